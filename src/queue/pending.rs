//! The calls waiting for the worker, and which one it runs next: the order rule alone.
//!
//! In issue order, the next call is the oldest. In priority order, it is the call of highest
//! priority (the oldest among equals) that no older waiting call shares a key with, so that
//! calls on one key run in issue order. A call with no keys is a fence that nothing passes.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::Key;

/// Calls waiting to run, and how many calls (waiting or running) name each key.
pub(super) struct Pending<T> {
    waiting: VecDeque<Waiting<T>>,
    /// Calls waiting or running, per key they name.
    busy: HashMap<Key, usize>,
    /// Calls taken by [`Pending::next`] and not yet [`Pending::done`].
    running: usize,
}

struct Waiting<T> {
    keys: Vec<Key>,
    priority: i32,
    item: T,
}

impl<T> Default for Pending<T> {
    fn default() -> Self {
        Pending {
            waiting: VecDeque::new(),
            busy: HashMap::new(),
            running: 0,
        }
    }
}

impl<T> Pending<T> {
    /// Queues a call on `keys` (each counted once, however often it is named).
    pub(super) fn push(&mut self, mut keys: Vec<Key>, priority: i32, item: T) {
        let mut seen = HashSet::new();
        keys.retain(|k| seen.insert(k.clone()));
        for k in &keys {
            *self.busy.entry(k.clone()).or_insert(0) += 1;
        }
        self.waiting.push_back(Waiting {
            keys,
            priority,
            item,
        });
    }

    /// Takes the call to run next (by the module docs' rule), with its keys for `done`.
    pub(super) fn next(&mut self, by_priority: bool) -> Option<(Vec<Key>, T)> {
        let at = if by_priority {
            self.first_by_priority()?
        } else {
            0
        };
        let w = self.waiting.remove(at)?;
        self.running += 1;
        Some((w.keys, w.item))
    }

    /// The index of the waiting call of highest priority that may run now.
    fn first_by_priority(&self) -> Option<usize> {
        let mut older: HashSet<&Key> = HashSet::new();
        let mut best: Option<(usize, i32)> = None;
        for (i, w) in self.waiting.iter().enumerate() {
            if w.keys.is_empty() {
                // A fence: it may run only as the oldest, and nothing younger may pass it.
                if i == 0 {
                    return Some(0);
                }
                break;
            }
            let free = w.keys.iter().all(|k| !older.contains(k));
            if free && best.is_none_or(|(_, p)| w.priority > p) {
                best = Some((i, w.priority));
            }
            older.extend(w.keys.iter());
        }
        best.map(|(i, _)| i)
    }

    /// Marks a call taken by [`Pending::next`] as finished.
    pub(super) fn done(&mut self, keys: &[Key]) {
        self.running = self.running.saturating_sub(1);
        for k in keys {
            if let Some(n) = self.busy.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.busy.remove(k);
                }
            }
        }
    }

    /// Whether a call on `key` is waiting or running.
    pub(super) fn is_busy(&self, key: &Key) -> bool {
        self.busy.contains_key(key)
    }

    /// Whether no call is waiting or running.
    pub(super) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::prelude::*;

    fn keys(ks: &[i32]) -> Vec<Key> {
        ks.iter().map(|&k| Key::Int(k)).collect()
    }

    /// Runs every queued call, one at a time, and gives their items in the order run.
    fn drain(p: &mut Pending<usize>, by_priority: bool) -> Vec<usize> {
        let mut order = Vec::new();
        while let Some((ks, item)) = p.next(by_priority) {
            p.done(&ks);
            order.push(item);
        }
        assert!(p.is_idle());
        order
    }

    #[test]
    fn issue_order_ignores_priorities() {
        let mut p = Pending::default();
        for (i, pr) in [0, 5, -3, 9].into_iter().enumerate() {
            p.push(keys(&[i as i32]), pr, i);
        }
        assert_eq!(drain(&mut p, false), vec![0, 1, 2, 3]);
    }

    #[test]
    fn priority_order_lets_no_call_pass_an_older_one_on_its_key() {
        let mut p = Pending::default();
        p.push(keys(&[1]), 0, 0); // push 1
        p.push(keys(&[2]), 0, 1); // push 2
        p.push(keys(&[1]), 9, 2); // pull 1: high, but after push 1
        p.push(keys(&[3]), 5, 3);
        p.push(keys(&[]), 100, 4); // a fence
        p.push(keys(&[5]), 50, 5);
        assert_eq!(drain(&mut p, true), vec![3, 0, 2, 1, 4, 5]);
    }

    #[test]
    fn busy_keys_are_counted_while_waiting_and_running() {
        let mut p = Pending::default();
        p.push(keys(&[1, 1, 2]), 0, 0);
        p.push(keys(&[2]), 0, 1);
        let (ks, _) = p.next(false).unwrap();
        assert_eq!(ks, keys(&[1, 2]));
        assert!(p.is_busy(&Key::Int(1)) && !p.is_idle());
        p.done(&ks);
        assert!(!p.is_busy(&Key::Int(1)) && p.is_busy(&Key::Int(2)));
        let (ks, _) = p.next(false).unwrap();
        assert!(p.waiting.is_empty() && !p.is_idle());
        p.done(&ks);
        assert!(p.is_idle() && !p.is_busy(&Key::Int(2)));
    }

    /// Against a reference written from the rule's words: random calls on few keys, with
    /// random priorities and fences, each call of the result checked to be allowed when it ran.
    #[test]
    fn random_queues_keep_per_key_order_and_run_the_highest_free_call() {
        let mut rng = StdRng::from_entropy();
        for _ in 0..200 {
            let n = rng.gen_range(1..30);
            let calls: Vec<(Vec<i32>, i32)> = (0..n)
                .map(|_| {
                    let k = if rng.gen_bool(0.1) {
                        0
                    } else {
                        rng.gen_range(1..4)
                    };
                    let ks = (0..k).map(|_| rng.gen_range(0..5)).collect();
                    (ks, rng.gen_range(-3..4))
                })
                .collect();
            let mut p = Pending::default();
            for (i, (ks, pr)) in calls.iter().enumerate() {
                p.push(keys(ks), *pr, i);
            }
            let order = drain(&mut p, true);
            let mut left: Vec<usize> = (0..n).collect();
            for &ran in &order {
                // Allowed: no older waiting call shares a key or is a fence, and it is a fence
                // only as the oldest; and no allowed call has a higher priority, or an equal one
                // and is older.
                let allowed = |c: usize| {
                    let older = left.iter().take_while(|&&o| o != c);
                    let mut older = older.peekable();
                    if calls[c].0.is_empty() {
                        return older.peek().is_none();
                    }
                    older.all(|&o| {
                        !calls[o].0.is_empty() && calls[o].0.iter().all(|k| !calls[c].0.contains(k))
                    })
                };
                assert!(
                    allowed(ran),
                    "call {ran} of {calls:?} ran too early: {order:?}"
                );
                for &c in &left {
                    if c != ran && allowed(c) && !calls[c].0.is_empty() {
                        let beats =
                            calls[c].1 > calls[ran].1 || (calls[c].1 == calls[ran].1 && c < ran);
                        assert!(!beats, "call {c} should have run before {ran}: {calls:?}");
                    }
                }
                left.retain(|&c| c != ran);
            }
            assert!(left.is_empty());
        }
    }
}

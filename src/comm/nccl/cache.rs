//! The communicator cache: one [`CommSet`] per sorted set of GPU ordinals, at most [`max_sets`]
//! of them (the least recently used idle set is destroyed), built before the store takes any
//! key lock ([`prepare`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::available;
use super::comm_set::CommSet;
use crate::backend::cuda;
use crate::config::nccl::{self as settings, force_single, max_sets};
use crate::{Key, Result};

/// The communicator cache.
#[derive(Default)]
pub(super) struct Cache {
    /// Device set -> its communicators and the tick of their last use.
    pub(super) sets: HashMap<Vec<usize>, (Arc<CommSet>, u64)>,
    /// Counts uses, for the LRU order.
    tick: u64,
}

/// The process's communicator cache, locked (for bookkeeping only: nothing blocks under it).
pub(super) fn cache() -> MutexGuard<'static, Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Drops `comms` from the cache, if it is still the cached set of `ordinals`.
pub(super) fn forget(ordinals: &[usize], comms: &Arc<CommSet>) {
    let mut c = cache();
    if c.sets
        .get(ordinals)
        .is_some_and(|(s, _)| Arc::ptr_eq(s, comms))
    {
        c.sets.remove(ordinals);
    }
}

/// Which of `entries` (key, last use, in use) to evict so that at most `cap` remain: the least
/// recently used first, never one in use (so more than `cap` may remain).
fn lru_victims<K: Clone>(entries: &[(K, u64, bool)], cap: usize) -> Vec<K> {
    let excess = entries.len().saturating_sub(cap);
    let mut idle: Vec<&(K, u64, bool)> = entries.iter().filter(|e| !e.2).collect();
    idle.sort_by_key(|e| e.1);
    idle.into_iter().take(excess).map(|e| e.0.clone()).collect()
}

/// The communicators of `ordinals` (ascending, distinct), from the cache or built (under no
/// lock), evicting the least recently used sets beyond [`max_sets`].
pub(super) fn get_set(ordinals: &[usize], keys: &[Key]) -> Result<Arc<CommSet>> {
    let cap = max_sets()?;
    {
        let mut c = cache();
        c.tick += 1;
        let tick = c.tick;
        if let Some((set, used)) = c.sets.get_mut(ordinals) {
            *used = tick;
            return Ok(set.clone());
        }
    }
    let op = "create NCCL communicator";
    let streams = ordinals.iter().map(|&o| Ok(cuda::gpu(o)?.stream().clone()));
    let streams = streams.collect::<Result<Vec<_>>>()?;
    let built = Arc::new(CommSet::init(ordinals, streams, op, keys)?);
    let (set, evicted) = {
        let mut c = cache();
        c.tick += 1;
        let tick = c.tick;
        // Another thread may have built the same set meanwhile: keep one.
        let set = c
            .sets
            .entry(ordinals.to_vec())
            .or_insert_with(|| (built.clone(), tick))
            .0
            .clone();
        let entries: Vec<(Vec<usize>, u64, bool)> = c
            .sets
            .iter()
            .map(|(k, (s, used))| {
                // Work in flight holds its set (`Pending::comms`), so a busy set counts more
                // than the cache's one reference.
                let in_use = k.as_slice() == ordinals || Arc::strong_count(s) > 1;
                (k.clone(), *used, in_use)
            })
            .collect();
        let evicted: Vec<Arc<CommSet>> = lru_victims(&entries, cap)
            .into_iter()
            .filter_map(|k| c.sets.remove(&k).map(|(s, _)| s))
            .collect();
        (set, evicted)
    };
    // Finalized and destroyed here, outside the cache lock (and `built`, if unused).
    drop(evicted);
    drop(built);
    Ok(set)
}

/// Builds, before a call takes its key locks, the communicators it will need: one per device
/// set of at least two GPUs (or one, with [`force_single`]). A bad `KVSTORE_NCCL_TIMEOUT_MS`
/// or `KVSTORE_NCCL_MAX_COMMS` fails it first, with an
/// [`Error::InvalidEnv`](crate::Error::InvalidEnv).
pub(crate) fn prepare(sets: &[Vec<usize>]) -> Result<()> {
    if !available() {
        return Ok(());
    }
    settings::check()?;
    for s in sets {
        if s.len() >= 2 || (s.len() == 1 && force_single()) {
            get_set(s, &[])?;
        }
    }
    Ok(())
}

/// The device sets whose communicators are cached (for tests of the LRU bound).
pub fn cached_sets() -> Vec<Vec<usize>> {
    let mut v: Vec<Vec<usize>> = cache().sets.keys().cloned().collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_least_recently_used_idle_sets() {
        let e = |k: u32, used: u64, busy: bool| (k, used, busy);
        // Within the bound: nothing goes.
        assert!(lru_victims(&[e(1, 5, false), e(2, 3, false)], 2).is_empty());
        // One over: the oldest idle one goes.
        assert_eq!(
            lru_victims(&[e(1, 5, false), e(2, 3, false), e(3, 9, false)], 2),
            vec![2]
        );
        // The oldest is in use: the next oldest goes instead.
        assert_eq!(
            lru_victims(&[e(1, 5, false), e(2, 3, true), e(3, 9, false)], 2),
            vec![1]
        );
        // Two over, in age order.
        assert_eq!(
            lru_victims(
                &[
                    e(1, 5, false),
                    e(2, 3, false),
                    e(3, 9, false),
                    e(4, 1, false)
                ],
                2
            ),
            vec![4, 2]
        );
        // Everything in use: the bound is exceeded rather than a set in use destroyed.
        assert!(lru_victims(&[e(1, 5, true), e(2, 3, true)], 1).is_empty());
    }
}

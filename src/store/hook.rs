//! The push hook: observes every key of every successful push, after the call's locks.

use std::sync::{Arc, RwLockWriteGuard};

use super::groups::{issue_order, Group};
use super::{write, Active, KvStore};
use crate::backend::HomeValue;
use crate::{Key, Result};

/// What a push hook sees: one key of an applied push ([`KvStore::set_push_hook`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PushEvent<'a> {
    /// The key.
    pub key: &'a Key,
    /// The key's step under the updater in force (pushes since it was set or loaded, this one
    /// included): Adam's `t`, a PTX updater's `step`. `None` for closures, which keep none.
    pub step: Option<u64>,
    /// The updater's [`name`](crate::Updater::name): `assign`, `sgd`, `adam`, ...
    pub updater: &'static str,
    /// How many arrays were summed for the key (over repeats of it in the call).
    pub values: usize,
}

/// A push hook: called once per key of every successful push. See [`KvStore::set_push_hook`].
pub type PushHook = dyn Fn(&PushEvent<'_>) + Send + Sync;

impl KvStore {
    /// Sets (replaces) a hook called after every successful push of any form, once per
    /// distinct key in the order the updater ran on them. It runs after the call's locks are
    /// released, so it may call the store; a panic in it reaches the caller of the applied push.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use kvstore::{Adam, Key, KvStore, NDArray, Updater};
    ///
    /// let kv = KvStore::create("local")?;
    /// kv.init_list(&[7, 2], &[NDArray::zeros([3]), NDArray::zeros([3])])?;
    /// kv.set_updater(Updater::Adam(Adam::default()))?;
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = seen.clone();
    /// kv.set_push_hook(move |e| log.lock().unwrap().push((e.key.clone(), e.step, e.updater)));
    /// let g = NDArray::ones([3]);
    /// kv.push_list(&[7, 2], &[&g, &g])?;
    /// kv.push(7, &g)?;
    /// assert_eq!(
    ///     *seen.lock().unwrap(),
    ///     [(Key::Int(2), Some(1), "adam"), (Key::Int(7), Some(1), "adam"), (Key::Int(7), Some(2), "adam")]
    /// );
    /// kv.clear_push_hook();
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn set_push_hook(&self, hook: impl Fn(&PushEvent<'_>) + Send + Sync + 'static) {
        *write(&self.hook) = Some(Arc::new(hook));
    }

    /// Removes the push hook, if one is set.
    pub fn clear_push_hook(&self) {
        *write(&self.hook) = None;
    }
}

/// Each group's key, step and value count in issue order, read under the cells' locks.
pub(super) fn pushed(
    groups: &[Group<'_>],
    steps: &[Option<u64>],
) -> Vec<(Key, Option<u64>, usize)> {
    issue_order(groups)
        .into_iter()
        .map(|i| (groups[i].slot.key.clone(), steps[i], groups[i].arrays.len()))
        .collect()
}

/// Each cell's step under the updater in force (`None` where it has no state for it).
pub(super) fn cell_steps(
    active: &Active,
    cells: &[RwLockWriteGuard<'_, HomeValue>],
) -> Vec<Option<u64>> {
    cells.iter().map(|c| c.step(active.generation)).collect()
}

/// Calls the push hook once per key of a push that succeeded.
pub(super) fn call_hook(
    hook: Option<&PushHook>,
    active: &Active,
    done: Option<Vec<(Key, Option<u64>, usize)>>,
) -> Result<()> {
    if let (Some(hook), Some(done)) = (hook, done) {
        for (key, step, values) in &done {
            hook(&PushEvent {
                key,
                step: *step,
                updater: active.updater.name(),
                values: *values,
            });
        }
    }
    Ok(())
}

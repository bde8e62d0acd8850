//! Test hooks of loads (cargo feature `test-util`): a function run at each stage of a load.

use std::cell::RefCell;

/// Where a [`set_load_hook`] hook runs inside [`KvStore::load`](crate::KvStore::load).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadStage {
    /// The file is read and checked against the updater in force; the store is unchanged.
    Checked,
    /// The file's keys are in the store, with their values and state; the load returns next.
    Applied,
}

type LoadHook = Box<dyn FnMut(LoadStage)>;

thread_local! {
    /// Test hook: runs at each [`LoadStage`] of the loads of this thread.
    static LOAD_HOOK: RefCell<Option<LoadHook>> = const { RefCell::new(None) };
}

/// Test hook: runs `hook` at each [`LoadStage`] of every later `load` on the calling thread, with
/// no lock of the store held (`None` turns it off). For tests of loads that race other calls.
#[cfg(feature = "test-util")]
pub fn set_load_hook(hook: Option<Box<dyn FnMut(LoadStage)>>) {
    LOAD_HOOK.with(|h| *h.borrow_mut() = hook);
}

/// Runs the calling thread's [`set_load_hook`] hook, if any, at `stage`.
pub(crate) fn run_load_hook(stage: LoadStage) {
    // Taken out while it runs, so a hook that loads does not run itself.
    let Some(mut hook) = LOAD_HOOK.with(|h| h.borrow_mut().take()) else {
        return;
    };
    hook(stage);
    LOAD_HOOK.with(|h| {
        let mut slot = h.borrow_mut();
        if slot.is_none() {
            *slot = Some(hook);
        }
    });
}

//! Updater state in host memory: host homes, and GPU keys without a kernel (`float64`).

use crate::host::HostData;

/// Updater state of one key.
pub(crate) struct State {
    /// Which `set_updater` call it belongs to; another updater starts afresh.
    pub generation: u64,
    /// Pushes applied so far (Adam's `t`).
    pub step: u64,
    /// One buffer per name in `Updater::state_names`, in the accumulator dtype.
    pub bufs: Vec<HostData>,
}

//! [`Entry`]: one key whole, as host copies, as a store exports it for the test hooks that
//! write checkpoints of a chosen layout.

use crate::{HostData, Key, Shape};

/// A key's value and updater state as host copies: what a single-file checkpoint holds.
pub(crate) struct Entry {
    /// The key.
    pub key: Key,
    /// The whole value's shape.
    pub shape: Shape,
    /// The whole value.
    pub value: HostData,
    /// The state kept for the updater in force, if the key has any.
    pub state: Option<EntryState>,
    /// Whether the key is row-sparse.
    pub row_sparse: bool,
    /// Gradient compression's residuals, one per position in a push's list of values.
    pub residuals: Vec<Vec<f32>>,
}

/// A key's updater state.
pub(crate) struct EntryState {
    /// The step count.
    pub step: u64,
    /// One buffer per state name, in the updater's order.
    pub bufs: Vec<HostData>,
}

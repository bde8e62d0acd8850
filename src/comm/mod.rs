//! Comm: moving sums and copies between places.
//!
//! - [`nccl`]: NCCL between this process's GPUs: communicators per device set, grouped reduce
//!   and broadcast, async-error polling with a timeout, and abort.
//!
//! It imports `backend` (memory, streams, kernels) and nothing from `store`.

pub mod nccl;

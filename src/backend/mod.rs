//! Backends: where values live and how loops over them run.
//!
//! - [`cpu`]: fused loops over host memory; the fallback for every store kind.
//! - [`probe`]: which GPUs this process can use, found without ever panicking.

pub mod cpu;
pub mod kernels;
pub mod probe;

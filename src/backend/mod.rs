//! Backends: memory and kernels, where values live and how loops over them run.
//!
//! - [`cpu`]: fused loops over host memory; the fallback for every store kind.
//! - [`cuda`]: the GPU runtime (one stream per GPU, PTX modules, fused launches) and the
//!   push and pull paths of GPU homes.
//! - [`probe`]: which GPUs this process can use, found without ever panicking.

pub mod cpu;
pub mod cuda;
pub mod probe;

//! The CUDA backend: GPU memory and kernels, the mirror of [`cpu`](super::cpu).
//!
//! - `runtime`: one context and one stream per GPU, PTX modules, device buffers, copies, and
//!   the fused multi-tensor launch.
//! - [`kernels`]: the hand-written PTX kernels and their launch ABI.
//! - `home`: the push (fused sum and update) and pull of keys whose home is a GPU.
//!
//! It imports nothing above `backend`; cudarc is used only here (and by the NCCL wrapper in
//! `comm`).

pub(crate) mod home;
pub mod kernels;
mod runtime;

pub(crate) use runtime::{
    alloc_zeros, clone_dtoh, clone_htod, cross_gpu_order, cuda_err, gpu, host_wait, launch_fused,
    launch_user, set_host_wait, stream_wait, synchronize_all, Gpu, GpuBuf, Record, UserLaunch,
};

//! The CUDA backend: GPU memory and kernels, the mirror of [`cpu`](super::cpu).
//!
//! - `runtime`: a context and stream per GPU, PTX modules, buffers, copies, the fused launch.
//! - [`kernels`]: the hand-written PTX kernels and their launch ABI.
//! - `copies`: many device copies, or downloads, of one call in O(1) driver calls per GPU.
//! - `push`, `pull` and `state`: keys homed on a GPU, file for file as in `cpu`.
//!
//! How data travels between GPUs is `comm`'s decision, handed in as [`CrossGpu`]. cudarc is
//! used only here and by `comm`'s NCCL wrapper.

mod copies;
pub mod kernels;
pub(crate) mod pull;
pub(crate) mod push;
mod runtime;
pub(crate) mod state;

pub use copies::BATCH_COPY_MAX_BYTES;
pub(crate) use copies::{copy_many, download_many, DeviceCopy};
/// Element type checks for the fast path: every dtype but f64 has a PTX kernel.
pub(crate) use kernels::has_kernels as has_kernel;
pub(crate) use runtime::{
    alloc_zeros, clone_dtoh, clone_htod, copy_device, cross_gpu_order, cuda_err, gpu,
    host_data_bytes, host_wait, launch_fused, launch_user, set_host_wait, stream_wait,
    synchronize_all, Gpu, GpuBuf, GpuPtr, Record, UserLaunch,
};
pub use runtime::{cuda_stream, gpu_sm};

use crate::{DType, Error, Key, Result};

/// One key's partial sums on GPUs other than its home, to be brought to the home.
pub(crate) struct PartialSum<'a> {
    pub key: &'a Key,
    pub home: usize,
    pub dtype: DType,
    pub n: usize,
    /// The home addresses the update kernel sums; the links add the ones they fill.
    pub inputs: &'a mut Vec<u64>,
    /// At most one partial sum per other GPU.
    pub parts: &'a [GpuPtr],
}

/// One key of a pull: its value on the home, and the first out to fill on each GPU.
pub(crate) struct Fanout<'a> {
    pub key: &'a Key,
    pub dtype: DType,
    pub n: usize,
    pub src: GpuPtr,
    /// Sorted by ordinal, one per GPU.
    pub firsts: Vec<GpuPtr>,
}

/// How data travels between this process's GPUs (NCCL or peer copies: `comm` implements it).
pub(crate) trait CrossGpu {
    /// Brings each key's partial sums home (scratch kept in `keep`), adding them to its inputs.
    fn sum_to_homes(&self, sums: Vec<PartialSum<'_>>, keep: &mut Vec<GpuBuf>) -> Result<()>;

    /// Copies each key's value from its home into its first out on every GPU.
    fn fan_out(&self, fanouts: &[Fanout<'_>]) -> Result<()>;
}

/// Names `key` in an error.
pub(crate) fn with_key(key: &Key) -> impl FnOnce(Error) -> Error + '_ {
    move |e| e.with_key(key)
}

//! A tensor key-value store for data-parallel training, with the semantics of MXNet's KVStore.
//!
//! - [`KvStore::init`] puts a tensor in under a key.
//! - [`KvStore::push`] sends values from any number of devices; they are summed and merged into
//!   the stored value by the store's [`Updater`].
//! - [`KvStore::pull`] copies the stored value out to any number of arrays.
//!
//! ```
//! use kvstore::{cpu, KvStore, NDArray, Updater};
//!
//! let kv = KvStore::create("local")?;
//! kv.init(3, &(NDArray::ones([2, 3]) * 2.0))?;
//! let a = NDArray::zeros([2, 3]);
//! kv.pull(3, &a)?;
//! assert_eq!(a.to_vec::<f32>()?, vec![2.0; 6]);
//!
//! // Values from four devices are summed, then assigned.
//! let b: Vec<NDArray> = (0..4).map(|i| NDArray::ones([2, 3]).to_device(cpu(i))).collect::<Result<_, _>>()?;
//! kv.push(3, &b)?;
//! kv.pull(3, &a)?;
//! assert_eq!(a.to_vec::<f32>()?, vec![4.0; 6]);
//!
//! // A custom updater: stored += input * 2.
//! kv.set_updater(Updater::custom(|_key, input, stored| *stored += input * 2.0))?;
//! kv.push(3, &NDArray::ones([2, 3]))?;
//! kv.pull(3, &a)?;
//! assert_eq!(a.to_vec::<f32>()?, vec![6.0; 6]);
//! # Ok::<(), kvstore::Error>(())
//! ```

#![warn(missing_docs)]
// Test and bench support (`__internal`) is what uses, and reaches, some items of the
// transports and the backend; without the `test-util` feature they are unused, not dead.
#![cfg_attr(
    not(feature = "test-util"),
    allow(dead_code, unused_imports, unreachable_pub)
)]

mod backend;
pub mod checkpoint;
mod checkpoint_error;
mod comm;
mod compress;
mod config;
mod device;
mod dtype;
mod error;
mod host;
mod interop;
mod key;
mod memcopy;
mod ndarray;
mod ptx_text;
mod queue;
mod row_sparse;
mod shape;
mod store;
mod updater;

pub use checkpoint_error::CheckpointErrorKind;
pub use compress::Compression;
pub use device::{cpu, gpu, Device};
pub use dtype::{DType, Element};
pub use error::{BoxError, Error, Result};
#[doc(hidden)]
pub use host::HostData;
/// candle tensors in init, push and pull (cargo feature `candle`).
#[cfg(feature = "candle")]
pub use interop::candle;
pub use interop::cuda::{cuda_stream, LentGpuArray};
pub use key::{IntoKey, Key, KeyKind};
pub use ndarray::NDArray;
pub use queue::{AsyncKvStore, CallSpan};
pub use row_sparse::RowSparse;
pub use shape::{Shape, MAX_NDIM};
pub use store::{IntoStoreKind, KvStore, PushEvent, PushHook, StoreKind, ValueList};
pub use updater::{
    Adam, CustomUpdater, Decay, LrScheduler, PtxUpdater, Sgd, UpdateFn, Updater, Warmup,
    WarmupMode, PTX_UPDATER_BLOCK, PTX_UPDATER_MAX_BLOCKS, PTX_UPDATER_PARAMS,
};

/// The number of CUDA GPUs this process can use (0 without libcuda or a GPU), found once.
///
/// ```
/// let n = kvstore::gpu_count();
/// println!("{n} GPUs");
/// ```
pub fn gpu_count() -> usize {
    backend::probe::gpu_count()
}

/// Test and bench support (cargo feature `test-util`), not part of the API.
#[cfg(feature = "test-util")]
#[doc(hidden)]
pub mod __internal {
    pub use crate::backend::cuda::gpu_sm;
    pub use crate::backend::cuda::kernels;
    pub use crate::backend::cuda::BATCH_COPY_MAX_BYTES;
    pub use crate::backend::{cpu, probe};
    /// The MPI transport of `dist_*` stores.
    #[cfg(feature = "mpi")]
    pub use crate::comm::mpi;
    pub use crate::comm::nccl;
    pub use crate::config::bigarray_bound;
}

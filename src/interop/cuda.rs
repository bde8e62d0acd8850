//! GPU memory of another library lent to the store without a copy: [`LentGpuArray`].

pub use crate::backend::cuda::cuda_stream;
use crate::backend::cuda::GpuBuf;
use crate::ndarray::Storage;
use crate::{DType, HostData, NDArray, Result, Shape};

/// Another library's GPU memory (a PyTorch or CuPy tensor, a DLPack capsule), seen as an
/// [`NDArray`] on `gpu(ordinal)` without a copy until this value is dropped.
///
/// The store reads it (init, push) or writes it (pull) with work on its own stream for that
/// GPU, [`cuda_stream`]. Two orders are the lender's to keep, as DLPack's handshake asks:
/// - **before**: the owner's work that writes the memory (or, for a pull out, reads it) is
///   ordered before the store's stream: `__dlpack__(stream=cuda_stream(i))` does it.
/// - **after**: the owner does not reuse, write or free the memory until the store's stream
///   has run the lend's work: make its stream wait on the store's (PyTorch:
///   `torch.cuda.current_stream().wait_stream(torch.cuda.ExternalStream(s))` and
///   `tensor.record_stream(...)`), or wait for the store ([`crate::KvStore::wait_all`]).
///
/// ```no_run
/// # fn main() -> kvstore::Result<()> {
/// use kvstore::{gpu, DType, KvStore, LentGpuArray};
/// let kv = KvStore::create("device")?;
/// # let (key, ptr) = (3, 0u64);
/// // `ptr`: 1024 float32 elements on gpu(0), allocated by another library.
/// // SAFETY: the memory stays allocated, and unused by its owner, until the store's stream
/// // has run the push (the wait_all below).
/// let grad = unsafe { LentGpuArray::new(ptr, 0, DType::F32, [1024]) }?;
/// kv.push(key, grad.array())?;
/// drop(grad);
/// kv.wait_all()?;
/// # Ok(())
/// # }
/// ```
pub struct LentGpuArray {
    array: NDArray,
}

impl LentGpuArray {
    /// Lends `shape.size()` elements of `dtype`, in row-major order, at device address `ptr`
    /// on GPU `ordinal`: [`Error::ForeignMemory`](crate::Error::ForeignMemory) unless the
    /// driver finds the first and last byte there, aligned to the element.
    ///
    /// # Safety
    /// - The memory stays allocated until this value is dropped and the store's stream for
    ///   `ordinal` has run the work queued on it meanwhile.
    /// - While it is lent, the owner does not touch the memory out of order with the store's
    ///   stream (the two orders above).
    /// - No clone of [`LentGpuArray::array`] outlives this value (one that does gets a copy;
    ///   if the copy fails, the process aborts rather than free memory not the store's).
    pub unsafe fn new(
        ptr: u64,
        ordinal: usize,
        dtype: DType,
        shape: impl Into<Shape>,
    ) -> Result<LentGpuArray> {
        let shape = shape.into();
        // SAFETY: the caller's contract above is `borrow_foreign`'s: the memory outlives the
        // buffer, which `Drop` gives up with `leak`.
        let buf = unsafe { GpuBuf::borrow_foreign(ordinal, dtype, ptr, shape.size())? };
        Ok(LentGpuArray {
            array: NDArray::from_gpu(buf, shape),
        })
    }

    /// The lent memory as an array, to pass to the store's calls.
    pub fn array(&self) -> &NDArray {
        &self.array
    }
}

impl Drop for LentGpuArray {
    fn drop(&mut self) {
        let kept = self.array.handles() > 1;
        let mut storage = self.array.write();
        let replacement = match &*storage {
            Storage::Gpu(b) if kept => match b.copy_to(b.ordinal()) {
                Ok(own) => Storage::Gpu(own),
                Err(e) => {
                    eprintln!(
                        "kvstore: a clone of a lent GPU array outlived the lend, and copying it \
                         failed ({e}); aborting rather than letting it free memory that is not \
                         the store's"
                    );
                    std::process::abort();
                }
            },
            _ => Storage::Host(HostData::filled(self.array.dtype(), 0, 0.0)),
        };
        if let Storage::Gpu(b) = std::mem::replace(&mut *storage, replacement) {
            b.leak();
        }
    }
}

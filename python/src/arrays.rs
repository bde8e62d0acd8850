//! Arrays from Python: DLPack capsules read into kvstore [`NDArray`]s, and kvstore arrays
//! written back into the memory of a capsule (a pull's `out`).
//!
//! The Python side (`kvstore/_arrays.py`) negotiates `__dlpack__` with the producer. Capsules of
//! host memory are read and written here element by element, contiguous or strided, in any of
//! kvstore's dtypes. Capsules of CUDA memory (contiguous PyTorch tensors, exported with the
//! store's stream) are lent to the store in place ([`LentGpuArray`]): nothing is copied.

use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDeviceType};
use dlpark::python::ImportedDlpack;
use dlpark::TensorRef;
use half::{bf16, f16};
use kvstore::{DType, LentGpuArray, NDArray, Shape};
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;

/// A Python array imported through DLPack: the owning capsule contents. Dropping it calls the
/// producer's deleter, which releases the producer's reference to its buffer.
pub struct Imported {
    /// The memory lent to the store, for a CUDA array. Declared first, so it is dropped (and
    /// the lend ended) before the capsule's deleter lets the producer's buffer go.
    lent: Option<LentGpuArray>,
    tensor: ImportedDlpack,
    dtype: DType,
    shape: Shape,
}

/// DLPack's device type of CUDA device memory (`kDLCUDA`).
const DL_CUDA: DLDeviceType = DLDeviceType(2);

// Imported only holds dlpark's `Managed` tensors, which dlpark declares `Send + Sync`; the
// struct is moved into `Python::detach` closures so copies run without the GIL.

/// Imports one DLPack capsule (or any object with `__dlpack__`): host memory, or contiguous CUDA
/// memory, which is lent to the store on its GPU.
pub fn import(obj: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let tensor = dlpark::python::from_dlpack(obj.as_borrowed(), None, None)?;
    let view = tensor
        .validate()
        .map_err(|e| PyValueError::new_err(format!("invalid DLPack tensor: {e}")))?;
    let device = view.device();
    let dtype = dtype_of(view.dtype())?;
    let dims: Vec<usize> = view.shape().iter().map(|&d| d as usize).collect();
    let shape = Shape::try_from(dims.as_slice()).map_err(crate::errors::to_py)?;
    let lent = match device.device_type {
        DLDeviceType::CPU | DLDeviceType::CUDAHOST => None,
        DL_CUDA => {
            let strides = view.strides_or_compact().unwrap_or_default();
            if !row_major(view.shape(), &strides) {
                return Err(PyTypeError::new_err(
                    "kvstore lends CUDA arrays in place only when their elements are \
                     contiguous (row-major): pass tensor.contiguous()",
                ));
            }
            // SAFETY: validated above; DLPack's `data + byte_offset` is the first element.
            let ptr = unsafe { view.offset_bytes_ptr() }
                .map_err(|e| PyValueError::new_err(format!("invalid DLPack tensor: {e}")))?;
            // SAFETY: the capsule, owned by the `Imported` built below, keeps the producer's
            // buffer alive until after the lend ends (`lent` is dropped first); the Python
            // side exported it with the store's stream (the producer's work on it is ordered
            // before the store's) and orders the producer's later use after the store's
            // stream (`kvstore/_arrays.py`); no clone of the array outlives the call.
            let lent =
                unsafe { LentGpuArray::new(ptr as u64, device.device_id as usize, dtype, shape) }
                    .map_err(crate::errors::to_py)?;
            Some(lent)
        }
        other => {
            return Err(PyTypeError::new_err(format!(
                "kvstore reads and writes host memory and CUDA memory through DLPack, but this \
                 array is on DLPack device type {}: copy it to the CPU first",
                other.0
            )))
        }
    };
    Ok(Imported {
        lent,
        tensor,
        dtype,
        shape,
    })
}

/// Whether `strides` (in elements) lay `shape` out in row-major order with no gaps. The stride
/// of a dimension of size 0 or 1 does not matter (torch exports such strides as 1, whatever
/// the tensor's own).
fn row_major(shape: &[i64], strides: &[i64]) -> bool {
    let mut next = 1i64;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d > 1 && s != next {
            return false;
        }
        next = next.saturating_mul(d);
    }
    true
}

/// kvstore's dtype for a DLPack dtype; a `TypeError` naming the supported ones otherwise.
fn dtype_of(t: DLDataType) -> PyResult<DType> {
    let dtype = match (t.code, t.bits, t.lanes) {
        (DLDataTypeCode::FLOAT, 32, 1) => Some(DType::F32),
        (DLDataTypeCode::FLOAT, 64, 1) => Some(DType::F64),
        (DLDataTypeCode::FLOAT, 16, 1) => Some(DType::F16),
        (DLDataTypeCode::BFLOAT, 16, 1) => Some(DType::BF16),
        _ => None,
    };
    dtype.ok_or_else(|| {
        PyTypeError::new_err(format!(
            "unsupported array dtype (DLPack code {}, {} bits, {} lanes): kvstore holds float32, \
             float64, float16 and bfloat16; convert the array first, e.g. a.astype(numpy.float32)",
            t.code.0, t.bits, t.lanes
        ))
    })
}

impl Imported {
    /// A kvstore array holding the elements: the lent memory itself for a CUDA array, else a
    /// copy on `cpu(0)` (one pass over memory).
    pub fn to_ndarray(&self) -> PyResult<NDArray> {
        if let Some(lent) = &self.lent {
            return Ok(lent.array().clone());
        }
        let view = self.view()?;
        let array = match self.dtype {
            DType::F32 => NDArray::from_vec(gather::<f32>(&view)?, self.shape),
            DType::F64 => NDArray::from_vec(gather::<f64>(&view)?, self.shape),
            DType::F16 => NDArray::from_vec(gather::<f16>(&view)?, self.shape),
            DType::BF16 => NDArray::from_vec(gather::<bf16>(&view)?, self.shape),
        };
        array.map_err(crate::errors::to_py)
    }

    /// A kvstore array of this array's shape and dtype, for a pull to write into before
    /// [`Imported::write_from`] copies it here: zeros, or the lent memory itself for a CUDA
    /// array.
    pub fn scratch(&self) -> PyResult<NDArray> {
        if let Some(lent) = &self.lent {
            return Ok(lent.array().clone());
        }
        let n = self.shape.size();
        let array = match self.dtype {
            DType::F32 => NDArray::from_vec(vec![0f32; n], self.shape),
            DType::F64 => NDArray::from_vec(vec![0f64; n], self.shape),
            DType::F16 => NDArray::from_vec(vec![f16::ZERO; n], self.shape),
            DType::BF16 => NDArray::from_vec(vec![bf16::ZERO; n], self.shape),
        };
        array.map_err(crate::errors::to_py)
    }

    /// Checks that this array may be written: a read-only capsule is an error.
    pub fn check_writable(&mut self) -> PyResult<()> {
        let writable = match &mut self.tensor {
            ImportedDlpack::Legacy(t) => t.validate_mut().map(|_| ()),
            ImportedDlpack::Versioned(t) => t.validate_mut().map(|_| ()),
        };
        writable.map_err(|e| {
            PyBufferError::new_err(format!(
                "pull needs a writable out array, but DLPack says: {e}; pass a writable array \
                 (for NumPy: a.copy(), or a.setflags(write=True) where allowed)"
            ))
        })
    }

    /// Copies `src` (this array's shape and dtype) into this array's memory; nothing for a
    /// CUDA array, which the store wrote in place. The caller has called
    /// [`Imported::check_writable`].
    pub fn write_from(&self, src: &NDArray) -> PyResult<()> {
        if self.lent.is_some() {
            return Ok(());
        }
        let view = self.view()?;
        match self.dtype {
            DType::F32 => scatter(&view, &host_vec::<f32>(src)?),
            DType::F64 => scatter(&view, &host_vec::<f64>(src)?),
            DType::F16 => scatter(&view, &host_vec::<f16>(src)?),
            DType::BF16 => scatter(&view, &host_vec::<bf16>(src)?),
        }
    }

    fn view(&self) -> PyResult<TensorRef<'_>> {
        self.tensor
            .validate()
            .map_err(|e| PyValueError::new_err(format!("invalid DLPack tensor: {e}")))
    }
}

/// The elements of a kvstore array as a vector of `T`.
fn host_vec<T: kvstore::Element>(a: &NDArray) -> PyResult<Vec<T>> {
    a.to_vec::<T>().map_err(crate::errors::to_py)
}

/// The element offsets (in elements, from the first element) of a tensor's elements in
/// row-major order, visited by `f` with the running index. `strides` are in elements, as DLPack
/// gives them; they may be zero or negative.
fn for_each_offset(shape: &[i64], strides: &[i64], mut f: impl FnMut(usize, isize)) {
    let n: i64 = shape.iter().product();
    if n <= 0 {
        return;
    }
    let ndim = shape.len();
    let mut index = vec![0i64; ndim];
    let mut offset: isize = 0;
    for i in 0..n as usize {
        f(i, offset);
        // Odometer step over the last axis first.
        for axis in (0..ndim).rev() {
            index[axis] += 1;
            offset += strides[axis] as isize;
            if index[axis] < shape[axis] {
                break;
            }
            offset -= (strides[axis] * shape[axis]) as isize;
            index[axis] = 0;
        }
    }
}

/// Copies a host tensor's elements out, in row-major order.
fn gather<T: Copy>(view: &TensorRef<'_>) -> PyResult<Vec<T>> {
    let n = view.num_elements();
    let mut out = Vec::<T>::with_capacity(n);
    if n == 0 {
        return Ok(out);
    }
    let base = base_ptr::<T>(view)?;
    let compact = view.is_compact().unwrap_or(false);
    if compact {
        // SAFETY: a compact tensor is `n` consecutive elements from `base` (DLPack's contract
        // for the exported buffer); `out` has capacity for `n` and they cannot overlap, since
        // `out` was just allocated. Copying bytes makes no alignment assumption.
        unsafe {
            std::ptr::copy_nonoverlapping(
                base.cast::<u8>(),
                out.as_mut_ptr().cast::<u8>(),
                n * std::mem::size_of::<T>(),
            );
            out.set_len(n);
        }
        return Ok(out);
    }
    let strides = view.strides_or_compact().unwrap_or_default().into_owned();
    for_each_offset(view.shape(), &strides, |_, off| {
        // SAFETY: every offset visited is within the producer's strided buffer (shape and
        // strides describe it, per DLPack); `read_unaligned` needs no alignment.
        out.push(unsafe { base.offset(off).read_unaligned() });
    });
    Ok(out)
}

/// The address of a host tensor's first element (`data + byte_offset`), typed as `T` but
/// possibly unaligned: every access through it is a byte copy or an unaligned read or write.
fn base_ptr<T>(view: &TensorRef<'_>) -> PyResult<*const T> {
    // SAFETY: the tensor was validated at import, is in host memory (checked there), and its
    // capsule, owned by the `Imported` that `view` borrows, keeps the memory alive; DLPack
    // guarantees that `data + byte_offset` lies within the producer's allocation.
    let p = unsafe { view.offset_bytes_ptr() }
        .map_err(|e| PyValueError::new_err(format!("invalid DLPack tensor: {e}")))?;
    Ok(p.cast::<T>())
}

/// Writes `src` (row-major) into a host tensor's elements.
fn scatter<T: Copy>(view: &TensorRef<'_>, src: &[T]) -> PyResult<()> {
    let n = view.num_elements();
    if n != src.len() {
        return Err(PyValueError::new_err(format!(
            "internal error: {} elements for an out of {n}; please report this bug",
            src.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    // The tensor is writable: `check_writable` was called on its owner.
    let base = base_ptr::<T>(view)?.cast_mut();
    if view.is_compact().unwrap_or(false) {
        // SAFETY: the tensor's `n` elements are consecutive from `base`; `src` is our own
        // vector, so they do not overlap. Copying bytes makes no alignment assumption.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr().cast::<u8>(),
                base.cast::<u8>(),
                std::mem::size_of_val(src),
            );
        }
        return Ok(());
    }
    let strides = view.strides_or_compact().unwrap_or_default().into_owned();
    for_each_offset(view.shape(), &strides, |i, off| {
        // SAFETY: the offset is within the producer's strided buffer; writes go through a raw
        // pointer (no references), so elements aliased by zero strides are simply overwritten.
        unsafe { base.offset(off).write_unaligned(src[i]) };
    });
    Ok(())
}

//! A Python function as the store's updater: `update(key, input, stored)`, called with NumPy
//! arrays that it may change in place, as MXNet's `kv._set_updater` calls it.

use half::f16;
use kvstore::{BoxError, DType, Key, NDArray, Updater};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyTuple};

/// An [`Updater`] that calls `trampoline(user_fn, key, input, stored, shape, dtype)`.
///
/// `input` and `stored` are `bytearray`s holding the elements in row-major order, and `dtype`
/// is the NumPy name of their element type: `kvstore._updater.call` views them as NumPy arrays
/// and calls `user_fn(key, input, stored)`. Whatever it leaves in `stored` becomes the key's
/// value. bfloat16 keys, which NumPy lacks, are handed over as float32 and rounded back.
///
/// The push that runs it holds no GIL (the binding releases it around store calls), so taking
/// it here cannot deadlock against another Python thread calling the store. The function must
/// not call the store it is set on: the key's lock is held while it runs.
///
/// `identity` names the function for the workers of a dist store to compare (see
/// `kvstore._updater.identity`): every Python updater is this one closure to Rust.
pub fn python_updater(trampoline: Py<PyAny>, user_fn: Py<PyAny>, identity: &str) -> Updater {
    Updater::try_custom_labeled(identity, move |key, input, stored| {
        Python::attach(|py| -> Result<(), BoxError> {
            let key_obj = match key {
                Key::Int(k) => k.into_pyobject(py)?.into_any(),
                Key::Str(s) => s.into_pyobject(py)?.into_any(),
                // A key kind added to kvstore later: hand over its text.
                #[allow(unreachable_patterns)]
                other => other.to_string().into_pyobject(py)?.into_any(),
            };
            let shape = PyTuple::new(py, stored.shape().dims())?;
            let new = match stored.dtype() {
                DType::F32 | DType::BF16 => {
                    call::<f32>(py, &trampoline, &user_fn, key_obj, input, stored, shape)?
                }
                DType::F64 => {
                    call::<f64>(py, &trampoline, &user_fn, key_obj, input, stored, shape)?
                }
                DType::F16 => {
                    call::<f16>(py, &trampoline, &user_fn, key_obj, input, stored, shape)?
                }
            };
            let new = if new.dtype() == stored.dtype() {
                new
            } else {
                new.astype(stored.dtype())?
            };
            *stored = new;
            Ok(())
        })
    })
}

/// A plain element type whose bytes are handed to Python: `f32`, `f64` or `f16`.
trait Plain: kvstore::Element + Copy + Default {
    /// NumPy's name for it.
    const NUMPY: &'static str;
}
impl Plain for f32 {
    const NUMPY: &'static str = "float32";
}
impl Plain for f64 {
    const NUMPY: &'static str = "float64";
}
impl Plain for f16 {
    const NUMPY: &'static str = "float16";
}

/// Calls the Python updater with `input` and `stored` as `T` elements; returns the new value.
fn call<T: Plain>(
    py: Python<'_>,
    trampoline: &Py<PyAny>,
    user_fn: &Py<PyAny>,
    key: Bound<'_, PyAny>,
    input: &NDArray,
    stored: &NDArray,
    shape: Bound<'_, PyTuple>,
) -> Result<NDArray, BoxError> {
    let input_bytes = PyByteArray::new(py, as_bytes(&input.to_vec::<T>()?));
    let stored_bytes = PyByteArray::new(py, as_bytes(&stored.to_vec::<T>()?));
    trampoline.call1(
        py,
        (user_fn, key, &input_bytes, &stored_bytes, shape, T::NUMPY),
    )?;
    let n = stored.size();
    if stored_bytes.len() != n * std::mem::size_of::<T>() {
        return Err(format!(
            "the updater resized the stored buffer to {} bytes; change `stored` in place \
             (stored += ..., stored[:] = ...) instead",
            stored_bytes.len()
        )
        .into());
    }
    let mut out = vec![T::default(); n];
    // SAFETY: we hold the GIL and run no Python code while the bytes are borrowed, so nothing
    // can resize or free the bytearray; its length was checked to be `n` elements of `T`, and
    // `out` is our own vector of `n` elements (byte copy: no alignment assumed).
    unsafe {
        let bytes = stored_bytes.as_bytes();
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), bytes.len());
    }
    Ok(NDArray::from_vec_on(out, stored.shape(), stored.device())?)
}

/// The bytes of a slice of plain floats.
fn as_bytes<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is f32, f64 or f16 (sealed by `Plain`'s impls): plain data with no padding
    // and no invalid bit patterns for `u8`; the byte slice covers exactly `v`'s memory and
    // borrows it for the same lifetime.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

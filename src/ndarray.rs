//! [`NDArray`]: a dense tensor with a shape, a dtype and a device.

use std::borrow::Cow;
use std::fmt;
use std::ops::{Add, AddAssign, Mul, MulAssign, Neg, Sub, SubAssign};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::backend::cuda::GpuBuf;
use crate::backend::probe::check_device;
use crate::host::{convert_into, with_host, HostData};
use crate::{DType, Device, Element, Error, Result, Shape};

/// Where an array's elements are.
#[derive(Debug)]
pub(crate) enum Storage {
    /// Host memory (every `cpu(i)` device).
    Host(HostData),
    /// Memory on GPU `gpu(i)`, with that GPU's stream (the buffer knows both).
    Gpu(GpuBuf),
}

impl Storage {
    /// The elements as host data: borrowed, or copied from a GPU (after its stream).
    pub(crate) fn host(&self) -> Result<Cow<'_, HostData>> {
        match self {
            Storage::Host(h) => Ok(Cow::Borrowed(h)),
            Storage::Gpu(b) => Ok(Cow::Owned(b.download()?)),
        }
    }
}

/// A dense tensor: a shape, a dtype, a device and the elements.
///
/// An `NDArray` is a handle, like MXNet's: `clone()` is cheap and the clone shares the elements,
/// so a store that pulls into one handle is seen through every clone. [`NDArray::copy`] makes an
/// independent copy. The shape, dtype and device of a handle never change.
///
/// ```
/// use kvstore::NDArray;
/// let a = NDArray::ones([2, 3]) * 2.0;
/// assert_eq!(a.to_vec::<f32>().unwrap(), vec![2.0; 6]);
/// println!("{a}"); // [[2. 2. 2.]
///                  //  [2. 2. 2.]]
/// ```
#[derive(Clone)]
pub struct NDArray {
    data: Arc<RwLock<Storage>>,
    shape: Shape,
    dtype: DType,
    device: Device,
}

impl NDArray {
    /// Wraps host data, which must hold `shape.size()` elements, on the CPU device `device`.
    pub(crate) fn from_host(data: HostData, shape: Shape, device: Device) -> NDArray {
        debug_assert_eq!(data.len(), shape.size());
        debug_assert!(!device.is_gpu());
        NDArray {
            dtype: data.dtype(),
            data: Arc::new(RwLock::new(Storage::Host(data))),
            shape,
            device,
        }
    }

    /// Wraps a GPU buffer of `shape.size()` elements.
    pub(crate) fn from_gpu(buf: GpuBuf, shape: Shape) -> NDArray {
        debug_assert_eq!(buf.len(), shape.size());
        NDArray {
            dtype: buf.dtype(),
            device: Device::Gpu(buf.ordinal()),
            data: Arc::new(RwLock::new(Storage::Gpu(buf))),
            shape,
        }
    }

    /// Places host data on `device`: kept as is for a CPU device, copied to a GPU.
    fn place(data: HostData, shape: Shape, device: Device) -> Result<NDArray> {
        match device {
            Device::Cpu(_) => Ok(NDArray::from_host(data, shape, device)),
            Device::Gpu(i) => Ok(NDArray::from_gpu(GpuBuf::upload(i, &data)?, shape)),
        }
    }

    /// A `float32` array of zeros on `cpu(0)`.
    ///
    /// # Panics
    /// If the elements would take more than `isize::MAX` bytes, or the dimensions overflow a
    /// [`Shape`]; [`NDArray::try_zeros`] returns an error instead.
    pub fn zeros(shape: impl Into<Shape>) -> NDArray {
        NDArray::full(shape, 0.0)
    }

    /// A `float32` array of ones on `cpu(0)`.
    ///
    /// # Panics
    /// As [`NDArray::zeros`]; [`NDArray::try_ones`] returns an error instead.
    pub fn ones(shape: impl Into<Shape>) -> NDArray {
        NDArray::full(shape, 1.0)
    }

    /// A `float32` array filled with `value` on `cpu(0)`.
    ///
    /// # Panics
    /// As [`NDArray::zeros`]; [`NDArray::try_full`] returns an error instead.
    pub fn full(shape: impl Into<Shape>, value: f64) -> NDArray {
        NDArray::try_full(shape, value).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`NDArray::zeros`], with an error instead of a panic when the shape is too large.
    /// Build a shape from untrusted dimensions with [`Shape::new`], which checks them.
    ///
    /// ```
    /// use kvstore::{NDArray, Shape};
    /// assert_eq!(NDArray::try_zeros([2, 3]).unwrap().size(), 6);
    /// // 2^62 elements fit in a usize, but not their 2^64 bytes of float32:
    /// assert!(NDArray::try_zeros(Shape::new(&[1 << 31, 1 << 31]).unwrap()).is_err());
    /// assert!(Shape::new(&[1 << 33, 1 << 31]).is_err()); // 2^64 elements: no shape at all
    /// ```
    pub fn try_zeros(shape: impl Into<Shape>) -> Result<NDArray> {
        NDArray::try_full(shape, 0.0)
    }

    /// [`NDArray::ones`], with an error instead of a panic when the shape is too large.
    pub fn try_ones(shape: impl Into<Shape>) -> Result<NDArray> {
        NDArray::try_full(shape, 1.0)
    }

    /// [`NDArray::full`], with an error instead of a panic when the shape is too large.
    pub fn try_full(shape: impl Into<Shape>, value: f64) -> Result<NDArray> {
        let shape = shape.into();
        shape.nbytes(DType::F32)?;
        Ok(NDArray::from_host(
            HostData::filled(DType::F32, shape.size(), value),
            shape,
            Device::Cpu(0),
        ))
    }

    /// An array of `dtype` filled with `value` on `device`; an error if the device does not
    /// exist, or if the elements would take more than `isize::MAX` bytes.
    ///
    /// ```
    /// use kvstore::{cpu, DType, NDArray};
    /// let a = NDArray::full_on([4], 0.5, DType::F16, cpu(1)).unwrap();
    /// assert_eq!(a.to_vec::<f32>().unwrap(), vec![0.5; 4]);
    /// ```
    pub fn full_on(
        shape: impl Into<Shape>,
        value: f64,
        dtype: DType,
        device: Device,
    ) -> Result<NDArray> {
        check_device(device)?;
        let shape = shape.into();
        shape.nbytes(dtype)?;
        NDArray::place(HostData::filled(dtype, shape.size(), value), shape, device)
    }

    /// An array on `cpu(0)` that takes ownership of `data`; its dtype is `T`'s. An error if
    /// `data` does not hold exactly `shape.size()` elements.
    ///
    /// ```
    /// use kvstore::NDArray;
    /// let a = NDArray::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], [2, 2]).unwrap();
    /// assert!(NDArray::from_vec(vec![1.0f32; 3], [2, 2]).is_err());
    /// ```
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>) -> Result<NDArray> {
        let shape = shape.into();
        check_len(data.len(), shape)?;
        Ok(NDArray::from_host(T::wrap(data), shape, Device::Cpu(0)))
    }

    /// The shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the elements live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The number of elements.
    pub fn size(&self) -> usize {
        self.shape.size()
    }

    /// The number of bytes the elements take.
    pub fn nbytes(&self) -> usize {
        self.size() * self.dtype.size()
    }

    /// The elements, converted to `T`, in row-major order (NumPy's `asnumpy().ravel()`). For
    /// an array on a GPU this waits for the GPU's stream (every push and pull in flight on it).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.with_host(|h| h.to_vec())
    }

    /// An independent copy on `device`; an error if the device does not exist.
    pub fn to_device(&self, device: Device) -> Result<NDArray> {
        check_device(device)?;
        let g = self.read();
        match (&*g, device) {
            (Storage::Gpu(b), Device::Gpu(i)) => Ok(NDArray::from_gpu(b.copy_to(i)?, self.shape)),
            (Storage::Host(h), Device::Gpu(i)) => {
                Ok(NDArray::from_gpu(GpuBuf::upload(i, h)?, self.shape))
            }
            (storage, device) => NDArray::place(storage.host()?.into_owned(), self.shape, device),
        }
    }

    /// An independent copy converted to `dtype`, on the same device (a GPU's via the host).
    pub fn astype(&self, dtype: DType) -> Result<NDArray> {
        let data = self.with_host(|h| h.cast(dtype))?;
        NDArray::place(data, self.shape, self.device)
    }

    /// An independent copy: same shape, dtype and device, its own elements.
    pub fn copy(&self) -> Result<NDArray> {
        self.to_device(self.device)
    }

    /// Sets every element to `value`.
    pub fn fill(&self, value: f64) -> Result<()> {
        let mut g = self.write();
        match &mut *g {
            Storage::Host(h) => with_host!(h, v: T => v.fill(T::from_f64(value))),
            Storage::Gpu(b) => b.fill(value)?,
        }
        Ok(())
    }

    /// `self += alpha * x`, in place, with the math in `f32` (`f64` for `float64`). `x` (maybe
    /// `self`) must have the same shape and dtype. GPU arrays go through the host (slow).
    pub fn add_scaled(&self, x: &NDArray, alpha: f64) -> Result<()> {
        self.check_operand("add_scaled", x)?;
        if self.shares_storage(x) {
            return self.scale(1.0 + alpha);
        }
        // Locks in address order, so `a.add_scaled(&b)` and `b.add_scaled(&a)` cannot deadlock.
        let (xg, mut g) = if x.storage_id() < self.storage_id() {
            let xg = x.read();
            (xg, self.write())
        } else {
            let g = self.write();
            (x.read(), g)
        };
        let xh = xg.host()?;
        modify_locked(&mut g, |h| {
            with_host!(h, v: T => {
                let xs = T::slice(&xh).expect("operand dtypes were checked");
                axpy(v, xs, alpha);
            })
        })
    }

    /// `self *= s`, in place. Arrays on a GPU go through the host and back (slow).
    pub fn scale(&self, s: f64) -> Result<()> {
        modify_locked(&mut self.write(), |h| with_host!(h, v: T => scale(v, s)))
    }

    /// A new array `self * s`: `&a * s` with an error instead of a panic (a GPU array that
    /// cannot be copied or scaled).
    ///
    /// ```
    /// use kvstore::NDArray;
    /// let a = NDArray::ones([2]).try_mul(3.0).unwrap();
    /// assert_eq!(a.to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
    /// ```
    pub fn try_mul(&self, s: f64) -> Result<NDArray> {
        let out = self.copy()?;
        out.scale(s)?;
        Ok(out)
    }

    /// A new array `a * self + b * other`; `other` must have the same shape and dtype.
    pub fn axpby(&self, a: f64, other: &NDArray, b: f64) -> Result<NDArray> {
        self.check_operand("axpby", other)?;
        let out = self.copy()?;
        out.scale(a)?;
        out.add_scaled(other, b)?;
        Ok(out)
    }

    fn check_operand(&self, op: &'static str, x: &NDArray) -> Result<()> {
        if x.shape != self.shape || x.dtype != self.dtype {
            return Err(Error::Operands {
                op,
                left: Box::new(self.shape),
                left_dtype: self.dtype,
                right: Box::new(x.shape),
                right_dtype: x.dtype,
            });
        }
        Ok(())
    }

    /// Runs `f` on the host elements, under a read lock (a GPU array is copied to the host).
    pub(crate) fn with_host<R>(&self, f: impl FnOnce(&HostData) -> R) -> Result<R> {
        let g = self.read();
        Ok(f(g.host()?.as_ref()))
    }

    /// Whether `self` and `other` are handles to the same elements.
    pub fn shares_storage(&self, other: &NDArray) -> bool {
        Arc::ptr_eq(&self.data, &other.data)
    }

    /// How many handles share these elements (this one included).
    pub(crate) fn handles(&self) -> usize {
        Arc::strong_count(&self.data)
    }

    /// An address that identifies the elements; locks on several arrays are taken in its order.
    pub(crate) fn storage_id(&self) -> usize {
        Arc::as_ptr(&self.data) as usize
    }

    /// A read lock on the elements. A panic in another holder does not poison them for us.
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Storage> {
        self.data.read().unwrap_or_else(|e| e.into_inner())
    }

    /// A write lock on the elements.
    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, Storage> {
        self.data.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The storage, moved out when this is the only handle to it; the array back otherwise.
    pub(crate) fn into_storage(self) -> std::result::Result<Storage, NDArray> {
        match Arc::try_unwrap(self.data) {
            Ok(lock) => Ok(lock.into_inner().unwrap_or_else(|e| e.into_inner())),
            Err(data) => Err(NDArray { data, ..self }),
        }
    }

    /// The elements as host data: moved out where this is their only handle, else copied.
    pub(crate) fn into_host(self) -> Result<HostData> {
        match self.into_storage() {
            Ok(Storage::Host(h)) => Ok(h),
            Ok(Storage::Gpu(b)) => b.download(),
            Err(shared) => Ok(shared.read().host()?.into_owned()),
        }
    }

    /// An array on `device` holding `data` (taken as is on a CPU, copied to a GPU) in row-major
    /// order; its dtype is `T`'s. An error if the length is not `shape`'s size or the device
    /// does not exist.
    ///
    /// ```
    /// use kvstore::{cpu, NDArray};
    /// let a = NDArray::from_vec_on(vec![1.0f32, 2.0, 3.0], [3], cpu(2))?;
    /// assert_eq!(a.device(), cpu(2));
    /// assert_eq!(a.to_vec::<f32>()?, vec![1.0, 2.0, 3.0]);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn from_vec_on<T: Element>(
        data: Vec<T>,
        shape: impl Into<Shape>,
        device: Device,
    ) -> Result<NDArray> {
        let shape = shape.into();
        check_len(data.len(), shape)?;
        check_device(device)?;
        NDArray::place(T::wrap(data), shape, device)
    }

    /// An array of `dtype` on `device` from `f64` data in row-major order, each element rounded
    /// to the nearest `dtype` value (what a deserializer or FFI layer holds). An error if the
    /// length is not `shape`'s size or the device does not exist.
    ///
    /// ```
    /// use kvstore::{cpu, DType, NDArray};
    /// let a = NDArray::from_f64(&[0.5, -1.25, 3.0, 1e-3], [2, 2], DType::BF16, cpu(0))?;
    /// assert_eq!(a.dtype(), DType::BF16);
    /// assert_eq!(a.to_vec::<f32>()?[..3], [0.5, -1.25, 3.0]);
    /// assert!(NDArray::from_f64(&[1.0; 3], [2, 2], DType::F32, cpu(0)).is_err());
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn from_f64(
        data: &[f64],
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
    ) -> Result<NDArray> {
        let shape = shape.into();
        check_len(data.len(), shape)?;
        check_device(device)?;
        let mut host = HostData::try_filled(dtype, data.len(), 0.0)?;
        convert_into(data, &mut host);
        NDArray::place(host, shape, device)
    }
}

/// `len` elements must fill `shape` exactly.
fn check_len(len: usize, shape: Shape) -> Result<()> {
    if len != shape.size() {
        return Err(Error::DataLength {
            len,
            shape: Box::new(shape),
        });
    }
    Ok(())
}

/// Runs `f` on the host elements of locked storage; GPU storage is copied to the host and back.
fn modify_locked(storage: &mut Storage, f: impl FnOnce(&mut HostData)) -> Result<()> {
    match storage {
        Storage::Host(h) => f(h),
        Storage::Gpu(b) => {
            let mut h = b.download()?;
            f(&mut h);
            b.upload_into(&h)?;
        }
    }
    Ok(())
}

/// `y *= s`, elementwise, in the accumulator precision.
fn scale<T: Element>(y: &mut [T], s: f64) {
    let s = <T::Acc as Element>::from_f64(s);
    for e in y.iter_mut() {
        *e = T::from_acc(e.to_acc() * s);
    }
}

/// `y += alpha * x`, elementwise, in the accumulator precision.
fn axpy<T: Element>(y: &mut [T], x: &[T], alpha: f64) {
    let a = <T::Acc as Element>::from_f64(alpha);
    for (y, x) in y.iter_mut().zip(x) {
        *y = T::from_acc(y.to_acc() + a * x.to_acc());
    }
}

impl fmt::Debug for NDArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (shape, dtype, device) = (self.shape, self.dtype, self.device);
        write!(f, "NDArray({self}, {shape}, {dtype}, {device})")
    }
}

impl fmt::Display for NDArray {
    /// NumPy's layout: `[[2. 2. 2.]\n [2. 2. 2.]]`; `[]` for an array with no elements.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.size() == 0 {
            return f.write_str("[]");
        }
        match self.to_vec::<f64>() {
            Ok(v) => {
                let text: Vec<String> = v.iter().map(|&x| format_element(x, self.dtype)).collect();
                write_nested(f, self.shape.dims(), &text, 0)
            }
            Err(e) => write!(f, "<unreadable: {e}>"),
        }
    }
}

/// One element as NumPy prints it: `2.` for integral values, the shortest form otherwise.
fn format_element(x: f64, dtype: DType) -> String {
    if x.is_finite() && x == x.trunc() && x.abs() < 1e16 {
        return format!("{x:.0}.");
    }
    match dtype {
        DType::F64 => format!("{x}"),
        // Shortest text that reads back as the same single-precision value.
        _ => format!("{}", x as f32),
    }
}

fn write_nested(
    f: &mut fmt::Formatter<'_>,
    dims: &[usize],
    text: &[String],
    depth: usize,
) -> fmt::Result {
    let Some((&n, rest)) = dims.split_first() else {
        return f.write_str(text.first().map_or("", String::as_str));
    };
    let inner: usize = rest.iter().product();
    let between = match rest.len() {
        0 => " ".to_owned(),
        d => "\n".repeat(d) + &" ".repeat(depth + 1),
    };
    f.write_str("[")?;
    for i in 0..n {
        if i > 0 {
            f.write_str(&between)?;
        }
        write_nested(f, rest, &text[i * inner..(i + 1) * inner], depth + 1)?;
    }
    f.write_str("]")
}

impl Mul<f64> for &NDArray {
    type Output = NDArray;
    /// A new array, `self * s`.
    ///
    /// # Panics
    /// If a GPU copy or scaling fails; [`NDArray::try_mul`] returns the error instead.
    fn mul(self, s: f64) -> NDArray {
        self.try_mul(s).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Mul<f64> for NDArray {
    type Output = NDArray;
    /// A new array, `self * s`. Panics as `&NDArray * f64` does.
    fn mul(self, s: f64) -> NDArray {
        &self * s
    }
}

impl Neg for &NDArray {
    type Output = NDArray;
    /// A new array, `-self`. Panics as `&NDArray * f64` does; `try_mul(-1.0)` returns an error.
    fn neg(self) -> NDArray {
        self * -1.0
    }
}

impl Neg for NDArray {
    type Output = NDArray;
    /// A new array, `-self`. Panics as `&NDArray * f64` does; `try_mul(-1.0)` returns an error.
    fn neg(self) -> NDArray {
        &self * -1.0
    }
}

impl MulAssign<f64> for NDArray {
    /// `self *= s`, in place.
    ///
    /// # Panics
    /// If a GPU scaling fails; [`NDArray::scale`] returns the error instead.
    fn mul_assign(&mut self, s: f64) {
        self.scale(s).unwrap_or_else(|e| panic!("{e}"))
    }
}

macro_rules! binary_ops {
    ($trait:ident, $method:ident, $assign_trait:ident, $assign_method:ident, $sign:expr) => {
        impl $assign_trait<&NDArray> for NDArray {
            /// In place, elementwise.
            ///
            /// # Panics
            /// If the operands differ in shape or dtype, or a GPU operand fails (a CUDA error);
            /// [`NDArray::add_scaled`] returns an error instead.
            fn $assign_method(&mut self, rhs: &NDArray) {
                self.add_scaled(rhs, $sign)
                    .unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl $assign_trait<NDArray> for NDArray {
            /// In place, elementwise. Panics as the `&NDArray` form does.
            fn $assign_method(&mut self, rhs: NDArray) {
                $assign_trait::$assign_method(self, &rhs)
            }
        }
        impl $trait<&NDArray> for &NDArray {
            type Output = NDArray;
            /// A new array, elementwise.
            ///
            /// # Panics
            /// If the operands differ in shape or dtype, or a GPU operand fails (a CUDA error);
            /// [`NDArray::axpby`] returns an error instead.
            fn $method(self, rhs: &NDArray) -> NDArray {
                self.axpby(1.0, rhs, $sign)
                    .unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl $trait<NDArray> for NDArray {
            type Output = NDArray;
            /// A new array, elementwise. Panics as the `&NDArray` form does.
            fn $method(self, rhs: NDArray) -> NDArray {
                $trait::$method(&self, &rhs)
            }
        }
    };
}
binary_ops!(Add, add, AddAssign, add_assign, 1.0);
binary_ops!(Sub, sub, SubAssign, sub_assign, -1.0);

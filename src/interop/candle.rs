//! candle [`Tensor`]s as init values, push values and pull outs (cargo feature `candle`).
//!
//! ```
//! use kvstore::candle::candle_core::{DType, Device, Tensor};
//! use kvstore::candle::CandleExt;
//! use kvstore::KvStore;
//!
//! let kv = KvStore::create("local")?;
//! kv.init_candle(0, &Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?)?;
//! // Gradients from two workers are summed into the stored value.
//! let grads = [
//!     Tensor::ones((2, 3), DType::F32, &Device::Cpu)?,
//!     Tensor::full(2f32, (2, 3), &Device::Cpu)?,
//! ];
//! kv.push_candle(0, &grads)?;
//! let out = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
//! kv.pull_candle(0, std::slice::from_ref(&out))?;
//! assert_eq!(out.to_vec2::<f32>()?, vec![vec![3.0; 3]; 2]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Copies
//!
//! On the CPU a tensor whose storage is exactly its elements (contiguous, offset 0: what
//! `Tensor::zeros`, `Var::new`, `backward` and `contiguous()` give) is **lent** for the call:
//! its `Vec` is moved into an [`NDArray`], read (push) or written (pull) in place, and moved
//! back. No element is copied:
//!
//! | call | lendable tensor | other CPU tensor (a view: transposed, narrowed, broadcast) |
//! |------|-----------------|-------------------------------------------------------------|
//! | push | none            | one gather into a contiguous array                          |
//! | pull | none            | one scatter from a contiguous array into the view           |
//! | init | one: the store keeps its own copy, as with any [`NDArray`] | one gather, then the store's copy |
//!
//! A pull out that shares storage with another out of the same call, or repeats elements (a
//! broadcast view), is refused with [`CandleError::AliasedOuts`]: two writers to one storage.
//!
//! # GPU tensors
//!
//! Not in this build: a tensor on a candle CUDA device is refused with
//! [`CandleError::UnsupportedDevice`]; move it with `tensor.to_device(&Device::Cpu)`. Lending
//! would work in principle (candle-core 0.11.1 uses cudarc 0.19.10 too, `CudaStorage::slice` is
//! public, `InplaceOp1::cuda_fwd` runs under the write lock, both retain the primary context),
//! but it cannot be built:
//! - candle-core asks cudarc for `dynamic-linking`, kvstore for `dynamic-loading` (dlopen, so a
//!   machine without a GPU, or the stand-in driver, works); Cargo unifies the one cudarc's
//!   features and its build script refuses the pair ("Both `dynamic-loading` and
//!   `dynamic-linking` features are active, this is a bug").
//! - nvcc 11.8 cannot build candle-kernels 0.11.1 for sm_90 (cudaforge 0.1.6 asks for
//!   `sm_90a`, CUDA 12.0's); with `CUDA_COMPUTE_CAP=89` it builds (27 minutes on 2 cores), but
//!   its MoE/GGUF kernels are sm_89 code, which does not load on sm_90.
//! - candle's stream and kvstore's need an event each way per lend, untested on a GPU.
//!
//! # Ownership (why there is no `unsafe` here)
//!
//! A lend never makes a second owner of candle's memory. `InplaceOp1::cpu_fwd` gives
//! `&mut CpuStorage` under the tensor's storage **write lock**, so no one else sees it until
//! the op returns. Inside it, the `Vec` is moved out with `std::mem::take`, wrapped in an
//! [`NDArray`], and the store call runs, keeping no handle. Then a guard's `Drop` (on unwind
//! too) moves it back: the same allocation when ours is the only handle, a copy when something
//! (a push hook, a custom updater) kept a clone. The compiler checks all this.
//!
//! Several tensors are lent by nesting: tensor `i+1` is locked inside tensor `i`'s op, so the
//! call holds all their write locks at once. candle's lock is not re-entrant, so a push value
//! sharing storage with an earlier one is copied before any lock is taken, and such pull outs
//! are refused. A lend waits for the write lock without a time limit: do not call it while the
//! same thread holds a read guard (`storage_and_layout`) on one of the tensors.

use std::cell::RefCell;
use std::collections::HashSet;

pub use candle_core;
use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};
use half::{bf16, f16};

use crate::host::HostData;
use crate::{DType, Device, Element, IntoKey, KvStore, NDArray, Shape};

/// What can go wrong handing candle tensors to the store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CandleError {
    /// The store refused the call (unknown key, shape or dtype mismatch, ...); it is unchanged.
    #[error(transparent)]
    Store(#[from] crate::Error),

    /// candle refused an operation on a tensor (reading or locking its storage).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    /// A tensor whose candle dtype has no kvstore dtype.
    #[error(
        "{what}: candle dtype {dtype:?} has no kvstore dtype: kvstore holds f32, f64, f16 and \
         bf16; convert first with tensor.to_dtype(DType::F32)"
    )]
    UnsupportedDType {
        /// Which tensor of the call ("value 2", "out 0").
        what: String,
        /// Its candle dtype.
        dtype: candle_core::DType,
    },

    /// A tensor on a device this build cannot lend (a candle CUDA or Metal device).
    #[error(
        "{what} is on candle device {device}: this build lends CPU tensors only (see the \
         kvstore::candle docs); move it with tensor.to_device(&Device::Cpu)"
    )]
    UnsupportedDevice {
        /// Which tensor of the call.
        what: String,
        /// Its candle device.
        device: String,
    },

    /// A pull out that shares storage with an earlier out or repeats elements (a broadcast).
    #[error(
        "pull: out {index} shares its storage with an earlier out of the call, or repeats \
         elements (a broadcast view): pull into tensors with storage of their own \
         (tensor.copy()) and copy from there"
    )]
    AliasedOuts {
        /// The index of the out among all outs of the call.
        index: usize,
    },
}

/// The result type of this module.
pub type CandleResult<T> = std::result::Result<T, CandleError>;

/// Whether a lend reads the tensors (init, push) or writes them (pull).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The store reads the arrays; the tensors are left as they are.
    Read,
    /// The store writes the arrays; what it wrote ends up in the tensors.
    Write,
}

/// The kvstore dtype of a candle dtype, if there is one.
pub fn kv_dtype(dtype: candle_core::DType) -> Option<DType> {
    match dtype {
        candle_core::DType::F32 => Some(DType::F32),
        candle_core::DType::F64 => Some(DType::F64),
        candle_core::DType::F16 => Some(DType::F16),
        candle_core::DType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// Runs `f` with one [`NDArray`] per tensor: its own storage where it can be lent, a copy
/// otherwise; with [`Access::Write`], what `f` writes is in the tensors after. A clone `f` keeps
/// costs a copy. For calls [`CandleExt`] lacks (`pushpull`, `broadcast`).
pub fn with_arrays<R>(
    tensors: &[&Tensor],
    access: Access,
    f: impl FnOnce(&[NDArray]) -> crate::Result<R>,
) -> CandleResult<R> {
    let lending = Lending::plan(tensors, access)?;
    let mut f = Some(f);
    let mut out = None;
    let mut body = |arrays: &[NDArray]| -> CandleResult<()> {
        let f = f.take().expect("the body of a lend runs once");
        out = Some(f(arrays)?);
        Ok(())
    };
    lending.step(0, &mut Vec::with_capacity(tensors.len()), &mut body)?;
    Ok(out.expect("a lend that succeeded ran its body"))
}

/// Store calls that take candle tensors: each is the [`KvStore`] method without `_candle`.
pub trait CandleExt {
    /// [`KvStore::init`] from a tensor.
    fn init_candle(&self, key: impl IntoKey, value: &Tensor) -> CandleResult<()>;
    /// [`KvStore::init_list`] from tensors, one per key.
    fn init_list_candle<K: IntoKey + Clone>(
        &self,
        keys: &[K],
        values: &[Tensor],
    ) -> CandleResult<()>;
    /// [`KvStore::push`] of tensors (one per device or worker) to one key.
    fn push_candle(&self, key: impl IntoKey, values: &[Tensor]) -> CandleResult<()>;
    /// [`KvStore::push_list`]: one store call for all keys, each with its tensors.
    fn push_list_candle<K: IntoKey + Clone, V: AsRef<[Tensor]>>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> CandleResult<()>;
    /// [`KvStore::pull`] into tensors; a pull converts to each out's dtype.
    fn pull_candle(&self, key: impl IntoKey, outs: &[Tensor]) -> CandleResult<()>;
    /// [`KvStore::pull_list`]: one consistent snapshot of all keys, into their tensors.
    fn pull_list_candle<K: IntoKey + Clone, V: AsRef<[Tensor]>>(
        &self,
        keys: &[K],
        outs: &[V],
    ) -> CandleResult<()>;
}

impl CandleExt for KvStore {
    fn init_candle(&self, key: impl IntoKey, value: &Tensor) -> CandleResult<()> {
        let key = key.into_key()?;
        with_arrays(&[value], Access::Read, |a| self.init(key, &a[0]))
    }

    fn init_list_candle<K: IntoKey + Clone>(
        &self,
        keys: &[K],
        values: &[Tensor],
    ) -> CandleResult<()> {
        let tensors: Vec<&Tensor> = values.iter().collect();
        with_arrays(&tensors, Access::Read, |a| self.init_list(keys, a))
    }

    fn push_candle(&self, key: impl IntoKey, values: &[Tensor]) -> CandleResult<()> {
        let key = key.into_key()?;
        with_arrays(&values.iter().collect::<Vec<_>>(), Access::Read, |a| {
            self.push(key, a)
        })
    }

    fn push_list_candle<K: IntoKey + Clone, V: AsRef<[Tensor]>>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> CandleResult<()> {
        let (tensors, lens) = flatten(values);
        with_arrays(&tensors, Access::Read, |a| {
            self.push_list(keys, &split(a, &lens))
        })
    }

    fn pull_candle(&self, key: impl IntoKey, outs: &[Tensor]) -> CandleResult<()> {
        let key = key.into_key()?;
        with_arrays(&outs.iter().collect::<Vec<_>>(), Access::Write, |a| {
            self.pull(key, a)
        })
    }

    fn pull_list_candle<K: IntoKey + Clone, V: AsRef<[Tensor]>>(
        &self,
        keys: &[K],
        outs: &[V],
    ) -> CandleResult<()> {
        let (tensors, lens) = flatten(outs);
        with_arrays(&tensors, Access::Write, |a| {
            self.pull_list(keys, &split(a, &lens))
        })
    }
}

/// All tensors of a list of lists, and the length of each list.
fn flatten<V: AsRef<[Tensor]>>(lists: &[V]) -> (Vec<&Tensor>, Vec<usize>) {
    let tensors = lists.iter().flat_map(|l| l.as_ref()).collect();
    let lens = lists.iter().map(|l| l.as_ref().len()).collect();
    (tensors, lens)
}

/// Arrays cut back into lists of the given lengths.
fn split(arrays: &[NDArray], lens: &[usize]) -> Vec<Vec<NDArray>> {
    let mut rest = arrays;
    lens.iter()
        .map(|&n| {
            let (head, tail) = rest.split_at(n);
            rest = tail;
            head.to_vec()
        })
        .collect()
}

/// How one tensor gets its array.
enum Plan {
    /// Lock the tensor's storage and lend it (or copy through its layout, under the lock).
    Lock,
    /// An array made before any lock: an aliased read tensor's copy, or an empty tensor's.
    Ready(NDArray),
}

/// The tensors of one call, checked, each with its plan.
struct Lending<'t> {
    tensors: &'t [&'t Tensor],
    shapes: Vec<Shape>,
    plans: Vec<Plan>,
    access: Access,
}

/// The body of a lend: runs once, with every array.
type Body<'b> = dyn FnMut(&[NDArray]) -> CandleResult<()> + 'b;

impl<'t> Lending<'t> {
    /// Checks every tensor (dtype, device, shape, aliasing) before any lock is taken.
    fn plan(tensors: &'t [&'t Tensor], access: Access) -> CandleResult<Lending<'t>> {
        let what = |i: usize| match access {
            Access::Read => format!("value {i}"),
            Access::Write => format!("out {i}"),
        };
        let mut shapes = Vec::with_capacity(tensors.len());
        let mut plans = Vec::with_capacity(tensors.len());
        let mut seen = HashSet::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            let Some(dtype) = kv_dtype(t.dtype()) else {
                return Err(CandleError::UnsupportedDType {
                    what: what(i),
                    dtype: t.dtype(),
                });
            };
            if !t.device().is_cpu() {
                return Err(CandleError::UnsupportedDevice {
                    what: what(i),
                    device: format!("{:?}", t.device().location()),
                });
            }
            let shape = Shape::new(t.dims())?;
            shapes.push(shape);
            if t.elem_count() == 0 {
                let empty = NDArray::full_on(shape, 0.0, dtype, Device::Cpu(0))?;
                plans.push(Plan::Ready(empty));
                continue;
            }
            // The address of the `Storage` inside the tensor's lock names the storage. One
            // read guard at a time: a second read on one lock could wait behind a writer.
            let (id, overlap) = {
                let (storage, layout) = t.storage_and_layout();
                let storage: &candle_core::Storage = &storage;
                (
                    std::ptr::from_ref(storage).addr(),
                    layout.has_internal_overlap(),
                )
            };
            if seen.insert(id) && !overlap {
                plans.push(Plan::Lock);
            } else if access == Access::Write {
                return Err(CandleError::AliasedOuts { index: i });
            } else {
                plans.push(Plan::Ready(copy_out(t, shape)?));
            }
        }
        Ok(Lending {
            tensors,
            shapes,
            plans,
            access,
        })
    }

    /// Gives tensor `i` its array, then the rest, then runs `body` with all of them.
    fn step(&self, i: usize, arrays: &mut Vec<NDArray>, body: &mut Body<'_>) -> CandleResult<()> {
        let Some(t) = self.tensors.get(i) else {
            return body(arrays);
        };
        match &self.plans[i] {
            Plan::Ready(a) => {
                arrays.push(a.clone());
                let r = self.step(i + 1, arrays, body);
                arrays.pop();
                r
            }
            Plan::Lock => {
                let op = LendOp {
                    lending: self,
                    i,
                    ctx: RefCell::new(Some((arrays, body))),
                    out: RefCell::new(None),
                };
                let locked = t.inplace_op1(&op);
                match (op.out.into_inner(), locked) {
                    (Some(r), _) => r,
                    (None, Err(e)) => Err(e.into()),
                    (None, Ok(())) => Err(candle_core::Error::Msg(
                        "kvstore lend: candle did not run the op on the CPU storage".into(),
                    )
                    .into()),
                }
            }
        }
    }

    /// Lends tensor `i`'s storage, under candle's write lock, for the rest of the call.
    fn lend_cpu(
        &self,
        i: usize,
        storage: &mut CpuStorage,
        layout: &Layout,
        arrays: &mut Vec<NDArray>,
        body: &mut Body<'_>,
    ) -> CandleResult<()> {
        match storage {
            CpuStorage::F32(v) => self.lend_vec(i, v, layout, arrays, body),
            CpuStorage::F64(v) => self.lend_vec(i, v, layout, arrays, body),
            CpuStorage::F16(v) => self.lend_vec(i, v, layout, arrays, body),
            CpuStorage::BF16(v) => self.lend_vec(i, v, layout, arrays, body),
            other => Err(CandleError::UnsupportedDType {
                what: format!("tensor {i}"),
                dtype: candle_core::backend::BackendStorage::dtype(other),
            }),
        }
    }

    fn lend_vec<T: Lend>(
        &self,
        i: usize,
        v: &mut Vec<T>,
        layout: &Layout,
        arrays: &mut Vec<NDArray>,
        body: &mut Body<'_>,
    ) -> CandleResult<()> {
        let shape = self.shapes[i];
        let n = shape.size();
        if layout.is_contiguous() && layout.start_offset() == 0 && v.len() == n {
            // No copy: the Vec itself, moved back by the guard (on unwind too).
            let array = NDArray::from_host(T::wrap(std::mem::take(v)), shape, Device::Cpu(0));
            let guard = Restore {
                slot: v,
                array: Some(array.clone()),
            };
            arrays.push(array);
            let r = self.step(i + 1, arrays, body);
            arrays.pop();
            drop(guard);
            return r;
        }
        // A view: one copy through the layout, under the lock.
        let copy = match self.access {
            Access::Read => {
                let mut c = Vec::with_capacity(n);
                for_each_offset(layout, |o| c.push(v[o]));
                c
            }
            Access::Write => vec![<T as Element>::from_f64(0.0); n],
        };
        let array = NDArray::from_host(T::wrap(copy), shape, Device::Cpu(0));
        arrays.push(array.clone());
        let r = self.step(i + 1, arrays, body);
        arrays.pop();
        if r.is_ok() && self.access == Access::Write {
            let pulled = T::take(array.into_host()?);
            let mut src = pulled.iter();
            for_each_offset(layout, |o| {
                if let Some(&x) = src.next() {
                    v[o] = x;
                }
            });
        }
        r
    }
}

/// The in-place op that candle runs under a tensor's write lock: the rest of the lend.
struct LendOp<'l, 'a, 'b> {
    lending: &'l Lending<'l>,
    i: usize,
    ctx: RefCell<Option<(&'a mut Vec<NDArray>, &'a mut Body<'b>)>>,
    out: RefCell<Option<CandleResult<()>>>,
}

impl InplaceOp1 for LendOp<'_, '_, '_> {
    fn name(&self) -> &'static str {
        "kvstore-lend"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        if let Some((arrays, body)) = self.ctx.borrow_mut().take() {
            let r = self.lending.lend_cpu(self.i, storage, layout, arrays, body);
            *self.out.borrow_mut() = Some(r);
        }
        Ok(())
    }
}

/// Moves a lent `Vec` back into candle's storage when dropped.
struct Restore<'v, T: Lend> {
    slot: &'v mut Vec<T>,
    array: Option<NDArray>,
}

impl<T: Lend> Drop for Restore<'_, T> {
    fn drop(&mut self) {
        if let Some(array) = self.array.take() {
            // A host array's `into_host` cannot fail: it moves the Vec out, or copies it.
            if let Ok(h) = array.into_host() {
                *self.slot = T::take(h);
            }
        }
    }
}

/// The four element types, with their candle and kvstore sides.
trait Lend: Element + candle_core::WithDType {
    /// The elements of host data holding this type, converted if it holds another.
    fn take(h: HostData) -> Vec<Self>;
}

macro_rules! lend {
    ($t:ty, $variant:ident) => {
        impl Lend for $t {
            fn take(h: HostData) -> Vec<$t> {
                match h {
                    HostData::$variant(v) => v,
                    other => other.to_vec(),
                }
            }
        }
    };
}
lend!(f32, F32);
lend!(f64, F64);
lend!(f16, F16);
lend!(bf16, BF16);

/// A contiguous copy of a tensor's elements (read access, no lock held by this call).
fn copy_out(t: &Tensor, shape: Shape) -> CandleResult<NDArray> {
    let flat = t.flatten_all()?;
    let data = match t.dtype() {
        candle_core::DType::F32 => HostData::F32(flat.to_vec1()?),
        candle_core::DType::F64 => HostData::F64(flat.to_vec1()?),
        candle_core::DType::F16 => HostData::F16(flat.to_vec1()?),
        candle_core::DType::BF16 => HostData::BF16(flat.to_vec1()?),
        dtype => {
            return Err(CandleError::UnsupportedDType {
                what: "tensor".into(),
                dtype,
            })
        }
    };
    Ok(NDArray::from_host(data, shape, Device::Cpu(0)))
}

/// Calls `f` with the storage offset of each element of `layout`, in row-major order.
fn for_each_offset(layout: &Layout, mut f: impl FnMut(usize)) {
    let dims = layout.dims();
    let stride = layout.stride();
    let n: usize = dims.iter().product();
    let mut index = vec![0usize; dims.len()];
    let mut offset = layout.start_offset();
    for _ in 0..n {
        f(offset);
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            offset += stride[d];
            if index[d] < dims[d] {
                break;
            }
            offset -= stride[d] * dims[d];
            index[d] = 0;
        }
    }
}

/// Test support, not API: a host array's first element's address (`None` on a GPU).
#[doc(hidden)]
pub fn __host_addr(a: &NDArray) -> Option<usize> {
    let g = a.read();
    match &*g {
        crate::ndarray::Storage::Host(h) => {
            Some(crate::host::with_host!(h, v: T => v.as_ptr().addr()))
        }
        crate::ndarray::Storage::Gpu(_) => None,
    }
}

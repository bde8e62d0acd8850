//! Across ranks on GPUs (`dist_device_sync` on a machine with GPUs): NCCL between the ranks, one
//! GPU per rank.
//!
//! A key of more than the big-array bound is sliced over the ranks: a push is one NCCL
//! reduce-scatter per key ([`reduce_scatter`]), a pull one all-gather ([`all_gather`]), an init
//! a broadcast per slice ([`scatter`]). Other keys are whole on their home rank. Keys of fewer than
//! [`PACK_MAX_BYTES`] travel packed, as on CPU ranks: one device buffer per (home rank, dtype),
//! filled and emptied by batched device copies ([`copy_many`]), so a list push of 1000 small
//! keys is one NCCL reduce per home rank and dtype, not 1000. Bigger keys travel alone, in
//! place. Every collective of a call goes out in NCCL groups with one wait each
//! ([`RankComm::group`]), with no copy through host memory. The fingerprint check and the
//! bounds on every wait are the link's, before the collectives, and [`RankComm`]'s own bound
//! on each NCCL call.

use std::collections::BTreeMap;
use std::ops::Range;

use super::super::nccl::{InPlace, RankComm};
use super::PACK_MAX_BYTES;
use crate::backend::cuda::{copy_many, DeviceCopy, GpuPtr};
use crate::comm::spread::{slice_block, slice_range};
use crate::ndarray::Storage;
use crate::{DType, Device, Error, NDArray, Result, Shape};

/// Where one key travels: at element `at` of packed buffer `bucket`, or alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Packed { bucket: usize, at: usize },
    Alone,
}

/// The packed buffers of one call: each one's home rank, dtype and length, and every key's
/// route. Every rank computes the same from the same keys (lengths, dtypes, homes), in order.
#[derive(Debug, PartialEq, Eq)]
struct Buckets {
    routes: Vec<Route>,
    buffers: Vec<(usize, DType, usize)>,
}

/// Packs the keys (length, dtype, home rank) of fewer than [`PACK_MAX_BYTES`] bytes by
/// (home, dtype), each at an offset aligned to 16 bytes.
fn buckets(keys: impl Iterator<Item = (usize, DType, usize)>) -> Buckets {
    let mut index: BTreeMap<(usize, &'static str), usize> = BTreeMap::new();
    let mut buffers: Vec<(usize, DType, usize)> = Vec::new();
    let routes = keys
        .map(|(len, dtype, root)| {
            if len * dtype.size() >= PACK_MAX_BYTES {
                return Route::Alone;
            }
            let bucket = *index.entry((root, dtype.name())).or_insert_with(|| {
                buffers.push((root, dtype, 0));
                buffers.len() - 1
            });
            let align = (16 / dtype.size()).max(1);
            let end = &mut buffers[bucket].2;
            let at = end.div_ceil(align) * align;
            *end = at + len;
            Route::Packed { bucket, at }
        })
        .collect();
    Buckets { routes, buffers }
}

/// The device address of element `at` of `a` (an array on a GPU).
fn address(a: &NDArray, at: usize) -> Result<GpuPtr> {
    match &*a.read() {
        Storage::Gpu(b) => Ok(GpuPtr {
            ordinal: b.ordinal(),
            addr: b.ptr() + (at * b.dtype().size()) as u64,
        }),
        Storage::Host(_) => Err(Error::internal("a GPU rank's value in host memory")),
    }
}

/// A copy of `len` elements of `dtype` from `src` (element `from`) to `dst` (element `to`).
fn copy(
    dst: &NDArray,
    to: usize,
    src: &NDArray,
    from: usize,
    len: usize,
    dtype: DType,
) -> Result<DeviceCopy> {
    Ok(DeviceCopy {
        dst: address(dst, to)?,
        src: address(src, from)?,
        bytes: len * dtype.size(),
        dtype,
    })
}

/// One zeroed buffer per bucket, on this rank's GPU.
fn bucket_buffers(rc: &RankComm, b: &Buckets) -> Result<Vec<NDArray>> {
    let gpu = Device::Gpu(rc.ordinal());
    b.buffers
        .iter()
        .map(|&(_, dtype, len)| NDArray::full_on(Shape::new(&[len])?, 0.0, dtype, gpu))
        .collect()
}

/// Sums every rank's `sums` (each key's sum on this rank's GPU, with its home rank) onto the
/// home. Returns the total on the home rank, `None` elsewhere.
pub(super) fn reduce(rc: &RankComm, sums: Vec<(NDArray, usize)>) -> Result<Vec<Option<NDArray>>> {
    let plan = buckets(sums.iter().map(|(a, root)| (a.size(), a.dtype(), *root)));
    let packed = bucket_buffers(rc, &plan)?;
    let mut copies = Vec::new();
    for ((sum, _), route) in sums.iter().zip(&plan.routes) {
        if let Route::Packed { bucket, at } = *route {
            copies.push(copy(&packed[bucket], at, sum, 0, sum.size(), sum.dtype())?);
        }
    }
    copy_many(&copies)?;
    let mut ops: Vec<InPlace<'_>> = (packed.iter().zip(&plan.buffers))
        .map(|(buf, &(root, _, _))| InPlace::Reduce { buf, root })
        .collect();
    for ((sum, root), route) in sums.iter().zip(&plan.routes) {
        if *route == Route::Alone {
            ops.push(InPlace::Reduce {
                buf: sum,
                root: *root,
            });
        }
    }
    rc.group(&ops)?;
    drop(ops);
    // The home takes each packed key's total out of its buffer.
    let gpu = Device::Gpu(rc.ordinal());
    let mut copies = Vec::new();
    let mut totals = Vec::with_capacity(sums.len());
    for ((sum, root), route) in sums.into_iter().zip(&plan.routes) {
        let total = match *route {
            _ if root != rc.rank() => None,
            Route::Alone => Some(sum),
            Route::Packed { bucket, at } => {
                let total = NDArray::full_on(sum.shape(), 0.0, sum.dtype(), gpu)?;
                copies.push(copy(
                    &total,
                    0,
                    &packed[bucket],
                    at,
                    sum.size(),
                    sum.dtype(),
                )?);
                Some(total)
            }
        };
        totals.push(total);
    }
    copy_many(&copies)?;
    Ok(totals)
}

/// One key of a GPU gather: the home's copy of the value (on the home rank), its shape and
/// dtype, and its home rank.
pub(crate) struct GpuPiece {
    pub data: Option<NDArray>,
    pub shape: Shape,
    pub dtype: DType,
    pub root: usize,
}

/// Brings every key's value from its home rank to every rank's GPU.
pub(super) fn gather(rc: &RankComm, mut pieces: Vec<GpuPiece>) -> Result<Vec<NDArray>> {
    let plan = buckets(pieces.iter().map(|p| (p.shape.size(), p.dtype, p.root)));
    let packed = bucket_buffers(rc, &plan)?;
    let gpu = Device::Gpu(rc.ordinal());
    // The home packs its values; a key alone travels in the home's copy, or in zeros.
    let mut copies = Vec::new();
    let mut sources = Vec::new();
    let mut alone = Vec::with_capacity(pieces.len());
    for (p, route) in pieces.iter_mut().zip(&plan.routes) {
        let mine = p.data.take().filter(|_| p.root == rc.rank());
        match (*route, mine) {
            (Route::Packed { bucket, at }, Some(d)) => {
                copies.push(copy(&packed[bucket], at, &d, 0, p.shape.size(), p.dtype)?);
                // Kept until the copies are enqueued: a buffer is freed on its stream, which
                // must see the copy first.
                sources.push(d);
                alone.push(None);
            }
            (Route::Packed { .. }, None) => alone.push(None),
            (Route::Alone, Some(d)) => alone.push(Some(d)),
            (Route::Alone, None) => alone.push(Some(NDArray::full_on(p.shape, 0.0, p.dtype, gpu)?)),
        }
    }
    copy_many(&copies)?;
    drop(sources);
    let mut ops: Vec<InPlace<'_>> = (packed.iter().zip(&plan.buffers))
        .map(|(buf, &(root, _, _))| InPlace::Broadcast { buf, root })
        .collect();
    for (p, buf) in pieces.iter().zip(&alone) {
        if let Some(buf) = buf {
            ops.push(InPlace::Broadcast { buf, root: p.root });
        }
    }
    rc.group(&ops)?;
    drop(ops);
    // Every rank takes each packed key's value out of its buffer.
    let mut copies = Vec::new();
    let mut values = Vec::with_capacity(pieces.len());
    for ((p, route), buf) in pieces.iter().zip(&plan.routes).zip(alone) {
        let value = match (*route, buf) {
            (Route::Packed { bucket, at }, _) => {
                let value = NDArray::full_on(p.shape, 0.0, p.dtype, gpu)?;
                copies.push(copy(
                    &value,
                    0,
                    &packed[bucket],
                    at,
                    p.shape.size(),
                    p.dtype,
                )?);
                value
            }
            (Route::Alone, Some(buf)) => buf,
            (Route::Alone, None) => return Err(Error::internal("a key alone with no buffer")),
        };
        values.push(value);
    }
    copy_many(&copies)?;
    Ok(values)
}

/// A copy of elements `range` of `a` (an array on this rank's GPU), as a flat array of its own.
pub(super) fn slice(a: &NDArray, range: Range<usize>) -> Result<NDArray> {
    let gpu = a.device();
    let part = NDArray::full_on(Shape::new(&[range.len()])?, 0.0, a.dtype(), gpu)?;
    copy_many(&[copy(&part, 0, a, range.start, range.len(), a.dtype())?])?;
    Ok(part)
}

/// `a` laid out in a buffer of `len` elements (its own elements first, zeros after), on its
/// GPU: `a` itself when it is that long already.
fn padded(a: NDArray, len: usize) -> Result<NDArray> {
    if a.size() == len {
        return Ok(a);
    }
    let buf = NDArray::full_on(Shape::new(&[len])?, 0.0, a.dtype(), a.device())?;
    copy_many(&[copy(&buf, 0, &a, 0, a.size(), a.dtype())?])?;
    Ok(buf)
}

/// Sums every rank's `sums` (each a sliced key's sum on this rank's GPU, of the key's whole
/// length) and leaves each rank its slice of the total ([`slice_range`]), as a flat array:
/// one NCCL reduce-scatter per key, over the key padded to a block per rank.
pub(super) fn reduce_scatter(rc: &RankComm, sums: Vec<NDArray>) -> Result<Vec<NDArray>> {
    let (rank, size) = (rc.rank(), rc.size());
    sums.into_iter()
        .map(|sum| {
            let len = sum.size();
            let block = slice_block(len, size);
            let send = padded(sum, block * size)?;
            let recv = NDArray::full_on(Shape::new(&[block])?, 0.0, send.dtype(), send.device())?;
            rc.reduce_scatter(&send, &recv)?;
            let mine = slice_range(len, size, rank);
            match mine.len() == block {
                true => Ok(recv),
                false => slice(&recv, 0..mine.len()),
            }
        })
        .collect()
}

/// Rank 0's value of sliced keys, scattered: each rank gets its own slice of each key, flat, on
/// its GPU. `values`: each key's whole value on rank 0 (`None` elsewhere), its length and
/// dtype. NCCL has no scatter, so each slice goes out in a broadcast of its own from rank 0,
/// and a rank that does not keep it receives it into one scratch block: no rank but rank 0
/// ever holds more than a block of a key beyond its own slice.
pub(super) fn scatter(
    rc: &RankComm,
    values: Vec<(Option<NDArray>, usize, DType)>,
) -> Result<Vec<NDArray>> {
    let (rank, size) = (rc.rank(), rc.size());
    let gpu = Device::Gpu(rc.ordinal());
    values
        .into_iter()
        .map(|(whole, len, dtype)| {
            let block = slice_block(len, size);
            let flat = |n: usize| NDArray::full_on(Shape::new(&[n])?, 0.0, dtype, gpu);
            let scratch = flat(block)?;
            let mut kept = None;
            for to in 0..size {
                let range = slice_range(len, size, to);
                // Another rank's slice lands in the scratch block (or, where that slice is
                // shorter, in a buffer of its length).
                let buf = match (to == rank, range.len() == block) {
                    (false, true) => scratch.clone(),
                    _ => flat(range.len())?,
                };
                if let (0, Some(w)) = (rank, &whole) {
                    copy_many(&[copy(&buf, 0, w, range.start, range.len(), dtype)?])?;
                }
                if to != 0 {
                    rc.broadcast(&buf, 0)?;
                }
                if to == rank {
                    kept = Some(buf);
                }
            }
            kept.ok_or_else(|| Error::internal("a scattered key left this rank no slice"))
        })
        .collect()
}

/// Every rank's slice of sliced keys, on every rank's GPU: `parts` holds this rank's slice of
/// each key and the key's whole length. One NCCL all-gather per key, over blocks padded to
/// one length.
pub(super) fn all_gather(rc: &RankComm, parts: Vec<(NDArray, usize)>) -> Result<Vec<NDArray>> {
    let size = rc.size();
    parts
        .into_iter()
        .map(|(part, len)| {
            let block = slice_block(len, size);
            let send = padded(part, block)?;
            let recv = NDArray::full_on(
                Shape::new(&[block * size])?,
                0.0,
                send.dtype(),
                send.device(),
            )?;
            rc.all_gather(&send, &recv)?;
            match block * size == len {
                true => Ok(recv),
                false => slice(&recv, 0..len),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_keys_pack_by_home_and_dtype_and_big_ones_travel_alone() {
        let big = PACK_MAX_BYTES / 4;
        let keys = [
            (10, DType::F32, 0),
            (3, DType::F16, 0),
            (big, DType::F32, 1),
            (5, DType::F32, 1),
            (7, DType::F32, 0),
            (2, DType::F64, 0),
        ];
        let b = buckets(keys.into_iter());
        assert_eq!(
            b.routes,
            [
                Route::Packed { bucket: 0, at: 0 },
                Route::Packed { bucket: 1, at: 0 },
                Route::Alone,
                Route::Packed { bucket: 2, at: 0 },
                // Aligned to 16 bytes: 4 f32 elements.
                Route::Packed { bucket: 0, at: 12 },
                Route::Packed { bucket: 3, at: 0 },
            ]
        );
        assert_eq!(
            b.buffers,
            [
                (0, DType::F32, 19),
                (0, DType::F16, 3),
                (1, DType::F32, 5),
                (0, DType::F64, 2),
            ]
        );
    }
}

//! Across ranks that keep their values where the link moves them in place
//! ([`Round::in_place`]): GPU ranks, NCCL between their GPUs, and the loopback link's stand-in
//! for them in tests, on host memory.
//!
//! A sliced key's push is one reduce-scatter ([`reduce_scatter`]), its pull one all-gather
//! ([`all_gather`]), its init a broadcast per slice ([`scatter`]). Whole keys of fewer than
//! [`PACK_MAX_BYTES`] travel packed, one buffer per (home rank, dtype), filled and emptied by
//! batched device copies ([`copy_many`]); bigger keys travel alone, in place. A call's
//! collectives go out in one [`Round::in_place`], with no copy through host memory. The
//! fingerprint check and the bounds on every wait are the link's.

use std::collections::BTreeMap;

use super::{Dist, PACK_MAX_BYTES};
use crate::backend::cuda::{copy_many, DeviceCopy, GpuPtr};
use crate::comm::link::{ArrayOp, Round};
use crate::comm::spread::{slice_block, slice_range};
use crate::host::with_host;
use crate::ndarray::Storage;
use crate::{DType, Device, Element, Error, NDArray, Result, Shape};

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
        Storage::Host(_) => Err(Error::internal("a copy from host memory onto a GPU")),
    }
}

/// A copy of `len` elements from `src` (element `from`) into `dst` (element `to`), arrays of
/// one dtype in one place ([`copy`] makes one).
struct Copy<'a> {
    dst: &'a NDArray,
    to: usize,
    src: &'a NDArray,
    from: usize,
    len: usize,
}

/// A [`Copy`].
fn copy<'a>(dst: &'a NDArray, to: usize, src: &'a NDArray, from: usize, len: usize) -> Copy<'a> {
    Copy {
        dst,
        to,
        src,
        from,
        len,
    }
}

/// Runs `copies`, in order: batched device copies on GPUs ([`copy_many`]), plain ones in host
/// memory.
fn copy_all(copies: &[Copy<'_>]) -> Result<()> {
    let mut device = Vec::new();
    for c in copies.iter().filter(|c| c.len > 0) {
        let dtype = c.dst.dtype();
        if c.dst.device().is_gpu() {
            device.push(DeviceCopy {
                dst: address(c.dst, c.to)?,
                src: address(c.src, c.from)?,
                bytes: c.len * dtype.size(),
                dtype,
            });
            continue;
        }
        let src = c.src.read();
        let (Storage::Host(dst), Storage::Host(src)) = (&mut *c.dst.write(), &*src) else {
            return Err(Error::internal("a copy from a GPU into host memory"));
        };
        with_host!(dst, d: T => {
            let s = T::slice(src).and_then(|s| s.get(c.from..c.from + c.len));
            match (s, d.get_mut(c.to..c.to + c.len)) {
                (Some(s), Some(d)) => d.copy_from_slice(s),
                _ => return Err(Error::internal("a copy outside its buffers")),
            }
        });
    }
    match device.is_empty() {
        true => Ok(()),
        false => copy_many(&device),
    }
}

/// One zeroed buffer per bucket, where this rank keeps its values.
fn bucket_buffers(home: Device, b: &Buckets) -> Result<Vec<NDArray>> {
    b.buffers
        .iter()
        .map(|&(_, dtype, len)| NDArray::full_on(Shape::new(&[len])?, 0.0, dtype, home))
        .collect()
}

/// Sums every rank's `sums` (each key's sum where this rank keeps its values, with its home
/// rank) onto the home. Returns the total on the home rank, `None` elsewhere.
pub(crate) fn reduce(
    round: &mut dyn Round,
    d: &Dist,
    sums: Vec<(NDArray, usize)>,
) -> Result<Vec<Option<NDArray>>> {
    let plan = buckets(sums.iter().map(|(a, root)| (a.size(), a.dtype(), *root)));
    let packed = bucket_buffers(d.home(), &plan)?;
    let mut copies = Vec::new();
    for ((sum, _), route) in sums.iter().zip(&plan.routes) {
        if let Route::Packed { bucket, at } = *route {
            copies.push(copy(&packed[bucket], at, sum, 0, sum.size()));
        }
    }
    copy_all(&copies)?;
    let mut ops: Vec<ArrayOp<'_>> = (packed.iter().zip(&plan.buffers))
        .map(|(buf, &(root, _, _))| ArrayOp::Reduce { buf, root })
        .collect();
    for ((buf, root), route) in sums.iter().zip(&plan.routes) {
        if *route == Route::Alone {
            ops.push(ArrayOp::Reduce { buf, root: *root });
        }
    }
    round.in_place(&ops)?;
    // The home takes each packed key's total out of its buffer.
    let totals = (sums.iter().zip(&plan.routes))
        .map(|((sum, root), route)| match *route {
            Route::Packed { .. } if *root == d.rank() => {
                NDArray::full_on(sum.shape(), 0.0, sum.dtype(), d.home()).map(Some)
            }
            _ => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut copies = Vec::new();
    for ((total, (sum, _)), route) in totals.iter().zip(&sums).zip(&plan.routes) {
        if let (Some(total), Route::Packed { bucket, at }) = (total, *route) {
            copies.push(copy(total, 0, &packed[bucket], at, sum.size()));
        }
    }
    copy_all(&copies)?;
    Ok((totals.into_iter().zip(sums).zip(&plan.routes))
        .map(|((total, (sum, root)), route)| match route {
            Route::Alone if root == d.rank() => Some(sum),
            _ => total,
        })
        .collect())
}

/// One key of an in-place gather: the home's copy of the value (on the home rank), its shape
/// and dtype, and its home rank.
pub(crate) struct Piece {
    pub data: Option<NDArray>,
    pub shape: Shape,
    pub dtype: DType,
    pub root: usize,
}

/// Brings every key's value from its home rank to every rank, where it keeps its values.
pub(crate) fn gather(round: &mut dyn Round, d: &Dist, pieces: Vec<Piece>) -> Result<Vec<NDArray>> {
    let plan = buckets(pieces.iter().map(|p| (p.shape.size(), p.dtype, p.root)));
    let packed = bucket_buffers(d.home(), &plan)?;
    // Each key alone travels in the home's copy, or in zeros; the home packs the others.
    let mut mine = Vec::with_capacity(pieces.len());
    let mut alone = Vec::with_capacity(pieces.len());
    for (p, route) in pieces.into_iter().zip(&plan.routes) {
        let data = p.data.filter(|_| p.root == d.rank());
        let buf = match (*route, &data) {
            (Route::Alone, Some(v)) => v.clone(),
            _ => NDArray::full_on(p.shape, 0.0, p.dtype, d.home())?,
        };
        mine.push(data);
        alone.push((buf, p.root));
    }
    let copies: Vec<Copy<'_>> = (mine.iter().zip(&plan.routes))
        .filter_map(|(data, route)| match (route, data) {
            (Route::Packed { bucket, at }, Some(v)) => {
                Some(copy(&packed[*bucket], *at, v, 0, v.size()))
            }
            _ => None,
        })
        .collect();
    copy_all(&copies)?;
    drop(copies);
    // Kept until the copies are enqueued: a buffer is freed on its stream, which must see the
    // copy first.
    drop(mine);
    let mut ops: Vec<ArrayOp<'_>> = (packed.iter().zip(&plan.buffers))
        .map(|(buf, &(root, _, _))| ArrayOp::Broadcast { buf, root })
        .collect();
    for ((buf, root), route) in alone.iter().zip(&plan.routes) {
        if *route == Route::Alone {
            ops.push(ArrayOp::Broadcast { buf, root: *root });
        }
    }
    round.in_place(&ops)?;
    // Every rank takes each packed key's value out of its buffer.
    let copies: Vec<Copy<'_>> = (alone.iter().zip(&plan.routes))
        .filter_map(|((value, _), route)| match *route {
            Route::Packed { bucket, at } => Some(copy(value, 0, &packed[bucket], at, value.size())),
            Route::Alone => None,
        })
        .collect();
    copy_all(&copies)?;
    Ok(alone.into_iter().map(|(value, _)| value).collect())
}

/// `a` as a flat buffer of `len` elements in the same place: `a` itself when it is that long,
/// else its first elements, then zeros.
fn resized(a: NDArray, len: usize) -> Result<NDArray> {
    if a.size() == len {
        return Ok(a);
    }
    let buf = NDArray::full_on(Shape::new(&[len])?, 0.0, a.dtype(), a.device())?;
    copy_all(&[copy(&buf, 0, &a, 0, a.size().min(len))])?;
    Ok(buf)
}

/// Sums every rank's `sums` (sliced keys' whole sums) and leaves each rank its slice of the
/// total ([`slice_range`]), flat: one reduce-scatter per key, padded to a block per rank.
pub(crate) fn reduce_scatter(
    round: &mut dyn Round,
    d: &Dist,
    sums: Vec<NDArray>,
) -> Result<Vec<NDArray>> {
    let (rank, size) = (d.rank(), d.size());
    let lens: Vec<usize> = sums.iter().map(NDArray::size).collect();
    let mut pairs = Vec::with_capacity(sums.len());
    for sum in sums {
        let block = slice_block(sum.size(), size);
        let send = resized(sum, block * size)?;
        let recv = NDArray::full_on(Shape::new(&[block])?, 0.0, send.dtype(), send.device())?;
        pairs.push((send, recv));
    }
    let ops: Vec<ArrayOp<'_>> = (pairs.iter())
        .map(|(send, recv)| ArrayOp::ReduceScatter { send, recv })
        .collect();
    round.in_place(&ops)?;
    (pairs.into_iter().zip(lens))
        .map(|((_, recv), len)| resized(recv, slice_range(len, size, rank).len()))
        .collect()
}

/// Rank 0's value of sliced keys, scattered: each rank gets its own slice of each key, flat.
/// `values`: each key's whole value on rank 0 (`None` elsewhere), its length and dtype. NCCL
/// has no scatter, so each slice goes out in a broadcast of its own from rank 0, and the ranks
/// that do not keep it receive it into one scratch block.
pub(crate) fn scatter(
    round: &mut dyn Round,
    d: &Dist,
    values: Vec<(Option<NDArray>, usize, DType)>,
) -> Result<Vec<NDArray>> {
    let (rank, size) = (d.rank(), d.size());
    values
        .into_iter()
        .map(|(whole, len, dtype)| {
            let block = slice_block(len, size);
            let flat = |n: usize| NDArray::full_on(Shape::new(&[n])?, 0.0, dtype, d.home());
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
                    copy_all(&[copy(&buf, 0, w, range.start, range.len())])?;
                }
                if to != 0 {
                    round.in_place(&[ArrayOp::Broadcast { buf: &buf, root: 0 }])?;
                }
                if to == rank {
                    kept = Some(buf);
                }
            }
            kept.ok_or_else(|| Error::internal("a scattered key left this rank no slice"))
        })
        .collect()
}

/// Every rank's slice of sliced keys, on every rank (`parts`: this rank's slice of each key, and
/// the key's length): one all-gather per key, over blocks padded to one length.
pub(crate) fn all_gather(
    round: &mut dyn Round,
    d: &Dist,
    parts: Vec<(NDArray, usize)>,
) -> Result<Vec<NDArray>> {
    let size = d.size();
    let mut pairs = Vec::with_capacity(parts.len());
    for (part, len) in parts {
        let block = slice_block(len, size);
        let send = resized(part, block)?;
        let all = Shape::new(&[block * size])?;
        let recv = NDArray::full_on(all, 0.0, send.dtype(), send.device())?;
        pairs.push((send, recv, len));
    }
    let ops: Vec<ArrayOp<'_>> = (pairs.iter())
        .map(|(send, recv, _)| ArrayOp::AllGather { send, recv })
        .collect();
    round.in_place(&ops)?;
    (pairs.into_iter())
        .map(|(_, recv, len)| resized(recv, len))
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

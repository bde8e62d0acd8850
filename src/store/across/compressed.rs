//! The across-ranks step of a compressed push: each rank's contribution encoded with its
//! residual, the encoded parts exchanged in one all-to-all, decoded and summed in rank order.

use std::sync::MutexGuard;

use half::{bf16, f16};

use super::{part_shape, Inputs, Mine};
use crate::comm::dist::{Blocks, Dist, Pool};
use crate::comm::link::Round;

use crate::compress::{
    half_encode_into, two_bit_decode, two_bit_quantize, two_bit_words, Compression, HalfWire,
    TwoBitTable,
};
use crate::host::HostData;
use crate::store::compress::{lock, take_residuals, Residuals};
use crate::store::groups::Group;
use crate::{cpu, DType, Element, Error, NDArray, Result};

/// A compressed push's step across ranks. Each rank's contribution (the sum of its values, as
/// MXNet's workers sum their devices first) is encoded with its residual of the key; each rank
/// sends every rank the encoded part that rank holds, in one all-to-all (2-bit: about a
/// sixteenth of the float32 bytes; 16-bit: about half), then decodes and sums every rank's part
/// in rank order. Returns the totals and the residuals to keep once the push has succeeded.
pub(super) fn sum_encoded(
    call: &mut dyn Round,
    d: &Dist,
    compression: Compression,
    groups: &[Group<'_>],
    mine: Vec<Mine<'_>>,
) -> Result<(Inputs, Vec<Residuals>)> {
    let size = d.size();
    // Each key's kept residual (one value per key: position 0), read under its lock; zeros
    // before the key's first push. The new ones go into pooled buffers, kept by `commit`.
    let committed: Vec<MutexGuard<'_, Residuals>> =
        groups.iter().map(|g| lock(&g.slot.residuals)).collect();
    let pool = d.pool();
    let mut kept: Vec<Residuals> = groups
        .iter()
        .map(|g| take_residuals(pool, 1, g.slot.shape.size()))
        .collect();
    let mut encoded = Encoded {
        pool,
        groups,
        committed: &committed,
        kept: &mut kept,
        bufs: Vec::with_capacity(groups.len()),
    };
    let piece = |g: &Group<'_>, r: usize| g.slot.spread.piece(g.slot.shape.size(), r, size);
    let totals = match compression {
        Compression::TwoBit { threshold } => {
            encoded.each(
                mine,
                DType::F32,
                two_bit_words,
                |value, residual, left, out| {
                    let words: &mut [u32] = bytemuck::cast_slice_mut(
                        f32::slice_mut(out)
                            .ok_or_else(|| Error::internal("a pooled buffer of another dtype"))?,
                    );
                    two_bit_quantize(value, residual, left, threshold, words);
                    Ok(())
                },
            )?;
            two_bit_across(call, d, groups, &encoded.bufs, threshold)
        }
        Compression::Half { dtype: DType::F16 } => {
            encoded.each(mine, DType::F16, |n| n, half_into::<f16>)?;
            half_across::<f16>(call, d, groups, &encoded.bufs, piece)
        }
        Compression::Half { .. } => {
            encoded.each(mine, DType::BF16, |n| n, half_into::<bf16>)?;
            half_across::<bf16>(call, d, groups, &encoded.bufs, piece)
        }
        Compression::None => Err(Error::internal("a compressed sum without compression")),
    };
    for buf in encoded.bufs.drain(..) {
        pool.give(buf);
    }
    Ok((Inputs::Totals(totals?), kept))
}

/// [`half_encode_into`] into a pooled buffer of `H`.
fn half_into<H: HalfWire>(
    value: &[f32],
    residual: &[f32],
    left: &mut [f32],
    out: &mut HostData,
) -> Result<()> {
    let out =
        H::slice_mut(out).ok_or_else(|| Error::internal("a pooled buffer of another dtype"))?;
    half_encode_into(value, residual, left, out);
    Ok(())
}

/// Each key's contribution encoded with its residual, into pooled buffers: the value is read
/// where it lies (a caller's array, or this rank's own sum), never copied first, and no
/// buffer is faulted in fresh on every push.
struct Encoded<'a, 'g> {
    pool: &'a Pool,
    groups: &'a [Group<'g>],
    committed: &'a [MutexGuard<'a, Residuals>],
    kept: &'a mut [Residuals],
    /// Per key, its encoding: `units(n)` elements of the wire's dtype.
    bufs: Vec<HostData>,
}

impl Encoded<'_, '_> {
    /// Encodes every key's value of `mine` into a buffer of `units(n)` elements of `dtype`, by
    /// `encode(value, residual, left, out)`, where `left` takes the new residual.
    fn each(
        &mut self,
        mine: Vec<Mine<'_>>,
        dtype: DType,
        units: impl Fn(usize) -> usize,
        mut encode: impl FnMut(&[f32], &[f32], &mut [f32], &mut HostData) -> Result<()>,
    ) -> Result<()> {
        for (k, (g, m)) in self.groups.iter().zip(mine).enumerate() {
            let n = g.slot.shape.size();
            let zeros;
            let residual: &[f32] = match self.committed[k].first() {
                Some(r) if r.len() == n => r,
                _ => {
                    zeros = vec![0.0; n];
                    &zeros
                }
            };
            let mut out = self.pool.take(dtype, units(n), units(n));
            let left = &mut self.kept[k][0];
            with_value(m, |value| {
                if value.len() != n {
                    return Err(Error::internal(&format!(
                        "a compressed contribution of {} elements for a key of {n}",
                        value.len()
                    )));
                }
                encode(value, residual, left, &mut out)
            })??;
            self.bufs.push(out);
        }
        Ok(())
    }
}

/// Runs `f` on a key's contribution in host memory, as float32 (compressed keys are float32),
/// read where it lies.
fn with_value<R>(m: Mine<'_>, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    match m {
        Mine::Owned(HostData::F32(v)) => Ok(f(&v)),
        Mine::Owned(h) => Ok(f(&h.to_vec())),
        Mine::Single(a) => a.with_host(|h| match h {
            HostData::F32(v) => f(v),
            other => f(&other.to_vec()),
        }),
        // GPU ranks read their sums back before the call (`contributions`).
        Mine::Summed(_) => Err(Error::internal(
            "a compressed contribution not in host memory",
        )),
    }
}

/// The 2-bit wire's step across ranks: the words covering each part exchanged, decoded and
/// summed.
fn two_bit_across(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    encoded: &[HostData],
    threshold: f32,
) -> Result<Vec<Option<NDArray>>> {
    // The words covering a part: 16 elements to a word, from the key's first element.
    let span = |g: &Group<'_>, r: usize| {
        let p = g.slot.spread.piece(g.slot.shape.size(), r, d.size());
        match p.is_empty() {
            true => 0..0,
            false => p.start / 16..p.end.div_ceil(16),
        }
    };
    let table = TwoBitTable::new(threshold);
    let (mut words, mut row) = (Vec::new(), Vec::new());
    // The words travel as float32 bit patterns: the all-to-all copies them, never adds.
    exchange::<f32>(
        call,
        d,
        groups,
        encoded,
        span,
        |seg, start, range, total, add| {
            // The bit patterns themselves: a conversion (through f64, say) would quiet a word
            // that reads as a signalling NaN, and change a code.
            words.clear();
            words.extend(seg.iter().map(|w| w.to_bits()));
            let elements = range.start - 16 * start..range.end - 16 * start;
            if !add {
                return two_bit_decode(&words, &table, elements, total);
            }
            row.resize(total.len(), 0.0);
            two_bit_decode(&words, &table, elements, &mut row);
            for (t, v) in total.iter_mut().zip(&row) {
                *t += v;
            }
        },
    )
}

/// The 16-bit wire's step across ranks: the parts exchanged, decoded and summed.
fn half_across<H: HalfWire>(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    encoded: &[HostData],
    piece: impl Fn(&Group<'_>, usize) -> std::ops::Range<usize>,
) -> Result<Vec<Option<NDArray>>> {
    exchange::<H>(
        call,
        d,
        groups,
        encoded,
        piece,
        |seg, start, range, total, add| {
            let seg = &seg[range.start - start..range.end - start];
            match add {
                false => total.iter_mut().zip(seg).for_each(|(t, h)| *t = h.widen()),
                true => total.iter_mut().zip(seg).for_each(|(t, h)| *t += h.widen()),
            }
        },
    )
}

/// The all-to-all of a compressed push: `encoded[k]` is this rank's encoding of key `k` (units
/// of `T`, in a buffer of `T`), and `span(g, r)` the units that carry the part of key `g` rank `r` holds. Block `r`
/// of the send buffer holds, key by key, the spans of the keys `r` holds, with no padding
/// (except past MPI's `int` counts: [`Blocks`]); every rank lays them out alike.
/// `decode(seg, span_start, elements, total, add)` decodes a key's `elements` from a span into
/// `total`, or with `add` adds them to it. Returns, per key, the part this rank holds summed
/// over the ranks in rank order, in float32 (`None` where it holds none).
fn exchange<T: Element + Copy>(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    encoded: &[HostData],
    span: impl Fn(&Group<'_>, usize) -> std::ops::Range<usize>,
    mut decode: impl FnMut(&[T], usize, std::ops::Range<usize>, &mut [f32], bool),
) -> Result<Vec<Option<NDArray>>> {
    let (rank, size) = (d.rank(), d.size());
    // What every rank sends rank `r`: the spans of the keys `r` holds, the same on every rank.
    let lens: Vec<usize> = (0..size)
        .map(|r| groups.iter().map(|g| span(g, r).len()).sum())
        .collect();
    let blocks = Blocks::to_each(&lens);
    // Both buffers from the pool: a big key's push does not fault in fresh pages every time.
    let pool = d.pool();
    let total = blocks.send_len(rank);
    let mut send_buf = pool.take(T::DTYPE, total, total);
    let send = T::slice_mut(&mut send_buf)
        .ok_or_else(|| Error::internal("a pooled buffer of another dtype"))?;
    for r in 0..size {
        let (mut at, end) = (blocks.send_at(rank, r), blocks.send_at(rank, r + 1));
        for (g, e) in groups.iter().zip(encoded) {
            let e = T::slice(e).ok_or_else(|| Error::internal("an encoding of another dtype"))?;
            let s = &e[span(g, r)];
            crate::memcopy::copy(&mut send[at..at + s.len()], s);
            at += s.len();
        }
        // Padding, where blocks are padded: zeros, never an earlier call's words.
        send[at..end].fill(T::from_f64(0.0));
    }
    let received_len = blocks.recv_len(rank);
    let recv = pool.take(T::DTYPE, received_len, received_len);
    let ticket = blocks.start(call, send_buf, recv)?;
    let (sent, received) = call.land(ticket)?;
    pool.give(sent);
    let all = T::slice(&received)
        .ok_or_else(|| Error::internal("compressed values came back as another dtype"))?;
    let mut totals = Vec::with_capacity(groups.len());
    let mut at = 0;
    for g in groups {
        let len = g.slot.shape.size();
        let piece = g.slot.spread.piece(len, rank, size);
        if piece.is_empty() && !g.slot.spread.holds(rank) {
            totals.push(None);
            continue;
        }
        let mine = span(g, rank);
        // Pooled too (the push gives it back once the updater has run); the first rank's
        // decode writes every element.
        let mut total_buf = pool.take(DType::F32, piece.len(), piece.len());
        let total = f32::slice_mut(&mut total_buf)
            .ok_or_else(|| Error::internal("a pooled buffer of another dtype"))?;
        for r in 0..size {
            let from = blocks.recv_at(r, rank) + at;
            let seg = &all[from..from + mine.len()];
            // In rank order, in float32: the first rank's value, then + each next one.
            decode(seg, mine.start, piece.clone(), total, r > 0);
        }
        at += mine.len();
        let shape = part_shape(g, total.len());
        totals.push(Some(NDArray::from_host(total_buf, shape, cpu(0))));
    }
    pool.give(received);
    Ok(totals)
}

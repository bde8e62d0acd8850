//! The across-ranks step of a compressed push: each rank's contribution encoded with its
//! residual, the encoded parts exchanged in one all-to-all, decoded and summed in rank order.

use std::sync::MutexGuard;

use half::{bf16, f16};

use super::{part_shape, Inputs, Mine};
use crate::comm::dist::{Blocks, Dist};
use crate::comm::link::Round;
use crate::compress::{
    half_encode, two_bit_decode, two_bit_quantize, two_bit_words, Compression, HalfWire,
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
    let values = host_values(groups, mine)?;
    // Each key's kept residual (one value per key: position 0), read under its lock; zeros
    // before the key's first push. The new ones go into pooled buffers, kept by `commit`.
    let committed: Vec<MutexGuard<'_, Residuals>> =
        groups.iter().map(|g| lock(&g.slot.residuals)).collect();
    let zeros: Vec<Vec<f32>> = (committed.iter().zip(&values))
        .map(|(c, v)| match c.first() {
            Some(r) if r.len() == v.len() => Vec::new(),
            _ => vec![0.0; v.len()],
        })
        .collect();
    let residual = |k: usize| -> &[f32] {
        match committed[k].first() {
            Some(r) if r.len() == values[k].len() => r,
            _ => &zeros[k],
        }
    };
    let pool = d.pool();
    let mut kept: Vec<Residuals> = values
        .iter()
        .map(|v| take_residuals(pool, 1, v.len()))
        .collect();
    let piece = |g: &Group<'_>, r: usize| g.slot.spread.piece(g.slot.shape.size(), r, size);
    let totals = match compression {
        Compression::TwoBit { threshold } => {
            two_bit_across(call, d, groups, &values, residual, &mut kept, threshold)?
        }
        Compression::Half { dtype: DType::F16 } => {
            half_across::<f16>(call, d, groups, &values, residual, &mut kept, piece)?
        }
        Compression::Half { .. } => {
            half_across::<bf16>(call, d, groups, &values, residual, &mut kept, piece)?
        }
        Compression::None => return Err(Error::internal("a compressed sum without compression")),
    };
    Ok((Inputs::Totals(totals), kept))
}

/// Each key's contribution in host memory, as float32 (compressed keys are float32).
fn host_values(groups: &[Group<'_>], mine: Vec<Mine<'_>>) -> Result<Vec<Vec<f32>>> {
    let mut values = Vec::with_capacity(groups.len());
    for (g, m) in groups.iter().zip(mine) {
        let value: Vec<f32> = match m {
            // This rank's own sum, moved rather than copied.
            Mine::Owned(HostData::F32(v)) => v,
            Mine::Owned(h) => h.to_vec(),
            Mine::Single(a) => a.to_vec::<f32>()?,
            // GPU ranks read their sums back before the call (`contributions`).
            Mine::Summed(_) => {
                return Err(Error::internal(
                    "a compressed contribution not in host memory",
                ))
            }
        };
        if value.len() != g.slot.shape.size() {
            return Err(Error::internal(&format!(
                "a compressed contribution of {} elements for a key of {}",
                value.len(),
                g.slot.shape.size()
            )));
        }
        values.push(value);
    }
    Ok(values)
}

/// The 2-bit wire's step across ranks: each key's value plus residual quantized to 2-bit words
/// (updating `kept`), the words covering each part exchanged, decoded and summed.
fn two_bit_across<'r>(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    values: &[Vec<f32>],
    residual: impl Fn(usize) -> &'r [f32],
    kept: &mut [Residuals],
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
    // The words travel as float32 bit patterns: the all-to-all copies them, never adds.
    let encoded: Vec<Vec<f32>> = (values.iter().zip(kept.iter_mut()).enumerate())
        .map(|(k, (v, l))| {
            let mut words = vec![0u32; two_bit_words(v.len())];
            two_bit_quantize(v, residual(k), &mut l[0], threshold, &mut words);
            words.into_iter().map(f32::from_bits).collect()
        })
        .collect();
    let table = TwoBitTable::new(threshold);
    let (mut words, mut row) = (Vec::new(), Vec::new());
    exchange(
        call,
        d,
        groups,
        &encoded,
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

/// The 16-bit wire's step across ranks: each key's value plus residual rounded to `H`
/// (updating `kept`), the parts exchanged, decoded and summed.
fn half_across<'r, H: HalfWire>(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    values: &[Vec<f32>],
    residual: impl Fn(usize) -> &'r [f32],
    kept: &mut [Residuals],
    piece: impl Fn(&Group<'_>, usize) -> std::ops::Range<usize>,
) -> Result<Vec<Option<NDArray>>> {
    let encoded: Vec<Vec<H>> = (values.iter().zip(kept.iter_mut()).enumerate())
        .map(|(k, (v, l))| half_encode(v, residual(k), &mut l[0]))
        .collect();
    exchange(
        call,
        d,
        groups,
        &encoded,
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
/// of `T`), and `span(g, r)` the units that carry the part of key `g` rank `r` holds. Block `r`
/// of the send buffer holds, key by key, the spans of the keys `r` holds, with no padding
/// (except past MPI's `int` counts: [`Blocks`]); every rank lays them out alike.
/// `decode(seg, span_start, elements, total, add)` decodes a key's `elements` from a span into
/// `total`, or with `add` adds them to it. Returns, per key, the part this rank holds summed
/// over the ranks in rank order, in float32 (`None` where it holds none).
fn exchange<T: Element + Copy>(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    encoded: &[Vec<T>],
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

//! Gradient compression in the store: which stores compress, the rules on when it is set and
//! on dtypes, and a push's decoded values (each value quantized with its residual and decoded,
//! then summed in order, as MXNet's `device` store does), with the residuals kept per key and
//! per position in the push's list of values. The codec itself is [`crate::compress`].

use std::sync::{Mutex, MutexGuard};

use super::across::{part_shape, Inputs, Mine};
use super::groups::Group;
use super::{read, write, KvStore, StoreKind};
use crate::comm::dist::{Blocks, Dist, Pool};
use crate::comm::link::Round;
use crate::compress::{
    half_encode, two_bit_decode, two_bit_quantize, two_bit_words, Compression, HalfWire,
    TwoBitTable,
};
use crate::host::HostData;
use crate::{cpu, DType, Element, Error, Key, NDArray, Result};
use half::{bf16, f16};

impl KvStore {
    /// Compresses pushed values before they are summed, as MXNet's
    /// `set_gradient_compression` does (see [`Compression`]). Each value of a push is quantized
    /// with its own residual (one per key and per position in the push's list of values), the
    /// quantized values are decoded and summed in list order, and the updater gets that sum.
    /// Init and pull are never compressed.
    ///
    /// On a `dist_*` store each rank compresses the sum of its own values with its residual of
    /// the key (MXNet's workers sum their devices first, then compress), on the host (GPU
    /// ranks read their sum back first, and their words travel through host memory: the
    /// all-to-all over MPI, or over NCCL for ranks started without MPI); every rank calls it
    /// with the same setting, or the first push fails on every rank with [`Error::Desync`].
    ///
    /// Call it before the first `init`: it is an [`Error::Compression`] once the store holds
    /// keys, on a kind that does not compress (`local` and `nccl`, as in MXNet), for a
    /// threshold not above 0, and (at
    /// `init`) for a key that is not float32. A checkpoint of a `device` store (one file)
    /// carries the residuals, and a load restores them with the values; a dist store's sharded
    /// checkpoint carries each rank's own, restored by a load by as many ranks (they start at
    /// zero after a load by another number of ranks).
    ///
    /// ```
    /// use kvstore::{Compression, KvStore, NDArray};
    /// let kv = KvStore::create("device")?;
    /// kv.set_gradient_compression(Compression::two_bit(0.5))?;
    /// kv.init(0, &NDArray::zeros([4]))?;
    /// kv.push(0, &NDArray::from_vec(vec![0.7f32, -0.2, 0.5, -0.9], [4])?)?;
    /// let out = NDArray::zeros([4]);
    /// kv.pull(0, &out)?;
    /// assert_eq!(out.to_vec::<f32>()?, [0.5, 0.0, 0.5, -0.5]);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn set_gradient_compression(&self, compression: Compression) -> Result<()> {
        let op = "set_gradient_compression";
        compression.check()?;
        if let StoreKind::Local | StoreKind::Nccl = self.kind {
            return Err(Error::Compression {
                op,
                message: format!(
                    "a '{}' store does not compress (MXNet compresses on 'device' and dist \
                     stores): create the store as 'device'",
                    self.name
                ),
            });
        }
        // Under the table's lock: no init can add a key meanwhile.
        let table = write(&self.table);
        if !table.slots.is_empty() {
            return Err(Error::Compression {
                op,
                message: format!(
                    "the store already holds {} keys: set the compression before the first \
                     init (the residuals of keys pushed uncompressed would be missing)",
                    table.slots.len()
                ),
            });
        }
        *write(&self.compression) = compression;
        Ok(())
    }

    /// The gradient compression in force.
    pub fn gradient_compression(&self) -> Compression {
        *read(&self.compression)
    }
}

/// An [`Error::Compression`] if compression is on and a value is not float32 (MXNet's 2-bit
/// kernels work on float32 only).
pub(super) fn check_dtypes(
    compression: Compression,
    keys: &[Key],
    values: &[NDArray],
) -> Result<()> {
    match (keys.iter().zip(values))
        .find_map(|(key, v)| dtype_refusal(compression, "init", key, v.dtype()))
    {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// The rule on dtypes under compression, for an init and for a load: an
/// [`Error::Compression`] when compression is on and `key` is not float32 (MXNet's 2-bit
/// kernels work on float32 only), or `None`. `op`: how the key came ("init", "load").
pub(super) fn dtype_refusal(
    compression: Compression,
    op: &'static str,
    key: &Key,
    dtype: DType,
) -> Option<Error> {
    if !compression.is_on() || dtype == DType::F32 {
        return None;
    }
    let fix = match op {
        "init" => "init it with .astype(DType::F32)",
        _ => "load it into a store without gradient compression, or save it as float32",
    };
    Some(Error::Compression {
        op,
        message: format!(
            "key {key} is {dtype}, but compressed keys must be float32 (as in MXNet): {fix}"
        ),
    })
}

/// A key's residuals: one per position in a push's list of values.
pub(super) type Residuals = Vec<Vec<f32>>;

/// Per group, the sum of its values after compression, as an array of the key's shape on the
/// host, and the residuals that sum leaves (to be kept with [`commit`] once the push has
/// succeeded: a failed push changes nothing). The caller holds the groups' write locks.
pub(super) fn decoded_totals(
    compression: Compression,
    groups: &[Group<'_>],
    pool: &Pool,
) -> Result<(Vec<Option<NDArray>>, Vec<Residuals>)> {
    let mut totals = Vec::with_capacity(groups.len());
    let mut kept = Vec::with_capacity(groups.len());
    for g in groups {
        let n = g.slot.shape.size();
        let committed = lock(&g.slot.residuals);
        let positions = committed.len().max(g.arrays.len());
        let mut left = take_residuals(pool, positions, n);
        let zeros = match committed.len() < g.arrays.len() {
            true => vec![0.0; n],
            false => Vec::new(),
        };
        let mut total: Vec<f32> = Vec::new();
        for (i, (a, l)) in g.arrays.iter().zip(left.iter_mut()).enumerate() {
            let residual = committed.get(i).map_or(&zeros[..], |r| &r[..]);
            let decoded = compression.round_trip(&a.to_vec::<f32>()?, residual, l);
            if total.is_empty() {
                total = decoded;
            } else {
                // In list order, in float32: ((v0 + v1) + v2) + ..., as MXNet sums.
                for (t, d) in total.iter_mut().zip(&decoded) {
                    *t += d;
                }
            }
        }
        // Positions this push did not fill keep their residuals.
        for (l, r) in left.iter_mut().zip(committed.iter()).skip(g.arrays.len()) {
            crate::memcopy::copy(l, r);
        }
        totals.push(Some(NDArray::from_vec(total, g.slot.shape)?));
        kept.push(left);
    }
    Ok((totals, kept))
}

/// Keeps the residuals of a push that succeeded; the ones they replace go back to `pool`.
pub(super) fn commit(groups: &[Group<'_>], residuals: Vec<Residuals>, pool: &Pool) {
    for (g, r) in groups.iter().zip(residuals) {
        let old = std::mem::replace(&mut *lock(&g.slot.residuals), r);
        for r in old {
            pool.give(HostData::F32(r));
        }
    }
}

fn lock(residuals: &Mutex<Residuals>) -> MutexGuard<'_, Residuals> {
    residuals.lock().unwrap_or_else(|e| e.into_inner())
}

/// Buffers for `positions` residuals of `n` elements, from `pool` (a push writes its new
/// residuals there instead of changing a copy of the kept ones), each of exactly `n` elements'
/// room: a key keeps its residual, so it must never hold a bigger buffer. Their contents are
/// unspecified: the quantizers write every element.
fn take_residuals(pool: &Pool, positions: usize, n: usize) -> Residuals {
    (0..positions)
        .map(|_| match pool.take_exact(DType::F32, n) {
            HostData::F32(v) => v,
            other => vec![0.0; other.len()],
        })
        .collect()
}

/// A compressed push's step across ranks (a `dist_*` store). Each rank's contribution (the
/// sum of its values, uncompressed, as MXNet's workers sum their devices first; read back
/// from a GPU rank's GPU before the call) is encoded with this rank's residual of the key (2-bit words, or 16-bit floats); each
/// rank sends every rank the encoded part of the key that rank holds, in one all-to-all (for
/// 2-bit about a sixteenth of the key's float32 bytes leaves and reaches each rank, for 16-bit
/// about half), and each rank decodes every rank's part and sums them in rank order. Returns
/// the totals and the residuals to keep once the push has succeeded.
pub(super) fn sum_across(
    call: &mut dyn Round,
    d: &Dist,
    compression: Compression,
    groups: &[Group<'_>],
    mine: Vec<Mine<'_>>,
) -> Result<(Inputs, Vec<Residuals>)> {
    let size = d.size();
    let mut values = Vec::with_capacity(groups.len());
    for (g, m) in groups.iter().zip(mine) {
        let value: Vec<f32> = match m {
            // This rank's own sum, moved rather than copied (compressed keys are float32).
            Mine::Owned(HostData::F32(v)) => v,
            Mine::Owned(h) => h.to_vec(),
            Mine::Single(a) => a.to_vec::<f32>()?,
            // GPU ranks read their sums back before the call (`contributions`).
            Mine::Summed(_) => {
                return Err(crate::comm::dist::internal(
                    "a compressed contribution not in host memory",
                ))
            }
        };
        if value.len() != g.slot.shape.size() {
            return Err(crate::comm::dist::internal(&format!(
                "a compressed contribution of {} elements for a key of {}",
                value.len(),
                g.slot.shape.size()
            )));
        }
        values.push(value);
    }
    // Each key's kept residual (a rank compresses one value per key: position 0), read under
    // its lock (the call, which holds the rank's lock, keeps every other reader out); zeros
    // before the key's first push.
    // The new residuals are written into pooled buffers, kept by `commit` on success.
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
            // The words covering a part: 16 elements to a word, from the key's first element.
            let span = |g: &Group<'_>, r: usize| {
                let p = piece(g, r);
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
                    // The bit patterns themselves: a conversion (through f64, say) would quiet a
                    // word that reads as a signalling NaN, and change a code.
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
            )?
        }
        Compression::Half { dtype: DType::F16 } => {
            half_across::<f16>(call, d, groups, &values, residual, &mut kept, piece)?
        }
        Compression::Half { .. } => {
            half_across::<bf16>(call, d, groups, &values, residual, &mut kept, piece)?
        }
        Compression::None => {
            return Err(crate::comm::dist::internal(
                "a compressed sum without compression",
            ))
        }
    };
    Ok((Inputs::Totals(totals), kept))
}

/// The 16-bit wire's step across ranks: each key's value plus residual rounded to `H` (the
/// residuals in `kept` updated), the parts exchanged, decoded and summed.
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
/// of the send buffer holds, key by key, the spans of the keys `r` holds, and nothing more:
/// blocks are of unequal lengths, and no padding travels (except past MPI's `int` counts:
/// [`Blocks`]). Every rank lays them out alike (the
/// fingerprint made the keys, shapes and spreads the same), so each finds its spans in every
/// rank's block. `decode(seg, span_start, elements, total, add)` decodes a key's `elements`
/// from a span into `total`, or with `add` adds them to it. Returns,
/// per key, the part this rank holds summed over the ranks in rank order, in float32 (`None`
/// where it holds none).
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
        .ok_or_else(|| crate::comm::dist::internal("a pooled buffer of another dtype"))?;
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
    let all = T::slice(&received).ok_or_else(|| {
        crate::comm::dist::internal("compressed values came back as another dtype")
    })?;
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
            .ok_or_else(|| crate::comm::dist::internal("a pooled buffer of another dtype"))?;
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

//! The across-ranks step of a compressed push: each rank's contribution encoded with its
//! residual, the encoded parts exchanged in all-to-alls, decoded and summed in rank order.
//!
//! A big push travels in waves ([`waves`]): each rank's part of every key is split into as many
//! consecutive pieces. The encode of one wave runs while the one before travels (its all-to-all
//! started, and moved on between chunks of the encode: [`Round::progress`]), and a wave is
//! decoded once it lands. Every element is still decoded and added in rank order, so the sums
//! are those of one wave, bit for bit.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::MutexGuard;

use half::{bf16, f16};

use super::{part_shape, Inputs, Mine};
use crate::comm::dist::{Blocks, Dist, Pool};
use crate::comm::link::{Round, Ticket};
use crate::compress::{
    half_encode_into, two_bit_decode, two_bit_quantize, Compression, HalfWire, TwoBitTable,
};
use crate::host::HostData;
use crate::store::compress::{lock, take_residuals, Residuals};
use crate::store::groups::Group;
use crate::{cpu, DType, Element, Error, NDArray, Result};

/// The float32 bytes of contributions per wave: a push of more travels in several.
#[cfg(not(test))]
const WAVE_BYTES: usize = 8 << 20;
/// (tests) Small, so that keys of a few dozen elements travel in several waves.
#[cfg(test)]
const WAVE_BYTES: usize = 64;
/// The most waves of one push.
const MAX_WAVES: usize = 16;
/// The elements encoded between two nudges of the wave in flight (1 MiB of float32).
const NUDGE_ELEMENTS: usize = 1 << 18;

/// How many waves a push of `elements` float32 contributions (all its keys) travels in: the
/// same on every rank, from the keys' lengths.
fn waves(elements: usize) -> usize {
    (elements * 4).div_ceil(WAVE_BYTES).clamp(1, MAX_WAVES)
}

/// A compressed push's step across ranks. Each rank's contribution (the sum of its values, as
/// MXNet's workers sum their devices first) is encoded with its residual of the key; each rank
/// sends every rank the encoded part that rank holds (2-bit: about a sixteenth of the float32
/// bytes; 16-bit: about half), in all-to-alls, then decodes and sums every rank's part in rank
/// order. Returns the totals and the residuals to keep once the push has succeeded.
pub(super) fn sum_encoded(
    call: &mut dyn Round,
    d: &Dist,
    compression: Compression,
    groups: &[Group<'_>],
    mine: Vec<Mine<'_>>,
) -> Result<(Inputs, Vec<Residuals>)> {
    // Each key's kept residual (one value per key: position 0), read under its lock; zeros
    // before the key's first push. The new ones go into pooled buffers, kept by `commit`.
    let committed: Vec<MutexGuard<'_, Residuals>> =
        groups.iter().map(|g| lock(&g.slot.residuals)).collect();
    let pool = d.pool();
    let mut kept: Vec<Residuals> = groups
        .iter()
        .map(|g| take_residuals(pool, 1, g.slot.shape.size()))
        .collect();
    let push = Push {
        d,
        pool,
        groups,
        mine: &mine,
        committed: &committed,
    };
    let totals = match compression {
        Compression::TwoBit { threshold } => push.run(
            call,
            &TwoBit {
                t: threshold,
                table: TwoBitTable::new(threshold),
            },
            &mut kept,
        ),
        Compression::Half { dtype: DType::F16 } => push.run(call, &Half::<f16>::WIRE, &mut kept),
        Compression::Half { .. } => push.run(call, &Half::<bf16>::WIRE, &mut kept),
        Compression::None => Err(Error::internal("a compressed sum without compression")),
    };
    Ok((Inputs::Totals(totals?), kept))
}

/// A wire's encoding: units of `Unit` on the wire, each carrying one or more elements.
trait Codec {
    /// What travels.
    type Unit: Element + Copy;
    /// The units that carry elements `e` of a key (counted from its first element).
    fn units(&self, e: Range<usize>) -> Range<usize>;
    /// The elements units `u` of a key of `n` elements carry.
    fn elements(&self, u: Range<usize>, n: usize) -> Range<usize>;
    /// Encodes `value` plus `residual` into `out`, what is not sent into `left`.
    fn encode(&self, value: &[f32], residual: &[f32], left: &mut [f32], out: &mut [Self::Unit]);
    /// Decodes elements `e` (counted from the first element `seg` carries) into `total`, or
    /// with `add` adds them to it (`row`: room for that).
    fn decode(
        &self,
        seg: &[Self::Unit],
        e: Range<usize>,
        total: &mut [f32],
        add: bool,
        row: &mut Vec<f32>,
    );
}

/// The 2-bit wire: 16 elements to a 32-bit word, which travels as a float32 bit pattern (the
/// all-to-all copies it, never adds).
struct TwoBit {
    t: f32,
    table: TwoBitTable,
}

impl Codec for TwoBit {
    type Unit = f32;

    fn units(&self, e: Range<usize>) -> Range<usize> {
        match e.is_empty() {
            true => 0..0,
            false => e.start / 16..e.end.div_ceil(16),
        }
    }

    fn elements(&self, u: Range<usize>, n: usize) -> Range<usize> {
        (16 * u.start).min(n)..(16 * u.end).min(n)
    }

    fn encode(&self, value: &[f32], residual: &[f32], left: &mut [f32], out: &mut [f32]) {
        two_bit_quantize(value, residual, left, self.t, bytemuck::cast_slice_mut(out));
    }

    fn decode(
        &self,
        seg: &[f32],
        e: Range<usize>,
        total: &mut [f32],
        add: bool,
        row: &mut Vec<f32>,
    ) {
        // The bit patterns themselves: a conversion (through f64, say) would quiet a word
        // that reads as a signalling NaN, and change a code.
        let words: &[u32] = bytemuck::cast_slice(seg);
        if !add {
            return two_bit_decode(words, &self.table, e, total);
        }
        row.resize(total.len(), 0.0);
        two_bit_decode(words, &self.table, e, row);
        total.iter_mut().zip(row.iter()).for_each(|(t, v)| *t += v);
    }
}

/// A 16-bit wire (`f16` or `bf16`): one unit per element.
struct Half<H>(std::marker::PhantomData<H>);

impl<H> Half<H> {
    const WIRE: Half<H> = Half(std::marker::PhantomData);
}

impl<H: HalfWire + Copy> Codec for Half<H> {
    type Unit = H;

    fn units(&self, e: Range<usize>) -> Range<usize> {
        e
    }

    fn elements(&self, u: Range<usize>, _n: usize) -> Range<usize> {
        u
    }

    fn encode(&self, value: &[f32], residual: &[f32], left: &mut [f32], out: &mut [H]) {
        half_encode_into(value, residual, left, out);
    }

    fn decode(
        &self,
        seg: &[H],
        e: Range<usize>,
        total: &mut [f32],
        add: bool,
        _row: &mut Vec<f32>,
    ) {
        let seg = &seg[e];
        match add {
            false => total.iter_mut().zip(seg).for_each(|(t, h)| *t = h.widen()),
            true => total.iter_mut().zip(seg).for_each(|(t, h)| *t += h.widen()),
        }
    }
}

/// One compressed push: its keys, this rank's contributions and the residuals it encodes with.
struct Push<'a, 'g> {
    d: &'a Dist,
    pool: &'a Pool,
    groups: &'a [Group<'g>],
    mine: &'a [Mine<'a>],
    committed: &'a [MutexGuard<'a, Residuals>],
}

/// A wave in flight: its number, its blocks and its all-to-all.
struct Flying {
    wave: usize,
    blocks: Blocks,
    ticket: Ticket,
}

impl Push<'_, '_> {
    /// The push with `codec`: every key's new residual into `kept`; per key, the part this
    /// rank holds summed over the ranks in rank order, in float32 (`None` where it holds none).
    fn run<C: Codec>(
        &self,
        call: &mut dyn Round,
        codec: &C,
        kept: &mut [Residuals],
    ) -> Result<Vec<Option<NDArray>>> {
        let lens: Vec<usize> = self.groups.iter().map(|g| g.slot.shape.size()).collect();
        // Each contribution as float32, read where it lies (a caller's array, under its read
        // lock for the push, or this rank's own sum), never copied first.
        let guards: Vec<_> = self
            .mine
            .iter()
            .map(|m| match m {
                Mine::Single(a) => Some(a.read()),
                _ => None,
            })
            .collect();
        let hosts = (self.mine.iter().zip(&guards))
            .map(|(m, g)| match (m, g) {
                (Mine::Owned(h), _) => Ok(Cow::Borrowed(h)),
                (Mine::Single(_), Some(g)) => g.host(),
                // GPU ranks read their sums back before the call (`contributions`).
                _ => Err(Error::internal(
                    "a compressed contribution not in host memory",
                )),
            })
            .collect::<Result<Vec<Cow<'_, HostData>>>>()?;
        let values: Vec<Cow<'_, [f32]>> = hosts
            .iter()
            .map(|h| match h.as_ref() {
                HostData::F32(v) => Cow::Borrowed(v.as_slice()),
                other => Cow::Owned(other.to_vec()),
            })
            .collect();
        let residuals: Vec<Cow<'_, [f32]>> = (self.committed.iter().zip(&lens))
            .map(|(c, &n)| match c.first() {
                Some(r) if r.len() == n => Cow::Borrowed(r.as_slice()),
                _ => Cow::Owned(vec![0.0; n]),
            })
            .collect();
        if let Some(k) = (0..lens.len()).find(|&k| values[k].len() != lens[k]) {
            return Err(Error::internal(&format!(
                "a compressed contribution of {} elements for a key of {}",
                values[k].len(),
                lens[k]
            )));
        }
        let mut lefts: Vec<&mut [f32]> = kept.iter_mut().map(|r| r[0].as_mut_slice()).collect();
        // Per key, its encoding, from pooled buffers (no pages faulted in fresh every push).
        let mut bufs: Vec<HostData> = lens
            .iter()
            .map(|&n| {
                let units = codec.units(0..n).len();
                self.pool.take(C::Unit::DTYPE, units, units)
            })
            .collect();
        let got = self.waves(call, codec, &values, &residuals, &mut lefts, &mut bufs);
        for buf in bufs {
            self.pool.give(buf);
        }
        got
    }

    /// Encodes, sends and decodes every wave, the encode of each while the one before travels.
    fn waves<C: Codec>(
        &self,
        call: &mut dyn Round,
        codec: &C,
        values: &[Cow<'_, [f32]>],
        residuals: &[Cow<'_, [f32]>],
        lefts: &mut [&mut [f32]],
        bufs: &mut [HostData],
    ) -> Result<Vec<Option<NDArray>>> {
        let (rank, size) = (self.d.rank(), self.d.size());
        let count = waves(self.groups.iter().map(|g| g.slot.shape.size()).sum());
        let mut enc = bufs
            .iter_mut()
            .map(|b| {
                C::Unit::slice_mut(b)
                    .ok_or_else(|| Error::internal("a pooled buffer of another dtype"))
            })
            .collect::<Result<Vec<&mut [C::Unit]>>>()?;
        // Per key, the part this rank holds, summed into a pooled buffer (the push gives it
        // back once the updater has run); the first rank's decode writes every element.
        let mut totals: Vec<Option<HostData>> = (self.groups.iter())
            .map(|g| {
                let p = g.slot.spread.piece(g.slot.shape.size(), rank, size);
                match p.is_empty() && !g.slot.spread.holds(rank) {
                    true => None,
                    false => Some(self.pool.take(DType::F32, p.len(), p.len())),
                }
            })
            .collect();
        let mut flying: Option<Flying> = None;
        let mut row = Vec::new();
        // The units encoded between two nudges of the wave in flight.
        let chunk = codec.units(0..NUDGE_ELEMENTS).len().max(1);
        for wave in 0..count {
            for (k, g) in self.groups.iter().enumerate() {
                let n = g.slot.shape.size();
                for r in 0..size {
                    let units = self.wave_units(codec, g, r, wave, count);
                    let mut at = units.start;
                    while at < units.end {
                        let u = at..(at + chunk).min(units.end);
                        let e = codec.elements(u.clone(), n);
                        codec.encode(
                            &values[k][e.clone()],
                            &residuals[k][e.clone()],
                            &mut lefts[k][e],
                            &mut enc[k][u.clone()],
                        );
                        at = u.end;
                        if flying.is_some() {
                            call.progress()?;
                        }
                    }
                }
            }
            let started = self.start_wave(call, codec, &enc, wave, count)?;
            if let Some(landing) = flying.replace(started) {
                self.land_wave(call, codec, landing, count, &mut totals, &mut row)?;
            }
        }
        if let Some(landing) = flying {
            self.land_wave(call, codec, landing, count, &mut totals, &mut row)?;
        }
        Ok((self.groups.iter().zip(totals))
            .map(|(g, t)| {
                t.map(|t| {
                    let shape = part_shape(g, t.len());
                    NDArray::from_host(t, shape, cpu(0))
                })
            })
            .collect())
    }

    /// The units of wave `wave` (of `count`) of the part of key `g` rank `r` holds: the
    /// wave-th of `count` consecutive pieces of the units that carry that part.
    fn wave_units<C: Codec>(
        &self,
        codec: &C,
        g: &Group<'_>,
        r: usize,
        wave: usize,
        count: usize,
    ) -> Range<usize> {
        let p = g.slot.spread.piece(g.slot.shape.size(), r, self.d.size());
        let all = codec.units(p);
        let len = all.len();
        all.start + len * wave / count..all.start + len * (wave + 1) / count
    }

    /// Starts wave `wave`'s all-to-all: block `r` of the send buffer holds, key by key, the
    /// wave's units of the parts rank `r` holds, with no padding (except past MPI's `int`
    /// counts: [`Blocks`]); every rank lays them out alike.
    fn start_wave<C: Codec>(
        &self,
        call: &mut dyn Round,
        codec: &C,
        enc: &[&mut [C::Unit]],
        wave: usize,
        count: usize,
    ) -> Result<Flying> {
        let (rank, size) = (self.d.rank(), self.d.size());
        let lens: Vec<usize> = (0..size)
            .map(|r| {
                (self.groups.iter())
                    .map(|g| self.wave_units(codec, g, r, wave, count).len())
                    .sum()
            })
            .collect();
        let blocks = Blocks::to_each(&lens);
        let total = blocks.send_len(rank);
        let mut send_buf = self.pool.take(C::Unit::DTYPE, total, total);
        let send = C::Unit::slice_mut(&mut send_buf)
            .ok_or_else(|| Error::internal("a pooled buffer of another dtype"))?;
        for r in 0..size {
            let (mut at, end) = (blocks.send_at(rank, r), blocks.send_at(rank, r + 1));
            for (g, e) in self.groups.iter().zip(enc) {
                let s = &e[self.wave_units(codec, g, r, wave, count)];
                crate::memcopy::copy(&mut send[at..at + s.len()], s);
                at += s.len();
            }
            // Padding, where blocks are padded: zeros, never an earlier call's units.
            send[at..end].fill(C::Unit::from_f64(0.0));
        }
        let received = blocks.recv_len(rank);
        let recv = self.pool.take(C::Unit::DTYPE, received, received);
        let ticket = blocks.start(call, send_buf, recv)?;
        Ok(Flying {
            wave,
            blocks,
            ticket,
        })
    }

    /// Waits for a wave's all-to-all and decodes it: each key's units of this rank's part,
    /// from every rank in rank order, into `totals`.
    fn land_wave<C: Codec>(
        &self,
        call: &mut dyn Round,
        codec: &C,
        flying: Flying,
        count: usize,
        totals: &mut [Option<HostData>],
        row: &mut Vec<f32>,
    ) -> Result<()> {
        let (rank, size) = (self.d.rank(), self.d.size());
        let (sent, received) = call.land(flying.ticket)?;
        self.pool.give(sent);
        let all = C::Unit::slice(&received)
            .ok_or_else(|| Error::internal("compressed values came back as another dtype"))?;
        let mut at = 0;
        for (g, total) in self.groups.iter().zip(totals.iter_mut()) {
            let units = self.wave_units(codec, g, rank, flying.wave, count);
            let here = at;
            at += units.len();
            let Some(total) = total else { continue };
            if units.is_empty() {
                continue;
            }
            let n = g.slot.shape.size();
            let piece = g.slot.spread.piece(n, rank, size);
            let carried = codec.elements(units.clone(), n);
            let e = carried.start.max(piece.start)..carried.end.min(piece.end);
            let total = f32::slice_mut(total)
                .ok_or_else(|| Error::internal("a pooled buffer of another dtype"))?;
            let out = &mut total[e.start - piece.start..e.end - piece.start];
            let relative = e.start - carried.start..e.end - carried.start;
            for r in 0..size {
                let from = flying.blocks.recv_at(r, rank) + here;
                let seg = &all[from..from + units.len()];
                // In rank order, in float32: the first rank's value, then + each next one.
                codec.decode(seg, relative.clone(), out, r > 0, row);
            }
        }
        self.pool.give(received);
        Ok(())
    }
}

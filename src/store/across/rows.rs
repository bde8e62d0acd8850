//! The across-ranks steps of row-sparse keys: rows travel in compact form, only to and from
//! the ranks that hold them, in one all-to-all.

use std::ops::Range;

use crate::backend::cpu::rows::{add_row, Merged};
use crate::backend::HomeValue;
use crate::comm::dist::{Blocks, Dist};
use crate::comm::link::Round;
use crate::host::HostData;
use crate::row_sparse::row_width;
use crate::store::groups::Group;
use crate::store::table::Slot;
use crate::{DType, Error, Result, Shape};

/// The rows of a key this rank updates in a push: element ranges of its part of the value
/// (offsets in its cell), and their summed gradient, one range after another.
pub(in crate::store) struct Part {
    pub(in crate::store) segs: Vec<Range<usize>>,
    pub(in crate::store) grad: HostData,
    /// The gradient's shape: `[rows, ...]` for whole rows, flat for parts of rows.
    pub(in crate::store) shape: Shape,
}

/// The element ranges of whole rows `ids`, `width` elements each.
pub(super) fn whole_rows(ids: &[u64], width: usize) -> Vec<Range<usize>> {
    (ids.iter())
        .map(|&id| id as usize * width..(id as usize + 1) * width)
        .collect()
}

/// A key's part when this rank holds the whole value: every merged row.
pub(super) fn whole_part(shape: Shape, m: Merged) -> Part {
    let mut dims = shape.dims().to_vec();
    dims[0] = m.ids.len();
    Part {
        segs: whole_rows(&m.ids, row_width(shape)),
        shape: Shape::new(&dims).unwrap_or(shape),
        grad: m.rows,
    }
}

/// The elements of row `id` (of `width`) inside `piece`, as absolute element offsets (empty
/// when the row and the piece do not meet).
fn cut(id: u64, width: usize, piece: &Range<usize>) -> Range<usize> {
    let row = id as usize * width..(id as usize + 1) * width;
    let start = row.start.max(piece.start);
    let end = row.end.min(piece.end).max(start);
    start..end
}

/// The cuts of rows `ids` (of `width` elements) by `piece` that are not empty: where each
/// starts in the rows laid out one after another, where it starts in `piece`, and its length.
fn cuts<'a>(
    ids: &'a [u64],
    width: usize,
    piece: &'a Range<usize>,
) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    ids.iter().enumerate().filter_map(move |(i, &id)| {
        let c = cut(id, width, piece);
        let in_rows = i * width + (c.start - id as usize * width);
        (!c.is_empty()).then(|| (in_rows, c.start - piece.start, c.len()))
    })
}

/// Every rank's row ids of a call, per key: gathered with two word all-gathers (the counts,
/// then the ids, padded to the longest list).
struct AllIds {
    keys: usize,
    counts: Vec<u64>,
    stride: usize,
    words: Vec<u64>,
}

impl AllIds {
    fn gather(call: &mut dyn Round, mine: &[&[u64]]) -> Result<AllIds> {
        let counts_mine: Vec<u64> = mine.iter().map(|ids| ids.len() as u64).collect();
        let counts = call.all_gather_words(&counts_mine)?;
        let keys = mine.len();
        let stride = (counts.chunks(keys.max(1)))
            .map(|c| c.iter().sum::<u64>() as usize)
            .max()
            .unwrap_or(0);
        let mut words: Vec<u64> = mine.iter().flat_map(|ids| ids.iter().copied()).collect();
        words.resize(stride, 0);
        let words = call.all_gather_words(&words)?;
        Ok(AllIds {
            keys,
            counts,
            stride,
            words,
        })
    }

    /// Rank `r`'s ids of key `k`.
    fn of(&self, r: usize, k: usize) -> &[u64] {
        let counts = &self.counts[r * self.keys..(r + 1) * self.keys];
        let start = r * self.stride + counts[..k].iter().sum::<u64>() as usize;
        &self.words[start..start + counts[k] as usize]
    }
}

/// What a rank holds of a key in a row-sparse push: the rows any rank pushed that meet its
/// part (`piece` of the key's elements), and where each lands in the summed gradient.
struct Held {
    k: usize,
    piece: Range<usize>,
    ids: Vec<u64>,
    segs: Vec<Range<usize>>,
    offset: Vec<usize>,
}

impl Held {
    /// Key `k`'s rows (of `w` elements) that meet `piece`, from every rank's ids.
    fn of(k: usize, w: usize, piece: Range<usize>, all: &AllIds, size: usize) -> Held {
        let mut ids: Vec<u64> = (0..size)
            .flat_map(|s| all.of(s, k).iter().copied())
            .filter(|&id| !cut(id, w, &piece).is_empty())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        // A holder that got no rows still runs the update (on no rows): the key's step counts
        // every push, and an assign clears its part.
        let segs: Vec<Range<usize>> = (ids.iter())
            .map(|&id| {
                let c = cut(id, w, &piece);
                c.start - piece.start..c.end - piece.start
            })
            .collect();
        let mut offset = vec![0];
        for s in &segs {
            offset.push(offset.last().copied().unwrap_or(0) + s.len());
        }
        Held {
            k,
            piece,
            ids,
            segs,
            offset,
        }
    }

    /// Sums into `grad`, by row id in rank order, the cuts of this key's rows (of `w` elements)
    /// by this rank's part, found in each sender's block of `all` at `at` (moved past them).
    fn sum_received(
        &self,
        grad: &mut HostData,
        all: &HostData,
        at: &mut [usize],
        ids: &AllIds,
        w: usize,
    ) -> Result<()> {
        let mut seen = vec![false; self.ids.len()];
        for (s, at) in at.iter_mut().enumerate() {
            for &id in ids.of(s, self.k) {
                let c = cut(id, w, &self.piece);
                if c.is_empty() {
                    continue;
                }
                let j = (self.ids.binary_search(&id))
                    .map_err(|_| Error::internal("a row-sparse row id missing from the union"))?;
                let dst = self.offset[j]..self.offset[j] + c.len();
                add_row(all, *at..*at + c.len(), grad, dst, !seen[j]);
                seen[j] = true;
                *at += c.len();
            }
        }
        Ok(())
    }

    /// The part this rank updates, with its summed gradient `grad`, of a key of `shape`: whole
    /// rows keep the key's row shape, parts of rows are flat.
    fn into_part(self, grad: HostData, shape: Shape) -> Result<Part> {
        let whole = self.segs.iter().all(|s| s.len() == row_width(shape))
            && self.piece.len() == shape.size();
        let shape = match whole {
            true => {
                let mut dims = shape.dims().to_vec();
                dims[0] = self.ids.len();
                Shape::new(&dims)?
            }
            false => Shape::new(&[grad.len()])?,
        };
        Ok(Part {
            segs: self.segs,
            grad,
            shape,
        })
    }
}

/// A row-sparse push's step across ranks. Every rank learns every rank's row ids; each rank
/// sends each holder, in one all-to-all per dtype, the elements of its rows that fall in the
/// holder's part of the key (nothing else moves); each holder sums what it gets by row id, in
/// rank order. Returns, per key, the part this rank updates (`None` where it holds none).
pub(super) fn push_across(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    merged: Vec<Merged>,
) -> Result<Vec<Option<Part>>> {
    let (rank, size) = (d.rank(), d.size());
    let mine: Vec<&[u64]> = merged.iter().map(|m| m.ids.as_slice()).collect();
    let ids = AllIds::gather(call, &mine)?;
    let piece = |k: usize, r: usize| {
        let slot = &groups[k].slot;
        slot.spread.piece(slot.shape.size(), r, size)
    };
    let width = |k: usize| row_width(groups[k].slot.shape);
    let mut parts: Vec<Option<Part>> = (0..groups.len()).map(|_| None).collect();
    for dtype in dtypes(groups) {
        let keys: Vec<usize> = (0..groups.len())
            .filter(|&k| groups[k].slot.dtype == dtype)
            .collect();
        // Elements rank `s` sends rank `h`: its rows' cuts by `h`'s part, key by key.
        let block_len = |s: usize, h: usize| -> usize {
            (keys.iter())
                .map(|&k| {
                    let (w, p) = (width(k), piece(k, h));
                    ids.of(s, k)
                        .iter()
                        .map(|&id| cut(id, w, &p).len())
                        .sum::<usize>()
                })
                .sum()
        };
        let blocks = Blocks::from_fn(size, block_len);
        // Every buffer is allocated, and the ranks agree that it was, before any rows move (a
        // rank that could not allocate must not leave the others waiting in the all-to-all).
        let held: Vec<Held> = (keys.iter())
            .filter(|&&k| groups[k].slot.spread.holds(rank))
            .map(|&k| Held::of(k, width(k), piece(k, rank), &ids, size))
            .collect();
        let buffers = (|| {
            let send = HostData::try_filled(dtype, blocks.send_len(rank), 0.0)?;
            let recv = HostData::try_filled(dtype, blocks.recv_len(rank), 0.0)?;
            let grads = (held.iter())
                .map(|h| HostData::try_filled(dtype, *h.offset.last().unwrap_or(&0), 0.0))
                .collect::<Result<Vec<HostData>>>()?;
            Ok((send, recv, grads))
        })();
        let together = call.agree("push", buffers.is_ok(), "allocating the rows' buffers");
        let (mut send, recv, mut grads) = buffers?;
        together?;
        for h in 0..size {
            let mut at = blocks.send_at(rank, h);
            for &k in &keys {
                let (w, p) = (width(k), piece(k, h));
                for (from, _, n) in cuts(&merged[k].ids, w, &p) {
                    add_row(&merged[k].rows, from..from + n, &mut send, at..at + n, true);
                    at += n;
                }
            }
        }
        let ticket = blocks.start(call, send, recv)?;
        let (_, all) = call.land(ticket)?;
        // Each sender's block holds, key by key, the cuts of its rows by this rank's part:
        // summed by row id, in rank order.
        let mut at: Vec<usize> = (0..size).map(|s| blocks.recv_at(s, rank)).collect();
        let mut next_held = held.iter().zip(grads.iter_mut()).peekable();
        for &k in &keys {
            // Not held here: nothing of it was sent to this rank.
            if let Some((h, grad)) = next_held.next_if(|(h, _)| h.k == k) {
                h.sum_received(grad, &all, &mut at, &ids, width(k))?;
            }
        }
        for (h, grad) in held.into_iter().zip(grads) {
            let k = h.k;
            parts[k] = Some(h.into_part(grad, groups[k].slot.shape)?);
        }
    }
    Ok(parts)
}

/// A `row_sparse_pull`'s step across ranks: every rank learns every rank's ids; each holder
/// sends each rank, in one all-to-all, the elements of the rows it asked for that fall in the
/// holder's part; each rank puts its rows together from those pieces.
pub(super) fn pull_across(
    call: &mut dyn Round,
    d: &Dist,
    slot: &Slot,
    cell: &HomeValue,
    ids: &[u64],
) -> Result<HostData> {
    let (rank, size) = (d.rank(), d.size());
    let all = AllIds::gather(call, &[ids])?;
    let (len, w, dtype) = (slot.shape.size(), row_width(slot.shape), slot.dtype);
    let piece = |r: usize| slot.spread.piece(len, r, size);
    let block_len = |h: usize, r: usize| -> usize {
        let p = piece(h);
        all.of(r, 0).iter().map(|&id| cut(id, w, &p).len()).sum()
    };
    let blocks = Blocks::from_fn(size, block_len);
    let mine = piece(rank);
    let holds = slot.spread.holds(rank) && !mine.is_empty();
    // Every buffer allocated, and this rank's part read (a GPU rank's read back), and the
    // ranks agreed that it was, before any rows move.
    let buffers = (|| {
        let send = HostData::try_filled(dtype, blocks.send_len(rank), 0.0)?;
        let recv = HostData::try_filled(dtype, blocks.recv_len(rank), 0.0)?;
        let rows = HostData::try_filled(dtype, ids.len() * w, 0.0)?;
        let value = holds.then(|| cell.value_to_host()).transpose()?;
        Ok::<_, Error>((send, recv, rows, value))
    })();
    let together = call.agree("pull", buffers.is_ok(), "allocating the rows' buffers");
    let (mut send, recv, mut rows, value) = buffers?;
    together?;
    if let Some(value) = value {
        for r in 0..size {
            let mut at = blocks.send_at(rank, r);
            for (_, from, n) in cuts(all.of(r, 0), w, &mine) {
                add_row(&value, from..from + n, &mut send, at..at + n, true);
                at += n;
            }
        }
    }
    let ticket = blocks.start(call, send, recv)?;
    let (_, got) = call.land(ticket)?;
    for h in 0..size {
        let (p, mut at) = (piece(h), blocks.recv_at(h, rank));
        for (dst, _, n) in cuts(ids, w, &p) {
            add_row(&got, at..at + n, &mut rows, dst..dst + n, true);
            at += n;
        }
    }
    Ok(rows)
}

/// The distinct dtypes of `groups`, in order of first appearance.
fn dtypes(groups: &[Group<'_>]) -> Vec<DType> {
    let mut out: Vec<DType> = Vec::new();
    for g in groups {
        if !out.contains(&g.slot.dtype) {
            out.push(g.slot.dtype);
        }
    }
    out
}

//! Buddy ranks: where the copy of each rank's parts lives, so that the survivors of a lost
//! rank go on without losing its parts (elastic dist stores, `KVSTORE_REPLICAS=1`).
//!
//! Rank `r`'s buddy is `r + shift` (mod the world size), with the shift that puts the most
//! ranks' buddies on another machine (the smallest such shift): a lost machine then takes no
//! copy of its own ranks' parts with it, wherever the ranks can be placed so. Every rank keeps
//! the copy of exactly one rank's parts, its source's (`r - shift`).

use super::Pool;
use crate::comm::link::Round;
use crate::comm::Spread;
use crate::host::HostData;
use crate::{DType, Error, Result};

use super::Blocks;

/// Who keeps whose copy, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Buddies {
    shift: usize,
    size: usize,
}

impl Buddies {
    /// The buddies of ranks on `machine_of` (each rank's machine, in rank order); `None` for
    /// fewer than two ranks.
    pub(crate) fn of(machine_of: &[usize]) -> Option<Buddies> {
        let size = machine_of.len();
        if size < 2 {
            return None;
        }
        let apart = |shift: usize| {
            (0..size)
                .filter(|&r| machine_of[r] != machine_of[(r + shift) % size])
                .count()
        };
        // The most ranks apart from their buddy; ties to the smallest shift.
        let shift = (1..size)
            .max_by_key(|&s| (apart(s), std::cmp::Reverse(s)))
            .unwrap_or(1);
        Some(Buddies { shift, size })
    }

    /// The rank that keeps `rank`'s copy.
    pub(crate) fn buddy(&self, rank: usize) -> usize {
        (rank + self.shift) % self.size
    }

    /// The rank whose copy `rank` keeps.
    pub(crate) fn source(&self, rank: usize) -> usize {
        (rank + self.size - self.shift) % self.size
    }
}

/// One key of a [`to_buddy`] exchange: its dtype, elements and spread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyPart {
    pub(crate) dtype: DType,
    pub(crate) len: usize,
    pub(crate) spread: Spread,
}

impl KeyPart {
    /// The elements of the part rank `rank` of `size` holds.
    pub(crate) fn held(&self, rank: usize, size: usize) -> usize {
        self.spread.piece(self.len, rank, size).len()
    }
}

/// Sends this rank's part of each key (`mine[i]`: of `keys[i]`'s dtype and this rank's length
/// of it, `None` where it holds none) to its buddy, and receives its source's: per key, the
/// source's part (`None` where the source holds none). One all-to-all per dtype, every rank
/// sending only to its buddy.
pub(crate) fn to_buddy(
    call: &mut dyn Round,
    (rank, size): (usize, usize),
    buddies: Buddies,
    pool: &Pool,
    keys: &[KeyPart],
    mine: &[Option<&HostData>],
) -> Result<Vec<Option<HostData>>> {
    if mine.len() != keys.len() {
        return Err(Error::internal("parts for a buddy, not one per key"));
    }
    let source = buddies.source(rank);
    let mut out: Vec<Option<HostData>> = keys.iter().map(|_| None).collect();
    let mut dtypes: Vec<DType> = keys.iter().map(|k| k.dtype).collect();
    dtypes.sort_by_key(|d| d.name());
    dtypes.dedup();
    for dtype in dtypes {
        let of_dtype: Vec<usize> = (0..keys.len())
            .filter(|&i| keys[i].dtype == dtype)
            .collect();
        let sent_by = |s: usize| of_dtype.iter().map(|&i| keys[i].held(s, size)).sum();
        let blocks = Blocks::from_fn(size, |s, r| match r == buddies.buddy(s) {
            true => sent_by(s),
            false => 0,
        });
        let mut send = pool.take(dtype, blocks.send_len(rank), blocks.send_len(rank));
        let mut at = blocks.send_at(rank, buddies.buddy(rank));
        for &i in &of_dtype {
            let want = keys[i].held(rank, size);
            let part = match mine[i] {
                Some(p) if p.len() == want && p.dtype() == dtype => Some(p),
                None if want == 0 => None,
                _ => return Err(Error::internal("a part for a buddy of another length")),
            };
            if let Some(p) = part {
                send.write_at(at, p);
            }
            at += want;
        }
        let recv = pool.take(dtype, blocks.recv_len(rank), blocks.recv_len(rank));
        let ticket = blocks.start(call, send, recv)?;
        let (send, recv) = call.land(ticket)?;
        pool.give(send);
        let mut at = blocks.recv_at(source, rank);
        for &i in &of_dtype {
            let len = keys[i].held(source, size);
            if keys[i].spread.holds(source) {
                out[i] = Some(recv.slice_of(at..at + len));
            }
            at += len;
        }
        pool.give(recv);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::Buddies;

    #[test]
    fn buddies_sit_on_another_machine_where_the_ranks_allow_it() {
        // Two machines of two consecutive ranks: the buddy is two ranks on.
        let b = Buddies::of(&[0, 0, 2, 2]).unwrap();
        assert_eq!((0..4).map(|r| b.buddy(r)).collect::<Vec<_>>(), [2, 3, 0, 1]);
        // Round robin: the next rank.
        let b = Buddies::of(&[0, 1, 0, 1]).unwrap();
        assert_eq!((0..4).map(|r| b.buddy(r)).collect::<Vec<_>>(), [1, 2, 3, 0]);
        // One machine: the next rank; every rank keeps exactly one copy.
        let b = Buddies::of(&[0, 0, 0]).unwrap();
        assert_eq!((0..3).map(|r| b.buddy(r)).collect::<Vec<_>>(), [1, 2, 0]);
        for size in 2..7 {
            let m: Vec<usize> = (0..size).map(|r| r / 2).collect();
            let b = Buddies::of(&m).unwrap();
            for r in 0..size {
                assert_eq!(b.source(b.buddy(r)), r, "size {size}");
            }
        }
        // 3 + 1 ranks: no shift parts them all; the one that parts the most.
        let b = Buddies::of(&[0, 0, 0, 3]).unwrap();
        let apart = (0..4).filter(|&r| [0, 0, 0, 3][b.buddy(r)] != [0, 0, 0, 3][r]);
        assert_eq!(apart.count(), 2);
        assert!(Buddies::of(&[0]).is_none());
    }
}

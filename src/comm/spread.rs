//! Which ranks hold a key's value in a distributed store, and the slices of a sliced key.
// Without the `mpi` feature every key is whole on rank 0, and little of this is used.
#![cfg_attr(not(feature = "mpi"), allow(dead_code))]

use std::ops::Range;

/// Which ranks hold a key's value and updater state (rank 0 in a single process).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Spread {
    /// The whole value lives on one rank, which runs the updater for it.
    Whole {
        /// The home rank.
        rank: usize,
    },
    /// One contiguous slice per rank ([`slice_range`]), each held and updated by its rank.
    Sliced,
}

impl Spread {
    /// The part of a key of `len` elements that rank `rank` of `size` holds (maybe none).
    pub(crate) fn piece(self, len: usize, rank: usize, size: usize) -> Range<usize> {
        match self {
            Spread::Whole { rank: home } if home == rank => 0..len,
            Spread::Whole { .. } => 0..0,
            Spread::Sliced => slice_range(len, size, rank),
        }
    }

    /// Whether rank `rank` holds a part of the key's value (the whole, or a slice).
    pub(crate) fn holds(self, rank: usize) -> bool {
        match self {
            Spread::Whole { rank: home } => home == rank,
            Spread::Sliced => true,
        }
    }
}

/// Rank `rank`'s slice of a key of `len` elements over `size` ranks: blocks of `len / size`,
/// rounded up, in rank order.
pub(crate) fn slice_range(len: usize, size: usize, rank: usize) -> Range<usize> {
    let block = slice_block(len, size);
    let start = (rank * block).min(len);
    start..(start + block).min(len)
}

/// The block length of a sliced key of `len` elements over `size` ranks.
pub(crate) fn slice_block(len: usize, size: usize) -> usize {
    len.div_ceil(size.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_every_element_once_in_rank_order() {
        for len in [0usize, 1, 2, 5, 11, 12, 1000, 1_000_003] {
            for size in 1..=7 {
                let mut next = 0;
                for r in 0..size {
                    let s = slice_range(len, size, r);
                    assert_eq!(s.start, next, "len {len} size {size} rank {r}");
                    assert!(s.len() <= slice_block(len, size));
                    next = s.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn a_whole_key_lives_on_its_home_alone() {
        let w = Spread::Whole { rank: 2 };
        assert_eq!(w.piece(10, 2, 4), 0..10);
        assert!(w.piece(10, 1, 4).is_empty());
        assert!(w.holds(2) && !w.holds(0));
        assert_eq!(Spread::Sliced.piece(10, 3, 4), 9..10);
        assert!(Spread::Sliced.holds(0));
    }
}

//! The blocks of an all-to-all: how many elements each rank sends each rank, and where each
//! block lies in the send and receive buffers.
//!
//! Blocks travel at their own lengths (`MPI_Ialltoallv`). MPI takes the counts and
//! displacements of unequal blocks as C `int`s; where a rank's buffer would be too long for
//! them, every block is padded to the longest instead (`MPI_Ialltoall` needs only one block's
//! count to fit). Every rank decides from the same lengths.

use super::link::{Op, Round, Ticket};
use crate::host::HostData;
use crate::Result;

/// The blocks of one all-to-all, the same on every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Blocks {
    size: usize,
    /// Elements rank `s` sends rank `r`: `lens[s * size + r]`.
    lens: Vec<usize>,
    /// The length every block is padded to, where the unequal blocks' displacements would not
    /// fit MPI's `int`s.
    padded_to: Option<usize>,
}

impl Blocks {
    /// Blocks of `len(s, r)` elements from rank `s` to rank `r`, for `size` ranks (the same on
    /// every rank), padded where MPI's `int`s could not take them.
    pub(crate) fn from_fn(size: usize, len: impl Fn(usize, usize) -> usize) -> Blocks {
        let lens: Vec<usize> = (0..size * size).map(|i| len(i / size, i % size)).collect();
        let fits = |n: usize| n <= count_max();
        let sent = |s: usize| lens[s * size..(s + 1) * size].iter().sum::<usize>();
        let received = |r: usize| (0..size).map(|s| lens[s * size + r]).sum::<usize>();
        let unequal_fits = (0..size).all(|r| fits(sent(r)) && fits(received(r)));
        let padded_to = match unequal_fits {
            true => None,
            false => Some(lens.iter().copied().max().unwrap_or(0)),
        };
        Blocks {
            size,
            lens,
            padded_to,
        }
    }

    /// Blocks where every rank sends rank `r` `lens[r]` elements.
    pub(crate) fn to_each(lens: &[usize]) -> Blocks {
        Blocks::from_fn(lens.len(), |_, r| lens[r])
    }

    /// The elements of rank `s`'s block for rank `r` (its padding excluded).
    pub(crate) fn len(&self, s: usize, r: usize) -> usize {
        self.lens[s * self.size + r]
    }

    /// The room rank `s`'s block for rank `r` takes in the buffers: its length, or the
    /// longest block's where blocks are padded.
    pub(crate) fn room(&self, s: usize, r: usize) -> usize {
        self.padded_to.unwrap_or_else(|| self.len(s, r))
    }

    /// Where rank `s`'s block for rank `r` starts in `s`'s send buffer.
    pub(crate) fn send_at(&self, s: usize, r: usize) -> usize {
        (0..r).map(|q| self.room(s, q)).sum()
    }

    /// The length of rank `s`'s send buffer.
    pub(crate) fn send_len(&self, s: usize) -> usize {
        self.send_at(s, self.size)
    }

    /// Where rank `s`'s block starts in rank `r`'s receive buffer.
    pub(crate) fn recv_at(&self, s: usize, r: usize) -> usize {
        (0..s).map(|q| self.room(q, r)).sum()
    }

    /// The length of rank `r`'s receive buffer.
    pub(crate) fn recv_len(&self, r: usize) -> usize {
        self.recv_at(self.size, r)
    }

    /// Starts the all-to-all on `call`: `send` of [`Blocks::send_len`] elements, laid out by
    /// [`Blocks::send_at`], and `recv` of [`Blocks::recv_len`] (this rank's).
    pub(crate) fn start(
        &self,
        call: &mut dyn Round,
        send: HostData,
        recv: HostData,
    ) -> Result<Ticket> {
        match self.padded_to {
            None => call.start_all_to_all_v(send, &self.lens, recv),
            Some(_) => call.start(Op::AllToAll, send, recv),
        }
    }
}

/// Every rank's `mine[r]` (words for rank `r`, of any length) to rank `r`: what each rank sent
/// this one, by sender. Two collectives: the lengths (an all-gather), then the words (an
/// all-to-all of blocks of their own lengths, the words travelling as the bits of `f64`s, which
/// the link copies and never computes on).
pub(crate) fn all_to_all_words(
    call: &mut dyn Round,
    rank: usize,
    mine: &[Vec<u64>],
) -> Result<Vec<Vec<u64>>> {
    let size = mine.len();
    let lens: Vec<u64> = mine.iter().map(|w| w.len() as u64).collect();
    let all = call.all_gather_words(&lens)?;
    if all.len() != size * size || rank >= size {
        return Err(crate::Error::internal("word counts of another world size"));
    }
    let blocks = Blocks::from_fn(size, |s, r| all[s * size + r] as usize);
    let mut send = vec![0.0f64; blocks.send_len(rank)];
    for (r, words) in mine.iter().enumerate() {
        let at = blocks.send_at(rank, r);
        for (o, w) in send[at..at + words.len()].iter_mut().zip(words) {
            *o = f64::from_bits(*w);
        }
    }
    let recv = HostData::F64(vec![0.0; blocks.recv_len(rank)]);
    let ticket = blocks.start(call, HostData::F64(send), recv)?;
    let (_, recv) = call.land(ticket)?;
    let HostData::F64(recv) = recv else {
        return Err(crate::Error::internal("words came back of another dtype"));
    };
    (0..size)
        .map(|s| {
            let at = blocks.recv_at(s, rank);
            let got = recv.get(at..at + blocks.len(s, rank));
            let got = got.ok_or_else(|| crate::Error::internal("words arrived cut short"))?;
            Ok(got.iter().map(|w| w.to_bits()).collect())
        })
        .collect()
}

/// The most elements an MPI count or displacement holds (a C `int`).
#[cfg(not(test))]
fn count_max() -> usize {
    i32::MAX as usize
}

/// [`count_max`], lowered per thread by tests so that the padded all-to-all runs too.
#[cfg(test)]
fn count_max() -> usize {
    tests::COUNT_MAX.with(|m| m.get())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::Blocks;

    thread_local! {
        /// This thread's stand-in for MPI's largest count (see `count_max`).
        pub(crate) static COUNT_MAX: std::cell::Cell<usize> =
            const { std::cell::Cell::new(i32::MAX as usize) };
    }

    #[test]
    fn blocks_travel_unequal_unless_mpi_counts_would_overflow() {
        let b = Blocks::to_each(&[5, 0, 3]);
        assert_eq!(b.room(0, 1), 0);
        assert_eq!((b.send_len(1), b.recv_len(0), b.recv_len(1)), (8, 15, 0));
        assert_eq!((b.send_at(2, 2), b.recv_at(2, 2)), (5, 6));
        assert_eq!(Blocks::to_each(&[]).recv_len(0), 0);
        // A receive buffer of 3 × 1.1e9 overflows an int: equal blocks instead.
        let big = 1_100_000_000;
        let b = Blocks::to_each(&[big, 50_000_000, 50_000_000]);
        assert_eq!((b.room(0, 1), b.len(0, 1)), (big, 50_000_000));
        assert_eq!((b.send_len(0), b.recv_at(2, 1)), (3 * big, 2 * big));
    }

    #[test]
    fn each_pair_of_ranks_has_its_own_length() {
        // Rank 0 sends ranks 0, 1, 2: 1, 7, 0; rank 1: 2, 0, 4; rank 2: 0, 3, 5.
        let lens = [1, 7, 0, 2, 0, 4, 0, 3, 5];
        let b = Blocks::from_fn(3, |s, r| lens[s * 3 + r]);
        assert_eq!((0..3).map(|s| b.send_len(s)).collect::<Vec<_>>(), [8, 6, 8]);
        assert_eq!(
            (0..3).map(|r| b.recv_len(r)).collect::<Vec<_>>(),
            [3, 10, 9]
        );
        assert_eq!(
            (b.send_at(1, 2), b.recv_at(2, 1), b.recv_at(1, 2)),
            (2, 7, 0)
        );
    }
}

//! Ranks on several machines: which ranks share one, and the order in which a sliced key's
//! blocks travel in two stages, so that each byte crosses between machines once per machine
//! instead of once per rank.
//!
//! With `H` machines of `L` ranks each (`H`, `L` > 1), a reduce-scatter runs first among the
//! ranks of each machine (over shared memory), then among the ranks of the same local rank
//! across machines; an all-gather the other way round. For that, the blocks of the world's
//! ranks are laid out by local rank, then machine: position `l × H + h` holds the block of the
//! rank that is local rank `l` on machine `h` ([`Layout::order`]). The first stage's block for
//! local rank `l` is then the `H` blocks of the ranks of local rank `l`, one per machine, which
//! the second stage spreads to them.
//!
//! A sum so made adds, for each element, each machine's ranks in local rank order, then the
//! machines' partial sums in machine order (a float16 or bfloat16 sum is rounded after each
//! stage). Machines are numbered, for each local rank, by the world rank of that local rank on
//! them (as `MPI_Comm_split` with the world rank as key numbers them).

/// Where every rank sits: `hosts` machines of `local` ranks each.
#[derive(Debug, PartialEq)]
pub(crate) struct Layout {
    /// The number of machines.
    pub(crate) hosts: usize,
    /// The number of ranks on each machine.
    pub(crate) local: usize,
    /// The world rank at each position `l × hosts + h`.
    order: Vec<usize>,
    /// Each world rank's (machine, local rank).
    place: Vec<(usize, usize)>,
}

impl Layout {
    /// The layout of ranks whose local ranks and local sizes are `local_ranks` and
    /// `local_sizes` (in world rank order), or `None` where a sliced key gains nothing from two
    /// stages: one machine, one rank per machine, or machines with different numbers of ranks.
    pub(super) fn of(local_ranks: &[usize], local_sizes: &[usize]) -> Option<Layout> {
        let size = local_ranks.len();
        let local = *local_sizes.first()?;
        if local < 2 || local_sizes.iter().any(|&s| s != local) || size % local != 0 {
            return None;
        }
        let hosts = size / local;
        if hosts < 2 {
            return None;
        }
        // The machine of a rank: how many ranks of its local rank come before it.
        let mut seen = vec![0usize; local];
        let mut place = Vec::with_capacity(size);
        for &l in local_ranks {
            let h = *seen.get(l)?;
            seen[l] += 1;
            place.push((h, l));
        }
        if seen.iter().any(|&n| n != hosts) {
            return None;
        }
        let mut order = vec![0usize; size];
        for (rank, &(h, l)) in place.iter().enumerate() {
            order[l * hosts + h] = rank;
        }
        Some(Layout {
            hosts,
            local,
            order,
            place,
        })
    }

    /// The machine and local rank of world rank `rank`.
    pub(super) fn place(&self, rank: usize) -> (usize, usize) {
        self.place[rank]
    }

    /// The world rank at each position of the two-stage layout.
    pub(crate) fn order(&self) -> &[usize] {
        &self.order
    }

    /// `blocks` (one block of `n` elements per world rank, in rank order) laid out for the
    /// two stages, into `out`.
    pub(crate) fn stage_order<T: Copy>(&self, blocks: &[T], n: usize, out: &mut Vec<T>) {
        out.clear();
        for &rank in &self.order {
            out.extend_from_slice(&blocks[rank * n..(rank + 1) * n]);
        }
    }

    /// The inverse of [`Layout::stage_order`]: `staged` back into world rank order in `out`.
    pub(crate) fn rank_order<T: Copy>(&self, staged: &[T], n: usize, out: &mut [T]) {
        for (p, &rank) in self.order.iter().enumerate() {
            out[rank * n..(rank + 1) * n].copy_from_slice(&staged[p * n..(p + 1) * n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Local ranks of ranks placed `per` to a machine, in blocks or round robin.
    fn placed(hosts: usize, per: usize, round_robin: bool) -> Vec<usize> {
        (0..hosts * per)
            .map(|r| if round_robin { r / hosts } else { r % per })
            .collect()
    }

    #[test]
    fn layouts_need_several_machines_of_several_equal_ranks() {
        assert_eq!(Layout::of(&[0, 1, 2, 3], &[4; 4]), None, "one machine");
        assert_eq!(
            Layout::of(&[0, 0, 0], &[1; 3]),
            None,
            "one rank per machine"
        );
        assert_eq!(Layout::of(&[0, 1, 2, 0], &[3, 3, 3, 1]), None, "3 + 1");
        assert_eq!(Layout::of(&[], &[]), None);
        let l = Layout::of(&placed(2, 2, false), &[2; 4]).expect("2 x 2");
        assert_eq!((l.hosts, l.local), (2, 2));
        // Positions l × H + h: (h0 l0) = 0, (h1 l0) = 2, (h0 l1) = 1, (h1 l1) = 3.
        assert_eq!(l.order(), &[0, 2, 1, 3]);
        let rr = Layout::of(&placed(2, 2, true), &[2; 4]).expect("round robin");
        assert_eq!(rr.order(), &[0, 1, 2, 3]);
        assert_eq!(rr.place(1), (1, 0));
    }

    /// The two stages, run here on plain vectors, give each rank the sum of its block over every
    /// rank, and an all-gather every rank's block in rank order, for every placement.
    #[test]
    fn two_stages_give_each_rank_its_block() {
        for (hosts, per, rr) in [(2, 2, false), (2, 3, true), (3, 2, false), (4, 2, true)] {
            let l = Layout::of(&placed(hosts, per, rr), &vec![per; hosts * per]).unwrap();
            let size = hosts * per;
            let n = 3;
            // Rank r's send buffer: block q holds 1000 q + 10 r + i (sums are exact).
            let send = |r: usize| -> Vec<f64> {
                (0..size * n)
                    .map(|e| (1000 * (e / n) + 10 * r + e % n) as f64)
                    .collect()
            };
            let mut staged: Vec<Vec<f64>> = Vec::new();
            for r in 0..size {
                let mut out = Vec::new();
                l.stage_order(&send(r), n, &mut out);
                staged.push(out);
            }
            // Stage 1: on each machine, local rank lr gets chunk lr (H blocks) summed.
            let chunk = hosts * n;
            let partial: Vec<Vec<f64>> = (0..size)
                .map(|r| {
                    let (h, lr) = l.place(r);
                    (0..chunk)
                        .map(|e| {
                            (0..size)
                                .filter(|&q| l.place(q).0 == h)
                                .map(|q| staged[q][lr * chunk + e])
                                .sum()
                        })
                        .collect()
                })
                .collect();
            // Stage 2: among local rank lr, machine h gets block h of the chunk, summed.
            for r in 0..size {
                let (h, lr) = l.place(r);
                let got: Vec<f64> = (0..n)
                    .map(|e| {
                        (0..size)
                            .filter(|&q| l.place(q).1 == lr)
                            .map(|q| partial[q][h * n + e])
                            .sum()
                    })
                    .collect();
                let want: Vec<f64> = (0..n)
                    .map(|e| (0..size).map(|q| send(q)[r * n + e]).sum())
                    .collect();
                assert_eq!(got, want, "{hosts} x {per} (round robin {rr}), rank {r}");
            }
            // All-gather: blocks in stage order, back to rank order.
            let blocks: Vec<f64> = (0..size * n).map(|e| e as f64).collect();
            let mut there = Vec::new();
            l.stage_order(&blocks, n, &mut there);
            let mut back = vec![0.0; size * n];
            l.rank_order(&there, n, &mut back);
            assert_eq!(back, blocks);
        }
    }
}

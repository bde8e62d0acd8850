//! Row-sparse keys on the loopback link: N ranks as N threads, in `cargo test`.
//!
//! Pushed rows are multiples of 1/4 of at most 8 in magnitude, so their float sums are exact in
//! any order: the ranks sum in another order than the local store does, and the results must
//! still be equal bit for bit.

use std::time::Duration;

use rand::prelude::*;

use super::loopback_tests::{on_links, on_ranks, stores, stores_on, Lane, BOUND};
use crate::comm::link::loopback::Loopback;
use crate::{Adam, DType, Error, KvStore, NDArray, RowSparse, Sgd, Shape, Updater};

/// The keys: a sliced float32 key whose rows straddle the ranks' slices, a whole key, and a
/// sliced float64 key (a second dtype, a second all-to-all).
const KEYS: [(i32, [usize; 2], DType); 3] = [
    (0, [7, 3], DType::F32),
    (1, [2, 3], DType::F32),
    (2, [5, 4], DType::F64),
];

fn quarters(rng: &mut StdRng, n: usize, dtype: DType) -> NDArray {
    let v: Vec<f32> = (0..n)
        .map(|_| rng.gen_range(-32..=32) as f32 / 4.0)
        .collect();
    NDArray::from_vec(v, [n]).unwrap().astype(dtype).unwrap()
}

fn reshaped(a: NDArray, dims: &[usize]) -> NDArray {
    let host = a.with_host(|h| h.clone()).unwrap();
    NDArray::from_host(host, Shape::new(dims).unwrap(), crate::cpu(0))
}

/// Random row-sparse values for every key: 1 or 2 per key, ids repeating, some empty.
fn values(rng: &mut StdRng) -> Vec<Vec<RowSparse>> {
    KEYS.iter()
        .map(|&(_, [rows, width], dtype)| {
            (0..rng.gen_range(1..3))
                .map(|_| {
                    let n = if rng.gen_bool(0.2) {
                        0
                    } else {
                        rng.gen_range(1..5)
                    };
                    let ids = (0..n).map(|_| rng.gen_range(0..rows as u64)).collect();
                    let data = reshaped(quarters(rng, n * width, dtype), &[n, width]);
                    RowSparse::new(ids, data).unwrap()
                })
                .collect()
        })
        .collect()
}

fn dense(kv: &KvStore, key: i32) -> Result<Vec<f64>, Error> {
    let out = NDArray::zeros(kv.meta(key)?.0).astype(kv.meta(key)?.1)?;
    kv.pull(key, &out)?;
    out.to_vec::<f64>()
}

fn rows_of(kv: &KvStore, key: i32, ids: &[u64]) -> Result<(Vec<u64>, Vec<f64>), Error> {
    let got = kv.row_sparse_pull(key, ids)?;
    Ok((got.ids().to_vec(), got.rows().to_vec::<f64>()?))
}

/// Random row-sparse pushes on 1 to 4 ranks, through assign, lazy SGD with momentum and lazy
/// Adam, give every rank, at every step, what one local store gives when it is pushed every
/// rank's values as one list: dense pulls and `row_sparse_pull`s of random ids, bit for bit.
/// The ranks cross in host buffers and in the GPU ranks' way (in place), in turn.
#[test]
fn row_sparse_pushes_on_n_ranks_equal_a_local_store() {
    let updaters = [
        Updater::Assign,
        Updater::Sgd(Sgd {
            lr: 0.25,
            momentum: 0.5,
            wd: 0.125,
            ..Sgd::default()
        }),
        Updater::Adam(Adam {
            lr: 0.125,
            wd: 0.25,
            ..Adam::default()
        }),
    ];
    let mut rng = StdRng::from_entropy();
    for n in 1..=4 {
        for (u, updater) in updaters.iter().enumerate() {
            let ranks = stores_on([Lane::Host, Lane::InPlace][(n + u) % 2], n);
            let local = KvStore::create("local").unwrap();
            let keys: Vec<i32> = KEYS.iter().map(|k| k.0).collect();
            let inits: Vec<NDArray> = (KEYS.iter())
                .map(|&(_, dims, dtype)| {
                    reshaped(quarters(&mut rng, dims[0] * dims[1], dtype), &dims)
                })
                .collect();
            local.init_row_sparse_list(&keys, &inits).unwrap();
            local.set_updater(updater.clone()).unwrap();
            on_ranks(&ranks, |_, kv| {
                kv.init_row_sparse_list(&keys, &inits).unwrap();
                kv.set_updater(updater.clone()).unwrap();
            });
            for step in 0..4 {
                let pushed: Vec<Vec<Vec<RowSparse>>> = (0..n).map(|_| values(&mut rng)).collect();
                let asked: Vec<Vec<u64>> = (0..n)
                    .map(|_| {
                        (0..rng.gen_range(0..6))
                            .map(|_| rng.gen_range(0..2))
                            .collect()
                    })
                    .collect();
                let got = on_ranks(&ranks, |r, kv| {
                    kv.push_row_sparse_list(&keys, &pushed[r]).unwrap();
                    let whole: Vec<Vec<f64>> =
                        keys.iter().map(|&k| dense(kv, k).unwrap()).collect();
                    let rows: Vec<_> = keys
                        .iter()
                        .map(|&k| rows_of(kv, k, &asked[r]).unwrap())
                        .collect();
                    (whole, rows)
                });
                let all: Vec<Vec<RowSparse>> = (0..KEYS.len())
                    .map(|k| pushed.iter().flat_map(|p| p[k].iter().cloned()).collect())
                    .collect();
                local.push_row_sparse_list(&keys, &all).unwrap();
                for (r, (whole, rows)) in got.into_iter().enumerate() {
                    for (i, &k) in keys.iter().enumerate() {
                        let what =
                            format!("{n} ranks, {updater:?}, step {step}, rank {r}, key {k}");
                        assert_eq!(whole[i], dense(&local, k).unwrap(), "{what}");
                        assert_eq!(rows[i], rows_of(&local, k, &asked[r]).unwrap(), "{what}");
                    }
                }
            }
        }
    }
}

/// Ranks that disagree fail every rank and change nothing: one rank pushes another key, one
/// inits a key dense that the others init row-sparse, one pulls rows where the others pull
/// whole, one pushes a row id out of range.
#[test]
fn ranks_that_disagree_on_row_sparse_calls_fail_every_rank() {
    type Call = fn(usize, &KvStore) -> Result<(), Error>;
    let cases: [(&str, Call); 4] = [
        ("another key", |r, kv| {
            kv.push_row_sparse(
                if r == 1 { 1 } else { 0 },
                &[RowSparse::new(vec![0], NDArray::ones([1, 3]))?],
            )
        }),
        ("dense against row-sparse init", |r, kv| match r {
            1 => kv.init(9, &NDArray::zeros([7, 3])),
            _ => kv.init_row_sparse(9, &NDArray::zeros([7, 3])),
        }),
        ("rows against a whole pull", |r, kv| match r {
            1 => kv.pull(0, &NDArray::zeros([7, 3])),
            _ => kv.row_sparse_pull(0, &[1]).map(drop),
        }),
        ("an id out of range on one rank", |r, kv| {
            let id = if r == 1 { 7 } else { 6 };
            kv.push_row_sparse(0, &[RowSparse::new(vec![id], NDArray::ones([1, 3]))?])
        }),
    ];
    for (what, call) in cases {
        let ranks = stores(3);
        let outcome = on_ranks(&ranks, |r, kv| {
            kv.init_row_sparse_list(
                &[0, 1],
                &[NDArray::full([7, 3], 0.5), NDArray::full([7, 3], 0.5)],
            )
            .unwrap();
            kv.set_updater(Updater::Sgd(Sgd {
                lr: 0.5,
                ..Sgd::default()
            }))
            .unwrap();
            let err = call(r, kv);
            let after: Result<Vec<Vec<f64>>, Error> =
                [0, 1].iter().map(|&k| dense(kv, k)).collect();
            (err, after)
        });
        for (r, (err, after)) in outcome.into_iter().enumerate() {
            let err = err.expect_err(what);
            let expected = match (what, r) {
                ("an id out of range on one rank", 1) => matches!(err, Error::RowSparse { .. }),
                ("an id out of range on one rank", _) => matches!(err, Error::RankRejected { .. }),
                _ => matches!(err, Error::Desync { .. }),
            };
            assert!(expected, "{what}: rank {r}: {err}");
            if let Ok(after) = after {
                assert!(
                    after.iter().all(|v| v.iter().all(|&x| x == 0.5)),
                    "{what}: rank {r} changed"
                );
            }
        }
    }
}

/// What a row-sparse push moves: on 4 ranks, a key of 4,000 rows of 16 sliced in four, each
/// rank pushing 8 rows: each rank receives only the elements of pushed rows that fall in its
/// slice (at most 4 ranks x 8 rows x 16, padded to the longest block), not its 16,000-element
/// slice as a dense push does.
#[test]
fn a_row_sparse_push_moves_only_the_rows() {
    let (rows, width) = (4000, 16);
    let links = Loopback::world(4, Duration::from_secs(10));
    let ranks = on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), BOUND).unwrap()
    });
    on_ranks(&ranks, |_, kv| {
        kv.init_row_sparse(0, &NDArray::zeros([rows, width]))
            .unwrap();
        kv.init(1, &NDArray::zeros([rows, width])).unwrap();
    });
    let received = |sparse: bool| -> Vec<usize> {
        let before: Vec<usize> = links.iter().map(Loopback::received).collect();
        on_ranks(&ranks, |r, kv| match sparse {
            true => {
                let ids: Vec<u64> = (0..8)
                    .map(|i| (r as u64 * 997 + i * 501) % rows as u64)
                    .collect();
                kv.push_row_sparse(
                    0,
                    &[RowSparse::new(ids, NDArray::ones([8, width])).unwrap()],
                )
                .unwrap()
            }
            false => kv.push(1, &NDArray::ones([rows, width])).unwrap(),
        });
        links
            .iter()
            .zip(before)
            .map(|(l, b)| l.received() - b)
            .collect()
    };
    let sparse = received(true);
    let plain = received(false);
    for (r, (&s, &p)) in sparse.iter().zip(&plain).enumerate() {
        assert!(
            s <= 4 * 8 * width * 4,
            "rank {r} received {s} elements for 32 rows"
        );
        assert!(
            p >= rows * width / 4,
            "rank {r}: a dense push receives its slice, got {p}"
        );
    }
}

/// The blocks of a row-sparse push and pull have their own lengths: on 3 ranks, rank 0 pushes
/// 50 rows that fall in rank 2's slice and the others one row each in rank 0's, then rank 0
/// pulls 40 rows of rank 1's slice and the others one row each. Each rank receives exactly the
/// elements of those rows (padded to the busiest pair, every rank would receive 3 × 800 on the
/// push), and the rows arrive where they belong.
#[test]
fn row_sparse_blocks_carry_no_padding() {
    let (rows, width) = (3000usize, 16usize);
    let seed: u64 = rand::random();
    let links = Loopback::world(3, Duration::from_secs(10));
    let ranks = on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), BOUND).unwrap()
    });
    on_ranks(&ranks, |_, kv| {
        kv.init_row_sparse(0, &NDArray::zeros([rows, width]))
            .unwrap()
    });
    // Rank 0's rows are 2000..2050 (rank 2's slice); rank r > 0 pushes row r (rank 0's).
    let pushed_ids = |r: usize| -> Vec<u64> {
        match r {
            0 => (2000..2050).collect(),
            r => vec![r as u64],
        }
    };
    let pushed: Vec<Vec<f32>> = (0..3)
        .map(|r| {
            let mut rng = StdRng::seed_from_u64(seed ^ r as u64);
            (0..pushed_ids(r).len() * width)
                .map(|_| rng.gen_range(-8.0..8.0))
                .collect()
        })
        .collect();
    let moved = |f: &(dyn Fn(usize, &KvStore) + Sync)| -> Vec<usize> {
        let before: Vec<usize> = links.iter().map(Loopback::received).collect();
        on_ranks(&ranks, |r, kv| f(r, kv));
        (links.iter().zip(before))
            .map(|(l, b)| l.received() - b)
            .collect()
    };
    let push = moved(&|r, kv| {
        let ids = pushed_ids(r);
        let data = NDArray::from_vec(pushed[r].clone(), [ids.len(), width]).unwrap();
        kv.push_row_sparse(0, &[RowSparse::new(ids, data).unwrap()])
            .unwrap()
    });
    assert_eq!(
        push,
        [2 * width, 0, 50 * width],
        "seed {seed}: elements received"
    );
    // Rank 0 asks for rows 1000..1040 (rank 1's slice, never pushed: zeros), and rows 2010
    // and 1 (pushed by rank 0 and rank 1); ranks 1 and 2 for row 2049.
    let pulled_ids = |r: usize| -> Vec<u64> {
        match r {
            0 => (1000..1040).chain([2010, 1]).collect(),
            _ => vec![2049],
        }
    };
    let pulls: std::sync::Mutex<Vec<(Vec<u64>, Vec<f32>)>> =
        std::sync::Mutex::new(vec![(Vec::new(), Vec::new()); 3]);
    let pull = moved(&|r, kv| {
        let got = kv.row_sparse_pull(0, &pulled_ids(r)).unwrap();
        pulls.lock().unwrap()[r] = (got.ids().to_vec(), got.rows().to_vec::<f32>().unwrap());
    });
    assert_eq!(
        pull,
        [42 * width, width, width],
        "seed {seed}: elements received"
    );
    let row = |r: usize, i: usize| pushed[r][i * width..(i + 1) * width].to_vec();
    let pulls = pulls.into_inner().unwrap();
    let mut want0: Vec<f32> = row(1, 0);
    want0.extend(vec![0.0; 40 * width]);
    want0.extend(row(0, 10));
    let ids0: Vec<u64> = [1].into_iter().chain(1000..1040).chain([2010]).collect();
    assert_eq!(pulls[0], (ids0, want0), "seed {seed}: rank 0's rows");
    for (r, got) in pulls.iter().enumerate().skip(1) {
        assert_eq!(
            got,
            &(vec![2049], row(0, 49)),
            "seed {seed}: rank {r}'s row"
        );
    }
}

/// A sharded checkpoint keeps a key row-sparse: it loads row-sparse into fresh ranks and into a
/// single-process store, and a store holding the key dense, or compressing, refuses it on
/// every rank.
#[test]
fn a_sharded_checkpoint_keeps_a_key_row_sparse() {
    let dir = std::env::temp_dir().join(format!("kvstore-rsp-sharded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let value =
        NDArray::from_vec((0..21).map(|i| i as f32 / 4.0).collect::<Vec<_>>(), [7, 3]).unwrap();
    let saved = stores(3);
    on_ranks(&saved, |_, kv| {
        kv.init_row_sparse(0, &value).unwrap();
        kv.init(1, &value).unwrap();
        kv.save(&dir).unwrap();
    });
    let loaded = stores(2);
    on_ranks(&loaded, |_, kv| {
        kv.load(&dir).unwrap();
        assert!(kv.is_row_sparse(0).unwrap() && !kv.is_row_sparse(1).unwrap());
        assert_eq!(dense(kv, 0).unwrap(), value.to_vec::<f64>().unwrap());
    });
    let local = KvStore::create("local").unwrap();
    local.load(&dir).unwrap();
    assert!(local.is_row_sparse(0).unwrap() && !local.is_row_sparse(1).unwrap());
    let dense_ranks = stores(2);
    let errs = on_ranks(&dense_ranks, |_, kv| {
        kv.init(0, &NDArray::zeros([7, 3])).unwrap();
        kv.load(&dir).unwrap_err()
    });
    for e in errs {
        assert!(
            matches!(e, Error::Checkpoint { .. } | Error::RankRejected { .. }),
            "{e}"
        );
    }
    // Ranks that compress refuse the row-sparse key on every rank, and hold nothing after.
    let compressing = stores(2);
    let errs = on_ranks(&compressing, |_, kv| {
        kv.set_gradient_compression(crate::Compression::two_bit(0.5))
            .unwrap();
        let e = kv.load(&dir).unwrap_err();
        assert!(
            kv.keys().is_empty(),
            "a refused load left keys: {:?}",
            kv.keys()
        );
        e
    });
    for e in errs {
        assert!(
            matches!(e, Error::Checkpoint { .. } | Error::RankRejected { .. }),
            "{e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

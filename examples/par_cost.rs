//! What a push and a pull cost from the main thread and from inside a rayon pool: the
//! measurement behind BENCHMARKS.md's "Calls from rayon tasks".
//!
//! `cargo run --release --example par_cost -- [reps]` prints one line per case:
//! `case op size_mib median_ms`, each the median of `reps` (default 7) timed calls. Cases:
//!
//! - `main`: the call from the main thread;
//! - `rayon-1`: the same call as the only task on rayon's global pool (in `rayon::scope`);
//! - `rayon-4`: four tasks on the global pool at once (`par_iter`), each on its own key; the
//!   time is for all four.
//!
//! A push sums 4 values (on cpu(0..4)) into the key (assign); a pull copies it into 4 outs.
//! `benches/par_cost.sh` runs this binary built from two commits, alternately, and prints the
//! medians over rounds side by side.

use std::time::Instant;

use clap::Parser;
use kvstore::{cpu, KvStore, NDArray};
use rayon::prelude::*;

const DEVICES: usize = 4;
const TASKS: usize = 4;

fn arrays(elems: usize, fill: f64) -> Vec<NDArray> {
    (0..DEVICES)
        .map(|d| NDArray::full([elems], fill).to_device(cpu(d)).unwrap())
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up: page faults, pool start
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

/// What a push and a pull cost from the main thread and from inside a rayon pool.
#[derive(Parser)]
#[command(name = "par_cost")]
struct Options {
    /// Timed calls per case; each line is their median.
    #[arg(default_value_t = 7)]
    reps: usize,
}

fn main() {
    let reps = Options::parse().reps;
    for mib in [1usize, 64] {
        let elems = (mib << 20) / 4;
        let kv = KvStore::create("local").unwrap();
        let keys: Vec<(Vec<NDArray>, Vec<NDArray>)> = (0..TASKS)
            .map(|k| {
                kv.init(k as i32, &NDArray::zeros([elems])).unwrap();
                (arrays(elems, 1.0 + k as f64), arrays(elems, 0.0))
            })
            .collect();
        for op in ["push", "pull"] {
            let one = |k: usize| {
                let (values, outs) = &keys[k];
                if op == "push" {
                    kv.push(k as i32, &values[..]).unwrap()
                } else {
                    kv.pull(k as i32, &outs[..]).unwrap()
                }
            };
            let main = time(reps, || one(0));
            let rayon_1 = time(reps, || rayon::scope(|_| one(0)));
            let rayon_4 = time(reps, || (0..TASKS).into_par_iter().for_each(one));
            for (case, ms) in [("main", main), ("rayon-1", rayon_1), ("rayon-4", rayon_4)] {
                println!("{case} {op} {mib} {ms:.3}");
            }
        }
        // Key 0 holds the sum of its 4 values of ones, and its outs got it: the calls did
        // their work.
        let got = keys[0].1[3].to_vec::<f32>().unwrap();
        assert_eq!(got[elems - 1], DEVICES as f32, "pull after push");
    }
}

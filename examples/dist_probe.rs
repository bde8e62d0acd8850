//! A probe of a `dist_sync` store for the fault tests on the simulated cluster
//! (`scripts/cluster-faults.sh`): it pushes fresh random values and checks every pulled sum
//! against a reference it computes itself, and says on stdout what it did, one line per event,
//! so that a test can act on a line and check the outcome.
//!
//! ```text
//! mpirun -np 4 target/debug/examples/dist_probe --mode push --steps 3
//! mpirun -np 4 target/debug/examples/dist_probe --mode save --dir /tmp/ckpt --steps 50
//! target/debug/examples/dist_probe --mode verify --dir /tmp/ckpt --ranks 4
//! ```
//!
//! - `push`: key 0 of `--elems` f32 (default 1,048,576, 4 MiB: a sliced key above the default
//!   `KVSTORE_BIGARRAY_BOUND`), `--steps` times
//!   (default 3): every rank pushes its values for that step, pulls the sum and compares it
//!   with the sum of every rank's values, which it draws itself from the same seeds (rank `r`'s
//!   values at step `s` are in [-1, 1), from a generator seeded with `--seed`, `r` and `s`). Prints `PROBE rank=R host=H step=S OK max_err=E` after each step, `PROBE rank=R
//!   host=H DONE` at the end.
//! - `save`: as `push`, and key 1 holds the step number; after each step the store is saved to
//!   the sharded checkpoint `--dir` (`PROBE rank=R host=H SAVING S` before the save, `SAVED S`
//!   after it). With `--hold-save R:S:T`, rank `R` sleeps `T` seconds after it prints
//!   `SAVING S`, before its save: the other ranks are then inside save `S`, waiting for it, so
//!   a test can kill a host's ranks while a save is under way, not after a guessed sleep.
//! - `verify`: one process, no MPI job: loads `--dir` into a `local` store, reads the step `S`
//!   it holds and checks key 0 against the reference sum of `--ranks` ranks at step `S`. Prints
//!   `PROBE VERIFIED step=S max_err=E`.
//!
//! Any failure prints `PROBE rank=R host=H ERROR Variant: message` (the [`kvstore::Error`]
//! variant, then its message) and exits with code 1. A wrong value is a failure too.

use anyhow::{bail, Context, Result};
use kvstore::{KvStore, NDArray};

/// The largest difference from the reference allowed: a sum of a few f32 values in [-1, 1),
/// each rounded once, is off by far less.
const TOLERANCE: f64 = 1e-5;

struct Args {
    mode: String,
    steps: u64,
    elems: usize,
    seed: u64,
    dir: String,
    ranks: usize,
    /// `--hold-save R:S:T`: (rank, step, seconds).
    hold_save: Option<(usize, u64, f64)>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        mode: "push".to_owned(),
        steps: 3,
        elems: 1_048_576,
        seed: 1,
        dir: String::new(),
        ranks: 0,
        hold_save: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--mode" => a.mode = v,
            "--steps" => a.steps = v.parse()?,
            "--elems" => a.elems = v.parse()?,
            "--seed" => a.seed = v.parse()?,
            "--dir" => a.dir = v,
            "--ranks" => a.ranks = v.parse()?,
            "--hold-save" => a.hold_save = Some(hold_save(&v)?),
            _ => bail!("unknown option {flag}"),
        }
    }
    Ok(a)
}

/// `R:S:T` of `--hold-save`: rank, step, seconds (finite, 0 to 600).
fn hold_save(v: &str) -> Result<(usize, u64, f64)> {
    let parts: Vec<&str> = v.split(':').collect();
    let [r, s, t] = parts[..] else {
        bail!("--hold-save takes RANK:STEP:SECONDS, got {v}");
    };
    let secs: f64 = t.parse()?;
    if !(0.0..=600.0).contains(&secs) {
        bail!("--hold-save: {secs} seconds is not in 0 to 600");
    }
    Ok((r.parse()?, s.parse()?, secs))
}

/// Rank `rank`'s values at step `step`: multiples of 2^-22 in [-1, 1) from a splitmix64 stream
/// (fast even in a debug build). A sum of up to four of them is exact in f32, so a correct
/// store matches the reference exactly.
fn values(seed: u64, rank: usize, step: u64, n: usize) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((rank as u64) << 32)
        .wrapping_add(step);
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 41) as f32 / (1u64 << 22) as f32 - 1.0
        })
        .collect()
}

/// The sum of every rank's values at `step`, in f64: the reference, computed without the store.
fn reference(seed: u64, ranks: usize, step: u64, n: usize) -> Vec<f64> {
    let mut sum = vec![0f64; n];
    for r in 0..ranks {
        for (s, v) in sum.iter_mut().zip(values(seed, r, step, n)) {
            *s += f64::from(v);
        }
    }
    sum
}

/// The largest difference of `got` from `want`; an error if it is past [`TOLERANCE`].
fn compare(got: &[f32], want: &[f64], what: &str) -> Result<f64> {
    if got.len() != want.len() {
        bail!("{what}: {} values, expected {}", got.len(), want.len());
    }
    // A NaN (an element the store never wrote: `out` starts as NaN) is a wrong value too;
    // `f64::max` would drop it, so it is counted as infinitely far off.
    let err = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).abs())
        .map(|e| if e.is_nan() { f64::INFINITY } else { e })
        .fold(0f64, f64::max);
    if err > TOLERANCE {
        bail!("{what}: WRONG VALUE, off by {err:e} from the reference");
    }
    Ok(err)
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// Pushes and checks `steps` steps; with `save`, keeps the step in key 1 and saves after each.
fn run(a: &Args, kv: &KvStore, tag: &str, save: bool) -> Result<()> {
    let (rank, ranks, n) = (kv.rank(), kv.num_workers(), a.elems);
    kv.init(0, &NDArray::from_vec(vec![0f32; n], [n])?)?;
    if save {
        kv.init(1, &NDArray::from_vec(vec![0f32], [1])?)?;
    }
    let out = NDArray::from_vec(vec![f32::NAN; n], [n])?;
    for step in 1..=a.steps {
        kv.push(0, &NDArray::from_vec(values(a.seed, rank, step, n), [n])?)?;
        if save {
            let mine = if rank == 0 { step as f32 } else { 0.0 };
            kv.push(1, &NDArray::from_vec(vec![mine], [1])?)?;
        }
        kv.pull(0, &out)?;
        let want = reference(a.seed, ranks, step, n);
        let err = compare(&out.to_vec::<f32>()?, &want, &format!("step {step}"))?;
        println!("{tag} step={step} OK max_err={err:e}");
        if save {
            println!("{tag} SAVING {step}");
            if a.hold_save.is_some_and(|(r, s, _)| r == rank && s == step) {
                let secs = a.hold_save.map_or(0.0, |(_, _, t)| t);
                std::thread::sleep(std::time::Duration::from_secs_f64(secs));
            }
            kv.save(&a.dir)?;
            println!("{tag} SAVED {step}");
        }
    }
    println!("{tag} DONE");
    Ok(())
}

/// Loads `--dir` into a local store and checks it against the reference at the step it holds.
fn verify(a: &Args) -> Result<()> {
    if a.ranks == 0 {
        bail!("verify needs --ranks N (N >= 1): the reference is the sum of N ranks' values");
    }
    let kv = KvStore::create("local")?;
    kv.load(&a.dir)?;
    let step_out = NDArray::from_vec(vec![f32::NAN], [1])?;
    kv.pull(1, &step_out)?;
    let step = step_out.to_vec::<f32>()?[0];
    if !(step >= 1.0 && step.fract() == 0.0) {
        bail!("the checkpoint's step is {step}, not a step number");
    }
    let out = NDArray::from_vec(vec![f32::NAN; a.elems], [a.elems])?;
    kv.pull(0, &out)?;
    let want = reference(a.seed, a.ranks, step as u64, a.elems);
    let err = compare(&out.to_vec::<f32>()?, &want, "the checkpoint")?;
    println!("PROBE VERIFIED step={step} max_err={err:e}");
    Ok(())
}

/// "Timeout" from `Timeout { .. }`: the error's variant.
fn variant(e: &anyhow::Error) -> String {
    match e.downcast_ref::<kvstore::Error>() {
        Some(k) => format!("{k:?}")
            .split(|c: char| !c.is_alphanumeric())
            .next()
            .unwrap_or("Error")
            .to_owned(),
        None => "Error".to_owned(),
    }
}

fn main() {
    let (tag, result) = match args() {
        Err(e) => ("PROBE".to_owned(), Err(e)),
        Ok(a) if a.mode == "verify" => ("PROBE".to_owned(), verify(&a)),
        Ok(a) => match KvStore::create("dist_sync") {
            Err(e) => ("PROBE".to_owned(), Err(e.into())),
            Ok(kv) => {
                let tag = format!("PROBE rank={} host={}", kv.rank(), host());
                let r = match a.mode.as_str() {
                    "push" => run(&a, &kv, &tag, false),
                    "save" => run(&a, &kv, &tag, true),
                    m => Err(anyhow::anyhow!("unknown mode {m}")),
                };
                (tag, r)
            }
        },
    };
    if let Err(e) = result {
        println!("{tag} ERROR {}: {e:#}", variant(&e));
        std::process::exit(1);
    }
}

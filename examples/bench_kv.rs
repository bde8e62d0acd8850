//! Times one store workload (or a roof kernel) and prints the result as one JSON line: the
//! "ours" half of `benches/mxnet_peer.py`'s interleaved A/B runs, and the source of the CPU
//! tables in BENCHMARKS.md.
//!
//! ```text
//! cargo run --release --example bench_kv -- push 16M 4 [reps] [warmup] [updater] [dtype]
//! cargo run --release --example bench_kv -- --serve      # one such command per stdin line
//! cargo run --release --example bench_kv -- --suite [rounds] > suite.json
//! cargo run --release --example bench_kv -- --half-ab [rounds] [size] [reps] > half_ab.jsonl
//! ```
//!
//! Ops: `push`, `pull`, `pushpull`; `push_list`, `pull_list`, `push_loop`, `pull_loop` (1000 keys
//! of SIZE each); `roof_copy`, `roof_sum`, `roof_sum_rmw`, `roof_bcast`. Updaters: `assign`,
//! `axpby`, `sgd`, `sgd_mom`, `adam`. Dtypes: `float32`, `float16`, `bfloat16`.
//! Reps 0 picks a count by size. `--suite` runs every store op at every size and device count
//! interleaved with its roof kernel, `rounds` times (default 3), and prints one JSON line each.

#[path = "../benches/common/mod.rs"]
mod common;

use std::io::BufRead;

use anyhow::{bail, Context, Result};
use common::{roof::Bufs, Kv, SmallKeys, Target};
use kvstore::{DType, Updater};

/// One workload to time.
struct Cmd {
    op: String,
    bytes: usize,
    n: usize,
    reps: usize,
    warmup: usize,
    updater: String,
    dtype: DType,
}

impl Cmd {
    fn parse(args: &[&str]) -> Result<Cmd> {
        let get = |i: usize, default: &str| args.get(i).copied().unwrap_or(default).to_owned();
        let bytes = common::parse_size(&get(1, "16M"))?;
        let reps: usize = get(3, "0").parse()?;
        let dtype = match get(6, "float32").as_str() {
            "float32" | "f32" => DType::F32,
            "float16" | "f16" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            other => bail!("unknown dtype {other}"),
        };
        Ok(Cmd {
            op: args.first().context("missing op")?.to_string(),
            bytes,
            n: get(2, "4").parse()?,
            reps: if reps == 0 {
                common::auto_reps(bytes)
            } else {
                reps
            },
            warmup: get(4, "3").parse()?,
            updater: get(5, "assign"),
            dtype,
        })
    }

    /// Times the workload: every rep's seconds.
    fn run(&self, target: Target) -> Result<Vec<f64>> {
        let (w, r) = (self.warmup, self.reps);
        if let Some(kernel) = self.op.strip_prefix("roof_") {
            let mut b = Bufs::new(self.n, self.bytes);
            return common::time_reps(w, r, || {
                match kernel {
                    "copy" => b.copy(),
                    "sum" => b.sum(),
                    "sum_rmw" => b.sum_rmw(),
                    "bcast" => b.bcast(),
                    other => bail!("unknown roof kernel {other}"),
                }
                Ok(())
            });
        }
        if self.op.ends_with("_list") || self.op.ends_with("_loop") {
            let sk = SmallKeys::new(target, 1000, self.bytes, self.n)?;
            let f = match self.op.as_str() {
                "push_list" => SmallKeys::push_list,
                "pull_list" => SmallKeys::pull_list,
                "push_loop" => SmallKeys::push_loop,
                "pull_loop" => SmallKeys::pull_loop,
                other => bail!("unknown op {other}"),
            };
            return common::time_reps(w, r, || f(&sk));
        }
        let updater = common::updaters()
            .into_iter()
            .find(|(name, _)| *name == self.updater)
            .map(|(_, u)| u)
            .with_context(|| format!("unknown updater {}", self.updater))?;
        let kv = Kv::new(target, self.n, self.bytes, self.dtype, updater)?;
        let f = match self.op.as_str() {
            "push" => Kv::push,
            "pull" => Kv::pull,
            "pushpull" => Kv::pushpull,
            other => bail!("unknown op {other}"),
        };
        common::time_reps(w, r, || f(&kv))
    }

    /// The fewest bytes the workload reads and writes per call.
    fn moved(&self) -> usize {
        let (n, s) = (self.n, self.bytes);
        let updater = common::updaters()
            .into_iter()
            .find(|(name, _)| *name == self.updater)
            .map_or(Updater::Assign, |(_, u)| u);
        match self.op.as_str() {
            "roof_copy" => 2 * s,
            "roof_sum" | "roof_bcast" => (n + 1) * s,
            "roof_sum_rmw" => (n + 2) * s,
            "push" => common::moved_updater(&updater, n, s, self.dtype),
            "pull" => (n + 1) * s,
            "pushpull" => common::moved_updater(&updater, n, s, self.dtype) + (n + 1) * s,
            op if op.ends_with("_list") || op.ends_with("_loop") => 1000 * (n + 1) * s,
            _ => 0,
        }
    }

    /// Runs and prints one JSON line.
    fn report(&self, target: Target, round: usize) -> Result<()> {
        let times = self.run(target)?;
        let med = common::median(&times);
        let one = if self.op.ends_with("_list") || self.op.ends_with("_loop") {
            1000 * self.bytes
        } else {
            self.bytes
        };
        let list: Vec<String> = times.iter().map(|t| format!("{t:.9}")).collect();
        println!(
            "{{\"impl\":\"ours\",\"target\":\"{}\",\"op\":\"{}\",\"bytes\":{},\"ndev\":{},\
             \"updater\":\"{}\",\"dtype\":\"{}\",\"round\":{round},\"median_s\":{med:.9},\
             \"algbw_gbps\":{:.4},\"moved_gbps\":{:.4},\"times\":[{}]}}",
            target.name(),
            self.op,
            self.bytes,
            self.n,
            self.updater,
            self.dtype,
            one as f64 / med / 1e9,
            self.moved() as f64 / med / 1e9,
            list.join(",")
        );
        Ok(())
    }
}

/// Every store op at every size and device count, each next to its roof kernel, `rounds` times.
fn suite(target: Target, rounds: usize) -> Result<()> {
    for round in 0..rounds {
        for bytes in common::sizes() {
            let size = common::size_name(bytes);
            for n in common::dev_counts() {
                let n_s = n.to_string();
                let cmds: [&[&str]; 6] = [
                    &["roof_sum", &size, &n_s],
                    &["push", &size, &n_s],
                    &["roof_bcast", &size, &n_s],
                    &["pull", &size, &n_s],
                    &["roof_sum_rmw", &size, &n_s],
                    &["pushpull", &size, &n_s],
                ];
                for args in cmds {
                    Cmd::parse(args)?.report(target, round)?;
                }
            }
            Cmd::parse(&["roof_copy", &size, "1"])?.report(target, round)?;
        }
        for op in ["push_list", "push_loop", "pull_list", "pull_loop"] {
            Cmd::parse(&[op, "1K", "4", "30"])?.report(target, round)?;
        }
        let big = common::size_name(common::updater_size());
        for dtype in ["float32", "float16", "bfloat16"] {
            Cmd::parse(&["roof_sum_rmw", &big, "4"])?.report(target, round)?;
            for (name, _) in common::updaters() {
                Cmd::parse(&["push", &big, "4", "0", "3", name, dtype])?.report(target, round)?;
            }
        }
    }
    Ok(())
}

/// The float16/bfloat16 A/B: per round, dtype and updater, one store (4 values of SIZE) and the
/// sum-of-4 + read-modify-write roof kernel (float32, SIZE per array), timed rep by rep in a
/// rotating order: the roof, a push on the portable loops (`base`, the code before the
/// AVX2/F16C path), a push on the AVX2/F16C path (`new`). float32 runs too, as a control: its
/// two arms are the same code. One JSON line per arm and cell;
/// `benches/half_ab.py` makes the table.
fn half_ab(target: Target, rounds: usize, size: &str, reps: usize) -> Result<()> {
    let bytes = Cmd::parse(&["push", size, "4"])?.bytes;
    let mut roof = Bufs::new(4, bytes);
    for round in 0..rounds {
        for dtype in ["float32", "float16", "bfloat16"] {
            for (name, updater) in common::updaters() {
                let dt = Cmd::parse(&["push", size, "4", "0", "0", name, dtype])?.dtype;
                let moved = [
                    6 * bytes,
                    common::moved_updater(&updater, 4, bytes, dt),
                    common::moved_updater(&updater, 4, bytes, dt),
                ];
                let kv = Kv::new(target, 4, bytes, dt, updater)?;
                let mut times = [Vec::new(), Vec::new(), Vec::new()];
                for rep in 0..reps + 1 {
                    for k in 0..3 {
                        let arm = (k + rep) % 3;
                        kvstore::__internal::cpu::set_simd16(arm == 2);
                        let t = std::time::Instant::now();
                        if arm == 0 {
                            roof.sum_rmw();
                        } else {
                            kv.push()?;
                        }
                        // The first rep of each is a warm-up.
                        if rep >= 1 {
                            times[arm].push(t.elapsed().as_secs_f64());
                        }
                    }
                }
                kvstore::__internal::cpu::set_simd16(true);
                let roof_moved = moved[0] as f64 / common::median(&times[0]) / 1e9;
                for (k, arm) in ["roof", "base", "new"].into_iter().enumerate() {
                    let med = common::median(&times[k]);
                    let gbps = moved[k] as f64 / med / 1e9;
                    println!(
                        "{{\"arm\":\"{arm}\",\"round\":{round},\"dtype\":\"{dtype}\",\
                         \"updater\":\"{name}\",\"bytes\":{bytes},\"median_s\":{med:.9},\
                         \"moved_gbps\":{gbps:.4},\"roof_moved_gbps\":{roof_moved:.4}}}"
                    );
                }
            }
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let target = Target::from_env();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.first().copied() {
        Some("--serve") => {
            for line in std::io::stdin().lock().lines() {
                let line = line?;
                let words: Vec<&str> = line.split_whitespace().collect();
                if words.is_empty() {
                    continue;
                }
                if let Err(e) = Cmd::parse(&words).and_then(|c| c.report(target, 0)) {
                    println!("{{\"error\":\"{}\"}}", e.to_string().replace('"', "'"));
                }
            }
            Ok(())
        }
        Some("--half-ab") => half_ab(
            target,
            args.get(1).map_or(Ok(3), |r| r.parse())?,
            args.get(2).copied().unwrap_or("64M"),
            args.get(3).map_or(Ok(8), |r| r.parse())?,
        ),
        Some("--suite") => suite(target, args.get(1).map_or(Ok(3), |r| r.parse())?),
        Some(_) => Cmd::parse(&args)?.report(target, 0),
        None => bail!("usage: bench_kv OP SIZE NDEV [REPS] [WARMUP] [UPDATER] [DTYPE] | --serve | --suite [ROUNDS]"),
    }
}

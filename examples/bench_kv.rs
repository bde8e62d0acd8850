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
use clap::{CommandFactory, Parser};
use common::{roof::Bufs, size::parse_size, Kv, SmallKeys, Target};
use kvstore::{DType, Updater};

/// One workload to time: `OP SIZE NDEV [REPS] [WARMUP] [UPDATER] [DTYPE]`, on the command line
/// or as one line of `--serve`'s input.
#[derive(Parser)]
#[command(name = "bench_kv")]
struct Cmd {
    /// push, pull, pushpull; push_list, pull_list, push_loop, pull_loop (1000 keys of SIZE
    /// each); roof_copy, roof_sum, roof_sum_rmw, roof_bcast.
    op: String,
    /// Bytes per value: 4096, 64K, 16M, 1G.
    #[arg(value_name = "SIZE", value_parser = parse_size, default_value = "16M")]
    bytes: usize,
    /// Values per call (devices).
    #[arg(value_name = "NDEV", default_value_t = 4)]
    n: usize,
    /// Timed repetitions; 0 picks a count by size.
    #[arg(default_value_t = 0)]
    reps: usize,
    /// Untimed repetitions first.
    #[arg(default_value_t = 3)]
    warmup: usize,
    /// assign, axpby, sgd, sgd_mom or adam.
    #[arg(default_value = "assign")]
    updater: String,
    /// float32, float16 or bfloat16 (or f32, f16, bf16).
    #[arg(value_parser = parse_dtype, default_value = "float32")]
    dtype: DType,
}

/// A dtype as a workload names it.
fn parse_dtype(name: &str) -> std::result::Result<DType, String> {
    match name {
        "float32" | "f32" => Ok(DType::F32),
        "float16" | "f16" => Ok(DType::F16),
        "bfloat16" | "bf16" => Ok(DType::BF16),
        other => Err(format!(
            "unknown dtype '{other}': use float32, float16 or bfloat16"
        )),
    }
}

/// Times one store workload (or a roof kernel) and prints one JSON line; or many, with
/// `--serve`, `--suite` or `--half-ab`.
#[derive(Parser)]
#[command(name = "bench_kv")]
struct Cli {
    /// Read one workload per stdin line (OP SIZE NDEV ...) and print one JSON line for each.
    #[arg(long, exclusive = true)]
    serve: bool,
    /// Every store op at every size and device count, interleaved with its roof kernel,
    /// ROUNDS times [default: 3].
    #[arg(
        long,
        exclusive = true,
        value_name = "ROUNDS",
        num_args = 0..=1,
        default_missing_value = "3"
    )]
    suite: Option<usize>,
    /// The float16/bfloat16 A/B of the updaters (scalar against 16-wide): ROUNDS [3], SIZE
    /// [64M], REPS [8].
    #[arg(long, exclusive = true, value_names = ["ROUNDS", "SIZE", "REPS"], num_args = 0..=3)]
    half_ab: Option<Vec<String>>,
    #[command(flatten)]
    cmd: Option<Cmd>,
}

/// `--half-ab`'s values.
#[derive(Parser)]
#[command(name = "bench_kv --half-ab")]
struct HalfAb {
    /// Rounds.
    #[arg(default_value_t = 3)]
    rounds: usize,
    /// Bytes per value: 4096, 64K, 16M, 1G.
    #[arg(value_name = "SIZE", value_parser = parse_size, default_value = "64M")]
    bytes: usize,
    /// Timed repetitions per round.
    #[arg(default_value_t = 8)]
    reps: usize,
}

impl Cmd {
    /// The workload named by `args` (the words after `bench_kv`); REPS 0 picks a count.
    fn parse(args: &[&str]) -> Result<Cmd> {
        let words = std::iter::once("bench_kv").chain(args.iter().copied());
        let mut cmd = Cmd::try_parse_from(words)?;
        cmd.resolve();
        Ok(cmd)
    }

    /// Picks the count of repetitions by size where REPS is 0.
    fn resolve(&mut self) {
        if self.reps == 0 {
            self.reps = common::auto_reps(self.bytes);
        }
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
fn half_ab(target: Target, rounds: usize, bytes: usize, reps: usize) -> Result<()> {
    let mut roof = Bufs::new(4, bytes);
    for round in 0..rounds {
        for dtype in ["float32", "float16", "bfloat16"] {
            for (name, updater) in common::updaters() {
                let dt = parse_dtype(dtype).map_err(anyhow::Error::msg)?;
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
    let cli = Cli::parse();
    if cli.serve {
        for line in std::io::stdin().lock().lines() {
            let line = line?;
            let words: Vec<&str> = line.split_whitespace().collect();
            if words.is_empty() {
                continue;
            }
            if let Err(e) = Cmd::parse(&words).and_then(|c| c.report(target, 0)) {
                // One line per command: a usage error's first line says what is wrong.
                let e = e.to_string();
                let first = e.lines().next().unwrap_or_default();
                println!("{{\"error\":\"{}\"}}", first.replace('"', "'"));
            }
        }
        return Ok(());
    }
    if let Some(values) = cli.half_ab {
        let words = std::iter::once("--half-ab").chain(values.iter().map(String::as_str));
        let h = HalfAb::try_parse_from(words).unwrap_or_else(|e| e.exit());
        return half_ab(target, h.rounds, h.bytes, h.reps);
    }
    if let Some(rounds) = cli.suite {
        return suite(target, rounds);
    }
    match cli.cmd {
        Some(mut cmd) => {
            cmd.resolve();
            cmd.report(target, 0)
        }
        None => {
            Cli::command().print_help()?;
            std::process::exit(2);
        }
    }
}

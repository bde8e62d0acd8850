//! Bandwidth benches of the store, and the memory roof they are measured against.
//!
//! Groups (filter with `cargo bench --bench kv -- <prefix>`):
//! - `push/<n>dev`, `pull/<n>dev`, `pushpull/<n>dev`: one key of 4 KiB to 256 MiB;
//! - `roof/copy`, `roof/sum<n>`, `roof/sum<n>_rmw`, `roof/bcast<n>`: the same traffic without a store;
//! - `smallkeys`: 1000 keys × 1 KiB (`KVSTORE_BENCH_SMALL_KIB`) from 4 devices (`KVSTORE_BENCH_DEVS`;
//!   on the GPU target, the GPUs there are, at most 4), one list call vs a loop of single-key calls;
//! - `updater/<dtype>`: each built-in updater at a large size from 4 devices (as `smallkeys`);
//! - `gpu_d2d`: cudarc device-to-device copy (only with a GPU).
//!
//! Criterion's throughput is algbw (bytes of one value per second). At the end a summary prints
//! the median time, algbw and "moved" GB/s (fewest bytes read + written) of every bench run,
//! and each store result as a fraction of its roof.
//!
//! `KVSTORE_BENCH_QUICK=1` shrinks the matrix; `KVSTORE_BENCH_DEVICE=gpu|cpu` picks the target
//! (default: GPU when one is found).

#[path = "common/mod.rs"]
mod common;

use std::cell::RefCell;
use std::path::PathBuf;

use common::{roof::Bufs, size_name, Kv, SmallKeys, Target};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use kvstore::DType;

/// One bench that ran: its criterion id, the bytes of one value, and the bytes it moves.
struct Record {
    group: String,
    id: String,
    bytes: usize,
    moved: usize,
}

thread_local! {
    static RECORDS: RefCell<Vec<Record>> = const { RefCell::new(Vec::new()) };
}

static FILTER: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// Whether criterion's filter selects `group/id`; setup is skipped if not. The filter is taken as
/// plain substrings joined by `|` (criterion reads it as a regex; this covers `a|b|c`).
fn wanted(group: &str, id: &str) -> bool {
    let full = format!("{group}/{id}");
    FILTER
        .get()
        .and_then(|f| f.as_deref())
        .is_none_or(|f| selects(f, &full))
}

fn selects(filter: &str, full: &str) -> bool {
    filter.split('|').any(|part| full.contains(part))
}

fn record(group: &str, id: &str, bytes: usize, moved: usize) {
    RECORDS.with(|r| {
        r.borrow_mut().push(Record {
            group: group.to_owned(),
            id: id.to_owned(),
            bytes,
            moved,
        })
    });
}

/// Criterion's time and sample budget for `bytes` per iteration, and its throughput.
fn set_budget(g: &mut BenchmarkGroup<'_, WallTime>, bytes: usize) {
    let (time, samples) = common::criterion_budget(bytes);
    g.measurement_time(time).sample_size(samples);
    g.warm_up_time(std::time::Duration::from_millis(300));
    g.throughput(Throughput::Bytes(bytes as u64));
}

fn store_ops(c: &mut Criterion, target: Target) {
    for op in ["push", "pull", "pushpull"] {
        for n in common::dev_counts() {
            if !target.has(n) {
                eprintln!(
                    "skip {op}/{n}dev: {n} {} devices not available",
                    target.name()
                );
                continue;
            }
            let group_name = format!("{op}/{n}dev");
            let mut g = c.benchmark_group(&group_name);
            for bytes in common::sizes() {
                set_budget(&mut g, bytes);
                let id = size_name(bytes);
                if !wanted(&group_name, &id) {
                    continue;
                }
                let kv = Kv::new(target, n, bytes, DType::F32, kvstore::Updater::Assign)
                    .expect("bench setup");
                record(&group_name, &id, bytes, common::moved(op, n, bytes));
                g.bench_function(BenchmarkId::from_parameter(&id), |b| {
                    b.iter(|| match op {
                        "push" => kv.push(),
                        "pull" => kv.pull(),
                        _ => kv.pushpull(),
                    })
                });
            }
            g.finish();
        }
    }
}

fn roof(c: &mut Criterion) {
    let mut kernels: Vec<(String, usize)> = vec![("copy".into(), 1)];
    for n in common::dev_counts() {
        kernels.push((format!("sum{n}"), n));
        kernels.push((format!("sum{n}_rmw"), n));
        kernels.push((format!("bcast{n}"), n));
    }
    for (name, n) in kernels {
        let group_name = format!("roof/{name}");
        let mut g = c.benchmark_group(&group_name);
        for bytes in common::sizes() {
            set_budget(&mut g, bytes);
            let id = size_name(bytes);
            if !wanted(&group_name, &id) {
                continue;
            }
            let mut bufs = Bufs::new(n, bytes);
            let words = if name == "copy" {
                2
            } else if name.ends_with("_rmw") {
                n + 2
            } else {
                n + 1
            };
            record(&group_name, &id, bytes, words * bytes);
            g.bench_function(BenchmarkId::from_parameter(&id), |b| {
                b.iter(|| {
                    if name == "copy" {
                        bufs.copy()
                    } else if name.ends_with("_rmw") {
                        bufs.sum_rmw()
                    } else if name.starts_with("sum") {
                        bufs.sum()
                    } else {
                        bufs.bcast()
                    }
                })
            });
        }
        g.finish();
    }
}

/// One of the small-key workloads.
type SmallOp = fn(&SmallKeys) -> anyhow::Result<()>;

fn small_keys(c: &mut Criterion, target: Target) {
    let (count, n, bytes) = (1000, common::many_devs(target), common::small_key_bytes());
    if !target.has(n) {
        eprintln!(
            "skip smallkeys: {n} {} devices not available",
            target.name()
        );
        return;
    }
    let cases: [(&str, SmallOp); 4] = [
        ("push_list", SmallKeys::push_list),
        ("push_loop", SmallKeys::push_loop),
        ("pull_list", SmallKeys::pull_list),
        ("pull_loop", SmallKeys::pull_loop),
    ];
    if !cases.iter().any(|(name, _)| wanted("smallkeys", name)) {
        return;
    }
    eprintln!(
        "smallkeys: {count} keys of {} from {n} devices",
        size_name(bytes)
    );
    let sk = SmallKeys::new(target, count, bytes, n).expect("bench setup");
    let mut g = c.benchmark_group("smallkeys");
    // Throughput in elements = keys, so criterion prints keys per second.
    g.throughput(Throughput::Elements(count as u64));
    g.measurement_time(std::time::Duration::from_secs(2));
    g.sample_size(30);
    for (name, f) in cases {
        record("smallkeys", name, count * bytes, (n + 1) * count * bytes);
        g.bench_function(name, |b| b.iter(|| f(&sk)));
    }
    g.finish();
}

fn updaters(c: &mut Criterion, target: Target) {
    let n = common::many_devs(target);
    if !target.has(n) {
        eprintln!("skip updater: {n} {} devices not available", target.name());
        return;
    }
    let bytes = common::updater_size();
    for dtype in common::UPDATER_DTYPES {
        let group_name = format!("updater/{dtype}");
        let mut g = c.benchmark_group(&group_name);
        set_budget(&mut g, bytes);
        for (name, updater) in common::updaters() {
            let id = format!("{name}/{}", size_name(bytes));
            if !wanted(&group_name, &id) {
                continue;
            }
            let moved = common::moved_updater(&updater, n, bytes, dtype);
            let kv = Kv::new(target, n, bytes, dtype, updater).expect("bench setup");
            record(&group_name, &id, bytes, moved);
            g.bench_function(&id, |b| b.iter(|| kv.push()));
        }
        g.finish();
    }
}

fn gpu_d2d(c: &mut Criterion, target: Target) {
    if target != Target::Gpu || kvstore::gpu_count() == 0 {
        eprintln!("skip gpu_d2d: no GPU");
        return;
    }
    let mut g = c.benchmark_group("gpu_d2d");
    for bytes in common::sizes() {
        let id = size_name(bytes);
        if !wanted("gpu_d2d", &id) {
            continue;
        }
        set_budget(&mut g, bytes);
        record("gpu_d2d", &id, bytes, 2 * bytes);
        g.bench_function(BenchmarkId::from_parameter(&id), |b| {
            b.iter_custom(|iters| {
                let t = common::gpu_d2d_copy(bytes, iters as usize).expect("d2d copy");
                std::time::Duration::from_secs_f64(t.iter().sum())
            })
        });
    }
    g.finish();
}

/// Criterion's output folder.
fn criterion_dir() -> PathBuf {
    if let Ok(home) = std::env::var("CRITERION_HOME") {
        return home.into();
    }
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    PathBuf::from(target).join("criterion")
}

/// The median in ns from `<dir>/<group>/<id>/new/estimates.json`, without a JSON crate.
fn median_ns(group: &str, id: &str) -> Option<f64> {
    // Criterion turns `/` in group and function names into `_` for its folders.
    let dir = |s: &str| s.replace('/', "_");
    let path = criterion_dir()
        .join(dir(group))
        .join(dir(id))
        .join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let median = &text[text.find("\"median\"")?..];
    let pe = &median[median.find("\"point_estimate\":")? + 17..];
    let end = pe.find([',', '}'])?;
    pe[..end].trim().parse().ok()
}

/// The roof of a store bench: on the CPU, push ↔ sum of n, pull ↔ 1 into n; on a GPU every
/// store bench ↔ the device-to-device copy of the same size (`gpu_d2d`, when it ran too).
fn roof_of(group: &str, id: &str) -> Option<(String, String)> {
    if GPU_ROOF.get().copied().unwrap_or(false) {
        let size = id.rsplit('/').next()?;
        return Some(("gpu_d2d".to_owned(), size.to_owned()));
    }
    cpu_roof_of(group).map(|g| (g, id.to_owned()))
}

/// Whether the benches run on a GPU (their roof is then `gpu_d2d`).
static GPU_ROOF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// The CPU roof group for a store group: push ↔ sum of n, pull ↔ 1 into n.
fn cpu_roof_of(group: &str) -> Option<String> {
    let (op, rest) = group.split_once('/')?;
    let n = rest.strip_suffix("dev")?;
    match op {
        "push" => Some(format!("roof/sum{n}")),
        "pull" => Some(format!("roof/bcast{n}")),
        _ => None,
    }
}

fn summary(filter: Option<&str>) {
    let records = RECORDS.with(|r| std::mem::take(&mut *r.borrow_mut()));
    let moved_of = |group: &str, id: &str| -> Option<f64> {
        let r = records.iter().find(|r| r.group == group && r.id == id)?;
        Some(r.moved as f64 / median_ns(group, id)?)
    };
    println!("\n## Summary (medians; GB/s = 1e9 B/s)\n");
    println!("| bench | size | median | algbw GB/s | moved GB/s | % of roof |");
    println!("|---|---|---|---|---|---|");
    for r in &records {
        let full = format!("{}/{}", r.group, r.id);
        if filter.is_some_and(|f| !selects(f, &full)) {
            continue;
        }
        let Some(ns) = median_ns(&r.group, &r.id) else {
            continue;
        };
        let moved = r.moved as f64 / ns;
        let roof = roof_of(&r.group, &r.id)
            .filter(|(g, _)| *g != r.group)
            .and_then(|(g, id)| moved_of(&g, &id))
            .map_or("".to_owned(), |roof| {
                format!("{:.0}%", 100.0 * moved / roof)
            });
        let time = if ns >= 1e6 {
            format!("{:.2} ms", ns / 1e6)
        } else {
            format!("{:.1} µs", ns / 1e3)
        };
        println!(
            "| {} | {} | {time} | {:.2} | {moved:.2} | {roof} |",
            r.group,
            r.id,
            r.bytes as f64 / ns
        );
    }
}

fn main() {
    let target = Target::from_env();
    eprintln!(
        "kv bench: target {} ({} store)",
        target.name(),
        target.store()
    );
    let mut c = Criterion::default().configure_from_args();
    // The first free argument is criterion's filter; mirror it in the summary.
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .filter(|_| !std::env::args().any(|a| a == "--list"));
    FILTER.set(filter.clone()).expect("set once");
    GPU_ROOF.set(target == Target::Gpu).expect("set once");
    roof(&mut c);
    store_ops(&mut c, target);
    small_keys(&mut c, target);
    updaters(&mut c, target);
    gpu_d2d(&mut c, target);
    c.final_summary();
    if !std::env::args().any(|a| a == "--list" || a == "--test") {
        summary(filter.as_deref());
    }
}

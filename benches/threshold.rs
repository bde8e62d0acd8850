//! Where a push or pull should start using the thread pool: the same store calls at sizes
//! around `PAR_MIN_BYTES`, forced onto the calling thread (`seq`) and forced onto the pool
//! (`par`) by creating each store with `KVSTORE_PAR_MIN_BYTES` set to `usize::MAX` or 0.
//!
//! `cargo bench --bench threshold` (filter by `threshold/push` or `threshold/pull`).
//! The store's own choice is `kvstore::__internal::cpu::PAR_MIN_BYTES`; the sizes below are of one
//! value, from 4 devices, so traffic is 5× the value size.

#[path = "common/mod.rs"]
mod common;

use common::{Kv, Target};
use criterion::{BenchmarkId, Criterion, Throughput};
use kvstore::{DType, Updater};

fn main() {
    let mut c = Criterion::default()
        .configure_from_args()
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(1));
    let n = 4;
    eprintln!(
        "PAR_MIN_BYTES = {} (traffic bytes)",
        kvstore::__internal::cpu::PAR_MIN_BYTES
    );
    for op in ["push", "pull"] {
        let mut g = c.benchmark_group(format!("threshold/{op}"));
        for kib in [16usize, 32, 64, 128, 256, 512, 1024, 2048] {
            let bytes = kib << 10;
            g.throughput(Throughput::Bytes(bytes as u64));
            let f = if op == "push" { Kv::push } else { Kv::pull };
            for (name, min) in [("seq", usize::MAX), ("par", 0)] {
                // A store reads its threshold when it is created.
                std::env::set_var("KVSTORE_PAR_MIN_BYTES", min.to_string());
                let kv =
                    Kv::new(Target::Cpu, n, bytes, DType::F32, Updater::Assign).expect("setup");
                g.bench_function(BenchmarkId::new(name, format!("{kib}K")), |b| {
                    b.iter(|| f(&kv))
                });
            }
        }
        g.finish();
    }
    std::env::remove_var("KVSTORE_PAR_MIN_BYTES");
    c.final_summary();
}

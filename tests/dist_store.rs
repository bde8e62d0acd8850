//! The `dist_sync` store (`dist`, `dist_device_sync`) run for real under `mpirun` with 2, 3 and 4
//! ranks, oversubscribed.
//!
//! Each `#[test]` launches `mpirun -np N` on this same test binary (the launcher is
//! `tests/common/mpi_job.rs`, shared with `tests/dist_transport.rs`), which re-enters through
//! the ignored test [`inner`] with `KVT_CASE` naming the case. Every rank prints
//! `KVT rank=R size=N OK <case> ...` when its part passed; the outer test checks those lines and
//! the job's exit code, and every job has a hard bound past which it is killed (and the test
//! fails).
//!
//! The data is fresh on every run: the outer test draws a seed and hands it to every rank
//! (`KVT_SEED`), so each rank can compute every other rank's values and, from them, a reference
//! in f64 that never comes from the store. Values are checked on every rank.
//!
//! - **nightly**: MXNet's `dist_sync_kvstore.py` (`test` optimizer with `rescale_grad=2`,
//!   pushes of `ones*(rank+1)`): int and string keys, f32 and f16, big sliced keys, list calls,
//!   init from rank 0.
//! - **updaters**: every built-in updater against an f64 reference over 3 rounds, with big-key
//!   slicing off, on, and down to empty slices.
//! - **semantics**: list ops, repeats, pushpull, broadcast, dtype-converting pulls, priorities,
//!   `keys()` / `meta()`, the updater running on the home rank only.
//! - **bad input**: one rank's bad input is its own typed error and `RankRejected` on the others;
//!   nothing changes, and the store stays usable.
//! - **desync**, **skipped call**, **SIGKILL**: an error on every rank, and the job ends by
//!   itself, non-zero.
//! - **training**: N-rank data-parallel training equals single-process training (an f64 loop
//!   written here) within 1e-5, for SGD-momentum and Adam, slicing on and off.
//! - **across ranks**: an LR schedule's rate, the push hook's step, and a failing updater are
//!   the same on every rank (three bugs these tests found, fixed).
//!
//! `KVT_SEED=<n>` in the environment replays a run's data (each test prints its seed).
#![cfg(feature = "mpi")]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use kvstore::{
    cpu, Adam, DType, Device, Error, Key, KvStore, NDArray, Sgd, Shape, StoreKind, Updater,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::mpi_job::{launch, ok_line, Job};
use common::reference::{rounded, RefKey};

// =============================================================================================
// The outer side: one job per test.
// =============================================================================================

/// `KVSTORE_TIMEOUT` of the jobs that should succeed: a rank that panics makes the others time
/// out (and the job end) well before the bound.
const HEALTHY_TIMEOUT: &str = "20";

/// Runs `case` on `np` ranks with a fresh seed (or `KVT_SEED`, to replay a run) and `env`;
/// `None` without mpirun.
fn run(np: usize, case: &str, env: &[(&str, &str)], bound_s: u64) -> Option<Job> {
    let seed = std::env::var("KVT_SEED").unwrap_or_else(|_| rand::random::<u64>().to_string());
    println!("{case} on {np} ranks, seed {seed}");
    let mut all: Vec<(&str, &str)> = vec![("KVT_SEED", seed.as_str())];
    if !env.iter().any(|(k, _)| *k == "KVSTORE_TIMEOUT") {
        all.push(("KVSTORE_TIMEOUT", HEALTHY_TIMEOUT));
    }
    all.extend_from_slice(env);
    launch(Some(np), case, &all, Duration::from_secs(bound_s))
}

/// Runs a case that must pass on every rank; returns each rank's OK line.
fn healthy(np: usize, case: &str, env: &[(&str, &str)]) -> Option<Vec<String>> {
    let job = run(np, case, env, 120)?;
    let lines = job.assert_healthy(np, case);
    Some(lines.into_iter().map(str::to_owned).collect())
}

/// The value of `name=` in an OK line (up to the next space).
fn field<'a>(line: &'a str, name: &str) -> &'a str {
    let tag = format!(" {name}=");
    let at = line
        .find(&tag)
        .unwrap_or_else(|| panic!("no {name}= in {line}"));
    let rest = &line[at + tag.len()..];
    rest.split(' ').next().unwrap_or("")
}

/// Asserts that every rank printed the same `name=` field.
fn same_on_every_rank(lines: &[String], name: &str) {
    let first = field(&lines[0], name);
    for l in lines {
        assert_eq!(field(l, name), first, "ranks differ in {name}:\n{lines:#?}");
    }
}

// --- 1. MXNet's nightly dist_sync_kvstore.py ------------------------------------------------

fn nightly(np: usize, kind: &str) {
    nightly_with(np, kind, &[]);
}

fn nightly_with(np: usize, kind: &str, env: &[(&str, &str)]) {
    let mut env = env.to_vec();
    env.push(("KVT_KIND", kind));
    let Some(lines) = healthy(np, "nightly", &env) else {
        return;
    };
    // The formula, here as well as on the ranks: 1 + rescale·devices·n(n+1)/2·rounds.
    let tri = np * (np + 1) / 2;
    let (d1, d2) = (1 + 2 * tri * 3, 1 + 2 * 2 * tri * 3);
    for l in &lines {
        assert_eq!(field(l, "d1"), d1.to_string(), "{l}");
        assert_eq!(field(l, "d2"), d2.to_string(), "{l}");
        assert_eq!(field(l, "kind"), kind, "{l}");
    }
}

#[test]
fn nightly_dist_sync_semantics_on_2_ranks() {
    nightly(2, "dist_sync");
}

/// The 1200×1200 keys whole (a bound above their size): each travels alone, broadcast straight
/// into the out that pulls it.
#[test]
fn nightly_dist_sync_semantics_unsliced_on_2_ranks() {
    nightly_with(2, "dist_sync", &[("KVSTORE_BIGARRAY_BOUND", "100000000")]);
}

#[test]
fn nightly_dist_sync_semantics_on_3_ranks_as_dist() {
    nightly(3, "dist");
}

#[test]
fn nightly_dist_sync_semantics_on_4_ranks_as_dist_device_sync() {
    nightly(4, "dist_device_sync");
}

// --- 2. Every updater against an f64 reference ----------------------------------------------

#[test]
fn every_updater_matches_an_f64_reference_unsliced_on_2_ranks() {
    healthy(2, "updaters", &[]);
}

#[test]
fn every_updater_matches_an_f64_reference_sliced_on_3_ranks() {
    healthy(3, "updaters", &[("KVSTORE_BIGARRAY_BOUND", "100")]);
}

/// A bound of 4 slices every key, and gives the last of 4 ranks an empty slice of a 5-element
/// key (blocks of 2: 2, 2, 1, 0).
#[test]
fn every_updater_matches_an_f64_reference_with_empty_slices_on_4_ranks() {
    healthy(4, "updaters", &[("KVSTORE_BIGARRAY_BOUND", "4")]);
}

// --- 3. List ops, repeats, pushpull, broadcast, conversions, priorities ----------------------

/// Checks the `updated=` fields: the updater ran for a whole key on exactly one rank, and for a
/// sliced key on every rank.
fn semantics(np: usize, bound: Option<&str>) {
    let env: Vec<(&str, &str)> = bound
        .map(|b| ("KVSTORE_BIGARRAY_BOUND", b))
        .into_iter()
        .collect();
    let Some(lines) = healthy(np, "semantics", &env) else {
        return;
    };
    same_on_every_rank(&lines, "keys");
    same_on_every_rank(&lines, "init_order");
    same_on_every_rank(&lines, "meta");
    same_on_every_rank(&lines, "hook");
    let bound: usize = bound.map_or(1_000_000, |b| b.parse().unwrap());
    let mut count: BTreeMap<i32, usize> = BTreeMap::new();
    for l in &lines {
        for k in field(l, "updated").split(',').filter(|s| !s.is_empty()) {
            *count.entry(k.parse().unwrap()).or_default() += 1;
        }
    }
    for (key, size) in SEM_PRIO_KEYS {
        let want = if np > 1 && size > bound { np } else { 1 };
        assert_eq!(
            count.get(&key).copied().unwrap_or(0),
            want,
            "key {key} ({size} elements, bound {bound}): updater ran on the wrong number of ranks\n{lines:#?}"
        );
    }
}

#[test]
fn list_ops_repeats_pushpull_broadcast_and_priorities_on_2_ranks() {
    semantics(2, None);
}

#[test]
fn list_ops_repeats_pushpull_broadcast_and_priorities_sliced_on_3_ranks() {
    semantics(3, Some("100"));
}

/// Four ranks, as the simulated cluster's 2 hosts x 2 run them (scripts/cluster-tests.sh).
#[test]
fn list_ops_repeats_pushpull_broadcast_and_priorities_sliced_on_4_ranks() {
    semantics(4, Some("100"));
}

// --- 4. Bad input on one rank ----------------------------------------------------------------

#[test]
fn bad_input_on_one_rank_is_rejected_everywhere_and_changes_nothing_on_3_ranks() {
    healthy(3, "bad_input", &[]);
}

#[test]
fn bad_input_on_one_rank_is_rejected_everywhere_and_changes_nothing_sliced_on_4_ranks() {
    healthy(4, "bad_input", &[("KVSTORE_BIGARRAY_BOUND", "10")]);
}

// --- 5. Desync -------------------------------------------------------------------------------

/// A desync must be found by the fingerprint check at once, not by the 30 s timeout: the bound
/// (20 s) kills a job that waits for the timeout.
fn desync(np: usize, how: &str, needles: &[&str]) {
    let env = [("KVSTORE_TIMEOUT", "30"), ("KVT_HOW", how)];
    let Some(job) = run(np, "desync", &env, 20) else {
        return;
    };
    assert!(!job.killed, "a desync must end the job by itself\n{job}");
    let ranks: Vec<usize> = (0..np).collect();
    job.assert_ok(&ranks, np, "desync", needles);
    assert_ne!(job.code, Some(0), "a desynced job must end non-zero\n{job}");
}

#[test]
fn ranks_pushing_different_keys_get_desync_on_every_rank_on_3_ranks() {
    desync(
        3,
        "key",
        &["push (call #", "key 3 on ranks [0, 2], key 5 on rank 1"],
    );
}

#[test]
fn ranks_initializing_different_shapes_get_desync_on_every_rank_on_2_ranks() {
    desync(
        2,
        "shape",
        &["init (call #", "[2, 3] on rank 0, [3, 2] on rank 1"],
    );
}

#[test]
fn ranks_making_different_calls_get_desync_on_every_rank_on_4_ranks() {
    desync(4, "op", &["(call #", "disagree"]);
}

// --- 6. Faults -------------------------------------------------------------------------------

/// A rank skips a push and sleeps for a minute; the others must get a Timeout naming it within
/// KVSTORE_TIMEOUT (3 s) plus a margin, and the job must end by itself (the bound is 25 s, far
/// less than the sleeper's minute).
fn skipped(np: usize, check: &str, bound: Option<&str>) {
    let mut env = vec![("KVSTORE_TIMEOUT", "3"), ("KVSTORE_DIST_CHECK", check)];
    env.extend(bound.map(|b| ("KVSTORE_BIGARRAY_BOUND", b)));
    let Some(job) = run(np, "skip", &env, 25) else {
        return;
    };
    assert!(
        !job.killed,
        "the job must end by itself, long before the sleeper wakes\n{job}"
    );
    let last = np - 1;
    let others: Vec<usize> = (0..last).collect();
    let missing = format!("missing=[{last}]");
    job.assert_ok(
        &others,
        np,
        "skip",
        &[&missing, "timed out", "then: ", "failed earlier"],
    );
    assert!(
        job.ok_line(last, np, "skip").is_none(),
        "the skipping rank must not finish\n{job}"
    );
    assert_ne!(job.code, Some(0), "{job}");
}

#[test]
fn a_rank_that_skips_a_push_times_out_the_others_naming_it_on_3_ranks() {
    skipped(3, "1", None);
}

#[test]
fn a_rank_that_skips_a_push_times_out_the_others_without_the_check_on_2_ranks() {
    skipped(2, "0", Some("10"));
}

/// A rank that arrives in a push after another rank timed out in it gets a typed error, as
/// that rank does: the fingerprint check completes on it (the timed-out rank's part of it was
/// sent), but the push's reduce must not run blocking for a rank that gave the call up, or its
/// watchdog would end the late rank's process instead.
#[test]
fn a_rank_late_to_a_push_another_rank_gave_up_gets_an_error_not_killed() {
    let env = [("KVSTORE_TIMEOUT", "2")];
    let Some(job) = run(2, "late", &env, 40) else {
        return;
    };
    assert!(!job.killed, "the job must end by itself\n{job}");
    job.assert_ok(&[0], 2, "late", &["timed out"]);
    let late = job.ok_line(1, 2, "late");
    assert!(
        late.is_some(),
        "the late rank must get its error, not be ended\n{job}"
    );
    assert!(!job.stderr.contains("inside its blocking"), "{job}");
}

#[test]
fn a_rank_killed_by_sigkill_mid_run_ends_the_job_non_zero_on_4_ranks() {
    let env = [("KVSTORE_TIMEOUT", "10")];
    let Some(job) = run(4, "sigkill", &env, 40) else {
        return;
    };
    assert!(!job.killed, "the job must end by itself\n{job}");
    assert_ne!(job.code, Some(0), "{job}");
    job.assert_no_ok("sigkill");
}

// --- 8. Schedules, the push hook and failing updaters across ranks -------------------------

/// An LR schedule's rate is a function of `num_update`, the largest update count of any key.
/// Every rank keeps every key's update count, so every rank computes the rate a `local` store
/// would, whichever rank homes the busiest key; `num_update()` and `learning_rate()` agree.
#[test]
fn an_lr_schedule_gives_the_same_rates_as_a_local_store_on_2_ranks() {
    healthy(2, "schedule", &[]);
}

/// The push hook's `step` (Adam's `t`) is the same on every rank, homed there or not.
#[test]
fn the_push_hook_sees_the_same_steps_on_every_rank_on_2_ranks() {
    healthy(2, "hook_steps", &[]);
}

/// An updater that fails on a key's home fails the push (and a pushpull) on every rank, before
/// anything is stored, and the ranks stay in step.
#[test]
fn a_failing_updater_in_a_pushpull_keeps_the_ranks_in_step_on_2_ranks() {
    healthy(2, "updater_failure", &[]);
}

/// Queued calls (`AsyncKvStore`) on real MPI ranks: every rank queues its pushes and pulls at
/// its own pace (rank 0 all rounds at once, the others a round at a time) and with priorities
/// of its own, and still pulls the sum over the ranks; one rank's bad queued push fails every
/// rank's wait, stops the calls queued after it, and changes nothing.
#[test]
fn queued_calls_equal_the_sums_and_fail_together_on_2_ranks() {
    healthy(2, "async", &[]);
}

/// The same with the big key sliced over 3 ranks.
#[test]
fn queued_calls_equal_the_sums_and_fail_together_sliced_on_3_ranks() {
    healthy(3, "async", &[("KVSTORE_BIGARRAY_BOUND", "100000")]);
}

/// Gradient compression across ranks (2-bit, and the bfloat16 and float16 wires) equals a local
/// `device` store that pushes every rank's value as one list with the same compression (each
/// position keeps its own residual, as each rank does), bit for bit, over several pushes, for a
/// whole key and a sliced one.
#[test]
fn compressed_pushes_equal_a_local_compressed_store_sliced_on_3_ranks() {
    healthy(3, "compressed", &[("KVSTORE_BIGARRAY_BOUND", "1000")]);
}

/// The same on 2 ranks, every key whole.
#[test]
fn compressed_pushes_equal_a_local_compressed_store_unsliced_on_2_ranks() {
    healthy(2, "compressed", &[]);
}

/// Row-sparse training of an embedding across ranks: lazy SGD with momentum equals a local
/// store pushed every rank's rows as one list, bit for bit, and plain SGD on the rows equals
/// dense training (zeros in the rows not pushed) on the same data, at every step, with rows
/// travelling only to the ranks that hold them; `row_sparse_pull` of random ids agrees.
#[test]
fn row_sparse_training_equals_a_local_store_and_dense_training_sliced_on_3_ranks() {
    healthy(3, "row_sparse", &[("KVSTORE_BIGARRAY_BOUND", "1000")]);
}

/// The same on 2 ranks, the embedding whole on one rank, and on 4 ranks sliced.
#[test]
fn row_sparse_training_equals_a_local_store_unsliced_on_2_ranks() {
    healthy(2, "row_sparse", &[]);
}

#[test]
fn row_sparse_training_equals_a_local_store_sliced_on_4_ranks() {
    healthy(4, "row_sparse", &[("KVSTORE_BIGARRAY_BOUND", "1000")]);
}

/// A push's sum is rank 0's value plus rank 1's and so on, in that order, bit for bit, however
/// its key travels: alone, packed with others, in one list or in its own call (MPI's own reduce
/// picks its order of additions by message size, so a key's sum depended on its neighbours).
fn in_rank_order(np: usize) {
    healthy(np, "in_order", &[]);
}

#[test]
fn a_push_sums_the_ranks_in_rank_order_however_packed_on_3_ranks() {
    in_rank_order(3);
}

#[test]
fn a_push_sums_the_ranks_in_rank_order_however_packed_on_4_ranks() {
    in_rank_order(4);
}

// --- 7. Training equivalence -----------------------------------------------------------------

fn training(np: usize, bound: Option<&str>) {
    let env: Vec<(&str, &str)> = bound
        .map(|b| ("KVSTORE_BIGARRAY_BOUND", b))
        .into_iter()
        .collect();
    training_with(np, &env);
}

/// [`training`] with the environment `env`.
fn training_with(np: usize, env: &[(&str, &str)]) {
    let Some(lines) = healthy(np, "train", env) else {
        return;
    };
    // Every rank ends with the very same parameters, bit for bit.
    same_on_every_rank(&lines, "sgd_hash");
    same_on_every_rank(&lines, "adam_hash");
}

#[test]
fn data_parallel_training_matches_one_process_unsliced_on_2_ranks() {
    training(2, None);
}

#[test]
fn data_parallel_training_matches_one_process_sliced_on_3_ranks() {
    training(3, Some("50"));
}

#[test]
fn data_parallel_training_matches_one_process_sliced_on_4_ranks() {
    training(4, Some("50"));
}

// --- 8. Several machines: sliced keys in two stages ------------------------------------------
//
// `KVSTORE_TEST_MACHINES=2` (test support) makes 4 ranks on this box 2 machines of 2 ranks, so a
// sliced key's reduce-scatter and all-gather run in two stages (within each machine, then
// across), as on the simulated cluster (scripts/cluster-tests.sh).

/// Each machine's ranks in local rank order, then the machines, bit for bit, however packed.
#[test]
fn a_push_sums_each_machine_then_the_machines_on_2_machines_of_2_ranks() {
    healthy(4, "in_order", &[("KVSTORE_TEST_MACHINES", "2")]);
}

/// Ranks dealt to the machines round robin (`--map-by node`): the same two stages.
#[test]
fn a_push_sums_each_machine_then_the_machines_placed_round_robin() {
    healthy(4, "in_order", &[("KVSTORE_TEST_MACHINES", "2:rr")]);
}

/// Machines of 2 and 1 ranks: flat, in rank order.
#[test]
fn a_push_sums_the_ranks_in_rank_order_on_uneven_machines() {
    healthy(3, "in_order", &[("KVSTORE_TEST_MACHINES", "2")]);
}

#[test]
fn every_updater_matches_an_f64_reference_sliced_on_2_machines_of_2_ranks() {
    healthy(
        4,
        "updaters",
        &[
            ("KVSTORE_TEST_MACHINES", "2"),
            ("KVSTORE_BIGARRAY_BOUND", "100"),
        ],
    );
}

#[test]
fn data_parallel_training_matches_one_process_sliced_on_2_machines_of_2_ranks() {
    let env = [
        ("KVSTORE_TEST_MACHINES", "2"),
        ("KVSTORE_BIGARRAY_BOUND", "50"),
    ];
    training_with(4, &env);
}

// =============================================================================================
// The inner side: one case, on every rank.
// =============================================================================================

/// The entry point of the ranks; the outer tests run it through mpirun.
#[test]
#[ignore = "run on every rank under mpirun by the other tests"]
fn inner() {
    let case = std::env::var(common::mpi_job::CASE_VAR).expect("KVT_CASE names the case");
    match case.as_str() {
        "nightly" => case_nightly(),
        "updaters" => case_updaters(),
        "semantics" => case_semantics(),
        "bad_input" => case_bad_input(),
        "desync" => case_desync(),
        "skip" => case_skip(),
        "late" => case_late(),
        "sigkill" => case_sigkill(),
        "train" => case_train(),
        "schedule" => case_schedule(),
        "hook_steps" => case_hook_steps(),
        "updater_failure" => case_updater_failure(),
        "values_kept" => case_values_kept(),
        "compressed" => case_compressed(),
        "row_sparse" => case_row_sparse(),
        "async" => case_async(),
        "in_order" => case_in_order(),
        other => panic!("unknown case {other}"),
    }
}

// --- Helpers ---------------------------------------------------------------------------------

fn env_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// The run's seed, the same on every rank.
fn seed() -> u64 {
    env_var("KVT_SEED").parse().expect("KVT_SEED is a number")
}

/// Keys of more elements than this are sliced over every rank (what the store reads).
fn bound() -> usize {
    std::env::var("KVSTORE_BIGARRAY_BOUND").map_or(1_000_000, |b| b.parse().unwrap())
}

/// `n` numbers uniform in [-1, 1), a function of the run's seed and `tag` alone: every rank
/// computes every other rank's data.
fn uniform(tag: &[u64], n: usize) -> Vec<f64> {
    let mut h = seed() ^ 0x9e37_79b9_7f4a_7c15;
    for &t in tag {
        // splitmix64 steps
        h = (h ^ t).wrapping_add(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
    }
    let mut rng = StdRng::seed_from_u64(h);
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

/// An array of `dtype` and `shape` on `cpu(dev)` holding `data`.
fn arr(data: &[f64], shape: &[usize], dtype: DType, dev: usize) -> NDArray {
    NDArray::from_f64(data, Shape::new(shape).unwrap(), dtype, cpu(dev)).unwrap()
}

/// An array filled with `v`.
fn full(shape: &[usize], v: f64, dtype: DType, dev: usize) -> NDArray {
    NDArray::full_on(Shape::new(shape).unwrap(), v, dtype, cpu(dev)).unwrap()
}

/// An out array poisoned with a value no check expects.
fn poisoned(shape: &[usize], dtype: DType, dev: usize) -> NDArray {
    full(shape, -1234.5, dtype, dev)
}

fn get(a: &NDArray) -> Vec<f64> {
    a.to_vec::<f64>().unwrap()
}

fn size_of(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// The tolerance of a value of `dtype` that went through a sum over ranks: relative to
/// `|want| + 1`.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 16.0 * f16::EPSILON.to_f64(),
        DType::BF16 => 16.0 * half::bf16::EPSILON.to_f64(),
    }
}

/// Asserts `got` equals `want` within the tolerance of `dtype`.
fn assert_close(got: &[f64], want: &[f64], dtype: DType, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let tol = tolerance(dtype);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (w.abs() + 1.0),
            "{what} ({dtype:?}): element {i} of {} is {g} but the reference says {w} \
             (tolerance {tol}, seed {})",
            got.len(),
            seed()
        );
    }
}

/// The store of `kind`, with its rank and size checked against what mpirun told the process.
/// (Open MPI's variables; under another MPI the check is left out.)
fn store(kind: &str) -> KvStore {
    let kv = KvStore::create(kind).unwrap_or_else(|e| panic!("create {kind}: {e}"));
    let mpi = |v: &str| std::env::var(v).ok().map(|x| x.parse::<usize>().unwrap());
    if let Some(size) = mpi("OMPI_COMM_WORLD_SIZE") {
        assert_eq!(kv.num_workers(), size);
        assert_eq!(Some(kv.rank()), mpi("OMPI_COMM_WORLD_RANK"));
        // Machines made up for the test (`KVSTORE_TEST_MACHINES`) number their own ranks.
        if std::env::var_os("KVSTORE_TEST_MACHINES").is_none() {
            assert_eq!(Some(kv.local_rank()), mpi("OMPI_COMM_WORLD_LOCAL_RANK"));
        }
    }
    assert!(
        kv.num_workers() > 1,
        "run under mpirun with 2 ranks or more"
    );
    // The local rank is the launcher's, which need not follow the world rank's order.
    assert!(kv.rank() < kv.num_workers() && kv.local_rank() < kv.num_workers());
    kv
}

fn case_late() {
    let kv = store("dist_sync");
    let n = 1 << 12;
    kv.init(0, &NDArray::zeros([n])).unwrap();
    let t = std::time::Instant::now();
    if kv.rank() == 1 {
        // Rank 0 times out in the push's check (KVSTORE_TIMEOUT=2) before this rank comes.
        std::thread::sleep(Duration::from_millis(2500));
    }
    let e = kv.push(0, &NDArray::ones([n])).unwrap_err();
    if kv.rank() == 0 {
        // Handling its error while rank 1 is in the push.
        std::thread::sleep(Duration::from_secs(2));
    }
    ok(&kv, "late", &format!("after {:?}: {e}", t.elapsed()));
}

fn ok(kv: &KvStore, case: &str, detail: &str) {
    ok_line(kv.rank(), kv.num_workers(), case, detail);
}

// --- Reference updaters ----------------------------------------------------------------------

fn add_into(acc: &mut [f64], x: &[f64]) {
    for (a, x) in acc.iter_mut().zip(x) {
        *a += x;
    }
}

// --- 1. nightly ------------------------------------------------------------------------------

/// A key of the nightly test: its shape, dtype, and on how many devices each rank pushes it.
struct NKey {
    key: Key,
    shape: Vec<usize>,
    dtype: DType,
    devs: usize,
}

/// MXNet's keys: '3', '5', '7' (2,3) and '99' (1200,1200) in f32; '4', '6', '8' and '100' in
/// f16. The big keys have 1.44e6 elements: sliced under the default bound of 1e6.
fn nightly_keys(strings: bool) -> Vec<NKey> {
    let spec: [(i32, &[usize], DType, usize); 8] = [
        (3, &[2, 3], DType::F32, 1),
        (5, &[2, 3], DType::F32, 2),
        (7, &[2, 3], DType::F32, 2),
        (99, &[1200, 1200], DType::F32, 2),
        (4, &[2, 3], DType::F16, 1),
        (6, &[2, 3], DType::F16, 1),
        (8, &[2, 3], DType::F16, 2),
        (100, &[1200, 1200], DType::F16, 1),
    ];
    spec.iter()
        .map(|&(k, shape, dtype, devs)| NKey {
            key: if strings {
                Key::from(k.to_string())
            } else {
                Key::Int(k)
            },
            shape: shape.to_vec(),
            dtype,
            devs,
        })
        .collect()
}

/// The outs of a pull of `k`: one per device it is pushed from, poisoned.
fn outs_of(k: &NKey) -> Vec<NDArray> {
    (0..k.devs)
        .map(|d| poisoned(&k.shape, k.dtype, d))
        .collect()
}

fn check_filled(outs: &[NDArray], want: f64, what: &str) {
    for (d, o) in outs.iter().enumerate() {
        let v = get(o);
        if let Some((i, x)) = v.iter().enumerate().find(|(_, &x)| x != want) {
            panic!(
                "{what}, out {d}: element {i} of {} is {x}, want {want}",
                v.len()
            );
        }
    }
}

fn nightly_on(kv: &KvStore, strings: bool) -> (f64, f64) {
    let (r, n) = (kv.rank(), kv.num_workers());
    let keys = nightly_keys(strings);
    let small: Vec<&NKey> = keys
        .iter()
        .filter(|k| k.shape.len() == 2 && k.shape[0] == 2)
        .collect();
    let big: Vec<&NKey> = keys.iter().filter(|k| k.shape[0] == 1200).collect();
    // init takes rank 0's value: the others pass other values, which must be ignored.
    let init_value = |k: &NKey| {
        let v = if r == 0 { 1.0 } else { (r + 7) as f64 };
        full(&k.shape, v, k.dtype, 0)
    };
    let small_keys: Vec<Key> = small.iter().map(|k| k.key.clone()).collect();
    let small_vals: Vec<NDArray> = small.iter().map(|k| init_value(k)).collect();
    kv.init_list(&small_keys, &small_vals).unwrap();
    for k in &big {
        kv.init(&k.key, &init_value(k)).unwrap();
    }
    let all_keys: Vec<Key> = keys.iter().map(|k| k.key.clone()).collect();
    let outs: Vec<Vec<NDArray>> = keys.iter().map(outs_of).collect();
    kv.pull_list(&all_keys, &outs).unwrap();
    for (k, o) in keys.iter().zip(&outs) {
        check_filled(o, 1.0, &format!("key {} after init", k.key));
    }

    // MXNet 1.9.1's `test` optimizer with rescale_grad = 2: stored += 2 * input.
    kv.set_updater(Updater::custom(|_key, input, stored| {
        *stored += input * 2.0
    }))
    .unwrap();
    let tri = (n * (n + 1) / 2) as f64;
    let mut last = (0.0, 0.0);
    for round in 0..3 {
        let value = |k: &NKey| -> Vec<NDArray> {
            (0..k.devs)
                .map(|d| full(&k.shape, (r + 1) as f64, k.dtype, d))
                .collect()
        };
        // The first key alone (one value, or a list of one), the others in one list push.
        let first = &keys[0];
        match round {
            1 => kv.push(&first.key, &value(first)[0]).unwrap(),
            _ => kv.push(&first.key, &value(first)).unwrap(),
        }
        let rest: Vec<Key> = keys[1..].iter().map(|k| k.key.clone()).collect();
        let rest_vals: Vec<Vec<NDArray>> = keys[1..].iter().map(value).collect();
        kv.push_list(&rest, &rest_vals).unwrap();

        let outs: Vec<Vec<NDArray>> = keys.iter().map(outs_of).collect();
        if round == 1 {
            for (k, o) in keys.iter().zip(&outs) {
                kv.pull(&k.key, o).unwrap();
            }
        } else {
            kv.pull_list(&all_keys, &outs).unwrap();
        }
        for (k, o) in keys.iter().zip(&outs) {
            let want = 1.0 + 2.0 * k.devs as f64 * tri * (round + 1) as f64;
            check_filled(o, want, &format!("key {} after round {round}", k.key));
            if k.devs == 1 {
                last.0 = want;
            } else {
                last.1 = want;
            }
        }
    }
    // A pushpull of the values MXNet's dist_device_sync test checks: the same formula.
    let k = &keys[1];
    let vals: Vec<NDArray> = (0..k.devs)
        .map(|d| full(&k.shape, (r + 1) as f64, k.dtype, d))
        .collect();
    let outs = [
        poisoned(&k.shape, k.dtype, 0),
        poisoned(&k.shape, DType::F64, 1),
    ];
    kv.pushpull(&k.key, &vals, &outs).unwrap();
    check_filled(&outs, 1.0 + 2.0 * 2.0 * tri * 4.0, "pushpull after round 3");
    last
}

fn case_nightly() {
    let kind = env_var("KVT_KIND");
    let kv = store(&kind);
    let want = match kind.as_str() {
        "dist_device_sync" => StoreKind::DistDeviceSync,
        _ => StoreKind::DistSync,
    };
    assert_eq!(kv.kind(), want);
    assert_eq!(kv.type_name(), kind);
    let ints = nightly_on(&kv, false);
    kv.barrier().unwrap();
    // String keys: a second store over the same world.
    let strs = nightly_on(&store(&kind), true);
    assert_eq!(ints, strs);
    kv.barrier().unwrap();
    ok(
        &kv,
        "nightly",
        &format!("kind={kind} d1={} d2={}", ints.0, ints.1),
    );
}

// --- 2. updaters -----------------------------------------------------------------------------

fn updaters() -> Vec<(&'static str, Updater)> {
    vec![
        ("assign", Updater::Assign),
        ("axpby", Updater::Axpby { a: 0.9, b: 0.1 }),
        (
            "sgd",
            Updater::Sgd(Sgd {
                lr: 0.1,
                wd: 1e-3,
                ..Sgd::default()
            }),
        ),
        (
            "sgd_momentum",
            Updater::Sgd(Sgd {
                lr: 0.1,
                momentum: 0.9,
                wd: 1e-3,
                rescale_grad: 0.5,
                clip_gradient: Some(0.6),
            }),
        ),
        (
            "adam",
            Updater::Adam(Adam {
                lr: 0.01,
                wd: 1e-3,
                rescale_grad: 0.5,
                ..Adam::default()
            }),
        ),
        (
            "adam_clipped_torch_epsilon",
            Updater::Adam(Adam {
                lr: 0.02,
                beta1: 0.8,
                beta2: 0.99,
                epsilon: 1e-6,
                wd: 0.0,
                rescale_grad: 1.0,
                clip_gradient: Some(0.5),
                epsilon_after_correction: true,
            }),
        ),
    ]
}

/// Shapes and dtypes: small keys, keys just over a bound of 100, and a 5-element key that has
/// an empty slice at 4 ranks under a bound of 4.
const UPD_KEYS: [(&[usize], DType); 8] = [
    (&[5], DType::F32),
    (&[7], DType::F64),
    (&[3, 5], DType::F32),
    (&[101], DType::F32),
    (&[40, 31], DType::F32),
    (&[1000], DType::F64),
    (&[130], DType::F16),
    (&[2, 3, 4], DType::F32),
];

fn case_updaters() {
    let kv0 = store("dist_sync");
    let (r, n) = (kv0.rank(), kv0.num_workers());
    let keys: Vec<i32> = (0..UPD_KEYS.len() as i32).map(|k| 10 + k).collect();
    let mut sliced = 0;
    for (ui, (name, u)) in updaters().into_iter().enumerate() {
        let kv = store("dist_sync");
        let ui = ui as u64;
        // Rank 0's init values count; the others pass their own, which must be ignored.
        let init: Vec<NDArray> = UPD_KEYS
            .iter()
            .enumerate()
            .map(|(j, (shape, dtype))| {
                let from = if r == 0 { 0 } else { 1000 + r as u64 };
                arr(
                    &uniform(&[1, ui, j as u64, from], size_of(shape)),
                    shape,
                    *dtype,
                    0,
                )
            })
            .collect();
        kv.init_list(&keys, &init).unwrap();
        if !matches!(u, Updater::Assign) {
            kv.set_updater(u.clone()).unwrap();
        }
        let mut refs: Vec<RefKey> = UPD_KEYS
            .iter()
            .enumerate()
            .map(|(j, (shape, dtype))| {
                RefKey::new(*dtype, uniform(&[1, ui, j as u64, 0], size_of(shape)))
            })
            .collect();
        for round in 0..3u64 {
            // Each rank pushes each key from one or two devices.
            let devs = |j: usize| 1 + (j + round as usize) % 2;
            let data = |j: usize, rank: usize, d: usize| {
                let (shape, dtype) = UPD_KEYS[j];
                rounded(
                    dtype,
                    &uniform(
                        &[2, ui, j as u64, round, rank as u64, d as u64],
                        size_of(shape),
                    ),
                )
            };
            let values: Vec<Vec<NDArray>> = (0..UPD_KEYS.len())
                .map(|j| {
                    let (shape, dtype) = UPD_KEYS[j];
                    (0..devs(j))
                        .map(|d| arr(&data(j, r, d), shape, dtype, d))
                        .collect()
                })
                .collect();
            let outs: Vec<NDArray> = UPD_KEYS
                .iter()
                .enumerate()
                .map(|(j, (shape, dtype))| poisoned(shape, *dtype, j % 2))
                .collect();
            match round {
                0 => {
                    kv.push_list(&keys, &values).unwrap();
                    kv.pull_list(&keys, &outs).unwrap();
                }
                1 => {
                    for (k, v) in keys.iter().zip(&values) {
                        kv.push(k, v).unwrap();
                    }
                    for (k, o) in keys.iter().zip(&outs) {
                        kv.pull(k, o).unwrap();
                    }
                }
                _ => kv.pushpull_list(&keys, &values, &outs).unwrap(),
            }
            for (j, rk) in refs.iter_mut().enumerate() {
                let mut g = vec![0.0; rk.w.len()];
                for rank in 0..n {
                    for d in 0..devs(j) {
                        add_into(&mut g, &data(j, rank, d));
                    }
                }
                rk.step(&u, &g);
                let what = format!(
                    "{name}: key {} {:?} after round {round}",
                    keys[j], UPD_KEYS[j].0
                );
                assert_close(&get(&outs[j]), &rk.w, rk.dtype, &what);
            }
        }
        sliced = UPD_KEYS
            .iter()
            .filter(|(s, _)| n > 1 && size_of(s) > bound())
            .count();
    }
    kv0.barrier().unwrap();
    ok(
        &kv0,
        "updaters",
        &format!("updaters={} sliced_keys={sliced}", updaters().len()),
    );
}

// --- 3. semantics ----------------------------------------------------------------------------

/// The keys of the priority push, with their sizes.
const SEM_PRIO_KEYS: [(i32, usize); 5] = [(2, 3), (5, 6), (9, 20), (11, 3), (13, 300)];

fn case_semantics() {
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    // (key, shape, dtype), initialized in this order.
    let spec: [(i32, &[usize], DType); 6] = [
        (9, &[4, 5], DType::F32),
        (2, &[3], DType::F32),
        (5, &[2, 3], DType::F32),
        (11, &[3], DType::F32),
        (13, &[300], DType::F32),
        (14, &[7], DType::F64),
    ];
    let shape_of = |k: i32| spec.iter().find(|s| s.0 == k).unwrap().1;
    let dtype_of = |k: i32| spec.iter().find(|s| s.0 == k).unwrap().2;
    let keys: Vec<i32> = spec.iter().map(|s| s.0).collect();
    let data = |tag: u64, k: i32, rank: usize, d: usize| {
        rounded(
            dtype_of(k),
            &uniform(
                &[3, tag, k as u64, rank as u64, d as u64],
                size_of(shape_of(k)),
            ),
        )
    };
    let array = |tag: u64, k: i32, rank: usize, d: usize| {
        arr(&data(tag, k, rank, d), shape_of(k), dtype_of(k), d)
    };
    // The reference: every key's value.
    let mut want: BTreeMap<i32, Vec<f64>> = BTreeMap::new();

    // init from rank 0; keys(), keys_in_init_order(), meta().
    let init: Vec<NDArray> = keys.iter().map(|&k| array(0, k, r, 0)).collect();
    kv.init_list(&keys, &init).unwrap();
    for &k in &keys {
        want.insert(k, data(0, k, 0, 0));
    }
    let ints = |ks: Vec<Key>| -> Vec<i32> {
        ks.into_iter()
            .map(|k| match k {
                Key::Int(i) => i,
                other => panic!("not an int key: {other}"),
            })
            .collect()
    };
    let listed = ints(kv.keys());
    assert_eq!(listed, [2, 5, 9, 11, 13, 14]);
    let init_order = ints(kv.keys_in_init_order());
    assert_eq!(init_order, keys);
    let mut meta = Vec::new();
    for &k in &keys {
        let (shape, dtype, home) = kv.meta(k).unwrap();
        assert_eq!(shape.dims(), shape_of(k));
        assert_eq!(dtype, dtype_of(k));
        assert_eq!(home, Device::Cpu(0));
        meta.push(format!("{k}:{:?}:{dtype:?}", shape.dims()));
    }
    let check = |kv: &KvStore, want: &BTreeMap<i32, Vec<f64>>, what: &str| {
        let outs: Vec<NDArray> = keys
            .iter()
            .map(|&k| poisoned(shape_of(k), dtype_of(k), 0))
            .collect();
        kv.pull_list(&keys, &outs).unwrap();
        for (&k, o) in keys.iter().zip(&outs) {
            assert_close(&get(o), &want[&k], dtype_of(k), &format!("key {k} {what}"));
        }
    };
    check(&kv, &want, "after init");

    // Repeats of a key in one push are summed (no updater: the sum is assigned); one key with
    // values on two devices.
    let a = |rank| array(1, 5, rank, 0);
    let c = |rank| array(2, 5, rank, 1);
    let b = |rank, d| array(3, 2, rank, d);
    kv.push_list(
        &[5, 2, 5],
        &[vec![a(r)], vec![b(r, 0), b(r, 1)], vec![c(r)]],
    )
    .unwrap();
    let mut s5 = vec![0.0; 6];
    let mut s2 = vec![0.0; 3];
    for rank in 0..n {
        add_into(&mut s5, &data(1, 5, rank, 0));
        add_into(&mut s5, &data(2, 5, rank, 1));
        add_into(&mut s2, &data(3, 2, rank, 0));
        add_into(&mut s2, &data(3, 2, rank, 1));
    }
    want.insert(5, s5);
    want.insert(2, s2);
    check(&kv, &want, "after a push with repeats");

    // pushpull in place, over two devices; pushpull into outs of other dtypes.
    let vals = [array(4, 9, r, 0), array(4, 9, r, 1)];
    kv.pushpull_in_place(9, &vals).unwrap();
    let mut s9 = vec![0.0; 20];
    for rank in 0..n {
        add_into(&mut s9, &data(4, 9, rank, 0));
        add_into(&mut s9, &data(4, 9, rank, 1));
    }
    for v in &vals {
        assert_close(&get(v), &s9, DType::F32, "pushpull in place of key 9");
    }
    want.insert(9, s9);
    let x = array(5, 13, r, 0);
    let outs = [
        poisoned(&[300], DType::F64, 0),
        poisoned(&[300], DType::F32, 1),
    ];
    kv.pushpull(13, &x, &outs).unwrap();
    let mut s13 = vec![0.0; 300];
    for rank in 0..n {
        add_into(&mut s13, &data(5, 13, rank, 0));
    }
    for o in &outs {
        assert_close(
            &get(o),
            &s13,
            DType::F32,
            "pushpull of key 13 into f64 and f32 outs",
        );
    }
    want.insert(13, s13);

    // A list pushpull with one array as the value of two keys, in place: every push reads it
    // before any pull writes it.
    let shared = array(6, 2, r, 0);
    kv.pushpull_list_in_place(&[2, 11], &[&shared, &shared])
        .unwrap();
    let mut s = vec![0.0; 3];
    for rank in 0..n {
        add_into(&mut s, &data(6, 2, rank, 0));
    }
    assert_close(&get(&shared), &s, DType::F32, "shared in-place pushpull");
    want.insert(2, s.clone());
    want.insert(11, s);
    // ... and with outs, over several devices.
    let g2 = vec![array(7, 2, r, 0), array(7, 2, r, 1)];
    let g11 = vec![array(7, 11, r, 0)];
    let o2 = vec![poisoned(&[3], DType::F32, 0), poisoned(&[3], DType::F16, 1)];
    let o11 = vec![poisoned(&[3], DType::F64, 2)];
    kv.pushpull_list(&[11, 2], &[g11, g2], &[o11.clone(), o2.clone()])
        .unwrap();
    let (mut s2, mut s11) = (vec![0.0; 3], vec![0.0; 3]);
    for rank in 0..n {
        add_into(&mut s2, &data(7, 2, rank, 0));
        add_into(&mut s2, &data(7, 2, rank, 1));
        add_into(&mut s11, &data(7, 11, rank, 0));
    }
    assert_close(&get(&o2[0]), &s2, DType::F32, "pushpull_list key 2 out 0");
    assert_close(
        &get(&o2[1]),
        &rounded(DType::F16, &s2),
        DType::F16,
        "pushpull_list key 2 f16 out",
    );
    assert_close(
        &get(&o11[0]),
        &s11,
        DType::F32,
        "pushpull_list key 11 f64 out",
    );
    want.insert(2, s2);
    want.insert(11, s11);
    check(&kv, &want, "after the pushpulls");

    // Pulls convert to the out's dtype: f32 to f64 exactly, to f16 rounded once.
    let outs = [
        poisoned(&[2, 3], DType::F64, 0),
        poisoned(&[2, 3], DType::F16, 1),
        poisoned(&[2, 3], DType::F32, 3),
    ];
    kv.pull(5, &outs).unwrap();
    let held = get(&outs[0]);
    assert_close(&held, &want[&5], DType::F32, "pull of key 5 into f64");
    assert_eq!(held, rounded(DType::F32, &held), "an f32 value, exactly");
    assert_eq!(get(&outs[1]), rounded(DType::F16, &held), "f32 to f16");
    assert_eq!(get(&outs[2]), held, "pull of key 5 on cpu(3)");
    let o14 = poisoned(&[7], DType::F32, 0);
    kv.pull(14, &o14).unwrap();
    assert_eq!(get(&o14), rounded(DType::F32, &want[&14]), "f64 to f32");

    // broadcast: init from rank 0, then a pull into every out (of any dtype).
    let v20 = |rank: usize| rounded(DType::F32, &uniform(&[8, 20, rank as u64], 20));
    let outs = [
        poisoned(&[4, 5], DType::F32, 0),
        poisoned(&[4, 5], DType::F64, 1),
    ];
    kv.broadcast(20, &arr(&v20(r), &[4, 5], DType::F32, 0), &outs)
        .unwrap();
    for o in &outs {
        assert_eq!(get(o), v20(0), "broadcast of key 20");
    }
    let again = kv
        .broadcast(20, &arr(&v20(r), &[4, 5], DType::F32, 0), &outs)
        .unwrap_err();
    assert!(matches!(again, Error::DuplicateInit { .. }), "{again}");
    let v21 = arr(&uniform(&[9, 21, r as u64], 150), &[150], DType::F32, 0);
    let v22 = arr(&uniform(&[9, 22, r as u64], 4), &[4], DType::F32, 1);
    let o21 = vec![poisoned(&[150], DType::F32, 0)];
    let o22 = vec![poisoned(&[4], DType::F32, 0), poisoned(&[4], DType::F64, 1)];
    kv.broadcast_list(&[21, 22], &[v21, v22], &[o21.clone(), o22.clone()])
        .unwrap();
    assert_eq!(
        get(&o21[0]),
        rounded(DType::F32, &uniform(&[9, 21, 0], 150))
    );
    for o in &o22 {
        assert_eq!(get(o), rounded(DType::F32, &uniform(&[9, 22, 0], 4)));
    }
    check(&kv, &want, "after the broadcasts");

    // Priorities: the updater runs in descending priority (ties in key order), only where
    // each key lives; the push hook sees every key, in that order, on every rank.
    let updated = Arc::new(Mutex::new(Vec::new()));
    let log = updated.clone();
    kv.set_updater(Updater::custom(move |key, input, stored| {
        log.lock().unwrap().push(key.clone());
        *stored += input;
    }))
    .unwrap();
    let hooked = Arc::new(Mutex::new(Vec::new()));
    let hlog = hooked.clone();
    kv.set_push_hook(move |e| hlog.lock().unwrap().push(e.key.clone()));
    let pkeys: Vec<i32> = SEM_PRIO_KEYS.iter().map(|k| k.0).collect();
    let prios = [-1, 5, 0, 5, 3];
    let order = [5, 11, 13, 9, 2];
    let gs: Vec<NDArray> = pkeys.iter().map(|&k| array(10, k, r, 0)).collect();
    kv.push_list_with_priority(&pkeys, &gs, &prios).unwrap();
    kv.clear_push_hook();
    for &k in &pkeys {
        let w = want.get_mut(&k).unwrap();
        for rank in 0..n {
            add_into(w, &data(10, k, rank, 0));
        }
    }
    assert_eq!(
        ints(hooked.lock().unwrap().clone()),
        order,
        "the hook's order"
    );
    let mine = ints(updated.lock().unwrap().clone());
    let pos = |k: &i32| order.iter().position(|o| o == k).unwrap();
    assert!(
        mine.windows(2).all(|w| pos(&w[0]) < pos(&w[1])),
        "the updater ran out of priority order: {mine:?}"
    );
    let outs: Vec<NDArray> = pkeys
        .iter()
        .map(|&k| poisoned(shape_of(k), DType::F32, 1))
        .collect();
    kv.pull_list_with_priority(&pkeys, &outs, &[3, 0, -2, 7, 1])
        .unwrap();
    for (&k, o) in pkeys.iter().zip(&outs) {
        assert_close(
            &get(o),
            &want[&k],
            DType::F32,
            &format!("key {k} after the priority push"),
        );
    }
    check(&kv, &want, "at the end");
    kv.barrier().unwrap();
    kv.barrier().unwrap();
    let updated: Vec<String> = mine.iter().map(|k| k.to_string()).collect();
    ok(
        &kv,
        "semantics",
        &format!(
            "keys={listed:?} init_order={init_order:?} meta={} hook={order:?} updated={}",
            meta.join(","),
            updated.join(",")
        )
        .replace(", ", ","),
    );
}

// --- 4. bad input ----------------------------------------------------------------------------

/// One bad-input step: rank `i % n` makes the `bad` call, every other rank the `good` one.
struct Bad<'a> {
    what: &'static str,
    /// The good ranks' op, which their `RankRejected` names.
    op: &'static str,
    bad: Box<dyn Fn() -> kvstore::Result<()> + 'a>,
    good: Box<dyn Fn() -> kvstore::Result<()> + 'a>,
    /// The bad rank's own error.
    is_bad_error: fn(&Error) -> bool,
    /// A piece of the bad rank's message that the others must see.
    needle: &'static str,
}

fn bad<'a>(
    what: &'static str,
    op: &'static str,
    bad: impl Fn() -> kvstore::Result<()> + 'a,
    good: impl Fn() -> kvstore::Result<()> + 'a,
    is_bad_error: fn(&Error) -> bool,
    needle: &'static str,
) -> Bad<'a> {
    Bad {
        what,
        op,
        bad: Box::new(bad),
        good: Box::new(good),
        is_bad_error,
        needle,
    }
}

/// The keys of the bad-input case: (key, shape, dtype). Key 8 is sliced under a bound of 10.
const BAD_KEYS: [(i32, &[usize], DType); 3] = [
    (3, &[2, 3], DType::F32),
    (5, &[4], DType::F64),
    (8, &[30], DType::F32),
];

/// Every key's value, pulled.
fn snapshot(kv: &KvStore) -> Vec<Vec<f64>> {
    let keys: Vec<i32> = BAD_KEYS.iter().map(|k| k.0).collect();
    let outs: Vec<NDArray> = BAD_KEYS
        .iter()
        .map(|(_, shape, dtype)| poisoned(shape, *dtype, 0))
        .collect();
    kv.pull_list(&keys, &outs).unwrap();
    outs.iter().map(get).collect()
}

fn case_bad_input() {
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    let keys: Vec<i32> = BAD_KEYS.iter().map(|k| k.0).collect();
    let init: Vec<NDArray> = BAD_KEYS
        .iter()
        .map(|(k, shape, dtype)| {
            arr(
                &uniform(&[4, *k as u64, r as u64], size_of(shape)),
                shape,
                *dtype,
                0,
            )
        })
        .collect();
    kv.init_list(&keys, &init).unwrap();
    // Momentum: a bad call that touched the state would show in the next good push.
    let u = Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        wd: 1e-3,
        ..Sgd::default()
    });
    kv.set_updater(u.clone()).unwrap();
    let mut refs: Vec<RefKey> = BAD_KEYS
        .iter()
        .map(|(k, shape, dtype)| RefKey::new(*dtype, uniform(&[4, *k as u64, 0], size_of(shape))))
        .collect();
    let mut round = 0u64;
    // A good push of every key on every rank, checked against the reference.
    let mut good_round = |kv: &KvStore, refs: &mut [RefKey]| {
        round += 1;
        let grad = |j: usize, rank: usize| {
            let (_, shape, dtype) = BAD_KEYS[j];
            rounded(
                dtype,
                &uniform(&[5, round, j as u64, rank as u64], size_of(shape)),
            )
        };
        let values: Vec<NDArray> = BAD_KEYS
            .iter()
            .enumerate()
            .map(|(j, (_, shape, dtype))| arr(&grad(j, r), shape, *dtype, 0))
            .collect();
        kv.push_list(&keys, &values).unwrap();
        let got = snapshot(kv);
        for (j, rk) in refs.iter_mut().enumerate() {
            let mut g = vec![0.0; rk.w.len()];
            for rank in 0..n {
                add_into(&mut g, &grad(j, rank));
            }
            rk.step(&u, &g);
            assert_close(
                &got[j],
                &rk.w,
                rk.dtype,
                &format!("key {} after good round {round}", keys[j]),
            );
        }
    };
    good_round(&kv, &mut refs);

    let f32_of = |shape: &[usize], dev| full(shape, 0.25, DType::F32, dev);
    let f64_of = |shape: &[usize], dev| full(shape, 0.25, DType::F64, dev);
    // (what, the good ranks' op, the bad call, the good call, the bad rank's error, a word of
    // the bad rank's message the others must see).
    let kvr = &kv;
    let cases: Vec<Bad<'_>> = vec![
        bad(
            "unknown key",
            "push",
            move || kvr.push(42, &f32_of(&[2, 3], 0)),
            move || kvr.push(3, &f32_of(&[2, 3], 0)),
            |e| {
                matches!(
                    e,
                    Error::UnknownKey {
                        key: Key::Int(42),
                        ..
                    }
                )
            },
            "key 42 has not been initialized",
        ),
        bad(
            "shape mismatch",
            "push",
            move || kvr.push(3, &[f32_of(&[2, 3], 0), f32_of(&[3, 2], 1)]),
            move || kvr.push(3, &[f32_of(&[2, 3], 0), f32_of(&[2, 3], 1)]),
            |e| {
                matches!(
                    e,
                    Error::ShapeMismatch {
                        key: Key::Int(3),
                        ..
                    }
                )
            },
            "shape mismatch for key 3",
        ),
        bad(
            "dtype mismatch",
            "push",
            move || kvr.push_list(&[3, 5], &[f32_of(&[2, 3], 0), f32_of(&[4], 0)]),
            move || kvr.push_list(&[3, 5], &[f32_of(&[2, 3], 0), f64_of(&[4], 0)]),
            |e| {
                matches!(
                    e,
                    Error::DTypeMismatch {
                        key: Key::Int(5),
                        ..
                    }
                )
            },
            "dtype mismatch for key 5",
        ),
        bad(
            "list length mismatch",
            "push",
            move || kvr.push_list(&[3, 5], &[f32_of(&[2, 3], 0)]),
            move || kvr.push_list(&[3, 5], &[f32_of(&[2, 3], 0), f64_of(&[4], 0)]),
            |e| {
                matches!(
                    e,
                    Error::LengthMismatch {
                        keys: 2,
                        values: 1,
                        ..
                    }
                )
            },
            "2 keys but 1 values",
        ),
        bad(
            "key out of range",
            "push",
            move || kvr.push(i64::MAX, &f32_of(&[2, 3], 0)),
            move || kvr.push(3i64, &f32_of(&[2, 3], 0)),
            |e| matches!(e, Error::KeyOutOfRange { .. }),
            "9223372036854775807",
        ),
        bad(
            "no values",
            "push",
            move || kvr.push(8, &Vec::<NDArray>::new()),
            move || kvr.push(8, &f32_of(&[30], 0)),
            |e| {
                matches!(
                    e,
                    Error::Empty {
                        key: Key::Int(8),
                        ..
                    }
                )
            },
            "no values given for key 8",
        ),
        bad(
            "a sliced key's shape",
            "push",
            move || kvr.push(8, &f32_of(&[31], 0)),
            move || kvr.push(8, &f32_of(&[30], 0)),
            |e| {
                matches!(
                    e,
                    Error::ShapeMismatch {
                        key: Key::Int(8),
                        ..
                    }
                )
            },
            "shape mismatch for key 8",
        ),
        bad(
            "pull out shape",
            "pull",
            move || kvr.pull_list(&[3, 8], &[f32_of(&[2, 3], 0), f32_of(&[3, 10], 0)]),
            move || kvr.pull_list(&[3, 8], &[f32_of(&[2, 3], 0), f32_of(&[30], 0)]),
            |e| {
                matches!(
                    e,
                    Error::ShapeMismatch {
                        op: "pull",
                        key: Key::Int(8),
                        ..
                    }
                )
            },
            "shape mismatch for key 8",
        ),
        bad(
            "pushpull out shape",
            "pushpull",
            move || kvr.pushpull(3, &f32_of(&[2, 3], 0), &f32_of(&[6], 1)),
            move || kvr.pushpull(3, &f32_of(&[2, 3], 0), &f32_of(&[2, 3], 1)),
            |e| matches!(e, Error::ShapeMismatch { op: "pushpull", .. }),
            "shape mismatch for key 3",
        ),
        bad(
            "duplicate init",
            "init",
            move || kvr.init_list(&[77, 3], &[f32_of(&[2], 0), f32_of(&[2, 3], 0)]),
            move || kvr.init_list(&[77, 78], &[f32_of(&[2], 0), f32_of(&[2, 3], 0)]),
            |e| matches!(e, Error::DuplicateInit { key: Key::Int(3) }),
            "duplicate init of key 3",
        ),
        bad(
            "broadcast out shape",
            "init",
            move || kvr.broadcast(77, &f32_of(&[2], 0), &f32_of(&[3], 0)),
            move || kvr.broadcast(77, &f32_of(&[2], 0), &f32_of(&[2], 0)),
            |e| {
                matches!(
                    e,
                    Error::ShapeMismatch {
                        key: Key::Int(77),
                        ..
                    }
                )
            },
            "shape mismatch for key 77",
        ),
    ];
    let mut seen = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let (what, op, needle) = (c.what, c.op, c.needle);
        let b = i % n;
        let before = snapshot(&kv);
        let res = if r == b { (c.bad)() } else { (c.good)() };
        let e = res.expect_err(&format!("{what}: the call must fail on rank {r}"));
        if r == b {
            assert!(
                (c.is_bad_error)(&e),
                "{what}: rank {b}'s own error, got: {e}"
            );
        } else {
            let Error::RankRejected {
                op: got_op, detail, ..
            } = &e
            else {
                panic!("{what}: want RankRejected on rank {r}, got: {e}");
            };
            assert_eq!(*got_op, op, "{what}: {e}");
            assert!(
                detail.contains(&format!("rank {b} rejected its input")),
                "{what}: {e}"
            );
            assert!(detail.contains(needle), "{what}: '{needle}' not in: {e}");
        }
        // Nothing changed: the values (and the momentum, checked by the next round), and no
        // key was added.
        assert_eq!(
            snapshot(&kv),
            before,
            "{what}: the values changed on rank {r}"
        );
        assert_eq!(
            kv.keys(),
            keys.iter().map(|&k| Key::Int(k)).collect::<Vec<_>>(),
            "{what}"
        );
        good_round(&kv, &mut refs);
        seen.push(what.replace(' ', "_"));
    }
    // The keys a failed init named are still free.
    kv.init_list(&[77, 78], &[f32_of(&[2], 0), f32_of(&[2, 3], 0)])
        .unwrap();
    assert_eq!(kv.keys().len(), 5);
    good_round(&kv, &mut refs);
    kv.barrier().unwrap();
    ok(&kv, "bad_input", &format!("cases={}", seen.join(",")));
}

// --- 5. desync -------------------------------------------------------------------------------

fn case_desync() {
    let how = env_var("KVT_HOW");
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    kv.init_list(&[3, 5], &[NDArray::zeros([2, 3]), NDArray::zeros([2, 3])])
        .unwrap();
    let g = NDArray::ones([2, 3]);
    let t = Instant::now();
    let res = match how.as_str() {
        // Rank 1 pushes key 5, the others key 3: each call is valid on its own rank.
        "key" => kv.push(if r == 1 { 5 } else { 3 }, &g),
        // The last rank initializes key 9 with another shape.
        "shape" => {
            let shape: &[usize] = if r == n - 1 { &[3, 2] } else { &[2, 3] };
            kv.init(9, &full(shape, 1.0, DType::F32, 0))
        }
        // The last rank pulls while the others push.
        "op" => {
            if r == n - 1 {
                kv.pull(3, &NDArray::zeros([2, 3]))
            } else {
                kv.push(3, &g)
            }
        }
        other => panic!("unknown desync {other}"),
    };
    let took = t.elapsed();
    let e = res.expect_err("a desync");
    assert!(matches!(e, Error::Desync { .. }), "want Desync, got {e}");
    let later = kv.pull(3, &NDArray::zeros([2, 3])).unwrap_err();
    assert!(matches!(later, Error::DistFailed { .. }), "{later}");
    ok(
        &kv,
        "desync",
        &format!("after {took:?}: {e} || then: {later}"),
    );
}

// --- 6. faults -------------------------------------------------------------------------------

fn case_skip() {
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    let last = n - 1;
    kv.init_list(&[1, 2], &[NDArray::zeros([64]), NDArray::zeros([8])])
        .unwrap();
    let g = [NDArray::ones([64]), NDArray::ones([8])];
    let o = [NDArray::zeros([64]), NDArray::zeros([8])];
    kv.push_list(&[1, 2], &g).unwrap();
    kv.pull_list(&[1, 2], &o).unwrap();
    assert_eq!(get(&o[0]), vec![n as f64; 64]);
    if r == last {
        // Skip the next call, for far longer than the others' timeout and the harness's bound.
        std::thread::sleep(Duration::from_secs(60));
        println!("KVT rank={r} size={n} woke up");
        return;
    }
    let t = Instant::now();
    // Without the fingerprint check a rank may get through a call whose collectives do not
    // need the missing rank yet; it must fail at the latest within a few calls.
    let mut err = None;
    for _ in 0..3 {
        if let Err(e) = kv
            .push_list(&[1, 2], &g)
            .and_then(|()| kv.pull_list(&[1, 2], &o))
        {
            err = Some(e);
            break;
        }
    }
    let e = err.expect("a call without the last rank must fail");
    let took = t.elapsed();
    let Error::Timeout { missing, .. } = &e else {
        panic!("want Timeout, got {e}");
    };
    assert!(e.to_string().contains(&format!("rank {last}")), "{e}");
    let missing = format!("{missing:?}").replace(' ', "");
    let later = kv.pull(1, &o[0]).unwrap_err();
    assert!(matches!(later, Error::DistFailed { .. }), "{later}");
    ok(
        &kv,
        "skip",
        &format!("missing={missing} after {took:?}: {e} || then: {later}"),
    );
}

fn case_sigkill() {
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    let len = 1 << 16;
    kv.init_list(&[1, 2], &[NDArray::zeros([len]), NDArray::zeros([7])])
        .unwrap();
    let g = [NDArray::ones([len]), NDArray::ones([7])];
    let o = [NDArray::zeros([len]), NDArray::zeros([7])];
    for i in 0..40 {
        if i == 5 && r == 1 {
            // SAFETY: kill(2) on this very process.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        if let Err(e) = kv
            .push_list(&[1, 2], &g)
            .and_then(|()| kv.pull_list(&[1, 2], &o))
        {
            println!("KVT rank={r} size={n} ERR sigkill at round {i}: {e}");
            return;
        }
    }
    ok(&kv, "sigkill", "(must not happen: rank 1 died)");
}

// --- 7. training -----------------------------------------------------------------------------

/// The model: a two-layer perceptron, x (D) -> tanh(W1 x + b1) (H) -> W2 h + b2 (O), with the
/// squared error summed over the batch. W1 (288) and W2 (72) are sliced under a bound of 50.
const D: usize = 12;
const H: usize = 24;
const O: usize = 3;
const BATCH: usize = 48;
const STEPS: usize = 20;
const PARAM_SHAPES: [&[usize]; 4] = [&[H, D], &[H], &[O, H], &[O]];

/// Batch `step`: inputs and targets from a fixed random teacher, every rank alike.
fn batch(step: usize) -> Vec<(Vec<f64>, Vec<f64>)> {
    let teacher = uniform(&[7, 0], O * D);
    (0..BATCH)
        .map(|i| {
            let x = uniform(&[7, 1, step as u64, i as u64], D);
            let t = (0..O)
                .map(|o| (1.5 * (0..D).map(|d| teacher[o * D + d] * x[d]).sum::<f64>()).sin())
                .collect();
            (x, t)
        })
        .collect()
}

/// The gradients of the summed loss over `samples`, and the loss.
fn gradients(p: &[Vec<f64>], samples: &[(Vec<f64>, Vec<f64>)]) -> (Vec<Vec<f64>>, f64) {
    let (w1, b1, w2, b2) = (&p[0], &p[1], &p[2], &p[3]);
    let mut g: Vec<Vec<f64>> = PARAM_SHAPES.iter().map(|s| vec![0.0; size_of(s)]).collect();
    let mut loss = 0.0;
    for (x, t) in samples {
        let h: Vec<f64> = (0..H)
            .map(|j| (b1[j] + (0..D).map(|d| w1[j * D + d] * x[d]).sum::<f64>()).tanh())
            .collect();
        let e: Vec<f64> = (0..O)
            .map(|o| b2[o] + (0..H).map(|j| w2[o * H + j] * h[j]).sum::<f64>() - t[o])
            .collect();
        loss += 0.5 * e.iter().map(|v| v * v).sum::<f64>();
        for o in 0..O {
            g[3][o] += e[o];
            for j in 0..H {
                g[2][o * H + j] += e[o] * h[j];
            }
        }
        for j in 0..H {
            let dh: f64 = (0..O).map(|o| w2[o * H + j] * e[o]).sum();
            let da = dh * (1.0 - h[j] * h[j]);
            g[1][j] += da;
            for d in 0..D {
                g[0][j * D + d] += da * x[d];
            }
        }
    }
    (g, loss)
}

fn initial_params() -> Vec<Vec<f64>> {
    PARAM_SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let scale = if i % 2 == 0 { 0.5 } else { 0.1 };
            uniform(&[8, i as u64], size_of(s))
                .iter()
                .map(|v| v * scale)
                .collect()
        })
        .collect()
}

/// The largest `max|a - b| / max|b|` over the parameter tensors.
fn max_rel_err(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            diff / b.iter().map(|y| y.abs()).fold(1e-30, f64::max)
        })
        .fold(0.0, f64::max)
}

/// The loss of `p` on a held-out set (batches no step trains on).
fn held_out_loss(p: &[Vec<f64>]) -> f64 {
    (0..4).map(|b| gradients(p, &batch(1000 + b)).1).sum()
}

/// One process on the whole batch, in plain f64 with the reference updaters.
fn train_reference(u: &Updater) -> Vec<Vec<f64>> {
    let mut keys: Vec<RefKey> = initial_params()
        .into_iter()
        .map(|w| RefKey::new(DType::F32, w))
        .collect();
    for step in 0..STEPS {
        let params: Vec<Vec<f64>> = keys.iter().map(|k| k.w.clone()).collect();
        let (g, _) = gradients(&params, &batch(step));
        for (k, g) in keys.iter_mut().zip(&g) {
            k.step(u, g);
        }
    }
    keys.into_iter().map(|k| k.w).collect()
}

/// `n` ranks, each on its shard of every batch, split over two devices; the optimizer runs in
/// the store. Returns the final parameters every rank pulled.
fn train_dist(u: &Updater) -> Vec<Vec<f64>> {
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    let keys: Vec<i32> = (0..PARAM_SHAPES.len() as i32).collect();
    // Rank 0's parameters count; the others start from garbage that init must ignore.
    let init: Vec<NDArray> = initial_params()
        .iter()
        .zip(PARAM_SHAPES)
        .map(|(w, s)| {
            let w: Vec<f64> = match r {
                0 => w.clone(),
                _ => w.iter().map(|v| v * 3.0 + r as f64).collect(),
            };
            arr(&w, s, DType::F32, 0)
        })
        .collect();
    kv.init_list(&keys, &init).unwrap();
    kv.set_updater(u.clone()).unwrap();
    let params: Vec<NDArray> = PARAM_SHAPES
        .iter()
        .map(|s| poisoned(s, DType::F32, 0))
        .collect();
    kv.pull_list(&keys, &params).unwrap();
    let per_rank = BATCH / n;
    for step in 0..STEPS {
        let p: Vec<Vec<f64>> = params.iter().map(get).collect();
        let samples = batch(step);
        let shard = &samples[r * per_rank..(r + 1) * per_rank];
        let (lo, hi) = shard.split_at(per_rank / 2);
        let (g_lo, _) = gradients(&p, lo);
        let (g_hi, _) = gradients(&p, hi);
        let (g_lo, g_hi) = (quantized(g_lo), quantized(g_hi));
        let values: Vec<Vec<NDArray>> = PARAM_SHAPES
            .iter()
            .enumerate()
            .map(|(i, s)| {
                vec![
                    arr(&g_lo[i], s, DType::F32, 0),
                    arr(&g_hi[i], s, DType::F32, 1),
                ]
            })
            .collect();
        kv.push_list(&keys, &values).unwrap();
        kv.pull_list(&keys, &params).unwrap();
    }
    params.iter().map(get).collect()
}

/// Gradients on a grid of 2^-20, so that float32 adds any few of them exactly, in any order:
/// then N ranks and one process see the same totals, and any difference is the store's.
fn quantized(g: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
    const GRID: f64 = (1u64 << 20) as f64;
    g.into_iter()
        .map(|t| t.into_iter().map(|x| (x * GRID).round() / GRID).collect())
        .collect()
}

/// The same training in one process with a `local` store: the whole batch's gradient (the sum
/// of the shards' gradients that `n` ranks of two devices each compute), on one device, in one
/// push per step (the single-process run the issue compares with).
fn train_local(u: &Updater, n: usize) -> Vec<Vec<f64>> {
    let kv = KvStore::create("local").unwrap();
    let keys: Vec<i32> = (0..PARAM_SHAPES.len() as i32).collect();
    let init: Vec<NDArray> = initial_params()
        .iter()
        .zip(PARAM_SHAPES)
        .map(|(w, s)| arr(w, s, DType::F32, 0))
        .collect();
    kv.init_list(&keys, &init).unwrap();
    kv.set_updater(u.clone()).unwrap();
    let params: Vec<NDArray> = PARAM_SHAPES
        .iter()
        .map(|s| poisoned(s, DType::F32, 0))
        .collect();
    kv.pull_list(&keys, &params).unwrap();
    let half = BATCH / n / 2;
    for step in 0..STEPS {
        let p: Vec<Vec<f64>> = params.iter().map(get).collect();
        let samples = batch(step);
        let mut g: Vec<Vec<f64>> = PARAM_SHAPES
            .iter()
            .map(|s| vec![0.0; s.iter().product()])
            .collect();
        for shard in samples.chunks(half) {
            for (t, s) in g.iter_mut().zip(quantized(gradients(&p, shard).0)) {
                t.iter_mut().zip(s).for_each(|(a, b)| *a += b);
            }
        }
        let values: Vec<NDArray> = PARAM_SHAPES
            .iter()
            .enumerate()
            .map(|(i, s)| arr(&g[i], s, DType::F32, 0))
            .collect();
        kv.push_list(&keys, &values).unwrap();
        kv.pull_list(&keys, &params).unwrap();
    }
    params.iter().map(get).collect()
}

/// A hash of the parameters' f32 bits.
fn bits_hash(p: &[Vec<f64>]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in p.iter().flatten() {
        for b in (*v as f32).to_bits().to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn case_train() {
    let kv = store("dist_sync");
    let n = kv.num_workers();
    assert_eq!(
        BATCH % (2 * n),
        0,
        "the batch splits evenly over ranks and devices"
    );
    let rescale = 1.0 / BATCH as f64;
    let sgd = Updater::Sgd(Sgd {
        lr: 0.5,
        momentum: 0.9,
        wd: 1e-4,
        rescale_grad: rescale,
        ..Sgd::default()
    });
    let adam = Updater::Adam(Adam {
        lr: 0.02,
        rescale_grad: rescale,
        ..Adam::default()
    });
    let initial: Vec<Vec<f64>> = initial_params()
        .iter()
        .map(|w| rounded(DType::F32, w))
        .collect();
    let mut detail = String::new();
    for (name, u) in [("sgd", sgd), ("adam", adam)] {
        let want = train_reference(&u);
        let (first, last) = (held_out_loss(&initial), held_out_loss(&want));
        // The reference must learn (its held-out loss falls), so that the comparison below is
        // of a training that does something. How far it falls in 20 steps depends on the run's
        // random teacher: a fall of at least 10 % was asked before, and one run fell 6 %
        // (331 -> 310).
        assert!(
            last < first,
            "{name}: the reference did not learn: {first} -> {last}"
        );
        assert!(
            max_rel_err(&want, &initial) > 1e-2,
            "{name}: training did not move"
        );
        let got = train_dist(&u);
        // The check: N ranks equal one process on the whole batch (both in float32),
        // within 1e-5.
        let single = train_local(&u, n);
        let err = max_rel_err(&got, &single);
        assert!(
            err <= 1e-5,
            "{name}: {n} ranks vs one process: max relative error {err:e} (seed {})",
            seed()
        );
        // And it follows the float64 reference on unquantized gradients, up to float32's drift
        // and the quantization over the steps.
        let drift = max_rel_err(&got, &want);
        assert!(
            drift <= 1e-3,
            "{name}: {n} ranks vs the float64 reference: max relative error {drift:e} (seed {})",
            seed()
        );
        detail += &format!(
            "{name}_err={err:.1e} {name}_loss={first:.4}->{last:.4} {name}_hash={:016x} ",
            bits_hash(&got)
        );
    }
    kv.barrier().unwrap();
    ok(&kv, "train", detail.trim_end());
}

// --- 8. known bugs ---------------------------------------------------------------------------

/// The same pushes under an LR schedule on a `local` store (this process alone, pushing every
/// rank's values) and on the dist store.
fn case_schedule() {
    let dist = store("dist_sync");
    let local = KvStore::create("local").unwrap();
    let (r, n) = (dist.rank(), dist.num_workers());
    let keys = [1, 2, 3];
    for kv in [&local, &dist] {
        kv.init_list(
            &keys,
            &[
                NDArray::zeros([4]),
                NDArray::zeros([4]),
                NDArray::zeros([4]),
            ],
        )
        .unwrap();
        kv.set_updater(Updater::Sgd(Sgd {
            lr: 1.0,
            ..Sgd::default()
        }))
        .unwrap();
        kv.set_lr_scheduler(Some(kvstore::LrScheduler::factor(1, 0.5)))
            .unwrap();
    }
    let grad = |step: u64, k: i32, rank: usize| {
        arr(
            &uniform(&[11, step, k as u64, rank as u64], 4),
            &[4],
            DType::F32,
            0,
        )
    };
    // Key 1 three times, then keys 2 and 3 together, then key 2.
    let calls: [&[i32]; 5] = [&[1], &[1], &[1], &[2, 3], &[2]];
    for (step, ks) in calls.iter().enumerate() {
        let step = step as u64;
        let mine: Vec<NDArray> = ks.iter().map(|&k| grad(step, k, r)).collect();
        dist.push_list(ks, &mine).unwrap();
        let all: Vec<Vec<NDArray>> = ks
            .iter()
            .map(|&k| (0..n).map(|rank| grad(step, k, rank)).collect())
            .collect();
        local.push_list(ks, &all).unwrap();
    }
    for &k in &keys {
        let (a, b) = (NDArray::zeros([4]), NDArray::zeros([4]));
        dist.pull(k, &a).unwrap();
        local.pull(k, &b).unwrap();
        assert_close(
            &get(&a),
            &get(&b),
            DType::F32,
            &format!("key {k}: dist vs local"),
        );
    }
    assert_eq!(
        dist.num_update(),
        local.num_update(),
        "num_update on rank {r}"
    );
    assert_eq!(
        dist.learning_rate(),
        local.learning_rate(),
        "learning_rate on rank {r}"
    );
    dist.barrier().unwrap();
    ok(
        &dist,
        "schedule",
        &format!("num_update={}", dist.num_update()),
    );
}

fn case_compressed() {
    let t = [0.5f32, 0.3, 0.125][(seed() % 3) as usize];
    for compression in [
        kvstore::Compression::two_bit(t),
        kvstore::Compression::bf16(),
        kvstore::Compression::fp16(),
    ] {
        compressed_like_a_local_store(compression, t);
    }
    let kv = store("dist_sync");
    kv.barrier().unwrap();
    ok(
        &kv,
        "compressed",
        &format!("threshold={t} and the 16-bit wires"),
    );
}

fn compressed_like_a_local_store(compression: kvstore::Compression, t: f32) {
    let dist = store("dist_sync");
    let local = KvStore::create("device").unwrap();
    let (r, n) = (dist.rank(), dist.num_workers());
    let keys = [1, 2];
    let lens = [7usize, 2500];
    for kv in [&local, &dist] {
        kv.set_gradient_compression(compression).unwrap();
        let init: Vec<NDArray> = (keys.iter().zip(lens))
            .map(|(&k, len)| arr(&uniform(&[21, k as u64], len), &[len], DType::F32, 0))
            .collect();
        kv.init_list(&keys, &init).unwrap();
    }
    let grad = |step: u64, k: i32, len: usize, rank: usize| {
        let g: Vec<f64> = uniform(&[22, step, k as u64, rank as u64], len)
            .iter()
            .map(|x| x * 1.5 * f64::from(t))
            .collect();
        arr(&g, &[len], DType::F32, 0)
    };
    for step in 0..5u64 {
        let mine: Vec<NDArray> = (keys.iter().zip(lens))
            .map(|(&k, len)| grad(step, k, len, r))
            .collect();
        dist.push_list(&keys, &mine).unwrap();
        let all: Vec<Vec<NDArray>> = (keys.iter().zip(lens))
            .map(|(&k, len)| (0..n).map(|rank| grad(step, k, len, rank)).collect())
            .collect();
        local.push_list(&keys, &all).unwrap();
        for (&k, len) in keys.iter().zip(lens) {
            let (a, b) = (NDArray::zeros([len]), NDArray::zeros([len]));
            dist.pull(k, &a).unwrap();
            local.pull(k, &b).unwrap();
            let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert_eq!(
                    x.to_bits(),
                    y.to_bits(),
                    "rank {r}, step {step}, key {k}, element {i} ({compression:?}): {x} vs a \
                     local store's {y}"
                );
            }
        }
    }
    dist.barrier().unwrap();
}

fn case_row_sparse() {
    use kvstore::RowSparse;
    // 3005 elements: sliced, rows straddle the slices at 3 and 4 ranks.
    let (rows, width) = (601usize, 5usize);
    let dist = store("dist_sync");
    let local = KvStore::create("local").unwrap();
    let (r, n) = (dist.rank(), dist.num_workers());
    let momentum = Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        wd: 0.01,
        ..Sgd::default()
    });
    let plain = Updater::Sgd(Sgd {
        lr: 0.1,
        ..Sgd::default()
    });
    let init = arr(&uniform(&[31], rows * width), &[rows, width], DType::F32, 0);
    // Keys: 1 (lazy SGD with momentum, row-sparse), 2 (plain SGD, row-sparse), 3 (plain SGD,
    // dense). The dense key lives in its own store (an updater is per store).
    let dense = store("dist_sync");
    for kv in [&dist, &local] {
        kv.init_row_sparse_list(&[1, 2], &[init.clone(), init.clone()])
            .unwrap();
    }
    dense.init(3, &init).unwrap();
    dense.set_updater(plain.clone()).unwrap();
    // A rank's rows at a step: ids repeat, and each rank touches its own part of the table
    // more often (as a data-parallel batch of an embedding does).
    let grad = |step: u64, rank: usize| -> (Vec<u64>, Vec<f64>) {
        let u = uniform(&[32, step, rank as u64], 40);
        let ids: Vec<u64> = u
            .iter()
            .map(|x| ((x + 1.0) * 0.5 * rows as f64) as u64 % rows as u64)
            .collect();
        (ids, uniform(&[33, step, rank as u64], 40 * width))
    };
    let sparse = |(ids, data): (Vec<u64>, Vec<f64>)| {
        let k = ids.len();
        RowSparse::new(ids, arr(&data, &[k, width], DType::F32, 0)).unwrap()
    };
    let pulled = |kv: &KvStore, key: i32| {
        let out = NDArray::zeros([rows, width]);
        kv.pull(key, &out).unwrap();
        out.to_vec::<f32>().unwrap()
    };
    for (kv, u) in [(&dist, &momentum), (&local, &momentum)] {
        kv.set_updater(u.clone()).unwrap();
    }
    for step in 0..6u64 {
        let mine = sparse(grad(step, r));
        dist.push_row_sparse(1, std::slice::from_ref(&mine))
            .unwrap();
        // Each rank sums its own repeated rows first, then the ranks are summed in rank order
        // (as dense pushes sum a rank's devices first): the local store gets each rank's rows
        // summed the same way, in float32, in the order they come.
        let summed = |(ids, data): (Vec<u64>, Vec<f64>)| {
            let mut rows: BTreeMap<u64, Vec<f32>> = BTreeMap::new();
            for (j, &id) in ids.iter().enumerate() {
                let row = data[j * width..(j + 1) * width].iter().map(|&x| x as f32);
                match rows.get_mut(&id) {
                    Some(acc) => acc.iter_mut().zip(row).for_each(|(a, x)| *a += x),
                    None => {
                        rows.insert(id, row.collect());
                    }
                }
            }
            let data: Vec<f64> = rows.values().flatten().map(|&x| f64::from(x)).collect();
            (rows.keys().copied().collect::<Vec<u64>>(), data)
        };
        let all: Vec<RowSparse> = (0..n)
            .map(|rank| sparse(summed(grad(step, rank))))
            .collect();
        local.push_row_sparse(1, &all).unwrap();
        let (a, b) = (pulled(&dist, 1), pulled(&local, 1));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(
                x.to_bits(),
                y.to_bits(),
                "rank {r}, step {step}, element {i}: {x} vs a local store's {y}"
            );
        }
        let ids: Vec<u64> = uniform(&[34, step, r as u64], 7)
            .iter()
            .map(|x| ((x + 1.0) * 0.5 * rows as f64) as u64 % rows as u64)
            .collect();
        let got = dist.row_sparse_pull(1, &ids).unwrap();
        let want = local.row_sparse_pull(1, &ids).unwrap();
        assert_eq!(got.ids(), want.ids());
        assert_eq!(
            got.rows().to_vec::<f32>().unwrap(),
            want.rows().to_vec::<f32>().unwrap(),
            "rank {r}, step {step}: row_sparse_pull of {ids:?}"
        );
    }
    // Plain SGD on rows against dense training with the same gradients.
    dist.set_updater(plain).unwrap();
    let mut touched = vec![false; rows];
    for step in 10..14u64 {
        let (ids, data) = grad(step, r);
        let mut full = vec![0.0f64; rows * width];
        for (j, &id) in ids.iter().enumerate() {
            for c in 0..width {
                full[id as usize * width + c] += data[j * width + c];
            }
        }
        dist.push_row_sparse(2, &[sparse((ids, data))]).unwrap();
        dense
            .push(3, &arr(&full, &[rows, width], DType::F32, 0))
            .unwrap();
        for rank in 0..n {
            grad(step, rank)
                .0
                .iter()
                .for_each(|&id| touched[id as usize] = true);
        }
        let (a, b) = (pulled(&dist, 2), pulled(&dense, 3));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                "rank {r}, step {step}, element {i} (row {} touched: {}): {x} vs dense {y}",
                i / width,
                touched[i / width]
            );
        }
    }
    dist.barrier().unwrap();
    let count = touched.iter().filter(|&&t| t).count();
    ok(&dist, "row_sparse", &format!("rows_touched={count}/{rows}"));
}

fn case_hook_steps() {
    let kv = store("dist_sync");
    kv.init_list(
        &[1, 2, 3],
        &[
            NDArray::zeros([3]),
            NDArray::zeros([3]),
            NDArray::zeros([3]),
        ],
    )
    .unwrap();
    kv.set_updater(Updater::Adam(Adam::default())).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    kv.set_push_hook(move |e| log.lock().unwrap().push((e.key.clone(), e.step)));
    let g = NDArray::ones([3]);
    kv.push(1, &g).unwrap();
    kv.push_list(&[1, 2, 3], &[&g, &g, &g]).unwrap();
    kv.push(3, &g).unwrap();
    let want: Vec<(Key, Option<u64>)> = [(1, 1), (1, 2), (2, 1), (3, 1), (3, 2)]
        .iter()
        .map(|&(k, t)| (Key::Int(k), Some(t)))
        .collect();
    assert_eq!(
        *seen.lock().unwrap(),
        want,
        "the hook's keys and steps on rank {}",
        kv.rank()
    );
    kv.barrier().unwrap();
    ok(&kv, "hook_steps", "");
}

/// A pushed value's storage is lent to the transfer when the key travels alone: it must come
/// back unchanged, and a pull's out must hold the value, whether the key is sliced (key 0) or
/// whole and big (key 1, 2^17 elements, at a bound above it on 2 ranks) or small (key 2).
#[test]
fn pushed_values_come_back_unchanged_on_2_ranks() {
    healthy(2, "values_kept", &[("KVSTORE_BIGARRAY_BOUND", "200000")]);
}

fn case_values_kept() {
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    let lens = [400_000usize, 1 << 17, 10];
    let keys = [0, 1, 2];
    let init: Vec<NDArray> = lens.iter().map(|&l| NDArray::zeros([l])).collect();
    kv.init_list(&keys, &init).unwrap();
    let grads: Vec<Vec<f64>> = lens
        .iter()
        .map(|&l| {
            (0..l)
                .map(|i| ((i * 7 + r * 3) % 11) as f64 - 5.0)
                .collect()
        })
        .collect();
    let values: Vec<NDArray> = grads
        .iter()
        .map(|g| arr(g, &[g.len()], DType::F32, 0))
        .collect();
    for round in 1..=2 {
        kv.push_list(&keys, &values).unwrap();
        for (v, g) in values.iter().zip(&grads) {
            assert_eq!(
                get(v),
                *g,
                "rank {r}: a pushed value changed (round {round})"
            );
        }
        let outs: Vec<NDArray> = lens.iter().map(|&l| NDArray::zeros([l])).collect();
        kv.pull_list(&keys, &outs).unwrap();
        for (k, (o, &l)) in outs.iter().zip(&lens).enumerate() {
            let want: Vec<f64> = (0..l)
                .map(|i| (0..n).map(|q| ((i * 7 + q * 3) % 11) as f64 - 5.0).sum())
                .collect();
            assert_eq!(get(o), want, "rank {r}: key {k} pulled (round {round})");
        }
    }
    kv.barrier().unwrap();
    ok(&kv, "values_kept", "");
}

/// An updater that fails for key 1 (on its home rank, where it runs). The store must stay
/// usable on every rank, with key 1 unchanged.
fn case_updater_failure() {
    let kv = store("dist_sync");
    let n = kv.num_workers();
    kv.init_list(&[1, 2], &[NDArray::zeros([3]), NDArray::zeros([3])])
        .unwrap();
    kv.set_updater(Updater::try_custom(|key, input, stored| {
        if *key == Key::Int(1) {
            return Err("key 1 is refused".into());
        }
        *stored += input;
        Ok(())
    }))
    .unwrap();
    let g = NDArray::ones([3]);
    let o = NDArray::zeros([3]);
    // Every rank fails the call: the home rank with its updater's error, the others with
    // RankFailed; the ranks stay in step.
    let failed = |e: Result<(), Error>| match e {
        Err(Error::UpdaterFailed { .. }) | Err(Error::RankFailed { .. }) => {}
        other => panic!("rank {}: {other:?}", kv.rank()),
    };
    failed(kv.push(1, &g));
    kv.pull(1, &o).unwrap();
    assert_eq!(get(&o), vec![0.0; 3], "key 1 unchanged after a failed push");
    failed(kv.pushpull(1, &g, &o));
    kv.pull(1, &o).unwrap();
    assert_eq!(
        get(&o),
        vec![0.0; 3],
        "key 1 unchanged after a failed pushpull"
    );
    kv.pushpull(2, &g, &o).unwrap();
    assert_eq!(get(&o), vec![n as f64; 3]);
    kv.barrier().unwrap();
    ok(&kv, "updater_failure", "");
}

/// See `queued_calls_equal_the_sums_and_fail_together_on_2_ranks`.
fn case_async() {
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    let lens = [400_000usize, 1 << 12, 10];
    let keys = [0, 1, 2];
    let init: Vec<NDArray> = lens.iter().map(|&l| NDArray::zeros([l])).collect();
    kv.init_list(&keys, &init).unwrap();
    let kv = kvstore::AsyncKvStore::new(kv);
    // Rank q's value of key k in round t: quarters, so float32 sums are exact in any order.
    let value = |t: u64, k: usize, q: usize| -> Vec<f64> {
        (uniform(&[40, t, k as u64, q as u64], lens[k]).iter())
            .map(|x| (x * 32.0).round() / 4.0)
            .collect()
    };
    let mut rng = StdRng::seed_from_u64(seed() ^ r as u64);
    let rounds = 3u64;
    let mut pulled = Vec::new();
    for t in 1..=rounds {
        let values: Vec<NDArray> = (0..3)
            .map(|k| arr(&value(t, k, r), &[lens[k]], DType::F32, 0))
            .collect();
        // Priorities of this rank's own: a dist store runs its calls in issue order anyway.
        kv.push_list(&keys, &values, rng.gen_range(-5..5));
        let outs: Vec<NDArray> = lens.iter().map(|&l| NDArray::zeros([l])).collect();
        kv.pull_list(&keys, &outs, rng.gen_range(-5..5));
        pulled.push(outs);
        if r != 0 {
            kv.wait_all().unwrap();
        }
    }
    kv.wait_all().unwrap();
    for (t, outs) in (1..=rounds).zip(&pulled) {
        for (k, o) in outs.iter().enumerate() {
            let mut want = vec![0.0; lens[k]];
            for q in 0..n {
                add_into(&mut want, &value(t, k, q));
            }
            assert_eq!(get(o), want, "rank {r}: key {k}, round {t}");
        }
    }
    // One rank's bad push: every rank's wait fails; the push queued after it is not run.
    let before: Vec<Vec<f64>> = pulled.last().unwrap().iter().map(get).collect();
    let bad = if r == n - 1 { 11 } else { 10 };
    kv.push(2, &NDArray::ones([bad]), 0);
    kv.push(1, &NDArray::ones([lens[1]]), 0);
    let e = kv.wait_all().unwrap_err();
    match e.root() {
        Error::ShapeMismatch { .. } if r == n - 1 => {}
        Error::RankRejected { .. } if r != n - 1 => {}
        other => panic!("rank {r}: expected this rank's own error or RankRejected, got {other}"),
    }
    assert!(
        matches!(e, Error::Async { skipped: 1, .. }),
        "rank {r}: {e}"
    );
    let outs: Vec<NDArray> = lens.iter().map(|&l| NDArray::zeros([l])).collect();
    kv.pull_list(&keys, &outs, 0);
    kv.wait_all().unwrap();
    for (k, o) in outs.iter().enumerate() {
        assert_eq!(
            get(o),
            before[k],
            "rank {r}: key {k} changed by a failed call"
        );
    }
    kv.store().barrier().unwrap();
    ok(kv.store(), "async", "");
}

/// The ranks of each machine, machines in order, where the ranks run on several machines of
/// several ranks each (else `None`): every rank's local rank, gathered through the store, and
/// a rank's machine the number of ranks before it with its local rank (as the store numbers
/// them). That numbering names the real machines where ranks are placed by machine or round
/// robin (the layouts these tests run), not under every rankfile.
fn machines_of(kv: &KvStore) -> Option<Vec<Vec<usize>>> {
    let (r, n) = (kv.rank(), kv.num_workers());
    kv.init(9_999, &full(&[n], 0.0, DType::F64, 0)).unwrap();
    let mut mine = vec![0.0; n];
    mine[r] = (kv.local_rank() + 1) as f64;
    kv.push(9_999, &arr(&mine, &[n], DType::F64, 0)).unwrap();
    let out = full(&[n], 0.0, DType::F64, 0);
    kv.pull(9_999, &out).unwrap();
    let local: Vec<usize> = out
        .to_vec::<f64>()
        .unwrap()
        .iter()
        .map(|&v| v as usize - 1)
        .collect();
    let per = local.iter().max().unwrap() + 1;
    if per < 2
        || n % per != 0
        || n / per < 2
        || (0..per).any(|l| local.iter().filter(|&&x| x == l).count() != n / per)
    {
        return None;
    }
    let mut on = vec![vec![0; per]; n / per];
    let mut seen = vec![0; per];
    for (rank, &l) in local.iter().enumerate() {
        on[seen[l]][l] = rank;
        seen[l] += 1;
    }
    Some(on)
}

/// See [`in_rank_order`]: keys packed (small), alone (over 256 KiB, sent from the caller's
/// array) and of bfloat16 (summed in float32, rounded once), with values of magnitudes from
/// 1e-3 to 1e3 so that another order of additions gives other bits. Across machines the keys
/// over 65 536 elements are sliced, and summed in two stages.
fn case_in_order() {
    let kv = store("dist_sync");
    let (r, n) = (kv.rank(), kv.num_workers());
    let keys: [(i32, usize, DType); 5] = [
        (0, 7, DType::F32),
        (1, 5000, DType::F32),
        (2, 70_000, DType::F32),
        (3, 3000, DType::BF16),
        (4, 90_000, DType::BF16),
    ];
    let value = |round: u64, k: i32, len: usize, rank: usize| -> Vec<f64> {
        let scale = uniform(&[41, round, k as u64, rank as u64], len);
        uniform(&[40, round, k as u64, rank as u64], len)
            .iter()
            .zip(scale)
            .map(|(u, s)| u * 10f64.powi((3.0 * s).round() as i32))
            .collect()
    };
    let machines = machines_of(&kv);
    // A key is sliced from 65 536 elements across machines, from 1 000 000 on one.
    let sliced = |len: usize| machines.is_some() && len > 65_536;
    // Rank 0's value plus rank 1's and so on, in float32, rounded once to the key's dtype. A
    // sliced key across machines of equal ranks: each machine's ranks in local rank order, then
    // the machines in order, rounded after each stage (docs/dist.md).
    let want = |round: u64, k: i32, len: usize, dtype: DType| -> Vec<f64> {
        let as_dtype = |v: &[f64]| arr(v, &[v.len()], dtype, 0).to_vec::<f32>().unwrap();
        let round_to = |acc: Vec<f32>| -> Vec<f32> {
            match dtype {
                DType::BF16 => acc
                    .into_iter()
                    .map(|a| bf16::from_f32(a).to_f32())
                    .collect(),
                _ => acc,
            }
        };
        let sum_of = |ranks: &[usize]| -> Vec<f32> {
            let mut acc = as_dtype(&value(round, k, len, ranks[0]));
            for &rank in &ranks[1..] {
                for (a, x) in acc.iter_mut().zip(as_dtype(&value(round, k, len, rank))) {
                    *a += x;
                }
            }
            acc
        };
        let acc = match (&machines, sliced(len)) {
            (Some(on), true) => {
                let partials: Vec<Vec<f32>> = on.iter().map(|m| round_to(sum_of(m))).collect();
                let mut acc = partials[0].clone();
                for p in &partials[1..] {
                    for (a, x) in acc.iter_mut().zip(p) {
                        *a += x;
                    }
                }
                round_to(acc)
            }
            _ => round_to(sum_of(&(0..n).collect::<Vec<_>>())),
        };
        acc.into_iter().map(f64::from).collect()
    };
    let zeros: Vec<NDArray> = keys
        .iter()
        .map(|&(_, len, d)| full(&[len], 0.0, d, 0))
        .collect();
    let ids: Vec<i32> = keys.iter().map(|k| k.0).collect();
    kv.init_list(&ids, &zeros).unwrap();
    let mine = |round: u64| -> Vec<NDArray> {
        keys.iter()
            .map(|&(k, len, d)| arr(&value(round, k, len, r), &[len], d, 0))
            .collect()
    };
    let check = |round: u64, how: &str| {
        for &(k, len, d) in &keys {
            let out = poisoned(&[len], d, 0);
            kv.pull(k, &out).unwrap();
            let got = out.to_vec::<f64>().unwrap();
            let want = want(round, k, len, d);
            let differ = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.to_bits() != w.to_bits());
            assert_eq!(
                differ.count(),
                0,
                "round {round} ({how}), key {k}: elements not the rank-order sum"
            );
        }
    };
    // Each key in a call of its own.
    for (&(k, _, _), v) in keys.iter().zip(mine(0)) {
        kv.push(k, &v).unwrap();
    }
    check(0, "one call per key");
    // Every key in one list.
    kv.push_list(&ids, &mine(1)).unwrap();
    check(1, "one list");
    // In another order, the small keys in a call of their own.
    let values = mine(2);
    kv.push_list(&[4, 2], &[values[4].clone(), values[2].clone()])
        .unwrap();
    kv.push_list(
        &[3, 1, 0],
        &[values[3].clone(), values[1].clone(), values[0].clone()],
    )
    .unwrap();
    check(2, "two lists");
    ok(&kv, "in_order", "");
}

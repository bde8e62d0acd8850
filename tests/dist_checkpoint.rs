//! Checkpoints of `dist_sync` stores move between world sizes, under `mpirun` (cargo feature
//! `mpi`): a sharded save at 4 ranks loads at 2, at 3 and into a single-process `local` store,
//! and a `local` store's save (one shard), a single file of earlier versions and a 3-rank save
//! load at 4; a save that fails part way leaves the previous checkpoint the one a load finds.
//!
//! Every job trains the same model the same way, so every job can check itself against one
//! fact: after a load, one more push of a known gradient gives bit for bit the values that the
//! saving job got from the same push. Adam's moments and step counts must come back for that
//! (the continuation uses Adam), and keys are sliced differently at each world size
//! (`KVSTORE_BIGARRAY_BOUND`), so the shards are put back together by element range.
#![cfg(feature = "mpi")]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvstore::{Adam, DType, Error, KvStore, NDArray, Updater};

mod common;
use common::mpi_job::{launch, ok_line, Job, CASE_VAR};

/// The keys and their lengths: two small ones, and two that a bound of 100 slices.
const KEYS: [(i32, usize); 4] = [(0, 7), (1, 130), (2, 40), (3, 257)];

/// A fresh folder for one test's checkpoints.
fn folder(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvstore-dist-ckpt-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    dir
}

/// Runs `case` on `np` ranks (`None`: one process, no mpirun) with `env`, and returns each
/// rank's `digest=` value, which must all agree.
fn run(np: Option<usize>, case: &str, env: &[(&str, &str)]) -> Option<String> {
    let job = launch(np, case, env, Duration::from_secs(180))?;
    let n = np.unwrap_or(1);
    assert!(!job.killed, "the bound ended the job: a hang\n{job}");
    assert_eq!(job.code, Some(0), "{job}");
    let digests: BTreeSet<String> = (0..n).map(|r| digest_of(&job, r, n, case)).collect();
    assert_eq!(digests.len(), 1, "the ranks disagree on the values\n{job}");
    digests.into_iter().next()
}

fn digest_of(job: &Job, rank: usize, n: usize, case: &str) -> String {
    let line = job
        .ok_line(rank, n, case)
        .unwrap_or_else(|| panic!("rank {rank} did not finish {case}\n{job}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("digest="))
        .unwrap_or_else(|| panic!("no digest in: {line}"))
        .to_owned()
}

#[test]
fn a_save_at_4_ranks_loads_at_2_at_3_and_into_a_local_store() {
    let dir = folder("4to");
    let d = dir.join("ckpt");
    let d = d.to_str().expect("a UTF-8 path");
    let Some(saved) = run(
        Some(4),
        "train_save",
        &[("KVT_DIR", d), ("KVSTORE_BIGARRAY_BOUND", "100")],
    ) else {
        return;
    };
    for (np, bound) in [(Some(2), "1000000"), (Some(3), "100"), (None, "100")] {
        let got = run(
            np,
            "load_continue",
            &[("KVT_DIR", d), ("KVSTORE_BIGARRAY_BOUND", bound)],
        );
        assert_eq!(
            got.as_deref(),
            Some(saved.as_str()),
            "loaded at {np:?} ranks"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_local_file_and_a_3_rank_save_load_at_4_ranks() {
    let dir = folder("to4");
    let local = dir.join("local");
    let local = local.to_str().expect("a UTF-8 path");
    // A single process with a local store saves (one shard)...
    let Some(saved) = run(None, "train_save", &[("KVT_DIR", local)]) else {
        return;
    };
    let got = run(
        Some(4),
        "load_continue",
        &[("KVT_DIR", local), ("KVSTORE_BIGARRAY_BOUND", "100")],
    );
    assert_eq!(
        got.as_deref(),
        Some(saved.as_str()),
        "a local store's save at 4 ranks"
    );
    // ...and the single file of earlier versions loads at 4 ranks too.
    let file = dir.join("local.safetensors");
    let file = file.to_str().expect("a UTF-8 path");
    let single = run(
        None,
        "train_save",
        &[("KVT_DIR", file), ("KVT_SINGLE_FILE", "1")],
    );
    assert_eq!(
        single.as_deref(),
        Some(saved.as_str()),
        "one process trains alike"
    );
    let got = run(
        Some(4),
        "load_continue",
        &[("KVT_DIR", file), ("KVSTORE_BIGARRAY_BOUND", "100")],
    );
    assert_eq!(
        got.as_deref(),
        Some(saved.as_str()),
        "a single file at 4 ranks"
    );
    // ...and 3 ranks save a sharded folder that 4 ranks load.
    let sharded = dir.join("ckpt3");
    let sharded = sharded.to_str().expect("a UTF-8 path");
    let saved3 = run(
        Some(3),
        "train_save",
        &[("KVT_DIR", sharded), ("KVSTORE_BIGARRAY_BOUND", "100")],
    );
    assert_eq!(
        saved3.as_deref(),
        Some(saved.as_str()),
        "3 ranks train alike"
    );
    let got = run(
        Some(4),
        "load_continue",
        &[("KVT_DIR", sharded), ("KVSTORE_BIGARRAY_BOUND", "50")],
    );
    assert_eq!(
        got.as_deref(),
        Some(saved.as_str()),
        "3-rank save at 4 ranks"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_save_that_fails_part_way_leaves_the_previous_checkpoint() {
    let dir = folder("killed");
    let d = dir.join("ckpt");
    let d = d.to_str().expect("a UTF-8 path");
    // The job saves, trains one more step, then saves again with rank 1's writes failing part
    // way: every rank gets an error, and the folder still holds the first save.
    let Some(first) = run(
        Some(3),
        "save_twice_failing",
        &[("KVT_DIR", d), ("KVSTORE_BIGARRAY_BOUND", "100")],
    ) else {
        return;
    };
    let got = run(
        Some(2),
        "load_continue",
        &[("KVT_DIR", d), ("KVSTORE_BIGARRAY_BOUND", "100")],
    );
    assert_eq!(got.as_deref(), Some(first.as_str()), "the first save loads");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// The ranks' side.
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "run on every rank under mpirun by the other tests"]
fn inner() {
    let case = std::env::var(CASE_VAR).expect("KVT_CASE names the case");
    let dir = PathBuf::from(std::env::var("KVT_DIR").expect("KVT_DIR names the checkpoint"));
    match case.as_str() {
        "train_save" => case_train_save(&dir),
        "load_continue" => case_load_continue(&dir),
        "save_twice_failing" => case_save_twice_failing(&dir),
        other => panic!("unknown case {other}"),
    }
}

/// A store for the case: `local` when started without mpirun, else `dist_sync`.
fn store() -> KvStore {
    let launched = std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some();
    KvStore::create(if launched { "dist_sync" } else { "local" }).expect("a store")
}

fn adam() -> Updater {
    Updater::Adam(Adam {
        lr: 0.05,
        wd: 1e-3,
        ..Adam::default()
    })
}

/// Deterministic values in [-1, 1) for key `k`, step `t`, salt `s`.
fn values(k: i32, len: usize, t: u64, s: u64) -> Vec<f64> {
    (0..len as u64)
        .map(|i| {
            let mut x = (k as u64 + 1) * 0x9e37_79b9 + i * 0x85eb_ca6b + t * 0xc2b2_ae35 + s;
            x ^= x >> 13;
            x = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
            ((x >> 40) % 2000) as f64 / 1000.0 - 1.0
        })
        .collect()
}

fn array(v: &[f64]) -> NDArray {
    NDArray::from_f64(v, [v.len()], DType::F32, kvstore::cpu(0)).expect("an array")
}

/// One training step: the whole gradient of step `t` comes from rank 0, zeros from the others
/// (so the sum is the same, bit for bit, at every world size).
fn step(kv: &KvStore, t: u64) {
    let keys: Vec<i32> = KEYS.iter().map(|&(k, _)| k).collect();
    let grads: Vec<NDArray> = KEYS
        .iter()
        .map(|&(k, len)| match kv.rank() {
            0 => array(&values(k, len, t, 1)),
            _ => array(&vec![0.0; len]),
        })
        .collect();
    kv.push_list(&keys, &grads).expect("a push");
}

/// A digest of every key's value as pulled: the bits of every element.
fn digest(kv: &KvStore) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &(k, len) in &KEYS {
        let out = NDArray::zeros([len]);
        kv.pull(k, &out).expect("a pull");
        for x in out.to_vec::<f32>().expect("f32") {
            for b in x.to_bits().to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    format!("{h:016x}")
}

/// Trains three steps with Adam, saves to `dir`, then one more step; the digest after it.
fn case_train_save(dir: &Path) {
    let kv = store();
    let keys: Vec<i32> = KEYS.iter().map(|&(k, _)| k).collect();
    let init: Vec<NDArray> = KEYS
        .iter()
        .map(|&(k, len)| array(&values(k, len, 0, kv.rank() as u64 * 77)))
        .collect();
    kv.init_list(&keys, &init).expect("init");
    kv.set_updater(adam()).expect("adam");
    for t in 1..=3 {
        step(&kv, t);
    }
    // KVT_SINGLE_FILE: the single file of earlier versions, which still loads.
    match std::env::var_os("KVT_SINGLE_FILE") {
        Some(_) => kv.save_single_file(dir).expect("a single file"),
        None => kv.save(dir).expect("a save"),
    }
    step(&kv, 4);
    ok_line(
        kv.rank(),
        kv.num_workers(),
        "train_save",
        &format!("digest={}", digest(&kv)),
    );
}

/// Loads `dir` under Adam (so its state comes back) and takes the fourth step.
fn case_load_continue(dir: &Path) {
    let kv = store();
    kv.set_updater(adam()).expect("adam");
    kv.load(dir).expect("a load");
    step(&kv, 4);
    ok_line(
        kv.rank(),
        kv.num_workers(),
        "load_continue",
        &format!("digest={}", digest(&kv)),
    );
}

/// Trains and saves as [`case_train_save`] does (the digest is of that save's continuation),
/// then trains once more and saves again with rank 1's writes failing part way.
fn case_save_twice_failing(dir: &Path) {
    let kv = store();
    let keys: Vec<i32> = KEYS.iter().map(|&(k, _)| k).collect();
    let init: Vec<NDArray> = KEYS
        .iter()
        .map(|&(k, len)| array(&values(k, len, 0, 0)))
        .collect();
    kv.init_list(&keys, &init).expect("init");
    kv.set_updater(adam()).expect("adam");
    for t in 1..=3 {
        step(&kv, t);
    }
    kv.save(dir).expect("the first save");
    // What a load of the first save must reproduce: its continuation by step 4.
    let check = KvStore::create("local").expect("a local store");
    check.set_updater(adam()).expect("adam");
    check.load(dir).expect("the first save loads");
    step(&check, 4);
    let first = digest(&check);
    step(&kv, 5);
    if kv.rank() == 1 {
        kvstore::checkpoint::fail_writes_after(Some(64));
    }
    let err = kv.save(dir).expect_err("the second save fails");
    kvstore::checkpoint::fail_writes_after(None);
    match (&err, kv.rank()) {
        (Error::Checkpoint { .. }, 1) | (Error::RankFailed { .. }, _) => {}
        _ => panic!("rank {}: {err:?}", kv.rank()),
    }
    ok_line(
        kv.rank(),
        kv.num_workers(),
        "save_twice_failing",
        &format!("digest={first}"),
    );
}

//! The MPI transport of `dist_*` stores, run for real under `mpirun`.
//!
//! Each `#[test]` here launches `mpirun -np N` on this same test binary, which re-enters through
//! the ignored test [`inner`] with `KVT_CASE` naming the case to run on every rank. Every rank
//! prints `KVT rank=R size=N OK <case> ...` when its part passed; the outer test checks those
//! lines and the job's exit code. Each job has a hard bound: past it the job is killed and the
//! test fails. Jobs run one at a time. The launcher is shared with `tests/dist_store.rs`:
//! `tests/common/mpi_job.rs`.
//!
//! Without `mpirun` on the PATH each test prints `SKIPPED: mpirun not found` (CI treats that
//! line as a failure, since it installs Open MPI).
#![cfg(feature = "mpi")]

use std::time::{Duration, Instant};

use half::{bf16, f16};
use kvstore::__internal::mpi::{Done, Fingerprint, Wire, World};
use kvstore::{DType, Element, Error};
use rand::{Rng, SeedableRng};

mod common;
use common::mpi_job::launch;

/// This machine's host name, as every rank of a job on it reports it.
fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("the host name")
        .trim()
        .to_owned()
}

fn collectives(np: usize) {
    let Some(job) = launch(Some(np), "collectives", &[], Duration::from_secs(60)) else {
        return;
    };
    assert!(!job.killed, "the job ran past its bound\n{job}");
    let ranks: Vec<usize> = (0..np).collect();
    job.assert_ok(&ranks, np, "collectives", &[&format!("local_size={np}")]);
    assert_eq!(job.code, Some(0), "a healthy run must exit 0\n{job}");
}

#[test]
fn collectives_match_a_reference_on_2_ranks() {
    collectives(2);
}

#[test]
fn collectives_match_a_reference_on_3_ranks() {
    collectives(3);
}

#[test]
fn collectives_match_a_reference_on_4_ranks() {
    collectives(4);
}

#[test]
fn a_different_key_is_a_desync_error_on_every_rank() {
    let env = [("KVSTORE_TIMEOUT", "30")];
    let Some(job) = launch(Some(3), "desync_key", &env, Duration::from_secs(40)) else {
        return;
    };
    assert!(!job.killed, "{job}");
    // Within a second: well before the 30 s timeout, which would be a Timeout, not a Desync.
    job.assert_ok(
        &[0, 1, 2],
        3,
        "desync_key",
        &["key 5 on ranks [0, 2], key 6 on rank 1", "same order"],
    );
    assert_ne!(job.code, Some(0), "a desynced job must end non-zero\n{job}");
}

#[test]
fn a_different_shape_is_a_desync_error_on_every_rank() {
    let env = [("KVSTORE_TIMEOUT", "30")];
    let Some(job) = launch(Some(2), "desync_shape", &env, Duration::from_secs(40)) else {
        return;
    };
    assert!(!job.killed, "{job}");
    job.assert_ok(
        &[0, 1],
        2,
        "desync_shape",
        &["key 5 has shape [2, 3] on rank 0, [3, 2] on rank 1"],
    );
    assert_ne!(job.code, Some(0), "{job}");
}

fn skipped_call(np: usize, check: &str) {
    let env = [("KVSTORE_TIMEOUT", "2"), ("KVSTORE_DIST_CHECK", check)];
    let Some(job) = launch(Some(np), "skip", &env, Duration::from_secs(40)) else {
        return;
    };
    assert!(!job.killed, "{job}");
    let last = np - 1;
    let others: Vec<usize> = (0..last).collect();
    job.assert_ok(
        &others,
        np,
        "skip",
        &[
            "pull (call #2) of keys [5] timed out",
            &format!("waiting for ranks [{last}]"),
            &format!("rank {last} is not responding"),
            &format!("missing: rank {last} (host {})", this_host()),
            "first failure",
        ],
    );
    assert!(
        job.lines(last).iter().all(|l| !l.contains(" OK ")),
        "the skipping rank must not get that far\n{job}"
    );
    assert_ne!(job.code, Some(0), "{job}");
}

#[test]
fn a_skipped_call_times_out_naming_the_missing_rank_on_3_ranks() {
    skipped_call(3, "1");
}

#[test]
fn a_skipped_call_times_out_without_the_check_on_2_ranks() {
    skipped_call(2, "0");
}

#[test]
fn a_blocking_collective_that_a_rank_never_joins_ends_the_job_after_the_timeout() {
    // Every rank agrees on the call, then one never starts its blocking reduce: the watchdog
    // of the ranks inside it logs, then ends their processes, and mpirun ends the job, long
    // before the absent rank wakes up.
    let env = [("KVSTORE_TIMEOUT", "3"), ("KVSTORE_WAIT_LOG_SECS", "1")];
    let t = Instant::now();
    let Some(job) = launch(Some(2), "blocking_stall", &env, Duration::from_secs(60)) else {
        return;
    };
    assert!(!job.killed, "the job must end by itself\n{job}");
    assert_ne!(job.code, Some(0), "{job}");
    assert!(t.elapsed() < Duration::from_secs(25), "ended late\n{job}");
    for needle in [
        "rank 0: call #1 (push) has been inside its blocking reduce to rank 0 for",
        "a rank is slow inside it or stopped",
        "longer than KVSTORE_TIMEOUT (3 s)",
        "this process ends with exit code 1",
    ] {
        assert!(
            job.stderr.contains(needle),
            "'{needle}' not in stderr\n{job}"
        );
    }
    assert!(
        job.stdout.lines().all(|l| !l.contains("OK blocking_stall")),
        "no rank can finish\n{job}"
    );
}

#[test]
fn a_rank_killed_by_sigkill_ends_the_job_non_zero() {
    let env = [("KVSTORE_TIMEOUT", "10")];
    let Some(job) = launch(Some(3), "sigkill", &env, Duration::from_secs(40)) else {
        return;
    };
    assert!(!job.killed, "the job must end by itself\n{job}");
    assert_ne!(job.code, Some(0), "{job}");
    assert!(
        job.stdout.lines().all(|l| !l.contains("OK sigkill")),
        "no rank can finish\n{job}"
    );
}

#[test]
fn without_mpirun_a_process_is_a_one_rank_world() {
    let Some(job) = launch(None, "collectives", &[], Duration::from_secs(30)) else {
        return;
    };
    assert!(!job.killed, "{job}");
    job.assert_ok(&[0], 1, "collectives", &["local_size=1"]);
    assert_eq!(job.code, Some(0), "{job}");
}

#[test]
fn launcher_variables_that_disagree_with_mpi_are_an_error() {
    let env = [("RANK", "3"), ("WORLD_SIZE", "4")];
    let Some(job) = launch(None, "env_mismatch", &env, Duration::from_secs(30)) else {
        return;
    };
    assert!(!job.killed, "{job}");
    job.assert_ok(
        &[0],
        1,
        "env_mismatch",
        &["RANK=3 but MPI says this process's rank is 0", "mpirun"],
    );
    assert_ne!(job.code, Some(0), "{job}");
}

// --- Exit and slow ranks (issue 16) ---------------------------------------------------------

/// Fault 6: rank 1 returns from `main` right after the last store call while rank 0 spends three
/// times `KVSTORE_TIMEOUT` writing its model. A normal exit is not a failure: rank 1 must wait for
/// rank 0 (logging that it does), and rank 0 must finish its work; the job exits 0.
#[test]
fn a_normal_exit_waits_for_a_rank_still_writing_its_model_and_never_kills_it() {
    let env = [("KVSTORE_TIMEOUT", "2"), ("KVSTORE_WAIT_LOG_SECS", "1")];
    let Some(job) = launch(Some(2), "slow_writer", &env, Duration::from_secs(60)) else {
        return;
    };
    job.assert_healthy(2, "slow_writer");
    job.assert_ok(&[0], 2, "slow_writer", &["wrote 6 chunks"]);
    assert!(
        job.stderr.lines().any(
            |l| l.starts_with("kvstore: rank 1: at its exit after call #1, waiting for rank 0")
        ),
        "the rank at its exit must say whom it waits for\n{job}"
    );
}

/// Fault 7: rank 1 fails (`how`) after call 1 while ranks 0 and 2 wait in call 2 (`KVSTORE_TIMEOUT`
/// is 60 s). They must get `Error::RankExited` naming rank 1 at once, and the job must end
/// non-zero well before the timeout.
fn a_failed_rank_ends_the_job(how: &str, needles: &[&str]) {
    let env = [("KVSTORE_TIMEOUT", "60"), ("KVT_HOW", how)];
    let Some(job) = launch(Some(3), "rank_fails", &env, Duration::from_secs(100)) else {
        return;
    };
    assert!(!job.killed, "the job must end by itself\n{job}");
    assert!(
        job.took < Duration::from_secs(30),
        "the job must end well before KVSTORE_TIMEOUT=60 s, not after it\n{job}"
    );
    let named = format!("rank 1 (host {}) exited", this_host());
    let mut all = vec!["RankExited { op: ", "rank: 1", &named];
    all.extend_from_slice(needles);
    job.assert_ok(&[0, 2], 3, "rank_fails", &all);
    assert!(
        job.ok_line(1, 3, "rank_fails").is_none(),
        "rank 1 must not finish\n{job}"
    );
    assert_ne!(
        job.code,
        Some(0),
        "a failed rank must end the job non-zero\n{job}"
    );
}

#[test]
fn a_rank_that_panics_ends_the_job_at_once_and_the_others_name_it() {
    a_failed_rank_ends_the_job("panic", &["code 101", "rank 1 fails on purpose"]);
}

#[test]
fn a_rank_that_exits_with_code_1_ends_the_job_at_once_and_the_others_name_it() {
    a_failed_rank_ends_the_job("exit1", &["code 1 ", "barrier"]);
}

#[test]
fn a_rank_that_exits_normally_before_a_call_fails_the_others_at_once() {
    a_failed_rank_ends_the_job("exit0", &["exited normally after its call #1"]);
}

/// A rank waiting at its normal exit must not outlive a rank that fails afterwards: rank 1
/// returns from `main`, then rank 0 panics outside any call. Rank 1 hears of it, says so, and the
/// job ends non-zero at once (`KVSTORE_TIMEOUT` is 60 s).
#[test]
fn a_rank_waiting_at_its_exit_ends_the_job_when_another_rank_then_fails() {
    let env = [("KVSTORE_TIMEOUT", "60")];
    let Some(job) = launch(Some(2), "fail_after_exit", &env, Duration::from_secs(100)) else {
        return;
    };
    assert!(!job.killed, "the job must end by itself\n{job}");
    assert!(job.took < Duration::from_secs(30), "{job}");
    assert_ne!(job.code, Some(0), "{job}");
    job.assert_ok(&[1], 2, "fail_after_exit", &[]);
    assert!(
        job.stderr
            .contains("kvstore: rank 1: at its exit: rank 0 exited with code 101"),
        "rank 1 must say which rank failed\n{job}"
    );
}

/// A slow rank is not a dead one: rank 1 comes to call 2 four seconds late (the log interval is
/// 1 s, the timeout 60 s). Rank 0 must say, while it waits, that it waits for rank 1 and in which
/// call; the job then completes with the right sum and exits 0.
#[test]
fn a_slow_rank_is_named_in_the_wait_log_and_the_job_completes() {
    let env = [("KVSTORE_TIMEOUT", "60"), ("KVSTORE_WAIT_LOG_SECS", "1")];
    let Some(job) = launch(Some(3), "slow_rank", &env, Duration::from_secs(60)) else {
        return;
    };
    job.assert_healthy(3, "slow_rank");
    assert!(job.took < Duration::from_secs(30), "{job}");
    let logged: Vec<&str> = job
        .stderr
        .lines()
        .filter(|l| l.contains("kvstore: rank 0: waiting for rank 1 "))
        .collect();
    assert!(
        !logged.is_empty(),
        "rank 0 must log that it waits for rank 1\n{job}"
    );
    for needle in [
        "call #2 (push of key 7)",
        "rank 1 is not responding",
        "rank 2 is waiting in this same call",
    ] {
        assert!(
            logged.iter().any(|l| l.contains(needle)),
            "'{needle}' not in rank 0's wait log: {logged:?}\n{job}"
        );
    }
}

#[test]
fn a_bad_wait_log_interval_is_an_error_naming_the_variable() {
    let env = [("KVSTORE_WAIT_LOG_SECS", "soon")];
    let Some(job) = launch(None, "bad_wait_log", &env, Duration::from_secs(30)) else {
        return;
    };
    assert!(!job.killed, "{job}");
    job.assert_ok(
        &[0],
        1,
        "bad_wait_log",
        &["KVSTORE_WAIT_LOG_SECS", "'soon'"],
    );
}

// ---------------------------------------------------------------------------------------------
// The inner side: one case, on every rank.
// ---------------------------------------------------------------------------------------------

/// The entry point of the ranks; the outer tests run it through mpirun.
#[test]
#[ignore = "run on every rank under mpirun by the other tests"]
fn inner() {
    let case = std::env::var("KVT_CASE").expect("KVT_CASE names the case");
    match case.as_str() {
        "collectives" => case_collectives(),
        "desync_key" => case_desync(false),
        "desync_shape" => case_desync(true),
        "skip" => case_skip(),
        "sigkill" => case_sigkill(),
        "env_mismatch" => case_env_mismatch(),
        "slow_writer" => case_slow_writer(),
        "rank_fails" => case_rank_fails(),
        "fail_after_exit" => case_fail_after_exit(),
        "slow_rank" => case_slow_rank(),
        "bad_wait_log" => case_bad_wait_log(),
        "blocking_stall" => case_blocking_stall(),
        "rs_edges" => case_rs_edges(),
        "rs_mismatch" => case_rs_mismatch(),
        "reduce_short" => case_reduce_mismatch(false),
        "reduce_long" => case_reduce_mismatch(true),
        "rs_kill" => case_rs_kill(),
        other => panic!("unknown case {other}"),
    }
}

fn ok(w: &World, case: &str, detail: &str) {
    common::mpi_job::ok_line(w.rank(), w.size(), case, detail);
}

/// Rank `rank`'s data for `tag`: `n` uniform values in [-1, 1), the same wherever computed.
fn data<T: Element>(rank: usize, tag: u64, n: usize) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(tag * 1_000 + rank as u64);
    (0..n)
        .map(|_| T::from_f64(rng.gen_range(-1.0..1.0)))
        .collect()
}

/// The machine epsilon of `T`.
fn eps<T: Element>() -> f64 {
    match T::DTYPE {
        DType::F32 => f32::EPSILON.into(),
        DType::F64 => f64::EPSILON,
        DType::F16 => f16::EPSILON.to_f64(),
        DType::BF16 => bf16::EPSILON.to_f64(),
    }
}

/// Checks `got` against the sum over `ranks` of their data, element by element: the error
/// bound is size × eps(T) × Σ|x|, far below one rank's contribution.
fn check_sum<T: Element>(got: &[T], tag: u64, n: usize, ranks: usize, offset: usize, what: &str) {
    let all: Vec<Vec<T>> = (0..ranks).map(|r| data::<T>(r, tag, n)).collect();
    for (i, g) in got.iter().enumerate() {
        let xs = all.iter().map(|v| v[offset + i].to_f64());
        let sum: f64 = xs.clone().sum();
        let abs: f64 = xs.map(f64::abs).sum();
        let tol = ranks as f64 * eps::<T>() * abs + 1e-30;
        assert!(
            (g.to_f64() - sum).abs() <= tol,
            "{what} {:?}: element {i}: got {} want {sum} (tolerance {tol})",
            T::DTYPE,
            g.to_f64()
        );
    }
}

fn poisoned<T: Element>(n: usize) -> Vec<T> {
    vec![T::from_f64(f64::NAN); n]
}

/// One round of every collective in `T`, non-blocking or `blocking` (`Call::set_blocking`).
fn run_dtype<T: Element + Wire>(w: &'static World, round: u64, blocking: bool) {
    let (r, size) = (w.rank(), w.size());
    let block = [37, 1_001, 65_536][round as usize];
    let n = block * size;
    let tag = round * 16 + T::DTYPE as u64;
    let fp = |op| Fingerprint::new(op).entry(round as i32, &[n], T::DTYPE);

    // Reduce to a root that moves with the round.
    let root = (round as usize + 1) % size;
    let mut call = w.begin(&fp("push")).expect("begin");
    call.set_blocking(blocking);
    let mine = data::<T>(r, tag, n);
    let recv = if r == root { poisoned(n) } else { Vec::new() };
    let mut p = call.reduce_sum(mine.clone(), recv, root).expect("reduce");
    // A test first (a blocking reduce has completed already: the test says so, no error).
    let done = call.test(&mut p).expect("reduce test");
    assert!(
        done || !blocking,
        "a blocking reduce is done when it returns"
    );
    let Done { send, recv } = call.wait(p).expect("reduce wait");
    assert_eq!(send, mine, "reduce gives the input back unchanged");
    if r == root {
        check_sum(&recv, tag, n, size, 0, "reduce");
    }
    drop(call);

    // Broadcast from another root; the others start from NaN.
    let root = round as usize % size;
    let mut call = w.begin(&fp("pull")).expect("begin");
    call.set_blocking(blocking);
    let buf = if r == root {
        data::<T>(root, tag + 100, n)
    } else {
        poisoned(n)
    };
    let p = call.broadcast(buf, root).expect("broadcast");
    let got = call.wait(p).expect("broadcast wait").recv;
    assert_eq!(
        got,
        data::<T>(root, tag + 100, n),
        "broadcast {:?}",
        T::DTYPE
    );
    drop(call);

    // Reduce-scatter, then all-gather, both started before either is waited for, and polled
    // once with test.
    let mut call = w.begin(&fp("pushpull")).expect("begin");
    call.set_blocking(blocking);
    let p1 = call
        .reduce_scatter(data::<T>(r, tag + 200, n), poisoned(block))
        .expect("reduce-scatter");
    let mut p2 = call
        .all_gather(data::<T>(r, tag + 300, block), poisoned(n))
        .expect("all-gather");
    let _ = call.test(&mut p2).expect("test");
    let got = call.wait(p1).expect("reduce-scatter wait").recv;
    check_sum(&got, tag + 200, n, size, r * block, "reduce-scatter");
    let got = call.wait_all(vec![p2]).expect("all-gather wait");
    for k in 0..size {
        assert_eq!(
            got[0].recv[k * block..(k + 1) * block],
            data::<T>(k, tag + 300, block)[..],
            "all-gather {:?} block {k}",
            T::DTYPE
        );
    }
    drop(call);

    // An all-to-all whose every pair of ranks has its own block length (some empty): rank
    // `s` sends rank `d` `len(s, d)` elements of its data for `d`.
    let len = |s: usize, d: usize| ((s * 7 + d * 3 + round as usize) % 5) * (block / 4 + 1);
    let lens: Vec<usize> = (0..size)
        .flat_map(|s| (0..size).map(move |d| len(s, d)))
        .collect();
    let for_rank = |s: usize, d: usize| data::<T>(s, tag + 400 + d as u64, len(s, d));
    let send: Vec<T> = (0..size).flat_map(|d| for_rank(r, d)).collect();
    let mut call = w.begin(&fp("alltoallv")).expect("begin");
    call.set_blocking(blocking);
    let p = call
        .all_to_all_v(
            send.clone(),
            &lens,
            poisoned((0..size).map(|s| len(s, r)).sum()),
        )
        .expect("all-to-all");
    let Done { send: back, recv } = call.wait(p).expect("all-to-all wait");
    assert_eq!(back, send, "an all-to-all gives the input back unchanged");
    let want: Vec<T> = (0..size).flat_map(|s| for_rank(s, r)).collect();
    assert_eq!(recv, want, "all-to-all of unequal blocks {:?}", T::DTYPE);
    call.barrier().expect("barrier");
}

fn case_collectives() {
    let w = World::get().expect("the world");
    for (round, blocking) in (0..3).flat_map(|r| [(r, false), (r, true)]) {
        run_dtype::<f32>(w, round, blocking);
        run_dtype::<f64>(w, round, blocking);
        run_dtype::<f16>(w, round, blocking);
        run_dtype::<bf16>(w, round, blocking);
    }
    // A buffer that does not fit is refused before anything is sent, and does not poison.
    let mut call = w.begin(&Fingerprint::new("bad")).expect("begin");
    let e = call
        .reduce_scatter(vec![0f32; 3 * w.size() + 1], vec![0f32; 3])
        .err()
        .expect("a misfit");
    assert!(matches!(e, Error::Mpi { .. }), "{e}");
    drop(call);
    assert!(w.failure().is_none());
    let detail = format!(
        "local_rank={} local_size={} seq={}",
        w.local_rank(),
        w.local_size(),
        w.begin(&Fingerprint::new("end")).expect("begin").seq()
    );
    ok(w, "collectives", &detail);
}

fn case_desync(shape: bool) {
    let w = World::get().expect("the world");
    let last = w.size() - 1;
    let (key, dims): (i32, &[usize]) = match (shape, w.rank()) {
        (false, 1) => (6, &[2, 3]),
        (true, r) if r == last => (5, &[3, 2]),
        _ => (5, &[2, 3]),
    };
    // A matching call first.
    let first = Fingerprint::new("init").entry(4, &[2], DType::F32);
    drop(w.begin(&first).expect("a matching call"));
    let fp = Fingerprint::new("push")
        .entry(3, &[2], DType::F32)
        .entry(key, dims, DType::F32);
    let t = Instant::now();
    let e = w.begin(&fp).err().expect("a desync error");
    let took = t.elapsed();
    assert!(
        matches!(e, Error::Desync { seq: 2, .. }),
        "want Desync, got {e}"
    );
    let later = w.begin(&first).err().expect("poisoned");
    assert!(matches!(later, Error::DistFailed { .. }), "{later}");
    let case = if shape { "desync_shape" } else { "desync_key" };
    ok(w, case, &format!("after {took:?}: {e}"));
}

fn case_skip() {
    let w = World::get().expect("the world");
    let last = w.size() - 1;
    // Call 1, on every rank: a pull of key 4.
    let mut call = w
        .begin(&Fingerprint::new("pull").entry(4, &[8], DType::F32))
        .expect("begin");
    let p = call.broadcast(vec![1f32; 8], 0).expect("broadcast");
    call.wait(p).expect("call 1");
    drop(call);
    if w.rank() == last {
        // Skip call 2 and stay away past the others' timeout and grace period.
        std::thread::sleep(w.timeout() * 4 + Duration::from_secs(3));
        println!("KVT rank={last} size={} woke up", w.size());
        return;
    }
    // Call 2: a pull of key 5 that the last rank never makes.
    let r = w
        .begin(&Fingerprint::new("pull").entry(5, &[8], DType::F32))
        .and_then(|mut call| {
            // From the absent rank: a root would not wait for its receivers.
            let p = call.broadcast(vec![1f32; 8], last)?;
            call.wait(p)
        });
    let e = r.expect_err("a timeout");
    let Error::Timeout { missing, seq, .. } = &e else {
        panic!("want Timeout, got {e}");
    };
    assert_eq!((missing.as_slice(), *seq), (&[last][..], 2), "{e}");
    let later = w
        .begin(&Fingerprint::new("pull").entry(6, &[8], DType::F32))
        .err()
        .expect("poisoned");
    assert!(matches!(later, Error::DistFailed { .. }), "{later}");
    ok(w, "skip", &format!("{e} || then: {later}"));
}

fn case_blocking_stall() {
    let w = World::get().expect("the world");
    let mut call = w
        .begin(&Fingerprint::new("push").entry(1, &[1024], DType::F32))
        .expect("begin");
    if w.rank() == 1 {
        std::thread::sleep(Duration::from_secs(40));
        ok(w, "blocking_stall", "(must not happen)");
        return;
    }
    call.set_blocking(true);
    let recv = vec![0f32; 1024];
    let p = call.reduce_sum(vec![1f32; 1024], recv, 0);
    ok(
        w,
        "blocking_stall",
        &format!("(must not happen: {:?})", p.is_ok()),
    );
}

fn case_sigkill() {
    let w = World::get().expect("the world");
    for i in 0..20 {
        if i == 5 && w.rank() == 1 {
            // SAFETY: kill(2) on this very process.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        let mut call = w
            .begin(&Fingerprint::new("pull").entry(i, &[1 << 18], DType::F32))
            .expect("begin");
        let p = call.broadcast(vec![1f32; 1 << 18], 0).expect("broadcast");
        if call.wait(p).is_err() {
            break;
        }
    }
    ok(w, "sigkill", "(must not happen)");
}

fn case_env_mismatch() {
    let e = World::get().err().expect("an environment error");
    let Error::DistEnv { var, .. } = &e else {
        panic!("want DistEnv, got {e}");
    };
    assert_eq!(var, "RANK");
    println!("KVT rank=0 size=1 OK env_mismatch {e}");
}

/// One broadcast of key `key` from rank 0, as a whole call.
fn pull_from_0(w: &'static World, key: i32) {
    let mut call = w
        .begin(&Fingerprint::new("pull").entry(key, &[4], DType::F32))
        .expect("begin");
    let p = call
        .broadcast(vec![w.rank() as f32; 4], 0)
        .expect("broadcast");
    let got = call.wait(p).expect("broadcast wait").recv;
    assert_eq!(got, vec![0f32; 4]);
}

fn case_slow_writer() {
    let w = World::get().expect("the world");
    pull_from_0(w, 1);
    if w.rank() == 1 {
        ok(w, "slow_writer", "returned from main");
        return;
    }
    // Rank 0 writes its "model" for three times the timeout, a chunk every half timeout.
    let path = std::env::temp_dir().join(format!("kvt-model-{}.bin", std::process::id()));
    let mut file = std::fs::File::create(&path).expect("create the model file");
    let chunk = vec![7u8; 1 << 16];
    for _ in 0..6 {
        std::thread::sleep(w.timeout() / 2);
        std::io::Write::write_all(&mut file, &chunk).expect("write the model");
    }
    drop(file);
    let len = std::fs::metadata(&path).expect("the model file").len();
    let _ = std::fs::remove_file(&path);
    assert_eq!(len, 6 << 16);
    ok(w, "slow_writer", "wrote 6 chunks");
}

fn case_rank_fails() {
    let w = World::get().expect("the world");
    let how = std::env::var("KVT_HOW").expect("KVT_HOW");
    pull_from_0(w, 1);
    let t = Instant::now();
    if w.rank() == 1 {
        match how.as_str() {
            "panic" => panic!("rank 1 fails on purpose"),
            "exit1" => std::process::exit(1),
            _ => std::process::exit(0),
        }
    }
    let r = match how.as_str() {
        "exit1" => w
            .begin(&Fingerprint::new("barrier"))
            .and_then(|mut call| call.barrier()),
        _ => w
            .begin(&Fingerprint::new("push").entry(2, &[4], DType::F32))
            .and_then(|mut call| {
                let recv = if w.rank() == 0 {
                    vec![0f32; 4]
                } else {
                    Vec::new()
                };
                let p = call.reduce_sum(vec![1f32; 4], recv, 0)?;
                call.wait(p).map(drop)
            }),
    };
    let e = r.expect_err("rank 1 is gone: this call cannot complete");
    let later = w
        .begin(&Fingerprint::new("barrier"))
        .err()
        .expect("poisoned");
    assert!(matches!(later, Error::DistFailed { .. }), "{later}");
    ok(
        w,
        "rank_fails",
        &format!("after {:?}: {e:?} || {e}", t.elapsed()),
    );
}

fn case_fail_after_exit() {
    let w = World::get().expect("the world");
    pull_from_0(w, 1);
    if w.rank() == 1 {
        ok(w, "fail_after_exit", "returned from main");
        return;
    }
    std::thread::sleep(Duration::from_secs(1));
    panic!("rank 0 fails after rank 1 returned");
}

fn case_slow_rank() {
    let w = World::get().expect("the world");
    pull_from_0(w, 1);
    if w.rank() == 1 {
        // A validation pass: longer than the log interval, far shorter than the timeout.
        std::thread::sleep(Duration::from_secs(4));
    }
    let n = 1_000;
    let mut call = w
        .begin(&Fingerprint::new("push").entry(7, &[n], DType::F32))
        .expect("begin");
    let recv = if w.rank() == 0 {
        poisoned(n)
    } else {
        Vec::new()
    };
    let p = call
        .reduce_sum(data::<f32>(w.rank(), 7, n), recv, 0)
        .expect("reduce");
    let got = call.wait(p).expect("reduce wait").recv;
    if w.rank() == 0 {
        check_sum(&got, 7, n, w.size(), 0, "reduce after a slow rank");
    }
    drop(call);
    pull_from_0(w, 8);
    ok(w, "slow_rank", "");
}

fn case_bad_wait_log() {
    let e = World::get().err().expect("an environment error");
    let Error::DistEnv { var, .. } = &e else {
        panic!("want DistEnv, got {e}");
    };
    assert_eq!(var, "KVSTORE_WAIT_LOG_SECS");
    println!("KVT rank=0 size=1 OK bad_wait_log {e}");
}

// --- The store's own reduce-scatter (point to point) ---------------------------------------
// Sums bit for bit in rank order, several in flight at once and waited for in any order; ranks
// that disagree on the size; a rank killed mid-transfer.

fn rs_job(np: usize, case: &str, env: &[(&str, &str)]) -> Option<common::mpi_job::Job> {
    let job = launch(Some(np), case, env, Duration::from_secs(60))?;
    eprintln!("{job}");
    assert!(!job.killed, "the job ran past its bound\n{job}");
    Some(job)
}

#[test]
fn reduce_scatters_in_flight_together_sum_in_rank_order_on_2_3_4_ranks() {
    for np in [2, 3, 4] {
        let Some(job) = rs_job(np, "rs_edges", &[]) else {
            return;
        };
        let ranks: Vec<usize> = (0..np).collect();
        job.assert_ok(&ranks, np, "rs_edges", &[]);
        assert_eq!(job.code, Some(0), "{job}");
    }
}

#[test]
fn ranks_that_disagree_on_a_reduce_scatter_size_all_fail_without_the_check_on_2_ranks() {
    // What the ranks do when they disagree on a key's size (KVSTORE_DIST_CHECK=0 lets that
    // through to the transfer): printed, and asserted to never be a success with wrong data.
    let Some(job) = rs_job(2, "rs_mismatch", &[("KVSTORE_TIMEOUT", "3")]) else {
        return;
    };
    for r in 0..2 {
        for l in job.lines(r) {
            assert!(!l.contains("WRONG"), "rank {r}: {l}\n{job}");
        }
        // Each rank says why: the one sent less, and the one sent more than it expected.
        assert!(
            job.lines(r)
                .iter()
                .any(|l| l.contains("RESULT error") && l.contains("disagree on")),
            "rank {r} did not fail naming the disagreement\n{job}"
        );
    }
}

#[test]
fn a_reduce_in_rank_order_whose_ranks_disagree_on_the_size_never_sums_on_3_ranks() {
    // The reduce on three ranks or more is point to point into the root: a rank that sends
    // fewer elements than the root expects, or more, must fail the root, never give it a sum.
    // The senders hold nothing of the result; they may end Ok.
    for case in ["reduce_short", "reduce_long"] {
        let Some(job) = rs_job(3, case, &[("KVSTORE_TIMEOUT", "3")]) else {
            return;
        };
        for r in 0..3 {
            for l in job.lines(r) {
                assert!(!l.contains("WRONG"), "{case}, rank {r}: {l}\n{job}");
            }
        }
        assert!(
            job.lines(0)
                .iter()
                .any(|l| l.contains("ROOT RESULT error") && l.contains("disagree on")),
            "{case}: the root did not fail naming why\n{job}"
        );
    }
}

/// The sum over ranks 0, 1, … in that order, as the reduce-scatter promises (f16/bf16 in f32,
/// rounded once).
fn rank_order_sum<T: Element + Wire>(
    tag: u64,
    n: usize,
    size: usize,
    block: usize,
    owner: usize,
) -> Vec<T> {
    let all: Vec<Vec<T>> = (0..size).map(|r| data::<T>(r, tag, n)).collect();
    (0..block)
        .map(|i| {
            let j = owner * block + i;
            if T::SUM_IN_F32 {
                let mut s = all[0][j].to_f32();
                for v in &all[1..] {
                    s += v[j].to_f32();
                }
                T::from_f32(s)
            } else {
                let mut s = all[0][j];
                for v in &all[1..] {
                    s = s.add(v[j]);
                }
                s
            }
        })
        .collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

fn case_rs_edges() {
    let w = World::get().expect("the world");
    let (r, size) = (w.rank(), w.size());
    for round in 0..3u64 {
        let fp = Fingerprint::new("push").entry(round as i32, &[1], DType::F32);
        let mut call = w.begin(&fp).expect("begin");
        // Three reduce-scatters of different sizes (one empty) and one in f16 and one in bf16,
        // all started before any is waited for, then waited for in reverse order.
        let blocks = [5usize, 0, 70_000, 1_001];
        let tags: Vec<u64> = (0..4).map(|k| 1000 + round * 10 + k).collect();
        let mut pf32 = Vec::new();
        for (k, &b) in blocks.iter().enumerate() {
            // A receive buffer with spare room and one without.
            let mut recv = Vec::with_capacity(if k % 2 == 0 { b * size } else { b });
            recv.resize(b, f32::NAN);
            pf32.push(
                call.reduce_scatter(data::<f32>(r, tags[k], b * size), recv)
                    .expect("rs"),
            );
        }
        let ph = call
            .reduce_scatter(
                data::<f16>(r, 2000 + round, 333 * size),
                vec![f16::NAN; 333],
            )
            .expect("rs f16");
        let pb = call
            .reduce_scatter(
                data::<bf16>(r, 3000 + round, 17 * size),
                vec![bf16::NAN; 17],
            )
            .expect("rs bf16");
        let gb = call.wait(pb).expect("wait bf16");
        let gh = call.wait(ph).expect("wait f16");
        let mut got = Vec::new();
        while let Some(p) = pf32.pop() {
            got.push(call.wait(p).expect("wait f32"));
        }
        got.reverse();
        for (k, d) in got.iter().enumerate() {
            let b = blocks[k];
            assert_eq!(d.recv.len(), b, "block {k} length");
            assert_eq!(
                d.send,
                data::<f32>(r, tags[k], b * size),
                "send back unchanged"
            );
            let want = rank_order_sum::<f32>(tags[k], b * size, size, b, r);
            assert_eq!(
                bits(&d.recv),
                bits(&want),
                "f32 rs {k} (block {b}) on rank {r}"
            );
        }
        let want = rank_order_sum::<f16>(2000 + round, 333 * size, size, 333, r);
        assert_eq!(bits(&gh.recv), bits(&want), "f16 rs on rank {r}");
        let want = rank_order_sum::<bf16>(3000 + round, 17 * size, size, 17, r);
        assert_eq!(bits(&gb.recv), bits(&want), "bf16 rs on rank {r}");
        // Polled with test until done, then waited.
        let mut p = call
            .reduce_scatter(data::<f64>(r, 4000 + round, 9 * size), vec![f64::NAN; 9])
            .expect("rs f64");
        let t0 = Instant::now();
        while !call.test(&mut p).expect("test") {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "test never completes"
            );
        }
        let d = call.wait(p).expect("wait f64");
        let want = rank_order_sum::<f64>(4000 + round, 9 * size, size, 9, r);
        assert_eq!(bits(&d.recv), bits(&want), "f64 rs on rank {r}");
        drop(call);
    }
    assert!(w.failure().is_none());
    ok(w, "rs_edges", "");
}

fn case_rs_mismatch() {
    let w = World::get().expect("the world");
    let (r, size) = (w.rank(), w.size());
    // The ranks disagree on the block: rank 0 thinks 8, rank 1 thinks 4.
    let b = if r == 0 { 8 } else { 4 };
    let send: Vec<f32> = (0..b * size).map(|i| (100 * (r + 1) + i) as f32).collect();
    let fp = Fingerprint::new("push").entry(0, &[1], DType::F32);
    let res = w.begin(&fp).and_then(|mut call| {
        let p = call.reduce_scatter(send, vec![f32::NAN; b])?;
        call.wait(p)
    });
    let line = match res {
        Ok(d) => {
            // What a right sum would need: every rank's block r of the same length.
            format!(
                "Ok {:?} (WRONG if any rank ends Ok: the sizes disagree)",
                d.recv
            )
        }
        Err(e) => format!("error: {e}"),
    };
    println!("KVT rank={r} size={size} RESULT {line}");
    ok(w, "rs_mismatch", &line);
}

#[test]
fn a_rank_killed_mid_reduce_scatter_ends_the_job_on_3_ranks() {
    let env = [("KVSTORE_TIMEOUT", "10")];
    let Some(job) = rs_job(3, "rs_kill", &env) else {
        return;
    };
    assert_ne!(job.code, Some(0), "{job}");
    assert!(job.took < Duration::from_secs(30), "{job}");
    assert!(
        job.stdout.lines().all(|l| !l.contains("OK rs_kill")),
        "no rank can finish\n{job}"
    );
}

fn case_rs_kill() {
    let w = World::get().expect("the world");
    let (r, size) = (w.rank(), w.size());
    let block = 1 << 19;
    for i in 0..10 {
        let mut call = w
            .begin(&Fingerprint::new("push").entry(i, &[block * size], DType::F32))
            .expect("begin");
        let p = call
            .reduce_scatter(
                data::<f32>(r, 500 + i as u64, block * size),
                vec![f32::NAN; block],
            )
            .expect("rs");
        if i == 3 && r == 1 {
            // Mid-transfer: its sends and receives are posted, big enough for rendezvous.
            // SAFETY: kill(2) on this very process.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        match call.wait(p) {
            Ok(d) => {
                check_sum(
                    &d.recv,
                    500 + i as u64,
                    block * size,
                    size,
                    r * block,
                    "rs_kill",
                );
                println!("KVT rank={r} size={size} step {i} fine");
            }
            Err(e) => {
                println!("KVT rank={r} size={size} step {i} error: {e}");
                break;
            }
        }
    }
    ok(w, "rs_kill", "(must not happen)");
}

/// See `a_reduce_in_rank_order_whose_ranks_disagree_on_the_size_never_sums_on_3_ranks`: a
/// reduce to rank 0 where rank 2 sends 4 elements and the others 8, or (`long`) where the root
/// expects 4 and the others send 8.
fn case_reduce_mismatch(long: bool) {
    let w = World::get().expect("the world");
    let (r, size) = (w.rank(), w.size());
    let short = if long { 0 } else { 2 };
    let n = if r == short { 4 } else { 8 };
    let send: Vec<f32> = (0..n).map(|i| (100 * (r + 1) + i) as f32).collect();
    let fp = Fingerprint::new("push").entry(0, &[1], DType::F32);
    let recv = if r == 0 {
        vec![f32::NAN; n]
    } else {
        Vec::new()
    };
    let res = w.begin(&fp).and_then(|mut call| {
        let p = call.reduce_sum(send, recv, 0)?;
        call.wait(p)
    });
    let line = match (res, r) {
        (Ok(d), 0) => format!("ROOT RESULT Ok {:?} (WRONG: the sizes disagree)", d.recv),
        (Ok(_), _) => "RESULT Ok (a sender)".to_owned(),
        (Err(e), 0) => format!("ROOT RESULT error: {e}"),
        (Err(e), _) => format!("RESULT error: {e}"),
    };
    println!("KVT rank={r} size={size} {line}");
    ok(w, "reduce_mismatch", "");
}

//! NCCL across ranks (`RankComm`, the engine of `dist_device_sync`): the four collectives
//! against a host reference, a rank that stops calling, and ranks in separate processes
//! launched as torchrun launches them (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`), including one killed with SIGKILL.
//!
//! Every test is `#[ignore = "needs a GPU"]` and first asserts that a GPU exists. A case that
//! cannot run here prints a line starting with `SKIPPED:` and is not counted as a pass: several
//! ranks on one GPU need NCCL >= 2.30 with `NCCL_MULTI_RANK_GPU_ENABLE=1`.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kvstore::__internal::nccl::{self, RankComm};
use kvstore::{gpu, gpu_count, DType, Error, NDArray, Shape};
use rand::{Rng, SeedableRng};

fn require_gpu() {
    assert!(
        gpu_count() > 0,
        "this test needs a GPU and none was found (libcuda missing or no device)"
    );
}

fn skipped(test: &str, why: &str) {
    println!("\nSKIPPED: {test}: {why}");
}

/// Why `n` ranks cannot share this machine's GPUs, if they cannot.
fn cannot_place(n: usize) -> Option<String> {
    if n <= gpu_count() {
        return None;
    }
    let version = nccl::version().unwrap_or(0);
    let enabled = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").as_deref() == Ok("1");
    if version >= 23000 && enabled {
        return None;
    }
    Some(format!(
        "{n} ranks on {} GPU(s) need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL \
         here: {version}, variable set: {enabled})",
        gpu_count()
    ))
}

/// Rank `r`'s data for seed `seed`: fresh each run (the seed is), never all zeros.
fn data(seed: u64, r: usize, n: usize) -> Vec<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((r as u64 + 1) * 0x9E37_79B9));
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

fn on_gpu(v: &[f64], dtype: DType, ordinal: usize) -> Result<NDArray> {
    let a = NDArray::from_vec(v.to_vec(), Shape::new(&[v.len()])?)?.astype(dtype)?;
    Ok(a.to_device(gpu(ordinal))?)
}

fn host(a: &NDArray) -> Result<Vec<f64>> {
    Ok(a.astype(DType::F64)?.to_vec::<f64>()?)
}

fn close(got: &[f64], want: &[f64], tol: f64, what: &str) -> Result<()> {
    ensure!(
        got.len() == want.len(),
        "{what}: {} elements, expected {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        ensure!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
    Ok(())
}

/// One rank's part of the collectives check: reduce, broadcast, reduce-scatter and
/// all-gather, each compared with the sum or copy computed on the host from every rank's data.
fn check_collectives(comm: &RankComm, seed: u64, dtype: DType, tol: f64) -> Result<()> {
    let (r, size, ordinal) = (comm.rank(), comm.size(), comm.ordinal());
    let n = 1031;
    let round = |v: Vec<f64>| -> Result<Vec<f64>> { host(&on_gpu(&v, dtype, ordinal)?) };
    let all: Vec<Vec<f64>> = (0..size)
        .map(|q| round(data(seed, q, n * size)))
        .collect::<Result<_>>()?;
    let sum: Vec<f64> = (0..n * size)
        .map(|i| all.iter().map(|d| d[i]).sum())
        .collect();
    let mine = &all[r];

    // Reduce of the first n elements to the last rank.
    let root = size - 1;
    let send = on_gpu(&mine[..n], dtype, ordinal)?;
    let recv = on_gpu(&vec![f64::NAN; n], dtype, ordinal)?;
    comm.reduce_sum(&send, &recv, root)?;
    comm.synchronize()?;
    if r == root {
        close(&host(&recv)?, &sum[..n], tol, "reduce")?;
    }

    // Broadcast from rank 1 % size; the others start from NaN.
    let from = 1 % size;
    let start = if r == from {
        mine[..n].to_vec()
    } else {
        vec![f64::NAN; n]
    };
    let buf = on_gpu(&start, dtype, ordinal)?;
    comm.broadcast(&buf, from)?;
    comm.synchronize()?;
    close(&host(&buf)?, &all[from][..n], 0.0, "broadcast")?;

    // Reduce-scatter: slice r of the sum.
    let send = on_gpu(mine, dtype, ordinal)?;
    let recv = on_gpu(&vec![f64::NAN; n], dtype, ordinal)?;
    comm.reduce_scatter(&send, &recv)?;
    comm.synchronize()?;
    close(
        &host(&recv)?,
        &sum[r * n..(r + 1) * n],
        tol,
        "reduce-scatter",
    )?;

    // All-gather: every rank's first n elements, in rank order.
    let send = on_gpu(&mine[..n], dtype, ordinal)?;
    let recv = on_gpu(&vec![f64::NAN; n * size], dtype, ordinal)?;
    comm.all_gather(&send, &recv)?;
    comm.synchronize()?;
    let want: Vec<f64> = all.iter().flat_map(|d| d[..n].to_vec()).collect();
    close(&host(&recv)?, &want, 0.0, "all-gather")?;

    // All-to-all of blocks of their own lengths (some empty, one to this rank itself): rank s
    // sends rank t `count(s, t)` elements, taken from its data at `start(s, t)`.
    let count = |s: usize, t: usize| match (s + t + seed as usize) % size {
        0 => 0,
        _ => 1 + ((seed as usize >> 3) + 5 * s + 3 * t) % 6,
    };
    let start = |s: usize, t: usize| (0..t).map(|q| count(s, q)).sum::<usize>();
    let sends: Vec<usize> = (0..size).map(|t| count(r, t)).collect();
    let receives: Vec<usize> = (0..size).map(|s| count(s, r)).collect();
    let (sent, received) = (sends.iter().sum::<usize>(), receives.iter().sum::<usize>());
    let send = on_gpu(&mine[..sent.max(1)], dtype, ordinal)?;
    let recv = on_gpu(&vec![f64::NAN; received.max(1)], dtype, ordinal)?;
    comm.all_to_all_v(&send, &sends, &recv, &receives)?;
    let want: Vec<f64> = (0..size)
        .flat_map(|s| all[s][start(s, r)..start(s, r) + count(s, r)].to_vec())
        .collect();
    close(&host(&recv)?[..received], &want, 0.0, "all-to-all-v")?;
    // Counts that do not fit the buffers are refused before anything is sent.
    let too_many: Vec<usize> = sends.iter().map(|c| c + 1).collect();
    let e = comm
        .all_to_all_v(&send, &too_many, &recv, &receives)
        .unwrap_err();
    ensure!(
        matches!(e, Error::Nccl { .. }),
        "counts past the buffer: {e}"
    );

    // Misuse is refused before anything is sent, and the communicator stays usable.
    let short = on_gpu(&mine[..n - 1], dtype, ordinal)?;
    let e = comm.reduce_scatter(&send, &short).unwrap_err();
    ensure!(matches!(e, Error::Nccl { .. }), "a wrong length: {e}");
    let e = comm.all_gather(&send, &send).unwrap_err();
    ensure!(
        matches!(e, Error::Nccl { .. }),
        "one array as send and recv: {e}"
    );

    // An in-place reduce.
    let buf = on_gpu(&mine[..n], dtype, ordinal)?;
    comm.reduce_sum(&buf, &buf, 0)?;
    if r == 0 {
        close(&host(&buf)?, &sum[..n], tol, "in-place reduce")?;
    }
    Ok(())
}

/// Runs `body(rank)` on `n` threads, each with its own `RankComm` joined to one id, and
/// collects their results within `limit` (a hang fails the test instead of hanging it).
fn in_threads(
    n: usize,
    limit: Duration,
    body: impl Fn(RankComm) -> Result<()> + Send + Sync + Clone + 'static,
) -> Result<()> {
    let id = RankComm::unique_id()?;
    let (tx, rx) = mpsc::channel();
    for r in 0..n {
        let (tx, body) = (tx.clone(), body.clone());
        std::thread::spawn(move || {
            let res = RankComm::join(id, r, n, r % gpu_count())
                .map_err(anyhow::Error::from)
                .and_then(body);
            let _ = tx.send((r, res));
        });
    }
    drop(tx);
    let deadline = Instant::now() + limit;
    let mut results = HashMap::new();
    while results.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, res) = rx.recv_timeout(left).with_context(|| {
            format!("ranks {:?} did not finish within {limit:?}", {
                let mut missing: Vec<usize> = (0..n).filter(|r| !results.contains_key(r)).collect();
                missing.sort_unstable();
                missing
            })
        })?;
        results.insert(r, res);
    }
    for r in 0..n {
        results
            .remove(&r)
            .expect("every rank reported")
            .with_context(|| format!("rank {r}"))?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn collectives_across_ranks_match_a_host_reference() -> Result<()> {
    require_gpu();
    let seed: u64 = rand::random();
    println!("seed {seed}");
    for n in [2, 3] {
        if let Some(why) = cannot_place(n) {
            skipped("collectives_across_ranks_match_a_host_reference", &why);
            continue;
        }
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12), (DType::BF16, 2e-2)] {
            in_threads(n, Duration::from_secs(120), move |comm| {
                check_collectives(&comm, seed, dtype, tol)
                    .with_context(|| format!("{n} ranks, {dtype}"))
            })?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn a_rank_that_stops_calling_fails_the_others_within_the_timeout() -> Result<()> {
    require_gpu();
    let n = 3;
    if let Some(why) = cannot_place(n) {
        skipped(
            "a_rank_that_stops_calling_fails_the_others_within_the_timeout",
            &why,
        );
        return Ok(());
    }
    let timeout = Duration::from_secs(2);
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Arc::new(std::sync::Mutex::new(done_rx));
    in_threads(n, Duration::from_secs(90), move |mut comm| {
        comm.set_timeout(timeout);
        let ordinal = comm.ordinal();
        let x = on_gpu(&data(7, comm.rank(), 257), DType::F32, ordinal)?;
        // One reduce that every rank makes, so the connections exist.
        comm.reduce_sum(&x, &x, 0)?;
        comm.synchronize()?;
        if comm.rank() == n - 1 {
            // This rank skips the next call; it waits until the others have given up.
            let rx = done_rx.lock().unwrap();
            for _ in 0..n - 1 {
                rx.recv_timeout(Duration::from_secs(60))
                    .context("the other ranks never gave up")?;
            }
            return Ok(());
        }
        // An all-gather needs every rank's part on every rank (a reduce's non-root ranks may
        // finish without the others).
        let all = on_gpu(&vec![0.5; 257 * n], DType::F32, ordinal)?;
        let start = Instant::now();
        let res = comm.all_gather(&x, &all).and_then(|()| comm.synchronize());
        let took = start.elapsed();
        // Told before any check, so a failing rank never leaves the skipping one waiting.
        done_tx.send(()).ok();
        // An error, not a panic: a panicking rank never reports, and the test would only say
        // "did not finish" after its 90 s limit.
        let Err(err) = res else {
            bail!("an all-gather that one rank never joins returned Ok after {took:?}");
        };
        ensure!(
            matches!(err, Error::Timeout { .. }),
            "expected a timeout, got: {err}"
        );
        ensure!(took < timeout * 10, "the timeout took {took:?}");
        ensure!(
            err.to_string().contains("all-gather"),
            "the error names the op: {err}"
        );
        let later = comm.broadcast(&x, 0).unwrap_err();
        ensure!(
            matches!(later, Error::DistFailed { .. }),
            "after a failure every call fails at once: {later}"
        );
        Ok(())
    })
}

/// After a collective is aborted, its arrays may go at once: the caller frees them (on the
/// GPU's runtime stream) as soon as the call returns its error. Rank 1 never joins an
/// all-gather and keeps its communicator alive, so rank 0's abort is not the last of this
/// process, and NCCL's abort then waits for nothing (its host wait on the kernels is done only
/// by the process's last rank, in `commReclaim`). The stand-in's aborted part reads and writes
/// its buffers when it runs: a free not ordered after it is reported as a race, which the next
/// host wait on that GPU returns.
#[test]
#[ignore = "needs a GPU"]
fn the_arrays_of_an_aborted_collective_may_be_freed_at_once() -> Result<()> {
    require_gpu();
    let n = 2;
    if let Some(why) = cannot_place(n) {
        skipped(
            "the_arrays_of_an_aborted_collective_may_be_freed_at_once",
            &why,
        );
        return Ok(());
    }
    let seed: u64 = rand::random();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Arc::new(std::sync::Mutex::new(done_rx));
    in_threads(n, Duration::from_secs(90), move |mut comm| {
        comm.set_timeout(Duration::from_secs(1));
        let ordinal = comm.ordinal();
        if comm.rank() == 1 {
            let rx = done_rx.lock().unwrap_or_else(|e| e.into_inner());
            rx.recv_timeout(Duration::from_secs(60))
                .context("rank 0 never finished")?;
            return Ok(());
        }
        let len = 1031;
        let x = on_gpu(&data(seed, 0, len), DType::F32, ordinal)?;
        let all = on_gpu(&vec![f64::NAN; len * n], DType::F32, ordinal)?;
        let res = comm.all_gather(&x, &all);
        drop((x, all));
        // A round trip on the same GPU waits for its runtime stream, where the frees went.
        let fresh = data(seed ^ 0x5eed, 0, 4099);
        let back = on_gpu(&fresh, DType::F64, ordinal).and_then(|a| host(&a));
        done_tx.send(()).ok();
        let Err(err) = res else {
            bail!("an all-gather that rank 1 never joins returned Ok");
        };
        ensure!(
            matches!(err, Error::Timeout { .. }),
            "expected a timeout, got: {err}"
        );
        let back = back.context(
            "the GPU failed after the aborted collective's arrays were freed (a race with the \
             aborted kernel, or a use after free)",
        )?;
        ensure!(
            back == fresh,
            "the round trip after the abort changed the values"
        );
        Ok(())
    })
}

/// The child side of the process tests: a rank started with a torchrun-like environment.
fn child_rank() -> Result<()> {
    let seed: u64 = std::env::var("KVSTORE_TEST_SEED")?.parse()?;
    let before = std::env::var_os("NCCL_COMM_ID");
    let comm = RankComm::from_env()?;
    left_nothing_behind(before)?;
    check_collectives(&comm, seed, DType::F32, 1e-6)?;
    if std::env::var("KVSTORE_TEST_DIE_RANK").ok() == Some(comm.rank().to_string()) {
        // SIGKILL: no destructor, no exit hook, as an OOM kill or a crashed node.
        let me = std::process::id().to_string();
        std::process::Command::new("kill")
            .args(["-9", &me])
            .status()?;
        std::thread::sleep(Duration::from_secs(60));
        bail!("still alive after SIGKILL");
    }
    let x = on_gpu(&data(seed, comm.rank(), 64), DType::F32, comm.ordinal())?;
    let all = on_gpu(&vec![0.5; 64 * comm.size()], DType::F32, comm.ordinal())?;
    let started = Instant::now();
    match comm.all_gather(&x, &all).and_then(|()| comm.synchronize()) {
        Ok(()) => println!("CHILD OK rank {}", comm.rank()),
        Err(e) => {
            println!(
                "CHILD FAILED rank {} after {:?}: {e}",
                comm.rank(),
                started.elapsed()
            );
            std::process::exit(3);
        }
    }
    Ok(())
}

/// Checks, in a rank that has just joined, that joining changed nothing process-wide:
/// `NCCL_COMM_ID` is as it was before (`before`), and, when it was unset, a later
/// communicator of the process is not forced onto the job's address: two plain
/// `ncclGetUniqueId` calls give two different ids (with `NCCL_COMM_ID` set, NCCL, and the
/// stand-in, derive both from the address and a fixed magic, so they are equal).
fn left_nothing_behind(before: Option<std::ffi::OsString>) -> Result<()> {
    let now = std::env::var_os("NCCL_COMM_ID");
    ensure!(
        now == before,
        "joining changed NCCL_COMM_ID from {before:?} to {now:?}: the variable is process-wide \
         and forces every later NCCL communicator onto one address"
    );
    if before.is_none() {
        let (a, b) = (RankComm::unique_id()?, RankComm::unique_id()?);
        ensure!(
            a.0 != b.0,
            "two plain ncclGetUniqueId calls after joining gave the same id: later \
             communicators of this process are forced onto one address"
        );
    }
    Ok(())
}

/// Two free TCP ports in a row on 127.0.0.1: `MASTER_PORT`, and the rendezvous's after it.
fn free_port_pair() -> Result<u16> {
    for _ in 0..100 {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        if port < u16::MAX - 1 && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no two free ports in a row on 127.0.0.1")
}

/// Child processes of a test, killed if the test ends before they do.
struct Ranks(Vec<(std::process::Child, std::path::PathBuf)>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for (child, _) in &mut self.0 {
            if child.try_wait().ok().flatten().is_none() {
                child.kill().ok();
                child.wait().ok();
            }
        }
    }
}

/// Starts rank `r` of `n` of `test` in a child process, as torchrun would (`MASTER_PORT`
/// `port`, the run's `seed`, and `extra`), its output going to a file of its own.
fn spawn_rank(
    test: &str,
    r: usize,
    n: usize,
    port: u16,
    seed: u64,
    extra: &[(&str, String)],
) -> Result<(std::process::Child, std::path::PathBuf)> {
    let log = std::env::temp_dir().join(format!(
        "kvstore-nccl-rank-{}-{r}-{seed}-{}.log",
        std::process::id(),
        rand::random::<u32>()
    ));
    let out = std::fs::File::create(&log)?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args([
        test,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("KVSTORE_TEST_CHILD", "1")
    .env("KVSTORE_TEST_SEED", seed.to_string())
    .env("RANK", r.to_string())
    .env("WORLD_SIZE", n.to_string())
    .env("LOCAL_RANK", (r % gpu_count()).to_string())
    .env("MASTER_ADDR", "127.0.0.1")
    .env("MASTER_PORT", port.to_string())
    .env_remove("NCCL_COMM_ID")
    .env_remove("TORCHELASTIC_RUN_ID")
    .env_remove("KVSTORE_JOB_TOKEN")
    .stdout(out.try_clone()?)
    .stderr(out);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    Ok((cmd.spawn()?, log))
}

/// Waits for child `i` of `ranks` until `deadline`; its exit code (None: killed by a signal)
/// and output. A child still running at the deadline is a hang: an error with its output.
fn wait_rank(ranks: &mut Ranks, i: usize, deadline: Instant) -> Result<(Option<i32>, String)> {
    let (child, log) = &mut ranks.0[i];
    let code = loop {
        if let Some(status) = child.try_wait()? {
            break status.code();
        }
        if Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            let text = std::fs::read_to_string(&*log).unwrap_or_default();
            bail!("a rank was still running at the test's bound: a hang. Its output:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok((code, std::fs::read_to_string(&*log).unwrap_or_default()))
}

/// Starts `n` ranks of this test in child processes, as torchrun would, and returns each
/// one's exit code (None: killed by a signal) and output. Every child is killed after `limit`.
fn launch(
    test: &str,
    n: usize,
    extra: &[(&str, String)],
    limit: Duration,
) -> Result<Vec<(Option<i32>, String)>> {
    let port = free_port_pair()?;
    let seed: u64 = rand::random();
    let mut ranks = Ranks(Vec::new());
    for r in 0..n {
        ranks.0.push(spawn_rank(test, r, n, port, seed, extra)?);
    }
    let deadline = Instant::now() + limit;
    (0..n).map(|i| wait_rank(&mut ranks, i, deadline)).collect()
}

/// Why ranks in separate processes cannot run here, if they cannot. (The stand-in driver
/// spans processes through shared files, so it runs these too.)
fn cannot_spawn(n: usize) -> Option<String> {
    cannot_place(n)
}

#[test]
#[ignore = "needs a GPU"]
fn ranks_in_processes_launched_like_torchrun() -> Result<()> {
    if std::env::var_os("KVSTORE_TEST_CHILD").is_some() {
        return child_rank();
    }
    require_gpu();
    let n = 2;
    if let Some(why) = cannot_spawn(n) {
        skipped("ranks_in_processes_launched_like_torchrun", &why);
        return Ok(());
    }
    let results = launch(
        "ranks_in_processes_launched_like_torchrun",
        n,
        &[],
        Duration::from_secs(180),
    )?;
    for (r, (code, out)) in results.iter().enumerate() {
        ensure!(
            *code == Some(0) && out.contains(&format!("CHILD OK rank {r}")),
            "rank {r} exited with {code:?}:\n{out}"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn a_killed_rank_ends_the_others_with_an_error_not_a_hang() -> Result<()> {
    if std::env::var_os("KVSTORE_TEST_CHILD").is_some() {
        return child_rank();
    }
    require_gpu();
    let n = 2;
    if let Some(why) = cannot_spawn(n) {
        skipped(
            "a_killed_rank_ends_the_others_with_an_error_not_a_hang",
            &why,
        );
        return Ok(());
    }
    let extra = [
        ("KVSTORE_TEST_DIE_RANK", "1".to_owned()),
        ("KVSTORE_TIMEOUT", "5".to_owned()),
    ];
    let results = launch(
        "a_killed_rank_ends_the_others_with_an_error_not_a_hang",
        n,
        &extra,
        Duration::from_secs(120),
    )?;
    let (killed, _) = &results[1];
    ensure!(
        killed.is_none(),
        "rank 1 should have died by SIGKILL, exited {killed:?}"
    );
    let (code, out) = &results[0];
    ensure!(
        *code == Some(3) && out.contains("CHILD FAILED rank 0"),
        "rank 0 should fail with a clear error, exited {code:?}:\n{out}"
    );
    Ok(())
}

/// The child side of the intruder test: a process of another job (another token) that tries to
/// join rank 0's job as rank 1. It must be refused with an error naming the token's variable.
fn intruder() -> Result<()> {
    match RankComm::from_env() {
        Ok(_) => {
            println!("INTRUDER JOINED: a rank of another job was let into the communicator");
            std::process::exit(4);
        }
        Err(Error::DistEnv { var, message }) if var == "KVSTORE_JOB_TOKEN" => {
            println!("INTRUDER REFUSED: {var}: {message}");
            Ok(())
        }
        Err(e) => {
            println!("INTRUDER FAILED otherwise: {e:?}");
            std::process::exit(5);
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_rank_of_another_job_is_refused_and_the_job_still_forms() -> Result<()> {
    if std::env::var_os("KVSTORE_TEST_CHILD").is_some() {
        if std::env::var_os("KVSTORE_TEST_INTRUDER").is_some() {
            return intruder();
        }
        return child_rank();
    }
    require_gpu();
    let n = 2;
    if let Some(why) = cannot_spawn(n) {
        skipped(
            "a_rank_of_another_job_is_refused_and_the_job_still_forms",
            &why,
        );
        return Ok(());
    }
    let test = "a_rank_of_another_job_is_refused_and_the_job_still_forms";
    let port = free_port_pair()?;
    let seed: u64 = rand::random();
    let job = [
        (
            "KVSTORE_JOB_TOKEN",
            format!("job-{}", rand::random::<u64>()),
        ),
        ("KVSTORE_TIMEOUT", "90".to_owned()),
    ];
    let other = [
        (
            "KVSTORE_JOB_TOKEN",
            format!("other-{}", rand::random::<u64>()),
        ),
        ("KVSTORE_TIMEOUT", "90".to_owned()),
        ("KVSTORE_TEST_INTRUDER", "1".to_owned()),
    ];
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut ranks = Ranks(Vec::new());
    // Rank 0 first, then the intruder as rank 1 (it retries until rank 0 listens), and the
    // job's own rank 1 only once the intruder is done: it cannot have taken the place first.
    ranks.0.push(spawn_rank(test, 0, n, port, seed, &job)?);
    ranks.0.push(spawn_rank(test, 1, n, port, seed, &other)?);
    let (code, out) = wait_rank(&mut ranks, 1, deadline)?;
    ensure!(
        code == Some(0) && out.contains("INTRUDER REFUSED") && out.contains("another job"),
        "the rank of another job should be refused naming KVSTORE_JOB_TOKEN, exited \
         {code:?}:\n{out}"
    );
    ranks.0.push(spawn_rank(test, 1, n, port, seed, &job)?);
    for (i, r) in [(0, 0), (2, 1)] {
        let (code, out) = wait_rank(&mut ranks, i, deadline)?;
        ensure!(
            code == Some(0) && out.contains(&format!("CHILD OK rank {r}")),
            "rank {r} exited with {code:?}:\n{out}"
        );
    }
    Ok(())
}

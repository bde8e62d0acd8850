//! NCCL across processes: ranks in separate processes (each with its own stand-in state) form
//! one communicator through the clique's folder, move the data of their collectives, and are
//! as strict as ranks in one process. Each test starts its ranks as child processes of this
//! test binary (`XPROC_CASE` says what a child does), with `NCCL_COMM_ID` set as a launcher
//! without MPI sets it, and a folder of its own (`KVSTORE_STANDIN_SHM_DIR`).

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::process::Command;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use kvstore_stand_in_driver::driver::*;
use kvstore_stand_in_driver::nccl::*;

type H = *mut c_void;

const OK: i32 = 0;
const LAUNCH_FAILED: i32 = 719;
const LAUNCH_TIMEOUT: i32 = 702;
const NCCL_INVALID_USAGE: i32 = 5;
const NCCL_REMOTE_ERROR: i32 = 6;
const IN_PROGRESS: i32 = 7;
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

/// Values in [-1, 1) from `seed` (xorshift64*): each rank's data, which every process can
/// recompute, so a reference needs nothing from the stand-in.
fn data(seed: u64, rank: usize, n: usize) -> Vec<f32> {
    let mut x = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
            v as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Elements rank `a` sends rank `b` in the all-to-all-v (`[a][b]`), the same in every process:
/// unequal, 0 to 299, rank 0 sends nothing to rank 1 and the last rank nothing to rank 0, and
/// each rank sends itself a block.
fn p2p_counts(seed: u64, n: usize) -> Vec<Vec<usize>> {
    let mut counts: Vec<Vec<usize>> = (0..n)
        .map(|a| {
            let v = data(seed ^ 0x5eed, a, n);
            v.iter().map(|x| ((x + 1.0) * 150.0) as usize).collect()
        })
        .collect();
    counts[0][1] = 0;
    counts[n - 1][0] = 0;
    for (a, row) in counts.iter_mut().enumerate() {
        row[a] = row[a].max(1);
    }
    counts
}

fn env_usize(name: &str) -> usize {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is set for the children"))
        .parse()
        .unwrap()
}

/// One rank of the child side: its communicator (blocking), stream and context.
struct Rank {
    rank: usize,
    comm: H,
    s: H,
    /// Made with `blocking = 0` (`XPROC_NONBLOCKING=1`): calls answer ncclInProgress and are
    /// polled to completion.
    nonblocking: bool,
}

/// Polls a non-blocking communicator until its last call is done; the final state.
fn poll(comm: H) -> i32 {
    let start = Instant::now();
    loop {
        let mut state = -1;
        // SAFETY: a live communicator and a valid out-pointer.
        assert_eq!(unsafe { ncclCommGetAsyncError(comm, &mut state) }, OK);
        if state != IN_PROGRESS || start.elapsed() > Duration::from_secs(60) {
            return state;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Checks the result of an NCCL call that should succeed: `ncclSuccess` on a blocking
/// communicator; `ncclInProgress`, then polled to `ncclSuccess`, on a non-blocking one.
fn done(r: &Rank, code: i32) {
    if r.nonblocking {
        assert_eq!(code, IN_PROGRESS, "{}", last_error());
        assert_eq!(poll(r.comm), OK);
    } else {
        assert_eq!(code, OK, "{}", last_error());
    }
}

fn join_rank() -> Rank {
    let rank = env_usize("XPROC_RANK");
    let n = env_usize("XPROC_RANKS");
    let device = env_usize("XPROC_DEVICE");
    assert_eq!(cuInit(0), OK);
    let mut ctx = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { cuDevicePrimaryCtxRetain(&mut ctx, device as c_int) },
        OK
    );
    assert_eq!(cuCtxSetCurrent(ctx), OK);
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, OK);
    let mut comm = null_mut();
    let nonblocking = std::env::var("XPROC_NONBLOCKING").as_deref() == Ok("1");
    let r = if nonblocking {
        let mut cfg = ConfigHead {
            size: 48,
            magic: 0xcafe_beef,
            version: 21400,
            blocking: 0,
        };
        // SAFETY: a valid out-pointer and config; the id is the job's (from NCCL_COMM_ID).
        let r =
            unsafe { ncclCommInitRankConfig(&mut comm, n as c_int, id, rank as c_int, &mut cfg) };
        assert_eq!(r, IN_PROGRESS, "{}", last_error());
        poll(comm)
    } else {
        // SAFETY: a valid out-pointer; the id is the job's (from NCCL_COMM_ID).
        unsafe { ncclCommInitRank(&mut comm, n as c_int, id, rank as c_int) }
    };
    println!("XPROC INIT {r}");
    assert_eq!(r, OK, "{}", last_error());
    let mut s = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuStreamCreate(&mut s, 1) }, OK);
    Rank {
        rank,
        comm,
        s,
        nonblocking,
    }
}

fn upload(r: &Rank, v: &[f32]) -> u64 {
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemAllocAsync(&mut p, v.len() * 4, r.s) }, OK);
    // SAFETY: `v` holds the bytes given.
    let e = unsafe { cuMemcpyHtoDAsync_v2(p, v.as_ptr().cast(), v.len() * 4, r.s) };
    assert_eq!(e, OK);
    p
}

fn download(r: &Rank, p: u64, n: usize) -> (i32, Vec<f32>) {
    let mut out = vec![0f32; n];
    // SAFETY: `out` has room for the bytes asked for.
    let e = unsafe { cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), p, n * 4, r.s) };
    (e, out)
}

fn all_reduce(r: &Rank, send: u64, recv: u64, count: usize) -> i32 {
    ncclAllReduce(
        send as *const c_void,
        recv as *mut c_void,
        count,
        NCCL_FLOAT32,
        NCCL_SUM,
        r.comm,
        r.s,
    )
}

fn async_error(r: &Rank) -> i32 {
    let mut state = -1;
    // SAFETY: a live communicator and a valid out-pointer.
    assert_eq!(unsafe { ncclCommGetAsyncError(r.comm, &mut state) }, OK);
    state
}

/// What a child does, by `XPROC_CASE`.
fn child() {
    let case = std::env::var("XPROC_CASE").unwrap();
    let seed: u64 = std::env::var("XPROC_SEED").unwrap().parse().unwrap();
    let n = env_usize("XPROC_RANKS");
    let r = join_rank();
    let len = 1000;
    match case.as_str() {
        "collectives" => {
            // All-reduce, then a broadcast from the last rank and an all-gather, against sums
            // and copies of every rank's data computed here.
            let mine = data(seed, r.rank, len);
            let x = upload(&r, &mine);
            let y = upload(&r, &vec![f32::NAN; len]);
            done(&r, all_reduce(&r, x, y, len));
            let (e, got) = download(&r, y, len);
            assert_eq!(e, OK);
            for (i, g) in got.iter().enumerate() {
                // Summed in rank order, as the stand-in's reduction does.
                let want = (1..n).fold(data(seed, 0, len)[i], |a, q| a + data(seed, q, len)[i]);
                assert_eq!(*g, want, "all-reduce element {i}");
            }
            let root = n - 1;
            let b = upload(
                &r,
                &if r.rank == root {
                    mine.clone()
                } else {
                    vec![f32::NAN; len]
                },
            );
            let e = ncclBroadcast(
                b as *const c_void,
                b as *mut c_void,
                len,
                NCCL_FLOAT32,
                root as c_int,
                r.comm,
                r.s,
            );
            done(&r, e);
            assert_eq!(download(&r, b, len), (OK, data(seed, root, len)));
            let all = upload(&r, &vec![f32::NAN; len * n]);
            let e = ncclAllGather(
                x as *const c_void,
                all as *mut c_void,
                len,
                NCCL_FLOAT32,
                r.comm,
                r.s,
            );
            done(&r, e);
            let want: Vec<f32> = (0..n).flat_map(|q| data(seed, q, len)).collect();
            assert_eq!(download(&r, all, len * n), (OK, want));
            if r.nonblocking {
                done(&r, ncclCommFinalize(r.comm));
            }
            assert_eq!(ncclCommDestroy(r.comm), OK);
            println!("XPROC OK rank {}", r.rank);
        }
        "count_mismatch" => {
            // The last rank sends half the count.
            let count = if r.rank + 1 == n { len / 2 } else { len };
            let x = upload(&r, &data(seed, r.rank, len));
            // Issuing is accepted: the other process's part is not known yet.
            assert_eq!(all_reduce(&r, x, x, count), OK);
            assert_eq!(
                cuStreamSynchronize(r.s),
                LAUNCH_FAILED,
                "the sync reports it"
            );
            assert_eq!(
                async_error(&r),
                NCCL_INVALID_USAGE,
                "the communicator reports it"
            );
            println!("XPROC MISMATCH SEEN rank {}", r.rank);
        }
        "peer_dies" => {
            let x = upload(&r, &data(seed, r.rank, len));
            assert_eq!(all_reduce(&r, x, x, len), OK);
            assert_eq!(cuStreamSynchronize(r.s), OK);
            if r.rank == 1 {
                // SIGKILL: no destructor, no exit hook, as an OOM kill.
                let me = std::process::id().to_string();
                let _ = Command::new("kill").args(["-9", &me]).status();
                std::thread::sleep(Duration::from_secs(60));
                panic!("still alive after SIGKILL");
            }
            // Rank 0's next collective never gets rank 1's part.
            assert_eq!(all_reduce(&r, x, x, len), OK);
            let start = Instant::now();
            let state = loop {
                match async_error(&r) {
                    OK if start.elapsed() < Duration::from_secs(60) => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    state => break state,
                }
            };
            assert_eq!(
                state, NCCL_REMOTE_ERROR,
                "the communicator reports the dead peer"
            );
            // Abort ends this rank's part, so its stream drains instead of hanging.
            assert_eq!(ncclCommAbort(r.comm), OK);
            assert_eq!(cuStreamSynchronize(r.s), OK);
            println!("XPROC REMOTE ERROR SEEN rank {}", r.rank);
        }
        "peer_stalls" => {
            // The last rank joins, then never makes the collective: the others' wait on it
            // fails after KVSTORE_STANDIN_HANG_S instead of hanging.
            if r.rank + 1 == n {
                let done = std::path::Path::new(&std::env::var("XPROC_DONE").unwrap()).to_owned();
                let start = Instant::now();
                while !done.exists() && start.elapsed() < Duration::from_secs(60) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                assert!(done.exists(), "the other ranks never gave up");
                println!("XPROC STALLED rank {}", r.rank);
                return;
            }
            let x = upload(&r, &data(seed, r.rank, len));
            assert_eq!(all_reduce(&r, x, x, len), OK);
            assert_eq!(cuStreamSynchronize(r.s), LAUNCH_TIMEOUT);
            std::fs::write(std::env::var("XPROC_DONE").unwrap(), b"").unwrap();
            assert_eq!(ncclCommAbort(r.comm), OK);
            assert_eq!(cuStreamSynchronize(r.s), OK, "abort drains the stream");
            println!("XPROC TIMEOUT SEEN rank {}", r.rank);
        }
        "alltoallv" => {
            // Every rank sends counts[r][p] elements to each peer p (itself included) and
            // receives counts[p][r] from each, in one group, as kvstore's alltoallv does.
            let counts = p2p_counts(seed, n);
            let total: usize = counts[r.rank].iter().sum();
            let mine = data(seed, r.rank, total);
            let x = upload(&r, &mine);
            let got_len: usize = (0..n).map(|p| counts[p][r.rank]).sum();
            let y = upload(&r, &vec![f32::NAN; got_len]);
            let soff = |a: usize, b: usize| counts[a][..b].iter().sum::<usize>();
            let roff = |a: usize, b: usize| (0..a).map(|q| counts[q][b]).sum::<usize>();
            // Zero counts go with a null pointer, as NCCL allows.
            let at = |base: u64, elems: usize, count: usize| {
                if count == 0 {
                    0
                } else {
                    base + 4 * elems as u64
                }
            };
            assert_eq!(ncclGroupStart(), OK);
            for (p, &c) in counts[r.rank].iter().enumerate() {
                let cr = counts[p][r.rank];
                let out = at(x, soff(r.rank, p), c) as *const c_void;
                let e = ncclSend(out, c, NCCL_FLOAT32, p as c_int, r.comm, r.s);
                assert_eq!(e, OK, "{}", last_error());
                let into = at(y, roff(p, r.rank), cr) as *mut c_void;
                let e = ncclRecv(into, cr, NCCL_FLOAT32, p as c_int, r.comm, r.s);
                assert_eq!(e, OK, "{}", last_error());
            }
            done(&r, ncclGroupEnd());
            let (e, got) = download(&r, y, got_len);
            assert_eq!(e, OK);
            for p in 0..n {
                let theirs = data(seed, p, counts[p].iter().sum());
                for i in 0..counts[p][r.rank] {
                    let (g, w) = (got[roff(p, r.rank) + i], theirs[soff(p, r.rank) + i]);
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "rank {}, element {i} of its block from rank {p} (counts {counts:?})",
                        r.rank
                    );
                }
            }
            if r.nonblocking {
                done(&r, ncclCommFinalize(r.comm));
            }
            assert_eq!(ncclCommDestroy(r.comm), OK);
            println!("XPROC OK rank {} counts {counts:?}", r.rank);
        }
        "alltoallv_mismatch" => {
            // Rank 0 sends 5 elements to rank 1, which receives 4.
            let x = upload(&r, &data(seed, r.rank, 8));
            let (peer, send, recv) = match r.rank {
                0 => (1, 5, 0),
                _ => (0, 0, 4),
            };
            assert_eq!(ncclGroupStart(), OK);
            let e = ncclSend(x as *const c_void, send, NCCL_FLOAT32, peer, r.comm, r.s);
            assert_eq!(e, OK);
            let e = ncclRecv(x as *mut c_void, recv, NCCL_FLOAT32, peer, r.comm, r.s);
            assert_eq!(e, OK);
            // Issuing is accepted: the other process's part is not known yet.
            assert_eq!(ncclGroupEnd(), OK);
            assert_eq!(
                cuStreamSynchronize(r.s),
                LAUNCH_FAILED,
                "the sync reports it"
            );
            assert_eq!(
                async_error(&r),
                NCCL_INVALID_USAGE,
                "the communicator reports it"
            );
            println!("XPROC MISMATCH SEEN rank {}", r.rank);
        }
        "two_on_one_gpu" => {
            // Reached only when the communicator was made (the switch is on).
            println!("XPROC OK rank {}", r.rank);
        }
        other => panic!("unknown case {other}"),
    }
}

/// Runs `test` as one rank per entry of `devices` in child processes (rank `r` on device
/// `devices[r]`), with `extra` settings; each rank's exit code (None: a signal) and output. Children are killed after
/// 120 s (a hang fails the test).
fn ranks(test: &str, devices: &[usize], extra: &[(&str, &str)]) -> Vec<(Option<i32>, String)> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "kvstore-standin-xproc-{}-{seed}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let port = 1024 + seed % 60000;
    let mut children = Vec::new();
    let n = devices.len();
    for (r, device) in devices.iter().enumerate() {
        let log = dir.join(format!("rank-{r}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([test, "--exact", "--nocapture", "--test-threads", "1"])
            .env("XPROC_CHILD", "1")
            .env("XPROC_SEED", seed.to_string())
            .env("XPROC_RANK", r.to_string())
            .env("XPROC_RANKS", n.to_string())
            .env("XPROC_DEVICE", device.to_string())
            .env("NCCL_COMM_ID", format!("127.0.0.1:{port}"))
            .env("KVSTORE_STANDIN_SHM_DIR", dir.join("shm"))
            .env("XPROC_DONE", dir.join("done"))
            .env("KVSTORE_STANDIN_HANG_S", "30")
            .env("KVSTORE_STANDIN_GPUS", "2")
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        for (k, v) in extra {
            cmd.env(k, v);
        }
        children.push((cmd.spawn().unwrap(), log));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut results = Vec::new();
    for (mut child, log) in children {
        let code = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.code();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "a rank still ran after 120 s (a hang):\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        results.push((code, std::fs::read_to_string(&log).unwrap_or_default()));
    }
    // Every clique's folder is gone: ended communicators, exits and dead peers clean up.
    let left: Vec<_> = std::fs::read_dir(dir.join("shm"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{test}: folders left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
    results
}

fn is_child() -> bool {
    std::env::var_os("XPROC_CHILD").is_some()
}

#[test]
fn collectives_across_processes_match_a_host_reference() {
    if is_child() {
        return child();
    }
    for (n, nonblocking) in [(2, "0"), (3, "0"), (2, "1")] {
        let devices: Vec<usize> = (0..n).map(|r| r % 2).collect();
        let out = ranks(
            "collectives_across_processes_match_a_host_reference",
            &devices,
            &[
                ("XPROC_CASE", "collectives"),
                ("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
                ("XPROC_NONBLOCKING", nonblocking),
            ],
        );
        for (r, (code, text)) in out.iter().enumerate() {
            assert!(
                *code == Some(0) && text.contains(&format!("XPROC OK rank {r}")),
                "{n} ranks (non-blocking: {nonblocking}), rank {r} exited {code:?}:\n{text}"
            );
        }
    }
}

#[test]
fn a_count_mismatch_across_processes_is_rejected() {
    if is_child() {
        return child();
    }
    let out = ranks(
        "a_count_mismatch_across_processes_is_rejected",
        &[0, 1],
        &[("XPROC_CASE", "count_mismatch")],
    );
    for (r, (code, text)) in out.iter().enumerate() {
        assert!(
            *code == Some(0) && text.contains(&format!("XPROC MISMATCH SEEN rank {r}")),
            "rank {r} exited {code:?}:\n{text}"
        );
        assert!(
            text.contains("[kvstore stand-in]")
                && (text.contains("the count (500 vs 1000)")
                    || text.contains("the count (1000 vs 500)")),
            "rank {r} names the mismatch:\n{text}"
        );
    }
}

#[test]
fn a_peer_process_that_dies_is_an_error_not_a_hang() {
    if is_child() {
        return child();
    }
    let out = ranks(
        "a_peer_process_that_dies_is_an_error_not_a_hang",
        &[0, 1],
        &[("XPROC_CASE", "peer_dies")],
    );
    assert_eq!(out[1].0, None, "rank 1 died by SIGKILL:\n{}", out[1].1);
    let (code, text) = &out[0];
    assert!(
        *code == Some(0) && text.contains("XPROC REMOTE ERROR SEEN rank 0"),
        "rank 0 exited {code:?}:\n{text}"
    );
    assert!(
        text.contains("[kvstore stand-in]") && text.contains("exited before its part arrived"),
        "rank 0 says which rank is gone:\n{text}"
    );
}

#[test]
fn two_processes_on_one_gpu_need_nccl_2_30_and_the_switch() {
    if is_child() {
        return child();
    }
    let test = "two_processes_on_one_gpu_need_nccl_2_30_and_the_switch";
    let case = ("XPROC_CASE", "two_on_one_gpu");
    for (version, switch, made) in [
        ("23007", "1", true),
        ("23007", "0", false),
        ("22900", "1", false),
    ] {
        let out = ranks(
            test,
            &[0, 0],
            &[
                case,
                ("KVSTORE_STANDIN_NCCL_VERSION", version),
                ("NCCL_MULTI_RANK_GPU_ENABLE", switch),
            ],
        );
        for (r, (code, text)) in out.iter().enumerate() {
            if made {
                assert!(
                    *code == Some(0) && text.contains(&format!("XPROC OK rank {r}")),
                    "NCCL {version}, switch {switch}: rank {r} exited {code:?}:\n{text}"
                );
            } else {
                assert!(
                    *code != Some(0)
                        && text.contains(&format!("XPROC INIT {NCCL_INVALID_USAGE}"))
                        && text.contains("Duplicate GPU detected"),
                    "NCCL {version}, switch {switch}: rank {r} exited {code:?}:\n{text}"
                );
            }
        }
    }
}

#[test]
fn a_rank_that_never_joins_is_an_error_after_the_hang_bound() {
    if is_child() {
        return child();
    }
    // One process of a two-rank job: rank 1 never comes.
    let out = ranks(
        "a_rank_that_never_joins_is_an_error_after_the_hang_bound",
        &[0],
        &[
            ("XPROC_CASE", "two_on_one_gpu"),
            ("XPROC_RANKS", "2"),
            ("KVSTORE_STANDIN_HANG_S", "2"),
        ],
    );
    let (code, text) = &out[0];
    assert!(
        *code != Some(0)
            && text.contains(&format!("XPROC INIT {NCCL_INVALID_USAGE}"))
            && text.contains("[kvstore stand-in] ncclCommInitRank (rank 0 of 2")
            && text.contains("cannot finish"),
        "rank 0 exited {code:?}:\n{text}"
    );
}

#[test]
fn a_peer_that_stops_calling_is_an_error_after_the_hang_bound() {
    if is_child() {
        return child();
    }
    let out = ranks(
        "a_peer_that_stops_calling_is_an_error_after_the_hang_bound",
        &[0, 1],
        &[
            ("XPROC_CASE", "peer_stalls"),
            ("KVSTORE_STANDIN_HANG_S", "2"),
        ],
    );
    let (code, text) = &out[0];
    assert!(
        *code == Some(0)
            && text.contains("XPROC TIMEOUT SEEN rank 0")
            && text.contains("[kvstore stand-in] cuStreamSynchronize")
            && text.contains("cannot finish"),
        "rank 0 exited {code:?}:\n{text}"
    );
    assert!(
        out[1].0 == Some(0) && out[1].1.contains("XPROC STALLED rank 1"),
        "rank 1 exited {:?}:\n{}",
        out[1].0,
        out[1].1
    );
}

#[test]
fn an_all_to_all_v_across_processes_matches_a_host_reference() {
    if is_child() {
        return child();
    }
    for (n, nonblocking) in [(2, "0"), (3, "0"), (3, "1")] {
        let devices: Vec<usize> = (0..n).map(|r| r % 2).collect();
        let out = ranks(
            "an_all_to_all_v_across_processes_matches_a_host_reference",
            &devices,
            &[
                ("XPROC_CASE", "alltoallv"),
                ("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
                ("XPROC_NONBLOCKING", nonblocking),
            ],
        );
        for (r, (code, text)) in out.iter().enumerate() {
            assert!(
                *code == Some(0) && text.contains(&format!("XPROC OK rank {r}")),
                "{n} ranks (non-blocking: {nonblocking}), rank {r} exited {code:?}:\n{text}"
            );
        }
    }
}

#[test]
fn a_send_count_that_differs_from_the_receive_across_processes_is_rejected() {
    if is_child() {
        return child();
    }
    let out = ranks(
        "a_send_count_that_differs_from_the_receive_across_processes_is_rejected",
        &[0, 1],
        &[("XPROC_CASE", "alltoallv_mismatch")],
    );
    for (r, (code, text)) in out.iter().enumerate() {
        assert!(
            *code == Some(0) && text.contains(&format!("XPROC MISMATCH SEEN rank {r}")),
            "rank {r} exited {code:?}:\n{text}"
        );
        assert!(
            text.contains("[kvstore stand-in]")
                && text.contains("rank 0 sends 5 elements to rank 1")
                && text.contains("rank 1 receives 4 elements from rank 0"),
            "rank {r} names the mismatch:\n{text}"
        );
    }
}

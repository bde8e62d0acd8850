//! NCCL point-to-point (`ncclSend` / `ncclRecv`) in one process: an all-to-all with per-pair
//! counts (alltoallv), as kvstore issues it, moves exactly each sender's block to its receiver,
//! and what does not match is refused. The calls go straight to the exported functions, as
//! kvstore's loader would make them.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use kvstore_stand_in_driver::driver::*;
use kvstore_stand_in_driver::nccl::*;

type H = *mut c_void;

const OK: i32 = 0;
const NCCL_INVALID_ARGUMENT: i32 = 4;
const NCCL_INVALID_USAGE: i32 = 5;
const NCCL_FLOAT32: c_int = 7;
const NCCL_BFLOAT16: c_int = 9;

/// Initializes the driver and returns the primary contexts of devices `0..n`, with device 0's
/// current on this thread.
fn setup(n: usize) -> Vec<H> {
    assert_eq!(cuInit(0), OK);
    let ctx: Vec<H> = (0..n)
        .map(|d| {
            let mut c = null_mut();
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { cuDevicePrimaryCtxRetain(&mut c, d as c_int) }, OK);
            c
        })
        .collect();
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    ctx
}

fn stream() -> H {
    let mut s = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuStreamCreate(&mut s, 1) }, OK);
    s
}

fn alloc(bytes: usize, s: H) -> u64 {
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemAllocAsync(&mut p, bytes.max(1), s) }, OK);
    p
}

fn upload(dst: u64, data: &[u8], s: H) {
    // SAFETY: `data` holds the bytes given.
    let r = unsafe { cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), s) };
    assert_eq!(r, OK);
}

fn download(src: u64, n: usize, s: H) -> (i32, Vec<u8>) {
    let mut out = vec![0u8; n];
    // SAFETY: `out` has room for the bytes asked for.
    let r = unsafe { cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, n, s) };
    (r, out)
}

/// Random bytes (xorshift64*), from a seed taken from the clock: different data every run.
fn random_bytes(seed: &mut u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| {
            *seed ^= *seed >> 12;
            *seed ^= *seed << 25;
            *seed ^= *seed >> 27;
            (seed.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

fn clock_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    t | 1
}

fn send(buf: u64, count: usize, dtype: c_int, peer: usize, comm: H, s: H) -> i32 {
    ncclSend(buf as *const c_void, count, dtype, peer as c_int, comm, s)
}

fn recv(buf: u64, count: usize, dtype: c_int, peer: usize, comm: H, s: H) -> i32 {
    ncclRecv(buf as *mut c_void, count, dtype, peer as c_int, comm, s)
}

/// Runs the test `name` in a child process of its own (this test binary, filtered to it),
/// with `env` in its environment (the stand-in reads its settings once per process), and
/// returns false; in that child, returns true, and the caller runs the test's body.
fn in_own_process_with(name: &str, env: &[(&str, &str)]) -> bool {
    const CHILD: &str = "KVSTORE_STANDIN_P2P_CHILD";
    if std::env::var(CHILD).is_ok_and(|t| t == name) {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD, name)
        .envs(env.iter().copied())
        .output()
        .expect("the test binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name}, in a process of its own:\n{text}"
    );
    false
}

/// `counts[a][b]` elements of `es` bytes from rank `a` to rank `b`: every rank's sends and
/// receives in one group, issued by this one thread, as kvstore's alltoallv issues them
/// (zero counts with a null pointer). Returns each rank's received bytes, and checks them
/// against the host's reference: rank `b`'s block from `a` is exactly `a`'s block for `b`.
// Ranks index the counts both ways (`[r][p]` and `[p][r]`): plain index loops read best.
#[allow(clippy::needless_range_loop)]
fn all_to_all_v(
    ctx: &[H],
    comms: &[H],
    counts: &[Vec<usize>],
    es: usize,
    dtype: c_int,
    seed: &mut u64,
) {
    let n = comms.len();
    let mut streams = Vec::new();
    let (mut sbufs, mut rbufs, mut sent) = (Vec::new(), Vec::new(), Vec::new());
    // Per rank, the receive buffer holds its blocks plus 4 elements that nobody writes.
    let recv_len = |b: usize| ((0..n).map(|a| counts[a][b]).sum::<usize>() + 4) * es;
    for r in 0..n {
        assert_eq!(cuCtxSetCurrent(ctx[r]), OK);
        let s = stream();
        let total: usize = counts[r].iter().sum();
        let data = random_bytes(seed, total * es);
        let sb = alloc(total * es, s);
        upload(sb, &data, s);
        let rb = alloc(recv_len(r), s);
        streams.push(s);
        sbufs.push(sb);
        rbufs.push(rb);
        sent.push(data);
    }
    // Offsets, in elements: of a's block for b in a's send buffer; of b's block from a in
    // b's receive buffer.
    let soff = |a: usize, b: usize| counts[a][..b].iter().sum::<usize>();
    let roff = |a: usize, b: usize| (0..a).map(|q| counts[q][b]).sum::<usize>();
    let at = |base: u64, elems: usize, count: usize| {
        if count == 0 {
            0
        } else {
            base + (elems * es) as u64
        }
    };
    assert_eq!(ncclGroupStart(), OK);
    for r in 0..n {
        for p in 0..n {
            let (c, s) = (comms[r], streams[r]);
            let out = at(sbufs[r], soff(r, p), counts[r][p]);
            assert_eq!(
                send(out, counts[r][p], dtype, p, c, s),
                OK,
                "{}",
                last_error()
            );
            let into = at(rbufs[r], roff(p, r), counts[p][r]);
            assert_eq!(
                recv(into, counts[p][r], dtype, p, c, s),
                OK,
                "{}",
                last_error()
            );
        }
    }
    assert_eq!(ncclGroupEnd(), OK, "{}", last_error());
    for b in 0..n {
        assert_eq!(cuCtxSetCurrent(ctx[b]), OK);
        let (e, got) = download(rbufs[b], recv_len(b), streams[b]);
        assert_eq!(e, OK);
        for a in 0..n {
            for i in 0..counts[a][b] {
                let g = &got[(roff(a, b) + i) * es..][..es];
                let w = &sent[a][(soff(a, b) + i) * es..][..es];
                assert_eq!(
                    g, w,
                    "rank {b}, element {i} of its block from rank {a} (dtype {dtype})"
                );
            }
        }
        let tail = &got[recv_len(b) - 4 * es..];
        assert!(
            tail.iter().all(|&x| x == 0xff),
            "rank {b}: bytes past its blocks were written: {tail:?}"
        );
    }
}

/// Three ranks on three devices, one thread, one group: an all-to-all-v with unequal counts,
/// zero counts (rank 0 sends nothing to rank 1, rank 1 nothing to rank 2) and self blocks, in
/// f32 and in bf16, with data random per run, against the host's reference.
#[test]
fn an_all_to_all_v_in_one_group_matches_a_host_reference() {
    let name = "an_all_to_all_v_in_one_group_matches_a_host_reference";
    if !in_own_process_with(name, &[("KVSTORE_STANDIN_GPUS", "3")]) {
        return;
    }
    let ctx = setup(3);
    let mut comms = vec![null_mut(); 3];
    // SAFETY: room for three handles; a null device list means devices 0, 1 and 2.
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), 3, std::ptr::null()) },
        OK
    );
    let mut seed = clock_seed();
    println!("seed {seed}");
    let counts = vec![vec![37, 0, 5], vec![3, 11, 0], vec![64, 1, 20]];
    all_to_all_v(&ctx, &comms, &counts, 4, NCCL_FLOAT32, &mut seed);
    all_to_all_v(&ctx, &comms, &counts, 2, NCCL_BFLOAT16, &mut seed);
    // Random counts (0 to 9 each), on the same communicators.
    let counts: Vec<Vec<usize>> = (0..3)
        .map(|_| {
            random_bytes(&mut seed, 3)
                .iter()
                .map(|&b| b as usize % 10)
                .collect()
        })
        .collect();
    println!("counts {counts:?}");
    all_to_all_v(&ctx, &comms, &counts, 4, NCCL_FLOAT32, &mut seed);
    for c in comms {
        assert_eq!(ncclCommDestroy(c), OK);
    }
}

/// Two ranks (gpu 0 and gpu 1) of one clique, a stream each.
fn two_ranks(ctx: &[H]) -> ([H; 2], [H; 2]) {
    let mut comms = [null_mut(); 2];
    // SAFETY: room for two handles; a null device list means devices 0 and 1.
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) },
        OK
    );
    let mut streams = [null_mut(); 2];
    for d in 0..2 {
        assert_eq!(cuCtxSetCurrent(ctx[d]), OK);
        streams[d] = stream();
    }
    (comms, streams)
}

/// Rank 0 sends 5 elements to rank 1, which receives 4: refused when the group issues it, the
/// communicators report it, and nothing is copied.
#[test]
fn a_send_whose_count_differs_from_the_receive_is_refused() {
    let ctx = setup(2);
    let (comms, streams) = two_ranks(&ctx);
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    let x = alloc(64, streams[0]);
    upload(x, &[7; 64], streams[0]);
    assert_eq!(cuCtxSetCurrent(ctx[1]), OK);
    let y = alloc(64, streams[1]);
    upload(y, &[1; 64], streams[1]);
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(send(x, 5, NCCL_FLOAT32, 1, comms[0], streams[0]), OK);
    assert_eq!(recv(y, 4, NCCL_FLOAT32, 0, comms[1], streams[1]), OK);
    assert_eq!(ncclGroupEnd(), NCCL_INVALID_USAGE);
    let message = last_error();
    assert!(
        message.contains("rank 0 sends 5 elements to rank 1")
            && message.contains("rank 1 receives 4 elements from rank 0"),
        "{message}"
    );
    for c in comms {
        let mut state = -1;
        // SAFETY: a live communicator and a valid out-pointer.
        assert_eq!(unsafe { ncclCommGetAsyncError(c, &mut state) }, OK);
        assert_eq!(state, NCCL_INVALID_USAGE, "the communicator reports it");
    }
    // The cancelled parts end without moving data.
    assert_eq!(download(y, 64, streams[1]), (OK, vec![1; 64]));
}

/// Inside one group, a rank names each peer at most once per direction: a second send to the
/// same peer (or receive from it) is refused, and the group's other calls go on. A peer out of
/// range is an invalid argument; the rank itself is a valid peer.
#[test]
fn a_second_send_to_the_same_peer_in_one_group_is_refused() {
    let ctx = setup(2);
    let (comms, streams) = two_ranks(&ctx);
    let mut bufs = [0; 2];
    for r in 0..2 {
        assert_eq!(cuCtxSetCurrent(ctx[r]), OK);
        bufs[r] = alloc(64, streams[r]);
        upload(bufs[r], &[r as u8 + 1; 32], streams[r]);
    }
    let (dt, (c0, c1), (s0, s1)) = (NCCL_FLOAT32, (comms[0], comms[1]), (streams[0], streams[1]));
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(send(bufs[0], 4, dt, 1, c0, s0), OK);
    assert_eq!(send(bufs[0], 4, dt, 1, c0, s0), NCCL_INVALID_USAGE);
    assert!(
        last_error().contains("a second send to peer 1"),
        "{}",
        last_error()
    );
    assert_eq!(recv(bufs[1] + 32, 4, dt, 0, c1, s1), OK);
    assert_eq!(recv(bufs[1] + 32, 4, dt, 0, c1, s1), NCCL_INVALID_USAGE);
    assert!(
        last_error().contains("a second receive from peer 0"),
        "{}",
        last_error()
    );
    assert_eq!(send(bufs[0], 4, dt, 2, c0, s0), NCCL_INVALID_ARGUMENT);
    let r = ncclRecv(bufs[0] as *mut c_void, 4, dt, -1, c0, s0);
    assert_eq!(r, NCCL_INVALID_ARGUMENT);
    // Rank 1 to itself: a copy within its memory.
    assert_eq!(send(bufs[1], 2, dt, 1, c1, s1), OK);
    assert_eq!(recv(bufs[1] + 48, 2, dt, 1, c1, s1), OK);
    assert_eq!(ncclGroupEnd(), OK, "{}", last_error());
    let mut want = vec![2u8; 32];
    want.extend([1; 16]);
    want.extend([2; 8]);
    want.extend([0xff; 8]);
    assert_eq!(download(bufs[1], 64, streams[1]), (OK, want));
}

/// Outside a group each call is a part of its own: one thread driving both ranks of one
/// exchange needs a group (real NCCL may block in the first call), and every rank issues its
/// point-to-point part at the same position as a collective.
#[test]
fn point_to_point_outside_a_group_and_among_collectives_is_matched_by_issue_order() {
    let ctx = setup(2);
    let (comms, streams) = two_ranks(&ctx);
    let mut bufs = [0; 2];
    for r in 0..2 {
        assert_eq!(cuCtxSetCurrent(ctx[r]), OK);
        bufs[r] = alloc(64, streams[r]);
        upload(bufs[r], &[r as u8 + 3; 64], streams[r]);
    }
    // One part per call: rank 1's receive, from the thread that issued rank 0's send, is the
    // same collective issued by one thread outside a group.
    assert_eq!(send(bufs[0], 4, NCCL_FLOAT32, 1, comms[0], streams[0]), OK);
    assert_eq!(
        recv(bufs[1], 4, NCCL_FLOAT32, 0, comms[1], streams[1]),
        NCCL_INVALID_USAGE
    );
    assert_eq!(ncclCommAbort(comms[0]), OK);
    assert_eq!(ncclCommAbort(comms[1]), OK);
    // A rank that all-reduces where the other sends: the kinds differ.
    let (comms, streams) = two_ranks(&ctx);
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(send(bufs[0], 4, NCCL_FLOAT32, 1, comms[0], streams[0]), OK);
    let r = ncclAllReduce(
        bufs[1] as *const c_void,
        bufs[1] as *mut c_void,
        4,
        NCCL_FLOAT32,
        0,
        comms[1],
        streams[1],
    );
    assert_eq!(r, OK);
    assert_eq!(ncclGroupEnd(), NCCL_INVALID_USAGE);
    assert!(last_error().contains("the kind"), "{}", last_error());
}

/// The race checker's view of an exchange: a rank that receives bytes is ordered after the
/// ranks that send them (and only those), the bytes a rank sends are reads of its stream, and
/// the bytes it receives are writes of its stream.
#[test]
fn received_bytes_are_writes_sent_bytes_reads_and_receivers_follow_their_senders() {
    const RACE: i32 = 401; // CUDA_ERROR_ILLEGAL_STATE, as the stand-in reports a race
    let ctx = setup(2);
    let (comms, [s0, s1]) = two_ranks(&ctx);
    let (c0, c1, dt) = (comms[0], comms[1], NCCL_FLOAT32);
    let peer_copy = |dst: u64, src: u64, s: H| {
        // SAFETY: 16 live bytes on both sides, on the devices of the contexts given.
        unsafe { cuMemcpyPeerAsync(dst, ctx[1], src, ctx[0], 16, s) }
    };
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    let x = alloc(16, s0);
    upload(x, &[5; 16], s0);
    assert_eq!(cuCtxSetCurrent(ctx[1]), OK);
    let (y, z) = (alloc(16, s1), alloc(16, s1));
    assert_eq!(cuStreamSynchronize(s1), OK);
    // Rank 1 receives nothing from rank 0: its stream is not ordered after rank 0's, so a
    // copy of rank 0's freshly written buffer on it races with that write.
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(send(0, 0, dt, 1, c0, s0), OK);
    assert_eq!(recv(0, 0, dt, 0, c1, s1), OK);
    assert_eq!(ncclGroupEnd(), OK);
    assert_eq!(peer_copy(z, x, s1), OK);
    assert_eq!(cuStreamSynchronize(s1), RACE, "no bytes received, no order");
    // Receiving rank 0's bytes orders rank 1's stream after rank 0's write.
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    let x2 = alloc(16, s0);
    upload(x2, &[6; 16], s0);
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(send(x2, 4, dt, 1, c0, s0), OK);
    assert_eq!(recv(y, 4, dt, 0, c1, s1), OK);
    assert_eq!(ncclGroupEnd(), OK);
    assert_eq!(peer_copy(z, x2, s1), OK);
    assert_eq!(cuStreamSynchronize(s1), OK, "ordered by the bytes received");
    assert_eq!(download(y, 16, s1), (OK, vec![6; 16]));
    assert_eq!(cuStreamSynchronize(s0), OK);

    // The receive is a write: a read of the same bytes on another stream of rank 1, with
    // nothing ordering the two, races with it (whichever runs first).
    assert_eq!(cuCtxSetCurrent(ctx[1]), OK);
    let s1b = stream();
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(send(x2, 4, dt, 1, c0, s0), OK);
    assert_eq!(recv(y, 4, dt, 0, c1, s1), OK);
    assert_eq!(ncclGroupEnd(), OK);
    let codes = [
        download(y, 16, s1b).0,
        cuStreamSynchronize(s1),
        cuStreamSynchronize(s0),
    ];
    assert!(
        codes.contains(&RACE),
        "an unordered read of received bytes: {codes:?}"
    );

    // The send is a read: a write of the same bytes on another stream of rank 0 races with it.
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    let s0b = stream();
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(send(x2, 4, dt, 1, c0, s0), OK);
    assert_eq!(recv(y, 4, dt, 0, c1, s1), OK);
    assert_eq!(ncclGroupEnd(), OK);
    upload(x2, &[7; 16], s0b);
    let codes = [
        cuStreamSynchronize(s0b),
        cuStreamSynchronize(s0),
        cuStreamSynchronize(s1),
    ];
    assert!(
        codes.contains(&RACE),
        "an unordered write of sent bytes: {codes:?}"
    );
}

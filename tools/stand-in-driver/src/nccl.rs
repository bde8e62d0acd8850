//! The NCCL API subset kvstore calls (through its own loader, `nccl::loader`),
//! exported under NCCL's names, over the same state as the driver half.
//!
//! Communicators belong to cliques (one per unique id, or per `ncclCommInitAll`). Collectives
//! are matched across a clique's ranks by issue order (the k-th call of every rank is one
//! collective); a collective is checked when its last part is issued and runs when every part
//! is at the front of its stream. Calls between `ncclGroupStart` and `ncclGroupEnd` are kept
//! per thread and issued, in order, by the outermost `ncclGroupEnd`.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::MutexGuard;

use crate::state::{
    self, handle, lock, nc, nccl_elem_size, notify, report, unhandle, Clique, Coll, CollKind, Comm,
    Kind, Part, Peers, State, Work,
};

type Handle = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

/// The first bytes of every id the stand-in makes.
const MAGIC: &[u8; 16] = b"kvstore-standin\0";

/// A call deferred by a group.
enum Deferred {
    Init {
        out: *mut Handle,
        nranks: usize,
        id: [u8; 128],
        rank: usize,
        device: usize,
        nonblocking: bool,
    },
    Coll {
        comm: usize,
        part: Part,
    },
}

thread_local! {
    static GROUP: RefCell<(usize, Vec<Deferred>)> = const { RefCell::new((0, Vec::new())) };
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Reports a rejected call, keeps its text for `ncclGetLastError`, and returns `code`.
fn reject(code: i32, message: String) -> i32 {
    report(&message);
    LAST_ERROR.with(|l| *l.borrow_mut() = CString::new(message).unwrap_or_default());
    code
}

fn run(body: impl FnOnce() -> Result<(), i32>) -> i32 {
    match body() {
        Ok(()) => nc::SUCCESS,
        Err(code) => code,
    }
}

fn comm_of(st: &State, h: Handle, call: &str) -> Result<usize, i32> {
    match unhandle(Kind::Comm, h) {
        Some(c) if c < st.comms.len() && st.comms[c].live => Ok(c),
        Some(c) if c < st.comms.len() => Err(reject(
            nc::INVALID_ARGUMENT,
            format!("{call}: the communicator was aborted or destroyed"),
        )),
        _ => Err(reject(
            nc::INVALID_ARGUMENT,
            format!("{call}: not a communicator"),
        )),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> i32 {
    crate::calls::count("ncclGetVersion");
    if version.is_null() {
        return nc::INVALID_ARGUMENT;
    }
    let v = lock().cfg.nccl_version;
    // SAFETY: non-null out-pointer, per the API.
    unsafe { version.write(v) };
    nc::SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> i32 {
    crate::calls::count("ncclGetUniqueId");
    if id.is_null() {
        return nc::INVALID_ARGUMENT;
    }
    let mut bytes = [0u8; 128];
    bytes[..16].copy_from_slice(MAGIC);
    if let Some(addr) = std::env::var_os("NCCL_COMM_ID") {
        // As NCCL's `bootstrapGetUniqueId` (src/bootstrap.cc): with NCCL_COMM_ID set, the id
        // is that address and a fixed magic, so every process of a job computes the same id
        // by itself (no socket is opened here).
        let addr = addr.to_string_lossy().into_owned();
        let valid = addr
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !valid || addr.len() > 128 - 32 {
            return reject(
                nc::INVALID_ARGUMENT,
                format!(
                    "ncclGetUniqueId: NCCL_COMM_ID={addr} is not <host>:<port> (as NCCL says: \
                     Invalid NCCL_COMM_ID, please use format: <ipv4>:<port> or [<ipv6>]:<port> \
                     or <hostname>:<port>)"
                ),
            );
        }
        bytes[16..24].copy_from_slice(b"commid:\0");
        bytes[32..32 + addr.len()].copy_from_slice(addr.as_bytes());
    } else {
        // Unique per process (the pid) and per call (the counter).
        let mut st = lock();
        let n = st.next_unique_id;
        st.next_unique_id += 1;
        bytes[16..24].copy_from_slice(&n.to_le_bytes());
        bytes[24..28].copy_from_slice(&std::process::id().to_le_bytes());
    }
    let mut out = UniqueId { internal: [0; 128] };
    for (o, b) in out.internal.iter_mut().zip(bytes) {
        *o = b as c_char;
    }
    // SAFETY: non-null out-pointer, per the API.
    unsafe { id.write(out) };
    nc::SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(code: c_int) -> *const c_char {
    crate::calls::count("ncclGetErrorString");
    match code {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        8 => c"timeout",
        _ => c"unknown result code",
    }
    .as_ptr()
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: Handle) -> *const c_char {
    crate::calls::count("ncclGetLastError");
    // The pointer stays valid until this thread's next rejected call (as NCCL's does).
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Adds rank `rank` (on `device`) to the clique of `id`, creating it; returns the comm index.
/// With `shm` (`ncclCommInitRank`), the rank is also registered in the clique's folder, where
/// ranks of other processes find it (see `xproc`).
fn join(
    st: &mut State,
    id: [u8; 128],
    nranks: usize,
    rank: usize,
    device: usize,
    shm: bool,
) -> Result<usize, i32> {
    let call = "ncclCommInitRank";
    if &id[..16] != MAGIC {
        return Err(reject(
            nc::INVALID_ARGUMENT,
            format!("{call}: the unique id was not made by ncclGetUniqueId"),
        ));
    }
    if nranks == 0 || rank >= nranks {
        return Err(reject(
            nc::INVALID_ARGUMENT,
            format!("{call}: rank {rank} of {nranks}"),
        ));
    }
    // A clique whose communicators have ended is over: the same id starts a new one.
    let k = match st
        .cliques
        .iter()
        .position(|c| c.id == id && c.comms.iter().flatten().all(|&x| st.comms[x].live))
    {
        Some(k) => k,
        None => {
            st.cliques.push(Clique {
                id,
                nranks,
                comms: vec![None; nranks],
                devices: vec![None; nranks],
                next_seq: vec![0; nranks],
                ready: None,
                shm: shm.then(|| crate::xproc::dir_for(&id)),
                remote: vec![None; nranks],
                broken: false,
                left: false,
                met: None,
            });
            st.cliques.len() - 1
        }
    };
    let c = &st.cliques[k];
    if c.nranks != nranks {
        return Err(reject(
            nc::INVALID_ARGUMENT,
            format!(
                "{call}: rank {rank} says {nranks} ranks, an earlier rank said {}",
                c.nranks
            ),
        ));
    }
    if c.comms[rank].is_some() {
        return Err(reject(
            nc::INVALID_ARGUMENT,
            format!("{call}: rank {rank} joined twice"),
        ));
    }
    if let Some(dir) = &st.cliques[k].shm {
        crate::xproc::register(dir, rank, nranks, device)
            .map_err(|m| reject(nc::SYSTEM_ERROR, format!("{call}: {m}")))?;
        state::leave_folders_at_exit();
    }
    st.comms.push(Comm {
        clique: k,
        rank,
        device,
        live: true,
        async_error: nc::SUCCESS,
        nonblocking: false,
        busy: 0,
        created: false,
    });
    let comm = st.comms.len() - 1;
    let c = &mut st.cliques[k];
    c.comms[rank] = Some(comm);
    c.devices[rank] = Some(device);
    st.try_complete(k);
    Ok(comm)
}

/// Waits until the clique of `comm` is complete; its result.
fn wait_clique(st: MutexGuard<'static, State>, comm: usize) -> (MutexGuard<'static, State>, i32) {
    let k = st.comms[comm].clique;
    let (rank, n) = (st.comms[comm].rank, st.cliques[k].nranks);
    let (st, ok) = state::wait_until(
        st,
        &[],
        &|| {
            format!(
                "ncclCommInitRank (rank {rank} of {n}, waiting for the other ranks, in this \
                 process or in others with the same unique id; several ranks created from one \
                 thread need ncclGroupStart/ncclGroupEnd around them)"
            )
        },
        &|st| st.cliques[k].ready.is_some(),
    );
    if !ok {
        return (st, nc::INVALID_USAGE);
    }
    match st.cliques[k].ready.clone().expect("ready") {
        Ok(()) => (st, nc::SUCCESS),
        Err(m) => (
            st,
            reject(nc::INVALID_USAGE, format!("ncclCommInitRank: {m}")),
        ),
    }
}

fn in_group() -> bool {
    GROUP.with(|g| g.borrow().0 > 0)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut Handle,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> i32 {
    crate::calls::count("ncclCommInitRank");
    // SAFETY: the same contract.
    unsafe { init_rank(comm, nranks, id, rank, false) }
}

/// `ncclConfig_t`'s head, as every version since 2.14 lays it out.
#[repr(C)]
pub struct ConfigHead {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
}

/// `ncclCommInitRank` with a config (NCCL >= 2.14; the stand-in reports what
/// `KVSTORE_STANDIN_NCCL_VERSION` says, and refuses the call below 2.14). With `blocking = 0`
/// the communicator is non-blocking: this call, collectives, `ncclGroupEnd` and
/// `ncclCommFinalize` return `ncclInProgress`, `ncclCommGetAsyncError` answers `ncclInProgress`
/// until the work is done (for a collective, for one poll), and a call on a communicator that
/// is still in progress is rejected, as NCCL requires polling to `ncclSuccess` first.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut Handle,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *mut ConfigHead,
) -> i32 {
    crate::calls::count("ncclCommInitRankConfig");
    let version = lock().cfg.nccl_version;
    if version < 21400 {
        return reject(
            nc::INVALID_USAGE,
            format!("ncclCommInitRankConfig: not in NCCL {version} (2.14 and later)"),
        );
    }
    let nonblocking = if config.is_null() {
        false
    } else {
        // SAFETY: a non-null config is a valid ncclConfig_t, per the API.
        let c = unsafe { &*config };
        if c.magic != 0xcafe_beef || c.version < 21400 || c.size < std::mem::size_of::<ConfigHead>()
        {
            return reject(
                nc::INVALID_ARGUMENT,
                "ncclCommInitRankConfig: the config was not made by NCCL_CONFIG_INITIALIZER \
                 (magic, version or size)"
                    .into(),
            );
        }
        c.blocking == 0
    };
    // SAFETY: the same contract as ncclCommInitRank.
    unsafe { init_rank(comm, nranks, id, rank, nonblocking) }
}

/// Whether a non-blocking communicator still has a call in progress (its clique is not complete,
/// or its last call has not been polled to completion).
fn in_progress(st: &State, c: usize) -> bool {
    let comm = &st.comms[c];
    comm.nonblocking
        && (comm.busy > 0
            || st.cliques[comm.clique].ready.is_none()
            || (st.cfg.stall_init && !comm.created))
}

/// Rejects a call on a non-blocking communicator that is still in progress.
fn check_settled(st: &State, c: usize, call: &str) -> Result<(), i32> {
    if in_progress(st, c) {
        return Err(reject(
            nc::INVALID_USAGE,
            format!(
                "{call}: the non-blocking communicator is still in progress (rank {}); poll \
                 ncclCommGetAsyncError until it returns ncclSuccess before the next call",
                st.comms[c].rank
            ),
        ));
    }
    Ok(())
}

unsafe fn init_rank(
    comm: *mut Handle,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    nonblocking: bool,
) -> i32 {
    if comm.is_null() || nranks <= 0 || rank < 0 {
        return nc::INVALID_ARGUMENT;
    }
    let st = lock();
    let Some(ctx) = state::current_ctx() else {
        return reject(
            nc::INVALID_USAGE,
            "ncclCommInitRank: no current CUDA context; NCCL puts the rank on the current \
             device, so bind the rank's context first (cuCtxSetCurrent)"
                .into(),
        );
    };
    let device = st.ctxs[ctx].device;
    let id = id.internal.map(|c| c as u8);
    let (nranks, rank) = (nranks as usize, rank as usize);
    if in_group() {
        drop(st);
        GROUP.with(|g| {
            g.borrow_mut().1.push(Deferred::Init {
                out: comm,
                nranks,
                id,
                rank,
                device,
                nonblocking,
            })
        });
        return nc::SUCCESS;
    }
    let mut st = st;
    let c = match join(&mut st, id, nranks, rank, device, true) {
        Ok(c) => c,
        Err(e) => return e,
    };
    st.comms[c].nonblocking = nonblocking;
    // SAFETY: non-null out-pointer, per the API.
    unsafe { comm.write(handle(Kind::Comm, c)) };
    if nonblocking {
        return nc::IN_PROGRESS;
    }
    wait_clique(st, c).1
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut Handle,
    ndev: c_int,
    devs: *const c_int,
) -> i32 {
    crate::calls::count("ncclCommInitAll");
    if comms.is_null() || ndev <= 0 {
        return nc::INVALID_ARGUMENT;
    }
    let mut st = lock();
    let n = ndev as usize;
    let devices: Vec<usize> = (0..n)
        .map(|i| {
            if devs.is_null() {
                i as c_int
            } else {
                // SAFETY: `devs` holds `ndev` device numbers, per the API.
                unsafe { *devs.add(i) }
            }
        })
        .map(|d| d as usize)
        .collect();
    if let Some(d) = devices.iter().find(|&&d| d >= st.cfg.gpus) {
        return reject(
            nc::INVALID_ARGUMENT,
            format!("ncclCommInitAll: no device {d}"),
        );
    }
    let n_id = st.next_unique_id;
    st.next_unique_id += 1;
    let mut id = [0u8; 128];
    id[..16].copy_from_slice(MAGIC);
    id[16..24].copy_from_slice(&n_id.to_le_bytes());
    let mut made = Vec::with_capacity(n);
    for (rank, &d) in devices.iter().enumerate() {
        match join(&mut st, id, n, rank, d, false) {
            Ok(c) => made.push(c),
            Err(e) => return e,
        }
    }
    if let Some(Err(m)) = st.cliques[st.comms[made[0]].clique].ready.clone() {
        for &c in &made {
            st.comms[c].live = false;
        }
        return reject(nc::INVALID_USAGE, format!("ncclCommInitAll: {m}"));
    }
    for (i, &c) in made.iter().enumerate() {
        // SAFETY: `comms` has room for `ndev` handles, per the API.
        unsafe { comms.add(i).write(handle(Kind::Comm, c)) };
    }
    nc::SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> i32 {
    crate::calls::count("ncclGroupStart");
    GROUP.with(|g| g.borrow_mut().0 += 1);
    nc::SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> i32 {
    crate::calls::count("ncclGroupEnd");
    let calls = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        match g.0 {
            0 => None,
            1 => {
                g.0 = 0;
                Some(std::mem::take(&mut g.1))
            }
            _ => {
                g.0 -= 1;
                Some(Vec::new())
            }
        }
    });
    let Some(calls) = calls else {
        return reject(
            nc::INVALID_USAGE,
            "ncclGroupEnd without ncclGroupStart".into(),
        );
    };
    let mut st = lock();
    let mut first = nc::SUCCESS;
    let mut note = |code: i32| {
        if first == nc::SUCCESS {
            first = code;
        }
    };
    // Communicators first (all ranks of this thread join together), then collectives.
    let mut inits = Vec::new();
    let mut nonblocking = false;
    for call in &calls {
        if let Deferred::Init {
            out,
            nranks,
            id,
            rank,
            device,
            nonblocking: nb,
        } = call
        {
            match join(&mut st, *id, *nranks, *rank, *device, true) {
                Ok(c) => {
                    st.comms[c].nonblocking = *nb;
                    nonblocking |= *nb;
                    // SAFETY: the out-pointer given to the deferred ncclCommInitRank, which
                    // the caller keeps valid until ncclGroupEnd returns (NCCL's contract).
                    unsafe { out.write(handle(Kind::Comm, c)) };
                    if !*nb {
                        inits.push(c);
                    }
                }
                Err(e) => note(e),
            }
        }
    }
    for c in inits {
        let (s, code) = wait_clique(st, c);
        st = s;
        note(code);
    }
    for call in calls {
        if let Deferred::Coll { comm, part } = call {
            if st.comms[comm].nonblocking {
                nonblocking = true;
                st.comms[comm].busy = 1;
            }
            note(issue(&mut st, comm, part));
        }
    }
    if first == nc::SUCCESS && nonblocking {
        return nc::IN_PROGRESS;
    }
    first
}

/// Issues one rank's part: matches it with the other ranks' parts of the same collective and
/// puts it on its stream.
fn issue(st: &mut State, comm: usize, part: Part) -> i32 {
    if !st.comms[comm].live {
        return reject(
            nc::INVALID_ARGUMENT,
            format!("nccl {:?}: the communicator was aborted", part.kind),
        );
    }
    let k = st.comms[comm].clique;
    let rank = st.comms[comm].rank;
    let nranks = st.cliques[k].nranks;
    let seq = st.cliques[k].next_seq[rank];
    let ci = match st.coll_index.get(&(k, seq)) {
        Some(&i) => i,
        None => {
            st.colls.push(Coll {
                clique: k,
                seq,
                parts: vec![None; nranks],
                executed: false,
                cancelled: vec![false; nranks],
                published: false,
            });
            st.coll_index.insert((k, seq), st.colls.len() - 1);
            st.colls.len() - 1
        }
    };
    if !part.grouped {
        let me = part.thread;
        if let Some((r, _)) = st.colls[ci].parts.iter().enumerate().find_map(|(r, p)| {
            p.as_ref()
                .filter(|p| p.thread == me && !p.grouped)
                .map(|p| (r, p))
        }) {
            return reject(
                nc::INVALID_USAGE,
                format!(
                    "nccl {:?} on rank {rank}: this thread already issued rank {r}'s part of \
                     the same collective outside a group; with real NCCL the first call can \
                     block until every rank joins, so one thread driving several ranks must put \
                     their calls between ncclGroupStart and ncclGroupEnd (a deadlock otherwise)",
                    part.kind
                ),
            );
        }
    }
    st.cliques[k].next_seq[rank] += 1;
    let s = part.stream;
    let what = if part.kind == CollKind::SendRecv {
        format!(
            "nccl SendRecv (rank {rank} of {nranks}, sends {:?}, receives {:?} elements per \
             peer) on {}",
            part.peers.send_counts(),
            part.peers.recv_counts(),
            st.stream_name(s)
        )
    } else {
        format!(
            "nccl {:?} (rank {rank} of {nranks}, {} elements) on {}",
            part.kind,
            part.count,
            st.stream_name(s)
        )
    };
    st.colls[ci].parts[rank] = Some(part);
    let (pos, vc) = st.push_op(s, what, Work::Coll { coll: ci, rank });
    if let Some(p) = st.colls[ci].parts[rank].as_mut() {
        (p.pos, p.vc) = (pos, vc);
    }
    let clique = &st.cliques[k];
    let all_here = st.colls[ci]
        .parts
        .iter()
        .enumerate()
        .all(|(r, p)| p.is_some() || clique.remote[r].is_some());
    if all_here {
        return check_match(st, ci);
    }
    nc::SUCCESS
}

/// Every part of this process is issued: they must agree (the parts of ranks in other
/// processes are checked when their files arrive). Then the ranks that receive data are
/// ordered after the ranks of this process that send it.
fn check_match(st: &mut State, ci: usize) -> i32 {
    let parts: Vec<(usize, Part)> = st.colls[ci]
        .parts
        .iter()
        .enumerate()
        .filter_map(|(r, p)| p.clone().map(|p| (r, p)))
        .collect();
    let (r0, first) = &parts[0];
    let p0 = crate::xproc::Header::of(first);
    let mismatch = parts
        .iter()
        .find_map(|(r, p)| {
            crate::xproc::differ(&crate::xproc::Header::of(p), &p0)
                .map(|d| format!("rank {r} and rank {r0} differ in {d}"))
        })
        .or_else(|| {
            // Point-to-point: what each rank sends each peer is what that peer receives from
            // it (the pairs of this process; those with ranks of other processes are checked
            // when their files arrive).
            (p0.kind == CollKind::SendRecv)
                .then(|| {
                    let n = st.colls[ci].parts.len();
                    let (mut sends, mut recvs) = (vec![Vec::new(); n], vec![Vec::new(); n]);
                    for (r, p) in &parts {
                        (sends[*r], recvs[*r]) = (p.peers.send_counts(), p.peers.recv_counts());
                    }
                    state::p2p_mismatch(&sends, &recvs)
                })
                .flatten()
        });
    let k = st.colls[ci].clique;
    if let Some(d) = mismatch {
        st.colls[ci].cancelled.fill(true);
        for c in st.cliques[k].comms.clone().into_iter().flatten() {
            st.comms[c].async_error = nc::INVALID_USAGE;
        }
        return reject(
            nc::INVALID_USAGE,
            format!(
                "collective #{} of clique {k} ({:?}): {d}; every rank must make the same call \
                 (real NCCL would hang or corrupt memory). The communicators now report \
                 ncclInvalidUsage from ncclCommGetAsyncError",
                st.colls[ci].seq, p0.kind
            ),
        );
    }
    if p0.kind == CollKind::SendRecv {
        // A rank is ordered after the ranks it receives bytes from.
        for (_, p) in &parts {
            let from = p.peers.recv_counts();
            for (q, pq) in &parts {
                if from[*q] > 0 {
                    st.streams[p.stream].vc.join(&pq.vc);
                }
            }
        }
        return nc::SUCCESS;
    }
    let root = p0.root as usize;
    for (r, p) in &parts {
        let receives = match p0.kind {
            CollKind::Reduce => *r == root,
            _ => true,
        };
        if !receives {
            continue;
        }
        for (snd, q) in &parts {
            if p0.kind == CollKind::Broadcast && *snd != root {
                continue;
            }
            let vc = q.vc.clone();
            st.streams[p.stream].vc.join(&vc);
        }
    }
    nc::SUCCESS
}

/// Checks that a call's `what` buffer of `bytes` bytes at `ptr` lies in one live allocation on
/// the rank's device (nothing to check for 0 bytes).
fn check_buffer(
    st: &State,
    call: &str,
    rank: usize,
    device: usize,
    what: &str,
    ptr: u64,
    bytes: usize,
) -> Result<(), i32> {
    if bytes == 0 {
        return Ok(());
    }
    let (d, _) = st.locate(ptr, bytes).map_err(|e| {
        reject(
            nc::INVALID_ARGUMENT,
            format!("{call} (rank {rank}) {what} buffer: {e}"),
        )
    })?;
    if d != device {
        return Err(reject(
            nc::INVALID_ARGUMENT,
            format!(
                "{call} (rank {rank}): the {what} buffer {ptr:#x} is on gpu {d}, the rank on \
                 gpu {device}"
            ),
        ));
    }
    Ok(())
}

/// Who makes a collective or point-to-point call, once its communicator, stream and datatype
/// are checked: the communicator, the stream, the rank's device, the rank, the clique's size
/// and the datatype's element size.
struct Caller {
    c: usize,
    s: usize,
    device: usize,
    rank: usize,
    nranks: usize,
    es: usize,
}

/// Checks what every NCCL data call names: a live, settled communicator, a CUDA stream on the
/// rank's device, and a known datatype.
fn caller(
    st: &mut State,
    call: &str,
    comm: Handle,
    stream: Handle,
    dtype: c_int,
) -> Result<Caller, i32> {
    let c = comm_of(st, comm, call)?;
    check_settled(st, c, call)?;
    let s = st
        .stream(stream)
        .map_err(|_| reject(nc::INVALID_ARGUMENT, format!("{call}: not a CUDA stream")))?;
    let (device, rank) = (st.comms[c].device, st.comms[c].rank);
    let nranks = st.cliques[st.comms[c].clique].nranks;
    if st.device_of_stream(s) != device {
        return Err(reject(
            nc::INVALID_ARGUMENT,
            format!(
                "{call}: rank {rank}'s device is gpu {device}, but the stream is {}",
                st.stream_name(s)
            ),
        ));
    }
    let es = nccl_elem_size(dtype)
        .ok_or_else(|| reject(nc::INVALID_ARGUMENT, format!("{call}: datatype {dtype}")))?;
    Ok(Caller {
        c,
        s,
        device,
        rank,
        nranks,
        es,
    })
}

/// Issues a part made outside a group at once: `ncclInProgress` on a non-blocking
/// communicator (which is busy until polled), as NCCL returns it.
fn issue_now(st: &mut State, c: usize, part: Part) -> Result<(), i32> {
    match issue(st, c, part) {
        nc::SUCCESS if st.comms[c].nonblocking => {
            st.comms[c].busy = 1;
            Err(nc::IN_PROGRESS)
        }
        nc::SUCCESS => Ok(()),
        e => Err(e),
    }
}

/// Validates and issues (or defers, inside a group) one collective call.
#[allow(clippy::too_many_arguments)]
fn collective(
    call: &str,
    kind: CollKind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    run(|| {
        let mut st = lock();
        let Caller {
            c,
            s,
            device,
            rank,
            nranks,
            es,
        } = caller(&mut st, call, comm, stream, dtype)?;
        if !(0..=4).contains(&op) {
            return Err(reject(
                nc::INVALID_ARGUMENT,
                format!("{call}: operation {op}"),
            ));
        }
        let rooted = matches!(kind, CollKind::Reduce | CollKind::Broadcast);
        if rooted && (root < 0 || root as usize >= nranks) {
            return Err(reject(
                nc::INVALID_ARGUMENT,
                format!("{call}: root {root} with {nranks} ranks"),
            ));
        }
        let is_root = rooted && root as usize == rank;
        let (send_bytes, recv_bytes) = match kind {
            CollKind::Reduce => (count * es, if is_root { count * es } else { 0 }),
            CollKind::Broadcast => (if is_root { count * es } else { 0 }, count * es),
            CollKind::AllReduce => (count * es, count * es),
            CollKind::AllGather => (count * es, count * es * nranks),
            CollKind::ReduceScatter => (count * es * nranks, count * es),
            // Point-to-point calls are checked by `p2p`, never here.
            CollKind::SendRecv => (0, 0),
        };
        for (what, ptr, bytes) in [
            ("send", send as u64, send_bytes),
            ("receive", recv as u64, recv_bytes),
        ] {
            check_buffer(&st, call, rank, device, what, ptr, bytes)?;
        }
        let part = Part {
            kind,
            send: send as u64,
            recv: recv as u64,
            count,
            dtype,
            op,
            root,
            stream: s,
            pos: 0,
            vc: Default::default(),
            thread: std::thread::current().id(),
            grouped: in_group(),
            peers: Peers::default(),
        };
        if part.grouped {
            drop(st);
            GROUP.with(|g| g.borrow_mut().1.push(Deferred::Coll { comm: c, part }));
            return Ok(());
        }
        issue_now(&mut st, c, part)
    })
}

#[no_mangle]
pub extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    crate::calls::count("ncclReduce");
    collective(
        "ncclReduce",
        CollKind::Reduce,
        send,
        recv,
        count,
        dtype,
        op,
        root,
        comm,
        stream,
    )
}

#[no_mangle]
pub extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    crate::calls::count("ncclBroadcast");
    collective(
        "ncclBroadcast",
        CollKind::Broadcast,
        send,
        recv,
        count,
        dtype,
        0,
        root,
        comm,
        stream,
    )
}

#[no_mangle]
pub extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    crate::calls::count("ncclAllReduce");
    collective(
        "ncclAllReduce",
        CollKind::AllReduce,
        send,
        recv,
        count,
        dtype,
        op,
        0,
        comm,
        stream,
    )
}

#[no_mangle]
pub extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    crate::calls::count("ncclAllGather");
    collective(
        "ncclAllGather",
        CollKind::AllGather,
        send,
        recv,
        count,
        dtype,
        0,
        0,
        comm,
        stream,
    )
}

#[no_mangle]
pub extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    crate::calls::count("ncclReduceScatter");
    collective(
        "ncclReduceScatter",
        CollKind::ReduceScatter,
        send,
        recv,
        count,
        dtype,
        op,
        0,
        comm,
        stream,
    )
}

/// Validates one `ncclSend` (`send`) or `ncclRecv` and adds its block to this thread's
/// point-to-point part of the communicator: inside a group, the part deferred with the
/// communicator's first point-to-point call of the group (made then, at that position among
/// the group's calls); outside a group, a part of its own, issued at once.
#[allow(clippy::too_many_arguments)]
fn p2p(
    call: &str,
    send: bool,
    buf: u64,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    run(|| {
        let mut st = lock();
        let Caller {
            c,
            s,
            device,
            rank,
            nranks,
            es,
        } = caller(&mut st, call, comm, stream, dtype)?;
        if peer < 0 || peer as usize >= nranks {
            return Err(reject(
                nc::INVALID_ARGUMENT,
                format!("{call} (rank {rank}): peer {peer} with {nranks} ranks"),
            ));
        }
        let peer = peer as usize;
        let what = if send { "send" } else { "receive" };
        let bytes = count.checked_mul(es).ok_or_else(|| {
            reject(
                nc::INVALID_ARGUMENT,
                format!("{call} (rank {rank}): {count} elements"),
            )
        })?;
        check_buffer(&st, call, rank, device, what, buf, bytes)?;
        // Adds this call's block to `part`, this thread's part of the communicator.
        let add = |st: &State, part: &mut Part| -> Result<(), i32> {
            if part.stream != s {
                return Err(reject(
                    nc::INVALID_USAGE,
                    format!(
                        "{call} (rank {rank}, peer {peer}): on {}, but this group's first \
                         ncclSend/ncclRecv on the communicator was on {}; the stand-in takes \
                         one stream per communicator for the point-to-point calls of one group \
                         (stricter than NCCL)",
                        st.stream_name(s),
                        st.stream_name(part.stream)
                    ),
                ));
            }
            if part.dtype != dtype {
                return Err(reject(
                    nc::INVALID_USAGE,
                    format!(
                        "{call} (rank {rank}, peer {peer}): datatype {dtype}, but this group's \
                         first ncclSend/ncclRecv on the communicator has {}; the stand-in takes \
                         one datatype per communicator for the point-to-point calls of one \
                         group (stricter than NCCL)",
                        part.dtype
                    ),
                ));
            }
            let slot = if send {
                &mut part.peers.sends[peer]
            } else {
                &mut part.peers.recvs[peer]
            };
            if let Some((_, earlier)) = *slot {
                return Err(reject(
                    nc::INVALID_USAGE,
                    format!(
                        "{call} (rank {rank}): a second {what} {} peer {peer} in one group \
                         ({count} elements; the first was {earlier}); the stand-in takes one \
                         block per peer and direction in the point-to-point calls of one group \
                         on one communicator (stricter than NCCL, which would queue both)",
                        if send { "to" } else { "from" }
                    ),
                ));
            }
            *slot = Some((buf, count));
            if send {
                part.count += count;
            }
            Ok(())
        };
        let grouped = in_group();
        let fresh = || Part {
            kind: CollKind::SendRecv,
            send: 0,
            recv: 0,
            count: 0,
            dtype,
            op: 0,
            root: 0,
            stream: s,
            pos: 0,
            vc: Default::default(),
            thread: std::thread::current().id(),
            grouped,
            peers: Peers::new(nranks),
        };
        if grouped {
            return GROUP.with(|g| {
                let mut g = g.borrow_mut();
                let deferred = g.1.iter_mut().find_map(|d| match d {
                    Deferred::Coll { comm, part }
                        if *comm == c && part.kind == CollKind::SendRecv =>
                    {
                        Some(part)
                    }
                    _ => None,
                });
                match deferred {
                    Some(part) => add(&st, part),
                    None => {
                        let mut part = fresh();
                        add(&st, &mut part)?;
                        g.1.push(Deferred::Coll { comm: c, part });
                        Ok(())
                    }
                }
            });
        }
        let mut part = fresh();
        add(&st, &mut part)?;
        issue_now(&mut st, c, part)
    })
}

/// `ncclSend`: `count` elements of `datatype` at `sendbuff` to rank `peer`. Issued with the
/// thread's other point-to-point calls on the communicator in the same group as one part of a
/// collective of kind `SendRecv` (see `p2p`; a count of 0 needs no buffer).
#[no_mangle]
pub extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    crate::calls::count("ncclSend");
    p2p(
        "ncclSend",
        true,
        sendbuff as u64,
        count,
        datatype,
        peer,
        comm,
        stream,
    )
}

/// `ncclRecv`: `count` elements of `datatype` from rank `peer` into `recvbuff`, as
/// [`ncclSend`]'s counterpart.
#[no_mangle]
pub extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: Handle,
    stream: Handle,
) -> i32 {
    crate::calls::count("ncclRecv");
    p2p(
        "ncclRecv",
        false,
        recvbuff as u64,
        count,
        datatype,
        peer,
        comm,
        stream,
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: Handle, result: *mut c_int) -> i32 {
    crate::calls::count("ncclCommGetAsyncError");
    run(|| {
        let mut st = lock();
        let c = comm_of(&st, comm, "ncclCommGetAsyncError")?;
        if result.is_null() {
            return Err(nc::INVALID_ARGUMENT);
        }
        if st.run_ready(&state::Scope::Due) {
            notify();
        }
        let k = st.comms[c].clique;
        let stalled = st.cfg.stall_init && st.comms[c].nonblocking && !st.comms[c].created;
        let state = match (&st.cliques[k].ready, st.comms[c].nonblocking) {
            // A non-blocking communicator whose clique is incomplete is still being created.
            (None, true) => nc::IN_PROGRESS,
            _ if stalled => nc::IN_PROGRESS,
            (Some(Err(_)), true) => nc::INVALID_USAGE,
            _ if st.comms[c].busy > 0 => {
                if !st.cfg.stall_group {
                    st.comms[c].busy -= 1;
                }
                nc::IN_PROGRESS
            }
            _ => st.comms[c].async_error,
        };
        if state == nc::SUCCESS {
            st.comms[c].created = true;
        }
        // SAFETY: non-null out-pointer, per the API.
        unsafe { result.write(state) };
        Ok(())
    })
}

/// Ends a communicator: its rank's parts of collectives that have not run are cancelled (they
/// complete without moving data, as aborted NCCL kernels end), so its streams drain. The other
/// ranks' parts of those collectives stay blocked until they end their communicators too.
///
/// An abort of the last live communicator this process has in its clique then waits on the host
/// until the cancelled parts of this process's ranks have run, as NCCL's does: `ncclCommAbort`
/// runs `commReclaim`, which, for the process's last rank of the communicator only, calls
/// `commDestroySync`, whose `ncclStrongStreamSynchronize(deviceStream)` waits for every kernel
/// NCCL launched (the device stream waits on an event recorded after each, in
/// `ncclLaunchFinish`). An abort of any other rank returns without waiting: its aborted
/// part's buffers are not yet free to go.
fn end_comm(call: &str, comm: Handle, cancel: bool) -> i32 {
    run(|| {
        let mut st = lock();
        let c = comm_of(&st, comm, call)?;
        st.comms[c].live = false;
        let k = st.comms[c].clique;
        let clique = &st.cliques[k];
        let ours: Vec<usize> = clique.comms.iter().flatten().copied().collect();
        let last = ours.iter().all(|&x| !st.comms[x].live);
        if let (false, Some(dir)) = (clique.left, &clique.shm) {
            if last {
                // The last communicator of this process in the clique: its ranks leave the
                // folder (the last process to leave removes it).
                let ranks: Vec<usize> = ours.iter().map(|&x| st.comms[x].rank).collect();
                crate::xproc::leave(dir, &ranks, clique.nranks);
                st.cliques[k].left = true;
            }
        }
        if cancel {
            let (k, rank) = (st.comms[c].clique, st.comms[c].rank);
            for coll in st.colls.iter_mut() {
                if coll.clique == k && !coll.executed && coll.parts[rank].is_some() {
                    coll.cancelled[rank] = true;
                }
            }
        }
        // Destroying (not aborting) a communicator flushes its queued work, as
        // ncclCommFinalize does: parts not yet run are published to the other processes.
        st.run_ready(if cancel {
            &state::Scope::Due
        } else {
            &state::Scope::All
        });
        notify();
        if !(cancel && last) {
            return Ok(());
        }
        // The host wait of NCCL's abort of the process's last rank (above): every cancelled
        // part of this process's ranks in the clique, up to its position on its stream.
        let ranks: Vec<usize> = ours.iter().map(|&x| st.comms[x].rank).collect();
        let parts: Vec<(usize, u64, state::Vc)> = st
            .colls
            .iter()
            .filter(|coll| coll.clique == k && !coll.executed)
            .flat_map(|coll| {
                ranks.iter().filter_map(|&r| {
                    let p = coll.parts[r].as_ref().filter(|_| coll.cancelled[r])?;
                    Some((p.stream, p.pos, p.vc.clone()))
                })
            })
            .filter(|&(s, pos, _)| st.streams[s].done < pos)
            .collect();
        if parts.is_empty() {
            return Ok(());
        }
        let upto: Vec<(usize, u64)> = parts.iter().map(|&(s, pos, _)| (s, pos)).collect();
        let (mut st, ok) = state::wait_until(
            st,
            &upto,
            &|| format!("{call} (waiting for the aborted parts of this process's ranks)"),
            &|st| upto.iter().all(|&(s, pos)| st.streams[s].done >= pos),
        );
        if ok {
            for (_, _, vc) in &parts {
                st.host_vc.join(vc);
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclCommAbort(comm: Handle) -> i32 {
    crate::calls::count("ncclCommAbort");
    end_comm("ncclCommAbort", comm, true)
}

#[no_mangle]
pub extern "C" fn ncclCommDestroy(comm: Handle) -> i32 {
    crate::calls::count("ncclCommDestroy");
    end_comm("ncclCommDestroy", comm, false)
}

#[no_mangle]
pub extern "C" fn ncclCommFinalize(comm: Handle) -> i32 {
    crate::calls::count("ncclCommFinalize");
    run(|| {
        let mut st = lock();
        let c = comm_of(&st, comm, "ncclCommFinalize")?;
        check_settled(&st, c, "ncclCommFinalize")?;
        if st.comms[c].nonblocking {
            st.comms[c].busy = 1;
            return Err(nc::IN_PROGRESS);
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: Handle, count: *mut c_int) -> i32 {
    crate::calls::count("ncclCommCount");
    run(|| {
        let st = lock();
        let c = comm_of(&st, comm, "ncclCommCount")?;
        if count.is_null() {
            return Err(nc::INVALID_ARGUMENT);
        }
        // SAFETY: non-null out-pointer, per the API.
        unsafe { count.write(st.cliques[st.comms[c].clique].nranks as c_int) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: Handle, device: *mut c_int) -> i32 {
    crate::calls::count("ncclCommCuDevice");
    run(|| {
        let st = lock();
        let c = comm_of(&st, comm, "ncclCommCuDevice")?;
        if device.is_null() {
            return Err(nc::INVALID_ARGUMENT);
        }
        // SAFETY: non-null out-pointer, per the API.
        unsafe { device.write(st.comms[c].device as c_int) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: Handle, rank: *mut c_int) -> i32 {
    crate::calls::count("ncclCommUserRank");
    run(|| {
        let st = lock();
        let c = comm_of(&st, comm, "ncclCommUserRank")?;
        if rank.is_null() {
            return Err(nc::INVALID_ARGUMENT);
        }
        // SAFETY: non-null out-pointer, per the API.
        unsafe { rank.write(st.comms[c].rank as c_int) };
        Ok(())
    })
}

/// The text of `ncclGetLastError` on this thread (for tests).
pub fn last_error() -> String {
    LAST_ERROR.with(|l| l.borrow().to_string_lossy().into_owned())
}

//! The one state behind both APIs: devices, contexts, streams as queues, events, modules,
//! device memory, vector clocks, and NCCL cliques. See the crate docs for the model.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use half::{bf16, f16};

use crate::emu::{self, Arg, Memory, Module};

/// CUDA driver result codes (values of `CUresult`) the stand-in returns.
pub mod cu {
    pub const SUCCESS: i32 = 0;
    pub const INVALID_VALUE: i32 = 1;
    pub const OUT_OF_MEMORY: i32 = 2;
    pub const NOT_INITIALIZED: i32 = 3;
    pub const NO_DEVICE: i32 = 100;
    pub const INVALID_DEVICE: i32 = 101;
    pub const INVALID_CONTEXT: i32 = 201;
    pub const NO_BINARY_FOR_GPU: i32 = 209;
    pub const INVALID_PTX: i32 = 218;
    pub const UNSUPPORTED_PTX_VERSION: i32 = 222;
    pub const INVALID_HANDLE: i32 = 400;
    pub const ILLEGAL_STATE: i32 = 401;
    pub const NOT_FOUND: i32 = 500;
    pub const NOT_READY: i32 = 600;
    pub const ILLEGAL_ADDRESS: i32 = 700;
    pub const LAUNCH_OUT_OF_RESOURCES: i32 = 701;
    pub const LAUNCH_TIMEOUT: i32 = 702;
    pub const PEER_ACCESS_ALREADY_ENABLED: i32 = 704;
    pub const PEER_ACCESS_NOT_ENABLED: i32 = 705;
    pub const MISALIGNED_ADDRESS: i32 = 716;
    pub const LAUNCH_FAILED: i32 = 719;
    pub const NOT_SUPPORTED: i32 = 801;
}

/// NCCL result codes (values of `ncclResult_t`).
pub mod nc {
    pub const SUCCESS: i32 = 0;
    pub const SYSTEM_ERROR: i32 = 2;
    pub const INVALID_ARGUMENT: i32 = 4;
    pub const INVALID_USAGE: i32 = 5;
    pub const REMOTE_ERROR: i32 = 6;
    pub const IN_PROGRESS: i32 = 7;
}

/// Prints a rejection: every line the stand-in writes starts with this tag.
pub fn report(message: &str) {
    eprintln!("[kvstore stand-in] {message}");
}

/// Settings, read from the environment once.
#[derive(Clone, Debug)]
pub struct Config {
    /// `KVSTORE_STANDIN_GPUS` (default 2; 0 makes `cuInit` say there is no device).
    pub gpus: usize,
    /// `KVSTORE_STANDIN_SM`: compute capability as major * 10 + minor (default 90).
    pub sm: u32,
    /// `KVSTORE_STANDIN_PTX_ISA`: the highest PTX `.version` accepted, times 10 (default 88).
    pub ptx_isa: u32,
    /// `KVSTORE_STANDIN_NCCL_VERSION` (default 23007).
    pub nccl_version: i32,
    /// `KVSTORE_STANDIN_P2P`: what `cuDeviceCanAccessPeer` answers (default 1).
    pub p2p: bool,
    /// `KVSTORE_STANDIN_HANG_S`: how long a host wait may block before it fails (default 120).
    pub hang: Duration,
    /// `KVSTORE_STANDIN_NCCL_STALL_INIT=1`: a non-blocking communicator never finishes being
    /// created (`ncclCommGetAsyncError` answers `ncclInProgress` until it is aborted), as when
    /// NCCL's bootstrap hangs. For tests that a stalled init is aborted, not waited for.
    pub stall_init: bool,
    /// `KVSTORE_STANDIN_NCCL_STALL_GROUP=1`: a non-blocking communicator's collectives never
    /// finish being issued (`ncclCommGetAsyncError` answers `ncclInProgress` after its first
    /// collective until it is aborted), as when NCCL's connection setup for a first collective
    /// hangs on a peer. For tests that a group stalled in progress holds no lock a waiter needs.
    pub stall_group: bool,
    /// `KVSTORE_STANDIN_MEM_GIB`: each device's memory, in GiB (default 80, an H100's; a
    /// fraction such as 0.25 is allowed). Allocations beyond it fail with
    /// CUDA_ERROR_OUT_OF_MEMORY. Converted to bytes.
    pub mem_bytes: u64,
    /// `KVSTORE_STANDIN_DELAY_US`: how long an operation stays queued before the device's
    /// worker runs it, unless a host wait or query needs it first (default 20000: 20 ms, far
    /// longer than the host takes to reach its next call, so work the host never waits for
    /// is still pending when it looks).
    pub delay: Duration,
    /// `KVSTORE_STANDIN_SEED`: when set, each operation's delay is drawn from `[0, 2 * delay)`
    /// by a generator with this seed, so runs with different seeds order unsynchronized work
    /// differently.
    pub seed: Option<u64>,
}

impl Config {
    fn from_env() -> Config {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> T {
            match std::env::var(name) {
                Ok(v) => v.trim().parse().unwrap_or_else(|_| {
                    report(&format!("{name}={v} is not understood; using the default"));
                    default
                }),
                Err(_) => default,
            }
        }
        let isa: f64 = var("KVSTORE_STANDIN_PTX_ISA", 8.8);
        Config {
            gpus: var("KVSTORE_STANDIN_GPUS", 2),
            sm: var("KVSTORE_STANDIN_SM", 90),
            ptx_isa: (isa * 10.0).round() as u32,
            nccl_version: var("KVSTORE_STANDIN_NCCL_VERSION", 23007),
            p2p: var::<u32>("KVSTORE_STANDIN_P2P", 1) != 0,
            hang: Duration::from_secs(var("KVSTORE_STANDIN_HANG_S", 120)),
            stall_init: var::<u32>("KVSTORE_STANDIN_NCCL_STALL_INIT", 0) != 0,
            stall_group: var::<u32>("KVSTORE_STANDIN_NCCL_STALL_GROUP", 0) != 0,
            mem_bytes: (var::<f64>("KVSTORE_STANDIN_MEM_GIB", 80.0).max(0.0) * (1u64 << 30) as f64)
                as u64,
            delay: Duration::from_micros(var("KVSTORE_STANDIN_DELAY_US", 20_000)),
            seed: std::env::var_os("KVSTORE_STANDIN_SEED").map(|_| var("KVSTORE_STANDIN_SEED", 0)),
        }
    }
}

/// A vector clock: per stream id, the last operation of that stream known to happen before.
#[derive(Clone, Debug, Default)]
pub struct Vc(Vec<u64>);

impl Vc {
    pub fn get(&self, s: usize) -> u64 {
        self.0.get(s).copied().unwrap_or(0)
    }

    fn set(&mut self, s: usize, v: u64) {
        if self.0.len() <= s {
            self.0.resize(s + 1, 0);
        }
        self.0[s] = v;
    }

    pub fn join(&mut self, o: &Vc) {
        if self.0.len() < o.0.len() {
            self.0.resize(o.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&o.0) {
            *a = (*a).max(*b);
        }
    }
}

/// Handle kinds, in the top bits of every handle the stand-in gives out, so a handle of the
/// wrong kind (or a made-up one) is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Ctx = 1,
    Stream = 2,
    Event = 3,
    Module = 4,
    Function = 5,
    Comm = 6,
    /// A memory pool: a device's default pool (index: the device).
    Pool = 7,
}

pub fn handle(kind: Kind, index: usize) -> *mut std::ffi::c_void {
    (((kind as usize) << 44) | (index + 1)) as *mut std::ffi::c_void
}

pub fn unhandle(kind: Kind, h: *mut std::ffi::c_void) -> Option<usize> {
    let v = h as usize;
    (v >> 44 == kind as usize && v & ((1 << 44) - 1) != 0).then(|| (v & ((1 << 44) - 1)) - 1)
}

/// One earlier access to part of an allocation, kept for race checks.
#[derive(Clone, Debug)]
struct Access {
    lo: u64,
    hi: u64,
    stream: usize,
    clock: u64,
    write: bool,
    what: Arc<str>,
}

/// What the stand-in knows of an allocation besides its bytes.
struct AllocInfo {
    device: usize,
    /// Its size, counted against the device's memory.
    len: u64,
    /// From a memory pool (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`): other devices reach
    /// it only through the pool's access (`cuMemPoolSetAccess`), never through
    /// `cuCtxEnablePeerAccess`.
    pooled: bool,
    accesses: Vec<Access>,
}

pub struct Ctx {
    pub device: usize,
    pub retained: u32,
    /// The stream that handle 0 (the NULL stream) means in this context.
    pub null_stream: Option<usize>,
    /// The sticky error of a kernel fault in this context (an illegal address): from then on
    /// every call on the context fails with it, and queued work does not run, until the
    /// context is reset (`cuDevicePrimaryCtxReset`, or the last `cuDevicePrimaryCtxRelease`).
    pub sticky: Option<i32>,
}

/// Whether a kernel's error code is one CUDA makes sticky: the context is unusable afterwards
/// ("the process must be terminated and relaunched", the driver API's documentation of each
/// of these codes): an illegal address (700), a misaligned address (716). The stand-in's own
/// diagnoses (races, uninitialized registers: CUDA_ERROR_LAUNCH_FAILED from the interpreter,
/// peer access) are not sticky, since a GPU would not fault on them.
pub fn is_sticky(code: i32) -> bool {
    matches!(code, cu::ILLEGAL_ADDRESS | cu::MISALIGNED_ADDRESS)
}

/// Work a stream does when its operation runs.
pub enum Work {
    /// A stream-ordered allocation: counts as a write of the whole allocation.
    Alloc {
        base: u64,
        len: u64,
    },
    Free {
        base: u64,
    },
    HtoD {
        dst: u64,
        data: Vec<u8>,
    },
    /// From page-locked host memory (`cuMemHostAlloc`), which the copy reads when it runs, as
    /// a GPU's DMA does. `snapshot` is what the buffer held at the call: a buffer rewritten (or
    /// freed) before the copy ran is reported, since on a GPU the copy would have sent the new
    /// bytes.
    HtoDPinned {
        dst: u64,
        src: usize,
        snapshot: Vec<u8>,
    },
    /// To pageable host memory at `dst` (the calling thread waits inside the call until it
    /// ran, as CUDA's rule for pageable memory says).
    DtoH {
        dst: usize,
        src: u64,
        len: usize,
    },
    /// To page-locked host memory (`cuMemHostAlloc`): the call returns at once and the bytes
    /// land when the copy runs. Until then the destination holds `expect`: [`POISON`] bytes
    /// written at the call (what the host sees if it reads without waiting), or what an
    /// earlier copy into the same bytes wrote since. A destination that holds anything else
    /// when the copy runs was written by the host meanwhile: a race, reported.
    DtoHPinned {
        dst: usize,
        src: u64,
        expect: Vec<u8>,
    },
    /// `staged`: a peer copy, which needs no peer access.
    DtoD {
        dst: u64,
        src: u64,
        len: usize,
        staged: bool,
    },
    Memset {
        dst: u64,
        value: u8,
        len: usize,
    },
    Launch {
        func: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Vec<Arg>,
        /// The launching thread's counters: its idle blocks are added when the kernel runs.
        counts: Option<crate::calls::Counts>,
    },
    /// Waits until `stream` has done `upto` operations.
    Wait {
        stream: usize,
        upto: u64,
    },
    /// Rank `rank`'s part of a collective.
    Coll {
        coll: usize,
        rank: usize,
    },
    /// A cancelled operation (its host buffer went away): does nothing.
    Nothing,
}

impl Work {
    /// The page-locked host bytes a copy reads or writes when it runs: (address, length).
    fn pinned_span(&self) -> Option<(usize, usize)> {
        match self {
            Work::DtoHPinned { dst, expect, .. } => Some((*dst, expect.len())),
            Work::HtoDPinned { src, snapshot, .. } => Some((*src, snapshot.len())),
            _ => None,
        }
    }
}

pub struct Op {
    pub pos: u64,
    pub vc: Vc,
    pub what: Arc<str>,
    pub work: Work,
    /// When the device's worker may run it (a host wait runs it as soon as it is ready).
    pub due: Instant,
}

/// What the host finds in page-locked memory that a pending device-to-host copy will write:
/// NaN in every float type, so a read that did not wait for the copy shows in the results.
pub const POISON: u8 = 0xff;

/// Which queued operations a call runs.
pub enum Scope<'a> {
    /// The device's worker: operations whose delay is over, on every stream.
    Due,
    /// Every operation that is ready, due or not: at exit, before an allocation fails for want
    /// of memory a queued free would return, and when a communicator is destroyed.
    All,
    /// A host wait or query: the operations of these streams up to these positions, and, that
    /// far, what they wait for (an event's stream, a collective's other ranks), at once.
    Upto(&'a [(usize, u64)]),
}

pub struct Stream {
    pub ctx: usize,
    pub queue: VecDeque<Op>,
    /// Operations enqueued and done so far (positions are 1-based).
    pub enq: u64,
    pub done: u64,
    pub vc: Vc,
    pub live: bool,
    /// Failed operations not yet reported: (position, code).
    pub errors: Vec<(u64, i32)>,
}

pub struct Event {
    pub ctx: usize,
    pub live: bool,
    /// The last record: (stream, position, clock).
    pub recorded: Option<(usize, u64, Vc)>,
}

pub struct LoadedModule {
    pub ctx: usize,
    pub live: bool,
    pub module: Arc<Module>,
    /// Each entry's registers per thread, as ptxas assembled it (none without a ptxas).
    pub regs: Option<crate::regs::Registers>,
}

pub struct Function {
    pub ctx: usize,
    /// False once its context was reset.
    pub live: bool,
    pub module: Arc<Module>,
    pub entry: usize,
    /// Its registers per thread, when ptxas said.
    pub regs: Option<u32>,
}

/// NCCL collective kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollKind {
    Reduce,
    Broadcast,
    AllReduce,
    AllGather,
    ReduceScatter,
    /// `ncclSend` and `ncclRecv`: all the point-to-point calls one thread makes on one
    /// communicator inside one group (or one such call outside a group) are one part, and the
    /// parts are matched like those of other collectives (see `Peers`).
    SendRecv,
}

/// The blocks of a point-to-point part ([`CollKind::SendRecv`]), indexed by peer: (address,
/// elements) of what the rank sends to that peer and of what it receives from it; `None` where
/// it named no such block (the same as 0 elements). Empty for the other kinds.
#[derive(Clone, Debug, Default)]
pub struct Peers {
    pub sends: Vec<Option<(u64, usize)>>,
    pub recvs: Vec<Option<(u64, usize)>>,
}

impl Peers {
    /// No block to or from any of `n` ranks yet.
    pub fn new(n: usize) -> Peers {
        Peers {
            sends: vec![None; n],
            recvs: vec![None; n],
        }
    }

    /// The elements sent to each peer (0 where none was named).
    pub fn send_counts(&self) -> Vec<usize> {
        self.sends.iter().map(|b| b.map_or(0, |(_, c)| c)).collect()
    }

    /// The elements received from each peer (0 where none was named).
    pub fn recv_counts(&self) -> Vec<usize> {
        self.recvs.iter().map(|b| b.map_or(0, |(_, c)| c)).collect()
    }
}

/// The first disagreement of a point-to-point collective: an ordered pair of ranks `(a, b)`
/// where what `a` sends to `b` (`sends[a][b]`) is not what `b` receives from `a`
/// (`recvs[b][a]`). Ranks whose counts are unknown (empty rows) are skipped.
pub fn p2p_mismatch(sends: &[Vec<usize>], recvs: &[Vec<usize>]) -> Option<String> {
    for (a, to) in sends.iter().enumerate() {
        for (b, &sent) in to.iter().enumerate() {
            let Some(&got) = recvs.get(b).and_then(|from| from.get(a)) else {
                continue;
            };
            if sent != got {
                return Some(format!(
                    "rank {a} sends {sent} elements to rank {b} (peer {b}), but rank {b} receives \
                     {got} elements from rank {a} (peer {a})"
                ));
            }
        }
    }
    None
}

/// One rank's part of a collective, as issued.
#[derive(Clone, Debug)]
pub struct Part {
    pub kind: CollKind,
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub dtype: i32,
    pub op: i32,
    pub root: i32,
    pub stream: usize,
    pub pos: u64,
    pub vc: Vc,
    pub thread: ThreadId,
    pub grouped: bool,
    /// [`CollKind::SendRecv`]: the blocks sent and received, per peer (`count` is then the
    /// elements sent in all, `send` and `recv` are 0).
    pub peers: Peers,
}

pub struct Coll {
    pub clique: usize,
    pub seq: u64,
    pub parts: Vec<Option<Part>>,
    /// Ran: every part's data moved at once.
    pub executed: bool,
    /// Per rank: that rank's part will never run (its communicator was aborted, or the parts
    /// mismatched). It completes on its own stream without moving data; the other ranks' parts
    /// stay blocked until they are cancelled too, as a real NCCL kernel whose peer aborted never
    /// completes.
    pub cancelled: Vec<bool>,
    /// Cross-process cliques: this process's parts were written for the other processes.
    pub published: bool,
}

pub struct Clique {
    pub id: [u8; 128],
    pub nranks: usize,
    /// Per rank: its communicator and device, once it joined.
    pub comms: Vec<Option<usize>>,
    pub devices: Vec<Option<usize>>,
    pub next_seq: Vec<u64>,
    /// Set once every rank joined and the clique was checked (Err: why it was refused).
    pub ready: Option<Result<(), String>>,
    /// Cliques of `ncclCommInitRank`: the folder through which ranks in other processes join
    /// and exchange data (see `xproc`). `None` for `ncclCommInitAll`.
    pub shm: Option<std::path::PathBuf>,
    /// Per rank, once the clique is complete: the rank lives in another process (`rank-<r>`).
    pub remote: Vec<Option<crate::xproc::RankFile>>,
    /// A rank's process was found gone (reported once; the communicators report
    /// `ncclRemoteError`).
    pub broken: bool,
    /// This process's ranks have left the folder (their communicators ended).
    pub left: bool,
    /// Every rank was seen joining (the ranks of other processes, and the verdict); this
    /// process's ranks said so in the folder and wait for the others to say the same.
    #[allow(clippy::type_complexity)]
    pub met: Option<(Vec<Option<crate::xproc::RankFile>>, Result<(), String>)>,
}

impl Clique {
    /// Whether some rank lives in another process.
    pub fn xproc(&self) -> bool {
        self.remote.iter().any(Option::is_some)
    }
}

pub struct Comm {
    pub clique: usize,
    pub rank: usize,
    pub device: usize,
    pub live: bool,
    pub async_error: i32,
    /// Made with `ncclCommInitRankConfig` and `blocking = 0`: calls return `ncclInProgress`.
    pub nonblocking: bool,
    /// Polls of `ncclCommGetAsyncError` that still answer `ncclInProgress` for the last call.
    pub busy: u32,
    /// A poll has answered `ncclSuccess` once (the communicator is fully created).
    pub created: bool,
}

pub struct State {
    pub cfg: Config,
    pub initialized: bool,
    pub mem: Memory,
    allocs: HashMap<u64, AllocInfo>,
    pub ctxs: Vec<Ctx>,
    pub streams: Vec<Stream>,
    pub events: Vec<Event>,
    pub modules: Vec<LoadedModule>,
    pub functions: Vec<Function>,
    /// (from device, to device): kernels on `from` may touch memory of `to`.
    pub peer: HashSet<(usize, usize)>,
    /// (pool's device, accessing device) -> the access `cuMemPoolSetAccess` granted
    /// (`CU_MEM_ACCESS_FLAGS_PROT_READ` 1 or `_READWRITE` 3): kernels on the accessing device
    /// may read (1) or read and write (3) that pool's memory.
    pub pool_access: HashMap<(usize, usize), i32>,
    /// Bytes allocated per device (live allocations), against `cfg.mem_bytes`.
    pub used: Vec<u64>,
    /// Joined into every operation enqueued after a host wait.
    pub host_vc: Vc,
    pub cliques: Vec<Clique>,
    pub comms: Vec<Comm>,
    pub colls: Vec<Coll>,
    pub coll_index: HashMap<(usize, u64), usize>,
    pub next_unique_id: u64,
    /// Page-locked host allocations (`cuMemHostAlloc`): address -> length.
    pub pinned: std::collections::BTreeMap<usize, usize>,
    /// The delays' generator (a splitmix64 state), with `cfg.seed`.
    rng: u64,
    /// Allocations whose free is queued and has not run yet: calls made after the free
    /// refuse them, as they would the freed memory.
    pub freeing: HashSet<u64>,
}

static STATE: OnceLock<(Mutex<State>, Condvar)> = OnceLock::new();

fn global() -> &'static (Mutex<State>, Condvar) {
    STATE.get_or_init(|| {
        let cfg = Config::from_env();
        let gpus = cfg.gpus;
        let seed = cfg.seed.unwrap_or(0);
        let ctxs = (0..cfg.gpus)
            .map(|device| Ctx {
                device,
                retained: 0,
                null_stream: None,
                sticky: None,
            })
            .collect();
        (
            Mutex::new(State {
                cfg,
                initialized: false,
                mem: Memory::default(),
                allocs: HashMap::new(),
                ctxs,
                streams: Vec::new(),
                events: Vec::new(),
                modules: Vec::new(),
                functions: Vec::new(),
                peer: HashSet::new(),
                pool_access: HashMap::new(),
                used: vec![0; gpus],
                host_vc: Vc::default(),
                cliques: Vec::new(),
                comms: Vec::new(),
                colls: Vec::new(),
                coll_index: HashMap::new(),
                next_unique_id: 1,
                pinned: Default::default(),
                rng: seed,
                freeing: HashSet::new(),
            }),
            Condvar::new(),
        )
    })
}

/// The state, locked. A panic while it was held (a bug here) does not wedge later calls.
pub fn lock() -> MutexGuard<'static, State> {
    global().0.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wakes every thread blocked in a host wait: call after any change that may unblock one.
pub fn notify() {
    global().1.notify_all();
}

/// Blocks until `done` holds, running the ready work of the streams in `upto`, up to their
/// positions there (and what that waits for), itself, as soon as it is ready, rather than
/// leaving it to the device's worker. After
/// `cfg.hang` it gives up, reports `what` and returns false.
pub fn wait_until(
    mut st: MutexGuard<'static, State>,
    upto: &[(usize, u64)],
    what: &dyn Fn() -> String,
    done: &dyn Fn(&State) -> bool,
) -> (MutexGuard<'static, State>, bool) {
    let start = Instant::now();
    loop {
        if st.run_ready(&Scope::Upto(upto)) {
            // What ran may unblock work the device's worker holds.
            notify();
        }
        if done(&st) {
            return (st, true);
        }
        if start.elapsed() > st.cfg.hang {
            report(&format!(
                "{} has waited {:?} and cannot finish: a real GPU would hang here (a deadlock: \
                 work waits for something nobody will do). Failing it instead \
                 (KVSTORE_STANDIN_HANG_S).",
                what(),
                st.cfg.hang
            ));
            return (st, false);
        }
        st = global()
            .1
            .wait_timeout(st, Duration::from_millis(20))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

extern "C" {
    /// The C library's `atexit`, from the libc every process that loads the stand-in has.
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

/// At exit: the work still queued runs, and this process's ranks leave the folders of the
/// cliques whose communicators were never ended, so that the last process removes them.
extern "C" fn leave_at_exit() {
    let Some((m, _)) = STATE.get() else { return };
    // The lock is held only briefly (waits release it), unless exit was called from another
    // thread in the middle of a call: then the folders stay behind rather than the exit
    // deadlocking.
    let mut st = None;
    for _ in 0..200 {
        match m.try_lock() {
            Ok(g) => st = Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => st = Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
        }
        break;
    }
    let Some(mut st) = st else { return };
    // Work still queued runs now, so that its errors (a race, a fault) are reported rather
    // than lost with the process.
    st.run_ready(&Scope::All);
    for k in 0..st.cliques.len() {
        let c = &st.cliques[k];
        if let (false, Some(dir)) = (c.left, &c.shm) {
            let ranks: Vec<usize> = (0..c.nranks).filter(|&r| c.comms[r].is_some()).collect();
            crate::xproc::leave(dir, &ranks, c.nranks);
            st.cliques[k].left = true;
        }
    }
}

/// Registers [`leave_at_exit`] once (at a process's first clique with a folder).
pub fn leave_folders_at_exit() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: `leave_at_exit` is an `extern "C" fn()` that lives as long as the process
        // (this library is never unloaded while its state exists: nothing calls dlclose on it
        // in kvstore), as atexit requires.
        if unsafe { atexit(leave_at_exit) } != 0 {
            report("atexit refused the stand-in's clean-up: folders of cliques may stay behind");
        }
    });
}

/// Starts, once, the device's worker: a thread that runs each queued operation when its delay
/// is over (in stream order, after what it waits for), as a GPU runs work while the host goes
/// on. With a clique spanning processes it also looks every few milliseconds for parts that
/// other processes published, as a GPU progresses while every host thread is busy elsewhere
/// (in MPI, say).
pub fn start_worker() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        leave_folders_at_exit();
        let spawned = std::thread::Builder::new()
            .name("kvstore-standin-device".into())
            .spawn(|| {
                let mut st = lock();
                loop {
                    if st.run_ready(&Scope::Due) {
                        notify();
                    }
                    let now = Instant::now();
                    let xproc = st.cliques.iter().any(|c| c.ready.is_some() && c.xproc());
                    let mut sleep = if xproc {
                        Duration::from_millis(5)
                    } else {
                        Duration::from_millis(200)
                    };
                    // The next front operation to fall due. One already due is blocked (by
                    // an event, or a collective's other ranks): what unblocks it wakes this
                    // thread (an enqueue, a host wait that ran work) or is polled for above.
                    let next = st
                        .streams
                        .iter()
                        .filter_map(|s| s.queue.front())
                        .map(|o| o.due)
                        .filter(|&due| due > now)
                        .min();
                    if let Some(due) = next {
                        sleep = sleep.min(due - now);
                    }
                    st = global()
                        .1
                        .wait_timeout(st, sleep.max(Duration::from_micros(200)))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            });
        if let Err(e) = spawned {
            report(&format!(
                "cannot start the thread that runs queued work: only host waits will run it ({e})"
            ));
        }
    });
}

thread_local! {
    static CURRENT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The context current on this thread.
pub fn current_ctx() -> Option<usize> {
    CURRENT.with(|c| c.get())
}

pub fn set_current_ctx(ctx: Option<usize>) {
    CURRENT.with(|c| c.set(ctx));
}

/// The code for an interpreter error: bounds and freed memory are illegal addresses.
fn kernel_error_code(message: &str) -> i32 {
    if message.contains("misaligned") {
        cu::MISALIGNED_ADDRESS
    } else if message.contains("out of bounds") || message.contains("use after free") {
        cu::ILLEGAL_ADDRESS
    } else {
        cu::LAUNCH_FAILED
    }
}

/// NCCL element sizes by `ncclDataType_t`; `None` for an unknown type.
pub fn nccl_elem_size(dtype: i32) -> Option<usize> {
    Some(match dtype {
        0 | 1 => 1,
        2 | 3 => 4,
        4 | 5 => 8,
        6 => 2,
        7 => 4,
        8 => 8,
        9 => 2,
        _ => return None,
    })
}

impl State {
    /// The stream a `CUstream` handle names: 0 is the current context's NULL stream.
    pub fn stream(&mut self, h: *mut std::ffi::c_void) -> Result<usize, i32> {
        if h.is_null() {
            let ctx = current_ctx().ok_or(cu::INVALID_CONTEXT)?;
            if let Some(s) = self.ctxs[ctx].null_stream {
                return Ok(s);
            }
            let s = self.new_stream(ctx);
            self.ctxs[ctx].null_stream = Some(s);
            return Ok(s);
        }
        match unhandle(Kind::Stream, h) {
            Some(s) if s < self.streams.len() && self.streams[s].live => Ok(s),
            _ => Err(cu::INVALID_HANDLE),
        }
    }

    pub fn new_stream(&mut self, ctx: usize) -> usize {
        self.streams.push(Stream {
            ctx,
            queue: VecDeque::new(),
            enq: 0,
            done: 0,
            vc: Vc::default(),
            live: true,
            errors: Vec::new(),
        });
        self.streams.len() - 1
    }

    pub fn device_of_stream(&self, s: usize) -> usize {
        self.ctxs[self.streams[s].ctx].device
    }

    /// Describes stream `s` for messages.
    pub fn stream_name(&self, s: usize) -> String {
        format!("stream {s} (gpu {})", self.device_of_stream(s))
    }

    /// A new allocation of `len` bytes on `device` (filled with 0xff), from a memory pool when
    /// `pooled`. `Err(CUDA_ERROR_OUT_OF_MEMORY)` when the device's memory
    /// (`KVSTORE_STANDIN_MEM_GIB`) cannot hold it besides what is allocated already.
    pub fn alloc(&mut self, device: usize, len: usize, pooled: bool) -> Result<u64, i32> {
        let len64 = len as u64;
        let fits = |st: &State| len64 <= st.cfg.mem_bytes.saturating_sub(st.used[device]);
        if !fits(self) {
            // Memory whose free is queued comes back once the free runs, which a GPU would
            // have done by now: run what is ready, and look again.
            self.run_ready(&Scope::All);
            if !fits(self) {
                return Err(cu::OUT_OF_MEMORY);
            }
        }
        // The interpreter keeps each allocation in a slot of 4 GiB.
        if len64 >= 1 << 32 {
            report(&format!(
                "an allocation of {len} bytes: the stand-in holds at most 4 GiB per allocation \
                 (a GPU would give it if it had the memory); refused as out of memory"
            ));
            return Err(cu::OUT_OF_MEMORY);
        }
        let base = self.mem.alloc_filled(len, 0xff);
        self.used[device] += len64;
        self.allocs.insert(
            base,
            AllocInfo {
                device,
                len: len64,
                pooled,
                accesses: Vec::new(),
            },
        );
        Ok(base)
    }

    /// Frees the allocation at `base` (its bytes, and its share of its device's memory).
    fn release(&mut self, base: u64) -> anyhow::Result<()> {
        self.freeing.remove(&base);
        self.mem.free(base)?;
        if let Some(info) = self.allocs.remove(&base) {
            self.used[info.device] -= info.len;
        }
        Ok(())
    }

    /// Whether a kernel on device `from` may touch the allocation at `base` (`write`: also
    /// write it): its own device's memory always; another device's through peer access
    /// (`cuCtxEnablePeerAccess`) for plain allocations, or through the pool's access
    /// (`cuMemPoolSetAccess`) for memory from a pool, which peer access does not cover (the
    /// CUDA programming guide, "Stream Ordered Memory Allocator": pool allocation accessibility
    /// "does not follow cudaDeviceEnablePeerAccess or cuCtxEnablePeerAccess").
    fn check_kernel_reach(&self, from: usize, base: u64, write: bool) -> Result<(), (i32, String)> {
        let info = &self.allocs[&base];
        if !info.pooled {
            return self.check_peer(from, info.device, base);
        }
        let to = info.device;
        let granted = self.pool_access.get(&(to, from)).copied().unwrap_or(0);
        if from == to || granted == 3 || (granted == 1 && !write) {
            return Ok(());
        }
        Err((
            cu::PEER_ACCESS_NOT_ENABLED,
            format!(
                "a kernel on gpu {from} {} {base:#x}, memory of gpu {to} from its memory pool \
                 (cuMemAllocAsync), and gpu {to}'s pool grants gpu {from} {}: pool memory needs \
                 cuMemPoolSetAccess (cuCtxEnablePeerAccess{} does not cover it); on a GPU this \
                 is an illegal-address fault",
                if write { "writes" } else { "reads" },
                match granted {
                    1 => "only read access",
                    _ => "no access",
                },
                if self.peer.contains(&(from, to)) {
                    ", which is enabled,"
                } else {
                    ""
                }
            ),
        ))
    }

    /// Destroys everything of context `ctx` and clears its sticky error, as resetting a
    /// primary context does: its streams, events, modules and functions are dead handles, its
    /// queued work is dropped, its device's memory is freed, and its peer access is gone.
    pub fn reset_ctx(&mut self, ctx: usize) {
        let device = self.ctxs[ctx].device;
        for st in self.streams.iter_mut().filter(|st| st.ctx == ctx) {
            st.live = false;
            st.queue.clear();
            st.done = st.enq;
            st.errors.clear();
        }
        for e in self.events.iter_mut().filter(|e| e.ctx == ctx) {
            e.live = false;
        }
        for m in self.modules.iter_mut().filter(|m| m.ctx == ctx) {
            m.live = false;
        }
        for f in self.functions.iter_mut().filter(|f| f.ctx == ctx) {
            f.live = false;
        }
        let mine: Vec<u64> = self
            .allocs
            .iter()
            .filter(|(_, a)| a.device == device)
            .map(|(&base, _)| base)
            .collect();
        for base in mine {
            let _ = self.release(base);
        }
        self.peer
            .retain(|&(from, to)| from != device && to != device);
        self.pool_access
            .retain(|&(pool, from), _| pool != device && from != device);
        self.ctxs[ctx].null_stream = None;
        self.ctxs[ctx].sticky = None;
        notify();
    }

    /// The device and base of the live allocation holding `[addr, addr + len)`, for a call's
    /// checks: an allocation whose free is queued is refused too.
    pub fn locate(&self, addr: u64, len: usize) -> Result<(usize, u64), String> {
        let (device, base) = self.find_alloc(addr, len)?;
        if self.freeing.contains(&base) {
            return Err(format!(
                "{addr:#x} is in the allocation at {base:#x}, which an earlier call freed (its \
                 free is queued)"
            ));
        }
        Ok((device, base))
    }

    /// [`State::locate`] as queued work sees it when it runs: frees queued after it do not
    /// count.
    fn find_alloc(&self, addr: u64, len: usize) -> Result<(usize, u64), String> {
        let (base, _) = self
            .mem
            .allocation(addr, len as u64)
            .map_err(|e| format!("{e:#}"))?;
        Ok((self.allocs[&base].device, base))
    }

    /// Appends an operation to stream `s`, for the device's worker to run after its delay (or
    /// a host wait, sooner). Returns its position.
    pub fn enqueue(&mut self, s: usize, what: String, work: Work) -> u64 {
        let (pos, _) = self.push_op(s, what, work);
        pos
    }

    /// The delay of the next operation: `cfg.delay`, or with a seed a draw from
    /// `[0, 2 * cfg.delay)`.
    fn next_delay(&mut self) -> Duration {
        let Some(_) = self.cfg.seed else {
            return self.cfg.delay;
        };
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let unit = (z >> 11) as f64 / (1u64 << 53) as f64;
        self.cfg.delay.mul_f64(2.0 * unit)
    }

    /// Appends an operation to stream `s` without running anything; its position and clock.
    pub fn push_op(&mut self, s: usize, what: String, work: Work) -> (u64, Vc) {
        start_worker();
        notify();
        let due = Instant::now() + self.next_delay();
        let host = self.host_vc.clone();
        let st = &mut self.streams[s];
        st.vc.join(&host);
        st.enq += 1;
        let clock = st.vc.get(s) + 1;
        st.vc.set(s, clock);
        let pos = st.enq;
        st.queue.push_back(Op {
            pos,
            vc: st.vc.clone(),
            what: what.into(),
            work,
            due,
        });
        (pos, st.vc.clone())
    }

    /// The error of the operation at `pos` on `s`, once it ran and failed (reported once).
    pub fn take_error_at(&mut self, s: usize, pos: u64) -> i32 {
        let errors = &mut self.streams[s].errors;
        match errors.iter().position(|&(p, _)| p == pos) {
            Some(i) => errors.remove(i).1,
            None => cu::SUCCESS,
        }
    }

    /// The first unreported error of an operation at or before `pos` on `s` (all of them are
    /// reported by this).
    pub fn take_errors_upto(&mut self, s: usize, pos: u64) -> i32 {
        let errors = &mut self.streams[s].errors;
        let first = errors.iter().find(|&&(p, _)| p <= pos).map(|&(_, c)| c);
        errors.retain(|&(p, _)| p > pos);
        first.unwrap_or(cu::SUCCESS)
    }

    /// Runs the operations `scope` covers that are at the front of their streams and ready,
    /// until none is. Returns whether any ran.
    pub fn run_ready(&mut self, scope: &Scope) -> bool {
        self.poll_cliques();
        let now = Instant::now();
        // Per stream, the last position this call may run.
        let mut limit = vec![0u64; self.streams.len()];
        match scope {
            Scope::Due | Scope::All => limit.fill(u64::MAX),
            Scope::Upto(list) => {
                for &(s, upto) in *list {
                    limit[s] = limit[s].max(upto);
                }
            }
        }
        let due_only = matches!(scope, Scope::Due);
        let mut any = false;
        loop {
            let mut moved = false;
            for s in 0..self.streams.len() {
                while let Some(op) = self.streams[s].queue.front() {
                    if op.pos > limit[s] || (due_only && op.due > now) {
                        break;
                    }
                    let ready = match op.work {
                        Work::Coll { coll, rank } => self.coll_ready(coll, rank),
                        _ => self.ready(op),
                    };
                    if !ready {
                        // A host wait also runs what this operation waits for, that far.
                        if !due_only {
                            for (t, upto) in self.waits_for(s) {
                                if limit[t] < upto {
                                    limit[t] = upto;
                                    moved = true;
                                }
                            }
                        }
                        break;
                    }
                    let op = self.streams[s].queue.pop_front().expect("front exists");
                    self.run_op(s, op);
                    moved = true;
                    any = true;
                }
            }
            if !moved {
                return any;
            }
        }
    }

    /// What the front operation of `s` waits for: (stream, position) pairs.
    fn waits_for(&self, s: usize) -> Vec<(usize, u64)> {
        match self.streams[s].queue.front().map(|o| &o.work) {
            Some(Work::Wait { stream, upto }) => vec![(*stream, *upto)],
            Some(Work::Coll { coll, .. }) => self.colls[*coll]
                .parts
                .iter()
                .flatten()
                .map(|p| (p.stream, p.pos))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Runs one operation taken from the front of stream `s`, recording its error.
    fn run_op(&mut self, s: usize, op: Op) {
        let ctx = self.streams[s].ctx;
        if let Some(code) = self.ctxs[ctx].sticky {
            // A poisoned context runs nothing more: its queued work fails.
            self.streams[s].errors.push((op.pos, code));
        } else if let Err((code, message)) = self.execute(s, &op) {
            report(&format!("{}: {message}", op.what));
            if is_sticky(code) && matches!(op.work, Work::Launch { .. }) {
                report(&format!(
                    "the context of gpu {} is now unusable (a sticky error, as CUDA's): every \
                     later call on it fails with this code",
                    self.ctxs[ctx].device
                ));
                self.ctxs[ctx].sticky = Some(code);
            }
            self.streams[s].errors.push((op.pos, code));
        }
        self.streams[s].done += 1;
    }

    fn ready(&self, op: &Op) -> bool {
        match op.work {
            Work::Wait { stream, upto } => self.streams[stream].done >= upto,
            _ => true,
        }
    }

    /// Whether rank `rank`'s part of collective `coll` (at the front of its stream) may run:
    /// every part of this process is at the front of its stream and, for a clique spanning
    /// processes, every other process's part has arrived. On the way it publishes this
    /// process's parts (once), and notices a rank whose process is gone.
    fn coll_ready(&mut self, coll: usize, rank: usize) -> bool {
        let c = &self.colls[coll];
        if c.executed || c.cancelled[rank] {
            return true;
        }
        let k = c.clique;
        let clique = &self.cliques[k];
        let here_at_front = c.parts.iter().enumerate().all(|(r, p)| {
            clique.remote[r].is_some()
                || p.as_ref().is_some_and(|p| {
                    self.streams[p.stream].queue.front().map(|o| o.pos) == Some(p.pos)
                })
        });
        if !here_at_front {
            return false;
        }
        if !clique.xproc() {
            return true;
        }
        let dir = clique
            .shm
            .clone()
            .expect("a clique spanning processes has a folder");
        let seq = c.seq;
        if !c.published {
            self.colls[coll].published = true;
            if let Err(m) = self.publish(coll, &dir) {
                self.break_clique(k, nc::SYSTEM_ERROR, &format!("collective #{seq}: {m}"));
                return false;
            }
        }
        let clique = &self.cliques[k];
        let missing: Vec<(usize, crate::xproc::RankFile)> = clique
            .remote
            .iter()
            .enumerate()
            .filter_map(|(r, f)| f.map(|f| (r, f)))
            .filter(|&(r, _)| !crate::xproc::arrived(&dir, seq, r))
            .collect();
        if missing.is_empty() {
            return true;
        }
        // KVSTORE_STANDIN_SILENT_LOSS: as NCCL between the GPUs of one machine, never report a
        // peer that died; its collectives wait until ncclCommAbort.
        if !clique.broken && std::env::var_os("KVSTORE_STANDIN_SILENT_LOSS").is_none() {
            if let Some((r, f)) = missing
                .iter()
                .find(|(_, f)| !crate::xproc::alive(f.pid, f.start))
            {
                self.break_clique(
                    k,
                    nc::REMOTE_ERROR,
                    &format!(
                        "collective #{seq} of clique {k}: rank {r} (process {}) exited before \
                         its part arrived. Real NCCL's kernels would wait for it forever; the \
                         communicators of this process now report ncclRemoteError from \
                         ncclCommGetAsyncError, and their collectives stay blocked until \
                         ncclCommAbort",
                        f.pid
                    ),
                );
            }
        }
        false
    }

    /// Writes this process's parts of cross-process collective `coll` for every other process.
    fn publish(&mut self, coll: usize, dir: &std::path::Path) -> Result<(), String> {
        let c = &self.colls[coll];
        let clique = &self.cliques[c.clique];
        let n = c.parts.len();
        let mut pids: Vec<u32> = clique.remote.iter().flatten().map(|f| f.pid).collect();
        pids.sort_unstable();
        pids.dedup();
        for (r, p) in c.parts.iter().enumerate() {
            let Some(p) = p else { continue };
            let es = nccl_elem_size(p.dtype).expect("checked at issue");
            let len = send_len(p.kind, p.count * es, n, r, p.root);
            let data = if p.kind == CollKind::SendRecv {
                // The per-peer counts, then the blocks sent, in peer order.
                let mut blocks = Vec::with_capacity(len);
                for (q, b) in p.peers.sends.iter().enumerate() {
                    if let Some((addr, count)) = b.filter(|&(_, c)| c > 0) {
                        let bytes = self
                            .mem
                            .read(addr, count * es)
                            .map_err(|e| format!("rank {r}'s send buffer for peer {q}: {e:#}"))?;
                        blocks.extend_from_slice(&bytes);
                    }
                }
                crate::xproc::p2p_payload(&p.peers.send_counts(), &p.peers.recv_counts(), &blocks)
            } else if len > 0 {
                self.mem
                    .read(p.send, len)
                    .map_err(|e| format!("rank {r}'s send buffer: {e:#}"))?
            } else {
                Vec::new()
            };
            let h = crate::xproc::Header::of(p);
            for &pid in &pids {
                crate::xproc::publish(dir, c.seq, r, pid, &h, &data)?;
            }
        }
        Ok(())
    }

    /// Reports `message` and makes every communicator of this process in clique `k` report
    /// `code` from `ncclCommGetAsyncError` (once per clique).
    pub fn break_clique(&mut self, k: usize, code: i32, message: &str) {
        if self.cliques[k].broken {
            return;
        }
        self.cliques[k].broken = true;
        report(message);
        for c in self.cliques[k].comms.clone().into_iter().flatten() {
            if self.comms[c].async_error == nc::SUCCESS {
                self.comms[c].async_error = code;
            }
        }
    }

    /// Completes the cliques still waiting for ranks of other processes, where those have
    /// joined.
    fn poll_cliques(&mut self) {
        for k in 0..self.cliques.len() {
            let c = &self.cliques[k];
            if c.ready.is_none() && c.shm.is_some() && c.comms.iter().any(Option::is_some) {
                self.try_complete(k);
            }
        }
    }

    /// Marks clique `k` ready (or refused) if every rank has joined, here or in another
    /// process.
    pub fn try_complete(&mut self, k: usize) {
        let c = &self.cliques[k];
        if c.ready.is_some() {
            return;
        }
        let n = c.nranks;
        if let (Some((remote, ready)), Some(dir)) = (&c.met, &c.shm) {
            // Every rank was seen here; waiting for the others to say the same.
            if (0..n).all(|r| remote[r].is_none() || crate::xproc::has_seen_all(dir, r)) {
                let (remote, ready) = (remote.clone(), ready.clone());
                let c = &mut self.cliques[k];
                c.remote = remote;
                c.ready = Some(ready);
                notify();
            }
            return;
        }
        let (pid, _) = crate::xproc::me();
        let mut devices = Vec::with_capacity(n);
        let mut remote = vec![None; n];
        let mut wrong_size = None;
        for (r, slot) in remote.iter_mut().enumerate() {
            if let Some(d) = c.devices[r] {
                devices.push(d);
                continue;
            }
            let Some(dir) = &c.shm else { return };
            match crate::xproc::read_rank(dir, r) {
                Some(f) if f.pid != pid && crate::xproc::alive(f.pid, f.start) => {
                    if f.nranks != n && wrong_size.is_none() {
                        wrong_size = Some(format!(
                            "rank {r} (process {}) says {} ranks, this process {n}",
                            f.pid, f.nranks
                        ));
                    }
                    devices.push(f.device);
                    *slot = Some(f);
                }
                _ => return,
            }
        }
        // Ranks of one machine on one device number share that GPU, whichever process they
        // are in. NCCL's `initTransportsRank` (src/init.cc, right after the first AllGather of
        // peer info) refuses two ranks with the same host hash and GPU UUID with
        // ncclInvalidUsage unless `NCCL_MULTI_RANK_GPU_ENABLE` is set ("Multiple Ranks are
        // using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this
        // configuration."); older releases say "Duplicate GPU detected". The version bound
        // (2.30) is the one kvstore's tests assume, where the switch appeared.
        let mut sorted = devices.clone();
        sorted.sort_unstable();
        sorted.dedup();
        let multi_ok = self.cfg.nccl_version >= 23000
            && std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").as_deref() == Ok("1");
        let ready = if let Some(m) = wrong_size {
            Err(m)
        } else if sorted.len() < devices.len() && !multi_ok {
            Err(format!(
                "Duplicate GPU detected: the ranks of one communicator are on devices \
                 {devices:?}; NCCL before 2.30, or without NCCL_MULTI_RANK_GPU_ENABLE=1, refuses \
                 two ranks on one GPU (NCCL 2.30: Multiple Ranks are using the same \
                 GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.)"
            ))
        } else {
            Ok(())
        };
        let xproc = remote.iter().any(Option::is_some);
        let c = &mut self.cliques[k];
        match (xproc, &c.shm) {
            (true, Some(dir)) => {
                // Joining is a collective: no rank's init returns before every rank has seen
                // every other (a rank that saw all and exited at once must not leave a slower
                // one waiting for a process that is gone).
                let mine: Vec<usize> = (0..n).filter(|&r| c.devices[r].is_some()).collect();
                crate::xproc::announce(dir, &mine);
                c.met = Some((remote, ready));
                self.try_complete(k);
            }
            (_, shm) => {
                if let Some(dir) = shm {
                    // Every rank is in this process: nobody else needs the folder.
                    let _ = std::fs::remove_dir_all(dir);
                    c.left = true;
                }
                c.ready = Some(ready);
                notify();
            }
        }
    }

    /// Checks an access of `[lo, hi)` bytes of the allocation at `base` by an operation of
    /// stream `s` with clock `vc` against earlier accesses of other streams, and records it.
    fn access(
        &mut self,
        base: u64,
        (lo, hi): (u64, u64),
        write: bool,
        s: usize,
        vc: &Vc,
        what: &Arc<str>,
    ) -> Result<(), (i32, String)> {
        let Some(info) = self.allocs.get_mut(&base) else {
            // Its free ran first: a free on another stream not ordered after this operation.
            return Err((
                cu::ILLEGAL_ADDRESS,
                format!(
                    "the allocation at {base:#x} was freed before this operation ran (`{what}`): \
                     a free on another stream with nothing ordering it after this"
                ),
            ));
        };
        let device = info.device;
        for r in &info.accesses {
            let overlap = r.lo < hi && lo < r.hi;
            if r.stream != s && overlap && (r.write || write) && r.clock > vc.get(r.stream) {
                return Err((
                    cu::ILLEGAL_STATE,
                    format!(
                        "race: this {} bytes {lo}..{hi} of the allocation at {base:#x} (gpu \
                         {device}), which `{}` {} on stream {} with nothing ordering the two \
                         (no event recorded after it and waited for here, no host wait in \
                         between)",
                        if write { "writes" } else { "reads" },
                        r.what,
                        if r.write { "wrote" } else { "read" },
                        r.stream
                    ),
                ));
            }
        }
        info.accesses.retain(|r| {
            let before = r.clock <= vc.get(r.stream);
            !(before && r.lo >= lo && r.hi <= hi && (write || !r.write))
        });
        if info.accesses.len() > 256 {
            // Bound the list: forget accesses already ordered before this one.
            info.accesses.retain(|r| r.clock > vc.get(r.stream));
        }
        info.accesses.push(Access {
            lo,
            hi,
            stream: s,
            clock: vc.get(s),
            write,
            what: what.clone(),
        });
        Ok(())
    }

    /// Checks an access of `len` bytes at `addr` by stream `s`: the memory is live, in bounds,
    /// on the stream's device or one it has peer access to, and not racing.
    fn touch(
        &mut self,
        addr: u64,
        len: usize,
        write: bool,
        s: usize,
        op: &Op,
        staged: bool,
    ) -> Result<(), (i32, String)> {
        if len == 0 {
            return Ok(());
        }
        let (device, base) = self
            .find_alloc(addr, len)
            .map_err(|e| (cu::ILLEGAL_ADDRESS, e))?;
        if !staged {
            self.check_peer(self.device_of_stream(s), device, addr)?;
        }
        self.access(
            base,
            (addr - base, addr - base + len as u64),
            write,
            s,
            &op.vc,
            &op.what,
        )
    }

    /// Whether work on device `from` may touch memory of device `to`.
    pub fn check_peer(&self, from: usize, to: usize, addr: u64) -> Result<(), (i32, String)> {
        if from == to || self.peer.contains(&(from, to)) {
            return Ok(());
        }
        Err((
            cu::PEER_ACCESS_NOT_ENABLED,
            format!(
                "gpu {from} touches {addr:#x}, memory of gpu {to}, and peer access from gpu \
                 {from} to gpu {to} was never enabled (cuCtxEnablePeerAccess); copy with \
                 cuMemcpyPeerAsync instead"
            ),
        ))
    }

    /// Fills the `len` page-locked bytes at `dst` with [`POISON`] for a device-to-host copy
    /// into them that was just asked for, except the bytes a queued copy still reads (from
    /// pinned memory) or writes (into it): the host handed those to that copy first. Returns
    /// what the destination holds now, which the new copy expects to find when it runs.
    pub fn poison_pinned(&mut self, dst: usize, len: usize) -> Vec<u8> {
        let mut busy = vec![false; len];
        for op in self.streams.iter().flat_map(|t| t.queue.iter()) {
            let Some((at, n)) = op.work.pinned_span() else {
                continue;
            };
            let (lo, hi) = (at.max(dst), (at + n).min(dst + len));
            if lo < hi {
                busy[lo - dst..hi - dst].fill(true);
            }
        }
        // SAFETY: `dst..dst + len` lies inside a live page-locked allocation of this driver
        // (the caller checked), which the caller of the copy handed to it.
        let now = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
        for (b, busy) in now.iter_mut().zip(busy) {
            if !busy {
                *b = POISON;
            }
        }
        now.to_vec()
    }

    /// The queued copies from or into the `len` page-locked bytes at `at`: (stream, position).
    pub fn pinned_users(&self, at: usize, len: usize) -> Vec<(usize, u64)> {
        let mut users = Vec::new();
        for (s, t) in self.streams.iter().enumerate() {
            for op in &t.queue {
                let Some((lo, n)) = op.work.pinned_span() else {
                    continue;
                };
                if lo < at + len && at < lo + n {
                    users.push((s, op.pos));
                }
            }
        }
        users
    }

    /// A copy (operation `pos` of stream `s`) wrote `bytes` into page-locked memory at `dst`:
    /// the copies still queued that read or write those bytes after it, in stream order or
    /// through events, now expect them. Copies not ordered after it keep their expectation,
    /// so that they report the race when they run.
    fn pinned_written(&mut self, s: usize, pos: u64, dst: usize, bytes: &[u8]) {
        let end = dst + bytes.len();
        for t in &mut self.streams {
            for op in t.queue.iter_mut() {
                if op.vc.get(s) < pos {
                    continue;
                }
                let (at, seen) = match &mut op.work {
                    Work::DtoHPinned { dst: d, expect, .. } => (*d, expect),
                    Work::HtoDPinned { src, snapshot, .. } => (*src, snapshot),
                    _ => continue,
                };
                let (lo, hi) = (at.max(dst), (at + seen.len()).min(end));
                if lo < hi {
                    seen[lo - at..hi - at].copy_from_slice(&bytes[lo - dst..hi - dst]);
                }
            }
        }
    }

    /// The base of the page-locked allocation holding `[addr, addr + len)`, if there is one.
    pub fn pinned_range(&self, addr: usize, len: usize) -> Option<usize> {
        let (&base, &size) = self.pinned.range(..=addr).next_back()?;
        (addr + len <= base + size).then_some(base)
    }

    fn execute(&mut self, s: usize, op: &Op) -> Result<(), (i32, String)> {
        let host = |e: anyhow::Error| (cu::ILLEGAL_ADDRESS, format!("{e:#}"));
        match &op.work {
            Work::Nothing | Work::Wait { .. } => Ok(()),
            Work::Alloc { base, len } => self.access(*base, (0, *len), true, s, &op.vc, &op.what),
            Work::Free { base } => {
                let len = self.mem.allocation(*base, 0).map_err(host)?.1;
                // Freed even when the free races with another stream's access (reported).
                let raced = self.touch(*base, len as usize, true, s, op, true);
                self.release(*base).map_err(host)?;
                raced
            }
            Work::HtoD { dst, data } => {
                self.touch(*dst, data.len(), true, s, op, true)?;
                self.mem.write(*dst, data).map_err(host)
            }
            Work::HtoDPinned { dst, src, snapshot } => {
                let len = snapshot.len();
                if self.pinned_range(*src, len).is_none() {
                    return Err((
                        cu::ILLEGAL_ADDRESS,
                        format!(
                            "{}: its pinned host source {src:#x} was freed before the copy ran",
                            op.what
                        ),
                    ));
                }
                // SAFETY: `src..src + len` lies inside a live page-locked allocation of this
                // driver (checked just above); it is only read.
                let now = unsafe { std::slice::from_raw_parts(*src as *const u8, len) };
                if now != snapshot.as_slice() {
                    return Err((
                        cu::ILLEGAL_ADDRESS,
                        format!(
                            "{}: the pinned host buffer was rewritten before the copy from it \
                             ran (a race between the host and the stream: wait for the copy \
                             before reusing the buffer)",
                            op.what
                        ),
                    ));
                }
                self.touch(*dst, len, true, s, op, true)?;
                self.mem.write(*dst, now).map_err(host)
            }
            Work::DtoH { dst, src, len } => {
                self.touch(*src, *len, false, s, op, true)?;
                let bytes = self.mem.read(*src, *len).map_err(host)?;
                // SAFETY: `dst` is the host buffer of the cuMemcpyDtoH* call that enqueued this
                // operation; that call blocks until the operation ran (or cancels it, turning it
                // into `Work::Nothing`, before it returns), so the buffer is live and holds
                // `len` bytes, as the caller promised the driver.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), *dst as *mut u8, *len) };
                Ok(())
            }
            Work::DtoHPinned { dst, src, expect } => {
                let len = expect.len();
                if self.pinned_range(*dst, len).is_none() {
                    return Err((
                        cu::ILLEGAL_ADDRESS,
                        format!(
                            "{}: its pinned host destination {dst:#x} was freed before the copy \
                             ran",
                            op.what
                        ),
                    ));
                }
                // SAFETY: `dst..dst + len` lies inside a live page-locked allocation of this
                // driver (checked just above).
                let now = unsafe { std::slice::from_raw_parts_mut(*dst as *mut u8, len) };
                if now != expect.as_slice() {
                    return Err((
                        cu::ILLEGAL_ADDRESS,
                        format!(
                            "{}: the pinned destination changed before the copy into it ran: \
                             the host wrote it (wait for the copy, with an event or a stream \
                             synchronize, before touching the buffer), or another copy into it \
                             that is not ordered with this one ran",
                            op.what
                        ),
                    ));
                }
                self.touch(*src, len, false, s, op, true)?;
                let bytes = self.mem.read(*src, len).map_err(host)?;
                now.copy_from_slice(&bytes);
                self.pinned_written(s, op.pos, *dst, &bytes);
                Ok(())
            }
            Work::DtoD {
                dst,
                src,
                len,
                staged,
            } => {
                self.touch(*src, *len, false, s, op, *staged)?;
                self.touch(*dst, *len, true, s, op, *staged)?;
                let bytes = self.mem.read(*src, *len).map_err(host)?;
                self.mem.write(*dst, &bytes).map_err(host)
            }
            Work::Memset { dst, value, len } => {
                self.touch(*dst, *len, true, s, op, false)?;
                self.mem.write(*dst, &vec![*value; *len]).map_err(host)
            }
            Work::Launch {
                func,
                grid,
                block,
                args,
                counts,
            } => {
                let f = &self.functions[*func];
                let module = f.module.clone();
                let entry = &module.entries[f.entry];
                let blocks =
                    emu::launch(entry, &mut self.mem, *grid, *block, args).map_err(|e| {
                        let m = format!("{e:#}");
                        (kernel_error_code(&m), format!("kernel {}: {m}", entry.name))
                    })?;
                if let Some(c) = counts {
                    crate::calls::add_to(c, crate::calls::BLOCKS_IDLE, blocks.idle);
                }
                let device = self.device_of_stream(s);
                for t in self.mem.touched() {
                    self.check_kernel_reach(device, t.base, t.write.is_some())?;
                    if let Some(r) = t.read {
                        self.access(t.base, r, false, s, &op.vc, &op.what)?;
                    }
                    if let Some(w) = t.write {
                        self.access(t.base, w, true, s, &op.vc, &op.what)?;
                    }
                }
                Ok(())
            }
            Work::Coll { coll, rank } => {
                let c = &self.colls[*coll];
                if c.executed {
                    return Ok(());
                }
                if c.cancelled[*rank] {
                    return self.aborted_part(*coll, *rank);
                }
                self.colls[*coll].executed = true;
                self.run_collective(*coll)
            }
        }
    }

    /// Rank `rank`'s cancelled part of collective `coll` runs: it moves no data, but an aborted
    /// NCCL kernel may have read and written its buffers before it saw the abort flag, so the
    /// part reads what it sends and writes what it receives, as the stream's operation. A free
    /// or reuse of those buffers not ordered after it (by stream order, an event, or a host wait
    /// such as the one `ncclCommAbort` of a process's last rank does) is a race, and memory
    /// freed before it ran is a use after free.
    fn aborted_part(&mut self, coll: usize, rank: usize) -> Result<(), (i32, String)> {
        let Some(p) = self.colls[coll].parts[rank].clone() else {
            return Ok(());
        };
        let n = self.colls[coll].parts.len();
        let seq = self.colls[coll].seq;
        let what = format!(
            "aborted nccl {:?} (collective #{seq} over {n} ranks)",
            p.kind
        );
        let es = nccl_elem_size(p.dtype).expect("checked at issue");
        let mut spans: Vec<(u64, usize, bool)> = Vec::new();
        if p.kind == CollKind::SendRecv {
            for (blocks, write) in [(&p.peers.sends, false), (&p.peers.recvs, true)] {
                for &(addr, count) in blocks.iter().flatten() {
                    spans.push((addr, count * es, write));
                }
            }
        } else {
            let bytes = p.count * es;
            spans.push((p.send, send_len(p.kind, bytes, n, rank, p.root), false));
            if p.kind != CollKind::Reduce || rank == p.root as usize {
                let len = match p.kind {
                    CollKind::AllGather => bytes * n,
                    _ => bytes,
                };
                spans.push((p.recv, len, true));
            }
        }
        for (addr, len, write) in spans.into_iter().filter(|s| s.1 > 0) {
            self.part_access(&p, rank, &what, addr, len, write)?;
        }
        Ok(())
    }

    /// Moves a collective's data, every rank's part at once (all are at their streams' fronts;
    /// the parts of ranks in other processes come from the files they published, checked
    /// against this process's parts first). Only this process's ranks receive.
    fn run_collective(&mut self, coll: usize) -> Result<(), (i32, String)> {
        let parts: Vec<Option<Part>> = self.colls[coll].parts.clone();
        if parts.iter().flatten().any(|p| p.kind == CollKind::SendRecv) {
            return self.run_send_recv(coll);
        }
        let (k, seq) = (self.colls[coll].clique, self.colls[coll].seq);
        let n = parts.len();
        let (r0, p0) = parts
            .iter()
            .enumerate()
            .find_map(|(r, p)| p.clone().map(|p| (r, p)))
            .expect("a part of this process");
        let es = nccl_elem_size(p0.dtype).expect("checked at issue");
        let count = p0.count;
        let bytes = count * es;
        let root = p0.root as usize;
        let what: Arc<str> = format!(
            "nccl {:?} of {count} elements over {n} ranks (clique {k})",
            p0.kind
        )
        .into();
        // The other processes' parts: every header must agree with this process's parts.
        let mut remote: Vec<Option<Vec<u8>>> = vec![None; n];
        if let (true, Some(dir)) = (self.cliques[k].xproc(), self.cliques[k].shm.clone()) {
            let mine = crate::xproc::Header::of(&p0);
            let mut mismatch = None;
            for (r, slot) in remote.iter_mut().enumerate() {
                let Some(f) = self.cliques[k].remote[r] else {
                    continue;
                };
                let (h, data) =
                    crate::xproc::take(&dir, seq, r).map_err(|m| (cu::LAUNCH_FAILED, m))?;
                let want = send_len(h.kind, h.count * es, n, r, h.root);
                if mismatch.is_none() {
                    mismatch = crate::xproc::differ(&h, &mine)
                        .map(|d| {
                            format!("rank {r} (process {}) and rank {r0} differ in {d}", f.pid)
                        })
                        .or_else(|| {
                            (data.len() != want).then(|| {
                                format!("rank {r} sent {} bytes, {want} expected", data.len())
                            })
                        });
                }
                *slot = Some(data);
            }
            if let Some(d) = mismatch {
                return Err(self.refuse_remote(coll, &d));
            }
        }
        let check = |st: &mut State, r: usize, addr: u64, len: usize, write: bool| {
            let p = parts[r].as_ref().expect("a part of this process");
            st.part_access(p, r, &what, addr, len, write)
        };
        // What each rank sends: read here (after the race check) or published by its process.
        let mut inputs: Vec<Vec<u8>> = vec![Vec::new(); n];
        for r in 0..n {
            let len = send_len(p0.kind, bytes, n, r, p0.root);
            match &parts[r] {
                Some(p) if len > 0 => {
                    check(self, r, p.send, len, false)?;
                    inputs[r] = self
                        .mem
                        .read(p.send, len)
                        .map_err(|e| (cu::ILLEGAL_ADDRESS, format!("{e:#}")))?;
                }
                Some(_) => {}
                None => inputs[r] = remote[r].take().unwrap_or_default(),
            }
        }
        // What each rank of this process receives.
        let receives = |r: usize| p0.kind != CollKind::Reduce || r == root;
        let recv_len = match p0.kind {
            CollKind::AllGather => bytes * n,
            _ => bytes,
        };
        for (r, p) in parts.iter().enumerate() {
            if let Some(p) = p.as_ref().filter(|_| receives(r)) {
                check(self, r, p.recv, recv_len, true)?;
            }
        }
        let sum = |ins: &[&[u8]]| reduce_bytes(p0.dtype, p0.op, ins);
        let total = match p0.kind {
            CollKind::Reduce | CollKind::AllReduce => {
                let ins: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                Some(sum(&ins))
            }
            CollKind::AllGather => Some(inputs.concat()),
            CollKind::Broadcast => Some(inputs[root].clone()),
            CollKind::ReduceScatter => None,
            CollKind::SendRecv => unreachable!("run_send_recv moves point-to-point data"),
        };
        for (r, p) in parts.iter().enumerate() {
            let Some(p) = p.as_ref().filter(|_| receives(r)) else {
                continue;
            };
            let out = match &total {
                Some(t) => t.clone(),
                None => {
                    let ins: Vec<&[u8]> = inputs
                        .iter()
                        .map(|i| &i[r * bytes..(r + 1) * bytes])
                        .collect();
                    sum(&ins)
                }
            };
            self.mem
                .write(p.recv, &out)
                .map_err(|e| (cu::ILLEGAL_ADDRESS, format!("{e:#}")))?;
        }
        Ok(())
    }
}

impl State {
    /// Refuses collective `coll` after the parts of other processes disagreed with this
    /// process's (`d` says how): every part of it is cancelled, the clique is broken, and this
    /// process's communicators report ncclInvalidUsage. Returns the stream operation's error.
    fn refuse_remote(&mut self, coll: usize, d: &str) -> (i32, String) {
        let (k, seq) = (self.colls[coll].clique, self.colls[coll].seq);
        let message = format!(
            "collective #{seq} of clique {k}: {d}; every rank must make the same call (real \
             NCCL would hang or corrupt memory). The communicators of this process now report \
             ncclInvalidUsage from ncclCommGetAsyncError"
        );
        self.cliques[k].broken = true;
        for c in self.cliques[k].comms.clone().into_iter().flatten() {
            self.comms[c].async_error = nc::INVALID_USAGE;
        }
        self.colls[coll].cancelled.fill(true);
        (cu::LAUNCH_FAILED, message)
    }

    /// Checks and records an access of `len` bytes at `addr` by rank `r`'s part `p` of a
    /// collective (`what` names it), as its stream's operation: `write` for what it receives.
    fn part_access(
        &mut self,
        p: &Part,
        r: usize,
        what: &str,
        addr: u64,
        len: usize,
        write: bool,
    ) -> Result<(), (i32, String)> {
        let (_, base) = self
            .find_alloc(addr, len)
            .map_err(|e| (cu::ILLEGAL_ADDRESS, format!("{what}, rank {r}: {e}")))?;
        let what_r: Arc<str> = format!("{what}, rank {r}").into();
        self.access(
            base,
            (addr - base, addr - base + len as u64),
            write,
            p.stream,
            &p.vc,
            &what_r,
        )
    }

    /// Moves the data of point-to-point collective `coll` (`ncclSend` / `ncclRecv`): every
    /// receiving rank of this process gets, from each peer it receives from, exactly the block
    /// that peer sends it (bytes, copied). The parts of ranks in other processes come from
    /// their files (per-peer counts, then the blocks sent, in peer order); every pair of ranks
    /// is checked first, here too, so every process sees a disagreement.
    fn run_send_recv(&mut self, coll: usize) -> Result<(), (i32, String)> {
        let parts: Vec<Option<Part>> = self.colls[coll].parts.clone();
        let (k, seq) = (self.colls[coll].clique, self.colls[coll].seq);
        let n = parts.len();
        let (r0, p0) = parts
            .iter()
            .enumerate()
            .find_map(|(r, p)| p.clone().map(|p| (r, p)))
            .expect("a part of this process");
        let es = nccl_elem_size(p0.dtype).expect("checked at issue");
        let what = format!("nccl SendRecv (collective #{seq} over {n} ranks, clique {k})");
        // Per rank: the elements it sends to and receives from each peer (empty: unknown).
        let mut sends: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut recvs: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (r, p) in parts.iter().enumerate() {
            if let Some(p) = p {
                sends[r] = p.peers.send_counts();
                recvs[r] = p.peers.recv_counts();
            }
        }
        // The blocks ranks of other processes send, concatenated in peer order.
        let mut remote: Vec<Vec<u8>> = vec![Vec::new(); n];
        if let (true, Some(dir)) = (self.cliques[k].xproc(), self.cliques[k].shm.clone()) {
            let mine = crate::xproc::Header::of(&p0);
            let mut mismatch = None;
            for r in 0..n {
                let Some(f) = self.cliques[k].remote[r] else {
                    continue;
                };
                let (h, data) =
                    crate::xproc::take(&dir, seq, r).map_err(|m| (cu::LAUNCH_FAILED, m))?;
                if mismatch.is_some() {
                    continue;
                }
                if let Some(d) = crate::xproc::differ(&h, &mine) {
                    mismatch = Some(format!(
                        "rank {r} (process {}) and rank {r0} differ in {d}",
                        f.pid
                    ));
                    continue;
                }
                match crate::xproc::p2p_split(&data, n, h.count, es) {
                    Ok((s, rc, blocks)) => {
                        (sends[r], recvs[r]) = (s, rc);
                        remote[r] = blocks.to_vec();
                    }
                    Err(m) => mismatch = Some(format!("rank {r} (process {}): {m}", f.pid)),
                }
            }
            if let Some(d) = mismatch.or_else(|| p2p_mismatch(&sends, &recvs)) {
                return Err(self.refuse_remote(coll, &d));
            }
        }
        // block[q][r]: what rank q sends rank r, where r is of this process. This process's
        // senders' blocks are read (for every peer, as the kernel reads them) after the race
        // check; other processes' come from their files.
        let mut block: Vec<Vec<Vec<u8>>> = vec![vec![Vec::new(); n]; n];
        for q in 0..n {
            match &parts[q] {
                Some(p) => {
                    for (r, b) in p.peers.sends.iter().enumerate() {
                        let Some((addr, count)) = b.filter(|&(_, c)| c > 0) else {
                            continue;
                        };
                        self.part_access(p, q, &what, addr, count * es, false)?;
                        block[q][r] = self
                            .mem
                            .read(addr, count * es)
                            .map_err(|e| (cu::ILLEGAL_ADDRESS, format!("{e:#}")))?;
                    }
                }
                None => {
                    let mut at = 0;
                    for r in 0..n {
                        let len = sends[q].get(r).copied().unwrap_or(0) * es;
                        if parts[r].is_some() {
                            block[q][r] = remote[q][at..at + len].to_vec();
                        }
                        at += len;
                    }
                }
            }
        }
        let mut writes = Vec::new();
        for (r, p) in parts.iter().enumerate() {
            let Some(p) = p else { continue };
            for (q, b) in p.peers.recvs.iter().enumerate() {
                let Some((addr, count)) = b.filter(|&(_, c)| c > 0) else {
                    continue;
                };
                self.part_access(p, r, &what, addr, count * es, true)?;
                writes.push((addr, std::mem::take(&mut block[q][r])));
            }
        }
        for (addr, bytes) in writes {
            self.mem
                .write(addr, &bytes)
                .map_err(|e| (cu::ILLEGAL_ADDRESS, format!("{e:#}")))?;
        }
        Ok(())
    }
}

/// The bytes rank `r` sends in a collective of `kind` whose per-rank size is `bytes`, over `n`
/// ranks (a reduce-scatter sends every slice; a broadcast's other ranks send nothing).
pub fn send_len(kind: CollKind, bytes: usize, n: usize, r: usize, root: i32) -> usize {
    match kind {
        CollKind::ReduceScatter => bytes * n,
        CollKind::Broadcast if r != root as usize => 0,
        _ => bytes,
    }
}

/// Element-wise reduction of equally long byte buffers of NCCL `dtype` with `op` (sum, prod,
/// max, min, avg), in rank order, each step rounded to the type as NCCL's kernels do.
fn reduce_bytes(dtype: i32, op: i32, ins: &[&[u8]]) -> Vec<u8> {
    let n = ins.len();
    let fold_f64 = |a: f64, b: f64| match op {
        1 => a * b,
        2 => a.max(b),
        3 => a.min(b),
        _ => a + b,
    };
    let finish = |a: f64| if op == 4 { a / n as f64 } else { a };
    let es = nccl_elem_size(dtype).expect("checked at issue");
    let elems = ins[0].len() / es;
    let mut out = Vec::with_capacity(ins[0].len());
    for i in 0..elems {
        let at = |k: usize| &ins[k][i * es..(i + 1) * es];
        match dtype {
            7 => {
                let get = |k| f32::from_le_bytes(at(k).try_into().expect("4 bytes"));
                let mut a = get(0);
                for k in 1..n {
                    a = match op {
                        1 => a * get(k),
                        2 => a.max(get(k)),
                        3 => a.min(get(k)),
                        _ => a + get(k),
                    };
                }
                if op == 4 {
                    a /= n as f32;
                }
                out.extend_from_slice(&a.to_le_bytes());
            }
            8 => {
                let get = |k| f64::from_le_bytes(at(k).try_into().expect("8 bytes"));
                let a = (1..n).fold(get(0), |a, k| fold_f64(a, get(k)));
                out.extend_from_slice(&finish(a).to_le_bytes());
            }
            6 => {
                let get = |k| f16::from_le_bytes(at(k).try_into().expect("2 bytes")).to_f64();
                let a = (1..n).fold(get(0), |a, k| f16::from_f64(fold_f64(a, get(k))).to_f64());
                out.extend_from_slice(&f16::from_f64(finish(a)).to_le_bytes());
            }
            9 => {
                let get = |k| bf16::from_le_bytes(at(k).try_into().expect("2 bytes")).to_f64();
                let a = (1..n).fold(get(0), |a, k| bf16::from_f64(fold_f64(a, get(k))).to_f64());
                out.extend_from_slice(&bf16::from_f64(finish(a)).to_le_bytes());
            }
            _ => {
                // Integers: summed with wrap-around, as two's complement adds in any width.
                let get = |k: usize| {
                    let mut b = [0u8; 8];
                    b[..es].copy_from_slice(at(k));
                    u64::from_le_bytes(b)
                };
                let a = (1..n).fold(get(0), |a, k| a.wrapping_add(get(k)));
                out.extend_from_slice(&a.to_le_bytes()[..es]);
            }
        }
    }
    out
}

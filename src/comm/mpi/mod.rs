//! The across-process transport of `dist_*` stores: MPI for CPU ranks (cargo feature `mpi`).
//!
//! # The world
//!
//! [`World::get`] initialises MPI once per process (a binary started without `mpirun` is a
//! one-rank world) and returns the process-wide [`World`]: rank, size, and the local rank and
//! size on this machine (from a shared-memory split). The store's collectives run on a
//! duplicate of `MPI_COMM_WORLD`; a second duplicate carries the control records of a failure
//! (below). Both return MPI errors instead of aborting (`MPI_ERRORS_RETURN`). If `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK` or `LOCAL_WORLD_SIZE` is set (torchrun, srun wrappers) and
//! disagrees with MPI, [`World::get`] fails with [`Error::DistEnv`] naming the variable.
//!
//! **Threads.** The store is `Send + Sync`, so MPI runs at `MPI_THREAD_SERIALIZED` and every
//! MPI call is made under the world's one state mutex. Collectives must be issued in the same
//! order on every rank, so the store serialises its calls anyway; `MPI_THREAD_MULTIPLE` would
//! add locking to every MPI call (and some MPI builds lack it). A [`Call`] holds the mutex from
//! [`World::begin`] until it is dropped, so one call's collectives never interleave another's.
//!
//! # One call
//!
//! [`World::begin`] numbers a store call (the same number on every rank of a correct program)
//! and, unless `KVSTORE_DIST_CHECK=0`, compares its [`Fingerprint`] across ranks
//! ([`crate::comm::fingerprint`]): a mismatch is [`Error::Desync`] on every rank. The call then
//! starts non-blocking collectives on owned buffers ([`Call::reduce_sum`], [`Call::broadcast`],
//! ...) and waits for them ([`Call::wait`], [`Call::wait_all`]) or polls them ([`Call::test`]).
//! Where every rank has just agreed to start the same collectives, they may run blocking
//! ([`Call::set_blocking`]), bounded by a watchdog thread (`blocking.rs`).
//!
//! # No hang, and no kill for a slow rank
//!
//! Every wait is bounded by `KVSTORE_TIMEOUT` seconds (default [`DEFAULT_TIMEOUT`], whose
//! documentation says why a slow rank is not a dead one). Every `KVSTORE_WAIT_LOG_SECS` of a
//! wait, the rank asks the others where they are and logs it (the line is in docs/dist.md) as
//! a `log` warning, or on stderr without a logger. A rank waiting in a kvstore call or at its
//! exit answers at once; one busy outside kvstore does not.
//!
//! A pending MPI collective can be neither finished nor cancelled, so on a timeout the rank
//! tells the others where it is and listens for a grace period (half the timeout, 0.5 to 5 s).
//! [`Error::Timeout`] names the op, the keys, the missing ranks and where each one is ("rank 2
//! is at call #18 (pull of key 5)", or "not responding"). The abandoned buffers are leaked.
//!
//! MPI's setup (`MPI_Init` and the splits after it) waits for every rank and cannot be
//! cancelled either: a rank still in it after `KVSTORE_TIMEOUT` says why on stderr and ends
//! its process with exit code 1 (it cannot return: its thread is inside MPI).
//!
//! After a timeout, a desync, a rank that exited or a failed MPI call the world is
//! **poisoned**: every later call fails at once with [`Error::DistFailed`] naming the first
//! failure.
//!
//! # Exit
//!
//! A world in a static is never dropped, so [`World::get`] registers an exit hook (glibc's
//! `on_exit`, which gives the exit status; `atexit` elsewhere). It runs on `exit` and on return
//! from `main` (also after a panic unwinds out of it: code 101), not on a signal or `abort`; a
//! chained panic hook records the last panic. At exit every rank tells every other rank, on
//! the control communicator, that it exits, after which call, and whether it failed. Then:
//!
//! - **A failing rank** (non-zero exit status; where it is unknown, a recorded panic; or a
//!   poisoned world) says why, waits at most one grace period for the others to reach their
//!   exit (so that those in a call can report it), and calls `MPI_Abort` with its exit status
//!   (1 for a poisoned world exiting 0). It never finalizes: Open MPI 4.1's `mpirun` lets the
//!   other ranks run on when a rank finalizes and then exits non-zero.
//! - **A healthy rank** waits for every rank to reach its exit (an `MPI_Ibarrier` on the
//!   control communicator), frees its communicators and calls `MPI_Finalize`. This wait has
//!   **no time limit**, so a rank still working (writing the model, say) is never killed by
//!   another's normal exit; it answers questions and logs whom it waits for meanwhile, aborts
//!   at once if an exit record says a rank failed, and `mpirun` ends the job if a rank dies.
//! - **A rank waiting in a call** that an exited rank never made (its last call is earlier)
//!   fails with [`Error::RankExited`], poisoning its world, so its own exit aborts the job. A
//!   rank that exited in or after this call is no reason to stop: its part may be done, and if
//!   it failed, its `MPI_Abort` ends the job. A rank that fails because another exited relays
//!   that exit in its own record, so every rank names the first.
//!
//! A call still running on another thread at exit makes the hook abort the job after two
//! seconds. `mpirun` ends the job when a rank is killed by a signal; the survivors' own timeout
//! is the backstop.
//!
//! # A lost rank, under fault tolerance
//!
//! Under `mpirun --with-ft ulfm` with an MPI that has ULFM (`ulfm.rs`), a call that loses a
//! rank revokes the world, and the store's survivors go on: every call that changes the store
//! ends at a fault-tolerant agreement ([`Call::commit_point`], or [`World::settle_commit`] for a
//! survivor that failed before it), then [`World::shrink`] makes the next generation of the
//! world among the survivors, where they hold a strict majority. [`World::get`] returns the
//! newest generation, and its exit is the one the exit hook runs (with `_exit`, not
//! `MPI_Finalize`, which can hang after a loss). Nothing runs blocking under fault tolerance.
//!
//! # Environment
//!
//! `KVSTORE_TIMEOUT`, `KVSTORE_WAIT_LOG_SECS` and `KVSTORE_DIST_CHECK` (see [`crate::config`]);
//! a bad value of any of them is [`Error::DistEnv`] naming the variable, from [`World::get`].

mod blocking;
mod collective;
mod control;
mod exit;
mod hierarchy;
mod hosts;
mod poll;
mod raw;
// Only with test-util (the crate's tests and examples): a user's build never reads its variables.
#[cfg(feature = "test-util")]
mod test_hook;
mod ulfm;

use std::collections::BTreeMap;
use std::io::Write;
use std::os::raw::c_int;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use mpi::environment::{Threading, Universe};
use mpi::ffi;

pub use crate::comm::fingerprint::Fingerprint;
use crate::comm::points::{Agreed, Point, Points, Vote};
/// The default of `KVSTORE_TIMEOUT` (30 minutes): one constant for every distributed wait.
pub use crate::config::DEFAULT_TIMEOUT;
pub(crate) use collective::Group;
pub use collective::{Done, Pending, Wire};
pub(crate) use hierarchy::Layout;

use crate::{Error, Key, Result};
use control::{Here, Report, Watch, Whereabouts, REPORT_BYTES, TAG_HERE, TAG_WHERE};
use poll::Backoff;
use raw::{Comm, Request};

/// The process-wide distributed world. See the [module documentation](self).
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    /// The number of machines: ranks of local rank 0.
    machines: usize,
    /// Several machines of several ranks each: how sliced keys travel in two stages.
    layout: Option<hierarchy::Layout>,
    /// Every rank's host name, in rank order (see [`hosts`]): errors name a lost rank's host.
    hosts: Vec<String>,
    /// Each rank's machine, as the lowest rank on it.
    machine_of: Vec<usize>,
    timeout: Duration,
    /// How often a long wait logs whom it waits for (`KVSTORE_WAIT_LOG_SECS`).
    wait_log: Duration,
    check: bool,
    /// Every MPI call on the world's communicators is made with this locked.
    state: Mutex<State>,
    /// The first failure's message; set once, never cleared.
    poison: Mutex<Option<String>>,
    /// An environment variable that disagrees with MPI: (variable, message).
    env_error: Option<(String, String)>,
    /// The MPI universe, when this world initialised MPI; dropping it calls `MPI_Finalize`.
    universe: Mutex<Option<Universe>>,
    /// The number of distributed stores created in this process so far.
    stores: std::sync::atomic::AtomicU64,
    /// The bound on blocking collectives.
    watchdog: blocking::Watchdog,
    /// 0 for the world `mpirun` started; one more for each time survivors went on without
    /// lost ranks ([`World::shrink`]).
    generation: u64,
    /// The world the survivors of this one went on in, once they have.
    successor: OnceLock<&'static World>,
    /// The ranks of the previous generation lost when this one began (empty for the first).
    lost_before: Vec<usize>,
    /// Whether a call saw a rank lost (ULFM): [`World::shrink`] may go on without it.
    saw_loss: std::sync::atomic::AtomicBool,
    /// Why this side stopped after a lost rank: it held no majority of the ranks.
    stopped: OnceLock<String>,
}

/// A world the survivors of a lost rank went on in ([`World::shrink`]).
pub(crate) struct Shrunk {
    /// The new world.
    pub(crate) world: &'static World,
    /// The ranks lost, numbered as in the world before.
    pub(crate) lost: Vec<usize>,
}

/// What the state mutex guards.
struct State {
    /// The communicator of the store's collectives.
    data: Comm,
    /// The communicator of failure reports and of the exit barrier.
    control: Comm,
    /// With a [`hierarchy::Layout`]: the communicators of this rank's machine and of its local
    /// rank across machines.
    stages: Option<(Comm, Comm)>,
    /// The number of the last call begun.
    seq: u64,
    /// Where this rank is, for answers to other ranks.
    here: Here,
    /// The questions of ranks that timed out, heard while waiting, by rank.
    heard: BTreeMap<usize, Report>,
    /// The exit records of the ranks that have exited, by rank.
    exits: BTreeMap<usize, Report>,
    /// The number of the last question this rank asked.
    next_query: u32,
    /// Set by the exit hook: no call may begin any more.
    closed: bool,
    /// The rank whose exit failed this world first, and how, relayed in this rank's exit.
    caused_by: Option<(usize, String)>,
    /// Sent control records whose sends may not have completed: kept alive, never freed early.
    outbox: Vec<(Request, Box<[u8; REPORT_BYTES]>)>,
    /// The f32 buffers of the last blocking f16/bf16 reduce ([`Call::reduce_sum_borrowed`]).
    wide: (Vec<f32>, Vec<f32>),
    /// The buffers of the other ranks' blocks, kept between calls ([`collective::Staged`]).
    staged: collective::Staged,
    /// Under an MPI with ULFM, a test failed (see [`ulfm`]): whether its error's class said a
    /// rank was lost or the communicator revoked (`MPI_ERR_IN_STATUS` without statuses hides
    /// it; [`Call::named_loss`] then asks MPI which ranks failed).
    loss_seen: Option<bool>,
    /// The ranks lost (ULFM), as this rank learnt of them.
    lost: Vec<usize>,
    /// Under fault tolerance: the agreements of the call begun last, its commit and end points
    /// ([`Call::commit_point`], [`Call::end_point`]), which every survivor passes.
    points: Points,
    /// When [`Call::loss_known`] last asked MPI.
    asked_loss: Option<Instant>,
}

static WORLD: OnceLock<Result<World, (String, String)>> = OnceLock::new();

/// The newest generation of the world, once survivors have gone on without lost ranks.
static NEWEST: std::sync::RwLock<Option<&'static World>> = std::sync::RwLock::new(None);

/// What the world's split into machines found.
struct Split {
    /// Rank, size, local rank and local size.
    counts: [usize; 4],
    /// The number of machines.
    machines: usize,
    layout: Option<hierarchy::Layout>,
    /// With a layout: the communicators of this machine and of this local rank across machines.
    comms: Option<(Comm, Comm)>,
    /// Each rank's machine, as the lowest rank on it.
    machine_of: Vec<usize>,
}

/// Splits `world` into the ranks sharing memory with this one (numbered by `key`), into
/// `local`. Under `test-util`, `KVSTORE_TEST_MACHINES=N` splits it into N machines of
/// consecutive ranks instead (`N:rr`: ranks dealt round robin, as `--map-by node` places
/// them), so that one box tests what several machines run.
///
/// # Safety
/// MPI is initialised, `world` is a valid communicator and `local` a valid out-pointer.
unsafe fn split_machines(world: ffi::MPI_Comm, key: c_int, local: &mut ffi::MPI_Comm) -> c_int {
    #[cfg(feature = "test-util")]
    if let Some((n, round_robin)) = std::env::var("KVSTORE_TEST_MACHINES").ok().and_then(|v| {
        let (n, rr) = v
            .split_once(':')
            .map_or((v.as_str(), false), |(n, how)| (n, how == "rr"));
        n.parse::<c_int>().ok().filter(|&n| n > 0).map(|n| (n, rr))
    }) {
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: as the caller promises; the out-pointers are valid locals.
        unsafe {
            ffi::MPI_Comm_rank(world, &mut rank);
            ffi::MPI_Comm_size(world, &mut size);
            let per = (size + n - 1) / n;
            let machine = if round_robin {
                rank % n
            } else {
                rank / per.max(1)
            };
            return ffi::MPI_Comm_split(world, machine, rank, local);
        }
    }
    let (shared, info) = (ffi::RSMPI_COMM_TYPE_SHARED, ffi::RSMPI_INFO_NULL);
    // SAFETY: as the caller promises.
    unsafe { ffi::MPI_Comm_split_type(world, shared, key, info, local) }
}

/// The local rank an MPI launcher gave this process: Open MPI's `OMPI_COMM_WORLD_LOCAL_RANK`,
/// or MPICH's (Hydra's) `MPI_LOCALRANKID`. The store's local rank follows it, so that it picks
/// the GPU the user's script picks from the same variable (Open MPI 5 does not always number a
/// machine's ranks in world-rank order). A value that is not a number is ignored.
fn mpi_launcher_local_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// Compares an environment variable a launcher may set with what MPI says.
fn env_agrees(var: &str, mpi_value: usize, what: &str) -> Option<(String, String)> {
    let v = std::env::var(var).ok()?;
    let message = match v.trim().parse::<usize>() {
        Ok(n) if n == mpi_value => return None,
        Ok(n) => format!(
            "{var}={n} but MPI says this process's {what} is {mpi_value}: the launcher's \
             variables and MPI disagree (was this process started without mpirun, or with a \
             stale {var}?); start every rank with `mpirun -np N`, or unset {var}"
        ),
        Err(_) => format!("'{v}' is not a number; unset {var} or set it to {mpi_value}"),
    };
    Some((var.to_owned(), message))
}

/// Ends this process if the world's setup lasts past `timeout`, until the sender is dropped.
fn bound_setup(timeout: Duration) -> std::sync::mpsc::Sender<()> {
    bound_wait(
        timeout,
        "creating a dist store did not finish within KVSTORE_TIMEOUT: MPI's setup waits for \
         every rank, so some rank has not created its dist store (it failed, waits on \
         something else, or makes its calls in another order); MPI cannot cancel the wait",
    )
}

/// Ends this process with exit code 1, saying `what` went wrong, if a wait MPI cannot cancel
/// lasts past `timeout`, until the sender is dropped.
fn bound_wait(timeout: Duration, what: &'static str) -> std::sync::mpsc::Sender<()> {
    let (done, setup) = std::sync::mpsc::channel::<()>();
    let watch = move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = setup.recv_timeout(timeout) {
            // Written whatever happens to stderr (a closed pipe must not stop the exit).
            let _ = writeln!(
                std::io::stderr(),
                "kvstore: {what} ({} s), so this process ends with exit code 1",
                timeout.as_secs_f64()
            );
            // SAFETY: `_exit` ends the process at once, without running exit handlers, which
            // would call into MPI while another thread of this process is inside MPI_Init.
            unsafe { libc::_exit(1) }
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("kvstore-mpi-setup-bound".to_owned())
        .spawn(watch)
    {
        eprintln!("kvstore: could not start the bound on MPI's setup ({e}); it is unbounded");
    }
    done
}

impl World {
    /// The process-wide world, initialising MPI on the first call (see [the module](self)).
    pub fn get() -> Result<&'static World> {
        if let Some(newest) = *NEWEST.read().unwrap_or_else(|p| p.into_inner()) {
            return Ok(newest);
        }
        match WORLD.get_or_init(World::init) {
            Ok(World {
                env_error: Some((var, message)),
                ..
            })
            | Err((var, message)) => Err(Error::dist_env(var, message.clone())),
            Ok(w) => Ok(w),
        }
    }

    fn init() -> Result<World, (String, String)> {
        let as_pair = |e: Error| match e {
            Error::DistEnv { var, message } => (var, message),
            other => ("MPI".to_owned(), other.to_string()),
        };
        let config = crate::config::Config::from_env().map_err(as_pair)?;
        let timeout = config.timeout;

        // Disarmed when dropped, as this function returns.
        let _bound = bound_setup(timeout);
        // Without a universe someone else initialised MPI: use it, but leave finalizing to them.
        let (universe, level) = match mpi::initialize_with_threading(Threading::Serialized) {
            Some((u, provided)) => (Some(u), provided),
            None => (None, mpi::environment::threading_support()),
        };
        if level < Threading::Serialized {
            let message = match universe {
                Some(_) => format!(
                    "this MPI library provides thread level {level:?} but kvstore needs \
                     MPI_THREAD_SERIALIZED; use an MPI built with thread support (Open MPI and \
                     MPICH are)"
                ),
                None => format!(
                    "MPI was initialised by someone else with thread level {level:?}; kvstore \
                     needs MPI_THREAD_SERIALIZED: initialise it with \
                     mpi::initialize_with_threading(Threading::Serialized) or higher"
                ),
            };
            return Err(("MPI".to_owned(), message));
        }

        // SAFETY: RSMPI_COMM_WORLD is a constant handle that rsmpi's C shim exports.
        let base = unsafe { ffi::RSMPI_COMM_WORLD };
        let mut world = World::on(base, &config, 0).map_err(as_pair)?;

        // From here on MPI is initialised by us: the exit hook must run whatever happens.
        exit::install_panic_hook();
        if !exit::register() {
            eprintln!("kvstore: could not register the MPI exit hook; MPI will not be finalized");
        }

        let (rank, size) = (world.rank, world.size);
        let (local_rank, local_size) = (world.local_rank, world.local_size);
        let env_error = env_agrees("RANK", rank, "rank")
            .or_else(|| env_agrees("WORLD_SIZE", size, "world size"))
            .or_else(|| env_agrees("LOCAL_RANK", local_rank, "local rank"))
            .or_else(|| env_agrees("LOCAL_WORLD_SIZE", local_size, "local world size"));
        world.poison = Mutex::new(
            env_error
                .as_ref()
                .map(|(var, message)| format!("distributed setup: {var}: {message}")),
        );
        world.env_error = env_error;
        world.universe = Mutex::new(universe);
        Ok(world)
    }

    /// A world of the ranks of `base` (`MPI_COMM_WORLD`, or the survivors of a lost rank),
    /// as generation `generation`: its communicators, machines and host names.
    fn on(base: ffi::MPI_Comm, config: &crate::config::Config, generation: u64) -> Result<World> {
        let (timeout, wait_log, check) = (config.timeout, config.wait_log, config.dist_check);
        let (split, data, control) = Self::communicators(base)?;
        let [rank, size, local_rank, local_size] = split.counts;
        let hosts = hosts::gather(control.0, size)?;
        let watchdog =
            blocking::Watchdog::start((rank, &hosts), timeout, wait_log).map_err(|message| {
                Error::Mpi {
                    op: "initialise MPI",
                    message,
                }
            })?;
        Ok(World {
            rank,
            size,
            local_rank,
            local_size,
            machines: split.machines,
            layout: split.layout,
            hosts,
            machine_of: split.machine_of,
            timeout,
            wait_log,
            check,
            state: Mutex::new(State {
                data,
                control,
                stages: split.comms,
                seq: 0,
                here: Here::idle(0, "not in a call"),
                heard: BTreeMap::new(),
                exits: BTreeMap::new(),
                next_query: 0,
                closed: false,
                caused_by: None,
                outbox: Vec::new(),
                wide: (Vec::new(), Vec::new()),
                staged: collective::Staged::with_cap(collective::staged_cap(config.pool_bytes)),
                loss_seen: None,
                lost: Vec::new(),
                points: Points::default(),
                asked_loss: None,
            }),
            poison: Mutex::new(None),
            env_error: None,
            universe: Mutex::new(None),
            stores: std::sync::atomic::AtomicU64::new(0),
            watchdog,
            generation,
            successor: OnceLock::new(),
            lost_before: Vec::new(),
            saw_loss: std::sync::atomic::AtomicBool::new(false),
            stopped: OnceLock::new(),
        })
    }

    /// Rank, size, local rank and size, the machines, and the two duplicated communicators,
    /// of the ranks of `world`.
    fn communicators(world: ffi::MPI_Comm) -> Result<(Split, Comm, Comm)> {
        const OP: &str = "initialise MPI";
        let [mut rank, mut size, mut local_rank, mut local_size]: [c_int; 4] = [0; 4];
        // SAFETY: MPI is initialised (above); every out-pointer is a valid local, and the
        // gathered buffer holds two ints per rank of the world; the world communicator and the
        // constants are handles rsmpi's C shim exports. The local communicator is kept only
        // with a layout (its handle then lives in the state), else freed before returning.
        unsafe {
            raw::check(OP, ffi::MPI_Comm_rank(world, &mut rank))?;
            raw::check(OP, ffi::MPI_Comm_size(world, &mut size))?;
            // Ranks on one machine are numbered as the launcher numbered them, where it says
            // (ties, and launchers that do not say, by world rank).
            let key = mpi_launcher_local_rank()
                .and_then(|l| c_int::try_from(l).ok())
                .unwrap_or(rank);
            let mut local: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
            raw::check(OP, split_machines(world, key, &mut local))?;
            raw::check(OP, ffi::MPI_Comm_rank(local, &mut local_rank))?;
            raw::check(OP, ffi::MPI_Comm_size(local, &mut local_size))?;
            let dt = raw::datatype::<c_int>();
            // The machine's lowest rank names it.
            let mut leader: c_int = rank;
            let min = ffi::RSMPI_MIN;
            let rc = ffi::MPI_Allreduce(
                raw::ptr(&[rank][..]),
                &mut leader as *mut c_int as _,
                1,
                dt,
                min,
                local,
            );
            raw::check(OP, rc)?;
            let mine = [local_rank, local_size, leader];
            let mut all: Vec<c_int> = vec![0; 3 * size.max(0) as usize];
            let rc = ffi::MPI_Allgather(
                raw::ptr(&mine[..]),
                3,
                dt,
                raw::ptr_mut(&mut all),
                3,
                dt,
                world,
            );
            raw::check(OP, rc)?;
            let locals: Vec<usize> = all.iter().step_by(3).map(|&v| v as usize).collect();
            let sizes: Vec<usize> = all.iter().skip(1).step_by(3).map(|&v| v as usize).collect();
            let machine_of: Vec<usize> =
                all.iter().skip(2).step_by(3).map(|&v| v as usize).collect();
            let machines = locals.iter().filter(|&&l| l == 0).count().max(1);
            let layout = hierarchy::Layout::of(&locals, &sizes);
            let comms = match layout {
                Some(_) => {
                    let mut cross: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
                    raw::check(OP, ffi::MPI_Comm_split(world, local_rank, rank, &mut cross))?;
                    for c in [local, cross] {
                        raw::check(
                            OP,
                            ffi::MPI_Comm_set_errhandler(c, ffi::RSMPI_ERRORS_RETURN),
                        )?;
                    }
                    Some((Comm(local), Comm(cross)))
                }
                None => {
                    raw::check(OP, ffi::MPI_Comm_free(&mut local))?;
                    None
                }
            };
            let dup = || -> Result<Comm> {
                let mut c: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
                raw::check(OP, ffi::MPI_Comm_dup(world, &mut c))?;
                raw::check(
                    OP,
                    ffi::MPI_Comm_set_errhandler(c, ffi::RSMPI_ERRORS_RETURN),
                )?;
                Ok(Comm(c))
            };
            let counts = [rank, size, local_rank, local_size].map(|v| v as usize);
            let split = Split {
                counts,
                machines,
                layout,
                comms,
                machine_of,
            };
            Ok((split, dup()?, dup()?))
        }
    }

    /// This process's rank, `0..size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This process's rank among the ranks on this machine.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The number of ranks on this machine.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// The number of machines the ranks run on: the groups of ranks MPI finds sharing memory.
    pub fn host_count(&self) -> usize {
        self.machines
    }

    /// Each rank's machine, named by the lowest rank on it.
    pub(crate) fn machine_of(&self) -> &[usize] {
        &self.machine_of
    }

    /// Several machines of several ranks each: the two-stage layout of sliced keys.
    pub(crate) fn layout(&self) -> Option<&hierarchy::Layout> {
        self.layout.as_ref()
    }

    /// The host name of `rank` (its `gethostname`, cleaned; "unknown" out of range).
    pub fn host_of(&self, rank: usize) -> &str {
        self.hosts.get(rank).map_or("unknown", String::as_str)
    }

    /// The bound of every wait (`KVSTORE_TIMEOUT`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether calls are fingerprinted across ranks (`KVSTORE_DIST_CHECK`).
    pub fn check_enabled(&self) -> bool {
        self.check
    }

    /// How long a rank that timed out listens for the others' reports.
    fn grace(&self) -> Duration {
        (self.timeout / 2).clamp(Duration::from_millis(500), Duration::from_secs(5))
    }

    /// The first failure, if the world is poisoned.
    pub fn failure(&self) -> Option<String> {
        lock(&self.poison).clone()
    }

    /// A number for a new store on this world: the count of stores created before it.
    pub(crate) fn next_store_id(&self) -> u64 {
        self.stores
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the survivors of a lost rank may go on without it: the job runs under
    /// `mpirun --with-ft ulfm` with an MPI that has ULFM.
    pub(crate) fn is_elastic(&self) -> bool {
        ulfm::enabled()
    }

    /// Whether a call saw a rank lost, or the survivors already went on without it.
    pub(crate) fn lost_a_rank(&self) -> bool {
        self.saw_loss.load(std::sync::atomic::Ordering::Relaxed) || self.successor.get().is_some()
    }

    /// Under fault tolerance, after a call failed outside MPI (in NCCL, between GPU ranks):
    /// whether MPI knows of a lost rank. Its news comes with MPI's progress, so this asks again
    /// for a while (the grace of a timeout) before it says no.
    pub(crate) fn find_loss(&'static self) -> bool {
        if !self.is_elastic() {
            return false;
        }
        let deadline = Instant::now() + self.grace();
        loop {
            let mut st = lock(&self.state);
            // SAFETY: MPI is initialised, the state lock is held, and the data communicator is
            // the world's own.
            if !unsafe { ulfm::failed(st.data.0) }.is_empty() {
                (self.saw_loss).store(true, std::sync::atomic::Ordering::Relaxed);
                return true;
            }
            // Receiving what the control communicator holds moves MPI's progress on.
            st.answer_queries(self);
            drop(st);
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// After a call failed for a lost rank, under fault tolerance: passes the point of the
    /// call begun last that this rank has not (see [`crate::comm::points`]; every survivor
    /// passes each, and this rank's vote makes it fail everywhere), and says whether that call
    /// committed on every survivor.
    pub(crate) fn settle_commit(&'static self) -> bool {
        let mut st = lock(&self.state);
        if let Some(point) = st.points.next() {
            let agreed = agree(&mut st, Vote::Recovering, self.timeout).unwrap_or(Agreed::Lost);
            st.points.passed(point, agreed);
        }
        st.points.committed()
    }

    /// The survivors' world after a lost rank: every survivor calls this (the first store of a
    /// process to find the loss makes the new world; its other stores are given it). The
    /// survivors agree on who is left (`MPIX_Comm_shrink`, bounded by the timeout: past it the
    /// process ends with code 1), and go on only where they hold a strict majority of this
    /// world's ranks: a side without one fails with [`Error::DistFailed`], and so does every
    /// later call of this process.
    pub(crate) fn shrink(&'static self) -> Result<Shrunk> {
        const OP: &str = "recover from a lost rank";
        let mut st = lock(&self.state);
        if let Some(&next) = self.successor.get() {
            return Ok(Shrunk {
                world: next,
                lost: next.lost_before.clone(),
            });
        }
        if !self.is_elastic() {
            return Err(Error::internal("a shrink without fault tolerance"));
        }
        if let Some(first) = self.stopped.get() {
            let first = first.clone();
            return Err(Error::DistFailed { op: OP, first });
        }
        // Every survivor's call on the old communicators ends now (the control one carries the
        // exit records, and stays).
        let mut old = vec![st.data.0];
        if let Some((machine, across)) = &st.stages {
            old.extend([machine.0, across.0]);
        }
        // SAFETY: MPI is initialised, the state lock is held, and the communicators are the
        // world's own, valid until the world is dropped (never: it is leaked or static).
        unsafe { ulfm::revoke(&old) };
        let bound = bound_wait(
            self.timeout,
            "the survivors of a lost rank did not all join the recovery within KVSTORE_TIMEOUT \
             (MPIX_Comm_shrink waits for every survivor, and cannot be cancelled)",
        );
        let config = crate::config::Config::from_env()?;
        // The communicator to shrink: the old world's, then, where another rank was lost while
        // the survivors made their new world, the one they shrank to.
        let mut from = st.data.0;
        let (mut next, lost) = loop {
            // SAFETY: as above; every survivor calls it on the same communicator.
            let base = unsafe { ulfm::shrink(from) };
            let base = base.map_err(|rc| Error::Mpi {
                op: OP,
                message: format!(
                    "MPIX_Comm_shrink failed: {}; the distributed world is unusable now: \
                     restart the job from its last checkpoint",
                    raw::error_string(rc)
                ),
            });
            let base = base.inspect_err(|e| self.poison_with(e.to_string()))?;
            // SAFETY: `base` is the valid communicator MPI just returned, and the old data
            // communicator is valid (above).
            let (survivors, lost) = unsafe {
                raw::check(
                    OP,
                    ffi::MPI_Comm_set_errhandler(base, ffi::RSMPI_ERRORS_RETURN),
                )?;
                survivors_of(base, st.data.0, self.size)?
            };
            if 2 * survivors.len() <= self.size {
                let why = format!(
                    "no majority: {} of the {} ranks are left on this side (lost: {lost:?}), \
                     not a strict majority, so this side stops and never computes on (the \
                     other side may hold one); restart the job from its last checkpoint",
                    survivors.len(),
                    self.size
                );
                self.poison_with(why.clone());
                let _ = self.stopped.set(why.clone());
                return Err(Error::DistFailed { op: OP, first: why });
            }
            // The new world's communicators come from blocking calls, which a rank lost
            // meanwhile fails on some survivors only: they agree (fault-tolerantly) that every
            // survivor made them, else shrink again without that rank.
            let made = World::on(base, &config, self.generation + 1);
            let agreed = agree_on(base, Vote::from(made.is_ok()), self.timeout)
                .inspect_err(|e| self.poison_with(e.to_string()))?;
            let failed = match (made, agreed) {
                (Ok(next), Agreed::All) => break (next, lost),
                (_, Agreed::Lost) => {
                    from = base;
                    continue;
                }
                // A failure with no rank lost: nothing to shrink away.
                (Err(e), _) => e,
                (Ok(_), _) => Error::Mpi {
                    op: OP,
                    message: "another survivor could not make the new world (its own error \
                              says why); restart the job from its last checkpoint"
                        .to_owned(),
                },
            };
            self.poison_with(failed.to_string());
            return Err(failed);
        };
        drop(bound);
        next.lost_before.clone_from(&lost);
        next.universe = Mutex::new(lock(&self.universe).take());
        let stores = self.stores.load(std::sync::atomic::Ordering::Relaxed);
        next.stores = std::sync::atomic::AtomicU64::new(stores);
        let next: &'static World = Box::leak(Box::new(next));
        self.poison_with(format!(
            "the distributed world changed: ranks {lost:?} were lost, and the survivors went on \
             in a new world of {} ranks (this store's next call joins it)",
            next.size
        ));
        let _ = self.successor.set(next);
        *NEWEST.write().unwrap_or_else(|p| p.into_inner()) = Some(next);
        st.closed = true;
        Ok(Shrunk { world: next, lost })
    }

    /// Records the first failure; later calls fail with [`Error::DistFailed`].
    pub(crate) fn poison_with(&self, message: String) {
        let mut p = lock(&self.poison);
        if p.is_none() {
            *p = Some(message);
        }
    }

    /// Begins a store call: takes the state lock (waiting for another thread's call), numbers
    /// the call and, unless the check is off, compares `fp` across ranks. Errors:
    /// [`Error::DistFailed`] if the world is poisoned or the process is exiting;
    /// [`Error::RankExited`] if a rank exited without making this call; [`Error::Desync`] if the
    /// ranks disagree; [`Error::Timeout`] if a rank does not join within the timeout.
    pub fn begin(&'static self, fp: &Fingerprint) -> Result<Call> {
        let mut st = lock(&self.state);
        if let Some(first) = self.failure() {
            return Err(Error::DistFailed { op: fp.op(), first });
        }
        if st.closed {
            return Err(Error::DistFailed {
                op: fp.op(),
                first: "the process is exiting: its distributed world is closed".to_owned(),
            });
        }
        st.seq += 1;
        st.points = Points::of_call(fp);
        let mut call = Call {
            world: self,
            seq: st.seq,
            st,
            op: fp.op(),
            blocking: false,
        };
        call.st.here = Here::in_call(call.seq, fp.op(), fp.key_iter());
        if let Some(e) = call.exited_error() {
            self.poison_with(e.to_string());
            return Err(e);
        }
        if self.check {
            call.check_fingerprint(fp)?;
        }
        Ok(call)
    }
}

/// A fault-tolerant agreement on the world's data communicator of `st` (every survivor must
/// join): what every survivor's `vote` and any rank lost before it ended make (see
/// [`crate::comm::points`]). Bounded by `timeout` (an error, after which the world is
/// unusable).
fn agree(st: &mut State, vote: Vote, timeout: Duration) -> Result<Agreed> {
    agree_on(st.data.0, vote, timeout)
}

/// [`agree`] on communicator `comm`, valid and the world's own (its state lock held, or the
/// world being made).
fn agree_on(comm: ffi::MPI_Comm, vote: Vote, timeout: Duration) -> Result<Agreed> {
    // On the heap: MPI writes it when the agreement ends, which may be after a timeout here.
    let mut flag = Box::new(vote.flag() as c_int);
    let mut req = Request::null();
    // SAFETY: the communicator is valid (the caller's contract); `flag` lives until the
    // request completes below, or is leaked on a timeout; `req` is a valid out-pointer.
    let rc = unsafe { ulfm::iagree(comm, &mut *flag, &mut req.0) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return Ok(Agreed::Lost);
    }
    let start = Instant::now();
    let mut backoff = Backoff::new(start, 0);
    loop {
        let mut done: c_int = 0;
        // SAFETY: `req` is the request just started; MPI_STATUS_IGNORE is a constant.
        let rc = unsafe { ffi::MPI_Test(&mut req.0, &mut done, ffi::RSMPI_STATUS_IGNORE) };
        if rc != ffi::MPI_SUCCESS as c_int {
            // A loss during the agreement: every survivor's ends with the same error.
            return Ok(Agreed::Lost);
        }
        if done != 0 {
            return Ok(Agreed::from_flag(Some(*flag)));
        }
        if start.elapsed() > timeout {
            // The pending request still refers to `flag`: leak it rather than free it under MPI.
            let _ = Box::leak(flag);
            return Err(Error::Mpi {
                op: "commit",
                message: format!(
                    "the survivors did not all reach the commit point within KVSTORE_TIMEOUT \
                     ({} s)",
                    timeout.as_secs_f64()
                ),
            });
        }
        backoff.pause();
    }
}

/// The ranks of `old` (of `size` ranks) that are in `new`, and those that are not.
///
/// # Safety
/// MPI is initialised and not finalised, and both communicators are valid.
unsafe fn survivors_of(
    new: ffi::MPI_Comm,
    old: ffi::MPI_Comm,
    size: usize,
) -> Result<(Vec<usize>, Vec<usize>)> {
    const OP: &str = "recover from a lost rank";
    // SAFETY: RSMPI_GROUP_NULL is a constant handle that rsmpi's C shim exports.
    let null = unsafe { ffi::RSMPI_GROUP_NULL };
    let (mut new_group, mut old_group) = (null, null);
    let mut n: c_int = 0;
    // SAFETY: valid communicators (the caller's contract) and valid out-pointers.
    let got = unsafe {
        raw::check(OP, ffi::MPI_Comm_group(new, &mut new_group))
            .and_then(|()| raw::check(OP, ffi::MPI_Comm_group(old, &mut old_group)))
            .and_then(|()| raw::check(OP, ffi::MPI_Group_size(new_group, &mut n)))
    };
    let mut theirs = vec![0 as c_int; usize::try_from(n).unwrap_or(0)];
    let got = got.and_then(|()| {
        let inside: Vec<c_int> = (0..n).collect();
        // SAFETY: both groups are valid, and both arrays hold `n` ranks.
        raw::check(OP, unsafe {
            ffi::MPI_Group_translate_ranks(
                new_group,
                n,
                inside.as_ptr(),
                old_group,
                theirs.as_mut_ptr(),
            )
        })
    });
    for g in [&mut new_group, &mut old_group] {
        if *g != null {
            // SAFETY: a group MPI returned, freed once.
            unsafe { ffi::MPI_Group_free(g) };
        }
    }
    got?;
    let survivors: Vec<usize> = theirs
        .into_iter()
        .filter_map(|r| usize::try_from(r).ok())
        .collect();
    let lost = (0..size).filter(|r| !survivors.contains(r)).collect();
    Ok((survivors, lost))
}

impl State {
    /// One `MPI_Testall`: whether all of `reqs` completed (then null; `statuses` say how).
    fn test(
        &mut self,
        reqs: &mut [Request],
        statuses: Option<&mut [ffi::MPI_Status]>,
        op: &'static str,
    ) -> Result<bool> {
        let mut flag: c_int = 0;
        let n = raw::count(op, reqs.len())?;
        let (statuses, given) = match statuses {
            Some(s) if s.len() == reqs.len() => (s.as_mut_ptr(), Some(&*s)),
            Some(_) => {
                return Err(Error::Internal {
                    op,
                    message: "a test with statuses, but not one per request".to_owned(),
                })
            }
            // SAFETY: RSMPI_STATUSES_IGNORE is a constant that rsmpi's C shim exports; reading
            // it has no side effect.
            None => (unsafe { ffi::RSMPI_STATUSES_IGNORE }, None),
        };
        // SAFETY: `Request` is `#[repr(transparent)]` over `MPI_Request`, so the slice is an
        // array of `n` requests that MPI may update in place; `statuses` is an array of `n`
        // statuses it may write, or MPI_STATUSES_IGNORE. Every request was started on a
        // communicator that is still valid.
        let rc = unsafe { ffi::MPI_Testall(n, reqs.as_mut_ptr().cast(), &mut flag, statuses) };
        self.note_failure(rc, given);
        if rc == ffi::MPI_ERR_IN_STATUS as c_int {
            if let Some(e) = given.and_then(|s| status_error(s, op)) {
                return Err(e);
            }
        }
        raw::check(op, rc)?;
        Ok(flag != 0)
    }
}

impl State {
    /// Under an MPI with ULFM, notes a failed MPI call (code `rc`, its requests' `statuses`
    /// where asked for) for [`Call::named_loss`].
    fn note_failure(&mut self, rc: c_int, statuses: Option<&[ffi::MPI_Status]>) {
        if rc != ffi::MPI_SUCCESS as c_int && ulfm::available() {
            let said = ulfm::is_loss(rc)
                || statuses.is_some_and(|s| s.iter().any(|s| ulfm::is_loss(s.MPI_ERROR)));
            self.loss_seen = Some(said || self.loss_seen == Some(true));
        }
    }
}

/// The error of the first request in `statuses` that failed (after `MPI_ERR_IN_STATUS`); a
/// truncated message is a rank that sent more than this rank expected.
fn status_error(statuses: &[ffi::MPI_Status], op: &'static str) -> Option<Error> {
    let failed = statuses.iter().find(|s| {
        s.MPI_ERROR != ffi::MPI_SUCCESS as c_int && s.MPI_ERROR != ffi::MPI_ERR_PENDING as c_int
    })?;
    let what = raw::error_string(failed.MPI_ERROR);
    let message = match failed.MPI_ERROR == ffi::MPI_ERR_TRUNCATE as c_int {
        true => format!(
            "rank {} sent more than this rank expected ({what}): the ranks disagree on a key's \
             size (with KVSTORE_DIST_CHECK=0 nothing compared it first)",
            failed.MPI_SOURCE
        ),
        false => format!("a transfer with rank {} failed: {what}", failed.MPI_SOURCE),
    };
    Some(Error::Mpi { op, message })
}

/// One store call, holding the state lock: wait for the collectives it starts before dropping it.
pub struct Call {
    world: &'static World,
    st: MutexGuard<'static, State>,
    seq: u64,
    op: &'static str,
    /// Whether collectives start blocking ([`Call::set_blocking`]).
    blocking: bool,
}

impl Call {
    /// The world.
    pub fn world(&self) -> &'static World {
        self.world
    }

    /// This call's sequence number (1 for the first call of the process).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Under fault tolerance, the point where a call that changes the store commits: every
    /// survivor passes it (a failed call at [`World::settle_commit`]), and it is `Ok` only where
    /// every rank passed `ok` and no rank was lost: then every survivor commits, else none.
    /// Elsewhere (no fault tolerance) it is `Ok(())` at once.
    pub(crate) fn commit_point(&mut self, ok: bool) -> Result<()> {
        self.pass(Point::Commit, ok)
    }

    /// Under fault tolerance, the end of a call that goes on after its commit point or never
    /// commits (see [`crate::comm::points`]): every survivor passes it, and it is `Ok` only
    /// where every rank passed `ok` and no rank was lost, so that a loss fails the call on every
    /// survivor or on none. Elsewhere, or for a call without one, `Ok(())` at once.
    pub(crate) fn end_point(&mut self, ok: bool) -> Result<()> {
        self.pass(Point::End, ok)
    }

    /// Passes `point` of this call, if it is the call's next, voting `ok` (or, where this rank
    /// failed for a lost rank, as one recovering).
    fn pass(&mut self, point: Point, ok: bool) -> Result<()> {
        if !self.world.is_elastic() || self.st.points.next() != Some(point) {
            return Ok(());
        }
        let vote = match ok {
            true => Vote::Yes,
            false if self.world.lost_a_rank() => Vote::Recovering,
            false => Vote::FailedHere,
        };
        let agreed = agree(&mut self.st, vote, self.world.timeout)?;
        self.st.points.passed(point, agreed);
        let what = match point {
            Point::Commit => "did not commit",
            Point::End => "did not end on every rank",
        };
        match agreed {
            Agreed::All => Ok(()),
            Agreed::FailedElsewhere => Err(Error::Mpi {
                op: self.op,
                message: format!(
                    "call #{} {what}: another rank failed its part of it (its own error says \
                     why); no rank was lost, and every rank failed the call",
                    self.seq
                ),
            }),
            Agreed::Lost => {
                (self.world.saw_loss).store(true, std::sync::atomic::Ordering::Relaxed);
                let e = Error::Mpi {
                    op: self.op,
                    message: format!(
                        "call #{} {what}: a rank was lost before every rank agreed to end it",
                        self.seq
                    ),
                };
                self.world.poison_with(e.to_string());
                Err(e)
            }
        }
    }

    /// Under fault tolerance, `Err` once MPI knows of a lost rank (it has not told this call
    /// yet): a wait outside MPI (NCCL between GPU ranks, which never hears of a peer of the same
    /// machine that died) ends with it. Asks MPI at most every 10 ms; `Ok` elsewhere.
    pub(crate) fn loss_known(&mut self) -> Result<()> {
        if !self.world.is_elastic() {
            return Ok(());
        }
        let now = Instant::now();
        if self
            .st
            .asked_loss
            .is_some_and(|t| now - t < Duration::from_millis(10))
        {
            return Ok(());
        }
        self.st.asked_loss = Some(now);
        // Receiving what the control communicator holds moves MPI's progress on.
        self.st.answer_queries(self.world);
        // SAFETY: MPI is initialised, the state lock is held (by this call), and the data
        // communicator is the world's own.
        if unsafe { ulfm::failed_count(self.st.data.0) } == 0 {
            return Ok(());
        }
        (self.world.saw_loss).store(true, std::sync::atomic::Ordering::Relaxed);
        Err(Error::Mpi {
            op: self.op,
            message: format!(
                "call #{}: MPI reports a lost rank, whose part of this call never comes",
                self.seq
            ),
        })
    }

    /// Compares the fingerprint across ranks; see [`crate::comm::fingerprint`].
    fn check_fingerprint(&mut self, fp: &Fingerprint) -> Result<()> {
        let (seq, size) = (self.seq, self.world.size);
        let checked =
            crate::comm::fingerprint::check_across(fp, seq, size, |w| self.all_gather_u64(w));
        if let Err(err @ Error::Desync { .. }) = &checked {
            self.world.poison_with(err.to_string());
        }
        checked
    }

    /// Whether another rank timed out in this call (its question arrived): nothing may block.
    pub fn peer_timed_out(&mut self) -> bool {
        self.st.answer_queries(self.world);
        let seq = self.seq;
        self.st.heard.values().any(|r| r.timed_out && r.seq == seq)
    }

    /// A blocking, bounded all-gather of a few `u64`s on the data communicator.
    pub(crate) fn all_gather_u64(&mut self, mine: &[u64]) -> Result<Vec<u64>> {
        let recv = vec![0u64; mine.len() * self.world.size];
        let (mine, world) = (mine.to_vec(), collective::Group::World);
        let p = self.all_gather_as(world, mine, recv, collective::Coll::Fingerprint)?;
        Ok(self.wait(p)?.recv)
    }

    /// Polls `reqs` until all complete, within the timeout counted from `start` (`statuses`, one
    /// per request, then say how each completed). At most every [`poll::SLEEP_MAX`] it also
    /// answers the other ranks' questions, reads their exit records (a rank gone for good ends
    /// the wait with [`Error::RankExited`]), and logs every `KVSTORE_WAIT_LOG_SECS` whom it waits
    /// for. On a timeout it finds out where the others are and poisons the world.
    fn poll(
        &mut self,
        reqs: &mut [Request],
        mut statuses: Option<&mut [ffi::MPI_Status]>,
        bytes: usize,
        start: Instant,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let mut backoff = Backoff::new(start, bytes);
        let mut last_service = start;
        let mut watch: Option<Watch> = None;
        // What this wait is for, in words: made once the wait is long, never on a quick one.
        let mut said: Option<String> = None;
        loop {
            let done = self.st.test(reqs, statuses.as_deref_mut(), self.op);
            let done = done.map_err(|e| self.named_loss().unwrap_or(e));
            if done.inspect_err(|e| self.world.poison_with(e.to_string()))? {
                return Ok(());
            }
            if backoff.pause() == poll::Phase::Spin {
                continue;
            }
            let now = Instant::now();
            if now.duration_since(last_service) >= poll::SLEEP_MAX {
                last_service = now;
                let what = said.get_or_insert_with(what);
                if watch.is_none() {
                    // A long wait: say where it is to the ranks that ask.
                    self.st.here.set_at(format!("in its {what}"));
                }
                self.st.service(self.world);
                if let Some(err) = self.exited_error() {
                    self.world.poison_with(err.to_string());
                    return Err(err);
                }
                let watch = watch.get_or_insert_with(|| Watch::new(self.world, start));
                if let Some(answers) = watch.tick(&mut self.st, self.world) {
                    control::warn(&control::wait_line(
                        (self.world.rank, self.world.size, &self.world.hosts),
                        self.seq,
                        &self.st.here.summary(),
                        what,
                        now.duration_since(start),
                        &answers,
                        self.world.timeout,
                    ));
                }
            }
            if now.duration_since(start) > self.world.timeout {
                let what = said.get_or_insert_with(what).clone();
                let err = self.diagnose(&what);
                self.world.poison_with(err.to_string());
                return Err(err);
            }
        }
    }

    /// After a test saw a rank lost (MPI with ULFM): the world's communicators revoked, so
    /// that every survivor's call ends now, and the error naming the lost rank.
    pub(super) fn named_loss(&mut self) -> Option<Error> {
        let said = self.st.loss_seen.take()?;
        // The control communicator stays: the exit records of the survivors travel on it.
        let mut comms = vec![self.st.data.0];
        if let Some((machine, across)) = &self.st.stages {
            comms.extend([machine.0, across.0]);
        }
        let data = self.st.data.0;
        // SAFETY: MPI is initialised (a call is under way), the state lock is held (`self.st`),
        // and the data communicator is the world's own, valid until the world is dropped.
        let said = said || unsafe { ulfm::is_revoked(data) };
        // SAFETY: as above.
        let failed = || unsafe { ulfm::failed(data) };
        let mut lost = failed();
        // A rank that only saw an error code may hear of the loss a moment later (Open MPI's
        // runtime tells every process): wait for it a little, bounded. Not where the survivors
        // go on (they learn who was lost when they rebuild their world), nor once the world is
        // known revoked: waiting then only delays every survivor's recovery (measured: most
        // survivors of a kill waited out the whole bound).
        let wait = match said && self.world.is_elastic() {
            true => Duration::ZERO,
            false => ulfm::HEAR_WITHIN,
        };
        let until = Instant::now() + wait;
        while lost.is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
            lost = failed();
        }
        if lost.is_empty() && !said {
            return None; // an error of another kind
        }
        // SAFETY: as above, for the world's data and stage communicators.
        unsafe { ulfm::revoke(&comms) };
        self.st.lost.clone_from(&lost);
        (self.world.saw_loss).store(true, std::sync::atomic::Ordering::Relaxed);
        let others = match lost.get(1..) {
            Some(more) if !more.is_empty() => format!(" (and ranks {more:?})"),
            _ => String::new(),
        };
        Some(match lost.first() {
            Some(&rank) => Error::RankExited {
                op: self.op,
                seq: self.seq,
                rank,
                host: self.world.hosts.get(rank).cloned(),
                detail: format!(
                    "was lost during this call{others}: its process ended without a word \
                     (killed, or crashed), as Open MPI's fault tolerance (ULFM) reported"
                ),
            },
            None => Error::Mpi {
                op: self.op,
                message: format!(
                    "call #{}: a rank was lost, and another rank that saw it revoked the world \
                     (Open MPI's fault tolerance, ULFM); the distributed world is unusable now: \
                     restart the job from its last checkpoint",
                    self.seq
                ),
            },
        })
    }

    /// The error, kept as this rank's cause, if a rank exited without making this call.
    fn exited_error(&mut self) -> Option<Error> {
        let (rank, rep) = self.st.gone(self.seq)?;
        let detail = if rep.failed {
            rep.text.clone()
        } else {
            format!(
                "{}, without making this call: every rank must make the same kvstore calls in \
                 the same order",
                rep.text
            )
        };
        self.st
            .caused_by
            .get_or_insert_with(|| (rank, detail.clone()));
        Some(Error::RankExited {
            op: self.op,
            seq: self.seq,
            rank,
            host: Some(self.world.host_of(rank).to_owned()),
            detail,
        })
    }

    /// After a timeout in `what`: asks where the others are, for a grace period; the error.
    fn diagnose(&mut self, what: &str) -> Error {
        let world = self.world;
        let query = self.st.new_query();
        self.st.here.set_at(format!("in its {what}"));
        let question = Report {
            timed_out: true,
            ..self.st.here.report(query)
        };
        self.st.send_all(world, TAG_WHERE, &question);
        self.st
            .here
            .set_at(format!("in its {what}, where it timed out"));
        let mut reports = std::mem::take(&mut self.st.heard);
        let end = Instant::now() + world.grace();
        while reports.len() + 1 < world.size && Instant::now() < end {
            if let Some((src, answer)) = self.st.receive(TAG_HERE) {
                // Answers to older questions (of a wait log) are not about now.
                if answer.query == query {
                    reports.insert(src, answer);
                }
            } else if let Some((src, other)) = self.st.receive(TAG_WHERE) {
                // Another rank asks too: its question says where it is. Answer it.
                let answer = self.st.here.report(other.query);
                self.st.send_report(world, src, TAG_HERE, &answer);
                reports.insert(src, other);
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        timeout_error(
            self.op,
            self.seq,
            self.st.here.keys().to_vec(),
            (world.rank, world.size),
            &reports,
            what,
            (world.timeout, &world.hosts),
        )
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.st.here = Here::idle(self.seq, "between calls");
    }
}

/// The error of a timed-out `what` in call `seq`, from the other ranks' reports: who is in this
/// call, who is elsewhere (and where), who did not answer, and the missing ranks' hosts.
fn timeout_error(
    op: &'static str,
    seq: u64,
    keys: Vec<Key>,
    (me, size): (usize, usize),
    reports: &BTreeMap<usize, Report>,
    what: &str,
    (timeout, hosts): (Duration, &[String]),
) -> Error {
    let w = Whereabouts::of(seq, (me, size), reports);
    let secs = timeout.as_secs_f64();
    let mut parts = vec![format!(
        "the {what} did not complete within KVSTORE_TIMEOUT={secs} s"
    )];
    if !w.missing.is_empty() {
        parts.push(format!(
            "missing: {}",
            hosts::ranks_on_hosts(&w.missing, hosts)
        ));
    }
    parts.extend(w.parts("died, hung outside kvstore, or stopped making kvstore calls"));
    let missing = w.missing;
    let advice = match missing.len() {
        0 => "every rank is in this call, so their collectives do not match (is \
              KVSTORE_DIST_CHECK=0 hiding a desync?) or the transfer needs more than \
              KVSTORE_TIMEOUT"
            .to_owned(),
        n => format!(
            "every rank must make the same kvstore calls in the same order; if {} {} only \
             slow, raise KVSTORE_TIMEOUT",
            if n == 1 { "that rank" } else { "those ranks" },
            is_are(&missing)
        ),
    };
    Error::Timeout {
        op,
        seq,
        keys,
        missing,
        detail: format!(
            "{}; {advice}. The distributed world is unusable now; restart the job",
            parts.join("; ")
        ),
    }
}

/// Locks `m`, also after a thread panicked while holding it (its value is used as it is).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// "is" for one rank, "are" for several.
fn is_are(r: &[usize]) -> &'static str {
    if r.len() == 1 {
        "is"
    } else {
        "are"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(seq: u64, timed_out: bool, text: &str) -> Report {
        Report {
            seq,
            timed_out,
            text: text.to_owned(),
            ..Report::default()
        }
    }

    #[test]
    fn a_timeout_names_the_missing_ranks_and_where_they_are() {
        let mut reports = BTreeMap::new();
        reports.insert(
            1,
            report(7, true, "push of key 3, in its fingerprint check"),
        );
        reports.insert(2, report(18, false, "pull of key 5"));
        let e = timeout_error(
            "push",
            7,
            vec![Key::Int(3)],
            (0, 5),
            &reports,
            "reduce to rank 0",
            (
                Duration::from_secs(3),
                &["h0", "h1", "h2", "h3", "h4"].map(String::from),
            ),
        );
        let Error::Timeout { missing, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(missing, &[2, 3, 4]);
        let text = e.to_string();
        for part in [
            "push (call #7) of keys [3] timed out waiting for ranks [2, 3, 4]",
            "the reduce to rank 0 did not complete within KVSTORE_TIMEOUT=3 s",
            "missing: ranks 2, 3, 4 (hosts h2, h3, h4)",
            "ranks [3, 4] are not responding",
            "rank 2 is at call #18 (pull of key 5)",
            "rank 1 is waiting in this same call",
            "same order",
        ] {
            assert!(text.contains(part), "'{part}' not in: {text}");
        }
        assert!(std::mem::size_of::<Error>() <= 128);
    }
}

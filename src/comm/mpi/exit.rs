//! What a rank does when its process exits: the exit hook, and the panic hook that tells it
//! why. The rules are in the module documentation of [`comm::mpi`](super), under "Exit".

use std::os::raw::c_int;
use std::sync::{Mutex, Once, TryLockError};
use std::time::{Duration, Instant};

use mpi::ffi;

use super::control::{self, Here, Watch};
use super::poll::{self, Backoff};
use super::raw::{self, Request};
use super::{lock, State, World, NEWEST, WORLD};

/// The last panic of this process, recorded by the panic hook, for the exit record.
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// The most bytes of a panic message that are kept.
const PANIC_TEXT: usize = 160;

/// How long a healthy rank waits after the exit barrier for records and sends to complete.
const SETTLE: Duration = Duration::from_secs(5);

/// Chains a panic hook that records the panic in [`LAST_PANIC`] (once per process).
pub(super) fn install_panic_hook() {
    static ONCE: Once = Once::new();
    // `take_hook` and `set_hook` panic when called from a panicking thread.
    if std::thread::panicking() {
        return;
    }
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = describe(info);
            if let Ok(mut last) = LAST_PANIC.try_lock() {
                *last = Some(text);
            }
            previous(info);
        }));
    });
}

/// "panicked at file:line:col: message", at most [`PANIC_TEXT`] bytes.
fn describe(info: &std::panic::PanicHookInfo<'_>) -> String {
    let payload = info.payload();
    let message = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(a panic with a payload that is not text)");
    let mut text = match info.location() {
        Some(at) => format!("panicked at {at}: {message}"),
        None => format!("panicked: {message}"),
    };
    if text.len() > PANIC_TEXT {
        text = format!("{}...", control::cut(&text, PANIC_TEXT));
    }
    text
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C" {
    /// glibc's `on_exit(3)`: as `atexit`, but the function is given the exit status.
    fn on_exit(function: extern "C" fn(c_int, *mut libc::c_void), arg: *mut libc::c_void) -> c_int;
}

/// Registers the exit hook (`on_exit` on glibc, else `atexit`); whether the C library took it.
pub(super) fn register() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `hook_with_status` is an `extern "C" fn(int, void *)` that never unwinds (it
    // catches every panic); `on_exit` only stores the pointer and the null argument, which the
    // hook ignores.
    let rc = unsafe { on_exit(hook_with_status, std::ptr::null_mut()) };
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    // SAFETY: `hook` is an `extern "C" fn()` that never unwinds (it catches every panic);
    // `atexit` only stores the pointer.
    let rc = unsafe { libc::atexit(hook) };
    rc == 0
}

/// The exit hook on glibc: the exit status is known.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C" fn hook_with_status(status: c_int, _arg: *mut std::os::raw::c_void) {
    run(Some(status));
}

/// The exit hook elsewhere: the exit status is unknown.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
extern "C" fn hook() {
    run(None);
}

/// Runs [`World::at_exit`]; a panic aborts the job (nothing may unwind out of `extern "C"`).
fn run(status: Option<c_int>) {
    let r = std::panic::catch_unwind(|| {
        // The newest generation: the survivors' world after a lost rank, else the first.
        let newest = *NEWEST.read().unwrap_or_else(|p| p.into_inner());
        match (newest, WORLD.get()) {
            (Some(w), _) | (None, Some(Ok(w))) => w.at_exit(status),
            _ => {}
        }
    });
    if r.is_err() {
        raw::abort(1);
    }
}

impl World {
    /// Runs at process exit (`status`, where the C library says it): see "Exit" in the module
    /// documentation of [`comm::mpi`](super).
    fn at_exit(&self, status: Option<c_int>) {
        // A call still running on another thread at exit: waiting for it could take the whole
        // timeout, and the other ranks expect its collectives; end the job.
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut st = loop {
            match self.state.try_lock() {
                Ok(st) => break st,
                Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(TryLockError::WouldBlock) => {
                    control::say(&format!(
                        "kvstore: rank {}: the process is exiting while a distributed call is \
                         still running on another thread; aborting the job",
                        self.rank
                    ));
                    raw::abort(1);
                }
            }
        };
        st.closed = true;
        if let Some(Failing { code, cause, text }) = self.exit_failure(status, &st) {
            let why = match cause {
                Some(c) => format!("rank {c} {text}"),
                None => format!("this rank {text}"),
            };
            control::say(&format!(
                "kvstore: rank {}: ending the job (MPI_Abort with code {code}) because {why}",
                self.rank
            ));
            st.tell_exit(self, true, cause, &text);
            if super::ulfm::revoked() {
                // A rank was lost (MPI with ULFM): the exit barrier cannot complete, and
                // MPI_Abort can leave mpirun hanging. Wait (bounded) for the other survivors'
                // exit records, so that each has reported its own error first.
                st.hear_survivors(self, self.grace());
                // SAFETY: _exit ends the process at once, running no more of its code.
                unsafe { libc::_exit(code) };
            }
            // Let the other ranks hear of it and report it in their own errors.
            let _ = st.exit_wait(self, Some(self.grace()));
            raw::abort(code);
        }
        let text = format!("exited normally after its call #{}", st.seq);
        st.tell_exit(self, false, None, &text);
        if let Err(why) = st.exit_wait(self, None).and_then(|()| st.settle_exit(self)) {
            if (self.generation > 0 || self.is_elastic()) && st.failed_peer(self.rank).is_none() {
                // Under fault tolerance a rank lost after its program's last call, or the old
                // world's loss after a recovery (measured: a host of 2 ranks lost, 2 runs in
                // 5), fails the survivors' exit barrier, though every survivor is healthy and
                // mpirun kills none for an exit. This rank's work is done: it ends with its
                // program's status.
                control::say(&format!(
                    "kvstore: rank {}: at its exit: {why}; no rank reported a failure, so it \
                     ends with its program's status",
                    self.rank
                ));
                // SAFETY: fflush(NULL) flushes every C stream; _exit ends the process at once.
                unsafe {
                    libc::fflush(std::ptr::null_mut());
                    libc::_exit(status.unwrap_or(0));
                }
            }
            control::say(&format!(
                "kvstore: rank {}: at its exit: {why}; ending the job (MPI_Abort with code 1)",
                self.rank
            ));
            raw::abort(1);
        }
        // SAFETY: the communicators were created by MPI_Comm_dup (and, for the two stages,
        // split) and are freed once, here, under the state lock, which the closed flag keeps
        // every later call from using; no collective on them is pending (the world is healthy,
        // every call waited for its collectives, and the exit barrier completed).
        unsafe {
            ffi::MPI_Comm_free(&mut st.data.0);
            ffi::MPI_Comm_free(&mut st.control.0);
            if let Some((host, cross)) = st.stages.as_mut() {
                ffi::MPI_Comm_free(&mut host.0);
                ffi::MPI_Comm_free(&mut cross.0);
            }
        }
        drop(st);
        if self.generation > 0 {
            // The survivors' world after a lost rank: MPI_Finalize can hang once a process of
            // the job is gone (Open MPI 5.0, measured: the design notes' ULFM findings), and
            // every survivor has passed the exit barrier above. End here, with the status.
            // SAFETY: fflush(NULL) flushes every C stream; _exit then ends the process at once.
            unsafe {
                libc::fflush(std::ptr::null_mut());
                libc::_exit(status.unwrap_or(0));
            }
        }
        // Dropping rsmpi's universe calls MPI_Finalize.
        drop(lock(&self.universe).take());
    }

    /// Whether this process fails at its exit: a non-zero status, or (where the status is
    /// unknown) a panic, or a failed world. A failure caused by another rank's exit
    /// (`st.caused_by`) relays that exit.
    fn exit_failure(&self, status: Option<c_int>, st: &State) -> Option<Failing> {
        let poison = self.failure();
        let panic = lock(&LAST_PANIC).clone();
        let failed_status = status.map_or(panic.is_some(), |code| code != 0);
        if !failed_status && poison.is_none() {
            return None;
        }
        let nonzero = status.filter(|&code| code != 0);
        let code = nonzero.unwrap_or(1);
        if let Some((cause, text)) = &st.caused_by {
            return Some(Failing {
                code,
                cause: Some(*cause),
                text: text.clone(),
            });
        }
        let seq = st.seq;
        let mut text = match nonzero {
            Some(code) => format!("exited with code {code} after its call #{seq}"),
            None => format!("exited after its call #{seq}"),
        };
        if let Some(p) = panic.filter(|_| failed_status) {
            text.push_str(&format!("; its last panic: {p}"));
        }
        if let Some(first) = poison {
            text.push_str(&format!("; its distributed world had failed: {first}"));
        }
        Some(Failing {
            code,
            cause: None,
            text,
        })
    }
}

/// How a rank fails at its exit.
struct Failing {
    /// The code of its `MPI_Abort`: its exit status, or 1.
    code: c_int,
    /// The rank whose exit made it fail, if that is why.
    cause: Option<usize>,
    /// How it (or the cause) exited: "exited with code 101 after its call #4; ...".
    text: String,
}

impl State {
    /// Waits until every rank has reached its exit (an `MPI_Ibarrier` on the control
    /// communicator), answering questions and hearing exits meanwhile: a failing rank for at
    /// most `limit`; a healthy one (no limit) as long as it takes, logging whom it waits for,
    /// unless an exit record says another rank failed.
    fn exit_wait(&mut self, world: &World, limit: Option<Duration>) -> Result<(), String> {
        let mut req = Request::null();
        // SAFETY: the control communicator is valid until `at_exit` frees it after this barrier;
        // `req` is a valid out-pointer.
        let rc = unsafe { ffi::MPI_Ibarrier(self.control.0, &mut req.0) };
        raw::check("exit", rc).map_err(|e| e.to_string())?;
        self.here = Here::idle(self.seq, "at its exit");
        let start = Instant::now();
        let mut backoff = Backoff::new(start, 0);
        let mut watch = Watch::new(world, start);
        loop {
            // On an early return the barrier stays pending: the caller aborts the job.
            if self
                .test(std::slice::from_mut(&mut req), None, "exit")
                .map_err(|e| e.to_string())?
            {
                return Ok(());
            }
            if backoff.pause() == poll::Phase::Spin {
                continue;
            }
            self.service(world);
            if let Some(limit) = limit {
                if start.elapsed() > limit {
                    return Err(format!(
                        "not every rank reached its exit within {:.1} s",
                        limit.as_secs_f64()
                    ));
                }
                continue;
            }
            if let Some(why) = self.failed_peer(world.rank) {
                return Err(why);
            }
            if let Some(answers) = watch.tick(self, world) {
                let awaited: Vec<usize> = (0..world.size)
                    .filter(|&r| r != world.rank && !self.exits.contains_key(&r))
                    .collect();
                if !awaited.is_empty() {
                    control::warn(&control::exit_line(
                        world.rank,
                        self.seq,
                        &awaited,
                        start.elapsed(),
                        &answers,
                    ));
                }
            }
        }
    }

    /// After a lost rank: hears exit records until every rank but the lost ones has sent its
    /// own, and this rank's have gone out, for at most `limit`.
    fn hear_survivors(&mut self, world: &World, limit: Duration) {
        let end = Instant::now() + limit;
        loop {
            self.hear_exits();
            let sent = self.flush_outbox();
            let heard = (0..world.size)
                .all(|r| r == world.rank || self.lost.contains(&r) || self.exits.contains_key(&r));
            if (heard && sent) || Instant::now() > end {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// After a healthy rank's exit barrier: reads the exit records still on their way (each rank
    /// sent its own before the barrier) and lets this rank's sends complete, for at most
    /// [`SETTLE`]. Fails if a record says that its rank failed.
    fn settle_exit(&mut self, world: &World) -> Result<(), String> {
        let end = Instant::now() + SETTLE;
        loop {
            self.hear_exits();
            if let Some(why) = self.failed_peer(world.rank) {
                return Err(why);
            }
            let heard_all = self.exits.len() + 1 >= world.size;
            let sent = self.flush_outbox();
            if (heard_all && sent) || Instant::now() > end {
                return Ok(());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Why this healthy rank (`me`) must end the job at its exit: a rank failed.
    fn failed_peer(&self, me: usize) -> Option<String> {
        let (r, rep) = self.failed()?;
        Some(if r == me {
            format!("another rank failed because this rank {}", rep.text)
        } else {
            format!("rank {r} {}", rep.text)
        })
    }
}

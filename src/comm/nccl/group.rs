//! One call's collectives (a reduce or a broadcast per key) issued in one NCCL group over the
//! cached communicators of their device sets, on the GPUs' runtime streams, and handed to the
//! watchdog as work in flight.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::cache::{forget, get_set};
use super::comm_set::CommSet;
use super::loader::Nccl;
use super::result::{self, lib, nccl_error, During, On};
use super::watchdog::{fail, inflight, start_watchdog, Pending};
use crate::backend::cuda::{cross_gpu_order, cuda_err};
use crate::config::nccl::timeout;
use crate::{DType, Key, Result};

/// What one key's collective does. Ranks are indices into the job's `devices`.
pub(crate) enum Kind {
    /// Sum `sends[rank]` (one per rank) into `recv` on rank `root`.
    Reduce {
        sends: Vec<u64>,
        recv: u64,
        root: usize,
    },
    /// Copy `send` on rank `root` into `recvs[rank]` (the root's recv may equal `send`).
    Broadcast {
        send: u64,
        recvs: Vec<u64>,
        root: usize,
    },
}

/// One key's collective over a set of GPUs.
pub(crate) struct Job {
    pub key: Key,
    pub dtype: DType,
    pub n: usize,
    /// Distinct GPU ordinals, ascending: rank `r` is `devices[r]`.
    pub devices: Vec<usize>,
    pub kind: Kind,
}

/// Issues every job's collective in one NCCL group on the GPUs' runtime streams, holding
/// [`cross_gpu_order`] and each set's call lock (never the cache's or the in-flight list's);
/// what reports `ncclInProgress` is polled with the timeout, and a stall is aborted. The
/// caller keeps every buffer named by a job alive (freed on its GPU's stream, so after the
/// collective).
pub(crate) fn run(op: &'static str, jobs: &[Job]) -> Result<()> {
    if jobs.is_empty() {
        return Ok(());
    }
    let all_keys: Vec<Key> = jobs.iter().map(|j| j.key.clone()).collect();
    let lib = lib(op, &all_keys)?;
    let limit = timeout()?;
    start_watchdog();
    // Errors of earlier work (other keys) do not fail this call: wait_all reports them.
    let failure = inflight().poll().err();
    if let Some(f) = failure {
        fail(&f);
        inflight().deferred.push(f.error);
    }
    let mut set_keys: Vec<Vec<usize>> = jobs.iter().map(|j| j.devices.clone()).collect();
    set_keys.sort();
    set_keys.dedup();
    let keys_of = |s: &Vec<usize>| -> Vec<Key> {
        jobs.iter()
            .filter(|j| &j.devices == s)
            .map(|j| j.key.clone())
            .collect()
    };
    let sets = (set_keys.iter().map(|s| get_set(s, &keys_of(s)))).collect::<Result<Vec<_>>>()?;
    let order = cross_gpu_order();
    // Always in ascending set order, so two calls never wait on each other's locks.
    let mut guards: Vec<_> = sets.iter().map(|s| s.lock()).collect();
    let mut result = if guards.iter().any(|g| g.aborted) {
        Err(nccl_error(
            op,
            &all_keys,
            "the communicators were aborted after an earlier failure; retry the call".to_owned(),
        ))
    } else {
        issue(lib, &set_keys, &sets, op, jobs, &all_keys)
    };
    let deadline = Instant::now() + limit;
    for (s, k) in sets.iter().zip(&set_keys) {
        result = result.and_then(|()| s.settle(lib, op, &keys_of(k), deadline));
    }
    let events = result.and_then(|()| {
        let record = |s: &Arc<CommSet>| {
            s.ranks
                .iter()
                .map(|r| r.stream.record_event(None))
                .collect()
        };
        let events: std::result::Result<Vec<Vec<_>>, _> = sets.iter().map(record).collect();
        events.map_err(cuda_err("record NCCL event", None))
    });
    if events.is_err() {
        // A failed group leaves the communicators in an unknown state: abort them all.
        for (s, g) in sets.iter().zip(guards.iter_mut()) {
            s.abort_locked(g);
        }
    }
    drop(guards);
    drop(order);
    let events = events.inspect_err(|_| {
        for (k, s) in set_keys.iter().zip(&sets) {
            forget(k, s);
        }
    })?;
    ISSUED.fetch_add(jobs.len() as u64, Ordering::Relaxed);
    let mut c = inflight();
    for ((k, s), events) in set_keys.iter().zip(sets).zip(events) {
        let seq = c.next_seq;
        c.next_seq += 1;
        c.pending.push(Pending {
            seq,
            issued: Instant::now(),
            set: k.clone(),
            comms: s,
            events,
            keys: keys_of(k),
            op,
        });
    }
    Ok(())
}

/// The group itself: `group_end` is always called, even after a failed call inside.
fn issue(
    lib: &Nccl,
    set_keys: &[Vec<usize>],
    sets: &[Arc<CommSet>],
    op: &'static str,
    jobs: &[Job],
    all_keys: &[Key],
) -> Result<()> {
    // The matching group end is always called below.
    result::group_start(lib).during(op, all_keys)?;
    let mut first: Result<()> = Ok(());
    for job in jobs {
        let at = set_keys
            .binary_search(&job.devices)
            .expect("every job's set is in the list");
        for (rank, r) in sets[at].ranks.iter().enumerate() {
            let (on, n, dt) = (On::new(lib, r.comm, &r.stream), job.n, job.dtype);
            let only_root = |p: u64, root: usize| if rank == root { p } else { 0 };
            // SAFETY: the addresses name live device buffers of `job.n` elements of `job.dtype`
            // on this rank's GPU (kept alive by the caller, freed on this stream, so after the
            // collective); `r.comm` is a live communicator used under its set's call lock;
            // `r.stream` is its rank's live runtime stream.
            let res = unsafe {
                match &job.kind {
                    Kind::Reduce { sends, recv, root } => {
                        result::reduce(on, sends[rank], only_root(*recv, *root), n, dt, *root)
                    }
                    Kind::Broadcast { send, recvs, root } => {
                        result::broadcast(on, only_root(*send, *root), recvs[rank], n, dt, *root)
                    }
                }
            };
            first = first.and(res.during(op, std::slice::from_ref(&job.key)));
        }
    }
    first.and(result::group_end(lib).during(op, all_keys))
}

/// How many collectives (one per key and call) the store's NCCL path has issued (for tests).
pub fn collectives_issued() -> u64 {
    ISSUED.load(Ordering::Relaxed)
}

static ISSUED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

//! [`AsyncKvStore`]: a store whose calls return at once and run on a worker thread, as MXNet's
//! engine ran KVStore calls; [`pending`] holds the order rule.

mod pending;
#[cfg(test)]
mod tests;

use std::cell::Cell;
use std::collections::HashSet;
use std::fmt;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::store::ValueList;
use crate::{Error, IntoKey, Key, KvStore, NDArray, Result};
use pending::Pending;

/// A call the worker runs: what it does to the store.
type Run = Box<dyn FnOnce(&KvStore) -> Result<()> + Send>;

/// A queued call.
struct Call {
    /// The store operation, as [`KvStore::reject`] names it to the other ranks.
    op: &'static str,
    /// The call in words, for errors and the timeline.
    what: String,
    queued: Instant,
    run: Run,
}

/// The first failure since the last [`AsyncKvStore::wait_all`], and the calls it skipped.
struct Failure {
    what: String,
    error: Arc<Error>,
    skipped: usize,
}

impl Failure {
    fn to_error(&self) -> Error {
        Error::Async {
            call: self.what.clone(),
            skipped: self.skipped,
            source: self.error.clone(),
        }
    }
}

/// When one call ran: see [`AsyncKvStore::set_timeline`].
#[derive(Clone, Debug)]
pub struct CallSpan {
    /// The call in words, with its number in issue order: `"#3 push [w1, b1]"`.
    pub call: String,
    /// When it was issued.
    pub queued: Instant,
    /// When the worker started it.
    pub started: Instant,
    /// When it finished.
    pub finished: Instant,
    /// Whether it ran and succeeded.
    pub ok: bool,
}

#[derive(Default)]
struct State {
    pending: Pending<Call>,
    /// The number of the last call queued (calls count from 1).
    last_id: u64,
    failure: Option<Failure>,
    /// Keys of calls that failed or were not run since the last `wait_all`.
    failed_keys: HashSet<Key>,
    /// Set when the store is dropped: the worker runs what is queued, then ends.
    closing: bool,
    timeline: Option<Vec<CallSpan>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when a call is queued, when one finishes, and on close.
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(guard).unwrap_or_else(|e| e.into_inner())
    }
}

/// A store whose `push`, `pull` and `pushpull` return at once and run in issue order on one
/// worker thread per store (MXNet's asynchronous KVStore calls), so that a training loop can
/// push each layer's gradients as backward makes them and go on computing.
///
/// **The contract, as MXNet's `wait_to_read`:** a call shares its arrays with the worker until
/// it is done. Do not write a push's values, nor touch a pull's outs, before
/// [`AsyncKvStore::wait`] on their key or [`AsyncKvStore::wait_all`] has returned.
///
/// **Order.** On a single-process store, the worker starts the waiting call of highest
/// priority (MXNet: `priority = -layer index`) that no older waiting call shares a key with,
/// so each key's calls run in issue order. On several ranks calls run in issue order, since
/// the ranks' collectives must match: give every rank the same sequence of calls.
///
/// **Errors.** A call's error comes back as [`Error::Async`] from the next `wait` on one of
/// its keys or `wait_all`. Later calls are not run (on a dist store each is refused to the
/// other ranks) until `wait_all` has returned it; a store dropped with a failure no wait
/// returned logs it.
///
/// Calls made directly on [`AsyncKvStore::store`] (`init`, `set_updater`, `save`) are not
/// ordered with queued ones: call `wait_all` first.
///
/// ```
/// use kvstore::{AsyncKvStore, KvStore, NDArray};
/// let kv = KvStore::create("local")?;
/// kv.init_list(&[0, 1], &[NDArray::zeros([2]), NDArray::zeros([3])])?;
/// let kv = AsyncKvStore::new(kv);
/// kv.push(0, &NDArray::ones([2]), 0); // returns at once
/// kv.push(1, &NDArray::full([3], 2.0), 0);
/// let out = NDArray::zeros([3]);
/// kv.pull(1, &out, 0);
/// kv.wait(1)?; // the push and the pull of key 1 are done
/// assert_eq!(out.to_vec::<f32>()?, vec![2.0; 3]);
/// kv.pull(7, &out, 0); // an unknown key: the error comes at the wait
/// assert!(matches!(kv.wait_all(), Err(kvstore::Error::Async { .. })));
/// # Ok::<(), kvstore::Error>(())
/// ```
pub struct AsyncKvStore {
    store: Arc<KvStore>,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl AsyncKvStore {
    /// Starts a worker for `store`.
    pub fn new(store: impl Into<Arc<KvStore>>) -> AsyncKvStore {
        let store = store.into();
        let shared = Arc::new(Shared::default());
        let by_priority = store.num_workers() == 1;
        let (s, sh) = (store.clone(), shared.clone());
        // Without a thread, every call runs on the caller's thread as it is issued (see
        // `submit`): the order and the errors are the same.
        let worker = std::thread::Builder::new()
            .name("kvstore-async".into())
            .spawn(move || work(&s, &sh, by_priority))
            .map_err(|e| {
                log::warn!("kvstore: no worker thread ({e}); asynchronous calls run at once")
            })
            .ok();
        AsyncKvStore {
            store,
            shared,
            worker,
        }
    }

    /// The store underneath, for calls that are not queued (after [`AsyncKvStore::wait_all`]).
    pub fn store(&self) -> &KvStore {
        &self.store
    }

    /// Queues `run`, a call of store operation `op` (as [`KvStore::reject`] names it) on
    /// `keys`, for adapters that wrap a store call in their own work (the Python package's
    /// pull). `run` must make the store call it names: on a dist store the other ranks do.
    pub fn submit(
        &self,
        op: &'static str,
        keys: Vec<Key>,
        priority: i32,
        run: impl FnOnce(&KvStore) -> Result<()> + Send + 'static,
    ) {
        let what = format!("{op} {}", list(&keys));
        self.queue(op, keys, priority, what, run);
    }

    /// Queues call `op` as refused with `error` (bad arguments): in its turn it fails here and
    /// is refused to the other ranks ([`KvStore::reject`]). It has no keys: no call passes it.
    pub fn refuse(&self, op: &'static str, priority: i32, error: Error) {
        let what = format!("{op} (refused: {error})");
        self.queue(op, Vec::new(), priority, what, move |kv| {
            kv.reject(op, &error.to_string())?;
            Err(error)
        });
    }

    fn queue(
        &self,
        op: &'static str,
        keys: Vec<Key>,
        priority: i32,
        what: String,
        run: impl FnOnce(&KvStore) -> Result<()> + Send + 'static,
    ) {
        let mut state = self.shared.lock();
        state.last_id += 1;
        let id = state.last_id;
        let call = Call {
            op,
            what: format!("#{id} {what}"),
            queued: Instant::now(),
            run: Box::new(run),
        };
        state.pending.push(keys, priority, call);
        if self.worker.is_none() {
            // No worker: run it here, now (the queue holds only this call).
            let (keys, call) = state.pending.next(false).expect("the call just queued");
            drop(state);
            finish(&self.store, &self.shared, keys, call);
            return;
        }
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Queues a push of `values` to `key` ([`KvStore::push`]).
    pub fn push<V: ValueList + ?Sized>(&self, key: impl IntoKey, values: &V, priority: i32) {
        let values = values.arrays().to_vec();
        self.queue_keys("push", [key], priority, move |kv, keys| {
            kv.push_list(keys, &[values])
        });
    }

    /// Queues a push to many keys at once ([`KvStore::push_list`]).
    pub fn push_list<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        values: &[V],
        priority: i32,
    ) {
        let values = owned(values);
        self.queue_keys("push", keys.iter().cloned(), priority, move |kv, keys| {
            kv.push_list(keys, &values)
        });
    }

    /// Queues a pull of `key` into `outs` ([`KvStore::pull`]).
    pub fn pull<V: ValueList + ?Sized>(&self, key: impl IntoKey, outs: &V, priority: i32) {
        let outs = outs.arrays().to_vec();
        self.queue_keys("pull", [key], priority, move |kv, keys| {
            kv.pull_list(keys, &[outs])
        });
    }

    /// Queues a pull of many keys at once ([`KvStore::pull_list`]).
    pub fn pull_list<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        outs: &[V],
        priority: i32,
    ) {
        let outs = owned(outs);
        self.queue_keys("pull", keys.iter().cloned(), priority, move |kv, keys| {
            kv.pull_list(keys, &outs)
        });
    }

    /// Queues a push of `values` to `key` and a pull into `outs` ([`KvStore::pushpull`]).
    pub fn pushpull<V: ValueList + ?Sized, O: ValueList + ?Sized>(
        &self,
        key: impl IntoKey,
        values: &V,
        outs: &O,
        priority: i32,
    ) {
        let (values, outs) = (values.arrays().to_vec(), outs.arrays().to_vec());
        self.queue_keys("pushpull", [key], priority, move |kv, keys| {
            kv.pushpull_list(keys, &[values], &[outs])
        });
    }

    /// Queues a push and pull of many keys as one step ([`KvStore::pushpull_list`]).
    pub fn pushpull_list<K: IntoKey + Clone, V: ValueList, O: ValueList>(
        &self,
        keys: &[K],
        values: &[V],
        outs: &[O],
        priority: i32,
    ) {
        let (values, outs) = (owned(values), owned(outs));
        self.queue_keys(
            "pushpull",
            keys.iter().cloned(),
            priority,
            move |kv, keys| kv.pushpull_list(keys, &values, &outs),
        );
    }

    /// Queues `run` on the converted `keys`; a key that does not convert refuses the call.
    fn queue_keys<K: IntoKey>(
        &self,
        op: &'static str,
        keys: impl IntoIterator<Item = K>,
        priority: i32,
        run: impl FnOnce(&KvStore, &[Key]) -> Result<()> + Send + 'static,
    ) {
        match keys
            .into_iter()
            .map(IntoKey::into_key)
            .collect::<Result<Vec<Key>>>()
        {
            Ok(keys) => self.submit(op, keys.clone(), priority, move |kv| run(kv, &keys)),
            // No keys: a fence, so it fails in its place in the order.
            Err(e) => self.refuse(op, priority, e),
        }
    }

    /// Waits until every queued call on `key` is done (each is bounded, on a dist store by
    /// `KVSTORE_TIMEOUT`); the first failure since the last `wait_all` if one of them failed or
    /// was skipped.
    pub fn wait(&self, key: impl IntoKey) -> Result<()> {
        let key = key.into_key()?;
        self.not_on_worker("wait")?;
        let mut state = self.shared.lock();
        while state.pending.is_busy(&key) {
            state = self.shared.wait(state);
        }
        match &state.failure {
            Some(f) if state.failed_keys.contains(&key) => Err(f.to_error()),
            _ => Ok(()),
        }
    }

    /// Waits until every queued call is done, then for the store's GPU work. Returns the first
    /// failure since the last `wait_all`, after which queued calls run again.
    pub fn wait_all(&self) -> Result<()> {
        self.not_on_worker("wait_all")?;
        let mut state = self.shared.lock();
        while !state.pending.is_idle() {
            state = self.shared.wait(state);
        }
        let failure = state.failure.take();
        state.failed_keys.clear();
        drop(state);
        match failure {
            Some(f) => Err(f.to_error()),
            None => self.store.wait_all(),
        }
    }

    /// An error for a wait made by a queued call itself, which would wait forever.
    fn not_on_worker(&self, op: &'static str) -> Result<()> {
        if IN_CALL.with(Cell::get) {
            return Err(Error::InvalidUpdater(format!(
                "{op} was called from a queued call (a custom updater, say) on the store \
                     that runs it, and would wait for itself forever: wait outside the updater"
            )));
        }
        Ok(())
    }

    /// Starts or stops recording when each call ran ([`AsyncKvStore::take_timeline`]); off by
    /// default.
    pub fn set_timeline(&self, on: bool) {
        let mut state = self.shared.lock();
        state.timeline = on.then(|| state.timeline.take().unwrap_or_default());
    }

    /// The calls finished since the timeline was started or last taken, in the order they
    /// finished; empty when it is off.
    pub fn take_timeline(&self) -> Vec<CallSpan> {
        let timeline = self.shared.lock().timeline.as_mut().map(std::mem::take);
        timeline.unwrap_or_default()
    }
}

impl Drop for AsyncKvStore {
    /// Runs what is queued, then ends the worker; a failure no wait returned goes to stderr.
    /// Dropped by a queued call itself, it lets the worker finish the queue on its own.
    fn drop(&mut self) {
        self.shared.lock().closing = true;
        self.shared.changed.notify_all();
        if let Some(w) = self.worker.take() {
            if w.thread().id() == std::thread::current().id() {
                return;
            }
            let _ = w.join();
        }
        report_unseen(&self.shared);
    }
}

/// Writes a failure that no wait returned to stderr and the log.
fn report_unseen(shared: &Shared) {
    if let Some(f) = shared.lock().failure.take() {
        let text = format!(
            "kvstore: an asynchronous call failed and no wait returned it: {}",
            f.to_error()
        );
        log::error!("{text}");
        let _ = writeln!(std::io::stderr(), "{text}");
    }
}

impl fmt::Debug for AsyncKvStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncKvStore")
            .field("store", &self.store.type_name())
            .finish_non_exhaustive()
    }
}

/// The worker: takes calls in order and runs them until the store is dropped.
fn work(store: &KvStore, shared: &Shared, by_priority: bool) {
    loop {
        let mut state = shared.lock();
        let (keys, call) = loop {
            if let Some(next) = state.pending.next(by_priority) {
                break next;
            }
            if state.closing {
                drop(state);
                // Dropped from a queued call, the store could not report this itself.
                report_unseen(shared);
                return;
            }
            state = shared.wait(state);
        };
        drop(state);
        finish(store, shared, keys, call);
    }
}

thread_local! {
    /// Whether this thread is running a queued call (the worker, or a caller when there is
    /// none): a wait there would wait for itself.
    static IN_CALL: Cell<bool> = const { Cell::new(false) };
}

/// Runs one call taken from the queue (or, after a failure, refuses it), and records the end.
fn finish(store: &KvStore, shared: &Shared, keys: Vec<Key>, call: Call) {
    let started = Instant::now();
    let failed_before = shared.lock().failure.as_ref().map(|f| f.what.clone());
    let result = match failed_before {
        Some(first) => {
            // The other ranks are told, so that their same call fails instead of waiting.
            let why = format!("not run: the earlier asynchronous call {first} failed");
            let _ = store.reject(call.op, &why);
            Err(None)
        }
        None => {
            IN_CALL.with(|c| c.set(true));
            let ran = catch_unwind(AssertUnwindSafe(|| (call.run)(store)));
            IN_CALL.with(|c| c.set(false));
            match ran {
                Ok(r) => r.map_err(Some),
                Err(panic) => Err(Some(Error::Internal {
                    op: call.op,
                    message: format!(
                        "an asynchronous call panicked: {}",
                        crate::error::panic_message(&*panic)
                    ),
                })),
            }
        }
    };
    let finished = Instant::now();
    let mut state = shared.lock();
    let ok = result.is_ok();
    if let Err(error) = result {
        state.failed_keys.extend(keys.iter().cloned());
        match (error, state.failure.as_mut()) {
            (Some(error), None) => {
                state.failure = Some(Failure {
                    what: call.what.clone(),
                    error: Arc::new(error),
                    skipped: 0,
                })
            }
            (None, Some(f)) => f.skipped += 1,
            _ => {}
        }
    }
    if let Some(t) = state.timeline.as_mut() {
        t.push(CallSpan {
            call: call.what,
            queued: call.queued,
            started,
            finished,
            ok,
        });
    }
    state.pending.done(&keys);
    drop(state);
    shared.changed.notify_all();
}

/// Owned handles of every array of `lists`.
fn owned<V: ValueList>(lists: &[V]) -> Vec<Vec<NDArray>> {
    lists.iter().map(|v| v.arrays().to_vec()).collect()
}

/// Keys in words: `[3, w1]`, shortened past eight.
fn list(keys: &[Key]) -> String {
    let shown: Vec<String> = keys.iter().take(8).map(|k| k.to_string()).collect();
    match keys.len() {
        n if n > 8 => format!("[{}, ... ({n} keys)]", shown.join(", ")),
        _ => format!("[{}]", shown.join(", ")),
    }
}

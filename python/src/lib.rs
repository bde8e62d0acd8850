//! `kvstore._native`: the Rust half of the `kvstore` Python package.
//!
//! A thin layer over kvstore's public API. The Python half (`kvstore/__init__.py`) turns MXNet's
//! call forms (one key or a list, one array or a list, lists of lists) into flat lists of keys
//! and of DLPack capsules, one list of capsules per key; this module imports the capsules, calls
//! the store with the GIL released, and maps kvstore's `Error` to Python exceptions.

mod arrays;
mod errors;
mod updater;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use kvstore::{Adam, AsyncKvStore, Key, KvStore, NDArray, RowSparse, Sgd, Updater};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use arrays::Imported;

/// A queued call's outcome, for the Python half: `ok()` once it ran and succeeded. A call that
/// failed, or was not run because an earlier one failed, stays not ok, and its results are not
/// copied into the caller's arrays.
#[pyclass(frozen)]
struct Done(Arc<AtomicBool>);

#[pymethods]
impl Done {
    /// Whether the call ran and succeeded.
    fn ok(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// A key from Python: an `int` (or anything with `__index__`, such as a NumPy integer) or a
/// `str`. `bool` is refused, as it is almost always a mistake.
fn key_from(obj: &Bound<'_, PyAny>) -> PyResult<Key> {
    if obj.is_instance_of::<PyString>() {
        return Ok(Key::Str(obj.extract::<String>()?));
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(
            "keys are int or str, got a bool: pass an int key",
        ));
    }
    match obj.extract::<i64>() {
        Ok(k) => kvstore::IntoKey::into_key(k).map_err(errors::to_py),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => {
            Err(errors::to_py(kvstore::Error::KeyOutOfRange {
                value: obj.str()?.to_string(),
                ty: "int",
            }))
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "keys are int or str, got {}: pass an int or a str",
            obj.get_type().name()?
        ))),
    }
}

fn keys_from(keys: &[Bound<'_, PyAny>]) -> PyResult<Vec<Key>> {
    keys.iter().map(key_from).collect()
}

/// Imports one list of capsules per key.
fn import_lists(lists: &[Vec<Bound<'_, PyAny>>]) -> PyResult<Vec<Vec<Imported>>> {
    lists
        .iter()
        .map(|l| l.iter().map(arrays::import).collect())
        .collect()
}

/// Imports out capsules, each checked writable.
fn import_outs(lists: &[Vec<Bound<'_, PyAny>>]) -> PyResult<Vec<Vec<Imported>>> {
    let mut outs = import_lists(lists)?;
    for o in outs.iter_mut().flatten() {
        o.check_writable()?;
    }
    Ok(outs)
}

/// Copies imported arrays into kvstore arrays (one copy each).
fn to_ndarrays(lists: &[Vec<Imported>]) -> PyResult<Vec<Vec<NDArray>>> {
    lists
        .iter()
        .map(|l| l.iter().map(Imported::to_ndarray).collect())
        .collect()
}

/// One zeroed kvstore array per out, of the out's shape and dtype.
fn scratch(outs: &[Vec<Imported>]) -> PyResult<Vec<Vec<NDArray>>> {
    outs.iter()
        .map(|l| l.iter().map(Imported::scratch).collect())
        .collect()
}

/// Copies each scratch array into its out.
fn write_back(outs: &[Vec<Imported>], scratch: &[Vec<NDArray>]) -> PyResult<()> {
    for (outs, scratch) in outs.iter().zip(scratch) {
        for (o, s) in outs.iter().zip(scratch) {
            o.write_from(s)?;
        }
    }
    Ok(())
}

/// The instant `clock()` counts from, for timelines.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// A Python error in a queued call (copying a pull's result into the caller's array, after
/// its checks passed), as the store's error.
fn queued_py_error(op: &'static str, e: PyErr) -> kvstore::Error {
    kvstore::Error::Internal {
        op,
        message: format!("writing the result into the caller's array failed: {e}"),
    }
}

/// `r`; when it is an error, first the other workers of a dist store are told that this one
/// will not make its call `op` (so they fail it instead of waiting for this worker). For errors
/// found before the store is called: converting the arguments.
/// On a world that failed earlier the error is that failure (`DistFailedError`), as for every
/// other call.
fn told<T>(py: Python<'_>, kv: &Arc<KvStore>, op: &'static str, r: PyResult<T>) -> PyResult<T> {
    if let Err(e) = &r {
        let why = format!("{}: {e}", e.get_type(py).name()?);
        let kv = kv.clone();
        py.detach(move || kv.reject(op, &why))
            .map_err(errors::to_py)?;
    }
    r
}

/// [`told`] for work done with the GIL released.
fn told_detached<T>(kv: &KvStore, op: &'static str, r: PyResult<T>) -> PyResult<T> {
    if let Err(e) = &r {
        kv.reject(op, &e.to_string()).map_err(errors::to_py)?;
    }
    r
}

impl PyStore {
    /// The queue of the `*_async` calls (started on first use).
    fn queue(&self) -> &AsyncKvStore {
        self.queue
            .get_or_init(|| AsyncKvStore::new(self.inner.clone()))
    }

    /// The store, once every queued call is done, for a blocking call: it goes after them, as
    /// issued. The error of a queued call that failed, if one did (see `wait_all`). For calls
    /// that only this worker makes (setters, counters).
    fn store(&self, py: Python<'_>) -> PyResult<Arc<KvStore>> {
        if let Some(q) = self.queue.get() {
            py.detach(|| q.wait_all()).map_err(errors::to_py)?;
        }
        Ok(self.inner.clone())
    }

    /// [`PyStore::store`] for a call `op` that every worker of a dist store makes: when a queued
    /// call failed, this worker will not make it, so the other workers are told
    /// ([`KvStore::reject`]) and their same call fails at once, naming the failure, instead of
    /// waiting for this worker until the timeout. (A failure every worker's queue met is told
    /// by every worker: their refusals meet each other, as their calls would have.)
    fn store_for(&self, py: Python<'_>, op: &'static str) -> PyResult<Arc<KvStore>> {
        let Some(q) = self.queue.get() else {
            return Ok(self.inner.clone());
        };
        match py.detach(|| q.wait_all()) {
            Ok(()) => Ok(self.inner.clone()),
            Err(e) => {
                let why = format!("an asynchronous call before it failed on this worker: {e}");
                // The queued call's error is the one to raise, whatever telling found (a world
                // that failed earlier already fails the others' calls).
                let _ = py.detach(|| self.inner.reject(op, &why));
                Err(errors::to_py(e))
            }
        }
    }

    /// Queues `run` on the converted `args`. Arguments that did not convert raise here, and
    /// the call is queued as a failure in its place, told to the other workers when it runs,
    /// so the queues of every worker fail the same call.
    fn queue_call<A: Send + 'static>(
        &self,
        py: Python<'_>,
        op: &'static str,
        priority: i32,
        args: PyResult<(Vec<Key>, A)>,
        run: impl FnOnce(&KvStore, &[Key], A) -> kvstore::Result<()> + Send + 'static,
    ) -> PyResult<Done> {
        let queue = self.queue();
        match args {
            Ok((keys, a)) => {
                let ks = keys.clone();
                let done = Arc::new(AtomicBool::new(false));
                let flag = done.clone();
                py.detach(|| {
                    queue.submit(op, ks, priority, move |kv| {
                        run(kv, &keys, a)?;
                        flag.store(true, Ordering::Release);
                        Ok(())
                    })
                });
                Ok(Done(done))
            }
            Err(e) => {
                let message = format!("{}: {e}", e.get_type(py).name()?);
                self.queue_refusal(py, op, priority, message);
                Err(e)
            }
        }
    }

    /// Queues call `op` as refused because `message`: when it runs, the other workers are told
    /// (their same call fails) and it fails here too, so later queued calls are not run.
    fn queue_refusal(&self, py: Python<'_>, op: &'static str, priority: i32, message: String) {
        let queue = self.queue();
        let error = kvstore::Error::Argument { op, message };
        py.detach(|| queue.refuse(op, priority, error));
    }

    /// An init of dense or row-sparse keys, one capsule per key.
    fn init_keys(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Bound<'_, PyAny>>,
        row_sparse: bool,
    ) -> PyResult<()> {
        let kv = self.store_for(py, "init")?;
        let args = (|| {
            let keys = keys_from(&keys)?;
            let values: Vec<Imported> =
                values.iter().map(arrays::import).collect::<PyResult<_>>()?;
            Ok((keys, values))
        })();
        let (keys, values) = told(py, &kv, "init", args)?;
        py.detach(move || {
            let values: Vec<NDArray> = told_detached(
                &kv,
                "init",
                values.iter().map(Imported::to_ndarray).collect(),
            )?;
            match row_sparse {
                true => kv.init_row_sparse_list(&keys, &values),
                false => kv.init_list(&keys, &values),
            }
            .map_err(errors::to_py)
        })
    }
}

/// A kvstore `KvStore`. Use `kvstore.create(...)`, which wraps it in `kvstore.KVStore`.
#[pyclass(name = "Store", module = "kvstore._native", frozen)]
struct PyStore {
    inner: Arc<KvStore>,
    /// The worker of the `*_async` calls, started by the first of them.
    queue: OnceLock<AsyncKvStore>,
}

impl Drop for PyStore {
    /// Runs the queued calls without the GIL: one may run a Python updater, which takes it.
    fn drop(&mut self) {
        if let Some(queue) = self.queue.take() {
            Python::attach(|py| py.detach(move || drop(queue)));
        }
    }
}

#[pymethods]
impl PyStore {
    /// A store of kind `name` ('local', 'device', 'nccl', or an alias).
    #[new]
    fn new(name: &str) -> PyResult<Self> {
        Ok(PyStore {
            inner: Arc::new(KvStore::create(name).map_err(errors::to_py)?),
            queue: OnceLock::new(),
        })
    }

    /// The name it was created with (MXNet's `kv.type`).
    #[getter]
    fn type_name(&self) -> String {
        self.inner.type_name().to_owned()
    }

    /// This worker's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// The number of workers.
    #[getter]
    fn num_workers(&self) -> usize {
        self.inner.num_workers()
    }

    /// This worker's rank among the workers on its machine.
    #[getter]
    fn local_rank(&self) -> usize {
        self.inner.local_rank()
    }

    /// Waits for every queued call, then for the store's GPU work (see
    /// `AsyncKvStore::wait_all`); the first error of a queued call since the last `wait_all`.
    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        match self.queue.get() {
            Some(q) => py.detach(|| q.wait_all()),
            None => {
                let kv = self.inner.clone();
                py.detach(move || kv.wait_all())
            }
        }
        .map_err(errors::to_py)
    }

    /// Waits until every queued call on `key` is done; the first error of a queued call since
    /// the last `wait_all` if one of them failed or was not run because of it.
    fn wait(&self, py: Python<'_>, key: Bound<'_, PyAny>) -> PyResult<()> {
        let key = key_from(&key)?;
        match self.queue.get() {
            Some(q) => py.detach(|| q.wait(key)).map_err(errors::to_py),
            None => Ok(()),
        }
    }

    /// Queues a push (see `push`); returns at once.
    fn push_async(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Vec<Bound<'_, PyAny>>>,
        priority: i32,
    ) -> PyResult<Done> {
        // The values are copied now: the caller may reuse its arrays at once.
        let args = (|| {
            let keys = keys_from(&keys)?;
            let imported = import_lists(&values)?;
            Ok((keys, py.detach(|| to_ndarrays(&imported))?))
        })();
        self.queue_call(py, "push", priority, args, |kv, keys, values| {
            kv.push_list(keys, &values)
        })
    }

    /// Queues a pull (see `pull`) into the outs, which are written when it runs: read them
    /// only after `wait` on the key or `wait_all`.
    fn pull_async(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        outs: Vec<Vec<Bound<'_, PyAny>>>,
        priority: i32,
    ) -> PyResult<Done> {
        let args = (|| {
            let keys = keys_from(&keys)?;
            let outs = import_outs(&outs)?;
            let tmp = scratch(&outs)?;
            Ok((keys, (outs, tmp)))
        })();
        self.queue_call(py, "pull", priority, args, |kv, keys, (outs, tmp)| {
            kv.pull_list(keys, &tmp)?;
            write_back(&outs, &tmp).map_err(|e| queued_py_error("pull", e))
        })
    }

    /// Queues a pushpull (see `pushpull`): the values are copied now, the outs written when it
    /// runs.
    fn pushpull_async(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Vec<Bound<'_, PyAny>>>,
        outs: Vec<Vec<Bound<'_, PyAny>>>,
        priority: i32,
    ) -> PyResult<Done> {
        let args = (|| {
            let keys = keys_from(&keys)?;
            let imported = import_lists(&values)?;
            let values = py.detach(|| to_ndarrays(&imported))?;
            let outs = import_outs(&outs)?;
            let tmp = scratch(&outs)?;
            Ok((keys, (values, outs, tmp)))
        })();
        self.queue_call(
            py,
            "pushpull",
            priority,
            args,
            |kv, keys, (values, outs, tmp)| {
                kv.pushpull_list(keys, &values, &tmp)?;
                write_back(&outs, &tmp).map_err(|e| queued_py_error("pushpull", e))
            },
        )
    }

    /// Queues call `op` ("push", "pull" or "pushpull") as refused, for an error the Python
    /// layer found in its arguments: the other workers' same call fails when it runs.
    fn refuse_async(&self, py: Python<'_>, op: &str, why: String, priority: i32) {
        let op = match op {
            "push" => "push",
            "pull" => "pull",
            "pushpull" => "pushpull",
            _ => "call",
        };
        self.queue_refusal(py, op, priority, why);
    }

    /// Seconds on the scale of `take_timeline`'s times: for timelines that mix the store's
    /// calls with the caller's own events.
    fn clock(&self) -> f64 {
        epoch().elapsed().as_secs_f64()
    }

    /// Starts (`True`) or stops recording when each queued call ran (`take_timeline`).
    fn set_timeline(&self, on: bool) {
        self.queue().set_timeline(on);
    }

    /// The queued calls finished since the timeline was started or last taken: tuples of
    /// (call, queued, started, finished, ok), times in seconds on `clock()`'s scale.
    fn take_timeline(&self) -> Vec<(String, f64, f64, f64, bool)> {
        let secs = |t: Instant| t.saturating_duration_since(epoch()).as_secs_f64();
        (self.queue().take_timeline().into_iter())
            .map(|c| {
                (
                    c.call,
                    secs(c.queued),
                    secs(c.started),
                    secs(c.finished),
                    c.ok,
                )
            })
            .collect()
    }

    /// Waits until every worker is here (bounded by `KVSTORE_TIMEOUT`).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let kv = self.store_for(py, "barrier")?;
        py.detach(move || kv.barrier().map_err(errors::to_py))
    }

    /// The keys, in update order (ints ascending, strings in init order).
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.inner
            .keys()
            .into_iter()
            .map(|k| match k {
                Key::Int(i) => Ok(i.into_pyobject(py)?.into_any()),
                Key::Str(s) => Ok(s.into_pyobject(py)?.into_any()),
                #[allow(unreachable_patterns)]
                other => Ok(other.to_string().into_pyobject(py)?.into_any()),
            })
            .collect()
    }

    /// `init(keys, values)`: one capsule per key.
    fn init(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.init_keys(py, keys, values, false)
    }

    /// `init_row_sparse(keys, values)`: one capsule per key, each key row-sparse.
    fn init_row_sparse(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.init_keys(py, keys, values, true)
    }

    /// `push_row_sparse(keys, values)`: per key, a list of (row ids, rows capsule) pairs.
    fn push_row_sparse(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Vec<(Vec<u64>, Bound<'_, PyAny>)>>,
    ) -> PyResult<()> {
        let kv = self.store_for(py, "push")?;
        let args = (|| {
            let keys = keys_from(&keys)?;
            let values = (values.iter())
                .map(|l| {
                    l.iter()
                        .map(|(ids, rows)| Ok((ids.clone(), arrays::import(rows)?)))
                        .collect::<PyResult<Vec<_>>>()
                })
                .collect::<PyResult<Vec<_>>>()?;
            Ok((keys, values))
        })();
        let (keys, values) = told(py, &kv, "push", args)?;
        py.detach(move || {
            let converted = (values.into_iter())
                .map(|l| {
                    (l.into_iter())
                        .map(|(ids, rows)| {
                            RowSparse::new(ids, rows.to_ndarray()?).map_err(errors::to_py)
                        })
                        .collect::<PyResult<Vec<RowSparse>>>()
                })
                .collect::<PyResult<Vec<_>>>();
            let values = told_detached(&kv, "push", converted)?;
            kv.push_row_sparse_list(&keys, &values)
                .map_err(errors::to_py)
        })
    }

    /// `row_sparse_pull(key, ids, out)`: rows `ids` (distinct, ascending) into `out`, a capsule
    /// of shape `[len(ids), ...]` and the key's dtype.
    fn row_sparse_pull(
        &self,
        py: Python<'_>,
        key: Bound<'_, PyAny>,
        ids: Vec<u64>,
        out: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let kv = self.store_for(py, "pull")?;
        let args = (|| {
            let mut out = arrays::import(&out)?;
            out.check_writable()?;
            Ok((key_from(&key)?, out))
        })();
        let (key, out) = told(py, &kv, "pull", args)?;
        py.detach(move || {
            let got = kv.row_sparse_pull(key, &ids).map_err(errors::to_py)?;
            out.write_from(got.rows())
        })
    }

    /// `meta(key)`: the key's shape, dtype name, and whether it is row-sparse.
    fn meta(&self, key: Bound<'_, PyAny>) -> PyResult<(Vec<usize>, String, bool)> {
        let key = key_from(&key)?;
        let (shape, dtype, _) = self.inner.meta(key.clone()).map_err(errors::to_py)?;
        let sparse = self.inner.is_row_sparse(key).map_err(errors::to_py)?;
        Ok((shape.dims().to_vec(), dtype.name().to_owned(), sparse))
    }

    /// `push(keys, values, priority)`: a list of capsules per key.
    fn push(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Vec<Bound<'_, PyAny>>>,
        priority: i32,
    ) -> PyResult<()> {
        let kv = self.store_for(py, "push")?;
        let args = (|| Ok((keys_from(&keys)?, import_lists(&values)?)))();
        let (keys, values) = told(py, &kv, "push", args)?;
        py.detach(move || {
            let values = told_detached(&kv, "push", to_ndarrays(&values))?;
            let priorities = vec![priority; keys.len()];
            kv.push_list_with_priority(&keys, &values, &priorities)
                .map_err(errors::to_py)
        })
    }

    /// `pull(keys, outs, priority)`: a list of writable capsules per key.
    fn pull(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        outs: Vec<Vec<Bound<'_, PyAny>>>,
        priority: i32,
    ) -> PyResult<()> {
        let kv = self.store_for(py, "pull")?;
        let args = (|| Ok((keys_from(&keys)?, import_outs(&outs)?)))();
        let (keys, outs) = told(py, &kv, "pull", args)?;
        py.detach(move || {
            let tmp = told_detached(&kv, "pull", scratch(&outs))?;
            let priorities = vec![priority; keys.len()];
            kv.pull_list_with_priority(&keys, &tmp, &priorities)
                .map_err(errors::to_py)?;
            write_back(&outs, &tmp)
        })
    }

    /// `pushpull(keys, values, outs)`: every push, then every pull, atomically.
    fn pushpull(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Vec<Bound<'_, PyAny>>>,
        outs: Vec<Vec<Bound<'_, PyAny>>>,
    ) -> PyResult<()> {
        let kv = self.store_for(py, "pushpull")?;
        let args = (|| {
            Ok((
                keys_from(&keys)?,
                import_lists(&values)?,
                import_outs(&outs)?,
            ))
        })();
        let (keys, values, outs) = told(py, &kv, "pushpull", args)?;
        py.detach(move || {
            let prepared = (|| Ok((to_ndarrays(&values)?, scratch(&outs)?)))();
            let (values, tmp) = told_detached(&kv, "pushpull", prepared)?;
            kv.pushpull_list(&keys, &values, &tmp)
                .map_err(errors::to_py)?;
            write_back(&outs, &tmp)
        })
    }

    /// `broadcast(keys, values, outs)`: init, then pull; one value capsule per key.
    fn broadcast(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Bound<'_, PyAny>>,
        outs: Vec<Vec<Bound<'_, PyAny>>>,
    ) -> PyResult<()> {
        let kv = self.store_for(py, "broadcast")?;
        let args = (|| {
            let keys = keys_from(&keys)?;
            let values: Vec<Imported> =
                values.iter().map(arrays::import).collect::<PyResult<_>>()?;
            Ok((keys, values, import_outs(&outs)?))
        })();
        let (keys, values, outs) = told(py, &kv, "broadcast", args)?;
        py.detach(move || {
            let prepared = (|| {
                let values: Vec<NDArray> = values
                    .iter()
                    .map(Imported::to_ndarray)
                    .collect::<PyResult<_>>()?;
                Ok((values, scratch(&outs)?))
            })();
            let (values, tmp) = told_detached(&kv, "broadcast", prepared)?;
            kv.broadcast_list(&keys, &values, &tmp)
                .map_err(errors::to_py)?;
            write_back(&outs, &tmp)
        })
    }

    /// Sets a Python function as the updater: `trampoline(fn, key, input, stored, shape,
    /// dtype)` is called for each key of a push (see `kvstore/_updater.py`). `identity` is
    /// what the workers of a dist store compare of it (`kvstore._updater.identity`).
    fn set_python_updater(
        &self,
        py: Python<'_>,
        trampoline: Py<PyAny>,
        function: Py<PyAny>,
        identity: &str,
    ) -> PyResult<()> {
        self.store(py)?
            .set_updater(updater::python_updater(trampoline, function, identity))
            .map_err(errors::to_py)
    }

    /// Checks that every worker passes the same `what` (`DesyncError` otherwise).
    fn agree(&self, py: Python<'_>, what: String) -> PyResult<()> {
        let kv = self.store_for(py, "agree")?;
        py.detach(move || kv.agree(&what).map_err(errors::to_py))
    }

    /// For each flag, whether any worker passed True (see `KvStore::any_of`).
    fn any_of(&self, py: Python<'_>, what: String, flags: Vec<bool>) -> PyResult<Vec<bool>> {
        let kv = self.store_for(py, "agree")?;
        py.detach(move || kv.any_of(&what, &flags).map_err(errors::to_py))
    }

    /// Sets the tag every later call's check carries (see `KvStore::set_tag`).
    fn set_tag(&self, tag: Option<String>) {
        self.inner.set_tag(tag.as_deref());
    }

    /// Tells the other workers that this one will not make its call `op`, because `why` (an
    /// error the Python layer found in its arguments).
    /// `DistFailedError` when the world failed earlier (raise that instead).
    fn reject(&self, py: Python<'_>, op: String, why: String) -> PyResult<()> {
        let kv = self.store(py)?;
        py.detach(move || kv.reject(&op, &why).map_err(errors::to_py))
    }

    /// Back to the default updater: assign.
    fn set_assign(&self, py: Python<'_>) -> PyResult<()> {
        self.store(py)?
            .set_updater(Updater::Assign)
            .map_err(errors::to_py)
    }

    /// SGD (MXNet's `sgd_update` / `sgd_mom_update`) as the updater; `keep_state`: new
    /// hyperparameters for the SGD in force, keeping every key's state.
    #[pyo3(signature = (lr, momentum, wd, rescale_grad, clip_gradient, keep_state=false))]
    #[allow(clippy::too_many_arguments)]
    fn set_sgd(
        &self,
        py: Python<'_>,
        lr: f64,
        momentum: f64,
        wd: f64,
        rescale_grad: f64,
        clip_gradient: Option<f64>,
        keep_state: bool,
    ) -> PyResult<()> {
        let sgd = Sgd {
            lr,
            momentum,
            wd,
            rescale_grad,
            clip_gradient,
        };
        let store = self.store(py)?;
        match keep_state {
            true => store.update_hyperparameters(Updater::Sgd(sgd)),
            false => store.set_updater(Updater::Sgd(sgd)),
        }
        .map_err(errors::to_py)
    }

    /// Adam (MXNet's `adam_update`, or PyTorch's epsilon placement) as the updater; `keep_state`:
    /// new hyperparameters for the Adam in force, keeping every key's state and step.
    #[pyo3(signature = (lr, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient, epsilon_after_correction, keep_state=false))]
    #[allow(clippy::too_many_arguments)]
    fn set_adam(
        &self,
        py: Python<'_>,
        lr: f64,
        beta1: f64,
        beta2: f64,
        epsilon: f64,
        wd: f64,
        rescale_grad: f64,
        clip_gradient: Option<f64>,
        epsilon_after_correction: bool,
        keep_state: bool,
    ) -> PyResult<()> {
        let adam = Adam {
            lr,
            beta1,
            beta2,
            epsilon,
            wd,
            rescale_grad,
            clip_gradient,
            epsilon_after_correction,
        };
        let store = self.store(py)?;
        match keep_state {
            true => store.update_hyperparameters(Updater::Adam(adam)),
            false => store.set_updater(Updater::Adam(adam)),
        }
        .map_err(errors::to_py)
    }

    /// Compresses pushes (see `kvstore::Compression`): `kind` is "2bit" (MXNet's scheme, with
    /// `threshold`), "bf16" or "fp16" (a 16-bit wire with error feedback).
    fn set_gradient_compression(&self, py: Python<'_>, kind: &str, threshold: f32) -> PyResult<()> {
        let compression = match kind {
            "2bit" => kvstore::Compression::two_bit(threshold),
            "bf16" => kvstore::Compression::bf16(),
            "fp16" => kvstore::Compression::fp16(),
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown compression type {other:?}: '2bit', 'bf16' or 'fp16'"
                )))
            }
        };
        self.store(py)?
            .set_gradient_compression(compression)
            .map_err(errors::to_py)
    }

    /// Changes the learning rate of SGD or Adam, keeping their state.
    fn set_learning_rate(&self, py: Python<'_>, lr: f64) -> PyResult<()> {
        self.store(py)?.set_learning_rate(lr).map_err(errors::to_py)
    }

    /// The learning rate of the updater in force, if it has one.
    #[getter]
    fn learning_rate(&self) -> Option<f64> {
        self.inner.learning_rate()
    }

    /// The largest update count of any key.
    #[getter]
    fn num_update(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.store(py)?.num_update())
    }

    /// Writes every value and updater state to `path` (safetensors).
    fn save(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        let kv = self.store_for(py, "save")?;
        py.detach(move || kv.save(&path).map_err(errors::to_py))
    }

    /// Reads every value and updater state from `path`.
    fn load(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        let kv = self.store_for(py, "load")?;
        py.detach(move || kv.load(&path).map_err(errors::to_py))
    }
}

/// The native module.
#[pymodule]
#[pyo3(name = "_native")]
fn kvstore_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStore>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Whether this build has the MPI link (the `kvstore-mpi` companion wheel).
    m.add("HAS_MPI", cfg!(feature = "mpi"))?;
    // The newest DLPack ABI this module reads; passed as `max_version` to `__dlpack__`.
    m.add(
        "DLPACK_MAX_VERSION",
        (
            dlpark::ffi::DLPACK_MAJOR_VERSION,
            dlpark::ffi::DLPACK_MINOR_VERSION,
        ),
    )?;
    m.add_function(wrap_pyfunction!(cuda_stream, m)?)?;
    epoch(); // timelines count from the import
    Ok(())
}

/// The CUDA stream (as an integer) on which the store works on GPU `device_id`: the `stream`
/// handed to `__dlpack__` when a CUDA array is lent, and the stream its owner waits on after.
#[pyfunction]
fn cuda_stream(device_id: usize) -> PyResult<usize> {
    kvstore::cuda_stream(device_id).map_err(errors::to_py)
}

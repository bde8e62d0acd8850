//! [`KvStore`]: the key table, validation, per-key locks and the order updaters run in.
//!
//! Every operation validates all of its arguments before it changes anything, so an error
//! leaves the store exactly as it was. Each key has its own lock: operations on different keys
//! run in parallel, operations on one key are serialized. A list operation takes its keys' locks
//! in ascending key order, which makes it atomic and free of deadlocks.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{Arc, Once, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::backend::cpu::{self, PushJob};
use crate::backend::cuda::home::{self, GpuCell};
use crate::backend::cuda::{self as gpu_rt, GpuBuf};
use crate::backend::{nccl, probe};
use crate::checkpoint::Problem;
use crate::host::{convert_into, with_host, HostData};
use crate::ndarray::Storage;
use crate::updater::{Hyper, UpdateFn};
use crate::{
    DType, Device, Element, Error, IntoKey, Key, KeyKind, NDArray, PtxUpdater, Result, Shape,
    Updater,
};

/// The kinds of store, by where values live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// Values live in host memory; values from several devices are summed on the CPU.
    Local,
    /// Values live on a home GPU, spread across GPUs by size (the CPU when there is none).
    Device,
    /// As `Device`, with NCCL moving data between GPUs (the CPU when there is none; peer
    /// copies, as `Device`, with a warning once, when no usable NCCL is found).
    Nccl,
}

/// The names `KvStore::create` accepts (MXNet's, lower case), and the kind each means.
const KIND_NAMES: [(&str, StoreKind); 6] = [
    ("local", StoreKind::Local),
    ("local_update_cpu", StoreKind::Local),
    ("local_allreduce_cpu", StoreKind::Local),
    ("device", StoreKind::Device),
    ("local_allreduce_device", StoreKind::Device),
    ("nccl", StoreKind::Nccl),
];

impl StoreKind {
    /// The kind's canonical name: `local`, `device` or `nccl`.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Local => "local",
            StoreKind::Device => "device",
            StoreKind::Nccl => "nccl",
        }
    }

    /// Parses a kind name, case-insensitively; an error lists the valid names.
    pub fn parse(name: &str) -> Result<StoreKind> {
        let lower = name.to_ascii_lowercase();
        KIND_NAMES
            .iter()
            .find(|(n, _)| *n == lower)
            .map(|&(_, k)| k)
            .ok_or_else(|| Error::UnknownKind {
                kind: name.to_owned(),
                valid: KIND_NAMES.iter().map(|(n, _)| *n).collect(),
            })
    }
}

impl std::fmt::Display for StoreKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for StoreKind {
    type Err = Error;

    /// As [`StoreKind::parse`].
    fn from_str(name: &str) -> Result<StoreKind> {
        StoreKind::parse(name)
    }
}

/// What [`KvStore::create`] accepts: a kind name (`"local"`, `"nccl"`, an MXNet alias, in any
/// case) or a [`StoreKind`].
pub trait IntoStoreKind {
    /// The kind, and the name the store reports as its [`KvStore::type_name`]; an
    /// [`Error::UnknownKind`] for a name that is no kind.
    fn into_store_kind(self) -> Result<(StoreKind, String)>;
}

impl IntoStoreKind for StoreKind {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        Ok((self, self.name().to_owned()))
    }
}

impl IntoStoreKind for &str {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        Ok((StoreKind::parse(self)?, self.to_ascii_lowercase()))
    }
}

impl IntoStoreKind for String {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        self.as_str().into_store_kind()
    }
}

impl IntoStoreKind for &String {
    fn into_store_kind(self) -> Result<(StoreKind, String)> {
        self.as_str().into_store_kind()
    }
}

/// One or more arrays: what a push takes as values and a pull as outs, for one key.
///
/// Implemented for a single [`NDArray`], slices, vectors and arrays of them.
pub trait ValueList {
    /// The arrays.
    fn arrays(&self) -> &[NDArray];
}

impl ValueList for NDArray {
    fn arrays(&self) -> &[NDArray] {
        std::slice::from_ref(self)
    }
}

impl ValueList for [NDArray] {
    fn arrays(&self) -> &[NDArray] {
        self
    }
}

impl ValueList for Vec<NDArray> {
    fn arrays(&self) -> &[NDArray] {
        self
    }
}

impl<const N: usize> ValueList for [NDArray; N] {
    fn arrays(&self) -> &[NDArray] {
        self
    }
}

impl<T: ValueList + ?Sized> ValueList for &T {
    fn arrays(&self) -> &[NDArray] {
        (**self).arrays()
    }
}

/// A key's entry: fixed facts, and the value and state behind the key's lock.
struct Slot {
    key: Key,
    /// Ascending order of updates: the int key, or a string key's init order.
    order: i64,
    /// When the key was initialized: 0 for the store's first key, then 1, 2, ...
    init_seq: u64,
    shape: Shape,
    dtype: DType,
    home: Device,
    cell: RwLock<Cell>,
}

struct Cell {
    value: Value,
    /// Host updater state (host homes, and the host round trip of f64 keys on a GPU).
    state: Option<State>,
}

/// Where a key's value lives: host memory, or its home GPU (with the GPU updater state).
enum Value {
    Host(HostData),
    Gpu(GpuCell),
}

/// Updater state of one key.
struct State {
    /// Which `set_updater` call it belongs to; another updater starts afresh.
    generation: u64,
    /// Pushes applied so far (Adam's `t`).
    step: u64,
    /// One buffer per name in `Updater::state_names`, in the accumulator dtype.
    bufs: Vec<HostData>,
}

#[derive(Default)]
struct Table {
    key_kind: Option<KeyKind>,
    slots: HashMap<Key, Arc<Slot>>,
    next_str_order: i64,
    /// The `init_seq` of the next key initialized.
    next_init_seq: u64,
    /// Bytes of values homed on each GPU so far (for placement by size).
    gpu_bytes: Vec<usize>,
}

impl Table {
    fn check_kind(&self, op: &'static str, key: &Key) -> Result<()> {
        match self.key_kind {
            Some(store) if store != key.kind() => Err(Error::MixedKeyTypes {
                op,
                key: key.clone(),
                got: key.kind(),
                store,
            }),
            _ => Ok(()),
        }
    }

    fn get(&self, op: &'static str, key: &Key) -> Result<Arc<Slot>> {
        self.check_kind(op, key)?;
        self.slots
            .get(key)
            .cloned()
            .ok_or_else(|| Error::UnknownKey {
                op,
                key: key.clone(),
            })
    }
}

mod hyper;

/// The updater in force, and which `set_updater` call set it.
struct Active {
    updater: Updater,
    generation: u64,
    /// The learning-rate schedule, per-key multipliers and update count.
    hyper: hyper::Settings,
}

/// A key and the arrays an operation gives it, merged over repeats of the key.
struct Group<'a> {
    slot: Arc<Slot>,
    arrays: Vec<&'a NDArray>,
    /// Work for higher priorities is issued first (the highest, over repeats of the key).
    priority: i32,
}

/// A tensor key-value store with MXNet KVStore semantics.
///
/// `KvStore` is `Send + Sync` and every method takes `&self`: share it between threads with an
/// `Arc` or a scoped borrow.
///
/// On a machine with GPUs, `device` and `nccl` stores keep each key on a home GPU (see
/// [`KvStore::init`]). Pushes and pulls on GPU homes are enqueued on the GPUs' streams and
/// return at once; reading an array on the host waits for its GPU, and
/// [`KvStore::wait_all`] waits for everything (and reports NCCL failures). Custom closure
/// updaters and `float64` keys on a GPU take a slow path through host memory. A CUDA or NCCL
/// failure in the middle of a call can leave that call's GPU keys partly updated; validation
/// errors never do.
pub struct KvStore {
    name: String,
    kind: StoreKind,
    table: RwLock<Table>,
    active: RwLock<Arc<Active>>,
    hook: RwLock<Option<Arc<PushHook>>>,
}

/// What a push hook sees: one key of a push that has been applied. See
/// [`KvStore::set_push_hook`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PushEvent<'a> {
    /// The key.
    pub key: &'a Key,
    /// The key's step under the updater in force: the pushes applied to it since the updater
    /// was set (or since a checkpoint set its state), this one included. This is the `t` of
    /// Adam's bias correction and the `step` a PTX updater gets. `None` for a closure updater
    /// (and a PTX updater's CPU twin), which keeps no step.
    pub step: Option<u64>,
    /// The updater's [`name`](Updater::name): `assign`, `sgd`, `adam`, ...
    pub updater: &'static str,
    /// How many arrays were summed for the key (over repeats of it in the call).
    pub values: usize,
}

/// A push hook: called once per key of every successful push. See [`KvStore::set_push_hook`].
pub type PushHook = dyn Fn(&PushEvent<'_>) + Send + Sync;

impl KvStore {
    /// Creates a store of a kind given by name (`local`, `device` or `nccl`, or one of MXNet's
    /// aliases `local_update_cpu`, `local_allreduce_cpu`, `local_allreduce_device`; in any
    /// case) or as a [`StoreKind`].
    ///
    /// With no GPU, `device` and `nccl` keep their values on the CPU (logged once).
    ///
    /// ```
    /// use kvstore::{KvStore, StoreKind};
    /// let kv = KvStore::create("local_allreduce_cpu")?;
    /// assert_eq!(kv.kind(), StoreKind::Local);
    /// assert_eq!(kv.type_name(), "local_allreduce_cpu");
    /// let kv = KvStore::create(StoreKind::Device)?;
    /// assert_eq!(kv.type_name(), "device");
    /// let err = KvStore::create("dist_sync").err().unwrap();
    /// assert!(err.to_string().contains("local, local_update_cpu"));
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn create(kind: impl IntoStoreKind) -> Result<KvStore> {
        let (kind, name) = kind.into_store_kind()?;
        if kind != StoreKind::Local && probe::gpu_count() == 0 {
            static ONCE: Once = Once::new();
            ONCE.call_once(|| {
                log::warn!("kvstore: no GPU found; '{name}' stores keep their values on the CPU")
            });
        }
        Ok(KvStore {
            name,
            kind,
            table: RwLock::new(Table::default()),
            active: RwLock::new(Arc::new(Active {
                updater: Updater::Assign,
                generation: 0,
                hyper: hyper::Settings::default(),
            })),
            hook: RwLock::new(None),
        })
    }

    /// The kind of store.
    pub fn kind(&self) -> StoreKind {
        self.kind
    }

    /// The name the store was created with, lower-cased (MXNet's `kv.type`); the canonical
    /// name when it was created from a [`StoreKind`].
    pub fn type_name(&self) -> &str {
        &self.name
    }

    /// This worker's rank: always 0 for a single-process store.
    pub fn rank(&self) -> usize {
        0
    }

    /// The number of workers: always 1 for a single-process store.
    pub fn num_workers(&self) -> usize {
        1
    }

    /// Waits for every operation in flight: pushes and pulls on GPU homes are enqueued on the
    /// GPUs' streams and return at once. NCCL work is polled for asynchronous errors, with a
    /// timeout (env `KVSTORE_NCCL_TIMEOUT_MS`, default 60 s). Without a GPU every call is
    /// synchronous and this returns `Ok` at once.
    pub fn wait_all(&self) -> Result<()> {
        if probe::gpu_count() == 0 {
            return Ok(());
        }
        nccl::wait_all()?;
        gpu_rt::synchronize_all()
    }

    /// Whether cross-GPU sums and broadcasts of this store go through NCCL. A `nccl` store on
    /// a GPU machine without a usable NCCL warns once (what was found, how to fix it) and uses
    /// peer copies.
    fn use_nccl(&self) -> bool {
        if self.kind != StoreKind::Nccl || probe::gpu_count() == 0 {
            return false;
        }
        if probe::nccl_present() {
            return true;
        }
        nccl::warn_unavailable();
        false
    }

    /// Builds the NCCL communicators a call on `groups` will need before it takes any key
    /// lock: one per set of GPUs (the home and the GPUs of the arrays) of a key homed on a GPU.
    fn prepare_nccl(&self, groups: &[Group<'_>]) -> Result<()> {
        if !self.use_nccl() {
            return Ok(());
        }
        let mut sets: Vec<Vec<usize>> = Vec::new();
        for g in groups {
            let Device::Gpu(home) = g.slot.home else {
                continue;
            };
            if g.slot.dtype == DType::F64 {
                continue;
            }
            let mut set: Vec<usize> = g
                .arrays
                .iter()
                .filter_map(|a| match a.device() {
                    Device::Gpu(d) => Some(d),
                    Device::Cpu(_) => None,
                })
                .chain([home])
                .collect();
            set.sort_unstable();
            set.dedup();
            sets.push(set);
        }
        sets.sort();
        sets.dedup();
        nccl::prepare(&sets)
    }

    /// Replaces the updater. Per-key state (momentum and the like) and the update count start
    /// afresh on each key's next push, even for the same updater: to change hyperparameters and
    /// keep the state, use [`KvStore::update_hyperparameters`] or
    /// [`KvStore::set_learning_rate`]. A learning-rate schedule and per-key multipliers stay
    /// set; an error if the schedule does not fit the new updater's `lr`.
    ///
    /// ```
    /// use kvstore::{KvStore, Sgd, Updater};
    /// let kv = KvStore::create("local").unwrap();
    /// kv.set_updater(Updater::Sgd(Sgd { lr: 0.1, momentum: 0.9, ..Sgd::default() })).unwrap();
    /// assert!(kv.set_updater(Updater::Sgd(Sgd { lr: -1.0, ..Sgd::default() })).is_err());
    /// ```
    pub fn set_updater(&self, updater: Updater) -> Result<()> {
        updater.validate()?;
        let mut active = write(&self.active);
        active.hyper.check_fits(&updater)?;
        let generation = active.generation + 1;
        *active = Arc::new(Active {
            updater,
            generation,
            hyper: active.hyper.restarted(),
        });
        Ok(())
    }

    /// The updater in force.
    pub fn updater(&self) -> Updater {
        read(&self.active).updater.clone()
    }

    /// Sets a hook that observes pushes without changing them: after every successful push
    /// (`push`, `push_list`, the `pushpull` forms and the priority forms), `hook` is called
    /// once per distinct key, in the order the updater ran on them (ascending key order, or
    /// descending priority), with the key, its step and the updater's name. It runs after the
    /// call's locks are released, so it may call the store; a failed push calls it for no key.
    /// A panic in the hook reaches the caller of the push, which has been applied by then.
    /// Replaces any hook set before.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use kvstore::{Adam, Key, KvStore, NDArray, Updater};
    ///
    /// let kv = KvStore::create("local")?;
    /// kv.init_list(&[7, 2], &[NDArray::zeros([3]), NDArray::zeros([3])])?;
    /// kv.set_updater(Updater::Adam(Adam::default()))?;
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = seen.clone();
    /// kv.set_push_hook(move |e| log.lock().unwrap().push((e.key.clone(), e.step, e.updater)));
    /// let g = NDArray::ones([3]);
    /// kv.push_list(&[7, 2], &[&g, &g])?;
    /// kv.push(7, &g)?;
    /// assert_eq!(
    ///     *seen.lock().unwrap(),
    ///     [(Key::Int(2), Some(1), "adam"), (Key::Int(7), Some(1), "adam"), (Key::Int(7), Some(2), "adam")]
    /// );
    /// kv.clear_push_hook();
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn set_push_hook(&self, hook: impl Fn(&PushEvent<'_>) + Send + Sync + 'static) {
        *write(&self.hook) = Some(Arc::new(hook));
    }

    /// Removes the push hook, if one is set.
    pub fn clear_push_hook(&self) {
        *write(&self.hook) = None;
    }

    /// The keys in update order: int keys ascending, string keys in the order they were first
    /// initialized (the order the updater runs in, MXNet's). See [`KvStore::keys_in_init_order`]
    /// for the order of initialization.
    ///
    /// ```
    /// use kvstore::{Key, KvStore, NDArray};
    /// let kv = KvStore::create("local")?;
    /// kv.init_list(&[9, 3], &[NDArray::zeros([1]), NDArray::zeros([1])])?;
    /// kv.init(5, &NDArray::zeros([1]))?;
    /// assert_eq!(kv.keys(), [Key::Int(3), Key::Int(5), Key::Int(9)]);
    /// assert_eq!(kv.keys_in_init_order(), [Key::Int(9), Key::Int(3), Key::Int(5)]);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn keys(&self) -> Vec<Key> {
        let table = read(&self.table);
        let mut slots: Vec<&Arc<Slot>> = table.slots.values().collect();
        slots.sort_by_key(|s| s.order);
        slots.iter().map(|s| s.key.clone()).collect()
    }

    /// The keys in the order they were initialized (by `init`, `broadcast`, a list call's key
    /// order, or a checkpoint `load` that added them). For string keys this is also
    /// [`KvStore::keys`]' order.
    pub fn keys_in_init_order(&self) -> Vec<Key> {
        let table = read(&self.table);
        let mut slots: Vec<&Arc<Slot>> = table.slots.values().collect();
        slots.sort_by_key(|s| s.init_seq);
        slots.iter().map(|s| s.key.clone()).collect()
    }

    /// The shape, dtype and home device of a key.
    pub fn meta(&self, key: impl IntoKey) -> Result<(Shape, DType, Device)> {
        let slot = read(&self.table).get("meta", &key.into_key()?)?;
        Ok((slot.shape, slot.dtype, slot.home))
    }

    /// Puts a copy of `value` in under `key`. A key is initialized once.
    ///
    /// `device` and `nccl` stores on a machine with GPUs give the key a home GPU: the one with
    /// the fewest bytes homed so far. `local` stores, and every store without a GPU, keep it in
    /// host memory.
    pub fn init(&self, key: impl IntoKey, value: &NDArray) -> Result<()> {
        self.init_list(&[key.into_key()?], std::slice::from_ref(value))
    }

    /// Initializes many keys at once: all of them, or none on error. Homes are placed largest
    /// key first (see [`KvStore::init`]).
    pub fn init_list<K: IntoKey + Clone>(&self, keys: &[K], values: &[NDArray]) -> Result<()> {
        self.init_with_homes(keys, values, None)
    }

    /// As [`KvStore::init`], with the home chosen by the caller: `cpu(i)` keeps the value in
    /// host memory, `gpu(i)` on that GPU (an error if it does not exist).
    pub fn init_on(&self, key: impl IntoKey, value: &NDArray, home: Device) -> Result<()> {
        self.init_list_on(&[key.into_key()?], std::slice::from_ref(value), &[home])
    }

    /// As [`KvStore::init_list`], with one home per key chosen by the caller.
    pub fn init_list_on<K: IntoKey + Clone>(
        &self,
        keys: &[K],
        values: &[NDArray],
        homes: &[Device],
    ) -> Result<()> {
        check_len("init", keys.len(), homes.len(), "homes")?;
        for &h in homes {
            probe::check_device(h)?;
        }
        self.init_with_homes(keys, values, Some(homes))
    }

    fn init_with_homes<K: IntoKey + Clone>(
        &self,
        keys: &[K],
        values: &[NDArray],
        homes: Option<&[Device]>,
    ) -> Result<()> {
        check_len("init", keys.len(), values.len(), "values")?;
        let keys = to_keys(keys)?;
        let gpus = probe::gpu_count();
        let any_gpu_home = match homes {
            Some(h) => h.iter().any(|d| d.is_gpu()),
            None => self.kind != StoreKind::Local && gpus > 0,
        };
        // Host homes: copy outside the table lock, so big inits do not stall other keys'
        // lookups. GPU homes are copied under the lock, once the homes are placed.
        let host_copies: Option<Vec<HostData>> = if any_gpu_home {
            None
        } else {
            Some(
                values
                    .iter()
                    .map(|v| v.with_host(HostData::clone))
                    .collect::<Result<_>>()?,
            )
        };
        let mut table = write(&self.table);
        let call_kind = keys.first().map(Key::kind);
        for (i, key) in keys.iter().enumerate() {
            table.check_kind("init", key)?;
            if let Some(kind) = call_kind.filter(|&k| k != key.kind()) {
                return Err(Error::MixedKeyTypes {
                    op: "init",
                    key: key.clone(),
                    got: key.kind(),
                    store: kind,
                });
            }
            if table.slots.contains_key(key) || keys[..i].contains(key) {
                return Err(Error::DuplicateInit { key: key.clone() });
            }
        }
        let placed: Vec<Device> = match homes {
            Some(h) => h.to_vec(),
            None if any_gpu_home => place_by_size(&mut table.gpu_bytes.clone(), gpus, values),
            None => vec![Device::Cpu(0); keys.len()],
        };
        let data: Vec<Value> = match host_copies {
            Some(copies) => copies.into_iter().map(Value::Host).collect(),
            None => values
                .iter()
                .zip(&placed)
                .zip(&keys)
                .map(|((v, &home), key)| copy_home(v, home, key))
                .collect::<Result<_>>()?,
        };
        table.gpu_bytes.resize(gpus, 0);
        for (v, home) in values.iter().zip(&placed) {
            if let Device::Gpu(i) = *home {
                table.gpu_bytes[i] += v.nbytes();
            }
        }
        for (((key, value), data), home) in keys.into_iter().zip(values).zip(data).zip(placed) {
            let order = match &key {
                Key::Int(k) => i64::from(*k),
                Key::Str(_) => {
                    table.next_str_order += 1;
                    table.next_str_order
                }
            };
            table.key_kind = Some(key.kind());
            let init_seq = table.next_init_seq;
            table.next_init_seq += 1;
            let slot = Slot {
                key: key.clone(),
                order,
                init_seq,
                shape: value.shape(),
                dtype: value.dtype(),
                home,
                cell: RwLock::new(Cell {
                    value: data,
                    state: None,
                }),
            };
            table.slots.insert(key, Arc::new(slot));
        }
        Ok(())
    }

    /// Pushes one or more values to `key`: they are summed, and the updater merges the sum into
    /// the stored value. The values are read, never kept.
    ///
    /// ```
    /// use kvstore::{cpu, KvStore, NDArray};
    /// let kv = KvStore::create("local").unwrap();
    /// kv.init(3, &NDArray::zeros([2])).unwrap();
    /// let grads = vec![NDArray::ones([2]), NDArray::full([2], 2.0).to_device(cpu(1)).unwrap()];
    /// kv.push(3, &grads).unwrap();
    /// let out = NDArray::zeros([2]);
    /// kv.pull(3, &out).unwrap();
    /// assert_eq!(out.to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
    /// ```
    pub fn push<V: ValueList + ?Sized>(&self, key: impl IntoKey, values: &V) -> Result<()> {
        self.push_list(&[key.into_key()?], &[values.arrays()])
    }

    /// Pushes to many keys at once. A key listed more than once gets the sum of all its values.
    /// The updater runs once per distinct key, in ascending key order. All or nothing.
    pub fn push_list<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> Result<()> {
        self.push_groups(self.groups("push", keys, values, "values", None)?)
    }

    /// Copies the stored value of `key` into every out, converting to each out's dtype.
    pub fn pull<V: ValueList + ?Sized>(&self, key: impl IntoKey, outs: &V) -> Result<()> {
        self.pull_list(&[key.into_key()?], &[outs.arrays()])
    }

    /// Pulls many keys at once, from one consistent snapshot of them. All or nothing.
    pub fn pull_list<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        outs: &[V],
    ) -> Result<()> {
        self.pull_groups(self.groups("pull", keys, outs, "outs", None)?)
    }

    /// Validates and applies a push of looked-up groups.
    fn push_groups(&self, groups: Vec<Group<'_>>) -> Result<()> {
        check_values("push", &groups)?;
        let active = read(&self.active).clone();
        let hook = read(&self.hook).clone();
        self.prepare_nccl(&groups)?;
        let mut cells = lock_cells(&groups);
        apply_push(&active, self.use_nccl(), &groups, &mut cells)?;
        let done = hook.as_ref().map(|_| pushed(&active, &groups, &cells));
        drop(cells);
        call_hook(hook.as_deref(), &active, done)
    }

    /// Validates and applies a pull of looked-up groups, from one consistent snapshot.
    fn pull_groups(&self, groups: Vec<Group<'_>>) -> Result<()> {
        check_outs("pull", &groups)?;
        self.prepare_nccl(&groups)?;
        let cells: Vec<RwLockReadGuard<'_, Cell>> =
            groups.iter().map(|g| read(&g.slot.cell)).collect();
        pull_all(self.use_nccl(), &groups, &cells)
    }

    /// A push, then a pull of the result into `outs`, as one atomic step. To update in place,
    /// pass the values as the outs too, or use [`KvStore::pushpull_in_place`].
    pub fn pushpull<V: ValueList + ?Sized, O: ValueList + ?Sized>(
        &self,
        key: impl IntoKey,
        values: &V,
        outs: &O,
    ) -> Result<()> {
        self.pushpull_list(&[key.into_key()?], &[values.arrays()], &[outs.arrays()])
    }

    /// A push of `values`, then a pull of the result back into the same arrays.
    pub fn pushpull_in_place<V: ValueList + ?Sized>(
        &self,
        key: impl IntoKey,
        values: &V,
    ) -> Result<()> {
        self.pushpull(key, values, values)
    }

    /// Pushes every key, then pulls every key, as one atomic step. A value that is also an out
    /// is read by every push before any pull writes it.
    pub fn pushpull_list<K: IntoKey + Clone, V: ValueList, O: ValueList>(
        &self,
        keys: &[K],
        values: &[V],
        outs: &[O],
    ) -> Result<()> {
        let pushes = self.groups("pushpull", keys, values, "values", None)?;
        let pulls = self.groups("pushpull", keys, outs, "outs", None)?;
        check_values("pushpull", &pushes)?;
        check_outs("pushpull", &pulls)?;
        let active = read(&self.active).clone();
        let hook = read(&self.hook).clone();
        self.prepare_nccl(&pushes)?;
        self.prepare_nccl(&pulls)?;
        let mut cells = lock_cells(&pushes);
        apply_push(&active, self.use_nccl(), &pushes, &mut cells)?;
        let done = hook.as_ref().map(|_| pushed(&active, &pushes, &cells));
        // `pushes` and `pulls` hold the same distinct keys in the same order.
        pull_all(self.use_nccl(), &pulls, &cells)?;
        drop(cells);
        call_hook(hook.as_deref(), &active, done)
    }

    /// Pushes every key, then pulls every key's result back into its own values, as one atomic
    /// step: [`KvStore::pushpull_list`] with the values as the outs (MXNet's list `pushpull`
    /// without `out`). All or nothing.
    ///
    /// ```
    /// use kvstore::{KvStore, NDArray};
    /// let kv = KvStore::create("local")?;
    /// kv.init_list(&[0, 1], &[NDArray::zeros([2]), NDArray::zeros([3])])?;
    /// let grads = [NDArray::ones([2]), NDArray::full([3], 2.0)];
    /// kv.pushpull_list_in_place(&[0, 1], &grads)?;
    /// assert_eq!(grads[1].to_vec::<f32>()?, vec![2.0; 3]);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn pushpull_list_in_place<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> Result<()> {
        self.pushpull_list(keys, values, values)
    }

    /// Initializes `key` with `value` and pulls it into `outs` (MXNet's `broadcast`).
    pub fn broadcast<V: ValueList + ?Sized>(
        &self,
        key: impl IntoKey,
        value: &NDArray,
        outs: &V,
    ) -> Result<()> {
        self.broadcast_list(
            &[key.into_key()?],
            std::slice::from_ref(value),
            &[outs.arrays()],
        )
    }

    /// Initializes many keys and pulls them. All or nothing: the outs are checked before any
    /// key is initialized.
    pub fn broadcast_list<K: IntoKey + Clone, O: ValueList>(
        &self,
        keys: &[K],
        values: &[NDArray],
        outs: &[O],
    ) -> Result<()> {
        check_len("broadcast", keys.len(), values.len(), "values")?;
        check_len("broadcast", keys.len(), outs.len(), "outs")?;
        for ((key, value), outs) in keys.iter().zip(values).zip(outs) {
            let key: Key = key.clone().into_key()?;
            check_arrays(
                "broadcast",
                &key,
                value.shape(),
                None,
                &outs.arrays().iter().collect::<Vec<_>>(),
                "out",
            )?;
        }
        self.init_list(keys, values)?;
        self.pull_list(keys, outs)
    }

    /// Looks up every key and pairs it with its arrays and priority (0 when `priorities` is
    /// `None`), sorted by key order, repeats merged. Locks are taken in this order; work is
    /// issued in [`issue_order`].
    fn groups<'a, K: IntoKey + Clone, V: ValueList>(
        &self,
        op: &'static str,
        keys: &[K],
        lists: &'a [V],
        what: &'static str,
        priorities: Option<&[i32]>,
    ) -> Result<Vec<Group<'a>>> {
        check_len(op, keys.len(), lists.len(), what)?;
        if let Some(p) = priorities {
            check_len(op, keys.len(), p.len(), "priorities")?;
        }
        let table = read(&self.table);
        let mut groups = keys
            .iter()
            .zip(lists)
            .enumerate()
            .map(|(i, (k, list))| {
                let key: Key = k.clone().into_key()?;
                Ok(Group {
                    slot: table.get(op, &key)?,
                    arrays: list.arrays().iter().collect(),
                    priority: priorities.map_or(0, |p| p[i]),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        drop(table);
        groups.sort_by_key(|g| g.slot.order);
        groups.dedup_by(|later, kept| {
            let same = later.slot.order == kept.slot.order;
            if same {
                kept.arrays.append(&mut later.arrays);
                kept.priority = kept.priority.max(later.priority);
            }
            same
        });
        Ok(groups)
    }
}

/// Each group's key, step and value count, in issue order: what the push hook is told, read
/// while the cells are still locked.
fn pushed(
    active: &Active,
    groups: &[Group<'_>],
    cells: &[RwLockWriteGuard<'_, Cell>],
) -> Vec<(Key, Option<u64>, usize)> {
    issue_order(groups)
        .into_iter()
        .map(|i| {
            let cell = &cells[i];
            let host = cell
                .state
                .as_ref()
                .filter(|s| s.generation == active.generation)
                .map(|s| s.step);
            let step = match &cell.value {
                Value::Gpu(c) => c.step(active.generation).or(host),
                Value::Host(_) => host,
            };
            (groups[i].slot.key.clone(), step, groups[i].arrays.len())
        })
        .collect()
}

/// Calls the push hook once per key of a push that succeeded.
fn call_hook(
    hook: Option<&PushHook>,
    active: &Active,
    done: Option<Vec<(Key, Option<u64>, usize)>>,
) -> Result<()> {
    if let (Some(hook), Some(done)) = (hook, done) {
        for (key, step, values) in &done {
            hook(&PushEvent {
                key,
                step: *step,
                updater: active.updater.name(),
                values: *values,
            });
        }
    }
    Ok(())
}

/// Homes for keys of a `device`/`nccl` init: largest value first, each to the GPU with the
/// fewest bytes so far (MXNet's CommDevice placement). Ties go to the lowest ordinal.
fn place_by_size(bytes: &mut Vec<usize>, gpus: usize, values: &[NDArray]) -> Vec<Device> {
    bytes.resize(gpus, 0);
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(values[i].nbytes()));
    let mut homes = vec![Device::Cpu(0); values.len()];
    for i in order {
        let g = (0..gpus).min_by_key(|&g| (bytes[g], g)).unwrap_or(0);
        bytes[g] += values[i].nbytes();
        homes[i] = Device::Gpu(g);
    }
    homes
}

/// A copy of `value` for a key homed on `home`.
fn copy_home(value: &NDArray, home: Device, key: &Key) -> Result<Value> {
    let storage = value.read();
    let with_key = |e: Error| e.with_key(key);
    match (home, &*storage) {
        (Device::Cpu(_), s) => Ok(Value::Host(s.host().map_err(with_key)?.into_owned())),
        (Device::Gpu(i), Storage::Gpu(b)) => {
            Ok(Value::Gpu(GpuCell::new(b.copy_to(i).map_err(with_key)?)))
        }
        (Device::Gpu(i), Storage::Host(h)) => Ok(Value::Gpu(GpuCell::new(
            GpuBuf::upload(i, h).map_err(with_key)?,
        ))),
    }
}

fn to_keys<K: IntoKey + Clone>(keys: &[K]) -> Result<Vec<Key>> {
    keys.iter().cloned().map(IntoKey::into_key).collect()
}

fn check_len(op: &'static str, keys: usize, values: usize, what: &'static str) -> Result<()> {
    if keys != values {
        return Err(Error::LengthMismatch {
            op,
            keys,
            values,
            what,
        });
    }
    Ok(())
}

/// Pushed values must match the key's shape and dtype exactly.
fn check_values(op: &'static str, groups: &[Group<'_>]) -> Result<()> {
    for g in groups {
        check_arrays(
            op,
            &g.slot.key,
            g.slot.shape,
            Some(g.slot.dtype),
            &g.arrays,
            "value",
        )?;
    }
    Ok(())
}

/// Outs must match the key's shape; a pull converts to the out's dtype.
fn check_outs(op: &'static str, groups: &[Group<'_>]) -> Result<()> {
    for g in groups {
        check_arrays(op, &g.slot.key, g.slot.shape, None, &g.arrays, "out")?;
    }
    Ok(())
}

fn check_arrays(
    op: &'static str,
    key: &Key,
    shape: Shape,
    dtype: Option<DType>,
    arrays: &[&NDArray],
    what: &'static str,
) -> Result<()> {
    if arrays.is_empty() {
        let what = if what == "value" { "values" } else { "outs" };
        return Err(Error::Empty {
            op,
            key: key.clone(),
            what,
        });
    }
    for (i, a) in arrays.iter().enumerate() {
        if a.shape() != shape {
            return Err(Error::ShapeMismatch {
                op,
                key: key.clone(),
                what: format!("{what} {i}"),
                expected: Box::new(shape),
                got: Box::new(a.shape()),
            });
        }
        if let Some(dtype) = dtype.filter(|&d| d != a.dtype()) {
            return Err(Error::DTypeMismatch {
                op,
                key: key.clone(),
                what: format!("{what} {i}"),
                expected: dtype,
                got: a.dtype(),
            });
        }
    }
    Ok(())
}

/// The order work is issued in: descending priority, ties in ascending key order. `groups` is
/// sorted by key order, and a stable sort keeps that order among equal priorities.
fn issue_order(groups: &[Group<'_>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(groups[i].priority));
    order
}

/// Write locks on the groups' cells, taken in ascending key order.
fn lock_cells<'a>(groups: &'a [Group<'_>]) -> Vec<RwLockWriteGuard<'a, Cell>> {
    groups.iter().map(|g| write(&g.slot.cell)).collect()
}

/// Applies a validated push to every group. A custom updater runs on copies first, so a panic
/// in any key leaves every key unchanged.
///
/// Keys homed on a GPU are enqueued on the GPU backend ([`home::push`]), except for the slow
/// paths, which copy the value to the host and back: custom closures, and `float64` keys (no
/// PTX kernel).
fn apply_push(
    active: &Active,
    use_nccl: bool,
    groups: &[Group<'_>],
    cells: &mut [RwLockWriteGuard<'_, Cell>],
) -> Result<()> {
    let order = issue_order(groups);
    let hypers = hyper::for_push(active, groups, cells);
    match &active.updater {
        Updater::Custom(f) => {
            let updated = run_closure(f.as_ref(), &order, groups, cells)?;
            return store_results(&order, updated, cells);
        }
        Updater::Ptx(p) => return push_ptx(p, active, use_nccl, &order, groups, cells),
        _ => {}
    }
    // Taken out one by one in issue order: GPU jobs keep their cell borrowed until the launch.
    let mut cells: Vec<Option<&mut RwLockWriteGuard<'_, Cell>>> =
        cells.iter_mut().map(Some).collect();
    let mut gpu_jobs = Vec::new();
    for i in order {
        let g = &groups[i];
        let cell = cells[i].take().expect("each key is issued once");
        let Cell { value, state } = &mut **cell;
        match value {
            Value::Host(value) => {
                let reads = ReadSet::lock(&g.arrays)?;
                with_host!(value, stored: T => push_fused::<T>(active, hypers.of(i), &reads, &g.arrays, stored, state));
            }
            Value::Gpu(c) => {
                if home::has_kernel(c.buf.dtype()) {
                    gpu_jobs.push(home::PushJob {
                        key: &g.slot.key,
                        cell: c,
                        values: &g.arrays,
                        hyper: hypers.of(i),
                    });
                    continue;
                }
                // Slow path: no kernel for this dtype; update a host copy and copy it back.
                let reads = ReadSet::lock(&g.arrays)?;
                let mut value = c.buf.download()?;
                with_host!(&mut value, stored: T => push_fused::<T>(active, hypers.of(i), &reads, &g.arrays, stored, state));
                c.buf.upload_into(&value)?;
            }
        }
    }
    if !gpu_jobs.is_empty() {
        home::push(&active.updater, active.generation, use_nccl, gpu_jobs)?;
    }
    hypers.commit(active);
    Ok(())
}

/// Runs closure `f` for the groups `which`, in that order, on copies: nothing changes yet, so
/// a panic or a bad result in any key leaves every key as it was.
fn run_closure(
    f: &UpdateFn,
    which: &[usize],
    groups: &[Group<'_>],
    cells: &[RwLockWriteGuard<'_, Cell>],
) -> Result<Vec<HostData>> {
    which
        .iter()
        .map(|&i| {
            let value = match &cells[i].value {
                Value::Host(h) => std::borrow::Cow::Borrowed(h),
                Value::Gpu(c) => std::borrow::Cow::Owned(c.buf.download()?),
            };
            run_custom(f, &groups[i].slot, &value, &groups[i].arrays)
        })
        .collect()
}

/// Stores the results of [`run_closure`] for the groups `which`.
fn store_results(
    which: &[usize],
    results: Vec<HostData>,
    cells: &mut [RwLockWriteGuard<'_, Cell>],
) -> Result<()> {
    for (&i, value) in which.iter().zip(results) {
        match &mut cells[i].value {
            Value::Host(h) => *h = value,
            Value::Gpu(c) => c.buf.upload_into(&value)?,
        }
    }
    Ok(())
}

/// A push with a user PTX updater: its kernel on GPU-homed keys, its CPU twin on keys homed in
/// host memory. Every key is checked first (the dtype, a twin where one is needed), and the
/// twin runs on copies, so a bad key fails the call with nothing changed.
fn push_ptx(
    p: &PtxUpdater,
    active: &Active,
    use_nccl: bool,
    order: &[usize],
    groups: &[Group<'_>],
    cells: &mut [RwLockWriteGuard<'_, Cell>],
) -> Result<()> {
    let (on_gpu, on_host): (Vec<usize>, Vec<usize>) = order
        .iter()
        .partition(|&&i| matches!(cells[i].value, Value::Gpu(_)));
    for &i in &on_gpu {
        let slot = &groups[i].slot;
        if slot.dtype != p.dtype() {
            return Err(Error::InvalidUpdater(format!(
                "the PTX updater '{}' works on {} keys, and key {} is {}: use one PTX updater \
                 per dtype, or store the key as {}",
                p.entry(),
                p.dtype(),
                slot.key,
                slot.dtype,
                p.dtype()
            )));
        }
    }
    // Every GPU home loads the module before the twin runs: a twin may keep state of its own,
    // which a push that then fails on a broken module must not have advanced.
    for &i in &on_gpu {
        if let Device::Gpu(d) = groups[i].slot.home {
            gpu_rt::gpu(d)?.user_function(p)?;
        }
    }
    let twin_results = match (p.cpu_twin(), on_host.first()) {
        (_, None) => Vec::new(),
        (Some(twin), Some(_)) => run_closure(twin.as_ref(), &on_host, groups, cells)?,
        (None, Some(&i)) => {
            return Err(Error::InvalidUpdater(format!(
                "key {} is homed in host memory ({}) and the PTX updater '{}' has no CPU twin: \
                 give one with PtxUpdater::with_cpu_twin, or home the key on a GPU",
                groups[i].slot.key,
                groups[i].slot.home,
                p.entry()
            )))
        }
    };
    if !on_gpu.is_empty() {
        let mut taken: Vec<Option<&mut RwLockWriteGuard<'_, Cell>>> =
            cells.iter_mut().map(Some).collect();
        let mut jobs = Vec::with_capacity(on_gpu.len());
        for &i in &on_gpu {
            let cell = taken[i].take().expect("each key is issued once");
            let Value::Gpu(c) = &mut cell.value else {
                unreachable!("partitioned by home just above")
            };
            jobs.push(home::PushJob {
                key: &groups[i].slot.key,
                cell: c,
                values: &groups[i].arrays,
                hyper: Hyper::default(),
            });
        }
        home::push(&active.updater, active.generation, use_nccl, jobs)?;
    }
    store_results(&on_host, twin_results, cells)
}

/// Pulls every group from its cell: host homes here, GPU homes through [`home::pull`].
fn pull_all<C: std::ops::Deref<Target = Cell>>(
    use_nccl: bool,
    groups: &[Group<'_>],
    cells: &[C],
) -> Result<()> {
    let mut gpu_jobs = Vec::new();
    for i in issue_order(groups) {
        let g = &groups[i];
        match &cells[i].value {
            Value::Host(h) => pull_into(h, &g.arrays)?,
            Value::Gpu(c) => gpu_jobs.push(home::PullJob {
                key: &g.slot.key,
                cell: c,
                outs: &g.arrays,
            }),
        }
    }
    if gpu_jobs.is_empty() {
        return Ok(());
    }
    home::pull(use_nccl, &gpu_jobs)
}

/// The fused sum and update of one key.
fn push_fused<T: Element>(
    active: &Active,
    hyper: Hyper,
    reads: &ReadSet<'_>,
    arrays: &[&NDArray],
    stored: &mut [T],
    state: &mut Option<State>,
) {
    let names = active.updater.state_names();
    // State is used only when it is this updater's and has its shape: one accumulator buffer
    // of the value's length per state name. Anything else (a race, a bad checkpoint) would
    // hand the kernel a short buffer; it starts afresh instead.
    let acc = <T::Acc as Element>::DTYPE;
    let current = matches!(state, Some(s) if s.generation == active.generation
        && s.bufs.len() == names.len()
        && s.bufs.iter().all(|b| b.dtype() == acc && b.len() == stored.len()));
    let state = match state {
        Some(s) if current => s,
        _ => state.insert(State {
            generation: active.generation,
            step: 0,
            bufs: names
                .iter()
                .map(|_| HostData::filled(<T::Acc as Element>::DTYPE, stored.len(), 0.0))
                .collect(),
        }),
    };
    state.step += 1;
    let rule = active
        .updater
        .rule_with::<T::Acc>(state.step, hyper)
        .expect("custom updaters take the other path");
    let values: Vec<&[T]> = arrays
        .iter()
        .map(|a| T::slice(reads.host(a)).expect("value dtypes were checked"))
        .collect();
    let mut bufs = state.bufs.iter_mut().map(|b| {
        <T::Acc as Element>::slice_mut(b).expect("state is kept in the accumulator dtype")
    });
    let s0 = bufs.next().unwrap_or_default();
    let s1 = bufs.next().unwrap_or_default();
    let job = PushJob {
        values,
        stored,
        state: [s0, s1],
    };
    cpu::push(job, &rule);
}

/// Runs a custom updater on a copy of the stored value; returns the new value.
fn run_custom(
    f: &UpdateFn,
    slot: &Slot,
    value: &HostData,
    arrays: &[&NDArray],
) -> Result<HostData> {
    let merged = {
        let reads = ReadSet::lock(arrays)?;
        with_host!(value, v: T => {
            let values: Vec<&[T]> = arrays
                .iter()
                .map(|a| T::slice(reads.host(a)).expect("value dtypes were checked"))
                .collect();
            let mut sum = v.clone();
            cpu::sum_into(&values, &mut sum);
            T::wrap(sum)
        })
    };
    // The closure sees host arrays: for a GPU home they are host copies on cpu(0).
    let device = if slot.home.is_gpu() {
        Device::Cpu(0)
    } else {
        slot.home
    };
    let merged = NDArray::from_host(merged, slot.shape, device);
    let mut stored = NDArray::from_host(value.clone(), slot.shape, device);
    catch_unwind(AssertUnwindSafe(|| f(&slot.key, &merged, &mut stored)))
        .map_err(|panic| Error::UpdaterPanicked {
            key: slot.key.clone(),
            message: panic_message(panic.as_ref()),
        })?
        .map_err(|source| Error::UpdaterFailed {
            key: slot.key.clone(),
            source,
        })?;
    let what = "the updater's result".to_owned();
    if stored.shape() != slot.shape {
        return Err(Error::ShapeMismatch {
            op: "push",
            key: slot.key.clone(),
            what,
            expected: Box::new(slot.shape),
            got: Box::new(stored.shape()),
        });
    }
    if stored.dtype() != slot.dtype {
        return Err(Error::DTypeMismatch {
            op: "push",
            key: slot.key.clone(),
            what,
            expected: slot.dtype,
            got: stored.dtype(),
        });
    }
    stored.into_host()
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}

/// Copies `src` into every out. Outs that share elements are written once. Outs on a GPU get
/// a host-to-GPU copy.
fn pull_into(src: &HostData, outs: &[&NDArray]) -> Result<()> {
    let mut outs = outs.to_vec();
    outs.sort_by_key(|a| a.storage_id());
    outs.dedup_by_key(|a| a.storage_id());
    let mut guards: Vec<RwLockWriteGuard<'_, Storage>> = outs.iter().map(|a| a.write()).collect();
    with_host!(src, s: T => {
        let mut same: Vec<&mut [T]> = Vec::with_capacity(guards.len());
        for g in guards.iter_mut() {
            match &mut **g {
                Storage::Host(h) => {
                    if h.dtype() == T::DTYPE {
                        same.push(T::slice_mut(h).expect("dtype was just checked"));
                    } else {
                        convert_into(s.as_slice(), h);
                    }
                }
                Storage::Gpu(b) => b.upload_into(src)?,
            }
        }
        cpu::broadcast(s.as_slice(), same);
    });
    Ok(())
}

/// Read locks on a set of arrays, each taken once, in address order. Arrays on a GPU are
/// copied to the host instead (the host path of a push).
struct ReadSet<'a> {
    guards: Vec<(usize, Held<'a>)>,
}

enum Held<'a> {
    Lock(RwLockReadGuard<'a, Storage>),
    Copy(HostData),
}

impl<'a> ReadSet<'a> {
    fn lock(arrays: &[&'a NDArray]) -> Result<ReadSet<'a>> {
        let mut uniq = arrays.to_vec();
        uniq.sort_by_key(|a| a.storage_id());
        uniq.dedup_by_key(|a| a.storage_id());
        let guards = uniq
            .iter()
            .map(|a| {
                let g = a.read();
                let held = match &*g {
                    Storage::Host(_) => Held::Lock(g),
                    Storage::Gpu(b) => Held::Copy(b.download()?),
                };
                Ok((a.storage_id(), held))
            })
            .collect::<Result<_>>()?;
        Ok(ReadSet { guards })
    }

    fn host(&self, a: &NDArray) -> &HostData {
        let i = self
            .guards
            .binary_search_by_key(&a.storage_id(), |(id, _)| *id)
            .expect("every array was locked");
        match &self.guards[i].1 {
            Held::Copy(h) => h,
            Held::Lock(g) => match &**g {
                Storage::Host(h) => h,
                Storage::Gpu(_) => unreachable!("GPU arrays are held as copies"),
            },
        }
    }
}

fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

/// Priorities: the order work is issued in within one call.
impl KvStore {
    /// A push, like [`KvStore::push`], with a priority; see [`KvStore::push_list_with_priority`].
    pub fn push_with_priority<V: ValueList + ?Sized>(
        &self,
        key: impl IntoKey,
        values: &V,
        priority: i32,
    ) -> Result<()> {
        self.push_list_with_priority(&[key.into_key()?], &[values.arrays()], &[priority])
    }

    /// Pushes to many keys at once, like [`KvStore::push_list`], issuing the work for keys of
    /// higher priority first: the updater runs on keys in descending priority, and keys of equal
    /// priority in ascending key order (MXNet's order, and that of `push_list`). On a GPU home
    /// this is the order kernels and NCCL calls are enqueued in, so the gradients a training
    /// loop needs first (its first layers) can be given the highest priority. A key listed more
    /// than once gets the highest of its priorities.
    ///
    /// `priorities` has one entry per key. Locks are still taken in ascending key order, so
    /// calls with any priorities cannot deadlock one another. All or nothing, as `push_list`.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use kvstore::{Key, KvStore, NDArray, Updater};
    ///
    /// let kv = KvStore::create("local")?;
    /// kv.init_list(&[0, 1, 2], &[NDArray::zeros([2]), NDArray::zeros([2]), NDArray::zeros([2])])?;
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = seen.clone();
    /// kv.set_updater(Updater::custom(move |key, input, stored| {
    ///     log.lock().unwrap().push(key.clone());
    ///     *stored += input;
    /// }))?;
    /// let g = NDArray::ones([2]);
    /// kv.push_list_with_priority(&[0, 1, 2], &[&g, &g, &g], &[-1, 5, 0])?;
    /// assert_eq!(*seen.lock().unwrap(), vec![Key::Int(1), Key::Int(2), Key::Int(0)]);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn push_list_with_priority<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        values: &[V],
        priorities: &[i32],
    ) -> Result<()> {
        self.push_groups(self.groups("push", keys, values, "values", Some(priorities))?)
    }

    /// A pull, like [`KvStore::pull`], with a priority; see [`KvStore::pull_list_with_priority`].
    pub fn pull_with_priority<V: ValueList + ?Sized>(
        &self,
        key: impl IntoKey,
        outs: &V,
        priority: i32,
    ) -> Result<()> {
        self.pull_list_with_priority(&[key.into_key()?], &[outs.arrays()], &[priority])
    }

    /// Pulls many keys at once, like [`KvStore::pull_list`], copying keys of higher priority
    /// first; equal priorities go in ascending key order. `priorities` has one entry per key.
    /// Locks are taken in ascending key order whatever the priorities.
    ///
    /// ```
    /// use kvstore::{KvStore, NDArray};
    /// let kv = KvStore::create("local")?;
    /// kv.init_list(&[0, 1], &[NDArray::ones([2]), NDArray::full([3], 2.0)])?;
    /// let (a, b) = (NDArray::zeros([2]), NDArray::zeros([3]));
    /// kv.pull_list_with_priority(&[0, 1], &[&a, &b], &[0, 10])?;
    /// assert_eq!(b.to_vec::<f32>()?, vec![2.0; 3]);
    /// assert!(kv.pull_list_with_priority(&[0, 1], &[&a, &b], &[0]).is_err());
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn pull_list_with_priority<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        outs: &[V],
        priorities: &[i32],
    ) -> Result<()> {
        self.pull_groups(self.groups("pull", keys, outs, "outs", Some(priorities))?)
    }
}

/// A key's value and updater state as host copies: what a checkpoint holds.
pub(crate) struct Entry {
    pub key: Key,
    pub shape: Shape,
    pub value: HostData,
    /// The state kept for the updater in force, if the key has any.
    pub state: Option<EntryState>,
}

/// A key's updater state: the step count and one buffer per name in `Updater::state_names`.
pub(crate) struct EntryState {
    pub step: u64,
    pub bufs: Vec<HostData>,
}

/// Checkpoint support: host copies of every value and updater state, out and in.
impl KvStore {
    /// The updater in force and its generation, read together.
    pub(crate) fn active_updater(&self) -> (Updater, u64) {
        let active = read(&self.active).clone();
        (active.updater.clone(), active.generation)
    }

    /// The key kind, the updater in force, and every key in update order with copies of its
    /// value and its state for that updater, taken as one consistent snapshot (all read locks
    /// held together).
    pub(crate) fn export_entries(&self) -> Result<(Option<KeyKind>, Updater, Vec<Entry>)> {
        let (kind, mut slots) = {
            let table = read(&self.table);
            let slots: Vec<Arc<Slot>> = table.slots.values().cloned().collect();
            (table.key_kind, slots)
        };
        slots.sort_by_key(|s| s.order);
        let active = read(&self.active).clone();
        let generation = active.generation;
        let buffers = active.updater.state_names().len();
        let cells: Vec<RwLockReadGuard<'_, Cell>> = slots.iter().map(|s| read(&s.cell)).collect();
        let entries = slots
            .iter()
            .zip(&cells)
            .map(|(slot, cell)| {
                let host_state = || {
                    cell.state
                        .as_ref()
                        .filter(|s| s.generation == generation)
                        .map(|s| (s.step, s.bufs.clone()))
                };
                let (value, state) = match &cell.value {
                    Value::Host(h) => (h.clone(), host_state()),
                    Value::Gpu(c) if home::has_kernel(c.buf.dtype()) => {
                        (c.buf.download()?, c.state_to_host(generation)?)
                    }
                    // Kernel-less dtypes keep their state on the host.
                    Value::Gpu(c) => (c.buf.download()?, host_state()),
                };
                // Only state a push of this updater would use: one buffer per state name.
                let state = state.filter(|(_, bufs)| bufs.len() == buffers);
                Ok(Entry {
                    key: slot.key.clone(),
                    shape: slot.shape,
                    value,
                    state: state.map(|(step, bufs)| EntryState { step, bufs }),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((kind, active.updater.clone(), entries))
    }

    /// Puts checked `entries` (distinct keys, in update order, their state already matched to
    /// the updater of `generation`) into the store, all or nothing, as one step.
    ///
    /// Lock order, as every other operation: the cells of the keys the store has are
    /// write-locked in ascending key order (found with a brief read of the table), and only
    /// then is the table write-locked. Under both, the new keys are copied to their homes (as
    /// init does, still invisible), the existing keys get their values and state, and the new
    /// keys are added, complete, in one step; a failure before that last step adds nothing.
    /// Nothing ever holds the table lock while it waits for a cell, so this cannot deadlock
    /// against push, pull, init, save or another load. A key that a concurrent init added
    /// between the lookup and the table lock is not locked yet, so the whole step starts over
    /// with nothing changed (each retry finds at least one more key, so this ends).
    pub(crate) fn import_entries(
        &self,
        path: &Path,
        kind: Option<KeyKind>,
        mut entries: Vec<Entry>,
        generation: u64,
    ) -> Result<()> {
        let mismatch = |message: String| Problem::mismatch(message).at(path);
        let check_kind = |store: Option<KeyKind>| match (store, kind) {
            (Some(store), Some(file)) if store != file => Err(mismatch(format!(
                "the file holds {file} keys but the store holds {store} keys: load it into a \
                 store of {file} keys"
            ))),
            _ => Ok(()),
        };
        loop {
            let found: Vec<Option<Arc<Slot>>> = {
                let table = read(&self.table);
                check_kind(table.key_kind)?;
                entries
                    .iter()
                    .map(|e| table.slots.get(&e.key).cloned())
                    .collect()
            };
            for (e, slot) in entries.iter().zip(&found) {
                let Some(slot) = slot else { continue };
                if slot.shape != e.shape || slot.dtype != e.value.dtype() {
                    return Err(mismatch(format!(
                        "key {}: the file holds {} {} but the store holds {} {}: load it into \
                         a store without this key, or with the file's shape and dtype",
                        e.key,
                        e.shape,
                        e.value.dtype(),
                        slot.shape,
                        slot.dtype
                    )));
                }
            }
            // The cells of the keys the store has, in ascending key order; `cell_of[i]` is
            // entry i's place among them.
            let mut have: Vec<(usize, &Arc<Slot>)> = found
                .iter()
                .enumerate()
                .filter_map(|(i, s)| Some((i, s.as_ref()?)))
                .collect();
            have.sort_by_key(|(_, s)| s.order);
            let mut cell_of = vec![None; entries.len()];
            for (place, &(i, _)) in have.iter().enumerate() {
                cell_of[i] = Some(place);
            }
            let mut cells: Vec<RwLockWriteGuard<'_, Cell>> =
                have.iter().map(|(_, s)| write(&s.cell)).collect();

            let mut table = write(&self.table);
            let raced = entries
                .iter()
                .zip(&found)
                .any(|(e, s)| s.is_none() && table.slots.contains_key(&e.key));
            if raced {
                continue;
            }
            check_kind(table.key_kind)?;

            // New keys: placed and copied to their homes, as init does, but not visible yet.
            let entries = std::mem::take(&mut entries);
            let gpus = probe::gpu_count();
            let on_gpus = self.kind != StoreKind::Local && gpus > 0;
            let mut new: Vec<Entry> = Vec::new();
            let mut old: Vec<(usize, Entry)> = Vec::new();
            for (i, e) in entries.into_iter().enumerate() {
                match cell_of[i] {
                    Some(place) => old.push((place, e)),
                    None => new.push(e),
                }
            }
            let mut gpu_bytes = table.gpu_bytes.clone();
            let mut made: Vec<Slot> = Vec::with_capacity(new.len());
            if on_gpus {
                let arrays: Vec<(NDArray, Option<EntryState>, Key)> = new
                    .into_iter()
                    .map(|e| {
                        let a = NDArray::from_host(e.value, e.shape, Device::Cpu(0));
                        (a, e.state, e.key)
                    })
                    .collect();
                let values: Vec<NDArray> = arrays.iter().map(|(a, _, _)| a.clone()).collect();
                let homes = place_by_size(&mut gpu_bytes, gpus, &values);
                for ((a, state, key), home) in arrays.into_iter().zip(homes) {
                    let value = copy_home(&a, home, &key)?;
                    let cell = loaded_cell(value, state, generation)?;
                    made.push(new_slot(key, a.shape(), a.dtype(), home, cell));
                }
            } else {
                for e in new {
                    let dtype = e.value.dtype();
                    let cell = loaded_cell(Value::Host(e.value), e.state, generation)?;
                    made.push(new_slot(e.key, e.shape, dtype, Device::Cpu(0), cell));
                }
            }

            // Keys the store has: changed under their locks, before any new key appears.
            for (place, e) in old {
                load_into(&mut cells[place], e.value, e.state, generation)?;
            }

            // New keys appear, complete, in one step.
            table.gpu_bytes = gpu_bytes;
            for mut slot in made {
                if let Key::Str(_) = slot.key {
                    table.next_str_order += 1;
                    slot.order = table.next_str_order;
                }
                slot.init_seq = table.next_init_seq;
                table.next_init_seq += 1;
                table.key_kind = Some(slot.key.kind());
                table.slots.insert(slot.key.clone(), Arc::new(slot));
            }
            return Ok(());
        }
    }
}

/// The slot of a key a load adds; its update order (string keys) and init order are set when
/// it is added.
fn new_slot(key: Key, shape: Shape, dtype: DType, home: Device, cell: Cell) -> Slot {
    let order = match &key {
        Key::Int(k) => i64::from(*k),
        Key::Str(_) => 0,
    };
    Slot {
        key,
        order,
        init_seq: 0,
        shape,
        dtype,
        home,
        cell: RwLock::new(cell),
    }
}

/// Host state of updater `generation` from a checkpoint's.
fn host_state(state: Option<EntryState>, generation: u64) -> Option<State> {
    state.map(|s| State {
        generation,
        step: s.step,
        bufs: s.bufs,
    })
}

/// The cell of a key a load adds: `value` (on its home) and the loaded state.
fn loaded_cell(value: Value, state: Option<EntryState>, generation: u64) -> Result<Cell> {
    let mut cell = Cell { value, state: None };
    match &mut cell.value {
        Value::Gpu(c) if home::has_kernel(c.buf.dtype()) => {
            c.set_state_from_host(generation, state.map(|s| (s.step, s.bufs)))?
        }
        _ => cell.state = host_state(state, generation),
    }
    Ok(cell)
}

/// Replaces the value and state of a key the store has with a checkpoint's.
fn load_into(
    cell: &mut Cell,
    value: HostData,
    state: Option<EntryState>,
    generation: u64,
) -> Result<()> {
    match &mut cell.value {
        Value::Host(h) => {
            *h = value;
            cell.state = host_state(state, generation);
        }
        Value::Gpu(c) => {
            c.buf.upload_into(&value)?;
            if home::has_kernel(c.buf.dtype()) {
                c.set_state_from_host(generation, state.map(|s| (s.step, s.bufs)))?;
            } else {
                cell.state = host_state(state, generation);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_and_arrays_stay_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<KvStore>();
        send_sync::<NDArray>();
    }

    #[test]
    fn homes_are_placed_largest_first_on_the_least_loaded_gpu() {
        // Sizes in f32 elements; the reference below is worked out by hand.
        let sizes = [100usize, 4000, 250, 3000, 2000, 1000];
        let values: Vec<NDArray> = sizes.iter().map(|&s| NDArray::zeros([s])).collect();
        let mut bytes = Vec::new();
        let homes = place_by_size(&mut bytes, 2, &values);
        // 4000 -> g0 (16000), 3000 -> g1 (12000), 2000 -> g1 (20000), 1000 -> g0 (20000),
        // 250 -> g0 (tie, lowest ordinal: 21000), 100 -> g1 (20400).
        let want = [1usize, 0, 0, 1, 1, 0];
        assert_eq!(
            homes,
            want.iter().map(|&g| Device::Gpu(g)).collect::<Vec<_>>()
        );
        assert_eq!(bytes, vec![21000, 20400]);
        // A later call continues from the loads so far.
        let more = place_by_size(&mut bytes, 2, &[NDArray::zeros([10])]);
        assert_eq!(more, vec![Device::Gpu(1)]);
    }

    /// State stamped with the updater's generation but of the wrong shape (too few buffers, or
    /// buffers of the wrong length, as a load racing `set_updater` once left) never reaches a
    /// kernel: the key starts afresh, as a key with no state does.
    #[test]
    fn state_of_the_wrong_shape_starts_afresh() {
        use rand::prelude::*;
        let mut rng = StdRng::from_entropy();
        let mut random = |n: usize| {
            let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
            NDArray::from_vec(v, [n]).unwrap()
        };
        let wrong = [
            vec![HostData::filled(DType::F32, 5, 0.5)],
            vec![
                HostData::filled(DType::F32, 5, 0.5),
                HostData::filled(DType::F32, 2, 0.5),
            ],
            vec![
                HostData::filled(DType::F64, 5, 0.5),
                HostData::filled(DType::F64, 5, 0.5),
            ],
        ];
        for bufs in wrong {
            let (value, grad) = (random(5), random(5));
            let (kv, reference) = (
                KvStore::create("local").unwrap(),
                KvStore::create("local").unwrap(),
            );
            for s in [&kv, &reference] {
                s.init(0, &value).unwrap();
                s.set_updater(Updater::Adam(crate::Adam::default()))
                    .unwrap();
            }
            let slot = read(&kv.table).get("test", &Key::Int(0)).unwrap();
            write(&slot.cell).state = Some(State {
                generation: read(&kv.active).generation,
                step: 7,
                bufs,
            });
            for s in [&kv, &reference] {
                s.push(0, &grad).unwrap();
            }
            let (a, b) = (NDArray::zeros([5]), NDArray::zeros([5]));
            kv.pull(0, &a).unwrap();
            reference.pull(0, &b).unwrap();
            let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            assert_ne!(
                a,
                value.to_vec::<f32>().unwrap(),
                "the push changed nothing"
            );
            assert_eq!(a, b);
        }
    }

    #[test]
    fn cpu_only_machines_keep_host_homes() {
        if probe::gpu_count() > 0 {
            return;
        }
        for kind in ["local", "device", "nccl"] {
            let kv = KvStore::create(kind).unwrap();
            kv.init(1, &NDArray::ones([3])).unwrap();
            assert_eq!(kv.meta(1).unwrap().2, Device::Cpu(0));
            assert!(kv.wait_all().is_ok());
            let err = kv
                .init_on(2, &NDArray::ones([3]), Device::Gpu(0))
                .unwrap_err();
            assert!(matches!(err, Error::DeviceNotFound { .. }), "{err}");
            kv.init_on(2, &NDArray::ones([3]), Device::Cpu(1)).unwrap();
            assert_eq!(kv.meta(2).unwrap().2, Device::Cpu(1));
        }
    }
}

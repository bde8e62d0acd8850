//! Store: [`KvStore`] and its rules. Kind names ([`kind`]), the key table and placement
//! ([`table`]), validation ([`validate`]), lookup, lock order and issue order ([`groups`]), the
//! updater and its hyperparameters ([`hyper`]), the push hook ([`hook`]) and checkpoints
//! ([`save_load`]).
//!
//! Every operation validates all its arguments before it changes anything, so an error leaves
//! the store as it was. Each key has its own lock; a list operation takes its keys' locks in
//! ascending key order, which makes it atomic and free of deadlocks.
//!
//! Every kind runs the same push: validate, this process's contribution, the sum across ranks
//! onto each key's home, the updater there, the hook. A pull runs the same path backwards. How
//! values cross ranks is one trait, [`across::Across`], chosen once in `create`; the store never
//! branches on which one it has, nor on the link. The store imports `comm`, the backend's
//! boundary type [`HomeValue`] and the GPU probe; it knows no CUDA and no NCCL.

mod across;
mod compress;
mod copies;
mod elastic;
#[cfg(test)]
mod elastic_tests;
mod groups;
mod heal;
#[cfg(test)]
mod heal_tests;
mod hook;
mod kind;
#[cfg(test)]
mod loopback_in_place_tests;
#[cfg(test)]
mod loopback_rows_tests;
#[cfg(test)]
pub(crate) mod loopback_tests;
mod rows;
mod save_load;
mod table;
mod validate;

use std::collections::HashSet;
use std::sync::{Arc, Once, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::backend::cpu::rows::Merged;
use crate::backend::cpu::Few;
use crate::backend::{probe, HomeValue, KeyFacts};
use crate::comm::dist::{Dist, KeyPart, Pool};
use crate::comm::{self, Ctx, KeyUpdate};
use crate::compress::Compression;
use crate::config::{Config, ReplicaUpdate};
use crate::{DType, Device, Error, IntoKey, Key, NDArray, Result, Shape, Updater};
use across::{Across, Arrived, Inputs, Sent};

pub use groups::ValueList;
use groups::{check_outs, check_values, issue_order, lock_cells, Group};
use hook::{call_hook, pushed};
pub use hook::{PushEvent, PushHook};
pub use kind::{IntoStoreKind, StoreKind};
use table::{NewKey, Slot, Table};
use validate::{check_arrays, check_len, to_keys};
mod hyper;

/// The updater in force, and which `set_updater` call set it.
pub(super) struct Active {
    updater: Updater,
    generation: u64,
    /// The learning-rate schedule, per-key multipliers and update count.
    hyper: hyper::Settings,
    /// [`Active::describe`]: an `Active` never changes (a change makes a new one).
    described: std::sync::OnceLock<String>,
}

impl Active {
    fn new(updater: Updater, generation: u64, hyper: hyper::Settings) -> Active {
        Active {
            updater,
            generation,
            hyper,
            described: std::sync::OnceLock::new(),
        }
    }

    /// Everything about the updater that decides what a push computes, which the ranks compare
    /// before every push. Made once per `Active` (the multipliers may name every key).
    fn describe(&self) -> &str {
        self.described.get_or_init(|| {
            format!(
                "updater {:?}, set by call #{}, {}",
                self.updater,
                self.generation,
                self.hyper.describe()
            )
        })
    }
}

/// A tensor key-value store with MXNet KVStore semantics.
///
/// `KvStore` is `Send + Sync` and every method takes `&self`.
///
/// On a machine with GPUs, `device` and `nccl` stores keep each key on a home GPU (see
/// [`KvStore::init`]). Pushes and pulls on GPU homes return once enqueued; reading an array on
/// the host waits for its GPU, and [`KvStore::wait_all`] waits for everything. Closure updaters
/// and `float64` keys on a GPU take a slow path through host memory. A CUDA or NCCL failure in
/// the middle of a call can leave that call's GPU keys partly updated; validation errors never
/// do.
pub struct KvStore {
    name: String,
    kind: StoreKind,
    table: RwLock<Table>,
    active: RwLock<Arc<Active>>,
    hook: RwLock<Option<Arc<PushHook>>>,
    /// Gradient compression of pushed values (changed only while the store holds no key).
    compression: RwLock<Compression>,
    /// Bytes of traffic from which a call on host memory splits over threads
    /// (`KVSTORE_PAR_MIN_BYTES` at creation).
    par_min_bytes: usize,
    /// The link to the other ranks: one rank alone for the single-process kinds.
    ranks: Dist,
    /// How values cross `ranks`, chosen once when the store is created.
    across: Box<dyn Across>,
    /// The checkpoint of this store's last save or load: the survivors of a lost rank reload
    /// it ([`KvStore::survive`]).
    last_checkpoint: std::sync::Mutex<Option<std::path::PathBuf>>,
    /// The save in progress: its directory and the generation rank 0 claimed for it. A loss
    /// during it may leave it committed on disk all the same ([`KvStore::survive`]).
    saving: std::sync::Mutex<Option<(std::path::PathBuf, u64)>>,
}

impl KvStore {
    /// Creates a store of a kind given by name (`local`, `device` or `nccl`, or one of MXNet's
    /// aliases `local_update_cpu`, `local_allreduce_cpu`, `local_allreduce_device`; in any
    /// case) or as a [`StoreKind`].
    ///
    /// With no GPU, `device` and `nccl` keep their values on the CPU (logged once).
    ///
    /// `KVSTORE_PAR_MIN_BYTES` (bytes read plus written, default 1 MiB) sets how big a push or
    /// pull on host memory must be to split over threads; `0` always splits. A value that is
    /// not a whole number is an [`Error::InvalidEnv`].
    ///
    /// ```
    /// use kvstore::{KvStore, StoreKind};
    /// let kv = KvStore::create("local_allreduce_cpu")?;
    /// assert_eq!(kv.kind(), StoreKind::Local);
    /// assert_eq!(kv.type_name(), "local_allreduce_cpu");
    /// let kv = KvStore::create(StoreKind::Device)?;
    /// assert_eq!(kv.type_name(), "device");
    /// let err = KvStore::create("dist_synk").err().unwrap();
    /// assert!(err.to_string().contains("local, local_update_cpu"));
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn create(kind: impl IntoStoreKind) -> Result<KvStore> {
        let (kind, name) = kind.into_store_kind()?;
        if matches!(kind, StoreKind::Device | StoreKind::Nccl) && probe::gpu_count() == 0 {
            static ONCE: Once = Once::new();
            ONCE.call_once(|| {
                log::warn!("kvstore: no GPU found; '{name}' stores keep their values on the CPU")
            });
        }
        let config = Config::from_env()?;
        let ranks = across::connect(kind, &name, &config)?;
        KvStore::with_ranks(kind, name, ranks, &config)
    }

    /// A store of `kind`, named `name`, over `ranks`, which its values cross as `across` says.
    fn with_ranks(
        kind: StoreKind,
        name: String,
        (ranks, across): (Dist, Box<dyn Across>),
        config: &Config,
    ) -> Result<KvStore> {
        Ok(KvStore {
            name,
            kind,
            table: RwLock::new(Table::default()),
            active: RwLock::new(Arc::new(Active::new(
                Updater::Assign,
                0,
                Default::default(),
            ))),
            hook: RwLock::new(None),
            compression: RwLock::new(Compression::None),
            par_min_bytes: config.par_min_bytes,
            ranks,
            across,
            last_checkpoint: std::sync::Mutex::new(None),
            saving: std::sync::Mutex::new(None),
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

    /// This worker's rank: 0 to `num_workers() - 1`; 0 in a single-process store.
    pub fn rank(&self) -> usize {
        self.ranks.rank()
    }

    /// The number of workers (processes); 1 in a single-process store.
    pub fn num_workers(&self) -> usize {
        self.ranks.size()
    }

    /// This worker's rank among the workers on its machine (pick its GPU with it); 0 in a
    /// single-process store.
    pub fn local_rank(&self) -> usize {
        self.ranks.local_rank()
    }

    /// Waits until every worker of a `dist_*` store has called `barrier` (bounded by
    /// `KVSTORE_TIMEOUT`); `Ok` at once in a single-process store.
    pub fn barrier(&self) -> Result<()> {
        self.survive("barrier", self.ranks.barrier())
    }

    /// Checks that every worker of a `dist_*` store passes the same `what`, at the same place
    /// among its store calls: [`Error::Desync`] on every worker when they differ, naming the
    /// workers on each side; `Ok` at once in a single-process store.
    ///
    /// The store compares what it sees itself (keys, shapes, dtypes, the updater, checkpoint
    /// paths) before every call. This is for what it does not see: a framework optimizer's
    /// hyperparameters, a data order seed, a configuration file's checksum.
    ///
    /// ```
    /// use kvstore::KvStore;
    /// let kv = KvStore::create("local")?;
    /// kv.agree("torch SGD lr=0.1 momentum=0.9")?;
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn agree(&self, what: &str) -> Result<()> {
        self.survive("agree", self.ranks.agree(what))
    }

    /// For each of `flags`, whether any worker of a `dist_*` store passed `true`. Every worker
    /// calls it at the same point, with as many flags and the same `what` (else
    /// [`Error::Desync`] on every worker). A framework's wrapper asks with it which parameters
    /// got a gradient on any worker, so that every worker pushes the same keys.
    ///
    /// ```
    /// use kvstore::KvStore;
    /// let kv = KvStore::create("local")?;
    /// assert_eq!(kv.any_of("used", &[true, false])?, [true, false]);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn any_of(&self, what: &str, flags: &[bool]) -> Result<Vec<bool>> {
        self.survive("any_of", self.ranks.any_of(what, flags))
    }

    /// Sets a tag that the check of every later call of a `dist_*` store carries (`None`: no
    /// tag): workers whose tags differ fail with [`Error::Desync`]. A framework puts its step
    /// count here, so that a worker that skipped a step fails instead of summing its gradients
    /// with another step's. A queued call ([`crate::AsyncKvStore`]) carries the tag in force
    /// when it runs. No effect in a single-process store.
    pub fn set_tag(&self, tag: Option<&str>) {
        self.ranks.set_tag(tag);
    }

    /// Tells the other workers of a `dist_*` store that this worker will not make its call
    /// `op` (`"push"`, `"pull"`, ...) because its input was bad (`why`), so that they fail
    /// it with [`Error::RankRejected`] instead of waiting. `Ok` when they were told (at once
    /// in a single-process store); [`Error::DistFailed`] when the world failed earlier.
    ///
    /// The store does this itself for input it rejects. This is for a layer above that checks
    /// its own input (a binding): else a retry would be matched with the others' last call.
    pub fn reject(&self, op: &str, why: &str) -> Result<()> {
        // The fingerprint names ops by static names: the store's own, else "call".
        const OPS: [&str; 9] = [
            "init",
            "push",
            "pull",
            "pushpull",
            "broadcast",
            "save",
            "load",
            "barrier",
            "agree",
        ];
        let op = OPS.iter().find(|&&k| k == op).copied().unwrap_or("call");
        self.ranks.tell_rejected(op, why)
    }

    /// `err`, after telling the other ranks that this rank rejected its input for `op` (see
    /// [`Dist::reject`]). Only for errors found before the call's collectives begin.
    fn rejected(&self, op: &'static str, err: Error) -> Error {
        self.ranks.reject(op, err)
    }

    /// A key, or the error of converting it, told to the other ranks.
    fn key_for(&self, op: &'static str, key: impl IntoKey) -> Result<Key> {
        key.into_key().map_err(|e| self.rejected(op, e))
    }

    /// Waits for every operation in flight (pushes and pulls on GPU homes return once
    /// enqueued). NCCL work is polled for asynchronous errors, bounded by
    /// `KVSTORE_NCCL_TIMEOUT_MS` (default 60 s). Without a GPU this returns `Ok` at once.
    pub fn wait_all(&self) -> Result<()> {
        comm::wait_all()
    }

    /// How this store's calls run (a `nccl` store without a usable NCCL warns once and uses
    /// peer copies).
    fn ctx(&self) -> Ctx {
        Ctx::new(self.kind == StoreKind::Nccl, self.par_min_bytes)
    }

    /// Readies what a call on `groups` needs before it takes any key lock (NCCL communicators).
    fn prepare(&self, groups: &[Group<'_>]) -> Result<()> {
        let keys = groups.iter().map(|g| (g.slot.facts(), g.arrays.as_slice()));
        comm::prepare(self.ctx(), keys)
    }

    /// Replaces the updater. Per-key state (momentum and the like) and the update count start
    /// afresh on each key's next push, even for the same updater; to keep the state, use
    /// [`KvStore::update_hyperparameters`] or [`KvStore::set_learning_rate`]. A schedule and
    /// per-key multipliers stay set; an error if the schedule does not fit the new `lr`.
    ///
    /// ```
    /// use kvstore::{KvStore, Sgd, Updater};
    /// let kv = KvStore::create("local").unwrap();
    /// kv.set_updater(Updater::Sgd(Sgd { lr: 0.1, momentum: 0.9, ..Sgd::default() })).unwrap();
    /// assert!(kv.set_updater(Updater::Sgd(Sgd { lr: -1.0, ..Sgd::default() })).is_err());
    /// ```
    pub fn set_updater(&self, updater: Updater) -> Result<()> {
        updater.validate()?;
        if self.num_workers() > 1 {
            updater.check_named()?;
        }
        let mut active = write(&self.active);
        active.hyper.check_fits(&updater)?;
        let generation = active.generation + 1;
        *active = Arc::new(Active::new(updater, generation, active.hyper.restarted()));
        Ok(())
    }

    /// The updater in force.
    pub fn updater(&self) -> Updater {
        read(&self.active).updater.clone()
    }

    /// The keys in update order (MXNet's): int keys ascending, string keys in init order.
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
        self.keys_by(|s| s.order)
    }

    /// The keys in the order they were initialized (by `init`, `broadcast`, a list call's key
    /// order, or a checkpoint `load` that added them).
    pub fn keys_in_init_order(&self) -> Vec<Key> {
        self.keys_by(|s| s.init_seq)
    }

    /// Every key, sorted by `rank`.
    fn keys_by<R: Ord>(&self, rank: impl Fn(&Slot) -> R) -> Vec<Key> {
        let table = read(&self.table);
        let mut slots: Vec<&Arc<Slot>> = table.slots.values().collect();
        slots.sort_by_key(|s| rank(s));
        slots.iter().map(|s| s.key.clone()).collect()
    }

    /// The shape, dtype and home device of a key.
    pub fn meta(&self, key: impl IntoKey) -> Result<(Shape, DType, Device)> {
        let slot = read(&self.table).get("meta", &key.into_key()?)?;
        Ok((slot.shape, slot.dtype, slot.home))
    }

    /// Puts a copy of `value` in under `key`, once. `device` and `nccl` stores on a machine with
    /// GPUs home it on the GPU with the fewest bytes homed so far; the others keep it in host
    /// memory.
    pub fn init(&self, key: impl IntoKey, value: &NDArray) -> Result<()> {
        self.init_list(&[self.key_for("init", key)?], std::slice::from_ref(value))
    }

    /// Initializes many keys at once, all or none; homes are placed largest key first.
    pub fn init_list<K: IntoKey + Clone>(&self, keys: &[K], values: &[NDArray]) -> Result<()> {
        self.init_with_homes(keys, values, None, false)
    }

    /// As [`KvStore::init`], with the home chosen by the caller: `cpu(i)` keeps the value in
    /// host memory, `gpu(i)` on that GPU (an error if it does not exist).
    pub fn init_on(&self, key: impl IntoKey, value: &NDArray, home: Device) -> Result<()> {
        self.init_list_on(
            &[self.key_for("init", key)?],
            std::slice::from_ref(value),
            &[home],
        )
    }

    /// As [`KvStore::init_list`], with one home per key chosen by the caller (a `dist_*` store
    /// places keys itself and only checks the homes).
    pub fn init_list_on<K: IntoKey + Clone>(
        &self,
        keys: &[K],
        values: &[NDArray],
        homes: &[Device],
    ) -> Result<()> {
        let checked = check_len("init", keys.len(), homes.len(), "homes")
            .and_then(|()| homes.iter().try_for_each(|&h| probe::check_device(h)));
        checked.map_err(|e| self.rejected("init", e))?;
        self.init_with_homes(keys, values, Some(homes), false)
    }

    /// Adds `keys` with `values` (see [`KvStore::init_list_on`]), and goes on after a lost
    /// rank ([`KvStore::survive`]).
    fn init_with_homes<K: IntoKey + Clone>(
        &self,
        keys: &[K],
        values: &[NDArray],
        homes: Option<&[Device]>,
        row_sparse: bool,
    ) -> Result<()> {
        let got = self.init_here(keys, values, homes, row_sparse);
        self.survive("init", got)
    }

    fn init_here<K: IntoKey + Clone>(
        &self,
        keys: &[K],
        values: &[NDArray],
        homes: Option<&[Device]>,
        row_sparse: bool,
    ) -> Result<()> {
        let keys = check_len("init", keys.len(), values.len(), "values")
            .and_then(|()| to_keys(keys))
            .map_err(|e| self.rejected("init", e))?;
        let (d, across) = (&self.ranks, &*self.across);
        let any_gpu_home = across.gpu_homes(self.kind, homes);
        // Rank 0's values, read or copied before the call (that may fail). Host homes are
        // copied outside the table lock, so big inits do not stall other keys' lookups.
        let prepared = check_new_keys(&read(&self.table), &keys)
            .and_then(|()| across.rank0_values(d, values, any_gpu_home));
        let mine = prepared.map_err(|e| d.reject("init", e))?;
        let fp = || match row_sparse {
            true => across::init_fingerprint(&keys, values).note("row_sparse"),
            false => across::init_fingerprint(&keys, values),
        };
        let mut call = d.begin_with(fp)?;
        // Held to the end: the keys are placed before the values move, and nothing else
        // changes the table meanwhile.
        let mut table = write(&self.table);
        // Another thread may have added one of these keys since the check: the ranks agree
        // before any adds a key, so that no rank's table lacks keys the others have.
        let fresh = check_new_keys(&table, &keys)
            .and_then(|()| compress::check_dtypes(*read(&self.compression), &keys, values));
        let together = call.agree("init", fresh.is_ok(), "adding its keys");
        fresh?;
        together?;
        let loads = (table.rank_bytes.clone(), table.gpu_bytes.clone());
        let sizes: Vec<(usize, usize)> = values.iter().map(|v| (v.nbytes(), v.size())).collect();
        let (placed, spreads) = across.place(d, &mut table, &sizes, homes, any_gpu_home);
        let parts = (|| {
            let whole = across.rank0_to_all(&mut *call, d, values, &spreads, mine)?;
            let parts = whole.into_iter().zip(&spreads).zip(&placed).zip(values);
            parts
                .zip(&keys)
                .map(|((((w, &s), &home), v), key)| across::keep_part(d, w, s, home, v, key))
                .collect::<Result<Vec<HomeValue>>>()
        })();
        // Where the store keeps copies, each rank's new parts go to its buddy.
        let parts = parts.and_then(|data| {
            let Some(buddies) = d.buddies() else {
                let none = data.iter().map(|_| None).collect();
                return Ok((data, none));
            };
            let facts: Vec<KeyPart> = (values.iter().zip(&spreads))
                .map(|(v, &spread)| KeyPart {
                    dtype: v.dtype(),
                    len: v.size(),
                    spread,
                })
                .collect();
            let refs: Vec<&HomeValue> = data.iter().collect();
            let copies = copies::exchange_values(&mut *call, d, buddies, &facts, &refs)?;
            Ok((data, copies))
        });
        let parts = parts.and_then(|p| call.commit().map(|()| p));
        let (data, copies) = match parts {
            Ok(data) => data,
            Err(e) => {
                // Nothing was added: the placement loads are as they were.
                (table.rank_bytes, table.gpu_bytes) = loads;
                return Err(e);
            }
        };
        let new = (keys
            .into_iter()
            .zip(values)
            .zip(data.into_iter().zip(copies)))
        .zip(placed.into_iter().zip(spreads))
        .map(|(((key, v), (cell, copy)), (home, spread))| NewKey {
            key,
            shape: v.shape(),
            dtype: v.dtype(),
            home,
            spread,
            row_sparse,
            cell,
            copy,
        });
        table.insert(new);
        Ok(())
    }

    /// Pushes one or more values to `key`: the updater merges their sum into the stored value.
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
        self.push_list(&[self.key_for("push", key)?], &[values.arrays()])
    }

    /// Pushes to many keys at once, all or nothing. A key listed more than once gets the sum of
    /// all its values; the updater runs once per distinct key, in ascending key order.
    pub fn push_list<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> Result<()> {
        self.push_groups(self.groups("push", keys, values, "values", None))
    }

    /// Copies the stored value of `key` into every out, converting to each out's dtype.
    pub fn pull<V: ValueList + ?Sized>(&self, key: impl IntoKey, outs: &V) -> Result<()> {
        self.pull_list(&[self.key_for("pull", key)?], &[outs.arrays()])
    }

    /// Pulls many keys at once, from one consistent snapshot. All or nothing, with one
    /// exception on a `dist_*` store: a transfer that fails midway (a rank gone, or past
    /// `KVSTORE_TIMEOUT`; the store then refuses every call) may leave zeros in the outs it
    /// received into directly (a call's only key, or a big key, with one out in host memory).
    pub fn pull_list<K: IntoKey + Clone, V: ValueList>(
        &self,
        keys: &[K],
        outs: &[V],
    ) -> Result<()> {
        self.pull_groups(self.groups("pull", keys, outs, "outs", None))
    }

    /// Validates and applies a push of looked-up groups (or the error of looking them up).
    fn push_groups(&self, groups: Result<Vec<Group<'_>>>) -> Result<()> {
        let groups = groups
            .and_then(|g| check_values("push", &g).map(|()| g))
            .map_err(|e| self.rejected("push", e))?;
        self.push_call("push", groups, None, None)
    }

    /// Validates and applies a pull of looked-up groups (or the error of looking them up).
    fn pull_groups(&self, groups: Result<Vec<Group<'_>>>) -> Result<()> {
        let got = self.pull_here(groups);
        self.survive("pull", got)
    }

    fn pull_here(&self, groups: Result<Vec<Group<'_>>>) -> Result<()> {
        let groups = groups
            .and_then(|g| check_outs("pull", &g).map(|()| g))
            .map_err(|e| self.rejected("pull", e))?;
        let d = &self.ranks;
        self.prepare(&groups)?;
        let mut call = d.begin_with(|| across::fingerprint("pull", &groups))?;
        let cells: Few<RwLockReadGuard<'_, HomeValue>> =
            groups.iter().map(|g| read(&g.slot.cell)).collect();
        let cells: Few<&HomeValue> = cells.iter().map(|c| &**c).collect();
        let pulled = (self.across).pull_parts(&mut *call, d, self.ctx(), &groups, &cells);
        call.ended(pulled)
    }

    /// The one push of every store, on checked `groups` (`op`: `push` or `pushpull`): this
    /// process's contribution (for row-sparse keys, their merged `rows`), the sum across ranks,
    /// the updater, for a pushpull the pull of `pulls` (the same keys), and the hook.
    fn push_call(
        &self,
        op: &'static str,
        groups: Vec<Group<'_>>,
        pulls: Option<&[Group<'_>]>,
        rows: Option<Vec<Merged>>,
    ) -> Result<()> {
        let got = self.push_here(op, groups, pulls, rows);
        self.survive(op, got)
    }

    fn push_here(
        &self,
        op: &'static str,
        groups: Vec<Group<'_>>,
        pulls: Option<&[Group<'_>]>,
        rows: Option<Vec<Merged>>,
    ) -> Result<()> {
        let (d, across, ctx) = (&self.ranks, &*self.across, self.ctx());
        let compression = *read(&self.compression);
        let sent = match rows {
            Some(merged) => Sent::Rows(merged),
            None => Sent::Dense {
                mine: (across.contributions(d, ctx, &groups, compression.is_on()))
                    .map_err(|e| d.reject(op, e))?,
                compression,
            },
        };
        let active = read(&self.active).clone();
        let hook = read(&self.hook).clone();
        if let Sent::Dense { .. } = sent {
            self.prepare(&groups)?;
        }
        if let Some(pulls) = pulls {
            self.prepare(pulls)?;
        }
        // Where the store keeps copies: how this push keeps them current (rows: not at all).
        let copying = match &sent {
            Sent::Dense { .. } => self.copy_update(&active),
            Sent::Rows(_) => None,
        };
        let sends = copying == Some(ReplicaUpdate::Send);
        // The ranks must agree on the whole updater (it decides which collectives follow and
        // what they compute) and on what travels. Made only where the fingerprint is compared.
        let fp = || {
            let note = match &sent {
                Sent::Rows(_) => format!("row_sparse; {}", active.describe()),
                Sent::Dense { .. } if compression.is_on() => {
                    format!("{}; {}", active.describe(), compression.describe())
                }
                Sent::Dense { .. } => active.describe().to_owned(),
            };
            let fp = across::fingerprint(op, &groups);
            // Sending the updated parts goes on after the commit point, to an end point.
            match sends {
                true => fp.note(format!("{note}; copies sent")).with_end_point(),
                false => fp.note(note),
            }
        };
        let mut call = d.begin_with(fp)?;
        let arrived = across.sum_across(&mut *call, d, &groups, sent)?;
        let mut cells = lock_cells(&groups);
        let mut totals = None;
        // How this rank's part of the call went after its commit point, where the call goes on
        // to an end point (a pull, or the updated parts sent to the buddies).
        let mut after_commit = None;
        let counts = match arrived {
            Arrived::Dense(summed) => {
                let (inputs, residuals) = across.locked_inputs(d, compression, &groups, summed)?;
                // Where the store keeps copies, they are kept current by replaying the same
                // sums on the buddies, or by sending the updated parts after the commit.
                // (Who keeps whose copy as of this call, begun: a loss may have come between.)
                let mirrored = match (copying, d.buddies(), &inputs) {
                    (Some(ReplicaUpdate::Replay), Some(b), Inputs::Totals(totals)) => {
                        Some(copies::exchange_totals(&mut *call, d, b, &groups, totals)?)
                    }
                    _ => None,
                };
                let mut copy_cells = match mirrored {
                    Some(_) => groups.iter().map(|g| write(&g.slot.copy)).collect(),
                    None => Vec::new(),
                };
                let copies = mirrored.as_deref().map(|m| (m, copy_cells.as_mut_slice()));
                // Every survivor applies this push, or none (a rank lost before the commit
                // point). An updater that can fail computes every key first and asks whether
                // every rank succeeded: the push commits after that question, before any key
                // is stored; other updaters store as they go, so the push commits first.
                let asks = comm::asks_before_storing(&active.updater);
                let mut committed = false;
                if !asks {
                    call.commit()?;
                    committed = true;
                }
                let counts = across.update_counts(&active, &groups, &cells);
                let mut agree = |ok: bool| {
                    call.agree(op, ok, "in the updater")?;
                    if asks {
                        call.commit()?;
                        committed = true;
                    }
                    Ok(())
                };
                let applied = apply_push(
                    &active, ctx, &groups, &inputs, copies, &counts, &mut cells, &mut agree,
                );
                drop(copy_cells);
                if !committed {
                    // Failed before the commit point, as on every rank: nothing took effect.
                    applied?;
                    return Err(Error::internal("a push stored without committing"));
                }
                // A GPU fault the update latched shows here, before its parts are read.
                let applied = match sends {
                    true => applied.and_then(|()| crate::backend::settle(d.home())),
                    false => applied,
                };
                match &applied {
                    Ok(()) => {
                        if let Some(residuals) = residuals {
                            compress::commit(&groups, residuals, d.pool());
                        }
                    }
                    // Stopped midway: this rank's copies may be half updated.
                    Err(_) => copies::mark_behind(&groups),
                }
                // Where the call goes on after its commit (its parts sent to the buddies, or
                // a pull), every rank does, also where its own update failed (it sends none):
                // every rank meets the same collectives, and the end point fails the call on
                // every rank.
                after_commit = match (sends, d.buddies()) {
                    (true, Some(buddies)) => {
                        let current = applied.is_ok();
                        let sent = copies::send_parts(
                            &mut *call, d, buddies, &groups, &cells, &active, current,
                        );
                        Some(sent.and(applied))
                    }
                    _ if sends || pulls.is_some() => Some(applied),
                    _ => {
                        applied?;
                        None
                    }
                };
                totals = Some(inputs);
                counts
            }
            Arrived::Rows(parts) => {
                // Row-sparse pushes update no copies: a heal cannot use them.
                copies::mark_behind(&groups);
                let counts = across.update_counts(&active, &groups, &cells);
                // Commits once every rank has every key's new rows, before any is stored.
                rows::apply_rows(
                    &active, ctx, &groups, parts, &counts, &mut cells, &mut *call, op,
                )?;
                counts
            }
        };
        let done = hook
            .as_ref()
            .map(|_| pushed(&groups, &across.hook_steps(&active, &counts, &cells)));
        match (pulls, after_commit) {
            (Some(pulls), so_far) => {
                // `pushes` and `pulls` hold the same distinct keys in the same order.
                let values: Vec<&HomeValue> = cells.iter().map(|c| &**c).collect();
                // Pulled whatever came before: every rank meets the same collectives.
                let pulled = across.pull_parts(&mut *call, d, ctx, pulls, &values);
                call.ended(so_far.unwrap_or(Ok(())).and(pulled))?;
            }
            (None, Some(so_far)) => call.ended(so_far)?,
            (None, None) => {}
        }
        drop(cells);
        drop(call);
        if let Some(inputs) = totals {
            across.recycle(d, inputs);
        }
        call_hook(hook.as_deref(), &active, done)
    }

    /// A push, then a pull of the result into `outs`, as one atomic step (see also
    /// [`KvStore::pushpull_in_place`]).
    pub fn pushpull<V: ValueList + ?Sized, O: ValueList + ?Sized>(
        &self,
        key: impl IntoKey,
        values: &V,
        outs: &O,
    ) -> Result<()> {
        self.pushpull_list(
            &[self.key_for("pushpull", key)?],
            &[values.arrays()],
            &[outs.arrays()],
        )
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
        let checked = (|| {
            let pushes = self.groups("pushpull", keys, values, "values", None)?;
            let pulls = self.groups("pushpull", keys, outs, "outs", None)?;
            check_values("pushpull", &pushes)?;
            check_outs("pushpull", &pulls)?;
            Ok((pushes, pulls))
        })();
        let (pushes, pulls) = checked.map_err(|e| self.rejected("pushpull", e))?;
        self.push_call("pushpull", pushes, Some(&pulls), None)
    }

    /// [`KvStore::pushpull_list`] with the values as the outs (MXNet's list `pushpull` without
    /// `out`).
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
            &[self.key_for("init", key)?],
            std::slice::from_ref(value),
            &[outs.arrays()],
        )
    }

    /// Initializes many keys and pulls them; the outs are checked before any key is initialized.
    pub fn broadcast_list<K: IntoKey + Clone, O: ValueList>(
        &self,
        keys: &[K],
        values: &[NDArray],
        outs: &[O],
    ) -> Result<()> {
        let checked = (|| {
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
            Ok(())
        })();
        // A broadcast is an init then a pull: the other ranks are at the init.
        checked.map_err(|e| self.rejected("init", e))?;
        self.init_list(keys, values)?;
        match self.pull_list(keys, outs) {
            // A rank lost in the pull, after the init committed: where the store kept its keys
            // (healed), every survivor pulls again in the new world, and the broadcast took
            // effect; back at a checkpoint, the init is undone with the rest (redo the call).
            Err(Error::WorldChanged {
                lost,
                healed,
                restored,
                detail,
                ..
            }) => {
                let committed = restored.is_none() && self.pull_list(keys, outs).is_ok();
                Err(Error::WorldChanged {
                    op: "broadcast",
                    lost,
                    world: self.num_workers(),
                    rank: self.rank(),
                    healed,
                    restored,
                    committed,
                    detail: match committed {
                        true => format!(
                            "{detail}; its init had committed, and its pull was done again in \
                             the new world"
                        ),
                        false => detail,
                    },
                })
            }
            pulled => pulled,
        }
    }
}

/// Checks that `keys` (of one init call) are new to the table and to the call, of one kind,
/// and of the table's kind.
fn check_new_keys(table: &Table, keys: &[Key]) -> Result<()> {
    let call_kind = keys.first().map(Key::kind);
    let mut seen = HashSet::with_capacity(keys.len());
    for key in keys {
        table.check_kind("init", key)?;
        if let Some(kind) = call_kind.filter(|&k| k != key.kind()) {
            return Err(Error::MixedKeyTypes {
                op: "init",
                key: key.clone(),
                got: key.kind(),
                store: kind,
            });
        }
        if table.slots.contains_key(key) || !seen.insert(key) {
            return Err(Error::DuplicateInit { key: key.clone() });
        }
    }
    Ok(())
}

/// Applies a validated push to every group this rank holds, in issue order (`inputs`: what the
/// updater takes; `counts`: each group's update count so far), then records the new counts.
/// `agree`: see [`comm::update`].
/// Where the store keeps copies: the source's part of each key's sum, and the copies' cells.
type CopyUpdates<'a, 'g> = Option<(
    &'a [Option<NDArray>],
    &'a mut [RwLockWriteGuard<'g, HomeValue>],
)>;

/// `copies`: where the store keeps copies, updated with the parts in the same step.
#[allow(clippy::too_many_arguments)]
fn apply_push(
    active: &Active,
    ctx: Ctx,
    groups: &[Group<'_>],
    inputs: &Inputs,
    copies: CopyUpdates<'_, '_>,
    counts: &[u64],
    cells: &mut [RwLockWriteGuard<'_, HomeValue>],
    agree: comm::Agree<'_>,
) -> Result<()> {
    let hypers = hyper::for_push(active, groups, counts);
    let totals: Vec<Option<[&NDArray; 1]>> = match inputs {
        Inputs::Values => Vec::new(),
        Inputs::Totals(t) => t.iter().map(|a| a.as_ref().map(|a| [a])).collect(),
    };
    let mut taken: Vec<Option<&mut RwLockWriteGuard<'_, HomeValue>>> =
        cells.iter_mut().map(Some).collect();
    let mut jobs = Vec::with_capacity(groups.len());
    for i in issue_order(groups) {
        let g = &groups[i];
        let (values, shape): (&[&NDArray], Shape) = match inputs {
            Inputs::Values => (&g.arrays, g.slot.shape),
            Inputs::Totals(_) => match &totals[i] {
                Some(total) => (total, total[0].shape()),
                None => continue,
            },
        };
        let Some(value) = taken[i].take() else {
            continue;
        };
        jobs.push(KeyUpdate {
            facts: KeyFacts {
                shape,
                ..g.slot.facts()
            },
            value,
            values,
            hyper: hypers.of(i),
            // Totals are the push's own buffers, never a caller's: the backend may take one
            // instead of copying it, but only one the pool keeps. Taking small ones moved every
            // small key's value into a fresh allocation on every push, which the allocator
            // faulted in again on the next (measured: a push of 1000 keys of 1 KiB went slower).
            owned: matches!(inputs, Inputs::Totals(_))
                && values.iter().all(|v| Pool::keeps(v.nbytes())),
        });
    }
    let copy_totals: Vec<Option<[&NDArray; 1]>> = match &copies {
        Some((t, _)) => t.iter().map(|a| a.as_ref().map(|a| [a])).collect(),
        None => Vec::new(),
    };
    if let Some((_, copy_cells)) = copies {
        for (i, cell) in copy_cells.iter_mut().enumerate() {
            let (Some(total), g) = (&copy_totals[i], &groups[i]) else {
                continue;
            };
            jobs.push(KeyUpdate {
                facts: KeyFacts {
                    shape: total[0].shape(),
                    ..g.slot.facts()
                },
                value: cell,
                values: total,
                hyper: hypers.of(i),
                owned: false,
            });
        }
    }
    comm::update(&active.updater, active.generation, ctx, jobs, Some(agree))?;
    hypers.commit(active);
    for (g, &c) in groups.iter().zip(counts) {
        g.slot.set_updates(active.generation, c + 1);
    }
    Ok(())
}

/// A read lock that a panic elsewhere does not poison.
fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

/// A write lock that a panic elsewhere does not poison.
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
        self.push_list_with_priority(
            &[self.key_for("push", key)?],
            &[values.arrays()],
            &[priority],
        )
    }

    /// [`KvStore::push_list`], issuing the work for keys of higher priority first; equal
    /// priorities go in ascending key order (MXNet's). On a GPU home this is the order kernels
    /// and NCCL calls are enqueued in, so the gradients needed first (the first layers) can be
    /// given the highest priority. A key listed more than once gets the highest of its
    /// priorities. `priorities` has one entry per key; locks are still taken in ascending key
    /// order, so no priorities can deadlock.
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
        self.push_groups(self.groups("push", keys, values, "values", Some(priorities)))
    }

    /// A pull, like [`KvStore::pull`], with a priority; see [`KvStore::pull_list_with_priority`].
    pub fn pull_with_priority<V: ValueList + ?Sized>(
        &self,
        key: impl IntoKey,
        outs: &V,
        priority: i32,
    ) -> Result<()> {
        self.pull_list_with_priority(&[self.key_for("pull", key)?], &[outs.arrays()], &[priority])
    }

    /// [`KvStore::pull_list`], copying keys of higher priority first; equal priorities go in
    /// ascending key order. `priorities` has one entry per key.
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
        self.pull_groups(self.groups("pull", keys, outs, "outs", Some(priorities)))
    }
}

/// Stores over the loopback link, for tests of the distributed rules without `mpirun`.
#[cfg(test)]
impl KvStore {
    /// A `dist_sync` store on rank `link` of a loopback world; keys of more than `bound`
    /// elements are sliced over every rank.
    pub(crate) fn over_loopback(
        link: comm::link::loopback::Loopback,
        bound: usize,
    ) -> Result<KvStore> {
        KvStore::over_loopback_keeping(link, bound, Some(ReplicaUpdate::Replay))
    }

    /// [`KvStore::over_loopback`], keeping copies as `replicas` says (`None`: none).
    pub(crate) fn over_loopback_keeping(
        link: comm::link::loopback::Loopback,
        bound: usize,
        replicas: Option<ReplicaUpdate>,
    ) -> Result<KvStore> {
        let ranks = Dist::over_keeping(Box::new(link), Some(bound), replicas)?;
        let across = across::over(&ranks);
        let config = Config::from_vars(|_| None)?;
        let name = "dist_sync".to_owned();
        KvStore::with_ranks(StoreKind::DistSync, name, (ranks, across), &config)
    }
}

#[cfg(test)]
mod tests {
    use super::table::place_by_size;
    use super::*;
    use crate::host::HostData;

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
        let values: Vec<usize> = sizes
            .iter()
            .map(|&s| NDArray::zeros([s]).nbytes())
            .collect();
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
        let more = place_by_size(&mut bytes, 2, &[NDArray::zeros([10]).nbytes()]);
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
            let generation = read(&kv.active).generation;
            write(&slot.cell).set_host_state(generation, 7, bufs);
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

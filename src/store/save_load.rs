//! Checkpoints of every kind of store: one save and one load, of the sharded layout of
//! [`crate::checkpoint`] (a store of one process is a world of one rank).
//!
//! - **save**: rank 0 claims a new generation and tells the others; every rank writes its
//!   shard (the keys it homes, and its slice of every sliced key); then rank 0 checks the
//!   shards and commits the index. The ranks must share the checkpoint directory.
//! - **load**: the ranks compare which checkpoint each found; each locks the keys it has and
//!   makes its parts ready, and the ranks agree that all succeeded before any changes anything.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, RwLockReadGuard, RwLockWriteGuard};

use super::compress::lock;
use super::table::{NewKey, Slot, Table};
use super::{read, write, Active, KvStore};
use crate::backend::{HomeValue, HostState, StagedLoad};
use crate::checkpoint::{
    self, Entry, EntryState, KeyMeta, KeyResiduals, LoadStage, Piece, Problem, Reader, SaveId,
};
use crate::comm::fingerprint::Fingerprint;
use crate::comm::link::Round;
use crate::host::HostData;
use crate::{cpu, Device, Error, Key, KeyKind, NDArray, Result, Shape, Updater};

/// A checkpoint's path as the ranks compare it: canonical where it exists.
fn where_is(path: &Path) -> String {
    std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_owned())
        .display()
        .to_string()
}

/// Checkpoints: save and load.
impl KvStore {
    /// Saves every value and updater state into the checkpoint directory `path` (created if
    /// it does not exist), atomically: every rank of a `dist_*` store writes its shard, and a
    /// store of one process one shard that holds every key. See the
    /// [checkpoint docs](crate::checkpoint) for the format.
    ///
    /// A crash or an error at any point leaves the previous checkpoint in `path` (if any) the
    /// one a load finds; only a crash leaves files behind, which the next save removes. The
    /// values are one consistent snapshot: a concurrent push is wholly in it or not.
    ///
    /// A failure is an [`Error::Checkpoint`] of kind
    /// [`NotFound`](crate::CheckpointErrorKind::NotFound) (no such parent directory),
    /// [`Io`](crate::CheckpointErrorKind::Io), with the I/O error as its source, or
    /// [`Invalid`](crate::CheckpointErrorKind::Invalid) (`path` is a file).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let got = self.save_here(path.as_ref());
        let got = self.survive("save", got);
        // Saved, even where a rank was lost after rank 0 committed the save.
        if matches!(
            got,
            Ok(())
                | Err(Error::WorldChanged {
                    committed: true,
                    ..
                })
        ) {
            self.remember_checkpoint(path.as_ref());
        }
        *self.saving.lock().unwrap_or_else(|p| p.into_inner()) = None;
        got
    }

    fn save_here(&self, dir: &Path) -> Result<()> {
        let d = &self.ranks;
        let slots = self.slots_in_order();
        let active = read(&self.active).clone();
        // The updater too: each rank writes its shard's state under its own.
        let mut call = d.begin_with(|| save_fingerprint(dir, &active, &slots))?;
        let save = claim_generation(&mut *call, d.rank(), dir)?;
        let canonical = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
        *self.saving.lock().unwrap_or_else(|p| p.into_inner()) = Some((canonical, save.generation));
        let written = self.write_own_shard(dir, save, &slots, &active);
        let together = call.agree("save", written.is_ok(), "writing its shard");
        written?;
        together?;
        let committed = match d.rank() {
            0 => checkpoint::commit(dir, save, d.size()),
            _ => Ok(()),
        };
        let together = call.agree("save", committed.is_ok(), "committing the index");
        committed?;
        together?;
        call.end(true)
    }

    /// Loads a checkpoint written by [`KvStore::save`] (a directory saved by any world size,
    /// or a single file of an earlier version; see the [checkpoint docs](crate::checkpoint))
    /// into a store of any kind and device set. Keys the store lacks are added; keys it has
    /// must have the file's shape and dtype.
    ///
    /// - **Values** always load.
    /// - **Updater state** (momentum, Adam's moments, and their step count) loads when the
    ///   file was saved under an updater of the same [`name`](crate::Updater::name) and
    ///   [`state_names`](crate::Updater::state_names) as the one in force (Adam into Adam),
    ///   whatever the hyperparameters: set the updater before `load`. Otherwise, or where the
    ///   file holds no state for a key, the key starts its state afresh on its next push, as
    ///   after [`KvStore::set_updater`]. The updater is read once per call (a concurrent
    ///   `set_updater` is wholly before the load, or starts every key's state afresh).
    /// - **Compression residuals** load where as many ranks saved the checkpoint as load it
    ///   (each rank's are its own); otherwise they start at zero.
    ///
    /// Every byte read is verified against the file's checksums before it is used (files of
    /// format 1, which have none, load unverified, with a warning in the log).
    ///
    /// A load is all or nothing: the file's keys (new ones with their values and state) all
    /// change in one step, under every key's lock, so a concurrent push or pull sees the store
    /// wholly before or after it. Any error is an [`Error::Checkpoint`] whose
    /// [`kind`](crate::CheckpointErrorKind) tells a missing file or shard (`NotFound`), an I/O
    /// failure, an invalid or corrupt file (`Invalid`, even where it would not fit the store
    /// either) and one that does not fit the store apart, and leaves the store as it was, on
    /// every rank. Ranks that found different checkpoints at `path` all fail. (A CUDA failure
    /// while copying to a GPU home, an [`Error::Cuda`], can leave keys already in the store
    /// partly loaded.)
    pub fn load(&self, path: impl AsRef<Path>) -> Result<()> {
        let got = self.load_here(path.as_ref());
        if got.is_ok() {
            self.remember_checkpoint(path.as_ref());
        }
        self.survive("load", got)
    }

    /// [`KvStore::load`], without going on after a lost rank.
    pub(super) fn load_here(&self, path: &Path) -> Result<()> {
        let d = &self.ranks;
        let active = read(&self.active).clone();
        let (updater, generation) = (active.updater.clone(), active.generation);
        let opened = checkpoint::open(path).and_then(|reader| {
            let fits = self.check_fits(&read(&self.table), &reader, path);
            // A corrupt checkpoint is Invalid, whatever else is wrong with it.
            fits.or_else(|e| reader.verify().and(Err(e)))
                .map(|()| reader)
        });
        let reader = opened.map_err(|e| d.reject("load", e))?;
        // The updater decides whether the saved state is restored, so the ranks compare it too.
        let mut call = d.begin_with(|| load_fingerprint(path, &reader, &updater, generation))?;
        checkpoint::run_load_hook(LoadStage::Checked);
        self.load_from(&mut *call, path, &reader, &updater, generation)?;
        checkpoint::run_load_hook(LoadStage::Applied);
        Ok(())
    }

    /// Test hook: saves this store as a sharded checkpoint of `world` ranks in `dir`, through
    /// the writer and commit of a `dist` store (keys of `world` elements or more sliced evenly,
    /// smaller ones whole on one rank each in turn; the residuals saved as every rank's own),
    /// for tests without a `dist` store.
    #[cfg(feature = "test-util")]
    #[doc(hidden)]
    pub fn save_sharded(&self, dir: impl AsRef<Path>, world: usize) -> Result<()> {
        let dir = dir.as_ref();
        if world == 0 {
            return Err(
                Problem::invalid("a sharded save needs a world of one rank or more").at(dir),
            );
        }
        let (_, updater, entries) = self.export_entries()?;
        let residuals: Vec<KeyResiduals> = (entries.iter())
            .filter_map(|e| KeyResiduals::of(&e.key, e.shape.size(), &e.residuals))
            .collect();
        let save = checkpoint::next_generation(dir)?;
        for rank in 0..world {
            let pieces = (entries.iter().enumerate())
                .filter_map(|(order, e)| {
                    let range = checkpoint::rank_range(e.shape.size(), order, rank, world)?;
                    Some(checkpoint::entry_piece(e, order, range, &updater))
                })
                .collect::<Result<Vec<_>>>()?;
            checkpoint::write_shard(dir, save, rank, world, &updater, &pieces, &residuals)?;
        }
        checkpoint::commit(dir, save, world)
    }

    /// Test hook: saves this store to `path` as a single file of format 2, for tests of old files.
    #[cfg(feature = "test-util")]
    #[doc(hidden)]
    pub fn save_single_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let (kind, updater, entries) = self.export_entries()?;
        checkpoint::write_single_file(path.as_ref(), kind, &updater, &entries)
    }

    /// Every slot, in update order.
    pub(super) fn slots_in_order(&self) -> Vec<Arc<Slot>> {
        let mut slots: Vec<Arc<Slot>> = read(&self.table).slots.values().cloned().collect();
        slots.sort_by_key(|s| s.order);
        slots
    }

    /// Writes this rank's shard of `save` into `dir`: its parts of `slots` (in update order),
    /// one snapshot under every key's read lock, and its residuals of every key it pushed.
    fn write_own_shard(
        &self,
        dir: &Path,
        save: SaveId,
        slots: &[Arc<Slot>],
        active: &Active,
    ) -> Result<()> {
        let (rank, size) = (self.ranks.rank(), self.ranks.size());
        let cells: Vec<RwLockReadGuard<'_, HomeValue>> =
            slots.iter().map(|s| read(&s.cell)).collect();
        let mut pieces = Vec::new();
        for (order, (slot, cell)) in slots.iter().zip(&cells).enumerate() {
            if slot.spread.holds(rank) {
                pieces.push(own_piece(slot, cell, order, rank, size, active)?);
            }
        }
        let residuals: Vec<KeyResiduals> = (slots.iter())
            .filter_map(|s| KeyResiduals::of(&s.key, s.shape.size(), &lock(&s.residuals)))
            .collect();
        let updater = &active.updater;
        checkpoint::write_shard(dir, save, rank, size, updater, &pieces, &residuals)
    }

    /// The key kind, the updater in force, and every key in update order with copies of its
    /// value (on ranks, this rank's part) and state, as one snapshot under every read lock.
    pub(crate) fn export_entries(&self) -> Result<(Option<KeyKind>, Updater, Vec<Entry>)> {
        let kind = read(&self.table).key_kind;
        let slots = self.slots_in_order();
        let active = read(&self.active).clone();
        let cells: Vec<RwLockReadGuard<'_, HomeValue>> =
            slots.iter().map(|s| read(&s.cell)).collect();
        let entries = (slots.iter().zip(&cells))
            .map(|(slot, cell)| {
                let (value, state) = host_copy(cell, &active)?;
                Ok(Entry {
                    key: slot.key.clone(),
                    shape: slot.shape,
                    value,
                    state,
                    row_sparse: slot.row_sparse,
                    residuals: lock(&slot.residuals).clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((kind, active.updater.clone(), entries))
    }

    /// Checks that a checkpoint's keys fit `table`: kind, shape, dtype and storage, new keys too.
    fn check_fits(&self, table: &Table, reader: &Reader, path: &Path) -> Result<()> {
        let mismatch = |why: String| Problem::mismatch(why).at(path);
        if let (Some(store), Some(file)) = (table.key_kind, reader.key_kind()) {
            if store != file {
                return Err(mismatch(format!(
                    "the file holds {file} keys but the store holds {store} keys: load it into \
                     a store of {file} keys"
                )));
            }
        }
        for m in reader.keys() {
            let Some(slot) = table.slots.get(&m.key) else {
                let sparse_refusal = m.row_sparse.then(|| self.row_sparse_refusal("load"));
                if let Some(refusal) = sparse_refusal.flatten() {
                    return Err(mismatch(format!("key {} is row-sparse: {refusal}", m.key)));
                }
                let compression = *read(&self.compression);
                let refusal = super::compress::dtype_refusal(compression, "load", &m.key, m.dtype);
                if let Some(refusal) = refusal {
                    return Err(mismatch(refusal.to_string()));
                }
                continue;
            };
            if slot.shape.dims() != m.dims.as_slice() || slot.dtype != m.dtype {
                return Err(mismatch(format!(
                    "key {}: the file holds {} {} but the store holds {} {}: load it into a \
                     store without this key, or with the file's shape and dtype",
                    m.key,
                    Shape::new(&m.dims).map_or_else(|_| format!("{:?}", m.dims), |s| s.to_string()),
                    m.dtype,
                    slot.shape,
                    slot.dtype
                )));
            }
            if m.row_sparse != slot.row_sparse {
                let name = |sparse: bool| if sparse { "row-sparse" } else { "dense" };
                return Err(mismatch(format!(
                    "key {}: the file holds it {} but the store holds it {}: load it into a \
                     store without this key, or with the key initialized as the file has it",
                    m.key,
                    name(m.row_sparse),
                    name(slot.row_sparse)
                )));
            }
        }
        Ok(())
    }

    /// Puts `reader`'s checkpoint into the store, all or nothing, in one step, in `call`.
    ///
    /// Lock order, as every other operation: the cells of the keys the store has, in key order
    /// (found with a brief read of the table), then the table; nothing holds the table lock
    /// while it waits for a cell, so this cannot deadlock. A key that a concurrent init added
    /// between the lookup and the table lock is not locked yet, so the step starts over with
    /// nothing changed (each retry finds at least one more key, so this ends).
    pub(super) fn load_from(
        &self,
        call: &mut dyn Round,
        path: &Path,
        reader: &Reader,
        updater: &Updater,
        generation: u64,
    ) -> Result<()> {
        loop {
            let found: Vec<Option<Arc<Slot>>> = {
                let table = read(&self.table);
                (reader.keys().iter())
                    .map(|m| table.slots.get(&m.key).cloned())
                    .collect()
            };
            let mut cells = lock_in_key_order(&found);
            let mut table = write(&self.table);
            let raced = (reader.keys().iter().zip(&found))
                .any(|(m, s)| s.is_none() && table.slots.contains_key(&m.key));
            if raced {
                continue;
            }
            let loads = (table.rank_bytes.clone(), table.gpu_bytes.clone());
            let made = self
                .check_fits(&table, reader, path)
                .and_then(|()| self.make_parts(&mut table, reader, updater, generation, &cells))
                .and_then(|made| {
                    let residuals = reader.rank_residuals(self.ranks.rank(), self.ranks.size())?;
                    Ok((made, residuals))
                });
            let together = call.agree("load", made.is_ok(), "making its parts");
            // Every survivor applies this load, or none (a rank lost before this point).
            let together = together.and_then(|()| call.commit());
            let (made, residuals) = match (made, together) {
                (Ok(made), Ok(())) => made,
                (made, together) => {
                    // Nothing was added: the placement loads are as they were.
                    (table.rank_bytes, table.gpu_bytes) = loads;
                    made?;
                    return together;
                }
            };
            apply_parts(&mut table, made, &found, &mut cells)?;
            // Residuals change only under their cells' locks, still held.
            set_loaded_extras(&table, reader, residuals, updater, generation);
            drop(cells);
            return Ok(());
        }
    }

    /// Every key of `reader` made ready for this rank (new keys placed, the others staged for
    /// their `cells`): what can fail on one rank alone (out of GPU memory) fails here.
    fn make_parts(
        &self,
        table: &mut Table,
        reader: &Reader,
        updater: &Updater,
        generation: u64,
        cells: &[Option<RwLockWriteGuard<'_, HomeValue>>],
    ) -> Result<Vec<Made>> {
        let d = &self.ranks;
        let (rank, size) = (d.rank(), d.size());
        // Where the store keeps copies: the part of the rank whose copy this rank keeps.
        let source = d.buddies().map(|b| b.source(rank));
        let fits = reader.state_fits(updater);
        let new: Vec<&KeyMeta> = (reader.keys().iter())
            .filter(|m| !table.slots.contains_key(&m.key))
            .collect();
        let sizes: Vec<(usize, usize)> = (new.iter())
            .map(|m| (m.size() * m.dtype.size(), m.size()))
            .collect();
        let to_gpu = self.across.gpu_homes(self.kind, None);
        let (homes, spreads) = (self.across).place(d, table, &sizes, None, to_gpu);
        // A fault the GPU latched earlier fails every rank here, not this rank after agreeing.
        crate::backend::settle(d.home())?;
        let mut placed = new.iter().zip(homes.into_iter().zip(spreads));
        let mut made = Vec::with_capacity(reader.keys().len());
        for (m, cell) in reader.keys().iter().zip(cells) {
            let (home, spread) = match table.slots.get(&m.key) {
                Some(slot) => (slot.home, slot.spread),
                None => (placed.next().map(|(_, p)| p))
                    .ok_or_else(|| internal("fewer placements than new keys"))?,
            };
            let range = spread.piece(m.size(), rank, size);
            let (value, state) = match spread.holds(rank) {
                true => read_part(reader, m, range, fits)?,
                false => (HostData::filled(m.dtype, 0, 0.0), None),
            };
            let copy = match source.filter(|&s| spread.holds(s)) {
                Some(s) => {
                    let range = spread.piece(m.size(), s, size);
                    let (value, state) = read_part(reader, m, range, fits)?;
                    let mut copy = keep_on(Device::Cpu(0), value, &m.key)?;
                    copy.set_state(generation, state)?;
                    Some(copy)
                }
                None => None,
            };
            made.push(match cell {
                Some(cell) => Made::Held(cell.stage_load(value, generation, state)?, copy),
                None => {
                    let mut cell = keep_on(home, value, &m.key)?;
                    cell.set_state(generation, state)?;
                    Made::New(NewKey {
                        key: m.key.clone(),
                        shape: Shape::new(&m.dims)?,
                        dtype: m.dtype,
                        home,
                        spread,
                        row_sparse: m.row_sparse,
                        cell,
                        copy,
                    })
                }
            });
        }
        Ok(made)
    }
}

/// The cells of the slots found (`None`: a key the store lacks), write-locked in key order.
fn lock_in_key_order(found: &[Option<Arc<Slot>>]) -> Vec<Option<RwLockWriteGuard<'_, HomeValue>>> {
    let mut have: Vec<(usize, &Arc<Slot>)> = (found.iter().enumerate())
        .filter_map(|(i, s)| Some((i, s.as_ref()?)))
        .collect();
    have.sort_by_key(|(_, s)| s.order);
    let mut cells: Vec<Option<RwLockWriteGuard<'_, HomeValue>>> =
        found.iter().map(|_| None).collect();
    for (i, slot) in have {
        cells[i] = Some(write(&slot.cell));
    }
    cells
}

/// Claims the generation of a save into `dir` on rank 0 and tells every rank (or its failure).
fn claim_generation(call: &mut dyn Round, rank: usize, dir: &Path) -> Result<SaveId> {
    // u64::MAX is never a generation: it tells the other ranks that rank 0 failed.
    let own = (rank == 0).then(|| checkpoint::next_generation(dir));
    let words = match &own {
        Some(Ok(s)) => vec![s.generation, s.token],
        _ => vec![u64::MAX, 0],
    };
    let words = call.broadcast_words(words, 0)?;
    if words[0] == u64::MAX {
        own.transpose()?;
        return Err(Error::RankFailed {
            op: "save",
            seq: call.seq(),
            detail: "rank 0 could not start the save (its own error says why)".to_owned(),
        });
    }
    Ok(SaveId {
        generation: words[0],
        token: words[1],
    })
}

/// What the ranks compare before a save into `dir`: the path, the updater and every key.
fn save_fingerprint(dir: &Path, active: &Active, slots: &[Arc<Slot>]) -> Fingerprint {
    let mut fp = Fingerprint::new("save").note(format!(
        "into {}, under updater {:?} set by call #{}",
        where_is(dir),
        active.updater,
        active.generation
    ));
    for s in slots {
        fp.push(s.key.clone(), s.shape.dims(), s.dtype);
    }
    fp
}

/// What the ranks compare before a load: the path, the checkpoint found, the updater, every key.
fn load_fingerprint(
    path: &Path,
    reader: &Reader,
    updater: &Updater,
    generation: u64,
) -> Fingerprint {
    let mut fp = Fingerprint::new("load").note(format!(
        "from {}, {}, under updater {updater:?} set by call #{generation}",
        where_is(path),
        reader.which()
    ));
    for m in reader.keys() {
        fp.push(m.key.clone(), &m.dims, m.dtype);
    }
    fp
}

/// This rank's piece of `slot`, the `order`-th key, from its `cell`, with its state if any.
fn own_piece(
    slot: &Slot,
    cell: &HomeValue,
    order: usize,
    rank: usize,
    size: usize,
    active: &Active,
) -> Result<Piece> {
    let range = slot.spread.piece(slot.shape.size(), rank, size);
    let (value, state) = host_copy(cell, active)?;
    let names = active.updater.state_names().iter().map(|n| n.to_string());
    let flat = Shape::new(&[range.len()])?;
    let host = |h: HostData| NDArray::from_host(h, flat, cpu(0));
    Ok(Piece {
        meta: KeyMeta {
            key: slot.key.clone(),
            dims: slot.shape.dims().to_vec(),
            dtype: slot.dtype,
            order,
            step: state.as_ref().map_or(0, |s| s.step),
            has_state: state.is_some(),
            row_sparse: slot.row_sparse,
        },
        range,
        value: host(value),
        state: state.map_or_else(Vec::new, |s| {
            names.zip(s.bufs.into_iter().map(host)).collect()
        }),
    })
}

/// Copies of `cell`'s value (on ranks, this rank's part) and of its state for the updater in
/// force (only state a push of it would use, one buffer per state name).
pub(super) fn host_copy(
    cell: &HomeValue,
    active: &Active,
) -> Result<(HostData, Option<EntryState>)> {
    let (value, state) = cell.to_host(active.generation)?;
    let buffers = active.updater.state_names().len();
    let state = state.filter(|(_, bufs)| bufs.len() == buffers);
    Ok((value, state.map(|(step, bufs)| EntryState { step, bufs })))
}

/// Elements `range` of key `m`, with its step and state where it has state that `fits`.
fn read_part(
    reader: &Reader,
    m: &KeyMeta,
    range: std::ops::Range<usize>,
    fits: bool,
) -> Result<(HostData, Option<HostState>)> {
    let piece = reader.read(&m.key, range)?;
    let state = match fits && m.has_state {
        true => {
            let bufs = piece.state.into_iter().map(|(_, b)| b.into_host());
            Some((m.step, bufs.collect::<Result<Vec<HostData>>>()?))
        }
        false => None,
    };
    Ok((piece.value.into_host()?, state))
}

/// A loaded part, `part` (flat), kept on `home`.
pub(super) fn keep_on(home: Device, part: HostData, key: &Key) -> Result<HomeValue> {
    let flat = Shape::new(&[part.len()])?;
    HomeValue::from_array(NDArray::from_host(part, flat, cpu(0)), home).map_err(|e| e.with_key(key))
}

/// Applies the parts `made` (one per key, in order): keys the store has (the slots `found`)
/// under their `cells` (allocating nothing, failing only where the GPU does), with their copies
/// where the store keeps them, then the new keys, into `table`.
fn apply_parts(
    table: &mut Table,
    made: Vec<Made>,
    found: &[Option<Arc<Slot>>],
    cells: &mut [Option<RwLockWriteGuard<'_, HomeValue>>],
) -> Result<()> {
    let mut new_keys = Vec::new();
    for ((made, cell), slot) in made.into_iter().zip(cells.iter_mut()).zip(found) {
        match (made, cell, slot) {
            (Made::Held(staged, copy), Some(cell), Some(slot)) => {
                cell.commit_load(staged)?;
                if let Some(copy) = copy {
                    // The copy's lock comes after the cell's (held), as everywhere.
                    *write(&slot.copy) = copy;
                    (slot.copy_behind).store(false, std::sync::atomic::Ordering::Release);
                }
            }
            (Made::New(new), None, _) => new_keys.push(new),
            _ => return Err(internal("a key made ready for a cell it does not have")),
        }
    }
    table.insert(new_keys);
    Ok(())
}

/// After a load: every loaded key's residuals (this rank's own, or none) and update count.
fn set_loaded_extras(
    table: &Table,
    reader: &Reader,
    residuals: Option<Vec<KeyResiduals>>,
    updater: &Updater,
    generation: u64,
) {
    let fits = reader.state_fits(updater);
    let mut saved: HashMap<Key, Vec<Vec<f32>>> = (residuals.unwrap_or_default().into_iter())
        .map(|r| (r.key, r.residuals))
        .collect();
    for m in reader.keys() {
        if let Some(slot) = table.slots.get(&m.key) {
            *lock(&slot.residuals) = saved.remove(&m.key).unwrap_or_default();
            let count = if fits && m.has_state { m.step } else { 0 };
            slot.set_updates(generation, count);
        }
    }
}

/// An error of this module's own bookkeeping.
fn internal(message: &str) -> Error {
    Error::Internal {
        op: "load",
        message: message.to_owned(),
    }
}

/// One key of a load, made ready before the ranks agree.
enum Made {
    /// A key the store holds: its value and state, staged for its cell, and its copy where
    /// the store keeps one.
    Held(StagedLoad, Option<HomeValue>),
    /// A new key, to add to the table.
    New(NewKey),
}

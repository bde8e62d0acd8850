//! Checkpoints of a distributed store: each rank saves and loads only its own parts of the
//! values and of the updater state, in the sharded layout of [`crate::checkpoint`].
//!
//! - **save**: rank 0 picks a new generation and tells the others; every rank writes its shard
//!   (the keys it homes, and its slice of every sliced key); once every rank has written, rank 0
//!   checks the shards and commits the index. A save that fails or stops part way never
//!   touches the index. The ranks must share the checkpoint directory (one machine, or a
//!   shared file system).
//! - **load**: every rank opens the checkpoint (a sharded directory of any world size, or a
//!   single file a local store saved), reads the parts it holds, and the ranks agree that every
//!   read succeeded before any of them changes anything.

use std::path::Path;
use std::sync::{Arc, RwLockWriteGuard};

use super::table::{place_on_ranks, Slot};
use super::{insert_slots, read, write, KvStore};
use crate::backend::{HomeValue, StagedLoad};
use crate::checkpoint::{self, KeyMeta, KeyResiduals, Piece, Problem, Reader};
use crate::comm::fingerprint::Fingerprint;
use crate::comm::Spread;
use crate::host::HostData;
use crate::{Device, Error, Key, NDArray, Result, Shape};

/// A checkpoint's path as the ranks compare it: canonical where it exists, so that a relative
/// and an absolute path to the same place agree.
fn where_is(path: &Path) -> String {
    std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_owned())
        .display()
        .to_string()
}

impl KvStore {
    /// A dist store's save into checkpoint directory `dir`.
    pub(super) fn dist_save(&self, dir: &Path) -> Result<()> {
        let d = &self.ranks;
        let (rank, size) = (d.rank(), d.size());
        let mut slots: Vec<Arc<Slot>> = read(&self.table).slots.values().cloned().collect();
        slots.sort_by_key(|s| s.order);
        let (updater, generation) = self.active_updater();
        // The updater too: each rank writes its shard's state under its own.
        let mut fp = Fingerprint::new("save").note(format!(
            "into {}, under updater {updater:?} set by call #{generation}",
            where_is(dir)
        ));
        for s in &slots {
            fp.push(s.key.clone(), s.shape.dims(), s.dtype);
        }
        let mut call = d.begin(fp)?;
        // Rank 0 claims the generation and mints the save's token; a failure there fails the
        // save on every rank.
        let mut words = vec![u64::MAX, 0];
        let mut own = Ok(());
        if rank == 0 {
            match checkpoint::next_generation(dir) {
                Ok(s) => words = vec![s.generation, s.token],
                Err(e) => own = Err(e),
            }
        }
        let words = call.broadcast_words(words, 0)?;
        let save = checkpoint::SaveId {
            generation: words[0],
            token: words[1],
        };
        if save.generation == u64::MAX {
            return own.and(Err(Error::RankFailed {
                op: "save",
                seq: call.seq(),
                detail: "rank 0 could not start the save (its own error says why)".to_owned(),
            }));
        }
        // One consistent snapshot of this rank's parts, under every key's read lock.
        let active = read(&self.active).clone();
        let cells: Vec<_> = slots.iter().map(|s| read(&s.cell)).collect();
        let written = (|| {
            let buffers = active.updater.state_names().len();
            let mut pieces = Vec::new();
            for (order, (slot, cell)) in slots.iter().zip(&cells).enumerate() {
                if !slot.spread.holds(rank) {
                    continue;
                }
                let range = slot.spread.piece(slot.shape.size(), rank, size);
                let (value, state) = cell.to_host(active.generation)?;
                let state = state.filter(|(_, bufs)| bufs.len() == buffers);
                let flat = Shape::new(&[range.len()])?;
                let host = |h: HostData| NDArray::from_host(h, flat, Device::Cpu(0));
                pieces.push(Piece {
                    meta: KeyMeta {
                        key: slot.key.clone(),
                        dims: slot.shape.dims().to_vec(),
                        dtype: slot.dtype,
                        order,
                        step: state.as_ref().map_or(0, |s| s.0),
                        has_state: state.is_some(),
                        row_sparse: slot.row_sparse,
                    },
                    range,
                    value: host(value),
                    state: match state {
                        Some((_, bufs)) => active
                            .updater
                            .state_names()
                            .iter()
                            .map(|n| n.to_string())
                            .zip(bufs.into_iter().map(host))
                            .collect(),
                        None => Vec::new(),
                    },
                });
            }
            // This rank's compression residuals, of every key it pushed (homed here or not).
            let residuals: Vec<KeyResiduals> = slots
                .iter()
                .filter_map(|slot| {
                    let r = slot.residuals.lock().unwrap_or_else(|p| p.into_inner());
                    (!r.is_empty()).then(|| KeyResiduals {
                        key: slot.key.clone(),
                        len: slot.shape.size(),
                        residuals: r.clone(),
                    })
                })
                .collect();
            checkpoint::write_shard(dir, save, rank, size, &active.updater, &pieces, &residuals)
        })();
        drop(cells);
        let together = call.agree("save", written.is_ok(), "writing its shard");
        written?;
        together?;
        let committed = match rank {
            0 => checkpoint::commit(dir, save, size),
            _ => Ok(()),
        };
        let together = call.agree("save", committed.is_ok(), "committing the index");
        committed?;
        together
    }

    /// A dist store's load of checkpoint `path` (a sharded directory or a single file).
    pub(super) fn dist_load(&self, path: &Path) -> Result<()> {
        let d = &self.ranks;
        let (rank, size) = (d.rank(), d.size());
        let (updater, generation) = self.active_updater();
        let opened = (|| {
            let reader = checkpoint::open(path)?;
            self.check_fits(&reader, path)?;
            Ok(reader)
        })();
        let reader: Reader = opened.map_err(|e| d.reject("load", e))?;
        // The ranks must read the same checkpoint: its path and, for a directory, the
        // generation each rank found committed and the token of the save that wrote it.
        let which = match checkpoint::read_index(path) {
            Ok(index) if path.is_dir() => {
                format!("generation {} of save {:?}", index.generation, index.token)
            }
            _ => "a single file".to_owned(),
        };
        // The updater in force too: it decides whether the saved state is restored, so ranks
        // that set theirs in another order relative to the load would keep mixed state.
        let mut fp = Fingerprint::new("load").note(format!(
            "from {}, {which}, under updater {updater:?} set by call #{generation}",
            where_is(path)
        ));
        for m in reader.keys() {
            fp.push(m.key.clone(), &m.dims, m.dtype);
        }
        let mut call = d.begin(fp)?;
        let fits = reader.state_fits(&updater);
        // Where every key lives: as it is, or placed as an init would place it. Every rank
        // holds the same table, so every rank computes the same.
        let mut table = write(&self.table);
        let mut rank_bytes = table.rank_bytes.clone();
        let new: Vec<&KeyMeta> = reader
            .keys()
            .iter()
            .filter(|m| !table.slots.contains_key(&m.key))
            .collect();
        let sizes: Vec<(usize, bool)> = new
            .iter()
            .map(|m| (m.size() * m.dtype.size(), d.is_sliced(m.size())))
            .collect();
        let placed = place_on_ranks(&mut rank_bytes, size, &sizes);
        let spread_of = |key: &Key| -> Spread {
            match table.slots.get(key) {
                Some(s) => s.spread,
                None => {
                    let i = new.iter().position(|m| &m.key == key).unwrap_or(0);
                    placed[i]
                }
            }
        };
        // Read this rank's parts; nothing changes until every rank has read its own.
        let read_parts = reader
            .keys()
            .iter()
            .map(|m| {
                let spread = spread_of(&m.key);
                if !spread.holds(rank) {
                    return Ok((spread, None));
                }
                let piece = reader.read(&m.key, spread.piece(m.size(), rank, size))?;
                let state = (fits && m.has_state).then(|| {
                    let bufs = piece.state.into_iter().map(|(_, b)| b.into_host());
                    (m.step, bufs.collect::<Result<Vec<HostData>>>())
                });
                let state = match state {
                    Some((step, bufs)) => Some((step, bufs?)),
                    None => None,
                };
                Ok((spread, Some((piece.value.into_host()?, state))))
            })
            .collect::<Result<Vec<_>>>();
        // Every key's new value and state, made ready before the ranks agree: what can fail on
        // one rank alone (out of GPU memory) fails every rank here, with no key changed. A new
        // key gets its cell; a key already held gets what its cell cannot take in place (state
        // buffers it lacks), and is written under its lock, taken now.
        let existing: Vec<Arc<Slot>> = reader
            .keys()
            .iter()
            .filter_map(|m| table.slots.get(&m.key).cloned())
            .collect();
        let mut cells: Vec<RwLockWriteGuard<'_, HomeValue>> =
            existing.iter().map(|s| write(&s.cell)).collect();
        let made = read_parts.and_then(|parts| {
            // A fault the GPU latched earlier fails every rank here, not this rank's commit
            // after the agreement.
            crate::backend::settle(d.home())?;
            let mut next_cell = 0;
            (reader.keys().iter().zip(parts))
                .map(|(m, (spread, part))| {
                    let (value, state) = match part {
                        Some((v, s)) => (v, s),
                        None => (HostData::filled(m.dtype, 0, 0.0), None),
                    };
                    if table.slots.contains_key(&m.key) {
                        let staged = cells[next_cell].stage_load(value, generation, state)?;
                        next_cell += 1;
                        return Ok(Made::Held(staged));
                    }
                    let mut cell = super::across::keep(d, value)?;
                    cell.set_state(generation, state)?;
                    Ok(Made::New(spread, Shape::new(&m.dims)?, cell))
                })
                .collect::<Result<Vec<_>>>()
        });
        // This rank's compression residuals, where the checkpoint was saved by as many ranks.
        let residuals = made.and_then(|made| Ok((made, reader.rank_residuals(rank, size)?)));
        let together = call.agree("load", residuals.is_ok(), "making its parts");
        let (made, residuals) = residuals?;
        together?;
        // Apply, in one step: existing keys under their write locks (this allocates nothing,
        // and fails only where the GPU itself does), then the new keys.
        let mut new_keys = Vec::new();
        let mut new_kinds = Vec::new();
        let mut new_data = Vec::new();
        let mut new_spreads = Vec::new();
        let mut new_sparse = Vec::new();
        let mut held = cells.iter_mut();
        for (m, made) in reader.keys().iter().zip(made) {
            match made {
                Made::Held(staged) => {
                    let cell = held.next().ok_or_else(|| Error::Internal {
                        op: "load",
                        message: "more keys held than cells locked".to_owned(),
                    })?;
                    cell.commit_load(staged)?;
                }
                Made::New(spread, shape, cell) => {
                    new_keys.push(m.key.clone());
                    new_kinds.push((shape, m.dtype));
                    new_data.push(cell);
                    new_spreads.push(spread);
                    new_sparse.push(m.row_sparse);
                }
            }
        }
        drop(cells);
        table.rank_bytes = rank_bytes;
        let homes = vec![d.home(); new_keys.len()];
        insert_slots(
            &mut table,
            new_keys,
            &new_kinds,
            new_data,
            &homes,
            &new_spreads,
            &new_sparse,
        );
        // The loaded keys' residuals: this rank's own from the checkpoint, or none (they start
        // at zero) where it has none for a key or was saved by another number of ranks.
        let mut saved: std::collections::HashMap<Key, Vec<Vec<f32>>> = residuals
            .unwrap_or_default()
            .into_iter()
            .map(|r| (r.key, r.residuals))
            .collect();
        for m in reader.keys() {
            if let Some(slot) = table.slots.get(&m.key) {
                *slot.residuals.lock().unwrap_or_else(|p| p.into_inner()) =
                    saved.remove(&m.key).unwrap_or_default();
            }
        }
        // Every rank keeps every key's update count, whoever holds its state.
        for m in reader.keys() {
            if let Some(slot) = table.slots.get(&m.key) {
                let count = if fits && m.has_state { m.step } else { 0 };
                slot.set_updates(generation, count);
            }
        }
        Ok(())
    }

    /// Checks that a checkpoint's keys fit the store: the key kind, the shape, dtype and storage
    /// of every key the store has, and that it can hold the new row-sparse keys.
    fn check_fits(&self, reader: &Reader, path: &Path) -> Result<()> {
        let table = read(&self.table);
        if let (Some(store), Some(file)) = (table.key_kind, reader.key_kind()) {
            if store != file {
                return Err(Problem::mismatch(format!(
                    "the file holds {file} keys but the store holds {store} keys: load it into \
                     a store of {file} keys"
                ))
                .at(path));
            }
        }
        for m in reader.keys() {
            if let Some(slot) = table.slots.get(&m.key) {
                if slot.shape.dims() != m.dims.as_slice() || slot.dtype != m.dtype {
                    return Err(Problem::mismatch(format!(
                        "key {}: the file holds {:?} {} but the store holds {} {}: load it \
                         into a store without this key, or with the file's shape and dtype",
                        m.key, m.dims, m.dtype, slot.shape, slot.dtype
                    ))
                    .at(path));
                }
                if let Some(why) = super::entries::storage_mismatch(&m.key, m.row_sparse, slot) {
                    return Err(Problem::mismatch(why).at(path));
                }
            } else {
                // A new key this store cannot hold because it compresses: row-sparse, or not
                // float32.
                let sparse_refusal = m.row_sparse.then(|| self.row_sparse_refusal("load"));
                if let Some(refusal) = sparse_refusal.flatten() {
                    let why = format!("key {} is row-sparse: {refusal}", m.key);
                    return Err(Problem::mismatch(why).at(path));
                }
                let compression = *read(&self.compression);
                let refusal = super::compress::dtype_refusal(compression, "load", &m.key, m.dtype);
                if let Some(refusal) = refusal {
                    return Err(Problem::mismatch(refusal.to_string()).at(path));
                }
            }
        }
        Ok(())
    }
}

/// One key of a load, made ready before the ranks agree.
enum Made {
    /// A key the store holds: its value and state, staged for its cell.
    Held(StagedLoad),
    /// A new key: where it lives, its shape, and its cell.
    New(Spread, Shape, HomeValue),
}

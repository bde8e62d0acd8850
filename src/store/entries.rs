//! Checkpoint support: every key's value and updater state copied out to the host, and put
//! back in, all or nothing.

use std::path::Path;
use std::sync::{Arc, RwLockReadGuard, RwLockWriteGuard};

use super::table::{new_slot, place_by_size, Slot};
use super::{copy_home, read, write, KvStore, StoreKind};
use crate::backend::{probe, HomeValue, HostState};
use crate::checkpoint::Problem;
use crate::host::HostData;
use crate::{Device, Key, KeyKind, NDArray, Result, Shape, Updater};

/// A key's value and updater state as host copies: what a checkpoint holds.
pub(crate) struct Entry {
    pub key: Key,
    pub shape: Shape,
    pub value: HostData,
    /// The state kept for the updater in force, if the key has any.
    pub state: Option<EntryState>,
    /// Whether the key is row-sparse.
    pub row_sparse: bool,
    /// Gradient compression's residuals of the key, one per position in a push's list of
    /// values (empty when the key has none).
    pub residuals: Vec<Vec<f32>>,
}

/// Why a checkpoint's key cannot load into the store's `slot` of the same name: one is
/// row-sparse and the other dense. `None` when they agree.
pub(super) fn storage_mismatch(key: &Key, file_sparse: bool, slot: &Slot) -> Option<String> {
    let name = |sparse: bool| if sparse { "row-sparse" } else { "dense" };
    (file_sparse != slot.row_sparse).then(|| {
        format!(
            "key {key}: the file holds it {} but the store holds it {}: load it into a store \
             without this key, or with the key initialized as the file has it",
            name(file_sparse),
            name(slot.row_sparse)
        )
    })
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
        let cells: Vec<RwLockReadGuard<'_, HomeValue>> =
            slots.iter().map(|s| read(&s.cell)).collect();
        let entries = slots
            .iter()
            .zip(&cells)
            .map(|(slot, cell)| {
                let (value, state) = cell.to_host(generation)?;
                // Only state a push of this updater would use: one buffer per state name.
                let state = state.filter(|(_, bufs)| bufs.len() == buffers);
                Ok(Entry {
                    key: slot.key.clone(),
                    shape: slot.shape,
                    value,
                    state: state.map(|(step, bufs)| EntryState { step, bufs }),
                    row_sparse: slot.row_sparse,
                    residuals: slot
                        .residuals
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone(),
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
                if slot.is_none() && e.row_sparse {
                    if let Some(refusal) = self.row_sparse_refusal("load") {
                        return Err(mismatch(format!("key {} is row-sparse: {refusal}", e.key)));
                    }
                }
                if slot.is_none() {
                    let (compression, dtype) = (*read(&self.compression), e.value.dtype());
                    let refusal =
                        super::compress::dtype_refusal(compression, "load", &e.key, dtype);
                    if let Some(refusal) = refusal {
                        return Err(mismatch(refusal.to_string()));
                    }
                }
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
                if let Some(why) = storage_mismatch(&e.key, e.row_sparse, slot) {
                    return Err(mismatch(why));
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
            let mut cells: Vec<RwLockWriteGuard<'_, HomeValue>> =
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
                let arrays: Vec<(NDArray, Entry)> = new
                    .into_iter()
                    .map(|mut e| {
                        let value = std::mem::replace(&mut e.value, HostData::F32(Vec::new()));
                        (NDArray::from_host(value, e.shape, Device::Cpu(0)), e)
                    })
                    .collect();
                let values: Vec<NDArray> = arrays.iter().map(|(a, _)| a.clone()).collect();
                let homes = place_by_size(&mut gpu_bytes, gpus, &values);
                for ((a, e), home) in arrays.into_iter().zip(homes) {
                    let value = copy_home(&a, home, &e.key)?;
                    let cell = loaded_cell(value, e.state, generation)?;
                    let slot = new_slot(e.key, a.shape(), a.dtype(), home, cell);
                    made.push(with_extras(slot, e.row_sparse, e.residuals));
                }
            } else {
                for e in new {
                    let dtype = e.value.dtype();
                    let cell = loaded_cell(HomeValue::from_host(e.value), e.state, generation)?;
                    let slot = new_slot(e.key, e.shape, dtype, Device::Cpu(0), cell);
                    made.push(with_extras(slot, e.row_sparse, e.residuals));
                }
            }

            // Keys the store has: every one staged first (what can fail for want of GPU memory
            // fails here, with no key changed), then changed under their locks, before any new
            // key appears.
            let staged = old
                .into_iter()
                .map(|(place, e)| {
                    let state = host_state(e.state);
                    let staged = cells[place].stage_load(e.value, generation, state)?;
                    Ok((place, staged, e.residuals))
                })
                .collect::<Result<Vec<_>>>()?;
            for (place, staged, residuals) in staged {
                cells[place].commit_load(staged)?;
                // The residuals come with the values they belong to (none in the file: none).
                *have[place]
                    .1
                    .residuals
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = residuals;
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

/// A loaded key's slot with the file's storage kind and residuals.
fn with_extras(mut slot: Slot, row_sparse: bool, residuals: Vec<Vec<f32>>) -> Slot {
    slot.row_sparse = row_sparse;
    slot.residuals = std::sync::Mutex::new(residuals);
    slot
}

/// A checkpoint's state in the backends' form.
fn host_state(state: Option<EntryState>) -> Option<HostState> {
    state.map(|s| (s.step, s.bufs))
}

/// The value of a key a load adds: `value` (on its home) with the loaded state.
fn loaded_cell(
    mut value: HomeValue,
    state: Option<EntryState>,
    generation: u64,
) -> Result<HomeValue> {
    value.set_state(generation, host_state(state))?;
    Ok(value)
}

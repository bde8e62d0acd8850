//! The key table: each key's slot (fixed facts, value behind a lock), and where keys live.

use rustc_hash::FxHashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};

use crate::backend::{HomeValue, KeyFacts};
use crate::comm::Spread;
use crate::{DType, Device, Error, Key, KeyKind, Result, Shape};

/// A key's entry: fixed facts, and the value and state behind the key's lock.
pub(super) struct Slot {
    pub key: Key,
    /// Ascending order of updates: the int key, or a string key's init order.
    pub order: i64,
    /// When the key was initialized: 0 for the store's first key, then 1, 2, ...
    pub init_seq: u64,
    pub shape: Shape,
    pub dtype: DType,
    pub home: Device,
    /// Which ranks hold the value (a dist store); `Whole { rank: 0 }` in a single process.
    pub spread: Spread,
    /// This rank's part of the value (all of it in a single process) and its updater state.
    pub cell: RwLock<HomeValue>,
    /// Where the store keeps copies ([`crate::comm::dist::Buddies`]): the part of the rank
    /// whose copy this rank keeps, with its updater state (empty where that rank holds none of
    /// the key, or no copies are kept). Locked after `cell`, never before.
    pub copy: RwLock<HomeValue>,
    /// Whether `copy` may lag the part it copies: after a push that updated no copies (of
    /// rows), or while a push's updated parts are on their way to the buddies
    /// ([`super::copies::send_parts`]). A heal cannot start from such a copy.
    pub copy_behind: AtomicBool,
    /// A dist store's (generation, update count), kept on every rank, not only the value's.
    pub updates: Mutex<(u64, u64)>,
    /// Compression residuals, one per position in a push's values; written under `cell`'s lock.
    pub residuals: Mutex<Vec<Vec<f32>>>,
    /// Whether the key is pushed by rows (`push_row_sparse`), never as a dense array.
    pub row_sparse: bool,
}

/// A key to add to the table ([`Table::insert`]) with this rank's part of its value.
pub(super) struct NewKey {
    pub key: Key,
    pub shape: Shape,
    pub dtype: DType,
    pub home: Device,
    pub spread: Spread,
    pub row_sparse: bool,
    pub cell: HomeValue,
    /// The copy of the buddy source's part (see [`Slot::copy`]), where one is kept.
    pub copy: Option<HomeValue>,
}

#[derive(Default)]
pub(super) struct Table {
    pub key_kind: Option<KeyKind>,
    pub slots: FxHashMap<Key, Arc<Slot>>,
    pub next_str_order: i64,
    /// The `init_seq` of the next key initialized.
    pub next_init_seq: u64,
    /// Bytes of values homed on each GPU so far (for placement by size).
    pub gpu_bytes: Vec<usize>,
    /// Bytes of values held by each rank so far (a dist store's placement by size).
    pub rank_bytes: Vec<usize>,
}

impl Slot {
    /// A dist store's count of the key's updates under updater `generation`.
    pub(super) fn updates(&self, generation: u64) -> u64 {
        let u = self.updates.lock().unwrap_or_else(|p| p.into_inner());
        if u.0 == generation {
            u.1
        } else {
            0
        }
    }

    /// Sets a dist store's count of the key's updates under updater `generation`.
    pub(super) fn set_updates(&self, generation: u64, count: u64) {
        *self.updates.lock().unwrap_or_else(|p| p.into_inner()) = (generation, count);
    }

    /// The key's fixed facts, for the backends.
    pub(super) fn facts(&self) -> KeyFacts<'_> {
        KeyFacts {
            key: &self.key,
            shape: self.shape,
            dtype: self.dtype,
            home: self.home,
        }
    }
}

impl Table {
    /// Adds checked new keys, in order (string keys' update order and the init order follow).
    pub(super) fn insert(&mut self, keys: impl IntoIterator<Item = NewKey>) {
        for new in keys {
            let order = match &new.key {
                Key::Int(k) => i64::from(*k),
                Key::Str(_) => {
                    self.next_str_order += 1;
                    self.next_str_order
                }
            };
            self.key_kind = Some(new.key.kind());
            let init_seq = self.next_init_seq;
            self.next_init_seq += 1;
            let slot = Slot {
                key: new.key.clone(),
                order,
                init_seq,
                shape: new.shape,
                dtype: new.dtype,
                home: new.home,
                spread: new.spread,
                cell: RwLock::new(new.cell),
                copy: RwLock::new(new.copy.unwrap_or_else(|| {
                    HomeValue::from_host(crate::host::HostData::filled(new.dtype, 0, 0.0))
                })),
                copy_behind: AtomicBool::new(false),
                updates: Mutex::new((0, 0)),
                residuals: Mutex::new(Vec::new()),
                row_sparse: new.row_sparse,
            };
            self.slots.insert(new.key, Arc::new(slot));
        }
    }

    pub(super) fn check_kind(&self, op: &'static str, key: &Key) -> Result<()> {
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

    pub(super) fn get(&self, op: &'static str, key: &Key) -> Result<Arc<Slot>> {
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

/// The one placement rule, for GPUs and ranks: items of `(bytes, sliced)`, largest first, each
/// whole one into the bin with the fewest bytes (ties to the lowest), a sliced one (`None`)
/// adding its share to every bin. `loads` carries over between inits; every rank agrees.
fn balance(loads: &mut Vec<usize>, bins: usize, items: &[(usize, bool)]) -> Vec<Option<usize>> {
    let bins = bins.max(1);
    loads.resize(bins, 0);
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(items[i].0));
    let mut placed = vec![None; items.len()];
    for i in order {
        let (size, sliced) = items[i];
        if sliced {
            let share = size.div_ceil(bins);
            loads.iter_mut().for_each(|b| *b += share);
        } else {
            let bin = (0..bins).min_by_key(|&b| (loads[b], b)).unwrap_or(0);
            loads[bin] += size;
            placed[i] = Some(bin);
        }
    }
    placed
}

/// Homes for keys of a `device`/`nccl` init, by [`balance`] over the GPUs (MXNet's CommDevice).
pub(super) fn place_by_size(bytes: &mut Vec<usize>, gpus: usize, sizes: &[usize]) -> Vec<Device> {
    let items: Vec<(usize, bool)> = sizes.iter().map(|&b| (b, false)).collect();
    balance(bytes, gpus, &items)
        .into_iter()
        .map(|g| Device::Gpu(g.unwrap_or(0)))
        .collect()
}

/// Where the keys of a dist store's init live, by [`balance`] over the ranks.
pub(super) fn place_on_ranks(
    bytes: &mut Vec<usize>,
    ranks: usize,
    keys: &[(usize, bool)],
) -> Vec<Spread> {
    balance(bytes, ranks, keys)
        .into_iter()
        .map(|r| match r {
            Some(rank) => Spread::Whole { rank },
            None => Spread::Sliced,
        })
        .collect()
}

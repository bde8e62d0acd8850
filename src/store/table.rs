//! The key table: each key's slot (its fixed facts, and its value behind a lock), key order,
//! and where new keys are homed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use crate::backend::{HomeValue, KeyFacts};
use crate::comm::Spread;
use crate::{DType, Device, Error, Key, KeyKind, NDArray, Result, Shape};

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
    /// A dist store's count of the key's updates under an updater generation, kept on every
    /// rank (the step lives only where the value does): (generation, count).
    pub updates: Mutex<(u64, u64)>,
}

#[derive(Default)]
pub(super) struct Table {
    pub key_kind: Option<KeyKind>,
    pub slots: HashMap<Key, Arc<Slot>>,
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
    pub fn updates(&self, generation: u64) -> u64 {
        let u = self.updates.lock().unwrap_or_else(|p| p.into_inner());
        if u.0 == generation {
            u.1
        } else {
            0
        }
    }

    /// Sets a dist store's count of the key's updates under updater `generation`.
    pub fn set_updates(&self, generation: u64, count: u64) {
        *self.updates.lock().unwrap_or_else(|p| p.into_inner()) = (generation, count);
    }

    /// The key's fixed facts, for the backends.
    pub fn facts(&self) -> KeyFacts<'_> {
        KeyFacts {
            key: &self.key,
            shape: self.shape,
            dtype: self.dtype,
            home: self.home,
        }
    }
}

impl Table {
    pub fn check_kind(&self, op: &'static str, key: &Key) -> Result<()> {
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

    pub fn get(&self, op: &'static str, key: &Key) -> Result<Arc<Slot>> {
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

/// The slot of a key a load adds; its update order (string keys) and init order are set when
/// it is added.
pub(super) fn new_slot(
    key: Key,
    shape: Shape,
    dtype: DType,
    home: Device,
    cell: HomeValue,
) -> Slot {
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
        spread: Spread::Whole { rank: 0 },
        cell: RwLock::new(cell),
        updates: Mutex::new((0, 0)),
    }
}

/// Homes for keys of a `device`/`nccl` init: largest value first, each to the GPU with the
/// fewest bytes so far (MXNet's CommDevice placement). Ties go to the lowest ordinal.
pub(super) fn place_by_size(
    bytes: &mut Vec<usize>,
    gpus: usize,
    values: &[NDArray],
) -> Vec<Device> {
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

/// Where the keys of a dist store's init live, given each key's bytes and whether it is sliced:
/// largest first, each whole key on the rank holding the fewest bytes so far (ties to the
/// lowest rank); a sliced key adds its share to every rank. Every rank computes the same.
pub(super) fn place_on_ranks(
    bytes: &mut Vec<usize>,
    ranks: usize,
    keys: &[(usize, bool)],
) -> Vec<Spread> {
    bytes.resize(ranks, 0);
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(keys[i].0));
    let mut spreads = vec![Spread::Whole { rank: 0 }; keys.len()];
    for i in order {
        let (size, sliced) = keys[i];
        if sliced {
            let share = size.div_ceil(ranks.max(1));
            bytes.iter_mut().for_each(|b| *b += share);
            spreads[i] = Spread::Sliced;
        } else {
            let r = (0..ranks).min_by_key(|&r| (bytes[r], r)).unwrap_or(0);
            bytes[r] += size;
            spreads[i] = Spread::Whole { rank: r };
        }
    }
    spreads
}

//! Pushes on host memory: the fused sum and update of a key with a built-in updater, and a
//! closure updater run on a copy. The mirror of `cuda::push`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::RwLockReadGuard;

use super::state::State;
use super::{Few, PushJob};
use crate::backend::KeyFacts;
use crate::host::{with_host, HostData};
use crate::ndarray::Storage;
use crate::updater::{Hyper, UpdateFn};
use crate::{Device, Element, Error, NDArray, Result, Updater};

/// The fused sum and update of one key.
#[allow(clippy::too_many_arguments)] // the key's parts, as the store held them together
pub(crate) fn push_fused<T: Element>(
    updater: &Updater,
    generation: u64,
    par_min_bytes: usize,
    hyper: Hyper,
    reads: &ReadSet<'_>,
    arrays: &[&NDArray],
    stored: &mut [T],
    state: &mut Option<State>,
) {
    let names = updater.state_names();
    // State is used only when it is this updater's and has its shape: one accumulator buffer
    // of the value's length per state name. Anything else (a race, a bad checkpoint) would
    // hand the kernel a short buffer; it starts afresh instead.
    let acc = <T::Acc as Element>::DTYPE;
    let current = matches!(state, Some(s) if s.generation == generation
        && s.bufs.len() == names.len()
        && s.bufs.iter().all(|b| b.dtype() == acc && b.len() == stored.len()));
    let state = match state {
        Some(s) if current => s,
        _ => state.insert(State {
            generation,
            step: 0,
            bufs: names
                .iter()
                .map(|_| HostData::filled(<T::Acc as Element>::DTYPE, stored.len(), 0.0))
                .collect(),
        }),
    };
    state.step += 1;
    let rule = updater
        .rule_with::<T::Acc>(state.step, hyper)
        .expect("custom updaters take the other path");
    let values: Few<&[T]> = arrays
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
    super::push(job, &rule, par_min_bytes);
}

/// Runs a closure updater on a copy of the stored value of `key`; returns the new value.
pub(crate) fn push_closure(
    f: &UpdateFn,
    par_min_bytes: usize,
    key: &KeyFacts<'_>,
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
            super::sum_into(&values, &mut sum, par_min_bytes);
            T::wrap(sum)
        })
    };
    // The closure sees host arrays: for a GPU home they are host copies on cpu(0).
    let device = if key.home.is_gpu() {
        Device::Cpu(0)
    } else {
        key.home
    };
    let merged = NDArray::from_host(merged, key.shape, device);
    let mut stored = NDArray::from_host(value.clone(), key.shape, device);
    catch_unwind(AssertUnwindSafe(|| f(key.key, &merged, &mut stored)))
        .map_err(|panic| Error::UpdaterPanicked {
            key: key.key.clone(),
            message: crate::error::panic_message(panic.as_ref()),
        })?
        .map_err(|source| Error::UpdaterFailed {
            key: key.key.clone(),
            source,
        })?;
    let what = "the updater's result".to_owned();
    if stored.shape() != key.shape {
        return Err(Error::ShapeMismatch {
            op: "push",
            key: key.key.clone(),
            what,
            expected: Box::new(key.shape),
            got: Box::new(stored.shape()),
        });
    }
    if stored.dtype() != key.dtype {
        return Err(Error::DTypeMismatch {
            op: "push",
            key: key.key.clone(),
            what,
            expected: key.dtype,
            got: stored.dtype(),
        });
    }
    stored.into_host()
}

/// Read locks on a set of arrays, each taken once, in address order. Arrays on a GPU are
/// copied to the host instead (the host path of a push).
pub(crate) struct ReadSet<'a> {
    guards: Few<(usize, Held<'a>)>,
}

enum Held<'a> {
    Lock(RwLockReadGuard<'a, Storage>),
    Copy(HostData),
}

impl<'a> ReadSet<'a> {
    pub fn lock(arrays: &[&'a NDArray]) -> Result<ReadSet<'a>> {
        let mut uniq: Few<&NDArray> = arrays.iter().copied().collect();
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

    pub fn host(&self, a: &NDArray) -> &HostData {
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

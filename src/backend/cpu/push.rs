//! Pushes on host memory: a built-in updater's fused sum and update, a closure's on a copy.

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
    let state = current_state::<T>(updater, generation, stored.len(), state);
    state.step += 1;
    let rule = updater
        .rule_with::<T::Acc>(state.step, hyper)
        .expect("custom updaters take the other path");
    let values = reads.slices(arrays);
    let mut bufs = state.bufs.iter_mut().map(|b| {
        <T::Acc as Element>::slice_mut(b).expect("state is kept in the accumulator dtype")
    });
    let s0 = bufs.next().unwrap_or_default();
    let s1 = bufs.next().unwrap_or_default();
    super::push(PushJob::new(values, stored, [s0, s1]), &rule, par_min_bytes);
}

/// `updater`'s state (of set_updater call `generation`): an accumulator buffer of `len` per
/// state name. Anything else (a race, a bad checkpoint) would be a short buffer: start afresh.
fn current_state<'s, T: Element>(
    updater: &Updater,
    generation: u64,
    len: usize,
    state: &'s mut Option<State>,
) -> &'s mut State {
    let names = updater.state_names();
    let acc = <T::Acc as Element>::DTYPE;
    let current = matches!(state, Some(s) if s.generation == generation
        && s.bufs.len() == names.len()
        && s.bufs.iter().all(|b| b.dtype() == acc && b.len() == len));
    if !current {
        *state = None;
    }
    state.get_or_insert_with(|| State {
        generation,
        step: 0,
        bufs: names
            .iter()
            .map(|_| HostData::filled(acc, len, 0.0))
            .collect(),
    })
}

/// A push that assigns one value whole ([`Updater::Assign`], a dtype whose assignment is a
/// copy) by swapping that value's buffer, of the same capacity, with `stored`: for a push's own
/// totals, never a caller's array. Returns whether it did; `false` changes nothing.
pub(crate) fn take_assigned(
    updater: &Updater,
    generation: u64,
    values: &[&NDArray],
    stored: &mut HostData,
    state: &mut Option<State>,
) -> bool {
    let ([value], Updater::Assign) = (values, updater) else {
        return false;
    };
    if !super::assign_is_copy(stored.dtype()) {
        return false;
    }
    let mut storage = value.write();
    let Storage::Host(total) = &mut *storage else {
        return false;
    };
    if total.dtype() != stored.dtype()
        || total.len() != stored.len()
        || total.capacity() != stored.capacity()
    {
        return false;
    }
    std::mem::swap(total, stored);
    with_host!(stored, v: T => current_state::<T>(updater, generation, v.len(), state).step += 1);
    true
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
            let values = reads.slices::<T>(arrays);
            let mut sum = v.clone();
            super::sum_into(&values, &mut sum, par_min_bytes);
            T::wrap(sum)
        })
    };
    // The closure sees host arrays: for a GPU home they are host copies on cpu(0).
    let device = Some(key.home)
        .filter(|d| !d.is_gpu())
        .unwrap_or(Device::Cpu(0));
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
    let (what, dtype) = ("the updater's result", Some(key.dtype));
    Error::check_fit("push", key.key, what, key.shape, dtype, &stored)?;
    stored.into_host()
}

/// Read locks on arrays, each taken once, in address order; GPU arrays are copied instead.
pub(crate) struct ReadSet<'a> {
    guards: Few<(usize, Held<'a>)>,
}

enum Held<'a> {
    Lock(RwLockReadGuard<'a, Storage>),
    Copy(HostData),
}

impl<'a> ReadSet<'a> {
    pub(crate) fn lock(arrays: &[&'a NDArray]) -> Result<ReadSet<'a>> {
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

    /// The elements of each of `arrays` (all locked here, all of dtype `T`).
    pub(crate) fn slices<T: Element>(&self, arrays: &[&NDArray]) -> Few<&[T]> {
        let slice = |a: &&NDArray| T::slice(self.host(a)).expect("value dtypes were checked");
        arrays.iter().map(slice).collect()
    }

    pub(crate) fn host(&self, a: &NDArray) -> &HostData {
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

#[cfg(test)]
mod tests {
    use half::f16;
    use rand::Rng;

    use super::*;
    use crate::updater::Sgd;

    fn random(n: usize) -> Vec<f32> {
        let mut rng = rand::thread_rng();
        (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
    }

    fn array(h: HostData) -> NDArray {
        let n = h.len();
        NDArray::from_host(h, crate::Shape::new(&[n]).unwrap(), crate::cpu(0))
    }

    #[test]
    fn an_assigned_total_is_taken_and_the_old_value_left_in_its_place() {
        let (old, new) = (random(1000), random(1000));
        let total = array(HostData::F32(new.clone()));
        let mut stored = HostData::F32(old.clone());
        let mut state = None;
        assert!(take_assigned(
            &Updater::Assign,
            3,
            &[&total],
            &mut stored,
            &mut state
        ));
        assert_eq!(stored, HostData::F32(new));
        assert_eq!(total.to_vec::<f32>().unwrap(), old);
        let state = state.expect("the step is counted, as a copy counts it");
        assert_eq!((state.generation, state.step), (3, 1));
    }

    #[test]
    fn a_total_is_copied_not_taken_unless_it_is_one_assigned_f32_or_f64_of_the_same_room() {
        let old = random(1000);
        let same = || array(HostData::F32(random(1000)));
        let mut bigger = random(1000);
        bigger.reserve_exact(1000);
        let cases: Vec<(Updater, Vec<NDArray>)> = vec![
            (Updater::Sgd(Sgd::default()), vec![same()]),
            (Updater::Assign, vec![same(), same()]),
            (Updater::Assign, vec![array(HostData::F32(bigger))]),
            (Updater::Assign, vec![array(HostData::F32(random(999)))]),
        ];
        for (updater, values) in cases {
            let before: Vec<Vec<f32>> = values.iter().map(|v| v.to_vec().unwrap()).collect();
            let refs: Vec<&NDArray> = values.iter().collect();
            let mut stored = HostData::F32(old.clone());
            let mut state = None;
            assert!(!take_assigned(&updater, 1, &refs, &mut stored, &mut state));
            assert_eq!(stored, HostData::F32(old.clone()));
            assert!(state.is_none());
            let after: Vec<Vec<f32>> = values.iter().map(|v| v.to_vec().unwrap()).collect();
            assert_eq!(after, before);
        }
        // float16 assigns through its accumulator, so it is never taken.
        let halves = |v: Vec<f32>| HostData::F16(v.into_iter().map(f16::from_f32).collect());
        let total = array(halves(random(1000)));
        let mut stored = halves(old);
        let kept = stored.clone();
        assert!(!take_assigned(
            &Updater::Assign,
            1,
            &[&total],
            &mut stored,
            &mut None
        ));
        assert_eq!(stored, kept);
    }
}

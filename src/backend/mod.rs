//! Backend: where a key's value lives, and the loops and launches that sum, update and copy it.
//!
//! - [`cpu`]: fused loops over host memory; the fallback for every store kind.
//! - [`cuda`]: the GPU runtime and the push and pull of keys homed on a GPU.
//! - [`probe`]: which GPUs this process can use, found without panicking.
//!
//! [`HomeValue`] (a key's value and updater state, in host memory or on a GPU), [`push`] and
//! [`pull`] are the only place that matches on where a value lives. This layer imports nothing
//! from `store` or `comm`.

pub mod cpu;
pub(crate) mod cuda;
pub mod probe;

use std::borrow::Cow;
use std::ops::Range;

use cpu::push::{push_fused, ReadSet};
use cpu::state::State;
use cuda::pull::PullJob;
use cuda::push::PushJob;
use cuda::state::GpuCell;
use cuda::{has_kernel, CrossGpu};

use crate::host::{with_host, HostData};
use crate::ndarray::Storage;
use crate::updater::Hyper;
use crate::{DType, Device, Error, Key, NDArray, PtxUpdater, Result, Shape, Updater};

/// A key's fixed facts, as the backends need them.
pub(crate) struct KeyFacts<'a> {
    pub key: &'a Key,
    pub shape: Shape,
    pub dtype: DType,
    pub home: Device,
}

/// A key's stored value and updater state, on the key's home.
pub(crate) struct HomeValue {
    place: Place,
    /// Host updater state (host homes, and the host round trip of f64 keys on a GPU).
    state: Option<State>,
}

/// Where a key's value lives: host memory, or its home GPU (with the GPU updater state).
enum Place {
    Host(HostData),
    Gpu(GpuCell),
}

/// A checkpoint's form of updater state: the step count and one host buffer per state name.
pub(crate) type HostState = (u64, Vec<HostData>);

/// A checkpoint's value and updater state made ready for one cell ([`HomeValue::stage_load`]).
pub(crate) struct StagedLoad {
    value: HostData,
    state: StagedState,
}

/// Where a [`StagedLoad`]'s state goes: the cell's host state, or its GPU state.
enum StagedState {
    Host(Option<State>),
    Gpu(cuda::state::StagedState),
}

/// A checkpoint's state as host state of updater `generation`.
fn host_state(generation: u64, state: Option<HostState>) -> Option<State> {
    state.map(|(step, bufs)| State {
        generation,
        step,
        bufs,
    })
}

impl HomeValue {
    /// A value in host memory, with no updater state yet.
    pub(crate) fn from_host(value: HostData) -> HomeValue {
        HomeValue {
            place: Place::Host(value),
            state: None,
        }
    }

    /// A copy of `value` for a key homed on `home`, with no updater state yet.
    pub(crate) fn copy_of(value: &NDArray, home: Device) -> Result<HomeValue> {
        let storage = value.read();
        let place = match (home, &*storage) {
            (Device::Cpu(_), s) => Place::Host(s.host()?.into_owned()),
            (Device::Gpu(i), Storage::Gpu(b)) => Place::Gpu(GpuCell::new(b.copy_to(i)?)),
            (Device::Gpu(i), Storage::Host(h)) => {
                Place::Gpu(GpuCell::new(cuda::GpuBuf::upload(i, h)?))
            }
        };
        Ok(HomeValue { place, state: None })
    }

    /// `value` kept for a key homed on `home`, with no updater state yet: its storage moved in
    /// where `value` is its only handle and already on `home`, copied otherwise.
    pub(crate) fn from_array(value: NDArray, home: Device) -> Result<HomeValue> {
        // Every cpu(i) is host memory.
        let in_place = home == value.device() || !(home.is_gpu() || value.device().is_gpu());
        if !in_place {
            return HomeValue::copy_of(&value, home);
        }
        match value.into_storage() {
            Ok(Storage::Host(h)) => Ok(HomeValue::from_host(h)),
            Ok(Storage::Gpu(b)) => Ok(HomeValue {
                place: Place::Gpu(GpuCell::new(b)),
                state: None,
            }),
            Err(shared) => HomeValue::copy_of(&shared, home),
        }
    }

    /// Whether the value lives on a GPU.
    pub(crate) fn is_gpu(&self) -> bool {
        matches!(self.place, Place::Gpu(_))
    }

    /// The key's step under updater `generation`: `None` when it has no state for it.
    pub(crate) fn step(&self, generation: u64) -> Option<u64> {
        let host = self.host_state_of(generation).map(|s| s.step);
        match &self.place {
            Place::Gpu(c) => c.step(generation).or(host),
            Place::Host(_) => host,
        }
    }

    /// The host updater state, when it is updater `generation`'s.
    fn host_state_of(&self, generation: u64) -> Option<&State> {
        self.state.as_ref().filter(|s| s.generation == generation)
    }

    /// Host copies of the value and of its state for updater `generation` (for checkpoints).
    pub(crate) fn to_host(&self, generation: u64) -> Result<(HostData, Option<HostState>)> {
        let host_state = || {
            self.host_state_of(generation)
                .map(|s| (s.step, s.bufs.clone()))
        };
        Ok(match &self.place {
            Place::Host(h) => (h.clone(), host_state()),
            Place::Gpu(c) if has_kernel(c.buf.dtype()) => {
                (c.buf.download()?, c.state_to_host(generation)?)
            }
            // Kernel-less dtypes keep their state on the host.
            Place::Gpu(c) => (c.buf.download()?, host_state()),
        })
    }

    /// Replaces the updater state with a checkpoint's, as state of updater `generation`.
    pub(crate) fn set_state(&mut self, generation: u64, state: Option<HostState>) -> Result<()> {
        let staged = self.stage_state(generation, state)?;
        self.commit_state(staged)
    }

    /// A checkpoint's state made ready for this cell, on its GPU or in host memory.
    fn stage_state(&self, generation: u64, state: Option<HostState>) -> Result<StagedState> {
        Ok(match &self.place {
            Place::Gpu(c) if has_kernel(c.buf.dtype()) => {
                StagedState::Gpu(c.stage_state(generation, state)?)
            }
            _ => StagedState::Host(host_state(generation, state)),
        })
    }

    /// Puts in a state staged by [`HomeValue::stage_state`]; allocates nothing.
    fn commit_state(&mut self, staged: StagedState) -> Result<()> {
        match (staged, &mut self.place) {
            (StagedState::Gpu(s), Place::Gpu(c)) => c.commit_state(s),
            (StagedState::Host(s), _) => {
                self.state = s;
                Ok(())
            }
            (StagedState::Gpu(_), Place::Host(_)) => Err(Error::Internal {
                op: "updater state",
                message: "a GPU state staged for a value in host memory".to_owned(),
            }),
        }
    }

    /// Makes a checkpoint's value and state (of updater `generation`) ready to replace this
    /// cell's: what can fail for want of memory fails here, not in [`HomeValue::commit_load`].
    pub(crate) fn stage_load(
        &self,
        value: HostData,
        generation: u64,
        state: Option<HostState>,
    ) -> Result<StagedLoad> {
        if let Place::Gpu(c) = &self.place {
            if value.len() != c.buf.len() {
                return Err(Error::Internal {
                    op: "load",
                    message: format!("{} elements for a value of {}", value.len(), c.buf.len()),
                });
            }
        }
        let state = self.stage_state(generation, state)?;
        Ok(StagedLoad { value, state })
    }

    /// Puts in a load staged by [`HomeValue::stage_load`]; fails only where the GPU does.
    pub(crate) fn commit_load(&mut self, staged: StagedLoad) -> Result<()> {
        self.replace_value(staged.value)?;
        self.commit_state(staged.state)
    }

    /// The value in host memory: borrowed from a host home, copied from a GPU.
    pub(crate) fn value_to_host(&self) -> Result<Cow<'_, HostData>> {
        Ok(match &self.place {
            Place::Host(h) => Cow::Borrowed(h),
            Place::Gpu(c) => Cow::Owned(c.buf.download()?),
        })
    }

    /// The value as an array of `shape`, where it lives; the updater state is dropped.
    pub(crate) fn into_array(self, shape: Shape) -> NDArray {
        match self.place {
            Place::Host(h) => NDArray::from_host(h, shape, Device::Cpu(0)),
            Place::Gpu(c) => NDArray::from_gpu(c.buf, shape),
        }
    }

    /// The value in host memory, taken out of the home (copied from a GPU).
    pub(crate) fn into_host(self) -> Result<HostData> {
        match self.place {
            Place::Host(h) => Ok(h),
            Place::Gpu(c) => c.buf.download(),
        }
    }

    /// A copy of the value as an array of `shape`, where the value lives.
    pub(crate) fn to_array(&self, shape: Shape) -> Result<NDArray> {
        Ok(match &self.place {
            Place::Host(h) => NDArray::from_host(h.clone(), shape, Device::Cpu(0)),
            Place::Gpu(c) => NDArray::from_gpu(c.buf.copy_to(c.buf.ordinal())?, shape),
        })
    }

    /// Replaces the value (a closure updater's result), keeping the updater state.
    pub(crate) fn replace_value(&mut self, value: HostData) -> Result<()> {
        match &mut self.place {
            Place::Host(h) => *h = value,
            Place::Gpu(c) => c.buf.upload_into(&value)?,
        }
        Ok(())
    }

    /// Elements `segs` of the value and of its state for `generation`, as a host value of
    /// their own: the rows a row-sparse push updates, given back by [`HomeValue::scatter`].
    pub(crate) fn gather(&self, generation: u64, segs: &[Range<usize>]) -> Result<HomeValue> {
        // A host home is read in place (its state too: only the rows are copied).
        let downloaded;
        let (value, state): (&HostData, Option<(u64, &[HostData])>) = match &self.place {
            Place::Host(h) => {
                let state = self.host_state_of(generation);
                (h, state.map(|s| (s.step, s.bufs.as_slice())))
            }
            Place::Gpu(_) => {
                downloaded = self.to_host(generation)?;
                let state = (downloaded.1.as_ref()).map(|(step, bufs)| (*step, bufs.as_slice()));
                (&downloaded.0, state)
            }
        };
        let n = value.len();
        // State of another length (a race, a bad checkpoint) is not this value's: start afresh.
        let state = state
            .filter(|(_, bufs)| bufs.iter().all(|b| b.len() == n))
            .map(|(step, bufs)| State {
                generation,
                step,
                bufs: bufs.iter().map(|b| cpu::rows::gather(b, segs)).collect(),
            });
        Ok(HomeValue {
            place: Place::Host(cpu::rows::gather(value, segs)),
            state,
        })
    }

    /// `compact`, a [`HomeValue::gather`] of `segs` after its update, written back into `segs`
    /// of the value and its state (state the value lacked is zero elsewhere); `clear`: the rest
    /// of the value is zeroed first (an assign). Nothing changes until [`Scattered::commit`],
    /// which cannot fail, so a push of several keys changes none until all are ready.
    pub(crate) fn scatter(
        &self,
        generation: u64,
        segs: Vec<Range<usize>>,
        compact: HomeValue,
        clear: bool,
    ) -> Result<Scattered> {
        let HomeValue {
            place: Place::Host(rows),
            state: rows_state,
        } = compact
        else {
            return Err(Error::Internal {
                op: "push",
                message: "a row-sparse update's rows were not in host memory".to_owned(),
            });
        };
        let Place::Gpu(c) = &self.place else {
            return Ok(Scattered::Host {
                segs,
                rows,
                rows_state,
                clear,
                generation,
            });
        };
        let (mut value, state) = self.to_host(generation)?;
        let state = host_state(generation, state);
        write_rows(&mut value, &segs, &rows, clear);
        let state = merge_state(state, rows_state, &segs, value.len(), generation);
        let shape = Shape::new(&[value.len()])?;
        let array = NDArray::from_host(value, shape, Device::Cpu(0));
        let mut fresh = HomeValue::copy_of(&array, Device::Gpu(c.buf.ordinal()))?;
        fresh.set_state(generation, state.map(|s| (s.step, s.bufs)))?;
        Ok(Scattered::Gpu(fresh))
    }

    /// Sets the host updater state as it is, unchecked (tests of state of the wrong shape).
    #[cfg(test)]
    pub(crate) fn set_host_state(&mut self, generation: u64, step: u64, bufs: Vec<HostData>) {
        self.state = Some(State {
            generation,
            step,
            bufs,
        });
    }
}

/// A row-sparse update ready to go into its value: [`Scattered::commit`] puts it there.
pub(crate) enum Scattered {
    /// Rows to write into a host home's value and state, in place.
    Host {
        segs: Vec<Range<usize>>,
        rows: HostData,
        rows_state: Option<State>,
        clear: bool,
        generation: u64,
    },
    /// A GPU home's new value, complete on its GPU.
    Gpu(HomeValue),
}

impl Scattered {
    /// Puts the update into `home` (the value it was made from); cannot fail.
    pub(crate) fn commit(self, home: &mut HomeValue) {
        match self {
            Scattered::Gpu(fresh) => *home = fresh,
            Scattered::Host {
                segs,
                rows,
                rows_state,
                clear,
                generation,
            } => {
                let HomeValue { place, state } = home;
                let Place::Host(value) = place else {
                    unreachable!("a host update is made from a host home")
                };
                write_rows(value, &segs, &rows, clear);
                *state = merge_state(state.take(), rows_state, &segs, value.len(), generation);
            }
        }
    }
}

/// Writes `rows` into `segs` of `value`, after zeroing it when `clear` (an assign).
fn write_rows(value: &mut HostData, segs: &[Range<usize>], rows: &HostData, clear: bool) {
    if clear {
        *value = HostData::filled(value.dtype(), value.len(), 0.0);
    }
    cpu::rows::scatter(rows, segs, value);
}

/// The state of a value of `len` elements after a row-sparse update: `old`, with `rows` (the
/// updated state of elements `segs`) written into it, and `rows`' step. State `old` lacks, or
/// that is not of `generation` and this shape, starts at zero.
fn merge_state(
    old: Option<State>,
    rows: Option<State>,
    segs: &[Range<usize>],
    len: usize,
    generation: u64,
) -> Option<State> {
    let Some(rows) = rows else {
        return old;
    };
    let fits = |s: &State| {
        s.generation == generation
            && s.bufs.len() == rows.bufs.len()
            && (s.bufs.iter().zip(&rows.bufs))
                .all(|(b, r)| b.len() == len && b.dtype() == r.dtype())
    };
    let mut bufs = match old.filter(fits) {
        Some(s) => s.bufs,
        None => (rows.bufs.iter())
            .map(|r| HostData::filled(r.dtype(), len, 0.0))
            .collect(),
    };
    for (b, r) in bufs.iter_mut().zip(&rows.bufs) {
        cpu::rows::scatter(r, segs, b);
    }
    Some(State {
        generation,
        step: rows.step,
        bufs,
    })
}

/// Waits for the work queued on `home`'s GPU, so an error it latched (a failed kernel) is
/// reported now, not by the next copy; nothing for a host home.
pub(crate) fn settle(home: Device) -> Result<()> {
    match home {
        Device::Gpu(i) => cuda::host_wait(cuda::gpu(i)?),
        Device::Cpu(_) => Ok(()),
    }
}

/// Loads a user PTX updater on `home` (when it is a GPU), so a broken module fails a push
/// before anything changes.
pub(crate) fn load_user_kernel(p: &PtxUpdater, home: Device) -> Result<()> {
    if let Device::Gpu(d) = home {
        cuda::gpu(d)?.user_function(p)?;
    }
    Ok(())
}

/// One key of a push with a built-in or PTX updater, on its home.
pub(crate) struct HomePush<'a> {
    pub key: &'a Key,
    pub value: &'a mut HomeValue,
    pub values: &'a [&'a NDArray],
    /// The learning rate and weight decay of this key in this push (built-in rules).
    pub hyper: Hyper,
    /// Whether the push may take a value assigned whole instead of copying it: given only for
    /// the push's own arrays (totals across ranks), never the caller's.
    pub owned: bool,
}

/// Applies a validated push with a built-in or PTX updater (PTX: GPU homes only) to `jobs`, in
/// order: host homes at once; GPU homes enqueued together ([`cuda::push`]), except dtypes
/// without a kernel (`float64`), updated on a host copy. `between`: how sums travel between GPUs.
pub(crate) fn push(
    updater: &Updater,
    generation: u64,
    between: &dyn CrossGpu,
    par_min_bytes: usize,
    jobs: Vec<HomePush<'_>>,
) -> Result<()> {
    let mut gpu_jobs = Vec::new();
    for job in jobs {
        let HomeValue { place, state } = job.value;
        match place {
            Place::Host(value) => {
                if job.owned
                    && cpu::push::take_assigned(updater, generation, job.values, value, state)
                {
                    continue;
                }
                let reads = ReadSet::lock(job.values)?;
                with_host!(value, stored: T => push_fused::<T>(updater, generation, par_min_bytes, job.hyper, &reads, job.values, stored, state));
            }
            Place::Gpu(c) => {
                if has_kernel(c.buf.dtype()) {
                    gpu_jobs.push(PushJob {
                        key: job.key,
                        cell: c,
                        values: job.values,
                        hyper: job.hyper,
                    });
                    continue;
                }
                // Slow path: no kernel for this dtype; update a host copy and copy it back.
                let reads = ReadSet::lock(job.values)?;
                let mut value = c.buf.download()?;
                with_host!(&mut value, stored: T => push_fused::<T>(updater, generation, par_min_bytes, job.hyper, &reads, job.values, stored, state));
                c.buf.upload_into(&value)?;
            }
        }
    }
    if !gpu_jobs.is_empty() {
        cuda::push::push(updater, generation, between, gpu_jobs)?;
    }
    Ok(())
}

/// One key of a pull from its home.
pub(crate) struct HomePull<'a> {
    pub key: &'a Key,
    pub value: &'a HomeValue,
    /// The key's elements of a host `value` that several keys share (a dist pull receives
    /// small keys packed into one buffer); `None`: all of it.
    pub part: Option<std::ops::Range<usize>>,
    pub outs: &'a [&'a NDArray],
}

/// Copies every job's value into its outs, in order: host homes at once, GPU homes enqueued
/// together ([`cuda::pull`]).
pub(crate) fn pull(
    between: &dyn CrossGpu,
    par_min_bytes: usize,
    jobs: &[HomePull<'_>],
) -> Result<()> {
    let mut gpu_jobs = Vec::new();
    for job in jobs {
        match &job.value.place {
            Place::Host(h) => cpu::pull::pull_into(h, job.part.clone(), job.outs, par_min_bytes)?,
            Place::Gpu(_) if job.part.is_some() => {
                return Err(Error::internal("a GPU value shared by several keys"))
            }
            Place::Gpu(c) => gpu_jobs.push(PullJob {
                key: job.key,
                cell: c,
                outs: job.outs,
            }),
        }
    }
    if gpu_jobs.is_empty() {
        return Ok(());
    }
    cuda::pull::pull(between, &gpu_jobs)
}

//! Comm: moving sums and copies between places, and the update of a push's keys.
//!
//! In this process ([`update`], [`pull`], [`local_sum`]): a push's values are summed onto each
//! key's home, then the updater runs there (fused with the sum where the backend can); a pull
//! copies the home's value into every out.
//!
//! - `local`: sums and copies between this process's GPUs (NCCL or peer copies).
//! - `dist`: the across-ranks plans of `dist_*` stores and the pool of transfer buffers;
//!   `spread`: which ranks hold a key.
//! - `link`: the link between ranks, a file per transport; `fingerprint`: what ranks compare;
//!   `points`: where the survivors of a lost rank agree, call by call.
//! - [`launch`]: what a launcher says through the environment (rank, size, timeout).
//! - [`nccl`]: communicators per device set, grouped collectives, error polling, abort.
//! - `mpi` (cargo feature `mpi`): CPU ranks: bootstrap, bounded non-blocking collectives,
//!   poisoning and the exit hook.
//!
//! It imports `backend` (memory, streams, kernels) and nothing from `store`.

pub(crate) mod dist;
pub(crate) mod fingerprint;
pub(crate) mod launch;
pub(crate) mod link;
mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod nccl;
#[cfg(any(feature = "mpi", test))]
pub(crate) mod points;
mod spread;

pub(crate) use spread::Spread;

use crate::backend::cpu::push::push_closure;
use crate::backend::probe;
use crate::backend::{self, HomePull, HomePush, HomeValue, KeyFacts};
use crate::host::HostData;
use crate::updater::{Hyper, UpdateFn};
use crate::{DType, Device, Error, NDArray, PtxUpdater, Result, Updater};
use local::GpuLinks;

/// How a store's calls run: over NCCL or not, and from what size host loops split over threads.
#[derive(Clone, Copy)]
pub(crate) struct Ctx {
    pub use_nccl: bool,
    pub par_min_bytes: usize,
}

impl Ctx {
    /// How a store's calls run; without a usable NCCL a `nccl` store warns once (peer copies).
    pub(crate) fn new(nccl_asked: bool, par_min_bytes: usize) -> Ctx {
        let use_nccl = nccl_asked && probe::gpu_count() > 0 && {
            let found = nccl::available();
            if !found {
                nccl::warn_unavailable();
            }
            found
        };
        Ctx {
            use_nccl,
            par_min_bytes,
        }
    }

    /// How this call moves data between this process's GPUs.
    fn links(&self) -> GpuLinks {
        GpuLinks {
            use_nccl: self.use_nccl,
        }
    }
}

/// Builds the NCCL communicators a call on `keys` will need (one per set of a GPU home and its
/// arrays' GPUs) before the store takes any key lock: building one can block, and nothing may
/// block under a lock the watchdog or another call waits on.
pub(crate) fn prepare<'k>(
    ctx: Ctx,
    keys: impl IntoIterator<Item = (KeyFacts<'k>, &'k [&'k NDArray])>,
) -> Result<()> {
    if !ctx.use_nccl {
        return Ok(());
    }
    let mut sets: Vec<Vec<usize>> = Vec::new();
    for (facts, arrays) in keys {
        // float64 keys on a GPU are updated through a host copy; NCCL never sees them.
        let (Device::Gpu(home), false) = (facts.home, facts.dtype == DType::F64) else {
            continue;
        };
        let mut set: Vec<usize> = arrays
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

/// One key of a push: its facts, its locked home value, the values to sum, its hyperparameters.
pub(crate) struct KeyUpdate<'a> {
    pub facts: KeyFacts<'a>,
    pub value: &'a mut HomeValue,
    pub values: &'a [&'a NDArray],
    pub hyper: Hyper,
    /// Whether the push may take a value instead of copying it (see [`HomePush::owned`]).
    pub owned: bool,
}

impl<'a> KeyUpdate<'a> {
    fn home_push(self) -> HomePush<'a> {
        HomePush {
            key: self.facts.key,
            value: self.value,
            values: self.values,
            hyper: self.hyper,
            owned: self.owned,
        }
    }
}

/// A dist push's question, once every new value is computed and before any is stored: given
/// this rank's success, `Ok` when every rank's updater succeeded.
pub(crate) type Agree<'a> = &'a mut dyn FnMut(bool) -> Result<()>;

/// This rank's result `own` once `agree` (if any) has heard every rank's: own error first.
fn settle<T>(agree: Option<Agree<'_>>, own: Result<T>) -> Result<T> {
    let Some(agree) = agree else {
        return own;
    };
    let together = agree(own.is_ok());
    let value = own?;
    together?;
    Ok(value)
}

/// Whether [`update`] under `updater` computes every key first and asks whether every rank
/// succeeded before it stores any (closures and PTX updaters, which can fail); built-in
/// updaters store as they go, and never ask.
pub(crate) fn asks_before_storing(updater: &Updater) -> bool {
    matches!(updater, Updater::Custom(_) | Updater::Ptx(_))
}

/// Applies a validated push to every key, in issue order. Updaters that can fail (closures,
/// PTX twins) compute every key on copies first, then ask `agree` (a dist store) whether every
/// rank succeeded, and store nothing unless all did; built-in updaters do not ask.
pub(crate) fn update(
    updater: &Updater,
    generation: u64,
    ctx: Ctx,
    jobs: Vec<KeyUpdate<'_>>,
    agree: Option<Agree<'_>>,
) -> Result<()> {
    match updater {
        Updater::Custom(f) => {
            let updated = settle(agree, run_closure(f.function().as_ref(), ctx, &jobs))?;
            store_results(jobs, updated)
        }
        Updater::Ptx(p) => push_ptx(p, updater, generation, ctx, jobs, agree),
        _ => backend::push(
            updater,
            generation,
            &ctx.links(),
            ctx.par_min_bytes,
            jobs.into_iter().map(KeyUpdate::home_push).collect(),
        ),
    }
}

/// Runs closure `f` for every job, in order, on copies: nothing changes yet.
fn run_closure(f: &UpdateFn, ctx: Ctx, jobs: &[KeyUpdate<'_>]) -> Result<Vec<HostData>> {
    jobs.iter()
        .map(|j| {
            let value = j.value.value_to_host()?;
            push_closure(f, ctx.par_min_bytes, &j.facts, &value, j.values)
        })
        .collect()
}

/// Stores the results of [`run_closure`].
fn store_results(jobs: Vec<KeyUpdate<'_>>, results: Vec<HostData>) -> Result<()> {
    for (job, value) in jobs.into_iter().zip(results) {
        job.value.replace_value(value)?;
    }
    Ok(())
}

/// A push with a user PTX updater: its kernel on GPU homes, its CPU twin on host homes.
fn push_ptx(
    p: &PtxUpdater,
    updater: &Updater,
    generation: u64,
    ctx: Ctx,
    jobs: Vec<KeyUpdate<'_>>,
    agree: Option<Agree<'_>>,
) -> Result<()> {
    let (on_gpu, on_host): (Vec<KeyUpdate<'_>>, Vec<KeyUpdate<'_>>) =
        jobs.into_iter().partition(|j| j.value.is_gpu());
    let twin_results = settle(agree, ptx_check_and_twin(p, ctx, &on_gpu, &on_host))?;
    if !on_gpu.is_empty() {
        let jobs = on_gpu
            .into_iter()
            .map(|j| HomePush {
                hyper: Hyper::default(),
                ..j.home_push()
            })
            .collect();
        backend::push(updater, generation, &ctx.links(), ctx.par_min_bytes, jobs)?;
    }
    store_results(on_host, twin_results)
}

/// The checks of a PTX push (dtypes, modules, a twin where needed) and the twin's results on
/// copies of the host-homed keys: nothing changes yet.
fn ptx_check_and_twin(
    p: &PtxUpdater,
    ctx: Ctx,
    on_gpu: &[KeyUpdate<'_>],
    on_host: &[KeyUpdate<'_>],
) -> Result<Vec<HostData>> {
    for j in on_gpu {
        let f = &j.facts;
        if f.dtype != p.dtype() {
            return Err(Error::InvalidUpdater(format!(
                "the PTX updater '{}' works on {} keys, and key {} is {}: use one PTX updater \
                 per dtype, or store the key as {}",
                p.entry(),
                p.dtype(),
                f.key,
                f.dtype,
                p.dtype()
            )));
        }
    }
    // Every GPU home loads the module before the twin runs: a twin may keep state of its own,
    // which a push that then fails on a broken module must not have advanced.
    for j in on_gpu {
        backend::load_user_kernel(p, j.facts.home)?;
    }
    match (p.cpu_twin(), on_host.first()) {
        (_, None) => Ok(Vec::new()),
        (Some(twin), Some(_)) => run_closure(twin.as_ref(), ctx, on_host),
        (None, Some(j)) => Err(Error::InvalidUpdater(format!(
            "key {} is homed in host memory ({}) and the PTX updater '{}' has no CPU twin: \
             give one with PtxUpdater::with_cpu_twin, or home the key on a GPU",
            j.facts.key,
            j.facts.home,
            p.entry()
        ))),
    }
}

/// Waits for this process's GPU work, polling NCCL for errors with its timeout.
pub(crate) fn wait_all() -> Result<()> {
    if backend::probe::gpu_count() == 0 {
        return Ok(());
    }
    nccl::wait_all()?;
    backend::cuda::synchronize_all()
}

/// The sum of checked `values` on `device`, in the key's dtype: a dist push's sum within this
/// process. In host memory it goes into `scratch` when that fits (whatever it holds).
pub(crate) fn local_sum(
    ctx: Ctx,
    facts: &KeyFacts<'_>,
    values: &[&NDArray],
    device: Device,
    scratch: Option<HostData>,
) -> Result<NDArray> {
    let len = facts.shape.size();
    let mut sum = match (device, scratch) {
        (Device::Cpu(_), Some(buf)) if buf.len() == len && buf.dtype() == facts.dtype => {
            HomeValue::from_host(buf)
        }
        (Device::Cpu(_), _) => HomeValue::from_host(HostData::try_filled(facts.dtype, len, 0.0)?),
        (Device::Gpu(_), _) => HomeValue::copy_of(
            &NDArray::full_on(facts.shape, 0.0, facts.dtype, device)?,
            device,
        )?,
    };
    let job = HomePush {
        key: facts.key,
        value: &mut sum,
        values,
        hyper: Hyper::default(),
        owned: false,
    };
    backend::push(
        &Updater::Assign,
        0,
        &ctx.links(),
        ctx.par_min_bytes,
        vec![job],
    )?;
    Ok(sum.into_array(facts.shape))
}

/// Copies every key's value from its home into its outs, in the order given.
pub(crate) fn pull(ctx: Ctx, jobs: &[HomePull<'_>]) -> Result<()> {
    backend::pull(&ctx.links(), ctx.par_min_bytes, jobs)
}

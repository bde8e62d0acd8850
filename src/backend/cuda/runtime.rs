//! The per-process GPU runtime: one CUDA context and ONE stream per GPU, the PTX modules loaded
//! once per GPU, device buffers per dtype, copies, and the fused multi-tensor launch.
//!
//! Ordering: every kernel, copy and NCCL call for GPU `i` goes on its single stream, so stream
//! order alone orders one GPU's work. cudarc's per-slice events are off; cross-GPU dependencies
//! use explicit events. Reading a buffer on the host waits for its stream.
//!
//! Nothing here runs unless [`probe::gpu_count`] finds a GPU, so cudarc cannot panic on a
//! missing libcuda.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    DriverError, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use half::{bf16, f16};

use super::kernels::{self, RuleKind, TensorRecord};
use crate::backend::probe;
use crate::host::HostData;
use crate::{DType, Device, Element, Error, Key, PtxUpdater, Result};
use crate::{PTX_UPDATER_BLOCK, PTX_UPDATER_MAX_BLOCKS};

/// One GPU: its context, its single stream, and its kernels (loaded on first use).
pub(crate) struct Gpu {
    ordinal: usize,
    /// The CUDA ordinal of the physical GPU: `ordinal`, unless the test-only
    /// `KVSTORE_TEST_GPU_MAP` puts several of the store's GPUs on one ([`probe::gpu_map`]).
    physical: usize,
    /// The compute capability, as major * 10 + minor (70 for an sm_70 GPU).
    sm: u32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The PTX modules, loaded on first use: one this GPU cannot load fails only its kernels.
    modules: Mutex<HashMap<&'static str, std::result::Result<Arc<CudaModule>, DriverError>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// Users' PTX updaters loaded here: (PTX text, entry) and the function. Few, so a list.
    user_functions: Mutex<Vec<(Arc<str>, String, CudaFunction)>>,
    /// The fused launches' reused device table; locked from its copy until its launch.
    table: Mutex<Option<CudaSlice<u8>>>,
    /// Peer GPUs whose access was tried: ordinal -> whether it is enabled.
    peers: Mutex<HashMap<usize, bool>>,
    /// Pinned host buffers that host data goes up through (see [`Gpu::upload_bytes`]).
    staging: Mutex<Staging>,
}

/// Bytes per pinned staging buffer.
const STAGING_BYTES: usize = 4 << 20;

/// Pinned staging buffers of one GPU, used in turn, each rewritten once its copy is done.
#[derive(Default)]
struct Staging {
    bufs: Vec<Pinned>,
    next: usize,
}

/// One page-locked host buffer and the event that marks the end of the last copy from it.
struct Pinned {
    ptr: *mut u8,
    len: usize,
    done: cudarc::driver::CudaEvent,
}

// SAFETY: `Pinned` owns its page-locked allocation (a plain host address, usable from any
// thread); it is only touched under its GPU's `staging` mutex.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // A copy from the buffer may still be queued: let it finish before the memory goes.
        let _ = self.done.synchronize();
        // SAFETY: `ptr` came from `malloc_host` and is freed once, here, after the last copy
        // reading it has completed (the event above).
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

impl Gpu {
    /// The CUDA ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The one stream every operation on this GPU goes on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The compute capability, as major * 10 + minor (80 for an A100, 90 for an H100).
    pub(crate) fn sm(&self) -> u32 {
        self.sm
    }

    /// Refuses PTX whose `.target` is above this GPU's, naming both (not NO_BINARY_FOR_GPU).
    fn check_target(
        &self,
        op: &'static str,
        text: &str,
        what: impl FnOnce() -> String,
        fix: &'static str,
    ) -> Result<()> {
        match crate::ptx_text::target(text) {
            Some(need) if need > self.sm => Err(Error::GpuArch {
                op,
                key: None,
                what: what(),
                device: Device::Gpu(self.ordinal),
                have: self.sm,
                need,
                fix,
            }),
            _ => Ok(()),
        }
    }

    /// Waits for everything enqueued on this GPU's stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronize", None))
    }

    fn open(ordinal: usize, physical: usize) -> std::result::Result<Gpu, DriverError> {
        let ctx = CudaContext::new(physical)?;
        let (major, minor) = ctx.compute_capability()?;
        // SAFETY: event tracking goes off before any slice or stream of this context exists.
        // We order work ourselves: one stream per GPU, explicit events for every cross-GPU
        // dependency, and buffers freed on their own GPU's stream, after every use there.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        Ok(Gpu {
            ordinal,
            physical,
            sm: (major * 10 + minor).max(0) as u32,
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            user_functions: Mutex::new(Vec::new()),
            table: Mutex::new(None),
            peers: Mutex::new(HashMap::new()),
            staging: Mutex::new(Staging::default()),
        })
    }

    /// Copies `src` from pageable host memory to device address `dst` on this GPU's stream,
    /// asynchronously through two pinned buffers (the host fills one while the GPU copies the
    /// other), or, without pinned memory, synchronously staged by the driver.
    pub(crate) fn upload_bytes(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let op = "copy to GPU";
        let e = || cuda_err(op, None);
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if staging.bufs.is_empty() {
            self.ctx.bind_to_thread().map_err(e())?;
            for _ in 0..2 {
                // SAFETY: a fresh page-locked allocation; its contents are only written before
                // they are read (by the copies below).
                let ptr = match unsafe { cudarc::driver::result::malloc_host(STAGING_BYTES, 0) } {
                    Ok(p) => p.cast::<u8>(),
                    Err(err) => {
                        log::warn!("kvstore: no pinned staging memory on gpu({}) ({err:?}); host values go up from pageable memory", self.ordinal);
                        break;
                    }
                };
                let done = match self.ctx.new_event(None) {
                    Ok(ev) => ev,
                    Err(err) => {
                        // SAFETY: just allocated above, never used.
                        let _ = unsafe { cudarc::driver::result::free_host(ptr.cast()) };
                        return Err(e()(err));
                    }
                };
                staging.bufs.push(Pinned {
                    ptr,
                    len: STAGING_BYTES,
                    done,
                });
            }
        }
        if staging.bufs.is_empty() {
            // SAFETY: `dst` names a live device buffer of at least `src.len()` bytes on this
            // GPU (the caller's contract); pageable memory is staged by the driver at the call.
            return unsafe {
                cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream())
            }
            .map_err(e());
        }
        for (i, piece) in src.chunks(STAGING_BYTES).enumerate() {
            let at = staging.next;
            staging.next = (at + 1) % staging.bufs.len();
            let buf = &staging.bufs[at];
            // The copy that last read this buffer must be done before it is overwritten.
            buf.done.synchronize().map_err(e())?;
            debug_assert!(piece.len() <= buf.len);
            // SAFETY: `buf.ptr` is a live pinned allocation of `buf.len >= piece.len()` bytes
            // that no queued copy reads any more (the event above), owned under the mutex.
            let pinned = unsafe { std::slice::from_raw_parts_mut(buf.ptr, piece.len()) };
            pinned.copy_from_slice(piece);
            let at_dst = dst + (i * STAGING_BYTES) as u64;
            // SAFETY: `at_dst` names `piece.len()` live device bytes inside the caller's
            // buffer; the pinned source stays untouched until `done`, recorded just after the
            // copy on the same stream, has completed.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(at_dst, pinned, self.stream.cu_stream())
            }
            .map_err(e())?;
            buf.done.record(&self.stream).map_err(e())?;
        }
        Ok(())
    }

    /// Enables this GPU's direct access (NVLink or PCIe) to `peer`'s memory, once per pair,
    /// where `cuDeviceCanAccessPeer` allows it; returns whether it is enabled.
    pub(crate) fn enable_peer(&self, peer: &Gpu) -> bool {
        if peer.ordinal == self.ordinal {
            return true;
        }
        let mut seen = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&on) = seen.get(&peer.ordinal) {
            return on;
        }
        let on = self.try_enable_peer(peer);
        if !on {
            log::info!(
                "kvstore: gpu({}) cannot access gpu({}) directly; copies between them may be \
                 staged through the host",
                self.ordinal,
                peer.ordinal
            );
        }
        seen.insert(peer.ordinal, on);
        on
    }

    fn try_enable_peer(&self, peer: &Gpu) -> bool {
        // Two of the store's GPUs on one physical GPU (the test-only map) share its primary
        // context and memory: each reaches the other's buffers already.
        if self.physical == peer.physical {
            return true;
        }
        let mut can = 0;
        // SAFETY: both devices are valid ordinals of this process; `can` is a valid out-pointer.
        let r = unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer.ctx.cu_device())
        };
        if r != sys::CUresult::CUDA_SUCCESS || can == 0 {
            return false;
        }
        if self.ctx.bind_to_thread().is_err() {
            return false;
        }
        // SAFETY: this GPU's context is current (bound just above) and `peer`'s context is
        // live for the process; the flags must be 0.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
        if !matches!(
            r,
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        ) {
            return false;
        }
        self.grant_pool_access(peer)
    }

    /// Lets this GPU's kernels use memory of `peer`'s current pool, where cudarc allocates
    /// (`cuMemAllocAsync`). Peer access does not cover pool memory (CUDA programming guide:
    /// pool accessibility "does not follow cuCtxEnablePeerAccess"); without this, a kernel here
    /// reading a buffer on `peer` faults with an illegal address.
    fn grant_pool_access(&self, peer: &Gpu) -> bool {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid device of this process and a valid out-pointer.
        let r = unsafe { sys::cuDeviceGetMemPool(&mut pool, peer.ctx.cu_device()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return false;
        }
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ctx.cu_device(),
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `pool` is `peer`'s live pool (just queried), `desc` one valid descriptor.
        let r = unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) };
        r == sys::CUresult::CUDA_SUCCESS
    }

    /// The fused kernel for `rule` and `dtype`, loading this GPU's PTX modules on first use.
    pub(crate) fn function(&self, rule: RuleKind, dtype: DType) -> Result<CudaFunction> {
        let name = kernels::entry_name(rule, dtype);
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let stem = kernels::module_for(rule, dtype);
        let Some(text) = kernels::ptx_source(stem) else {
            return Err(Error::Cuda {
                op: "load kernels",
                key: None,
                message: format!(
                    "no PTX module '{stem}' is embedded in this build (needed for {name})"
                ),
                source: None,
            });
        };
        self.check_target(
            "load kernels",
            text,
            || format!("the {dtype} kernels (kernels/{stem}.ptx)"),
            "keep keys of this dtype in host memory (init_on(key, value, cpu(0))) or on a newer \
             GPU, or use float32 or float16",
        )?;
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let loaded = modules
            .entry(stem)
            .or_insert_with(|| self.ctx.load_module(Ptx::from_src(text)));
        let module = loaded.as_ref().map_err(|&e| Error::Cuda {
            op: "load kernels",
            key: None,
            message: format!(
                "loading PTX module '{stem}' on gpu({}): {:?}",
                self.ordinal, e.0
            ),
            source: Some(e),
        })?;
        let f = module
            .load_function(name)
            .map_err(cuda_err("load kernels", None))?;
        functions.insert(name, f.clone());
        Ok(f)
    }

    /// A user PTX updater's entry, loaded here once per PTX text and entry.
    pub(crate) fn user_function(&self, p: &PtxUpdater) -> Result<CudaFunction> {
        let mut user = self
            .user_functions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, f)) = user
            .iter()
            .find(|(ptx, entry, _)| Arc::ptr_eq(ptx, p.ptx()) && entry == p.entry())
        {
            return Ok(f.clone());
        }
        // The same text and entry, loaded for another updater: share it, and count this GPU
        // for this updater too (once: the alias pushed below is found by pointer).
        if let Some((_, _, f)) = user
            .iter()
            .find(|(ptx, entry, _)| ptx == p.ptx() && entry == p.entry())
        {
            let f = f.clone();
            p.note_load();
            user.push((p.ptx().clone(), p.entry().to_owned(), f.clone()));
            return Ok(f);
        }
        let err = |e: DriverError| {
            let mut err = Error::from_driver("load PTX updater", Some(self.ordinal), None, e);
            if let Error::Cuda { message, .. } = &mut err {
                *message = format!("entry '{}' on gpu({}): {:?}", p.entry(), self.ordinal, e.0);
            }
            err
        };
        self.check_target(
            "load PTX updater",
            p.ptx(),
            || format!("the PTX updater's module (entry '{}')", p.entry()),
            "write the module for the lowest .target your GPUs have (PTX for sm_70 runs on every \
             newer GPU), or home these keys on a newer GPU",
        )?;
        let module = self
            .ctx
            .load_module(Ptx::from_src(&**p.ptx()))
            .map_err(err)?;
        let f = module.load_function(p.entry()).map_err(err)?;
        p.note_load();
        user.push((p.ptx().clone(), p.entry().to_owned(), f.clone()));
        Ok(f)
    }
}

/// The device addresses and counts of one user PTX updater launch (see [`crate::PtxUpdater`]).
pub(crate) struct UserLaunch {
    pub stored: u64,
    pub merged: u64,
    pub m: u64,
    pub v: u64,
    pub n: u64,
    pub step: u64,
}

/// Launches a user PTX updater on `gpu` for one key (its grid-stride loop covers the rest).
pub(crate) fn launch_user(gpu: &Gpu, p: &PtxUpdater, a: &UserLaunch) -> Result<()> {
    if a.n == 0 {
        return Ok(());
    }
    let func = gpu.user_function(p)?;
    let blocks =
        a.n.div_ceil(u64::from(PTX_UPDATER_BLOCK))
            .min(u64::from(PTX_UPDATER_MAX_BLOCKS)) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (PTX_UPDATER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let scalars = p.scalars();
    let mut args = gpu.stream().launch_builder(&func);
    for addr_or_count in [&a.stored, &a.merged, &a.m, &a.v, &a.n, &a.step] {
        args.arg(addr_or_count);
    }
    for s in &scalars {
        args.arg(s);
    }
    // SAFETY: `PtxUpdater::new` checked the entry's parameters (six u64, four f32). `stored`
    // and `merged` name live buffers of `n` elements of its dtype on this GPU, `m` and `v` live
    // f32 buffers of `n` or 0, kept alive by the caller and freed on this stream after the
    // launch. What the user's code does with them is the user's contract (`ptx_updater`).
    unsafe { args.launch(cfg) }.map_err(cuda_err("launch PTX updater", None))?;
    Ok(())
}

/// Every GPU of the process, each opened on first use (or the reason it could not be).
type Gpus = Vec<OnceLock<std::result::Result<Gpu, DriverError>>>;
static GPUS: OnceLock<Gpus> = OnceLock::new();

/// The GPU with ordinal `i`, opened on first use; `DeviceNotFound` when there is no such GPU.
pub(crate) fn gpu(i: usize) -> Result<&'static Gpu> {
    // A bad test-only map fails every use of a GPU, before anything is opened.
    probe::gpu_map()?;
    let n = probe::gpu_count();
    if i >= n {
        return Err(Error::DeviceNotFound {
            device: Device::Gpu(i),
            available: probe::describe_gpus(),
        });
    }
    let gpus = GPUS.get_or_init(|| (0..n).map(|_| OnceLock::new()).collect());
    gpus[i]
        .get_or_init(|| Gpu::open(i, probe::physical_ordinal(i).unwrap_or(i)))
        .as_ref()
        .map_err(|&e| Error::from_driver("open GPU", Some(i), None, e))
}

/// The store's GPU of a buffer on CUDA device `physical` made on `stream`: `physical` itself,
/// unless the test-only `KVSTORE_TEST_GPU_MAP` puts several of the store's GPUs on that device,
/// where the buffer's stream (each of them has its own) says which.
fn logical_ordinal(physical: usize, stream: &Arc<CudaStream>) -> usize {
    if !matches!(probe::gpu_map(), Ok(Some(_))) {
        return physical;
    }
    let slots = GPUS.get().into_iter().flatten().enumerate();
    let mine = |(i, slot): (usize, &OnceLock<_>)| match slot.get() {
        Some(Ok::<Gpu, DriverError>(g)) if Arc::ptr_eq(g.stream(), stream) => Some(i),
        _ => None,
    };
    slots.filter_map(mine).next().unwrap_or(physical)
}

/// The compute capability of GPU `i` as major * 10 + minor (opening it on first use).
pub fn gpu_sm(i: usize) -> Result<u32> {
    Ok(gpu(i)?.sm())
}

/// [`host_wait`] on every GPU this process has opened (opens none).
pub(crate) fn synchronize_all() -> Result<()> {
    for slot in GPUS.get().into_iter().flatten() {
        if let Some(Ok(g)) = slot.get() {
            host_wait(g)?;
        }
    }
    Ok(())
}

/// The comm layer's wait before host reads (`comm::nccl::wait_stream`: polls collectives).
static HOST_WAIT: OnceLock<fn(&Gpu) -> Result<()>> = OnceLock::new();

/// Sets, once, the wait of [`host_wait`]; the comm layer calls it before its first collective.
pub(crate) fn set_host_wait(wait: fn(&Gpu) -> Result<()>) {
    let _ = HOST_WAIT.set(wait);
}

/// Waits on the host for `gpu`'s stream: through the comm layer's wait once set (a stalled
/// collective is aborted, not waited on forever), else [`Gpu::synchronize`].
pub(crate) fn host_wait(gpu: &Gpu) -> Result<()> {
    match HOST_WAIT.get() {
        Some(wait) => wait(gpu),
        None => gpu.synchronize(),
    }
}

/// Maps a driver error during `op` (on `key`) to [`Error::Cuda`] or [`Error::OutOfMemory`].
pub(crate) fn cuda_err(op: &'static str, key: Option<&Key>) -> impl FnOnce(DriverError) -> Error {
    let key = key.cloned();
    move |e| {
        let err = Error::from_driver(op, None, None, e);
        match &key {
            Some(k) => err.with_key(k),
            None => err,
        }
    }
}

/// Maps a driver error of `op` allocating `bytes` on GPU `ordinal`.
fn alloc_err(op: &'static str, ordinal: usize, bytes: usize) -> impl Fn(DriverError) -> Error {
    move |e| Error::from_driver(op, Some(ordinal), Some(bytes), e)
}

/// `n` uninitialized elements on `st`. The driver refuses 0 bytes (`CUDA_ERROR_INVALID_VALUE`),
/// so an empty buffer owns a one-element allocation with length 0.
///
/// # Safety
/// The elements are not initialized (as for `CudaStream::alloc`).
pub(crate) unsafe fn alloc_uninit<T: DeviceRepr>(
    st: &Arc<CudaStream>,
    n: usize,
) -> std::result::Result<CudaSlice<T>, DriverError> {
    if n > 0 {
        // SAFETY: the caller accepts uninitialized elements.
        return unsafe { st.alloc(n) };
    }
    // SAFETY: as above; the one element is never read.
    let one = unsafe { st.alloc::<T>(1) }?;
    let ptr = one.leak();
    // SAFETY: `ptr` is the allocation just leaked from a slice of this stream; the new slice
    // owns it (and frees it on this stream when dropped). Event tracking is off, so this
    // creates no events and cannot panic.
    Ok(unsafe { st.upgrade_device_ptr(ptr, 0) })
}

/// `n` zeros on `st` (see [`alloc_uninit`] for `n == 0`).
pub(crate) fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
    st: &Arc<CudaStream>,
    n: usize,
) -> std::result::Result<CudaSlice<T>, DriverError> {
    // SAFETY: every element is set to zero just below, on the same stream, before any use.
    let mut s = unsafe { alloc_uninit(st, n) }?;
    if n > 0 {
        st.memset_zeros(&mut s)?;
    }
    Ok(s)
}

/// A copy of `host` on `st` (see [`alloc_uninit`] for an empty `host`).
pub(crate) fn clone_htod<T: DeviceRepr>(
    st: &Arc<CudaStream>,
    host: &[T],
) -> std::result::Result<CudaSlice<T>, DriverError> {
    // SAFETY: every element is overwritten just below, on the same stream, before any use.
    let mut s = unsafe { alloc_uninit(st, host.len()) }?;
    if !host.is_empty() {
        st.memcpy_htod(host, &mut s)?;
    }
    Ok(s)
}

/// The elements of `s`, copied to the host (no driver call for an empty slice).
pub(crate) fn clone_dtoh<T: DeviceRepr>(
    st: &Arc<CudaStream>,
    s: &CudaSlice<T>,
) -> std::result::Result<Vec<T>, DriverError> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    st.clone_dtoh(s)
}

/// Elements on one GPU, one variant per dtype.
#[derive(Debug)]
pub(crate) enum GpuBuf {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
}

// Runs `$body` with `$s` bound to the typed slice inside a [`GpuBuf`].
macro_rules! with_gpu {
    ($buf:expr, $s:ident => $body:expr) => {
        match $buf {
            $crate::backend::cuda::GpuBuf::F32($s) => $body,
            $crate::backend::cuda::GpuBuf::F64($s) => $body,
            $crate::backend::cuda::GpuBuf::F16($s) => $body,
            $crate::backend::cuda::GpuBuf::BF16($s) => $body,
        }
    };
}

// The [`GpuBuf`] of `$dtype`'s variant around `$make`, whose element type the variant decides.
macro_rules! gpu_of {
    ($dtype:expr, $make:expr) => {
        match $dtype {
            DType::F32 => GpuBuf::F32($make),
            DType::F64 => GpuBuf::F64($make),
            DType::F16 => GpuBuf::F16($make),
            DType::BF16 => GpuBuf::BF16($make),
        }
    };
}

impl GpuBuf {
    /// The dtype of the elements.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            GpuBuf::F32(_) => DType::F32,
            GpuBuf::F64(_) => DType::F64,
            GpuBuf::F16(_) => DType::F16,
            GpuBuf::BF16(_) => DType::BF16,
        }
    }

    /// The number of elements.
    pub(crate) fn len(&self) -> usize {
        with_gpu!(self, s => s.len())
    }

    /// Whether there are no elements.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The GPU ordinal the elements live on.
    pub(crate) fn ordinal(&self) -> usize {
        with_gpu!(self, s => logical_ordinal(s.ordinal(), s.stream()))
    }

    /// The stream the buffer belongs to (its GPU's single stream).
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        with_gpu!(self, s => s.stream())
    }

    /// The device address of the first element (no synchronization: see the module docs).
    pub(crate) fn ptr(&self) -> u64 {
        with_gpu!(self, s => s.device_ptr(s.stream()).0)
    }

    /// The device address of the first element, on its GPU.
    pub(crate) fn at(&self) -> GpuPtr {
        GpuPtr::new(self.ordinal(), self.ptr())
    }

    /// The size of the elements in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// Zeros of `dtype` on GPU `ordinal`.
    pub(crate) fn zeros(ordinal: usize, dtype: DType, n: usize) -> Result<GpuBuf> {
        let st = gpu(ordinal)?.stream();
        let e = alloc_err("alloc", ordinal, n * dtype.size());
        Ok(gpu_of!(dtype, alloc_zeros(st, n).map_err(e)?))
    }

    /// `n` uninitialized elements on GPU `ordinal`, for work there to overwrite before reads.
    pub(crate) fn scratch(ordinal: usize, dtype: DType, n: usize) -> Result<GpuBuf> {
        let st = gpu(ordinal)?.stream();
        let e = alloc_err("alloc", ordinal, n * dtype.size());
        // SAFETY: `alloc` returns uninitialized device memory; every caller overwrites all `n`
        // elements with work enqueued on this stream before any read enqueued after it, and
        // the elements are plain floats, valid for any bit pattern.
        Ok(unsafe { gpu_of!(dtype, alloc_uninit(st, n).map_err(e)?) })
    }

    /// A copy of host data on GPU `ordinal`, same dtype (see [`Gpu::upload_bytes`]).
    pub(crate) fn upload(ordinal: usize, data: &HostData) -> Result<GpuBuf> {
        let mut b = GpuBuf::scratch(ordinal, data.dtype(), data.len())?;
        b.upload_into(data)?;
        Ok(b)
    }

    /// Overwrites the elements with host data, converted to this buffer's dtype.
    pub(crate) fn upload_into(&mut self, data: &HostData) -> Result<()> {
        if data.len() != self.len() {
            return Err(Error::Internal {
                op: "copy to GPU",
                message: format!("{} elements into a buffer of {}", data.len(), self.len()),
            });
        }
        if self.is_empty() {
            return Ok(());
        }
        let data = data.cast(self.dtype());
        gpu(self.ordinal())?.upload_bytes(self.ptr(), host_data_bytes(&data))
    }

    /// The elements, copied to the host after [`host_wait`] on the buffer's GPU.
    pub(crate) fn download(&self) -> Result<HostData> {
        host_wait(gpu(self.ordinal())?)?;
        let e = cuda_err("copy to host", None);
        let data = with_gpu!(self, s => Element::wrap(clone_dtoh(s.stream(), s).map_err(e)?));
        // A copy to pageable memory returns once it is done (CUDA's rule), and
        // `host_wait` above already surfaced any earlier error.
        Ok(data)
    }

    /// A copy on GPU `ordinal` (this one or another), ordered as [`copy_device`] orders it.
    pub(crate) fn copy_to(&self, ordinal: usize) -> Result<GpuBuf> {
        let out = GpuBuf::scratch(ordinal, self.dtype(), self.len())?;
        copy_device(out.at(), self.at(), self.bytes())?;
        Ok(out)
    }

    /// Sets every element to `value`.
    pub(crate) fn fill(&mut self, value: f64) -> Result<()> {
        self.upload_into(&HostData::filled(self.dtype(), self.len(), value))
    }

    /// Another library's memory as a buffer of `n` elements of `dtype` on GPU `ordinal`,
    /// checked first ([`check_foreign`]).
    ///
    /// # Safety
    /// The memory must stay allocated until the buffer is given up with [`GpuBuf::leak`]
    /// (dropping it would free memory the store does not own) and the store's work on the
    /// stream has run.
    pub(crate) unsafe fn borrow_foreign(
        ordinal: usize,
        dtype: DType,
        ptr: u64,
        n: usize,
    ) -> Result<GpuBuf> {
        let g = gpu(ordinal)?;
        check_foreign(g, dtype, ptr, n)?;
        let st = g.stream();
        // SAFETY: `check_foreign` found `n` elements of `dtype` inside one allocation on this
        // GPU; the caller keeps it allocated for the buffer's life and gives it up with `leak`.
        Ok(unsafe { gpu_of!(dtype, st.upgrade_device_ptr(ptr, n)) })
    }

    /// Gives up the memory without freeing it: the end of a [`GpuBuf::borrow_foreign`].
    pub(crate) fn leak(self) {
        with_gpu!(self, s => {
            s.leak();
        })
    }
}

/// Checks memory lent by another library: device memory of GPU `g` (whose context is the
/// primary one, as PyTorch's and CuPy's) at its first and last byte, aligned to `dtype`. The
/// ends are asked apart, not one allocation's range: PyTorch's expandable segments map one
/// tensor over several physical chunks, and the driver reports a chunk as the allocation.
fn check_foreign(g: &Gpu, dtype: DType, ptr: u64, n: usize) -> Result<()> {
    let device = Device::Gpu(g.ordinal);
    let refuse = |message: String| Error::ForeignMemory { device, message };
    if ptr % dtype.size() as u64 != 0 {
        return Err(refuse(format!(
            "address {ptr:#x} is not aligned to its {dtype} elements ({} bytes): lend an \
             array that starts on an element",
            dtype.size()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    g.ctx
        .bind_to_thread()
        .map_err(cuda_err("lend GPU memory", None))?;
    let last = ptr + (n * dtype.size()) as u64 - 1;
    for (what, at) in [("address", ptr), ("last byte", last)] {
        let mut ordinal: std::ffi::c_int = -1;
        // SAFETY: a valid out-pointer of the attribute's type (an int for DEVICE_ORDINAL); the
        // driver only reads `at`'s mapping, and refuses an address it does not know.
        let known = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut std::ffi::c_int).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                at,
            )
        };
        if known == sys::CUresult::CUDA_SUCCESS && ordinal == g.physical as std::ffi::c_int {
            continue;
        }
        let found = match known == sys::CUresult::CUDA_SUCCESS {
            true => format!("memory of gpu({ordinal})"),
            false => format!("not device memory the driver knows ({known:?})"),
        };
        return Err(refuse(format!(
            "the {what} {at:#x} of {n} {dtype} elements from {ptr:#x} is {found}: lend an \
             array whose elements all lie in memory of the GPU that holds it"
        )));
    }
    Ok(())
}

/// The store's CUDA stream (`CUstream`, as an integer) on GPU `ordinal`: the `stream` to hand a
/// DLPack producer, and the one to wait on before reusing memory lent to the store.
pub fn cuda_stream(ordinal: usize) -> Result<usize> {
    Ok(gpu(ordinal)?.stream().cu_stream() as usize)
}

/// The bytes of host data, as the GPU holds them (little-endian, no padding).
pub(crate) fn host_data_bytes(data: &HostData) -> &[u8] {
    match data {
        HostData::F32(v) => host_bytes(v),
        HostData::F64(v) => host_bytes(v),
        HostData::F16(v) => host_bytes(v),
        HostData::BF16(v) => host_bytes(v),
    }
}

/// The bytes of a slice of plain numbers (f32, f64, f16, bf16: no padding, any bit pattern).
fn host_bytes<T: DeviceRepr>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is a plain number type without padding, so every byte of the slice is
    // initialized; the view lives no longer than `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Makes `consumer` wait for the work enqueued on `producer`, under [`cross_gpu_order`].
pub(crate) fn stream_wait(consumer: &CudaStream, producer: &CudaStream) -> Result<()> {
    if consumer.cu_stream() == producer.cu_stream() {
        return Ok(());
    }
    let e = || cuda_err("order streams", None);
    let ev = producer.record_event(None).map_err(e())?;
    consumer.wait(&ev).map_err(e())
}

/// Serializes everything that orders one stream against another: NCCL groups (whose kernels on
/// different GPUs wait for each other) and event waits between streams (peer copies).
///
/// Without it: thread A enqueues its NCCL kernel on GPU 0, thread B makes GPU 1's stream wait
/// for an event after that kernel, then A enqueues its NCCL kernel on GPU 1 behind B's wait.
/// GPU 0's kernel waits for GPU 1's, which waits for GPU 0's: a deadlock. Under this lock every
/// wait is entirely before or after a collective on both GPUs.
pub(crate) fn cross_gpu_order() -> std::sync::MutexGuard<'static, ()> {
    static ORDER: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ORDER.lock().unwrap_or_else(|e| e.into_inner())
}

/// One tensor of a fused launch: raw device addresses (see the ABI's record layout).
#[derive(Clone, Debug, Default)]
pub(crate) struct Record {
    pub stored: u64,
    pub inputs: Vec<u64>,
    pub m: u64,
    pub v: u64,
    pub n: u64,
    pub lr_t: f32,
}

/// The bytes of a [`record_table`] of `records`, `starts` and `inputs` input pointers in all.
fn table_len(records: usize, starts: usize, inputs: usize) -> usize {
    records * size_of::<TensorRecord>() + (starts * 4).next_multiple_of(8) + inputs * 8
}

/// The bytes of a launch's table at device address `base`: a [`TensorRecord`] per record,
/// `starts` padded to 8 bytes, then every record's input pointers, in order.
pub(crate) fn record_table(base: u64, records: &[Record], starts: &[u32]) -> Vec<u8> {
    let inputs: usize = records.iter().map(|r| r.inputs.len()).sum();
    let len = table_len(records.len(), starts.len(), inputs);
    let mut host = Vec::with_capacity(len);
    let mut next_input = base + table_len(records.len(), starts.len(), 0) as u64;
    for r in records {
        let record = TensorRecord {
            stored: r.stored,
            inputs: next_input,
            m: r.m,
            v: r.v,
            n: r.n,
            k: r.inputs.len() as u32,
            lr_t: r.lr_t,
            _reserved: [0; 2],
        };
        host.extend_from_slice(bytemuck::bytes_of(&record));
        next_input += 8 * r.inputs.len() as u64;
    }
    host.extend_from_slice(bytemuck::cast_slice(starts));
    host.resize(table_len(records.len(), starts.len(), 0), 0);
    for r in records {
        host.extend_from_slice(bytemuck::cast_slice(&r.inputs));
    }
    debug_assert_eq!(host.len(), len);
    host
}

/// Launches `fused_<rule>_<dtype>` on `gpu` over `records`: one launch per
/// [`kernels::MAX_TENSORS_PER_LAUNCH`] tensors, one block per chunk of work; a batch with no
/// work launches nothing. The table ([`record_table`]) goes up through pinned staging into the
/// GPU's reused table buffer (stream order puts each copy after the previous launch). The
/// caller keeps every buffer a record names alive; they are freed on this stream, after it.
pub(crate) fn launch_fused(
    gpu: &Gpu,
    rule: RuleKind,
    dtype: DType,
    scalars: &[f32],
    records: &[Record],
) -> Result<()> {
    let e = || cuda_err("launch update kernel", None);
    let func = gpu.function(rule, dtype)?;
    let stream = gpu.stream();
    for batch in records.chunks(kernels::MAX_TENSORS_PER_LAUNCH) {
        let starts = kernels::block_starts(batch.iter().map(|r| (r.n, r.inputs.len() as u32)))
            .ok_or_else(|| Error::Cuda {
                op: "launch update kernel",
                key: None,
                message: format!(
                    "{} tensors need more than {} blocks in one launch",
                    batch.len(),
                    kernels::MAX_BLOCKS_PER_LAUNCH
                ),
                source: None,
            })?;
        let total = *starts.last().expect("starts has ntensors + 1 entries");
        if total == 0 {
            continue;
        }
        let inputs: usize = batch.iter().map(|r| r.inputs.len()).sum();
        let bytes = table_len(batch.len(), starts.len(), inputs);
        let mut table = gpu.table.lock().unwrap_or_else(|e| e.into_inner());
        if table.as_ref().is_none_or(|t| t.len() < bytes) {
            // The old table is freed on this stream, after the launches that read it.
            *table = None;
            // SAFETY: every byte a launch reads is written by the copy below first (stream
            // order), and bytes are valid for any bit pattern.
            let fresh = unsafe { alloc_uninit::<u8>(stream, bytes.next_power_of_two().max(4096)) }
                .map_err(alloc_err("alloc", gpu.ordinal, bytes))?;
            *table = Some(fresh);
        }
        let buf = table.as_ref().expect("allocated just above");
        let base = buf.device_ptr(stream).0;
        let host = record_table(base, batch, &starts);
        gpu.upload_bytes(base, &host)?;
        let cfg = LaunchConfig {
            grid_dim: kernels::grid_dim(total),
            block_dim: (kernels::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let ntensors = batch.len() as u32;
        let chunk = kernels::CHUNK;
        let mut args = stream.launch_builder(&func);
        args.arg(&base).arg(&ntensors).arg(&chunk);
        for s in scalars {
            args.arg(s);
        }
        // SAFETY: the arguments are the ABI's (table, ntensors, chunk, then the rule's scalars
        // in `kernels::scalars`' order). The table holds `ntensors` records naming live buffers
        // of `n` elements on this GPU (freed on this stream, after the launch), then the block
        // starts, the last the grid size; only a later copy on this stream rewrites it.
        unsafe { args.launch(cfg) }.map_err(e())?;
        drop(table);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn record_table_follows_the_abi_layout() {
        let base = 0x7000_0000_0000u64;
        let records = [
            Record {
                stored: 0x1000,
                inputs: vec![0x2000, 0x3000, 0x4000],
                m: 0x5000,
                v: 0x6000,
                n: 12345,
                lr_t: 0.25,
            },
            Record {
                stored: 0x8000,
                inputs: vec![0x9000],
                n: 7,
                ..Record::default()
            },
        ];
        let t = record_table(base, &records, &[0, 4, 5]);
        // Records, then 3 starts (12 bytes, padded to 16), then the pointer arrays.
        assert_eq!(t.len(), 2 * 64 + 16 + 4 * 8);
        let starts: Vec<u32> = (0..3)
            .map(|i| u32::from_le_bytes(t[128 + 4 * i..132 + 4 * i].try_into().unwrap()))
            .collect();
        assert_eq!(starts, vec![0, 4, 5]);
        // Record 0.
        assert_eq!(u64_at(&t, 0), 0x1000);
        assert_eq!(u64_at(&t, 8), base + 144);
        assert_eq!(u64_at(&t, 16), 0x5000);
        assert_eq!(u64_at(&t, 24), 0x6000);
        assert_eq!(u64_at(&t, 32), 12345);
        assert_eq!(u32::from_le_bytes(t[40..44].try_into().unwrap()), 3);
        assert_eq!(f32::from_le_bytes(t[44..48].try_into().unwrap()), 0.25);
        assert!(t[48..64].iter().all(|&b| b == 0), "reserved bytes are zero");
        // Record 1: its inputs follow record 0's three.
        assert_eq!(u64_at(&t, 64), 0x8000);
        assert_eq!(u64_at(&t, 72), base + 144 + 24);
        assert_eq!((u64_at(&t, 80), u64_at(&t, 88)), (0, 0));
        assert_eq!(u32::from_le_bytes(t[104..108].try_into().unwrap()), 1);
        // The pointer arrays.
        let ptrs: Vec<u64> = (0..4).map(|i| u64_at(&t, 144 + 8 * i)).collect();
        assert_eq!(ptrs, vec![0x2000, 0x3000, 0x4000, 0x9000]);
    }

    #[test]
    fn record_table_records_read_back_as_tensor_records() {
        let base = 0x7f00_0000_1000u64;
        let records: Vec<Record> = (0..3u64)
            .map(|i| Record {
                stored: 0x1_0000 * (i + 1),
                inputs: (0..=i).map(|j| 0x10_0000 + 0x100 * j + i).collect(),
                m: 0x2_0000 + i,
                v: 0x3_0000 + i,
                n: 1000 + i,
                lr_t: 0.5 + i as f32,
            })
            .collect();
        let t = record_table(base, &records, &[0, 1, 2, 3]);
        // 3 records, 4 starts (16 bytes), 6 input pointers.
        assert_eq!(t.len(), 3 * 64 + 16 + 6 * 8);
        let mut first_input = base + 3 * 64 + 16;
        for (i, r) in records.iter().enumerate() {
            let read: TensorRecord = bytemuck::pod_read_unaligned(&t[64 * i..64 * (i + 1)]);
            let want = TensorRecord {
                stored: r.stored,
                inputs: first_input,
                m: r.m,
                v: r.v,
                n: r.n,
                k: r.inputs.len() as u32,
                lr_t: r.lr_t,
                _reserved: [0; 2],
            };
            assert_eq!(read, want, "record {i}");
            let at = (first_input - base) as usize;
            let ptrs: Vec<u64> = (0..r.inputs.len())
                .map(|j| u64_at(&t, at + 8 * j))
                .collect();
            assert_eq!(ptrs, r.inputs, "record {i}'s inputs");
            first_input += 8 * r.inputs.len() as u64;
        }
    }

    #[test]
    fn no_gpu_means_device_not_found() {
        if probe::gpu_count() > 0 {
            return;
        }
        assert!(matches!(gpu(0), Err(Error::DeviceNotFound { .. })));
        assert!(synchronize_all().is_ok());
    }
}

/// A raw device address and the GPU it is on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GpuPtr {
    pub ordinal: usize,
    pub addr: u64,
}

impl GpuPtr {
    /// `addr` on GPU `ordinal`.
    pub(crate) fn new(ordinal: usize, addr: u64) -> GpuPtr {
        GpuPtr { ordinal, addr }
    }
}

/// Copies `bytes` from `src` to `dst` on `dst`'s stream, ordered against `src`'s stream both
/// ways (the copy waits for src's producers; later work on src's GPU waits for the copy).
pub(crate) fn copy_device(dst: GpuPtr, src: GpuPtr, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let d = gpu(dst.ordinal)?;
    let s = gpu(src.ordinal)?;
    if dst.ordinal != src.ordinal {
        // Direct copies where the GPUs allow it (else the driver stages through the host).
        d.enable_peer(s);
        s.enable_peer(d);
    }
    let _order = cross_gpu_order();
    stream_wait(d.stream(), s.stream())?;
    d.context()
        .bind_to_thread()
        .map_err(cuda_err("copy between GPUs", None))?;
    let r = if dst.ordinal == src.ordinal {
        // SAFETY: both addresses name live buffers of at least `bytes` on this GPU, kept alive
        // by the caller until after the copy is enqueued, and freed on this stream later.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.addr,
                src.addr,
                bytes,
                d.stream().cu_stream(),
            )
        }
    } else {
        // SAFETY: as above, with `src` on another GPU whose context is given; the source
        // stream waits for this copy below before anything can reuse or free the source.
        unsafe {
            cudarc::driver::result::memcpy_peer_async(
                d.context().cu_ctx(),
                dst.addr,
                s.context().cu_ctx(),
                src.addr,
                bytes,
                d.stream().cu_stream(),
            )
        }
    };
    r.map_err(cuda_err("copy between GPUs", None))?;
    stream_wait(s.stream(), d.stream())
}

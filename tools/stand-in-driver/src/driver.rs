//! The CUDA driver API subset cudarc 0.19.10 calls for kvstore, exported under the driver's
//! names. Each function checks its arguments, turns the call into queue operations on the
//! state (see the crate docs), and returns a `CUresult`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Arc, MutexGuard};

use crate::emu::{Arg, Module, Ty};
use crate::state::{
    self, cu, current_ctx, handle, lock, notify, report, set_current_ctx, unhandle, Kind,
    LoadedModule, State, Work,
};

type Handle = *mut c_void;

/// The state, after `cuInit`.
fn begin() -> Result<MutexGuard<'static, State>, i32> {
    let st = lock();
    if !st.initialized {
        return Err(cu::NOT_INITIALIZED);
    }
    Ok(st)
}

/// Runs a call body and turns its result into a `CUresult`.
fn run(body: impl FnOnce() -> Result<(), i32>) -> i32 {
    match body() {
        Ok(()) => cu::SUCCESS,
        Err(code) => code,
    }
}

/// Reports a rejected call and returns its code.
fn reject(code: i32, message: String) -> i32 {
    report(&message);
    code
}

/// Writes `v` to the caller's out-parameter `p`; a null one is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
unsafe fn out<T>(p: *mut T, v: T) -> Result<(), i32> {
    if p.is_null() {
        return Err(cu::INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for a write by the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

fn ctx_of(st: &State, h: Handle) -> Result<usize, i32> {
    match unhandle(Kind::Ctx, h) {
        Some(c) if c < st.ctxs.len() => Ok(c),
        _ => Err(cu::INVALID_CONTEXT),
    }
}

fn current(st: &State) -> Result<usize, i32> {
    let c = current_ctx().ok_or(cu::INVALID_CONTEXT)?;
    if st.ctxs[c].retained == 0 {
        return Err(cu::INVALID_CONTEXT);
    }
    usable(st, c)?;
    Ok(c)
}

/// Fails with context `ctx`'s sticky error, once a kernel fault has poisoned it (as CUDA does:
/// every later call on the context returns the error, until the context is reset).
fn usable(st: &State, ctx: usize) -> Result<(), i32> {
    match st.ctxs[ctx].sticky {
        Some(code) => Err(code),
        None => Ok(()),
    }
}

/// The stream a `CUstream` handle names, in a context that is still usable.
fn stream_of(st: &mut State, h: Handle) -> Result<usize, i32> {
    let s = st.stream(h)?;
    usable(st, st.streams[s].ctx)?;
    Ok(s)
}

// ---------------------------------------------------------------------------------------------
// Initialization, devices, contexts.

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> i32 {
    crate::calls::count("cuInit");
    let mut st = lock();
    if flags != 0 {
        return cu::INVALID_VALUE;
    }
    if st.cfg.gpus == 0 {
        return cu::NO_DEVICE;
    }
    st.initialized = true;
    cu::SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> i32 {
    crate::calls::count("cuDriverGetVersion");
    // SAFETY: the caller passes a valid out-pointer (or null, refused by `out`).
    run(|| unsafe { out(version, 12080) })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> i32 {
    crate::calls::count("cuDeviceGetCount");
    run(|| {
        let st = begin()?;
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(count, st.cfg.gpus as c_int) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> i32 {
    crate::calls::count("cuDeviceGet");
    run(|| {
        let st = begin()?;
        if ordinal < 0 || ordinal as usize >= st.cfg.gpus {
            return Err(cu::INVALID_DEVICE);
        }
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(device, ordinal) }
    })
}

fn check_device(st: &State, dev: c_int) -> Result<usize, i32> {
    if dev < 0 || dev as usize >= st.cfg.gpus {
        return Err(cu::INVALID_DEVICE);
    }
    Ok(dev as usize)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, dev: c_int) -> i32 {
    crate::calls::count("cuDeviceGetAttribute");
    run(|| {
        let st = begin()?;
        check_device(&st, dev)?;
        let v = match attrib {
            1 | 2 => 1024,                   // max threads per block, max block x
            3 => 1024,                       // max block y
            4 => 64,                         // max block z
            5 => i32::MAX,                   // max grid x
            6 | 7 => 65535,                  // max grid y, z
            8 => 49152,                      // shared memory per block
            10 => 32,                        // warp size
            16 => 132,                       // multiprocessors
            41 => 1,                         // unified addressing
            75 => (st.cfg.sm / 10) as c_int, // compute capability
            76 => (st.cfg.sm % 10) as c_int,
            115 => 1, // memory pools: cudarc then uses cuMemAllocAsync / cuMemFreeAsync
            _ => 0,
        };
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(value, v) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> i32 {
    crate::calls::count("cuDeviceGetName");
    run(|| {
        let st = begin()?;
        let d = check_device(&st, dev)?;
        let text = format!("kvstore stand-in {d} (not a GPU)\0");
        if name.is_null() || len <= 0 {
            return Err(cu::INVALID_VALUE);
        }
        let n = text.len().min(len as usize);
        // SAFETY: `name` holds `len` bytes (the API's contract); at most that many are written,
        // and the last one written is a NUL.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, name, n);
            *name.add(n - 1) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> i32 {
    crate::calls::count("cuDeviceTotalMem_v2");
    run(|| {
        let st = begin()?;
        check_device(&st, dev)?;
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(bytes, st.cfg.mem_bytes as usize) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> i32 {
    crate::calls::count("cuMemGetInfo_v2");
    run(|| {
        let st = begin()?;
        let c = current(&st)?;
        let total_bytes = st.cfg.mem_bytes;
        let used = st.used[st.ctxs[c].device];
        // SAFETY: valid out-pointers, per the API.
        unsafe {
            out(free, total_bytes.saturating_sub(used) as usize)?;
            out(total, total_bytes as usize)
        }
    })
}

/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`, the one pointer attribute modelled.
const POINTER_DEVICE_ORDINAL: c_int = 9;

/// The device whose memory holds `ptr` (attribute 9 only). An address that no live
/// allocation holds is `CUDA_ERROR_INVALID_VALUE`, as CUDA answers for memory it does not know.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: u64,
) -> i32 {
    crate::calls::count("cuPointerGetAttribute");
    run(|| {
        let st = begin()?;
        if attribute != POINTER_DEVICE_ORDINAL {
            return Err(cu::NOT_SUPPORTED);
        }
        let (device, _) = st.locate(ptr, 1).map_err(|_| cu::INVALID_VALUE)?;
        // SAFETY: for this attribute `data` points to an int, per the API.
        unsafe { out(data.cast::<c_int>(), device as c_int) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: c_int, peer: c_int) -> i32 {
    crate::calls::count("cuDeviceCanAccessPeer");
    run(|| {
        let st = begin()?;
        let (d, p) = (check_device(&st, dev)?, check_device(&st, peer)?);
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(can, c_int::from(st.cfg.p2p && d != p)) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, dev: c_int) -> i32 {
    crate::calls::count("cuDevicePrimaryCtxRetain");
    run(|| {
        let mut st = begin()?;
        let d = check_device(&st, dev)?;
        if ctx.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        st.ctxs[d].retained += 1;
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(ctx, handle(Kind::Ctx, d)) }
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> i32 {
    crate::calls::count("cuDevicePrimaryCtxRelease_v2");
    run(|| {
        let mut st = begin()?;
        let d = check_device(&st, dev)?;
        if st.ctxs[d].retained == 0 {
            return Err(cu::INVALID_CONTEXT);
        }
        st.ctxs[d].retained -= 1;
        if st.ctxs[d].retained == 0 {
            // The last release destroys the primary context.
            st.reset_ctx(d);
        }
        Ok(())
    })
}

/// Resets a primary context: everything in it is destroyed and its sticky error is cleared
/// (see `State::reset_ctx`). The retains stay.
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: c_int) -> i32 {
    crate::calls::count("cuDevicePrimaryCtxReset_v2");
    run(|| {
        let mut st = begin()?;
        let d = check_device(&st, dev)?;
        st.reset_ctx(d);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Handle) -> i32 {
    crate::calls::count("cuCtxGetCurrent");
    run(|| {
        let _st = begin()?;
        let h = current_ctx().map_or(std::ptr::null_mut(), |c| handle(Kind::Ctx, c));
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(ctx, h) }
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: Handle) -> i32 {
    crate::calls::count("cuCtxSetCurrent");
    run(|| {
        let st = begin()?;
        if ctx.is_null() {
            set_current_ctx(None);
            return Ok(());
        }
        let c = ctx_of(&st, ctx)?;
        if st.ctxs[c].retained == 0 {
            return Err(cu::INVALID_CONTEXT);
        }
        set_current_ctx(Some(c));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> i32 {
    crate::calls::count("cuCtxGetDevice");
    run(|| {
        let st = begin()?;
        let c = current(&st)?;
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(dev, st.ctxs[c].device as c_int) }
    })
}

/// Waits for every stream of context `ctx`.
fn sync_ctx(st: MutexGuard<'static, State>, ctx: usize) -> Result<(), i32> {
    let targets: Vec<(usize, u64)> = (0..st.streams.len())
        .filter(|&s| st.streams[s].ctx == ctx)
        .map(|s| (s, st.streams[s].enq))
        .collect();
    // The clocks of the work waited for: not of what other threads enqueue meanwhile.
    let clocks: Vec<state::Vc> = targets
        .iter()
        .map(|&(s, _)| st.streams[s].vc.clone())
        .collect();
    let (mut st, ok) = state::wait_until(
        st,
        &targets,
        &|| format!("cuCtxSynchronize (gpu {ctx})"),
        &|st| targets.iter().all(|&(s, p)| st.streams[s].done >= p),
    );
    if !ok {
        return Err(cu::LAUNCH_TIMEOUT);
    }
    let mut first = cu::SUCCESS;
    for (&(s, p), vc) in targets.iter().zip(&clocks) {
        st.host_vc.join(vc);
        let e = st.take_errors_upto(s, p);
        if first == cu::SUCCESS {
            first = e;
        }
    }
    if first != cu::SUCCESS {
        return Err(first);
    }
    Ok(())
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> i32 {
    crate::calls::count("cuCtxSynchronize");
    run(|| {
        let st = begin()?;
        let c = current(&st)?;
        sync_ctx(st, c)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxEnablePeerAccess(peer: Handle, flags: c_uint) -> i32 {
    crate::calls::count("cuCtxEnablePeerAccess");
    run(|| {
        let mut st = begin()?;
        let c = current(&st)?;
        let p = ctx_of(&st, peer)?;
        let (from, to) = (st.ctxs[c].device, st.ctxs[p].device);
        if flags != 0 {
            return Err(cu::INVALID_VALUE);
        }
        if from == to || !st.cfg.p2p {
            return Err(cu::INVALID_DEVICE);
        }
        if !st.peer.insert((from, to)) {
            return Err(cu::PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxDisablePeerAccess(peer: Handle) -> i32 {
    crate::calls::count("cuCtxDisablePeerAccess");
    run(|| {
        let mut st = begin()?;
        let c = current(&st)?;
        let p = ctx_of(&st, peer)?;
        let key = (st.ctxs[c].device, st.ctxs[p].device);
        if !st.peer.remove(&key) {
            return Err(cu::PEER_ACCESS_NOT_ENABLED);
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Streams and events.

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut Handle, _flags: c_uint) -> i32 {
    crate::calls::count("cuStreamCreate");
    run(|| {
        let mut st = begin()?;
        let c = current(&st)?;
        if stream.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        let s = st.new_stream(c);
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(stream, handle(Kind::Stream, s)) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut Handle,
    flags: c_uint,
    _priority: c_int,
) -> i32 {
    crate::calls::count("cuStreamCreateWithPriority");
    // SAFETY: same contract as cuStreamCreate.
    unsafe { cuStreamCreate(stream, flags) }
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: Handle) -> i32 {
    crate::calls::count("cuStreamDestroy_v2");
    run(|| {
        let mut st = begin()?;
        if stream.is_null() {
            return Err(cu::INVALID_HANDLE);
        }
        let s = stream_of(&mut st, stream)?;
        // Work already enqueued still runs (CUDA's rule); the handle is dead from now on.
        st.streams[s].live = false;
        Ok(())
    })
}

/// Waits until stream `s` has done everything enqueued before this call.
fn sync_stream(st: MutexGuard<'static, State>, s: usize, what: &str) -> Result<(), i32> {
    let target = st.streams[s].enq;
    // The clock of the work waited for: not of what other threads enqueue meanwhile.
    let vc = st.streams[s].vc.clone();
    let name = st.stream_name(s);
    let (mut st, ok) =
        state::wait_until(st, &[(s, target)], &|| format!("{what} on {name}"), &|st| {
            st.streams[s].done >= target
        });
    if !ok {
        return Err(cu::LAUNCH_TIMEOUT);
    }
    st.host_vc.join(&vc);
    match st.take_errors_upto(s, target) {
        cu::SUCCESS => Ok(()),
        e => Err(e),
    }
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: Handle) -> i32 {
    crate::calls::count("cuStreamSynchronize");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        sync_stream(st, s, "cuStreamSynchronize")
    })
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(stream: Handle) -> i32 {
    crate::calls::count("cuStreamQuery");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        let target = st.streams[s].enq;
        let vc = st.streams[s].vc.clone();
        // A query runs what it asks about, as a wait does: code that asks is synchronized.
        if st.run_ready(&state::Scope::Upto(&[(s, target)])) {
            state::notify();
        }
        if st.streams[s].done < target {
            return Err(cu::NOT_READY);
        }
        st.host_vc.join(&vc);
        match st.take_errors_upto(s, target) {
            cu::SUCCESS => Ok(()),
            e => Err(e),
        }
    })
}

fn event_of(st: &State, h: Handle) -> Result<usize, i32> {
    match unhandle(Kind::Event, h) {
        Some(e) if e < st.events.len() && st.events[e].live => {
            usable(st, st.events[e].ctx)?;
            Ok(e)
        }
        _ => Err(cu::INVALID_HANDLE),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(event: *mut Handle, _flags: c_uint) -> i32 {
    crate::calls::count("cuEventCreate");
    run(|| {
        let mut st = begin()?;
        let c = current(&st)?;
        if event.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        st.events.push(state::Event {
            ctx: c,
            live: true,
            recorded: None,
        });
        let e = st.events.len() - 1;
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(event, handle(Kind::Event, e)) }
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(event: Handle) -> i32 {
    crate::calls::count("cuEventDestroy_v2");
    run(|| {
        let mut st = begin()?;
        let e = event_of(&st, event)?;
        st.events[e].live = false;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecord(event: Handle, stream: Handle) -> i32 {
    crate::calls::count("cuEventRecord");
    run(|| {
        let mut st = begin()?;
        let e = event_of(&st, event)?;
        let s = stream_of(&mut st, stream)?;
        if st.events[e].ctx != st.streams[s].ctx {
            return Err(reject(
                cu::INVALID_HANDLE,
                format!(
                    "cuEventRecord: the event belongs to gpu {}'s context and {} to another; \
                     CUDA refuses to record an event on another context's stream",
                    st.ctxs[st.events[e].ctx].device,
                    st.stream_name(s)
                ),
            ));
        }
        let vc = st.streams[s].vc.clone();
        let pos = st.streams[s].enq;
        st.events[e].recorded = Some((s, pos, vc));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecordWithFlags(event: Handle, stream: Handle, _flags: c_uint) -> i32 {
    crate::calls::count("cuEventRecordWithFlags");
    cuEventRecord(event, stream)
}

/// Whether event `e`'s recorded work is done; on done, the host has seen it (joins its clock)
/// and any error of that work is returned.
fn event_done(st: &mut State, e: usize) -> Option<Result<(), i32>> {
    let Some((s, pos, vc)) = st.events[e].recorded.clone() else {
        return Some(Ok(()));
    };
    if st.streams[s].done < pos {
        return None;
    }
    st.host_vc.join(&vc);
    Some(match st.take_errors_upto(s, pos) {
        cu::SUCCESS => Ok(()),
        code => Err(code),
    })
}

#[no_mangle]
pub extern "C" fn cuEventQuery(event: Handle) -> i32 {
    crate::calls::count("cuEventQuery");
    run(|| {
        let mut st = begin()?;
        let e = event_of(&st, event)?;
        // A query runs what it asks about, as a wait does: code that asks is synchronized.
        if let Some((s, pos, _)) = st.events[e].recorded {
            if st.run_ready(&state::Scope::Upto(&[(s, pos)])) {
                state::notify();
            }
        }
        event_done(&mut st, e).unwrap_or(Err(cu::NOT_READY))
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(event: Handle) -> i32 {
    crate::calls::count("cuEventSynchronize");
    run(|| {
        let st = begin()?;
        let e = event_of(&st, event)?;
        let Some((s, pos, _)) = st.events[e].recorded.clone() else {
            return Ok(());
        };
        let name = st.stream_name(s);
        let (mut st, ok) = state::wait_until(
            st,
            &[(s, pos)],
            &|| format!("cuEventSynchronize (an event on {name})"),
            &|st| st.streams[s].done >= pos,
        );
        if !ok {
            return Err(cu::LAUNCH_TIMEOUT);
        }
        event_done(&mut st, e).expect("done")
    })
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(stream: Handle, event: Handle, flags: c_uint) -> i32 {
    crate::calls::count("cuStreamWaitEvent");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        let e = event_of(&st, event)?;
        if flags != 0 {
            return Err(cu::INVALID_VALUE);
        }
        // An event never recorded is complete: waiting on it does nothing.
        let Some((src, upto, vc)) = st.events[e].recorded.clone() else {
            return Ok(());
        };
        st.streams[s].vc.join(&vc);
        let what = format!("cuStreamWaitEvent on {}", st.stream_name(s));
        st.enqueue(s, what, Work::Wait { stream: src, upto });
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuEventElapsedTime(_ms: *mut f32, _start: Handle, _end: Handle) -> i32 {
    crate::calls::count("cuEventElapsedTime");
    // Timings from the stand-in would be meaningless (and must never pass for a GPU's).
    report("cuEventElapsedTime: the stand-in has no GPU timings to give");
    cu::NOT_SUPPORTED
}

#[no_mangle]
pub extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: Handle, end: Handle) -> i32 {
    crate::calls::count("cuEventElapsedTime_v2");
    cuEventElapsedTime(ms, start, end)
}

// ---------------------------------------------------------------------------------------------
// Memory.

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut u64, bytes: usize, stream: Handle) -> i32 {
    crate::calls::count("cuMemAllocAsync");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        if dptr.is_null() || bytes == 0 {
            return Err(cu::INVALID_VALUE);
        }
        let device = st.device_of_stream(s);
        let base = st.alloc(device, bytes, true)?;
        let what = format!("cuMemAllocAsync({bytes} bytes) on {}", st.stream_name(s));
        st.enqueue(
            s,
            what,
            Work::Alloc {
                base,
                len: bytes as u64,
            },
        );
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(dptr, base) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> i32 {
    crate::calls::count("cuMemAlloc_v2");
    run(|| {
        let mut st = begin()?;
        let c = current(&st)?;
        if dptr.is_null() || bytes == 0 {
            return Err(cu::INVALID_VALUE);
        }
        let device = st.ctxs[c].device;
        let base = st.alloc(device, bytes, false)?;
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(dptr, base) }
    })
}

/// `CUmemLocation`: a device (type 1) and its ordinal.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemLocation {
    pub kind: c_uint,
    pub id: c_int,
}

/// `CUmemAccessDesc`: a location and the access it gets (0 none, 1 read, 3 read and write).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemAccessDesc {
    pub location: MemLocation,
    pub flags: c_uint,
}

const MEM_LOCATION_TYPE_DEVICE: c_uint = 1;

/// The pool a `CUmemoryPool` handle names: each device's default pool (the only pools here).
fn pool_of(st: &State, h: Handle) -> Result<usize, i32> {
    match unhandle(Kind::Pool, h) {
        Some(d) if d < st.cfg.gpus => Ok(d),
        _ => Err(cu::INVALID_VALUE),
    }
}

/// The device's default memory pool, which `cuMemAllocAsync` allocates from.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut Handle, dev: c_int) -> i32 {
    crate::calls::count("cuDeviceGetDefaultMemPool");
    run(|| {
        let st = begin()?;
        let d = check_device(&st, dev)?;
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(pool, handle(Kind::Pool, d)) }
    })
}

/// The device's current memory pool: its default one (no other pools are made here).
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut Handle, dev: c_int) -> i32 {
    crate::calls::count("cuDeviceGetMemPool");
    // SAFETY: the same contract.
    unsafe { cuDeviceGetDefaultMemPool(pool, dev) }
}

/// Grants devices access to a pool's memory (the only way kernels on another device may touch
/// it: peer access does not cover pools). The pool's own device always has read and write
/// access, which cannot be changed; other devices need `cuDeviceCanAccessPeer`.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAccess(
    pool: Handle,
    map: *const MemAccessDesc,
    count: usize,
) -> i32 {
    crate::calls::count("cuMemPoolSetAccess");
    run(|| {
        let mut st = begin()?;
        let p = pool_of(&st, pool)?;
        if map.is_null() && count > 0 {
            return Err(cu::INVALID_VALUE);
        }
        for i in 0..count {
            // SAFETY: `map` holds `count` descriptors, per the API.
            let d = unsafe { *map.add(i) };
            let to = d.location.id;
            if d.location.kind != MEM_LOCATION_TYPE_DEVICE || !matches!(d.flags, 0 | 1 | 3) {
                return Err(cu::INVALID_VALUE);
            }
            let to = check_device(&st, to)?;
            if to == p {
                if d.flags != 3 {
                    return Err(reject(
                        cu::INVALID_VALUE,
                        format!(
                            "cuMemPoolSetAccess: gpu {p}'s own access to its pool cannot be \
                             changed"
                        ),
                    ));
                }
                continue;
            }
            if !st.cfg.p2p {
                return Err(cu::INVALID_DEVICE);
            }
            match d.flags {
                0 => st.pool_access.remove(&(p, to)),
                f => st.pool_access.insert((p, to), f as i32),
            };
        }
        Ok(())
    })
}

/// The access a device has to a pool's memory.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAccess(
    flags: *mut c_uint,
    pool: Handle,
    location: *const MemLocation,
) -> i32 {
    crate::calls::count("cuMemPoolGetAccess");
    run(|| {
        let st = begin()?;
        let p = pool_of(&st, pool)?;
        if location.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        // SAFETY: a valid location, per the API.
        let loc = unsafe { *location };
        if loc.kind != MEM_LOCATION_TYPE_DEVICE {
            return Err(cu::INVALID_VALUE);
        }
        let d = check_device(&st, loc.id)?;
        let f = if d == p {
            3
        } else {
            st.pool_access.get(&(p, d)).copied().unwrap_or(0) as c_uint
        };
        // SAFETY: a valid out-pointer, per the API.
        unsafe { out(flags, f) }
    })
}

/// A stream-ordered allocation from `pool` (a device's default pool), on any device's stream.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut u64,
    bytes: usize,
    pool: Handle,
    stream: Handle,
) -> i32 {
    crate::calls::count("cuMemAllocFromPoolAsync");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        let device = pool_of(&st, pool)?;
        if dptr.is_null() || bytes == 0 {
            return Err(cu::INVALID_VALUE);
        }
        let base = st.alloc(device, bytes, true)?;
        let what = format!(
            "cuMemAllocFromPoolAsync({bytes} bytes, gpu {device}'s pool) on {}",
            st.stream_name(s)
        );
        st.enqueue(
            s,
            what,
            Work::Alloc {
                base,
                len: bytes as u64,
            },
        );
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(dptr, base) }
    })
}

/// Page-locked host memory: real host memory, recorded so that copies from it are read when
/// they run (see `Work::HtoDPinned`). Any flags are accepted.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: c_uint) -> i32 {
    crate::calls::count("cuMemHostAlloc");
    run(|| {
        let mut st = begin()?;
        current(&st)?;
        if pp.is_null() || bytes == 0 {
            return Err(cu::INVALID_VALUE);
        }
        let layout =
            std::alloc::Layout::from_size_align(bytes, 4096).map_err(|_| cu::INVALID_VALUE)?;
        // SAFETY: a non-zero size (checked above).
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(cu::OUT_OF_MEMORY);
        }
        // Unwritten pinned memory reads as 0xff, as device memory does.
        // SAFETY: `p` is a fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(p, 0xff, bytes) };
        st.pinned.insert(p as usize, bytes);
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(pp, p.cast::<c_void>()) }
    })
}

/// `cuMemAllocHost`: `cuMemHostAlloc` with no flags.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> i32 {
    crate::calls::count("cuMemAllocHost_v2");
    // SAFETY: the same contract.
    unsafe { cuMemHostAlloc(pp, bytes, 0) }
}

/// Frees page-locked host memory, once the copies queued from or into it have run.
#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> i32 {
    crate::calls::count("cuMemFreeHost");
    run(|| {
        let st = begin()?;
        let Some(&bytes) = st.pinned.get(&(p as usize)) else {
            return Err(reject(
                cu::INVALID_VALUE,
                format!("cuMemFreeHost({p:?}): not a pinned allocation (a double free?)"),
            ));
        };
        // Freeing page-locked memory synchronizes with the device (as CUDA's does): the copies
        // queued from or into this buffer run first.
        let users = st.pinned_users(p as usize, bytes);
        let (mut st, ok) = state::wait_until(
            st,
            &users,
            &|| format!("cuMemFreeHost({p:?}), waiting for the copies queued with it"),
            &|st| users.iter().all(|&(s, pos)| st.streams[s].done >= pos),
        );
        if !ok {
            return Err(cu::LAUNCH_TIMEOUT);
        }
        if st.pinned.remove(&(p as usize)).is_none() {
            return Err(reject(
                cu::INVALID_VALUE,
                format!("cuMemFreeHost({p:?}): freed by another thread meanwhile"),
            ));
        }
        let layout =
            std::alloc::Layout::from_size_align(bytes, 4096).map_err(|_| cu::INVALID_VALUE)?;
        // SAFETY: `p` was allocated by cuMemHostAlloc with this layout and is freed once (it
        // was just removed from the table).
        unsafe { std::alloc::dealloc(p.cast::<u8>(), layout) };
        Ok(())
    })
}

/// The allocation base `ptr` must be, for a free.
fn check_free(st: &State, call: &str, ptr: u64) -> Result<(), i32> {
    match st.locate(ptr, 0) {
        Ok((_, base)) if base == ptr => Ok(()),
        Ok((_, base)) => Err(reject(
            cu::INVALID_VALUE,
            format!("{call}({ptr:#x}): not the start of an allocation (that is {base:#x})"),
        )),
        Err(e) => Err(reject(
            cu::INVALID_VALUE,
            format!("{call}({ptr:#x}): {e} (a double free?)"),
        )),
    }
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(ptr: u64, stream: Handle) -> i32 {
    crate::calls::count("cuMemFreeAsync");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        check_free(&st, "cuMemFreeAsync", ptr)?;
        st.freeing.insert(ptr);
        let what = format!("cuMemFreeAsync({ptr:#x}) on {}", st.stream_name(s));
        let pos = st.enqueue(s, what, Work::Free { base: ptr });
        match st.take_error_at(s, pos) {
            cu::SUCCESS => Ok(()),
            e => Err(e),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> i32 {
    crate::calls::count("cuMemFree_v2");
    run(|| {
        let st = begin()?;
        let c = current(&st)?;
        check_free(&st, "cuMemFree", ptr)?;
        // cuMemFree waits for the device first; then frees.
        sync_ctx(st, c)?;
        let mut st = lock();
        let s = match st.ctxs[c].null_stream {
            Some(s) => s,
            None => {
                let s = st.new_stream(c);
                st.ctxs[c].null_stream = Some(s);
                s
            }
        };
        st.freeing.insert(ptr);
        let what = format!("cuMemFree({ptr:#x})");
        let pos = st.enqueue(s, what.clone(), Work::Free { base: ptr });
        let (mut st, ok) = state::wait_until(st, &[(s, pos)], &|| what.clone(), &|st| {
            st.streams[s].done >= pos
        });
        if !ok {
            return Err(cu::LAUNCH_TIMEOUT);
        }
        match st.take_error_at(s, pos) {
            cu::SUCCESS => Ok(()),
            e => Err(e),
        }
    })
}

/// Enqueues `work` on `s` and returns the operation's own error if it already ran and failed.
fn enqueue_checked(st: &mut State, s: usize, what: String, work: Work) -> Result<(), i32> {
    let pos = st.enqueue(s, what, work);
    match st.take_error_at(s, pos) {
        cu::SUCCESS => Ok(()),
        e => Err(e),
    }
}

/// Checks, at call time, that `[ptr, ptr + len)` is live device memory that work on stream
/// `s` may touch (its device, or one it has peer access to).
fn check_range(st: &State, call: &str, s: usize, ptr: u64, len: usize) -> Result<(), i32> {
    if len == 0 {
        return Ok(());
    }
    let (device, _) = st
        .locate(ptr, len)
        .map_err(|e| reject(cu::INVALID_VALUE, format!("{call}: {e}")))?;
    st.check_peer(st.device_of_stream(s), device, ptr)
        .map_err(|(code, m)| reject(code, format!("{call}: {m}")))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(dst: u64, value: u8, n: usize, stream: Handle) -> i32 {
    crate::calls::count("cuMemsetD8Async");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        check_range(&st, "cuMemsetD8Async", s, dst, n)?;
        let what = format!(
            "cuMemsetD8Async({dst:#x}, {n} bytes) on {}",
            st.stream_name(s)
        );
        enqueue_checked(&mut st, s, what, Work::Memset { dst, value, len: n })
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    bytes: usize,
    stream: Handle,
) -> i32 {
    crate::calls::count("cuMemcpyHtoDAsync_v2");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        if bytes == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        let (_, _) = st
            .locate(dst, bytes)
            .map_err(|e| reject(cu::INVALID_VALUE, format!("cuMemcpyHtoDAsync: {e}")))?;
        // Pageable host memory is staged at the call (CUDA's rule), so the caller may reuse
        // its buffer as soon as this returns. Pinned memory is read when the copy runs.
        // SAFETY: the caller's source holds `bytes` readable bytes (the API's contract).
        let data = unsafe { std::slice::from_raw_parts(src as *const u8, bytes) }.to_vec();
        let pinned = st.pinned_range(src as usize, bytes).is_some();
        let what = format!(
            "cuMemcpyHtoDAsync({dst:#x}, {bytes} bytes{}) on {}",
            if pinned { " from pinned memory" } else { "" },
            st.stream_name(s)
        );
        let work = if pinned {
            crate::calls::add(crate::calls::PINNED_HTOD_BYTES, bytes as u64);
            Work::HtoDPinned {
                dst,
                src: src as usize,
                snapshot: data,
            }
        } else {
            crate::calls::add(crate::calls::PAGEABLE_HTOD_BYTES, bytes as u64);
            Work::HtoD { dst, data }
        };
        enqueue_checked(&mut st, s, what, work)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    bytes: usize,
    stream: Handle,
) -> i32 {
    crate::calls::count("cuMemcpyDtoHAsync_v2");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        if bytes == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        let (_, _) = st
            .locate(src, bytes)
            .map_err(|e| reject(cu::INVALID_VALUE, format!("cuMemcpyDtoHAsync: {e}")))?;
        if st.pinned_range(dst as usize, bytes).is_some() {
            // Into page-locked memory the copy is asynchronous: the call returns now, and the
            // destination holds POISON until the copy runs (see `Work::DtoHPinned`), except
            // the bytes a queued copy still reads or writes (those stay as they are).
            let expect = st.poison_pinned(dst as usize, bytes);
            let what = format!(
                "cuMemcpyDtoHAsync({src:#x}, {bytes} bytes, into pinned memory) on {}",
                st.stream_name(s)
            );
            let work = Work::DtoHPinned {
                dst: dst as usize,
                src,
                expect,
            };
            return enqueue_checked(&mut st, s, what, work);
        }
        let what = format!(
            "cuMemcpyDtoHAsync({src:#x}, {bytes} bytes) on {}",
            st.stream_name(s)
        );
        let name = what.clone();
        let (pos, vc) = st.push_op(
            s,
            what,
            Work::DtoH {
                dst: dst as usize,
                src,
                len: bytes,
            },
        );
        // To pageable memory the copy is done when the call returns (CUDA's rule): wait.
        let (mut st, ok) = state::wait_until(st, &[(s, pos)], &|| name.clone(), &|st| {
            st.streams[s].done >= pos
        });
        if !ok {
            // Never write into the caller's buffer after this returns.
            if let Some(op) = st.streams[s].queue.iter_mut().find(|o| o.pos == pos) {
                op.work = Work::Nothing;
            }
            return Err(cu::LAUNCH_TIMEOUT);
        }
        st.host_vc.join(&vc);
        match st.take_errors_upto(s, pos) {
            cu::SUCCESS => Ok(()),
            e => Err(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: u64,
    src: u64,
    bytes: usize,
    stream: Handle,
) -> i32 {
    crate::calls::count("cuMemcpyDtoDAsync_v2");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        if bytes == 0 {
            return Ok(());
        }
        check_range(&st, "cuMemcpyDtoDAsync (source)", s, src, bytes)?;
        check_range(&st, "cuMemcpyDtoDAsync (destination)", s, dst, bytes)?;
        let what = format!(
            "cuMemcpyDtoDAsync({dst:#x} <- {src:#x}, {bytes} bytes) on {}",
            st.stream_name(s)
        );
        let work = Work::DtoD {
            dst,
            src,
            len: bytes,
            staged: false,
        };
        enqueue_checked(&mut st, s, what, work)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: u64,
    dst_ctx: Handle,
    src: u64,
    src_ctx: Handle,
    bytes: usize,
    stream: Handle,
) -> i32 {
    crate::calls::count("cuMemcpyPeerAsync");
    run(|| {
        let mut st = begin()?;
        let s = stream_of(&mut st, stream)?;
        let (dc, sc) = (ctx_of(&st, dst_ctx)?, ctx_of(&st, src_ctx)?);
        if bytes == 0 {
            return Ok(());
        }
        for (call, ptr, ctx) in [("destination", dst, dc), ("source", src, sc)] {
            let (device, _) = st.locate(ptr, bytes).map_err(|e| {
                reject(
                    cu::INVALID_VALUE,
                    format!("cuMemcpyPeerAsync ({call}): {e}"),
                )
            })?;
            if device != st.ctxs[ctx].device {
                return Err(reject(
                    cu::INVALID_VALUE,
                    format!(
                        "cuMemcpyPeerAsync: the {call} {ptr:#x} is memory of gpu {device}, but \
                         the context given for it is gpu {}'s",
                        st.ctxs[ctx].device
                    ),
                ));
            }
        }
        let what = format!(
            "cuMemcpyPeerAsync({dst:#x} on gpu {} <- {src:#x} on gpu {}, {bytes} bytes) on {}",
            st.ctxs[dc].device,
            st.ctxs[sc].device,
            st.stream_name(s)
        );
        // A peer copy needs no peer access (it is staged when access is off); its accesses
        // are checked for races like any other.
        let work = Work::DtoD {
            dst,
            src,
            len: bytes,
            staged: true,
        };
        enqueue_checked(&mut st, s, what, work)
    })
}

/// The synchronous copies: enqueue on the current context's NULL stream and wait for it.
fn sync_copy(body: impl FnOnce(Handle) -> i32) -> i32 {
    match body(std::ptr::null_mut()) {
        cu::SUCCESS => cuCtxSynchronize(),
        code => code,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, bytes: usize) -> i32 {
    crate::calls::count("cuMemcpyHtoD_v2");
    // SAFETY: same contract as the async form, on the NULL stream.
    sync_copy(|s| unsafe { cuMemcpyHtoDAsync_v2(dst, src, bytes, s) })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, bytes: usize) -> i32 {
    crate::calls::count("cuMemcpyDtoH_v2");
    // SAFETY: same contract as the async form, on the NULL stream.
    sync_copy(|s| unsafe { cuMemcpyDtoHAsync_v2(dst, src, bytes, s) })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, bytes: usize) -> i32 {
    crate::calls::count("cuMemcpyDtoD_v2");
    // SAFETY: same contract as the async form, on the NULL stream.
    sync_copy(|s| unsafe { cuMemcpyDtoDAsync_v2(dst, src, bytes, s) })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, n: usize) -> i32 {
    crate::calls::count("cuMemsetD8_v2");
    // SAFETY: same contract as the async form, on the NULL stream.
    sync_copy(|s| unsafe { cuMemsetD8Async(dst, value, n, s) })
}

// ---------------------------------------------------------------------------------------------
// Modules and launches.

/// `major.minor` of a directive's argument as major * 10 + minor (`7.1` -> 71, `sm_80` -> 80).
fn directive(text: &str, name: &str) -> Option<(u32, String)> {
    let line = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or("").trim())
        .find(|l| l.starts_with(name))?;
    let arg = line[name.len()..].trim().to_owned();
    let digits: String = arg.chars().filter(|c| c.is_ascii_digit()).collect();
    Some((digits.parse().ok()?, arg))
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> i32 {
    crate::calls::count("cuModuleLoadData");
    run(|| {
        let mut st = begin()?;
        let c = current(&st)?;
        if module.is_null() || image.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        // SAFETY: for PTX, the image is a NUL-terminated string (the API's contract for text
        // images, and what cudarc passes).
        let text = unsafe { CStr::from_ptr(image as *const c_char) };
        let text = text.to_str().map_err(|_| {
            reject(
                cu::INVALID_PTX,
                "cuModuleLoadData: the image is not UTF-8 PTX text (the stand-in runs PTX only)"
                    .into(),
            )
        })?;
        let sm = st.cfg.sm;
        match directive(text, ".target") {
            Some((t, arg)) if t > sm => {
                return Err(reject(
                    cu::NO_BINARY_FOR_GPU,
                    format!(
                        "cuModuleLoadData: the PTX's `.target {arg}` is above this device's \
                         compute capability sm_{sm} (KVSTORE_STANDIN_SM): the driver cannot JIT it \
                         for this GPU"
                    ),
                ))
            }
            Some(_) => {}
            None => {
                return Err(reject(
                    cu::INVALID_PTX,
                    "cuModuleLoadData: the PTX has no `.target`".into(),
                ))
            }
        }
        match directive(text, ".version") {
            Some((v, arg)) if v > st.cfg.ptx_isa => {
                return Err(reject(
                    cu::UNSUPPORTED_PTX_VERSION,
                    format!(
                        "cuModuleLoadData: PTX `.version {arg}` is newer than this driver's PTX \
                         ISA {}.{} (KVSTORE_STANDIN_PTX_ISA)",
                        st.cfg.ptx_isa / 10,
                        st.cfg.ptx_isa % 10
                    ),
                ))
            }
            Some(_) => {}
            None => {
                return Err(reject(
                    cu::INVALID_PTX,
                    "cuModuleLoadData: the PTX has no `.version`".into(),
                ))
            }
        }
        let parsed = Module::parse(text).map_err(|e| {
            let e = format!("{e:#}");
            // An instruction above the module's own `.target` or `.version`: ptxas refuses it
            // ("Feature 'cvt with .bf16' requires .target sm_80 or higher"), and so does the
            // driver's JIT, with CUDA_ERROR_INVALID_PTX.
            let why = if e.contains("requires .target")
                || e.contains("requires PTX ISA")
                || e.contains("needs PTX ISA")
            {
                "the PTX is invalid: it uses an instruction its own `.target` or `.version` does \
                 not have (ptxas and the driver's JIT refuse it too)"
            } else {
                "the stand-in's PTX interpreter refuses this module (it knows only the subset \
                 kvstore's kernels use; this need not be a PTX error)"
            };
            reject(cu::INVALID_PTX, format!("cuModuleLoadData: {why}: {e}"))
        })?;
        // Every instruction is within the `.target`, which is within the device (checked
        // above); checked once more per instruction, so a message names the instruction.
        if let Some(n) = parsed.needs.as_ref().filter(|n| n.sm > sm) {
            return Err(reject(
                cu::NO_BINARY_FOR_GPU,
                format!(
                    "cuModuleLoadData: {} ({}) needs sm_{}, above this device's compute \
                     capability sm_{sm} (KVSTORE_STANDIN_SM)",
                    n.what, n.at, n.sm
                ),
            ));
        }
        // The driver's JIT assembles the module for the device: so does ptxas here, which
        // says each entry's registers (and refuses what the JIT would).
        let regs = crate::regs::of_module(text, sm)
            .map_err(|m| reject(cu::INVALID_PTX, format!("cuModuleLoadData: {m}")))?;
        st.modules.push(LoadedModule {
            ctx: c,
            live: true,
            module: Arc::new(parsed),
            regs,
        });
        let m = st.modules.len() - 1;
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(module, handle(Kind::Module, m)) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    func: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> i32 {
    crate::calls::count("cuModuleGetFunction");
    run(|| {
        let mut st = begin()?;
        let m = match unhandle(Kind::Module, module) {
            Some(m) if m < st.modules.len() && st.modules[m].live => m,
            _ => return Err(cu::INVALID_HANDLE),
        };
        usable(&st, st.modules[m].ctx)?;
        if func.is_null() || name.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated name, per the API.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        let module = st.modules[m].module.clone();
        let entry = module
            .entries
            .iter()
            .position(|e| e.name == name)
            .ok_or(cu::NOT_FOUND)?;
        let ctx = st.modules[m].ctx;
        let regs = st.modules[m]
            .regs
            .as_ref()
            .and_then(|r| r.get(&*name).copied());
        st.functions.push(state::Function {
            ctx,
            live: true,
            module,
            entry,
            regs,
        });
        let f = st.functions.len() - 1;
        // SAFETY: non-null out-pointer, per the API.
        unsafe { out(func, handle(Kind::Function, f)) }
    })
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(module: Handle) -> i32 {
    crate::calls::count("cuModuleUnload");
    run(|| {
        let mut st = begin()?;
        match unhandle(Kind::Module, module) {
            Some(m) if m < st.modules.len() && st.modules[m].live => {
                st.modules[m].live = false;
                Ok(())
            }
            _ => Err(cu::INVALID_HANDLE),
        }
    })
}

/// The `extra` markers of `cuLaunchKernel`.
const LAUNCH_PARAM_END: usize = 0;
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> i32 {
    crate::calls::count("cuLaunchKernel");
    run(|| {
        let mut st = begin()?;
        let func = match unhandle(Kind::Function, f) {
            Some(i) if i < st.functions.len() && st.functions[i].live => i,
            _ => return Err(cu::INVALID_HANDLE),
        };
        let s = stream_of(&mut st, stream)?;
        let (fctx, module, entry) = {
            let fr = &st.functions[func];
            (fr.ctx, fr.module.clone(), fr.entry)
        };
        let entry = &module.entries[entry];
        let call = format!("cuLaunchKernel({})", entry.name);
        if fctx != st.streams[s].ctx {
            return Err(reject(
                cu::INVALID_HANDLE,
                format!(
                    "{call}: the function was loaded in gpu {}'s context, the launch is on {}",
                    st.ctxs[fctx].device,
                    st.stream_name(s)
                ),
            ));
        }
        // Products in u64: a u32 product of large dimensions could wrap to a small one.
        let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
        if threads > 1024
            || bx > 1024
            || by > 1024
            || bz > 64
            || gx > i32::MAX as c_uint
            || gy > 65535
            || gz > 65535
        {
            return Err(reject(
                cu::INVALID_VALUE,
                format!(
                    "{call}: grid ({gx}, {gy}, {gz}) x block ({bx}, {by}, {bz}) is over the limits"
                ),
            ));
        }
        if [gx, gy, gz, bx, by, bz].contains(&0) {
            return Err(reject(
                cu::INVALID_VALUE,
                format!("{call}: an empty grid ({gx}, {gy}, {gz}) x block ({bx}, {by}, {bz})"),
            ));
        }
        if shared > 49152 {
            return Err(cu::INVALID_VALUE);
        }
        if let Some(r) = st.functions[func].regs {
            let need = crate::regs::per_block(r, threads);
            if need > crate::regs::REGISTERS_PER_BLOCK {
                return Err(reject(
                    cu::LAUNCH_OUT_OF_RESOURCES,
                    format!(
                        "{call}: a block of {threads} threads of `{}` needs {need} registers \
                         ({r} per thread, as ptxas assembled it for this device), over the \
                         {} a block can have",
                        entry.name,
                        crate::regs::REGISTERS_PER_BLOCK
                    ),
                ));
            }
        }
        let size = entry
            .params
            .last()
            .map_or(0, |p| (p.offset + p.ty.bytes()) as usize);
        let mut block = vec![0u8; size];
        match (params.is_null(), extra.is_null()) {
            (false, false) => {
                return Err(reject(
                    cu::INVALID_VALUE,
                    format!("{call}: both kernelParams and extra are given"),
                ))
            }
            (true, true) if size > 0 => {
                return Err(reject(
                    cu::INVALID_VALUE,
                    format!("{call}: the entry takes {size} bytes of parameters and none came"),
                ))
            }
            (true, true) => {}
            (false, true) => {
                for (i, p) in entry.params.iter().enumerate() {
                    // SAFETY: `params` holds one pointer per parameter of the entry (the API's
                    // contract; the driver reads exactly as many, knowing no other count).
                    let ptr = unsafe { *params.add(i) } as *const u8;
                    let n = p.ty.bytes() as usize;
                    if ptr.is_null() || ptr as usize % n != 0 {
                        return Err(reject(
                            cu::INVALID_VALUE,
                            format!(
                                "{call}: parameter {i} `{}` is .{:?} ({n} bytes), but its \
                                 argument pointer {ptr:?} is {} (the value passed is not {n} \
                                 bytes wide)",
                                p.name,
                                p.ty,
                                if ptr.is_null() {
                                    "null"
                                } else {
                                    "not aligned for it"
                                }
                            ),
                        ));
                    }
                    let at = p.offset as usize;
                    // SAFETY: the pointer is non-null and names the argument's value, which
                    // has the parameter's size by the API's contract (checked above as far as
                    // alignment can tell).
                    unsafe { std::ptr::copy_nonoverlapping(ptr, block[at..].as_mut_ptr(), n) };
                }
            }
            (true, false) => {
                let (mut buf, mut len) = (std::ptr::null::<u8>(), None);
                for i in (0..).step_by(2) {
                    // SAFETY: `extra` is a list of (marker, value) pointer pairs ended by
                    // CU_LAUNCH_PARAM_END, per the API.
                    let key = unsafe { *extra.add(i) } as usize;
                    if key == LAUNCH_PARAM_END {
                        break;
                    }
                    // SAFETY: as above: every marker but the end one has a value after it.
                    let value = unsafe { *extra.add(i + 1) };
                    match key {
                        LAUNCH_PARAM_BUFFER_POINTER => buf = value as *const u8,
                        LAUNCH_PARAM_BUFFER_SIZE if !value.is_null() => {
                            // SAFETY: the size marker's value points to a size_t, per the API.
                            len = Some(unsafe { *(value as *const usize) })
                        }
                        _ => return Err(cu::INVALID_VALUE),
                    }
                }
                let Some(len) = len.filter(|_| !buf.is_null()) else {
                    return Err(reject(
                        cu::INVALID_VALUE,
                        format!("{call}: extra needs both a buffer pointer and its size"),
                    ));
                };
                if len != size {
                    return Err(reject(
                        cu::INVALID_VALUE,
                        format!(
                            "{call}: the parameter buffer is {len} bytes; the entry's parameters \
                             ({}) take {size}",
                            entry
                                .params
                                .iter()
                                .map(|p| format!(".{:?} {}", p.ty, p.name))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ));
                }
                // SAFETY: the buffer holds `len` bytes (its size marker says so).
                block.copy_from_slice(unsafe { std::slice::from_raw_parts(buf, len) });
            }
        }
        let args: Vec<Arg> = entry
            .params
            .iter()
            .map(|p| {
                let at = p.offset as usize;
                let b = &block[at..at + p.ty.bytes() as usize];
                match p.ty.bytes() {
                    8 => Arg::U64(u64::from_le_bytes(b.try_into().expect("8 bytes"))),
                    _ if p.ty == Ty::F32 => {
                        Arg::F32(f32::from_le_bytes(b.try_into().expect("4 bytes")))
                    }
                    _ => Arg::U32(u32::from_le_bytes(b.try_into().expect("4 bytes"))),
                }
            })
            .collect();
        let what = format!("{call} on {}", st.stream_name(s));
        let blocks = u64::from(gx) * u64::from(gy) * u64::from(gz);
        crate::calls::add(crate::calls::BLOCKS_LAUNCHED, blocks);
        enqueue_checked(
            &mut st,
            s,
            what,
            Work::Launch {
                func,
                grid: (gx, gy, gz),
                block: (bx, by, bz),
                args,
                counts: crate::calls::mine(),
            },
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// (name, description) of a result code.
fn describe(code: i32) -> Option<(&'static CStr, &'static CStr)> {
    Some(match code {
        0 => (c"CUDA_SUCCESS", c"no error"),
        1 => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        2 => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        3 => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        100 => (c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
        101 => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        200 => (c"CUDA_ERROR_INVALID_IMAGE", c"device kernel image is invalid"),
        201 => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        209 => (
            c"CUDA_ERROR_NO_BINARY_FOR_GPU",
            c"no kernel image is available for execution on the device",
        ),
        218 => (c"CUDA_ERROR_INVALID_PTX", c"a PTX JIT compilation failed"),
        222 => (
            c"CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
            c"the provided PTX was compiled with an unsupported toolchain.",
        ),
        400 => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        401 => (
            c"CUDA_ERROR_ILLEGAL_STATE",
            c"the operation cannot be performed in the present state (stand-in: see its report on stderr)",
        ),
        500 => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        600 => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        700 => (
            c"CUDA_ERROR_ILLEGAL_ADDRESS",
            c"an illegal memory access was encountered",
        ),
        701 => (
            c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            c"too many resources requested for launch",
        ),
        702 => (
            c"CUDA_ERROR_LAUNCH_TIMEOUT",
            c"the launch timed out and was terminated (stand-in: a host wait that could never finish)",
        ),
        704 => (
            c"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
            c"peer access is already enabled",
        ),
        705 => (
            c"CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
            c"peer access has not been enabled",
        ),
        716 => (c"CUDA_ERROR_MISALIGNED_ADDRESS", c"misaligned address"),
        719 => (c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure"),
        801 => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: c_int, text: *mut *const c_char) -> i32 {
    crate::calls::count("cuGetErrorString");
    let Some((_, d)) = describe(code) else {
        return cu::INVALID_VALUE;
    };
    // SAFETY: a valid out-pointer, per the API; the string is static.
    run(|| unsafe { out(text, d.as_ptr()) })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: c_int, text: *mut *const c_char) -> i32 {
    crate::calls::count("cuGetErrorName");
    let Some((n, _)) = describe(code) else {
        return cu::INVALID_VALUE;
    };
    // SAFETY: a valid out-pointer, per the API; the string is static.
    run(|| unsafe { out(text, n.as_ptr()) })
}

/// Marks the library as the stand-in (for scripts and tests that must know).
#[no_mangle]
pub extern "C" fn kvstore_standin_driver() -> c_int {
    crate::calls::count("kvstore_standin_driver");
    notify();
    1
}

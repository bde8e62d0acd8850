//! A stand-in for `libcuda.so` and `libnccl.so`, so that kvstore's GPU host path runs in CI
//! on a machine with no GPU. **It is not a GPU, and nothing measured on it is a GPU result.**
//!
//! cudarc (with `dynamic-loading`) dlopens `libcuda.so` and `libnccl.so` by name and resolves
//! each symbol on first use. `scripts/standin-gpu-tests.sh` builds this crate as a `cdylib`,
//! puts it under both names in one folder first on `LD_LIBRARY_PATH`, and runs the tests that
//! are `#[ignore = "needs a GPU"]`. Both names are links to one file, so the dynamic loader maps
//! it once: the driver half and the NCCL half share one state.
//!
//! # The model
//!
//! - **Devices** (`KVSTORE_STANDIN_GPUS`, default 2) each have one primary context. Device
//!   memory is host memory in the PTX interpreter's [`emu::Memory`]: one address space for all
//!   devices, every allocation in its own 4 GiB slot, so an overrun hits nothing, and addresses
//!   are never reused, so a use after free is always seen. New memory is filled with `0xff`
//!   bytes (NaN in every float type), so reading memory nobody wrote shows.
//! - **Streams are queues.** Every copy, memset, launch, allocation, free, event wait and
//!   collective is an operation at the back of its stream's queue. An operation runs when it is
//!   at the front and ready (an event wait: the event's work is done; a collective: every rank's
//!   part is at the front of its stream). Whatever is ready runs at once, on the thread that made
//!   it ready, under one lock; operations that are not ready wait in their queues, and a host
//!   wait (`cuStreamSynchronize`, `cuEventSynchronize`, ...) blocks until they have run. So order
//!   is exactly stream order plus event waits plus collectives, as on a GPU; only the timing
//!   differs (nothing overlaps).
//! - **Kernels** run on the interpreter in `tests/ptx_emulator` (bounds, alignment, races
//!   between the threads of one launch, uninitialized registers).
//! - **Happens-before.** Each stream has a vector clock; an event records its stream's clock,
//!   a wait joins it, a host wait joins the clock of what it waited for into a host clock that
//!   every later operation (from any thread) joins, and a collective joins the clocks of the
//!   ranks whose data a rank receives. Every access to device memory (a kernel's, as the
//!   interpreter saw it, a copy's, a collective's, an allocation's or a free's) is checked
//!   against the earlier accesses of other streams: two accesses that overlap, where one
//!   writes, with no happens-before edge between them, are a race.
//! - **NCCL**: communicators per clique (`ncclCommInitAll`, or `ncclCommInitRank` /
//!   `ncclCommInitRankConfig` with an id from `ncclGetUniqueId`), groups per thread,
//!   collectives matched per clique by issue order and run when every rank's part reaches the
//!   front of its stream. A communicator made with `blocking = 0` is non-blocking: its init,
//!   collectives, `ncclGroupEnd` and `ncclCommFinalize` return `ncclInProgress`, and
//!   `ncclCommGetAsyncError` answers `ncclInProgress` until the work is done (a collective:
//!   for one poll).
//! - **NCCL across processes** (`xproc`): ranks in separate processes of one machine (mpirun,
//!   or a torchrun-style launch) that join with the same unique id form one clique through a
//!   folder named after the id (`KVSTORE_STANDIN_SHM_DIR`, else `/dev/shm`): each rank writes
//!   a file when it joins, and joining ends when every rank has seen every other (a bootstrap
//!   is a collective). Each process keeps its own devices (`KVSTORE_STANDIN_GPUS` of them) and
//!   memory; a collective is matched by issue order as in one process, and when every part of
//!   a process is at the front of its stream that process writes its parts (header and sent
//!   bytes) for the others, reads theirs, and runs its own ranks' share. A thread of the process
//!   keeps moving such work every few milliseconds, as a GPU progresses while the host is
//!   busy elsewhere. With `NCCL_COMM_ID=host:port` set, `ncclGetUniqueId` returns an id made
//!   from that address alone, as NCCL's `bootstrapGetUniqueId` (src/bootstrap.cc) does, so
//!   every process of a job computes the same id by itself.
//!
//! # What it rejects
//!
//! Each rejection prints a line starting `[kvstore stand-in]` to stderr naming the call, and
//! the call (or, for an operation that ran later, the next call that waits for it) returns an
//! error code.
//!
//! - A launch whose parameters do not fit the `.entry`: through `extra`, a parameter buffer
//!   whose size differs from the entry's; through `kernelParams`, a null pointer, or a pointer
//!   not aligned for its parameter's type (a narrower value was passed: a `u64` is always 8-byte
//!   aligned). The driver API passes no sizes with `kernelParams`, so a wrong count there cannot
//!   be seen (the real driver reads just as blindly).
//! - PTX whose `.target` is above the device's compute capability (`KVSTORE_STANDIN_SM`,
//!   default 90; CI runs 70, 80 and 90), or whose `.version` is above the driver's PTX ISA
//!   (`KVSTORE_STANDIN_PTX_ISA`, default 8.8), or that the interpreter does not understand
//!   (all `CUDA_ERROR_NO_BINARY_FOR_GPU`, `_UNSUPPORTED_PTX_VERSION` or `_INVALID_PTX`).
//! - PTX with an instruction above its own `.target` or `.version` (`cvt.rn.bf16.f32` needs
//!   sm_80 and ISA 7.0, `cvt.f32.bf16` sm_80 and 7.1), or a `.target` its `.version` does not
//!   know (sm_90 needs 7.8): `CUDA_ERROR_INVALID_PTX`, as ptxas and the JIT refuse it.
//! - **Sticky errors.** A kernel that faults (an illegal or misaligned address: out of bounds,
//!   freed memory, address 0) poisons its context, as on a GPU: every later call on that
//!   context (copies, launches, waits, allocations, module loads, stream and event calls)
//!   returns the same code, and work already queued there does not run, until the context is
//!   reset (`cuDevicePrimaryCtxReset_v2`, or the last `cuDevicePrimaryCtxRelease_v2`), which
//!   destroys its streams, events, modules and memory. Other devices' contexts go on.
//! - **Memory capacity.** Each device has `KVSTORE_STANDIN_MEM_GIB` GiB (default 80; a
//!   fraction is fine): allocations beyond what is free fail with `CUDA_ERROR_OUT_OF_MEMORY`,
//!   and `cuMemGetInfo` / `cuDeviceTotalMem` report it. Memory freed with `cuMemFreeAsync`
//!   comes back when the free runs, in stream order. One allocation holds at most 4 GiB here.
//! - **Memory pools.** `cuMemAllocAsync` and `cuMemAllocFromPoolAsync` allocate from the
//!   device's default pool (`cuDeviceGetDefaultMemPool`). A kernel on another device reaches
//!   pool memory only with the pool's access (`cuMemPoolSetAccess`: read, or read and write),
//!   never through `cuCtxEnablePeerAccess`, as the CUDA programming guide says of the
//!   stream-ordered allocator; plain `cuMemAlloc` memory needs peer access as before.
//! - A launch over the block limits: more than 1024 threads per block, a block above
//!   (1024, 1024, 64) or a grid above (2^31 - 1, 65535, 65535), with the products in 64 bits.
//! - A race between streams (above); a use after free or a double free; an access out of
//!   bounds; a kernel or copy touching another device's memory without peer access enabled
//!   (`cuCtxEnablePeerAccess`; `cuMemcpyPeerAsync` needs none).
//! - A copy from pinned host memory (`cuMemHostAlloc`; read when the copy runs, as a GPU's DMA
//!   reads it) whose buffer the host rewrote or freed before the copy ran.
//! - A function launched on a stream of another context; an event recorded on a stream of
//!   another context.
//! - NCCL: one thread issuing several ranks' parts of one collective outside
//!   `ncclGroupStart`/`ncclGroupEnd` (a deadlock with real NCCL); collectives whose kind,
//!   count, datatype, operation or root differ across ranks; buffers not on the rank's
//!   device or not large enough; two ranks on one device unless the reported version is
//!   ≥ 2.30 and `NCCL_MULTI_RANK_GPU_ENABLE=1`; use of an aborted communicator; a call on a
//!   non-blocking communicator still in progress (NCCL requires polling to `ncclSuccess`
//!   first); `ncclCommInitRankConfig` when the reported version is below 2.14.
//! - A host wait that cannot finish (a collective a rank never joins, an `ncclCommInitRank`
//!   whose other ranks never come, in this process or another) returns an error after
//!   `KVSTORE_STANDIN_HANG_S` seconds (default 120) instead of hanging CI, saying what it
//!   waited for.
//! - Across processes: a collective whose kind, count, datatype, operation or root differs
//!   from another process's part is refused in every process when the parts meet: the stream
//!   operation fails (`CUDA_ERROR_LAUNCH_FAILED` at the next wait) and the communicators report
//!   `ncclInvalidUsage`. A rank whose process is gone (killed, exited) while a collective waits
//!   for its part makes this process's communicators report `ncclRemoteError` from
//!   `ncclCommGetAsyncError`; the collective stays blocked, as real NCCL's kernels do, until
//!   `ncclCommAbort` (a blocking host wait on it fails after `KVSTORE_STANDIN_HANG_S`). Ranks of
//!   different processes on one device number are two ranks on one GPU (the rule above), and
//!   ranks that disagree on the number of ranks are refused. A clique's folder is removed by
//!   the last process to leave it (its communicators ended, or it exited: an `atexit` hook
//!   leaves for a process that never ended them; a killed process counts as gone).
//!
//! Call counts: `KVSTORE_STANDIN_COUNT_CALLS=1` prints how often each entry point was called,
//! at exit, to stderr (`[stand-in calls] name count` lines); the exported
//! `kvstore_standin_thread_calls(name)` gives the calling thread's count to a test (see
//! `calls`).
//!
//! Other settings: `KVSTORE_STANDIN_NCCL_VERSION` (default 23007, i.e. 2.30.7),
//! `KVSTORE_STANDIN_P2P` (whether `cuDeviceCanAccessPeer` says yes; default 1),
//! `KVSTORE_STANDIN_NCCL_STALL_INIT=1` (non-blocking communicators never finish being created,
//! as when NCCL's bootstrap hangs), `KVSTORE_STANDIN_SHM_DIR` (where the folders of cliques
//! spanning processes go; default `/dev/shm`).
//!
//! # What it does not model
//!
//! Timing and overlap, caches and the memory model inside a kernel, the legacy default
//! stream's implicit synchronization (the store uses non-blocking streams only), and anything
//! of real NCCL beyond the data each collective moves.
//!
//! - **Registers per thread.** `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES` (registers per thread times
//!   threads per block over 64K) depends on how ptxas allocates hardware registers; a PTX
//!   module's `.reg` declarations are virtual registers, which ptxas reuses, so their count
//!   says nothing about it. Not modelled; build.rs assembles every kernel with ptxas, which
//!   reports each entry's registers. Shared memory per block is checked only against 48 KiB.
//! - A fault on a GPU stops the kernel; the interpreter stops at the first faulting access,
//!   after the threads before it ran. Only illegal and misaligned addresses are sticky: the
//!   stand-in's own diagnoses (races, unwritten registers, missing peer or pool access)
//!   fail just the operation (on a GPU the last two are illegal-address faults).
//! - NCCL calls on a poisoned context are accepted (real NCCL fails them with
//!   `ncclUnhandledCudaError`); their parts never run, so the other ranks wait, as with a
//!   dead rank.
//! - Copies between devices of pool memory follow the peer-access rules of plain memory (the
//!   driver's copy engines; pool access is modelled for kernels only). No pool other than the
//!   default one, no release thresholds or fragmentation: free memory is capacity minus the
//!   live allocations.
//! - Host waits order everything that any thread enqueues after them (one host clock), so a
//!   race that only a second host thread's missing synchronization would cause is not seen.
//! - Across processes: ranks on different machines (the folder is the transport, so one
//!   machine), NCCL's own bootstrap (nothing listens on `NCCL_COMM_ID`; a rank that never starts
//!   is a timeout, not a connection error), a rank that dies *while joining* (the others wait
//!   until their timeout), one physical GPU shared by the processes (each process has its own
//!   memory model, so a kernel of one process cannot touch another's buffers, and device
//!   capacity is per process), and happens-before between processes (a race between a remote
//!   rank's writes and this process's reads cannot be seen; only each process's own streams are
//!   checked).
#![deny(unsafe_op_in_unsafe_fn)]
// The exported functions keep the C names of the APIs they stand in for.
#![allow(non_snake_case)]
// Every exported `unsafe extern "C" fn` has the contract of the NVIDIA function of the same
// name (valid pointers for its out-parameters and buffers); each unsafe block inside says which
// part it relies on.
#![allow(clippy::missing_safety_doc)]

/// The PTX interpreter of kvstore's tests (`tests/ptx_emulator`), shared by path: its three
/// files, without its unit tests (which need kvstore itself).
#[allow(dead_code)]
#[path = "../../../tests/ptx_emulator"]
pub mod emu {
    mod exec;
    mod memory;
    mod parse;

    pub use exec::{launch, Arg};
    pub use memory::{Memory, Touch};
    pub use parse::{Module, Ty};
}

mod calls;
pub mod driver;
pub mod nccl;
mod state;
pub mod xproc;

pub use state::Config;

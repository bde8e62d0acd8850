//! The stand-in rejects what it promises to reject: each test does one wrong thing (and, where
//! it helps, the right thing next to it, which must pass). The calls go straight to the
//! exported functions, as cudarc would make them.

use std::ffi::{c_int, c_void, CString};
use std::ptr::null_mut;

use kvstore_stand_in_driver::driver::*;
use kvstore_stand_in_driver::nccl::*;

type H = *mut c_void;

// Result codes.
const OK: i32 = 0;
const INVALID_VALUE: i32 = 1;
const OUT_OF_MEMORY: i32 = 2;
const NO_BINARY_FOR_GPU: i32 = 209;
const INVALID_PTX: i32 = 218;
const UNSUPPORTED_PTX_VERSION: i32 = 222;
const INVALID_HANDLE: i32 = 400;
const ILLEGAL_STATE: i32 = 401;
const ILLEGAL_ADDRESS: i32 = 700;
const PEER_ACCESS_NOT_ENABLED: i32 = 705;
const NCCL_INVALID_USAGE: i32 = 5;
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

/// `dst[i] = src[i]` for `i < n`, one thread per element, in the interpreter's subset.
const COPY_PTX: &str = "
.version 7.0
.target sm_70
.address_size 64
.visible .entry copy(.param .u64 dst, .param .u64 src, .param .u32 n)
{
.reg .pred %p<2>;
.reg .b32 %r<4>;
.reg .f32 %f<2>;
.reg .b64 %rd<8>;
ld.param.u64 %rd1, [dst];
ld.param.u64 %rd2, [src];
ld.param.u32 %r1, [n];
mov.u32 %r2, %tid.x;
setp.ge.u32 %p1, %r2, %r1;
@%p1 bra DONE;
mul.wide.u32 %rd3, %r2, 4;
add.u64 %rd4, %rd1, %rd3;
add.u64 %rd5, %rd2, %rd3;
ld.global.f32 %f1, [%rd5];
st.global.f32 [%rd4], %f1;
DONE:
ret;
}
";

/// Initializes the driver and returns the primary contexts of devices 0 and 1, with device
/// 0's current on this thread.
fn setup() -> [H; 2] {
    assert_eq!(cuInit(0), OK);
    let mut ctx = [null_mut(); 2];
    for (d, c) in ctx.iter_mut().enumerate() {
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { cuDevicePrimaryCtxRetain(c, d as c_int) }, OK);
    }
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    ctx
}

fn stream() -> H {
    let mut s = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuStreamCreate(&mut s, 1) }, OK);
    s
}

fn alloc(bytes: usize, s: H) -> u64 {
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemAllocAsync(&mut p, bytes, s) }, OK);
    p
}

fn upload(dst: u64, data: &[f32], s: H) -> i32 {
    // SAFETY: `data` holds the bytes given.
    unsafe { cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len() * 4, s) }
}

fn download(src: u64, n: usize, s: H) -> (i32, Vec<f32>) {
    let mut out = vec![0f32; n];
    // SAFETY: `out` has room for the bytes asked for.
    let r = unsafe { cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, n * 4, s) };
    (r, out)
}

fn load(ptx: &str) -> (i32, H) {
    let text = CString::new(ptx).unwrap();
    let mut m = null_mut();
    // SAFETY: a NUL-terminated image and a valid out-pointer.
    let r = unsafe { cuModuleLoadData(&mut m, text.as_ptr().cast()) };
    (r, m)
}

fn copy_kernel() -> H {
    let (r, m) = load(COPY_PTX);
    assert_eq!(r, OK);
    let mut f = null_mut();
    let name = CString::new("copy").unwrap();
    // SAFETY: valid module, name and out-pointer.
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m, name.as_ptr()) }, OK);
    f
}

/// Launches `copy(dst, src, n)` with one block of `n` threads.
fn launch_copy(f: H, dst: u64, src: u64, n: u32, s: H) -> i32 {
    let (mut d, mut sr, mut nn) = (dst, src, n);
    let mut params: [*mut c_void; 3] = [
        (&mut d as *mut u64).cast(),
        (&mut sr as *mut u64).cast(),
        (&mut nn as *mut u32).cast(),
    ];
    // SAFETY: one pointer per parameter, each to a value of the parameter's type.
    unsafe { cuLaunchKernel(f, 1, 1, 1, n, 1, 1, 0, s, params.as_mut_ptr(), null_mut()) }
}

/// A launch, then a wait on its stream: kernels run later, so what a kernel does wrong is
/// reported by the next wait (as on a GPU), unless the launch itself was refused.
fn launch_and_wait(f: H, dst: u64, src: u64, n: u32, s: H) -> i32 {
    match launch_copy(f, dst, src, n, s) {
        OK => cuStreamSynchronize(s),
        refused => refused,
    }
}

#[test]
fn a_launch_whose_parameter_bytes_do_not_match_the_entry_is_rejected() {
    setup();
    let s = stream();
    let f = copy_kernel();
    let (a, b) = (alloc(16, s), alloc(16, s));
    assert_eq!(upload(b, &[1.0, 2.0, 3.0, 4.0], s), OK);
    assert_eq!(launch_copy(f, a, b, 4, s), OK, "the right arguments pass");
    assert_eq!(download(a, 4, s).1, [1.0, 2.0, 3.0, 4.0]);

    // Through `extra`: 16 bytes where the entry takes 8 + 8 + 4 = 20.
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&a.to_le_bytes());
    buf[8..].copy_from_slice(&b.to_le_bytes());
    let mut size = buf.len();
    let mut extra: [*mut c_void; 5] = [
        std::ptr::without_provenance_mut(1), // CU_LAUNCH_PARAM_BUFFER_POINTER
        buf.as_mut_ptr().cast(),
        std::ptr::without_provenance_mut(2), // CU_LAUNCH_PARAM_BUFFER_SIZE
        (&mut size as *mut usize).cast(),
        null_mut(),
    ];
    // SAFETY: a well-formed extra list.
    let r = unsafe { cuLaunchKernel(f, 1, 1, 1, 4, 1, 1, 0, s, null_mut(), extra.as_mut_ptr()) };
    assert_eq!(
        r, INVALID_VALUE,
        "a 16-byte parameter buffer for a 20-byte entry"
    );

    // Through kernelParams: a 4-byte value where the entry declares .u64 (its address is only
    // 4-byte aligned: the value is narrower than the parameter).
    let narrow = [0u32; 2];
    let (mut d, mut n) = (a, 4u32);
    let mut params: [*mut c_void; 3] = [
        (&mut d as *mut u64).cast(),
        (narrow.as_ptr() as *mut u32).wrapping_add(1).cast(),
        (&mut n as *mut u32).cast(),
    ];
    // SAFETY: every pointer is readable for 8 bytes or fewer than its parameter; the stand-in
    // refuses before reading the misaligned one.
    let r = unsafe { cuLaunchKernel(f, 1, 1, 1, 4, 1, 1, 0, s, params.as_mut_ptr(), null_mut()) };
    assert_eq!(r, INVALID_VALUE, "a u32 passed for a .u64 parameter");
}

/// The device's compute capability as major * 10 + minor (`KVSTORE_STANDIN_SM`; the CI runs
/// these tests at sm_70, sm_80 and sm_90).
fn device_sm() -> u32 {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: valid out-pointers; 75 and 76 are the compute capability's major and minor.
    unsafe {
        assert_eq!(cuDeviceGetAttribute(&mut major, 75, 0), OK);
        assert_eq!(cuDeviceGetAttribute(&mut minor, 76, 0), OK);
    }
    (major * 10 + minor) as u32
}

/// COPY_PTX for `.target sm_{sm}`, with the PTX ISA version that target needs.
fn copy_ptx_for(sm: u32) -> String {
    let version = match sm {
        ..=75 => "7.0",
        76..=86 => "7.1",
        _ => "7.8",
    };
    COPY_PTX
        .replace(".target sm_70", &format!(".target sm_{sm}"))
        .replace(".version 7.0", &format!(".version {version}"))
}

#[test]
fn ptx_above_the_device_is_rejected() {
    setup();
    let sm = device_sm();
    let next = match sm {
        ..=79 => 80,
        80..=89 => 90,
        _ => 100,
    };
    assert_eq!(
        load(&copy_ptx_for(next)).0,
        NO_BINARY_FOR_GPU,
        "sm_{next} on sm_{sm}"
    );
    let newer = COPY_PTX.replace(".version 7.0", ".version 9.9");
    assert_eq!(load(&newer).0, UNSUPPORTED_PTX_VERSION);
    for below in [70, 80, 90].into_iter().filter(|&t| t <= sm) {
        assert_eq!(
            load(&copy_ptx_for(below)).0,
            OK,
            "sm_{below} PTX on sm_{sm}"
        );
    }
}

/// `y = bf16(x)`: one `cvt.rn.bf16.f32`, which needs sm_80 and PTX ISA 7.0.
const BF16_PTX: &str = "
.version 7.0
.target sm_80
.address_size 64
.visible .entry narrow(.param .u64 p)
{
.reg .b64 %a;
.reg .f32 %x;
.reg .b16 %h;
ld.param.u64 %a, [p];
ld.global.f32 %x, [%a];
cvt.rn.bf16.f32 %h, %x;
st.global.b16 [%a+4], %h;
ret;
}
";

#[test]
fn an_instruction_above_the_module_target_is_rejected() {
    setup();
    // A bf16 conversion in a module that says sm_70 is invalid PTX on every device: ptxas
    // refuses it ("Feature 'cvt with .bf16' requires .target sm_80 or higher"), as the JIT does.
    let on70 = BF16_PTX.replace(".target sm_80", ".target sm_70");
    assert_eq!(load(&on70).0, INVALID_PTX);
    // At sm_80 it is valid, and loads where the device has sm_80.
    let want = if device_sm() >= 80 {
        OK
    } else {
        NO_BINARY_FOR_GPU
    };
    assert_eq!(load(BF16_PTX).0, want, "sm_80 PTX on sm_{}", device_sm());
}

#[test]
fn a_read_of_what_another_stream_writes_needs_an_event() {
    setup();
    let (s1, s2) = (stream(), stream());
    let buf = alloc(16, s1);
    assert_eq!(upload(buf, &[5.0; 4], s1), OK);
    // Stream 2 reads what stream 1 writes (and allocates), with nothing in between. Whichever
    // runs first, the second one's access is the race; the waits report it.
    let (read, _) = download(buf, 4, s2);
    let write = cuStreamSynchronize(s1);
    assert!(
        read == ILLEGAL_STATE || write == ILLEGAL_STATE,
        "an unordered read and write: {read}, {write}"
    );

    // With an event recorded after the write and waited for, the same read is fine.
    let buf = alloc(16, s1);
    assert_eq!(upload(buf, &[6.0; 4], s1), OK);
    let mut ev = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuEventCreate(&mut ev, 2) }, OK);
    assert_eq!(cuEventRecord(ev, s1), OK);
    assert_eq!(cuStreamWaitEvent(s2, ev, 0), OK);
    assert_eq!(download(buf, 4, s2), (OK, vec![6.0; 4]));

    // A kernel on stream 2 writing what stream 1 reads, unordered, is a race too.
    let f = copy_kernel();
    let (a, b) = (alloc(16, s1), alloc(16, s1));
    assert_eq!(upload(b, &[1.0; 4], s1), OK);
    assert_eq!(
        cuStreamSynchronize(s1),
        OK,
        "the host wait orders everything before it"
    );
    assert_eq!(launch_copy(f, a, b, 4, s2), OK);
    let (read, _) = download(a, 4, s1);
    let write = cuStreamSynchronize(s2);
    assert!(
        read == ILLEGAL_STATE || write == ILLEGAL_STATE,
        "an unordered kernel write and read: {read}, {write}"
    );
}

/// Runs the test `name` in a child process of its own (this test binary, filtered to it) and
/// returns false; in that child, returns true, and the caller runs the test's body. A kernel
/// fault poisons its context for the whole process, as CUDA's do, and the stand-in's state is
/// per process: a test that makes one must not share its process with the others.
fn in_own_process(name: &str) -> bool {
    in_own_process_with(name, &[])
}

/// `in_own_process`, with settings in the child's environment (the stand-in reads its
/// settings once per process).
fn in_own_process_with(name: &str, env: &[(&str, &str)]) -> bool {
    const CHILD: &str = "KVSTORE_STANDIN_STRICT_CHILD";
    if std::env::var(CHILD).is_ok_and(|t| t == name) {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD, name)
        .envs(env.iter().copied())
        .output()
        .expect("the test binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name}, in a process of its own:\n{text}"
    );
    false
}

#[test]
fn use_after_free_and_double_free_are_rejected() {
    // The kernel reading freed memory faults, which poisons the context.
    if !in_own_process("use_after_free_and_double_free_are_rejected") {
        return;
    }
    setup();
    let s = stream();
    let f = copy_kernel();
    let (a, b) = (alloc(16, s), alloc(16, s));
    assert_eq!(upload(b, &[1.0; 4], s), OK);
    assert_eq!(cuMemFreeAsync(b, s), OK);
    assert_eq!(
        upload(b, &[1.0; 4], s),
        INVALID_VALUE,
        "a copy into freed memory"
    );
    assert_eq!(cuMemFreeAsync(b, s), INVALID_VALUE, "a double free");
    // Last: the fault poisons the context. The launch names memory whose free is queued
    // before it on the same stream; it is refused when it runs, at the wait.
    assert_eq!(
        launch_and_wait(f, a, b, 4, s),
        ILLEGAL_ADDRESS,
        "a kernel reading freed memory"
    );
}

#[test]
fn a_kernel_fault_poisons_its_context_until_it_is_reset() {
    if !in_own_process("a_kernel_fault_poisons_its_context_until_it_is_reset") {
        return;
    }
    let ctx = setup();
    let s = stream();
    let f = copy_kernel();
    let (a, b) = (alloc(16, s), alloc(16, s));
    assert_eq!(upload(b, &[2.0; 4], s), OK);
    assert_eq!(launch_and_wait(f, a, b, 4, s), OK, "a good launch first");
    // A kernel reading address 0, outside every allocation: an illegal address, reported by
    // the wait after it (the launch itself returns before the kernel runs).
    assert_eq!(launch_copy(f, a, 0, 4, s), OK);
    assert_eq!(cuStreamSynchronize(s), ILLEGAL_ADDRESS);
    // Every later call on the context fails with the same error, whatever it is.
    assert_eq!(upload(b, &[1.0; 4], s), ILLEGAL_ADDRESS, "a copy");
    assert_eq!(download(a, 4, s).0, ILLEGAL_ADDRESS, "a copy back");
    assert_eq!(
        cuStreamSynchronize(s),
        ILLEGAL_ADDRESS,
        "a stream wait again"
    );
    assert_eq!(cuCtxSynchronize(), ILLEGAL_ADDRESS, "a context wait");
    assert_eq!(launch_copy(f, a, b, 4, s), ILLEGAL_ADDRESS, "a good launch");
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemAllocAsync(&mut p, 16, s) }, ILLEGAL_ADDRESS);
    let mut s2 = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuStreamCreate(&mut s2, 1) }, ILLEGAL_ADDRESS);
    assert_eq!(load(COPY_PTX).0, ILLEGAL_ADDRESS, "a module load");
    // Another device's context is not affected.
    assert_eq!(cuCtxSetCurrent(ctx[1]), OK);
    let s1 = stream();
    let c = alloc(16, s1);
    assert_eq!(upload(c, &[4.0; 4], s1), OK);
    assert_eq!(download(c, 4, s1), (OK, vec![4.0; 4]));
    // A reset destroys the context's streams and memory and clears the error.
    assert_eq!(cuDevicePrimaryCtxReset_v2(0), OK);
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    assert_eq!(
        cuStreamSynchronize(s),
        INVALID_HANDLE,
        "streams of before the reset"
    );
    let s = stream();
    let d = alloc(16, s);
    assert_eq!(upload(d, &[5.0; 4], s), OK);
    assert_eq!(download(d, 4, s), (OK, vec![5.0; 4]));
    assert_eq!(
        upload(a, &[1.0; 4], s),
        INVALID_VALUE,
        "memory of before the reset"
    );
}

#[test]
fn peer_access_must_be_enabled() {
    let ctx = setup();
    let s0 = stream();
    let f = copy_kernel();
    assert_eq!(cuCtxSetCurrent(ctx[1]), OK);
    let s1 = stream();
    let on1 = alloc(16, s1);
    assert_eq!(upload(on1, &[3.0; 4], s1), OK);
    // And plain memory (cuMemAlloc, not from a pool).
    let mut plain1 = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut plain1, 16) }, OK);
    assert_eq!(upload(plain1, &[7.0; 4], s1), OK);
    assert_eq!(cuStreamSynchronize(s1), OK);
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    let on0 = alloc(16, s0);
    // A kernel on gpu 0 reading gpu 1's memory, and a plain device copy from it.
    assert_eq!(launch_and_wait(f, on0, on1, 4, s0), PEER_ACCESS_NOT_ENABLED);
    // SAFETY: live buffers of 16 bytes.
    let r = unsafe { cuMemcpyDtoDAsync_v2(on0, on1, 16, s0) };
    assert_eq!(r, PEER_ACCESS_NOT_ENABLED);
    // A peer copy needs no peer access.
    // SAFETY: live buffers of 16 bytes, each with its own device's context.
    let r = unsafe { cuMemcpyPeerAsync(on0, ctx[0], on1, ctx[1], 16, s0) };
    assert_eq!(r, OK);
    assert_eq!(download(on0, 4, s0), (OK, vec![3.0; 4]));
    // Once enabled, the kernel may read plain memory...
    assert_eq!(cuCtxEnablePeerAccess(ctx[1], 0), OK);
    assert_eq!(launch_and_wait(f, on0, plain1, 4, s0), OK);
    assert_eq!(download(on0, 4, s0), (OK, vec![7.0; 4]));
    // ...but not memory from a pool (cuMemAllocAsync): peer access does not cover pools
    // (CUDA programming guide, stream-ordered allocator); cuMemPoolSetAccess does.
    assert_eq!(launch_and_wait(f, on0, on1, 4, s0), PEER_ACCESS_NOT_ENABLED);
    let mut pool1 = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuDeviceGetDefaultMemPool(&mut pool1, 1) }, OK);
    let grant = |flags: u32| {
        let desc = MemAccessDesc {
            location: MemLocation { kind: 1, id: 0 },
            flags,
        };
        // SAFETY: one valid descriptor.
        unsafe { cuMemPoolSetAccess(pool1, &desc, 1) }
    };
    assert_eq!(grant(1), OK, "read access for gpu 0");
    assert_eq!(launch_and_wait(f, on0, on1, 4, s0), OK);
    assert_eq!(download(on0, 4, s0), (OK, vec![3.0; 4]));
    // Read access does not let a kernel write there.
    assert_eq!(launch_and_wait(f, on1, on0, 4, s0), PEER_ACCESS_NOT_ENABLED);
    assert_eq!(grant(3), OK, "read and write access for gpu 0");
    assert_eq!(launch_and_wait(f, on1, on0, 4, s0), OK);
    let mut flags = 0;
    let gpu0 = MemLocation { kind: 1, id: 0 };
    // SAFETY: valid pointers.
    assert_eq!(unsafe { cuMemPoolGetAccess(&mut flags, pool1, &gpu0) }, OK);
    assert_eq!(flags, 3);
    // Revoked again, and peer access alone still does not reach the pool.
    assert_eq!(grant(0), OK);
    assert_eq!(launch_and_wait(f, on0, on1, 4, s0), PEER_ACCESS_NOT_ENABLED);
    assert_eq!(cuCtxDisablePeerAccess(ctx[1]), OK);
}

#[test]
fn device_memory_has_a_capacity() {
    // 1 MiB of device memory: its own process, since the setting is read once.
    if !in_own_process_with(
        "device_memory_has_a_capacity",
        &[("KVSTORE_STANDIN_MEM_GIB", "0.0009765625")],
    ) {
        return;
    }
    setup();
    let s = stream();
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { cuMemGetInfo_v2(&mut free, &mut total) }, OK);
    assert_eq!((free, total), (1 << 20, 1 << 20));
    let a = alloc(600 << 10, s);
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { cuMemAllocAsync(&mut p, 600 << 10, s) },
        OUT_OF_MEMORY
    );
    // SAFETY: as above.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut p, 600 << 10) }, OUT_OF_MEMORY);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { cuMemGetInfo_v2(&mut free, &mut total) }, OK);
    assert_eq!(free, (1 << 20) - (600 << 10));
    // The other device has its own memory.
    let mut total1 = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuDeviceTotalMem_v2(&mut total1, 1) }, OK);
    assert_eq!(total1, 1 << 20);
    // Freed memory (once the free ran, in stream order) can be allocated again.
    assert_eq!(cuMemFreeAsync(a, s), OK);
    assert_eq!(cuStreamSynchronize(s), OK);
    let b = alloc(600 << 10, s);
    assert_eq!(upload(b, &[1.0; 4], s), OK);
}

/// A kernel that keeps `n` loaded values live at once: every load comes before every store,
/// and loads and stores go through two pointers that may alias, so ptxas may not reorder them
/// (at least `n` registers per thread).
fn wide_ptx(n: usize) -> String {
    let mut body = String::new();
    for i in 0..n {
        body += &format!("ld.global.f32 %f{i}, [%rd4+{}];\n", 4 * i);
    }
    for i in (0..n).rev() {
        body += &format!("st.global.f32 [%rd3+{}], %f{i};\n", 4 * i);
    }
    format!(
        ".version 7.0
.target sm_70
.address_size 64
.visible .entry wide(.param .u64 dst, .param .u64 src)
{{
.reg .b32 %r<2>;
.reg .f32 %f<{n}>;
.reg .b64 %rd<6>;
ld.param.u64 %rd1, [dst];
ld.param.u64 %rd2, [src];
mov.u32 %r1, %tid.x;
mul.wide.u32 %rd5, %r1, {bytes};
add.u64 %rd3, %rd1, %rd5;
add.u64 %rd4, %rd2, %rd5;
{body}ret;
}}
",
        bytes = 4 * n
    )
}

/// A block whose threads need more registers than a block can have (65536 on sm_70 to
/// sm_90, given in whole units per warp) is refused with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
/// the same kernel in smaller blocks runs. The registers are ptxas's, for the device.
#[test]
fn a_block_needing_more_registers_than_there_are_is_refused() {
    let ptxas = std::env::var_os("PTXAS").filter(|p| !p.is_empty());
    let found = std::process::Command::new(ptxas.unwrap_or_else(|| "ptxas".into()))
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ptxas"));
    if !found {
        println!(
            "\nSKIPPED: a_block_needing_more_registers_than_there_are_is_refused: no ptxas \
             (set PTXAS, or run scripts/install-ptxas.sh)"
        );
        return;
    }
    setup();
    let s = stream();
    let n = 128;
    let (r, m) = load(&wide_ptx(n));
    assert_eq!(r, OK);
    let mut f = null_mut();
    let name = CString::new("wide").unwrap();
    // SAFETY: valid module, name and out-pointer.
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m, name.as_ptr()) }, OK);
    let launch = |threads: u32, dst: u64, src: u64| {
        let (mut d, mut sr) = (dst, src);
        let mut params: [*mut c_void; 2] =
            [(&mut d as *mut u64).cast(), (&mut sr as *mut u64).cast()];
        // SAFETY: one pointer per parameter, each to a u64.
        unsafe {
            cuLaunchKernel(
                f,
                1,
                1,
                1,
                threads,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                null_mut(),
            )
        }
    };
    const OUT_OF_RESOURCES: i32 = 701;
    let threads = 128u32;
    // Room for 1024 threads, so that a launch the check wrongly lets through runs cleanly
    // (and fails the assertion) instead of faulting, which would poison the context the other
    // tests of this process share.
    let bytes = 1024 * n * 4;
    let (src, dst) = (alloc(bytes, s), alloc(bytes, s));
    let data: Vec<f32> = (0..1024 * n).map(|i| i as f32 * 0.5).collect();
    assert_eq!(upload(src, &data, s), OK);
    assert_eq!(
        launch(1024, dst, src),
        OUT_OF_RESOURCES,
        "1024 threads of over 64 registers"
    );
    assert_eq!(launch(threads, dst, src), OK, "{threads} threads fit");
    let ran = threads as usize * n;
    assert_eq!(download(dst, ran, s), (OK, data[..ran].to_vec()));
}

#[test]
fn launches_over_the_block_limits_are_refused() {
    setup();
    let s = stream();
    let f = copy_kernel();
    let (a, b) = (alloc(16, s), alloc(16, s));
    let launch = |grid: (u32, u32, u32), block: (u32, u32, u32)| {
        let (mut d, mut sr, mut nn) = (a, b, 0u32);
        let mut params: [*mut c_void; 3] = [
            (&mut d as *mut u64).cast(),
            (&mut sr as *mut u64).cast(),
            (&mut nn as *mut u32).cast(),
        ];
        // SAFETY: one pointer per parameter, each to a value of the parameter's type.
        unsafe {
            cuLaunchKernel(
                f,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                0,
                s,
                params.as_mut_ptr(),
                null_mut(),
            )
        }
    };
    assert_eq!(
        launch((1, 1, 1), (1024, 1, 1)),
        OK,
        "1024 threads per block"
    );
    assert_eq!(launch((1, 1, 1), (1025, 1, 1)), INVALID_VALUE);
    assert_eq!(
        launch((1, 1, 1), (512, 4, 1)),
        INVALID_VALUE,
        "2048 threads"
    );
    assert_eq!(
        launch((1, 1, 1), (1, 1, 65)),
        INVALID_VALUE,
        "block z above 64"
    );
    // 65536 * 65536 threads wrap to 0 in 32 bits: still far over the limit.
    assert_eq!(launch((1, 1, 1), (65536, 65536, 1)), INVALID_VALUE);
    assert_eq!(launch((1, 65536, 1), (1, 1, 1)), INVALID_VALUE, "grid y");
    assert_eq!(launch((1 << 31, 1, 1), (1, 1, 1)), INVALID_VALUE, "grid x");
}

/// Two ranks (gpu 0 and gpu 1) of one clique, with a stream and a 64-float buffer each.
fn two_ranks(ctx: [H; 2]) -> ([H; 2], [H; 2], [u64; 2]) {
    let mut comms = [null_mut(); 2];
    // SAFETY: room for two handles; null device list means devices 0 and 1.
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) },
        OK
    );
    let mut streams = [null_mut(); 2];
    let mut bufs = [0; 2];
    for d in 0..2 {
        assert_eq!(cuCtxSetCurrent(ctx[d]), OK);
        streams[d] = stream();
        bufs[d] = alloc(256, streams[d]);
        assert_eq!(upload(bufs[d], &[d as f32 + 1.0; 64], streams[d]), OK);
    }
    (comms, streams, bufs)
}

fn reduce(send: u64, recv: u64, count: usize, root: c_int, comm: H, s: H) -> i32 {
    ncclReduce(
        send as *const c_void,
        recv as *mut c_void,
        count,
        NCCL_FLOAT32,
        NCCL_SUM,
        root,
        comm,
        s,
    )
}

#[test]
fn nccl_mismatched_counts_and_roots_are_rejected() {
    let ctx = setup();
    let (comms, streams, bufs) = two_ranks(ctx);
    // The right call: both ranks reduce 64 floats onto rank 0.
    assert_eq!(ncclGroupStart(), OK);
    for r in 0..2 {
        assert_eq!(reduce(bufs[r], bufs[r], 64, 0, comms[r], streams[r]), OK);
    }
    assert_eq!(ncclGroupEnd(), OK);
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    assert_eq!(download(bufs[0], 64, streams[0]), (OK, vec![3.0; 64]));

    // Counts differ.
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(reduce(bufs[0], bufs[0], 64, 0, comms[0], streams[0]), OK);
    assert_eq!(reduce(bufs[1], bufs[1], 32, 0, comms[1], streams[1]), OK);
    assert_eq!(ncclGroupEnd(), NCCL_INVALID_USAGE);
    let mut state = 0;
    // SAFETY: a live communicator and a valid out-pointer.
    assert_eq!(unsafe { ncclCommGetAsyncError(comms[0], &mut state) }, OK);
    assert_eq!(state, NCCL_INVALID_USAGE, "the communicator reports it");

    // Roots differ (a fresh clique: the first one is in error now).
    let (comms, streams, bufs) = two_ranks(ctx);
    assert_eq!(ncclGroupStart(), OK);
    assert_eq!(reduce(bufs[0], bufs[0], 64, 0, comms[0], streams[0]), OK);
    assert_eq!(reduce(bufs[1], bufs[1], 64, 1, comms[1], streams[1]), OK);
    assert_eq!(ncclGroupEnd(), NCCL_INVALID_USAGE);
    assert!(last_error().contains("root"), "{}", last_error());
}

#[test]
fn one_thread_driving_two_ranks_needs_a_group() {
    let ctx = setup();
    let (comms, streams, bufs) = two_ranks(ctx);
    assert_eq!(reduce(bufs[0], bufs[0], 64, 0, comms[0], streams[0]), OK);
    assert_eq!(
        reduce(bufs[1], bufs[1], 64, 0, comms[1], streams[1]),
        NCCL_INVALID_USAGE,
        "rank 1's part of the same collective, from the same thread, outside a group"
    );
    // Abort ends the half-issued collective, so rank 0's stream drains.
    assert_eq!(ncclCommAbort(comms[0]), OK);
    assert_eq!(ncclCommAbort(comms[1]), OK);
    assert_eq!(cuStreamSynchronize(streams[0]), OK);
}

/// An aborted part still reads and writes its buffers (an aborted NCCL kernel may have, before
/// it saw the abort flag): freeing them on another stream with nothing ordering the free after
/// it is a race, or a use after free. The abort of the process's last rank of the clique waits
/// for the aborted parts on the host, as NCCL's `commReclaim` does, and orders the free.
#[test]
fn buffers_of_an_aborted_part_need_ordering_unless_the_last_rank_was_aborted() {
    let ctx = setup();
    for last_first in [false, true] {
        let (comms, streams, bufs) = two_ranks(ctx);
        assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
        // The buffer's allocation and upload are done and ordered before what follows.
        assert_eq!(cuStreamSynchronize(streams[0]), OK);
        // Rank 0 reduces alone: rank 1 never comes, so its part stays blocked until the abort.
        assert_eq!(reduce(bufs[0], bufs[0], 64, 1, comms[0], streams[0]), OK);
        if last_first {
            // Rank 1 goes first, so aborting rank 0 ends the process's last rank: it waits.
            assert_eq!(ncclCommAbort(comms[1]), OK);
            assert_eq!(ncclCommAbort(comms[0]), OK);
        } else {
            assert_eq!(ncclCommAbort(comms[0]), OK);
        }
        let other = stream();
        assert_eq!(cuMemFreeAsync(bufs[0], other), OK);
        let freed = cuStreamSynchronize(other);
        let aborted = cuStreamSynchronize(streams[0]);
        if last_first {
            assert_eq!(
                (freed, aborted),
                (OK, OK),
                "the last rank's abort ordered the free"
            );
        } else {
            assert!(
                freed == ILLEGAL_STATE || aborted == ILLEGAL_ADDRESS,
                "a free racing with an aborted part: {freed}, {aborted}"
            );
            assert_eq!(ncclCommAbort(comms[1]), OK);
        }
    }
}

#[test]
fn two_ranks_on_one_gpu_need_nccl_2_30_and_the_switch() {
    setup();
    let mut comms = [null_mut(); 2];
    let devs: [c_int; 2] = [0, 0];
    // SAFETY: room for two handles and two device numbers.
    let r = unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, devs.as_ptr()) };
    let enabled = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").as_deref() == Ok("1");
    assert_eq!(r, if enabled { OK } else { NCCL_INVALID_USAGE });
}

/// A copy from pinned host memory reads the buffer when it runs, as a GPU's DMA does: a
/// buffer rewritten while the copy waits in its stream is reported. Here the copy waits
/// behind a collective that rank 1 joins only after the host rewrote the buffer.
#[test]
fn pinned_memory_rewritten_before_its_copy_ran_is_a_race() {
    let ctx = setup();
    let (comms, streams, bufs) = two_ranks(ctx);
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    let mut p = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemHostAlloc(&mut p, 16, 0) }, OK);
    // SAFETY: `p` is a fresh pinned allocation of 16 bytes.
    let pinned = unsafe { std::slice::from_raw_parts_mut(p.cast::<f32>(), 4) };
    // The right use: write, copy, wait, then reuse.
    pinned.copy_from_slice(&[7.0; 4]);
    let dst = alloc(16, streams[0]);
    // SAFETY: 16 live bytes on both sides.
    assert_eq!(unsafe { cuMemcpyHtoDAsync_v2(dst, p, 16, streams[0]) }, OK);
    assert_eq!(download(dst, 4, streams[0]), (OK, vec![7.0; 4]));

    // Rank 0's part waits at the front of its stream; the copy queues behind it.
    assert_eq!(reduce(bufs[0], bufs[0], 64, 0, comms[0], streams[0]), OK);
    pinned.copy_from_slice(&[8.0; 4]);
    // SAFETY: as above.
    assert_eq!(unsafe { cuMemcpyHtoDAsync_v2(dst, p, 16, streams[0]) }, OK);
    pinned.copy_from_slice(&[9.0; 4]); // too early: the copy has not run
    let (c1, s1, b1) = (comms[1] as usize, streams[1] as usize, bufs[1]);
    std::thread::spawn(move || reduce(b1, b1, 64, 0, c1 as H, s1 as H))
        .join()
        .map(|r| assert_eq!(r, OK))
        .unwrap();
    assert_eq!(cuStreamSynchronize(streams[0]), ILLEGAL_ADDRESS);
    assert_eq!(cuMemFreeHost(p), OK);
    assert_eq!(cuMemFreeHost(p), INVALID_VALUE, "a double free");
}

/// Work runs later, on the device's worker: a copy into pinned memory returns at once, and
/// the host sees the copy's bytes only after a wait (before it, POISON, NaN in every float
/// type). The host writing such a destination, or rewriting a pinned source, before the copy
/// ran is a reported race. A delay of 10 s here, so nothing runs but what a wait runs.
#[test]
fn copies_with_pinned_memory_run_later_and_races_with_the_host_are_reported() {
    if !in_own_process_with(
        "copies_with_pinned_memory_run_later_and_races_with_the_host_are_reported",
        &[("KVSTORE_STANDIN_DELAY_US", "10000000")],
    ) {
        return;
    }
    setup();
    let s = stream();
    let data: Vec<f32> = (0..4).map(|i| 1.5 + i as f32).collect();
    let dev = alloc(16, s);
    assert_eq!(upload(dev, &data, s), OK);
    let mut p = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemHostAlloc(&mut p, 16, 0) }, OK);
    let pinned = p.cast::<f32>();
    // SAFETY: `pinned` is a live pinned allocation of 4 f32; the copy writes it only inside
    // the driver's calls (when a wait runs it), never while this thread reads.
    let read = || unsafe { std::ptr::read_volatile(pinned.cast::<[f32; 4]>()) };
    // SAFETY: 16 live bytes on both sides.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(p, dev, 16, s) }, OK);
    assert!(
        read().iter().all(|x| x.is_nan()),
        "read without a wait: {:?}",
        read()
    );
    assert_eq!(cuStreamSynchronize(s), OK);
    assert_eq!(read().to_vec(), data, "after the wait");

    // The host writes the destination while the copy into it is queued.
    // SAFETY: as above.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(p, dev, 16, s) }, OK);
    // SAFETY: a live pinned allocation of 4 f32.
    unsafe { pinned.write_volatile(9.0) };
    assert_eq!(cuStreamSynchronize(s), ILLEGAL_ADDRESS);

    // Two queued copies into one buffer, in stream order, are not a race.
    // SAFETY: as above.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(p, dev, 16, s) }, OK);
    // SAFETY: as above.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(p, dev, 16, s) }, OK);
    assert_eq!(cuStreamSynchronize(s), OK);
    assert_eq!(read().to_vec(), data);

    // A pinned staging buffer refilled before the copy from it ran.
    let other = alloc(16, s);
    // SAFETY: a live pinned allocation of 4 f32.
    unsafe { pinned.cast::<[f32; 4]>().write_volatile([3.0; 4]) };
    // SAFETY: 16 live bytes on both sides.
    assert_eq!(unsafe { cuMemcpyHtoDAsync_v2(other, p, 16, s) }, OK);
    // SAFETY: as above.
    unsafe { pinned.cast::<[f32; 4]>().write_volatile([4.0; 4]) };
    assert_eq!(cuStreamSynchronize(s), ILLEGAL_ADDRESS);
    // Refilled only after an event says the copy ran: fine.
    let mut ev = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuEventCreate(&mut ev, 2) }, OK);
    // SAFETY: 16 live bytes on both sides.
    assert_eq!(unsafe { cuMemcpyHtoDAsync_v2(other, p, 16, s) }, OK);
    assert_eq!(cuEventRecord(ev, s), OK);
    assert_eq!(cuEventSynchronize(ev), OK);
    // SAFETY: as above.
    unsafe { pinned.cast::<[f32; 4]>().write_volatile([5.0; 4]) };
    assert_eq!(download(other, 4, s), (OK, vec![4.0; 4]));
    assert_eq!(cuMemFreeHost(p), OK);
}

/// What the asynchrony must not report, and what a wait runs (a delay of 10 s: nothing runs
/// but what a wait runs):
/// - an upload from a pinned buffer, then a download into it, on one stream: legal;
/// - a wait on an event runs the work before the event, not the work queued after it;
/// - freeing a pinned buffer waits for the copies queued with it (as CUDA's free synchronizes);
/// - two downloads into the same pinned bytes on two unordered streams: a race, reported.
#[test]
fn pinned_copies_in_order_pass_waits_run_what_they_wait_for_and_unordered_ones_race() {
    if !in_own_process_with(
        "pinned_copies_in_order_pass_waits_run_what_they_wait_for_and_unordered_ones_race",
        &[("KVSTORE_STANDIN_DELAY_US", "10000000")],
    ) {
        return;
    }
    setup();
    let (s, s2) = (stream(), stream());
    let (a, b) = (alloc(16, s), alloc(16, s));
    assert_eq!(upload(a, &[1.0; 4], s), OK);
    let mut p = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemHostAlloc(&mut p, 16, 0) }, OK);
    let pinned = p.cast::<[f32; 4]>();
    // SAFETY: a live pinned allocation of 4 f32, touched by copies only inside driver calls.
    unsafe { pinned.write_volatile([2.0; 4]) };
    // Up from the buffer, then down into it, in stream order.
    // SAFETY: 16 live bytes on both sides.
    assert_eq!(unsafe { cuMemcpyHtoDAsync_v2(b, p, 16, s) }, OK);
    // SAFETY: as above.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(p, a, 16, s) }, OK);
    let mut ev = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuEventCreate(&mut ev, 2) }, OK);
    assert_eq!(cuEventRecord(ev, s), OK);
    // Queued after the event: the event's wait must not run it.
    // SAFETY: 16 live bytes on both sides.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(p, b, 16, s) }, OK);
    assert_eq!(cuEventSynchronize(ev), OK);
    // SAFETY: as above.
    let now = unsafe { pinned.read_volatile() };
    assert_eq!(
        now, [1.0; 4],
        "the download before the event ran, the one after it did not"
    );
    // The free waits for the last download (which brings b, the upload's 2.0s).
    assert_eq!(cuMemFreeHost(p), OK);
    assert_eq!(download(b, 4, s), (OK, vec![2.0; 4]));

    // Two streams download into the same pinned bytes, unordered.
    let mut q = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemHostAlloc(&mut q, 16, 0) }, OK);
    let c = alloc(16, s2);
    assert_eq!(upload(c, &[3.0; 4], s2), OK);
    assert_eq!(cuStreamSynchronize(s2), OK);
    // SAFETY: 16 live bytes on both sides.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(q, a, 16, s) }, OK);
    // SAFETY: as above.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(q, c, 16, s2) }, OK);
    let first = cuStreamSynchronize(s);
    let second = cuStreamSynchronize(s2);
    assert!(
        first == ILLEGAL_ADDRESS || second == ILLEGAL_ADDRESS,
        "unordered downloads into one buffer: {first}, {second}"
    );
}

/// With no wait at all, the device's worker runs queued work once its delay is over (1 ms
/// here): a copy into pinned memory lands by itself.
#[test]
fn the_device_runs_queued_work_without_a_host_wait() {
    if !in_own_process_with(
        "the_device_runs_queued_work_without_a_host_wait",
        &[("KVSTORE_STANDIN_DELAY_US", "1000")],
    ) {
        return;
    }
    setup();
    let s = stream();
    let dev = alloc(16, s);
    assert_eq!(upload(dev, &[2.5; 4], s), OK);
    let mut p = null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemHostAlloc(&mut p, 16, 0) }, OK);
    // SAFETY: 16 live bytes on both sides.
    assert_eq!(unsafe { cuMemcpyDtoHAsync_v2(p, dev, 16, s) }, OK);
    let start = std::time::Instant::now();
    // SAFETY: a live pinned allocation of 4 f32, written by the worker while this thread only
    // polls it (a test of exactly that).
    let read = || unsafe { std::ptr::read_volatile(p.cast::<[f32; 4]>()) };
    while read() != [2.5; 4] {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the copy never ran"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(cuStreamSynchronize(s), OK);
}

/// Non-blocking communicators: init and collectives return ncclInProgress, a call before the
/// communicator settles is rejected, and polling ncclCommGetAsyncError settles it.
#[test]
fn nonblocking_communicators_must_be_polled_to_success() {
    let ctx = setup();
    const IN_PROGRESS: i32 = 7;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, OK);
    let mut cfg = ConfigHead {
        size: 48,
        magic: 0xcafe_beef,
        version: 21400,
        blocking: 0,
    };
    let mut comm = null_mut();
    assert_eq!(cuCtxSetCurrent(ctx[0]), OK);
    // SAFETY: valid out-pointer and config.
    let r = unsafe { ncclCommInitRankConfig(&mut comm, 1, id, 0, &mut cfg) };
    assert_eq!(r, IN_PROGRESS);
    let poll = |c: H| {
        let mut state = -1;
        // SAFETY: a live communicator and a valid out-pointer.
        assert_eq!(unsafe { ncclCommGetAsyncError(c, &mut state) }, OK);
        state
    };
    // One rank of one: complete at once.
    assert_eq!(poll(comm), OK);
    let s = stream();
    let buf = alloc(256, s);
    assert_eq!(upload(buf, &[2.0; 64], s), OK);
    assert_eq!(reduce(buf, buf, 64, 0, comm, s), IN_PROGRESS);
    assert_eq!(
        reduce(buf, buf, 64, 0, comm, s),
        NCCL_INVALID_USAGE,
        "a second call before polling"
    );
    assert_eq!(poll(comm), IN_PROGRESS);
    assert_eq!(poll(comm), OK);
    assert_eq!(reduce(buf, buf, 64, 0, comm, s), IN_PROGRESS);
    assert_eq!(poll(comm), IN_PROGRESS);
    assert_eq!(poll(comm), OK);
    assert_eq!(download(buf, 4, s), (OK, vec![2.0; 4]));
    assert_eq!(ncclCommFinalize(comm), IN_PROGRESS);
    assert_eq!(poll(comm), IN_PROGRESS);
    assert_eq!(poll(comm), OK);
    assert_eq!(ncclCommDestroy(comm), OK);
    // A config not made by NCCL_CONFIG_INITIALIZER.
    cfg.magic = 0;
    // SAFETY: as above.
    let r = unsafe { ncclCommInitRankConfig(&mut comm, 1, id, 0, &mut cfg) };
    assert_eq!(r, 4);
}

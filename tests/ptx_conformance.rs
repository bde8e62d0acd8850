//! Runs every PTX kernel in `kernels/` and compares it with a reference written here, which
//! follows `backend::cpu::update_block` operation by operation in f32. Every case runs on two
//! devices: GPU 0 (`gpu::*`, ignored: needs a GPU) and the PTX emulator in `tests/ptx_emulator`
//! (`emulated::*`, runs everywhere), which interprets the same PTX text thread by thread and
//! fails on any out-of-bounds or misaligned access and on any race between threads.
//!
//! Each test is one entry `fused_<rule>_<dtype>`: single tensors of 1, 3, 1000, 4097 and
//! 2^20 + 5 elements (2^16 + 5 on the emulator), and a table of 50 tensors of mixed sizes (up to
//! 70 000 elements) whose buffers start at mixed offsets (so some take the vector path and some
//! do not), each with k = 1 and k = 3 inputs, three steps in a row, fresh random data every
//! step. Outputs the rule does not read (stored, for `assign`) are NaN before the launch,
//! and a guard of sentinel values around every written buffer must come back untouched.
//!
//! `*_skips_empty_records` checks that every entry leaves records with `k == 0` or `n == 0`
//! alone, and `reference_matches_the_cpu_store` checks the reference here against the CPU store
//! itself, so "matches the reference" means "matches the CPU twin".
//!
//! The GPU runs: `cargo test --test ptx_conformance -- --ignored gpu`.

mod ptx_emulator;

use std::marker::PhantomData;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::{bf16, f16};
use kvstore::__internal::kernels::{self, RuleKind, TensorRecord};
use kvstore::{Adam, DType, Element, KvStore, NDArray, Sgd, Updater};
use ptx_emulator::{Arg, Memory, Module};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Elements of sentinel before (at most) and after every written buffer.
const GUARD: usize = 3;
/// The sentinel: exact in f32, f16 and bf16.
const SENTINEL: f64 = 777.0;
/// Steps run on the same tensors, so state carries over.
const STEPS: u32 = 3;

/// A rule and its scalars, as this test's reference applies it.
#[derive(Clone, Copy, Debug)]
enum TestRule {
    Assign,
    Axpby {
        a: f32,
        b: f32,
    },
    Sgd {
        lr: f32,
        wd: f32,
        rescale: f32,
        clip: f32,
    },
    SgdMom {
        lr: f32,
        momentum: f32,
        wd: f32,
        rescale: f32,
        clip: f32,
    },
    Adam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        epsilon: f32,
        wd: f32,
        rescale: f32,
        clip: f32,
    },
}

impl TestRule {
    /// Random scalars for `kind`; clipping on or off (`clip = +inf`).
    fn random(kind: RuleKind, rng: &mut StdRng, clipped: bool) -> TestRule {
        let clip = if clipped {
            rng.gen_range(0.3..1.5)
        } else {
            f32::INFINITY
        };
        let rescale = rng.gen_range(0.5..2.0);
        let wd = rng.gen_range(0.0..0.1);
        match kind {
            RuleKind::Assign => TestRule::Assign,
            RuleKind::Axpby => TestRule::Axpby {
                a: rng.gen_range(-2.0..2.0),
                b: rng.gen_range(-2.0..2.0),
            },
            RuleKind::Sgd => TestRule::Sgd {
                lr: rng.gen_range(0.01..0.5),
                wd,
                rescale,
                clip,
            },
            RuleKind::SgdMom => TestRule::SgdMom {
                lr: rng.gen_range(0.01..0.5),
                momentum: rng.gen_range(0.5..0.99),
                wd,
                rescale,
                clip,
            },
            RuleKind::Adam => TestRule::Adam {
                lr: rng.gen_range(0.001..0.1),
                beta1: rng.gen_range(0.8..0.95),
                beta2: rng.gen_range(0.9..0.999),
                epsilon: 1e-8,
                wd,
                rescale,
                clip,
            },
        }
    }

    /// The store's updater with these scalars (`clip = +inf` is no clipping).
    fn updater(&self) -> Updater {
        let clip_gradient = |c: f32| c.is_finite().then_some(f64::from(c));
        let f = f64::from;
        match *self {
            TestRule::Assign => Updater::Assign,
            TestRule::Axpby { a, b } => Updater::Axpby {
                a: a.into(),
                b: b.into(),
            },
            TestRule::Sgd {
                lr,
                wd,
                rescale,
                clip,
            } => Updater::Sgd(Sgd {
                lr: f(lr),
                momentum: 0.0,
                wd: f(wd),
                rescale_grad: f(rescale),
                clip_gradient: clip_gradient(clip),
            }),
            TestRule::SgdMom {
                lr,
                momentum,
                wd,
                rescale,
                clip,
            } => Updater::Sgd(Sgd {
                lr: f(lr),
                momentum: f(momentum),
                wd: f(wd),
                rescale_grad: f(rescale),
                clip_gradient: clip_gradient(clip),
            }),
            TestRule::Adam {
                lr,
                beta1,
                beta2,
                epsilon,
                wd,
                rescale,
                clip,
            } => Updater::Adam(Adam {
                lr: f(lr),
                beta1: f(beta1),
                beta2: f(beta2),
                epsilon: f(epsilon),
                wd: f(wd),
                rescale_grad: f(rescale),
                clip_gradient: clip_gradient(clip),
                epsilon_after_correction: false,
            }),
        }
    }

    fn kind(&self) -> RuleKind {
        match self {
            TestRule::Assign => RuleKind::Assign,
            TestRule::Axpby { .. } => RuleKind::Axpby,
            TestRule::Sgd { .. } => RuleKind::Sgd,
            TestRule::SgdMom { .. } => RuleKind::SgdMom,
            TestRule::Adam { .. } => RuleKind::Adam,
        }
    }

    /// The kernel's f32 parameters after (table, ntensors, chunk), in the ABI's order.
    fn params(&self) -> Vec<f32> {
        match *self {
            TestRule::Assign => vec![],
            TestRule::Axpby { a, b } => vec![a, b],
            TestRule::Sgd {
                lr,
                wd,
                rescale,
                clip,
            } => vec![lr, wd, rescale, clip],
            TestRule::SgdMom {
                lr,
                momentum,
                wd,
                rescale,
                clip,
            } => vec![lr, momentum, wd, rescale, clip],
            TestRule::Adam {
                beta1,
                beta2,
                epsilon,
                wd,
                rescale,
                clip,
                ..
            } => vec![beta1, beta2, epsilon, wd, rescale, clip],
        }
    }

    /// Adam's bias-corrected step size at step `t` (from 1), computed in f64 and rounded once.
    fn lr_t(&self, t: u32) -> f32 {
        match *self {
            TestRule::Adam {
                lr, beta1, beta2, ..
            } => {
                let (b1, b2) = (f64::from(beta1), f64::from(beta2));
                let t = t as i32;
                (f64::from(lr) * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t))) as f32
            }
            _ => 0.0,
        }
    }

    /// State buffers the rule keeps: 0, 1 (m) or 2 (m, v).
    fn states(&self) -> usize {
        match self {
            TestRule::SgdMom { .. } => 1,
            TestRule::Adam { .. } => 2,
            _ => 0,
        }
    }

    /// One element: the new stored value; `m` and `v` are updated in place.
    fn apply(&self, lr_t: f32, g: f32, w: f32, m: &mut f32, v: &mut f32) -> f32 {
        match *self {
            TestRule::Assign => g,
            TestRule::Axpby { a, b } => a * w + b * g,
            TestRule::Sgd {
                lr,
                wd,
                rescale,
                clip,
            } => (1.0 - lr * wd) * w - lr * clamp(rescale * g, clip),
            TestRule::SgdMom {
                lr,
                momentum,
                wd,
                rescale,
                clip,
            } => {
                *m = momentum * *m - lr * wd * w - lr * clamp(rescale * g, clip);
                w + *m
            }
            TestRule::Adam {
                beta1,
                beta2,
                epsilon,
                wd,
                rescale,
                clip,
                ..
            } => {
                let g = clamp(rescale * g + wd * w, clip);
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                w - lr_t * *m / (v.sqrt() + epsilon)
            }
        }
    }
}

/// `g` clamped to `[-c, c]`; NaN passes through.
fn clamp(g: f32, c: f32) -> f32 {
    if g > c {
        c
    } else if g < -c {
        -c
    } else {
        g
    }
}

/// Where one tensor's buffers start: an element offset per buffer (stored, inputs, m, v).
#[derive(Clone, Debug)]
struct Layout {
    n: usize,
    stored_at: usize,
    inputs_at: Vec<usize>,
    m_at: usize,
    v_at: usize,
}

impl Layout {
    /// Every buffer at offset 0 (device allocations are 256-byte aligned).
    fn aligned(n: usize, k: usize) -> Layout {
        Layout {
            n,
            stored_at: 0,
            inputs_at: vec![0; k],
            m_at: 0,
            v_at: 0,
        }
    }

    /// Offsets 0..4 elements, so some tensors are misaligned for vector loads.
    fn random(n: usize, k: usize, rng: &mut StdRng) -> Layout {
        let mut off = || {
            if rng.gen_bool(0.5) {
                0
            } else {
                rng.gen_range(0..5)
            }
        };
        Layout {
            n,
            stored_at: off(),
            inputs_at: (0..k).map(|_| off()).collect(),
            m_at: off(),
            v_at: off(),
        }
    }
}

/// An element type the kernels take, and its bytes in device memory (little-endian).
trait Elem: Element<Acc = f32> {
    /// Bytes per element.
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
    fn get(bytes: &[u8]) -> Self;
}

impl Elem for f32 {
    const SIZE: usize = 4;
    fn put(self, out: &mut Vec<u8>) {
        out.extend(self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> f32 {
        f32::from_le_bytes(bytes.try_into().unwrap())
    }
}

impl Elem for f16 {
    const SIZE: usize = 2;
    fn put(self, out: &mut Vec<u8>) {
        out.extend(self.to_bits().to_le_bytes());
    }
    fn get(bytes: &[u8]) -> f16 {
        f16::from_bits(u16::from_le_bytes(bytes.try_into().unwrap()))
    }
}

impl Elem for bf16 {
    const SIZE: usize = 2;
    fn put(self, out: &mut Vec<u8>) {
        out.extend(self.to_bits().to_le_bytes());
    }
    fn get(bytes: &[u8]) -> bf16 {
        bf16::from_bits(u16::from_le_bytes(bytes.try_into().unwrap()))
    }
}

fn to_bytes<T: Elem>(data: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() * T::SIZE);
    for x in data {
        x.put(&mut out);
    }
    out
}

/// Where the kernels run: GPU 0 ([`Gpu`]) or the PTX emulator ([`Emulated`]). Addresses are
/// device addresses.
trait Device {
    /// A new allocation holding `bytes`; returns its address (256-byte aligned).
    fn upload(&mut self, bytes: &[u8]) -> Result<u64>;
    /// Copies `bytes` to `addr`, inside one allocation.
    fn write(&mut self, addr: u64, bytes: &[u8]) -> Result<()>;
    /// The `len` bytes at `addr`, inside one allocation.
    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>>;
    /// Launches the entry for `kind` on `dtype` as `launch_fused` does, on `grid` blocks of
    /// `(BLOCK, 1, 1)` threads with `args` (table, ntensors, chunk, then the rule's scalars),
    /// and waits for it.
    fn launch(
        &mut self,
        kind: RuleKind,
        dtype: DType,
        grid: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()>;
    /// Frees every allocation.
    fn free_all(&mut self);
}

/// GPU 0 with the kvstore PTX modules loaded.
struct Gpu {
    stream: Arc<CudaStream>,
    modules: Vec<(&'static str, Arc<cudarc::driver::CudaModule>)>,
    /// The modules whose `.target` is above this GPU's architecture, which the driver refused
    /// (as it must): (stem, why).
    refused: Vec<(&'static str, String)>,
    /// Every allocation, with its address.
    allocs: Vec<(u64, CudaSlice<u8>)>,
}

impl Gpu {
    fn new() -> Result<Gpu> {
        let count = kvstore::gpu_count();
        assert!(
            count > 0,
            "ptx_conformance needs a CUDA GPU, and this machine has none (libcuda missing or no \
             device): these tests are #[ignore]d for that reason; run them on a GPU machine"
        );
        let ctx = CudaContext::new(0).context("CudaContext::new(0)")?;
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        let sm = (major * 10 + minor) as u32;
        let (mut modules, mut refused) = (Vec::new(), Vec::new());
        for &(stem, text) in kernels::PTX_SOURCES {
            let loaded = ctx.load_module(Ptx::from_src(text));
            let target = ptx_target(text).with_context(|| format!("kernels/{stem}.ptx"))?;
            if target > sm {
                // The driver cannot build sm_80 PTX for an sm_70 GPU, and must say so.
                use cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NO_BINARY_FOR_GPU;
                match loaded {
                    Err(e) if e.0 == CUDA_ERROR_NO_BINARY_FOR_GPU => refused.push((
                        stem,
                        format!(
                            "gpu 0 is sm_{sm} and kernels/{stem}.ptx is .target sm_{target} \
                             (the driver refused it with {:?}, as it must)",
                            e.0
                        ),
                    )),
                    other => anyhow::bail!(
                        "kernels/{stem}.ptx is .target sm_{target} and gpu 0 is sm_{sm}: the \
                         load must fail with CUDA_ERROR_NO_BINARY_FOR_GPU, got {:?}",
                        other.map(|_| ())
                    ),
                }
                continue;
            }
            modules.push((
                stem,
                loaded.with_context(|| format!("loading kernels/{stem}.ptx"))?,
            ));
        }
        Ok(Gpu {
            stream,
            modules,
            refused,
            allocs: Vec::new(),
        })
    }

    /// Why this GPU cannot run the kernels of `dtype`, if it cannot (printed as SKIPPED).
    fn cannot_run(&self, dtype: DType) -> Option<&str> {
        let stem = kernels::module_for(RuleKind::Assign, dtype);
        self.refused
            .iter()
            .find(|(s, _)| *s == stem)
            .map(|(_, why)| why.as_str())
    }

    fn function(&self, kind: RuleKind, dtype: DType) -> Result<CudaFunction> {
        let stem = kernels::module_for(kind, dtype);
        let name = kernels::entry_name(kind, dtype);
        let (_, module) = self
            .modules
            .iter()
            .find(|(s, _)| *s == stem)
            .with_context(|| format!("no module {stem}"))?;
        Ok(module.load_function(name)?)
    }

    /// The allocation holding `[addr, addr + len)` and the offset of `addr` in it.
    fn find(&self, addr: u64, len: usize) -> Result<(usize, usize)> {
        self.allocs
            .iter()
            .position(|(base, s)| addr >= *base && addr - base + len as u64 <= s.len() as u64)
            .map(|i| (i, (addr - self.allocs[i].0) as usize))
            .with_context(|| format!("{len} bytes at {addr:#x} are not in one allocation"))
    }
}

impl Device for Gpu {
    fn upload(&mut self, bytes: &[u8]) -> Result<u64> {
        let dev = self.stream.clone_htod(bytes)?;
        let addr = {
            let (addr, _sync) = dev.device_ptr(&self.stream);
            addr
        };
        self.allocs.push((addr, dev));
        Ok(addr)
    }

    fn write(&mut self, addr: u64, bytes: &[u8]) -> Result<()> {
        let (i, off) = self.find(addr, bytes.len())?;
        let mut view = self.allocs[i].1.slice_mut(off..off + bytes.len());
        self.stream.memcpy_htod(bytes, &mut view)?;
        Ok(())
    }

    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>> {
        let (i, off) = self.find(addr, len)?;
        let view = self.allocs[i].1.slice(off..off + len);
        Ok(self.stream.clone_dtoh(&view)?)
    }

    fn launch(
        &mut self,
        kind: RuleKind,
        dtype: DType,
        grid: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        let func = self.function(kind, dtype)?;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (kernels::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&func);
        for a in args {
            match a {
                Arg::U64(v) => launch.arg(v),
                Arg::U32(v) => launch.arg(v),
                Arg::F32(v) => launch.arg(v),
            };
        }
        // SAFETY: `run_case` passes the ABI's parameter list for this entry (build.rs checks
        // the PTX side), and a table whose records point to live allocations of this GPU:
        // `stored` and each input hold `n` elements of the dtype, `m`/`v` hold `n` f32 where
        // the rule keeps state (0 otherwise), and `inputs` points to `k` input addresses.
        unsafe { launch.launch(cfg) }?;
        self.stream.synchronize()?;
        Ok(())
    }

    fn free_all(&mut self) {
        self.allocs.clear();
    }
}

/// The PTX emulator (`tests/ptx_emulator`) with the kvstore PTX modules parsed.
struct Emulated {
    modules: Vec<(&'static str, Module)>,
    mem: Memory,
}

impl Emulated {
    fn new() -> Result<Emulated> {
        let modules = kernels::PTX_SOURCES
            .iter()
            .map(|&(stem, text)| {
                let module =
                    Module::parse(text).with_context(|| format!("parsing kernels/{stem}.ptx"))?;
                Ok((stem, module))
            })
            .collect::<Result<_>>()?;
        Ok(Emulated {
            modules,
            mem: Memory::default(),
        })
    }
}

impl Device for Emulated {
    fn upload(&mut self, bytes: &[u8]) -> Result<u64> {
        Ok(self.mem.alloc(bytes))
    }

    fn write(&mut self, addr: u64, bytes: &[u8]) -> Result<()> {
        self.mem.write(addr, bytes)
    }

    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>> {
        self.mem.read(addr, len)
    }

    fn launch(
        &mut self,
        kind: RuleKind,
        dtype: DType,
        grid: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        let stem = kernels::module_for(kind, dtype);
        let (_, module) = self
            .modules
            .iter()
            .find(|(s, _)| *s == stem)
            .with_context(|| format!("no module {stem}"))?;
        let entry = module.entry(kernels::entry_name(kind, dtype))?;
        ptx_emulator::launch(entry, &mut self.mem, grid, (kernels::BLOCK, 1, 1), args)?;
        Ok(())
    }

    fn free_all(&mut self) {
        self.mem = Memory::default();
    }
}

/// A device buffer holding `at` sentinel elements, `n` data elements, then `GUARD` sentinels.
struct Buf<T> {
    /// Address of the allocation (the first sentinel).
    base: u64,
    at: usize,
    n: usize,
    _elem: PhantomData<T>,
}

impl<T: Elem> Buf<T> {
    fn new(dev: &mut impl Device, data: &[T], at: usize) -> Result<Buf<T>> {
        let s = T::from_f64(SENTINEL);
        let host: Vec<T> = std::iter::repeat_n(s, at)
            .chain(data.iter().copied())
            .chain(std::iter::repeat_n(s, GUARD))
            .collect();
        Ok(Buf {
            base: dev.upload(&to_bytes(&host))?,
            at,
            n: data.len(),
            _elem: PhantomData,
        })
    }

    /// Device address of the first data element.
    fn ptr(&self) -> u64 {
        self.base + (self.at * T::SIZE) as u64
    }

    fn write(&self, dev: &mut impl Device, data: &[T]) -> Result<()> {
        assert_eq!(data.len(), self.n);
        dev.write(self.ptr(), &to_bytes(data))
    }

    /// The data elements, after checking that the guards are untouched.
    fn read(&self, dev: &mut impl Device, what: &str) -> Result<Vec<T>> {
        let bytes = dev.read(self.base, (self.at + self.n + GUARD) * T::SIZE)?;
        let host: Vec<T> = bytes.chunks(T::SIZE).map(T::get).collect();
        let s = T::from_f64(SENTINEL).to_f64();
        let guard_ok = host[..self.at]
            .iter()
            .chain(&host[self.at + self.n..])
            .all(|x| x.to_f64() == s);
        ensure!(
            guard_ok,
            "{what}: the kernel wrote outside its {} elements",
            self.n
        );
        Ok(host[self.at..self.at + self.n].to_vec())
    }
}

/// The 64 bytes of a record, at the offsets the ABI (`kernels.rs`) documents.
fn record_bytes(r: &TensorRecord) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    for x in [r.stored, r.inputs, r.m, r.v, r.n] {
        b.extend(x.to_le_bytes());
    }
    b.extend(r.k.to_le_bytes());
    b.extend(r.lr_t.to_le_bytes());
    for x in r._reserved {
        b.extend(x.to_le_bytes());
    }
    assert_eq!(b.len(), 64);
    b
}

/// One tensor on the device and its expected host copy.
struct Tensor<T: Elem> {
    layout: Layout,
    stored: Buf<T>,
    inputs: Vec<Buf<T>>,
    m: Option<Buf<f32>>,
    v: Option<Buf<f32>>,
    host_w: Vec<T>,
    host_m: Vec<f32>,
    host_v: Vec<f32>,
    /// Adam's step count for this tensor at the first launch (tensors differ, to test lr_t).
    first_step: u32,
}

fn random_vec<T: Element>(rng: &mut StdRng, n: usize, lo: f64, hi: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.gen_range(lo..hi))).collect()
}

fn close(got: f32, want: f32, tol: f32) -> bool {
    if want.is_nan() {
        return got.is_nan();
    }
    got == want || (got - want).abs() <= tol * want.abs()
}

/// Runs `STEPS` launches of `rule` over tensors laid out as `layouts`, checking each.
fn run_case<T: Elem>(
    dev: &mut impl Device,
    rule: TestRule,
    layouts: &[Layout],
    rng: &mut StdRng,
    tol: f32,
    label: &str,
) -> Result<()> {
    dev.free_all();
    let states = rule.states();

    let mut tensors: Vec<Tensor<T>> = Vec::new();
    for (i, layout) in layouts.iter().enumerate() {
        let n = layout.n;
        let host_w: Vec<T> = random_vec(rng, n, -1.0, 1.0);
        let host_m: Vec<f32> = if states >= 1 {
            random_vec(rng, n, -0.1, 0.1)
        } else {
            vec![]
        };
        let host_v: Vec<f32> = if states >= 2 {
            random_vec(rng, n, 0.0, 0.01)
        } else {
            vec![]
        };
        let inputs = layout
            .inputs_at
            .iter()
            .map(|&at| Buf::new(dev, &vec![T::from_f64(0.0); n], at))
            .collect::<Result<_>>()?;
        tensors.push(Tensor {
            stored: Buf::new(dev, &host_w, layout.stored_at)?,
            inputs,
            m: (states >= 1)
                .then(|| Buf::new(dev, &host_m, layout.m_at))
                .transpose()?,
            v: (states >= 2)
                .then(|| Buf::new(dev, &host_v, layout.v_at))
                .transpose()?,
            layout: layout.clone(),
            host_w,
            host_m,
            host_v,
            first_step: 1 + (i % 3) as u32,
        });
    }

    // The k input pointers of every tensor, one array each, in one allocation.
    let ptrs: Vec<u8> = tensors
        .iter()
        .flat_map(|t| t.inputs.iter().flat_map(|b| b.ptr().to_le_bytes()))
        .collect();
    let ptrs_base = dev.upload(&ptrs)?;

    for step in 0..STEPS {
        // Fresh inputs; stored is NaN where the rule never reads it.
        let mut table = Vec::new();
        let mut first_input = 0;
        let mut sums: Vec<Vec<f32>> = Vec::new();
        for t in tensors.iter_mut() {
            let n = t.layout.n;
            let mut g = vec![0.0f32; n];
            for (j, buf) in t.inputs.iter().enumerate() {
                let x: Vec<T> = random_vec(rng, n, -1.0, 1.0);
                for (g, x) in g.iter_mut().zip(&x) {
                    *g = if j == 0 { x.to_acc() } else { *g + x.to_acc() };
                }
                buf.write(dev, &x)?;
            }
            sums.push(g);
            if rule.kind() == RuleKind::Assign {
                t.stored.write(dev, &vec![T::from_f64(f64::NAN); n])?;
            }
            table.extend(record_bytes(&TensorRecord {
                stored: t.stored.ptr(),
                inputs: ptrs_base + 8 * first_input as u64,
                m: t.m.as_ref().map_or(0, |b| b.ptr()),
                v: t.v.as_ref().map_or(0, |b| b.ptr()),
                n: n as u64,
                k: t.inputs.len() as u32,
                lr_t: rule.lr_t(t.first_step + step),
                _reserved: [0; 2],
            }));
            first_input += t.inputs.len();
        }

        // The block starts follow the records (the ABI).
        let starts = kernels::block_starts(
            tensors
                .iter()
                .map(|t| (t.layout.n as u64, t.inputs.len() as u32)),
        )
        .expect("a small table");
        table.extend(starts.iter().flat_map(|s| s.to_le_bytes()));
        let table = dev.upload(&table)?;
        let mut args = vec![
            Arg::U64(table),
            Arg::U32(tensors.len() as u32),
            Arg::U32(kernels::CHUNK),
        ];
        args.extend(rule.params().into_iter().map(Arg::F32));
        let grid = kernels::grid_dim(*starts.last().unwrap());
        dev.launch(rule.kind(), T::DTYPE, grid, &args)
            .with_context(|| format!("{label}, step {step}"))?;

        for (i, (t, g)) in tensors.iter_mut().zip(&sums).enumerate() {
            let what = format!("{label}, step {step}, tensor {i} ({:?})", t.layout);
            let got_w = t.stored.read(dev, &format!("{what}: stored"))?;
            let got_m = match &t.m {
                Some(b) => b.read(dev, &format!("{what}: m"))?,
                None => vec![],
            };
            let got_v = match &t.v {
                Some(b) => b.read(dev, &format!("{what}: v"))?,
                None => vec![],
            };
            let lr_t = rule.lr_t(t.first_step + step);
            for e in 0..t.layout.n {
                let (mut m, mut v) = (
                    t.host_m.get(e).copied().unwrap_or(0.0),
                    t.host_v.get(e).copied().unwrap_or(0.0),
                );
                let w = T::from_acc(rule.apply(lr_t, g[e], t.host_w[e].to_acc(), &mut m, &mut v));
                let (gw, ww) = (got_w[e].to_acc(), w.to_acc());
                ensure!(
                    close(gw, ww, tol),
                    "{what}: stored[{e}] = {gw}, expected {ww} (rule {rule:?})"
                );
                if states >= 1 {
                    ensure!(
                        close(got_m[e], m, tol.min(1e-6)),
                        "{what}: m[{e}] = {}, expected {m} (rule {rule:?})",
                        got_m[e]
                    );
                }
                if states >= 2 {
                    ensure!(
                        close(got_v[e], v, tol.min(1e-6)),
                        "{what}: v[{e}] = {}, expected {v} (rule {rule:?})",
                        got_v[e]
                    );
                }
            }
            // The next step starts from what the device computed.
            t.host_w = got_w;
            t.host_m = got_m;
            t.host_v = got_v;
        }
    }
    Ok(())
}

/// The number of the module's `.target sm_NN`.
fn ptx_target(text: &str) -> Option<u32> {
    let line = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or("").trim())
        .find(|l| l.starts_with(".target"))?;
    let digits: String = line[".target".len()..]
        .trim()
        .strip_prefix("sm_")?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Says that `test` could not run its case here (a line of its own, which the run counts).
fn skipped(test: &str, why: &str) {
    println!("\nSKIPPED: {test}: {why}");
}

/// Sizes of the single-tensor cases on the GPU.
const GPU_SIZES: &[usize] = &[1, 3, 1000, 4097, (1 << 20) + 5];

/// The GPU sizes, or the emulator's when the "GPU" is the stand-in driver (its kernels run on
/// the same interpreter; `scripts/standin-gpu-tests.sh` sets `KVSTORE_STANDIN`), unless
/// `KVSTORE_STANDIN_FULL_SHAPES=1` asks for the full ones.
fn gpu_sizes() -> &'static [usize] {
    if std::env::var_os("KVSTORE_STANDIN").is_some()
        && std::env::var("KVSTORE_STANDIN_FULL_SHAPES").as_deref() != Ok("1")
    {
        EMULATED_SIZES
    } else {
        GPU_SIZES
    }
}

/// Sizes of the single-tensor cases on the emulator, which runs one thread at a time:
/// 2^16 + 5 (17 chunks) stands in for 2^20 + 5. The tables are the GPU's.
const EMULATED_SIZES: &[usize] = &[1, 3, 1000, 4097, (1 << 16) + 5];

/// Every case for one entry.
fn check_entry<T: Elem>(
    dev: &mut impl Device,
    sizes: &[usize],
    kind: RuleKind,
    tol: f32,
) -> Result<()> {
    let seed: u64 = rand::random();
    let name = kernels::entry_name(kind, T::DTYPE);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut case = 0;
    for k in [1, 3] {
        for &n in sizes {
            let rule = TestRule::random(kind, &mut rng, case % 2 == 1);
            let label = format!("{name} (seed {seed}), n {n}, k {k}");
            run_case::<T>(dev, rule, &[Layout::aligned(n, k)], &mut rng, tol, &label)?;
            case += 1;
        }
        // A table of 50 tensors: tiny, around a chunk, and a few chunks, at mixed offsets.
        let layouts: Vec<Layout> = (0..50)
            .map(|i| {
                let n = match i % 5 {
                    0 => rng.gen_range(1..8),
                    1 => rng.gen_range(8..1000),
                    2 => rng.gen_range(4090..4100),
                    3 => rng.gen_range(1000..20_000),
                    _ => rng.gen_range(20_000..70_000),
                };
                Layout::random(n, k, &mut rng)
            })
            .collect();
        for clipped in [false, true] {
            let rule = TestRule::random(kind, &mut rng, clipped);
            let label = format!("{name} (seed {seed}), table of 50, k {k}");
            run_case::<T>(dev, rule, &layouts, &mut rng, tol, &label)?;
        }
    }
    Ok(())
}

/// Records with `k == 0` or `n == 0` are skipped: every entry must leave their buffers alone.
/// Their pointers are all null, so any access to them faults.
fn check_empty_records(dev: &mut impl Device, dtypes: &[DType]) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(rand::random());
    for kind in RuleKind::ALL {
        for &dtype in dtypes {
            dev.free_all();
            let records = [
                TensorRecord {
                    n: 5,
                    k: 0,
                    ..TensorRecord::default()
                },
                TensorRecord {
                    n: 0,
                    k: 1,
                    ..TensorRecord::default()
                },
            ];
            let mut table: Vec<u8> = records.iter().flat_map(record_bytes).collect();
            let starts = kernels::block_starts(records.iter().map(|r| (r.n, r.k))).unwrap();
            assert_eq!(starts, vec![0, 0, 0], "neither record has work");
            table.extend(starts.iter().flat_map(|s| s.to_le_bytes()));
            let mut args = vec![
                Arg::U64(dev.upload(&table)?),
                Arg::U32(records.len() as u32),
                Arg::U32(kernels::CHUNK),
            ];
            let rule = TestRule::random(kind, &mut rng, false);
            args.extend(rule.params().into_iter().map(Arg::F32));
            // Blocks past `starts[ntensors]` exit at once (a grid rounded up would have them).
            dev.launch(kind, dtype, kernels::grid_dim(3), &args)
                .with_context(|| kernels::entry_name(kind, dtype))?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_skips_empty_records() -> Result<()> {
    let mut gpu = Gpu::new()?;
    let dtypes: Vec<DType> = [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .filter(|&d| match gpu.cannot_run(d) {
            Some(why) => {
                skipped("gpu_skips_empty_records", &format!("{d}: {why}"));
                false
            }
            None => true,
        })
        .collect();
    check_empty_records(&mut gpu, &dtypes)
}

#[test]
fn emulated_skips_empty_records() -> Result<()> {
    check_empty_records(
        &mut Emulated::new()?,
        &[DType::F32, DType::F16, DType::BF16],
    )
}

/// Pushes `STEPS` rounds of `k` random values through a `local` store with `rule`'s updater and
/// checks every pulled value against the reference, which starts from zero state at step 1.
fn check_store<T: Element<Acc = f32>>(rule: TestRule, rng: &mut StdRng, label: &str) -> Result<()> {
    let (n, k) = (1031, 3);
    let kv = KvStore::create("local")?;
    kv.set_updater(rule.updater())?;
    let mut w: Vec<T> = random_vec(rng, n, -1.0, 1.0);
    kv.init(0, &NDArray::from_vec(w.clone(), [n])?)?;
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    for step in 1..=STEPS {
        let xs: Vec<Vec<T>> = (0..k).map(|_| random_vec(rng, n, -1.0, 1.0)).collect();
        let values = xs
            .iter()
            .map(|x| NDArray::from_vec(x.clone(), [n]))
            .collect::<Result<Vec<_>, _>>()?;
        kv.push(0, &values)?;
        let out = NDArray::zeros([n]).astype(T::DTYPE)?;
        kv.pull(0, &out)?;
        let got = out.to_vec::<T>()?;
        let lr_t = rule.lr_t(step);
        for e in 0..n {
            let mut g = xs[0][e].to_acc();
            for x in &xs[1..] {
                g += x[e].to_acc();
            }
            w[e] = T::from_acc(rule.apply(lr_t, g, w[e].to_acc(), &mut m[e], &mut v[e]));
            // The same f32 operations in the same order: equal, bit for bit.
            ensure!(
                got[e].to_f64().to_bits() == w[e].to_f64().to_bits(),
                "{label}, step {step}: store has {:?} at {e}, reference {:?} ({rule:?})",
                got[e],
                w[e]
            );
        }
    }
    Ok(())
}

/// The reference this file compares the GPU with is the CPU store's arithmetic. No GPU needed.
#[test]
fn reference_matches_the_cpu_store() -> Result<()> {
    let seed: u64 = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    for kind in RuleKind::ALL {
        for clipped in [false, true] {
            let rule = TestRule::random(kind, &mut rng, clipped);
            let label = format!("{} (seed {seed})", kind.name());
            check_store::<f32>(rule, &mut rng, &format!("{label}, f32"))?;
            check_store::<f16>(rule, &mut rng, &format!("{label}, f16"))?;
            check_store::<bf16>(rule, &mut rng, &format!("{label}, bf16"))?;
        }
    }
    Ok(())
}

macro_rules! entry_tests {
    ($($test:ident: $rule:ident, $t:ty, $tol:expr;)*) => {
        /// Every entry on GPU 0.
        mod gpu {
            use super::*;
            $(
                #[test]
                #[ignore = "needs a GPU"]
                fn $test() -> Result<()> {
                    let mut gpu = Gpu::new()?;
                    if let Some(why) = gpu.cannot_run(<$t as Element>::DTYPE) {
                        skipped(concat!("gpu::", stringify!($test)), why);
                        return Ok(());
                    }
                    check_entry::<$t>(&mut gpu, gpu_sizes(), RuleKind::$rule, $tol)
                }
            )*
        }

        /// Every entry on the PTX emulator, bit for bit: the emulator's arithmetic is IEEE f32
        /// with round-to-nearest like the GPU's `.rn` instructions, and the kernels promise the
        /// reference's operations in the reference's order (the GPU run gets the tolerance).
        mod emulated {
            use super::*;
            $(
                #[test]
                fn $test() -> Result<()> {
                    check_entry::<$t>(&mut Emulated::new()?, EMULATED_SIZES, RuleKind::$rule, 0.0)
                }
            )*
        }
    };
}

entry_tests! {
    fused_assign_f32: Assign, f32, 1e-6;
    fused_assign_f16: Assign, f16, 1e-2;
    fused_assign_bf16: Assign, bf16, 1e-2;
    fused_axpby_f32: Axpby, f32, 1e-6;
    fused_axpby_f16: Axpby, f16, 1e-2;
    fused_axpby_bf16: Axpby, bf16, 1e-2;
    fused_sgd_f32: Sgd, f32, 1e-6;
    fused_sgd_f16: Sgd, f16, 1e-2;
    fused_sgd_bf16: Sgd, bf16, 1e-2;
    fused_sgd_mom_f32: SgdMom, f32, 1e-6;
    fused_sgd_mom_f16: SgdMom, f16, 1e-2;
    fused_sgd_mom_bf16: SgdMom, bf16, 1e-2;
    fused_adam_f32: Adam, f32, 1e-6;
    fused_adam_f16: Adam, f16, 1e-2;
    fused_adam_bf16: Adam, bf16, 1e-2;
}

/// The example user updater `kernels/user/sgd_f32.ptx` on the emulator, launched as the store
/// launches user updaters, against the same f32 operations written here: plain SGD (no state)
/// and SGD with momentum, over sizes that leave some threads idle and sizes that need the
/// grid-stride loop (more elements than 4096 blocks of 256 threads). Bit for bit.
#[test]
fn emulated_user_sgd_f32() -> Result<()> {
    use kvstore::{PTX_UPDATER_BLOCK, PTX_UPDATER_MAX_BLOCKS};
    let module = Module::parse(kvstore::PtxUpdater::EXAMPLE_SGD_F32)?;
    let entry = module.entry("sgd_f32")?;
    let mut rng = StdRng::seed_from_u64(7);
    let (lr, momentum) = (0.05f32, 0.9f32);
    let big = (PTX_UPDATER_BLOCK * PTX_UPDATER_MAX_BLOCKS) as usize + 37;
    for n in [1, 5, 1000, big] {
        for with_state in [false, true] {
            let mut mem = Memory::default();
            let mut w: Vec<f32> = random_vec(&mut rng, n, -1.0, 1.0);
            let mut m: Vec<f32> = random_vec(&mut rng, n, -0.1, 0.1);
            let w_at = mem.alloc(&f32_bytes(&w));
            let m_at = if with_state {
                mem.alloc(&f32_bytes(&m))
            } else {
                0
            };
            for step in 1..=2u64 {
                let g: Vec<f32> = random_vec(&mut rng, n, -1.0, 1.0);
                let g_at = mem.alloc(&f32_bytes(&g));
                let blocks = (n as u32)
                    .div_ceil(PTX_UPDATER_BLOCK)
                    .min(PTX_UPDATER_MAX_BLOCKS);
                let args = [
                    Arg::U64(w_at),
                    Arg::U64(g_at),
                    Arg::U64(m_at),
                    Arg::U64(0),
                    Arg::U64(n as u64),
                    Arg::U64(step),
                    Arg::F32(lr),
                    Arg::F32(momentum),
                    Arg::F32(0.0),
                    Arg::F32(0.0),
                ];
                ptx_emulator::launch(
                    entry,
                    &mut mem,
                    (blocks, 1, 1),
                    (PTX_UPDATER_BLOCK, 1, 1),
                    &args,
                )
                .with_context(|| format!("n {n}, state {with_state}, step {step}"))?;
                for i in 0..n {
                    let d = if with_state {
                        m[i] = momentum * m[i] + g[i];
                        m[i]
                    } else {
                        g[i]
                    };
                    w[i] -= lr * d;
                }
                let got_w = f32_values(&mem.read(w_at, 4 * n)?);
                ensure!(
                    got_w == w,
                    "n {n}, state {with_state}, step {step}: w differs"
                );
                if with_state {
                    let got_m = f32_values(&mem.read(m_at, 4 * n)?);
                    ensure!(got_m == m, "n {n}, step {step}: m differs");
                }
            }
        }
    }
    Ok(())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

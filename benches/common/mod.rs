//! Workloads shared by the criterion benches (`benches/kv.rs`) and the JSON runner
//! (`examples/bench_kv.rs`), so both time exactly the same calls.
//!
//! - `Target`: CPU (`local` store, `cpu(i)` devices) or GPU (`device`/`nccl` store, `gpu(i)`).
//! - `Kv`: one key with `n` values and `n` outs, for push / pull / pushpull.
//! - `SmallKeys`: 1000 keys of 1 KiB, pushed and pulled as one list call or as a loop.
//! - `roof`: the memory-bandwidth roof, the same access patterns without a store.
//! - `gpu_d2d_copy`: the device-to-device copy roof, only ever called with a GPU present.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvstore::{cpu, gpu, Adam, DType, Device, KvStore, NDArray, Sgd, Updater};

pub(crate) mod size;

/// 1 KiB.
pub(crate) const KIB: usize = 1 << 10;
/// 1 MiB.
pub(crate) const MIB: usize = 1 << 20;

/// `KVSTORE_BENCH_QUICK=1` shrinks the matrix (CI-like runs).
pub(crate) fn quick() -> bool {
    std::env::var("KVSTORE_BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// Value sizes in bytes.
pub(crate) fn sizes() -> Vec<usize> {
    if quick() {
        vec![4 * KIB, MIB, 16 * MIB]
    } else {
        vec![4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB]
    }
}

/// Device counts.
pub(crate) fn dev_counts() -> Vec<usize> {
    if quick() {
        vec![1, 4]
    } else {
        vec![1, 2, 4, 8]
    }
}

/// Devices the `smallkeys` and `updater` benches push from: `KVSTORE_BENCH_DEVS`, else 4 (on the
/// GPU target, as many GPUs as there are, at most 4, so a one-GPU machine runs them too).
pub(crate) fn many_devs(target: Target) -> usize {
    if let Some(n) = std::env::var("KVSTORE_BENCH_DEVS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    match target {
        Target::Cpu => 4,
        Target::Gpu => kvstore::gpu_count().clamp(1, 4),
    }
}

/// The bytes of one key in the `smallkeys` bench: `KVSTORE_BENCH_SMALL_KIB` KiB, else 1 KiB.
pub(crate) fn small_key_bytes() -> usize {
    std::env::var("KVSTORE_BENCH_SMALL_KIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1)
        * KIB
}

/// The size the updater benches use.
pub(crate) fn updater_size() -> usize {
    if quick() {
        16 * MIB
    } else {
        64 * MIB
    }
}

/// A size as `4K`, `64K`, `1M`, `256M`.
pub(crate) fn size_name(bytes: usize) -> String {
    if bytes >= MIB {
        format!("{}M", bytes / MIB)
    } else {
        format!("{}K", bytes / KIB)
    }
}

/// Where the store's values live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// A `local` store with `cpu(i)` devices.
    Cpu,
    /// A `device` (or `nccl`, with `KVSTORE_BENCH_STORE=nccl`) store with `gpu(i)` devices.
    Gpu,
}

impl Target {
    /// `KVSTORE_BENCH_DEVICE=gpu|cpu`, or GPU when the probe finds one.
    pub(crate) fn from_env() -> Target {
        match std::env::var("KVSTORE_BENCH_DEVICE").as_deref() {
            Ok("gpu") => Target::Gpu,
            Ok("cpu") => Target::Cpu,
            _ if kvstore::gpu_count() > 0 => Target::Gpu,
            _ => Target::Cpu,
        }
    }

    /// The store kind name.
    pub(crate) fn store(self) -> String {
        match self {
            Target::Cpu => "local".to_owned(),
            Target::Gpu => std::env::var("KVSTORE_BENCH_STORE").unwrap_or_else(|_| "device".into()),
        }
    }

    /// Device `i`.
    pub(crate) fn device(self, i: usize) -> Device {
        match self {
            Target::Cpu => cpu(i),
            Target::Gpu => gpu(i),
        }
    }

    /// Whether `n` distinct devices exist. Never touches CUDA without a driver.
    pub(crate) fn has(self, n: usize) -> bool {
        match self {
            Target::Cpu => true,
            Target::Gpu => kvstore::gpu_count() >= n,
        }
    }

    /// `cpu` or `gpu`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Gpu => "gpu",
        }
    }
}

/// One key, its `n` pushed values and `n` outs.
pub(crate) struct Kv {
    /// The store.
    pub kv: KvStore,
    /// One value per device.
    pub values: Vec<NDArray>,
    /// One out per device.
    pub outs: Vec<NDArray>,
}

impl Kv {
    /// A store of `target`'s kind holding key 0 of `bytes` bytes of `dtype`, with `updater`.
    pub(crate) fn new(
        target: Target,
        n: usize,
        bytes: usize,
        dtype: DType,
        updater: Updater,
    ) -> Result<Kv> {
        if !target.has(n) {
            bail!("{n} {} devices are not available", target.name());
        }
        let len = bytes / dtype.size();
        let kv = KvStore::create(target.store())?;
        kv.init(0, &NDArray::full_on([len], 0.5, dtype, target.device(0))?)?;
        kv.set_updater(updater)?;
        let values = (0..n)
            .map(|i| NDArray::full_on([len], 0.25 * (i + 1) as f64, dtype, target.device(i)))
            .collect::<kvstore::Result<Vec<_>>>()?;
        let outs = (0..n)
            .map(|i| NDArray::full_on([len], 0.0, dtype, target.device(i)))
            .collect::<kvstore::Result<Vec<_>>>()?;
        Ok(Kv { kv, values, outs })
    }

    /// `kv.push(0, values)`, then wait.
    pub(crate) fn push(&self) -> Result<()> {
        self.kv.push(0, &self.values)?;
        self.kv.wait_all()?;
        Ok(())
    }

    /// `kv.pull(0, outs)`, then wait.
    pub(crate) fn pull(&self) -> Result<()> {
        self.kv.pull(0, &self.outs)?;
        self.kv.wait_all()?;
        Ok(())
    }

    /// `kv.pushpull(0, values, outs)`, then wait.
    pub(crate) fn pushpull(&self) -> Result<()> {
        self.kv.pushpull(0, &self.values, &self.outs)?;
        self.kv.wait_all()?;
        Ok(())
    }
}

/// Bytes a push, pull or pushpull of `n` values of `bytes` moves at the least: push reads `n`
/// values and writes the stored one, `(n+1)·S`; pull reads it and writes `n` outs, `(n+1)·S`.
pub(crate) fn moved(op: &str, n: usize, bytes: usize) -> usize {
    match op {
        "push" | "pull" => (n + 1) * bytes,
        "pushpull" => 2 * (n + 1) * bytes,
        _ => panic!("unknown op {op}"),
    }
}

/// The built-in updaters the updater benches cover.
pub(crate) fn updaters() -> Vec<(&'static str, Updater)> {
    vec![
        ("assign", Updater::Assign),
        ("axpby", Updater::Axpby { a: 0.9, b: 0.1 }),
        ("sgd", Updater::Sgd(Sgd::default())),
        (
            "sgd_mom",
            Updater::Sgd(Sgd {
                momentum: 0.9,
                ..Sgd::default()
            }),
        ),
        ("adam", Updater::Adam(Adam::default())),
    ]
}

/// Bytes a push with `updater` moves at the least: `n` values read, the stored value read (except
/// for assign) and written, and each state buffer (in f32 for the half types) read and written.
pub(crate) fn moved_updater(updater: &Updater, n: usize, bytes: usize, dtype: DType) -> usize {
    let len = bytes / dtype.size();
    let acc = if dtype == DType::F64 { 8 } else { 4 };
    let stored = if matches!(updater, Updater::Assign) {
        1
    } else {
        2
    };
    (n + stored) * bytes + updater.state_names().len() * 2 * len * acc
}

/// The dtypes the updater benches cover.
pub(crate) const UPDATER_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// 1000 keys of 1 KiB, each pushed from `n` devices and pulled into `n` outs.
pub(crate) struct SmallKeys {
    /// The store.
    pub kv: KvStore,
    /// Keys 0..count.
    pub keys: Vec<i32>,
    /// Per key, one value per device.
    pub values: Vec<Vec<NDArray>>,
    /// Per key, one out per device.
    pub outs: Vec<Vec<NDArray>>,
}

impl SmallKeys {
    /// `count` keys of `bytes` f32 bytes each, `n` devices.
    pub(crate) fn new(target: Target, count: usize, bytes: usize, n: usize) -> Result<SmallKeys> {
        if !target.has(n) {
            bail!("{n} {} devices are not available", target.name());
        }
        let len = bytes / 4;
        let kv = KvStore::create(target.store())?;
        let keys: Vec<i32> = (0..count as i32).collect();
        let init = (0..count)
            .map(|_| NDArray::full_on([len], 0.0, DType::F32, target.device(0)))
            .collect::<kvstore::Result<Vec<_>>>()?;
        kv.init_list(&keys, &init)?;
        let arrays = |v: f64| -> Result<Vec<Vec<NDArray>>> {
            (0..count)
                .map(|_| {
                    (0..n)
                        .map(|i| NDArray::full_on([len], v, DType::F32, target.device(i)))
                        .collect::<kvstore::Result<Vec<_>>>()
                        .map_err(Into::into)
                })
                .collect()
        };
        Ok(SmallKeys {
            kv,
            keys,
            values: arrays(1.0)?,
            outs: arrays(0.0)?,
        })
    }

    /// One `push_list` call for every key.
    pub(crate) fn push_list(&self) -> Result<()> {
        self.kv.push_list(&self.keys, &self.values)?;
        self.kv.wait_all()?;
        Ok(())
    }

    /// One `pull_list` call for every key.
    pub(crate) fn pull_list(&self) -> Result<()> {
        self.kv.pull_list(&self.keys, &self.outs)?;
        self.kv.wait_all()?;
        Ok(())
    }

    /// One `push` call per key.
    pub(crate) fn push_loop(&self) -> Result<()> {
        for (k, v) in self.keys.iter().zip(&self.values) {
            self.kv.push(*k, v)?;
        }
        self.kv.wait_all()?;
        Ok(())
    }

    /// One `pull` call per key.
    pub(crate) fn pull_loop(&self) -> Result<()> {
        for (k, o) in self.keys.iter().zip(&self.outs) {
            self.kv.pull(*k, o)?;
        }
        self.kv.wait_all()?;
        Ok(())
    }
}

/// Times `reps` calls of `f` after `warmup` untimed ones; returns every rep's seconds.
pub(crate) fn time_reps(
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        out.push(t.elapsed().as_secs_f64());
    }
    Ok(out)
}

/// The median of `xs`.
pub(crate) fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Timed reps that fit the size: many for small values, few for 256 MiB.
pub(crate) fn auto_reps(bytes: usize) -> usize {
    match bytes {
        b if b <= 64 * KIB => 200,
        b if b <= MIB => 100,
        b if b <= 16 * MIB => 30,
        b if b <= 64 * MIB => 12,
        _ => 6,
    }
}

/// Measurement time and sample count for criterion at a size: cheap for the big ones.
pub(crate) fn criterion_budget(bytes: usize) -> (Duration, usize) {
    match bytes {
        b if b >= 64 * MIB => (Duration::from_secs(2), 10),
        b if b >= 16 * MIB => (Duration::from_secs(2), 20),
        _ => (Duration::from_secs(1), 50),
    }
}

/// The memory-bandwidth roof: the store's access patterns on plain `f32` vectors, both cores.
pub(crate) mod roof {
    use rayon::prelude::*;

    /// Elements per parallel chunk (128 KiB of f32).
    const CHUNK: usize = 32 << 10;
    /// Elements per inner block (4 KiB of f32, stays in L1).
    const BLOCK: usize = 1024;
    /// Below this many bytes of traffic the roof runs on one thread, like the store.
    const SEQ_BYTES: usize = 1 << 20;

    /// Buffers for one roof kernel: `n` inputs and `n` outputs of `len` f32 each.
    pub(crate) struct Bufs {
        /// Inputs (the values of a push).
        pub srcs: Vec<Vec<f32>>,
        /// Outputs (the outs of a pull).
        pub dsts: Vec<Vec<f32>>,
        /// The single stored value.
        pub one: Vec<f32>,
    }

    impl Bufs {
        /// `n` inputs and outputs of `bytes` bytes.
        pub(crate) fn new(n: usize, bytes: usize) -> Bufs {
            let len = bytes / 4;
            Bufs {
                srcs: (0..n).map(|i| vec![0.25 * (i + 1) as f32; len]).collect(),
                dsts: (0..n).map(|_| vec![0.0; len]).collect(),
                one: vec![0.5; len],
            }
        }

        /// `one = src[0]`: 2 words per element.
        pub(crate) fn copy(&mut self) {
            let src = &self.srcs[0];
            run_chunks(&mut self.one, 2, |r, d| d.copy_from_slice(&src[r]));
        }

        /// `one = Σ srcs`: n+1 words per element (push with assign).
        pub(crate) fn sum(&mut self) {
            let srcs = &self.srcs;
            run_chunks(&mut self.one, srcs.len() + 1, |r, d| {
                for (b, d) in d.chunks_mut(BLOCK).enumerate() {
                    let o = r.start + b * BLOCK;
                    d.copy_from_slice(&srcs[0][o..o + d.len()]);
                    for s in &srcs[1..] {
                        for (d, x) in d.iter_mut().zip(&s[o..]) {
                            *d += x;
                        }
                    }
                }
            });
        }

        /// `one = 0.9·one + Σ srcs`: n+2 words per element (push with an updater that reads
        /// the stored value).
        pub(crate) fn sum_rmw(&mut self) {
            let srcs = &self.srcs;
            run_chunks(&mut self.one, srcs.len() + 2, |r, d| {
                let mut acc = [0f32; BLOCK];
                for (b, d) in d.chunks_mut(BLOCK).enumerate() {
                    let o = r.start + b * BLOCK;
                    let acc = &mut acc[..d.len()];
                    acc.copy_from_slice(&srcs[0][o..o + d.len()]);
                    for s in &srcs[1..] {
                        for (a, x) in acc.iter_mut().zip(&s[o..]) {
                            *a += x;
                        }
                    }
                    for (d, a) in d.iter_mut().zip(acc.iter()) {
                        *d = 0.9 * *d + a;
                    }
                }
            });
        }

        /// Every `dsts[i] = one`, each block read once and written n times: n+1 words per
        /// element (pull into n).
        pub(crate) fn bcast(&mut self) {
            let one = &self.one;
            let len = one.len();
            let words = self.dsts.len() + 1;
            let run = |start: usize, outs: Vec<&mut [f32]>| {
                let mut outs = outs;
                let n = outs.first().map_or(0, |o| o.len());
                let mut b = 0;
                while b < n {
                    let e = (b + BLOCK).min(n);
                    let src = &one[start + b..start + e];
                    for o in outs.iter_mut() {
                        o[b..e].copy_from_slice(src);
                    }
                    b = e;
                }
            };
            if len * 4 * words < SEQ_BYTES {
                return run(0, self.dsts.iter_mut().map(|d| d.as_mut_slice()).collect());
            }
            let chunks = len.div_ceil(CHUNK);
            let mut per: Vec<Vec<&mut [f32]>> = (0..chunks).map(|_| Vec::new()).collect();
            for d in self.dsts.iter_mut() {
                for (c, part) in d.chunks_mut(CHUNK).enumerate() {
                    per[c].push(part);
                }
            }
            per.into_par_iter()
                .enumerate()
                .for_each(|(c, outs)| run(c * CHUNK, outs));
        }
    }

    /// Runs `f(range, dst_chunk)` over `dst` in chunks, on both cores unless the traffic
    /// (`words` per element) is small.
    fn run_chunks(
        dst: &mut [f32],
        words: usize,
        f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
    ) {
        let len = dst.len();
        if len * 4 * words < SEQ_BYTES {
            return f(0..len, dst);
        }
        dst.par_chunks_mut(CHUNK).enumerate().for_each(|(c, d)| {
            let s = c * CHUNK;
            let e = s + d.len();
            f(s..e, d)
        });
    }
}

/// Seconds per device-to-device copy of `bytes` on gpu(0), the median of `reps`, using cudarc
/// directly. An error, never a panic, when there is no GPU.
pub(crate) fn gpu_d2d_copy(bytes: usize, reps: usize) -> Result<Vec<f64>> {
    if kvstore::gpu_count() == 0 {
        bail!("no GPU: the D2D copy roof is skipped");
    }
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let src = stream.alloc_zeros::<u8>(bytes)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes)?;
    stream.memcpy_dtod(&src, &mut dst)?;
    stream.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(times)
}

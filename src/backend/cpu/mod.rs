//! Fused loops over host memory: the CPU home of every store kind.
//!
//! A push is one pass: each block of elements is summed over every value into a buffer that
//! stays in L1, and the updater folds it into the stored value (and its state) at once. A pull
//! reads each block once and writes it to every out. Large arrays are split in halves
//! recursively over the store's own thread pool.
//!
//! The store calls these while it holds key locks, so a call must never run anyone else's work
//! while it waits: a rayon worker waiting in `join` steals queued jobs, and one that pushes to
//! a key the suspended call has locked would block that worker forever. So:
//!
//! - A call from an ordinary thread runs on a private pool (`pool()`), whose workers see only
//!   this module's jobs, which take no locks; the caller blocks without stealing.
//! - A call from a worker of any rayon pool (the user's `par_iter`) runs sequentially on that
//!   thread: `install` on another pool would wait by stealing jobs of the caller's pool.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use half::f16;
use half::slice::HalfFloatSliceExt;
use num_traits::{Float, One, Zero};

use crate::dtype::{DType, Element};
use crate::updater::{clip, Rule};

/// A handful of values (one key's outs or locks, or one per key of a call of a few keys), on
/// the stack up to four.
pub(crate) type Few<T> = smallvec::SmallVec<[T; 4]>;

#[cfg(target_arch = "x86_64")]
mod half16;
pub(crate) mod pull;
pub(crate) mod push;
pub(crate) mod rows;
pub(crate) mod state;

/// Elements per block: small enough that a block of sums stays in L1.
const BLOCK: usize = 1024;

pub use crate::config::PAR_MIN_BYTES;

/// Split jobs until a half moves at most this many bytes.
const PAR_GRAIN_BYTES: usize = 256 << 10;

/// The pool large calls from ordinary threads split their work over: one thread per core,
/// made on first use. `None` (every call runs on the caller) on one core, or if it failed.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        if threads < 2 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvstore-cpu-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// The pool to split a call of `bytes` over; `None` for a small call or a rayon worker's.
fn pool_for(bytes: usize, par_min_bytes: usize) -> Option<&'static rayon::ThreadPool> {
    if bytes < par_min_bytes || rayon::current_thread_index().is_some() {
        return None;
    }
    pool()
}

/// Elements per leaf job of a split call: `PAR_GRAIN_BYTES` of traffic, at least a block.
fn grain(len: usize, bytes: usize) -> usize {
    let per_element = (bytes / len.max(1)).max(1);
    (PAR_GRAIN_BYTES / per_element).max(BLOCK)
}

/// A push on one key: values to sum, the stored value, and up to two state buffers.
pub(crate) struct PushJob<'a, T: Element> {
    pub values: Few<&'a [T]>,
    pub stored: &'a mut [T],
    pub state: [&'a mut [T::Acc]; 2],
}

/// A [`PushJob`]'s values, stored value and state buffers.
type JobParts<'a, T> = (
    Few<&'a [T]>,
    &'a mut [T],
    [&'a mut [<T as Element>::Acc]; 2],
);

impl<'a, T: Element> PushJob<'a, T> {
    /// A push of the sum of `values` into `stored`, with `state` (empty buffers where none).
    pub(crate) fn new(
        values: Few<&'a [T]>,
        stored: &'a mut [T],
        state: [&'a mut [T::Acc]; 2],
    ) -> Self {
        PushJob {
            values,
            stored,
            state,
        }
    }

    /// The values, the stored value and the two state buffers.
    fn parts(self) -> JobParts<'a, T> {
        (self.values, self.stored, self.state)
    }

    fn bytes(&self) -> usize {
        let words = self.values.len() + 2;
        let state = self.state.iter().filter(|s| !s.is_empty()).count() * 2;
        let per_element = words * size_of::<T>() + state * size_of::<T::Acc>();
        self.stored.len().saturating_mul(per_element)
    }
}

/// Whether assigning one value of `dtype` copies its bits: f32 and f64, their own accumulator.
/// A push assigning one such value uses the copy loop (faster), or takes its buffer.
pub(crate) fn assign_is_copy(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64)
}

/// Runs one push, `stored = rule(sum(values), stored, state)`, on the pool from `par_min_bytes`.
pub(crate) fn push<T: Element>(job: PushJob<'_, T>, rule: &Rule<T::Acc>, par_min_bytes: usize) {
    if let (Rule::Assign, [value], true) = (rule, &job.values[..], assign_is_copy(T::DTYPE)) {
        return broadcast(value, smallvec::smallvec![job.stored], par_min_bytes);
    }
    let bytes = job.bytes();
    match pool_for(bytes, par_min_bytes) {
        None => push_seq(job, rule),
        Some(pool) => {
            let grain = grain(job.stored.len(), bytes);
            pool.install(|| push_par(job, rule, grain));
        }
    }
}

fn push_par<T: Element>(job: PushJob<'_, T>, rule: &Rule<T::Acc>, grain: usize) {
    let n = job.stored.len();
    if n <= grain {
        return push_seq(job, rule);
    }
    // At least one block, so both halves shrink even when `n` is under two blocks.
    let mid = (n / 2 / BLOCK * BLOCK).max(BLOCK);
    let (values, stored, [s0, s1]) = job.parts();
    let (lo_v, hi_v) = values.iter().map(|v| v.split_at(mid)).unzip();
    let (lo_w, hi_w) = stored.split_at_mut(mid);
    let (lo_0, hi_0) = split_state(s0, mid);
    let (lo_1, hi_1) = split_state(s1, mid);
    let lo = PushJob::new(lo_v, lo_w, [lo_0, lo_1]);
    let hi = PushJob::new(hi_v, hi_w, [hi_0, hi_1]);
    rayon::join(|| push_par(lo, rule, grain), || push_par(hi, rule, grain));
}

fn split_state<A>(s: &mut [A], mid: usize) -> (&mut [A], &mut [A]) {
    if s.is_empty() {
        (&mut [], &mut [])
    } else {
        s.split_at_mut(mid)
    }
}

/// Whether float16/bfloat16 pushes may take the AVX2/F16C block loop (`half16`).
static SIMD16: AtomicBool = AtomicBool::new(true);

/// Lets this process's float16 and bfloat16 pushes use the AVX2/F16C loop (`true`, default)
/// or the portable ones (the same bits, for benches); returns the previous setting.
pub fn set_simd16(enabled: bool) -> bool {
    SIMD16.swap(enabled, Ordering::Relaxed)
}

fn push_seq<T: Element>(job: PushJob<'_, T>, rule: &Rule<T::Acc>) {
    // One CPU check per call picks the AVX2/F16C loop for float16 and bfloat16.
    #[cfg(target_arch = "x86_64")]
    if matches!(T::DTYPE, DType::F16 | DType::BF16)
        && SIMD16.load(Ordering::Relaxed)
        && half16::available()
    {
        return half16::push_seq(job, rule);
    }
    if T::DTYPE == DType::F16 {
        return push_seq_f16(job, rule);
    }
    push_seq_generic(job, rule)
}

/// The portable loop for every dtype (bfloat16 too when the CPU lacks AVX2 or F16C).
fn push_seq_generic<T: Element>(job: PushJob<'_, T>, rule: &Rule<T::Acc>) {
    // A small key's sum lives in a small block: zeroing 1024 accumulators for a key of 256
    // elements was most of the work of a push of many small keys.
    match job.stored.len() <= SMALL_BLOCK {
        true => push_seq_blocks::<T, SMALL_BLOCK>(job, rule),
        false => push_seq_blocks::<T, BLOCK>(job, rule),
    }
}

/// The elements of the block of a key of at most this many elements.
const SMALL_BLOCK: usize = 256;

/// A block of sums on a cache line's boundary, so that no vector load or store of it straddles
/// two lines wherever the caller's stack frame puts it (a push of 1 MiB ran 7% slower with the
/// block at another offset).
#[repr(C, align(64))]
pub(super) struct Aligned<A>(pub(super) A);

/// [`push_seq_generic`], `B` elements at a time.
fn push_seq_blocks<T: Element, const B: usize>(job: PushJob<'_, T>, rule: &Rule<T::Acc>) {
    let (values, stored, [s0, s1]) = job.parts();
    let mut acc = Aligned([T::Acc::zero(); B]);
    let acc = &mut acc.0;
    let n = stored.len();
    let mut start = 0;
    while start < n {
        let end = (start + B).min(n);
        let acc = &mut acc[..end - start];
        sum_block(&values, start..end, acc);
        let w = &mut stored[start..end];
        let m = part(s0, start..end);
        let v = part(s1, start..end);
        update_block(rule, acc, w, m, v);
        start = end;
    }
}

/// The portable float16 push: the generic loop's f32 arithmetic, with each block converted by
/// `half`'s slice conversions (F16C where the CPU has it), which round as its scalar ones do.
fn push_seq_f16<T: Element>(job: PushJob<'_, T>, rule: &Rule<T::Acc>) {
    debug_assert_eq!(T::DTYPE, DType::F16);
    let (values, stored, [s0, s1]) = job.parts();
    // SAFETY: `Element` is sealed and `half::f16` is its only type with DTYPE F16, whose
    // accumulator type is f32; so `T` is `f16` and `T::Acc` is `f32`, and these casts only
    // rename the types of the same slices and rule (same layout, same lengths, same lifetimes).
    let (values, stored, s0, s1, rule) = unsafe {
        let values: Few<&[f16]> = values
            .iter()
            .map(|v| std::slice::from_raw_parts(v.as_ptr().cast::<f16>(), v.len()))
            .collect();
        let stored =
            std::slice::from_raw_parts_mut(stored.as_mut_ptr().cast::<f16>(), stored.len());
        let s0 = std::slice::from_raw_parts_mut(s0.as_mut_ptr().cast::<f32>(), s0.len());
        let s1 = std::slice::from_raw_parts_mut(s1.as_mut_ptr().cast::<f32>(), s1.len());
        let rule = &*(rule as *const Rule<T::Acc>).cast::<Rule<f32>>();
        (values, stored, s0, s1, rule)
    };
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    let mut w = [0f32; BLOCK];
    let n = stored.len();
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let len = end - start;
        let (acc, tmp, w) = (&mut acc[..len], &mut tmp[..len], &mut w[..len]);
        let (first, rest) = values.split_first().expect("a push has at least one value");
        first[start..end].convert_to_f32_slice(acc);
        for v in rest {
            v[start..end].convert_to_f32_slice(tmp);
            for (a, x) in acc.iter_mut().zip(tmp.iter()) {
                *a += x;
            }
        }
        let out = &mut stored[start..end];
        if !matches!(rule, Rule::Assign) {
            out.convert_to_f32_slice(w);
        }
        let m = part(s0, start..end);
        let v = part(s1, start..end);
        update_block::<f32>(rule, acc, w, m, v);
        out.convert_from_f32_slice(w);
        start = end;
    }
}

fn part<A>(s: &mut [A], r: std::ops::Range<usize>) -> &mut [A] {
    if s.is_empty() {
        s
    } else {
        &mut s[r]
    }
}

/// `acc = Σ values[j][range]`, in the accumulator type.
#[inline]
fn sum_block<T: Element>(values: &[&[T]], range: std::ops::Range<usize>, acc: &mut [T::Acc]) {
    let (first, rest) = values.split_first().expect("a push has at least one value");
    for (a, x) in acc.iter_mut().zip(&first[range.clone()]) {
        *a = x.to_acc();
    }
    for v in rest {
        for (a, x) in acc.iter_mut().zip(&v[range.clone()]) {
            *a += x.to_acc();
        }
    }
}

/// Folds the sum `g` into the block `w` and its state `m`, `v` (inlined: AVX2 in `half16`).
#[inline(always)]
fn update_block<T: Element>(
    rule: &Rule<T::Acc>,
    g: &[T::Acc],
    w: &mut [T],
    m: &mut [T::Acc],
    v: &mut [T::Acc],
) {
    let one = T::Acc::one();
    match *rule {
        Rule::Assign => {
            for (w, &g) in w.iter_mut().zip(g) {
                *w = T::from_acc(g);
            }
        }
        Rule::Axpby { a, b } => {
            for (w, &g) in w.iter_mut().zip(g) {
                *w = T::from_acc(a * w.to_acc() + b * g);
            }
        }
        Rule::Sgd {
            lr,
            wd,
            rescale,
            clip: c,
        } => {
            let keep = one - lr * wd;
            for (w, &g) in w.iter_mut().zip(g) {
                *w = T::from_acc(keep * w.to_acc() - lr * clip(rescale * g, c));
            }
        }
        Rule::SgdMom {
            lr,
            momentum,
            wd,
            rescale,
            clip: c,
        } => {
            for ((w, &g), m) in w.iter_mut().zip(g).zip(m.iter_mut()) {
                let x = w.to_acc();
                *m = momentum * *m - lr * wd * x - lr * clip(rescale * g, c);
                *w = T::from_acc(x + *m);
            }
        }
        Rule::Adam {
            lr_t,
            beta1,
            beta2,
            epsilon,
            wd,
            rescale,
            clip: c,
        } => {
            for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let x = w.to_acc();
                let g = clip(rescale * g + wd * x, c);
                *m = beta1 * *m + (one - beta1) * g;
                *v = beta2 * *v + (one - beta2) * g * g;
                *w = T::from_acc(x - lr_t * *m / (v.sqrt() + epsilon));
            }
        }
    }
}

/// `dst = Σ values`, rounded once from the accumulator: a custom updater's merged input.
pub(crate) fn sum_into<T: Element>(values: &[&[T]], dst: &mut [T], par_min_bytes: usize) {
    let job = PushJob::new(values.iter().copied().collect(), dst, [&mut [], &mut []]);
    push(job, &Rule::Assign, par_min_bytes);
}

/// Copies `src` into every out, a block at a time, on the pool from `par_min_bytes`.
pub(crate) fn broadcast<T: Copy + Send + Sync>(
    src: &[T],
    outs: Few<&mut [T]>,
    par_min_bytes: usize,
) {
    let bytes = std::mem::size_of_val(src).saturating_mul(outs.len() + 1);
    match pool_for(bytes, par_min_bytes) {
        None => broadcast_seq(src, outs),
        Some(pool) => {
            let grain = grain(src.len(), bytes);
            pool.install(|| broadcast_par(src, outs, grain));
        }
    }
}

fn broadcast_par<T: Copy + Send + Sync>(src: &[T], outs: Few<&mut [T]>, grain: usize) {
    if src.len() <= grain {
        return broadcast_seq(src, outs);
    }
    let mid = (src.len() / 2 / BLOCK * BLOCK).max(BLOCK);
    let (lo_s, hi_s) = src.split_at(mid);
    let (lo, hi): (Few<_>, Few<_>) = outs.into_iter().map(|o| o.split_at_mut(mid)).unzip();
    rayon::join(
        || broadcast_par(lo_s, lo, grain),
        || broadcast_par(hi_s, hi, grain),
    );
}

fn broadcast_seq<T: Copy>(src: &[T], mut outs: Few<&mut [T]>) {
    if let [out] = outs.as_mut_slice() {
        return crate::memcopy::copy(out, src);
    }
    for (i, block) in src.chunks(4 * BLOCK).enumerate() {
        let start = i * 4 * BLOCK;
        for out in outs.iter_mut() {
            crate::memcopy::copy(&mut out[start..start + block.len()], block);
        }
    }
}

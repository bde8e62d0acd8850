//! The 16-bit pushes (float16, bfloat16) with x86-64 AVX2 and F16C (compiled on x86-64 only).
//!
//! Each 1024-element block is widened to f32 8 lanes at a time (bfloat16: 16), summed in
//! registers, folded by the shared f32 rule ([`update_block`]) and narrowed back, in one
//! function compiled with `avx2,f16c` so the conversions inline into the loop. [`available`]
//! is the one run-time check per call; other CPUs take the portable loops (the same bits).
//!
//! The conversions are bit-identical to the `half` crate's:
//! - float16 uses the F16C instructions `half` picks at run time (`vcvtph2ps`; `vcvtps2ph`
//!   rounding to nearest-even);
//! - bfloat16 restates `half`'s integer rules: widening is a shift (NaNs get their quiet bit),
//!   narrowing adds `0x7fff` plus the lowest kept bit and truncates (ties to even, subnormals
//!   kept). AVX-512 BF16's `vcvtneps2bf16` would change results: it flushes subnormals to zero.
//!
//! The arithmetic is the same IEEE f32 operations in the same order as the portable path. Where
//! two NaNs meet in the sum, the running sum's is kept ([`add_first_nan`]); Rust leaves that
//! choice unspecified, and the portable loops make it differently in their vector body and tail.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::{part, update_block, PushJob, BLOCK};
use crate::dtype::{DType, Element};
use crate::updater::Rule;

/// Whether this CPU has AVX2 and F16C for [`push_seq`] (`std` caches CPUID: one atomic load).
#[inline]
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

/// A float16 or bfloat16 push on the fast path. The caller checked [`available`].
///
/// # Panics
/// If `T` is not `f16` or `bf16`, or the CPU lacks AVX2 or F16C.
pub(super) fn push_seq<T: Element>(job: PushJob<'_, T>, rule: &Rule<T::Acc>) {
    assert!(
        matches!(T::DTYPE, DType::F16 | DType::BF16),
        "the 16-bit path got {}",
        T::DTYPE
    );
    assert!(available(), "the 16-bit fast path needs AVX2 and F16C");
    let (values, stored, [s0, s1]) = job.parts();
    // SAFETY: `Element` is sealed; its only types with DTYPE F16 and BF16 are `half::f16` and
    // `half::bf16`, both `repr(transparent)` over `u16`, and their accumulator type is f32. So
    // these casts only rename the element types of the same slices and rule (same size,
    // alignment and length, same lifetimes); every u16 bit pattern is a valid f16/bf16.
    let (values, stored, s0, s1, rule) = unsafe {
        let values: super::Few<&[u16]> = values
            .iter()
            .map(|v| std::slice::from_raw_parts(v.as_ptr().cast::<u16>(), v.len()))
            .collect();
        let stored =
            std::slice::from_raw_parts_mut(stored.as_mut_ptr().cast::<u16>(), stored.len());
        let s0 = std::slice::from_raw_parts_mut(s0.as_mut_ptr().cast::<f32>(), s0.len());
        let s1 = std::slice::from_raw_parts_mut(s1.as_mut_ptr().cast::<f32>(), s1.len());
        let rule = &*(rule as *const Rule<T::Acc>).cast::<Rule<f32>>();
        (values, stored, s0, s1, rule)
    };
    let run = match (T::DTYPE == DType::BF16, values.len()) {
        (false, 1) => blocks_x86::<false, 0>,
        (false, 2) => blocks_x86::<false, 1>,
        (false, 3) => blocks_x86::<false, 2>,
        (false, _) => blocks_x86::<false, 3>,
        (true, 1) => blocks_x86::<true, 0>,
        (true, 2) => blocks_x86::<true, 1>,
        (true, 3) => blocks_x86::<true, 2>,
        (true, _) => blocks_x86::<true, 3>,
    };
    // SAFETY: `available()` was asserted above, so the CPU has AVX2 and F16C; `R` is at most
    // the number of values after the first (`values` is never empty: `split_first` panics).
    unsafe { run(&values, stored, s0, s1, rule) }
}

/// The block loop: `stored = rule(Σ values, stored, state)` in f32, with 16-bit storage
/// (bfloat16 when `BF`, float16 otherwise).
///
/// Within a block, 8 elements (bfloat16: 16) at a time of the first `R + 1` values are widened
/// and summed in registers, so those streams advance together; further values are added in an
/// L1 buffer, one pass each. An assign of up to 4 values narrows the sum straight into
/// `stored`; otherwise the rule gets the sum from the L1 buffer.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
unsafe fn blocks_x86<const BF: bool, const R: usize>(
    values: &[&[u16]],
    stored: &mut [u16],
    s0: &mut [f32],
    s1: &mut [f32],
    rule: &Rule<f32>,
) {
    let (first, rest) = values.split_first().expect("a push has at least one value");
    let (head, more) = rest.split_at(R);
    let assign = matches!(rule, Rule::Assign);
    let direct = assign && more.is_empty();
    let mut acc = super::Aligned([0f32; BLOCK]);
    let acc = &mut acc.0;
    let mut w = super::Aligned([0f32; BLOCK]);
    let w = &mut w.0;
    let n = stored.len();
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let len = end - start;
        let (acc, w) = (&mut acc[..len], &mut w[..len]);
        let out = &mut stored[start..end];
        let f = &first[start..end];
        let h: [&[u16]; R] = std::array::from_fn(|k| &head[k][start..end]);
        // bfloat16 goes 16 lanes at a time first: unpacking a 32-byte load with zeros gives two
        // vectors of f32 in an order within 128-bit lanes that the narrowing pack undoes.
        let body16 = if BF { len / 16 * 16 } else { 0 };
        for j in (0..body16).step_by(16) {
            let (mut lo, mut hi) = unpack_bf16(load16(f, j));
            if R == 0 {
                (lo, hi) = (quiet(lo), quiet(hi));
            }
            for v in &h {
                let (l, u) = unpack_bf16(load16(v, j));
                (lo, hi) = (add_first_nan(lo, l), add_first_nan(hi, u));
            }
            if direct {
                let bits = _mm256_packus_epi32(narrow_bf16_bits(lo), narrow_bf16_bits(hi));
                let d: &mut [u16; 16] = (&mut out[j..j + 16]).try_into().expect("16 lanes");
                // SAFETY: `d` is 16 u16 (32 bytes); the store is unaligned.
                unsafe { _mm256_storeu_si256(d.as_mut_ptr().cast(), bits) };
            } else {
                let a: &mut [f32; 16] = (&mut acc[j..j + 16]).try_into().expect("16 lanes");
                // SAFETY: `a` is 16 f32 (64 bytes); the two stores are unaligned and in it.
                unsafe {
                    _mm256_storeu_ps(a.as_mut_ptr(), _mm256_permute2f128_ps::<0x20>(lo, hi));
                    _mm256_storeu_ps(
                        a.as_mut_ptr().add(8),
                        _mm256_permute2f128_ps::<0x31>(lo, hi),
                    );
                }
            }
        }
        let body = len / 8 * 8;
        for j in (body16..body).step_by(8) {
            // With another value to add, the add quiets a signalling NaN as `half` would.
            let mut x = if R == 0 {
                widen8::<BF>(load8(f, j))
            } else {
                widen8_raw::<BF>(load8(f, j))
            };
            for v in &h {
                x = add_first_nan(x, widen8_raw::<BF>(load8(v, j)));
            }
            if direct {
                store8(out, j, narrow8::<BF>(x));
            } else {
                let a: &mut [f32; 8] = (&mut acc[j..j + 8]).try_into().expect("8 lanes");
                // SAFETY: `a` is 8 f32 (32 bytes); the store is unaligned.
                unsafe { _mm256_storeu_ps(a.as_mut_ptr(), x) };
            }
        }
        for j in body..len {
            let mut x = widen1::<BF>(f[j]);
            for v in &h {
                add1_first_nan::<BF>(&mut x, v[j]);
            }
            if direct {
                out[j] = narrow1::<BF>(x);
            } else {
                acc[j] = x;
            }
        }
        if direct {
            start = end;
            continue;
        }
        for v in more {
            add_widened::<BF>(&v[start..end], acc);
        }
        if assign {
            narrow::<BF>(acc, out);
        } else {
            widen::<BF>(out, w);
            let m = part(s0, start..end);
            let v = part(s1, start..end);
            update_block::<f32>(rule, acc, w, m, v);
            narrow::<BF>(w, out);
        }
        start = end;
    }
}

/// `acc += widen(src)`, keeping `acc`'s NaNs. Same lengths.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn add_widened<const BF: bool>(src: &[u16], acc: &mut [f32]) {
    debug_assert_eq!(src.len(), acc.len());
    let mut s = src.chunks_exact(8);
    let mut d = acc.chunks_exact_mut(8);
    for (s, d) in (&mut s).zip(&mut d) {
        // SAFETY: `s` has 8 u16 (16 bytes) and `d` 8 f32 (32 bytes); the loads and stores are
        // unaligned, so any address is fine. AVX2 and F16C are enabled on this function.
        unsafe {
            let x = widen8_raw::<BF>(_mm_loadu_si128(s.as_ptr().cast()));
            let a = _mm256_loadu_ps(d.as_ptr());
            _mm256_storeu_ps(d.as_mut_ptr(), add_first_nan(a, x));
        }
    }
    for (&s, d) in s.remainder().iter().zip(d.into_remainder()) {
        add1_first_nan::<BF>(d, s);
    }
}

/// `*x += widen(h)` unless `x` is a NaN: one element of [`add_first_nan`].
#[inline]
fn add1_first_nan<const BF: bool>(x: &mut f32, h: u16) {
    // With `x` not a NaN at most one operand is, and the add returns it (quiet) whichever
    // order the compiler gives the operands.
    if !x.is_nan() {
        *x += widen1::<BF>(h);
    }
}

/// The 8 elements of `s` from `i`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn load8(s: &[u16], i: usize) -> __m128i {
    let s: &[u16; 8] = s[i..i + 8].try_into().expect("8 lanes");
    // SAFETY: `s` is 8 u16 (16 bytes); the load is unaligned.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// The 16 elements of `s` from `i`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn load16(s: &[u16], i: usize) -> __m256i {
    let s: &[u16; 16] = s[i..i + 16].try_into().expect("16 lanes");
    // SAFETY: `s` is 16 u16 (32 bytes); the load is unaligned.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 16 bfloat16 to f32 as [`widen8_raw`], in two vectors (elements 0–3 and 8–11, 4–7 and
/// 12–15), which `_mm256_packus_epi32` of the narrowed two puts back in order.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn unpack_bf16(h: __m256i) -> (__m256, __m256) {
    let zero = _mm256_setzero_si256();
    let lo = _mm256_unpacklo_epi16(zero, h);
    let hi = _mm256_unpackhi_epi16(zero, h);
    (_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi))
}

/// Sets the quiet bit of the NaN lanes of widened bfloat16, as `half`'s widening does.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn quiet(x: __m256) -> __m256 {
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    let bit = _mm256_and_ps(nan, _mm256_castsi256_ps(_mm256_set1_epi32(0x0040_0000)));
    _mm256_or_ps(x, bit)
}

/// Stores 8 lanes into `d` from `j`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn store8(d: &mut [u16], j: usize, x: __m128i) {
    let d: &mut [u16; 8] = (&mut d[j..j + 8]).try_into().expect("8 lanes");
    // SAFETY: `d` is 8 u16 (16 bytes); the store is unaligned.
    unsafe { _mm_storeu_si128(d.as_mut_ptr().cast(), x) }
}

/// `dst = widen(src)`. Same lengths.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn widen<const BF: bool>(src: &[u16], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    let mut s = src.chunks_exact(8);
    let mut d = dst.chunks_exact_mut(8);
    for (s, d) in (&mut s).zip(&mut d) {
        // SAFETY: `s` has 8 u16 (16 bytes) and `d` 8 f32 (32 bytes); the loads and stores are
        // unaligned, so any address is fine. AVX2 and F16C are enabled on this function.
        unsafe {
            let x = widen8::<BF>(_mm_loadu_si128(s.as_ptr().cast()));
            _mm256_storeu_ps(d.as_mut_ptr(), x);
        }
    }
    for (&s, d) in s.remainder().iter().zip(d.into_remainder()) {
        *d = widen1::<BF>(s);
    }
}

/// `a + b`, keeping a NaN `a` as it is: `vaddps` with `a` first, written out because LLVM may
/// swap an add's operands and x86 returns the first source's NaN. A signalling NaN (only a
/// bfloat16 from [`widen8_raw`]) comes out with quiet bit `0x0040_0000`, as `half` widens it.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn add_first_nan(a: __m256, b: __m256) -> __m256 {
    let r: __m256;
    // SAFETY: one AVX instruction on registers (AVX is enabled on this function); it reads no
    // memory, uses no stack and leaves the flags alone, as the options say.
    unsafe {
        std::arch::asm!(
            "vaddps {r}, {a}, {b}",
            r = lateout(ymm_reg) r,
            a = in(ymm_reg) a,
            b = in(ymm_reg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    r
}

/// `dst = narrow(src)`. Same lengths.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn narrow<const BF: bool>(src: &[f32], dst: &mut [u16]) {
    debug_assert_eq!(src.len(), dst.len());
    let mut s = src.chunks_exact(8);
    let mut d = dst.chunks_exact_mut(8);
    for (s, d) in (&mut s).zip(&mut d) {
        // SAFETY: `s` has 8 f32 (32 bytes) and `d` 8 u16 (16 bytes); the loads and stores are
        // unaligned, so any address is fine. AVX2 and F16C are enabled on this function.
        unsafe {
            let x = narrow8::<BF>(_mm256_loadu_ps(s.as_ptr()));
            _mm_storeu_si128(d.as_mut_ptr().cast(), x);
        }
    }
    for (&s, d) in s.remainder().iter().zip(d.into_remainder()) {
        *d = narrow1::<BF>(s);
    }
}

/// Eight 16-bit floats to f32, exactly as `half`'s `to_f32`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn widen8<const BF: bool>(h: __m128i) -> __m256 {
    if !BF {
        return _mm256_cvtph_ps(h);
    }
    // bfloat16: the bits go to the top half of an f32; a NaN (`h & 0x7fff > 0x7f80`) also gets
    // its quiet bit, 0x40, set first.
    let x = _mm256_cvtepu16_epi32(h);
    let nan = _mm256_cmpgt_epi32(
        _mm256_and_si256(x, _mm256_set1_epi32(0x7fff)),
        _mm256_set1_epi32(0x7f80),
    );
    let x = _mm256_or_si256(x, _mm256_and_si256(nan, _mm256_set1_epi32(0x40)));
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x))
}

/// Eight 16-bit floats to f32 for an add: as [`widen8`], but a bfloat16 signalling NaN stays
/// signalling; the add quiets it with the bit `half`'s widening sets (`0x0040_0000`).
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn widen8_raw<const BF: bool>(h: __m128i) -> __m256 {
    if !BF {
        return _mm256_cvtph_ps(h);
    }
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

/// Eight f32 to 16-bit floats, exactly as `half`'s `from_f32` (round to nearest, ties to even).
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn narrow8<const BF: bool>(f: __m256) -> __m128i {
    if !BF {
        return _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
    }
    let r = narrow_bf16_bits(f);
    // Every lane is in 0..=0xffff, so the unsigned saturating pack keeps it as is.
    _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r))
}

/// Eight f32 to bfloat16 as `half`'s `from_f32`, each in the low half of a 32-bit lane.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn narrow_bf16_bits(f: __m256) -> __m256i {
    let x = _mm256_castps_si256(f);
    let top = _mm256_srli_epi32::<16>(x);
    // Rounded: (x + 0x7fff + bit 16 of x) >> 16. It cannot wrap for a non-NaN: the largest
    // such bit pattern, -inf, is 0xff80_0000.
    let lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
    let x_bias = _mm256_add_epi32(x, _mm256_set1_epi32(0x7fff));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x_bias, lsb));
    // A NaN: the top half with the quiet bit set.
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(f, f));
    let quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

/// One 16-bit float to f32 (the tail of a block that is not a multiple of 8).
#[inline]
fn widen1<const BF: bool>(h: u16) -> f32 {
    if BF {
        bf16::from_bits(h).to_f32()
    } else {
        f16::from_bits(h).to_f32()
    }
}

/// One f32 to a 16-bit float (the tail of a block that is not a multiple of 8).
#[inline]
fn narrow1<const BF: bool>(x: f32) -> u16 {
    if BF {
        bf16::from_f32(x).to_bits()
    } else {
        f16::from_f32(x).to_bits()
    }
}

#[cfg(test)]
mod tests {
    //! The fast path against two references, bit for bit: the portable loops of the parent
    //! module (today's code, which a CPU without AVX2/F16C runs) and a scalar model built from
    //! `half`'s software conversions (`to_f32_const`/`from_f32_const`, which never use SIMD)
    //! and the f32 rule applied one element at a time.

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::super::{push_seq_f16, push_seq_generic};
    use super::*;

    /// A fresh seed per run (printed on failure), or `KVSTORE_TEST_SEED`.
    fn rng() -> (StdRng, u64) {
        let seed = std::env::var("KVSTORE_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(rand::random);
        (StdRng::seed_from_u64(seed), seed)
    }

    fn soft_to_f32(bits: u16, bf: bool) -> f32 {
        if bf {
            bf16::from_bits(bits).to_f32_const()
        } else {
            f16::from_bits(bits).to_f32_const()
        }
    }

    fn soft_from_f32(x: f32, bf: bool) -> u16 {
        if bf {
            bf16::from_f32_const(x).to_bits()
        } else {
            f16::from_f32_const(x).to_bits()
        }
    }

    fn widen_fast(src: &[u16], bf: bool) -> Vec<f32> {
        assert!(available(), "these tests need AVX2 and F16C");
        let mut out = vec![f32::NAN; src.len()];
        // SAFETY: `available()` was asserted: the CPU has AVX2 and F16C.
        unsafe {
            if bf {
                widen::<true>(src, &mut out)
            } else {
                widen::<false>(src, &mut out)
            }
        }
        out
    }

    fn narrow_fast(src: &[f32], bf: bool) -> Vec<u16> {
        assert!(available(), "these tests need AVX2 and F16C");
        let mut out = vec![0x5555; src.len()];
        // SAFETY: `available()` was asserted: the CPU has AVX2 and F16C.
        unsafe {
            if bf {
                narrow::<true>(src, &mut out)
            } else {
                narrow::<false>(src, &mut out)
            }
        }
        out
    }

    /// f32 inputs that stress narrowing: every exact midpoint between neighbouring 16-bit
    /// values and its two f32 neighbours, NaNs with every top payload, infinities, f32
    /// subnormals, and random bit patterns.
    fn narrowing_inputs(bf: bool, rng: &mut StdRng) -> Vec<f32> {
        let mut xs = Vec::new();
        for h in 0..=u16::MAX {
            let lo = soft_to_f32(h, bf);
            let hi = soft_to_f32(h.wrapping_add(1), bf);
            xs.push(lo);
            if lo.is_finite() && hi.is_finite() && (lo < 0.0) == (hi < 0.0) {
                let mid = lo + (hi - lo) / 2.0;
                let b = mid.to_bits();
                xs.extend([mid, f32::from_bits(b + 1), f32::from_bits(b - 1)]);
            }
            // The same top bits with the low bits that decide rounding and NaN-ness.
            let top = u32::from(h) << 16;
            for low in [1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                xs.push(f32::from_bits(top | low));
            }
        }
        for b in [
            0x0000_0001,
            0x007f_ffff,
            0x0080_0000,
            0x3380_0000,
            0x3380_0001,
        ] {
            xs.extend([f32::from_bits(b), -f32::from_bits(b)]);
        }
        xs.extend((0..1 << 20).map(|_| f32::from_bits(rng.gen())));
        xs
    }

    #[test]
    fn conversions_match_half_bit_for_bit() {
        let (mut rng, seed) = rng();
        for bf in [false, true] {
            // Widening: all 65 536 bit patterns (the last 0 lanes go through the scalar tail).
            let all: Vec<u16> = (0..=u16::MAX).collect();
            for len in [all.len(), all.len() - 5] {
                let got = widen_fast(&all[..len], bf);
                for (&h, g) in all.iter().zip(&got) {
                    let want = soft_to_f32(h, bf);
                    assert_eq!(g.to_bits(), want.to_bits(), "bf16={bf} widen {h:#06x}");
                }
            }
            let xs = narrowing_inputs(bf, &mut rng);
            for len in [xs.len(), xs.len() - 3] {
                let got = narrow_fast(&xs[..len], bf);
                for (x, g) in xs.iter().zip(&got) {
                    let want = soft_from_f32(*x, bf);
                    assert_eq!(
                        *g,
                        want,
                        "bf16={bf} narrow {:#010x} (seed {seed})",
                        x.to_bits()
                    );
                }
            }
        }
    }

    /// One 16-bit input: random bits, values of nearby exponents (so sums round and tie),
    /// subnormals, values near overflow, and the specials.
    fn value_bits(bf: bool, rng: &mut StdRng) -> u16 {
        let (exp_bits, man_bits) = if bf { (8, 7) } else { (5, 10) };
        let max_exp = (1u16 << exp_bits) - 1;
        let sign = if rng.gen() { 0x8000 } else { 0 };
        let man = rng.gen::<u16>() & ((1 << man_bits) - 1);
        let with_exp = |e: u16| sign | (e << man_bits) | man;
        match rng.gen_range(0..10) {
            0..=3 => rng.gen(),
            4..=6 => with_exp(max_exp / 2 + rng.gen_range(0..4)),
            7 => with_exp(rng.gen_range(0..2)),
            8 => with_exp(max_exp - 1),
            _ => {
                let specials = [
                    0,
                    0x8000,
                    max_exp << man_bits,                           // +inf
                    0x8000 | (max_exp << man_bits),                // -inf
                    (max_exp << man_bits) | 1,                     // signalling NaN
                    (max_exp << man_bits) | (1 << (man_bits - 1)), // quiet NaN
                    0x8000 | (max_exp << man_bits) | man | 1,      // NaN with a payload
                    1,                                             // smallest subnormal
                    (max_exp << man_bits) - 1,                     // largest finite
                ];
                specials[rng.gen_range(0..specials.len())]
            }
        }
    }

    fn state_value(rng: &mut StdRng) -> f32 {
        match rng.gen_range(0..10) {
            0 => f32::from_bits(rng.gen()),
            1 => 0.0,
            _ => rng.gen_range(-4.0..4.0),
        }
    }

    fn rules() -> Vec<Rule<f32>> {
        let inf = f32::INFINITY;
        vec![
            Rule::Assign,
            Rule::Axpby { a: 0.9, b: 0.1 },
            Rule::Axpby { a: 1.0, b: -2.5 },
            Rule::Sgd {
                lr: 0.01,
                wd: 0.0,
                rescale: 1.0,
                clip: inf,
            },
            Rule::Sgd {
                lr: 0.1,
                wd: 1e-4,
                rescale: 0.5,
                clip: 0.25,
            },
            Rule::SgdMom {
                lr: 0.1,
                momentum: 0.9,
                wd: 1e-4,
                rescale: 1.0,
                clip: inf,
            },
            Rule::Adam {
                lr_t: 0.001,
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-8,
                wd: 0.0,
                rescale: 1.0,
                clip: inf,
            },
            Rule::Adam {
                lr_t: 0.02,
                beta1: 0.5,
                beta2: 0.75,
                epsilon: 1e-3,
                wd: 0.1,
                rescale: 2.0,
                clip: 1.0,
            },
        ]
    }

    /// The state buffers a rule keeps.
    fn states(rule: &Rule<f32>) -> usize {
        match rule {
            Rule::SgdMom { .. } => 1,
            Rule::Adam { .. } => 2,
            _ => 0,
        }
    }

    /// Stored bits and state bits after a push.
    type Outcome = (Vec<u16>, Vec<u32>, Vec<u32>);

    /// Runs `run` on typed copies of the inputs.
    fn typed<T: Element<Acc = f32>>(
        from_bits: fn(u16) -> T,
        to_bits: fn(T) -> u16,
        values: &[Vec<u16>],
        stored: &[u16],
        state: &[Vec<f32>; 2],
        rule: &Rule<f32>,
        run: fn(PushJob<'_, T>, &Rule<f32>),
    ) -> Outcome {
        let values: Vec<Vec<T>> = values
            .iter()
            .map(|v| v.iter().map(|&b| from_bits(b)).collect())
            .collect();
        let mut stored: Vec<T> = stored.iter().map(|&b| from_bits(b)).collect();
        let [mut m, mut v] = state.clone();
        let job = PushJob {
            values: values.iter().map(Vec::as_slice).collect(),
            stored: &mut stored,
            state: [&mut m, &mut v],
        };
        run(job, rule);
        let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect();
        (
            stored.into_iter().map(to_bits).collect(),
            bits(&m),
            bits(&v),
        )
    }

    /// The scalar model: `half`'s software conversions around the f32 rule, one element at a
    /// time, values summed in push order.
    fn reference(
        bf: bool,
        values: &[Vec<u16>],
        stored: &[u16],
        state: &[Vec<f32>; 2],
        rule: &Rule<f32>,
    ) -> Outcome {
        let [mut m, mut v] = state.clone();
        let mut out = Vec::with_capacity(stored.len());
        for (i, &s) in stored.iter().enumerate() {
            let mut g = soft_to_f32(values[0][i], bf);
            for value in &values[1..] {
                g += soft_to_f32(value[i], bf);
            }
            let mut w = [soft_to_f32(s, bf)];
            let (mi, vi) = (part(&mut m, i..i + 1), part(&mut v, i..i + 1));
            update_block::<f32>(rule, &[g], &mut w, mi, vi);
            out.push(soft_from_f32(w[0], bf));
        }
        let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect();
        (out, bits(&m), bits(&v))
    }

    /// Asserts two outcomes are equal bit for bit, element by element, and returns how many
    /// elements were compared without the one allowance: where two or more of an element's
    /// inputs (values, stored, state) are NaN or infinite, two NaNs (or a NaN and an infinity's
    /// NaN) can meet in one add, and which operand's NaN comes out is not specified by Rust and
    /// differs within today's code itself (its vector body keeps the first, its scalar tail the
    /// second). There, a NaN result only has to be a NaN on both sides; every other bit, and
    /// every result of every other element, must be equal.
    fn check(
        a: &Outcome,
        b: &Outcome,
        bf: bool,
        (values, stored, state): (&[Vec<u16>], &[u16], &[Vec<f32>; 2]),
        what: &str,
    ) -> usize {
        let mut strict = 0;
        for i in 0..stored.len() {
            let halves = values.iter().map(|v| v[i]).chain([stored[i]]);
            let non_finite = halves.filter(|&h| !soft_to_f32(h, bf).is_finite()).count()
                + state
                    .iter()
                    .filter_map(|s| s.get(i))
                    .filter(|x| !x.is_finite())
                    .count();
            let lax = non_finite >= 2;
            strict += usize::from(!lax);
            let nan16 = |h: u16| soft_to_f32(h, bf).is_nan();
            let same16 = |x: u16, y: u16| x == y || (lax && nan16(x) && nan16(y));
            let nan32 = |x: Option<u32>| x.is_some_and(|x| f32::from_bits(x).is_nan());
            let same32 = |x: Option<u32>, y: Option<u32>| x == y || (lax && nan32(x) && nan32(y));
            let (m, v) = (
                |o: &Outcome| o.1.get(i).copied(),
                |o: &Outcome| o.2.get(i).copied(),
            );
            if !(same16(a.0[i], b.0[i]) && same32(m(a), m(b)) && same32(v(a), v(b))) {
                let inputs: Vec<String> = values.iter().map(|v| format!("{:#06x}", v[i])).collect();
                let st: Vec<f32> = state.iter().filter_map(|s| s.get(i).copied()).collect();
                panic!(
                    "{what}: element {i}: values {inputs:?} stored {:#06x} state {st:?}: \
                     {:#06x} {:x?} {:x?} vs {:#06x} {:x?} {:x?}",
                    stored[i],
                    a.0[i],
                    m(a),
                    v(a),
                    b.0[i],
                    m(b),
                    v(b)
                );
            }
        }
        assert_eq!(a.1.len(), b.1.len(), "{what}");
        assert_eq!(a.2.len(), b.2.len(), "{what}");
        strict
    }

    #[test]
    fn fast_push_matches_portable_and_scalar_model() {
        assert!(available(), "this test needs AVX2 and F16C");
        let (mut rng, seed) = rng();
        let (mut cases, mut strict, mut total) = (0, 0, 0);
        for bf in [false, true] {
            for rule in rules() {
                for count in 1..=5 {
                    for len in [1, 7, 8, 9, 1023, 1024, 1025, 2 * BLOCK + 13] {
                        let values: Vec<Vec<u16>> = (0..count)
                            .map(|_| (0..len).map(|_| value_bits(bf, &mut rng)).collect())
                            .collect();
                        let stored: Vec<u16> = (0..len).map(|_| value_bits(bf, &mut rng)).collect();
                        let mut state = [Vec::new(), Vec::new()];
                        for s in state.iter_mut().take(states(&rule)) {
                            *s = (0..len).map(|_| state_value(&mut rng)).collect();
                        }
                        let (fast, portable) = if bf {
                            let run = |f| {
                                typed(
                                    bf16::from_bits,
                                    bf16::to_bits,
                                    &values,
                                    &stored,
                                    &state,
                                    &rule,
                                    f,
                                )
                            };
                            (run(push_seq::<bf16>), run(push_seq_generic::<bf16>))
                        } else {
                            let run = |f| {
                                typed(
                                    f16::from_bits,
                                    f16::to_bits,
                                    &values,
                                    &stored,
                                    &state,
                                    &rule,
                                    f,
                                )
                            };
                            (run(push_seq::<f16>), run(push_seq_f16::<f16>))
                        };
                        let model = reference(bf, &values, &stored, &state, &rule);
                        let what =
                            format!("bf16={bf} {rule:?} values={count} len={len} (seed {seed})");
                        let inputs = (&values[..], &stored[..], &state);
                        let what_p = format!("fast vs portable: {what}");
                        strict += check(&fast, &portable, bf, inputs, &what_p);
                        let what_m = format!("fast vs scalar model: {what}");
                        check(&fast, &model, bf, inputs, &what_m);
                        total += len;
                        cases += 1;
                    }
                }
            }
        }
        assert_eq!(cases, 2 * 8 * 5 * 8);
        // Most elements are compared with no allowance at all.
        assert!(
            strict * 10 > total * 7,
            "{strict} of {total} compared strictly"
        );
    }
}

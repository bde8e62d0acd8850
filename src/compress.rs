//! Gradient compression, as MXNet's `set_gradient_compression`: each pushed value is quantized
//! before it is summed, and what that drops is kept in a residual (error feedback) for the next
//! push of the same key from the same source.
//!
//! 2-bit ([`Compression::TwoBit`], MXNet 1.9.1's `"2bit"`): per element, in float32, the value
//! is added to its residual; a residual `>= t` sends `+t` and keeps `residual - t`; one `<= -t`
//! sends `-t` and keeps `residual + t`; any other (NaN included) sends 0 and is kept whole. The
//! codes travel 16 to a 32-bit word: element `k` of a word (0 to 15) sits in byte `k / 4`, in
//! the two bits starting at bit `6 - 2 * (k % 4)` of that byte, `0b11` for `+t`, `0b10` for
//! `-t`, `0b00` for 0 (the layout of MXNet's kernels, so that words are interchangeable). A
//! word is stored as the little-endian `u32` of its four bytes.
//!
//! 16-bit ([`Compression::Half`], not in MXNet): per element, in float32, the value is added to
//! its residual, the sum is rounded to the nearest bfloat16 or float16 (ties to even), that is
//! sent, and the rounding error stays in the residual. A sum that is not finite, or rounds to
//! an infinity (float16 past ±65504), is sent as it rounds and leaves a residual of 0.

use half::{bf16, f16};
use std::ops::Range;

use crate::{DType, Error, Result};

/// How a store compresses pushed values ([`crate::KvStore::set_gradient_compression`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Compression {
    /// Values are summed as they are (the default).
    #[default]
    None,
    /// MXNet's 2-bit compression: each element sends `+threshold`, `-threshold` or 0.
    TwoBit {
        /// The magnitude each element sends, greater than 0 (MXNet's default is 0.5).
        threshold: f32,
    },
    /// A 16-bit wire (not MXNet's): each element sends its value plus residual rounded to `dtype`.
    Half {
        /// [`DType::BF16`] (float32's range) or [`DType::F16`] (more bits, up to ±65504).
        dtype: DType,
    },
}

impl Compression {
    /// 2-bit compression with `threshold` (see [`Compression::TwoBit`]).
    pub fn two_bit(threshold: f32) -> Compression {
        Compression::TwoBit { threshold }
    }

    /// The bfloat16 wire (see [`Compression::Half`]).
    pub fn bf16() -> Compression {
        Compression::Half { dtype: DType::BF16 }
    }

    /// The float16 wire (see [`Compression::Half`]).
    pub fn fp16() -> Compression {
        Compression::Half { dtype: DType::F16 }
    }

    /// Whether pushes are compressed.
    pub fn is_on(&self) -> bool {
        !matches!(self, Compression::None)
    }

    /// An [`Error::Compression`] unless the settings are usable (a threshold above 0).
    pub(crate) fn check(&self) -> Result<()> {
        match *self {
            Compression::None => Ok(()),
            Compression::TwoBit { threshold } if threshold > 0.0 => Ok(()),
            Compression::TwoBit { threshold } => Err(Error::Compression {
                op: "set_gradient_compression",
                message: format!(
                    "the 2-bit threshold must be greater than 0, got {threshold}: pass the \
                     magnitude each element sends (MXNet's default is 0.5)"
                ),
            }),
            Compression::Half {
                dtype: DType::BF16 | DType::F16,
            } => Ok(()),
            Compression::Half { dtype } => Err(Error::Compression {
                op: "set_gradient_compression",
                message: format!(
                    "a 16-bit wire is bfloat16 or float16, got {dtype}: use \
                     Compression::bf16() or Compression::fp16()"
                ),
            }),
        }
    }

    /// In words, for the ranks of a distributed store to compare.
    pub(crate) fn describe(&self) -> String {
        match self {
            Compression::None => "no gradient compression".to_owned(),
            Compression::TwoBit { threshold } => format!(
                "2-bit gradient compression, threshold {threshold} (bits {:#010x})",
                threshold.to_bits()
            ),
            Compression::Half { dtype } => format!("{dtype} wire with error feedback"),
        }
    }

    /// `value` quantized with `residual` and decoded, the residual that stays written to `left`.
    pub(crate) fn round_trip(&self, value: &[f32], residual: &[f32], left: &mut [f32]) -> Vec<f32> {
        match *self {
            Compression::None => {
                crate::memcopy::copy(left, residual);
                value.to_vec()
            }
            Compression::TwoBit { threshold } => {
                let mut words = vec![0u32; two_bit_words(value.len())];
                two_bit_quantize(value, residual, left, threshold, &mut words);
                let mut out = vec![0f32; value.len()];
                two_bit_dequantize(&words, threshold, &mut out);
                out
            }
            Compression::Half { dtype: DType::F16 } => {
                half_round_trip::<f16>(value, residual, left)
            }
            Compression::Half { .. } => half_round_trip::<bf16>(value, residual, left),
        }
    }
}

/// [`half_encode`], widened to float32.
fn half_round_trip<H: HalfWire>(value: &[f32], residual: &[f32], left: &mut [f32]) -> Vec<f32> {
    half_encode::<H>(value, residual, left)
        .into_iter()
        .map(H::widen)
        .collect()
}

/// A 16-bit float type of the wire: `bf16` or `f16`, whose accumulator is float32.
pub(crate) trait HalfWire: crate::Element<Acc = f32> {
    /// The nearest value (ties to even).
    fn round(x: f32) -> Self {
        Self::from_acc(x)
    }
    /// Its float32 value (exact).
    fn widen(self) -> f32 {
        self.to_acc()
    }
}

impl HalfWire for bf16 {}
impl HalfWire for f16 {}

/// What the 16-bit wire sends: `value` plus `residual` rounded to `H`, the rounding error
/// written into `left` (0 where the sum or what it rounds to is not finite).
pub(crate) fn half_encode<H: HalfWire>(
    value: &[f32],
    residual: &[f32],
    left: &mut [f32],
) -> Vec<H> {
    let mut out = vec![H::round(0.0); value.len()];
    half_encode_into(value, residual, left, &mut out);
    out
}

/// [`half_encode`] into `out` (all four of one length).
pub(crate) fn half_encode_into<H: HalfWire>(
    value: &[f32],
    residual: &[f32],
    left: &mut [f32],
    out: &mut [H],
) {
    debug_assert_eq!(value.len(), residual.len());
    debug_assert_eq!(value.len(), left.len());
    debug_assert_eq!(value.len(), out.len());
    for (((&v, &r), l), o) in value.iter().zip(residual).zip(left.iter_mut()).zip(out) {
        let acc = r + v;
        let sent = H::round(acc);
        let back = sent.widen();
        *l = if back.is_finite() { acc - back } else { 0.0 };
        *o = sent;
    }
}

/// The 32-bit words `n` elements take in 2-bit form: 16 per word.
pub(crate) fn two_bit_words(n: usize) -> usize {
    n.div_ceil(16)
}

/// The shift, within a little-endian word, of element `k` (0 to 15) of that word.
fn shift(k: usize) -> u32 {
    (8 * (k / 4) + 6 - 2 * (k % 4)) as u32
}

/// Quantizes `grad` plus `residual` into `out` (a word per 16 elements, unused codes 0),
/// writing what is not sent into `left` (all three of one length).
pub(crate) fn two_bit_quantize(
    grad: &[f32],
    residual: &[f32],
    left: &mut [f32],
    t: f32,
    out: &mut [u32],
) {
    debug_assert_eq!(grad.len(), residual.len());
    debug_assert_eq!(grad.len(), left.len());
    debug_assert_eq!(out.len(), two_bit_words(grad.len()));
    // Whole words of 16 elements, then the last one: a fixed-length body the compiler turns
    // into vector selects.
    let whole = grad.len() / 16;
    let (g_body, g_tail) = grad.split_at(16 * whole);
    let (r_body, r_tail) = residual.split_at(16 * whole);
    let (l_body, l_tail) = left.split_at_mut(16 * whole);
    for (((g, r), l), word) in g_body
        .chunks_exact(16)
        .zip(r_body.chunks_exact(16))
        .zip(l_body.chunks_exact_mut(16))
        .zip(out.iter_mut())
    {
        *word = quantize_word(g, r, l, t);
    }
    if !g_tail.is_empty() {
        out[whole] = quantize_word(g_tail, r_tail, l_tail, t);
    }
}

/// The word of up to 16 elements, its residuals written into `left` as MXNet's kernel does.
#[inline(always)]
fn quantize_word(grad: &[f32], residual: &[f32], left: &mut [f32], t: f32) -> u32 {
    let mut bits = 0u32;
    for (k, ((&g, &r), l)) in grad.iter().zip(residual).zip(left.iter_mut()).enumerate() {
        let sum = r + g;
        let (up, down) = (sum >= t, sum <= -t);
        *l = if up {
            sum - t
        } else if down {
            sum + t
        } else {
            sum
        };
        let code = (u32::from(up) * 0b11) | (u32::from(down) * 0b10);
        bits |= code << shift(k);
    }
    bits
}

/// Decodes 2-bit `words` into `out` (its length says how many elements): `+t`, `-t` or 0.
pub(crate) fn two_bit_dequantize(words: &[u32], t: f32, out: &mut [f32]) {
    debug_assert_eq!(words.len(), two_bit_words(out.len()));
    two_bit_decode(words, &TwoBitTable::new(t), 0..out.len(), out);
}

/// The four values of every byte of 2-bit codes for one threshold: a lookup per byte.
pub(crate) struct TwoBitTable([[f32; 4]; 256]);

impl TwoBitTable {
    pub(crate) fn new(t: f32) -> TwoBitTable {
        let value = |code: usize| match code {
            0b11 => t,
            0b10 => -t,
            _ => 0.0,
        };
        let mut table = [[0.0; 4]; 256];
        for (byte, four) in table.iter_mut().enumerate() {
            for (j, v) in four.iter_mut().enumerate() {
                *v = value((byte >> (6 - 2 * j)) & 0b11);
            }
        }
        TwoBitTable(table)
    }
}

/// Decodes elements `range` of the 2-bit `words` into `out` (`range.len()` long).
pub(crate) fn two_bit_decode(
    words: &[u32],
    table: &TwoBitTable,
    range: Range<usize>,
    out: &mut [f32],
) {
    debug_assert_eq!(out.len(), range.len());
    // Byte b of the words (little-endian) holds elements 4b to 4b + 3.
    let byte = |b: usize| (words[b / 4] >> (8 * (b % 4))) as u8 as usize;
    let mut i = range.start;
    let mut o = 0;
    while i < range.end && i % 4 != 0 {
        out[o] = table.0[byte(i / 4)][i % 4];
        i += 1;
        o += 1;
    }
    let fours = (range.end - i) / 4;
    for (n, chunk) in out[o..o + 4 * fours].chunks_exact_mut(4).enumerate() {
        chunk.copy_from_slice(&table.0[byte(i / 4 + n)]);
    }
    i += 4 * fours;
    o += 4 * fours;
    while i < range.end {
        out[o] = table.0[byte(i / 4)][i % 4];
        i += 1;
        o += 1;
    }
}

/// The value element `i` of 2-bit `words` sends: `+t`, `-t` or 0.
#[cfg(test)]
pub(crate) fn two_bit_value(words: &[u32], i: usize, t: f32) -> f32 {
    match (words[i / 16] >> shift(i % 16)) & 0b11 {
        0b11 => t,
        0b10 => -t,
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example worked out from MXNet's kernel (t = 0.5, 17 elements): bytes
    /// `E3 00 00 02 | C0 00 00 00`, and the residuals that stay.
    #[test]
    fn packs_as_mxnet_does() {
        let mut grad = vec![0f32; 17];
        grad[..4].copy_from_slice(&[0.6, -0.7, 0.2, 0.5]);
        grad[15] = -0.5;
        grad[16] = 1.3;
        let mut residual = vec![f32::NAN; 17];
        let mut words = vec![0u32; two_bit_words(17)];
        two_bit_quantize(&grad, &[0.0; 17], &mut residual, 0.5, &mut words);
        assert_eq!(words, [0x0200_00E3, 0x0000_00C0]);
        assert_eq!(residual[0], 0.6f32 - 0.5);
        assert_eq!(residual[1], -0.7f32 + 0.5);
        assert_eq!(residual[2], 0.2);
        assert_eq!(residual[3], 0.0);
        assert_eq!(residual[15], 0.0);
        assert_eq!(residual[16], 1.3f32 - 0.5);
        let mut back = vec![f32::NAN; 17];
        two_bit_dequantize(&words, 0.5, &mut back);
        let mut want = vec![0f32; 17];
        want[0] = 0.5;
        want[1] = -0.5;
        want[3] = 0.5;
        want[15] = -0.5;
        want[16] = 0.5;
        assert_eq!(back, want);
    }

    /// What is sent plus what stays equals what came in, element by element (up to float32
    /// rounding of the residual's sums), over many pushes of random values.
    #[test]
    fn sent_plus_residual_is_what_came_in() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let t = rng.gen_range(0.05f32..2.0);
        let n = rng.gen_range(1..200);
        let c = Compression::two_bit(t);
        let mut residual = vec![0f32; n];
        let mut came = vec![0f64; n];
        let mut sent = vec![0f64; n];
        for _ in 0..50 {
            let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0 * t..3.0 * t)).collect();
            let mut left = vec![f32::NAN; n];
            let out = c.round_trip(&g, &residual, &mut left);
            residual = left;
            for i in 0..n {
                came[i] += f64::from(g[i]);
                sent[i] += f64::from(out[i]);
                assert!(
                    out[i] == 0.0 || out[i].abs() == t,
                    "a 2-bit value is 0 or ±t"
                );
            }
        }
        for i in 0..n {
            let drift = (came[i] - sent[i] - f64::from(residual[i])).abs();
            assert!(drift < 1e-3 * t as f64 * 50.0, "element {i}: {drift}");
        }
    }

    /// The word-at-a-time quantizer and the table decoder against the per-element rule,
    /// bit for bit, on random lengths, values and ranges.
    #[test]
    fn fast_codec_equals_the_element_rule() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        for _ in 0..200 {
            let t = rng.gen_range(0.05f32..2.0);
            let n = rng.gen_range(1..300);
            let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0 * t..3.0 * t)).collect();
            let r0: Vec<f32> = (0..n).map(|_| rng.gen_range(-t..t)).collect();
            let (mut r, mut words) = (vec![f32::NAN; n], vec![0u32; two_bit_words(n)]);
            two_bit_quantize(&g, &r0, &mut r, t, &mut words);
            for i in 0..n {
                let sum = r0[i] + g[i];
                let (code, left) = if sum >= t {
                    (0b11, sum - t)
                } else if sum <= -t {
                    (0b10, sum + t)
                } else {
                    (0, sum)
                };
                assert_eq!((words[i / 16] >> shift(i % 16)) & 0b11, code, "element {i}");
                assert_eq!(r[i].to_bits(), left.to_bits(), "element {i}");
            }
            let table = TwoBitTable::new(t);
            let a = rng.gen_range(0..n);
            let b = rng.gen_range(a..=n);
            let mut out = vec![f32::NAN; b - a];
            two_bit_decode(&words, &table, a..b, &mut out);
            for (o, i) in out.iter().zip(a..b) {
                assert_eq!(
                    o.to_bits(),
                    two_bit_value(&words, i, t).to_bits(),
                    "element {i}"
                );
            }
        }
    }

    #[test]
    fn thresholds_must_be_positive() {
        assert!(Compression::two_bit(0.5).check().is_ok());
        for t in [0.0, -0.5, f32::NAN] {
            let e = Compression::two_bit(t).check().unwrap_err();
            assert!(e.to_string().contains("greater than 0"), "{e}");
        }
    }
}

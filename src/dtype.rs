//! Element types: the [`DType`] tag and the [`Element`] trait that ties it to a Rust type.

use std::fmt;

use half::{bf16, f16};
use num_traits::Float;

/// The element type of an [`NDArray`](crate::NDArray).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float, the default.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The lower-case name MXNet and NumPy use: `float32`, `float64`, `float16`, `bfloat16`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An element type of an [`NDArray`](crate::NDArray): `f32`, `f64`, `half::f16`, `half::bf16`.
/// Arithmetic and updater state use its [`Element::Acc`]: `f64` for `f64`, else `f32`.
pub trait Element: Copy + Send + Sync + PartialEq + fmt::Debug + 'static + private::Sealed {
    /// The dtype tag of this type.
    const DTYPE: DType;
    /// The type sums and updater math are done in.
    type Acc: Element + Float + Default + std::ops::AddAssign;

    /// Widens to the accumulator type.
    fn to_acc(self) -> Self::Acc;
    /// Narrows from the accumulator type, rounding to nearest.
    fn from_acc(a: Self::Acc) -> Self;
    /// Converts from `f64`, rounding to nearest.
    fn from_f64(v: f64) -> Self;
    /// Converts to `f64` exactly.
    fn to_f64(self) -> f64;

    /// Borrows the elements of `data` if it holds this type.
    #[doc(hidden)]
    fn slice(data: &HostData) -> Option<&[Self]>;
    /// Borrows the elements of `data` mutably if it holds this type.
    #[doc(hidden)]
    fn slice_mut(data: &mut HostData) -> Option<&mut [Self]>;
    /// Wraps a vector of this type.
    #[doc(hidden)]
    fn wrap(v: Vec<Self>) -> HostData;
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

macro_rules! element {
    ($t:ty, $variant:ident, $acc:ty, $to_acc:expr, $from_acc:expr, $from_f64:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            type Acc = $acc;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                $to_acc(self)
            }
            #[inline(always)]
            fn from_acc(a: $acc) -> Self {
                $from_acc(a)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                $from_f64(v)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                f64::from(self)
            }
            fn slice(data: &HostData) -> Option<&[Self]> {
                match data {
                    HostData::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(data: &mut HostData) -> Option<&mut [Self]> {
                match data {
                    HostData::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> HostData {
                HostData::$variant(v)
            }
        }
    };
}

element!(f32, F32, f32, |x| x, |a| a, |v| v as f32);
element!(f64, F64, f64, |x| x, |a| a, |v| v);
element!(
    f16,
    F16,
    f32,
    f16::to_f32,
    f16::from_f32,
    |v| f16::from_f32(to_f32_odd(v))
);
element!(bf16, BF16, f32, bf16::to_f32, bf16::from_f32, |v| {
    bf16::from_f32(to_f32_odd(v))
});

/// `v` rounded to f32 toward zero, the last bit set where that lost anything ("round to odd"),
/// so that rounding it to f16 or bf16 is exactly `v` rounded there. `half`'s own conversions
/// from f64 round twice and can put a value just above a tie on its even side (half-rs#151).
fn to_f32_odd(v: f64) -> f32 {
    let f = v as f32;
    if f64::from(f) == v || !f.is_finite() || v.is_nan() {
        return f;
    }
    let mut bits = f.to_bits();
    // `as` rounded to nearest: step back toward zero where it rounded away from zero (the
    // magnitude is in the low 31 bits, so one less is the next value toward zero).
    if f64::from(f).abs() > v.abs() {
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

/// Elements in host memory. The variant is the dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// `float32` elements.
    F32(Vec<f32>),
    /// `float64` elements.
    F64(Vec<f64>),
    /// `float16` elements.
    F16(Vec<f16>),
    /// `bfloat16` elements.
    BF16(Vec<bf16>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The nearest value of `T` to `v` (ties to the even bit pattern), found among the
    /// neighbours of a first guess by comparing exact f64 distances: a reference that rounds
    /// nothing itself.
    fn nearest<T: Element>(v: f64, bits: impl Fn(T) -> u16, from_bits: impl Fn(u16) -> T) -> T {
        let guess = bits(T::from_f64(v));
        let candidates = [guess.wrapping_sub(1), guess, guess.wrapping_add(1)]
            .map(&from_bits)
            .into_iter()
            .filter(|c| c.to_f64().is_finite() && c.to_f64().signum() == v.signum());
        candidates
            .min_by(|a, b| {
                let (da, db) = ((a.to_f64() - v).abs(), (b.to_f64() - v).abs());
                da.total_cmp(&db).then((bits(*a) & 1).cmp(&(bits(*b) & 1)))
            })
            .unwrap_or_else(|| T::from_f64(v))
    }

    /// Conversions from f64 round to nearest even, in particular values just above a tie
    /// between two neighbours (which `half`'s own conversion rounds down), and random values.
    #[test]
    fn conversions_from_f64_round_to_nearest_even() {
        let mut rng = rand::rngs::StdRng::from_entropy();
        // 353.0000915527344 lies just above the tie 353 between bf16's 352 and 354.
        assert_eq!(
            <bf16 as Element>::from_f64(353.000_091_552_734_4).to_f32(),
            354.0
        );
        assert_eq!(<f16 as Element>::from_f64(2049.0001).to_f32(), 2050.0);
        for _ in 0..20_000 {
            // Finite, positive bit patterns of both types (below 0x7b00: no infinity nearby).
            let a = rng.gen_range(1u16..0x7b00);
            let sign = if rng.gen_bool(0.5) { 1.0 } else { -1.0 };
            // Just above, at, or just below the tie between two neighbours, or anywhere.
            let tiny = rng.gen_range(1.0..2.0) * 2f64.powi(-rng.gen_range(20..50));
            for (lo, hi) in [
                (f16::from_bits(a).to_f64(), f16::from_bits(a + 1).to_f64()),
                (bf16::from_bits(a).to_f64(), bf16::from_bits(a + 1).to_f64()),
            ] {
                let tie = (lo + hi) / 2.0;
                for v in [
                    tie * (1.0 + tiny),
                    tie,
                    tie * (1.0 - tiny),
                    rng.gen_range(lo..hi),
                ] {
                    let v = sign * v;
                    // f16 within its finite range (past it, both round to infinity).
                    if v.abs() < 65504.0 {
                        let want = nearest::<f16>(v, f16::to_bits, f16::from_bits);
                        let got = <f16 as Element>::from_f64(v);
                        assert_eq!(got.to_bits(), want.to_bits(), "f16 of {v:e}");
                    }
                    let want = nearest::<bf16>(v, bf16::to_bits, bf16::from_bits);
                    assert_eq!(
                        <bf16 as Element>::from_f64(v).to_bits(),
                        want.to_bits(),
                        "bf16 of {v:e}"
                    );
                }
            }
        }
    }
}

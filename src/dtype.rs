//! Element types: the [`DType`] tag and the [`Element`] trait that ties it to a Rust type.

use std::fmt;

use half::{bf16, f16};
use num_traits::Float;

use crate::host::HostData;

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

/// A Rust type that can be the element of an [`NDArray`](crate::NDArray):
/// `f32`, `f64`, `half::f16` or `half::bf16`.
///
/// Arithmetic on an element is done in its accumulator type [`Element::Acc`]: `f64` for `f64`,
/// `f32` for everything else. That is also the precision of updater state (momentum and the like).
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
element!(f16, F16, f32, f16::to_f32, f16::from_f32, f16::from_f64);
element!(
    bf16,
    BF16,
    f32,
    bf16::to_f32,
    bf16::from_f32,
    bf16::from_f64
);

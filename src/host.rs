//! Host memory: [`HostData`], a typed vector of elements (one variant per [`DType`], defined
//! beside the element types), and what is done with it.

use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::{Error, Shape};

pub use crate::dtype::HostData;

/// Runs `$body` with `$v` bound to the typed vector inside a [`HostData`], and `$t` to its
/// element type.
macro_rules! with_host {
    ($data:expr, $v:ident: $t:ident => $body:expr) => {
        $crate::host::with_host!(@each $data, $v, $t, $body;
            F32 f32, F64 f64, F16 half::f16, BF16 half::bf16)
    };
    (@each $data:expr, $v:ident, $t:ident, $body:expr; $($variant:ident $ty:ty),*) => {
        match $data {
            $($crate::host::HostData::$variant($v) => {
                #[allow(dead_code)]
                type $t = $ty;
                $body
            })*
        }
    };
}
pub(crate) use with_host;

impl HostData {
    /// `len` copies of `value`, converted to `dtype`.
    ///
    /// # Panics
    /// If `len` elements of `dtype` would take more than `isize::MAX` bytes (Rust's
    /// "capacity overflow"); check first with [`Shape::nbytes`](crate::Shape::nbytes).
    pub fn filled(dtype: DType, len: usize, value: f64) -> HostData {
        HostData::try_filled(dtype, len, value).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`HostData::filled`], with an [`Error::ShapeTooLarge`] instead of a panic when `len`
    /// elements of `dtype` would take more than `isize::MAX` bytes.
    pub fn try_filled(dtype: DType, len: usize, value: f64) -> Result<HostData, Error> {
        Shape::new(&[len])?.nbytes(dtype)?;
        Ok(HostData::filled_unchecked(dtype, len, value))
    }

    fn filled_unchecked(dtype: DType, len: usize, value: f64) -> HostData {
        match dtype {
            DType::F32 => HostData::F32(vec![value as f32; len]),
            DType::F64 => HostData::F64(vec![value; len]),
            DType::F16 => HostData::F16(vec![<f16 as Element>::from_f64(value); len]),
            DType::BF16 => HostData::BF16(vec![<bf16 as Element>::from_f64(value); len]),
        }
    }

    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        with_host!(self, _v: T => T::DTYPE)
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        with_host!(self, v: T => v.len())
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements the buffer has room for without growing.
    pub(crate) fn capacity(&self) -> usize {
        with_host!(self, v: T => v.capacity())
    }

    /// A copy of the elements in `range`, clipped to the elements there are.
    pub(crate) fn slice_of(&self, range: std::ops::Range<usize>) -> HostData {
        let end = range.end.min(self.len());
        let start = range.start.min(end);
        with_host!(self, v: T => T::wrap(v[start..end].to_vec()))
    }

    /// Copies `src` into these elements from element `at`: `false` (nothing copied) where
    /// `src` is of another dtype or runs past the end.
    pub(crate) fn write_at(&mut self, at: usize, src: &HostData) -> bool {
        with_host!(self, v: T => match T::slice(src) {
            Some(s) if at.checked_add(s.len()).is_some_and(|end| end <= v.len()) => {
                v[at..at + s.len()].copy_from_slice(s);
                true
            }
            _ => false,
        })
    }

    /// A copy converted to `dtype` (a plain clone when it already is).
    pub fn cast(&self, dtype: DType) -> HostData {
        if self.dtype() == dtype {
            return self.clone();
        }
        with_host!(self, v: T => {
            let mut out = HostData::filled_unchecked(dtype, v.len(), 0.0);
            convert_into(v, &mut out);
            out
        })
    }

    /// The elements as a `Vec<U>`, converted.
    pub fn to_vec<U: Element>(&self) -> Vec<U> {
        if let Some(s) = U::slice(self) {
            return s.to_vec();
        }
        with_host!(self, v: T => v.iter().map(|x| U::from_f64(x.to_f64())).collect())
    }
}

/// Copies `src` into `dst`, converting each element to `dst`'s dtype. Lengths must match.
pub(crate) fn convert_into<T: Element>(src: &[T], dst: &mut HostData) {
    if let Some(d) = T::slice_mut(dst) {
        crate::memcopy::copy(d, src);
        return;
    }
    with_host!(dst, d: U => {
        for (o, x) in d.iter_mut().zip(src) {
            *o = U::from_f64(x.to_f64());
        }
    })
}

/// The little-endian bytes of host elements.
pub(crate) fn to_le_bytes(data: &HostData) -> Vec<u8> {
    with_host!(data, v: T => v.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// Host elements of `dtype` from their little-endian bytes; the length is checked by the
/// caller (a trailing part of an element is dropped).
pub(crate) fn from_le_bytes(dtype: DType, bytes: &[u8]) -> HostData {
    fn each<const N: usize, T>(bytes: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
        // `chunks_exact` yields chunks of `N` bytes only, so every conversion succeeds.
        (bytes.chunks_exact(N))
            .filter_map(|c| c.try_into().ok().map(f))
            .collect()
    }
    match dtype {
        DType::F32 => HostData::F32(each(bytes, f32::from_le_bytes)),
        DType::F64 => HostData::F64(each(bytes, f64::from_le_bytes)),
        DType::F16 => HostData::F16(each(bytes, f16::from_le_bytes)),
        DType::BF16 => HostData::BF16(each(bytes, bf16::from_le_bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn le_bytes_round_trip_every_dtype() {
        let xs = [1.5f32, -0.25, 3.0e-3, 7.0];
        let f32s: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(matches!(from_le_bytes(DType::F32, &f32s), HostData::F32(v) if v == xs));
        let f64s: Vec<u8> = xs
            .iter()
            .flat_map(|&x| f64::from(x).to_le_bytes())
            .collect();
        assert!(matches!(from_le_bytes(DType::F64, &f64s),
            HostData::F64(v) if v.iter().zip(&xs).all(|(a, &b)| *a == f64::from(b))));
        let h: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
        let hb: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(matches!(from_le_bytes(DType::F16, &hb), HostData::F16(v) if v == h));
        let b: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
        let bb: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(matches!(from_le_bytes(DType::BF16, &bb), HostData::BF16(v) if v == b));
    }
}

//! [`Shape`]: the dimensions of an array, 0-d to 8-d.

use std::fmt;

use crate::error::Error;
use crate::DType;

/// The most dimensions an array may have.
pub const MAX_NDIM: usize = 8;

/// The dimensions of an array: 0 to [`MAX_NDIM`], at most `isize::MAX` elements. Arrays of up
/// to 8 dimensions convert with `From` (a deeper one does not compile):
///
/// ```
/// use kvstore::Shape;
/// let s: Shape = [2, 3].into();
/// assert_eq!(s.dims(), &[2, 3]);
/// assert_eq!(s.size(), 6);
/// assert_eq!(Shape::from([]).size(), 1); // a 0-d array holds one element
/// ```
///
/// A slice goes through [`Shape::new`]. Dimensions whose product overflows are an error there,
/// and a panic in `From`:
///
/// ```
/// use kvstore::{Error, Shape};
/// assert!(matches!(Shape::new(&[1 << 33, 1 << 31]), Err(Error::ShapeTooLarge { .. })));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: [usize; MAX_NDIM],
    ndim: u8,
}

impl Shape {
    /// A shape from a slice of dimensions: an error past [`MAX_NDIM`] or `isize::MAX` elements.
    pub fn new(dims: &[usize]) -> Result<Shape, Error> {
        if dims.len() > MAX_NDIM {
            return Err(Error::TooManyDims { ndim: dims.len() });
        }
        check_size(dims, None, 1)?;
        let mut d = [0; MAX_NDIM];
        d[..dims.len()].copy_from_slice(dims);
        Ok(Shape {
            dims: d,
            ndim: dims.len() as u8,
        })
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.ndim as usize]
    }

    /// The number of dimensions.
    pub fn ndim(&self) -> usize {
        self.ndim as usize
    }

    /// The number of elements: the product of the dimensions (1 for a 0-d shape).
    pub fn size(&self) -> usize {
        // Checked when the shape was made: no overflow.
        self.dims().iter().product()
    }

    /// The bytes `dtype` elements of this shape take; an error over `isize::MAX`.
    ///
    /// ```
    /// use kvstore::{DType, Shape};
    /// assert_eq!(Shape::from([2, 3]).nbytes(DType::F64).unwrap(), 48);
    /// assert!(Shape::from([1 << 31, 1 << 31]).nbytes(DType::F32).is_err());
    /// ```
    pub fn nbytes(&self, dtype: DType) -> Result<usize, Error> {
        check_size(self.dims(), Some(dtype), dtype.size())
    }
}

/// The product of `dims` times `elem_bytes`, if it is at most `isize::MAX`.
fn check_size(dims: &[usize], dtype: Option<DType>, elem_bytes: usize) -> Result<usize, Error> {
    if dims.contains(&0) {
        return Ok(0);
    }
    dims.iter()
        .try_fold(elem_bytes, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| Error::ShapeTooLarge {
            dims: dims.to_vec(),
            dtype,
        })
}

macro_rules! shape_from_array {
    ($($n:literal)*) => {$(
        impl From<[usize; $n]> for Shape {
            /// The shape with these dimensions.
            ///
            /// # Panics
            /// Over `isize::MAX` elements, where [`Shape::new`] returns an error.
            fn from(a: [usize; $n]) -> Shape {
                Shape::new(&a).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl From<&[usize; $n]> for Shape {
            /// The shape with these dimensions.
            ///
            /// # Panics
            /// As `From<[usize; N]>`.
            fn from(a: &[usize; $n]) -> Shape {
                Shape::from(*a)
            }
        }
    )*};
}
shape_from_array!(0 1 2 3 4 5 6 7 8);

impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Shape {
        *s
    }
}

impl TryFrom<&[usize]> for Shape {
    type Error = Error;
    fn try_from(dims: &[usize]) -> Result<Shape, Error> {
        Shape::new(dims)
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Shape {
    /// NumPy style: `(2, 3)`, `(5,)`, `()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dims() {
            [d] => write!(f, "({d},)"),
            dims => {
                let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
                write!(f, "({})", dims.join(", "))
            }
        }
    }
}

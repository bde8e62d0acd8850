//! [`Device`]: where an array lives.

use std::fmt;

/// Where an array's elements live.
///
/// `Cpu(i)` are MXNet's logical CPU devices (`mx.cpu(i)`), all host memory; the index only
/// tells values apart. `Gpu(i)` is CUDA device ordinal `i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Logical CPU device `i` (host memory).
    Cpu(usize),
    /// CUDA GPU with ordinal `i`.
    Gpu(usize),
}

/// Logical CPU device `i`, MXNet's `mx.cpu(i)`.
///
/// ```
/// use kvstore::{cpu, Device};
/// assert_eq!(cpu(2), Device::Cpu(2));
/// assert_eq!(cpu(2).to_string(), "cpu(2)");
/// ```
pub fn cpu(i: usize) -> Device {
    Device::Cpu(i)
}

/// GPU `i`, MXNet's `mx.gpu(i)`.
pub fn gpu(i: usize) -> Device {
    Device::Gpu(i)
}

impl Device {
    /// Whether this is a GPU.
    pub fn is_gpu(self) -> bool {
        matches!(self, Device::Gpu(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu(i) => write!(f, "cpu({i})"),
            Device::Gpu(i) => write!(f, "gpu({i})"),
        }
    }
}

//! Across ranks on GPUs (`dist_device_sync` on a machine with GPUs): NCCL between the ranks, one
//! GPU per rank.
//!
//! Every key is whole on its home rank here (no slicing): a push is one NCCL reduce onto the
//! home per key, a pull one NCCL broadcast from it, each on the rank's GPU, with no copy
//! through host memory. The fingerprint check and the bounds on every wait are the
//! link's, before the collectives, and [`RankComm`]'s own bound on each NCCL call.

use super::super::nccl::RankComm;
use crate::{DType, Device, NDArray, Result, Shape};

/// Sums every rank's `sums` (each key's sum on this rank's GPU, with its home rank) onto the
/// home, in place. Returns the total on the home rank, `None` elsewhere.
pub(super) fn reduce(rc: &RankComm, sums: Vec<(NDArray, usize)>) -> Result<Vec<Option<NDArray>>> {
    sums.into_iter()
        .map(|(sum, root)| {
            rc.reduce_sum(&sum, &sum, root)?;
            Ok((root == rc.rank()).then_some(sum))
        })
        .collect()
}

/// One key of a GPU gather: the home's copy of the value (on the home rank), its shape and
/// dtype, and its home rank.
pub(crate) struct GpuPiece {
    pub data: Option<NDArray>,
    pub shape: Shape,
    pub dtype: DType,
    pub root: usize,
}

/// Brings every key's value from its home rank to every rank's GPU, in place.
pub(super) fn gather(rc: &RankComm, pieces: Vec<GpuPiece>) -> Result<Vec<NDArray>> {
    pieces
        .into_iter()
        .map(|p| {
            let buf = match p.data {
                Some(d) => d,
                None => NDArray::full_on(p.shape, 0.0, p.dtype, Device::Gpu(rc.ordinal()))?,
            };
            rc.broadcast(&buf, p.root)?;
            Ok(buf)
        })
        .collect()
}

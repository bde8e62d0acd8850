//! Across ranks on GPUs (`dist_device_sync` on a machine with GPUs): NCCL between the ranks, one
//! GPU per rank, with the NCCL id sent over MPI (as nccl-tests does it).
//!
//! Every key is whole on its home rank here (no slicing): a push is one NCCL reduce onto the
//! home per key, a pull one NCCL broadcast from it, each on the rank's GPU, with no copy
//! through host memory. The fingerprint check and the bounds on every wait are the MPI
//! transport's, before the collectives, and [`RankComm`]'s own bound on each NCCL call.

use super::super::mpi::{Fingerprint, World};
use super::super::nccl::loader::UniqueId;
use super::super::nccl::RankComm;
use crate::backend::probe;
use crate::{DType, Device, Error, NDArray, Result, Shape};

/// Joins the NCCL communicator of every rank of `world`, on the GPU this rank's local rank
/// picks (`local_rank % GPUs`).
pub(super) fn join(world: &'static World) -> Result<RankComm> {
    let gpus = probe::gpu_count();
    let ordinal = world.local_rank() % gpus.max(1);
    let mut call = world.begin(&Fingerprint::new("join NCCL ranks"))?;
    let mut words = vec![0u64; 16];
    let mut made = Ok(());
    if world.rank() == 0 {
        match RankComm::unique_id() {
            Ok(id) => words = pack(&id),
            Err(e) => made = Err(e),
        }
    }
    let p = call.broadcast(words, 0)?;
    let words = call.wait(p)?.recv;
    // The world's lock is not held across NCCL's own bootstrap, which waits for every rank
    // (bounded by KVSTORE_TIMEOUT).
    drop(call);
    made?;
    if words.iter().all(|&w| w == 0) {
        return Err(Error::DistEnv {
            var: "NCCL".to_owned(),
            message: "rank 0 could not create an NCCL id (its own error says why)".to_owned(),
        });
    }
    RankComm::join(unpack(&words), world.rank(), world.size(), ordinal)
}

/// The 128 bytes of an NCCL id as 16 words, for MPI.
fn pack(id: &UniqueId) -> Vec<u64> {
    id.0.chunks(8)
        .map(|c| {
            let mut b = [0u8; 8];
            for (o, &x) in b.iter_mut().zip(c) {
                *o = x as u8;
            }
            u64::from_le_bytes(b)
        })
        .collect()
}

/// The NCCL id from the 16 words of [`pack`].
fn unpack(words: &[u64]) -> UniqueId {
    let mut id = UniqueId([0; 128]);
    for (chunk, w) in id.0.chunks_mut(8).zip(words) {
        for (o, b) in chunk.iter_mut().zip(w.to_le_bytes()) {
            *o = b as _;
        }
    }
    id
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nccl_id_survives_its_trip_as_words() {
        let mut id = UniqueId([0; 128]);
        for (i, b) in id.0.iter_mut().enumerate() {
            *b = (i as i32 * 37 - 100) as _;
        }
        let back = unpack(&pack(&id));
        assert_eq!(back.0, id.0);
    }
}

//! Gradient compression in the store: which stores compress, the rules on when it is set and
//! on dtypes, and a push's decoded values, with the residuals kept per key and per position in
//! the push's list of values. The codec itself is [`crate::compress`].

use std::sync::{Mutex, MutexGuard};

use super::groups::Group;
use super::{read, write, KvStore, StoreKind};
use crate::comm::dist::Pool;
use crate::compress::Compression;
use crate::host::HostData;
use crate::{DType, Error, Key, NDArray, Result};

impl KvStore {
    /// Compresses pushed values before they are summed, as MXNet's
    /// `set_gradient_compression` does (see [`Compression`]). Each value of a push is quantized
    /// with its own residual (one per key and per position in the push's list), the quantized
    /// values are decoded and summed in list order, and the updater gets that sum. Init and
    /// pull are never compressed.
    ///
    /// On a `dist_*` store each rank compresses the sum of its own values with its residual of
    /// the key, in host memory (MXNet's workers sum their devices first); every rank calls it
    /// with the same setting, or the first push fails on every rank with [`Error::Desync`].
    ///
    /// Call it before the first `init`: it is an [`Error::Compression`] once the store holds
    /// keys, on a kind that does not compress (`local` and `nccl`, as in MXNet), for a
    /// threshold not above 0, and (at `init`) for a key that is not float32. A checkpoint
    /// carries the residuals (a dist store's, each rank's own, restored by a load by as many
    /// ranks; they start at zero after a load by another number of ranks).
    ///
    /// ```
    /// use kvstore::{Compression, KvStore, NDArray};
    /// let kv = KvStore::create("device")?;
    /// kv.set_gradient_compression(Compression::two_bit(0.5))?;
    /// kv.init(0, &NDArray::zeros([4]))?;
    /// kv.push(0, &NDArray::from_vec(vec![0.7f32, -0.2, 0.5, -0.9], [4])?)?;
    /// let out = NDArray::zeros([4]);
    /// kv.pull(0, &out)?;
    /// assert_eq!(out.to_vec::<f32>()?, [0.5, 0.0, 0.5, -0.5]);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn set_gradient_compression(&self, compression: Compression) -> Result<()> {
        let op = "set_gradient_compression";
        compression.check()?;
        if let StoreKind::Local | StoreKind::Nccl = self.kind {
            return Err(Error::Compression {
                op,
                message: format!(
                    "a '{}' store does not compress (MXNet compresses on 'device' and dist \
                     stores): create the store as 'device'",
                    self.name
                ),
            });
        }
        // Under the table's lock: no init can add a key meanwhile.
        let table = write(&self.table);
        if !table.slots.is_empty() {
            return Err(Error::Compression {
                op,
                message: format!(
                    "the store already holds {} keys: set the compression before the first \
                     init (the residuals of keys pushed uncompressed would be missing)",
                    table.slots.len()
                ),
            });
        }
        *write(&self.compression) = compression;
        Ok(())
    }

    /// The gradient compression in force.
    pub fn gradient_compression(&self) -> Compression {
        *read(&self.compression)
    }
}

/// [`dtype_refusal`] for the values of an init.
pub(super) fn check_dtypes(
    compression: Compression,
    keys: &[Key],
    values: &[NDArray],
) -> Result<()> {
    (keys.iter().zip(values))
        .find_map(|(key, v)| dtype_refusal(compression, "init", key, v.dtype()))
        .map_or(Ok(()), Err)
}

/// An [`Error::Compression`] when compression is on and `key` is not float32 (MXNet's 2-bit
/// kernels work on float32 only), or `None`. `op`: how the key came ("init", "load").
pub(super) fn dtype_refusal(
    compression: Compression,
    op: &'static str,
    key: &Key,
    dtype: DType,
) -> Option<Error> {
    if !compression.is_on() || dtype == DType::F32 {
        return None;
    }
    let fix = match op {
        "init" => "init it with .astype(DType::F32)",
        _ => "load it into a store without gradient compression, or save it as float32",
    };
    Some(Error::Compression {
        op,
        message: format!(
            "key {key} is {dtype}, but compressed keys must be float32 (as in MXNet): {fix}"
        ),
    })
}

/// A key's residuals: one per position in a push's list of values.
pub(super) type Residuals = Vec<Vec<f32>>;

/// Per group, the sum of its values after compression, in host memory, and the residuals it
/// leaves (kept by [`commit`] once the push has succeeded). The caller holds the groups' locks.
pub(super) fn decoded_totals(
    compression: Compression,
    groups: &[Group<'_>],
    pool: &Pool,
) -> Result<(Vec<Option<NDArray>>, Vec<Residuals>)> {
    let mut totals = Vec::with_capacity(groups.len());
    let mut kept = Vec::with_capacity(groups.len());
    for g in groups {
        let n = g.slot.shape.size();
        let committed = lock(&g.slot.residuals);
        let positions = committed.len().max(g.arrays.len());
        let mut left = take_residuals(pool, positions, n);
        let zeros = match committed.len() < g.arrays.len() {
            true => vec![0.0; n],
            false => Vec::new(),
        };
        let mut total: Vec<f32> = Vec::new();
        for (i, (a, l)) in g.arrays.iter().zip(left.iter_mut()).enumerate() {
            let residual = committed.get(i).map_or(&zeros[..], |r| &r[..]);
            let decoded = compression.round_trip(&a.to_vec::<f32>()?, residual, l);
            if total.is_empty() {
                total = decoded;
            } else {
                // In list order, in float32: ((v0 + v1) + v2) + ..., as MXNet sums.
                for (t, d) in total.iter_mut().zip(&decoded) {
                    *t += d;
                }
            }
        }
        // Positions this push did not fill keep their residuals.
        for (l, r) in left.iter_mut().zip(committed.iter()).skip(g.arrays.len()) {
            crate::memcopy::copy(l, r);
        }
        totals.push(Some(NDArray::from_vec(total, g.slot.shape)?));
        kept.push(left);
    }
    Ok((totals, kept))
}

/// Keeps the residuals of a push that succeeded; the ones they replace go back to `pool`.
pub(super) fn commit(groups: &[Group<'_>], residuals: Vec<Residuals>, pool: &Pool) {
    for (g, r) in groups.iter().zip(residuals) {
        let old = std::mem::replace(&mut *lock(&g.slot.residuals), r);
        for r in old {
            pool.give(HostData::F32(r));
        }
    }
}

pub(super) fn lock(residuals: &Mutex<Residuals>) -> MutexGuard<'_, Residuals> {
    residuals.lock().unwrap_or_else(|e| e.into_inner())
}

/// Buffers for `positions` residuals of `n` elements from `pool`, each of exactly `n` elements'
/// room (a key keeps its residual, so it must never hold a bigger buffer). Their contents are
/// unspecified: the quantizers write every element.
pub(super) fn take_residuals(pool: &Pool, positions: usize, n: usize) -> Residuals {
    (0..positions)
        .map(|_| match pool.take_exact(DType::F32, n) {
            HostData::F32(v) => v,
            other => vec![0.0; other.len()],
        })
        .collect()
}

//! Pulls from host memory: the stored value copied (and converted) into every out. The mirror
//! of `cuda::pull`.

use std::sync::RwLockWriteGuard;

use crate::host::{convert_into, with_host, HostData};
use crate::ndarray::Storage;
use crate::{Element, NDArray, Result};

/// Copies `src` into every out. Outs that share elements are written once. Outs on a GPU get
/// a host-to-GPU copy.
pub(crate) fn pull_into(src: &HostData, outs: &[&NDArray], par_min_bytes: usize) -> Result<()> {
    let mut outs = outs.to_vec();
    outs.sort_by_key(|a| a.storage_id());
    outs.dedup_by_key(|a| a.storage_id());
    let mut guards: Vec<RwLockWriteGuard<'_, Storage>> = outs.iter().map(|a| a.write()).collect();
    with_host!(src, s: T => {
        let mut same: Vec<&mut [T]> = Vec::with_capacity(guards.len());
        for g in guards.iter_mut() {
            match &mut **g {
                Storage::Host(h) => {
                    if h.dtype() == T::DTYPE {
                        same.push(T::slice_mut(h).expect("dtype was just checked"));
                    } else {
                        convert_into(s.as_slice(), h);
                    }
                }
                Storage::Gpu(b) => b.upload_into(src)?,
            }
        }
        super::broadcast(s.as_slice(), same, par_min_bytes);
    });
    Ok(())
}

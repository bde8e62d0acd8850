//! Pulls from host memory into every out (converted where needed). The mirror of `cuda::pull`.

use std::ops::Range;
use std::sync::RwLockWriteGuard;

use super::Few;
use crate::host::{convert_into, with_host, HostData};
use crate::ndarray::Storage;
use crate::{Element, Error, NDArray, Result};

/// Copies `src` (or its elements `part`) into every out, once per shared storage.
pub(crate) fn pull_into(
    src: &HostData,
    part: Option<Range<usize>>,
    outs: &[&NDArray],
    par_min_bytes: usize,
) -> Result<()> {
    let part = part.unwrap_or(0..src.len());
    if part.end > src.len() || part.start > part.end {
        return Err(Error::internal("a pull's part lies outside its value"));
    }
    let whole = part == (0..src.len());
    // The part, in a buffer of its own, for outs on a GPU (made once, for the first).
    let mut upload: Option<HostData> = None;
    let mut outs: Few<&NDArray> = outs.iter().copied().collect();
    outs.sort_by_key(|a| a.storage_id());
    outs.dedup_by_key(|a| a.storage_id());
    let mut guards: Few<RwLockWriteGuard<'_, Storage>> = outs.iter().map(|a| a.write()).collect();
    with_host!(src, all: T => {
        let s = &all[part.clone()];
        let mut same: Few<&mut [T]> = Few::with_capacity(guards.len());
        for g in guards.iter_mut() {
            match &mut **g {
                Storage::Host(h) => {
                    if h.dtype() == T::DTYPE {
                        same.push(T::slice_mut(h).expect("dtype was just checked"));
                    } else {
                        convert_into(s, h);
                    }
                }
                Storage::Gpu(b) if whole => b.upload_into(src)?,
                Storage::Gpu(b) => {
                    b.upload_into(upload.get_or_insert_with(|| src.slice_of(part.clone())))?
                }
            }
        }
        super::broadcast(s, same, par_min_bytes);
    });
    Ok(())
}

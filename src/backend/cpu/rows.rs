//! Row-sparse arithmetic on host memory: [`merge`] by id, [`gather`] and [`scatter`] rows.

use super::push::ReadSet;
use crate::host::{with_host, HostData};
use crate::{Element, NDArray, Result};

/// Rows by sorted, distinct id: `rows` holds `ids.len()` rows of `width` elements.
pub(crate) struct Merged {
    pub ids: Vec<u64>,
    pub rows: HostData,
}

/// The sum of `values` (ids, and checked rows of `width`, one dtype) by id, ascending, each
/// id's rows added in the order they come, in the dtype's own arithmetic.
pub(crate) fn merge(values: &[(&[u64], &NDArray)], width: usize) -> Result<Merged> {
    // No values: no ids, and no rows of float32.
    let dtype = values
        .first()
        .map_or(crate::DType::F32, |(_, rows)| rows.dtype());
    // Read in place (each array locked once; rows on a GPU are copied to the host).
    let arrays: Vec<&NDArray> = values.iter().map(|&(_, rows)| rows).collect();
    let reads = ReadSet::lock(&arrays)?;
    let hosts: Vec<&HostData> = arrays.iter().map(|a| reads.host(a)).collect();
    let mut ids: Vec<u64> = values
        .iter()
        .flat_map(|(ids, _)| ids.iter().copied())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    let mut rows = HostData::try_filled(dtype, ids.len() * width, 0.0)?;
    let mut seen = vec![false; ids.len()];
    for ((v_ids, _), host) in values.iter().zip(&hosts) {
        for (i, id) in v_ids.iter().enumerate() {
            let at = ids.binary_search(id).expect("every id was collected");
            let src = i * width..(i + 1) * width;
            let dst = at * width..(at + 1) * width;
            add_row(host, src, &mut rows, dst, !seen[at]);
            seen[at] = true;
        }
    }
    Ok(Merged { ids, rows })
}

/// `dst[dst_range] (+)= src[src_range]`: a copy when `first`, else a dense push's addition.
pub(crate) fn add_row(
    src: &HostData,
    src_range: std::ops::Range<usize>,
    dst: &mut HostData,
    dst_range: std::ops::Range<usize>,
    first: bool,
) {
    with_host!(dst, d: T => {
        let s = T::slice(src).expect("rows of one dtype");
        let (s, d) = (&s[src_range], &mut d[dst_range]);
        if first {
            crate::memcopy::copy(d, s);
        } else {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = T::from_acc(d.to_acc() + s.to_acc());
            }
        }
    })
}

/// The elements of `segs` of `data`, one after another.
pub(crate) fn gather(data: &HostData, segs: &[std::ops::Range<usize>]) -> HostData {
    with_host!(data, v: T => {
        let mut out = Vec::with_capacity(segs.iter().map(|s| s.len()).sum());
        for s in segs {
            crate::memcopy::extend(&mut out, &v[s.clone()]);
        }
        T::wrap(out)
    })
}

/// Writes `compact`, as [`gather`] reads it, back into `segs` of `data` (of the same dtype).
pub(crate) fn scatter(compact: &HostData, segs: &[std::ops::Range<usize>], data: &mut HostData) {
    with_host!(data, d: T => {
        let c = T::slice(compact).expect("rows of the value's dtype");
        let mut at = 0;
        for s in segs {
            crate::memcopy::copy(&mut d[s.clone()], &c[at..at + s.len()]);
            at += s.len();
        }
    })
}

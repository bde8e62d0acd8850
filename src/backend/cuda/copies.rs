//! Many device copies, and many downloads, for one call in O(1) driver calls per (GPU, dtype),
//! not one or more per key: each driver call costs microseconds, more than moving a few KiB.
//!
//! - [`copy_many`]: per (destination GPU, dtype), [`BATCH_MIN_COPIES`] or more copies of at
//!   most [`BATCH_COPY_MAX_BYTES`] go into one launch of the fused `assign` kernel, one input
//!   per record: exact for every value (f16 and bf16 go through f32; a NaN's payload may not
//!   survive), reading other GPUs over peer access. Larger copies, copies without peer access,
//!   and f64 keep their own `cuMemcpy*Async`.
//! - [`download_many`]: one GPU's small buffers are gathered by [`copy_many`] into one scratch
//!   buffer, which goes to the host in ONE copy after ONE wait; larger ones go one by one.

use std::collections::{BTreeMap, BTreeSet};

use super::kernels::RuleKind;
use super::{
    copy_device, cross_gpu_order, gpu, host_data_bytes, launch_fused, stream_wait, GpuBuf, GpuPtr,
    Record,
};
use crate::host::{from_le_bytes, HostData};
use crate::{DType, Result};

/// The largest copy (in bytes) that `copy_many` batches into a launch. A driver call costs
/// microseconds (≈ 10 µs for a copy and a stream sync on an H200), while 1 MiB moves in well
/// under one: below this the call dominates; above it the copy engine is as good as a kernel.
pub const BATCH_COPY_MAX_BYTES: usize = 1 << 20;

/// The fewest small copies to one GPU, of one dtype, that go into a launch.
pub(crate) const BATCH_MIN_COPIES: usize = 4;

/// One device copy of `bytes` (a whole number of `dtype` elements) from `src` to `dst`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceCopy {
    pub dst: GpuPtr,
    pub src: GpuPtr,
    pub bytes: usize,
    pub dtype: DType,
}

/// Whether `c` goes into a batched launch: small, of a dtype with kernels, and within one GPU
/// or from a GPU the destination can read directly (peer access, enabled here once per pair).
fn batched(c: &DeviceCopy) -> Result<bool> {
    if c.bytes > BATCH_COPY_MAX_BYTES
        || !super::has_kernel(c.dtype)
        || c.bytes % c.dtype.size() != 0
    {
        return Ok(false);
    }
    Ok(c.dst.ordinal == c.src.ordinal || gpu(c.dst.ordinal)?.enable_peer(gpu(c.src.ordinal)?))
}

/// Enqueues every copy (see the module docs). A launch that reads other GPUs waits for their
/// streams, and they then wait for it (one event each way per GPU pair), as [`copy_device`]
/// orders a peer copy.
///
/// The copies keep list order's meaning: a copy that reads or writes a buffer an earlier copy
/// writes, or writes one an earlier copy reads, goes in a later wave (a pull with one out under
/// several keys). Buffers are known by their start address: callers copy whole buffers. The
/// caller keeps every buffer alive until the work is enqueued, and frees it on its GPU's stream.
pub(crate) fn copy_many(copies: &[DeviceCopy]) -> Result<()> {
    // Per buffer: the last wave that writes it, and the last wave that reads it.
    let mut written: BTreeMap<(usize, u64), usize> = BTreeMap::new();
    let mut read: BTreeMap<(usize, u64), usize> = BTreeMap::new();
    let mut waves: Vec<Vec<DeviceCopy>> = Vec::new();
    for c in copies {
        if c.bytes == 0 {
            continue;
        }
        let (src, dst) = ((c.src.ordinal, c.src.addr), (c.dst.ordinal, c.dst.addr));
        let after = |m: &BTreeMap<(usize, u64), usize>, b| m.get(&b).map_or(0, |w| w + 1);
        let w = after(&written, src)
            .max(after(&written, dst))
            .max(after(&read, dst));
        if waves.len() <= w {
            waves.resize_with(w + 1, Vec::new);
        }
        waves[w].push(*c);
        let up = |m: &mut BTreeMap<(usize, u64), usize>, b| {
            let e = m.entry(b).or_insert(w);
            *e = (*e).max(w);
        };
        up(&mut written, dst);
        up(&mut read, src);
    }
    for wave in &waves {
        copy_wave(wave)?;
    }
    Ok(())
}

/// [`copy_many`] for copies of which none reads or writes what another writes.
fn copy_wave(copies: &[DeviceCopy]) -> Result<()> {
    // (destination GPU, dtype) -> the dtype, the records, and the other GPUs they read.
    type Launch = (DType, Vec<Record>, BTreeSet<usize>);
    let mut launches: BTreeMap<(usize, u8), Launch> = BTreeMap::new();
    let mut groups: BTreeMap<(usize, u8), Vec<DeviceCopy>> = BTreeMap::new();
    for c in copies {
        if batched(c)? {
            groups
                .entry((c.dst.ordinal, c.dtype as u8))
                .or_default()
                .push(*c);
        } else {
            copy_device(c.dst, c.src, c.bytes)?;
        }
    }
    // A launch adds a record-table upload: a few copies are cheaper as copies (a single-key
    // pull: 10 µs by cuMemcpy, 14-16 µs by a launch, on an H200).
    let (few, many): (Vec<_>, Vec<_>) = groups
        .into_values()
        .partition(|g| g.len() < BATCH_MIN_COPIES);
    for c in few.into_iter().flatten() {
        copy_device(c.dst, c.src, c.bytes)?;
    }
    for c in many.into_iter().flatten() {
        let launch = launches
            .entry((c.dst.ordinal, c.dtype as u8))
            .or_insert_with(|| (c.dtype, Vec::new(), BTreeSet::new()));
        launch.1.push(Record {
            stored: c.dst.addr,
            inputs: vec![c.src.addr],
            n: (c.bytes / c.dtype.size()) as u64,
            ..Record::default()
        });
        if c.src.ordinal != c.dst.ordinal {
            launch.2.insert(c.src.ordinal);
        }
    }
    for ((ordinal, _), (dtype, records, sources)) in &launches {
        let d = gpu(*ordinal)?;
        let _order = (!sources.is_empty()).then(cross_gpu_order);
        for &s in sources {
            stream_wait(d.stream(), gpu(s)?.stream())?;
        }
        launch_fused(d, RuleKind::Assign, *dtype, &[], records)?;
        for &s in sources {
            stream_wait(gpu(s)?.stream(), d.stream())?;
        }
    }
    Ok(())
}

/// Every buffer's elements, copied to the host, in order (see the module docs).
pub(crate) fn download_many(bufs: &[&GpuBuf]) -> Result<Vec<HostData>> {
    let mut out: Vec<Option<HostData>> = (0..bufs.len()).map(|_| None).collect();
    // Per GPU: (index, byte offset in the gather buffer) of each small buffer, and the bytes.
    let mut gathers: BTreeMap<usize, (Vec<(usize, usize)>, usize)> = BTreeMap::new();
    for (i, b) in bufs.iter().enumerate() {
        let bytes = b.bytes();
        if b.is_empty() || bytes > BATCH_COPY_MAX_BYTES || !super::has_kernel(b.dtype()) {
            out[i] = Some(b.download()?);
            continue;
        }
        let (items, total) = gathers.entry(b.ordinal()).or_default();
        items.push((i, *total));
        *total += bytes.next_multiple_of(16);
    }
    for (ordinal, (items, total)) in gathers {
        // f32 elements only as a unit of bytes: the segments hold each buffer's own dtype.
        let gather = GpuBuf::scratch(ordinal, DType::F32, total / 4)?;
        let base = gather.ptr();
        let copies: Vec<DeviceCopy> = items
            .iter()
            .map(|&(i, at)| DeviceCopy {
                dst: GpuPtr::new(ordinal, base + at as u64),
                src: bufs[i].at(),
                bytes: bufs[i].bytes(),
                dtype: bufs[i].dtype(),
            })
            .collect();
        copy_many(&copies)?;
        // `download` waits for the stream (so for the gathering launch) first.
        let gathered = gather.download()?;
        let bytes = host_data_bytes(&gathered);
        for &(i, at) in &items {
            let b = bufs[i];
            let seg = &bytes[at..at + b.bytes()];
            out[i] = Some(from_le_bytes(b.dtype(), seg));
        }
    }
    Ok(out
        .into_iter()
        .map(|h| h.expect("every buffer was downloaded"))
        .collect())
}

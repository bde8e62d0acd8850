//! Simulated global memory: separate allocations at distinct base addresses, with bounds,
//! alignment and cross-thread race checks on every kernel access.

use anyhow::{bail, ensure, Result};

/// Allocation `i` starts at `FIRST + i * SLOT`: 256-byte aligned, as `cuMemAlloc`'s are, with
/// the rest of its slot unallocated, so any overrun hits no allocation, and finding the
/// allocation of an address is a division.
const SLOT: u64 = 1 << 32;
/// Where the first allocation starts (any nonzero value would do).
const FIRST: u64 = 0x7f00_0000_0000;
/// Race tracking works on 2-byte granules: every kernel access is 2-byte aligned and a
/// multiple of 2 bytes long (b16 is the narrowest type).
const GRANULE: u64 = 2;
/// No thread has touched the granule in this launch.
const NOBODY: u32 = u32::MAX;
/// More than one thread has read the granule in this launch.
const MANY: u32 = u32::MAX - 1;

struct Alloc {
    base: u64,
    bytes: Vec<u8>,
    /// Per granule, during a launch: the thread that wrote it, or NOBODY.
    writer: Vec<u32>,
    /// Per granule, during a launch: the thread that read it, NOBODY, or MANY.
    reader: Vec<u32>,
}

/// Device memory for the emulator. Host reads and writes (between launches) are bounds checked;
/// kernel accesses are also checked for alignment and for races between threads.
#[derive(Default)]
pub struct Memory {
    allocs: Vec<Alloc>,
}

impl Memory {
    /// A new allocation holding `bytes`; returns its base address (256-byte aligned).
    pub fn alloc(&mut self, bytes: &[u8]) -> u64 {
        assert!((bytes.len() as u64) < SLOT, "allocation too large");
        let base = FIRST + SLOT * self.allocs.len() as u64;
        self.allocs.push(Alloc {
            base,
            bytes: bytes.to_vec(),
            writer: Vec::new(),
            reader: Vec::new(),
        });
        base
    }

    /// Copies `data` to `addr`, which must lie inside one allocation with all of `data`.
    pub fn write(&mut self, addr: u64, data: &[u8]) -> Result<()> {
        let (a, off) = self.find(addr, data.len() as u64, "host write")?;
        self.allocs[a].bytes[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    /// `len` bytes from `addr`, which must lie inside one allocation.
    pub fn read(&self, addr: u64, len: usize) -> Result<Vec<u8>> {
        let (a, off) = self.find(addr, len as u64, "host read")?;
        Ok(self.allocs[a].bytes[off..off + len].to_vec())
    }

    /// The allocation holding `[addr, addr + len)` and the offset of `addr` in it.
    fn find(&self, addr: u64, len: u64, what: &str) -> Result<(usize, usize)> {
        let slot = addr.wrapping_sub(FIRST) / SLOT;
        let off = addr.wrapping_sub(FIRST) % SLOT;
        if let Some(a) = self.allocs.get(slot as usize) {
            if off + len <= a.bytes.len() as u64 {
                return Ok((slot as usize, off as usize));
            }
            bail!(
                "{what} of {len} bytes at {addr:#x} is out of bounds: the nearest allocation \
                 below it is the {}-byte one at {:#x}",
                a.bytes.len(),
                a.base
            );
        }
        bail!("{what} of {len} bytes at {addr:#x} is out of bounds: no allocation there")
    }

    /// Clears the race records: called at the start of every launch.
    pub(super) fn begin_launch(&mut self) {
        for a in &mut self.allocs {
            let granules = (a.bytes.len() as u64).div_ceil(GRANULE) as usize;
            a.writer.clear();
            a.writer.resize(granules, NOBODY);
            a.reader.clear();
            a.reader.resize(granules, NOBODY);
        }
    }

    /// A kernel load of `out.len()` bytes at `addr` by `thread` (a linear id).
    pub(super) fn load(&mut self, addr: u64, out: &mut [u8], thread: u32) -> Result<()> {
        let len = out.len() as u64;
        ensure!(
            addr % len == 0,
            "misaligned load of {len} bytes at {addr:#x} (needs {len}-byte alignment)"
        );
        let (a, off) = self.find(addr, len, "load")?;
        let a = &mut self.allocs[a];
        out.copy_from_slice(&a.bytes[off..off + out.len()]);
        for g in granules(off, len) {
            let w = a.writer[g];
            ensure!(
                w == NOBODY || w == thread,
                "race: thread {thread} loads {addr:#x}, which thread {w} stored in this launch"
            );
            a.reader[g] = match a.reader[g] {
                NOBODY => thread,
                r if r == thread => thread,
                _ => MANY,
            };
        }
        Ok(())
    }

    /// A kernel store of `data` at `addr` by `thread` (a linear id).
    pub(super) fn store(&mut self, addr: u64, data: &[u8], thread: u32) -> Result<()> {
        let len = data.len() as u64;
        ensure!(
            addr % len == 0,
            "misaligned store of {len} bytes at {addr:#x} (needs {len}-byte alignment)"
        );
        let (a, off) = self.find(addr, len, "store")?;
        let a = &mut self.allocs[a];
        for g in granules(off, len) {
            let (w, r) = (a.writer[g], a.reader[g]);
            ensure!(
                w == NOBODY || w == thread,
                "race: thread {thread} stores to {addr:#x}, which thread {w} stored in this launch"
            );
            ensure!(
                r == NOBODY || r == thread,
                "race: thread {thread} stores to {addr:#x}, which {} loaded in this launch",
                if r == MANY {
                    "several threads".to_owned()
                } else {
                    format!("thread {r}")
                }
            );
            a.writer[g] = thread;
        }
        a.bytes[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }
}

/// The granules of the `len` bytes at offset `off` (both multiples of GRANULE).
fn granules(off: usize, len: u64) -> std::ops::Range<usize> {
    let first = off / GRANULE as usize;
    first..first + (len / GRANULE) as usize
}

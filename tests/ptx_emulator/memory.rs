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
    /// Set by [`Memory::free`]: the slot stays, so a later access is reported as a use after
    /// free rather than as an access to nothing.
    freed: bool,
    /// The launch (`Memory::launch`) the race records below belong to: they are cleared on the
    /// first access of a new launch, so a launch costs nothing for allocations it never touches.
    launch: u64,
    /// Per granule, during a launch: the thread that wrote it, or NOBODY.
    writer: Vec<u32>,
    /// Per granule, during a launch: the thread that read it, NOBODY, or MANY.
    reader: Vec<u32>,
    /// The byte ranges this launch read and wrote (hulls), if any.
    read_range: Option<(u64, u64)>,
    write_range: Option<(u64, u64)>,
}

/// What one launch did to one allocation: the hull of the bytes it read and of those it wrote
/// (offsets from the allocation's base).
#[allow(dead_code)] // used by the stand-in driver (tools/stand-in-driver)
#[derive(Clone, Debug)]
pub struct Touch {
    pub base: u64,
    pub read: Option<(u64, u64)>,
    pub write: Option<(u64, u64)>,
}

/// Device memory for the emulator. Host reads and writes (between launches) are bounds checked;
/// kernel accesses are also checked for alignment and for races between threads.
#[derive(Default)]
pub struct Memory {
    allocs: Vec<Alloc>,
    /// Counts launches; 0 before the first.
    launch: u64,
    /// The allocations the current launch has touched, in first-touch order.
    touched: Vec<usize>,
    /// Kernel stores so far, all launches (to tell blocks that did no work).
    stores: u64,
}

impl Memory {
    /// A new allocation holding `bytes`; returns its base address (256-byte aligned).
    pub fn alloc(&mut self, bytes: &[u8]) -> u64 {
        self.alloc_owned(bytes.to_vec())
    }

    /// A new allocation of `len` bytes, each `fill`; returns its base address.
    #[allow(dead_code)] // used by the stand-in driver (tools/stand-in-driver)
    pub fn alloc_filled(&mut self, len: usize, fill: u8) -> u64 {
        self.alloc_owned(vec![fill; len])
    }

    fn alloc_owned(&mut self, bytes: Vec<u8>) -> u64 {
        assert!((bytes.len() as u64) < SLOT, "allocation too large");
        let base = FIRST + SLOT * self.allocs.len() as u64;
        self.allocs.push(Alloc {
            base,
            bytes,
            freed: false,
            launch: 0,
            writer: Vec::new(),
            reader: Vec::new(),
            read_range: None,
            write_range: None,
        });
        base
    }

    /// Frees the allocation starting at `base`. Its address is never handed out again, so any
    /// later access to it is reported as a use after free.
    #[allow(dead_code)] // used by the stand-in driver (tools/stand-in-driver)
    pub fn free(&mut self, base: u64) -> Result<()> {
        let (a, off) = self.find(base, 0, "free")?;
        ensure!(
            off == 0,
            "free of {base:#x}, which is {off} bytes into the allocation at {:#x}, not its start",
            self.allocs[a].base
        );
        let a = &mut self.allocs[a];
        a.freed = true;
        a.bytes = Vec::new();
        a.writer = Vec::new();
        a.reader = Vec::new();
        Ok(())
    }

    /// The base and length of the live allocation holding `[addr, addr + len)`.
    #[allow(dead_code)] // used by the stand-in driver (tools/stand-in-driver)
    pub fn allocation(&self, addr: u64, len: u64) -> Result<(u64, u64)> {
        let (a, _) = self.find(addr, len, "access")?;
        Ok((self.allocs[a].base, self.allocs[a].bytes.len() as u64))
    }

    /// What the last launch read and wrote, per allocation it touched.
    #[allow(dead_code)] // used by the stand-in driver (tools/stand-in-driver)
    pub fn touched(&self) -> Vec<Touch> {
        self.touched
            .iter()
            .map(|&i| {
                let a = &self.allocs[i];
                Touch {
                    base: a.base,
                    read: a.read_range,
                    write: a.write_range,
                }
            })
            .collect()
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
            ensure!(
                !a.freed,
                "use after free: {what} of {len} bytes at {addr:#x}, in the allocation at {:#x}, \
                 which was freed",
                a.base
            );
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

    /// Kernel stores so far, over every launch.
    pub(super) fn stores(&self) -> u64 {
        self.stores
    }

    /// Starts a new launch: every allocation's race records are stale from here on (each is
    /// cleared on its first access in this launch).
    pub(super) fn begin_launch(&mut self) {
        self.launch += 1;
        self.touched.clear();
    }

    /// The allocation a kernel access of `len` bytes at `addr` falls in, with fresh race records
    /// for this launch, and the offset of `addr` in it; notes the access range.
    fn kernel_access(
        &mut self,
        addr: u64,
        len: u64,
        what: &str,
        write: bool,
    ) -> Result<(usize, usize)> {
        let (i, off) = self.find(addr, len, what)?;
        let launch = self.launch;
        let a = &mut self.allocs[i];
        if a.launch != launch {
            let granules = (a.bytes.len() as u64).div_ceil(GRANULE) as usize;
            a.launch = launch;
            a.writer.clear();
            a.writer.resize(granules, NOBODY);
            a.reader.clear();
            a.reader.resize(granules, NOBODY);
            a.read_range = None;
            a.write_range = None;
            self.touched.push(i);
        }
        let range = if write {
            &mut a.write_range
        } else {
            &mut a.read_range
        };
        let (lo, hi) = (off as u64, off as u64 + len);
        *range = Some(match *range {
            None => (lo, hi),
            Some((l, h)) => (l.min(lo), h.max(hi)),
        });
        Ok((i, off))
    }

    /// A kernel load of `out.len()` bytes at `addr` by `thread` (a linear id).
    pub(super) fn load(&mut self, addr: u64, out: &mut [u8], thread: u32) -> Result<()> {
        let len = out.len() as u64;
        ensure!(
            addr % len == 0,
            "misaligned load of {len} bytes at {addr:#x} (needs {len}-byte alignment)"
        );
        let (a, off) = self.kernel_access(addr, len, "load", false)?;
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
        let (a, off) = self.kernel_access(addr, len, "store", true)?;
        self.stores += 1;
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

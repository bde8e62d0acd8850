//! Host buffers kept from one call of a dist store to the next, so that a big transfer writes
//! into memory already mapped instead of paying page faults on fresh pages every call (glibc
//! hands big allocations back to the kernel when they are freed). The collectives' buffers,
//! the local sums and the copies a pull sends come from here and go back here.
//!
//! At most `KVSTORE_DIST_POOL_BYTES` bytes are kept (default 1 GiB), and at most [`SMALL_KEPT`]
//! small buffers (under 64 KiB), so that a call on small keys allocates nothing either.

use std::sync::{Arc, Mutex, OnceLock};

use crate::host::{convert_into, with_host, HostData};
use crate::{DType, Element, Error, Result};

/// Buffers smaller than this are small: at most [`SMALL_KEPT`] of them are kept.
const SMALL_BYTES: usize = 64 << 10;

/// The most small buffers kept: a call needs a few (send and receive per packed bucket).
const SMALL_KEPT: usize = 32;

/// A small request takes a kept buffer of at most this much room: a small key never holds a
/// big key's buffer (whose next push would then fault its pages in afresh).
const SMALL_TAKES_AT_MOST: usize = 4 * SMALL_BYTES;

/// Host buffers kept between calls.
pub(crate) struct Pool {
    bufs: Mutex<Kept>,
    max_bytes: usize,
}

/// The buffers a pool keeps, oldest first, with their count of small ones and their bytes
/// (kept up to date, so that giving back a buffer per key never re-counts them).
#[derive(Default)]
struct Kept {
    bufs: Vec<HostData>,
    small: usize,
    bytes: usize,
}

impl Kept {
    /// Takes buffer `i` out, keeping the others oldest first.
    fn remove(&mut self, i: usize) -> HostData {
        let b = self.bufs.remove(i);
        let bytes = room_bytes(&b);
        self.bytes -= bytes;
        self.small -= usize::from(bytes < SMALL_BYTES);
        b
    }

    fn push(&mut self, b: HostData) {
        let bytes = room_bytes(&b);
        self.bytes += bytes;
        self.small += usize::from(bytes < SMALL_BYTES);
        self.bufs.push(b);
    }
}

/// The bytes a buffer holds room for.
fn room_bytes(b: &HostData) -> usize {
    with_host!(b, v: T => v.capacity() * std::mem::size_of::<T>())
}

impl Pool {
    /// The process's pool, shared by its distributed stores so that the bound holds per
    /// process, keeping at most `max_bytes` bytes (`KVSTORE_DIST_POOL_BYTES`). A later store
    /// that asks for another bound is an error naming the variable.
    pub(crate) fn process(max_bytes: usize) -> Result<Arc<Pool>> {
        static POOL: OnceLock<Arc<Pool>> = OnceLock::new();
        let pool = POOL.get_or_init(|| Arc::new(Pool::with_max_bytes(max_bytes)));
        if pool.max_bytes != max_bytes {
            return Err(Error::InvalidEnv {
                var: "KVSTORE_DIST_POOL_BYTES",
                value: max_bytes.to_string(),
                expected: "the value this process's first dist store read (the pool is one \
                           per process): set it before the first store, and leave it",
            });
        }
        Ok(pool.clone())
    }

    /// Whether buffers of `bytes` bytes are kept between calls with no bound on their count
    /// (only on the pool's bytes).
    pub(crate) fn keeps(bytes: usize) -> bool {
        bytes >= SMALL_BYTES
    }

    /// The most bytes the pool keeps.
    pub(crate) fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// A pool that keeps at most `max_bytes` bytes.
    pub(crate) fn with_max_bytes(max_bytes: usize) -> Pool {
        Pool {
            bufs: Mutex::new(Kept::default()),
            max_bytes,
        }
    }

    /// A buffer of `len` elements of `dtype` with room for `room` (at least `len`). Its contents
    /// are unspecified.
    pub(crate) fn take(&self, dtype: DType, len: usize, room: usize) -> HostData {
        let room = room.max(len);
        let need = room * dtype.size();
        self.take_fitting(dtype, len, room, |have| {
            have >= need && (need >= SMALL_BYTES || have <= SMALL_TAKES_AT_MOST)
        })
    }

    /// A buffer of `len` elements of `dtype` with room for exactly `len`, for what a store keeps
    /// beyond the call (a key's residual). Its contents are unspecified.
    pub(crate) fn take_exact(&self, dtype: DType, len: usize) -> HostData {
        let need = len * dtype.size();
        self.take_fitting(dtype, len, len, |have| have == need)
    }

    /// The smallest kept buffer of `dtype` whose room in bytes `fits`, at `len` elements, or a
    /// fresh one with room for `room`.
    fn take_fitting(
        &self,
        dtype: DType,
        len: usize,
        room: usize,
        fits: impl Fn(usize) -> bool,
    ) -> HostData {
        if room == 0 {
            return with_room(dtype, 0, 0);
        }
        let mut bufs = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let best = bufs
            .bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| b.dtype() == dtype && fits(room_bytes(b)))
            .min_by_key(|(_, b)| room_bytes(b))
            .map(|(i, _)| i);
        let mut buf = match best {
            Some(i) => bufs.remove(i),
            None => {
                drop(bufs);
                return with_room(dtype, len, room);
            }
        };
        drop(bufs);
        with_host!(&mut buf, v: T => v.resize(len, T::from_f64(0.0)));
        buf
    }

    /// Keeps `buf` for a later [`Pool::take`], within `max_bytes` in all (the oldest go first)
    /// and [`SMALL_KEPT`] small buffers (past that, a small one given is freed).
    pub(crate) fn give(&self, buf: HostData) {
        let bytes = room_bytes(&buf);
        if bytes == 0 || bytes > self.max_bytes {
            return;
        }
        let mut kept = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        // A call that gives back a small buffer per key (the totals of a push of many keys)
        // fills the small ones' room once; the rest are freed as they come, in O(1).
        if bytes < SMALL_BYTES && kept.small >= SMALL_KEPT {
            return;
        }
        kept.push(buf);
        while kept.bytes > self.max_bytes {
            kept.remove(0);
        }
    }
}

/// A fresh buffer of `len` elements (zeros) with room for `room`.
fn with_room(dtype: DType, len: usize, room: usize) -> HostData {
    let mut buf = HostData::filled(dtype, 0, 0.0);
    with_host!(&mut buf, v: T => {
        v.reserve_exact(room);
        v.resize(len, T::from_f64(0.0));
    });
    buf
}

/// Copies `src` into `dst`, which has its length.
pub(crate) fn copy_into(dst: &mut HostData, src: &HostData) {
    with_host!(src, s: T => convert_into(s, dst));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_take_never_gets_a_bigger_buffer() {
        let pool = Pool::with_max_bytes(64 << 20);
        pool.give(with_room(DType::F32, 10, 2_000_000));
        let a = pool.take_exact(DType::F32, 20_000);
        assert_eq!((a.len(), room_bytes(&a)), (20_000, 80_000));
        assert_eq!(
            pool.bufs.lock().unwrap().bufs.len(),
            1,
            "the big buffer stays kept"
        );
        pool.give(a);
        let b = pool.take_exact(DType::F32, 20_000);
        assert_eq!(room_bytes(&b), 80_000);
        assert_eq!(
            pool.bufs.lock().unwrap().bufs.len(),
            1,
            "the exact one was taken"
        );
    }

    #[test]
    fn buffers_come_back_with_their_room_and_the_bound_holds() {
        let pool = Pool::with_max_bytes(3 << 20);
        let a = pool.take(DType::F32, 100_000, 250_000);
        assert_eq!((a.len(), room_bytes(&a) >= 1_000_000), (100_000, true));
        pool.give(a);
        // The kept buffer serves a request that fits its room, at the length asked.
        let b = pool.take(DType::F32, 200_000, 200_000);
        assert_eq!(b.len(), 200_000);
        assert!(pool.bufs.lock().unwrap().bufs.is_empty());
        // Another dtype does not take it.
        pool.give(b);
        let c = pool.take(DType::F64, 10, 10);
        assert_eq!(pool.bufs.lock().unwrap().bufs.len(), 1);
        pool.give(c); // small buffers are kept too
        assert_eq!(pool.bufs.lock().unwrap().bufs.len(), 2);
        // Past the bound, the oldest buffers go.
        for _ in 0..4 {
            pool.give(with_room(DType::F32, 0, 250_000));
        }
        let kept: usize = pool.bufs.lock().unwrap().bufs.iter().map(room_bytes).sum();
        assert!(kept <= 3 << 20, "{kept}");
    }

    #[test]
    fn small_buffers_are_kept_up_to_their_count_and_never_take_a_big_one() {
        let pool = Pool::with_max_bytes(64 << 20);
        // A small request does not take a big buffer; a big one does.
        pool.give(with_room(DType::F32, 0, 1 << 20));
        let small = pool.take(DType::F32, 1024, 1024);
        assert_eq!(room_bytes(&small), 4096);
        assert_eq!(pool.bufs.lock().unwrap().bufs.len(), 1);
        let big = pool.take(DType::F32, 600_000, 600_000);
        assert!(room_bytes(&big) >= 4 << 20);
        assert!(pool.bufs.lock().unwrap().bufs.is_empty());
        // A small buffer comes back at the length asked, with no fresh allocation.
        pool.give(small);
        let again = pool.take(DType::F32, 1000, 1024);
        assert_eq!((again.len(), room_bytes(&again)), (1000, 4096));
        // At most SMALL_KEPT small buffers stay; the big one is not counted among them.
        pool.give(big);
        for _ in 0..SMALL_KEPT + 10 {
            pool.give(with_room(DType::F32, 0, 256));
        }
        let kept = pool.bufs.lock().unwrap();
        let small = kept
            .bufs
            .iter()
            .filter(|b| room_bytes(b) < SMALL_BYTES)
            .count();
        assert_eq!((small, kept.bufs.len()), (SMALL_KEPT, SMALL_KEPT + 1));
        // The counts kept alongside agree with the buffers.
        let bytes: usize = kept.bufs.iter().map(room_bytes).sum();
        assert_eq!((kept.small, kept.bytes), (small, bytes));
    }
}

//! Copies of host memory that stay fast whatever the two addresses are.
//!
//! glibc's `memcpy` (to at least 2.36) moves medium blocks (about 2 KiB to the L2 size) with
//! `rep movsb`, which on AMD Zen (FSRM) is slow when the destination sits just above the source
//! modulo a 4 KiB page (each store falsely aliases a load in flight): 15–30× at 1–31 bytes, up
//! to 1.7× (64 KiB) or 5× (4 KiB) at a few hundred. On the build machine (AMD EPYC, glibc 2.36;
//! `benches/results/memcopy_2026-11-27/`) a 64 KiB copy took 22–54 µs at a distance of 8–24
//! bytes against 1.4 µs at 0; 4 KiB, 1.6–2.4 µs against 0.06 µs. `malloc` often gives two arrays
//! such a distance, so a pull into the caller's array was slow or fast by chance.
//!
//! At those distances the copy runs backward, in blocks `memcpy` moves with vector registers,
//! whose loads run ahead of the stores: 64 KiB at 16 bytes takes 1.3–1.7 µs, as at any distance.

/// The block of a backward copy, in bytes: below glibc's smallest `rep movsb` threshold
/// (2,112 bytes on the build machine, 2 KiB and more elsewhere).
const BLOCK_BYTES: usize = 2048;

/// Destinations at most this far above the source, modulo a page, are copied backward.
const SHORT_DISTANCE: usize = 255;

/// The page size of the aliasing: 4 KiB on x86-64.
const PAGE: usize = 4096;

/// Copies `src` into `dst`, as `dst.copy_from_slice(src)` (which panics if lengths differ).
pub(crate) fn copy<T: Copy>(dst: &mut [T], src: &[T]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of different lengths"
    );
    // SAFETY: `dst` and `src` are valid for `src.len()` elements, and a `&mut` slice cannot
    // overlap a shared one.
    unsafe { copy_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// Appends `src` to `v`, as `v.extend_from_slice(src)`.
pub(crate) fn extend<T: Copy>(v: &mut Vec<T>, src: &[T]) {
    let at = v.len();
    v.reserve(src.len());
    // SAFETY: `reserve` made room for `src.len()` elements after `at`; `src` cannot overlap
    // `v`'s spare room, which nothing else refers to.
    unsafe {
        copy_raw(v.as_mut_ptr().add(at), src.as_ptr(), src.len());
        // The `src.len()` elements after `at` were reserved above and have just been written.
        v.set_len(at + src.len());
    }
}

/// Copies `len` elements from `src` to `dst`: forward, or backward in blocks where the
/// destination lies a short distance above the source.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` elements, and they must not
/// overlap.
unsafe fn copy_raw<T: Copy>(dst: *mut T, src: *const T, len: usize) {
    let width = size_of::<T>();
    if !aliases(dst as usize, src as usize, len * width) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let per = (BLOCK_BYTES / width.max(1)).max(1);
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(per);
        // SAFETY: `start..end` lies within the `len` elements of the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.add(start), dst.add(start), end - start) };
        end = start;
    }
}

/// Whether a forward copy of `bytes` bytes from `src` to `dst` would meet the slow case.
fn aliases(dst: usize, src: usize, bytes: usize) -> bool {
    let distance = dst.wrapping_sub(src) % PAGE;
    bytes > BLOCK_BYTES && (1..=SHORT_DISTANCE).contains(&distance)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_equal_copy_from_slice_at_every_distance_and_length() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let src: Vec<u32> = (0..40_000)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u32
            })
            .collect();
        for len in [0, 1, 511, 512, 513, 4_000, 16_411, 33_000] {
            let s = &src[..len];
            // Destinations placed at chosen distances above the source, modulo a page: the
            // backward copy (4..=252) and the plain one.
            for distance in [0, 4, 16, 60, 252, 256, 2048, 4092] {
                let mut buf = vec![0u32; len + PAGE / 4 + 1];
                let gap = (s.as_ptr() as usize + distance).wrapping_sub(buf.as_ptr() as usize);
                let off = (gap % PAGE) / 4;
                let dst = &mut buf[off..off + len];
                let backward = len * 4 > BLOCK_BYTES && (1..=SHORT_DISTANCE).contains(&distance);
                assert_eq!(
                    aliases(dst.as_ptr() as usize, s.as_ptr() as usize, len * 4),
                    backward,
                    "len {len}, distance {distance}"
                );
                copy(dst, s);
                assert_eq!(&buf[off..off + len], s, "len {len}, distance {distance}");
                assert!(
                    buf[..off].iter().all(|&x| x == 0),
                    "wrote before the destination"
                );
                assert!(
                    buf[off + len..].iter().all(|&x| x == 0),
                    "wrote past the destination"
                );
            }
        }
    }

    #[test]
    fn only_short_distances_above_the_source_modulo_a_page_go_backward() {
        let src = 10 * PAGE + 48;
        assert!(aliases(src + 16, src, 64 << 10));
        assert!(aliases(src + 3 * PAGE + 8, src, 4096));
        assert!(aliases(src + 255, src, 4096));
        assert!(!aliases(src, src, 64 << 10));
        assert!(!aliases(src + 256, src, 64 << 10));
        assert!(!aliases(src - 16, src, 64 << 10));
        assert!(!aliases(src + 16, src, BLOCK_BYTES));
    }

    #[test]
    fn extend_appends_forward_and_backward() {
        let more: Vec<f32> = (0..PAGE as u32 + 5000)
            .map(|i| i as f32 * 0.5 - 7.0)
            .collect();
        for distance in [0, 16, 252, 300] {
            let mut v = vec![1.0f32, 2.0];
            v.reserve(5000);
            // The source placed `distance` bytes below the spare room, modulo a page.
            let spare = v.as_ptr() as usize + 8;
            let gap = spare.wrapping_sub(more.as_ptr() as usize + distance) % PAGE;
            let src = &more[gap / 4..gap / 4 + 5000];
            let backward = (1..=SHORT_DISTANCE).contains(&distance);
            assert_eq!(aliases(spare, src.as_ptr() as usize, 20_000), backward);
            let room = v.capacity();
            extend(&mut v, src);
            assert_eq!(v.capacity(), room, "extend moved the vector");
            assert_eq!(v.len(), 5002);
            assert_eq!(&v[..2], &[1.0, 2.0]);
            assert_eq!(&v[2..], src);
        }
    }
}

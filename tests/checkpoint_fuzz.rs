//! No checkpoint file can crash a process (issue 41, item 5): proptest mutates the bytes of
//! real checkpoints and loads them, and every load must give an `Error::Checkpoint` (or, for a
//! mutation that happens to be valid, load a store whose every key pulls and pushes), never a
//! panic, never an abort, and never an allocation larger than a small multiple of the files.
//!
//! The checkpoints are real saves of small trained stores: a single file and a sharded
//! checkpoint of 2 ranks (through the writer the ranks of a `dist` store use), each of a store
//! with Adam state in every dtype, a key without state and a row-sparse key, and of a store
//! with SGD momentum state and two gradient-compression residuals per key. A case picks one
//! file of the checkpoint, one section of it (the header's length, the header, the key table
//! of `order/` or `piece/` entries, the tensors' data, the state and residuals with their
//! entries, or the index), and one mutation: bit flips, a cut, bytes appended, a decimal count
//! overwritten with a huge one (10^13, 2^64 - 1, ...), or the header's length overwritten.
//! Flips and counts are also made with every checksum computed afresh (the tensors', the
//! header's, the index's), so that what the checks behind the checksums do is exercised, not
//! only the checksums; an index may also be rewritten in the previous format, which has none.
//!
//! The allocation bound is checked by this binary's global allocator, which records the
//! largest single allocation and the most bytes held at once by the loading thread while a
//! load runs (and refuses any allocation above 1 GiB then, so that a missing bound aborts this
//! test at once, instead of exhausting the machine).

// Sections are lists of byte ranges, and some lists hold one range.
#![allow(clippy::single_range_in_vec_init)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fs;
use std::path::{Path, PathBuf};

use kvstore::{Adam, Compression, DType, Error, KvStore, NDArray, RowSparse, Sgd, Shape, Updater};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Counts what the loading thread allocates while a load runs; see the module docs.
struct Counting;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

thread_local! {
    /// Whether this thread's allocations are being watched (a load is running on it).
    static WATCHING: Cell<bool> = const { Cell::new(false) };
    /// The largest single allocation (or reallocation) while watched.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    /// Bytes allocated less bytes freed while watched, and the most it reached.
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

/// Above this, a watched allocation is refused (Rust then aborts with "memory allocation of
/// N bytes failed"): no load of these kilobyte checkpoints may ask for it.
const REFUSED: usize = 1 << 30;

/// Records an allocation of `size` bytes on this thread; false when it is to be refused.
fn allocating(size: usize) -> bool {
    let watched = WATCHING.try_with(Cell::get).unwrap_or(false);
    if !watched {
        return true;
    }
    LARGEST.with(|l| l.set(l.get().max(size)));
    HELD.with(|h| {
        h.set(h.get() + size as isize);
        PEAK.with(|p| p.set(p.get().max(h.get())));
    });
    size <= REFUSED
}

/// Records that `size` bytes were freed on this thread.
fn freeing(size: usize) {
    if WATCHING.try_with(Cell::get).unwrap_or(false) {
        HELD.with(|h| h.set(h.get() - size as isize));
    }
}

// SAFETY: every method passes its arguments on to `System` unchanged, under the same contract
// that the caller of this allocator keeps; the bookkeeping around it touches only const
// thread-locals of `Cell`s (no allocation, no destructor), and a refusal is a null pointer,
// which the contract allows.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !allocating(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires it (non-zero size).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !allocating(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        freeing(layout.size());
        // SAFETY: `ptr` was allocated by `System` (through this allocator) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !allocating(new_size) {
            return std::ptr::null_mut();
        }
        freeing(layout.size());
        // SAFETY: `ptr` was allocated by `System` with `layout`, and `new_size` is the caller's,
        // as `GlobalAlloc::realloc` requires them.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Stops watching when dropped, also when the load panics.
struct Watch;

impl Watch {
    fn start() -> Watch {
        LARGEST.with(|l| l.set(0));
        HELD.with(|h| h.set(0));
        PEAK.with(|p| p.set(0));
        WATCHING.with(|w| w.set(true));
        Watch
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        WATCHING.with(|w| w.set(false));
    }
}

/// `f`'s result, with the largest single allocation and the most bytes held at once while it
/// ran on this thread.
fn measured<T>(f: impl FnOnce() -> T) -> (T, usize, isize) {
    let watch = Watch::start();
    let out = f();
    drop(watch);
    (out, LARGEST.with(Cell::get), PEAK.with(Cell::get))
}

/// The bound on the largest single allocation of a load of `total` bytes of checkpoint: the
/// file itself (a single file is read whole) once over, and room for small tables. (Measured
/// on 10,000 cases: at most the files and 1.8 KiB.)
fn largest_bound(total: usize) -> usize {
    2 * total + (16 << 10)
}

/// The bound on the bytes a load holds at once: a few copies of the files (read, decoded,
/// the store's own copy) and the store's fixed costs. (Measured on 10,000 cases: at most 4
/// times the files and 11 KiB.)
fn held_bound(total: usize) -> isize {
    (4 * total + (64 << 10)) as isize
}

/// A file of a checkpoint: where it is, its good bytes, and what it is.
struct File {
    path: PathBuf,
    good: Vec<u8>,
    /// The index of a sharded checkpoint (text), or a safetensors file.
    index: bool,
}

/// A saved checkpoint and how to load it.
struct Fixture {
    /// What `load` is given: the file, or the sharded directory.
    path: PathBuf,
    files: Vec<File>,
    /// The store kind, updater and compression of the store loaded into.
    kind: &'static str,
    updater: Updater,
    compression: Compression,
    /// The directory the fixture owns, removed with it.
    dir: PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn adam() -> Updater {
    Updater::Adam(Adam {
        lr: 0.01,
        wd: 0.001,
        ..Adam::default()
    })
}

fn sgd_momentum() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.05,
        momentum: 0.9,
        ..Sgd::default()
    })
}

/// An array of `dims` and `dtype` with values from `seed`.
fn array(dims: &[usize], dtype: DType, seed: f64) -> NDArray {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|i| ((i as f64 + seed) * 0.37).sin()).collect();
    let a = NDArray::from_vec(v, Shape::new(dims).unwrap()).unwrap();
    a.astype(dtype).unwrap()
}

/// A `local` store with Adam state in every dtype, a key never pushed (no state) and a
/// row-sparse key.
fn adam_store() -> KvStore {
    let kv = KvStore::create("local").unwrap();
    kv.set_updater(adam()).unwrap();
    let keys: [(i32, &[usize], DType); 4] = [
        (0, &[3, 4], DType::F32),
        (1, &[5], DType::F64),
        (2, &[], DType::F16),
        (3, &[2, 3], DType::BF16),
    ];
    for (k, dims, dtype) in keys {
        kv.init(k, &array(dims, dtype, k as f64)).unwrap();
        kv.push(k, &array(dims, dtype, 10.0 + k as f64)).unwrap();
        kv.push(k, &array(dims, dtype, 20.0 + k as f64)).unwrap();
    }
    kv.init(4, &array(&[7], DType::F32, 4.0)).unwrap();
    kv.init_row_sparse(5, &array(&[4, 2], DType::F32, 5.0))
        .unwrap();
    let rows = RowSparse::new(vec![1, 3], array(&[2, 2], DType::F32, 6.0)).unwrap();
    kv.push_row_sparse(5, &[rows]).unwrap();
    kv
}

/// A `device` store (on the CPU fallback without a GPU) with SGD momentum state and two
/// gradient-compression residuals per key, of string keys.
fn compressed_store() -> KvStore {
    let kv = KvStore::create("device").unwrap();
    kv.set_gradient_compression(Compression::two_bit(0.5))
        .unwrap();
    kv.set_updater(sgd_momentum()).unwrap();
    for (k, dims) in [("w", &[6][..]), ("b", &[2, 3][..])] {
        kv.init(k, &array(dims, DType::F32, 1.0)).unwrap();
        let grads = [array(dims, DType::F32, 2.0), array(dims, DType::F32, 3.0)];
        kv.push(k, &grads[..]).unwrap();
    }
    kv
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(files_under(&path));
        } else {
            found.push(path);
        }
    }
    found.sort();
    found
}

impl Fixture {
    /// A checkpoint of `kv`, saved into a fresh directory named for `name`: a single file (the
    /// format of earlier versions), or sharded over `world` ranks.
    fn new(name: &str, kv: &KvStore, world: Option<usize>, kind: &'static str) -> Fixture {
        let dir = std::env::temp_dir().join(format!("kvstore-fuzz-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let path = match world {
            Some(world) => {
                let path = dir.join("sharded");
                kv.save_sharded(&path, world).unwrap();
                path
            }
            None => {
                // The single file of earlier versions, which loads still.
                let path = dir.join("ckpt.safetensors");
                kv.save_single_file(&path).unwrap();
                path
            }
        };
        let files = files_under(&dir)
            .into_iter()
            .map(|p| File {
                good: fs::read(&p).unwrap(),
                index: p.file_name().is_some_and(|n| n == "index"),
                path: p,
            })
            .collect();
        let fixture = Fixture {
            path,
            files,
            kind,
            updater: kv.updater(),
            compression: kv.gradient_compression(),
            dir,
        };
        // The unmutated checkpoint loads, within the bounds.
        let (result, largest, held) = fixture.load();
        result.unwrap();
        let total = fixture.total(None);
        assert!(largest <= largest_bound(total), "{largest} of {total}");
        assert!(held <= held_bound(total), "{held} of {total}");
        fixture
    }

    /// The bytes of every file, with file `mutated` of `len` bytes in place of its own.
    fn total(&self, mutated: Option<(usize, usize)>) -> usize {
        (self.files.iter().enumerate())
            .map(|(i, f)| match mutated {
                Some((m, len)) if m == i => len,
                _ => f.good.len(),
            })
            .sum()
    }

    /// A fresh store as the checkpoint's was set up.
    fn store(&self) -> KvStore {
        let kv = KvStore::create(self.kind).unwrap();
        if self.compression != Compression::None {
            kv.set_gradient_compression(self.compression).unwrap();
        }
        kv.set_updater(self.updater.clone()).unwrap();
        kv
    }

    /// Loads the checkpoint into a fresh store, watched: the store, the result, the largest
    /// allocation, the most bytes held.
    fn load(&self) -> (kvstore::Result<KvStore>, usize, isize) {
        let kv = self.store();
        let (result, largest, held) = measured(|| kv.load(&self.path));
        (result.map(|()| kv), largest, held)
    }

    /// Loads the checkpoint with file `i` replaced by `bytes`, and checks the outcome; the
    /// file is put back afterwards.
    fn check(&self, i: usize, bytes: &[u8]) -> Result<(), TestCaseError> {
        let file = &self.files[i];
        fs::write(&file.path, bytes).unwrap();
        let (result, largest, held) = self.load();
        fs::write(&file.path, &file.good).unwrap();
        let total = self.total(Some((i, bytes.len())));
        prop_assert!(
            largest <= largest_bound(total),
            "a load of {total} bytes allocated {largest} at once"
        );
        prop_assert!(
            held <= held_bound(total),
            "a load of {total} bytes held {held} at once"
        );
        match result {
            Ok(kv) => passes(&kv),
            Err(Error::Checkpoint { .. }) => Ok(()),
            Err(e) => Err(TestCaseError::fail(format!("not a checkpoint error: {e}"))),
        }
    }
}

/// A store a mutated checkpoint loaded into works: every key pulls, and every dense key
/// pushes (through its loaded updater state and residuals).
fn passes(kv: &KvStore) -> Result<(), TestCaseError> {
    for key in kv.keys() {
        let (shape, dtype, _) = kv.meta(key.clone()).unwrap();
        let out = NDArray::zeros(shape).astype(dtype).unwrap();
        kv.pull(key.clone(), &out)
            .map_err(|e| TestCaseError::fail(format!("pull {key}: {e}")))?;
        if !kv.is_row_sparse(key.clone()).unwrap() {
            let grad = NDArray::full(shape, 0.25).astype(dtype).unwrap();
            kv.push(key.clone(), &grad)
                .map_err(|e| TestCaseError::fail(format!("push {key}: {e}")))?;
        }
    }
    Ok(())
}

/// Where in a file a mutation lands.
#[derive(Clone, Copy, Debug)]
enum Section {
    /// The 8-byte header length.
    Length,
    /// The whole JSON header.
    Header,
    /// The key table: the `order/<key>` (single file) or `piece/<key>` (shard) entries.
    Keys,
    /// The tensors' data: `value/<key>`.
    Values,
    /// State and residuals: their tensors' data, and the `step/`, `residuals/` and
    /// `state_names` entries.
    State,
}

const SECTIONS: [Section; 5] = [
    Section::Length,
    Section::Header,
    Section::Keys,
    Section::Values,
    Section::State,
];

/// Huge and edge counts to write over a decimal count.
const COUNTS: [&str; 8] = [
    "10000000000000",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "4294967296",
    "100000000",
    "0",
    "1",
];

/// What a case does to the bytes of the file.
#[derive(Clone, Debug)]
enum Mutation {
    /// Flips `bits` bits (picked from `at`), then makes every checksum right when `reseal`.
    Flip { at: u64, bits: u8, reseal: bool },
    /// Cuts the file at a place picked from `at`.
    Cut { at: u64 },
    /// Appends bytes.
    Extend { bytes: Vec<u8> },
    /// Writes `COUNTS[count]` over the decimal number picked from `at` (the header's length
    /// made right); every checksum made right when `reseal`. An index without `reseal` is
    /// rewritten in the previous format, which has no checksum.
    Count { at: u64, count: usize, reseal: bool },
    /// Writes `length` over the 8-byte header length.
    Length { length: u64 },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<u64>(), 1..=4u8, any::<bool>())
            .prop_map(|(at, bits, reseal)| Mutation::Flip { at, bits, reseal }),
        1 => any::<u64>().prop_map(|at| Mutation::Cut { at }),
        1 => prop::collection::vec(any::<u8>(), 1..32).prop_map(|bytes| Mutation::Extend { bytes }),
        4 => (any::<u64>(), 0..COUNTS.len(), any::<bool>())
            .prop_map(|(at, count, reseal)| Mutation::Count { at, count, reseal }),
        1 => prop::sample::select(vec![
            u64::MAX,
            10_000_000_000_000,
            1 << 32,
            99_999_999,
            100_000_001,
        ])
        .prop_map(|length| Mutation::Length { length }),
    ]
}

/// A safetensors file split into its JSON header and its data.
struct Split {
    json: Vec<u8>,
    data: Vec<u8>,
}

impl Split {
    fn of(bytes: &[u8]) -> Split {
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        Split {
            json: bytes[8..8 + n].to_vec(),
            data: bytes[8 + n..].to_vec(),
        }
    }

    /// The file again, the header's length made right for the JSON as it is now; with
    /// `reseal`, every tensor's checksums and the header's made right too (the tensors' only
    /// where the JSON still parses).
    fn join(mut self, reseal: bool) -> Vec<u8> {
        if reseal {
            self.reseal_tensors();
            self.reseal_header();
        }
        let mut out = (self.json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&self.json);
        out.extend_from_slice(&self.data);
        out
    }

    /// Recomputes every `crc32/<tensor>` entry from the data, where the JSON parses.
    fn reseal_tensors(&mut self) {
        let Ok(serde_json::Value::Object(mut header)) = serde_json::from_slice(&self.json) else {
            return;
        };
        let mut sums = Vec::new();
        let meta = header.get("__metadata__").and_then(|m| m.as_object());
        let chunk = meta
            .and_then(|m| m.get("crc32_chunk")?.as_str()?.parse::<usize>().ok())
            .filter(|&c| c > 0);
        let Some(chunk) = chunk else { return };
        for (name, info) in header.iter().filter(|(n, _)| *n != "__metadata__") {
            let offsets = info.get("data_offsets").and_then(|o| o.as_array());
            let range = offsets.and_then(|o| {
                let (s, e) = (o.first()?.as_u64()? as usize, o.get(1)?.as_u64()? as usize);
                (s <= e && e <= self.data.len()).then_some(s..e)
            });
            let Some(range) = range else { return };
            let list: Vec<String> = self.data[range]
                .chunks(chunk)
                .map(|c| format!("{:08x}", crc32fast::hash(c)))
                .collect();
            sums.push((format!("crc32/{name}"), list.join(",")));
        }
        if let Some(serde_json::Value::Object(meta)) = header.get_mut("__metadata__") {
            for (entry, list) in sums {
                meta.insert(entry, list.into());
            }
        }
        self.json = serde_json::to_vec(&header).unwrap();
    }

    /// Recomputes the header's checksum, where its entry is there once.
    fn reseal_header(&mut self) {
        let pattern = b"\"header_crc32\":\"";
        let found: Vec<usize> = (self.json.windows(pattern.len()))
            .enumerate()
            .filter(|(_, w)| w == pattern)
            .map(|(i, _)| i + pattern.len())
            .collect();
        let [at] = found[..] else { return };
        if at + 8 > self.json.len() {
            return;
        }
        self.json[at..at + 8].copy_from_slice(b"00000000");
        let mut header = (self.json.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&self.json);
        let sum = format!("{:08x}", crc32fast::hash(&header));
        self.json[at..at + 8].copy_from_slice(sum.as_bytes());
    }
}

/// The byte ranges of `section` in safetensors file `bytes` (positions in the file).
fn ranges(bytes: &[u8], section: Section) -> Vec<std::ops::Range<usize>> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let (json, data_start) = (&bytes[8..8 + n], 8 + n);
    // `"<prefix>...":"..."` entries of the JSON header.
    let entries = |prefixes: &[&str]| -> Vec<std::ops::Range<usize>> {
        let mut found = Vec::new();
        for prefix in prefixes {
            let pattern = format!("\"{prefix}");
            let mut from = 0;
            while let Some(i) = find(&json[from..], pattern.as_bytes()) {
                let start = from + i;
                let end = quotes_after(json, start, 4).unwrap_or(json.len());
                found.push(8 + start..8 + end);
                from = start + 1;
            }
        }
        found
    };
    // The data of tensors whose names start with one of `prefixes`.
    let tensors = |prefixes: &[&str]| -> Vec<std::ops::Range<usize>> {
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
        (meta.tensors().into_iter())
            .filter(|(name, _)| prefixes.iter().any(|p| name.starts_with(p)))
            .map(|(_, info)| data_start + info.data_offsets.0..data_start + info.data_offsets.1)
            .filter(|r| !r.is_empty())
            .collect()
    };
    let found = match section {
        Section::Length => vec![0..8],
        Section::Header => vec![8..8 + n],
        Section::Keys => entries(&["order/", "piece/", "keys\""]),
        Section::Values => tensors(&["value/"]),
        Section::State => {
            let mut r = tensors(&["state/", "residual/"]);
            r.extend(entries(&["step/", "residuals/", "state_names"]));
            r
        }
    };
    if found.is_empty() {
        vec![8..8 + n]
    } else {
        found
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The position just past the `count`-th `"` from `start` on (the first is at `start`).
fn quotes_after(json: &[u8], start: usize, count: usize) -> Option<usize> {
    let mut seen = 0;
    for (i, &b) in json[start..].iter().enumerate() {
        if b == b'"' {
            seen += 1;
            if seen == count {
                return Some(start + i + 1);
            }
        }
    }
    None
}

/// A position among `ranges`, picked by `at`.
fn pick(ranges: &[std::ops::Range<usize>], at: u64) -> usize {
    let total: usize = ranges.iter().map(|r| r.len()).sum();
    let mut k = (at % total.max(1) as u64) as usize;
    for r in ranges {
        if k < r.len() {
            return r.start + k;
        }
        k -= r.len();
    }
    ranges[0].start
}

/// The maximal runs of decimal digits in `bytes` that overlap `ranges`.
fn digit_runs(bytes: &[u8], ranges: &[std::ops::Range<usize>]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if ranges.iter().any(|r| r.start < i && start < r.end) {
                runs.push(start..i);
            }
        } else {
            i += 1;
        }
    }
    runs
}

/// Flips `bits` bits at places picked from `at` within `ranges`.
fn flip(bytes: &mut [u8], ranges: &[std::ops::Range<usize>], at: u64, bits: u8) {
    let mut x = at;
    for _ in 0..bits {
        let place = pick(ranges, x);
        bytes[place] ^= 1 << (x >> 61);
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
    }
}

/// The index text with its checksum line made right (where it has one).
fn reseal_index(text: &[u8]) -> Vec<u8> {
    let Ok(text) = std::str::from_utf8(text) else {
        return text.to_vec();
    };
    let trimmed = text.strip_suffix('\n').unwrap_or(text);
    let Some(at) = trimmed.rfind('\n') else {
        return text.as_bytes().to_vec();
    };
    let (body, last) = trimmed.split_at(at + 1);
    if !last.starts_with("crc32 ") {
        return text.as_bytes().to_vec();
    }
    format!("{body}crc32 {:08x}\n", crc32fast::hash(body.as_bytes())).into_bytes()
}

/// The index in the previous format: its first four lines, the first naming format 2.
fn index_2(text: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(text);
    let mut lines: Vec<String> = text.lines().take(4).map(str::to_owned).collect();
    if let Some(first) = lines.first_mut() {
        *first = "kvstore-checkpoint-index/2".into();
    }
    lines
        .iter()
        .map(|l| format!("{l}\n"))
        .collect::<String>()
        .into_bytes()
}

/// Writes `COUNTS[count]` over the digit run picked from `at` among `runs`.
fn write_count(bytes: &[u8], runs: &[std::ops::Range<usize>], at: u64, count: usize) -> Vec<u8> {
    let run = runs[(at % runs.len() as u64) as usize].clone();
    let mut out = bytes[..run.start].to_vec();
    out.extend_from_slice(COUNTS[count].as_bytes());
    out.extend_from_slice(&bytes[run.end..]);
    out
}

/// The index of a sharded checkpoint, mutated.
fn mutate_index(good: &[u8], m: &Mutation) -> Vec<u8> {
    let all = [0..good.len()];
    let mut bytes = good.to_vec();
    match m {
        Mutation::Flip { at, bits, reseal } => {
            flip(&mut bytes, &all, *at, *bits);
            if *reseal {
                bytes = reseal_index(&bytes);
            }
        }
        Mutation::Cut { at } => bytes.truncate((*at % good.len() as u64) as usize),
        Mutation::Extend { bytes: more } => bytes.extend_from_slice(more),
        Mutation::Count { at, count, reseal } => {
            let base = if *reseal { bytes } else { index_2(good) };
            let runs = digit_runs(&base, &[0..base.len()]);
            let changed = write_count(&base, &runs, *at, *count);
            bytes = if *reseal {
                reseal_index(&changed)
            } else {
                changed
            };
        }
        Mutation::Length { length } => {
            // The world the index names.
            let text = String::from_utf8_lossy(good);
            let world = text.lines().nth(2).unwrap_or_default();
            let changed = text.replacen(world, &format!("world {length}"), 1);
            bytes = reseal_index(changed.as_bytes());
        }
    }
    bytes
}

/// A safetensors file of a checkpoint, mutated in `section`.
fn mutate_file(good: &[u8], section: Section, m: &Mutation) -> Vec<u8> {
    let within = ranges(good, section);
    match m {
        Mutation::Flip { at, bits, reseal } => {
            let mut bytes = good.to_vec();
            flip(&mut bytes, &within, *at, *bits);
            let header_end = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
            // A resealed flip in the length would only undo itself.
            let flipped_length = bytes[..8] != good[..8];
            if *reseal && !flipped_length && bytes.len() >= header_end {
                Split::of(&bytes).join(true)
            } else {
                bytes
            }
        }
        Mutation::Cut { at } => good[..pick(&within, *at)].to_vec(),
        Mutation::Extend { bytes } => [good, bytes].concat(),
        Mutation::Count { at, count, reseal } => {
            let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
            let runs = digit_runs(good, &within);
            let runs: Vec<_> = runs
                .into_iter()
                .filter(|r| r.start >= 8 && r.end <= 8 + n)
                .collect();
            let runs = if runs.is_empty() {
                digit_runs(good, &[8..8 + n])
            } else {
                runs
            };
            let changed = write_count(good, &runs, *at, *count);
            // The header's length made right for the longer (or shorter) JSON.
            let grown = changed.len() as isize - good.len() as isize;
            let json = changed[8..(8 + n as isize + grown) as usize].to_vec();
            let data = changed[(8 + n as isize + grown) as usize..].to_vec();
            Split { json, data }.join(*reseal)
        }
        Mutation::Length { length } => {
            let mut bytes = good.to_vec();
            bytes[..8].copy_from_slice(&length.to_le_bytes());
            bytes
        }
    }
}

/// Runs one case on `fixture`: file `file` (picked), section `section`, mutation `m`.
fn run_case(
    fixture: &Fixture,
    file: u64,
    section: Section,
    m: &Mutation,
) -> Result<(), TestCaseError> {
    let i = (file % fixture.files.len() as u64) as usize;
    let f = &fixture.files[i];
    let bytes = if f.index {
        mutate_index(&f.good, m)
    } else {
        mutate_file(&f.good, section, m)
    };
    fixture.check(i, &bytes)
}

/// 2,500 cases per checkpoint, 10,000 in all.
const CASES: u32 = 2_500;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn case() -> impl Strategy<Value = (u64, Section, Mutation)> {
    (
        any::<u64>(),
        prop::sample::select(SECTIONS.to_vec()),
        mutation(),
    )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn single_file_with_adam_state_in_every_dtype((file, section, m) in case()) {
        thread_local!(static F: Fixture =
            Fixture::new("single-adam", &adam_store(), None, "local"));
        F.with(|f| run_case(f, file, section, &m))?;
    }

    #[test]
    fn single_file_with_momentum_and_residuals((file, section, m) in case()) {
        thread_local!(static F: Fixture =
            Fixture::new("single-residuals", &compressed_store(), None, "device"));
        F.with(|f| run_case(f, file, section, &m))?;
    }

    #[test]
    fn two_shards_with_adam_state_in_every_dtype((file, section, m) in case()) {
        thread_local!(static F: Fixture =
            Fixture::new("sharded-adam", &adam_store(), Some(2), "local"));
        F.with(|f| run_case(f, file, section, &m))?;
    }

    #[test]
    fn two_shards_with_momentum_and_residuals((file, section, m) in case()) {
        thread_local!(static F: Fixture =
            Fixture::new("sharded-residuals", &compressed_store(), Some(2), "device"));
        F.with(|f| run_case(f, file, section, &m))?;
    }
}

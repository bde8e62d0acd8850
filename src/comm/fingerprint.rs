//! The fingerprint of a store call, and the message that says how ranks differ.
//!
//! Before a call's collectives, every rank contributes a fixed-size [`Record`] (sequence
//! number, hashes of the op and of every key, shape and dtype, the entry count) to one
//! all-gather. On any difference every rank takes the error path together: a second all-gather
//! of each rank's description, from which all build the same message naming the first
//! difference and the ranks on each side.

// `pub` for the MPI transport's test and bench support (`__internal::mpi`).
#![cfg_attr(not(feature = "mpi"), allow(unreachable_pub))]

use std::fmt::Write as _;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::{DType, Error, Key, Result};

/// One entry of a call: a key with the shape and dtype of its value.
#[derive(Clone, Debug, PartialEq)]
struct Entry {
    key: Key,
    dims: smallvec::SmallVec<[usize; 4]>,
    dtype: DType,
}

/// What the ranks must agree on for one store call: the op and its keys, shapes and dtypes.
#[derive(Clone, Debug, Default)]
pub struct Fingerprint {
    op: &'static str,
    /// Inline for a call of one key.
    entries: SmallVec<[Entry; 1]>,
    /// Why this rank rejected its input, if it did: so the others fail the call, not wait.
    rejected: Option<String>,
    /// What else the ranks must agree on (a push's updater), in words.
    note: Option<String>,
    /// Which store of the process makes the call: its number on its link.
    store: u64,
    /// The caller's tag ([`crate::KvStore::set_tag`]), so that ranks at different steps fail.
    tag: Option<Arc<str>>,
    /// The call goes on after its commit point, so it has an end point too
    /// ([`crate::comm::points`]), whatever its op.
    end_point: bool,
}

/// The record one rank contributes to the fingerprint all-gather, as `u64`s.
pub(crate) type Record = [u64; 4];

/// The 64-bit hash of a record's fields: XXH3, fixed by its specification, so every rank
/// hashes alike on any platform (against mistakes, not adversaries). Fields are framed (a word
/// as 8 little-endian bytes, a byte string after its length) into a buffer hashed in one pass:
/// 12 µs for 1000 entries, against 63 µs for XXH3's streaming hasher. A few keys' records fit
/// inline, so such a fingerprint allocates nothing.
struct Hash64(SmallVec<[u8; 256]>);

impl Hash64 {
    /// A hash with room for `bytes` bytes of fields.
    fn with_capacity(bytes: usize) -> Hash64 {
        Hash64(SmallVec::with_capacity(bytes))
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// `b`'s length, then its bytes.
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    fn digest(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&self.0)
    }
}

// `entry`, `keys` and `summary` serve the MPI link, its tests and the loopback link.
#[allow(dead_code)]
impl Fingerprint {
    /// A call of `op` ("push", "pull", ...) with no entries yet.
    pub fn new(op: &'static str) -> Fingerprint {
        Fingerprint {
            op,
            ..Fingerprint::default()
        }
    }

    /// The call, going on after its commit point: it has an end point too
    /// ([`crate::comm::points`]).
    pub(crate) fn with_end_point(mut self) -> Fingerprint {
        self.end_point = true;
        self
    }

    /// Whether the call has an end point whatever its op ([`Fingerprint::with_end_point`]).
    pub(crate) fn has_end_point(&self) -> bool {
        self.end_point
    }

    /// The call as made by store number `store` of its link.
    pub fn store(mut self, store: u64) -> Fingerprint {
        self.store = store;
        self
    }

    /// The call as made under the caller's tag `tag` (none: no tag).
    pub fn tag(mut self, tag: Option<Arc<str>>) -> Fingerprint {
        self.tag = tag;
        self
    }

    /// A call of `op` that this rank rejected (`why`), which every rank then fails together.
    pub fn rejected(op: &'static str, why: &str) -> Fingerprint {
        Fingerprint {
            rejected: Some(why.to_owned()),
            ..Fingerprint::new(op)
        }
    }

    /// Adds a key with the shape (`dims`) and dtype of its value.
    pub fn entry(mut self, key: impl Into<Key>, dims: &[usize], dtype: DType) -> Fingerprint {
        self.push(key.into(), dims, dtype);
        self
    }

    /// Adds what else the ranks must agree on, in words (for a push, the updater's name).
    pub fn note(mut self, note: impl Into<String>) -> Fingerprint {
        self.note = Some(note.into());
        self
    }

    /// Adds a key with the shape (`dims`) and dtype of its value, in place.
    pub fn push(&mut self, key: Key, dims: &[usize], dtype: DType) {
        self.entries.push(Entry {
            key,
            dims: dims.iter().copied().collect(),
            dtype,
        });
    }

    /// Makes room for `n` more entries.
    pub(crate) fn reserve(&mut self, n: usize) {
        self.entries.reserve(n);
    }

    /// The op name.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The keys, in call order.
    pub fn keys(&self) -> Vec<Key> {
        self.key_iter().cloned().collect()
    }

    /// The keys, in call order, where they are.
    pub(crate) fn key_iter(&self) -> impl Iterator<Item = &Key> {
        self.entries.iter().map(|e| &e.key)
    }

    /// The fixed-size record for call number `seq`.
    pub(crate) fn record(&self, seq: u64) -> Record {
        let mut op = Hash64::with_capacity(64);
        op.u64(self.store);
        op.bytes(self.op.as_bytes());
        if let Some(note) = &self.note {
            op.bytes(note.as_bytes());
        }
        if let Some(tag) = &self.tag {
            op.u64(3);
            op.bytes(tag.as_bytes());
        }
        // About 64 bytes an entry: a short key, two dims and the dtype's name, framed.
        let mut all = Hash64::with_capacity(64 * self.entries.len());
        for e in &self.entries {
            match &e.key {
                Key::Int(i) => {
                    all.u64(0);
                    all.u64(*i as u64);
                }
                Key::Str(s) => {
                    all.u64(1);
                    all.bytes(s.as_bytes());
                }
            }
            all.u64(e.dims.len() as u64);
            for &d in &e.dims {
                all.u64(d as u64);
            }
            all.bytes(e.dtype.name().as_bytes());
        }
        if let Some(why) = &self.rejected {
            all.u64(2);
            all.bytes(why.as_bytes());
        }
        [seq, op.digest(), self.entries.len() as u64, all.digest()]
    }

    /// "pull of key 5", "push of keys 3, 5, 7", "push of 12 keys (3, 5, 7, ...)".
    pub fn summary(&self) -> String {
        summary_of(self.op, self.entries.iter().map(|e| &e.key))
    }

    /// The full description for call number `seq`, one line per entry, exchanged on a mismatch.
    pub(crate) fn describe(&self, seq: u64) -> String {
        let op = match self.store {
            0 => self.op.to_owned(),
            n => format!("{} of store #{n}", self.op),
        };
        // Escaped, not blanked: texts that differ only there must still read apart.
        let one_line = |t: &str| {
            t.replace('\\', "\\\\")
                .replace('\n', "\\n")
                .replace('\t', "\\t")
        };
        let mut s = match &self.note {
            Some(note) => format!("{seq}\t{op} ({})", one_line(note)),
            None => format!("{seq}\t{op}"),
        };
        if let Some(tag) = &self.tag {
            let _ = write!(s, " [{}]", one_line(tag));
        }
        if let Some(why) = &self.rejected {
            // A message, shown to the other ranks: its line breaks read as spaces.
            let _ = write!(s, "\n{REJECTED}\t{}", why.replace(['\n', '\t'], " "));
        }
        for e in &self.entries {
            let _ = write!(s, "\n{}\t{:?}\t{}", typed(&e.key), e.dims, e.dtype);
        }
        s
    }
}

/// Compares `fp` for call `seq` across `size` ranks through `all_gather` (words in rank order).
pub(crate) fn check_across(
    fp: &Fingerprint,
    seq: u64,
    size: usize,
    mut all_gather: impl FnMut(&[u64]) -> Result<Vec<u64>>,
) -> Result<()> {
    let mine = fp.record(seq);
    let all = all_gather(&mine)?;
    if all.chunks(mine.len()).all(|r| r == mine) {
        return Ok(());
    }
    let text = fp.describe(seq).into_bytes();
    let lens = all_gather(&[text.len() as u64])?;
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    let words = max.div_ceil(8);
    let mut padded = vec![0u64; words];
    for (i, b) in text.iter().enumerate() {
        padded[i / 8] |= u64::from(*b) << (8 * (i % 8));
    }
    let gathered = all_gather(&padded)?;
    let texts: Vec<String> = (0..size)
        .map(|r| {
            let bytes: Vec<u8> = gathered[r * words..(r + 1) * words]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .take(lens[r] as usize)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .collect();
    Err(mismatch_error(fp.op(), seq, &texts))
}

/// A key as a description names it: a string key in quotes, so that 3 and "3" read apart.
fn typed(key: &Key) -> String {
    match key {
        Key::Int(i) => i.to_string(),
        Key::Str(s) => format!("{s:?}"),
    }
}

/// The first word of the description line that carries a rejection.
const REJECTED: &str = "!rejected";

/// The ranks that rejected their input, with why, from every rank's description.
fn rejections(texts: &[String]) -> Vec<(usize, String)> {
    texts
        .iter()
        .enumerate()
        .filter_map(|(rank, t)| {
            t.lines()
                .find_map(|l| l.strip_prefix(REJECTED)?.strip_prefix('\t'))
                .map(|why| (rank, why.to_owned()))
        })
        .collect()
}

/// The error of call `seq` of `op` from every rank's description (`texts[rank]`):
/// [`Error::RankRejected`] when a rank rejected its input (the world stays usable), else
/// [`Error::Desync`].
pub(crate) fn mismatch_error(op: &'static str, seq: u64, texts: &[String]) -> Error {
    let rejected = rejections(texts);
    if rejected.is_empty() {
        return Error::Desync {
            op,
            seq,
            detail: mismatch_detail(texts),
        };
    }
    let detail = rejected
        .iter()
        .map(|(r, why)| format!("rank {r} rejected its input: {why}"))
        .collect::<Vec<_>>()
        .join("; ");
    Error::RankRejected { op, seq, detail }
}

/// [`Fingerprint::summary`] of a call of `op` with `keys` (only the first few are written out).
pub(crate) fn summary_of<K: std::fmt::Display>(
    op: &str,
    keys: impl ExactSizeIterator<Item = K>,
) -> String {
    let n = keys.len();
    let first: Vec<String> = keys.take(4).map(|k| k.to_string()).collect();
    match n {
        0 => op.to_owned(),
        1 => format!("{op} of key {}", first[0]),
        2..=4 => format!("{op} of keys {}", first.join(", ")),
        n => format!("{op} of {n} keys ({}, ...)", first[..3].join(", ")),
    }
}

/// One rank's description, parsed back; entries are (key, shape, dtype) as text.
#[derive(PartialEq)]
struct Described {
    seq: String,
    op: String,
    entries: Vec<(String, String, String)>,
}

impl Described {
    /// The call in words, as [`Fingerprint::summary`] says it.
    fn summary(&self) -> String {
        summary_of(&self.op, self.entries.iter().map(|e| &e.0))
    }
}

fn parse(text: &str) -> Described {
    let mut lines = text.lines();
    let mut head = lines.next().unwrap_or("").splitn(2, '\t');
    let seq = head.next().unwrap_or("?").to_owned();
    let op = head.next().unwrap_or("?").to_owned();
    let entries = lines
        .map(|l| {
            let mut f = l.splitn(3, '\t');
            let mut next = || f.next().unwrap_or("?").to_owned();
            (next(), next(), next())
        })
        .collect();
    Described { seq, op, entries }
}

/// "rank 1" or "ranks [0, 2]".
pub(crate) fn ranks(r: &[usize]) -> String {
    match r {
        [one] => format!("rank {one}"),
        _ => format!("ranks {r:?}"),
    }
}

/// Where each group of ranks first differs from rank 0's group, alike on every rank.
fn mismatch_detail(texts: &[String]) -> String {
    // Group ranks by identical descriptions, in order of their first rank.
    let mut groups: Vec<(Described, Vec<usize>)> = Vec::new();
    for (rank, t) in texts.iter().enumerate() {
        let d = parse(t);
        match groups.iter_mut().find(|(g, _)| *g == d) {
            Some((_, members)) => members.push(rank),
            None => groups.push((d, vec![rank])),
        }
    }
    let Some(((a, ra), rest)) = groups.split_first() else {
        return "no ranks".to_owned();
    };
    if rest.is_empty() {
        return "the ranks' records differ but their descriptions agree (a hash collision?)"
            .to_owned();
    }
    let parts: Vec<String> = rest
        .iter()
        .map(|(b, rb)| compare(a, &ranks(ra), b, &ranks(rb)))
        .collect();
    parts.join("; ")
}

/// The first difference between two groups' descriptions.
fn compare(a: &Described, ra: &str, b: &Described, rb: &str) -> String {
    if a.seq != b.seq {
        return format!(
            "{ra} at call #{} ({}) but {rb} at call #{} ({}): a rank skipped or added a call",
            a.seq,
            a.summary(),
            b.seq,
            b.summary(),
        );
    }
    if a.op != b.op {
        return format!("{} on {ra}, {} on {rb}", a.summary(), b.summary(),);
    }
    let n = a.entries.len().max(b.entries.len());
    for i in 0..n {
        match (a.entries.get(i), b.entries.get(i)) {
            (Some(x), Some(y)) if x == y => continue,
            (Some(x), Some(y)) if x.0 != y.0 => {
                return format!(
                    "{}, position {i}: key {} on {ra}, key {} on {rb}",
                    a.op, x.0, y.0
                )
            }
            (Some(x), Some(y)) if x.1 != y.1 => {
                return format!(
                    "{}: key {} has shape {} on {ra}, {} on {rb}",
                    a.op, x.0, x.1, y.1
                )
            }
            (Some(x), Some(y)) => {
                return format!(
                    "{}: key {} has dtype {} on {ra}, {} on {rb}",
                    a.op, x.0, x.2, y.2
                )
            }
            (Some(x), None) | (None, Some(x)) => {
                let on = if i < a.entries.len() { ra } else { rb };
                return format!(
                    "{}: {} keys on {ra}, {} on {rb}; the first extra key is {} on {on}",
                    a.op,
                    a.entries.len(),
                    b.entries.len(),
                    x.0
                );
            }
            (None, None) => break,
        }
    }
    format!("{ra} and {rb} describe the call differently")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(key: i32, dims: &[usize]) -> Fingerprint {
        Fingerprint::new("push")
            .entry(3, &[2], DType::F32)
            .entry(key, dims, DType::F32)
    }

    #[test]
    fn records_differ_exactly_when_the_calls_differ() {
        assert_eq!(fp(5, &[2, 3]).record(7), fp(5, &[2, 3]).record(7));
        assert_ne!(fp(5, &[2, 3]).record(7), fp(6, &[2, 3]).record(7));
        assert_ne!(fp(5, &[2, 3]).record(7), fp(5, &[3, 2]).record(7));
        assert_ne!(fp(5, &[2, 3]).record(7), fp(5, &[2, 3]).record(8));
        let f16 = Fingerprint::new("push")
            .entry(3, &[2], DType::F32)
            .entry(5, &[2, 3], DType::F16);
        assert_ne!(fp(5, &[2, 3]).record(7), f16.record(7));
        let str_key = Fingerprint::new("push").entry("3", &[2], DType::F32);
        let int_key = Fingerprint::new("push").entry(3, &[2], DType::F32);
        assert_ne!(str_key.record(1), int_key.record(1));
    }

    #[test]
    fn records_tell_apart_what_a_word_wise_hash_could_blur() {
        let keys = |ks: &[&str]| {
            ks.iter()
                .fold(Fingerprint::new("pull"), |f, k| {
                    f.entry(*k, &[4], DType::F32)
                })
                .record(1)
        };
        // Where one string ends and the next starts; a string that fills whole words.
        assert_ne!(keys(&["ab", "c"]), keys(&["a", "bc"]));
        assert_ne!(keys(&["weights1"]), keys(&["weights1\0"]));
        assert_ne!(keys(&["weights1"]), keys(&["weights2"]));
        // Differences in the high bytes of two neighbouring words, which a multiply-and-fold
        // step lets cancel for about half of all states: 64 prefixes (so, states) each.
        for prefix in 0..64 {
            let a = format!("{prefix:08}aaaaaaaaaaaaaaaa");
            let b = format!("{prefix:08}aaaaaaa!aaa!aaa!");
            assert_ne!(keys(&[&a]), keys(&[&b]), "{a} and {b} hash alike");
            let note = |n: &str| fp(5, &[2]).note(n.to_owned()).record(1);
            assert_ne!(note(&a), note(&b));
        }
        // Dims that differ only in their high bits, or only by moving between entries.
        assert_ne!(fp(5, &[1 << 40]).record(1), fp(5, &[1 << 41]).record(1));
        assert_ne!(fp(5, &[2, 3]).record(1), fp(5, &[2, 3, 1]).record(1));
        // Negative int keys, and the store, the note and the op.
        assert_ne!(fp(-1, &[2]).record(1), fp(1, &[2]).record(1));
        assert_ne!(
            fp(5, &[2]).store(1).record(1),
            fp(5, &[2]).store(2).record(1)
        );
        assert_ne!(fp(5, &[2]).note("sgd").record(1), fp(5, &[2]).record(1));
        assert_ne!(fp(5, &[2]).note("").record(1), fp(5, &[2]).record(1));
        assert_ne!(
            fp(5, &[2]).note("sgd lr 0.1").record(1),
            fp(5, &[2]).note("sgd lr 0.2").record(1)
        );
        let pull = Fingerprint::new("pull")
            .entry(3, &[2], DType::F32)
            .entry(5, &[2], DType::F32);
        assert_ne!(pull.record(1), fp(5, &[2]).record(1));
    }

    #[test]
    fn a_rejection_differs_from_the_call_and_names_its_rank_and_reason() {
        let bad = Fingerprint::rejected("push", "unknown key 7\nfix it");
        assert_ne!(bad.record(3), fp(5, &[2]).record(3));
        assert_ne!(bad.record(3), Fingerprint::new("push").record(3));
        let texts = vec![
            fp(5, &[2]).describe(3),
            bad.describe(3),
            fp(5, &[2]).describe(3),
        ];
        assert_eq!(
            rejections(&texts),
            vec![(1, "unknown key 7 fix it".to_owned())]
        );
        assert!(rejections(&texts[..1]).is_empty());
    }

    #[test]
    fn notes_that_differ_only_in_line_breaks_differ_and_read_apart() {
        let a = Fingerprint::new("agree").note("lr 0.1\nwd 0");
        let b = Fingerprint::new("agree").note("lr 0.1 wd 0");
        assert_ne!(a.record(2), b.record(2));
        let d = mismatch_detail(&[a.describe(2), b.describe(2)]);
        assert!(!d.contains("hash collision"), "{d}");
    }

    #[test]
    fn the_detail_names_the_first_differing_key_and_the_ranks_on_each_side() {
        let texts = vec![
            fp(5, &[2, 3]).describe(7),
            fp(6, &[2, 3]).describe(7),
            fp(5, &[2, 3]).describe(7),
        ];
        let d = mismatch_detail(&texts);
        assert_eq!(
            d,
            "push, position 1: key 5 on ranks [0, 2], key 6 on rank 1"
        );
        let texts = vec![fp(5, &[2, 3]).describe(7), fp(5, &[3, 2]).describe(7)];
        assert_eq!(
            mismatch_detail(&texts),
            "push: key 5 has shape [2, 3] on rank 0, [3, 2] on rank 1"
        );
        let texts = vec![
            fp(5, &[2]).describe(7),
            Fingerprint::new("pull")
                .entry(5, &[2], DType::F32)
                .describe(8),
        ];
        let d = mismatch_detail(&texts);
        assert!(d.contains("rank 0 at call #7 (push of keys 3, 5)"), "{d}");
        assert!(d.contains("rank 1 at call #8 (pull of key 5)"), "{d}");
    }
}

//! The bounds every checkpoint decode reads within: no length or count a file declares sizes
//! anything before it is checked against what is there. A corrupt or crafted file (a header
//! length of 2^63, 10^13 residuals, an index naming 10^13 shards) is then
//! [`Invalid`](super::CheckpointErrorKind::Invalid), never an allocation the file cannot back,
//! which would abort the process (a failed allocation aborts; it does not panic). Every count
//! goes through [`count`], directly or through [`Cursor`]; [`read_header`] is the one reader of
//! the safetensors header that single files and shards share.

use std::borrow::Cow;
use std::ops::Range;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::SafeTensorError;

use super::layout::count_of;
use super::{checksum, not_safetensors, Problem};

/// The largest header a reader accepts (the safetensors crate's own bound).
pub(super) const MAX_HEADER: u64 = 100_000_000;

/// The rule for every count a file declares: `n` items of `each` units (an empty one counts as
/// one) fit in the `present` units there. The count if they do.
pub(super) fn count(n: u64, each: u64, present: u64) -> Option<usize> {
    let need = n.checked_mul(each.max(1))?;
    if need > present {
        return None;
    }
    usize::try_from(n).ok()
}

/// The largest step count a reader accepts: every push adds one, so a corrupt
/// `18446744073709551615` would overflow on the next push; below this, 2^63 more fit.
pub(super) const MAX_STEP: u64 = i64::MAX as u64;

/// A step count from its canonical decimal spelling, if it is one within [`MAX_STEP`].
pub(super) fn step(text: &str) -> Option<u64> {
    count_of(text).filter(|&n| n <= MAX_STEP)
}

/// A count that [`count`] refused: the file declares `n` of `what`, more than `limit`.
pub(super) fn too_many(what: &str, n: u64, limit: &str) -> Problem {
    Problem::invalid(format!(
        "the file declares {n} {what}, more than {limit}: it is corrupt, or was not written by \
         kvstore; restore it from a copy, or save again"
    ))
}

/// A reader's place in a file of known length: it hands out only what fits after it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Cursor {
    at: u64,
    end: u64,
}

impl Cursor {
    /// At the start of a run of `len` bytes.
    pub(super) fn new(len: u64) -> Cursor {
        Cursor { at: 0, end: len }
    }

    /// The number of bytes after the cursor.
    pub(super) fn remaining(&self) -> u64 {
        self.end - self.at
    }

    /// The range of the next `n` bytes (`what`, in errors), moving past them.
    pub(super) fn take(&mut self, n: u64, what: &str) -> Result<Range<u64>, Problem> {
        if n > self.remaining() {
            return Err(Problem::invalid(format!(
                "{what} needs {n} bytes, but the file has {} after it: it is truncated or \
                 corrupt; restore it from a copy, or save again",
                self.remaining()
            )));
        }
        let range = self.at..self.at + n;
        self.at += n;
        Ok(range)
    }

    /// A count of `n` items of `size` bytes each, checked by [`count`] against what is left.
    pub(super) fn count(&self, n: u64, size: u64, what: &str) -> Result<usize, Problem> {
        count(n, size, self.remaining()).ok_or_else(|| {
            let limit = format!("the {} bytes after it can hold", self.remaining());
            too_many(what, n, &limit)
        })
    }
}

/// A checkpoint file's safetensors header, checked: the tensors end where the file does.
pub(super) struct Header {
    /// The parsed header: the metadata and every tensor's dtype, shape and offsets.
    pub meta: Metadata,
    /// Where the data section starts; tensors' offsets count from here.
    pub data_start: u64,
    /// Whether the header's checksum entry was there (it matched: a mismatch is an error).
    pub sealed: bool,
    /// The CRC-32 of the header's bytes (the length and the JSON): it tells two files apart,
    /// and, where the header holds its tensors' checksums, their data too.
    pub crc: u32,
}

impl Header {
    /// The byte range of a tensor in the file.
    pub(super) fn span(&self, info: &TensorInfo) -> Range<u64> {
        let (s, e) = info.data_offsets;
        self.data_start + s as u64..self.data_start + e as u64
    }
}

/// Reads the header of a file of `len` bytes through `read` (a range's bytes), checking its
/// length before anything is read by it, its checksum (if there) before anything in it is
/// believed, and the tensors' extent: a truncated or extended file is an error here.
pub(super) fn read_header<'a>(
    len: u64,
    mut read: impl FnMut(Range<u64>) -> Result<Cow<'a, [u8]>, Problem>,
) -> Result<Header, Problem> {
    // What is wrong, with the safetensors error that says it in its terms as the source.
    let unparsable = |p: Problem, e: SafeTensorError| not_safetensors(e).with_message(p.message);
    let mut file = Cursor::new(len);
    let prefix = (file.take(8, "the header's length"))
        .map_err(|p| unparsable(p, SafeTensorError::HeaderTooSmall))?;
    let n = u64::from_le_bytes(read(prefix)?.as_ref().try_into().map_err(|_| {
        Problem::invalid("the header's length could not be read: the file is corrupt")
    })?);
    if n > MAX_HEADER {
        let limit = format!("the {MAX_HEADER} bytes a header may have");
        let p = too_many("bytes of header", n, &limit);
        return Err(unparsable(p, SafeTensorError::HeaderTooLarge));
    }
    let body = (file.take(n, "the header"))
        .map_err(|p| unparsable(p, SafeTensorError::InvalidHeaderLength))?;
    let header = read(0..body.end)?;
    let sealed = checksum::verify_header(&header)?;
    let meta: Metadata = serde_json::from_slice(&header[8..])
        .map_err(|e| not_safetensors(SafeTensorError::InvalidHeaderDeserialization(e)))?;
    // The furthest tensor end, not the last tensor's, so that every tensor lies in the file.
    let data_len = (meta.tensors().values())
        .map(|info| info.data_offsets.1 as u64)
        .max()
        .unwrap_or(0);
    if data_len != file.remaining() {
        let p = Problem::invalid(format!(
            "the header's tensors end {data_len} bytes after it, but the file has {}: it is \
             truncated or corrupt; restore it from a copy, or save again",
            file.remaining()
        ));
        return Err(unparsable(p, SafeTensorError::MetadataIncompleteBuffer));
    }
    Ok(Header {
        meta,
        data_start: body.end,
        sealed,
        crc: crc32fast::hash(&header),
    })
}

/// The state buffer names of a `state_names` entry: comma-separated, and distinct (repeated
/// names would read one tensor again and again, allocating far more than the file holds).
pub(super) fn state_names(text: &str) -> Result<Vec<String>, Problem> {
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let names: Vec<String> = text.split(',').map(str::to_owned).collect();
    let mut seen = std::collections::HashSet::with_capacity(names.len());
    if let Some(twice) = names.iter().find(|n| !seen.insert(n.as_str())) {
        return Err(Problem::invalid(format!(
            "metadata state_names '{text}' names '{twice}' twice: the file is corrupt; restore \
             it from a copy, or save again"
        )));
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_fit_in_what_is_there() {
        assert_eq!(count(3, 4, 12), Some(3));
        assert_eq!(count(4, 4, 12), None);
        assert_eq!(count(10_000_000_000_000, 1, 70), None);
        assert_eq!(count(u64::MAX, 2, u64::MAX), None);
        // Items of no bytes are bounded as if of one.
        assert_eq!(count(13, 0, 12), None);
        assert_eq!(count(0, 8, 0), Some(0));
    }

    #[test]
    fn a_cursor_hands_out_only_what_remains() {
        let mut c = Cursor::new(10);
        assert_eq!(c.take(8, "x").ok(), Some(0..8));
        assert!(c.take(3, "x").is_err());
        assert_eq!(c.take(2, "x").ok(), Some(8..10));
        assert_eq!(c.remaining(), 0);
        assert!(c.count(1, 1, "x").is_err());
        assert_eq!(c.count(0, 1, "x").ok(), Some(0));
    }

    #[test]
    fn a_huge_header_length_is_refused_before_it_is_read() {
        let mut bytes = u64::MAX.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        let mut asked = Vec::new();
        let read = |r: Range<u64>| {
            asked.push(r.clone());
            Ok(Cow::Owned(bytes[r.start as usize..r.end as usize].to_vec()))
        };
        assert!(read_header(bytes.len() as u64, read).is_err());
        assert_eq!(asked, vec![0..8]);
    }

    #[test]
    fn step_counts_leave_room_for_more_pushes() {
        assert_eq!(step("0"), Some(0));
        assert_eq!(step("9223372036854775807"), Some(MAX_STEP));
        assert_eq!(step("9223372036854775808"), None);
        assert_eq!(step("18446744073709551615"), None);
        assert_eq!(step("07"), None);
        assert_eq!(step("+7"), None);
    }

    #[test]
    fn state_names_are_distinct() {
        assert_eq!(state_names("").ok(), Some(vec![]));
        assert_eq!(
            state_names("mean,var").ok(),
            Some(vec!["mean".into(), "var".into()])
        );
        assert!(state_names("mean,mean").is_err());
    }
}

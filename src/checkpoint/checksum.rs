//! Checksums of checkpoint files: a CRC-32 of the header, and of every tensor's data chunk by
//! chunk, so that a file read by range is verified as it is read. See the
//! [module docs](super#checksums) for the entries.

use std::collections::HashMap;

use safetensors::tensor::Metadata;

use super::{layout, Problem};

/// The metadata entry that holds the header's checksum.
pub(super) const HEADER_ENTRY: &str = "header_crc32";

/// The metadata entry that holds the chunk size, in bytes, of the tensors' checksums.
pub(super) const CHUNK_ENTRY: &str = "crc32_chunk";

/// The prefix of the metadata entries that hold the checksums of a tensor: `crc32/<tensor>`.
pub(super) const TENSOR_PREFIX: &str = "crc32/";

/// The name of an index's last line: `crc32 <8 hex digits>`, of every byte before that line.
pub(super) const INDEX_ENTRY: &str = "crc32";

/// The chunk size written: a read by range reads at most 1 MiB more than it asked for at each
/// end, and the checksums take 9 bytes per MiB of data.
const CHUNK: usize = 1 << 20;

/// The largest chunk size a reader accepts, which bounds the buffer a read by range needs.
const MAX_CHUNK: usize = 1 << 30;

/// The value the header's checksum entry holds while the checksum is computed.
const PLACEHOLDER: &str = "00000000";

#[cfg(test)]
thread_local! {
    /// Test hook: the chunk size the writes of this thread use instead of [`CHUNK`].
    pub(super) static TEST_CHUNK: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

/// The chunk size of the checksums this thread writes.
fn chunk_size() -> usize {
    #[cfg(test)]
    if let Some(chunk) = TEST_CHUNK.with(std::cell::Cell::get) {
        return chunk;
    }
    CHUNK
}

/// The CRC-32 (IEEE 802.3, as zlib computes it) of `bytes`.
fn crc(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// A checksum as files spell it: 8 lowercase hex digits.
fn crc_text(crc: u32) -> String {
    format!("{crc:08x}")
}

/// A checksum from its spelling, which must be canonical (8 lowercase hex digits).
fn parse_crc(text: &str) -> Option<u32> {
    u32::from_str_radix(text, 16)
        .ok()
        .filter(|&c| crc_text(c) == text)
}

/// Adds to `meta` the checksum entries of a file about to be serialized: the chunk size, the
/// checksums of `tensors` (name and data) and a placeholder for the header's, filled by [`seal`].
pub(super) fn add_entries<'a>(
    meta: &mut HashMap<String, String>,
    tensors: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) {
    let chunk = chunk_size();
    meta.insert(CHUNK_ENTRY.into(), chunk.to_string());
    for (name, data) in tensors {
        let sums: Vec<String> = data.chunks(chunk).map(|c| crc_text(crc(c))).collect();
        meta.insert(format!("{TENSOR_PREFIX}{name}"), sums.join(","));
    }
    meta.insert(HEADER_ENTRY.into(), PLACEHOLDER.into());
}

/// Where the 8 digits of the header's checksum lie in `header`, if the entry is there once.
fn header_digits(header: &[u8]) -> Option<usize> {
    let pattern = format!("\"{HEADER_ENTRY}\":\"");
    let pattern = pattern.as_bytes();
    let mut found = header
        .windows(pattern.len())
        .enumerate()
        .filter(|(_, w)| *w == pattern)
        .map(|(i, _)| i + pattern.len());
    let at = found.next()?;
    if found.next().is_some() || header.get(at + PLACEHOLDER.len()) != Some(&b'"') {
        return None;
    }
    Some(at)
}

/// Fills in the header's checksum of the serialized file `bytes` (computed with the placeholder).
pub(super) fn seal(bytes: &mut [u8]) -> Result<(), Problem> {
    let header_end = bytes
        .get(..8)
        .map(|n| 8 + u64::from_le_bytes(n.try_into().unwrap_or([0; 8])) as usize)
        .filter(|&end| end <= bytes.len())
        .ok_or("cannot seal: the serialized file has no header")?;
    let header = &mut bytes[..header_end];
    let at =
        header_digits(header).ok_or("cannot seal: the header checksum entry is not there once")?;
    let sum = crc_text(crc(header));
    header[at..at + PLACEHOLDER.len()].copy_from_slice(sum.as_bytes());
    Ok(())
}

/// Verifies the checksum of `header`: `Ok(true)` when it matches, `Ok(false)` when the entry
/// is not there (format 1, or corrupt: the caller tells which by the format).
pub(super) fn verify_header(header: &[u8]) -> Result<bool, Problem> {
    let Some(at) = header_digits(header) else {
        return Ok(false);
    };
    let digits = &header[at..at + PLACEHOLDER.len()];
    let stored = std::str::from_utf8(digits).ok().and_then(parse_crc);
    let mut zeroed = header.to_vec();
    zeroed[at..at + PLACEHOLDER.len()].copy_from_slice(PLACEHOLDER.as_bytes());
    if stored != Some(crc(&zeroed)) {
        return Err(Problem::invalid(
            "the checksum of the file's header does not match: the file is corrupt (a flipped \
             bit on disk or in a copy?); restore it from a copy, or save again",
        ));
    }
    Ok(true)
}

/// `text`, the lines of an index each ending in a newline, with its checksum line added.
pub(super) fn seal_index(text: &str) -> String {
    format!("{text}{INDEX_ENTRY} {}\n", crc_text(crc(text.as_bytes())))
}

/// Verifies the checksum line that ends an index's `text`: the text before it, if it is there.
pub(super) fn verify_index(text: &str) -> Result<Option<&str>, Problem> {
    let trimmed = text.strip_suffix('\n').unwrap_or(text);
    let (body, last) = match trimmed.rfind('\n') {
        Some(at) => trimmed.split_at(at + 1),
        None => ("", trimmed),
    };
    let Some(digits) = last
        .strip_prefix(INDEX_ENTRY)
        .and_then(|d| d.strip_prefix(' '))
    else {
        return Ok(None);
    };
    if parse_crc(digits) != Some(crc(body.as_bytes())) {
        return Err(Problem::invalid(
            "the checksum of the index does not match: the index is corrupt (a flipped bit on \
             disk or in a copy?); restore it from a copy, or save again",
        ));
    }
    Ok(Some(body))
}

/// The checksum entries of a file, parsed and checked against its tensors.
#[derive(Clone, Debug)]
pub(super) struct Sums {
    /// The chunk size, in bytes.
    pub chunk: usize,
    /// Every tensor's checksums, one per chunk of its data, by tensor name.
    pub tensors: HashMap<String, Vec<u32>>,
}

/// Parses the checksum entries of metadata `md` for `tensors` (name and length in bytes).
pub(super) fn parse_sums(
    md: &HashMap<String, String>,
    tensors: impl IntoIterator<Item = (String, usize)>,
) -> Result<Sums, Problem> {
    let text = layout::entry(md, CHUNK_ENTRY)?;
    let chunk = (layout::count_of(text))
        .filter(|c| (1..=MAX_CHUNK).contains(c))
        .ok_or_else(|| {
            Problem::invalid(format!(
                "metadata {CHUNK_ENTRY} = '{text}' is not a chunk size from 1 to {MAX_CHUNK}"
            ))
        })?;
    let mut sums = HashMap::new();
    for (name, len) in tensors {
        let entry = format!("{TENSOR_PREFIX}{name}");
        let list = match layout::entry(md, &entry)? {
            "" => Vec::new(),
            text => text
                .split(',')
                .map(parse_crc)
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    Problem::invalid(format!(
                        "metadata {entry} is not a list of 8-digit lowercase hex checksums"
                    ))
                })?,
        };
        if list.len() != len.div_ceil(chunk) {
            return Err(Problem::invalid(format!(
                "metadata {entry} holds {} checksums, but tensor '{name}' has {len} bytes, {} \
                 chunks of {chunk}",
                list.len(),
                len.div_ceil(chunk)
            )));
        }
        sums.insert(name, list);
    }
    if let Some(stray) = md.keys().find(|k| {
        k.strip_prefix(TENSOR_PREFIX)
            .is_some_and(|t| !sums.contains_key(t))
    }) {
        return Err(Problem::invalid(format!(
            "metadata entry '{stray}' belongs to no tensor of the file"
        )));
    }
    Ok(Sums {
        chunk,
        tensors: sums,
    })
}

/// The checksums of a file of `tensors` and metadata `md` by its `format`: `Some` for one of
/// `sealed` (whose header's checksum must have been there); `None` for `bare`, format 1, which
/// must have no checksum entries and none of `bare_lacks`. `what` names the file.
pub(super) fn format_sums(
    (tensors, sealed_header): (&Metadata, bool),
    md: &HashMap<String, String>,
    format: &str,
    (sealed, bare): (&[&str], &str),
    bare_lacks: &[&str],
    what: &str,
) -> Result<Option<Sums>, Problem> {
    let corrupt = format!("the {what} is corrupt; restore it from a copy, or save again");
    if sealed.contains(&format) {
        if !sealed_header {
            return Err(Problem::invalid(format!(
                "metadata entry '{HEADER_ENTRY}' (the header's checksum) is missing: {corrupt}"
            )));
        }
        let lens = (tensors.tensors().into_iter()).map(|(name, info)| {
            let (start, end) = info.data_offsets;
            (name, end.saturating_sub(start))
        });
        return parse_sums(md, lens).map(Some);
    }
    let marked = md.keys().any(|k| {
        k == HEADER_ENTRY
            || k == CHUNK_ENTRY
            || k.starts_with(TENSOR_PREFIX)
            || bare_lacks.contains(&k.as_str())
    });
    match format {
        _ if format != bare => Err(Problem::invalid(format!(
            "metadata format is '{format}', expected one of {sealed:?} or '{bare}': it was not \
             written by a save of this or an earlier version"
        ))),
        _ if marked => Err(Problem::invalid(format!(
            "a {what} of format 1 with checksum entries or a token: {corrupt}"
        ))),
        _ => Ok(None),
    }
}

/// Verifies `data`, whole chunks of tensor `name` from its byte `from` on, against `sums`.
pub(super) fn verify_chunks(
    name: &str,
    data: &[u8],
    from: usize,
    sums: &[u32],
    chunk: usize,
) -> Result<(), Problem> {
    debug_assert_eq!(from % chunk, 0);
    let first = from / chunk;
    for (i, piece) in data.chunks(chunk).enumerate() {
        let at = first + i;
        if sums.get(at) != Some(&crc(piece)) {
            let start = at * chunk;
            return Err(Problem::invalid(format!(
                "the checksum of tensor '{name}' (its bytes {start}..{}) does not match: the \
                 file is corrupt (a flipped bit on disk or in a copy?); restore it from a copy, \
                 or save again",
                start + piece.len()
            )));
        }
    }
    Ok(())
}

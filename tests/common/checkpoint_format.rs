//! The checksums of the checkpoint format, written here from `kvstore::checkpoint`'s module docs
//! (not from its code), so that tests can write and alter checkpoint files by hand. Included by
//! the checkpoint tests with `#[path]`.
#![allow(dead_code)]

use std::collections::HashMap;

use safetensors::tensor::{Dtype, TensorView};

/// The chunk size of the checksums that tests write: small, so that tensors span many chunks.
pub(crate) const CHUNK: usize = 16;

/// One tensor to write: name, dtype, shape, data.
pub(crate) type Tensor<'a> = (&'a str, Dtype, &'a [usize], &'a [u8]);

/// The checksum entries' prefix, chunk entry and header entry.
const PREFIX: &str = "crc32/";
const CHUNK_ENTRY: &str = "crc32_chunk";
const HEADER_ENTRY: &str = "header_crc32";

/// `meta` with its checksum entries (any there are dropped) made afresh for `tensors`: the
/// chunk size, every tensor's chunk checksums, and the header's checksum as `00000000`.
pub(crate) fn with_checksums(
    tensors: &[Tensor],
    mut meta: HashMap<String, String>,
) -> HashMap<String, String> {
    meta.retain(|k, _| k != HEADER_ENTRY && k != CHUNK_ENTRY && !k.starts_with(PREFIX));
    meta.insert(CHUNK_ENTRY.into(), CHUNK.to_string());
    for (name, _, _, data) in tensors {
        let sums: Vec<String> = data
            .chunks(CHUNK)
            .map(|c| format!("{:08x}", crc32fast::hash(c)))
            .collect();
        meta.insert(format!("{PREFIX}{name}"), sums.join(","));
    }
    meta.insert(HEADER_ENTRY.into(), "00000000".into());
    meta
}

/// The safetensors file of `tensors` and `meta`, with fresh checksum entries: a file that
/// passes every checksum.
pub(crate) fn sealed(tensors: &[Tensor], meta: HashMap<String, String>) -> Vec<u8> {
    let meta = with_checksums(tensors, meta);
    with_header_checksum(tensors, meta)
}

/// The safetensors file of `tensors` and `meta` as they are, with the header's checksum filled
/// in where `meta` holds it as `00000000` (the CRC-32 of the 8-byte length and the JSON header,
/// padding included, as written with the placeholder).
pub(crate) fn with_header_checksum(tensors: &[Tensor], meta: HashMap<String, String>) -> Vec<u8> {
    let mut bytes = plain(tensors, meta);
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let pattern = format!("\"{HEADER_ENTRY}\":\"00000000\"");
    let at = bytes[..header]
        .windows(pattern.len())
        .position(|w| w == pattern.as_bytes())
        .expect("the header checksum placeholder")
        + pattern.len()
        - 9;
    let crc = crc32fast::hash(&bytes[..header]);
    bytes[at..at + 8].copy_from_slice(format!("{crc:08x}").as_bytes());
    bytes
}

/// The safetensors file of `tensors` and `meta` as they are: no checksum filled in.
pub(crate) fn plain(tensors: &[Tensor], meta: HashMap<String, String>) -> Vec<u8> {
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.to_vec(), b).unwrap()))
        .collect();
    safetensors::serialize(views, Some(meta)).unwrap()
}

//! The single-file format that earlier versions' [`KvStore::save`](crate::KvStore::save) wrote
//! for stores of one process: one safetensors file holding every key whole. Read as a world of
//! one shard by [`super::reader`]; written only by a test hook, for tests of old files. See the
//! [module docs](super) for its layout.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use safetensors::tensor::TensorView;

use super::atomic::write_atomic;
use super::bounded;
use super::checksum::{self, Sums};
use super::entry::Entry;
use super::held::{Held, Saved, ShardHeader, Tensors};
use super::layout::{acc_dtype, entries_under, entry, st_dtype, KeyMeta};
use super::{Problem, FORMAT, FORMAT_1};
use crate::host::to_le_bytes;
use crate::{DType, Error, Key, KeyKind, Shape, Updater};

/// The spelling of a `key_kind` entry.
pub(super) fn kind_name(kind: Option<KeyKind>) -> &'static str {
    match kind {
        Some(KeyKind::Int) => "int",
        Some(KeyKind::Str) => "str",
        None => "none",
    }
}

/// Writes `entries` (in update order) to `path` as a single file of format 2, atomically.
pub(crate) fn write_single_file(
    path: &std::path::Path,
    kind: Option<KeyKind>,
    updater: &Updater,
    entries: &[Entry],
) -> Result<(), Error> {
    let bytes = encode(kind, updater, entries).map_err(|p| p.at(path))?;
    write_atomic(path, &bytes).map_err(|e| Problem::io(false, e).at(path))
}

/// One tensor to write: its name, dtype, shape and little-endian bytes.
pub(super) struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// The safetensors bytes of `tensors` and metadata `meta`, with every checksum added.
pub(super) fn serialize_sealed(
    mut meta: HashMap<String, String>,
    tensors: &[Tensor],
) -> std::result::Result<Vec<u8>, Problem> {
    let named = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.bytes.as_slice()));
    checksum::add_entries(&mut meta, named);
    let views = (tensors.iter())
        .map(|t| {
            TensorView::new(st_dtype(t.dtype), t.shape.clone(), &t.bytes)
                .map(|v| (t.name.as_str(), v))
                .map_err(|e| Problem::invalid(format!("cannot serialize tensor {}: {e}", t.name)))
        })
        .collect::<std::result::Result<Vec<_>, Problem>>()?;
    let mut bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| Problem::invalid(format!("cannot serialize: {e}")))?;
    checksum::seal(&mut bytes)?;
    Ok(bytes)
}

/// The safetensors bytes of a store's entries, as a single file.
pub(super) fn encode(
    kind: Option<KeyKind>,
    updater: &Updater,
    entries: &[Entry],
) -> std::result::Result<Vec<u8>, Problem> {
    let names = updater.state_names();
    let mut meta: HashMap<String, String> = HashMap::from([
        ("format".into(), FORMAT.into()),
        ("key_kind".into(), kind_name(kind).into()),
        ("keys".into(), entries.len().to_string()),
        ("updater".into(), updater.name().into()),
        ("state_names".into(), names.join(",")),
    ]);
    let mut tensors: Vec<Tensor> = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        meta.insert(format!("order/{}", e.key), i.to_string());
        let tensor = |name: String, data: &crate::HostData| Tensor {
            name,
            dtype: data.dtype(),
            shape: e.shape.dims().to_vec(),
            bytes: to_le_bytes(data),
        };
        tensors.push(tensor(format!("value/{}", e.key), &e.value));
        if e.row_sparse {
            meta.insert(format!("row_sparse/{}", e.key), "1".into());
        }
        if !e.residuals.is_empty() {
            let count = e.residuals.len().to_string();
            meta.insert(format!("residuals/{}", e.key), count);
            for (i, r) in e.residuals.iter().enumerate() {
                // A position never pushed keeps no residual: written as zeros.
                let r = match r.len() == e.shape.size() {
                    true => crate::HostData::F32(r.clone()),
                    false => crate::HostData::filled(DType::F32, e.shape.size(), 0.0),
                };
                tensors.push(tensor(format!("residual/{}/{i}", e.key), &r));
            }
        }
        // The store exports only state of the updater in force, one buffer per name.
        if let Some(state) = e.state.as_ref().filter(|s| s.bufs.len() == names.len()) {
            meta.insert(format!("step/{}", e.key), state.step.to_string());
            for (name, buf) in names.iter().zip(&state.bufs) {
                tensors.push(tensor(format!("state/{}/{name}", e.key), buf));
            }
        }
    }
    serialize_sealed(meta, &tensors)
}

/// Checks a whole single file, `bytes`, every tensor's data included; it reads as shard 0 of
/// one, with no token, that holds every key whole.
pub(super) fn check_file(bytes: &[u8]) -> std::result::Result<ShardHeader, Problem> {
    let header = bounded::read_header(bytes.len() as u64, |r| Ok(Cow::Borrowed(slice(bytes, r)?)))?;
    let meta = header
        .meta
        .metadata()
        .as_ref()
        .ok_or("the file has no metadata: it was not written by KvStore::save")?;
    let get = |name: &str| entry(meta, name);
    let sums = verified_sums(get("format")?, &header, meta, bytes)?;
    let kind = parse_kind(get("key_kind")?)?;
    let keys = keys_in_order(meta, kind, get("keys")?)?;
    let updater = get("updater")?.to_owned();
    let state_names = bounded::state_names(get("state_names")?)?;
    let mut tensors = Tensors::new(&header, sums.as_ref());
    let (mut pieces, mut residuals) = (Vec::with_capacity(keys.len()), Vec::new());
    for (order, key) in keys.into_iter().enumerate() {
        let (piece, saved) = check_key(&mut tensors, meta, key, order, &state_names)?;
        pieces.push(piece);
        residuals.extend(saved);
    }
    tensors.all_claimed("key")?;
    Ok(ShardHeader {
        rank: 0,
        header_crc: header.crc,
        token: None,
        chunk: sums.map(|s| s.chunk),
        kind,
        updater,
        state_names,
        pieces,
        residuals,
    })
}

/// The bytes `range` of `bytes`; a range outside them is an error, not a panic.
fn slice(bytes: &[u8], range: std::ops::Range<u64>) -> std::result::Result<&[u8], Problem> {
    usize::try_from(range.start)
        .ok()
        .zip(usize::try_from(range.end).ok())
        .and_then(|(s, e)| bytes.get(s..e))
        .ok_or_else(|| Problem::invalid("a range beyond the file's end: the file is corrupt"))
}

/// The checksums of a file of `format` (`None` for format 1), every tensor verified.
fn verified_sums(
    format: &str,
    header: &bounded::Header,
    meta: &HashMap<String, String>,
    bytes: &[u8],
) -> std::result::Result<Option<Sums>, Problem> {
    let sums = checksum::format_sums(
        (&header.meta, header.sealed),
        meta,
        format,
        (&[FORMAT], FORMAT_1),
        &[],
        "file",
    )?;
    if let Some(sums) = &sums {
        for (name, info) in header.meta.tensors() {
            let list = sums.tensors.get(&name).map_or(&[][..], Vec::as_slice);
            let data = slice(bytes, header.span(info))?;
            checksum::verify_chunks(&name, data, 0, list, sums.chunk)?;
        }
    }
    Ok(sums)
}

/// The key kind of a `key_kind` metadata entry: `None` for a file with no keys.
pub(super) fn parse_kind(text: &str) -> std::result::Result<Option<KeyKind>, Problem> {
    match text {
        "int" => Ok(Some(KeyKind::Int)),
        "str" => Ok(Some(KeyKind::Str)),
        "none" => Ok(None),
        other => Err(format!("metadata key_kind '{other}' is not int, str or none").into()),
    }
}

/// The keys of a single file in update order, distinct, with no entry naming another key.
fn keys_in_order(
    meta: &HashMap<String, String>,
    kind: Option<KeyKind>,
    count_text: &str,
) -> std::result::Result<Vec<Key>, Problem> {
    let count = count_text
        .parse::<u64>()
        .ok()
        // Each key has an `order/` entry: a larger count cannot be right.
        .and_then(|n| bounded::count(n, 1, meta.len() as u64))
        .ok_or_else(|| {
            format!(
                "metadata keys '{count_text}' is not a plausible key count (the header has {} \
                 entries, one per key at least): the file is corrupt; restore it from a copy, \
                 or save again",
                meta.len()
            )
        })?;
    // Each key is spelled one way only (its canonical form), so no two entries name one key.
    let mut ordered: Vec<Option<Key>> = vec![None; count];
    for (name, text, value) in entries_under(meta, "order/") {
        let key = parse_key(kind, text)?;
        let slot = value
            .parse::<usize>()
            .ok()
            .and_then(|i| ordered.get_mut(i))
            .ok_or_else(|| format!("metadata {name} = '{value}' is not below keys = {count}"))?;
        if slot.replace(key).is_some() {
            return Err(format!("metadata {name}: two keys share place {value}").into());
        }
    }
    let keys: Vec<Key> = ordered
        .into_iter()
        .collect::<Option<_>>()
        .ok_or_else(|| format!("metadata lists fewer than keys = {count} order entries"))?;
    // Checked again: a duplicate would make the load lock one key twice.
    let mut seen: HashSet<&Key> = HashSet::with_capacity(keys.len());
    if let Some(k) = keys.iter().find(|k| !seen.insert(*k)) {
        return Err(format!("metadata lists key {k} twice").into());
    }
    let spelled: HashSet<String> = keys.iter().map(Key::to_string).collect();
    if let Some(name) = meta.keys().find(|name| {
        ["step/", "row_sparse/", "residuals/"]
            .iter()
            .filter_map(|p| name.strip_prefix(p))
            .any(|k| !spelled.contains(k))
    }) {
        return Err(format!("metadata entry '{name}' belongs to no key in the metadata").into());
    }
    Ok(keys)
}

/// Key `key`, the `order`-th, of a single file: its piece and residuals, checked.
fn check_key(
    tensors: &mut Tensors<'_>,
    meta: &HashMap<String, String>,
    key: Key,
    order: usize,
    state_names: &[String],
) -> std::result::Result<(Held, Option<Saved>), Problem> {
    let name = format!("value/{key}");
    let info =
        (tensors.header.meta.info(&name)).ok_or_else(|| format!("tensor '{name}' is missing"))?;
    let shape = Shape::new(&info.shape).map_err(|e| format!("tensor '{name}': {e}"))?;
    let dims = shape.dims();
    let (dtype, value) = tensors.claim(name, None, dims)?;
    let step = (meta.get(&format!("step/{key}"))).map(|step| {
        bounded::step(step).ok_or_else(|| {
            let max = bounded::MAX_STEP;
            format!("metadata step/{key} = '{step}' is not a count from 0 to {max}")
        })
    });
    let step = step.transpose()?;
    let names = (state_names.iter().filter(|_| step.is_some())).map(|s| format!("state/{key}/{s}"));
    let state = tensors.claim_each(names, acc_dtype(dtype), dims)?;
    let row_sparse = match meta.get(&format!("row_sparse/{key}")).map(String::as_str) {
        None => false,
        Some("1") if shape.ndim() >= 2 => true,
        Some("1") => {
            return Err(format!(
                "metadata row_sparse/{key} marks a key of shape {shape} row-sparse, but a \
                 row-sparse key has two or more dimensions"
            )
            .into())
        }
        Some(other) => return Err(format!("metadata row_sparse/{key} = '{other}' is not 1").into()),
    };
    let residuals = match meta.get(&format!("residuals/{key}")) {
        None => None,
        Some(text) => {
            // One tensor each: a count above the file's tensors cannot be right.
            let present = tensors.header.meta.tensors().len() as u64;
            let count = (text.parse::<u64>().ok())
                .and_then(|n| bounded::count(n, 1, present))
                .ok_or_else(|| {
                    format!(
                        "metadata residuals/{key} = '{text}' is not a count of the file's \
                         {present} tensors: the file is corrupt; restore it from a copy, or \
                         save again"
                    )
                })?;
            let names = (0..count).map(|i| format!("residual/{key}/{i}"));
            let spans = tensors.claim_each(names, DType::F32, dims)?;
            Some((key.clone(), shape.size(), spans))
        }
    };
    let piece = Held {
        meta: KeyMeta {
            key,
            dims: dims.to_vec(),
            dtype,
            order,
            step: step.unwrap_or(0),
            has_state: step.is_some(),
            row_sparse,
        },
        range: 0..shape.size(),
        file: 0,
        value,
        state,
    };
    Ok((piece, residuals))
}

/// A key from its spelling in the file; an int key's must be canonical.
pub(super) fn parse_key(kind: Option<KeyKind>, text: &str) -> std::result::Result<Key, Problem> {
    match kind {
        Some(KeyKind::Int) => text
            .parse::<i32>()
            .ok()
            .filter(|k| k.to_string() == text)
            .map(Key::Int)
            .ok_or_else(|| {
                format!(
                    "key '{text}' is not an int key in canonical form (as KvStore::save writes \
                     it: decimal, no '+', no leading zeros or spaces)"
                )
                .into()
            }),
        Some(KeyKind::Str) => Ok(Key::Str(text.to_owned())),
        None => Err(format!("key '{text}' in a file whose key_kind is none").into()),
    }
}

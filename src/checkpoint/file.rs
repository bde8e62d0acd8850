//! The single-file format that [`KvStore::save`](crate::KvStore::save) writes: one safetensors
//! file holding every key whole. See the [module docs](super) for its layout.

use std::collections::{HashMap, HashSet};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::checksum::{self, Sums};
use super::{not_safetensors, Problem, FORMAT, FORMAT_1};
use crate::store::{Entry, EntryState};
use crate::{DType, Key, KeyKind, Shape, Updater};

/// `Dtype` of the safetensors format for a dtype.
pub(super) fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
    }
}

/// The dtype updater state is kept in for values of `dtype`.
pub(super) fn acc_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

pub(super) fn kind_name(kind: Option<KeyKind>) -> &'static str {
    match kind {
        Some(KeyKind::Int) => "int",
        Some(KeyKind::Str) => "str",
        None => "none",
    }
}

/// Little-endian bytes of host elements.
pub(super) fn to_bytes(data: &crate::HostData) -> Vec<u8> {
    use crate::HostData as H;
    match data {
        H::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        H::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        H::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        H::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Host elements of `dtype` from little-endian bytes; the length is checked by the caller.
pub(super) fn from_bytes(dtype: DType, b: &[u8]) -> crate::HostData {
    use crate::HostData as H;
    match dtype {
        DType::F32 => H::F32(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        DType::F64 => H::F64(
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        ),
        DType::F16 => H::F16(
            b.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        DType::BF16 => H::BF16(
            b.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
    }
}

/// The safetensors bytes of a store's entries.
pub(super) fn encode(
    kind: Option<KeyKind>,
    updater: &Updater,
    entries: &[Entry],
) -> std::result::Result<Vec<u8>, Problem> {
    let names = updater.state_names();
    let mut meta: HashMap<String, String> = HashMap::new();
    meta.insert("format".into(), FORMAT.into());
    meta.insert("key_kind".into(), kind_name(kind).into());
    meta.insert("keys".into(), entries.len().to_string());
    meta.insert("updater".into(), updater.name().into());
    meta.insert("state_names".into(), names.join(","));

    // (name, dtype, shape, bytes) of every tensor.
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        meta.insert(format!("order/{}", e.key), i.to_string());
        let dims = e.shape.dims().to_vec();
        tensors.push((
            format!("value/{}", e.key),
            st_dtype(e.value.dtype()),
            dims.clone(),
            to_bytes(&e.value),
        ));
        if e.row_sparse {
            meta.insert(format!("row_sparse/{}", e.key), "1".into());
        }
        if !e.residuals.is_empty() {
            meta.insert(
                format!("residuals/{}", e.key),
                e.residuals.len().to_string(),
            );
            for (i, r) in e.residuals.iter().enumerate() {
                // A position never pushed keeps no residual: written as zeros.
                let r = match r.len() == e.shape.size() {
                    true => crate::HostData::F32(r.clone()),
                    false => crate::HostData::filled(crate::DType::F32, e.shape.size(), 0.0),
                };
                tensors.push((
                    format!("residual/{}/{i}", e.key),
                    st_dtype(r.dtype()),
                    dims.clone(),
                    to_bytes(&r),
                ));
            }
        }
        // The store exports only state of the updater in force, one buffer per name.
        if let Some(state) = e.state.as_ref().filter(|s| s.bufs.len() == names.len()) {
            meta.insert(format!("step/{}", e.key), state.step.to_string());
            for (name, buf) in names.iter().zip(&state.bufs) {
                tensors.push((
                    format!("state/{}/{name}", e.key),
                    st_dtype(buf.dtype()),
                    dims.clone(),
                    to_bytes(buf),
                ));
            }
        }
    }
    checksum::add_entries(
        &mut meta,
        tensors
            .iter()
            .map(|(n, _, _, b)| (n.as_str(), b.as_slice())),
    );
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| format!("cannot serialize tensor {name}: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    let mut bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| Problem::from(format!("cannot serialize: {e}")))?;
    checksum::seal(&mut bytes)?;
    Ok(bytes)
}

/// A whole single-file checkpoint, parsed and checked, with every key's state whatever the
/// updater.
pub(super) struct Decoded {
    /// The key kind (`None` for an empty store).
    pub kind: Option<KeyKind>,
    /// The name of the updater it was saved under.
    pub updater: String,
    /// That updater's state buffer names.
    pub state_names: Vec<String>,
    /// Every key, in update order.
    pub entries: Vec<Entry>,
    /// The checksums of its tensors, all verified; `None` for a file of format 1, which has
    /// none.
    pub sums: Option<Sums>,
}

impl Decoded {
    /// Whether the saved state fits `updater`: the same name and state buffers.
    pub(super) fn fits(&self, updater: &Updater) -> bool {
        self.updater == updater.name() && self.state_names.iter().eq(updater.state_names())
    }
}

/// Parses and checks a whole checkpoint. Every key's state is checked whatever the updater,
/// and kept only where it fits `updater` (the same name and state buffers); see
/// [`KvStore::load`](crate::KvStore::load).
/// Also returns whether the file was verified by its checksums (a file of format 1 has none).
pub(super) fn decode(
    bytes: &[u8],
    updater: &Updater,
) -> std::result::Result<(Option<KeyKind>, Vec<Entry>, bool), Problem> {
    let mut decoded = decode_all(bytes)?;
    if !decoded.fits(updater) {
        // State of another updater is checked, then left behind: the key starts afresh, as
        // after set_updater.
        for e in &mut decoded.entries {
            e.state = None;
        }
    }
    Ok((decoded.kind, decoded.entries, decoded.sums.is_some()))
}

/// Parses and checks a whole checkpoint, keeping every key's state. The header's checksum is
/// verified before anything in the header is believed, and every tensor's data before any is
/// read.
pub(super) fn decode_all(bytes: &[u8]) -> std::result::Result<Decoded, Problem> {
    // The header as its length says, when the file is that long; anything else fails below.
    let header_end = bytes
        .get(..8)
        .and_then(|n| usize::try_from(u64::from_le_bytes(n.try_into().ok()?)).ok())
        .and_then(|n| n.checked_add(8))
        .filter(|&end| end <= bytes.len());
    let sealed = match header_end {
        Some(end) => checksum::verify_header(&bytes[..end])?,
        None => false,
    };
    let file = SafeTensors::deserialize(bytes).map_err(not_safetensors)?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(not_safetensors)?;
    let meta = header
        .metadata()
        .as_ref()
        .ok_or("the file has no metadata: it was not written by KvStore::save")?;
    let get = |name: &str| {
        meta.get(name)
            .map(String::as_str)
            .ok_or_else(|| format!("metadata entry '{name}' is missing"))
    };
    let sums = match get("format")? {
        FORMAT if sealed => {
            let tensors = file.tensors();
            let sums = checksum::parse_sums(
                meta,
                tensors.iter().map(|(n, t)| (n.as_str(), t.data().len())),
            )?;
            checksum::verify_all(&sums, tensors.iter().map(|(n, t)| (n.as_str(), t.data())))?;
            Some(sums)
        }
        FORMAT => {
            return Err(format!(
                "metadata entry '{}' (the header's checksum) is missing: the file is corrupt; \
                 restore it from a copy, or save again",
                checksum::HEADER_ENTRY
            )
            .into())
        }
        FORMAT_1 if !checksum::has_entries(meta) => None,
        FORMAT_1 => {
            return Err(
                "a file of format 1 with checksum entries: the file is corrupt; \
                        restore it from a copy, or save again"
                    .into(),
            )
        }
        other => {
            return Err(format!(
                "metadata format is '{other}', expected '{FORMAT}' (or '{FORMAT_1}'): it was \
                 not written by KvStore::save of this or the previous format"
            )
            .into())
        }
    };
    let kind = match get("key_kind")? {
        "int" => Some(KeyKind::Int),
        "str" => Some(KeyKind::Str),
        "none" => None,
        other => return Err(format!("metadata key_kind '{other}' is not int, str or none").into()),
    };
    let count_text = get("keys")?;
    let count: usize = count_text
        .parse()
        .ok()
        // Each key has an `order/` entry, so a larger count cannot be right (and must not
        // size an allocation).
        .filter(|&n| n <= meta.len())
        .ok_or_else(|| format!("metadata keys '{count_text}' is not a plausible key count"))?;

    // Keys in update order, from `order/<key>`. Each key is spelled one way only (its
    // canonical form), so no two entries name one key.
    let mut ordered: Vec<Option<Key>> = vec![None; count];
    for (name, value) in meta {
        let Some(text) = name.strip_prefix("order/") else {
            continue;
        };
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
    // Canonical spellings make every key distinct; checked again, as a duplicate would make
    // the load lock one key twice.
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

    let file_updater = get("updater")?;
    let state_names: Vec<&str> = match get("state_names")? {
        "" => Vec::new(),
        names => names.split(',').collect(),
    };

    let mut used: HashSet<String> = HashSet::new();
    let mut entries = Vec::with_capacity(keys.len());
    for key in keys {
        let name = format!("value/{key}");
        let (shape, value) = read_tensor(&file, &name, None, None)?;
        used.insert(name);
        let state = match meta.get(&format!("step/{key}")) {
            None => None,
            Some(step) => {
                let step: u64 = step
                    .parse()
                    .map_err(|_| format!("metadata step/{key} = '{step}' is not a count"))?;
                let mut bufs = Vec::with_capacity(state_names.len());
                for s in &state_names {
                    let name = format!("state/{key}/{s}");
                    let acc = acc_dtype(value.dtype());
                    let (_, buf) = read_tensor(&file, &name, Some(acc), Some(shape))?;
                    used.insert(name);
                    bufs.push(buf);
                }
                Some(EntryState { step, bufs })
            }
        };
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
            Some(other) => {
                return Err(format!("metadata row_sparse/{key} = '{other}' is not 1").into())
            }
        };
        let mut residuals = Vec::new();
        if let Some(count) = meta.get(&format!("residuals/{key}")) {
            let count: usize = count
                .parse()
                .ok()
                .filter(|&n| n <= file.names().len())
                .ok_or_else(|| format!("metadata residuals/{key} = '{count}' is not a count"))?;
            for i in 0..count {
                let name = format!("residual/{key}/{i}");
                let (_, r) = read_tensor(&file, &name, Some(DType::F32), Some(shape))?;
                used.insert(name);
                residuals.push(r.to_vec::<f32>());
            }
        }
        entries.push(Entry {
            key,
            shape,
            value,
            state,
            row_sparse,
            residuals,
        });
    }
    if let Some(extra) = file.names().into_iter().find(|n| !used.contains(*n)) {
        return Err(format!("tensor '{extra}' belongs to no key in the metadata").into());
    }
    Ok(Decoded {
        kind,
        updater: file_updater.to_owned(),
        state_names: state_names.into_iter().map(str::to_owned).collect(),
        entries,
        sums,
    })
}

/// A key from its spelling in the file. Int keys must be spelled canonically (as `save`
/// writes them: no sign but `-`, no leading zeros, no spaces), so that no two spellings name
/// one key.
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

/// Reads tensor `name`, checking its dtype and shape when given.
fn read_tensor(
    file: &SafeTensors<'_>,
    name: &str,
    dtype: Option<DType>,
    shape: Option<Shape>,
) -> std::result::Result<(Shape, crate::HostData), Problem> {
    let t = file
        .tensor(name)
        .map_err(|_| format!("tensor '{name}' is missing"))?;
    let got = DType::ALL
        .into_iter()
        .find(|&d| st_dtype(d) == t.dtype())
        .ok_or_else(|| format!("tensor '{name}' has unsupported dtype {:?}", t.dtype()))?;
    let got_shape = Shape::new(t.shape()).map_err(|e| format!("tensor '{name}': {e}"))?;
    if let Some(want) = dtype.filter(|&d| d != got) {
        return Err(format!("tensor '{name}' is {got}, expected {want}").into());
    }
    if let Some(want) = shape.filter(|&s| s != got_shape) {
        return Err(format!("tensor '{name}' has shape {got_shape}, expected {want}").into());
    }
    let len = got_shape
        .size()
        .checked_mul(got.size())
        .filter(|&n| n == t.data().len())
        .ok_or_else(|| format!("tensor '{name}' has the wrong number of bytes"))?;
    Ok((got_shape, from_bytes(got, &t.data()[..len])))
}

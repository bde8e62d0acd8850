//! Checkpoints: [`KvStore::save`] and [`KvStore::load`], in the safetensors format.
//!
//! A checkpoint holds every key's value and the updater state of every key (its buffers and
//! step count). Tensors are named `value/<key>` and `state/<key>/<name>`, where `<name>` is one
//! of [`Updater::state_names`](crate::Updater::state_names) (`momentum`, `mean`, `var`). The
//! safetensors metadata holds:
//!
//! | entry            | value                                                     |
//! |------------------|-----------------------------------------------------------|
//! | `format`         | [`FORMAT`]                                                |
//! | `key_kind`       | `int`, `str`, or `none` for an empty store                 |
//! | `keys`           | the number of keys                                        |
//! | `order/<key>`    | the key's place in update order, `0..keys`               |
//! | `updater`        | the updater's [`name`](crate::Updater::name)               |
//! | `state_names`    | the state buffer names, comma-separated                   |
//! | `step/<key>`     | the key's step count, for keys that have updater state    |
//!
//! Values are stored in their own dtype (`F32`, `F64`, `F16`, `BF16`), state buffers in the
//! accumulator dtype (`F64` for `float64` values, `F32` otherwise), little-endian.
//!
//! ```
//! use kvstore::{KvStore, NDArray, Sgd, Updater};
//! let dir = std::env::temp_dir().join(format!("kvstore-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("model.safetensors");
//!
//! let kv = KvStore::create("local")?;
//! kv.set_updater(Updater::Sgd(Sgd { lr: 0.1, momentum: 0.9, ..Sgd::default() }))?;
//! kv.init(0, &NDArray::ones([4]))?;
//! kv.push(0, &NDArray::ones([4]))?;
//! kv.save(&path)?;
//!
//! let restored = KvStore::create("device")?;
//! restored.set_updater(kv.updater())?;
//! restored.load(&path)?;
//! let (a, b) = (NDArray::zeros([4]), NDArray::zeros([4]));
//! kv.pull(0, &a)?;
//! restored.pull(0, &b)?;
//! assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), kvstore::Error>(())
//! ```

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::store::{Entry, EntryState};
use crate::{DType, Error, Key, KeyKind, KvStore, Result, Shape};

/// The `format` entry of the metadata of every checkpoint this version writes.
pub const FORMAT: &str = "kvstore-checkpoint/1";

impl KvStore {
    /// Saves every value and every updater state to `path`, atomically.
    ///
    /// The checkpoint is written to a temporary file in the same directory, flushed to disk,
    /// and renamed over `path`; then the directory is flushed. A crash or an error at any point
    /// leaves the previous file at `path` (if any) intact; only a crash can leave the
    /// temporary file (`.<name>.tmp-<pid>-<n>`) behind, which is safe to delete. The values are
    /// one consistent snapshot: a push that runs concurrently is either wholly in it or not.
    /// See the [module docs](crate::checkpoint) for the format.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let fail = |message: String| Error::Checkpoint {
            path: path.to_owned(),
            message,
        };
        let (kind, updater, entries) = self.export_entries()?;
        let bytes = encode(kind, &updater, &entries).map_err(fail)?;
        write_atomic(path, &bytes).map_err(|e| fail(format!("write failed: {e}")))
    }

    /// Loads a checkpoint written by [`KvStore::save`], into a store of any kind and device set.
    ///
    /// Keys the store lacks are initialized; keys it has must have the file's shape and dtype.
    /// Each key's value and updater state become the file's (a key without state in the file
    /// starts afresh on its next push). Set the updater first: a file with updater state must
    /// have been saved with an updater of the same name and state buffers.
    ///
    /// The whole file is read and checked before anything changes: a corrupt, truncated or
    /// mismatched file is an [`Error::Checkpoint`] and leaves the store as it was.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let fail = |message: String| Error::Checkpoint {
            path: path.to_owned(),
            message,
        };
        let bytes = fs::read(path).map_err(|e| fail(format!("read failed: {e}")))?;
        let (kind, entries) = decode(&bytes, &self.updater()).map_err(fail)?;
        self.check_entries(kind, &entries).map_err(fail)?;
        self.import_entries(entries)
    }
}

/// `Dtype` of the safetensors format for a dtype.
fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
    }
}

/// The dtype updater state is kept in for values of `dtype`.
fn acc_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

fn kind_name(kind: Option<KeyKind>) -> &'static str {
    match kind {
        Some(KeyKind::Int) => "int",
        Some(KeyKind::Str) => "str",
        None => "none",
    }
}

/// Little-endian bytes of host elements.
fn to_bytes(data: &crate::HostData) -> Vec<u8> {
    use crate::HostData as H;
    match data {
        H::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        H::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        H::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        H::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Host elements of `dtype` from little-endian bytes; the length is checked by the caller.
fn from_bytes(dtype: DType, b: &[u8]) -> crate::HostData {
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
fn encode(
    kind: Option<KeyKind>,
    updater: &crate::Updater,
    entries: &[Entry],
) -> std::result::Result<Vec<u8>, String> {
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
        if let Some(state) = &e.state {
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
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| format!("tensor {name}: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    safetensors::serialize(views, Some(meta)).map_err(|e| format!("cannot serialize: {e}"))
}

/// Parses and checks a whole checkpoint against the updater in force.
fn decode(
    bytes: &[u8],
    updater: &crate::Updater,
) -> std::result::Result<(Option<KeyKind>, Vec<Entry>), String> {
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| format!("not a valid safetensors file (corrupt or truncated?): {e}"))?;
    let (_, header) = SafeTensors::read_metadata(bytes)
        .map_err(|e| format!("not a valid safetensors file (corrupt or truncated?): {e}"))?;
    let meta = header
        .metadata()
        .as_ref()
        .ok_or("the file has no metadata: it was not written by KvStore::save")?;
    let get = |name: &str| {
        meta.get(name)
            .map(String::as_str)
            .ok_or_else(|| format!("metadata entry '{name}' is missing"))
    };
    if get("format")? != FORMAT {
        return Err(format!(
            "metadata format is '{}', expected '{FORMAT}'",
            get("format")?
        ));
    }
    let kind = match get("key_kind")? {
        "int" => Some(KeyKind::Int),
        "str" => Some(KeyKind::Str),
        "none" => None,
        other => {
            return Err(format!(
                "metadata key_kind '{other}' is not int, str or none"
            ))
        }
    };
    let count_text = get("keys")?;
    let count: usize = count_text
        .parse()
        .ok()
        // Each key has an `order/` entry, so a larger count cannot be right (and must not
        // size an allocation).
        .filter(|&n| n <= meta.len())
        .ok_or_else(|| format!("metadata keys '{count_text}' is not a plausible key count"))?;

    // Keys in update order, from `order/<key>`.
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
            return Err(format!("metadata {name}: two keys share place {value}"));
        }
    }
    let keys: Vec<Key> = ordered
        .into_iter()
        .collect::<Option<_>>()
        .ok_or_else(|| format!("metadata lists fewer than keys = {count} order entries"))?;

    let file_updater = get("updater")?;
    let state_names: Vec<&str> = match get("state_names")? {
        "" => Vec::new(),
        names => names.split(',').collect(),
    };
    let has_state = keys.iter().any(|k| meta.contains_key(&format!("step/{k}")));
    if has_state && (file_updater != updater.name() || state_names != updater.state_names()) {
        return Err(format!(
            "the file holds state of a '{file_updater}' updater with buffers [{}], but the \
             store's updater is '{}' with buffers [{}]; set the same updater before load",
            state_names.join(", "),
            updater.name(),
            updater.state_names().join(", ")
        ));
    }

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
        entries.push(Entry {
            key,
            shape,
            value,
            state,
        });
    }
    if let Some(extra) = file.names().into_iter().find(|n| !used.contains(*n)) {
        return Err(format!(
            "tensor '{extra}' belongs to no key in the metadata"
        ));
    }
    Ok((kind, entries))
}

fn parse_key(kind: Option<KeyKind>, text: &str) -> std::result::Result<Key, String> {
    match kind {
        Some(KeyKind::Int) => text
            .parse::<i32>()
            .map(Key::Int)
            .map_err(|_| format!("key '{text}' is not an int key")),
        Some(KeyKind::Str) => Ok(Key::Str(text.to_owned())),
        None => Err(format!("key '{text}' in a file whose key_kind is none")),
    }
}

/// Reads tensor `name`, checking its dtype and shape when given.
fn read_tensor(
    file: &SafeTensors<'_>,
    name: &str,
    dtype: Option<DType>,
    shape: Option<Shape>,
) -> std::result::Result<(Shape, crate::HostData), String> {
    let t = file
        .tensor(name)
        .map_err(|_| format!("tensor '{name}' is missing"))?;
    let got = DType::ALL
        .into_iter()
        .find(|&d| st_dtype(d) == t.dtype())
        .ok_or_else(|| format!("tensor '{name}' has unsupported dtype {:?}", t.dtype()))?;
    let got_shape = Shape::new(t.shape()).map_err(|e| format!("tensor '{name}': {e}"))?;
    if let Some(want) = dtype.filter(|&d| d != got) {
        return Err(format!("tensor '{name}' is {got}, expected {want}"));
    }
    if let Some(want) = shape.filter(|&s| s != got_shape) {
        return Err(format!(
            "tensor '{name}' has shape {got_shape}, expected {want}"
        ));
    }
    let len = got_shape
        .size()
        .checked_mul(got.size())
        .filter(|&n| n == t.data().len())
        .ok_or_else(|| format!("tensor '{name}' has the wrong number of bytes"))?;
    Ok((got_shape, from_bytes(got, &t.data()[..len])))
}

thread_local! {
    /// Test hook: fail the next checkpoint writes of this thread after this many bytes.
    static FAIL_AFTER: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Makes every checkpoint save on the calling thread fail with an I/O error after writing
/// `bytes` bytes of the temporary file (`None` turns this off). For tests of interrupted saves.
#[doc(hidden)]
pub fn fail_writes_after(bytes: Option<u64>) {
    FAIL_AFTER.with(|f| f.set(bytes));
}

/// Writes `bytes` to a temporary file next to `path`, flushes it, renames it over `path` and
/// flushes the directory. The temporary file is removed on error.
fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path has no file name"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        file_name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = write_file(&tmp, bytes).and_then(|()| fs::rename(&tmp, path));
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(&dir)
}

fn write_file(tmp: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = OpenOptions::new().write(true).create_new(true).open(tmp)?;
    let limit = FAIL_AFTER.with(Cell::get);
    for (i, chunk) in bytes.chunks(1 << 16).enumerate() {
        let offset = (i << 16) as u64;
        if let Some(limit) = limit.filter(|&l| offset + chunk.len() as u64 > l) {
            file.write_all(&chunk[..(limit - offset.min(limit)) as usize])?;
            return Err(io::Error::other("injected write failure (test hook)"));
        }
        file.write_all(chunk)?;
    }
    file.sync_all()
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}

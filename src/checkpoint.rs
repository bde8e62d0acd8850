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
//! Keys are spelled as [`Key`]'s `Display` writes them; an int key in any other spelling
//! (`05`, `+5`) makes the file invalid, so that no two entries can name one key.
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
//! restored.set_updater(kv.updater())?; // before load, so the momentum comes back too
//! restored.load(&path)?;
//! let (a, b) = (NDArray::zeros([4]), NDArray::zeros([4]));
//! kv.pull(0, &a)?;
//! restored.pull(0, &b)?;
//! assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), kvstore::Error>(())
//! ```

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::store::{Entry, EntryState};
use crate::{DType, Error, Key, KeyKind, KvStore, Result, Shape, Updater};

/// The `format` entry of the metadata of every checkpoint this version writes.
pub const FORMAT: &str = "kvstore-checkpoint/1";

/// What kind of failure an [`Error::Checkpoint`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CheckpointErrorKind {
    /// There is no file at the path (`load`), or the directory to save into does not exist
    /// (`save`). The source is the [`std::io::Error`].
    NotFound,
    /// Reading or writing failed for another reason: permissions, a full disk, a failing
    /// device. The source is the [`std::io::Error`].
    Io,
    /// The file is not a checkpoint this version can read: corrupt, truncated, not a
    /// safetensors file, or with missing or malformed metadata or tensors. The source is the
    /// safetensors error, when the file could not be parsed at all.
    Invalid,
    /// A valid checkpoint that does not fit the store: a key whose shape or dtype differs from
    /// the store's, or keys of the other kind (int or string) than the store holds.
    Mismatch,
}

/// A checkpoint failure before its path is attached.
pub(crate) struct Problem {
    kind: CheckpointErrorKind,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Problem {
    /// A file that is not a valid checkpoint.
    pub(crate) fn invalid(message: impl Into<String>) -> Problem {
        Problem {
            kind: CheckpointErrorKind::Invalid,
            message: message.into(),
            source: None,
        }
    }

    /// A valid checkpoint that does not fit the store.
    pub(crate) fn mismatch(message: impl Into<String>) -> Problem {
        Problem {
            kind: CheckpointErrorKind::Mismatch,
            message: message.into(),
            source: None,
        }
    }

    /// A failed read or write: [`CheckpointErrorKind::NotFound`] or
    /// [`CheckpointErrorKind::Io`], with `e` as the source.
    fn io(reading: bool, e: io::Error) -> Problem {
        let (kind, message) = match (e.kind(), reading) {
            (io::ErrorKind::NotFound, true) => (
                CheckpointErrorKind::NotFound,
                "there is no file at this path: check the path, or save a checkpoint there first"
                    .to_owned(),
            ),
            (io::ErrorKind::NotFound, false) => (
                CheckpointErrorKind::NotFound,
                "the directory to save into does not exist: create it first".to_owned(),
            ),
            (k, true) => (
                CheckpointErrorKind::Io,
                format!("reading the file failed ({k}): check its permissions and the device"),
            ),
            (k, false) => (
                CheckpointErrorKind::Io,
                format!(
                    "writing the file failed ({k}): check the directory's permissions and free \
                     space; any previous checkpoint at this path is unchanged"
                ),
            ),
        };
        Problem {
            kind,
            message,
            source: Some(Box::new(e)),
        }
    }

    /// The error for the checkpoint at `path`.
    pub(crate) fn at(self, path: &Path) -> Error {
        Error::Checkpoint {
            path: path.to_owned(),
            kind: self.kind,
            message: self.message,
            source: self.source,
        }
    }
}

impl From<String> for Problem {
    fn from(message: String) -> Problem {
        Problem::invalid(message)
    }
}

impl From<&str> for Problem {
    fn from(message: &str) -> Problem {
        Problem::invalid(message)
    }
}

/// An unparsable file: [`CheckpointErrorKind::Invalid`] with the safetensors error as source.
fn not_safetensors(e: safetensors::SafeTensorError) -> Problem {
    Problem {
        kind: CheckpointErrorKind::Invalid,
        message: "not a valid safetensors file (corrupt or truncated?): restore it from a copy, \
                  or save it again"
            .to_owned(),
        source: Some(Box::new(e)),
    }
}

impl KvStore {
    /// Saves every value and every updater state to `path`, atomically.
    ///
    /// The checkpoint is written to a temporary file in the same directory, flushed to disk,
    /// and renamed over `path`; then the directory is flushed. A crash or an error at any point
    /// leaves the previous file at `path` (if any) intact; only a crash can leave the
    /// temporary file (`.<name>.tmp-<pid>-<n>`) behind, which is safe to delete. The values are
    /// one consistent snapshot: a push that runs concurrently is either wholly in it or not.
    /// See the [module docs](crate::checkpoint) for the format.
    ///
    /// A failure is an [`Error::Checkpoint`] of kind [`CheckpointErrorKind::NotFound`] (no
    /// such directory) or [`CheckpointErrorKind::Io`], with the I/O error as its source.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let (kind, updater, entries) = self.export_entries()?;
        let bytes = encode(kind, &updater, &entries).map_err(|p| p.at(path))?;
        write_atomic(path, &bytes).map_err(|e| Problem::io(false, e).at(path))
    }

    /// Loads a checkpoint written by [`KvStore::save`], into a store of any kind and device set,
    /// whatever updater either was saved or is set with.
    ///
    /// Keys the store lacks are added; keys it has must have the file's shape and dtype. What
    /// a load brings in:
    ///
    /// - **Values** always load.
    /// - **Updater state** (momentum, Adam's moments, and the step count that goes with them)
    ///   loads when it fits the updater in force: the file was saved under an updater of the
    ///   same [`name`](Updater::name) and [`state_names`](Updater::state_names) (for example
    ///   Adam into Adam, or SGD with momentum into SGD with momentum), whatever the
    ///   hyperparameters, so a resumed run may change its learning rate and keep its moments.
    ///   Set the updater before `load`.
    /// - Otherwise (SGD state into Adam, no momentum into momentum, a checkpoint saved under
    ///   the default assign updater into any optimizer, ...) every loaded key starts its state
    ///   afresh on its next push, exactly as after [`KvStore::set_updater`]: zero buffers and a
    ///   step count of 0, so Adam's bias correction starts over with its fresh moments. A key
    ///   the file holds no state for starts afresh too.
    ///
    /// The updater is read once per call: a [`KvStore::set_updater`] that runs during the load
    /// is either wholly before it or, like any later `set_updater`, starts every key's state
    /// afresh.
    ///
    /// A load is all or nothing, like the list operations: the whole file is read and checked
    /// first, and then the file's keys (new ones appearing together with their values and
    /// state) all change in one step, with every key's lock held, so a concurrent push or pull
    /// of the file's keys sees the store wholly before or wholly after the load. Any error is an
    /// [`Error::Checkpoint`] whose [`kind`](CheckpointErrorKind) tells a missing file, an I/O
    /// failure, a corrupt or invalid file and a file that does not fit the store apart, and
    /// leaves the store as it was. (A CUDA failure while copying to a GPU home, an
    /// [`Error::Cuda`], can leave keys already in the store partly loaded.)
    pub fn load(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = fs::read(path).map_err(|e| Problem::io(true, e).at(path))?;
        let (updater, generation) = self.active_updater();
        let (kind, entries) = decode(&bytes, &updater).map_err(|p| p.at(path))?;
        run_load_hook(LoadStage::Checked);
        self.import_entries(path, kind, entries, generation)?;
        run_load_hook(LoadStage::Applied);
        Ok(())
    }
}

/// Where a [`set_load_hook`] hook runs inside [`KvStore::load`].
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadStage {
    /// The file is read and checked against the updater in force; the store is unchanged.
    Checked,
    /// The file's keys are in the store, with their values and state; the load returns next.
    Applied,
}

type LoadHook = Box<dyn FnMut(LoadStage)>;

thread_local! {
    /// Test hook: runs at each [`LoadStage`] of the loads of this thread.
    static LOAD_HOOK: RefCell<Option<LoadHook>> = const { RefCell::new(None) };
}

/// Test hook: runs `hook` at each [`LoadStage`] of every later `load` on the calling thread, with
/// no lock of the store held (`None` turns it off). For tests of loads that race other calls.
#[doc(hidden)]
pub fn set_load_hook(hook: Option<Box<dyn FnMut(LoadStage)>>) {
    LOAD_HOOK.with(|h| *h.borrow_mut() = hook);
}

fn run_load_hook(stage: LoadStage) {
    // Taken out while it runs, so a hook that loads does not run itself.
    let Some(mut hook) = LOAD_HOOK.with(|h| h.borrow_mut().take()) else {
        return;
    };
    hook(stage);
    LOAD_HOOK.with(|h| {
        let mut slot = h.borrow_mut();
        if slot.is_none() {
            *slot = Some(hook);
        }
    });
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
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| format!("cannot serialize tensor {name}: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    safetensors::serialize(views, Some(meta))
        .map_err(|e| Problem::from(format!("cannot serialize: {e}")))
}

/// Parses and checks a whole checkpoint. Every key's state is checked whatever the updater,
/// and kept only where it fits `updater` (the same name and state buffers); see
/// [`KvStore::load`].
fn decode(
    bytes: &[u8],
    updater: &Updater,
) -> std::result::Result<(Option<KeyKind>, Vec<Entry>), Problem> {
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
    if get("format")? != FORMAT {
        return Err(format!(
            "metadata format is '{}', expected '{FORMAT}': it was not written by this version \
             of KvStore::save",
            get("format")?
        )
        .into());
    }
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
        name.strip_prefix("step/")
            .is_some_and(|k| !spelled.contains(k))
    }) {
        return Err(format!("metadata entry '{name}' belongs to no key in the metadata").into());
    }

    let file_updater = get("updater")?;
    let state_names: Vec<&str> = match get("state_names")? {
        "" => Vec::new(),
        names => names.split(',').collect(),
    };
    let fits = file_updater == updater.name() && state_names == updater.state_names();

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
                // State of another updater is checked, then left behind: the key starts
                // afresh, as after set_updater.
                fits.then_some(EntryState { step, bufs })
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
        return Err(format!("tensor '{extra}' belongs to no key in the metadata").into());
    }
    Ok((kind, entries))
}

/// A key from its spelling in the file. Int keys must be spelled canonically (as `save`
/// writes them: no sign but `-`, no leading zeros, no spaces), so that no two spellings name
/// one key.
fn parse_key(kind: Option<KeyKind>, text: &str) -> std::result::Result<Key, Problem> {
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

//! Checkpoints: [`KvStore::save`] and [`KvStore::load`], in the safetensors format.
//!
//! There are two layouts, and [`KvStore::load`] reads both: a **single file**, which a store
//! in one process writes, and a **sharded directory**, which the ranks of a `dist` store write
//! together, one shard file each. Either loads into a store of any kind and any world size.
//!
//! # Single file
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
//! | `state_names`    | the state buffer names, comma-separated, distinct         |
//! | `step/<key>`     | the key's step count, for keys that have updater state    |
//! | `row_sparse/<key>` | `1` for a row-sparse key ([`KvStore::init_row_sparse`]); absent for a dense one |
//! | `residuals/<key>` | the number of gradient-compression residuals of the key (one per position in a push's list of values), each a float32 tensor `residual/<key>/<i>` of the key's shape; absent when it has none |
//! | `header_crc32`, `crc32_chunk`, `crc32/<tensor>` | the checksums, see [below](#checksums) |
//!
//! Keys are spelled as [`Key`](crate::Key)'s `Display` writes them; an int key in any other spelling
//! (`05`, `+5`) makes the file invalid, so that no two entries can name one key.
//!
//! Values are stored in their own dtype (`F32`, `F64`, `F16`, `BF16`), state buffers in the
//! accumulator dtype (`F64` for `float64` values, `F32` otherwise), little-endian.
//!
//! # Checksums
//!
//! Every file, a single file or a shard, carries checksums of all its bytes, and a load
//! verifies every byte before it uses it. They are CRC-32s (IEEE 802.3, as zlib computes
//! them), each written as 8 lowercase hex digits, in three kinds of metadata entry:
//!
//! | entry            | value                                                           |
//! |------------------|-----------------------------------------------------------------|
//! | `header_crc32`   | the CRC-32 of the header: bytes `0..8+N` of the file (the 8-byte length `N` and the JSON header, padding included), as written with this entry's value `00000000` |
//! | `crc32_chunk`    | the chunk size `C` of the tensors' checksums, in bytes (this version writes 1048576) |
//! | `crc32/<tensor>` | for every tensor, the CRC-32 of each `C`-byte chunk of its data, in order (the last one may be shorter), comma-separated; empty for a tensor of no bytes |
//!
//! The header's checksum is verified before anything in the header is believed. A shard is
//! read by range, so a read reads and verifies only the chunks it touches (at most one chunk
//! more than it needs at each end), each before any of its bytes is used. A mismatch is an
//! [`Error::Checkpoint`] of kind [`CheckpointErrorKind::Invalid`] that names the file, and a
//! load that meets one changes nothing.
//!
//! Files of format 1 (`kvstore-checkpoint/1`, and the shards of format 1 below) have no
//! checksums: they still load, unverified, with a warning in the log; save them again to
//! write the current format. A file of format 1 with checksum entries is invalid.
//!
//! # Sharded checkpoints
//!
//! A directory with an `index` file and one folder per generation of shards:
//!
//! ```text
//! <dir>/index                                  which generation is the checkpoint
//! <dir>/gen-<G>/shard-<rank>-of-<world>.safetensors
//! ```
//!
//! `index` is five lines of text: `kvstore-checkpoint-index/3`, `generation <G>`, `world <W>`,
//! `token <T>` and `crc32 <C>`, where `C` is the CRC-32 of the four lines before it (their
//! newlines included), written as 8 lowercase hex digits; a load verifies it before it believes
//! anything in the index. A save claims a fresh generation: rank 0 creates its folder with a create
//! that fails if the folder exists, taking the next number if it does, so two saves into one
//! directory at once (a restarted job while the old one still runs) never share a
//! generation. It also mints the save's token, a random 64-bit number written as 16 lowercase
//! hex digits, that marks every shard of the save. Every rank writes its shard into the
//! generation (each through a temporary file that is flushed and renamed), then rank 0 checks
//! that every shard carries the save's token and that the shards together hold every element
//! of every key exactly once, and replaces `index` atomically; the generations up to the one
//! `index` named before are removed after that. A save that stops part way never touches
//! `index`, so the previous checkpoint stays the one a load finds; its leftovers are ignored.
//! A load checks that every shard carries the token `index` names, so a generation holding a
//! shard of another save is an error, never values mixed from two saves.
//!
//! Checkpoints of format 1 (an `index` of the first three lines, `kvstore-checkpoint-index/1`,
//! and shards of format `kvstore-shard/1`, with no token and no checksums) still load, with a
//! warning in the log that they cannot tell a corrupt byte or a shard of another save. So do
//! checkpoints whose index is of format 2 (`kvstore-checkpoint-index/2`, the first four lines,
//! with no checksum line), with a warning that a corrupt index would go unnoticed.
//!
//! Each shard holds, for every key it has, one contiguous range of the key's row-major
//! flattened value (the whole key, or one slice of it), as 1-D tensors `value/<key>` and
//! `state/<key>/<name>` of that range's length, in the dtypes of the single file. Its
//! metadata:
//!
//! | entry          | value                                                             |
//! |----------------|-------------------------------------------------------------------|
//! | `format`       | `kvstore-shard/2`                                                 |
//! | `generation`, `rank`, `world` | as in the file's name                              |
//! | `token`        | the save's token, as in `index`                                   |
//! | `key_kind`     | `int`, `str`, or `none` for a shard with no keys                  |
//! | `updater`, `state_names` | as in the single file, the same in every shard          |
//! | `piece/<key>`  | `order=<o> start=<a> end=<b> dims=<d0>,<d1>,... step=<s> sparse=1` |
//! | `residuals/<key>` | `count=<c> len=<n>`: the saving rank's own gradient-compression residuals of the key, `c` float32 tensors `residual/<key>/<i>` of the whole key's `n` elements; absent when it has none |
//! | `header_crc32`, `crc32_chunk`, `crc32/<tensor>` | the checksums, as in the single file |
//!
//! `order` is the key's place in update order (distinct per key; keys are listed by it),
//! `start..end` the element range this shard holds, `dims` the whole key's dims (empty for a
//! scalar), and `step` the updater step count, present exactly when the key has updater state
//! (then the shard has one `state/<key>/<name>` per state name), and `sparse=1` marks a
//! row-sparse key. Every shard of a key records the same `order`, `dims`, dtype, `step` and
//! `sparse`. A shard's residuals are its rank's own, of every key that rank pushed (homed
//! there or not): a load by as many ranks gives rank `r` those of shard `r`; after a load by
//! another number of ranks, or into a single-process store, they start at zero. Keys are
//! spelled canonically, as in the single file.
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
//!
//! # Bounds
//!
//! No checkpoint file can make a load allocate more than the files hold: every length or count
//! a file declares (the header's length, `keys`, a `residuals` count, the `world` an index
//! names) is checked against the bytes, header entries, tensors or shard files that are there
//! before anything is sized by it. A file that declares more is [`CheckpointErrorKind::Invalid`]
//! (an index that names more shards than its generation holds is
//! [`CheckpointErrorKind::NotFound`], as a missing shard is); it never aborts the process.
//! Two more rules keep a load from growing past its files, or a later push from failing: the
//! state buffer names are distinct (a name given twice would read its tensors twice over), and
//! a step count is at most 2^63 - 1 (every push adds one to it).

mod atomic;
mod bounded;
mod checksum;
mod file;
// The writing side and `Reader::read` serve the dist store, which saves and loads by piece;
// a local store only loads whole keys.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod reader;
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod sharded;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::fs;
use std::io;
use std::path::Path;

pub use atomic::fail_writes_after;
use atomic::write_atomic;
use file::{decode, encode};
#[allow(unused_imports)] // the crate-internal API of sharded checkpoints, for the dist store
pub(crate) use reader::{open, read_index, Reader};
#[doc(hidden)]
pub use sharded::save_sharded;
#[allow(unused_imports)]
pub(crate) use sharded::{
    commit, next_generation, write_shard, KeyMeta, KeyResiduals, Piece, SaveId,
};

use crate::{Error, KvStore, Result};

/// The `format` entry of the metadata of every single-file checkpoint this version writes.
pub const FORMAT: &str = "kvstore-checkpoint/2";

/// The `format` of single files of the previous version, which have no checksums; still read.
const FORMAT_1: &str = "kvstore-checkpoint/1";

/// Warns that the checkpoint at `path` is of format 1, whose files carry no checksums, so that
/// a corrupt byte in it would go unnoticed.
fn warn_unverified(path: &Path) {
    log::warn!(
        "{}: a checkpoint of format 1, which has no checksums, so a corrupt byte in it would go \
         unnoticed; it loads unverified. Save it again to write the current format",
        path.display()
    );
}

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
    /// The file is not a checkpoint this version can read: corrupt (a checksum that does not
    /// match), truncated, not a safetensors file, with missing or malformed metadata or
    /// tensors, or a shard of another save than the index names. The source is the
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

    /// The same failure with another message.
    pub(crate) fn with_message(mut self, message: impl Into<String>) -> Problem {
        self.message = message.into();
        self
    }

    /// A failed read or write: [`CheckpointErrorKind::NotFound`] or
    /// [`CheckpointErrorKind::Io`], with `e` as the source.
    pub(crate) fn io(reading: bool, e: io::Error) -> Problem {
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
pub(crate) fn not_safetensors(e: safetensors::SafeTensorError) -> Problem {
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
        if let Some(done) = self.save_across_ranks(path) {
            return done;
        }
        let (kind, updater, entries) = self.export_entries()?;
        let bytes = encode(kind, &updater, &entries).map_err(|p| p.at(path))?;
        write_atomic(path, &bytes).map_err(|e| Problem::io(false, e).at(path))
    }

    /// Loads a checkpoint written by [`KvStore::save`], into a store of any kind and device set,
    /// whatever updater either was saved or is set with.
    ///
    /// `path` is a single file, or a directory holding a sharded checkpoint that the ranks of a
    /// `dist` store saved, at any world size (see the [module docs](crate::checkpoint)): its
    /// shards are put back together key by key. A directory with no committed checkpoint is
    /// [`CheckpointErrorKind::NotFound`]; so is a shard that its index names and the directory
    /// lacks.
    ///
    /// Keys the store lacks are added; keys it has must have the file's shape and dtype. What
    /// a load brings in:
    ///
    /// - **Values** always load.
    /// - **Updater state** (momentum, Adam's moments, and the step count that goes with them)
    ///   loads when it fits the updater in force: the file was saved under an updater of the
    ///   same [`name`](crate::Updater::name) and [`state_names`](crate::Updater::state_names) (for example
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
    /// Every byte read is verified against the file's checksums before it is used (see the
    /// [module docs](crate::checkpoint#checksums)); a mismatch is
    /// [`CheckpointErrorKind::Invalid`]. A file of the previous format, which has no
    /// checksums, loads unverified, with a warning in the log.
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
        if let Some(done) = self.load_across_ranks(path) {
            return done;
        }
        let (updater, generation) = self.active_updater();
        let (kind, entries) = if path.is_dir() {
            let reader = reader::open(path)?;
            (reader.key_kind(), reader.entries(&updater)?)
        } else {
            let bytes = fs::read(path).map_err(|e| Problem::io(true, e).at(path))?;
            let (kind, entries, verified) = decode(&bytes, &updater).map_err(|p| p.at(path))?;
            if !verified {
                warn_unverified(path);
            }
            (kind, entries)
        };
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

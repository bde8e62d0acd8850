//! Checkpoints: [`KvStore::save`](crate::KvStore::save) and
//! [`KvStore::load`](crate::KvStore::load), in the safetensors format. This module knows files,
//! not stores: the store hands it pieces of values and reads pieces back.
//!
//! Every store saves one format: a **sharded directory** (see [below](#sharded-checkpoints)),
//! one shard per rank; a store of one process is a world of one and writes one shard that
//! holds every key whole. [`KvStore::load`](crate::KvStore::load) reads it at any world size,
//! into a store of any kind, and still reads sharded directories of every earlier format and
//! the **single files** of formats 1 and 2 that stores of one process wrote before.
//!
//! # Single file (written by earlier versions; still read)
//!
//! A single file holds every key's value and updater state (buffers and step count) as
//! tensors `value/<key>` and `state/<key>/<name>`, where `<name>` is one of
//! [`Updater::state_names`](crate::Updater::state_names) (`momentum`, `mean`, `var`). The
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
//! | `row_sparse/<key>` | `1` for a row-sparse key ([`KvStore::init_row_sparse`](crate::KvStore::init_row_sparse)); absent for a dense one |
//! | `residuals/<key>` | the number of gradient-compression residuals of the key (one per position in a push's list of values), each a float32 tensor `residual/<key>/<i>` of the key's shape; absent when it has none |
//! | `header_crc32`, `crc32_chunk`, `crc32/<tensor>` | the checksums, see [below](#checksums) |
//!
//! Keys are spelled as [`Key`](crate::Key)'s `Display` writes them; an int key spelled
//! otherwise (`05`, `+5`) makes the file invalid, so that no two entries name one key. Values
//! are in their own dtype (`F32`, `F64`, `F16`, `BF16`), state buffers in the accumulator
//! dtype (`F64` for `float64` values, `F32` otherwise), little-endian.
//!
//! # Checksums
//!
//! Every file, shard or single file, carries CRC-32s (IEEE 802.3, as zlib computes them) of
//! all its bytes, each written as 8 lowercase hex digits, and a load verifies every byte
//! before it uses it:
//!
//! | entry            | value                                                           |
//! |------------------|-----------------------------------------------------------------|
//! | `header_crc32`   | the CRC-32 of the header: bytes `0..8+N` of the file (the 8-byte length `N` and the JSON header, padding included), as written with this entry's value `00000000` |
//! | `crc32_chunk`    | the chunk size `C` of the tensors' checksums, in bytes (this version writes 1048576) |
//! | `crc32/<tensor>` | for every tensor, the CRC-32 of each `C`-byte chunk of its data, in order (the last one may be shorter), comma-separated; empty for a tensor of no bytes |
//!
//! The header's checksum is verified before anything in the header is believed. A shard is
//! read by range: a read verifies each chunk it touches (at most one more than it needs at
//! each end) before any of its bytes is used. A mismatch is an [`Error::Checkpoint`] of kind
//! [`CheckpointErrorKind::Invalid`] that names the file, and the load changes nothing.
//!
//! Files of format 1 (`kvstore-checkpoint/1`, and the shards of format 1 below) have no
//! checksums: they load unverified, with a warning in the log; saving again writes the
//! current format. A file of format 1 with checksum entries is invalid.
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
//! `token <T>` and `crc32 <C>`, where `C` is the CRC-32 of the four lines before it (newlines
//! included) as 8 lowercase hex digits, verified before anything in the index is believed.
//!
//! A save claims a fresh generation: rank 0 creates its folder with a create that fails if it
//! exists, taking the next number if it does, so two saves into one directory at once (a
//! restarted job while the old one still runs) never share a generation. Rank 0 also mints
//! the save's token, 64 random bits as 16 lowercase hex digits, that marks every shard of the
//! save. Every rank writes its shard (through a temporary file that is flushed and renamed);
//! then rank 0 checks that every shard carries the token and that the shards hold every
//! element of every key exactly once, replaces `index` atomically, and removes the
//! generations up to the one `index` named before. A save that stops part way never touches
//! `index`, so the previous checkpoint stays the one a load finds. A load checks that every
//! shard carries the token `index` names, so a shard of another save is an error, never
//! values mixed from two saves.
//!
//! Checkpoints of format 1 (an `index` of the first three lines, `kvstore-checkpoint-index/1`,
//! and shards `kvstore-shard/1`, with no token and no checksums) still load, with a warning
//! that a corrupt byte or a shard of another save would go unnoticed; so do those whose index
//! is of format 2 (`kvstore-checkpoint-index/2`, the first four lines), with a warning that a
//! corrupt index would go unnoticed.
//!
//! Each shard holds, for every key it has, one contiguous range of the key's row-major
//! flattened value (the whole key, or a slice), as 1-D tensors `value/<key>` and
//! `state/<key>/<name>` of the range's length, in the dtypes of the single file. Its metadata:
//!
//! | entry          | value                                                             |
//! |----------------|-------------------------------------------------------------------|
//! | `format`       | `kvstore-shard/3`                                                 |
//! | `generation`, `rank`, `world` | as in the file's name                              |
//! | `token`        | the save's token, as in `index`                                   |
//! | `key_kind`     | `int`, `str`, or `none` for a shard with no keys                  |
//! | `updater`, `state_names` | as in the single file, the same in every shard          |
//! | `piece/<key>`  | a JSON object: `{"order":<o>,"start":<a>,"end":<b>,"dims":[<d0>,<d1>,...],"step":<s>,"sparse":true}` |
//! | `residuals/<key>` | a JSON object `{"count":<c>,"len":<n>}`: the saving rank's own gradient-compression residuals of the key, `c` float32 tensors `residual/<key>/<i>` of the whole key's `n` elements; absent when it has none |
//! | `header_crc32`, `crc32_chunk`, `crc32/<tensor>` | the checksums, as in the single file |
//!
//! In `piece/`, `order` is the key's place in update order (distinct per key), `start..end`
//! the element range the shard holds, `dims` the whole key's dims (empty for a scalar),
//! `step` the updater step count, present exactly when the key has updater state (then the
//! shard has one `state/<key>/<name>` per state name), and `sparse` (`true`, or absent for a
//! dense key) marks a row-sparse key; no other field is allowed. Every shard of a key records
//! the same `order`, `dims`, dtype, `step` and `sparse`. A shard's residuals are its rank's
//! own, of every key that rank pushed: a load by as many ranks gives rank `r` those of shard
//! `r` (a single file is one shard); a load by another number of ranks starts them at zero.
//!
//! Shards of format 2 (`kvstore-shard/2`) differ only in spelling `piece/` as
//! `order=<o> start=<a> end=<b> dims=<d0>,<d1>,... step=<s> sparse=1` and `residuals/` as
//! `count=<c> len=<n>` (fields separated by single spaces, counts in canonical decimal).
//!
//! ```
//! use kvstore::{KvStore, NDArray, Sgd, Updater};
//! let dir = std::env::temp_dir().join(format!("kvstore-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("model");
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
//! names) is checked against the bytes, entries, tensors or shard files there before anything
//! is sized by it. A file that declares more is [`CheckpointErrorKind::Invalid`] (an index
//! naming more shards than its generation holds is [`CheckpointErrorKind::NotFound`], as a
//! missing shard is); it never aborts the process. State buffer names are distinct (a name
//! given twice would read its tensors twice over), and a step count is at most 2^63 - 1 (every
//! push adds one to it).

mod atomic;
mod bounded;
mod checksum;
mod entry;
mod file;
mod held;
mod layout;
mod load_hook;
mod reader;
mod sharded;
mod spec;
#[cfg(test)]
mod tests;

use std::io;
use std::path::Path;

#[cfg(feature = "test-util")]
pub use atomic::fail_writes_after;
pub(crate) use entry::{Entry, EntryState};
pub(crate) use file::write_single_file;
pub(crate) use layout::{KeyMeta, KeyResiduals, Piece};
pub(crate) use load_hook::run_load_hook;
#[cfg(not(feature = "test-util"))]
pub(crate) use load_hook::LoadStage;
#[cfg(feature = "test-util")]
pub use load_hook::{set_load_hook, LoadStage};
pub(crate) use reader::{open, read_index, Reader};
pub(crate) use sharded::{commit, entry_piece, next_generation, rank_range, write_shard, SaveId};

pub(crate) use crate::checkpoint_error::CheckpointErrorKind;
use crate::Error;

/// The `format` of single files of format 2, with checksums; still read.
pub const FORMAT: &str = "kvstore-checkpoint/2";

/// The `format` of single files of format 1, with no checksums; still read.
const FORMAT_1: &str = "kvstore-checkpoint/1";

/// A checkpoint failure before its path is attached.
pub(crate) struct Problem {
    kind: CheckpointErrorKind,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Problem {
    /// A failure of `kind`, with no source.
    fn new(kind: CheckpointErrorKind, message: impl Into<String>) -> Problem {
        Problem {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// A file that is not a valid checkpoint.
    pub(crate) fn invalid(message: impl Into<String>) -> Problem {
        Problem::new(CheckpointErrorKind::Invalid, message)
    }

    /// A valid checkpoint that does not fit the store.
    pub(crate) fn mismatch(message: impl Into<String>) -> Problem {
        Problem::new(CheckpointErrorKind::Mismatch, message)
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
            source: Some(Box::new(e)),
            ..Problem::new(kind, message)
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
        source: Some(Box::new(e)),
        ..Problem::invalid(
            "not a valid safetensors file (corrupt or truncated?): restore it from a copy, or \
             save it again",
        )
    }
}

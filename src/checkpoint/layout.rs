//! The layout of a checkpoint on disk, shared by its writers and its reader: the format names,
//! how tokens, counts and dtypes are spelled, the paths, and what is recorded of each key.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use super::entry::Entry;
use super::Problem;
use crate::{DType, Key, NDArray};

/// The `format` metadata entry of every shard file this version writes.
pub(crate) const SHARD_FORMAT: &str = "kvstore-shard/3";

/// The `format` of earlier shard files, which spell `piece/` and `residuals/` as `name=value`
/// fields; still read.
pub(crate) const SHARD_FORMAT_2: &str = "kvstore-shard/2";

/// The `format` of earlier shard files, with no token and no checksums; still read.
pub(crate) const SHARD_FORMAT_1: &str = "kvstore-shard/1";

/// The first line of every index file this version writes.
pub(crate) const INDEX_FORMAT: &str = "kvstore-checkpoint-index/3";

/// The first line of earlier index files, with no checksum; still read.
pub(crate) const INDEX_FORMAT_2: &str = "kvstore-checkpoint-index/2";

/// The first line of earlier index files, with no token either; still read.
pub(crate) const INDEX_FORMAT_1: &str = "kvstore-checkpoint-index/1";

/// A token as files spell it: 16 lowercase hex digits.
pub(crate) fn token_text(token: u64) -> String {
    format!("{token:016x}")
}

/// A token from its canonical spelling (16 lowercase hex digits).
pub(crate) fn parse_token(text: &str) -> Option<u64> {
    u64::from_str_radix(text, 16)
        .ok()
        .filter(|&t| token_text(t) == text)
}

/// What a checkpoint records of one key, whole: shared by all its pieces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KeyMeta {
    /// The key, canonically spelled in files as its `Display` writes it.
    pub key: Key,
    /// The dims of the whole value (a piece holds a range of its row-major flattening).
    pub dims: Vec<usize>,
    /// The value's dtype; state buffers are in its [`acc_dtype`].
    pub dtype: DType,
    /// The key's place in update order: keys are listed by it, and no two keys share it.
    pub order: usize,
    /// The key's updater step count; 0 where it has no state.
    pub step: u64,
    /// Whether the key has updater state (one buffer per state name).
    pub has_state: bool,
    /// Whether the key is row-sparse.
    pub row_sparse: bool,
}

impl KeyMeta {
    /// The description of entry `e`, the `order`-th key in update order.
    pub(crate) fn of(e: &Entry, order: usize) -> KeyMeta {
        KeyMeta {
            key: e.key.clone(),
            dims: e.shape.dims().to_vec(),
            dtype: e.value.dtype(),
            order,
            step: e.state.as_ref().map_or(0, |s| s.step),
            has_state: e.state.is_some(),
            row_sparse: e.row_sparse,
        }
    }

    /// The number of elements of the whole value.
    pub(crate) fn size(&self) -> usize {
        self.dims.iter().product()
    }
}

/// One key's gradient-compression residuals on the rank that saves them: one per position of
/// a push's list of values, each of the key's `len` elements (or empty: never pushed).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct KeyResiduals {
    pub key: Key,
    pub len: usize,
    pub residuals: Vec<Vec<f32>>,
}

impl KeyResiduals {
    /// The residuals of `key`, of `len` elements each: `None` where it has none.
    pub(crate) fn of(key: &Key, len: usize, residuals: &[Vec<f32>]) -> Option<KeyResiduals> {
        (!residuals.is_empty()).then(|| KeyResiduals {
            key: key.clone(),
            len,
            residuals: residuals.to_vec(),
        })
    }
}

/// One contiguous element range of one key: its value and updater state there.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    /// The key this is a piece of.
    pub meta: KeyMeta,
    /// The element range of the key's flattened value, within `0..meta.size()`.
    pub range: Range<usize>,
    /// The value over `range`: 1-D, `range.len()` elements of `meta.dtype`.
    pub value: NDArray,
    /// The updater state over `range`, named and ordered as [`Updater::state_names`] (empty
    /// exactly when `meta.has_state` is false), each 1-D of the accumulator dtype.
    pub state: Vec<(String, NDArray)>,
}

/// The directory of generation `generation` inside checkpoint directory `dir`.
pub(crate) fn generation_dir(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("gen-{generation}"))
}

/// The shard file of `rank` of `world` inside generation directory `gen_dir`.
pub(crate) fn shard_path(gen_dir: &Path, rank: usize, world: usize) -> PathBuf {
    gen_dir.join(format!("shard-{rank}-of-{world}.safetensors"))
}

/// The index file of checkpoint directory `dir`.
pub(crate) fn index_path(dir: &Path) -> PathBuf {
    dir.join("index")
}

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

/// Metadata entry `name` of `md`; a missing one is `Invalid`.
pub(super) fn entry<'m>(md: &'m HashMap<String, String>, name: &str) -> Result<&'m str, Problem> {
    md.get(name)
        .map(String::as_str)
        .ok_or_else(|| Problem::invalid(format!("metadata entry '{name}' is missing")))
}

/// The metadata entries of `md` named `<prefix><rest>`: each one's name, `rest` and value.
pub(super) fn entries_under<'m>(
    md: &'m HashMap<String, String>,
    prefix: &'m str,
) -> impl Iterator<Item = (&'m str, &'m str, &'m str)> {
    (md.iter()).filter_map(move |(name, value)| {
        Some((name.as_str(), name.strip_prefix(prefix)?, value.as_str()))
    })
}

/// A count as files spell it: decimal, canonical (no sign, no leading zeros), so that no two
/// spellings name one number.
pub(super) fn count_of<T: std::str::FromStr + ToString>(text: &str) -> Option<T> {
    text.parse::<T>().ok().filter(|n| n.to_string() == text)
}

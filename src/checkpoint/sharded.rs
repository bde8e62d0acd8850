//! Sharded checkpoints, the writing side: each rank writes one shard file of a fresh generation,
//! and rank 0 commits the generation by replacing the index. See the
//! [module docs](super#sharded-checkpoints) for the layout.
//!
//! A save by a store of `world` ranks runs:
//!
//! 1. rank 0: [`next_generation`], which claims a fresh generation directory (an atomic
//!    create, so no two saves ever share one) and mints the save's token; both are broadcast
//!    to every rank as a [`SaveId`];
//! 2. every rank: [`write_shard`] with the pieces it holds, marked with the token;
//! 3. a barrier;
//! 4. rank 0: [`commit`], which checks that every shard carries the save's token and that the
//!    shards cover every key exactly once, and then points the index at the new generation.
//!
//! A save that stops before step 4 completes leaves the index, and so the previous checkpoint,
//! as it was.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;

use super::atomic::{sync_dir, write_atomic};
use super::checksum;
use super::file::{acc_dtype, kind_name, st_dtype, to_bytes};
use super::reader::{check_cover, read_index, read_shard_header};
use super::Problem;
use crate::{DType, Device, Error, Key, NDArray, Result, Updater};

/// The `format` metadata entry of every shard file this version writes.
pub(crate) const SHARD_FORMAT: &str = "kvstore-shard/2";

/// The `format` of shard files of the previous version, which carry no token; still read.
pub(crate) const SHARD_FORMAT_1: &str = "kvstore-shard/1";

/// The first line of every index file this version writes.
pub(crate) const INDEX_FORMAT: &str = "kvstore-checkpoint-index/3";

/// The first line of index files of the previous version, which carry no checksum; still read.
pub(crate) const INDEX_FORMAT_2: &str = "kvstore-checkpoint-index/2";

/// The first line of index files of the previous version, which name no token; still read.
pub(crate) const INDEX_FORMAT_1: &str = "kvstore-checkpoint-index/1";

/// One save of a sharded checkpoint: the generation it claimed and the token that marks every
/// shard it writes, so that shards of another save are told apart from its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SaveId {
    /// The generation directory the save owns.
    pub generation: u64,
    /// A random number, unique to the save, written into every shard and into the index.
    pub token: u64,
}

/// A token as files spell it: 16 lowercase hex digits.
pub(crate) fn token_text(token: u64) -> String {
    format!("{token:016x}")
}

/// A token from its spelling in a file, which must be canonical (16 lowercase hex digits).
pub(crate) fn parse_token(text: &str) -> Option<u64> {
    u64::from_str_radix(text, 16)
        .ok()
        .filter(|&t| token_text(t) == text)
}

/// A new save token: 64 random bits from the operating system (`getrandom`), so that saves of
/// two jobs, or two saves of one job, share one with a chance of 2^-64. Fails (with an I/O
/// error that names the cause) only where the system has no random source to read.
fn new_token() -> io::Result<u64> {
    getrandom::u64()
        .map_err(|e| io::Error::other(format!("no random save token from the system: {e}")))
}

/// What a checkpoint records of one key, whole: shared by all its pieces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KeyMeta {
    /// The key, canonically spelled in files as its `Display` writes it.
    pub key: Key,
    /// The dims of the whole value (a piece holds a range of its row-major flattening).
    pub dims: Vec<usize>,
    /// The value's dtype. State buffers are in its accumulator dtype (`float64` for `float64`
    /// values, `float32` otherwise).
    pub dtype: DType,
    /// The key's place in update order: keys are listed by it, and no two keys share it.
    pub order: usize,
    /// The key's updater step count; 0 where it has no state.
    pub step: u64,
    /// Whether the key has updater state (one buffer per state name); a key pushed to under
    /// the updater in force has, a key never pushed to has not.
    pub has_state: bool,
    /// Whether the key is row-sparse (written `sparse=1`; absent for a dense key).
    pub row_sparse: bool,
}

impl KeyMeta {
    /// The description of entry `e`, the `order`-th key in update order.
    pub(crate) fn of(e: &crate::store::Entry, order: usize) -> KeyMeta {
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
/// a push's list of values, each of the whole key's `len` elements (an empty one, a position
/// never pushed, is saved as zeros).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct KeyResiduals {
    pub key: Key,
    pub len: usize,
    pub residuals: Vec<Vec<f32>>,
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
    /// The updater state over `range`, named as [`Updater::state_names`], in that order;
    /// empty exactly when `meta.has_state` is false. Each buffer is 1-D, `range.len()`
    /// elements of the accumulator dtype.
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

/// The generation a `gen-<G>` directory name stands for.
fn parse_generation_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("gen-")?;
    digits
        .parse::<u64>()
        .ok()
        .filter(|g| g.to_string() == digits)
}

/// Every generation directory in `dir`.
fn generations(dir: &Path) -> io::Result<Vec<u64>> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if let Some(g) = entry.file_name().to_str().and_then(parse_generation_dir) {
            found.push(g);
        }
    }
    Ok(found)
}

/// An I/O failure on `path` while saving.
fn write_error(path: &Path, e: io::Error) -> Error {
    Problem::io(false, e).at(path)
}

/// Claims a new generation for a save into `dir`, and mints the save's token. The generation is
/// above every generation there, committed or not, so a save never writes into the remains of
/// an interrupted one, and its directory is created here with an atomic create that fails if
/// it exists: a save that finds it taken (another job saving into `dir` at the same time) takes
/// the next number, so no two saves ever own one generation. Creates `dir` (and its parents)
/// if it does not exist. Rank 0 calls this before a save; the store broadcasts the
/// [`SaveId`] to the other ranks.
pub(crate) fn next_generation(dir: &Path) -> Result<SaveId> {
    if dir.is_file() {
        return Err(Problem::invalid(
            "this path is a file (a single-file checkpoint?), not a checkpoint directory: \
             save a sharded checkpoint to a directory",
        )
        .at(dir));
    }
    fs::create_dir_all(dir).map_err(|e| write_error(dir, e))?;
    let found = generations(dir).map_err(|e| write_error(dir, e))?;
    let committed = match read_index(dir) {
        Ok(index) => Some(index.generation),
        Err(Error::Checkpoint {
            kind: super::CheckpointErrorKind::NotFound,
            ..
        }) => None,
        // A corrupt index is replaced by the next commit; the generations on disk suffice.
        Err(Error::Checkpoint {
            kind: super::CheckpointErrorKind::Invalid,
            ..
        }) => None,
        Err(e) => return Err(e),
    };
    let top = found.into_iter().chain(committed).max();
    let exhausted = |g: u64| {
        Problem::invalid(format!(
            "the generation counter is exhausted (gen-{g}): save to a new directory"
        ))
        .at(dir)
    };
    // u64::MAX is never a generation: the dist store sends it to mean "no generation".
    let mut generation = match top {
        None => 0,
        Some(g) => g
            .checked_add(1)
            .filter(|&n| n < u64::MAX)
            .ok_or_else(|| exhausted(g))?,
    };
    let token = new_token().map_err(|e| write_error(dir, e))?;
    loop {
        let gen_dir = generation_dir(dir, generation);
        match fs::create_dir(&gen_dir) {
            Ok(()) => break,
            // Taken by another save since the directory was listed: the next one.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                generation = generation
                    .checked_add(1)
                    .filter(|&n| n < u64::MAX)
                    .ok_or_else(|| exhausted(generation))?;
            }
            Err(e) => return Err(write_error(&gen_dir, e)),
        }
    }
    sync_dir(dir).map_err(|e| write_error(dir, e))?;
    Ok(SaveId { generation, token })
}

/// Writes the shard of `rank` (of `world` ranks) of save `save` into `dir`:
/// `dir/gen-<generation>/shard-<rank>-of-<world>.safetensors`, marked with the save's token,
/// through a temporary file that is flushed and renamed, so a shard file is either whole or
/// absent. `updater` is the updater in
/// force; every piece with state must hold one buffer per [`Updater::state_names`], in order.
/// A rank holds at most one piece of a key.
///
/// Bad pieces (a range outside the key, a length, dtype or state name that does not match) are
/// [`Error::Checkpoint`] of kind `Invalid` and write nothing.
pub(crate) fn write_shard(
    dir: &Path,
    save: SaveId,
    rank: usize,
    world: usize,
    updater: &Updater,
    pieces: &[Piece],
    residuals: &[KeyResiduals],
) -> Result<()> {
    let gen_dir = generation_dir(dir, save.generation);
    let path = shard_path(&gen_dir, rank, world);
    let bytes =
        encode_shard(save, rank, world, updater, pieces, residuals).map_err(|p| p.at(&path))?;
    fs::create_dir_all(&gen_dir).map_err(|e| write_error(&gen_dir, e))?;
    sync_dir(dir).map_err(|e| write_error(dir, e))?;
    write_atomic(&path, &bytes).map_err(|e| write_error(&path, e))
}

/// The safetensors bytes of one shard.
fn encode_shard(
    save: SaveId,
    rank: usize,
    world: usize,
    updater: &Updater,
    pieces: &[Piece],
    residuals: &[KeyResiduals],
) -> std::result::Result<Vec<u8>, Problem> {
    if rank >= world {
        return Err(Problem::invalid(format!(
            "rank {rank} is not below the world size {world}"
        )));
    }
    let names = updater.state_names();
    // A rank that holds no key may still hold residuals (of keys it pushed): they name the kind.
    let kind = (pieces.iter().map(|p| &p.meta.key))
        .chain(residuals.iter().map(|r| &r.key))
        .next()
        .map(Key::kind);
    let mut meta: HashMap<String, String> = HashMap::new();
    meta.insert("format".into(), SHARD_FORMAT.into());
    meta.insert("generation".into(), save.generation.to_string());
    meta.insert("token".into(), token_text(save.token));
    meta.insert("rank".into(), rank.to_string());
    meta.insert("world".into(), world.to_string());
    meta.insert("key_kind".into(), kind_name(kind).into());
    meta.insert("updater".into(), updater.name().into());
    meta.insert("state_names".into(), names.join(","));

    let mut seen: HashSet<&Key> = HashSet::with_capacity(pieces.len());
    // (name, dtype, len, bytes) of every tensor.
    let mut tensors: Vec<(String, DType, usize, Vec<u8>)> = Vec::new();
    for p in pieces {
        let m = &p.meta;
        let key = &m.key;
        if Some(key.kind()) != kind {
            return Err(Problem::invalid(format!(
                "key {key} is of another kind than key {}: a checkpoint holds int keys or \
                 string keys, not both",
                pieces[0].meta.key
            )));
        }
        if !seen.insert(key) {
            return Err(Problem::invalid(format!(
                "key {key} is given twice: a rank holds at most one piece of a key"
            )));
        }
        let size = m.size();
        if p.range.start > p.range.end || p.range.end > size {
            return Err(Problem::invalid(format!(
                "key {key}: range {:?} is not within its {size} elements",
                p.range
            )));
        }
        let len = p.range.len();
        let check = |what: &str, a: &NDArray, dtype: DType| {
            if a.dtype() != dtype || a.size() != len || a.shape().dims().len() != 1 {
                return Err(Problem::invalid(format!(
                    "key {key}: {what} is {} {}, expected 1-D {dtype} of {len} elements",
                    a.shape(),
                    a.dtype()
                )));
            }
            Ok(())
        };
        check("the value", &p.value, m.dtype)?;
        let state_names_given = p.state.iter().map(|(n, _)| n.as_str());
        // An updater with no state buffers (SGD without momentum) still has a step count.
        if (!m.has_state && !p.state.is_empty())
            || (m.has_state && !state_names_given.eq(names.iter().copied()))
        {
            return Err(Problem::invalid(format!(
                "key {key}: the state buffers must be {names:?} (the updater's state names) \
                 when has_state is set, and none otherwise"
            )));
        }
        let mut spec = format!(
            "order={} start={} end={} dims={}",
            m.order,
            p.range.start,
            p.range.end,
            m.dims
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(",")
        );
        if m.has_state {
            spec.push_str(&format!(" step={}", m.step));
        }
        if m.row_sparse {
            spec.push_str(" sparse=1");
        }
        meta.insert(format!("piece/{key}"), spec);
        tensors.push((
            format!("value/{key}"),
            m.dtype,
            len,
            p.value
                .with_host(to_bytes)
                .map_err(|e| Problem::invalid(format!("key {key}: reading the value: {e}")))?,
        ));
        for (name, buf) in &p.state {
            check(&format!("state buffer {name}"), buf, acc_dtype(m.dtype))?;
            tensors.push((
                format!("state/{key}/{name}"),
                acc_dtype(m.dtype),
                len,
                buf.with_host(to_bytes)
                    .map_err(|e| Problem::invalid(format!("key {key}: reading {name}: {e}")))?,
            ));
        }
    }
    for r in residuals {
        let key = &r.key;
        if kind.is_some_and(|k| k != key.kind()) {
            return Err(Problem::invalid(format!(
                "the residuals of key {key} are of another key kind than the shard's other keys"
            )));
        }
        if let Some(bad) = r
            .residuals
            .iter()
            .find(|v| !v.is_empty() && v.len() != r.len)
        {
            return Err(Problem::invalid(format!(
                "key {key}: a residual of {} elements, expected {}",
                bad.len(),
                r.len
            )));
        }
        meta.insert(
            format!("residuals/{key}"),
            format!("count={} len={}", r.residuals.len(), r.len),
        );
        for (i, v) in r.residuals.iter().enumerate() {
            // A position never pushed keeps no residual: written as zeros.
            let bytes = match v.is_empty() {
                true => vec![0u8; r.len * 4],
                false => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            tensors.push((format!("residual/{key}/{i}"), DType::F32, r.len, bytes));
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
        .map(|(name, dtype, len, bytes)| {
            TensorView::new(st_dtype(*dtype), vec![*len], bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| Problem::invalid(format!("cannot serialize tensor {name}: {e}")))
        })
        .collect::<std::result::Result<Vec<_>, Problem>>()?;
    let mut bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| Problem::invalid(format!("cannot serialize: {e}")))?;
    checksum::seal(&mut bytes)?;
    Ok(bytes)
}

/// Commits save `save` of `world` ranks in `dir`, after every rank's [`write_shard`] returned
/// (rank 0 calls it).
///
/// Reads every shard's header and checks that every shard carries the save's token (a shard
/// another save wrote into this generation is rejected), that the shards agree (updater, key
/// kind, every key's dims, dtype, order and step) and that together they cover every element
/// of every key exactly once. Then it replaces `dir/index` atomically (a temporary file,
/// flushed, renamed, and the directory flushed) to point at the generation and name the
/// token, and removes, best effort, the generations up to the one the index named before
/// (older leftovers of interrupted saves go with them; a generation above that one may be
/// another job's save in progress, and is left to a later commit). On any error the index,
/// and so the checkpoint a load finds, is unchanged: a missing shard is kind `NotFound`, a
/// corrupt or foreign one or a gap or overlap `Invalid`.
pub(crate) fn commit(dir: &Path, save: SaveId, world: usize) -> Result<()> {
    let generation = save.generation;
    let gen_dir = generation_dir(dir, generation);
    let mut shards = Vec::with_capacity(world);
    for rank in 0..world {
        let path = shard_path(&gen_dir, rank, world);
        let header = read_shard_header(&path, generation, rank, world)?;
        if header.token() != Some(save.token) {
            return Err(Problem::invalid(format!(
                "shard {rank} of {world} was written by another save (token {}; this save's is \
                 {}): two jobs are saving into this directory at once (a restarted job while \
                 the old one still runs?), or a shard was copied in; give each job its own \
                 checkpoint directory and save again. The previous checkpoint is unchanged",
                header.token().map_or("none".to_owned(), token_text),
                token_text(save.token)
            ))
            .at(&path));
        }
        shards.push(header);
    }
    check_cover(&gen_dir, shards)?;
    let previous = read_index(dir).ok().map(|i| i.generation);
    let index = checksum::seal_index(&format!(
        "{INDEX_FORMAT}\ngeneration {generation}\nworld {world}\ntoken {}\n",
        token_text(save.token)
    ));
    let path = index_path(dir);
    write_atomic(&path, index.as_bytes()).map_err(|e| write_error(&path, e))?;
    // The generations up to the previous checkpoint are no longer reachable; a failure to
    // remove one leaves only litter.
    if let (Some(previous), Ok(found)) = (previous, generations(dir)) {
        for g in found
            .into_iter()
            .filter(|&g| g <= previous && g != generation)
        {
            let _ = fs::remove_dir_all(generation_dir(dir, g));
        }
    }
    Ok(())
}

/// Test hook: saves `kv` as a sharded checkpoint of `world` ranks in directory `dir`, through
/// the writer and the commit that the ranks of a `dist` store use: keys of `world` elements or
/// more sliced evenly over the ranks, smaller ones whole on one rank each in turn, and the
/// store's compression residuals saved as every rank's own. For tests of sharded checkpoints
/// (a load by another world size, corrupt shards) without a `dist` store.
#[doc(hidden)]
pub fn save_sharded(kv: &crate::KvStore, dir: impl AsRef<Path>, world: usize) -> Result<()> {
    let dir = dir.as_ref();
    if world == 0 {
        return Err(Problem::invalid("a sharded save needs a world of one rank or more").at(dir));
    }
    let (_, updater, entries) = kv.export_entries()?;
    let residuals: Vec<KeyResiduals> = (entries.iter())
        .filter(|e| !e.residuals.is_empty())
        .map(|e| KeyResiduals {
            key: e.key.clone(),
            len: e.shape.size(),
            residuals: e.residuals.clone(),
        })
        .collect();
    let save = next_generation(dir)?;
    for rank in 0..world {
        let pieces = (entries.iter().enumerate())
            .filter_map(|(order, e)| {
                let range = rank_range(e.shape.size(), order, rank, world)?;
                Some(entry_piece(e, order, range, &updater))
            })
            .collect::<Result<Vec<_>>>()?;
        write_shard(dir, save, rank, world, &updater, &pieces, &residuals)?;
    }
    commit(dir, save, world)
}

/// The range of the `order`-th key, of `size` elements, that `rank` of `world` holds in
/// [`save_sharded`]'s layout, if any.
fn rank_range(size: usize, order: usize, rank: usize, world: usize) -> Option<Range<usize>> {
    if size >= world {
        return Some(size * rank / world..size * (rank + 1) / world);
    }
    (order % world == rank).then_some(0..size)
}

/// Elements `range` of entry `e`, the `order`-th key, as a piece: its value, and its state
/// where it has state for `updater`.
fn entry_piece(
    e: &crate::store::Entry,
    order: usize,
    range: Range<usize>,
    updater: &Updater,
) -> Result<Piece> {
    let flat = crate::Shape::new(&[range.len()])?;
    let part =
        |h: &crate::HostData| NDArray::from_host(h.slice_of(range.clone()), flat, Device::Cpu(0));
    let state = match &e.state {
        Some(s) => (updater.state_names().iter().map(|n| n.to_string()))
            .zip(s.bufs.iter().map(part))
            .collect(),
        None => Vec::new(),
    };
    Ok(Piece {
        meta: KeyMeta::of(e, order),
        range: range.clone(),
        value: part(&e.value),
        state,
    })
}

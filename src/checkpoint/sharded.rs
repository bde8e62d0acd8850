//! Sharded checkpoints, the writing side (see the [module docs](super#sharded-checkpoints) for
//! the layout). A save of `world` ranks runs [`next_generation`] on rank 0, which claims a
//! fresh generation and mints the save's token, broadcast as a [`SaveId`]; [`write_shard`] on
//! every rank; a barrier; and [`commit`] on rank 0, which checks the shards and points the
//! index at the new generation. A save that stops before the commit leaves the index as it was.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::ops::Range;
use std::path::Path;

use super::atomic::{sync_dir, write_atomic};
use super::checksum;
use super::entry::Entry;
use super::file::{kind_name, serialize_sealed, Tensor};
use super::layout::{
    acc_dtype, count_of, generation_dir, index_path, shard_path, token_text, KeyMeta, KeyResiduals,
    Piece, INDEX_FORMAT, SHARD_FORMAT,
};
use super::reader::{assemble, open_shard, read_index};
use super::spec::{to_json, PieceSpec, ResidualSpec};
use super::{CheckpointErrorKind, Problem};
use crate::host::to_le_bytes;
use crate::{DType, Device, Error, Key, KeyKind, NDArray, Result, Updater};

/// One save: the generation it claimed and the token that marks every shard it writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SaveId {
    /// The generation directory the save owns.
    pub generation: u64,
    /// A random number, unique to the save, written into every shard and into the index.
    pub token: u64,
}

/// Every generation in `dir`, by its `gen-<G>` directory.
fn generations(dir: &Path) -> io::Result<Vec<u64>> {
    let names = fs::read_dir(dir)?.map(|e| Ok(e?.file_name()));
    let names = names.collect::<io::Result<Vec<_>>>()?;
    Ok((names.iter())
        .filter_map(|n| count_of(n.to_str()?.strip_prefix("gen-")?))
        .collect())
}

/// An I/O failure on `path` while saving.
fn write_error(path: &Path, e: io::Error) -> Error {
    Problem::io(false, e).at(path)
}

/// Claims a new generation for a save into `dir` (created if need be) and mints its token. The
/// generation is above every one there, so a save never writes into the remains of another;
/// one that finds its directory taken (another job saving at once) takes the next number.
pub(crate) fn next_generation(dir: &Path) -> Result<SaveId> {
    if dir.is_file() {
        return Err(Problem::invalid(
            "this path is a file (a single-file checkpoint of an earlier version?), not a \
             checkpoint directory: a save writes a directory, so save to another path (the \
             file still loads)",
        )
        .at(dir));
    }
    // Not its parents: a save into a mistyped path is an error that says so.
    match fs::create_dir(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(write_error(dir, e)),
        _ => {}
    }
    let found = generations(dir).map_err(|e| write_error(dir, e))?;
    let committed = match read_index(dir) {
        Ok(index) => Some(index.generation),
        // A corrupt index is replaced by the next commit; the generations on disk suffice.
        Err(Error::Checkpoint {
            kind: CheckpointErrorKind::NotFound | CheckpointErrorKind::Invalid,
            ..
        }) => None,
        Err(e) => return Err(e),
    };
    let top = found.into_iter().chain(committed).max();
    // u64::MAX is never a generation: the dist store sends it to mean "no generation".
    let after = |g: u64| {
        (g.checked_add(1).filter(|&n| n < u64::MAX)).ok_or_else(|| {
            let why =
                format!("the generation counter is exhausted (gen-{g}): save to a new directory");
            Problem::invalid(why).at(dir)
        })
    };
    let mut generation = top.map_or(Ok(0), after)?;
    // 64 random bits from the system: two saves share a token with a chance of 2^-64.
    let token = getrandom::u64().map_err(|e| {
        let e = io::Error::other(format!("no random save token from the system: {e}"));
        write_error(dir, e)
    })?;
    loop {
        let gen_dir = generation_dir(dir, generation);
        match fs::create_dir(&gen_dir) {
            Ok(()) => break,
            // Taken by another save since the directory was listed: the next one.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => generation = after(generation)?,
            Err(e) => return Err(write_error(&gen_dir, e)),
        }
    }
    sync_dir(dir).map_err(|e| write_error(dir, e))?;
    Ok(SaveId { generation, token })
}

/// Writes the shard of `rank` of `world` of `save` into `dir`, atomically. Every piece with
/// state holds one buffer per [`Updater::state_names`] of `updater`, in order, and a rank holds
/// at most one piece of a key: bad pieces are kind `Invalid` and write nothing.
pub(crate) fn write_shard(
    dir: &Path,
    save: SaveId,
    rank: usize,
    world: usize,
    updater: &Updater,
    pieces: &[Piece],
    residuals: &[KeyResiduals],
) -> Result<()> {
    let path = shard_path(&generation_dir(dir, save.generation), rank, world);
    let bytes =
        encode_shard(save, rank, world, updater, pieces, residuals).map_err(|p| p.at(&path))?;
    put_shard(dir, save, rank, world, &bytes)
}

/// Writes `bytes` as the shard of `rank` of `world` of `save` into `dir`.
fn put_shard(dir: &Path, save: SaveId, rank: usize, world: usize, bytes: &[u8]) -> Result<()> {
    let gen_dir = generation_dir(dir, save.generation);
    let path = shard_path(&gen_dir, rank, world);
    fs::create_dir_all(&gen_dir).map_err(|e| write_error(&gen_dir, e))?;
    sync_dir(dir).map_err(|e| write_error(dir, e))?;
    write_atomic(&path, bytes).map_err(|e| write_error(&path, e))
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
    let mut meta: HashMap<String, String> = HashMap::from([
        ("format".into(), SHARD_FORMAT.into()),
        ("generation".into(), save.generation.to_string()),
        ("token".into(), token_text(save.token)),
        ("rank".into(), rank.to_string()),
        ("world".into(), world.to_string()),
        ("key_kind".into(), kind_name(kind).into()),
        ("updater".into(), updater.name().into()),
        ("state_names".into(), names.join(",")),
    ]);
    let mut tensors: Vec<Tensor> = Vec::new();
    let mut seen: HashSet<&Key> = HashSet::with_capacity(pieces.len());
    for p in pieces {
        check_piece(p, kind, names, &mut seen)?;
        let (m, range) = (&p.meta, &p.range);
        let spec = PieceSpec {
            order: m.order,
            start: range.start,
            end: range.end,
            dims: m.dims.clone(),
            step: m.has_state.then_some(m.step),
            sparse: m.row_sparse,
        };
        let spec = to_json(&spec).map_err(Problem::invalid)?;
        meta.insert(format!("piece/{}", p.meta.key), spec);
        tensors.extend(piece_tensors(p)?);
    }
    for r in residuals {
        check_residuals(r, kind)?;
        let spec = ResidualSpec {
            count: r.residuals.len() as u64,
            len: r.len,
        };
        let spec = to_json(&spec).map_err(Problem::invalid)?;
        meta.insert(format!("residuals/{}", r.key), spec);
        tensors.extend(residual_tensors(r));
    }
    serialize_sealed(meta, &tensors)
}

/// Checks piece `p`: of key `kind`, not in `seen` (which it joins), a range within the key,
/// and value and state buffers (`names`, if it has state) of the right dtype and length.
fn check_piece<'p>(
    p: &'p Piece,
    kind: Option<KeyKind>,
    names: &[&str],
    seen: &mut HashSet<&'p Key>,
) -> std::result::Result<(), Problem> {
    let (m, key) = (&p.meta, &p.meta.key);
    if Some(key.kind()) != kind {
        return Err(Problem::invalid(format!(
            "key {key} is of another kind than the shard's first key: a checkpoint holds int \
             keys or string keys, not both"
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
            "key {key}: the state buffers must be {names:?} (the updater's state names) when \
             has_state is set, and none otherwise"
        )));
    }
    for (name, buf) in &p.state {
        check(&format!("state buffer {name}"), buf, acc_dtype(m.dtype))?;
    }
    Ok(())
}

/// The tensors of checked piece `p`: its value and its state buffers, 1-D.
fn piece_tensors(p: &Piece) -> std::result::Result<Vec<Tensor>, Problem> {
    let (key, len) = (&p.meta.key, p.range.len());
    let tensor = |name: String, what: &str, a: &NDArray| {
        let bytes = (a.with_host(to_le_bytes))
            .map_err(|e| Problem::invalid(format!("key {key}: reading {what}: {e}")))?;
        Ok(Tensor {
            name,
            dtype: a.dtype(),
            shape: vec![len],
            bytes,
        })
    };
    let value = tensor(format!("value/{key}"), "the value", &p.value);
    let state =
        (p.state.iter()).map(|(name, buf)| tensor(format!("state/{key}/{name}"), name, buf));
    std::iter::once(value).chain(state).collect()
}

/// Checks residuals `r`: of key `kind`, each of the key's length or empty (never pushed).
fn check_residuals(r: &KeyResiduals, kind: Option<KeyKind>) -> std::result::Result<(), Problem> {
    let key = &r.key;
    if kind.is_some_and(|k| k != key.kind()) {
        return Err(Problem::invalid(format!(
            "the residuals of key {key} are of another key kind than the shard's other keys"
        )));
    }
    match (r.residuals.iter()).find(|v| !v.is_empty() && v.len() != r.len) {
        Some(bad) => Err(Problem::invalid(format!(
            "key {key}: a residual of {} elements, expected {}",
            bad.len(),
            r.len
        ))),
        None => Ok(()),
    }
}

/// The tensors of checked residuals `r`, one per position; one never pushed is written as zeros.
fn residual_tensors(r: &KeyResiduals) -> impl Iterator<Item = Tensor> + '_ {
    r.residuals.iter().enumerate().map(|(i, v)| Tensor {
        name: format!("residual/{}/{i}", r.key),
        dtype: DType::F32,
        shape: vec![r.len],
        bytes: match v.is_empty() {
            true => vec![0u8; r.len * 4],
            false => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        },
    })
}

/// Commits `save` of `world` ranks in `dir` once every shard is written: checks the shards
/// (the save's token, and that they cover every key exactly once), replaces `dir/index`
/// atomically, and removes the generations up to the one the index named before (one above it
/// may be another job's save in progress). On any error the index is unchanged.
pub(crate) fn commit(dir: &Path, save: SaveId, world: usize) -> Result<()> {
    let generation = save.generation;
    let gen_dir = generation_dir(dir, generation);
    let mut shards = Vec::with_capacity(world);
    for rank in 0..world {
        let path = shard_path(&gen_dir, rank, world);
        let (header, _) = open_shard(&path, generation, rank, world)?;
        if header.token != Some(save.token) {
            return Err(Problem::invalid(format!(
                "shard {rank} of {world} was written by another save (token {}; this save's is \
                 {}): two jobs are saving into this directory at once (a restarted job while \
                 the old one still runs?), or a shard was copied in; give each job its own \
                 checkpoint directory and save again. The previous checkpoint is unchanged",
                header.token.map_or("none".to_owned(), token_text),
                token_text(save.token)
            ))
            .at(&path));
        }
        shards.push(header);
    }
    assemble(&gen_dir, shards)?;
    let previous = read_index(dir).ok().map(|i| i.generation);
    let index = checksum::seal_index(&format!(
        "{INDEX_FORMAT}\ngeneration {generation}\nworld {world}\ntoken {}\n",
        token_text(save.token)
    ));
    let path = index_path(dir);
    write_atomic(&path, index.as_bytes()).map_err(|e| write_error(&path, e))?;
    // Unreachable now; a failure to remove one leaves only litter.
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

/// The range of the `order`-th key that `rank` of `world` holds in `save_sharded`'s layout.
pub(crate) fn rank_range(
    size: usize,
    order: usize,
    rank: usize,
    world: usize,
) -> Option<Range<usize>> {
    if size >= world {
        return Some(size * rank / world..size * (rank + 1) / world);
    }
    (order % world == rank).then_some(0..size)
}

/// Elements `range` of entry `e`, the `order`-th key, as a piece, with its state for `updater`.
pub(crate) fn entry_piece(
    e: &Entry,
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

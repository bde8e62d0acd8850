//! Reading checkpoints by key and element range: a committed sharded directory (any world
//! size, any slicing) or a single file, read as one shard that holds every key whole.
//! Opening reads only the index and the shards' headers; [`Reader::read`] then reads just the
//! bytes of the range asked for, from whichever shards hold them.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::bounded;
use super::checksum::{self, Sums};
use super::file::{check_file, parse_key, parse_kind};
use super::held::{Held, Saved, ShardHeader, Span, Tensors};
use super::layout::{
    acc_dtype, count_of, entries_under, entry, generation_dir, index_path, parse_token, shard_path,
    token_text, KeyMeta, KeyResiduals, Piece, INDEX_FORMAT, INDEX_FORMAT_1, INDEX_FORMAT_2,
    SHARD_FORMAT, SHARD_FORMAT_1, SHARD_FORMAT_2,
};
use super::spec::{PieceSpec, ResidualSpec, Spelling};
use super::Problem;
use crate::host::from_le_bytes;
use crate::{DType, Device, HostData, Key, KeyKind, NDArray, Result, Shape, Updater};

/// What `dir/index` says.
pub(crate) struct Index {
    /// The committed generation.
    pub generation: u64,
    /// The number of shards in it.
    pub world: usize,
    /// The token every shard of the generation carries; `None` in an index of format 1.
    pub token: Option<u64>,
    /// Whether the index carried a checksum (it matched); earlier formats have none.
    pub verified: bool,
}

/// Reads and checks `dir/index`, of any format. No index is kind `NotFound`; a malformed one
/// `Invalid`.
pub(crate) fn read_index(dir: &Path) -> Result<Index> {
    let path = index_path(dir);
    let text = fs::read_to_string(&path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => Problem::io(true, e).with_message(
            "this directory holds no committed checkpoint (no index file): check the path, or \
             save a checkpoint there first",
        ),
        io::ErrorKind::InvalidData => Problem::invalid("the index is not text: it is corrupt"),
        _ => Problem::io(true, e),
    });
    text.and_then(|text| parse_index(&text))
        .map_err(|p| p.at(&path))
}

/// An index from its text; see [`read_index`].
fn parse_index(text: &str) -> std::result::Result<Index, Problem> {
    let bad = || {
        Problem::invalid(format!(
            "the index is corrupt: expected the lines '{INDEX_FORMAT}', 'generation <n>', \
             'world <n>', 'token <16 hex digits>' and '{} <8 hex digits>'; restore it from a \
             copy, or save again",
            checksum::INDEX_ENTRY
        ))
    };
    let (body, verified) = match text.lines().next() {
        Some(INDEX_FORMAT) => (checksum::verify_index(text)?.ok_or_else(bad)?, true),
        _ => (text, false),
    };
    let lines: Vec<&str> = body.lines().collect();
    let (generation, world, token) = match lines[..] {
        [INDEX_FORMAT, generation, world, token] if verified => (generation, world, Some(token)),
        [INDEX_FORMAT_2, generation, world, token] => (generation, world, Some(token)),
        [INDEX_FORMAT_1, generation, world] => (generation, world, None),
        _ => return Err(bad()),
    };
    let field =
        |line: &str, name: &str| Some(line.strip_prefix(name)?.strip_prefix(' ')?.to_owned());
    let generation =
        (field(generation, "generation").and_then(|n| count_of(&n))).ok_or_else(bad)?;
    // Only a count: what it may size is bounded by the shards there (see `open_dir`).
    let world = (field(world, "world").and_then(|w| count_of::<usize>(&w)))
        .filter(|&w| w > 0)
        .ok_or_else(bad)?;
    let token = (token.map(|line| field(line, "token").and_then(|t| parse_token(&t))))
        .map(|t| t.ok_or_else(bad))
        .transpose()?;
    Ok(Index {
        generation,
        world,
        token,
        verified,
    })
}

/// An open file, read at offsets.
pub(super) struct ShardFile {
    path: PathBuf,
    file: File,
    /// The chunk size of its checksums (unused in a file of format 1, which has none).
    chunk: usize,
}

impl ShardFile {
    /// Fills `out` with the bytes of tensor `span` from its byte `from` on, verifying every
    /// chunk they touch before any byte of it is used: whole chunks are read straight into
    /// `out`, a chunk the range starts or ends inside into a buffer.
    fn read_tensor(
        &self,
        span: &Span,
        from: usize,
        out: &mut [u8],
    ) -> std::result::Result<(), Problem> {
        let io = |e| Problem::io(true, e);
        let Some(sums) = &span.sums else {
            return self.read_at(span.start + from as u64, out).map_err(io);
        };
        let (chunk, len, to) = (
            self.chunk,
            (span.end - span.start) as usize,
            from + out.len(),
        );
        debug_assert!(to <= len);
        if out.is_empty() {
            return Ok(());
        }
        // The chunks wholly inside `from..to` (the last chunk ends at `len`, and may be short).
        let whole = from.div_ceil(chunk)..if to == len {
            len.div_ceil(chunk)
        } else {
            to / chunk
        };
        for c in from / chunk..to.div_ceil(chunk) {
            let (cs, ce) = (c * chunk, ((c + 1) * chunk).min(len));
            if whole.contains(&c) {
                if c == whole.start {
                    let dst = &mut out[cs - from..(whole.end * chunk).min(len) - from];
                    self.read_at(span.start + cs as u64, dst).map_err(io)?;
                    checksum::verify_chunks(&span.name, dst, cs, sums, chunk)?;
                }
                continue;
            }
            let mut buf = vec![0u8; ce - cs];
            self.read_at(span.start + cs as u64, &mut buf).map_err(io)?;
            checksum::verify_chunks(&span.name, &buf, cs, sums, chunk)?;
            let (a, b) = (cs.max(from), ce.min(to));
            crate::memcopy::copy(&mut out[a - from..b - from], &buf[a - cs..b - cs]);
        }
        Ok(())
    }

    /// Fills `buf` from byte `offset` on.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            self.file.read_exact_at(buf, offset)
        }
        #[cfg(not(unix))]
        {
            use std::io::Seek;
            // A fresh handle, so concurrent reads do not share a cursor.
            let mut file = File::open(&self.path)?;
            file.seek(io::SeekFrom::Start(offset))?;
            file.read_exact(buf)
        }
    }

    /// Reads and checks the file's header with [`bounded::read_header`].
    fn read_header(&self) -> std::result::Result<bounded::Header, Problem> {
        let len = self
            .file
            .metadata()
            .map_err(|e| Problem::io(true, e))?
            .len();
        bounded::read_header(len, |range| {
            let mut buf = vec![0u8; (range.end - range.start) as usize];
            self.read_at(range.start, &mut buf)
                .map_err(|e| Problem::io(true, e))?;
            Ok(Cow::Owned(buf))
        })
    }
}

/// Opens the shard at `path`, checking that it is shard `rank` of `world` of `generation`.
pub(super) fn open_shard(
    path: &Path,
    generation: u64,
    rank: usize,
    world: usize,
) -> Result<(ShardHeader, ShardFile)> {
    let file = File::open(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => Problem::io(true, e).with_message(format!(
            "shard {rank} of {world} of generation {generation} is missing: the save that \
             wrote it did not finish on every rank; load the previous checkpoint, or save again"
        )),
        _ => Problem::io(true, e),
    });
    let file = file.map_err(|p| p.at(path))?;
    let mut file = ShardFile {
        path: path.to_owned(),
        file,
        chunk: 1,
    };
    let checked = file
        .read_header()
        .and_then(|h| check_shard(&h, generation, rank, world))
        .map_err(|p| p.at(path))?;
    file.chunk = checked.chunk.unwrap_or(1);
    Ok((checked, file))
}

/// What a `piece/<key>` entry says: the key (the caller sets its dtype) and the range held.
fn parse_spec(
    key: Key,
    text: &str,
    spelling: Spelling,
) -> std::result::Result<(KeyMeta, Range<usize>), Problem> {
    let bad = |why: &str| Problem::invalid(format!("metadata piece/{key} = '{text}': {why}"));
    let spec = PieceSpec::parse(text, spelling).map_err(|why| bad(&why))?;
    let shape = Shape::new(&spec.dims).map_err(|e| bad(&e.to_string()))?;
    if spec.step.is_some_and(|s| s > bounded::MAX_STEP) {
        let max = bounded::MAX_STEP;
        return Err(bad(&format!("step is not a count from 0 to {max}")));
    }
    if spec.sparse && shape.ndim() < 2 {
        return Err(bad("a row-sparse key has two or more dimensions"));
    }
    if spec.start > spec.end || spec.end > shape.size() {
        return Err(bad("the range is not within the key's elements"));
    }
    let meta = KeyMeta {
        key,
        dims: spec.dims,
        dtype: DType::F32, // set from the value tensor by the caller
        order: spec.order,
        step: spec.step.unwrap_or(0),
        has_state: spec.step.is_some(),
        row_sparse: spec.sparse,
    };
    Ok((meta, spec.start..spec.end))
}

/// Checks a shard's parsed header against its place and its own tensors.
fn check_shard(
    header: &bounded::Header,
    generation: u64,
    rank: usize,
    world: usize,
) -> std::result::Result<ShardHeader, Problem> {
    let md = header
        .meta
        .metadata()
        .as_ref()
        .ok_or("the shard has no metadata: it was not written by a sharded save")?;
    let get = |name: &str| entry(md, name);
    let (token, sums, spelling) = shard_format(header, md, get("format")?)?;
    for (name, want) in [
        ("generation", generation.to_string()),
        ("rank", rank.to_string()),
        ("world", world.to_string()),
    ] {
        let have = get(name)?;
        if have != want {
            return Err(Problem::invalid(format!(
                "metadata {name} is '{have}' but the file is named for {name} {want}: it was \
                 moved or copied from another checkpoint"
            )));
        }
    }
    let kind = parse_kind(get("key_kind")?)?;
    let updater = get("updater")?.to_owned();
    let state_names = bounded::state_names(get("state_names")?)?;
    let mut tensors = Tensors::new(header, sums.as_ref());
    let pieces = shard_pieces(&mut tensors, md, spelling, kind, &state_names)?;
    let residuals = shard_residuals(&mut tensors, md, spelling, kind)?;
    tensors.all_claimed("piece or residual")?;
    Ok(ShardHeader {
        rank,
        header_crc: header.crc,
        token,
        chunk: sums.map(|s| s.chunk),
        kind,
        updater,
        state_names,
        pieces,
        residuals,
    })
}

/// The token and checksums of a shard of `format` (`None` for format 1), and its spelling.
fn shard_format(
    header: &bounded::Header,
    md: &HashMap<String, String>,
    format: &str,
) -> std::result::Result<(Option<u64>, Option<Sums>, Spelling), Problem> {
    let formats = (&[SHARD_FORMAT, SHARD_FORMAT_2][..], SHARD_FORMAT_1);
    let Some(sums) = checksum::format_sums(
        (&header.meta, header.sealed),
        md,
        format,
        formats,
        &["token"],
        "shard",
    )?
    else {
        return Ok((None, None, Spelling::Fields));
    };
    let text = entry(md, "token")?;
    let token = parse_token(text).ok_or_else(|| {
        Problem::invalid(format!(
            "metadata token '{text}' is not 16 lowercase hex digits: the shard is corrupt"
        ))
    })?;
    let spelling = match format {
        SHARD_FORMAT => Spelling::Json,
        _ => Spelling::Fields,
    };
    Ok((Some(token), Some(sums), spelling))
}

/// The pieces a shard's `piece/<key>` entries name, each checked against its tensors.
fn shard_pieces(
    tensors: &mut Tensors<'_>,
    md: &HashMap<String, String>,
    spelling: Spelling,
    kind: Option<KeyKind>,
    state_names: &[String],
) -> std::result::Result<Vec<Held>, Problem> {
    let mut pieces = Vec::new();
    for (_, text, spec) in entries_under(md, "piece/") {
        let key = parse_key(kind, text)?;
        let (mut km, range) = parse_spec(key, spec, spelling)?;
        let dims = [range.len()];
        let (dtype, value) = tensors.claim(format!("value/{text}"), None, &dims)?;
        km.dtype = dtype;
        let names =
            (state_names.iter().filter(|_| km.has_state)).map(|s| format!("state/{text}/{s}"));
        let state = tensors.claim_each(names, acc_dtype(dtype), &dims)?;
        pieces.push(Held {
            meta: km,
            range,
            file: 0,
            value,
            state,
        });
    }
    Ok(pieces)
}

/// The residuals a shard's `residuals/<key>` entries name, each count bounded first.
fn shard_residuals(
    tensors: &mut Tensors<'_>,
    md: &HashMap<String, String>,
    spelling: Spelling,
    kind: Option<KeyKind>,
) -> std::result::Result<Vec<Saved>, Problem> {
    let present = tensors.header.meta.tensors().len() as u64;
    let mut residuals = Vec::new();
    for (name, text, spec) in entries_under(md, "residuals/") {
        let key = parse_key(kind, text)?;
        let ResidualSpec { count, len } = ResidualSpec::parse(spec, spelling).ok_or_else(|| {
            Problem::invalid(format!(
                "metadata {name} = '{spec}' is not a residuals entry (a count and a length)"
            ))
        })?;
        let count = bounded::count(count, 1, present).ok_or_else(|| {
            Problem::invalid(format!(
                "metadata {name} = '{spec}' declares {count} residual tensors, but the shard \
                 has {present} tensors in all: it is corrupt; restore it from a copy, or save \
                 again"
            ))
        })?;
        let names = (0..count).map(|i| format!("residual/{text}/{i}"));
        residuals.push((key, len, tensors.claim_each(names, DType::F32, &[len])?));
    }
    Ok(residuals)
}

/// Every key of a checkpoint, whole, and the pieces that hold it.
pub(super) struct Assembled {
    kind: Option<KeyKind>,
    updater: String,
    state_names: Vec<String>,
    /// Keys in update order.
    keys: Vec<KeyMeta>,
    /// The pieces of `keys[i]`, by range start.
    held: Vec<Vec<Held>>,
    /// Each shard's residuals, by file.
    residuals: Vec<Vec<Saved>>,
}

/// Puts `shards` together: checks that they agree, that every residual belongs to a key of its
/// length, that keys have distinct places in update order, and that each key's pieces cover
/// its elements exactly once. `at` names the checkpoint in errors.
pub(super) fn assemble(at: &Path, shards: Vec<ShardHeader>) -> Result<Assembled> {
    let invalid = |message: String| Problem::invalid(message).at(at);
    let mut a = gather(shards).map_err(invalid)?;
    check_residual_keys(&a).map_err(invalid)?;
    let mut by_order: Vec<(KeyMeta, Vec<Held>)> = std::mem::take(&mut a.keys)
        .into_iter()
        .zip(std::mem::take(&mut a.held))
        .collect();
    by_order.sort_by_key(|(meta, _)| meta.order);
    if let Some(w) = by_order.windows(2).find(|w| w[0].0.order == w[1].0.order) {
        let (x, y) = (&w[0].0, &w[1].0);
        let why = format!(
            "keys {} and {} share place {} in update order",
            x.key, y.key, y.order
        );
        return Err(invalid(why));
    }
    for (meta, mut list) in by_order {
        list.sort_by_key(|p| (p.range.start, p.range.end));
        check_key_cover(&meta, &list).map_err(invalid)?;
        a.keys.push(meta);
        a.held.push(list);
    }
    Ok(a)
}

/// Every key of `shards` once, with its pieces; the shards must agree on updater, kind, keys.
fn gather(shards: Vec<ShardHeader>) -> std::result::Result<Assembled, String> {
    let Some(first) = shards.first() else {
        return Err("the checkpoint has no shards".to_owned());
    };
    let mut a = Assembled {
        kind: None,
        updater: first.updater.clone(),
        state_names: first.state_names.clone(),
        keys: Vec::new(),
        held: Vec::new(),
        residuals: Vec::with_capacity(shards.len()),
    };
    let mut place: HashMap<Key, usize> = HashMap::new();
    for (file, shard) in shards.into_iter().enumerate() {
        a.residuals.push(shard.residuals);
        if shard.updater != a.updater || shard.state_names != a.state_names {
            return Err(format!(
                "shard {} was saved under updater {} {:?} but shard 0 under {} {:?}: the \
                 shards are from different saves",
                shard.rank, shard.updater, shard.state_names, a.updater, a.state_names
            ));
        }
        if let Some(k) = shard.kind {
            if a.kind.is_some_and(|have| have != k) {
                return Err(format!(
                    "shard {} holds {k} keys but another shard holds the other kind",
                    shard.rank
                ));
            }
            a.kind = Some(k);
        }
        for mut p in shard.pieces {
            p.file = file;
            let i = *place.entry(p.meta.key.clone()).or_insert_with(|| {
                a.keys.push(p.meta.clone());
                a.held.push(Vec::new());
                a.keys.len() - 1
            });
            if a.keys[i] != p.meta {
                return Err(format!(
                    "key {}: shard {} records it as {:?} but another shard as {:?}",
                    p.meta.key, shard.rank, p.meta, a.keys[i]
                ));
            }
            a.held[i].push(p);
        }
    }
    Ok(a)
}

/// Checks that every shard's residuals are of a key the checkpoint holds, of its length.
fn check_residual_keys(a: &Assembled) -> std::result::Result<(), String> {
    let size_of: HashMap<&Key, usize> = a.keys.iter().map(|k| (&k.key, k.size())).collect();
    for (file, saved) in a.residuals.iter().enumerate() {
        for (key, len, _) in saved {
            match size_of.get(key) {
                Some(size) if size == len => {}
                Some(size) => {
                    return Err(format!(
                        "shard {file}: the residuals of key {key} have {len} elements, the key \
                         {size}"
                    ))
                }
                None => {
                    return Err(format!(
                        "shard {file}: residuals of key {key}, which no shard holds"
                    ))
                }
            }
        }
    }
    Ok(())
}

/// Checks that `list`, the pieces of `meta` by range, holds each element exactly once.
fn check_key_cover(meta: &KeyMeta, list: &[Held]) -> std::result::Result<(), String> {
    let key = &meta.key;
    let gap = |from, to| Err(format!("key {key}: elements {from}..{to} are in no shard"));
    let (mut next, mut last_rank) = (0, 0);
    for p in list.iter().filter(|p| !p.range.is_empty()) {
        let Range { start, end } = p.range;
        if start < next {
            return Err(format!(
                "key {key}: elements {start}..{} are held by two shards ({last_rank} and {}): \
                 the shards are from different saves or slicings",
                next.min(end),
                p.file
            ));
        }
        if start > next {
            return gap(next, start);
        }
        (next, last_rank) = (end, p.file);
    }
    match next == meta.size() {
        true => Ok(()),
        false => gap(next, meta.size()),
    }
}

/// A checkpoint open for reading by key and element range.
pub(crate) struct Reader {
    path: PathBuf,
    /// Every key, the pieces that hold it and each shard's residuals (by rank).
    all: Assembled,
    /// Each key's place in `all.keys`.
    place: HashMap<Key, usize>,
    /// One per rank that saved the checkpoint (a single file: one).
    files: Vec<ShardFile>,
    /// Which checkpoint this is, in words that differ for any two saves: see [`Reader::which`].
    which: String,
}

/// Opens a checkpoint directory or single file. A missing path, index or shard is kind
/// `NotFound`; anything malformed, or shards that do not cover every key once, `Invalid`.
pub(crate) fn open(path: &Path) -> Result<Reader> {
    let meta = fs::metadata(path).map_err(|e| Problem::io(true, e).at(path))?;
    if meta.is_dir() {
        open_dir(path)
    } else {
        open_file(path)
    }
}

fn open_dir(dir: &Path) -> Result<Reader> {
    let index = read_index(dir)?;
    let gen_dir = generation_dir(dir, index.generation);
    shards_present(&gen_dir, &index)?;
    let mut shards = Vec::with_capacity(index.world);
    let mut files = Vec::with_capacity(index.world);
    for rank in 0..index.world {
        let path = shard_path(&gen_dir, rank, index.world);
        let (header, file) = open_shard(&path, index.generation, rank, index.world)?;
        if header.token != index.token {
            let spell = |t: Option<u64>| t.map_or("none".to_owned(), token_text);
            return Err(Problem::invalid(format!(
                "shard {rank} of {} of generation {} was written by another save than the \
                 index names (its token is {}, the index names {}): another job wrote into \
                 this checkpoint (two jobs saving into one directory?), or a shard was copied \
                 in; load another checkpoint, or save again, each job to its own directory",
                index.world,
                index.generation,
                spell(header.token),
                spell(index.token)
            ))
            .at(&path));
        }
        shards.push(header);
        files.push(file);
    }
    // Every shard's header, which holds the checksums of its data (format 1: at least its keys).
    let crcs: Vec<u8> = (shards.iter())
        .flat_map(|s| s.header_crc.to_le_bytes())
        .collect();
    let headers = crc32fast::hash(&crcs);
    let a = assemble(&gen_dir, shards)?;
    if index.token.is_none() {
        warn_unverified(
            dir,
            "a sharded checkpoint of format 1, whose shards carry no checksums and no save \
             token, so a corrupt byte or a shard of another save would go unnoticed",
        );
    } else if !index.verified {
        warn_unverified(
            dir,
            "the index of this sharded checkpoint has no checksum (an earlier version wrote \
             it), so a corrupt index would go unnoticed",
        );
    }
    let token = index.token.map_or("none (format 1)".to_owned(), token_text);
    let which = format!(
        "generation {} of the save with token {token}, whose shards' headers have the combined \
         CRC-32 {headers:08x}",
        index.generation
    );
    Ok(Reader::new(dir, a, files, which))
}

/// A warning that the checkpoint at `path` loads unverified, and `why`.
fn warn_unverified(path: &Path, why: &str) {
    log::warn!(
        "{}: {why}; it loads unverified. Save it again to write the current format",
        path.display()
    );
}

/// Checks that `gen_dir` holds a shard for every rank the index names, before anything is
/// sized by that count: naming more (a crafted world of 10^13) is `NotFound`, as a missing one.
fn shards_present(gen_dir: &Path, index: &Index) -> Result<()> {
    let world = index.world;
    let suffix = format!("-of-{world}.safetensors");
    // Spelled as `shard_path` spells it, so that `shard-01-of-2` does not count as rank 1.
    let is_shard = |name: &str| {
        (name.strip_prefix("shard-"))
            .and_then(|n| n.strip_suffix(&suffix))
            .and_then(count_of::<usize>)
            .is_some_and(|r| r < world)
    };
    let present = match fs::read_dir(gen_dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| is_shard(name))
            .count(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
        Err(e) => return Err(Problem::io(true, e).at(gen_dir)),
    };
    if bounded::count(world as u64, 1, present as u64).is_some() {
        return Ok(());
    }
    let missing = io::Error::from(io::ErrorKind::NotFound);
    Err(Problem::io(true, missing)
        .with_message(format!(
            "the index names {world} shards of generation {}, but {present} of them are there: \
             the others are missing (deleted, or the index is corrupt); load another \
             checkpoint, or save again",
            index.generation
        ))
        .at(gen_dir))
}

/// Opens a single file as a world of one shard that holds every key whole.
fn open_file(path: &Path) -> Result<Reader> {
    // Through the handle that later reads by range: one file, even if a save replaces it.
    let io = |e| Problem::io(true, e).at(path);
    let mut file = File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(io)?;
    let header = check_file(&bytes).map_err(|p| p.at(path))?;
    let chunk = header.chunk;
    if chunk.is_none() {
        let why = "a checkpoint of format 1, which has no checksums, so a corrupt byte in it \
                   would go unnoticed";
        warn_unverified(path, why);
    }
    let which = format!(
        "a single file whose header's CRC-32 is {:08x}",
        header.header_crc
    );
    let a = assemble(path, vec![header])?;
    let files = vec![ShardFile {
        path: path.to_owned(),
        file,
        chunk: chunk.unwrap_or(1),
    }];
    Ok(Reader::new(path, a, files, which))
}

impl Reader {
    fn new(path: &Path, all: Assembled, files: Vec<ShardFile>, which: String) -> Reader {
        let place = (all.keys.iter().enumerate())
            .map(|(i, k)| (k.key.clone(), i))
            .collect();
        Reader {
            path: path.to_owned(),
            all,
            place,
            files,
            which,
        }
    }

    /// Which checkpoint this is: the generation, the save's token and a CRC-32 of the shards'
    /// headers (a single file: its header's), which hold the checksums of the data (format 1:
    /// every key, dtype and range), so checkpoints whose bytes differ are told apart. Ranks
    /// compare it, so that ranks that found different checkpoints at one path fail.
    pub(crate) fn which(&self) -> &str {
        &self.which
    }

    /// The compression residuals rank `rank` of `world` saved: `None` if another world saved.
    pub(crate) fn rank_residuals(
        &self,
        rank: usize,
        world: usize,
    ) -> Result<Option<Vec<KeyResiduals>>> {
        if self.files.len() != world {
            return Ok(None);
        }
        let (Some(file), Some(saved)) = (self.files.get(rank), self.all.residuals.get(rank)) else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(saved.len());
        for (key, len, spans) in saved {
            let mut residuals = Vec::with_capacity(spans.len());
            for span in spans {
                // Checked when the shard was opened; checked again where it sizes a buffer.
                let n = bounded::Cursor::new(span.end - span.start)
                    .count(*len as u64, 4, "residual elements")
                    .map_err(|p| p.at(&file.path))?;
                let mut bytes = vec![0u8; n * 4];
                file.read_tensor(span, 0, &mut bytes)
                    .map_err(|e| e.at(&file.path))?;
                residuals.push(from_le_bytes(DType::F32, &bytes).to_vec::<f32>());
            }
            out.push(KeyResiduals {
                key: key.clone(),
                len: *len,
                residuals,
            });
        }
        Ok(Some(out))
    }

    /// Reads and verifies every byte, one key at a time, keeping none: a corrupt checkpoint is
    /// `Invalid`, whatever else is wrong with it.
    pub(crate) fn verify(&self) -> Result<()> {
        for (i, meta) in self.all.keys.iter().enumerate() {
            self.read_host(i, 0..meta.size())?;
        }
        for rank in 0..self.files.len() {
            self.rank_residuals(rank, self.files.len())?;
        }
        Ok(())
    }

    /// Every key of the checkpoint, whole, in update order.
    pub(crate) fn keys(&self) -> &[KeyMeta] {
        &self.all.keys
    }

    /// The key kind: `None` for a checkpoint with no keys.
    pub(crate) fn key_kind(&self) -> Option<KeyKind> {
        self.all.kind
    }

    /// The [`name`](Updater::name) of the updater the checkpoint was saved under.
    #[cfg(test)]
    pub(crate) fn updater_name(&self) -> &str {
        &self.all.updater
    }

    /// The state buffer names of that updater, as [`Updater::state_names`].
    #[cfg(test)]
    pub(crate) fn state_names(&self) -> &[String] {
        &self.all.state_names
    }

    /// Whether the saved state fits `updater`: the same name and state buffers.
    pub(crate) fn state_fits(&self, updater: &Updater) -> bool {
        self.all.updater == updater.name() && self.all.state_names.iter().eq(updater.state_names())
    }

    /// Elements `range` of `key`, value and state. A key the checkpoint lacks, or a range
    /// outside it, is kind `Mismatch`; a read failure `Io`.
    pub(crate) fn read(&self, key: &Key, range: Range<usize>) -> Result<Piece> {
        let i = self.place.get(key).copied().ok_or_else(|| {
            Problem::mismatch(format!("key {key} is not in this checkpoint")).at(&self.path)
        })?;
        let (value, state) = self.read_host(i, range.clone())?;
        let shape = Shape::new(&[range.len()])?;
        let meta = self.all.keys[i].clone();
        let state = (self.all.state_names.iter())
            .cloned()
            .zip(state)
            .map(|(n, b)| (n, NDArray::from_host(b, shape, Device::Cpu(0))))
            .collect();
        Ok(Piece {
            meta,
            range,
            value: NDArray::from_host(value, shape, Device::Cpu(0)),
            state,
        })
    }

    /// Elements `range` of `keys[i]` as host data: the value and its state buffers.
    fn read_host(&self, i: usize, range: Range<usize>) -> Result<(HostData, Vec<HostData>)> {
        let meta = &self.all.keys[i];
        if range.start > range.end || range.end > meta.size() {
            return Err(Problem::mismatch(format!(
                "key {}: range {range:?} is not within its {} elements",
                meta.key,
                meta.size()
            ))
            .at(&self.path));
        }
        let (vsize, acc) = (meta.dtype.size(), acc_dtype(meta.dtype));
        let asize = acc.size();
        let buffers = if meta.has_state {
            self.all.state_names.len()
        } else {
            0
        };
        let mut value = vec![0u8; range.len() * vsize];
        let mut state = vec![vec![0u8; range.len() * asize]; buffers];
        for p in &self.all.held[i] {
            let (lo, hi) = (p.range.start.max(range.start), p.range.end.min(range.end));
            if lo >= hi {
                continue;
            }
            let file = &self.files[p.file];
            let (from, to) = (lo - p.range.start, lo - range.start);
            let n = hi - lo;
            // Verified against the shard's checksums as it is read, before any of it is used.
            let read = |span: &Span, size: usize, out: &mut [u8]| {
                debug_assert!(span.start + (hi - p.range.start) as u64 * size as u64 <= span.end);
                file.read_tensor(span, from * size, &mut out[to * size..(to + n) * size])
                    .map_err(|e| e.at(&file.path))
            };
            read(&p.value, vsize, &mut value)?;
            for (span, out) in p.state.iter().zip(&mut state) {
                read(span, asize, out)?;
            }
        }
        let value = from_le_bytes(meta.dtype, &value);
        let state = state.iter().map(|b| from_le_bytes(acc, b)).collect();
        Ok((value, state))
    }
}

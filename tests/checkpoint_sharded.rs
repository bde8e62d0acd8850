//! `KvStore::load` of a sharded checkpoint directory (the layout the ranks of a `dist` store
//! save, documented in `kvstore::checkpoint`), written here by hand from that documentation
//! with the safetensors crate, so the reader is checked against the format and not against its
//! own writer.
//!
//! Random keys are split over 1 to 4 simulated ranks (whole keys and slices), loaded into a
//! `local` store (and a `device` store: `gpu::*`, ignored without a GPU) and compared with the
//! arrays they were made from; the updater state is checked by training on after the load,
//! against the same checkpoint in the single-file format. The shards are of the current format
//! (JSON `piece/` entries); files of format 1 (no checksums, no tokens) and shards of format 2
//! (`name=value` entries) still load. Then the failures: a save killed part way, missing and truncated
//! shards, gaps and overlaps, corrupt indexes, key spellings that are not canonical, shards of
//! another save, and flipped bits. Every failure is an `Error::Checkpoint` of the right kind,
//! and leaves the store as it was.

#[path = "common/checkpoint_format.rs"]
mod checkpoint_format;
mod common;

use std::collections::HashMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use common::Home;
use half::{bf16, f16};
use kvstore::{Adam, CheckpointErrorKind, DType, Error, Key, KvStore, NDArray, Sgd, Updater};
use rand::prelude::*;
use safetensors::tensor::Dtype;

/// A fresh directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvstore-sharded-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn adam() -> Updater {
    Updater::Adam(Adam {
        lr: 0.02,
        wd: 0.001,
        ..Adam::default()
    })
}

fn sgd_momentum() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.05,
        momentum: 0.9,
        wd: 0.01,
        ..Sgd::default()
    })
}

/// The accumulator dtype that state buffers of `dtype` values are kept in.
fn acc(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Little-endian bytes of `v` in `dtype` (values already representable in it).
fn bytes(v: &[f64], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        DType::F64 => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f64(x).to_le_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f64(x).to_le_bytes())
            .collect(),
    }
}

fn st(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
    }
}

/// Random elements exactly representable in `dtype`.
fn random(rng: &mut StdRng, n: usize, dtype: DType) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let x: f64 = rng.gen_range(-3.0..3.0);
            match dtype {
                DType::F32 => x as f32 as f64,
                DType::F16 => f16::from_f64(x).to_f64(),
                DType::BF16 => bf16::from_f64(x).to_f64(),
                _ => x,
            }
        })
        .collect()
}

/// One key of a test checkpoint.
struct Truth {
    key: Key,
    order: usize,
    dims: Vec<usize>,
    dtype: DType,
    value: Vec<f64>,
    /// (step, one buffer per state name), if the key has state.
    state: Option<(u64, Vec<Vec<f64>>)>,
}

impl Truth {
    fn size(&self) -> usize {
        self.dims.iter().product()
    }
}

fn truths(rng: &mut StdRng, updater: &Updater, count: usize, string_keys: bool) -> Vec<Truth> {
    let shapes: [&[usize]; 5] = [&[6, 4], &[19], &[], &[2, 2, 5], &[33]];
    let mut orders: Vec<usize> = (0..count).collect();
    orders.shuffle(rng);
    (0..count)
        .map(|i| {
            let dims = shapes[rng.gen_range(0..shapes.len())].to_vec();
            let dtype = [DType::F32, DType::F64, DType::F16, DType::BF16][rng.gen_range(0..4)];
            let n: usize = dims.iter().product();
            let names = updater.state_names();
            let state = (!names.is_empty() && rng.gen_bool(0.8)).then(|| {
                let bufs = names
                    .iter()
                    // Adam's variance is never negative.
                    .map(|_| random(rng, n, acc(dtype)).iter().map(|x| x.abs()).collect())
                    .collect();
                (rng.gen_range(1..50u64), bufs)
            });
            Truth {
                key: if string_keys {
                    Key::Str(format!("block{i}.weight"))
                } else {
                    Key::Int(100 - 9 * i as i32)
                },
                order: orders[i],
                dims,
                dtype,
                value: random(rng, n, dtype),
                state,
            }
        })
        .collect()
}

/// A piece of a key in a hand-written shard; `spelling` overrides the key's name in the file.
struct HandPiece<'a> {
    truth: &'a Truth,
    range: Range<usize>,
    spelling: Option<String>,
}

/// The token of the save that wrote generation `g` in these tests.
fn token_of(g: u64) -> u64 {
    0x9e37_79b9_7f4a_7c15 ^ g.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// Writes shard `rank` of `world` of generation `g` by hand, as the module docs describe it,
/// in the current format, marked with the generation's token, with checksums.
fn write_shard(
    dir: &Path,
    g: u64,
    rank: usize,
    world: usize,
    updater: &Updater,
    pieces: &[HandPiece],
) {
    write_shard_as(dir, g, Some(token_of(g)), rank, world, updater, pieces);
}

/// As [`write_shard`], marked with `token`; `None` writes a shard of format 1 (no token, no
/// checksums).
fn write_shard_as(
    dir: &Path,
    g: u64,
    token: Option<u64>,
    rank: usize,
    world: usize,
    updater: &Updater,
    pieces: &[HandPiece],
) {
    let format = match token {
        Some(_) => ShardFormat::Json,
        None => ShardFormat::Fields,
    };
    write_shard_in(dir, g, token, format, rank, world, updater, pieces);
}

/// How a hand-written shard spells its `piece/` entries.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ShardFormat {
    /// This version's: a JSON object (`kvstore-shard/3`).
    Json,
    /// Earlier versions': `name=value` fields (`kvstore-shard/2` with a token,
    /// `kvstore-shard/1` without).
    Fields,
}

/// The `piece/` entry of `p`, spelled as `format` says.
fn piece_entry(p: &HandPiece, format: ShardFormat) -> String {
    let t = p.truth;
    let step = t.state.as_ref().map(|(step, _)| *step);
    match format {
        ShardFormat::Json => {
            let mut spec = serde_json::json!({
                "order": t.order,
                "start": p.range.start,
                "end": p.range.end,
                "dims": t.dims,
            });
            if let Some(step) = step {
                spec["step"] = step.into();
            }
            spec.to_string()
        }
        ShardFormat::Fields => {
            let dims: Vec<String> = t.dims.iter().map(usize::to_string).collect();
            let mut spec = format!(
                "order={} start={} end={} dims={}",
                t.order,
                p.range.start,
                p.range.end,
                dims.join(",")
            );
            if let Some(step) = step {
                spec.push_str(&format!(" step={step}"));
            }
            spec
        }
    }
}

/// As [`write_shard_as`], in `format`.
#[allow(clippy::too_many_arguments)]
fn write_shard_in(
    dir: &Path,
    g: u64,
    token: Option<u64>,
    format: ShardFormat,
    rank: usize,
    world: usize,
    updater: &Updater,
    pieces: &[HandPiece],
) {
    let names = updater.state_names();
    let mut meta: HashMap<String, String> = HashMap::new();
    match (token, format) {
        (Some(t), _) => {
            let name = match format {
                ShardFormat::Json => "kvstore-shard/3",
                ShardFormat::Fields => "kvstore-shard/2",
            };
            meta.insert("format".into(), name.into());
            meta.insert("token".into(), format!("{t:016x}"));
        }
        (None, _) => {
            meta.insert("format".into(), "kvstore-shard/1".into());
        }
    }
    meta.insert("generation".into(), g.to_string());
    meta.insert("rank".into(), rank.to_string());
    meta.insert("world".into(), world.to_string());
    let kind = match pieces.first().map(|p| &p.truth.key) {
        Some(Key::Int(_)) => "int",
        Some(_) => "str",
        None => "none",
    };
    meta.insert("key_kind".into(), kind.into());
    meta.insert("updater".into(), updater.name().into());
    meta.insert("state_names".into(), names.join(","));
    let mut tensors: Vec<(String, Dtype, usize, Vec<u8>)> = Vec::new();
    for p in pieces {
        let t = p.truth;
        let name = p.spelling.clone().unwrap_or_else(|| t.key.to_string());
        let r = p.range.clone();
        tensors.push((
            format!("value/{name}"),
            st(t.dtype),
            r.len(),
            bytes(&t.value[r.clone()], t.dtype),
        ));
        if let Some((_, bufs)) = &t.state {
            for (s, buf) in names.iter().zip(bufs) {
                tensors.push((
                    format!("state/{name}/{s}"),
                    st(acc(t.dtype)),
                    r.len(),
                    bytes(&buf[r.clone()], acc(t.dtype)),
                ));
            }
        }
        meta.insert(format!("piece/{name}"), piece_entry(p, format));
    }
    let shapes: Vec<[usize; 1]> = tensors.iter().map(|t| [t.2]).collect();
    let views: Vec<checkpoint_format::Tensor> = tensors
        .iter()
        .zip(&shapes)
        .map(|((n, d, _, b), shape)| (n.as_str(), *d, &shape[..], b.as_slice()))
        .collect();
    let data = match token {
        Some(_) => checkpoint_format::sealed(&views, meta),
        None => checkpoint_format::plain(&views, meta),
    };
    let gen_dir = dir.join(format!("gen-{g}"));
    fs::create_dir_all(&gen_dir).unwrap();
    fs::write(
        gen_dir.join(format!("shard-{rank}-of-{world}.safetensors")),
        data,
    )
    .unwrap();
}

/// Writes the index in the current format, naming generation `g`'s token, with its checksum
/// line: the CRC-32 of the lines before it.
fn write_index(dir: &Path, g: u64, world: usize) {
    let body = format!(
        "kvstore-checkpoint-index/3\ngeneration {g}\nworld {world}\ntoken {:016x}\n",
        token_of(g)
    );
    let text = format!("{body}crc32 {:08x}\n", crc32fast::hash(body.as_bytes()));
    fs::write(dir.join("index"), text).unwrap();
}

/// Writes an index of format 2, which has no checksum line.
fn write_index_2(dir: &Path, g: u64, world: usize) {
    let text = format!(
        "kvstore-checkpoint-index/2\ngeneration {g}\nworld {world}\ntoken {:016x}\n",
        token_of(g)
    );
    fs::write(dir.join("index"), text).unwrap();
}

/// Writes an index of format 1, which names no token.
fn write_index_1(dir: &Path, g: u64, world: usize) {
    let text = format!("kvstore-checkpoint-index/1\ngeneration {g}\nworld {world}\n");
    fs::write(dir.join("index"), text).unwrap();
}

/// Random contiguous ranges, one per rank, covering `0..n` (some may be empty).
fn cuts(rng: &mut StdRng, n: usize, parts: usize) -> Vec<Range<usize>> {
    let mut at: Vec<usize> = (1..parts).map(|_| rng.gen_range(0..=n)).collect();
    at.sort_unstable();
    let mut bounds = vec![0];
    bounds.extend(at);
    bounds.push(n);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

/// Writes generation `g` of `truths` over `world` ranks (each key whole on one rank, or sliced
/// over all), and the index.
fn write_sharded(
    dir: &Path,
    rng: &mut StdRng,
    g: u64,
    world: usize,
    updater: &Updater,
    truths: &[Truth],
) {
    let mut ranks: Vec<Vec<HandPiece>> = (0..world).map(|_| Vec::new()).collect();
    for t in truths {
        if world > 1 && t.size() >= 2 && rng.gen_bool(0.6) {
            for (r, range) in cuts(rng, t.size(), world).into_iter().enumerate() {
                ranks[r].push(HandPiece {
                    truth: t,
                    range,
                    spelling: None,
                });
            }
        } else {
            let r = rng.gen_range(0..world);
            ranks[r].push(HandPiece {
                truth: t,
                range: 0..t.size(),
                spelling: None,
            });
        }
    }
    for (rank, pieces) in ranks.iter().enumerate() {
        write_shard(dir, g, rank, world, updater, pieces);
    }
    write_index(dir, g, world);
}

/// The same keys as a single-file checkpoint, by hand, as the module docs describe it, with
/// checksums.
fn write_single_file(path: &Path, updater: &Updater, truths: &[Truth]) {
    write_single_file_as(path, updater, truths, false);
}

/// As [`write_single_file`]; of format 1 (no checksums) when `format_1` is set.
fn write_single_file_as(path: &Path, updater: &Updater, truths: &[Truth], format_1: bool) {
    let names = updater.state_names();
    let mut meta: HashMap<String, String> = HashMap::new();
    let format = if format_1 {
        "kvstore-checkpoint/1"
    } else {
        "kvstore-checkpoint/2"
    };
    meta.insert("format".into(), format.into());
    let kind = if matches!(truths[0].key, Key::Int(_)) {
        "int"
    } else {
        "str"
    };
    meta.insert("key_kind".into(), kind.into());
    meta.insert("keys".into(), truths.len().to_string());
    meta.insert("updater".into(), updater.name().into());
    meta.insert("state_names".into(), names.join(","));
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for t in truths {
        meta.insert(format!("order/{}", t.key), t.order.to_string());
        tensors.push((
            format!("value/{}", t.key),
            st(t.dtype),
            t.dims.clone(),
            bytes(&t.value, t.dtype),
        ));
        if let Some((step, bufs)) = &t.state {
            meta.insert(format!("step/{}", t.key), step.to_string());
            for (s, buf) in names.iter().zip(bufs) {
                tensors.push((
                    format!("state/{}/{s}", t.key),
                    st(acc(t.dtype)),
                    t.dims.clone(),
                    bytes(buf, acc(t.dtype)),
                ));
            }
        }
    }
    let views: Vec<checkpoint_format::Tensor> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    let data = match format_1 {
        false => checkpoint_format::sealed(&views, meta),
        true => checkpoint_format::plain(&views, meta),
    };
    fs::write(path, data).unwrap();
}

fn pull(kv: &KvStore, t: &Truth) -> Vec<f64> {
    let out = NDArray::zeros(kvstore::Shape::new(&t.dims).unwrap())
        .astype(t.dtype)
        .unwrap();
    kv.pull(t.key.clone(), &out).unwrap();
    out.to_vec::<f64>().unwrap()
}

fn store(updater: &Updater) -> KvStore {
    store_on(Home::Cpu, updater)
}

/// A fresh store on home `h` (`local` or `device`) with `updater`.
fn store_on(h: Home, updater: &Updater) -> KvStore {
    let kv = h.store();
    kv.set_updater(updater.clone()).unwrap();
    kv
}

on_every_home!(every_world_size_loads_and_trains_on);

/// Checkpoints of 1 to 4 ranks load into a store on `h` (`local`, or `device` on the GPUs) with
/// their values, and their state: training on matches the same keys loaded from a single file.
fn every_world_size_loads_and_trains_on(h: Home) {
    let mut rng = StdRng::from_entropy();
    for (u, updater) in [adam(), sgd_momentum()].iter().enumerate() {
        for world in 1..=4 {
            let dir = temp_dir(&format!("worlds-{h:?}-{u}-{world}"));
            let truths = truths(&mut rng, updater, 8, world % 2 == 1);
            let sharded = dir.join("ckpt");
            fs::create_dir_all(&sharded).unwrap();
            write_sharded(&sharded, &mut rng, 3, world, updater, &truths);
            let single = dir.join("single.safetensors");
            write_single_file(&single, updater, &truths);

            let a = store_on(h, updater);
            a.load(&sharded).unwrap();
            let b = store_on(h, updater);
            b.load(&single).unwrap();
            // Update order: string keys in the checkpoint's order, int keys ascending.
            let mut by_order: Vec<&Truth> = truths.iter().collect();
            by_order.sort_by_key(|t| t.order);
            let mut want: Vec<Key> = by_order.iter().map(|t| t.key.clone()).collect();
            if matches!(want[0], Key::Int(_)) {
                want.sort_by_key(|k| match k {
                    Key::Int(i) => *i,
                    _ => unreachable!("int keys only"),
                });
            }
            assert_eq!(a.keys(), want, "keys in update order");
            for t in &truths {
                assert_eq!(pull(&a, t), t.value, "key {} at world {world}", t.key);
            }
            // The state (moments, steps) came back: training on matches the single file's.
            for _ in 0..2 {
                for t in &truths {
                    let g = NDArray::from_vec(
                        random(&mut rng, t.size(), t.dtype),
                        kvstore::Shape::new(&t.dims).unwrap(),
                    )
                    .unwrap()
                    .astype(t.dtype)
                    .unwrap();
                    a.push(t.key.clone(), &g).unwrap();
                    b.push(t.key.clone(), &g).unwrap();
                    assert_eq!(pull(&a, t), pull(&b, t), "key {} after a push", t.key);
                }
            }
            // And not by chance: a store that started afresh (no state) differs.
            let fresh = store_on(h, updater);
            fresh.set_updater(Updater::Assign).unwrap();
            fresh.load(&sharded).unwrap();
            fresh.set_updater(updater.clone()).unwrap();
            // The stateful key with the most elements: in a one-element f16 or bf16 key the
            // state's effect can round away (seen in CI: 2.90625 both ways).
            let stateful = truths
                .iter()
                .filter(|t| t.state.is_some() && t.size() > 1)
                .max_by_key(|t| t.size());
            if let Some(t) = stateful {
                let c = store_on(h, updater);
                c.load(&sharded).unwrap();
                let g = NDArray::from_vec(
                    random(&mut rng, t.size(), t.dtype),
                    kvstore::Shape::new(&t.dims).unwrap(),
                )
                .unwrap()
                .astype(t.dtype)
                .unwrap();
                c.push(t.key.clone(), &g).unwrap();
                fresh.push(t.key.clone(), &g).unwrap();
                assert_ne!(
                    pull(&c, t),
                    pull(&fresh, t),
                    "key {}: the state made no difference",
                    t.key
                );
            }
            fs::remove_dir_all(&dir).unwrap();
        }
    }
}

fn checkpoint_kind(result: kvstore::Result<()>) -> CheckpointErrorKind {
    match result {
        Err(Error::Checkpoint { kind, .. }) => kind,
        other => panic!("expected Error::Checkpoint, got {other:?}"),
    }
}

/// A store holding `truths` (loaded from a good checkpoint), to check that failed loads leave
/// it unchanged.
fn loaded(dir: &Path, rng: &mut StdRng, truths: &[Truth]) -> KvStore {
    write_sharded(dir, rng, 0, 2, &adam(), truths);
    let kv = store(&adam());
    kv.load(dir).unwrap();
    kv
}

fn assert_unchanged(kv: &KvStore, truths: &[Truth]) {
    assert_eq!(kv.keys().len(), truths.len());
    for t in truths {
        assert_eq!(pull(kv, t), t.value, "key {}", t.key);
    }
}

#[test]
fn a_save_killed_part_way_loads_the_previous_checkpoint() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("killed");
    let old = truths(&mut rng, &adam(), 5, false);
    write_sharded(&dir, &mut rng, 4, 3, &adam(), &old);
    // The next save wrote its shards (and a half-written temporary file), but never committed.
    let new = truths(&mut rng, &adam(), 5, false);
    let refs: Vec<HandPiece> = new
        .iter()
        .map(|t| HandPiece {
            truth: t,
            range: 0..t.size(),
            spelling: None,
        })
        .collect();
    write_shard(&dir, 5, 0, 2, &adam(), &refs);
    write_shard(&dir, 5, 1, 2, &adam(), &[]);
    fs::write(
        dir.join("gen-5/.shard-1-of-2.safetensors.tmp-7-0"),
        [1u8, 2, 3],
    )
    .unwrap();
    let kv = store(&adam());
    kv.load(&dir).unwrap();
    assert_unchanged(&kv, &old);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_and_truncated_shards() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("shards");
    let truths = truths(&mut rng, &adam(), 4, false);
    let kv = loaded(&dir, &mut rng, &truths);
    // The index names 3 ranks; there are 2 shards.
    write_index(&dir, 0, 3);
    assert_eq!(
        checkpoint_kind(kv.load(&dir)),
        CheckpointErrorKind::NotFound
    );
    // A truncated shard.
    write_sharded(&dir, &mut rng, 1, 2, &adam(), &truths);
    let path = dir.join("gen-1/shard-1-of-2.safetensors");
    let b = fs::read(&path).unwrap();
    fs::write(&path, &b[..b.len() - 1]).unwrap();
    assert_eq!(checkpoint_kind(kv.load(&dir)), CheckpointErrorKind::Invalid);
    fs::write(&path, b"not a shard").unwrap();
    assert_eq!(checkpoint_kind(kv.load(&dir)), CheckpointErrorKind::Invalid);
    // A shard from another generation, renamed into this one.
    fs::copy(dir.join("gen-0/shard-1-of-2.safetensors"), &path).unwrap();
    assert_eq!(checkpoint_kind(kv.load(&dir)), CheckpointErrorKind::Invalid);
    // A directory with no checkpoint at all.
    let empty = dir.join("empty");
    fs::create_dir_all(&empty).unwrap();
    assert_eq!(
        checkpoint_kind(kv.load(&empty)),
        CheckpointErrorKind::NotFound
    );
    assert_unchanged(&kv, &truths);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gaps_and_overlaps_are_invalid() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("cover");
    let held = truths(&mut rng, &adam(), 3, false);
    let kv = loaded(&dir, &mut rng, &held);
    let mut t = truths(&mut rng, &adam(), 1, false).remove(0);
    t.dims = vec![12];
    t.value = random(&mut rng, 12, t.dtype);
    t.state = None;
    let layouts: [&[Range<usize>]; 4] = [
        &[0..7, 5..12],
        &[0..5, 6..12],
        &[0..5, 5..11],
        &[0..12, 0..12],
    ];
    for (g, ranges) in layouts.into_iter().enumerate() {
        let g = g as u64 + 1;
        for (rank, range) in ranges.iter().enumerate() {
            let piece = HandPiece {
                truth: &t,
                range: range.clone(),
                spelling: None,
            };
            write_shard(&dir, g, rank, ranges.len(), &adam(), &[piece]);
        }
        write_index(&dir, g, ranges.len());
        assert_eq!(
            checkpoint_kind(kv.load(&dir)),
            CheckpointErrorKind::Invalid,
            "{ranges:?}"
        );
    }
    assert_unchanged(&kv, &held);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_indexes_are_invalid() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("index");
    let truths = truths(&mut rng, &adam(), 3, false);
    let kv = loaded(&dir, &mut rng, &truths);
    for junk in [
        "",
        "kvstore-checkpoint-index/1\n",
        "kvstore-checkpoint-index/1\ngeneration x\nworld 2\n",
        "kvstore-checkpoint-index/1\ngeneration +0\nworld 2\n",
        "kvstore-checkpoint-index/1\ngeneration 0\nworld 02\n",
        "kvstore-checkpoint-index/1\ngeneration 0\nworld 2\nextra\n",
        "kvstore-checkpoint-index/2\ngeneration 0\nworld 2\n",
        "kvstore-checkpoint-index/3\ngeneration 0\nworld 2\ntoken 0000000000000001\n",
        "kvstore-checkpoint-index/2\ngeneration 0\nworld 2\ntoken 1\n",
        "kvstore-checkpoint-index/2\ngeneration 0\nworld 2\ntoken 000000000000000A\n",
        "kvstore-checkpoint-index/2\ngeneration 0\nworld 2\ntoken 00000000000000000\n",
        "kvstore-checkpoint-index/2\ngeneration 0\nworld 2\ntokens 0000000000000001\n",
    ] {
        fs::write(dir.join("index"), junk).unwrap();
        assert_eq!(
            checkpoint_kind(kv.load(&dir)),
            CheckpointErrorKind::Invalid,
            "{junk:?}"
        );
    }
    assert_unchanged(&kv, &truths);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn key_spellings_must_be_canonical() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("spelling");
    let held = truths(&mut rng, &adam(), 2, false);
    let kv = loaded(&dir, &mut rng, &held);
    let mut t = truths(&mut rng, &adam(), 1, false).remove(0);
    t.key = Key::Int(5);
    for (g, spelling) in ["05", "+5", " 5", "5 "].into_iter().enumerate() {
        let g = g as u64 + 1;
        let piece = HandPiece {
            truth: &t,
            range: 0..t.size(),
            spelling: Some(spelling.into()),
        };
        write_shard(&dir, g, 0, 1, &adam(), &[piece]);
        write_index(&dir, g, 1);
        assert_eq!(
            checkpoint_kind(kv.load(&dir)),
            CheckpointErrorKind::Invalid,
            "{spelling:?}"
        );
    }
    // One key spelled two ways over two shards (5 and 05) is not one key covered twice.
    let g = 10;
    let n = t.size().max(1);
    t.dims = vec![n];
    t.value = random(&mut rng, n, t.dtype);
    t.state = None;
    write_shard(
        &dir,
        g,
        0,
        2,
        &adam(),
        &[HandPiece {
            truth: &t,
            range: 0..n,
            spelling: None,
        }],
    );
    write_shard(
        &dir,
        g,
        1,
        2,
        &adam(),
        &[HandPiece {
            truth: &t,
            range: 0..n,
            spelling: Some("05".into()),
        }],
    );
    write_index(&dir, g, 2);
    assert_eq!(checkpoint_kind(kv.load(&dir)), CheckpointErrorKind::Invalid);
    assert_unchanged(&kv, &held);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_key_of_another_shape_is_a_mismatch() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("mismatch");
    let truths = truths(&mut rng, &adam(), 3, false);
    write_sharded(&dir, &mut rng, 0, 3, &adam(), &truths);
    let kv = store(&adam());
    let t = &truths[0];
    let other =
        NDArray::from_vec(random(&mut rng, t.size() + 1, DType::F32), [t.size() + 1]).unwrap();
    kv.init(t.key.clone(), &other).unwrap();
    assert_eq!(
        checkpoint_kind(kv.load(&dir)),
        CheckpointErrorKind::Mismatch
    );
    assert_eq!(kv.keys(), vec![t.key.clone()], "nothing was added");
    assert_eq!(
        pull(
            &kv,
            &Truth {
                dims: vec![t.size() + 1],
                dtype: DType::F32,
                ..truth_copy(t)
            }
        ),
        other.to_vec::<f64>().unwrap()
    );
    fs::remove_dir_all(&dir).unwrap();
}

fn truth_copy(t: &Truth) -> Truth {
    Truth {
        key: t.key.clone(),
        order: t.order,
        dims: t.dims.clone(),
        dtype: t.dtype,
        value: t.value.clone(),
        state: t.state.clone(),
    }
}

#[test]
fn format_1_checkpoints_still_load() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("format1");
    let truths = truths(&mut rng, &adam(), 6, false);
    let world = 3;
    for rank in 0..world {
        let pieces: Vec<HandPiece> = truths
            .iter()
            .filter(|t| t.order % world == rank)
            .map(|t| HandPiece {
                truth: t,
                range: 0..t.size(),
                spelling: None,
            })
            .collect();
        write_shard_as(&dir, 2, None, rank, world, &adam(), &pieces);
    }
    write_index_1(&dir, 2, world);
    let kv = store(&adam());
    kv.load(&dir).unwrap();
    assert_unchanged(&kv, &truths);
    let single = dir.join("single.safetensors");
    write_single_file_as(&single, &adam(), &truths, true);
    let kv = store(&adam());
    kv.load(&single).unwrap();
    assert_unchanged(&kv, &truths);
    // An index of format 1 names no token: shards that carry one are not its own.
    write_sharded(&dir, &mut rng, 3, 2, &adam(), &truths);
    write_index_1(&dir, 3, 2);
    assert_eq!(checkpoint_kind(kv.load(&dir)), CheckpointErrorKind::Invalid);
    fs::remove_dir_all(&dir).unwrap();
}

/// Shards of format 2 (`name=value` entries), under an index of format 3 (what the previous
/// version saved) or of format 2 (no checksum line), still load, and so does a store of this
/// version's save of a world of one; the current format is what the other tests write.
#[test]
fn format_2_checkpoints_still_load() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("format2");
    let truths = truths(&mut rng, &sgd_momentum(), 7, true);
    let world = 2;
    for (g, index_2) in [(4, false), (5, true)] {
        for rank in 0..world {
            let pieces: Vec<HandPiece> = (truths.iter())
                .filter(|t| t.order % world == rank)
                .map(|t| HandPiece {
                    truth: t,
                    range: 0..t.size(),
                    spelling: None,
                })
                .collect();
            let token = Some(token_of(g));
            let (updater, format) = (sgd_momentum(), ShardFormat::Fields);
            write_shard_in(&dir, g, token, format, rank, world, &updater, &pieces);
        }
        match index_2 {
            true => write_index_2(&dir, g, world),
            false => write_index(&dir, g, world),
        }
        let kv = store(&sgd_momentum());
        kv.load(&dir).unwrap();
        assert_unchanged(&kv, &truths);
        // A store of one process saves it again, as one shard of the current format.
        let again = dir.join(format!("again-{g}"));
        kv.save(&again).unwrap();
        let shard = again.join("gen-0").join("shard-0-of-1.safetensors");
        let (_, meta) =
            safetensors::SafeTensors::read_metadata(&fs::read(&shard).unwrap()).unwrap();
        let meta = meta.metadata().clone().unwrap();
        assert_eq!(meta["format"], "kvstore-shard/3");
        let restored = store(&sgd_momentum());
        restored.load(&again).unwrap();
        assert_unchanged(&restored, &truths);
    }
    fs::remove_dir_all(&dir).unwrap();
}

/// A generation whose shards carry different tokens, or a token other than the index names,
/// holds shards of two saves (two jobs saving into one directory): invalid, never loaded.
#[test]
fn a_shard_of_another_save_is_invalid() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("foreign");
    let held = truths(&mut rng, &adam(), 4, false);
    let kv = loaded(&dir, &mut rng, &held);
    let other = truths(&mut rng, &adam(), 4, false);
    let whole = |t: &[Truth]| -> Vec<(usize, Vec<usize>)> {
        // Keys by rank: even places on rank 0, odd on rank 1.
        (0..2)
            .map(|r| (r, (0..t.len()).filter(|i| i % 2 == r).collect()))
            .collect()
    };
    for (case, tokens) in [
        [Some(token_of(5)), Some(0x1234)],
        [Some(0x1234), Some(0x1234)],
        [Some(token_of(5)), None],
    ]
    .into_iter()
    .enumerate()
    {
        for (rank, keys) in whole(&other) {
            let pieces: Vec<HandPiece> = keys
                .iter()
                .map(|&i| HandPiece {
                    truth: &other[i],
                    range: 0..other[i].size(),
                    spelling: None,
                })
                .collect();
            write_shard_as(&dir, 5, tokens[rank], rank, 2, &adam(), &pieces);
        }
        write_index(&dir, 5, 2);
        match kv.load(&dir) {
            Err(
                e @ Error::Checkpoint {
                    kind: CheckpointErrorKind::Invalid,
                    ..
                },
            ) => assert!(e.to_string().contains("another save"), "case {case}: {e}"),
            other => panic!("case {case}: expected an Invalid checkpoint error, got {other:?}"),
        }
    }
    assert_unchanged(&kv, &held);
    fs::remove_dir_all(&dir).unwrap();
}

/// A flipped bit in a hand-written shard (chunks of 16 bytes): in its data, or in its header. Each load is an `Invalid` error naming the shard; the store keeps its
/// values.
#[test]
fn a_flipped_bit_in_a_shard_is_invalid() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("flip");
    let held = truths(&mut rng, &adam(), 4, false);
    let kv = loaded(&dir, &mut rng, &held);
    let new = truths(&mut rng, &adam(), 5, true);
    write_sharded(&dir, &mut rng, 1, 2, &adam(), &new);
    let fresh = store(&adam());
    fresh.load(&dir).unwrap();
    assert_unchanged(&fresh, &new);
    for rank in 0..2 {
        let path = dir.join(format!("gen-1/shard-{rank}-of-2.safetensors"));
        let good = fs::read(&path).unwrap();
        let header = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        // 200 random bytes of the header, 40 of the data.
        let mut flips: Vec<usize> = (0..200).map(|_| rng.gen_range(0..header)).collect();
        flips.extend((0..40).map(|_| rng.gen_range(header..good.len().max(header + 1))));
        for at in flips.into_iter().filter(|&at| at < good.len()) {
            let mut bad = good.clone();
            bad[at] ^= 1 << rng.gen_range(0..8);
            fs::write(&path, &bad).unwrap();
            match kv.load(&dir) {
                Err(Error::Checkpoint {
                    kind: CheckpointErrorKind::Invalid,
                    path: p,
                    ..
                }) => assert_eq!(p, path, "byte {at}"),
                other => panic!("byte {at} of shard {rank}: expected Invalid, got {other:?}"),
            }
        }
        fs::write(&path, &good).unwrap();
    }
    assert_unchanged(&kv, &held);
    fs::remove_dir_all(&dir).unwrap();
}

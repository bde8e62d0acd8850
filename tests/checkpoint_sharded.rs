//! `KvStore::load` of a sharded checkpoint directory (the layout the ranks of a `dist` store
//! save, documented in `kvstore::checkpoint`), written here by hand from that documentation
//! with the safetensors crate, so the reader is checked against the format and not against its
//! own writer.
//!
//! Random keys are split over 1 to 4 simulated ranks (whole keys and slices), loaded into a
//! `local` store (and a `device` store: `gpu::*`, ignored without a GPU) and compared with the arrays they were made from; the updater state is checked
//! by training on after the load, against the same checkpoint in the single-file format. Then
//! the failures: a save killed part way, missing and truncated shards, gaps and overlaps,
//! corrupt indexes, and key spellings that are not canonical. Every failure is an
//! `Error::Checkpoint` of the right kind, and leaves the store as it was.

mod common;

use std::collections::HashMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use common::Home;
use half::{bf16, f16};
use kvstore::{Adam, CheckpointErrorKind, DType, Error, Key, KvStore, NDArray, Sgd, Updater};
use rand::prelude::*;
use safetensors::tensor::{Dtype, TensorView};

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

/// Writes shard `rank` of `world` of generation `g` by hand, as the module docs describe it.
fn write_shard(
    dir: &Path,
    g: u64,
    rank: usize,
    world: usize,
    updater: &Updater,
    pieces: &[HandPiece],
) {
    let names = updater.state_names();
    let mut meta: HashMap<String, String> = HashMap::new();
    meta.insert("format".into(), "kvstore-shard/1".into());
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
        let dims: Vec<String> = t.dims.iter().map(usize::to_string).collect();
        let mut spec = format!(
            "order={} start={} end={} dims={}",
            t.order,
            p.range.start,
            p.range.end,
            dims.join(",")
        );
        let r = p.range.clone();
        tensors.push((
            format!("value/{name}"),
            st(t.dtype),
            r.len(),
            bytes(&t.value[r.clone()], t.dtype),
        ));
        if let Some((step, bufs)) = &t.state {
            spec.push_str(&format!(" step={step}"));
            for (s, buf) in names.iter().zip(bufs) {
                tensors.push((
                    format!("state/{name}/{s}"),
                    st(acc(t.dtype)),
                    r.len(),
                    bytes(&buf[r.clone()], acc(t.dtype)),
                ));
            }
        }
        meta.insert(format!("piece/{name}"), spec);
    }
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .map(|(n, d, len, b)| (n.as_str(), TensorView::new(*d, vec![*len], b).unwrap()))
        .collect();
    let data = safetensors::serialize(views, Some(meta)).unwrap();
    let gen_dir = dir.join(format!("gen-{g}"));
    fs::create_dir_all(&gen_dir).unwrap();
    fs::write(
        gen_dir.join(format!("shard-{rank}-of-{world}.safetensors")),
        data,
    )
    .unwrap();
}

fn write_index(dir: &Path, g: u64, world: usize) {
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

/// The same keys as a single-file checkpoint, by hand, as the module docs describe it.
fn write_single_file(path: &Path, updater: &Updater, truths: &[Truth]) {
    let names = updater.state_names();
    let mut meta: HashMap<String, String> = HashMap::new();
    meta.insert("format".into(), "kvstore-checkpoint/1".into());
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
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    fs::write(path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
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
            let stateful = truths.iter().find(|t| t.state.is_some() && t.size() > 0);
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

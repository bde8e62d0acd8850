//! Unit tests of the crate-internal sharded checkpoint API: ranks simulated in one process
//! write pieces (whole keys and slices), rank 0 commits, and readers of every other world size
//! and slicing read them back, element for element.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use rand::prelude::*;

use super::layout::{
    generation_dir, index_path, shard_path, token_text, KeyMeta, KeyResiduals, Piece,
};
use super::reader::open;
use super::sharded::{commit, next_generation, write_shard, SaveId};
use super::CheckpointErrorKind;
use crate::{Adam, DType, Error, Key, KvStore, NDArray, Sgd, Updater};

/// A fresh directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvstore-sharded-unit-{name}-{}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn adam() -> Updater {
    Updater::Adam(Adam {
        lr: 0.01,
        ..Adam::default()
    })
}

fn sgd_momentum() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    })
}

/// Random elements, rounded to `dtype` (so converting back to `dtype` is exact).
fn random(rng: &mut StdRng, n: usize, dtype: DType) -> Vec<f64> {
    let v: Vec<f64> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
    NDArray::from_vec(v, [n])
        .unwrap()
        .astype(dtype)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()
}

fn array(v: &[f64], dtype: DType) -> NDArray {
    NDArray::from_vec(v.to_vec(), [v.len()])
        .unwrap()
        .astype(dtype)
        .unwrap()
}

fn acc(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// One key, whole, as the reference: its metadata, value and state buffers.
struct Truth {
    meta: KeyMeta,
    value: Vec<f64>,
    state: Vec<Vec<f64>>,
}

/// `count` keys of random shapes and dtypes, in a random update order; some without state.
fn truths(rng: &mut StdRng, updater: &Updater, count: usize, string_keys: bool) -> Vec<Truth> {
    let shapes: [&[usize]; 6] = [&[7, 5], &[13], &[], &[2, 3, 4], &[1], &[40]];
    let mut orders: Vec<usize> = (0..count).map(|i| i * 3 + 1).collect();
    orders.shuffle(rng);
    (0..count)
        .map(|i| {
            let dims = shapes[rng.gen_range(0..shapes.len())].to_vec();
            let dtype = DType::ALL[rng.gen_range(0..4)];
            let n: usize = dims.iter().product();
            let has_state = !updater.state_names().is_empty() && rng.gen_bool(0.8);
            let state = if has_state {
                updater
                    .state_names()
                    .iter()
                    .map(|_| random(rng, n, acc(dtype)))
                    .collect()
            } else {
                Vec::new()
            };
            let key = if string_keys {
                Key::Str(format!("layer{i}/w"))
            } else {
                Key::Int(i as i32 * 7 - 20)
            };
            let row_sparse = dims.len() >= 2 && rng.gen_bool(0.3);
            Truth {
                meta: KeyMeta {
                    key,
                    dims,
                    dtype,
                    order: orders[i],
                    step: if has_state { rng.gen_range(1..1000) } else { 0 },
                    has_state,
                    row_sparse,
                },
                value: random(rng, n, dtype),
                state,
            }
        })
        .collect()
}

/// `parts` contiguous ranges that cover `0..n`, at random cuts (some may be empty).
fn cuts(rng: &mut StdRng, n: usize, parts: usize) -> Vec<Range<usize>> {
    let mut at: Vec<usize> = (1..parts).map(|_| rng.gen_range(0..=n)).collect();
    at.sort_unstable();
    let mut bounds = vec![0];
    bounds.extend(at);
    bounds.push(n);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

/// For each rank of `world`, the (key index, range) it holds: each key whole on one rank, or
/// sliced over every rank.
fn layout(rng: &mut StdRng, truths: &[Truth], world: usize) -> Vec<Vec<(usize, Range<usize>)>> {
    let mut ranks = vec![Vec::new(); world];
    for (i, t) in truths.iter().enumerate() {
        let n = t.meta.size();
        if world > 1 && n >= 2 && rng.gen_bool(0.5) {
            for (r, range) in cuts(rng, n, world).into_iter().enumerate() {
                ranks[r].push((i, range));
            }
        } else {
            ranks[rng.gen_range(0..world)].push((i, 0..n));
        }
    }
    ranks
}

fn piece(t: &Truth, names: &[&str], range: Range<usize>) -> Piece {
    Piece {
        meta: t.meta.clone(),
        range: range.clone(),
        value: array(&t.value[range.clone()], t.meta.dtype),
        state: names
            .iter()
            .zip(&t.state)
            .map(|(n, s)| (n.to_string(), array(&s[range.clone()], acc(t.meta.dtype))))
            .collect(),
    }
}

/// Saves `truths` from `world` simulated ranks, as a dist store would, and commits.
fn save(dir: &Path, rng: &mut StdRng, updater: &Updater, truths: &[Truth], world: usize) -> u64 {
    let g = next_generation(dir).unwrap();
    for (rank, held) in layout(rng, truths, world).into_iter().enumerate() {
        let pieces: Vec<Piece> = held
            .into_iter()
            .map(|(i, r)| piece(&truths[i], updater.state_names(), r))
            .collect();
        write_shard(dir, g, rank, world, updater, &pieces, &[]).unwrap();
    }
    commit(dir, g, world).unwrap();
    g.generation
}

/// Reads every key at a `world` layout of its own and compares with the reference.
fn check_reads(dir: &Path, rng: &mut StdRng, updater: &Updater, truths: &[Truth], world: usize) {
    let reader = open(dir).unwrap();
    assert_eq!(reader.updater_name(), updater.name());
    assert!(reader.state_names().iter().eq(updater.state_names()));
    let mut sorted: Vec<&Truth> = truths.iter().collect();
    sorted.sort_by_key(|t| t.meta.order);
    let metas: Vec<&KeyMeta> = sorted.iter().map(|t| &t.meta).collect();
    assert!(reader.keys().iter().eq(metas), "keys, in update order");
    for held in layout(rng, truths, world) {
        for (i, range) in held {
            let t = &truths[i];
            let p = reader.read(&t.meta.key, range.clone()).unwrap();
            assert_eq!(p.meta, t.meta);
            assert_eq!(p.range, range);
            assert_eq!(p.value.dtype(), t.meta.dtype);
            assert_eq!(p.value.to_vec::<f64>().unwrap(), t.value[range.clone()]);
            assert_eq!(p.state.len(), t.state.len(), "key {}", t.meta.key);
            for ((name, buf), (want_name, want)) in p
                .state
                .iter()
                .zip(updater.state_names().iter().zip(&t.state))
            {
                assert_eq!(name, want_name);
                assert_eq!(buf.dtype(), acc(t.meta.dtype));
                assert_eq!(buf.to_vec::<f64>().unwrap(), want[range.clone()]);
            }
        }
    }
}

#[test]
fn every_world_size_reads_every_other() {
    let mut rng = StdRng::from_entropy();
    for (u, updater) in [adam(), sgd_momentum(), Updater::Assign].iter().enumerate() {
        for w in 1..=4 {
            let dir = temp_dir(&format!("worlds-{u}-{w}"));
            let truths = truths(&mut rng, updater, 9, w % 2 == 0);
            save(&dir, &mut rng, updater, &truths, w);
            for w2 in 1..=4 {
                check_reads(&dir, &mut rng, updater, &truths, w2);
            }
            fs::remove_dir_all(&dir).unwrap();
        }
    }
}

#[test]
fn a_new_save_replaces_the_old_and_removes_its_generation() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("replace");
    let first = truths(&mut rng, &adam(), 5, false);
    let g0 = save(&dir, &mut rng, &adam(), &first, 4);
    let second = truths(&mut rng, &adam(), 6, false);
    let g1 = save(&dir, &mut rng, &adam(), &second, 2);
    assert!(g1 > g0);
    assert!(!generation_dir(&dir, g0).exists());
    check_reads(&dir, &mut rng, &adam(), &second, 3);
    fs::remove_dir_all(&dir).unwrap();
}

/// Makes `t` a 1-D key of `n` elements; a 1-D key is never row-sparse.
fn set_one_dim(t: &mut Truth, n: usize) {
    t.meta.dims = vec![n];
    t.meta.row_sparse = false;
}

fn checkpoint_kind(e: Error) -> CheckpointErrorKind {
    match e {
        Error::Checkpoint { kind, .. } => kind,
        other => panic!("expected Error::Checkpoint, got {other:?}"),
    }
}

#[test]
fn a_save_killed_part_way_leaves_the_previous_checkpoint() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("killed");
    let updater = adam();
    let old = truths(&mut rng, &updater, 6, false);
    save(&dir, &mut rng, &updater, &old, 3);
    let new = truths(&mut rng, &updater, 6, false);

    // 1. Every shard of the new generation written, no commit.
    let g = next_generation(&dir).unwrap();
    for (rank, held) in layout(&mut rng, &new, 3).into_iter().enumerate() {
        let pieces: Vec<Piece> = held
            .into_iter()
            .map(|(i, r)| piece(&new[i], updater.state_names(), r))
            .collect();
        write_shard(&dir, g, rank, 3, &updater, &pieces, &[]).unwrap();
    }
    check_reads(&dir, &mut rng, &updater, &old, 2);

    // 2. A shard write that fails part way: an error, no shard file, the old checkpoint.
    let g = next_generation(&dir).unwrap();
    let pieces: Vec<Piece> = new
        .iter()
        .map(|t| piece(t, updater.state_names(), 0..t.meta.size()))
        .collect();
    super::fail_writes_after(Some(100));
    let e = write_shard(&dir, g, 0, 1, &updater, &pieces, &[]).unwrap_err();
    super::fail_writes_after(None);
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Io);
    assert!(!shard_path(&generation_dir(&dir, g.generation), 0, 1).exists());
    // A crash leaves a half-written temporary file instead: loads ignore it.
    fs::write(
        generation_dir(&dir, g.generation).join(".shard-0-of-1.safetensors.tmp-1-1"),
        b"\x10\x00\x00",
    )
    .unwrap();
    check_reads(&dir, &mut rng, &updater, &old, 4);

    // 3. A shard missing at commit: NotFound, and the index still points at the old one.
    let g = next_generation(&dir).unwrap();
    write_shard(&dir, g, 0, 2, &updater, &pieces, &[]).unwrap();
    let e = commit(&dir, g, 2).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::NotFound);
    check_reads(&dir, &mut rng, &updater, &old, 1);

    // 4. A truncated shard at commit: Invalid, the old index.
    let g = next_generation(&dir).unwrap();
    write_shard(&dir, g, 0, 1, &updater, &pieces, &[]).unwrap();
    let path = shard_path(&generation_dir(&dir, g.generation), 0, 1);
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let e = commit(&dir, g, 1).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid);
    check_reads(&dir, &mut rng, &updater, &old, 3);

    // And a later save still works, and wins.
    save(&dir, &mut rng, &updater, &new, 2);
    check_reads(&dir, &mut rng, &updater, &new, 4);
    fs::remove_dir_all(&dir).unwrap();
}

/// Writes `ranges` of key `t`, one per rank, and commits; returns the commit's result.
fn commit_ranges(dir: &Path, t: &Truth, ranges: &[Range<usize>]) -> crate::Result<()> {
    let g = next_generation(dir).unwrap();
    let world = ranges.len();
    for (rank, r) in ranges.iter().enumerate() {
        let pieces = vec![piece(t, &[], r.clone())];
        write_shard(dir, g, rank, world, &Updater::Assign, &pieces, &[]).unwrap();
    }
    commit(dir, g, world)
}

#[test]
fn overlaps_and_gaps_fail_the_commit() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("cover");
    let mut t = truths(&mut rng, &Updater::Assign, 1, false).remove(0);
    set_one_dim(&mut t, 10);
    t.value = random(&mut rng, 10, t.meta.dtype);
    commit_ranges(&dir, &t, &[0..4, 4..10]).unwrap();
    #[allow(clippy::single_range_in_vec_init)] // one rank's range
    for bad in [
        vec![0..6, 4..10],
        vec![0..4, 5..10],
        vec![0..4, 4..9],
        vec![1..10],
        vec![0..10, 0..10],
    ] {
        let e = commit_ranges(&dir, &t, &bad).unwrap_err();
        assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid, "{bad:?}");
    }
    // Still the first save.
    let p = open(&dir).unwrap().read(&t.meta.key, 0..10).unwrap();
    assert_eq!(p.value.to_vec::<f64>().unwrap(), t.value);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn shards_that_disagree_fail_the_commit() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("disagree");
    let updater = adam();
    let mut t = truths(&mut rng, &updater, 1, false).remove(0);
    set_one_dim(&mut t, 8);
    t.meta.has_state = true;
    t.meta.step = 3;
    t.value = random(&mut rng, 8, t.meta.dtype);
    t.state = (0..2)
        .map(|_| random(&mut rng, 8, acc(t.meta.dtype)))
        .collect();
    let g = next_generation(&dir).unwrap();
    write_shard(
        &dir,
        g,
        0,
        2,
        &updater,
        &[piece(&t, updater.state_names(), 0..4)],
        &[],
    )
    .unwrap();
    let mut other = piece(&t, updater.state_names(), 4..8);
    other.meta.step = 4;
    write_shard(&dir, g, 1, 2, &updater, &[other], &[]).unwrap();
    let e = commit(&dir, g, 2).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid);
    // Another updater on one rank.
    let g = next_generation(&dir).unwrap();
    write_shard(
        &dir,
        g,
        0,
        2,
        &updater,
        &[piece(&t, updater.state_names(), 0..4)],
        &[],
    )
    .unwrap();
    let mut plain = piece(&t, &[], 4..8);
    plain.meta.has_state = false;
    write_shard(&dir, g, 1, 2, &Updater::Assign, &[plain], &[]).unwrap();
    let e = commit(&dir, g, 2).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid);
    assert_eq!(
        checkpoint_kind(open(&dir).map(|_| ()).unwrap_err()),
        CheckpointErrorKind::NotFound,
        "nothing was ever committed"
    );
    fs::remove_dir_all(&dir).unwrap();
}

/// A save of generation 0, for writes that are meant to fail.
const SOME_SAVE: SaveId = SaveId {
    generation: 0,
    token: 0x5eed,
};

#[test]
fn bad_pieces_are_errors_and_write_nothing() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("badpieces");
    let updater = adam();
    let mut t = truths(&mut rng, &updater, 1, false).remove(0);
    set_one_dim(&mut t, 6);
    t.meta.has_state = true;
    t.value = random(&mut rng, 6, t.meta.dtype);
    t.state = (0..2)
        .map(|_| random(&mut rng, 6, acc(t.meta.dtype)))
        .collect();
    let good = piece(&t, updater.state_names(), 0..6);
    let mut out_of_range = good.clone();
    out_of_range.range = 2..8;
    let mut short = good.clone();
    short.value = array(&t.value[..5], t.meta.dtype);
    let mut wrong_dtype = good.clone();
    wrong_dtype.meta.dtype = if t.meta.dtype == DType::F32 {
        DType::F64
    } else {
        DType::F32
    };
    let mut no_state = good.clone();
    no_state.state.clear();
    let mut renamed = good.clone();
    renamed.state[0].0 = "momentum".into();
    for (what, pieces) in [
        ("range", vec![out_of_range]),
        ("length", vec![short]),
        ("dtype", vec![wrong_dtype]),
        ("missing state", vec![no_state]),
        ("state name", vec![renamed]),
        ("twice", vec![good.clone(), good.clone()]),
    ] {
        let e = write_shard(&dir, SOME_SAVE, 0, 1, &updater, &pieces, &[]).unwrap_err();
        assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid, "{what}");
    }
    assert!(
        write_shard(&dir, SOME_SAVE, 1, 1, &updater, &[good], &[]).is_err(),
        "rank >= world"
    );
    assert!(!generation_dir(&dir, 0).exists());
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_or_missing_index() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("index");
    let e = open(&dir).map(|_| ()).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::NotFound);
    let t = truths(&mut rng, &Updater::Assign, 3, false);
    let g = save(&dir, &mut rng, &Updater::Assign, &t, 2);
    for junk in [
        String::new(),
        "garbage".into(),
        format!("kvstore-checkpoint-index/1\ngeneration {g}\n"),
        format!("kvstore-checkpoint-index/1\ngeneration 0{g}\nworld 2\n"),
        format!("kvstore-checkpoint-index/1\ngeneration {g}\nworld 0\n"),
        format!("kvstore-checkpoint-index/9\ngeneration {g}\nworld 2\n"),
    ] {
        fs::write(index_path(&dir), junk.as_bytes()).unwrap();
        let e = open(&dir).map(|_| ()).unwrap_err();
        assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid, "{junk:?}");
    }
    fs::write(index_path(&dir), [0xff, 0xfe, 0x00]).unwrap();
    let e = open(&dir).map(|_| ()).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid);
    // The world size the index names must match the shards.
    fs::write(
        index_path(&dir),
        format!("kvstore-checkpoint-index/1\ngeneration {g}\nworld 3\n"),
    )
    .unwrap();
    let e = open(&dir).map(|_| ()).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::NotFound);
    // A save repairs it.
    save(&dir, &mut rng, &Updater::Assign, &t, 1);
    check_reads(&dir, &mut rng, &Updater::Assign, &t, 2);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reads_outside_the_checkpoint_are_mismatches() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("outside");
    let t = truths(&mut rng, &Updater::Assign, 2, false);
    save(&dir, &mut rng, &Updater::Assign, &t, 2);
    let reader = open(&dir).unwrap();
    let n = t[0].meta.size();
    let e = reader
        .read(&t[0].meta.key, 0..n + 1)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Mismatch);
    let e = reader.read(&Key::Int(12345), 0..1).map(|_| ()).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Mismatch);
    fs::remove_dir_all(&dir).unwrap();
}

/// A local store with `updater`, some keys, pushed twice, so every key has state.
fn trained_store(rng: &mut StdRng, updater: &Updater) -> (KvStore, Vec<(i32, Vec<usize>, DType)>) {
    let kv = KvStore::create("local").unwrap();
    kv.set_updater(updater.clone()).unwrap();
    let keys = vec![
        (3, vec![4, 5], DType::F32),
        (9, vec![11], DType::F64),
        (-2, vec![3, 3], DType::F16),
        (20, vec![6], DType::BF16),
    ];
    for (k, dims, dtype) in &keys {
        let n = dims.iter().product();
        let v = NDArray::from_vec(random(rng, n, *dtype), crate::Shape::new(dims).unwrap())
            .unwrap()
            .astype(*dtype)
            .unwrap();
        kv.init(*k, &v).unwrap();
    }
    for _ in 0..2 {
        for (k, dims, dtype) in &keys {
            let n = dims.iter().product();
            let g = NDArray::from_vec(random(rng, n, *dtype), crate::Shape::new(dims).unwrap())
                .unwrap()
                .astype(*dtype)
                .unwrap();
            kv.push(*k, &g).unwrap();
        }
    }
    (kv, keys)
}

fn pull(kv: &KvStore, k: i32, dims: &[usize], dtype: DType) -> Vec<f64> {
    let out = NDArray::zeros(crate::Shape::new(dims).unwrap())
        .astype(dtype)
        .unwrap();
    kv.pull(k, &out).unwrap();
    out.to_vec::<f64>().unwrap()
}

#[test]
fn the_reader_reads_a_single_file_checkpoint() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("single");
    let path = dir.join("model.safetensors");
    let (kv, keys) = trained_store(&mut rng, &adam());
    kv.save_single_file(&path).unwrap();
    let reader = open(&path).unwrap();
    assert_eq!(reader.updater_name(), "adam");
    assert!(reader.state_names().iter().eq(["mean", "var"]));
    let order: Vec<Key> = reader.keys().iter().map(|m| m.key.clone()).collect();
    assert_eq!(order, kv.keys());
    for (k, dims, dtype) in &keys {
        let want = pull(&kv, *k, dims, *dtype);
        let meta = reader
            .keys()
            .iter()
            .find(|m| m.key == Key::Int(*k))
            .unwrap();
        assert_eq!(
            (&meta.dims, meta.dtype, meta.step, meta.has_state),
            (dims, *dtype, 2, true)
        );
        // Whole, and in slices.
        let n = want.len();
        for range in std::iter::once(0..n).chain(cuts(&mut rng, n, 3)) {
            let p = reader.read(&Key::Int(*k), range.clone()).unwrap();
            assert_eq!(p.value.to_vec::<f64>().unwrap(), want[range.clone()]);
            assert_eq!(p.state.len(), 2);
        }
    }
    fs::remove_dir_all(&dir).unwrap();
}

/// Splits every key of `kv` over `world` ranks, writes the shards and commits: a dist save.
fn save_store_sharded(dir: &Path, rng: &mut StdRng, kv: &KvStore, world: usize) {
    let (_, updater, entries) = kv.export_entries().unwrap();
    let truths: Vec<Truth> = entries
        .iter()
        .enumerate()
        .map(|(order, e)| Truth {
            meta: KeyMeta {
                key: e.key.clone(),
                dims: e.shape.dims().to_vec(),
                dtype: e.value.dtype(),
                order,
                step: e.state.as_ref().map_or(0, |s| s.step),
                has_state: e.state.is_some(),
                row_sparse: e.row_sparse,
            },
            value: e.value.to_vec(),
            state: e
                .state
                .iter()
                .flat_map(|s| s.bufs.iter().map(|b| b.to_vec()))
                .collect(),
        })
        .collect();
    save(dir, rng, &updater, &truths, world);
}

#[test]
fn a_sharded_checkpoint_loads_into_a_local_store_and_trains_on() {
    let mut rng = StdRng::from_entropy();
    for (u, updater) in [adam(), sgd_momentum()].iter().enumerate() {
        for world in 1..=4 {
            let dir = temp_dir(&format!("local-{u}-{world}"));
            let (kv, keys) = trained_store(&mut rng, updater);
            save_store_sharded(&dir, &mut rng, &kv, world);
            let restored = KvStore::create("local").unwrap();
            restored.set_updater(updater.clone()).unwrap();
            restored.load(&dir).unwrap();
            assert_eq!(restored.keys(), kv.keys());
            for (k, dims, dtype) in &keys {
                assert_eq!(
                    pull(&restored, *k, dims, *dtype),
                    pull(&kv, *k, dims, *dtype)
                );
            }
            // The state came back too: one more push gives the same values.
            for (k, dims, dtype) in &keys {
                let n = dims.iter().product();
                let g = NDArray::from_vec(
                    random(&mut rng, n, *dtype),
                    crate::Shape::new(dims).unwrap(),
                )
                .unwrap()
                .astype(*dtype)
                .unwrap();
                kv.push(*k, &g).unwrap();
                restored.push(*k, &g).unwrap();
                assert_eq!(
                    pull(&restored, *k, dims, *dtype),
                    pull(&kv, *k, dims, *dtype)
                );
            }
            fs::remove_dir_all(&dir).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Two jobs saving into one directory (issue 16, fault 4): a restarted job saves while the old
// one is still alive. Each save must own its generation, a commit must reject shards that are
// not its own, and a load must never return values mixed from both jobs.
// ---------------------------------------------------------------------------------------------

/// The same keys as `truths` (metadata, so shards of both cover each other exactly), with fresh
/// random values and state: what a second job training the same model holds.
fn same_model_other_values(rng: &mut StdRng, truths: &[Truth]) -> Vec<Truth> {
    truths
        .iter()
        .map(|t| Truth {
            meta: t.meta.clone(),
            value: random(rng, t.meta.size(), t.meta.dtype),
            state: t
                .state
                .iter()
                .map(|_| random(rng, t.meta.size(), acc(t.meta.dtype)))
                .collect(),
        })
        .collect()
}

/// The pieces of `truths` that `held` (one rank's part of a layout) names.
fn pieces_of(truths: &[Truth], updater: &Updater, held: &[(usize, Range<usize>)]) -> Vec<Piece> {
    held.iter()
        .map(|(i, r)| piece(&truths[*i], updater.state_names(), r.clone()))
        .collect()
}

/// Which of `jobs` the committed checkpoint in `dir` is, read key by key, whole: every key's
/// value and state must be that one job's. Panics on values mixed from several jobs.
fn committed_job(dir: &Path, jobs: &[&[Truth]]) -> usize {
    let reader = open(dir).unwrap();
    let mut matches = Vec::new();
    for i in 0..jobs[0].len() {
        let key = &jobs[0][i].meta.key;
        let p = reader.read(key, 0..jobs[0][i].meta.size()).unwrap();
        let value = p.value.to_vec::<f64>().unwrap();
        let state: Vec<Vec<f64>> = p.state.iter().map(|(_, b)| b.to_vec().unwrap()).collect();
        let job = jobs
            .iter()
            .position(|j| j[i].value == value && j[i].state == state);
        matches.push((key.clone(), job));
    }
    let first = matches[0].1;
    assert!(
        first.is_some() && matches.iter().all(|(_, j)| *j == first),
        "a load returned values mixed from several jobs (key: the job it matches): {matches:?}"
    );
    first.unwrap_or(0)
}

#[test]
fn two_jobs_saving_at_once_never_share_a_generation() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("two-jobs");
    let updater = adam();
    let world = 2;
    let a = truths(&mut rng, &updater, 6, false);
    let b = same_model_other_values(&mut rng, &a);
    let held = layout(&mut rng, &a, world);
    // Both jobs' rank 0 pick a generation before either has written anything.
    let ga = next_generation(&dir).unwrap();
    let gb = next_generation(&dir).unwrap();
    // Their ranks write interleaved: job A's rank 0, job B's ranks 0 and 1, job A's rank 1.
    write_shard(
        &dir,
        ga,
        0,
        world,
        &updater,
        &pieces_of(&a, &updater, &held[0]),
        &[],
    )
    .unwrap();
    write_shard(
        &dir,
        gb,
        0,
        world,
        &updater,
        &pieces_of(&b, &updater, &held[0]),
        &[],
    )
    .unwrap();
    write_shard(
        &dir,
        gb,
        1,
        world,
        &updater,
        &pieces_of(&b, &updater, &held[1]),
        &[],
    )
    .unwrap();
    write_shard(
        &dir,
        ga,
        1,
        world,
        &updater,
        &pieces_of(&a, &updater, &held[1]),
        &[],
    )
    .unwrap();
    // Job B commits first, then job A. A commit may fail (its generation was taken from under
    // it), but what a load finds is always one job's checkpoint, whole: the last one committed.
    let mut last = None;
    for (job, g) in [(1, gb), (0, ga)] {
        match commit(&dir, g, world) {
            Ok(()) => last = Some(job),
            Err(e) => assert!(
                matches!(e, Error::Checkpoint { .. }),
                "job {job}'s commit: {e:?}"
            ),
        }
        if let Some(want) = last {
            assert_eq!(
                committed_job(&dir, &[&a, &b]),
                want,
                "after job {job}'s commit"
            );
        }
    }
    assert!(last.is_some(), "neither job's save committed");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_commit_rejects_a_shard_of_another_save() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("foreign-commit");
    let updater = adam();
    let world = 2;
    let old = truths(&mut rng, &updater, 5, false);
    save(&dir, &mut rng, &updater, &old, world);
    let a = same_model_other_values(&mut rng, &old);
    let b = same_model_other_values(&mut rng, &old);
    let held = layout(&mut rng, &a, world);
    let ga = next_generation(&dir).unwrap();
    write_shard(
        &dir,
        ga,
        0,
        world,
        &updater,
        &pieces_of(&a, &updater, &held[0]),
        &[],
    )
    .unwrap();
    write_shard(
        &dir,
        ga,
        1,
        world,
        &updater,
        &pieces_of(&a, &updater, &held[1]),
        &[],
    )
    .unwrap();
    // Another job, that never claimed this generation (an older kvstore, or one handed the
    // wrong number), replaces rank 1's shard with its own, marked with its own token.
    let foreign = SaveId {
        token: next_generation(&dir).unwrap().token,
        ..ga
    };
    write_shard(
        &dir,
        foreign,
        1,
        world,
        &updater,
        &pieces_of(&b, &updater, &held[1]),
        &[],
    )
    .unwrap();
    let e = commit(&dir, ga, world).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid);
    // The index was not replaced: the previous checkpoint is the one a load finds.
    assert_eq!(committed_job(&dir, &[&old, &a, &b]), 0);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_load_rejects_a_generation_with_a_shard_of_another_save() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("foreign-load");
    let updater = adam();
    let world = 2;
    let a = truths(&mut rng, &updater, 6, false);
    let b = same_model_other_values(&mut rng, &a);
    let held = layout(&mut rng, &a, world);
    let ga = next_generation(&dir).unwrap();
    for (rank, h) in held.iter().enumerate() {
        write_shard(
            &dir,
            ga,
            rank,
            world,
            &updater,
            &pieces_of(&a, &updater, h),
            &[],
        )
        .unwrap();
    }
    commit(&dir, ga, world).unwrap();
    // A store holding job A's checkpoint.
    let kv = KvStore::create("local").unwrap();
    kv.set_updater(updater.clone()).unwrap();
    kv.load(&dir).unwrap();
    let snapshot = |kv: &KvStore| -> Vec<Vec<f64>> {
        a.iter()
            .map(|t| {
                let out = NDArray::zeros(crate::Shape::new(&t.meta.dims).unwrap())
                    .astype(t.meta.dtype)
                    .unwrap();
                kv.pull(t.meta.key.clone(), &out).unwrap();
                out.to_vec::<f64>().unwrap()
            })
            .collect()
    };
    let before = snapshot(&kv);
    assert_eq!(
        before,
        a.iter().map(|t| t.value.clone()).collect::<Vec<_>>()
    );
    // After the commit, another job writes its rank 1 shard, with its own token, into the
    // committed generation.
    let foreign = SaveId {
        token: next_generation(&dir).unwrap().token,
        ..ga
    };
    write_shard(
        &dir,
        foreign,
        1,
        world,
        &updater,
        &pieces_of(&b, &updater, &held[1]),
        &[],
    )
    .unwrap();
    let e = open(&dir).map(|_| ()).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid);
    let e = kv.load(&dir).unwrap_err();
    assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid);
    assert_eq!(snapshot(&kv), before, "a failed load changed the store");
    fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Flipped bits (issue 16, fault 5): every byte of a shard is under a checksum, verified before
// it is used; a mismatch is a typed error naming the file, and the store stays as it was.
// ---------------------------------------------------------------------------------------------

/// Where the data of tensor `name` lies in the safetensors file `bytes`.
fn tensor_bytes(bytes: &[u8], name: &str) -> Range<usize> {
    let (n, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let (s, e) = meta.info(name).unwrap().data_offsets;
    8 + n + s..8 + n + e
}

/// The length of the header of the safetensors file `bytes`: its 8-byte length and its JSON.
fn header_len(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

/// A local store with `updater` that loaded `dir`.
fn store_loaded(dir: &Path, updater: &Updater) -> KvStore {
    let kv = KvStore::create("local").unwrap();
    kv.set_updater(updater.clone()).unwrap();
    kv.load(dir).unwrap();
    kv
}

/// Every value of `truths` as `kv` holds it.
fn values_of(kv: &KvStore, truths: &[Truth]) -> Vec<Vec<f64>> {
    truths
        .iter()
        .map(|t| {
            let out = NDArray::zeros(crate::Shape::new(&t.meta.dims).unwrap())
                .astype(t.meta.dtype)
                .unwrap();
            kv.pull(t.meta.key.clone(), &out).unwrap();
            out.to_vec::<f64>().unwrap()
        })
        .collect()
}

/// A checkpoint error of kind `Invalid` that names `file` and says it is a checksum mismatch.
fn assert_checksum_error(e: Error, file: &Path) {
    let text = e.to_string();
    match &e {
        Error::Checkpoint {
            kind: CheckpointErrorKind::Invalid,
            path,
            ..
        } => assert_eq!(path, file, "the error names another file: {text}"),
        other => panic!("expected an Invalid checkpoint error, got {other:?}"),
    }
    assert!(text.contains("checksum"), "'{text}' does not say checksum");
}

#[test]
fn a_flipped_bit_in_a_shards_data_is_an_error_and_changes_nothing() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("flip-data");
    let updater = adam();
    let world = 2;
    let t = truths(&mut rng, &updater, 8, false);
    let g = save(&dir, &mut rng, &updater, &t, world);
    let kv = store_loaded(&dir, &updater);
    let before = values_of(&kv, &t);
    assert_eq!(
        before,
        t.iter().map(|t| t.value.clone()).collect::<Vec<_>>()
    );
    for rank in 0..world {
        let path = shard_path(&generation_dir(&dir, g), rank, world);
        let good = fs::read(&path).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&good).unwrap();
        let names: Vec<String> = meta
            .tensors()
            .into_iter()
            .filter(|(_, info)| info.data_offsets.1 > info.data_offsets.0)
            .map(|(name, _)| name)
            .collect();
        for name in names {
            let span = tensor_bytes(&good, &name);
            let mut bad = good.clone();
            bad[rng.gen_range(span)] ^= 1 << rng.gen_range(0..8);
            fs::write(&path, &bad).unwrap();
            let e = kv.load(&dir).unwrap_err();
            assert_checksum_error(e, &path);
            assert_eq!(
                values_of(&kv, &t),
                before,
                "tensor {name}: the store changed"
            );
            // The reader, which reads by range, verifies what it reads too.
            let key_text = name.split('/').nth(1).unwrap();
            let meta = t
                .iter()
                .find(|t| t.meta.key.to_string() == key_text)
                .unwrap();
            let reader = open(&dir).unwrap();
            let e = reader
                .read(&meta.meta.key, 0..meta.meta.size())
                .map(|_| ())
                .unwrap_err();
            assert_checksum_error(e, &path);
        }
        fs::write(&path, &good).unwrap();
    }
    assert_eq!(values_of(&store_loaded(&dir, &updater), &t), before);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_flipped_bit_in_a_shards_header_is_an_error_and_changes_nothing() {
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("flip-header");
    let updater = adam();
    let world = 2;
    let mut t = truths(&mut rng, &updater, 6, false);
    // Every key has state, so every piece records a step count.
    for x in &mut t {
        if !x.meta.has_state {
            x.meta.has_state = true;
            x.meta.step = rng.gen_range(1..1000);
            x.state = (0..2)
                .map(|_| random(&mut rng, x.meta.size(), acc(x.meta.dtype)))
                .collect();
        }
    }
    // Keys whole, alternating between the ranks: a step count in shard 0 is the key's only one.
    let g = next_generation(&dir).unwrap();
    for rank in 0..world {
        let held: Vec<(usize, Range<usize>)> = (rank..t.len())
            .step_by(world)
            .map(|i| (i, 0..t[i].meta.size()))
            .collect();
        write_shard(
            &dir,
            g,
            rank,
            world,
            &updater,
            &pieces_of(&t, &updater, &held),
            &[],
        )
        .unwrap();
    }
    commit(&dir, g, world).unwrap();
    let kv = store_loaded(&dir, &updater);
    let before = values_of(&kv, &t);
    let path = shard_path(&generation_dir(&dir, g.generation), 0, world);
    let good = fs::read(&path).unwrap();
    let header = header_len(&good);

    // A step count one off: still a well-formed count, so only a checksum can tell.
    // (Searched in the JSON only: the 8-byte length before it need not be text.)
    let json = std::str::from_utf8(&good[8..header]).unwrap();
    // A piece's entry is a JSON object inside the header's JSON, so its quotes are escaped.
    let needle = "\\\"step\\\":";
    let at = json
        .find(needle)
        .expect("a piece with a step count in shard 0")
        + needle.len();
    let end = 8 + at + json[at..].find(|c: char| !c.is_ascii_digit()).unwrap();
    let mut bad = good.clone();
    bad[end - 1] ^= 1;
    fs::write(&path, &bad).unwrap();
    assert_checksum_error(kv.load(&dir).unwrap_err(), &path);
    assert_eq!(values_of(&kv, &t), before);

    // A bit of every byte of the header: never a checkpoint that opens.
    let mut opened = Vec::new();
    for byte in 0..header {
        let bit = rng.gen_range(0..8);
        let mut bad = good.clone();
        bad[byte] ^= 1 << bit;
        fs::write(&path, &bad).unwrap();
        match open(&dir) {
            Ok(_) => opened.push((byte, bit)),
            Err(e) => assert_eq!(checkpoint_kind(e), CheckpointErrorKind::Invalid),
        }
    }
    assert!(
        opened.is_empty(),
        "{} of {header} one-bit flips of the {header}-byte header opened, e.g. (byte, bit) {:?}",
        opened.len(),
        &opened[..opened.len().min(5)]
    );
    fs::write(&path, &good).unwrap();
    assert_eq!(values_of(&store_loaded(&dir, &updater), &t), before);
    fs::remove_dir_all(&dir).unwrap();
}

/// Chunks of 6 bytes, which element boundaries cut anywhere: every range of a key reads back
/// exactly, at every world size; with one bit of one chunk flipped, exactly the reads whose
/// bytes touch that chunk fail, so a read by range verifies what it reads and no more.
#[test]
fn reads_by_range_verify_the_chunks_they_touch() {
    super::checksum::TEST_CHUNK.with(|c| c.set(Some(6)));
    let mut rng = StdRng::from_entropy();
    let dir = temp_dir("chunks");
    let updater = adam();
    let many = truths(&mut rng, &updater, 7, false);
    save(&dir, &mut rng, &updater, &many, 3);
    for world in 1..=4 {
        check_reads(&dir, &mut rng, &updater, &many, world);
    }

    let mut t = truths(&mut rng, &updater, 1, false).remove(0);
    let n = 37;
    set_one_dim(&mut t, n);
    t.meta.has_state = true;
    t.meta.step = 5;
    t.value = random(&mut rng, n, t.meta.dtype);
    t.state = (0..2)
        .map(|_| random(&mut rng, n, acc(t.meta.dtype)))
        .collect();
    let g = save(&dir, &mut rng, &updater, std::slice::from_ref(&t), 1);
    let path = shard_path(&generation_dir(&dir, g), 0, 1);
    let good = fs::read(&path).unwrap();
    let size = t.meta.dtype.size();
    for tensor in ["value", "state"] {
        let name = match tensor {
            "value" => format!("value/{}", t.meta.key),
            _ => format!("state/{}/var", t.meta.key),
        };
        let elem = if tensor == "value" {
            size
        } else {
            acc(t.meta.dtype).size()
        };
        let span = tensor_bytes(&good, &name);
        let byte = rng.gen_range(0..span.len());
        let mut bad = good.clone();
        bad[span.start + byte] ^= 1 << rng.gen_range(0..8);
        fs::write(&path, &bad).unwrap();
        let reader = open(&dir).unwrap();
        let chunk = (byte / 6 * 6)..(byte / 6 * 6 + 6);
        for start in 0..=n {
            for end in start..=n {
                let bytes = start * elem..end * elem;
                let touches =
                    !bytes.is_empty() && bytes.start < chunk.end && chunk.start < bytes.end;
                match reader.read(&t.meta.key, start..end) {
                    Ok(p) => {
                        assert!(!touches, "{name} {start}..{end} read a corrupt chunk");
                        assert_eq!(p.value.to_vec::<f64>().unwrap(), t.value[start..end]);
                        for (got, want) in p.state.iter().zip(&t.state) {
                            assert_eq!(got.1.to_vec::<f64>().unwrap(), want[start..end]);
                        }
                    }
                    Err(e) => {
                        assert!(touches, "{name} {start}..{end}: {e}");
                        assert_checksum_error(e, &path);
                    }
                }
            }
        }
    }
    super::checksum::TEST_CHUNK.with(|c| c.set(None));
    fs::remove_dir_all(&dir).unwrap();
}

/// A key the file marks row-sparse must have two or more dimensions: a file that marks a 1-D
/// key (hand-made: `save` never writes one) is invalid, in a single file and in a shard's
/// piece, instead of a key no row-sparse call could use.
#[test]
fn a_row_sparse_key_of_one_dimension_is_invalid() {
    use super::entry::{Entry, EntryState};
    let entry = |dims: &[usize]| Entry {
        key: Key::Int(3),
        shape: crate::Shape::new(dims).unwrap(),
        value: crate::HostData::filled(DType::F32, dims.iter().product(), 0.5),
        state: None::<EntryState>,
        row_sparse: true,
        residuals: Vec::new(),
    };
    let encode = |e| {
        super::file::encode(Some(crate::KeyKind::Int), &Updater::Assign, &[e])
            .unwrap_or_else(|_| panic!("encoded"))
    };
    assert!(super::file::check_file(&encode(entry(&[2, 3]))).is_ok());
    let bad = encode(entry(&[6]));
    let err = super::file::check_file(&bad).err().expect("refused");
    match err.at(Path::new("x")) {
        Error::Checkpoint { kind, message, .. } => {
            assert_eq!(kind, CheckpointErrorKind::Invalid, "{message}");
            assert!(message.contains("two or more dimensions"), "{message}");
        }
        other => panic!("{other}"),
    }
}

/// Each rank's residuals come back from its own shard, exactly, for as many ranks; another
/// number of ranks gets none. Residuals of another length than their key, or of a key no shard
/// holds, make the checkpoint invalid at commit.
#[test]
fn a_shards_residuals_come_back_to_its_rank_only() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    let updater = Updater::Assign;
    let dir = temp_dir("residuals");
    let keys = truths(&mut rng, &updater, 3, false);
    let world = 2;
    let held = layout(&mut rng, &keys, world);
    let mine = |rank: usize, rng: &mut StdRng| -> Vec<KeyResiduals> {
        let mut out = Vec::new();
        for t in keys.iter() {
            if !rng.gen_bool(0.7) {
                continue;
            }
            let n = t.meta.size();
            // Position 1 never pushed on rank 1: saved as zeros.
            let residuals = (0..2)
                .map(|i| match (rank, i) {
                    (1, 1) => Vec::new(),
                    _ => (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect(),
                })
                .collect();
            out.push(KeyResiduals {
                key: t.meta.key.clone(),
                len: n,
                residuals,
            });
        }
        out
    };
    let saved: Vec<Vec<KeyResiduals>> = (0..world).map(|r| mine(r, &mut rng)).collect();
    let g = next_generation(&dir).unwrap();
    for (rank, h) in held.iter().enumerate() {
        let pieces = pieces_of(&keys, &updater, h);
        write_shard(&dir, g, rank, world, &updater, &pieces, &saved[rank]).unwrap();
    }
    commit(&dir, g, world).unwrap();
    let reader = open(&dir).unwrap();
    for (rank, want) in saved.iter().enumerate() {
        let got = reader.rank_residuals(rank, world).unwrap().unwrap();
        let want: Vec<KeyResiduals> = want
            .iter()
            .map(|r| KeyResiduals {
                residuals: (r.residuals.iter())
                    .map(|v| {
                        if v.is_empty() {
                            vec![0.0; r.len]
                        } else {
                            v.clone()
                        }
                    })
                    .collect(),
                ..r.clone()
            })
            .collect();
        assert_eq!(got.len(), want.len(), "rank {rank}");
        for w in &want {
            assert!(
                got.contains(w),
                "rank {rank}: {:?} missing from {got:?}",
                w.key
            );
        }
    }
    assert!(reader.rank_residuals(0, world + 1).unwrap().is_none());

    let bad_len = KeyResiduals {
        key: keys[0].meta.key.clone(),
        len: keys[0].meta.size() + 1,
        residuals: vec![vec![0.5; keys[0].meta.size() + 1]],
    };
    let no_key = KeyResiduals {
        key: Key::Int(1_000_000),
        len: 3,
        residuals: vec![vec![0.5; 3]],
    };
    for bad in [bad_len, no_key] {
        let g = next_generation(&dir).unwrap();
        for (rank, h) in held.iter().enumerate() {
            let pieces = pieces_of(&keys, &updater, h);
            let r = if rank == 1 {
                vec![bad.clone()]
            } else {
                Vec::new()
            };
            write_shard(&dir, g, rank, world, &updater, &pieces, &r).unwrap();
        }
        let e = commit(&dir, g, world).unwrap_err();
        assert_eq!(
            checkpoint_kind(e),
            CheckpointErrorKind::Invalid,
            "{:?}",
            bad.key
        );
    }
    let _ = fs::remove_dir_all(&dir);
}

/// Ranks compare [`Reader::which`](super::Reader::which) before a load: two checkpoints that
/// differ only in their values (the same generation, the same token, the same keys, as two
/// ranks might find on file systems that are not shared) are told apart, and the same
/// checkpoint opened twice is not.
#[test]
fn checkpoints_that_differ_only_in_values_are_told_apart() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    let updater = adam();
    let t = truths(&mut rng, &updater, 5, false);
    let other = same_model_other_values(&mut rng, &t);
    let save = SaveId {
        generation: 3,
        token: rng.gen(),
    };
    let root = temp_dir("which");
    let write = |name: &str, truths: &[Truth]| {
        let dir = root.join(name);
        fs::create_dir_all(&dir).unwrap();
        let held: Vec<(usize, Range<usize>)> = (0..truths.len())
            .map(|i| (i, 0..truths[i].meta.size()))
            .collect();
        let pieces = pieces_of(truths, &updater, &held);
        write_shard(&dir, save, 0, 1, &updater, &pieces, &[]).unwrap();
        commit(&dir, save, 1).unwrap();
        dir
    };
    let (a, b) = (write("a", &t), write("b", &other));
    let (ra, rb) = (open(&a).unwrap(), open(&b).unwrap());
    assert_ne!(ra.which(), rb.which());
    assert_eq!(ra.which(), open(&a).unwrap().which());
    assert!(
        ra.which().contains(&token_text(save.token)),
        "{}",
        ra.which()
    );
    fs::remove_dir_all(&root).unwrap();
}

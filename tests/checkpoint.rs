//! `KvStore::save` / `KvStore::load`: round trips of values and updater state, atomic saves,
//! loads into other store kinds, and typed errors (never panics) for bad files.
//!
//! Every test runs on both homes: `cpu::*` with `local` stores and arrays on cpu(i); `gpu::*`
//! (ignored: needs a GPU) with `device` stores and arrays on the GPUs. Loads across kinds go
//! between a `local` store and every kind of the home, both ways.

#[path = "common/checkpoint_format.rs"]
mod checkpoint_format;
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::Home;
use kvstore::checkpoint::{set_load_hook, LoadStage};
use kvstore::{Adam, CheckpointErrorKind, DType, Error, Key, KvStore, NDArray, Sgd, Updater};
use rand::prelude::*;
use safetensors::tensor::SafeTensors;

/// A fresh directory for one test on one home (both homes' tests may run at once).
fn temp_dir(h: Home, name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("kvstore-ckpt-{name}-{h:?}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn random(rng: &mut StdRng, shape: &[usize], dtype: DType) -> NDArray {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
    let a = NDArray::from_vec(v, kvstore::Shape::new(shape).unwrap()).unwrap();
    a.astype(dtype).unwrap()
}

const SHAPES: [&[usize]; 4] = [&[5, 3], &[17], &[], &[2, 2, 3]];

fn sgd() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.05,
        momentum: 0.9,
        wd: 0.01,
        rescale_grad: 0.5,
        ..Sgd::default()
    })
}

fn adam() -> Updater {
    Updater::Adam(Adam {
        lr: 0.01,
        wd: 0.001,
        rescale_grad: 0.25,
        ..Adam::default()
    })
}

/// The home that keeps the keys of a `kind` store in a test on `h`: `h` for its own kinds, the
/// CPU for `local` in a GPU test.
fn home_for(h: Home, kind: &str) -> Home {
    if h.kinds().contains(&kind) {
        h
    } else {
        Home::Cpu
    }
}

/// A fresh store of `kind` (see [`home_for`]).
fn store_of(h: Home, kind: &str) -> KvStore {
    home_for(h, kind).store_of(kind)
}

/// Checks that every key of `kv` lives on `h`.
fn assert_homes(h: Home, kv: &KvStore) {
    for k in kv.keys() {
        let home = kv.meta(&k).unwrap().2;
        assert!(h.is_home(home), "key {k} is homed on {home}, not on {h:?}");
    }
}

/// A store of `kind` with one key per dtype and shape, random values (on the store's home),
/// `updater` set.
fn filled_store(h: Home, kind: &str, updater: &Updater, rng: &mut StdRng) -> (KvStore, Vec<i32>) {
    let home = home_for(h, kind);
    let kv = home.store_of(kind);
    kv.set_updater(updater.clone()).unwrap();
    let mut keys = Vec::new();
    for (d, dtype) in DType::ALL.into_iter().enumerate() {
        for (s, shape) in SHAPES.iter().enumerate() {
            let key = (d * 10 + s) as i32 - 7;
            kv.init(key, &home.put(&random(rng, shape, dtype), 0))
                .unwrap();
            keys.push(key);
        }
    }
    assert_homes(home, &kv);
    (kv, keys)
}

/// Pushes two random values per key, the same to every store given. Each store gets both on
/// the key's home device (several values on one GPU), where every home sums them in f32 in the
/// same order, so stores of different homes stay equal bit for bit.
fn push_round(stores: &[&KvStore], keys: &[i32], rng: &mut StdRng) {
    let values: Vec<Vec<NDArray>> = keys
        .iter()
        .map(|&k| {
            let (shape, dtype, _) = stores[0].meta(k).unwrap();
            (0..2).map(|_| random(rng, shape.dims(), dtype)).collect()
        })
        .collect();
    for kv in stores {
        let placed: Vec<Vec<NDArray>> = keys
            .iter()
            .zip(&values)
            .map(|(&k, vals)| {
                let home = kv.meta(k).unwrap().2;
                vals.iter().map(|v| v.to_device(home).unwrap()).collect()
            })
            .collect();
        kv.push_list(keys, &placed).unwrap();
    }
}

/// Every key's value as raw f64s (exact for every dtype), in `kv.keys()` order.
fn snapshot(kv: &KvStore) -> Vec<(Key, DType, Vec<f64>)> {
    kv.keys()
        .into_iter()
        .map(|k| {
            let (shape, dtype, _) = kv.meta(&k).unwrap();
            let out = NDArray::full_on(shape, 0.0, dtype, kvstore::cpu(0)).unwrap();
            kv.pull(&k, &out).unwrap();
            (k, dtype, out.to_vec::<f64>().unwrap())
        })
        .collect()
}

fn round_trip(h: Home, updater: Updater, seed: u64) {
    let dir = temp_dir(h, &format!("roundtrip-{}", updater.name()));
    let path = dir.join("ckpt.safetensors");
    let mut rng = StdRng::seed_from_u64(seed);
    let (kv, keys) = filled_store(h, h.kind(), &updater, &mut rng);
    for _ in 0..3 {
        push_round(&[&kv], &keys, &mut rng);
    }
    kv.save(&path).unwrap();

    let restored = h.store();
    restored.set_updater(updater.clone()).unwrap();
    restored.load(&path).unwrap();
    assert_homes(h, &restored);
    assert_eq!(snapshot(&restored), snapshot(&kv));
    // Loaded into a store that holds the keys and their state already (other values, other
    // momentum or moments, other step counts): the checkpoint's replace them (on a GPU home,
    // copied into the state buffers the keys have).
    let (held, _) = filled_store(h, h.kind(), &updater, &mut rng);
    push_round(&[&held], &keys, &mut rng);
    held.load(&path).unwrap();
    assert_eq!(snapshot(&held), snapshot(&kv));

    // Further pushes give exactly what the uninterrupted store gives: momentum, Adam's moments
    // and step counts came back too.
    for _ in 0..3 {
        push_round(&[&kv, &restored, &held], &keys, &mut rng);
    }
    assert_eq!(snapshot(&restored), snapshot(&kv));
    assert_eq!(snapshot(&held), snapshot(&kv));

    std::fs::remove_dir_all(&dir).unwrap();
}

fn round_trip_sgd_momentum_all_dtypes(h: Home) {
    round_trip(h, sgd(), 1);
}

fn round_trip_adam_all_dtypes(h: Home) {
    round_trip(h, adam(), 2);
}

/// Dropping the state on load is caught: pushes after a values-only restore differ.
fn lost_state_would_be_noticed(h: Home) {
    let mut rng = StdRng::seed_from_u64(3);
    let (kv, keys) = filled_store(h, h.kind(), &adam(), &mut rng);
    push_round(&[&kv], &keys, &mut rng);
    let copy = h.store();
    copy.set_updater(adam()).unwrap();
    for (k, dtype, v) in snapshot(&kv) {
        let shape = kv.meta(&k).unwrap().0;
        let a = NDArray::from_vec(v, shape).unwrap().astype(dtype).unwrap();
        copy.init(k, &h.put(&a, 0)).unwrap();
    }
    assert_homes(h, &copy);
    assert_eq!(snapshot(&copy), snapshot(&kv));
    push_round(&[&kv, &copy], &keys, &mut rng);
    assert_ne!(snapshot(&copy), snapshot(&kv));
}

/// String keys come back with their names and init order, in every kind of the home (the
/// original case: a `local` checkpoint loaded into an `nccl` store).
fn string_keys_keep_names_and_order(h: Home) {
    let dir = temp_dir(h, "strkeys");
    let path = dir.join("s.safetensors");
    let mut rng = StdRng::seed_from_u64(4);
    let kv = h.store();
    let names = ["fc2/weight", "fc1/bias", "zeta", "a/b/c", "12"];
    for n in names {
        kv.init(n, &h.put(&random(&mut rng, &[3, 2], DType::F32), 0))
            .unwrap();
    }
    kv.set_updater(sgd()).unwrap();
    let grads: Vec<NDArray> = (0..5)
        .map(|i| h.put(&random(&mut rng, &[3, 2], DType::F32), i))
        .collect();
    kv.push_list(&names, &grads).unwrap();
    kv.save(&path).unwrap();
    for kind in h.kinds() {
        let restored = h.store_of(kind);
        restored.set_updater(sgd()).unwrap();
        restored.load(&path).unwrap();
        assert_eq!(restored.keys(), names.map(Key::from).to_vec(), "{kind}");
        assert_homes(h, &restored);
        assert_eq!(snapshot(&restored), snapshot(&kv), "{kind}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint of one kind loads into a store of another that already holds some of the
/// keys; the others are initialized, on the target's home. The kinds: `local` and each other
/// kind of the home, both ways (the original case: `local` into `device`). Pushes afterwards
/// give the same values in both stores, across homes too.
fn cross_kind_load_initializes_missing_keys(h: Home) {
    let dir = temp_dir(h, "crosskind");
    let path = dir.join("c.safetensors");
    let mut rng = StdRng::seed_from_u64(5);
    let mut pairs = Vec::new();
    for kind in h.kinds() {
        if kind != "local" {
            pairs.extend([("local", kind), (kind, "local")]);
        }
    }
    assert!(!pairs.is_empty());
    for (from, to) in pairs {
        let (kv, keys) = filled_store(h, from, &adam(), &mut rng);
        push_round(&[&kv], &keys, &mut rng);
        kv.save(&path).unwrap();

        let home = home_for(h, to);
        let target = store_of(h, to);
        target.set_updater(adam()).unwrap();
        for &k in &keys[..5] {
            let (shape, dtype, _) = kv.meta(k).unwrap();
            target
                .init(k, &home.put(&random(&mut rng, shape.dims(), dtype), 0))
                .unwrap();
        }
        target.load(&path).unwrap();
        assert_homes(home, &target);
        assert_eq!(snapshot(&target), snapshot(&kv), "{from} into {to}");
        push_round(&[&kv, &target], &keys, &mut rng);
        assert_eq!(snapshot(&target), snapshot(&kv), "{from} into {to}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The message of a checkpoint error and the text of every error under it.
fn error_text(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(" / {s}"));
        source = s.source();
    }
    text
}

fn assert_checkpoint_error(result: kvstore::Result<()>, needle: &str) {
    match result {
        Err(e @ Error::Checkpoint { .. }) => {
            let text = error_text(&e);
            assert!(text.contains(needle), "'{text}' lacks '{needle}'")
        }
        other => panic!("expected a checkpoint error about '{needle}', got {other:?}"),
    }
}

/// As [`assert_checkpoint_error`], of this kind.
fn assert_checkpoint_kind(result: kvstore::Result<()>, want: CheckpointErrorKind, needle: &str) {
    match result {
        Err(e @ Error::Checkpoint { kind, .. }) if kind == want => {
            let text = error_text(&e);
            assert!(text.contains(needle), "'{text}' lacks '{needle}'")
        }
        other => panic!("expected a {want:?} checkpoint error about '{needle}', got {other:?}"),
    }
}

/// Mismatched shapes, dtypes, key kinds and updaters are typed errors, and nothing changes:
/// not even the keys the file has and the store lacks.
fn mismatches_are_errors_and_change_nothing(h: Home) {
    let dir = temp_dir(h, "mismatch");
    let path = dir.join("m.safetensors");
    let mut rng = StdRng::seed_from_u64(6);
    let kv = h.store();
    kv.init_list(
        &[1, 2],
        &[
            h.put(&random(&mut rng, &[4], DType::F32), 0),
            h.put(&random(&mut rng, &[2, 3], DType::F16), 0),
        ],
    )
    .unwrap();
    kv.set_updater(sgd()).unwrap();
    kv.push_list(
        &[1, 2],
        &[
            h.put(&random(&mut rng, &[4], DType::F32), 0),
            h.put(&random(&mut rng, &[2, 3], DType::F16), 1),
        ],
    )
    .unwrap();
    assert_homes(h, &kv);
    kv.save(&path).unwrap();

    let cases: Vec<(KvStore, &str)> = vec![
        (
            store_with(h, 2, &[3, 2], DType::F16, sgd()),
            "store holds (3, 2) float16",
        ),
        (store_with(h, 2, &[2, 3], DType::BF16, sgd()), "bfloat16"),
    ];
    for (target, needle) in cases {
        let before = snapshot(&target);
        assert_checkpoint_kind(target.load(&path), CheckpointErrorKind::Mismatch, needle);
        assert_eq!(snapshot(&target), before, "{needle}");
        assert_eq!(
            target.keys(),
            vec![Key::Int(2)],
            "{needle}: key 1 was added"
        );
    }
    let strings = h.store();
    strings.set_updater(sgd()).unwrap();
    strings
        .init("w", &h.put(&random(&mut rng, &[2], DType::F32), 0))
        .unwrap();
    let before = snapshot(&strings);
    assert_checkpoint_kind(
        strings.load(&path),
        CheckpointErrorKind::Mismatch,
        "int keys",
    );
    assert_eq!(strings.keys(), vec![Key::from("w")]);
    assert_checkpoint_kind(
        strings.load(dir.join("missing.safetensors")),
        CheckpointErrorKind::NotFound,
        "check the path",
    );
    assert_eq!(snapshot(&strings), before);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn store_with(h: Home, key: i32, shape: &[usize], dtype: DType, updater: Updater) -> KvStore {
    let mut rng = StdRng::seed_from_u64(key as u64 + 99);
    let kv = h.store();
    kv.init(key, &h.put(&random(&mut rng, shape, dtype), 0))
        .unwrap();
    assert_homes(h, &kv);
    kv.set_updater(updater).unwrap();
    kv
}

/// The temporary files left anywhere under `dir`.
fn leftovers(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            found.extend(leftovers(&e.path()));
        }
        let name = e.file_name().to_string_lossy().into_owned();
        if name.contains(".tmp-") {
            found.push(name);
        }
    }
    found
}

/// The bytes of the biggest file under checkpoint directory `dir`: its shard.
fn shard_len(dir: &Path) -> u64 {
    let mut biggest = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let len = match e.file_type().unwrap().is_dir() {
            true => shard_len(&e.path()),
            false => e.metadata().unwrap().len(),
        };
        biggest = biggest.max(len);
    }
    biggest
}

/// A save whose writer fails part way leaves the previous checkpoint intact and loadable, and
/// no temporary file behind.
fn failed_save_keeps_the_previous_checkpoint(h: Home) {
    let dir = temp_dir(h, "interrupted");
    let path = dir.join("i.safetensors");
    let mut rng = StdRng::seed_from_u64(7);
    let (kv, keys) = filled_store(h, h.kind(), &sgd(), &mut rng);
    push_round(&[&kv], &keys, &mut rng);
    kv.save(&path).unwrap();
    let saved = snapshot(&kv);
    let len = shard_len(&path);

    push_round(&[&kv], &keys, &mut rng);
    assert_ne!(snapshot(&kv), saved);
    for cut in [0, 1, 8, 100, len / 2, len - 1] {
        kvstore::checkpoint::fail_writes_after(Some(cut));
        let result = kv.save(&path);
        kvstore::checkpoint::fail_writes_after(None);
        assert_checkpoint_error(result, "injected write failure");
        assert_eq!(leftovers(&dir), Vec::<String>::new());
        let check = h.store();
        check.set_updater(sgd()).unwrap();
        check.load(&path).unwrap();
        assert_eq!(snapshot(&check), saved, "cut at {cut}");
    }
    kv.save(&path).unwrap();
    let check = h.store();
    check.set_updater(sgd()).unwrap();
    check.load(&path).unwrap();
    assert_eq!(snapshot(&check), snapshot(&kv));
    std::fs::remove_dir_all(&dir).unwrap();
}

const CHILD_ENV: &str = "KVSTORE_CHECKPOINT_CHILD";
const CHILD_KEYS: i32 = 8;
const CHILD_LEN: usize = 1 << 18;

/// A process killed in the middle of saving (again and again) leaves a checkpoint that loads,
/// and whose every key holds the same generation: one whole save, never a mix. The child is
/// this same test (`cpu::` or `gpu::`), saving from a store of the home.
fn killed_saver_leaves_a_loadable_checkpoint(h: Home) {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        return saver_child(h, Path::new(&path));
    }
    let dir = temp_dir(h, "killed");
    let path = dir.join("k.safetensors");
    let mut rng = StdRng::seed_from_u64(8);
    let name = match h {
        Home::Cpu => "cpu::killed_saver_leaves_a_loadable_checkpoint",
        Home::Gpu => "gpu::killed_saver_leaves_a_loadable_checkpoint",
    };
    for round in 0..3 {
        // Made first: a GPU test without a GPU fails here, not after the child's minute.
        let kv = h.store();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--include-ignored", "--quiet"])
            .env(CHILD_ENV, &path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        // The directory appears when a save claims its first generation; the checkpoint is
        // there once the index is.
        while !path.join("index").exists() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the child never saved"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(5..150)));
        child.kill().unwrap();
        child.wait().unwrap();

        kv.load(&path).unwrap();
        assert_homes(h, &kv);
        let snap = snapshot(&kv);
        assert_eq!(snap.len(), CHILD_KEYS as usize);
        let generation = snap[0].2[0];
        for (k, _, v) in &snap {
            assert!(
                v.iter()
                    .all(|&x| x == generation + f64::from(k.to_string().parse::<i32>().unwrap())),
                "round {round}: key {k} is not from save {generation}"
            );
        }
        std::fs::remove_dir_all(&path).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The child: saves generation after generation until it is killed (or, should the parent be
/// gone, for a minute at most).
fn saver_child(h: Home, path: &Path) {
    let start = Instant::now();
    let kv = h.store();
    let keys: Vec<i32> = (0..CHILD_KEYS).collect();
    let zeros: Vec<NDArray> = keys.iter().map(|_| h.full([CHILD_LEN], 0.0, 0)).collect();
    kv.init_list(&keys, &zeros).unwrap();
    for generation in 0.. {
        if start.elapsed() > Duration::from_secs(60) {
            return;
        }
        let values: Vec<NDArray> = keys
            .iter()
            .map(|&k| h.full([CHILD_LEN], f64::from(generation * 100 + k), 0))
            .collect();
        kv.push_list(&keys, &values).unwrap();
        kv.save(path).unwrap();
    }
}

/// A tensor taken apart: name, dtype, shape, bytes.
type Tensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// A valid checkpoint's tensors and metadata, to rebuild altered files from.
fn parts(bytes: &[u8]) -> (Vec<Tensor>, HashMap<String, String>) {
    let file = SafeTensors::deserialize(bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    let tensors = file
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    (tensors, meta.metadata().clone().unwrap())
}

/// A file of `tensors` and `meta`, with fresh checksums, so that it passes them and the checks
/// behind them are what a load meets.
fn rebuild(tensors: &[Tensor], meta: HashMap<String, String>) -> Vec<u8> {
    checkpoint_format::sealed(&as_views(tensors), meta)
}

fn as_views(tensors: &[Tensor]) -> Vec<checkpoint_format::Tensor<'_>> {
    tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect()
}

/// Well-formed safetensors files with wrong contents: typed errors naming the problem.
fn wrong_metadata_and_tensors_are_typed_errors(h: Home) {
    let dir = temp_dir(h, "wrong");
    let path = dir.join("w.safetensors");
    let mut rng = StdRng::seed_from_u64(9);
    let (kv, keys) = filled_store(h, h.kind(), &adam(), &mut rng);
    push_round(&[&kv], &keys, &mut rng);
    kv.save_single_file(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let (tensors, meta) = parts(&good);
    let key = keys[1];

    type Alter = Box<dyn Fn(&mut Vec<Tensor>, &mut HashMap<String, String>)>;
    let cases: Vec<(Alter, &str)> = vec![
        (
            Box::new(|_, m| {
                m.remove("format");
            }),
            "'format' is missing",
        ),
        (
            Box::new(|_, m| {
                m.insert("format".into(), "other/9".into());
            }),
            "format",
        ),
        (
            Box::new(|_, m| {
                m.insert("key_kind".into(), "float".into());
            }),
            "key_kind",
        ),
        (
            Box::new(|_, m| {
                m.insert("keys".into(), "99999999999".into());
            }),
            "key count",
        ),
        (
            Box::new(|_, m| {
                m.insert("keys".into(), "3".into());
            }),
            "order",
        ),
        (
            Box::new(move |_, m| {
                m.insert(format!("order/{key}"), "0".into());
            }),
            "share place",
        ),
        (
            Box::new(move |_, m| {
                m.insert(format!("step/{key}"), "many".into());
            }),
            "not a count",
        ),
        (
            Box::new(|_, m| {
                m.insert("state_names".into(), "mean".into());
            }),
            "belongs to no key",
        ),
        (
            Box::new(|_, m| {
                m.insert("step/123456".into(), "1".into());
            }),
            "belongs to no key",
        ),
        (
            Box::new(move |t, _| t.retain(|x| x.0 != format!("value/{key}"))),
            "missing",
        ),
        (
            Box::new(move |t, _| t.retain(|x| x.0 != format!("state/{key}/var"))),
            "missing",
        ),
        (
            Box::new(|t, _| t.push(("stray".into(), safetensors::Dtype::F32, vec![1], vec![0; 4]))),
            "belongs to no key",
        ),
        (
            Box::new(move |t, _| {
                let x = t
                    .iter_mut()
                    .find(|x| x.0 == format!("state/{key}/mean"))
                    .unwrap();
                x.1 = safetensors::Dtype::I32;
            }),
            "dtype",
        ),
        (
            Box::new(move |t, _| {
                let x = t
                    .iter_mut()
                    .find(|x| x.0 == format!("state/{key}/mean"))
                    .unwrap();
                x.2 = vec![1, x.3.len() / 4];
            }),
            "shape",
        ),
    ];
    for (i, (alter, needle)) in cases.into_iter().enumerate() {
        let (mut t, mut m) = (tensors.clone(), meta.clone());
        alter(&mut t, &mut m);
        std::fs::write(&path, rebuild(&t, m)).unwrap();
        let target = h.store();
        target.set_updater(adam()).unwrap();
        assert_checkpoint_kind(target.load(&path), CheckpointErrorKind::Invalid, needle);
        assert!(target.keys().is_empty(), "case {i} changed the store");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Truncated files and random bit flips: a typed error, never a panic nor a load (every byte
/// is under a checksum), and a failed load changes nothing.
fn truncated_and_corrupt_files_never_panic(h: Home) {
    let dir = temp_dir(h, "fuzz");
    let path = dir.join("f.safetensors");
    let mut rng = StdRng::seed_from_u64(10);
    let (kv, keys) = filled_store(h, h.kind(), &sgd(), &mut rng);
    push_round(&[&kv], &keys, &mut rng);
    kv.save_single_file(&path).unwrap();
    let good = std::fs::read(&path).unwrap();

    let target = h.store();
    target.set_updater(sgd()).unwrap();
    target
        .init(keys[0], &h.put(&random(&mut rng, SHAPES[0], DType::F32), 0))
        .unwrap();
    assert_homes(h, &target);
    let before = snapshot(&target);

    let header_end = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let cuts = (0..header_end)
        .step_by(3)
        .chain((header_end..good.len()).step_by(7));
    let mut truncated = 0;
    for cut in cuts {
        std::fs::write(&path, &good[..cut]).unwrap();
        assert!(
            matches!(target.load(&path), Err(Error::Checkpoint { .. })),
            "a file cut at {cut} of {} loaded",
            good.len()
        );
        truncated += 1;
    }
    assert!(truncated > 300);
    assert_eq!(snapshot(&target), before);

    const FLIPS: usize = 1000;
    let (mut loaded, mut failed) = (0, 0);
    for _ in 0..FLIPS {
        let mut bad = good.clone();
        for _ in 0..rng.gen_range(1..4) {
            // Mostly the header, where the structure is.
            let at = if rng.gen_bool(0.8) {
                rng.gen_range(0..header_end)
            } else {
                rng.gen_range(0..bad.len())
            };
            bad[at] ^= 1 << rng.gen_range(0..8);
        }
        std::fs::write(&path, &bad).unwrap();
        let fresh = h.store();
        fresh.set_updater(sgd()).unwrap();
        match fresh.load(&path) {
            Ok(()) => {
                assert_homes(h, &fresh);
                loaded += 1;
            }
            Err(Error::Checkpoint { .. }) => {
                failed += 1;
                assert!(fresh.keys().is_empty());
            }
            Err(e) => panic!("not a checkpoint error: {e}"),
        }
    }
    assert_eq!(loaded, 0, "{loaded} of {FLIPS} corrupt files loaded");
    assert_eq!(failed, FLIPS);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One flipped bit anywhere in a saved file (issue 16, fault 5): in any tensor's data, in a step
/// count (still a well-formed count), in the header. Each load is a typed `Invalid`
/// error that names the file, and the store loaded into keeps its values.
fn a_flipped_bit_is_a_typed_error_and_changes_nothing(h: Home) {
    let dir = temp_dir(h, "flip");
    let path = dir.join("f.safetensors");
    let mut rng = StdRng::from_entropy();
    let (kv, keys) = filled_store(h, h.kind(), &adam(), &mut rng);
    push_round(&[&kv], &keys, &mut rng);
    kv.save_single_file(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let target = h.store();
    target.set_updater(adam()).unwrap();
    target.load(&path).unwrap();
    push_round(&[&target], &keys, &mut rng);
    let before = snapshot(&target);
    // The load's error, which must be Invalid and name the file; its text.
    let expect_error = |bad: &[u8], what: &str| -> String {
        std::fs::write(&path, bad).unwrap();
        match target.load(&path) {
            Err(
                e @ Error::Checkpoint {
                    kind: CheckpointErrorKind::Invalid,
                    ..
                },
            ) => {
                assert!(matches!(&e, Error::Checkpoint { path: p, .. } if *p == path));
                error_text(&e)
            }
            other => panic!("{what}: expected an Invalid checkpoint error, got {other:?}"),
        }
    };

    // A bit of every tensor's data.
    let (n, meta) = SafeTensors::read_metadata(&good).unwrap();
    let data_start = 8 + n;
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        if s == e {
            continue;
        }
        let mut bad = good.clone();
        bad[data_start + rng.gen_range(s..e)] ^= 1 << rng.gen_range(0..8);
        let text = expect_error(&bad, &format!("a bit of {name}"));
        assert!(text.contains("checksum") && text.contains(&name), "{text}");
    }
    // A step count one off.
    // (Searched in the JSON only: the 8-byte length before it need not be text.)
    let text = std::str::from_utf8(&good[8..data_start]).unwrap();
    let at = text.find("\"step/").expect("a step entry");
    let value = at + text[at..].find("\":\"").unwrap() + 3;
    let end = 8 + value + text[value..].find('"').unwrap();
    let mut bad = good.clone();
    bad[end - 1] ^= 1;
    let text = expect_error(&bad, "a step count");
    assert!(text.contains("checksum"), "{text}");
    // One bit of 400 random bytes of the header (the unit tests flip every byte of a shard's).
    for _ in 0..400 {
        let byte = rng.gen_range(0..data_start);
        let mut bad = good.clone();
        bad[byte] ^= 1 << rng.gen_range(0..8);
        expect_error(&bad, &format!("header byte {byte}"));
    }
    assert_eq!(snapshot(&target), before, "a failed load changed the store");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The checksum entries themselves: missing, stray, malformed or wrong, each is a typed
/// `Invalid` error naming the problem, and the store is unchanged. Files of format 1 (no
/// checksums) still load, and one of format 1 that has checksum entries is invalid.
fn checksum_entries_are_checked(h: Home) {
    let dir = temp_dir(h, "sums");
    let path = dir.join("c.safetensors");
    let mut rng = StdRng::from_entropy();
    let (kv, keys) = filled_store(h, h.kind(), &adam(), &mut rng);
    push_round(&[&kv], &keys, &mut rng);
    kv.save_single_file(&path).unwrap();
    let (tensors, meta) = parts(&std::fs::read(&path).unwrap());
    assert_eq!(meta["format"], "kvstore-checkpoint/2");
    let views = as_views(&tensors);
    let fresh = checkpoint_format::with_checksums(&views, meta.clone());
    let value = format!("value/{}", keys[0]);

    type Alter = Box<dyn Fn(&mut HashMap<String, String>)>;
    let entry = format!("crc32/{value}");
    let (e1, e2) = (entry.clone(), entry.clone());
    let cases: Vec<(Alter, &str)> = vec![
        (
            Box::new(move |m| {
                m.remove(&e1);
            }),
            "is missing",
        ),
        (
            Box::new(|m| {
                m.insert("crc32/value/99999".into(), "00000000".into());
            }),
            "belongs to no tensor",
        ),
        (
            Box::new(|m| {
                m.insert("crc32_chunk".into(), "0".into());
            }),
            "chunk size",
        ),
        (
            Box::new(|m| {
                m.insert("crc32_chunk".into(), "16.0".into());
            }),
            "chunk size",
        ),
        (
            Box::new(|m| {
                m.insert("crc32_chunk".into(), "1".into());
            }),
            "chunks of 1",
        ),
        (
            // One chunk's checksum wrong, in a header whose own checksum is right.
            Box::new(move |m| {
                let mut sums: Vec<String> = m[&e2].split(',').map(str::to_owned).collect();
                sums[0] = if sums[0] == "00000000" {
                    "00000001"
                } else {
                    "00000000"
                }
                .into();
                m.insert(e2.clone(), sums.join(","));
            }),
            "checksum of tensor",
        ),
    ];
    let target = h.store();
    target.set_updater(adam()).unwrap();
    for (alter, needle) in cases {
        let mut m = fresh.clone();
        alter(&mut m);
        std::fs::write(&path, checkpoint_format::with_header_checksum(&views, m)).unwrap();
        assert_checkpoint_kind(target.load(&path), CheckpointErrorKind::Invalid, needle);
        assert!(target.keys().is_empty());
    }
    // No header checksum at all, in a file of format 2.
    let mut m = fresh.clone();
    m.remove("header_crc32");
    std::fs::write(&path, checkpoint_format::plain(&views, m)).unwrap();
    assert_checkpoint_kind(
        target.load(&path),
        CheckpointErrorKind::Invalid,
        "header's checksum",
    );
    // Format 1: no checksum entries, loads (unverified); with them, invalid.
    let mut m = meta.clone();
    m.retain(|k, _| !k.starts_with("crc32") && k != "header_crc32");
    m.insert("format".into(), "kvstore-checkpoint/1".into());
    std::fs::write(&path, checkpoint_format::plain(&views, m)).unwrap();
    target.load(&path).unwrap();
    assert_eq!(snapshot(&target), snapshot(&kv));
    let mut m = fresh.clone();
    m.insert("format".into(), "kvstore-checkpoint/1".into());
    std::fs::write(&path, checkpoint_format::with_header_checksum(&views, m)).unwrap();
    let other = h.store();
    assert_checkpoint_kind(other.load(&path), CheckpointErrorKind::Invalid, "format 1");
    assert!(other.keys().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// How long a call that may deadlock gets before the test calls it a hang. Generous: it only
/// tells a hang from a slow machine, and is never reached by a passing test.
const HANG: Duration = Duration::from_secs(120);

/// Runs `f` on its own thread and returns its result; a panic if it has not finished within
/// [`HANG`] (a deadlock fails the test instead of hanging the test binary) or if it panicked.
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(HANG) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {HANG:?}: a deadlock")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what} panicked"),
    }
}

/// Int keys spelled any way but the canonical one (`05`, `+5`, ` 5`, `-0`), alone or beside the
/// canonical spelling, are invalid files: a typed error that changes nothing, never a hang (one
/// key locked twice) nor a `DuplicateInit`. Random spellings of random keys, replacing or
/// duplicating `order/` and `step/` entries.
fn int_key_spellings_must_be_canonical(h: Home) {
    let dir = temp_dir(h, "spellings");
    let path = dir.join("s.safetensors");
    let mut rng = StdRng::seed_from_u64(11);
    let keys = [0, 5, 12, -4, 700];
    let kv = h.store();
    kv.set_updater(sgd()).unwrap();
    for k in keys {
        kv.init(k, &h.put(&random(&mut rng, &[3], DType::F32), 0))
            .unwrap();
    }
    let grads: Vec<NDArray> = keys
        .iter()
        .map(|_| h.put(&random(&mut rng, &[3], DType::F32), 0))
        .collect();
    kv.push_list(&keys, &grads).unwrap();
    kv.save_single_file(&path).unwrap();
    let (tensors, meta) = parts(&std::fs::read(&path).unwrap());

    // Targets: one holding every key (a duplicate would lock a cell twice), one holding none
    // (a duplicate would be a DuplicateInit).
    let full = Arc::new(h.store());
    full.set_updater(sgd()).unwrap();
    for k in keys {
        full.init(k, &h.put(&random(&mut rng, &[3], DType::F32), 0))
            .unwrap();
    }
    let empty = Arc::new(h.store());
    empty.set_updater(sgd()).unwrap();
    let before = snapshot(&full);

    let spellings = |k: i32, rng: &mut StdRng| -> String {
        let forms = [
            format!("0{k}"),
            format!("00{k}"),
            format!("+{k}"),
            format!(" {k}"),
            format!("{k} "),
            format!("{k}\n"),
            match k {
                0 => "-0".to_owned(),
                k if k < 0 => format!("-0{}", -k),
                k => format!("+0{k}"),
            },
        ];
        forms.choose(rng).unwrap().clone()
    };
    const CASES: usize = 60;
    for case in 0..CASES {
        let (t, mut m) = (tensors.clone(), meta.clone());
        let k = *keys.choose(&mut rng).unwrap();
        let other = spellings(k, &mut rng);
        let place = m[&format!("order/{k}")].clone();
        match case % 3 {
            // The key under another spelling only (its tensors still under the canonical
            // one).
            0 => {
                m.remove(&format!("order/{k}"));
                m.insert(format!("order/{other}"), place);
            }
            // Both spellings, at two places.
            1 => {
                m.insert(format!("order/{other}"), keys.len().to_string());
                m.insert("keys".into(), (keys.len() + 1).to_string());
            }
            // A step count under another spelling.
            _ => {
                let step = m[&format!("step/{k}")].clone();
                m.insert(format!("step/{other}"), step);
            }
        }
        std::fs::write(&path, rebuild(&t, m)).unwrap();
        for target in [&full, &empty] {
            let (target, path) = (target.clone(), path.clone());
            let result = bounded(&format!("load of case {case} (key '{other}')"), move || {
                target.load(&path)
            });
            assert_checkpoint_kind(result, CheckpointErrorKind::Invalid, "");
        }
        assert_eq!(snapshot(&full), before, "case {case} changed the store");
        assert!(empty.keys().is_empty(), "case {case} added keys");
    }
    // The file as saved still loads.
    std::fs::write(&path, rebuild(&tensors, meta)).unwrap();
    full.load(&path).unwrap();
    assert_eq!(snapshot(&full), snapshot(&kv));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The updaters a checkpoint may be saved and loaded under, one of each kind.
fn every_updater() -> Vec<Updater> {
    vec![
        Updater::Assign,
        Updater::Axpby { a: 0.75, b: -0.5 },
        Updater::Sgd(Sgd {
            lr: 0.1,
            wd: 0.02,
            ..Sgd::default()
        }),
        sgd(),
        adam(),
        Updater::custom(|_key, input, stored| *stored += input * 0.25),
    ]
}

/// Every pair of updaters: a checkpoint saved under one loads into a store with the other
/// (resuming training, the main use of a checkpoint). Values always load. State loads when the
/// updaters match (then pushes continue exactly as in the saved store); otherwise every key
/// starts afresh, step count included, exactly as after `set_updater`.
fn load_across_every_pair_of_updaters(h: Home) {
    let dir = temp_dir(h, "pairs");
    let path = dir.join("p.safetensors");
    let mut rng = StdRng::seed_from_u64(12);
    let updaters = every_updater();
    for (i, from) in updaters.iter().enumerate() {
        for (j, to) in updaters.iter().enumerate() {
            let what = format!(
                "saved under {}#{i}, loaded under {}#{j}",
                from.name(),
                to.name()
            );
            let (kv, keys) = filled_store(h, h.kind(), from, &mut rng);
            for _ in 0..2 {
                push_round(&[&kv], &keys, &mut rng);
            }
            kv.save(&path).unwrap();

            let restored = h.store();
            restored.set_updater(to.clone()).unwrap();
            restored
                .load(&path)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_homes(h, &restored);
            assert_eq!(snapshot(&restored), snapshot(&kv), "{what}");
            // The reference: the saved store itself, going on under `to`; a different
            // updater starts its state afresh there too.
            if i != j {
                kv.set_updater(to.clone()).unwrap();
            }
            for round in 0..3 {
                push_round(&[&kv, &restored], &keys, &mut rng);
                assert_eq!(snapshot(&restored), snapshot(&kv), "{what}, round {round}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `set_updater` that lands inside a `load` (after the file is checked against the old
/// updater) leaves no key with state of the wrong shape: every key starts the new updater
/// afresh, exactly as a store that set it after the load, and its pushes change it. Both ways:
/// SGD state meeting Adam (too few buffers), and Adam state meeting SGD (too many).
fn load_racing_set_updater_starts_state_afresh(h: Home) {
    let dir = temp_dir(h, "racing-updater");
    let path = dir.join("r.safetensors");
    let mut rng = StdRng::seed_from_u64(13);
    for (saved, raced) in [(sgd(), adam()), (adam(), sgd())] {
        let what = format!(
            "{} state, {} set during the load",
            saved.name(),
            raced.name()
        );
        let (kv, keys) = filled_store(h, h.kind(), &saved, &mut rng);
        push_round(&[&kv], &keys, &mut rng);
        kv.save(&path).unwrap();

        let restored = Arc::new(h.store());
        restored.set_updater(saved.clone()).unwrap();
        let (target, mut next) = (restored.clone(), Some(raced.clone()));
        set_load_hook(Some(Box::new(move |stage| {
            if stage == LoadStage::Checked {
                if let Some(u) = next.take() {
                    target.set_updater(u).unwrap();
                }
            }
        })));
        let result = restored.load(&path);
        set_load_hook(None);
        result.unwrap();
        assert_eq!(snapshot(&restored), snapshot(&kv), "{what}");

        kv.set_updater(raced.clone()).unwrap();
        for round in 0..3 {
            let before = snapshot(&restored);
            push_round(&[&kv, &*restored], &keys, &mut rng);
            assert_ne!(
                snapshot(&restored),
                before,
                "{what}: a push changed nothing"
            );
            assert_eq!(snapshot(&restored), snapshot(&kv), "{what}, round {round}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A load is one step: a push that lands once the loaded keys are visible is never undone by
/// the load, and a pull of old and new keys together sees all of them loaded or none. Racing
/// threads, many times, each join bounded (a deadlock fails, it does not hang); plus the same
/// push made deterministically the moment the load says its keys are in.
fn load_is_all_or_nothing_against_pushes_and_pulls(h: Home) {
    let dir = temp_dir(h, "atomic");
    let path = Arc::new(dir.join("a.safetensors"));
    let mut rng = StdRng::seed_from_u64(14);
    // The file: keys 0..8 with SGD momentum state. Targets hold keys 0..4 already (with other
    // values), and lack 4..8.
    let keys: Vec<i32> = (0..8).collect();
    let kv = h.store();
    kv.set_updater(sgd()).unwrap();
    let vals: Vec<NDArray> = keys
        .iter()
        .map(|_| h.put(&random(&mut rng, &[64], DType::F32), 0))
        .collect();
    kv.init_list(&keys, &vals).unwrap();
    push_round(&[&kv], &keys, &mut rng);
    kv.save(&*path).unwrap();
    let loaded = snapshot(&kv);
    let grad = random(&mut rng, &[64], DType::F32);
    // The value of key 7 after the load and one push of `grad`.
    kv.push(7, &h.put(&grad, 0)).unwrap();
    let pushed: Vec<f64> = snapshot(&kv)[7].2.clone();
    assert_ne!(pushed, loaded[7].2);

    let fresh_target = |rng: &mut StdRng| {
        let t = Arc::new(h.store());
        t.set_updater(sgd()).unwrap();
        let old: Vec<NDArray> = (0..4)
            .map(|_| h.put(&random(rng, &[64], DType::F32), 0))
            .collect();
        t.init_list(&keys[..4], &old).unwrap();
        t
    };

    // Deterministic: the push the moment the load's keys are in.
    let target = fresh_target(&mut rng);
    let (t, g) = (target.clone(), h.put(&grad, 0));
    set_load_hook(Some(Box::new(move |stage| {
        if stage == LoadStage::Applied {
            t.push(7, &g).unwrap();
        }
    })));
    let result = target.load(&*path);
    set_load_hook(None);
    result.unwrap();
    assert_eq!(
        snapshot(&target)[7].2,
        pushed,
        "the push after the load was lost"
    );

    // Racing: a pusher that pushes key 7 as soon as it exists, and a puller of keys 3 and 7
    // (one the target had, one the load adds), against the load.
    const ROUNDS: usize = 100;
    let mut lost = 0;
    let mut torn = 0;
    for _ in 0..ROUNDS {
        let target = fresh_target(&mut rng);
        let (path, g) = (path.clone(), h.put(&grad, 0));
        let (want3, want7) = (loaded[3].2.clone(), loaded[7].2.clone());
        let pushed7 = pushed.clone();
        let (value7, tears) = bounded("a load racing a push and a pull", move || {
            std::thread::scope(|s| {
                let pusher = s.spawn(|| loop {
                    match target.push(7, &g) {
                        Ok(()) => return,
                        Err(Error::UnknownKey { .. }) => std::hint::spin_loop(),
                        Err(e) => panic!("push: {e}"),
                    }
                });
                let puller = s.spawn(|| {
                    let (a, b) = (NDArray::zeros([64]), NDArray::zeros([64]));
                    loop {
                        match target.pull_list(&[3, 7], &[&a, &b]) {
                            Ok(()) => {
                                let x = a.to_vec::<f64>().unwrap();
                                let y = b.to_vec::<f64>().unwrap();
                                // Key 7 is in: key 3 must be the file's too, and key 7 the
                                // file's or pushed since.
                                return usize::from(x != want3 || (y != want7 && y != pushed7));
                            }
                            Err(Error::UnknownKey { .. }) => std::hint::spin_loop(),
                            Err(e) => panic!("pull: {e}"),
                        }
                    }
                });
                target.load(&*path).unwrap();
                pusher.join().unwrap();
                let tears = puller.join().unwrap();
                (snapshot(&target)[7].2.clone(), tears)
            })
        });
        lost += usize::from(value7 != pushed);
        torn += tears;
    }
    assert_eq!(lost, 0, "{lost} of {ROUNDS} pushes racing a load were lost");
    assert_eq!(torn, 0, "{torn} of {ROUNDS} pulls saw a load half done");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Loads (into keys the store has and keys it lacks) against concurrent pushes, pulls, inits
/// of the same and other keys, set_updater and saves: no deadlock (bounded), and every call
/// succeeds or fails with its documented error.
fn load_never_deadlocks_with_concurrent_calls(h: Home) {
    let dir = temp_dir(h, "no-deadlock");
    let path = Arc::new(dir.join("d.safetensors"));
    let save_path = Arc::new(dir.join("other.safetensors"));
    let mut rng = StdRng::seed_from_u64(15);
    let keys: Vec<i32> = (0..12).collect();
    let kv = h.store();
    kv.set_updater(adam()).unwrap();
    let vals: Vec<NDArray> = keys
        .iter()
        .map(|_| h.put(&random(&mut rng, &[32], DType::F32), 0))
        .collect();
    kv.init_list(&keys, &vals).unwrap();
    push_round(&[&kv], &keys, &mut rng);
    kv.save(&*path).unwrap();
    let grad = h.put(&random(&mut rng, &[32], DType::F32), 0);

    bounded("loads racing every other call", move || {
        for round in 0..20 {
            let target = h.store();
            target.set_updater(adam()).unwrap();
            target.init_list(&keys[..6], &vals[..6]).unwrap();
            std::thread::scope(|s| {
                s.spawn(|| {
                    for _ in 0..3 {
                        target.load(&*path).unwrap();
                    }
                });
                s.spawn(|| {
                    for i in 0..50 {
                        let ks = [keys[11 - i % 12], keys[i % 6]];
                        match target.push_list(&ks, &[&grad, &grad]) {
                            Ok(()) | Err(Error::UnknownKey { .. }) => {}
                            Err(e) => panic!("push: {e}"),
                        }
                    }
                });
                s.spawn(|| {
                    let outs = [NDArray::zeros([32]), NDArray::zeros([32])];
                    for i in 0..50 {
                        match target.pull_list(&[keys[i % 12], keys[5]], &[&outs[0], &outs[1]]) {
                            Ok(()) | Err(Error::UnknownKey { .. }) => {}
                            Err(e) => panic!("pull: {e}"),
                        }
                    }
                });
                s.spawn(|| {
                    // Keys of the file (racing the load to add them) and others.
                    for k in [6, 100 + round, 9, 200 + round, 11] {
                        match target.init(k, &vals[0]) {
                            Ok(()) | Err(Error::DuplicateInit { .. }) => {}
                            Err(e) => panic!("init: {e}"),
                        }
                    }
                });
                s.spawn(|| {
                    for i in 0..10 {
                        let u = if i % 2 == 0 { sgd() } else { adam() };
                        target.set_updater(u).unwrap();
                        target.save(&*save_path).unwrap();
                    }
                });
            });
            // Every key of the file is in, with the file's shape.
            for &k in &keys {
                assert_eq!(target.meta(k).unwrap().0.dims(), &[32]);
            }
        }
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The kinds of checkpoint failure are told apart, with the underlying error as the source: a
/// missing file, a failed read or write, a corrupt file, a file that does not fit the store.
fn failures_are_told_apart_by_kind(h: Home) {
    let dir = temp_dir(h, "kinds");
    let path = dir.join("k.safetensors");
    let mut rng = StdRng::seed_from_u64(16);
    let (kv, _) = filled_store(h, h.kind(), &sgd(), &mut rng);
    kv.save(&path).unwrap();
    let target = h.store();

    let source_of = |e: &Error| std::error::Error::source(e).map(|s| s.to_string());
    let e = target.load(dir.join("nothing-here")).unwrap_err();
    let io = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .unwrap_or_else(|| panic!("no io::Error under {e:?}"));
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    assert_checkpoint_kind(Err(e), CheckpointErrorKind::NotFound, "check the path");
    // A directory is read as a sharded checkpoint: without an index it holds none.
    assert_checkpoint_kind(
        target.load(&dir),
        CheckpointErrorKind::NotFound,
        "no committed checkpoint",
    );
    assert_checkpoint_kind(
        kv.save(dir.join("no-such-dir").join("x.safetensors")),
        CheckpointErrorKind::NotFound,
        "does not exist",
    );
    kvstore::checkpoint::fail_writes_after(Some(10));
    let result = kv.save(&path);
    kvstore::checkpoint::fail_writes_after(None);
    assert_checkpoint_kind(result, CheckpointErrorKind::Io, "injected write failure");

    let nonsense = dir.join("nonsense.safetensors");
    std::fs::write(
        &nonsense,
        b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": nonsense}",
    )
    .unwrap();
    let e = target.load(&nonsense).unwrap_err();
    assert!(
        std::error::Error::source(&e)
            .is_some_and(|s| s.downcast_ref::<safetensors::SafeTensorError>().is_some()),
        "no safetensors error under {e:?}"
    );
    assert_checkpoint_kind(Err(e), CheckpointErrorKind::Invalid, "corrupt");

    kv.save(&path).unwrap();
    let other = h.store();
    other
        .init(-7, &h.put(&random(&mut rng, &[2], DType::F32), 0))
        .unwrap();
    let e = other.load(&path).unwrap_err();
    assert_eq!(source_of(&e), None);
    assert_checkpoint_kind(Err(e), CheckpointErrorKind::Mismatch, "key -7");
    assert!(target.keys().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

on_every_home!(
    round_trip_sgd_momentum_all_dtypes,
    round_trip_adam_all_dtypes,
    lost_state_would_be_noticed,
    string_keys_keep_names_and_order,
    cross_kind_load_initializes_missing_keys,
    mismatches_are_errors_and_change_nothing,
    failed_save_keeps_the_previous_checkpoint,
    killed_saver_leaves_a_loadable_checkpoint,
    wrong_metadata_and_tensors_are_typed_errors,
    truncated_and_corrupt_files_never_panic,
    a_flipped_bit_is_a_typed_error_and_changes_nothing,
    checksum_entries_are_checked,
    int_key_spellings_must_be_canonical,
    load_across_every_pair_of_updaters,
    load_racing_set_updater_starts_state_afresh,
    load_is_all_or_nothing_against_pushes_and_pulls,
    load_never_deadlocks_with_concurrent_calls,
    failures_are_told_apart_by_kind,
);

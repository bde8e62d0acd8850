//! `KvStore::save` / `KvStore::load`: round trips of values and updater state, atomic saves,
//! loads into other store kinds, and typed errors (never panics) for bad files.
//!
//! Every test runs on both homes: `cpu::*` with `local` stores and arrays on cpu(i); `gpu::*`
//! (ignored: needs a GPU) with `device` stores and arrays on the GPUs. Loads across kinds go
//! between a `local` store and every kind of the home, both ways.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::Home;
use kvstore::{Adam, DType, Error, Key, KvStore, NDArray, Sgd, Updater};
use rand::prelude::*;
use safetensors::tensor::{SafeTensors, TensorView};

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

    // Further pushes give exactly what the uninterrupted store gives: momentum, Adam's moments
    // and step counts came back too.
    for _ in 0..3 {
        push_round(&[&kv, &restored], &keys, &mut rng);
    }
    assert_eq!(snapshot(&restored), snapshot(&kv));

    // A store with another updater refuses the state.
    let fresh = h.store();
    fresh.set_updater(Updater::Assign).unwrap();
    assert_checkpoint_error(fresh.load(&path), "set the same updater");
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

fn assert_checkpoint_error(result: kvstore::Result<()>, needle: &str) {
    match result {
        Err(Error::Checkpoint { message, .. }) => {
            assert!(message.contains(needle), "'{message}' lacks '{needle}'")
        }
        other => panic!("expected a checkpoint error about '{needle}', got {other:?}"),
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
        (
            store_with(h, 2, &[2, 3], DType::F16, adam()),
            "set the same updater",
        ),
        (
            store_with(h, 2, &[2, 3], DType::F16, Updater::Assign),
            "set the same updater",
        ),
    ];
    for (target, needle) in cases {
        let before = snapshot(&target);
        assert_checkpoint_error(target.load(&path), needle);
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
    assert_checkpoint_error(strings.load(&path), "int keys");
    assert_eq!(strings.keys(), vec![Key::from("w")]);
    assert_checkpoint_error(strings.load(dir.join("missing.safetensors")), "read failed");
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

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect()
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
    let len = std::fs::metadata(&path).unwrap().len();

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
        while !path.exists() {
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
        std::fs::remove_file(&path).unwrap();
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

fn rebuild(tensors: &[Tensor], meta: HashMap<String, String>) -> Vec<u8> {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, Some(meta)).unwrap()
}

/// Well-formed safetensors files with wrong contents: typed errors naming the problem.
fn wrong_metadata_and_tensors_are_typed_errors(h: Home) {
    let dir = temp_dir(h, "wrong");
    let path = dir.join("w.safetensors");
    let mut rng = StdRng::seed_from_u64(9);
    let (kv, keys) = filled_store(h, h.kind(), &adam(), &mut rng);
    push_round(&[&kv], &keys, &mut rng);
    kv.save(&path).unwrap();
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
                m.insert("updater".into(), "sgd".into());
            }),
            "same updater",
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
        assert_checkpoint_error(target.load(&path), needle);
        assert!(target.keys().is_empty(), "case {i} changed the store");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Truncated files and random byte flips: a typed error or a successful load, never a panic,
/// and a failed load changes nothing.
fn truncated_and_corrupt_files_never_panic(h: Home) {
    let dir = temp_dir(h, "fuzz");
    let path = dir.join("f.safetensors");
    let mut rng = StdRng::seed_from_u64(10);
    let (kv, keys) = filled_store(h, h.kind(), &sgd(), &mut rng);
    push_round(&[&kv], &keys, &mut rng);
    kv.save(&path).unwrap();
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
    assert!(
        failed > FLIPS / 10,
        "only {failed} of {FLIPS} corrupt files were rejected"
    );
    assert_eq!(loaded + failed, FLIPS);
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
);

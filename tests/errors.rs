//! One test per error case of a local/device store (mxnet.md §4), plus the places where we
//! deliberately do better than MXNet.
//!
//! Every error test checks three things: the typed variant, that the message names what went
//! wrong (key, shapes, ...), and that the store is exactly as before: same keys, same homes,
//! same values (random, pulled to the host through the store before and after), and the
//! updater still in force.
//!
//! Each store test runs on both homes: `cpu::*` with a `local` store and arrays on cpu(i);
//! `gpu::*` (ignored: needs a GPU) with a `device` store and arrays on the GPUs (all on one
//! GPU on a one-GPU machine). Tests that were written for the `device` kind run on every kind
//! of the home.

mod common;

use common::Home;
use kvstore::__internal::probe::describe_gpus;
use kvstore::gpu_count;
use kvstore::{cpu, gpu, DType, Device, Error, Key, KvStore, NDArray, Sgd, Shape, Updater};
use rand::{thread_rng, Rng};

const SHAPE: [usize; 2] = [2, 3];

/// A random f32 array of `shape` on cpu(0) with no zero element.
fn rand_host(shape: impl Into<Shape>) -> NDArray {
    let shape = shape.into();
    let mut rng = thread_rng();
    let data: Vec<f32> = (0..shape.size())
        .map(|_| rng.gen_range(0.5f32..2.0) * if rng.gen() { 1.0 } else { -1.0 })
        .collect();
    NDArray::from_vec(data, shape).unwrap()
}

/// A random f32 array of `shape` with no zero element, on the home's `i`-th device.
fn rand_on(h: Home, shape: impl Into<Shape>, i: usize) -> NDArray {
    h.put(&rand_host(shape), i)
}

/// A random f32 array of `shape` with no zero element, on the home's first device.
fn rand_arr(h: Home, shape: impl Into<Shape>) -> NDArray {
    rand_on(h, shape, 0)
}

/// A random array of `shape` and `dtype` with no zero element, on the home's first device.
fn rand_typed(h: Home, shape: impl Into<Shape>, dtype: DType) -> NDArray {
    h.put(&rand_host(shape).astype(dtype).unwrap(), 0)
}

/// Checks that every key of `kv` lives on `h`.
fn assert_homes(h: Home, kv: &KvStore) {
    for k in kv.keys() {
        let home = kv.meta(&k).unwrap().2;
        assert!(h.is_home(home), "key {k} is homed on {home}, not on {h:?}");
    }
}

/// A store of `kind` with int keys 3, 5, 7 holding random values; 7 is float64 and (3, 2).
fn int_store_of(h: Home, kind: &str) -> KvStore {
    let kv = h.store_of(kind);
    kv.init(3, &rand_arr(h, SHAPE)).unwrap();
    kv.init(5, &rand_arr(h, SHAPE)).unwrap();
    kv.init(7, &rand_typed(h, [3, 2], DType::F64)).unwrap();
    assert_homes(h, &kv);
    kv
}

/// [`int_store_of`] the home's store kind.
fn int_store(h: Home) -> KvStore {
    int_store_of(h, h.kind())
}

/// A store of the home with string keys "a", "b" holding random values.
fn str_store(h: Home) -> KvStore {
    let kv = h.store();
    kv.init("a", &rand_arr(h, SHAPE)).unwrap();
    kv.init("b", &rand_arr(h, SHAPE)).unwrap();
    assert_homes(h, &kv);
    kv
}

/// Everything observable about a store: its keys, each key's meta and value, and the updater.
#[derive(Debug, PartialEq)]
struct Snapshot {
    keys: Vec<Key>,
    values: Vec<(Shape, DType, Device, Vec<f64>)>,
    updater: String,
}

/// Reads a store back through its own API: each value is pulled into a host array of the
/// key's dtype (f64 holds every element of every dtype exactly).
fn snapshot(kv: &KvStore) -> Snapshot {
    let keys = kv.keys();
    let values = keys
        .iter()
        .map(|k| {
            let (shape, dtype, home) = kv.meta(k).unwrap();
            let out = NDArray::full_on(shape, 12345.0, dtype, cpu(0)).unwrap();
            kv.pull(k, &out).unwrap();
            (shape, dtype, home, out.to_vec::<f64>().unwrap())
        })
        .collect();
    Snapshot {
        keys,
        values,
        updater: format!("{:?}", kv.updater()),
    }
}

/// Runs `op`, which must fail; checks the store did not change and returns the error.
fn fails(kv: &KvStore, op: impl FnOnce(&KvStore) -> kvstore::Result<()>) -> Error {
    let before = snapshot(kv);
    let err = op(kv).expect_err("the operation should fail");
    assert_eq!(
        snapshot(kv),
        before,
        "the failed call changed the store: {err}"
    );
    err
}

fn assert_mentions(e: &Error, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} should mention {p:?}");
    }
}

fn values(a: &NDArray) -> Vec<f64> {
    a.to_vec().unwrap()
}

// ---- unknown keys ----

fn push_unknown_int_key(h: Home) {
    let kv = int_store(h);
    let e = fails(&kv, |kv| kv.push(9, &rand_arr(h, SHAPE)));
    assert!(
        matches!(
            &e,
            Error::UnknownKey {
                op: "push",
                key: Key::Int(9)
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key 9", "init"]);
}

fn push_unknown_int_key_with_updater(h: Home) {
    for kind in h.kinds() {
        let kv = int_store_of(h, kind);
        kv.set_updater(Updater::custom(|_, x, w| *w += x)).unwrap();
        let e = fails(&kv, |kv| kv.push(9, &rand_arr(h, SHAPE)));
        assert!(
            matches!(
                &e,
                Error::UnknownKey {
                    op: "push",
                    key: Key::Int(9)
                }
            ),
            "{kind}: {e:?}"
        );
        assert_mentions(&e, &["key 9"]);
    }
}

fn pull_unknown_int_key(h: Home) {
    let kv = int_store(h);
    let out = rand_arr(h, SHAPE);
    let before = values(&out);
    let e = fails(&kv, |kv| kv.pull(9, &out));
    assert!(
        matches!(
            &e,
            Error::UnknownKey {
                op: "pull",
                key: Key::Int(9)
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key 9"]);
    assert_eq!(
        values(&out),
        before,
        "the out of a failed pull is untouched"
    );
}

fn unknown_str_key(h: Home) {
    let kv = str_store(h);
    let e = fails(&kv, |kv| kv.push("x", &rand_arr(h, SHAPE)));
    assert!(
        matches!(&e, Error::UnknownKey { key: Key::Str(k), .. } if k == "x"),
        "{e:?}"
    );
    assert_mentions(&e, &["key x"]);
    let e = fails(&kv, |kv| kv.pull("x", &rand_arr(h, SHAPE)));
    assert!(matches!(&e, Error::UnknownKey { op: "pull", key: Key::Str(k) } if k == "x"));
    let e = fails(&kv, |kv| {
        kv.pushpull("x", &rand_arr(h, SHAPE), &rand_arr(h, SHAPE))
    });
    assert!(
        matches!(&e, Error::UnknownKey { op: "pushpull", .. }),
        "{e:?}"
    );
}

fn failed_ops_do_not_poison_a_key(h: Home) {
    let kv = int_store(h);
    fails(&kv, |kv| kv.push(9, &rand_arr(h, SHAPE)));
    fails(&kv, |kv| kv.pull(9, &rand_arr(h, SHAPE)));
    fails(&kv, |kv| {
        kv.push_list(&[3, 9], &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)])
    });
    let v = rand_arr(h, [4]);
    kv.init(9, &v).unwrap();
    assert!(h.is_home(kv.meta(9).unwrap().2));
    let out = rand_arr(h, [4]);
    kv.pull(9, &out).unwrap();
    assert_eq!(values(&out), values(&v));

    let kv = str_store(h);
    fails(&kv, |kv| kv.pull("z", &rand_arr(h, SHAPE)));
    kv.init("z", &v).unwrap();
    kv.pull("z", &out).unwrap();
    assert_eq!(values(&out), values(&v));
}

// ---- duplicate init ----

fn duplicate_init_across_calls(h: Home) {
    let kv = int_store(h);
    let e = fails(&kv, |kv| kv.init(3, &rand_arr(h, SHAPE)));
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(3) }),
        "{e:?}"
    );
    assert_mentions(&e, &["duplicate init of key 3"]);

    let kv = str_store(h);
    let e = fails(&kv, |kv| kv.init("a", &rand_arr(h, SHAPE)));
    assert!(matches!(&e, Error::DuplicateInit { key: Key::Str(k) } if k == "a"));
    assert_mentions(&e, &["duplicate init of key a"]);
}

fn duplicate_init_within_one_list(h: Home) {
    let kv = int_store(h);
    let e = fails(&kv, |kv| {
        kv.init_list(&[9, 9], &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)])
    });
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(9) }),
        "{e:?}"
    );
    assert_mentions(&e, &["key 9"]);
    // MXNet's `init([3, 3], ...)` on a fresh store: nothing is initialized.
    let fresh = h.store();
    let e = fails(&fresh, |kv| {
        kv.init_list(&[3, 3], &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)])
    });
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(3) }),
        "{e:?}"
    );
    assert_mentions(&e, &["duplicate init of key 3"]);
    assert!(fresh.keys().is_empty());
    // A new key beside an existing one: neither is initialized.
    let e = fails(&kv, |kv| {
        kv.init_list(&[8, 5], &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)])
    });
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(5) }),
        "{e:?}"
    );
}

fn broadcast_twice(h: Home) {
    for kind in h.kinds() {
        let kv = int_store_of(h, kind);
        let out = rand_arr(h, SHAPE);
        let v = rand_arr(h, SHAPE);
        kv.broadcast(9, &v, &out).unwrap();
        assert!(h.is_home(kv.meta(9).unwrap().2), "{kind}");
        assert_eq!(values(&out), values(&v), "{kind}");
        let out2 = rand_arr(h, SHAPE);
        let before = values(&out2);
        let e = fails(&kv, |kv| kv.broadcast(9, &rand_arr(h, SHAPE), &out2));
        assert!(
            matches!(&e, Error::DuplicateInit { key: Key::Int(9) }),
            "{kind}: {e:?}"
        );
        assert_mentions(&e, &["key 9", "broadcast"]);
        assert_eq!(
            values(&out2),
            before,
            "{kind}: a failed broadcast pulls nothing"
        );
    }
}

// ---- shape and dtype ----

fn push_wrong_shape_one_value(h: Home) {
    let kv = int_store(h);
    let e = fails(&kv, |kv| kv.push(3, &rand_arr(h, [4, 4])));
    match &e {
        Error::ShapeMismatch {
            op: "push",
            key: Key::Int(3),
            expected,
            got,
            ..
        } => {
            assert_eq!(**expected, Shape::from(SHAPE));
            assert_eq!(**got, Shape::from([4, 4]));
        }
        _ => panic!("{e:?}"),
    }
    assert_mentions(&e, &["key 3", "(2, 3)", "(4, 4)"]);
}

fn push_wrong_shape_one_value_with_updater(h: Home) {
    let kv = int_store(h);
    kv.set_updater(Updater::custom(|_, x, w| *w += x)).unwrap();
    let e = fails(&kv, |kv| kv.push(3, &rand_arr(h, [4, 4])));
    assert!(matches!(
        &e,
        Error::ShapeMismatch {
            op: "push",
            key: Key::Int(3),
            ..
        }
    ));
    assert_mentions(&e, &["key 3", "(2, 3)", "(4, 4)"]);
}

fn push_wrong_shape_several_values(h: Home) {
    let kv = int_store(h);
    let vals = [
        rand_on(h, SHAPE, 0),
        rand_on(h, [3, 2], 1),
        rand_on(h, SHAPE, 2),
    ];
    let e = fails(&kv, |kv| kv.push(3, &vals));
    assert!(
        matches!(&e, Error::ShapeMismatch { op: "push", key: Key::Int(3), what, .. } if what == "value 1"),
        "{e:?}"
    );
    assert_mentions(&e, &["key 3", "(2, 3)", "(3, 2)", "value 1"]);
}

fn push_wrong_dtype(h: Home) {
    let kv = int_store(h);
    let v = rand_typed(h, SHAPE, DType::F64);
    let e = fails(&kv, |kv| kv.push(3, &v));
    assert!(
        matches!(
            &e,
            Error::DTypeMismatch {
                op: "push",
                key: Key::Int(3),
                expected: DType::F32,
                got: DType::F64,
                ..
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key 3", "float32", "float64"]);
    // Two values, the second of another dtype.
    let vals = [
        rand_on(h, SHAPE, 0),
        h.put(&rand_host(SHAPE).astype(DType::F16).unwrap(), 1),
    ];
    let e = fails(&kv, |kv| kv.push(3, &vals));
    assert!(
        matches!(
            &e,
            Error::DTypeMismatch {
                got: DType::F16,
                ..
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["float16", "value 1"]);
}

fn pull_into_wrong_shape(h: Home) {
    let kv = int_store(h);
    let out = rand_arr(h, [4, 4]);
    let e = fails(&kv, |kv| kv.pull(3, &out));
    assert!(
        matches!(
            &e,
            Error::ShapeMismatch {
                op: "pull",
                key: Key::Int(3),
                ..
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key 3", "(2, 3)", "(4, 4)"]);
    // Several outs, one bad: none is written.
    let outs = [
        rand_on(h, SHAPE, 0),
        rand_on(h, SHAPE, 1),
        rand_on(h, [6], 2),
    ];
    let before: Vec<_> = outs.iter().map(values).collect();
    let e = fails(&kv, |kv| kv.pull(3, &outs));
    assert!(
        matches!(&e, Error::ShapeMismatch { what, .. } if what == "out 2"),
        "{e:?}"
    );
    assert_mentions(&e, &["(6,)"]);
    assert_eq!(outs.iter().map(values).collect::<Vec<_>>(), before);
}

fn pushpull_with_bad_out_pushes_nothing(h: Home) {
    let kv = int_store(h);
    let e = fails(&kv, |kv| {
        kv.pushpull(3, &rand_arr(h, SHAPE), &rand_arr(h, [3, 2]))
    });
    assert!(
        matches!(&e, Error::ShapeMismatch { op: "pushpull", .. }),
        "{e:?}"
    );
    assert_mentions(&e, &["key 3", "(3, 2)"]);
}

// ---- lengths ----

fn assert_length(e: &Error, op: &str, keys: usize, values: usize) {
    match e {
        Error::LengthMismatch {
            op: o,
            keys: k,
            values: v,
            ..
        } => {
            assert_eq!((*o, *k, *v), (op, keys, values), "{e}");
        }
        _ => panic!("expected LengthMismatch, got {e:?}"),
    }
    assert_mentions(e, &[&format!("{keys} keys"), &format!("{values} ")]);
}

fn length_mismatch(h: Home) {
    let kv = int_store(h);
    let a = rand_arr(h, SHAPE);
    let one = std::slice::from_ref(&a);
    let e = fails(&kv, |kv| kv.init_list(&[1, 2], one));
    assert_length(&e, "init", 2, 1);
    let e = fails(&kv, |kv| kv.push_list(&[3, 5], one));
    assert_length(&e, "push", 2, 1);
    let e = fails(&kv, |kv| kv.pull_list(&[3], &[a.clone(), a.clone()]));
    assert_length(&e, "pull", 1, 2);
    let e = fails(&kv, |kv| {
        kv.pushpull_list(&[3, 5], &[a.clone(), a.clone()], one)
    });
    assert_length(&e, "pushpull", 2, 1);
    let e = fails(&kv, |kv| {
        kv.pushpull_list(&[3, 5], one, &[a.clone(), a.clone()])
    });
    assert_length(&e, "pushpull", 2, 1);
    let e = fails(&kv, |kv| {
        kv.broadcast_list(&[1, 2], one, &[a.clone(), a.clone()])
    });
    assert_length(&e, "broadcast", 2, 1);
    let e = fails(&kv, |kv| {
        kv.broadcast_list(&[1, 2], &[a.clone(), a.clone()], one)
    });
    assert_length(&e, "broadcast", 2, 1);
}

// ---- key kinds ----

fn mixed_key_kinds_across_calls(h: Home) {
    let kv = int_store(h);
    let a = rand_arr(h, SHAPE);
    let e = fails(&kv, |kv| kv.init("w", &a));
    assert!(
        matches!(
            &e,
            Error::MixedKeyTypes {
                op: "init",
                got: kvstore::KeyKind::Str,
                store: kvstore::KeyKind::Int,
                ..
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key w", "string", "int", "cannot be mixed"]);
    let e = fails(&kv, |kv| kv.push("w", &a));
    assert!(
        matches!(&e, Error::MixedKeyTypes { op: "push", .. }),
        "{e:?}"
    );
    let e = fails(&kv, |kv| kv.pull("w", &a));
    assert!(
        matches!(&e, Error::MixedKeyTypes { op: "pull", .. }),
        "{e:?}"
    );

    let kv = str_store(h);
    let e = fails(&kv, |kv| kv.init(3, &a));
    assert!(
        matches!(
            &e,
            Error::MixedKeyTypes {
                key: Key::Int(3),
                store: kvstore::KeyKind::Str,
                ..
            }
        ),
        "{e:?}"
    );
    let e = fails(&kv, |kv| kv.push(3, &a));
    assert!(matches!(&e, Error::MixedKeyTypes { .. }), "{e:?}");
    let e = fails(&kv, |kv| kv.broadcast(3, &a, &a));
    assert!(matches!(&e, Error::MixedKeyTypes { .. }), "{e:?}");
}

fn mixed_key_kinds_within_one_call(h: Home) {
    let a = rand_arr(h, SHAPE);
    let keys = [Key::Int(1), Key::from("w")];
    // On a fresh store: nothing is initialized, and the store stays open to either kind.
    let kv = h.store();
    let e = fails(&kv, |kv| kv.init_list(&keys, &[a.clone(), a.clone()]));
    assert!(
        matches!(&e, Error::MixedKeyTypes { key: Key::Str(k), .. } if k == "w"),
        "{e:?}"
    );
    assert_mentions(&e, &["key w", "cannot be mixed"]);
    assert!(kv.keys().is_empty());
    kv.init("w", &a).unwrap();
    assert_homes(h, &kv);

    let kv = int_store(h);
    let e = fails(&kv, |kv| kv.init_list(&keys, &[a.clone(), a.clone()]));
    assert!(matches!(&e, Error::MixedKeyTypes { .. }), "{e:?}");
    let e = fails(&kv, |kv| {
        kv.push_list(&[Key::Int(3), Key::from("w")], &[a.clone(), a.clone()])
    });
    assert!(matches!(&e, Error::MixedKeyTypes { .. }), "{e:?}");
    let e = fails(&kv, |kv| {
        kv.pull_list(&[Key::Int(3), Key::from("w")], &[a.clone(), a.clone()])
    });
    assert!(matches!(&e, Error::MixedKeyTypes { .. }), "{e:?}");
}

// ---- kinds and devices ----

/// `dist_async` exists in MXNet and not here: the error says what to use instead.
#[test]
fn dist_async_is_unavailable_and_says_what_to_use() {
    for name in ["dist_async", "DIST_ASYNC", "dist_device_async"] {
        let e = KvStore::create(name).err().expect("not supported");
        assert!(
            matches!(&e, Error::KindUnavailable { kind, .. } if kind == name),
            "{e:?}"
        );
        assert_mentions(&e, &["not supported yet", "dist_"]);
    }
}

/// Without the `mpi` feature the dist kinds name the feature that brings them.
#[cfg(not(feature = "mpi"))]
#[test]
fn dist_kinds_need_the_mpi_feature() {
    for name in ["dist_sync", "dist", "dist_device_sync", "dist_sync_device"] {
        let e = KvStore::create(name)
            .err()
            .expect("no transport in this build");
        assert!(matches!(&e, Error::KindUnavailable { .. }), "{e:?}");
        assert_mentions(&e, &["--features mpi", "mpirun"]);
    }
}

/// Parsing a kind name involves no store and no home: a plain test.
#[test]
fn unknown_store_kind() {
    for name in ["dist_synk", "loca", ""] {
        let e = KvStore::create(name).err().expect("no such kind");
        assert!(
            matches!(&e, Error::UnknownKind { kind, .. } if kind == name),
            "{e:?}"
        );
        assert_mentions(
            &e,
            &[
                &format!("'{name}'"),
                "local",
                "local_update_cpu",
                "local_allreduce_cpu",
                "device",
                "local_allreduce_device",
                "nccl",
                "dist_sync",
                "dist_device_sync",
            ],
        );
    }
    // Names are case-insensitive, as in MXNet.
    assert_eq!(KvStore::create("Local").unwrap().type_name(), "local");
    assert!(matches!(
        "Dist_synk".parse::<kvstore::StoreKind>(),
        Err(Error::UnknownKind { kind, .. }) if kind == "Dist_synk"
    ));
    assert_eq!(
        "Dist_Sync_Device".parse::<kvstore::StoreKind>().unwrap(),
        kvstore::StoreKind::DistDeviceSync
    );
}

fn assert_device_not_found(e: &Error, missing: Device) {
    assert!(
        matches!(e, Error::DeviceNotFound { device, .. } if *device == missing),
        "{e:?}"
    );
    assert_mentions(
        e,
        &[&missing.to_string(), "does not exist", &describe_gpus()],
    );
    if gpu_count() == 0 {
        assert_mentions(e, &["no GPU"]);
    }
}

/// GPUs this machine lacks: gpu(99) on every machine, and the first ordinal past the last GPU
/// (gpu(0) on a machine without one). Arrays cannot be made or copied there, and a store
/// refuses them as homes, unchanged.
fn device_that_does_not_exist(h: Home) {
    for kind in h.kinds() {
        let kv = int_store_of(h, kind);
        for missing in [gpu(gpu_count()), gpu(gpu_count() + 7), gpu(99)] {
            let before = snapshot(&kv);
            let e = NDArray::full_on(SHAPE, 1.0, DType::F32, missing).unwrap_err();
            assert_device_not_found(&e, missing);
            let e = rand_arr(h, SHAPE).to_device(missing).unwrap_err();
            assert_device_not_found(&e, missing);
            assert_eq!(snapshot(&kv), before, "{kind}");

            let e = fails(&kv, |kv| kv.init_on(11, &rand_arr(h, SHAPE), missing));
            assert_device_not_found(&e, missing);
            let e = fails(&kv, |kv| {
                kv.init_list_on(
                    &[11, 12],
                    &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)],
                    &[h.dev(0), missing],
                )
            });
            assert_device_not_found(&e, missing);
        }
        // The keys are free for an init on a home that exists.
        let v = rand_arr(h, SHAPE);
        kv.init_on(11, &v, h.dev(0)).unwrap();
        assert_eq!(kv.meta(11).unwrap().2, h.dev(0), "{kind}");
        let out = rand_arr(h, SHAPE);
        kv.pull(11, &out).unwrap();
        assert_eq!(values(&out), values(&v), "{kind}");
    }
}

// ---- empty value lists ----

fn empty_value_list(h: Home) {
    let kv = int_store(h);
    let none: Vec<NDArray> = Vec::new();
    let e = fails(&kv, |kv| kv.push(3, &none));
    assert!(
        matches!(
            &e,
            Error::Empty {
                op: "push",
                key: Key::Int(3),
                what: "values"
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key 3", "no values"]);
    let e = fails(&kv, |kv| kv.pull(5, &none));
    assert!(
        matches!(
            &e,
            Error::Empty {
                op: "pull",
                key: Key::Int(5),
                what: "outs"
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key 5", "no outs"]);
    // In a list, the first key's values are fine: nothing is applied.
    let e = fails(&kv, |kv| {
        kv.push_list(&[3, 5], &[vec![rand_arr(h, SHAPE)], none.clone()])
    });
    assert!(
        matches!(
            &e,
            Error::Empty {
                key: Key::Int(5),
                ..
            }
        ),
        "{e:?}"
    );
}

// ---- updaters ----

fn custom_updater_panics(h: Home) {
    let kv = int_store(h);
    kv.set_updater(Updater::custom(|key, _, w| {
        *w *= 100.0;
        panic!("boom on {key}");
    }))
    .unwrap();
    let e = fails(&kv, |kv| kv.push(5, &rand_arr(h, SHAPE)));
    assert!(
        matches!(
            &e,
            Error::UpdaterPanicked {
                key: Key::Int(5),
                ..
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key 5", "boom on 5", "unchanged"]);
}

fn custom_updater_changes_shape_or_dtype(h: Home) {
    let kv = int_store(h);
    kv.set_updater(Updater::custom(|_, _, w| *w = NDArray::ones([7])))
        .unwrap();
    let e = fails(&kv, |kv| kv.push(3, &rand_arr(h, SHAPE)));
    assert!(
        matches!(&e, Error::ShapeMismatch { key: Key::Int(3), got, .. } if **got == Shape::from([7])),
        "{e:?}"
    );
    assert_mentions(&e, &["key 3", "(2, 3)", "(7,)"]);

    kv.set_updater(Updater::custom(|_, _, w| {
        *w = w.astype(DType::F64).unwrap()
    }))
    .unwrap();
    let e = fails(&kv, |kv| kv.push(3, &rand_arr(h, SHAPE)));
    assert!(
        matches!(
            &e,
            Error::DTypeMismatch {
                key: Key::Int(3),
                got: DType::F64,
                ..
            }
        ),
        "{e:?}"
    );
}

fn invalid_updater_params(h: Home) {
    let kv = int_store(h);
    kv.set_updater(Updater::Axpby { a: 1.0, b: 2.0 }).unwrap();
    let bad = [
        Updater::Sgd(Sgd {
            lr: -1.0,
            ..Sgd::default()
        }),
        Updater::Sgd(Sgd {
            lr: f64::NAN,
            ..Sgd::default()
        }),
        Updater::Sgd(Sgd {
            momentum: 1.0,
            ..Sgd::default()
        }),
        Updater::Sgd(Sgd {
            wd: -0.1,
            ..Sgd::default()
        }),
        Updater::Sgd(Sgd {
            clip_gradient: Some(-1.0),
            ..Sgd::default()
        }),
        Updater::Adam(kvstore::Adam {
            beta1: 1.0,
            ..Default::default()
        }),
        Updater::Adam(kvstore::Adam {
            beta2: -0.5,
            ..Default::default()
        }),
        Updater::Adam(kvstore::Adam {
            epsilon: 0.0,
            ..Default::default()
        }),
        Updater::Axpby {
            a: f64::INFINITY,
            b: 1.0,
        },
        Updater::Axpby {
            a: 1.0,
            b: f64::NAN,
        },
    ];
    for u in bad {
        let e = fails(&kv, |kv| kv.set_updater(u.clone()));
        assert!(matches!(&e, Error::InvalidUpdater(_)), "{u:?}: {e:?}");
        assert!(e.to_string().starts_with("invalid updater"), "{e}");
    }
    // The old updater is still the one that runs: stored = stored + 2 * input.
    let (w, x) = (rand_arr(h, SHAPE), rand_arr(h, SHAPE));
    kv.init(9, &w).unwrap();
    kv.push(9, &x).unwrap();
    let out = rand_arr(h, SHAPE);
    kv.pull(9, &out).unwrap();
    let want: Vec<f64> = values(&w)
        .iter()
        .zip(values(&x))
        .map(|(w, x)| f64::from((*w as f32) + 2.0 * (x as f32)))
        .collect();
    assert_eq!(values(&out), want);
}

// ---- list operations are all or nothing ----

fn list_push_with_unknown_key_applies_nothing(h: Home) {
    let kv = int_store(h);
    let e = fails(&kv, |kv| {
        kv.push_list(&[3, 99], &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)])
    });
    assert!(
        matches!(
            &e,
            Error::UnknownKey {
                key: Key::Int(99),
                ..
            }
        ),
        "{e:?}"
    );
    let kv = str_store(h);
    let e = fails(&kv, |kv| {
        kv.push_list(&["a", "zz"], &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)])
    });
    assert!(
        matches!(&e, Error::UnknownKey { key: Key::Str(k), .. } if k == "zz"),
        "{e:?}"
    );
}

fn list_push_with_bad_shape_on_second_key_applies_nothing(h: Home) {
    let kv = int_store(h);
    let e = fails(&kv, |kv| {
        kv.push_list(&[3, 5], &[rand_arr(h, SHAPE), rand_arr(h, [3, 3])])
    });
    assert!(
        matches!(
            &e,
            Error::ShapeMismatch {
                key: Key::Int(5),
                ..
            }
        ),
        "{e:?}"
    );
    // Listed in descending order, with a bad dtype: the same.
    let bad = rand_typed(h, SHAPE, DType::BF16);
    let e = fails(&kv, |kv| {
        kv.push_list(&[5, 3], &[bad.clone(), rand_arr(h, SHAPE)])
    });
    assert!(
        matches!(
            &e,
            Error::DTypeMismatch {
                key: Key::Int(5),
                ..
            }
        ),
        "{e:?}"
    );
}

fn list_push_with_panicking_updater_on_second_key_applies_nothing(h: Home) {
    let kv = int_store(h);
    kv.set_updater(Updater::custom(|key, x, w| {
        if *key == Key::Int(5) {
            panic!("no updates for key 5");
        }
        *w += x;
    }))
    .unwrap();
    let e = fails(&kv, |kv| {
        kv.push_list(&[3, 5], &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)])
    });
    assert!(
        matches!(
            &e,
            Error::UpdaterPanicked {
                key: Key::Int(5),
                ..
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["no updates for key 5"]);
    let e = fails(&kv, |kv| {
        let v = [rand_arr(h, SHAPE), rand_arr(h, SHAPE)];
        kv.pushpull_list(&[3, 5], &v, &v)
    });
    assert!(matches!(&e, Error::UpdaterPanicked { .. }), "{e:?}");
    // Key 3 alone still updates.
    kv.push(3, &rand_arr(h, SHAPE)).unwrap();
}

fn broadcast_list_with_one_bad_out_inits_nothing(h: Home) {
    let kv = int_store(h);
    let outs = [rand_on(h, SHAPE, 0), rand_on(h, [5], 1)];
    let before: Vec<_> = outs.iter().map(values).collect();
    let e = fails(&kv, |kv| {
        kv.broadcast_list(&[10, 11], &[rand_arr(h, SHAPE), rand_arr(h, SHAPE)], &outs)
    });
    assert!(
        matches!(
            &e,
            Error::ShapeMismatch {
                op: "broadcast",
                key: Key::Int(11),
                ..
            }
        ),
        "{e:?}"
    );
    assert_mentions(&e, &["key 11", "(5,)"]);
    assert_eq!(outs.iter().map(values).collect::<Vec<_>>(), before);
    // The keys are free for a correct broadcast afterwards.
    let outs = [rand_on(h, SHAPE, 0), rand_on(h, SHAPE, 1)];
    let vals = [rand_arr(h, SHAPE), rand_arr(h, SHAPE)];
    kv.broadcast_list(&[10, 11], &vals, &outs).unwrap();
    assert_eq!(values(&outs[1]), values(&vals[1]));
    assert_homes(h, &kv);
}

// ---- where we do better than MXNet ----

fn single_value_push_is_copied_not_aliased(h: Home) {
    let kv = int_store(h);
    let a = rand_arr(h, SHAPE);
    let pushed = values(&a);
    kv.push(3, &a).unwrap();
    a.fill(9.0).unwrap();
    let out = rand_arr(h, SHAPE);
    kv.pull(3, &out).unwrap();
    assert_eq!(values(&out), pushed);
    // init copies too.
    let b = rand_arr(h, SHAPE);
    let inited = values(&b);
    kv.init(4, &b).unwrap();
    b.fill(-9.0).unwrap();
    kv.pull(4, &out).unwrap();
    assert_eq!(values(&out), inited);
}

/// A random f32 array of `shape` whose elements are nonzero multiples of 1/8 in [-8, 8], on
/// the home's `i`-th device: sums of a few of them are exact in f32 in any order, so the
/// reference below need not know the order a home sums in (the values of a push spread over
/// several GPUs are summed per GPU first).
fn rand_eighths(h: Home, shape: impl Into<Shape>, i: usize) -> NDArray {
    let shape = shape.into();
    let mut rng = thread_rng();
    let data: Vec<f32> = (0..shape.size())
        .map(|_| rng.gen_range(1..=64) as f32 / 8.0 * if rng.gen() { 1.0 } else { -1.0 })
        .collect();
    h.put(&NDArray::from_vec(data, shape).unwrap(), i)
}

fn number_of_values_per_key_may_grow(h: Home) {
    let kv = int_store(h);
    for n in [2, 4, 1, 6] {
        let vals: Vec<NDArray> = (0..n).map(|d| rand_eighths(h, SHAPE, d)).collect();
        kv.push(3, &vals).unwrap();
        let mut want = vec![0f32; 6];
        for v in &vals {
            for (w, x) in want.iter_mut().zip(v.to_vec::<f32>().unwrap()) {
                *w += x;
            }
        }
        let out = rand_arr(h, SHAPE);
        kv.pull(3, &out).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), want, "{n} values");
    }
}

fn repeated_array_in_one_push_is_summed(h: Home) {
    let kv = int_store(h);
    let a = rand_arr(h, SHAPE);
    kv.push(3, &[a.clone(), a.clone(), a.clone(), a.clone()])
        .unwrap();
    let out = rand_arr(h, SHAPE);
    kv.pull(3, &out).unwrap();
    let want: Vec<f32> = a.to_vec::<f32>().unwrap().iter().map(|x| 4.0 * x).collect();
    assert_eq!(out.to_vec::<f32>().unwrap(), want);
    // Pushed and pulled in place, shared by two keys.
    kv.pushpull_list(
        &[3, 5],
        &[vec![a.clone(); 2], vec![a.clone(); 2]],
        &[vec![a.clone()], vec![a.clone()]],
    )
    .unwrap();
    let twice: Vec<f32> = want.iter().map(|x| x / 2.0).collect();
    assert_eq!(a.to_vec::<f32>().unwrap(), twice);
}

// ---- custom updaters and the arrays they touch ----

fn custom_updater_may_assign_an_array_it_keeps(h: Home) {
    let kv = int_store(h);
    let keep = rand_arr(h, SHAPE);
    let kept = values(&keep);
    let handle = keep.clone();
    kv.set_updater(Updater::custom(move |_, _, w| *w = handle.clone()))
        .unwrap();
    kv.push(3, &rand_arr(h, SHAPE)).unwrap();
    let out = rand_arr(h, SHAPE);
    kv.pull(3, &out).unwrap();
    assert_eq!(values(&out), kept);
    // The user's array is untouched, and is not the store's value.
    assert_eq!(keep.size(), 6);
    assert_eq!(values(&keep), kept);
    keep.fill(1.0).unwrap();
    kv.pull(3, &out).unwrap();
    assert_eq!(values(&out), kept);
    // It can still be pushed.
    kv.set_updater(Updater::Assign).unwrap();
    kv.push(3, &keep).unwrap();
    kv.pull(3, &out).unwrap();
    assert_eq!(values(&out), vec![1.0; 6]);
}

fn custom_updater_may_keep_a_handle_to_stored(h: Home) {
    use std::sync::{Arc, Mutex};
    let kv = int_store(h);
    let stash: Arc<Mutex<Option<NDArray>>> = Arc::default();
    let s = stash.clone();
    kv.set_updater(Updater::custom(move |_, x, w| {
        *w += x;
        *s.lock().unwrap() = Some(w.clone());
    }))
    .unwrap();
    let before = snapshot(&kv).values[0].3.clone();
    let x = rand_arr(h, SHAPE);
    kv.push(3, &x).unwrap();
    let kept = stash.lock().unwrap().take().unwrap();
    assert_eq!(kept.size(), 6);
    let want: Vec<f64> = before
        .iter()
        .zip(values(&x))
        .map(|(a, b)| f64::from(*a as f32 + b as f32))
        .collect();
    assert_eq!(values(&kept), want);
    // Writing through the handle does not reach the store.
    kept.fill(0.0).unwrap();
    let out = rand_arr(h, SHAPE);
    kv.pull(3, &out).unwrap();
    assert_eq!(values(&out), want);
    kv.set_updater(Updater::Assign).unwrap();
    kv.push(3, &kept).unwrap();
}

on_every_home!(
    push_unknown_int_key,
    push_unknown_int_key_with_updater,
    pull_unknown_int_key,
    unknown_str_key,
    failed_ops_do_not_poison_a_key,
    duplicate_init_across_calls,
    duplicate_init_within_one_list,
    broadcast_twice,
    push_wrong_shape_one_value,
    push_wrong_shape_one_value_with_updater,
    push_wrong_shape_several_values,
    push_wrong_dtype,
    pull_into_wrong_shape,
    pushpull_with_bad_out_pushes_nothing,
    length_mismatch,
    mixed_key_kinds_across_calls,
    mixed_key_kinds_within_one_call,
    device_that_does_not_exist,
    empty_value_list,
    custom_updater_panics,
    custom_updater_changes_shape_or_dtype,
    invalid_updater_params,
    list_push_with_unknown_key_applies_nothing,
    list_push_with_bad_shape_on_second_key_applies_nothing,
    list_push_with_panicking_updater_on_second_key_applies_nothing,
    broadcast_list_with_one_bad_out_inits_nothing,
    single_value_push_is_copied_not_aliased,
    number_of_values_per_key_may_grow,
    repeated_array_in_one_push_is_summed,
    custom_updater_may_assign_an_array_it_keeps,
    custom_updater_may_keep_a_handle_to_stored,
);

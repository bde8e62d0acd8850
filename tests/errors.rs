//! One test per error case of a local/device store (mxnet.md §4), plus the places where we
//! deliberately do better than MXNet.
//!
//! Every error test checks three things: the typed variant, that the message names what went
//! wrong (key, shapes, ...), and that the store is exactly as before: same keys, same values
//! (random, pulled before and after), and the updater still in force.

use kvstore::backend::probe::gpu_count;
use kvstore::{cpu, gpu, DType, Error, Key, KvStore, NDArray, Sgd, Shape, Updater};
use rand::{thread_rng, Rng};

const SHAPE: [usize; 2] = [2, 3];

/// A random f32 array of `shape` with no zero element.
fn rand_arr(shape: impl Into<Shape>) -> NDArray {
    let shape = shape.into();
    let mut rng = thread_rng();
    let data: Vec<f32> = (0..shape.size())
        .map(|_| rng.gen_range(0.5f32..2.0) * if rng.gen() { 1.0 } else { -1.0 })
        .collect();
    NDArray::from_vec(data, shape).unwrap()
}

/// A store of `kind` with int keys 3, 5, 7 holding random values; 7 is float64 and (3, 2).
fn int_store(kind: &str) -> KvStore {
    let kv = KvStore::create(kind).unwrap();
    kv.init(3, &rand_arr(SHAPE)).unwrap();
    kv.init(5, &rand_arr(SHAPE)).unwrap();
    kv.init(7, &rand_arr([3, 2]).astype(DType::F64).unwrap())
        .unwrap();
    kv
}

/// A `local` store with string keys "a", "b" holding random values.
fn str_store() -> KvStore {
    let kv = KvStore::create("local").unwrap();
    kv.init("a", &rand_arr(SHAPE)).unwrap();
    kv.init("b", &rand_arr(SHAPE)).unwrap();
    kv
}

/// Everything observable about a store: its keys, each key's meta and value, and the updater.
#[derive(Debug, PartialEq)]
struct Snapshot {
    keys: Vec<Key>,
    values: Vec<(Shape, DType, Vec<f64>)>,
    updater: String,
}

fn snapshot(kv: &KvStore) -> Snapshot {
    let keys = kv.keys();
    let values = keys
        .iter()
        .map(|k| {
            let (shape, dtype, _) = kv.meta(k).unwrap();
            let out = NDArray::full_on(shape, 12345.0, dtype, cpu(0)).unwrap();
            kv.pull(k, &out).unwrap();
            (shape, dtype, out.to_vec::<f64>().unwrap())
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

#[test]
fn push_unknown_int_key() {
    let kv = int_store("local");
    let e = fails(&kv, |kv| kv.push(9, &rand_arr(SHAPE)));
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

#[test]
fn push_unknown_int_key_with_updater() {
    let kv = int_store("device");
    kv.set_updater(Updater::custom(|_, x, w| *w += x)).unwrap();
    let e = fails(&kv, |kv| kv.push(9, &rand_arr(SHAPE)));
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
    assert_mentions(&e, &["key 9"]);
}

#[test]
fn pull_unknown_int_key() {
    let kv = int_store("local");
    let out = rand_arr(SHAPE);
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

#[test]
fn unknown_str_key() {
    let kv = str_store();
    let e = fails(&kv, |kv| kv.push("x", &rand_arr(SHAPE)));
    assert!(
        matches!(&e, Error::UnknownKey { key: Key::Str(k), .. } if k == "x"),
        "{e:?}"
    );
    assert_mentions(&e, &["key x"]);
    let e = fails(&kv, |kv| kv.pull("x", &rand_arr(SHAPE)));
    assert!(matches!(&e, Error::UnknownKey { op: "pull", key: Key::Str(k) } if k == "x"));
    let e = fails(&kv, |kv| {
        kv.pushpull("x", &rand_arr(SHAPE), &rand_arr(SHAPE))
    });
    assert!(
        matches!(&e, Error::UnknownKey { op: "pushpull", .. }),
        "{e:?}"
    );
}

#[test]
fn failed_ops_do_not_poison_a_key() {
    let kv = int_store("local");
    fails(&kv, |kv| kv.push(9, &rand_arr(SHAPE)));
    fails(&kv, |kv| kv.pull(9, &rand_arr(SHAPE)));
    fails(&kv, |kv| {
        kv.push_list(&[3, 9], &[rand_arr(SHAPE), rand_arr(SHAPE)])
    });
    let v = rand_arr([4]);
    kv.init(9, &v).unwrap();
    let out = rand_arr([4]);
    kv.pull(9, &out).unwrap();
    assert_eq!(values(&out), values(&v));

    let kv = str_store();
    fails(&kv, |kv| kv.pull("z", &rand_arr(SHAPE)));
    kv.init("z", &v).unwrap();
    kv.pull("z", &out).unwrap();
    assert_eq!(values(&out), values(&v));
}

// ---- duplicate init ----

#[test]
fn duplicate_init_across_calls() {
    let kv = int_store("local");
    let e = fails(&kv, |kv| kv.init(3, &rand_arr(SHAPE)));
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(3) }),
        "{e:?}"
    );
    assert_mentions(&e, &["duplicate init of key 3"]);

    let kv = str_store();
    let e = fails(&kv, |kv| kv.init("a", &rand_arr(SHAPE)));
    assert!(matches!(&e, Error::DuplicateInit { key: Key::Str(k) } if k == "a"));
    assert_mentions(&e, &["duplicate init of key a"]);
}

#[test]
fn duplicate_init_within_one_list() {
    let kv = int_store("local");
    let e = fails(&kv, |kv| {
        kv.init_list(&[9, 9], &[rand_arr(SHAPE), rand_arr(SHAPE)])
    });
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(9) }),
        "{e:?}"
    );
    assert_mentions(&e, &["key 9"]);
    // MXNet's `init([3, 3], ...)` on a fresh store: nothing is initialized.
    let fresh = KvStore::create("local").unwrap();
    let e = fails(&fresh, |kv| {
        kv.init_list(&[3, 3], &[rand_arr(SHAPE), rand_arr(SHAPE)])
    });
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(3) }),
        "{e:?}"
    );
    assert_mentions(&e, &["duplicate init of key 3"]);
    assert!(fresh.keys().is_empty());
    // A new key beside an existing one: neither is initialized.
    let e = fails(&kv, |kv| {
        kv.init_list(&[8, 5], &[rand_arr(SHAPE), rand_arr(SHAPE)])
    });
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(5) }),
        "{e:?}"
    );
}

#[test]
fn broadcast_twice() {
    let kv = int_store("device");
    let out = rand_arr(SHAPE);
    let v = rand_arr(SHAPE);
    kv.broadcast(9, &v, &out).unwrap();
    assert_eq!(values(&out), values(&v));
    let out2 = rand_arr(SHAPE);
    let before = values(&out2);
    let e = fails(&kv, |kv| kv.broadcast(9, &rand_arr(SHAPE), &out2));
    assert!(
        matches!(&e, Error::DuplicateInit { key: Key::Int(9) }),
        "{e:?}"
    );
    assert_mentions(&e, &["key 9", "broadcast"]);
    assert_eq!(values(&out2), before, "a failed broadcast pulls nothing");
}

// ---- shape and dtype ----

#[test]
fn push_wrong_shape_one_value() {
    let kv = int_store("local");
    let e = fails(&kv, |kv| kv.push(3, &rand_arr([4, 4])));
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

#[test]
fn push_wrong_shape_one_value_with_updater() {
    let kv = int_store("local");
    kv.set_updater(Updater::custom(|_, x, w| *w += x)).unwrap();
    let e = fails(&kv, |kv| kv.push(3, &rand_arr([4, 4])));
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

#[test]
fn push_wrong_shape_several_values() {
    let kv = int_store("local");
    let vals = [rand_arr(SHAPE), rand_arr([3, 2]), rand_arr(SHAPE)];
    let e = fails(&kv, |kv| kv.push(3, &vals));
    assert!(
        matches!(&e, Error::ShapeMismatch { op: "push", key: Key::Int(3), what, .. } if what == "value 1"),
        "{e:?}"
    );
    assert_mentions(&e, &["key 3", "(2, 3)", "(3, 2)", "value 1"]);
}

#[test]
fn push_wrong_dtype() {
    let kv = int_store("local");
    let v = rand_arr(SHAPE).astype(DType::F64).unwrap();
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
    let vals = [rand_arr(SHAPE), rand_arr(SHAPE).astype(DType::F16).unwrap()];
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

#[test]
fn pull_into_wrong_shape() {
    let kv = int_store("local");
    let out = rand_arr([4, 4]);
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
    let outs = [rand_arr(SHAPE), rand_arr(SHAPE), rand_arr([6])];
    let before: Vec<_> = outs.iter().map(values).collect();
    let e = fails(&kv, |kv| kv.pull(3, &outs));
    assert!(
        matches!(&e, Error::ShapeMismatch { what, .. } if what == "out 2"),
        "{e:?}"
    );
    assert_mentions(&e, &["(6,)"]);
    assert_eq!(outs.iter().map(values).collect::<Vec<_>>(), before);
}

#[test]
fn pushpull_with_bad_out_pushes_nothing() {
    let kv = int_store("local");
    let e = fails(&kv, |kv| {
        kv.pushpull(3, &rand_arr(SHAPE), &rand_arr([3, 2]))
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

#[test]
fn length_mismatch() {
    let kv = int_store("local");
    let a = rand_arr(SHAPE);
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

#[test]
fn mixed_key_kinds_across_calls() {
    let kv = int_store("local");
    let a = rand_arr(SHAPE);
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

    let kv = str_store();
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

#[test]
fn mixed_key_kinds_within_one_call() {
    let a = rand_arr(SHAPE);
    let keys = [Key::Int(1), Key::from("w")];
    // On a fresh store: nothing is initialized, and the store stays open to either kind.
    let kv = KvStore::create("local").unwrap();
    let e = fails(&kv, |kv| kv.init_list(&keys, &[a.clone(), a.clone()]));
    assert!(
        matches!(&e, Error::MixedKeyTypes { key: Key::Str(k), .. } if k == "w"),
        "{e:?}"
    );
    assert_mentions(&e, &["key w", "cannot be mixed"]);
    assert!(kv.keys().is_empty());
    kv.init("w", &a).unwrap();

    let kv = int_store("local");
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

#[test]
fn unknown_store_kind() {
    for name in ["dist_sync", "loca", ""] {
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
            ],
        );
    }
    // Names are case-insensitive, as in MXNet.
    assert_eq!(KvStore::create("Local").unwrap().kind(), "local");
}

#[test]
fn device_that_does_not_exist() {
    if gpu_count() != 0 {
        return; // this case is for machines without a GPU
    }
    let kv = int_store("device");
    let before = snapshot(&kv);
    let e = NDArray::full_on(SHAPE, 1.0, DType::F32, gpu(0)).unwrap_err();
    assert!(
        matches!(&e, Error::DeviceNotFound { device, .. } if *device == gpu(0)),
        "{e:?}"
    );
    assert_mentions(&e, &["gpu(0)", "no GPU"]);
    let e = rand_arr(SHAPE).to_device(gpu(7)).unwrap_err();
    assert!(
        matches!(&e, Error::DeviceNotFound { device, .. } if *device == gpu(7)),
        "{e:?}"
    );
    assert_mentions(&e, &["gpu(7)"]);
    assert_eq!(snapshot(&kv), before);
}

// ---- empty value lists ----

#[test]
fn empty_value_list() {
    let kv = int_store("local");
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
        kv.push_list(&[3, 5], &[vec![rand_arr(SHAPE)], none.clone()])
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

#[test]
fn custom_updater_panics() {
    let kv = int_store("local");
    kv.set_updater(Updater::custom(|key, _, w| {
        *w *= 100.0;
        panic!("boom on {key}");
    }))
    .unwrap();
    let e = fails(&kv, |kv| kv.push(5, &rand_arr(SHAPE)));
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

#[test]
fn custom_updater_changes_shape_or_dtype() {
    let kv = int_store("local");
    kv.set_updater(Updater::custom(|_, _, w| *w = NDArray::ones([7])))
        .unwrap();
    let e = fails(&kv, |kv| kv.push(3, &rand_arr(SHAPE)));
    assert!(
        matches!(&e, Error::ShapeMismatch { key: Key::Int(3), got, .. } if **got == Shape::from([7])),
        "{e:?}"
    );
    assert_mentions(&e, &["key 3", "(2, 3)", "(7,)"]);

    kv.set_updater(Updater::custom(|_, _, w| {
        *w = w.astype(DType::F64).unwrap()
    }))
    .unwrap();
    let e = fails(&kv, |kv| kv.push(3, &rand_arr(SHAPE)));
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

#[test]
fn invalid_updater_params() {
    let kv = int_store("local");
    kv.set_updater(Updater::Axpby { a: 1.0, b: 2.0 }).unwrap();
    let bad = [
        Updater::Sgd(Sgd {
            lr: -1.0,
            ..Sgd::default()
        }),
        Updater::Sgd(Sgd {
            lr: f32::NAN,
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
    let (w, x) = (rand_arr(SHAPE), rand_arr(SHAPE));
    kv.init(9, &w).unwrap();
    kv.push(9, &x).unwrap();
    let out = rand_arr(SHAPE);
    kv.pull(9, &out).unwrap();
    let want: Vec<f64> = values(&w)
        .iter()
        .zip(values(&x))
        .map(|(w, x)| f64::from((*w as f32) + 2.0 * (x as f32)))
        .collect();
    assert_eq!(values(&out), want);
}

// ---- list operations are all or nothing ----

#[test]
fn list_push_with_unknown_key_applies_nothing() {
    let kv = int_store("local");
    let e = fails(&kv, |kv| {
        kv.push_list(&[3, 99], &[rand_arr(SHAPE), rand_arr(SHAPE)])
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
    let kv = str_store();
    let e = fails(&kv, |kv| {
        kv.push_list(&["a", "zz"], &[rand_arr(SHAPE), rand_arr(SHAPE)])
    });
    assert!(
        matches!(&e, Error::UnknownKey { key: Key::Str(k), .. } if k == "zz"),
        "{e:?}"
    );
}

#[test]
fn list_push_with_bad_shape_on_second_key_applies_nothing() {
    let kv = int_store("local");
    let e = fails(&kv, |kv| {
        kv.push_list(&[3, 5], &[rand_arr(SHAPE), rand_arr([3, 3])])
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
    let bad = rand_arr(SHAPE).astype(DType::BF16).unwrap();
    let e = fails(&kv, |kv| {
        kv.push_list(&[5, 3], &[bad.clone(), rand_arr(SHAPE)])
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

#[test]
fn list_push_with_panicking_updater_on_second_key_applies_nothing() {
    let kv = int_store("local");
    kv.set_updater(Updater::custom(|key, x, w| {
        if *key == Key::Int(5) {
            panic!("no updates for key 5");
        }
        *w += x;
    }))
    .unwrap();
    let e = fails(&kv, |kv| {
        kv.push_list(&[3, 5], &[rand_arr(SHAPE), rand_arr(SHAPE)])
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
        let v = [rand_arr(SHAPE), rand_arr(SHAPE)];
        kv.pushpull_list(&[3, 5], &v, &v)
    });
    assert!(matches!(&e, Error::UpdaterPanicked { .. }), "{e:?}");
    // Key 3 alone still updates.
    kv.push(3, &rand_arr(SHAPE)).unwrap();
}

#[test]
fn broadcast_list_with_one_bad_out_inits_nothing() {
    let kv = int_store("local");
    let outs = [rand_arr(SHAPE), rand_arr([5])];
    let before: Vec<_> = outs.iter().map(values).collect();
    let e = fails(&kv, |kv| {
        kv.broadcast_list(&[10, 11], &[rand_arr(SHAPE), rand_arr(SHAPE)], &outs)
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
    let outs = [rand_arr(SHAPE), rand_arr(SHAPE)];
    let vals = [rand_arr(SHAPE), rand_arr(SHAPE)];
    kv.broadcast_list(&[10, 11], &vals, &outs).unwrap();
    assert_eq!(values(&outs[1]), values(&vals[1]));
}

// ---- where we do better than MXNet ----

#[test]
fn single_value_push_is_copied_not_aliased() {
    let kv = int_store("local");
    let a = rand_arr(SHAPE);
    let pushed = values(&a);
    kv.push(3, &a).unwrap();
    a.fill(9.0).unwrap();
    let out = rand_arr(SHAPE);
    kv.pull(3, &out).unwrap();
    assert_eq!(values(&out), pushed);
    // init copies too.
    let b = rand_arr(SHAPE);
    let inited = values(&b);
    kv.init(4, &b).unwrap();
    b.fill(-9.0).unwrap();
    kv.pull(4, &out).unwrap();
    assert_eq!(values(&out), inited);
}

#[test]
fn number_of_values_per_key_may_grow() {
    let kv = int_store("local");
    for n in [2, 4, 1, 6] {
        let vals: Vec<NDArray> = (0..n)
            .map(|d| rand_arr(SHAPE).to_device(cpu(d)).unwrap())
            .collect();
        kv.push(3, &vals).unwrap();
        let mut want = vec![0f32; 6];
        for v in &vals {
            for (w, x) in want.iter_mut().zip(v.to_vec::<f32>().unwrap()) {
                *w += x;
            }
        }
        let out = rand_arr(SHAPE);
        kv.pull(3, &out).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), want, "{n} values");
    }
}

#[test]
fn repeated_array_in_one_push_is_summed() {
    let kv = int_store("local");
    let a = rand_arr(SHAPE);
    kv.push(3, &[a.clone(), a.clone(), a.clone(), a.clone()])
        .unwrap();
    let out = rand_arr(SHAPE);
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

#[test]
fn custom_updater_may_assign_an_array_it_keeps() {
    let kv = int_store("local");
    let keep = rand_arr(SHAPE);
    let kept = values(&keep);
    let handle = keep.clone();
    kv.set_updater(Updater::custom(move |_, _, w| *w = handle.clone()))
        .unwrap();
    kv.push(3, &rand_arr(SHAPE)).unwrap();
    let out = rand_arr(SHAPE);
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

#[test]
fn custom_updater_may_keep_a_handle_to_stored() {
    use std::sync::{Arc, Mutex};
    let kv = int_store("local");
    let stash: Arc<Mutex<Option<NDArray>>> = Arc::default();
    let s = stash.clone();
    kv.set_updater(Updater::custom(move |_, x, w| {
        *w += x;
        *s.lock().unwrap() = Some(w.clone());
    }))
    .unwrap();
    let before = snapshot(&kv).values[0].2.clone();
    let x = rand_arr(SHAPE);
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
    let out = rand_arr(SHAPE);
    kv.pull(3, &out).unwrap();
    assert_eq!(values(&out), want);
    kv.set_updater(Updater::Assign).unwrap();
    kv.push(3, &kept).unwrap();
}

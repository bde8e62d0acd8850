//! The API a framework adapter needs: integer keys of any type, placed and tagged
//! constructors, `pushpull_list_in_place`, fallible closures, the push hook and key orders.
//!
//! Store tests run on both homes: `cpu::*` with a `local` store, `gpu::*` (ignored: needs a
//! GPU) with a `device` store. Inputs are fresh random numbers on every run; each assertion
//! names the seed that reproduces it.

mod common;

use std::sync::{Arc, Mutex};

use common::Home;
use kvstore::{
    cpu, gpu, gpu_count, Adam, DType, Device, Error, Key, KvStore, NDArray, Sgd, Updater,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A fresh seed, and a generator from it.
fn fresh() -> (u64, StdRng) {
    let seed: u64 = rand::thread_rng().gen();
    (seed, StdRng::seed_from_u64(seed))
}

fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

fn random_array(h: Home, rng: &mut StdRng, n: usize, i: usize) -> NDArray {
    h.put(&NDArray::from_vec(random_vec(rng, n), [n]).unwrap(), i)
}

fn values(kv: &KvStore, keys: &[i32], n: usize) -> Vec<Vec<f32>> {
    keys.iter()
        .map(|&k| {
            let out = NDArray::zeros([n]);
            kv.pull(k, &out).unwrap();
            out.to_vec::<f32>().unwrap()
        })
        .collect()
}

fn int_keys_of_every_type(h: Home) {
    let (seed, mut rng) = fresh();
    let kv = h.store();
    let n = 5;
    let init = random_array(h, &mut rng, n, 0);
    kv.init(3usize, &init).unwrap();
    kv.init_list(&[4u8, 5], &[init.copy().unwrap(), init.copy().unwrap()])
        .unwrap();
    let g = random_array(h, &mut rng, n, 1);
    kv.push(3i64, &g).unwrap();
    kv.push_list(&[4u64, 4], &[&g, &g]).unwrap();
    let want_g = g.to_vec::<f32>().unwrap();
    let got = values(&kv, &[3, 4, 5], n);
    assert_eq!(got[0], want_g, "seed {seed}");
    let twice: Vec<f32> = want_g.iter().map(|x| x + x).collect();
    assert_eq!(got[1], twice, "seed {seed}");
    assert_eq!(got[2], init.to_vec::<f32>().unwrap(), "seed {seed}");
    for k in &[3i16, 4] {
        assert_eq!(kv.meta(k).unwrap().0, init.shape());
    }
    assert_eq!(kv.keys(), [Key::Int(3), Key::Int(4), Key::Int(5)]);

    // Out of range: a typed error naming the value, and nothing changes, in a list too.
    let big = u64::from(u32::MAX);
    let e = kv.push_list(&[3u64, big], &[&g, &g]).unwrap_err();
    assert!(
        matches!(&e, Error::KeyOutOfRange { value, ty: "u64" } if *value == big.to_string()),
        "{e}"
    );
    let e = kv.init(-1 - i64::from(i32::MAX) - 1, &init).unwrap_err();
    assert!(matches!(e, Error::KeyOutOfRange { ty: "i64", .. }), "{e}");
    assert!(kv.pull(usize::MAX, &NDArray::zeros([n])).is_err());
    assert_eq!(values(&kv, &[3, 4, 5], n), got, "seed {seed}");
    assert_eq!(kv.keys().len(), 3);
    // The largest key that fits is an ordinary key.
    kv.init(i64::from(i32::MAX), &init).unwrap();
    assert_eq!(kv.keys().last(), Some(&Key::Int(i32::MAX)));
}

fn pushpull_list_in_place_matches_pushpull_list(h: Home) {
    let (seed, mut rng) = fresh();
    let n = 37;
    let keys = [2, 9, 4];
    let init: Vec<NDArray> = keys
        .iter()
        .map(|_| random_array(h, &mut rng, n, 0))
        .collect();
    let sgd = Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    });
    let (a, b) = (h.store(), h.store());
    for kv in [&a, &b] {
        kv.init_list(&keys, &init).unwrap();
        kv.set_updater(sgd.clone()).unwrap();
    }
    for _ in 0..3 {
        let grads: Vec<Vec<NDArray>> = keys
            .iter()
            .map(|_| (0..2).map(|d| random_array(h, &mut rng, n, d)).collect())
            .collect();
        let outs: Vec<Vec<NDArray>> = grads
            .iter()
            .map(|g| g.iter().map(|x| x.copy().unwrap()).collect())
            .collect();
        let copies: Vec<Vec<NDArray>> = grads
            .iter()
            .map(|g| g.iter().map(|x| x.copy().unwrap()).collect())
            .collect();
        a.pushpull_list(&keys, &copies, &outs).unwrap();
        b.pushpull_list_in_place(&keys, &grads).unwrap();
        for (o, g) in outs.iter().flatten().zip(grads.iter().flatten()) {
            assert_eq!(
                o.to_vec::<f32>().unwrap(),
                g.to_vec::<f32>().unwrap(),
                "seed {seed}"
            );
        }
    }
    // All or nothing: an unknown key changes neither the store nor the arrays.
    let before = values(&b, &keys, n);
    let g = random_array(h, &mut rng, n, 0);
    let kept = g.to_vec::<f32>().unwrap();
    assert!(b.pushpull_list_in_place(&[2, 77], &[&g, &g]).is_err());
    assert_eq!(values(&b, &keys, n), before, "seed {seed}");
    assert_eq!(g.to_vec::<f32>().unwrap(), kept);
}

/// The error a test updater returns.
#[derive(Debug)]
struct Refused(i32);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "refused key {}", self.0)
    }
}

impl std::error::Error for Refused {}

fn fallible_closures(h: Home) {
    let (seed, mut rng) = fresh();
    let n = 11;
    let keys = [1, 2, 3];
    let kv = h.store();
    let init: Vec<NDArray> = keys
        .iter()
        .map(|_| random_array(h, &mut rng, n, 0))
        .collect();
    kv.init_list(&keys, &init).unwrap();
    let refuse = Arc::new(Mutex::new(None::<i32>));
    let r = refuse.clone();
    kv.set_updater(Updater::try_custom(move |key, input, stored| {
        let Key::Int(k) = key else {
            return Err("string key".into());
        };
        stored.add_scaled(input, 2.0)?;
        if *r.lock().unwrap() == Some(*k) {
            return Err(Box::new(Refused(*k)));
        }
        Ok(())
    }))
    .unwrap();
    let g: Vec<NDArray> = keys
        .iter()
        .map(|_| random_array(h, &mut rng, n, 1))
        .collect();
    kv.push_list(&keys, &g).unwrap();
    let after_ok = values(&kv, &keys, n);
    for ((got, i), gi) in after_ok.iter().zip(&init).zip(&g) {
        let (i, gi) = (i.to_vec::<f32>().unwrap(), gi.to_vec::<f32>().unwrap());
        let want: Vec<f32> = i.iter().zip(&gi).map(|(s, x)| s + 2.0 * x).collect();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "seed {seed}");
        }
    }

    // Key 2 fails after keys before it ran: the error names it and keeps the source, and
    // every key is as it was.
    *refuse.lock().unwrap() = Some(2);
    let e = kv.push_list(&keys, &g).unwrap_err();
    match &e {
        Error::UpdaterFailed { key, source } => {
            assert_eq!(*key, Key::Int(2));
            assert!(matches!(source.downcast_ref::<Refused>(), Some(Refused(2))));
        }
        other => panic!("expected UpdaterFailed, got {other}"),
    }
    assert!(e.to_string().contains("refused key 2"), "{e}");
    assert!(std::error::Error::source(&e).is_some());
    assert_eq!(values(&kv, &keys, n), after_ok, "seed {seed}");

    // An error from the store's own API inside the closure propagates with `?`.
    kv.set_updater(Updater::try_custom(|_, _, stored| {
        stored.add_scaled(&NDArray::zeros([1]), 1.0)?;
        Ok(())
    }))
    .unwrap();
    let e = kv.push(1, &g[0]).unwrap_err();
    let source = match &e {
        Error::UpdaterFailed { source, .. } => source,
        other => panic!("expected UpdaterFailed, got {other}"),
    };
    assert!(matches!(
        source.downcast_ref::<Error>(),
        Some(Error::Operands { .. })
    ));
    assert_eq!(values(&kv, &keys, n), after_ok, "seed {seed}");

    // Infallible closures still read as one-liners, and a panic is still its own error.
    kv.set_updater(Updater::custom(|_key, input, stored| {
        *stored += input * 2.0
    }))
    .unwrap();
    kv.set_updater(Updater::custom(|_, _, _| panic!("boom")))
        .unwrap();
    assert!(matches!(
        kv.push(1, &g[0]),
        Err(Error::UpdaterPanicked { .. })
    ));
    assert_eq!(values(&kv, &keys, n), after_ok, "seed {seed}");
}

type Events = Arc<Mutex<Vec<(Key, Option<u64>, &'static str, usize)>>>;

fn record(kv: &KvStore) -> Events {
    let events: Events = Arc::default();
    let log = events.clone();
    kv.set_push_hook(move |e| {
        log.lock()
            .unwrap()
            .push((e.key.clone(), e.step, e.updater, e.values))
    });
    events
}

fn push_hook_observes_without_changing_the_numbers(h: Home) {
    let (seed, mut rng) = fresh();
    let n = 300;
    let keys = [8, 1, 5];
    let init: Vec<NDArray> = keys
        .iter()
        .map(|_| random_array(h, &mut rng, n, 0))
        .collect();
    for updater in [
        Updater::Adam(Adam {
            lr: 0.01,
            wd: 1e-3,
            ..Adam::default()
        }),
        Updater::Sgd(Sgd {
            lr: 0.05,
            momentum: 0.9,
            ..Sgd::default()
        }),
        Updater::Axpby { a: 0.5, b: -1.5 },
    ] {
        let (plain, hooked) = (h.store(), h.store());
        for kv in [&plain, &hooked] {
            kv.init_list(&keys, &init).unwrap();
            kv.set_updater(updater.clone()).unwrap();
        }
        let events = record(&hooked);
        for step in 1..=3u64 {
            let grads: Vec<Vec<NDArray>> = keys
                .iter()
                .map(|_| (0..3).map(|d| random_array(h, &mut rng, n, d)).collect())
                .collect();
            plain.push_list(&keys, &grads).unwrap();
            hooked.push_list(&keys, &grads).unwrap();
            let got: Vec<_> = events.lock().unwrap().drain(..).collect();
            let want: Vec<_> = [1, 5, 8]
                .iter()
                .map(|&k| (Key::Int(k), Some(step), updater.name(), 3))
                .collect();
            assert_eq!(got, want, "{}", updater.name());
            // Bit for bit: the hook only observes.
            assert_eq!(
                values(&plain, &keys, n),
                values(&hooked, &keys, n),
                "{} seed {seed}",
                updater.name()
            );
        }
        // Priorities change the order, not the numbers; a failed push reports nothing.
        let g = random_array(h, &mut rng, n, 0);
        plain
            .push_list_with_priority(&keys, &[&g, &g, &g], &[0, 0, 9])
            .unwrap();
        hooked
            .push_list_with_priority(&keys, &[&g, &g, &g], &[0, 0, 9])
            .unwrap();
        assert!(hooked.push_list(&[1, 404], &[&g, &g]).is_err());
        let got: Vec<Key> = events.lock().unwrap().drain(..).map(|e| e.0).collect();
        assert_eq!(got, [Key::Int(5), Key::Int(1), Key::Int(8)]);
        assert_eq!(
            values(&plain, &keys, n),
            values(&hooked, &keys, n),
            "seed {seed}"
        );
        // A new updater starts the steps afresh; pushpull reports its pushes.
        hooked.set_updater(updater.clone()).unwrap();
        hooked.pushpull(1, &g, &NDArray::zeros([n])).unwrap();
        assert_eq!(
            events.lock().unwrap().drain(..).collect::<Vec<_>>(),
            [(Key::Int(1), Some(1), updater.name(), 1)]
        );
        hooked.clear_push_hook();
        hooked.push(1, &g).unwrap();
        assert!(events.lock().unwrap().is_empty());
    }
}

fn push_hook_may_call_the_store(h: Home) {
    let (seed, mut rng) = fresh();
    let n = 16;
    let kv = Arc::new(h.store());
    kv.init(0, &random_array(h, &mut rng, n, 0)).unwrap();
    kv.set_updater(Updater::custom(|_, input, stored| *stored += input))
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (store, log) = (Arc::downgrade(&kv), seen.clone());
    kv.set_push_hook(move |e| {
        assert_eq!(e.step, None, "a closure keeps no step");
        let out = NDArray::zeros([16]);
        store.upgrade().unwrap().pull(e.key, &out).unwrap();
        log.lock().unwrap().push(out.to_vec::<f32>().unwrap());
    });
    let g = random_array(h, &mut rng, n, 1);
    kv.push(0, &g).unwrap();
    let now = values(&kv, &[0], n).remove(0);
    assert_eq!(*seen.lock().unwrap(), [now], "seed {seed}");
}

fn key_orders(h: Home) {
    let kv = h.store();
    let one = || NDArray::zeros([1]);
    kv.init_list(&[40, -3], &[one(), one()]).unwrap();
    kv.init(7, &one()).unwrap();
    assert!(kv.init_list(&[1, 7], &[one(), one()]).is_err());
    assert_eq!(kv.keys(), [Key::Int(-3), Key::Int(7), Key::Int(40)]);
    assert_eq!(
        kv.keys_in_init_order(),
        [Key::Int(40), Key::Int(-3), Key::Int(7)]
    );
    let kv = h.store();
    kv.init_list(&["w", "b"], &[one(), one()]).unwrap();
    kv.init("a", &one()).unwrap();
    let want = [Key::from("w"), Key::from("b"), Key::from("a")];
    assert_eq!(kv.keys(), want);
    assert_eq!(kv.keys_in_init_order(), want);
}

on_every_home!(
    int_keys_of_every_type,
    pushpull_list_in_place_matches_pushpull_list,
    fallible_closures,
    push_hook_observes_without_changing_the_numbers,
    push_hook_may_call_the_store,
    key_orders,
);

/// The reference rounding of one `f64` to `dtype`, widened back to `f64`.
fn round_to(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => x,
        DType::F32 => f64::from(x as f32),
        DType::F16 => half::f16::from_f64(x).to_f64(),
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
    }
}

#[test]
fn from_f64_rounds_to_the_tag_and_places_on_the_device() {
    let (seed, mut rng) = fresh();
    let data: Vec<f64> = (0..24).map(|_| rng.gen_range(-1e3..1e3)).collect();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for device in [cpu(0), cpu(3)] {
            let a = NDArray::from_f64(&data, [2, 3, 4], dtype, device).unwrap();
            assert_eq!((a.dtype(), a.device()), (dtype, device));
            assert_eq!(a.shape(), [2, 3, 4].into());
            let want: Vec<f64> = data.iter().map(|&x| round_to(x, dtype)).collect();
            assert_eq!(a.to_vec::<f64>().unwrap(), want, "{dtype} seed {seed}");
        }
    }
    let e = NDArray::from_f64(&data, [5, 5], DType::F32, cpu(0)).unwrap_err();
    assert!(matches!(e, Error::DataLength { len: 24, .. }), "{e}");
    if gpu_count() == 0 {
        let e = NDArray::from_f64(&data, [24], DType::F32, gpu(0)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::DeviceNotFound {
                    device: Device::Gpu(0),
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn from_vec_on_keeps_the_elements_and_places_them() {
    let (seed, mut rng) = fresh();
    let data = random_vec(&mut rng, 12);
    let a = NDArray::from_vec_on(data.clone(), [3, 4], cpu(2)).unwrap();
    assert_eq!((a.device(), a.dtype()), (cpu(2), DType::F32));
    assert_eq!(a.to_vec::<f32>().unwrap(), data, "seed {seed}");
    let wide: Vec<f64> = data.iter().map(|&x| f64::from(x)).collect();
    let b = NDArray::from_vec_on(wide.clone(), [12], cpu(1)).unwrap();
    assert_eq!(b.to_vec::<f64>().unwrap(), wide);
    assert!(matches!(
        NDArray::from_vec_on(data.clone(), [5], cpu(0)),
        Err(Error::DataLength { len: 12, .. })
    ));
    if gpu_count() == 0 {
        assert!(matches!(
            NDArray::from_vec_on(data, [12], gpu(0)),
            Err(Error::DeviceNotFound { .. })
        ));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn placed_constructors_on_a_gpu() {
    assert!(gpu_count() > 0, "this test needs a GPU and none was found");
    let (seed, mut rng) = fresh();
    let data = random_vec(&mut rng, 1000);
    let a = NDArray::from_vec_on(data.clone(), [1000], gpu(0)).unwrap();
    assert_eq!(a.device(), gpu(0));
    assert_eq!(a.to_vec::<f32>().unwrap(), data, "seed {seed}");
    let wide: Vec<f64> = data.iter().map(|&x| f64::from(x)).collect();
    let b = NDArray::from_f64(&wide, [1000], DType::F16, gpu(0)).unwrap();
    let want: Vec<f64> = wide.iter().map(|&x| round_to(x, DType::F16)).collect();
    assert_eq!(b.to_vec::<f64>().unwrap(), want, "seed {seed}");
}

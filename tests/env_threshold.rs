//! `KVSTORE_PAR_MIN_BYTES`: the size from which a store splits host loops over threads, read
//! when the store is created. Its own test binary, because it sets a process-wide variable.

use kvstore::{cpu, Adam, Error, KvStore, NDArray, Updater};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const VAR: &str = "KVSTORE_PAR_MIN_BYTES";

fn random_ints(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-8..=8) as f32).collect()
}

/// Pushes two values (summed, assigned) and one value (a plain copy) to a key of `dims`, and
/// pulls it into two outs; checks every result against a sum made here.
fn push_and_pull(kv: &KvStore, key: i32, dims: &[usize], rng: &mut StdRng) {
    let n: usize = dims.iter().product();
    let shape = kvstore::Shape::new(dims).unwrap();
    kv.init(key, &NDArray::from_vec(random_ints(rng, n), shape).unwrap())
        .unwrap();
    let (a, b) = (random_ints(rng, n), random_ints(rng, n));
    let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let values = [
        NDArray::from_vec(a.clone(), shape).unwrap(),
        NDArray::from_vec(b, shape)
            .unwrap()
            .to_device(cpu(1))
            .unwrap(),
    ];
    kv.push(key, &values[..]).unwrap();
    let outs = [
        NDArray::full(shape, f64::NAN),
        NDArray::full(shape, f64::NAN).to_device(cpu(2)).unwrap(),
    ];
    kv.pull(key, &outs[..]).unwrap();
    for o in &outs {
        assert_eq!(o.to_vec::<f32>().unwrap(), sum, "key {key} {dims:?}");
    }
    kv.push(key, &values[0]).unwrap();
    kv.pull(key, &outs[0]).unwrap();
    assert_eq!(outs[0].to_vec::<f32>().unwrap(), a, "key {key} {dims:?}");
}

#[test]
fn par_min_bytes_from_the_environment() {
    let mut rng = StdRng::from_entropy();

    // 0: every call splits over threads, empty keys included (they used to divide by zero).
    std::env::set_var(VAR, "0");
    let kv = KvStore::create("local").unwrap();
    for (key, dims) in [&[0][..], &[3, 0], &[0, 5, 2], &[1], &[7, 33], &[300_000]]
        .into_iter()
        .enumerate()
    {
        push_and_pull(&kv, key as i32, dims, &mut rng);
    }
    // An updater with state, on an empty key and a big one.
    kv.set_updater(Updater::Adam(Adam::default())).unwrap();
    for key in [0, 5] {
        let (shape, _, _) = kv.meta(key).unwrap();
        kv.push(key, &NDArray::ones(shape)).unwrap();
        let out = NDArray::full(shape, f64::NAN);
        kv.pull(key, &out).unwrap();
        assert!(out.to_vec::<f32>().unwrap().iter().all(|x| x.is_finite()));
    }
    // A custom updater sums the pushed values itself.
    kv.set_updater(Updater::custom(|_, input, stored| *stored += input))
        .unwrap();
    kv.push(0, &[NDArray::zeros([0]), NDArray::zeros([0])][..])
        .unwrap();

    // Each store keeps the threshold it was created with: the first one still works after the
    // variable changes, and a store that never splits computes the same.
    std::env::set_var(VAR, usize::MAX.to_string());
    let never = KvStore::create("local").unwrap();
    push_and_pull(&never, 1, &[300_000], &mut rng);
    push_and_pull(&kv, 100, &[0], &mut rng);

    // A value that is not a number of bytes is an error that names the variable.
    for bad in ["-1", "1MiB", "", "1e6"] {
        std::env::set_var(VAR, bad);
        match KvStore::create("local") {
            Err(e @ Error::InvalidEnv { .. }) => {
                let text = e.to_string();
                assert!(text.contains(VAR) && text.contains("unset"), "{text}");
            }
            Err(e) => panic!("{VAR}={bad:?}: expected Error::InvalidEnv, got {e:?}"),
            Ok(_) => panic!("{VAR}={bad:?}: expected Error::InvalidEnv, got a store"),
        }
    }
    std::env::remove_var(VAR);
    KvStore::create("local").unwrap();
}

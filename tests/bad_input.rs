//! Bad input through the public API: an error (or, where the signature cannot return one, a
//! documented panic with a `try_` twin), never a silent wrong answer. And duplicate keys in
//! `init_list`, which are checked in linear time.

use kvstore::{DType, Error, Key, KvStore, NDArray, Shape};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn panic_text(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let panic = std::panic::catch_unwind(f).expect_err("expected a panic");
    match (panic.downcast_ref::<String>(), panic.downcast_ref::<&str>()) {
        (Some(s), _) => s.clone(),
        (_, Some(s)) => (*s).to_owned(),
        _ => String::new(),
    }
}

/// 2^64 elements used to wrap to 0: an empty array that `init` accepted and `Display` crashed on.
#[test]
fn element_counts_that_overflow_are_errors() {
    for dims in [
        &[1usize << 33, 1 << 31][..],
        &[usize::MAX, 2],
        &[1 << 32, 1 << 32, 1],
        &[3, 5, 1 << 62],
    ] {
        match Shape::new(dims) {
            Err(e @ Error::ShapeTooLarge { .. }) => {
                assert!(e.to_string().contains("smaller dimensions"), "{e}")
            }
            other => panic!("{dims:?}: expected ShapeTooLarge, got {other:?}"),
        }
        assert!(Shape::try_from(dims).is_err());
    }
    let text = panic_text(|| {
        NDArray::zeros([1 << 33, 1 << 31]);
    });
    assert!(text.contains("too large"), "{text}");
    let text = panic_text(|| {
        let _: Shape = [1 << 40, 1 << 40].into();
    });
    assert!(text.contains("too large"), "{text}");
    // A zero dimension makes any other dimension fine: no elements.
    let empty = NDArray::zeros(Shape::new(&[usize::MAX, 0]).unwrap());
    assert_eq!(empty.size(), 0);
    assert_eq!(empty.to_string(), "[]");
}

#[test]
fn byte_sizes_that_overflow_are_errors() {
    // 2^62 elements fit in a shape; in any dtype they take at least 2^63 bytes, over
    // isize::MAX.
    let shape = Shape::new(&[1 << 31, 1 << 31]).unwrap();
    assert_eq!(shape.size(), 1 << 62);
    for dtype in DType::ALL {
        let err = NDArray::full_on(shape, 1.0, dtype, kvstore::cpu(0)).unwrap_err();
        assert!(matches!(err, Error::ShapeTooLarge { dtype: Some(d), .. } if d == dtype));
        assert!(err.to_string().contains(dtype.name()), "{err}");
        assert!(shape.nbytes(dtype).is_err());
        assert!(kvstore::HostData::try_filled(dtype, shape.size(), 0.0).is_err());
    }
    assert!(NDArray::try_zeros(shape).is_err());
    assert!(NDArray::try_ones(shape).is_err());
    assert!(NDArray::try_full(shape, 2.0).is_err());
    let text = panic_text(|| {
        NDArray::ones(shape);
    });
    assert!(
        text.contains("float32") && text.contains("too large"),
        "{text}"
    );
    // Just under the limit for 2-byte elements, over it for 4 and 8.
    let half = Shape::new(&[(isize::MAX as usize) / 2]).unwrap();
    assert_eq!(half.nbytes(DType::F16).unwrap(), isize::MAX as usize - 1);
    assert!(half.nbytes(DType::F32).is_err());
    // Shapes that fit are unchanged.
    let mut rng = StdRng::from_entropy();
    let dims: Vec<usize> = (0..3).map(|_| rng.gen_range(1..9)).collect();
    let s = Shape::new(&dims).unwrap();
    assert_eq!(
        s.nbytes(DType::F64).unwrap(),
        8 * dims.iter().product::<usize>()
    );
    assert_eq!(NDArray::try_zeros(s).unwrap().size(), s.size());
}

#[test]
fn try_mul_matches_the_operator() {
    let mut rng = StdRng::from_entropy();
    let data: Vec<f32> = (0..37).map(|_| rng.gen_range(-4.0..4.0)).collect();
    let a = NDArray::from_vec(data.clone(), [37]).unwrap();
    let s = rng.gen_range(-3.0..3.0f64);
    let want: Vec<f32> = data.iter().map(|x| x * s as f32).collect();
    assert_eq!(a.try_mul(s).unwrap().to_vec::<f32>().unwrap(), want);
    assert_eq!((&a * s).to_vec::<f32>().unwrap(), want);
    // The input is untouched.
    assert_eq!(a.to_vec::<f32>().unwrap(), data);
}

fn str_keys(n: usize, tag: &str) -> Vec<String> {
    (0..n).map(|i| format!("{tag}/layer{i}/weight")).collect()
}

/// Every key in `keys` holds `value`, and the store has exactly `count` keys.
fn holds(kv: &KvStore, keys: &[&str], value: f32, count: usize) {
    assert_eq!(kv.keys().len(), count);
    for &k in keys {
        let out = NDArray::full([3], f64::NAN);
        kv.pull(k, &out).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), vec![value; 3], "key {k}");
    }
}

#[test]
fn init_list_finds_duplicates_and_changes_nothing() {
    let mut rng = StdRng::from_entropy();
    let n = 40_000;
    let keys = str_keys(n, "a");
    let values = vec![NDArray::full([3], 1.0); n];
    let kv = KvStore::create("local").unwrap();

    // A duplicate inside the list, at a random place: nothing is initialized.
    let (i, j) = (rng.gen_range(0..n / 2), rng.gen_range(n / 2..n));
    let mut dup = keys.clone();
    dup[j] = dup[i].clone();
    match kv.init_list(&dup, &values) {
        Err(Error::DuplicateInit { key }) => assert_eq!(key, Key::from(&keys[i])),
        other => panic!("expected DuplicateInit, got {other:?}"),
    }
    assert!(kv.keys().is_empty());

    // Distinct keys: all in.
    kv.init_list(&keys, &values).unwrap();
    holds(&kv, &[&keys[0], &keys[i], &keys[n - 1]], 1.0, n);

    // A duplicate against the table, after new keys: none of the new keys go in, and the old
    // value is unchanged.
    let mut more = str_keys(100, "b");
    let k = rng.gen_range(0..100);
    more[k] = keys[j].clone();
    let twos = vec![NDArray::full([3], 2.0); 100];
    match kv.init_list(&more, &twos) {
        Err(Error::DuplicateInit { key }) => assert_eq!(key, Key::from(&keys[j])),
        other => panic!("expected DuplicateInit, got {other:?}"),
    }
    holds(&kv, &[&keys[j]], 1.0, n);
    let fresh = if k == 0 {
        more[1].clone()
    } else {
        more[0].clone()
    };
    assert!(matches!(
        kv.meta(fresh.as_str()),
        Err(Error::UnknownKey { .. })
    ));

    // The same list without the duplicate goes in.
    more[k] = "b/replacement".to_owned();
    kv.init_list(&more, &twos).unwrap();
    holds(&kv, &[&fresh, "b/replacement"], 2.0, n + 100);

    // Int keys: the same rules.
    let kv = KvStore::create("local").unwrap();
    let ints: Vec<i32> = (0..1000).rev().collect();
    let mut dup = ints.clone();
    dup[999] = dup[0];
    assert!(matches!(
        kv.init_list(&dup, &vec![NDArray::zeros([3]); 1000]),
        Err(Error::DuplicateInit { key: Key::Int(999) })
    ));
    assert!(kv.keys().is_empty());
    kv.init_list(&ints, &vec![NDArray::zeros([3]); 1000])
        .unwrap();
    assert_eq!(kv.keys().len(), 1000);
}

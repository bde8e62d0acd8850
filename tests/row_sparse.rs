//! Row-sparse keys: against MXNet 1.9.1's own results (`tests/fixtures/mxnet_row_sparse.json`,
//! written by `tests/fixtures/make_mxnet_row_sparse.py` with MXNet run on this machine), against
//! an independent float64 reference of the lazy updates on fresh random data, and the errors
//! (each leaves the store as it was).

use anyhow::{ensure, Context, Result};
use kvstore::{
    cpu, gpu, gpu_count, Adam, DType, Device, Error, Key, KvStore, NDArray, RowSparse, Sgd, Shape,
    Updater,
};
use rand::prelude::*;
use serde_json::Value;

fn floats(v: &Value) -> Result<Vec<f32>> {
    v.as_array()
        .context("a list of float32 bit patterns")?
        .iter()
        .map(|b| Ok(f32::from_bits(b.as_u64().context("a bit pattern")? as u32)))
        .collect()
}

fn ints(v: &Value) -> Result<Vec<u64>> {
    v.as_array()
        .context("a list of ints")?
        .iter()
        .map(|b| b.as_u64().context("an int"))
        .collect()
}

fn shape_of(v: &Value) -> Result<Shape> {
    let dims: Vec<usize> = ints(v)?.into_iter().map(|d| d as usize).collect();
    Ok(Shape::new(&dims)?)
}

/// The updater of a fixture case's MXNet optimizer (lazy SGD or Adam), or assign.
fn updater_of(o: &Value) -> Result<Updater> {
    if o.is_null() {
        return Ok(Updater::Assign);
    }
    let f = |name: &str, default: f64| o[name].as_f64().unwrap_or(default);
    Ok(match o["name"].as_str().context("a name")? {
        "sgd" => Updater::Sgd(Sgd {
            lr: f("learning_rate", 0.01),
            momentum: f("momentum", 0.0),
            wd: f("wd", 0.0),
            rescale_grad: f("rescale_grad", 1.0),
            clip_gradient: o["clip_gradient"].as_f64(),
        }),
        "adam" => Updater::Adam(Adam {
            lr: f("learning_rate", 0.001),
            beta1: f("beta1", 0.9),
            beta2: f("beta2", 0.999),
            epsilon: f("epsilon", 1e-8),
            wd: f("wd", 0.0),
            rescale_grad: f("rescale_grad", 1.0),
            clip_gradient: o["clip_gradient"].as_f64(),
            ..Adam::default()
        }),
        other => anyhow::bail!("unknown optimizer {other}"),
    })
}

fn close(got: &[f32], want: &[f32], what: &str) -> Result<()> {
    ensure!(
        got.len() == want.len(),
        "{what}: {} values, want {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-6 * w.abs().max(1.0);
        ensure!(
            (g - w).abs() <= tol,
            "{what}: element {i} is {g}, MXNet has {w}"
        );
    }
    Ok(())
}

/// Every fixture case with the key homed on `home` and device `d`'s rows on `device(d)`.
fn every_case(home: Option<Device>, device: impl Fn(usize) -> Device) -> Result<()> {
    let fx: Value = serde_json::from_str(include_str!("fixtures/mxnet_row_sparse.json"))?;
    ensure!(fx["mxnet"] == "1.9.1", "the fixture comes from MXNet 1.9.1");
    let cases = fx["cases"].as_array().context("cases")?;
    ensure!(cases.len() >= 20, "the fixture has its cases");
    for (c, case) in cases.iter().enumerate() {
        let shape = shape_of(&case["shape"])?;
        let kv = KvStore::create(case["kind"].as_str().context("a kind")?)?;
        let init = NDArray::from_vec(floats(&case["init"])?, shape)?;
        kv.init_row_sparse("e", &init)?;
        if let Some(h) = home {
            ensure!(kv.meta("e")?.2 == h, "case {c}: the key is homed on {h}");
        }
        kv.set_updater(updater_of(&case["optimizer"])?)?;
        let steps = case["steps"].as_array().context("steps")?;
        for (s, values) in steps.iter().enumerate() {
            let values = values.as_array().context("values")?;
            let grads = values
                .iter()
                .enumerate()
                .map(|(d, v)| {
                    let ids = ints(&v["ids"])?;
                    let mut dims = shape.dims().to_vec();
                    dims[0] = ids.len();
                    let rows = NDArray::from_vec(floats(&v["rows"])?, Shape::new(&dims)?)?;
                    Ok(RowSparse::new(ids, rows.to_device(device(d))?)?)
                })
                .collect::<Result<Vec<RowSparse>>>()?;
            kv.push_row_sparse("e", &grads)?;
            let what = format!("case {c} ({:?}) step {s}", case["optimizer"]);
            // A dense pull of the whole value.
            let whole = NDArray::zeros(shape);
            kv.pull("e", &whole)?;
            close(&whole.to_vec::<f32>()?, &floats(&case["dense"][s])?, &what)?;
            // A row_sparse_pull of MXNet's random ids: its rows, zeros elsewhere.
            let ids = ints(&case["pull_ids"][s])?;
            let got = kv.row_sparse_pull("e", &ids)?;
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            sorted.dedup();
            ensure!(got.ids() == sorted, "{what}: pulled ids {:?}", got.ids());
            let dense = got.to_dense(shape)?.to_vec::<f32>()?;
            close(
                &dense,
                &floats(&case["pulled"][s])?,
                &format!("{what}, row_sparse_pull"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn row_sparse_keys_match_mxnet() -> Result<()> {
    every_case(Some(cpu(0)).filter(|_| gpu_count() == 0), cpu)
}

#[test]
#[ignore = "needs a GPU"]
fn row_sparse_keys_on_a_gpu_match_mxnet() -> Result<()> {
    if gpu_count() == 0 {
        println!("SKIPPED: no GPU");
        return Ok(());
    }
    // `device` stores home keys on GPU 0; local ones keep them in host memory.
    every_case(None, |_| gpu(0))
}

/// A float64 reference of the lazy updates, written from MXNet's formulas: the rows present in
/// a push change (with their state), the others stay.
struct Reference {
    width: usize,
    w: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    t: u64,
}

impl Reference {
    fn push(&mut self, updater: &Updater, grads: &[(Vec<u64>, Vec<f32>)]) {
        let mut sum: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
        for (ids, rows) in grads {
            for (i, &id) in ids.iter().enumerate() {
                let row = sum.entry(id).or_insert_with(|| vec![0.0; self.width]);
                for (r, &x) in row.iter_mut().zip(&rows[i * self.width..]) {
                    *r += f64::from(x);
                }
            }
        }
        self.t += 1;
        if let Updater::Assign = updater {
            self.w.iter_mut().for_each(|x| *x = 0.0);
        }
        for (id, g) in sum {
            for (j, g) in g.into_iter().enumerate() {
                let i = id as usize * self.width + j;
                match updater {
                    Updater::Assign => self.w[i] = g,
                    Updater::Sgd(s) => {
                        let g = s.rescale_grad * g + s.wd * self.w[i];
                        self.m[i] = s.momentum * self.m[i] - s.lr * g;
                        self.w[i] += self.m[i];
                    }
                    Updater::Adam(a) => {
                        let g = a.rescale_grad * g + a.wd * self.w[i];
                        self.m[i] = a.beta1 * self.m[i] + (1.0 - a.beta1) * g;
                        self.v[i] = a.beta2 * self.v[i] + (1.0 - a.beta2) * g * g;
                        let t = self.t as i32;
                        let lr = a.lr * (1.0 - a.beta2.powi(t)).sqrt() / (1.0 - a.beta1.powi(t));
                        self.w[i] -= lr * self.m[i] / (self.v[i].sqrt() + a.epsilon);
                    }
                    _ => unreachable!(),
                }
            }
        }
    }
}

/// Random pushes of random rows (repeated ids in one value, several values, some pushes with
/// no rows at all) through lazy SGD with momentum, lazy Adam and assign, on `local` and
/// `device` stores, against the float64 reference; rows never pushed keep their initial
/// values exactly.
#[test]
fn lazy_updates_equal_a_float64_reference() -> Result<()> {
    let mut rng = StdRng::from_entropy();
    let updaters = [
        Updater::Assign,
        Updater::Sgd(Sgd {
            lr: 0.1,
            momentum: 0.9,
            wd: 0.01,
            ..Sgd::default()
        }),
        Updater::Adam(Adam {
            lr: 0.01,
            wd: 0.001,
            ..Adam::default()
        }),
    ];
    for kind in ["local", "device"] {
        for updater in &updaters {
            let (rows_n, dims) = (40usize, [40usize, 3, 2]);
            let width = 6;
            let init: Vec<f32> = (0..rows_n * width)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let kv = KvStore::create(kind)?;
            kv.init_row_sparse(7, &NDArray::from_vec(init.clone(), dims)?)?;
            kv.set_updater(updater.clone())?;
            let mut reference = Reference {
                width,
                w: init.iter().map(|&x| f64::from(x)).collect(),
                m: vec![0.0; rows_n * width],
                v: vec![0.0; rows_n * width],
                t: 0,
            };
            let mut touched = vec![false; rows_n];
            for step in 0..6 {
                let values = rng.gen_range(1..4);
                let grads: Vec<(Vec<u64>, Vec<f32>)> = (0..values)
                    .map(|_| {
                        // Step 2 pushes no rows; ids repeat within a value, drawn from the
                        // first 30 rows only, so the last 10 are never pushed.
                        let n = if step == 2 { 0 } else { rng.gen_range(1..12) };
                        let ids: Vec<u64> = (0..n).map(|_| rng.gen_range(0..30)).collect();
                        let rows = (0..n * width).map(|_| rng.gen_range(-2.0..2.0)).collect();
                        (ids, rows)
                    })
                    .collect();
                for (ids, _) in &grads {
                    ids.iter().for_each(|&i| touched[i as usize] = true);
                }
                let pushed = grads
                    .iter()
                    .map(|(ids, rows)| {
                        RowSparse::new(
                            ids.clone(),
                            NDArray::from_vec(rows.clone(), [ids.len(), 3, 2])?,
                        )
                    })
                    .collect::<kvstore::Result<Vec<_>>>()?;
                kv.push_row_sparse(7, &pushed)?;
                reference.push(updater, &grads);
                let out = NDArray::zeros(dims);
                kv.pull(7, &out)?;
                let got = out.to_vec::<f32>()?;
                for (i, (&g, &w)) in got.iter().zip(&reference.w).enumerate() {
                    let row = i / width;
                    if !touched[row] && !matches!(updater, Updater::Assign) {
                        assert_eq!(g, init[i], "{kind} {updater:?}: row {row} was never pushed");
                    }
                    let tol = 2e-5 * w.abs().max(1.0);
                    ensure!(
                        (f64::from(g) - w).abs() <= tol,
                        "{kind} {updater:?} step {step}: element {i} is {g}, the reference {w}"
                    );
                }
            }
            // The pushed rows never changed the arrays they came in.
            ensure!(kv.is_row_sparse(7)?);
        }
    }
    Ok(())
}

/// A closure updater gets only the rows present, as arrays of shape `[rows, ...]`.
#[test]
fn a_closure_updater_sees_the_rows_present() -> Result<()> {
    let kv = KvStore::create("local")?;
    kv.init_row_sparse(0, &NDArray::ones([5, 2]))?;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    kv.set_updater(Updater::custom(move |_, input, stored| {
        log.lock().unwrap().push(input.shape().dims().to_vec());
        *stored += input;
    }))?;
    let rows = NDArray::from_vec(vec![1f32, 2., 3., 4., 5., 6.], [3, 2])?;
    kv.push_row_sparse(0, &[RowSparse::new(vec![4, 1, 4], rows)?])?;
    assert_eq!(*seen.lock().unwrap(), vec![vec![2, 2]]);
    let out = NDArray::zeros([5, 2]);
    kv.pull(0, &out)?;
    assert_eq!(
        out.to_vec::<f32>()?,
        [1., 1., 4., 5., 1., 1., 1., 1., 7., 9.]
    );
    Ok(())
}

/// A snapshot of every key's value, to check that a refused call changed nothing.
fn snapshot(kv: &KvStore) -> Result<Vec<(Key, Vec<f32>)>> {
    kv.keys()
        .into_iter()
        .map(|k| {
            let out = NDArray::zeros(kv.meta(k.clone())?.0);
            kv.pull(k.clone(), &out)?;
            Ok((k, out.to_vec::<f32>()?))
        })
        .collect()
}

#[test]
fn bad_row_sparse_input_is_a_typed_error_and_changes_nothing() -> Result<()> {
    let mut rng = StdRng::from_entropy();
    let kv = KvStore::create("local")?;
    let random = |rng: &mut StdRng, dims: &[usize]| -> Result<NDArray> {
        let n = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
        Ok(NDArray::from_vec(v, Shape::new(dims)?)?)
    };
    kv.init_row_sparse(0, &random(&mut rng, &[6, 4])?)?;
    kv.init(1, &random(&mut rng, &[6, 4])?)?;
    kv.set_updater(Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    }))?;
    // One good push, so momentum state exists.
    let good = RowSparse::new(vec![1, 2], random(&mut rng, &[2, 4])?)?;
    kv.push_row_sparse(0, std::slice::from_ref(&good))?;
    let before = snapshot(&kv)?;
    let pushed_before = good.rows().to_vec::<f32>()?;

    let is_row_sparse_err = |e: Error| matches!(e, Error::RowSparse { .. });
    let cases: Vec<(&str, Error)> = vec![
        (
            "an id out of range",
            kv.push_row_sparse(0, &[RowSparse::new(vec![6], random(&mut rng, &[1, 4])?)?])
                .unwrap_err(),
        ),
        (
            "rows of the wrong width",
            kv.push_row_sparse(0, &[RowSparse::new(vec![0], random(&mut rng, &[1, 5])?)?])
                .unwrap_err(),
        ),
        (
            "rows of the wrong dtype",
            kv.push_row_sparse(
                0,
                &[RowSparse::new(
                    vec![0],
                    random(&mut rng, &[1, 4])?.astype(DType::F64)?,
                )?],
            )
            .unwrap_err(),
        ),
        (
            "a row-sparse push to a dense key",
            kv.push_row_sparse(1, std::slice::from_ref(&good))
                .unwrap_err(),
        ),
        (
            "a dense push to a row-sparse key",
            kv.push(0, &random(&mut rng, &[6, 4])?).unwrap_err(),
        ),
        (
            "a pushpull to a row-sparse key",
            kv.pushpull(0, &random(&mut rng, &[6, 4])?, &NDArray::zeros([6, 4]))
                .unwrap_err(),
        ),
        (
            "a row_sparse_pull of a dense key",
            kv.row_sparse_pull(1, &[0]).unwrap_err(),
        ),
        (
            "a row_sparse_pull id out of range",
            kv.row_sparse_pull(0, &[0, 6]).unwrap_err(),
        ),
        (
            "a list push with one bad value",
            kv.push_row_sparse_list(
                &[0, 0],
                &[
                    vec![good.clone()],
                    vec![RowSparse::new(vec![9], random(&mut rng, &[1, 4])?)?],
                ],
            )
            .unwrap_err(),
        ),
        (
            "a one-dimensional row-sparse key",
            kv.init_row_sparse(2, &NDArray::zeros([6])).unwrap_err(),
        ),
    ];
    for (what, err) in cases {
        let msg = err.to_string();
        ensure!(
            is_row_sparse_err(err),
            "{what}: not Error::RowSparse: {msg}"
        );
        println!("{what}: {msg}");
    }
    ensure!(matches!(
        kv.push_row_sparse(0, &[]).unwrap_err(),
        Error::Empty { .. }
    ));
    ensure!(matches!(
        kv.push_row_sparse(5, std::slice::from_ref(&good))
            .unwrap_err(),
        Error::UnknownKey { .. }
    ));
    ensure!(matches!(
        kv.push_row_sparse_list(&[0], &[vec![good.clone()], vec![good.clone()]])
            .unwrap_err(),
        Error::LengthMismatch { .. }
    ));
    ensure!(snapshot(&kv)? == before, "a refused call changed the store");
    ensure!(
        good.rows().to_vec::<f32>()? == pushed_before,
        "a push changed its input"
    );
    ensure!(!kv.keys().contains(&Key::Int(2)));
    // The state survived: the next push continues the momentum of the first.
    kv.push_row_sparse(0, std::slice::from_ref(&good))?;
    Ok(())
}

/// Row-sparse keys are not compressed, as in MXNet.
#[test]
fn a_compressed_store_refuses_row_sparse_keys() -> Result<()> {
    let kv = KvStore::create("device")?;
    kv.set_gradient_compression(kvstore::Compression::two_bit(0.5))?;
    let err = kv.init_row_sparse(0, &NDArray::zeros([4, 2])).unwrap_err();
    ensure!(matches!(err, Error::Compression { .. }), "{err}");
    ensure!(kv.keys().is_empty());
    Ok(())
}

/// A checkpoint keeps a key row-sparse, with its lazy optimizer state: a fresh store that
/// loads it continues exactly as the saved one, and a store holding the key dense refuses it.
#[test]
fn a_checkpoint_keeps_a_key_row_sparse() -> Result<()> {
    let mut rng = StdRng::from_entropy();
    let dir = std::env::temp_dir().join(format!("kvstore-rsp-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("rsp.safetensors");
    let sgd = Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    });
    let init: Vec<f32> = (0..24).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let push = |kv: &KvStore, rng: &mut StdRng| -> Result<()> {
        let g: Vec<f32> = (0..6).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let ids = vec![rng.gen_range(0..8), rng.gen_range(0..8)];
        kv.push_row_sparse("e", &[RowSparse::new(ids, NDArray::from_vec(g, [2, 3])?)?])?;
        Ok(())
    };
    let saved = KvStore::create("local")?;
    saved.init_row_sparse("e", &NDArray::from_vec(init.clone(), [8, 3])?)?;
    saved.set_updater(sgd.clone())?;
    push(&saved, &mut rng)?;
    saved.save(&path)?;
    let loaded = KvStore::create("device")?;
    loaded.set_updater(sgd.clone())?;
    loaded.load(&path)?;
    ensure!(loaded.is_row_sparse("e")?, "the load made the key dense");
    ensure!(matches!(
        loaded.push("e", &NDArray::zeros([8, 3])).unwrap_err(),
        Error::RowSparse { .. }
    ));
    let seed: u64 = rng.gen();
    let (mut a, mut b) = (StdRng::seed_from_u64(seed), StdRng::seed_from_u64(seed));
    for _ in 0..3 {
        push(&saved, &mut a)?;
        push(&loaded, &mut b)?;
    }
    let (x, y) = (NDArray::zeros([8, 3]), NDArray::zeros([8, 3]));
    saved.pull("e", &x)?;
    loaded.pull("e", &y)?;
    ensure!(
        x.to_vec::<f32>()? == y.to_vec::<f32>()?,
        "the loaded store went another way"
    );
    let dense = KvStore::create("local")?;
    dense.init("e", &NDArray::zeros([8, 3]))?;
    let err = dense.load(&path).unwrap_err();
    ensure!(
        matches!(&err, Error::Checkpoint { kind, .. } if *kind == kvstore::CheckpointErrorKind::Mismatch),
        "{err}"
    );
    ensure!(!dense.is_row_sparse("e")?);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A load cannot add a row-sparse key where `init_row_sparse` would refuse one: into a store
/// with gradient compression it is a Mismatch, and the store stays empty.
#[test]
fn a_load_cannot_add_a_row_sparse_key_to_a_compressed_store() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("kvstore-rsp-compress-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("rsp.safetensors");
    let saved = KvStore::create("local")?;
    saved.init_row_sparse(0, &NDArray::ones([4, 2]))?;
    saved.save(&path)?;
    let kv = KvStore::create("device")?;
    kv.set_gradient_compression(kvstore::Compression::two_bit(0.5))?;
    let err = kv.load(&path).unwrap_err();
    ensure!(
        matches!(&err, Error::Checkpoint { kind, .. } if *kind == kvstore::CheckpointErrorKind::Mismatch),
        "{err}"
    );
    ensure!(kv.keys().is_empty(), "the refused load added a key");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

//! 2-bit gradient compression against MXNet 1.9.1's own results (`tests/fixtures/mxnet_2bit.json`,
//! written by `tests/fixtures/make_mxnet_2bit.py` with MXNet run on this machine), bit for bit,
//! and the rules on when compression can be set.
//!
//! Each fixture case pushes the same values from the same number of devices into a `device`
//! store with the same threshold, and pulls after every step. Without an updater the pulled sum
//! must equal MXNet's to the last bit; through SGD (MXNet's `sgd_mom_update` kernel orders its
//! float operations its own way) to within 1e-6.

use anyhow::{bail, ensure, Context, Result};
use kvstore::{
    cpu, gpu, gpu_count, Compression, DType, Device, Error, KvStore, NDArray, Sgd, Shape, Updater,
};
use serde_json::Value;

fn fixture() -> Result<Value> {
    let text = include_str!("fixtures/mxnet_2bit.json");
    Ok(serde_json::from_str(text)?)
}

fn floats(v: &Value) -> Result<Vec<f32>> {
    v.as_array()
        .context("a list of float32 bit patterns")?
        .iter()
        .map(|b| Ok(f32::from_bits(b.as_u64().context("a bit pattern")? as u32)))
        .collect()
}

fn shape(v: &Value) -> Result<Shape> {
    let dims = v
        .as_array()
        .context("a shape")?
        .iter()
        .map(|d| Ok(d.as_u64().context("a dimension")? as usize))
        .collect::<Result<Vec<usize>>>()?;
    Ok(Shape::new(&dims)?)
}

/// Runs every case with the key homed on `home` and device `d`'s values on `device(d)`.
fn every_case(home: Device, device: impl Fn(usize) -> Device) -> Result<()> {
    let fx = fixture()?;
    ensure!(fx["mxnet"] == "1.9.1", "the fixture comes from MXNet 1.9.1");
    let cases = fx["cases"].as_array().context("cases")?;
    ensure!(cases.len() >= 10, "the fixture has its cases");
    for (c, case) in cases.iter().enumerate() {
        let t = f32::from_bits(case["threshold_bits"].as_u64().context("threshold")? as u32);
        let shape = shape(&case["shape"])?;
        let kv = KvStore::create("device")?;
        kv.set_gradient_compression(Compression::two_bit(t))?;
        let exact = case["optimizer"].is_null();
        if !exact {
            let o = &case["optimizer"];
            kv.set_updater(Updater::Sgd(Sgd {
                lr: o["learning_rate"].as_f64().context("lr")?,
                momentum: o["momentum"].as_f64().context("momentum")?,
                wd: o["wd"].as_f64().context("wd")?,
                rescale_grad: o["rescale_grad"].as_f64().context("rescale_grad")?,
                ..Sgd::default()
            }))?;
        }
        let init = NDArray::from_vec(floats(&case["init"])?, shape)?;
        kv.init_on(0, &init, home)?;
        let steps = case["steps"].as_array().context("steps")?;
        let pulled = case["pulled"].as_array().context("pulled")?;
        for (s, (values, want)) in steps.iter().zip(pulled).enumerate() {
            let values = values
                .as_array()
                .context("values")?
                .iter()
                .enumerate()
                .map(|(d, v)| Ok(NDArray::from_vec_on(floats(v)?, shape, device(d))?))
                .collect::<Result<Vec<_>>>()?;
            kv.push(0, &values)?;
            let out = NDArray::full(shape, 0.0);
            kv.pull(0, &out)?;
            let got = out.to_vec::<f32>()?;
            for (i, (g, w)) in got.iter().zip(floats(want)?).enumerate() {
                let same = if exact {
                    g.to_bits() == w.to_bits()
                } else {
                    (g - w).abs() <= 1e-6 * w.abs().max(1.0)
                };
                if !same {
                    bail!("case {c} (t = {t}, shape {shape:?}), step {s}, element {i}: {g} vs MXNet's {w}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn two_bit_pushes_match_mxnet_bit_for_bit() -> Result<()> {
    every_case(cpu(0), cpu)
}

/// The same cases with the key on gpu(0) and the values on the GPUs in turn.
#[test]
#[ignore = "needs a GPU"]
fn two_bit_pushes_on_gpus_match_mxnet_bit_for_bit() -> Result<()> {
    assert!(gpu_count() > 0, "this test needs a GPU and none was found");
    let n = gpu_count();
    every_case(gpu(0), |d| gpu(d % n))
}

/// What cannot be compressed is refused with an `Error::Compression` that says what to do, and
/// the store is left as it was.
#[test]
fn compression_is_refused_where_it_cannot_apply() -> Result<()> {
    let expect = |r: kvstore::Result<()>, what: &str, says: &str| -> Result<()> {
        match r {
            Err(e @ Error::Compression { .. }) => {
                ensure!(e.to_string().contains(says), "{what}: {e}");
                Ok(())
            }
            other => bail!("{what}: expected a compression error, got {other:?}"),
        }
    };
    for kind in ["local", "nccl"] {
        let kv = KvStore::create(kind)?;
        expect(
            kv.set_gradient_compression(Compression::two_bit(0.5)),
            kind,
            "create the store as 'device'",
        )?;
        ensure!(kv.gradient_compression() == Compression::None);
    }
    let kv = KvStore::create("device")?;
    for t in [0.0, -1.0, f32::NAN] {
        expect(
            kv.set_gradient_compression(Compression::two_bit(t)),
            "threshold",
            "greater than 0",
        )?;
    }
    ensure!(kv.gradient_compression() == Compression::None);
    kv.init(1, &NDArray::zeros([3]))?;
    expect(
        kv.set_gradient_compression(Compression::two_bit(0.5)),
        "after init",
        "before the first init",
    )?;
    ensure!(kv.gradient_compression() == Compression::None);

    let kv = KvStore::create("device")?;
    kv.set_gradient_compression(Compression::two_bit(0.25))?;
    expect(
        kv.init(2, &NDArray::zeros([3]).astype(DType::F16)?),
        "float16 key",
        "must be float32",
    )?;
    ensure!(kv.keys().is_empty(), "the refused init added no key");
    Ok(())
}

/// A push that fails keeps the residuals as they were: the same push again sends what the
/// first would have.
#[test]
fn a_failed_push_leaves_the_residuals_as_they_were() -> Result<()> {
    let kv = KvStore::create("device")?;
    kv.set_gradient_compression(Compression::two_bit(0.5))?;
    kv.init(0, &NDArray::zeros([4]))?;
    kv.set_updater(Updater::custom(|_key, _input, _stored| {
        panic!("this updater fails")
    }))?;
    let g = NDArray::from_vec(vec![0.3f32, -0.3, 0.7, 0.1], [4])?;
    ensure!(kv.push(0, &g).is_err(), "the push fails in the updater");
    kv.set_updater(Updater::Assign)?;
    kv.push(0, &g)?;
    let out = NDArray::zeros([4]);
    kv.pull(0, &out)?;
    // Had the failed push kept its residuals (0.3, -0.3, 0.2, 0.1), this one would send
    // 0.5, -0.5, 0.5, 0: it sends what a first push does.
    ensure!(
        out.to_vec::<f32>()? == [0.0, 0.0, 0.5, 0.0],
        "{:?}",
        out.to_vec::<f32>()?
    );
    Ok(())
}

/// A checkpoint carries the residuals: a store that loads it continues bit for bit as the one
/// that saved it (values below the threshold, which only the residuals remember, reach the
/// value in the next pushes), for the 2-bit and the 16-bit wires, with two devices' residuals.
#[test]
fn a_checkpoint_carries_the_residuals() -> Result<()> {
    use rand::prelude::*;
    let mut rng = StdRng::from_entropy();
    let dir = std::env::temp_dir().join(format!("kvstore-residuals-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for (i, c) in [
        Compression::two_bit(0.5),
        Compression::bf16(),
        Compression::fp16(),
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.join(format!("c{i}.safetensors"));
        let grads = |rng: &mut StdRng| -> Result<Vec<NDArray>> {
            (0..2)
                .map(|_| {
                    let g: Vec<f32> = (0..40).map(|_| rng.gen_range(-0.45..0.45)).collect();
                    Ok(NDArray::from_vec(g, [40])?)
                })
                .collect()
        };
        let saved = KvStore::create("device")?;
        saved.set_gradient_compression(c)?;
        saved.init(0, &NDArray::zeros([40]))?;
        saved.push(0, &grads(&mut rng)?)?;
        saved.save(&path)?;
        let loaded = KvStore::create("device")?;
        loaded.set_gradient_compression(c)?;
        loaded.load(&path)?;
        // `forgot` has the saved value but no residuals: what a load without them would be.
        let out = NDArray::zeros([40]);
        saved.pull(0, &out)?;
        let forgot = KvStore::create("device")?;
        forgot.set_gradient_compression(c)?;
        forgot.init(0, &out)?;
        for _ in 0..4 {
            let g = grads(&mut rng)?;
            saved.push(0, &g)?;
            loaded.push(0, &g)?;
            forgot.push(0, &g)?;
        }
        let (a, b, f) = (
            NDArray::zeros([40]),
            NDArray::zeros([40]),
            NDArray::zeros([40]),
        );
        saved.pull(0, &a)?;
        loaded.pull(0, &b)?;
        forgot.pull(0, &f)?;
        let (a, b, f) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?, f.to_vec::<f32>()?);
        ensure!(
            a.iter()
                .map(|x| x.to_bits())
                .eq(b.iter().map(|x| x.to_bits())),
            "{c:?}: the loaded store went another way"
        );
        ensure!(
            a != f,
            "{c:?}: residuals made no difference, so the test shows nothing"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A `device` store's list pushes whose number of values changes from push to push: each
/// position keeps its own residual, also through the pushes that leave it out (3 values, then
/// 1, then 3 again: positions 1 and 2 carry their residuals across). Fresh random values,
/// against a reference of MXNet's 2-bit rule written here.
#[test]
fn a_position_a_push_leaves_out_keeps_its_residual() -> Result<()> {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (t, n) = (0.5f32, 37);
    let kv = KvStore::create("device")?;
    kv.set_gradient_compression(Compression::two_bit(t))?;
    kv.init(0, &NDArray::zeros([n]))?;
    let mut residual: Vec<Vec<f32>> = Vec::new();
    for count in [2usize, 1, 3, 1, 2, 1, 3] {
        let values: Vec<Vec<f32>> = (0..count)
            .map(|_| (0..n).map(|_| rng.gen_range(-0.75f32..0.75)).collect())
            .collect();
        if residual.len() < count {
            residual.resize(count, vec![0.0; n]);
        }
        // The reference: each value plus its position's residual, quantized to ±t or 0, the
        // rest kept; the quantized values summed in list order (the default updater assigns).
        let mut want = vec![0f32; n];
        for (p, v) in values.iter().enumerate() {
            for i in 0..n {
                let acc = residual[p][i] + v[i];
                let sent = match acc {
                    a if a >= t => t,
                    a if a <= -t => -t,
                    _ => 0.0,
                };
                residual[p][i] = acc - sent;
                want[i] = if p == 0 { sent } else { want[i] + sent };
            }
        }
        let arrays: Vec<NDArray> = values
            .iter()
            .map(|v| NDArray::from_vec(v.clone(), [n]))
            .collect::<kvstore::Result<_>>()?;
        kv.push(0, &arrays)?;
        let out = NDArray::zeros([n]);
        kv.pull(0, &out)?;
        ensure!(
            out.to_vec::<f32>()? == want,
            "seed {seed}: a push of {count} values pulled {:?}, want {want:?}",
            out.to_vec::<f32>()?
        );
    }
    Ok(())
}

/// A store that compresses refuses a checkpoint's key that is not float32, as its init would,
/// with an error that says what to do, and holds nothing after.
#[test]
fn a_compressing_store_refuses_to_load_a_key_that_is_not_float32() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("kvstore-cmp-f16-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("f16.safetensors");
    let saved = KvStore::create("local")?;
    let v: Vec<f32> = (0..12).map(|i| i as f32 / 8.0 - 0.7).collect();
    saved.init(0, &NDArray::from_vec(v, [12])?.astype(kvstore::DType::F16)?)?;
    saved.save(&path)?;
    let kv = KvStore::create("device")?;
    kv.set_gradient_compression(Compression::two_bit(0.5))?;
    let e = kv.load(&path).unwrap_err();
    let text = e.to_string();
    ensure!(
        text.contains("float32") && text.contains("without gradient compression"),
        "{text}"
    );
    ensure!(kv.keys().is_empty(), "a refused load left keys");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

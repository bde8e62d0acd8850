//! The store's behaviours re-run with values homed on GPUs.
//!
//! Every test is `#[ignore = "needs a GPU"]` and first asserts that a GPU exists, so running
//! `--include-ignored` on a machine without one fails loudly instead of passing. A test that
//! cannot run its case here (one GPU where it needs two, NCCL without multi-rank support)
//! prints a line starting with `SKIPPED:`; `scripts/gpu-check.sh` counts those apart from the
//! passes.

mod common;

use anyhow::{ensure, Result};
use kvstore::__internal::gpu_sm;
use kvstore::__internal::nccl::{self, MultiRank};
use kvstore::gpu_count;
use kvstore::{cpu, gpu, Adam, DType, Device, Error, KvStore, NDArray, RowSparse, Sgd, Updater};
use rand::Rng;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn require_gpu() {
    assert!(
        gpu_count() > 0,
        "this test needs a GPU and none was found (libcuda missing or no device)"
    );
}

/// Says that `test` could not run its case here. The line starts a line of its own even when
/// the harness has just printed `test name ... ` (with `--nocapture`), so scripts count it.
fn skipped(test: &str, why: &str) {
    println!("\nSKIPPED: {test}: {why}");
}

/// Fresh random values in [-1, 1), never all zeros.
fn random(n: usize) -> Vec<f32> {
    let mut rng = rand::thread_rng();
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// An array of `dtype` on `device` holding `data` (rounded to the dtype).
fn array(data: &[f32], dims: &[usize], dtype: DType, device: Device) -> Result<NDArray> {
    let a = NDArray::from_vec(data.to_vec(), kvstore::Shape::new(dims)?)?.astype(dtype)?;
    Ok(a.to_device(device)?)
}

/// The values as the dtype rounds them, widened to f64.
fn rounded(data: &[f32], dtype: DType) -> Result<Vec<f64>> {
    Ok(NDArray::from_vec(data.to_vec(), [data.len()])?
        .astype(dtype)?
        .to_vec::<f64>()?)
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(
            err <= tol,
            "{what}: element {i}: got {g}, want {w} (relative error {err:e} > {tol:e})"
        );
    }
}

/// Whether every GPU runs `dtype`'s kernels: bf16's need compute capability 8.0 (sm_80). On
/// the stand-in the architecture is `KVSTORE_STANDIN_SM`, which CI sets to 70, 80 and 90.
fn runs_kernels(dtype: DType) -> bool {
    dtype != DType::BF16 || (0..gpu_count()).all(|i| gpu_sm(i).expect("the GPU opens") >= 80)
}

/// The architecture of the oldest GPU, as major * 10 + minor.
fn oldest_sm() -> u32 {
    (0..gpu_count())
        .map(|i| gpu_sm(i).expect("the GPU opens"))
        .min()
        .expect("a GPU")
}

/// Checks that `r`, a push of a key of `dtype` whose kernels the GPUs cannot run, failed with
/// the typed error that names both architectures (and, where given, the key).
fn assert_refused_below_arch<T: std::fmt::Debug>(
    r: Result<T>,
    dtype: DType,
    key: Option<kvstore::Key>,
) {
    let err = r.expect_err("a push needing kernels this GPU cannot run must fail");
    let have = oldest_sm();
    match err.downcast_ref::<Error>() {
        Some(
            e @ Error::GpuArch {
                need: 80,
                have: h,
                key: k,
                ..
            },
        ) if *h == have && (key.is_none() || *k == key) => {
            let text = e.to_string();
            assert!(
                text.contains(&format!("sm_{have}"))
                    && text.contains("sm_80")
                    && text.contains(&dtype.to_string()),
                "the message names both architectures and the dtype: {text}"
            );
        }
        _ => panic!("expected Error::GpuArch (needs sm_80, gpu is sm_{have}), got {err:?}"),
    }
}

/// Whether the test-only `KVSTORE_TEST_GPU_MAP` puts two of the store's GPUs on one physical
/// GPU (the lent one-GPU machine's multi-device run).
fn on_one_physical_gpu() -> bool {
    let map = kvstore::__internal::probe::gpu_map().expect("a valid KVSTORE_TEST_GPU_MAP");
    map.is_some_and(|m| m.len() >= 2 && m.iter().all(|&o| o == m[0]))
}

/// Whether `NCCL_MULTI_RANK_GPU_ENABLE=1` (several NCCL ranks on one GPU, NCCL >= 2.30).
fn multi_rank_enabled() -> bool {
    std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").as_deref() == Ok("1")
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        DType::F16 | DType::BF16 => 1e-2,
    }
}

#[test]
#[ignore = "needs a GPU"]
fn init_push_pull_on_gpu0_home() -> Result<()> {
    require_gpu();
    let kv = KvStore::create("device")?;
    let n = 1000;
    let init = random(n);
    kv.init_on(3, &array(&init, &[10, 100], DType::F32, cpu(0))?, gpu(0))?;
    assert_eq!(kv.meta(3)?.2, gpu(0));

    // Pull straight after init, to the GPU and the host.
    let out_gpu = NDArray::full_on([10, 100], f64::NAN, DType::F32, gpu(0))?;
    let out_cpu = NDArray::full_on([10, 100], f64::NAN, DType::F32, cpu(0))?;
    kv.pull(3, &[out_gpu.clone(), out_cpu.clone()])?;
    let want: Vec<f64> = init.iter().map(|&x| f64::from(x)).collect();
    assert_close(&out_gpu.to_vec()?, &want, 0.0, "pull after init (gpu out)");
    assert_close(&out_cpu.to_vec()?, &want, 0.0, "pull after init (cpu out)");

    // One value on the home GPU: assign.
    let v = random(n);
    kv.push(3, &array(&v, &[10, 100], DType::F32, gpu(0))?)?;
    kv.pull(3, &out_cpu)?;
    let want: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
    assert_close(&out_cpu.to_vec()?, &want, 0.0, "push of one gpu value");
    kv.wait_all()?;
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn several_values_on_one_gpu_are_summed() -> Result<()> {
    require_gpu();
    for kind in ["device", "nccl"] {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let kv = KvStore::create(kind)?;
            let n = 4099; // not a multiple of the vector width or the chunk
            kv.init(7, &NDArray::full_on([n], 0.5, dtype, cpu(0))?)?;
            let data: Vec<Vec<f32>> = (0..4).map(|_| random(n)).collect();
            let values = data
                .iter()
                .map(|d| array(d, &[n], dtype, gpu(0)))
                .collect::<Result<Vec<_>>>()?;
            // The same array twice counts twice.
            let mut pushed = values.clone();
            pushed.push(values[0].clone());
            if !runs_kernels(dtype) {
                assert_refused_below_arch(kv.push(7, &pushed).map_err(Into::into), dtype, None);
                continue;
            }
            kv.push(7, &pushed)?;
            let out = NDArray::full_on([n], f64::NAN, dtype, gpu(0))?;
            kv.pull(7, &out)?;
            let mut want = vec![0.0f64; n];
            for d in data.iter().chain(std::iter::once(&data[0])) {
                for (w, x) in want.iter_mut().zip(rounded(d, dtype)?) {
                    *w += x;
                }
            }
            if dtype != DType::F64 {
                want = rounded(&want.iter().map(|&x| x as f32).collect::<Vec<_>>(), dtype)?;
            }
            assert_close(
                &out.to_vec()?,
                &want,
                tol(dtype) * 5.0,
                &format!("{kind} {dtype}"),
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn values_on_cpu_and_gpus_mixed() -> Result<()> {
    require_gpu();
    let gpus = gpu_count();
    for kind in ["device", "nccl"] {
        let kv = KvStore::create(kind)?;
        let n = 3000;
        kv.init("w", &NDArray::zeros([n]))?;
        let mut devices = vec![cpu(0), cpu(1), gpu(0), gpu(0)];
        if gpus > 1 {
            devices.extend([gpu(1), gpu(1), gpu(gpus - 1)]);
        } else {
            skipped(
                "values_on_cpu_and_gpus_mixed",
                &format!("{kind}: one GPU, so no cross-GPU sum is exercised"),
            );
        }
        let data: Vec<Vec<f32>> = devices.iter().map(|_| random(n)).collect();
        let values = data
            .iter()
            .zip(&devices)
            .map(|(d, &dev)| array(d, &[n], DType::F32, dev))
            .collect::<Result<Vec<_>>>()?;
        kv.push("w", &values)?;
        let outs = devices
            .iter()
            .map(|&dev| NDArray::full_on([n], f64::NAN, DType::F32, dev))
            .collect::<kvstore::Result<Vec<_>>>()?;
        kv.pull("w", &outs)?;
        let want: Vec<f64> = (0..n)
            .map(|i| data.iter().map(|d| f64::from(d[i])).sum())
            .collect();
        for (o, dev) in outs.iter().zip(&devices) {
            assert_close(&o.to_vec()?, &want, 1e-5, &format!("{kind} out on {dev}"));
        }
        kv.wait_all()?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn pull_converts_dtype_from_gpu_home() -> Result<()> {
    require_gpu();
    let kv = KvStore::create("device")?;
    let n = 777;
    let init = random(n);
    kv.init_on(1, &array(&init, &[n], DType::F32, cpu(0))?, gpu(0))?;
    let outs = [
        NDArray::full_on([n], f64::NAN, DType::F16, gpu(0))?,
        NDArray::full_on([n], f64::NAN, DType::BF16, cpu(0))?,
        NDArray::full_on([n], f64::NAN, DType::F64, gpu(0))?,
    ];
    kv.pull(1, &outs)?;
    for o in &outs {
        let want = rounded(&init, o.dtype())?;
        assert_close(&o.to_vec()?, &want, 0.0, &format!("pull to {}", o.dtype()));
    }
    Ok(())
}

/// 2 and 4 NCCL ranks on one GPU (NCCL >= 2.30 with `NCCL_MULTI_RANK_GPU_ENABLE=1`), with
/// non-blocking communicators: reduce and broadcast to and from every root.
#[test]
#[ignore = "needs a GPU"]
fn nccl_reduce_and_broadcast_over_2_and_4_ranks_on_one_gpu() -> Result<()> {
    require_gpu();
    for nranks in [2, 4] {
        let ranks = match MultiRank::new(0, nranks) {
            Ok(r) => r,
            Err(e) => {
                skipped(
                    "nccl_reduce_and_broadcast_over_2_and_4_ranks_on_one_gpu",
                    &format!("{nranks} ranks, NCCL version {:?}: {e}", nccl::version()),
                );
                return Ok(());
            }
        };
        ensure!(ranks.nranks() == nranks);
        let n = 10_000;
        let sends: Vec<Vec<f32>> = (0..nranks).map(|_| random(n)).collect();
        for root in 0..nranks {
            let got = ranks.reduce_f32(&sends, root)?;
            let want: Vec<f64> = (0..n)
                .map(|i| sends.iter().map(|s| f64::from(s[i])).sum())
                .collect();
            let got: Vec<f64> = got.iter().map(|&x| f64::from(x)).collect();
            assert_close(
                &got,
                &want,
                1e-6,
                &format!("{nranks} ranks: reduce to {root}"),
            );
            let data = random(n);
            let all = ranks.broadcast_f32(&data, root)?;
            ensure!(all.len() == nranks, "every rank answers");
            for (r, got) in all.iter().enumerate() {
                ensure!(
                    got == &data,
                    "{nranks} ranks: broadcast from rank {root} to rank {r} differs"
                );
            }
        }
    }
    Ok(())
}

/// Runs this test binary's test `name` alone in a child process with `set` added to the
/// environment and `unset` removed (and `KVSTORE_TEST_CHILD=1`), killing it after `limit`.
/// Returns whether it passed, and its output.
fn run_child(
    name: &str,
    set: &[(&str, std::ffi::OsString)],
    unset: &[&str],
    limit: Duration,
) -> Result<(bool, String)> {
    let log = std::env::temp_dir().join(format!(
        "kvstore-child-{name}-{}-{}.log",
        std::process::id(),
        rand::random::<u32>()
    ));
    let out = std::fs::File::create(&log)?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args([
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("KVSTORE_TEST_CHILD", "1")
    .stdout(out.try_clone()?)
    .stderr(out);
    for k in unset {
        cmd.env_remove(k);
    }
    for (k, v) in set {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn()?;
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    match status {
        // A filter that matched nothing would exit 0 too: the test itself must have passed.
        Some(s) => Ok((s.success() && text.contains("1 passed"), text)),
        None => anyhow::bail!("the child test {name} was still running after {limit:?}:\n{text}"),
    }
}

fn in_child() -> bool {
    std::env::var("KVSTORE_TEST_CHILD").as_deref() == Ok("1")
}

/// What a child with `KVSTORE_NCCL_FORCE=1` checks: a `nccl` store sends every key through
/// NCCL, even with all values on the home GPU (one-rank communicators), so init, group,
/// reduce, broadcast, async-error polling and abort all run. Values from two GPUs too, where
/// there are two. Pulls into the home GPU come through the broadcast (the outs start as NaN).
fn forced_nccl_store_round() -> Result<()> {
    ensure!(nccl::force_single(), "KVSTORE_NCCL_FORCE=1 is set");
    ensure!(nccl::available(), "NCCL was found");
    let kv = KvStore::create("nccl")?;
    let n = 3000;
    let ngpu = gpu_count().min(2);
    let keys: Vec<i32> = (0..4).collect();
    let homes: Vec<Device> = keys.iter().map(|&k| gpu(k as usize % ngpu)).collect();
    let inits = keys
        .iter()
        .map(|_| NDArray::full_on([n], 0.0, DType::F32, cpu(0)))
        .collect::<kvstore::Result<Vec<_>>>()?;
    kv.init_list_on(&keys, &inits, &homes)?;
    for round in 0..2 {
        // Two values on the home GPU and one on the host, per key.
        let data: Vec<[Vec<f32>; 3]> = keys
            .iter()
            .map(|_| [random(n), random(n), random(n)])
            .collect();
        let values = data
            .iter()
            .zip(&homes)
            .map(|(d, &h)| {
                Ok(vec![
                    array(&d[0], &[n], DType::F32, h)?,
                    array(&d[1], &[n], DType::F32, h)?,
                    array(&d[2], &[n], DType::F32, cpu(0))?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let before = nccl::collectives_issued();
        kv.push_list(&keys, &values)?;
        let pushed = nccl::collectives_issued() - before;
        ensure!(
            pushed == keys.len() as u64,
            "one NCCL reduce per key, got {pushed}"
        );
        let outs = homes
            .iter()
            .map(|&h| {
                Ok(vec![
                    NDArray::full_on([n], f64::NAN, DType::F32, h)?,
                    NDArray::full_on([n], f64::NAN, DType::F32, gpu(ngpu - 1))?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        kv.pull_list(&keys, &outs)?;
        let pulled = nccl::collectives_issued() - before - pushed;
        ensure!(
            pulled == keys.len() as u64,
            "one NCCL broadcast per key, got {pulled}"
        );
        kv.wait_all()?;
        for (k, (d, o)) in data.iter().zip(&outs).enumerate() {
            let want: Vec<f64> = (0..n)
                .map(|i| f64::from(d[0][i] + d[1][i] + d[2][i]))
                .collect();
            for out in o {
                assert_close(
                    &out.to_vec()?,
                    &want,
                    1e-6,
                    &format!("round {round}, key {k}"),
                );
            }
        }
        let sets = nccl::cached_sets();
        ensure!(
            sets.contains(&vec![0]),
            "a one-rank communicator on gpu 0: {sets:?}"
        );
        // Abort every communicator: the next round builds them afresh.
        nccl::abort_all();
        ensure!(nccl::cached_sets().is_empty());
    }
    Ok(())
}

/// On any number of GPUs, a `nccl` store with `KVSTORE_NCCL_FORCE=1` runs every NCCL call it
/// makes for real (see [`forced_nccl_store_round`]); run in a child process, since the switch
/// is read once per process.
#[test]
#[ignore = "needs a GPU"]
fn nccl_store_forced_onto_one_rank_communicators() -> Result<()> {
    require_gpu();
    if in_child() {
        return forced_nccl_store_round();
    }
    if !nccl::available() {
        skipped(
            "nccl_store_forced_onto_one_rank_communicators",
            "no usable NCCL (>= 2.14) was found",
        );
        return Ok(());
    }
    let (ok, out) = run_child(
        "nccl_store_forced_onto_one_rank_communicators",
        &[("KVSTORE_NCCL_FORCE", "1".into())],
        &[],
        Duration::from_secs(300),
    )?;
    ensure!(ok, "the forced NCCL round failed:\n{out}");
    Ok(())
}

/// NCCL is found where pip puts it, as `libnccl.so.2` only: a child process sees no NCCL on
/// `LD_LIBRARY_PATH` (every folder holding one is shadowed by a copy without it), only
/// `<venv>/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2` (a link to this
/// process's NCCL) under `VIRTUAL_ENV`; it must load that file and run the forced NCCL round.
#[test]
#[ignore = "needs a GPU"]
fn nccl_is_found_as_pip_libnccl_so_2() -> Result<()> {
    require_gpu();
    if in_child() {
        let want = std::env::var_os("KVSTORE_TEST_EXPECT_NCCL").expect("set by the parent");
        ensure!(
            nccl::library_path() == Some(want.clone().into()),
            "loaded {:?}, expected {want:?}",
            nccl::library_path()
        );
        return forced_nccl_store_round();
    }
    let Some(found) = nccl::library_path() else {
        skipped(
            "nccl_is_found_as_pip_libnccl_so_2",
            "no usable NCCL was found",
        );
        return Ok(());
    };
    let real = std::fs::canonicalize(&found)?;
    let root = std::env::temp_dir().join(format!(
        "kvstore-pip-nccl-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let lib_dir = root.join("venv/lib/python3.11/site-packages/nvidia/nccl/lib");
    std::fs::create_dir_all(&lib_dir)?;
    let pip_lib = lib_dir.join("libnccl.so.2");
    std::os::unix::fs::symlink(&real, &pip_lib)?;
    // LD_LIBRARY_PATH with every NCCL hidden: a folder holding one is replaced by a folder of
    // links to everything else in it (the stand-in's libcuda.so lives beside its libnccl.so).
    let mut dirs = Vec::new();
    for (i, d) in
        std::env::split_paths(&std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default()).enumerate()
    {
        let has_nccl = std::fs::read_dir(&d)
            .map(|es| {
                es.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("libnccl"))
            })
            .unwrap_or(false);
        if !has_nccl {
            dirs.push(d);
            continue;
        }
        let shadow = root.join(format!("ld{i}"));
        std::fs::create_dir_all(&shadow)?;
        for e in std::fs::read_dir(&d)?.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().starts_with("libnccl") {
                std::os::unix::fs::symlink(std::fs::canonicalize(e.path())?, shadow.join(&name))?;
            }
        }
        dirs.push(shadow);
    }
    let ld = std::env::join_paths(&dirs)?;
    let result = run_child(
        "nccl_is_found_as_pip_libnccl_so_2",
        &[
            ("LD_LIBRARY_PATH", ld),
            ("VIRTUAL_ENV", root.join("venv").into()),
            ("HOME", root.clone().into()),
            ("KVSTORE_NCCL_FORCE", "1".into()),
            ("KVSTORE_TEST_EXPECT_NCCL", pip_lib.clone().into()),
        ],
        &["KVSTORE_NCCL_LIB", "CONDA_PREFIX", "PYTHONPATH"],
        Duration::from_secs(300),
    );
    let _ = std::fs::remove_dir_all(&root);
    let (ok, out) = result?;
    ensure!(
        ok,
        "the child did not find or use pip's libnccl.so.2:\n{out}"
    );
    Ok(())
}

/// With at most one cached device set (`KVSTORE_NCCL_MAX_COMMS=1`), a forced `nccl` store
/// alternating between sets evicts (finalizes and destroys) the least recently used one each
/// time, and stays correct.
#[test]
#[ignore = "needs a GPU"]
fn nccl_communicator_cache_is_bounded() -> Result<()> {
    require_gpu();
    if in_child() {
        let kv = KvStore::create("nccl")?;
        let n = 1000;
        let ngpu = gpu_count().min(2);
        kv.init_on(0, &NDArray::full_on([n], 0.0, DType::F32, cpu(0))?, gpu(0))?;
        kv.init_on(
            1,
            &NDArray::full_on([n], 0.0, DType::F32, cpu(0))?,
            gpu(ngpu - 1),
        )?;
        for round in 0..3 {
            for (key, from) in [(0, gpu(0)), (1, gpu(ngpu - 1)), (0, gpu(ngpu - 1))] {
                let data = random(n);
                kv.push(key, &array(&data, &[n], DType::F32, from)?)?;
                let out = NDArray::full_on([n], f64::NAN, DType::F32, cpu(0))?;
                kv.pull(key, &out)?;
                kv.wait_all()?;
                assert_close(
                    &out.to_vec()?,
                    &rounded(&data, DType::F32)?,
                    0.0,
                    &format!("round {round}, key {key}"),
                );
                // Three sets take turns ([0], [1], [0, 1] on two GPUs); the bound is 1, plus
                // a set still busy when the next was built (it is never destroyed in use).
                let sets = nccl::cached_sets();
                ensure!(sets.len() <= 2, "the cache is bounded: {sets:?}");
            }
        }
        return Ok(());
    }
    if !nccl::available() {
        skipped(
            "nccl_communicator_cache_is_bounded",
            "no usable NCCL was found",
        );
        return Ok(());
    }
    let (ok, out) = run_child(
        "nccl_communicator_cache_is_bounded",
        &[
            ("KVSTORE_NCCL_FORCE", "1".into()),
            ("KVSTORE_NCCL_MAX_COMMS", "1".into()),
        ],
        &[],
        Duration::from_secs(300),
    )?;
    ensure!(ok, "the bounded-cache child failed:\n{out}");
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn nccl_store_across_gpus() -> Result<()> {
    require_gpu();
    if gpu_count() < 2 {
        skipped(
            "nccl_store_across_gpus",
            "one GPU: no cross-GPU sum (nccl_store_forced_onto_one_rank_communicators runs the store's NCCL calls on one GPU)",
        );
        return Ok(());
    }
    let kv = KvStore::create("nccl")?;
    let n = 1 << 16;
    let issued = nccl::collectives_issued();
    // Keys on each GPU, pushed from every GPU in a list push.
    let keys: Vec<i32> = (0..4).collect();
    let homes: Vec<Device> = keys.iter().map(|&k| gpu(k as usize % 2)).collect();
    let inits = keys
        .iter()
        .map(|_| NDArray::full_on([n], 0.0, DType::F32, cpu(0)))
        .collect::<kvstore::Result<Vec<_>>>()?;
    kv.init_list_on(&keys, &inits, &homes)?;
    let data: Vec<Vec<Vec<f32>>> = keys.iter().map(|_| vec![random(n), random(n)]).collect();
    let values = data
        .iter()
        .map(|d| {
            Ok(vec![
                array(&d[0], &[n], DType::F32, gpu(0))?,
                array(&d[1], &[n], DType::F32, gpu(1))?,
            ])
        })
        .collect::<Result<Vec<_>>>()?;
    kv.push_list(&keys, &values)?;
    let outs = keys
        .iter()
        .map(|_| {
            Ok(vec![
                NDArray::full_on([n], f64::NAN, DType::F32, gpu(0))?,
                NDArray::full_on([n], f64::NAN, DType::F32, gpu(1))?,
            ])
        })
        .collect::<Result<Vec<_>>>()?;
    kv.pull_list(&keys, &outs)?;
    kv.wait_all()?;
    // Two of the store's GPUs on one physical GPU (KVSTORE_TEST_GPU_MAP=0,0, the lent machine's
    // run): the sums and broadcasts must have gone through NCCL's two ranks on that GPU, not
    // peer copies, wherever that NCCL allows it.
    if on_one_physical_gpu() && nccl::version().unwrap_or(0) >= 23000 && multi_rank_enabled() {
        let used = nccl::collectives_issued() - issued;
        ensure!(
            used >= 8,
            "4 keys pushed and pulled over 2 devices: at least 8 NCCL collectives, got {used}"
        );
        println!(
            "nccl_store_across_gpus: {used} NCCL collectives, 2 ranks on one GPU (NCCL {:?})",
            nccl::version()
        );
    }
    for (k, (d, o)) in data.iter().zip(&outs).enumerate() {
        let want: Vec<f64> = (0..n)
            .map(|i| f64::from(d[0][i]) + f64::from(d[1][i]))
            .collect();
        for out in o {
            assert_close(&out.to_vec()?, &want, 1e-6, &format!("key {k}"));
        }
    }
    Ok(())
}

/// Runs the same pushes through a CPU store and a GPU-homed store; compares the results.
fn compare_with_cpu(updater: Updater, dtype: DType, steps: usize) -> Result<()> {
    let n = 5000;
    let cpu_kv = KvStore::create("local")?;
    let gpu_kv = KvStore::create("device")?;
    cpu_kv.set_updater(updater.clone())?;
    gpu_kv.set_updater(updater.clone())?;
    let init = random(n);
    cpu_kv.init(0, &array(&init, &[n], dtype, cpu(0))?)?;
    gpu_kv.init_on(0, &array(&init, &[n], dtype, cpu(0))?, gpu(0))?;
    for _ in 0..steps {
        let grads: Vec<Vec<f32>> = (0..3).map(|_| random(n)).collect();
        let on_cpu = grads
            .iter()
            .map(|g| array(g, &[n], dtype, cpu(0)))
            .collect::<Result<Vec<_>>>()?;
        let on_gpu = grads
            .iter()
            .map(|g| array(g, &[n], dtype, gpu(0)))
            .collect::<Result<Vec<_>>>()?;
        cpu_kv.push(0, &on_cpu)?;
        gpu_kv.push(0, &on_gpu)?;
    }
    let a = NDArray::full_on([n], f64::NAN, dtype, cpu(0))?;
    let b = NDArray::full_on([n], f64::NAN, dtype, gpu(0))?;
    cpu_kv.pull(0, &a)?;
    gpu_kv.pull(0, &b)?;
    assert_close(
        &b.to_vec()?,
        &a.to_vec()?,
        tol(dtype),
        &format!("{} {dtype}", updater.name()),
    );
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn sgd_and_adam_on_gpu_match_the_cpu_store() -> Result<()> {
    require_gpu();
    let sgd = Updater::Sgd(Sgd {
        lr: 0.1,
        wd: 0.01,
        rescale_grad: 0.5,
        clip_gradient: Some(0.8),
        ..Sgd::default()
    });
    let sgd_mom = Updater::Sgd(Sgd {
        lr: 0.05,
        momentum: 0.9,
        wd: 0.001,
        ..Sgd::default()
    });
    let adam = Updater::Adam(Adam {
        lr: 0.01,
        wd: 0.001,
        ..Adam::default()
    });
    let axpby = Updater::Axpby { a: 0.9, b: 0.25 };
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for u in [&sgd, &sgd_mom, &adam, &axpby, &Updater::Assign] {
            let r = compare_with_cpu(u.clone(), dtype, 3);
            if runs_kernels(dtype) {
                r?;
            } else {
                assert_refused_below_arch(r, dtype, None);
            }
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn list_push_of_300_small_keys() -> Result<()> {
    require_gpu();
    let kv = KvStore::create("device")?;
    let reference = KvStore::create("local")?;
    let u = Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.5,
        ..Sgd::default()
    });
    kv.set_updater(u.clone())?;
    reference.set_updater(u)?;
    let keys: Vec<i32> = (0..300).collect();
    let sizes: Vec<usize> = keys.iter().map(|&k| 1 + (k as usize * 37) % 700).collect();
    let inits: Vec<Vec<f32>> = sizes.iter().map(|&s| random(s)).collect();
    let cpu_inits = inits
        .iter()
        .map(|d| array(d, &[d.len()], DType::F32, cpu(0)))
        .collect::<Result<Vec<_>>>()?;
    kv.init_list(&keys, &cpu_inits)?;
    reference.init_list(&keys, &cpu_inits)?;
    for _ in 0..2 {
        let grads: Vec<Vec<Vec<f32>>> = sizes.iter().map(|&s| vec![random(s), random(s)]).collect();
        let on_gpu = grads
            .iter()
            .map(|g| {
                g.iter()
                    .map(|x| array(x, &[x.len()], DType::F32, gpu(0)))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let on_cpu = grads
            .iter()
            .map(|g| {
                g.iter()
                    .map(|x| array(x, &[x.len()], DType::F32, cpu(0)))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        kv.push_list(&keys, &on_gpu)?;
        reference.push_list(&keys, &on_cpu)?;
    }
    let outs = sizes
        .iter()
        .map(|&s| NDArray::full_on([s], f64::NAN, DType::F32, cpu(0)))
        .collect::<kvstore::Result<Vec<_>>>()?;
    let want = sizes
        .iter()
        .map(|&s| NDArray::full_on([s], f64::NAN, DType::F32, cpu(0)))
        .collect::<kvstore::Result<Vec<_>>>()?;
    kv.pull_list(&keys, &outs)?;
    reference.pull_list(&keys, &want)?;
    for (k, (o, w)) in outs.iter().zip(&want).enumerate() {
        assert_close(&o.to_vec()?, &w.to_vec()?, 1e-6, &format!("key {k}"));
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn custom_closure_on_a_gpu_key() -> Result<()> {
    require_gpu();
    let kv = KvStore::create("device")?;
    let n = 321;
    let init = random(n);
    kv.init_on(3, &array(&init, &[n], DType::F32, cpu(0))?, gpu(0))?;
    kv.set_updater(Updater::custom(|_key, input, stored| {
        *stored += input * 2.0;
    }))?;
    let a = random(n);
    let b = random(n);
    kv.push(
        3,
        &[
            array(&a, &[n], DType::F32, gpu(0))?,
            array(&b, &[n], DType::F32, cpu(0))?,
        ],
    )?;
    let out = NDArray::full_on([n], f64::NAN, DType::F32, gpu(0))?;
    kv.pull(3, &out)?;
    let want: Vec<f64> = (0..n)
        .map(|i| f64::from(init[i] + 2.0 * (a[i] + b[i])))
        .collect();
    assert_close(&out.to_vec()?, &want, 1e-6, "custom updater");

    // A panicking closure leaves the GPU value unchanged.
    kv.set_updater(Updater::custom(|_, _, _| panic!("boom")))?;
    let err = kv.push(3, &NDArray::ones([n])).unwrap_err();
    ensure!(matches!(err, Error::UpdaterPanicked { .. }), "got {err}");
    kv.pull(3, &out)?;
    assert_close(&out.to_vec()?, &want, 1e-6, "after a panicking updater");
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn homes_are_balanced_by_size() -> Result<()> {
    require_gpu();
    let gpus = gpu_count();
    let kv = KvStore::create("device")?;
    let sizes = [100usize, 4000, 250, 3000, 2000, 1000, 50, 1500];
    let keys: Vec<i32> = (0..sizes.len() as i32).collect();
    let values = sizes
        .iter()
        .map(|&s| NDArray::full_on([s], 1.0, DType::F32, cpu(0)))
        .collect::<kvstore::Result<Vec<_>>>()?;
    kv.init_list(&keys, &values)?;
    // Reference: largest first, each to the least-loaded GPU (lowest ordinal on ties).
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]));
    let mut load = vec![0usize; gpus];
    let mut want = vec![0usize; sizes.len()];
    for i in order {
        let g = (0..gpus).min_by_key(|&g| (load[g], g)).unwrap();
        load[g] += sizes[i] * 4;
        want[i] = g;
    }
    for (k, &w) in keys.iter().zip(&want) {
        assert_eq!(kv.meta(*k)?.2, gpu(w), "home of key {k}");
    }
    // A later single init goes to the least-loaded GPU.
    let least = (0..gpus).min_by_key(|&g| (load[g], g)).unwrap();
    kv.init(100, &NDArray::zeros([10]))?;
    assert_eq!(kv.meta(100)?.2, gpu(least));
    // A local store keeps the host home.
    let local = KvStore::create("local")?;
    local.init(1, &NDArray::zeros([10]))?;
    assert_eq!(local.meta(1)?.2, cpu(0));
    if gpus == 1 {
        skipped(
            "homes_are_balanced_by_size",
            "one GPU: every home is gpu(0)",
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs a GPU"]
fn errors_on_a_missing_gpu() -> Result<()> {
    require_gpu();
    let missing = gpu(gpu_count().max(7));
    let err = NDArray::full_on([2], 1.0, DType::F32, missing).unwrap_err();
    ensure!(matches!(err, Error::DeviceNotFound { .. }), "got {err}");
    let err = NDArray::ones([2]).to_device(missing).unwrap_err();
    ensure!(matches!(err, Error::DeviceNotFound { .. }), "got {err}");
    let kv = KvStore::create("nccl")?;
    let err = kv.init_on(1, &NDArray::ones([2]), missing).unwrap_err();
    ensure!(matches!(err, Error::DeviceNotFound { .. }), "got {err}");
    // Nothing was initialized; the store still works.
    kv.init(1, &NDArray::ones([2]))?;
    let out = NDArray::zeros([2]);
    kv.pull(1, &out)?;
    ensure!(out.to_vec::<f32>()? == vec![1.0, 1.0]);
    Ok(())
}

/// Keys and arrays with no elements: the driver refuses 0-byte allocations, so the GPU buffers
/// must not ask it for one. Every operation must succeed and leave the non-empty key alone.
#[test]
#[ignore = "needs a GPU"]
fn empty_arrays_on_a_gpu() -> Result<()> {
    require_gpu();
    for kind in ["device", "nccl"] {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let kv = KvStore::create(kind)?;
            kv.set_updater(Updater::Sgd(Sgd {
                lr: 0.1,
                momentum: 0.9,
                ..Sgd::default()
            }))?;
            let empty_gpu = NDArray::full_on([0, 3], 1.0, dtype, gpu(0))?;
            let empty_cpu = NDArray::full_on([0, 3], 1.0, dtype, cpu(0))?;
            assert_eq!(empty_gpu.to_vec::<f32>()?, Vec::<f32>::new());
            kv.init_on(1, &empty_cpu, gpu(0))?;
            let data = random(5);
            kv.init_on(2, &array(&data, &[5], dtype, cpu(0))?, gpu(0))?;
            let r = kv.push(
                1,
                &[empty_gpu.clone(), empty_cpu.clone(), empty_gpu.copy()?],
            );
            if !runs_kernels(dtype) {
                assert_refused_below_arch(r.map_err(Into::into), dtype, None);
                continue;
            }
            r?;
            kv.pull(1, &[empty_gpu.clone(), empty_cpu.clone()])?;
            empty_gpu.fill(2.0)?;
            assert_eq!(
                empty_gpu.to_device(cpu(0))?.to_vec::<f32>()?,
                Vec::<f32>::new()
            );
            kv.wait_all()?;
            let out = NDArray::full_on([5], f64::NAN, dtype, cpu(0))?;
            kv.pull(2, &out)?;
            assert_close(
                &out.to_vec()?,
                &rounded(&data, dtype)?,
                0.0,
                &format!("{kind} {dtype}"),
            );
        }
    }
    Ok(())
}

/// A collective that cannot complete (one of two ranks never joins) is aborted after the
/// timeout, with an error that says so, instead of hanging; the GPU stays usable.
#[test]
#[ignore = "needs a GPU"]
fn stalled_nccl_collective_is_aborted() -> Result<()> {
    require_gpu();
    if std::env::var("NCCL_LAUNCH_MODE").is_ok_and(|m| m.eq_ignore_ascii_case("group")) {
        skipped(
            "stalled_nccl_collective_is_aborted",
            "NCCL_LAUNCH_MODE=GROUP makes the group call itself wait for the missing rank",
        );
        return Ok(());
    }
    // The stall runs on its own thread (with its own communicators: they cannot move between
    // threads) so that, should the abort not end it, this test fails after a bound instead of
    // hanging the run.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut ranks = match MultiRank::new(0, 2) {
            Ok(r) => r,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        ranks.set_timeout(Duration::from_secs(2));
        let started = Instant::now();
        let stalled = ranks.stalled_reduce_f32(1 << 16);
        let took = started.elapsed();
        let after = ranks.reduce_f32(&[vec![1.0], vec![2.0]], 0);
        let _ = tx.send(Ok((stalled, took, after)));
    });
    let outcome = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the stalled collective was still hanging after 60 s: it was not aborted");
    let (stalled, took, after) = match outcome {
        Ok(o) => o,
        Err(e) => {
            skipped(
                "stalled_nccl_collective_is_aborted",
                &format!("NCCL version {:?}: {e}", nccl::version()),
            );
            return Ok(());
        }
    };
    match stalled {
        Err(Error::Nccl { message, .. }) => {
            ensure!(
                message.contains("no progress") && message.contains("aborted"),
                "the error says what happened: {message}"
            );
        }
        other => panic!("expected an NCCL timeout error, got {other:?}"),
    }
    ensure!(
        took >= Duration::from_secs(2),
        "it waited the timeout ({took:?})"
    );
    ensure!(
        matches!(after, Err(Error::Nccl { ref message, .. }) if message.contains("create a new")),
        "an aborted communicator refuses later calls: {after:?}"
    );

    // The GPU itself still works.
    let kv = KvStore::create("device")?;
    let data = random(1000);
    kv.init_on(1, &array(&data, &[1000], DType::F32, cpu(0))?, gpu(0))?;
    let out = NDArray::full_on([1000], f64::NAN, DType::F32, cpu(0))?;
    kv.pull(1, &out)?;
    assert_close(
        &out.to_vec()?,
        &rounded(&data, DType::F32)?,
        0.0,
        "pull after abort",
    );
    Ok(())
}

/// Host values pushed to a GPU-homed f16 or bf16 key are summed in f32 and rounded once, as on
/// the CPU home: after three SGD-momentum pushes of three host values each, the two homes
/// agree bit for bit.
#[test]
#[ignore = "needs a GPU"]
fn host_values_to_a_gpu_key_round_as_on_the_cpu_home() -> Result<()> {
    require_gpu();
    let n = 4099;
    for dtype in [DType::F16, DType::BF16] {
        let on_gpu = KvStore::create("device")?;
        let on_cpu = KvStore::create("local")?;
        let sgd = Updater::Sgd(Sgd {
            lr: 0.1,
            momentum: 0.9,
            ..Sgd::default()
        });
        let init = random(n);
        on_gpu.init_on(1, &array(&init, &[n], dtype, cpu(0))?, gpu(0))?;
        on_cpu.init(1, &array(&init, &[n], dtype, cpu(0))?)?;
        for kv in [&on_gpu, &on_cpu] {
            kv.set_updater(sgd.clone())?;
        }
        if !runs_kernels(dtype) {
            let values = [array(&random(n), &[n], dtype, cpu(0))?];
            assert_refused_below_arch(on_gpu.push(1, &values).map_err(Into::into), dtype, None);
            continue;
        }
        for _ in 0..3 {
            let values = (0..3)
                .map(|i| array(&random(n), &[n], dtype, cpu(i)))
                .collect::<Result<Vec<_>>>()?;
            on_gpu.push(1, &values)?;
            on_cpu.push(1, &values)?;
        }
        let (a, b) = (
            NDArray::full_on([n], f64::NAN, dtype, cpu(0))?,
            NDArray::full_on([n], f64::NAN, dtype, cpu(0))?,
        );
        on_gpu.pull(1, &a)?;
        on_cpu.pull(1, &b)?;
        let (a, b) = (a.to_vec::<f64>()?, b.to_vec::<f64>()?);
        let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
        ensure!(
            differ == 0,
            "{dtype}: {differ} of {n} elements differ between the homes"
        );
    }
    Ok(())
}

/// bf16 keys need sm_80 for their kernels. Below it (an sm_70 GPU: `KVSTORE_STANDIN_SM=70` on
/// the stand-in) a push into a GPU-homed bf16 key fails with `Error::GpuArch`, which names
/// both architectures, and changes nothing, also for the f32 key of the same call; f32 keys
/// keep working, and a user PTX updater whose `.target` is above the GPU is refused the same
/// way. From sm_80 the same calls succeed and match a reference computed here.
#[test]
#[ignore = "needs a GPU"]
fn bf16_keys_need_sm_80_and_the_error_names_the_architecture() -> Result<()> {
    require_gpu();
    let sm = oldest_sm();
    let n = 1031;
    let kv = KvStore::create("device")?;
    let (a, b) = (random(n), random(n));
    kv.init_on(1, &array(&a, &[n], DType::F32, cpu(0))?, gpu(0))?;
    kv.init_on(2, &array(&b, &[n], DType::BF16, cpu(0))?, gpu(0))?;
    let (ga, gb) = (random(n), random(n));
    let values = vec![
        vec![array(&ga, &[n], DType::F32, gpu(0))?],
        vec![array(&gb, &[n], DType::BF16, gpu(0))?],
    ];
    let pulled = |key: i32, dtype: DType| -> Result<Vec<f64>> {
        let out = NDArray::full_on([n], f64::NAN, dtype, cpu(0))?;
        kv.pull(key, &out)?;
        Ok(out.to_vec()?)
    };
    kv.set_updater(Updater::Axpby { a: 0.5, b: 2.0 })?;
    let r = kv.push_list(&[1, 2], &values);
    let axpby = |w: &[f32], g: &[f32], dtype: DType| -> Result<Vec<f64>> {
        let w = rounded(w, dtype)?;
        let g = rounded(g, dtype)?;
        let exact: Vec<f32> = w
            .iter()
            .zip(&g)
            .map(|(w, g)| 0.5 * *w as f32 + 2.0 * *g as f32)
            .collect();
        rounded(&exact, dtype)
    };
    if sm >= 80 {
        r?;
        assert_close(
            &pulled(1, DType::F32)?,
            &axpby(&a, &ga, DType::F32)?,
            1e-6,
            "f32",
        );
        assert_close(
            &pulled(2, DType::BF16)?,
            &axpby(&b, &gb, DType::BF16)?,
            1e-2,
            "bf16",
        );
        return Ok(());
    }
    assert_refused_below_arch(r.map_err(Into::into), DType::BF16, Some(2.into()));
    assert_close(
        &pulled(1, DType::F32)?,
        &rounded(&a, DType::F32)?,
        0.0,
        "f32 key after the refused call",
    );
    assert_close(
        &pulled(2, DType::BF16)?,
        &rounded(&b, DType::BF16)?,
        0.0,
        "bf16 key after the refused call",
    );
    // f32 keys work on this GPU.
    kv.push(1, &values[0])?;
    assert_close(
        &pulled(1, DType::F32)?,
        &axpby(&a, &ga, DType::F32)?,
        1e-6,
        "f32 on sm_70",
    );
    // A user updater for sm_80 is refused on this GPU, naming both architectures.
    let ptx = kvstore::PtxUpdater::EXAMPLE_SGD_F32.replace(".target sm_70", ".target sm_80");
    let p =
        kvstore::PtxUpdater::new(ptx, "sgd_f32", DType::F32)?.with_scalars([0.1, 0.0, 0.0, 0.0]);
    kv.set_updater(Updater::Ptx(p))?;
    let err = kv
        .push(1, &values[0])
        .expect_err("sm_80 PTX on an older GPU");
    match &err {
        Error::GpuArch {
            op, need: 80, have, ..
        } if *have == sm => {
            assert_eq!(*op, "load PTX updater", "{err}");
            assert!(err.to_string().contains("sm_80"), "{err}");
        }
        _ => panic!("expected Error::GpuArch, got {err:?}"),
    }
    Ok(())
}

/// Free memory on gpu(0), as the driver reports it (`cuMemGetInfo`).
fn free_gpu0_bytes(ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<usize> {
    ctx.bind_to_thread()?;
    Ok(cudarc::driver::result::mem_get_info()?.0)
}

/// The store's out-of-memory paths: with gpu(0) filled, an init that needs GPU memory and a
/// first momentum push (whose state needs GPU memory) fail with `Error::OutOfMemory` naming
/// the device and the bytes, and change nothing: the key is not created, the pushed key keeps
/// its value, and once memory is free again the same calls succeed. On the stand-in the GPU
/// has 0.25 GiB (`KVSTORE_STANDIN_MEM_GIB`, read once per process, so the test runs in a
/// process of its own); on a GPU the filling takes what the GPU has.
#[test]
#[ignore = "needs a GPU"]
fn out_of_memory_is_a_typed_error_and_changes_nothing() -> Result<()> {
    let name = "out_of_memory_is_a_typed_error_and_changes_nothing";
    if !common::in_own_process(
        name,
        &[("KVSTORE_STANDIN_MEM_GIB", "0.25")],
        Duration::from_secs(600),
    ) {
        return Ok(());
    }
    require_gpu();
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let kv = KvStore::create("device")?;
    kv.set_updater(Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    }))?;
    let (small, big) = (1000, 1 << 20);
    // Row-sparse keys 10 (small) and 11 (4 MiB), pushed once: a row-sparse push on a GPU home
    // makes each key's new value on the GPU before it changes any, so a push of both in which
    // key 11's runs out of memory must leave key 10 as it was too.
    let rsp_dims = [[100usize, 4], [big / 4, 4]];
    let rsp: Vec<NDArray> = (rsp_dims.iter())
        .map(|d| array(&random(d[0] * 4), d, DType::F32, cpu(0)))
        .collect::<Result<_>>()?;
    // First, so that the 4 MiB key is placed on gpu(0) (the emptiest, lowest ordinal).
    kv.init_row_sparse_list(&[10, 11], &rsp)?;
    assert_eq!(kv.meta(11)?.2, gpu(0));
    // Key 1: small, pushed once before the filling (its state exists). Key 2: 4 MiB, never
    // pushed, so its first push must allocate 4 MiB of state.
    kv.init_on(
        1,
        &array(&random(small), &[small], DType::F32, cpu(0))?,
        gpu(0),
    )?;
    kv.push(1, &array(&random(small), &[small], DType::F32, gpu(0))?)?;
    let b = random(big);
    kv.init_on(2, &array(&b, &[big], DType::F32, cpu(0))?, gpu(0))?;
    let pushed = array(&random(big), &[big], DType::F32, gpu(0))?;
    let host_value = array(&random(big), &[big], DType::F32, cpu(0))?;
    let pull = |key: i32, n: usize| -> Result<Vec<f64>> {
        let out = NDArray::full_on([n], f64::NAN, DType::F32, cpu(0))?;
        kv.pull(key, &out)?;
        Ok(out.to_vec()?)
    };
    let one_before = pull(1, small)?;
    let row = || -> Result<Vec<RowSparse>> {
        Ok(vec![RowSparse::new(
            vec![0],
            array(&random(4), &[1, 4], DType::F32, gpu(0))?,
        )?])
    };
    kv.push_row_sparse_list(&[10, 11], &[row()?, row()?])?;
    let rows_before = |kv: &KvStore| -> Result<Vec<Vec<f32>>> {
        [10, 11]
            .iter()
            .map(|&k| Ok(kv.row_sparse_pull(k, &[0, 1])?.rows().to_vec::<f32>()?))
            .collect()
    };
    let rsp_before = rows_before(&kv)?;
    kv.wait_all()?;

    // Fill gpu(0) until the driver refuses 1 MiB, with the driver's own allocations: an array
    // made by the store would be built in host memory first, which on a 141 GiB GPU is more
    // than the host has (the first GPU run of this test stalled there). A real GPU keeps some
    // of what `cuMemGetInfo` calls free for itself (30 MB on an H100), so the test asks for
    // memory until it is refused rather than until nothing reads as free.
    let stream = ctx.default_stream();
    let mut fillers = Vec::new();
    let mut ask = free_gpu0_bytes(&ctx)?.saturating_sub(512 << 10);
    while ask >= 1 << 20 && fillers.len() < 256 {
        match stream.alloc_zeros::<u8>(ask) {
            Ok(a) => {
                fillers.push(a);
                ask = ask.min(free_gpu0_bytes(&ctx)?.saturating_sub(512 << 10));
            }
            Err(_) => ask /= 2,
        }
    }
    stream.synchronize()?;
    // What the calls below need is 4 MiB at a time: the GPU must refuse that much.
    if let Ok(probe) = stream.alloc_zeros::<u8>(4 * big) {
        drop(probe);
        let free = free_gpu0_bytes(&ctx)?;
        skipped(
            name,
            &format!("gpu(0) still gives 4 MiB after filling ({free} bytes read as free)"),
        );
        return Ok(());
    }

    let is_oom = |r: kvstore::Result<()>, what: &str, bytes: usize| match r {
        Err(Error::OutOfMemory {
            device: Some(d),
            requested,
            ..
        }) if d == gpu(0) => {
            assert!(
                requested.is_none_or(|r| r >= bytes),
                "{what}: asked for {requested:?}, at least {bytes} expected"
            );
        }
        other => panic!("{what}: expected Error::OutOfMemory on gpu(0), got {other:?}"),
    };
    is_oom(
        kv.init_on(3, &host_value, gpu(0)),
        "init of a 4 MiB key",
        4 * big,
    );
    is_oom(kv.push(2, &pushed), "the first momentum push", 4 * big);
    is_oom(
        kv.push_row_sparse_list(&[10, 11], &[row()?, row()?]),
        "a row-sparse push whose 4 MiB key's new value does not fit",
        4 * big,
    );
    let text = kv
        .push(2, &pushed)
        .expect_err("still no memory")
        .to_string();
    assert!(
        text.contains("out of memory on gpu(0)") && text.contains("free arrays"),
        "the message says where and what to do: {text}"
    );

    // Memory back: nothing had changed, and the same calls now succeed.
    drop(fillers);
    assert!(
        matches!(kv.meta(3), Err(Error::UnknownKey { .. })),
        "the failed init created no key"
    );
    let want_b: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
    assert_close(
        &pull(2, big)?,
        &want_b,
        0.0,
        "key 2 after the failed pushes",
    );
    assert_close(&pull(1, small)?, &one_before, 0.0, "key 1");
    assert_eq!(
        rows_before(&kv)?,
        rsp_before,
        "the failed row-sparse push changed a key"
    );
    kv.init_on(3, &host_value, gpu(0))?;
    kv.push_row_sparse_list(&[10, 11], &[row()?, row()?])?;
    kv.push(1, &array(&random(small), &[small], DType::F32, gpu(0))?)?;
    kv.wait_all()?;
    Ok(())
}

/// A `device` store copying between two GPUs enables peer access first, where the GPUs
/// allow it, so the copies go directly instead of through the host: after a push from gpu(1)
/// to a key homed on gpu(0) and a pull back, enabling access again says it already is.
#[test]
#[ignore = "needs a GPU"]
fn device_store_enables_peer_access() -> Result<()> {
    use cudarc::driver::{sys, CudaContext};
    require_gpu();
    if gpu_count() < 2 {
        skipped(
            "device_store_enables_peer_access",
            "one GPU: there is no peer to enable",
        );
        return Ok(());
    }
    if on_one_physical_gpu() {
        // The store's two GPUs share one context: copies between them need no peer access.
        let kv = KvStore::create("device")?;
        let n = 5000;
        let data = random(n);
        kv.init_on(3, &array(&vec![0.0; n], &[n], DType::F32, cpu(0))?, gpu(0))?;
        kv.push(3, &array(&data, &[n], DType::F32, gpu(1))?)?;
        let out = NDArray::full_on([n], f64::NAN, DType::F32, gpu(1))?;
        kv.pull(3, &out)?;
        kv.wait_all()?;
        let want = rounded(&data, DType::F32)?;
        assert_close(&out.to_vec()?, &want, 0.0, "round trip on one GPU");
        skipped(
            "device_store_enables_peer_access",
            "KVSTORE_TEST_GPU_MAP puts gpu(0) and gpu(1) on one physical GPU: no peer to enable \
             (the round trip between them ran)",
        );
        return Ok(());
    }
    let (c0, c1) = (CudaContext::new(0)?, CudaContext::new(1)?);
    let mut can = [0; 2];
    // SAFETY: valid device handles and out-pointers.
    unsafe {
        sys::cuDeviceCanAccessPeer(&mut can[0], c0.cu_device(), c1.cu_device());
        sys::cuDeviceCanAccessPeer(&mut can[1], c1.cu_device(), c0.cu_device());
    }
    let kv = KvStore::create("device")?;
    let n = 5000;
    let data = random(n);
    kv.init_on(3, &array(&vec![0.0; n], &[n], DType::F32, cpu(0))?, gpu(0))?;
    kv.push(3, &array(&data, &[n], DType::F32, gpu(1))?)?;
    let out = NDArray::full_on([n], f64::NAN, DType::F32, gpu(1))?;
    kv.pull(3, &out)?;
    kv.wait_all()?;
    assert_close(
        &out.to_vec()?,
        &rounded(&data, DType::F32)?,
        0.0,
        "round trip",
    );
    for (from, to, can) in [(&c0, &c1, can[0]), (&c1, &c0, can[1])] {
        from.bind_to_thread()?;
        // SAFETY: `from` is current and `to` is a live context; flags must be 0.
        let r = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
        if can == 0 {
            skipped(
                "device_store_enables_peer_access",
                "the GPUs cannot access each other's memory",
            );
            return Ok(());
        }
        ensure!(
            r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
            "peer access was not enabled by the store: enabling it now gave {r:?}"
        );
    }
    Ok(())
}

/// A hang inside NCCL is aborted after `KVSTORE_NCCL_TIMEOUT_MS` with an error that says so,
/// and while it hangs it holds no lock anyone else needs: another thread's `wait_all` returns
/// meanwhile. Two hangs, which the stand-in fakes: communicator creation that never finishes
/// (`KVSTORE_STANDIN_NCCL_STALL_INIT=1`), and a group whose collectives never finish being
/// issued (`KVSTORE_STANDIN_NCCL_STALL_GROUP=1`: the store polls it with the watchdog's
/// in-flight list free). Stand-in only: a real NCCL cannot be made to hang on purpose here.
#[test]
#[ignore = "needs a GPU"]
fn a_hang_inside_nccl_is_aborted_not_waited_for() -> Result<()> {
    require_gpu();
    if in_child() {
        let kv = KvStore::create("nccl")?;
        let n = 100;
        kv.init_on(0, &NDArray::full_on([n], 1.0, DType::F32, cpu(0))?, gpu(0))?;
        let value = array(&random(n), &[n], DType::F32, gpu(0))?;
        // While the push hangs (until the 8 s NCCL timeout the parent sets), another thread
        // calls wait_all again and again: each call must return at once, since the hung call
        // holds no lock that wait_all needs. The longest call is checked against half the
        // timeout, a bound no wait_all reaches unless it was blocked behind the hang.
        let done = std::sync::atomic::AtomicBool::new(false);
        let (pushed, longest) = std::thread::scope(|s| {
            let push = s.spawn(|| {
                let r = kv.push(0, &value);
                done.store(true, std::sync::atomic::Ordering::Release);
                r
            });
            let waiter = s.spawn(|| {
                let mut longest = Duration::ZERO;
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    let start = Instant::now();
                    // Its result may be the hung call's error, once that is aborted.
                    let _ = nccl::wait_all();
                    longest = longest.max(start.elapsed());
                    std::thread::sleep(Duration::from_millis(50));
                }
                longest
            });
            (push.join(), waiter.join())
        });
        let longest = longest.map_err(|_| anyhow::anyhow!("wait_all panicked"))?;
        ensure!(
            longest < Duration::from_secs(4),
            "a wait_all was blocked behind the hung NCCL call for {longest:?} (the call is \
             aborted after 8 s): the hung call holds a lock that wait_all needs"
        );
        match pushed.map_err(|_| anyhow::anyhow!("the push panicked"))? {
            Err(Error::Nccl { message, .. }) => ensure!(
                message.contains("in progress") && message.contains("aborted"),
                "the error says what happened: {message}"
            ),
            other => anyhow::bail!("expected an NCCL error, got {other:?}"),
        }
        return Ok(());
    }
    if std::env::var("KVSTORE_STANDIN").as_deref() != Ok("1") || !nccl::available() {
        skipped(
            "a_hang_inside_nccl_is_aborted_not_waited_for",
            "needs the stand-in driver (KVSTORE_STANDIN=1) to make NCCL hang",
        );
        return Ok(());
    }
    for stall in [
        "KVSTORE_STANDIN_NCCL_STALL_INIT",
        "KVSTORE_STANDIN_NCCL_STALL_GROUP",
    ] {
        let (ok, out) = run_child(
            "a_hang_inside_nccl_is_aborted_not_waited_for",
            &[
                (stall, "1".into()),
                ("KVSTORE_NCCL_TIMEOUT_MS", "8000".into()),
                ("KVSTORE_NCCL_FORCE", "1".into()),
            ],
            &[],
            Duration::from_secs(120),
        )?;
        ensure!(ok, "{stall}=1: the hung NCCL call was not aborted:\n{out}");
    }
    Ok(())
}

/// The NCCL settings a bad value of which is an error, with the value each child sets.
const BAD_NCCL_SETTINGS: [(&str, &str); 2] = [
    ("KVSTORE_NCCL_TIMEOUT_MS", "soon"),
    ("KVSTORE_NCCL_MAX_COMMS", "0"),
];

/// A bad `KVSTORE_NCCL_TIMEOUT_MS` or `KVSTORE_NCCL_MAX_COMMS` (each read once per process) is
/// an `Error::InvalidEnv` naming the variable, at every push and pull of a `nccl` store that
/// needs NCCL, rather than being replaced by the default in silence.
#[test]
#[ignore = "needs a GPU"]
fn bad_nccl_settings_are_errors_that_name_the_variable() -> Result<()> {
    require_gpu();
    if in_child() {
        let (var, value) = BAD_NCCL_SETTINGS
            .into_iter()
            .find(|(v, _)| std::env::var_os(v).is_some())
            .expect("the parent sets one of them");
        let kv = KvStore::create("nccl")?;
        let n = 100;
        kv.init_on(0, &NDArray::full_on([n], 1.0, DType::F32, cpu(0))?, gpu(0))?;
        let pushed = kv.push(0, &array(&random(n), &[n], DType::F32, gpu(0))?);
        let pulled = kv.pull(0, &NDArray::full_on([n], 0.0, DType::F32, cpu(0))?);
        for (what, got) in [("push", pushed), ("pull", pulled)] {
            match got {
                Err(e @ Error::InvalidEnv { .. }) => {
                    let Error::InvalidEnv {
                        var: v, value: got, ..
                    } = &e
                    else {
                        unreachable!()
                    };
                    ensure!(
                        *v == var && got == value && e.to_string().contains(var),
                        "{what}: the error names {var}={value:?}: {e}"
                    );
                }
                other => anyhow::bail!("{what}: expected InvalidEnv for {var}, got {other:?}"),
            }
        }
        return Ok(());
    }
    if !nccl::available() {
        skipped(
            "bad_nccl_settings_are_errors_that_name_the_variable",
            "no usable NCCL was found",
        );
        return Ok(());
    }
    for (var, value) in BAD_NCCL_SETTINGS {
        let others: Vec<&str> = BAD_NCCL_SETTINGS
            .iter()
            .map(|(v, _)| *v)
            .filter(|v| *v != var)
            .collect();
        let (ok, out) = run_child(
            "bad_nccl_settings_are_errors_that_name_the_variable",
            &[(var, value.into()), ("KVSTORE_NCCL_FORCE", "1".into())],
            &others,
            Duration::from_secs(120),
        )?;
        ensure!(ok, "{var}={value:?} did not fail as expected:\n{out}");
    }
    Ok(())
}

/// Host values larger than the two pinned staging buffers (4 MiB each) go up in pieces, each
/// buffer refilled only after the copy from it has completed: a 12 MiB host value, and a
/// 2 MiB one written into an existing key, come back exactly.
#[test]
#[ignore = "needs a GPU"]
fn host_values_go_up_through_pinned_staging() -> Result<()> {
    require_gpu();
    let kv = KvStore::create("device")?;
    let n = 3 << 20;
    let data = random(n);
    kv.init_on(0, &array(&data, &[n], DType::F32, cpu(0))?, gpu(0))?;
    let small = random(1 << 19);
    kv.init_on(1, &array(&small, &[1 << 19], DType::F32, cpu(0))?, gpu(0))?;
    let out = NDArray::full_on([n], f64::NAN, DType::F32, cpu(0))?;
    kv.pull(0, &out)?;
    let out_small = NDArray::full_on([1 << 19], f64::NAN, DType::F32, cpu(0))?;
    kv.pull(1, &out_small)?;
    ensure!(
        out.to_vec::<f32>()? == data,
        "the 12 MiB value differs after the round trip"
    );
    ensure!(
        out_small.to_vec::<f32>()? == small,
        "the 2 MiB value differs after the round trip"
    );
    Ok(())
}

/// The test-only `KVSTORE_TEST_GPU_MAP`: a bad value fails every use of a GPU with an
/// `Error::InvalidEnv` naming it, and `0,0` gives the store two GPUs on physical GPU 0, whose
/// values sum and come back as on two GPUs (a `device` store: peer copies; the `nccl` kind's
/// run is `nccl_store_across_gpus` under the map, in scripts/gpu-run.sh's lease plan).
#[test]
#[ignore = "needs a GPU"]
fn the_test_gpu_map_puts_two_devices_on_one_gpu() -> Result<()> {
    require_gpu();
    const NAME: &str = "the_test_gpu_map_puts_two_devices_on_one_gpu";
    if in_child() {
        let map = std::env::var("KVSTORE_TEST_GPU_MAP")?;
        let kv = KvStore::create("device")?;
        let n = 1000;
        let zeros = NDArray::full_on([n], 0.0, DType::F32, cpu(0))?;
        if map == "0,0" {
            ensure!(gpu_count() == 2, "two devices, got {}", gpu_count());
            let (a, b) = (random(n), random(n));
            kv.init_on(1, &zeros, gpu(1))?;
            kv.push(
                1,
                &[
                    array(&a, &[n], DType::F32, gpu(0))?,
                    array(&b, &[n], DType::F32, gpu(1))?,
                ],
            )?;
            let outs = [
                NDArray::full_on([n], f64::NAN, DType::F32, gpu(0))?,
                NDArray::full_on([n], f64::NAN, DType::F32, gpu(1))?,
            ];
            kv.pull(1, &outs)?;
            kv.wait_all()?;
            let want: Vec<f64> = (0..n).map(|i| f64::from(a[i] + b[i])).collect();
            for o in &outs {
                assert_close(&o.to_vec()?, &want, 0.0, "sum over two mapped devices");
            }
            return Ok(());
        }
        match kv.init_on(1, &zeros, gpu(0)) {
            Err(Error::InvalidEnv { var, value, .. }) => {
                ensure!(
                    var == "KVSTORE_TEST_GPU_MAP" && value == map,
                    "{var}={value}"
                )
            }
            other => anyhow::bail!("expected InvalidEnv for {map:?}, got {other:?}"),
        }
        return Ok(());
    }
    // No machine has a GPU 4096.
    for map in ["0,0", "0,x", "0,4096", ""] {
        let (ok, out) = run_child(
            NAME,
            &[("KVSTORE_TEST_GPU_MAP", map.into())],
            &[],
            Duration::from_secs(120),
        )?;
        ensure!(ok, "KVSTORE_TEST_GPU_MAP={map}:\n{out}");
    }
    Ok(())
}

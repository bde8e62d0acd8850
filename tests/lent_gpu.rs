//! GPU memory of another library lent to the store without a copy (`LentGpuArray`): the
//! memory here is allocated by cudarc on a stream of the test's own, as PyTorch or CuPy would
//! allocate it, and the store pushes from it and pulls into it in place.
//!
//! Run on a GPU, and on the stand-in driver in CI (`scripts/standin-gpu-tests.sh`).

use std::sync::Arc;

use anyhow::{ensure, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use kvstore::{cpu, gpu, gpu_count, DType, Error, KvStore, LentGpuArray, NDArray, Sgd, Updater};
use rand::Rng;

fn require_gpu() {
    assert!(
        gpu_count() > 0,
        "this test needs a GPU and none was found (libcuda missing or no device)"
    );
}

fn random(n: usize) -> Vec<f32> {
    let mut rng = rand::thread_rng();
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// A stream of the test's own on `gpu(i)`: the "other library".
fn other_library(i: usize) -> Result<Arc<CudaStream>> {
    Ok(CudaContext::new(i)?.new_stream()?)
}

/// `values` in memory the other library allocated, written and finished.
fn foreign(st: &Arc<CudaStream>, values: &[f32]) -> Result<CudaSlice<f32>> {
    let s = st.clone_htod(values)?;
    st.synchronize()?;
    Ok(s)
}

fn address(st: &Arc<CudaStream>, s: &CudaSlice<f32>) -> u64 {
    let (p, _sync) = s.device_ptr(st);
    p
}

fn read_back(st: &Arc<CudaStream>, s: &CudaSlice<f32>) -> Result<Vec<f32>> {
    Ok(st.clone_dtoh(s)?)
}

/// A push from two lent gradients and a pull into a lent out, on a `device` store with SGD:
/// the out holds the updated weight (against a reference computed here), the pushed memory is
/// unchanged, and the memory is still the other library's (it reads and frees it after).
#[test]
#[ignore = "needs a GPU"]
fn push_from_and_pull_into_lent_memory() -> Result<()> {
    require_gpu();
    let n = 3000;
    let st = other_library(0)?;
    let (w0, g0, g1) = (random(n), random(n), random(n));
    let (grad0, grad1) = (foreign(&st, &g0)?, foreign(&st, &g1)?);
    let out = foreign(&st, &vec![f32::NAN; n])?;

    let kv = KvStore::create("device")?;
    let lr = 0.25f32;
    kv.set_updater(Updater::Sgd(Sgd {
        lr: f64::from(lr),
        ..Sgd::default()
    }))?;
    kv.init_on(7, &NDArray::from_vec(w0.clone(), [n])?, gpu(0))?;
    {
        // SAFETY: the slices stay allocated until after `wait_all` below, and the test's
        // stream does not touch them meanwhile.
        let a = unsafe { LentGpuArray::new(address(&st, &grad0), 0, DType::F32, [n])? };
        // SAFETY: as for `a`.
        let b = unsafe { LentGpuArray::new(address(&st, &grad1), 0, DType::F32, [n])? };
        // SAFETY: as for `a`.
        let o = unsafe { LentGpuArray::new(address(&st, &out), 0, DType::F32, [n])? };
        ensure!(a.array().device() == gpu(0), "a lent array is on its GPU");
        kv.push(7, &[a.array().clone(), b.array().clone()])?;
        kv.pull(7, o.array())?;
    }
    kv.wait_all()?;

    let want: Vec<f32> = (0..n).map(|i| w0[i] - lr * (g0[i] + g1[i])).collect();
    let got = read_back(&st, &out)?;
    for i in 0..n {
        ensure!(
            (got[i] - want[i]).abs() <= 1e-6,
            "element {i}: pulled {} into lent memory, want {}",
            got[i],
            want[i]
        );
    }
    ensure!(
        read_back(&st, &grad0)? == g0,
        "the first pushed gradient is unchanged"
    );
    ensure!(
        read_back(&st, &grad1)? == g1,
        "the second pushed gradient is unchanged"
    );
    // The other library frees its memory once (a second free by the store would be refused).
    drop((grad0, grad1, out));
    st.synchronize()?;
    Ok(())
}

/// Memory the store cannot use is refused before anything runs: an address inside no
/// allocation, elements past the end of the allocation (its last byte is not device memory),
/// an address not aligned to the element, and (with two GPUs) memory of another GPU.
#[test]
#[ignore = "needs a GPU"]
fn unusable_memory_is_refused_and_nothing_is_lent() -> Result<()> {
    require_gpu();
    let st = other_library(0)?;
    let s = foreign(&st, &random(100))?;
    let p = address(&st, &s);
    let refused = |r: kvstore::Result<LentGpuArray>, what: &str, says: &str| -> Result<()> {
        match r {
            Err(Error::ForeignMemory { device, message }) => {
                ensure!(device == gpu(0), "{what}: names gpu(0), got {device}");
                ensure!(message.contains(says), "{what}: says {says:?}: {message}");
                Ok(())
            }
            Err(e) => anyhow::bail!("{what}: expected ForeignMemory, got {e}"),
            Ok(_) => anyhow::bail!("{what}: was lent"),
        }
    };
    // SAFETY (each call): only checked, never lent; `s` outlives them all.
    refused(
        // SAFETY: only checked, never lent; the memory outlives the call.
        unsafe { LentGpuArray::new(p, 0, DType::F32, [101]) },
        "one element too many",
        "the last byte",
    )?;
    refused(
        // SAFETY: only checked, never lent; the memory outlives the call.
        unsafe { LentGpuArray::new(p + 2, 0, DType::F32, [10]) },
        "misaligned",
        "not aligned",
    )?;
    let host = [0f32; 16];
    refused(
        // SAFETY: only checked, never lent; the memory outlives the call.
        unsafe { LentGpuArray::new(host.as_ptr() as u64, 0, DType::F32, [16]) },
        "host memory",
        "not device memory",
    )?;
    if gpu_count() > 1 {
        let st1 = other_library(1)?;
        let s1 = foreign(&st1, &random(100))?;
        refused(
            // SAFETY: only checked, never lent; the memory outlives the call.
            unsafe { LentGpuArray::new(address(&st1, &s1), 0, DType::F32, [100]) },
            "memory of gpu(1) lent as gpu(0)",
            "memory of gpu(1)",
        )?;
    }
    // Nothing was lent: the memory is still whole.
    ensure!(read_back(&st, &s)?.len() == 100);
    drop(s);
    st.synchronize()?;
    Ok(())
}

/// A clone of a lent array kept past the lend gets a copy of its own: it keeps the values it
/// had, however the other library changes its memory after.
#[test]
#[ignore = "needs a GPU"]
fn a_clone_kept_past_the_lend_gets_its_own_copy() -> Result<()> {
    require_gpu();
    let n = 500;
    let st = other_library(0)?;
    let v = random(n);
    let mut s = foreign(&st, &v)?;
    // SAFETY: `s` outlives the lend and the copy its end makes (the `to_vec` below waits for
    // the store's stream before the test's stream writes `s` again).
    let lent = unsafe { LentGpuArray::new(address(&st, &s), 0, DType::F32, [n])? };
    let kept = lent.array().clone();
    drop(lent);
    ensure!(kept.to_vec::<f32>()? == v, "the kept clone has the values");
    st.memcpy_htod(&random(n), &mut s)?;
    st.synchronize()?;
    ensure!(
        kept.to_vec::<f32>()? == v,
        "the kept clone does not see the other library's later writes"
    );
    let host = kept.to_device(cpu(0))?;
    ensure!(host.to_vec::<f32>()? == v);
    drop(s);
    st.synchronize()?;
    Ok(())
}

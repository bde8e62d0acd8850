//! List pushes and pulls of many small keys on a GPU home: results against an independent
//! host reference, the number of driver calls one list call makes (it must not grow with the
//! number of keys), and what those calls ask of the GPU: launch grids no larger than twice the
//! blocks that do work, and host values uploaded from pinned memory.
//!
//! Every test is `#[ignore = "needs a GPU"]`, as in `gpu_store.rs`. The counts come from the
//! stand-in driver (`tools/stand-in-driver`, its `kvstore_standin_thread_calls`); on a real
//! driver that symbol does not exist and the count checks print `SKIPPED:`.

use anyhow::{ensure, Result};
use half::{bf16, f16};
use kvstore::__internal::BATCH_COPY_MAX_BYTES;
use kvstore::{cpu, gpu, gpu_count, DType, Device, KvStore, NDArray, Sgd, Updater};
use rand::Rng;
use std::collections::BTreeMap;

/// The calls this thread has made so far to each driver entry point, from the stand-in
/// driver; `None` on a real driver.
fn thread_calls() -> Option<BTreeMap<&'static str, u64>> {
    type Count = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;
    // SAFETY: loading the libcuda.so the store already loaded (the same mapping); its
    // initializers have run.
    let lib = unsafe { libloading::Library::new("libcuda.so") }.ok()?;
    // SAFETY: the stand-in exports this symbol with exactly this signature.
    let f: libloading::Symbol<Count> =
        unsafe { lib.get(b"kvstore_standin_thread_calls\0") }.ok()?;
    let mut out = BTreeMap::new();
    for name in NAMES {
        let c = std::ffi::CString::new(*name).expect("no NUL");
        // SAFETY: a valid NUL-terminated string.
        out.insert(*name, unsafe { f(c.as_ptr()) });
    }
    // SAFETY: a null name asks for every entry point.
    out.insert("all", unsafe { f(std::ptr::null()) });
    Some(out)
}

/// Counter `name` of the stand-in for this thread (see `tools/stand-in-driver/src/calls.rs`:
/// "blocks launched", "blocks idle", "pageable HtoD bytes"); `None` on a real driver.
fn thread_counter(name: &str) -> Option<u64> {
    type Count = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;
    // SAFETY: as in `thread_calls`.
    let lib = unsafe { libloading::Library::new("libcuda.so") }.ok()?;
    // SAFETY: as in `thread_calls`.
    let f: libloading::Symbol<Count> =
        unsafe { lib.get(b"kvstore_standin_thread_calls\0") }.ok()?;
    let c = std::ffi::CString::new(name).expect("no NUL");
    // SAFETY: a valid NUL-terminated string.
    Some(unsafe { f(c.as_ptr()) })
}

/// The entry points whose counts are reported.
const NAMES: &[&str] = &[
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemAllocAsync",
    "cuMemAlloc_v2",
    "cuMemFreeAsync",
    "cuMemsetD8Async",
    "cuLaunchKernel",
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuEventSynchronize",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
];

/// The calls `f` makes on this thread, per entry point (`None` on a real driver).
fn calls_of(f: impl FnOnce() -> Result<()>) -> Result<Option<BTreeMap<&'static str, u64>>> {
    let before = thread_calls();
    f()?;
    let after = thread_calls();
    Ok(before.zip(after).map(|(b, a)| {
        a.iter()
            .map(|(k, v)| (*k, v - b[k]))
            .filter(|(_, v)| *v > 0)
            .collect()
    }))
}

fn require_gpu() {
    assert!(
        gpu_count() > 0,
        "this test needs a GPU and none was found (libcuda missing or no device)"
    );
}

/// Fresh random values in [-2, 2), never zeros.
fn random(n: usize) -> Vec<f32> {
    let mut rng = rand::thread_rng();
    (0..n)
        .map(|_| {
            let x: f32 = rng.gen_range(-2.0f32..2.0);
            if x == 0.0 {
                0.5
            } else {
                x
            }
        })
        .collect()
}

/// `x` rounded to `dtype` as the `half` crate (not kvstore) rounds it, widened to f64.
fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F64 => x,
        DType::F32 => f64::from(x as f32),
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::BF16 => bf16::from_f64(x).to_f64(),
    }
}

/// An array of `dtype` on `device` holding `data`.
fn array(data: &[f32], dtype: DType, device: Device) -> Result<NDArray> {
    let a = NDArray::from_vec(data.to_vec(), [data.len()])?.astype(dtype)?;
    Ok(a.to_device(device)?)
}

/// Another dtype than `d` (for outs that convert).
fn other(d: DType) -> DType {
    match d {
        DType::F32 => DType::F16,
        DType::F16 => DType::F32,
        DType::BF16 => DType::F64,
        DType::F64 => DType::BF16,
    }
}

const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// Elements of a key just above the batching threshold (it keeps its own copies).
fn large(dtype: DType) -> usize {
    BATCH_COPY_MAX_BYTES / dtype.size() + 3
}

/// One list pull of small keys of every dtype and some above the batching threshold, with
/// repeated keys, several outs per key on every GPU, outs on the host and outs of another
/// dtype: every out equals the initial data as the key's dtype and then the out's round it.
#[test]
#[ignore = "needs a GPU"]
fn list_pull_of_mixed_keys_and_outs_matches_the_host() -> Result<()> {
    require_gpu();
    let mut rng = rand::thread_rng();
    let kv = KvStore::create("device")?;
    let nkeys = 30;
    let mut sizes: Vec<usize> = (0..nkeys).map(|_| rng.gen_range(1..2500)).collect();
    let dtypes: Vec<DType> = (0..nkeys).map(|k| DTYPES[k % 4]).collect();
    sizes[3] = large(dtypes[3]);
    sizes[8] = large(dtypes[8]);
    sizes[13] = BATCH_COPY_MAX_BYTES / dtypes[13].size(); // exactly at the threshold
    let data: Vec<Vec<f32>> = sizes.iter().map(|&n| random(n)).collect();
    let keys: Vec<i32> = (0..nkeys as i32).collect();
    let inits = data
        .iter()
        .zip(&dtypes)
        .map(|(d, &t)| array(d, t, cpu(0)))
        .collect::<Result<Vec<_>>>()?;
    kv.init_list(&keys, &inits)?;
    // Every key, then some again (each listed pull has its own outs).
    let mut list: Vec<usize> = (0..nkeys).collect();
    list.extend([0, 5, 8, 13, 21]);
    let mut places: Vec<(DType, Device)> = Vec::new();
    let mut outs: Vec<Vec<NDArray>> = Vec::new();
    let mut out_kinds: Vec<Vec<(DType, Device)>> = Vec::new();
    for &k in &list {
        let t = dtypes[k];
        places.clear();
        places.extend([
            (t, gpu(0)),
            (t, gpu(0)),
            (t, cpu(0)),
            (other(t), gpu(0)),
            (other(t), cpu(0)),
        ]);
        if gpu_count() > 1 {
            places.extend([(t, gpu(1)), (t, gpu(1)), (other(t), gpu(1))]);
        }
        outs.push(
            places
                .iter()
                .map(|&(d, dev)| NDArray::full_on([sizes[k]], f64::NAN, d, dev))
                .collect::<kvstore::Result<Vec<_>>>()?,
        );
        out_kinds.push(places.clone());
    }
    let list_keys: Vec<i32> = list.iter().map(|&k| k as i32).collect();
    kv.pull_list(&list_keys, &outs)?;
    kv.wait_all()?;
    for ((&k, os), kinds) in list.iter().zip(&outs).zip(&out_kinds) {
        for (o, &(d, dev)) in os.iter().zip(kinds) {
            let got = o.to_vec::<f64>()?;
            ensure!(got.len() == sizes[k], "key {k}: length");
            for (i, (&g, &x)) in got.iter().zip(&data[k]).enumerate() {
                let want = round_to(d, round_to(dtypes[k], f64::from(x)));
                ensure!(
                    g == want,
                    "key {k} ({} elements of {}), out {d} on {dev:?}, element {i}: got {g}, want {want}",
                    sizes[k],
                    dtypes[k]
                );
            }
        }
    }
    Ok(())
}

/// One list push of keys of f32, f16 and bf16 (small ones and a bigger one), each from host
/// values and GPU values, one key listed twice (its values are summed): with the default
/// (assign) updater every key holds the sum, against a host sum of the same rounded values.
#[test]
#[ignore = "needs a GPU"]
fn list_push_of_host_and_gpu_values_matches_the_host() -> Result<()> {
    require_gpu();
    let mut rng = rand::thread_rng();
    let kv = KvStore::create("device")?;
    let nkeys = 24;
    let dtypes: Vec<DType> = (0..nkeys).map(|k| DTYPES[k % 3]).collect();
    let mut sizes: Vec<usize> = (0..nkeys).map(|_| rng.gen_range(1..1500)).collect();
    sizes[4] = 20_000;
    let keys: Vec<i32> = (0..nkeys as i32).collect();
    let inits = sizes
        .iter()
        .zip(&dtypes)
        .map(|(&n, &t)| array(&random(n), t, cpu(0)))
        .collect::<Result<Vec<_>>>()?;
    kv.init_list(&keys, &inits)?;
    let mut list: Vec<usize> = (0..nkeys).collect();
    list.push(7);
    let mut want: Vec<Vec<f64>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    let mut values: Vec<Vec<NDArray>> = Vec::new();
    for (j, &k) in list.iter().enumerate() {
        let t = dtypes[k];
        let mut devs = vec![cpu(0), gpu(0)];
        if j % 3 == 0 {
            devs.push(cpu(0));
        }
        if gpu_count() > 1 && j % 2 == 0 {
            devs.extend([gpu(1), gpu(1)]);
        }
        let mut vs = Vec::new();
        for dev in devs {
            let x = random(sizes[k]);
            for (w, &v) in want[k].iter_mut().zip(&x) {
                *w += round_to(t, f64::from(v));
            }
            vs.push(array(&x, t, dev)?);
        }
        values.push(vs);
    }
    let list_keys: Vec<i32> = list.iter().map(|&k| k as i32).collect();
    kv.push_list(&list_keys, &values)?;
    let outs = sizes
        .iter()
        .map(|&n| Ok(vec![NDArray::full_on([n], f64::NAN, DType::F64, cpu(0))?]))
        .collect::<Result<Vec<_>>>()?;
    kv.pull_list(&keys, &outs)?;
    for k in 0..nkeys {
        let got = outs[k][0].to_vec::<f64>()?;
        // bf16 sums made on another GPU are rounded there first (see push.rs): two roundings.
        let tol = match dtypes[k] {
            DType::F32 => 1e-6,
            DType::F16 => 1e-2,
            _ => 3e-2,
        };
        for (i, (g, w)) in got.iter().zip(&want[k]).enumerate() {
            let err = (g - w).abs() / w.abs().max(1.0);
            ensure!(
                err <= tol,
                "key {k} ({}), element {i}: got {g}, want {w}",
                dtypes[k]
            );
        }
    }
    Ok(())
}

/// The driver calls of one list push and one list pull of `count` small f32 keys homed on
/// gpu(0): each key pushed from a value on gpu(0) and one on the host, and pulled into two
/// outs on gpu(0), one on the host and, where there is one, one on gpu(1).
fn list_calls(count: usize) -> Result<Option<[BTreeMap<&'static str, u64>; 2]>> {
    let kv = KvStore::create("device")?;
    let keys: Vec<i32> = (0..count as i32).collect();
    let n = 1024;
    for &k in &keys {
        kv.init_on(k, &array(&random(n), DType::F32, cpu(0))?, gpu(0))?;
    }
    let values = keys
        .iter()
        .map(|_| {
            Ok(vec![
                array(&random(n), DType::F32, gpu(0))?,
                array(&random(n), DType::F32, cpu(0))?,
            ])
        })
        .collect::<Result<Vec<_>>>()?;
    let outs = keys
        .iter()
        .map(|_| {
            let mut o = vec![
                NDArray::full_on([n], 0.0, DType::F32, gpu(0))?,
                NDArray::full_on([n], 0.0, DType::F32, gpu(0))?,
                NDArray::full_on([n], 0.0, DType::F32, cpu(0))?,
            ];
            if gpu_count() > 1 {
                // Read from the home over peer access.
                o.push(NDArray::full_on([n], 0.0, DType::F32, gpu(1))?);
            }
            Ok(o)
        })
        .collect::<Result<Vec<_>>>()?;
    // Once untimed, so kernels are loaded and buffers exist.
    kv.push_list(&keys, &values)?;
    kv.pull_list(&keys, &outs)?;
    kv.wait_all()?;
    let push = calls_of(|| Ok(kv.push_list(&keys, &values)?))?;
    let pull = calls_of(|| Ok(kv.pull_list(&keys, &outs)?))?;
    kv.wait_all()?;
    Ok(push.zip(pull).map(|(a, b)| [a, b]))
}

/// A list push and a list pull of many small keys make as many driver calls for 48 keys as
/// for 16: O(1) per GPU, not O(keys).
#[test]
#[ignore = "needs a GPU"]
fn list_calls_do_not_grow_with_the_keys() -> Result<()> {
    require_gpu();
    let (Some(few), Some(many)) = (list_calls(16)?, list_calls(48)?) else {
        println!(
            "\nSKIPPED: list_calls_do_not_grow_with_the_keys: no call counts (not the stand-in driver)"
        );
        return Ok(());
    };
    for (op, (a, b)) in ["push_list", "pull_list"].iter().zip(few.iter().zip(&many)) {
        println!("{op}: 16 keys {a:?}\n{op}: 48 keys {b:?}");
        assert_eq!(a, b, "{op}: driver calls grow with the number of keys");
        // Measured on the stand-in: push 15 and pull 34 on one GPU; 16 and 63 with a gpu(1) out.
        assert!(a["all"] <= 80, "{op}: {} driver calls", a["all"]);
    }
    Ok(())
}

/// One out listed under several keys of one list pull (on the home GPU, on another GPU and on
/// the host): no race between the batched copies into it (the stand-in checks), it ends with
/// one whole key's value (the last one on the host), and each key's own out on its home GPU
/// holds its own value.
#[test]
#[ignore = "needs a GPU"]
fn one_out_under_several_keys_gets_one_whole_value() -> Result<()> {
    require_gpu();
    let kv = KvStore::create("device")?;
    let n = 777;
    let keys: Vec<i32> = (0..9).collect();
    let data: Vec<Vec<f32>> = keys.iter().map(|_| random(n)).collect();
    for (&k, d) in keys.iter().zip(&data) {
        // Homes alternate where there are two GPUs.
        let home = gpu(k as usize % gpu_count().min(2));
        kv.init_on(k, &array(d, DType::F32, cpu(0))?, home)?;
    }
    let mut devs = vec![gpu(0), cpu(0)];
    if gpu_count() > 1 {
        devs.push(gpu(1));
    }
    let shared: Vec<NDArray> = devs
        .iter()
        .map(|&d| NDArray::full_on([n], f64::NAN, DType::F32, d))
        .collect::<kvstore::Result<_>>()?;
    // Each key's own out on its home GPU. (An own out on another GPU, where a shared out is
    // the first out, is copied from that shared out after the whole fan-out, so it gets the
    // last key's value: a known limit of the GPU pull, older than this test.)
    let own: Vec<NDArray> = keys
        .iter()
        .map(|&k| {
            NDArray::full_on(
                [n],
                f64::NAN,
                DType::F32,
                gpu(k as usize % gpu_count().min(2)),
            )
        })
        .collect::<kvstore::Result<_>>()?;
    let outs: Vec<Vec<NDArray>> = own
        .iter()
        .map(|o| {
            let mut v = vec![o.clone()];
            v.extend(shared.iter().cloned());
            v
        })
        .collect();
    kv.pull_list(&keys, &outs)?;
    let exact = |d: &[f32]| d.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    for (k, o) in own.iter().enumerate() {
        ensure!(
            o.to_vec::<f64>()? == exact(&data[k]),
            "key {k}: its own out"
        );
    }
    // Which key's value a shared out ends with is not specified on GPU homes (first outs are
    // filled before further outs, across keys; so it was before the batching): it must be one
    // whole key's value, never a mixture or the poison. On the host it is the last key's.
    for (s, d) in shared.iter().zip(&devs) {
        let got = s.to_vec::<f64>()?;
        let which: Vec<usize> = (0..keys.len())
            .filter(|&k| got == exact(&data[k]))
            .collect();
        ensure!(
            which.len() == 1,
            "the out on {d:?} shared by every key holds no key's value"
        );
        if *d == cpu(0) {
            ensure!(
                which == [keys.len() - 1],
                "the host out: key {which:?}, not the last"
            );
        }
    }
    Ok(())
}

/// Pulls of 1 to 12 small keys into outs on gpu(0): a few copies to one GPU go one by one, more
/// go into one launch (`BATCH_MIN_COPIES`, 4); on both sides of that line every out equals its
/// key's value. (12 keys: with the keys' homes spread over two GPUs, each side still gets 4 or
/// more copies of its own.)
#[test]
#[ignore = "needs a GPU"]
fn pulls_of_a_few_and_of_more_small_keys_match_the_host() -> Result<()> {
    require_gpu();
    let mut rng = rand::thread_rng();
    for nkeys in 1..=12 {
        let kv = KvStore::create("device")?;
        let keys: Vec<i32> = (0..nkeys).collect();
        let data: Vec<Vec<f32>> = keys
            .iter()
            .map(|_| random(rng.gen_range(1..3000)))
            .collect();
        let values = data
            .iter()
            .map(|d| array(d, DType::F32, cpu(0)))
            .collect::<Result<Vec<_>>>()?;
        kv.init_list(&keys, &values)?;
        let outs = data
            .iter()
            .map(|d| array(&vec![f32::NAN; d.len()], DType::F32, gpu(0)))
            .collect::<Result<Vec<_>>>()?;
        kv.pull_list(&keys, &outs)?;
        for (k, (out, want)) in outs.iter().zip(&data).enumerate() {
            let got = out.to_vec::<f32>()?;
            ensure!(
                got == *want,
                "{nkeys} keys: key {k} pulled into gpu(0) differs from its value"
            );
        }
    }
    Ok(())
}

/// One list push of keys of many sizes through the fused multi-tensor kernel (SGD with
/// momentum, f32 and f16 keys on gpu(0)): the launches' grids hold at most twice the blocks
/// that do work (the stand-in counts the blocks none of whose threads stored to memory). A grid
/// sized by the largest key times the number of keys, say, fails here. The values are checked
/// against a host reference too, so the counted launch is the one that did the update.
#[test]
#[ignore = "needs a GPU"]
fn a_multi_tensor_push_launches_at_most_twice_the_blocks_it_needs() -> Result<()> {
    require_gpu();
    let mut rng = rand::thread_rng();
    let kv = KvStore::create("device")?;
    let (lr, momentum) = (0.1f32, 0.9f32);
    kv.set_updater(Updater::Sgd(Sgd {
        lr: f64::from(lr),
        momentum: f64::from(momentum),
        ..Sgd::default()
    }))?;
    let sizes: Vec<usize> = (0..40)
        .map(|i| match i % 8 {
            0 => rng.gen_range(20_000..40_000),
            _ => rng.gen_range(1..3_000),
        })
        .collect();
    let dtypes: Vec<DType> = (0..sizes.len())
        .map(|i| if i % 3 == 2 { DType::F16 } else { DType::F32 })
        .collect();
    let keys: Vec<i32> = (0..sizes.len() as i32).collect();
    let mut want = Vec::new();
    let mut grads = Vec::new();
    for ((&k, &n), &dt) in keys.iter().zip(&sizes).zip(&dtypes) {
        let w: Vec<f32> = random(n)
            .iter()
            .map(|&x| round_to(dt, x as f64) as f32)
            .collect();
        let g: Vec<f32> = random(n)
            .iter()
            .map(|&x| round_to(dt, x as f64) as f32)
            .collect();
        kv.init_on(k, &array(&w, dt, cpu(0))?, gpu(0))?;
        // One SGD step from zero momentum: mom = momentum * 0 - lr * g; w += mom.
        want.push(
            w.iter()
                .zip(&g)
                .map(|(&w, &g)| round_to(dt, f64::from(w - lr * g)))
                .collect::<Vec<f64>>(),
        );
        grads.push(array(&g, dt, gpu(0))?);
    }
    kv.wait_all()?;
    let before = (
        thread_counter("blocks launched"),
        thread_counter("blocks idle"),
    );
    kv.push_list(&keys, &grads)?;
    kv.wait_all()?;
    let after = (
        thread_counter("blocks launched"),
        thread_counter("blocks idle"),
    );
    for (i, &k) in keys.iter().enumerate() {
        let out = NDArray::full_on([sizes[i]], 0.0, dtypes[i], cpu(0))?;
        kv.pull(k, &out)?;
        let got = out.astype(DType::F64)?.to_vec::<f64>()?;
        for (j, (&g, &w)) in got.iter().zip(&want[i]).enumerate() {
            ensure!(
                (g - w).abs() <= 2e-3 * w.abs().max(1.0),
                "key {k} ({:?}, {} elements) element {j}: {g} vs {w}",
                dtypes[i],
                sizes[i]
            );
        }
    }
    let (Some(l0), Some(i0), Some(l1), Some(i1)) = (before.0, before.1, after.0, after.1) else {
        println!(
            "\nSKIPPED: a_multi_tensor_push_launches_at_most_twice_the_blocks_it_needs: no block \
             counts (not the stand-in driver)"
        );
        return Ok(());
    };
    let (launched, idle) = (l1 - l0, i1 - i0);
    let working = launched - idle;
    println!(
        "push_list of {} keys: {launched} blocks launched, {idle} idle",
        keys.len()
    );
    ensure!(launched > 0, "the push launched no kernel");
    ensure!(
        launched <= 2 * working,
        "the push launched {launched} blocks for {working} that did work: a grid more than twice \
         what its data needs"
    );
    Ok(())
}

/// Host values go up to a GPU through pinned staging buffers, so the copy is asynchronous
/// (from pageable memory the driver stages it synchronously, and the host waits). A value of
/// more than two staging buffers (the store keeps two, refilled in turn) also shows a buffer
/// refilled before the copy from it ran: the stand-in reports that race, and the value pulled
/// back would differ.
#[test]
#[ignore = "needs a GPU"]
fn host_values_go_up_through_pinned_memory() -> Result<()> {
    require_gpu();
    let kv = KvStore::create("device")?;
    // 10 MiB: three staging buffers of 4 MiB.
    let n = (10 << 20) / 4;
    let first = random(n);
    let second = random(n);
    let before = (
        thread_counter("pageable HtoD bytes"),
        thread_counter("pinned HtoD bytes"),
    );
    kv.init_on(7, &array(&first, DType::F32, cpu(0))?, gpu(0))?;
    let out = NDArray::full_on([n], 0.0, DType::F32, cpu(0))?;
    kv.pull(7, &out)?;
    ensure!(
        out.to_vec::<f32>()? == first,
        "init from the host: another value came back"
    );
    kv.push(7, &array(&second, DType::F32, cpu(0))?)?;
    kv.pull(7, &out)?;
    ensure!(
        out.to_vec::<f32>()? == second,
        "push from the host: another value came back"
    );
    kv.wait_all()?;
    let after = (
        thread_counter("pageable HtoD bytes"),
        thread_counter("pinned HtoD bytes"),
    );
    let ((Some(b), Some(pb)), (Some(a), Some(pa))) = (before, after) else {
        println!(
            "\nSKIPPED: host_values_go_up_through_pinned_memory: no copy counts (not the \
             stand-in driver)"
        );
        return Ok(());
    };
    let (pageable, pinned) = (a - b, pa - pb);
    println!(
        "{} MiB up from the host: {pageable} bytes from pageable memory, {pinned} from pinned",
        (2 * n * 4) >> 20
    );
    ensure!(
        pinned >= (2 * n * 4) as u64,
        "only {pinned} bytes went up from pinned memory on this thread, of {} uploaded",
        2 * n * 4
    );
    ensure!(
        pageable <= 64 << 10,
        "{pageable} bytes went up from pageable memory (of {} uploaded): host values must go \
         through the pinned staging buffers",
        2 * n * 4
    );
    Ok(())
}

//! `dist_device_sync` on GPU ranks: values on each rank's GPU, NCCL between the ranks. Every
//! test needs a GPU (`#[ignore = "needs a GPU"]`); CI runs them on the stand-in driver, whose
//! ranks in separate processes form one communicator through files in `/dev/shm`, so the
//! two-rank jobs run there too.
//!
//! Two launches: under `mpirun` (the NCCL id travels over MPI), and as torchrun starts ranks,
//! with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` and no MPI at all.
//! Two ranks need two GPUs, or one GPU with NCCL >= 2.30 and `NCCL_MULTI_RANK_GPU_ENABLE=1`.
#![cfg(feature = "mpi")]

use std::time::Duration;

use kvstore::{gpu, gpu_count, DType, Device, Error, KvStore, NDArray, Sgd, Shape, Updater};

mod common;
use common::mpi_job::{launch, launch_without_mpi, ok_line, Job, CASE_VAR};

/// What the jobs inherit from the test's environment: the stand-in driver's settings, where
/// they are set, and the NCCL switch for several ranks on one GPU.
fn passed_on() -> Vec<(&'static str, String)> {
    [
        "LD_LIBRARY_PATH",
        "KVSTORE_STANDIN",
        "KVSTORE_STANDIN_GPUS",
        "KVSTORE_STANDIN_SM",
        "NCCL_MULTI_RANK_GPU_ENABLE",
        "KVSTORE_NCCL_LIB",
        // NCCL's own log of its communicators and collectives (scripts/gpu-run.sh's lease plan
        // keeps it, one file per rank), and its channel cap for ranks sharing a GPU.
        "NCCL_DEBUG",
        "NCCL_DEBUG_SUBSYS",
        "NCCL_DEBUG_FILE",
        "NCCL_MAX_CTAS",
    ]
    .into_iter()
    .filter_map(|k| std::env::var(k).ok().map(|v| (k, v)))
    .collect()
}

/// [`passed_on`], `extra`, and `KVT_DIR`: a fresh checkpoint folder for the job.
fn env_with(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, String)> {
    static JOB: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let job = JOB.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kvstore-dist-gpu-{}-{job}", std::process::id()));
    let mut env = passed_on();
    env.extend(extra.iter().map(|&(k, v)| (k, v.to_owned())));
    env.push(("KVT_DIR", dir.display().to_string()));
    env
}

fn as_refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Whether `n` ranks can run here, or why not.
fn ranks_fit(n: usize) -> Result<(), String> {
    if gpu_count() == 0 {
        panic!("needs a GPU: kvstore finds none");
    }
    if n == 1 {
        return Ok(());
    }
    if gpu_count() >= n {
        return Ok(());
    }
    let version = kvstore::__internal::nccl::version().unwrap_or(0);
    let shared = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v == "1");
    if version >= 23000 && shared {
        Ok(())
    } else {
        Err(format!(
            "{n} ranks need {n} GPUs, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL \
             {version}, {} GPUs)",
            gpu_count()
        ))
    }
}

fn check(job: &Job, n: usize, case: &str) {
    assert!(!job.killed, "the bound ended the job: a hang\n{job}");
    assert_eq!(job.code, Some(0), "{job}");
    job.assert_ok(&(0..n).collect::<Vec<_>>(), n, case, &[]);
}

fn under_mpirun(n: usize) {
    if let Err(why) = ranks_fit(n) {
        println!("SKIPPED: dist_device_sync_under_mpirun_on_{n}_ranks: {why}");
        return;
    }
    let env = env_with(&[("KVSTORE_TIMEOUT", "60")]);
    let Some(job) = launch(
        Some(n),
        "gpu_store",
        &as_refs(&env),
        Duration::from_secs(240),
    ) else {
        return;
    };
    check(&job, n, "gpu_store");
}

fn without_mpi(n: usize) {
    if let Err(why) = ranks_fit(n) {
        println!("SKIPPED: dist_device_sync_without_mpi_on_{n}_ranks: {why}");
        return;
    }
    let env = env_with(&[("KVSTORE_TIMEOUT", "60")]);
    let job = launch_without_mpi(n, "gpu_store", &as_refs(&env), Duration::from_secs(240));
    check(&job, n, "gpu_store");
}

#[test]
#[ignore = "needs a GPU"]
fn dist_device_sync_under_mpirun_on_1_rank() {
    under_mpirun(1);
}

#[test]
#[ignore = "needs a GPU"]
fn dist_device_sync_under_mpirun_on_2_ranks() {
    under_mpirun(2);
}

#[test]
#[ignore = "needs a GPU"]
fn dist_device_sync_without_mpi_on_1_rank() {
    without_mpi(1);
}

#[test]
#[ignore = "needs a GPU"]
fn dist_device_sync_without_mpi_on_2_ranks() {
    without_mpi(2);
}

/// Four ranks: past NCCL's tested ~2 ranks per GPU on a one-GPU machine (scripts/gpu-run.sh's
/// lease plan bounds it, since it may hang there).
#[test]
#[ignore = "needs a GPU"]
fn dist_device_sync_under_mpirun_on_4_ranks() {
    under_mpirun(4);
}

/// As above, launched as torchrun launches ranks.
#[test]
#[ignore = "needs a GPU"]
fn dist_device_sync_without_mpi_on_4_ranks() {
    without_mpi(4);
}

/// A launch without MPI whose variables disagree is an error naming the variable, not a hang.
#[test]
#[ignore = "needs a GPU"]
fn a_launch_without_mpi_with_a_bad_variable_names_it() {
    ranks_fit(1).expect("one rank fits");
    let env = env_with(&[("LOCAL_RANK", "3"), ("RANK", "0")]);
    let job = launch_without_mpi(1, "bad_env", &as_refs(&env), Duration::from_secs(60));
    check(&job, 1, "bad_env");
}

// ---------------------------------------------------------------------------------------------
// The ranks' side.
// ---------------------------------------------------------------------------------------------

/// A list push and pull of 1000 small keys (and a big one) on GPU ranks: the values match a
/// host reference, and, on the stand-in driver, the push is one NCCL reduce per (home rank,
/// dtype) plus one per big key, and the pull one broadcast each, not one per key.
#[test]
#[ignore = "needs a GPU"]
fn a_list_of_1000_keys_is_a_handful_of_nccl_calls_on_2_ranks() {
    let n = 2;
    if let Err(why) = ranks_fit(n) {
        println!("SKIPPED: a_list_of_1000_keys_is_a_handful_of_nccl_calls_on_2_ranks: {why}");
        return;
    }
    let env = env_with(&[("KVSTORE_TIMEOUT", "120")]);
    let Some(job) = launch(
        Some(n),
        "many_keys",
        &as_refs(&env),
        Duration::from_secs(400),
    ) else {
        return;
    };
    check(&job, n, "many_keys");
    if job.stdout.contains("SKIPPED") {
        println!("SKIPPED: the NCCL call count (no stand-in driver: the count is its own)\n{job}");
    }
}

/// Keys over `KVSTORE_BIGARRAY_BOUND` on GPU ranks: each rank holds and updates its own slice,
/// a push is one NCCL reduce-scatter per such key and a pull one all-gather, and the values
/// (SGD with momentum over three rounds, from values on the GPU and in host memory) match a
/// host reference; a sharded save of the slices loads whole into a single-process store.
#[test]
#[ignore = "needs a GPU"]
fn big_keys_are_sliced_over_gpu_ranks_on_2_and_3_ranks() {
    for n in [2, 3] {
        if let Err(why) = ranks_fit(n) {
            println!("SKIPPED: big_keys_are_sliced_over_gpu_ranks on {n} ranks: {why}");
            continue;
        }
        let mut env = env_with(&[("KVSTORE_TIMEOUT", "120"), ("KVSTORE_BIGARRAY_BOUND", "64")]);
        env.push(("KVT_SEED", rand::random::<u64>().to_string()));
        let Some(job) = launch(Some(n), "sliced", &as_refs(&env), Duration::from_secs(400)) else {
            return;
        };
        check(&job, n, "sliced");
        if job.stdout.contains("SKIPPED") {
            println!(
                "SKIPPED: the NCCL call count (no stand-in driver: the count is its own)\n{job}"
            );
        }
    }
}

/// Gradient compression (2-bit and the bfloat16 wire) and row-sparse keys on GPU ranks, each
/// against a reference written here element by element, with a key sliced over the ranks and
/// one whole on a rank, on 1, 2 and 3 ranks: under `mpirun` (the words and rows travel over
/// MPI through host memory) and started without MPI (they travel in NCCL sends and receives,
/// one group per all-to-all). A sharded save loads into a single-process store and, under
/// mpirun, into a fresh store of the ranks, whose next push continues from the saved residuals
/// and momentum. On the stand-in driver the launch without MPI also counts the sends.
#[test]
#[ignore = "needs a GPU"]
fn compression_and_row_sparse_keys_on_gpu_ranks() {
    // One rank too: its all-to-alls are a send and a receive to itself (a one-GPU machine).
    for (n, mpi) in [1, 2, 3, 1, 2, 3]
        .into_iter()
        .zip([true, true, true, false, false, false])
    {
        if let Err(why) = ranks_fit(n) {
            println!("SKIPPED: compression and row_sparse on {n} GPU ranks: {why}");
            continue;
        }
        for wire in ["2bit", "bf16", "rows"] {
            let mut env = env_with(&[
                ("KVSTORE_TIMEOUT", "120"),
                ("KVSTORE_BIGARRAY_BOUND", "64"),
                ("KVT_WIRE", wire),
                ("KVT_MPI", if mpi { "1" } else { "0" }),
            ]);
            env.push(("KVT_SEED", rand::random::<u64>().to_string()));
            let bound = Duration::from_secs(400);
            let job = match mpi {
                true => match launch(Some(n), "sparse_compressed", &as_refs(&env), bound) {
                    Some(job) => job,
                    None => {
                        println!("SKIPPED: compression and row_sparse under mpirun: no mpirun");
                        continue;
                    }
                },
                false => launch_without_mpi(n, "sparse_compressed", &as_refs(&env), bound),
            };
            check(&job, n, "sparse_compressed");
            job.assert_ok(&(0..n).collect::<Vec<_>>(), n, "sparse_compressed", &[wire]);
        }
    }
}

/// A load that runs out of GPU memory on one rank only fails on every rank and changes no
/// rank's store. On the stand-in driver, rank 1's GPU has 8 MiB: the checkpoint's three sliced
/// keys need 12 MiB of it. (Before the fix, the ranks agreed before making their parts: rank 0
/// loaded everything and returned `Ok`, rank 1 failed with part of its keys replaced.) On a
/// real GPU, whose memory the test cannot bound per rank, SKIPPED.
#[test]
#[ignore = "needs a GPU"]
fn a_load_out_of_gpu_memory_on_one_rank_fails_every_rank_and_changes_nothing() {
    if standin_calls("cuInit").is_none() {
        println!("SKIPPED: a load out of GPU memory on one rank: runs on the stand-in driver only");
        return;
    }
    if let Err(why) = ranks_fit(2) {
        println!("SKIPPED: a load out of GPU memory on one rank: {why}");
        return;
    }
    let mut env = env_with(&[("KVSTORE_TIMEOUT", "60")]);
    env.push(("KVT_SEED", rand::random::<u64>().to_string()));
    let Some(job) = launch(
        Some(2),
        "load_short_of_memory",
        &as_refs(&env),
        Duration::from_secs(240),
    ) else {
        println!("SKIPPED: a load out of GPU memory on one rank: no mpirun");
        return;
    };
    check(&job, 2, "load_short_of_memory");
}

fn case_load_short_of_memory() {
    use rand::{Rng, SeedableRng};
    let rank: usize = std::env::var("OMPI_COMM_WORLD_RANK")
        .expect("under mpirun")
        .parse()
        .unwrap();
    if rank == 1 {
        // Read by the stand-in driver once, at its first call: before any store exists.
        std::env::set_var("KVSTORE_STANDIN_MEM_GIB", (8.0 / 1024.0).to_string());
    }
    let seed: u64 = std::env::var("KVT_SEED").unwrap().parse().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut random = |n: usize| -> Vec<f64> { (0..n).map(|_| rng.gen_range(-4.0..4.0)).collect() };
    let kv = KvStore::create("dist_device_sync").expect("a dist_device_sync store");
    let (r, n) = (kv.rank(), kv.num_workers());
    assert_eq!(r, rank);
    let mine = gpu(kv.local_rank() % gpu_count());
    // Key 1, held before the load, and its value in the checkpoint (every rank draws both).
    let (small, big) = (1000, 2_000_000);
    let before = random(small);
    let saved = random(small);
    kv.init(
        1,
        &NDArray::from_f64(&before, [small], DType::F32, mine).unwrap(),
    )
    .unwrap();
    // Rank 0 writes a single-file checkpoint of key 1 and three keys of 8 MiB, which a store
    // of 2 ranks slices: 4 MiB of each on every rank.
    let dir = std::path::PathBuf::from(std::env::var("KVT_DIR").unwrap());
    let file = dir.join("short.kvs");
    if r == 0 {
        std::fs::create_dir_all(&dir).unwrap();
        let local = KvStore::create("local").unwrap();
        local
            .init(
                1,
                &NDArray::from_f64(&saved, [small], DType::F32, Device::Cpu(0)).unwrap(),
            )
            .unwrap();
        for k in 10..13 {
            let v = NDArray::from_f64(&random(big), [big], DType::F32, Device::Cpu(0)).unwrap();
            local.init(k, &v).unwrap();
        }
        local.save(&file).unwrap();
    }
    kv.barrier().unwrap();
    let err = kv
        .load(&file)
        .expect_err("a load that rank 1 cannot hold must fail on every rank");
    match (r, &err) {
        (1, Error::OutOfMemory { .. }) | (0, Error::RankFailed { .. }) => {}
        _ => panic!("rank {r}: {err:?}"),
    }
    // Nothing changed, on either rank: key 1 keeps its value, the new keys do not exist, and
    // the store goes on.
    let out = NDArray::full_on([small], f64::NAN, DType::F32, mine).unwrap();
    kv.pull(1, &out).unwrap();
    let want: Vec<f32> = before.iter().map(|&x| x as f32).collect();
    assert_eq!(
        out.to_vec::<f32>().unwrap(),
        want,
        "rank {r}: key 1 changed"
    );
    // (Outs in host memory: rank 1's GPU cannot hold them.)
    for k in 10..13 {
        let got = kv.pull(k, &NDArray::zeros([big]));
        assert!(
            matches!(got, Err(Error::UnknownKey { .. })),
            "rank {r}: key {k} after the failed load: {got:?}"
        );
    }
    kv.push(
        1,
        &NDArray::from_f64(&saved, [small], DType::F32, mine).unwrap(),
    )
    .unwrap();
    kv.barrier().unwrap();
    if r == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    ok_line(
        r,
        n,
        "load_short_of_memory",
        &err.to_string().replace('\n', " "),
    );
}

/// The calls this thread has made to the stand-in's `name`; `None` on a real driver.
fn standin_calls(name: &str) -> Option<u64> {
    type Count = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;
    // SAFETY: loading the libcuda.so the store already loaded (the same mapping).
    let lib = unsafe { libloading::Library::new("libcuda.so") }.ok()?;
    // SAFETY: the stand-in exports this symbol with exactly this signature.
    let f: libloading::Symbol<Count> =
        unsafe { lib.get(b"kvstore_standin_thread_calls\0") }.ok()?;
    let c = std::ffi::CString::new(name).expect("no NUL");
    // SAFETY: a valid NUL-terminated string.
    Some(unsafe { f(c.as_ptr()) })
}

#[test]
#[ignore = "run on every rank by the other tests"]
fn inner() {
    // Run directly (`--ignored`), there is no case: the outer tests set one.
    let Ok(case) = std::env::var(CASE_VAR) else {
        println!("SKIPPED: inner: the entry point of the jobs the other tests start, run alone");
        return;
    };
    match case.as_str() {
        "gpu_store" => case_gpu_store(),
        "many_keys" => case_many_keys(),
        "sliced" => case_sliced(),
        "bad_env" => case_bad_env(),
        "sparse_compressed" => case_sparse_compressed(),
        "load_short_of_memory" => case_load_short_of_memory(),
        other => panic!("unknown case {other}"),
    }
}

/// Rank `rank`'s gradient of key `key` in round `round`: values every rank can recompute.
fn grad(rank: usize, key: i32, round: usize, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let x = (rank * 131 + key as usize * 17 + round * 7 + i * 3) % 23;
            x as f64 / 8.0 - 1.25
        })
        .collect()
}

fn case_gpu_store() {
    let comm_id = std::env::var_os("NCCL_COMM_ID");
    let kv = KvStore::create("dist_device_sync").expect("a dist_device_sync store");
    // Making the store changed nothing process-wide: NCCL_COMM_ID is as it was, and, when it
    // was unset, a later NCCL communicator of this process (torch.distributed's) is not forced
    // onto the store's address: two plain ids differ (with NCCL_COMM_ID set, NCCL and the
    // stand-in derive both from the address and a fixed magic).
    assert_eq!(
        std::env::var_os("NCCL_COMM_ID"),
        comm_id,
        "making the store changed NCCL_COMM_ID"
    );
    if comm_id.is_none() {
        use kvstore::__internal::nccl::RankComm;
        let (a, b) = (
            RankComm::unique_id().unwrap(),
            RankComm::unique_id().unwrap(),
        );
        assert_ne!(
            a.0, b.0,
            "two plain ncclGetUniqueId calls after the store was made gave the same id"
        );
    }
    let (r, n) = (kv.rank(), kv.num_workers());
    let mine = gpu(kv.local_rank() % gpu_count());
    let len = 6;
    let keys = [3, 5];
    // Rank 0's values win; the others pass something else.
    let init: Vec<NDArray> = keys
        .iter()
        .map(|&k| {
            let v: Vec<f64> = (0..len).map(|i| (k as f64) + i as f64 / 4.0).collect();
            let v = if r == 0 { v } else { vec![-99.0; len] };
            NDArray::from_f64(&v, [len], DType::F32, mine).unwrap()
        })
        .collect();
    kv.init_list(&keys, &init).unwrap();
    for &k in &keys {
        assert_eq!(
            kv.meta(k).unwrap().2,
            mine,
            "key {k} lives on this rank's GPU"
        );
    }
    let (lr, momentum) = (0.1, 0.9);
    kv.set_updater(Updater::Sgd(Sgd {
        lr,
        momentum,
        ..Sgd::default()
    }))
    .unwrap();
    // The reference: SGD with momentum in f64 on the sum of every rank's gradients.
    let mut w: Vec<Vec<f64>> = keys
        .iter()
        .map(|&k| (0..len).map(|i| (k as f64) + i as f64 / 4.0).collect())
        .collect();
    let mut m = vec![vec![0.0; len]; keys.len()];
    // Each rank pushes one value from its GPU and one from host memory.
    let push_round = |round: usize| {
        let values: Vec<Vec<NDArray>> = keys
            .iter()
            .map(|&k| {
                let g = grad(r, k, round, len);
                let half: Vec<f64> = g.iter().map(|x| x / 2.0).collect();
                vec![
                    NDArray::from_f64(&half, [len], DType::F32, mine).unwrap(),
                    NDArray::from_f64(&half, [len], DType::F32, Device::Cpu(0)).unwrap(),
                ]
            })
            .collect();
        kv.push_list(&keys, &values).unwrap();
    };
    // A round, in the store and in the reference, then both compared.
    let checked_round = |round: usize, w: &mut Vec<Vec<f64>>, m: &mut Vec<Vec<f64>>| {
        push_round(round);
        for (j, &k) in keys.iter().enumerate() {
            for i in 0..len {
                let total: f64 = (0..n).map(|rank| grad(rank, k, round, len)[i]).sum();
                m[j][i] = momentum * m[j][i] - lr * total;
                w[j][i] += m[j][i];
            }
        }
        let on_gpu = NDArray::full_on([len], 0.0, DType::F32, mine).unwrap();
        let on_host = NDArray::zeros([len]).astype(DType::F64).unwrap();
        for (j, &k) in keys.iter().enumerate() {
            kv.pull(k, &[on_gpu.clone(), on_host.clone()]).unwrap();
            for out in [&on_gpu, &on_host] {
                let got = out.to_vec::<f64>().unwrap();
                for i in 0..len {
                    let want = w[j][i];
                    assert!(
                        (got[i] - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "rank {r} round {round} key {k}[{i}] on {}: {} vs {want}",
                        out.device(),
                        got[i]
                    );
                }
            }
        }
    };
    for round in 0..3 {
        checked_round(round, &mut w, &mut m);
    }
    // Bad input on the last rank: its own error there, RankRejected elsewhere.
    let bad = if r + 1 == n {
        kv.push(3, &NDArray::ones([len + 1])).unwrap_err()
    } else {
        kv.push(3, &NDArray::ones([len])).unwrap_err()
    };
    match (&bad, r + 1 == n) {
        (Error::ShapeMismatch { .. }, true) | (Error::RankRejected { .. }, false) => {}
        _ => panic!("rank {r}: {bad:?}"),
    }
    // A sharded save, loaded back into a single-process store.
    let dir = std::path::PathBuf::from(std::env::var("KVT_DIR").expect("the checkpoint folder"));
    kv.barrier().unwrap();
    kv.save(&dir).unwrap();
    kv.barrier().unwrap();
    let local = KvStore::create("local").unwrap();
    local.load(&dir).unwrap();
    for (j, &k) in keys.iter().enumerate() {
        let out = NDArray::zeros([len]).astype(DType::F64).unwrap();
        local.pull(k, &out).unwrap();
        let got = out.to_vec::<f64>().unwrap();
        for i in 0..len {
            assert!((got[i] - w[j][i]).abs() <= 1e-5 * w[j][i].abs().max(1.0));
        }
    }
    // The save loaded back into the store itself after one more round (other gradients): the
    // round is undone, values and momentum alike (the momentum copied into the state buffers
    // the keys have), so the reference's next round follows.
    push_round(7);
    kv.load(&dir).unwrap();
    checked_round(3, &mut w, &mut m);
    kv.barrier().unwrap();
    if r == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    ok_line(r, n, "gpu_store", &format!("gpu={mine}"));
}

fn case_many_keys() {
    use rand::{Rng, SeedableRng};
    let kv = KvStore::create("dist_device_sync").expect("a dist_device_sync store");
    let (r, n) = (kv.rank(), kv.num_workers());
    let mine = gpu(kv.local_rank() % gpu_count());
    // 1000 small keys of two dtypes and a few lengths, and one key big enough to travel alone.
    let mut lens: Vec<(usize, DType)> = (0..1000)
        .map(|i| (1 + i % 13, if i % 5 == 0 { DType::F16 } else { DType::F32 }))
        .collect();
    lens.push((70_000, DType::F32));
    let keys: Vec<i32> = (0..lens.len() as i32).collect();
    let random = |seed: u64, len: usize| -> Vec<f64> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        // Multiples of 1/8 in [-4, 4): sums of two are exact in f16.
        (0..len)
            .map(|_| rng.gen_range(-32..32) as f64 / 8.0)
            .collect()
    };
    let init: Vec<NDArray> = lens
        .iter()
        .enumerate()
        .map(|(k, &(len, dt))| NDArray::from_f64(&random(k as u64, len), [len], dt, mine).unwrap())
        .collect();
    kv.init_list(&keys, &init).unwrap();
    // No updater: a push stores the sum of every rank's values.
    let grad = |rank: usize, k: usize, len: usize| {
        random(1_000_000 + 10_000 * rank as u64 + k as u64, len)
    };
    let values: Vec<NDArray> = lens
        .iter()
        .enumerate()
        .map(|(k, &(len, dt))| NDArray::from_f64(&grad(r, k, len), [len], dt, mine).unwrap())
        .collect();
    let before = standin_calls("ncclReduce");
    kv.push_list(&keys, &values).unwrap();
    let reduces = standin_calls("ncclReduce").zip(before).map(|(a, b)| a - b);
    let outs: Vec<NDArray> = lens
        .iter()
        .map(|&(len, dt)| NDArray::full_on([len], -7.0, dt, mine).unwrap())
        .collect();
    let before = standin_calls("ncclBroadcast");
    kv.pull_list(&keys, &outs).unwrap();
    let broadcasts = standin_calls("ncclBroadcast")
        .zip(before)
        .map(|(a, b)| a - b);
    for (k, (&(len, _), out)) in lens.iter().zip(&outs).enumerate() {
        let got = out.to_vec::<f64>().unwrap();
        let parts: Vec<Vec<f64>> = (0..n).map(|rank| grad(rank, k, len)).collect();
        for (i, got) in got.iter().enumerate() {
            let want: f64 = parts.iter().map(|p| p[i]).sum();
            assert_eq!(*got, want, "rank {r}: key {k}[{i}]");
        }
    }
    // Homes × dtypes packed buffers, and the big key alone.
    let most = (2 * n + 1) as u64;
    let detail = match (reduces, broadcasts) {
        (Some(red), Some(bc)) => {
            assert!(
                red <= most,
                "rank {r}: the push made {red} NCCL reduces, more than {most}"
            );
            assert!(
                bc <= most,
                "rank {r}: the pull made {bc} NCCL broadcasts, more than {most}"
            );
            format!("reduces={red} broadcasts={bc}")
        }
        _ => "SKIPPED: the NCCL call count (not the stand-in driver)".to_owned(),
    };
    ok_line(r, n, "many_keys", &detail);
}

fn case_sliced() {
    use rand::{Rng, SeedableRng};
    let kv = KvStore::create("dist_device_sync").expect("a dist_device_sync store");
    let (r, n) = (kv.rank(), kv.num_workers());
    let mine = gpu(kv.local_rank() % gpu_count());
    let seed: u64 = std::env::var("KVT_SEED")
        .expect("KVT_SEED")
        .parse()
        .expect("a seed");
    // Two keys over the bound of 64 elements (lengths that leave the last slice shorter), one
    // under it.
    let shapes: Vec<Shape> = [&[1001][..], &[33, 31], &[10]]
        .iter()
        .map(|d| Shape::new(d).unwrap())
        .collect();
    let keys = [0, 1, 2];
    let sliced = 2;
    let random = |salt: u64, len: usize| -> Vec<f64> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ salt);
        (0..len)
            .map(|_| rng.gen_range(-32..32) as f64 / 8.0)
            .collect()
    };
    let len = |k: usize| shapes[k].size();
    // Rank 0's values win; the others pass something else.
    let init: Vec<NDArray> = (0..keys.len())
        .map(|k| {
            let v = match r {
                0 => random(k as u64, len(k)),
                _ => vec![-99.0; len(k)],
            };
            NDArray::from_f64(&v, shapes[k], DType::F32, mine).unwrap()
        })
        .collect();
    let before = standin_calls("ncclBroadcast");
    kv.init_list(&keys, &init).unwrap();
    // An init scatters each sliced key, a broadcast per slice but rank 0's own (NCCL has no
    // scatter), and sends the small key packed.
    let init_broadcasts = standin_calls("ncclBroadcast")
        .zip(before)
        .map(|(a, b)| a - b);
    let (lr, momentum) = (0.1, 0.9);
    kv.set_updater(Updater::Sgd(Sgd {
        lr,
        momentum,
        ..Sgd::default()
    }))
    .unwrap();
    let grad = |rank: usize, k: usize, round: usize| {
        random(
            1_000 + 100 * round as u64 + 10 * rank as u64 + k as u64,
            len(k),
        )
    };
    let mut w: Vec<Vec<f64>> = (0..keys.len()).map(|k| random(k as u64, len(k))).collect();
    let mut m: Vec<Vec<f64>> = (0..keys.len()).map(|k| vec![0.0; len(k)]).collect();
    let calls = |name: &str| standin_calls(name);
    let mut counts = Vec::new();
    for round in 0..3 {
        // Each rank pushes half of its gradient from its GPU and half from host memory.
        let values: Vec<Vec<NDArray>> = (0..keys.len())
            .map(|k| {
                let half: Vec<f64> = grad(r, k, round).iter().map(|x| x / 2.0).collect();
                vec![
                    NDArray::from_f64(&half, shapes[k], DType::F32, mine).unwrap(),
                    NDArray::from_f64(&half, shapes[k], DType::F32, Device::Cpu(0)).unwrap(),
                ]
            })
            .collect();
        let before = calls("ncclReduceScatter");
        kv.push_list(&keys, &values).unwrap();
        counts.push(calls("ncclReduceScatter").zip(before).map(|(a, b)| a - b));
        for k in 0..keys.len() {
            let total: Vec<f64> = (0..len(k))
                .map(|i| (0..n).map(|rank| grad(rank, k, round)[i]).sum())
                .collect();
            for i in 0..len(k) {
                m[k][i] = momentum * m[k][i] - lr * total[i];
                w[k][i] += m[k][i];
            }
        }
        let on_gpu: Vec<NDArray> = (0..keys.len())
            .map(|k| NDArray::full_on(shapes[k], -7.0, DType::F32, mine).unwrap())
            .collect();
        let on_host: Vec<NDArray> = (0..keys.len())
            .map(|k| NDArray::zeros(shapes[k]).astype(DType::F64).unwrap())
            .collect();
        let outs: Vec<Vec<NDArray>> = (0..keys.len())
            .map(|k| vec![on_gpu[k].clone(), on_host[k].clone()])
            .collect();
        let before = calls("ncclAllGather");
        kv.pull_list(&keys, &outs).unwrap();
        counts.push(calls("ncclAllGather").zip(before).map(|(a, b)| a - b));
        for k in 0..keys.len() {
            for out in &outs[k] {
                let got = out.to_vec::<f64>().unwrap();
                for (i, (&got, &want)) in got.iter().zip(&w[k]).enumerate() {
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "rank {r} round {round} key {k}[{i}] on {}: {got} vs {want}",
                        out.device()
                    );
                }
            }
        }
    }
    // A sharded save of the slices, loaded back whole into a single-process store.
    let dir = std::path::PathBuf::from(std::env::var("KVT_DIR").expect("the checkpoint folder"));
    kv.barrier().unwrap();
    kv.save(&dir).unwrap();
    kv.barrier().unwrap();
    let local = KvStore::create("local").unwrap();
    local.load(&dir).unwrap();
    // And into a fresh store of the same ranks, which slices the big keys again.
    let again = KvStore::create("dist_device_sync").unwrap();
    again
        .set_updater(Updater::Sgd(Sgd {
            lr,
            momentum,
            ..Sgd::default()
        }))
        .unwrap();
    again.load(&dir).unwrap();
    for k in 0..keys.len() {
        let out = NDArray::zeros(shapes[k]).astype(DType::F64).unwrap();
        local.pull(keys[k], &out).unwrap();
        let on_gpu = NDArray::full_on(shapes[k], -7.0, DType::F32, mine).unwrap();
        again.pull(keys[k], &on_gpu).unwrap();
        for got in [
            out.to_vec::<f64>().unwrap(),
            on_gpu.to_vec::<f64>().unwrap(),
        ] {
            for (got, want) in got.iter().zip(&w[k]) {
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{got} vs {want}"
                );
            }
        }
    }
    // One more step on the reloaded store: each rank's momentum slice came back with its values.
    let round = 3;
    let values: Vec<NDArray> = (0..keys.len())
        .map(|k| NDArray::from_f64(&grad(r, k, round), shapes[k], DType::F32, mine).unwrap())
        .collect();
    again.push_list(&keys, &values).unwrap();
    for k in 0..keys.len() {
        for i in 0..len(k) {
            let total: f64 = (0..n).map(|rank| grad(rank, k, round)[i]).sum();
            m[k][i] = momentum * m[k][i] - lr * total;
            w[k][i] += m[k][i];
        }
        let on_gpu = NDArray::full_on(shapes[k], -7.0, DType::F32, mine).unwrap();
        again.pull(keys[k], &on_gpu).unwrap();
        for (i, (got, want)) in on_gpu
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .zip(&w[k])
            .enumerate()
        {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "rank {r}: key {k}[{i}] after the reload's step: {got} vs {want}"
            );
        }
    }
    kv.barrier().unwrap();
    if r == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    // One reduce-scatter per sliced key and push, one all-gather per sliced key and pull.
    let detail = match (
        counts.iter().copied().collect::<Option<Vec<u64>>>(),
        init_broadcasts,
    ) {
        (Some(c), Some(init)) => {
            assert!(
                c.iter().all(|&c| c == sliced),
                "rank {r}: NCCL reduce-scatters and all-gathers per call {c:?}, not {sliced} each"
            );
            let want = sliced * (n as u64 - 1) + 1;
            assert_eq!(init, want, "rank {r}: the init's NCCL broadcasts");
            format!("collectives={c:?} init_broadcasts={init}")
        }
        _ => "SKIPPED: the NCCL call count (not the stand-in driver)".to_owned(),
    };
    ok_line(r, n, "sliced", &detail);
}

fn case_bad_env() {
    let err = KvStore::create("dist_device_sync")
        .err()
        .expect("a bad launch is an error");
    match &err {
        Error::DistEnv { var, .. } if var == "LOCAL_RANK" => {}
        other => panic!("{other:?}"),
    }
    ok_line(0, 1, "bad_env", "");
}

/// One store with `KVT_WIRE`'s setting: 2-bit compression (threshold 0.5), the bfloat16 wire,
/// or row-sparse keys (no compression). Keys: one of 40 × 7 elements, sliced over the ranks
/// (the bound is 64), and one of 6 × 3, whole on a rank. Every value is fresh for the run's
/// seed; every rank recomputes every rank's pushes for the reference.
fn case_sparse_compressed() {
    use half::bf16;
    use kvstore::{Compression, RowSparse};
    use rand::{Rng, SeedableRng};
    let wire = std::env::var("KVT_WIRE").expect("KVT_WIRE");
    let seed: u64 = std::env::var("KVT_SEED")
        .expect("KVT_SEED")
        .parse()
        .expect("a seed");
    let kv = KvStore::create("dist_device_sync").expect("a dist_device_sync store");
    let (r, n) = (kv.rank(), kv.num_workers());
    let mine = gpu(kv.local_rank() % gpu_count());
    let shapes = [Shape::new(&[40, 7]).unwrap(), Shape::new(&[6, 3]).unwrap()];
    let keys = [0, 1];
    let random = |salt: u64, len: usize| -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ salt.wrapping_mul(0x9E37_79B9));
        (0..len).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
    };
    // Values from 2^-10 to 2^10 in size: their float32 sums round, so an order of additions
    // other than the reference's shows.
    let wide = |salt: u64, len: usize| -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ salt.wrapping_mul(0x85EB_CA6B));
        (0..len)
            .map(|_| rng.gen_range(-1.0f32..1.0) * 2f32.powi(rng.gen_range(-10..=10)))
            .collect()
    };
    let init: Vec<Vec<f32>> = (0..2)
        .map(|k| random(k, shapes[k as usize].size()))
        .collect();
    let on = |v: &[f32], shape: Shape, device: Device| {
        NDArray::from_vec(v.to_vec(), shape)
            .unwrap()
            .to_device(device)
            .unwrap()
    };
    // Pulls both keys into an out on this rank's GPU and one in host memory, and compares
    // each element with `want`, bit for bit.
    let pull_equals = |kv: &KvStore, want: &[Vec<f32>], what: &str| {
        for k in 0..2 {
            for device in [mine, Device::Cpu(0)] {
                let out = on(&vec![-7.0; shapes[k].size()], shapes[k], device);
                kv.pull(keys[k], &out).unwrap();
                let got = out.to_vec::<f32>().unwrap();
                for (i, (g, w)) in got.iter().zip(&want[k]).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "rank {r} {what}: key {k}[{i}] on {device} is {g}, expected {w}"
                    );
                }
            }
        }
    };
    if wire == "rows" {
        kv.init_row_sparse_list(
            &keys,
            &[on(&init[0], shapes[0], mine), on(&init[1], shapes[1], mine)],
        )
        .unwrap();
        let rows_of = |k: usize| shapes[k].dims()[0];
        let width = |k: usize| shapes[k].dims()[1];
        // Rank `q`'s push of round `round` to key `k`: some rows (one id twice, so the push
        // sums it), their values.
        let push_of = |q: usize, k: usize, round: usize| -> (Vec<u64>, Vec<f32>) {
            let salt = 1_000 + 100 * round as u64 + 10 * q as u64 + k as u64;
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ salt);
            // In the last round the last rank pushes no rows to key 1.
            if round == 2 && k == 1 && q + 1 == n && n > 1 {
                return (Vec::new(), Vec::new());
            }
            let mut ids: Vec<u64> = (0..rows_of(k) / 3)
                .map(|_| rng.gen_range(0..rows_of(k) as u64))
                .collect();
            ids.push(ids[0]);
            let rows = random(salt, ids.len() * width(k));
            (ids, rows)
        };
        let mut w = init.clone();
        // SGD's momentum, per element: it changes on the rows pushed only, as the values do.
        let mut m: Vec<Vec<f32>> = (0..2).map(|k| vec![0.0; shapes[k].size()]).collect();
        let (lr, momentum) = (0.25f32, 0.5f32);
        let sgd = Updater::Sgd(Sgd {
            lr: lr.into(),
            momentum: momentum.into(),
            ..Sgd::default()
        });
        // As for compression: round 3, under mpirun, pushes to a store loaded from a sharded
        // save, whose momentum comes back with the values.
        let mut reloaded: Option<(KvStore, Option<KvStore>)> = None;
        for round in 0..4 {
            if round == 3 {
                let (local, again) = reloaded.insert(save_and_reload(&kv, |s| {
                    s.set_updater(sgd.clone()).unwrap()
                }));
                for k in keys {
                    assert!(local.is_row_sparse(k).unwrap(), "key {k} loads row-sparse");
                }
                let loaded: Vec<Vec<f32>> = (0..2)
                    .map(|k| {
                        let out = NDArray::zeros(shapes[k]);
                        local.pull(keys[k], &out).unwrap();
                        out.to_vec::<f32>().unwrap()
                    })
                    .collect();
                assert_eq!(loaded, w, "rank {r}: the values a local store loads");
                if again.is_none() {
                    break;
                }
            }
            let store = match &reloaded {
                Some((_, Some(again))) => again,
                _ => &kv,
            };
            // Round 0 assigns (no updater: the value becomes the sum, zeros elsewhere); then
            // SGD with momentum, lazily: only the rows some rank pushed change.
            if round == 1 {
                kv.set_updater(sgd.clone()).unwrap();
            }
            let pushes: Vec<Vec<RowSparse>> = (0..2)
                .map(|k| {
                    let (ids, rows) = push_of(r, k, round);
                    let dims = [ids.len(), width(k)];
                    let device = if k == 0 { mine } else { Device::Cpu(0) };
                    let rows = on(&rows, Shape::new(&dims).unwrap(), device);
                    vec![RowSparse::new(ids, rows).unwrap()]
                })
                .collect();
            store.push_row_sparse_list(&keys, &pushes).unwrap();
            for (k, (wk, mk)) in w.iter_mut().zip(m.iter_mut()).enumerate() {
                // The sum per row, rank by rank in rank order, each rank's own rows first
                // summed in their order.
                let wd = width(k);
                let mut by_rank: Vec<std::collections::BTreeMap<u64, Vec<f32>>> = Vec::new();
                for q in 0..n {
                    let (ids, rows) = push_of(q, k, round);
                    let mut own = std::collections::BTreeMap::new();
                    for (j, id) in ids.iter().enumerate() {
                        let row = &rows[j * wd..(j + 1) * wd];
                        let acc: &mut Vec<f32> = own.entry(*id).or_insert_with(|| vec![0.0; wd]);
                        for (a, x) in acc.iter_mut().zip(row) {
                            *a += x;
                        }
                    }
                    by_rank.push(own);
                }
                let mut sum: std::collections::BTreeMap<u64, Vec<f32>> = Default::default();
                for own in &by_rank {
                    for (id, row) in own {
                        match sum.get_mut(id) {
                            None => {
                                sum.insert(*id, row.clone());
                            }
                            Some(acc) => acc.iter_mut().zip(row).for_each(|(a, x)| *a += x),
                        }
                    }
                }
                if round == 0 {
                    wk.iter_mut().for_each(|x| *x = 0.0);
                }
                for (id, g) in &sum {
                    let at = *id as usize * wd..(*id as usize + 1) * wd;
                    for ((x, v), g) in wk[at.clone()].iter_mut().zip(&mut mk[at]).zip(g) {
                        if round == 0 {
                            *x = *g;
                            continue;
                        }
                        *v = momentum * *v - lr * g;
                        *x += *v;
                    }
                }
            }
            if round == 0 {
                pull_equals(store, &w, &format!("round {round} (assign)"));
                continue;
            }
            // The host's SGD (GPU ranks update rows in host memory) computes as the reference
            // does, in float32: bit for bit.
            pull_equals(store, &w, &format!("round {round} (sgd)"));
            for k in 0..2 {
                // The rows rank 0 pushed this round, and row 0, read by rows.
                let mut ids = push_of(0, k, round).0;
                ids.push(0);
                let got = store.row_sparse_pull(keys[k], &ids).unwrap();
                ids.sort_unstable();
                ids.dedup();
                assert_eq!(
                    got.ids(),
                    &ids[..],
                    "rank {r}: the ids row_sparse_pull gives"
                );
                let rows = got.rows().to_vec::<f32>().unwrap();
                for (j, id) in ids.iter().enumerate() {
                    let wd = width(k);
                    let want = &w[k][*id as usize * wd..(*id as usize + 1) * wd];
                    for (g, w) in rows[j * wd..(j + 1) * wd].iter().zip(want) {
                        assert_eq!(g.to_bits(), w.to_bits(), "row {id}: {g} vs {w}");
                    }
                }
            }
        }
        ok_line(r, n, "sparse_compressed", &format!("rows {}", sends_seen()));
        return;
    }
    let compression = match wire.as_str() {
        "2bit" => Compression::two_bit(0.5),
        "bf16" => Compression::bf16(),
        other => panic!("unknown KVT_WIRE {other}"),
    };
    kv.set_gradient_compression(compression).unwrap();
    kv.init_list(
        &keys,
        &[on(&init[0], shapes[0], mine), on(&init[1], shapes[1], mine)],
    )
    .unwrap();
    // What a rank sends of `x` (value plus residual), and the residual it keeps.
    let send = |x: f32| -> (f32, f32) {
        let sent = match wire.as_str() {
            "2bit" if x >= 0.5 => 0.5,
            "2bit" if x <= -0.5 => -0.5,
            "2bit" => 0.0,
            _ => bf16::from_f32(x).to_f32(),
        };
        (sent, x - sent)
    };
    // Every rank's residual of every key, as the reference keeps them.
    let mut residual: Vec<Vec<Vec<f32>>> = (0..n)
        .map(|_| (0..2).map(|k| vec![0.0; shapes[k].size()]).collect())
        .collect();
    // Rounds 0 to 2 on `kv`; then a sharded save, loaded into a single-process store (the
    // values) and, under mpirun, into a fresh store of the same ranks, which round 3 pushes to:
    // each rank's residuals come back from its shard, so it sends what `kv` would have sent.
    let mut reloaded: Option<(KvStore, Option<KvStore>)> = None;
    let mut want: Vec<Vec<f32>> = Vec::new();
    for round in 0..4 {
        if round == 3 {
            let (local, again) = reloaded.insert(save_and_reload(&kv, |s| {
                s.set_gradient_compression(compression).unwrap()
            }));
            pull_equals(local, &want, &format!("{wire} loaded into a local store"));
            if again.is_none() {
                break;
            }
        }
        let store = match &reloaded {
            Some((_, Some(again))) => again,
            _ => &kv,
        };
        // Rank `q`'s pushed values of key `k`: one for key 0, three for key 1 (which the rank
        // sums in list order, in float32, before it compresses).
        let values_of = |q: usize, k: usize| -> Vec<Vec<f32>> {
            let salt = 1_000 + 100 * round + 10 * q as u64 + k as u64;
            let len = shapes[k].size();
            match k {
                0 => vec![wide(salt, len)],
                _ => (0..3).map(|j| wide(salt + 5_000 * j, len)).collect(),
            }
        };
        let grad = |q: usize, k: usize| -> Vec<f32> {
            let vs = values_of(q, k);
            (0..shapes[k].size())
                .map(|i| vs.iter().skip(1).fold(vs[0][i], |acc, v| acc + v[i]))
                .collect()
        };
        // This rank's push: key 0 from its GPU, key 1 from its GPU, host memory and its GPU.
        let values: Vec<Vec<NDArray>> = (0..2)
            .map(|k| {
                let devices = [mine, Device::Cpu(0), mine];
                (values_of(r, k).iter().zip(devices))
                    .map(|(v, d)| on(v, shapes[k], d))
                    .collect()
            })
            .collect();
        store.push_list(&keys, &values).unwrap();
        // No updater (assign): each key becomes the sum of what every rank sent, in rank order.
        want = (0..2).map(|k| vec![0.0; shapes[k].size()]).collect();
        for (q, res) in residual.iter_mut().enumerate() {
            for k in 0..2 {
                let g = grad(q, k);
                for i in 0..g.len() {
                    let (sent, left) = send(g[i] + res[k][i]);
                    res[k][i] = left;
                    want[k][i] = match q {
                        0 => sent,
                        _ => want[k][i] + sent,
                    };
                }
            }
        }
        pull_equals(store, &want, &format!("{wire} round {round}"));
    }
    ok_line(
        r,
        n,
        "sparse_compressed",
        &format!("{wire} {}", sends_seen()),
    );
}

/// Saves `kv` (sharded) to `KVT_DIR`, and loads the save into a single-process store and,
/// under mpirun, into a fresh `dist_device_sync` store of the same ranks (`setup` first: its
/// compression, its updater). The folder is gone when this returns.
fn save_and_reload(kv: &KvStore, setup: impl Fn(&KvStore)) -> (KvStore, Option<KvStore>) {
    let dir = std::path::PathBuf::from(std::env::var("KVT_DIR").expect("the checkpoint folder"));
    kv.barrier().unwrap();
    kv.save(&dir).unwrap();
    kv.barrier().unwrap();
    let local = KvStore::create("local").unwrap();
    local.load(&dir).unwrap();
    // A second store of GPU ranks started without MPI would join NCCL again with the same id.
    let under_mpirun = std::env::var("KVT_MPI").expect("KVT_MPI") == "1";
    let again = under_mpirun.then(|| {
        let again = KvStore::create("dist_device_sync").unwrap();
        setup(&again);
        again.load(&dir).unwrap();
        again
    });
    kv.barrier().unwrap();
    if kv.rank() == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    (local, again)
}

/// On the stand-in driver: the NCCL sends this rank made, which must be some where the ranks
/// were started without MPI (the all-to-alls go over NCCL) and none under `mpirun` (they go
/// over MPI).
fn sends_seen() -> String {
    let Some(sends) = standin_calls("ncclSend") else {
        return "SKIPPED: the NCCL send count (not the stand-in driver)".to_owned();
    };
    let without_mpi = std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none();
    assert_eq!(
        sends > 0,
        without_mpi,
        "{sends} NCCL sends on ranks started {} MPI",
        if without_mpi { "without" } else { "by" }
    );
    format!("nccl_sends={sends}")
}

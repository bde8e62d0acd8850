#!/usr/bin/env bash
# Runs the `#[ignore = "needs a GPU"]` tests against the stand-in driver
# (tools/stand-in-driver): a libcuda.so + libnccl.so built here that runs kernels on the PTX
# interpreter and checks stream ordering, launches, memory and NCCL call sequences.
#
# THIS IS NOT A GPU RUN. Nothing it prints is a GPU result; the real run is scripts/gpu-check.sh
# on a GPU machine.
#
# Usage: scripts/standin-gpu-tests.sh [cargo test filter args...]
#   e.g. scripts/standin-gpu-tests.sh --test gpu_store
# Environment: KVSTORE_STANDIN_GPUS (default 2 here), KVSTORE_STANDIN_SM (default 90), and the
# others listed in tools/stand-in-driver/src/lib.rs.
set -euo pipefail
cd "$(dirname "$0")/.."

banner() {
    echo "=================================================================="
    echo "  STAND-IN DRIVER RUN (not a GPU)"
    echo "  $1"
    echo "=================================================================="
}

banner "building tools/stand-in-driver"
# Its own target folder inside target/, so it never invalidates the main build.
cargo build --release --offline --quiet \
    --manifest-path tools/stand-in-driver/Cargo.toml \
    --target-dir target/standin-build 2>&1 || \
cargo build --release --quiet \
    --manifest-path tools/stand-in-driver/Cargo.toml \
    --target-dir target/standin-build

# One file under both names: the loader maps it once (same inode), so the driver half and the
# NCCL half share one state.
lib_dir="$PWD/target/standin-lib"
mkdir -p "$lib_dir"
cp -f target/standin-build/release/libkvstore_stand_in_driver.so "$lib_dir/libkvstore_stand_in.so"
ln -sf libkvstore_stand_in.so "$lib_dir/libcuda.so"
ln -sf libkvstore_stand_in.so "$lib_dir/libnccl.so"

export LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVSTORE_STANDIN_GPUS="${KVSTORE_STANDIN_GPUS:-2}"
# Several ranks on one GPU (the two-rank NCCL tests): allowed from NCCL 2.30 with this set.
export NCCL_MULTI_RANK_GPU_ENABLE="${NCCL_MULTI_RANK_GPU_ENABLE:-1}"
# The tests read this to use smaller shapes on the interpreter (never on a real GPU).
export KVSTORE_STANDIN=1

log="target/standin-lib/last-run.log"
banner "cargo test -- --ignored  (${KVSTORE_STANDIN_GPUS} stand-in GPUs, sm_${KVSTORE_STANDIN_SM:-90})"
start=$(date +%s)
status=0
# The strictness tests of the stand-in itself (no GPU code of the store involved).
# They need two devices, whatever KVSTORE_STANDIN_GPUS says for the store's tests.
KVSTORE_STANDIN_GPUS=2 cargo test --release --offline --quiet \
    --manifest-path tools/stand-in-driver/Cargo.toml \
    --target-dir target/standin-build 2>&1 | tee "$log.strict" || status=1
# Every GPU test of the store, on the stand-in. Test threads: the stand-in serializes on one
# lock, so more threads only add contention.
# --show-output: the stdout of passing tests too, so their SKIPPED lines are counted.
# --no-fail-fast: every test binary runs even after one fails, so the counts are the true ones
# (without it, a fault that fails one binary hid every later binary's failures).
cargo test --offline --no-fail-fast "$@" -- --ignored --show-output \
    --test-threads "${KVSTORE_STANDIN_THREADS:-2}" 2>&1 | tee "$log" || status=1
took=$(( $(date +%s) - start ))

passed=$(grep -Eo '[0-9]+ passed' "$log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' "$log" | awk '{s+=$1} END {print s+0}')
# Distinct tests that printed SKIPPED (a test may print it once per case it skips).
skipped=$({ grep '^SKIPPED:' "$log" || true; } | awk -F': ' '{print $2}' | sort -u | wc -l)
rejections=$(grep -c '^\[kvstore stand-in\]' "$log" || true)
strict=$(grep -Eo '[0-9]+ passed' "$log.strict" | awk '{s+=$1} END {print s+0}')
strict_failed=$(grep -Eo '[0-9]+ failed' "$log.strict" | awk '{s+=$1} END {print s+0}')
# A test that printed SKIPPED did not run its case: it is not a pass.
ran=$(( passed - skipped ))
banner "summary: GPU tests ${ran} passed, ${skipped} SKIPPED (not passes), ${failed} failed, \
${rejections} stand-in rejections on stderr; stand-in strictness tests ${strict} passed, \
${strict_failed} failed; \
${took}s. Not a GPU result."
grep '^SKIPPED:' "$log" | sed 's/^/    /' || true
# Ranks in separate processes form one communicator on the stand-in (through /dev/shm): the
# multi-process NCCL tests must run here, so a SKIPPED from one of them fails the run.
if grep -E '^SKIPPED: (dist_device_sync_.*_on_[2-9]_ranks|ranks_in_processes_launched_like_torchrun|a_killed_rank_ends_the_others_with_an_error_not_a_hang):' "$log"; then
    echo "multi-process NCCL tests were skipped on the stand-in, which spans processes" >&2
    status=1
fi
exit "$status"

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
# Environment: KVSTORE_STANDIN_GPUS (default 2 here), KVSTORE_STANDIN_SM (default 90),
# KVSTORE_STANDIN_NCCL_SONAME (libnccl.so, or libnccl.so.2), and the others listed in
# tools/stand-in-driver/README.md.
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
# NCCL half share one state. KVSTORE_STANDIN_NCCL_SONAME=libnccl.so.2 installs the NCCL half
# only under the name pip's nvidia-nccl-cu* wheels and the distributions ship, in a folder of
# its own (python/ci.sh puts target/standin-lib on the path of processes that import torch,
# whose own NCCL a libnccl.so.2 there would replace).
soname="${KVSTORE_STANDIN_NCCL_SONAME:-libnccl.so}"
case "$soname" in
    libnccl.so) lib_dir="$PWD/target/standin-lib" ;;
    libnccl.so.2) lib_dir="$PWD/target/standin-lib-so2" ;;
    *) echo "KVSTORE_STANDIN_NCCL_SONAME=$soname: use libnccl.so or libnccl.so.2" >&2; exit 2 ;;
esac
mkdir -p "$lib_dir"
cp -f target/standin-build/release/libkvstore_stand_in_driver.so "$lib_dir/libkvstore_stand_in.so"
ln -sf libkvstore_stand_in.so "$lib_dir/libcuda.so"
ln -sf libkvstore_stand_in.so "$lib_dir/$soname"

export LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVSTORE_STANDIN_GPUS="${KVSTORE_STANDIN_GPUS:-2}"
# Several ranks on one GPU (the two-rank NCCL tests): allowed from NCCL 2.30 with this set.
export NCCL_MULTI_RANK_GPU_ENABLE="${NCCL_MULTI_RANK_GPU_ENABLE:-1}"
# The tests read this to use smaller shapes on the interpreter (never on a real GPU).
export KVSTORE_STANDIN=1

log="$lib_dir/last-run.log"
# Every test process appends its counters (blocks launched and idle, pageable upload bytes)
# here at exit, for the summary.
totals="$lib_dir/totals.tsv"
rm -f "$totals"
banner "cargo test -- --ignored  (${KVSTORE_STANDIN_GPUS} stand-in GPUs, sm_${KVSTORE_STANDIN_SM:-90}, NCCL as $soname)"
start=$(date +%s)
status=0
# The strictness tests of the stand-in itself (no GPU code of the store involved).
# They need two devices, whatever KVSTORE_STANDIN_GPUS says for the store's tests.
# --show-output: a test that could not run says SKIPPED on its stdout.
KVSTORE_STANDIN_GPUS=2 cargo test --release --offline --quiet \
    --manifest-path tools/stand-in-driver/Cargo.toml \
    --target-dir target/standin-build -- --show-output 2>&1 | tee "$log.strict" || status=1
echo "=== the store's GPU tests"
# Every GPU test of the store, on the stand-in. Test threads: the stand-in serializes on one
# lock, so more threads only add contention.
# --show-output: the stdout of passing tests too, so their SKIPPED lines are counted.
# --no-fail-fast: every test binary runs even after one fails, so the counts are the true ones
# (without it, a fault that fails one binary hid every later binary's failures).
KVSTORE_STANDIN_TOTALS="$totals" cargo test --offline --no-fail-fast "$@" -- --ignored \
    --show-output --test-threads "${KVSTORE_STANDIN_THREADS:-2}" 2>&1 | tee "$log" || status=1
took=$(( $(date +%s) - start ))

# Counted from libtest's "test result:" lines only: a test's own output may say "3 failed".
count() { { grep -a '^test result:' "$1" || true; } | grep -Eo "[0-9]+ $2" | awk '{s+=$1} END {print s+0}'; }
passed=$(count "$log" passed)
failed=$(count "$log" failed)
# Distinct tests that printed SKIPPED (a test may print it once per case it skips).
skipped=$({ grep '^SKIPPED:' "$log" || true; } | awk -F': ' '{print $2}' | sort -u | wc -l)
rejections=$(grep -c '^\[kvstore stand-in\]' "$log" || true)
strict=$(count "$log.strict" passed)
# A strictness test that could not run (no ptxas for the register check) says SKIPPED.
strict_skipped=$({ grep '^SKIPPED:' "$log.strict" || true; } | wc -l)
strict=$(( strict - strict_skipped ))
strict_failed=$(count "$log.strict" failed)
# A test that printed SKIPPED did not run its case: it is not a pass.
ran=$(( passed - skipped ))
total_of() { awk -F'\t' -v k="$1" '$1 == k {s += $2} END {print s + 0}' "$totals" 2>/dev/null || echo 0; }
blocks=$(total_of "blocks launched")
idle=$(total_of "blocks idle")
pageable=$(total_of "pageable HtoD bytes")
idle_share=$(awk -v i="$idle" -v b="$blocks" 'BEGIN {printf "%.1f", b ? 100 * i / b : 0}')
banner "summary: GPU tests ${ran} passed, ${skipped} SKIPPED (not passes), ${failed} failed, \
${rejections} stand-in rejections on stderr; stand-in strictness tests ${strict} passed, \
${strict_skipped} SKIPPED, ${strict_failed} failed; \
kernels: ${blocks} blocks launched, ${idle} did no work (${idle_share}%); \
${pageable} bytes uploaded from pageable memory; ${took}s. Not a GPU result."
grep '^SKIPPED:' "$log" | sed 's/^/    /' || true
# Ranks in separate processes form one communicator on the stand-in (through /dev/shm): the
# multi-process NCCL tests must run here, so a SKIPPED from one of them fails the run.
if grep -E '^SKIPPED: (dist_device_sync_.*_on_[2-9]_ranks|ranks_in_processes_launched_like_torchrun|a_killed_rank_ends_the_others_with_an_error_not_a_hang|a_rank_of_another_job_is_refused_and_the_job_still_forms):' "$log"; then
    echo "multi-process NCCL tests were skipped on the stand-in, which spans processes" >&2
    status=1
fi
# With NCCL installed only as libnccl.so.2, the store's loader must have found it there: a
# test that skipped for want of NCCL fails the run.
if [ "$soname" = libnccl.so.2 ] && grep -iE '^SKIPPED: .*(nccl|NCCL)' "$log"; then
    echo "NCCL was not found under the name libnccl.so.2" >&2
    status=1
fi
exit "$status"

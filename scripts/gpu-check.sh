#!/usr/bin/env bash
# gpu-check.sh: build kvstore's test and bench binaries here, run them on a GPU machine there.
#
# A GPU test machine may have no Rust toolchain. The binaries dlopen libcuda and libnccl at run
# time (cudarc's dynamic loading), so they link against neither and can be built anywhere.
#
# 1. Here (any machine with cargo, no GPU needed):
#        scripts/gpu-check.sh
#    builds every test binary (`cargo test --release --no-run`) and bench binary
#    (`cargo bench --no-run`), strips them, and stages them with a `run.sh` in `.gpu-stage/`
#    (git-ignored), and packs that folder into `.gpu-bundle/stage.tgz` (git-ignored, under 60 MiB:
#    a device run carries 64 MiB at most).
# 2. On the GPU machine, from a copy of the repository with `.gpu-bundle` carried:
#        tar -xzf .gpu-bundle/stage.tgz
#        .gpu-stage/run.sh            # logs in .gpu-stage/logs, packed into $OUT if set
#    run.sh reports which libnccl.so.2 the machine has (env NCCL_LIB, then pip's
#    nvidia-nccl-cu12/13 under python's site-packages, then ldconfig, then /usr and /opt); it
#    makes no symlink, since kvstore searches for libnccl.so.2 itself. It prints nvidia-smi, runs every test binary with `--include-ignored` (with
#    NCCL_MULTI_RANK_GPU_ENABLE=1, so two NCCL ranks may share one GPU on NCCL >= 2.30), then
#    every bench, and prints a summary per binary: passed, failed, and SKIPPED (tests that
#    printed `SKIPPED:` because this machine cannot run their case; never counted as passed).
#    It exits non-zero when any binary failed, and with 2 at once when the machine has no GPU.
#    Where scripts/build-nccl.sh has built NCCL 2.30 (.nccl-build/, or KVSTORE_NCCL_XZ), its
#    xz (about 28 MiB) travels too, and run.sh loads it through KVSTORE_NCCL_LIB.
#    SKIP_BENCHES=1 runs the tests only (the benches take minutes). Knobs for a short lease:
#      TESTS=ignored         only the `#[ignore = "needs a GPU"]` tests (CI runs the others);
#      BENCH_FILTERS="a b"   the kv bench once per criterion filter, instead of every bench whole;
#      TORCH_BENCH=1         also benches/torch_updaters.py (PyTorch's fused steps, same GPU);
#    Where maturin is installed here, the Python wheel is staged too, and run.sh trains
#    python/examples/train_torch.py under torchrun with one worker per GPU (dist_device_sync).
#      SANITIZE="t1 t2"      also compute-sanitizer on those test binaries' GPU tests, with the
#                            tools in SANITIZE_TOOLS (default "memcheck racecheck").
#    Logs are packed into $OUT after every step, so a run cut off at its limit still brings back
#    what it did.
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

echo "== building test binaries (release)"
cargo test --release --no-run --message-format=json 2>/dev/null | executables |
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
else
    echo "== no maturin here: the Python wheel is not staged (pip install maturin)"
fi

echo "== building bench binaries"
cargo bench --no-run --message-format=json 2>/dev/null | executables |
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

cat >"$STAGE/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the staged kvstore tests and benches on a GPU machine. See scripts/gpu-check.sh.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# Logs are written to $HERE/logs and packed at the end into logs.tgz, with summary.txt beside
# it, in $OUT when it is set (a device run brings back at most 8 files).
LOG="$HERE/logs"
rm -rf "$LOG"
mkdir -p "$LOG"
pack() {
    [ -n "${OUT:-}" ] || return 0
    tar -C "$HERE" -czf "$OUT/logs.tgz.part" logs && mv "$OUT/logs.tgz.part" "$OUT/logs.tgz"
    cp "$LOG/summary.txt" "$OUT/summary.txt" 2>/dev/null || true
}
trap pack EXIT

# Without a GPU every GPU test fails anyway: say so once, up front, and stop.
if ! { nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    echo "run.sh: needs a GPU: nvidia-smi lists none and there is no /dev/nvidiaN on $(hostname)" |
        tee "$LOG/summary.txt" >&2
    exit 2
fi

find_nccl() {
    if [ -n "${NCCL_LIB:-}" ] && [ -e "$NCCL_LIB" ]; then echo "$NCCL_LIB"; return; fi
    local py
    for py in python3 python; do
        command -v "$py" >/dev/null || continue
        "$py" - <<'PY' 2>/dev/null && return
import glob, os, site, sys
dirs = list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()] + sys.path
for d in dirs:
    for f in sorted(glob.glob(os.path.join(d, "nvidia", "nccl", "lib", "libnccl.so*"))):
        print(f); sys.exit(0)
sys.exit(1)
PY
    done
    local f
    f=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so/ {print $NF; exit}')
    if [ -n "$f" ]; then echo "$f"; return; fi
    find /usr /opt -name 'libnccl.so*' 2>/dev/null | head -n 1
}

# The carried NCCL (>= 2.30), unpacked and loaded through KVSTORE_NCCL_LIB unless that is set.
if [ -e "$HERE/nccl/libnccl.so.2.xz" ] && [ -z "${KVSTORE_NCCL_LIB:-}" ]; then
    if command -v xz >/dev/null; then
        xz -dc "$HERE/nccl/libnccl.so.2.xz" >"$HERE/nccl/libnccl.so.2"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
            "$HERE/nccl/libnccl.so.2.xz" >"$HERE/nccl/libnccl.so.2"
    fi
    export KVSTORE_NCCL_LIB="$HERE/nccl/libnccl.so.2" NCCL_LIB="$HERE/nccl/libnccl.so.2"
    echo "NCCL carried: $(cat "$HERE/nccl/VERSION" 2>/dev/null | tr '\n' ' ')" | tee "$LOG/nccl.txt"
fi

# Only reported: kvstore finds libnccl.so.2 itself (src/comm/nccl/loader.rs), so no
# libnccl.so symlink is made; the tests then check that its own search works.
NCCL=$(find_nccl)
{
    echo "== machine"
    nvidia-smi || echo "nvidia-smi failed"
    if [ -n "$NCCL" ]; then
        echo "NCCL: $(readlink -f "$NCCL") (kvstore's own search should find it)"
        for py in python3 python; do
            command -v "$py" >/dev/null && "$py" -m pip list 2>/dev/null | grep -i nccl && break
        done
    else
        echo "NCCL: libnccl.so.2 not found; NCCL tests will fail or print SKIPPED"
    fi
} 2>&1 | tee "$LOG/machine.txt"
export NCCL_MULTI_RANK_GPU_ENABLE=1
export RUST_BACKTRACE=1

SUMMARY="$LOG/summary.txt"
: >"$SUMMARY"
FAILED=0
for t in "$HERE"/tests/*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    echo "== test $name"
    # A hung test must not eat the whole run: each binary gets TEST_TIMEOUT seconds.
    # The dist GPU tests load the MPI libraries staged beside them.
    libs=""
    [ "$name" = dist_gpu ] && [ -d "$HERE/lib" ] && libs="$HERE/lib"
    LD_LIBRARY_PATH="${libs}${libs:+${LD_LIBRARY_PATH:+:}}${LD_LIBRARY_PATH:-}" \
        timeout "${TEST_TIMEOUT:-300}" "$t" "--${TESTS:-include-ignored}" --nocapture --test-threads=1 \
        >"$LOG/test-$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 124 ] && echo "TIMED OUT after ${TEST_TIMEOUT:-300} s" >>"$LOG/test-$name.log"
    # From libtest's "test result:" line only: a test's own output may say "3 failed".
    result=$(grep -a '^test result:' "$LOG/test-$name.log" | tail -n 1)
    passed=$(echo "$result" | grep -Eo '[0-9]+ passed' | cut -d' ' -f1)
    failed=$(echo "$result" | grep -Eo '[0-9]+ failed' | cut -d' ' -f1)
    # Distinct tests that printed SKIPPED (a test may print it once per case it skips).
    # With --nocapture a test's line may read "test x ... SKIPPED: x: why": match anywhere.
    skipped=$(grep -o 'SKIPPED: .*' "$LOG/test-$name.log" | awk -F': ' '{print $2}' | sort -u | wc -l)
    # A test that printed SKIPPED did not run its case: it is not counted as passed.
    [ -n "$passed" ] && passed=$(( passed - skipped ))
    [ "$rc" -ne 0 ] && FAILED=1
    printf '%-28s rc=%-3s passed=%-4s failed=%-4s SKIPPED=%s\n' "$name" "$rc" "${passed:-?}" "${failed:-?}" "$skipped" | tee -a "$SUMMARY"
    grep -o 'SKIPPED: .*' "$LOG/test-$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    # The harness lists failed tests, indented, after its last "failures:" line.
    awk '/^failures:$/ {n++; next} n == 2 && /^    [^ ]/ {print "    FAILED" $0}' "$LOG/test-$name.log" | tee -a "$SUMMARY"
    pack
done
for name in ${SANITIZE:-}; do
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        echo "== compute-sanitizer --tool $tool $name"
        # API errors are not memory errors: the tests provoke some on purpose (broken PTX).
        extra=""
        [ "$tool" = memcheck ] && extra="--report-api-errors no --leak-check full"
        # shellcheck disable=SC2086
        timeout "${SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool "$tool" $extra --error-exitcode 99 \
            "$HERE/tests/$name" --ignored --test-threads=1 >"$LOG/sanitize-$tool-$name.log" 2>&1
        rc=$?
        # memcheck counts each allocation still held at exit as an error. kvstore keeps a few
        # for the process (pinned staging buffers, the launch's record table), so leaks are
        # reported apart and only the other errors (invalid accesses) fail the step.
        errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$LOG/sanitize-$tool-$name.log" | tail -n 1 | grep -Eo '[0-9]+$')
        leaks=$(grep -c '^========= Leaked ' "$LOG/sanitize-$tool-$name.log")
        if [ "$rc" -eq 99 ] && [ -n "$errors" ] && [ "$errors" -eq "$leaks" ]; then rc=0; fi
        [ "$rc" -ne 0 ] && FAILED=1
        printf '%-28s rc=%s (compute-sanitizer %s; %s errors, of which %s leaks at exit; %s)\n' \
            "$name" "$rc" "$tool" "${errors:-?}" "$leaks" \
            "$(grep -E 'LEAK SUMMARY|RACECHECK SUMMARY' "$LOG/sanitize-$tool-$name.log" | tail -n 1)" | tee -a "$SUMMARY"
        pack
    done
done
# Python: every GPU a torchrun worker, in one dist_device_sync store over NCCL; rank 0 prints
# the loss on the whole batch, which must fall.
if ls "$HERE"/python/*.whl >/dev/null 2>&1 && python3 -c "import torch" 2>/dev/null; then
    echo "== python: torchrun train_torch.py"
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    rm -rf "$HERE/site" && python3 -m zipfile -e "$HERE"/python/*.whl "$HERE/site"
    PYTHONPATH="$HERE/site" PYTHONUNBUFFERED=1 timeout "${TEST_TIMEOUT:-300}" \
        python3 -m torch.distributed.run --nproc-per-node "${gpus:-1}" \
        "$HERE/python/train_torch.py" --steps 100 >"$LOG/python-train_torch.log" 2>&1
    rc=$?
    first=$(grep -o 'loss [0-9.]*' "$LOG/python-train_torch.log" | head -n 1)
    last=$(grep -o 'loss [0-9.]*' "$LOG/python-train_torch.log" | tail -n 1)
    [ "$rc" -ne 0 ] && FAILED=1
    printf '%-28s rc=%s (%s GPU workers; %s -> %s)\n' python-train_torch "$rc" "${gpus:-1}" \
        "$first" "$last" | tee -a "$SUMMARY"
    pack
    # torch CUDA tensors lent to the store in place (pytest is in the GPU machine's image).
    echo "== python: pytest test_torch_cuda.py"
    (cd "$HERE/python/tests" && PYTHONPATH="$HERE/site" timeout "${TEST_TIMEOUT:-300}" \
        python3 -m pytest -q -rs -p no:cacheprovider test_torch_cuda.py) \
        >"$LOG/python-test_torch_cuda.log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && FAILED=1
    printf '%-28s rc=%s (%s)\n' python-test_torch_cuda "$rc" \
        "$(tail -n 1 "$LOG/python-test_torch_cuda.log")" | tee -a "$SUMMARY"
    pack
fi
if [ "${TORCH_BENCH:-0}" = 1 ]; then
    echo "== torch_updaters.py"
    timeout "${BENCH_TIMEOUT:-400}" python3 "$HERE/torch_updaters.py" --json "$LOG/torch_updaters.json" \
        >"$LOG/bench-torch_updaters.log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && FAILED=1
    printf '%-28s rc=%s (bench; results in bench-torch_updaters.log)\n' torch_updaters "$rc" | tee -a "$SUMMARY"
    pack
fi
for filter in ${BENCH_FILTERS:-}; do
    [ "${SKIP_BENCHES:-0}" = 1 ] && break
    echo "== bench kv -- $filter"
    log="$LOG/bench-kv-$(echo "$filter" | tr -c 'A-Za-z0-9_\n' '_').log"
    timeout "${BENCH_TIMEOUT:-400}" "$HERE/benches/kv" --bench "$filter" >"$log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && FAILED=1
    printf '%-28s rc=%s (bench; results in %s)\n' "kv $filter" "$rc" "$(basename "$log")" | tee -a "$SUMMARY"
    pack
done
for b in "$HERE"/benches/*; do
    [ -x "$b" ] || continue
    [ -n "${BENCH_FILTERS:-}" ] && break
    [ "${SKIP_BENCHES:-0}" = 1 ] && { echo "== benches skipped (SKIP_BENCHES=1)"; break; }
    name=$(basename "$b")
    echo "== bench $name"
    timeout "${BENCH_TIMEOUT:-400}" "$b" --bench >"$LOG/bench-$name.log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && FAILED=1
    printf '%-28s rc=%s (bench; results in bench-%s.log)\n' "$name" "$rc" "$name" | tee -a "$SUMMARY"
done
# GPU ranks against raw NCCL on the same GPUs: needs mpirun and a GPU per rank, two at least
# (ranks sharing a GPU would time the sharing).
if [ -x "$HERE/bench_gpu_ranks" ] && [ "${SKIP_BENCHES:-0}" != 1 ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if ! command -v mpirun >/dev/null; then
        echo "bench_gpu_ranks              SKIPPED: no mpirun on this machine" | tee -a "$SUMMARY"
    elif [ "${gpus:-0}" -lt 2 ]; then
        echo "bench_gpu_ranks              SKIPPED: $gpus GPU (a GPU per rank; two ranks at least)" | tee -a "$SUMMARY"
    else
        echo "== bench_gpu_ranks"
        np=$gpus
        LD_LIBRARY_PATH="$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout "${BENCH_TIMEOUT:-400}" \
            mpirun --allow-run-as-root -np "$np" "$HERE/bench_gpu_ranks" >"$LOG/bench-gpu-ranks.log" 2>&1
        rc=$?
        [ "$rc" -ne 0 ] && FAILED=1
        printf '%-28s rc=%s (%s ranks; results in bench-gpu-ranks.log)\n' bench_gpu_ranks "$rc" "$np" | tee -a "$SUMMARY"
        pack
    fi
fi
echo "== summary (SKIPPED tests did not run their case; they are not passes)"
cat "$SUMMARY"
exit "$FAILED"
RUN
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

#!/usr/bin/env bash
# GPU run 10: row_sparse on a GPU home, then the push_list A/B (2513543 against 4104da1 and f3c07ec), interleaved.
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== row_sparse --ignored"
timeout 120 ./rsp/row_sparse --ignored --nocapture 2>&1 | tail -8
echo "== row_sparse (default tests, GPU machine: device stores home on the GPU)"
timeout 120 ./rsp/row_sparse 2>&1 | tail -4
echo "== compute-sanitizer memcheck row_sparse --ignored"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$CS" ] && timeout 200 "$CS" --tool memcheck --leak-check no ./rsp/row_sparse --ignored 2>&1 | tail -4
echo "== push_list A/B"
for round in 1 2 3 4; do
  for b in kv-2513543 kv-4104da1 kv-f3c07ec; do
    line=$(KVSTORE_BENCH_SMALL_KIB=4 timeout 60 ./bisect/$b --bench smallkeys/push_list 2>&1 | grep -E "time:" | head -1)
    echo "round $round $b $line"
  done
done

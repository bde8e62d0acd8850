#!/usr/bin/env bash
# Bisect of the 1000 x 4 KiB push_list slowdown: each build's kv bench, interleaved, 3 rounds.
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for round in 1 2 3; do
  for b in kv-05cd0f1 kv-35dacd4 kv-f3766ce kv-e67f4bd kv-a262a29 kv-2513543 kv-4104da1; do
    [ -x ./$b ] || continue
    line=$(KVSTORE_BENCH_SMALL_KIB=4 timeout 60 ./$b --bench smallkeys/push_list 2>&1 | grep -E "time:" | head -1)
    echo "round $round $b $line"
  done
done

#!/usr/bin/env bash
# GPU run 11: row_sparse after its review (new values of GPU homes made before any is committed).
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== row_sparse --ignored and default"
timeout 120 ./row_sparse --ignored 2>&1 | grep -E "^test |test result"
timeout 120 ./row_sparse 2>&1 | grep -E "^test |test result"
echo "== gpu_store out_of_memory (row-sparse case included)"
timeout 300 ./gpu_store --ignored --nocapture out_of_memory 2>&1 | grep -E "^test |test result|SKIPPED|panicked|assert" | head -20

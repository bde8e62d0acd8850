#!/usr/bin/env bash
# Quick GPU check of the lend fixes (run 8): lent_gpu, test_torch_cuda with and without
# expandable segments, train_torch under torchrun.
set -uo pipefail
Q=$(cd "$(dirname "$0")" && pwd)
cd "$Q/../.."
rm -rf /tmp/site && python3 -m zipfile -e "$Q"/*.whl /tmp/site && cp python/kvstore/*.py /tmp/site/kvstore/
echo "== lent_gpu"; timeout 60 "$Q/lent_gpu" --ignored --test-threads=1 2>&1 | tail -4
for conf in "" "expandable_segments:True"; do
  echo "== test_torch_cuda.py PYTORCH_CUDA_ALLOC_CONF=$conf"
  (cd python/tests && PYTORCH_CUDA_ALLOC_CONF=$conf PYTHONPATH=/tmp/site timeout 120 python3 -m pytest -q -rs -p no:cacheprovider test_torch_cuda.py 2>&1 | tail -15)
done
echo "== torchrun train_torch.py"
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 120 python3 -m torch.distributed.run --nproc-per-node 1 python/examples/train_torch.py --steps 100 2>&1 | grep -E "loss|Error|error" | sed -n '1p;$p'

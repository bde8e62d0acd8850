#!/bin/bash
# 5 runs of torchrun --max-restarts 1, one worker SIGKILLed at step 15, checkpoints every 10 steps.
R=benches/results/elastic_2026-11-29
V=/work/venv-cluster/venv
for i in 1 2 3 4 5; do
  rm -rf /tmp/te_ckpt && mkdir -p /tmp/te_ckpt
  timeout -k 5 300 $V/bin/torchrun --standalone --nproc-per-node 4 --max-restarts 1 --monitor-interval 0.1 \
    benches/torchelastic_restart.py --ckpt /tmp/te_ckpt/ckpt.pt --steps 20 --ckpt-every 10 --kill-step 15 --kill-rank 3 \
    --port $((29800 + 2 * i)) > $R/torchelastic/run$i.txt 2>&1
  echo "run $i rc=$? load=$(cut -d' ' -f1 /proc/loadavg)"
done
rm -rf /tmp/te_ckpt

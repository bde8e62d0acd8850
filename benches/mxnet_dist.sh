#!/usr/bin/env bash
# MXNet 1.9.1's dist_sync (ps-lite) on N local workers and N servers: the push and pull times of
# benches/mxnet_dist.py, the slowest worker's median per op and size.
#
#   MXPY=/path/to/venv/bin/python benches/mxnet_dist.sh N [bytes ...]
#
# MXPY is a Python with mxnet==1.9.1 and numpy<1.24 (MXNet 1.9.1 has wheels up to Python 3.8 or
# so: python3.8 -m venv /tmp/mxv && /tmp/mxv/bin/pip install mxnet==1.9.1 'numpy<1.24').
# Prints `mxnet <op> <bytes> <slowest median seconds>` lines. Every process is bounded by
# `timeout`.
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:?usage: benches/mxnet_dist.sh N [bytes ...]}"
shift
py="${MXPY:-python3}"
port="${MXNET_PORT:-$((9000 + RANDOM % 1000))}"
export DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT="$port" DMLC_NUM_SERVER="$n" \
    DMLC_NUM_WORKER="$n" DMLC_INTERFACE=lo OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1
out="$(mktemp)"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -f "$out"' EXIT
# The scheduler and the servers serve until the workers are done (MXNet starts them on import).
DMLC_ROLE=scheduler timeout 900 "$py" -c "import mxnet" &
pids+=($!)
for _ in $(seq "$n"); do
    DMLC_ROLE=server timeout 900 "$py" -c "import mxnet" &
    pids+=($!)
done
workers=()
for _ in $(seq "$n"); do
    DMLC_ROLE=worker timeout 900 "$py" benches/mxnet_dist.py "$@" >>"$out" &
    workers+=($!)
done
for w in "${workers[@]}"; do wait "$w"; done
# The slowest worker's median, per op and size.
awk '$1 == "mxnet" { k = $2 " " $3; if (!(k in m) || $4 > m[k]) m[k] = $4 } END { for (k in m) print "mxnet", k, m[k] }' "$out" | sort -k2,2 -k3,3n

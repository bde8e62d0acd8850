#!/usr/bin/env bash
# MXNet 1.9.1 vs ours, interleaved, CPU only. Writes target/mxnet_peer.md and target/mxnet_peer.json.
# Usage: benches/mxnet_peer.sh [mxnet_peer.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 benches/mxnet_peer.py "$@" | tee target/mxnet_peer.md

#!/usr/bin/env bash
# Installs NVIDIA's PTX assembler (ptxas) from the pip wheel `nvidia-cuda-nvcc-cu12` and prints
# its path. Idempotent: a second run finds the installed binary and only prints the path.
#
# ptxas 12.9 still accepts -arch=sm_70 (CUDA 13 dropped Volta), which build.rs assembles for.
#
#   export PTXAS="$(scripts/install-ptxas.sh)"
#
# Needs python3 with pip, and network access to PyPI on the first run. Messages go to stderr so
# stdout is only the path.
set -euo pipefail

VERSION="12.9.86"
DEST="${KVSTORE_PTXAS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/ptxas-$VERSION}"
BIN="$DEST/ptxas"

if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "install-ptxas: downloading nvidia-cuda-nvcc-cu12==$VERSION" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    "nvidia-cuda-nvcc-cu12==$VERSION" -d "$TMP" >&2

WHEEL="$(ls "$TMP"/nvidia_cuda_nvcc_cu12-*.whl)"
mkdir -p "$DEST"
python3 - "$WHEEL" "$BIN.tmp" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, open(out, "wb") as f:
    f.write(z.read("nvidia/cuda_nvcc/bin/ptxas"))
PY
chmod +x "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
"$BIN" --version >&2
echo "$BIN"

#!/usr/bin/env bash
# Installs Debian's CUDA toolkit (`nvidia-cuda-toolkit`, nvcc 11.8 on bookworm) from the
# `contrib`/`non-free` components, for building candle-core with its `cuda` feature (cargo
# feature `candle-cuda`), whose kernels (candle-kernels) are compiled with nvcc at build time.
#
#   sudo scripts/install-cuda-toolkit.sh             # then: nvcc --version
#   sudo scripts/install-cuda-toolkit.sh --dry-run   # adds the sources, shows what apt would do
#
# Idempotent: the components go into a sources file of their own,
# /etc/apt/sources.list.d/kvstore-contrib-non-free.sources (the existing sources are not
# edited), written only when it is missing or differs; the package is installed only when nvcc
# is missing. Prints each step. Debian only (reads VERSION_CODENAME from /etc/os-release).
# Run as root. Needs about 5 GB of disk (the toolkit and its dependencies).
#
# Result on bookworm (issue 17; the "GPU tensors" section of src/interop/candle.rs): it installs
# nvidia-cuda-toolkit 11.8.89~11.8.0-5~deb12u1 (nvcc V11.8.89, g++-11 as host compiler; 64
# packages, about 5 GB of disk, under 4 minutes). It also installs the driver's user-space
# libcuda.so.1 and libnvidia-ml.so.1 (535.309.01) in the default library path: with no GPU,
# cuInit returns CUDA_ERROR_NO_DEVICE (100), so kvstore still counts 0 GPUs. It does not make
# candle-core's `cuda` feature usable with kvstore: cudarc refuses candle's `dynamic-linking`
# together with kvstore's `dynamic-loading`, and nvcc 11.8 rejects the sm_90a target that
# candle-kernels asks for on CUDA_COMPUTE_CAP=90 (it builds them for 89).
set -euo pipefail

say() { echo "install-cuda-toolkit: $*" >&2; }

dry_run=false
case "${1:-}" in
    "") ;;
    --dry-run) dry_run=true ;;
    *)
        say "usage: $0 [--dry-run]"
        exit 2
        ;;
esac

if command -v nvcc >/dev/null 2>&1; then
    say "nvcc already installed: $(command -v nvcc)"
    nvcc --version
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    say "run as root (it writes an apt sources file and installs packages)"
    exit 1
fi

# shellcheck disable=SC1091
. /etc/os-release
if [[ "${ID:-}" != debian || -z "${VERSION_CODENAME:-}" ]]; then
    say "not Debian (ID=${ID:-?}); install the CUDA toolkit from NVIDIA instead"
    exit 1
fi

components="contrib non-free"
# bookworm split the firmware out of non-free; later releases keep that component.
case "$VERSION_CODENAME" in
    buster | bullseye) ;;
    *) components="$components non-free-firmware" ;;
esac

sources=/etc/apt/sources.list.d/kvstore-contrib-non-free.sources
wanted="$(
    cat <<EOF
# Written by kvstore's scripts/install-cuda-toolkit.sh: the contrib/non-free components
# (nvidia-cuda-toolkit lives in non-free). Remove this file to undo.
Types: deb
URIs: http://deb.debian.org/debian
Suites: $VERSION_CODENAME $VERSION_CODENAME-updates
Components: $components
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: $VERSION_CODENAME-security
Components: $components
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
)"

if [[ -f "$sources" ]] && [[ "$(cat "$sources")" == "$wanted" ]]; then
    say "$sources already present ($components)"
else
    say "writing $sources ($components for $VERSION_CODENAME)"
    printf '%s\n' "$wanted" >"$sources.tmp"
    mv "$sources.tmp" "$sources"
fi

say "apt-get update"
apt-get update -q

if $dry_run; then
    say "dry run: apt-get install --simulate --no-install-recommends nvidia-cuda-toolkit"
    apt-get install --simulate --no-install-recommends nvidia-cuda-toolkit
    exit 0
fi

say "apt-get install --no-install-recommends nvidia-cuda-toolkit"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nvidia-cuda-toolkit

say "installed:"
nvcc --version

#!/usr/bin/env bash
# Builds NCCL 2.30.7 for sm_90 (H100/H200) only, small enough to carry to a lent GPU machine,
# where the image's NCCL is 2.28 and cannot share one GPU between ranks (issue 40). NCCL 2.30
# lets several ranks use one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1; kvstore loads the built
# library through KVSTORE_NCCL_LIB.
#
#   scripts/build-nccl.sh [OUTDIR]       # OUTDIR defaults to .nccl-build/ in the repo root
#
# Result, in OUTDIR:
#   lib/libnccl.so.2.30.7      stripped (--strip-unneeded), soname libnccl.so.2, plus the
#                              libnccl.so.2 and libnccl.so links
#   libnccl.so.2.30.7.xz       the same, xz -9e: carry this one
#   include/nccl.h             the matching header
#   MANIFEST                   versions, commit, flags, sizes, sha256, build time
# Unpack on the GPU machine:
#   mkdir -p /tmp/nccl && xz -dc libnccl.so.2.30.7.xz > /tmp/nccl/libnccl.so.2
#   (where xz is missing: python3 -c 'import lzma, shutil, sys;
#    shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' libnccl.so.2.30.7.xz > ...)
#   export KVSTORE_NCCL_LIB=/tmp/nccl/libnccl.so.2 NCCL_MULTI_RANK_GPU_ENABLE=1
#
# Toolchain: CUDA 13.0 from PyPI wheels (nvidia-cuda-nvcc, -nvvm, -crt, -runtime, -cccl), laid
# out as a CUDA_HOME in OUTDIR/cuda-root/nvidia/cu13. The cu12 wheel nvidia-cuda-nvcc-cu12
# (12.9.86) carries only ptxas and libnvvm, no nvcc, cicc or cudafe++, so it cannot build
# NCCL; the CUDA 13 wheels carry the whole compiler. 13.0 matches the lent machine (driver 580,
# CUDA 13.0, torch cu130, nvcc 13.0). cudart is linked statically (NCCL's default;
# libcudart_static.a is in the runtime wheel), so the library needs no libcudart there, only the
# driver's libcuda.so.1, which NCCL dlopens at run time.
# Set CUDA_HOME to use an installed toolkit instead (e.g. /usr/local/cuda on the GPU machine,
# to build there: `JOBS=16 scripts/build-nccl.sh`).
#
# Source: tag v2.30.7-1 (commit pinned below), from $NCCL_GIT_DIR (a local clone or bare
# mirror) if set, else a shallow clone of https://github.com/NVIDIA/nccl, else a local mirror at
# /work/.mirror/NVIDIA+nccl/repo, else GitHub's tag tarball; the commit is checked when git
# gives one.
#
# Idempotent: wheels, toolkit and source are fetched once; make rebuilds only what changed; the
# packaging step reruns cheaply. Environment: JOBS (make -j, default nproc), NICE (default 19),
# CUDA_HOME (skip the wheels), NCCL_GIT_DIR, PYTHON (default python3), FATBIN_COMPRESS (below).
# Needs python3 with pip, git or curl, g++ (gcc 12 here), make, xz; about 1.5 GB of disk.
set -euo pipefail

NCCL_VERSION="2.30.7"
NCCL_TAG="v2.30.7-1"
NCCL_COMMIT="73cf112295c33aee2b895f329f592f2a9b4b0f97"
CUDA_WHEELS=(
    "nvidia-cuda-nvcc==13.0.88"
    "nvidia-nvvm==13.0.88"
    "nvidia-cuda-crt==13.0.88"
    "nvidia-cuda-runtime==13.0.96"
    "nvidia-cuda-cccl==13.0.85"
)
GENCODE="-gencode=arch=compute_90,code=sm_90"
# Calls from inside the library to its own API (ncclBcast -> ncclBroadcast,
# ncclCommGetAsyncError, ncclCommWindowDeregister, ...) bind to this copy, never to another
# libnccl.so.2 already in the process's global scope (torch's 2.28 beside this 2.30).
LINK_FLAGS="-Wl,-Bsymbolic-functions"
# Device code compression in the fatbins: `all` is NCCL's own -Xfatbin -compress-all (LZ4-like,
# xz then gains little); `none` leaves the cubins raw, so the library on disk is several times
# larger but xz makes the carried file about a third smaller; `size` is CUDA 12.8+'s stronger
# mode (the driver must be 12.8 or newer). Measured on one object (all_reduce_sum_f32, sm_90):
# xz of the object 309 KB (all), 244 KB (size), 201 KB (none).
FATBIN_COMPRESS="${FATBIN_COMPRESS:-all}"
case "$FATBIN_COMPRESS" in
    all) fatbin_flag="-compress-all" ;;
    none | size) fatbin_flag="-compress-mode=$FATBIN_COMPRESS" ;;
    *)
        echo "build-nccl: FATBIN_COMPRESS must be all, none or size" >&2
        exit 2
        ;;
esac

say() { echo "build-nccl: $*" >&2; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$repo_root/.nccl-build}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
jobs="${JOBS:-$(nproc)}"
nice_n="${NICE:-19}"
py="${PYTHON:-python3}"
run() { nice -n "$nice_n" "$@"; }

# ---- 1. CUDA_HOME from PyPI wheels ----------------------------------------------------------
if [[ -n "${CUDA_HOME:-}" ]]; then
    cuda_home="$CUDA_HOME"
    say "using CUDA_HOME=$cuda_home"
else
    cuda_root="$out/cuda-root"
    stamp="$cuda_root/.installed"
    want="$(printf '%s\n' "${CUDA_WHEELS[@]}")"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        say "downloading ${CUDA_WHEELS[*]}"
        rm -rf "$cuda_root" "$out/wheels"
        mkdir -p "$out/wheels"
        run "$py" -m pip download --quiet --no-deps --only-binary=:all: \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux2010_x86_64 --platform manylinux_2_12_x86_64 \
            -d "$out/wheels" "${CUDA_WHEELS[@]}"
        rm -rf "$cuda_root.part" && mkdir -p "$cuda_root.part"
        for w in "$out"/wheels/*.whl; do
            run "$py" - "$w" "$cuda_root.part" <<'PY'
import sys, zipfile, os
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if not info.filename.startswith("nvidia/") or info.is_dir():
            continue
        path = z.extract(info, dest)
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
PY
        done
        # nvcc.profile looks for lib64/; the wheels ship lib/.
        ln -sfn lib "$cuda_root.part/nvidia/cu13/lib64"
        chmod +x "$cuda_root.part"/nvidia/cu13/bin/* "$cuda_root.part"/nvidia/cu13/nvvm/bin/*
        echo "$want" >"$cuda_root.part/.installed"
        mv "$cuda_root.part" "$cuda_root"
        rm -rf "$out/wheels"
    fi
    cuda_home="$cuda_root/nvidia/cu13"
fi
"$cuda_home/bin/nvcc" --version | grep release >&2

# ---- 2. NCCL source at the pinned tag -------------------------------------------------------
src="$out/src/nccl-$NCCL_TAG"
if [[ ! -f "$src/.complete" ]]; then
    rm -rf "$src" "$src.part"
    mkdir -p "$out/src"
    got=""
    mirror="${NCCL_GIT_DIR:-}"
    if [[ -z "$mirror" ]]; then
        say "cloning $NCCL_TAG from https://github.com/NVIDIA/nccl"
        if timeout 600 git -c advice.detachedHead=false clone --quiet --depth 1 \
            --branch "$NCCL_TAG" https://github.com/NVIDIA/nccl "$src.part" 2>/dev/null; then
            got="$(git -C "$src.part" rev-parse HEAD)"
            rm -rf "$src.part/.git"
        else
            rm -rf "$src.part"
            [[ -d /work/.mirror/NVIDIA+nccl/repo ]] && mirror=/work/.mirror/NVIDIA+nccl/repo
        fi
    fi
    if [[ -z "$got" && -n "$mirror" ]]; then
        say "exporting $NCCL_TAG from $mirror"
        got="$(git -C "$mirror" rev-parse "$NCCL_TAG^{commit}")"
        mkdir -p "$src.part"
        git -C "$mirror" archive --format=tar "$got" | tar -x -C "$src.part"
    fi
    if [[ -z "$got" ]]; then
        say "downloading the $NCCL_TAG tarball from GitHub"
        mkdir -p "$src.part"
        curl -fsSL "https://github.com/NVIDIA/nccl/archive/refs/tags/$NCCL_TAG.tar.gz" |
            tar -xz -C "$src.part" --strip-components=1
        got="$NCCL_COMMIT" # a tarball names no commit; version.mk is checked below
    fi
    if [[ "$got" != "$NCCL_COMMIT" ]]; then
        say "tag $NCCL_TAG is commit $got, expected $NCCL_COMMIT"
        exit 1
    fi
    grep -q "NCCL_PATCH *:= *${NCCL_VERSION##*.}$" "$src.part/makefiles/version.mk" || {
        say "source is not NCCL $NCCL_VERSION"
        exit 1
    }
    touch "$src.part/.complete"
    mv "$src.part" "$src"
fi

# ---- 3. Build (sm_90 only, static cudart) ---------------------------------------------------
build="$out/build"
lib="$build/lib/libnccl.so.$NCCL_VERSION"
# The fatbin flag is in NCCL's makefiles (makefiles/common.mk, src/device/Makefile); make does
# not track flags, so a build made with another compression is started afresh.
for mk in "$src/makefiles/common.mk" "$src/src/device/Makefile"; do
    grep -qF -- "-Xfatbin $fatbin_flag" "$mk" ||
        sed -i -E "s/-Xfatbin -compress-(all|mode=[a-z]+)/-Xfatbin $fatbin_flag/" "$mk"
done
built_with="$(cat "$build/.fatbin-compress" 2>/dev/null || echo all)"
if [[ -d "$build" && "$built_with" != "$FATBIN_COMPRESS" ]]; then
    say "the build in $build used another fatbin compression: starting afresh"
    rm -rf "$build"
fi
mkdir -p "$build"
echo "$FATBIN_COMPRESS" >"$build/.fatbin-compress"
# A library linked with other flags is relinked (the objects are kept).
if [[ -f "$lib" && "$(cat "$build/.link-flags" 2>/dev/null)" != "$LINK_FLAGS" ]]; then
    rm -f "$lib"
fi
say "building in $build with make -j$jobs (log: $out/make.log)"
start=$(date +%s)
set +e
(
    cd "$src"
    # LDFLAGS from the environment: src/Makefile appends its own (-lcudart_static ...) to it.
    LDFLAGS="$LINK_FLAGS" run make -j"$jobs" src.build \
        CUDA_HOME="$cuda_home" \
        NVCC_GENCODE="$GENCODE" \
        CUDARTLIB=cudart_static \
        NCCL_GIT_COMMIT_HASH="$NCCL_COMMIT" NCCL_GIT_BRANCH="$NCCL_TAG" \
        BUILDDIR="$build"
) >"$out/make.log" 2>&1
rc=$?
set -e
elapsed=$(($(date +%s) - start))
if [[ $rc -ne 0 ]]; then
    tail -30 "$out/make.log" >&2
    say "make failed (exit $rc) after ${elapsed}s; see $out/make.log"
    exit "$rc"
fi
say "make finished in ${elapsed}s"
echo "$LINK_FLAGS" >"$build/.link-flags"

# ---- 4. Package: strip, compress, manifest --------------------------------------------------
mkdir -p "$out/lib" "$out/include"
stripped="$out/lib/libnccl.so.$NCCL_VERSION"
if [[ ! -f "$stripped" || "$stripped" -ot "$lib" ]]; then
    strip --strip-unneeded -o "$stripped.tmp" "$lib"
    mv "$stripped.tmp" "$stripped"
fi
ln -sfn "libnccl.so.$NCCL_VERSION" "$out/lib/libnccl.so.2"
ln -sfn libnccl.so.2 "$out/lib/libnccl.so"
cp "$build/include/nccl.h" "$out/include/nccl.h"
xz_out="$out/libnccl.so.$NCCL_VERSION.xz"
if [[ ! -f "$xz_out" || "$xz_out" -ot "$stripped" ]]; then
    run xz -9e -T1 -c "$stripped" >"$xz_out.tmp"
    mv "$xz_out.tmp" "$xz_out"
fi

reported="$(strings "$lib" | grep -m1 -o 'NCCL version [0-9][0-9.+a-z]*' || true)"
needed="$(readelf -d "$lib" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ' || true)"
glibc="$(objdump -T "$lib" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 || true)"
glibcxx="$(objdump -T "$lib" | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1 || true)"
# cuobjdump is in no 13.0 wheel (nvidia-cuda-cuobjdump starts at 13.2); one on PATH is used.
archs="$(cuobjdump --list-elf "$lib" 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort -u |
    tr '\n' ' ' || true)"
# ncclGetVersion needs no GPU: this checks that the library loads and is the version pinned.
api="$("$py" -c 'import ctypes, sys
lib = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int()
print(v.value if lib.ncclGetVersion(ctypes.byref(v)) == 0 else "error")' "$out/lib/libnccl.so.2")"
IFS=. read -r v_major v_minor v_patch <<<"$NCCL_VERSION"
code=$((v_major * 10000 + v_minor * 100 + v_patch))
if [[ "$api" != "$code" ]]; then
    say "ncclGetVersion says $api, expected $code"
    exit 1
fi
size() { stat -c %s "$1"; }
{
    echo "nccl: $NCCL_TAG ($NCCL_COMMIT)"
    echo "reported: ${reported:-?}; ncclGetVersion: $api"
    echo "nvcc: $("$cuda_home/bin/nvcc" --version | grep release | sed 's/.*release //')"
    echo "host compiler: $(${CXX:-g++} --version | head -1)"
    echo "gencode: $GENCODE; fatbin compression: $FATBIN_COMPRESS"
    echo "cudart: static; link flags: $LINK_FLAGS"
    echo "needed: $needed"
    echo "newest symbol versions: $glibc $glibcxx"
    echo "cubins: ${archs:-? (no cuobjdump on PATH)}"
    echo "size unstripped: $(size "$lib")"
    echo "size stripped: $(size "$stripped")"
    echo "size xz: $(size "$xz_out")"
    echo "sha256 stripped: $(sha256sum "$stripped" | cut -d' ' -f1)"
    echo "sha256 xz: $(sha256sum "$xz_out" | cut -d' ' -f1)"
    echo "last make: ${elapsed}s with -j$jobs"
} >"$out/MANIFEST"
cat "$out/MANIFEST" >&2
echo "$xz_out"

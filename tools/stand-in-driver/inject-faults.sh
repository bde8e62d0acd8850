#!/usr/bin/env bash
# Injects, one at a time, the faults the stand-in driver must catch (issue 21: the seven an
# audit found it missed) into a copy of this working tree, runs the stand-in tests that should
# catch each, and checks that they fail; with nothing injected the same tests must pass.
#
# Usage: tools/stand-in-driver/inject-faults.sh [fault name...]   (default: all of them)
# The copy and its build live in target/inject/ (about 20 minutes on a 2-core machine from
# empty, most of it building; later runs reuse the build). Exit status 0 only when the
# baseline passes and every fault is caught. The last result is in tools/stand-in-driver/README.md.
#
# THIS IS NOT A GPU RUN: every test here runs on the stand-in driver.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="$repo/target/inject"
tree="$work/tree"
export CARGO_TARGET_DIR="$work/target"
mkdir -p "$work"

# The copy: every tracked and untracked, not ignored, file of the working tree.
rm -rf "$tree"
mkdir -p "$tree"
(cd "$repo" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$tree"

# Each fault: `fault NAME FILE 'ENV WORDS' 'TEST ARGS'`, with the perl program that injects it
# on stdin (run with -0pi: the whole file is one string). The tests run as
# `env ENV WORDS scripts/standin-gpu-tests.sh TEST ARGS`.
faults() {
fault dtoh_read_unsynced src/backend/cuda/runtime.rs '' '--test gpu_smallkeys' <<'PERL'
s/    st\.clone_dtoh\(s\)\n/    use cudarc::driver::DevicePtr;
    let n = s.len();
    let p = unsafe { cudarc::driver::result::malloc_host(n * std::mem::size_of::<T>(), 0) }?.cast::<T>();
    let host = unsafe { std::slice::from_raw_parts_mut(p, n) };
    let (ptr, _sync) = s.device_ptr(st);
    unsafe { cudarc::driver::result::memcpy_dtoh_async(host, ptr, st.cu_stream()) }?;
    let mut out = Vec::with_capacity(n);
    unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), n); out.set_len(n) };
    Ok(out)
/
PERL
fault staging_reused_early src/backend/cuda/runtime.rs '' \
    '--test gpu_smallkeys host_values_go_up_through_pinned_memory' <<'PERL'
s/\n            buf\.done\.synchronize\(\)\.map_err\(e\(\)\)\?;//
PERL
fault sm7x_loads_every_module src/backend/cuda/runtime.rs 'KVSTORE_STANDIN_SM=70' \
    '--test gpu_store' <<'PERL'
s/(        let mut modules = self\.modules\.lock\(\)\.unwrap_or_else\(\|e\| e\.into_inner\(\)\);\n)/$1        for &(s, t) in kernels::PTX_SOURCES {
            if let Err(e) = modules.entry(s).or_insert_with(|| self.ctx.load_module(Ptx::from_src(t))) {
                return Err(Error::Cuda { op: "load kernels", key: None, message: format!("loading PTX module '{s}': {:?}", e.0), source: Some(*e) });
            }
        }
/
PERL
# PTXAS=true: neither build.rs's ptxas nor the stand-in's refuses the module first, so what is
# tested is the stand-in's interpreter, which knows cvt.rn.bf16.f32 needs sm_80.
fault bf16_in_an_sm70_file kernels/fused_bf16.ptx 'PTXAS=true' '--test gpu_store' <<'PERL'
s/\.target sm_80/.target sm_70/
PERL
fault watchdog_lock_over_the_group src/comm/nccl/group.rs '' \
    '--test gpu_store a_hang_inside_nccl_is_aborted_not_waited_for' <<'PERL'
s/(        inflight\(\)\.deferred\.push\(f\.error\);\n    }\n)/$1    let held = inflight();\n/;
s/(    drop\(guards\);\n    drop\(order\);\n)/$1    drop(held);\n/
PERL
fault grid_40x_too_large src/backend/cuda/runtime.rs '' \
    '--test gpu_smallkeys a_multi_tensor_push_launches_at_most_twice_the_blocks_it_needs' <<'PERL'
s/grid_dim: kernels::grid_dim\(total\)/grid_dim: kernels::grid_dim(total * 40)/
PERL
fault pageable_uploads src/backend/cuda/runtime.rs '' \
    '--test gpu_smallkeys host_values_go_up_through_pinned_memory' <<'PERL'
s/            for _ in 0\.\.2 \{\n(                \/\/ SAFETY: a fresh page-locked)/            for _ in 0..0 {\n$1/
PERL
}

wanted=("$@")
selected() {
    [ ${#wanted[@]} -eq 0 ] && return 0
    local w
    for w in "${wanted[@]}"; do [ "$w" = "$1" ] && return 0; done
    return 1
}

# Runs the stand-in tests `$@` in the copy with the environment words given; returns their
# status. Bounded: a fault that hangs counts as caught, once the bound ends it.
run_tests() {
    local env_words="$1" log="$2"; shift 2
    # shellcheck disable=SC2086
    (cd "$tree" && timeout 1200 env $env_words scripts/standin-gpu-tests.sh "$@") >"$log" 2>&1
}

# Builds the test binaries of `$@` in the copy: a fault that does not compile is not caught.
build_tests() {
    local env_words="$1" log="$2"; shift 2
    # shellcheck disable=SC2086
    (cd "$tree" && env $env_words cargo test --offline --no-run "$@") >"$log" 2>&1
}

results=()
status=0
declare -A seen_baseline
fault() {
    local name="$1" file="$2" env_words="$3" args="$4" subst
    subst="$(cat)"
    selected "$name" || return 0
    # The baseline: the same command with nothing injected must pass (once per command).
    local key="$env_words|$args"
    if [ -z "${seen_baseline[$key]:-}" ]; then
        seen_baseline[$key]=1
        echo "=== baseline: ${env_words:+$env_words }scripts/standin-gpu-tests.sh $args"
        # shellcheck disable=SC2086
        if run_tests "$env_words" "$work/baseline-$name.log" $args; then
            results+=("baseline for $name: passes")
        else
            results+=("baseline for $name: FAILS with nothing injected (see $work/baseline-$name.log)")
            status=1
            return 0
        fi
    fi
    echo "=== $name: $file"
    cp "$repo/$file" "$tree/$file"
    perl -0pi -e "$subst" "$tree/$file"
    if cmp -s "$repo/$file" "$tree/$file"; then
        results+=("$name: NOT APPLIED (the substitution matched nothing; update this script)")
        status=1
        return 0
    fi
    # shellcheck disable=SC2086
    if ! build_tests "$env_words" "$work/$name.build.log" $args; then
        results+=("$name: DID NOT BUILD (see $work/$name.build.log; update this script)")
        status=1
    # shellcheck disable=SC2086
    elif run_tests "$env_words" "$work/$name.log" $args; then
        results+=("$name: MISSED (the tests passed with the fault in; see $work/$name.log)")
        status=1
    else
        local why
        # What caught it: the stand-in's report, else the failing test's error (in the store's
        # tests: the stand-in's own strictness tests before them report on purpose).
        local store_log
        store_log=$(sed -n "/^=== the store's GPU tests/,\$p" "$work/$name.log")
        why=$({ grep -E '^\[kvstore stand-in\]' <<<"$store_log" | grep -v 'no ptxas'
                grep -E '^Error: |panicked at' <<<"$store_log"; } | head -1 | cut -c1-200)
        results+=("$name: caught (${why:-the tests failed})")
    fi
    cp "$repo/$file" "$tree/$file"
}
faults

echo
echo "=================================================================="
echo "  fault injection on the stand-in driver ($(date -u +%Y-%m-%d), $(cd "$repo" && git rev-parse --short HEAD)$(cd "$repo" && git diff --quiet HEAD || echo '+changes'))"
echo "=================================================================="
printf '  %s\n' "${results[@]}"
exit "$status"

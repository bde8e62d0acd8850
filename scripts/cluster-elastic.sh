#!/usr/bin/env bash
# Elastic dist_sync on the simulated cluster (issue 39): a lost host costs the steps since the
# last checkpoint, not the job, and only a side holding a strict majority of the ranks goes on.
# Every job runs scripts/cluster_elastic_worker.py under PyPI's Open MPI 5 with
# `mpirun --with-ft ulfm`, through scripts/cluster.sh (hosts = network namespaces, 1 Gbit/s
# links). The worker trains 3 keys (one sliced) with SGD and momentum in the store, saves a
# checkpoint before step 3, and at step 5 the ranks of the host to lose hold (sleep) before
# their push while the others wait inside it; the host is lost then. Fresh random data per case
# (the seed is printed); every value is checked against the worker's NumPy replay.
#
#   kill31  3 hosts x 1 rank; rank 2 (host ke2) SIGKILLed: ranks 0 and 1 (2 of 3, a majority)
#           get WorldChangedError (lost [2]), find every key equal to the replay of the steps
#           the store kept (every committed step where it keeps copies of each part, else the
#           checkpoint's 3), train on from there as a world of 2, end equal to the replay of
#           all 9 steps, and exit 0; so does mpirun.
#   kill31ckpt  the same under KVSTORE_REPLICAS=0: the keys must come from the checkpoint.
#   kill32  the same on 3 hosts x 2 ranks: both ranks of host ke2 (ranks 4, 5) SIGKILLed; the 4
#           survivors go on (lost [4, 5]), re-sharded 4 ways.
#   cut31   3 x 1 with ULFM's failure detector on; host ke2's link cut: ranks 0 and 1 go on as
#           in kill31; rank 2, alone on its side, stops with DistFailedError "no majority"
#           (every later call too), never computes on, and exits non-zero (its exit code is
#           recorded on the shared file system: a cut host's output never reaches mpirun).
#   cut22   2 hosts x 2 ranks, detector on; host ke1's link cut: each half holds 2 of 4, so
#           BOTH stop with "no majority" and exit non-zero; nothing trains on.
#
# In every case: every child is under `timeout -k 5` (a case that reaches its bound fails),
# mpirun ends by itself, nothing of the job is left in any host (checked before a cut link is
# restored), and the cluster is taken down at the end. Measured times (detection: the first
# survivor's error after the kill or cut; the recovery the error's message reports) are
# printed with each PASS. docs/across-hosts.md, "Elastic dist_sync across hosts", has them.
#
# Usage: KVT_CLUSTER_VENV=/path/to/venv scripts/cluster-elastic.sh [CASE...] (default: all
# five). KVT_CLUSTER_VENV holds kvstore, kvstore-mpi and PyPI's Open MPI 5 (python/ci.sh with
# KVSTORE_PY_KEEP=DIR leaves one at DIR/venv). Needs root (namespaces). Prints one PASS/FAIL
# line per case and exits non-zero on any FAIL; a case that could not run prints SKIPPED and
# fails too (exit 77 where the kernel refused namespaces).
# Cluster names: prefix ke, subnet 10.79 (KVE_PREFIX / KVE_SUBNET to change).
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

PREFIX="${KVE_PREFIX:-ke}"
SUBNET="${KVE_SUBNET:-10.79}"
C=(scripts/cluster.sh --prefix "$PREFIX" --subnet "$SUBNET")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export KVC_LAYOUTS="3:3x1 6:3x2 4:2x2"
LOGS="$(mktemp -d /tmp/kvstore-elastic.XXXXXX)"
WORKER="$repo/scripts/cluster_elastic_worker.py"

venv="${KVT_CLUSTER_VENV:-}"
if [ -z "$venv" ] || [ ! -x "$venv/bin/mpirun" ] || ! "$venv/bin/python" -c "import kvstore, kvstore_mpi" 2>/dev/null; then
    echo "cluster-elastic.sh: set KVT_CLUSTER_VENV to a venv with kvstore and kvstore-mpi" \
        "(python/ci.sh with KVSTORE_PY_KEEP=DIR makes DIR/venv); got '${venv}'" >&2
    echo "SKIPPED: no venv with kvstore-mpi"
    exit 1
fi
export KVC_MPIRUN="$venv/bin/mpirun"

# KVSTORE_TIMEOUT bounds every wait of the store (a survivor waits inside the push while the
# host to lose holds: HOLD_SECS, far below it); its exit grace is T/2 = 5 s.
T=10
# ULFM's failure detector (heartbeats every 0.5 s, a peer silent for 2 s is failed): without
# it nothing notices a cut link (the ULFM findings in the design notes). A kill is seen without
# it, by the lost process's daemon.
DETECTOR=(--mca mpi_ft_detector 1 --mca mpi_ft_detector_period 0.5 --mca mpi_ft_detector_timeout 2)
# How mpirun (PRRTE) learns that a cut host's daemon is gone: its TCP keepalive, a daemon
# silent for 2 x 3 s after 10 s of quiet (and net.ipv4.tcp_retries2 = 5 in every host, where
# mpirun has written to it). Without these mpirun waits for that daemon until the link comes
# back, after every rank has ended. When they fire, mpirun ends the job: a survivor still
# running then is killed (measured; docs/across-hosts.md), so the survivors here finish first.
KEEPALIVE=(--prtemca oob_tcp_keepalive_time 10 --prtemca oob_tcp_keepalive_intvl 2
    --prtemca oob_tcp_keepalive_probes 3)
HOLD_SECS=1.5
BOUND=90

passed=0 failed=0
CUT=""
cleanup() {
    [ -n "$CUT" ] && "${C[@]}" restore "$CUT" >/dev/null 2>&1
    "${C[@]}" down >/dev/null 2>&1
}
trap cleanup EXIT
trap 'exit 143' TERM INT

pass() { echo "PASS: $*"; passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

# Starts the job of case NAME: NP ranks, the ranks HOLD (comma-separated) holding at step 5,
# then mpirun's extra ARGS. Each rank runs in `sh`, which sends its output to DIR/rank-R.out,
# writes its exit code to DIR/rank-R.rc and ends as the worker ended (by the same signal, so
# mpirun sees a killed rank as killed).
start() {
    local name="$1" np="$2" hold="$3"
    shift 3
    DIR="$LOGS/$name"
    mkdir -p "$DIR"
    SEED=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
    echo "--- $name: seed $SEED, logs in $DIR"
    JOB_START=$SECONDS
    timeout -k 5 "$BOUND" "${C[@]}" mpirun -np "$np" --with-ft ulfm "$@" \
        -x KVSTORE_TIMEOUT=$T -x KVSTORE_BIGARRAY_BOUND=1000 -x OMPI_MCA_mpi_yield_when_idle=1 \
        sh -c 'd=$0 r=$OMPI_COMM_WORLD_RANK; exec >"$d/rank-$r.out" 2>&1; "$@"; rc=$?
               echo "$rc" >"$d/rank-$r.rc"; [ $rc -gt 128 ] && kill -$((rc - 128)) $$; exit $rc' \
        "$DIR" "$venv/bin/python" "$WORKER" "$SEED" "$DIR" "$hold" "$HOLD_SECS" 0 \
        >"$DIR/mpirun.out" 2>&1 &
    JOB=$!
}

# Waits (at most 60 s) until every rank named (original numbers) has written "AT HOLD".
at_hold() {
    local end=$((SECONDS + 60)) r ok
    while [ $SECONDS -lt $end ]; do
        ok=1
        for r in "$@"; do grep -q "AT HOLD" "$DIR/rank-$r.log" 2>/dev/null || ok=0; done
        [ $ok = 1 ] && return 0
        kill -0 "$JOB" 2>/dev/null || return 1
        sleep 0.05
    done
    return 1
}

# Waits for mpirun; sets RC and HUNG.
finish() {
    wait "$JOB"
    RC=$?
    HUNG=0
    [ $((SECONDS - JOB_START)) -ge "$BOUND" ] && HUNG=1
}

# SIGKILLs every worker process in host $1; prints how many.
kill_ranks() {
    local n=0 p
    for p in $(ip netns pids "$1"); do
        if [ "$(cat "/proc/$p/comm" 2>/dev/null)" = python ]; then
            kill -9 "$p" && n=$((n + 1))
        fi
    done
    echo "$n"
}

# Nothing of the job may be left in any host once mpirun has ended (10 s of grace), a cut
# host included, before its link comes back; then the link is restored. Prints what was left.
settle() {
    local h left end=$((SECONDS + 10)) all=""
    while [ $SECONDS -lt $end ]; do
        all=""
        for h in $("${C[@]}" hosts | cut -d' ' -f1); do all="$all$(ip netns pids "$h")"; done
        [ -z "$all" ] && break
        sleep 0.2
    done
    for h in $("${C[@]}" hosts | cut -d' ' -f1); do
        left="$(for p in $(ip netns pids "$h"); do cat "/proc/$p/comm" 2>/dev/null; done | sort | uniq -c | tr -s ' ' | tr '\n' ',')"
        if [ -n "$left" ]; then
            fail "$1: left in $h 10 s after mpirun ended: $left"
            ip netns pids "$h" | xargs -r kill -9
        fi
    done
    if [ -n "$CUT" ]; then
        "${C[@]}" restore "$CUT"
        CUT=""
    fi
}

# The first wall time at which a line matching REGEX was written, over the ranks named.
first_t() {
    local regex="$1" r
    shift
    for r in "$@"; do grep -hE "$regex" "$DIR/rank-$r.log" 2>/dev/null; done |
        sed -n 's/^rank [0-9]* host [^ ]* t=\([0-9.]*\): .*/\1/p' | sort -n | head -1
}
# The largest "recovery took X s" among the ranks named.
recovery_s() {
    local r
    for r in "$@"; do grep -h "WORLD CHANGED" "$DIR/rank-$r.log" 2>/dev/null; done |
        sed -n 's/.*the recovery took \([0-9.]*\) s in all.*/\1/p' | sort -n | tail -1
}
since() { printf '%.2f' "$(echo "$1 - $2" | bc)"; }
count() { local n=0 r; for r in "${@:2}"; do grep -qE "$1" "$DIR/rank-$r.log" 2>/dev/null && n=$((n + 1)); done; echo $n; }
# The exit codes the ranks named recorded, space-separated ("-" where none).
rcs() { local r; for r in "$@"; do cat "$DIR/rank-$r.rc" 2>/dev/null || echo -; done | tr '\n' ' ' | sed 's/ $//'; }
# No rank may have failed a check (a traceback, a wrong value) or trained on past a "no majority".
no_failure() { ! grep -lE "FAILED|Traceback" "$DIR"/rank-*.log "$DIR"/rank-*.out 2>/dev/null; }

# Survivors SURV (original ranks) went on without LOST (a list as Python prints it): each got
# WorldChangedError naming LOST, checked the checkpoint, and finished.
went_on() {
    local lost="$1"
    shift
    [ "$(count "WORLD CHANGED at step 5: lost=\\[$lost\\] world=$# " "$@")" = $# ] &&
        [ "$(count "VALUES OK (at the checkpoint|after the [0-9]+ committed steps)" "$@")" = $# ] &&
        [ "$(count "VALUES OK after 9 steps" "$@")" = $# ] &&
        [ "$(count "DONE rank [0-9]+ of $#, lost \\[$lost\\]" "$@")" = $# ] &&
        [ "$(rcs "$@")" = "$(printf '0 %.0s' "$@" | sed 's/ $//')" ]
}
# The ranks named stopped with "no majority", the next call failing too, and exited non-zero;
# none trained on.
stopped() {
    local r
    [ "$(count "STOPPED at step 5: .*no majority" "$@")" = $# ] &&
        [ "$(count "STOPPED AGAIN" "$@")" = $# ] &&
        [ "$(count "WORLD CHANGED|VALUES OK|DONE" "$@")" = 0 ] || return 1
    for r in $(rcs "$@"); do [ "$r" != - ] && [ "$r" != 0 ] || return 1; done
}

# How the survivors of case DIR kept the keys: "copies" (rebuilt from the lost ranks' copies,
# no key lost) or "checkpoint" (reloaded from it); what their WorldChangedError said.
kept() {
    if grep -qh "WORLD CHANGED.* restored=None" "$DIR"/rank-*.log; then
        echo "copies: $(grep -oh "GOING ON from step [0-9]*" "$DIR"/rank-*.log | sort -u | tr '\n' ' ')"
    else
        echo "checkpoint: $(grep -oh "GOING ON from step [0-9]*" "$DIR"/rank-*.log | sort -u | tr '\n' ' ')"
    fi
}

# --- kill31 / kill32 / kill31ckpt: a host's ranks SIGKILLed while the others wait inside a push.
# Usage: case_kill NAME NP LOST-RANKS "LOST, AS, PYTHON, LISTS" MPIRUN-ARGS -- SURVIVORS...
case_kill() {
    local name="$1" np="$2" lost="$3" lostlist="$4" extra=()
    shift 4
    while [ "$1" != -- ]; do extra+=("$1"); shift; done
    shift
    local surv=("$@") killed at det rec
    start "$name" "$np" "$lost" "${extra[@]}"
    if ! at_hold $(seq 0 $((np - 1))); then
        fail "$name: the ranks did not reach step 5 within 60 s"
        wait "$JOB"
        return
    fi
    sleep 0.3 # the others into the push
    killed=$(kill_ranks "${PREFIX}2")
    at=$(date +%s.%N)
    finish
    det=$(first_t "WORLD CHANGED" "${surv[@]}")
    rec=$(recovery_s "${surv[@]}")
    if [ "$killed" -ne "$(echo "$lost" | tr ',' ' ' | wc -w)" ]; then
        fail "$name: killed $killed ranks on ${PREFIX}2, expected ranks $lost"
    elif [ $HUNG = 1 ]; then
        fail "$name: mpirun hung (killed at its bound of $BOUND s)"
    elif ! no_failure; then
        fail "$name: a rank failed a check (above)"
    elif ! went_on "$lostlist" "${surv[@]}"; then
        fail "$name: survivors ${surv[*]} did not all go on without ranks [$lostlist] and finish (exit codes $(rcs "${surv[@]}"))"
    elif [ $RC -ne 0 ]; then
        fail "$name: the survivors finished but mpirun exited $RC"
    elif [[ " ${extra[*]} " == *" KVSTORE_REPLICAS=0 "* ]] && [[ "$(kept)" != checkpoint* ]]; then
        fail "$name: under KVSTORE_REPLICAS=0 the keys were not reloaded from the checkpoint ($(kept))"
    else
        pass "$name: ${PREFIX}2's $killed rank(s) killed; survivors ${surv[*]} got WorldChangedError $(since "$det" "$at") s later (recovery $rec s), keys kept by $(kept)equal to the replay, then trained on to the replay's values; mpirun exited 0"
    fi
    settle "$name"
}

# --- cut31 / cut22: a host's link cut while the others wait inside a push.
case_cut() {
    local name="$1" np="$2" host="$3" hold="$4" lostlist="$5" surv="$6" stop="$7"
    local at det stop_t rec
    start "$name" "$np" "$hold" "${DETECTOR[@]}" "${KEEPALIVE[@]}"
    if ! at_hold $(seq 0 $((np - 1))); then
        fail "$name: the ranks did not reach step 5 within 60 s"
        wait "$JOB"
        return
    fi
    "${C[@]}" cut "$host"
    CUT="$host"
    at=$(date +%s.%N)
    finish
    local took
    took=$(since "$(date +%s.%N)" "$at")
    det=$(first_t "WORLD CHANGED|STOPPED" $surv $stop)
    stop_t=$(first_t "STOPPED" $stop)
    rec=$(recovery_s $surv)
    if [ $HUNG = 1 ]; then
        fail "$name: mpirun hung (killed at its bound of $BOUND s)"
    elif ! no_failure; then
        fail "$name: a rank failed a check (above)"
    elif [ -n "$surv" ] && ! went_on "$lostlist" $surv; then
        fail "$name: survivors $surv did not all go on without ranks [$lostlist] and finish (exit codes $(rcs $surv))"
    elif [ -n "$surv" ] && grep -q "DONE" <(cat $(printf "$DIR/rank-%s.log " $stop) 2>/dev/null); then
        fail "$name: a rank of the side without a majority finished"
    elif ! stopped $stop; then
        fail "$name: ranks $stop did not all stop with 'no majority' and exit non-zero (exit codes $(rcs $stop))"
    elif [ -z "$surv" ] && [ $RC -eq 0 ]; then
        # (Where a majority finished, mpirun's code is theirs, or its own for the lost daemon.)
        fail "$name: mpirun exited 0 although every rank stopped"
    else
        local what="ranks $stop stopped (no majority) $(since "$stop_t" "$at") s after the cut, exit codes $(rcs $stop)"
        [ -n "$surv" ] && what="survivors $surv got WorldChangedError $(since "$det" "$at") s after the cut (recovery $rec s) and trained on to the replay's values; $what"
        pass "$name: $host cut; $what; mpirun exited $RC ${took} s after the cut"
    fi
    settle "$name"
}

echo "=== cluster elastic: logs in $LOGS"
"${C[@]}" up 3 1gbit
rc=$?
if [ $rc -eq 77 ]; then
    echo "SKIPPED: the kernel refused network namespaces"
    exit 77
fi
[ $rc -eq 0 ] || exit 1
for h in $("${C[@]}" hosts | cut -d' ' -f1); do
    ip netns exec "$h" sysctl -qw net.ipv4.tcp_retries2=5 ||
        { echo "cluster-elastic.sh: could not set net.ipv4.tcp_retries2 in $h" >&2; exit 1; }
done

cases=(${*:-kill31 kill31ckpt kill32 cut31 cut22})
for c in "${cases[@]}"; do
    case "$c" in
        kill31) case_kill kill31 3 2 "2" -- 0 1 ;;
        kill31ckpt) case_kill kill31ckpt 3 2 "2" -x KVSTORE_REPLICAS=0 -- 0 1 ;;
        kill32) case_kill kill32 6 4,5 "4, 5" -- 0 1 2 3 ;;
        cut31) case_cut cut31 3 "${PREFIX}2" 2 "2" "0 1" "2" ;;
        cut22) case_cut cut22 4 "${PREFIX}1" 2,3 "" "" "0 1 2 3" ;;
        *) fail "$c: no such case (cases: kill31 kill31ckpt kill32 cut31 cut22)" ;;
    esac
done

echo "=== cluster elastic: $passed passed, $failed failed of ${#cases[@]} (logs in $LOGS)"
# Every case must have passed: one that ended without a verdict is a failure too. The logs stay
# only for a failure.
if [ $failed -eq 0 ] && [ $passed -eq ${#cases[@]} ]; then
    rm -rf "$LOGS"
    exit 0
fi
exit 1

#!/usr/bin/env bash
# Push and pull from the main thread and from rayon tasks, the store at two commits, run
# alternately round by round; prints the median over rounds of each case side by side.
#
#   benches/par_cost.sh OLD_COMMIT [ROUNDS]    (default 5 rounds; ~2 GiB RAM)
#
# examples/par_cost.rs of this checkout is built against both versions of the library.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: benches/par_cost.sh OLD_COMMIT [ROUNDS]}
rounds=${2:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git archive "$old" | tar -x -C "$work"
cp examples/par_cost.rs "$work/examples/"
target=$PWD/target
(cd "$work" && CARGO_TARGET_DIR="$target" cargo build -q --release --example par_cost)
cp target/release/examples/par_cost "$work/old"
cargo build -q --release --example par_cost
cp target/release/examples/par_cost "$work/new"
for r in $(seq "$rounds"); do
  "$work/old" | sed 's/^/old /' >> "$work/log"
  "$work/new" | sed 's/^/new /' >> "$work/log"
done
python3 - "$work/log" <<'PY'
import sys, statistics, collections
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    ver, case, op, mib, ms = line.split()
    t[(case, op, int(mib), ver)].append(float(ms))
print("| caller | op | size (MiB) | old ms | new ms | new/old |")
print("|---|---|---|---|---|---|")
for (case, op, mib) in sorted({k[:3] for k in t}, key=lambda k: (k[2], k[1], k[0])):
    o = statistics.median(t[(case, op, mib, "old")])
    n = statistics.median(t[(case, op, mib, "new")])
    print(f"| {case} | {op} | {mib} | {o:.2f} | {n:.2f} | {n / o:.2f} |")
PY

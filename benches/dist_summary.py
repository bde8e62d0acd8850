"""Tables of benches/dist_bench.sh's runs (OUT/runs.jsonl), in BENCHMARKS.md's form.

    python3 benches/dist_summary.py target/dist_bench/runs.jsonl

Each cell is the median over rounds of a run's median; a ratio is the median over rounds of
the ratio within a round (the two sides ran interleaved in one run, or, for gloo, in runs one
right after the other).
"""

import json
import sys
from collections import defaultdict


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return float("nan")
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def t(s):
    return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    loads = sorted(r["load"] for r in rows)
    rounds = sorted({r["round"] for r in rows})
    print(f"rounds: {len(rounds)}; load average (1 min) at the start of each run: "
          f"{loads[0]:.2f} to {loads[-1]:.2f}\n")

    store = [r for r in rows if r["tag"] == "store"]
    gloo = {(r["round"], r["ranks"], r["bytes"], r["op"]): r["gloo_s"]
            for r in rows if r["tag"] == "gloo"}
    cells = defaultdict(list)
    for r in store:
        cells[(r["ranks"], r["bytes"], r["op"])].append(r)
    for ranks in sorted({k[0] for k in cells}):
        print(f"**{ranks} ranks**\n")
        print("| size | key | op | store | raw MPI (blocking) | store/raw | raw non-blocking + wait "
              "| store GB/s | raw GB/s | gloo | store vs gloo |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for (rk, b, op), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "push")):
            if rk != ranks:
                continue
            st = median([r["store_s"] for r in rs])
            raw = median([r["raw_s"] for r in rs])
            nb = median([r["nb_s"] for r in rs])
            ratio = median([r["raw_s"] / r["store_s"] for r in rs])
            g = [(gloo[(r["round"], rk, b, op)], r["store_s"]) for r in rs
                 if (r["round"], rk, b, op) in gloo]
            if g:
                gs = median([x for x, _ in g])
                gloo_cells = f"{t(gs)} | {median([x / s for x, s in g]):.2f}×"
            else:
                gloo_cells = "– | –"
            print(f"| {size(b)} | {rs[0]['key']} | {op} ({rs[0]['raw']}) | {t(st)} | {t(raw)} | "
                  f"{100 * ratio:.0f}% | {t(nb)} | {b / st / 1e9:.2f} | {b / raw / 1e9:.2f} | "
                  f"{gloo_cells} |")
        print()

    small = defaultdict(list)
    for r in rows:
        if r["tag"].startswith("check") and "keys" in r:
            small[(r["tag"], r["op"])].append(r)
    if ("check1", "push_list") in small:
        print("**1000 keys × 1 KiB, 4 ranks, fingerprint check on**\n")
        print("| op | store per call | store per key | raw MPI per call (the same packed "
              "collectives) | store/raw |")
        print("|---|---|---|---|---|")
        for op in ["push_list", "pull_list"]:
            rs = small[("check1", op)]
            st = median([r["store_s"] for r in rs])
            raw = median([r["raw_s"] for r in rs])
            ratio = median([r["raw_s"] / r["store_s"] for r in rs])
            print(f"| {op} | {t(st)} | {st * 1e6 / rs[0]['keys']:.2f} µs | {t(raw)} | "
                  f"{100 * ratio:.0f}% |")
        print()

    per = defaultdict(list)
    for r in rows:
        if r["tag"].startswith("check"):
            name = f"{r['op']} of {r['keys']} keys × 1 KiB" if "keys" in r else f"{r['op']} of one 4 KiB key"
            per[(name, r["tag"])].append(r["store_s"])
    names = sorted({n for n, _ in per}, key=lambda n: ("keys" in n, n))
    if names:
        print("**The fingerprint check, 4 ranks** (runs with `KVSTORE_DIST_CHECK=1` and `=0`, "
              "alternating)\n")
        print("| call | check on | check off | cost of the check per call |")
        print("|---|---|---|---|")
        for n in names:
            on = median(per.get((n, "check1"), []))
            off = median(per.get((n, "check0"), []))
            print(f"| {n} | {t(on)} | {t(off)} | {(on - off) * 1e6:.1f} µs |")
        print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target/dist_bench/runs.jsonl")

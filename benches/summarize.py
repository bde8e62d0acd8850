#!/usr/bin/env python3
"""Turns `bench_kv --suite` output (JSON lines) into BENCHMARKS.md's CPU tables.

    python3 benches/summarize.py target/suite.jsonl

Per row: the median over rounds of each round's median. "% of roof" = our moved GB/s / the
matching roof kernel's moved GB/s, both from the same run (each roof kernel ran right before the
store op it matches): push of N <-> sum of N into 1, pull into N <-> 1 into N (fused),
pushpull <-> sum + broadcast (times added), push with an updater <-> sum of N with a
read-modify-write of the stored value.
"""

import json
import statistics
import sys
from collections import defaultdict

KIB, MIB = 1 << 10, 1 << 20


def size_name(b):
    return f"{b // MIB}M" if b >= MIB else f"{b // KIB}K"


def fmt_t(s):
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
    by = defaultdict(list)
    for r in rows:
        by[(r["op"], r["bytes"], r["ndev"], r["updater"], r["dtype"])].append(r["median_s"])
    med = {k: statistics.median(v) for k, v in by.items()}
    rounds = len(next(iter(by.values())))

    def t(op, b, n, upd="assign", dt="float32"):
        return med.get((op, b, n, upd, dt))

    sizes = sorted({k[1] for k in med if k[0] == "push" and k[3] == "assign" and k[1] > KIB})
    ndevs = sorted({k[2] for k in med if k[0] == "push" and k[3] == "assign"})
    print(f"Rounds: {rounds}; each cell the median over rounds of a per-round median.\n")
    print(
        "| op | N | size | time | algbw GB/s | moved GB/s | roof moved GB/s | % of roof |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for op, roof in (("push", "roof_sum"), ("pull", "roof_bcast"), ("pushpull", None)):
        for n in ndevs:
            for b in sizes:
                o = t(op, b, n)
                if o is None:
                    continue
                words = 2 * (n + 1) if op == "pushpull" else n + 1
                if roof:
                    r = t(roof, b, n)
                elif t("roof_sum", b, n) and t("roof_bcast", b, n):
                    r = t("roof_sum", b, n) + t("roof_bcast", b, n)
                else:
                    r = None
                if r is None:
                    continue
                moved = words * b / o / 1e9
                rmoved = words * b / r / 1e9
                print(
                    f"| {op} | {n} | {size_name(b)} | {fmt_t(o)} | {b / o / 1e9:.2f} "
                    f"| {moved:.2f} | {rmoved:.2f} | {100 * r / o:.0f}% |"
                )
    big = [b for b in sizes if b >= 16 * MIB and t("roof_sum", b, ndevs[0])]
    print("\n% of the matching roof at DRAM sizes (same run):\n")
    print("| op | N | " + " | ".join(size_name(b) for b in big) + " |")
    print("|---|---|" + "---|" * len(big))
    allpct = defaultdict(list)
    for op, roof in (("push", "roof_sum"), ("pull", "roof_bcast")):
        for n in ndevs:
            cells = []
            for b in big:
                pct = 100 * t(roof, b, n) / t(op, b, n)
                allpct[op].append(pct)
                cells.append(f"{pct:.0f}%")
            print(f"| {op} | {n} | " + " | ".join(cells) + " |")
    for op, v in allpct.items():
        print(f"\nmedian over the {op} cells above: {statistics.median(v):.0f}%")
    print("\nRoof kernels alone (moved GB/s):\n")
    print("| size | copy | " + " | ".join(f"sum{n} | bcast{n}" for n in ndevs) + " |")
    print("|---|---|" + "---|---|" * len(ndevs))
    for b in sizes:
        if not t("roof_copy", b, 1):
            continue
        cells = [f"{2 * b / t('roof_copy', b, 1) / 1e9:.1f}"]
        for n in ndevs:
            cells.append(f"{(n + 1) * b / t('roof_sum', b, n) / 1e9:.1f}")
            cells.append(f"{(n + 1) * b / t('roof_bcast', b, n) / 1e9:.1f}")
        print(f"| {size_name(b)} | " + " | ".join(cells) + " |")

    print("\nSmall keys: 1000 keys × 1 KiB, 4 devices (MXNet 1.9.1: ≈ 35 µs/key push, ≈ 22 µs/key pull):\n")
    print("| op | per call | per key |")
    print("|---|---|---|")
    for op in ("push_list", "push_loop", "pull_list", "pull_loop"):
        o = t(op, KIB, 4)
        if o is not None:
            print(f"| {op} | {fmt_t(o)} | {o / 1000 * 1e6:.3f} µs |")

    upd = sorted({(k[1], k[4]) for k in med if k[0] == "push" and k[3] != "assign"})
    if upd:
        big = upd[0][0]
        print(f"\nUpdaters: push of 4 values of {size_name(big)} (state in float32):\n")
        print("| dtype | updater | time | algbw GB/s | moved GB/s | % of sum4+rmw roof |")
        print("|---|---|---|---|---|---|")
        r = t("roof_sum_rmw", big, 4)
        rmoved = 6 * big / r / 1e9
        for dt in ("float32", "float16", "bfloat16"):
            esz = 4 if dt == "float32" else 2
            for u, nstate in (("assign", 0), ("axpby", 0), ("sgd", 0), ("sgd_mom", 1), ("adam", 2)):
                o = t("push", big, 4, u, dt)
                if o is None:
                    continue
                words = 5 if u == "assign" else 6
                moved = (words * big + nstate * 2 * (big // esz) * 4) / o / 1e9
                print(
                    f"| {dt} | {u} | {fmt_t(o)} | {big / o / 1e9:.2f} | {moved:.2f} "
                    f"| {100 * moved / rmoved:.0f}% |"
                )
        print(f"\n(roof sum4+rmw at {size_name(big)}: {rmoved:.1f} GB/s moved, float32)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Summarizes benches/cluster_bench.sh's json lines: per link rate, layout, size and op, each
build's median time over the rounds, the median per-round A/B (> 1: B faster), raw MPI's
median, and B against the wire bound: the fewest bytes that must leave the busiest host,
(H - 1) / H of the key, over the link's measured rate.

usage: benches/cluster_summary.py runs.jsonl
"""
import json
import statistics
import sys
from collections import defaultdict


def fmt(s):
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def main(path):
    cells = defaultdict(lambda: defaultdict(dict))
    raw = defaultdict(list)
    for line in open(path):
        r = json.loads(line)
        key = (r["rate"], r["layout"], r["bytes"], r["op"], r["link_mbs"])
        cells[key][r["round"]][r["build"]] = r["store_s"]
        if r.get("raw_s"):
            raw[key].append(r["raw_s"])
    print("| link | layout | size | op | A | B | A/B per round | raw MPI | bound | B / bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2], k[3])):
        rate, layout, size, op, mbs = key
        rounds = cells[key]
        a = [v["A"] for v in rounds.values() if "A" in v]
        b = [v["B"] for v in rounds.values() if "B" in v]
        ratio = [v["A"] / v["B"] for v in rounds.values() if "A" in v and "B" in v]
        hosts = int(layout.split("x")[0])
        bound = size * (hosts - 1) / hosts / (mbs * 1e6)
        mb = statistics.median(b) if b else float("nan")
        print(
            f"| {rate} | {layout} | {size >> 20} MiB | {op} | "
            if size >= 1 << 20
            else f"| {rate} | {layout} | {size >> 10} KiB | {op} | ",
            end="",
        )
        print(
            f"{fmt(statistics.median(a)) if a else '-'} | {fmt(mb) if b else '-'} | "
            f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | "
            f"{fmt(statistics.median(raw[key])) if raw[key] else '-'} | {fmt(bound)} | "
            f"{mb / bound:.2f} |"
            if ratio
            else "- | - | - | - | - |"
        )


main(sys.argv[1])

#!/usr/bin/env python3
"""Summarizes benches/ab_pipeline.sh's json lines: per cell, each build's median time over the
pairs, and the median of the per-pair ratios A/B (> 1: B is faster).

usage: benches/ab_pipeline_summary.py ab.jsonl
"""
import json
import statistics
import sys
from collections import defaultdict


def cell(r):
    if "cmd" in r:  # bench_kv: the local store
        return ("local", r["cmd"]), r["median_s"]
    if "keys" in r:  # bench_dist_store: 1000 small keys in one list call
        return (f"dist {r['ranks']} ranks", f"{r['op']}_list {r['keys']} x 1 KiB ({r['check']})"), r["store_s"]
    return (f"dist {r['ranks']} ranks", f"{r['op']} {r['bytes']} B {r['key']} ({r['check']})"), r["store_s"]


def main(path):
    times = defaultdict(lambda: defaultdict(dict))
    loads = []
    for line in open(path):
        r = json.loads(line)
        key, t = cell(r)
        times[key][r["pair"]][r["build"]] = t
        loads.append(r["load"])
    print(f"load {min(loads)}-{max(loads)}")
    print("| bench | cell | A (median) | B (median) | A/B per pair: median (min-max) |")
    print("|---|---|---|---|---|")
    for key in sorted(times):
        pairs = times[key]
        a = [p["A"] for p in pairs.values() if "A" in p]
        b = [p["B"] for p in pairs.values() if "B" in p]
        ratios = [p["A"] / p["B"] for p in pairs.values() if "A" in p and "B" in p]
        if not ratios:
            continue
        fmt = lambda s: f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"
        print(
            f"| {key[0]} | {key[1]} | {fmt(statistics.median(a))} | {fmt(statistics.median(b))} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


main(sys.argv[1])

#!/usr/bin/env python3
"""Summarizes benches/ab_pipeline.sh's json lines: per cell, each build's median time over the
rounds, and the median of the per-round ratios A/B (and A/C; > 1: B, or C, is faster).

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
    builds = sorted({b for cells in times.values() for p in cells.values() for b in p})
    others = [b for b in builds if b != "A"]
    print("| bench | cell | " + " | ".join(f"{b} (median)" for b in builds) + " | "
          + " | ".join(f"A/{b} per round: median (min-max)" for b in others) + " |")
    print("|---|---|" + "---|" * (len(builds) + len(others)))
    fmt = lambda s: f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"
    for key in sorted(times):
        pairs = times[key]
        meds = []
        for b in builds:
            v = [p[b] for p in pairs.values() if b in p]
            meds.append(fmt(statistics.median(v)) if v else "-")
        ratios = []
        for b in others:
            r = [p["A"] / p[b] for p in pairs.values() if "A" in p and b in p]
            ratios.append(f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" if r else "-")
        print(f"| {key[0]} | {key[1]} | " + " | ".join(meds) + " | " + " | ".join(ratios) + " |")


main(sys.argv[1])

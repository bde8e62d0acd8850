"""Summary of torch_cnn/job*.json: per kvstore mode, the stores' medians and the ratios taken
inside each job (Rs: copies sent; R1: sums replayed; R0: no copies), by store order and over
both. Usage: python3 summary.py torch_cnn"""
import json, os, statistics, sys

d = sys.argv[1]
jobs = [json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d)) if f.endswith(".json")]


def med(v):
    return f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})"


for mode in ("kvstore_blocking", "kvstore_overlap"):
    rows = [{s: j["median_ms"][f"{mode}_{s}"] for s in ("r0", "r1", "rs")} | {
        "ddp": j["median_ms"]["ddp_gloo"],
        "first": next(k for k in j["median_ms"] if k.startswith("kvstore")).rsplit("_", 1)[1]}
        for j in jobs]
    print(f"{mode}: {len(rows)} jobs; medians R0 {statistics.median(r['r0'] for r in rows):.1f} ms, "
          f"R1 {statistics.median(r['r1'] for r in rows):.1f} ms, Rs "
          f"{statistics.median(r['rs'] for r in rows):.1f} ms, DDP "
          f"{statistics.median(r['ddp'] for r in rows):.1f} ms")
    for first in sorted({r["first"] for r in rows}):
        sub = [r for r in rows if r["first"] == first]
        print(f"  {first} first ({len(sub)} jobs): R1/R0 {med([r['r1'] / r['r0'] for r in sub])}, "
              f"Rs/R0 {med([r['rs'] / r['r0'] for r in sub])}, Rs/R1 {med([r['rs'] / r['r1'] for r in sub])}")
    print(f"  all: R1/R0 {med([r['r1'] / r['r0'] for r in rows])}, Rs/R0 "
          f"{med([r['rs'] / r['r0'] for r in rows])}, Rs/R1 {med([r['rs'] / r['r1'] for r in rows])}")

#!/usr/bin/env python3
"""The table of the float16/bfloat16 A/B made by `bench_kv --half-ab`.

    cargo build --release --example bench_kv
    KVSTORE_BENCH_DEVICE=cpu target/release/examples/bench_kv --half-ab 5 64M 8 > target/half_ab.jsonl
    python3 benches/half_ab.py target/half_ab.jsonl

`--half-ab ROUNDS SIZE REPS`: per round, dtype and updater, one store (4 values of SIZE) and
the sum-of-4 + read-modify-write roof kernel (float32, SIZE per array), timed rep by rep in a
rotating order (REPS timed reps each after one warm-up): the roof, a push on the portable loops
(`base`: the code before the AVX2/F16C path) and a push on the AVX2/F16C path (`new`).
float32 is a control (its two arms run the same code). Per cell the table gives the median over
rounds of: each arm's median time, its moved GB/s, its % of the roof measured in the same
cell, and the new/base time ratio.
"""

import json
import statistics
import sys

DTYPES = ["float32", "float16", "bfloat16"]
UPDATERS = ["assign", "axpby", "sgd", "sgd_mom", "adam"]


def main():
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    by = {(r["round"], r["dtype"], r["updater"], r["arm"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    med = statistics.median
    print(f"Rounds: {len(rounds)}; each cell the median over rounds.\n")
    print("| dtype | updater | base time | new time | new/base | base moved GB/s | "
          "new moved GB/s | roof moved GB/s | base % of roof | new % of roof |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in DTYPES:
        for upd in UPDATERS:
            ks = [k for k in rounds if (k, dtype, upd, "new") in by]
            if not ks:
                continue
            b = [by[(k, dtype, upd, "base")] for k in ks]
            n = [by[(k, dtype, upd, "new")] for k in ks]
            roof = [by[(k, dtype, upd, "roof")]["moved_gbps"] for k in ks]
            tb, tn = med([x["median_s"] for x in b]), med([x["median_s"] for x in n])
            ratio = med([y["median_s"] / x["median_s"] for x, y in zip(b, n)])
            pb = med([x["moved_gbps"] / r for x, r in zip(b, roof)])
            pn = med([x["moved_gbps"] / r for x, r in zip(n, roof)])
            print(f"| {dtype} | {upd} | {tb * 1e3:.2f} ms | {tn * 1e3:.2f} ms | {ratio:.2f} | "
                  f"{med([x['moved_gbps'] for x in b]):.2f} | "
                  f"{med([x['moved_gbps'] for x in n]):.2f} | {med(roof):.2f} | "
                  f"{100 * pb:.0f}% | {100 * pn:.0f}% |")


if __name__ == "__main__":
    main()

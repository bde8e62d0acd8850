"""The table of benches/cluster_peers.sh's lines: per layout and size, the medians over the
rounds of kvstore's push, pull and push + pull, gloo's reduce, broadcast and allreduce, and
MXNet's push and pull, with each peer's time over kvstore's (above 1: kvstore ahead), per
round and as the median of those ratios.

    python3 benches/cluster_peers_summary.py lines.txt
"""
import json
import statistics
import sys
from collections import defaultdict

# (layout, round, peer, op, bytes) -> seconds
t = {}
links = {}
for line in open(sys.argv[1]):
    f = line.split()
    if not f:
        continue
    if f[0] == "link":
        links[f[1]] = f[2]
    elif f[0] == "kvstore-json":
        d = json.loads(line.split(None, 3)[3])
        t[(f[1], int(f[2]), "kvstore", d["op"], d["bytes"])] = d["store_s"]
        t[(f[1], int(f[2]), "mpi", d["raw"], d["bytes"])] = d["raw_s"]
    elif f[0] in ("gloo", "mxnet"):
        t[(f[1], int(f[2]), f[0], f[3], int(f[4]))] = float(f[5])

rounds = defaultdict(set)
for (layout, rnd, *_rest) in t:
    rounds[layout].add(rnd)


def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def ms(s):
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def per_round(layout, b, peer, ops, ours):
    """The peer's time (the sum of `ops`) over kvstore's (the sum of `ours`), per round."""
    out = []
    for r in sorted(rounds[layout]):
        p = [t.get((layout, r, peer, o, b)) for o in ops]
        k = [t.get((layout, r, "kvstore", o, b)) for o in ours]
        if None not in p and None not in k:
            out.append(sum(p) / sum(k))
    return out


def med(layout, b, peer, ops):
    v = [sum(t[(layout, r, peer, o, b)] for o in ops) for r in sorted(rounds[layout])
         if all((layout, r, peer, o, b) in t for o in ops)]
    return statistics.median(v) if v else None


def ratio(v):
    return f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})" if v else "—"


for layout in sorted(rounds):
    print(f"\n{layout}, link {links.get(layout, '?')} MB/s, {len(rounds[layout])} rounds\n")
    print("| size | kvstore push / pull / both | gloo reduce / broadcast / allreduce | MXNet push / pull / both | gloo reduce ÷ push | gloo bcast ÷ pull | gloo allreduce ÷ both | MXNet push ÷ push | MXNet pull ÷ pull | MXNet both ÷ both |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sizes = sorted({k[4] for k in t if k[0] == layout})
    for b in sizes:
        kv = [med(layout, b, "kvstore", o) for o in (["push"], ["pull"], ["push", "pull"])]
        gl = [med(layout, b, "gloo", [o]) for o in ("reduce", "broadcast", "allreduce")]
        mx = [med(layout, b, "mxnet", o) for o in (["push"], ["pull"], ["push", "pull"])]
        fmt = lambda v: " / ".join(ms(x) if x is not None else "—" for x in v)
        cells = [
            ratio(per_round(layout, b, "gloo", ["reduce"], ["push"])),
            ratio(per_round(layout, b, "gloo", ["broadcast"], ["pull"])),
            ratio(per_round(layout, b, "gloo", ["allreduce"], ["push", "pull"])),
            ratio(per_round(layout, b, "mxnet", ["push"], ["push"])),
            ratio(per_round(layout, b, "mxnet", ["pull"], ["pull"])),
            ratio(per_round(layout, b, "mxnet", ["push", "pull"], ["push", "pull"])),
        ]
        print(f"| {size(b)} | {fmt(kv)} | {fmt(gl)} | {fmt(mx)} | " + " | ".join(cells) + " |")

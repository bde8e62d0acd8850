#!/usr/bin/env python3
"""MXNet 1.9.1 KVStore vs ours, interleaved A/B in one run, on the CPU.

Run from the repository root:

    python3 benches/mxnet_peer.py [--rounds 3] [--json target/mxnet_peer.json]

It builds `examples/bench_kv` in release, creates a venv (default /tmp/kvbench-mxv) with
`mxnet==1.9.1` and `numpy<1.24` if it has none, and re-runs itself inside it. Ours runs in a
`bench_kv --serve` child process; every workload is timed as ours then MXNet (odd rounds: MXNet
then ours), so both see the same machine state. Each timed region ends with `mx.nd.waitall()`
(ours: the call returns when done). Per workload the table shows the median over rounds of the
per-round medians, and ratio = our bandwidth / MXNet's (= MXNet time / our time).

Workloads (one key, N = 4 logical devices cpu(0..3), float32):
  push, pull, pushpull   no updater (stored = sum)
  push sgd               kv.set_optimizer(SGD(learning_rate=0.01)) vs Updater::Sgd(lr 0.01)
  push_list, pull_list   1000 keys x 1 KiB in one list call
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIB, MIB = 1 << 10, 1 << 20


def parse_size(s):
    mul = {"K": KIB, "M": MIB, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mul != 1 else s) * mul


def size_name(b):
    return f"{b // MIB}M" if b >= MIB else f"{b // KIB}K"


def auto_reps(b):
    if b <= 64 * KIB:
        return 200
    if b <= MIB:
        return 100
    if b <= 16 * MIB:
        return 30
    if b <= 64 * MIB:
        return 12
    return 6


def ensure_venv(venv):
    """Re-exec inside a venv that has mxnet, creating it first if needed."""
    try:
        import mxnet  # noqa: F401

        return
    except ImportError:
        pass
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        print(f"creating venv {venv}", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", venv])
    ok = subprocess.run([py, "-c", "import mxnet"], capture_output=True).returncode == 0
    if not ok:
        print("installing mxnet==1.9.1 numpy<1.24", file=sys.stderr)
        subprocess.check_call([py, "-m", "pip", "install", "-q", "mxnet==1.9.1", "numpy<1.24"])
    os.execv(py, [py] + sys.argv)


class Ours:
    """`bench_kv --serve`: one command line in, one JSON line out."""

    def __init__(self, binary):
        env = dict(os.environ, KVSTORE_BENCH_DEVICE="cpu")
        self.p = subprocess.Popen(
            [binary, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def run(self, op, size, ndev, reps, warmup, updater="assign"):
        self.p.stdin.write(f"{op} {size} {ndev} {reps} {warmup} {updater} float32\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        if "error" in r:
            raise RuntimeError(r["error"])
        return r["times"]

    def close(self):
        self.p.stdin.close()
        self.p.wait()


class Mx:
    """The same workloads on an MXNet `local` store."""

    def __init__(self):
        import mxnet as mx

        self.mx = mx

    def run(self, op, size, ndev, reps, warmup, updater="assign"):
        mx = self.mx
        nd = mx.nd
        kv = mx.kv.create("local")
        if updater == "sgd":
            kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01))
        elif updater != "assign":
            raise ValueError(updater)
        ctx = [mx.cpu(i) for i in range(ndev)]
        if op in ("push_list", "pull_list"):
            n = size // 4
            keys = list(range(1000))
            kv.init(keys, [nd.zeros((n,)) for _ in keys])
            vals = [[nd.full((n,), i + 1, ctx=c) for i, c in enumerate(ctx)] for _ in keys]
            outs = [[nd.zeros((n,), ctx=c) for c in ctx] for _ in keys]
            if op == "push_list":
                f = lambda: kv.push(keys, vals)  # noqa: E731
            else:
                f = lambda: kv.pull(keys, out=outs)  # noqa: E731
        else:
            n = size // 4
            kv.init(0, nd.full((n,), 0.5))
            vals = [nd.full((n,), 0.25 * (i + 1), ctx=c) for i, c in enumerate(ctx)]
            outs = [nd.zeros((n,), ctx=c) for c in ctx]

            def pushpull():
                kv.push(0, vals)
                kv.pull(0, out=outs)

            f = {
                "push": lambda: kv.push(0, vals),
                "pull": lambda: kv.pull(0, out=outs),
                "pushpull": pushpull,
            }[op]
        nd.waitall()
        for _ in range(warmup):
            f()
            nd.waitall()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            nd.waitall()
            times.append(time.perf_counter() - t)
        del kv, vals, outs
        nd.waitall()
        return times


def moved(op, updater, ndev, size):
    if op in ("push_list", "pull_list"):
        return 1000 * (ndev + 1) * size
    push = (ndev + (1 if updater == "assign" else 2)) * size
    return {"push": push, "pull": (ndev + 1) * size, "pushpull": push + (ndev + 1) * size}[op]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M")
    ap.add_argument("--ndev", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ops", default="push,pull,pushpull,sgd,smallkeys")
    ap.add_argument("--venv", default=os.environ.get("KVBENCH_VENV", "/tmp/kvbench-mxv"))
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/examples/bench_kv"))
    ap.add_argument("--no-build", action="store_true", help="use --bin as it is")
    ap.add_argument("--json", default=os.path.join(ROOT, "target/mxnet_peer.json"))
    args = ap.parse_args()
    ensure_venv(args.venv)
    if not args.no_build:
        subprocess.check_call(
            ["cargo", "build", "--release", "--quiet", "--example", "bench_kv"], cwd=ROOT
        )

    ops = args.ops.split(",")
    work = []  # (label, op, size, updater)
    for s in map(parse_size, args.sizes.split(",")):
        for op in ("push", "pull", "pushpull"):
            if op in ops:
                work.append((op, op, s, "assign"))
        if "sgd" in ops:
            work.append(("push sgd", "push", s, "sgd"))
    if "smallkeys" in ops:
        work.append(("push_list 1000x1K", "push_list", KIB, "assign"))
        work.append(("pull_list 1000x1K", "pull_list", KIB, "assign"))

    ours, mx = Ours(args.bin), Mx()
    meds = {w: {"ours": [], "mxnet": []} for w in work}
    t0 = time.time()
    for rnd in range(args.rounds):
        for w in work:
            label, op, size, upd = w
            reps = 30 if op.endswith("_list") else auto_reps(size)
            order = [("ours", ours), ("mxnet", mx)]
            if rnd % 2:
                order.reverse()
            for name, impl in order:
                t = impl.run(op, size, args.ndev, reps, args.warmup, upd)
                meds[w][name].append(statistics.median(t))
            print(
                f"round {rnd} {label:18} {size_name(size):>5}: ours {meds[w]['ours'][-1] * 1e6:10.1f} us"
                f"  mxnet {meds[w]['mxnet'][-1] * 1e6:10.1f} us   [{time.time() - t0:.0f} s]",
                file=sys.stderr,
            )
    ours.close()

    import mxnet

    rows = []
    for w in work:
        label, op, size, upd = w
        o, m = statistics.median(meds[w]["ours"]), statistics.median(meds[w]["mxnet"])
        one = 1000 * size if op.endswith("_list") else size
        mv = moved(op, upd, args.ndev, size)
        rows.append(
            {
                "workload": label,
                "op": op,
                "updater": upd,
                "bytes": size,
                "ndev": args.ndev,
                "ours_s": o,
                "mxnet_s": m,
                "ours_rounds_s": meds[w]["ours"],
                "mxnet_rounds_s": meds[w]["mxnet"],
                "ours_algbw_gbps": one / o / 1e9,
                "mxnet_algbw_gbps": one / m / 1e9,
                "ours_moved_gbps": mv / o / 1e9,
                "mxnet_moved_gbps": mv / m / 1e9,
                "ratio": m / o,
            }
        )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"mxnet": mxnet.__version__, "rounds": args.rounds, "rows": rows}, f, indent=1)

    print(
        f"MXNet {mxnet.__version__} vs ours, {args.ndev} devices, float32, median of {args.rounds} "
        "interleaved rounds (each a median of reps)\n"
    )
    print(
        "| workload | size | ours µs | MXNet µs | ours algbw GB/s | MXNet algbw GB/s "
        "| ours moved GB/s | MXNet moved GB/s | ours/MXNet |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per = " (per call)" if r["op"].endswith("_list") else ""
        print(
            f"| {r['workload']}{per} | {size_name(r['bytes'])} | {r['ours_s'] * 1e6:.1f} "
            f"| {r['mxnet_s'] * 1e6:.1f} | {r['ours_algbw_gbps']:.3f} | {r['mxnet_algbw_gbps']:.3f} "
            f"| {r['ours_moved_gbps']:.2f} | {r['mxnet_moved_gbps']:.2f} | {r['ratio']:.1f}× |"
        )
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()

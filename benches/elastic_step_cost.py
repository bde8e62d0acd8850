"""What fault tolerance costs a healthy step (issue 39): plain mpirun, against
``mpirun --with-ft ulfm`` with KVSTORE_REPLICAS=0 (the commit agreement only) and with
KVSTORE_REPLICAS=1 (the agreement and the buddy copies), jobs interleaved round by round.
The copies are kept current by replaying the sums (the default), and with ``--ab-order 01s``
(torch) or ``--with-send`` (tdp) also by sending the updated parts
(KVSTORE_REPLICA_UPDATE=send).

    V=/work/venv-cluster/venv; export PYTHONPATH=...     # python with torch, kvstore, kvstore_mpi
    R=benches/results/elastic_2026-11-29
    # the torch bench's CNN at 4 ranks: per round a plain job, then a ULFM job that holds a
    # KVSTORE_REPLICAS=0 store and a =1 store side by side (torch_overlap.py --replicas-ab)
    $V/bin/python benches/elastic_step_cost.py torch --ranks 4 --pairs 5 --dir $R/torch_cnn
    $V/bin/python benches/elastic_step_cost.py torch-summary $R/torch_cnn
    # the communication-bound train_data_parallel (a release build with --features mpi,
    # against the Open MPI of $V: PATH=$V/bin:$PATH cargo build --release --features mpi
    # --example train_data_parallel; it is run with LD_LIBRARY_PATH=$V/lib, else it loads
    # Debian's Open MPI 4): plain, ULFM R0, ULFM R1 jobs in turn
    $V/bin/python benches/elastic_step_cost.py tdp --bin target/release/examples/train_data_parallel \\
        --ranks 4 --rounds 8 --out $R/train_data_parallel.jsonl
    $V/bin/python benches/elastic_step_cost.py tdp-summary $R/train_data_parallel.jsonl

Every job runs under ``timeout -k 5``. Open MPI's ``OMPI_MCA_mpi_yield_when_idle=1`` and
``--oversubscribe`` as in every dist bench here (4 ranks on a 2-core machine).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
MPIRUN = os.path.join(os.path.dirname(PY), "mpirun")
ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1", KVSTORE_TIMEOUT="120")


def job(n, ft, argv, env=None, timeout=600):
    e = dict(os.environ)
    e.update(ENV)
    e.update(env or {})
    cmd = ["timeout", "-k", "5", str(timeout), MPIRUN, *(["--with-ft", "ulfm"] if ft else []),
           "--oversubscribe", "-np", str(n), *argv]
    t = time.time()
    p = subprocess.run(cmd, env=e, capture_output=True, text=True)
    return p.returncode, time.time() - t, p.stdout + p.stderr


def torch_runs(a):
    os.makedirs(a.dir, exist_ok=True)
    for i in range(a.first_pair, a.first_pair + a.pairs):
        for launch in ("plain", "ulfm"):
            port = 29700 + 2 * i + (launch == "ulfm")
            out = os.path.join(a.dir, f"pair{i}_{launch}.json")
            argv = [PY, os.path.join(HERE, "torch_overlap.py"), "--model", a.model,
                    "--rounds", str(a.rounds), "--steps", str(a.steps), "--modes", a.modes,
                    "--json", out]
            if launch == "ulfm":
                argv += ["--replicas-ab", "--ab-order", a.ab_order]
            rc, wall, text = job(a.ranks, launch == "ulfm", argv,
                                 {"KVSTORE_BENCH_PORT": str(port)})
            with open(os.path.join(a.dir, f"pair{i}_{launch}.txt"), "w") as f:
                f.write(f"rc={rc} wall={wall:.1f}s load={os.getloadavg()[0]:.2f}\n{text}")
            print(f"pair {i} {launch}: rc={rc} {wall:.0f} s", flush=True)


def torch_summary(a):
    rows = {}
    for name in sorted(os.listdir(a.dir)):
        if not name.endswith(".json"):
            continue
        d = json.load(open(os.path.join(a.dir, name)))
        launch = "ulfm" if "ulfm" in name else "plain"
        pair = int(re.match(r"pair(\d+)", name).group(1))
        rows.setdefault(pair, {})[launch] = d["median_ms"]
        if launch == "ulfm":
            # The store created first (and run first in each round): json keeps the order.
            first = next(k for k in d["median_ms"] if k.startswith("kvstore"))
            rows[pair]["order"] = first.rsplit("_", 1)[1] + " first"
    modes = sorted({m for p in rows.values() for l in p.values() for m in l})
    print("per pair (median step of the slowest rank, ms):")
    for p, r in sorted(rows.items()):
        print(f"  pair {p}: " + "; ".join(f"{l}: " + ", ".join(f"{m} {v:.1f}" for m, v in
                                                                 sorted(r[l].items()))
                                          for l in ("plain", "ulfm") if l in r))

    def med(v):
        return f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})"

    for base in sorted({m.rsplit('_r', 1)[0] for m in modes if m.startswith("kvstore")}):
        r0 = [r["ulfm"][f"{base}_r0"] for r in rows.values() if "ulfm" in r]
        r1 = [r["ulfm"][f"{base}_r1"] for r in rows.values() if "ulfm" in r]
        plain = [r["plain"][base] for r in rows.values() if "plain" in r]
        ddp_p = [r["plain"]["ddp_gloo"] for r in rows.values() if "plain" in r]
        ddp_u = [r["ulfm"]["ddp_gloo"] for r in rows.values() if "ulfm" in r]
        both = [r for r in rows.values() if "ulfm" in r and "plain" in r]
        print(f"{base}: plain {statistics.median(plain):.1f} ms, ULFM R0 "
              f"{statistics.median(r0):.1f} ms, ULFM R1 {statistics.median(r1):.1f} ms "
              f"(DDP in the same jobs: plain {statistics.median(ddp_p):.1f}, ULFM "
              f"{statistics.median(ddp_u):.1f})")
        print(f"  R1 / R0 in the same ULFM job, per pair: {med([b / a for a, b in zip(r0, r1)])}")
        by_order = {}
        for r in rows.values():
            if "ulfm" in r:
                by_order.setdefault(r["order"], []).append(
                    r["ulfm"][f"{base}_r1"] / r["ulfm"][f"{base}_r0"])
        for o, v in sorted(by_order.items()):
            print(f"    {o} ({len(v)} pairs): {med(v)}")
        if all(f"{base}_rs" in r["ulfm"] for r in rows.values() if "ulfm" in r):
            rs = [r["ulfm"][f"{base}_rs"] for r in rows.values() if "ulfm" in r]
            print(f"  sent copies: ULFM Rs {statistics.median(rs):.1f} ms; Rs / R0 in the same "
                  f"job, per pair: {med([b / a for a, b in zip(r0, rs)])}; Rs / R1: "
                  f"{med([b / a for a, b in zip(r1, rs)])}")
        if len(by_order) == 2:
            a_, b_ = (statistics.median(v) for v in by_order.values())
            print(f"    balanced over the order (geometric mean of the two medians): "
                  f"{(a_ * b_) ** 0.5:.3f}")
        print(f"  ULFM R0 / plain, each over its job's DDP: "
              f"{med([(r['ulfm'][base + '_r0'] / r['ulfm']['ddp_gloo']) / (r['plain'][base] / r['plain']['ddp_gloo']) for r in both])}")
        print(f"  ULFM R1 / plain, each over its job's DDP: "
              f"{med([(r['ulfm'][base + '_r1'] / r['ulfm']['ddp_gloo']) / (r['plain'][base] / r['plain']['ddp_gloo']) for r in both])}")
        print(f"  ULFM R0 / plain, raw: {med([r['ulfm'][base + '_r0'] / r['plain'][base] for r in both])}; "
              f"R1 / plain, raw: {med([r['ulfm'][base + '_r1'] / r['plain'][base] for r in both])}")


def tdp(a):
    modes = [("plain", False, None), ("ulfm_r0", True, "0"), ("ulfm_r1", True, "1")]
    if a.with_send:
        modes.append(("ulfm_rs", True, "s"))
    with open(a.out, "a") as f:
        for rnd in range(a.first_round, a.first_round + a.rounds):
            for name, ft, rep in modes:
                # The example links libmpi.so.40 by name: the Open MPI 5 beside this python.
                env = {"LD_LIBRARY_PATH": os.path.join(os.path.dirname(os.path.dirname(PY)),
                                                       "lib")}
                if rep == "s":
                    env.update(KVSTORE_REPLICAS="1", KVSTORE_REPLICA_UPDATE="send")
                elif rep is not None:
                    env.update(KVSTORE_REPLICAS=rep, KVSTORE_REPLICA_UPDATE="replay")
                argv = [a.bin, "--kind", "dist_sync", "--epochs", str(a.epochs), "--check", "0",
                        "--optimizer", a.optimizer]
                rc, wall, text = job(a.ranks, ft, argv, env, timeout=300)
                m = re.search(r"step time, median of this rank's steps: ([0-9.]+) ms \((\d+) steps",
                              text)
                done = re.search(r"done: (\d+) samples in ([0-9.]+) s", text)
                line = {"round": rnd, "mode": name, "ranks": a.ranks, "rc": rc,
                        "wall_s": round(wall, 2), "load1": os.getloadavg()[0],
                        "step_ms": float(m.group(1)) if m else None,
                        "steps": int(m.group(2)) if m else None,
                        "train_s": float(done.group(2)) if done else None}
                if rc != 0 or not m:
                    line["output"] = text[-3000:]
                f.write(json.dumps(line) + "\n")
                f.flush()
                print(json.dumps({k: v for k, v in line.items() if k != "output"}), flush=True)


def tdp_summary(a):
    rounds = {}
    for l in open(a.file):
        d = json.loads(l)
        if d.get("step_ms") is not None:
            rounds.setdefault(d["round"], {})[d["mode"]] = d
    names = ["plain", "ulfm_r0", "ulfm_r1"]
    if any("ulfm_rs" in r for r in rounds.values()):
        names.append("ulfm_rs")
    full = [r for r in rounds.values() if all(m in r for m in names)]

    def med(v):
        return f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})"

    for m in names:
        print(f"{m}: step {med([r[m]['step_ms'] for r in full])} ms, training "
              f"{med([r[m]['train_s'] for r in full])} s")
    print(f"ULFM R0 / plain per round: {med([r['ulfm_r0']['step_ms'] / r['plain']['step_ms'] for r in full])}")
    print(f"ULFM R1 / plain per round: {med([r['ulfm_r1']['step_ms'] / r['plain']['step_ms'] for r in full])}")
    print(f"ULFM R1 / R0 per round: {med([r['ulfm_r1']['step_ms'] / r['ulfm_r0']['step_ms'] for r in full])}")
    if "ulfm_rs" in names:
        print(f"ULFM Rs / R0 per round: {med([r['ulfm_rs']['step_ms'] / r['ulfm_r0']['step_ms'] for r in full])}")
        print(f"ULFM Rs / R1 per round: {med([r['ulfm_rs']['step_ms'] / r['ulfm_r1']['step_ms'] for r in full])}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("torch")
    t.add_argument("--ranks", type=int, default=4)
    t.add_argument("--model", default="cnn")
    t.add_argument("--pairs", type=int, default=5)
    t.add_argument("--rounds", type=int, default=6)
    t.add_argument("--steps", type=int, default=5)
    t.add_argument("--modes", default="kvstore_blocking,kvstore_overlap")
    t.add_argument("--dir", required=True)
    t.add_argument("--first-pair", type=int, default=0, help="numbers the pairs from here")
    t.add_argument("--ab-order", default="01", help="torch_overlap.py --ab-order")
    ts = sub.add_parser("torch-summary")
    ts.add_argument("dir")
    d = sub.add_parser("tdp")
    d.add_argument("--bin", required=True)
    d.add_argument("--ranks", type=int, default=4)
    d.add_argument("--rounds", type=int, default=8)
    d.add_argument("--epochs", type=int, default=10)
    d.add_argument("--optimizer", default="sgd")
    d.add_argument("--first-round", type=int, default=0,
                   help="numbers the rounds from here (to append more rounds to --out)")
    d.add_argument("--out", required=True)
    d.add_argument("--with-send", action="store_true",
                   help="a fourth job per round: KVSTORE_REPLICA_UPDATE=send")
    ds = sub.add_parser("tdp-summary")
    ds.add_argument("file")
    a = ap.parse_args()
    {"torch": torch_runs, "torch-summary": torch_summary, "tdp": tdp,
     "tdp-summary": tdp_summary}[a.cmd](a)


if __name__ == "__main__":
    main()

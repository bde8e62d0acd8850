"""TorchElastic's answer to a lost worker, timed: torchrun --max-restarts restarts every worker,
which reload the last checkpoint (issue 39's side by side).

    V=/work/venv-cluster/venv
    timeout -k 5 300 $V/bin/torchrun --standalone --nproc-per-node 4 --max-restarts 1 \\
        --monitor-interval 0.1 benches/torchelastic_restart.py --ckpt /tmp/te/ckpt.pt \\
        --steps 20 --ckpt-every 10 --kill-step 15 --kill-rank 3
    $V/bin/python benches/torchelastic_restart.py --summary LOGS...   # the table from saved logs

The model is benches/torch_overlap.py's CNN (545 098 parameters), trained with DDP (gloo) and
SGD with momentum on a fixed batch of 32 per rank, one thread per rank. Rank 0 saves the model
and the optimizer's state every --ckpt-every steps (torch.save to a temporary file, then a
rename). In the first attempt (TORCHELASTIC_RESTART_COUNT=0), --kill-rank prints a wall-clock
timestamp and SIGKILLs itself at the start of --kill-step. torchrun's agent sees the worker
die, stops the others, and starts every worker again; they meet again (init_process_group),
load the checkpoint and go on from its step. Each worker prints one ``TE {json}`` line per
event with wall-clock times: its start (before torch is imported), torch imported, the process
group up, the checkpoint loaded (the first step of the new attempt), and the end. The
restart time is the latest worker's "resumed" minus the kill; the steps lost are the kill step
minus the checkpoint's step (those steps are computed again).
"""

import json
import os
import sys
import time

T_START = time.time()


def te(event, **kw):
    kw.update(event=event, t=time.time(), rank=int(os.environ.get("RANK", -1)),
              attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", -1)))
    sys.stdout.write("TE " + json.dumps(kw) + "\n")
    sys.stdout.flush()


def summary(paths):
    import statistics

    rows = []
    for p in paths:
        ev = [json.loads(l[3:]) for l in open(p) if l.startswith("TE ")]
        kill = [e for e in ev if e["event"] == "kill"]
        if not kill:
            print(f"{p}: no kill")
            continue
        k = kill[0]
        again = [e for e in ev if e["attempt"] >= 1]
        start = [e["t"] for e in again if e["event"] == "start"]
        imported = [e["t"] for e in again if e["event"] == "imported"]
        group = [e["t"] for e in again if e["event"] == "group"]
        model = [e["t"] for e in again if e["event"] == "model"]
        resumed = [e for e in again if e["event"] == "resumed"]
        steps = [e["step_ms"] for e in ev if e["event"] == "step_times" and e["attempt"] == 0]
        if not resumed:
            print(f"{p}: no resume")
            continue
        rows.append({
            "file": os.path.basename(p),
            "first_new_start_s": min(start) - k["t"],
            "last_imported_s": max(imported) - k["t"],
            "last_group_s": max(group) - k["t"],
            "last_model_s": max(model) - k["t"],
            "restart_s": max(e["t"] for e in resumed) - k["t"],
            "steps_lost": k["step"] - resumed[0]["from_step"],
            "step_ms": statistics.median(steps) if steps else None,
        })
    for r in rows:
        print(json.dumps(r))
    if rows:
        def med(name):
            v = [r[name] for r in rows]
            return f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})"
        print(f"runs {len(rows)}: new workers started {med('first_new_start_s')} s after the kill, "
              f"torch imported {med('last_imported_s')} s, group up {med('last_group_s')} s, "
              f"DDP model built {med('last_model_s')} s, "
              f"resumed {med('restart_s')} s; steps lost {[r['steps_lost'] for r in rows]}; "
              f"step {med('step_ms')} ms")


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/torchelastic_restart/ckpt.pt")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--kill-step", type=int, default=15)
    ap.add_argument("--kill-rank", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--pg-timeout", type=float, default=60)
    ap.add_argument("--port", type=int, default=29650, help="attempt k's store: port + k")
    ap.add_argument("--agent-store", action="store_true",
                    help="meet at torchrun's own store (env://) instead")
    ap.add_argument("--summary", nargs="+")
    a = ap.parse_args()
    if a.summary:
        return summary(a.summary)
    te("start", t_start=T_START)
    import signal

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_overlap import model_of

    te("imported", **{k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT",
                                                      "TORCHELASTIC_USE_AGENT_STORE")})
    torch.set_num_threads(1)
    import datetime

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if a.agent_store:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    else:
        # A TCPStore of each attempt's own, hosted by its rank 0 (see the module's doc).
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{a.port + attempt}",
            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=a.pg_timeout))
    r, n = dist.get_rank(), dist.get_world_size()
    te("group", world=n)
    torch.manual_seed(0)
    base, shape = model_of("cnn")
    model = torch.nn.parallel.DistributedDataParallel(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    te("model")
    first = 0
    if os.path.exists(a.ckpt):
        st = torch.load(a.ckpt)
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        first = st["step"]
    g = torch.Generator().manual_seed(1 + r)
    x = torch.randn(a.batch, *shape, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    te("resumed", from_step=first)
    times = []
    for step in range(first, a.steps):
        if attempt == 0 and r == a.kill_rank and step == a.kill_step:
            te("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t))
        done = step + 1
        if done % a.ckpt_every == 0 and r == 0:
            tmp = a.ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "step": done}, tmp)
            os.replace(tmp, a.ckpt)
            te("saved", step=done)
        if attempt == 0 and step == a.kill_step - 1:
            te("step_times", step_ms=sorted(times)[len(times) // 2])
    te("end", steps=a.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

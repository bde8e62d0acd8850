#!/usr/bin/env python3
"""PyTorch's fused optimizer steps on a GPU, to compare with our GPU updaters (not run on the CPU box).

    python3 benches/torch_updaters.py [--sizes 4K,64K,1M,16M,64M,256M] [--dtypes float32,float16,bfloat16]

For each size S (bytes of one parameter tensor) and dtype it times one optimizer step on a single
parameter whose .grad is set: SGD (foreach and fused), SGD with momentum 0.9 (foreach, fused) and
Adam (foreach, fused), with CUDA events, median of reps after warm-up. It also times a plain
device-to-device copy (`dst.copy_(src)`) of S bytes: the roof the issue's target refers to
(updaters >= 90% of D2D copy bandwidth).

Bandwidth: algbw = S / t; moved = fewest bytes read + written per step:
  sgd       read w, g; write w                           = 3 S
  sgd_mom   read w, g, m; write w, m                     = 5 S  (m in the param dtype in torch)
  adam      read w, g, m, v; write w, m, v               = 7 S
  copy      read src; write dst                          = 2 S
Prints a markdown table and writes JSON (--json).
"""

import argparse
import json
import statistics
import sys

KIB, MIB = 1 << 10, 1 << 20


def parse_size(s):
    mul = {"K": KIB, "M": MIB, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mul != 1 else s) * mul


def size_name(b):
    return f"{b // MIB}M" if b >= MIB else f"{b // KIB}K"


def time_cuda(torch, f, reps, warmup):
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default="target/torch_updaters.json")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("torch_updaters.py needs a CUDA GPU")
    dev = torch.device("cuda:0")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", file=sys.stderr)

    optims = [
        ("sgd", 3, lambda p, kw: torch.optim.SGD([p], lr=0.01, **kw)),
        ("sgd_mom", 5, lambda p, kw: torch.optim.SGD([p], lr=0.01, momentum=0.9, **kw)),
        ("adam", 7, lambda p, kw: torch.optim.Adam([p], lr=0.001, **kw)),
    ]
    rows = []
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        for size in map(parse_size, args.sizes.split(",")):
            n = size // torch.tensor([], dtype=dtype).element_size()
            src = torch.randn(n, device=dev).to(dtype)
            dst = torch.empty_like(src)
            t = time_cuda(torch, lambda: dst.copy_(src), args.reps, args.warmup)
            rows.append(dict(dtype=dname, bytes=size, what="d2d_copy", s=t, moved=2 * size))
            for name, words, make in optims:
                for mode in ("foreach", "fused"):
                    p = torch.nn.Parameter(torch.randn(n, device=dev).to(dtype))
                    p.grad = torch.randn(n, device=dev).to(dtype)
                    try:
                        opt = make(p, {mode: True})
                    except (RuntimeError, ValueError) as e:
                        print(f"skip {name} {mode} {dname}: {e}", file=sys.stderr)
                        continue
                    t = time_cuda(torch, opt.step, args.reps, args.warmup)
                    rows.append(
                        dict(dtype=dname, bytes=size, what=f"{name}/{mode}", s=t, moved=words * size)
                    )
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    copy = {(r["dtype"], r["bytes"]): r for r in rows if r["what"] == "d2d_copy"}
    print("| dtype | size | step | µs | algbw GB/s | moved GB/s | moved % of D2D copy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        c = copy[(r["dtype"], r["bytes"])]
        pct = 100 * (r["moved"] / r["s"]) / (c["moved"] / c["s"])
        print(
            f"| {r['dtype']} | {size_name(r['bytes'])} | {r['what']} | {r['s'] * 1e6:.1f} "
            f"| {r['bytes'] / r['s'] / 1e9:.1f} | {r['moved'] / r['s'] / 1e9:.1f} | {pct:.0f}% |"
        )


if __name__ == "__main__":
    main()

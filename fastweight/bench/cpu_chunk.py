"""CPU benchmark of the PyTorch chunkwise gated delta rule (issue 3).

    python -m fastweight.bench.cpu_chunk [--T 4096] [--H 4] [--D 64] [--memory 4096,16384,65536]

fp32, B = 1, K = V = D. Times (median of a few runs, ms) side by side in one process:
our ``chunk_gated_delta_rule`` (``fastweight.chunk``), fla's ``naive_chunk_gated_delta_rule``
(if ``flash-linear-attention`` / ``fla-core`` is installed: the ``bench`` extra), the per-step
recurrence (``fastweight.reference``), forward and forward+backward. Then the peak memory of
one forward+backward at each ``--memory`` length, each in a fresh subprocess (peak RSS minus
the RSS after the inputs were made).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from fastweight.chunk import chunk_gated_delta_rule
from fastweight.mechanisms import get
from fastweight.testing import generator


def make_inputs(T: int, H: int, D: int, requires_grad: bool = False, seed: int = 0) -> dict:
    x = get("gated_deltanet").sample(1, T, H, D, D, dtype=torch.float32, device="cpu", generator=generator(seed))
    return {n: t.requires_grad_(requires_grad) for n, t in x.items()}


def ours(x: dict, backward: bool = False):
    o, _ = chunk_gated_delta_rule(**x, scale=x["q"].shape[-1] ** -0.5)
    if backward:
        o.sum().backward()
    return o


def recurrence(x: dict, backward: bool = False):
    o, _ = get("gated_deltanet").recurrent(x)
    if backward:
        o.sum().backward()
    return o


def fla_naive():
    try:
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    except ImportError:
        return None
    return lambda x: naive_chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64)


def timeit(fn, x: dict, repeat: int, backward: bool = False) -> float:
    """Median wall time in ms (one warm-up call first)."""
    times = []
    for i in range(repeat + 1):
        if backward:
            for t in x.values():
                t.grad = None
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            fn(x, backward) if backward else fn(x)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_memory_mb(T: int, H: int, D: int) -> float:
    """Peak RSS growth of one chunkwise forward+backward (run in this process: call in a subprocess)."""
    x = make_inputs(T, H, D, requires_grad=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ours(x, backward=True)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--memory", default="4096,16384,65536", help="lengths for the memory column ('' to skip)")
    p.add_argument("--peak-memory-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    if args.peak_memory_child:
        print(json.dumps(peak_memory_mb(args.peak_memory_child, args.H, args.D)))
        return

    print(f"fp32, B=1, H={args.H}, T={args.T}, K=V={args.D}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    x = make_inputs(args.T, args.H, args.D)
    rows = [("fastweight chunk_gated_delta_rule (chunk 64)", timeit(ours, x, args.repeat))]
    fla = fla_naive()
    if fla is not None:
        rows.append(("fla naive_chunk_gated_delta_rule", timeit(lambda x: fla(x), x, args.repeat)))
    rows.append(("per-step recurrence", timeit(recurrence, x, 1)))
    for name, ms in rows:
        print(f"forward   {name:48s} {ms:9.1f} ms   ({ms / rows[0][1]:.1f}x ours)")
    xg = make_inputs(args.T, args.H, args.D, requires_grad=True)
    ours_fb = timeit(ours, xg, args.repeat, backward=True)
    rec_fb = timeit(recurrence, xg, 1, backward=True)
    print(f"fwd+bwd   {'fastweight chunk_gated_delta_rule (chunk 64)':48s} {ours_fb:9.1f} ms")
    print(f"fwd+bwd   {'autograd through the per-step recurrence':48s} {rec_fb:9.1f} ms   ({rec_fb / ours_fb:.1f}x ours)")
    for T in [int(t) for t in args.memory.split(",") if t]:
        out = subprocess.run([sys.executable, "-m", "fastweight.bench.cpu_chunk", "--peak-memory-child", str(T),
                              "--H", str(args.H), "--D", str(args.D)], capture_output=True, text=True, check=True)
        mb = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"peak memory fwd+bwd T={T:6d}: {mb:8.1f} MB  ({mb / T * 1024:.1f} MB per 1k tokens)")


if __name__ == "__main__":
    main()

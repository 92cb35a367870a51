"""CPU benchmark of the PyTorch chunkwise gated delta rule (issue 3).

    python -m fastweight.bench.cpu_chunk [--T 4096] [--H 4] [--D 64] [--memory 4096,16384,65536]

fp32, B = 1, K = V = D. Times (median of a few runs: wall and process CPU time, ms) side by side in one process:
our ``chunk_gated_delta_rule`` (``fastweight.chunk``), fla's ``naive_chunk_gated_delta_rule``
(if ``flash-linear-attention`` / ``fla-core`` is installed: the ``bench`` extra), the per-step
recurrence (``fastweight.reference``), forward and forward+backward. Then the peak memory of
one forward+backward at each ``--memory`` length, each in a fresh subprocess (peak RSS during
the call minus the RSS after the inputs were made).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
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


def timeit(fn, x: dict, repeat: int, backward: bool = False, warmup: bool = True) -> tuple[float, float]:
    """(median wall time, median CPU time of the process) in ms, over ``repeat`` calls."""
    wall, cpu = [], []
    for i in range(repeat + int(warmup)):
        if backward:
            for t in x.values():
                t.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.set_grad_enabled(backward):
            fn(x, backward) if backward else fn(x)
        if i or not warmup:
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_memory_mb(T: int, H: int, D: int) -> float:
    """Peak RSS growth (MB) during one chunkwise forward+backward, sampled every 0.5 ms by a
    thread (Linux; call it in a fresh subprocess so that the allocator holds no free memory)."""
    x = make_inputs(T, H, D, requires_grad=True)
    base, peak, done = _rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(5e-4)

    watcher = threading.Thread(target=sample)
    watcher.start()
    ours(x, backward=True)
    done.set()
    watcher.join()
    return (max(peak[0], _rss_bytes()) - base) / 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--memory", default="4096,16384,65536", help="lengths for the memory column ('' to skip)")
    p.add_argument("--peak-memory-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    if args.peak_memory_child:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        print(json.dumps(peak_memory_mb(args.peak_memory_child, args.H, args.D)))
        return

    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"fp32, B=1, H={args.H}, T={args.T}, K=V={args.D}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':9} {'':48} {'wall ms':>9} {'cpu ms':>9}   wall ratio")
    x = make_inputs(args.T, args.H, args.D)
    rows = [("fastweight chunk_gated_delta_rule (chunk 64)", timeit(ours, x, args.repeat))]
    fla = fla_naive()
    if fla is not None:
        rows.append(("fla naive_chunk_gated_delta_rule", timeit(lambda x: fla(x), x, args.repeat)))
    rows.append(("per-step recurrence", timeit(recurrence, x, 1, warmup=False)))
    for name, (ms, cpu) in rows:
        print(f"forward   {name:48s} {ms:9.1f} {cpu:9.1f}   {ms / rows[0][1][0]:.2f}x ours")
    xg = make_inputs(args.T, args.H, args.D, requires_grad=True)
    rows = [("fastweight chunk_gated_delta_rule (chunk 64)", timeit(ours, xg, args.repeat, backward=True)),
            ("autograd through the per-step recurrence", timeit(recurrence, xg, 1, backward=True, warmup=False))]
    for name, (ms, cpu) in rows:
        print(f"fwd+bwd   {name:48s} {ms:9.1f} {cpu:9.1f}   {ms / rows[0][1][0]:.2f}x ours")
    for T in [int(t) for t in args.memory.split(",") if t]:
        out = subprocess.run([sys.executable, "-m", "fastweight.bench.cpu_chunk", "--peak-memory-child", str(T),
                              "--H", str(args.H), "--D", str(args.D), "--threads", str(torch.get_num_threads())],
                             capture_output=True, text=True, check=True)
        mb = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"peak memory fwd+bwd T={T:6d}: {mb:8.1f} MB  ({mb / T * 1024:.1f} MB per 1k tokens)")


if __name__ == "__main__":
    main()

"""CPU benchmark of the PyTorch chunkwise gated delta rule (issue 3).

    python -m fastweight.bench.cpu_chunk [--T 4096] [--H 4] [--D 64] [--memory 4096,16384,65536]

fp32, B = 1, K = V = D. Times (wall: median and min over ``--repeat`` calls taking turns, so that
all see the same machine load; process CPU time, median), side by side in one process:
our ``chunk_gated_delta_rule`` (``fastweight.chunk``), fla's ``naive_chunk_gated_delta_rule``
(if ``flash-linear-attention`` / ``fla-core`` is installed: the ``bench`` extra), the per-step
recurrence (``fastweight.reference``), forward and forward+backward. Then the peak memory of
one forward+backward at each ``--memory`` length, each in a fresh subprocess: the peak RSS during
the call minus the RSS after the inputs were made (sampled, so a lower bound), and the exact
size of the tensors autograd keeps for backward.
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


def time_interleaved(fns: list, x: dict, repeat: int, backward: bool = False) -> list:
    """Each (name, fn, rounds) called ``rounds`` times (``repeat`` when None), the functions taking
    turns so that all see the same machine load; one warm-up call each first (not for rounds = 1).
    Returns (name, median wall ms, min wall ms, median process CPU ms) per function."""
    times = {name: ([], []) for name, _, _ in fns}

    def call(fn):
        if backward:
            for t in x.values():
                t.grad = None
        with torch.set_grad_enabled(backward):
            fn(x, backward) if backward else fn(x)

    for name, fn, rounds in fns:
        if rounds is None:
            call(fn)
    for i in range(repeat):
        for name, fn, rounds in fns:
            if i >= (rounds or repeat):
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            call(fn)
            times[name][0].append((time.perf_counter() - t0) * 1e3)
            times[name][1].append((time.process_time() - c0) * 1e3)
    return [(name, statistics.median(w), min(w), statistics.median(c)) for name, (w, c) in times.items()]


def report(kind: str, rows: list):
    base_med, base_min = rows[0][1], rows[0][2]
    for name, med, low, cpu in rows:
        print(f"{kind:9} {name:46s} {med:9.1f} {low:9.1f} {cpu:9.1f}   {med / base_med:6.2f}x {low / base_min:6.2f}x")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_memory_mb(T: int, H: int, D: int) -> float:
    """Peak RSS growth (MB) during one chunkwise forward+backward, sampled every 0.5 ms by a
    thread (Linux; call it in a fresh subprocess so that the allocator holds no free memory)."""
    ours(make_inputs(64, H, D, requires_grad=True), backward=True)  # lazy library initialisation
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


def saved_for_backward_mb(T: int, H: int, D: int) -> float:
    """MB of distinct tensor storage that autograd keeps between forward and backward."""
    x = make_inputs(T, H, D, requires_grad=True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = ours(x)
    o.sum().backward()
    return sum(storages.values()) / 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--memory", default="4096,16384,65536", help="lengths for the memory column ('' to skip)")
    p.add_argument("--peak-memory-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    if args.peak_memory_child:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        T = args.peak_memory_child
        print(json.dumps([peak_memory_mb(T, args.H, args.D), saved_for_backward_mb(T, args.H, args.D)]))
        return

    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"fp32, B=1, H={args.H}, T={args.T}, K=V={args.D}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':9} {'':46} {'med ms':>9} {'min ms':>9} {'cpu ms':>9}   vs ours (median, min wall)")
    name = "fastweight chunk_gated_delta_rule (chunk 64)"
    x = make_inputs(args.T, args.H, args.D)
    fns = [(name, ours, None)]
    fla = fla_naive()
    if fla is not None:
        fns.append(("fla naive_chunk_gated_delta_rule", lambda x: fla(x), None))
    fns.append(("per-step recurrence", recurrence, 1))
    report("forward", time_interleaved(fns, x, args.repeat))
    xg = make_inputs(args.T, args.H, args.D, requires_grad=True)
    fns = [(name, ours, None), ("autograd through the per-step recurrence", recurrence, 1)]
    report("fwd+bwd", time_interleaved(fns, xg, args.repeat, backward=True))
    for T in [int(t) for t in args.memory.split(",") if t]:
        out = subprocess.run([sys.executable, "-m", "fastweight.bench.cpu_chunk", "--peak-memory-child", str(T),
                              "--H", str(args.H), "--D", str(args.D), "--threads", str(torch.get_num_threads())],
                             capture_output=True, text=True, check=True)
        peak, saved = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"memory fwd+bwd T={T:6d}: peak RSS growth {peak:8.1f} MB ({peak / T * 1024:5.1f} MB per 1k tokens), "
              f"saved for backward {saved:8.1f} MB ({saved / T * 1024:5.1f} MB per 1k tokens)")


if __name__ == "__main__":
    main()

"""What the default call's input checks cost: every chunk op, default call vs value checks off.

    python -m fastweight.bench.default_overhead [--shape B,T,H,K] [--ops gla,kda,...] [--rounds 2]
        [--limit 1.03] [--device cuda] [--out DIR]

For each op (all 13 unless ``--ops``), ``fastweight.ops.chunk_<op>`` with ``backend=None`` in bf16
at (4, 8192, 16, 128) unless ``--shape``: forward and forward+backward, ms, median of
``triton.testing.do_bench``, in three value-check modes (``fastweight.checks``): the default
(``auto``), off, and forced on (for the record). The modes are measured interleaved,
``--rounds`` times, and each keeps its fastest median, so that a slow moment of the machine
does not land on one mode only. Inputs are the published benchmarks' (``gpu_delta.inputs``
for the delta family, ``gpu_decay_dplr.inputs`` for the decay family and the RWKV-7-like DPLR
inputs). Prints a markdown table; exits with status 1 if a default/off ratio exceeds ``--limit``.

``--device cpu --shape 1,128,2,32`` is a smoke run in seconds (wall-clock medians; the CPU's
default runs the value checks, so its ratio is their cost there, not the CUDA figure).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

from fastweight import checks, ops
from fastweight.mechanisms import OPS
from fastweight.bench import gpu_decay_dplr, gpu_delta

MODES = {"default": "auto", "off": False, "on": True}


def inputs(op, B, T, H, K, device) -> tuple[dict, dict]:
    """(tensors, options) of ``ops.chunk_<op>``: bf16 inputs as the op's GPU benchmark draws them
    (DeltaNet's beta in [0, 2], hence allow_neg_eigval for the delta family)."""
    if op in gpu_delta.MECHANISM:
        options = {**(dict(allow_neg_eigval=True) if OPS[op].neg_eigval else {}), **OPS[op].defaults}
        return gpu_delta.inputs(op, B, T, H, K, K, torch.bfloat16, device), options
    return gpu_decay_dplr.inputs(op, B, T, H, K, torch.bfloat16, device=device), {}


def timer(device, grad_to_none=None):
    """fn -> ms: the median of ``do_bench`` on CUDA; elsewhere the wall clock of one call after one."""
    if device.type == "cuda":
        import triton
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                                  return_mode="median")

    def wall(fn, reps=1):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    return wall


def measure(op, shape, device, rounds):
    """{mode: (fwd ms, fwd+bwd ms)} for every mode of MODES, interleaved, fastest of ``rounds``."""
    x, options = inputs(op, *shape, device)
    fn = functools.partial(getattr(ops, f"chunk_{op}"), **options)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    do = torch.randn_like(fn(**x)[0])

    def fwd():
        fn(**x)

    def fwd_bwd():
        fn(**leaves)[0].backward(do)

    time_fwd, time_fwd_bwd = timer(device), timer(device, grad_to_none=list(leaves.values()))
    best = {m: [float("inf"), float("inf")] for m in MODES}
    for _ in range(rounds):
        for name, mode in MODES.items():
            with checks.value_checks(mode):
                best[name][0] = min(best[name][0], time_fwd(fwd))
                best[name][1] = min(best[name][1], time_fwd_bwd(fwd_bwd))
    return {m: tuple(t) for m, t in best.items()}


def table(results: dict) -> str:
    lines = ["| op | default fwd | off fwd | ratio | default fwd+bwd | off fwd+bwd | ratio | on fwd | on fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|"]
    for op, r in results.items():
        (d_f, d_fb), (o_f, o_fb), (n_f, n_fb) = r["default"], r["off"], r["on"]
        lines.append(f"| {op} | {d_f:.3f} | {o_f:.3f} | {d_f / o_f:.3f} | {d_fb:.3f} | {o_fb:.3f} | "
                     f"{d_fb / o_fb:.3f} | {n_f:.3f} | {n_fb:.3f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fastweight.bench.default_overhead",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,8192,16,128", help="B,T,H,K (V = K); default %(default)s")
    ap.add_argument("--ops", default=",".join(ops.OPS), help="comma-separated op names; default all 13")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved measurements per mode (fastest kept)")
    ap.add_argument("--limit", type=float, default=1.03, help="largest default/off ratio that passes")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default="", help="directory for default_overhead.json (optional)")
    args = ap.parse_args(argv)
    try:
        args.shape = tuple(int(n) for n in args.shape.split(","))
    except ValueError:
        args.shape = ()
    if len(args.shape) != 4 or min(args.shape) < 1:
        ap.error(f"--shape must be four positive integers B,T,H,K, got {args.shape!r}")
    args.ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in args.ops if o not in ops.OPS]
    if unknown or not args.ops:
        ap.error(f"--ops: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(ops.OPS)}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for a smoke run)")
    results = {}
    for op in args.ops:
        results[op] = measure(op, args.shape, device, args.rounds)
        print(f"{op}: " + ", ".join(f"{m} {f:.3f}/{fb:.3f} ms" for m, (f, fb) in results[op].items()), flush=True)
    ratios = {op: max(r["default"][i] / r["off"][i] for i in (0, 1)) for op, r in results.items()}
    over = [op for op, q in ratios.items() if q > args.limit]
    what = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{what}, bf16, (B, T, H, K) = {args.shape}, ms, fastest of {args.rounds} interleaved medians\n")
    print(table(results))
    print(f"\nworst default/off ratio {max(ratios.values()):.3f} (limit {args.limit:g})"
          + (f": over it: {', '.join(over)}" if over else ": all within"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "default_overhead.json"), "w") as f:
            json.dump(dict(device=what, torch=torch.__version__, shape=args.shape, rounds=args.rounds,
                           limit=args.limit, ms={op: r for op, r in results.items()}), f, indent=1)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

"""Time ops in the tree it runs from: forward, forward+backward, peak memory, and per-kernel time.

    python -m fastweight.bench.ops_time --cases rwkv7:8,16384,64,64 [--dtype bf16] [--rep 300] [--label main]
    python -m fastweight.bench.ops_time --cases kda:4,8192,16,128 --profile fb
    DPLR_LAUNCH="solve_wy=False" python -m fastweight.bench.ops_time --cases rwkv7:4,8192,16,128

The A/B tool of the GPU records (``docs/bench/runs-*.md``): run it once per tree (``git archive <rev>
fastweight | tar -x -C DIR``), from the tree's folder (``cd DIR && python -m ...``: ``python -m`` puts the
current folder ahead of ``PYTHONPATH``, so a tree on ``PYTHONPATH`` run from the repository's root
would time the root's code; ``main`` refuses that case by name), in separate processes, and alternate the
trees (A B A B) so that the machine's drift falls on both. Per case (op:B,T,H,K with
V = K, inputs as the family's benchmark draws them: ``gpu_delta.inputs``, ``gpu_decay_dplr.inputs``):

- forward without autograd and forward+backward (a fixed random cotangent; the inputs' grads set to
  None between runs; ``--forward-only``: the forward alone), ``--samples`` medians each of
  ``triton.testing.do_bench`` (``--rep`` ms);
- the peak of ``torch.cuda.max_memory_allocated`` over forward+backward, the inputs, their copies
  that take grads and the cotangent included (GiB);
- ``--profile fwd|fb|fbng``: instead, CUDA ms per kernel of one call under ``torch.profiler`` after
  two warm calls (fbng: the gate without a gradient). The grads are reset before the profiled call,
  so no accumulation kernel counts.

The op is ``gpu_decay_dplr.fast_op``'s (the path users get; ``DPLR_LAUNCH`` picks a ``DplrLaunch``
for the DPLR ops) or ``gpu_delta.run``'s. Prints one line per case. ``--warm``: every case at
B = 1, T = 512 (the kernels compile for the same constexprs), for warm-up processes run in parallel
before the timed ones. On a machine without CUDA it times wall clock (the interpreter; tests only).
"""

from __future__ import annotations

import argparse
import os

import torch

from fastweight.bench.side_by_side import time_ms

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GATES = ("g", "gk", "w")


def parse_case(case: str):
    """"op:B,T,H,K" -> (op, (B, T, H, K))."""
    try:
        op, shape = case.split(":")
        B, T, H, K = (int(n) for n in shape.split(","))
    except ValueError:
        raise ValueError(f"--cases: each case is op:B,T,H,K, got {case!r}") from None
    return op, (B, T, H, K)


def op_and_inputs(op: str, B: int, T: int, H: int, K: int, dtype: torch.dtype, device):
    """(fn, inputs by name): the op as the family's benchmark runs it, its inputs seeded."""
    from fastweight.bench import gpu_decay_dplr, gpu_delta
    from fastweight.mechanisms import OPS
    if op not in OPS:
        raise ValueError(f"--cases: unknown op {op!r}; one of {sorted(OPS)}")
    torch.manual_seed(0)
    if op in gpu_delta.MECHANISM:
        x = gpu_delta.inputs(op, B, T, H, K, K, dtype, device)
        return (lambda **a: gpu_delta.run(op, a, scale=K ** -0.5)), x
    x = gpu_decay_dplr.inputs(op, B, T, H, K, dtype, device=device)
    return gpu_decay_dplr.fast_op(op, K), x


def time_case(op: str, shape, dtype: torch.dtype, rep: int, samples: int, device, backward: bool = True) -> dict:
    """{"fwd": [ms per sample], "fb": [...] (empty without ``backward``), "peak_gib": float or None}."""
    fn, x = op_and_inputs(op, *shape, dtype, device)
    fwd = []
    for _ in range(samples):
        with torch.no_grad():
            fwd.append(time_ms(lambda: fn(**x), torch.device(device), rep))
    if not backward:
        return {"fwd": fwd, "fb": [], "peak_gib": None}
    xg = {n: t.clone().requires_grad_(t.is_floating_point()) for n, t in x.items()}
    do = torch.randn_like(fn(**xg)[0])
    leaves = [t for t in xg.values() if t.requires_grad]

    def step():
        fn(**xg)[0].backward(do)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    fb = [time_ms(step, torch.device(device), rep, leaves) for _ in range(samples)]
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None
    return {"fwd": fwd, "fb": fb, "peak_gib": peak}


def profile_case(op: str, shape, dtype: torch.dtype, mode: str, device) -> dict[str, float]:
    """CUDA ms per kernel name of one call (``mode`` fwd, fb or fbng), largest first."""
    if mode not in ("fwd", "fb", "fbng"):
        raise ValueError(f"--profile: fwd, fb or fbng, got {mode!r}")
    fn, x = op_and_inputs(op, *shape, dtype, device)
    if mode != "fwd":
        x = {n: t.clone().requires_grad_(t.is_floating_point() and not (mode == "fbng" and n in GATES))
             for n, t in x.items()}
    leaves = [t for t in x.values() if t.requires_grad]

    def run():
        for t in leaves:
            t.grad = None
        if mode == "fwd":
            with torch.no_grad():
                fn(**x)
        else:
            o = fn(**x)[0]
            o.backward(torch.ones_like(o))
    run()
    run()
    torch.cuda.synchronize()
    return kernel_ms(run)


def kernel_ms(run) -> dict[str, float]:
    """CUDA ms per kernel name of one ``run()`` under ``torch.profiler``, largest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            per[e.key] = per.get(e.key, 0.0) + t / 1000.0
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def check_tree():
    """Refuse a run whose ``fastweight`` is not the tree that ``PYTHONPATH`` names first (module docstring)."""
    import fastweight
    first = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastweight.__file__)))
    if first and os.path.isdir(os.path.join(first, "fastweight")) and os.path.abspath(first) != root:
        raise SystemExit(f"ops_time: fastweight comes from {root}, not from PYTHONPATH's {first} (python -m puts "
                         f"the current folder first): run it from {first}")


def main(argv=None):
    check_tree()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", required=True, help="op:B,T,H,K[;op:B,T,H,K...]")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--rep", type=int, default=150, help="do_bench's rep (ms) per sample")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--label", default="")
    ap.add_argument("--warm", action="store_true", help="every case at B = 1, T = 512, one short sample")
    ap.add_argument("--profile", default="", help="fwd, fb or fbng: per-kernel CUDA ms instead of timings")
    ap.add_argument("--forward-only", action="store_true", help="time the forward without autograd alone")
    args = ap.parse_args(argv)
    cases = [parse_case(c) for c in args.cases.split(";") if c]
    dtype = DTYPES[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.profile and device != "cuda":
        raise SystemExit("--profile needs a GPU (CUDA kernel times)")
    for op, shape in cases:
        if args.warm:
            shape = (1, 512, *shape[2:])
        name = f"{args.label} {op} {','.join(map(str, shape))} {args.dtype}".strip()
        if args.profile:
            per = profile_case(op, shape, dtype, args.profile, device)
            print(f"{name} {args.profile} total {sum(per.values()):.3f} ms | "
                  + ", ".join(f"{n[:40]} {t:.3f}" for n, t in list(per.items())[:12]), flush=True)
        else:
            r = time_case(op, shape, dtype, 30 if args.warm else args.rep, 1 if args.warm else args.samples, device,
                          backward=not args.forward_only)
            peak = f" peak {r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else ""
            fb = f" fb {' '.join(f'{t:.4f}' for t in r['fb'])}" if r["fb"] else ""
            print(f"{name} fwd {' '.join(f'{t:.4f}' for t in r['fwd'])}{fb}{peak}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

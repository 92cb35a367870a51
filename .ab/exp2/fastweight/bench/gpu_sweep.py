"""Launch-configuration sweep of every Triton kernel one chunked op runs (on the GPU):

    python -m fastweight.bench.gpu_sweep OP SHAPE [--warps 4,8] [--stages 1,2,3] [--budget S] [--out DIR]

OP is a ``fastweight.ops.chunk_<OP>`` name, SHAPE one of ``gpu_decay_dplr.SHAPES`` (bf16). The
kernels the op's forward+backward launches are found by recording them; then, one kernel at a
time, each (num_warps, num_stages) pair replaces the launcher's own choice and the whole
forward+backward is timed (``triton.testing.do_bench``, median). A configuration that fails to
compile, or whose output or gradients move from the default run's by more than 1e-2 relative, is
marked and never chosen. Prints, per kernel, the default time and the best configuration with
the time it saves; writes DIR/sweep_OP_SHAPE.json. The defaults in the launchers are set from
these tables (docs/bench), never from this script at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

import fastweight.kernels  # noqa: F401  (registers every kernel module)
from fastweight import ops
from fastweight.mechanisms import OPS
from fastweight.bench.gpu_decay_dplr import SHAPES, inputs as decay_inputs

DELTA = tuple(name for name, op in OPS.items() if op.family == "delta")


DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: the interpreter smoke test (tests/bench)
LOW = torch.bfloat16 if DEV == "cuda" else torch.float32


def make_inputs(op, B, T, H, K):
    if op in DELTA:
        from fastweight.bench.gpu_delta import inputs
        return inputs(op, B, T, H, K, K, LOW, DEV)
    return decay_inputs(op, B, T, H, K, LOW, device=DEV)


import triton.runtime.interpreter  # noqa: E402  (not imported by triton unless TRITON_INTERPRET is set)
KERNEL_TYPES = (triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction)


def kernels_of():
    """Every @triton.jit kernel (a name ending in _kernel) of the fastweight.kernels modules."""
    import sys
    out = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fastweight.kernels."):
            continue
        for attr, obj in vars(mod).items():
            if attr.endswith("_kernel") and isinstance(obj, KERNEL_TYPES):
                out[f"{name.split('.')[-1]}.{attr}"] = obj
    return out


def override(kern, cfg):
    """Make ``kern`` launch with ``cfg`` (num_warps / num_stages) until ``restore``."""
    orig = type(kern).run

    def run(*a, **kw):
        kw.update(cfg)
        return orig(kern, *a, **kw)
    kern.run = run


def restore(kern):
    kern.__dict__.pop("run", None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("shape", choices=sorted(SHAPES) + ["tiny"])
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--budget", type=float, default=240)
    ap.add_argument("--kernels", default="", help="only these kernels (comma-separated names as printed)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t_start = time.time()
    B, T, H, K = SHAPES.get(args.shape, (1, 100, 2, 32))
    x = {n: (t.clone().requires_grad_() if t.is_floating_point() else t)
         for n, t in make_inputs(args.op, B, T, H, K).items()}
    fn = getattr(ops, f"chunk_{args.op}")
    do = None

    def step():
        nonlocal do
        o, _ = fn(**x, backend="triton")
        if do is None:
            do = torch.randn_like(o)
        o.backward(do)
        return o

    def result():
        for t in x.values():
            t.grad = None
        o = step()
        return [o.detach().float().clone()] + [t.grad.float().clone() for t in x.values() if t.grad is not None]

    grads = [t for t in x.values() if t.requires_grad]
    def bench():
        if DEV == "cpu":
            t0 = time.perf_counter()
            step()
            return (time.perf_counter() - t0) * 1e3
        return triton.testing.do_bench(step, warmup=10, rep=100, grad_to_none=grads, return_mode="median")
    # which kernels run, with their default launch options
    kerns, seen = kernels_of(), {}
    for name, kern in kerns.items():
        orig = type(kern).run

        def rec(*a, _n=name, _k=kern, _o=orig, **kw):
            seen.setdefault(_n, (kw.get("num_warps"), kw.get("num_stages")))
            return _o(_k, *a, **kw)
        kern.run = rec
    ref = result()
    for kern in kerns.values():
        restore(kern)
    base = bench()
    print(f"{args.op} {args.shape} {(B, T, H, K)}: fwd+bwd {base:.3f} ms; kernels: {sorted(seen)}", flush=True)
    rows = []
    warps = [int(w) for w in args.warps.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    for name in sorted(seen):
        if args.kernels and name not in args.kernels.split(","):
            continue
        if time.time() - t_start > args.budget:
            print(f"budget reached, skipping {name} and after", flush=True)
            break
        kern, trials = kerns[name], []
        for w in warps:
            for s in stages:
                override(kern, dict(num_warps=w, num_stages=s))
                try:
                    got = result()
                    err = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, ref))
                    ms = bench() if err < 1e-2 else float("nan")
                    trials.append(dict(warps=w, stages=s, ms=ms, err=err))
                except Exception as exc:  # noqa: BLE001
                    trials.append(dict(warps=w, stages=s, ms=float("nan"), err=None, error=type(exc).__name__))
                    if "illegal" in str(exc).lower():
                        raise
                finally:
                    restore(kern)
        ok = [t for t in trials if t["ms"] == t["ms"]]
        best = min(ok, key=lambda t: t["ms"]) if ok else None
        row = dict(kernel=name, default=seen[name], trials=trials, best=best)
        rows.append(row)
        desc = " ".join(f"{t['warps']}w{t['stages']}s:{t['ms']:.3f}" if t["ms"] == t["ms"]
                        else f"{t['warps']}w{t['stages']}s:{t.get('error') or 'WRONG'}" for t in trials)
        gain = f"best {best['warps']}w{best['stages']}s saves {base - best['ms']:.3f} ms" if best else "none ok"
        print(f"  {name} (default {seen[name]}): {gain} | {desc}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"sweep_{args.op}_{args.shape}.json"), "w") as f:
        json.dump(dict(op=args.op, shape=args.shape, base_ms=base, rows=rows,
                       device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__, triton=triton.__version__),
                  f, indent=1)


if __name__ == "__main__":
    main()

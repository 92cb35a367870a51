"""fastweight against fla 0.6.0 in one process, per op and shape: correctness first, then speed and memory.

    python -m fastweight.bench.side_by_side [--ops gated_delta_rule,kda,...] [--shapes gdn1.3b,rwkv7paper,short]
        [--rep MS] [--out DIR] [--device cuda] [--resume DIR/side_by_side.json]

For each op, first one forward+backward of each implementation at every timed shape (``tune``: fla
autotunes on its first call, keyed on H and K, so that call has to be at the shape that is timed), then a
check: both implementations (``fastweight.ops.chunk_<op>``, ``backend="triton"``,
and fla's ``chunk_<op>``) on the same inputs in the timing dtype, each against the float64 reference
(``backend="reference"``, the per-token definition) on those rounded inputs: the output and the gradient
of every floating input, relative error (``testing.rel_err``), at (1, 300, H, K) with H and K the op's
first shape's (a partial last chunk). Then, per shape: forward (no autograd graph) and forward+backward, median ms
(``triton.testing.do_bench`` on the GPU, the median of ``--rep`` runs' wall time on the CPU), and the
peak memory of forward+backward on top of the inputs and the cotangent (GPU only). Both get the same
tensors by argument name (fastweight's ops take fla's signatures). Inputs: the delta family as
``gpu_delta.inputs``, the others as ``gpu_decay_dplr.inputs`` (gates fp32, log-space).

fla is imported from ``fla.ops.<family>`` when it is installed (on a GPU machine without internet, from
the wheels of ``pip download --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0``); otherwise its
columns are "-". fla autotunes each kernel on its first call (100-250 s an op and shape on the H200):
``TRITON_CACHE_AUTOTUNING=1`` with a ``TRITON_CACHE_DIR`` kept between runs saves it (its
``*.autotune.json`` files hold the choices; fla then compiles only those). ``--resume`` keeps an
earlier run's rows and runs the rest, for runs longer than one time limit. fla 0.6.0
refuses its gated backward on Hopper with Triton 3.4-3.7 (fla issue 640); ``--fla-hopper-guard off``
(the default) lifts that guard, and the check above then reports whether its gradients are right.

Prints the table last (ratio: ours / fla, below 1 is faster); writes every row to DIR/side_by_side.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time

import torch

from fastweight import ops
from fastweight.mechanisms import OPS
from fastweight.testing import rel_err

SHAPES = {"gdn1.3b": (4, 8192, 16, 128), "rwkv7paper": (8, 16384, 64, 64), "short": (8, 2048, 16, 64),
          "tiny": (1, 128, 2, 32)}
# the package of fla 0.6.0 that exports chunk_<op>
FLA = {"gated_delta_rule": "fla.ops.gated_delta_rule", "kda": "fla.ops.kda", "delta_rule": "fla.ops.delta_rule",
       "comba": "fla.ops.comba", "simple_gla": "fla.ops.simple_gla", "gla": "fla.ops.gla", "rwkv6": "fla.ops.rwkv6",
       "linear_attn": "fla.ops.linear_attn", "retention": "fla.ops.retention", "rwkv7": "fla.ops.rwkv7",
       "dplr_delta_rule": "fla.ops.generalized_delta_rule"}


def inputs(op: str, B: int, T: int, H: int, K: int, dtype: torch.dtype, device) -> dict:
    """The op's tensors by argument name, seeded, in ``dtype`` (gates fp32)."""
    torch.manual_seed(0)
    if OPS[op].family == "delta":
        from fastweight.bench.gpu_delta import inputs as delta_inputs
        return delta_inputs(op, B, T, H, K, K, dtype, device)
    from fastweight.bench.gpu_decay_dplr import inputs as other_inputs
    return other_inputs(op, B, T, H, K, dtype, device=device)


def fla_op(op: str, hopper_guard: bool = False):
    """fla's chunk_<op>, or None when fla (or that op) is not installed."""
    try:
        fn = getattr(importlib.import_module(FLA[op]), f"chunk_{op}")
    except (ImportError, KeyError, AttributeError):
        return None
    if not hopper_guard:
        try:
            importlib.import_module("fla.ops.common.chunk_o").IS_NVIDIA_HOPPER = False
        except (ImportError, AttributeError):
            pass
    return fn


def ours(op: str):
    return lambda **x: getattr(ops, f"chunk_{op}")(**x, backend="triton")


def tune(fn, op: str, dims, dtype, device) -> str:
    """One forward+backward at a timed shape before anything else runs: fla autotunes each kernel on its first
    call and keys its choices on H, K (not on B, T), so the first call must be at the timed shape (a first call
    at the check's (1, 300) chose fla's configurations for 300 tokens). Returns "" or fn's error."""
    x = inputs(op, *dims, dtype, device)
    leaves = {n: t.detach().requires_grad_(t.is_floating_point()) for n, t in x.items()}
    try:
        fn(**leaves)[0].float().sum().backward()
    except Exception as e:  # noqa: BLE001  (reported as the check's error)
        return repr(e)[:300]
    return ""


def check(fn, op: str, x: dict) -> dict:
    """{field: relative error against float64} for o and every floating input's gradient."""
    mine = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in x.items()}
    ref = {n: t.detach().double().requires_grad_(t.is_floating_point()) for n, t in x.items()}
    o = fn(**mine)[0]
    o_ref = getattr(ops, f"chunk_{op}")(**ref, backend="reference")[0]
    do = torch.randn(o_ref.shape, dtype=torch.float64, device=o_ref.device,
                     generator=torch.Generator(o_ref.device).manual_seed(1))
    (o_ref * do).sum().backward()
    (o.float() * do.float()).sum().backward()
    errs = {"o": rel_err(o, o_ref)}
    errs.update({f"d{n}": rel_err(mine[n].grad, ref[n].grad) for n in ref if ref[n].grad is not None})
    return errs


def time_ms(fn, device, rep_ms: float, grads=()) -> float:
    """Median ms of fn: ``triton.testing.do_bench`` on the GPU (``grads`` set to None between runs), wall clock
    after one warm call elsewhere."""
    if device.type == "cuda":
        import triton
        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, grad_to_none=list(grads), return_mode="median")
    fn()
    runs = []
    for _ in range(max(3, int(rep_ms // 100))):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def measure(fn, x: dict, device, rep_ms: float) -> dict:
    """fwd ms (no graph), fwd+bwd ms, and the peak GiB of fwd+bwd on top of the inputs and do (GPU)."""
    with torch.no_grad():
        fwd = time_ms(lambda: fn(**x), device, rep_ms)
    leaves = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in x.items()}
    grads = [t for t in leaves.values() if t.requires_grad]
    do = torch.randn_like(fn(**leaves)[0])

    def step():
        fn(**leaves)[0].backward(do)
    peak = None
    if device.type == "cuda":
        from fastweight.bench.gpu_delta import peak_gib
        step()
        for t in grads:
            t.grad = None
        peak = peak_gib(step)
    fb = time_ms(step, device, rep_ms, grads)
    return dict(fwd=fwd, fb=fb, peak=peak)


def _finished(path: str, dtype: str, device: str) -> list:
    """The rows of an earlier ``side_by_side.json`` in this dtype and on this kind of device (a row is
    written once both implementations' timings, or their errors, are in)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    return [r for r in rows if r["dtype"] == dtype and r["device"].split(":")[0] == device.split(":")[0]]


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="gated_delta_rule,kda,delta_rule,simple_gla,gla,rwkv7")
    ap.add_argument("--shapes", default="gdn1.3b,rwkv7paper", help=f"of {sorted(SHAPES)}")
    ap.add_argument("--rep", type=float, default=200, help="ms of repetitions a timing (do_bench's rep)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fla-hopper-guard", default="off", choices=("on", "off"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--resume", default="", help="an earlier run's side_by_side.json: its rows with both timings "
                    "are kept and not run again (a run cut short by a time limit goes on in the next)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {s!r}; one of {sorted(SHAPES)}")
    rows = _finished(args.resume, args.dtype, str(device)) if args.resume else []
    done = {(r["op"], r["shape"]) for r in rows}
    for op in [o for o in args.ops.split(",") if o]:
        if op not in OPS:
            raise SystemExit(f"--ops: unknown op {op!r}; one of {sorted(OPS)}")
        todo = [s for s in shapes if (op, s) not in done]
        if not todo:
            print(f"skip  {op:18s} {','.join(shapes)}: in {args.resume}", flush=True)
            continue
        impls = {"fastweight": ours(op), "fla": fla_op(op, hopper_guard=args.fla_hopper_guard == "on")}
        tuned = {name: [tune(fn, op, SHAPES[s], dtype, device) for s in todo] for name, fn in impls.items()
                 if fn is not None}
        _, _, H, K = SHAPES[shapes[0]] if shapes else (1, 300, 2, 64)
        small = inputs(op, 1, 300, H, K, dtype, device)
        checks = {}
        for name, fn in impls.items():
            if fn is None:
                continue
            try:
                checks[name] = check(fn, op, small)
            except Exception as e:  # noqa: BLE001  (fla's refusals and failures are reported, not fatal)
                checks[name] = {"error": repr(e)[:300]}
            failed = [t for t in tuned[name] if t]
            if failed and "error" not in checks[name]:
                checks[name] = {"error": failed[0]}
            print(f"check {op:18s} {name:10s} {json.dumps(checks[name])}", flush=True)
        for shape in todo:
            B, T, H, K = SHAPES[shape]
            x = inputs(op, B, T, H, K, dtype, device)
            row = dict(op=op, shape=shape, dims=(B, T, H, K), dtype=args.dtype, device=str(device), checks=checks)
            for name, fn in impls.items():
                if fn is None or "error" in checks.get(name, {}):
                    row[name] = None
                    continue
                try:
                    row[name] = measure(fn, x, device, args.rep)
                except Exception as e:  # noqa: BLE001
                    row[name] = {"error": repr(e)[:300]}
                print(f"time  {op:18s} {shape:10s} {name:10s} {json.dumps(row[name])}", flush=True)
            rows.append(row)
            with open(os.path.join(args.out, "side_by_side.json"), "w") as f:
                json.dump(dict(rows=rows, torch=torch.__version__, argv=vars(args)), f, indent=1)
    print("\n| op | shape | fastweight fwd / fwd+bwd ms | fla | ratio fwd / fwd+bwd | peak GiB ours / fla "
          "| worst error ours / fla |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["fastweight"] or {}, r["fla"] or {}
        ok = lambda d: isinstance(d, dict) and "fwd" in d  # noqa: E731
        ratio = (f"{a['fwd'] / b['fwd']:.2f}x / {a['fb'] / b['fb']:.2f}x" if ok(a) and ok(b) else "-")
        worst = [max(c.values()) if c and "error" not in c else None for c in
                 (r["checks"].get("fastweight"), r["checks"].get("fla"))]
        print(f"| {r['op']} | {r['shape']} {r['dims']} | {_fmt(a.get('fwd'))} / {_fmt(a.get('fb'))} | "
              f"{_fmt(b.get('fwd'))} / {_fmt(b.get('fb'))} | {ratio} | {_fmt(a.get('peak'), '.2f')} / "
              f"{_fmt(b.get('peak'), '.2f')} | {_fmt(worst[0], '.1e')} / {_fmt(worst[1], '.1e')} |")
    return rows


if __name__ == "__main__":
    main()

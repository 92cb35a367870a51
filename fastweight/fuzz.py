"""Property fuzz: every public op, mode and backend against the float64 truth, on seeded random cases.

A case (:class:`Case`) is drawn from a seed within a :class:`Space` of shapes: the sequence
length (partial last chunks of 64), batch or packed ``cu_seqlens`` (int32/int64, empty and
1-token sequences included), query and value heads (grouped value heads where the op allows
them), head sizes, initial state and final state or not, gate strength (log gates down to -6,
strong in the last partial chunk too), beta's range, the in-kernel options (q/k L2 norm,
Mamba-2's gate formed in the kernel, simple GLA's g and/or g_gamma, linear attention's
normaliser) and the cotangents of ``o`` and of the final state: dense, expanded (stride 0, as
``S.sum()`` gives), transposed (``.mT`` of a contiguous tensor), sliced, permuted (dims 0 and 1,
or 1 and 2: a head-first buffer), or none (a
loss on the state alone, or on ``o`` alone). :func:`check` runs it and compares the output,
the final state and the gradient of every floating input (``initial_state`` included) with
the truth. The same seed draws the same case on any device (everything is drawn on the CPU).

Inputs are drawn in float64 and rounded to the case's dtype; the truth runs on the rounded
values upcast to float64, so only the computation error is measured. The truth is the
per-token definition (``backend="reference"``) up to ``Space.reference_tokens`` tokens, the
PyTorch chunk path in float64 above (itself held to the reference to ~1e-12 by tests/chunk).

Tolerance (:func:`tolerance`), per field, as ``||x - ref|| <= rtol ||ref|| + atol sqrt(numel)``:

- float64: rtol 1e-10. With ``backend="triton"`` float64 is served exactly or refused with a
  ValueError that names float64 before any kernel runs; anything else fails.
- float32: a fixed rtol for every field (:data:`FP32_RTOL`, set from the errors of the PyTorch
  chunk path in float32 over the fuzz's cases).
- float16 / bfloat16 (flash-attention's rule): rtol = 3 x floor (10 x for the delta family's chunk
  kernels, whose WY stages round to 16 bits: :data:`WY_FLOOR_FACTOR`), the floor being the larger of
  the error of the PyTorch chunk path run in that dtype on the same case and the error of the
  truth rounded to the dtype (the dtype's resolution, which stands in for fields kept in
  float32 such as the state: the PyTorch path accumulates in float32).
- A parameter shared by every token (g_gamma, A_log, dt_bias) has its gradient summed over
  tokens, so its error is the per-token error times ``||sum_t |c_t||| / ||sum_t c_t||`` (c_t the
  per-token contributions, read from the truth): that cancellation ratio scales its float32
  rtol and its rounding floor, the floor being the per-token contributions' resolution (the truth's
  c_t, scaled to a largest magnitude of 1, rounded to the dtype), not the rounding of the few summed
  values alone, which is one draw (g_gamma's two entries rounded almost exactly in a GPU fuzz case:
  8.0e-5 against 4.0e-4 from the per-token contributions).
- atol = :data:`ATOL` times the case's scale (the largest RMS among the truth's fields), for
  references near zero (a gate's gradient where the state it multiplies is zero, say).

Repro of one case: ``python -m fastweight.fuzz --space ci --op gla --mode chunk --backend triton
--dtype fp16 --seed 123`` (``Case.repro`` writes that line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from fastweight import ops
from fastweight.mechanisms import OPS
from fastweight.dispatch import mamba_gate
from fastweight.fuzz_cases import (  # noqa: F401  (the case API, re-exported: fuzz.draw, fuzz.Case, ...)
    CHUNK, COTANGENTS, DTYPES, GATE_IN_KERNEL, GATE_STRENGTHS, GATES, MODES, NEG_EIGVAL, SAME_HEADS, SPACES, Case,
    Space, case_seed, draw, draw_cotangents, draw_inputs, input_dtypes, op_shapes)
from fastweight.testing import rel_err


# float32, every field (outputs, states, every gradient, the gates' included): the PyTorch chunk
# path's float32 errors stay below 1.5e-6 on every field over 372 cases of the "gpu" space on the
# H200 (T up to 2048, packed up to 3748 tokens); the fused recurrent kernels, one token at a time,
# reach 4e-5 at T = 2048 (retention)
FP32_RTOL = 1e-4
FP64_RTOL = 1e-10
# the absolute term, per unit of the case's scale (the largest RMS among the truth's fields): a
# tenth of the dtype's unit roundoff for 16-bit dtypes
ATOL = {torch.float64: 1e-13, torch.float32: 1e-6, torch.float16: 5e-5, torch.bfloat16: 4e-4}
FLOOR_FACTOR = 3.0
# The delta family's chunk kernels keep W, U and (I + A)^{-1} in the input dtype, the DPLR ones W and
# U~ (16-bit tensor-core operands, as fla's do): more roundings than the PyTorch path, which
# accumulates in float32; up to 7.7x the fp16 floor measured on the "ci" space (DeltaNet dh0), 4.3x
# on the "gpu" space for DPLR (db). fp32 is held to FP32_RTOL as every op.
WY_OPS = tuple(name for name, op in OPS.items() if op.wy)
WY_FLOOR_FACTOR = 10.0


# Running a case.

def _call(case: Case, tensors: dict, backend: str, cu_seqlens, form_gate=False):
    """``fastweight.ops.<mode>_<op>(...)``; with ``form_gate`` Mamba-2's gate is formed here
    (the truth's own graph, so that the per-token gate gradient can be read)."""
    opt = {n: v for n, v in case.options if n not in ("gate_parts", "p_is_k")}
    x = dict(tensors)
    h0 = x.pop("initial_state", None)
    if case.op == "comba" and "p" not in x:
        x["p"] = None
    if form_gate and opt.get("use_gate_in_kernel"):
        x["g"] = mamba_gate(x["g"], x.pop("A_log"), x.pop("dt_bias"))
        x["g"].retain_grad()
        opt["use_gate_in_kernel"] = False
    if case.scale is not None:
        opt["scale"] = case.scale
    fn = getattr(ops, f"{case.mode}_{case.op}")
    return fn(**x, initial_state=h0, output_final_state=case.output_final_state, cu_seqlens=cu_seqlens,
              backend=backend, **opt), x


def _cu_seqlens(case: Case, device):
    if case.lengths is None:
        return None
    return torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=getattr(torch, case.cu_dtype),
                        device=device)


def forward_only(case: Case, inputs: dict, backend: str, device) -> dict:
    """Output and final state of a forward without autograd (``torch.no_grad``, no input requiring grad):
    the inference path, which the Triton backend runs through other kernels (nothing kept for a backward)."""
    with torch.no_grad():
        (o, S), _ = _call(case, {n: t.to(device) for n, t in inputs.items() if t is not None}, backend,
                          _cu_seqlens(case, device))
    if isinstance(S, tuple):   # normalised linear attention: fla's (S, z_state)
        S = S[0]
    return {"o": o, "final_state": S}


def forward_backward(case: Case, inputs: dict, backend: str, cotangents: dict, device, truth=False) -> dict:
    """Output, final state and the gradient of every floating input (``d<name>``, ``dh0``), plus
    the per-token gate gradient under ``_dg`` and the formed gate under ``_g`` when ``truth``."""
    leaves = {n: t.to(device, copy=True).requires_grad_() for n, t in inputs.items() if t is not None}
    if truth and case.op == "simple_gla" and "g" not in leaves:
        # g = 0 leaves the op unchanged and gives the per-token gradient that dg_gamma sums
        leaves["g"] = torch.zeros(case.B, case.T, case.HV, dtype=torch.float64, device=device,
                                  requires_grad=True)
    (o, S), called = _call(case, leaves, backend, _cu_seqlens(case, device), form_gate=truth)
    z = None
    if isinstance(S, tuple):   # normalised linear attention: fla's (S, z_state)
        S, z = S
    out = {"o": o, "final_state": S}
    outputs, grads = [], []
    for name, (base, view) in cotangents.items():
        y = out[name]
        outputs.append(y)
        grads.append(view(base.to(y.dtype).to(device)))
    torch.autograd.backward(outputs, grads)
    if z is not None:
        out["z_state"] = z
    out["_problems"] = []
    for n, t in leaves.items():
        out["dh0" if n == "initial_state" else f"d{n}"] = t.grad
        if t.grad is not None and t.grad.dtype != t.dtype:
            out["_problems"].append(f"d{n} is {t.grad.dtype}, expected {t.dtype}")
    if truth:
        out["_dg"], out["_g"] = called["g"].grad if "g" in called else None, called.get("g")
        if case.op == "simple_gla" and "g" not in inputs:
            del out["dg"]
    return out


def cancellation(case: Case, want: dict) -> tuple[dict, dict]:
    """Per summed parameter, ``||sum_t |contribution_t||| / ||sum_t contribution_t||`` from the truth, and the
    contributions' resolution in the case's dtype (their relative error rounded to it)."""
    dg, ratios, parts = want.get("_dg"), {}, {}
    if dg is None:
        return ratios, {}
    dg, want = dg.detach(), {n: t.detach() for n, t in want.items() if isinstance(t, torch.Tensor)}
    tokens = lambda t: t.abs().sum((0, 1)).flatten()  # noqa: E731
    if "dg_gamma" in want:
        parts["dg_gamma"] = dg
    if "dA_log" in want:
        contrib = dg * want["_g"]
        parts["dA_log"] = contrib if contrib.dim() == 3 else contrib.sum(-1)
        # d dt_bias = sum_t d(pre-activation)_t; the pre-activation's gradient is the input g's
        parts["ddt_bias"] = want["dg"]
    for name, c in parts.items():
        ratios[name] = tokens(c).norm() / want[name].norm()
    ratios = {n: max(1.0, float(r)) if math.isfinite(float(r)) else 1.0 for n, r in ratios.items()}
    return ratios, _resolutions(parts, DTYPES[case.dtype])


def _resolutions(parts: dict, dtype: torch.dtype) -> dict:
    """Per summed parameter, its per-token contributions' relative error when rounded to a 16-bit ``dtype``,
    taken on the contributions scaled to a largest magnitude of 1 (fp16's range does not then decide it:
    an overflow would make the floor infinite); 0 where they are all zero or not finite."""
    if dtype not in (torch.float16, torch.bfloat16):
        return {}
    out = {}
    for name, c in parts.items():
        top = c.abs().max()
        out[name] = rel_err((c / top).to(dtype), c / top) if top > 0 and torch.isfinite(top) else 0.0
    return out


def tolerance(dtype: torch.dtype, floor: float | None, ratio: float, scale: float,
              factor: float = FLOOR_FACTOR):
    """(rtol, atol) of one field (module docstring): ``floor`` for 16-bit dtypes (times ``factor``),
    ``ratio`` the field's cancellation ratio, ``scale`` the case's."""
    if dtype == torch.float64:
        rtol = FP64_RTOL
    elif dtype == torch.float32:
        rtol = FP32_RTOL * ratio
    else:
        rtol = factor * floor
    return rtol, ATOL[dtype] * scale


@dataclass
class Result:
    case: Case
    truth: str
    rows: dict = field(default_factory=dict)      # field -> dict(err, tol, floor, ok)
    problems: list = field(default_factory=list)  # what failed besides the numbers
    refused: str = ""                             # float64 refused by the Triton backend (accepted)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and all(r["ok"] for r in self.rows.values())

    def failures(self) -> list:
        return self.problems + [f"{n} err {r['err']:.3g} > tol {r['tol']:.3g} (floor {r['floor']:.2g})"
                                for n, r in self.rows.items() if not r["ok"]]

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        if self.refused:
            return f"{status} seed {self.case.seed} {self.case.describe()}: float64 refused ({self.refused[:80]})"
        worst = max(self.rows.items(), key=lambda kv: kv[1]["err"] / max(kv[1]["tol"], 1e-300), default=None)
        worst = f"worst {worst[0]} {worst[1]['err']:.2e}/{worst[1]['tol']:.1e}" if worst else ""
        bad = "; ".join(self.failures())
        return f"{status} seed {self.case.seed} {self.case.describe()} [truth {self.truth}] {worst} {bad}".rstrip()

    def to_json(self) -> dict:
        return dict(case=asdict(self.case), truth=self.truth, ok=self.ok, rows=self.rows, problems=self.problems,
                    refused=self.refused, seconds=self.seconds, repro=self.case.repro())


def _where(e: BaseException) -> str:
    """The exception and the innermost fastweight frame that raised it, in one line."""
    frames = traceback.extract_tb(e.__traceback__)
    inner = [f for f in frames if "fastweight" in f.filename] or frames
    f = inner[-1] if inner else None
    at = f" at {os.path.relpath(f.filename)}:{f.lineno}" if f else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}{at}"


def compare(case: Case, got: dict, want: dict, floors: dict | None, ratios: dict,
            resolution: dict | None = None) -> tuple[dict, list]:
    """Rows per field of the truth, and the problems that are not a number (dtype, missing gradient);
    ``resolution``: a summed parameter's per-token contributions' (:func:`cancellation`)."""
    resolution = resolution or {}
    dtype, rows, problems = DTYPES[case.dtype], {}, list(got["_problems"])
    if got["o"].dtype != dtype:
        problems.append(f"o is {got['o'].dtype}, expected {dtype}")
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if case.output_final_state and (got["final_state"] is None or got["final_state"].dtype != state_dtype):
        problems.append(f"final state is {getattr(got['final_state'], 'dtype', None)}, expected {state_dtype}")
    if not case.output_final_state and got["final_state"] is not None:
        problems.append("a final state returned with output_final_state=False")
    fields = {n: t.detach() for n, t in want.items() if not n.startswith("_") and t is not None}
    scale = max(t.double().pow(2).mean().sqrt().item() for t in fields.values() if t.numel())
    for name, ref in fields.items():
        x = got.get(name)
        if x is None:
            problems.append(f"{name} missing (the truth has one, norm {ref.norm().item():.3g})")
            continue
        x, ratio, floor = x.detach(), ratios.get(name, 1.0), None
        if floors is not None:
            floor = max(floors[name], rel_err(ref.to(dtype), ref) * ratio, resolution.get(name, 0.0) * ratio)
        factor = WY_FLOOR_FACTOR if case.op in WY_OPS and case.mode == "chunk" else FLOOR_FACTOR
        rtol, atol = tolerance(dtype, floor, ratio, scale, factor)
        norm = ref.double().norm().item()
        denom = max(norm, 1e-300)
        err = rel_err(x, ref) if norm > 0 else (x.double().norm().item() / denom
                                                if torch.isfinite(x).all() else float("inf"))
        tol = rtol + atol * math.sqrt(ref.numel()) / denom
        rows[name] = dict(err=err, tol=tol, floor=floor or 0.0, rms=norm / math.sqrt(max(ref.numel(), 1)),
                          ok=bool(err <= tol))
    return rows, problems


def _stage(name: str, fn):
    """``fn()``, an exception tagged with the stage that raised it (the truth, the floor)."""
    try:
        return fn()
    except Exception as e:
        e.stage = name
        raise


def _is_float64_refusal(case: Case, e: BaseException) -> bool:
    """The Triton backend's clear refusal of float64: a ValueError naming float64, raised by
    fastweight itself (not from inside Triton)."""
    frames = traceback.extract_tb(e.__traceback__)
    return (case.backend == "triton" and case.dtype == "fp64" and isinstance(e, ValueError)
            and not hasattr(e, "stage") and "float64" in str(e)
            and bool(frames) and f"{os.sep}triton{os.sep}" not in frames[-1].filename)


def check(case: Case, device="cpu") -> Result:
    """Run ``case`` on its backend and against the truth; every failure is in the Result, never raised."""
    t0 = time.time()
    space = SPACES[case.space]
    x64 = draw_inputs(case)
    dts = input_dtypes(case, x64)
    low = {n: (t.to(dts[n]) if t is not None else None) for n, t in x64.items()}
    up = {n: (t.double() if t is not None else None) for n, t in low.items()}
    cot = draw_cotangents(case)
    truth = "reference" if case.backend == "torch" or case.B * case.T <= space.reference_tokens else "torch"
    res = Result(case, truth)
    try:
        from fastweight.kernels.common import poisoned_outputs   # NaN output buffers: a missed element shows
        with poisoned_outputs() if case.backend == "triton" else contextlib.nullcontext():
            got = forward_backward(case, low, case.backend, cot, device)
            nograd = forward_only(case, low, case.backend, device) if case.backend == "triton" else {}
        want = _stage("the truth", lambda: forward_backward(case, up, truth, cot, device, truth=True))
        floors = None
        if case.dtype in ("fp16", "bf16"):
            run = _stage("the floor", lambda: forward_backward(case, low, "torch", cot, device))
            floors = {n: rel_err(run[n], w) if run.get(n) is not None else 0.0
                      for n, w in want.items() if w is not None and not n.startswith("_")}
    except Exception as e:  # noqa: BLE001  (every failure is reported in the Result)
        if _is_float64_refusal(case, e):
            res.refused = str(e).splitlines()[0]
        else:
            res.problems.append(f"{getattr(e, 'stage', 'the op')} raised {_where(e)}")
        res.seconds = time.time() - t0
        return res
    ratios, resolution = cancellation(case, want) if case.dtype != "fp64" else ({}, {})
    for name, t in nograd.items():   # the inference forward held to the same truth and tolerance
        if t is not None and want.get(name) is not None:
            got[f"{name}_nograd"], want[f"{name}_nograd"] = t, want[name]
            if floors is not None:
                floors[f"{name}_nograd"] = floors[name]
    res.rows, problems = compare(case, got, want, floors, ratios, resolution)
    res.problems += problems
    res.seconds = time.time() - t0
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description="Run one fuzz case (the repro line a failure prints).")
    ap.add_argument("--space", default="ci", choices=sorted(SPACES))
    ap.add_argument("--case", default="", help="a case as JSON (gpu_fuzz.json's results[i].case): rerun it "
                    "as recorded, whatever the drawing code does now")
    ap.add_argument("--op", choices=ops.OPS)
    ap.add_argument("--mode", default="chunk", choices=MODES)
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.case:
        case = Case.from_json(json.loads(args.case))
    elif args.op is None or args.seed is None:
        ap.error("pass --op and --seed (or --case)")
    else:
        case = draw(args.space, args.op, args.seed, args.mode, args.backend, args.dtype)
    res = check(case, device=args.device)
    print(res.line())
    for name, r in res.rows.items():
        print(f"  {name:16s} err {r['err']:.3e}  tol {r['tol']:.3e}  floor {r['floor']:.2e}  "
              f"{'ok' if r['ok'] else 'FAIL'}")
    return 0 if res.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

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
  rtol and its rounding floor.
- atol = :data:`ATOL` times the case's scale (the largest RMS among the truth's fields), for
  references near zero (a gate's gradient where the state it multiplies is zero, say).

Repro of one case: ``python -m fastweight.fuzz --space ci --op gla --mode chunk --backend triton
--dtype fp16 --seed 123`` (``Case.repro`` writes that line).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import random
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field

import torch

from fastweight import ops
from fastweight.dispatch import mamba_gate
from fastweight.mechanisms.base import l2norm
from fastweight.testing import rel_err

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("chunk", "fused_recurrent")
CHUNK = 64
GATE_STRENGTHS = ("mild", "mixed", "strong", "strong_tail")
COTANGENTS = ("dense", "expanded", "ones", "transposed", "sliced", "permuted", "heads_first", "none")

# the per-token log gates of each op (name -> per key channel or one per value head)
GATES = {"simple_gla": {"g": False}, "gla": {"g": True}, "rwkv6": {"w": True}, "hgrn2": {"g": True},
         "gated_delta_rule": {"g": False}, "kda": {"g": True}, "comba": {"g": False},
         "dplr_delta_rule": {"gk": True}, "rwkv7": {"w": True}}
# L2-normalised keys, and the options allow_neg_eigval and use_qk_l2norm_in_kernel
NEG_EIGVAL = ("delta_rule", "gated_delta_rule", "kda", "comba")
GATE_IN_KERNEL = ("gated_delta_rule", "kda")                        # where the op's signature has it
SAME_HEADS = ("rwkv6",)                                             # raise for HV != H (ops.py)

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
WY_OPS = ("delta_rule", "gated_delta_rule", "kda", "comba", "longhorn", "dplr_delta_rule", "rwkv7")
WY_FLOOR_FACTOR = 10.0


@dataclass(frozen=True)
class Space:
    """Where cases are drawn from. Each op gets ``common`` (K, V) pairs plus one of ``odd``
    (by its index), so the number of distinct head sizes, hence of Triton compilations, stays small."""
    name: str
    lengths: tuple
    batch: tuple
    heads: tuple
    groups: tuple
    max_value_heads: int
    common: tuple
    odd: tuple
    max_tokens: int
    reference_tokens: int
    varlen: float = 0.35
    profiles: dict = field(default_factory=dict)   # "mode" or "mode/dtype" -> profiles (none: every case its own)


SPACES = {
    "ci": Space("ci", lengths=(1, 43, 63, 64, 65, 100, 130), batch=(1, 2), heads=(1, 2), groups=(1, 2),
                max_value_heads=2, common=((16, 16),), odd=((16, 32), (32, 16), (32, 32)), max_tokens=130,
                reference_tokens=10 ** 9),
    "smoke": Space("smoke", lengths=(1, 20, 65), batch=(1, 2), heads=(1,), groups=(1, 2), max_value_heads=2,
                   common=((16, 16),), odd=((16, 32),), max_tokens=80, reference_tokens=10 ** 9),
    "gpu": Space("gpu", lengths=(1, 43, 64, 65, 130, 257, 700, 1000, 2048), batch=(1, 2, 4), heads=(1, 2, 4, 8),
                 groups=(1, 2, 4), max_value_heads=8, common=((128, 128),),
                 odd=((16, 256), (256, 16), (32, 128), (128, 32), (64, 64), (256, 256), (16, 16), (64, 128)),
                 max_tokens=4096, reference_tokens=256,
                 profiles={"chunk": 2, "chunk/fp32": 1, "fused_recurrent": 3}),
}


@dataclass(frozen=True)
class Case:
    space: str
    op: str
    mode: str
    backend: str
    dtype: str
    seed: int
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    lengths: tuple | None      # cu_seqlens' sequence lengths (B = 1), or None
    cu_dtype: str
    initial_state: bool
    output_final_state: bool
    gates: str                 # GATE_STRENGTHS
    gate_dtype: str            # log gates and beta: the case's dtype or fp32
    scale: float | None
    options: tuple             # (name, value) pairs passed to the op
    do: str                    # cotangent of o (COTANGENTS)
    dS: str                    # cotangent of the final state

    @property
    def N(self):
        return self.B if self.lengths is None else len(self.lengths)

    def describe(self) -> str:
        shape = f"B={self.B} T={self.T}" if self.lengths is None else f"lengths={list(self.lengths)}({self.cu_dtype})"
        opts = " ".join(f"{n}={v}" for n, v in self.options)
        gated = self.op in GATES or dict(self.options).get("use_gate_in_kernel")
        gates = f" gates={self.gates}/{self.gate_dtype}" if gated else ""
        return (f"{self.mode}_{self.op} {self.backend} {self.dtype} {shape} H={self.H} HV={self.HV} K={self.K} "
                f"V={self.V} h0={int(self.initial_state)} final={int(self.output_final_state)}{gates}"
                f" scale={self.scale} do={self.do} dS={self.dS} {opts}".rstrip())

    @classmethod
    def from_json(cls, fields: dict) -> "Case":
        """The case of :meth:`Result.to_json`'s ``case`` (JSON turns tuples into lists)."""
        return cls(**{**fields, "lengths": tuple(fields["lengths"]) if fields["lengths"] else None,
                      "options": tuple(tuple(o) for o in fields["options"])})

    def repro(self) -> str:
        return (f"python -m fastweight.fuzz --space {self.space} --op {self.op} --mode {self.mode} "
                f"--backend {self.backend} --dtype {self.dtype} --seed {self.seed}")


def op_shapes(space: Space, op: str) -> tuple:
    return space.common + (space.odd[ops.OPS.index(op) % len(space.odd)],)


def _varlen_lengths(rng: random.Random, space: Space) -> tuple:
    n = rng.choice((2, 3, 4))
    pool = (0, 1) + space.lengths
    lengths = [rng.choice(pool) for _ in range(n)]
    while sum(lengths) > space.max_tokens:
        lengths[lengths.index(max(lengths))] //= 2
    if sum(lengths) == 0:
        lengths[-1] = rng.choice(space.lengths)
    return tuple(lengths)


def draw(space: Space | str, op: str, seed: int, mode: str, backend: str, dtype: str) -> Case:
    """The case of ``seed`` for (op, mode, backend, dtype) in ``space``: a pure function of its arguments.

    With ``space.profiles`` the fields that select compiled kernels (head sizes, grouping, flags,
    options, cotangent layouts, T's divisibility) come from one of a few profiles per (op, mode,
    dtype), the rest (lengths, batch, heads, gate strength, scale, values) from the seed."""
    space = SPACES[space] if isinstance(space, str) else space
    rng = random.Random(f"{space.name}/{op}/{mode}/{backend}/{dtype}/{seed}")
    n_profiles = space.profiles.get(f"{mode}/{dtype}", space.profiles.get(mode, 0))
    cfg = random.Random(f"{space.name}/{op}/{mode}/{backend}/{dtype}/profile{rng.randrange(n_profiles)}") \
        if n_profiles else rng
    K, V = cfg.choice(op_shapes(space, op))
    group = cfg.choice([g for g in space.groups if g == 1 or op not in SAME_HEADS])
    varlen, t_kind = cfg.random() < space.varlen, cfg.choice(("one", "aligned", "ragged", "ragged", "ragged"))
    final, initial = cfg.random() < 0.7, cfg.random() < 0.7
    cu_dtype = cfg.choice(("int32", "int64"))
    gate_dtype = dtype if dtype in ("fp64", "fp32") or cfg.random() < 0.5 else "fp32"
    options = []
    if op == "linear_attn":
        options.append(("normalize", cfg.random() < 0.3))
    if op == "simple_gla":
        options.append(("gate_parts", cfg.choice(("g", "g_gamma", "both", "both"))))
    if op in NEG_EIGVAL:
        options += [("use_qk_l2norm_in_kernel", cfg.random() < 0.4), ("allow_neg_eigval", cfg.random() < 0.4)]
    if op in GATE_IN_KERNEL and "use_gate_in_kernel" in inspect.signature(getattr(ops, f"{mode}_{op}")).parameters:
        options.append(("use_gate_in_kernel", cfg.random() < 0.4))
    if op == "comba":
        options.append(("p_is_k", cfg.random() < 0.2))
    do = cfg.choice(COTANGENTS[:-1] + (("none",) if final else ()))
    dS = cfg.choice(COTANGENTS if do != "none" else COTANGENTS[:-1]) if final else "none"

    H = rng.choice([h for h in space.heads if h * group <= space.max_value_heads] or [1])
    group = min(group, space.max_value_heads // H)
    lengths = _varlen_lengths(rng, space) if varlen else None
    if lengths is None:
        pool = {"one": (1,), "aligned": tuple(t for t in space.lengths if t % 16 == 0)}.get(t_kind) or \
            tuple(t for t in space.lengths if t % 16)
        B, T = rng.choice(space.batch), rng.choice(pool)
        while B > 1 and B * T > space.max_tokens:
            B //= 2
        T = min(T, space.max_tokens)
    else:
        B, T = 1, sum(lengths)
    return Case(space=space.name, op=op, mode=mode, backend=backend, dtype=dtype, seed=seed, B=B, T=T, H=H,
                HV=H * group, K=K, V=V, lengths=lengths, cu_dtype=cu_dtype, initial_state=initial,
                output_final_state=final, gates=rng.choice(GATE_STRENGTHS), gate_dtype=gate_dtype,
                scale=rng.choice((None, None, 0.5)), options=tuple(options), do=do, dS=dS)


# Inputs, by the op's argument names, drawn in float64 on the CPU.

def _tail_mask(case: Case) -> torch.Tensor:
    """[T] bool: the tokens of each sequence's last chunk (partial or not)."""
    lengths = case.lengths or (case.T,)
    parts = []
    for L in lengths:
        t = torch.arange(L)
        parts.append(t >= CHUNK * ((L - 1) // CHUNK) if L else t.bool())
    return torch.cat(parts)


def _log_gate(case: Case, shape, gen) -> torch.Tensor:
    """Log decays per token: mild in [-0.5, -0.01], strong in [-6, -0.5], mixed (a quarter strong),
    or mild but in [-6, -3] over each sequence's last chunk."""
    u = lambda: torch.rand(shape, dtype=torch.float64, generator=gen)  # noqa: E731
    mild, strong = -(0.01 + 0.49 * u()), -(0.5 + 5.5 * u())
    if case.gates == "mild":
        return mild
    if case.gates == "strong":
        return strong
    if case.gates == "mixed":
        return torch.where(u() < 0.25, strong, mild)
    tail = _tail_mask(case).view(1, shape[1], *([1] * (len(shape) - 2)))
    return torch.where(tail, -(3 + 3 * u()), mild)


def draw_inputs(case: Case) -> dict:
    """float64 tensors by argument name (``initial_state`` included when the case has one)."""
    gen = torch.Generator().manual_seed(case.seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    opt = dict(case.options)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, dtype=torch.float64, generator=gen)  # noqa: E731
    op = case.op
    q, v = r(B, T, H, K), r(B, T, HV, V)
    if opt.get("use_qk_l2norm_in_kernel"):
        k = r(B, T, H, K) * 2
    elif op in NEG_EIGVAL:
        k = l2norm(r(B, T, H, K))
    else:
        k = r(B, T, H, K) * K ** -0.5
    x = dict(q=q, k=k, v=v)
    if op == "linear_attn" and opt["normalize"]:
        # positive feature maps keep the normaliser away from zero
        x.update(q=torch.nn.functional.softplus(q), k=torch.nn.functional.softplus(k))
    gates = {n: _log_gate(case, (B, T, HV, K) if op == "kda" else (B, T, H, K) if per_channel else (B, T, HV),
                          gen) for n, per_channel in GATES.get(op, {}).items()}
    x.update(gates)
    if op == "simple_gla":
        parts = opt["gate_parts"]
        strong = case.gates in ("strong", "mixed")
        if parts == "g_gamma":
            del x["g"]
        if parts != "g":
            x["g_gamma"] = -(0.5 + 2.5 * u(HV)) if strong else -(0.01 + 0.09 * u(HV))
    if op == "rwkv6":
        x = dict(r=x.pop("q"), k=x["k"], v=v, w=x["w"], u=r(H, K) * 0.5)
    if op == "hgrn2":
        del x["k"]
    if op in NEG_EIGVAL:
        x["beta"] = u(B, T, HV) * (2.0 if opt["allow_neg_eigval"] else 1.0)
    if op == "longhorn":
        x["beta"] = 0.1 + 2 * u(B, T, HV)
    if op == "comba":
        base = x["k"] if not opt["use_qk_l2norm_in_kernel"] else l2norm(x["k"])
        p = l2norm(base + 0.5 * r(B, T, H, K)) * (0.5 + 0.5 * u(B, T, H, 1))
        x["p"] = None if opt["p_is_k"] else (p * 2 if opt["use_qk_l2norm_in_kernel"] else p)
    if op in GATE_IN_KERNEL and opt.get("use_gate_in_kernel"):
        lo, hi = {"mild": (0.05, 0.5), "strong": (1.0, 6.0)}.get(case.gates, (0.05, 2.0))
        x["A_log"] = (lo + (hi - lo) * u(HV)).log()
        x["dt_bias"] = 0.5 * r(HV * K if op == "kda" else HV)
        x["g"] = r(*x["g"].shape) + (4.0 * _tail_mask(case).view(1, T, *([1] * (x["g"].dim() - 2)))
                                       if case.gates == "strong_tail" else 0.0)
    if op in ("dplr_delta_rule", "rwkv7"):
        kappa = l2norm(r(B, T, H, K))
        x.update(a=-kappa, b=kappa * u(B, T, H, K))
        if op == "rwkv7":
            x = dict(r=x["q"], w=x["w"], k=x["k"], v=v, a=x["a"], b=x["b"])
    if case.initial_state:
        x["initial_state"] = r(case.N, HV, K, V)
    return x


def input_dtypes(case: Case, x: dict) -> dict:
    """The dtype each input is passed in: vectors in the case's dtype, gates and beta in the gate
    dtype, the state and Mamba-2's parameters in float32 (float64 for float64 cases)."""
    low, gate = DTYPES[case.dtype], DTYPES[case.gate_dtype]
    high = torch.float64 if low == torch.float64 else torch.float32
    gate_names = set(GATES.get(case.op, {})) | {"beta", "g_gamma"}
    return {n: high if n in ("initial_state", "A_log", "dt_bias") else gate if n in gate_names else low for n in x}


def _cotangent(kind: str, shape, gen):
    """(base float64 tensor, view making the cotangent's layout from the base)."""
    shape = tuple(shape)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=gen)  # noqa: E731
    if kind == "dense":
        return r(*shape), lambda t: t
    if kind == "ones":
        return torch.ones(()), lambda t: t.expand(shape)
    if kind == "expanded":
        dims = [i for i in range(len(shape)) if torch.rand((), generator=gen) < 0.5] or [1]
        return r(*[1 if i in dims else s for i, s in enumerate(shape)]), lambda t: t.expand(shape)
    if kind == "transposed":
        return r(*shape[:-2], shape[-1], shape[-2]), lambda t: t.mT
    if kind == "sliced":
        return r(*shape[:-1], 2 * shape[-1] + 1), lambda t: t[..., 1::2]
    if kind == "permuted":
        return r(shape[1], shape[0], *shape[2:]), lambda t: t.transpose(0, 1)
    if kind == "heads_first":
        return r(shape[0], shape[2], shape[1], *shape[3:]), lambda t: t.transpose(1, 2)
    raise ValueError(kind)


def draw_cotangents(case: Case) -> dict:
    """{"o": (base, view), "final_state": (base, view)} for the outputs the loss reads."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    out = {}
    if case.do != "none":
        out["o"] = _cotangent(case.do, (case.B, case.T, case.HV, case.V), gen)
    if case.dS != "none":
        out["final_state"] = _cotangent(case.dS, (case.N, case.HV, case.K, case.V), gen)
    return out


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


def forward_backward(case: Case, inputs: dict, backend: str, cotangents: dict, device, truth=False) -> dict:
    """Output, final state and the gradient of every floating input (``d<name>``, ``dh0``), plus
    the per-token gate gradient under ``_dg`` and the formed gate under ``_g`` when ``truth``."""
    leaves = {n: t.to(device, copy=True).requires_grad_() for n, t in inputs.items() if t is not None}
    if truth and case.op == "simple_gla" and "g" not in leaves:
        # g = 0 leaves the op unchanged and gives the per-token gradient that dg_gamma sums
        leaves["g"] = torch.zeros(case.B, case.T, case.HV, dtype=torch.float64, device=device,
                                  requires_grad=True)
    cu = None
    if case.lengths is not None:
        cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=getattr(torch, case.cu_dtype),
                          device=device)
    (o, S), called = _call(case, leaves, backend, cu, form_gate=truth)
    out = {"o": o, "final_state": S}
    outputs, grads = [], []
    for name, (base, view) in cotangents.items():
        y = out[name]
        outputs.append(y)
        grads.append(view(base.to(y.dtype).to(device)))
    torch.autograd.backward(outputs, grads)
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


def cancellation(case: Case, want: dict) -> dict:
    """Per summed parameter, ``||sum_t |contribution_t||| / ||sum_t contribution_t||`` from the truth."""
    dg, ratios = want.get("_dg"), {}
    if dg is None:
        return ratios
    dg, want = dg.detach(), {n: t.detach() for n, t in want.items() if isinstance(t, torch.Tensor)}
    tokens = lambda t: t.abs().sum((0, 1)).flatten()  # noqa: E731
    if "dg_gamma" in want:
        ratios["dg_gamma"] = tokens(dg).norm() / want["dg_gamma"].norm()
    if "dA_log" in want:
        contrib = dg * want["_g"]
        ratios["dA_log"] = tokens(contrib if contrib.dim() == 3 else contrib.sum(-1)).norm() / want["dA_log"].norm()
        # d dt_bias = sum_t d(pre-activation)_t; the pre-activation's gradient is the input g's
        ratios["ddt_bias"] = tokens(want["dg"]).norm() / want["ddt_bias"].norm()
    return {n: max(1.0, float(r)) if math.isfinite(float(r)) else 1.0 for n, r in ratios.items()}


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


def compare(case: Case, got: dict, want: dict, floors: dict | None, ratios: dict) -> tuple[dict, list]:
    """Rows per field of the truth, and the problems that are not a number (dtype, missing gradient)."""
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
            floor = max(floors[name], rel_err(ref.to(dtype), ref) * ratio)
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


def poisoned_outputs():
    """The Triton kernels' output buffers start as NaN (``kernels.common.poisoned_outputs``)."""
    from fastweight.kernels import common
    return common.poisoned_outputs()


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
        with poisoned_outputs() if case.backend == "triton" else contextlib.nullcontext():
            got = forward_backward(case, low, case.backend, cot, device)
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
    ratios = cancellation(case, want) if case.dtype != "fp64" else {}
    res.rows, problems = compare(case, got, want, floors, ratios)
    res.problems += problems
    res.seconds = time.time() - t0
    return res


def case_seed(base: int, *parts) -> int:
    """A seed per (base seed, op, slot): stable across runs and Python versions."""
    return zlib.crc32("/".join(map(str, (base,) + parts)).encode())


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

"""The decay and delta chunk ops as test cases: inputs by the op's own argument names (drawn
from each mechanism's ``sample``), the chunk implementation and the per-token reference op
(``fastweight.reference.ops``: the mechanism's own recurrence, the float64 truth)."""

from __future__ import annotations

import inspect

import torch

import fastweight.chunk
import fastweight.ops
import fastweight.reference.ops
import fastweight.testing
from fastweight.mechanisms import get
from fastweight.mechanisms.base import sample_log_decay
from fastweight.testing import generator, rel_err

# op -> (mechanism whose sample draws the inputs, renames sample -> op argument, dropped names)
CASES = {
    "linear_attn": ("linear_attention", {}, ()),
    "retention": ("retnet", {}, ("_log_gamma",)),
    "simple_gla": ("linear_attention", {}, ()),
    "gla": ("gla", {}, ()),
    "rwkv6": ("rwkv6", {"q": "r", "_u": "u"}, ()),
    "hgrn2": ("hgrn2", {}, ()),
    "delta_rule": ("deltanet", {}, ()),
    "gated_delta_rule": ("gated_deltanet", {}, ()),
    "kda": ("kda", {}, ()),
    "comba": ("comba", {}, ()),
    "longhorn": ("longhorn", {}, ()),
}
DECAY_OPS = ("linear_attn", "retention", "simple_gla", "gla", "rwkv6", "hgrn2")
DELTA_OPS = ("delta_rule", "gated_delta_rule", "kda", "comba", "longhorn")
GATED_OPS = ("simple_gla", "gla", "rwkv6", "hgrn2", "gated_delta_rule", "kda", "comba")
GATES = ("g", "w")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def sample(op, B, T, H, K, V, *, gate_range=None, seed=None) -> dict:
    """float64 inputs of ``op``; ``gate_range=(lo, hi)`` redraws every per-token log gate uniformly in
    it (and zeroes simple GLA's per-head g_gamma, so that the decay of one step stays in the range)."""
    g = generator(seed)
    name, rename, drop = CASES[op]
    x = get(name).sample(B, T, H, K, V, dtype=torch.float64, device="cpu", generator=g)
    x = {rename.get(n, n): t for n, t in x.items() if n not in drop}
    if op == "simple_gla":
        x["g"] = sample_log_decay((B, T, H), dtype=torch.float64, device="cpu", generator=g)
        x["g_gamma"] = sample_log_decay((H,), dtype=torch.float64, device="cpu", generator=g, high=0.1)
    if gate_range is not None:
        lo, hi = gate_range
        for n in GATES:
            if n in x:
                x[n] = lo + (hi - lo) * torch.rand(x[n].shape, dtype=torch.float64, generator=g)
        if "g_gamma" in x:
            x["g_gamma"] = torch.zeros_like(x["g_gamma"])
    return x


def chunk_impl(op):
    return getattr(fastweight.chunk, f"chunk_{op}")


def reference_impl(op):
    return getattr(fastweight.reference.ops, op)


def run(fn, x, h0, *, seed=0, grads=True, **kw):
    """Output, final state and (``grads``) the gradient of every input and of ``h0`` under random
    cotangents (drawn in fp64 from ``seed``, so every dtype sees the same ones)."""
    x = {n: t.detach().clone().requires_grad_(grads) for n, t in x.items()}
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(grads)
    o, S = fn(**x, initial_state=h0, output_final_state=True, **kw)
    out = dict(o=o, S=S)
    if grads:
        g = generator(seed)
        do = torch.randn(o.shape, dtype=torch.float64, generator=g).to(o.dtype)
        dS = torch.randn(S.shape, dtype=torch.float64, generator=g).to(S.dtype)
        ((o.to(S.dtype) * do.to(S.dtype)).sum() + (S * dS).sum()).backward()
        out.update({f"d{n}": t.grad for n, t in x.items()})
        if h0 is not None:
            out["dh0"] = h0.grad
    return out


def errors(got: dict, want: dict) -> dict:
    return {n: rel_err(got[n], want[n]) for n in want}


def assert_close(got: dict, want: dict, tol: float, scale: dict | None = None):
    """Every relative error within ``tol`` (times ``scale[name]`` where given)."""
    errs = errors(got, want)
    scale = scale or {}
    assert all(e <= tol * scale.get(n, 1.0) for n, e in errs.items()), (errs, scale)


def summed_gate_scale(want: dict) -> dict:
    """RetNet-style ``g_gamma`` is one log gate shared by every token, so dg_gamma = sum_t dg_t: its
    fp32 error is the per-token error times sum_t |dg_t|, which cancellation can make much larger
    than |dg_gamma| under strong gates. Its tolerance is scaled by that ratio (from the reference),
    as in tests/kernels/test_fused_recurrent.py."""
    if "dg_gamma" not in want or "dg" not in want:
        return {}
    ratio = want["dg"].abs().sum((0, 1)).norm() / want["dg_gamma"].norm().clamp_min(1e-300)
    return {"dg_gamma": max(1.0, ratio.item())}


def assert_finite(got: dict):
    bad = [n for n, t in got.items() if t is not None and not bool(torch.isfinite(t).all())]
    assert not bad, f"NaN/Inf in {bad}"


# The checks every op goes through (test_decay.py / test_delta.py parametrise them).

_REFERENCE_CACHE: dict = {}


def check_matches_reference_fp64(op, T, chunk_size, H=2, K=8, V=8):
    """Outputs, final state and every gradient (initial_state included) to 1e-10 in fp64. The
    inputs are fresh per session; the reference is computed once per (op, T) for all chunk sizes."""
    if (op, T) in _REFERENCE_CACHE:
        x, h0, want, seeds = _REFERENCE_CACHE[(op, T)]
        fastweight.testing.fresh_seeds.extend(seeds)  # reported with a failure, as if drawn here
    else:
        first = len(fastweight.testing.fresh_seeds)
        x = sample(op, 2, T, H, K, V)
        h0 = torch.randn(2, H, K, V, dtype=torch.float64, generator=generator())
        want = run(reference_impl(op), x, h0, scale=0.4)
        _REFERENCE_CACHE[(op, T)] = x, h0, want, fastweight.testing.fresh_seeds[first:]
    assert_close(run(chunk_impl(op), x, h0, scale=0.4, chunk_size=chunk_size), want, TOL[torch.float64])


def check_varlen(op, chunk_size, lengths=(37, 1, 62), H=2, K=8, V=8):
    """Packed sequences of unequal lengths, each with its own initial state, against the reference."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = sample(op, 1, int(cu[-1]), H, K, V)
    h0 = torch.randn(len(lengths), H, K, V, dtype=torch.float64, generator=generator())
    want = run(reference_impl(op), x, h0, scale=0.4, cu_seqlens=cu)
    assert_close(run(chunk_impl(op), x, h0, scale=0.4, cu_seqlens=cu, chunk_size=chunk_size), want,
                 TOL[torch.float64])


def check_fp32(op, T=100, chunk_size=64, H=2, K=16, V=16):
    """fp32 inputs against the fp64 reference on the same (rounded) inputs: ~1e-5 relative RMS."""
    x = {n: t.float() for n, t in sample(op, 2, T, H, K, V).items()}
    h0 = torch.randn(2, H, K, V, generator=generator())
    got = run(chunk_impl(op), x, h0, scale=0.4, chunk_size=chunk_size)
    want = run(reference_impl(op), {n: t.double() for n, t in x.items()}, h0.double(), scale=0.4)
    assert_close(got, want, TOL[torch.float32])


def check_gate_extremes(op, gate_range, T=100, H=2, K=8, V=8):
    """Log gates in ``gate_range`` per step (cumulative decays far below -300 for [-20, 0]): no
    NaN/Inf in fp32 forward or backward, and the fp64 result still matches the reference."""
    x = sample(op, 1, T, H, K, V, gate_range=gate_range)
    h0 = torch.randn(1, H, K, V, dtype=torch.float64, generator=generator())
    want = run(reference_impl(op), x, h0, scale=0.4)
    for C in (16, 64):
        assert_close(run(chunk_impl(op), x, h0, scale=0.4, chunk_size=C), want, TOL[torch.float64])
        got32 = run(chunk_impl(op), {n: t.float() for n, t in x.items()}, h0.float(), scale=0.4, chunk_size=C)
        assert_finite(got32)
        assert_close(got32, want, TOL[torch.float32], scale=summed_gate_scale(want))


def check_low_precision(op, dtype, T=100, H=2, K=16, V=16):
    """bf16/fp16 inputs: the output (in the input dtype) is within 2x of the fp64 reference's own
    rounding error to that dtype, plus a small slack for the fp32 accumulation."""
    x = {n: t.to(dtype) for n, t in sample(op, 1, T, H, K, V).items()}
    o, _ = chunk_impl(op)(**x, scale=0.4)
    assert o.dtype == dtype
    want, _ = reference_impl(op)(**{n: t.double() for n, t in x.items()}, scale=0.4)
    floor = rel_err(want.to(dtype), want)
    assert rel_err(o, want) <= 2 * floor + 1e-4, (rel_err(o, want), floor)


def check_random_shapes(op, B, T, H, K, V, chunk_size, seed):
    """Forward and final state at shapes drawn by hypothesis, with an initial state, to 1e-10 in fp64."""
    x = sample(op, B, T, H, K, V, seed=seed)
    h0 = torch.randn(B, H, K, V, dtype=torch.float64, generator=generator(seed))
    want = run(reference_impl(op), x, h0, scale=0.7, grads=False)
    assert_close(run(chunk_impl(op), x, h0, scale=0.7, chunk_size=chunk_size, grads=False), want, TOL[torch.float64])


def check_public_op(op, T=40, H=2, K=8, V=8):
    """``fastweight.ops.chunk_<op>(backend="torch")`` is this implementation (same tensor names)."""
    x = {n: t.float() for n, t in sample(op, 1, T, H, K, V).items()}
    public = getattr(fastweight.ops, f"chunk_{op}")
    params = inspect.signature(public).parameters
    kw = {"allow_neg_eigval": True} if "allow_neg_eigval" in params else {}
    if "normalize" in params:
        kw["normalize"] = False     # the normaliser is applied by the op around the implementation
    o, S = public(**x, output_final_state=True, backend="torch", **kw)
    want_o, want_S = chunk_impl(op)(**x, scale=K ** -0.5, output_final_state=True)
    assert torch.equal(o, want_o) and torch.equal(S, want_S)

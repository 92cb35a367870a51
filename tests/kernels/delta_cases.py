"""Inputs and the float64 comparison of the delta-family kernel tests (``test_delta``; ``dplr_cases`` is
the DPLR tests' counterpart)."""

import torch

import fastweight.kernels as kernels
import fastweight.reference.ops as reference
from fastweight import ops
from fastweight.dispatch import l2norm, mamba_gate
from fastweight.mechanisms import get
from fastweight.testing import check_gradients, generator, rel_err

MECHANISM = {"delta_rule": "deltanet", "gated_delta_rule": "gated_deltanet", "longhorn": "longhorn", "kda": "kda",
             "comba": "comba"}
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


def sample(op, B, T, H, K, V, G=1, seed=None):
    x = get(MECHANISM[op]).sample(B, T, H * G, K, V, dtype=torch.float64, device="cpu", generator=generator(seed))
    for n in ("q", "k", "p"):
        if n in x:
            x[n] = x[n][:, :, ::G].contiguous()
    return x


def run_pair(op, x, h0, dtype, *, G=1, cu_seqlens=None, qk_l2norm=False, via_ops=False, gate=None):
    """The kernel on ``x`` (float64 values, run in ``dtype``) and the float64 reference on the same values.

    gate: (A_log, dt_bias) for the in-kernel gate (``x["g"]`` is then its pre-activation; the reference
    gets the gate formed in float64 by ``dispatch.mamba_gate``). Returns (outs, leaves, ref_outs,
    ref_leaves, g_ref): outs = (o, final state), leaves by name with ``initial_state``, g_ref the
    reference's log gate (None without the in-kernel gate).
    """
    x = dict(x, **dict(zip(("A_log", "dt_bias"), gate or ())))
    low = {n: t.to(dtype) for n, t in x.items()}
    mine = {n: t.detach().clone().requires_grad_() for n, t in low.items()}
    ref = {n: t.detach().double().requires_grad_() for n, t in low.items()}
    if h0 is not None:
        mine["initial_state"], ref["initial_state"] = h0.float().requires_grad_(), h0.double().requires_grad_()
    scale = x["q"].shape[-1] ** -0.5
    kw = dict(scale=scale, output_final_state=True, cu_seqlens=cu_seqlens)
    if via_ops:
        # the mechanisms sample beta up to 2 where the op allows it (negative eigenvalues)
        neg = dict(allow_neg_eigval=True) if op != "longhorn" else {}
        outs = getattr(ops, f"chunk_{op}")(**mine, **kw, **neg, backend="triton")
    else:
        extra = dict(use_qk_l2norm_in_kernel=True) if qk_l2norm else {}
        if gate is not None:
            extra["use_gate_in_kernel"] = True
        outs = getattr(kernels, f"chunk_{op}")(**mine, **kw, **extra)
    expanded = dict(ref)
    for n in ("q", "k", "p"):
        if n in ref:
            expanded[n] = l2norm(ref[n]) if qk_l2norm else ref[n]
            expanded[n] = expanded[n].repeat_interleave(G, dim=2)
    g_ref = None
    if gate is not None:
        g_ref = expanded["g"] = mamba_gate(expanded["g"], expanded.pop("A_log"), expanded.pop("dt_bias"))
    ref_outs = getattr(reference, op)(**expanded, **kw)
    return outs, mine, ref_outs, ref, g_ref


def check(op, B, T, H, K, V, dtype, *, G=1, cu_seqlens=None, initial_state=True, qk_l2norm=False, via_ops=False,
          gate_scale=1.0):
    x = sample(op, B, T, H, K, V, G)
    if "g" in x:
        x["g"] = x["g"] * gate_scale
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.randn(N, H * G, K, V, generator=generator()) if initial_state else None
    pair = run_pair(op, x, h0, dtype, G=G, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, via_ops=via_ops)
    (o, ht), _, (o_ref, ht_ref), _, _ = pair
    assert o.dtype == dtype and ht.dtype == torch.float32
    tol = TOL[dtype]
    assert rel_err(o, o_ref) < tol
    assert rel_err(ht, ht_ref) < tol
    do, dht = torch.randn_like(o_ref), torch.randn_like(ht_ref)
    check_gradients(*pair, (do.to(dtype), dht.float()), tol)

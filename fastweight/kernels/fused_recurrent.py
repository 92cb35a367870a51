"""Fused recurrent kernel: the DPLR recurrence one token at a time, state in registers.

One generic forward kernel serves every op of the family (decode and short sequences):

    S_t = Diag(exp gk_t) S_{t-1} + a_t (b_t^T S_{t-1}) + k_t v_t^T        o_t = S_t^T (scale q_t)

State ``S`` is ``[K, V]`` in fp32; a program holds all K rows and a ``BV``-wide block of
columns (columns of S are independent), reads the initial state once and writes the final
state once. Constexpr flags pick the pieces of the step:

- decay: ``USE_G`` (scalar per token, ``g [B, T, HV]``), ``USE_G_GAMMA`` (constant per head,
  ``g_gamma [HV]``), ``USE_GK`` (per key channel, ``gk [B, T, HV, K]``), any together (summed
  in log space). ``USE_GATE_IN_KERNEL``: the gate tensor is raw and the log decay is
  ``-exp(A_log) * softplus(g + dt_bias)`` (Mamba-2 parameterisation; ``A_log [HV]``,
  ``dt_bias [HV]`` for a scalar gate or ``[HV * K]`` for a per-channel one).
- low rank: ``LOW_RANK = 0`` none; ``1`` the delta rule with tied keys, ``a = -beta k``,
  write ``beta k``, ``b = k`` (or the separate key ``p`` with ``USE_P``), ``b`` multiplied by
  the decay with ``B_DECAYED`` (Gated DeltaNet, KDA: the rule acts on the decayed state),
  ``beta`` replaced by the implicit step's ``eps = beta / (1 + beta k^T k)`` with ``IMPLICIT``;
  ``2`` free ``a``, ``b`` (generic DPLR, RWKV-7).
- readout: ``USE_BONUS`` is RWKV-6's, ``o_t = S_{t-1}^T (scale q) + (scale q . (u * k_t)) v_t``.
- ``USE_QK_L2NORM``: q and k (and p) divided by ``sqrt(sum x^2 + 1e-6)`` in the kernel.
- grouped value heads: q, k (and p) have H heads, everything else HV (a multiple of H).

With ``STORE_R`` the kernel also writes ``r_t = b_t^T S_{t-1}`` (``[B, T, HV, V]`` fp32), which
the backward needs (``fused_recurrent_bwd.py``; the derivation is in ``docs/fused_recurrent.md``).
Each op's mechanism file (``fastweight.mechanisms``) maps the op's arguments onto these flags.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastweight.dispatch import l2norm
from fastweight.kernels.common import alloc, exp


@triton.jit(do_not_specialize=["T"])
def fused_recurrent_fwd_kernel(
    q, k, v, g, g_gamma, gk, beta, p, a, b, u, A_log, dt_bias,
    o, h0, ht, r, cu_seqlens,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_G_GAMMA: tl.constexpr, USE_GK: tl.constexpr,
    USE_GATE_IN_KERNEL: tl.constexpr, LOW_RANK: tl.constexpr, USE_P: tl.constexpr,
    B_DECAYED: tl.constexpr, IMPLICIT: tl.constexpr, USE_BONUS: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STORE_R: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = eos - bos
    else:
        bos = i_n.to(tl.int64) * T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0).to(tl.float32)
    if USE_G_GAMMA:
        b_gamma = tl.load(g_gamma + i_hv).to(tl.float32)
    if USE_GATE_IN_KERNEL:
        b_A = -exp(tl.load(A_log + i_hv).to(tl.float32))
        if USE_GK:
            b_dt = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
        else:
            b_dt = tl.load(dt_bias + i_hv).to(tl.float32)
    if USE_BONUS:
        b_u = tl.load(u + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)

    # a while loop, not range(T): the interpreter cannot iterate to a runtime bound
    t = tl.zeros([], dtype=tl.int64)
    while t < T:
        i_tok = bos + t
        o_qk = (i_tok * H + i_h) * K + o_k
        o_hk = (i_tok * HV + i_hv) * K + o_k
        o_hv = (i_tok * HV + i_hv) * V + o_v
        b_q = tl.load(q + o_qk, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + o_qk, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + o_hv, mask=m_v, other=0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        if USE_BONUS:
            # RWKV-6 reads the state before this token's update, plus the bonus on the current token
            b_o = tl.sum(b_q[:, None] * b_h, 0) + tl.sum(b_q * b_u * b_k) * b_v

        # log decay: a scalar and/or a per-channel vector
        b_gs = 0.
        if USE_G:
            b_gs = tl.load(g + i_tok * HV + i_hv).to(tl.float32)
            if USE_GATE_IN_KERNEL:
                b_x = b_gs + b_dt
                b_gs = b_A * tl.where(b_x > 20., b_x, tl.log(1. + exp(tl.minimum(b_x, 20.))))
        if USE_G_GAMMA:
            b_gs += b_gamma
        if USE_GK:
            b_gk = tl.load(gk + o_hk, mask=m_k, other=0).to(tl.float32)
            if USE_GATE_IN_KERNEL:
                b_x = b_gk + b_dt
                b_gk = b_A * tl.where(b_x > 20., b_x, tl.log(1. + exp(tl.minimum(b_x, 20.))))
            b_w = exp(b_gk + b_gs)
        else:
            b_w = exp(b_gs + tl.zeros([BK], dtype=tl.float32))

        if LOW_RANK == 1:
            if USE_P:
                b_b = tl.load(p + o_qk, mask=m_k, other=0).to(tl.float32)
                if USE_QK_L2NORM:
                    b_b = b_b * tl.rsqrt(tl.sum(b_b * b_b) + 1e-6)
            else:
                b_b = b_k
            b_beta = tl.load(beta + i_tok * HV + i_hv).to(tl.float32)
            if IMPLICIT:
                b_beta = b_beta / (1. + b_beta * tl.sum(b_k * b_k))
            if B_DECAYED:
                b_h = b_h * b_w[:, None]
                b_r = tl.sum(b_b[:, None] * b_h, 0)
            else:
                b_r = tl.sum(b_b[:, None] * b_h, 0)
                b_h = b_h * b_w[:, None]
            # erase-write: S += beta k (v - b^T S)^T
            b_h += (b_beta * b_k)[:, None] * (b_v - b_r)[None, :]
        elif LOW_RANK == 2:
            b_a = tl.load(a + o_hk, mask=m_k, other=0).to(tl.float32)
            b_b = tl.load(b + o_hk, mask=m_k, other=0).to(tl.float32)
            b_r = tl.sum(b_b[:, None] * b_h, 0)
            b_h = b_h * b_w[:, None] + b_a[:, None] * b_r[None, :] + b_k[:, None] * b_v[None, :]
        else:
            b_h = b_h * b_w[:, None] + b_k[:, None] * b_v[None, :]
        if STORE_R:
            tl.store(r + o_hv, b_r, mask=m_v)

        if not USE_BONUS:
            b_o = tl.sum(b_q[:, None] * b_h, 0)
        tl.store(o + o_hv, b_o.to(o.dtype.element_ty), mask=m_v)
        t += 1

    if STORE_FINAL_STATE:
        tl.store(ht + i_nh.to(tl.int64) * K * V + o_h, b_h.to(ht.dtype.element_ty), mask=m_h)


@dataclass(frozen=True)
class Spec:
    """Which step the generic kernel runs (the constexpr flags, see the module docstring)."""
    low_rank: int = 0
    use_p: bool = False
    b_decayed: bool = False
    implicit: bool = False
    bonus: bool = False
    qk_l2norm: bool = False
    gate_in_kernel: bool = False


def buffer(like: torch.Tensor, *shape, dtype=None) -> torch.Tensor:
    """An output buffer on ``like``'s device (NaN-filled inside ``common.poisoned_outputs()``)."""
    return alloc(shape, dtype=dtype or like.dtype, device=like.device)


_FORCED: dict = {}   # "fwd" / "bwd" -> (BV, num_warps), set only by forced_blocks()


@contextmanager
def forced_blocks(fwd: tuple[int, int] | None = None, bwd: tuple[int, int] | None = None):
    """Within the block, the forward / backward kernels run with these (BV, num_warps) instead of
    :func:`default_block_v`'s (tests: value blocks split across programs; benchmarks: a block sweep)."""
    before = dict(_FORCED)
    _FORCED.update({n: b for n, b in (("fwd", fwd), ("bwd", bwd)) if b is not None})
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(before)


def default_block_v(K: int, V: int, backward: bool = False) -> tuple[int, int]:
    """(BV, num_warps): a [K, BV] fp32 state block of 2048 elements per program (unless forced_blocks).

    Measured on the H200 (docs/bench/decode.md), K = V = 128: the decode step moved the state at
    84% of the copy rate with BV=16 in 1 warp (79% with BV=32 in 4 warps, 63% with BV=64 in 8);
    forward+backward at (8, 256, 16, 128) was fastest with the backward at BV=16 in 2 warps.
    """
    forced = _FORCED.get("bwd" if backward else "fwd")
    if forced is not None:
        return forced
    BV = min(triton.next_power_of_2(V), max(8, 2048 // triton.next_power_of_2(K)))
    return BV, 2 if backward else 1


def fused_recurrent_fwd(spec: Spec, q, k, v, *, g=None, g_gamma=None, gk=None, beta=None, p=None,
                        a=None, b=None, u=None, A_log=None, dt_bias=None, scale: float,
                        initial_state=None, output_final_state=False, cu_seqlens=None,
                        store_r=False, block_v=None, num_warps=None):
    """Launch the forward kernel. q, k (, p): [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV];
    gk, a, b: [B, T, HV, K]; g_gamma, A_log: [HV]; u: [HV, K]; dt_bias: [HV] or [HV * K].

    Returns (o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] fp32 or None,
    r [B, T, HV, V] fp32 or None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BK = triton.next_power_of_2(K)
    BV, warps = default_block_v(K, V)
    BV, warps = block_v or BV, num_warps or warps
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = buffer(v, *v.shape)
    ht = buffer(q, N, HV, K, V, dtype=torch.float32) if output_final_state else None
    r = buffer(q, B, T, HV, V, dtype=torch.float32) if store_r and spec.low_rank else None
    cont = lambda x: None if x is None else x.contiguous()  # noqa: E731
    grid = (triton.cdiv(V, BV), N * HV)
    fused_recurrent_fwd_kernel[grid](
        q, k, v, cont(g), cont(g_gamma), cont(gk), cont(beta), cont(p), cont(a), cont(b), cont(u),
        cont(A_log), cont(dt_bias), o, cont(initial_state), ht, r, cu_seqlens,
        scale, T, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_G=g is not None, USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None,
        USE_GATE_IN_KERNEL=spec.gate_in_kernel, LOW_RANK=spec.low_rank, USE_P=spec.use_p,
        B_DECAYED=spec.b_decayed, IMPLICIT=spec.implicit, USE_BONUS=spec.bonus,
        USE_QK_L2NORM=spec.qk_l2norm, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state, STORE_R=r is not None, IS_VARLEN=cu_seqlens is not None,
        num_warps=warps,
    )
    return o, ht, r


TENSORS = ("q", "k", "v", "g", "g_gamma", "gk", "beta", "p", "a", "b", "u", "A_log", "dt_bias", "initial_state")


def generic_inputs(spec: Spec, x: dict, scale: float):
    """What the forward kernel computes in registers, in PyTorch (fp32, differentiable).

    Returns the generic step's inputs ``dict(q, k, v, a, b, g)`` at the value heads (``g``: the
    total log decay, [B, T, HV] or [B, T, HV, K] or None) and RWKV-6's bonus term of the output
    (``(scale q . (u * k)) v``, or None).
    """
    B, T, H, K = x["q"].shape
    HV = x["v"].shape[2]
    heads = lambda t: t.repeat_interleave(HV // H, dim=2) if HV != H else t  # noqa: E731
    q, k, v = x["q"].float(), x["k"].float(), x["v"].float()
    if spec.qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = heads(q), heads(k)
    softplus = torch.nn.functional.softplus
    decay = None
    if x["g"] is not None:
        decay = x["g"].float()
        if spec.gate_in_kernel:
            decay = -x["A_log"].float().exp() * softplus(decay + x["dt_bias"].float())
    if x["g_gamma"] is not None:
        gamma = x["g_gamma"].float().expand(B, T, HV)
        decay = gamma if decay is None else decay + gamma
    if x["gk"] is not None:
        gk = x["gk"].float()
        if spec.gate_in_kernel:
            gk = -x["A_log"].float().exp()[:, None] * softplus(gk + x["dt_bias"].float().view(HV, K))
        decay = gk if decay is None else gk + decay[..., None]
    a = b = None
    if spec.low_rank == 1:
        b = k
        if spec.use_p:
            b = heads(l2norm(x["p"].float()) if spec.qk_l2norm else x["p"].float())
        beta = x["beta"].float()[..., None]
        if spec.implicit:
            beta = beta / (1 + beta * (k * k).sum(-1, keepdim=True))
        if spec.b_decayed and decay is not None:
            b = b * (decay.exp() if decay.dim() == 4 else decay.exp()[..., None])
        k = beta * k
        a = -k
    elif spec.low_rank == 2:
        a, b = x["a"].float(), x["b"].float()
    bonus = None
    if spec.bonus:
        bonus = (scale * q * x["u"].float() * k).sum(-1, keepdim=True) * v
    return dict(q=q, k=k, v=v, a=a, b=b, g=decay), bonus


class FusedRecurrentFunction(torch.autograd.Function):
    """The generic fused recurrence with its backward (``fused_recurrent_bwd.py``)."""

    @staticmethod
    def forward(ctx, spec, scale, cu_seqlens, output_final_state, *tensors):
        x = dict(zip(TENSORS, tensors))
        needs_grad = any(ctx.needs_input_grad[4:])
        o, ht, r = fused_recurrent_fwd(
            spec, x["q"], x["k"], x["v"], **{n: x[n] for n in TENSORS[3:-1]}, scale=scale,
            initial_state=x["initial_state"], output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, store_r=needs_grad)
        ctx.save_for_backward(*tensors, r)
        ctx.spec, ctx.scale, ctx.cu_seqlens = spec, scale, cu_seqlens
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        from fastweight.kernels.fused_recurrent_bwd import fused_recurrent_bwd

        *tensors, r = ctx.saved_tensors
        x = dict(zip(TENSORS, tensors))
        wants = dict(zip(TENSORS, ctx.needs_input_grad[4:]))
        leaves = {n: x[n].detach().requires_grad_() for n in TENSORS[:-1] if wants[n]}
        with torch.enable_grad():
            gen, bonus = generic_inputs(ctx.spec, {**x, **leaves}, ctx.scale)
        if do is None:
            do = torch.zeros_like(x["v"])
        detached = {n: (t.detach() if t is not None else None) for n, t in gen.items()}
        dq, dk, dv, da, db, dg, dh0 = fused_recurrent_bwd(
            **detached, r=r, do=do, dht=dht, h0=x["initial_state"], scale=ctx.scale,
            cu_seqlens=ctx.cu_seqlens, readout_prev=ctx.spec.bonus)
        outs, grads = [], []
        for name, grad in zip(("q", "k", "v", "a", "b", "g"), (dq, dk, dv, da, db, dg)):
            if gen[name] is not None and gen[name].requires_grad:
                outs.append(gen[name])
                grads.append(grad)
        if bonus is not None and bonus.requires_grad:
            outs.append(bonus)
            grads.append(do.float())
        found = torch.autograd.grad(outs, list(leaves.values()), grads, allow_unused=True) if outs else ()
        found = dict(zip(leaves, found))
        result = []
        for n in TENSORS:
            if n == "initial_state":
                result.append(dh0.to(x[n].dtype) if wants[n] else None)
            elif n in found and found[n] is not None:
                result.append(found[n].to(x[n].dtype))
            else:
                result.append(torch.zeros_like(x[n]) if wants[n] else None)
        return (None, None, None, None, *result)


def fused_recurrent(q, k, v, *, spec: Spec, scale: float, initial_state=None, output_final_state=False,
                    cu_seqlens=None, **tensors):
    """The generic fused recurrence (see the module docstring), differentiable in every tensor."""
    x = dict(q=q, k=k, v=v, initial_state=initial_state, **tensors)
    return FusedRecurrentFunction.apply(spec, scale, cu_seqlens, output_final_state,
                                        *(x.get(n) for n in TENSORS))


def gate_spec(A_log, dt_bias, heads: int, channels: int) -> bool:
    """Whether the gate is computed in the kernel; checks ``A_log`` [HV] and ``dt_bias`` [HV * channels]."""
    from fastweight import checks
    if (A_log is None) != (dt_bias is None):
        raise ValueError("the in-kernel gate needs both `A_log` and `dt_bias`, or neither")
    if A_log is None:
        return False
    checks.check_tensor("A_log", A_log, ndim=1, shape=(heads,))
    checks.check_tensor("dt_bias", dt_bias, ndim=1, shape=(heads * channels,))
    return True

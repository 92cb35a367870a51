"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, arXiv:2412.06464).

    S_t = (I - beta_t k_t k_t^T) alpha_t S_{t-1} + beta_t k_t v_t^T,    alpha_t = exp(g_t)

Online learning: decay first, then one SGD step with learning rate beta_t on
``1/2 ||S~^T k_t - v_t||^2`` at the decayed state ``S~ = alpha_t S_{t-1}``.
DPLR: w = alpha_t, a = -beta k, b = alpha_t k, write (beta k, v).
"""

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, kT_S, l2norm, outer, rand, randn,
                                        reference_op, register, register_mixer, register_op, regression)
from fastweight.mechanisms.deltanet import delta_dplr, delta_torch, delta_triton_chunk


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(
        q=randn((B, T, H, K), **kw),
        k=l2norm(randn((B, T, H, K), **kw)),
        v=randn((B, T, H, V), **kw),
        g=-rand((B, T, H), **kw) * 0.5 - 0.01,
        beta=rand((B, T, H), **kw),
    )


def step(S, x):
    alpha, beta, k = x["g"].exp()[..., None, None], x["beta"][..., None], x["k"]
    S = alpha * S
    return S - outer(beta * k, kT_S(k, S)) + outer(beta * k, x["v"])


def to_dplr(inputs):
    k, beta, g = inputs["k"], inputs["beta"][..., None], inputs["g"]
    return dict(q=inputs["q"], k=beta * k, v=inputs["v"], a=-beta * k, b=g.exp()[..., None] * k, gk=g)


def objective(S, x):
    S_decayed = x["g"].exp()[..., None, None] * S
    return S_decayed, [(x["beta"][..., None, None], regression(x["k"], x["v"]))], False


MECHANISM = register(Mechanism(
    name="gated_deltanet",
    title="Gated DeltaNet",
    paper="arXiv:2412.06464",
    kernel_path="delta",
    dplr_in_words="w=alpha_t (scalar), a=-beta k, b=alpha_t k, write (beta k, v)",
    input_names=("q", "k", "v", "g", "beta"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="gated_delta_rule",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"]),
))


def _dplr(q, k, v, g, beta, **_):
    return delta_dplr(q, k, v, beta, gk=g[..., None].expand_as(q).contiguous(), a=g.exp()[..., None] * k)


def _triton_fused_recurrent(q, k, v, g, beta, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None, **kw):
    """With ``A_log``, ``dt_bias`` ([HV]) the gate is ``-exp(A_log) * softplus(g + dt_bias)``, in the kernel."""
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent, gate_spec
    spec = Spec(low_rank=1, b_decayed=True, qk_l2norm=use_qk_l2norm_in_kernel,
                gate_in_kernel=gate_spec(A_log, dt_bias, v.shape[2], 1))
    return fused_recurrent(q, k, v, spec=spec, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, **kw)


OP = register_op(Op(name="gated_delta_rule", mechanism="gated_deltanet", args=("q", "k", "v", "g", "beta"),
                    family="delta", gates={"g": "head"}, beta="unit", gate_in_kernel=True,
                    reference=reference_op(MECHANISM), dplr=_dplr, torch=Impl(delta_torch),
                    triton_chunk=Impl(delta_triton_chunk, grouped_heads=True, fused_l2norm=True, fused_gate=True),
                    triton_fused_recurrent=Impl(_triton_fused_recurrent, grouped_heads=True, fused_l2norm=True)))
register_mixer(Mixer(name="gdn", op="gated_delta_rule", layer="delta", options=dict(decay="head", gate="silu")))

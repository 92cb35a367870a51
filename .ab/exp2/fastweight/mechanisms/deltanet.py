"""DeltaNet (Schlag et al. 2021, arXiv:2102.11174; parallelised by Yang et al. 2024, arXiv:2406.06484).

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

Erase the value the key reads, write the new one (the step below is this erase-write form).
Online learning: one SGD step with learning rate beta_t on ``1/2 ||S^T k_t - v_t||^2``.
With ``allow_neg_eigval`` beta_t lies in (0, 2): the transition's eigenvalue along k is
1 - beta_t < 0 (state tracking; Grazzi et al. 2024). DPLR: w = 1, a = -beta k, b = k, write (beta k, v).
"""

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, kT_S, l2norm, outer, rand, randn,
                                        reference_op, register, register_mixer, register_op, regression)


def sample(B, T, H, K, V, *, dtype, device, generator, allow_neg_eigval=True):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), k=l2norm(randn((B, T, H, K), **kw)),
                v=randn((B, T, H, V), **kw),
                beta=rand((B, T, H), **kw) * (2.0 if allow_neg_eigval else 1.0))


def step(S, x):
    k, beta = x["k"], x["beta"][..., None]
    v_old = kT_S(k, S)
    return S + outer(beta * k, x["v"] - v_old)


def to_dplr(inputs):
    k, beta = inputs["k"], inputs["beta"][..., None]
    return dict(q=inputs["q"], k=beta * k, v=inputs["v"], a=-beta * k, b=k, gk=None)


def objective(S, x):
    return S, [(x["beta"][..., None, None], regression(x["k"], x["v"]))], False


MECHANISM = register(Mechanism(
    name="deltanet",
    title="DeltaNet",
    paper="arXiv:2406.06484",
    kernel_path="delta",
    dplr_in_words="w=1, a=-beta k, b=k, write (beta k, v); beta in (0, 2) with allow_neg_eigval",
    input_names=("q", "k", "v", "beta"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    options=dict(allow_neg_eigval=True),
    op="delta_rule",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], allow_neg_eigval=True),
))


def delta_dplr(q, k, v, beta, gk=None, a=None):
    """The delta step's DPLR arguments, fla's meaning: write (beta k, v), read ``a`` (k by
    default) against the state, b = -beta k."""
    b = beta[..., None] * k
    return dict(q=q, k=b, v=v, a=k if a is None else a, b=-b, gk=gk)


def delta_torch(q, k, v, beta, g=None, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                chunk_size=64, **_):
    """The delta rule's PyTorch chunk path, with the decay ``g`` (None; per head [B, T, HV]; per key
    channel [B, T, HV, K]) applied before the step: DeltaNet, Gated DeltaNet, KDA."""
    from fastweight.chunk.delta import delta_chunk
    return delta_chunk(q, k, v, beta, g, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def delta_triton_chunk(q, k, v, beta, g=None, *, scale, initial_state=None, output_final_state=False,
                       cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                       use_gate_in_kernel=False, **_):
    """The same on the Triton kernels. use_gate_in_kernel: ``g`` is the pre-activation and the kernel
    forms the log gate ``-exp(A_log) softplus(g + dt_bias)`` (A_log [HV]; dt_bias [HV], or [HV * K]
    for a per-channel gate, as fla's chunk_kda), with gradients for all three."""
    from fastweight.kernels.delta import chunk_delta, gate_params
    return chunk_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       **gate_params(use_gate_in_kernel, A_log, dt_bias))


def _triton_fused_recurrent(q, k, v, beta, use_qk_l2norm_in_kernel=False, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    return fused_recurrent(q, k, v, spec=Spec(low_rank=1, qk_l2norm=use_qk_l2norm_in_kernel), beta=beta, **kw)


def _dplr(q, k, v, beta, **_):
    return delta_dplr(q, k, v, beta)


OP = register_op(Op(name="delta_rule", mechanism="deltanet", args=("q", "k", "v", "beta"), family="delta",
                    beta="unit", reference=reference_op(MECHANISM), dplr=_dplr, torch=Impl(delta_torch),
                    triton_chunk=Impl(delta_triton_chunk, grouped_heads=True, fused_l2norm=True),
                    triton_fused_recurrent=Impl(_triton_fused_recurrent, grouped_heads=True, fused_l2norm=True)))
register_mixer(Mixer(name="deltanet", op="delta_rule", layer="delta", options=dict(decay=None, gate=None)))

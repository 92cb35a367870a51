"""Comba (Hu et al. 2025, arXiv:2506.02475): scalar decay plus a delta correction read by a second key.

    S_t = (alpha_t I - beta_t k_t p_t^T) S_{t-1} + beta_t k_t v_t^T
        = alpha_t S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T,      alpha_t = exp(g_t)

``p`` [B, T, H, K] is the auxiliary (read) key, the seed's k-hat and fla's ``p`` (fla's layer
uses p = d * k with a per-head d in (0, 1)); the prediction error is read from the *undecayed*
state. Online learning: weight decay ``1/2 (1 - alpha_t) ||S||_F^2`` plus a step on
``1/2 ||S^T p_t - v_t||^2`` preconditioned by ``P = beta_t k_t p_t^T / ||p_t||^2``; for p != k
no scalar objective has this step as its gradient (docs/objectives.md).
DPLR: w = alpha_t (scalar), a = -beta k, b = p, write (beta k, v).
"""

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, Preconditioner, kT_S, l2norm, outer, rand,
                                        randn, reference_op, register, register_mixer, register_op,
                                        regression, sample_log_decay, weight_decay)
from fastweight.mechanisms.deltanet import delta_dplr


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    k = l2norm(randn((B, T, H, K), **kw))
    return dict(q=randn((B, T, H, K), **kw), k=k, v=randn((B, T, H, V), **kw),
                p=l2norm(k + 0.5 * randn((B, T, H, K), **kw)) * (0.5 + 0.5 * rand((B, T, H, 1), **kw)),
                g=sample_log_decay((B, T, H), **kw), beta=rand((B, T, H), **kw))


def step(S, x):
    k, beta = x["k"], x["beta"][..., None]
    error = x["v"] - kT_S(x["p"], S)
    return x["g"].exp()[..., None, None] * S + outer(beta * k, error)


def to_dplr(inputs):
    k, beta = inputs["k"], inputs["beta"][..., None]
    return dict(q=inputs["q"], k=beta * k, v=inputs["v"], a=-beta * k, b=inputs["p"], gk=inputs["g"])


def objective(S, x):
    k, p, beta = x["k"], x["p"], x["beta"]
    P = beta[..., None, None] * outer(k, p) / (p * p).sum(-1)[..., None, None]
    return S, [(None, weight_decay(x["g"].exp())), (Preconditioner(P), regression(p, x["v"]))], False


MECHANISM = register(Mechanism(
    name="comba",
    title="Comba",
    paper="arXiv:2506.02475",
    kernel_path="dplr",
    dplr_in_words="w=alpha_t (scalar), a=-beta k, b=p (read key), write (beta k, v)",
    input_names=("q", "k", "v", "p", "g", "beta"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="comba",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], p=x["p"], g=x["g"], beta=x["beta"]),
))


def _dplr(q, k, v, p, g, beta, **_):
    return delta_dplr(q, k, v, beta, gk=g[..., None].expand_as(q).contiguous(), a=p)


def _torch(q, k, v, p, g, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
           chunk_size=64, **_):
    """The read key p meets the undecayed state (fla's naive Comba reads the decayed one)."""
    from fastweight.chunk.delta import delta_chunk
    return delta_chunk(q, k, v, beta, g, read_key=p, read_after_decay=False, scale=scale,
                       initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _triton_chunk(q, k, v, p, g, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                  use_qk_l2norm_in_kernel=False, **_):
    from fastweight.kernels.delta import chunk_delta
    return chunk_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, p=p)


def _triton_fused_recurrent(q, k, v, p, g, beta, use_qk_l2norm_in_kernel=False, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    spec = Spec(low_rank=1, use_p=True, qk_l2norm=use_qk_l2norm_in_kernel)
    return fused_recurrent(q, k, v, spec=spec, p=p, g=g, beta=beta, **kw)


OP = register_op(Op(name="comba", mechanism="comba", args=("q", "k", "v", "p", "g", "beta"), family="delta",
                    gates={"g": "head"}, beta="unit", reference=reference_op(MECHANISM), dplr=_dplr,
                    torch=Impl(_torch), triton_chunk=Impl(_triton_chunk, grouped_heads=True, fused_l2norm=True),
                    triton_fused_recurrent=Impl(_triton_fused_recurrent, grouped_heads=True, fused_l2norm=True)))
register_mixer(Mixer(name="comba", op="comba", layer="delta", options=dict(decay="head", gate="silu", read_key=True)))

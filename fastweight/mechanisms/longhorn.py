"""Longhorn (Liu et al. 2024, arXiv:2407.14207): the implicit (proximal) step on the delta rule's loss.

    S_t = argmin_X 1/2 ||X - S_{t-1}||_F^2 + beta_t/2 ||X^T k_t - v_t||^2
        = (I - eps_t k_t k_t^T) S_{t-1} + eps_t k_t v_t^T,      eps_t = beta_t / (1 + beta_t k_t^T k_t)

The closed form writes ``eps k v^T``, not the seed table's ``beta k v^T`` (docs/objectives.md
derives it; the verifier solves the proximal problem numerically). ``beta`` [B, T, H] > 0 is
one learning rate per head (the paper's per-value-channel beta would give each column of S
its own transition: not one DPLR). DPLR: w = 1, a = -eps k, b = k, write (eps k, v).
"""

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, kT_S, outer, rand, randn, reference_op,
                                        register, register_mixer, register_op, regression)
from fastweight.mechanisms.deltanet import delta_dplr


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), k=randn((B, T, H, K), **kw) * K ** -0.5,
                v=randn((B, T, H, V), **kw), beta=0.1 + 2 * rand((B, T, H), **kw))


def step_size(k, beta):
    """eps = beta / (1 + beta k^T k): [..., K], [...] -> [...]."""
    return beta / (1 + beta * (k * k).sum(-1))


def step(S, x):
    k = x["k"]
    eps = step_size(k, x["beta"])[..., None]
    return S - outer(eps * k, kT_S(k, S) - x["v"])


def to_dplr(inputs):
    k = inputs["k"]
    eps = step_size(k, inputs["beta"])[..., None]
    return dict(q=inputs["q"], k=eps * k, v=inputs["v"], a=-eps * k, b=k, gk=None)


def objective(S, x):
    return S, [(x["beta"][..., None, None], regression(x["k"], x["v"]))], True


MECHANISM = register(Mechanism(
    name="longhorn",
    title="Longhorn",
    paper="arXiv:2407.14207",
    kernel_path="delta",
    dplr_in_words="w=1, a=-eps k, b=k, write (eps k, v), eps=beta/(1+beta k.k)",
    input_names=("q", "k", "v", "beta"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="longhorn",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"]),
))


def _dplr(q, k, v, beta, **_):
    eps = beta / (1 + beta * (k.float() * k.float()).sum(-1)).to(beta.dtype)
    return delta_dplr(q, k, v, eps)


def _torch(q, k, v, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64,
           **_):
    from fastweight.chunk.common import compute_dtype
    from fastweight.chunk.delta import delta_chunk
    dt = compute_dtype(k, beta)
    return delta_chunk(q, k, v, step_size(k.to(dt), beta.to(dt)), scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _triton_chunk(q, k, v, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """The delta rule's kernels with the step eps (its gradient by autograd); k at H heads, beta at HV."""
    from fastweight.kernels.delta import chunk_delta
    kk = (k.float() * k.float()).sum(-1)
    if v.shape[2] != k.shape[2]:
        kk = kk.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    eps = (beta.float() / (1 + beta.float() * kk)).to(beta.dtype)
    return chunk_delta(q, k, v, None, eps, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def _triton_fused_recurrent(q, k, v, beta, use_qk_l2norm_in_kernel=False, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    spec = Spec(low_rank=1, implicit=True, qk_l2norm=use_qk_l2norm_in_kernel)
    return fused_recurrent(q, k, v, spec=spec, beta=beta, **kw)


OP = register_op(Op(name="longhorn", mechanism="longhorn", args=("q", "k", "v", "beta"), family="delta",
                    beta="positive", reference=reference_op(MECHANISM), dplr=_dplr, torch=Impl(_torch),
                    triton_chunk=Impl(_triton_chunk, grouped_heads=True),
                    triton_fused_recurrent=Impl(_triton_fused_recurrent, grouped_heads=True, fused_l2norm=True)))
register_mixer(Mixer(name="longhorn", op="longhorn", layer="delta", options=dict(decay=None, gate=None,
                                                                               implicit=True)))

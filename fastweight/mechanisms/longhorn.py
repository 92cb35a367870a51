"""Longhorn (Liu et al. 2024, arXiv:2407.14207): the implicit (proximal) step on the delta rule's loss.

    S_t = argmin_X 1/2 ||X - S_{t-1}||_F^2 + beta_t/2 ||X^T k_t - v_t||^2
        = (I - eps_t k_t k_t^T) S_{t-1} + eps_t k_t v_t^T,      eps_t = beta_t / (1 + beta_t k_t^T k_t)

The closed form writes ``eps k v^T``, not the seed table's ``beta k v^T`` (docs/objectives.md
derives it; the verifier solves the proximal problem numerically). ``beta`` [B, T, H] > 0 is
one learning rate per head (the paper's per-value-channel beta would give each column of S
its own transition: not one DPLR). DPLR: w = 1, a = -eps k, b = k, write (eps k, v).

``diagonal_step=True`` (the op's flag; the ``longhorn_diagonal`` mixer) is the form of the
released Longhorn code instead: the transition's ``k k^T`` replaced by its diagonal,

    S_t = Diag(1 - eps_t k_t * k_t) S_{t-1} + eps_t k_t v_t^T

a per-key-channel decay (GLA's form with write key ``eps k`` and log gate
``g = log(1 - eps k * k)``), one explicit gradient step with learning rate eps on
``1/2 ||Diag(k) S||_F^2 - <S^T k, v>``. For beta >= 0, ``1 - eps k_i^2 = (1 + beta (k^T k -
k_i^2)) / (1 + beta k^T k)`` lies in (0, 1]: the gate is finite for every key. The default
(``diagonal_step=False``) is the paper's exact step above.
"""

import torch

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, hebbian, kT_S, outer, rand, randn,
                                        reference_op, register, register_mixer, register_op, regression,
                                        weight_decay)
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


def diagonal_gate(k, beta):
    """The released step's log decay g = log(1 - eps k * k) [..., K] and write key eps k, from k
    [..., K] and beta [...] >= 0, as ``log(1 + beta (k^T k - k_i^2)) - log(1 + beta k^T k)``: no
    cancellation in 1 - eps k_i^2 where k_i carries the key's whole norm."""
    kk = k * k
    total = kk.sum(-1, keepdim=True)
    b = beta[..., None]
    g = torch.log1p(b * (total - kk).clamp(min=0)) - torch.log1p(b * total)
    return g.clamp(max=0), b / (1 + b * total) * k


def diagonal_step(S, x):
    k = x["k"]
    eps = step_size(k, x["beta"])[..., None]
    return (1 - eps * k * k)[..., None] * S + outer(eps * k, x["v"])


def diagonal_to_dplr(inputs):
    g, write = diagonal_gate(inputs["k"], inputs["beta"])
    return dict(q=inputs["q"], k=write, v=inputs["v"], a=None, b=None, gk=g)


def diagonal_objective(S, x):
    k = x["k"]
    eps = step_size(k, x["beta"])[..., None, None]
    return S, [(eps, weight_decay(1 - k * k)), (eps, hebbian(k, x["v"]))], False


# The form ``diagonal_step=True`` of the Longhorn op: a variant of MECHANISM, not a registry entry
# (the registry holds one mechanism per op); ``fastweight verify`` checks it in its own row.
DIAGONAL = Mechanism(
    name="longhorn_diagonal",
    title="Longhorn (released diagonal step)",
    paper="arXiv:2407.14207",
    kernel_path="vector_decay",
    dplr_in_words="w=1-eps k*k (vector), a=0, b=0, write (eps k, v), eps=beta/(1+beta k.k)",
    input_names=("q", "k", "v", "beta"),
    sample=sample,
    step=diagonal_step,
    to_dplr=diagonal_to_dplr,
    objective=diagonal_objective,
    op="longhorn",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], diagonal_step=True),
)

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
    variants=(DIAGONAL,),
))


_EXACT_REFERENCE, _DIAGONAL_REFERENCE = reference_op(MECHANISM), reference_op(DIAGONAL)


def _reference(*, diagonal_step=False, **kw):
    return (_DIAGONAL_REFERENCE if diagonal_step else _EXACT_REFERENCE)(**kw)


def _dplr(q, k, v, beta, diagonal_step=False, **_):
    if diagonal_step:
        q, write, g = _diagonal_factors(q, k, v, beta)
        return dict(q=q, k=write, v=v, a=None, b=None, gk=g)
    eps = beta / (1 + beta * (k.float() * k.float()).sum(-1)).to(beta.dtype)
    return delta_dplr(q, k, v, eps)


def _diagonal_factors(q, k, v, beta):
    """The released step as GLA's arguments at the HV value heads: q, write key eps k (k's
    dtype) and the log gate in float32 (float64 for float64 inputs)."""
    from fastweight.chunk.common import compute_dtype
    HV = v.shape[2]
    if HV != k.shape[2]:
        q, k = (x.repeat_interleave(HV // k.shape[2], dim=2) for x in (q, k))
    dt = compute_dtype(k, beta)
    g, write = diagonal_gate(k.to(dt), beta.to(dt))
    return q, write.to(k.dtype), g


def _torch(q, k, v, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64,
           diagonal_step=False, **_):
    from fastweight.chunk.common import compute_dtype
    from fastweight.chunk.decay import decay_chunk
    from fastweight.chunk.delta import delta_chunk
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    if diagonal_step:
        q, write, g = _diagonal_factors(q, k, v, beta)
        return decay_chunk(q, write, v, g, **kw)
    dt = compute_dtype(k, beta)
    return delta_chunk(q, k, v, step_size(k.to(dt), beta.to(dt)), **kw)


def _triton_chunk(q, k, v, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                  diagonal_step=False, **_):
    """The delta rule's kernels with the step eps (its gradient by autograd); k at H heads, beta at HV.
    The released diagonal step: the decay family's kernels (GLA's), the gate formed here."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens)
    if diagonal_step:
        from fastweight.kernels.decay import chunk_decay
        q, write, g = _diagonal_factors(q, k, v, beta)
        return chunk_decay(q, write, v, g, **kw)
    from fastweight.kernels.delta import chunk_delta
    kk = (k.float() * k.float()).sum(-1)
    if v.shape[2] != k.shape[2]:
        kk = kk.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    # eps stays fp32 into the kernels, which read beta in fp32 anyway: rounded to beta's dtype it
    # would round the forward's step and, through autograd, d eps before d beta
    eps = beta.float() / (1 + beta.float() * kk)
    return chunk_delta(q, k, v, None, eps, **kw)


def _triton_fused_recurrent(q, k, v, beta, use_qk_l2norm_in_kernel=False, diagonal_step=False, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    if diagonal_step:
        q, write, g = _diagonal_factors(q, k, v, beta)
        return fused_recurrent(q, write, v, spec=Spec(), gk=g, **kw)
    spec = Spec(low_rank=1, implicit=True, qk_l2norm=use_qk_l2norm_in_kernel)
    return fused_recurrent(q, k, v, spec=spec, beta=beta, **kw)


OP = register_op(Op(name="longhorn", mechanism="longhorn", args=("q", "k", "v", "beta"), family="delta",
                    beta="positive", reference=_reference, dplr=_dplr, torch=Impl(_torch),
                    triton_chunk=Impl(_triton_chunk, grouped_heads=True),
                    triton_fused_recurrent=Impl(_triton_fused_recurrent, grouped_heads=True, fused_l2norm=True),
                    sample_options=dict(diagonal_step=(False, True))))
register_mixer(Mixer(name="longhorn", op="longhorn", layer="delta", options=dict(decay=None, gate=None,
                                                                               implicit=True)))
register_mixer(Mixer(name="longhorn_diagonal", op="longhorn", layer="delta",
                     options=dict(decay=None, gate=None, implicit=True, diagonal_step=True)))

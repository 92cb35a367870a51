"""The generic DPLR recurrence as a mechanism (core names; see ``fastweight.reference.recurrence``).

    S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t)

``a`` is the write direction of the low-rank term, ``b`` is read against the undecayed state;
fla's ``chunk_dplr_delta_rule(q, k, v, a=b, b=a, gk)`` names them the other way round.
Online learning: row-wise weight decay + a step on ``1/2 ||S^T b_t||^2`` preconditioned by
``P = -a_t b_t^T / ||b_t||^2`` + the Hebbian write of (k_t, v_t). No scalar objective exists
unless a is a negative multiple of b (docs/objectives.md).
"""

import torch

from fastweight.mechanisms.base import (Impl, Mechanism, Op, Preconditioner, hebbian, l2norm, outer, rand,
                                        randn, register, register_op, regression, sample_log_decay,
                                        weight_decay)
from fastweight.reference.recurrence import dplr_recurrent, dplr_step


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    b = l2norm(randn((B, T, H, K), **kw))
    return dict(q=randn((B, T, H, K), **kw), k=randn((B, T, H, K), **kw) * K ** -0.5,
                v=randn((B, T, H, V), **kw), a=-b * rand((B, T, H, K), **kw),
                b=b, gk=sample_log_decay((B, T, H, K), **kw))


def to_dplr(inputs):
    return {n: inputs[n] for n in ("q", "k", "v", "a", "b", "gk")}


def objective(S, x):
    a, b = x["a"], x["b"]
    P = -outer(a, b) / (b * b).sum(-1)[..., None, None]
    return S, [(None, weight_decay(x["gk"].exp())),
               (Preconditioner(P), regression(b, torch.zeros_like(x["v"]))),
               (None, hebbian(x["k"], x["v"]))], False


MECHANISM = register(Mechanism(
    name="dplr",
    title="generic DPLR",
    paper="(the core)",
    kernel_path="dplr",
    dplr_in_words="w=exp(gk_t), a_t, b_t, write (k_t, v_t): free",
    input_names=("q", "k", "v", "a", "b", "gk"),
    sample=sample,
    step=dplr_step,
    to_dplr=to_dplr,
    objective=objective,
    op="dplr_delta_rule",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], a=x["b"], b=x["a"], gk=x["gk"]),
))


def _reference(q, k, v, a, b, gk, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """fla's meaning: S_t = (Diag(exp gk) + b a^T) S + k v^T (fla's ``a`` is read against S)."""
    return dplr_recurrent(q, k, v, a=b, b=a, gk=gk, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def _torch(q, k, v, a, b, gk, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
           chunk_size=64, **_):
    """fla's ``a`` is read against the state and ``b`` is the write direction (the core's b, a)."""
    from fastweight.chunk.dplr import dplr_chunk
    return dplr_chunk(q, k, v, a=b, b=a, gk=gk, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _triton_chunk(q, k, v, a, b, gk, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                  launch=None, **_):
    from fastweight.kernels.dplr import DplrLaunch, chunk_dplr
    return chunk_dplr(q, k, v, a, b, gk, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, launch=launch or DplrLaunch())


def _triton_fused_recurrent(q, k, v, a, b, gk, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    return fused_recurrent(q, k, v, spec=Spec(low_rank=2), a=b, b=a, gk=gk, **kw)


OP = register_op(Op(name="dplr_delta_rule", mechanism="dplr", args=("q", "k", "v", "a", "b", "gk"), family="dplr",
                    gates={"gk": "channel"}, reference=_reference, torch=Impl(_torch),
                    triton_chunk=Impl(_triton_chunk), triton_fused_recurrent=Impl(_triton_fused_recurrent)))

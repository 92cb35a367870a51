"""HGRN2 (Qin et al. 2024, arXiv:2404.07904): the forget gate's complement is the key.

    S_t = Diag(alpha_t) S_{t-1} + (1 - alpha_t) v_t^T,    o_t = S_t^T (scale q_t),    alpha_t = exp(g_t)

``g`` [B, T, H, K] log forget gate; there is no separate key. Online learning: the Hebbian
loss ``-<S^T (1 - alpha_t), v_t>`` plus the row-wise weight decay. DPLR: w = alpha_t (vector),
a = b = 0, write (1 - alpha_t, v).
"""

import torch

from fastweight.mechanisms.base import (Mechanism, Mixer, Op, hebbian, outer, randn, reference_op, register,
                                        register_mixer, register_op, sample_log_decay, weight_decay)


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), v=randn((B, T, H, V), **kw),
                g=sample_log_decay((B, T, H, K), **kw))


def step(S, x):
    return x["g"].exp()[..., None] * S + outer(-torch.expm1(x["g"]), x["v"])


def to_dplr(inputs):
    g = inputs["g"]
    return dict(q=inputs["q"], k=-torch.expm1(g), v=inputs["v"], a=None, b=None, gk=g)


def objective(S, x):
    g = x["g"]
    return S, [(None, weight_decay(g.exp())), (None, hebbian(-torch.expm1(g), x["v"]))], False


MECHANISM = register(Mechanism(
    name="hgrn2",
    title="HGRN2",
    paper="arXiv:2404.07904",
    kernel_path="vector_decay",
    dplr_in_words="w=alpha_t (vector), a=0, b=0, write (1 - alpha_t, v)",
    input_names=("q", "v", "g"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="hgrn2",
    to_op=lambda x: dict(q=x["q"], v=x["v"], g=x["g"]),
))


OP = register_op(Op(name="hgrn2", mechanism="hgrn2", args=("q", "v", "g"), family="decay",
                    reference=reference_op(MECHANISM, lambda q, v, g, **_: dict(q=q, v=v, g=g)),
                    dplr=lambda q, v, g, **_: dict(q=q, k=(1 - g.exp()).to(q.dtype), v=v, a=None, b=None, gk=g),
                    gates={"g": "channel"}))
register_mixer(Mixer(name="hgrn2", op="hgrn2", layer="decay"))

"""RWKV-7 "Goose" (Peng et al. 2025, arXiv:2503.14456), with its weight preparation.

The paper keeps the state row-wise, ``wkv`` [V, K], multiplied on the right (Eq. 17):

    kappa_t = k_t * xi                     removal key (xi: per-channel parameter ``_xi`` [H, K])
    kappa^_t = kappa_t / ||kappa_t||        per-head L2 normalisation
    k~_t = k_t * (1 + (a_t - 1) * alpha)   replacement key (``_alpha`` [H, K])
    wkv_t = wkv_{t-1} (Diag(w_t) - kappa^_t^T (a_t * kappa^_t)) + v_t^T k~_t
    o_t = wkv_t (scale r_t)

``q`` is the receptance r, ``w`` [B, T, H, K] the log decay (w_t = exp(w)), ``a`` [B, T, H, K]
the in-context learning rate in (0, 1). ``step`` is that row-wise update, literally; the
state handed around is ``S = wkv^T`` [K, V], so in the column convention

    S_t = (Diag(w_t) - (a_t * kappa^_t) kappa^_t^T) S_{t-1} + k~_t v_t^T

(the learning rate ``a`` sits on the write side; the seed's ``kappa^ (a * kappa^)^T`` is the
transpose: same eigenvalues, other outputs when ``a`` varies across channels).
Online learning: weight decay ``1/2 ||sqrt(Diag(1 - w_t)) S||^2`` + the removal loss
``1/2 ||S^T kappa^_t||^2`` with the *row-wise* learning rate ``a_t`` + the Hebbian write of
(k~_t, v_t). DPLR: w = w_t (vector), a = -(a_t * kappa^), b = kappa^, write (k~, v);
fla's ``chunk_rwkv7(r, w, k~, v, a=-kappa^, b=kappa^ * a_t)``.
"""

import torch

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, get_op, hebbian, l2norm, rand, randn,
                                        register, register_mixer, register_op, regression, weight_decay)


def prepare(inputs):
    """(kappa^, k~) from k, a and the parameters xi, alpha: [B, T, H, K] each (any leading dims)."""
    k, a = inputs["k"], inputs["a"]
    kappa_hat = l2norm(k * inputs["_xi"])
    k_tilde = k * (1 + (a - 1) * inputs["_alpha"])
    return kappa_hat, k_tilde


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), k=randn((B, T, H, K), **kw) * K ** -0.5,
                v=randn((B, T, H, V), **kw),
                w=-0.6065306597126334 * torch.sigmoid(randn((B, T, H, K), **kw)),
                a=torch.sigmoid(randn((B, T, H, K), **kw)),
                _xi=0.5 + rand((H, K), **kw), _alpha=rand((H, K), **kw))


def step(S, x):
    kappa_hat, k_tilde = prepare(x)
    wkv = S.transpose(-1, -2)
    transition = torch.diag_embed(x["w"].exp()) - kappa_hat[..., :, None] * (x["a"] * kappa_hat)[..., None, :]
    wkv = wkv @ transition + x["v"][..., :, None] * k_tilde[..., None, :]
    return wkv.transpose(-1, -2)


def to_dplr(inputs):
    kappa_hat, k_tilde = prepare(inputs)
    return dict(q=inputs["q"], k=k_tilde, v=inputs["v"], a=-(inputs["a"] * kappa_hat), b=kappa_hat,
                gk=inputs["w"])


def to_op(inputs):
    kappa_hat, k_tilde = prepare(inputs)
    return dict(r=inputs["q"], w=inputs["w"], k=k_tilde, v=inputs["v"], a=-kappa_hat, b=kappa_hat * inputs["a"])


def objective(S, x):
    kappa_hat, k_tilde = prepare(x)
    return S, [(None, weight_decay(x["w"].exp())),
               (x["a"][..., None], regression(kappa_hat, torch.zeros_like(x["v"]))),
               (None, hebbian(k_tilde, x["v"]))], False


MECHANISM = register(Mechanism(
    name="rwkv7",
    title="RWKV-7",
    paper="arXiv:2503.14456",
    kernel_path="dplr",
    dplr_in_words="w=exp(w_t) (vector), a=-(a_t * kappa^), b=kappa^, write (k~, v)",
    input_names=("q", "w", "k", "v", "a", "_xi", "_alpha"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="rwkv7",
    to_op=to_op,
))


def _on_dplr(which: str):
    """``dplr_delta_rule``'s implementation ``which`` (an ``Op`` field) with RWKV-7's names: fla's
    chunk_rwkv7 is S_t = (Diag(exp w) + b a^T) S + k v^T, o_t = S_t^T (scale r_t)."""
    def impl(r, w, k, v, a, b, **kw):
        target = getattr(get_op("dplr_delta_rule"), which)
        return (target if which == "reference" else target.fn)(q=r, k=k, v=v, a=a, b=b, gk=w, **kw)
    impl.__name__ = f"rwkv7_{which}"
    return impl


def _dplr(r, w, k, v, a, b, **_):
    return dict(q=r, k=k, v=v, a=a, b=b, gk=w)


OP = register_op(Op(name="rwkv7", mechanism="rwkv7", args=("r", "w", "k", "v", "a", "b"), family="dplr",
                    gates={"w": "channel"}, reference=_on_dplr("reference"), dplr=_dplr,
                    torch=Impl(_on_dplr("torch")), triton_chunk=Impl(_on_dplr("triton_chunk")),
                    triton_fused_recurrent=Impl(_on_dplr("triton_fused_recurrent"))))
register_mixer(Mixer(name="rwkv7", op="rwkv7", layer="rwkv7"))

"""Gated DeltaProduct (Siems et al. 2025, arXiv:2502.10297).

Each token t takes n = ``num_householder`` delta steps j = 0 .. n-1, the gate on the first:

    S_{t,0} = alpha_t S_{t-1},     alpha_t = exp(g_t)
    S_{t,j+1} = (I - beta_{t,j} k_{t,j} k_{t,j}^T) S_{t,j} + beta_{t,j} k_{t,j} v_{t,j}^T
    S_t = S_{t,n},                 o_t = S_t^T (scale q_t)

so the token's transition ``alpha_t prod_j (I - beta_{t,j} k_{t,j} k_{t,j}^T)`` is a product of n
generalised Householder matrices (identity plus rank n), not one DPLR factor: more expressive
state tracking per token at n times the work (n = 1 is Gated DeltaNet).
Online learning: decay, then n SGD steps with learning rates beta_{t,j} on
``1/2 ||S^T k_{t,j} - v_{t,j}||^2``, each at the state the previous one left.
DPLR: Gated DeltaNet over the expanded sequence of T * n steps (``Mechanism.dplr_steps``): step
t*n+j carries (k_{t,j}, v_{t,j}, beta_{t,j}), the gate g_t on j = 0 and 0 (no decay) on the others,
and q_t is read at j = n-1 only.

Layouts. The mechanism's own inputs are per token: q [B, T, H, K], k [B, T, H, n, K],
v [B, T, H, n, V], beta [B, T, H, n], g [B, T, H]. The op's are fla's: k [B, T*n, H, K],
v [B, T*n, HV, V], beta [B, T*n, HV] (token t's substeps at rows t*n ... t*n+n-1), q [B, T, H, K],
g [B, T, HV] (None: no decay); ``cu_seqlens`` counts tokens. Every implementation is a thin map
onto the Gated DeltaNet cores on the expanded sequence: q at the last substep (zeros elsewhere),
g at the first, ``cu_seqlens * n``, and o gathered at each token's last row.
"""

import torch

from fastweight import checks
from fastweight.mechanisms import gated_deltanet as gdn
from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, kT_S, l2norm, outer, rand, randn, register,
                                        register_mixer, register_op, regression)
from fastweight.mechanisms.deltanet import delta_torch, delta_triton_chunk

NUM_HOUSEHOLDER = 2   # the default of sample() and of the mixer (the paper's n_h = 2 .. 4)


def sample(B, T, H, K, V, *, dtype, device, generator, num_householder=NUM_HOUSEHOLDER):
    kw, n = dict(dtype=dtype, device=device, generator=generator), num_householder
    return dict(
        q=randn((B, T, H, K), **kw),
        k=l2norm(randn((B, T, H, n, K), **kw)),
        v=randn((B, T, H, n, V), **kw),
        g=-rand((B, T, H), **kw) * 0.5 - 0.01,
        beta=rand((B, T, H, n), **kw),
    )


def step(S, x):
    """One token: decay, then n delta steps (k [B, H, n, K], v [B, H, n, V], beta [B, H, n])."""
    if x.get("g") is not None:
        S = x["g"].exp()[..., None, None] * S
    for j in range(x["beta"].shape[-1]):
        k, beta = x["k"][:, :, j], x["beta"][:, :, j, None]
        S = S + outer(beta * k, x["v"][:, :, j] - kT_S(k, S))
    return S


def objective(S, x, substep):
    """Substep j: one SGD step with lr beta_{t,j} on the delta rule's loss, after the decay for j = 0."""
    if substep == 0 and x.get("g") is not None:
        S = x["g"].exp()[..., None, None] * S
    lr = x["beta"][:, :, substep, None, None]
    return S, [(lr, regression(x["k"][:, :, substep], x["v"][:, :, substep]))], False


def substeps_first(t: torch.Tensor) -> torch.Tensor:
    """Per-token [B, T, H, n, ...] -> fla's rows [B, T*n, H, ...] (token t's substeps at t*n ...)."""
    return t.transpose(2, 3).flatten(1, 2)


def per_token(t: torch.Tensor, n: int) -> torch.Tensor:
    """fla's rows [B, T*n, H, ...] -> per token [B, T, H, n, ...]."""
    return t.unflatten(1, (-1, n)).transpose(2, 3)


def interleave(q: torch.Tensor, g, n: int):
    """q [B, T, H, K] at each token's last substep and g [B, T, HV] at its first, zeros elsewhere:
    ([B, T*n, H, K], [B, T*n, HV] or None). Zeros in log space are no decay; the zero queries'
    outputs are dropped."""
    if n == 1:
        return q, g
    q_x = torch.cat([q.new_zeros(q.shape[0], q.shape[1], n - 1, *q.shape[2:]), q[:, :, None]], 2).flatten(1, 2)
    if g is None:
        return q_x, None
    g_x = torch.cat([g[:, :, None], g.new_zeros(g.shape[0], g.shape[1], n - 1, *g.shape[2:])], 2).flatten(1, 2)
    return q_x, g_x


def last_substep(o: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T*n, HV, V] -> [B, T, HV, V]: each token's output, read after its last substep."""
    return o if n == 1 else o.unflatten(1, (-1, n))[:, :, -1].contiguous()


def to_dplr(inputs):
    n = inputs["beta"].shape[-1]
    q, g = interleave(inputs["q"], inputs.get("g"), n)
    expanded = dict(q=q, k=substeps_first(inputs["k"]), v=substeps_first(inputs["v"]),
                    beta=substeps_first(inputs["beta"]), g=torch.zeros_like(q[..., 0]) if g is None else g)
    return gdn.to_dplr(expanded)


MECHANISM = register(Mechanism(
    name="gated_deltaproduct",
    title="Gated DeltaProduct",
    paper="arXiv:2502.10297",
    kernel_path="delta",
    dplr_in_words="n GDN steps a token, w=alpha_t on the first (1 after); a=-beta k, b=w k, write (beta k, v)",
    input_names=("q", "k", "v", "g", "beta"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="gated_delta_product",
    to_op=lambda x: dict(q=x["q"], k=substeps_first(x["k"]), v=substeps_first(x["v"]), g=x["g"],
                         beta=substeps_first(x["beta"]), num_householder=x["beta"].shape[-1]),
    dplr_steps=lambda x: x["beta"].shape[-1],
))


def _substeps(q, k, num_householder):
    """n: given, else k's rows per token (for callers of an implementation that skip the op's checks)."""
    return num_householder if num_householder is not None else k.shape[1] // q.shape[1]


def _substep_seqlens(cu_seqlens, n: int):
    """Token offsets -> substep offsets (times n), their host copy handed on (no second device read)."""
    if cu_seqlens is None or n == 1:
        return cu_seqlens
    # one derived tensor per source (``checks.cached_for``), so its host copy and chunk bookkeeping
    # are kept across calls as the source's are
    derived = checks.cached_for(cu_seqlens, _SUBSTEP_CACHE) if checks._cacheable(cu_seqlens) else None
    cu = (derived or {}).get(n)
    if cu is None:
        cu = cu_seqlens * n
        if checks._cacheable(cu_seqlens):
            checks.cache_for(cu_seqlens, _SUBSTEP_CACHE, {**(derived or {}), n: cu})
    checks.provide_host_bounds(cu, [b * n for b in checks.host_bounds(cu_seqlens)])
    return cu


_SUBSTEP_CACHE: dict = {}   # a device cu_seqlens -> {n: its substep offsets}


def _reference(q, k, v, g, beta, num_householder=None, *, scale, initial_state=None, output_final_state=False,
               cu_seqlens=None, **_):
    """The definition: the mechanism's own per-token step (n substeps a token)."""
    n = _substeps(q, k, num_householder)
    x = dict(q=q, k=per_token(k, n), v=per_token(v, n), g=g, beta=per_token(beta, n))
    return MECHANISM.recurrent(x, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                               cu_seqlens=cu_seqlens)


def _on_substeps(core):
    """``core`` (a Gated DeltaNet implementation, keyword arguments) run on the expanded sequence."""
    def impl(q, k, v, g, beta, num_householder=None, *, cu_seqlens=None, **kw):
        n = _substeps(q, k, num_householder)
        q_x, g_x = interleave(q, g, n)
        if g_x is None:   # ungated DeltaProduct: log gate 0
            g_x = beta.new_zeros(beta.shape, dtype=torch.float32 if beta.dtype != torch.float64 else beta.dtype)
        o, S = core(q=q_x, k=k, v=v, g=g_x, beta=beta, cu_seqlens=_substep_seqlens(cu_seqlens, n), **kw)
        return last_substep(o, n), S
    impl.__name__ = impl.__qualname__ = f"gated_delta_product_{core.__name__.lstrip('_')}"
    impl.__doc__ = f"Gated DeltaProduct as ``{core.__name__}`` on the T * num_householder substeps."
    return impl


def _dplr(q, k, v, g, beta, num_householder, **_):
    """The generic DPLR op's arguments on the expanded sequence (``Op.dplr_steps``)."""
    q_x, g_x = interleave(q, g, num_householder)
    return gdn._dplr(q_x, k, v, torch.zeros_like(beta) if g_x is None else g_x, beta)


def sample_op(B, T, H, HV, K, V, *, dtype, device, generator, log_gate=None, num_householder=NUM_HOUSEHOLDER,
              use_qk_l2norm_in_kernel=False, allow_neg_eigval=False, **_):
    """The op's tensors (``Op.sample``): k, v, beta at T * num_householder rows; unit keys unless the
    op normalises them; beta in (0, 1), (0, 2) with allow_neg_eigval."""
    kw, n = dict(dtype=dtype, device=device, generator=generator), num_householder
    k = randn((B, T * n, H, K), **kw)
    if log_gate is None:
        log_gate = lambda shape: -rand(shape, **kw) * 0.5 - 0.01  # noqa: E731
    return dict(q=randn((B, T, H, K), **kw), k=2 * k if use_qk_l2norm_in_kernel else l2norm(k),
                v=randn((B, T * n, HV, V), **kw), g=log_gate((B, T, HV)),
                beta=rand((B, T * n, HV), **kw) * (2.0 if allow_neg_eigval else 1.0))


OP = register_op(Op(name="gated_delta_product", mechanism="gated_deltaproduct", args=("q", "k", "v", "g", "beta"),
                    family="delta", gates={"g": "head"}, beta="unit", reference=_reference, dplr=_dplr,
                    torch=Impl(_on_substeps(delta_torch)),
                    triton_chunk=Impl(_on_substeps(delta_triton_chunk), grouped_heads=True, fused_l2norm=True),
                    triton_fused_recurrent=Impl(_on_substeps(gdn._triton_fused_recurrent), grouped_heads=True,
                                                fused_l2norm=True),
                    dplr_steps="num_householder", sample=sample_op, sample_options=dict(num_householder=(2, 1, 3))))
register_mixer(Mixer(name="gdp", op="gated_delta_product", layer="delta",
                     options=dict(decay="head", gate="silu", num_householder=NUM_HOUSEHOLDER)))

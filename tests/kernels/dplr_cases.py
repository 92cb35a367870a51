"""Inputs and the float64 comparison shared by the DPLR kernel tests (``test_dplr``, ``test_dplr_wy``)."""

import functools

import torch
import torch.nn.functional as F

import fastweight.kernels as kernels
from fastweight import ops
from fastweight.testing import rel_err

# measured: fp32 errors 1e-7..4e-6 (strong decays included); fp16 <= 7e-4
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


W_BOUND = -0.6065306597126334  # RWKV-7's strongest log decay per step, -exp(-0.5)


def inputs(op, T, H=1, K=16, V=32, gen=None, w_scale=1.0, at_bound=False):
    """fla-style RWKV-7 inputs: a = -kappa^ (read), b = kappa^ * iclr (write), log decay w in
    [-0.607 w_scale, 0] (w_scale a float or a [T] tensor of per-token factors), or every w at
    RWKV-7's bound (``at_bound``)."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    kappa = F.normalize(r(1, T, H, K), dim=-1)
    iclr = torch.rand(1, T, H, 1, generator=gen)
    if torch.is_tensor(w_scale):
        w_scale = w_scale.reshape(1, T, 1, 1)
    w = W_BOUND * torch.sigmoid(r(1, T, H, K)) * w_scale
    if at_bound:
        w = torch.full_like(w, W_BOUND)
    q, k, v = r(1, T, H, K), r(1, T, H, K) * K ** -0.5, r(1, T, H, V)
    if op == "rwkv7":
        return dict(r=q, w=w, k=k, v=v, a=-kappa, b=kappa * iclr)
    return dict(q=q, k=k, v=v, a=-kappa, b=kappa * iclr, gk=w)


def check(op, inputs, dtype=torch.float32, initial_state=True, cu_seqlens=None, gen=None, launch=None):
    """``launch``: the Triton side runs ``kernels.chunk_<op>`` with that ``DplrLaunch`` (default: the op)."""
    fn = getattr(ops, f"chunk_{op}")
    if launch is None:
        kernel = functools.partial(fn, backend="triton")
    else:
        kernel = functools.partial(getattr(kernels, f"chunk_{op}"), launch=launch)
    H, V = inputs["v"].shape[2], inputs["v"].shape[3]
    K = inputs["k"].shape[-1]
    N = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    leaves = dict(inputs)
    if initial_state:
        leaves["initial_state"] = torch.randn(N, H, K, V, generator=gen)
    low = {n: x.to(dtype if n not in ("gk", "w", "initial_state") else x.dtype, copy=True).requires_grad_(True)
           for n, x in leaves.items()}
    ref = {n: x.to(torch.float64, copy=True).requires_grad_(True) for n, x in leaves.items()}
    o, ht = kernel(**low, scale=K ** -0.5, output_final_state=True, cu_seqlens=cu_seqlens)
    ro, rht = fn(**ref, scale=K ** -0.5, output_final_state=True, cu_seqlens=cu_seqlens, backend="reference")
    tol = TOL[dtype]
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert rel_err(o, ro) < tol, f"o: {rel_err(o, ro):.3g}"
    assert rel_err(ht, rht) < tol, f"final state: {rel_err(ht, rht):.3g}"
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    torch.autograd.backward([o, ht], [do.to(dtype), dht])
    torch.autograd.backward([ro, rht], [do.double(), dht.double()])
    for n in leaves:
        err = rel_err(low[n].grad, ref[n].grad)
        assert err < tol, f"d{n}: {err:.3g}"

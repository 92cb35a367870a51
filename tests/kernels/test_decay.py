"""The chunked Triton kernels of the decay family (``fastweight.kernels.decay``) against the
float64 definitions.

Runs on CPU under TRITON_INTERPRET=1 (fp32, fp16). Every floating buffer allocated with
``torch.empty``/``torch.empty_like`` during a call is poisoned with NaN, so an element the
kernels fail to write fails the check. Each test calls the public op with ``backend="triton"``
and the same op with ``backend="reference"`` on float64 copies of the inputs, and compares the
output, the final state and the gradient of every input.
"""

import pytest
import torch

from fastweight import ops
from fastweight.kernels import decay, decay_intra
from fastweight.testing import generator, rel_err

# measured: fp32 errors ~1e-6 (gate gradients through the reverse cumulative sum ~3e-6);
# fp16: the rounding of fp16 inputs, outputs and the fp16 per-chunk states (~1e-3)
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _inputs(op, T, H=2, K=16, V=32, gen=None, decay=1.0):
    """Random inputs of ``fastweight.ops.chunk_<op>`` by argument name (B = 1); ``decay`` scales
    the log gates (a float, or a [T] tensor of per-token factors)."""
    if torch.is_tensor(decay):
        decay = decay.reshape(1, T, 1, 1) if op in ("gla", "rwkv6", "hgrn2") else decay.reshape(1, T, 1)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    log_decay = lambda *s: torch.nn.functional.logsigmoid(r(*s) + 2) * decay  # noqa: E731
    q, k, v = r(1, T, H, K), r(1, T, H, K) * K ** -0.5, r(1, T, H, V)
    if op in ("linear_attn", "retention"):
        return dict(q=q, k=k, v=v)
    if op == "simple_gla":
        return dict(q=q, k=k, v=v, g=log_decay(1, T, H), g_gamma=-torch.rand(H, generator=gen) * 0.1)
    if op == "gla":
        return dict(q=q, k=k, v=v, g=log_decay(1, T, H, K))
    if op == "rwkv6":
        return dict(r=q, k=k, v=v, w=log_decay(1, T, H, K), u=r(H, K) * 0.5)
    if op == "hgrn2":
        return dict(q=q, v=v, g=log_decay(1, T, H, K))
    raise ValueError(op)


def _check(op, inputs, dtype=torch.float32, initial_state=True, cu_seqlens=None, grads=True, gen=None, final=True):
    """Run ``chunk_<op>`` on the kernels and on the float64 definition; compare o, final state, grads."""
    fn = getattr(ops, f"chunk_{op}")
    H, V = inputs["v"].shape[2], inputs["v"].shape[3]
    K = next(x for n, x in inputs.items() if n in ("q", "r")).shape[-1]
    N = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.randn(N, H, K, V, generator=gen) if initial_state else None
    leaves = dict(inputs, initial_state=h0) if initial_state else dict(inputs)
    # g_gamma is a fixed decay: not trained, not differentiated
    trained = [n for n in leaves if n != "g_gamma"]
    low = {n: x.to(dtype if n not in ("g", "w", "g_gamma", "initial_state") else x.dtype, copy=True)
           .requires_grad_(grads and n in trained) for n, x in leaves.items()}
    ref = {n: x.to(torch.float64, copy=True).requires_grad_(grads and n in trained) for n, x in leaves.items()}
    o, ht = fn(**low, output_final_state=final, cu_seqlens=cu_seqlens, backend="triton")
    ro, rht = fn(**ref, output_final_state=final, cu_seqlens=cu_seqlens, backend="reference")
    tol = TOL[dtype]
    assert o.dtype == dtype
    assert rel_err(o, ro) < tol, f"o: {rel_err(o, ro):.3g}"
    if final:
        assert ht.dtype == torch.float32
        assert rel_err(ht, rht) < tol, f"final state: {rel_err(ht, rht):.3g}"
    else:
        assert ht is None
    if not grads:
        return
    do = torch.randn(o.shape, generator=gen)
    if final:
        dht = torch.randn(ht.shape, generator=gen)
        torch.autograd.backward([o, ht], [do.to(dtype), dht])
        torch.autograd.backward([ro, rht], [do.double(), dht.double()])
    else:
        o.backward(do.to(dtype))
        ro.backward(do.double())
    for n in trained:
        err = rel_err(low[n].grad, ref[n].grad)
        assert err < tol, f"d{n}: {err:.3g}"


@pytest.mark.parametrize("op", ["linear_attn", "retention", "simple_gla", "gla", "rwkv6", "hgrn2"])
def test_ops_fwd_bwd(op):
    gen = generator()
    _check(op, _inputs(op, 100, gen=gen), gen=gen)


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_states_recomputed(op, monkeypatch):
    """The backward with the chunk states recomputed instead of kept from the forward."""
    monkeypatch.setattr(decay, "RECOMPUTE", True)
    gen = generator()
    _check(op, _inputs(op, 100, gen=gen), gen=gen)


@pytest.mark.parametrize("op", ["simple_gla", "gla", "rwkv6"])
@pytest.mark.parametrize("T", [1, 63])
def test_short_and_odd_lengths(op, T):
    gen = generator()
    _check(op, _inputs(op, T, gen=gen), initial_state=T == 1, gen=gen)


@pytest.mark.parametrize("op", ["simple_gla", "gla", "rwkv6"])
def test_varlen(op):
    gen = generator()
    cu = torch.tensor([0, 1, 37, 37, 130], dtype=torch.int64)
    _check(op, _inputs(op, 130, gen=gen), cu_seqlens=cu, gen=gen)


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_fp16(op):
    gen = generator()
    _check(op, _inputs(op, 100, K=32, V=32, gen=gen), dtype=torch.float16, gen=gen)


def test_wide_head_dims():
    """K = 80, V = 72: several K and V blocks, partial last blocks."""
    gen = generator()
    _check("gla", _inputs("gla", 40, H=1, K=80, V=72, gen=gen), gen=gen)


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_without_final_state(op):
    """No initial state in, no final state out (the backward then has no dS_T term)."""
    gen = generator()
    _check(op, _inputs(op, 63, gen=gen), initial_state=False, final=False, gen=gen)


def _spans(op, x):
    """The gate span of every diagonal sub-chunk (B = 1), as the intra kernels compute it."""
    g = x["w"] if op == "rwkv6" else x["g"]
    return decay_intra.diagonal_spans(g[0], exclusive=op == "rwkv6", BK=16)


@pytest.mark.parametrize("op", ["gla", "rwkv6"])
def test_strong_decay_without_overflow(op):
    """Per-step log decays down to about -40: exp(-g) over a chunk would overflow fp32 (e^2560);
    the sub-chunked decays stay finite and exact. The gates' strength alternates every 16 tokens
    (x20, x0.5), so diagonal sub-chunks take both paths (factored below SAFE_SPAN, token at a
    time above) and the off-diagonal blocks pair strong with weak."""
    gen = generator()
    strength = torch.where((torch.arange(100) // 16) % 2 == 0, 20.0, 0.5)
    x = _inputs(op, 100, gen=gen, decay=strength)
    spans = _spans(op, x)
    assert (spans < decay_intra.SAFE_SPAN).any() and (spans >= decay_intra.SAFE_SPAN).any(), spans.flatten()
    _check(op, x, gen=gen)


@pytest.mark.parametrize("path", ["exact", "factored"])
@pytest.mark.parametrize("op", ["gla", "rwkv6", "hgrn2"])
def test_diagonal_paths(op, path, monkeypatch):
    """Each diagonal sub-chunk path on its own (SAFE_SPAN 0: always token at a time; 1e30: always
    factored), with gates of RWKV-6-like strength (spans up to ~10) and odd T."""
    monkeypatch.setattr(decay_intra, "SAFE_SPAN", 0.0 if path == "exact" else 1e30)
    gen = generator()
    x = _inputs(op, 77, gen=gen, decay=4.0)
    _check(op, x, gen=gen)

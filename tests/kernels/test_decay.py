"""The chunked Triton kernels of the decay family (``fastweight.kernels.decay``) against the
float64 definitions.

Runs on CPU under TRITON_INTERPRET=1 (fp32, fp16). Every floating buffer allocated with
``torch.empty``/``torch.empty_like`` during a call is poisoned with NaN, so an element the
kernels fail to write fails the check. Each test calls the public op with ``backend="triton"``
(a kernel variant: ``fastweight.kernels.chunk_<op>`` with its ``launch``) and the same op
with ``backend="reference"`` on float64 copies of the inputs, and compares the output, the final
state and the gradient of every input.
"""

import functools
import os

import pytest
import torch

import fastweight.kernels as kernels
from fastweight import ops
from fastweight.kernels import decay_intra, decay_output
from fastweight.kernels.common import prepare_chunks
from fastweight.kernels.decay import DecayLaunch
from fastweight.testing import generator, rel_err

# measured: fp32 errors ~1e-6; the gate gradients up to 7e-6 under log decays of -6 per token
# (the fp32 chunk-local cumsum of the gates: its rounding at |G| ~ 400 is the exponents' error);
# fp16: the rounding of fp16 inputs, outputs and the fp16 per-chunk states (~1e-3)
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _inputs(op, T, H=2, K=16, V=32, gen=None, decay=1.0, strength=None):
    """Random inputs of ``fastweight.ops.chunk_<op>`` by argument name (B = 1); ``decay`` scales
    the log gates (a float, or a [T] tensor of per-token factors); ``strength`` instead draws them
    uniformly in [-1.25, -0.75] * strength per token (and g_gamma in [-0.55, -0.45] * strength).
    ``simple_gla_gamma``: simple_gla with g_gamma alone."""
    if torch.is_tensor(decay):
        decay = decay.reshape(1, T, 1, 1) if op in ("gla", "rwkv6", "hgrn2") else decay.reshape(1, T, 1)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if strength is None:
        log_decay = lambda *s: torch.nn.functional.logsigmoid(r(*s) + 2) * decay  # noqa: E731
        g_gamma = -torch.rand(H, generator=gen) * 0.1
    else:
        log_decay = lambda *s: -strength * (0.75 + 0.5 * torch.rand(*s, generator=gen))  # noqa: E731
        g_gamma = -strength * (0.45 + 0.1 * torch.rand(H, generator=gen))
    q, k, v = r(1, T, H, K), r(1, T, H, K) * K ** -0.5, r(1, T, H, V)
    if op in ("linear_attn", "retention"):
        return dict(q=q, k=k, v=v)
    if op == "simple_gla":
        g = log_decay(1, T, H)
        return dict(q=q, k=k, v=v, g=g * 0.5 if strength is not None else g, g_gamma=g_gamma)
    if op == "simple_gla_gamma":
        return dict(q=q, k=k, v=v, g_gamma=g_gamma * 2 if strength is not None else g_gamma)
    if op == "gla":
        return dict(q=q, k=k, v=v, g=log_decay(1, T, H, K))
    if op == "rwkv6":
        return dict(r=q, k=k, v=v, w=log_decay(1, T, H, K), u=r(H, K) * 0.5)
    if op == "hgrn2":
        return dict(q=q, v=v, g=log_decay(1, T, H, K))
    raise ValueError(op)


def _gate_floor(inputs, cu_seqlens, BT=64):
    """The kernels form every decay exp(G_i - G_j) from the fp32 chunk-local cumsum G: each of G_i,
    G_j is rounded to half an ulp of the largest |G| a chunk reaches, so each exponent, and with it
    every term of the gate gradient, carries a relative error up to 2^-23 max|G| (4.6e-5 for a full
    chunk at -6 per token, against the flat fp32 tolerance of 2e-5)."""
    g = next((inputs[n] for n in ("g", "w") if n in inputs), None)
    g = torch.zeros(inputs["v"].shape[:3], dtype=torch.float64) if g is None else g.double()
    if "g_gamma" in inputs:
        g = g + inputs["g_gamma"].double()
    flat = g.reshape(-1, *g.shape[2:]).abs()
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [i * g.shape[1] for i in range(g.shape[0] + 1)]
    decay = max([flat[a + c:min(a + c + BT, b)].sum(0).max().item() for a, b in zip(cu[:-1], cu[1:])
                 for c in range(0, b - a, BT)] + [0.0])
    return 2.0 ** -23 * decay


def _check(op, inputs, dtype=torch.float32, initial_state=True, cu_seqlens=None, grads=True, gen=None, final=True,
           cotangents=None, launch=None, normalize=False):
    """Run ``chunk_<op>`` on the kernels and on the float64 definition; compare o, final state and
    the gradient of every input. ``cotangents(dtype, state_dtype)``: the (do, dS) to pull back,
    either None (no loss on it), built in the dtypes given (any strides); default random.
    ``launch``: the kernels run as ``kernels.chunk_<op>`` with that ``DecayLaunch`` (default: the op)."""
    name = "chunk_simple_gla" if op == "simple_gla_gamma" else f"chunk_{op}"
    fn = getattr(ops, name)
    H, V = inputs["v"].shape[2], inputs["v"].shape[3]
    K = next(x for n, x in inputs.items() if n in ("q", "r")).shape[-1]
    if launch is None:
        kernel = functools.partial(fn, backend="triton")
    else:
        kernel = functools.partial(getattr(kernels, name), scale=K ** -0.5, launch=launch)
    N = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.randn(N, H, K, V, generator=gen) if initial_state else None
    leaves = dict(inputs, initial_state=h0) if initial_state else dict(inputs)
    low = {n: x.to(dtype if n not in ("g", "w", "g_gamma", "initial_state") else x.dtype, copy=True)
           .requires_grad_(grads) for n, x in leaves.items()}
    ref = {n: x.to(torch.float64, copy=True).requires_grad_(grads) for n, x in leaves.items()}
    # the reference with g_gamma alone takes a zero g too: its gradient is the per-token one
    if "g_gamma" in inputs and "g" not in inputs:
        ref["g"] = torch.zeros(inputs["v"].shape[:3], dtype=torch.float64, requires_grad=grads)
    # linear_attn: the kernel alone unless asked (its normaliser is torch code around it, and with
    # zero-mean q, k the normaliser crosses zero, where any rounding is amplified without bound)
    extra = {"normalize": normalize} if op == "linear_attn" else {}
    o, ht = kernel(**low, output_final_state=final, cu_seqlens=cu_seqlens, **extra)
    ro, rht = fn(**ref, output_final_state=final, cu_seqlens=cu_seqlens, backend="reference", **extra)
    tol = TOL[dtype]
    z = rz = None
    if normalize:   # fla's (final state, z_state): z the normaliser's key sum at each sequence's end
        (ht, z), (rht, rz) = ht, rht
        assert rel_err(z, rz) < tol, f"z_state: {rel_err(z, rz):.3g}"
    assert o.dtype == dtype
    assert rel_err(o, ro) < tol, f"o: {rel_err(o, ro):.3g}"
    if final:
        assert ht.dtype == torch.float32
        assert rel_err(ht, rht) < tol, f"final state: {rel_err(ht, rht):.3g}"
    else:
        assert ht is None
    if not grads:
        return
    if cotangents is None:
        do = torch.randn(o.shape, generator=gen)
        dht = torch.randn(ht.shape, generator=gen) if final else None
        cotangents = lambda dt, st: (do.to(dt), None if dht is None else dht.to(st))  # noqa: E731
    dz = torch.randn(z.shape, generator=gen) if z is not None else None
    for outs, cots in (((o, ht, z), (*cotangents(dtype, torch.float32), None if dz is None else dz.to(dtype))),
                       ((ro, rht, rz), (*cotangents(torch.float64, torch.float64), None if dz is None else dz.double()))):
        torch.autograd.backward(*zip(*[(x, c) for x, c in zip(outs, cots) if c is not None]))
    for n in leaves:
        assert low[n].grad is not None, f"d{n}: missing"
        # zero where the loss does not reach the input (q under a loss on the state alone)
        err = rel_err(low[n].grad, ref[n].grad if ref[n].grad is not None else torch.zeros_like(ref[n]))
        scale = 1.0
        if n in ("g", "w", "g_gamma") and dtype == torch.float32:
            scale = _gate_floor(inputs, cu_seqlens) / tol
        if n == "g_gamma":
            # dg_gamma = sum_t dg_t: the per-token error times sum_t |dg_t|, which cancellation makes
            # larger than |dg_gamma| under strong gates (as tests/chunk/chunk_cases.summed_gate_scale)
            scale = max(1.0, (ref["g"].grad.abs().sum((0, 1)).norm() / ref[n].grad.norm()).item())
        assert err < tol * max(1.0, scale), f"d{n}: {err:.3g} (tolerance scaled by {max(1.0, scale):.3g})"


@pytest.mark.parametrize("op", ["linear_attn", "retention", "simple_gla", "gla", "rwkv6", "hgrn2"])
def test_ops_fwd_bwd(op):
    gen = generator()
    _check(op, _inputs(op, 100, gen=gen), gen=gen)


def test_linear_attn_normalized():
    """The op's default normalize=True on positive feature maps (as it is used: the normaliser
    q_t . sum_{s<=t} k_s stays away from zero), varlen included."""
    gen = generator()
    x = {n: torch.nn.functional.softplus(t) if n in ("q", "k") else t
         for n, t in _inputs("linear_attn", 100, gen=gen).items()}
    _check("linear_attn", x, gen=gen, normalize=True, cu_seqlens=torch.tensor([0, 37, 37, 100]))


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_states_recomputed(op):
    """The backward with the chunk states recomputed instead of kept from the forward."""
    gen = generator()
    _check(op, _inputs(op, 100, gen=gen), gen=gen, launch=DecayLaunch(recompute=True))


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


@pytest.mark.parametrize("op, wide", [("gla", False), ("simple_gla", False), ("simple_gla", True),
                                      ("retention", True), ("linear_attn", True)])
def test_wide_head_dims(op, wide, monkeypatch):
    """K = 80, V = 72: partial last blocks; 64-wide K and V blocks, or (``wide``: a scalar gate or none,
    its default in bf16 and fp16, here through the dtype switch in fp32) the dq/dk kernel's one 128-wide key block
    with the scores do v^T formed there and no dA from the dv kernel."""
    monkeypatch.setattr(decay_output, "WIDE_DQK_DTYPES", (torch.float32,) if wide else ())
    gen = generator()
    _check(op, _inputs(op, 40, H=1, K=80, V=72, gen=gen), gen=gen)


@pytest.mark.parametrize("K, V, wide", [(100, 72, True), (100, 72, False), (200, 40, False)])
def test_wide_head_dims_fp16(K, V, wide, monkeypatch):
    """fp16 (split chunk states for the scalar gate's gradient) at K = 100 (one padded 128-wide key block
    in the wide form, two 64-wide ones else) and K = 200 (beyond the wide form: four key blocks, whose
    dg parts are summed)."""
    monkeypatch.setattr(decay_output, "WIDE_DQK_DTYPES", (torch.float16,) if wide else ())
    gen = generator()
    _check("simple_gla", _inputs("simple_gla", 70, H=1, K=K, V=V, gen=gen), dtype=torch.float16, gen=gen)


@pytest.mark.parametrize("op", ["simple_gla", "retention"])
def test_wide_dqk_form_at_small_k(op, monkeypatch):
    """The wide form's kernel at K <= 64 (one 64-wide key block, do v^T formed there; the 16-bit default,
    here through the dtype switch in fp32): K = 48 padded, V = 40, varlen with an empty sequence."""
    monkeypatch.setattr(decay_output, "WIDE_DQK_DTYPES", (torch.float32,))
    gen = generator()
    cu = torch.tensor([0, 1, 37, 37, 130], dtype=torch.int64)
    _check(op, _inputs(op, 130, H=2, K=48, V=40, gen=gen), cu_seqlens=cu, gen=gen)


def test_dqk_register_cap(monkeypatch):
    """The dq/dk launch is capped at ``BWD_DQK_MAXNREG`` registers for bf16 at K <= 64 (timed there) and nowhere
    else; the capped launch (here through the dtype switch in fp32) gives the op's values (K = 48, varlen)."""
    cap = decay_output._dqk_cap
    assert cap(64, torch.bfloat16) == {"maxnreg": decay_output.BWD_DQK_MAXNREG} == cap(16, torch.bfloat16)
    assert cap(128, torch.bfloat16) == {} and cap(64, torch.float16) == {} and cap(64, torch.float32) == {}
    monkeypatch.setattr(decay_output, "BWD_DQK_MAXNREG_DTYPES", (torch.float32,))
    assert cap(48, torch.float32)
    gen = generator()
    cu = torch.tensor([0, 37, 37, 130], dtype=torch.int64)
    _check("simple_gla", _inputs("simple_gla", 130, H=2, K=48, V=40, gen=gen), cu_seqlens=cu, gen=gen)


def test_wide_dqk_policy():
    """The wide form is taken for K <= 128 in bf16 and fp16 (the timed cases) and refused elsewhere; the
    exclusive readout without a per-channel gate's scores is refused by name."""
    for K in (16, 64, 80, 128):
        assert decay_output.wide_dqk(K, torch.bfloat16) and decay_output.wide_dqk(K, torch.float16)
    assert not decay_output.wide_dqk(129, torch.bfloat16) and not decay_output.wide_dqk(256, torch.float16)
    assert not decay_output.wide_dqk(128, torch.float32) and not decay_output.wide_dqk(64, torch.float32)
    x = torch.zeros(1, 64, 1, 64)
    ch = prepare_chunks(None, 1, 64, 64, "cpu")
    with pytest.raises(ValueError, match="exclusive readout needs"):
        decay_output.output_fwd(x, x, x, None, None, torch.zeros(1, 1, 64, 64), None, 1.0, ch, True)
    with pytest.raises(ValueError, match="inclusive readout only"):
        decay_output.bwd_dqk(x, x, x, None, None, torch.zeros(1, 1, 64, 64), torch.zeros(1, 1, 64, 64), x, None,
                             1.0, ch, True)
    with pytest.raises(ValueError, match="wide_dqk"):
        decay_output.bwd_dqk(x, x, x, None, None, torch.zeros(1, 1, 64, 64), torch.zeros(1, 1, 64, 64), x, None,
                             1.0, ch, False)


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
def test_diagonal_paths(op, path):
    """Each diagonal sub-chunk path on its own (span 0: always token at a time; 1e30: always
    factored), with gates of RWKV-6-like strength (spans up to ~10) and odd T."""
    gen = generator()
    x = _inputs(op, 77, gen=gen, decay=4.0)
    _check(op, x, gen=gen, launch=DecayLaunch(span=0.0 if path == "exact" else 1e30))


def _layout(kind, shape, gen):
    """fn(dtype) -> a cotangent of ``shape`` in the given dtype, laid out as ``kind``: expanded
    (stride 0 along the last dim), transposed (a .mT view), sliced (every second element)."""
    if kind == "expanded":
        base = torch.randn(*shape[:-1], 1, generator=gen, dtype=torch.float64)
        return lambda dt: base.to(dt).expand(shape)
    if kind == "transposed":
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen, dtype=torch.float64)
        return lambda dt: base.to(dt).mT
    base = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen, dtype=torch.float64)
    return lambda dt: base.to(dt)[..., ::2]


@pytest.mark.parametrize("kind", ["expanded", "transposed", "sliced", "state_sum"])
@pytest.mark.parametrize("op", ["simple_gla", "gla", "rwkv6"])
def test_cotangent_layouts(op, kind):
    """Cotangents of o and of the final state with any strides (``S.sum()`` hands an expanded one,
    ``S.mT`` losses a transposed one); ``state_sum``: the loss S.sum() on the state alone."""
    gen = generator()
    T, H, K, V = 70, 2, 16, 32
    x = _inputs(op, T, H=H, K=K, V=V, gen=gen)
    if kind == "state_sum":
        cot = lambda dt, st: (None, torch.ones((), dtype=st).expand(1, H, K, V))  # noqa: E731
    else:
        do, dS = _layout(kind, (1, T, H, V), gen), _layout(kind, (1, H, K, V), gen)
        cot = lambda dt, st: (do(dt), dS(st))  # noqa: E731
    assert not any(c.is_contiguous() for c in cot(torch.float32, torch.float32) if c is not None)
    _check(op, x, gen=gen, cotangents=cot)


@pytest.mark.parametrize("op", ["simple_gla", "simple_gla_gamma"])
def test_g_gamma_gradient(op):
    """g_gamma's gradient is the sum over tokens of the per-token gate gradients of its head, with
    and without a data-dependent g (retention's fixed gamma is no input)."""
    gen = generator()
    x = _inputs(op, 100, gen=gen)
    assert "g_gamma" in x
    _check(op, x, gen=gen)


@pytest.mark.parametrize("strength", [3.0, 6.0])
@pytest.mark.parametrize("T", [1, 43, 65])
@pytest.mark.parametrize("op", ["simple_gla", "simple_gla_gamma", "gla", "rwkv6", "hgrn2"])
def test_strong_gates_partial_chunk(op, T, strength):
    """Log decays of about -3 and -6 per token, a partial last chunk: the cumulative decay inside
    a chunk passes e^88 (exp(-G) of it overflows fp32), the padded rows and channels load gates
    of 0; forward and backward must stay finite and match."""
    gen = generator()
    _check(op, _inputs(op, T, gen=gen, strength=strength), gen=gen)


GATE_OPS = ["simple_gla", "simple_gla_gamma", "gla", "rwkv6", "hgrn2"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("strength", [6.0, 3.0, None])
@pytest.mark.parametrize("op", GATE_OPS)
def test_gate_gradient_strong_decay(op, strength, dtype):
    """fla's recipe, (B, T, H, K) = (1, 64, 2, 64): one full chunk, log decays of about -6, -3 per
    token or mild, an initial state and a loss on o and the state. Under strong decay the gate
    gradient is a small sum of large terms (the diagonal pairs, the state's carry) unless it is
    formed per chunk without them (``fastweight.kernels.decay``); measured fp16 2e-4..5e-4,
    fp32 <= 7e-6 (the gates' fp32 cumsum), where the sequence-wide form gave 0.02..0.37 / 3e-4."""
    gen = generator()
    _check(op, _inputs(op, 64, K=64, V=64, gen=gen, strength=strength), dtype=dtype, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["chunks", "varlen"])
@pytest.mark.parametrize("op", GATE_OPS)
def test_gate_gradient_strong_decay_chunks(op, layout, dtype):
    """As above at -6 per token over several chunks and a partial last one (T = 140), or packed
    sequences through cu_seqlens (lengths 30, 0, 70, 40), each with its initial state."""
    gen = generator()
    T, cu = (140, None) if layout == "chunks" else (140, torch.tensor([0, 30, 30, 100, 140]))
    _check(op, _inputs(op, T, K=16, V=32, gen=gen, strength=6.0), dtype=dtype, cu_seqlens=cu, gen=gen)


# fp16, loss on the final state alone (the fuzz's gpu-space case of docs/bench/runs-2026-12-01-s6.md,
# cut to T = 130): with 16-bit chunk states these seeds gave dg_gamma 1.14x and 1.95x the fuzz's
# tolerance (3x the PyTorch path's error); fp32 states with split dots give 0.24 and 0.19. Under the
# summed-parameter floor of session 34 (per-token resolution): the same 1.15x and 1.95x, against 0.24 and 0.19
STATE_ONLY = {"space": "gpu", "op": "simple_gla", "mode": "chunk", "backend": "triton", "dtype": "fp16", "B": 1,
              "H": 2, "HV": 2, "K": 32, "V": 128, "cu_dtype": "int32", "initial_state": True,
              "output_final_state": True, "gate_dtype": "fp16", "scale": None, "options": [["gate_parts", "both"]],
              "do": "none", "dS": "sliced"}


@pytest.mark.parametrize("seed,lengths,gates", [(2, [1, 64, 65], "mixed"), (4, [130], "strong")])
def test_scalar_gate_state_only_loss(seed, lengths, gates):
    """A scalar gate's gradient under a loss on the state alone: its chunk-state term
    exp(G_C) sum h dh is the whole of it, so h and dh are kept in fp32 and the 16-bit dots that
    read them split into two (decay.py)."""
    from fastweight import fuzz
    case = fuzz.Case.from_json(dict(STATE_ONLY, seed=seed, lengths=lengths, T=sum(lengths), gates=gates))
    result = fuzz.check(case)
    assert result.ok, result.line()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="emulate_bf16 patches the interpreter")
@pytest.mark.parametrize("op", ["gla", "rwkv6"])
def test_bf16_dv_against_rounding(op):
    """The per-channel decay's bf16 value gradient with the interpreter computing bf16 and TF32 dots
    as the GPU does (``testing.emulate_bf16``, ``testing.emulate_tf32``): within 1.7x its rounding
    floor (the float64 reference's dv rounded to bf16) at T = 190 (a partial last chunk), K = V = 64.
    ``decay_bwd_dv`` multiplies the fp32 scores at TF32; measured over seeds 1-3: 1.57-1.60x, where
    scores rounded to bf16 give 1.78-1.82x."""
    from fastweight.testing import emulate_bf16, emulate_tf32
    import fastweight.reference.ops as reference
    x = _inputs(op, 190, H=2, K=64, V=64, gen=generator(2))
    low = {n: t.bfloat16() for n, t in x.items()}
    mine = {n: t.clone().requires_grad_() for n, t in low.items()}
    ref = {n: t.double().requires_grad_() for n, t in low.items()}
    o_r, _ = getattr(reference, op)(**ref, scale=64 ** -0.5)
    do = torch.randn(o_r.shape, generator=generator(6), dtype=torch.float64)
    (o_r * do).sum().backward()
    with emulate_bf16(), emulate_tf32():
        o, _ = getattr(kernels, f"chunk_{op}")(**mine, scale=64 ** -0.5)
        (o.float() * do.float()).sum().backward()
    err, floor = rel_err(mine["v"].grad, ref["v"].grad), rel_err(ref["v"].grad.bfloat16(), ref["v"].grad)
    assert err <= 1.7 * floor, f"dv: {err:.3g} against a bf16 rounding floor of {floor:.3g}"


@pytest.mark.parametrize("op", ["linear_attn", "retention", "simple_gla", "simple_gla_gamma", "gla", "hgrn2", "rwkv6"])
@pytest.mark.parametrize("dtype, K, V, how", [(torch.float32, 16, 32, "no_grad"), (torch.float16, 80, 72, "leaves"),
                                              (torch.float32, 128, 16, "no_grad")])
def test_fused_output_without_grad(op, dtype, K, V, how, monkeypatch):
    """``DecayLaunch(fused_output=True)`` without a backward (inputs that require grad under ``no_grad``,
    or grad enabled and no input requiring it, "leaves"): the state pass forms the output and
    stores no chunk states (K up to 128 in one key block, padded at 80; V = 72: a partial V block);
    against float64 with an initial state, the final state, varlen with an empty sequence and a short
    last chunk, strong gates. RWKV-6's exclusive form keeps the output kernel (checked too)."""
    from fastweight.kernels import decay
    calls = []
    real = decay.state_fwd
    monkeypatch.setattr(decay, "state_fwd", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    gen = generator()
    x = _inputs(op, 150, K=K, V=V, gen=gen, decay=4.0)
    op_name = op if op != "simple_gla_gamma" else "simple_gla"
    cu = torch.tensor([0, 70, 70, 150])
    h0 = torch.randn(3, 2, K, V, generator=gen)
    low = {n: t.to(dtype if n not in ("g", "w", "g_gamma") else t.dtype).requires_grad_(how == "no_grad")
           for n, t in x.items()}
    scale = K ** -0.5
    with torch.set_grad_enabled(how != "no_grad"):
        o, ht = getattr(kernels, f"chunk_{op_name}")(**low, scale=scale, initial_state=h0, output_final_state=True,
                                                     cu_seqlens=cu, launch=DecayLaunch(fused_output=True))
    plain = dict(normalize=False) if op == "linear_attn" else {}  # the kernels' linear attention is unnormalised
    ro, rht = getattr(ops, f"chunk_{op_name}")(**{n: t.detach().to(dtype).double() for n, t in x.items()}, scale=scale,
                                               initial_state=h0.double(), output_final_state=True, cu_seqlens=cu,
                                               backend="reference", **plain)
    assert o.dtype == dtype and rel_err(o, ro) < TOL[dtype], f"o: {rel_err(o, ro):.3g}"
    assert rel_err(ht, rht) < TOL[dtype], f"final state: {rel_err(ht, rht):.3g}"
    fused = op != "rwkv6"
    assert [kw.get("fuse_output", False) for kw in calls] == [fused]
    assert [kw.get("store_h", True) for kw in calls] == [not fused]


@pytest.mark.parametrize("op, K, fused", [("simple_gla", 64, True), ("simple_gla", 128, False), ("retention", 32, True),
                                          ("gla", 128, True), ("rwkv6", 64, False), ("gla", 144, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_output_default(op, K, fused, dtype, monkeypatch):
    """The default launch (``fused_output=None``) without a backward, 16-bit inputs: fused for K <= 64 and
    for GLA's per-channel gate up to 128, the output kernel for a scalar gate at K = 128, RWKV-6 and
    K > 128; fp32 inputs keep the output kernel (their exact dots spill in the fused pass). The output
    matches float64 either way."""
    from fastweight.kernels import decay
    calls = []
    real = decay.state_fwd
    monkeypatch.setattr(decay, "state_fwd", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    gen = generator()
    x = _inputs(op, 70, K=K, V=16, gen=gen)
    low = {n: t.to(dtype if n not in ("g", "w", "g_gamma") else t.dtype) for n, t in x.items()}
    with torch.no_grad():
        o, _ = getattr(kernels, f"chunk_{op}")(**low, scale=K ** -0.5)
    ro, _ = getattr(ops, f"chunk_{op}")(**{n: t.double() for n, t in low.items()}, scale=K ** -0.5,
                                        backend="reference")
    assert rel_err(o, ro) < TOL[dtype], f"o: {rel_err(o, ro):.3g}"
    assert [kw.get("fuse_output", False) for kw in calls] == [fused and dtype != torch.float32]
    with pytest.raises(ValueError, match="fused_output"):
        DecayLaunch(fused_output=1)


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_fused_output_with_grad_keeps_the_states(op):
    """With inputs that require grad, ``fused_output`` changes nothing: the states are kept for the
    backward and every gradient matches float64."""
    gen = generator()
    _check(op, _inputs(op, 100, gen=gen), gen=gen, cu_seqlens=torch.tensor([0, 37, 100]),
           launch=DecayLaunch(fused_output=True))


def test_split_states_are_the_wide_states_in_two_planes():
    """``state_dtype="split"`` (a scalar gate's gradient with 16-bit inputs): the forward and backward
    passes store each state as hi = x rounded to fp16 and lo = (x - hi) rounded, x the fp32 state the
    ``state_dtype=float32`` passes store (bit for bit, varlen with an empty sequence, an initial state and
    a final-state cotangent); fp32 inputs and the DPLR forward refuse it by name."""
    from fastweight.kernels.common import prepare_chunks
    from fastweight.kernels.cumsum import chunk_cumsum
    from fastweight.kernels.state import state_bwd, state_fwd
    gen = generator()
    T, H, K, V = 150, 2, 32, 48
    cu = torch.tensor([0, 70, 70, 150])
    chunks = prepare_chunks(cu, 1, T, 64, "cpu")
    x = _inputs("simple_gla", T, H=H, K=K, V=V, gen=gen)
    q, k, v = (x[n].half() for n in ("q", "k", "v"))
    gc = chunk_cumsum(x["g"], chunks, g_gamma=x["g_gamma"], heads=H, length=T)
    h0, dht = torch.randn(3, H, K, V, generator=gen), torch.randn(3, H, K, V, generator=gen)
    do = torch.randn(1, T, H, V, generator=gen).half()
    wide = state_fwd("decay", k, v, chunks, g=gc, initial_state=h0, output_final_state=True, state_dtype=torch.float32)
    split = state_fwd("decay", k, v, chunks, g=gc, initial_state=h0, output_final_state=True, state_dtype="split")
    dwide = state_bwd("decay", q, do, chunks, g=gc, scale=0.3, dht=dht, need_dh0=True, state_dtype=torch.float32)
    dsplit = state_bwd("decay", q, do, chunks, g=gc, scale=0.3, dht=dht, need_dh0=True, state_dtype="split")
    for (w, s) in ((wide[0], split[0]), (dwide[0], dsplit[0])):
        assert s.shape == (2, *w.shape) and s.dtype == torch.float16
        hi = w.half()
        assert torch.equal(s[0], hi) and torch.equal(s[1], (w - hi.float()).half())
    assert torch.equal(wide[3], split[3]) and torch.equal(dwide[2], dsplit[2])
    with pytest.raises(ValueError, match="state_dtype"):
        state_fwd("decay", k.float(), v.float(), chunks, g=gc, state_dtype="split")
    with pytest.raises(ValueError, match="state_dtype"):
        state_bwd("decay", q, do, chunks, g=gc, state_dtype="wide")
    with pytest.raises(ValueError, match="split"):
        state_fwd("dplr", k, v, chunks, g=gc, state_dtype="split")

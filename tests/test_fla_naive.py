"""Our ops against fla 0.6.0's own reference code (``fla.ops.*.naive``), called as fla's tests call fla's ops:
positional (fla's argument order and defaults, read from fla's signature) and by keyword (a scale other than the
default), an initial state, varlen batches through ``cu_seqlens`` (against the reference run per sequence, an empty
and a one-token sequence among them), the output, the final state and every gradient (q, k, v, the gates, beta, the
other per-token inputs, u, the initial state). Both fla's chunk_ and fused_recurrent_ forms (their signatures
differ; on the CPU, in float64, both run our PyTorch chunk path). Ours run in float64, fla's references in float32
(their dtype).
Runs where fla-core 0.6.0 is importable (``pip install -e ".[compat]"``, which CI installs; its references run on
the CPU); the signatures are also checked from recorded data (tests/test_fla_compat.py).

Covered: every op both libraries have that fla has a reference for: linear_attn (normalized or not), retention
(``naive_retention``; with a state, as fla's chunk_retention defines it: simple_gla at RetNet's decays), simple_gla,
gla, rwkv6 (``naive_recurrent_rwkv6``), delta_rule, gated_delta_rule, gated_delta_product, kda, comba (its chunk
reference: see ``_comba``), dplr_delta_rule and rwkv7 (fla's rwkv7 ops are its DPLR ops with gk = w, so
``dplr_recurrence``). fla has no HGRN-2 or Longhorn op; its ``naive_recurrent_hgrn`` is HGRN-1 (no state matrix: ``test_hgrn_against_fla_reference``).
"""

import inspect
from unittest import mock
from importlib import import_module
from typing import Callable, NamedTuple

import pytest
import torch

from fastweight import ops
from fastweight.mechanisms.retnet import retnet_log_gamma
from fastweight.testing import rel_err

pytest.importorskip("fla.ops")

B, T, H, K, V = 2, 37, 2, 16, 16
ROWS = 2              # DeltaProduct's num_householder: k, v, beta at T * ROWS rows
CU_SEQLENS = [0, 15, 16, 16, 50, 63]
SCALE = 0.3           # the keyword form's scale (fla's default in the positional form)
# fla's references run in float32, ours in float64: measured 3.8e-8 to 6.9e-7 (the largest: Comba's final state,
# through its chunk reference; 1.0e-6 on Comba's dp with other draws)
TOL = 5e-6


def _draw(B, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    k, beta = unit(r(B, T, H, K)), u(B, T, H)
    x = dict(q=r(B, T, H, K), k=k, v=r(B, T, H, V), g=-u(B, T, H), gk=-u(B, T, H, K) * 0.5, beta=beta,
             p=unit(k + 0.3 * r(B, T, H, K)), u=r(H, K),
             # positive features (elu + 1, Katharopoulos et al.) for the normalized linear attention: a
             # normaliser near 0 would amplify fp32's rounding in fla's reference
             q_pos=torch.nn.functional.elu(r(B, T, H, K)) + 1, k_pos=torch.nn.functional.elu(r(B, T, H, K)) + 1,
             # DPLR with fla's meaning of (a, b): S <- (Diag(exp gk) + b a^T) S + k v^T; a = -k, b = beta k
             # (DeltaNet-like)
             a=-k, b=k * beta[..., None], g_gamma=retnet_log_gamma(H, torch.float64),
             k_rows=unit(r(B, T * ROWS, H, K)), v_rows=r(B, T * ROWS, H, V), beta_rows=u(B, T * ROWS, H))
    return x, r(len(CU_SEQLENS) - 1 if B == 1 else B, H, K, V)


def _scaled(x, scale):
    """q for a reference with K^-0.5 built in, so that it computes with ``scale``."""
    return x * (scale * x.shape[-1] ** 0.5)


def _head_first(*xs):
    return [x.transpose(1, 2) for x in xs]


def _o_seq_first(o, S):
    return o.transpose(1, 2), S


def _linear_attn(x, h0, scale, normalize=False):
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
    o, S = naive_recurrent_linear_attn(x["q"], x["k"], x["v"], scale=scale, initial_state=h0, output_final_state=True,
                                       normalize=normalize)
    if normalize and S[1].shape[1] == 0:   # an empty sequence: fla's naive z is k_cum[:, -1:] of nothing
        S = (S[0], S[1].new_zeros(S[1].shape[0], 1, *S[1].shape[2:]))
    return o, _state(S)


def _state(S):
    """The final state as one tensor: the normalised linear attention's (S, z_state) as S with z [N, 1, H, K]
    appended as one more value column (both libraries return the pair)."""
    return torch.cat([S[0], S[1].squeeze(1)[..., None].to(S[0].dtype)], dim=-1) if isinstance(S, tuple) else S


def _retention(x, h0, scale):
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
    g = retnet_log_gamma(H).expand(*x["q"].shape[:3])  # fla's chunk_retention: simple_gla with g_gamma at these
    return naive_recurrent_simple_gla(x["q"], x["k"], x["v"], g, scale=scale, initial_state=h0,
                                      output_final_state=True)


def _simple_gla(x, h0, scale):
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
    g = x["g"] + x["g_gamma"] if "g_gamma" in x else x["g"]   # fla's chunk_simple_gla: g_gamma adds to g
    return naive_recurrent_simple_gla(x["q"], x["k"], x["v"], g, scale=scale, initial_state=h0,
                                      output_final_state=True)


def _gla(x, h0, scale):
    from fla.ops.gla.naive import naive_recurrent_gla
    return naive_recurrent_gla(_scaled(x["q"], scale), x["k"], x["v"], x["g"], initial_state=h0,
                               output_final_state=True)


def _rwkv6(x, h0, scale):
    from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6
    return _o_seq_first(*naive_recurrent_rwkv6(*_head_first(x["r"], x["k"], x["v"], x["w"]), x["u"], scale=scale,
                                               initial_state=h0, output_final_state=True))


def _delta_rule(x, h0, scale):
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    return _o_seq_first(*delta_rule_recurrence(*_head_first(_scaled(x["q"], scale), x["k"], x["v"], x["beta"]),
                                               initial_state=h0, output_final_state=True))


def _gated_delta_rule(x, h0, scale):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    return naive_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"], scale=scale, initial_state=h0,
                                            output_final_state=True)


def _gated_delta_product(x, h0, scale):
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
    return naive_recurrent_gated_delta_product(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, initial_state=h0,
                                               output_final_state=True, num_householder=ROWS)


def _kda(x, h0, scale):
    from fla.ops.kda.naive import naive_recurrent_kda
    return naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=h0,
                               output_final_state=True)


def _comba(x, h0, scale):
    # fla's chunk reference and its kernels (chunk and fused recurrent: b_v -= h p before h *= exp(g)) read the
    # state with p before the decay, as the paper's alpha_t I - beta_t k_t p_t^T; naive_recurrent_comba decays
    # first (p reads alpha_t S_{t-1}) and differs from both (rel 0.08 on o here)
    from fla.ops.comba.naive import naive_chunk_comba
    return naive_chunk_comba(x["q"], x["k"], x["v"], x["p"], x["g"], x["beta"], scale=scale, initial_state=h0,
                             output_final_state=True)


def _iplr(x, h0, scale):
    from fla.ops.generalized_delta_rule.iplr.naive import iplr_recurrence
    return _o_seq_first(*iplr_recurrence(*_head_first(_scaled(x["q"], scale), x["k"], x["v"], x["a"], x["b"]),
                                         initial_state=h0, output_final_state=True))


LAYER_IDX, NUM_LAYERS = 1, 4    # lightning attention's decays depend on the layer's place


def _lightning_attn(x, h0, scale):
    """fla's own chunk_lightning_attn (its decay rule), its simple_gla call sent to fla's naive recurrence (the
    kernel it calls needs a GPU)."""
    import fla.ops.lightning_attn.chunk as lightning
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    def naive(q, k, v, scale, g_gamma, initial_state, output_final_state, cu_seqlens, chunk_size):
        return naive_recurrent_simple_gla(q, k, v, g_gamma.expand(*q.shape[:3]), scale=scale,
                                          initial_state=initial_state, output_final_state=True)
    with mock.patch.object(lightning, "chunk_simple_gla", naive):
        return lightning.chunk_lightning_attn(x["q"], x["k"], x["v"], LAYER_IDX, NUM_LAYERS, scale=scale,
                                              initial_state=h0, output_final_state=True)


def _dplr(q, x, h0, scale):
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
    return _o_seq_first(*dplr_recurrence(*_head_first(_scaled(q, scale), x["k"], x["v"], x["a"], x["b"], x["gk"]),
                                         initial_state=h0, output_final_state=True))


class Case(NamedTuple):
    op: str                 # ours: fastweight.ops.{chunk,fused_recurrent}_<op>; fla's: fla.ops.<package>
    package: str
    inputs: dict            # fla's argument name -> the drawn tensor
    reference: Callable     # (inputs by fla's name, float32; initial state; scale) -> (o, final state)
    options: dict = {}      # fla's non-tensor arguments
    rows: tuple = ()        # the inputs with ROWS rows a token
    constants: tuple = ()   # inputs without a gradient (fla returns none for them)
    variant: str = ""       # the test id's suffix where an op has several cases


_QKV = dict(q="q", k="k", v="v")
CASES = {c.op + (c.variant and "-" + c.variant): c for c in [
    Case("linear_attn", "linear_attn", _QKV, _linear_attn, dict(normalize=False)),
    Case("linear_attn", "linear_attn", dict(q="q_pos", k="k_pos", v="v"),
         lambda x, h0, s: _linear_attn(x, h0, s, normalize=True), dict(normalize=True), variant="normalize"),
    Case("retention", "retention", _QKV, _retention),
    Case("simple_gla", "simple_gla", {**_QKV, "g": "g"}, _simple_gla),
    Case("simple_gla", "simple_gla", {**_QKV, "g": "g", "g_gamma": "g_gamma"}, _simple_gla, constants=("g_gamma",),
         variant="g_gamma"),
    Case("gla", "gla", {**_QKV, "g": "gk"}, _gla),
    Case("rwkv6", "rwkv6", dict(r="q", k="k", v="v", w="gk", u="u"), _rwkv6),
    Case("delta_rule", "delta_rule", {**_QKV, "beta": "beta"}, _delta_rule),
    Case("gated_delta_rule", "gated_delta_rule", {**_QKV, "g": "g", "beta": "beta"}, _gated_delta_rule),
    Case("gated_delta_product", "gated_delta_product",
         dict(q="q", k="k_rows", v="v_rows", g="g", beta="beta_rows"), _gated_delta_product,
         dict(num_householder=ROWS), rows=("k", "v", "beta")),
    Case("kda", "kda", {**_QKV, "g": "gk", "beta": "beta"}, _kda),
    Case("comba", "comba", {**_QKV, "p": "p", "g": "g", "beta": "beta"}, _comba),
    Case("dplr_delta_rule", "generalized_delta_rule", {**_QKV, "a": "a", "b": "b", "gk": "gk"},
         lambda x, h0, s: _dplr(x["q"], x, h0, s)),
    Case("rwkv7", "rwkv7", dict(r="q", w="gk", k="k", v="v", a="a", b="b"),
         lambda x, h0, s: _dplr(x["r"], {**x, "gk": x["w"]}, h0, s)),
    Case("iplr_delta_rule", "generalized_delta_rule", {**_QKV, "a": "a", "b": "b"}, _iplr),
    Case("lightning_attn", "lightning_attn", _QKV, _lightning_attn, dict(layer_idx=LAYER_IDX, num_layers=NUM_LAYERS)),
]}
# fla's fused_chunk forms that compute (fused_chunk_gla and fused_chunk_delta_rule only raise in fla 0.6.0)
_FUSED_CHUNK = ("linear_attn", "linear_attn-normalize", "retention", "simple_gla", "simple_gla-g_gamma")
# fla's names where fused_recurrent's differ from chunk's
_FUSED_NAMES = {"gla": {"g": "gk"}}


def _fla_op(case, mode):
    return getattr(import_module(f"fla.ops.{case.package}"), f"{mode}_{case.op}", None)


def _modes(name):
    modes = ("chunk", "fused_recurrent") + (("fused_chunk",) if name in _FUSED_CHUNK else ())
    return [pytest.param(name, m, id=f"{name}-{m}") for m in modes
            if _fla_op(CASES[name], m) is not None]   # fla has no fused_recurrent_gated_delta_product


def _call(case, mode, form, x, h0, cu_seqlens=None):
    """Our op called as fla's tests call fla's: the tensors positionally in fla's order (fla's defaults for the
    optional arguments between them, fla's default scale) or by keyword with SCALE; the other arguments by
    keyword. Returns (o, final state, the scale used)."""
    ours, fla = getattr(ops, f"{mode}_{case.op}"), _fla_op(case, mode)
    rename = _FUSED_NAMES.get(case.op, {}) if mode == "fused_recurrent" else {}
    tensors = {rename.get(n, n): x[n] for n in case.inputs}
    rest = dict(**case.options, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    if form == "keyword":
        o, S = ours(**tensors, scale=SCALE, **rest)
        return o, _state(S), SCALE
    params = inspect.signature(fla).parameters
    names = list(params)[:max(list(params).index(n) for n in tensors) + 1]
    o, S = ours(*[tensors[n] if n in tensors else params[n].default for n in names], **rest)
    scale = params["scale"].default
    return o, _state(S), K ** -0.5 if scale is None else scale


def _leaves(case, x):
    return {n: x[d].clone().requires_grad_(n not in case.constants) for n, d in case.inputs.items()}


def _errors(leaves, h0, ours, theirs):
    """rel_err of o, the final state and each gradient (a random cotangent on o and on the final state)."""
    (o, S), (o_f, S_f) = ours, theirs
    gen = torch.Generator().manual_seed(1)
    do, dS = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, S))
    wrt = {n: t for n, t in leaves.items() if t.requires_grad} | {"initial_state": h0}
    mine = torch.autograd.grad((o * do).sum() + (S * dS).sum(), [*wrt.values()])
    ref = torch.autograd.grad((o_f.double() * do).sum() + (S_f.double() * dS).sum(), [*wrt.values()])
    return {"o": rel_err(o, o_f), "final_state": rel_err(S, S_f),
            **{f"d{n}": rel_err(a, b) for n, a, b in zip(wrt, mine, ref)}}


def _assert_close(case, leaves, h0, ours, theirs):
    errors = _errors(leaves, h0, ours, theirs)
    assert max(errors.values()) < TOL, f"{case.op}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())


@pytest.mark.parametrize("form", ["positional", "keyword"])
@pytest.mark.parametrize("name,mode", [p for name in CASES for p in _modes(name)])
def test_op_against_fla_reference(name, mode, form):
    case = CASES[name]
    x, h0 = _draw(B, T)
    leaves, h0 = _leaves(case, x), h0.requires_grad_()
    o, S, scale = _call(case, mode, form, leaves, h0)
    ref = case.reference({n: t.float() for n, t in leaves.items()}, h0.float(), scale)
    _assert_close(case, leaves, h0, (o, S), ref)


@pytest.mark.parametrize("name,mode", [p for name in CASES for p in _modes(name)])
def test_varlen_against_fla_reference_per_sequence(name, mode):
    """One packed batch (B = 1, ``cu_seqlens``) against fla's reference run on each sequence alone."""
    case = CASES[name]
    x, h0 = _draw(1, CU_SEQLENS[-1], seed=2)
    leaves, h0 = _leaves(case, x), h0.requires_grad_()
    o, S, scale = _call(case, mode, "keyword", leaves, h0, cu_seqlens=torch.tensor(CU_SEQLENS))
    outs, states = [], []
    for i, (bos, eos) in enumerate(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])):
        # per token: [B, T, ...]; u and g_gamma are per head
        per = {n: (t[:, bos * ROWS:eos * ROWS] if n in case.rows else t[:, bos:eos] if t.dim() > 2 else t).float()
               for n, t in leaves.items()}
        o_i, S_i = case.reference(per, h0[i:i + 1].float(), scale)
        outs.append(o_i)
        states.append(S_i)
    _assert_close(case, leaves, h0, (o, S), (torch.cat(outs, dim=1), torch.cat(states)))


def test_retention_is_fla_naive_retention():
    """fla's own retention reference (no state): pins RetNet's decays that ``_retention`` takes from us."""
    from fla.ops.retention.naive import naive_retention
    x, _ = _draw(B, T)
    leaves = {n: x[n].clone().requires_grad_() for n in "qkv"}
    o, _ = ops.chunk_retention(*leaves.values())
    o_f = naive_retention(*_head_first(*(t.float() for t in leaves.values()))).transpose(1, 2)
    assert rel_err(o, o_f) < TOL
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for n, a, b in zip("qkv", torch.autograd.grad((o * do).sum(), [*leaves.values()]),
                       torch.autograd.grad((o_f.double() * do).sum(), [*leaves.values()])):
        assert rel_err(a, b) < TOL, f"d{n} {rel_err(a, b):.2e}"


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_hgrn_against_fla_reference(mode):
    """HGRN-1 (fla's ``naive_recurrent_hgrn``: no state matrix, [B, T, D]), positional as fla's tests call it."""
    from fla.ops.hgrn.naive import naive_recurrent_hgrn
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, 24, generator=gen, dtype=torch.float64).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, 24, generator=gen, dtype=torch.float64)).requires_grad_()
    h0 = torch.randn(B, 24, generator=gen, dtype=torch.float64).requires_grad_()
    o, S = getattr(ops, f"{mode}_hgrn")(x, g, h0, True)
    o_f, S_f = naive_recurrent_hgrn(x.float(), g.float(), h0.float(), True)
    errors = _errors({"x": x, "g": g}, h0, (o, S), (o_f, S_f))
    assert max(errors.values()) < TOL, ", ".join(f"{n} {e:.2e}" for n, e in errors.items())


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_hgrn_varlen_against_fla_reference_per_sequence(mode):
    """HGRN-1 on one packed batch (``cu_seqlens``: fla's fused_recurrent_hgrn takes it; ours also on chunk_hgrn, as a
    keyword), by keyword, against fla's ``naive_recurrent_hgrn`` run on each sequence alone (an empty and a
    one-token sequence among them): o, the final states and every gradient."""
    from fla.ops.hgrn.naive import naive_recurrent_hgrn
    gen = torch.Generator().manual_seed(4)
    D, N = 24, len(CU_SEQLENS) - 1
    x = torch.randn(1, CU_SEQLENS[-1], D, generator=gen, dtype=torch.float64).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(1, CU_SEQLENS[-1], D, generator=gen, dtype=torch.float64))
    g = g.requires_grad_()
    h0 = torch.randn(N, D, generator=gen, dtype=torch.float64).requires_grad_()
    o, S = getattr(ops, f"{mode}_hgrn")(x=x, g=g, initial_state=h0, output_final_state=True,
                                        cu_seqlens=torch.tensor(CU_SEQLENS))
    outs, states = [], []
    for i, (bos, eos) in enumerate(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])):
        o_i, S_i = naive_recurrent_hgrn(x[:, bos:eos].float(), g[:, bos:eos].float(), h0[i:i + 1].float(), True)
        outs.append(o_i)
        states.append(S_i)
    errors = _errors({"x": x, "g": g}, h0, (o, S), (torch.cat(outs, 1), torch.cat(states)))
    assert max(errors.values()) < TOL, ", ".join(f"{n} {e:.2e}" for n, e in errors.items())


@pytest.mark.parametrize("op", ["simple_gla", "retention"])
def test_parallel_against_fla_reference(op):
    """fla's parallel forms return (o, the causal decayed scores [B, H, T, T] with ``output_attentions``): ours
    against fla's ``naive_parallel_simple_gla`` (retention: at RetNet's decays, as fla's parallel_retention
    calls it), o, the scores and the gradients through both."""
    from fla.ops.simple_gla.naive import naive_parallel_simple_gla
    x, _ = _draw(B, T)
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g")}
    if op == "simple_gla":
        o, A = ops.parallel_simple_gla(*leaves.values(), scale=SCALE, output_attentions=True)
        g = leaves["g"]
    else:
        leaves.pop("g")
        o, A = ops.parallel_retention(*leaves.values(), scale=SCALE, output_attentions=True)
        g = retnet_log_gamma(H, torch.float64).expand(B, T, H)
    o_f, A_f = naive_parallel_simple_gla(*(t.float() for t in (leaves["q"], leaves["k"], leaves["v"], g)), scale=SCALE)
    assert rel_err(o, o_f) < TOL and rel_err(A, A_f) < TOL
    assert ops.__dict__[f"parallel_{op}"](*leaves.values(), scale=SCALE)[1] is None
    gen = torch.Generator().manual_seed(1)
    do, dA = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, A))
    mine = torch.autograd.grad((o * do).sum() + (A * dA).sum(), [*leaves.values()])
    ref = torch.autograd.grad((o_f.double() * do).sum() + (A_f.double() * dA).sum(), [*leaves.values()])
    for n, a, b in zip(leaves, mine, ref):
        assert rel_err(a, b) < TOL, f"d{n} {rel_err(a, b):.2e}"

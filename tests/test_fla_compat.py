"""fla 0.6.0 parity of the public ops: signatures against the recorded data, and fla's options."""

import inspect
import itertools
import json
import os
import warnings

import pytest
import torch

from fastweight import checks, ops
from fastweight.ops.decay import lightning_log_gamma
from fastweight.testing import rel_err

FLA = json.load(open(os.path.join(os.path.dirname(__file__), "data", "fla_0.6.0_ops.json")))["ops"]
B, T, H, K, V = 1, 21, 2, 8, 8


def _default(src):
    return inspect.Parameter.empty if src is None else eval(src)  # noqa: S307  (fla's literal defaults)


@pytest.mark.parametrize("name", sorted(FLA))
def test_signature_is_fla(name):
    """fla's parameters, in fla's order, with fla's defaults; ours beyond them are keyword-only; **kwargs
    where fla has them (fla reads options from them)."""
    params = list(inspect.signature(getattr(ops, name)).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == [(n, _default(d)) for n, d in FLA[name]["params"]]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params[len(positional):])
    assert any(p.kind == p.VAR_KEYWORD for p in params) == FLA[name]["kwargs"]


def _x(gen=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(gen)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    return dict(q=r(B, T, H, K), k=k, v=r(B, T, H, V), g=-torch.rand(B, T, H, generator=g, dtype=dtype),
                gk=-torch.rand(B, T, H, K, generator=g, dtype=dtype), beta=torch.rand(B, T, H, generator=g, dtype=dtype),
                p=0.5 * k, h0=r(B, H, K, V), braw=r(B, T, H))


def test_comba_argument_orders():
    x = _x()
    want, _ = ops.chunk_comba(x["q"], x["k"], x["v"], x["p"], x["g"], x["beta"], backend="reference")
    got, _ = ops.fused_recurrent_comba(x["q"], x["k"], x["p"], x["v"], x["g"], x["beta"], backend="reference")
    assert rel_err(got, want) < 1e-12
    ones, _ = ops.chunk_comba(x["q"], x["k"], x["v"], x["p"], x["g"], backend="reference")
    assert rel_err(ones, ops.chunk_comba(x["q"], x["k"], x["v"], x["p"], x["g"], torch.ones_like(x["beta"]),
                                         backend="reference")[0]) < 1e-12


def test_fla_defaults():
    x = _x()
    o, _ = ops.chunk_linear_attn(x["q"], x["k"], x["v"], backend="reference")
    assert rel_err(o, ops.chunk_linear_attn(x["q"], x["k"], x["v"], normalize=True, backend="reference")[0]) == 0
    o, _ = ops.fused_recurrent_linear_attn(x["q"], x["k"], x["v"], backend="reference")
    assert rel_err(o, ops.chunk_linear_attn(x["q"], x["k"], x["v"], normalize=False, backend="reference")[0]) < 1e-12
    w, a, b = x["gk"], -x["k"], x["k"] * 0.5
    o, S = ops.fused_recurrent_rwkv7(x["q"], w, x["k"], x["v"], a, b, backend="reference")
    o2, S2 = ops.chunk_rwkv7(x["q"], w, x["k"], x["v"], a, b, scale=K ** -0.5, output_final_state=True,
                             backend="reference")
    assert S is not None and rel_err(o, o2) < 1e-12 and rel_err(S, S2) < 1e-12


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_state_v_first(backend):
    x = _x()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, S = ops.chunk_gated_delta_rule(*args, initial_state=x["h0"], output_final_state=True, backend=backend)
    o2, S2 = ops.chunk_gated_delta_rule(*args, initial_state=x["h0"].mT.contiguous(), output_final_state=True,
                                        state_v_first=True, backend=backend)
    assert rel_err(o2, o) < 1e-12 and S2.shape == (B, H, V, K) and rel_err(S2.mT, S) < 1e-12
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o3, S3 = ops.chunk_gated_delta_rule(*args, initial_state=x["h0"].mT, output_final_state=True,
                                            transpose_state_layout=True, backend=backend)
    assert rel_err(S3, S2) < 1e-12
    for fn in (ops.chunk_simple_gla, ops.fused_recurrent_simple_gla):
        o, S = fn(x["q"], x["k"], x["v"], x["g"], initial_state=x["h0"], output_final_state=True, backend=backend)
        o2, S2 = fn(x["q"], x["k"], x["v"], x["g"], initial_state=x["h0"].mT, output_final_state=True,
                    state_v_first=True, backend=backend)
        assert rel_err(o2, o) < 1e-12 and rel_err(S2.mT, S) < 1e-12


@pytest.mark.parametrize("neg", [False, True])
def test_beta_sigmoid_in_kernel(neg):
    x = _x()
    braw = x["braw"].clone().requires_grad_()
    beta = torch.sigmoid(x["braw"]) * (2 if neg else 1)
    for fn, gate in ((ops.chunk_gated_delta_rule, x["g"]), (ops.chunk_kda, x["gk"]),
                     (ops.fused_recurrent_kda, x["gk"])):
        want, _ = fn(x["q"], x["k"], x["v"], gate, beta, allow_neg_eigval=neg, backend="torch")
        got, _ = fn(x["q"], x["k"], x["v"], gate, braw, allow_neg_eigval=neg, use_beta_sigmoid_in_kernel=True,
                    backend="torch")
        assert rel_err(got, want) < 1e-12
    got.sum().backward()
    assert braw.grad.abs().sum() > 0


def test_fused_gated_delta_rule_gk_is_kda():
    x = _x()
    want, _ = ops.fused_recurrent_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], backend="reference")
    got, _ = ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], gk=x["gk"], beta=x["beta"],
                                                  backend="reference")
    assert rel_err(got, want) < 1e-12
    with pytest.raises(ValueError, match="`g`.*`gk`"):
        ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["gk"], beta=x["beta"])


def test_fla_short_names():
    """fla.ops exports the gated delta rule also as chunk_gdn / fused_recurrent_gdn (the same functions, so the
    recorded signatures cover them); code that imports the short names gets ours."""
    assert ops.chunk_gdn is ops.chunk_gated_delta_rule
    assert ops.fused_recurrent_gdn is ops.fused_recurrent_gated_delta_rule
    fla_ops = pytest.importorskip("fla.ops")
    assert fla_ops.chunk_gdn is fla_ops.chunk_gated_delta_rule
    assert fla_ops.fused_recurrent_gdn is fla_ops.fused_recurrent_gated_delta_rule


def test_cu_seqlens_cpu_means_no_device_read(monkeypatch):
    x = _x()
    cu = torch.tensor([0, 5, 21])
    want, _ = ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, backend="torch")
    reads = []
    monkeypatch.setattr(checks, "_read", lambda t: reads.append(t) or t.tolist())
    got, _ = ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                        cu_seqlens_cpu=cu.clone(), backend="torch")
    assert reads == [] and rel_err(got, want) == 0
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        ops.chunk_gla(x["q"], x["k"], x["v"], x["gk"], cu_seqlens_cpu=cu)


@pytest.mark.parametrize("call, option", [
    (lambda x: ops.chunk_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], lower_bound=5.0), "lower_bound"),
    (lambda x: ops.chunk_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], safe_gate=1), "safe_gate"),
    (lambda x: ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cp_context=object()),
     "cp_context"),
    (lambda x: ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=48), "chunk_size"),
    (lambda x: ops.chunk_rwkv7(x["q"], x["gk"], x["k"], x["v"], -x["k"], x["k"], chunk_size=128), "chunk_size"),
    (lambda x: ops.fused_recurrent_gla(x["q"], x["k"], x["v"], gv=x["v"]), "gv"),
    (lambda x: ops.chunk_rwkv7(x["q"], x["gk"], x["k"], x["v"], -x["k"], x["k"], cp_context=object()),
     "cp_context"),
    (lambda x: ops.chunk_rwkv7(x["q"], x["gk"], x["k"], x["v"], -x["k"], x["k"], lower_bound=0.0), "lower_bound"),
    (lambda x: ops.chunk_dplr_delta_rule(x["q"], x["k"], x["v"], -x["k"], x["k"], x["gk"], lower_bound=1.0),
     "lower_bound"),
])
def test_unsupported_options_are_refused_by_name(call, option):
    with pytest.raises(ValueError, match=f"`{option}="):
        call(_x())


def _positive(x):
    """Positive feature maps (as the normaliser is used): its denominator stays away from zero."""
    return {n: torch.nn.functional.softplus(x[n]) for n in "qk"}


@pytest.mark.parametrize("op", [ops.chunk_linear_attn, ops.fused_recurrent_linear_attn])
@pytest.mark.parametrize("cu", [None, [0, 5, 5, B * T]])
def test_linear_attn_z_state_chains(op, cu):
    """fla 0.6.0's normalised linear attention takes initial_state=(S, z), z [N, 1, H, K] the key sum
    carried over, and returns (final state, z_state): the two halves of a sequence chained through
    the pair give the whole (varlen with an empty sequence: its z is its z_0)."""
    x = _x()
    qk = _positive(x)
    if cu is not None:
        q, k, v = (t.reshape(1, B * T, *t.shape[2:]) for t in (qk["q"], qk["k"], x["v"]))
        cu_t = torch.tensor(cu)
        o, (S, z) = op(q, k, v, normalize=True, output_final_state=True, cu_seqlens=cu_t, backend="reference")
        # each sequence alone: the same o, S and z
        for i, (b, e) in enumerate(zip(cu[:-1], cu[1:])):
            if b == e:
                assert (z[i] == 0).all() and (S[i] == 0).all()   # an empty sequence: its (zero) initial pair
                continue
            o_i, (S_i, z_i) = op(q[:, b:e], k[:, b:e], v[:, b:e], normalize=True, output_final_state=True,
                                 backend="reference")
            assert rel_err(o[:, b:e], o_i) < 1e-12 and rel_err(S[i:i + 1], S_i) < 1e-12
            assert rel_err(z[i:i + 1], z_i) < 1e-12
        return
    q, k, v = qk["q"], qk["k"], x["v"]
    o, (S, z) = op(q, k, v, normalize=True, output_final_state=True, backend="reference")
    assert z.shape == (B, 1, H, K) and rel_err(z, k.sum(1, keepdim=True)) < 1e-14
    h = T // 2
    o1, (S1, z1) = op(q[:, :h], k[:, :h], v[:, :h], normalize=True, output_final_state=True, backend="reference")
    o2, (S2, z2) = op(q[:, h:], k[:, h:], v[:, h:], initial_state=(S1, z1), normalize=True,
                      output_final_state=True, backend="reference")
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-12
    assert rel_err(S2, S) < 1e-12 and rel_err(z2, z) < 1e-12
    # without output_final_state: fla's (None, z_state)
    _, (none, z_only) = op(q, k, v, normalize=True, backend="reference")
    assert none is None and rel_err(z_only, z) == 0


def test_linear_attn_z_state_gradient():
    """z_state = z_0 + sum_t k_t: a loss on it reaches every k_t and z_0 with its own cotangent."""
    x = _x()
    qk = _positive(x)
    k = qk["k"].detach().requires_grad_()
    z0 = torch.rand(B, 1, H, K, dtype=torch.float64, requires_grad=True)
    _, (_, z) = ops.chunk_linear_attn(qk["q"], k, x["v"], initial_state=(x["h0"], z0), normalize=True,
                                      backend="reference")
    dz = torch.randn(z.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    dk, dz0 = torch.autograd.grad((z * dz).sum(), [k, z0])
    assert rel_err(dk, dz.expand_as(k)) < 1e-15 and rel_err(dz0, dz) < 1e-15


def test_linear_attn_reverse_normalize():
    """fused_recurrent_linear_attn(reverse=True, normalize=True), as fla: the key sum runs from the end,
    z_t = sum_{s >= t} k_s, and z_state is the whole sum (the reversed sequence's)."""
    x = _x()
    qk = _positive(x)
    q, k, v = qk["q"], qk["k"], x["v"]
    o, (_, z) = ops.fused_recurrent_linear_attn(q, k, v, reverse=True, normalize=True, output_final_state=True,
                                                backend="reference")
    want, (_, zw) = ops.fused_recurrent_linear_attn(q.flip(1), k.flip(1), v.flip(1), normalize=True,
                                                    output_final_state=True, backend="reference")
    assert rel_err(o, want.flip(1)) < 1e-14 and rel_err(z, zw) < 1e-14


@pytest.mark.parametrize("bad, what", [
    (lambda x: (x["h0"], x["k"][:, :1, :, :2]), "`initial_state`'s z must be"),
    (lambda x: (x["h0"],), "pair"),
    (lambda x: (x["h0"], torch.zeros(x["k"].shape[0], 1, *x["k"].shape[2:], dtype=torch.int64)), "floating"),
    (lambda x: (x["h0"], torch.zeros(x["k"].shape[0], 1, *x["k"].shape[2:], device="meta")), "k's device"),
])
def test_linear_attn_bad_z_state_is_refused(bad, what):
    x = _x()
    with pytest.raises((TypeError, ValueError), match=what):
        ops.chunk_linear_attn(x["q"], x["k"], x["v"], initial_state=bad(x), normalize=True)
    with pytest.raises(TypeError, match="normalize=False"):
        ops.chunk_linear_attn(x["q"], x["k"], x["v"], initial_state=(x["h0"], x["k"][:, :1]), normalize=False)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_dplr_safe_gate_and_lower_bound_change_nothing(backend):
    """fla's RWKV7Attention calls chunk_rwkv7 with safe_gate=True, lower_bound=-exp(-1/2), chunk_size=64:
    options of fla's kernel numerics only, so the result is the op's without them (also when the
    gates break the promised bound: nothing is clamped, in fla or here); so are fla's other chunk
    sizes, 16 (its default without a safe bound) and 32."""
    x = _x()
    kk = torch.nn.functional.normalize(x["k"], dim=-1)
    for w, chunk_size in itertools.product((-0.6065306597126334 * torch.sigmoid(x["gk"]), x["gk"] * 30), (16, 32, 64)):
        fla_args = dict(safe_gate=True, lower_bound=-0.6065306597126334, chunk_size=chunk_size)
        for op, args in ((ops.chunk_rwkv7, (x["q"], w, x["k"], x["v"], -kk, kk * 0.5)),
                         (ops.chunk_dplr_delta_rule, (x["q"], x["k"], x["v"], -kk, kk * 0.5, w))):
            want, S = op(*args, output_final_state=True, backend=backend)
            got, S_got = op(*args, output_final_state=True, backend=backend, **fla_args)
            assert rel_err(got, want) == 0 and rel_err(S_got, S) == 0
    with pytest.raises(ValueError, match="`safe_gate="):
        ops.chunk_rwkv7(x["q"], x["gk"], x["k"], x["v"], -kk, kk, safe_gate="yes")


def test_legacy_and_unknown_keywords():
    x = _x()
    with pytest.raises(DeprecationWarning, match="head_first"):
        ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], head_first=False)
    with pytest.raises(TypeError, match="'use_qk_l2nrom_in_kernel'"):
        ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2nrom_in_kernel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_indices=torch.zeros(1, 2),
                                   disable_recompute=True, chunk_size=64, backend="reference")


def _reverse_loop(q, k, v, gk, h0, scale, lengths):
    """S_t = Diag(exp gk_t) S_{t+1} + k_t v_t^T from each sequence's last token to its first, o_t = S_t^T (scale q_t)."""
    o, finals, start = torch.zeros_like(v), [], 0
    for n, L in enumerate(lengths):
        S = h0[n].clone()
        for t in reversed(range(start, start + L)):
            S = gk[0, t].exp()[..., None] * S + k[0, t][..., None] * v[0, t][:, None, :]
            o[0, t] = scale * torch.einsum("hk,hkv->hv", q[0, t], S)
        finals.append(S)
        start += L
    return o, torch.stack(finals)


@pytest.mark.parametrize("lengths", [[21], [5, 0, 16]], ids=["one", "varlen"])
def test_reverse_runs_each_sequence_backwards(lengths, monkeypatch):
    x = _x()
    reads = []
    monkeypatch.setattr(checks, "_read", lambda t: reads.append(t) or t.tolist())
    cu = None if len(lengths) == 1 else torch.tensor([0] + lengths).cumsum(0)
    h0 = torch.randn(len(lengths), H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want_o, want_S = _reverse_loop(x["q"], x["k"], x["v"], x["gk"], h0, K ** -0.5, lengths)
    for backend in ("torch", "reference"):
        o, S = ops.fused_recurrent_gla(x["q"], x["k"], x["v"], x["gk"], initial_state=h0, output_final_state=True,
                                       reverse=True, cu_seqlens=cu, backend=backend)
        assert rel_err(o, want_o) < 1e-12 and rel_err(S, want_S) < 1e-12
        assert len(reads) == (0 if cu is None else 1)      # one host copy of cu_seqlens per call
        reads.clear()
        g = x["g"]
        o, S = ops.fused_recurrent_simple_gla(x["q"], x["k"], x["v"], g, initial_state=h0, output_final_state=True,
                                              reverse=True, cu_seqlens=cu, backend=backend)
        want = _reverse_loop(x["q"], x["k"], x["v"], g[..., None].expand(B, T, H, K), h0, K ** -0.5, lengths)
        assert rel_err(o, want[0]) < 1e-12 and rel_err(S, want[1]) < 1e-12
        assert len(reads) == (0 if cu is None else 1)
        reads.clear()
    # the Triton kernels (interpreter on the CPU), fp32, and the gradient through the reversal
    f = {n: x[n].float().requires_grad_() for n in ("q", "k", "v", "gk")}
    o, S = ops.fused_recurrent_gla(f["q"], f["k"], f["v"], f["gk"], initial_state=h0.float(), output_final_state=True,
                                   reverse=True, cu_seqlens=cu, backend="triton")
    assert rel_err(o, want_o) < 1e-5 and rel_err(S, want_S) < 1e-5
    o.sum().backward()
    d = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "gk")}
    _reverse_loop(d["q"], d["k"], d["v"], d["gk"], h0, K ** -0.5, lengths)[0].sum().backward()
    assert all(rel_err(f[n].grad, d[n].grad) < 1e-4 for n in f)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("with_A", [True, False])
def test_kda_lower_bound_gate(mode, with_A):
    """fla's bounded KDA gate with the in-kernel gate: lower_bound * sigmoid(exp(A_log) (g + dt_bias)) (A_log
    None: lower_bound * sigmoid(g + dt_bias)), the op on it equal to the op on that gate formed outside, every
    gradient (g, A_log, dt_bias through the gate) in float64."""
    x = _x()
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).requires_grad_()
    A_log = torch.randn(H, generator=gen, dtype=torch.float64).requires_grad_() if with_A else None
    dt_bias = torch.randn(H * K, generator=gen, dtype=torch.float64).requires_grad_()
    op = getattr(ops, f"{mode}_kda")
    gate = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=-3.0)
    if mode == "chunk":
        gate["safe_gate"] = True
    o, S = op(x["q"], x["k"], x["v"], raw, x["beta"], output_final_state=True, backend="torch", **gate)
    a = A_log.exp()[:, None] if with_A else 1.0
    g = -3.0 * torch.sigmoid(a * (raw + dt_bias.view(H, K)))
    assert g.min() >= -3.0 and g.max() < 0
    want, S_want = op(x["q"], x["k"], x["v"], g, x["beta"], output_final_state=True, backend="torch")
    assert rel_err(o, want) < 1e-14 and rel_err(S, S_want) < 1e-14
    leaves = [t for t in (raw, A_log, dt_bias) if t is not None]
    got = torch.autograd.grad((o.sum(), S.sum()), leaves, retain_graph=True)
    ref = torch.autograd.grad((want.sum(), S_want.sum()), leaves)
    assert all(rel_err(a_, b_) < 1e-13 for a_, b_ in zip(got, ref))


def test_kda_safe_gate_and_lower_bound_checks():
    """safe_gate with the in-kernel gate needs lower_bound in [-5, 0) (fla's check); without the in-kernel gate
    both are fla's kernel numerics only: the result is the op's without them."""
    x = _x()
    A_log, dt_bias = torch.zeros(H, dtype=torch.float64), torch.zeros(H * K, dtype=torch.float64)
    for bound in (None, -6.0):
        with pytest.raises(ValueError, match="`safe_gate=True`"):
            ops.chunk_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], use_gate_in_kernel=True, safe_gate=True,
                          lower_bound=bound, A_log=A_log, dt_bias=dt_bias)
    with pytest.raises(ValueError, match="`lower_bound="):
        ops.fused_recurrent_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], lower_bound=0.5)
    with pytest.raises(ValueError, match="`A_log`"):
        ops.chunk_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], use_gate_in_kernel=True, dt_bias=dt_bias)
    want, _ = ops.chunk_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], backend="torch")
    got, _ = ops.chunk_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], safe_gate=True, lower_bound=-5.0,
                           backend="torch")
    assert rel_err(got, want) == 0


def test_fla_other_forms_refuse_what_fla_refuses():
    """fla 0.6.0's removed fused_chunk_gla / fused_chunk_delta_rule raise as fla's do (importing them works); the
    parallel forms' scores need one sequence a row and q's heads on v; lightning attention's decays need a layer
    index in [0, num_layers) and q's heads on v."""
    x = _x()
    q, k, v = x["q"], x["k"], x["v"]
    for name, instead in (("fused_chunk_gla", "chunk_gla"), ("fused_chunk_delta_rule", "chunk_delta_rule")):
        with pytest.raises(NotImplementedError, match=instead):
            getattr(ops, name)(q=q, k=k, v=v)
    cu = torch.tensor([0, 9, T])
    assert ops.parallel_simple_gla(q, k, v, x["g"], cu_seqlens=cu)[1] is None
    with pytest.raises(ValueError, match="output_attentions.*cu_seqlens"):
        ops.parallel_simple_gla(q, k, v, x["g"], output_attentions=True, cu_seqlens=cu)
    v2 = torch.cat([v, v], dim=2)
    with pytest.raises(ValueError, match="output_attentions.*heads"):
        ops.parallel_retention(q, k, v2, output_attentions=True)
    for bad in (dict(layer_idx=4, num_layers=4), dict(layer_idx=-1, num_layers=4), dict(layer_idx=0, num_layers=0),
                dict(layer_idx=1.0, num_layers=4)):
        with pytest.raises(ValueError, match="layer_idx|num_layers"):
            ops.chunk_lightning_attn(q, k, v, **bad)
    with pytest.raises(ValueError, match="`v`"):
        ops.fused_recurrent_lightning_attn(q, k, v2, 0, 2)
    # the first layer's head 0 does not decay, the last layer's heads decay least
    assert lightning_log_gamma(4, 0, 2)[0] == 0 and (lightning_log_gamma(4, 1, 2) > lightning_log_gamma(4, 0, 2))[1:].all()


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("op", ["iplr_delta_rule", "lightning_attn"])
def test_other_forms_on_triton(op, mode):
    """The identity-plus-low-rank rule (the DPLR kernels at gk = 0) and lightning attention (simple_gla's at fixed
    decays) on the Triton kernels, fp32, against the reference: o, the final state, every gradient."""
    x = _x()
    args = (-x["k"], 0.5 * x["beta"][..., None] * x["k"]) if op == "iplr_delta_rule" else (1, 3)
    leaves = {n: x[n].float().requires_grad_() for n in ("q", "k", "v")}
    h0 = x["h0"].float().requires_grad_()
    fn = getattr(ops, f"{mode}_{op}")
    extra = [a.float() if torch.is_tensor(a) else a for a in args]
    o, S = fn(*leaves.values(), *extra, initial_state=h0, output_final_state=True, backend="triton")
    ref = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    h0r = h0.detach().double().requires_grad_()
    ro, rS = fn(*ref.values(), *args, initial_state=h0r, output_final_state=True, backend="reference")
    assert rel_err(o, ro) < 1e-5 and rel_err(S, rS) < 1e-5
    gen = torch.Generator().manual_seed(1)
    do, dS = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (ro, rS))
    mine = torch.autograd.grad((o * do.float()).sum() + (S * dS.float()).sum(), [*leaves.values(), h0])
    want = torch.autograd.grad((ro * do).sum() + (rS * dS).sum(), [*ref.values(), h0r])
    for n, a, b in zip([*leaves, "initial_state"], mine, want):
        assert rel_err(a, b) < 1e-5, f"d{n} {rel_err(a, b):.2e}"

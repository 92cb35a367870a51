"""fla's ``Comba``, ``HGRN2Attention``, ``Mamba2`` and ``RWKV7Attention`` layer classes (``fastweight.layers.fla_layers``):
fla's parameter names, each checked against the layer's formula (as fla 0.6.0's layer computes it)
written out here in float64 from the parameters alone, and, where fla is importable (with
``TRITON_INTERPRET=1``: ``fastweight.testing.fla_cpu_patches``), against fla's own layer holding the
same weights; padding, packed input, the cache, the refusals."""


import pytest
import torch
import torch.nn.functional as F

from fastweight import ops
from fastweight.layers import Comba, HGRN2Attention, Mamba2, RWKV7Attention
from fastweight.testing import fla_on_cpu, generator, rel_err

FLA_KEYS = {
    "comba": {"q_proj.weight", "k_proj.weight", "v_proj.weight", "a_proj.weight", "b_proj.weight", "decay", "D",
              "A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "g_proj.weight",
              "o_norm.weight", "o_proj.weight"},
    "hgrn2": {"q_proj.weight", "f_proj.weight", "i_proj.weight", "g_norm.weight", "o_proj.weight"},
    "mamba2": {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "norm.weight", "D",
               "out_proj.weight"}}
LAYERS = {"comba": (Comba, dict(hidden_size=32, head_dim=8, num_heads=2, expand_v=2)),
          "hgrn2": (HGRN2Attention, dict(hidden_size=32, expand_ratio=8)),
          "mamba2": (Mamba2, dict(hidden_size=32, head_dim=8, state_size=8))}
KINDS = list(LAYERS)


def _layer(kind, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    cls, base = LAYERS[kind]
    layer = cls(**{**base, **kw}).to(dtype)
    for p in layer.parameters():   # away from the initialisation's ones and zeros
        p.data.add_(0.1 * torch.randn_like(p))
    return layer


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _conv(w, y, bias=None):
    T = y.shape[1]
    return F.silu(F.conv1d(y.transpose(1, 2), w, bias, padding=w.shape[-1] - 1, groups=w.shape[0])[..., :T]
                  .transpose(1, 2))


def _l2(t):
    return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)


def _formula(kind, p: dict, x, lower_bound=None, layer_idx=1):
    """The layer as fla 0.6.0's computes it, from its state dict (fla's names)."""
    if kind == "comba":
        H = p["decay"].shape[0]
        q, k = (_conv(p[f"{n}_conv1d.weight"], x @ p[f"{n}_proj.weight"].T).unflatten(-1, (H, -1)) for n in "qk")
        HV = p["A_log"].shape[0]
        v = _conv(p["v_conv1d.weight"], x @ p["v_proj.weight"].T).unflatten(-1, (HV, -1))
        pk = k * torch.sigmoid(p["decay"])[:, None]
        q = q - p["D"][:, None] * pk
        beta = torch.sigmoid(x @ p["b_proj.weight"].T)
        g = -p["A_log"].exp() * F.softplus(x @ p["a_proj.weight"].T + p["dt_bias"])
        o, _ = ops.chunk_comba(_l2(q), _l2(k), v, _l2(pk), g, beta, scale=k.shape[-1] ** -0.5, backend="reference")
        o = _rms(o, p["o_norm.weight"]) * torch.sigmoid(x @ p["g_proj.weight"].T).unflatten(-1, (HV, -1))
        return o.flatten(-2) @ p["o_proj.weight"].T
    if kind == "hgrn2":
        K = 8
        g = F.logsigmoid(x @ p["f_proj.weight"].T)
        if lower_bound is not None and layer_idx > 0:
            g = (lower_bound + (1 - lower_bound) * g.exp()).log()
        q, k, g = (t.unflatten(-1, (-1, K)) for t in (F.silu(x @ p["q_proj.weight"].T), 1 - g.exp(), g))
        v = (x @ p["i_proj.weight"].T).unflatten(-1, (q.shape[2], -1))
        o, _ = ops.chunk_gla(q, k, v, g, scale=K ** -0.5, backend="reference")
        return _rms(o.flatten(-2), p["g_norm.weight"]) @ p["o_proj.weight"].T
    N, H = 8, p["A_log"].shape[0]
    E = p["out_proj.weight"].shape[1]
    z, xbc, dt = (x @ p["in_proj.weight"].T).split([E, E + 2 * N, H], -1)
    xs, b, c = _conv(p["conv1d.weight"], xbc, p["conv1d.bias"]).split([E, N, N], -1)
    dt = F.softplus(dt + p["dt_bias"])
    xs = xs.unflatten(-1, (H, -1))
    B, T = x.shape[:2]
    o, _ = ops.chunk_simple_gla(c[:, :, None].expand(B, T, H, N), b[:, :, None].expand(B, T, H, N),
                                xs * dt[..., None], -p["A_log"].exp() * dt, scale=1.0, backend="reference")
    y = (o + p["D"][:, None] * xs).flatten(-2) * F.silu(z)
    return _rms(y, p["norm.weight"]) @ p["out_proj.weight"].T


@pytest.mark.parametrize("kind", KINDS)
def test_fla_names_and_formula(kind):
    layer = _layer(kind).train()
    assert set(layer.state_dict()) == FLA_KEYS[kind]
    x = torch.randn(2, 70, 32, dtype=torch.float64, generator=generator())
    o, attentions, cache = layer(x)
    assert attentions is None and cache is None and o.shape == x.shape
    assert rel_err(o, _formula(kind, layer.state_dict(), x)) < 1e-12
    fresh = LAYERS[kind][0](**LAYERS[kind][1]).double().train()
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x)[0], o)


def test_comba_grouped_value_heads_and_options():
    layer = _layer("comba", num_v_heads=4).train()
    sd = layer.state_dict()
    assert sd["decay"].shape == sd["D"].shape == (2,) and sd["A_log"].shape == (4,)
    x = torch.randn(1, 20, 32, dtype=torch.float64, generator=generator())
    assert rel_err(layer(x)[0], _formula("comba", sd, x)) < 1e-12
    plain = Comba(**LAYERS["comba"][1], use_output_gate=False, use_output_correction=False, use_inner_decay=False)
    assert {"g_proj.weight", "D", "decay"}.isdisjoint(plain.state_dict())


def test_hgrn2_lower_bound():
    """HGRN's forget-gate lower bound (a forward argument, from layer 1 on) and the joint norm."""
    x = torch.randn(2, 30, 32, dtype=torch.float64, generator=generator())
    lb = torch.rand(32, dtype=torch.float64, generator=generator())
    for layer_idx in (0, 2):
        layer = _layer("hgrn2", layer_idx=layer_idx).train()
        want = _formula("hgrn2", layer.state_dict(), x, lb, layer_idx)
        assert rel_err(layer(x, lower_bound=lb)[0], want) < 1e-12
    assert rel_err(layer(x)[0], want) > 1e-3
    # fla's forward signature: lower_bound is the sixth parameter, so a positional call reaches it
    assert torch.equal(layer(x, None, None, False, False, lb)[0], layer(x, lower_bound=lb)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_padding_packed_and_cache(kind):
    layer = _layer(kind).eval()
    gen = generator()
    a, b = (torch.randn(1, n, 32, dtype=torch.float64, generator=gen) for n in (9, 5))
    x = torch.zeros(2, 9, 32, dtype=torch.float64)
    x[0], x[1, 4:] = a[0], b[0]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    o, _, _ = layer(x, attention_mask=mask)
    alone_a, alone_b = layer(a)[0], layer(b)[0]
    assert rel_err(o[0], alone_a[0]) < 1e-12 and rel_err(o[1, 4:], alone_b[0]) < 1e-12
    packed, _, _ = layer(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 9, 14]))
    assert rel_err(packed, torch.cat([alone_a, alone_b], 1)) < 1e-12
    o1, _, cache = layer(a[:, :6], use_cache=True)
    o2, _, _ = layer(a[:, 6:], past_key_values=cache, use_cache=True)
    assert rel_err(torch.cat([o1, o2], 1), alone_a) < 1e-12


@pytest.mark.parametrize("kind,kw", [("comba", dict(conv_bias=True)), ("comba", dict(use_short_conv=False)),
                                     ("hgrn2", dict(use_short_conv=True)), ("hgrn2", dict(elementwise_affine=False)),
                                     ("mamba2", dict(n_groups=2)), ("mamba2", dict(D_has_hdim=True)),
                                     ("mamba2", dict(norm_before_gate=True)), ("mamba2", dict(dt_limit=(0.0, 1.0))),
                                     ("mamba2", dict(use_bias=True))])
def test_refusals_name_the_argument(kind, kw):
    with pytest.raises(NotImplementedError, match=next(iter(kw))):
        LAYERS[kind][0](**{**LAYERS[kind][1], **kw})


@pytest.mark.parametrize("kind", KINDS)
def test_against_fla_layer(kind, monkeypatch):
    """fla's own layer with the same weights (fp32; fla's layer in its training path)."""
    fla_layers = fla_on_cpu(monkeypatch)
    extra = dict(num_v_heads=4) if kind == "comba" else {}
    ours = _layer(kind, torch.float32, layer_idx=1, **extra).train()
    cls = {"comba": fla_layers.Comba, "hgrn2": fla_layers.HGRN2Attention, "mamba2": fla_layers.Mamba2}[kind]
    kwargs = {**LAYERS[kind][1], **extra, "layer_idx": 1}
    if kind == "mamba2":
        kwargs["backend"] = "triton"
    theirs = cls(**kwargs).train()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 70, 32, generator=generator())
    call = dict(lower_bound=torch.rand(32, generator=generator())) if kind == "hgrn2" else {}
    with torch.no_grad():
        got, want = ours(x, **call)[0], theirs(x, **call)[0]
    assert rel_err(got, want) < 1e-5, rel_err(got, want)


RWKV7_KEYS = {"x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k", "k_a", "r_k", "r_proj.weight", "k_proj.weight",
              "v_proj.weight", "o_proj.weight", "g_norm.weight", "g_norm.bias", "w_lora.lora.0.weight",
              "w_lora.lora.2.weight", "w_lora.lora.2.bias", "a_lora.lora.0.weight", "a_lora.lora.2.weight",
              "a_lora.lora.2.bias", "g_lora.lora.0.weight", "g_lora.lora.2.weight"}
V_LORA = {"v_lora.lora.0.weight", "v_lora.lora.2.weight", "v_lora.lora.2.bias"}


def _rwkv7(layer_idx, dtype=torch.float64, **kw):
    torch.manual_seed(layer_idx)
    layer = RWKV7Attention(hidden_size=64, head_dim=16, layer_idx=layer_idx, **kw).to(dtype)
    for p in layer.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    return layer


def _rwkv7_formula(p: dict, x, v_first, H=4, eps=16e-5):
    """RWKV-7 time mixing as fla's layer (and the official x070 code) computes it, from fla's names."""
    def lora(name, t, act=lambda y: y):
        y = act(t @ p[f"{name}.lora.0.weight"].T) @ p[f"{name}.lora.2.weight"].T
        return y + p[f"{name}.lora.2.bias"] if f"{name}.lora.2.bias" in p else y
    xx = F.pad(x, (0, 0, 1, -1)) - x
    xr, xw, xk, xv, xa, xg = (x + xx * p[f"x_{c}"] for c in "rwkvag")
    r, k, v = xr @ p["r_proj.weight"].T, xk @ p["k_proj.weight"].T, xv @ p["v_proj.weight"].T
    w = -torch.exp(torch.tensor(-0.5, dtype=x.dtype)) * torch.sigmoid(lora("w_lora", xw, torch.tanh))
    if v_first is None:
        v_first = v
    else:
        v = v + (v_first - v) * torch.sigmoid(lora("v_lora", xv))
    a, g = torch.sigmoid(lora("a_lora", xa)), lora("g_lora", xg, torch.sigmoid)
    kk = (k * p["k_k"]).unflatten(-1, (H, -1))
    kk = kk / kk.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    k = k * (1 + (a - 1) * p["k_a"])
    r, w, k, a, v = (t.unflatten(-1, (H, -1)) for t in (r, w, k, a, v))
    o, _ = ops.chunk_rwkv7(r, w, k, v, -kk, kk * a, scale=1.0, backend="reference")
    mean, var = o.mean(-1, keepdim=True), o.var(-1, unbiased=False, keepdim=True)
    o = ((o - mean) / torch.sqrt(var + eps)).flatten(-2) * p["g_norm.weight"] + p["g_norm.bias"]
    o = o + ((r * k * p["r_k"]).sum(-1, keepdim=True) * v).flatten(-2)
    return (o * g) @ p["o_proj.weight"].T, v_first


def test_rwkv7_names_formula_and_value_residual():
    x = torch.randn(2, 70, 64, dtype=torch.float64, generator=generator())
    v_first = None
    for layer_idx in (0, 1):
        layer = _rwkv7(layer_idx).train()
        assert set(layer.state_dict()) == RWKV7_KEYS | (V_LORA if layer_idx else set())
        o, attentions, cache, v_out = layer(x, v_first=v_first)
        want, want_v_first = _rwkv7_formula(layer.state_dict(), x, v_first)
        assert attentions is None and cache is None
        assert rel_err(o, want) < 1e-12 and rel_err(v_out, want_v_first) < 1e-12
        v_first = v_out
    # fla's default ranks from hidden_size and head_dim; GroupNorm's eps head_dim * norm_eps
    big = RWKV7Attention(hidden_size=2048, head_dim=64, layer_idx=1)
    assert (big.decay_low_rank_dim, big.a_low_rank_dim, big.v_low_rank_dim, big.gate_low_rank_dim) == (128, 128, 64, 224)
    assert big.g_norm.eps == 64e-5


def test_rwkv7_packed_and_cache():
    layer = _rwkv7(1).eval()
    gen = generator()
    a, b = (torch.randn(1, n, 64, dtype=torch.float64, generator=gen) for n in (9, 5))
    va, vb = (torch.randn(1, n, 64, dtype=torch.float64, generator=gen) for n in (9, 5))
    alone_a, alone_b = layer(a, v_first=va)[0], layer(b, v_first=vb)[0]
    packed = layer(torch.cat([a, b], 1), v_first=torch.cat([va, vb], 1), cu_seqlens=torch.tensor([0, 9, 14]))[0]
    assert rel_err(packed, torch.cat([alone_a, alone_b], 1)) < 1e-12
    o1, _, cache, _ = layer(a[:, :6], v_first=va[:, :6], use_cache=True)
    o2, _, _, _ = layer(a[:, 6:], v_first=va[:, 6:], past_key_values=cache, use_cache=True)
    assert rel_err(torch.cat([o1, o2], 1), alone_a) < 1e-12
    with pytest.raises(NotImplementedError, match="attention_mask"):
        layer(a, attention_mask=torch.tensor([[0] + [1] * 8]), v_first=va)


def test_rwkv7_against_fla_layer(monkeypatch):
    fla_layers = fla_on_cpu(monkeypatch)
    x = torch.randn(2, 70, 64, generator=generator())
    v_first = None
    for layer_idx in (0, 1):
        ours = _rwkv7(layer_idx, torch.float32, num_hidden_layers=2).train()
        theirs = fla_layers.RWKV7Attention(hidden_size=64, head_dim=16, layer_idx=layer_idx,
                                           num_hidden_layers=2).train()
        theirs.load_state_dict(ours.state_dict(), strict=True)
        with torch.no_grad():
            got, want = ours(x, v_first=v_first), theirs(x, v_first=v_first)
        assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[3], want[3]) < 1e-5
        v_first = want[3]


def test_fla_rwkv7_layer_on_our_op(monkeypatch):
    """fla's RWKV7Attention with its chunk_rwkv7 pointed straight at ``ops.chunk_rwkv7`` (fla's own
    arguments: safe_gate=True, lower_bound, chunk_size=64) runs and equals our layer."""
    import functools
    fla_layers = fla_on_cpu(monkeypatch)
    import fla.layers.rwkv7 as fla_rwkv7
    calls = []
    op = functools.partial(ops.chunk_rwkv7, backend="torch")
    monkeypatch.setattr(fla_rwkv7, "chunk_rwkv7", lambda *a, **kw: calls.append(kw) or op(*a, **kw))
    x = torch.randn(1, 70, 64, generator=generator())
    ours = _rwkv7(0, torch.float32, num_hidden_layers=2).train()
    theirs = fla_layers.RWKV7Attention(hidden_size=64, head_dim=16, layer_idx=0, num_hidden_layers=2).train()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    with torch.no_grad():
        got, want = ours(x), theirs(x)
    assert calls and calls[0]["safe_gate"] is True and calls[0]["lower_bound"] < 0
    assert rel_err(got[0], want[0]) < 1e-5

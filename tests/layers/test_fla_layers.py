"""fla's layer classes on fastweight (``fastweight.layers.fla_layers``): fla's constructor, call and
return convention and parameter names, checked against the layer's formula written out here in
float64 from the parameters alone (short convolutions by F.conv1d, the recurrence by the per-token
reference), padding masks, packed input, the cache, and the refusals; where fla is importable, every
fla-named class's signatures against fla's."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from fastweight import layers, ops
from fastweight.layers import DeltaNet, GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention
from fastweight.testing import generator, rel_err

# fla 0.6.0's layers (short convs without bias; GDN with its output gate): their parameters by name
COMMON = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "A_log", "dt_bias", "q_conv1d.weight",
          "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight", "o_proj.weight"}
FLA_KEYS = {"gdn": COMMON | {"a_proj.weight", "g_proj.weight"}, "kda": COMMON | {
    "f_proj.0.weight", "f_proj.1.weight", "g_proj.0.weight", "g_proj.1.weight", "g_proj.1.bias"},
    "deltanet": COMMON - {"A_log", "dt_bias"},
    "gla": {"q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "gk_proj.0.weight", "gk_proj.1.weight",
            "gk_proj.1.bias", "g_norm_swish_gate.weight", "o_proj.weight"}}
# each at key heads of 8 (DeltaNet's from hidden_size * expand_k / num_heads, as fla sizes it)
LAYERS = {"gdn": (GatedDeltaNet, dict(head_dim=8, expand_v=2)),
          "kda": (KimiDeltaAttention, dict(head_dim=8, expand_v=1)),
          "deltanet": (DeltaNet, dict(expand_k=0.5, expand_v=1)),
          "gla": (GatedLinearAttention, dict(expand_k=0.5, expand_v=1))}
KINDS = list(LAYERS)


def _layer(kind="gdn", **kw):
    torch.manual_seed(0)
    cls, extra = LAYERS[kind]
    layer = cls(**{**dict(hidden_size=32, num_heads=2), **extra, **kw}).double()
    for p in layer.parameters():   # away from the initialisation's symmetric values
        p.data.add_(0.1 * torch.randn_like(p))
    return layer


def _formula(kind, p: dict, x, H, K, allow_neg_eigval=False, eps=1e-5, HV=None, lower_bound=None):
    """The layer written out from its state dict (fla's names), float64; ``HV`` value heads (GVA:
    the op reads key head j // (HV / H) for value head j, as fla's layer repeats q and k);
    ``lower_bound``: KDA's bounded gate, lower_bound * sigmoid(exp(A_log) (f + dt_bias))."""
    T, HV = x.shape[1], HV or H
    if kind == "gla":   # no short convolutions, no key norm; the decay from its low-rank map
        q, k, v = (x @ p[f"{n}_proj.weight"].T for n in "qkv")
        g = F.logsigmoid(x @ p["gk_proj.0.weight"].T @ p["gk_proj.1.weight"].T + p["gk_proj.1.bias"]) / 16
        o, _ = ops.chunk_gla(*(t.unflatten(-1, (H, -1)) for t in (q, k, v, g)), scale=K ** -0.5, backend="reference")
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * p["g_norm_swish_gate.weight"]
        return (o * F.silu(x @ p["g_proj.weight"].T).unflatten(-1, (H, -1))).flatten(-2) @ p["o_proj.weight"].T

    def conv(name, y):
        w = p[f"{name}_conv1d.weight"]
        return F.silu(F.conv1d(y.transpose(1, 2), w, padding=w.shape[-1] - 1, groups=w.shape[0])[..., :T]
                      .transpose(1, 2))

    q = conv("q", x @ p["q_proj.weight"].T).unflatten(-1, (H, K))
    k = conv("k", x @ p["k_proj.weight"].T).unflatten(-1, (H, K))
    v = conv("v", x @ p["v_proj.weight"].T).unflatten(-1, (HV, -1))
    q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))   # fla's l2norm
    beta = torch.sigmoid(x @ p["b_proj.weight"].T) * (2 if allow_neg_eigval else 1)
    if kind == "deltanet":
        o, _ = ops.chunk_delta_rule(q, k, v, beta, scale=K ** -0.5, allow_neg_eigval=allow_neg_eigval,
                                    backend="reference")
        gate = None
    elif kind == "gdn":
        g = -p["A_log"].exp() * F.softplus(x @ p["a_proj.weight"].T + p["dt_bias"])
        o, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, scale=K ** -0.5, allow_neg_eigval=allow_neg_eigval,
                                          backend="reference")
        gate = F.silu(x @ p["g_proj.weight"].T)
    else:
        f = (x @ p["f_proj.0.weight"].T @ p["f_proj.1.weight"].T + p["dt_bias"]).unflatten(-1, (HV, K))
        if lower_bound is None:
            g = -p["A_log"].exp()[:, None] * F.softplus(f)
        else:
            g = lower_bound * torch.sigmoid(p["A_log"].exp()[:, None] * f)
        o, _ = ops.chunk_kda(q, k, v, g, beta, scale=K ** -0.5, allow_neg_eigval=allow_neg_eigval,
                             backend="reference")
        gate = torch.sigmoid(x @ p["g_proj.0.weight"].T @ p["g_proj.1.weight"].T + p["g_proj.1.bias"])
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * p["o_norm.weight"]
    if gate is not None:
        o = o * gate.unflatten(-1, (HV, -1))
    return o.flatten(-2) @ p["o_proj.weight"].T


@pytest.mark.parametrize("kind,allow_neg_eigval", [(k, neg) for k in KINDS for neg in (False, True)
                                                     if not (neg and k == "gla")])   # GLA has no beta
def test_fla_names_and_formula(kind, allow_neg_eigval):
    layer = _layer(kind, **(dict(allow_neg_eigval=True) if allow_neg_eigval else {})).train()
    assert set(layer.state_dict()) == FLA_KEYS[kind]
    x = torch.randn(2, 70, 32, dtype=torch.float64, generator=generator())
    o, attentions, cache = layer(x)
    assert attentions is None and cache is None and o.shape == x.shape
    want = _formula(kind, layer.state_dict(), x, 2, 8, allow_neg_eigval)
    assert rel_err(o, want) < 1e-12
    # an fla-named state dict loads into a fresh layer and gives the same outputs
    cls, extra = LAYERS[kind]
    fresh = cls(hidden_size=32, num_heads=2, **extra, **(dict(allow_neg_eigval=True) if allow_neg_eigval else {}))
    fresh = fresh.double().train()
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x)[0], o)


def test_gated_deltanet_grouped_value_heads():
    """fla's ``num_v_heads`` (Qwen3-Next's GVA): 4 value heads over 2 key heads, fla's shapes and formula."""
    layer = _layer("gdn", num_v_heads=4).train()
    sd = layer.state_dict()
    assert set(sd) == FLA_KEYS["gdn"] and layer.num_v_heads == 4
    assert sd["v_proj.weight"].shape == (4 * 16, 32) and sd["b_proj.weight"].shape == (4, 32)
    assert sd["A_log"].shape == sd["dt_bias"].shape == (4,) and sd["q_proj.weight"].shape == (2 * 8, 32)
    x = torch.randn(2, 70, 32, dtype=torch.float64, generator=generator())
    assert rel_err(layer(x)[0], _formula("gdn", sd, x, 2, 8, HV=4)) < 1e-12
    with pytest.raises(ValueError, match="`num_v_heads` \\(3\\) must be a multiple of `num_heads` \\(2\\)"):
        GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=3)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_mask_and_packed_input(kind):
    """attention_mask (left and right padding) and cu_seqlens: each sequence as if alone, zeros at pads."""
    layer = _layer(kind).train()
    gen = generator()
    a, b = (torch.randn(1, n, 32, dtype=torch.float64, generator=gen) for n in (9, 5))
    x = torch.zeros(2, 9, 32, dtype=torch.float64)
    x[0], x[1, 4:] = a[0], b[0]                       # row 1 left-padded by 4
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    o, _, _ = layer(x, attention_mask=mask)
    alone_a, alone_b = layer(a)[0], layer(b)[0]
    assert rel_err(o[0], alone_a[0]) < 1e-12 and rel_err(o[1, 4:], alone_b[0]) < 1e-12
    assert o[1, :4].abs().max() == 0
    packed, _, _ = layer(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 9, 14]))
    assert rel_err(packed, torch.cat([alone_a, alone_b], 1)) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_cache_prefill_then_decode(kind):
    layer = _layer(kind).eval()
    x = torch.randn(1, 12, 32, dtype=torch.float64, generator=generator())
    full = layer(x)[0]
    o1, _, cache = layer(x[:, :9], use_cache=True)
    o2, _, cache = layer(x[:, 9:10], past_key_values=cache, use_cache=True)
    o3, _, _ = layer(x[:, 10:], past_key_values=cache, use_cache=True)
    assert rel_err(torch.cat([o1, o2, o3], 1), full) < 1e-12


@pytest.mark.parametrize("kw,error,message", [
    (dict(num_v_heads=3), ValueError, "num_v_heads"),
    (dict(use_gate=False), NotImplementedError, "use_gate"),
    (dict(conv_bias=True), NotImplementedError, "conv_bias"),
    (dict(mode="parallel"), ValueError, "mode"),
    (dict(bogus=1), TypeError, "bogus"),
])
def test_refusals_name_the_argument(kw, error, message):
    with pytest.raises(error, match=message):
        GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, **kw)


@pytest.mark.parametrize("kw,error,message", [(dict(safe_gate=True), ValueError, "safe_gate"),
                                              (dict(safe_gate=True, lower_bound=-6.0), ValueError, "lower_bound"),
                                              (dict(num_v_heads=3), ValueError, "num_v_heads"),
                                              (dict(use_short_conv=False), NotImplementedError, "use_short_conv")])
def test_kda_refusals_name_the_argument(kw, error, message):
    with pytest.raises(error, match=message):
        KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, **kw)


@pytest.mark.parametrize("kw", [dict(num_v_heads=4, expand_v=2), dict(lower_bound=-3.0),
                                dict(safe_gate=True, lower_bound=-5.0, num_v_heads=4)])
def test_kda_options(kw):
    """fla's KDA options: grouped value heads, expand_v (fla's low-rank maps of rank head_v_dim),
    lower_bound (the bounded gate, formed before the op), safe_gate (a kernel choice of fla's)."""
    layer = _layer("kda", **kw).train()
    sd = layer.state_dict()
    HV, V = kw.get("num_v_heads", 2), 8 * kw.get("expand_v", 1)
    assert set(sd) == FLA_KEYS["kda"] and sd["f_proj.0.weight"].shape == sd["g_proj.0.weight"].shape == (V, 32)
    assert sd["f_proj.1.weight"].shape == (HV * 8, V) and sd["g_proj.1.weight"].shape == (HV * V, V)
    x = torch.randn(2, 70, 32, dtype=torch.float64, generator=generator())
    want = _formula("kda", sd, x, 2, 8, HV=HV, lower_bound=kw.get("lower_bound"))
    assert rel_err(layer(x)[0], want) < 1e-12
    assert rel_err(layer.eval()(x[:, :20])[0], want[:, :20]) < 1e-12   # the decode path takes the same gate


@pytest.mark.parametrize("kw,error,message", [
    (dict(use_gate=True), NotImplementedError, "use_gate"), (dict(qk_norm="sum"), NotImplementedError, "qk_norm"),
    (dict(qk_activation="relu"), NotImplementedError, "qk_activation"),
    (dict(expand_k=0.3), ValueError, "expand_k"), (dict(head_dim=8), TypeError, "head_dim"),
])
def test_deltanet_refusals_name_the_argument(kw, error, message):
    with pytest.raises(error, match=message):
        DeltaNet(hidden_size=32, num_heads=2, **kw)


@pytest.mark.parametrize("kw", [dict(use_short_conv=True), dict(num_kv_heads=1), dict(feature_map="relu"),
                                dict(gate_fn="sigmoid"), dict(gate_low_rank_dim=8), dict(clamp_min=-1.0),
                                dict(fuse_norm=False), dict(use_output_gate=False), dict(gate_logit_normalizer=8)])
def test_gla_refusals_name_the_argument(kw):
    with pytest.raises(NotImplementedError, match=next(iter(kw))):
        GatedLinearAttention(hidden_size=32, num_heads=2, **kw)


def test_deltanet_sizes_as_fla_does():
    """Key and value widths hidden_size * expand_k / expand_v split into num_heads; d_model aliases hidden_size."""
    layer = DeltaNet(d_model=64, num_heads=4, expand_k=0.5, expand_v=2)
    assert (layer.hidden_size, layer.key_dim, layer.value_dim, layer.head_dim, layer.head_v_dim) == (64, 32, 128, 8, 32)
    assert layer.state_dict()["q_proj.weight"].shape == (32, 64) and layer.state_dict()["o_norm.weight"].shape == (32,)


def test_foreign_cache_is_refused():
    """Neither our dict nor fla's cache protocol (``tests/layers/test_fla_cache.py`` has the protocol)."""
    layer = _layer()
    with pytest.raises(ValueError, match="past_key_values"):
        layer(torch.randn(1, 4, 32, dtype=torch.float64), past_key_values=object())


def _named(fn) -> list:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@pytest.mark.parametrize("name", ["GatedDeltaNet", "KimiDeltaAttention", "DeltaNet", "GatedLinearAttention", "Comba",
                                  "HGRN2Attention", "Mamba2", "RWKV7Attention", "HGRNAttention",
                                  "LinearAttention", "MultiScaleRetention", "RWKV6Attention",
                                  "GatedDeltaProduct"])
def test_signatures_are_fla(name):
    """The constructor and ``forward`` start with fla 0.6.0's named parameters, in fla's order with fla's
    defaults, so positional and keyword calls written for fla bind alike (ours may add parameters after
    them: ``cu_seqlens``, which fla's layers read from ``**kwargs``)."""
    fla_layers = pytest.importorskip("fla.layers")
    for method in ("__init__", "forward"):
        theirs = _named(getattr(getattr(fla_layers, name), method))
        assert _named(getattr(getattr(layers, name), method))[:len(theirs)] == theirs, method

"""fla's decay-family layer classes in ``fastweight.layers.fla_layers_decay``: fla's parameter names;
where fla is importable (with ``TRITON_INTERPRET=1``: ``fastweight.testing.fla_cpu_patches``), fla's
own layer at random init, its state dict loaded strictly into ours, the same outputs (fp32); padding,
packed input and a cache (ours, fla's ``Cache``, fla's layer prefilling and ours decoding) against
the full forward; the refusals."""


import pytest
import torch

from fastweight.layers import HGRNAttention, LinearAttention, MultiScaleRetention, RWKV6Attention
from fastweight.testing import fla_on_cpu, generator, rel_err

QKVO = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
HADAMARD = {f"feature_map_{c}.layer{i}.{p}" for c in "qk" for i in (1, 2) for p in ("weight", "bias")}
FLA_KEYS = {"hgrn": {"i_proj.weight", "f_proj.weight", "g_proj.weight", "g_norm.weight", "o_proj.weight"},
            "la": QKVO | HADAMARD | {"norm.weight"}, "la_elu": QKVO,
            "retnet": QKVO | {"g_proj.weight", "g_norm_swish_gate.weight"}, "retnet_gqa": QKVO | {"g_norm.weight"},
            "rwkv6": {"x_proj.0.mu", "x_proj.0.linear.weight", "x_proj.2.weight", "x_bias", "r_proj.linear.weight",
                      "w_proj.linear.lora.0.weight", "w_proj.linear.lora.2.weight", "w_proj.linear.lora.2.bias",
                      "k_proj.linear.weight", "v_proj.linear.weight", "g_proj.linear.weight", "bonus",
                      "g_norm.weight", "g_norm.bias", "o_proj.weight"}}
LAYERS = {"hgrn": (HGRNAttention, dict(hidden_size=32, expand_ratio=2)),
          "la": (LinearAttention, dict(hidden_size=32, num_heads=2, expand_k=0.5)),
          # fla's other options: a parameter-free map, its normaliser (state (S, z)), grouped k/v heads
          "la_elu": (LinearAttention, dict(hidden_size=32, num_heads=4, num_kv_heads=2, feature_map="elu",
                                           norm_q=True, norm_k=True, do_feature_map_norm=True,
                                           output_norm="identity")),
          "retnet": (MultiScaleRetention, dict(hidden_size=32, num_heads=2, expand_k=0.5, expand_v=1)),
          "retnet_gqa": (MultiScaleRetention, dict(hidden_size=32, num_heads=4, num_kv_heads=2, use_output_gate=False)),
          "rwkv6": (RWKV6Attention, dict(hidden_size=32, num_heads=2, proj_low_rank_dim=8, gate_low_rank_dim=16))}
FLA_CLASSES = {"hgrn": "HGRNAttention", "la": "LinearAttention", "la_elu": "LinearAttention",
               "retnet": "MultiScaleRetention", "retnet_gqa": "MultiScaleRetention", "rwkv6": "RWKV6Attention"}
KINDS = list(LAYERS)


def _layer(kind, dtype=torch.float32, layer_idx=1, **kw):
    torch.manual_seed(0)
    cls, base = LAYERS[kind]
    layer = cls(**{**base, **kw}, layer_idx=layer_idx).to(dtype)
    for p in layer.parameters():   # away from the initialisation's ones and zeros
        p.data.add_(0.1 * torch.randn_like(p))
    return layer


def _call(kind, dtype=torch.float32):
    """The forward keywords a kind takes besides x (HGRN's lower bound)."""
    if kind == "hgrn":
        return dict(lower_bound=torch.rand(64, generator=generator()).to(dtype))
    return {}


def _fla(kind, monkeypatch, ours):
    """fla's layer of ``kind`` holding ``ours``' weights (strict load), runnable on a CPU."""
    fla_layers = fla_on_cpu(monkeypatch)
    theirs = getattr(fla_layers, FLA_CLASSES[kind])(**LAYERS[kind][1], layer_idx=ours.layer_idx).train(ours.training)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs


@pytest.mark.parametrize("kind", KINDS)
def test_against_fla_layer(kind, monkeypatch):
    """fla's own layer at its random init plus noise, its state dict into ours: the same output
    (fp32), in fla's training path and its eval path."""
    ours = _layer(kind).train()
    assert set(ours.state_dict()) == FLA_KEYS[kind]
    theirs = _fla(kind, monkeypatch, ours)
    x = torch.randn(2, 70, LAYERS[kind][1]["hidden_size"], generator=generator())
    call = _call(kind)
    for training in (True, False):
        ours.train(training), theirs.train(training)
        with torch.no_grad():
            got, want = ours(x, **call)[0], theirs(x, **call)[0]
        assert rel_err(got, want) < 1e-5, (training, rel_err(got, want))


@pytest.mark.parametrize("kind", KINDS)
def test_padding_packed_and_cache(kind):
    layer = _layer(kind, torch.float64).eval()
    gen = generator()
    D = LAYERS[kind][1]["hidden_size"]
    a, b = (torch.randn(1, n, D, dtype=torch.float64, generator=gen) for n in (9, 5))
    call = _call(kind, torch.float64)
    x = torch.zeros(2, 9, D, dtype=torch.float64)
    x[0], x[1, 4:] = a[0], b[0]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    o, _, _ = layer(x, attention_mask=mask, **call)
    alone_a, alone_b = layer(a, **call)[0], layer(b, **call)[0]
    assert rel_err(o[0], alone_a[0]) < 1e-12 and rel_err(o[1, 4:], alone_b[0]) < 1e-12
    assert o[1, :4].abs().max() == 0
    packed, _, _ = layer(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 9, 14]), **call)
    assert rel_err(packed, torch.cat([alone_a, alone_b], 1)) < 1e-12
    o1, _, cache = layer(a[:, :6], use_cache=True, **call)
    o2, _, _ = layer(a[:, 6:], past_key_values=cache, use_cache=True, **call)
    assert rel_err(torch.cat([o1, o2], 1), alone_a) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_decode_through_fla_cache(kind):
    """Prefill 7 tokens, then 5 one by one, through fla's ``Cache``: the full forward (fp32)."""
    fla_utils = pytest.importorskip("fla.models.utils")
    layer = _layer(kind, layer_idx=0).eval()
    x = torch.randn(2, 12, LAYERS[kind][1]["hidden_size"], generator=generator())
    call = _call(kind)
    with torch.no_grad():
        full = layer(x, **call)[0]
        cache = fla_utils.Cache()
        outs = [layer(x[:, :7], past_key_values=cache, use_cache=True, **call)]
        outs += [layer(x[:, t:t + 1], past_key_values=cache, use_cache=True, **call) for t in range(7, 12)]
    assert all(out[2] is cache for out in outs) and cache.get_seq_length(0) == 12
    assert rel_err(torch.cat([out[0] for out in outs], 1), full) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_fla_layer_prefills_ours_decodes(kind, monkeypatch):
    """fla's layer prefills into fla's ``Cache``; ours decodes from it to fla's full forward, and
    ours prefilling writes the state fla's writes."""
    fla_utils = pytest.importorskip("fla.models.utils")
    ours = _layer(kind, layer_idx=0).eval()
    theirs = _fla(kind, monkeypatch, ours)
    x = torch.randn(2, 9, LAYERS[kind][1]["hidden_size"], generator=generator())
    call = _call(kind)
    with torch.no_grad():
        want = theirs(x, **call)[0]
        cache = fla_utils.Cache()
        outs = [theirs(x[:, :6], past_key_values=cache, use_cache=True, **call)[0]]
        entry = dict(cache[0])
        outs += [ours(x[:, t:t + 1], past_key_values=cache, use_cache=True, **call)[0] for t in range(6, 9)]
        mine = fla_utils.Cache()
        ours(x[:, :6], past_key_values=mine, use_cache=True, **call)
    assert rel_err(torch.cat(outs, 1), want) <= 1e-5
    # a tuple (S, z) for linear attention with its normaliser
    got, want = (s if isinstance(s, tuple) else (s,) for s in (mine[0]["recurrent_state"], entry["recurrent_state"]))
    assert len(got) == len(want) and all(rel_err(a, b) <= 1e-5 for a, b in zip(got, want))
    if entry["conv_state"] is not None:   # RWKV-6's last token
        assert mine[0]["conv_state"].shape == entry["conv_state"].shape
        assert rel_err(mine[0]["conv_state"], entry["conv_state"]) <= 1e-5


@pytest.mark.parametrize("kind,kw", [("hgrn", dict(use_short_conv=True)), ("hgrn", dict(elementwise_affine=False)),
                                     ("la", dict(feature_map="hedgehog")), ("la", dict(elementwise_affine=False)),
                                     ("retnet", dict(feature_map="swish")), ("retnet", dict(use_short_conv=True)),
                                     ("retnet", dict(gate_fn="sigmoid")), ("rwkv6", dict(gate_fn="sigmoid")),
                                     ("rwkv6", dict(elementwise_affine=False))])
def test_refusals_name_the_argument(kind, kw):
    with pytest.raises(NotImplementedError, match=next(iter(kw))):
        LAYERS[kind][0](**{**LAYERS[kind][1], **kw})
    with pytest.raises(TypeError, match="not_an_option"):
        LAYERS[kind][0](**LAYERS[kind][1], not_an_option=1)


@pytest.mark.parametrize("make", ["dict", "LayerCache", "fla"])
def test_retention_positions_after_padding(make, monkeypatch):
    """RetNet's rotary positions with a cache: a left-padded prefill, then decoding with the mask
    growing (generation's), equals each sequence alone; with fla's ``Cache``, fla's own layer too."""
    from fastweight.layers.fla_cache import LayerCache
    layer = _layer("retnet").eval()
    gen = generator()
    a, b = (torch.randn(1, n, 32, generator=gen) for n in (12, 8))
    x = torch.zeros(2, 12, 32)
    x[0], x[1, 4:] = a[0], b[0]
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    if make == "fla":
        cache = pytest.importorskip("fla.models.utils").Cache()
    else:
        cache = LayerCache() if make == "LayerCache" else None
    with torch.no_grad():
        alone_a, alone_b = layer(a)[0], layer(b)[0]
        outs = [layer(x[:, :9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)]
        cache = outs[0][2]
        outs += [layer(x[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
                 for t in range(9, 12)]
    o = torch.cat([out[0] for out in outs], 1)
    assert rel_err(o[0], alone_a[0]) <= 1e-5 and rel_err(o[1, 4:], alone_b[0]) <= 1e-5
    if make == "fla":
        theirs = _fla("retnet", monkeypatch, layer)
        fla_cache = type(cache)()
        with torch.no_grad():
            want = [theirs(x[:, :9], attention_mask=mask[:, :9], past_key_values=fla_cache, use_cache=True)[0]]
            want += [theirs(x[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=fla_cache,
                            use_cache=True)[0] for t in range(9, 12)]
        want = torch.cat(want, 1)
        assert rel_err(o[0], want[0]) <= 1e-5 and rel_err(o[1, 4:], want[1, 4:]) <= 1e-5

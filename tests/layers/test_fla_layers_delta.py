"""fla's ``GatedDeltaProduct`` layer class (``fastweight.layers.fla_layers_delta``): fla's parameter
names; where fla is importable (with ``TRITON_INTERPRET=1``: ``fastweight.testing.fla_cpu_patches``),
fla's own layer at random init, its state dict loaded strictly into ours, the same outputs (fp32);
padding, packed input and a cache (ours, fla's ``Cache``, fla's layer prefilling and ours decoding)
against the full forward; the refusals."""


import pytest
import torch

from fastweight.layers import GatedDeltaProduct
from fastweight.testing import fla_on_cpu, generator, rel_err

FLA_KEYS = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "a_proj.weight", "A_log", "dt_bias",
            "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "g_proj.weight", "o_norm.weight",
            "o_proj.weight"}
BASE = dict(hidden_size=32, head_dim=8, num_heads=2)
# fla's defaults (2 steps a token, allow_neg_eigval), and 3 steps with grouped value heads
VARIANTS = {"default": {}, "gva": dict(num_householder=3, num_v_heads=4, allow_neg_eigval=False)}


def _layer(variant, dtype=torch.float32, layer_idx=0):
    torch.manual_seed(0)
    layer = GatedDeltaProduct(**BASE, **VARIANTS[variant], layer_idx=layer_idx).to(dtype)
    for p in layer.parameters():   # away from the initialisation's ones and zeros
        p.data.add_(0.1 * torch.randn_like(p))
    return layer


def _fla(variant, monkeypatch, ours):
    fla_layers = fla_on_cpu(monkeypatch)
    theirs = fla_layers.GatedDeltaProduct(**BASE, **VARIANTS[variant], layer_idx=ours.layer_idx)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs.train(ours.training)


@pytest.mark.parametrize("variant", VARIANTS)
def test_against_fla_layer(variant, monkeypatch):
    """fla's layer, its state dict into ours: the same output in fla's chunk (training) and decode
    (eval, T <= 64: fla's fused_recurrent over the T*n substeps) paths."""
    ours = _layer(variant).train()
    assert set(ours.state_dict()) == FLA_KEYS
    theirs = _fla(variant, monkeypatch, ours)
    x = torch.randn(2, 40, 32, generator=generator())
    for training in (True, False):
        ours.train(training), theirs.train(training)
        with torch.no_grad():
            got, want = ours(x)[0], theirs(x)[0]
        assert rel_err(got, want) < 1e-5, (training, rel_err(got, want))


def test_padding_packed_and_cache():
    layer = _layer("gva", torch.float64).eval()
    gen = generator()
    a, b = (torch.randn(1, n, 32, dtype=torch.float64, generator=gen) for n in (9, 5))
    x = torch.zeros(2, 9, 32, dtype=torch.float64)
    x[0], x[1, 4:] = a[0], b[0]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    o = layer(x, attention_mask=mask)[0]
    alone_a, alone_b = layer(a)[0], layer(b)[0]
    assert rel_err(o[0], alone_a[0]) < 1e-12 and rel_err(o[1, 4:], alone_b[0]) < 1e-12
    packed = layer(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 9, 14]))[0]
    assert rel_err(packed, torch.cat([alone_a, alone_b], 1)) < 1e-12
    o1, _, cache = layer(a[:, :6], use_cache=True)
    o2 = layer(a[:, 6:], past_key_values=cache, use_cache=True)[0]
    assert rel_err(torch.cat([o1, o2], 1), alone_a) < 1e-12


@pytest.mark.parametrize("variant", VARIANTS)
def test_fla_layer_prefills_ours_decodes(variant, monkeypatch):
    """fla's layer prefills into fla's ``Cache``; ours decodes from it, token by token, to fla's full
    forward; ours prefilling writes the state and the convolutions' inputs fla's writes; ours alone,
    prefill then decode through fla's ``Cache``, is its full forward."""
    fla_utils = pytest.importorskip("fla.models.utils")
    ours = _layer(variant).eval()
    theirs = _fla(variant, monkeypatch, ours)
    x = torch.randn(2, 9, 32, generator=generator())
    with torch.no_grad():
        want, full = theirs(x)[0], ours(x)[0]
        cache = fla_utils.Cache()
        outs = [theirs(x[:, :6], past_key_values=cache, use_cache=True)[0]]
        entry = dict(cache[0])
        outs += [ours(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0] for t in range(6, 9)]
        mine = fla_utils.Cache()
        alone = [ours(x[:, :6], past_key_values=mine, use_cache=True)[0]]
        mine_entry = dict(mine[0])
        alone += [ours(x[:, t:t + 1], past_key_values=mine, use_cache=True)[0] for t in range(6, 9)]
    assert rel_err(torch.cat(outs, 1), want) <= 1e-5 and rel_err(torch.cat(alone, 1), full) <= 1e-5
    assert rel_err(mine_entry["recurrent_state"], entry["recurrent_state"]) <= 1e-5
    for a, b in zip(mine_entry["conv_state"], entry["conv_state"]):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("kw", [dict(use_output_gate=False), dict(use_short_conv=False), dict(conv_bias=True),
                                dict(use_forget_gate=False)])
def test_refusals_name_the_argument(kw):
    with pytest.raises(NotImplementedError, match=next(iter(kw))):
        GatedDeltaProduct(**BASE, **kw)
    with pytest.raises(TypeError, match="not_an_option"):
        GatedDeltaProduct(**BASE, not_an_option=1)

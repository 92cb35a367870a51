import math

import pytest
import torch

from fastweight.layers.common import mamba_decay_init
from fastweight.layers.rwkv import rwkv7_channel_mix_init, rwkv7_init
from fastweight.models import LanguageModel, LMConfig


def test_rwkv7_init_spans_slow_to_fast_channels():
    """The official decay init: the log decay -e^-1/2 sigmoid(w0) runs from ~-2e-4 (a horizon of
    thousands of tokens) to ~-0.58 over the channels, and within every head (the zigzag) over a factor
    of 20 or more, in every layer; a linear spread over [-4, 2] (the former init) bottomed out at
    -0.011, a 90-token horizon, so nothing held a pair across 128 tokens (docs/results/tiny_mqar_sweep.md)."""
    for layer in range(4):
        init = rwkv7_init(64, 4, 16, 16, layer, 4)
        log_decay = -math.exp(-0.5) * torch.sigmoid(init["w0"]).view(4, 16)
        assert -1 / float(log_decay.max()) > 1000 and float(log_decay.min()) < -0.5
        assert (log_decay.min(-1).values / log_decay.max(-1).values > 20).all()
        a = torch.sigmoid(init["a0"])
        assert 0.3 < float(a.mean()) < 0.6 and (a > 0).all() and (a < 1).all()
        assert init["xi"].shape == init["alpha"].shape == init["rho"].shape == (4, 16)
        assert torch.all(init["alpha"] == 1.02) and torch.all(init["rho"] == -0.04)
        mu = init["mu"]
        assert mu.shape == (6, 64) and (mu >= 0).all() and (mu <= 1).all() and torch.all(mu[:, 0] == 1.0)
    first, last = (rwkv7_init(64, 4, 16, 16, i, 4)["mu"] for i in (0, 3))
    assert (last <= first + 1e-6).all() and float(last.mean()) < float(first.mean())   # deeper: nearer x_t
    mu_k = rwkv7_channel_mix_init(64, 0, 4)
    assert mu_k.shape == (64,) and float(mu_k[0]) == 1.0 and float(mu_k[-1]) < 0.05


@pytest.mark.parametrize("official", [False, True])
def test_the_model_applies_rwkv7_init_per_layer(official):
    """LanguageModel calls each layer's reset_layer_parameters after its generic init: the rwkv7 mixer's
    w0, a0, v0, xi, alpha, rho, mu and the channel mix's mu_k, and in the official form the same values
    as the LoRAs' output biases and x_*, k_k, k_a, r_k (made as zeros), are rwkv7_init's for that layer."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=16, d_model=32, n_layers=3, n_heads=2, mixer="rwkv7", lora_rank=4,
                   rwkv7_official=official)
    model = LanguageModel(cfg)
    for i, block in enumerate(model.blocks):
        init, m = rwkv7_init(32, 2, 16, 16, i, 3), block.mixer
        assert torch.equal(block.mlp.mu_k, rwkv7_channel_mix_init(32, i, 3))
        if official:
            assert torch.equal(m.w_lora.up.bias, init["w0"]) and torch.equal(m.a_lora.up.bias, init["a0"])
            assert (m.v_lora is None) == (i == 0) and (i == 0 or torch.equal(m.v_lora.up.bias, init["v0"]))
            assert torch.equal(m.x_w.flatten(), init["mu"][1]) and torch.equal(m.k_k, init["xi"].flatten())
            assert torch.equal(m.k_a, init["alpha"].flatten()) and torch.equal(m.r_k, init["rho"])
        else:
            for name in ("mu", "w0", "a0", "v0", "xi", "alpha", "rho"):
                assert torch.equal(getattr(m, name), init[name]), name


def test_gated_deltanet_draws_a_from_zero_to_sixteen():
    """GDN's A = exp(A_log) is uniform in (0, 16) as fla's GatedDeltaNet draws it (Mamba-2's [1, 16]
    stays Mamba-2's and KDA's); dt starts log-uniform in [1e-3, 0.1] for both."""
    torch.manual_seed(0)
    A_log, dt_bias = mamba_decay_init(4096, a_range=(0, 16))
    A, dt = A_log.detach().exp(), torch.nn.functional.softplus(dt_bias.detach())
    assert float(A.min()) < 0.05 and float(A.max()) <= 16 and abs(float(A.mean()) - 8) < 0.3
    assert float(dt.min()) >= 1e-3 * 0.999 and float(dt.max()) <= 0.1 * 1.001
    A_log, _ = mamba_decay_init(4096)
    assert float(A_log.detach().exp().min()) >= 1.0
    from fastweight.layers import build_mixer
    gdn = build_mixer("gdn", LMConfig(vocab_size=16, d_model=64, n_layers=1, n_heads=2, mixer="gdn"))
    assert float(gdn.A_log.detach().exp().max()) <= 16

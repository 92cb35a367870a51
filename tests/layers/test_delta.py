"""The delta-rule mixers with grouped value heads (``LMConfig.n_v_heads``): a mixer with n_v_heads
value heads per n_heads query/key heads is the ungrouped mixer whose query/key heads are repeated
per group, parameter for parameter; the LM decodes from its cache as it runs the whole sequence."""

import pytest
import torch

from fastweight.layers import build_mixer
from fastweight.models import LanguageModel, LMConfig
from fastweight.testing import rel_err

DELTA = ["deltanet", "gdn", "kda", "comba", "longhorn"]


def _repeat_heads(t: torch.Tensor, H: int, group: int, dim: int = 0) -> torch.Tensor:
    """A [.., H * d, ..] tensor with each head's block repeated ``group`` times along ``dim``."""
    return t.unflatten(dim, (H, -1)).repeat_interleave(group, dim=dim).flatten(dim, dim + 1)


@pytest.mark.parametrize("mixer", DELTA)
def test_grouped_value_heads_are_repeated_key_heads(mixer):
    H, HV, D = 2, 4, 32
    cfg = LMConfig(vocab_size=16, d_model=D, n_layers=1, n_heads=H, n_v_heads=HV, head_dim=8, mixer=mixer)
    torch.manual_seed(0)
    grouped = build_mixer(mixer, cfg).double()
    for p in grouped.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    flat = build_mixer(mixer, cfg.replace(n_heads=HV, n_v_heads=None)).double()
    state = dict(grouped.state_dict())
    for name in ("q_proj.weight", "k_proj.weight", "q_conv.weight", "k_conv.weight"):
        state[name] = _repeat_heads(state[name], H, HV // H)
    if "d_logit" in state:
        state["d_logit"] = state["d_logit"].repeat_interleave(HV // H)
    flat.load_state_dict(state)
    x = torch.randn(2, 70, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    o = grouped(x)
    assert rel_err(o, flat(x)) < 1e-12
    o.sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in grouped.parameters())


@pytest.mark.parametrize("mixer", ["gdn", "kda"])
def test_grouped_lm_decodes_from_its_cache(mixer):
    cfg = LMConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_v_heads=4, mixer=f"{mixer},swa", window_size=8)
    torch.manual_seed(0)
    model = LanguageModel(cfg).double().eval()
    ids = torch.randint(0, 32, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :7], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(7, 21)]
    assert rel_err(torch.cat(parts, 1), full) < 1e-10


def test_grouped_value_heads_are_checked():
    with pytest.raises(ValueError, match="n_v_heads \\(6\\) must be a multiple of n_heads \\(4\\)"):
        LMConfig(n_heads=4, n_v_heads=6)
    with pytest.raises(ValueError, match="grouped value heads are for the delta-rule mixers.*mamba2"):
        LMConfig(n_heads=4, n_v_heads=8, mixer="gdn,mamba2")


@pytest.mark.parametrize("n", [1, 3])
def test_deltaproduct_householder_steps(n):
    """LMConfig.num_householder sets the gdp mixer's steps a token (its k, v, beta projections n times
    as wide); the model decodes from its cache as it prefills; other mixers refuse the field by name."""
    cfg = LMConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, mixer="gdp", num_householder=n)
    torch.manual_seed(0)
    model = LanguageModel(cfg).double().eval()
    mixer = model.layers[0].mixer if hasattr(model, "layers") else next(m for m in model.modules()
                                                                       if hasattr(m, "num_householder"))
    assert mixer.num_householder == n
    ids = torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :5], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(5, 13)]
    assert rel_err(torch.cat(parts, 1), full) < 1e-10
    with pytest.raises(ValueError, match="num_householder is the Gated DeltaProduct mixer's"):
        LMConfig(mixer="gdn", num_householder=3)

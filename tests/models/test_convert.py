"""fla checkpoints in and out (``fastweight.models.convert``).

With fla 0.6.0 importable (``pip install flash-linear-attention==0.6.0``; CPU is enough): fla's own
``*ForCausalLM`` at random init, saved with ``save_pretrained``, converted, and its logits compared
with ours, and back. fla's Triton kernels do not run on a CPU: its norms, convolutions and L2 norm
run in Triton's interpreter and its layers' recurrence calls go to fla's own PyTorch references
(``fastweight.testing.fla_cpu_patches``; run with ``TRITON_INTERPRET=1``). Without fla: the names and shapes
of fla's tiny models, recorded in ``tests/data/fla_0.6.0_models.json``, load strictly and map back.
"""

import json
import os
import sys

import pytest
import torch

from fastweight.models.convert import (FLA_MODELS, fla_config_from_lm, from_fla, lm_config_from_fla, load_fla,
                                       save_fla, state_dict_to_fla, state_from_fla)
from fastweight.testing import fla_cpu_patches, fla_on_cpu, rel_err

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "fla_0.6.0_models.json")
# the tiny configs (fla's config.json fields) of the recorded names and the logit tests
TINY = {"gated_deltanet": dict(head_dim=16, num_heads=2, num_v_heads=4, expand_v=2.0, allow_neg_eigval=True),
        "kda": dict(head_dim=16, num_heads=2),
        # KDA's options (a name "type/variant": model_type before the slash)
        "kda/gva_expand_v": dict(head_dim=16, num_heads=2, num_v_heads=4, expand_v=2.0),
        "kda/lower_bound": dict(head_dim=16, num_heads=2, lower_bound=-3.0),
        "kda/safe_gate": dict(head_dim=16, num_heads=2, safe_gate=True, lower_bound=-5.0),
        "delta_net": dict(num_heads=2, expand_k=0.5, expand_v=1.0),
        "comba": dict(head_dim=16, num_heads=2, num_v_heads=4, expand_v=2.0),
        "hgrn2": dict(num_heads=2, expand_ratio=None),
        "hgrn2/no_lower_bound": dict(expand_ratio=16, use_lower_bound=False, tie_word_embeddings=True),
        # fla's hybrid attention layers (attn: full; with window_size: sliding window)
        "gated_deltanet/attn": dict(head_dim=16, num_heads=2, attn=dict(layers=[1], num_heads=4, num_kv_heads=2)),
        "hgrn2/swa": dict(num_heads=2, expand_ratio=None, attn=dict(layers=[0], num_heads=2, window_size=8)),
        "kda/swa_attn": dict(head_dim=16, num_heads=2, num_hidden_layers=3,
                             attn=[dict(layers=[0], num_heads=4, window_size=8, rope_theta=500.0),
                                   dict(layers=[2], num_heads=4, rope_theta=500.0)]),
        "gla": dict(num_heads=2, expand_k=0.5, expand_v=1.0, tie_word_embeddings=True),
        "mamba2": dict(head_dim=16, state_size=16, expand=2),
        "rwkv7": dict(hidden_size=128, head_dim=64, decay_low_rank_dim=32, a_low_rank_dim=32, v_low_rank_dim=16,
                      gate_low_rank_dim=32),
        "rwkv7/head_dim_32": dict(hidden_size=128, head_dim=32, decay_low_rank_dim=32, a_low_rank_dim=32,
                                  v_low_rank_dim=16, gate_low_rank_dim=32)}
COMMON = dict(hidden_size=64, num_hidden_layers=2, vocab_size=128, fuse_cross_entropy=False)


def _type(name: str) -> str:
    """fla's model_type of a TINY entry."""
    return name.split("/")[0]


def _tiny(name: str) -> dict:
    return {"model_type": _type(name), **COMMON, **TINY[name]}


@pytest.mark.parametrize("name", list(TINY))
def test_recorded_fla_names_load_strictly_and_map_back(name):
    with open(DATA) as f:
        recorded = json.load(f)[name]
    state = {name: torch.randn(shape) for name, shape in recorded["tensors"].items()}
    model = from_fla(recorded["config"], state)   # strict
    assert model.num_parameters() == recorded["parameters"]
    back = state_dict_to_fla(model.state_dict(), model.cfg)
    if model.cfg.tie_embeddings:
        back.pop("lm_head.weight")
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[n], state[n]) for n in state)


def test_config_round_trip():
    for name in TINY:
        cfg = lm_config_from_fla(_tiny(name))
        assert lm_config_from_fla(fla_config_from_lm(cfg)) == cfg


@pytest.mark.parametrize("change, message", [(dict(attn=dict(layers=[1], num_heads=2, qkv_bias=True)), "qkv_bias"),
                                             (dict(attn=[dict(layers=[0], num_heads=2), dict(layers=[1], num_heads=4)]),
                                              "num_heads"),
                                             (dict(attn=[dict(layers=[0], num_heads=2, window_size=4),
                                                         dict(layers=[1], num_heads=2, window_size=8)]), "window_size"),
                                             (dict(hidden_act="gelu"), "hidden_act"),
                                             (dict(use_gate=False), "use_gate"),
                                             (dict(model_type="mamba3"), "not supported")])
def test_unsupported_options_are_refused_by_name(change, message):
    with pytest.raises((NotImplementedError, ValueError), match=message):
        lm_config_from_fla({**_tiny("gated_deltanet"), **change})


@pytest.mark.parametrize("change, message", [(dict(head_dim=48), "head_dim"),
                                             (dict(head_dim=32, num_heads=2), "head_dim"),
                                             (dict(norm_first=False), "norm_first"),
                                             (dict(norm_bias=False), "norm_bias"), (dict(value_dim=256), "value_dim"),
                                             (dict(hidden_act="gelu"), "hidden_act"),
                                             (dict(attn=dict(layers=[1], num_heads=2)), "hybrid attention")])
def test_rwkv7_unsupported_options_are_refused_by_name(change, message):
    with pytest.raises(NotImplementedError, match=message):
        lm_config_from_fla({**_tiny("rwkv7"), **change})


@pytest.mark.parametrize("change, error, message", [
    (dict(lower_bound=0.5), ValueError, "lower_bound"),
    (dict(safe_gate=True), ValueError, "safe_gate"),
    (dict(safe_gate=True, lower_bound=-6.0), ValueError, "safe_gate"),
    (dict(expand_v=1.1), ValueError, "expand_v"),
    (dict(use_short_conv=False), NotImplementedError, "use_short_conv")])
def test_kda_options_are_checked_by_name(change, error, message):
    with pytest.raises(error, match=message):
        lm_config_from_fla({**_tiny("kda"), **change})


def test_kda_options_map_onto_the_lm():
    """fla's gate maps have rank head_v_dim; lower_bound bounds the gate; safe_gate is a kernel choice
    (not kept: fla's result is the same without it)."""
    cfg = lm_config_from_fla(_tiny("kda/gva_expand_v"))
    assert (cfg.n_v_heads, cfg.head_v_dim, cfg.kda_gate_rank, cfg.kda_lower_bound) == (4, 32, 32, None)
    cfg = lm_config_from_fla(_tiny("kda/safe_gate"))
    assert cfg.kda_gate_rank is None and cfg.kda_lower_bound == -5.0
    assert fla_config_from_lm(cfg)["lower_bound"] == -5.0 and fla_config_from_lm(cfg)["safe_gate"] is False
    with pytest.raises(NotImplementedError, match="kda_gate_rank"):
        fla_config_from_lm(cfg.replace(expand_v=2.0))   # our own rank (head_dim) is not fla's (head_v_dim)


def test_kda_config_fields_are_checked():
    from fastweight.models import LMConfig
    with pytest.raises(ValueError, match="kda_lower_bound"):
        LMConfig.preset("tiny", mixer="kda", kda_lower_bound=0.1)
    with pytest.raises(ValueError, match="kda_gate_rank"):
        LMConfig.preset("tiny", mixer="gdn", kda_gate_rank=8)
    with pytest.raises(ValueError, match="kda_gate_rank"):
        LMConfig.preset("tiny", mixer="kda", kda_gate_rank=0)


@pytest.mark.parametrize("name, change, message", [
    ("comba", dict(use_output_gate=False), "use_output_gate"), ("comba", dict(use_short_conv=False), "use_short_conv"),
    ("hgrn2", dict(use_short_conv=True), "use_short_conv"), ("hgrn2", dict(elementwise_affine=False), "elementwise_affine"),
    ("hgrn2", dict(num_heads=2, expand_ratio=16), "expand_ratio")])
def test_comba_hgrn2_unsupported_options_are_refused_by_name(name, change, message):
    with pytest.raises(NotImplementedError, match=message):
        lm_config_from_fla({**_tiny(name), **change})


def test_comba_hgrn2_are_fla_forms():
    """fla's Comba and HGRN2 models load into LMConfig(fla_form=True) (HGRN2's lower bounds a model
    parameter); the LM's own comba / hgrn2 mixers (other forms) do not go to fla."""
    from fastweight.models import LMConfig
    comba, hgrn2 = lm_config_from_fla(_tiny("comba")), lm_config_from_fla(_tiny("hgrn2"))
    assert comba.fla_form and (comba.n_v_heads, comba.head_v_dim) == (4, 32) and not comba.hgrn2_lower_bounds
    assert hgrn2.fla_form and hgrn2.hgrn2_lower_bounds and (hgrn2.n_heads, hgrn2.head_dim, hgrn2.head_v_dim) == (2, 32, 32)
    assert not lm_config_from_fla(_tiny("hgrn2/no_lower_bound")).hgrn2_lower_bounds
    for mixer in ("comba", "hgrn2"):
        with pytest.raises(NotImplementedError, match="fla_form"):
            fla_config_from_lm(LMConfig.preset("tiny", mixer=mixer))
    with pytest.raises(ValueError, match="allow_neg_eigval"):   # fla-form Comba has no [-1, 1] form at all
        fla_config_from_lm(comba.replace(allow_neg_eigval=True))
    with pytest.raises(ValueError, match="fla_form"):
        LMConfig.preset("tiny", mixer="gdn", fla_form=True)
    with pytest.raises(ValueError, match="hgrn2_lower_bounds"):
        LMConfig.preset("tiny", mixer="hgrn2", hgrn2_lower_bounds=True)


@pytest.mark.parametrize("name", ["comba", "hgrn2"])
def test_fla_form_lm_decodes_as_it_prefills(name):
    """LMConfig(fla_form=True) (HGRN2 with its lower bounds): the cache carries the fla forms' state."""
    from fastweight.models import LanguageModel
    torch.manual_seed(0)
    model = LanguageModel(lm_config_from_fla(_tiny(name))).double().eval()
    if model.lower_bounds is not None:
        with torch.no_grad():
            model.lower_bounds.normal_()
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :7], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(7, 12)]
    assert rel_err(torch.cat(steps, 1), full) < 1e-12


def test_hybrid_attention_layers():
    """fla's attn specs as attn / swa layers of the LM, their heads, window and rope_theta; back the same."""
    cfg = lm_config_from_fla(_tiny("kda/swa_attn"))
    assert cfg.mixers == ("swa", "kda", "attn") and cfg.attention_heads == 4 and cfg.n_heads == 2
    assert (cfg.window_size, cfg.rope_theta, cfg.n_kv_heads) == (8, 500.0, None)
    back = fla_config_from_lm(cfg)["attn"]
    assert [(s["layers"], s["window_size"]) for s in back] == [([2], None), ([0], 8)]
    cfg = lm_config_from_fla(_tiny("gated_deltanet/attn"))
    assert cfg.mixers == ("gdn", "attn") and (cfg.attn_heads, cfg.n_kv_heads) == (4, 2)


def test_a_model_without_mlp_goes_to_fla_only_as_mamba2():
    """fla's blocks all have an MLP but Mamba-2's, which has none in either library."""
    from fastweight.models import LMConfig
    with pytest.raises(NotImplementedError, match="use_mlp"):
        fla_config_from_lm(LMConfig.preset("tiny", mixer="gdn", use_mlp=False))
    mamba2 = LMConfig.preset("tiny", mixer="mamba2")
    assert fla_config_from_lm(mamba2.replace(use_mlp=False)) == fla_config_from_lm(mamba2)


def test_rwkv7_is_the_official_form():
    """fla's RWKV7ForCausalLM is LMConfig(rwkv7_official=True), the config of an official .pth;
    the LM's own rwkv7 mixer (another form) does not go to fla."""
    from fastweight.models import LMConfig
    cfg = lm_config_from_fla(_tiny("rwkv7"))
    assert cfg.rwkv7_official and cfg.rwkv7_ranks == (32, 32, 16, 32) and cfg.n_heads == 2 and cfg.norm_eps == 1e-5
    assert cfg.intermediate_size is None   # fla's 4 * hidden_size, the official width
    with pytest.raises(NotImplementedError, match="rwkv7_official"):
        fla_config_from_lm(LMConfig(vocab_size=16, d_model=128, n_layers=2, n_heads=2, mixer="rwkv7", head_dim=64))
    with pytest.raises(NotImplementedError, match="rwkv7_group_norm_eps"):
        fla_config_from_lm(cfg.replace(n_heads=4, head_dim=32))   # the official eps, not fla's at head_dim 32
    small = lm_config_from_fla(_tiny("rwkv7/head_dim_32"))
    assert (small.n_heads, small.head_dim, small.rwkv7_ln_x_eps) == (4, 32, 32 * 1e-5)
    assert fla_config_from_lm(small)["head_dim"] == 32 and cfg.rwkv7_group_norm_eps is None
    with pytest.raises(ValueError, match="rwkv7_group_norm_eps"):
        LMConfig.preset("tiny", mixer="rwkv7", rwkv7_group_norm_eps=1e-3)   # the official form's option


def test_only_single_mixer_models_go_to_fla():
    from fastweight.models import LMConfig
    with pytest.raises(NotImplementedError, match="one mixer"):
        fla_config_from_lm(LMConfig.preset("tiny", mixer="gdn,mamba2"))
    with pytest.raises(NotImplementedError, match="hybrid attention"):
        fla_config_from_lm(LMConfig.preset("tiny", mixer="mamba2,attn"))
    with pytest.raises(NotImplementedError, match="allow_neg_eigval"):   # fla's Mamba2 has only [0, 1]
        fla_config_from_lm(LMConfig.preset("tiny", mixer="mamba2", allow_neg_eigval=True))


def test_state_layout():
    s = torch.randn(2, 3, 5, 4)
    assert state_from_fla(s).shape == (2, 3, 4, 5) and torch.equal(state_from_fla(state_from_fla(s)), s)


def _recorded_folder(path, model_type):
    """An fla folder with the recorded names and shapes, random tensors (no fla needed)."""
    from safetensors.torch import save_file
    with open(DATA) as f:
        recorded = json.load(f)[model_type]
    gen = torch.Generator().manual_seed(0)
    state = {n: 0.1 * torch.randn(shape, generator=gen) for n, shape in recorded["tensors"].items()}
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(recorded["config"], f)
    save_file(state, os.path.join(path, "model.safetensors"))
    return state


# every family fla's hub holds (fla's model_type; a hybrid KDA with window and full attention layers)
@pytest.mark.parametrize("model_type", ["gated_deltanet", "kda", "delta_net", "gla", "mamba2", "rwkv7", "hgrn2", "comba",
                                        "kda/swa_attn"])
def test_cli_convert_both_ways_and_from_pretrained(model_type, tmp_path):
    pytest.importorskip("transformers")
    from fastweight import cli
    from fastweight.models.hf import FastweightForCausalLM
    from fastweight.models.convert import read_folder
    state = _recorded_folder(str(tmp_path / "fla"), model_type)
    assert cli.main(["convert", str(tmp_path / "fla"), str(tmp_path / "ours")]) == 0
    ids = torch.randint(0, COMMON["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(2))
    direct = load_fla(str(tmp_path / "fla")).eval()
    with torch.no_grad():
        expected = direct(ids)
        for model in (FastweightForCausalLM.from_pretrained(str(tmp_path / "ours")),
                      FastweightForCausalLM.from_pretrained(str(tmp_path / "fla"))):
            assert torch.equal(model.eval()(ids).logits, expected)
    assert cli.main(["convert", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    _, back = read_folder(str(tmp_path / "back"))
    assert sorted(back) == sorted(state) and all(torch.equal(back[n], state[n]) for n in state)


# fla's models, where fla is importable


@pytest.fixture
def fla_models(monkeypatch):
    return fla_on_cpu(monkeypatch, "fla.models")


def _fla_model(fla_models, name):
    arch = FLA_MODELS[_type(name)].architecture
    config_class = getattr(fla_models, arch.replace("ForCausalLM", "Config"))
    config = config_class(**{k: v for k, v in _tiny(name).items() if k != "model_type"})
    torch.manual_seed(0)
    model = getattr(fla_models, arch)(config)
    with torch.no_grad():
        for p in model.parameters():   # away from the initialisation's ones and zeros
            p.add_(0.05 * torch.randn_like(p))
    return model.train()   # fla's chunk path (its eval decode path is the same op, fused_recurrent)


@pytest.mark.parametrize("name", list(TINY))
def test_fla_checkpoint_logits(name, fla_models, tmp_path):
    """fla's model (its chunk path) against ours, decode (fused recurrent) and chunk paths."""
    theirs = _fla_model(fla_models, name)
    theirs.save_pretrained(tmp_path / "fla")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        ours = load_fla(str(tmp_path / "fla"))
        assert ours.num_parameters() == sum(p.numel() for p in theirs.parameters())
        for mode in ("eval", "train"):
            got = getattr(ours, mode)()(ids)
            assert rel_err(got, expected) <= 1e-5, (mode, rel_err(got, expected))
        save_fla(ours, str(tmp_path / "back"))
        again = type(theirs).from_pretrained(tmp_path / "back").train()
        assert rel_err(again(ids).logits, expected) <= 1e-5


def record(path: str = DATA) -> None:
    """Write ``tests/data/fla_0.6.0_models.json`` from fla's tiny models (needs fla importable)."""
    import fla.models as fla_models
    for owner, name, value in fla_cpu_patches():   # fla's attention layers need flash-attn otherwise
        setattr(owner, name, value)
    out = {}
    for name in TINY:
        model = _fla_model(fla_models, name)
        state = {n: list(t.shape) for n, t in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        out[name] = dict(config=_tiny(name), parameters=sum(p.numel() for p in model.parameters()), tensors=state)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":   # python tests/models/test_convert.py record
    if sys.argv[1:] == ["record"]:
        record()

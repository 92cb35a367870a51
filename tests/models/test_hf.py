import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from fastweight.models import Block, LMConfig, LanguageModel  # noqa: E402
from fastweight.models.hf import FastweightConfig, FastweightForCausalLM  # noqa: E402
from fastweight.testing import generator  # noqa: E402


def hf_model(mixer="gdn,swa"):
    torch.manual_seed(0)
    return FastweightForCausalLM(FastweightConfig(mixer=mixer, vocab_size=64, d_model=64, n_layers=2, n_heads=2,
                                                  window_size=8)).eval()


def ids(B=2, T=5):
    return torch.randint(0, 64, (B, T), generator=generator())


def test_save_load_round_trip(tmp_path):
    model = hf_model()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert isinstance(AutoConfig.from_pretrained(tmp_path), FastweightConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, FastweightForCausalLM)
    assert loaded.model.lm_head.weight is loaded.model.embed.weight
    assert loaded.config.to_lm_config() == model.config.to_lm_config()
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("mixer", ["gdn,swa", "rwkv7,mamba2"])
def test_generate_uses_the_cache_and_matches_the_plain_model(mixer):
    model = hf_model(mixer)
    lengths = []
    model.model.embed.register_forward_hook(lambda m, inp, out: lengths.append(inp[0].shape[1]))
    x = ids(T=7)
    out = model.generate(x, max_new_tokens=5, do_sample=False)
    assert lengths[0] == 7 and set(lengths[1:]) == {1}, lengths
    assert torch.equal(out, model.model.generate(x, max_new_tokens=5))


def test_beam_search_with_the_cache_matches_beam_search_without():
    model = hf_model()
    x = ids(T=5)
    assert torch.equal(model.generate(x, max_new_tokens=4, num_beams=3),
                       model.generate(x, max_new_tokens=4, num_beams=3, use_cache=False))


def test_mismatched_config_is_refused(tmp_path):
    hf_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="n_layers: checkpoint 2, config 3"):
        AutoModelForCausalLM.from_pretrained(tmp_path, n_layers=3)
    with pytest.raises(ValueError, match="mixer"):
        FastweightForCausalLM.from_pretrained(tmp_path, config=FastweightConfig(
            mixer="gdn", vocab_size=64, d_model=64, n_layers=2, n_heads=2, window_size=8))


def test_loss_labels_and_conversion():
    plain = LanguageModel(LMConfig.preset("tiny", mixer="gdn", vocab_size=64))
    model = FastweightForCausalLM.from_language_model(plain)
    x = ids(T=9)
    out = model(x, labels=x)
    ref = torch.nn.functional.cross_entropy(plain(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert torch.allclose(out.loss, ref, rtol=1e-5)
    with pytest.raises(ValueError, match="attention_mask"):
        model(x, attention_mask=torch.zeros_like(x))
    for labels in (x[:, :5], torch.full_like(x, 64)):
        with pytest.raises(ValueError, match="labels"):
            model(x, labels=labels)
    model(x, labels=x.masked_fill(x > 30, -100))  # -100: not scored
    with pytest.raises(ValueError, match="mixer"):
        FastweightConfig(mixer="transformer")


def test_config_takes_transformers_names_and_refuses_unknown_ones(tmp_path):
    """FastweightConfig(hidden_size=128, num_hidden_layers=2) builds that model (not the defaults), the
    standard names read back, a typo is a TypeError naming it, and a saved config loads back the same."""
    cfg = FastweightConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                           num_key_value_heads=2, rms_norm_eps=1e-5, bos_token_id=1)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps) == (128, 2, 4, 2, 1e-5)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 2, 4)
    model = FastweightForCausalLM(cfg)
    assert len(model.model.blocks) == 2 and model.model.embed.weight.shape == (64, 128)
    with pytest.raises(TypeError, match="hidden_sise"):
        FastweightConfig(hidden_sise=128)
    with pytest.raises(ValueError, match="hidden_size.*d_model"):
        FastweightConfig(hidden_size=128, d_model=64)
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert back.to_lm_config() == cfg.to_lm_config() and back.bos_token_id == 1


def test_auto_classes_load_in_a_fresh_process(tmp_path):
    """A saved model loads with transformers' Auto classes in a new process once `fastweight.models.hf` is
    imported (the import registers "fastweight" with AutoConfig / AutoModelForCausalLM)."""
    import subprocess
    import sys
    hf_model("gdn").save_pretrained(tmp_path)
    load = f"from transformers import AutoModelForCausalLM; m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})"
    ok = subprocess.run([sys.executable, "-c", "import fastweight.models.hf; " + load + "; print(type(m).__name__)"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "FastweightForCausalLM" in ok.stdout, ok.stderr[-2000:]


def edited_checkpoint(tmp_path, **changes):
    """A saved gdn model whose config.json is then edited: the weights no longer fill its model."""
    import json
    hf_model("gdn").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return tmp_path


@pytest.mark.parametrize("changes, report", [
    (dict(n_layers=3), r"18 missing key\(s\): model\.blocks\.2\.mixer\.A_log"),
    (dict(n_layers=1), r"18 unexpected key\(s\): model\.blocks\.1\.mixer\.A_log"),
    (dict(mixer="la"), r"unexpected key\(s\): model\.blocks\.0\.mixer\.A_log"),
    (dict(mixer="gdn,mamba2"), r"missing key\(s\): model\.blocks\.1\.mixer\.\w+.*unexpected key\(s\)"),
    (dict(d_model=128), r"26 mismatched key\(s\): model\.blocks\.0\.mixer\.a_proj\.weight "
                        r"\(checkpoint \(2, 64\), model \(2, 128\)\)"),
])
def test_weights_that_do_not_fill_the_config_are_refused(tmp_path, changes, report):
    path = edited_checkpoint(tmp_path, **changes)
    with pytest.raises(ValueError, match=report) as error:
        AutoModelForCausalLM.from_pretrained(path)
    assert str(path) in str(error.value) and "strict=False" in str(error.value)


def test_not_strict_initialises_the_missing_tensors_as_a_new_model(tmp_path, monkeypatch):
    """strict=False: the third block, absent from the checkpoint, is a new Block as the LanguageModel
    initialises it (the same tensors from the same seed; the memory that transformers leaves to
    `_init_weights` is filled with NaN here, so none of it may remain)."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    saved = hf_model("gdn")
    path = edited_checkpoint(tmp_path, n_layers=3)
    torch.manual_seed(1)
    loaded = FastweightForCausalLM.from_pretrained(path, strict=False)
    torch.manual_seed(1)
    new = Block(loaded.model.cfg, "gdn").apply(loaded.model._init_weights)
    for name, p in new.named_parameters():
        assert torch.equal(loaded.model.blocks[2].get_parameter(name), p), name
    for name, p in saved.model.named_parameters():
        assert torch.equal(loaded.model.get_parameter(name), p), name
    assert all(torch.isfinite(p).all() for p in loaded.parameters())
    assert loaded.model.lm_head.weight is loaded.model.embed.weight


def test_ignore_mismatched_sizes_initialises_them(tmp_path, monkeypatch):
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    path = edited_checkpoint(tmp_path, d_model=128)
    loaded = AutoModelForCausalLM.from_pretrained(path, ignore_mismatched_sizes=True)
    assert loaded.model.embed.weight.shape == (64, 128) and loaded.model.lm_head.weight is loaded.model.embed.weight
    assert all(torch.isfinite(p).all() for p in loaded.parameters())
    assert 0.015 < loaded.model.embed.weight.std() < 0.025 and torch.equal(loaded.model.norm.weight, torch.ones(128))


def test_a_new_model_is_initialised_once_by_the_language_model():
    """post_init leaves the LanguageModel's own initialisation (the same weights from the same seed)
    and no transformers mark on the tensors (a mark would hide them from the missing-key report)."""
    hf = hf_model("gdn,rwkv7")
    torch.manual_seed(0)
    plain = LanguageModel(hf.config.to_lm_config())
    for name, p in plain.named_parameters():
        assert torch.equal(hf.model.get_parameter(name), p), name
    assert not any(hasattr(p, "_is_hf_initialized") for p in hf.parameters())

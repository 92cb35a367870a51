import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from fastweight.models import LMConfig, LanguageModel  # noqa: E402
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

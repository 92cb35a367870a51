import pytest
import torch

from fastweight.models import MIXERS, LMConfig, LanguageModel
from fastweight.testing import generator, rel_err



def tiny(mixer, **kw):
    torch.manual_seed(0)
    return LanguageModel(LMConfig.preset("tiny", mixer=mixer, vocab_size=64, **kw))


def ids(B=2, T=21, seed=None):
    return torch.randint(0, 64, (B, T), generator=generator(seed))


@pytest.mark.parametrize("mixer", list(MIXERS) + ["gdn,swa", "mamba2,gdn,swa", "rwkv7,swa,rwkv7"])
def test_prefill_then_decode_matches_one_pass(mixer):
    model = tiny(mixer, n_layers=3 if "," in mixer else 2).eval()
    x = ids()
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        parts = [model(x[:, :7], cache=cache), model(x[:, 7:13], cache=cache)]  # prefill in two chunks
        parts += [model(x[:, t:t + 1], cache=cache) for t in range(13, 21)]
    assert cache.seen == 21
    # measured worst 2.1e-5 (hgrn2 at seed 1344870754691273968, the same on a5799ae; over 151 seeds the
    # next is 1.3e-5, median 7e-7: a heavy tail of fp32 rounding; the others < 1e-6); issue 6 asks 1e-4
    assert rel_err(torch.cat(parts, 1), full) < 5e-5


@pytest.mark.parametrize("mixer", MIXERS)
def test_trains_on_tiny_batch(mixer):
    model = tiny(mixer)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = ids(B=2, T=16, seed=1)
    losses = []
    for _ in range(8):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("mixer", ["gdn", "gdn,swa"])
def test_generate_greedy_equals_repeated_argmax(mixer):
    model = tiny(mixer)
    x = ids(B=2, T=5)
    out = model.generate(x, max_new_tokens=6)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], x)
    seq = x
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    assert model.training


@pytest.mark.parametrize("mixer", [m for m in MIXERS if m != "attn"])
def test_decode_memory_is_constant(mixer):
    model = tiny(mixer).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(ids(T=20), cache=cache)
        size = cache.nbytes()
        for _ in range(5):
            model(ids(T=1), cache=cache)
    assert cache.nbytes() == size


def test_mixer_states():
    model = tiny("gdn,attn")
    states = model.mixer_states(ids(T=9))
    cfg = model.cfg
    assert states[0].shape == (2, cfg.n_heads, cfg.head_dim, cfg.head_v_dim) and states[0].dtype == torch.float32
    assert states[1] is None


def test_config_errors():
    with pytest.raises(ValueError, match="mixer"):
        LMConfig.preset("tiny", mixer="gdn,transformer")
    with pytest.raises(ValueError, match="n_heads"):
        LMConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="preset"):
        LMConfig.preset("7B")
    cfg = LMConfig.preset("tiny", mixer="gdn,swa", n_layers=5)
    assert cfg.mixers == ("gdn", "swa", "gdn", "swa", "gdn")
    assert LMConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TypeError, match="input_ids"):
        tiny("gdn")(torch.zeros(1, 3))
    for field, value in (("n_kv_heads", 0), ("n_kv_heads", -1), ("intermediate_size", 0), ("head_dim", "8"),
                         ("expand_v", "2"), ("norm_eps", -1.0), ("recurrent_threshold", -1)):
        with pytest.raises(ValueError, match=field):
            LMConfig.preset("tiny", **{field: value})


@pytest.mark.parametrize("mixer, kw", [("gdn", {}), ("attn", {}), ("rwkv7", {}), ("mamba2", {}),
                                        ("rwkv7", dict(rwkv7_official=True))])
def test_use_mlp_false_leaves_each_block_its_mixer(mixer, kw):
    """Zoology's blocks (state_mixer: Identity): no MLP, no channel mix, no norm before them; Mamba-2
    blocks have none anyway. The model still trains and decodes as one pass."""
    with_mlp, without = tiny(mixer, **kw), tiny(mixer, use_mlp=False, **kw)
    assert all(b.mlp is None and b.mlp_norm is None for b in without.blocks)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(without) == n(with_mlp) if mixer == "mamba2" else n(without) < n(with_mlp)
    x = ids(seed=1)
    logits = without(x)
    logits.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(logits).all() and torch.isfinite(without.embed.weight.grad).all()
    cache = without.new_cache()
    with torch.no_grad():
        steps = torch.cat([without(x[:, :13], cache=cache)] + [without(x[:, t:t + 1], cache=cache)
                                                                for t in range(13, x.shape[1])], dim=1)
    assert rel_err(steps, logits.detach()) < 5e-5   # the bound of test_prefill_then_decode_matches_one_pass


def test_input_errors():
    model = tiny("gdn")
    for bad in (64, -1):
        with pytest.raises(ValueError, match="input_ids"):
            model(torch.full((1, 3), bad))
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids(B=1, T=3), logits_to_keep=-1)
    for kw, name in ((dict(temperature=-1.0), "temperature"), (dict(temperature=1.0, top_k=0), "top_k")):
        with pytest.raises(ValueError, match=name):
            model.generate(ids(B=1, T=3), max_new_tokens=2, **kw)


@pytest.mark.parametrize("mixer", list(MIXERS) + ["rwkv7,swa,mamba2"])
def test_packed_sequences_match_separate_ones(mixer):
    model = tiny(mixer, n_layers=3 if "," in mixer else 2, window_size=4)
    lengths = [5, 1, 9]
    seqs = [ids(B=1, T=n) for n in lengths]
    cu_seqlens = torch.tensor([0, 5, 6, 15])
    packed = model(torch.cat(seqs, 1), cu_seqlens=cu_seqlens)
    separate = torch.cat([model(s) for s in seqs], 1)
    assert rel_err(packed, separate) < 1e-5


def test_packed_sequences_errors():
    model = tiny("gdn")
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids(B=2, T=6), cu_seqlens=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids(B=1, T=6), cu_seqlens=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="cache"):
        model(ids(B=1, T=6), cache=model.new_cache(), cu_seqlens=torch.tensor([0, 3, 6]))


def test_gla_short_conv():
    """``gla_short_conv``: GLA's q, k, v through short convolutions (fla's use_short_conv). The
    convolutions exist and change the output; prefill then decode matches one pass (the
    convolutions' tails cached); packed sequences match separate ones (no tap crosses a boundary);
    no fla config is written for it (fla's GLAForCausalLM would build it without them)."""
    from fastweight.models.convert import fla_config_from_lm
    plain, conv = tiny("gla"), tiny("gla", gla_short_conv=True)
    names = {n for n, _ in conv.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert names and all("qkv_conv" in n for n in names), names
    x = ids()
    conv.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        assert rel_err(conv(x), plain(x)) > 1e-3
        conv.eval()
        full = conv(x)
        cache = conv.new_cache()
        parts = [conv(x[:, :7], cache=cache)] + [conv(x[:, t:t + 1], cache=cache) for t in range(7, 21)]
    assert rel_err(torch.cat(parts, 1), full) < 5e-5
    seqs = [ids(B=1, T=n) for n in (5, 1, 9)]
    with torch.no_grad():
        packed = conv(torch.cat(seqs, 1), cu_seqlens=torch.tensor([0, 5, 6, 15]))
        separate = torch.cat([conv(s) for s in seqs], 1)
    assert rel_err(packed, separate) < 1e-5
    with pytest.raises(NotImplementedError, match="gla_short_conv"):
        fla_config_from_lm(conv.cfg)

import pytest
import torch

from fastweight.models import MIXERS, LMConfig, LanguageModel
from fastweight.testing import generator, rel_err


def test_bf16_autocast_training_reduces_the_loss():
    torch.manual_seed(0)
    model = LanguageModel(LMConfig.preset("tiny", mixer="gdn,swa", vocab_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (2, 16), generator=generator(2))
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        assert logits.dtype == torch.bfloat16
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("mixer", MIXERS)
def test_every_mixer_runs_under_bf16_autocast(mixer):
    """Under autocast the ops get bf16 tensors and fp32 log decays (the recurrence runs outside autocast)."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig.preset("tiny", mixer=mixer, vocab_size=64))
    x = torch.randint(0, 64, (2, 20), generator=generator())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    logits.float().square().mean().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = LanguageModel(LMConfig.preset("tiny", mixer="gdn,swa", vocab_size=64))
    x = torch.randint(0, 64, (2, 12), generator=generator())
    ref = model(x)
    out = torch.compile(model, backend="aot_eager")(x)
    assert rel_err(out, ref) < 1e-6
    out.float().square().mean().backward()
    assert model.blocks[0].mixer.q_proj.weight.grad is not None


def test_model_on_the_triton_kernels():
    """The model through the Triton kernels (interpreted on CPU) gives the PyTorch path's logits,
    gradients, and the same logits when decoding from the cache."""
    from fastweight.layers import use_backend
    torch.manual_seed(0)
    model = LanguageModel(LMConfig.preset("tiny", mixer="gdn,swa", vocab_size=64))
    x = torch.randint(0, 64, (2, 20), generator=generator())
    ref = model(x)
    ref.square().mean().backward()
    ref_grad = model.blocks[0].mixer.q_proj.weight.grad.clone()
    model.zero_grad()
    with use_backend("triton"):
        out = model(x)
        out.square().mean().backward()
        model.eval()
        with torch.no_grad():
            cache = model.new_cache()
            steps = [model(x[:, :13], cache=cache)] + [model(x[:, t:t + 1], cache=cache) for t in range(13, 20)]
    assert rel_err(out, ref) < 1e-5
    assert rel_err(model.blocks[0].mixer.q_proj.weight.grad, ref_grad) < 1e-5
    assert rel_err(torch.cat(steps, 1), ref) < 1e-5

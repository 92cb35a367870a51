import pytest
import torch

from fastweight.optim import learning_rate, make_optimizer
from fastweight.train import TrainConfig, build_model


def tiny(tmp_path, **kw):
    base = dict(task="parity:seq_len=16", mixer="gdn", d_model=32, n_layers=1, n_heads=2, steps=6, batch_size=4,
                lr=1e-2, warmup=2, out_dir=str(tmp_path), progress=False, threads=1)
    return TrainConfig(**{**base, **kw})


def test_warmup_then_cosine_to_a_tenth():
    cfg = TrainConfig(lr=1e-2, steps=100, warmup=10)
    assert learning_rate(cfg, 0) == pytest.approx(1e-3) and learning_rate(cfg, 9) == pytest.approx(1e-2)
    assert learning_rate(cfg, 10) == pytest.approx(1e-2) and learning_rate(cfg, 55) == pytest.approx(5.5e-3)
    assert learning_rate(cfg, 100) == pytest.approx(1e-3)


def test_weight_decay_on_matrices_only(tmp_path):
    """By default (as Mamba, fla and RWKV-LM train) A_log, dt_bias, D, norm weights and biases get no
    decay, every matrix does; one step with zero gradients then shrinks only the matrices.
    ``weight_decay_1d=True`` decays every parameter (one group)."""
    cfg = tiny(tmp_path, mixer="mamba2", weight_decay=0.5)
    model = build_model(cfg, 16)
    opt = make_optimizer(model, cfg)
    decayed, kept = opt.param_groups
    assert decayed["weight_decay"] == 0.5 and kept["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in kept["params"])
    assert len(decayed["params"]) + len(kept["params"]) == len(list(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    kept_names = {names[id(p)] for p in kept["params"]}
    assert {n.rsplit(".", 1)[-1] for n in kept_names} >= {"A_log", "dt_bias", "D", "bias", "weight"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if p.dim() < 2:
            assert torch.equal(p, before[n]), n
        elif before[n].abs().sum() > 0:
            assert not torch.equal(p, before[n]), n
    every = make_optimizer(model, tiny(tmp_path, mixer="mamba2", weight_decay_1d=True))
    assert len(every.param_groups) == 1 and every.param_groups[0]["weight_decay"] == 0.1
    assert len(every.param_groups[0]["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("official", [False, True])
def test_rwkv7_gate_vectors_get_no_weight_decay(tmp_path, official):
    """RWKV-7's per-channel vectors kept 2-D or 3-D (token-shift mixes, key scales, bonus) are not
    weights: no decay on them, as RWKV-LM decays only its ``.weight`` matrices; its projections and
    LoRA factors are decayed."""
    cfg = tiny(tmp_path, mixer="rwkv7", model_args="rwkv7_official=true" if official else "")
    model = build_model(cfg, 16)
    decayed, kept = make_optimizer(model, cfg).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    kept_names = {names[id(p)].split(".")[-1] for p in kept["params"]}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    vectors = {"x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "r_k"} if official else {"mu", "xi", "alpha", "rho"}
    assert vectors <= kept_names and not any(n.split(".")[-1] in vectors for n in decayed_names)
    assert any("r_proj" in n for n in decayed_names) and any("w_lora.down" in n for n in decayed_names)
    assert len(decayed["params"]) + len(kept["params"]) == len({id(p) for p in model.parameters()})

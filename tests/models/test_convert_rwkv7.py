"""The official RWKV-7 checkpoints (``RWKV_x070`` ``.pth``) into our LM and back
(``fastweight.models.convert_rwkv``, ``LMConfig(rwkv7_official=True)``).

A tiny official-format state dict with random weights (the official names and shapes: n_embd 128,
head size 64, vocab 256) is converted and our model's logits are compared with a float64
per-token loop of the official forward written here from the official recurrence, and, where the
``rwkv`` package is installed (the compat extra), with that package's own ``RWKV_x070`` model.
"""

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fastweight.layers import use_backend
from fastweight.models.config import LMConfig
from fastweight.models.convert import convert
from fastweight.models.convert_rwkv import (
    from_rwkv7,
    lm_config_from_rwkv7,
    load_rwkv7,
    save_rwkv7,
    state_dict_from_rwkv7,
    state_dict_to_rwkv7,
)
from fastweight.models.lm import LanguageModel
from fastweight.testing import rel_err

C, N, VOCAB = 128, 64, 256
RANKS = {"w": 32, "a": 48, "v": 16, "g": 64}


def official_state_dict(n_layer: int = 2, ffn: int = 4 * C, seed: int = 0) -> dict:
    """Random weights under the official names and shapes, at scales that keep every part of the
    forward in play (decays spread over (0, 1), a and the value residual's mix away from 0 and 1)."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    def ru(*shape, lo=0.0, hi=1.0):
        return torch.rand(*shape, generator=g) * (hi - lo) + lo

    H = C // N
    sd = {"emb.weight": rn(VOCAB, C), "blocks.0.ln0.weight": rn(C, std=0.1, mean=1.0),
          "blocks.0.ln0.bias": rn(C, std=0.1)}
    for i in range(n_layer):
        p = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            sd[p + ln + ".weight"], sd[p + ln + ".bias"] = rn(C, std=0.1, mean=1.0), rn(C, std=0.1)
        for c in "rwkvag":
            sd[p + f"att.x_{c}"] = ru(1, 1, C)
        sd[p + "att.w0"] = ru(1, 1, C, lo=-3.0, hi=2.0)
        sd[p + "att.a0"] = rn(1, 1, C, std=0.5)
        for c in "wavg":
            if c == "v" and i == 0:
                continue
            sd[p + f"att.{c}1"] = rn(C, RANKS[c], std=C ** -0.5)
            sd[p + f"att.{c}2"] = rn(RANKS[c], C, std=0.5 * RANKS[c] ** -0.5)
        if i > 0:
            sd[p + "att.v0"] = rn(1, 1, C, std=0.5)
        sd[p + "att.k_k"] = rn(1, 1, C, std=0.1, mean=0.7)
        sd[p + "att.k_a"] = rn(1, 1, C, std=0.1, mean=1.0)
        sd[p + "att.r_k"] = rn(H, N, std=0.1)
        for name in ("receptance", "key", "value", "output"):
            sd[p + f"att.{name}.weight"] = rn(C, C, std=C ** -0.5)
        sd[p + "att.ln_x.weight"], sd[p + "att.ln_x.bias"] = rn(C, std=0.1, mean=1.0), rn(C, std=0.1)
        sd[p + "ffn.x_k"] = ru(1, 1, C)
        sd[p + "ffn.key.weight"] = rn(ffn, C, std=C ** -0.5)
        sd[p + "ffn.value.weight"] = rn(C, ffn, std=0.5 * ffn ** -0.5)
    sd["ln_out.weight"], sd["ln_out.bias"] = rn(C, std=0.1, mean=1.0), rn(C, std=0.1)
    sd["head.weight"] = rn(VOCAB, C, std=C ** -0.5)
    return sd


def _layer_norm(x, weight, bias, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps) * weight + bias


def official_forward(sd: dict, ids: torch.Tensor) -> torch.Tensor:
    """The official RWKV_x070 forward in float64, one sequence and one token at a time: logits [T, vocab].

    State S [H, N(value), N(key)] per layer:  S <- S diag(w) + (S a) b^T + v k^T,  out = S r,
    with a = -kk, b = kk * a_iclr;  w = exp(-exp(-softplus(-(w0 + tanh(x^w w1) w2)) - 0.5))."""
    sd = {k: v.double() for k, v in sd.items()}
    n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    H, T = C // N, ids.shape[0]
    x = _layer_norm(sd["emb.weight"][ids], sd["blocks.0.ln0.weight"], sd["blocks.0.ln0.bias"])
    v_first = [None] * T
    for i in range(n_layer):
        def P(name, i=i):
            return sd[f"blocks.{i}.{name}"]

        def mix(name, i=i):
            return P(name, i).reshape(-1)

        h = _layer_norm(x, P("ln1.weight"), P("ln1.bias"))
        S = torch.zeros(H, N, N, dtype=torch.float64)
        prev = torch.zeros(C, dtype=torch.float64)
        att = []
        for t in range(T):
            xt = h[t]
            xx = prev - xt
            prev = xt
            xr, xw, xk, xv, xa, xg = (xt + xx * mix(f"att.x_{c}") for c in "rwkvag")
            r = P("att.receptance.weight") @ xr
            k = P("att.key.weight") @ xk
            v = P("att.value.weight") @ xv
            w_log = -F.softplus(-(mix("att.w0") + torch.tanh(xw @ P("att.w1")) @ P("att.w2"))) - 0.5
            w = torch.exp(-torch.exp(w_log))
            if i == 0:
                v_first[t] = v
            else:
                v = v + (v_first[t] - v) * torch.sigmoid(mix("att.v0") + (xv @ P("att.v1")) @ P("att.v2"))
            a = torch.sigmoid(mix("att.a0") + (xa @ P("att.a1")) @ P("att.a2"))
            g = torch.sigmoid(xg @ P("att.g1")) @ P("att.g2")
            kk = (k * mix("att.k_k")).view(H, N)
            kk = kk / kk.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            k = k * (1 + (a - 1) * mix("att.k_a"))
            rh, kh, vh, ah = r.view(H, N), k.view(H, N), v.view(H, N), a.view(H, N)
            out = torch.empty(H, N, dtype=torch.float64)
            for hd in range(H):
                sa = S[hd] @ (-kk[hd])
                S[hd] = S[hd] * w.view(H, N)[hd][None, :] + torch.outer(sa, kk[hd] * ah[hd]) \
                    + torch.outer(vh[hd], kh[hd])
                o = S[hd] @ rh[hd]
                o = (o - o.mean()) / math.sqrt(((o - o.mean()) ** 2).mean().item() + 64e-5)
                out[hd] = o * P("att.ln_x.weight").view(H, N)[hd] + P("att.ln_x.bias").view(H, N)[hd] \
                    + (rh[hd] * kh[hd] * P("att.r_k")[hd]).sum() * vh[hd]
            att.append(P("att.output.weight") @ (out.reshape(C) * g))
        x = x + torch.stack(att)
        h = _layer_norm(x, P("ln2.weight"), P("ln2.bias"))
        prev = torch.zeros(C, dtype=torch.float64)
        ffn = []
        for t in range(T):
            xk = h[t] + (prev - h[t]) * mix("ffn.x_k")
            prev = h[t]
            ffn.append(P("ffn.value.weight") @ torch.relu(P("ffn.key.weight") @ xk) ** 2)
        x = x + torch.stack(ffn)
    return _layer_norm(x, sd["ln_out.weight"], sd["ln_out.bias"]) @ sd["head.weight"].T


def _ids(B=2, T=16, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_config_from_shapes():
    cfg = lm_config_from_rwkv7(official_state_dict(n_layer=3, ffn=448))
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.head_dim) == (VOCAB, C, 3, 2, N)
    assert cfg.rwkv7_official and cfg.rwkv7_ranks == (32, 48, 16, 64) and cfg.intermediate_size == 448
    assert not cfg.tie_embeddings and cfg.norm_eps == 1e-5
    assert lm_config_from_rwkv7(official_state_dict()).intermediate_size is None   # 4 * n_embd


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("train", [False, True], ids=["fused_recurrent", "chunk"])
def test_logits_match_float64_official_loop(train, backend):
    if backend == "triton" and not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    sd = official_state_dict()
    model = from_rwkv7(sd).train(train)   # train(): chunk mode; eval() at T <= 64: fused_recurrent
    ids = _ids()
    with torch.no_grad(), use_backend(backend):
        ours = model(ids)
    ref = torch.stack([official_forward(sd, row) for row in ids])
    err = rel_err(ours, ref)
    print(f"rel err vs float64 official loop ({backend}, {'chunk' if train else 'fused_recurrent'}): {err:.2e}")
    assert err <= 1e-5


# the rwkv package's RWKV_x070 on the CPU in fp32: a .pth path without its suffix, token ids -> logits [T, vocab]
RWKV_PACKAGE = """
import os, sys, torch
os.environ["RWKV_V7_ON"] = "1"
from rwkv.model import RWKV_x070
ids = torch.load(sys.argv[1])
for i, name in enumerate(sys.argv[3:]):
    torch.save(RWKV_x070(name, "cpu fp32").forward(ids.tolist(), None, full_output=True)[0], f"{sys.argv[2]}{i}.pt")
"""


@pytest.mark.skipif(importlib.util.find_spec("rwkv") is None, reason="the rwkv package (compat extra) is not installed")
def test_logits_match_the_rwkv_package(tmp_path):
    """The rwkv package's own x070 model (its CPU fp32 path) on an official ``.pth`` and on the ``.pth`` we write
    back: our logits within fp32 rounding of both. The package runs in a child process: importing it with
    RWKV_V7_ON=1 sets process-wide torch flags (TF32, cudnn.benchmark, the TorchScript autocast mode)."""
    sd = official_state_dict()
    torch.save(sd, tmp_path / "official.pth")
    model = load_rwkv7(str(tmp_path / "official.pth")).eval()
    save_rwkv7(model, str(tmp_path / "ours.pth"))
    ids = _ids(B=1, T=16)[0]
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run([sys.executable, "-c", RWKV_PACKAGE, str(tmp_path / "ids.pt"), str(tmp_path / "logits"),
                    str(tmp_path / "official"), str(tmp_path / "ours")], check=True, capture_output=True)
    with torch.no_grad():
        ours = {mode: getattr(model, mode)()(ids[None])[0] for mode in ("eval", "train")}   # fused_recurrent, chunk
    for i in range(2):
        theirs = torch.load(tmp_path / f"logits{i}.pt")
        for mode, logits in ours.items():
            assert rel_err(logits, theirs) <= 1e-5, (i, mode, rel_err(logits, theirs))

def test_decode_from_cache_matches_full_forward():
    model = from_rwkv7(official_state_dict()).eval()
    ids = _ids(T=10)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :6], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(6, 10)]
    assert rel_err(torch.cat(steps, 1), full) <= 1e-5


def test_round_trip_is_exact():
    sd = official_state_dict(n_layer=3, ffn=448)
    back = state_dict_to_rwkv7(from_rwkv7(sd).state_dict(), lm_config_from_rwkv7(sd))
    assert set(back) == set(sd)
    for k in sd:
        assert back[k].shape == sd[k].shape and torch.equal(back[k], sd[k]), k


def test_strict_names():
    sd = official_state_dict()
    with pytest.raises(KeyError, match="time_maa_r"):
        state_dict_from_rwkv7({**sd, "blocks.0.att.time_maa_r": sd["blocks.0.att.x_r"]})
    missing = dict(sd)
    del missing["blocks.1.att.v0"]
    model = LanguageModel(lm_config_from_rwkv7(sd))
    with pytest.raises(RuntimeError, match="v_lora.up.bias"):
        model.load_state_dict(state_dict_from_rwkv7(missing), strict=True)


def test_config_refuses_other_patterns():
    with pytest.raises(ValueError, match="rwkv7_official"):
        LMConfig(vocab_size=16, d_model=128, n_layers=2, n_heads=2, mixer="rwkv7,attn", rwkv7_official=True)
    with pytest.raises(ValueError, match="rwkv7_ranks"):
        LMConfig(vocab_size=16, d_model=128, n_layers=2, n_heads=2, mixer="rwkv7", rwkv7_ranks=(32, 32, 32, 32))
    assert not LMConfig().rwkv7_official   # the default LM is unchanged
    with pytest.raises(NotImplementedError, match="use_mlp"):   # the official blocks all have a channel mix
        state_dict_to_rwkv7({}, LMConfig(vocab_size=16, d_model=128, n_layers=2, n_heads=2, mixer="rwkv7",
                                         rwkv7_official=True, use_mlp=False))


def test_cli_convert_pth_to_folder_and_back(tmp_path):
    sd = {k: v.to(torch.bfloat16) for k, v in official_state_dict().items()}
    torch.save(sd, tmp_path / "rwkv.pth")
    assert convert(str(tmp_path / "rwkv.pth"), str(tmp_path / "fw")) == "RWKV-7 .pth -> fastweight"
    from fastweight.models.hf import FastweightForCausalLM
    hf = FastweightForCausalLM.from_pretrained(str(tmp_path / "fw"))
    assert hf.model.cfg.rwkv7_official and hf.model.cfg.rwkv7_ranks == (32, 48, 16, 64)
    for k, v in state_dict_from_rwkv7(sd).items():
        assert torch.equal(hf.model.state_dict()[k].to(v.dtype), v), k
    assert convert(str(tmp_path / "fw"), str(tmp_path / "back.pth")) == "fastweight -> RWKV-7 .pth"
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert set(back) == set(sd) and all(torch.equal(back[k].to(sd[k].dtype), sd[k]) for k in sd)
    model = load_rwkv7(str(tmp_path / "rwkv.pth"))
    save_rwkv7(model, str(tmp_path / "again.pth"))
    again = torch.load(tmp_path / "again.pth", weights_only=True)
    assert all(again[k].dtype == torch.bfloat16 and torch.equal(again[k], sd[k]) for k in sd)

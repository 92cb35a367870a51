"""The Triton parts of the layers (fastweight/kernels/conv.py) against their PyTorch forms, and
the layers with them against the layers without (CPU: TRITON_INTERPRET=1, fp32)."""
import pytest
import torch
import torch.nn.functional as F

from fastweight.kernels.conv import short_conv
from fastweight.layers import ShortConv, use_backend
from fastweight.testing import generator, rel_err


def conv_reference(x, w, b, silu):
    """F.conv1d in float64 (channels first, zero history)."""
    T, C, W = x.shape[1], x.shape[2], w.shape[1]
    y = F.conv1d(x.double().transpose(1, 2), w.double()[:, None], None if b is None else b.double(),
                 padding=W - 1, groups=C)[..., :T].transpose(1, 2)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("B,T,C,W,bias,silu", [(2, 37, 200, 4, False, True), (1, 5, 64, 4, True, True),
                                               (2, 50, 130, 3, True, False), (1, 2, 16, 4, False, True)])
def test_short_conv_kernel_matches_conv1d(B, T, C, W, bias, silu):
    gen = generator()
    x = torch.randn(B, T, C, generator=gen, requires_grad=True)
    w = torch.randn(C, W, generator=gen, requires_grad=True)
    b = torch.randn(C, generator=gen, requires_grad=True) if bias else None
    leaves = [x, w] + ([b] if bias else [])
    ref = conv_reference(x, w, b, silu)
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves, dy)
    y = short_conv(x, w, b, silu)
    grads = torch.autograd.grad(y, leaves, dy.float())
    # fp32 accumulation of W <= 4 terms: measured worst 3.5e-7 over these shapes
    assert rel_err(y, ref) < 2e-6
    for name, g, r in zip(("dx", "dw", "db"), grads, ref_grads):
        assert rel_err(g, r) < 2e-6, name


def test_short_conv_with_bias_keeps_conv1d():
    assert not ShortConv(48, 4, "silu", bias=True).fused
    assert ShortConv(48, 4, "silu").fused


def test_short_conv_layer_uses_the_kernel_with_the_same_result():
    conv = ShortConv(48, 4, "silu")
    x = torch.randn(2, 21, 48, generator=generator(), requires_grad=True)
    ref, ref_tail = conv(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, conv.weight])
    with use_backend("triton"):
        y, tail = conv(x)
        grads = torch.autograd.grad(y.square().sum(), [x, conv.weight])
    assert torch.equal(tail, ref_tail)
    assert rel_err(y, ref) < 2e-6
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 2e-6


def norm_reference(x, gate, w, eps, act):
    x = x.double()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()
    if gate is None:
        return y
    g = gate.double()
    return y * {"silu": F.silu, "sigmoid": torch.sigmoid, "identity": lambda t: t}[act](g)


@pytest.mark.parametrize("D,act", [(128, "silu"), (96, "sigmoid"), (64, "identity"), (200, None), (1024, None)])
def test_gated_norm_kernel_matches_its_definition(D, act):
    from fastweight.kernels.norm import gated_rms_norm
    gen = generator()
    x = torch.randn(3, 7, 2, D, generator=gen, requires_grad=True)
    gate = torch.randn(3, 7, 2, D, generator=gen, requires_grad=True) if act else None
    w = (1 + 0.1 * torch.randn(D, generator=gen)).requires_grad_()
    leaves = [x, w] + ([gate] if act else [])
    ref = norm_reference(x, gate, w, 1e-6, act)
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves, dy)
    y = gated_rms_norm(x, gate, w, 1e-6, act or "identity")
    grads = torch.autograd.grad(y, leaves, dy.float())
    # fp32 sums over D <= 200 and over 42 rows (dw): measured worst 1.5e-7 over 5 seeds
    assert rel_err(y, ref) < 1e-6
    for name, g, r in zip(("dx", "dw", "dgate"), grads, ref_grads):
        assert rel_err(g, r) < 1e-6, name


def test_norms_use_the_kernel_with_the_same_result(monkeypatch):
    from fastweight.layers import common
    monkeypatch.setattr(common, "_TRITON_MIN_NUMEL", 0)
    for norm, gated in ((common.RMSNorm(64), False), (common.GatedRMSNorm(64, activation="silu"), True)):
        norm.weight.data.uniform_(0.5, 1.5)
        x = torch.randn(2, 9, 64, generator=generator(), requires_grad=True)
        gate = torch.randn(2, 9, 64, generator=generator(), requires_grad=True)
        args = (x, gate) if gated else (x,)
        ref = norm(*args)
        ref_grads = torch.autograd.grad(ref.square().sum(), [*args, norm.weight])
        with use_backend("triton"):
            y = norm(*args)
            grads = torch.autograd.grad(y.square().sum(), [*args, norm.weight])
        assert rel_err(y, ref) < 2e-6
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) < 2e-6


@pytest.mark.parametrize("mixer", ["gdn", "kda", "gdn,swa"])
def test_model_on_the_triton_path_matches_the_pytorch_path(mixer, monkeypatch):
    """Logits and gradients of a tiny model through the Triton parts (short conv, norms, the
    chunk kernel forming the gate from its pre-activation) against the PyTorch paths, fp32."""
    from fastweight.layers import common
    from fastweight.models import LanguageModel, LMConfig
    monkeypatch.setattr(common, "_TRITON_MIN_NUMEL", 0)
    torch.manual_seed(0)
    model = LanguageModel(LMConfig.preset("tiny", mixer=mixer, vocab_size=64, window_size=8))
    ids = torch.randint(0, 64, (2, 24), generator=generator())

    def run():
        model.zero_grad()
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_grads = run()
    with use_backend("triton"):
        out, grads = run()
    # measured worst over 10 seeds: logits 1.3e-6 (kda), gradients 2.2e-6 (the chunk kernels' fp32
    # sums), but A_log / dt_bias 4.4e-5 (kda): sums over all tokens that cancel (both sides fp32)
    assert rel_err(out, ref) < 5e-6
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        bound = 3e-4 if name.endswith(("A_log", "dt_bias")) else 1e-5
        assert rel_err(grads[name], ref_grads[name]) < bound, name


def test_short_conv_kernel_continues_a_cache():
    """Chunks of several tokens after a cache (the kernel over [cache, x]) and single steps."""
    conv = ShortConv(40, 4, "silu")
    x = torch.randn(2, 30, 40, generator=generator())
    ref, _ = conv(x)
    outs, cache = [], None
    with use_backend("triton"):
        for a, b in ((0, 7), (7, 8), (8, 20), (20, 21), (21, 30)):
            y, cache = conv(x[:, a:b], cache)
            outs.append(y)
    assert cache.shape == (2, 3, 40) and cache.is_contiguous()
    assert rel_err(torch.cat(outs, 1), ref) < 2e-6


@pytest.mark.parametrize("offset", [0, 5, "positions"])
def test_rotary_kernel_matches_the_pytorch_form(offset, monkeypatch):
    from fastweight.layers import common
    gen = generator()
    x = torch.randn(2, 9, 3, 16, generator=gen, requires_grad=True)
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0]) if offset == "positions" else offset
    ref = common.rotary(x, pos)
    dy = torch.randn(ref.shape, generator=gen)
    (ref_dx,) = torch.autograd.grad(ref, x, dy)
    monkeypatch.setattr(common, "_TRITON_MIN_NUMEL", 0)
    tables = {}
    with use_backend("triton"):
        y = common.rotary(x, pos, tables=tables)
        (dx,) = torch.autograd.grad(y, x, dy)
        assert len(tables) == 1 and common.rotary(x, pos, tables=tables).shape == y.shape and len(tables) == 1
    # the same fp32 products and sums in both: measured 0 / 1e-7
    assert rel_err(y, ref) < 1e-6 and rel_err(dx, ref_dx) < 1e-6
    # the rotation keeps norms (a rotation per pair of channels)
    assert rel_err(y.norm(dim=-1), x.norm(dim=-1)) < 1e-6


def test_swiglu_kernel_matches_its_definition(monkeypatch):
    from fastweight.layers import common
    from fastweight.kernels.swiglu import swiglu
    gen = generator()
    a, b = (torch.randn(3, 5, 700, generator=gen, requires_grad=True) for _ in range(2))
    ref = F.silu(a.double()) * b.double()
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, [a, b], dy)
    y = swiglu(a, b)
    grads = torch.autograd.grad(y, [a, b], dy.float())
    # elementwise fp32: measured worst 7e-8 over 4 seeds
    assert rel_err(y, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-6
    mlp = common.SwiGLU(16, 48)
    x = torch.randn(2, 3, 16, generator=gen)
    ref = mlp(x)
    monkeypatch.setattr(common, "_TRITON_MIN_NUMEL", 0)
    with use_backend("triton"):
        assert rel_err(mlp(x), ref) < 1e-6

"""The delta family's backward stages: the storage and launch choices of the output and WY backward
(``delta.PARTIAL_DK_DTYPES``, ``delta.WY_GATE_GRAD``, ``output.QK_FIRST``) against float64 and against each
other, under TRITON_INTERPRET=1 (fp32, fp16; bf16 by emulation)."""

import os

import pytest
import torch

import fastweight.kernels as kernels
import fastweight.reference.ops as reference
from fastweight.kernels import common
from fastweight.testing import emulate_tf32, generator, rel_err

from delta_cases import check, sample


@pytest.fixture(autouse=True)
def poison():
    with common.poisoned_outputs():
        yield


@pytest.mark.parametrize("op, G, gate", [("gated_delta_rule", 1, False), ("delta_rule", 1, False), ("comba", 1, False),
                                        ("gated_delta_rule", 2, False), ("comba", 2, False),
                                        ("gated_delta_rule", 1, True), ("gated_delta_rule", 2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_grad_summed_in_wy_bwd(op, G, gate, dtype, monkeypatch):
    """``delta.WY_GATE_GRAD``: the WY backward takes the reverse cumsum of a scalar gate's dg and stores it and
    dbeta in the inputs' dtypes; every gradient bit-equal to the reverse cumsum's launch and the casts after
    it, varlen with an empty sequence and a partial last chunk, grouped value heads, Mamba-2's gate in the
    kernel (whose backward still gets dg in fp32); no reverse ``chunk_cumsum`` runs."""
    from fastweight.kernels import delta
    x = {n: t.to(dtype) for n, t in sample(op, 1, 150, 2, 16, 16, G).items()}
    cu = torch.tensor([0, 70, 70, 150])
    extra = {}
    if gate:
        gen = generator(3)
        extra = dict(use_gate_in_kernel=True, A_log=(-1 - torch.rand(2 * G, generator=gen)).to(dtype),
                     dt_bias=torch.randn(2 * G, generator=gen).to(dtype))
    calls, gate_dg = [], []
    real, real_gate = delta.chunk_cumsum, delta._gate_backward
    monkeypatch.setattr(delta, "chunk_cumsum", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(delta, "_gate_backward", lambda dg, *a: gate_dg.append(dg.dtype) or real_gate(dg, *a))
    grads = []
    for summed in (False, True):
        monkeypatch.setattr(delta, "WY_GATE_GRAD", summed)
        calls.clear()
        leaves = {n: t.clone().requires_grad_() for n, t in {**x, **extra}.items() if isinstance(t, torch.Tensor)}
        kw = {n: v for n, v in extra.items() if not isinstance(v, torch.Tensor)}
        o, _ = getattr(kernels, f"chunk_{op}")(**leaves, **kw, scale=0.25, cu_seqlens=cu)
        o.float().mul(torch.randn(o.shape, generator=generator(4))).sum().backward()
        grads.append({n: t.grad for n, t in leaves.items()})
        assert any(c.get("reverse") for c in calls) == (not summed and "g" in x)
    assert set(gate_dg) == ({torch.float32} if gate else set())
    for n, want in grads[0].items():
        assert grads[1][n].dtype == want.dtype == dtype and torch.equal(grads[1][n], want), n


@pytest.mark.parametrize("op", ["gated_delta_rule", "delta_rule"])
def test_partial_dk_in_input_dtype(op, monkeypatch):
    """``delta.PARTIAL_DK_DTYPES`` (bf16 by default, which the interpreter runs only under emulation: fp16
    stands in here): the output backward stores its part of dk in the inputs' dtype and the WY backward
    completes it in place; the op against float64, varlen with an empty sequence, an initial state."""
    from fastweight.kernels import delta, output
    monkeypatch.setattr(delta, "PARTIAL_DK_DTYPES", (torch.float16,))
    seen = []
    real = output.output_bwd
    monkeypatch.setattr(delta, "output_bwd", lambda *a, **kw: seen.append(kw["dk_dtype"]) or real(*a, **kw))
    check(op, 1, 150, 2, 32, 40, torch.float16, cu_seqlens=torch.tensor([0, 70, 70, 150]))
    assert seen and set(seen) == {torch.float16}


@pytest.mark.parametrize("op", ["gated_delta_rule", "delta_rule"])
def test_partial_dk_completed_in_fp32(op, monkeypatch):
    """The WY backward completes a 16-bit partial dk in fp32 and rounds once: every gradient bit-equal to the
    same partial handed over widened to fp32 (an add in 16 bits would round twice)."""
    from fastweight.kernels import delta, output
    monkeypatch.setattr(delta, "PARTIAL_DK_DTYPES", (torch.float16,))
    x = {n: t.to(torch.float16) for n, t in sample(op, 1, 150, 2, 32, 40, seed=4).items()}
    real = output.output_bwd

    def grads(widen):
        def partial(*a, **kw):
            out = list(real(*a, **kw))
            assert out[1].dtype == torch.float16
            out[1] = out[1].float() if widen else out[1]
            return tuple(out)
        monkeypatch.setattr(delta, "output_bwd", partial)
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, _ = getattr(kernels, f"chunk_{op}")(**leaves, scale=0.25, cu_seqlens=torch.tensor([0, 70, 70, 150]))
        o.float().mul(torch.randn(o.shape, generator=generator(5))).sum().backward()
        return {n: t.grad for n, t in leaves.items()}
    narrow, wide = grads(False), grads(True)
    for n in narrow:
        assert torch.equal(narrow[n], wide[n]), n


@pytest.mark.parametrize("op, G", [("gated_delta_rule", 2), ("comba", 1), ("kda", 1)])
def test_partial_dk_fp32_where_dk_is_summed(op, G, monkeypatch):
    """Grouped value heads (summed after), Comba's read key and KDA's per-channel gate (added to after) keep
    the fp32 partial dk even where the dtype is listed."""
    from fastweight.kernels import delta, output
    monkeypatch.setattr(delta, "PARTIAL_DK_DTYPES", (torch.float16,))
    seen = []
    real = output.output_bwd
    monkeypatch.setattr(delta, "output_bwd", lambda *a, **kw: seen.append(kw["dk_dtype"]) or real(*a, **kw))
    check(op, 1, 70, 2, 16, 16, torch.float16, G=G)
    assert seen and set(seen) == {torch.float32}


@pytest.mark.parametrize("qk_first", [False, True])
def test_output_bwd_qk_first(qk_first, monkeypatch):
    """``output.QK_FIRST`` (q and k read before the loop over V): only at K = 128 at 8 warps with a 16-bit partial
    dk, the one configuration where it was timed faster; both orders against float64 there (fp16 standing in for
    bf16), the rule seen to apply in the run."""
    from fastweight.kernels import delta, output
    monkeypatch.setattr(output, "QK_FIRST", qk_first)
    monkeypatch.setattr(delta, "PARTIAL_DK_DTYPES", (torch.float16,))
    f16, bf16 = torch.float16, torch.bfloat16
    assert output.reads_qk_first(128, 8, f16, f16, False) == qk_first
    assert output.reads_qk_first(128, 8, bf16, bf16, False) == qk_first
    # K = 64 or 100, 4 warps (narrow V blocks), an fp32 partial dk, a per-channel gate, K = 256: never
    for K, warps, dk_dtype, per_channel in ((64, 8, bf16, False), (100, 8, bf16, False), (128, 4, bf16, False),
                                            (128, 8, torch.float32, False), (128, 8, bf16, True),
                                            (256, 8, bf16, False)):
        assert not output.reads_qk_first(K, warps, dk_dtype, bf16, per_channel)
    seen = []
    real = output.reads_qk_first
    monkeypatch.setattr(output, "reads_qk_first", lambda *a: seen.append(real(*a)) or seen[-1])
    check("gated_delta_rule", 1, 150, 2, 128, 40, f16, cu_seqlens=torch.tensor([0, 70, 150]))
    assert seen and set(seen) == {qk_first}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="emulate_bf16 patches the interpreter")
def test_gdn_bf16_dk_against_rounding():
    """GDN's bf16 key gradient under the GPU's numerics ((2, 300, 2, 128), ``testing.emulate_bf16`` and
    ``emulate_tf32``), with the output backward's part of dk stored in bf16 (``delta.PARTIAL_DK_DTYPES``):
    within 2.6x its rounding floor. Input seeds 0-3: 2.46-2.55x (seed 0: 4.10e-3; fla 0.6.0, which rounds
    both parts to bf16 and adds them in bf16, 4.16e-3 there), against 2.26-2.35x with an fp32 partial."""
    from fastweight.bench.gpu_delta import inputs
    from fastweight.testing import emulate_bf16
    x = inputs("gated_delta_rule", 2, 300, 2, 128, 128, torch.bfloat16, "cpu", seed=0)
    mine = {n: t.clone().requires_grad_() for n, t in x.items()}
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    o_r, _ = reference.gated_delta_rule(**ref, scale=128 ** -0.5)
    do = torch.randn(o_r.shape, generator=generator(1), dtype=torch.float64)
    (o_r * do).sum().backward()
    with emulate_bf16(), emulate_tf32():
        o, _ = kernels.chunk_gated_delta_rule(**mine, scale=128 ** -0.5)
        (o.float() * do.float()).sum().backward()
    err, floor = rel_err(mine["k"].grad, ref["k"].grad), rel_err(ref["k"].grad.bfloat16(), ref["k"].grad)
    assert err <= 2.6 * floor, f"dk: {err:.3g} against a bf16 rounding floor of {floor:.3g}"

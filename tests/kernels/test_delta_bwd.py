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


@pytest.mark.parametrize("op", ["gated_delta_rule", "delta_rule", "comba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_grad_summed_in_wy_bwd(op, dtype, monkeypatch):
    """``delta.WY_GATE_GRAD``: the WY backward takes the reverse cumsum of a scalar gate's dg and stores it and
    dbeta in the inputs' dtypes; every gradient bit-equal to the reverse cumsum's launch and the casts after
    it, varlen with an empty sequence and a partial last chunk; no reverse ``chunk_cumsum`` runs."""
    from fastweight.kernels import delta
    x = {n: t.to(dtype) for n, t in sample(op, 1, 150, 2, 16, 16).items()}
    cu = torch.tensor([0, 70, 70, 150])
    calls = []
    real = delta.chunk_cumsum
    monkeypatch.setattr(delta, "chunk_cumsum", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    grads = []
    for fold in (False, True):
        monkeypatch.setattr(delta, "WY_GATE_GRAD", fold)
        calls.clear()
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, _ = getattr(kernels, f"chunk_{op}")(**leaves, scale=0.25, cu_seqlens=cu)
        o.float().sum().backward()
        grads.append({n: t.grad for n, t in leaves.items()})
        assert any(kw.get("reverse") for kw in calls) == (not fold and "g" in x)
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


@pytest.mark.parametrize("qk_first", [False, True])
def test_output_bwd_qk_first(qk_first, monkeypatch):
    """``output.QK_FIRST`` (q and k read before the loop over V): only at K = 128 with a 16-bit partial dk, the
    one configuration where it was timed faster; both orders against float64 there (fp16 standing in for bf16)."""
    from fastweight.kernels import delta, output
    monkeypatch.setattr(output, "QK_FIRST", qk_first)
    monkeypatch.setattr(delta, "PARTIAL_DK_DTYPES", (torch.float16,))
    f16, bf16 = torch.float16, torch.bfloat16
    assert output.reads_qk_first(128, f16, f16, False) == qk_first
    assert output.reads_qk_first(128, bf16, bf16, False) == qk_first
    # K = 64, an fp32 partial dk, a per-channel gate, K = 256: never
    for BK, dk_dtype, per_channel in ((64, bf16, False), (128, torch.float32, False), (128, bf16, True),
                                      (256, bf16, False)):
        assert not output.reads_qk_first(BK, dk_dtype, bf16, per_channel)
    check("gated_delta_rule", 1, 150, 2, 128, 40, f16, cu_seqlens=torch.tensor([0, 70, 150]))


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

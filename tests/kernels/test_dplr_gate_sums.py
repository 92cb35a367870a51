"""The generic DPLR kernels' gate sums formed inside a state pass rather than by ``chunk_cumsum``: the backward's
(``DplrLaunch.bwd_gate_sums``) and the forward's (``DplrLaunch.fwd_gate_sums``), against the float64
definitions under TRITON_INTERPRET=1, as ``test_dplr.py``.
"""

import pytest
import torch

import fastweight.kernels as kernels
from fastweight import ops
from fastweight.kernels import dplr
from fastweight.kernels.dplr import DplrLaunch
from fastweight.testing import generator, rel_err
from dplr_cases import TOL, check as _check, inputs as _inputs

pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.mark.parametrize("dtype, K, V", [(torch.float32, 16, 32), (torch.float16, 80, 72), (torch.float32, 144, 40)])
def test_dplr_bwd_gate_sums_in_the_state_pass(dtype, K, V, monkeypatch):
    """``DplrLaunch(bwd_gate_sums=True)``: the backward state pass forms the gate's chunk sums from the
    raw log gate and stores them for the rest of the backward (no ``chunk_cumsum``): the sums equal
    ``chunk_cumsum``'s to fp32 rounding (the same cumsum, another kernel), and the op matches float64
    with them (varlen with an empty sequence, a wide chunk between narrow ones, a short last chunk, K
    not a power of two: 80, 144, padded in the pass's one key block)."""
    from fastweight.kernels.cumsum import chunk_cumsum
    seen = []
    real = dplr.dplr_bwd

    def spy(q, k, v, a, b, gc, gk, *args, **kw):
        seen.append((gc.clone(), gk))
        return real(q, k, v, a, b, gc, gk, *args, **kw)
    monkeypatch.setattr(dplr, "dplr_bwd", spy)
    monkeypatch.setattr(dplr, "chunk_cumsum", lambda *a, **kw: pytest.fail("chunk_cumsum ran"))
    gen = generator()
    t = torch.arange(150)
    x = _inputs("rwkv7", 150, H=2, K=K, V=V, gen=gen, w_scale=torch.where(t // 64 == 1, 8.0, 1.0))
    cu = torch.tensor([0, 70, 70, 150])
    _check("rwkv7", x, dtype=dtype, cu_seqlens=cu, gen=gen, launch=DplrLaunch(bwd_gate_sums=True))
    (gc, gk), = seen
    want = chunk_cumsum(gk, kernels.common.prepare_chunks(cu, 1, 150, dplr.BT, "cpu"))
    # equal in the interpreter; on the GPU the scan may sum in another order
    assert rel_err(gc, want) < 1e-6, f"gate sums {rel_err(gc, want):.3g}"


@pytest.mark.parametrize("K, launch, in_pass", [(32, DplrLaunch(), False), (64, DplrLaunch(bwd_gate_sums=True), True),
                                               (80, DplrLaunch(bwd_gate_sums=True), True)])
def test_dplr_bwd_gate_sums_launch(K, launch, in_pass, monkeypatch):
    """The backward forms its gate sums in the state pass when asked (or, by default, for bf16 at K <= 64,
    which the interpreter cannot run: ``gate_sums_in_pass`` below), by ``chunk_cumsum`` otherwise; every
    gradient matches float64 either way."""
    ran = []
    real = dplr.chunk_cumsum
    monkeypatch.setattr(dplr, "chunk_cumsum", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    gen = generator()
    _check("rwkv7", _inputs("rwkv7", 70, H=2, K=K, V=16, gen=gen), dtype=torch.float32, gen=gen, launch=launch)
    assert (ran == []) == in_pass


def test_dplr_gate_sums_default():
    """The default: bf16 at K <= 64 (timed there), every other dtype and K by ``chunk_cumsum``; the flag's type."""
    rule = dplr.gate_sums_in_pass
    assert rule(DplrLaunch(), 64, torch.bfloat16) and rule(DplrLaunch(), 16, torch.bfloat16)
    assert not rule(DplrLaunch(), 128, torch.bfloat16) and not rule(DplrLaunch(), 64, torch.float16)
    assert not rule(DplrLaunch(), 64, torch.float32) and not rule(DplrLaunch(bwd_gate_sums=False), 64, torch.bfloat16)
    with pytest.raises(ValueError, match="bwd_gate_sums"):
        DplrLaunch(bwd_gate_sums=1)


@pytest.mark.parametrize("dtype, K, V, grad, extra", [(torch.float32, 16, 32, True, {}),
                                                      (torch.float16, 32, 40, True, {}),
                                                      (torch.float32, 80, 72, True, {}),
                                                      (torch.float32, 32, 24, False, {}),
                                                      (torch.float32, 16, 32, True, {"recompute": True}),
                                                      (torch.float32, 16, 32, True, {"wide_kernel": False})])
def test_dplr_fwd_gate_sums_in_the_state_pass(dtype, K, V, grad, extra, monkeypatch):
    """``DplrLaunch(fwd_gate_sums=True)``: the forward state pass forms the gate's chunk sums from the raw
    log gate; the intra kernel returns none (where K fits its one key block it stores them for the wide
    chunks alone, which its sub-chunk path reads). Output, final state and every gradient match float64
    (varlen with an empty sequence, a wide chunk between narrow ones, a short last chunk, K = 80 over
    several key blocks, V not a power of two), with and without a backward, with a backward that recomputes
    the forward (whose own pass reads the sums) and with the sub-chunk path inside the intra kernel."""
    seen = []
    real = dplr.state_fwd

    def spy(transition, k, v, chunks, **kw):
        seen.append((kw.get("raw_gate", False), kw["g"]))
        return real(transition, k, v, chunks, **kw)
    monkeypatch.setattr(dplr, "state_fwd", spy)
    intra = dplr.dplr_intra_fwd
    sums = []
    monkeypatch.setattr(dplr, "dplr_intra_fwd", lambda *a, **kw: sums.append(kw["gate_sums"]) or intra(*a, **kw))
    gen = generator()
    t = torch.arange(150)
    x = _inputs("rwkv7", 150, H=2, K=K, V=V, gen=gen, w_scale=torch.where(t // 64 == 1, 8.0, 1.0))
    cu = torch.tensor([0, 70, 70, 150])
    launch = DplrLaunch(fwd_gate_sums=True, **extra)
    if grad:
        _check("rwkv7", x, dtype=dtype, cu_seqlens=cu, gen=gen, launch=launch)
    else:
        with torch.no_grad():
            o, ht = kernels.chunk_rwkv7(**{n: v.to(dtype) for n, v in x.items()}, scale=K ** -0.5,
                                        output_final_state=True, cu_seqlens=cu, launch=launch)
        ro, rht = ops.chunk_rwkv7(**{n: v.double() for n, v in x.items()}, scale=K ** -0.5, output_final_state=True,
                                  cu_seqlens=cu, backend="reference")
        assert rel_err(o, ro) < TOL[dtype] and rel_err(ht, rht) < TOL[dtype], (rel_err(o, ro), rel_err(ht, rht))
    # the forward's pass read the raw gate; the backward's forms its own sums (or reads chunk_cumsum's)
    assert seen[0][0] and seen[0][1].shape == (1, 150, 2, K) and sums[0] is False
    # a recomputing backward runs the pass again on the full sums of its own intra call
    assert [raw for raw, _ in seen[1:]] == ([False] if extra.get("recompute") else [])
    assert sums[1:] == ([True] if extra.get("recompute") else [])


def test_dplr_fwd_gate_sums_default():
    """The forward's gate sums in the pass: by default for bf16 at K <= 64 (timed there), elsewhere when asked;
    the flag's type; ``state_fwd`` refuses a raw gate outside the dplr transition."""
    rule = dplr.fwd_gate_sums_in_pass
    assert rule(DplrLaunch(fwd_gate_sums=True), 128, torch.float32)
    assert not rule(DplrLaunch(fwd_gate_sums=False), 64, torch.bfloat16)
    assert rule(DplrLaunch(), 64, torch.bfloat16) and rule(DplrLaunch(), 16, torch.bfloat16)
    assert not rule(DplrLaunch(), 128, torch.bfloat16) and not rule(DplrLaunch(), 64, torch.float16)
    # bf16 K in 33..63 takes 32-wide key blocks in the intra kernel, which then stores its sums anyway
    assert rule(DplrLaunch(), 32, torch.bfloat16) and not rule(DplrLaunch(), 48, torch.bfloat16)
    assert rule(DplrLaunch(intra_config=(64, (4, 2))), 48, torch.bfloat16)
    with pytest.raises(ValueError, match="fwd_gate_sums"):
        DplrLaunch(fwd_gate_sums="yes")
    from fastweight.kernels.common import prepare_chunks
    from fastweight.kernels.state import state_fwd
    chunks = prepare_chunks(None, 1, 64, 64, "cpu")
    with pytest.raises(ValueError, match="raw_gate"):
        state_fwd("decay", torch.zeros(1, 64, 1, 16), torch.zeros(1, 64, 1, 16), chunks, g=torch.zeros(1, 64, 1, 16),
                  raw_gate=True)

"""The fused solve and WY stage of the DPLR forward (``fastweight.kernels.dplr_wy.dplr_solve_wy``, the default
for bf16) against the two kernels it replaces, against float64, and in the op; under TRITON_INTERPRET=1 (fp32,
fp16). The op-level helpers are ``dplr_cases``'."""

import pytest
import torch

import fastweight.kernels as kernels
from fastweight import ops
from fastweight.kernels import dplr, dplr_wy
from fastweight.kernels.dplr import DplrLaunch
from fastweight.testing import generator, rel_err
from dplr_cases import TOL, check as _check, inputs as _inputs

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _wy64(Aab, Aak, ag, v, cu):
    """W = T ag and U~ = T A_ak V in float64 from the stage inputs, T = (I - A_ab)^{-1} per chunk."""
    W, U = torch.zeros_like(ag, dtype=torch.float64), torch.zeros_like(v, dtype=torch.float64)
    for n in range(len(cu) - 1):
        for c0 in range(int(cu[n]), int(cu[n + 1]), dplr.BT):
            c1 = min(c0 + dplr.BT, int(cu[n + 1]))
            for h in range(ag.shape[2]):
                L = c1 - c0
                T = torch.linalg.inv(torch.eye(L, dtype=torch.float64) - Aab[0, c0:c1, h, :L].double().tril(-1))
                W[0, c0:c1, h] = T @ ag[0, c0:c1, h].double()
                U[0, c0:c1, h] = T @ (Aak[0, c0:c1, h, :L].double().tril(-1) @ v[0, c0:c1, h].double())
    return W, U


@pytest.mark.parametrize("dtype, K, V, factors_fp32", [(torch.float32, 16, 32, False), (torch.float16, 80, 72, False),
                                                       (torch.float16, 32, 16, True)])
def test_dplr_solve_wy_against_its_stages(dtype, K, V, factors_fp32):
    """``dplr_solve_wy`` (the solve and W, U~ in one kernel, T held as blocks) against the solve and
    ``dplr_wy_fwd`` run apart: T bit for bit (the same blocks, stored the same way); W and U~ (U~
    regrouped as (T A_ak) V), with and without a stored T, as close to float64 as the stages' (measured:
    equal to 3 digits in fp16, U~ 7% closer in fp32). A strong-decay chunk between weak ones, a short last
    chunk, varlen with an empty sequence, two heads; the default configuration and (2 warps, 64, 64)."""
    gen = generator()
    t = torch.arange(150)
    x = _inputs("dplr_delta_rule", 150, H=2, K=K, V=V, gen=gen, w_scale=torch.where(t // 64 == 1, 8.0, 1.0))
    x = {n: t.to(dtype if n != "gk" else t.dtype) for n, t in x.items()}
    cu = torch.tensor([0, 70, 70, 150])
    chunks = kernels.common.prepare_chunks(cu, 1, 150, dplr.BT, "cpu")
    launch = DplrLaunch(factors_fp32=factors_fp32)
    _, _, _, Aak, Aab, _, ag = dplr._intra(x["q"], x["k"], x["a"], x["b"], x["gk"], K ** -0.5, chunks, launch)
    factors = torch.float32 if factors_fp32 else dtype
    Ai = kernels.kkt_solve.solve(Aab, torch.full((1, 150, 2), -1.0), chunks, dtype=factors, precision_of=dtype)
    w, ut = dplr_wy.dplr_wy_fwd(ag, x["v"], Ai, Aak, chunks, dtype=dtype)
    W, U = _wy64(Aab, Aak, ag, x["v"], cu)
    Ai2, w2, ut2 = dplr_wy.dplr_solve_wy(Aab, ag, x["v"], Aak, chunks, dtype=dtype, t_dtype=factors)
    assert torch.equal(Ai2, Ai)
    fused = [(w2, ut2)]
    if not factors_fp32:  # no T stored: rounded as the inputs' dtype, as the stored T it equals
        assert dplr_wy.dplr_solve_wy(Aab, ag, x["v"], Aak, chunks, dtype=dtype, t_dtype=None)[0] is None
        fused.append(dplr_wy.dplr_solve_wy(Aab, ag, x["v"], Aak, chunks, dtype=dtype, t_dtype=None)[1:])
    # the other configurations the benchmark sweeps: two warps, 64-wide blocks
    fused.append(dplr_wy.dplr_solve_wy(Aab, ag, x["v"], Aak, chunks, dtype=dtype, t_dtype=factors,
                                       config=(2, 64, 64))[1:])
    for w_f, ut_f in fused:
        assert rel_err(w_f, W) <= 1.1 * rel_err(w, W), f"W: {rel_err(w_f, W):.3g} against {rel_err(w, W):.3g}"
        assert rel_err(ut_f, U) <= 1.1 * rel_err(ut, U), f"U~: {rel_err(ut_f, U):.3g} against {rel_err(ut, U):.3g}"


@pytest.mark.parametrize("how", ["grad", "no_grad", "recompute"])
def test_dplr_solve_wy_op(how):
    """The op with the fused solve and WY stage (``DplrLaunch(solve_wy=True)``) against float64: the
    backward keeping T (stored by the fused kernel), recomputing it, or none (T never stored); a
    wide chunk, varlen, two heads, K = 80 (two key blocks), V = 72."""
    gen = generator()
    t = torch.arange(150)
    x = _inputs("rwkv7", 150, H=2, K=80, V=72, gen=gen, w_scale=torch.where(t // 64 == 1, 8.0, 1.0))
    launch = DplrLaunch(solve_wy=True, recompute=how == "recompute")
    cu = torch.tensor([0, 70, 150])
    if how != "no_grad":
        _check("rwkv7", x, cu_seqlens=cu, gen=gen, launch=launch)
        return
    with torch.no_grad():
        o, ht = kernels.chunk_rwkv7(**x, scale=80 ** -0.5, output_final_state=True, cu_seqlens=cu, launch=launch)
    ro, rht = ops.chunk_rwkv7(**{n: v.double() for n, v in x.items()}, scale=80 ** -0.5, output_final_state=True,
                              cu_seqlens=cu, backend="reference")
    assert rel_err(o, ro) < TOL[torch.float32] and rel_err(ht, rht) < TOL[torch.float32]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("dtype, solve_wy, fused", [(torch.bfloat16, None, True), (torch.float16, None, False),
                                                    (torch.float32, None, False), (torch.float32, True, True),
                                                    (torch.bfloat16, False, False)])
def test_dplr_solve_wy_default_by_dtype(dtype, solve_wy, fused, monkeypatch):
    """The fused solve and WY stage is the default for bf16 inputs only (fp16's and fp32's dots spill
    there, docs/bench/decay_dplr.md); ``solve_wy`` True / False forces either."""
    taken = []

    def record(name):
        def stop(*args, **kw):
            taken.append(name)
            raise _Stop
        return stop
    monkeypatch.setattr(dplr, "dplr_solve_wy", record("fused"))
    monkeypatch.setattr(dplr, "solve", record("split"))
    x = {n: t.to(dtype if n != "w" else t.dtype) for n, t in _inputs("rwkv7", 20, gen=generator()).items()}
    with pytest.raises(_Stop):
        kernels.chunk_rwkv7(**x, scale=1.0, launch=DplrLaunch(solve_wy=solve_wy))
    assert taken == ["fused" if fused else "split"]

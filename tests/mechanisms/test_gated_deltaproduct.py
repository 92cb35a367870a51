"""Gated DeltaProduct: n delta steps a token, the gate on the first, q read after the last.

The op (fla's layout: k, v, beta at T * n rows) against its definition (the mechanism's own
per-token step) in float64, on every path: the PyTorch chunk map, the Triton kernels under the
interpreter (fp32, small shapes), every gradient. n = 1 is Gated DeltaNet."""

import dataclasses

import pytest
import torch

from fastweight import fuzz, ops, theory
from fastweight.mechanisms import OPS, get
from fastweight.mechanisms.gated_deltaproduct import per_token, substeps_first
from fastweight.testing import generator, rel_err, strided

M = get("gated_deltaproduct")
# float64: the PyTorch chunk path's errors measured up to 7.4e-15 on these cases
TOL64 = 1e-12
# float32 against the float64 definition (67 tokens, 134 substeps): measured up to 3.7e-7 (Triton
# chunk, dg), 1.9e-7 (Triton fused recurrent), 1.8e-7 (PyTorch chunk path)
TOL32 = 5e-6


def op_inputs(B, T, H, K, V, n, *, HV=None, strong=False, seed=0, dtype=torch.float64):
    """The op's tensors by name (fla's layout), initial state [B, HV, K, V] under ``initial_state``."""
    g = generator(seed)
    gate = (lambda shape: -(0.5 + 5.5 * torch.rand(shape, dtype=torch.float64, generator=g))) if strong else None
    x = OPS["gated_delta_product"].sample(B, T, H, HV or H, K, V, dtype=torch.float64, device="cpu",
                                          generator=g, log_gate=gate, num_householder=n)
    x["initial_state"] = torch.randn(B, HV or H, K, V, dtype=torch.float64, generator=g)
    return {name: t.to(dtype) for name, t in x.items()}


def run(x, n, backend, mode="chunk", cotangent="contiguous", **kw):
    """(o, final state, gradients of every input by name) of ``<mode>_gated_delta_product``."""
    leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
    h0 = leaves.pop("initial_state")
    fn = getattr(ops, f"{mode}_gated_delta_product")
    o, S = fn(**leaves, num_householder=n, initial_state=h0, output_final_state=True, backend=backend, **kw)
    g = generator(7)   # the cotangents drawn in float64 (the same values for every dtype), cast
    do = strided(torch.randn(o.shape, dtype=torch.float64, generator=g).to(o.dtype), cotangent)
    dS = torch.randn(S.shape, dtype=torch.float64, generator=g).to(S.dtype)
    torch.autograd.backward([o, S], [do, dS])
    grads = {f"d{name}": t.grad for name, t in leaves.items()}
    grads["dh0"] = h0.grad
    return dict(o=o.detach(), S=S.detach(), **grads)


def worst(got: dict, want: dict) -> dict:
    assert set(got) == set(want) and all(t is not None for t in got.values())
    return {name: rel_err(got[name], want[name]) for name in want}


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("T, strong", [(1, False), (37, True), (65, False), (100, True)])
def test_torch_chunk_path_is_the_definition(n, T, strong):
    """Odd lengths, partial chunks (of 64 substeps), strong decays, every gradient (dg, dbeta, dh0 too),
    float64."""
    x = op_inputs(2, T, 2, 8, 6, n, strong=strong)
    errors = worst(run(x, n, "torch"), run(x, n, "reference"))
    assert max(errors.values()) <= TOL64, errors


@pytest.mark.parametrize("cotangent", ["expanded", "transposed_outer", "sliced"])
def test_non_contiguous_output_gradient(cotangent):
    x = op_inputs(1, 30, 2, 8, 6, 2, seed=1)
    errors = worst(run(x, 2, "torch", cotangent=cotangent), run(x, 2, "reference", cotangent=cotangent))
    assert max(errors.values()) <= TOL64, errors


def test_grouped_value_heads():
    """q, k at H heads, v, beta, g and the state at HV = 2 H (value head j reads key head j // 2)."""
    x = op_inputs(1, 40, 1, 8, 6, 2, HV=2, seed=2)
    want = run(x, 2, "reference")
    assert want["o"].shape == (1, 40, 2, 6) and want["S"].shape == (1, 2, 8, 6)
    assert max(worst(run(x, 2, "torch"), want).values()) <= TOL64


def test_varlen_counts_tokens():
    """cu_seqlens in tokens (an empty sequence included): each sequence restarts from its own state."""
    n, lengths = 3, [20, 0, 45, 1]
    x = op_inputs(1, sum(lengths), 2, 8, 6, n, seed=3)
    x["initial_state"] = torch.randn(len(lengths), 2, 8, 6, dtype=torch.float64, generator=generator(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    want = run(x, n, "reference", cu_seqlens=cu)
    assert max(worst(run(x, n, "torch", cu_seqlens=cu), want).values()) <= TOL64
    for i, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = dict(q=x["q"][:, bos:eos], g=x["g"][:, bos:eos], initial_state=x["initial_state"][i:i + 1],
                    **{name: x[name][:, bos * n:eos * n] for name in ("k", "v", "beta")})
        if eos == bos:
            assert rel_err(want["S"][i], x["initial_state"][i]) == 0
            continue
        alone = run(part, n, "reference")
        assert rel_err(want["o"][:, bos:eos], alone["o"]) <= TOL64 and rel_err(want["S"][i:i + 1], alone["S"]) <= TOL64


def test_one_householder_step_is_gated_delta_rule():
    x = op_inputs(2, 50, 2, 8, 6, 1, seed=5)
    for backend in ("reference", "torch"):
        got = run(x, 1, backend)
        leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
        h0 = leaves.pop("initial_state")
        o, S = ops.chunk_gated_delta_rule(**leaves, initial_state=h0, output_final_state=True, backend=backend)
        g = generator(7)
        torch.autograd.backward([o, S], [torch.randn(o.shape, dtype=o.dtype, generator=g),
                                         torch.randn(S.shape, dtype=S.dtype, generator=g)])
        want = dict(o=o.detach(), S=S.detach(), dh0=h0.grad, **{f"d{name}": t.grad for name, t in leaves.items()})
        assert max(worst(got, want).values()) <= TOL64


def test_options_and_ungated():
    """use_qk_l2norm_in_kernel normalises q and every substep's key; g=None is no decay;
    allow_neg_eigval takes beta in (0, 2]."""
    x = op_inputs(1, 21, 2, 8, 6, 2, seed=6)
    x["k"] = 3 * x["k"]
    o, _ = ops.chunk_gated_delta_product(**{n: t for n, t in x.items() if n != "initial_state"}, num_householder=2,
                                         use_qk_l2norm_in_kernel=True, backend="torch")
    unit = {n: x[n] / x[n].norm(dim=-1, keepdim=True) for n in ("q", "k")}
    o_ref, _ = ops.chunk_gated_delta_product(**{**x, **unit, "initial_state": None}, num_householder=2,
                                             backend="reference")
    assert rel_err(o, o_ref) <= 1e-6   # the kernel's norm has fla's eps 1e-6 inside the root
    none, _ = ops.chunk_gated_delta_product(x["q"], x["k"], x["v"], None, x["beta"], 2, backend="torch")
    zero, _ = ops.chunk_gated_delta_product(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]), x["beta"], 2,
                                            backend="reference")
    assert rel_err(none, zero) <= TOL64
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        ops.chunk_gated_delta_product(x["q"], x["k"], x["v"], x["g"], 1.5 * x["beta"] + 0.5, 2, backend="torch")
    wide, _ = ops.chunk_gated_delta_product(x["q"], x["k"], x["v"], x["g"], 1.5 * x["beta"] + 0.5, 2,
                                            allow_neg_eigval=True, backend="torch")
    assert torch.isfinite(wide).all()


@pytest.mark.parametrize("backend, mode", [("triton", "chunk"), ("triton", "fused_recurrent"), ("torch", "chunk")])
def test_fp32_paths(backend, mode):
    """The Triton kernels (TRITON_INTERPRET=1 on the CPU) and the PyTorch chunk path in fp32 against
    the float64 definition: varlen in tokens (an empty sequence), grouped value heads, every gradient."""
    n, lengths = 2, [37, 0, 30]
    x = op_inputs(1, sum(lengths), 1, 16, 16, n, HV=2, seed=8)
    x["initial_state"] = torch.randn(len(lengths), 2, 16, 16, dtype=torch.float64, generator=generator(9))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    want = run(x, n, "reference", cu_seqlens=cu)
    got = run({k: t.float() for k, t in x.items()}, n, backend, mode=mode, cu_seqlens=cu)
    assert got["o"].dtype == torch.float32 and got["S"].dtype == torch.float32
    errors = worst(got, want)
    assert max(errors.values()) <= TOL32, errors


def test_the_mechanism_is_the_op():
    """The mechanism's own inputs (per token: k [B, T, H, n, K]) through ``to_op`` give the op's
    result; its step is n delta-rule gradient steps (objective) and GDN over T * n steps (DPLR)."""
    x = M.sample(2, 23, 2, 8, 6, dtype=torch.float64, device="cpu", generator=generator(10), num_householder=3)
    h0 = torch.randn(2, 2, 8, 6, dtype=torch.float64, generator=generator(11))
    o, S = M.recurrent(x, scale=0.7, initial_state=h0, output_final_state=True)
    args = M.to_op(x)
    assert args["num_householder"] == 3 and args["k"].shape == (2, 69, 2, 8)
    assert rel_err(per_token(args["k"], 3), x["k"]) == 0 and rel_err(substeps_first(per_token(args["v"], 3)),
                                                                      args["v"]) == 0
    o_op, S_op = ops.chunk_gated_delta_product(**args, scale=0.7, initial_state=h0, output_final_state=True,
                                               backend="torch")
    assert rel_err(o_op, o) <= TOL64 and rel_err(S_op, S) <= TOL64
    assert theory.check_dplr_map(M, x, initial_state=h0, scale=0.7) <= TOL64
    assert theory.check_gradient_step(M, x, initial_state=h0) <= TOL64


def test_the_gate_on_a_later_substep_is_caught():
    """The checks can fail: the gate applied after the first delta step is another recurrence."""
    x = M.sample(2, 9, 2, 8, 6, dtype=torch.float64, device="cpu", generator=generator(12))

    def late_gate(S, x):
        first = {**x, "g": None, "k": x["k"][:, :, :1], "v": x["v"][:, :, :1], "beta": x["beta"][:, :, :1]}
        rest = {**x, "k": x["k"][:, :, 1:], "v": x["v"][:, :, 1:], "beta": x["beta"][:, :, 1:]}
        return M.step(M.step(S, first), rest)

    assert theory.check_gradient_step(M, x, step=late_gate) > 1e-3
    assert theory.check_dplr_map(dataclasses.replace(M, step=late_gate), x) > 1e-3


def test_a_token_transition_is_the_product_of_its_householder_factors():
    x = M.sample(2, 4, 2, 6, 5, dtype=torch.float64, device="cpu", generator=generator(13), num_householder=3)
    t, eye = 2, torch.eye(6, dtype=torch.float64)
    want = x["g"][:, t].exp()[..., None, None] * eye
    for j in range(3):
        k, beta = x["k"][:, t, :, j], x["beta"][:, t, :, j, None, None]
        want = (eye - beta * k[..., :, None] * k[..., None, :]) @ want
    assert rel_err(theory.transition_matrix(M, x, t), want) <= 1e-14


def test_bad_inputs_name_the_argument():
    x = op_inputs(1, 10, 2, 8, 6, 2)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match=r"`k` must have T \* num_householder = 10 \* 2 = 20 rows"):
        ops.chunk_gated_delta_product(q, k[:, :19], v, g, beta, 2)
    with pytest.raises(ValueError, match="`v` must have T"):
        ops.fused_recurrent_gated_delta_product(q, k, v[:, :10], g, beta, 2)
    with pytest.raises(ValueError, match="`beta` must have T"):
        ops.chunk_gated_delta_product(q, k, v, g, beta[:, :10], 2)
    with pytest.raises(ValueError, match="`k` must have T"):
        ops.chunk_gated_delta_product(q, k, v, g, beta, 3)
    with pytest.raises(ValueError, match="`num_householder` must be >= 1"):
        ops.chunk_gated_delta_product(q, k, v, g, beta, 0)
    with pytest.raises(TypeError, match="`num_householder` must be an int"):
        ops.chunk_gated_delta_product(q, k, v, g, beta, 2.0)
    with pytest.raises(ValueError, match="`g`"):
        ops.chunk_gated_delta_product(q, k, v, g[:, :5], beta, 2)
    with pytest.raises(ValueError, match="`cu_seqlens` must end at T=10"):
        ops.chunk_gated_delta_product(q, k, v, g, beta, 2, cu_seqlens=torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="cp_context"):
        ops.chunk_gated_delta_product(q, k, v, g, beta, 2, cp_context=object())


def test_the_fuzz_draws_it_through_its_sample():
    """No per-op branch in the fuzz: Op.sample draws the tensors, Op.sample_options the substeps."""
    case = next(c for s in range(50) if (c := fuzz.draw("ci", "gated_delta_product", s, "chunk", "torch", "fp32"))
                .lengths and dict(c.options)["num_householder"] == 3)
    x = fuzz.draw_inputs(case)
    assert x["k"].shape[1] == x["v"].shape[1] == x["beta"].shape[1] == 3 * case.T and x["g"].shape[1] == case.T
    res = fuzz.check(case)
    assert res.ok, res.line()

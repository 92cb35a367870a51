"""Longhorn: the closed form is the proximal step; the write is eps k v^T, not beta k v^T.

The released Longhorn code's diagonal step (``diagonal_step=True``; ``longhorn.DIAGONAL``, a variant of
the mechanism with its own ``fastweight verify`` row) against
its definition (the per-token step ``Diag(1 - eps k * k) S + eps k v^T``) in float64 on the PyTorch
chunk path, under the Triton interpreter in fp32, every gradient; its DPLR form and objective."""

import dataclasses

import pytest
import torch

from fastweight import ops, theory
from fastweight.analysis.attention import recorded_recurrences
from fastweight.layers import build_mixer
from fastweight.layers.linear_op import force_generic
from fastweight.mechanisms import OPS, REGISTRY, get
from fastweight.mechanisms.base import kT_S, outer
from fastweight.mechanisms.longhorn import DIAGONAL, diagonal_gate, step_size
from fastweight.models import LMConfig
from fastweight.testing import generator, rel_err

TOL64 = 1e-12
# fp32 against the float64 definition (67 tokens, K = V = 16): measured up to 6.0e-7 (dbeta, Triton fused
# recurrent), 4.7e-7 (Triton chunk), 5.6e-7 (PyTorch chunk path)
TOL32 = 5e-6


def test_closed_form_is_the_proximal_step():
    m = get("longhorn")
    x = m.sample(2, 20, 2, 8, 6, dtype=torch.float64, device="cpu", generator=generator())
    assert theory.check_gradient_step(m, x) <= 1e-12


def test_the_seed_write_is_not_the_proximal_step():
    m = get("longhorn")
    x = m.sample(2, 20, 2, 8, 6, dtype=torch.float64, device="cpu", generator=generator())

    def seed_step(S, x):
        k, beta = x["k"], x["beta"][..., None]
        eps = step_size(k, x["beta"])[..., None]
        return S - outer(eps * k, kT_S(k, S)) + outer(beta * k, x["v"])

    assert theory.check_gradient_step(m, x, step=seed_step) > 1e-3


def test_eps_keeps_the_transition_in_0_1():
    """1 - eps k^T k = 1 / (1 + beta k^T k): in (0, 1] for any beta >= 0."""
    m = get("longhorn")
    x = m.sample(4, 3, 2, 8, 6, dtype=torch.float64, device="cpu", generator=generator())
    x["beta"] = x["beta"] * 100
    eig = theory.transition_eigenvalues(m, x, 1).real
    assert bool((eig > 0).all()) and bool((eig <= 1 + 1e-12).all())


@pytest.mark.parametrize("T", [1, 63, 100])
def test_diagonal_step_is_a_dplr_recurrence_and_a_gradient_step(T):
    """The released step is the DPLR recurrence with w = 1 - eps k * k, a = b = 0, write (eps k, v),
    and one explicit step, learning rate eps, on 1/2 ||Diag(k) S||^2 - <S^T k, v>."""
    g = generator()
    x = DIAGONAL.sample(2, T, 2, 8, 6, dtype=torch.float64, device="cpu", generator=g)
    h0 = torch.randn(2, 2, 8, 6, dtype=torch.float64, generator=g)
    assert theory.check_dplr_map(DIAGONAL, x, initial_state=h0, scale=0.7) <= TOL64
    assert theory.check_gradient_step(DIAGONAL, x, initial_state=h0) <= TOL64
    # not the exact (proximal) step: that one is checked against the same objective above
    assert theory.check_gradient_step(get("longhorn"), x, initial_state=h0, step=DIAGONAL.step) > 1e-3


def test_diagonal_step_is_a_variant_of_longhorn_not_a_registry_entry():
    m = get("longhorn")
    assert m.variants == (DIAGONAL,) and DIAGONAL.op == m.op and DIAGONAL.name not in REGISTRY
    assert DIAGONAL.to_op({n: None for n in DIAGONAL.input_names})["diagonal_step"] is True
    with pytest.raises(ValueError, match="same op"):
        dataclasses.replace(m, variants=(dataclasses.replace(DIAGONAL, op="delta_rule"),))


def test_diagonal_gate_is_log_of_1_minus_eps_k2_and_finite_for_any_key():
    g = generator(0)
    k = torch.randn(3, 5, 2, 8, dtype=torch.float64, generator=g)
    beta = 2 * torch.rand(3, 5, 2, dtype=torch.float64, generator=g)
    gate, write = diagonal_gate(k, beta)
    eps = step_size(k, beta)[..., None]
    assert rel_err(gate, torch.log(1 - eps * k * k)) <= TOL64 and rel_err(write, eps * k) <= TOL64
    # a key on one channel with a large beta: 1 - eps k_0^2 = 1 / (1 + beta k_0^2), rounding to 0 in fp32
    one = torch.zeros(1, 8)
    one[0, 0] = 100.0
    gate32, _ = diagonal_gate(one, torch.tensor([1e4]))
    assert torch.isfinite(gate32).all() and bool((gate32 <= 0).all())
    assert abs(gate32[0, 0].item() + torch.log1p(torch.tensor(1e8, dtype=torch.float64)).item()) <= 1e-5
    assert bool((gate32[0, 1:] == 0).all())


def op_inputs(B, T, H, K, V, *, HV=None, seed=0, dtype=torch.float64):
    g = generator(seed)
    x = DIAGONAL.sample(B, T, HV or H, K, V, dtype=torch.float64, device="cpu", generator=g)
    x["q"], x["k"] = x["q"][:, :, :H], x["k"][:, :, :H]
    x["initial_state"] = torch.randn(B, HV or H, K, V, dtype=torch.float64, generator=g)
    return {name: t.to(dtype) for name, t in x.items()}


def run(x, backend, mode="chunk", **kw):
    """(o, final state, every gradient by name) of ``<mode>_longhorn``."""
    leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
    h0 = leaves.pop("initial_state")
    fn = getattr(ops, f"{mode}_longhorn")
    o, S = fn(**leaves, initial_state=h0, output_final_state=True, backend=backend, **kw)
    g = generator(7)
    do = torch.randn(o.shape, dtype=torch.float64, generator=g).to(o.dtype)
    dS = torch.randn(S.shape, dtype=torch.float64, generator=g).to(S.dtype)
    torch.autograd.backward([o, S], [do, dS])
    return dict(o=o.detach(), S=S.detach(), dh0=h0.grad, **{f"d{name}": t.grad for name, t in leaves.items()})


def worst(got, want):
    assert set(got) == set(want) and all(t is not None for t in got.values())
    return {name: rel_err(got[name], want[name]) for name in want}


def test_the_reference_is_the_released_per_token_step():
    """The op's reference with diagonal_step=True is the released code's loop, written out here:
    dA = 1 - eps k^2, dB = eps k; S <- S * dA + v dB; o = S^T (scale q)."""
    x = op_inputs(2, 30, 2, 8, 6, seed=1)
    o, S = ops.chunk_longhorn(**x, output_final_state=True, diagonal_step=True, backend="reference", scale=0.5)
    state = x["initial_state"].clone()
    outs = []
    for t in range(30):
        k, v, beta = x["k"][:, t], x["v"][:, t], x["beta"][:, t]
        eps = beta / (1 + beta * (k * k).sum(-1))
        state = state * (1 - eps[..., None] * k * k)[..., None] + (eps[..., None] * k)[..., None] * v[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, 0.5 * x["q"][:, t]))
    assert rel_err(o, torch.stack(outs, 1)) <= TOL64 and rel_err(S, state) <= TOL64


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("T", [1, 63, 100])
def test_diagonal_step_torch_path_is_the_definition(mode, T):
    x = op_inputs(2, T, 2, 8, 6, seed=T)
    errors = worst(run(x, "torch", mode, diagonal_step=True), run(x, "reference", mode, diagonal_step=True))
    assert max(errors.values()) <= TOL64, errors


def test_diagonal_step_grouped_heads_and_varlen():
    """q, k at H heads, v, beta and the state at HV = 2 H; cu_seqlens with an empty sequence."""
    lengths = [20, 0, 45, 1]
    x = op_inputs(1, sum(lengths), 1, 8, 6, HV=2, seed=3)
    x["initial_state"] = torch.randn(len(lengths), 2, 8, 6, dtype=torch.float64, generator=generator(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    want = run(x, "reference", diagonal_step=True, cu_seqlens=cu)
    assert want["o"].shape == (1, 66, 2, 6) and rel_err(want["S"][1], x["initial_state"][1]) == 0
    assert max(worst(run(x, "torch", diagonal_step=True, cu_seqlens=cu), want).values()) <= TOL64
    for i, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if eos > bos:
            part = {n: x[n][:, bos:eos] for n in ("q", "k", "v", "beta")}
            o, S = ops.chunk_longhorn(**part, initial_state=x["initial_state"][i:i + 1], output_final_state=True,
                                      diagonal_step=True, backend="reference")
            assert rel_err(want["o"][:, bos:eos], o) <= TOL64 and rel_err(want["S"][i:i + 1], S) <= TOL64


@pytest.mark.parametrize("backend, mode", [("triton", "chunk"), ("triton", "fused_recurrent"), ("torch", "chunk")])
def test_diagonal_step_fp32_paths(backend, mode):
    """The Triton kernels (the decay family's, under TRITON_INTERPRET=1 on the CPU) and the PyTorch
    chunk path in fp32 against the float64 definition: varlen, grouped value heads, every gradient."""
    lengths = [37, 0, 30]
    x = op_inputs(1, sum(lengths), 1, 16, 16, HV=2, seed=8)
    x["initial_state"] = torch.randn(len(lengths), 2, 16, 16, dtype=torch.float64, generator=generator(9))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    want = run(x, "reference", mode, diagonal_step=True, cu_seqlens=cu)
    x32 = {n: t.float() for n, t in x.items()}
    errors = worst(run(x32, backend, mode, diagonal_step=True, cu_seqlens=cu), want)
    assert max(errors.values()) <= TOL32, errors


def test_default_is_the_exact_step_and_the_forms_differ():
    x = op_inputs(2, 64, 2, 8, 6, seed=10)
    default = run(x, "torch")
    exact = run(x, "reference")
    assert max(worst(default, exact).values()) <= TOL64
    diagonal = run(x, "reference", diagonal_step=True)
    assert rel_err(diagonal["o"], exact["o"]) > 0.05
    assert OPS["longhorn"].defaults == dict(diagonal_step=False)


def test_diagonal_step_arguments_are_checked():
    x = op_inputs(1, 5, 2, 8, 6)
    with pytest.raises(ValueError, match="beta"):
        ops.chunk_longhorn(x["q"], x["k"], x["v"], -x["beta"], diagonal_step=True, backend="torch")
    with pytest.raises(TypeError, match="diagonal_step"):
        ops.fused_recurrent_longhorn(x["q"], x["k"], x["v"], x["beta"], diagonal_step=1)


def test_longhorn_diagonal_mixer_takes_the_released_step():
    """The two mixers hold the same weights; the diagonal one calls the op with diagonal_step=True
    (the forms differ), and the layers' generic DPLR route reads the same flag."""
    cfg = LMConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=16, mixer="longhorn")
    torch.manual_seed(0)
    exact = build_mixer("longhorn", cfg).double()
    diagonal = build_mixer("longhorn_diagonal", cfg).double()
    diagonal.load_state_dict(exact.state_dict())
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with recorded_recurrences() as calls:
        y_exact, y_diagonal = exact(x), diagonal(x)
    assert [c.op for c in calls] == ["longhorn", "longhorn"]
    assert [c.tensors.get("diagonal_step", False) for c in calls] == [False, True]
    t = calls[1].tensors
    o, _ = ops.chunk_longhorn(t["q"], t["k"], t["v"], t["beta"], scale=calls[1].scale, diagonal_step=True,
                              backend="reference")
    assert rel_err(calls[1].output, o) <= TOL64
    assert rel_err(y_diagonal, y_exact) > 1e-3
    with force_generic():
        assert rel_err(diagonal(x), y_diagonal) <= 1e-10


@pytest.mark.parametrize("diagonal_step", [False, True])
def test_a_step_size_per_value_channel_is_the_op_on_value_heads_of_dim_1(diagonal_step):
    """The released code's eps per value channel (Mamba's dt) is one transition per column of S: the op with
    grouped value heads of value dim 1 sharing q, k (docs/objectives.md measures it against the per-head
    mean this package takes). Equal beta over a head's channels gives the per-head op."""
    x = op_inputs(2, 37, 2, 8, 6, seed=11)
    q, k, v = x["q"], x["k"], x["v"]

    def per_channel(beta):   # beta [B, T, H, V]
        return torch.stack([ops.chunk_longhorn(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h, :, None],
                                               beta[:, :, h],
                                               diagonal_step=diagonal_step, backend="reference")[0][..., 0]
                            for h in range(2)], dim=2)

    o, _ = ops.chunk_longhorn(q, k, v, x["beta"], diagonal_step=diagonal_step, backend="reference")
    assert rel_err(per_channel(x["beta"][..., None].expand(v.shape)), o) <= TOL64
    spread = x["beta"][..., None] * (1 + 0.5 * torch.randn(v.shape, dtype=torch.float64, generator=generator(12)))
    assert rel_err(per_channel(spread.abs()), o) > 1e-2

"""The facts of DESIGN.md section 1."""

import pytest
import torch

from fastweight import theory
from fastweight.mechanisms import REGISTRY, get
from fastweight.mechanisms.base import regression
from fastweight.testing import generator, rel_err


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def test_delta_rule_three_forms_agree():
    g = generator()
    S = torch.randn(4, 3, 8, 5, dtype=torch.float64, generator=g)
    k = unit(torch.randn(4, 3, 8, dtype=torch.float64, generator=g))
    v = torch.randn(4, 3, 5, dtype=torch.float64, generator=g)
    beta = 2 * torch.rand(4, 3, dtype=torch.float64, generator=g)
    erase_write, householder, sgd = theory.delta_rule_forms(S, k, v, beta)
    assert rel_err(householder, erase_write) <= 1e-14 and rel_err(sgd, erase_write) <= 1e-14
    assert rel_err(erase_write, get("deltanet").step(S, dict(k=k, v=v, beta=beta))) <= 1e-14


@pytest.mark.parametrize("beta", [0.3, 1.0, 1.7])
def test_householder_spectrum(beta):
    """K-1 eigenvalues 1 and one 1 - beta along k (negative for beta > 1), from DeltaNet's transition."""
    m = get("deltanet")
    x = m.sample(3, 2, 2, 8, 4, dtype=torch.float64, device="cpu", generator=generator())
    x["beta"] = torch.full_like(x["beta"], beta)
    x["k"] = unit(x["k"])
    eig = theory.transition_eigenvalues(m, x, 1)
    assert float(eig.imag.abs().max()) <= 1e-12
    want = theory.householder_eigenvalues(torch.full((3, 2), beta, dtype=torch.float64), 8)
    assert rel_err(eig.real.sort(-1).values, want) <= 1e-12
    assert (float(eig.real.min()) < -1e-3) == (beta > 1)


@pytest.mark.parametrize("name", tuple(REGISTRY))
def test_transition_matrix_is_the_step(name):
    """S_t = A_t S_{t-1} + (write), with A_t = transition_matrix: checked on two states."""
    m = get(name)
    x = m.sample(2, 3, 2, 6, 5, dtype=torch.float64, device="cpu", generator=generator())
    g = generator()
    S1, S2 = (torch.randn(2, 2, 6, 5, dtype=torch.float64, generator=g) for _ in range(2))
    xt = {n: (v if n.startswith("_") else v[:, 1]) for n, v in x.items()}
    A = theory.transition_matrix(m, x, 1)
    assert rel_err(m.step(S1, xt) - m.step(S2, xt), A @ (S1 - S2)) <= 1e-13


def test_rwkv7_eigenvalues_in_unit_interval():
    """Real, in [-1, 1], below 1: also at the extremes a = 1 and w -> 0."""
    m = get("rwkv7")
    x = m.sample(64, 3, 2, 16, 4, dtype=torch.float64, device="cpu", generator=generator())
    x["a"][:, 2] = 1.0
    x["w"][:, 2] = -30.0
    for t in range(3):
        eig = theory.transition_eigenvalues(m, x, t)
        assert float(eig.imag.abs().max()) <= 1e-10
        assert float(eig.real.min()) >= -1 - 1e-12 and float(eig.real.max()) < 1


def test_proximal_step_solves_the_proximal_problem():
    """Against the closed form of argmin 1/2||X - A||^2 + beta/2 ||X^T k - v||^2, per head."""
    g = generator()
    A = torch.randn(2, 3, 6, 4, dtype=torch.float64, generator=g)
    k = torch.randn(2, 3, 6, dtype=torch.float64, generator=g)
    v = torch.randn(2, 3, 4, dtype=torch.float64, generator=g)
    beta = 3 * torch.rand(2, 3, dtype=torch.float64, generator=g)
    X, residual = theory.proximal_step(A, [(beta[..., None, None], regression(k, v))])
    Hess = torch.eye(6, dtype=torch.float64) + beta[..., None, None] * k[..., :, None] * k[..., None, :]
    closed = torch.linalg.solve(Hess, A + beta[..., None, None] * k[..., :, None] * v[..., None, :])
    assert rel_err(X, closed) <= 1e-13 and residual <= 1e-13


def test_check_gradient_step_needs_an_objective():
    from fastweight.mechanisms import Mechanism
    bare = Mechanism(**{**get("gla").__dict__, "name": "bare", "objective": None})
    x = bare.sample(1, 2, 1, 4, 4, dtype=torch.float64, device="cpu", generator=generator())
    with pytest.raises(ValueError, match="objective"):
        theory.check_gradient_step(bare, x)

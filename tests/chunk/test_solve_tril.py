"""The blockwise unit-lower solve against LAPACK's triangular solve."""

import pytest
import torch

from fastweight.chunk.solve_tril import solve_unit_lower
from fastweight.testing import generator, rel_err


def strictly_lower(C, dtype, seed=None, batch=(3, 2)):
    """Like the UT transform's diag(beta) K K^T: entries beta_r k_r . k_i with unit keys."""
    g = generator(seed)
    k = torch.nn.functional.normalize(torch.randn(*batch, C, 16, dtype=torch.float64, generator=g), dim=-1)
    beta = torch.rand(*batch, C, 1, dtype=torch.float64, generator=g)
    return ((beta * k) @ k.transpose(-1, -2)).tril(-1).to(dtype)


def lapack(L):
    eye = torch.eye(L.shape[-1], dtype=L.dtype).expand(L.shape)
    return torch.linalg.solve_triangular(eye + L.tril(-1), eye, upper=False, unitriangular=True)


@pytest.mark.parametrize("C", [1, 7, 16, 32, 64, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-5)])
def test_matches_solve_triangular(C, dtype, tol):
    L = strictly_lower(C, dtype)
    X = solve_unit_lower(L)
    assert X.dtype == dtype
    assert rel_err(X, lapack(L.double())) <= tol
    assert torch.equal(X.triu(1), torch.zeros_like(X))
    assert torch.equal(X.diagonal(dim1=-2, dim2=-1), torch.ones(X.shape[:-1], dtype=dtype))


def test_reads_only_the_strictly_lower_part():
    L = strictly_lower(64, torch.float64)
    noise = torch.randn(L.shape, dtype=torch.float64, generator=generator()).triu(0)
    assert torch.equal(solve_unit_lower(L + noise), solve_unit_lower(L))


@pytest.mark.parametrize("C", [16, 64])
def test_gradient(C):
    L = strictly_lower(C, torch.float64).requires_grad_()
    dX = torch.randn(L.shape, dtype=torch.float64, generator=generator())
    (grad,) = torch.autograd.grad((solve_unit_lower(L) * dX).sum(), L)
    (want,) = torch.autograd.grad((lapack(L) * dX).sum(), L)
    assert rel_err(grad, want.tril(-1)) <= 1e-12
    assert torch.equal(grad.triu(0), torch.zeros_like(grad))


def test_rejects_chunks_not_a_power_of_two_times_16():
    with pytest.raises(ValueError, match="chunk size"):
        solve_unit_lower(torch.zeros(48, 48))

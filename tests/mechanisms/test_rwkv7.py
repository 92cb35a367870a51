"""RWKV-7: the paper's row-wise update, its column form, and the seed's transposed conversion."""

import torch

from fastweight import theory
from fastweight.mechanisms import get
from fastweight.mechanisms.rwkv7 import prepare
from fastweight.reference import dplr_recurrent
from fastweight.testing import generator, rel_err


def test_prepare_is_the_paper_weight_preparation():
    x = get("rwkv7").sample(1, 4, 2, 8, 4, dtype=torch.float64, device="cpu", generator=generator())
    kappa_hat, k_tilde = prepare(x)
    kappa = x["k"] * x["_xi"]
    assert rel_err(kappa_hat * kappa.norm(dim=-1, keepdim=True), kappa) <= 1e-5  # l2norm eps 1e-6
    assert torch.allclose(kappa_hat.norm(dim=-1), torch.ones(1, 4, 2, dtype=torch.float64), atol=1e-5)
    assert rel_err(k_tilde, x["k"] * torch.lerp(torch.ones_like(x["a"]), x["a"], x["_alpha"])) <= 1e-15


def test_paper_order_not_the_seed_transpose():
    """Learning rate on the write side: the transposed conversion gives other outputs when a varies."""
    m = get("rwkv7")
    x = m.sample(2, 40, 2, 8, 6, dtype=torch.float64, device="cpu", generator=generator())
    o, _ = m.recurrent(x)
    d = m.to_dplr(x)
    o_paper, _ = dplr_recurrent(**d)
    kappa_hat, _ = prepare(x)
    o_seed, _ = dplr_recurrent(**{**d, "a": -kappa_hat, "b": x["a"] * kappa_hat})
    assert rel_err(o_paper, o) <= 1e-12
    assert rel_err(o_seed, o) > 1e-3
    # Same eigenvalues either way (a matrix and its transpose).
    A = theory.transition_matrix(m, x, 3)
    e1 = torch.linalg.eigvals(A).real.sort(-1).values
    e2 = torch.linalg.eigvals(A.transpose(-1, -2)).real.sort(-1).values
    assert rel_err(e1, e2) <= 1e-12

"""Comba: a preconditioned step in general, a plain gradient step when p is a multiple of k."""

import torch

from fastweight import theory
from fastweight.mechanisms import get
from fastweight.mechanisms.base import regression, weight_decay
from fastweight.testing import generator


def test_p_multiple_of_k_is_a_plain_gradient_step():
    """p = d k: S_t = S - grad [weight decay + beta d/2 ||S^T k - v/d||^2] (a scalar objective)."""
    m = get("comba")
    x = m.sample(2, 10, 2, 8, 6, dtype=torch.float64, device="cpu", generator=generator())
    d = torch.rand(2, 10, 2, 1, dtype=torch.float64) * 0.5 + 0.5
    x["p"] = d * x["k"]
    S = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    for t in range(10):
        xt = {n: v[:, t] for n, v in x.items()}
        lr = (xt["beta"] * d[:, t, :, 0])[..., None, None]
        losses = [(None, weight_decay(xt["g"].exp())), (lr, regression(xt["k"], xt["v"] / d[:, t]))]
        assert (theory.explicit_step(S, losses) - m.step(S, xt)).norm() <= 1e-12 * S.norm()


def test_general_p_is_not_symmetric():
    """For p not parallel to k the update operator k p^T is not symmetric: no scalar objective."""
    m = get("comba")
    x = m.sample(1, 1, 1, 8, 6, dtype=torch.float64, device="cpu", generator=generator())
    x["beta"] = torch.ones_like(x["beta"])
    A = theory.transition_matrix(m, x, 0)[0, 0]
    assert (A - A.T).norm() > 0.1 * (x["k"].norm() * x["p"].norm())
    assert theory.check_gradient_step(m, x) <= 1e-12

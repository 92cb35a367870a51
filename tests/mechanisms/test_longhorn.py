"""Longhorn: the closed form is the proximal step; the write is eps k v^T, not beta k v^T."""

import torch

from fastweight import theory
from fastweight.mechanisms import get
from fastweight.mechanisms.base import kT_S, outer
from fastweight.mechanisms.longhorn import step_size
from fastweight.testing import generator


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

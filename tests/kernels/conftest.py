import pytest
import torch

from fastweight.testing import nan_like


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every floating buffer from ``torch.empty``/``torch.empty_like`` starts as NaN (the decay and DPLR
    kernels allocate that way), so an element a kernel fails to write fails the check."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return nan_like(x) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))

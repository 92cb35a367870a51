"""The shared chunk stages: the varlen/padded layout and the decayed intra-chunk scores."""

import pytest
import torch

from fastweight.chunk.common import chunk_layout, decayed_scores, from_chunks, local_cumsum, to_chunks
from fastweight.testing import generator, rel_err


@pytest.mark.parametrize("cu_seqlens", [None, [0, 37, 38, 100], [0, 0, 64, 100]])
@pytest.mark.parametrize("C", [16, 64])
def test_layout_round_trip(cu_seqlens, C):
    B = 2 if cu_seqlens is None else 1
    x = torch.randn(B, 100, 3, 5, generator=generator())
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    layout = chunk_layout(B, 100, C, cu, x.device)
    chunks = to_chunks(x, layout, torch.float64)
    assert chunks.shape == (layout.N, 3, layout.NT, C, 5) and chunks.dtype == torch.float64
    assert torch.equal(from_chunks(chunks, layout), x.double())
    # the padding is zero: every element of x appears once, the rest is 0
    assert chunks.ne(0).sum() == x.ne(0).sum()


def naive_scores(x, y, Gx, Gy, strict):
    """Sum over k of x_r y_i exp(Gx_r - Gy_i), masked, straight from the definition."""
    M = torch.einsum("...rk,...ik,...rik->...ri", x, y, (Gx[..., :, None, :] - Gy[..., None, :, :]).clamp(max=0).exp())
    return M.tril(-1 if strict else 0)


@pytest.mark.parametrize("K", [1, 8])
@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("exclusive", [False, True])
def test_decayed_scores(K, C, exclusive):
    g = generator()
    x, y = (torch.randn(2, 3, C, 8, dtype=torch.float64, generator=g) for _ in range(2))
    gates = -torch.rand(2, 3, C, K, dtype=torch.float64, generator=g)
    G = local_cumsum(gates)
    Gx = G - gates if exclusive else G
    got = decayed_scores(x, y, Gx, G, strict=exclusive)
    assert rel_err(got, naive_scores(x, y, Gx, G, exclusive)) <= 1e-13


def test_decayed_scores_strong_decays_stay_finite():
    """Per-step log decays in [-20, -15]: cumulative below -960 over a chunk; exp(-G) would overflow even fp64."""
    g = generator()
    x, y = (torch.randn(1, 64, 8, generator=g) for _ in range(2))
    gates = -15 - 5 * torch.rand(1, 64, 8, generator=g)
    G = local_cumsum(gates)
    assert not torch.isfinite((-G).exp()).all()
    got = decayed_scores(x, y, G, G)
    assert torch.isfinite(got).all()
    assert rel_err(got, naive_scores(x.double(), y.double(), G, G, False)) <= 1e-6

"""The DPLR definition against dense per-token matrix algebra."""

import torch

from fastweight.mechanisms import get
from fastweight.reference import dplr_recurrent
from fastweight.testing import generator, rel_err


def sample(B=1, T=5, H=1, K=4, V=3, seed=None):
    g = generator(seed)
    return get("dplr").sample(B, T, H, K, V, dtype=torch.float64, device="cpu", generator=g), g


def test_dense_transition():
    """S_t = (Diag(exp gk) + a b^T) S + k v^T with b^T S on the undecayed state; o_t = S_t^T (scale q)."""
    x, g = sample()
    h0 = torch.randn(1, 1, 4, 3, dtype=torch.float64, generator=g)
    o, S_final = dplr_recurrent(**x, initial_state=h0, output_final_state=True, scale=0.5)
    S = h0[0, 0]
    for t in range(5):
        A = torch.diag(x["gk"][0, t, 0].exp()) + torch.outer(x["a"][0, t, 0], x["b"][0, t, 0])
        S = A @ S + torch.outer(x["k"][0, t, 0], x["v"][0, t, 0])
        assert rel_err(o[0, t, 0], 0.5 * S.T @ x["q"][0, t, 0]) <= 1e-14
    assert rel_err(S_final[0, 0], S) <= 1e-14


def test_scalar_decay_and_bonus_readout():
    """gk [B, T, H] broadcasts over K; with u the readout is S_{t-1}^T q + (q . (u * k)) v."""
    x, g = sample()
    gs = -torch.rand(1, 5, 1, dtype=torch.float64, generator=g)
    u = torch.randn(1, 4, dtype=torch.float64, generator=g)
    o, _ = dplr_recurrent(x["q"], x["k"], x["v"], gk=gs, scale=1.0, u=u)
    S = torch.zeros(4, 3, dtype=torch.float64)
    for t in range(5):
        q, k, v = x["q"][0, t, 0], x["k"][0, t, 0], x["v"][0, t, 0]
        want = S.T @ q + (q * u[0] * k).sum() * v
        S = gs[0, t, 0].exp() * S + torch.outer(k, v)
        assert rel_err(o[0, t, 0], want) <= 1e-14


def test_defaults_and_dtypes():
    x, _ = sample(K=16)
    o, S = dplr_recurrent(**x)
    o1, _ = dplr_recurrent(**x, scale=16 ** -0.5)
    assert S is None and rel_err(o, o1) == 0.0
    low = {n: t.to(torch.float16) for n, t in x.items()}
    o16, S16 = dplr_recurrent(**low, output_final_state=True)
    assert o16.dtype == torch.float16 and S16.dtype == torch.float32


def test_varlen_with_an_empty_sequence():
    x, g = sample(T=9)
    cu = torch.tensor([0, 4, 4, 9])
    h0 = torch.randn(3, 1, 4, 3, dtype=torch.float64, generator=g)
    o, S = dplr_recurrent(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert rel_err(S[1], h0[1]) == 0.0
    o2, S2 = dplr_recurrent(**{n: t[:, 4:] for n, t in x.items()}, initial_state=h0[2:], output_final_state=True)
    assert rel_err(o[:, 4:], o2) <= 1e-15 and rel_err(S[2:], S2) <= 1e-15

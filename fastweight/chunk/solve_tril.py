"""The UT transform's triangular solve: X = (I + L)^{-1} for a strictly lower L.

Done as the kernels do it (fla's ``solve_tril``):

1. forward substitution on each 16x16 diagonal block, one row at a time:
   ``X_ii[r, :r] = -L_ii[r, :r] X_ii[:r, :r]``;
2. exact blockwise merge of neighbouring diagonal blocks, 16 -> 32 -> 64:

       [[A, 0], [L21, D]]^{-1} = [[A^{-1}, 0], [-D^{-1} L21 A^{-1}, D^{-1}]]

   (A, D are the unit-lower diagonal blocks, already inverted at the level below).

Backward: ``dX`` gives ``dL = -strictLower(X^T dX X^T)`` (the derivative of a matrix
inverse, restricted to the entries of L that are read).
"""

from __future__ import annotations

import torch

BLOCK = 16


def _forward_substitution(L: torch.Tensor) -> torch.Tensor:
    """Inverse of I + L for strictly lower L: [..., n, n] with n <= 16, row by row."""
    n = L.shape[-1]
    X = torch.eye(n, dtype=L.dtype, device=L.device).expand(L.shape).clone()
    for r in range(1, n):
        X[..., r, :r] = -(L[..., r:r + 1, :r] @ X[..., :r, :r]).squeeze(-2)
    return X


def _blocks(L: torch.Tensor, s: int) -> torch.Tensor:
    """[..., n*s, n*s] -> [..., n, n, s, s]: block (I, J) at [..., I, J, :, :]."""
    n = L.shape[-1] // s
    return L.reshape(*L.shape[:-2], n, s, n, s).transpose(-3, -2)


def _merge(L: torch.Tensor, X_diag: torch.Tensor) -> torch.Tensor:
    """One merge level: inverses of the s x s diagonal blocks ``X_diag`` [..., n, s, s] (n even)
    -> inverses of the 2s x 2s diagonal blocks [..., n/2, 2s, 2s]. ``L``: [..., n*s, n*s]."""
    n, s = X_diag.shape[-3], X_diag.shape[-1]
    i_even = torch.arange(0, n, 2, device=L.device)
    L21 = _blocks(L, s)[..., i_even + 1, i_even, :, :]  # [..., n/2, s, s]
    A, D = X_diag[..., 0::2, :, :], X_diag[..., 1::2, :, :]
    B = -(D @ L21 @ A)
    top = torch.cat([A, torch.zeros_like(A)], dim=-1)
    bottom = torch.cat([B, D], dim=-1)
    return torch.cat([top, bottom], dim=-2)


def _solve_unit_lower(L: torch.Tensor) -> torch.Tensor:
    C = L.shape[-1]
    if C <= BLOCK:
        return _forward_substitution(L)
    if C % BLOCK or (C // BLOCK) & (C // BLOCK - 1):
        raise ValueError(f"the chunk size must be 16 times a power of two, got {C}")
    n = C // BLOCK
    i_n = torch.arange(n, device=L.device)
    X = _forward_substitution(_blocks(L, BLOCK)[..., i_n, i_n, :, :])  # [..., n, 16, 16]
    while X.shape[-3] > 1:
        X = _merge(L, X)
    return X.squeeze(-3)


class _SolveUnitLower(torch.autograd.Function):
    @staticmethod
    def forward(ctx, L):
        X = _solve_unit_lower(L)
        ctx.save_for_backward(X)
        return X

    @staticmethod
    def backward(ctx, dX):
        (X,) = ctx.saved_tensors
        XT = X.transpose(-1, -2)
        return -(XT @ dX @ XT).tril(-1)


def solve_unit_lower(L: torch.Tensor) -> torch.Tensor:
    """(I + strictLower(L))^{-1} for ``L`` [..., C, C], C in {1..16, 32, 64, 128, ...}.

    Only the strictly lower part of ``L`` is read (the diagonal and above are ignored).
    Differentiable (the gradient is strictly lower triangular).
    """
    return _SolveUnitLower.apply(L.tril(-1))

"""The UT transform's triangular solve: X = (I + L)^{-1} for a strictly lower L.

Done as the kernels do it (fla's ``solve_tril``):

1. forward substitution on each 16x16 diagonal block, one row at a time:
   ``X_ii[r, :r] = -L_ii[r, :r] X_ii[:r, :r]``;
2. exact blockwise merge of neighbouring diagonal blocks, 16 -> 32 -> 64, in place:

       [[A, 0], [L21, D]]^{-1} = [[A^{-1}, 0], [-D^{-1} L21 A^{-1}, D^{-1}]]

   (A, D are the unit-lower diagonal blocks, already inverted at the level below).

Backward: ``dX`` gives ``dL = -strictLower(X^T dX X^T)`` (the derivative of a matrix
inverse, restricted to the entries of L that are read).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

BLOCK = 16


def _forward_substitution(L: torch.Tensor) -> torch.Tensor:
    """Inverse of I + L for strictly lower L: [..., n, n] with n <= 16, row by row."""
    n = L.shape[-1]
    X = torch.eye(n, dtype=L.dtype, device=L.device).expand(L.shape).clone()
    for r in range(1, n):
        X[..., r, :r] = -(L[..., r:r + 1, :r] @ X[..., :r, :r]).squeeze(-2)
    return X


def _diagonal_blocks(L: torch.Tensor, s: int, row: int = 0, col: int = 0) -> torch.Tensor:
    """View of the s x s blocks (2p + row, 2p + col) of [..., n*s, n*s] (or every (p, p) with
    row = col = None) as [..., blocks, s, s]: writing into it writes into L."""
    n = L.shape[-1] // s
    b_L = L.reshape(*L.shape[:-2], n, s, n, s).transpose(-3, -2)  # block (I, J) at [..., I, J, :, :]
    if row is not None:
        b_L = b_L[..., row::2, col::2, :, :]
    return b_L.diagonal(dim1=-4, dim2=-3).movedim(-1, -3)


def _solve_unit_lower(L: torch.Tensor) -> torch.Tensor:
    C = L.shape[-1]
    if C <= BLOCK:
        return _forward_substitution(L)
    if C % BLOCK or (C // BLOCK) & (C // BLOCK - 1):
        raise ValueError(f"the chunk size must be 16 times a power of two, got {C}")
    X = torch.zeros_like(L)
    _diagonal_blocks(X, BLOCK, None, None).copy_(_forward_substitution(_diagonal_blocks(L, BLOCK, None, None)))
    s = BLOCK
    while s < C:
        # merge neighbouring inverted diagonal blocks A, D into [[A, 0], [-D L21 A, D]]
        A, D = _diagonal_blocks(X, s, 0, 0), _diagonal_blocks(X, s, 1, 1)
        _diagonal_blocks(X, s, 1, 0).copy_(-(D @ _diagonal_blocks(L, s, 1, 0) @ A))
        s *= 2
    return X


class _SolveUnitLower(torch.autograd.Function):
    @staticmethod
    def forward(ctx, L):
        # forward substitution reads the strictly lower part of the diagonal blocks, the merge
        # only blocks below the diagonal: the diagonal and above are never read
        X = _solve_unit_lower(L)
        ctx.save_for_backward(X)
        return X

    @staticmethod
    @once_differentiable
    def backward(ctx, dX):
        (X,) = ctx.saved_tensors
        XT = X.transpose(-1, -2)
        return -(XT @ dX @ XT).tril(-1)


def solve_unit_lower(L: torch.Tensor) -> torch.Tensor:
    """(I + strictLower(L))^{-1} for ``L`` [..., C, C], C in {1..16, 32, 64, 128, ...}.

    Only the strictly lower part of ``L`` is read (the diagonal and above are ignored).
    Differentiable (the gradient is strictly lower triangular).
    """
    return _SolveUnitLower.apply(L)

"""The facts of the fast-weight view, as functions (DESIGN.md section 1; tests and ``fastweight verify``).

- :func:`delta_rule_forms`: the delta rule's erase-write form, its generalised Householder form
  ``(I - beta k k^T) S + beta k v^T`` and one SGD step on ``1/2 ||S^T k - v||^2`` (autograd)
  are one update.
- :func:`transition_matrix` / :func:`transition_eigenvalues`: the transition
  ``Diag(exp gk_t) + a_t b_t^T`` of any mechanism at step t, read off its DPLR map.
- :func:`householder_eigenvalues`: the closed-form spectrum of ``I - beta k^ k^^T`` (K-1 ones and
  ``1 - beta``: negative for beta > 1).
- RWKV-7: ``Diag(w) - (a * kappa^) kappa^^T`` is similar to the symmetric
  ``Diag(w) - u u^T`` with ``u = sqrt(a) * kappa^`` (conjugate by ``Diag(sqrt a)``), so its
  eigenvalues are real, at most ``max w < 1`` and at least ``min w - ||u||^2 >= -1`` for a in
  (0, 1] and a unit kappa^: every eigenvalue in [-1, 1], every subspace decays.
- :func:`check_dplr_map`: a mechanism's own recurrence against the DPLR recurrence.
- :func:`check_gradient_step`: a mechanism's step against one step of its objective
  (explicit: ``S_anchor - sum_j lr_j grad L_j``; implicit: the proximal problem solved by one
  exact Newton step, its linear system by conjugate gradients on autograd Hessian products).
"""

from __future__ import annotations

import torch

from fastweight.mechanisms.base import Mechanism, Preconditioner, kT_S, outer
from fastweight.reference.recurrence import dplr_recurrent
from fastweight.testing import rel_err


def delta_rule_forms(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor):
    """The delta rule's three forms: (erase-write, Householder, SGD step) ``[B, H, K, V]`` each.

    S: [B, H, K, V]; k: [B, H, K]; v: [B, H, V]; beta: [B, H].
    """
    b = beta[..., None]
    v_old = kT_S(k, S)
    erase_write = S - outer(k, b * v_old) + outer(k, b * v)
    K = k.shape[-1]
    householder = torch.eye(K, dtype=S.dtype, device=S.device) - b[..., None] * outer(k, k)
    householder_form = householder @ S + outer(b * k, v)
    X = S.detach().clone().requires_grad_(True)
    loss = 0.5 * ((kT_S(k, X) - v) ** 2).sum()
    (grad,) = torch.autograd.grad(loss, X)
    sgd = S - beta[..., None, None] * grad
    return erase_write, householder_form, sgd


def householder_eigenvalues(beta: torch.Tensor, K: int) -> torch.Tensor:
    """The spectrum of ``I - beta k^ k^^T`` (unit k^), sorted ascending: [..., K] (K-1 ones and 1 - beta)."""
    ones = torch.ones(*beta.shape, K - 1, dtype=beta.dtype, device=beta.device)
    return torch.cat([(1 - beta)[..., None], ones], dim=-1).sort(dim=-1).values


def _dplr_factor(d: dict, r: int) -> torch.Tensor:
    """``Diag(exp gk_r) + a_r b_r^T`` at row ``r`` of the DPLR arguments ``d``: [B, H, K, K]."""
    k = d["k"][:, r]
    B, H, K = k.shape
    gk = d.get("gk")
    if gk is None:
        w = torch.ones(B, H, K, dtype=k.dtype, device=k.device)
    else:
        w = gk[:, r].exp()
        w = w[..., None].expand(B, H, K) if w.dim() == 2 else w
    A = torch.diag_embed(w)
    if d.get("a") is not None and d.get("b") is not None:
        A = A + outer(d["a"][:, r], d["b"][:, r])
    return A


def transition_matrix(mechanism: Mechanism, inputs: dict, t: int) -> torch.Tensor:
    """The transition of ``mechanism`` at token ``t``: [B, H, K, K] (from its DPLR map).

    ``Diag(exp gk_t) + a_t b_t^T``; for a token of n DPLR steps (``Mechanism.dplr_steps``) the
    product of its n factors, the last on the left."""
    d, n = mechanism.to_dplr(inputs), mechanism.steps(inputs)
    A = _dplr_factor(d, t * n)
    for j in range(1, n):
        A = _dplr_factor(d, t * n + j) @ A
    return A


def transition_eigenvalues(mechanism: Mechanism, inputs: dict, t: int) -> torch.Tensor:
    """The eigenvalues of :func:`transition_matrix` (complex): [B, H, K]."""
    return torch.linalg.eigvals(transition_matrix(mechanism, inputs, t))


def check_dplr_map(mechanism: Mechanism, inputs: dict, *, scale: float | None = None, initial_state=None,
                   cu_seqlens=None) -> float:
    """max rel err of (o, final state) between the mechanism's own recurrence and the DPLR one.

    A token of n DPLR steps (``Mechanism.dplr_steps``) is n rows of the DPLR sequence
    (``cu_seqlens`` scaled by n), its output the last row's."""
    o, S = mechanism.recurrent(inputs, scale=scale, initial_state=initial_state, output_final_state=True,
                               cu_seqlens=cu_seqlens)
    n = mechanism.steps(inputs)
    o_d, S_d = dplr_recurrent(**mechanism.to_dplr(inputs), scale=scale, initial_state=initial_state,
                              output_final_state=True, cu_seqlens=None if cu_seqlens is None else cu_seqlens * n)
    return max(rel_err(o_d.unflatten(1, (-1, n))[:, :, -1], o), rel_err(S_d, S))


def _step_direction(lr, grad: torch.Tensor) -> torch.Tensor:
    if lr is None:
        return grad
    if isinstance(lr, Preconditioner):
        return lr.apply(grad)
    return lr * grad


def _gradient_field(losses, X: torch.Tensor, create_graph: bool) -> torch.Tensor:
    """sum_j lr_j grad L_j(X) (lr applied to the gradient)."""
    total = torch.zeros_like(X)
    for lr, loss in losses:
        (g,) = torch.autograd.grad(loss(X), X, create_graph=create_graph)
        total = total + _step_direction(lr, g)
    return total


def explicit_step(anchor: torch.Tensor, losses) -> torch.Tensor:
    """``anchor - sum_j lr_j grad L_j(anchor)``."""
    X = anchor.detach().clone().requires_grad_(True)
    return anchor.detach() - _gradient_field(losses, X, create_graph=False)


def proximal_step(anchor: torch.Tensor, losses, *, max_iter: int | None = None):
    """``argmin_X 1/2 ||X - anchor||^2 + sum_j lr_j L_j(X)`` for quadratic L_j: one exact Newton step.

    The optimality condition ``F(X) = X - anchor + sum_j lr_j grad L_j(X) = 0`` is affine in X;
    Newton from the anchor solves ``J d = -F(anchor)`` with ``J = I + sum_j lr_j Hess L_j``
    (symmetric positive definite for nonnegative per-head lr), here by conjugate gradients per
    (batch, head) with Hessian-vector products from autograd. Returns (X, ||F(X)|| / ||anchor||).
    """
    A = anchor.detach()
    X = A.clone().requires_grad_(True)
    F = X - A + _gradient_field(losses, X, create_graph=True)

    def J(p):
        return torch.autograd.grad(F, X, p, retain_graph=True)[0]

    def dot(x, y):
        return (x * y).sum((-2, -1), keepdim=True)

    d = torch.zeros_like(A)
    r = -F.detach()
    p = r.clone()
    rr = dot(r, r)
    floor = (torch.finfo(A.dtype).eps * (A.norm() + r.norm())) ** 2
    for _ in range(max_iter or A.shape[-1] * A.shape[-2]):
        if bool((rr <= floor).all()):
            break
        Jp = J(p)
        pJp = dot(p, Jp)
        alpha = torch.where(rr > floor, rr / pJp.where(pJp != 0, torch.ones_like(pJp)), torch.zeros_like(rr))
        d = d + alpha * p
        r = r - alpha * Jp
        rr_new = dot(r, r)
        p = r + (rr_new / rr.where(rr != 0, torch.ones_like(rr))) * p
        rr = rr_new
    X_new = A + d
    Y = X_new.clone().requires_grad_(True)
    residual = (Y - A + _gradient_field(losses, Y, create_graph=False)).detach().norm() / A.norm().clamp_min(1e-300)
    return X_new, float(residual)


def check_gradient_step(mechanism: Mechanism, inputs: dict, *, initial_state=None, generator=None,
                        step=None) -> float:
    """rel err between the mechanism's step and one step of its objective, over every t.

    Starts from ``initial_state`` ([B, H, K, V]; default a random state), follows the
    mechanism's own recurrence and at each t compares ``step(S, x_t)`` with the explicit or
    proximal step of ``objective(S, x_t)``. ``step`` overrides the mechanism's (to test a variant).
    For implicit objectives the Newton residual is added to the error. A token of n > 1 DPLR steps
    (``Mechanism.dplr_steps``) is compared with the composition of its substeps' objective steps.
    """
    if mechanism.objective is None:
        raise ValueError(f"mechanism {mechanism.name!r} has no objective")
    step = step or mechanism.step
    timed = {n: t for n, t in inputs.items() if not n.startswith("_") and t is not None}
    static = {n: t for n, t in inputs.items() if n.startswith("_")}
    ref = inputs["v"]
    B, T, H, V = *ref.shape[:3], ref.shape[-1]
    K = inputs["q"].shape[-1]
    S = initial_state
    if S is None:
        S = torch.randn(B, H, K, V, dtype=ref.dtype, device=ref.device, generator=generator)
    num, den, extra = 0.0, 0.0, 0.0
    for t in range(T):
        x = {n: v[:, t] for n, v in timed.items()}
        x.update(static)
        S_next = step(S, x)
        n, S_obj = mechanism.steps(x), S
        for j in range(n):
            anchor, losses, implicit = mechanism.objective(S_obj, x, j) if n > 1 else mechanism.objective(S_obj, x)
            if implicit:
                S_obj, residual = proximal_step(anchor, losses)
                extra = max(extra, residual)
            else:
                S_obj = explicit_step(anchor, losses)
        num += float((S_obj - S_next).double().norm() ** 2)
        den += float(S_next.double().norm() ** 2)
        S = S_next.detach()
    return (num ** 0.5) / max(den ** 0.5, 1e-300) + extra

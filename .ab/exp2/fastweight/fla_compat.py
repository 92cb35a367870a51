"""fla 0.6.0's extra op arguments, handled in one place for ``fastweight.ops``.

The public ops take fla's parameters in fla's order with fla's defaults (checked against
``tests/data/fla_0.6.0_ops.json``). Besides the recurrence's own inputs fla has options of
three kinds, and each is handled here the same way for every op:

- implemented: ``reverse`` on the fused recurrent decay and DPLR ops (the recurrence runs from
  each sequence's last token to its first: the per-token inputs are reversed in time, run, and
  the output reversed back), ``state_v_first`` (states as ``[N, H, V, K]``, fla's and vLLM's layout: the
  initial state is read transposed and the final state returned transposed),
  ``use_beta_sigmoid_in_kernel`` (beta is the pre-activation: ``beta = sigmoid(beta)``, times 2
  with ``allow_neg_eigval``, as fla), ``cu_seqlens_cpu`` (the host copy of ``cu_seqlens``: the
  call then reads nothing from the device);
- accepted without effect on the result: ``chunk_indices`` (fla's precomputed chunk
  bookkeeping; ours is built from the host copy of ``cu_seqlens``), ``disable_recompute`` (a
  memory/speed trade-off in fla's kernels), ``chunk_size`` of 16, 32 or 64 (fla's choices: the tokens
  its kernels take a chunk, which changes rounding, not the recurrence; ours take 64), ``safe_gate`` and
  ``lower_bound`` on the DPLR / RWKV-7 chunk ops (:func:`gate_bound`) and on KDA without the
  in-kernel gate (:func:`kda_gate`), the deprecated
  ``transpose_state_layout`` (``state_v_first``, with fla's DeprecationWarning);
- KDA's ``lower_bound`` with ``use_gate_in_kernel``: fla's bounded gate, formed by the op
  (:func:`kda_gate`);
- refused with a ValueError naming the option unless left at its default: ``cp_context``
  (context parallelism), ``gv``, a ``chunk_size`` fla does not take either (not 16, 32 or 64),
  ``return_intermediate_states``, ``use_graph``, ``max_num_seqs``; ``head_first``
  raises fla's own DeprecationWarning error. Any other keyword is a TypeError (fla ignores
  unknown keywords silently; a typo here must not be).
"""

from __future__ import annotations

import warnings

import torch

from fastweight import checks


def refuse(op: str, **options):
    """Raise for the first option passed with a value other than its default: ``name=(value, default)``."""
    for name, (value, default) in options.items():
        if value is not default and value != default:
            raise ValueError(f"`{name}={value!r}` is not supported by fastweight's {op} (fla 0.6.0 option); "
                             f"leave it at {default!r}")


def gate_bound(op: str, safe_gate, lower_bound) -> None:
    """fla's ``safe_gate`` / ``lower_bound`` on the DPLR and RWKV-7 chunk ops: accepted, no effect.

    In fla 0.6.0 (``fla/ops/generalized_delta_rule/dplr/chunk.py``) both only pick kernel numerics:
    ``safe_gate=True``, or a ``lower_bound`` with ``gate_bound_is_safe``, selects the tensor-core
    A-stage that factors ``exp(G_i - G_j)`` around the chunk's midpoint (the caller promises
    ``lower_bound <= gk < 0``; nothing is clamped, and ``lower_bound`` chooses chunk size 64). The
    recurrence computed is the same. fastweight's DPLR kernels factor a chunk only when its own
    gates span less than ``SAFE_SPAN`` and otherwise take a path whose exponents are all <= 0
    (``fastweight.kernels.dplr``), so no promise is needed and the result equals the call without
    these options. As fla, a ``lower_bound`` that is not negative is a ValueError."""
    if not isinstance(safe_gate, bool):
        raise ValueError(f"`safe_gate={safe_gate!r}` for fastweight's {op}: it must be a bool")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"`lower_bound={lower_bound!r}` for fastweight's {op}: it must be negative "
                         f"(gk is a log-decay < 0)")


def kda_gate(op: str, g, use_gate_in_kernel: bool, safe_gate, lower_bound, A_log, dt_bias):
    """fla 0.6.0's KDA ``safe_gate`` / ``lower_bound`` -> ``(g, use_gate_in_kernel, A_log, dt_bias)`` for our op.

    With ``use_gate_in_kernel`` and a ``lower_bound`` fla's gate is bounded, ``lower_bound *
    sigmoid(exp(A_log) (g + dt_bias))`` (``A_log`` may then be None: ``lower_bound * sigmoid(g +
    dt_bias)``), in [lower_bound, 0): formed here in fp32 (float64 for float64 g; differentiable in g, A_log, dt_bias) and
    handed to the op as the log decay. ``safe_gate`` only selects fla's tensor-core intra kernel (with
    the in-kernel gate it needs ``lower_bound`` in [-5, 0), checked as fla does); without the in-kernel
    gate both are the caller's promise about g and change nothing (our intra kernel needs none).
    """
    if not isinstance(safe_gate, bool):
        raise ValueError(f"`safe_gate={safe_gate!r}` for fastweight's {op}: it must be a bool")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"`lower_bound={lower_bound!r}` for fastweight's {op}: it must be negative (a log decay)")
    if not use_gate_in_kernel:
        return g, False, A_log, dt_bias
    if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"`safe_gate=True` with `use_gate_in_kernel=True` needs `lower_bound` in [-5, 0) for "
                         f"fastweight's {op} (as fla), got lower_bound={lower_bound!r}")
    if lower_bound is None:
        if A_log is None:
            raise ValueError(f"`use_gate_in_kernel=True` needs `A_log` for fastweight's {op} when `lower_bound` "
                             f"is not set")
        return g, True, A_log, dt_bias
    HV, K = g.shape[2], g.shape[3]
    dt = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = g.to(dt)
    if dt_bias is not None:
        x = x + dt_bias.to(dt).view(HV, K)
    if A_log is not None:
        x = A_log.to(dt).exp().view(HV, 1) * x
    return lower_bound * torch.sigmoid(x), False, None, None


def extra_kwargs(op: str, kwargs: dict, state_v_first: bool = False, allowed=()) -> tuple[dict, bool]:
    """fla's keyword-only leftovers: returns (the ``allowed`` ones, state_v_first)."""
    kwargs = dict(kwargs)
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass `state_v_first` or the deprecated `transpose_state_layout`, not both")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    chunk_size = kwargs.pop("chunk_size", None)
    kwargs.pop("disable_recompute", None)
    if chunk_size is not None and chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size={chunk_size!r}` is not supported by fastweight's {op}: fla's chunk sizes are "
                         f"16, 32 and 64 (ours is 64; the result is the same recurrence)")
    out = {n: kwargs.pop(n) for n in allowed if n in kwargs}
    if kwargs:
        raise TypeError(f"{op}() got an unexpected keyword argument '{next(iter(kwargs))}'")
    return out, state_v_first


def host_seqlens(cu_seqlens, cu_seqlens_cpu):
    """Hand ``cu_seqlens_cpu`` (fla's host copy) to the checks, so the call makes no device read."""
    if cu_seqlens_cpu is None:
        return
    if cu_seqlens is None:
        raise ValueError("`cu_seqlens_cpu` is the host copy of `cu_seqlens`: pass `cu_seqlens` too")
    if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu":
        raise ValueError("`cu_seqlens_cpu` must be a CPU tensor (the host copy of `cu_seqlens`)")
    if cu_seqlens_cpu.shape != getattr(cu_seqlens, "shape", None):
        raise ValueError(f"`cu_seqlens_cpu` must have the shape of `cu_seqlens`, got "
                         f"{tuple(cu_seqlens_cpu.shape)} and {tuple(getattr(cu_seqlens, 'shape', ()))}")
    checks.provide_host_bounds(cu_seqlens, cu_seqlens_cpu.tolist())


def state_in(initial_state, state_v_first: bool):
    """``[N, H, V, K]`` -> ``[N, H, K, V]`` (a view) when ``state_v_first``."""
    if state_v_first and isinstance(initial_state, torch.Tensor):
        if initial_state.dim() != 4:
            raise ValueError(f"`initial_state` must be [N, HV, V, K] with state_v_first=True, got shape "
                             f"{tuple(initial_state.shape)}")
        return initial_state.transpose(-1, -2)
    return initial_state


def state_out(result, state_v_first: bool):
    o, final_state = result
    if state_v_first and final_state is not None:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state


def beta_sigmoid(beta, on: bool, allow_neg_eigval: bool):
    """fla's ``use_beta_sigmoid_in_kernel``: beta = sigmoid(beta) (2 sigmoid(beta) with allow_neg_eigval), in fp32."""
    if not on:
        return beta
    if not isinstance(beta, torch.Tensor):
        raise ValueError("`use_beta_sigmoid_in_kernel=True` needs `beta` (its pre-activation)")
    up = torch.float64 if beta.dtype == torch.float64 else torch.float32
    return torch.sigmoid(beta.to(up)) * (2.0 if allow_neg_eigval else 1.0)


def time_reversed(reverse: bool, cu_seqlens, per_token: dict):
    """fla's ``reverse=True``: (``per_token`` reversed in time within each sequence, the function that
    reverses an output back). ``per_token``: name -> [B, T, ...] tensor or None."""
    if not reverse:
        return per_token, lambda o: o
    v = per_token["v"]
    if not isinstance(v, torch.Tensor) or v.dim() < 3:
        return per_token, lambda o: o          # the op's own checks name the bad argument
    if cu_seqlens is None:
        flip = lambda x: x.flip(1)  # noqa: E731
    else:
        checks.check_cu_seqlens(cu_seqlens, v.shape[0], v.shape[1])
        bounds = checks.host_bounds(cu_seqlens)
        checks.provide_host_bounds(cu_seqlens, bounds)   # the op's own check reads no second copy
        idx = torch.cat([torch.arange(e - 1, b - 1, -1) for b, e in zip(bounds[:-1], bounds[1:])]).to(v.device)
        flip = lambda x: x.index_select(1, idx)  # noqa: E731
    out = {n: flip(x) if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[1] == v.shape[1] else x
           for n, x in per_token.items()}
    return out, flip

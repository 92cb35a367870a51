"""Backend choice for the public ops.

Three implementations of each op share one signature (after validation):

    impl(<tensors by name>, *, scale: float, initial_state, output_final_state: bool,
         cu_seqlens, **options) -> (o, final_state_or_None)

and each op's mechanism file declares them (``fastweight.mechanisms.Op``), by direct reference:

- ``"triton"``:    ``Op.triton_chunk`` / ``Op.triton_fused_recurrent``  (CUDA tensors, or TRITON_INTERPRET=1)
- ``"torch"``:     ``Op.torch``      (PyTorch chunkwise; any device; serves both modes)
- ``"reference"``: ``Op.reference``  (the per-token definition)

``mode`` is ``chunk`` or ``fused_recurrent``. With ``backend=None`` the first that exists
wins: triton on CUDA, then torch, then reference. float64 inputs never go to triton (the
kernels compute in fp32 and have no float64 path): ``backend=None`` serves them with the
PyTorch chunk path on every device, ``backend="triton"`` refuses them. An implementation that
handles grouped value heads (HV > H) itself says so (``Impl.grouped_heads``), as does one that
fuses the q/k L2 norm (``Impl.fused_l2norm``) or Mamba-2's gate (``Impl.fused_gate``);
otherwise the dispatcher does these in PyTorch first.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from fastweight.mechanisms import Impl, get_op

BACKENDS = ("triton", "torch", "reference")
_WARNED: set = set()


def _lookup(backend: str, mode: str, op: str) -> Impl | None:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        return None
    return get_op(op).impl(backend, mode)


def triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu"


def resolve(op: str, mode: str, backend: str | None, device: torch.device,
            dtype: torch.dtype = torch.float32) -> Impl:
    """The implementation of ``op`` in ``mode`` for ``backend`` (None = best available) and
    inputs of ``dtype`` on ``device``."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS} or None, got {backend!r}")
    order = [backend] if backend is not None else list(BACKENDS)
    if backend is None and (device.type != "cuda" or dtype == torch.float64):
        order.remove("triton")
    for b in order:
        if b == "triton" and not triton_usable(device):
            raise ValueError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {device}")
        if b == "triton" and dtype == torch.float64:
            raise ValueError(f"backend='triton' has no float64 path for {mode}_{op} (the kernels compute in "
                             "float32), got torch.float64 inputs: use backend='torch' (exact in float64) or "
                             "backend=None")
        impl = _lookup(b, mode, op)
        if impl is not None:
            return impl
    raise NotImplementedError(f"no {backend or 'available'} implementation of {mode}_{op}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x||_2 over the last dim (fla's l2norm: rsqrt(sum x^2 + eps)); the norm in float32
    (float64 for float64 x), the result in x's dtype."""
    x_c = x.to(_compute_dtype(x))
    return x * torch.rsqrt((x_c * x_c).sum(-1, keepdim=True) + eps).to(x.dtype)


def mamba_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log) softplus(x + dt_bias): x [B, T, H] (A_log, dt_bias [H]) or [B, T, H, K]
    (A_log [H], dt_bias [H * K]); in float32 (float64 for float64 x), as the kernels form it:
    a log decay rounded to 16 bits would carry its rounding into every decay product."""
    H, dt = A_log.shape[0], _compute_dtype(x)
    bias, a = dt_bias.to(dt), A_log.to(dt).exp()
    if x.dim() == 4:
        bias, a = bias.view(H, -1), a.view(H, 1)
    return -a * torch.nn.functional.softplus(x.to(dt) + bias)


def call(op: str, mode: str, backend: str | None, tensors: dict, *, key_tensors=("q", "k"),
         use_qk_l2norm: bool = False, l2norm_tensors=("q", "k"), **kwargs):
    """Resolve and call, expanding grouped heads and applying the q/k L2 norm where the impl does not.

    ``l2norm_tensors``: what ``use_qk_l2norm`` normalises (Comba adds its read key ``p``).
    """
    device = next(t.device for t in tensors.values() if isinstance(t, torch.Tensor))
    dtype = tensors[key_tensors[0]].dtype
    impl = resolve(op, mode, backend, device, dtype)
    why = impl.unverified(device, tensors["k"].shape[-1], tensors["v"].shape[-1]) if impl.unverified else None
    if why:
        if backend == "triton":
            raise ValueError(f"backend='triton' cannot run {mode}_{op} at {why}; use backend='torch'")
        if (op, why) not in _WARNED:
            _WARNED.add((op, why))
            warnings.warn(f"{mode}_{op}: {why}: running the PyTorch chunk path instead of the Triton kernels",
                          stacklevel=3)
        impl = resolve(op, mode, "torch", device, dtype)
    tensors = dict(tensors)
    if tensors.get("A_log") is not None:
        # Mamba-2's gate, requested to be formed by the op: in the kernel, or here for the others
        A_log, dt_bias = tensors.pop("A_log"), tensors.pop("dt_bias")
        if impl.fused_gate:
            kwargs.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        else:
            tensors["g"] = mamba_gate(tensors["g"], A_log, dt_bias)
    if use_qk_l2norm:
        if impl.fused_l2norm:
            kwargs["use_qk_l2norm_in_kernel"] = True
        else:
            for n in l2norm_tensors:
                tensors[n] = l2norm(tensors[n])
    v = tensors["v"]
    H = tensors[key_tensors[0]].shape[2]
    if v.shape[2] != H and not impl.grouped_heads:
        group = v.shape[2] // H
        for n in key_tensors:
            if tensors.get(n) is not None:
                tensors[n] = tensors[n].repeat_interleave(group, dim=2)
    # ops compute in the dtype of their inputs: autocast would recast the chunk path's inner
    # products one by one and mix dtypes inside it (the kernels ignore it anyway)
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        with torch.autocast(device_type=device.type, enabled=False):
            return impl.fn(**tensors, **kwargs)
    return impl.fn(**tensors, **kwargs)

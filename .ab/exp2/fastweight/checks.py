"""Input validation shared by every public op.

Every op checks its arguments here, before any kernel runs, and raises a
``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, device,
value) that names the argument and says what was expected.

Shape, dtype and device checks always run: they read metadata only. The value checks
(NaN/Inf anywhere, log gates <= 0, beta's range, token ids) read tensor contents, which
for a GPU tensor is a device-to-host sync that stalls the launch queue. They have three
modes, set by ``FASTWEIGHT_VALUE_CHECKS`` or :func:`set_value_checks`:

- ``auto`` (the default): on for CPU tensors, off for CUDA (and every other device), so
  the default call never syncs the GPU;
- ``1`` / ``True``: on for every device (debugging: a sync per check and call);
- ``0`` / ``False``: off everywhere.

``cu_seqlens`` contents are checked in every mode (bad offsets would make the kernels read
out of bounds), from one host copy, as fla reads them: a varlen call syncs once for it (the
kernels' chunk bookkeeping reuses that copy, :func:`host_bounds`), and not again while the same
CUDA tensor comes back unchanged (a model's layers); a call without ``cu_seqlens`` reads no
tensor value at all.
Value checks and the ``cu_seqlens`` contents are skipped inside ``torch.compile`` graphs.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import weakref
from contextlib import contextmanager

import torch

_MODES = {"auto": None, "": None, "1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


def _mode(value, source: str):
    """True (on everywhere), False (off) or None (auto) from a flag or the environment variable."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _MODES:
        return _MODES[value.strip().lower()]
    raise ValueError(f"{source} must be 1/true/on, 0/false/off or auto, got {value!r}")


_VALUE_CHECKS = _mode(os.environ.get("FASTWEIGHT_VALUE_CHECKS", "auto"), "`FASTWEIGHT_VALUE_CHECKS`")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def set_value_checks(enabled) -> None:
    """Value checks (module docstring): True on for every device, False off, None or "auto" the default."""
    global _VALUE_CHECKS
    _VALUE_CHECKS = _mode(enabled, "`enabled`")


@contextmanager
def value_checks(enabled):
    """Context manager form of :func:`set_value_checks`."""
    global _VALUE_CHECKS
    old, _VALUE_CHECKS = _VALUE_CHECKS, _mode(enabled, "`enabled`")
    try:
        yield
    finally:
        _VALUE_CHECKS = old


def reads_values_for_free(device: torch.device) -> bool:
    """Whether reading a tensor's values on ``device`` costs no device sync (auto mode's rule)."""
    return device.type == "cpu"


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()


def checking_values(device: torch.device) -> bool:
    """Whether the value checks run for tensors on ``device`` in the current mode."""
    if device.type == "meta" or _compiling():
        return False
    if _VALUE_CHECKS is None:
        return reads_values_for_free(device)
    return _VALUE_CHECKS


def check_tensor(name: str, x, ndim: int | None = None, shape: tuple | None = None,
                 allow_none: bool = False, hint: str = "") -> None:
    """``x`` is a floating tensor with ``ndim`` dims and, where given, ``shape`` (None = any).

    ``hint`` is appended to a shape error (where the expected shape comes from).
    """
    if x is None:
        if allow_none:
            return
        raise TypeError(f"`{name}` is required, got None")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"`{name}` must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        want = f"shape {_fmt(shape)}" if shape is not None else f"{ndim} dims"
        raise ValueError(f"`{name}` must have {want}, got shape {tuple(x.shape)}{hint}")
    if shape is not None:
        for want, got in zip(shape, x.shape):
            if want is not None and want != got:
                raise ValueError(f"`{name}` must have shape {_fmt(shape)}, got {tuple(x.shape)}{hint}")


def _fmt(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_same_device(**tensors) -> None:
    """All given tensors (None skipped) live on one device."""
    devices = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"`{n}` on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {desc}")


def check_finite(**tensors) -> None:
    """No NaN or Inf in any given tensor (value check)."""
    for n, t in tensors.items():
        if t is not None and checking_values(t.device) and not bool(torch.isfinite(t).all()):
            raise ValueError(f"`{n}` contains NaN or Inf")


def check_log_gate(name: str, g) -> None:
    """A gate in log space: finite and <= 0 (a decay factor exp(g) in (0, 1]) (value check)."""
    if g is None or not checking_values(g.device):
        return
    if not bool(torch.isfinite(g).all()):
        raise ValueError(f"`{name}` (a log-space gate) contains NaN or Inf")
    if bool((g > 0).any()):
        raise ValueError(f"`{name}` is a log-space decay and must be <= 0 everywhere; max is {g.max().item():.4g}")


_LAST_READ: tuple = (None, -1, None, False)   # (weakref to a cu_seqlens, its _version, its values, provided)


def _read(t: torch.Tensor) -> list:
    return t.tolist()


def _version(t: torch.Tensor):
    """``t._version``; None for an inference tensor, which keeps no version counter."""
    return None if t.is_inference() else t._version


def provide_host_bounds(cu_seqlens: torch.Tensor, values: list):
    """The caller's host copy of ``cu_seqlens`` (fla's ``cu_seqlens_cpu``), used by the next
    :func:`host_bounds` reads of the same call instead of a device read."""
    global _LAST_READ
    _LAST_READ = (weakref.ref(cu_seqlens), _version(cu_seqlens), list(values), True)


def _cacheable(t: torch.Tensor) -> bool:
    """Host copies of a device tensor are kept across calls (:func:`host_bounds`); a CPU tensor is
    read every time (no sync, and NumPy can write it behind ``_version``'s back), and so is an
    inference tensor (no version counter)."""
    return t.device.type != "cpu" and not t.is_inference()


_HOST_CACHE: dict = {}   # id -> (weakref, _version, values): device cu_seqlens read by earlier calls
_CACHE_SIZE = 16
_CACHE_LOCK = threading.Lock()   # autograd's device threads and multi-threaded callers share the caches


def cached_for(t: torch.Tensor, cache: dict):
    """The entry ``cache`` holds for ``t`` (same object, same ``_version``), else None; a hit moves
    to the back (the least recently used entry goes first)."""
    with _CACHE_LOCK:
        hit = cache.pop(id(t), None)
        if hit is None or hit[0]() is not t or hit[1] != t._version:
            return None
        cache[id(t)] = hit
        return hit[2]


def cache_for(t: torch.Tensor, cache: dict, value, size: int = _CACHE_SIZE):
    """Keep ``value`` for ``t`` (by identity and ``_version``); dead or least recently used entries
    go first."""
    with _CACHE_LOCK:
        for key in [key for key, (ref, _, _) in cache.items() if ref() is None]:
            cache.pop(key, None)
        cache.pop(id(t), None)
        while len(cache) >= size:
            cache.pop(next(iter(cache)))
        cache[id(t)] = (weakref.ref(t), t._version, value)
    return value


def host_bounds(cu_seqlens: torch.Tensor, fresh: bool = False) -> list:
    """``cu_seqlens.tolist()``, shared by the input check and the kernels' chunk bookkeeping of one
    call, so that a varlen call makes at most one device-to-host copy (a sync for a CUDA tensor).

    The check reads ``fresh`` and leaves the values in a one-slot cache; the next reader of the
    same tensor (identity and ``_version``: an in-place write bumps it) takes them and empties the
    slot, so a CPU tensor's values never outlive the call that read them (a write through a NumPy
    view, which ``_version`` does not see, cannot leave them stale). Values the caller provided
    (:func:`provide_host_bounds`) count as fresh. A device tensor's values are also kept across
    calls while it lives unchanged (identity and ``_version``, as fla's cache of its chunk
    indices): the layers of a model, which share one ``cu_seqlens``, sync once per step, not once
    a layer. A write torch's version counter does not see (through ``.data``, DLPack, another
    process) is not seen here either: pass a new tensor then. The kernels never read the caller's
    tensor itself (``kernels.common.prepare_chunks`` copies the checked values to the device), so
    such a write leaves a result computed on the earlier bounds, never a read out of bounds. Values
    a caller provides for a device tensor are kept the same way (they were checked)."""
    global _LAST_READ
    if _compiling():
        return _read(cu_seqlens)
    ref, version, values, provided = _LAST_READ
    _LAST_READ = (None, -1, None, False)
    same = ref is not None and ref() is cu_seqlens and version == _version(cu_seqlens)
    kept = None
    if not same or (fresh and not provided):
        kept = values = cached_for(cu_seqlens, _HOST_CACHE) if _cacheable(cu_seqlens) else None
        if values is None:
            values = _read(cu_seqlens)
    values = tuple(values)
    if kept is None and _cacheable(cu_seqlens):   # a hit is already in the cache, at its back
        cache_for(cu_seqlens, _HOST_CACHE, values)
    if fresh:
        _LAST_READ = (weakref.ref(cu_seqlens), _version(cu_seqlens), values, False)
    return list(values)


def check_cu_seqlens(cu_seqlens, batch: int, T: int):
    """``cu_seqlens``: int32/int64 1-D, starts at 0, non-decreasing, ends at T; needs batch == 1.

    The contents are checked in every value-check mode, from one host copy (one sync for a
    CUDA tensor; the kernels read the boundaries on the host anyway). Returns the number of
    sequences N.
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"`cu_seqlens` must be a torch.Tensor of int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"`cu_seqlens` must be an integer tensor (int64 or int32), got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"`cu_seqlens` must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (sequences packed along T), got B={batch}")
    if cu_seqlens.device.type == "meta":
        raise ValueError("`cu_seqlens` is on the meta device, which holds no values: the sequence boundaries "
                         "must be readable (pass it on the device of the inputs, or on the CPU with CPU inputs)")
    if not _compiling():
        bounds = host_bounds(cu_seqlens, fresh=True)
        if bounds[0] != 0:
            raise ValueError(f"`cu_seqlens` must start at 0, got {bounds[0]}")
        if bounds[-1] != T:
            raise ValueError(f"`cu_seqlens` must end at T={T}, got {bounds[-1]}")
        if any(e < s for s, e in zip(bounds[:-1], bounds[1:])):
            raise ValueError("`cu_seqlens` must be non-decreasing")
    return cu_seqlens.numel() - 1


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    """Every token id lies in [0, vocab_size) (value check)."""
    if not checking_values(ids.device) or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"`{name}` must lie in [0, {vocab_size}) (the vocabulary), got ids in [{lo}, {hi}]")


def check_initial_state(initial_state, n: int, h: int, k: int, v: int) -> None:
    """``initial_state`` is None or a floating tensor [N, H, K, V]."""
    if initial_state is None:
        return
    check_tensor("initial_state", initial_state, ndim=4, shape=(n, h, k, v))


def check_scale(scale, k: int) -> float:
    """Resolve ``scale`` (None -> K ** -0.5): a real number > 0, finite.

    Python and numpy numbers are accepted, and 0-d tensors as torch's own number arguments
    accept them (read on the host: a CUDA tensor costs a sync; a gradient would not reach it).
    """
    if scale is None:
        return k ** -0.5
    if isinstance(scale, torch.Tensor):
        if scale.ndim != 0:
            raise ValueError(f"`scale` must be a number (or a 0-d tensor), got a tensor of shape {tuple(scale.shape)}")
        if scale.dtype == torch.bool or scale.is_complex():
            raise TypeError(f"`scale` must be a real number, got a {scale.dtype} tensor")
        if scale.requires_grad:
            raise ValueError("`scale` is a constant of the op and gets no gradient: pass it detached "
                             "(or fold a learned scale into q)")
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"`scale` must be a real number, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"`scale` must be a finite number > 0, got {scale}")
    return scale


def check_chunk_size(chunk_size: int) -> int:
    """``chunk_size`` is the int 16, 32 or 64."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32 or 64, got {chunk_size}")
    return chunk_size


def check_qkv(q, k, v, *, head_first_hint: bool = True, names: tuple = ("q", "k", "v")):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H. Returns (B, T, H, K, HV, V).

    ``names``: what the op calls the three (RWKV's ``r`` for q; HGRN2 checks its gate as k).
    """
    qn, kn, vn = names
    check_tensor(qn, q, ndim=4, shape=(None, None, None, None))
    B, T, H, K = q.shape
    check_tensor(kn, k, ndim=4, shape=(B, T, H, K), hint=f" (the shape of `{qn}`, [B, T, H, K])")
    check_tensor(vn, v, ndim=4, shape=(B, T, None, None), hint=f" ([B, T, HV, V] with B, T of `{qn}`)")
    HV, V = v.shape[2], v.shape[3]
    if 0 in (B, T, H, K, HV, V):
        raise ValueError(f"`{qn}`, `{kn}`, `{vn}` must have no empty dimension, got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} ([B, T, H, K], [B, T, HV, V])")
    if HV % H != 0:
        raise ValueError(f"`{vn}` has {HV} heads, which must be a multiple of the {H} heads of `{qn}`/`{kn}` "
                         "(shape [B, T, HV, V])")
    check_same_device(**{qn: q, kn: k, vn: v})
    return B, T, H, K, HV, V


def check_same_dtype(**tensors) -> None:
    """All given tensors (None skipped) share one dtype (q, k, v and the key-side vectors; gates may differ)."""
    dtypes = {n: t.dtype for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(dtypes.values())) > 1:
        first = next(iter(dtypes))
        odd = [n for n, d in dtypes.items() if d != dtypes[first]]
        desc = ", ".join(f"`{n}` is {d}" for n, d in dtypes.items())
        raise TypeError(f"`{odd[0]}` must have the dtype of `{first}` ({dtypes[first]}); got {desc}")


def check_float64_only_with_float64(dtype, **tensors) -> None:
    """float64 anywhere only when the inputs (q, k, v) are float64 too: the low-precision
    paths (the kernels) run gates and states in float32 and have no float64 mix."""
    if dtype == torch.float64:
        return
    for n, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            raise TypeError(f"`{n}` is float64 while the inputs are {dtype}: pass it in float32 "
                            f"(or all inputs in float64)")


def check_range(name: str, x, low: float, high: float, hint: str = "") -> None:
    """Every value of ``x`` lies in [low, high] (value check)."""
    if x is None or not checking_values(x.device):
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"`{name}` contains NaN or Inf")
    lo, hi = x.min().item(), x.max().item()
    if lo < low or hi > high:
        raise ValueError(f"`{name}` must lie in [{low:g}, {high:g}], got values in [{lo:.4g}, {hi:.4g}]{hint}")

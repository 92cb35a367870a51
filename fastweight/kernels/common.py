"""What the chunked kernels share: chunk bookkeeping, the chunk's gate rows (``chunk_gates``: the
state passes, the output and WY stages read them alike), an exact-in-fp32 dot, ``exp`` as exp2 and
the round-to-nearest TF32 operands of ``dot_at``.

Every chunked kernel sees its inputs flattened to one packed sequence of ``B*T`` tokens
(``[1, B*T, H, ...]``) cut into N sequences by ``cu_seqlens`` (built as ``0, T, 2T, ...`` when
the caller gave none), and each sequence cut into chunks of ``BT`` tokens; the last chunk of a
sequence may be short. ``chunk_indices[c] = (n, i)``: global chunk ``c`` is chunk ``i`` of
sequence ``n``. ``chunk_offsets[n]`` is the global index of sequence ``n``'s first chunk, so
per-chunk tensors (boundary states ``h``) are ``[NC, H, K, V]`` with ``NC`` chunks in all.
``order`` lists the sequences longest first: the state passes, one program per sequence walking
its chunks, take their sequences in that order, so the GPU starts the longest chain first and
fills the other slots with the short ones (in the caller's order a long sequence that starts late
adds its whole chain to the pass: a packed batch took twice the uniform batch's time).
"""

from __future__ import annotations

import functools
import itertools
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastweight.checks import _cacheable, cache_for, cached_for, host_bounds


# Inside ``poisoned_outputs()`` every buffer a kernel should fully write starts as NaN, so a missed
# element shows (the tests and the fuzz); set only through that context manager.
POISON_OUTPUTS = False

# A block of rows whose log gates span less than this (largest minus smallest, per channel) is
# factored through one reference gate: every factor within exp(+-SAFE_SPAN) (within
# exp(+-SAFE_SPAN / 2) around a midpoint), far inside fp32's range; a wider block takes a path
# whose every exponent is <= 0. The intra-chunk kernels take it as their SPAN constexpr.
SAFE_SPAN = 40.0

# The narrowest block a 16-bit tl.dot may take: Triton 3.6 on the H200 addresses shared memory out
# of range in 16-bit dots over blocks narrower than 64 (compute-sanitizer), which faulted or gave
# wrong states and gradients at 16 and 32 wide (docs/kernels.md, narrow blocks). Kernels pad a
# smaller dimension to it and mask.
MIN_DOT_BLOCK = 64


@triton.jit
def exp(x):
    """e^x. fp32 as ``exp2(x log2 e)``, whose ex2.approx.ftz is one MUFU.EX2 after the multiply;
    ``tl.exp`` lowers to the non-flushing ex2, which sm_90 wraps in a range test and two fix-up
    multiplies for subnormal results (five instructions against two). The one difference in value:
    results below 2^-126 (x < -87.3) flush to 0 instead of a subnormal. Other dtypes as ``tl.exp``."""
    if x.dtype == tl.float32:
        return tl.exp2(x * 1.4426950408889634)
    else:
        return tl.exp(x)


@triton.jit
def round_tf32(x):
    """fp32 ``x`` rounded to the nearest TF32 value (10 mantissa bits, ties away from zero). A TF32
    dot truncates its fp32 operands to 10 bits toward zero, and the truncation's bias adds up along
    the sum; operands rounded here lose nothing more there, and their rounding errors are unbiased
    and half as large. An integer add and mask an element, where 3 x TF32 takes three passes; a NaN
    passes unchanged (the add would carry its mantissa into the exponent or the sign)."""
    b = x.to(tl.int32, bitcast=True)
    r = ((b + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
    return tl.where(x == x, r, x)


@triton.jit
def dot_at(a, b, P: tl.constexpr):
    """``tl.dot(a, b)`` at input precision ``P``: Triton's ("ieee", "tf32", "tf32x3") or "tf32rn",
    one TF32 pass with the fp32 operands rounded to nearest first (:func:`round_tf32`; 16-bit
    operands are exact in TF32)."""
    if P == "tf32rn":
        if a.dtype == tl.float32:
            a = round_tf32(a)
        if b.dtype == tl.float32:
            b = round_tf32(b)
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=P)


def dot_block(n: int) -> int:
    """The block that covers a dimension of size ``n`` in a 16-bit dot: a power of two, at least
    :data:`MIN_DOT_BLOCK` (a smaller dimension is padded and masked)."""
    return max(MIN_DOT_BLOCK, triton.next_power_of_2(n))


def while_loops() -> bool:
    """Loops to a runtime bound run as ``while`` under the interpreter (its range() needs a
    constexpr bound); compiled kernels use ``for``, which Triton software-pipelines."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (ieee); 16-bit inputs use the tensor cores, where fp32
    operands (decayed rows, fp32 gradients) pass as TF32: for fp16, rounded to nearest first
    ("tf32rn", :func:`dot_at`), as fine as fp16 itself, since the tensor cores' truncation is biased;
    for bf16, 8 times coarser itself, truncated."""
    if dtype == torch.float32:
        return "ieee"
    return "tf32rn" if dtype == torch.float16 else "tf32"


@contextmanager
def poisoned_outputs(enabled: bool = True):
    """Within the block, :func:`alloc` fills every output buffer with NaN."""
    global POISON_OUTPUTS
    before, POISON_OUTPUTS = POISON_OUTPUTS, enabled
    try:
        yield
    finally:
        POISON_OUTPUTS = before


def alloc(shape, *, dtype, device) -> torch.Tensor:
    """An output buffer: uninitialised, or NaN-filled while POISON_OUTPUTS is set."""
    if POISON_OUTPUTS:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


@dataclass(frozen=True)
class Chunks:
    cu_seqlens: torch.Tensor      # [N+1] int64
    chunk_indices: torch.Tensor   # [NC, 2] int32: (sequence, chunk within the sequence)
    chunk_offsets: torch.Tensor   # [N+1] int64
    N: int
    NC: int
    BT: int
    order: torch.Tensor           # [N] int32: the sequences, longest first (ties in their order)
    NT: int | None = None          # chunks per sequence when all have the same length (no cu_seqlens)


_CHUNKS_CACHE: dict = {}   # id(cu_seqlens) -> (weakref, _version, {(BT, device): Chunks}), device tensors


def prepare_chunks(cu_seqlens: torch.Tensor | None, B: int, T: int, BT: int, device) -> Chunks:
    """Chunk indices on ``device``; with ``cu_seqlens`` the lengths are read on the host once per
    call (the copy the input check made, ``checks.host_bounds``) and the bookkeeping (the checked
    bounds themselves, chunk offsets, order, indices) goes to the device in one copy: the kernels
    never read the caller's tensor, so a write to it that the checks could not see changes no
    index under them. For a device ``cu_seqlens`` the result is kept while the same tensor comes
    back unchanged (identity and ``_version``, as the host copy): a copy from pageable host memory
    waits for the stream, and a model's layers would each stall the launch queue."""
    if cu_seqlens is None:
        return _uniform_chunks(B, T, BT, torch.device(device))
    key = (BT, str(torch.device(device)))
    kept = cached_for(cu_seqlens, _CHUNKS_CACHE) if _cacheable(cu_seqlens) else None
    if kept is not None and key in kept:
        host_bounds(cu_seqlens)   # the call's check left its copy in the one-slot cache: take it
        return kept[key]
    bounds = host_bounds(cu_seqlens)
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    counts = [triton.cdiv(L, BT) for L in lens]
    N, NC = len(lens), sum(counts)
    order = sorted(range(N), key=lambda n: -lens[n])
    pairs = [x for n, c in enumerate(counts) for i in range(c) for x in (n, i)]
    host = torch.tensor([*bounds, 0, *itertools.accumulate(counts), *order, *pairs], dtype=torch.int64)
    dev = host.to(device)
    chunks = Chunks(dev[:N + 1], dev[3 * N + 2:].view(NC, 2).to(torch.int32), dev[N + 1:2 * N + 2], N, NC, BT,
                    dev[2 * N + 2:3 * N + 2].to(torch.int32))
    if _cacheable(cu_seqlens):
        cache_for(cu_seqlens, _CHUNKS_CACHE, {**(kept or {}), key: chunks})
    return chunks


@functools.lru_cache(maxsize=64)
def _uniform_chunks(B: int, T: int, BT: int, device: torch.device) -> Chunks:
    """B sequences of T tokens (cached: the same shapes come back every training step)."""
    NT = triton.cdiv(T, BT)
    cu = torch.arange(B + 1, device=device, dtype=torch.int64) * T
    n = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(NT)
    i = torch.arange(NT, device=device, dtype=torch.int32).repeat(B)
    offsets = torch.arange(B + 1, device=device, dtype=torch.int64) * NT
    order = torch.arange(B, device=device, dtype=torch.int32)
    return Chunks(cu, torch.stack([n, i], 1).contiguous(), offsets, B, B * NT, BT, order, NT)


@triton.jit
def sub_chunk_rows(i_tc, cu_seqlens, chunk_indices, BT: tl.constexpr, BC: tl.constexpr):
    """Program id over (chunk, sub-chunk) pairs -> (i_t global chunk, i_i sub-chunk, i_c chunk in its
    sequence, bos, T of the sequence, o_i [BC] row positions in the sequence, m_i rows < T)."""
    NC: tl.constexpr = BT // BC
    i_t, i_i = (i_tc // NC).to(tl.int64), i_tc % NC
    i_n, i_c = tl.load(chunk_indices + i_t * 2).to(tl.int64), tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    o_i = i_c * BT + i_i * BC + tl.arange(0, BC)
    return i_t, i_i, i_c, bos, T, o_i, o_i < T


@triton.jit
def chunk_bounds(i_t, cu_seqlens, chunk_indices):
    """Global chunk index -> (i_c chunk in its sequence, bos, T of the sequence), all int64."""
    i_t = i_t.to(tl.int64)
    i_n, i_c = tl.load(chunk_indices + i_t * 2).to(tl.int64), tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return i_c, bos, eos - bos


@triton.jit
def chunk_gates(g, bos, T, i_t, H: tl.constexpr, i_h, BT: tl.constexpr):
    """(scalar g of the chunk's rows [BT], g at its last row C); rows past the end repeat g_C.
    With 0 there, exp(0 - g_j) would pass e^88 once the chunk decays that much, and inf times the
    lane's zero operand would put NaN into the valid rows' sums. The fill is a select after the
    load: a tensor as the masked load's ``other`` keeps Triton 3.6's pipeliner from giving the
    state passes' loop a third buffer."""
    o_t = i_t * BT + tl.arange(0, BT)
    b_glast = tl.load(g + (bos + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h)
    b_g = tl.load(g + (bos + o_t) * H + i_h, mask=o_t < T, other=0.)
    return tl.where(o_t < T, b_g, b_glast), b_glast


@triton.jit
def chunk_gates_k(g, bos, T, i_t, H: tl.constexpr, i_h, i_k, K: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr):
    """(per-channel G of the chunk's rows [BT, BK] in key block i_k, G at its last row [BK]); rows
    past the end repeat the last row, as in ``chunk_gates``."""
    p_g = tl.make_block_ptr(g + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    m_t = i_t * BT + tl.arange(0, BT) < T
    b_glast = chunk_gate_last_k(g, bos, T, i_t, H, i_h, i_k, K, BT, BK)
    return tl.where(m_t[:, None], tl.load(p_g, boundary_check=(0, 1)), b_glast[None, :]), b_glast


@triton.jit
def chunk_gates_raw_k(g, bos, T, i_t, H: tl.constexpr, i_h, i_k, K: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr):
    """As ``chunk_gates_k``, from the raw per-channel log gate g [1, T, H, K]: the chunk's cumsum formed
    here (rows past the end load 0, so they repeat the last row's sums) and its total."""
    p_g = tl.make_block_ptr(g + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    b_raw = tl.load(p_g, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    return tl.cumsum(b_raw, axis=0), tl.sum(b_raw, axis=0)


@triton.jit
def chunk_gate_last_k(g, bos, T, i_t, H: tl.constexpr, i_h, i_k, K: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr):
    """G at the chunk's last row [BK], key block i_k, of the per-channel cumsum g [1, T, H, K]."""
    o_k = i_k * BK + tl.arange(0, BK)
    return tl.load(g + ((bos + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h) * K + o_k, mask=o_k < K, other=0.)


@triton.jit
def mm(a, b):
    """tl.dot that stays IEEE fp32 for fp32 operands (TF32 would cost fp32 inputs ~1e-3 accuracy)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)

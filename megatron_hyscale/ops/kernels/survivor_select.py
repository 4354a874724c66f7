"""The survivors' select of HyTopK's Gluon path written straight to the rows, where no row sort
follows (`HyTopKOptions.scores_sm90_direct_select`).

Shapes: keys int64 [rows, cap] (packed as `hytopk._pack`: a row's first min(count, cap)
entries are its distinct keys), counts int32 [rows] -> indices int32 and scores fp32
[rows, topk], a row's selected keys in its buffer's order, -1 / -inf after them.

Algorithm: one program a row. The k-th largest key by a bitwise radix select over the score
halves alone, starting below the bits every key's score half shares; over the tied keys' index
halves only when the tie straddles k. Each key at or above it is decoded and stored at its rank
among them (a prefix count): no in-place compaction, and only one half of the keys held at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.kernels.common import fix_interpreter
from megatron_hyscale.ops.kernels.hytopk import (
    _bit_length,
    _high_bits,
    _low32_mask,
    _radix_select,
    _unpack_index,
    _unpack_score,
)

fix_interpreter()
# INT64_MIN: an empty slot's key, below every survivor's.
KEY_MIN = tl.constexpr(-(2**63))
# -inf's fp32 bits as int32 (the scores are stored as their bits).
NEG_INF_BITS = tl.constexpr(-8388608)
# Keys a program decodes and stores at a time (8 a thread with 4 warps).
OUT_CHUNK_KEYS = 1024


@triton.jit
def _kth_largest_nonzero(x, k):
    """The k-th largest of the nonzero entries of the uint32 tensor x (1 <= k <= their count;
    zeros never count): the answer's bits from the top down, one count reduction a bit, from
    the first bit on which the largest and the smallest nonzero entry differ (every entry
    between them shares the bits above it)."""
    top = tl.max(x, axis=0)
    bottom = tl.min(tl.where(x != 0, x, tl.full([], 0xFFFFFFFF, tl.uint32)), axis=0)
    free = _bit_length(top ^ bottom)
    return _radix_select(x, k, _high_bits(top, free), 32 - free)


@triton.jit
def _score_halves(buf):
    """The high words of the int64 keys buf in unsigned order (an empty slot's: 0)."""
    sign = tl.full([], KEY_MIN, tl.int64)
    return ((buf ^ sign).to(tl.uint64, bitcast=True) >> 32).to(tl.uint32)


@triton.jit
def _kth_key(row_ptr, offs, valid, k):
    """The k-th largest of the row's distinct keys (k below their count): the score halves'
    k-th, then, if the keys tied with it do not all make the cut, their index halves' rank-th.
    The row is read again for the index halves, so only one half is held at a time."""
    sign = tl.full([], KEY_MIN, tl.int64)
    hi = _score_halves(tl.load(row_ptr + offs, mask=valid, other=KEY_MIN,
                               eviction_policy="evict_last"))
    kth_hi = _kth_largest_nonzero(hi, k)
    rank = k - tl.sum((hi > kth_hi).to(tl.int32), axis=0)
    tie = hi == kth_hi
    kth_lo = tl.zeros([], tl.uint32)  # every tied key kept: their index halves are all > 0
    if tl.sum(tie.to(tl.int32), axis=0) > rank:
        # an index half is 2^32 - 1 - index: never 0 for an int32 index
        lo = (tl.load(row_ptr + offs, mask=valid, other=KEY_MIN, cache_modifier=".cg")
              & _low32_mask()).to(tl.uint32)
        kth_lo = _kth_largest_nonzero(tl.where(tie, lo, 0), rank)
    kth = (kth_hi.to(tl.uint64) << 32) | kth_lo.to(tl.uint64)
    return kth.to(tl.int64, bitcast=True) ^ sign


@triton.jit
def _select_rows_kernel(keys_ptr, count_ptr, out_idx_ptr, out_score_ptr, CAP,
                        TOPK: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr,
                        CHUNK: tl.constexpr):
    """keys int64 [rows, CAP], counts int32 [rows] -> out int32 [rows, TOPK] (scores as their
    fp32 bits); program r writes row r. CP: CAP rounded up to a power of two, KP: TOPK's;
    CHUNK: the keys decoded and stored at a time."""
    r = tl.program_id(0).to(tl.int64)
    row_ptr = keys_ptr + r * CAP
    n = tl.minimum(tl.load(count_ptr + r), CAP)
    kth = tl.full([], KEY_MIN, tl.int64)
    if n > TOPK:
        offs = tl.arange(0, CP)
        kth = _kth_key(row_ptr, offs, offs < n, TOPK)
    # The kept keys in chunks (a dynamic loop): the whole row's keys, their slots and their
    # 64-bit output addresses at once would take most of the registers (compiled for sm_90a).
    # Stores stay inside the row's TOPK slots whatever the keys (repeated keys would pass the
    # cut more than TOPK times), and the tail starts after what was stored.
    row_out = r * TOPK
    out = row_out
    for c0 in range(0, n, CHUNK):
        offs_c = c0 + tl.arange(0, CHUNK)
        buf = tl.load(row_ptr + offs_c, mask=offs_c < n, other=KEY_MIN)
        keep = (offs_c < n) & (buf >= kth)
        slot = out + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        keep = keep & (slot < row_out + TOPK)
        tl.store(out_idx_ptr + slot, _unpack_index(buf), mask=keep)
        tl.store(out_score_ptr + slot, _unpack_score(buf).to(tl.int32, bitcast=True),
                 mask=keep)
        out += tl.sum(keep.to(tl.int32), axis=0)
    offs_k = tl.arange(0, KP)
    tail = (offs_k >= out - row_out) & (offs_k < TOPK)
    tl.store(out_idx_ptr + r * TOPK + offs_k, tl.full([KP], -1, tl.int32), mask=tail)
    tl.store(out_score_ptr + r * TOPK + offs_k, tl.full([KP], NEG_INF_BITS, tl.int32),
             mask=tail)


def select_rows(keys: torch.Tensor, counts: torch.Tensor, topk: int, *, num_warps: int = 4
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's topk largest of its first min(counts[r], cap) keys, in the buffer's order
    (module docstring); keys are not modified. keys int64 [rows, cap] contiguous, counts
    integer [rows]. A row whose distinct keys number fewer than topk gets -1 / -inf in the
    rest."""
    if keys.dim() != 2 or keys.dtype != torch.int64 or not keys.is_contiguous():
        raise ValueError(f"keys must be contiguous int64 [rows, cap], got {keys.dtype} "
                         f"{tuple(keys.shape)}")
    rows, cap = keys.shape
    if counts.shape != (rows,) or counts.dtype.is_floating_point:
        raise ValueError(f"counts must be an integer tensor of shape ({rows},), got "
                         f"{counts.dtype} {tuple(counts.shape)}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    indices = torch.empty(rows, topk, dtype=torch.int32, device=keys.device)
    scores = torch.empty(rows, topk, dtype=torch.float32, device=keys.device)
    if rows == 0:
        return indices, scores
    cp = triton.next_power_of_2(cap)
    _select_rows_kernel[(rows,)](
        keys, counts.to(torch.int32).contiguous(), indices, scores.view(torch.int32), cap,
        TOPK=topk, KP=triton.next_power_of_2(topk), CP=cp, CHUNK=min(cp, OUT_CHUNK_KEYS),
        num_warps=num_warps)
    return indices, scores

"""Each row's r-th largest value: the threshold pick of HyTopK's sample (`hytopk_sm90.
sample_thresholds`), where torch.topk over the sample table took most of the sample's time.

Shapes: table fp32 [R, N], rank int [R] with 1 <= rank <= N (any strides; rows may hold -inf).
Returns fp32 [R]: each row's rank-th largest value, counted with multiplicity, as
`torch.topk(table, rank).values[:, rank - 1]` gives it (-0.0 returned as 0.0: they compare
equal, and the ordered bits would otherwise tell them apart).

Algorithm: one program a row, the row in registers as int32 keys whose signed order is the
floats' order (negative floats' magnitude bits flipped); the answer is built from the top bit
down, a bit kept when at least rank keys are at or above the candidate: 32 counts, one read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.kernels.common import fix_interpreter

fix_interpreter()
# The smallest int32: padding past the row's end (below every float's key, -inf's included).
KEY_MIN = tl.constexpr(-(2**31))
# Magnitude bits flipped for negative floats (and back): the float order as signed int order.
MAGNITUDE_BITS = tl.constexpr(2**31 - 1)
KEY_BITS = 32
# The widest row a program holds in registers (the sample's 2048 columns by default).
MAX_COLUMNS = 1 << 14


@triton.jit
def _rank_value_kernel(table_ptr, rank_ptr, out_ptr, N, stride_r, stride_n, stride_rank,
                       BLOCK: tl.constexpr, NUM_BITS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(table_ptr + r * stride_r + cols * stride_n, mask=cols < N, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ MAGNITUDE_BITS, bits)
    key = tl.where(key == -1, 0, key)  # -0.0's key is -1: taken as 0.0's (no float add to flush)
    key = tl.where(cols < N, key, KEY_MIN)
    want = tl.load(rank_ptr + r * stride_rank).to(tl.int32)
    # Sign first (candidates 0 or KEY_MIN), then bits 30 .. 0 added on top: no overflow.
    ans = tl.where(tl.sum((key >= 0).to(tl.int32)) >= want, 0, KEY_MIN)
    for i in tl.static_range(NUM_BITS - 1):
        cand = ans + (1 << (NUM_BITS - 2 - i))
        ans = tl.where(tl.sum((key >= cand).to(tl.int32)) >= want, cand, ans)
    out = tl.where(ans < 0, ans ^ MAGNITUDE_BITS, ans)
    tl.store(out_ptr + r, out.to(tl.float32, bitcast=True))


def rank_values(table: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """fp32 [R]: row r's rank[r]-th largest value of table fp32 [R, N] (module docstring). The
    ranks are trusted to lie in [1, N] (a rank past the row returns a padding key's float)."""
    if table.dim() != 2 or table.dtype != torch.float32:
        raise ValueError(f"table must be fp32 [R, N], got {table.dtype} {tuple(table.shape)}")
    R, N = table.shape
    if rank.dtype.is_floating_point or rank.dtype == torch.bool or rank.device != table.device:
        raise ValueError(f"rank must be an integer tensor on {table.device}, got {rank.dtype} "
                         f"on {rank.device}")
    if rank.shape != (R,):
        raise ValueError(f"rank must have shape ({R},) to match table's rows, got "
                         f"{tuple(rank.shape)}")
    if N > MAX_COLUMNS:
        raise ValueError(f"table has {N} columns; rank_values holds at most {MAX_COLUMNS} a row")
    if R and not N:
        raise ValueError("table has no columns: no rank can be picked")
    out = torch.empty(R, dtype=torch.float32, device=table.device)
    if R:
        block = triton.next_power_of_2(N)
        _rank_value_kernel[(R,)](table, rank, out, N, *table.stride(), rank.stride(0),
                                 BLOCK=block, NUM_BITS=KEY_BITS,
                                 num_warps=4 if block <= 4096 else 8)
    return out


def rank_values_reference(table: torch.Tensor, rank: torch.Tensor,
                          max_rank: int | None = None) -> torch.Tensor:
    """`rank_values` through torch.topk (what the sample ran before): the top max_rank of every
    row (default rank.max(), a host sync), then each row's own rank."""
    best = torch.topk(table, int(rank.max()) if max_rank is None else max_rank, dim=1).values
    return best.gather(1, (rank.long() - 1)[:, None])[:, 0] + 0.0

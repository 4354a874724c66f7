"""DeepSeek-V4's interleaved RoPE of each row's trailing channels, in one read and one write.

x [rows, D] contiguous (row r = (b * T + t) * heads + h), cos / sin [T, R/2] or [B, T, R/2] fp32
contiguous; out [rows, D] new, x's dtype. Channels below P = D - R are copied; each pair
(P + 2j, P + 2j + 1) turns by its position's angle j in fp32:
  out[P+2j] = x[P+2j] cos_j - x[P+2j+1] sin_j,   out[P+2j+1] = x[P+2j+1] cos_j + x[P+2j] sin_j,
each product rounded to fp32 before the sum (no FMA), then rounded once to x's dtype: bitwise
`compress._rotate_pairs`. The backward is the same rotation by -sin (the caller negates sin).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.kernels.common import fix_interpreter

fix_interpreter()

# Rows per program: 16 rows of V4's 512 bf16 channels are 16 KiB read and written.
BLOCK_ROWS = 16


@triton.jit
def _interleaved_rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, heads, T, cos_batch_rows,
                             D: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr,
                             ROWS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_D)
    P: tl.constexpr = D - R
    row_ok = (r < n_rows)[:, None]
    mask = row_ok & (c < D)[None, :]
    rope = (c >= P) & (c < D)
    # A rope channel's partner is its pair's other channel (P is even: c ^ 1 stays in the pair).
    partner = tl.where(rope, c ^ 1, c)
    base = x_ptr + r[:, None] * D
    x = tl.load(base + c[None, :], mask=mask)
    xp = tl.load(base + partner[None, :], mask=row_ok & rope[None, :], other=0.0)
    pos = r // heads
    angle_row = (pos % T + (pos // T) * cos_batch_rows) * (R // 2)
    j = tl.where(rope, (c - P) // 2, 0)
    angle = angle_row[:, None] + j[None, :]
    cs = tl.load(cos_ptr + angle, mask=row_ok & rope[None, :], other=0.0)
    sn = tl.load(sin_ptr + angle, mask=row_ok & rope[None, :], other=0.0)
    xf = x.to(tl.float32)
    pf = xp.to(tl.float32)
    even = (c % 2 == 0)[None, :]
    turned = tl.where(even, xf * cs - pf * sn, xf * cs + pf * sn)
    tl.store(out_ptr + r[:, None] * D + c[None, :],
             tl.where(rope[None, :], turned.to(x.dtype), x), mask=mask)


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     heads: int) -> torch.Tensor:
    """The rotated copy of x ([B, T, D] with heads 1, or [B, T, heads, D]); cos / sin [T, R/2]
    or [B, T, R/2] fp32 (see the module's docstring)."""
    T, D = x.shape[1], x.shape[-1]
    R = 2 * cos.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    n_rows = x.numel() // D
    if n_rows == 0:
        return out
    cos_batch_rows = T if cos.dim() == 3 and cos.shape[0] > 1 else 0  # else one for all
    grid = (triton.cdiv(n_rows, BLOCK_ROWS),)
    # No FMA contraction: torch rounds each product to fp32 before the sum.
    _interleaved_rope_kernel[grid](x, cos.contiguous(), sin.contiguous(), out, n_rows, heads, T,
                                   cos_batch_rows, D=D, R=R, BLOCK_D=triton.next_power_of_2(D),
                                   ROWS=BLOCK_ROWS, enable_fp_fusion=False)
    return out

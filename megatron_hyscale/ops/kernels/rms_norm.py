"""RMSNorm over the last dim, optionally followed by DeepSeek-V4's interleaved RoPE of the
trailing channels, in one read and one write a direction (forward and backward).

x [rows, C] (C's stride 1, rows any stride; row r = (b * T + t) * heads + h), weight [C] or None
(any float dtype); out [rows, C] new, x's dtype; rstd fp32 [rows]. Per row, in fp32: r =
rsqrt(sum(x^2) / C + eps), y = x r [w], rounded to x's dtype. With RoPE (cos / sin fp32 [T,
R/2] or [B, T, R/2]) the pairs (P + 2j, P + 2j + 1), P = C - R, of that rounded y then turn by
their position's angle j in fp32 and round again: `rms_norm` then `apply_interleaved_rope`
(`kernels/interleaved_rope.py`), whose roundings this mirrors (a rope channel's partner is
loaded again, as that kernel does): bit for bit under the interpreter; compiled, the row sums
may add in another order than the norm-only kernel's (the compiler lays them out per kernel).
Backward: dy = the opposite rotation of the output's gradient, rounded to x's dtype (what the
RoPE's backward hands the norm's), xhat = x r, gw = dy [w], dx = r (gw - xhat mean(gw xhat));
dw = sum over rows of dy xhat, each program adding its rows' share into an fp32 row of partial
sums (a few hundred programs, persistent over row blocks), summed by torch. FMA contraction is
off (every launch): torch rounds each product before the sum, and so does the rotation.
Offsets are 64-bit: torch 2.11's fused kernels index a row in 32 bits (pytorch#181555), which
V4-Flash's query (64 x 512 channels a token) passes at 128K tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.checks import check_rope_shapes
from megatron_hyscale.ops.kernels.common import fix_interpreter, sm_count

fix_interpreter()

# Elements a program block: 16 rows of V4's 512 channels (16 KiB of bf16 read and written at a
# time); wider rows take fewer rows a block. Compiled for sm_90a (2026-12-06) at 4 warps the
# backward with the RoPE epilogue holds such a block in 197 registers, no spill.
BLOCK_ELEMENTS = 8192
# The widest row the kernels take; rms_norm runs its chunked ops past it.
MAX_BLOCK_C = 16384
# Channels a warp past 4 warps: a weighted backward holds the row's weight and its gradient's
# partial sums besides the block (sm_90a, 2026-12-06: 8192 channels at 4 warps 255 registers,
# at 8 warps 167; 16384 at 16 warps 128, the register file's share, 56 B spilled).
WARP_CHANNELS = 1024
# Persistent programs of the backward an SM: its dw partial sums are [programs, C] fp32, so
# a grid of one program a row block (8.4 M rows of V4's query at 128K) would need GiBs.
BWD_PROGRAMS_PER_SM = 4


class Rope(NamedTuple):
    """The interleaved RoPE after the norm: fp32 cos / sin [T, R/2] or [B, T, R/2] (B > 1)
    and the rows a token (x's heads; 1 without a head axis)."""

    cos: torch.Tensor
    sin: torch.Tensor
    heads: int


@triton.jit
def _mean(total, C: tl.constexpr):
    """total / C rounded once, as torch's mean divides: a product where C is a power of two
    (exact), else the correctly rounded division (Triton's `/` is the approximate one)."""
    if (C & (C - 1)) == 0:
        return total * (1.0 / C)
    return tl.math.div_rn(total, C)


@triton.jit
def _rope_angles(r, c, row_ok, heads, T, cos_batch_rows, cos_ptr, sin_ptr, C: tl.constexpr,
                 R: tl.constexpr):
    """Each (row, channel)'s cos and sin (0 off the rope channels), whether it is a rope
    channel, and its pair partner's channel."""
    rope = (c >= C - R) & (c < C)
    pos = r // heads
    angle_row = (pos % T + (pos // T) * cos_batch_rows) * (R // 2)
    angle = angle_row[:, None] + tl.where(rope, (c - (C - R)) // 2, 0)[None, :]
    m = row_ok[:, None] & rope[None, :]
    cs = tl.load(cos_ptr + angle, mask=m, other=0.0)
    sn = tl.load(sin_ptr + angle, mask=m, other=0.0)
    # C - R is even: c ^ 1 stays in the pair.
    return cs, sn, rope, tl.where(rope, c ^ 1, c)


@triton.jit
def _turn(v, vp, cs, sn, c, INVERSE: tl.constexpr):
    """(even, odd) -> (even cos - odd sin, odd cos + even sin), v this channel, vp its partner;
    INVERSE: by the opposite angle, the sign in the formula and not on sin (Triton negates as
    0 - x, which turns -0.0 into +0.0 where torch's -sin keeps it)."""
    even = (c % 2 == 0)[None, :]
    if INVERSE:
        return tl.where(even, v * cs + vp * sn, v * cs - vp * sn)
    return tl.where(even, v * cs - vp * sn, v * cs + vp * sn)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, cos_ptr, sin_ptr, n_rows, sx, so,
                         eps, heads, T, cos_batch_rows, C: tl.constexpr, BLOCK_C: tl.constexpr,
                         ROWS: tl.constexpr, HAS_W: tl.constexpr, R: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_C)
    row_ok = r < n_rows
    c_ok = c < C
    mask = row_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    # torch's rsqrt is CUDA's approximate one too (rsqrt.approx).
    rstd = tl.math.rsqrt(_mean(tl.sum(x * x, axis=1), C) + eps)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    y = y.to(out_ptr.dtype.element_ty)
    if R > 0:
        cs, sn, rope, partner = _rope_angles(r, c, row_ok, heads, T, cos_batch_rows, cos_ptr,
                                             sin_ptr, C, R)
        pm = row_ok[:, None] & rope[None, :]
        yp = tl.load(x_ptr + r[:, None] * sx + partner[None, :], mask=pm,
                     other=0.0).to(tl.float32) * rstd[:, None]
        if HAS_W:
            yp = yp * tl.load(w_ptr + partner, mask=rope, other=0.0).to(tl.float32)[None, :]
        yp = yp.to(out_ptr.dtype.element_ty).to(tl.float32)
        turned = _turn(y.to(tl.float32), yp, cs, sn, c, False).to(out_ptr.dtype.element_ty)
        y = tl.where(rope[None, :], turned, y)
    tl.store(out_ptr + r[:, None] * so + c[None, :], y, mask=mask)
    tl.store(rstd_ptr + r, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, g_ptr, w_ptr, rstd_ptr, cos_ptr, sin_ptr, dx_ptr, dw_ptr,
                         n_rows, n_blocks, sx, sg, sdx, heads, T, cos_batch_rows,
                         C: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
                         HAS_W: tl.constexpr, NEED_W: tl.constexpr, R: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    if HAS_W:
        w = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], tl.float32)
    for blk in range(pid, n_blocks, tl.num_programs(0)):
        # Row numbers fit 32 bits (the wrapper checks); their element offsets need 64.
        r = (blk * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = r < n_rows
        mask = row_ok[:, None] & c_ok[None, :]
        x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + r[:, None] * sg + c[None, :], mask=mask, other=0.0)
        if R > 0:  # the opposite rotation
            cs, sn, rope, partner = _rope_angles(r, c, row_ok, heads, T, cos_batch_rows,
                                                 cos_ptr, sin_ptr, C, R)
            gp = tl.load(g_ptr + r[:, None] * sg + partner[None, :],
                         mask=row_ok[:, None] & rope[None, :], other=0.0)
            back = _turn(g.to(tl.float32), gp.to(tl.float32), cs, sn, c, True).to(g.dtype)
            g = tl.where(rope[None, :], back, g)
        g = g.to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        if NEED_W:
            dw += tl.sum(g * xhat, axis=0)
        gw = g * w[None, :] if HAS_W else g
        dot = _mean(tl.sum(gw * xhat, axis=1), C)
        dx = rstd[:, None] * (gw - xhat * dot[:, None])
        tl.store(dx_ptr + r[:, None] * sdx + c[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
    if NEED_W:
        tl.store(dw_ptr + pid * C + c, dw, mask=c_ok)


def unsupported_width(C: int) -> str | None:
    """Why the kernels cannot take rows of C channels (None: they can)."""
    if triton.next_power_of_2(C) > MAX_BLOCK_C:
        return f"rows of {C} channels, wider than the Triton kernels' {MAX_BLOCK_C}"
    return None


def _geometry(C: int) -> dict:
    """The launch's row block: BLOCK_C, ROWS and warps for rows of C channels."""
    block_c = triton.next_power_of_2(C)
    return dict(BLOCK_C=block_c, ROWS=max(1, BLOCK_ELEMENTS // block_c),
                num_warps=max(4, block_c // WARP_CHANNELS))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, C] with C's stride 1 (a view where the layout allows, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] >= 2**31 - BLOCK_ELEMENTS:  # the kernels number rows in 32 bits
        raise ValueError(f"rms_norm: {x2.shape[0]} rows, more than the Triton kernels' 32-bit "
                         "row numbers take")
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _rope_args(x: torch.Tensor, rope: Rope | None
               ) -> tuple[tuple[torch.Tensor, torch.Tensor, int, int, int], int]:
    """(cos, sin, heads, T, cos_batch_rows) for the kernels and R (0: no RoPE), after checking
    that rope fits x ([B, T, C] with heads 1, or [B, T, heads, C])."""
    if rope is None:
        return (x, x, 1, 1, 0), 0
    cos, sin, heads = rope
    check_rope_shapes(x, cos, sin, x.dim() == 4)
    R, T = 2 * cos.shape[-1], x.shape[1]
    if heads != (x.shape[2] if x.dim() == 4 else 1):
        raise ValueError(f"rope: x must be [B, T, C] with heads 1 or [B, T, heads, C]; got "
                         f"{tuple(x.shape)} with heads {heads}")
    if any(t.dtype != torch.float32 or t.device != x.device for t in (cos, sin)):
        raise ValueError(f"rope: cos and sin must be fp32 on {x.device}, got {cos.dtype} on "
                         f"{cos.device} and {sin.dtype} on {sin.device}")
    cos_batch_rows = T if cos.dim() == 3 and cos.shape[0] > 1 else 0
    return (cos.contiguous(), sin.contiguous(), heads, T, cos_batch_rows), R


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 rope: Rope | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in x's shape and dtype, rstd fp32 [rows]) for x [..., C] (see the module doc)."""
    C = x.shape[-1]
    x2 = _rows(x)
    n_rows = x2.shape[0]
    out = torch.empty((n_rows, C), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    (cos, sin, heads, T, cos_batch_rows), R = _rope_args(x, rope)
    geometry = _geometry(C)
    if n_rows:
        grid = (triton.cdiv(n_rows, geometry["ROWS"]),)
        w = x2 if weight is None else weight.contiguous()
        _rms_norm_fwd_kernel[grid](x2, w, out, rstd, cos, sin, n_rows, x2.stride(0),
                                   out.stride(0), eps, heads, T, cos_batch_rows, C=C,
                                   HAS_W=weight is not None, R=R, enable_fp_fusion=False,
                                   **geometry)
    return out.view(x.shape), rstd


def rms_norm_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 rstd: torch.Tensor, need_weight_grad: bool, rope: Rope | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x's shape and dtype, dw fp32 [C] or None) from the forward's rstd; grad is the
    output's gradient (after the RoPE, when there is one)."""
    C = x.shape[-1]
    x2, g2 = _rows(x), _rows(grad)
    n_rows = x2.shape[0]
    dx = torch.empty((n_rows, C), dtype=x.dtype, device=x.device)
    geometry = _geometry(C)
    n_blocks = triton.cdiv(n_rows, geometry["ROWS"])
    programs = max(1, min(n_blocks, BWD_PROGRAMS_PER_SM * sm_count(x.device)))
    need_w = need_weight_grad and weight is not None
    partial = torch.empty((programs, C) if need_w else (1,), dtype=torch.float32,
                          device=x.device)
    (cos, sin, heads, T, cos_batch_rows), R = _rope_args(x, rope)
    if n_rows:
        w = x2 if weight is None else weight.contiguous()
        _rms_norm_bwd_kernel[(programs,)](
            x2, g2, w, rstd, cos, sin, dx, partial, n_rows, n_blocks, x2.stride(0),
            g2.stride(0), dx.stride(0), heads, T, cos_batch_rows, C=C,
            HAS_W=weight is not None, NEED_W=need_w, R=R, enable_fp_fusion=False, **geometry)
    dw = None
    if need_w:
        dw = partial.sum(0) if n_rows else torch.zeros(C, dtype=torch.float32, device=x.device)
    return dx.view(x.shape), dw

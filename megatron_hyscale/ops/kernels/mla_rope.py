"""MLA's RoPE on the query's rotary part, read from and written to strided views.

x [rows, b, n, R] (R = 2 * HALF, any strides), cos / sin [rows, R] contiguous in x's dtype
(megatron's `(cos(freqs) * mscale).to(dtype)`); out: a view of the same shape.
DeepSeek's pairs (x[2j], x[2j+1]) are de-interleaved into halves lo, hi, then rotated:
  out[j] = lo[j] cos[j] - hi[j] sin[j],   out[HALF + j] = hi[j] cos[HALF + j] + lo[j] sin[HALF + j],
each product and the sum rounded to x's dtype, the order megatron's unfused RoPE rounds in, so
the values are bitwise its. The backward kernel applies the transpose and re-interleaves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.kernels.common import fix_interpreter

fix_interpreter()

# (row, batch, head) triples per program: 128 x 64 rotary values of bf16 is 16 KiB read and
# written; few programs also keep Triton's interpreter (one Python pass a program) quick.
BLOCK_TRIPLES = 128
# bf16 keeps an fp32's upper 16 bits: adding 0x7FFF plus the kept part's lowest bit, then
# clearing the lower 16, rounds to nearest even.
BF16_DROPPED_BITS = tl.constexpr(16)
BF16_ROUNDING_BIAS = tl.constexpr(0x7FFF)


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    # The product rounded to x's dtype, as torch rounds each op's result. For bf16 in integer
    # arithmetic: a cast there and back may be folded away on the GPU (then the multiply-add
    # contracts into one FMA, one rounding instead of three); integer ops cannot be.
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits += BF16_ROUNDING_BIAS + ((bits >> BF16_DROPPED_BITS) & 1)
        bits = (bits >> BF16_DROPPED_BITS) << BF16_DROPPED_BITS
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    elif dtype == tl.float32:
        return v
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _mla_rope_kernel(src_ptr, cos_ptr, sin_ptr, dst_ptr, M, B, N,
                     ss_r, ss_b, ss_n, ss_d, sd_r, sd_b, sd_n, sd_d,
                     HALF: tl.constexpr, BLOCK_M: tl.constexpr, BACKWARD: tl.constexpr):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (m < M)[:, None]
    head = m % N
    bi = (m // N) % B
    row = m // (N * B)
    j = tl.arange(0, HALF)
    dtype: tl.constexpr = dst_ptr.dtype.element_ty
    # Forward reads the interleaved pairs and writes halves; backward the other way round.
    pair_lo, pair_hi = 2 * j, 2 * j + 1
    half_lo, half_hi = j, HALF + j
    in_lo, in_hi = (half_lo, half_hi) if BACKWARD else (pair_lo, pair_hi)
    out_lo, out_hi = (pair_lo, pair_hi) if BACKWARD else (half_lo, half_hi)
    src = src_ptr + (row * ss_r + bi * ss_b + head * ss_n)[:, None]
    a = tl.load(src + in_lo[None, :] * ss_d, mask=mask).to(tl.float32)
    b = tl.load(src + in_hi[None, :] * ss_d, mask=mask).to(tl.float32)
    factors = (row * 2 * HALF)[:, None]
    c_lo = tl.load(cos_ptr + factors + half_lo[None, :], mask=mask).to(tl.float32)
    c_hi = tl.load(cos_ptr + factors + half_hi[None, :], mask=mask).to(tl.float32)
    s_lo = tl.load(sin_ptr + factors + half_lo[None, :], mask=mask).to(tl.float32)
    s_hi = tl.load(sin_ptr + factors + half_hi[None, :], mask=mask).to(tl.float32)
    # The rotation and its transpose: sin's halves trade places and the minus moves. The minus
    # as a subtraction of the rounded product: megatron negates x, and x + (-p) is x - p to the
    # sign of a zero, where negating sin (0 - s in Triton) would turn sin's +0 into +0, not -0.
    if BACKWARD:
        first = _rounded(a * c_lo, dtype) + _rounded(b * s_hi, dtype)
        second = _rounded(b * c_hi, dtype) - _rounded(a * s_lo, dtype)
        # megatron's de-interleaving slices sum their zero-filled gradients: -0 becomes +0.
        first += 0.0
        second += 0.0
    else:
        first = _rounded(a * c_lo, dtype) - _rounded(b * s_lo, dtype)
        second = _rounded(b * c_hi, dtype) + _rounded(a * s_hi, dtype)
    dst = dst_ptr + (row * sd_r + bi * sd_b + head * sd_n)[:, None]
    tl.store(dst + out_lo[None, :] * sd_d, first.to(dtype), mask=mask)
    tl.store(dst + out_hi[None, :] * sd_d, second.to(dtype), mask=mask)


def _launch(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor,
            backward: bool) -> None:
    rows, b, n, width = src.shape
    triples = rows * b * n
    grid = (triton.cdiv(triples, BLOCK_TRIPLES),)
    # No FMA contraction: megatron rounds each product before the sum (fp32 too).
    _mla_rope_kernel[grid](src, cos, sin, dst, triples, b, n, *src.stride(), *dst.stride(),
                           HALF=width // 2, BLOCK_M=BLOCK_TRIPLES, BACKWARD=backward,
                           enable_fp_fusion=False)


def mla_rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Write RoPE(x) into `out` ([rows, b, n, R] views; cos / sin [rows, R] contiguous)."""
    _launch(x, cos, sin, out, backward=False)


def mla_rope_bwd(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 grad_x: torch.Tensor) -> None:
    """Write RoPE's input gradient for `grad` into `grad_x` (views as in `mla_rope_fwd`)."""
    _launch(grad, cos, sin, grad_x, backward=True)

"""RMSNorm over the last dim, computed in fp32 and returned in the input's dtype, whose autograd
keeps only the input and one fp32 scale a row.

DeepSeek-V4 normalizes every query head (and each compressed entry) this way. Written as plain
torch ops, autograd keeps the fp32 upcast of the input for backward and builds several fp32
gradients of the same size: for V4-Flash's queries ([T, 64, 512]) that is 4 GiB each at 32K
tokens, and five of them were alive at once at the peak of a layer's backward (measured with
scripts/profile_layer_memory.py on the H200, 2026-11-30: 20 of the step's 25 GiB). Here the
forward and the backward run in row chunks of about CHUNK_BYTES of fp32, and what is saved is
the input (bf16 for the layer) and rstd [rows] in fp32.

Values: per row, y = x * rsqrt(mean(x^2) + eps) [* weight], all in fp32, rounded once to x's
dtype; the same ops in the same order as the plain-torch form, row by row.

On CUDA the op runs HyScale's Triton kernels (`kernels/rms_norm.py`, kernel="triton"): the same
formula and saved tensors, one read and one write of each tensor a direction, where the chunked
form makes six to eleven fp32 passes (V4-Flash's queries at 128K tokens are 4.3 G elements);
64-bit offsets, a weight of any dtype, the weight's gradient from per-program partial sums.
Their row sums add in another order than torch's `mean`: 1-ulp fp32 differences of the scale.
kernel="fused" runs torch's fused RMSNorm kernels (`aten._fused_rms_norm` and its backward,
what `F.rms_norm` runs there) instead, in row chunks below 2^31 elements (torch 2.11's kernels
index a row in 32 bits), each chunk's output copied into the whole: timed against the Triton
kernels by scripts/bench_rms_norm.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch.autograd.function import once_differentiable

from megatron_hyscale.ops.checks import triton_interpret, warn_once

if TYPE_CHECKING:  # the kernels (and Triton) load on first use
    from megatron_hyscale.ops.kernels.rms_norm import Rope

# fp32 bytes of one chunk's temporaries (a few of them live at once).
CHUNK_BYTES = 256 << 20

# Elements one fused launch may take: torch 2.11's CUDA kernels compute a row's offset in 32
# bits (pytorch#181555, fixed after 2.11), so larger inputs go in row chunks below 2^31.
FUSED_MAX_ELEMENTS = 2**31 - 1


def _fused_ops() -> tuple | None:
    """torch's fused RMSNorm forward and backward (torch >= 2.8) where this torch has them with
    the signatures used here, else None. The backward op has CUDA kernels only: on the CPU
    (tests) torch's own decomposition of it stands in."""
    fwd = getattr(torch.ops.aten, "_fused_rms_norm", None)
    bwd = getattr(torch.ops.aten, "_fused_rms_norm_backward", None)
    want = (["input", "normalized_shape", "weight", "eps"],
            ["grad_out", "input", "normalized_shape", "rstd", "weight", "output_mask"])
    try:
        names = tuple([a.name for a in op.default._schema.arguments] for op in (fwd, bwd))
    except AttributeError:
        return None
    if names != want:
        return None
    from torch._decomp import decomposition_table

    bwd_cpu = decomposition_table.get(bwd.default, bwd)

    def backward(grad, x, *args):
        return (bwd if x.is_cuda else bwd_cpu)(grad, x, *args)

    return fwd, backward


_FUSED = _fused_ops()


def _fused_rows(width: int) -> int:
    return max(1, FUSED_MAX_ELEMENTS // width)


class _FusedRMSNorm(torch.autograd.Function):
    """torch's fused kernels, in row chunks of at most FUSED_MAX_ELEMENTS elements (one launch
    below that); a weight only with one chunk (its gradient is one reduction)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        fwd = _FUSED[0]
        width = x.shape[-1]
        x2 = x.reshape(-1, width)
        step = _fused_rows(width)
        if x2.shape[0] <= step:
            out, rstd = fwd(x2, [width], weight, eps)
        else:
            out = torch.empty_like(x2)
            rstd = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
            for r0 in range(0, x2.shape[0], step):
                out[r0:r0 + step], rstd[r0:r0 + step] = fwd(x2[r0:r0 + step], [width], weight,
                                                           eps)
        ctx.save_for_backward(x, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        bwd = _FUSED[1]
        x, weight, rstd = ctx.saved_tensors
        width = x.shape[-1]
        x2, g2 = x.reshape(-1, width), grad.reshape(-1, width)
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        step = _fused_rows(width)
        if x2.shape[0] <= step:
            dx, dw = bwd(g2, x2, [width], rstd, weight, mask)
        else:  # no weight here (rms_norm keeps weighted norms this large on the chunked ops)
            dx, dw = torch.empty_like(x2), None
            for r0 in range(0, x2.shape[0], step):
                dx[r0:r0 + step] = bwd(g2[r0:r0 + step], x2[r0:r0 + step], [width],
                                       rstd[r0:r0 + step], None, [True, False])[0]
        return (dx.view(x.shape) if mask[0] else None, dw if mask[1] else None, None)


def _rows_per_chunk(width: int) -> int:
    return max(1, CHUNK_BYTES // (4 * width))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        wf = None if weight is None else weight.float()
        step = _rows_per_chunk(shape[-1])
        for r0 in range(0, x2.shape[0], step):
            xf = x2[r0:r0 + step].float()
            r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            y = xf * r
            out[r0:r0 + step] = y if wf is None else y * wf
            rstd[r0:r0 + step] = r.squeeze(-1)
        ctx.save_for_backward(x, weight, rstd)
        return out.view(shape)

    @staticmethod
    @once_differentiable  # the saved rstd is used as a constant: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        g2 = grad.reshape(-1, shape[-1])
        need_x, need_w = ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]
        dx = torch.empty_like(x2) if need_x else None
        dw = torch.zeros(shape[-1], dtype=torch.float32, device=x.device) if need_w else None
        wf = None if weight is None else weight.float()
        step = _rows_per_chunk(shape[-1])
        for r0 in range(0, x2.shape[0], step):
            r = rstd[r0:r0 + step, None]
            xhat = x2[r0:r0 + step].float() * r
            g = g2[r0:r0 + step].float()
            if need_w:
                dw += (g * xhat).sum(0)
            if need_x:
                gw = g if wf is None else g * wf
                # d/dx of x * r(x): r * (gw - xhat * mean(gw * xhat))
                dx[r0:r0 + step] = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return (None if dx is None else dx.view(shape),
                None if dw is None else dw.to(weight.dtype), None)


class _TritonRMSNorm(torch.autograd.Function):
    """HyScale's Triton kernels (`kernels/rms_norm.py`), any size in one launch each way, with
    the RoPE after the norm when cos and sin are given (constants: no gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                cos: torch.Tensor | None, sin: torch.Tensor | None, heads: int) -> torch.Tensor:
        from megatron_hyscale.ops.kernels.rms_norm import Rope, rms_norm_fwd

        rope = None if cos is None else Rope(cos, sin, heads)
        out, rstd = rms_norm_fwd(x, weight, eps, rope)
        ctx.save_for_backward(x, weight, rstd, cos, sin)
        ctx.heads = heads
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from megatron_hyscale.ops.kernels.rms_norm import Rope, rms_norm_bwd

        x, weight, rstd, cos, sin = ctx.saved_tensors
        rope = None if cos is None else Rope(cos, sin, ctx.heads)
        need_w = weight is not None and ctx.needs_input_grad[1]
        dx, dw = rms_norm_bwd(grad, x, weight, rstd, need_w, rope)
        return (dx if ctx.needs_input_grad[0] else None,
                dw.to(weight.dtype) if need_w else None, None, None, None, None)


def _fused_declined(x: torch.Tensor, weight: torch.Tensor | None) -> str | None:
    """Why torch's fused kernels cannot take this call (None: they can)."""
    if _FUSED is None:
        return f"torch {torch.__version__} has no fused RMSNorm kernel (aten._fused_rms_norm)"
    if weight is None:
        return None
    if weight.dtype != x.dtype:  # one dtype for both (F.rms_norm declines otherwise)
        return f"the weight's dtype {weight.dtype} is not the input's {x.dtype}"
    if x.numel() > FUSED_MAX_ELEMENTS:
        return (f"x has {x.numel()} elements, more than one fused launch takes "
                f"({FUSED_MAX_ELEMENTS}), and a weight, whose gradient would add up in chunks")
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
             kernel: Literal["auto", "triton", "fused", "chunked"] = "auto",
             rope: Rope | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) times weight (if given), in fp32, returned in x's dtype.

    x: [..., C] (any float dtype); weight: [C] or None. (transformers' V4 rounds to x's dtype
    before the weight and keeps the weight's dtype, fp32 there, in the output; identical in
    fp32, and here the output dtype never changes.)
    kernel: "triton" HyScale's Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1), "fused"
    torch's fused RMSNorm kernels (CUDA; a weight of x's dtype; row chunks past 2^31 elements),
    "chunked" the row-chunked torch ops above, "auto" (default) Triton on CUDA, chunked
    elsewhere (and, with one warning, for rows wider than the Triton kernels take: 16384).
    rope: V4's interleaved RoPE of the trailing channels after the norm, in the same pass (the
    Triton kernels only: `compress.rms_norm_rope` composes the two ops elsewhere).
    """
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected "
                         f"({x.shape[-1]},) for x of shape {tuple(x.shape)}")
    if kernel not in ("auto", "triton", "fused", "chunked"):
        raise ValueError(f"rms_norm: kernel must be 'auto', 'triton', 'fused' or 'chunked', got "
                         f"{kernel!r}")
    wide = None  # why the Triton kernels cannot take x's rows, where they are asked
    if kernel == "triton" or (kernel == "auto" and x.is_cuda):
        from megatron_hyscale.ops.kernels.rms_norm import unsupported_width

        wide = unsupported_width(x.shape[-1])
    if kernel == "auto":
        kernel = "triton" if x.is_cuda and wide is None else "chunked"
        if wide is not None and rope is None:
            warn_once(f"rms_norm: {wide}", "HyScale: rms_norm runs its chunked torch ops, "
                      f"not the Triton kernels: {wide}")
    if rope is not None and kernel != "triton":
        raise ValueError(f"rms_norm: rope runs on the Triton kernels only (here: {kernel!r}); "
                         "compress.rms_norm_rope composes the norm and the rotation elsewhere")
    if kernel == "triton":
        if wide is not None:
            raise ValueError(f"rms_norm: the Triton kernels cannot run: {wide}")
        if not x.is_cuda and not triton_interpret():
            raise ValueError(f"rms_norm: kernel='triton' got x on {x.device}, where the Triton "
                             "kernels run only in Triton's interpreter (TRITON_INTERPRET=1); "
                             "use CUDA tensors or kernel='chunked'")
        cos, sin, heads = (None, None, 1) if rope is None else rope
        return _TritonRMSNorm.apply(x, weight, eps, cos, sin, heads)
    if kernel == "fused":
        why = _fused_declined(x, weight)
        if why is not None:
            raise ValueError(f"rms_norm: kernel='fused' cannot run: {why}")
        return _FusedRMSNorm.apply(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)

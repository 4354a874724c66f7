"""Absorbed MLA's per-head projections around the core attention, each written in place.

megatron-core's AbsorbedMLA splits the q up projection's output into its no-RoPE and RoPE
parts, absorbs K's up projection into the first with `einsum("...nd,ndk->...nk")`, makes it
contiguous, rotates the second (its unfused RoPE: five elementwise passes and three
concatenations), then concatenates the two; the V up projection after the core attention is
another einsum plus a reshape. Each step copies a whole [rows, heads, width] tensor, in
forward, again in the recompute, and in the backward of each. Here the batched GEMM over the
heads writes into a strided view of the final buffer (cuBLAS takes a row stride of heads x
width and a batch stride of width) and one kernel writes the rotated part beside it:

- `absorbed_query(q, k_up_weight, cos, sin)`: [s, b, n, kv_lora + rope] from q [s, b, n,
  qk_head_dim + rope], as megatron's absorbed query;
- `project_values(out, v_up_weight)`: [s, b, n * v_head_dim] from the core attention's
  [b, s, n, kv_lora], as HyScaleDSAttention's former einsum + reshape.

The GEMMs are the einsums' products (one per head over the same operands, fp32
accumulation); the RoPE is bitwise megatron's (`kernels/mla_rope.py`).
"""

from __future__ import annotations

import torch

from megatron_hyscale.ops.checks import triton_interpret
from megatron_hyscale.ops.kernels.mla_rope import mla_rope_bwd, mla_rope_fwd
from megatron_hyscale.ops.reference import mla_rope_grad_reference, mla_rope_reference


def _on_triton(x: torch.Tensor) -> bool:
    """The RoPE kernel runs on CUDA tensors and under TRITON_INTERPRET (plain torch else)."""
    return x.is_cuda or triton_interpret()


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[..., n, w] -> [n, rows, w] (rows = the leading dims, flattened); a copy only where
    the leading dims do not flatten in place (an operand, never a GEMM's output)."""
    return x.reshape(-1, *x.shape[-2:]).transpose(0, 1)


def _heads_first_out(x: torch.Tensor) -> torch.Tensor:
    """As `_heads_first`, always a view (a GEMM's output: `view` raises rather than let the
    GEMM write into a copy)."""
    return x.view(-1, *x.shape[-2:]).transpose(0, 1)


class _AbsorbedQuery(torch.autograd.Function):
    """q [s, b, n, d + r] -> [s, b, n, c + r]: q[..., :d] @ k_up [n, d, c] per head, then
    the RoPE'd q[..., d:]; the backward writes dq's two parts in place likewise."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k_up_weight: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        d, c = k_up_weight.shape[1:]
        query = q.new_empty(*q.shape[:-1], c + q.size(-1) - d)
        torch.bmm(_heads_first(q[..., :d]), k_up_weight, out=_heads_first_out(query[..., :c]))
        if _on_triton(q):
            mla_rope_fwd(q[..., d:], cos, sin, query[..., c:])
        else:
            query[..., c:] = mla_rope_reference(q[..., d:], cos, sin)
        ctx.save_for_backward(q, k_up_weight, cos, sin)
        return query

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k_up_weight, cos, sin = ctx.saved_tensors
        d, c = k_up_weight.shape[1:]
        grad_abs = _heads_first(grad[..., :c])  # [n, rows, c]
        grad_q = grad_k = None
        if ctx.needs_input_grad[0]:
            grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
            torch.bmm(grad_abs, k_up_weight.transpose(1, 2),
                      out=_heads_first_out(grad_q[..., :d]))
            if _on_triton(grad):
                mla_rope_bwd(grad[..., c:], cos, sin, grad_q[..., d:])
            else:
                grad_q[..., d:] = mla_rope_grad_reference(grad[..., c:], cos, sin)
        if ctx.needs_input_grad[1]:
            grad_k = torch.bmm(_heads_first(q[..., :d]).transpose(1, 2), grad_abs)
        return grad_q, grad_k, None, None


class _ProjectValues(torch.autograd.Function):
    """[1, s, n, c] x [n, d, c] per head -> [s, 1, n, d] (a batch of one)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, v_up_weight: torch.Tensor) -> torch.Tensor:
        _, s, n, _ = out.shape
        result = out.new_empty(s, 1, n, v_up_weight.size(1))
        torch.bmm(_heads_first(out[0]), v_up_weight.transpose(1, 2),
                  out=_heads_first_out(result[:, 0]))
        ctx.save_for_backward(out, v_up_weight)
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out, v_up_weight = ctx.saved_tensors
        grad_rows = _heads_first(grad[:, 0])  # [n, s, d]
        grad_out = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_out = torch.empty_like(out, memory_format=torch.contiguous_format)
            torch.bmm(grad_rows, v_up_weight, out=_heads_first_out(grad_out[0]))
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(grad_rows.transpose(1, 2), _heads_first(out[0]))
        return grad_out, grad_w


def _check_heads(name: str, x: torch.Tensor, weight_name: str, weight: torch.Tensor,
                 dim: int) -> None:
    if weight.ndim != 3 or x.size(-2) != weight.size(0) or x.size(-1) != weight.size(dim):
        raise ValueError(f"{name} {tuple(x.shape)} and {weight_name} {tuple(weight.shape)} "
                         f"do not agree on the heads and the width")
    if x.dtype != weight.dtype:
        raise ValueError(f"{name} is {x.dtype} but {weight_name} is {weight.dtype}")


def absorbed_query(q: torch.Tensor, k_up_weight: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """The absorbed MLA query [s, b, n, c + r], contiguous, from the q up projection's
    output `q` [s, b, n, d + r]: q[..., :d] times `k_up_weight` [n, d, c] per head, then
    RoPE (DeepSeek's interleaved pairs) on q[..., d:] with `cos` / `sin` [s, r] in q's dtype
    (megatron's `(cos(freqs) * mscale).to(dtype)`).

    Equals megatron's `cat([einsum("...nd,ndk->...nk", q_no_pe, k_up).contiguous(),
    apply_rotary_pos_emb(q_pos_emb, freqs, mla_rotary_interleaved=True)], -1)` (RoPE bitwise,
    the GEMM the same product) in one buffer: no split, copy or concatenation either way."""
    _check_heads("q", q[..., :k_up_weight.size(1)], "k_up_weight", k_up_weight, 1)
    rope = q.size(-1) - k_up_weight.size(1)
    if q.ndim != 4 or rope < 2 or rope & (rope - 1):
        raise ValueError(f"q {tuple(q.shape)}: expected [s, b, n, d + r] with a rotary part "
                         f"r a power of two, d = k_up_weight's {k_up_weight.size(1)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (q.size(0), rope) or t.dtype != q.dtype:
            raise ValueError(f"{name} must be [{q.size(0)}, {rope}] in {q.dtype}, got "
                             f"{tuple(t.shape)} in {t.dtype}")
    return _AbsorbedQuery.apply(q, k_up_weight, cos.contiguous(), sin.contiguous())


def project_values(out: torch.Tensor, v_up_weight: torch.Tensor) -> torch.Tensor:
    """[s, b, n * d]: the core attention's `out` [b, s, n, c] times `v_up_weight` [n, d, c]
    per head, as `einsum("bshc,hdc->sbhd", out, v_up_weight).reshape(s, b, -1)`; with a
    batch of one the GEMM writes the result in place (larger batches take the einsum)."""
    _check_heads("out", out, "v_up_weight", v_up_weight, 2)
    b, s = out.shape[:2]
    if b != 1:
        return torch.einsum("bshc,hdc->sbhd", out, v_up_weight).reshape(s, b, -1)
    return _ProjectValues.apply(out, v_up_weight).view(s, b, -1)

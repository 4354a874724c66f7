"""Sparse MLA attention on library kernels: FlashMLA's SM90 forward, cuDNN's SM90 backward.

The pair megatron-core's cudnn DSA backend runs, under `ops.sparse_attention`'s contract for
one shared KV head (absorbed MLA: K = [latent | rope], V = the first 512 channels; or
DeepSeek-V4's K = V of 512 with a per-head sink). Rows are flattened batch-major, key ids made
global, each row's valid slots put first with a length, query heads padded with zero heads to
the 64 the Hopper kernels take. FlashMLA's lse leaves the sink out; the contract's includes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_hyscale.ops.backends.availability import (
    CUDNN,
    FLASHMLA,
    cudnn_dsa,
    flash_mla_sparse_fwd,
    library_unavailable,
)
from megatron_hyscale.ops.backends.slots import flat_key_ids, round_up, valid_first

VALUE_CHANNELS = 512  # FlashMLA's sparse prefill writes 512 value channels only
KEY_CHANNELS = (576, 512)  # [latent 512 | rope 64] (MLA), or K = V (DeepSeek-V4)
HEAD_COUNTS = (64, 128)  # the SM90 kernels' query-head tiles; fewer heads are zero-padded
TOPK_ALIGNMENT = 512  # slots per row a multiple of this (megatron's FlashMLA alignment on sm_90)


def flashmla_forward_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                                 indices: torch.Tensor, dv: int | None, *,
                                 prefix_lengths: torch.Tensor | None) -> str | None:
    """None when FlashMLA's sparse forward (`flashmla_forward`) can run this call, else the
    reason it cannot."""
    reason = library_unavailable(FLASHMLA, q.device)
    if reason:
        return reason
    B, T, Hq, D = q.shape
    if q.dtype != torch.bfloat16:
        return f"FlashMLA takes bf16 (got {q.dtype})"
    if k.shape[2] != 1 or (indices.dim() == 4 and indices.shape[2] != 1):
        return f"FlashMLA's DSA kernel takes one shared KV head (got {k.shape[2]})"
    if v is not None:
        return "FlashMLA reads V from K (absorbed MLA / shared K = V), v must be None"
    if D not in KEY_CHANNELS:
        return f"FlashMLA takes {KEY_CHANNELS} key channels (got {D})"
    if (dv or D) != VALUE_CHANNELS:
        return f"FlashMLA writes {VALUE_CHANNELS} value channels (got {dv or D})"
    if Hq not in HEAD_COUNTS and (Hq > HEAD_COUNTS[0] or HEAD_COUNTS[0] % Hq):
        return f"FlashMLA takes {HEAD_COUNTS} query heads or a divisor of 64 (got {Hq})"
    if prefix_lengths is not None:
        return "prefix_lengths (generated prefix slots) has no library kernel"
    if B * k.shape[1] >= 2**31:
        return "B * S keys exceed the library kernels' int32 key ids"
    return None


def library_attention_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                                  indices: torch.Tensor, dv: int | None, *,
                                  prefix_lengths: torch.Tensor | None,
                                  deterministic: bool) -> str | None:
    """None when `library_attention` (FlashMLA's forward and cuDNN's backward) can run this
    call, else the reason it cannot."""
    return (library_unavailable(CUDNN, q.device)
            or flashmla_forward_unsupported(q, k, v, indices, dv, prefix_lengths=prefix_lengths)
            or cudnn_backward_unsupported(q.device, deterministic=deterministic))


def cudnn_backward_unsupported(device: torch.device, *, deterministic: bool) -> str | None:
    """None when cuDNN's SM90 sparse-attention backward can run on the inputs FlashMLA's
    forward accepted (`flashmla_forward_unsupported`), else the reason it cannot."""
    reason = library_unavailable(CUDNN, device)
    if reason:
        return reason
    if deterministic:
        return "cuDNN's SM90 sparse-attention backward has no deterministic mode"
    return None


def _padded_heads(Hq: int) -> int:
    return Hq if Hq in HEAD_COUNTS else HEAD_COUNTS[0]


class FlashMLAForward(NamedTuple):
    """FlashMLA's forward in the contract's layout, and what cuDNN's backward reads."""

    out: torch.Tensor  # [B, T, Hq, 512] (a view of the padded rows)
    lse: torch.Tensor  # fp32 [B, T, Hq], natural log, the sink included
    q_flat: torch.Tensor  # [B * T, Hp, D], the query heads zero-padded to Hp
    kv: torch.Tensor  # [B * S, 1, D]
    ids: torch.Tensor  # int32 [B * T, 1, K'] flat key ids, valid first, -1 after
    length: torch.Tensor  # int32 [B * T] valid slots a row
    out_flat: torch.Tensor  # [B * T, Hp, 512]
    lse_flat: torch.Tensor  # fp32 [B * T, Hp], FlashMLA's (without the sink)
    sink_p: torch.Tensor  # fp32 [Hp], -inf where none


def flashmla_forward(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, scale: float, *,
                     sink: torch.Tensor | None = None, hytopk_layout: bool = False
                     ) -> FlashMLAForward:
    """FlashMLA's SM90 sparse forward on inputs `flashmla_forward_unsupported` accepts (no
    autograd): rows flattened batch-major, key ids made global, each row's valid slots first
    with a length, query heads zero-padded to the kernels' 64. `hytopk_layout`: the caller
    vouches that every row lists its valid slots first and holds one (no layout or empty-row
    test, no host sync); otherwise a row without slots gets the contract's zeros and -inf."""
    B, T, Hq, D = q.shape
    S = k.shape[1]
    Hp = _padded_heads(Hq)
    rows = indices.reshape(B, T, indices.shape[-1])
    slots, length = valid_first(rows, known_valid_first=hytopk_layout)
    K = slots.shape[-1]
    if K % TOPK_ALIGNMENT:
        slots = torch.nn.functional.pad(slots, (0, round_up(K, TOPK_ALIGNMENT) - K), value=-1)
    ids = flat_key_ids(slots, S).reshape(B * T, 1, -1).contiguous()
    length = length.reshape(B * T).contiguous()
    q_flat = q.reshape(B * T, Hq, D)
    if Hp != Hq:
        q_flat = torch.nn.functional.pad(q_flat, (0, 0, 0, Hp - Hq))
    q_flat = q_flat.contiguous()
    kv = k.reshape(B * S, 1, D).contiguous()
    sink_p = torch.full((Hp,), float("-inf"), device=q.device, dtype=torch.float32)
    if sink is not None:
        sink_p[:Hq] = sink.float()
    out, _max_logits, lse = flash_mla_sparse_fwd()(q_flat, kv, ids, scale, d_v=VALUE_CHANNELS,
                                                   attn_sink=sink_p, topk_length=length)
    # FlashMLA's value for a row without slots is not the contract's. HyTopK's rows all hold a
    # slot (key 0 is visible to every row): no test, no host sync.
    empty = None if hytopk_layout else length == 0
    if empty is not None and bool(empty.any()):
        out = out.masked_fill(empty.view(-1, 1, 1), 0.0)
        lse = lse.masked_fill(empty.view(-1, 1), float("-inf"))
    full_lse = lse[:, :Hq] if sink is None else torch.logaddexp(lse[:, :Hq], sink_p[:Hq])
    return FlashMLAForward(out[:, :Hq].reshape(B, T, Hq, VALUE_CHANNELS),
                           full_lse.reshape(B, T, Hq).contiguous(), q_flat, kv, ids, length,
                           out, lse, sink_p)


class LibrarySparseAttention(torch.autograd.Function):
    """FlashMLA forward, cuDNN backward; inputs already checked by the unsupported test."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, scale: float,
                sink: torch.Tensor | None, hytopk_layout: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, Hq, D = q.shape
        fwd = flashmla_forward(q, k, indices, scale, sink=sink, hytopk_layout=hytopk_layout)
        ctx.save_for_backward(fwd.q_flat, fwd.kv, fwd.ids, fwd.length, fwd.out_flat,
                              fwd.lse_flat, fwd.sink_p)
        ctx.rows_all_hold_slots = hytopk_layout
        ctx.shape = (B, T, Hq, D, k.shape[1])
        ctx.scale = scale
        ctx.has_sink = sink is not None
        ctx.sink_dtype = None if sink is None else sink.dtype
        return fwd.out, fwd.lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):
        q_flat, kv, ids, length, out, lse, sink_p = ctx.saved_tensors
        B, T, Hq, D, S = ctx.shape
        Hp = q_flat.shape[1]
        dout = grad_out.reshape(B * T, Hq, VALUE_CHANNELS).to(out.dtype)
        if Hp != Hq:
            dout = torch.nn.functional.pad(dout, (0, 0, 0, Hp - Hq))
        rows = None if ctx.rows_all_hold_slots else torch.nonzero(length > 0).flatten()
        all_rows = rows is None or rows.numel() == B * T
        pick = (lambda x: x) if all_rows else (lambda x: x.index_select(0, rows).contiguous())
        if rows is not None and rows.numel() == 0:
            dq = torch.zeros_like(q_flat)
            dkv = torch.zeros_like(kv).reshape(B * S, D)
            dsink = torch.zeros_like(sink_p)
        else:
            grads = cudnn_dsa().sparse_attention_backward_wrapper(
                pick(q_flat), kv.reshape(B * S, D), pick(out), pick(dout.contiguous()),
                pick(lse), sink_p, pick(ids.reshape(B * T, -1)).clamp_min(0),
                softmax_scale=ctx.scale, topk_length=pick(length))
            dq_rows, dkv, dsink = grads["dq"], grads["dkv"], grads.get("d_sink")
            if all_rows:
                dq = dq_rows
            else:
                dq = torch.zeros_like(q_flat)
                dq.index_copy_(0, rows, dq_rows)
        dq = dq[:, :Hq].reshape(B, T, Hq, D)
        dk = dkv.reshape(B, S, 1, D)
        dsink_out = None
        if ctx.has_sink and dsink is not None:
            dsink_out = dsink[:Hq].to(ctx.sink_dtype)
        return dq, dk, None, None, dsink_out, None


def library_attention(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, scale: float, *,
                      sink: torch.Tensor | None = None, hytopk_layout: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, Hq, 512], lse [B, T, Hq]) of `ops.sparse_attention` on FlashMLA + cuDNN.

    q [B, T, Hq, 576 or 512] bf16, k [B, S, 1, same], indices [B, T, K] or [B, T, 1, K];
    sink [Hq] or None. `hytopk_layout`: the caller vouches that every row lists its valid
    slots first and holds at least one (HyTopK's causal output), which spares the layout and
    empty-row tests and their host syncs. Differentiable in q, k and sink.
    """
    return LibrarySparseAttention.apply(q, k, indices, scale, sink, hytopk_layout)

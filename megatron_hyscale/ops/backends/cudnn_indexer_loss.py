"""The sparse DSA indexer KL loss on cuDNN-frontend's SM90 kernels.

The path megatron-core's cudnn backend takes, under `ops.indexer_kl_loss`'s contract (sparse
form): the softmax of the indexer's scores over the selected slots
(`DSA.sparse_indexer_score_recompute`; a probability under 2^-126 counts as 2^-126), the
head-summed attention probabilities there as the target
(`DSA.sparse_attn_score_recompute`, from the attention's log-sum-exp), the KL in torch, and
the indexer gradients from `DSA.indexer_backward` in the same forward (the loss is linear in
its coefficient, so backward only scales them by the incoming gradient).
"""

from __future__ import annotations

import torch

from megatron_hyscale.ops.backends.availability import (
    CUDNN,
    FLASHMLA,
    cudnn_dsa,
    library_unavailable,
)
from megatron_hyscale.ops.backends.library_attention import (
    VALUE_CHANNELS,
    library_attention,
    library_attention_unsupported,
)
from megatron_hyscale.ops.backends.slots import (
    flat_key_ids,
    keys_off_default_positions,
    round_up,
    valid_first,
)
from megatron_hyscale.ops.reference import INDEXER_LOSS_EPS

# cuDNN's SM90 indexer backward runs heads in tiles of 64 (megatron pads with zero heads) and
# slots in blocks of BLOCK_I; one launch covers at most GRID_Y_ROWS query rows.
MIN_INDEXER_HEADS = 64
BLOCK_I = 128
GRID_Y_ROWS = 65535
CHUNK_ROWS = 32768
# The backward kernel gates each slot's gradient on a positive predicted probability; an
# underflowed softmax entry keeps its (predict - target) gradient at this floor (as megatron).
MIN_PROBABILITY = torch.finfo(torch.float32).tiny


def cudnn_indexer_loss_unsupported(q_index: torch.Tensor, weights: torch.Tensor,
                                   query: torch.Tensor, key: torch.Tensor, *, sparse: bool,
                                   relu: bool, kpos: torch.Tensor | None,
                                   attention_lse: torch.Tensor | None) -> str | None:
    """None when `cudnn_indexer_loss` can run this call, else the reason it cannot.

    kpos None: the keys sit at their default positions 0 .. S-1 (no test, no host sync).
    """
    reason = library_unavailable(CUDNN, q_index.device)
    if reason:
        return reason
    if not sparse:
        return "the dense warm-up loss (sparse=False) has no cuDNN SM90 path here"
    if not relu:
        return "cuDNN's DSA indexer always applies ReLU (relu=False)"
    if q_index.dtype != torch.bfloat16 or query.dtype != torch.bfloat16:
        return "cuDNN's DSA loss kernels take bf16 inputs"
    if weights.dtype != torch.bfloat16:
        return (f"cuDNN's indexer score kernel reads bf16 weights (got {weights.dtype}; "
                "rounding them would change the loss)")
    if key.shape[2] != 1:
        return f"cuDNN's DSA target kernel takes one shared KV head (got {key.shape[2]})"
    S = key.shape[1]
    if keys_off_default_positions(kpos, S):
        return "cuDNN's DSA kernels take keys at positions 0 .. S-1 (k_positions given)"
    if attention_lse is None:
        no_slots = torch.empty(0, 0, 0, dtype=torch.int32, device=query.device)
        reason = library_unavailable(FLASHMLA, q_index.device) or library_attention_unsupported(
            query, key, None, no_slots, VALUE_CHANNELS, prefix_lengths=None,
            deterministic=False)
        if reason:
            return f"no attention_lse and no FlashMLA forward to compute it: {reason}"
    return None


def _pad_dim(x: torch.Tensor, dim: int, size: int, value: float = 0.0) -> torch.Tensor:
    if x.shape[dim] >= size:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, size - x.shape[dim]]
    return torch.nn.functional.pad(x, pad, value=value)


class CudnnIndexerLoss(torch.autograd.Function):
    """Loss in forward with its indexer gradients; backward scales them."""

    @staticmethod
    def forward(ctx, q_index, weights, k_index, query, key, topk_indices, qpos, scale, coeff,
                per_token, tp_group, attention_lse, hytopk_layout):
        DSA = cudnn_dsa()
        B, T, H_I, _ = q_index.shape
        S = key.shape[1]
        Hq = query.shape[2]
        rows = topk_indices.reshape(B, T, -1)
        if hytopk_layout:  # visible and valid-first by construction
            slots, length = valid_first(rows, known_valid_first=True)
        else:
            visible = (rows >= 0) & (rows.long() <= qpos.unsqueeze(-1))
            slots, length = valid_first(torch.where(visible, rows, -1))
        K = slots.shape[-1]
        slot_valid = torch.arange(K, device=slots.device).view(1, 1, K) < length.unsqueeze(-1)

        # The kernel returns the softmax over each row's slots (not the logits).
        predict = DSA.sparse_indexer_score_recompute_wrapper(
            q_index.contiguous(), k_index.contiguous(), weights.contiguous(), slots,
            qhead_per_kv_head=H_I, topk_length=length)["predict"]
        predict = predict.masked_fill(~slot_valid, 0.0)
        log_predict = torch.log(predict.clamp_min(MIN_PROBABILITY)).masked_fill(~slot_valid, 0.0)

        if attention_lse is None:
            with torch.no_grad():
                _, attention_lse = library_attention(query, key, rows, scale,
                                                      hytopk_layout=hytopk_layout)
        Hp = max(Hq, MIN_INDEXER_HEADS)  # the target kernel's head tile, as the attention's
        q_attn = _pad_dim(query.detach(), 2, Hp).contiguous()
        lse = _pad_dim(attention_lse.detach().float(), 2, Hp, float("inf")).contiguous()
        target = DSA.sparse_attn_score_recompute_wrapper(
            q_attn, key.detach()[:, :, 0].contiguous(), lse, slots, scale,
            qhead_per_kv_head=Hp, topk_indices_global=False, topk_length=length)["target"]
        target = target.masked_fill(~slot_valid, 0.0)
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            torch.distributed.all_reduce(target, group=tp_group)
        target = target / target.sum(-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)
        kl = target * (torch.log(target.clamp_min(INDEXER_LOSS_EPS)) - log_predict)
        total = kl.sum(-1).sum()
        loss = (total if per_token else total / (B * T)) * coeff

        grad_coeff = coeff * (B * T) if per_token else coeff
        grads = _indexer_grads(DSA, q_index, weights, k_index, target, predict, slots,
                               slot_valid, S, grad_coeff)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dq, dw, dk = ctx.saved_tensors
        g = grad_loss.to(torch.float32)
        return ((dq * g).to(dq.dtype), (dw * g).to(dw.dtype), (dk * g).to(dk.dtype),
                None, None, None, None, None, None, None, None, None, None)


def _indexer_grads(DSA, q_index, weights, k_index, target, predict, slots, slot_valid, S,
                   coeff):
    """cuDNN's sparse indexer backward, in row chunks under CUDA's grid-y limit."""
    B, T, H_I, D_I = q_index.shape
    q_p = _pad_dim(q_index, 2, MIN_INDEXER_HEADS).contiguous()
    w_p = _pad_dim(weights, 2, MIN_INDEXER_HEADS).contiguous()
    K = slots.shape[-1]
    Kp = round_up(K, BLOCK_I)
    # Slots past a row's length go in as key -1 with zero predict and target: the kernel gates
    # them off (no gradient signal), zero-fills their K rows and skips their dK reduction.
    # megatron points them at key 0 instead, and every such slot then adds (zeros) into that
    # one key row with atomics: in a packed sequence of short documents, where most rows hold
    # fewer than top-k keys, that serialized the backward (BENCHMARKS.md, packed THD).
    ids = flat_key_ids(slots.masked_fill(~slot_valid, -1), S)
    attn = _pad_dim(target.contiguous(), 2, Kp)
    pred = _pad_dim(torch.where(slot_valid, predict.clamp_min(MIN_PROBABILITY), 0.0), 2, Kp)
    ids = _pad_dim(ids, 2, Kp, value=-1).contiguous()
    unit = torch.ones((), device=q_index.device, dtype=torch.float32)
    step = T if T <= GRID_Y_ROWS else CHUNK_ROWS
    dq = torch.empty_like(q_p)
    dw = torch.empty_like(w_p)
    dk = torch.zeros(k_index.shape, device=k_index.device, dtype=torch.float32)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        got = DSA.indexer_backward_wrapper(
            q_p[:, t0:t1].contiguous(), w_p[:, t0:t1].contiguous(), k_index.contiguous(),
            attn[:, t0:t1].contiguous(), pred[:, t0:t1].contiguous(), ids[:, t0:t1].contiguous(),
            grad_loss=unit, sm_scale=1.0, loss_coeff=coeff * (t1 - t0) / T, block_I=BLOCK_I,
            topk_indices_global=B > 1)
        dq[:, t0:t1] = got["d_index_q"]
        dw[:, t0:t1] = got["d_weights"]
        dk += got["d_index_k"].float()
    return dq[:, :, :H_I].contiguous(), dw[:, :, :H_I].contiguous(), dk.to(k_index.dtype)


def cudnn_indexer_loss(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor,
                       query: torch.Tensor, key: torch.Tensor, topk_indices: torch.Tensor,
                       softmax_scale: float, loss_coeff: float, *, qpos: torch.Tensor,
                       calculate_per_token_loss: bool = False,
                       tp_group: torch.distributed.ProcessGroup | None = None,
                       attention_lse: torch.Tensor | None = None,
                       hytopk_layout: bool = False) -> torch.Tensor:
    """`ops.indexer_kl_loss(sparse=True, relu=True)` on cuDNN's kernels (scope: the
    `_unsupported` check). q_index [B, T, H_I, 128] bf16, weights [B, T, H_I] bf16, k_index
    [B, S, 128], query [B, T, Hq, 576], key [B, S, 1, 576], topk_indices [B, T, K] (-1 padded;
    keys after a row's position are ignored; indices distinct within a row, as HyTopK's are:
    a repeated one would count twice here), attention_lse [B, T, Hq] or None (then
    FlashMLA's forward computes it). `hytopk_layout`: the caller vouches that the indices are
    HyTopK's for these rows (visible, valid slots first), sparing the layout test and its
    host sync. Differentiable in q_index, weights and k_index."""
    return CudnnIndexerLoss.apply(q_index, weights, k_index, query, key, topk_indices, qpos,
                                  softmax_scale, loss_coeff, calculate_per_token_loss, tp_group,
                                  attention_lse, hytopk_layout)

"""Sparse attention whose backward also runs the DSA indexer's sparse KL loss, its target taken
from the dQ kernel (`sparse_attention_bwd_with_target`) instead of a second gather pass.

The loss's target is the head-summed attention probability of each selected key, which the
backward's dQ kernel recomputes anyway; `attention_target` gathers the same key rows again for
it (the dominant part of the standalone loss). So here the attention's backward emits the
target, then runs the loss's row pass (KL, the index scores' log-sum-exp) and its backward;
given the index scores' log-sum-exp (the selection's: HyTopK scored the same slots), the row
pass gathers nothing (`normalize_target`).
The loss's value is known only then: the forward returns a zero-valued `anchor` that stands
for it in the graph (its gradient is the loss's gradient; scale and divide it as the loss
itself), and the backward hands the value to `on_loss`. Exactly the standalone
`indexer_kl_loss(..., attention_lse=lse)` where the indices are distinct and visible (the
target's slots are the attention's), to fp32 rounding of the target.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_hyscale.ops.kernels.indexer_loss import (
    fold_index_query,
    indexer_loss_bwd,
    indexer_loss_rows,
    indexer_loss_rows_bwd,
    loss_scaling,
    normalize_target,
)
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions, IndexerLossKernelOptions
from megatron_hyscale.ops.kernels.sparse_attention import (
    pad_head_dim,
    sparse_attention_bwd_with_target,
    sparse_attention_fwd,
)

LossReport = Callable[[torch.Tensor], None]


class SparseAttentionIndexerLossFunction(torch.autograd.Function):
    """Autograd wrapper: forward = the attention (out, lse) and a zero anchor; backward = the
    attention's gradients with the target, the loss rows, `on_loss(value)`, and the indexer's
    gradients from the anchor's."""

    @staticmethod
    def forward(ctx, q, k, v, indices, softmax_scale, dv, deterministic, options, q_index,
                weights, k_index, coeff, relu, tp_group, query_valid_rows, loss_options,
                on_loss, hytopk_layout, keys_ascending, index_lse):
        ctx.set_materialize_grads(False)
        out, lse = sparse_attention_fwd(q, k, v, indices, softmax_scale, dv=dv, options=options,
                                        hytopk_layout=hytopk_layout,
                                        keys_ascending=keys_ascending)
        ctx.save_for_backward(q, k, v, indices, out, lse, q_index, weights, k_index,
                              query_valid_rows, index_lse)
        ctx.softmax_scale, ctx.dv, ctx.deterministic, ctx.options = (softmax_scale, dv,
                                                                       deterministic, options)
        ctx.coeff, ctx.relu, ctx.tp_group = coeff, relu, tp_group
        ctx.loss_options, ctx.on_loss = loss_options, on_loss
        ctx.keys_ascending = keys_ascending
        # The loss backward's key passes need both: valid keys first, increasing.
        ctx.keys_in_order = bool(keys_ascending and hytopk_layout)
        anchor = torch.zeros((), device=q.device, dtype=torch.float32)
        return out, lse, anchor

    @staticmethod
    def backward(ctx, dout, dlse, danchor):
        (q, k, v, indices, out, lse, q_index, weights, k_index,
         query_valid_rows, index_lse) = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None:
            dlse = dlse.contiguous()  # read with lse's strides (see SparseAttentionFunction)
        dq, dk, dvv, _, target = sparse_attention_bwd_with_target(
            q, k, v, indices, ctx.softmax_scale, out, lse, dout, dlse=dlse, dv=ctx.dv,
            deterministic=ctx.deterministic, options=ctx.options,
            keys_ascending=ctx.keys_ascending)
        if query_valid_rows is not None:  # rows outside the mask have no valid slot
            target.masked_fill_(~query_valid_rows.unsqueeze(-1), -1.0)
        group = ctx.tp_group
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(target, group=group)  # the other ranks' query heads
        loss_indices = indices if indices.dim() == 3 else indices[:, :, 0]
        dqi = dw = dki = None
        index_args = (q_index, weights, k_index, loss_indices, target)
        opts = ctx.loss_options
        if danchor is not None and opts.fused_rows_bwd:
            kl, dqi, dw, dki = indexer_loss_rows_bwd(*index_args, danchor, ctx.coeff, ctx.relu,
                                                     ctx.deterministic, opts)
        elif danchor is not None and opts.kl_in_bwd:
            if index_lse is not None:  # the selection's: no gathered row pass
                psum = normalize_target(target, opts)
            else:
                _, index_lse, psum = indexer_loss_rows(*index_args, ctx.relu, opts,
                                                       with_kl=False)
            dqi, dw, dki, kl = indexer_loss_bwd(*index_args, index_lse, psum, danchor,
                                                ctx.coeff, ctx.relu, ctx.deterministic, opts,
                                                with_kl=True, keys_ascending=ctx.keys_in_order)
        else:
            kl, index_lse, psum = indexer_loss_rows(*index_args, ctx.relu, opts)
            if danchor is not None:
                dqi, dw, dki = indexer_loss_bwd(*index_args, index_lse, psum, danchor,
                                                ctx.coeff, ctx.relu, ctx.deterministic, opts,
                                                keys_ascending=ctx.keys_in_order)
        if ctx.on_loss is not None:
            ctx.on_loss((kl.sum() * ctx.coeff).detach())
        return (dq, dk, dvv, None, None, None, None, None, dqi, dw, dki) + (None,) * 9


def sparse_attention_indexer_loss_triton(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, indices: torch.Tensor,
        softmax_scale: float, *, q_index: torch.Tensor, weights: torch.Tensor,
        k_index: torch.Tensor, loss_coeff: float, relu: bool, dv: int | None = None,
        calculate_per_token_loss: bool = False, query_valid_rows: torch.Tensor | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None, deterministic: bool = False,
        options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT,
        loss_options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT,
        on_loss: LossReport | None = None, hytopk_layout: bool = False,
        keys_ascending: bool = False, index_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention (no sink or prefix) and the sparse indexer KL loss on validated inputs.

    q, k, v, indices, softmax_scale, dv, deterministic, options: as `sparse_attention_triton`
    (indices [B, T, K], or [B, T, 1, K] with one KV head: the target needs slots shared by every
    head). q_index [B, T, H_I, D_I], weights [B, T, H_I], k_index [B, S, D_I], loss_coeff,
    relu, calculate_per_token_loss, query_valid_rows (bool [B, T] or None), tp_group,
    loss_options: as `indexer_kl_loss_triton`; the indices must be distinct and visible to
    their rows (HyTopK's), so that the attention's slots are the loss's. hytopk_layout: as
    `sparse_attention_triton`'s (valid slots first and one at least a row); keys_ascending:
    as its (each row's valid keys increasing: the lockstep kernels skip their sort).
    index_lse: fp32 [B, T], each row's log-sum-exp of its index scores over its selected
    slots (`ops.indexer_loss.index_lse_from_scores` of the selection's scores): the backward
    skips the loss's gathered row pass (with the options' kl_in_bwd, fused_rows_bwd off).

    Returns (out, lse, anchor): anchor is an fp32 scalar equal to 0 that carries the loss's
    gradient to q_index, weights and k_index; on_loss(value) receives the loss (an fp32 device
    scalar, the same scaling as `indexer_kl_loss`'s result) during the backward.
    """
    B, T = q.shape[:2]
    coeff, count = loss_scaling(loss_coeff, max(B * T, 1), calculate_per_token_loss,
                                query_valid_rows)
    if not relu:
        q_index, weights = fold_index_query(q_index, weights)
    report = on_loss
    if count is not None and on_loss is not None:
        def report(value: torch.Tensor) -> None:
            on_loss(value / count)
    q, k, dv = pad_head_dim(q, k, v, dv)
    out, lse, anchor = SparseAttentionIndexerLossFunction.apply(
        q, k, v, indices, float(softmax_scale), dv, bool(deterministic), options, q_index,
        weights, k_index, coeff, bool(relu), tp_group, query_valid_rows, loss_options, report,
        bool(hytopk_layout), bool(keys_ascending),
        None if index_lse is None else index_lse.detach().float().contiguous())
    return out, lse, anchor if count is None else anchor / count

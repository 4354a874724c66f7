"""Sparse attention and the DSA indexer's sparse KL loss in one op, the loss's target from the
attention backward's dQ kernel (no second gather of the selected keys for it).

The same values and gradients as `sparse_attention(..., return_lse=True)` followed by
`indexer_kl_loss(..., sparse=True, attention_lse=lse)` where the indices are distinct and
visible to their rows (HyTopK's output), to fp32 rounding of the target; but the loss is
computed in the backward: the op returns a zero-valued anchor standing for it in the graph
(scale or divide it as the loss; its gradient drives the indexer's) and hands the loss's value
to `on_loss` when the backward runs. HyScale's Triton kernels only (CUDA, or Triton's
interpreter on CPU; the forward on FlashMLA where `backend` picks it); no sink, no dense
prefix, indices shared by every KV head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron_hyscale.ops.backends import dispatch, measured
from megatron_hyscale.ops.backends.dispatch import LIBRARY_BACKENDS
from megatron_hyscale.ops.checks import (
    check_backend,
    check_bool,
    check_options,
    check_triton_device,
)
from megatron_hyscale.ops.indexer_loss import (
    check_index_lse,
    normalize_valid_rows,
    validate_indexer_loss_inputs,
)
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions, IndexerLossKernelOptions
from megatron_hyscale.ops.sparse_attention import validate_sparse_attention_inputs


def sparse_attention_indexer_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    q_index: torch.Tensor,
    weights: torch.Tensor,
    k_index: torch.Tensor,
    loss_coeff: float,
    relu: bool = True,
    dv: int | None = None,
    calculate_per_token_loss: bool = False,
    query_valid_rows: torch.Tensor | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    deterministic: bool = False,
    options: AttentionKernelOptions | None = None,
    loss_options: IndexerLossKernelOptions | None = None,
    on_loss: Callable[[torch.Tensor], None] | None = None,
    check_values: bool = True,
    backend: str = "auto",
    hytopk_layout: bool = False,
    keys_ascending: bool = False,
    index_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention whose backward also runs the sparse indexer KL loss.

    Args:
        query, key, value, indices, softmax_scale, dv, deterministic, options: as
            `ops.sparse_attention` (indices [B, T, K], or [B, T, Hkv, K] with one KV head).
        q_index, weights, k_index, loss_coeff, relu, calculate_per_token_loss,
            query_valid_rows, tp_group, loss_options: as `ops.indexer_kl_loss` (sparse).
        on_loss: called once per backward with the loss (fp32 device scalar, the value
            `indexer_kl_loss` would return).
        check_values: also check index ranges and distinctness (a device sync).
        backend: "auto" or "triton": HyScale's kernels. "cudnn" / "best": the forward may run
            on FlashMLA (where it can; "best" where measured faster, `ops.sparse_attention`),
            the backward is always HyScale's, which emits the target.
        hytopk_layout: as `ops.sparse_attention`'s (each row's valid slots first, one at
            least: spares FlashMLA's forward its layout test and host syncs). With
            keys_ascending, the loss backward may run in key passes
            (`IndexerLossKernelOptions.bwd_key_passes`), whose results rely on it.
        keys_ascending: as `ops.sparse_attention`'s (each row's valid indices increase: the
            lockstep kernels skip their sort; the loss backward's key passes, with
            hytopk_layout).
        index_lse: None, or [B, T] each row's natural log-sum-exp of its index scores over the
            selected slots, from the selection that chose `indices` on these q_index, weights
            and k_index (`ops.indexer_loss.index_lse_from_scores` of `ops.hytopk`'s scores,
            bf16 precision): the backward then skips the loss's gathered row pass
            (`IndexerLossKernelOptions.kl_in_bwd`, the default; ignored with fused_rows_bwd or
            without kl_in_bwd). The loss's own scores may differ from the selection's by fp32
            rounding (another summation order): the loss and gradients agree to that rounding.

    Returns:
        (out, lse, anchor): the attention's output and log-sum-exp, and an fp32 scalar equal to
        0 that carries the loss's gradient to q_index, weights and k_index.
    """
    for name, flag in (("relu", relu), ("calculate_per_token_loss", calculate_per_token_loss),
                       ("deterministic", deterministic), ("check_values", check_values),
                       ("hytopk_layout", hytopk_layout), ("keys_ascending", keys_ascending)):
        check_bool(name, flag)
    check_backend(backend, ("auto", "triton", *LIBRARY_BACKENDS))
    options = check_options("options", options, AttentionKernelOptions)
    loss_options = check_options("loss_options", loss_options, IndexerLossKernelOptions)
    if on_loss is not None and not callable(on_loss):
        raise ValueError(f"on_loss must be callable or None, got {type(on_loss).__name__}")
    if indices.dim() == 4 and indices.shape[2] != 1:
        raise ValueError("sparse_attention_indexer_loss: indices must be shared by the KV "
                         f"heads ([B, T, K] or [B, T, 1, K]), got {tuple(indices.shape)}")
    scale, dv = validate_sparse_attention_inputs(query, key, value, indices, softmax_scale, dv,
                                                 None, check_values=check_values)
    _, coeff, _, _ = validate_indexer_loss_inputs(
        q_index, weights, k_index, query, key, indices.flatten(2) if indices.dim() == 4
        else indices, scale, loss_coeff, True, None, None, check_values)
    valid_rows = normalize_valid_rows(query_valid_rows, q_index)
    check_index_lse(index_lse, q_index)
    check_triton_device("triton", query)
    if backend in LIBRARY_BACKENDS and dispatch.attention_plan(
            query, key, value, indices, backend=backend, dv=dv, sink=None,
            deterministic=deterministic, prefix_lengths=None,
            library_backward=False) == measured.FLASHMLA_FORWARD:
        options = dataclasses.replace(options, fwd_flashmla=True)

    from megatron_hyscale.ops.kernels.attention_indexer_loss import (
        sparse_attention_indexer_loss_triton,
    )

    return sparse_attention_indexer_loss_triton(
        query, key, value, indices, scale, q_index=q_index, weights=weights, k_index=k_index,
        loss_coeff=coeff, relu=relu, dv=dv, calculate_per_token_loss=calculate_per_token_loss,
        query_valid_rows=valid_rows, tp_group=tp_group, deterministic=deterministic,
        options=options, loss_options=loss_options, on_loss=on_loss,
        hytopk_layout=hytopk_layout, keys_ascending=keys_ascending, index_lse=index_lse)

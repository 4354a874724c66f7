"""The DSA lightning indexer's KL loss, without a [T, S] score table.

Same value and gradients as megatron-core 0.19.2's `compute_dsa_indexer_loss` /
`FusedDSAIndexerLoss` as DSAttention calls them on a causal mask:

    index score  I[t, s] = sum_j w[t, j] * act(q_index[t, j] . k_index[s])       (fp32)
    target       P[t, s] = normalize_L1( sum_h softmax_s(scale * query[t, h] . key[s, h // G]) )
    loss         = loss_coeff * sum_t KL(P[t] || softmax(I[t])) / (B * T)

with every softmax restricted to the keys visible to t (k_pos <= q_pos unless causal=False,
and where an explicit mask `visible` allows) and, when `sparse`, further to the row's selected
keys. The target is detached (the indexer learns from the main attention, never the reverse),
so gradients reach only q_index, weights and k_index.

Triton kernels: `kernels/indexer_loss.py` (sparse) and `kernels/indexer_loss_dense.py` (dense
warm-up: per-row statistics, then one streaming pass for the KL and the gradients).
"""

from __future__ import annotations

import math

import torch

from megatron_hyscale.ops import reference
from megatron_hyscale.ops.backends import dispatch
from megatron_hyscale.ops.backends.dispatch import BACKEND_CHOICES, LIBRARY_BACKENDS
from megatron_hyscale.ops.checks import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_backend,
    check_bool,
    check_distinct_indices,
    check_finite,
    check_index_range,
    check_options,
    check_same_device,
    check_softmax_scale,
    check_tensor,
    check_triton_device,
    normalize_positions,
    normalize_visible,
    triton_interpret,
    warn_once,
)
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions


def validate_indexer_loss_inputs(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    k_index: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    topk_indices: torch.Tensor | None,
    softmax_scale: float,
    loss_coeff: float,
    sparse: bool,
    q_positions: torch.Tensor | None,
    k_positions: torch.Tensor | None,
    check_values: bool = True,
) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """Check everything (values only when `check_values`); return (softmax_scale, loss_coeff,
    [B, T] and [B, S] int64 positions)."""
    check_tensor("q_index", q_index, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("weights", weights, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_index", k_index, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("query", query, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("key", key, ndim=4, dtypes=FLOAT_DTYPES)
    B, T, H, D = q_index.shape
    if tuple(weights.shape) != (B, T, H):
        raise ValueError(f"weights must be [B={B}, T={T}, H_I={H}], got {tuple(weights.shape)}")
    if k_index.shape[0] != B or k_index.shape[2] != D:
        raise ValueError(f"k_index must be [B={B}, S, D_I={D}], got {tuple(k_index.shape)}")
    if k_index.dtype != q_index.dtype:
        raise ValueError(f"k_index dtype {k_index.dtype} must match q_index dtype {q_index.dtype}")
    S = k_index.shape[1]
    if tuple(query.shape[:2]) != (B, T):
        raise ValueError(f"query must be [B={B}, T={T}, Hq, Dqk], got {tuple(query.shape)}")
    Hq, Dqk = query.shape[2], query.shape[3]
    if tuple(key.shape[:2]) != (B, S) or key.shape[3] != Dqk:
        raise ValueError(f"key must be [B={B}, S={S}, Hkv, Dqk={Dqk}], got {tuple(key.shape)}")
    if key.shape[2] == 0 or Hq % key.shape[2] != 0:
        raise ValueError(f"key has {key.shape[2]} heads, which must divide query's {Hq} heads")
    if key.dtype != query.dtype:
        raise ValueError(f"key dtype {key.dtype} must match query dtype {query.dtype}")
    check_bool("sparse", sparse)
    if topk_indices is None:
        if sparse:
            raise ValueError("topk_indices is required when sparse=True")
    else:
        check_tensor("topk_indices", topk_indices, ndim=3, dtypes=INT_DTYPES)
        if tuple(topk_indices.shape[:2]) != (B, T):
            raise ValueError(f"topk_indices must be [B={B}, T={T}, K], got "
                             f"{tuple(topk_indices.shape)}")
    scale = check_softmax_scale(softmax_scale)
    if isinstance(loss_coeff, bool) or not isinstance(loss_coeff, (int, float)) or not (
        math.isfinite(loss_coeff)
    ):
        raise ValueError(f"loss_coeff must be a finite number, got {loss_coeff!r}")
    check_same_device(q_index=q_index, weights=weights, k_index=k_index, query=query, key=key,
                      topk_indices=topk_indices)
    if check_values:
        if topk_indices is not None:
            check_index_range("topk_indices", topk_indices, S)
        for name, x in (("q_index", q_index), ("weights", weights), ("k_index", k_index),
                        ("query", query), ("key", key)):
            check_finite(name, x)
    qpos = normalize_positions("q_positions", q_positions, B, T, S - T, q_index.device)
    kpos = normalize_positions("k_positions", k_positions, B, S, 0, q_index.device)
    return scale, float(loss_coeff), qpos, kpos


def indexer_kl_loss(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    k_index: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    topk_indices: torch.Tensor | None,
    softmax_scale: float,
    loss_coeff: float,
    *,
    sparse: bool,
    relu: bool = True,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    causal: bool = True,
    visible: torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
    tp_group: torch.distributed.ProcessGroup | None = None,
    deterministic: bool = False,
    attention_lse: torch.Tensor | None = None,
    backend: str = "auto",
    options: IndexerLossKernelOptions | None = None,
    check_values: bool = True,
    hytopk_layout: bool = False,
    query_valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(main-attention target || indexer distribution), megatron-core's DSA indexer loss.

    Args:
        q_index: [B, T, H_I, D_I] indexer queries.
        weights: [B, T, H_I] indexer head weights.
        k_index: [B, S, D_I] indexer keys (same dtype as q_index).
        query: [B, T, Hq, Dqk] main-attention queries (absorbed form for MLA); detached.
        key: [B, S, Hkv, Dqk] main-attention keys, Hkv dividing Hq (key head h // (Hq / Hkv)
            serves query head h); detached.
        topk_indices: [B, T, K] int32/int64 selected keys, -1 padded; used only when sparse
            (None allowed when dense). Selected keys that are not visible are ignored, and a
            repeated index counts once, as in megatron.
        softmax_scale: > 0, the main attention's scale.
        loss_coeff: multiplies the loss.
        sparse: False = dense warm-up (softmax over all visible keys), True = restricted to the
            selected visible keys.
        relu: ReLU on each indexer head's logit (megatron's dsa_indexer_scoring_relu).
        q_positions, k_positions: [T] / [S] or [B, T] / [B, S] integer positions; key s is
            visible to row t iff k_positions[s] <= q_positions[t]. Defaults arange(S) and
            arange(T) + (S - T).
        causal: False: the positions hide no key (as hytopk's causal=False).
        visible: bool [T, S], [1, T, S] or [B, T, S], or None: an explicit key mask, True
            where row t may see key s, on top of the position rule (megatron's attention_mask
            with attn_mask_type=None, negated; a row that sees no key adds 0 and still counts
            in the mean, as there). The plain-torch reference runs it (row chunks): backend
            "auto", "best" and "reference" take it, "triton" and "cudnn" raise ValueError.
            Not needed for a sparse loss over a selection that already honours the mask.
        calculate_per_token_loss: return the KL sum over rows instead of its mean over the
            B * T rows.
        tp_group: tensor-parallel group holding the other query heads: the head-summed target
            is all-reduced over it when its size > 1 (also when backward recomputes a chunk,
            so every rank must call this with the same shapes). The dense loss's Triton
            kernel holds no [T, S] target to all-reduce: a split dense call runs the reference.
        deterministic: Triton backward without fp32 atomics for k_index's gradient (bitwise
            repeatable; one extra backward pass, for the dense loss one extra pass of its
            loss kernel). The reference is always deterministic.
        attention_lse: fp32 [B, T, Hq] or None, sparse only: the main attention's log-sum-exp
            (`sparse_attention(query, key, ..., topk_indices, softmax_scale, return_lse=True)`
            without sink or prefix). The target's per-head softmax then takes it as its
            denominator instead of a pass of its own over the keys. Valid only when the
            attention ran over exactly the loss's slots: topk_indices distinct and visible
            (HyTopK's output is); detached.
        backend: "auto" (Triton on CUDA tensors, the reference elsewhere and for the dense
            loss with a tp_group of size > 1, said once), "triton" (sparse, or dense without
            a tp split and without `visible`, else ValueError; CPU tensors need
            TRITON_INTERPRET=1, else ValueError),
            "reference", "cudnn" (cuDNN-frontend's sparse indexer-score / target recompute
            and indexer backward, the stock cudnn backend's kernels; sparse, ReLU, bf16
            inputs and weights, one KV head, keys at 0 .. S-1, distinct indices, not
            deterministic; elsewhere one warning names why and the Triton kernel runs) or
            "best" (whichever was measured faster for this shape, said once; the library only
            with attention_lse, whose slots are known distinct).
        options: the Triton kernels' tilings (`IndexerLossKernelOptions`; None: its DEFAULT),
            forward and backward; the reference ignores it.
        check_values: True (default) checks the values (a host sync each): finite inputs,
            topk_indices in [-1, S) and, where the call relies on distinct indices
            (attention_lse given, or backend="cudnn", whose kernels count a repeated index
            twice), that no row lists a key twice (a sort on their device; ValueError naming
            the first such row and key; elsewhere a repeated index is legal and counts once,
            as in megatron). False trusts the caller and syncs nothing (the layers pass
            False). Shapes, dtypes and devices are always checked.
        hytopk_layout: topk_indices are HyTopK's causal output for these rows (visible,
            valid slots first), so the library kernels skip their visibility mask and layout
            test, and the host sync it costs (the DSA layer passes True).
        query_valid_rows: bool [T] or [B, T] (or [1, T]), or None: the rows that take part
            (megatron's query_valid_rows, from a packed batch's real_token_mask_q). The others
            add nothing to the loss and get zero gradient, and the mean is over the valid
            rows (at least 1) instead of B * T (a device sum: no host sync). The library
            kernels take no row mask: with one, "cudnn" warns once and "best" says once that
            HyScale's kernel runs.

    Returns:
        fp32 scalar loss, differentiable in q_index, weights and k_index only.
    """
    check_backend(backend, BACKEND_CHOICES)
    options = check_options("options", options, IndexerLossKernelOptions)
    for name, flag in (("relu", relu), ("calculate_per_token_loss", calculate_per_token_loss),
                       ("deterministic", deterministic), ("check_values", check_values),
                       ("hytopk_layout", hytopk_layout), ("causal", causal)):
        check_bool(name, flag)
    scale, coeff, qpos, kpos = validate_indexer_loss_inputs(
        q_index, weights, k_index, query, key, topk_indices, softmax_scale, loss_coeff, sparse,
        q_positions, k_positions, check_values,
    )
    if not causal and kpos.shape[1] > 0:
        # Every row at the last key's position sees every key: each backend reads positions.
        qpos = kpos.amax(dim=1, keepdim=True).expand_as(qpos)
    visible = normalize_visible("visible", visible, q_index.shape[0], q_index.shape[1],
                                k_index.shape[1], q_index.device)
    if visible is not None:
        if backend in ("triton", "cudnn"):
            raise ValueError(f"indexer_kl_loss: visible (an explicit key mask) runs on the "
                             f"plain-torch reference; backend={backend!r} cannot take it: use "
                             "'auto' or 'reference'")
        backend = "reference"
    valid_rows = normalize_valid_rows(query_valid_rows, q_index)
    if attention_lse is not None:
        if not sparse:
            raise ValueError("indexer_kl_loss: attention_lse needs sparse=True (the dense loss "
                             "normalizes over every visible key, not the selected ones)")
        check_tensor("attention_lse", attention_lse, dtypes=(torch.float32,), ndim=3)
        check_same_device(q_index=q_index, attention_lse=attention_lse)
        if tuple(attention_lse.shape) != tuple(query.shape[:3]):
            raise ValueError(f"indexer_kl_loss: attention_lse must be [B, T, Hq] = "
                             f"{tuple(query.shape[:3])}, got {tuple(attention_lse.shape)}")
        attention_lse = attention_lse.detach()
    if check_values and sparse and (attention_lse is not None or backend == "cudnn"):
        check_distinct_indices("topk_indices", topk_indices, ("batch", "row"))
    if backend in LIBRARY_BACKENDS:
        got = dispatch.indexer_loss(
            q_index, weights, k_index, query, key, topk_indices, scale, coeff, backend=backend,
            sparse=sparse, relu=relu, qpos=qpos, kpos=None if k_positions is None else kpos,
            per_token=calculate_per_token_loss, tp_group=tp_group, attention_lse=attention_lse,
            deterministic=deterministic, hytopk_layout=hytopk_layout,
            row_mask=valid_rows is not None)
        if got is not None:
            return got
        backend = "auto"
    # The dense kernel streams the target per row: another rank's heads cannot join it.
    tp_split = (not sparse and tp_group is not None
                and torch.distributed.get_world_size(tp_group) > 1)
    if backend == "triton" and tp_split:
        raise ValueError("indexer_kl_loss: backend='triton' cannot take the dense warm-up loss "
                         "(sparse=False) with a tp_group of size > 1 (the other ranks' heads "
                         "would need a [T, S] exchange of the target); use backend='reference' "
                         "or 'auto'")
    check_triton_device(backend, q_index)
    auto_triton = backend == "auto" and q_index.is_cuda and not tp_split
    if (backend == "triton" or auto_triton) and not sparse:
        from megatron_hyscale.ops.kernels.indexer_loss_dense import dense_indexer_kl_loss_triton

        return dense_indexer_kl_loss_triton(
            q_index, weights, k_index, query, key, scale, coeff, relu=relu, q_positions=qpos,
            k_positions=kpos, calculate_per_token_loss=calculate_per_token_loss,
            deterministic=deterministic, options=options, query_valid_rows=valid_rows,
        )
    if backend == "triton" or auto_triton:
        from megatron_hyscale.ops.kernels.indexer_loss import indexer_kl_loss_triton

        return indexer_kl_loss_triton(
            q_index, weights, k_index, query, key, topk_indices, scale, coeff, relu=relu,
            q_positions=qpos, k_positions=kpos,
            calculate_per_token_loss=calculate_per_token_loss, tp_group=tp_group,
            deterministic=deterministic, attention_lse=attention_lse, options=options,
            query_valid_rows=valid_rows,
        )
    if backend == "auto" and q_index.is_cuda and tp_split:
        warn_once("indexer-loss-dense-tp", "indexer_kl_loss: the dense warm-up loss "
                  "(sparse=False) with a tp_group of size > 1 uses the plain-torch reference "
                  "(slow, memory-bounded): the Triton kernel would need the other ranks' "
                  "heads' [T, S] target")
    return reference.indexer_loss_reference(
        q_index, weights, k_index, query, key, topk_indices, scale, coeff, sparse=sparse,
        relu=relu, q_positions=qpos, k_positions=kpos,
        calculate_per_token_loss=calculate_per_token_loss, tp_group=tp_group,
        attention_lse=attention_lse, query_valid_rows=valid_rows, visible=visible,
    )


def normalize_valid_rows(query_valid_rows: torch.Tensor | None,
                         q_index: torch.Tensor) -> torch.Tensor | None:
    """query_valid_rows checked (bool [T], [1, T] or [B, T], q_index's device) and expanded to
    [B, T]; None stays None."""
    if query_valid_rows is None:
        return None
    B, T = q_index.shape[:2]
    check_tensor("query_valid_rows", query_valid_rows, ndim=(1, 2), dtypes=(torch.bool,))
    check_same_device(q_index=q_index, query_valid_rows=query_valid_rows)
    if query_valid_rows.dim() == 1:
        query_valid_rows = query_valid_rows.unsqueeze(0)
    if query_valid_rows.shape[1] != T or query_valid_rows.shape[0] not in (1, B):
        raise ValueError(f"query_valid_rows must be [T={T}], [1, T] or [B={B}, T], got "
                         f"{tuple(query_valid_rows.shape)}")
    return query_valid_rows.expand(B, T)


def index_lse_from_scores(scores: torch.Tensor, block_n: int | None = None) -> torch.Tensor:
    """Each row's natural log-sum-exp of its selected index scores (`ops.hytopk`'s scores
    [B, T, K], -inf at unused slots): fp32 [B, T], 0 for a row without a selected key (as the
    loss's row pass has it). Handed to `sparse_attention_indexer_loss(index_lse=...)`, it
    spares the loss the gathered pass that scores the same slots again. On CUDA (or under
    Triton's interpreter) one Triton read of the scores (`kernels.indexer_loss.
    selected_scores_lse`, tiles of block_n slots if given), else torch's logsumexp."""
    check_tensor("scores", scores, ndim=3)
    if scores.is_cuda or triton_interpret():
        from megatron_hyscale.ops.kernels.indexer_loss import selected_scores_lse

        return selected_scores_lse(scores, block_n)
    lse = torch.logsumexp(scores.float(), dim=-1)
    return torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)


def check_index_lse(index_lse: torch.Tensor | None, q_index: torch.Tensor) -> None:
    """index_lse None, or an fp32 [B, T] tensor on q_index's device (B, T its first dims)."""
    if index_lse is None:
        return
    check_tensor("index_lse", index_lse, ndim=2, dtypes=(torch.float32,))
    check_same_device(q_index=q_index, index_lse=index_lse)
    if tuple(index_lse.shape) != tuple(q_index.shape[:2]):
        raise ValueError(f"index_lse must be [B, T] = {tuple(q_index.shape[:2])} (q_index's "
                         f"first dims), got {tuple(index_lse.shape)}")

"""Plain-torch references that define what the fast kernels must compute.

They are exact (fp32 arithmetic, a total order for ties) and bounded in memory: query rows
are processed in chunks so that no [T, S] tensor is ever built for the whole sequence.
"""

from __future__ import annotations

from functools import partial

import torch

# Elements of fp32 work per query-row chunk (about 256 MiB): keeps long-context runs bounded.
CHUNK_ELEMENTS = 1 << 26
# On a CPU, cache-sized chunks are faster (fewer page faults on fresh buffers) and keep a 32K-token
# run well under 1 GiB; the CPU budget is min(CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS).
CPU_CHUNK_ELEMENTS = 1 << 22
_LOW32 = 0xFFFFFFFF


def rows_per_chunk(
    per_row_elements: int, budget: int | None = None, device: torch.device | None = None
) -> int:
    """Query rows per chunk so that one chunk holds about `budget` elements of work.

    The budget is read from CHUNK_ELEMENTS (and CPU_CHUNK_ELEMENTS for CPU tensors) at call
    time, not bound at import, so tests can shrink it to check that results do not depend on
    the chunking.
    """
    if budget is None:
        budget = CHUNK_ELEMENTS
        if device is not None and device.type == "cpu":
            budget = min(budget, CPU_CHUNK_ELEMENTS)
    return max(1, budget // max(1, per_row_elements))


def indexer_scores(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, relu: bool
) -> torch.Tensor:
    """fp32 scores [B, t, S] = sum_h w[b,t,h] * act(q[b,t,h] . k[b,s]) for one row chunk."""
    logits = torch.einsum("bthd,bsd->bths", q.float(), k.float())
    if relu:
        logits = logits.relu()
    return (logits * weights.float().unsqueeze(-1)).sum(dim=2)


def order_key(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is (score descending, index ascending) along the last dim.

    High 32 bits: the fp32 score mapped to an order-preserving int32 (-0.0 folded into +0.0);
    low 32 bits: ~index, so among equal scores the smaller index has the larger key.
    """
    bits = (scores + 0.0).view(torch.int32)  # x + 0.0 turns -0.0 into +0.0
    # In-place steps: on a CPU each fresh full-size buffer costs as much as the op itself.
    ordered = (bits >> 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return ordered.to(torch.int64).bitwise_left_shift_(32).bitwise_or_(_LOW32 - index)


def hytopk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    relu: bool,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    causal: bool,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference HyTopK on validated inputs; positions are int64 [B, T] and [B, S]; visible
    bool [B or 1, T, S] or None: an explicit mask on top of the position rule (when causal)."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    kk = min(topk, S)
    indices = torch.full((B, T, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((B, T, topk), float("-inf"), dtype=torch.float32, device=q.device)
    step = rows_per_chunk(B * H * S, device=q.device)
    slot = torch.arange(kk, device=q.device)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        # Keys past the last one visible to any row of the chunk cannot be selected: skip them
        # (halves the causal work). Exact for any positions, sorted or not.
        n_cols = S
        if causal:
            reach = k_positions <= q_positions[:, t0:t1].amax(dim=1, keepdim=True)  # [B, S]
            seen = reach.any(dim=0).nonzero()
            if seen.numel() == 0:
                continue  # no key visible to any row: the -1 / -inf fill stands
            n_cols = int(seen[-1]) + 1
        kc = min(kk, n_cols)
        s = indexer_scores(q[:, t0:t1], k[:, :n_cols], weights[:, t0:t1], relu)  # [B, t, n]
        key = order_key(s)
        allowed = None  # [B or 1, t, n] the keys the rows may select; None: all of them
        if causal:
            allowed = k_positions[:, None, :n_cols] <= q_positions[:, t0:t1, None]
        if visible is not None:
            mask = visible[:, t0:t1, :n_cols]
            allowed = mask if allowed is None else allowed & mask
        if allowed is not None:
            # Masked keys sort below every score; the count keeps them out of the output.
            key.masked_fill_(~allowed, torch.iinfo(torch.int64).min)
            n_visible = allowed.sum(-1, keepdim=True)
        else:
            n_visible = torch.full((B, t1 - t0, 1), S, device=q.device)
        top = key.topk(kc, dim=-1).values
        keep = slot[:kc] < n_visible
        idx = torch.where(keep, _LOW32 - (top & _LOW32), 0)
        chunk_scores = s.gather(-1, idx).masked_fill(~keep, float("-inf"))
        indices[:, t0:t1, :kc] = torch.where(keep, idx, -1).to(torch.int32)
        scores[:, t0:t1, :kc] = chunk_scores + 0.0
    return indices, scores


# ---------------------------------------------------------------------------------------------
# Sparse attention over selected indices
# ---------------------------------------------------------------------------------------------

INDEXER_LOSS_EPS = 1e-10  # megatron-core's INDEXER_LOSS_EPS: the clamp in every normalization


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fp32_accumulating(x: torch.Tensor | None) -> torch.Tensor | None:
    """x upcast once to fp32 when autograd will add gradient parts into it; else x itself.

    A tensor every chunk reads (keys, values, sink), or one a chunk gathers rows of (a key
    chosen by many queries), receives its gradient as a sum of many parts. Autograd adds them
    in the tensor's dtype: for bf16 keys, hundreds of bf16 roundings per key (an isolated
    1024-token test: cosine 0.999876 to fp32). Reading an fp32 copy makes every part fp32,
    summed in fp32, and the copy's backward casts the total to x's dtype once. Exact in the
    forward: each chunk computes in fp32 anyway.
    """
    if x is None or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    if x.dtype not in (torch.bfloat16, torch.float16):
        return x
    return x.float()


def _run_chunk(fn, needs_grad: bool, *args):
    # Non-reentrant checkpoint keeps only the chunk's inputs (views of the full tensors) for
    # backward and recomputes the chunk's [rows, keys] work there, so backward memory is as
    # bounded as forward memory.
    if needs_grad:
        # No RNG is drawn inside a chunk, so there is no RNG state to stash and restore.
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 preserve_rng_state=False)
    return fn(*args)


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B*S*H, D]; row (b*S + s)*H + h. A view when x is contiguous."""
    return x.reshape(-1, x.shape[-1])


def _sparse_attention_chunk(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor | None,
    indices: torch.Tensor,
    sink: torch.Tensor | None,
    S: int,
    dv: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of query rows: q [B, t, Hq, D], indices [B, t, Hkv, K] -> out, lse."""
    B, t, Hq, D = q.shape
    Hkv, K = indices.shape[2], indices.shape[3]
    G = Hq // Hkv
    valid = indices >= 0
    b_off = torch.arange(B, device=q.device).view(B, 1, 1, 1) * (S * Hkv)
    h_off = torch.arange(Hkv, device=q.device).view(1, 1, Hkv, 1)
    rows = (b_off + indices.clamp_min(0).long() * Hkv + h_off).reshape(-1)
    k_sel = k_flat.index_select(0, rows).view(B, t, Hkv, K, D)
    if v_flat is None:
        v_sel = k_sel[..., :dv]  # V is the first dv channels of K (absorbed MLA / shared KV)
    else:
        v_sel = v_flat.index_select(0, rows).view(B, t, Hkv, K, dv)
    qg = q.float().reshape(B, t, Hkv, G, D)  # query head h = kv * G + g reads KV head kv
    logits = torch.einsum("btkgd,btkjd->btkgj", qg, k_sel.float()) * softmax_scale
    logits = logits.masked_fill(~valid.unsqueeze(3), float("-inf"))
    sink_g = None if sink is None else sink.float().view(Hkv, G)
    with torch.no_grad():  # any finite shift gives the same softmax; detaching it is exact
        m = logits.amax(dim=-1)
        if sink_g is not None:
            m = torch.maximum(m, sink_g)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m.unsqueeze(-1))  # exactly 0 (and 0 gradient) at -1 slots
    denom = p.sum(dim=-1)
    if sink_g is not None:
        denom = denom + torch.exp(sink_g - m)
    nonempty = denom > 0
    # A row with no valid index and no sink has denom 0: divide by 1 instead so the output and
    # every gradient stay 0 rather than NaN (where() alone would still backprop 0/0).
    safe = torch.where(nonempty, denom, torch.ones_like(denom))
    out = torch.einsum("btkgj,btkjd->btkgd", p, v_sel.float()) / safe.unsqueeze(-1)
    lse = torch.where(nonempty, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return out.reshape(B, t, Hq, dv).to(q.dtype), lse.reshape(B, t, Hq)


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    dv: int | None = None,
    sink: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse attention on validated inputs (see ops.sparse_attention for the contract).

    Args:
        q: [B, T, Hq, Dqk]; k: [B, S, Hkv, Dqk]; v: [B, S, Hkv, Dv] or None (V = K[..., :dv]).
        indices: [B, T, Hkv, K] or [B, T, K] integer, -1 ignored (assumed distinct per row:
            a repeated index would be counted twice).
        sink: [Hq] logits that join each softmax denominator only.
        prefix_lengths: int [B, T] or None; row t also attends to keys 0 .. n_t - 1 (listed
            before its indices, chunk by chunk, as -1-padded slots).

    Returns:
        out [B, T, Hq, Dv] in q's dtype and lse fp32 [B, T, Hq] (-inf for empty rows).

    Memory: query rows are processed in chunks of about CHUNK_ELEMENTS gathered elements; with
    autograd each chunk is checkpointed, so no [T, K, D] gather outlives its chunk. With
    autograd, low-precision k, v and sink are read through one fp32 copy each, so their
    gradients (summed over chunks and over the rows that select a key) accumulate in fp32 and
    are rounded to their dtype once.
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if indices.dim() == 3:
        indices = indices.unsqueeze(2).expand(B, T, Hkv, indices.shape[-1])
    n_pre = 0 if prefix_lengths is None or T == 0 else int(prefix_lengths.max())
    if indices.shape[-1] + n_pre == 0:  # no slots at all: one empty slot keeps reductions defined
        indices = indices.new_full((B, T, Hkv, 1), -1)
    K = indices.shape[-1] + n_pre
    Dv = v.shape[-1] if v is not None else (D if dv is None else dv)
    needs_grad = _needs_grad(q, k, v, sink)
    # Every chunk reads (gathers from) the whole k, v and sink: their gradients add up in fp32
    # and are cast once (q's rows belong to one chunk each and need no copy).
    k_flat = _flat_rows(_fp32_accumulating(k))
    v_flat = None if v is None else _flat_rows(_fp32_accumulating(v))
    sink = _fp32_accumulating(sink)
    # Per query row: the gathered K and V (fp32 copies too) and a few [Hq, K] logit buffers.
    step = rows_per_chunk(B * (2 * Hkv * K * (D + Dv) + 4 * Hq * K), device=q.device)
    fn = lambda qc, kf, vf, ic, sk: _sparse_attention_chunk(qc, kf, vf, ic, sk, S, Dv,
                                                           softmax_scale)
    outs, lses = [], []
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        ic = indices[:, t0:t1]
        if n_pre:
            slots = torch.arange(n_pre, device=ic.device)
            pre = torch.where(slots < prefix_lengths[:, t0:t1, None], slots, -1)
            ic = torch.cat([pre[:, :, None].expand(-1, -1, Hkv, -1).to(ic.dtype), ic], dim=-1)
        out, lse = _run_chunk(fn, needs_grad, q[:, t0:t1], k_flat, v_flat, ic, sink)
        outs.append(out)
        lses.append(lse)
    if not outs:  # T == 0
        return q.new_zeros(B, 0, Hq, Dv), q.new_zeros(B, 0, Hq, dtype=torch.float32)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


# ---------------------------------------------------------------------------------------------
# DSA indexer KL loss (megatron-core 0.19.2 compute_dsa_indexer_loss / FusedDSAIndexerLoss)
# ---------------------------------------------------------------------------------------------


class _LogSoftmax(torch.autograd.Function):
    """log_softmax over the last dim whose backward takes the softmax directly from the input
    (exp(x - max) / sum), as megatron's analytic indexer-loss backward does, instead of as the
    exp of the rounded log-softmax output (torch's LogSoftmaxBackward): that output carries an
    absolute rounding error of about eps * log(n), so the indexer's gradient
    (prediction - target, which cancels) lost a factor growing with the number of keys n
    (measured in fp32 against float64, scripts/accuracy.py --device cpu --tiny: 1.5x stock's
    error at 64 keys, 2x at 512)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.log_softmax(x, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad - torch.softmax(x, dim=-1) * grad.sum(dim=-1, keepdim=True)


def _masked_log_softmax(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """megatron's dsa_masking.masked_log_softmax: log-probs over valid entries, 0 elsewhere."""
    masked = logits.masked_fill(~valid, torch.finfo(logits.dtype).min)
    has_valid = valid.any(dim=-1, keepdim=True)
    safe = torch.where(has_valid, masked, torch.zeros_like(masked))
    return _LogSoftmax.apply(safe).masked_fill(~valid, 0.0)


def _attention_target(
    logits: torch.Tensor, valid: torch.Tensor, tp_group: object | None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer target from main-attention logits [B, t, Hkv, G, n] and validity [B, t, n].

    Per-head masked softmax (megatron's masked_softmax, denominator clamped at eps), summed
    over heads (and over tensor-parallel ranks, which hold the other heads), L1-normalized
    with the denominator clamped at eps. Returns [B, t, n] fp32; rows with no valid entry
    are all zero. lse [B, t, Hkv, G]: the attention's log-sum-exp over the same entries,
    used as each head's log-denominator instead of computing it here.
    """
    mask = valid[:, :, None, None, :]
    logits = logits.masked_fill(~mask, float("-inf"))
    if lse is not None:
        finite = torch.isfinite(lse)[..., None]
        shift = torch.where(finite, lse[..., None], torch.zeros_like(lse[..., None]))
        p = (logits - shift).exp_().masked_fill_(~finite, 0.0)
    else:
        m = logits.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = (logits - m).exp_()
        p = p / p.sum(dim=-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)
    target = p.sum(dim=(2, 3))
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        torch.distributed.all_reduce(target, group=tp_group)
    return target / target.sum(dim=-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)


def _kl_sum(target: torch.Tensor, log_predict: torch.Tensor) -> torch.Tensor:
    """sum of megatron's KL terms target * (log(max(target, eps)) - log_predict).

    Entries outside the valid set have target 0 and log_predict 0, so they add exactly 0, as in
    megatron (which also leaves them unmasked). Per-row sums first, then over rows, as there.
    """
    terms = target * (torch.log(target.clamp_min(INDEXER_LOSS_EPS)) - log_predict)
    return terms.sum(dim=-1).sum()


def _indexer_kl_dense_chunk(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    k_index: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    softmax_scale: float,
    relu: bool,
    tp_group: object | None,
    row_valid: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL sum over one chunk of rows, softmax over every visible key (dense warm-up loss).
    row_valid [B, t] bool: rows outside it have no valid key, so they add exactly 0.
    visible [B or 1, t, n] bool: an explicit key mask on top of the positions."""
    B, t, Hq, D = query.shape
    Hkv = key.shape[2]
    valid = k_positions[:, None, :] <= q_positions[:, :, None]  # [B, t, n]
    if visible is not None:
        valid = valid & visible
    if row_valid is not None:
        valid = valid & row_valid[:, :, None]
    with torch.no_grad():
        logits = torch.einsum(
            "btkgd,bskd->btkgs", query.float().reshape(B, t, Hkv, Hq // Hkv, D), key.float()
        ) * softmax_scale
        target = _attention_target(logits, valid, tp_group)
        del logits
    scores = indexer_scores(q_index, k_index, weights, relu)  # [B, t, n]
    return _kl_sum(target, _masked_log_softmax(scores, valid))


def _indexer_kl_sparse_chunk(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    k_index: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    topk_indices: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    softmax_scale: float,
    relu: bool,
    tp_group: object | None,
    attention_lse: torch.Tensor | None = None,
    row_valid: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL sum over one chunk of rows, restricted to the selected visible keys (sparse loss).

    Works on the K gathered keys only; equal to megatron's full-width masked form because
    every other key has target 0 and log-probability 0 there. row_valid [B, t] bool: rows
    outside it have no valid slot, so they add exactly 0. visible [B or 1, t, S] bool: an
    explicit key mask on top of the positions.
    """
    B, t, Hq, D = query.shape
    S, Hkv = key.shape[1], key.shape[2]
    K = topk_indices.shape[-1]
    sel = topk_indices.long()
    valid = sel >= 0
    sel = sel.clamp_min(0)
    valid &= k_positions.gather(1, sel.reshape(B, -1)).view(B, t, K) <= q_positions[..., None]
    if visible is not None:
        valid &= visible.expand(B, -1, -1).gather(-1, sel)
    # megatron scatters the indices into a [t, S] mask: a repeated index counts once.
    order = sel.masked_fill(~valid, S).sort(dim=-1)
    dup = torch.zeros_like(valid)
    dup[..., 1:] = (order.values[..., 1:] == order.values[..., :-1]) & (order.values[..., 1:] < S)
    valid &= ~torch.zeros_like(valid).scatter_(-1, order.indices, dup)
    if row_valid is not None:
        valid &= row_valid[..., None]
    b_rows = (torch.arange(B, device=sel.device).view(B, 1, 1) * S + sel).reshape(-1)
    with torch.no_grad():
        key_sel = key.reshape(B * S, Hkv, D).index_select(0, b_rows).view(B, t, K, Hkv, D)
        logits = torch.einsum(
            "btkgd,btjkd->btkgj", query.float().reshape(B, t, Hkv, Hq // Hkv, D), key_sel.float()
        ) * softmax_scale
        del key_sel
        lse = None if attention_lse is None else attention_lse.float().view(B, t, Hkv, Hq // Hkv)
        target = _attention_target(logits, valid, tp_group, lse)
        del logits
    k_sel = k_index.reshape(B * S, -1).index_select(0, b_rows).view(B, t, K, -1)
    head_logits = torch.einsum("bthd,btjd->bthj", q_index.float(), k_sel.float())
    if relu:
        head_logits = head_logits.relu()
    scores = (head_logits * weights.float().unsqueeze(-1)).sum(dim=2)  # [B, t, K]
    return _kl_sum(target, _masked_log_softmax(scores, valid))


def indexer_loss_reference(
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
    relu: bool,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    calculate_per_token_loss: bool,
    tp_group: object | None = None,
    attention_lse: torch.Tensor | None = None,
    query_valid_rows: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference DSA indexer KL loss on validated inputs (see ops.indexer_kl_loss).

    Args:
        q_index [B, T, H_I, D_I], weights [B, T, H_I], k_index [B, S, D_I]: the indexer
            tensors (the only ones that get gradients).
        query [B, T, Hq, Dqk], key [B, S, Hkv, Dqk]: main attention (detached here).
        topk_indices [B, T, K] (-1 padded), needed when sparse.
        q_positions [B, T], k_positions [B, S] int64: key s visible to row t iff
            k_positions[s] <= q_positions[t].
        query_valid_rows [B, T] bool or None: rows outside it take no part (KL and gradient
            0) and the mean is over the rows inside it (at least 1), as megatron's
            query_valid_rows.
        visible [B or 1, T, S] bool or None: an explicit key mask, on top of the positions
            (a row seeing no key adds 0, and still counts in the mean, as in megatron).

    Returns:
        fp32 scalar: loss_coeff * sum of per-row KL / (B * T) (or / the valid rows; the plain
        sum when calculate_per_token_loss).

    Memory: query rows in chunks; the dense form only touches keys up to the last one visible
    in the chunk; with autograd each chunk is checkpointed (its target and scores are
    recomputed in backward), so neither pass holds a [T, S] tensor. With autograd, a
    low-precision k_index is read through one fp32 copy, so its gradient (summed over chunks
    and over the rows that select a key) accumulates in fp32 and is rounded once.
    """
    B, T, H_I, D_I = q_index.shape
    S, Hkv = k_index.shape[1], key.shape[2]
    Hq = query.shape[2]
    query, key = query.detach(), key.detach()
    needs_grad = _needs_grad(q_index, weights, k_index)
    # Every chunk reads (gathers from) k_index: its gradient adds up in fp32 and is cast once.
    k_index = _fp32_accumulating(k_index)
    total = torch.zeros((), dtype=torch.float32, device=q_index.device)
    if sparse:
        if topk_indices.shape[-1] == 0:  # one empty slot keeps the reductions defined
            topk_indices = topk_indices.new_full((B, T, 1), -1)
        K = topk_indices.shape[-1]
        step = rows_per_chunk(B * K * (2 * Hkv * query.shape[-1] + 4 * Hq + 3 * H_I + 2 * D_I),
                              device=q_index.device)
        fn = lambda *a, lse=None, rows=None, vis=None: _indexer_kl_sparse_chunk(
            *a, softmax_scale, relu, tp_group, lse, rows, vis)
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            chunk_fn = partial(fn, lse=None if attention_lse is None else attention_lse[:, t0:t1],
                               rows=_rows(query_valid_rows, t0, t1),
                               vis=None if visible is None else visible[:, t0:t1])
            total = total + _run_chunk(
                chunk_fn, needs_grad, q_index[:, t0:t1], weights[:, t0:t1], k_index,
                query[:, t0:t1], key, topk_indices[:, t0:t1], q_positions[:, t0:t1], k_positions,
            )
    else:
        step = rows_per_chunk(B * S * (3 * Hq + 3 * H_I + 4), device=q_index.device)
        fn = lambda *a, rows=None, vis=None: _indexer_kl_dense_chunk(
            *a, softmax_scale, relu, tp_group, rows, vis)
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            # Keys past the last one any row of the chunk sees contribute exactly 0: skip them.
            reach = k_positions <= q_positions[:, t0:t1].amax(dim=1, keepdim=True)
            seen = reach.any(dim=0).nonzero()
            if seen.numel() == 0:
                continue
            n = int(seen[-1]) + 1
            vis = None if visible is None else visible[:, t0:t1, :n]
            total = total + _run_chunk(
                partial(fn, rows=_rows(query_valid_rows, t0, t1), vis=vis), needs_grad,
                q_index[:, t0:t1], weights[:, t0:t1], k_index[:, :n],
                query[:, t0:t1], key[:, :n], q_positions[:, t0:t1], k_positions[:, :n],
            )
    if not calculate_per_token_loss:
        total = total / valid_row_count(query_valid_rows, B * T)
    return total * loss_coeff


def _rows(query_valid_rows: torch.Tensor | None, t0: int, t1: int) -> torch.Tensor | None:
    return None if query_valid_rows is None else query_valid_rows[:, t0:t1]


def valid_row_count(query_valid_rows: torch.Tensor | None, rows: int) -> torch.Tensor | int:
    """The mean's denominator: the valid rows, at least 1 (an fp32 device scalar, no host
    sync), or max(rows, 1) without a mask."""
    if query_valid_rows is None:
        return max(rows, 1)
    return query_valid_rows.sum(dtype=torch.float32).clamp_min(1.0)


def mla_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's unfused MLA RoPE (`_apply_rotary_pos_emb_bshd`, mla_rotary_interleaved) on
    x [rows, b, n, R] with cos / sin [rows, R] already scaled and in x's dtype: the same ops
    in the same order, so the same roundings."""
    t = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    cos, sin = cos[:, None, None], sin[:, None, None]
    lo, hi = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-hi, lo), dim=-1) * sin


def mla_rope_grad_reference(grad: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> torch.Tensor:
    """The input gradient of `mla_rope_reference` for `grad` (what its autograd computes:
    each product rounded to grad's dtype, then the sum), re-interleaved. The two interleaving
    slices' backwards each fill the other's elements with zeros and autograd sums them, so a
    -0.0 comes out +0.0: the `+ 0.0` keeps that."""
    cos, sin = cos[:, None, None], sin[:, None, None]
    half = grad.size(-1) // 2
    g_lo, g_hi = grad[..., :half], grad[..., half:]
    d_lo = g_lo * cos[..., :half] + g_hi * sin[..., half:]
    d_hi = g_hi * cos[..., half:] - g_lo * sin[..., :half]
    return torch.stack((d_lo, d_hi), dim=-1).flatten(-2) + 0.0

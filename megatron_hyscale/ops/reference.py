"""Plain-torch references that define what the fast kernels must compute.

They are exact (fp32 arithmetic, a total order for ties) and bounded in memory: query rows
are processed in chunks so that no [T, S] tensor is ever built for the whole sequence.
"""

from __future__ import annotations

import torch

# Elements of fp32 work per query-row chunk (about 256 MiB): keeps 32K-token CPU runs bounded.
CHUNK_ELEMENTS = 1 << 26
_LOW32 = 0xFFFFFFFF


def rows_per_chunk(per_row_elements: int, budget: int = CHUNK_ELEMENTS) -> int:
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
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return (ordered.to(torch.int64) << 32) | (_LOW32 - index)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference HyTopK on validated inputs; positions are int64 [B, T] and [B, S]."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    kk = min(topk, S)
    indices = torch.full((B, T, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((B, T, topk), float("-inf"), dtype=torch.float32, device=q.device)
    step = rows_per_chunk(B * H * S)
    slot = torch.arange(kk, device=q.device)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        s = indexer_scores(q[:, t0:t1], k, weights[:, t0:t1], relu)  # [B, t, S]
        key = order_key(s)
        if causal:
            visible = k_positions[:, None, :] <= q_positions[:, t0:t1, None]
            key = key.masked_fill(~visible, torch.iinfo(torch.int64).min)
            n_visible = visible.sum(-1, keepdim=True)
        else:
            n_visible = torch.full((B, t1 - t0, 1), S, device=q.device)
        top = key.topk(kk, dim=-1).values
        keep = slot < n_visible
        idx = torch.where(keep, _LOW32 - (top & _LOW32), 0)
        chunk_scores = s.gather(-1, idx).masked_fill(~keep, float("-inf"))
        indices[:, t0:t1, :kk] = torch.where(keep, idx, -1).to(torch.int32)
        scores[:, t0:t1, :kk] = chunk_scores + 0.0
    return indices, scores

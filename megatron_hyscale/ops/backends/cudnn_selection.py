"""Exact DSA top-k with cuDNN-frontend's SM90 kernels: score row chunks, then radix top-k.

The library path megatron-core's cudnn backend takes, under `ops.hytopk`'s contract: the
indexer scores of a chunk of query rows (at most `CHUNK_BYTES` of fp32, keys cropped to the
last one the chunk can see) from `DSA.indexer_forward_wrapper` with each chunk's global
position as its causal offset, then `DSA.indexer_top_k_wrapper(deterministic=True)`, whose
ties keep the smaller key index. Its rows come back in key order; a stable sort by score
gives HyTopK's (score descending, index ascending) order.
"""

from __future__ import annotations

import torch

from megatron_hyscale.ops.backends.availability import CUDNN, cudnn_dsa, library_unavailable
from megatron_hyscale.ops.backends.slots import keys_off_default_positions

# megatron-core's score chunk: the table for one chunk of query rows stays under 1 GiB.
CHUNK_BYTES = 1 << 30
# Chunks start on multiples of the SM90 indexer's 128-row tiles (megatron aligns to 512).
ROW_ALIGNMENT = 512
SUPPORTED_HEAD_DIMS = (128,)


def cudnn_selection_unsupported(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *,
                                relu: bool, causal: bool, kpos: torch.Tensor | None) -> str | None:
    """None when `cudnn_selection` can run this call, else the reason it cannot.

    kpos None: the keys sit at their default positions 0 .. S-1 (no test, no host sync).
    """
    reason = library_unavailable(CUDNN, q.device)
    if reason:
        return reason
    if not relu:
        return "cuDNN's DSA indexer always applies ReLU (relu=False)"
    if not causal:
        return "cuDNN's DSA indexer masks causally (causal=False)"
    if q.dtype != torch.bfloat16:
        return f"cuDNN's DSA indexer takes bf16 q / k (got {q.dtype})"
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        return f"cuDNN's SM90 indexer takes head dim {SUPPORTED_HEAD_DIMS} (got {q.shape[3]})"
    S = k.shape[1]
    if keys_off_default_positions(kpos, S):
        return "cuDNN's DSA indexer takes keys at positions 0 .. S-1 (k_positions given)"
    return None


def _contiguous_runs(qpos: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges [start, end) over which every batch's positions rise by exactly 1."""
    T = qpos.shape[1]
    if T == 1:
        return [(0, 1)]
    steps_ok = ((qpos[:, 1:] - qpos[:, :-1]) == 1).all(0)
    breaks = (torch.nonzero(~steps_ok).flatten() + 1).tolist()
    edges = [0, *breaks, T]
    return list(zip(edges[:-1], edges[1:]))


def cudnn_selection(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                    qpos: torch.Tensor, ordered: bool = True, q_start: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """HyTopK's contract on cuDNN's kernels (see `cudnn_selection_unsupported` for the scope).

    q [B, T, H, 128] bf16, k [B, S, 128] bf16, weights [B, T, H] (used in fp32), qpos int
    [B, T] (keys 0 .. qpos are visible). `q_start`: qpos is known to be arange(T) + q_start
    in every batch, so the chunks' bounds come from the host instead of a read of qpos (a
    host sync per chunk). Returns int32 indices and fp32 scores [B, T, topk], -1 / -inf past
    the visible keys; with ordered=False a row's set comes in key order.
    """
    DSA = cudnn_dsa()
    B, T, H, D = q.shape
    S = k.shape[1]
    k4 = k.unsqueeze(2)  # [B, S, 1, D]: one key head
    w = weights.float()
    indices = torch.full((B, T, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((B, T, topk), float("-inf"), dtype=torch.float32, device=q.device)
    rows_per_chunk = max(ROW_ALIGNMENT, CHUNK_BYTES // (4 * B * S) // ROW_ALIGNMENT
                         * ROW_ALIGNMENT)
    runs = [(0, T)] if q_start is not None else _contiguous_runs(qpos)
    for run_start, run_end in runs:
        for r0 in range(run_start, run_end, rows_per_chunk):
            r1 = min(run_end, r0 + rows_per_chunk)
            pos = qpos[:, r0:r1]
            # cuTe takes unit innermost strides literally, also for a dimension of size 1.
            if q_start is None:
                first = torch.empty(B, dtype=torch.int32, device=q.device).copy_(pos[:, 0])
                last = int(pos[:, -1].max())
            else:
                first = torch.full((B,), q_start + r0, dtype=torch.int32, device=q.device)
                last = q_start + r1 - 1
            visible = min(S, last + 1)
            if visible <= 0:
                continue  # no key is visible to any row of the chunk
            keys = k4[:, :visible]
            table = DSA.indexer_forward_wrapper(
                q[:, r0:r1], keys if B == 1 else keys.contiguous(), w[:, r0:r1], ratio=1,
                sm_scale=1.0, q_causal_offsets=first)["scores"]
            kk = min(topk, visible)
            seq_lens = torch.empty(B * (r1 - r0), dtype=torch.int32, device=q.device)
            seq_lens.copy_((pos + 1).clamp(0, visible).reshape(-1))
            got = DSA.indexer_top_k_wrapper(table.view(B * (r1 - r0), visible), seq_lens,
                                            top_k=kk, next_n=1, return_val=True,
                                            deterministic=True)
            del table
            idx = got["indices"].view(B, r1 - r0, kk)
            val = got["values"].view(B, r1 - r0, kk).float()
            # Slots past a row's visible count hold -1 / -inf already; -0.0 ties +0.0.
            val = torch.where(idx >= 0, val + 0.0, float("-inf"))
            if ordered:
                val, order = val.sort(dim=-1, descending=True, stable=True)
                idx = idx.gather(-1, order)
            indices[:, r0:r1, :kk] = idx
            scores[:, r0:r1, :kk] = val
    return indices, scores

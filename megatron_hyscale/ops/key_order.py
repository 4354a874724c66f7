"""Top-k rows in increasing key order: each row's valid indices ascending, -1 slots after them.

The order HyScale's lockstep attention kernels pace their programs by (`AttentionKernelOptions.
bwd_lockstep`, `fwd_lockstep`): rows that arrive in it (`ops.hytopk(order="key")`, the DSA
layer's selection) spare the kernels a sort of their own, its int64 permutation and, with the
indexer target, the target's second buffer. Any other row order gives the same results there.
"""

from __future__ import annotations

import torch

# Temporaries (the sort's keys and int64 permutation) bounded to about this many bytes.
CHUNK_BYTES = 256 << 20
_EMPTY_LAST = torch.iinfo(torch.int32).max  # -1 slots sort after every key below 2^31 - 1


def sort_rows_by_key(indices: torch.Tensor, scores: torch.Tensor | None = None) -> None:
    """In place: each row (last dim) of indices int32 / int64 [..., K] in increasing key order,
    -1 after the valid ones, and scores (same shape, aligned) moved with them; keys below
    2^31 - 1 (the value that marks -1 while sorting). Rows run in chunks (CHUNK_BYTES).
    ValueError for misaligned or non-contiguous tensors."""
    if not indices.is_contiguous() or (scores is not None and not scores.is_contiguous()):
        raise ValueError("sort_rows_by_key: indices and scores must be contiguous")
    if scores is not None and scores.shape != indices.shape:
        raise ValueError(f"sort_rows_by_key: scores {tuple(scores.shape)} must match indices "
                         f"{tuple(indices.shape)}")
    K = indices.shape[-1] if indices.dim() else 0
    if indices.numel() == 0 or K < 2:
        return
    rows = indices.view(-1, K)
    values = None if scores is None else scores.view(-1, K)
    step = max(1, CHUNK_BYTES // (16 * K))
    for r0 in range(0, rows.shape[0], step):
        block = rows[r0:r0 + step]
        keys, perm = torch.where(block < 0, _EMPTY_LAST, block).sort(dim=-1)
        block.copy_(keys.masked_fill_(keys == _EMPTY_LAST, -1))
        if values is not None:
            values[r0:r0 + step] = values[r0:r0 + step].gather(-1, perm)

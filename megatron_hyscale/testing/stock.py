"""Making megatron-core's stock DSA comparable to HyScale's exactly (tests only).

Stock selects with `torch.topk`, whose choice among tied scores is unspecified; with ReLU many
indexer scores are exactly 0, so ties at the k-th score are common and stock and HyScale would
pick different, equally valid keys. `stock_topk_breaks_ties_by_index()` gives the stock layer a
top-k that breaks ties by the smaller key index (a stable sort of its own score table), which is
HyScale's documented total order; everything else in the stock path is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch


@contextlib.contextmanager
def stock_topk_breaks_ties_by_index() -> Iterator[None]:
    """Patch megatron's `fused_qk_topk_naive` (used by the stock forward and its loss path)."""
    from megatron.core.transformer.experimental_attention_variant import dsa as megatron_dsa

    original = megatron_dsa.fused_qk_topk_naive

    def tie_deterministic(q, k, weights, index_topk, *args, **kwargs):
        index_scores, _ = original(q, k, weights, index_topk, *args, **kwargs)
        top = min(index_topk, index_scores.shape[-1])
        scores, order = torch.sort(index_scores + 0.0, dim=-1, descending=True, stable=True)
        indices = order[..., :top].masked_fill(scores[..., :top] == float("-inf"), -1)
        return index_scores, indices

    with mock.patch.object(megatron_dsa, "fused_qk_topk_naive", tie_deterministic):
        yield

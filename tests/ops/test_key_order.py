"""`ops/key_order.py`: rows in increasing key order, -1 slots last, scores moved with them."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.ops import key_order
from megatron_hyscale.ops.key_order import sort_rows_by_key


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rows_ascend_with_empty_slots_last_and_scores_follow(dtype, monkeypatch):
    monkeypatch.setattr(key_order, "CHUNK_BYTES", 16 * 5 * 3)  # three rows a chunk: 3 chunks
    idx = torch.tensor([[[7, -1, 3, 0, -1], [-1, -1, -1, -1, -1], [4, 3, 2, 1, 0]],
                        [[-1, 9, -1, 8, 2], [1, -1, -1, -1, -1], [2**31 - 2, 5, -1, 6, 0]]],
                       dtype=dtype)
    scores = torch.where(idx >= 0, idx.double() * 0.5 - 1.0, float("-inf"))
    want_i = torch.tensor([[[0, 3, 7, -1, -1], [-1] * 5, [0, 1, 2, 3, 4]],
                           [[2, 8, 9, -1, -1], [1, -1, -1, -1, -1], [0, 5, 6, 2**31 - 2, -1]]],
                          dtype=dtype)
    sort_rows_by_key(idx, scores)
    assert torch.equal(idx, want_i)
    assert torch.equal(scores, torch.where(want_i >= 0, want_i.double() * 0.5 - 1.0,
                                           float("-inf")))


def test_without_scores_and_degenerate_shapes():
    idx = torch.tensor([[3, -1, 1]], dtype=torch.int32)
    sort_rows_by_key(idx)
    assert idx.tolist() == [[1, 3, -1]]
    for shape in [(0, 4), (3, 1), (2, 0)]:
        x = torch.full(shape, -1, dtype=torch.int32)
        sort_rows_by_key(x)
        assert x.shape == shape


def test_refuses_what_it_cannot_sort_in_place():
    idx = torch.arange(12, dtype=torch.int32).view(3, 4)
    with pytest.raises(ValueError, match="contiguous"):
        sort_rows_by_key(idx.t())
    with pytest.raises(ValueError, match="must match"):
        sort_rows_by_key(idx, torch.zeros(3, 3))

"""Library backends on CPU: slot layouts, and the reasons a call cannot run on them."""

from __future__ import annotations

import torch

from megatron_hyscale.ops.backends.availability import CUDNN, FLASHMLA, library_unavailable
from megatron_hyscale.ops.backends.cudnn_indexer_loss import cudnn_indexer_loss_unsupported
from megatron_hyscale.ops.backends.cudnn_selection import (
    _contiguous_runs,
    cudnn_selection_unsupported,
)
from megatron_hyscale.ops.backends.library_attention import library_attention_unsupported
from megatron_hyscale.ops.backends.slots import flat_key_ids, valid_first


def test_valid_first_keeps_order_and_counts():
    idx = torch.tensor([[[5, -1, 3, -1, 7], [-1, -1, -1, -1, -1], [1, 2, 3, 4, 0]]])
    got, length = valid_first(idx)
    assert got.tolist() == [[[5, 3, 7, -1, -1], [-1] * 5, [1, 2, 3, 4, 0]]]
    assert length.tolist() == [[3, 0, 5]] and length.dtype == torch.int32
    assert got.dtype == torch.int32 and got.is_contiguous()


def test_valid_first_leaves_compact_rows_alone():
    idx = torch.tensor([[[4, 2, -1], [0, -1, -1]]], dtype=torch.int32)
    got, length = valid_first(idx)
    assert torch.equal(got, idx) and length.tolist() == [[2, 1]]


def test_flat_key_ids_offsets_each_batch_and_keeps_empty_slots():
    idx = torch.tensor([[[0, 2, -1]], [[1, -1, 3]]], dtype=torch.int32)
    assert flat_key_ids(idx, 10).tolist() == [[[0, 2, -1]], [[11, -1, 13]]]
    assert flat_key_ids(idx[:1], 10) is not None


def test_contiguous_runs_split_where_positions_jump():
    pos = torch.tensor([[0, 1, 2, 10, 11, 4], [5, 6, 7, 15, 16, 9]])
    assert _contiguous_runs(pos) == [(0, 3), (3, 5), (5, 6)]
    assert _contiguous_runs(torch.arange(4)[None]) == [(0, 4)]


def test_unsupported_calls_name_their_reason_on_cpu():
    q = torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    w = torch.zeros(1, 8, 4)
    kpos = torch.arange(8)[None]
    reason = cudnn_selection_unsupported(q, k, w, relu=True, causal=True, kpos=kpos)
    assert reason and "CUDA" in reason
    for lib in (CUDNN, FLASHMLA):
        assert "CUDA" in library_unavailable(lib, torch.device("cpu"))
    query = torch.zeros(1, 8, 64, 576, dtype=torch.bfloat16)
    key = torch.zeros(1, 8, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 8, 4, dtype=torch.int32)
    assert library_attention_unsupported(query, key, None, idx, 512, prefix_lengths=None,
                                         deterministic=False)
    assert cudnn_indexer_loss_unsupported(q, w, query, key, sparse=True, relu=True, kpos=kpos,
                                          attention_lse=None)

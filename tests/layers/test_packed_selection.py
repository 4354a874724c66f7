"""Batched selection over packed THD documents (`layers/packed_selection.py`): the indices equal
one HyTopK call per document, without and with context parallelism (the local rows' in-document
positions), whatever the grouping; and the DSA layer gives identical results in both modes."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.layers.packed import PackedLayout, _cp_layout
from megatron_hyscale.layers.packed_selection import (
    batched_document_selection,
    document_groups,
)
from megatron_hyscale.ops import hytopk

TOPK = 8
H, D = 2, 16


def select_from(q, k, w, positions):
    return hytopk(q, k, w, TOPK, q_positions=positions, backend="reference")[0]


def per_document(q, k, w, packed: PackedLayout) -> torch.Tensor:
    """The per-document loop of the DSA layer: each document's rows over its own keys."""
    out = torch.full((1, q.shape[1], TOPK), -1, dtype=torch.int32)
    for (start, end), (r0, r1) in zip(packed.documents, packed.local, strict=True):
        pos = None if packed.offsets is None else packed.offsets[r0:r1]
        got = select_from(q[:, r0:r1], k[:, start:end], w[:, r0:r1], pos)
        out[:, r0:r1] = torch.where(got >= 0, got + start, got)
    return out


def inputs(rows: int, keys: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # integer values: exact fp32 sums, so every tie is a real tie (broken by the smaller index)
    q = torch.randint(-2, 3, (1, rows, H, D), generator=g).float()
    k = torch.randint(-2, 3, (1, keys, D), generator=g).float()
    w = torch.randint(-1, 2, (1, rows, H), generator=g).float()
    return q, k, w


def test_document_groups_bound_the_padding():
    lengths = [100, 3, 80, 60, 71, 10, 9]
    groups = document_groups(lengths, min_fill=0.5, short_rows=12)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups == [[0, 2, 4], [3], [5, 6, 1]]  # 71^2 >= 0.5 * 100^2 > 60^2; then <= 12
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert all(lengths[i] ** 2 >= 0.5 * longest ** 2 or longest <= 12 for i in g)
    assert document_groups([5, 5, 5]) == [[0, 1, 2]]
    assert document_groups([]) == []


@pytest.mark.parametrize("short_rows", [0, 10**9])
def test_batched_equals_per_document(short_rows):
    lengths = [13, 40, 27, 1, 9, 40, 22]  # one shorter than top-k, a single-token one
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    docs = tuple(zip(cu, cu[1:]))
    packed = PackedLayout(docs, docs, None, None, None)
    q, k, w = inputs(cu[-1], cu[-1], seed=1)
    got = batched_document_selection(select_from, q, k, w, packed, TOPK,
                                     short_rows=short_rows)
    assert torch.equal(got, per_document(q, k, w, packed))
    # non-contiguous inputs (the layer hands transposed views)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(batched_document_selection(select_from, qt, k, w, packed, TOPK), got)


@pytest.mark.parametrize("rank", [0, 1])
def test_batched_equals_per_document_under_context_parallelism(rank):
    cu = (0, 8, 40, 52, 56)  # lengths divisible by 2 * cp = 4
    packed = _cp_layout(cu, 2, rank, "cpu")
    q, k, w = inputs(cu[-1] // 2, cu[-1], seed=2 + rank)
    for short_rows in (0, 10**9):
        got = batched_document_selection(select_from, q, k, w, packed, TOPK,
                                         short_rows=short_rows)
        assert torch.equal(got, per_document(q, k, w, packed))


@pytest.mark.parametrize("cp_rank", [None, 0, 1])
def test_row_values_travel_to_their_packed_rows(cp_rank):
    """row_values: `select`'s value a row (the DSA layer's log-sum-exps) lands in the row's
    packed place, 0 at rows of no document, the indices unchanged; grouped or not."""
    from megatron_hyscale.ops.indexer_loss import index_lse_from_scores

    def select_lse(q, k, w, positions):
        idx, scores = hytopk(q, k, w, TOPK, q_positions=positions, backend="reference")
        return idx, index_lse_from_scores(scores)

    if cp_rank is None:
        cu = [0, 13, 53, 54, 63]  # and rows 63 .. 66 in no document (padding)
        docs = tuple(zip(cu, cu[1:]))
        packed = PackedLayout(docs, docs, None, None, None)
        q, k, w = inputs(cu[-1] + 3, cu[-1] + 3, seed=4)
    else:
        cu = (0, 8, 40, 52, 56)
        packed = _cp_layout(cu, 2, cp_rank, "cpu")
        q, k, w = inputs(cu[-1] // 2, cu[-1], seed=5 + cp_rank)
    want = torch.zeros(q.shape[:2])
    for (start, end), (r0, r1) in zip(packed.documents, packed.local, strict=True):
        pos = None if packed.offsets is None else packed.offsets[r0:r1]
        want[:, r0:r1] = select_lse(q[:, r0:r1], k[:, start:end], w[:, r0:r1], pos)[1]
    assert want.abs().sum() > 0
    for short_rows in (0, 10**9):
        got, values = batched_document_selection(select_lse, q, k, w, packed, TOPK,
                                                 short_rows=short_rows, row_values=True)
        assert torch.equal(got, per_document(q, k, w, packed))
        assert values.dtype == torch.float32 and torch.equal(values, want)


def test_batch_size_above_one_is_refused():
    docs = ((0, 4),)
    packed = PackedLayout(docs, docs, None, None, None)
    q, k, w = inputs(4, 4, seed=0)
    with pytest.raises(ValueError, match="batch size 1"):
        batched_document_selection(select_from, q.expand(2, -1, -1, -1), k, w, packed, TOPK)


@pytest.mark.parametrize("recompute", [False, True])
def test_dsa_layer_batched_mode_is_identical(recompute, monkeypatch):
    from megatron_hyscale.layers import dsa
    from tests.layers.test_dsa_packed import build_pair, hyscale_step, packed_params

    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return batched_document_selection(*a, **kw)

    monkeypatch.setattr(dsa, "batched_document_selection", counted)

    lengths = (13, 40, 27, 3, 16)
    # deterministic_mode: bitwise on the GPU too (the backward kernels' fp32 atomics off)
    _, per_doc = build_pair(dsa_indexer_use_sparse_loss=True, deterministic_mode=True)
    _, batched = build_pair(dsa_indexer_use_sparse_loss=True, deterministic_mode=True)
    batched.config.hyscale_packed_selection = "batched"
    params = packed_params(lengths)
    device = next(per_doc.parameters()).device
    hidden = torch.randn(sum(lengths), 1, 64, generator=torch.Generator().manual_seed(5))
    want = hyscale_step(per_doc, hidden.to(device), params, recompute)
    assert not calls
    got = hyscale_step(batched, hidden.to(device), params, recompute)
    assert len(calls) == 1  # the batched mode ran (once: the recompute replays it)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name
    assert torch.equal(got[3], want[3])


def test_unknown_mode_is_refused_by_name():
    from megatron_hyscale.layers.kernel_backend import packed_selection

    class Cfg:
        hyscale_packed_selection = "grouped"

    with pytest.raises(ValueError, match="config.hyscale_packed_selection"):
        packed_selection(Cfg())

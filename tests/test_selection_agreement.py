"""megatron_hyscale.selection_agreement: the overlap measures and the log lines they print."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.launch import logparse
from megatron_hyscale.selection_agreement import (
    jaccard,
    same_scores,
    sample_rows,
    stock_topk,
)


def test_jaccard_by_hand() -> None:
    a = torch.tensor([[0, 1, 2, 3], [5, 6, -1, -1], [-1, -1, -1, -1]])
    b = torch.tensor([[3, 2, 1, 9], [6, 5, -1, -1], [-1, -1, -1, -1]])
    assert jaccard(a, b).tolist() == pytest.approx([3 / 5, 1.0, 1.0])


def test_same_scores_tells_ties_from_misses() -> None:
    scores = torch.tensor([[4.0, 1.0, 1.0, 0.5]])
    tie = same_scores(scores, torch.tensor([[0, 1]]), torch.tensor([[0, 2]]))
    miss = same_scores(scores, torch.tensor([[0, 1]]), torch.tensor([[0, 3]]))
    assert tie.tolist() == [True] and miss.tolist() == [False]


def test_hytopk_agrees_with_stock_on_continuous_scores() -> None:
    from megatron_hyscale.ops import hytopk

    torch.manual_seed(0)
    seq, b, heads, dim, topk = 48, 2, 3, 8, 8
    q, k = torch.randn(seq, b, heads, dim), torch.randn(seq, b, dim)
    w = torch.randn(seq, b, heads)
    rows = sample_rows(seq, topk, 16, "cpu")
    assert rows.min() >= topk and rows.max() == seq - 1
    ours, _ = hytopk(q[rows].transpose(0, 1), k.transpose(0, 1), w[rows].transpose(0, 1), topk,
                     relu=False, q_positions=rows, backend="reference")
    scores, theirs = stock_topk(q[rows], k, w[rows], topk, rows, relu=False)
    assert (theirs <= rows[None, :, None]).all()  # the causal mask held
    assert jaccard(ours, theirs).min() == 1.0
    assert same_scores(scores, ours, theirs).all()


def test_log_lines_round_trip() -> None:
    text = "\n".join([
        "[hyscale agreement] rank 0 step 1 layer 1: jaccard 0.990000 score_match 1.000000 rows 8",
        "[hyscale agreement] rank 1 step 1 layer 1: jaccard 0.970000 score_match 0.500000 rows 8",
        "noise",
        "[hyscale agreement] rank 0 step 50 layer 2: jaccard 1.000000 score_match 1.000000 rows 8",
    ])
    points = logparse.selection_agreement(text)
    assert [(p.step, p.layer) for p in points] == [(1, 1), (50, 2)]
    assert points[0].jaccard == pytest.approx(0.98) and points[0].score_match == 0.75
    assert points[0].rows == 16

"""The survivors' select written straight to the rows (`kernels/survivor_select.py`,
`HyTopKOptions.scores_sm90_direct_select`) against the plain-torch select of the same buffers:
ties in score (the smaller index wins), ties straddling k, rows with fewer keys than topk, none,
over the cap, a row's keys in its buffer's order. CPU: Triton's interpreter; GPU: real sizes
beside the compacting select it replaces."""

from __future__ import annotations

import pytest
import torch
from test_hytopk_sm90 import DEV, LOW32, pack

from megatron_hyscale.ops import HyTopKOptions
from megatron_hyscale.ops.kernels import hytopk_sm90, survivor_select

# What a row's slots past its count hold here: the largest key (a select that read past the
# count would take it).
INT64_MAX = torch.iinfo(torch.int64).max


def torch_select(keys: torch.Tensor, counts: torch.Tensor, topk: int):
    """Each row's topk largest of its first min(count, cap) keys, in buffer order, decoded,
    -1 / -inf after them."""
    rows, cap = keys.shape
    idx = torch.full((rows, topk), -1, dtype=torch.int32)
    val = torch.full((rows, topk), float("-inf"))
    for r in range(rows):
        row = keys[r, :min(int(counts[r]), cap)].cpu()
        if row.numel() > topk:
            kth = row.topk(topk).values[-1]
            row = row[row >= kth]
        n = row.numel()
        idx[r, :n] = (LOW32 - (row & LOW32)).to(torch.int32)
        bits = (row >> 32).to(torch.int32)
        val[r, :n] = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).view(torch.float32)
    return idx, val


def survivor_rows(rows, cap, counts, score_range, seed, n_index=1 << 20):
    """Packed keys with distinct indices a row, shuffled; slots past a row's count hold the
    largest key (a select that read past it would take it)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-score_range, score_range + 1, (rows, cap), generator=g).float()
    index = torch.stack([torch.randperm(n_index, generator=g)[:cap] for _ in range(rows)])
    keys = pack(scores, index)
    return torch.where(torch.arange(cap) < counts.clamp(max=cap)[:, None], keys, INT64_MAX)


@pytest.mark.parametrize("chunk", [1024, 8])
@pytest.mark.parametrize("score_range", [0, 2, 1000])
def test_select_rows_equals_the_torch_select(score_range, chunk, monkeypatch):
    """Scores from one value (every key tied: the index halves decide) to many; counts above
    topk, exactly topk, below, zero, over the cap; the kept keys stored in one chunk or in
    several (each chunk's slots after the last one's)."""
    monkeypatch.setattr(survivor_select, "OUT_CHUNK_KEYS", chunk)
    cap, topk = 32, 7
    counts = torch.tensor([32, 7, 3, 0, 8, 19, 40, 1], dtype=torch.int32)
    keys = survivor_rows(counts.numel(), cap, counts, score_range, seed=score_range)
    idx, val = survivor_select.select_rows(keys.to(DEV), counts.to(DEV), topk)
    want_idx, want_val = torch_select(keys, counts, topk)
    assert torch.equal(idx.cpu(), want_idx) and torch.equal(val.cpu(), want_val)


def test_select_rows_tie_straddling_k_and_signed_zero():
    """Scores -0.0, +0.0 (one key), negatives, a tie that straddles k, -inf survivors kept as
    scores: the rows equal the torch select's, -0.0 read back as +0.0."""
    scores = torch.tensor([[-0.0, 0.0, -1.0, 3.0, 3.0, 3.0, 3.0, -2.0],
                           [float("-inf"), -5.0, -5.0, 1e-30, -1e30, 2.0, 2.0, 2.0]])
    index = torch.tensor([[9, 4, 7, 100, 5, 77, 2, 8], [0, 1, 2, 3, 4, 5, 6, 7]])
    keys = pack(scores, index)
    counts = torch.tensor([8, 8], dtype=torch.int32)
    for topk in (1, 2, 3, 5, 6, 8):
        idx, val = survivor_select.select_rows(keys.to(DEV), counts.to(DEV), topk)
        want_idx, want_val = torch_select(keys, counts, topk)
        assert torch.equal(idx.cpu(), want_idx) and torch.equal(val.cpu(), want_val), topk
    assert not torch.signbit(val.cpu()[0][val.cpu()[0] == 0]).any()


def test_select_rows_leaves_keys_and_takes_one_index_half():
    """The keys are not modified (no in-place compaction); a key whose index is 0 (index half
    2^32 - 1) and one near 2^31 take part like any."""
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    keys = pack(scores, torch.tensor([[0, 2**31 - 2, 5, 6]]))
    before = keys.clone()
    counts = torch.tensor([4], dtype=torch.int32)
    idx, _ = survivor_select.select_rows(keys.to(DEV), counts.to(DEV), 2)
    assert idx.cpu().tolist() == [[0, 5]]
    idx, _ = survivor_select.select_rows(keys.to(DEV), counts.to(DEV), 3)
    assert idx.cpu().tolist() == [[0, 5, 6]]
    assert torch.equal(keys, before)


def test_select_rows_never_writes_past_its_row():
    """Keys repeated within a row (outside the contract: the filter's keys are distinct) pass
    the cut more than topk times: the row still gets exactly its topk slots, and the next
    row's output is its own."""
    keys = torch.cat([pack(torch.full((1, 8), 5.0), torch.full((1, 8), 3)),
                      pack(torch.arange(8.0)[None], torch.arange(8)[None])])
    counts = torch.tensor([8, 8], dtype=torch.int32)
    idx, val = survivor_select.select_rows(keys.to(DEV), counts.to(DEV), 3)
    assert idx.cpu().tolist() == [[3, 3, 3], [5, 6, 7]]
    assert val.cpu()[1].tolist() == [5.0, 6.0, 7.0]


@pytest.mark.parametrize("bad, match", [
    (dict(keys=torch.zeros(4, 8, dtype=torch.int32)), "keys must be contiguous int64"),
    (dict(keys=torch.zeros(8, 4, dtype=torch.int64).t()), "keys must be contiguous int64"),
    (dict(counts=torch.zeros(3, dtype=torch.int32)), r"counts must be .* \(4,\)"),
    (dict(counts=torch.zeros(4)), "counts must be an integer"),
    (dict(topk=0), "topk must be >= 1"),
])
def test_select_rows_input_checks(bad, match):
    args = {"keys": torch.zeros(4, 8, dtype=torch.int64),
            "counts": torch.zeros(4, dtype=torch.int32), "topk": 2, **bad}
    with pytest.raises(ValueError, match=match):
        survivor_select.select_rows(args["keys"], args["counts"], args["topk"])


@pytest.mark.parametrize("order", ["key", "any", "score"])
def test_select_survivors_takes_the_direct_select_only_without_a_sort(order, monkeypatch):
    """select_survivors with the option: order "key" on key-ordered buffers and "any" go through
    select_rows (rows equal to the compacting select's); "score" still sorts (write_rows)."""
    calls = []
    real = survivor_select.select_rows

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(survivor_select, "select_rows", spy)
    g = torch.Generator().manual_seed(3)
    B, n, cap, topk = 2, 4, 16, 5
    scores = torch.randint(-3, 4, (B, n, cap), generator=g).float()
    index = torch.stack([torch.randperm(200, generator=g)[:cap].sort().values
                         for _ in range(B * n)]).view(B, n, cap)
    counts = torch.tensor([[16, 5, 3, 0], [12, 7, 1, 9]], dtype=torch.int32)
    keys = torch.where(torch.arange(cap) < counts[..., None], pack(scores, index), INT64_MAX)
    base = HyTopKOptions(interpret_programs=2, scores_sm90_direct_select=False)
    direct = HyTopKOptions(interpret_programs=2, scores_sm90_direct_select=True)
    got = hytopk_sm90.select_survivors(keys.clone().to(DEV), counts.to(DEV), topk, order=order,
                                       options=direct, keys_in_order=True)
    want = hytopk_sm90.select_survivors(keys.clone().to(DEV), counts.to(DEV), topk, order=order,
                                        options=base, keys_in_order=True)
    assert len(calls) == (0 if order == "score" else 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_direct_select_option_is_checked():
    with pytest.raises(ValueError, match="scores_sm90_direct_select"):
        HyTopKOptions(scores_sm90_direct_select=1)


@pytest.mark.gpu
@pytest.mark.parametrize("score_range", [3, 1 << 20])
def test_select_rows_real_size_equals_the_compacting_select(score_range):
    """4096-slot buffers, top-2048, 512 rows with counts around topk: the direct select's rows
    equal `write_rows(select=True)`'s (ordered=False) bit for bit."""
    from megatron_hyscale.ops.kernels import hytopk as hk

    rows, cap, topk = 512, 4096, 2048
    g = torch.Generator().manual_seed(score_range)
    counts = torch.randint(1800, 4600, (rows,), generator=g, dtype=torch.int32)
    counts[:4] = torch.tensor([0, 1, topk, cap])
    keys = survivor_rows(rows, cap, counts, score_range, seed=5, n_index=1 << 17).cuda()
    want = hk.write_rows(keys.clone(), counts.cuda(), topk, ordered=False, select=True)
    got = survivor_select.select_rows(keys, counts.cuda(), topk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

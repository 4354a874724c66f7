"""HyTopKOptions.row_sort under the Triton interpreter (CPU): every value writes the same rows
bit for bit as the default `tl.sort`, alone (`hytopk.write_rows`) and in the select kernel.

Widths of 512 keys and more are the ones where bitonic_regs maps sort-index bits away from
the identity (`hytopk._sort_axis`), so its scatter by rank is exercised there.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from megatron_hyscale.ops import hytopk  # noqa: E402
from megatron_hyscale.ops.hytopk import validate_hytopk_inputs  # noqa: E402
from megatron_hyscale.ops.kernels import hytopk as kernel  # noqa: E402
from megatron_hyscale.ops.kernels.options import HyTopKOptions  # noqa: E402
from megatron_hyscale.ops.reference import order_key  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = [v for v in kernel.ROW_SORTS if v != "bitonic"]  # against Triton's tl.sort


def options(row_sort, **fields):
    return replace(HyTopKOptions.DEFAULT, row_sort=row_sort, **fields)


def packed_rows(scores, cap):
    """Per row of scores [rows, n], its packed keys (order_key) shuffled into the first n of
    cap slots (garbage after them: write_rows must not read it)."""
    rows, n = scores.shape
    g = torch.Generator().manual_seed(n)
    keys = torch.randint(-2**63, 2**63 - 1, (rows, cap), generator=g, dtype=torch.int64)
    packed = order_key(scores)
    for r in range(rows):
        keys[r, :n] = packed[r, torch.randperm(n, generator=g)]
    return keys


def expected(keys, counts, topk):
    """Plain-torch decode of each row's first counts[r] keys, sorted descending."""
    rows = keys.shape[0]
    idx = torch.full((rows, topk), -1, dtype=torch.int32)
    sc = torch.full((rows, topk), float("-inf"))
    for r in range(rows):
        k = keys[r, :counts[r]].sort(descending=True).values
        hi = (k >> 32).to(torch.int32)
        sc[r, :len(k)] = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).view(torch.float32)
        idx[r, :len(k)] = (0xFFFFFFFF - (k & 0xFFFFFFFF)).to(torch.int32)
    return idx, sc


def assert_same(a, b, case=""):
    assert torch.equal(a[0], b[0]), case
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32)), case  # -0.0 too


@pytest.mark.parametrize("row_sort", VARIANTS)
@pytest.mark.parametrize("topk", [1, 2, 3, 12, 300, 2048])
def test_write_rows_sorts_like_the_default(row_sort, topk):
    """Random distinct scores, all-tied scores (order by index alone), -0.0 next to +0.0
    (packed alike), and rows with fewer keys than topk (empty, one, all but a few)."""
    g = torch.Generator().manual_seed(topk)
    n = topk
    rand = torch.randn(1, n, generator=g)
    tied = torch.zeros(1, n)
    signed_zero = torch.where(torch.rand(1, n, generator=g) < 0.5, -0.0, 0.0)
    few = torch.randint(-2, 3, (1, n), generator=g).float()
    scores = torch.cat([rand, tied, signed_zero, few, rand, rand])
    keys = packed_rows(scores, 2 * max(topk, 2))
    counts = torch.tensor([n, n, n, n, 0, max(0, n - 3) if n > 3 else 1], dtype=torch.int32)
    ref = expected(keys, counts, topk)
    got_default = kernel.write_rows(keys.to(DEVICE), counts.to(DEVICE), topk,
                                    options=options("bitonic"), programs=2)
    got = kernel.write_rows(keys.to(DEVICE), counts.to(DEVICE), topk, options=options(row_sort),
                            programs=2)
    assert_same((got_default[0].cpu(), got_default[1].cpu()), ref)
    assert_same((got[0].cpu(), got[1].cpu()), ref)
    assert not torch.signbit(got[1][got[1] == 0]).any()


@pytest.mark.parametrize("row_sort", list(kernel.ROW_SORTS))
@pytest.mark.parametrize("topk", [1, 3, 300, 2048])
def test_write_rows_in_key_order(row_sort, topk):
    """key_order: the same rows as the score order, each in increasing index (scores moved
    with them), -1 / -inf after; ties, -0.0 and short rows as above, and indices up to
    2^31 - 2 (the swapped halves' largest)."""
    from megatron_hyscale.ops.key_order import sort_rows_by_key

    g = torch.Generator().manual_seed(topk + 1)
    n = topk
    rand = torch.randn(1, n, generator=g)
    scores = torch.cat([rand, torch.zeros(1, n), torch.where(rand < 0, -0.0, 0.0), rand])
    keys = packed_rows(scores, 2 * max(topk, 2))
    keys[3, :n] = (keys[3, :n] & ~0xFFFFFFFF) | (0xFFFFFFFF - (2**31 - 2 - torch.arange(n)))
    counts = torch.tensor([n, n, n, max(1, n - 1)], dtype=torch.int32)
    want_i, want_s = expected(keys, counts, topk)
    sort_rows_by_key(want_i, want_s)
    got = kernel.write_rows(keys.to(DEVICE), counts.to(DEVICE), topk, options=options(row_sort),
                            programs=2, key_order=True)
    assert_same((got[0].cpu(), got[1].cpu()), (want_i, want_s))
    assert int(got[0].max()) == 2**31 - 2  # row 3's first slot


@pytest.mark.parametrize("row_sort", list(kernel.ROW_SORTS))
@pytest.mark.parametrize("sort_in_kernel", [True, False])
def test_select_kernel_key_order(row_sort, sort_in_kernel):
    """The select kernel's rows in key order (the kernel's sort, or `_finish`'s): the score
    order's rows re-sorted by index, bit for bit, on every adversarial case."""
    from megatron_hyscale.ops.key_order import sort_rows_by_key

    for name, q, k, w, topk, relu in adversarial_cases():
        want = run(q, k, w, topk, row_sort, relu=relu)
        want = tuple(t.clone() for t in want)
        sort_rows_by_key(*want)
        qpos, kpos = validate_hytopk_inputs(q, k, w, topk, None, None)
        got = kernel._launch(q, k, w, topk, relu=relu, causal=True, q_positions=qpos,
                             k_positions=kpos, key_order=True,
                             options=options(row_sort, block_n=16, num_programs=2,
                                             sort_in_kernel=sort_in_kernel))
        assert_same(got, want, name)


def test_unknown_row_sort_raises():
    keys = torch.zeros(1, 8, dtype=torch.int64, device=DEVICE)
    counts = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="row_sort"):
        kernel.write_rows(keys, counts, 4, options=options("quicksort"))


def int_inputs(B, T, S, H, D, seed, lo=-2, hi=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(lo, hi, (B, T, H, D), generator=g).float()
    k = torch.randint(lo, hi, (B, S, D), generator=g).float()
    w = torch.randint(lo, hi, (B, T, H), generator=g).float()
    return q.to(DEVICE), k.to(DEVICE), w.to(DEVICE)


def run(q, k, w, topk, row_sort, relu=True, causal=True, **fields):
    qpos, kpos = validate_hytopk_inputs(q, k, w, topk, None, None)
    return kernel._launch(q, k, w, topk, relu=relu, causal=causal, q_positions=qpos,
                          k_positions=kpos,
                          options=options(row_sort, block_n=16, num_programs=2, **fields))


def adversarial_cases():
    """(name, q, k, w, topk, relu): ties, all-zero and -0.0 rows, fewer visible keys than
    topk, batch 2, non-contiguous q, topk not a power of two, relu on and off."""
    q, k, w = int_inputs(2, 12, 40, 2, 8, seed=1)
    yield "ties_batch2", q, k, w, 12, True
    yield "relu_false", q, k, w, 12, False
    zero_w = torch.zeros_like(w)
    yield "all_zero_rows", q, k, zero_w, 10, True
    qn, kn, wn = int_inputs(1, 8, 24, 2, 8, seed=2, lo=0, hi=2)
    yield "negative_zero", qn, kn, -wn.abs() - 1, 6, True  # ReLU'd logits x negative weights
    yield "fewer_visible_than_topk", q[:1], k[:1, :9], w[:1], 20, True
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous view, same values
    assert not qt.is_contiguous()
    yield "noncontiguous_q", qt, k, w, 7, False
    qw, kw, ww = int_inputs(1, 6, 700, 2, 8, seed=3, lo=-1, hi=2)
    yield "wide_topk_ties", qw, kw, ww, 600, True  # 1024-wide sort: mapped sort-index bits


@pytest.mark.parametrize("row_sort", VARIANTS)
def test_select_kernel_rows_bitwise_equal(row_sort):
    for name, q, k, w, topk, relu in adversarial_cases():
        ref = hytopk(q, k, w, topk, relu=relu, backend="reference")
        want = run(q, k, w, topk, "bitonic", relu=relu)
        got = run(q, k, w, topk, row_sort, relu=relu)
        assert_same(want, ref, name)
        assert_same(got, want, name)


@pytest.mark.parametrize("row_sort", VARIANTS)
def test_select_kernel_unordered_ignores_row_sort(row_sort):
    q, k, w = int_inputs(1, 8, 40, 2, 8, seed=4)
    qpos, kpos = validate_hytopk_inputs(q, k, w, 12, None, None)
    outs = [kernel._launch(q, k, w, 12, relu=True, causal=True, q_positions=qpos,
                           k_positions=kpos, ordered=False,
                           options=options(rs, block_n=16, num_programs=2))
            for rs in ("bitonic", row_sort)]
    # unordered rows come in the atomic slots' order, which varies run to run on a GPU: the
    # same sets, each row's keys in any order
    assert_same(*(tuple(t.sort(dim=-1).values for t in (o[0], o[1].view(torch.int32)))
                  for o in outs))


"""QSA block pooling, visibility and expansion (ops/block_pool.py) against brute-force loops."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_hyscale.ops import hytopk
from megatron_hyscale.ops.block_pool import (
    block_first_positions,
    block_scores,
    block_visibility_positions,
    expand_blocks,
    num_complete_blocks,
    pool_blocks,
    select_blocks_reference,
)


@pytest.mark.parametrize("seq_len", [3, 4, 13, 16])
def test_pool_blocks_is_the_mean_of_complete_blocks(seq_len):
    keys = torch.randn(2, seq_len, 5)
    pooled = pool_blocks(keys, 4)
    assert pooled.shape == (2, seq_len // 4, 5) and num_complete_blocks(seq_len, 4) == seq_len // 4
    for b in range(seq_len // 4):
        torch.testing.assert_close(pooled[:, b], keys[:, 4 * b:4 * b + 4].mean(dim=1))


def test_pool_blocks_rounds_once_after_an_fp32_mean():
    keys = torch.randn(1, 8, 16).bfloat16()
    expected = keys.float().reshape(1, 2, 4, 16).mean(2).bfloat16()
    assert torch.equal(pool_blocks(keys, 4), expected)


def test_visibility_positions_are_the_qsa_rule():
    """k_pos[b] <= t  <=>  b < (t + 1) // 4 (transformers: complete visible blocks)."""
    nb, bs = 12, 4
    kpos = block_visibility_positions(nb, bs)
    assert torch.equal(block_first_positions(nb, bs), torch.arange(nb) * bs)
    for t in range(nb * bs + 3):
        for b in range(nb):
            assert bool(kpos[b] <= t) == (b < (t + 1) // bs), (t, b)


def expand_brute(blocks: list[int], t: int, bs: int) -> list[int]:
    tokens = [blk * bs + j for blk in blocks if blk >= 0 for j in range(bs)]
    start = (t + 1) // bs * bs
    return tokens + list(range(start, t + 1))


@pytest.mark.parametrize("bs", [2, 4])
def test_expand_blocks_adds_tokens_and_the_causal_tail(bs):
    T, Kb = 23, 3
    g = torch.Generator().manual_seed(0)
    blocks = torch.full((2, T, Kb), -1, dtype=torch.int32)
    for b in range(2):
        for t in range(T):
            visible = (t + 1) // bs
            pick = torch.randperm(visible, generator=g)[:Kb] if visible else torch.empty(0)
            blocks[b, t, : pick.numel()] = pick.to(torch.int32)
    tokens = expand_blocks(blocks, torch.arange(T), bs)
    assert tokens.shape == (2, T, Kb * bs + bs - 1) and tokens.dtype == torch.int32
    for b in range(2):
        for t in range(T):
            row = tokens[b, t]
            got = row[row >= 0].tolist()
            assert got == expand_brute(blocks[b, t].tolist(), t, bs), (b, t)
            assert len(set(got)) == len(got) and max(got) <= t


def test_expand_blocks_with_no_block_slots_gives_tails_only():
    tokens = expand_blocks(torch.empty(1, 6, 0, dtype=torch.int32), torch.arange(6), 4)
    assert tokens.shape == (1, 6, 3)
    assert tokens[0, 2].tolist() == [0, 1, 2]
    assert tokens[0, 3].tolist() == [-1, -1, -1]  # its own block is complete: no tail
    assert tokens[0, 5].tolist() == [4, 5, -1]


def test_expand_blocks_rejects_bad_positions():
    with pytest.raises(ValueError, match="q_positions"):
        expand_blocks(torch.zeros(1, 4, 1, dtype=torch.int32), torch.arange(5), 4)
    with pytest.raises(ValueError, match="block_indices"):
        expand_blocks(torch.zeros(1, 4, 1), torch.arange(4), 4)


@pytest.mark.parametrize("T", [5, 38, 41])
def test_reference_selection_matches_hytopk_and_a_loop(T):
    """Baseline (table + torch.topk) = HyTopK with the block positions = a per-row loop."""
    bs, H, D, topk = 4, 4, 8, 3
    g = torch.Generator().manual_seed(T)
    # Positive-leaning q and k keep ReLU zeros (ties) out of the top-k.
    q = torch.randn(2, T, H, D, generator=g) + 0.5
    keys = torch.randn(2, T // bs, D, generator=g) + 0.5
    qpos = torch.arange(T)
    ref = select_blocks_reference(q, keys, topk, scale=D ** -0.5, q_positions=qpos,
                                  block_size=bs, rows_per_chunk=7)
    weights = torch.full((2, T, H), D ** -0.5)
    fast, _ = hytopk(q, keys, weights, topk, relu=True, q_positions=qpos,
                     k_positions=block_visibility_positions(T // bs, bs))
    scores = block_scores(q, keys, D ** -0.5)
    for b in range(2):
        for t in range(T):
            visible = (t + 1) // bs
            expected = scores[b, t, :visible].topk(min(topk, visible)).indices.tolist()
            assert sorted(x for x in ref[b, t].tolist() if x >= 0) == sorted(expected)
            assert sorted(x for x in fast[b, t].tolist() if x >= 0) == sorted(expected)


def test_reference_selection_without_complete_blocks_is_empty():
    q = torch.randn(1, 3, 2, 4)
    out = select_blocks_reference(q, torch.zeros(1, 0, 4), 2, scale=1.0,
                                  q_positions=torch.arange(3), block_size=4)
    assert out.shape == (1, 3, 2) and bool((out == -1).all())


def test_hytopk_triton_kernel_on_qsa_shapes():
    """The Triton kernel (interpreted on CPU) with QSA's 4 indexer heads, no head weights and
    the block positions selects what the reference selects."""
    T, nb, H, D = 70, 17, 4, 32
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(2, T, H, D, generator=g), torch.randn(2, nb, D, generator=g)
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    weights = torch.full((2, T, H), D ** -0.5)
    kw = dict(relu=True, q_positions=torch.arange(T),
              k_positions=block_visibility_positions(nb, 4))
    fast_i, fast_s = hytopk(q, keys, weights, 8, backend="triton", **kw)
    ref_i, ref_s = hytopk(q, keys, weights, 8, backend="reference", **kw)
    assert torch.equal(fast_i, ref_i)
    torch.testing.assert_close(fast_s, ref_s, rtol=1e-6, atol=1e-5)


def test_sparse_attention_triton_kernel_on_expanded_qsa_indices():
    """QSA's expanded indices (4-token runs + tail, -1 padding) in GQA form (4 query heads on
    2 KV heads, indices shared by the KV heads) through the Triton kernel (interpreted on CPU):
    forward and backward equal the reference."""
    from megatron_hyscale.ops import sparse_attention

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    T = 70
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, T, h, 16, generator=g).requires_grad_(True) for h in (4, 2, 2))
    blocks = torch.full((1, T, 3), -1, dtype=torch.int32)
    for t in range(T):
        pick = torch.randperm((t + 1) // 4, generator=g)[:3]
        blocks[0, t, : pick.numel()] = pick.to(torch.int32)
    indices = expand_blocks(blocks, torch.arange(T), 4)
    results = []
    for backend in ("triton", "reference"):
        out = sparse_attention(q, k, v, indices, 0.25, backend=backend)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)

"""HyTopK Triton kernel under the Triton interpreter (CPU), against the plain-torch reference.

Inputs are small integers in fp32, so every score is an exact integer and the kernel must match
the reference bit for bit: indices, scores, -1 / -inf padding, tie order (smaller index first).
The interpreter's bf16 arithmetic is wrong, so only fp32 runs here; cases are tiny because the
interpreter is slow. Small key tiles (block_n=16) make the candidate buffer compact many times.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from megatron_hyscale.ops import hytopk  # noqa: E402
from megatron_hyscale.ops.hytopk import validate_hytopk_inputs  # noqa: E402
from megatron_hyscale.ops.kernels import hytopk as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def int_inputs(B, T, S, H, D, seed, lo=-2, hi=3, wlo=-2, whi=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(lo, hi, (B, T, H, D), generator=g).float()
    k = torch.randint(lo, hi, (B, S, D), generator=g).float()
    w = torch.randint(wlo, whi, (B, T, H), generator=g).float()
    return q.to(DEVICE), k.to(DEVICE), w.to(DEVICE)


def check(q, k, w, topk, block_n=16, rows=None, num_programs=None, group_slack_div=4, **kw):
    """Kernel (with the given tiling) against the reference; exact equality."""
    ref_i, ref_s = hytopk(q, k, w, topk, backend="reference", **kw)
    qpos, kpos = validate_hytopk_inputs(q, k, w, topk, kw.get("q_positions"),
                                        kw.get("k_positions"))
    out_i, out_s = kernel._launch(
        q, k, w, topk, relu=kw.get("relu", True), causal=kw.get("causal", True),
        q_positions=qpos, k_positions=kpos, block_n=block_n, rows=rows,
        num_programs=num_programs, group_slack_div=group_slack_div)
    assert out_i.dtype == torch.int32 and out_s.dtype == torch.float32
    assert out_i.shape == ref_i.shape and out_s.shape == ref_s.shape
    assert torch.equal(out_i, ref_i), (out_i, ref_i)
    assert torch.equal(out_s, ref_s), (out_s, ref_s)
    # -0.0 and +0.0 tie, and the output holds +0.0 like the reference.
    assert not torch.signbit(out_s[out_s == 0]).any()
    return out_i, out_s


def test_public_api_triton_backend():
    q, k, w = int_inputs(1, 12, 12, 4, 16, seed=0)
    ref = hytopk(q, k, w, 5, backend="reference")
    out = hytopk(q, k, w, 5, backend="triton")
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_ties_and_compaction_batch2():
    # Values in {-1, 0, 1}: scores collide constantly; 48 keys with 16-key tiles and topk 6
    # force several compactions; B = 2 with different data per batch.
    q, k, w = int_inputs(2, 20, 48, 4, 16, seed=1, lo=-1, hi=2)
    check(q, k, w, 6)


def test_all_zero_relu_rows_and_negative_zero():
    # Queries whose logits are all <= 0 give all-zero ReLU rows (scores 0 or -0.0 with negative
    # weights): the order is then by key index alone.
    q, k, w = int_inputs(1, 16, 40, 2, 16, seed=2)
    k = k.abs()
    q[0, :8] = -q[0, :8].abs()
    w[0, :8] = -1.0
    out_i, out_s = check(q, k, w, 7)
    assert torch.equal(out_i[0, 0, :1], torch.tensor([0], dtype=torch.int32, device=DEVICE))


def test_fewer_visible_than_k_and_topk_above_s():
    q, k, w = int_inputs(1, 10, 10, 4, 16, seed=3)
    out_i, _ = check(q, k, w, 16)  # topk > S: -1 / -inf beyond the visible keys
    assert (out_i[0, 0, 1:] == -1).all()


def test_relu_false_and_noncausal():
    q, k, w = int_inputs(1, 18, 44, 4, 16, seed=4)
    check(q, k, w, 9, relu=False)
    check(q, k, w, 9, relu=True, causal=False)


def test_relu_false_noncausal_negative_weights():
    q, k, w = int_inputs(1, 9, 30, 3, 8, seed=5, wlo=-3, whi=0)
    check(q, k, w, 11, relu=False, causal=False)


def test_shard_positions_per_batch_noncontiguous():
    # Context-parallel style: two non-contiguous query chunks, per-batch positions, and
    # non-contiguous q / k / weights views.
    B, S, H, D = 2, 48, 4, 16
    qb, kb, wb = int_inputs(B, 16, S, H, 2 * D, seed=6)
    q = qb[..., ::2]
    k = kb[..., 1::2]
    w = wb.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or w.is_contiguous())
    pos = torch.cat([torch.arange(4, 12), torch.arange(36, 44)])
    qpos = torch.stack([pos, pos + 3]).to(DEVICE)
    check(q, k, w, 5, q_positions=qpos)


def test_unsorted_key_positions():
    # Key positions need not be sorted: visibility is by comparison, not by index.
    q, k, w = int_inputs(1, 12, 36, 4, 16, seed=7)
    g = torch.Generator().manual_seed(0)
    kpos = torch.randperm(36, generator=g).to(DEVICE)
    qpos = torch.arange(0, 36, 3).to(DEVICE)
    check(q, k, w, 8, q_positions=qpos, k_positions=kpos)


@pytest.mark.parametrize("H,D,rows", [(1, 16, 16), (5, 8, None), (3, 64, 8)])
def test_head_padding_and_tilings(H, D, rows):
    q, k, w = int_inputs(1, 21, 33, H, D, seed=8 + H)
    check(q, k, w, 10, rows=rows, num_programs=2)


def test_tile_groups_and_compaction():
    # topk 70 with 16-key tiles: buffer 128, groups of 3 tiles, compaction past 80 entries.
    q, k, w = int_inputs(1, 6, 300, 2, 16, seed=12, lo=-1, hi=2)
    check(q, k, w, 70, group_slack_div=1)


def test_default_tile_size():
    q, k, w = int_inputs(1, 8, 150, 2, 16, seed=9)
    check(q, k, w, 20, block_n=None)


def test_kernel_would_fail_on_wrong_order():
    # Guard that the comparison can fail: a reversed row is not equal to the reference.
    q, k, w = int_inputs(1, 6, 20, 2, 16, seed=10)
    out_i, _ = check(q, k, w, 4)
    ref_i, _ = hytopk(q, k, w, 4, backend="reference")
    assert not torch.equal(out_i.flip(-1), ref_i)

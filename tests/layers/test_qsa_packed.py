"""HyScale's QSA attention on packed THD sequences (fp32, no CP, on the GPU where there is one).

The defining property: a packed sequence of documents gives, per document, exactly the output,
the input gradient, the block selection and the indexer loss of the layer run on that document
alone (unpacked, RoPE from 0), and the parameter gradients are the sum of the documents'. The
budget is 8 blocks of 4: one document has fewer complete blocks than that and none is a
multiple of the block size; the second set has a document with no complete block. RoPE comes
as megatron gives it for THD: a table of max_seqlen rows (positions restart per document) or
one of the whole packed length (indexed by packed row). Also: recompute with selection replay,
the baseline selector, the indexer loss (dense, sparse, per-token and rows-mean), padded
cu_seqlens, and bad cu_seqlens.

Rows left out of the indexer loss (real_token_mask_q, the last rows of some documents, or a
padded document's padding): they still select and attend (the outputs are the unmasked run's),
and the indexer loss and its gradients are those of each document's valid rows run alone (the
mean over the valid rows, or their KL sum when per-token).
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module

import megatron_hyscale.layers.qsa as qsa
from hyscale_bench.models import default_device
from megatron_hyscale import replay
from megatron_hyscale.specs.qsa import get_qsa_attention_spec
from megatron_hyscale.testing.packed import (
    Step,
    assert_steps_close,
    check_prefix_mask,
    cu_seqlens,
    document_prefix_rows,
    joined,
    prefix_mask,
    thd_params,
    train_step,
)
from megatron_hyscale.testing.qsa import tiny_qsa_configs

DEVICE = default_device()

LENGTHS = (13, 46, 27)  # 3, 11, 6 complete blocks (budget 8)
LENGTHS_WITH_EMPTY = (3, 38, 21)  # the first has no complete block
# real_token_mask_q's valid rows: each document's first ones (the first document whole; in the
# second set the second cut down to no complete block, its valid rows' KL 0 but counted)
VALID = (13, 29, 17)
VALID_WITH_EMPTY = (3, 2, 15)


def build(seed: int = 0, baseline: bool = False, **overrides):
    pytest.importorskip("transformers.models.qwen4_exp")
    cfg, hcfg = tiny_qsa_configs(**{"deterministic_mode": True, **overrides})
    layer = build_module(get_qsa_attention_spec(cfg, baseline=baseline), config=cfg,
                         layer_number=1).to(DEVICE)
    # CPU noise, copied to the device: the same weights on every device.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.2 * noise)
    return layer, hcfg


def rope(hcfg, rows: int) -> torch.Tensor:
    params = hcfg.rope_parameters
    return RotaryEmbedding(kv_channels=hcfg.head_dim,
                           rotary_percent=params["partial_rotary_factor"],
                           rotary_base=params["rope_theta"],
                           use_cpu_initialization=True)(rows).to(DEVICE)


def packed_params(lengths, padded=None):
    return thd_params(lengths, padded, device=DEVICE)


def run(layer, x, r, freqs, params=None, recompute=False) -> Step:
    return train_step(layer, lambda t: layer(t, None, rotary_pos_emb=freqs,
                                             packed_seq_params=params)[0], x, r, recompute)


def per_document(layer, hcfg, x, r, lengths, coeff_share=None) -> Step:
    """The layer on each document alone (RoPE from 0), joined; coeff_share: each document's
    indexer-loss coefficient scaled by its share of the rows (as the packed rows-mean weighs
    it)."""
    steps, core = [], layer.core_attention
    base = core.config
    for a, n in zip(cu_seqlens(lengths), lengths):
        if coeff_share is not None:
            core.config = copy.copy(base)
            core.config.qsa_indexer_loss_coeff = base.qsa_indexer_loss_coeff * n / coeff_share
        steps.append(run(layer, x[a:a + n], r[a:a + n], rope(hcfg, n)))
        core.config = base
    return joined(steps)


def inputs(rows, hidden=64, seed=1):
    """(x, r) drawn on the CPU (the same values on every device), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 1, hidden, generator=g).to(DEVICE),
            torch.randn(rows, 1, hidden, generator=g).to(DEVICE))


assert_same = assert_steps_close


@pytest.mark.parametrize("table", ["max_seqlen", "packed"])
@pytest.mark.parametrize("lengths", [LENGTHS, LENGTHS_WITH_EMPTY])
def test_packed_equals_each_document_alone(lengths, table):
    layer, hcfg = build()
    x, r = inputs(sum(lengths))
    if table == "max_seqlen":
        freqs = rope(hcfg, max(lengths))
    else:  # megatron's exact mapping: one row per packed row
        freqs = torch.cat([rope(hcfg, n) for n in lengths])
    replay.reset_stats()
    got = run(layer, x, r, freqs, packed_params(lengths))
    want = per_document(layer, hcfg, x, r, lengths)
    # one packed selection, then one per document with a complete block
    alone = sum(n >= layer.config.qsa_block_size for n in lengths)
    assert replay.get_stats()["selections_computed"] == 1 + alone
    assert_same(got, want)


def test_packed_indices_are_each_documents_alone(monkeypatch):
    layer, hcfg = build(seed=2)
    seen = []
    original = qsa.sparse_attention

    def spy(q, k, v, indices, *args, **kwargs):
        seen.append(indices.detach().clone())
        return original(q, k, v, indices, *args, **kwargs)

    monkeypatch.setattr(qsa, "sparse_attention", spy)
    x, _ = inputs(sum(LENGTHS), seed=3)
    layer.eval()
    with torch.no_grad():
        layer(x, None, rotary_pos_emb=rope(hcfg, max(LENGTHS)),
              packed_seq_params=packed_params(LENGTHS))
        (packed,) = seen
        start = 0
        for n in LENGTHS:
            seen.clear()
            layer(x[start:start + n], None, rotary_pos_emb=rope(hcfg, n))
            alone = seen[0][0].long()
            rows = packed[0, start:start + n].long()
            blocks = alone.shape[-1] - (layer.config.qsa_block_size - 1)
            width = rows.shape[-1] - (layer.config.qsa_block_size - 1)
            want = torch.where(alone < 0, -1, alone + start)
            assert torch.equal(rows[:, :blocks], want[:, :blocks])
            assert bool((rows[:, blocks:width] == -1).all())  # padded to the widest document
            assert torch.equal(rows[:, width:], want[:, blocks:])  # the causal tails
            start += n


def test_packed_recompute_replays_and_matches():
    layer, hcfg = build(seed=4)
    x, r = inputs(sum(LENGTHS), seed=5)
    params, freqs = packed_params(LENGTHS), rope(hcfg, max(LENGTHS))
    plain = run(layer, x, r, freqs, params)
    replay.reset_stats()
    got = run(layer, x, r, freqs, params, recompute=True)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 1 and stats["selections_replayed"] == 1
    replay.assert_drained()
    assert_same(got, plain)
    assert torch.equal(got.out, plain.out) and torch.equal(got.x_grad, plain.x_grad)


def test_packed_baseline_selector_equals_each_document_alone_and_reselects():
    """The score-table baseline packed against itself per document (against HyTopK its
    torch.topk may pick another of the blocks tied at score 0, see test_qsa.py)."""
    base, hcfg = build(seed=6, baseline=True)
    x, r = inputs(sum(LENGTHS), seed=7)
    params, freqs = packed_params(LENGTHS), rope(hcfg, max(LENGTHS))
    replay.reset_stats()
    got = run(base, x, r, freqs, params, recompute=True)
    assert replay.get_stats()["selections_computed"] == 2
    assert replay.get_stats()["selections_replayed"] == 0
    assert_same(got, per_document(base, hcfg, x, r, LENGTHS))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_packed_indexer_loss_equals_each_document_alone(sparse, per_token, recompute):
    layer, hcfg = build(seed=8, qsa_indexer_loss_coeff=0.5, qsa_indexer_use_sparse_loss=sparse,
                        calculate_per_token_loss=per_token)
    lengths = LENGTHS_WITH_EMPTY if sparse else LENGTHS
    x, r = inputs(sum(lengths), seed=9)
    replay.reset_stats()
    got = run(layer, x, r, rope(hcfg, max(lengths)), packed_params(lengths), recompute)
    assert replay.get_stats()["selections_replayed"] == int(recompute)
    want = per_document(layer, hcfg, x, r, lengths, None if per_token else sum(lengths))
    assert any(".indexer." in n for n in want.grads), "the indexer loss never ran"
    assert want.logged > 0
    assert_same(got, want)


def test_padded_documents_give_their_real_rows_alone():
    """cu_seqlens_q_padded: each document occupies its padded rows (padding after its real
    rows, part of it); the real rows equal the real document alone."""
    layer, hcfg = build(seed=10)
    lengths, padded = LENGTHS, (16, 48, 28)
    x, r = inputs(sum(padded), seed=11)
    real = document_prefix_rows(lengths, padded, DEVICE)
    r_real = torch.zeros_like(r)
    r_real[real] = r[real]
    got = run(layer, x, r_real, rope(hcfg, max(padded)), packed_params(lengths, padded))
    want = per_document(layer, hcfg, x[real], r[real], lengths)
    assert_same(got._replace(out=got.out[real], x_grad=got.x_grad[real]), want)
    padding = torch.ones(sum(padded), dtype=torch.bool, device=DEVICE)
    padding[real] = False
    assert bool((got.x_grad[padding] == 0).all())  # real rows never read the padding


def test_bad_cu_seqlens_name_the_argument():
    layer, hcfg = build()
    x = torch.randn(sum(LENGTHS) + 1, 1, 64).to(DEVICE)
    freqs = rope(hcfg, 64)
    call = lambda h, p: layer(h, None, rotary_pos_emb=freqs, packed_seq_params=p)  # noqa: E731
    with pytest.raises(ValueError, match=r"HyScaleQSAttention: packed cu_seqlens must rise .*"
                                         r"packed_seq_params\.cu_seqlens_q\)"):
        call(x[:-2], packed_params(LENGTHS))
    params = packed_params(LENGTHS)
    params.cu_seqlens_kv = torch.tensor([0, 40, 86], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="HyScaleQSAttention: packed THD with different"):
        call(x[:-1], params)
    with pytest.raises(ValueError, match="cu_seqlens_q .* must give every document at most"):
        call(x[:-1], packed_params((13, 47, 26), (13, 46, 27)))
    with pytest.raises(ValueError, match="fewer than the longest packed document"):
        layer(x[:-1], None, rotary_pos_emb=rope(hcfg, 20),
              packed_seq_params=packed_params(LENGTHS))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_real_token_mask_loss_is_the_valid_rows_alone(sparse, per_token, recompute):
    """The last rows of some documents masked out of the indexer loss (real_token_mask_q):
    the valid rows' output, the indexer loss (their mean, or KL sum when per-token) and every
    gradient are those of each document's valid rows run alone (the same selection: causal,
    per document); the outputs are the unmasked run's, the indexer's gradients and loss not."""
    layer, hcfg = build(seed=12, qsa_indexer_loss_coeff=0.5, qsa_indexer_use_sparse_loss=sparse,
                        calculate_per_token_loss=per_token)
    lengths, valid = (LENGTHS_WITH_EMPTY, VALID_WITH_EMPTY) if sparse else (LENGTHS, VALID)
    x, r = inputs(sum(lengths), seed=13)
    freqs = rope(hcfg, max(lengths))
    replay.reset_stats()
    # The input gradients reach ~9 and their packed and alone sums round apart by up to ~2e-6
    # (also unmasked: test_packed_indexer_loss_equals_each_document_alone at other seeds).
    check_prefix_mask(lambda x, r, p: run(layer, x, r, freqs, p, recompute),
                      partial(per_document, layer, hcfg), x, r, lengths, valid,
                      per_token=per_token, atol=1e-5)
    replay.assert_drained()


@pytest.mark.parametrize("sparse", [False, True])
def test_real_token_mask_of_padded_documents(sparse):
    """cu_seqlens_q_padded and a mask of the real rows (megatron's real_token_mask_q): the loss
    is each real document's alone; the padding rows still attend."""
    layer, hcfg = build(seed=14, qsa_indexer_loss_coeff=0.5, qsa_indexer_use_sparse_loss=sparse)
    lengths, padded = LENGTHS, (16, 48, 28)
    x, r = inputs(sum(padded), seed=15)
    freqs = rope(hcfg, max(padded))
    check_prefix_mask(lambda x, r, p: run(layer, x, r, freqs, p),
                      partial(per_document, layer, hcfg), x, r, lengths, lengths, padded=padded)


def test_real_token_mask_without_the_indexer_loss_changes_nothing():
    """Without the indexer loss the mask changes nothing (as stock's DSA: rows still attend)."""
    lengths, padded = LENGTHS, (16, 48, 28)
    params = packed_params(lengths, padded)
    params.real_token_mask_q = prefix_mask(lengths, padded, DEVICE)
    x, r = inputs(sum(padded), seed=16)
    layer, hcfg = build(seed=16)
    masked = run(layer, x, r, rope(hcfg, max(padded)), params)
    plain = run(layer, x, r, rope(hcfg, max(padded)), packed_params(lengths, padded))
    assert torch.equal(masked.out, plain.out)
    assert_same(masked, plain)

"""HyScaleV4Attention (window / CSA / HCA) on packed THD sequences (fp32, no CP, on the GPU
where there is one).

The defining property: a packed sequence of documents gives, per document, exactly the output,
the input gradient, the selection and the indexer loss of the layer run on that document alone
(unpacked), and the parameter gradients are the sum of the documents' (the loss is a sum over
tokens). The documents are uneven: one has fewer compressed entries than top-k (and fewer
tokens than the HCA window of 8 plus the sliding window), none is a multiple of the CSA ratio
4, and in the second set one is shorter than the CSA ratio (no compressed entry at all). Also:
recompute with selection replay, the baseline selector, the indexer loss (dense, sparse,
per-token and rows-mean), padded cu_seqlens, row chunks, and bad cu_seqlens.

Rows left out of the indexer loss (real_token_mask_q, the last rows of some documents, or a
padded document's padding): they still select and attend (the outputs are the unmasked run's),
and the CSA indexer loss and its gradients are those of each document's valid rows run alone
(the mean over the valid rows, or their KL sum when per-token), also in row parts; window and
HCA layers have no indexer loss, so the mask changes nothing there.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)

import megatron_hyscale.layers.deepseek_v4 as v4
from hyscale_bench.models import default_device, randomize_, tiny_v4_config
from megatron_hyscale import replay
from megatron_hyscale.layers.deepseek_v4 import HyScaleV4Attention
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

DEVICE = default_device()
LAYERS = {"window": 0, "csa": 1, "hca": 2}  # compress ratios 0, 4, 8 (tiny_v4_config)
LENGTHS = (9, 30, 22)  # CSA entries 2, 7, 5 (top-k 3); HCA entries 1, 3, 2
LENGTHS_WITH_EMPTY = (3, 17, 26)  # the first has no complete CSA window
# real_token_mask_q's valid rows: each document's first ones (the first document whole; in the
# second set the second cut down to no compressed entry, its valid rows' KL 0 but counted)
VALID = (9, 21, 13)
VALID_WITH_EMPTY = (3, 3, 19)


@pytest.fixture(autouse=True)
def empty_loss_tracker():
    yield
    DSAIndexerLossLoggingHelper.tracker.clear()


def build(kind: str, seed: int = 0, **overrides) -> HyScaleV4Attention:
    cfg = tiny_v4_config(csa_ratio=4, hca_ratio=8, window=5, index_topk=3, **overrides)
    layer = HyScaleV4Attention(cfg, layer_number=LAYERS[kind] + 1).to(DEVICE)
    randomize_(layer, seed=seed)  # CPU noise, copied: the same weights on every device
    return layer


def packed_params(lengths, padded=None):
    return thd_params(lengths, padded, device=DEVICE)


def run(layer, x, r, params=None, recompute=False) -> Step:
    return train_step(layer, lambda t: layer(t, None, packed_seq_params=params)[0], x, r,
                      recompute)


def per_document(layer, x, r, lengths, coeff_share=None) -> Step:
    """The layer on each document alone, joined. coeff_share: scale each document's
    indexer-loss coefficient by its share of the rows (the packed rows-mean loss weighs it so;
    the logged loss then holds the scaled coefficient)."""
    steps, base = [], layer.config
    for a, n in zip(cu_seqlens(lengths), lengths):
        if coeff_share is not None:
            layer.config = copy.copy(base)
            layer.config.v4_indexer_loss_coeff = base.v4_indexer_loss_coeff * n / coeff_share
        steps.append(run(layer, x[a:a + n], r[a:a + n]))
        layer.config = base
    return joined(steps)


def inputs(rows, hidden, seed=1):
    """(x, r) drawn on the CPU (the same values on every device), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 1, hidden, generator=g).to(DEVICE),
            torch.randn(rows, 1, hidden, generator=g).to(DEVICE))


assert_same = assert_steps_close


def spy_indices(monkeypatch, layer):
    """The sparse-attention indices of each call (selection, window) into a list."""
    seen = []
    original = v4.sparse_attention

    def spy(q, k, v, indices, *args, **kwargs):
        seen.append((indices.detach().clone(), kwargs.get("prefix_lengths")))
        return original(q, k, v, indices, *args, **kwargs)

    monkeypatch.setattr(v4, "sparse_attention", spy)
    return seen


@pytest.mark.parametrize("lengths", [LENGTHS, LENGTHS_WITH_EMPTY])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_packed_equals_each_document_alone(kind, lengths):
    layer = build(kind)
    x, r = inputs(sum(lengths), layer.config.hidden_size)
    replay.reset_stats()
    got = run(layer, x, r, packed_params(lengths))
    want = per_document(layer, x, r, lengths)
    assert_same(got, want)
    if kind == "csa":
        # one packed selection, then one per document that has a compressed entry
        alone = sum(n >= layer.compress_ratio for n in lengths)
        assert replay.get_stats()["selections_computed"] == 1 + alone


@pytest.mark.parametrize("kind", list(LAYERS))
def test_packed_indices_stay_in_their_document(kind, monkeypatch):
    layer = build(kind)
    seen = spy_indices(monkeypatch, layer)
    x, _ = inputs(sum(LENGTHS), layer.config.hidden_size)
    with torch.no_grad():
        layer.eval()
        layer(x, None, packed_seq_params=packed_params(LENGTHS))
    ((indices, prefix),) = seen
    assert prefix is None  # HCA's per-document entries are listed, not a prefix of them
    m = layer.compress_ratio
    n_entries = sum(n // m for n in LENGTHS) if m else 0
    start = entry = 0
    for n in LENGTHS:
        rows = indices[0, start:start + n].long()
        own_entries = (rows >= entry) & (rows < entry + (n // m if m else 0))
        own_tokens = (rows >= n_entries + start) & (rows < n_entries + start + n)
        assert bool(((rows < 0) | own_entries | own_tokens).all()), "a row left its document"
        start, entry = start + n, entry + (n // m if m else 0)
    # the alone runs' indices, shifted into the packed keys, are the packed ones
    seen.clear()
    start = entry = 0
    for n in LENGTHS:
        with torch.no_grad():
            layer(x[start:start + n], None)
        alone = seen.pop()[0].long()
        if layer.compress_ratio and not layer.is_csa:  # HCA alone: a prefix, packed: listed
            continue
        count = n // m if m else 0
        shifted = torch.where(alone < 0, -1,
                              torch.where(alone < count, alone + entry,
                                          alone - count + n_entries + start))
        packed_rows = indices[0, start:start + n].long()
        width = shifted.shape[-1] - layer.config.v4_sliding_window
        # selection slots (-1 padded to the packed width), then the window
        assert torch.equal(packed_rows[:, :width], shifted[0, :, :width])
        assert bool((packed_rows[:, width:-layer.config.v4_sliding_window] == -1).all())
        assert torch.equal(packed_rows[:, -layer.config.v4_sliding_window:],
                           shifted[0, :, width:])
        start, entry = start + n, entry + count


@pytest.mark.parametrize("kind", list(LAYERS))
def test_packed_recompute_replays_and_matches(kind):
    layer = build(kind, seed=2)
    x, r = inputs(sum(LENGTHS), layer.config.hidden_size, seed=3)
    params = packed_params(LENGTHS)
    plain = run(layer, x, r, params)
    replay.reset_stats()
    got = run(layer, x, r, params, recompute=True)
    stats = replay.get_stats()
    csa = int(layer.is_csa)
    assert stats["selections_computed"] == csa and stats["selections_replayed"] == csa
    replay.assert_drained()
    assert_same(got, plain)
    assert torch.equal(got.out, plain.out)


def test_packed_baseline_selector_equals_hyscale_and_reselects():
    ours, base = build("csa", seed=4), build("csa", seed=4, v4_baseline=True,
                                              v4_baseline_row_block=7)
    x, r = inputs(sum(LENGTHS), ours.config.hidden_size, seed=5)
    params = packed_params(LENGTHS)
    replay.reset_stats()
    want = run(ours, x, r, params, recompute=True)
    replay.reset_stats()
    got = run(base, x, r, params, recompute=True)
    assert replay.get_stats()["selections_computed"] == 2
    assert replay.get_stats()["selections_replayed"] == 0
    assert_same(got, want)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_packed_indexer_loss_equals_each_document_alone(sparse, per_token, recompute):
    layer = build("csa", seed=6, v4_indexer_loss_coeff=0.5, v4_indexer_use_sparse_loss=sparse,
                  calculate_per_token_loss=per_token)
    lengths = LENGTHS_WITH_EMPTY if sparse else LENGTHS
    x, r = inputs(sum(lengths), layer.config.hidden_size, seed=7)
    replay.reset_stats()
    got = run(layer, x, r, packed_params(lengths), recompute=recompute)
    assert replay.get_stats()["selections_replayed"] == int(recompute)
    want = per_document(layer, x, r, lengths, None if per_token else sum(lengths))
    assert any(n.startswith("indexer.") for n in want.grads), "the indexer loss never ran"
    assert want.logged > 0
    assert_same(got, want)


@pytest.mark.parametrize(("kind", "sparse"), [("window", True), ("csa", True), ("csa", False),
                                              ("hca", True)])
def test_packed_row_chunks_equal_whole(kind, sparse):
    """Parts of 16 rows cut the documents (9 | 30 | 22): each part's loss reads the documents
    it holds rows of."""
    lengths = LENGTHS
    cfg = dict(v4_indexer_loss_coeff=0.5, v4_indexer_use_sparse_loss=sparse)
    whole = build(kind, seed=8, **cfg)
    parts = build(kind, seed=8, v4_row_chunk=16, **cfg)
    x, r = inputs(sum(lengths), whole.config.hidden_size, seed=9)
    params = packed_params(lengths)
    assert_same(run(parts, x, r, params), run(whole, x, r, params))


@pytest.mark.parametrize("kind", list(LAYERS))
def test_padded_documents_give_their_real_rows_alone(kind):
    """cu_seqlens_q_padded: each document occupies its padded rows (the padding rows belong to
    it, after its real rows); the real rows equal the real document alone."""
    layer = build(kind, seed=10)
    lengths, padded = LENGTHS, (12, 32, 24)
    x, r = inputs(sum(padded), layer.config.hidden_size, seed=11)
    real = document_prefix_rows(lengths, padded, DEVICE)
    r_real = torch.zeros_like(r)
    r_real[real] = r[real]  # the loss reads the real rows only
    got = run(layer, x, r_real, packed_params(lengths, padded))
    want = per_document(layer, x[real], r[real], lengths)
    assert_same(got._replace(out=got.out[real], x_grad=got.x_grad[real]), want)
    padding = torch.ones(sum(padded), dtype=torch.bool, device=DEVICE)
    padding[real] = False
    assert bool((got.x_grad[padding] == 0).all())  # real rows never read the padding


def test_bad_cu_seqlens_name_the_argument():
    layer = build("csa")
    x = torch.randn(61, 1, layer.config.hidden_size).to(DEVICE)
    with pytest.raises(ValueError, match=r"HyScaleV4Attention: packed cu_seqlens must rise .*"
                                         r"packed_seq_params\.cu_seqlens_q\)"):
        layer(x[:60], None, packed_seq_params=packed_params(LENGTHS))
    params = packed_params(LENGTHS)
    params.cu_seqlens_kv = torch.tensor([0, 30, 61], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="HyScaleV4Attention: packed THD with different"):
        layer(x, None, packed_seq_params=params)
    with pytest.raises(ValueError, match=r"cu_seqlens_q_padded\)"):
        layer(x, None, packed_seq_params=packed_params(LENGTHS, (10, 30, 20)))
    with pytest.raises(ValueError, match="cu_seqlens_q .* must give every document at most"):
        layer(x, None, packed_seq_params=packed_params((9, 33, 19), (9, 30, 22)))
    with pytest.raises(NotImplementedError, match="qkv_format='sbhd'"):
        layer(x, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_real_token_mask_loss_is_the_valid_rows_alone(sparse, per_token, recompute):
    """The last rows of some documents masked out of the indexer loss: the valid rows' output,
    the indexer loss (their mean, or KL sum when per-token) and every gradient are those of
    each document's valid rows run alone (the same selection: causal, per document); the
    outputs are the unmasked run's, the indexer's gradients and loss are not."""
    layer = build("csa", seed=12, v4_indexer_loss_coeff=0.5, v4_indexer_use_sparse_loss=sparse,
                  calculate_per_token_loss=per_token)
    lengths, valid = (LENGTHS_WITH_EMPTY, VALID_WITH_EMPTY) if sparse else (LENGTHS, VALID)
    x, r = inputs(sum(lengths), layer.config.hidden_size, seed=13)
    replay.reset_stats()
    check_prefix_mask(lambda x, r, p: run(layer, x, r, p, recompute),
                      partial(per_document, layer), x, r, lengths, valid, per_token=per_token)
    replay.assert_drained()


@pytest.mark.parametrize("sparse", [False, True])
def test_real_token_mask_of_padded_documents(sparse):
    """cu_seqlens_q_padded and a mask of the real rows (megatron's real_token_mask_q): the loss
    is each real document's alone; the padding rows still attend."""
    layer = build("csa", seed=14, v4_indexer_loss_coeff=0.5, v4_indexer_use_sparse_loss=sparse)
    lengths, padded = LENGTHS, (12, 32, 24)
    x, r = inputs(sum(padded), layer.config.hidden_size, seed=15)
    check_prefix_mask(partial(run, layer), partial(per_document, layer), x, r, lengths,
                      lengths, padded=padded)


@pytest.mark.parametrize(("sparse", "per_token"), [(False, False), (True, False), (True, True)])
def test_real_token_mask_row_chunks(sparse, per_token):
    """Row parts of 16 rows cutting the documents (9 | 30 | 22), some of their rows masked:
    each part adds its valid rows' KL sum, divided once by the layer's valid-row count, so the
    parts give each document's valid rows alone (the whole layer's, unchunked)."""
    cfg = dict(v4_indexer_loss_coeff=0.5, v4_indexer_use_sparse_loss=sparse,
               calculate_per_token_loss=per_token)
    parts, whole = build("csa", seed=16, v4_row_chunk=16, **cfg), build("csa", seed=16, **cfg)
    x, r = inputs(sum(LENGTHS), parts.config.hidden_size, seed=17)
    check_prefix_mask(partial(run, parts), partial(per_document, whole), x, r, LENGTHS, VALID,
                      per_token=per_token)


@pytest.mark.parametrize("kind", ["window", "hca"])
def test_real_token_mask_without_an_indexer_changes_nothing(kind):
    """Window and HCA layers have no indexer loss: with the loss coefficient set and a mask,
    their step is the unmasked one."""
    layer = build(kind, seed=18, v4_indexer_loss_coeff=0.5)
    x, r = inputs(sum(LENGTHS), layer.config.hidden_size, seed=19)
    params = packed_params(LENGTHS)
    params.real_token_mask_q = prefix_mask(VALID, LENGTHS, DEVICE)
    got = run(layer, x, r, params)
    assert got.logged == 0
    assert_same(got, run(layer, x, r, packed_params(LENGTHS)))

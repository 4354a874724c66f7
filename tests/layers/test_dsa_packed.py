"""HyScaleDSAttention on packed THD sequences against megatron-core's DSAttention (fp32, CPU).

Three documents of uneven length (one shorter than top-k) packed in one sequence: the output,
the input gradient, every parameter gradient (the indexer's come from the indexer loss only)
and the logged indexer loss equal stock's, dense and sparse loss, with and without activation
recompute, also with padded rows masked out of the indexer loss (real_token_mask_q); HyScale's
own path runs (no fallback warning) and replays its selection.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)
from megatron.core.transformer.spec_utils import build_module

from hyscale_bench.models import default_device, tiny_dsa_config
from megatron_hyscale import replay
from megatron_hyscale.specs import get_dsa_layer_specs
from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

DEVICE = default_device()
LENGTHS = (13, 40, 27)  # top-k is 16: the first document has fewer keys than that


@pytest.fixture(autouse=True)
def stock_ties_by_index():
    with stock_topk_breaks_ties_by_index():
        yield


def packed_params(lengths=LENGTHS, padded=None):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    extra = {} if padded is None else dict(cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths), **extra)


def build_pair(**overrides):
    cfg = tiny_dsa_config(num_layers=1, dsa_indexer_topk=16, **overrides)

    def build(stock):
        spec = get_dsa_layer_specs(cfg, stock=stock)[0].submodules.self_attention
        torch.manual_seed(0)
        return build_module(spec, config=cfg, layer_number=1).to(DEVICE)

    stock, hyscale = build(True), build(False)
    hyscale.load_state_dict(stock.state_dict(), strict=True)
    return stock, hyscale


def step(attn, hidden, params, recompute):
    attn.train()
    attn.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    h = hidden.clone().requires_grad_()
    call = lambda x: attn(x, None, packed_seq_params=params)[0]  # noqa: E731
    out = tensor_parallel.checkpoint(call, False, h) if recompute else call(h)
    out.pow(2).mean().backward()
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    logged = values.clone() if values is not None else torch.zeros(0)
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    grads = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
    return out.detach(), h.grad, grads, logged


def hyscale_step(hyscale, hidden, params, recompute):
    """`step` on HyScale's layer, which must keep to its own path (a fallback warning fails)
    and compute the selection once, replaying it under recompute, with the store drained."""
    replay.reset_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="HyScaleDSAttention", category=RuntimeWarning)
        got = step(hyscale, hidden, params, recompute)
    stats = replay.get_stats()
    assert (stats["selections_computed"], stats["selections_replayed"]) == (
        1, 1 if recompute else 0)
    replay.assert_drained()
    return got


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_packed_thd_matches_stock(sparse, recompute):
    stock, hyscale = build_pair(dsa_indexer_use_sparse_loss=sparse)
    params = packed_params()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(sum(LENGTHS), 1, 64, generator=g).to(DEVICE)
    want = step(stock, hidden, params, recompute)
    got = hyscale_step(hyscale, hidden, params, recompute)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-7)
    assert set(got[2]) == set(want[2])
    assert any(".indexer." in n for n in want[2]), "no indexer gradient: the loss never ran"
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert want[3].abs().sum() > 0
    # The KL (~1e-5 here) is a difference of near-equal O(1) terms: on the GPU HyScale's
    # kernels sum them in another order than stock's torch, and fp32 rounding shows at ~1e-4
    # relative (the dense loss: 2.2e-4 on an H100, 2026-12-07); on the CPU the references'
    # sums agree to 1e-4.
    torch.testing.assert_close(got[3], want[3], rtol=1e-3 if got[3].is_cuda else 1e-4, atol=0.0)


def test_packed_documents_select_only_their_own_keys():
    _, hyscale = build_pair()
    core = hyscale.core_attention
    seen = []
    original = core._selection

    def spy(*a, **kw):
        out = original(*a, **kw)
        seen.append(out[0])  # (indices, the selected scores' log-sum-exp or None)
        return out

    core._selection = spy
    hidden = torch.randn(sum(LENGTHS), 1, 64).to(DEVICE)
    with torch.no_grad():
        hyscale.eval()
        hyscale(hidden, None, packed_seq_params=packed_params())
    (indices,) = seen
    start = 0
    for length in LENGTHS:
        rows = indices[0, start:start + length]
        valid = rows >= 0
        assert bool((rows[valid] >= start).all()), "a row selected another document's key"
        row_pos = torch.arange(start, start + length, device=rows.device).unsqueeze(-1)
        assert bool((rows[valid] <= row_pos.expand_as(rows)[valid]).all())
        # every visible key is selected while the document is shorter than top-k
        assert valid.sum(-1).tolist() == [min(16, i + 1) for i in range(length)]
        start += length


def test_mismatched_cu_seqlens_name_the_layer():
    _, hyscale = build_pair()
    params = packed_params()
    params.cu_seqlens_kv = torch.tensor([0, 40, 80], dtype=torch.int32, device=DEVICE)
    # Named by the layer that meets the layout first: the MLA's own projections.
    with pytest.raises(ValueError, match="HyScaleMLASelfAttention: packed THD with different"):
        hyscale(torch.randn(80, 1, 64).to(DEVICE), None, packed_seq_params=params)


@pytest.mark.parametrize("reading", ["per-document", "whole-pack", "padded"])
def test_own_projections_are_megatrons(reading):
    """HyScaleMLASelfAttention's own query, key and compressed query equal AbsorbedMLA's on
    the same module. megatron's THD RoPE puts a row at its position in its document, or,
    where max_seqlen equals the packed length (its frequency table then covers the whole
    sequence), at its position in the whole sequence; the two readings give other queries
    (the layer's output barely moves: RoPE is relative within a document)."""
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
        AbsorbedMLASelfAttention,
    )

    _, hyscale = build_pair()
    padded = torch.tensor([0, 16, 56, 80], dtype=torch.int32, device=DEVICE)
    params = packed_params(padded=padded if reading == "padded" else None)
    rows = 80 if reading == "padded" else sum(LENGTHS)
    if reading == "whole-pack":
        params.max_seqlen_q = params.max_seqlen_kv = rows
    hidden = torch.randn(rows, 1, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    with torch.no_grad():
        got = hyscale.get_query_key_value_tensors(hidden, None, params)
        want = AbsorbedMLASelfAttention.get_query_key_value_tensors(hyscale, hidden, None,
                                                                    params)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.is_contiguous()
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        if reading == "whole-pack":  # the comparison can fail: the other reading differs
            params.max_seqlen_q = params.max_seqlen_kv = max(LENGTHS)
            other = hyscale.get_query_key_value_tensors(hidden, None, params)[0]
            assert (other - want[0]).abs().max() > 1e-2


def test_padded_documents_use_their_storage_rows():
    """cu_seqlens_q_padded gives the rows each document occupies, as megatron masks them."""
    stock, hyscale = build_pair(dsa_indexer_use_sparse_loss=True)
    padded = torch.tensor([0, 16, 56, 80], dtype=torch.int32, device=DEVICE)
    params = packed_params(padded=padded)
    hidden = torch.randn(80, 1, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = step(stock, hidden, params, recompute=False)
    got = hyscale_step(hyscale, hidden, params, recompute=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6)


def real_token_mask(padded, lengths, shape=(80,)):
    """True at each document's real tokens (its first `lengths` storage rows)."""
    mask = torch.zeros(80, dtype=torch.bool)
    for start, n in zip(padded.tolist(), lengths):
        mask[start:start + n] = True
    return mask.view(shape).to(DEVICE)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("sparse,per_token", [(False, False), (True, False), (True, True)])
def test_real_token_mask_matches_stock(sparse, per_token, recompute):
    """Padded documents whose padding rows are masked out of the indexer loss
    (real_token_mask_q): they still select and attend, as stock, and the loss is the mean over
    the real rows. Outputs, logged loss and every gradient equal stock's, on HyScale's own
    path (no fallback warning), its selection replayed under recompute."""
    stock, hyscale = build_pair(dsa_indexer_use_sparse_loss=sparse,
                                calculate_per_token_loss=per_token)
    padded = torch.tensor([0, 16, 56, 80], dtype=torch.int32, device=DEVICE)
    params = packed_params(padded=padded)  # real documents 13, 40, 27 in 16, 40, 24 rows
    params.real_token_mask_q = real_token_mask(padded, (13, 33, 20), shape=(1, 80))
    hidden = torch.randn(80, 1, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = step(stock, hidden, params, recompute)
    got = hyscale_step(hyscale, hidden, params, recompute)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-7)
    assert set(got[2]) == set(want[2])
    assert any(".indexer." in n for n in want[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert want[3].abs().sum() > 0
    # A row's KL (~1e-5 here) is a sum of O(1) terms that cancel: fp32 rounding leaves up to
    # ~1e-8 of it (either implementation, at random sign); the mean divides that by the rows.
    torch.testing.assert_close(got[3], want[3], rtol=1e-4,
                               atol=1e-8 * (int(params.real_token_mask_q.sum())
                                            if per_token else 1))
    # The mask changes the loss and the indexer's gradients: the test can fail.
    params.real_token_mask_q = None
    unmasked = step(hyscale, hidden, params, recompute)
    assert not torch.allclose(unmasked[3], got[3])
    weight = "core_attention.indexer.linear_wq_b.weight"
    assert not torch.allclose(unmasked[2][weight], got[2][weight])


def test_real_token_mask_leaves_padding_rows_without_indexer_gradient():
    """Rows outside the mask add nothing to the indexer loss: with only the first document's
    rows valid, the indexer's query projection sees no gradient from the others' rows; all
    rows masked: the loss is 0 (the count clamped at 1, as stock's)."""
    _, hyscale = build_pair(dsa_indexer_use_sparse_loss=True)
    params = packed_params()
    hidden = torch.randn(80, 1, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    params.real_token_mask_q = torch.zeros(80, dtype=torch.bool, device=DEVICE)
    *_, logged = step(hyscale, hidden, params, recompute=False)
    assert logged.abs().sum() == 0
    # The first document alone, masked or cut out: the same loss.
    params.real_token_mask_q = torch.arange(80, device=DEVICE) < 13
    *_, masked = step(hyscale, hidden, params, recompute=False)
    *_, alone = step(hyscale, hidden[:13], packed_params(lengths=(13,)), recompute=False)
    assert masked.abs().sum() > 0
    # The KL (~1e-6 here) is a difference of near-equal O(1) terms: on the GPU the kernels
    # tile 80 rows and 13 rows differently, and fp32 rounding shows up at ~1e-4 relative
    # (measured 1.4e-4 on an H200); on the CPU the reference's sums agree to 1e-5.
    torch.testing.assert_close(masked, alone, rtol=1e-3 if masked.is_cuda else 1e-5, atol=0.0)


def test_documents_are_read_once_and_again_after_an_in_place_change():
    from megatron_hyscale.layers.packed import packed_documents

    params = packed_params()
    assert packed_documents(params, 80, layer="L") == ((0, 13), (13, 53), (53, 80))
    params.cu_seqlens_q[1] = 20  # a reused buffer rewritten in place
    params.cu_seqlens_kv = params.cu_seqlens_q
    assert packed_documents(params, 80, layer="L") == ((0, 20), (20, 53), (53, 80))
    with pytest.raises(ValueError, match="L: packed cu_seqlens must rise from 0 to the 81"):
        packed_documents(params, 81, layer="L")


@pytest.mark.parametrize("sparse,target", [(False, "auto"), (True, "separate"),
                                           (True, "attention_backward")])
def test_row_parts_of_packed_documents_add_up_to_the_whole(sparse, target):
    """The core attention's row parts (`prepare` once, `attend_rows` per part, as the
    row-chunked MLA layer runs them) on packed documents with padded rows masked out of the
    loss: parts that cut documents give the whole's output, indexer loss and gradients (the
    dense loss per document per part, at the part's positions in the document)."""
    _, hyscale = build_pair(dsa_indexer_use_sparse_loss=sparse)
    hyscale.config.hyscale_indexer_target = target  # "auto" takes the backward's on CUDA
    core = hyscale.core_attention
    core.train()
    padded = torch.tensor([0, 16, 56, 80], dtype=torch.int32, device=DEVICE)
    params = packed_params(padded=padded)
    params.real_token_mask_q = real_token_mask(padded, (13, 33, 20))
    g = torch.Generator().manual_seed(8)
    x, qr = torch.randn(80, 1, 64, generator=g), torch.randn(80, 1, 32, generator=g)
    key = torch.randn(80, 1, 1, 40, generator=g)
    query = torch.randn(80, 1, 4, 40, generator=g)
    up_v = torch.randn(4, 16, 32, generator=g)
    x, qr, key, query, up_v = (t.to(DEVICE) for t in (x, qr, key, query, up_v))

    def run(bounds):
        core.zero_grad(set_to_none=True)
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        state = core.prepare(key, None, x, qr, sq=80, b=1, packed_seq_params=params)
        outs, losses = [], []
        for r0, r1 in zip(bounds, bounds[1:]):
            out, loss = core.attend_rows(query[r0:r1], state, r0, r1, up_v)
            outs.append(out)
            losses.append(loss)
        torch.cat(outs).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in core.named_parameters() if p.grad is not None}
        if target == "attention_backward":
            # The target comes from the attention backward: each part returns None and logs
            # its share from the backward (the tracker adds them).
            assert losses == [None] * len(losses)
            total = DSAIndexerLossLoggingHelper.tracker["values"].sum()
        else:
            total = sum(losses)
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        return torch.cat(outs).detach(), total, grads

    whole = run([0, 80])
    parts = run([0, 10, 30, 61, 80])  # cutting the first and the second document
    torch.testing.assert_close(parts[0], whole[0], rtol=1e-5, atol=1e-6)
    assert whole[1] > 0
    torch.testing.assert_close(parts[1], whole[1], rtol=1e-5, atol=1e-9)
    assert set(parts[2]) == set(whole[2]) and any("indexer." in n for n in whole[2])
    for name in whole[2]:
        torch.testing.assert_close(parts[2][name], whole[2][name], rtol=1e-4, atol=1e-7)

"""HyScaleDSAttention on packed THD sequences against megatron-core's DSAttention (fp32, CPU).

Three documents of uneven length (one shorter than top-k) packed in one sequence: the output,
the input gradient, every parameter gradient (the indexer's come from the indexer loss only)
and the logged indexer loss equal stock's, dense and sparse loss, with and without activation
recompute; HyScale's own path runs (no fallback warning) and replays its selection.
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


@pytest.fixture(autouse=True)
def empty_loss_tracker():
    """megatron's indexer-loss tracker is a process-wide dict sized by the first model that
    logs: these one-layer modules must not leave it behind for the next test's models."""
    yield
    DSAIndexerLossLoggingHelper.tracker.clear()


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


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_packed_thd_matches_stock(sparse, recompute):
    stock, hyscale = build_pair(dsa_indexer_use_sparse_loss=sparse)
    params = packed_params()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(sum(LENGTHS), 1, 64, generator=g).to(DEVICE)
    want = step(stock, hidden, params, recompute)
    replay.reset_stats()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="HyScaleDSAttention", category=RuntimeWarning)
        got = step(hyscale, hidden, params, recompute)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 1
    assert stats["selections_replayed"] == (1 if recompute else 0)
    replay.assert_drained()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-7)
    assert set(got[2]) == set(want[2])
    assert any(".indexer." in n for n in want[2]), "no indexer gradient: the loss never ran"
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert want[3].abs().sum() > 0
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=0.0)


def test_packed_documents_select_only_their_own_keys():
    _, hyscale = build_pair()
    core = hyscale.core_attention
    seen = []
    original = core._selection

    def spy(*a, **kw):
        out = original(*a, **kw)
        seen.append(out)
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
    with pytest.raises(ValueError, match="HyScaleDSAttention: packed THD with different"):
        hyscale(torch.randn(80, 1, 64).to(DEVICE), None, packed_seq_params=params)


def test_padded_documents_use_their_storage_rows():
    """cu_seqlens_q_padded gives the rows each document occupies, as megatron masks them."""
    stock, hyscale = build_pair(dsa_indexer_use_sparse_loss=True)
    padded = torch.tensor([0, 16, 56, 80], dtype=torch.int32, device=DEVICE)
    params = packed_params(padded=padded)
    hidden = torch.randn(80, 1, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = step(stock, hidden, params, recompute=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="HyScaleDSAttention", category=RuntimeWarning)
        got = step(hyscale, hidden, params, recompute=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6)


def test_real_token_mask_falls_back_naming_why():
    _, hyscale = build_pair()
    params = packed_params()
    params.real_token_mask_q = torch.ones(80, dtype=torch.bool, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="real_token_mask_q"):
        hyscale(torch.randn(80, 1, 64).to(DEVICE), None, packed_seq_params=params)


def test_documents_are_read_once_and_again_after_an_in_place_change():
    from megatron_hyscale.layers.packed import packed_documents

    params = packed_params()
    assert packed_documents(params, 80, layer="L") == ((0, 13), (13, 53), (53, 80))
    params.cu_seqlens_q[1] = 20  # a reused buffer rewritten in place
    params.cu_seqlens_kv = params.cu_seqlens_q
    assert packed_documents(params, 80, layer="L") == ((0, 20), (20, 53), (53, 80))
    with pytest.raises(ValueError, match="L: packed cu_seqlens must rise from 0 to the 81"):
        packed_documents(params, 81, layer="L")

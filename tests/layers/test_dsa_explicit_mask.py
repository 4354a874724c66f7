"""HyScale's DSA under an explicit attention mask (attn_mask_type=None, a bool attention_mask
[b, 1, sq, skv], True = masked) against megatron-core's DSAttention (fp32, CPU).

The MLA + DSA attention layer is built with attn_mask_type=None (the core attention then takes
the mask alone, as stock: no causality) for both, on the same weights. The mask is
adversarial: batch 0 causal with padded queries and keys at its end, batch 1 bidirectional,
random holes in both, one fully masked row that is no padding row, rows with fewer visible
keys than top-k and rows with more. Output, input gradient, every parameter gradient and the
logged indexer loss equal stock's, dense and sparse loss, with and without recompute, also
with row chunks; a fully masked row outputs zeros, as stock's; HyScale runs no stock forward
and computes its selection once (replayed under recompute).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import build_module

from hyscale_bench.models import default_device, tiny_dsa_config
from megatron_hyscale.specs import get_dsa_layer_specs
from megatron_hyscale.testing.compare import assert_close_to_scale
from megatron_hyscale.testing.dsa_core import training_step
from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

DEVICE = default_device()
T, B, HIDDEN, TOPK = 48, 2, 64, 16
PAD = 8  # batch 0's last rows: padding
EMPTY_ROW = 20  # batch 1: a fully masked row that is no padding row
SCENARIOS = {
    "dense": dict(dsa_indexer_use_sparse_loss=False),
    "dense-recompute": dict(dsa_indexer_use_sparse_loss=False),
    "sparse": dict(dsa_indexer_use_sparse_loss=True),
    "sparse-recompute": dict(dsa_indexer_use_sparse_loss=True),
    "dense-row-chunks": dict(dsa_indexer_use_sparse_loss=False),
    # Layer 2 reuses layer 1's selection (the holder rides on the attention_mask).
    "index-share-recompute": dict(dsa_indexer_use_sparse_loss=True, dsa_indexer_topk_freq=2),
    # Packed THD documents: the mask alone decides, across documents (as stock).
    "packed-dense": dict(dsa_indexer_use_sparse_loss=False),
}


@pytest.fixture(autouse=True)
def stock_ties_by_index():
    with stock_topk_breaks_ties_by_index():
        yield


def adversarial_mask(seed: int = 0) -> torch.Tensor:
    """bool [B, 1, T, T], True = masked (module doc)."""
    g = torch.Generator().manual_seed(seed)
    visible = torch.ones(B, T, T, dtype=torch.bool)
    visible[0] = torch.tril(visible[0])
    visible &= torch.rand(B, T, T, generator=g) > 0.25
    visible[0, T - PAD:, :] = False  # padded queries see nothing
    visible[0, :, T - PAD:] = False  # and no query sees padded keys
    visible[1, EMPTY_ROW] = False
    counts = visible.sum(-1)
    assert (counts == 0).sum() == PAD + 1
    assert ((counts > 0) & (counts < TOPK)).any() and (counts > TOPK).any()
    return (~visible).unsqueeze(1).to(DEVICE)


def build_pair(row_chunk: int | None = None, **overrides):
    """Stock's and HyScale's attention layers (two with index sharing) on the same weights."""
    layers = 2 if overrides.get("dsa_indexer_topk_freq", 1) > 1 else 1
    cfg = tiny_dsa_config(num_layers=layers, dsa_indexer_topk=TOPK, **overrides)

    def build(stock: bool):
        specs = get_dsa_layer_specs(cfg, stock=stock, row_chunk=None if stock else row_chunk)
        torch.manual_seed(0)
        built = []
        for number, spec in enumerate(specs, start=1):
            spec = spec.submodules.self_attention
            # The layer's mask type: None, an explicit mask (the spec's default is causal).
            spec = dataclasses.replace(spec, params={**spec.params, "attn_mask_type": None})
            built.append(build_module(spec, config=cfg, layer_number=number))
        return torch.nn.ModuleList(built).to(DEVICE)

    stock, hyscale = build(True), build(False)
    hyscale.load_state_dict(stock.state_dict(), strict=True)
    return stock, hyscale


def packed_params(lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def step(layers, hidden, mask, recompute, params=None):
    """One forward + backward through the layers (`testing.dsa_core.training_step`)."""

    def call(x):
        for layer in layers:
            x = layer(x, mask, packed_seq_params=params)[0]
        return x

    return training_step(layers, call, {"hidden": hidden}, recompute=recompute)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_explicit_mask_matches_stock(scenario):
    row_chunk = 16 if scenario.endswith("row-chunks") else None
    stock, hyscale = build_pair(row_chunk, **SCENARIOS[scenario])
    assert all(layer.attn_mask_type is None for layer in hyscale)
    mask = adversarial_mask()
    hidden = torch.randn(T, B, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    params = None
    if scenario.startswith("packed"):
        # One packed sequence: batch 1 of the mask (bidirectional, a row that sees nothing),
        # the hidden states of both rows one after the other.
        params, mask, hidden = packed_params((11, 23, 14)), mask[1:], hidden[:, 1:]
    recompute = scenario.endswith("recompute")
    want = step(stock, hidden, mask, recompute, params)
    got = step(hyscale, hidden, mask, recompute, params)
    assert got["fallbacks"] == 0, f"{got['fallbacks']} stock fallback forward(s)"
    # One selection per forward (the index-sharing layer reuses it), replayed per layer.
    assert (got["stats"]["selections_computed"], got["stats"]["selections_replayed"]) == (
        1, len(hyscale) if recompute else 0)
    assert_close_to_scale(got["out"], want["out"], "output", 1e-5)
    assert_close_to_scale(got["dinputs"]["hidden"], want["dinputs"]["hidden"],
                          "input gradient", 1e-5)
    # Stock's result for a row that sees no key: zeros (the output projection has no bias).
    if params is None and len(hyscale) == 1:
        assert not want["out"][T - PAD:, 0].any() and not want["out"][EMPTY_ROW, 1].any()
        assert not got["out"][T - PAD:, 0].any() and not got["out"][EMPTY_ROW, 1].any()
    assert set(got["grads"]) == set(want["grads"])
    assert any(".indexer." in n for n in want["grads"]), "the indexer loss never ran"
    for name, grad in want["grads"].items():
        # The indexer's gradients come from the KL alone: looser than the main path's.
        assert_close_to_scale(got["grads"][name], grad, name,
                              1e-4 if ".indexer." in name else 1e-5)
    assert want["indexer_loss"].abs().sum() > 0
    assert_close_to_scale(got["indexer_loss"], want["indexer_loss"], "indexer loss", 5e-4)


def test_mask_errors_name_the_argument():
    _, (hyscale,) = build_pair()
    hidden = torch.randn(T, B, HIDDEN).to(DEVICE)
    mask = adversarial_mask()
    with pytest.raises(ValueError, match="attention_mask must be bool"):
        hyscale(hidden, mask.float())
    with pytest.raises(ValueError, match=r"attention_mask must be \[b, 1, sq, skv\]"):
        hyscale(hidden, mask[:, :, :, :-1])
    with pytest.raises(ValueError, match="attn_mask_type=None needs an attention_mask"):
        hyscale(hidden, None)
    hyscale.attn_mask_type = AttnMaskType.padding
    with pytest.raises(ValueError, match="attn_mask_type must be AttnMaskType.causal or None"):
        hyscale(hidden, mask)

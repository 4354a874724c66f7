"""HyScaleDSAttention with per-head K and V (value given: the non-absorbed layout, stock's
`unfused_dsa_fn`) against megatron-core's DSAttention on the same weights (fp32, CPU).

The core attention is called directly (an MLA layer makes the absorbed layout): query [T, B,
np, hn], key [T, B, np or 1, hn], value [T, B, np or 1, hnv]. Output, the gradients of query,
key and value, every parameter's (the indexer's, from its loss) and the logged indexer loss
equal stock's, dense and sparse loss, with and without recompute, causal and under an explicit
mask; HyScale runs no stock forward and computes its selection once (replayed under
recompute).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from hyscale_bench.models import default_device, tiny_dsa_config
from megatron_hyscale.testing.dsa_core import assert_core_steps_match, build_core_pair, core_step
from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

DEVICE = default_device()
T, B, HEADS, HN, HNV, HIDDEN, Q_LORA = 40, 2, 4, 24, 16, 64, 32
TOPK = 16
SCENARIOS = {
    "dense": dict(loss=dict(dsa_indexer_use_sparse_loss=False)),
    "dense-recompute": dict(loss=dict(dsa_indexer_use_sparse_loss=False), recompute=True),
    "sparse-recompute": dict(loss=dict(dsa_indexer_use_sparse_loss=True), recompute=True),
    "sparse-mask": dict(loss=dict(dsa_indexer_use_sparse_loss=True), mask=True),
    "dense-mask-recompute": dict(loss=dict(dsa_indexer_use_sparse_loss=False), mask=True,
                                 recompute=True),
    # One KV head shared by the query heads (stock's loss cannot take it: no loss here).
    "mqa-key-no-loss": dict(loss=dict(dsa_indexer_loss_coeff=0.0), key_heads=1),
}


@pytest.fixture(autouse=True)
def stock_ties_by_index():
    with stock_topk_breaks_ties_by_index():
        yield


def inputs(key_heads: int = HEADS, seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    tensors = dict(query=r(T, B, HEADS, HN), key=r(T, B, key_heads, HN), value=r(T, B, HEADS, HNV))
    return tensors, dict(x=r(T, B, HIDDEN), qr=r(T, B, Q_LORA))


def random_mask(seed: int = 1) -> torch.Tensor:
    """bool [B, 1, T, T], True = masked: batch 0 causal, batch 1 bidirectional, random holes."""
    g = torch.Generator().manual_seed(seed)
    visible = torch.ones(B, T, T, dtype=torch.bool)
    visible[0] = torch.tril(visible[0])
    visible &= torch.rand(B, T, T, generator=g) > 0.3
    return (~visible).unsqueeze(1).to(DEVICE)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_value_layout_matches_stock(scenario):
    case = SCENARIOS[scenario]
    cfg = tiny_dsa_config(num_layers=1, dsa_indexer_topk=TOPK, **case["loss"])
    mask = case.get("mask", False)
    stock, hyscale = (m.to(DEVICE) for m in build_core_pair(
        cfg, k_channels=HN, v_channels=HNV, attn_mask_type=None if mask else "causal"))
    tensors, rest = inputs(case.get("key_heads", HEADS))
    rest.update(attention_mask=random_mask(), attn_mask_type=None) if mask else rest.update(
        attn_mask_type=AttnMaskType.causal)
    recompute = case.get("recompute", False)
    want = core_step(stock, tensors, recompute=recompute, **rest)
    got = core_step(hyscale, tensors, recompute=recompute, **rest)
    assert_core_steps_match(got, want)
    assert set(want["dinputs"]) == {"query", "key", "value"}
    loss = cfg.dsa_indexer_loss_coeff > 0
    assert bool(want["grads"]) == loss, "the indexer loss ran iff it should"
    if loss:
        assert want["indexer_loss"].abs().sum() > 0
    assert (got["stats"]["selections_computed"], got["stats"]["selections_replayed"]) == (
        1, 1 if recompute else 0)

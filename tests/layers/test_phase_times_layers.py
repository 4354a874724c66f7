"""megatron_hyscale.phase_times on tiny GPT models of HyScale's three layers (DSA, DeepSeek-V4
CSA, QSA) and of stock megatron-core's DSA: each layer's phases are all seen, a slow selection
is counted as selection (not as communication), and timing changes no result."""

from __future__ import annotations

import time

import pytest
import torch
from megatron.core.models.gpt import GPTModel

import megatron_hyscale.layers.deepseek_v4 as v4_layers
import megatron_hyscale.layers.dsa as dsa_layers
import megatron_hyscale.layers.qsa as qsa_layers
from hyscale_bench.models import build_gpt, default_device, tiny_dsa_config
from megatron_hyscale import phase_spans, phase_times

DEVICE = default_device()
VOCAB, B = 61, 1
SLOW_S = 0.05


def dsa_model(stock: bool = False) -> tuple[GPTModel, int]:
    cfg = tiny_dsa_config(deterministic_mode=True)
    return build_gpt(cfg, stock=stock, vocab_size=VOCAB, max_sequence_length=64), 64


def v4_model() -> tuple[GPTModel, int]:
    pytest.importorskip("transformers.models.deepseek_v4")
    from megatron_hyscale.specs.deepseek_v4 import get_v4_block_spec
    from megatron_hyscale.testing.deepseek_v4 import tiny_v4_configs

    cfg, _ = tiny_v4_configs(compress_ratios=[4], index_topk=3, window=8,
                             v4_indexer_loss_coeff=0.1, deterministic_mode=True)
    model = GPTModel(config=cfg, transformer_layer_spec=get_v4_block_spec(cfg),
                     vocab_size=VOCAB, max_sequence_length=40,
                     share_embeddings_and_output_weights=False, position_embedding_type="none")
    return model.to(DEVICE), 40


def qsa_model() -> tuple[GPTModel, int]:
    pytest.importorskip("transformers.models.qwen4_exp")
    from megatron_hyscale.specs.qsa import get_qsa_block_spec
    from megatron_hyscale.testing.qsa import tiny_qsa_configs

    cfg, _ = tiny_qsa_configs(qsa_indexer_loss_coeff=0.1, deterministic_mode=True)
    model = GPTModel(config=cfg, transformer_layer_spec=get_qsa_block_spec(cfg),
                     vocab_size=VOCAB, max_sequence_length=70, position_embedding_type="rope",
                     rotary_percent=0.5, share_embeddings_and_output_weights=False)
    return model.to(DEVICE), 70


# name -> (model builder, the layer module whose `hytopk` the selection calls, whether the
# layer communicates without context parallelism: DSA and QSA start their K / V gathers at
# CP 1 too (no-ops), V4 gathers only under CP, see tests/parallel/test_cp_csa.py)
HYSCALE_MODELS = {"dsa": (dsa_model, dsa_layers, True), "v4": (v4_model, v4_layers, False),
                  "qsa": (qsa_model, qsa_layers, True)}


def slow_selection(monkeypatch: pytest.MonkeyPatch, module) -> None:
    fast = module.hytopk

    def slow_hytopk(*args, **kwargs):
        time.sleep(SLOW_S)
        return fast(*args, **kwargs)

    monkeypatch.setattr(module, "hytopk", slow_hytopk)


def train_step(model: GPTModel, T: int) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    pos = torch.arange(T, device=DEVICE)[None]
    model(ids, pos, None, labels=ids).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def timed_step(variant: str, model: GPTModel, T: int) -> tuple[dict, dict]:
    try:
        timer = phase_times.enable_from_env(variant)
        assert timer is not None
        grads = train_step(model, T)
        totals = timer.end_step()
    finally:
        phase_times.disable()
    assert phase_spans.installed() is None  # disable() stopped the spans' timing
    return totals, grads


@pytest.mark.parametrize("name", list(HYSCALE_MODELS))
def test_hyscale_layers_report_every_phase(name, monkeypatch):
    """Selection (a slow one, whole), attention and indexer loss (forward and backward) and,
    where the layer gathers, communication: the spans the layer marks itself. The timed step
    gives the untimed step's gradients bit for bit."""
    monkeypatch.setenv(phase_times.ENV, "1")
    build, module, communicates = HYSCALE_MODELS[name]
    slow_selection(monkeypatch, module)
    torch.manual_seed(0)
    model, T = build()
    expected = train_step(model, T)
    totals, grads = timed_step("hyscale", model, T)
    assert totals["selection"][1] >= 1 and totals["selection"][0] >= SLOW_S * 1e3, totals
    assert totals["attention"][1] >= 2, totals  # forward + backward
    assert totals["indexer_loss"][1] >= 2, totals  # forward + backward
    if communicates:
        assert totals["communication"][1] >= 1, totals
        assert totals["communication"][0] < SLOW_S * 1e3 / 2, totals  # nothing to wait on
    else:
        assert totals["communication"] == (0.0, 0), totals
    assert grads.keys() == expected.keys()
    for n, grad in expected.items():
        assert torch.equal(grads[n], grad), n


def test_stock_dsa_reports_every_phase(monkeypatch):
    """Stock megatron-core's DSA, timed through its functions wrapped by name."""
    monkeypatch.setenv(phase_times.ENV, "1")
    from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa

    original = stock_dsa.fused_qk_topk_naive
    torch.manual_seed(0)
    model, T = dsa_model(stock=True)
    totals, _ = timed_step("stock", model, T)
    assert totals["selection"][1] >= 1, totals
    assert totals["attention"][1] >= 2, totals  # forward + backward
    assert totals["indexer_loss"][1] >= 1, totals
    assert stock_dsa.fused_qk_topk_naive is original  # disable() put it back

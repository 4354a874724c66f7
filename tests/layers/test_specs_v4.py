"""A tiny 3-layer GPT with V4's attention pattern (window, CSA, HCA) builds and trains on CPU."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from hyscale_bench.models import default_device
from megatron_hyscale import replay
from megatron_hyscale.layers.deepseek_v4 import HyScaleV4Attention
from megatron_hyscale.specs.deepseek_v4 import get_v4_block_spec
from megatron_hyscale.testing.compare import assert_grads_close

pytest.importorskip("transformers.models.deepseek_v4")
from megatron_hyscale.testing.deepseek_v4 import tiny_v4_configs  # noqa: E402

DEVICE = default_device()
VOCAB, T, B = 61, 140, 2  # T > 128: the HCA layer has one complete window
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def build(baseline: bool = False, **overrides) -> GPTModel:
    cfg, _ = tiny_v4_configs(compress_ratios=[0, 4, 128], hca_ratio=128, index_topk=8,
                             window=16, **overrides)
    torch.manual_seed(3)
    return GPTModel(config=cfg, transformer_layer_spec=get_v4_block_spec(cfg, baseline=baseline),
                    vocab_size=VOCAB, max_sequence_length=T, pre_process=True,
                    post_process=True, share_embeddings_and_output_weights=False,
                    position_embedding_type="none").to(DEVICE)


def grads(model: GPTModel) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    labels = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=labels).mean()
    assert torch.isfinite(loss)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_v4_pattern_builds_and_runs_forward_backward():
    model = build()
    attns = [m for m in model.modules() if isinstance(m, HyScaleV4Attention)]
    assert [a.compress_ratio for a in attns] == [0, 4, 128]
    assert [a.is_csa for a in attns] == [False, True, False]
    got = grads(model)
    for name, _p in model.named_parameters():
        if ".indexer." in name:
            continue  # the indexer trains only from its (optional, off) KL loss
        assert name in got and got[name].abs().sum() > 0, name


def test_full_recompute_replays_and_baseline_matches():
    # Bitwise on the GPU too: deterministic_mode turns the kernels' fp32 atomics off.
    expected = grads(build(deterministic_mode=True))
    replay.reset_stats()
    got = grads(build(deterministic_mode=True, **FULL))
    stats = replay.get_stats()
    assert stats["selections_computed"] == 1 and stats["selections_replayed"] == 1
    assert replay.pending_entries() == 0
    replay.reset_stats()
    base = grads(build(baseline=True, **FULL))
    stats = replay.get_stats()
    assert stats["selections_computed"] == 2 and stats["selections_replayed"] == 0
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0)
        torch.testing.assert_close(base[name], grad, rtol=1e-5, atol=1e-6)


def _step_with_logged_loss(model: GPTModel):
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    DSAIndexerLossLoggingHelper.tracker.clear()
    got = grads(model)
    logged = DSAIndexerLossLoggingHelper.tracker["values"].clone()
    DSAIndexerLossLoggingHelper.tracker.clear()
    return got, logged


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-loss", "dense-loss"])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recompute"])
def test_row_chunks_match_the_whole_layer(recompute, sparse):
    """v4_row_chunk = 48: the 140 local rows in parts of 48, 48 and 44, each checkpointed, on
    every layer kind (window, CSA with its indexer loss on, HCA): gradients and the logged
    indexer loss equal the unchunked model's (up to summation order); the CSA selection still
    runs once per forward."""
    kw = dict(deterministic_mode=True, v4_indexer_loss_coeff=0.1,
              v4_indexer_use_sparse_loss=sparse, **(FULL if recompute else {}))
    whole, chunked = build(**kw), build(v4_row_chunk=48, **kw)
    chunked.load_state_dict(whole.state_dict())
    expected, expected_logged = _step_with_logged_loss(whole)
    replay.reset_stats()
    got, logged = _step_with_logged_loss(chunked)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 1
    assert stats["selections_replayed"] == (1 if recompute else 0)
    assert replay.pending_entries() == 0
    assert expected_logged.abs().sum() > 0
    torch.testing.assert_close(logged, expected_logged, rtol=1e-4, atol=1e-9)
    assert any(".indexer." in n for n in expected)
    assert_grads_close(got, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_bad_row_chunk_is_refused_by_the_config(bad):
    with pytest.raises(ValueError, match="v4_row_chunk must be a positive int"):
        tiny_v4_configs(compress_ratios=[0, 4, 128], hca_ratio=128, v4_row_chunk=bad)


def test_row_chunks_refuse_fp8():
    model = build(v4_row_chunk=48)
    model.config.fp8 = "e4m3"  # after construction: only the forward's check sees it
    try:
        with pytest.raises(NotImplementedError, match="fp8"):
            grads(model)
    finally:
        model.config.fp8 = None


def test_tensor_parallelism_is_refused_naming_the_setting():
    """V4 attention at TP > 1 is refused as Megatron-LM's own DeepSeek-V4 attention refuses it
    (no stock path to fall back to); the config field is set after construction so that no
    TP group has to exist."""
    cfg, _ = tiny_v4_configs(compress_ratios=[0, 4, 128], hca_ratio=128, index_topk=8,
                             window=16)
    cfg.tensor_model_parallel_size = 2
    with pytest.raises(NotImplementedError, match="tensor_model_parallel_size=1 only"):
        HyScaleV4Attention(cfg, layer_number=2)

"""megatron's `deterministic_mode` reaches the kernels: every sparse-attention and indexer-loss
call of the DSA, V4 (CSA) and QSA layers asks for the backward without fp32 atomics exactly
when the config has it on (megatron-LM's --deterministic-mode)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import GPTModel

import megatron_hyscale.layers.deepseek_v4 as csa_layers
import megatron_hyscale.layers.dsa as dsa_layers
import megatron_hyscale.layers.qsa as qsa_layers
from hyscale_bench.models import build_gpt, default_device, tiny_dsa_config

DEVICE = default_device()
VOCAB, B = 61, 1


def dsa_model(deterministic: bool) -> tuple[GPTModel, int]:
    cfg = tiny_dsa_config(deterministic_mode=deterministic)
    return build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=64), 64


def v4_model(deterministic: bool) -> tuple[GPTModel, int]:
    pytest.importorskip("transformers.models.deepseek_v4")
    from megatron_hyscale.specs.deepseek_v4 import get_v4_block_spec
    from megatron_hyscale.testing.deepseek_v4 import tiny_v4_configs

    cfg, _ = tiny_v4_configs(compress_ratios=[4], index_topk=3, window=8,
                             v4_indexer_loss_coeff=0.1, deterministic_mode=deterministic)
    model = GPTModel(config=cfg, transformer_layer_spec=get_v4_block_spec(cfg),
                     vocab_size=VOCAB, max_sequence_length=40,
                     share_embeddings_and_output_weights=False, position_embedding_type="none")
    return model.to(DEVICE), 40


def qsa_model(deterministic: bool) -> tuple[GPTModel, int]:
    pytest.importorskip("transformers.models.qwen4_exp")
    from megatron_hyscale.specs.qsa import get_qsa_block_spec
    from megatron_hyscale.testing.qsa import tiny_qsa_configs

    cfg, _ = tiny_qsa_configs(qsa_indexer_loss_coeff=0.1, deterministic_mode=deterministic)
    model = GPTModel(config=cfg, transformer_layer_spec=get_qsa_block_spec(cfg),
                     vocab_size=VOCAB, max_sequence_length=70, position_embedding_type="rope",
                     rotary_percent=0.5, share_embeddings_and_output_weights=False)
    return model.to(DEVICE), 70


MODELS = {"dsa": (dsa_model, dsa_layers), "v4": (v4_model, csa_layers),
          "qsa": (qsa_model, qsa_layers)}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_deterministic_mode_reaches_every_kernel_call(name, deterministic, monkeypatch):
    build, module = MODELS[name]
    seen: dict[str, list[bool]] = {"sparse_attention": [], "indexer_kl_loss": []}
    for fn in seen:
        original = getattr(module, fn)

        def spy(*args, _fn=fn, _original=original, **kwargs):
            seen[_fn].append(kwargs.get("deterministic", False))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, fn, spy)
    torch.manual_seed(0)
    model, T = build(deterministic)
    model.train()
    ids = torch.randint(0, VOCAB, (B, T), device=DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    model(ids, pos, None, labels=ids).mean().backward()
    assert seen["sparse_attention"] and seen["indexer_kl_loss"], seen
    assert all(flag == deterministic for flags in seen.values() for flag in flags), seen

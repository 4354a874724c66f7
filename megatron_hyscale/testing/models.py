"""Tiny MLA + DSA GPT models for tests and the demo (any device; fp32 by default)."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_hyscale.specs import get_dsa_block_spec

# Local (torch) modules and no fused kernels: what megatron-core needs to run on a CPU (and
# what makes its results comparable to the references). Shared by every test/bench config.
LOCAL_UNFUSED_FIELDS: dict[str, Any] = dict(
    transformer_impl="local",
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
)


def tiny_dsa_config(**overrides: Any) -> MLATransformerConfig:
    """A small MLA + DSA configuration with local (torch) linears; keyword overrides win."""
    fields: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        multi_latent_attention=True,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
        rope_type="rope",
        rotary_base=10000,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=4,
        dsa_indexer_head_dim=16,
        dsa_indexer_topk=32,
        dsa_indexer_loss_coeff=0.1,
        dsa_indexer_use_sparse_loss=False,
        # The Hadamard rotation needs bf16 and the fast_hadamard_transform package.
        dsa_indexer_rotate_activation=False,
        params_dtype=torch.float32,
        **LOCAL_UNFUSED_FIELDS,
    )
    fields.update(overrides)
    return MLATransformerConfig(**fields)


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_gpt(config: MLATransformerConfig, *, stock: bool, vocab_size: int,
              max_sequence_length: int, device: torch.device | str | None = None,
              row_chunk: int | None = None) -> GPTModel:
    """GPTModel whose every layer is MLA + HyScale DSA (or megatron-core's DSA if `stock`).

    Parameters are created on the CPU (reproducible from the CPU seed) and moved to `device`
    (default: `default_device()`). row_chunk: HyScale's attention rows per part (layers.mla).
    """
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_dsa_block_spec(config, stock=stock, row_chunk=row_chunk),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="none",
    )
    return model.to(device or default_device())

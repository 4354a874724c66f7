"""Tiny models for tests, the demo and CPU benchmark runs (any device; fp32 by default).

- `tiny_dsa_config` / `build_gpt`: MLA + DSA GPT models;
- `tiny_v4_config`: a DeepSeek-V4 attention configuration (window, CSA and HCA layers);
- `randomize_`: well-scaled random parameters (a freshly built module's may be uninitialized).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_hyscale.layers.deepseek_v4 import DeepseekV4TransformerConfig
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


# V4-Flash: hidden 4096, 64 heads x 512 (rope 64), q_lora 1024, 8 groups x 1024, indexer 64 x 128.
TINY_V4_GEOMETRY = dict(hidden_size=32, num_attention_heads=4, head_dim=16, rope_dim=8,
                        q_lora_rank=24, o_groups=2, o_lora_rank=8, index_n_heads=8,
                        index_head_dim=16)


def tiny_v4_config(*, csa_ratio: int = 4, hca_ratio: int = 8, window: int = 5,
                   index_topk: int = 3, compress_ratios: list[int] | None = None,
                   yarn: dict | None = None, geometry: dict[str, int] | None = None,
                   **overrides: Any) -> DeepseekV4TransformerConfig:
    """A tiny DeepSeek-V4 attention configuration with local (torch) linears.

    compress_ratios: per layer (0 window, csa_ratio CSA, hca_ratio HCA); default
    [0, csa_ratio, hca_ratio]. yarn: YaRN parameters for the compress RoPE (e.g. {"factor": 4,
    "original_max_position_embeddings": 16}). geometry: overrides of the sizes (keys as in
    `TINY_V4_GEOMETRY`). Keyword overrides win.
    """
    ratios = compress_ratios or [0, csa_ratio, hca_ratio]
    g = {**TINY_V4_GEOMETRY, **(geometry or {})}
    fields: dict[str, Any] = dict(
        num_layers=len(ratios), hidden_size=g["hidden_size"],
        num_attention_heads=g["num_attention_heads"], ffn_hidden_size=64,
        v4_head_dim=g["head_dim"], v4_rope_head_dim=g["rope_dim"],
        v4_q_lora_rank=g["q_lora_rank"], v4_o_groups=g["o_groups"],
        v4_o_lora_rank=g["o_lora_rank"], v4_sliding_window=window,
        v4_compress_ratios=list(ratios), v4_csa_ratio=csa_ratio,
        v4_index_n_heads=g["index_n_heads"], v4_index_head_dim=g["index_head_dim"],
        v4_index_topk=index_topk, normalization="RMSNorm", layernorm_epsilon=1e-6,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, **LOCAL_UNFUSED_FIELDS,
        v4_compress_rope_scaling=None if yarn is None else {"type": "yarn", **yarn},
    )
    fields.update(overrides)
    return DeepseekV4TransformerConfig(**fields)


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0) -> None:
    """Random, well-scaled values for every parameter (1 / sqrt(fan_in) for projections, norms
    near 1; biases and sinks nonzero, since zeros would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("position_bias") or name == "sinks":
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


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

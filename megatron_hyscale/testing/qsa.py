"""transformers' Qwen4-Exp QSA attention <-> HyScale's Megatron QSA modules: configs and weights.

transformers' `Qwen4ExpTextAttention` (the oracle for QSA semantics) and
`megatron_hyscale.layers.qsa.HyScaleQSASelfAttention` hold the same weights in different layouts:

| transformers (`self_attn.` ...)        | HyScale / megatron (`self_attention.` ...)          |
|----------------------------------------|-----------------------------------------------------|
| q_proj.weight [np * 2 * hn, h]: per    | linear_qkv.weight [ng * (2 r + 2) * hn, h], r =     |
|   head h its query rows then its gate  |   np / ng: per KV group g the query rows of its r   |
|   rows (`view(np, 2 hn)` + `chunk`)    |   heads, their r gate heads, key head g, value      |
| k_proj / v_proj.weight [ng * hn, h]    |   head g (megatron's gated layout)                  |
| o_proj.weight [h, np * hn]             | linear_proj.weight (same layout)                    |
| q_norm / k_norm.weight [hn]            | q_layernorm / k_layernorm.weight                    |
| indexer.index_qk_proj.weight           | core_attention.indexer.linear_qk.weight (same       |
|   [(H_I + 1) * D_I, h]                 |   layout: H_I query heads, then the key head)       |
| indexer.q_layernorm / k_layernorm      | core_attention.indexer.q_layernorm / k_layernorm    |

Norms: transformers' Qwen RMSNorm multiplies by (1 + weight) (zero-centered gamma, zero at
init); megatron's torch RMSNorm by weight. So weight_megatron = 1 + weight_hf, unless
`config.layernorm_zero_centered_gamma` (Transformer Engine norms), where they are equal.
Gradients of the norm weights are equal in both parametrizations (d(1 + w) / dw = 1).
Biases (`attention_bias=True` / `add_qkv_bias`, `add_bias_linear`) map the same way as weights.

RoPE: transformers' (multimodal) rotary embedding with identical text position ids on its three
axes equals megatron's `RotaryEmbedding(kv_channels=head_dim, rotary_percent=
partial_rotary_factor, rotary_base=rope_theta)`; both rotate the first rot dims by rotate-half.
"""

from __future__ import annotations

from typing import Any

import torch

from hyscale_bench.models import LOCAL_UNFUSED_FIELDS
from megatron_hyscale.layers.qsa import QSATransformerConfig

_NORMS = {
    "q_norm.weight": "q_layernorm.weight",
    "k_norm.weight": "k_layernorm.weight",
    "indexer.q_layernorm.weight": "core_attention.indexer.q_layernorm.weight",
    "indexer.k_layernorm.weight": "core_attention.indexer.k_layernorm.weight",
}
_SAME = {
    "o_proj.weight": "linear_proj.weight",
    "o_proj.bias": "linear_proj.bias",
    "indexer.index_qk_proj.weight": "core_attention.indexer.linear_qk.weight",
}


def tiny_qsa_configs(
    *,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    partial_rotary_factor: float = 0.5,
    rope_theta: float = 10000.0,
    indexer_heads: int = 4,
    indexer_head_dim: int = 16,
    budget: int = 32,
    block_size: int = 4,
    eps: float = 1e-6,
    **megatron_overrides: Any,
) -> tuple[QSATransformerConfig, Any]:
    """A matching (QSATransformerConfig, transformers Qwen4ExpTextConfig) pair, fp32, local
    linears; the defaults are a tiny QSA layer (budget 32 tokens = 8 blocks).

    The real model: hidden 2560, 24 / 2 heads of 256, indexer 4 x 128, budget 2048, block 4.
    """
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    fields: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=hidden_size,
        ffn_hidden_size=2 * hidden_size,
        num_attention_heads=num_heads,
        num_query_groups=num_kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        qsa_indexer_n_heads=indexer_heads,
        qsa_indexer_head_dim=indexer_head_dim,
        qsa_indexer_budget=budget,
        qsa_block_size=block_size,
        params_dtype=torch.float32,
        **LOCAL_UNFUSED_FIELDS,
    )
    fields.update(megatron_overrides)
    mcfg = QSATransformerConfig(**fields)
    hcfg = Qwen4ExpTextConfig(
        vocab_size=128,
        hidden_size=hidden_size,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                         "partial_rotary_factor": partial_rotary_factor},
        attention_bias=False,
        attention_dropout=0.0,
        layer_types=["qwen_sparse_attention"],
        indexer_n_heads=indexer_heads,
        indexer_kv_heads=1,
        indexer_head_dim=indexer_head_dim,
        indexer_budget=budget,
        indexer_compress_ratio=block_size,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
    )
    hcfg._attn_implementation = "eager"
    return mcfg, hcfg


def _norm_offset(config: QSATransformerConfig) -> float:
    return 0.0 if config.layernorm_zero_centered_gamma else 1.0


def hf_to_megatron_qsa_state_dict(
    hf_state: dict[str, torch.Tensor], config: QSATransformerConfig, *, gradients: bool = False
) -> dict[str, torch.Tensor]:
    """transformers `Qwen4ExpTextAttention.state_dict()` -> `HyScaleQSASelfAttention` keys.

    `gradients=True` maps gradients instead of weights (no +1 on the norm weights).
    """
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    r = np_ // ng
    out: dict[str, torch.Tensor] = {}
    offset = 0.0 if gradients else _norm_offset(config)
    for key, value in hf_state.items():
        if key in _NORMS:
            out[_NORMS[key]] = value + offset
        elif key in _SAME:
            out[_SAME[key]] = value.clone()
    for suffix in ("weight", "bias"):
        if f"q_proj.{suffix}" not in hf_state:
            continue
        tail = hf_state[f"q_proj.{suffix}"].shape[1:]
        q = hf_state[f"q_proj.{suffix}"].reshape(np_, 2, hn, *tail)
        k = hf_state[f"k_proj.{suffix}"].reshape(ng, hn, *tail)
        v = hf_state[f"v_proj.{suffix}"].reshape(ng, hn, *tail)
        rows = []
        for g in range(ng):
            heads = q[g * r:(g + 1) * r]
            rows += [heads[:, 0].reshape(r * hn, *tail), heads[:, 1].reshape(r * hn, *tail),
                     k[g], v[g]]
        out[f"linear_qkv.{suffix}"] = torch.cat(rows, dim=0)
    return out


def megatron_to_hf_qsa_state_dict(
    state: dict[str, torch.Tensor], config: QSATransformerConfig, *, gradients: bool = False
) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_megatron_qsa_state_dict` (e.g. to compare gradients)."""
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    r = np_ // ng
    out: dict[str, torch.Tensor] = {}
    offset = 0.0 if gradients else _norm_offset(config)
    for hf_key, key in _NORMS.items():
        if key in state:
            out[hf_key] = state[key] - offset
    for hf_key, key in _SAME.items():
        if key in state:
            out[hf_key] = state[key].clone()
    for suffix in ("weight", "bias"):
        if f"linear_qkv.{suffix}" not in state:
            continue
        w = state[f"linear_qkv.{suffix}"]
        tail = w.shape[1:]
        groups = w.reshape(ng, (2 * r + 2) * hn, *tail)
        q, gate, k, v = groups.split([r * hn, r * hn, hn, hn], dim=1)
        q = q.reshape(np_, 1, hn, *tail)
        gate = gate.reshape(np_, 1, hn, *tail)
        out[f"q_proj.{suffix}"] = torch.cat([q, gate], dim=1).reshape(np_ * 2 * hn, *tail)
        out[f"k_proj.{suffix}"] = k.reshape(ng * hn, *tail)
        out[f"v_proj.{suffix}"] = v.reshape(ng * hn, *tail)
    return out


def hf_position_embeddings(hf_config: Any, batch: int, seq_len: int) -> tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    """(cos, sin) [batch, seq_len, rot] of transformers' rotary embedding for text positions
    0..seq_len-1 (the same ids on the three multimodal axes, as Qwen4ExpTextModel makes them)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

    rope = Qwen4ExpTextRotaryEmbedding(hf_config)
    ids = torch.arange(seq_len).view(1, 1, -1).expand(3, batch, -1)
    return rope(torch.zeros(1, dtype=torch.float32), ids)


def hf_causal_mask(batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive [batch, 1, T, T] causal mask transformers' eager attention takes (0 / min)."""
    visible = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)
    return mask.expand(batch, 1, seq_len, seq_len)

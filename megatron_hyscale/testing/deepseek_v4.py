"""transformers' DeepseekV4 attention as an oracle for `layers.deepseek_v4.HyScaleV4Attention`.

- `tiny_v4_configs(...)`: a matching pair (HyScale's `DeepseekV4TransformerConfig` from
  `hyscale_bench.models.tiny_v4_config`, transformers' `DeepseekV4Config`) at tiny sizes, fp32,
  local linears, default RoPE. The oracle's (uninitialized) parameters are filled by
  `hyscale_bench.models.randomize_`.
- `load_from_transformers(ours, hf_attention)`: copy the oracle's weights into HyScale's module.
  The mapping (transformers name -> HyScale name; all tensors keep their layout):
      q_a_proj.weight -> linear_q_a.weight        q_a_norm.weight -> q_a_norm.weight
      q_b_proj.weight -> linear_q_b.weight        kv_proj.weight -> linear_kv.weight
      kv_norm.weight -> kv_norm.weight            o_a_proj.weight -> linear_o_a.weight
      o_b_proj.weight -> linear_o_b.weight        sinks -> sinks
      compressor.{kv_proj,gate_proj}.weight -> compressor.{linear_kv,linear_gate}.weight
      compressor.position_bias -> compressor.position_bias
      compressor.kv_norm.weight -> compressor.kv_norm.weight
      compressor.indexer.q_b_proj.weight -> indexer.linear_q_b.weight
      compressor.indexer.scorer.weights_proj.weight -> indexer.linear_weights.weight
      compressor.indexer.{kv_proj,gate_proj}.weight
          -> indexer.compressor.{linear_kv,linear_gate}.weight
      compressor.indexer.position_bias -> indexer.compressor.position_bias
      compressor.indexer.kv_norm.weight -> indexer.compressor.kv_norm.weight
  (`hf_to_hyscale_name` applies it to one name.)
- `transformers_attention_forward(hf_attention, hf_config, x)`: run the oracle on [B, T, h]
  hidden states with the model's own sliding-window mask and RoPE tables, as
  `DeepseekV4Model` does.

transformers is imported lazily: the package does not depend on it.
"""

from __future__ import annotations

from typing import Any

import torch

from hyscale_bench.models import TINY_V4_GEOMETRY, tiny_v4_config
from megatron_hyscale.layers.deepseek_v4 import DeepseekV4TransformerConfig, HyScaleV4Attention

_PREFIXES = (  # longest first: the indexer lives inside transformers' compressor
    ("compressor.indexer.scorer.weights_proj.", "indexer.linear_weights."),
    ("compressor.indexer.q_b_proj.", "indexer.linear_q_b."),
    ("compressor.indexer.", "indexer.compressor."),
    ("compressor.", "compressor."),
    ("", ""),
)
_LEAVES = {"q_a_proj": "linear_q_a", "q_b_proj": "linear_q_b", "kv_proj": "linear_kv",
           "gate_proj": "linear_gate", "o_a_proj": "linear_o_a", "o_b_proj": "linear_o_b"}


def hf_to_hyscale_name(name: str) -> str:
    """transformers' DeepseekV4Attention parameter name -> HyScaleV4Attention's."""
    for theirs, ours in _PREFIXES:
        if name.startswith(theirs):
            rest = name[len(theirs):]
            head, _, tail = rest.partition(".")
            if tail and head in _LEAVES:
                rest = f"{_LEAVES[head]}.{tail}"
            return ours + rest
    raise AssertionError("unreachable")


def tiny_v4_configs(*, csa_ratio: int = 4, hca_ratio: int = 8, window: int = 5,
                    index_topk: int = 3, compress_ratios: list[int] | None = None,
                    yarn: dict | None = None, geometry: dict[str, int] | None = None,
                    **overrides: Any) -> tuple[DeepseekV4TransformerConfig, Any]:
    """(HyScale config, transformers config) for the same tiny V4 attention geometry.

    compress_ratios: per layer (0 window, csa_ratio CSA, hca_ratio HCA); default
    [0, csa_ratio, hca_ratio]. yarn: YaRN parameters for the compress RoPE (e.g. {"factor": 4,
    "original_max_position_embeddings": 16}) given to both. geometry: overrides of the sizes
    (keys as in `TINY_V4_GEOMETRY`). Keyword overrides go to the HyScale config.
    """
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    ours = tiny_v4_config(csa_ratio=csa_ratio, hca_ratio=hca_ratio, window=window,
                          index_topk=index_topk, compress_ratios=compress_ratios, yarn=yarn,
                          geometry=geometry, **overrides)
    ratios = compress_ratios or [0, csa_ratio, hca_ratio]
    g = {**TINY_V4_GEOMETRY, **(geometry or {})}
    kinds = {0: "sliding_attention", csa_ratio: "compressed_sparse_attention",
             hca_ratio: "heavily_compressed_attention"}
    theirs = DeepseekV4Config(
        hidden_size=g["hidden_size"], num_attention_heads=g["num_attention_heads"],
        head_dim=g["head_dim"], partial_rotary_factor=g["rope_dim"] / g["head_dim"],
        q_lora_rank=g["q_lora_rank"], o_groups=g["o_groups"], o_lora_rank=g["o_lora_rank"],
        index_n_heads=g["index_n_heads"], index_head_dim=g["index_head_dim"],
        index_topk=index_topk, sliding_window=window, num_hidden_layers=len(ratios),
        layer_types=[kinds[r] for r in ratios],
        compress_rates={"compressed_sparse_attention": csa_ratio,
                        "heavily_compressed_attention": hca_ratio},
        rope_theta=ours.v4_rope_theta, compress_rope_theta=ours.v4_compress_rope_theta,
        rms_norm_eps=1e-6, vocab_size=64, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16,
        rope_parameters=None if yarn is None else {"rope_type": "yarn", **yarn},
    )
    theirs._attn_implementation = "eager"
    return ours, theirs


@torch.no_grad()
def load_from_transformers(ours: HyScaleV4Attention, hf_attention: torch.nn.Module) -> None:
    """Copy every parameter of transformers' DeepseekV4Attention into `ours` (strict)."""
    mine = dict(ours.named_parameters())
    theirs = {hf_to_hyscale_name(n): p for n, p in hf_attention.named_parameters()}
    if set(mine) != set(theirs):
        raise ValueError(f"parameter sets differ: only ours {sorted(set(mine) - set(theirs))}, "
                         f"only transformers' {sorted(set(theirs) - set(mine))}")
    for name, p in theirs.items():
        if mine[name].shape != p.shape:
            raise ValueError(f"{name}: shape {tuple(mine[name].shape)} vs {tuple(p.shape)}")
        mine[name].copy_(p)


def transformers_attention_forward(hf_attention: torch.nn.Module, hf_config: Any,
                                   x: torch.Tensor) -> torch.Tensor:
    """transformers' attention output [B, T, hidden] for x [B, T, hidden], positions 0..T-1."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    B, T, _ = x.shape
    positions = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
    rotary = DeepseekV4RotaryEmbedding(hf_config).to(x.device)
    tables = {kind: rotary(x, position_ids=positions, layer_type=kind)
              for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=hf_config, inputs_embeds=x,
                                             attention_mask=None, past_key_values=None,
                                             position_ids=positions)
    out, _ = hf_attention(x, position_embeddings=tables, position_ids=positions,
                          attention_mask=mask)
    return out

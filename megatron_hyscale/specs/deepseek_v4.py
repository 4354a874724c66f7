"""Layer specs for DeepSeek-V4's attention pattern with HyScale's modules.

`get_v4_layer_specs(config)` returns one megatron `TransformerLayer` spec per layer whose
self-attention is `layers.deepseek_v4.HyScaleV4Attention` with that layer's compress ratio from
`config.v4_compress_ratios` (0 window only, 4 CSA, 128 HCA; V4-Flash lists 43 of them);
`baseline=True` gives the CSA layers the side-by-side baseline selector
(`ScoreTableEntrySelector`: materialized indexer scores per row block + torch.topk, recompute
selects again). `get_v4_block_spec` wraps this pipeline stage's
layers in a `TransformerBlockSubmodules`.

Scope: the attention is V4's; the rest of the layer is megatron's (pre-norm residual, the MLP or
MoE megatron's local spec builds from the config). V4's manifold-constrained hyper-connections
(mHC: 4 residual streams), hash routing and its MoE details are not reproduced: these specs
exist to run and time V4's attention layers inside megatron, not to load a V4 checkpoint
end to end. Linears are megatron's local (torch) ones; tensor parallelism is not supported yet.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_hyscale.layers.deepseek_v4 import (
    DeepseekV4TransformerConfig,
    HyScaleV4Attention,
    V4AttentionSubmodules,
    csa_selector,
)


def v4_compress_ratios(config: DeepseekV4TransformerConfig) -> list[int]:
    """The per-layer ratio list (all CSA when the config leaves it unset), validated."""
    ratios = config.v4_compress_ratios
    if ratios is None:
        ratios = [config.v4_csa_ratio] * config.num_layers
    if len(ratios) != config.num_layers:
        raise ValueError(f"v4_compress_ratios has {len(ratios)} entries for "
                         f"{config.num_layers} layers")
    bad = [r for r in ratios if not isinstance(r, int) or r < 0]
    if bad:
        raise ValueError(f"v4_compress_ratios must be ints >= 0 (0 = window only), got {bad}")
    return list(ratios)


def get_v4_layer_specs(config: DeepseekV4TransformerConfig, *, baseline: bool = False
                       ) -> list[ModuleSpec]:
    """One TransformerLayer spec per model layer, attention = HyScaleV4Attention(ratio_i)."""
    base = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                    normalization=config.normalization)
    selector = csa_selector(config, baseline=baseline)
    specs = []
    for ratio in v4_compress_ratios(config):
        attention = ModuleSpec(module=HyScaleV4Attention, submodules=V4AttentionSubmodules(),
                               params={"compress_ratio": ratio, "selector": selector})
        submodules = dataclasses.replace(base.submodules, self_attention=attention)
        specs.append(dataclasses.replace(base, submodules=submodules))
    return specs


def get_v4_block_spec(config: DeepseekV4TransformerConfig, *, baseline: bool = False,
                      vp_stage: int | None = None, pp_rank: int | None = None
                      ) -> TransformerBlockSubmodules:
    """Decoder block spec (this pipeline stage's layers) for V4's attention pattern."""
    specs = get_v4_layer_specs(config, baseline=baseline)
    if config.pipeline_model_parallel_layout is not None:
        local_ids = list(config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = list(range(offset, offset + count))
    norm = specs[0].submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in local_ids], layer_norm=norm)

"""Megatron-Bridge: put HyScale's layer spec on a Bridge model provider.

Megatron-Bridge (`megatron-bridge` on PyPI) builds a model from a *provider*: a
TransformerConfig dataclass (`GPTModelProvider`, `MLAModelProvider`, ...) whose
`transformer_layer_spec` is a ModuleSpec or a callable of the provider (and of `vp_stage` when
the callable takes it), called by `provider.provide()` on each pipeline stage. Its recipes
return a `ConfigContainer` whose `model` is such a provider, and its `AutoBridge` makes one
from a Hugging Face config. `use_hyscale(provider)` swaps that spec for HyScale's:

- DSA (GLM-5 / 5.1 / 5.2 through Bridge's `GLM5Bridge`, DeepSeek-V3.2; the provider has
  `experimental_attention_variant == "dsa"`): `specs.get_dsa_block_spec`, MLA + HyScale's DSA
  in every layer. HyScale's modules keep megatron-core's parameter names, so Bridge's weight
  conversion (Hugging Face <-> Megatron) is unchanged.
- DeepSeek-V4 (Bridge's `DeepSeekV4Bridge`: `experimental_attention_variant == "dsv4_hybrid"`
  and `csa_compress_ratios`): `specs.deepseek_v4.get_v4_block_spec`, HyScale's window / CSA /
  HCA attention, with HyScale's `v4_*` fields filled from Bridge's fields when the model is
  built (so recipe overrides made after this call still count). HyScale's V4 spec reproduces
  V4's attention, not its hyper-connections or hash routing, and its parameter names are not
  megatron-core's V4 modules': it is for training and timing V4's attention from scratch, not
  for loading a V4 checkpoint through Bridge.
- QSA (a provider carrying `QSATransformerConfig`'s `qsa_*` fields): `specs.qsa.get_qsa_block_spec`.
  Megatron-Bridge has no Qwen3.8-Flash-Next provider; this serves a provider you define.

This module does not import megatron.bridge: `use_hyscale` works on any object with a
`transformer_layer_spec` attribute and the config fields above. The spec it sets is a
`functools.partial` of a public module-level function, which Bridge's YAML dump of a config
writes as an import path (`_target_: megatron_hyscale...`, `_partial_: true`); to load such a
dump through Bridge's instantiation, allow the prefix first
(`megatron.bridge.utils.instantiate_utils.register_allowed_target_prefix("megatron_hyscale")`).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_hyscale.layers.row_chunks import check_row_chunk
from megatron_hyscale.specs import get_dsa_block_spec

Model = Literal["auto", "dsa", "deepseek_v4", "qsa"]

# megatron-core's name for DeepSeek-V4's attention pattern (set by Bridge's DeepSeekV4Bridge).
V4_VARIANT = "dsv4_hybrid"
QSA_FIELDS = ("qsa_indexer_n_heads", "qsa_indexer_budget", "qsa_block_size")
# Bridge's DeepSeek-V4 provider fields that HyScale's V4 layers need, each with the HyScale
# (`DeepseekV4TransformerConfig`) field it fills.
V4_FIELDS_FROM_BRIDGE = {
    "v_head_dim": "v4_head_dim",
    "qk_pos_emb_head_dim": "v4_rope_head_dim",
    "q_lora_rank": "v4_q_lora_rank",
    "o_groups": "v4_o_groups",
    "o_lora_rank": "v4_o_lora_rank",
    "csa_window_size": "v4_sliding_window",
    "dsa_indexer_n_heads": "v4_index_n_heads",
    "dsa_indexer_head_dim": "v4_index_head_dim",
    "dsa_indexer_topk": "v4_index_topk",
    "rotary_base": "v4_rope_theta",
    "csa_compress_rotary_base": "v4_compress_rope_theta",
}


def detect_model(provider: Any) -> Literal["dsa", "deepseek_v4", "qsa"]:
    """Which HyScale spec fits `provider`, from its attention fields; ValueError if none."""
    variant = getattr(provider, "experimental_attention_variant", None)
    if variant == "dsa":
        return "dsa"
    if variant == V4_VARIANT or getattr(provider, "csa_compress_ratios", None) is not None:
        return "deepseek_v4"
    if all(hasattr(provider, f) for f in QSA_FIELDS):
        return "qsa"
    raise ValueError(
        f"use_hyscale: {type(provider).__name__} has no sparse attention HyScale replaces "
        f"(experimental_attention_variant={variant!r}; HyScale takes 'dsa' (GLM-5, "
        f"DeepSeek-V3.2), {V4_VARIANT!r} (DeepSeek-V4) or a provider with the qsa_* fields); "
        "pass model= to say which"
    )


def missing_v4_fields(config: Any) -> list[str]:
    """Bridge's DeepSeek-V4 fields that HyScale's V4 layers need and `config` lacks."""
    return [f for f in (*V4_FIELDS_FROM_BRIDGE, "csa_compress_ratios")
            if getattr(config, f, None) is None]


def set_v4_fields_from_bridge(config: Any, *, baseline: bool = False,
                              row_chunk: int | None = None) -> None:
    """Fill HyScale's `v4_*` fields on a Bridge DeepSeek-V4 provider from Bridge's own fields.

    Bridge lists one compress ratio per decoder layer plus one per MTP layer: the decoder's
    are kept. YaRN (`rope_type == "yarn"`) becomes `v4_compress_rope_scaling` (V4 applies it
    to the compressed layers' RoPE only). Fields Bridge does not have keep the
    DeepseekV4TransformerConfig defaults (CSA ratio 4, no indexer loss unless
    `dsa_indexer_loss_coeff` is set).
    """
    from megatron_hyscale.layers.deepseek_v4 import DeepseekV4TransformerConfig

    missing = missing_v4_fields(config)
    if missing:
        raise ValueError(f"HyScale's DeepSeek-V4 spec: the provider lacks {missing} "
                         "(Bridge's DeepSeekV4Bridge sets them)")
    for name, field in DeepseekV4TransformerConfig.__dataclass_fields__.items():
        if name.startswith("v4_") and not hasattr(config, name):
            setattr(config, name, field.default)
    for bridge_name, ours in V4_FIELDS_FROM_BRIDGE.items():
        setattr(config, ours, getattr(config, bridge_name))
    config.v4_compress_ratios = [int(r) for r in config.csa_compress_ratios[: config.num_layers]]
    if getattr(config, "rope_type", None) == "yarn":
        config.v4_compress_rope_scaling = {
            "type": "yarn",
            "factor": float(config.rotary_scaling_factor),
            "original_max_position_embeddings": int(config.original_max_position_embeddings),
            "beta_fast": float(config.beta_fast),
            "beta_slow": float(config.beta_slow),
        }
    coeff = getattr(config, "dsa_indexer_loss_coeff", None)
    if coeff:
        config.v4_indexer_loss_coeff = float(coeff)
        config.v4_indexer_use_sparse_loss = bool(getattr(config, "dsa_indexer_use_sparse_loss",
                                                         True))
    config.v4_baseline = baseline
    config.v4_row_chunk = row_chunk


def deepseek_v4_block_spec(config: Any, *, baseline: bool = False, row_chunk: int | None = None,
                           vp_stage: int | None = None, pp_rank: int | None = None
                           ) -> TransformerBlockSubmodules:
    """HyScale's V4 block spec for a Bridge DeepSeek-V4 provider (this pipeline stage's layers).

    The `transformer_layer_spec` that `use_hyscale` sets for DeepSeek-V4: it fills the
    provider's `v4_*` fields from Bridge's (`set_v4_fields_from_bridge`), then builds.
    """
    from megatron_hyscale.specs.deepseek_v4 import get_v4_block_spec

    set_v4_fields_from_bridge(config, baseline=baseline, row_chunk=row_chunk)
    return get_v4_block_spec(config, baseline=baseline, vp_stage=vp_stage, pp_rank=pp_rank)


def hyscale_layer_spec(model: Literal["dsa", "deepseek_v4", "qsa"], *, baseline: bool = False,
                       row_chunk: int | None = None) -> functools.partial:
    """The callable of (config, vp_stage=...) that builds HyScale's block spec for `model`."""
    row_chunk = check_row_chunk(row_chunk)
    if model == "dsa":
        if baseline and row_chunk is not None:
            raise ValueError("row_chunk is a HyScale option: the stock DSA spec has no row chunks")
        return functools.partial(get_dsa_block_spec, stock=baseline, row_chunk=row_chunk)
    if model == "deepseek_v4":
        return functools.partial(deepseek_v4_block_spec, baseline=baseline, row_chunk=row_chunk)
    if model == "qsa":
        if row_chunk is not None:
            raise ValueError("row_chunk: the QSA layer has no row chunks")
        from megatron_hyscale.specs.qsa import get_qsa_block_spec

        return functools.partial(get_qsa_block_spec, baseline=baseline)
    raise ValueError(f"model must be 'auto', 'dsa', 'deepseek_v4' or 'qsa', got {model!r}")


def use_hyscale[Provider](provider: Provider, *, model: Model = "auto", baseline: bool = False,
                          row_chunk: int | None = None) -> Provider:
    """Put HyScale's layer spec on a Megatron-Bridge model provider; returns the provider.

    Args:
        provider: a Bridge model provider (e.g. a recipe's `cfg.model`, or
            `AutoBridge.from_hf_pretrained(...).to_megatron_provider()`), changed in place: its
            `transformer_layer_spec` becomes HyScale's. Any object with that attribute and the
            model's config fields works.
        model: "dsa" (GLM-5.x, DeepSeek-V3.2), "deepseek_v4" or "qsa"; "auto" reads it from the
            provider (`detect_model`).
        baseline: the comparison spec instead of HyScale's: for DSA megatron-core's own
            `DSAttention` on the same linears, for V4 / QSA the materialized-score baseline
            (both select again in the recompute). For side-by-side runs.
        row_chunk: DSA / V4: run each attention layer's local query rows this many at a time,
            each part checkpointed (for 1M tokens at low context parallelism); None: off.
    """
    if not hasattr(provider, "transformer_layer_spec"):
        raise TypeError(f"use_hyscale: {type(provider).__name__} has no transformer_layer_spec "
                        "(expected a Megatron-Bridge model provider)")
    chosen = detect_model(provider) if model == "auto" else model
    spec = hyscale_layer_spec(chosen, baseline=baseline, row_chunk=row_chunk)
    if chosen == "dsa" and getattr(provider, "experimental_attention_variant", None) != "dsa":
        raise ValueError("use_hyscale(model='dsa') needs experimental_attention_variant='dsa', "
                         f"got {getattr(provider, 'experimental_attention_variant', None)!r}")
    if chosen == "deepseek_v4" and missing_v4_fields(provider):
        raise ValueError(f"use_hyscale(model='deepseek_v4'): the provider lacks "
                         f"{missing_v4_fields(provider)} (Bridge's DeepSeekV4Bridge sets them)")
    if chosen == "qsa":
        missing = [f for f in QSA_FIELDS if not hasattr(provider, f)]
        if missing:
            raise ValueError(f"use_hyscale(model='qsa'): the provider lacks {missing} "
                             "(megatron_hyscale.layers.qsa.QSATransformerConfig's fields)")
    provider.transformer_layer_spec = spec
    return provider

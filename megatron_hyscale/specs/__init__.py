"""Layer-spec builders that put HyScale's modules into megatron-core GPT models.

This package's top level holds the DSA (MLA + lightning indexer) builders; `specs.deepseek_v4`
holds DeepSeek-V4-Flash's window / CSA / HCA layer pattern and `specs.qsa` the Qwen3.8-Flash-Next
QSA and hybrid (Gated DeltaNet : QSA) patterns.

`get_dsa_block_spec(config)` returns a decoder block spec with MLA + HyScale DSA in every
layer; `stock=True` gives megatron-core's own `DSAttention` on the same linears, so one process
can compare the two on identical weights. Linears come from Transformer Engine when it imports
(and `config.transformer_impl == "transformer_engine"`), from megatron's local (torch) modules
otherwise. HyScale keeps the stock parameter names: a stock checkpoint loads into it.

Megatron-LM's training scripts import `--spec MODULE NAME`: `--spec megatron_hyscale.specs
hyscale_dsa_layer_spec` (HyScale) or `stock_dsa_layer_spec` (the stock modules on the same
linears, for side-by-side runs), a ModuleSpec each; `hyscale_dsa_block_spec` /
`stock_dsa_block_spec` are the same as callables of (config, vp_stage) returning this stage's
block spec, which `pretrain_gpt.py` (megatron.training's GPTModelBuilder) calls, and which
models with multi-token-prediction (MTP) layers need (with patches/megatron_lm_mtp_spec.patch).
`get_dsa_mtp_block_spec(config)` is the MTP block spec (HyScale's DSA in the MTP layers) for
models built from Python. HyScale's attention module is `HyScaleMLASelfAttention`
(AbsorbedMLASelfAttention's forward unless row chunks are asked for: `row_chunk=` here,
HYSCALE_ROW_CHUNK for the `--spec` entry points).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    _validate_dsa_index_share_pipeline_split,
    get_transformer_layer_with_experimental_attention_variant_spec,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
)
from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank

from megatron_hyscale.indexer_capture import attach_from_env as attach_indexer_capture
from megatron_hyscale.layers.dsa import HyScaleDSAttention
from megatron_hyscale.layers.linear import LocalLinear
from megatron_hyscale.layers.mla import HyScaleMLASelfAttention
from megatron_hyscale.layers.row_chunks import check_row_chunk
from megatron_hyscale.phase_times import enable_from_env as enable_phase_times
from megatron_hyscale.selection_agreement import attach_from_env as attach_selection_agreement
from megatron_hyscale.specs.mtp_check import note_dsa_spec

# Megatron-LM's `--spec` entry points read the row-chunk size from here (HyScaleMLASelfAttention).
ROW_CHUNK_ENV = "HYSCALE_ROW_CHUNK"


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # TE raises more than ImportError when its CUDA libraries are missing
        return False
    return True


class LocalDSASpecProvider(LocalSpecProvider):
    """megatron's local provider plus the `linear()` the DSA spec asks for (TELinear in TE)."""

    def linear(self) -> type:
        return LocalLinear


def get_backend(config: TransformerConfig) -> BackendSpecProvider:
    """TE linears when TE imports and the config asks for it; local (torch) linears otherwise."""
    if config.transformer_impl == "transformer_engine":
        if te_available():
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            return TESpecProvider()
        _warn_local_linears()
    return LocalDSASpecProvider()


@functools.cache
def _warn_local_linears() -> None:
    # megatron-core's default transformer_impl is "transformer_engine": without TE the specs
    # still build, on local linears, and the user is told once rather than finding out later.
    warnings.warn("HyScale specs: transformer_impl='transformer_engine' but transformer_engine "
                  "does not import; the layers use megatron's local (torch) linears and norms "
                  "(set transformer_impl='local' to silence this)", stacklevel=3)


def _use_core_attention(attention: ModuleSpec, core_cls: type, local: bool) -> None:
    """Point an AbsorbedMLA spec at `core_cls`; fix the local down projections."""
    subs = attention.submodules
    subs.core_attention = dataclasses.replace(subs.core_attention, module=core_cls)
    if local:
        # AbsorbedMLA accepts TELinear or a column-parallel linear for its down projections; the
        # local stand-in is ColumnParallelLinear (exact at tensor-parallel size 1).
        subs.linear_q_down_proj = ColumnParallelLinear
        subs.linear_kv_down_proj = ColumnParallelLinear


def transformer_config(config: object) -> TransformerConfig:
    """The TransformerConfig itself: megatron.training's GPTModelConfig (what Megatron-LM's
    GPTModelBuilder hands a callable spec) wraps one as `.transformer`."""
    inner = getattr(config, "transformer", None)
    return inner if isinstance(inner, TransformerConfig) else config  # type: ignore[return-value]


def row_chunk_from_env() -> int | None:
    """HYSCALE_ROW_CHUNK (rows per part, see layers.mla) for Megatron-LM's `--spec` entry
    points, which take no arguments; unset or empty: None (no chunking)."""
    text = os.environ.get(ROW_CHUNK_ENV, "").strip()
    if not text:
        return None
    try:
        return check_row_chunk(int(text))
    except ValueError:
        raise ValueError(f"{ROW_CHUNK_ENV} must be a positive integer, got {text!r}") from None


def get_dsa_layer_specs(
    config: TransformerConfig, *, stock: bool = False, backend: BackendSpecProvider | None = None,
    row_chunk: int | None = None,
) -> list[ModuleSpec]:
    """One TransformerLayer spec per layer of the model: MLA + (HyScale | stock) DSA.

    Args:
        config: an MLATransformerConfig with `experimental_attention_variant="dsa"`.
        stock: build megatron-core's `DSAttention` instead of `HyScaleDSAttention`.
        backend: the linear/norm provider; default `get_backend(config)`.
        row_chunk: HyScale only: run each attention layer's query rows this many at a time,
            each part checkpointed (`HyScaleMLASelfAttention`; for 1M tokens at low CP).
    """
    config = transformer_config(config)
    row_chunk = check_row_chunk(row_chunk)
    if stock and row_chunk is not None:
        raise ValueError("row_chunk is a HyScale option: the stock spec has no row chunks")
    if config.experimental_attention_variant != "dsa":
        raise ValueError(
            "config.experimental_attention_variant must be 'dsa' for the DSA spec, got "
            f"{config.experimental_attention_variant!r}"
        )
    note_dsa_spec(config, stock=stock)  # MTP layers: check the model's MTP attention when built
    backend = backend or get_backend(config)
    local = isinstance(backend, LocalDSASpecProvider)
    layer_specs = get_transformer_layer_with_experimental_attention_variant_spec(
        config=config, backend=backend
    )
    core_cls = DSAttention if stock else HyScaleDSAttention
    # The attention spec object is shared by the layers: rebuild it once, then reassign.
    rebuilt: dict[int, ModuleSpec] = {}
    for layer in layer_specs:
        attention = layer.submodules.self_attention
        if attention.module is not AbsorbedMLASelfAttention:
            continue
        if id(attention) not in rebuilt:
            fresh = dataclasses.replace(
                attention, submodules=dataclasses.replace(attention.submodules)
            )
            if not stock:
                fresh = dataclasses.replace(fresh, module=HyScaleMLASelfAttention,
                                            params={**fresh.params, "row_chunk": row_chunk})
            _use_core_attention(fresh, core_cls, local)
            rebuilt[id(attention)] = fresh
        layer.submodules.self_attention = rebuilt[id(attention)]
    return layer_specs


def get_dsa_block_spec(
    config: TransformerConfig,
    *,
    stock: bool = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    row_chunk: int | None = None,
) -> TransformerBlockSubmodules:
    """Decoder block spec (this pipeline stage's layers) with MLA + HyScale (or stock) DSA.

    Mirrors megatron-core's `get_transformer_block_with_experimental_attention_variant_spec`,
    which only accepts Transformer Engine; this one also builds with local linears.
    """
    config = transformer_config(config)
    backend = get_backend(config)
    layer_specs = get_dsa_layer_specs(config, stock=stock, backend=backend, row_chunk=row_chunk)
    if config.pipeline_model_parallel_layout is not None:
        local_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + count)
    local_ids = list(local_ids)
    _validate_dsa_index_share_pipeline_split(config, local_ids)
    return TransformerBlockSubmodules(
        layer_specs=[layer_specs[i] for i in local_ids],
        layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
    )


def get_dsa_mtp_block_spec(
    config: TransformerConfig,
    *,
    stock: bool = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    row_chunk: int | None = None,
) -> MultiTokenPredictionBlockSubmodules | None:
    """Multi-token-prediction block spec whose layers run MLA + HyScale (or stock) DSA.

    Each MTP layer's inner transformer layer is the model's last decoder layer's spec (its
    dense / MoE MLP included), as megatron-core's `get_gpt_mtp_block_spec` makes it from a
    decoder block, but taken from every layer's specs, so a pipeline stage that holds the MTP
    layers and no decoder layer still gets HyScale's; the MTP's norms and projection come from
    HyScale's backend (local linears without Transformer Engine). None where this stage builds
    no MTP layer. Pass it to GPTModel as `mtp_block_spec` beside `get_dsa_block_spec(config)`.
    """
    config = transformer_config(config)
    backend = get_backend(config)
    last = get_dsa_layer_specs(config, stock=stock, backend=backend, row_chunk=row_chunk)[-1]
    return get_gpt_mtp_block_spec_for_backend(config=config, spec=last, backend=backend,
                                              vp_stage=vp_stage, pp_rank=pp_rank)


def dsa_layer_spec_for(
    config: TransformerConfig, layer_number: int, *, stock: bool = False,
    row_chunk: int | None = None, vp_stage: int | None = None, pp_rank: int | None = None,
    is_mtp_layer: bool = False, add_layer_offset: bool = True,
) -> ModuleSpec:
    """The DSA layer spec of the layer megatron builds with these arguments.

    `layer_number` is what TransformerBlock passes (1-based within this pipeline stage: the
    stage's offset is added here, as TransformerLayer adds it, unless `add_layer_offset` is
    False); an MTP layer's inner layer (`is_mtp_layer`, numbered 1, 2, ... by megatron) is
    the last decoder layer's, as megatron-core's `get_gpt_mtp_block_spec` makes it.
    """
    layer_specs = get_dsa_layer_specs(config, stock=stock, row_chunk=row_chunk)
    if is_mtp_layer:
        return layer_specs[-1]
    if add_layer_offset:
        layer_number += get_transformer_layer_offset(config, vp_stage, pp_rank)
    return layer_specs[layer_number - 1]


class DSATransformerLayer(TransformerLayer):
    """A TransformerLayer that builds HyScale's (or stock) DSA layer and, for HyScale, attaches
    the selection-agreement check (HYSCALE_SELECTION_AGREEMENT) and phase times.

    Megatron-LM's `--spec MODULE NAME` can hand GPTModel a ready ModuleSpec (it does not call
    it), so that entry point must not depend on the pipeline stage: one ModuleSpec of this
    class without submodules (`hyscale_dsa_layer_spec`) serves every layer, each instance
    resolving its dense/MoE MLP and attention from `get_dsa_layer_specs(config)` by its global
    layer number (this stage's offset added, any PP / VPP layout) or, as an MTP layer's inner
    layer, as the last decoder layer. Given submodules (the block entry points'
    `hyscale_dsa_block_spec`), it builds those.
    """

    def __init__(self, config: TransformerConfig, submodules: object = None,
                 layer_number: int = 1, *, stock: bool = False, **kwargs: object) -> None:
        # HYSCALE_PHASE_TIMES=1: per-iteration selection / attention / indexer-loss /
        # communication times in the log (megatron_hyscale.phase_times)
        enable_phase_times("stock" if stock else "hyscale")
        if submodules is None:
            pg_collection = kwargs.get("pg_collection")
            pp_rank = None if pg_collection is None else get_pg_rank(pg_collection.pp)
            spec = dsa_layer_spec_for(
                config, layer_number, stock=stock,
                row_chunk=None if stock else row_chunk_from_env(),
                vp_stage=kwargs.get("vp_stage"), pp_rank=pp_rank,  # type: ignore[arg-type]
                is_mtp_layer=bool(kwargs.get("is_mtp_layer", False)),
                add_layer_offset=bool(kwargs.get("add_layer_offset", True)))
            submodules = spec.submodules
            kwargs = {**spec.params, **kwargs}
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        if not stock:
            # HYSCALE_SELECTION_AGREEMENT=N: HyScale's top-k against stock's on the same
            # weights every N iterations, in the log (megatron_hyscale.selection_agreement)
            attach_selection_agreement(self.self_attention.core_attention)
            # HYSCALE_INDEXER_CAPTURE=PATH, _AT=N: the first layer's indexer tensors at
            # iteration N, for bench_selection.py --captured (megatron_hyscale.indexer_capture)
            attach_indexer_capture(self.self_attention.core_attention)


def _entry_block_spec(config: object, vp_stage: int | None, *,
                      stock: bool) -> TransformerBlockSubmodules:
    config = transformer_config(config)
    block = get_dsa_block_spec(config, stock=stock, vp_stage=vp_stage,
                               row_chunk=None if stock else row_chunk_from_env())
    block.layer_specs = [
        dataclasses.replace(spec, module=DSATransformerLayer, params={**spec.params,
                                                                      "stock": stock})
        for spec in block.layer_specs
    ]
    return block


def hyscale_dsa_block_spec(config: TransformerConfig,
                           vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """`--spec megatron_hyscale.specs hyscale_dsa_block_spec`: this pipeline stage's block spec
    of HyScale's DSA layers, as a callable of (config, vp_stage).

    Megatron-LM's `pretrain_gpt.py` (megatron.training's GPTModelBuilder) calls a callable
    `--spec` with the model config and stage; megatron's MTP builder, patched by
    patches/megatron_lm_mtp_spec.patch, takes the MTP layers' spec from this block's last
    layer, so multi-token-prediction layers run HyScale's DSA too. Same layers, parameter
    names, HYSCALE_ROW_CHUNK / HYSCALE_PHASE_TIMES / HYSCALE_SELECTION_AGREEMENT handling as
    `hyscale_dsa_layer_spec`.
    """
    return _entry_block_spec(config, vp_stage, stock=False)


def stock_dsa_block_spec(config: TransformerConfig,
                         vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """`--spec megatron_hyscale.specs stock_dsa_block_spec`: `hyscale_dsa_block_spec` with
    megatron-core's DSAttention on the same linears (side-by-side runs)."""
    return _entry_block_spec(config, vp_stage, stock=True)


# Entry points for Megatron-LM: `--spec megatron_hyscale.specs hyscale_dsa_layer_spec` (HyScale)
# and `--spec megatron_hyscale.specs stock_dsa_layer_spec` (stock DSA on the same linears);
# `hyscale_dsa_block_spec` / `stock_dsa_block_spec` above for models with MTP layers.
hyscale_dsa_layer_spec = ModuleSpec(module=DSATransformerLayer, params={"stock": False})
stock_dsa_layer_spec = ModuleSpec(module=DSATransformerLayer, params={"stock": True})


"""Layer-spec builders for QSA (Qwen3.8-Flash-Next) models on megatron-core.

- `get_qsa_attention_spec(config)`: the QSA self-attention module spec (HyScaleQSASelfAttention
  with HyScaleQSAttention and its QSAIndexer); `baseline=True` gives the stock-style selector
  (`ScoreTableBlockSelector`: materialized block scores + torch.topk, re-selected during
  recompute) on the same modules and parameters, so one process can compare the two on
  identical weights.
- `get_qsa_layer_specs(config)`: one TransformerLayer spec per layer. With
  `config.experimental_attention_variant == "gated_delta_net"` the layers follow megatron's
  linear-attention pattern (`linear_attention_freq=4`: 3 Gated DeltaNet : 1 QSA, the released
  model's layout), the Gated DeltaNet layers being megatron-core's own `GatedDeltaNet`;
  otherwise every layer is QSA. MLPs follow `num_moe_experts` / `moe_layer_freq` as megatron's
  experimental-attention builder does.
- `get_qsa_block_spec(config)`: this pipeline stage's layers plus the final norm.
- `hyscale_qsa_layer_spec` / `baseline_qsa_layer_spec`: one ModuleSpec for every layer
  (`QSATransformerLayer` resolves its own layer number), for Megatron-LM's `--spec`.

The config is a `megatron_hyscale.layers.qsa.QSATransformerConfig` (megatron's
TransformerConfig plus the `qsa_*` indexer fields).

Linears come from Transformer Engine when it imports and the config asks for it, local (torch)
modules otherwise (`megatron_hyscale.specs.get_backend`). The QSA layer never fuses its input
norm into the QKV projection: the indexer needs the normalized input too. megatron-core's
GatedDeltaNet needs a fused norm + linear (`column_parallel_layer_norm_linear`, Transformer
Engine only) and its kernels need the `fla` package (Triton, CUDA), so the hybrid pattern
builds and runs only on a GPU machine with TE and fla; on a CPU, QSA-only models run.
"""

from __future__ import annotations

import warnings

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    _get_dense_mlp_module_spec,
    _get_moe_module_spec,
    get_gated_delta_net_module_spec,
    get_linear_attention_pattern,
    get_moe_layer_pattern,
)
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_hyscale.layers.qsa import (
    HyScaleQSASelfAttention,
    HyScaleQSAttention,
    QSAIndexer,
    QSAIndexerSubmodules,
    QSASelfAttentionSubmodules,
    QSAttentionSubmodules,
    qsa_selector,
)
from megatron_hyscale.phase_times import enable_from_env as enable_phase_times
from megatron_hyscale.specs import get_backend


def _check_qsa_config(config: TransformerConfig) -> None:
    missing = [f for f in ("qsa_indexer_n_heads", "qsa_indexer_budget", "qsa_block_size")
               if not hasattr(config, f)]
    if missing:
        raise ValueError(f"QSA specs need a QSATransformerConfig (missing {missing})")
    if not config.attention_output_gate:
        raise ValueError("QSA attention needs config.attention_output_gate=True")
    if not config.qk_layernorm:
        raise ValueError("QSA attention needs config.qk_layernorm=True (q/k RMSNorm)")


def get_qsa_attention_spec(
    config: TransformerConfig, *, baseline: bool = False,
    backend: BackendSpecProvider | None = None,
) -> ModuleSpec:
    """ModuleSpec of the QSA self-attention (HyScale, or the baseline selection if `baseline`)."""
    _check_qsa_config(config)
    backend = backend or get_backend(config)
    rms_norm = config.normalization == "RMSNorm"
    qk_norm = backend.layer_norm(rms_norm=rms_norm, for_qk=True)
    linear = getattr(backend, "linear", None)
    indexer_linear = linear() if linear is not None else backend.column_parallel_linear()
    indexer = ModuleSpec(
        module=QSAIndexer,
        submodules=QSAIndexerSubmodules(
            linear_qk=indexer_linear, q_layernorm=qk_norm, k_layernorm=qk_norm,
        ),
    )
    core = ModuleSpec(module=HyScaleQSAttention,
                      params={"selector": qsa_selector(baseline=baseline)},
                      submodules=QSAttentionSubmodules(indexer=indexer))
    return ModuleSpec(
        module=HyScaleQSASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=QSASelfAttentionSubmodules(
            # Not the fused norm + linear: the indexer reads the normalized input as well.
            linear_qkv=backend.column_parallel_linear(),
            core_attention=core,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
        metainfo={"fuse_input_layernorm": False},
    )


def get_qsa_layer_specs(
    config: TransformerConfig, *, baseline: bool = False,
    backend: BackendSpecProvider | None = None,
) -> list[ModuleSpec]:
    """One TransformerLayer spec per layer: QSA, or Gated DeltaNet where megatron's
    linear-attention pattern puts it (config.experimental_attention_variant='gated_delta_net')."""
    backend = backend or get_backend(config)
    rms_norm = config.normalization == "RMSNorm"
    if config.experimental_attention_variant == "gated_delta_net":
        pattern = get_linear_attention_pattern(config=config)  # 1 = Gated DeltaNet, 0 = QSA
    elif config.experimental_attention_variant is None:
        pattern = [0] * config.num_layers
    else:
        raise ValueError(f"QSA specs support experimental_attention_variant None or "
                         f"'gated_delta_net', got {config.experimental_attention_variant!r}")
    qsa = get_qsa_attention_spec(config, baseline=baseline, backend=backend)
    gdn = None
    if 1 in pattern:
        gdn = get_gated_delta_net_module_spec(config=config, backend=backend)
        if gdn.submodules.in_proj is None:
            warnings.warn(
                "megatron-core's GatedDeltaNet needs a fused norm + linear (Transformer Engine) "
                "and the fla package: this hybrid spec builds, but its Gated DeltaNet layers "
                "cannot be instantiated with the local backend", RuntimeWarning, stacklevel=2)
    if config.num_moe_experts is not None:
        moe_pattern = get_moe_layer_pattern(config=config)
    else:
        moe_pattern = [0] * config.num_layers
    moe = _get_moe_module_spec(config=config, backend=backend) if 1 in moe_pattern else None
    dense = _get_dense_mlp_module_spec(config=config, backend=backend) if 0 in moe_pattern \
        else None

    specs = []
    for i in range(config.num_layers):
        attention = gdn if pattern[i] == 1 else qsa
        mlp, fuse_pre_mlp = moe if moe_pattern[i] == 1 else dense
        input_norm = (IdentityOp if attention.metainfo.get("fuse_input_layernorm")
                      else backend.layer_norm(rms_norm=rms_norm, for_qk=False))
        pre_mlp_norm = IdentityOp if fuse_pre_mlp else backend.layer_norm(rms_norm=rms_norm,
                                                                          for_qk=False)
        specs.append(ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=input_norm,
                self_attention=attention,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=pre_mlp_norm,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        ))
    return specs


def get_qsa_block_spec(
    config: TransformerConfig, *, baseline: bool = False, vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """Decoder block spec (this pipeline stage's layers) for a QSA or hybrid GDN/QSA model."""
    backend = get_backend(config)
    layer_specs = get_qsa_layer_specs(config, baseline=baseline, backend=backend)
    if config.pipeline_model_parallel_layout is not None:
        local_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + count)
    return TransformerBlockSubmodules(
        layer_specs=[layer_specs[i] for i in local_ids],
        layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
    )


class QSATransformerLayer(TransformerLayer):
    """A TransformerLayer that builds its own layer number's spec from `get_qsa_layer_specs`.

    Megatron-LM's `--spec MODULE NAME` hands GPTModel one ready object for every layer; this
    class resolves each layer's attention (QSA or Gated DeltaNet) and MLP from its global layer
    number, so any pipeline layout works. The config must be a QSATransformerConfig (Megatron-LM's
    argument parser does not know the `qsa_*` fields: the launcher has to build that config).
    """

    def __init__(self, config: TransformerConfig, submodules: object = None,
                 layer_number: int = 1, *, baseline: bool = False, **kwargs: object) -> None:
        # HYSCALE_PHASE_TIMES=1: per-iteration selection / attention / indexer-loss /
        # communication times in the log (megatron_hyscale.phase_times); the baseline selector
        # runs in the same modules, so both sides are HyScale's spans.
        enable_phase_times("hyscale")
        spec = get_qsa_layer_specs(config, baseline=baseline)[layer_number - 1]
        super().__init__(config, spec.submodules, layer_number=layer_number,
                         **{**spec.params, **kwargs})


# Entry points: `--spec megatron_hyscale.specs.qsa hyscale_qsa_layer_spec` (HyScale selection)
# and `baseline_qsa_layer_spec` (materialized block scores + torch.topk, no replay).
hyscale_qsa_layer_spec = ModuleSpec(module=QSATransformerLayer, params={"baseline": False})
baseline_qsa_layer_spec = ModuleSpec(module=QSATransformerLayer, params={"baseline": True})

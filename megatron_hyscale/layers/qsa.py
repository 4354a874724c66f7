"""QSA (Qwen3.8-Flash-Next sparse attention) as Megatron modules, on HyScale's ops.

Semantics: those of transformers' `Qwen4ExpTextAttention` / `Qwen4ExpTextQSAIndexer` (the
independent oracle, `tests/layers/test_qsa.py`) on a causal mask without padding:
- main attention: GQA (24 query / 2 KV heads of 256 in the released model), q/k RMSNorm per head,
  RoPE (partial when `rotary_percent` < 1) after the norm, sigmoid output gate (one gate value per
  query channel, from the same projection as the query), output projection;
- indexer: one projection to H_I query heads + one key head of D_I (4 x 128); RMSNorm on the
  queries per head, RoPE on the queries at their own positions; keys are mean-pooled over
  complete blocks of 4 tokens, then RMSNorm'd, then rotated at the block's first position;
  score[t, b] = D_I^-0.5 * sum_h ReLU(q[t, h] . k_block[b]) (no learned head weights); block b is
  visible to query t iff b < (t + 1) // 4; the top budget // 4 visible blocks (512 for a budget
  of 2048 tokens) are kept;
- each query attends to the tokens of its selected blocks plus its causal tail (the 0 to 3
  tokens of its own incomplete block). One indexer key head serves all query heads, so the
  selection is shared by the KV heads: `sparse_attention` gets [B, T, K] indices.
- no gradient reaches the indexer through the selection (it is a top-k), and the reference
  defines no indexer loss (the indexer is frozen in public recipes): the indexer's input is
  detached, and its parameters get no gradient unless `qsa_indexer_loss_coeff` > 0 turns on a
  KL loss (an option, see `HyScaleQSAttention`).

Modules and parameter names (under a TransformerLayer: `self_attention.` + these):
- `HyScaleQSASelfAttention` (a megatron `SelfAttention` with `attention_output_gate=True`; its
  projections, norms and parameter names are megatron's own):
  `linear_qkv.weight` [ng * (2 * np/ng + 2) * hn, h]: per KV group g the rows of its np/ng query
  heads, then their np/ng gate heads, then key head g, then value head g (megatron's gated
  layout); `q_layernorm.weight`, `k_layernorm.weight` [hn]; `linear_proj.weight` [h, np * hn].
- `HyScaleQSAttention` (the core attention: selection + sparse attention), no parameters of its
  own besides `core_attention.indexer.*`.
- `QSAIndexer`: `core_attention.indexer.linear_qk.weight` [(H_I + 1) * D_I, h] (rows: H_I query
  heads, then the key head), `core_attention.indexer.q_layernorm.weight` [D_I],
  `core_attention.indexer.k_layernorm.weight` [D_I].
`megatron_hyscale.testing.qsa.hf_to_megatron_qsa_state_dict` maps transformers' weights.

Selection: the core attention's selector (a strategy, `BlockSelector`) picks the blocks,
expanded to token ids + tail. HyScale's `HyTopKBlockSelector` runs HyTopK over the pooled blocks
with block positions b * 4 + 3 (see `ops.block_pool`). Under megatron recompute (full, or
selective `core_attn`) the block selection is recorded in the first forward and replayed by the
recompute (`replay.SelectionReplay.select`; the block ids are stored, 1/4 of the token ids, and
re-expanded), so the indexer runs once per layer per micro-batch. `ScoreTableBlockSelector`
(the specs' `baseline=True`) is the stock-style path to compare against: the block score table
is materialized and `torch.topk` selects, and the recompute selects again (no replay).

Ties: with 4 indexer heads a block scores exactly 0 whenever its 4 ReLU'd logits are all
negative (about 1 block in 16 for random inputs), so queries with fewer than budget positive
blocks have ties at the cut-off. HyTopK keeps the smaller block index (a total order, bitwise
reproducible); transformers' torch.topk picks an unspecified one; both are valid QSA.

Memory at long context: the expanded token indices are int32 [b, sq, 4 * 512 + 3] (8 GiB per
1M tokens, transient: built from the block ids in each pass). A sparse-attention kernel that
reads block ids + tail directly (4-token contiguous loads) would not need them.

Context parallelism (megatron's zigzag layout, 2 x cp chunks): K, V and the indexer's raw keys
are all-gathered into global order (`parallel.all_gather_to_global`, whose backward
reduce-scatters to the owners; K and V asynchronously, transferring while HyTopK selects),
blocks are pooled over the global sequence, and the local query rows select and attend with
their global positions (allgather CP, as the DSA layer).

Packed THD sequences (`packed_seq_params`, qkv_format "thd"; cu_seqlens or their padded
variants, whose padding rows then belong to their document): each document is its own sequence,
so a packed batch gives each document exactly the output and gradients of the layer on that
document alone. `HyScaleQSASelfAttention` applies megatron's THD RoPE (as its Attention does,
batch size 1); the indexer's RoPE reads megatron's table by position in the document (or by
packed row when the table covers the packed length, as megatron's THD RoPE); each document's
complete blocks are pooled on their own and concatenated; its rows select (replayed) among its
own blocks and attend to their tokens plus their causal tail within the document; the dense
indexer loss runs per document. Under CP (megatron's per-document THD split) K, V and the
indexer keys are all-gathered in the packed global order and the local rows work as at CP 1.
Padded query rows (`packed_seq_params.real_token_mask_q`, this rank's local rows under CP, as
megatron's DSA reads it) still select and attend; the indexer loss leaves them out, its mean
over the valid rows (`layers.loss_rows`; the KL sum over them when per-token).

Tensor parallelism (with or without sequence parallelism): the main attention's heads split
over TP as megatron splits them (linear_qkv column-parallel, linear_proj row-parallel); the
indexer is replicated, every rank running it whole on the whole sequence: under SP the layer
input is this rank's rows [sq / tp, b, h], which the core attention all-gathers over TP for the
indexer (linear_qkv gathers the same rows for the heads). Each rank selects the same blocks.
The indexer loss's target sums the attention probabilities over the heads, so it is summed over
the TP group (`indexer_kl_loss(tp_group=...)`); every rank then has the same loss and the full
indexer gradient, so the indexer's parameters are marked for megatron's TP gradient average
(`average_gradients_across_tp_domain`, as megatron's DSA indexer), not its sum. Tested at TP 2
and TP 2 + SP (plain and packed) against TP 1 (`tests/parallel/test_tp_sp_qsa.py`), and at
TP 2 x CP 2 with and without SP against TP 1 x CP 1 (`tests/parallel/test_tp_cp_qsa.py`).

Not covered yet (raise NotImplementedError naming it): inference / KV cache, padding or
document masks (packed documents come as `packed_seq_params`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Protocol

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant import dsa_layout
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossAutoScaler,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

from megatron_hyscale import ops, parallel, phase_spans, replay
from megatron_hyscale.layers.kernel_backend import kernel_backend
from megatron_hyscale.layers.loss_logging import log_indexer_loss
from megatron_hyscale.layers.loss_rows import IndexerLossRows, indexer_loss_rows
from megatron_hyscale.layers.packed import (
    DocumentRows,
    Documents,
    PackedLayout,
    checked_packed_layout,
    document_rows,
    per_row,
    pooled_ranges,
)
from megatron_hyscale.ops import hytopk
from megatron_hyscale.ops.block_pool import (
    block_first_positions,
    block_visibility_positions,
    expand_blocks,
    pool_blocks,
    select_blocks_reference,
)
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions
from megatron_hyscale.parallel import cp_row_layout

# The ops this layer's phases are timed by (`phase_spans`: plain calls unless phase_times
# records); its selection is timed by `replay.SelectionReplay.select`.
sparse_attention = phase_spans.timed(phase_spans.ATTENTION, ops.sparse_attention)
indexer_kl_loss = phase_spans.timed(phase_spans.INDEXER_LOSS, ops.indexer_kl_loss)
all_gather_to_global = phase_spans.timed(phase_spans.COMMUNICATION, parallel.all_gather_to_global)
start_all_gather_to_global = phase_spans.timed_start(phase_spans.COMMUNICATION,
                                                     parallel.start_all_gather_to_global)

# The attention kernels' options when the config names none: the Triton dK/dV pass in lockstep
# (its blocks selected in key order), measured faster on QSA's shapes than unpaced; the dQ pass
# and the forward in lockstep were measured slower, so they stay off (BENCHMARKS.md).
QSA_ATTENTION_OPTIONS = AttentionKernelOptions(dkv_lockstep=True)

# Baseline selection: fp32 per-head logits materialized per chunk of query rows (1 GiB).
BASELINE_CHUNK_ELEMENTS = 1 << 28


class BlockSelector(Protocol):
    """A QSA layer's selection strategy.

    Called with the indexer's queries q [B, T, H_I, D_I], block keys [B, NB, D_I], the blocks
    to keep per row, the score scale, the rows' positions [T] and the block size (block b
    visible to row t iff b < (t + 1) // block_size); returns int32 [B, T, topk] block ids, -1
    padded. `deterministic`: megatron's deterministic_mode. `key_order`: each row's blocks in
    increasing order (passed only to selectors that declare `keys_ascending` True: the
    attention's lockstep dK/dV kernel then paces its programs by key,
    `AttentionKernelOptions.dkv_lockstep`). `replays`:
    whether the recompute replays its first forward's selection (`replay.SelectionReplay`)
    instead of selecting again.
    """

    replays: bool
    keys_ascending: bool

    def __call__(self, q: torch.Tensor, block_keys: torch.Tensor, topk: int, *, scale: float,
                 q_positions: torch.Tensor, block_size: int, deterministic: bool,
                 key_order: bool = False) -> torch.Tensor: ...


@dataclass(frozen=True)
class HyTopKBlockSelector:
    """HyScale's QSA selection: `ops.hytopk` over the blocks (no score table); replayed."""

    replays: ClassVar[bool] = True
    keys_ascending: ClassVar[bool] = True

    def __call__(self, q: torch.Tensor, block_keys: torch.Tensor, topk: int, *, scale: float,
                 q_positions: torch.Tensor, block_size: int, deterministic: bool,
                 key_order: bool = False) -> torch.Tensor:
        B, T, H = q.shape[:3]
        nb = block_keys.shape[1]
        weights = torch.full((B, T, H), scale, dtype=torch.float32, device=q.device)
        # The attention needs each row's set only; the kernel's order depends on its atomics,
        # so deterministic_mode keeps sorted rows (a fixed summation order); key order where
        # the attention paces by it.
        order = "key" if key_order else "score" if deterministic else "any"
        return hytopk(q, block_keys, weights, topk, relu=True, q_positions=q_positions,
                      k_positions=block_visibility_positions(nb, block_size, q.device),
                      order=order)[0]


@dataclass(frozen=True)
class ScoreTableBlockSelector:
    """The stock-style baseline: per-head logits of a chunk of query rows (about
    BASELINE_CHUNK_ELEMENTS fp32 values), ReLU, head sum, masked torch.topk
    (`ops.block_pool.select_blocks_reference`); like a stock layer, the recompute selects
    again."""

    replays: ClassVar[bool] = False
    keys_ascending: ClassVar[bool] = False  # torch.topk's score order

    def __call__(self, q: torch.Tensor, block_keys: torch.Tensor, topk: int, *, scale: float,
                 q_positions: torch.Tensor, block_size: int, deterministic: bool,
                 key_order: bool = False) -> torch.Tensor:
        B, _, H = q.shape[:3]
        rows = max(1, BASELINE_CHUNK_ELEMENTS // (B * H * block_keys.shape[1]))
        return select_blocks_reference(q, block_keys, topk, scale=scale, q_positions=q_positions,
                                       block_size=block_size, rows_per_chunk=rows)


def qsa_selector(*, baseline: bool) -> BlockSelector:
    """HyScale's QSA selector, or with `baseline` the score-table one."""
    return ScoreTableBlockSelector() if baseline else HyTopKBlockSelector()


@dataclass
class QSATransformerConfig(TransformerConfig):
    """TransformerConfig plus QSA's indexer fields (defaults: Qwen3.8-Flash-Next).

    The QSA attention always has the sigmoid output gate and q/k norms, so those default on.
    """

    attention_output_gate: bool = True
    qk_layernorm: bool = True
    attention_dropout: float = 0.0  # the sparse attention has no dropout (Qwen uses none)

    qsa_indexer_n_heads: int = 4
    """Indexer query heads H_I."""

    qsa_indexer_head_dim: int = 128
    """Indexer head dim D_I (query heads and the single key head)."""

    qsa_indexer_budget: int = 2048
    """Token budget of the selected blocks (a multiple of qsa_block_size): budget / block_size
    blocks are kept per query, plus its causal tail."""

    qsa_block_size: int = 4
    """Tokens per pooled key block (transformers' `indexer_compress_ratio`)."""

    qsa_indexer_loss_coeff: float = 0.0
    """KL indexer loss coefficient; 0 (the default, as the reference) trains no indexer."""

    qsa_indexer_use_sparse_loss: bool = False
    """KL restricted to the selected blocks (else over every visible block)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("qsa_indexer_n_heads", "qsa_indexer_head_dim", "qsa_indexer_budget",
                     "qsa_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.qsa_indexer_budget % self.qsa_block_size:
            raise ValueError(
                f"qsa_indexer_budget ({self.qsa_indexer_budget}) must be a multiple of "
                f"qsa_block_size ({self.qsa_block_size})"
            )
        if not self.attention_output_gate:
            raise ValueError("QSA attention has a sigmoid output gate: attention_output_gate "
                             "must be True")
        if self.attention_dropout:
            raise ValueError(f"QSA's sparse attention has no dropout: attention_dropout must be "
                             f"0, got {self.attention_dropout!r}")
        if self.qsa_indexer_loss_coeff < 0:
            raise ValueError(f"qsa_indexer_loss_coeff must be >= 0, got "
                             f"{self.qsa_indexer_loss_coeff!r}")


@dataclass
class QSAIndexerSubmodules:
    """Builders of the indexer's projection (duplicated on every TP rank) and its two norms."""

    linear_qk: ModuleSpec | type | None = None
    q_layernorm: ModuleSpec | type | None = None
    k_layernorm: ModuleSpec | type | None = None


@dataclass
class QSAttentionSubmodules:
    """The core attention's only submodule: the indexer."""

    indexer: ModuleSpec | type | None = None


@dataclass
class QSASelfAttentionSubmodules(SelfAttentionSubmodules):
    """megatron's SelfAttentionSubmodules; core_attention is a HyScaleQSAttention spec."""


@dataclass(frozen=True)
class PackedBlocks:
    """A packed THD forward's documents, as QSA's local rows and pooled blocks see them."""

    layout: PackedLayout
    rows: DocumentRows  # the local rows' document starts and positions in their documents
    blocks: Documents  # each document's complete blocks, in the concatenated block keys
    row_emb: torch.Tensor | None  # [sq, 1, 1, rot] RoPE frequencies of the local rows
    block_emb: torch.Tensor | None  # [NB, 1, 1, rot] at each block's first row


def _whole_rope_table(pos_emb: torch.Tensor, layout: PackedLayout) -> bool:
    """Whether a packed THD RoPE table has a row per packed row (else one per position in a
    document; ValueError when it is shorter than the longest document)."""
    if pos_emb.size(0) == (layout.documents[-1][1] if layout.documents else 0):
        return True
    longest = max((e - a for a, e in layout.documents), default=0)
    if pos_emb.size(0) < longest:
        raise ValueError(f"HyScaleQSAttention: the RoPE table has {pos_emb.size(0)} rows, "
                         f"fewer than the longest packed document ({longest} rows; "
                         "max_seqlen_q too small?)")
    return False


def packed_blocks(packed_seq_params: Any, sq: int, device: torch.device, cp_group: Any,
                  pos_emb: torch.Tensor | None, block_size: int) -> PackedBlocks:
    """The documents of a packed THD sequence for QSA (ValueError naming the cu_seqlens
    argument read when they do not cover the rows, `layers.packed.checked_packed_layout`).

    The RoPE frequencies are read as megatron's THD RoPE reads them
    (`rope_utils._apply_rotary_pos_emb_thd`): a table of the whole packed sequence's rows
    (its length is the packed length) is indexed by packed row, any other table (megatron's
    `RotaryEmbedding(max_seqlen, packed_seq=True)`) by the position within the document.
    """
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise NotImplementedError(f"HyScaleQSAttention: packed_seq_params with qkv_format="
                                  f"{fmt!r} is not supported (only 'thd')")
    layout = checked_packed_layout(packed_seq_params, sq, device, layer="HyScaleQSAttention",
                                   group=cp_group)
    rows = document_rows(layout, device)
    blocks = pooled_ranges(layout.documents, block_size)
    row_emb = block_emb = None
    if pos_emb is not None:
        whole_table = _whole_rope_table(pos_emb, layout)
        row_emb = pos_emb.index_select(0, rows.offsets + (rows.starts if whole_table else 0))
        firsts = [(a if whole_table else 0) + block_first_positions(e - s, block_size, device)
                  for (a, _), (s, e) in zip(layout.documents, blocks, strict=True)]
        block_emb = pos_emb.index_select(
            0, torch.cat(firsts or [torch.zeros(0, dtype=torch.int64, device=device)]))
    return PackedBlocks(layout, rows, blocks, row_emb, block_emb)


class QSAIndexer(MegatronModule):
    """QSA indexer: H_I query heads and one key head of D_I, keys pooled over blocks.

    Parameters: `linear_qk.weight` [(H_I + 1) * D_I, hidden] (the first H_I * D_I rows are the
    query heads, the last D_I rows the key head), `q_layernorm.weight` and
    `k_layernorm.weight` [D_I] (per-head RMSNorm of the queries; RMSNorm of the pooled keys).
    """

    def __init__(
        self,
        config: QSATransformerConfig,
        submodules: QSAIndexerSubmodules,
        layer_number: int = 1,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.pg_collection = pg_collection
        self.n_heads = config.qsa_indexer_n_heads
        self.head_dim = config.qsa_indexer_head_dim
        self.block_size = config.qsa_block_size
        self.linear_qk = build_module(
            submodules.linear_qk,
            config.hidden_size,
            (self.n_heads + 1) * self.head_dim,
            config=config,
            init_method=config.init_method,
            bias=False,
            skip_bias_add=False,
            skip_weight_param_allocation=False,
            parallel_mode="duplicated",
        )
        self.q_layernorm = build_module(
            submodules.q_layernorm, config=config, hidden_size=self.head_dim,
            eps=config.layernorm_epsilon,
        )
        self.k_layernorm = build_module(
            submodules.k_layernorm, config=config, hidden_size=self.head_dim,
            eps=config.layernorm_epsilon,
        )
        # Every TP rank runs this whole indexer on the whole sequence (gathered under SP) with
        # the loss's target summed over the TP group's heads, so each rank's gradient is
        # already the full one. megatron's finalize_model_grads would otherwise SUM some of
        # them over TP (TP times too large): the norms by name under qk_layernorm
        # ("q_layernorm" / "k_layernorm"), and under SP whatever Transformer Engine marks
        # `sequence_parallel` (its duplicated linear, its norms). Its average keeps the equal
        # per-rank values and takes precedence over those sums (as for megatron's DSA indexer).
        for param in self.parameters():
            param.average_gradients_across_tp_domain = True

    def forward(
        self, x: torch.Tensor, rotary_pos_emb: torch.Tensor | None,
        cp_group: torch.distributed.ProcessGroup | None = None,
        packed: PackedBlocks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries (this rank's rows) and block keys (the whole sequence).

        Args:
            x: [sq, b, hidden] the attention layer's input (under context parallelism this
                rank's two zigzag chunks; under sequence parallelism already gathered over
                TP: every row the query has).
            rotary_pos_emb: [sq, 1, 1, rot] megatron RoPE frequencies of these rows (the main
                attention's; rot <= D_I), or None for no RoPE.
            cp_group: the context-parallel group (None or size 1: no CP). The raw keys and the
                frequencies are all-gathered into global order before pooling, since blocks
                are global (they straddle the zigzag chunk borders).
            packed: packed THD documents (`PackedBlocks`): rotary_pos_emb then holds these
                rows' frequencies at their positions in their documents, the raw keys are
                gathered in the packed global order (under CP) and each document's blocks are
                pooled on their own and rotated at `packed.block_emb`.

        Returns:
            q: [b, sq, H_I, D_I] normalized, rotated queries;
            block_keys: [b, S // block_size, D_I] pooled, normalized, rotated block keys, S the
                global sequence length.
        """
        sq, b = x.shape[:2]
        qk, _ = self.linear_qk(x)
        q, k = qk.split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        q = self.q_layernorm(q.reshape(sq, b, self.n_heads, self.head_dim))
        # [S, b, D_I] raw keys in global order; the backward (indexer loss only) reduce-scatters
        # their gradient to the owner ranks.
        k = all_gather_to_global(k, cp_group, None if packed is None else packed.layout.key_order)
        if packed is not None:  # [b, nb, D_I]: each document's blocks, in document order
            k = k.transpose(0, 1)
            keys = torch.cat([pool_blocks(k[:, a:e], self.block_size)
                              for a, e in packed.layout.documents], dim=1)
        else:
            keys = pool_blocks(k.transpose(0, 1), self.block_size)  # [b, nb, D_I], keys' mean
        keys = self.k_layernorm(keys)
        if rotary_pos_emb is not None and packed is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb, config=self.config, cp_group=cp_group)
            keys = apply_rotary_pos_emb(keys.transpose(0, 1).unsqueeze(2), packed.block_emb,
                                        config=self.config, cp_group=cp_group)
            keys = keys.squeeze(2).transpose(0, 1)
        elif rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb, config=self.config, cp_group=cp_group)
            # Each block is rotated at its first token's position (transformers' group_starts),
            # a global position: take it from the gathered frequencies.
            global_emb = all_gather_to_global(rotary_pos_emb.detach(), cp_group)
            first = block_first_positions(keys.shape[1], self.block_size, x.device)
            block_emb = global_emb.index_select(0, first)  # [nb, 1, 1, rot]
            keys = apply_rotary_pos_emb(keys.transpose(0, 1).unsqueeze(2), block_emb,
                                        config=self.config, cp_group=cp_group)
            keys = keys.squeeze(2).transpose(0, 1)
        return q.transpose(0, 1), keys


class HyScaleQSAttention(MegatronModule):
    """QSA core attention: block selection (its selector, replayed) + sparse attention.

    Built by megatron's `Attention` like any core attention; `selector` (a spec param, default
    `HyTopKBlockSelector`) picks the blocks; `ScoreTableBlockSelector` selects with a
    materialized block-score table and torch.topk and re-selects during recompute.
    With `config.qsa_indexer_loss_coeff` > 0 (training only) a KL loss trains the indexer: the
    target is the main attention (detached, summed over heads) over block-mean main keys, the
    prediction the softmax of the indexer's block scores (`ops.indexer_kl_loss` with blocks as
    keys); it is attached to the output like megatron's DSA indexer loss. This is a HyScale
    option, not part of the reference model.
    """

    def __init__(
        self,
        config: QSATransformerConfig,
        submodules: QSAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_type: str = "self",
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection: Any = None,
        selector: BlockSelector | None = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.pg_collection = pg_collection
        # The selection strategy (fixed at construction: the replay store follows it).
        self.selector = selector if selector is not None else HyTopKBlockSelector()
        self.block_size = config.qsa_block_size
        self.block_topk = config.qsa_indexer_budget // config.qsa_block_size
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        self.index_scale = config.qsa_indexer_head_dim ** -0.5
        self.indexer = build_module(submodules.indexer, config=config, layer_number=layer_number,
                                    pg_collection=pg_collection)
        self.selection_replay = replay.SelectionReplay(f"QSA layer {layer_number}",
                                                       replays=self.selector.replays)

    @property
    def baseline(self) -> bool:
        """Whether the selector is a side-by-side baseline (it selects again in the recompute)."""
        return not self.selector.replays

    def _check_supported(self, attn_mask_type: AttnMaskType | None, packed_seq_params: Any,
                         x: torch.Tensor | None, attention_mask: torch.Tensor | None,
                         sq: int) -> None:
        if x is None:
            raise ValueError("HyScaleQSAttention needs the layer input x (use "
                             "HyScaleQSASelfAttention)")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"HyScaleQSAttention supports causal masks only, got "
                                      f"{mask_type}")
        # Under SP x is this rank's shard of the rows the (gathered) query has.
        tp_size = get_pg_size(getattr(self.pg_collection, "tp", None))
        x_rows = x.size(0) * (tp_size if self.config.sequence_parallel else 1)
        if x_rows != sq:
            raise ValueError(f"HyScaleQSAttention: x has {x.size(0)} rows, the query {sq}"
                             + (f" (sequence parallel over {tp_size} TP ranks: x must be "
                                f"this rank's {sq // tp_size} rows)"
                                if self.config.sequence_parallel and tp_size > 1 else ""))
        if attention_mask is not None:
            # Causality is in the selection and the mask is not read: refuse any other mask
            # (padding, reset document masks), whose QSA blocks would start elsewhere.
            # megatron's convention: True = masked.
            causal = torch.ones(sq, sq, dtype=torch.bool, device=x.device).triu(1)
            mask = attention_mask.bool()
            if get_pg_size(getattr(self.pg_collection, "cp", None)) > 1:
                raise NotImplementedError(
                    "HyScaleQSAttention under context parallelism takes no attention mask "
                    "(causal is implied): run with --no-create-attention-mask-in-dataloader")
            if mask.shape[-2:] != (sq, sq) or not bool((mask == causal).all()):
                raise NotImplementedError(
                    "HyScaleQSAttention supports the plain causal mask only (got a padding or "
                    "document mask; --reset-attention-mask is not supported)")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        x: torch.Tensor | None = None,
        pos_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [sq, b, np, hn], key / value [sq, b, ng, hn] (normalized, rotated), x [sq, b, h]
        (under sequence parallelism this rank's rows, [sq / tp, b, h]), pos_emb [sq, 1, 1, rot]
        (RoPE frequencies for the indexer) -> [sq, b, np * hn].

        `attention_mask` (None, or megatron's plain causal mask, True = masked: checked) is not
        read otherwise: causality is in the selected indices.
        """
        sq, b = query.shape[:2]
        self._check_supported(attn_mask_type, packed_seq_params, x, attention_mask, sq)
        cfg = self.config
        # The indexer learns only from its own loss (if any): no gradient into the main model.
        x = x.detach()
        pos_emb = pos_emb.detach() if pos_emb is not None else None
        loss_coeff = float(cfg.qsa_indexer_loss_coeff or 0.0)
        use_loss = self.training and torch.is_grad_enabled() and loss_coeff > 0

        # Whatever cp_comm_type says, QSA gathers K, V and the indexer keys (allgather CP):
        # every query's selection reaches anywhere before it.
        layout = cp_row_layout(self.pg_collection, sq, query.device, layer="HyScaleQSAttention",
                               key_rows=key.size(0), config=cfg)
        cp_group, q_positions = layout.group, layout.positions
        seq_len = key.size(0) * layout.size
        packed = order = None
        if packed_seq_params is not None:
            packed = packed_blocks(packed_seq_params, sq, query.device, cp_group, pos_emb,
                                   self.block_size)
            pos_emb, order = packed.row_emb, packed.layout.key_order

        q_idx = block_keys = None
        if use_loss or not self.selection_replay.replaying():
            with torch.enable_grad() if use_loss else torch.no_grad():
                q_idx, block_keys = self.indexer(self._indexer_rows(x), pos_emb, cp_group,
                                                 packed)
        # [sq, b, ng, hn] local -> [S, b, ng, hn] global order (no-op without CP), started after
        # the indexer's own gather and waited on after the selection, so K and V transfer while
        # HyTopK runs; backward reduce-scatters the gradients to the owner ranks. Indices below
        # address this global sequence.
        pending = [start_all_gather_to_global(t, cp_group, order) for t in (key, value)]
        if packed is None:
            blocks = self._select_blocks(q_idx, block_keys, b, sq, seq_len, q_positions)
            indices = expand_blocks(blocks, q_positions, self.block_size)  # [b, sq, 4 Kb + 3]
        else:
            blocks = self._select_packed_blocks(q_idx, block_keys, b, sq, packed)
            indices = self._expand_packed_blocks(blocks, packed)
        key, value = (p.wait() for p in pending)

        query_b, key_b, value_b = (t.transpose(0, 1) for t in (query, key, value))
        out = sparse_attention(query_b, key_b, value_b, indices, self.softmax_scale,
                               deterministic=bool(cfg.deterministic_mode),
                               options=self._attention_options(),
                               # expanded blocks and the causal tail: distinct by construction
                               backend=kernel_backend(cfg), check_values=False,
                               # blocks in key order expand to increasing tokens, tail last
                               keys_ascending=self._paced())
        output = out.transpose(0, 1).reshape(sq, b, -1)
        if use_loss and blocks.shape[-1] > 0:
            # Padded query rows (local rows, as stock reads them): out of the loss only.
            weigh = indexer_loss_rows(packed_seq_params, b=b, rows=sq,
                                      per_token=bool(cfg.calculate_per_token_loss),
                                      device=query.device, layer="HyScaleQSAttention")
            args = (q_idx, block_keys, query_b, key_b, blocks, q_positions, weigh)
            loss = self._indexer_loss(*args, *(() if packed is None else (packed,)))
            # Logged and back-propagated the way megatron's DSA indexer loss is.
            log_indexer_loss(loss, cfg, self.layer_number, cp_group)
            output = DSAIndexerLossAutoScaler.apply(output, loss)
        return output

    def _indexer_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The indexer's input: x [sq, b, h], or under sequence parallelism x
        [sq / tp, b, h] (this rank's shard) all-gathered over the TP group into the query's
        rows (megatron's linear_qkv gathers the same rows for the heads).

        Gathered only where the indexer runs (not when a recompute replays the selection
        without a loss). x is detached, so no gradient crosses this gather; were it not,
        each rank's gradient wrt the gathered rows would be the whole gradient (every rank
        computes the same replicated indexer and loss, its target summed over TP), so the
        backward must take this rank's slice (tensor_parallel_output_grad=False), not
        reduce-scatter (TP times the gradient)."""
        tp_group = getattr(self.pg_collection, "tp", None)
        if not self.config.sequence_parallel or get_pg_size(tp_group) == 1:
            return x
        return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                    group=tp_group)

    def _attention_options(self) -> AttentionKernelOptions:
        """config.attention_kernel_options, else this layer's default (QSA_ATTENTION_OPTIONS)."""
        return getattr(self.config, "attention_kernel_options", None) or QSA_ATTENTION_OPTIONS

    def _paced(self) -> bool:
        """Whether one of the attention's Triton kernels runs in lockstep
        (`AttentionKernelOptions.dkv_lockstep`, `dq_lockstep`, `fwd_lockstep`), which pays on
        rows in key order only: then a selector that can (`keys_ascending`) sorts them by
        key."""
        options = self._attention_options()
        # deterministic_mode runs dK/dV unpaced (its fixed-point passes); the others pace.
        paced = ((options.dkv_lockstep and not self.config.deterministic_mode)
                 or options.dq_lockstep or options.fwd_lockstep)
        return paced and getattr(self.selector, "keys_ascending", False)

    def _order_kwargs(self) -> dict:
        """The selector's key_order argument where it is wanted (a selector of its own that
        declares no `keys_ascending` is called as before)."""
        return {"key_order": True} if self._paced() else {}

    def _select_blocks(
        self, q_idx: torch.Tensor | None, block_keys: torch.Tensor | None, b: int, sq: int,
        seq_len: int, q_positions: torch.Tensor,
    ) -> torch.Tensor:
        """int32 [b, sq, min(block_topk, seq_len // block_size)] selected blocks (-1 padded)
        for the sq local query rows at global `q_positions`, over a sequence of seq_len:
        replayed, or picked by the selector."""
        nb = seq_len // self.block_size
        kb = min(self.block_topk, nb)
        if kb == 0:  # no complete block anywhere: every query attends to its tail only
            return torch.empty((b, sq, 0), dtype=torch.int32, device=q_positions.device)

        def compute() -> torch.Tensor:
            with torch.no_grad():
                return self.selector(q_idx.detach(), block_keys.detach(), kb,
                                     scale=self.index_scale, q_positions=q_positions,
                                     block_size=self.block_size,
                                     deterministic=bool(self.config.deterministic_mode),
                                     **self._order_kwargs())

        return self.selection_replay.select((b, sq, kb), compute)

    def _select_packed_blocks(
        self, q_idx: torch.Tensor | None, block_keys: torch.Tensor | None, b: int, sq: int,
        packed: PackedBlocks,
    ) -> torch.Tensor:
        """int32 [b, sq, min(block_topk, most blocks of a document)] selected blocks of packed
        documents (ids into the concatenated block keys, -1 padded): each document's rows pick
        among its own blocks at their positions in it; replayed, or picked by the selector."""
        kb = min(self.block_topk, max((e - s for s, e in packed.blocks), default=0))
        if kb == 0:  # no document has a complete block: every query attends to its tail only
            return torch.empty((b, sq, 0), dtype=torch.int32, device=packed.rows.offsets.device)

        def compute() -> torch.Tensor:
            blocks = torch.full((b, sq, kb), -1, dtype=torch.int32, device=q_idx.device)
            with torch.no_grad():
                for (r0, r1), (e0, e1) in zip(packed.layout.local, packed.blocks, strict=True):
                    k = min(kb, e1 - e0)
                    if k == 0 or r1 == r0:
                        continue
                    got = self.selector(q_idx[:, r0:r1].detach(), block_keys[:, e0:e1].detach(),
                                        k, scale=self.index_scale,
                                        q_positions=packed.rows.offsets[r0:r1],
                                        block_size=self.block_size,
                                        deterministic=bool(self.config.deterministic_mode),
                                        **self._order_kwargs())
                    blocks[:, r0:r1, :k] = torch.where(got >= 0, got + e0, got)
            return blocks

        return self.selection_replay.select((b, sq, kb), compute)

    def _expand_packed_blocks(self, blocks: torch.Tensor, packed: PackedBlocks) -> torch.Tensor:
        """Token indices (rows of the whole packed sequence) of packed documents' selected
        blocks plus each row's causal tail within its document, as `expand_blocks`."""
        first = per_row((s for s, _ in packed.blocks), packed.layout.local, blocks.device)
        local = torch.where(blocks >= 0, blocks - first[:, None].to(blocks.dtype), -1)
        tokens = expand_blocks(local, packed.rows.offsets, self.block_size)
        starts = packed.rows.starts.to(tokens.dtype)[:, None]
        return torch.where(tokens >= 0, tokens + starts, -1)

    def _indexer_loss(
        self, q_idx: torch.Tensor, block_keys: torch.Tensor, query_b: torch.Tensor,
        key_b: torch.Tensor, blocks: torch.Tensor, q_positions: torch.Tensor,
        weigh: IndexerLossRows, packed: PackedBlocks | None = None,
    ) -> torch.Tensor:
        """Optional KL indexer loss over blocks (see the class docstring), weighing the rows
        as `weigh` says (the mean over the rows, or over the valid rows of a row mask; the
        KL sum when per-token).

        Packed documents: the main keys are pooled per document; the sparse loss reads the
        selected blocks at packed positions (each block's last row, the rows' own rows: the
        selection is the row's document's), the dense loss runs per document over its own
        blocks with its share of the rows' mean (its KL sum when per-token or with a row
        mask, whose mean `weigh.finish` takes)."""
        cfg = self.config
        nb = block_keys.shape[1]
        bs = self.block_size
        b, _, hkv, hn = key_b.shape  # the (gathered) keys: all rows of the sequence
        rows = q_idx.shape[1]  # the local query rows, whose mean the loss is
        sparse = bool(cfg.qsa_indexer_use_sparse_loss)
        # Main keys averaged per block: [b, nb, hkv, hn] (fp32 mean, as the indexer's pooling).
        key_b = key_b.detach()
        if packed is None:
            main_blocks = pool_blocks(key_b.flatten(2), bs).unflatten(2, (hkv, hn))
            k_positions = block_visibility_positions(nb, bs, q_idx.device)
        else:
            main_blocks = torch.cat([pool_blocks(key_b[:, a:e].flatten(2), bs)
                                     for a, e in packed.layout.documents], dim=1)
            main_blocks = main_blocks.unflatten(2, (hkv, hn))
            q_positions = packed.rows.starts + packed.rows.offsets
            k_positions = torch.cat(
                [a + block_visibility_positions(e - s, bs, q_idx.device)
                 for (a, _), (s, e) in zip(packed.layout.documents, packed.blocks, strict=True)])
        weights = torch.full(q_idx.shape[:3], self.index_scale, dtype=torch.float32,
                             device=q_idx.device)
        loss = partial(indexer_kl_loss, softmax_scale=self.softmax_scale, relu=True,
                       calculate_per_token_loss=weigh.sums,
                       tp_group=getattr(self.pg_collection, "tp", None),
                       deterministic=bool(cfg.deterministic_mode))
        coeff = float(cfg.qsa_indexer_loss_coeff)
        if packed is None or sparse:
            return weigh.finish(loss(
                q_idx, weights, block_keys, query_b.detach(), main_blocks, blocks,
                loss_coeff=coeff * weigh.share(rows), sparse=sparse, q_positions=q_positions,
                k_positions=k_positions, query_valid_rows=weigh.part(0, rows)))
        total = None
        for (r0, r1), (e0, e1) in zip(packed.layout.local, packed.blocks, strict=True):
            if r1 == r0 or e1 == e0:  # alone, this document would have no loss
                continue
            part = loss(q_idx[:, r0:r1], weights[:, r0:r1], block_keys[:, e0:e1],
                        query_b[:, r0:r1].detach(), main_blocks[:, e0:e1], None,
                        loss_coeff=coeff * weigh.share(r1 - r0), sparse=False,
                        q_positions=packed.rows.offsets[r0:r1],
                        k_positions=block_visibility_positions(e1 - e0, bs, q_idx.device),
                        query_valid_rows=weigh.part(r0, r1))
            total = part if total is None else total + part
        return weigh.finish(total)


class HyScaleQSASelfAttention(SelfAttention):
    """megatron's gated SelfAttention whose core attention (HyScaleQSAttention) also receives
    the layer input (for the indexer) and the RoPE frequencies.

    Same constructor, parameters and TransformerLayer call signature as `SelfAttention`; the
    forward covers training and evaluation without a KV cache (see the module docstring).
    """

    def __init__(self, config: QSATransformerConfig, submodules: SelfAttentionSubmodules,
                 layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 **kwargs: Any) -> None:
        if not config.attention_output_gate:
            raise ValueError("HyScaleQSASelfAttention needs config.attention_output_gate=True")
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                         **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        rotary_pos_cos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [sq, b, h] -> (output [sq, b, h], bias or None), as SelfAttention."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("HyScaleQSASelfAttention: inference (KV cache) is not "
                                      "supported yet")
        if key_value_states is not None:
            raise ValueError("HyScaleQSASelfAttention is self-attention only")
        if rotary_pos_cos is not None or rotary_pos_sin is not None:
            raise NotImplementedError("HyScaleQSASelfAttention takes RoPE as rotary_pos_emb")
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        if isinstance(rotary_pos_emb, tuple):
            q_emb, k_emb = rotary_pos_emb
        else:
            q_emb = k_emb = rotary_pos_emb

        query, key, value, gate = self.get_query_key_value_tensors(
            hidden_states, output_gate=True
        )  # query / gate [sq, b, np, hn], key / value [sq, b, ng, hn]; q/k normalized
        cu_q = cu_kv = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # megatron's THD RoPE (as its Attention: per document, the padded cu_seqlens
            # where given), on the batch-free [t, heads, dim] layout it takes.
            if hidden_states.size(1) != 1:
                raise NotImplementedError(f"HyScaleQSASelfAttention: packed THD sequences "
                                          f"have batch size 1, got {hidden_states.size(1)}")
            cp = self.pg_collection.cp
            # Checked before megatron's RoPE splits by them (ValueError naming the argument).
            # The query's rows: under sequence parallelism linear_qkv has gathered them.
            layout = checked_packed_layout(packed_seq_params, query.size(0),
                                           hidden_states.device, layer="HyScaleQSAttention",
                                           group=cp if get_pg_size(cp) > 1 else None)
            for emb in (q_emb, k_emb):
                if emb is not None:
                    _whole_rope_table(emb, layout)
            cu_q, cu_kv = dsa_layout.get_packed_qk_cu_seqlens(packed_seq_params)
        if q_emb is not None:
            query = self._rotate(query, q_emb, cu_q)
        if k_emb is not None:
            key = self._rotate(key, k_emb, cu_kv)

        extra = {"x": hidden_states, "pos_emb": q_emb}
        if self.checkpoint_core_attention and self.training:
            core_out = self._checkpointed_attention_forward(
                query, key, value, attention_mask, attn_mask_type=self.attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                core_attention_extra_kwargs=extra,
            )
        else:
            core_out = self.core_attention(
                query, key, value, attention_mask, attn_mask_type=self.attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params, **extra,
            )
        # Sigmoid output gate per channel, in fp32 (megatron's _apply_output_gate, unscripted).
        core_out = (core_out * torch.sigmoid(gate.reshape(core_out.shape).float())).to(
            core_out.dtype)
        output, bias = self.linear_proj(core_out)
        return output, bias

    def _rotate(self, t: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor | None
                ) -> torch.Tensor:
        """megatron's RoPE of [sq, b, heads, dim] (per packed document with cu_seqlens)."""
        thd = cu_seqlens is not None
        out = apply_rotary_pos_emb(t.squeeze(1) if thd else t, freqs, config=self.config,
                                   cu_seqlens=cu_seqlens, mscale=self._yarn_concentration_factor,
                                   cp_group=self.pg_collection.cp)
        return out.unsqueeze(1) if thd else out


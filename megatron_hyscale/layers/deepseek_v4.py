"""DeepSeek-V4 attention (sliding window, CSA, HCA) as Megatron modules on HyScale's ops.

One class, `HyScaleV4Attention`, covers V4's three layer kinds, chosen per layer by the
compress ratio (`DeepseekV4TransformerConfig.v4_compress_ratios[layer_number - 1]`, or the
`compress_ratio` spec parameter):
- 0: sliding window only (the last `v4_sliding_window` tokens, the query's own included);
- 4 (CSA; the ratio `v4_csa_ratio`): KV compressed 4:1 with overlapping windows
  (`ops.compress.compress_overlapping`); a lightning indexer over its own compressed keys picks
  the top `v4_index_topk` visible entries per query through `ops.hytopk`; plus the window;
- 128 (HCA; any other positive ratio too): KV compressed 128:1 (`ops.compress.compress`),
  every visible entry plus the window.
Each query runs one `ops.sparse_attention` call over [compressed entries ; raw tokens] with
indices [selected compressed entries, window tokens] (CSA) or the window tokens after a dense
prefix of every visible entry (HCA: `prefix_lengths`, generated in the kernels, so there is no
[T, T / m] index tensor and each row runs only its visible entries): one shared K = V head of
`v4_head_dim`, RoPE (V4's interleaved variant) on its last `v4_rope_head_dim` channels, a
per-head sink logit, and afterwards the inverse rotation of the output at the query position
(V4: values carry RoPE because K = V) and the grouped output projection.

Semantics are those of transformers' `DeepseekV4Attention` (stateless training mode); see
`megatron_hyscale.ops.compress` for the compressors and the visibility rule: compressed entry s
is visible to query t iff s < floor((t + 1) / m). HyTopK expresses that with key positions
(s + 1) * m - 1 and query positions t (`compressed_key_positions`).

Selection: a CSA layer's selector (a strategy, `EntrySelector`) picks the entries; under
megatron's recompute (`tensor_parallel.checkpoint`) the selection is recorded in the first
forward and replayed by the recompute (`replay.SelectionReplay.select`), as in
`HyScaleDSAttention`; HCA and window layers select nothing (their indices are a fixed function
of T). `HyTopKEntrySelector` is HyScale's; `ScoreTableEntrySelector` (the specs' `baseline=True`,
or `v4_baseline`) is the side-by-side stand-in for a stock implementation: the indexer scores
are materialized per row block (`v4_baseline_row_block` rows), `torch.topk` selects, and the
recompute selects again (no replay).

Indexer training: the signal DeepSeek used for V4's indexer is not public. With
`v4_indexer_loss_coeff > 0` the DSA recipe is applied: the indexer's inputs are detached and a
KL loss (`ops.indexer_kl_loss`) to the main attention's head-summed distribution over the
compressed entries (over the selected ones with `v4_indexer_use_sparse_loss`, over all visible
ones otherwise) is attached to the output like megatron's DSA loss. Off by default, in which
case the indexer's parameters get no gradient (as in transformers, where top-k cuts it).

Parameter names (transformers' names in brackets; `testing.deepseek_v4` maps them):
  linear_q_a.weight [q_a_proj], q_a_norm.weight [q_a_norm], linear_q_b.weight [q_b_proj],
  linear_kv.weight [kv_proj], kv_norm.weight [kv_norm], linear_o_a.weight [o_a_proj],
  linear_o_b.weight [o_b_proj], sinks [sinks];
  compressor.{linear_kv, linear_gate}.weight, compressor.position_bias,
  compressor.kv_norm.weight [compressor.{kv_proj, gate_proj, position_bias, kv_norm}];
  indexer.linear_q_b.weight [compressor.indexer.q_b_proj],
  indexer.linear_weights.weight [compressor.indexer.scorer.weights_proj],
  indexer.compressor.* [compressor.indexer.{kv_proj, gate_proj, position_bias, kv_norm}].

RoPE: window-only layers use `v4_rope_theta`; CSA / HCA layers (attention, compressors and
indexer alike) `v4_compress_rope_theta`, with YaRN frequencies when `v4_compress_rope_scaling`
is set (V4-Flash's checkpoint config asks for YaRN there; copy its values).

Context parallelism (megatron's zigzag layout: rank r holds chunks r and 2cp-1-r of 2cp; any
`cp_comm_type`, the layer always all-gathers, `parallel.all_gather_to_global`, whose backward
reduce-scatters the gradients to the owner ranks): the sliding window straddles the chunk
borders, so each chunk gets a halo of the W - 1 RoPE'd raw tokens before it (the last W - 1
tokens of every chunk are all-gathered), or, when W - 1 exceeds a chunk, the whole raw K = V is
all-gathered. Each compressor pools the entries of its own chunks (CSA's first window of a
chunk also reads the previous chunk's last window) and all-gathers them, or, when a chunk is
not a whole number of windows, all-gathers its kv and gate projections and pools the whole
sequence. The local query rows then select (HyTopK with their global positions) among the
whole sequence's entries and attend over [compressed entries ; raw keys]. Selection replay is
unchanged (the selected indices point into the entries). `HyScaleV4Attention.forward` lists
the volumes at 1M tokens.

Packed THD sequences (`packed_seq_params`, qkv_format "thd"; cu_seqlens or their padded
variants, whose padding rows then belong to their document, after its real rows): every
document is its own sequence, so a packed batch gives each document exactly the output and
gradients of the layer on that document alone. Positions (RoPE, window, visibility) restart at
each document's first row; the window stops there; each compressor pools every document on its
own (its tail window partial and dropped) and concatenates the documents' entries; a CSA
layer's rows select (HyTopK, replayed) among their own document's entries, k = min(top-k, the
most entries of a document); an HCA layer lists each row's visible entries of its document
(int32 [T, most entries of a document], instead of the unpacked prefix generated in-kernel);
the dense indexer loss runs per document (the sparse one reads the selection at packed
positions). Under CP (megatron's per-document THD split: rank r holds chunks r and 2cp-1-r of
every document) the raw K = V and the compressors' projections are all-gathered in the packed
global order (the "gather" modes above) and the local rows work as at CP 1.

Padded query rows (`packed_seq_params.real_token_mask_q`, this rank's local rows under CP, as
megatron's DSA reads it): as in DSA, they still select and attend; a CSA layer's indexer loss
leaves them out, its mean over the valid rows (`layers.loss_rows`: the row parts and the
documents each add their valid rows' KL sum, divided once by the layer's valid-row count; the
KL sum over the valid rows when per-token). Window and HCA layers have no indexer loss, so the
mask changes nothing there.

Not covered yet (they raise): tensor / sequence parallelism, inference caches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Protocol

import torch
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossAutoScaler,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hyscale import ops, parallel, phase_spans, replay
from megatron_hyscale.layers.kernel_backend import kernel_backend
from megatron_hyscale.layers.linear import LocalLinear
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
from megatron_hyscale.layers.row_chunks import (
    check_row_chunk,
    row_chunk_conflict,
    run_in_row_parts,
)
from megatron_hyscale.ops import hytopk
from megatron_hyscale.ops.compress import (
    apply_interleaved_rope,
    compress,
    compress_overlapping,
    compressed_key_positions,
    compressed_visible_count,
    default_inv_freq,
    rms_norm_rope,
    rope_cos_sin,
    yarn_inv_freq,
)
from megatron_hyscale.parallel import RowOrder, cp_row_layout

# The ops this layer's phases are timed by (`phase_spans`: plain calls unless phase_times
# records); its selection is timed by `replay.SelectionReplay.select`.
sparse_attention = phase_spans.timed(phase_spans.ATTENTION, ops.sparse_attention)
indexer_kl_loss = phase_spans.timed(phase_spans.INDEXER_LOSS, ops.indexer_kl_loss)
all_gather_to_global = phase_spans.timed(phase_spans.COMMUNICATION, parallel.all_gather_to_global)

CSA_RATIO = 4
HCA_RATIO = 128


@dataclass
class DeepseekV4TransformerConfig(TransformerConfig):
    """TransformerConfig plus V4's attention geometry (defaults: DeepSeek-V4-Flash).

    Uses the base fields hidden_size, num_attention_heads, layernorm_epsilon (V4: 1e-6),
    normalization ("RMSNorm"), init_method / output_layer_init_method, params_dtype.
    """

    v4_head_dim: int = 512
    v4_rope_head_dim: int = 64
    v4_q_lora_rank: int = 1024
    v4_o_groups: int = 8
    v4_o_lora_rank: int = 1024
    v4_sliding_window: int = 128
    # One ratio per layer: 0 window only, 4 CSA, 128 HCA (None: all CSA).
    v4_compress_ratios: list[int] | None = None
    v4_csa_ratio: int = CSA_RATIO  # the ratio that means CSA; any other positive ratio is HCA
    v4_index_n_heads: int = 64
    v4_index_head_dim: int = 128
    v4_index_topk: int = 512
    v4_rope_theta: float = 10000.0  # window-only layers
    v4_compress_rope_theta: float = 160000.0  # CSA / HCA layers (attention and compressors)
    # YaRN for the compress RoPE, as in V4's checkpoint config: {"type": "yarn", "factor": 16,
    # "original_max_position_embeddings": ..., "beta_fast": 32, "beta_slow": 1}; None = plain.
    v4_compress_rope_scaling: dict | None = None
    v4_indexer_loss_coeff: float = 0.0  # > 0: DSA-style KL loss for the CSA indexer
    v4_indexer_use_sparse_loss: bool = True
    v4_baseline: bool = False  # ScoreTableEntrySelector: materialized scores + torch.topk
    v4_baseline_row_block: int = 4096
    # Rows per part (None: no parts): the per-row work (q up projection, sparse attention,
    # output projection, the part's indexer loss) runs this many local rows at a time, each
    # part under its own activation checkpoint; for 1M tokens at low CP.
    v4_row_chunk: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_row_chunk(self.v4_row_chunk, "v4_row_chunk")  # at construction, not first forward
        # Window, CSA and HCA layers carry different parameters; megatron's distributed
        # checkpoint stacks a tensor over the layers unless keys are per layer, and a tensor
        # only some layers have then fails its validation (the model cannot be saved).
        if self.v4_compress_ratios and len(set(self.v4_compress_ratios)) > 1:
            self.hetereogenous_dist_checkpoint = True


def _linear(submodule: Any, n_in: int, n_out: int, config: TransformerConfig,
            init_method: Any) -> torch.nn.Module:
    """A replicated, bias-free linear from its spec (LocalLinear / TELinear signature)."""
    return build_module(submodule, n_in, n_out, config=config, init_method=init_method,
                        bias=False, skip_bias_add=False, parallel_mode="duplicated",
                        skip_weight_param_allocation=False)


def _norm(submodule: Any, size: int, config: TransformerConfig) -> torch.nn.Module:
    return build_module(submodule, config=config, hidden_size=size, eps=config.layernorm_epsilon)


def _gather_tokens(x: torch.Tensor, cp_group: Any, order: RowOrder | None = None
                   ) -> torch.Tensor:
    """[B, L, C] this rank's zigzag rows -> [B, cp * L, C] the whole sequence in global order.

    A private wrapper of `parallel.all_gather_to_global` (sequence-first) for batch-first
    tensors; the backward reduce-scatters (sums) the gradient to the rows' owners. None or a
    size-1 group returns x unchanged. `order`: a packed THD sequence's gather order
    (`PackedLayout.key_order`; None: the zigzag chunks).
    """
    if cp_group is None:
        return x
    return all_gather_to_global(x.transpose(0, 1), cp_group, order).transpose(0, 1)


class GroupedLinear(MegatronModule):
    """Block-diagonal linear: group g of the input maps through its own [R, I] block.

    weight [G * R, I] (the same layout as transformers' `DeepseekV4GroupedLinear`: rows
    g*R..(g+1)*R-1 are group g's block). Input [..., G, I], output [..., G * R].
    """

    def __init__(self, input_size_per_group: int, output_size: int, groups: int, *,
                 config: TransformerConfig, init_method: Any) -> None:
        super().__init__(config)
        if output_size % groups:
            raise ValueError(f"output_size {output_size} is not divisible by groups {groups}")
        self.groups = groups
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size_per_group, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])  # [G, R, I]
        return torch.einsum("...gi,gri->...gr", x, w).flatten(-2)


@dataclass
class V4CompressorSubmodules:
    linear_kv: ModuleSpec | type = LocalLinear
    linear_gate: ModuleSpec | type = LocalLinear
    kv_norm: ModuleSpec | type = WrappedTorchNorm


class V4Compressor(MegatronModule):
    """Softmax-gated KV compressor: hidden [B, T, h] -> entries [B, T // ratio, dim].

    overlap=True is CSA's (projections to 2 * dim, windows of width 2 * ratio), False HCA's.
    Parameters: linear_kv.weight, linear_gate.weight, position_bias [ratio, (2 *) dim],
    kv_norm.weight [dim].
    """

    def __init__(self, config: TransformerConfig, submodules: V4CompressorSubmodules, *,
                 dim: int, ratio: int, overlap: bool) -> None:
        super().__init__(config)
        self.ratio, self.overlap, self.dim = ratio, overlap, dim
        width = 2 * dim if overlap else dim
        self.linear_kv = _linear(submodules.linear_kv, config.hidden_size, width, config,
                                 config.init_method)
        self.linear_gate = _linear(submodules.linear_gate, config.hidden_size, width, config,
                                   config.init_method)
        # V4 initializes the bias to zero (uniform softmax within a window at start).
        self.position_bias = torch.nn.Parameter(
            torch.zeros(ratio, width, dtype=config.params_dtype))
        self.kv_norm = _norm(submodules.kv_norm, dim, config)

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor | None, cp_group: Any = None,
                packed: PackedLayout | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T // ratio, dim] (RMSNorm'd, RoPE'd at i * ratio).

        Packed THD (`packed`): each document is pooled on its own (its tail window partial and
        dropped, RoPE at i * ratio within the document) and the documents' entries are
        concatenated in order (`layers.packed.pooled_ranges`); under CP the projections are
        all-gathered into the packed global order first (`cp_mode` "gather").

        Under context parallelism (`cp_group` of size cp > 1) x holds this rank's L zigzag rows
        and the result is [B, cp * L // ratio, dim], the entries of the whole sequence. When
        each zigzag chunk (L / 2 tokens) is a whole number of windows, every rank pools its own
        chunks' entries (CSA's first window of a chunk also reads the previous chunk's last
        window, all-gathered: 2 * ratio tokens a rank) and the entries are all-gathered:
        [S / ratio, dim] instead of the [S, 2 (2) dim] projections. Otherwise the projections
        are all-gathered (one collective for kv and gate) and pooled in global order on every
        rank. Both give the same entries. `cp_mode` records which ran ("chunks" / "gather").
        """
        kv, _ = self.linear_kv(x)
        gate, _ = self.linear_gate(x)
        self.cp_mode = None
        if packed is not None:
            if cp_group is not None:
                self.cp_mode = "gather"
                width = kv.shape[-1]
                kv, gate = _gather_tokens(torch.cat([kv, gate], dim=-1), cp_group,
                                          packed.key_order).split(width, -1)
            return torch.cat([self._pool(kv[:, a:b], gate[:, a:b], inv_freq)
                              for a, b in packed.documents], dim=1)
        if cp_group is not None:
            chunk = x.shape[1] // 2
            if x.shape[1] % 2 == 0 and chunk >= self.ratio and chunk % self.ratio == 0:
                self.cp_mode = "chunks"
                return self._pool_own_chunks(kv, gate, inv_freq, cp_group, chunk)
            self.cp_mode = "gather"
            width = kv.shape[-1]
            kv, gate = _gather_tokens(torch.cat([kv, gate], dim=-1), cp_group).split(width, -1)
        return self._pool(kv, gate, inv_freq)

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, inv_freq: torch.Tensor | None
              ) -> torch.Tensor:
        fn = compress_overlapping if self.overlap else compress
        return fn(kv, gate, self.position_bias, self.ratio, norm_weight=self.kv_norm.weight,
                  eps=self.config.layernorm_epsilon, inv_freq=inv_freq)

    def _pool_own_chunks(self, kv: torch.Tensor, gate: torch.Tensor,
                         inv_freq: torch.Tensor | None, cp_group: Any, chunk: int
                         ) -> torch.Tensor:
        """Entries of this rank's two zigzag chunks (global chunks r and 2 cp - 1 - r), pooled
        locally, then all-gathered into global order; see forward."""
        m, width = self.ratio, kv.shape[-1]
        cp, rank = cp_group.size(), cp_group.rank()
        proj = torch.cat([kv, gate], dim=-1)
        if self.overlap:
            # The last window of every chunk, global chunk order: [B, 2 cp * m, 2 width].
            tails = _gather_tokens(torch.cat([proj[:, chunk - m:chunk], proj[:, -m:]], dim=1),
                                   cp_group)
        parts = []
        for half, c in enumerate((rank, 2 * cp - 1 - rank)):
            part = proj[:, half * chunk:(half + 1) * chunk]
            drop = 0
            if self.overlap and c > 0:
                # Prepend the previous chunk's last window; the entry pooled from it alone
                # (against a virtual empty window) is dropped.
                part = torch.cat([tails[:, (c - 1) * m:c * m], part], dim=1)
                drop = 1
            entries = self._pool(*part.split(width, dim=-1), None)[:, drop:]
            if inv_freq is not None:  # RoPE at the entries' global positions i * m
                positions = (torch.arange(entries.shape[1], device=entries.device)
                             + c * chunk // m) * m
                cos, sin = rope_cos_sin(positions, inv_freq.to(entries.device))
                entries = apply_interleaved_rope(entries, cos, sin)
            parts.append(entries)
        return _gather_tokens(torch.cat(parts, dim=1), cp_group)


@dataclass
class V4IndexerSubmodules:
    linear_q_b: ModuleSpec | type = LocalLinear
    linear_weights: ModuleSpec | type = LocalLinear
    compressor: V4CompressorSubmodules = dataclasses.field(default_factory=V4CompressorSubmodules)


class V4Indexer(MegatronModule):
    """CSA lightning indexer: queries from the q latent, keys from its own CSA compressor.

    score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) with w = linear_weights(x) * H^-0.5 and
    the logit scale D^-0.5 folded into w (positive, so ReLU commutes with it).
    """

    def __init__(self, config: DeepseekV4TransformerConfig, submodules: V4IndexerSubmodules,
                 *, ratio: int) -> None:
        super().__init__(config)
        self.n_heads, self.head_dim = config.v4_index_n_heads, config.v4_index_head_dim
        self.linear_q_b = _linear(submodules.linear_q_b, config.v4_q_lora_rank,
                                  self.n_heads * self.head_dim, config, config.init_method)
        self.linear_weights = _linear(submodules.linear_weights, config.hidden_size,
                                      self.n_heads, config, config.init_method)
        self.compressor = V4Compressor(config, submodules.compressor, dim=self.head_dim,
                                       ratio=ratio, overlap=True)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, inv_freq: torch.Tensor, cp_group: Any = None,
                packed: PackedLayout | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [B, T, H_I, D_I], k [B, N, D_I], weights [B, T, H_I]) for HyTopK.

        cos / sin [T, R/2] are at the rows' (global) positions; with a CP group the keys are
        the whole sequence's entries (N = cp * T // ratio), the queries this rank's rows.
        Packed THD: cos / sin at the rows' positions in their documents, the keys pooled per
        document (`V4Compressor.forward`).
        """
        B, T = x.shape[:2]
        q, _ = self.linear_q_b(q_latent)
        q = apply_interleaved_rope(q.view(B, T, self.n_heads, self.head_dim), cos, sin,
                                   heads=True)
        k = self.compressor(x, inv_freq, cp_group, packed)
        w, _ = self.linear_weights(x)
        return q, k, w * (self.n_heads ** -0.5 * self.head_dim ** -0.5)


@dataclass
class V4AttentionSubmodules:
    linear_q_a: ModuleSpec | type = LocalLinear
    q_a_norm: ModuleSpec | type = WrappedTorchNorm
    linear_q_b: ModuleSpec | type = LocalLinear
    linear_kv: ModuleSpec | type = LocalLinear
    kv_norm: ModuleSpec | type = WrappedTorchNorm
    linear_o_a: ModuleSpec | type = GroupedLinear
    linear_o_b: ModuleSpec | type = LocalLinear
    compressor: V4CompressorSubmodules = dataclasses.field(default_factory=V4CompressorSubmodules)
    indexer: V4IndexerSubmodules = dataclasses.field(default_factory=V4IndexerSubmodules)


def v4_inv_freq(config: DeepseekV4TransformerConfig, *, compressed: bool) -> torch.Tensor:
    """fp32 [v4_rope_head_dim / 2] inverse frequencies of a window-only or a CSA / HCA layer."""
    if not compressed:
        return default_inv_freq(config.v4_rope_head_dim, config.v4_rope_theta)
    scaling = config.v4_compress_rope_scaling
    if scaling is None:
        return default_inv_freq(config.v4_rope_head_dim, config.v4_compress_rope_theta)
    scaling = dict(scaling)
    kind = scaling.pop("type", scaling.pop("rope_type", "yarn"))
    if kind != "yarn":
        raise ValueError(f"v4_compress_rope_scaling: only YaRN is supported, got {kind!r}")
    # V4 fixes YaRN's attention factor to 1 (cos / sin unscaled): mscale keys only feed it.
    if scaling.pop("attention_factor", None) not in (None, 1.0):
        raise ValueError("v4_compress_rope_scaling: V4 uses attention_factor = 1")
    for ignored in ("mscale", "mscale_all_dim"):
        scaling.pop(ignored, None)
    try:
        return yarn_inv_freq(config.v4_rope_head_dim, config.v4_compress_rope_theta, **scaling)
    except TypeError as err:
        raise ValueError(f"v4_compress_rope_scaling: {err}") from err


def _rows(T: int, positions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The rows' positions: `positions` ([T], global positions under CP) or 0..T-1."""
    if positions is None:
        return torch.arange(T, device=device)
    if positions.shape != (T,):
        raise ValueError(f"positions {tuple(positions.shape)} do not match {T} rows")
    return positions.to(device)


def window_indices(T: int, window: int, offset: int, device: torch.device,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [T, window]: keys p - window + 1 .. p (+ offset into the key tensor), -1 below 0.

    p is row t's position: t, or positions[t] ([T] int, the global positions of this rank's
    rows under context parallelism, where the raw keys are the whole gathered sequence).
    """
    rows = _rows(T, positions, device)
    keys = rows.unsqueeze(1) + torch.arange(1 - window, 1, device=device)
    return torch.where(keys >= 0, keys + offset, -1).to(torch.int32)


def baseline_select(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int,
                    row_block: int, *, q_positions: torch.Tensor, k_positions: torch.Tensor
                    ) -> torch.Tensor:
    """Stock-style selection: fp32 score table per block of query rows, then torch.topk.

    q [B, T, H, D], k [B, N, D], weights [B, T, H]; entry s is visible to row t iff
    k_positions[s] <= q_positions[t] (ascending [N]; [T] the rows' positions, global ones
    under context parallelism). Returns int32 [B, T, topk] with -1 where the pick is not
    visible (the rows with fewer than topk visible entries), as transformers' V4 indexer does.
    Ties are broken however torch.topk does.
    """
    B, T = q.shape[:2]
    N = k.shape[1]
    entries = torch.arange(N, device=q.device)
    # Visible entries are a prefix (positions ascend): V4's floor((t + 1) / m) of them.
    visible = torch.searchsorted(k_positions.contiguous(), q_positions.contiguous(), right=True)
    blocks = []
    for r0 in range(0, T, row_block):
        r1 = min(T, r0 + row_block)
        logits = torch.einsum("bthd,bsd->bths", q[:, r0:r1].float(), k.float()).relu()
        scores = (logits * weights[:, r0:r1, :, None].float()).sum(2)  # [B, R, N]
        limit = visible[r0:r1].view(1, -1, 1)
        scores = scores.masked_fill(entries.view(1, 1, -1) >= limit, float("-inf"))
        picked = scores.topk(topk, dim=-1).indices
        blocks.append(torch.where(picked >= limit, -1, picked))
    return torch.cat(blocks, dim=1).to(torch.int32)


class EntrySelector(Protocol):
    """A CSA layer's selection strategy.

    Called with the indexer's q [B, T, H, D], keys [B, N, D], weights [B, T, H] and topk
    (entry s visible to row t iff k_positions[s] <= q_positions[t]); returns int32
    [B, T, topk] entry indices, -1 padded. `replays`: whether the recompute replays its first
    forward's selection (`replay.SelectionReplay`) instead of selecting again. `keys_ascending`:
    whether each row's entries come in increasing order (the attention's lockstep kernels
    then skip their sort, `ops.sparse_attention`).
    """

    replays: bool
    keys_ascending: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                 q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class HyTopKEntrySelector:
    """HyScale's CSA selection: `ops.hytopk` (exact total order, no score table); replayed."""

    replays: ClassVar[bool] = True
    keys_ascending: ClassVar[bool] = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                 q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        # k_positions (s+1)*m - 1 <= t  <=>  s < floor((t+1)/m): V4's rule.
        return hytopk(q, k, weights, topk, relu=True, q_positions=q_positions,
                      k_positions=k_positions, order="key")[0]


@dataclass(frozen=True)
class ScoreTableEntrySelector:
    """The side-by-side baseline: `baseline_select` (a score table per `row_block` query rows
    and torch.topk); like a stock layer, the recompute selects again."""

    row_block: int = 4096
    replays: ClassVar[bool] = False
    keys_ascending: ClassVar[bool] = False  # torch.topk's score order

    def __call__(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                 q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        return baseline_select(q, k, weights, topk, self.row_block, q_positions=q_positions,
                               k_positions=k_positions)


def csa_selector(config: DeepseekV4TransformerConfig, *, baseline: bool) -> EntrySelector:
    """HyScale's CSA selector, or with `baseline` the score-table one (config's row block)."""
    if baseline:
        return ScoreTableEntrySelector(config.v4_baseline_row_block)
    return HyTopKEntrySelector()


@dataclass
class _CSASelection:
    """A CSA layer's selection and its indexer-loss inputs ([B, T, ...] tensors, T local)."""

    indices: torch.Tensor  # int32 [B, T, k] compressed entries
    use_loss: bool
    coeff: float
    q_idx: torch.Tensor | None
    k_idx: torch.Tensor | None
    weights: torch.Tensor | None
    entries: torch.Tensor  # [B, N, D] the compressed keys
    q_positions: torch.Tensor  # int64 [T]
    k_positions: torch.Tensor  # int64 [N]
    packed: _PackedRows | None = None  # packed THD: the documents (dense loss per document)
    # How the indexer loss weighs the rows (real_token_mask_q's valid rows; None: no loss).
    loss_rows: IndexerLossRows | None = None


@dataclass(frozen=True)
class _PackedRows:
    """A packed THD forward's documents, as a V4 layer's rows and compressed entries see them."""

    layout: PackedLayout
    rows: DocumentRows  # the local rows' document starts and positions in their documents
    entries: Documents  # each document's compressed entries (none for window layers)


@dataclass
class _RowInputs:
    """What the per-row work of `HyScaleV4Attention` reads (all local rows)."""

    q_latent: torch.Tensor  # [B, T, q_lora]
    cos: torch.Tensor  # [T, R/2]
    sin: torch.Tensor
    keys: torch.Tensor  # [B, S_keys, D]: [compressed entries ; raw tokens]
    indices: torch.Tensor  # int32 [B, T, slots] into keys
    prefix: torch.Tensor | None  # int32 [B, T] HCA's visible entries
    selection: _CSASelection | None


class HyScaleV4Attention(MegatronModule):
    """DeepSeek-V4 self-attention (window / CSA / HCA by compress ratio) on HyScale's ops.

    Input and output are megatron's [s, b, hidden]; forward returns (output, None) like
    megatron's attention modules. Positions are 0..s-1, or under context parallelism the global
    positions of this rank's zigzag rows; packed THD sequences restart them per document (module
    docstring). The CP group is `pg_collection.cp`
    (TransformerLayer passes it), else megatron's global CP group when the config asks for
    context_parallel_size > 1 (a layer built on its own, as in the benchmarks).
    """

    def __init__(self, config: DeepseekV4TransformerConfig,
                 submodules: V4AttentionSubmodules | None = None, layer_number: int = 1,
                 *, compress_ratio: int | None = None, selector: EntrySelector | None = None,
                 pg_collection: Any = None, cp_comm_type: str | None = None,
                 **unused: Any) -> None:
        super().__init__(config)
        submodules = submodules or V4AttentionSubmodules()
        if config.tensor_model_parallel_size != 1:
            # Megatron-LM's own DeepSeek-V4 attention (DSv4HybridAttention, dev branch)
            # asserts TP size 1 as well: a layout stock does not run either.
            raise NotImplementedError(
                f"HyScaleV4Attention supports tensor_model_parallel_size=1 only (got "
                f"{config.tensor_model_parallel_size}), as Megatron-LM's DeepSeek-V4 attention; "
                "scale V4 layers with context, pipeline and expert parallelism")
        # Any cp_comm_type runs the all-gather design (module docstring): the compressors and
        # the window need neighbours' tokens, which ring (p2p) attention does not provide.
        self.pg_collection = pg_collection
        self.cp_comm_type = cp_comm_type
        if compress_ratio is None:
            ratios = config.v4_compress_ratios
            compress_ratio = config.v4_csa_ratio if ratios is None else ratios[layer_number - 1]
        if not isinstance(compress_ratio, int) or compress_ratio < 0:
            raise ValueError(f"compress_ratio must be an int >= 0, got {compress_ratio!r}")
        self.layer_number = layer_number
        self.compress_ratio = compress_ratio
        self.is_csa = compress_ratio == config.v4_csa_ratio
        # CSA's selection strategy (fixed at construction: the replay store follows it).
        self.selector = (selector if selector is not None
                         else csa_selector(config, baseline=config.v4_baseline))
        H, D = config.num_attention_heads, config.v4_head_dim
        G = config.v4_o_groups
        if (H * D) % G:
            raise ValueError(f"heads x head_dim = {H * D} is not divisible by o_groups {G}")
        self.n_heads, self.head_dim = H, D
        self.softmax_scale = D ** -0.5
        # CSA / HCA layers rotate with the compress theta (attention and compressors alike);
        # window-only layers with the main theta, as in transformers' V4. A plain fp32
        # attribute, not a buffer: a bf16 cast of the model must not round the frequencies.
        self.inv_freq = v4_inv_freq(config, compressed=compress_ratio > 0)

        init, out_init = config.init_method, config.output_layer_init_method
        hidden, q_rank = config.hidden_size, config.v4_q_lora_rank
        self.linear_q_a = _linear(submodules.linear_q_a, hidden, q_rank, config, init)
        self.q_a_norm = _norm(submodules.q_a_norm, q_rank, config)
        self.linear_q_b = _linear(submodules.linear_q_b, q_rank, H * D, config, init)
        self.linear_kv = _linear(submodules.linear_kv, hidden, D, config, init)
        self.kv_norm = _norm(submodules.kv_norm, D, config)
        self.linear_o_a = build_module(submodules.linear_o_a, H * D // G,
                                       G * config.v4_o_lora_rank, G, config=config,
                                       init_method=init)
        self.linear_o_b = _linear(submodules.linear_o_b, G * config.v4_o_lora_rank, hidden,
                                  config, out_init)
        self.sinks = torch.nn.Parameter(torch.zeros(H, dtype=config.params_dtype))
        self.compressor = self.indexer = None
        if compress_ratio:
            self.compressor = V4Compressor(config, submodules.compressor, dim=D,
                                           ratio=compress_ratio, overlap=self.is_csa)
        if self.is_csa:
            self.indexer = V4Indexer(config, submodules.indexer, ratio=compress_ratio)
            self.selection_replay = replay.SelectionReplay(f"V4 CSA layer {layer_number}",
                                                           replays=self.selector.replays)

    @property
    def baseline(self) -> bool:
        """Whether the selector is a side-by-side baseline (it selects again in the recompute)."""
        return not self.selector.replays

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                key_value_states: torch.Tensor | None = None, inference_context: Any = None,
                packed_seq_params: Any = None, **unused: Any) -> tuple[torch.Tensor, None]:
        """hidden_states [s, b, hidden] -> ([s, b, hidden], None); causal, mask ignored.

        Under context parallelism s is this rank's share (its two zigzag chunks) of a sequence
        of S = cp * s tokens, and so is the output.

        Communication under CP (all-gather forward, reduce-scatter of the same tensors'
        gradients in the backward; each rank receives (cp-1)/cp of every gathered tensor).
        Per layer and sequence, V4-Flash (D = 512, D_I = 128, m = 4 / 128, W = 128), bf16,
        S = 1M tokens, CP 8, what every rank receives:
          window halos: the last W - 1 tokens of each chunk  2 cp (W - 1) x D  = 2 MiB
          CSA compressor entries (+ its last window a chunk) S / 4 x D      = 256 MiB
          HCA compressor entries                             S / 128 x D    = 8 MiB
          CSA indexer compressor entries                     S / 4 x D_I    = 64 MiB (forward
              only unless the indexer loss is on; skipped by a replayed recompute)
        That is when W - 1 <= S / (2 cp) and each chunk holds whole compression windows (any
        power-of-two S and CP of these runs). Otherwise the fallbacks gather the raw K = V of
        the whole sequence (S x D = 1 GiB) and the compressors' kv | gate projections (S x 4D
        = 4 GiB for CSA, S x 4 D_I = 1 GiB for its indexer, S x 2D = 2 GiB for HCA); the
        results are the same. Full recompute repeats the forward gathers (minus the replayed
        indexer's). The compressed entries of the whole sequence stay on every rank (the
        indexer selects among all of them).
        """
        if key_value_states is not None or inference_context is not None:
            raise NotImplementedError("HyScaleV4Attention: self-attention training only")
        cfg = self.config
        T, B, _ = hidden_states.shape
        device = hidden_states.device
        x = hidden_states.transpose(0, 1)  # [B, T, hidden]
        # positions: the local rows' global positions (0..T-1 without CP): RoPE, the window
        # and the compressed entries' visibility all use them.
        layout = cp_row_layout(self.pg_collection, T, device, layer="HyScaleV4Attention",
                               config=cfg)
        cp_group, positions = layout.group, layout.positions
        packed = self._packed(packed_seq_params, T, device, cp_group)
        if packed is not None:  # each document as its own sequence: positions within it
            positions = packed.rows.offsets
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        inv_freq = self.inv_freq
        cos, sin = rope_cos_sin(positions, inv_freq)  # [T, R/2]

        q_latent = self.q_a_norm(self.linear_q_a(x)[0])  # [B, T, q_lora]
        kv = apply_interleaved_rope(self.kv_norm(self.linear_kv(x)[0]), cos, sin)  # [B, T, D]
        # The raw keys the window reads (under CP, other chunks' tokens too, each rotated at
        # its own global position) and each row's window into them.
        kv, window = self._window_keys(kv, positions, cp_group, packed)

        prefix = selection = None
        if self.compressor is None:
            keys, num_entries, parts = kv, 0, []
        else:
            entries = self.compressor(x, inv_freq, cp_group,  # [B, N, D] (whole sequence)
                                      None if packed is None else packed.layout)
            num_entries = entries.shape[1]
            keys = torch.cat([entries, kv], dim=1)  # [compressed ; raw tokens]
            if self.is_csa:
                selection = self._csa_select(x, q_latent, entries, cos, sin, inv_freq,
                                             positions, cp_group, packed, packed_seq_params)
                parts = [selection.indices]
            elif packed is not None:  # every visible entry of the row's own document
                parts = [self._hca_indices(packed).expand(B, -1, -1)]
            else:  # every visible entry: a dense prefix of the keys, generated in-kernel
                parts = []
                prefix = compressed_visible_count(_rows(T, positions, device),
                                                  self.compress_ratio).clamp(max=num_entries)
                prefix = prefix.to(torch.int32).expand(B, -1)
        window = torch.where(window >= 0, window + num_entries, -1)  # past the entries
        indices = torch.cat(parts + [window.expand(B, -1, -1)], dim=-1)

        chunk = check_row_chunk(cfg.v4_row_chunk, "v4_row_chunk")
        rows = _RowInputs(q_latent, cos, sin, keys, indices, prefix, selection)
        if chunk is not None and T > chunk and (conflict := row_chunk_conflict(cfg)):
            raise NotImplementedError(f"HyScaleV4Attention(v4_row_chunk={chunk}): {conflict} "
                                      "is not supported with row chunks")
        # What every part reads whole: the keys, the sinks and the indexer keys (their
        # gradients are summed over the parts in fp32, `run_in_row_parts`).
        shared = (keys, self.sinks, None if selection is None else selection.k_idx)
        if chunk is None or T <= chunk:
            out, loss = self._rows_forward(rows, 0, T, *shared)
        else:
            # Parts of `chunk` rows, each checkpointed: one part's queries, attention output
            # and their gradients at a time. The selection above ran once; the parts' own
            # recompute in backward only repeats the per-row work.
            out, loss = run_in_row_parts(partial(self._rows_forward, rows), T, chunk, dim=1,
                                         shared=shared)
        if selection is not None and selection.use_loss:
            # Logged here, outside the parts: their recompute in backward must not log again.
            log_indexer_loss(loss, cfg, self.layer_number, cp_group)
        return out.transpose(0, 1).contiguous(), None  # [s, b, hidden]

    def _rows_forward(self, rows: _RowInputs, r0: int, r1: int, keys: torch.Tensor,
                      sinks: torch.Tensor, k_idx: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output [B, r1 - r0, hidden] of the local rows r0 .. r1 - 1 (the indexer loss of
        those rows attached for backward) and that loss, detached (0 without one). keys,
        sinks and k_idx stand in for rows.keys, self.sinks and the selection's indexer keys
        (a part's copies, `run_in_row_parts`)."""
        cfg = self.config
        H, D = self.n_heads, self.head_dim
        whole = r0 == 0 and r1 == rows.indices.shape[1]
        part = (lambda t: t) if whole else (lambda t: t[:, r0:r1])
        cos, sin = (rows.cos, rows.sin) if whole else (rows.cos[r0:r1], rows.sin[r0:r1])
        q_latent = part(rows.q_latent)
        B, n = q_latent.shape[:2]
        q = self.linear_q_b(q_latent)[0].view(B, n, H, D)
        q = rms_norm_rope(q, None, cfg.layernorm_epsilon, cos, sin, heads=True)
        out = sparse_attention(q, keys.unsqueeze(2), None, part(rows.indices),
                               self.softmax_scale, sink=sinks,
                               prefix_lengths=None if rows.prefix is None else part(rows.prefix),
                               deterministic=bool(cfg.deterministic_mode),  # [B, n, H, D]
                               options=getattr(cfg, "attention_kernel_options", None),
                               # the selection and the window index disjoint key ranges
                               backend=kernel_backend(cfg), check_values=False,
                               # entries (ascending) before the window's raw keys (ascending)
                               keys_ascending=not self.is_csa
                               or getattr(self.selector, "keys_ascending", False))
        # K = V carries RoPE: undo it at the query position so the output depends on
        # relative positions only (V4's conjugate rotation), then the grouped projection.
        out = apply_interleaved_rope(out, cos, sin, heads=True, inverse=True)
        out = self.linear_o_a(out.reshape(B, n, cfg.v4_o_groups, H * D // cfg.v4_o_groups))
        out = self.linear_o_b(out)[0]  # [B, n, hidden]
        sel = rows.selection
        if sel is None or not sel.use_loss:
            return out, out.new_zeros((), dtype=torch.float32)
        # With a row mask each part adds its valid rows' KL sum, divided by the layer's
        # valid-row count (`finish`): the parts add up to the mean over the valid rows.
        weigh = sel.loss_rows
        if sel.packed is not None and not cfg.v4_indexer_use_sparse_loss:
            loss = self._dense_loss_per_document(sel, q, r0, r1, k_idx)
        else:
            loss = indexer_kl_loss(
                part(sel.q_idx), part(sel.weights), k_idx, q.detach(),
                sel.entries.detach().unsqueeze(2), part(sel.indices), self.softmax_scale,
                sel.coeff * weigh.share(n), sparse=bool(cfg.v4_indexer_use_sparse_loss),
                relu=True, q_positions=sel.q_positions[r0:r1], k_positions=sel.k_positions,
                calculate_per_token_loss=weigh.sums,
                deterministic=bool(cfg.deterministic_mode), query_valid_rows=weigh.part(r0, r1),
            )
        loss = weigh.finish(loss)
        return DSAIndexerLossAutoScaler.apply(out, loss), loss.detach()

    def _dense_loss_per_document(self, sel: _CSASelection, q: torch.Tensor, r0: int, r1: int,
                                 k_idx: torch.Tensor) -> torch.Tensor:
        """The dense indexer loss of the local rows r0 .. r1 - 1 (q holds them) of packed
        documents: each document's rows over its own entries, with their share of the rows'
        mean (their KL sum when per-token or with a row mask, whose mean the caller takes:
        `IndexerLossRows`), so the documents' losses add up to the rows' loss. A document
        with no compressed entry has none (as the layer on that document alone)."""
        cfg = self.config
        weigh = sel.loss_rows
        m, packed = self.compress_ratio, sel.packed
        total = q.new_zeros((), dtype=torch.float32)
        for (a, b), (e0, e1) in zip(packed.layout.local, packed.entries, strict=True):
            a, b = max(a, r0), min(b, r1)
            if b <= a or e1 == e0:
                continue
            rows = slice(a, b)
            total = total + indexer_kl_loss(
                sel.q_idx[:, rows], sel.weights[:, rows], k_idx[:, e0:e1],
                q[:, a - r0:b - r0].detach(), sel.entries[:, e0:e1].detach().unsqueeze(2), None,
                self.softmax_scale, sel.coeff * weigh.share(b - a),
                sparse=False, relu=True, q_positions=packed.rows.offsets[rows],
                k_positions=compressed_key_positions(e1 - e0, m, q.device),
                calculate_per_token_loss=weigh.sums, deterministic=bool(cfg.deterministic_mode),
                query_valid_rows=weigh.part(a, b),
            )
        return total

    def _packed(self, packed_seq_params: Any, T: int, device: torch.device, cp_group: Any
                ) -> _PackedRows | None:
        """The packed THD documents of the T local rows (None: one sequence per batch row)."""
        if packed_seq_params is None:
            return None
        fmt = getattr(packed_seq_params, "qkv_format", None)
        if fmt != "thd":
            raise NotImplementedError(f"HyScaleV4Attention: packed_seq_params with qkv_format="
                                      f"{fmt!r} is not supported (only 'thd')")
        layout = checked_packed_layout(packed_seq_params, T, device,
                                       layer="HyScaleV4Attention", group=cp_group)
        m = self.compress_ratio
        entries = pooled_ranges(layout.documents, m) if m else ()
        return _PackedRows(layout, document_rows(layout, device), entries)

    def _hca_indices(self, packed: _PackedRows) -> torch.Tensor:
        """int32 [T, n]: each row's visible compressed entries of its own document (n the
        most entries a document has), -1 padded: HCA's dense prefix, per document."""
        m, device = self.compress_ratio, packed.rows.offsets.device
        width = max((e - s for s, e in packed.entries), default=0)
        counts = [e - s for s, e in packed.entries]
        first = per_row((s for s, _ in packed.entries), packed.layout.local, device)
        visible = torch.minimum(compressed_visible_count(packed.rows.offsets, m),
                                per_row(counts, packed.layout.local, device))
        slots = torch.arange(width, device=device)
        index = torch.where(slots < visible[:, None], first[:, None] + slots, -1)
        return index.to(torch.int32)

    def _window_keys(self, kv: torch.Tensor, positions: torch.Tensor, cp_group: Any,
                     packed: _PackedRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw keys [B, R, D], int32 [T, window] indices into them, -1 before position 0).

        Packed THD: positions are the rows' positions in their documents, so the window stops
        at the document's first row; the raw keys are the whole packed sequence (under CP
        all-gathered into its global order, `window_cp_mode` "gather") and the indices its rows.

        Without CP the raw keys are kv itself. Under CP, when the window's W - 1 earlier tokens
        fit in one zigzag chunk (W - 1 <= T / 2), each chunk gets a halo: the last W - 1
        tokens of every chunk are all-gathered (2 (W - 1) tokens a rank) and the raw keys are
        [halo, chunk r, halo, chunk 2 cp - 1 - r]; otherwise the whole sequence is
        all-gathered ([B, S, D]). `window_cp_mode` records which ran ("halo" / "gather").
        """
        T = kv.shape[1]
        W = self.config.v4_sliding_window
        self.window_cp_mode = None
        if packed is not None:
            if cp_group is not None:
                self.window_cp_mode = "gather"
                kv = _gather_tokens(kv, cp_group, packed.layout.key_order)
            index = window_indices(T, W, 0, kv.device, positions)  # within the document
            starts = packed.rows.starts.to(index.dtype)[:, None]
            return kv, torch.where(index >= 0, index + starts, -1)
        if cp_group is None:
            return kv, window_indices(T, W, 0, kv.device, positions)
        chunk, halo = T // 2, W - 1
        if halo == 0:  # each row reads only itself
            self.window_cp_mode = "halo"
            return kv, torch.arange(T, device=kv.device, dtype=torch.int32)[:, None]
        if halo > chunk:
            self.window_cp_mode = "gather"
            return _gather_tokens(kv, cp_group), window_indices(T, W, 0, kv.device, positions)
        self.window_cp_mode = "halo"
        cp, rank = cp_group.size(), cp_group.rank()
        tails = _gather_tokens(torch.cat([kv[:, chunk - halo:chunk], kv[:, T - halo:]], dim=1),
                               cp_group)  # the last W - 1 tokens of every chunk, global order
        parts = []
        for half, c in enumerate((rank, 2 * cp - 1 - rank)):
            prev = tails[:, (c - 1) * halo:c * halo] if c > 0 else kv.new_zeros(
                kv.shape[0], halo, kv.shape[2])  # before position 0: never read
            parts += [prev, kv[:, half * chunk:(half + 1) * chunk]]
        # Row i of half h reads raw rows h (W - 1 + chunk) + i + j, j = 0 .. W - 1: positions
        # p - W + 1 .. p, the window's order (ascending), as window_indices lists them.
        rows = torch.arange(T, device=kv.device)
        base = (rows // chunk) * (halo + chunk) + rows % chunk
        offs = torch.arange(W, device=kv.device)
        index = base[:, None] + offs[None, :]
        seen = (positions[:, None] - halo + offs[None, :]) >= 0
        return torch.cat(parts, dim=1), torch.where(seen, index, -1).to(torch.int32)

    def _csa_select(self, x: torch.Tensor, q_latent: torch.Tensor, entries: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor,
                    q_positions: torch.Tensor | None = None, cp_group: Any = None,
                    packed: _PackedRows | None = None, packed_seq_params: Any = None
                    ) -> _CSASelection:
        """The rows' selection: int32 [B, T, k] compressed-entry indices, -1 padded (recorded
        or replayed under recompute), and what the indexer loss of any of the rows needs.

        x [B, T, hidden], q_latent [B, T, q_lora] are this rank's rows at positions
        q_positions [T] (None: 0..T-1); entries [B, N, D] cover the whole sequence.
        Packed THD: q_positions are the rows' positions in their documents and each document's
        rows select among its own entries (`packed.entries`), k = min(topk, most entries of a
        document); the selection's positions for the indexer loss are then the packed rows
        and each entry's last row in the packed sequence (visibility within a document, and
        the selected entries are all the row's own). `packed_seq_params.real_token_mask_q`
        (where given; this rank's rows) leaves padded rows out of the indexer loss only.
        """
        cfg = self.config
        B, T = x.shape[:2]
        N = entries.shape[1]
        m = self.compress_ratio
        q_positions = _rows(T, q_positions, x.device)
        if packed is None:
            topk = min(cfg.v4_index_topk, N)
            select_positions = q_positions
            k_positions = compressed_key_positions(N, m, x.device)
        else:
            topk = min(cfg.v4_index_topk, max((e - s for s, e in packed.entries), default=0))
            select_positions = q_positions
            q_positions = packed.rows.starts + packed.rows.offsets
            k_positions = torch.cat(
                [a + compressed_key_positions(e - s, m, x.device)
                 for (a, _), (s, e) in zip(packed.layout.documents, packed.entries, strict=True)]
                or [torch.zeros(0, dtype=torch.int64, device=x.device)])
        if topk == 0:  # T < ratio: nothing compressed yet
            return _CSASelection(torch.empty(B, T, 0, dtype=torch.int32, device=x.device),
                                 False, 0.0, None, None, None, entries, q_positions,
                                 k_positions, packed)
        coeff = cfg.v4_indexer_loss_coeff or 0.0
        use_loss = self.training and torch.is_grad_enabled() and coeff > 0
        q_idx = k_idx = weights = None
        if use_loss or not self.selection_replay.replaying():
            # The indexer learns from its own loss only (DSA recipe): detached inputs.
            with torch.enable_grad() if use_loss else torch.no_grad():
                q_idx, k_idx, weights = self.indexer(x.detach(), q_latent.detach(), cos, sin,
                                                     inv_freq, cp_group,
                                                     None if packed is None else packed.layout)

        def select(rows: slice, keys: slice, k: int, positions: torch.Tensor) -> torch.Tensor:
            n = k_idx[:, keys].shape[1]
            return self.selector(q_idx[:, rows].detach(), k_idx[:, keys].detach(),
                                 weights[:, rows].detach(), k, q_positions=positions,
                                 k_positions=compressed_key_positions(n, m, x.device))

        def compute() -> torch.Tensor:
            with torch.no_grad():
                if packed is None:
                    return select(slice(None), slice(None), topk, select_positions)
                # Each document's rows over its own entries; its picks become packed entries.
                indices = torch.full((B, T, topk), -1, dtype=torch.int32, device=x.device)
                for (r0, r1), (e0, e1) in zip(packed.layout.local, packed.entries, strict=True):
                    k = min(topk, e1 - e0)
                    if k == 0 or r1 == r0:
                        continue
                    got = select(slice(r0, r1), slice(e0, e1), k, select_positions[r0:r1])
                    indices[:, r0:r1, :k] = torch.where(got >= 0, got + e0, got)
                return indices

        indices = self.selection_replay.select((B, T, topk), compute)
        # Padded query rows (local rows, as stock reads them): out of the loss, not the
        # selection or the attention.
        loss_rows = None if not use_loss else indexer_loss_rows(
            packed_seq_params, b=B, rows=T, per_token=bool(cfg.calculate_per_token_loss),
            device=x.device, layer="HyScaleV4Attention")
        return _CSASelection(indices, use_loss, coeff, q_idx, k_idx, weights, entries,
                             q_positions, k_positions, packed, loss_rows)

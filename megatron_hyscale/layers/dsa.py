"""HyScaleDSAttention: drop-in for megatron-core's DSAttention.

Same constructor, forward signature, class flags and parameters as the stock class (it is a
subclass), so a stock checkpoint loads with strict=True and the spec swap is one line. The
forward replaces the stock score table + torch.topk, the unfused sparse attention and the
table-based indexer loss with HyScale's ops:
- selection: `ops.hytopk` (exact total order; Triton on CUDA, chunked reference on CPU; fp8
  when `config.hyscale_indexer_precision == "fp8"`, `layers/kernel_backend.py`, while the
  indexer loss keeps the bf16 tensors);
- attention: `ops.sparse_attention` over the selected keys (absorbed MLA: V = the first
  kv_lora_rank channels of the one latent KV head; with an explicit value, per-head K and V,
  stock's `unfused_dsa_fn` layout: one or np heads each);
- indexer loss: `ops.indexer_kl_loss` (dense or sparse KL), attached and logged as stock does;
- recompute: the selection is recorded in the first forward and replayed by the recompute
  (`replay.SelectionReplay.select`), also for index-sharing layers (`dsa_indexer_topk_freq` > 1),
  whose stock implementation can read another micro-batch's indices during recompute.
- context parallelism (`cp_comm_type="allgather"`, megatron's zigzag 2 x cp chunk layout):
  the absorbed KV and the indexer keys are all-gathered over the CP group into global order
  (`megatron_hyscale.parallel.start_all_gather_to_global`, whose backward reduce-scatters the
  gradients to their owners); the KV gather is queued behind the indexer keys' and waited on
  after HyTopK, so it transfers while the selection runs. HyTopK, the sparse attention and the
  indexer loss run for the local query rows against the gathered keys, with the local rows'
  global positions. Indices are [local rows, gathered keys], so replay and index sharing are
  unchanged.
- packed THD sequences (`qkv_format="thd"`): each document selects over its own keys (HyTopK
  per document, the indices then global rows of the packed sequence), so the attention and the
  sparse indexer loss need nothing more; the dense loss runs per document. Under CP the
  cu_seqlens cover the whole sequence and each rank holds chunks r and 2cp-1-r of every
  document (megatron's THD split, `parallel.thd_split`): the keys are all-gathered into the
  global packed order (`layers.packed.packed_layout`'s `key_order`), and a document's local
  query rows select over its gathered keys at their positions within the document.
- padded query rows (`packed_seq_params.real_token_mask_q`, this rank's local rows under CP):
  as stock, they still select and attend, but take no part in the indexer loss, whose mean
  is over the valid rows (`indexer_kl_loss(query_valid_rows=...)`; the rows' parts and the
  documents each add their valid rows' KL sum, divided once by the layer's valid-row count:
  `layers.loss_rows`, shared with the V4 CSA and QSA layers).
- an explicit mask (attn_mask_type=None, a bool attention_mask [b, 1, sq, skv], True =
  masked, as stock reads it): it alone says which keys a row sees, as in stock (no causality,
  no packed documents). The selection runs on HyTopK's plain-torch path with the mask
  (`ops.hytopk(visible=...)`: row chunks, the same total order; a mask is O(sq x skv) anyway),
  then the sparse attention over the selected (visible) keys; the dense indexer loss reads the
  mask (`indexer_kl_loss(visible=...)`), the sparse one only the selection. A row with fewer
  visible keys than top-k keeps those (-1 slots after); a fully masked row selects nothing,
  outputs zeros (zero gradients) and adds 0 to the indexer loss while counting in its mean:
  stock's results for it.
- sequence-parallel TP with sequence-local query rows (query has x's rows; stock's
  `sequence_parallel_query_is_local`): key and value are gathered over TP as stock does, the
  rows select at their positions among the gathered ones; the indexer loss raises there, with
  stock's error.
Every layout runs this path; what stock refuses (another attn_mask_type, a CP communication
type other than allgather, the absorbed layout without up_v_weight) raises, naming why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant import dsa_layout
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossAutoScaler,
    DSAttention,
    _normalize_dsattention_output_rank,
)
from megatron.core.utils import get_pg_size

from megatron_hyscale import ops, parallel, phase_spans, replay
from megatron_hyscale.layers.kernel_backend import (
    indexer_lse,
    indexer_precision,
    indexer_target,
    kernel_backend,
    mla_projections,
    packed_selection,
)
from megatron_hyscale.layers.loss_logging import log_indexer_loss
from megatron_hyscale.layers.loss_rows import IndexerLossRows, indexer_loss_rows
from megatron_hyscale.layers.packed import PackedLayout, packed_layout
from megatron_hyscale.layers.packed_selection import batched_document_selection
from megatron_hyscale.ops import hytopk
from megatron_hyscale.ops.absorbed_mla import project_values
from megatron_hyscale.ops.backends.dispatch import attention_uses_library
from megatron_hyscale.ops.checks import triton_interpret, warn_once
from megatron_hyscale.ops.indexer_loss import index_lse_from_scores
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions
from megatron_hyscale.parallel import CPRowLayout, cp_row_layout

# The ops this layer's phases are timed by (`phase_spans`: plain calls unless phase_times
# records); its selection is timed by `replay.SelectionReplay.select`.
sparse_attention = phase_spans.timed(phase_spans.ATTENTION, ops.sparse_attention)
sparse_attention_indexer_loss = phase_spans.timed(phase_spans.ATTENTION,
                                                  ops.sparse_attention_indexer_loss)
indexer_kl_loss = phase_spans.timed(phase_spans.INDEXER_LOSS, ops.indexer_kl_loss)
start_all_gather_to_global = phase_spans.timed_start(phase_spans.COMMUNICATION,
                                                     parallel.start_all_gather_to_global)


@dataclasses.dataclass
class DSARowState:
    """What `HyScaleDSAttention.prepare` hands to `attend_rows` (tensors [b, rows, ...])."""

    key_b: torch.Tensor  # [b, S, 1, d] the (gathered) absorbed keys; [b, S, hkv, d] per head
    indices: torch.Tensor  # int32 [b, rows, topk] into key_b
    q_idx: torch.Tensor | None  # indexer queries [b, rows, H_I, D_I] (None when replayed)
    k_idx: torch.Tensor | None  # indexer keys [b, S, D_I]
    weights: torch.Tensor | None  # indexer head weights [b, rows, H_I]
    q_positions: torch.Tensor  # int64 [rows] global positions (0 .. rows - 1 without CP / SP rows)
    cp_group: Any
    rows: int
    loss_coeff: float  # 0: no indexer loss this forward
    packed: PackedLayout | None = None  # packed THD: the documents' rows; None: one sequence
    # How the indexer loss weighs the rows (real_token_mask_q's valid rows; None: no loss).
    loss_rows: IndexerLossRows | None = None
    value_b: torch.Tensor | None = None  # [b, S, hkv, dv] per-head values; None: absorbed
    # bool [b, rows, S]: the keys each row may see (an explicit attention_mask); None: causal.
    visible: torch.Tensor | None = None
    # fp32 [b, rows]: each row's log-sum-exp of its selected keys' index scores, from the
    # selection (`_keeps_index_lse`); None: the indexer loss's row pass takes it.
    index_lse: torch.Tensor | None = None


class HyScaleDSAttention(DSAttention):
    """DSA core attention with HyTopK selection, sparse-attention ops and selection replay."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where `_keeps_index_lse`, each entry carries the selected scores' log-sum-exp too.
        self.selection_replay = replay.SelectionReplay(f"DSA layer {self.layer_number}")

    def _check_inputs(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
        up_v_weight: torch.Tensor | None,
    ) -> None:
        """ValueError, naming the argument, for layouts megatron-core's DSAttention refuses
        too (it raises or asserts on each)."""
        cfg = self.config
        kv_lora = int(getattr(cfg, "kv_lora_rank", 0) or 0)
        absorbed_dim = kv_lora + int(getattr(cfg, "qk_pos_emb_head_dim", 0) or 0)
        if value is None:
            if not (kv_lora > 0 and key.size(2) == 1
                    and query.size(-1) == key.size(-1) == absorbed_dim):
                raise ValueError(
                    "HyScaleDSAttention: value=None means the absorbed MLA layout (one latent "
                    f"KV head of kv_lora_rank + qk_pos_emb_head_dim = {absorbed_dim} channels), "
                    f"but query is {tuple(query.shape)} and key {tuple(key.shape)}")
            if up_v_weight is None:
                raise ValueError("HyScaleDSAttention: the absorbed layout (value=None) needs "
                                 "up_v_weight [heads, v_head_dim, kv_lora_rank]")
            return
        if up_v_weight is not None:
            raise ValueError("HyScaleDSAttention: up_v_weight is for the absorbed layout "
                             "(value=None); got an explicit value tensor too")
        heads = query.size(2)
        for name, t in (("key", key), ("value", value)):
            if t.size(2) not in (1, heads):
                raise ValueError(f"HyScaleDSAttention: {name} must have 1 or query's {heads} "
                                 f"heads, got {tuple(t.shape)}")
        if value.shape[:2] != key.shape[:2] or key.size(-1) != query.size(-1):
            raise ValueError(f"HyScaleDSAttention: key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must have the same rows and batch, and key "
                             f"query's {query.size(-1)} channels")

    def _uses_indexer_loss(self) -> bool:
        """Whether this forward computes (and attaches) the indexer loss, as stock decides."""
        return (self.training and torch.is_grad_enabled() and not self.skip_topk
                and (self.config.dsa_indexer_loss_coeff or 0.0) > 0)

    def _sequence_parallel(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
        x: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None]:
        """Under sequence-parallel TP, as stock: key and value gathered over the TP group when
        they hold x's local rows (backward: the sum over the ranks, scattered back), and the
        query's rows among the gathered ones, (first, end), when it holds x's local rows only
        (stock's `sequence_parallel_query_is_local`); None when it holds them all (MLA's
        layout) or without SP TP."""
        group = getattr(self.pg_collection, "tp", None)
        tp = get_pg_size(group)
        if not (self.config.sequence_parallel and tp > 1):
            return key, value, None
        local = x.size(0)
        gathered = []
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t is not None and t.size(0) not in (local, local * tp):
                raise ValueError(f"HyScaleDSAttention: under sequence-parallel TP {tp} {name} "
                                 f"must hold x's {local} local rows or all {local * tp}, got "
                                 f"{t.size(0)}")
            gathered.append(gather_from_sequence_parallel_region(t, group=group)
                            if t is not None and t.size(0) == local and name != "query" else t)
        rank = group.rank()
        rows = (rank * local, (rank + 1) * local) if query.size(0) == local else None
        return gathered[1], gathered[2], rows

    def _visible_keys(self, attention_mask: Any, b: int, sq: int, keys: int,
                      device: torch.device) -> torch.Tensor:
        """bool [b, sq, keys], True where a query row may see a key: megatron's explicit
        attention_mask (attn_mask_type=None) [b, 1, sq, keys] negated (True = masked there,
        `dsa_masking.build_dsattention_forward_mask`); keys are the (gathered) key rows."""
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError("HyScaleDSAttention: attn_mask_type=None needs an attention_mask "
                             f"tensor [b, 1, sq, skv], got {type(attention_mask).__name__}")
        if attention_mask.dtype != torch.bool:
            raise ValueError("HyScaleDSAttention: attention_mask must be bool (True = masked, as "
                             f"megatron-core's DSAttention reads it), got {attention_mask.dtype}")
        if tuple(attention_mask.shape) != (b, 1, sq, keys):
            raise ValueError(f"HyScaleDSAttention: attention_mask must be [b, 1, sq, skv] = "
                             f"{(b, 1, sq, keys)} (skv: the key rows after the TP / CP gathers), "
                             f"got {tuple(attention_mask.shape)}")
        if attention_mask.device != device:
            raise ValueError(f"HyScaleDSAttention: attention_mask is on {attention_mask.device}, "
                             f"the keys on {device}")
        return ~attention_mask[:, 0]

    def _cp_layout(self, sq: int, skv: int, device: torch.device) -> CPRowLayout:
        """The CP group and the local query rows' global positions (`parallel.cp_row_layout`);
        under CP only cp_comm_type='allgather' runs, as in megatron-core's DSAttention."""
        rows = cp_row_layout(self.pg_collection, sq, device, layer="HyScaleDSAttention",
                             key_rows=skv, config=self.config)
        if rows.group is not None and self.cp_comm_type != "allgather":
            raise NotImplementedError(
                f"HyScaleDSAttention supports context parallelism with cp_comm_type='allgather' "
                f"only (got {self.cp_comm_type!r}); megatron-core's DSAttention has the same "
                "restriction"
            )
        return rows

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        attention_mask: torch.Tensor,
        x: torch.Tensor,
        qr: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask_type: AttnMaskType = None,
        attention_bias: torch.Tensor = None,
        packed_seq_params: Any = None,
        up_v_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sparse attention, as megatron-core's DSAttention.forward.

        Absorbed MLA (value None): query [sq, b, np, kv_lora+rope], key [skv, b, 1,
        kv_lora+rope], up_v_weight [np, v_head_dim, kv_lora]. Otherwise (per-head K and V):
        key [skv, b, 1 or np, hn], value [skv, b, 1 or np, hnv]. attn_mask_type causal, or
        None with a bool attention_mask [b, 1, sq, skv] (True = masked; skv counts the keys
        after the TP / CP gathers).

        Under context parallelism sq is this rank's share (its two zigzag chunks) of a sequence
        of cp * sq tokens; x, qr and the output hold the same local rows. Under
        sequence-parallel TP, query holds the TP-gathered rows (MLA's layout) or x's local
        rows only; then key and value (local or gathered rows) are gathered over TP, and the
        indexer loss cannot run (RuntimeError, as stock: its head-summed target needs every
        TP rank on the same rows).

        Returns [sq, b, np * v_head_dim] (the V up projection applied, as stock does), or
        [sq, b, np * hnv].
        """
        query, _ = dsa_layout.ensure_sbhd(query, "query")
        key, _ = dsa_layout.ensure_sbhd(key, "key")
        if value is not None:
            value, _ = dsa_layout.ensure_sbhd(value, "value")
        self._check_inputs(query, key, value, up_v_weight)
        key, value, rows = self._sequence_parallel(query, key, value, x)
        if value is not None and key.size(2) != value.size(2):
            # One KV head on one side only (stock takes 1 or np each): the ops want both alike.
            heads = (-1, -1, query.size(2), -1)
            key, value = key.expand(*heads), value.expand(*heads)

        state = self.prepare(key, attention_mask, x, qr, sq=query.size(0), b=query.size(1),
                             packed_seq_params=packed_seq_params, attn_mask_type=attn_mask_type,
                             value=value, query_rows=rows)
        output, indexer_loss = self.attend_rows(query, state, 0, query.size(0), up_v_weight)
        if indexer_loss is not None:
            self.log_indexer_loss(indexer_loss, state)
        return _normalize_dsattention_output_rank(output, x.ndim)

    def prepare(
        self, key: torch.Tensor, attention_mask: torch.Tensor | None, x: torch.Tensor,
        qr: torch.Tensor, *, sq: int, b: int, packed_seq_params: Any = None,
        attn_mask_type: AttnMaskType | None = AttnMaskType.causal,
        value: torch.Tensor | None = None, query_rows: tuple[int, int] | None = None,
    ) -> DSARowState:
        """Everything the rows' attention needs besides their queries: the indexer's tensors,
        the keys (and values) gathered over the CP group, the selection (replayed, shared or
        computed), the rows' positions. key [skv, b, 1, d] (or [skv, b, hkv, d] with value
        [skv, b, hkv, dv]), x [rows, b, h], qr [rows, b, q_lora]: this rank's rows.

        The sq query rows are the key's rows, or with `query_rows` = (first, end) those of
        them (sequence-parallel query rows; no indexer loss then). attn_mask_type None: the
        visibility is the bool `attention_mask` [b, 1, sq, keys] (True = masked) instead of
        causal (and of packed documents, as in stock).
        """
        cfg = self.config
        if attn_mask_type not in (AttnMaskType.causal, None):
            raise ValueError(f"HyScaleDSAttention: attn_mask_type must be AttnMaskType.causal or "
                             f"None (with an explicit attention_mask), got {attn_mask_type}; "
                             "megatron-core's DSAttention takes only these too")
        # The rows of the key side: all of this CP rank's rows (sequence-parallel query rows
        # are a part of them).
        key_rows = key.size(0)
        first, end = (0, sq) if query_rows is None else query_rows
        if end - first != sq or not 0 <= first < end <= key_rows or (
                query_rows is None and sq != key_rows):
            # Self-attention: the query's rows are the key's (or, given query_rows, a part).
            raise ValueError(f"HyScaleDSAttention: the query's {sq} rows must be the key's "
                             f"{key_rows} (or query_rows {query_rows} a part of them)")
        layout = self._cp_layout(key_rows, key_rows, key.device)
        cp_group, q_positions = layout.group, layout.positions
        packed = key_order = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            packed = packed_layout(packed_seq_params, key_rows, key.device,
                                   layer="HyScaleDSAttention", group=cp_group)
            if packed.positions is not None:
                q_positions, key_order = packed.positions, packed.key_order
        visible = None
        if attn_mask_type is None:
            visible = self._visible_keys(attention_mask, b, sq, key_rows * layout.size,
                                         key.device)
            packed = None  # stock masks with the attention_mask alone, not per document
        # The indexer learns only from its KL loss: no gradient into the main model.
        x, qr = x.detach(), qr.detach()
        use_indexer_loss = self._uses_indexer_loss()
        if use_indexer_loss and query_rows is not None:
            # megatron-core's DSAttention raises this too, with the same words.
            raise RuntimeError(
                "DSA indexer loss requires TP ranks to own the same query rows; "
                "sequence-local TP query shards cannot form a global-head target.")
        loss_coeff = cfg.dsa_indexer_loss_coeff or 0.0

        q_idx = weights = k_idx = pending_k_idx = None
        if not self.skip_topk and (use_indexer_loss or not self.selection_replay.replaying()):
            with torch.enable_grad() if use_indexer_loss else torch.no_grad():
                q_idx, k_idx, weights = self.indexer.forward_before_topk(x, qr, packed_seq_params)
                if query_rows is not None:
                    # The indexer gathered the sequence-parallel rows: keep the query's.
                    q_idx, weights = q_idx[first:end], weights[first:end]
                # Indexer keys [rows, b, d] -> [cp * rows, b, d]; their gradient (indexer loss
                # only) also goes back to the owner rank.
                pending_k_idx = start_all_gather_to_global(k_idx, cp_group, key_order)
        # The main KV [rows, b, h, d] -> [cp * rows, b, h, d] in global order (no-op without
        # CP), queued behind the indexer keys on the CP group and waited on only after the
        # selection: HyTopK runs while it transfers. Backward reduce-scatters the key gradient
        # (the sum over the ranks whose queries read it) back to this rank.
        pending_key = start_all_gather_to_global(key, cp_group, key_order)
        pending_value = (None if value is None
                         else start_all_gather_to_global(value, cp_group, key_order))
        if pending_k_idx is not None:
            with torch.enable_grad() if use_indexer_loss else torch.no_grad():
                k_idx = pending_k_idx.wait()
            q_idx, k_idx, weights = q_idx.transpose(0, 1), k_idx.transpose(0, 1), \
                weights.transpose(0, 1)

        q_positions = q_positions[first:end]
        # Without CP or row parts the rows sit at HyTopK's default positions, which its
        # library path then knows on the host instead of reading them back.
        default_rows = cp_group is None and query_rows is None
        indices, index_lse = self._selection(
            q_idx, k_idx, weights, b, sq, packed_seq_params, attention_mask,
            None if default_rows else q_positions, packed, rows=query_rows, visible=visible)
        # Padded query rows (local rows, as stock reads them): out of the loss, not the attention.
        loss_rows = None
        if use_indexer_loss:
            loss_rows = indexer_loss_rows(packed_seq_params, b=b, rows=sq,
                                          per_token=bool(cfg.calculate_per_token_loss),
                                          device=key.device, layer="HyScaleDSAttention")
        return DSARowState(
            key_b=pending_key.wait().transpose(0, 1), indices=indices, q_idx=q_idx,
            k_idx=k_idx, weights=weights, q_positions=q_positions, cp_group=cp_group,
            rows=sq, loss_coeff=loss_coeff if use_indexer_loss else 0.0, packed=packed,
            loss_rows=loss_rows,
            value_b=None if pending_value is None else pending_value.wait().transpose(0, 1),
            visible=visible, index_lse=index_lse,
        )

    def attend_rows(
        self, query: torch.Tensor, state: DSARowState, r0: int, r1: int,
        up_v_weight: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse attention and indexer loss of the local rows r0 .. r1 - 1 (query holds just
        those rows, [r1 - r0, b, np, d]): their [r1 - r0, b, np * v_head_dim] output (the loss
        attached to it for backward, as stock) and the detached loss (None without one), which
        the caller logs once per layer (`log_indexer_loss`). up_v_weight: the absorbed
        layout's V up projection; None with per-head values (`state.value_b`).

        A part of the rows gets the share (r1 - r0) / rows of the rows-mean indexer loss (all
        of it when per-token; with a row mask, its valid rows' KL sum over the layer's valid
        rows), so the parts' losses and gradients add up to the whole's.
        """
        cfg = self.config
        rows, b = query.shape[:2]
        whole = r0 == 0 and r1 == state.rows
        query_b = query.transpose(0, 1)  # [b, rows, np, d] views: the ops take strided inputs
        indices = state.indices if whole else state.indices[:, r0:r1]
        # Under an explicit mask a row may see no key at all: no valid slot, which the library
        # kernels' HyTopK layout (at least one valid slot a row) does not promise.
        hytopk_layout = state.visible is None
        # Indices address the (gathered) key sequence; causality (or the mask) is in them.
        absorbed = state.value_b is None
        if self._target_from_attention_backward(query_b, state, indices):
            return self._attend_rows_loss_in_backward(query_b, state, indices, r0, r1,
                                                      up_v_weight)
        out, lse = sparse_attention(query_b, state.key_b, state.value_b, indices,
                                    self.softmax_scale,
                                    dv=cfg.kv_lora_rank if absorbed else None, return_lse=True,
                                    deterministic=bool(cfg.deterministic_mode),
                                    options=getattr(cfg, "attention_kernel_options", None),
                                    backend=kernel_backend(cfg), check_values=False,
                                    hytopk_layout=hytopk_layout, keys_ascending=True)
        indexer_loss = None
        if state.loss_coeff > 0:
            # With a row mask a part adds its valid rows' KL sum, divided by the layer's
            # valid-row count (`finish`), so the parts add up to the mean over the valid rows.
            weigh = state.loss_rows
            if state.packed is not None and not cfg.dsa_indexer_use_sparse_loss:
                indexer_loss = self._dense_loss_per_document(query_b, state, r0, r1)
            else:
                part = (lambda t: t) if whole else (lambda t: t[:, r0:r1])
                q_positions = state.q_positions if whole else state.q_positions[r0:r1]
                sparse_loss = bool(cfg.dsa_indexer_use_sparse_loss)
                # An explicit mask replaces causality. The sparse loss needs only the selected
                # keys, all visible; the dense one reads the mask (on the plain-torch
                # reference, as the mask is O(rows x keys) anyway).
                masked = state.visible is not None
                visible = part(state.visible) if masked and not sparse_loss else None
                indexer_loss = indexer_kl_loss(
                    part(state.q_idx), part(state.weights), state.k_idx, query_b.detach(),
                    state.key_b.detach(), indices, self.softmax_scale,
                    state.loss_coeff * weigh.share(rows),
                    sparse=sparse_loss,
                    relu=bool(cfg.dsa_indexer_scoring_relu),
                    q_positions=q_positions, causal=not masked, visible=visible,
                    calculate_per_token_loss=weigh.sums,
                    tp_group=getattr(self.pg_collection, "tp", None),
                    deterministic=bool(cfg.deterministic_mode),
                    options=getattr(cfg, "indexer_loss_kernel_options", None),
                    # The selection's indices are distinct and visible, so the attention ran
                    # over exactly the loss's slots: its log-sum-exp is the target's
                    # denominator.
                    attention_lse=lse.detach() if sparse_loss else None,
                    backend="auto" if visible is not None else kernel_backend(cfg),
                    check_values=False, hytopk_layout=hytopk_layout,
                    query_valid_rows=weigh.part(r0, r1),
                )
            indexer_loss = weigh.finish(indexer_loss)

        output = self._output_rows(out, state, up_v_weight)
        if indexer_loss is None:
            return output, None
        return DSAIndexerLossAutoScaler.apply(output, indexer_loss), indexer_loss.detach()

    def _output_rows(self, out: torch.Tensor, state: DSARowState,
                     up_v_weight: torch.Tensor | None) -> torch.Tensor:
        """[rows, b, np * v_head_dim] from the attention's [b, rows, np, dv] output (the V up
        projection applied in the absorbed layout)."""
        b, rows = out.shape[:2]
        if state.value_b is None:
            up_v_weight = up_v_weight.to(device=out.device, dtype=out.dtype)
            if mla_projections(self.config) == "megatron":
                return torch.einsum("bshc,hdc->sbhd", out, up_v_weight).reshape(rows, b, -1)
            return project_values(out, up_v_weight)
        return out.transpose(0, 1).reshape(rows, b, -1)

    def _target_from_attention_backward(self, query_b: torch.Tensor, state: DSARowState,
                                        indices: torch.Tensor) -> bool:
        """Whether the sparse indexer loss takes its target from the attention backward
        (`kernel_backend.indexer_target`): asked for, or under "auto" where the attention runs
        HyScale's Triton kernels anyway (CUDA, and the backend does not pick the library)."""
        cfg = self.config
        if not (state.loss_coeff > 0 and cfg.dsa_indexer_use_sparse_loss
                and state.visible is None):
            return False
        target = indexer_target(cfg)
        if target == "separate":
            return False
        if target == "auto":
            return query_b.is_cuda and not attention_uses_library(
                query_b, state.key_b, state.value_b, indices, backend=kernel_backend(cfg),
                dv=cfg.kv_lora_rank if state.value_b is None else None, sink=None,
                deterministic=bool(cfg.deterministic_mode), prefix_lengths=None)
        if query_b.is_cuda or triton_interpret():
            return True
        warn_once("dsa-indexer-target-device", "HyScaleDSAttention: "
                  "hyscale_indexer_target='attention_backward' needs HyScale's Triton "
                  f"kernels, which do not run on {query_b.device} (CUDA, or TRITON_INTERPRET=1 "
                  "on CPU): the indexer loss computes its target in its own pass")
        return False

    def _attend_rows_loss_in_backward(
        self, query_b: torch.Tensor, state: DSARowState, indices: torch.Tensor, r0: int,
        r1: int, up_v_weight: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        """`attend_rows` with the sparse indexer loss's target from the attention backward
        (`config.hyscale_indexer_target == "attention_backward"`, `ops.
        sparse_attention_indexer_loss`): the loss is attached through its anchor (its gradient
        as stock's loss's) and logged from the backward, once per backward (a row part logs
        its part: the tracker adds them), so None is returned for the forward's logging."""
        cfg = self.config
        rows = r1 - r0
        whole = r0 == 0 and r1 == state.rows
        part = (lambda t: t) if whole else (lambda t: t[:, r0:r1])
        weigh = state.loss_rows

        def log_from_backward(value: torch.Tensor) -> None:
            self.log_indexer_loss(weigh.finish(value), state)

        out, _, anchor = sparse_attention_indexer_loss(
            query_b, state.key_b, state.value_b, indices, self.softmax_scale,
            q_index=part(state.q_idx), weights=part(state.weights), k_index=state.k_idx,
            loss_coeff=state.loss_coeff * weigh.share(rows),
            relu=bool(cfg.dsa_indexer_scoring_relu),
            dv=cfg.kv_lora_rank if state.value_b is None else None,
            calculate_per_token_loss=weigh.sums, query_valid_rows=weigh.part(r0, r1),
            tp_group=getattr(self.pg_collection, "tp", None),
            deterministic=bool(cfg.deterministic_mode),
            options=getattr(cfg, "attention_kernel_options", None),
            loss_options=getattr(cfg, "indexer_loss_kernel_options", None),
            on_loss=log_from_backward, check_values=False, backend=kernel_backend(cfg),
            hytopk_layout=True, keys_ascending=True,  # no explicit mask: HyTopK's causal rows
            index_lse=None if state.index_lse is None else part(state.index_lse))
        output = self._output_rows(out, state, up_v_weight)
        return DSAIndexerLossAutoScaler.apply(output, weigh.finish(anchor)), None

    def _dense_loss_per_document(self, query_b: torch.Tensor, state: DSARowState, r0: int,
                                 r1: int) -> torch.Tensor:
        """The dense (warm-up) indexer loss of the local rows r0 .. r1 - 1 (query_b holds just
        those) of packed documents: each document's rows among them over its own keys, with
        their share of the (local) rows-mean, so the documents' and the parts' losses add up
        to stock's; their KL sums instead with a per-token loss or a row mask, whose mean the
        caller takes (`IndexerLossRows`). Under CP a document's local rows read its gathered
        keys at their positions in it."""
        cfg = self.config
        packed = state.packed
        total = None
        for (start, end), (a, b) in zip(packed.documents, packed.local, strict=True):
            lo, hi = max(a, r0), min(b, r1)
            if lo >= hi:
                continue
            rows, keys = slice(lo, hi), slice(start, end)
            if packed.offsets is not None:
                positions = packed.offsets[rows]
            elif (lo, hi) != (a, b):  # part of a document: its rows' positions in it
                positions = torch.arange(lo - a, hi - a, device=query_b.device)
            else:
                positions = None  # the whole document: HyTopK's default positions
            loss = indexer_kl_loss(
                state.q_idx[:, rows], state.weights[:, rows], state.k_idx[:, keys],
                query_b[:, lo - r0:hi - r0].detach(), state.key_b[:, keys].detach(), None,
                self.softmax_scale,
                state.loss_coeff * state.loss_rows.share(hi - lo),
                sparse=False, relu=bool(cfg.dsa_indexer_scoring_relu),
                q_positions=positions, calculate_per_token_loss=state.loss_rows.sums,
                tp_group=getattr(self.pg_collection, "tp", None),
                deterministic=bool(cfg.deterministic_mode), backend=kernel_backend(cfg),
                options=getattr(cfg, "indexer_loss_kernel_options", None),
                check_values=False,
                query_valid_rows=state.loss_rows.part(lo, hi),
            )
            total = loss if total is None else total + loss
        return total

    def log_indexer_loss(self, loss: torch.Tensor, state: DSARowState) -> None:
        """Log the layer's indexer loss (the sum of its parts') as stock does."""
        log_indexer_loss(loss, self.config, self.layer_number, state.cp_group)

    def _selection(
        self, q_idx: torch.Tensor | None, k_idx: torch.Tensor | None,
        weights: torch.Tensor | None, b: int, sq: int, packed_seq_params: Any,
        attention_mask: torch.Tensor | None, q_positions: torch.Tensor | None,
        packed: PackedLayout | None = None, *, rows: tuple[int, int] | None = None,
        visible: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """int32 [b, sq, topk] indices into the (gathered) keys: replayed, shared or computed;
        and, where `_keeps_index_lse`, fp32 [b, sq] each row's log-sum-exp of its selected
        scores (replayed with the indices), else None (also where a hook replaced the
        selection with indices alone).

        `q_positions` ([sq] int64) are the query rows' global positions, None where they are
        HyTopK's default (no CP, all rows); the keys are the whole sequence in global order, so
        their positions are arange (HyTopK's default). Packed documents select each over its
        own keys: its rows (`packed.local`, clipped to `rows`, the query's part of the key
        rows, (0, sq) by default) against its rows of the keys (`packed.documents`) at their
        positions in the document (`packed.offsets`; HyTopK's default without CP or part).
        `visible` (bool [b, sq, keys], an explicit attention mask) replaces causality and
        documents: the selection runs on HyTopK's reference path with it (`ops.hytopk`).
        The selection's output is distinct, visible and valid-first by construction, so its
        consumers skip their value checks; each row's keys increase (HyTopK's order="key"; the
        documents' and parts' offsets keep it), so the lockstep attention kernels skip their
        sort (`keys_ascending`).
        """
        shape = (b, sq, self.index_topk)
        first, end = (0, sq) if rows is None else rows
        keep_lse = self._keeps_index_lse(visible)
        index_lse = None
        if self.skip_topk:
            indices = self.selection_replay.select(
                shape, lambda: self._shared_selection(packed_seq_params, attention_mask),
                shared=True)
        else:
            def select_scored(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                              positions: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
                masked = visible is not None
                return hytopk(
                    q.detach(), k.detach(), w.detach(), self.index_topk,
                    relu=bool(self.config.dsa_indexer_scoring_relu), q_positions=positions,
                    causal=not masked, visible=visible,
                    # The mask runs on the reference; "auto" lets every configured backend
                    # (the library's included) hand it there.
                    backend="auto" if masked else kernel_backend(self.config),
                    check_values=False, precision=indexer_precision(self.config),
                    # Key order: the lockstep attention kernels need no sort of their own.
                    order="key",
                    # HyTopK's kernel variant (e.g. scores_sm90); None: its DEFAULT.
                    options=getattr(self.config, "hytopk_options", None),
                )

            def select_from(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                            positions: torch.Tensor | None) -> replay.Selected:
                """The indices; where `keep_lse`, the pair (indices, fp32 [n, rows] each
                row's log-sum-exp of its selected scores)."""
                indices, scores = select_scored(q, k, w, positions)
                if not keep_lse:
                    return indices
                return indices, index_lse_from_scores(scores, self._loss_options().block_n)

            def compute() -> replay.Selected:
                # Where `keep_lse`, the pair (indices, log-sum-exps), recorded and replayed as
                # one entry.
                with torch.no_grad():
                    if packed is None:
                        return select_from(q_idx, k_idx, weights, q_positions)
                    if (packed_selection(self.config) == "batched" and b == 1
                            and rows is None):
                        return batched_document_selection(select_from, q_idx, k_idx, weights,
                                                          packed, self.index_topk,
                                                          row_values=keep_lse)
                    # Each document over its own keys; its indices become packed rows. Rows of
                    # no document select nothing (their log-sum-exp 0, as the row pass has it).
                    indices = torch.full(shape, -1, dtype=torch.int32, device=q_idx.device)
                    lse = (torch.zeros((b, sq), dtype=torch.float32, device=q_idx.device)
                           if keep_lse else None)
                    for (start, stop), (r0, r1) in zip(packed.documents, packed.local,
                                                       strict=True):
                        lo, hi = max(r0, first), min(r1, end)  # the query's rows of it
                        if lo >= hi:
                            continue
                        if packed.offsets is not None:
                            positions = packed.offsets[lo:hi]
                        elif (lo, hi) != (r0, r1):  # part of a document: its rows' positions
                            positions = torch.arange(lo - r0, hi - r0, device=q_idx.device)
                        else:
                            positions = None  # the whole document: HyTopK's default
                        mine = slice(lo - first, hi - first)
                        got = select_from(q_idx[:, mine], k_idx[:, start:stop],
                                          weights[:, mine], positions)
                        if keep_lse:
                            got, lse[:, mine] = got
                        indices[:, mine] = torch.where(got >= 0, got + start, got)
                    return indices if lse is None else (indices, lse)

            indices = self.selection_replay.select(shape, compute)
            # A hook that replaces the selections (hyscale_bench.accuracy's forced ones) gives
            # the indices alone: the loss's row pass then takes the log-sum-exp itself.
            if isinstance(indices, tuple):
                indices, index_lse = indices
        if self.index_share and not self.skip_topk:
            self._get_index_share_topk_holder(packed_seq_params, attention_mask)[
                self.layer_number] = indices
        return indices, index_lse

    def _loss_options(self) -> IndexerLossKernelOptions:
        return (getattr(self.config, "indexer_loss_kernel_options", None)
                or IndexerLossKernelOptions.DEFAULT)

    def _keeps_index_lse(self, visible: torch.Tensor | None) -> bool:
        """Whether the selection also gives the indexer loss each row's log-sum-exp of its
        selected scores (`kernel_backend.indexer_lse` "selection"): a training layer with
        a sparse loss whose target may come from the attention backward, causal rows (packed
        documents included; not an explicit mask, whose selection runs on the reference), the
        selection in bf16 (the loss scores bf16 q and k). Where the
        attention then runs the library pair (`_target_from_attention_backward` false: the
        separate target pass), the log-sum-exp goes unused (one read of the selected scores,
        [T] fp32 kept)."""
        cfg = self.config
        options = self._loss_options()
        return (self.training and not self.skip_topk and indexer_lse(cfg) == "selection"
                and options.kl_in_bwd and not options.fused_rows_bwd
                and (cfg.dsa_indexer_loss_coeff or 0.0) > 0
                and bool(cfg.dsa_indexer_use_sparse_loss)
                and indexer_target(cfg) != "separate" and indexer_precision(cfg) == "bf16"
                and visible is None)

    def _shared_selection(self, packed_seq_params: Any,
                          attention_mask: torch.Tensor | None) -> torch.Tensor:
        """An index-sharing layer's selection: its source layer's, from this forward."""
        holder = self._get_index_share_topk_holder(packed_seq_params, attention_mask)
        if self.source_layer not in holder:
            raise RuntimeError(
                f"DSA index-share layer {self.layer_number} needs the top-k of layer "
                f"{self.source_layer}, which did not run before it in this pipeline stage "
                f"(dsa_indexer_topk_freq={self.index_topk_freq}, "
                f"dsa_indexer_skip_topk_offset={self.index_skip_topk_offset})"
            )
        return holder[self.source_layer]

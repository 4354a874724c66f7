"""HyScaleMLASelfAttention: megatron-core's AbsorbedMLASelfAttention, optionally row-chunked.

Same constructor (plus `row_chunk`), forward signature and parameters as the stock class (it is
a subclass). With `row_chunk=None`, or a sequence of at most `row_chunk` local rows, it is the
stock forward, except that where the settings allow (the same as for row chunks: tensor-parallel
size 1, no RoPE fusion, no inference; `config.hyscale_mla_projections` not "megatron") the
query, key and compressed query come from this class's own projections, whose absorbed query
is written in place (`ops.absorbed_mla.absorbed_query`: no einsum copy, RoPE passes or
concatenations). Otherwise the per-row work runs `row_chunk` rows at a time, each part under its
own activation checkpoint, so that a 1M-token layer fits a GPU at CP = 2:

- once for all local rows: the q and kv down projections and norms, RoPE on the key, and the
  core attention's `prepare` (HyScaleDSAttention: indexer, keys gathered over the CP group,
  the selection, recorded or replayed as usual);
- per part of the rows, checkpointed: the q up projection, the K absorption and RoPE on the
  query, `attend_rows` (sparse attention and the part's share of the indexer loss), the V up
  projection and the output projection.

A part's query ([rows, b, heads, 576]), its attention output, their gradients and the output
projection's input exist for one part at a time (in backward as in forward), and the
selection runs once per layer forward, never inside a part's recompute. The result equals the
unchunked layer's up to floating-point summation order (the indexer loss is a sum of the parts'
row-weighted means). Covered: the HyScale DSA core (absorbed MLA), tensor-parallel size 1,
packed THD sequences (each row's RoPE at its position in its document, as megatron's
per-document RoPE, so a part may cut a document), RoPE without fusion, context parallelism
(allgather), both together, an explicit attention mask (attn_mask_type=None); other settings
raise, naming the setting (chunking was asked for, so it is never silently skipped; see
`layers.row_chunks` for FP8 / FP4, CUDA graphs and delayed weight gradients). Selective
recompute of `core_attn` is subsumed: the parts are checkpointed (more than the core
attention), and megatron's core_attn checkpoint is not applied on top.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
)
from megatron.core.utils import get_pg_size

from megatron_hyscale.layers.dsa import DSARowState, HyScaleDSAttention
from megatron_hyscale.layers.kernel_backend import mla_projections
from megatron_hyscale.layers.packed import document_rows, packed_layout
from megatron_hyscale.layers.row_chunks import (
    check_row_chunk,
    row_chunk_conflict,
    run_in_row_parts,
)
from megatron_hyscale.ops.absorbed_mla import absorbed_query


class HyScaleMLASelfAttention(AbsorbedMLASelfAttention):
    """AbsorbedMLASelfAttention whose forward can run its query rows in checkpointed parts."""

    def __init__(self, *args: Any, row_chunk: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.row_chunk = check_row_chunk(row_chunk)

    def _chunking_unsupported(self, packed_seq_params: Any) -> str | None:
        cfg = self.config
        if not isinstance(self.core_attention, HyScaleDSAttention):
            return f"the core attention is {type(self.core_attention).__name__}, not HyScale's"
        if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
            return f"packed_seq_params with qkv_format={packed_seq_params.qkv_format!r}"
        if getattr(packed_seq_params, "local_cp_size", None) is not None:
            return "dynamic context parallelism (packed_seq_params.local_cp_size)"
        if get_pg_size(self.tp_group) > 1:
            return "tensor parallelism (size > 1)"
        if cfg.apply_rope_fusion:
            return "apply_rope_fusion=True"
        if self.recompute_up_proj:
            return "selective recompute of mla_up_proj (the parts are checkpointed already)"
        return row_chunk_conflict(cfg)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        rotary_pos_cos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        position_ids: torch.Tensor | None = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[sq, b, h] -> ([sq, b, h], None), as AbsorbedMLASelfAttention."""
        mla_projections(self.config)  # a bad setting raises before anything runs
        if self.row_chunk is None or hidden_states.size(0) <= self.row_chunk:
            return super().forward(
                hidden_states, attention_mask, key_value_states=key_value_states,
                inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, position_ids=position_ids,
                sequence_len_offset=sequence_len_offset, inference_params=inference_params,
            )
        # The stock forward's argument checks (MLA makes its own RoPE, takes no bias).
        if rotary_pos_emb is not None or attention_bias is not None:
            raise ValueError("HyScaleMLASelfAttention: rotary_pos_emb and attention_bias must "
                             "be None (MLA applies its own RoPE and has no attention bias)")
        if rotary_pos_cos is not None or rotary_pos_sin is not None or rotary_pos_cos_sin:
            raise ValueError("HyScaleMLASelfAttention: rotary_pos_cos / rotary_pos_sin / "
                             "rotary_pos_cos_sin are for flash decoding, not supported by MLA")
        reason = self._chunking_unsupported(packed_seq_params)
        if reason is None and key_value_states is not None:
            reason = "key_value_states (cross attention)"
        if reason is None and (inference_context is not None or inference_params is not None):
            reason = "inference"
        if reason is not None:
            raise NotImplementedError(f"HyScaleMLASelfAttention(row_chunk={self.row_chunk}): "
                                      f"{reason} is not supported with row chunks")
        return self._chunked_forward(hidden_states, attention_mask, packed_seq_params), None

    def _own_projections_unsupported(self, key_value_states: Any, packed_seq_params: Any,
                                     inference_context: Any) -> str | None:
        """Why `get_query_key_value_tensors` must take the stock code (None: it need not)."""
        if mla_projections(self.config) == "megatron":
            return "config.hyscale_mla_projections = 'megatron'"
        if key_value_states is not None or inference_context is not None:
            return "cross attention or inference"
        if self.config.cache_mla_latents:
            return "cache_mla_latents"
        return self._chunking_unsupported(packed_seq_params)

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor,
                                    key_value_states: torch.Tensor | None = None,
                                    packed_seq_params: Any = None,
                                    inference_context: Any = None, *,
                                    inference_params: Any = None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(absorbed query, key, q_compressed), as AbsorbedMLASelfAttention's; where the
        row-chunked forward's own projections apply (`_chunking_unsupported`), from those:
        the absorbed query's GEMM writes into the final [.., n, kv_lora + rope] buffer
        (`absorbed_query`) instead of megatron's einsum, contiguous copy and concatenation."""
        if inference_params is not None:
            inference_context = inference_params
        if self._own_projections_unsupported(key_value_states, packed_seq_params,
                                             inference_context) is not None:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, packed_seq_params,
                inference_context=inference_context)
        q_compressed, key, freqs, mscale = self._latents(hidden_states, packed_seq_params)
        k_up_weight, _ = self._get_kv_up_weights()
        query = self._query_rows(q_compressed, freqs, mscale, k_up_weight)
        if packed_seq_params is not None:  # megatron's THD layout: no batch dimension
            return query.squeeze(1), key.squeeze(1), q_compressed.squeeze(1)
        return query, key, q_compressed

    def _rope(self, length: int, packed: bool) -> tuple[torch.Tensor, float]:
        """RoPE frequencies [length, 1, 1, dim] (this CP rank's rows unless `packed`, which
        gives positions 0 .. length - 1) and mscale, as AbsorbedMLA makes them."""
        if self.config.rope_type == "rope":
            return self.rotary_pos_emb(length, packed_seq=packed), 1.0
        return self.rotary_pos_emb(length, packed_seq=packed)

    def _latents(self, hidden_states: torch.Tensor, packed_seq_params: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """q_compressed [sq, b, q_lora], key [sq, b, 1, kv_lora + rope] (RoPE applied), the
        RoPE frequencies of the local rows and mscale: AbsorbedMLA's projections without the
        q up projection (tensor-parallel size 1, no fusion). A packed THD sequence's rows
        take the frequencies of their positions in their document (megatron's per-document
        RoPE, zigzag chunks under CP), or in the whole sequence where max_seqlen equals its
        length (megatron's THD RoPE then reads them so), gathered per row, so that any part
        of the rows has its own."""
        cfg = self.config
        sq = hidden_states.size(0)
        if packed_seq_params is not None:
            cp = self.pg_collection.cp
            layout = packed_layout(packed_seq_params, sq, hidden_states.device,
                                   layer="HyScaleMLASelfAttention",
                                   group=cp if get_pg_size(cp) > 1 else None)
            rows = document_rows(layout, hidden_states.device)
            total = layout.documents[-1][1] if layout.documents else 0
            rotary_len = max(packed_seq_params.max_seqlen_q or 0,
                             packed_seq_params.max_seqlen_kv or 0)
            if rotary_len == total:
                # megatron's THD RoPE reads a frequency table as long as the whole sequence
                # as positions in the whole sequence (`_apply_rotary_pos_emb_thd`).
                freqs, mscale = self._rope(total, packed=True)
                freqs = freqs[rows.starts + rows.offsets]
            else:
                longest = max((b - a for a, b in layout.documents), default=1)
                freqs, mscale = self._rope(longest, packed=True)
                freqs = freqs[rows.offsets]
        else:
            rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states,
                                                                    cfg, None)
            freqs, mscale = self._rope(rotary_seq_len, packed=False)
            freqs = freqs[:sq]
        if cfg.q_lora_rank is not None:
            q_compressed = self.q_layernorm(self.linear_q_down_proj(hidden_states)[0])
        else:
            q_compressed = hidden_states
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        kv_compressed, k_pos_emb = torch.split(
            kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        kv_compressed = self.kv_layernorm(kv_compressed)
        k_pos_emb = apply_rotary_pos_emb(
            k_pos_emb.unsqueeze(-2), freqs, config=cfg, cu_seqlens=None, mscale=mscale,
            cp_group=self.pg_collection.cp, mla_rotary_interleaved=True)
        key = torch.cat([kv_compressed.unsqueeze(-2), k_pos_emb], dim=-1).contiguous()
        return q_compressed, key, freqs, mscale

    def _query_rows(self, q_compressed: torch.Tensor, freqs: torch.Tensor, mscale: float,
                    k_up_weight: torch.Tensor) -> torch.Tensor:
        """Absorbed queries [rows, b, heads, kv_lora + rope] of some rows (as AbsorbedMLA):
        written in place by `ops.absorbed_mla.absorbed_query` where megatron's RoPE is the
        interleaved-pairs one over the whole rotary part, else AbsorbedMLA's own ops."""
        cfg = self.config
        up = self.linear_q_up_proj if cfg.q_lora_rank is not None else self.linear_q_proj
        q, _ = up(q_compressed)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, self.q_head_dim)
        if (mla_projections(cfg) == "hyscale" and not cfg.rotary_interleaved
                and freqs.size(-1) == cfg.qk_pos_emb_head_dim and k_up_weight.dtype == q.dtype):
            # megatron's RoPE factors, computed the way its unfused RoPE computes them.
            cos = (torch.cos(freqs) * mscale).to(q.dtype).view(freqs.size(0), -1)
            sin = (torch.sin(freqs) * mscale).to(q.dtype).view(freqs.size(0), -1)
            return absorbed_query(q, k_up_weight, cos, sin)
        q_no_pe, q_pos_emb = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        q_absorbed = torch.einsum("...nd,ndk->...nk", q_no_pe, k_up_weight)
        q_pos_emb = apply_rotary_pos_emb(
            q_pos_emb, freqs, config=cfg, cu_seqlens=None, mscale=mscale,
            cp_group=self.pg_collection.cp, mla_rotary_interleaved=True)
        return torch.cat([q_absorbed, q_pos_emb], dim=-1).contiguous()

    def _chunked_forward(self, hidden_states: torch.Tensor,
                         attention_mask: torch.Tensor | None,
                         packed_seq_params: Any = None) -> torch.Tensor:
        core: HyScaleDSAttention = self.core_attention
        sq, b = hidden_states.shape[:2]
        q_compressed, key, freqs, mscale = self._latents(hidden_states, packed_seq_params)
        # The core's own checks (the mask type, an explicit attention_mask) run in prepare.
        state = core.prepare(key, attention_mask, hidden_states, q_compressed, sq=sq, b=b,
                             packed_seq_params=packed_seq_params,
                             attn_mask_type=self.attn_mask_type)
        rows_forward = partial(self._rows_forward, q_compressed, freqs, state, mscale)
        # Every part reads the whole (gathered) key, the indexer keys and both absorbed
        # weights: their gradients are summed over the parts in fp32 (row_chunks' doc).
        # q_compressed and freqs are read in disjoint slices: nothing to sum there.
        k_up_weight, v_up_weight = self._get_kv_up_weights()
        output, loss = run_in_row_parts(
            rows_forward, sq, self.row_chunk, dim=0,
            shared=(state.key_b, state.k_idx, k_up_weight, v_up_weight))
        if state.loss_coeff > 0:
            # Logged here, outside the parts: their recompute in backward must not log again.
            core.log_indexer_loss(loss, state)
        return output

    def _rows_forward(self, q_compressed: torch.Tensor, freqs: torch.Tensor,
                      state: DSARowState, mscale: float, r0: int, r1: int,
                      key_b: torch.Tensor, k_idx: torch.Tensor | None,
                      k_up_weight: torch.Tensor, v_up_weight: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """[r1 - r0, b, h] output of rows r0 .. r1 - 1 (recomputed in backward) and their
        detached indexer loss (0 without one); q_compressed and freqs cover all local rows;
        key_b and k_idx stand in for the state's (this part's copies, `run_in_row_parts`)."""
        query = self._query_rows(q_compressed[r0:r1], freqs[r0:r1], mscale, k_up_weight)
        state = dataclasses.replace(state, key_b=key_b, k_idx=k_idx)
        out, loss = self.core_attention.attend_rows(query, state, r0, r1, v_up_weight)
        output, _ = self.linear_proj(out)
        return output, loss if loss is not None else output.new_zeros((), dtype=torch.float32)

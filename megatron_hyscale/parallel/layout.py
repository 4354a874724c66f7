"""Megatron's zigzag context-parallel sequence layout (causal load balancing).

A global sequence of length S is cut into 2 * cp chunks of c = S / (2 cp) tokens. CP rank r
holds chunks r and 2cp-1-r, in that order, so every rank gets one cheap (early) and one costly
(late) chunk of causal attention. This is what megatron's `get_batch_on_this_cp_rank` does to
tokens, labels, loss mask and position ids (non-packed sequences), and what its RoPE slicing
(`get_pos_emb_on_this_cp_rank`) assumes.

An all-gather over the CP group concatenates the ranks' local sequences in rank order
("rank-major": r0 front, r0 back, r1 front, r1 back, ...); `rank_major_to_global` restores the
global order and `global_to_rank_major` is its inverse. Both move whole chunks (one copy, no
index tensor) along dimension `dim`.

A packed THD sequence (documents back to back, `cu_seqlens`) is split per document instead:
each document's rows are cut into 2 * cp chunks and rank r holds chunks r and 2cp-1-r of every
document, documents in order (megatron's `get_batch_on_this_cp_rank` for THD, through
Transformer Engine's `thd_get_partitioned_indices`): `thd_positions`, `thd_split`,
`thd_gather_order` (the all-gather's rows back in global order) and `thd_merge`.

`cp_row_layout` is what a HyScale attention layer reads at the top of its forward: its CP group
and the global positions of its local query rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _check(length: int, parts: int, what: str) -> int:
    if parts <= 0 or length % parts != 0:
        raise ValueError(f"{what}: sequence length {length} must be divisible by {parts}")
    return length // parts


def zigzag_positions(
    local_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 [local_len] global positions of this rank's tokens (chunks r, then 2cp-1-r)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    if cp_size == 1:
        return torch.arange(local_len, device=device, dtype=torch.int64)
    c = _check(local_len, 2, "zigzag_positions (local length)")
    front = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device, dtype=torch.int64)
    back_chunk = 2 * cp_size - 1 - cp_rank
    back = torch.arange(back_chunk * c, (back_chunk + 1) * c, device=device, dtype=torch.int64)
    return torch.cat((front, back))


def zigzag_split(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int) -> torch.Tensor:
    """This rank's part of a full sequence: chunks r and 2cp-1-r of 2cp along `dim`.

    [..., S, ...] -> [..., S / cp, ...], as megatron's `get_batch_on_this_cp_rank`.
    """
    if cp_size == 1:
        return x
    _check(x.size(dim), 2 * cp_size, "zigzag_split")
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim=dim)


def rank_major_to_global(x: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Reorder an all-gathered [..., cp * L, ...] (rank-major) tensor to global order."""
    if cp_size == 1:
        return x
    _check(x.size(dim), 2 * cp_size, "rank_major_to_global")
    chunks = x.chunk(2 * cp_size, dim=dim)  # rank r's front = 2r, back = 2r + 1
    fronts = [chunks[2 * r] for r in range(cp_size)]                   # global chunks 0..cp-1
    backs = [chunks[2 * r + 1] for r in reversed(range(cp_size))]      # global chunks cp..2cp-1
    return torch.cat(fronts + backs, dim=dim)


def global_to_rank_major(x: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Inverse of `rank_major_to_global`: [..., S, ...] global -> gathered rank-major order."""
    if cp_size == 1:
        return x
    _check(x.size(dim), 2 * cp_size, "global_to_rank_major")
    chunks = x.chunk(2 * cp_size, dim=dim)
    parts = []
    for r in range(cp_size):
        parts += [chunks[r], chunks[2 * cp_size - 1 - r]]
    return torch.cat(parts, dim=dim)


def zigzag_merge(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Reassemble the full sequence from every rank's `zigzag_split` part (rank order)."""
    return rank_major_to_global(torch.cat(parts, dim=dim), len(parts), dim=dim)


def _thd_lengths(cu_seqlens: Sequence[int], cp_size: int, what: str) -> list[int]:
    """The documents' lengths, each checked divisible by 2 * cp_size (ValueError naming `what`)."""
    cu = [int(v) for v in cu_seqlens]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{what}: cu_seqlens must rise from 0, got {cu}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    bad = [n for n in lengths if n % (2 * cp_size)]
    if cp_size > 1 and bad:
        raise ValueError(f"{what}: every packed document's length must be divisible by 2 * cp = "
                         f"{2 * cp_size} (each is cut into 2 * cp chunks), got lengths {lengths}")
    return lengths


def thd_positions(cu_seqlens: Sequence[int], cp_size: int, cp_rank: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """int64 global rows of this rank's share of a packed THD sequence (host `cu_seqlens`):
    for each document, its chunks r and 2cp-1-r of 2cp, documents in order. As TE's
    `thd_get_partitioned_indices` (megatron's `get_batch_on_this_cp_rank` for THD). Raises
    ValueError when a document's length is not divisible by 2 * cp_size."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    lengths = _thd_lengths(cu_seqlens, cp_size, "thd_positions")
    if cp_size == 1:
        return torch.arange(sum(lengths), dtype=torch.int64, device=device)
    parts, start = [], 0
    for n in lengths:
        c = n // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
        start += n
    out = torch.cat(parts) if parts else torch.zeros(0)
    return out.to(device=device, dtype=torch.int64)


def thd_split(x: torch.Tensor, cu_seqlens: Sequence[int], cp_size: int, cp_rank: int,
              dim: int) -> torch.Tensor:
    """This rank's share of a packed THD sequence along `dim` (`thd_positions`' rows)."""
    return x.index_select(dim, thd_positions(cu_seqlens, cp_size, cp_rank, x.device))


@dataclass(frozen=True)
class RowOrder:
    """The rows of a CP all-gather (the ranks' local rows, rank after rank) in global order."""

    to_global: torch.Tensor  # int64 [S]: global row g is gathered row to_global[g]
    to_rank_major: torch.Tensor  # int64 [S]: gathered row m is global row to_rank_major[m]


def thd_gather_order(cu_seqlens: Sequence[int], cp_size: int,
                     device: torch.device | str | None = None) -> RowOrder:
    """How an all-gather of every rank's `thd_split` share maps to the global packed rows."""
    owners = torch.cat([thd_positions(cu_seqlens, cp_size, r) for r in range(cp_size)])
    to_global = torch.empty_like(owners)
    to_global[owners] = torch.arange(owners.numel(), dtype=torch.int64)
    return RowOrder(to_global.to(device), owners.to(device))


def thd_merge(parts: list[torch.Tensor], cu_seqlens: Sequence[int], dim: int) -> torch.Tensor:
    """Reassemble a packed THD sequence from every rank's `thd_split` part (rank order)."""
    order = thd_gather_order(cu_seqlens, len(parts), parts[0].device)
    return torch.cat(parts, dim=dim).index_select(dim, order.to_global)


@dataclass(frozen=True)
class CPRowLayout:
    """Where an attention layer's local query rows sit in the global sequence."""

    group: dist.ProcessGroup | None  # the context-parallel group; None without CP
    positions: torch.Tensor  # int64 [rows] global positions (0 .. rows - 1 without CP)

    @property
    def size(self) -> int:
        """CP size: 1 without a group."""
        return 1 if self.group is None else self.group.size()


def cp_row_layout(
    pg_collection: Any, rows: int, device: torch.device | str, *, layer: str,
    key_rows: int | None = None, config: Any = None,
) -> CPRowLayout:
    """The CP group and the global positions of `rows` local query rows.

    The group is `pg_collection.cp`; a layer built without a pg_collection (on its own, as in
    the benchmarks) takes megatron's global CP group when `config.context_parallel_size` > 1,
    as megatron's Attention does when it makes its own collection. Under CP megatron's data
    loader gave this rank zigzag chunks r and 2cp-1-r (`get_batch_on_this_cp_rank`) and RoPE
    was applied at those positions; they come from that layout, not from `position_ids`, so a
    data set with reset position ids masks exactly as at CP 1 (which ignores them too).

    Raises ValueError (naming `layer`) under CP when `rows` is odd (two zigzag chunks) or
    `key_rows`, the layer's local key rows where it has its own key input, differs from it.
    """
    if pg_collection is not None:
        group = getattr(pg_collection, "cp", None)
    elif config is not None and getattr(config, "context_parallel_size", 1) > 1:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group(check_initialized=False)
    else:
        group = None
    if group is None or not dist.is_initialized() or group.size() == 1:
        return CPRowLayout(None, torch.arange(rows, device=device))
    if rows % 2 or (key_rows is not None and key_rows != rows):
        keys = "" if key_rows is None else f" and as many local key rows ({key_rows})"
        raise ValueError(f"{layer} under context parallelism expects an even number of local "
                         f"query rows (two zigzag chunks){keys}, got {rows}")
    return CPRowLayout(group, zigzag_positions(rows, group.size(), group.rank(), device))

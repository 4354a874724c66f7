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

`cp_row_layout` is what a HyScale attention layer reads at the top of its forward: its CP group
and the global positions of its local query rows.
"""

from __future__ import annotations

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

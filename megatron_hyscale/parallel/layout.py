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
"""

from __future__ import annotations

import torch


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

"""Top-k slot layouts the library kernels take: valid slots first, a per-row length, flat ids."""

from __future__ import annotations

import torch


def valid_first(indices: torch.Tensor, *, known_valid_first: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices with each row's valid (>= 0) slots first in their order, int32 count per row).

    cuDNN's and FlashMLA's kernels read a row's first `length` slots only. HyTopK's rows are
    already in that layout (-1 fills the end), so the stable sort runs only when some row
    has a -1 before a valid slot; `known_valid_first` (the caller vouches for the layout)
    skips that test and its host sync.
    """
    valid = indices >= 0
    length = valid.sum(-1, dtype=torch.int32)
    if (not known_valid_first and indices.shape[-1] > 1
            and bool((valid[..., 1:] & ~valid[..., :-1]).any())):
        order = (~valid).to(torch.int8).argsort(dim=-1, stable=True)
        indices = indices.gather(-1, order)
    return indices.to(torch.int32).contiguous(), length


def keys_off_default_positions(kpos: torch.Tensor | None, S: int) -> bool:
    """Whether key positions differ from 0 .. S-1 (the library kernels' only layout); kpos
    None means the defaults, known without reading anything back."""
    return kpos is not None and not torch.equal(
        kpos, torch.arange(S, device=kpos.device).expand_as(kpos))


def flat_key_ids(indices: torch.Tensor, keys_per_batch: int) -> torch.Tensor:
    """[B, T, K] per-batch key ids -> ids into the [B * S] flattened keys; -1 stays -1."""
    B = indices.shape[0]
    if B == 1:
        return indices
    if B * keys_per_batch >= 2**31:
        raise ValueError(f"B * S = {B * keys_per_batch} keys exceed the library kernels' int32 "
                         "key ids")
    offsets = (torch.arange(B, device=indices.device, dtype=indices.dtype) * keys_per_batch)
    return torch.where(indices >= 0, indices + offsets.view(B, *([1] * (indices.dim() - 1))),
                       indices)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple

"""Selection over the documents of a packed THD sequence, documents batched into few launches.

Each document of a packed sequence selects over its own keys. Run one selection call per
document and a sequence of many short documents pays one launch (and its host work) per
document: 64 calls for 64 documents of 2K tokens. Batched instead, documents of similar length
become the batch rows of one call: their query rows and keys are gathered into [n, L] tensors,
padded to the group's longest document, selected together, and the indices scattered back to
the packed rows (made global by adding each document's first key row).

Exact: a real row t of a document sees keys 0 .. t of it (its in-document position bounds the
causal mask), so the padding keys, which sit past the document's end, are never visible to a
real row; padded query rows select garbage that is never written back. The padding costs work:
a document joins a group only while its own causal work (length squared) is at least
`MIN_FILL` of the group's padded work, except that documents no longer than
`SHORT_DOCUMENT_ROWS` all share one group (there the launches, not the padding, dominate).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_hyscale.layers.packed import PackedLayout

# A document joins a group while len^2 >= MIN_FILL * L_max^2 (at most 2x its own work padded).
MIN_FILL = 0.5
# Documents this short or shorter are batched together whatever their lengths.
SHORT_DOCUMENT_ROWS = 4096

# select(q [n, Lq, H, D], k [n, Lk, D], weights [n, Lq, H], q_positions [n, Lq] or None for
# 0 .. Lq - 1) -> int32 indices [n, Lq, topk] into each batch row's keys, -1 padded; with
# `row_values`, the pair (indices, a value a row [n, Lq]: the DSA layer's log-sum-exps).
SelectFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                    torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


def document_groups(lengths: list[int], *, min_fill: float = MIN_FILL,
                    short_rows: int = SHORT_DOCUMENT_ROWS) -> list[list[int]]:
    """Document ids grouped for batching, longest first: a document joins the current group
    while its length squared is at least `min_fill` x the group's longest's squared, or the
    group's longest has at most `short_rows` rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            longest = lengths[groups[-1][0]]
            if longest <= short_rows or lengths[i] ** 2 >= min_fill * longest ** 2:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _row_table(ranges: list[tuple[int, int]], width: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """On the host: (rows [n, width] int64: range i's rows, the last one repeated past its end;
    slots int64: the flat positions in [n * width] of the real ones, in order)."""
    starts = torch.tensor([a for a, _ in ranges], dtype=torch.int64)
    counts = torch.tensor([b - a for a, b in ranges], dtype=torch.int64)
    j = torch.arange(width, dtype=torch.int64)
    rows = starts[:, None] + torch.minimum(j[None, :], (counts - 1).clamp_min(0)[:, None])
    slots = torch.nonzero((j[None, :] < counts[:, None]).flatten()).flatten()
    return rows, slots


def batched_document_selection(select: SelectFn, q_idx: torch.Tensor, k_idx: torch.Tensor,
                               weights: torch.Tensor, packed: PackedLayout, topk: int, *,
                               min_fill: float = MIN_FILL,
                               short_rows: int = SHORT_DOCUMENT_ROWS, row_values: bool = False
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """int32 [1, rows, topk]: every document's selection over its own keys, as indices into
    the packed keys (k_idx's rows), -1 padded; the same as one `select` call per document.
    `row_values`: `select` returns pairs (indices, a value a row), and so does this: the values
    [1, rows] in the packed rows, 0 at rows of no document.

    q_idx [1, rows, H, D], weights [1, rows, H] (the local rows), k_idx [1, S, D] (the whole
    packed key sequence, gathered under CP). `packed.local` gives each document's local rows,
    `packed.documents` its key rows, `packed.offsets` (under CP) the local rows' in-document
    positions (without CP a document's rows sit at 0 .. length - 1). `min_fill`,
    `short_rows`: the grouping (`document_groups`).
    """
    if q_idx.shape[0] != 1:
        raise ValueError(f"packed THD sequences have batch size 1, got q_idx {tuple(q_idx.shape)}")
    device = q_idx.device
    rows = q_idx.shape[1]
    out = torch.full((1, rows, topk), -1, dtype=torch.int32, device=device)
    values = torch.zeros((1, rows), dtype=torch.float32, device=device) if row_values else None
    docs = [(d, loc) for d, loc in zip(packed.documents, packed.local, strict=True)
            if loc[1] > loc[0]]
    lengths = [d[1] - d[0] for d, _ in docs]
    for group in document_groups(lengths, min_fill=min_fill, short_rows=short_rows):
        keys = [docs[i][0] for i in group]
        local = [docs[i][1] for i in group]
        k_width = max(b - a for a, b in keys)
        q_width = max(b - a for a, b in local)
        # Index tables built on the host from the host-known documents: no device read-back.
        key_rows, _ = _row_table(keys, k_width)
        q_rows, q_slots = _row_table(local, q_width)
        first = torch.tensor([a for a, _ in keys], dtype=torch.int32)
        key_rows, q_dest = key_rows.to(device), q_rows.flatten()[q_slots].to(device)
        q_rows, q_slots, first = q_rows.to(device), q_slots.to(device), first.to(device)
        positions = None
        if packed.offsets is not None:
            positions = packed.offsets[q_rows]
        elif q_width != k_width:
            raise ValueError("without context parallelism a document's local rows are its keys")
        got = select(q_idx[0][q_rows], k_idx[0][key_rows], weights[0][q_rows], positions)
        if row_values:
            got, got_values = got
            values[0, q_dest] = got_values.reshape(-1)[q_slots].to(values.dtype)
        got = torch.where(got >= 0, got + first[:, None, None], got)
        out[0, q_dest] = got.reshape(-1, topk)[q_slots]
    return out if values is None else (out, values)

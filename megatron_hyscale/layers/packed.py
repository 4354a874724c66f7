"""The documents of a packed THD sequence, as host row ranges.

megatron packs documents back to back (`PackedSeqParams(qkv_format="thd")`, cu_seqlens
[docs + 1] int32 on the device; the padded variants give the rows each document occupies).
HyScale's DSA layer selects and normalizes per document, so it needs the boundaries on the
host: read once per micro-batch (all layers share the tensor) and cached by tensor.

Under context parallelism the cu_seqlens describe the whole sequence and each rank holds its
per-document zigzag share (chunks r and 2cp-1-r of every document, `parallel.thd_split`):
`packed_layout` gives a layer both views, the documents' rows in the whole (all-gathered)
sequence and in this rank's local rows, with the local rows' positions and the all-gather's
order, built once per layout and device and cached.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.experimental_attention_variant import dsa_layout

from megatron_hyscale.parallel import RowOrder, thd_gather_order, thd_positions

Documents = tuple[tuple[int, int], ...]
# id(tensor) -> (a weak reference to it, its version counter when read, its values). Tensors
# compare elementwise, so they cannot key a WeakKeyDictionary; the version counter catches
# a buffer rewritten in place.
_cache: dict[int, tuple[weakref.ref, int, list[int]]] = {}


def _host(cu: torch.Tensor) -> list[int]:
    hit = _cache.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == cu._version:
        return hit[2]
    got = [int(v) for v in cu.tolist()]  # the one host read of a micro-batch's layout
    key = id(cu)
    _cache[key] = (weakref.ref(cu, lambda _ref: _cache.pop(key, None)), cu._version, got)
    return got


def _cu_seqlens(packed_seq_params: Any, rows: int, layer: str, whole: str) -> list[int]:
    cu_q, cu_kv = dsa_layout.get_packed_qk_cu_seqlens(packed_seq_params)
    q, kv = _host(cu_q), _host(cu_kv) if cu_kv is not cu_q else None
    if kv is not None and kv != q:
        raise ValueError(f"{layer}: packed THD with different query and key documents "
                         f"(cu_seqlens_q {q} != cu_seqlens_kv {kv}) is not self-attention")
    if not q or q[0] != 0 or q[-1] != rows or any(b < a for a, b in zip(q, q[1:])):
        raise ValueError(f"{layer}: packed cu_seqlens must rise from 0 to the {rows} rows of "
                         f"{whole}, got {q}")
    return q


def packed_documents(packed_seq_params: Any, rows: int, *, layer: str) -> Documents:
    """[(start, end), ...] row ranges of the packed documents, covering rows 0 .. rows - 1.

    Storage rows count (the `_padded` cu_seqlens where given, as megatron's DSA masks them).
    Raises ValueError (naming `layer`) when query and key documents differ or do not cover
    the rows.
    """
    q = _cu_seqlens(packed_seq_params, rows, layer, "the input")
    return tuple((a, b) for a, b in zip(q, q[1:]) if b > a)


@dataclass(frozen=True)
class PackedLayout:
    """A packed THD sequence as an attention layer's local rows see it."""

    documents: Documents  # each document's rows of the whole sequence (the gathered keys)
    local: Documents  # this rank's rows of the same documents (its query rows), in order
    positions: torch.Tensor | None  # int64 [rows] the local rows' global rows; None: no CP
    offsets: torch.Tensor | None  # int64 [rows] their positions in their document; None: no CP
    key_order: RowOrder | None  # the all-gathered rows' global order; None: no CP


def packed_layout(packed_seq_params: Any, rows: int, device: torch.device, *, layer: str,
                  group: dist.ProcessGroup | None = None) -> PackedLayout:
    """The packed documents of `rows` local rows; under CP (`group` of size > 1) the
    cu_seqlens cover the whole sequence, `rows` x cp rows, split per document.

    Raises ValueError (naming `layer` and the cu_seqlens argument read) when query and key
    documents differ, do not cover the rows, or, under CP, a document's length is not
    divisible by 2 * cp (megatron's per-document zigzag split needs it).
    """
    cp = 1 if group is None else group.size()
    if cp == 1:
        documents = packed_documents(packed_seq_params, rows, layer=layer)
        return PackedLayout(documents, documents, None, None, None)
    name = ("cu_seqlens_q_padded" if getattr(packed_seq_params, "cu_seqlens_q_padded", None)
            is not None else "cu_seqlens_q")
    cu = _cu_seqlens(packed_seq_params, rows * cp, layer,
                     f"the whole sequence ({rows} local rows x context parallelism {cp})")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if any(n % (2 * cp) for n in lengths):
        raise ValueError(f"{layer}: packed THD under context parallelism {cp} needs every "
                         f"document's length divisible by 2 * cp = {2 * cp} (megatron splits "
                         f"each into 2 * cp chunks), got {name} lengths {lengths}")
    return _cp_layout(tuple(cu), cp, group.rank(), str(device))


@functools.lru_cache(maxsize=16)
def _cp_layout(cu: tuple[int, ...], cp: int, rank: int, device: str) -> PackedLayout:
    documents = tuple((a, b) for a, b in zip(cu, cu[1:]) if b > a)
    local, start = [], 0
    for a, b in documents:
        local.append((start, start + (b - a) // cp))
        start += (b - a) // cp
    positions = thd_positions(cu, cp, rank)
    doc_starts = torch.cat([torch.full((e - s,), a, dtype=torch.int64)
                            for (a, _), (s, e) in zip(documents, local)]
                           or [torch.zeros(0, dtype=torch.int64)])
    return PackedLayout(documents, tuple(local), positions.to(device),
                        (positions - doc_starts).to(device), thd_gather_order(cu, cp, device))


@dataclass(frozen=True)
class DocumentRows:
    """Per local row of a packed layout: where its document starts and where the row sits in it.

    For layers that position their own tokens (RoPE, sliding windows, pooled blocks) per
    document: a row's global row is starts + offsets.
    """

    starts: torch.Tensor  # int64 [rows] the row's document's first row in the whole sequence
    offsets: torch.Tensor  # int64 [rows] the row's position within its document


def document_rows(layout: PackedLayout, device: torch.device) -> DocumentRows:
    """The local rows' document starts and in-document positions (cached per layout, device)."""
    if layout.offsets is not None:  # CP: the layout has them
        return DocumentRows(layout.positions - layout.offsets, layout.offsets)
    return _document_rows(layout.documents, str(device))


@functools.lru_cache(maxsize=16)
def _document_rows(documents: Documents, device: str) -> DocumentRows:
    rows = documents[-1][1] if documents else 0
    starts = torch.cat([torch.full((b - a,), a, dtype=torch.int64) for a, b in documents]
                       or [torch.zeros(0, dtype=torch.int64)])
    return DocumentRows(starts.to(device), (torch.arange(rows) - starts).to(device))


def pooled_ranges(documents: Documents, size: int) -> Documents:
    """Each document's range of pooled entries (complete blocks of `size` rows, pooled per
    document and concatenated in document order): document i has length // size of them."""
    out, start = [], 0
    for a, b in documents:
        out.append((start, start + (b - a) // size))
        start += (b - a) // size
    return tuple(out)


def per_row(values: Any, local: Documents, device: torch.device) -> torch.Tensor:
    """int64 [rows]: values[i] repeated over document i's local rows (`PackedLayout.local`)."""
    lengths = torch.tensor([b - a for a, b in local], dtype=torch.int64)
    return torch.repeat_interleave(torch.tensor(list(values), dtype=torch.int64),
                                   lengths).to(device)


def checked_packed_layout(packed_seq_params: Any, rows: int, device: torch.device, *,
                          layer: str, group: dist.ProcessGroup | None = None) -> PackedLayout:
    """`packed_layout`, its ValueErrors naming the `packed_seq_params` argument read
    (cu_seqlens_q_padded where given, else cu_seqlens_q); with padded cu_seqlens also checks
    that each document's cu_seqlens_q length fits in its padded rows (the padding rows then
    belong to their document: later rows of it, which its real rows never read causally)."""
    name = ("cu_seqlens_q_padded" if getattr(packed_seq_params, "cu_seqlens_q_padded", None)
            is not None else "cu_seqlens_q")
    try:
        layout = packed_layout(packed_seq_params, rows, device, layer=layer, group=group)
    except ValueError as err:
        if name in str(err):
            raise
        raise ValueError(f"{err} (read from packed_seq_params.{name})") from err
    real = getattr(packed_seq_params, "cu_seqlens_q", None)
    if name == "cu_seqlens_q_padded" and real is not None:
        padded, real = _host(packed_seq_params.cu_seqlens_q_padded), _host(real)
        lengths = [b - a for a, b in zip(real, real[1:])]
        room = [b - a for a, b in zip(padded, padded[1:])]
        if len(lengths) != len(room) or any(n < 0 or n > r for n, r in zip(lengths, room)):
            raise ValueError(f"{layer}: packed_seq_params.cu_seqlens_q {real} must give every "
                             f"document at most its rows in cu_seqlens_q_padded {padded}")
    return layout

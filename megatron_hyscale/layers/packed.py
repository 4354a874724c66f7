"""The documents of a packed THD sequence, as host row ranges.

megatron packs documents back to back (`PackedSeqParams(qkv_format="thd")`, cu_seqlens
[docs + 1] int32 on the device; the padded variants give the rows each document occupies).
HyScale's DSA layer selects and normalizes per document, so it needs the boundaries on the
host: read once per micro-batch (all layers share the tensor) and cached by tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from megatron.core.transformer.experimental_attention_variant import dsa_layout

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


def packed_documents(packed_seq_params: Any, rows: int, *, layer: str) -> Documents:
    """[(start, end), ...] row ranges of the packed documents, covering rows 0 .. rows - 1.

    Storage rows count (the `_padded` cu_seqlens where given, as megatron's DSA masks them).
    Raises ValueError (naming `layer`) when query and key documents differ or do not cover
    the rows.
    """
    cu_q, cu_kv = dsa_layout.get_packed_qk_cu_seqlens(packed_seq_params)
    q, kv = _host(cu_q), _host(cu_kv) if cu_kv is not cu_q else None
    if kv is not None and kv != q:
        raise ValueError(f"{layer}: packed THD with different query and key documents "
                         f"(cu_seqlens_q {q} != cu_seqlens_kv {kv}) is not self-attention")
    if not q or q[0] != 0 or q[-1] != rows or any(b < a for a, b in zip(q, q[1:])):
        raise ValueError(f"{layer}: packed cu_seqlens must rise from 0 to the {rows} rows of "
                         f"the input, got {q}")
    return tuple((a, b) for a, b in zip(q, q[1:]) if b > a)

"""Sparse attention over selected key indices (DSA / CSA / QSA attention core).

out[b, t, h] = sum_j softmax_j(scale * q[b, t, h] . k[b, i_j, g]) * v[b, i_j, g] over the valid
(non -1) indices i_j of row (b, t, g), where g = h // (Hq / Hkv) is the KV head query head h
reads. An optional per-head sink logit joins each softmax denominator only. All arithmetic is
fp32; the output comes back in q's dtype.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_hyscale.ops import reference
from megatron_hyscale.ops.backends import dispatch, measured
from megatron_hyscale.ops.backends.dispatch import BACKEND_CHOICES, LIBRARY_BACKENDS
from megatron_hyscale.ops.checks import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_backend,
    check_bool,
    check_distinct_indices,
    check_finite,
    check_index_range,
    check_options,
    check_same_device,
    check_softmax_scale,
    check_tensor,
    check_triton_device,
)
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions


def check_prefix_lengths(prefix_lengths: torch.Tensor, indices: torch.Tensor, B: int, T: int,
                         S: int, check_values: bool = True) -> None:
    """prefix_lengths int [B, T]; with check_values also in [0, S], and listed indices must
    not repeat a prefix key."""
    check_tensor("prefix_lengths", prefix_lengths, ndim=2, dtypes=INT_DTYPES)
    if tuple(prefix_lengths.shape) != (B, T):
        raise ValueError(f"prefix_lengths must be [B={B}, T={T}], got "
                         f"{tuple(prefix_lengths.shape)}")
    if prefix_lengths.numel() == 0 or not check_values:
        return
    lo, hi = int(prefix_lengths.min()), int(prefix_lengths.max())
    if lo < 0 or hi > S:
        raise ValueError(f"prefix_lengths must lie in [0, S={S}], got values in [{lo}, {hi}]")
    n = prefix_lengths.view(B, T, *([1] * (indices.dim() - 2)))
    if ((indices >= 0) & (indices < n)).any():
        raise ValueError("indices must not list a key of the row's prefix (keys 0 .. "
                         "prefix_lengths - 1 are attended already): a repeated key would count "
                         "twice")


def validate_sparse_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    indices: torch.Tensor,
    softmax_scale: float,
    dv: int | None,
    sink: torch.Tensor | None,
    prefix_lengths: torch.Tensor | None = None,
    check_values: bool = True,
) -> tuple[float, int | None]:
    """Check shapes, dtypes, devices (and values unless `check_values` is False); return
    (softmax_scale, dv) normalized."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES)
    B, T, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, S, Hkv, Dqk={D}], got {tuple(k.shape)}")
    S, Hkv = k.shape[1], k.shape[2]
    if S == 0:
        raise ValueError("k must hold at least one key (S >= 1)")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k has {Hkv} heads, which must divide q's {Hq} heads")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} must match q dtype {q.dtype}")
    if v is not None:
        check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES)
        if tuple(v.shape[:3]) != (B, S, Hkv):
            raise ValueError(f"v must be [B={B}, S={S}, Hkv={Hkv}, Dv], got {tuple(v.shape)}")
        if v.dtype != q.dtype:
            raise ValueError(f"v dtype {v.dtype} must match q dtype {q.dtype}")
        if dv is not None and dv != v.shape[3]:
            raise ValueError(f"dv={dv!r} contradicts v's last dim {v.shape[3]} (leave dv None)")
    elif dv is not None and (isinstance(dv, bool) or not isinstance(dv, int) or not 0 < dv <= D):
        raise ValueError(f"dv must be an int in [1, Dqk={D}] when v is None, got {dv!r}")
    check_tensor("indices", indices, ndim=(3, 4), dtypes=INT_DTYPES)
    if tuple(indices.shape[:2]) != (B, T) or (indices.dim() == 4 and indices.shape[2] != Hkv):
        raise ValueError(f"indices must be [B={B}, T={T}, K] or [B, T, Hkv={Hkv}, K], got "
                         f"{tuple(indices.shape)}")
    if sink is not None:
        check_tensor("sink", sink, ndim=1, dtypes=FLOAT_DTYPES)
        if sink.shape[0] != Hq:
            raise ValueError(f"sink must be [Hq={Hq}], got {tuple(sink.shape)}")
    scale = check_softmax_scale(softmax_scale)
    check_same_device(q=q, k=k, v=v, indices=indices, sink=sink, prefix_lengths=prefix_lengths)
    if prefix_lengths is not None:
        check_prefix_lengths(prefix_lengths, indices, B, T, S, check_values)
    if not check_values:
        return scale, dv
    check_index_range("indices", indices, S)
    labels = ("batch", "row", "kv head") if indices.dim() == 4 else ("batch", "row")
    check_distinct_indices("indices", indices, labels)
    for name, x in (("q", q), ("k", k), ("v", v), ("sink", sink)):
        if x is not None:
            check_finite(name, x)
    return scale, dv


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    dv: int | None = None,
    sink: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    prefix_lengths: torch.Tensor | None = None,
    backend: str = "auto",
    options: AttentionKernelOptions | None = None,
    check_values: bool = True,
    hytopk_layout: bool = False,
    keys_ascending: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over its selected keys only.

    Args:
        q: [B, T, Hq, Dqk] queries (bf16, fp16 or fp32).
        k: [B, S, Hkv, Dqk] keys, Hkv dividing Hq (MQA: Hkv = 1); same dtype as q.
        v: [B, S, Hkv, Dv] values, or None: V is then the first `dv` channels of K (absorbed
            MLA, where K is the [latent | rope] cache) or all of K when dv is None (shared
            K = V as in DeepSeek-V4).
        indices: int32/int64 [B, T, Hkv, K] per KV head, or [B, T, K] shared by all KV heads;
            key indices in [0, S), distinct within a row, -1 = empty slot (a repeated key
            raises ValueError naming the row, see check_values). Causality is the caller's
            business: whatever is listed is attended.
        softmax_scale: > 0, multiplies q . k.
        dv: value width when v is None (1 <= dv <= Dqk).
        sink: [Hq] per-head logit added to each softmax denominator only (no value).
        return_lse: also return the log-sum-exp.
        deterministic: Triton backward without fp32 atomics (bitwise repeatable; about 2-3x
            the backward time). The reference is always deterministic.
        prefix_lengths: int [B, T] or None. Row (b, t) also attends to the keys
            0 .. prefix_lengths[b, t] - 1 (shared by all KV heads), before its listed indices,
            which must not repeat them. The kernels (Triton's; on Hopper the Gluon ones) generate
            these slots instead of reading them (DeepSeek-V4's HCA: every visible compressed
            entry, then the window),
            so no [T, S] index tensor exists and each row runs only its own slots.
        backend: "auto" (Triton on CUDA tensors, the reference elsewhere), "triton" (CPU
            tensors need TRITON_INTERPRET=1, else ValueError) or "reference". On Hopper the
            forward of absorbed MLA (GLM-5.1, V3.2) runs a Gluon kernel under either GPU choice
            (`AttentionKernelOptions.fwd_sm90`). "cudnn": FlashMLA's SM90 forward and
            cuDNN-frontend's SM90 backward (the stock cudnn backend's kernels; one KV head, v
            None, 512 value channels, 576 or 512 key channels, bf16, not deterministic;
            elsewhere FlashMLA's forward with HyScale's backward where the forward can run
            (deterministic, say), else HyScale's kernels, one warning naming why); "best":
            the fastest of those two pairs and FlashMLA's forward with HyScale's backward, as
            measured for this shape (`ops/backends/measured.py`), said once.
        options: the kernels' variants and tilings (`AttentionKernelOptions`; None: its
            DEFAULT), forward and backward; the reference ignores it.
        check_values: True (default) checks the values (a host sync each): finite inputs,
            indices in [-1, S) and distinct within a row (a sort on their device),
            prefix_lengths in [0, S] and not repeated by indices. False trusts the caller
            and syncs nothing (the layers pass False: their indices are distinct by
            construction); a broken promise gives undefined results. Shapes, dtypes and
            devices are always checked.
        hytopk_layout: the indices are HyTopK's causal output (each row's valid slots
            first, at least one per row), so the library kernels skip their layout tests
            and the host syncs they cost (the DSA layer passes True).
        keys_ascending: each row's valid indices increase, -1 slots anywhere (`ops.hytopk(
            order="key")`, the DSA layer's selection): HyScale's lockstep kernels
            (`AttentionKernelOptions.bwd_lockstep`) then skip their own sort of the rows, its
            int64 permutation and the indexer target's second buffer. Only their pace depends
            on it: rows in another order give the same results, more slowly.

    Returns:
        out [B, T, Hq, Dv] in q's dtype (zeros for a row with no valid index), and with
        return_lse the fp32 [B, T, Hq] natural log of each softmax denominator including the
        sink (-inf for a row with no valid index and no sink).

    Differentiable in q, k, v and sink; an empty row has zero (not NaN) gradients.
    """
    check_backend(backend, BACKEND_CHOICES)
    options = check_options("options", options, AttentionKernelOptions)
    check_bool("check_values", check_values)
    check_bool("hytopk_layout", hytopk_layout)
    check_bool("keys_ascending", keys_ascending)
    scale, dv = validate_sparse_attention_inputs(q, k, v, indices, softmax_scale, dv, sink,
                                                 prefix_lengths, check_values)
    check_triton_device(backend, q)
    if backend in LIBRARY_BACKENDS:
        plan = dispatch.attention_plan(q, k, v, indices, backend=backend, dv=dv, sink=sink,
                                       deterministic=deterministic,
                                       prefix_lengths=prefix_lengths)
        got = dispatch.attention(q, k, v, indices, scale, plan=plan, sink=sink,
                                 hytopk_layout=hytopk_layout)
        if got is not None:
            return got if return_lse else got[0]
        if plan == measured.FLASHMLA_FORWARD:
            options = dataclasses.replace(options, fwd_flashmla=True)
        backend = "auto"
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from megatron_hyscale.ops.kernels.sparse_attention import sparse_attention_triton

        return sparse_attention_triton(q, k, v, indices, scale, dv=dv, sink=sink,
                                       return_lse=return_lse, deterministic=deterministic,
                                       prefix_lengths=prefix_lengths, options=options,
                                       hytopk_layout=hytopk_layout,
                                       keys_ascending=keys_ascending)
    out, lse = reference.sparse_attention_reference(q, k, v, indices, scale, dv=dv, sink=sink,
                                                    prefix_lengths=prefix_lengths)
    return (out, lse) if return_lse else out

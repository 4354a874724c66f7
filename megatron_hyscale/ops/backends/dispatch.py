"""The ops' `backend="cudnn"` and `backend="best"`: run a library kernel, or say why not.

"cudnn" asks for the library kernel: where it cannot run the call, one warning names why and
HyScale's own kernel runs. "best" takes whichever of the two was measured faster for the op
and shape (`measured.faster_backend`) when the library can run the call, and says once which
it took and why. Each function returns the library's result, or None for "run your own".
"""

from __future__ import annotations

import sys

from megatron_hyscale.ops.backends import measured
from megatron_hyscale.ops.backends.availability import CUDNN, FLASHMLA, library_unavailable
from megatron_hyscale.ops.checks import warn_once

LIBRARY_BACKENDS = ("cudnn", "best")
BACKEND_CHOICES = ("auto", "triton", "reference", *LIBRARY_BACKENDS)
_announced: set[tuple] = set()


def announce_once(key: tuple, message: str) -> None:
    """Print which kernel an op runs, once per (op, shape, choice): users compare runs."""
    if key not in _announced:
        _announced.add(key)
        print(f"[hyscale] {message}", file=sys.stderr, flush=True)


def _use_library(backend: str, op: str, shape: str, T: int, reason: str | None) -> bool:
    if backend == "best" and library_unavailable(CUDNN):
        return False  # an optional extra not installed: nothing to choose between
    if reason:
        if backend == "cudnn":
            warn_once(f"{op}-cudnn:{reason}", f"{op}: backend='cudnn' cannot run this call "
                      f"({reason}); running HyScale's kernel")
        else:
            announce_once((op, shape, "own", reason), f"{op} {shape}: HyScale's kernel "
                          f"(the library cannot run it: {reason})")
        return False
    if backend == "cudnn":
        return True
    pick, why = measured.faster_backend(op, shape, T)
    announce_once((op, shape, pick), f"{op} {shape}: "
                  f"{'cuDNN/FlashMLA' if pick == measured.LIBRARY else 'HyScale'}'s kernel ({why})")
    return pick == measured.LIBRARY


# The positions the ops default to are known on the host: q_start (queries at
# arange(T) + q_start) and kpos None (keys at 0 .. S-1) spare the backends reading them back.


def selection(q, k, weights, topk, *, backend, relu, causal, qpos, kpos, ordered, q_start=None,
              precision="bf16"):
    from megatron_hyscale.ops.backends.cudnn_selection import (
        cudnn_selection,
        cudnn_selection_unsupported,
    )

    reason = cudnn_selection_unsupported(q, k, weights, relu=relu, causal=causal, kpos=kpos)
    if reason is None and precision != "bf16":
        reason = f"precision={precision!r}: cuDNN's SM90 indexer scores bf16 q and k"
    shape = measured.selection_shape(q.shape[2], q.shape[3], topk)
    if not _use_library(backend, "selection", shape, q.shape[1], reason):
        return None
    return cudnn_selection(q, k, weights, topk, qpos=qpos, ordered=ordered, q_start=q_start)


def attention_plan(q, k, v, indices, *, backend, dv, sink, deterministic, prefix_lengths,
                   library_backward: bool = True) -> str:
    """Which kernels `ops.sparse_attention` runs for this call (said once per shape and
    choice): `measured.LIBRARY_PAIR` (FlashMLA's forward, cuDNN's backward), `measured.
    FLASHMLA_FORWARD` (FlashMLA's forward, HyScale's backward) or `measured.OWN_PAIR`.
    "cudnn" takes the library pair where it runs, else FlashMLA's forward where that runs
    (one warning names why each time the pair cannot); "best" the fastest that can run, as
    measured (`measured.attention_plan`). library_backward=False: a call whose backward must be
    HyScale's (it emits the indexer loss's target)."""
    if backend not in LIBRARY_BACKENDS:
        return measured.OWN_PAIR
    if backend == "best" and library_unavailable(FLASHMLA):
        return measured.OWN_PAIR  # an optional extra not installed: nothing to choose between
    from megatron_hyscale.ops.backends.library_attention import (
        cudnn_backward_unsupported,
        flashmla_forward_unsupported,
    )

    fwd_reason = flashmla_forward_unsupported(q, k, v, indices, dv,
                                              prefix_lengths=prefix_lengths)
    pair_reason = fwd_reason or cudnn_backward_unsupported(q.device,
                                                           deterministic=deterministic)
    if pair_reason is None and not library_backward:
        pair_reason = "the call's backward emits the indexer loss's target (HyScale's kernel)"
    shape = measured.attention_shape(q.shape[2], q.shape[3], dv or q.shape[3], sink is not None)
    if backend == "cudnn":
        if pair_reason is None:
            return measured.LIBRARY_PAIR
        if fwd_reason is None:
            warn_once(f"attention-cudnn:{pair_reason}", "attention: backend='cudnn' cannot run "
                      f"cuDNN's backward here ({pair_reason}); running FlashMLA's forward and "
                      "HyScale's backward")
            return measured.FLASHMLA_FORWARD
        warn_once(f"attention-cudnn:{fwd_reason}", "attention: backend='cudnn' cannot run this "
                  f"call ({fwd_reason}); running HyScale's kernel")
        return measured.OWN_PAIR
    allowed = [measured.OWN_PAIR]
    if fwd_reason is None:
        allowed.append(measured.FLASHMLA_FORWARD)
    if pair_reason is None:
        allowed.append(measured.LIBRARY_PAIR)
    if fwd_reason:
        announce_once(("attention", shape, "own", fwd_reason), f"attention {shape}: "
                      f"HyScale's kernels (the library cannot run it: {fwd_reason})")
        return measured.OWN_PAIR
    plan, why = measured.attention_plan(shape, q.shape[1], tuple(allowed))
    announce_once(("attention", shape, plan), f"attention {shape}: "
                  f"{measured.PLAN_NAMES[plan]} ({why})")
    return plan


def attention_uses_library(q, k, v, indices, *, backend, dv, sink, deterministic,
                           prefix_lengths) -> bool:
    """Whether `attention` runs the library pair for this call (whose backward emits no
    indexer target); said once, as there."""
    return attention_plan(q, k, v, indices, backend=backend, dv=dv, sink=sink,
                          deterministic=deterministic,
                          prefix_lengths=prefix_lengths) == measured.LIBRARY_PAIR


def attention(q, k, v, indices, scale, *, plan, sink, hytopk_layout=False):
    """(out, lse) on FlashMLA + cuDNN where `plan` (`attention_plan`'s) is the library pair,
    else None."""
    if plan != measured.LIBRARY_PAIR:
        return None
    from megatron_hyscale.ops.backends.library_attention import library_attention

    return library_attention(q, k, indices, scale, sink=sink, hytopk_layout=hytopk_layout)


def indexer_loss(q_index, weights, k_index, query, key, topk_indices, scale, coeff, *, backend,
                 sparse, relu, qpos, kpos, per_token, tp_group, attention_lse, deterministic,
                 hytopk_layout=False, row_mask=False):
    from megatron_hyscale.ops.backends.cudnn_indexer_loss import (
        cudnn_indexer_loss,
        cudnn_indexer_loss_unsupported,
    )

    reason = cudnn_indexer_loss_unsupported(q_index, weights, query, key, sparse=sparse,
                                            relu=relu, kpos=kpos, attention_lse=attention_lse)
    if reason is None and row_mask:
        reason = ("a query row mask (query_valid_rows): cuDNN's indexer kernels weigh every "
                  "row")
    if reason is None and deterministic:
        reason = "cuDNN's SM90 indexer backward has no deterministic mode"
    if reason is None and backend == "best" and attention_lse is None:
        # Only with the attention's lse are the slots known to be distinct and visible (the
        # op's contract counts a repeated index once; the library would count it twice).
        reason = "no attention_lse: the slots may repeat"
    shape = measured.loss_shape(query.shape[2], query.shape[3], q_index.shape[2])
    if not _use_library(backend, "indexer_loss", shape, q_index.shape[1], reason):
        return None
    return cudnn_indexer_loss(q_index, weights, k_index, query, key, topk_indices, scale, coeff,
                              qpos=qpos, calculate_per_token_loss=per_token, tp_group=tp_group,
                              attention_lse=attention_lse, hytopk_layout=hytopk_layout)


"""HyTopK: exact top-k over lightning-indexer scores, without a score table.

score[b, t, s] = sum_h weights[b, t, h] * act(q[b, t, h] . k[b, s]) (fp32 accumulation),
act = ReLU or identity. precision="fp8" scores e4m3 copies of q and k with per-token scales
(`fp8_quant`) instead. Key s is visible to query t iff k_positions[s] <= q_positions[t]
(when causal) and, given an explicit mask `visible`, where it is True. Each row keeps the top-k
visible keys under the total order (score descending, then key index ascending); -0.0 and
+0.0 tie.
"""

from __future__ import annotations

import torch

from megatron_hyscale.ops import fp8_quant, reference
from megatron_hyscale.ops.backends import dispatch
from megatron_hyscale.ops.backends.dispatch import BACKEND_CHOICES, LIBRARY_BACKENDS
from megatron_hyscale.ops.checks import (
    FLOAT_DTYPES,
    check_backend,
    check_bool,
    check_finite,
    check_options,
    check_positive_int,
    check_same_device,
    check_tensor,
    check_triton_device,
    normalize_positions,
    normalize_visible,
    warn_once,
)
from megatron_hyscale.ops.kernels.options import HyTopKOptions
from megatron_hyscale.ops.key_order import sort_rows_by_key

ORDERS = ("score", "key", "any")


def validate_hytopk_inputs(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int,
    q_positions: torch.Tensor | None, k_positions: torch.Tensor | None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check shapes, dtypes, devices (and values unless `check_values` is False); return
    [B, T] / [B, S] int64 positions."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("weights", weights, ndim=3, dtypes=FLOAT_DTYPES)
    check_positive_int("topk", topk)
    B, T, H, D = q.shape
    if k.shape[0] != B or k.shape[2] != D:
        raise ValueError(f"k must be [B={B}, S, D={D}], got {tuple(k.shape)}")
    if tuple(weights.shape) != (B, T, H):
        raise ValueError(f"weights must be [B={B}, T={T}, H={H}], got {tuple(weights.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} must match q dtype {q.dtype}")
    check_same_device(q=q, k=k, weights=weights)
    if check_values:
        for name, x in (("q", q), ("k", k), ("weights", weights)):
            check_finite(name, x)
    S = k.shape[1]
    qpos = normalize_positions("q_positions", q_positions, B, T, S - T, q.device)
    kpos = normalize_positions("k_positions", k_positions, B, S, 0, q.device)
    return qpos, kpos


def hytopk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    relu: bool = True,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    causal: bool = True,
    visible: torch.Tensor | None = None,
    backend: str = "auto",
    order: str = "score",
    options: HyTopKOptions | None = None,
    check_values: bool = True,
    precision: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of indexer scores per query row.

    Args:
        q: [B, T, H, D] indexer queries (bf16, fp16 or fp32).
        k: [B, S, D] indexer keys (same dtype as q).
        weights: [B, T, H] per-head weights (any float dtype; used in fp32).
        topk: keys kept per row (> 0; may exceed the number of visible keys).
        relu: apply ReLU to each head's logit before weighting.
        q_positions, k_positions: [T] / [S] or per batch [B, T] / [B, S] integer positions;
            default k_positions = arange(S), q_positions = arange(T) + (S - T).
        causal: when False every key is visible (to the position rule).
        visible: bool [T, S], [1, T, S] or [B, T, S], or None: an explicit mask, True where
            row t may select key s (megatron's attention_mask with attn_mask_type=None, negated),
            on top of the position rule when causal. The plain-torch reference runs it (row
            chunks of the score table, bounded memory, the same total order): a mask is
            O(T * S) anyway. backend "auto", "best" and "reference" take it; "triton" and
            "cudnn" raise ValueError (their kernels read positions, not a mask).
        backend: "auto" (Triton on CUDA, reference elsewhere), "triton", "reference",
            "cudnn" (cuDNN-frontend's SM90 score chunks + radix top-k, the stock cudnn
            backend's kernels: `pip install megatron-hyscale[cudnn]`; bf16, ReLU, causal, keys
            at 0 .. S-1; elsewhere one warning names why and HyTopK runs) or "best" (whichever
            of HyTopK and cuDNN was measured faster for this shape: ops/backends/measured.py;
            it says once which it runs).
        order: each row's top-k set (the -1 slots last in every order) in "score" order
            (descending score, ties to the smaller index: the total order), "key" order
            (increasing key index: what HyScale's lockstep attention kernels pace by, so
            they need no sort of their own, `ops/key_order.py`; the DSA layer's) or "any"
            (the Triton backend skips its final per-row sort: QSA at 512K tokens, 43 of 460
            ms; for consumers that need the set only).
        options: the kernels' variant and tiling (`HyTopKOptions`; None: its DEFAULT, which
            on Hopper runs the Gluon scores' selection from `scores_sm90_min_keys` keys (16K;
            without ReLU `scores_sm90_folded_min_keys`, 16K), `scores_sm90`, and the Triton
            kernel elsewhere). Every variant returns the same outputs (but the Gluon path:
            exact for its kernel's fp32 scores, whose sums near-tied bf16 scores may order
            otherwise than the Triton kernel's); the reference ignores it.
        check_values: True (default) checks that q, k and weights are finite (a host sync
            each). False trusts the caller and syncs nothing for the check (the layers pass
            False): a NaN or Inf then gives an undefined selection and a NaN attention
            downstream, which Megatron's loss check reports, as with stock. Shapes, dtypes and
            devices are always checked. The Gluon-scores path (the default on Hopper from
            16K keys) syncs once a call itself (whether any row is redone; one more a batch
            with rows to redo), and steps aside while a CUDA graph is captured.
        precision: "bf16" (default) scores q and k as given (bf16, fp16 or fp32). "fp8"
            scores their e4m3 copies with per-token power-of-two scales (q per token and head,
            k per token: DeepSeek-V3.2's inference indexer, `ops/fp8_quant.py`), with fp32
            accumulation: the outputs are those of the bf16 path on the dequantized q and k
            (the reference runs exactly that; the Triton kernel runs fp8 tensor-core products,
            exact on integer-valued inputs; so does the Gluon path, options.scores_sm90).
            relu=False folds the heads into one fp32 query, so its kernel scores the
            dequantized values. Neither the cuDNN backend nor
            options.prune takes fp8: "cudnn" warns once and runs HyScale's kernel, prune raises.

    Returns:
        indices: int32 [B, T, topk] in `order`; -1 past the visible keys.
        scores: fp32 [B, T, topk] aligned with indices; -inf at -1 slots.

    Raises:
        ValueError naming the argument: wrong shapes, dtypes or devices; topk <= 0; backend="triton"
        on CPU tensors without TRITON_INTERPRET=1; NaN or Inf in q, k or weights (one host sync over
        the inputs; not with check_values=False). Stock megatron-core 0.19.2 (`fused_qk_topk_naive`)
        checks nothing: torch.topk ranks NaN above every score, so a NaN key is picked by every row,
        past the causal mask too (NaN + -inf is NaN), and the NaN reaches the losses; Megatron-LM's
        training loop stops on it one forward and backward later (`check_for_nan_in_loss_and_grad`,
        on by default) without saying where. HyScale's layers pass check_values=False (no host sync
        in the hot path), so in training a non-finite indexer activation reaches the losses as with
        stock and the same check stops the run; a direct call with the default names the tensor.
    """
    check_backend(backend, BACKEND_CHOICES)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    options = check_options("options", options, HyTopKOptions)
    check_bool("check_values", check_values)
    fp8 = fp8_quant.check_precision(precision) == "fp8"
    if fp8 and options.prune:
        raise ValueError("options.prune is not supported with precision='fp8': its score bound "
                         "assumes the bf16 kernel's products and one scale for every key")
    qpos, kpos = validate_hytopk_inputs(q, k, weights, topk, q_positions, k_positions,
                                        check_values)
    visible = normalize_visible("visible", visible, q.shape[0], q.shape[1], k.shape[1],
                                q.device)
    if visible is not None:
        if backend in ("triton", "cudnn"):
            raise ValueError(f"visible (an explicit key mask) runs on the plain-torch reference; "
                             f"backend={backend!r} cannot take it: use 'auto' or 'reference'")
        backend = "reference"
    check_triton_device(backend, q)
    if backend in LIBRARY_BACKENDS:
        got = dispatch.selection(
            q, k, weights, topk, backend=backend, relu=relu, causal=causal, qpos=qpos,
            kpos=None if k_positions is None else kpos, ordered=order == "score",
            q_start=k.shape[1] - q.shape[1] if q_positions is None else None,
            precision=precision)
        if got is not None:
            return _in_order(got, order)
        backend = "auto"
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda)
    q_scale = k_scale = None
    if fp8:
        q, q_scale, k, k_scale = fp8_quant.quantize_indexer(q, k)
    if use_triton:
        try:
            from megatron_hyscale.ops.kernels import hytopk as hytopk_kernel
        except ImportError as err:  # the kernel module is optional until Triton is importable
            if backend == "triton":
                raise
            warn_once("hytopk-import", f"HyTopK Triton kernel unavailable ({err}); using the "
                      "reference path")
        else:
            if options.scores_sm90 is not False:
                got = _from_sm90_scores(q, k, weights, topk, relu=relu, causal=causal,
                                        default_positions=q_positions is None
                                        and k_positions is None, precision=precision,
                                        options=options, order=order, q_scale=q_scale,
                                        k_scale=k_scale)
                if got is not None:
                    return got
            return hytopk_kernel.hytopk_triton(
                q, k, weights, topk, relu=relu, q_positions=qpos, k_positions=kpos,
                causal=causal, ordered=order != "any", options=options, q_scale=q_scale,
                k_scale=k_scale, key_order=order == "key",
            )
    if fp8:  # the reference on the same quantized inputs, dequantized exactly in fp32
        q, k = fp8_quant.dequantize(q, q_scale), fp8_quant.dequantize(k, k_scale)
    return _in_order(reference.hytopk_reference(
        q, k, weights, topk, relu=relu, q_positions=qpos, k_positions=kpos, causal=causal,
        visible=visible,
    ), order)


def _from_sm90_scores(q, k, weights, topk, *, relu, causal, default_positions, precision,
                      options, order, q_scale=None, k_scale=None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`options.scores_sm90`'s selection (`kernels/hytopk_sm90.py`, in `order`; e4m3 q and k
    with their scales under precision "fp8"; relu=False: the folded query's parts), or None
    when it does not run this call (the Triton kernel then runs): asked for (True), after one
    warning naming why; by default (None), for rows shorter than
    options.scores_sm90_min_keys (without ReLU: options.scores_sm90_folded_min_keys, None:
    never), while a CUDA graph is captured, or where it cannot run, without one."""
    from megatron_hyscale.ops.kernels import hytopk_sm90

    asked = options.scores_sm90 is True
    min_keys = options.scores_sm90_min_keys if relu else options.scores_sm90_folded_min_keys
    if not asked and (min_keys is None or k.shape[1] < min_keys or _capturing_graph(q)):
        # a CUDA graph cannot hold the path's host sync (whether rows are redone)
        return None
    reason = hytopk_sm90.unsupported(q, k, weights, relu=relu, causal=causal,
                                     default_positions=default_positions,
                                     precision=precision, options=options, k_scale=k_scale)
    if reason is not None:
        if asked:
            hytopk_sm90.VARIANTS.warn_cannot_run(reason)
        return None
    # relu=False runs one kernel variant whatever the head count (the folded query's parts);
    # the transposed head sum (ReLU only) is a variant of its own
    variant = (q.shape[2] if relu else "folded", topk, precision,
               relu and options.scores_sm90_head_sum_transpose)
    if variant in hytopk_sm90.VARIANTS.disabled:
        return None
    try:
        return hytopk_sm90.hytopk_sm90(q, k, weights.float().contiguous(), topk,
                                       options=options, order=order, q_scale=q_scale,
                                       k_scale=k_scale, relu=relu)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # a compile or launch failure of the Gluon kernel: said once
        hytopk_sm90.VARIANTS.disable(variant, f"{type(err).__name__}: {err}")
        return None


def _capturing_graph(t: torch.Tensor) -> bool:
    """Whether t's CUDA stream is capturing a graph (False off CUDA: asking there fails on a
    machine without a driver)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _in_order(result: tuple[torch.Tensor, torch.Tensor], order: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's and the library's rows (score order, or any order with the -1 slots
    last) in `order` (HyScale's kernel sorts them itself)."""
    if order == "key":
        result = (result[0].contiguous(), result[1].contiguous())
        sort_rows_by_key(*result)
    return result

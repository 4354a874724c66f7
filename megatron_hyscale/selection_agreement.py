"""HyScale's top-k beside stock megatron-core's on the same weights and batch, during a run.

Enabled by HYSCALE_SELECTION_AGREEMENT=N in a Megatron-LM run of HyScale's DSA spec
(`--spec megatron_hyscale.specs hyscale_dsa_layer_spec`; `python -m megatron_hyscale.evaluate`
sets it). Why inside the training run: two runs drift apart once training amplifies rounding,
so their selections cannot be compared step by step; the same layer's indexer on the same
weights and batch can. At iteration 1 and every N iterations after it, each HyScale DSA
layer's first forward of that iteration (not the recompute, not a later micro-batch) also:

- computes the indexer's q, k and head weights from its inputs (`indexer.forward_before_topk`,
  no gradient, nothing recorded for replay);
- selects with HyScale's op (`ops.hytopk`, the layer's kernel backend) and with stock's
  (`fused_qk_topk_naive` of megatron-core's dsa module, a causal additive mask) for a sample of
  query rows (HYSCALE_SELECTION_AGREEMENT_ROWS, default 256, evenly spaced over the rows that
  see more keys than the top-k: below that both keep every visible key);
- prints one line per layer, which `launch.logparse.selection_agreement` reads back:

    [hyscale agreement] rank 0 step 5 layer 1: jaccard 0.998047 score_match 1.000000 rows 256

  jaccard: |A & B| / |A | B| of the two index sets, mean over rows and batch; score_match: the
  share of rows whose two selections hold the same multiset of stock's fp32 scores (to 1e-6
  relative), i.e. both are an exact top-k and differ only where scores tie.

Stock's naive selection is what its `none` backend runs and the semantics its tilelang and
cudnn backends reproduce; over a row sample its [b, rows, T] score table stays small at long
context. Not measured (warned once, naming why): context parallelism (each rank holds a key
shard), packed THD sequences, and index-sharing layers (they reuse another layer's selection).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_hyscale.launch.logparse import AGREEMENT_ENV as ENV
from megatron_hyscale.launch.logparse import AGREEMENT_LINE_PREFIX as LINE_PREFIX
from megatron_hyscale.launch.logparse import AGREEMENT_ROWS_ENV as ROWS_ENV
from megatron_hyscale.ops.checks import warn_once

DEFAULT_ROWS = 256
SCORE_RTOL = 1e-6


def interval_from_env() -> int | None:
    """N of HYSCALE_SELECTION_AGREEMENT=N (None when unset or 0); a bad value is an error."""
    text = os.environ.get(ENV, "").strip()
    if not text or text == "0":
        return None
    if not text.isdigit():
        raise ValueError(f"{ENV} must be a positive integer (measure every N iterations), "
                         f"got {text!r}")
    return int(text)


def rows_from_env() -> int:
    text = os.environ.get(ROWS_ENV, "").strip()
    if not text:
        return DEFAULT_ROWS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{ROWS_ENV} must be a positive integer (query rows sampled), got "
                         f"{text!r}")
    return int(text)


def sample_rows(seq: int, topk: int, n: int, device: torch.device | str) -> torch.Tensor:
    """int64 row positions: up to n evenly spaced over [topk, seq) (rows with more visible keys
    than the top-k); all rows when none sees more."""
    lo = topk if seq > topk else 0
    rows = torch.linspace(lo, seq - 1, min(n, seq - lo), device=device).round().long()
    return torch.unique(rows)


def jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row |A & B| / |A | B| of two index sets [..., k] (-1 slots ignored); fp32 [...]."""
    a, b = a.long(), b.long()
    valid_a, valid_b = a >= 0, b >= 0
    hit = ((a[..., :, None] == b[..., None, :]) & valid_a[..., :, None]
           & valid_b[..., None, :]).any(-1)
    inter = hit.sum(-1).float()
    union = valid_a.sum(-1).float() + valid_b.sum(-1).float() - inter
    return torch.where(union > 0, inter / union.clamp_min(1.0), torch.ones_like(union))


def same_scores(scores: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                rtol: float = SCORE_RTOL) -> torch.Tensor:
    """Per row: whether the two selections hold the same sorted scores (bool [...]).
    scores [..., S] fp32; a, b [..., k] indices (-1: empty, scored -inf)."""
    def picked(idx: torch.Tensor) -> torch.Tensor:
        got = scores.gather(-1, idx.long().clamp_min(0))
        got = torch.where(idx >= 0, got, torch.full_like(got, float("-inf")))
        return got.sort(-1, descending=True).values

    sa, sb = picked(a), picked(b)
    both_inf = torch.isinf(sa) & torch.isinf(sb) & (sa == sb)
    close = (sa - sb).abs() <= rtol * torch.maximum(sa.abs(), sb.abs()).clamp_min(1e-30)
    return (close | both_inf).all(-1)


def stock_topk(q_rows: torch.Tensor, k: torch.Tensor, w_rows: torch.Tensor, topk: int,
               positions: torch.Tensor, *, relu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's stock selection (`fused_qk_topk_naive`) for some query rows: q_rows
    [rows, b, H, D], k [S, b, D], w_rows [rows, b, H] (megatron's sbhd layout), positions
    int64 [rows] (key s visible iff s <= position). Returns its fp32 scores [b, rows, S] and
    indices [b, rows, topk] (-1 where fewer keys are visible)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        fused_qk_topk_naive,
    )

    seq = k.size(0)
    keys = torch.arange(seq, device=k.device)
    mask = torch.zeros(positions.numel(), seq, device=k.device)
    mask = mask.masked_fill(keys[None, :] > positions[:, None], float("-inf"))
    return fused_qk_topk_naive(q_rows, k, w_rows, topk, mask, use_relu=relu)


def compare_layer(module: Any, x: torch.Tensor, qr: torch.Tensor, rows: int = DEFAULT_ROWS
                  ) -> dict[str, float]:
    """HyScale's and stock's top-k of one DSA core-attention module's indexer on its inputs x
    [sq, b, h] and qr [sq, b, q_lora]: {'jaccard', 'score_match', 'rows'} (means over the
    sampled rows and the batch)."""
    from megatron_hyscale.layers.kernel_backend import kernel_backend
    from megatron_hyscale.ops import hytopk

    config = module.config
    relu = bool(getattr(config, "dsa_indexer_scoring_relu", True))
    topk = int(module.indexer.index_topk)
    with torch.no_grad():
        q, k, w = module.indexer.forward_before_topk(x.detach(), qr.detach())  # sbhd, sbd, sbh
        seq = q.size(0)
        picked = sample_rows(seq, topk, rows, q.device)
        q_rows, w_rows = q.index_select(0, picked), w.index_select(0, picked)
        ours, _ = hytopk(q_rows.transpose(0, 1).float(), k.transpose(0, 1).float(),
                         w_rows.transpose(0, 1).float(), topk, relu=relu, q_positions=picked,
                         backend=kernel_backend(config))
        scores, theirs = stock_topk(q_rows, k, w_rows, topk, picked, relu=relu)
        overlap = jaccard(ours, theirs)
        match = same_scores(scores, ours, theirs).float()
    return {"jaccard": overlap.mean().item(), "score_match": match.mean().item(),
            "rows": int(picked.numel())}


def unsupported_reason(module: Any, kwargs: dict) -> str | None:
    """Why this forward's selection is not measured (None: measure it)."""
    if getattr(module, "skip_topk", False):
        return "an index-sharing layer reuses another layer's selection"
    packed = kwargs.get("packed_seq_params")
    if packed is not None and getattr(packed, "qkv_format", None) == "thd":
        return "packed THD sequences are not measured"
    if getattr(module, "pg_collection", None) is not None:
        cp = getattr(module.pg_collection, "cp", None)
        if cp is not None and cp.size() > 1:
            return "under context parallelism each rank holds only a shard of the keys"
    return None


def iteration_now() -> int | None:
    """Megatron-LM's current iteration (1-based), None outside its training loop."""
    try:
        from megatron.training import get_args

        args = get_args()
    except Exception:  # not a Megatron-LM run, or its globals are not set up
        return None
    current = getattr(args, "curr_iteration", None)
    return None if current is None else int(current) + 1


class AgreementProbe:
    """A forward pre-hook on one HyScale DSA core-attention module (see the module docstring)."""

    def __init__(self, interval: int, rows: int) -> None:
        self.interval, self.rows = interval, rows
        self.done: set[int] = set()  # iterations measured

    def due(self, iteration: int) -> bool:
        return (iteration == 1 or iteration % self.interval == 0) and iteration not in self.done

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        iteration = iteration_now()
        if iteration is None or not module.training or not self.due(iteration):
            return
        if torch._C._current_graph_task_id() != -1:  # the recompute inside backward
            return
        reason = unsupported_reason(module, kwargs)
        if reason is not None:
            warn_once(f"hyscale-agreement:{reason}",
                      f"selection agreement ({ENV}) not measured: {reason}")
            self.done.add(iteration)
            return
        names = ("query", "key", "value", "attention_mask", "x", "qr")
        bound = dict(zip(names, args)) | kwargs
        self.done.add(iteration)
        stats = compare_layer(module, bound["x"], bound["qr"], self.rows)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f"{LINE_PREFIX} rank {rank} step {iteration} layer {module.layer_number}: "
              f"jaccard {stats['jaccard']:.6f} score_match {stats['score_match']:.6f} "
              f"rows {stats['rows']}", flush=True)


def attach_from_env(core_attention: torch.nn.Module) -> bool:
    """With HYSCALE_SELECTION_AGREEMENT=N: hook `core_attention` (a HyScale DSA module) so that
    it prints its agreement with stock every N iterations. Returns whether it was hooked."""
    interval = interval_from_env()
    if interval is None or getattr(core_attention, "indexer", None) is None:
        return False
    core_attention.register_forward_pre_hook(AgreementProbe(interval, rows_from_env()),
                                             with_kwargs=True)
    return True

"""HyTopK from the warp-specialized Gluon indexer scores (Hopper): a sampled threshold, a filter,
an exact select over the survivors (`HyTopKOptions.scores_sm90`).

Shapes: q bf16 [B, T, H, D] (D = 128, H = 32 or 64), k bf16 [B, T, D] (S == T, causal, key s
visible to row t iff s <= t), w fp32 [B, T, H], ReLU; or e4m3 q and k with their fp32 scales
q_scale [B, T, H] and k_scale [B, T] (HyTopK's precision="fp8", `ops/fp8_quant.py`: the
Gluon kernels' fp8 products, the sample on the Gluon table); or without ReLU, bf16 q with any
head count, folded into one fp32 query a row and scored as its bf16 parts (`folded_parts`).
Returns HyTopK's outputs: indices int32
[B, T, topk] and scores fp32 [B, T, topk], each row's top-k in `ops.hytopk`'s orders ("score":
descending score, ties to the smaller index; "key": increasing index; "any"), -1 / -inf past
the visible keys and last.

Algorithm: (1) every `stride`-th key is scored for every row (HyTopK's score-table kernel over
those keys, or the Gluon kernel's table epilogue: `scores_sm90_sample_table`): a row's
threshold is the sample score ranked where SURVIVOR_MARGIN x topk of its visible keys would
rank (picked as `scores_sm90_sample_pick` says; the stride shrinks with S so that this rank
stays near `scores_sm90_sample_min_rank`, and a row seeing at most the cap's keys keeps them
all); (2) `indexer_filter_sm90` appends each row's
scores at or above its threshold as packed int64 keys (score, then the smaller index), at most
`survivor_cap(topk)` a row; (3) each row's top-k of its survivors (`select_survivors`: HyTopK's
radix select and row sort on the packed keys, in the caller's order). A row with fewer
survivors than min(topk, visible keys), or more than the cap (a threshold off its quantile,
ties at it), is redone by the Triton kernel: the result is exact whatever the sample, for the
scores each row was selected on (the Gluon kernel's fp32 sums, the Triton kernel's for a redone
row: equal on integer-valued inputs; near-ties of bf16 inputs may order differently from the
default kernel's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from megatron_hyscale.ops.checks import KernelVariants
from megatron_hyscale.ops.kernels import hytopk as hk
from megatron_hyscale.ops.kernels import row_rank, survivor_select
from megatron_hyscale.ops.kernels.common import on_hopper
from megatron_hyscale.ops.kernels.options import HyTopKOptions

# Survivors aimed at, in units of topk: the sample's quantile error must rarely push the count
# below topk (a redo) or above the cap.
SURVIVOR_MARGIN = 1.5
# Heads the Gluon kernels take the folded (relu=False) query as: its three bf16 parts and a zero
# one (`indexer_scores_sm90.FOLDED_HEADS`, not imported here: Gluon loads on first use).
FOLDED_GLUON_HEADS = 4
# Survivor slots a row, in units of topk.
CAP_FACTOR = 2
# Bytes of the survivor buffer a chunk of rows (plus torch.topk's temporaries of that size).
CHUNK_BYTES = 512 << 20
# Rows a chunk of the sample's score table (fp32 [rows, samples]), at most; fewer where the
# sample is wide (`scores_sm90_sample_min_rank` at long S), so a chunk stays within
# SAMPLE_CHUNK_BYTES, in multiples of SAMPLE_ROW_QUANTUM (whole row tiles of both tables).
SAMPLE_CHUNK_ROWS = 8192
SAMPLE_CHUNK_BYTES = 512 << 20
SAMPLE_ROW_QUANTUM = 1024
# The rows redone by the Triton kernel go in multiples of this (the last one repeated): its
# launch takes the row count and the row blocks as integer arguments, which Triton
# specializes (== 1, divisible by 16), so a count that changes every call would compile
# another kernel on some calls (15 s a step at V3.2 64K, 2026-12-05). 256 rows are a multiple
# of 16 row blocks for every head count the Gluon scores take.
REDO_ROWS_MULTIPLE = 256

# Why a call cannot run here (one warning a cause), and the (heads, topk) variants whose
# kernels failed to compile or launch in this process (refused after one warning): the Triton
# kernel runs instead (`ops.hytopk`).
VARIANTS = KernelVariants("hytopk-scores-sm90", "HyTopK on the Gluon scores (scores_sm90)",
                        "Triton kernel")

# The Gluon sample table's (`scores_sm90_sample_table`) (head count, part-major, transposed head
# sum) variants that failed to compile or launch in this process (one warning): their sample
# runs on the Triton score-table kernel.
TABLE_VARIANTS = KernelVariants("hytopk-sample-table",
                                "Gluon sample table (scores_sm90_sample_table)",
                                "Triton score-table kernel")

# (q, k, w, tau, t_lo, t_hi, cap, *, relu[, k_scale]) -> (keys, counts): `indexer_filter_sm90`'s
# contract. With relu=False, q may be stored part-major (`folded_parts`; the default filter is
# told so, an injected one reads q's strides).
FilterFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (keys, counts, topk, *, order, options) -> (indices, scores): `select_survivors`' contract.
SelectFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (q, k_sampled, w, key_stride, t_lo, t_hi, *, relu[, k_scale]) -> fp32 [B, t_hi - t_lo,
# samples], -inf where a row does not see the key: `indexer_scores_sm90.indexer_table_sm90`'s
# contract.
TableFn = Callable[..., torch.Tensor]


def survivor_cap(topk: int) -> int:
    return CAP_FACTOR * topk


def row_chunks(B: int, T: int, topk: int) -> list[tuple[int, int]]:
    """The [t0, t1) row chunks of the survivor buffers (CHUNK_BYTES each)."""
    step = max(1, CHUNK_BYTES // (8 * survivor_cap(topk) * B))
    return [(t0, min(t0 + step, T)) for t0 in range(0, T, step)]


def unsupported(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *, relu: bool,
                causal: bool, default_positions: bool, precision: str,
                options: HyTopKOptions, k_scale: torch.Tensor | None = None) -> str | None:
    """None when `hytopk_sm90` can run this call, else why not (precision "fp8": q and k
    e4m3, k_scale their keys' scales)."""
    samples = options.scores_sm90_samples
    if isinstance(samples, bool) or not (isinstance(samples, int) and samples >= 1):
        raise ValueError(f"options.scores_sm90_samples must be an int >= 1, got {samples!r}")
    if not on_hopper(q):
        return "the Gluon scores need a Hopper (sm_90) GPU"
    if options.scores_sm90_sample_pick == "radix" and samples > row_rank.MAX_COLUMNS:
        raise ValueError(f"options.scores_sm90_samples = {samples} is over the "
                         f"{row_rank.MAX_COLUMNS} sampled keys a row that "
                         f"scores_sm90_sample_pick='radix' holds; use 'topk' or fewer samples")
    want = torch.float8_e4m3fn if precision == "fp8" else torch.bfloat16
    if q.dtype != want or k.dtype != want:
        return (f"the Gluon scores take {precision} q and k as {want} (got {q.dtype}, "
                f"{k.dtype})")
    if not (causal and default_positions):
        return "the Gluon scores take causal rows at the default positions"
    if not relu and precision == "fp8":
        return "without ReLU the fp8 query folds into fp32 (the Triton kernel's dequantized path)"
    if not relu and not options.folded_parts:
        return ("options.folded_parts=False asks for the Triton kernel's fp32 folded query "
                "(the Gluon kernels take its bf16 parts)")
    if options.prune:
        return "options.prune bounds the Triton kernel's scores"
    if precision == "fp8" and options.fp8_imprecise_acc is not None:
        return ("options.fp8_imprecise_acc sets the Triton kernel's fp8 accumulation (the "
                "Gluon kernel's wgmma takes Hopper's default)")
    B, T, H, D = q.shape
    if k.shape[1] != T:
        return f"the Gluon scores take S == T (got S = {k.shape[1]}, T = {T})"
    try:
        from megatron_hyscale.ops.kernels.indexer_scores_sm90 import (
            HEAD_DIM,
            HEADS,
            check_inputs,
            check_keys,
        )
    except ImportError as err:  # a Triton without Gluon's Hopper API
        return f"the Gluon kernels do not import ({err})"

    if not relu:  # any head count: the heads fold into one query (`folded_parts`)
        if D != HEAD_DIM:
            return f"the Gluon scores take a head dim of {HEAD_DIM} (got {D})"
        try:  # the keys as TMA reads them; the folded parts are built packed
            check_keys(k, (B, T, D))
        except ValueError as err:
            return str(err)
        return None
    if D != HEAD_DIM or H not in HEADS:
        return f"the Gluon scores take {HEADS} heads of {HEAD_DIM} (got {H} of {D})"
    try:  # TMA's layout rules (packed rows, 16-byte alignment)
        check_inputs(q, k, w.float(), k_scale=k_scale)
    except ValueError as err:
        return str(err)
    return None


def folded_parts(q: torch.Tensor, w: torch.Tensor, *, part_major: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """relu=False's operands for the Gluon kernels: sum_h w_h q_h (one fp32 query a row) as
    its three bf16 parts and a zero one, bf16 [B, T, 4, D], with weights fp32 [B, T, 4] of 1,
    1, 1 and 0 (`hytopk.folded_heads`; the kernels' `FOLDED_HEADS`). part_major: the same
    values stored [B, 4, T, D] (a permuted view), as the kernels' `part_major` read them
    (HyTopKOptions.scores_sm90_folded_part_major)."""
    return hk.folded_heads(q, w, heads=FOLDED_GLUON_HEADS, part_major=part_major)


def sample_count(T: int, topk: int, samples: int, options: HyTopKOptions) -> int:
    """Keys the thresholds' sample scores over T keys: at least `samples`, more where
    options.scores_sm90_sample_min_rank asks (stride <= SURVIVOR_MARGIN x topk / min rank), at
    most row_rank.MAX_COLUMNS with the radix pick (never below `samples`)."""
    min_rank = options.scores_sm90_sample_min_rank
    if min_rank is None:
        return samples
    stride = max(1, math.floor(SURVIVOR_MARGIN * topk / min_rank))
    wanted = max(samples, math.ceil(T / stride))
    if options.scores_sm90_sample_pick == "radix":
        wanted = min(wanted, max(samples, row_rank.MAX_COLUMNS))
    return max(1, min(wanted, T))


def sample_chunk_rows(samples: int) -> int:
    """Rows a chunk of the sample's table: SAMPLE_CHUNK_ROWS, fewer for a wide sample."""
    fit = SAMPLE_CHUNK_BYTES // (4 * samples) // SAMPLE_ROW_QUANTUM * SAMPLE_ROW_QUANTUM
    return min(SAMPLE_CHUNK_ROWS, max(SAMPLE_ROW_QUANTUM, fit))


class SamplePlan(NamedTuple):
    """How `sample_thresholds` samples T keys: every `stride`-th key; rows 0 .. first_row - 1
    keep every visible key (at most the cap's: no threshold); the [t0, t1) row chunks of
    chunk_rows rows a table is scored for (those with a row from first_row on)."""

    stride: int
    first_row: int
    chunk_rows: int
    chunks: tuple[tuple[int, int], ...]


def sample_plan(T: int, topk: int, samples: int, options: HyTopKOptions) -> SamplePlan:
    """`sample_thresholds`' plan over T keys (`sample_count` keys, `sample_chunk_rows`)."""
    stride = max(1, math.ceil(T / sample_count(T, topk, samples, options)))
    first_row = min(survivor_cap(topk), T)
    rows = sample_chunk_rows(math.ceil(T / stride))
    chunks = tuple((t0, min(t0 + rows, T)) for t0 in range(0, T, rows)
                   if min(t0 + rows, T) > first_row)
    return SamplePlan(stride, first_row, rows, chunks)


def sample_thresholds(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int,
                      samples: int, *, options: HyTopKOptions,
                      table_fn: TableFn | None = None,
                      k_scale: torch.Tensor | None = None, relu: bool = True) -> torch.Tensor:
    """fp32 [B, T]: each row's threshold, the score of its r-th best visible sampled key, r =
    ceil(SURVIVOR_MARGIN x topk x visible samples / visible keys), over `sample_count` keys
    (`samples` at least); -inf where a row sees at most survivor_cap(topk) keys (all of them
    survive: such a row is never redone). The sample's scores from table_fn (tests pass a
    plain-torch one), else the Gluon table (`options.scores_sm90_sample_table`; a failure of it
    warns once and the Triton one takes over), else HyTopK's Triton score-table kernel. e4m3 q
    and k (k_scale: their keys' scales, w: the head weights times q's scales) take the Gluon
    table always: the Triton table has no scales. relu=False: q the folded query's bf16 parts
    (`folded_parts`; the Gluon table reads them part-major where q is stored so), w their
    weights."""
    fp8 = k_scale is not None
    # the folded parts' layout as q holds it (`folded_parts`), whatever the options say
    part_major = not relu and q.shape[2] > 1 and q.permute(0, 2, 1, 3).is_contiguous()
    transpose = relu and options.scores_sm90_head_sum_transpose
    variant = (q.shape[2], part_major, transpose)
    gluon = table_fn is None and (fp8 or (options.scores_sm90_sample_table
                                          and variant not in TABLE_VARIANTS.disabled))
    if gluon:
        from megatron_hyscale.ops.kernels.indexer_scores_sm90 import indexer_table_sm90

        # variants told only when on: the plain call is the contract's
        table_fn = partial(indexer_table_sm90, **({"part_major": True} if part_major else {}),
                           **({"head_sum_transpose": True} if transpose else {}))
    B, T = q.shape[:2]
    plan = sample_plan(T, topk, samples, options)
    stride = plan.stride
    sampled = torch.arange(0, T, stride, device=q.device)
    rows = torch.arange(T, device=q.device)
    # Ranks on the host (they depend on T, stride and topk only): no sync for their maxima.
    t = torch.arange(T, dtype=torch.float64)
    seen = torch.div(t, stride, rounding_mode="floor") + 1  # visible samples a row
    rank_host = torch.minimum(torch.ceil(SURVIVOR_MARGIN * topk * seen / (t + 1)).clamp_min(1),
                              seen).long()
    rank = rank_host.to(q.device)
    tau = torch.full((B, T), float("-inf"), device=q.device)
    # Row blocks of the score-table kernel must start on its row tiles: chunks of whole blocks.
    for b in range(B):
        k_s = k[b:b + 1, sampled].contiguous()
        keyed = {} if not fp8 else {"k_scale": k_scale[b:b + 1, sampled].contiguous()}
        for t0, t1 in plan.chunks:
            table = None
            if table_fn is not None:
                try:
                    table = table_fn(q[b:b + 1], k_s, w[b:b + 1], stride, t0, t1, relu=relu,
                                     **keyed)[0]
                except torch.OutOfMemoryError:
                    raise  # not the kernel's failure: the Triton table needs the same memory
                except Exception as exc:
                    if not gluon or fp8:  # the caller's, or no table without the Gluon one
                        raise
                    TABLE_VARIANTS.disable(variant, f"{type(exc).__name__}: {exc}")
                    table_fn = None
            if table is None:
                table = torch.empty(t1 - t0, sampled.numel(), device=q.device)
                hk.score_table(q[b:b + 1], k_s, w[b:b + 1], relu=relu,
                               q_positions=rows[None], k_positions=sampled[None], causal=True,
                               t0=t0, t1=t1, table=table, options=options)
            r = rank[t0:t1]
            if options.scores_sm90_sample_pick == "radix":
                tau[b, t0:t1] = row_rank.rank_values(table, r)
            else:
                tau[b, t0:t1] = row_rank.rank_values_reference(
                    table, r, max_rank=int(rank_host[t0:t1].max()))
    # A row seeing at most the cap's keys keeps them all: it cannot miss (counts == visible
    # keys), where a threshold from few visible samples (rows just past topk) often would.
    tau[:, :plan.first_row] = float("-inf")
    return tau


def hytopk_sm90(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, *,
                options: HyTopKOptions, order: str = "score",
                filter_fn: FilterFn | None = None, select_fn: SelectFn | None = None,
                table_fn: TableFn | None = None, stats: torch.Tensor | None = None,
                q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                relu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's exact top-k in `order` (module doc; "any": the set, empty slots last) on
    inputs `unsupported` accepted. filter_fn: the survivors' kernel
    (default `indexer_filter_sm90`; tests pass a plain-torch one); select_fn: the select over
    the survivors (default `select_survivors`; the interpreter tests pass a plain-torch one,
    its radix select taking minutes there); table_fn: the sample's table (`sample_thresholds`).
    stats: optional int64 [2] receiving (rows redone, rows). q_scale, k_scale: e4m3 q and k's
    scales (both or neither): q's fold into the head weights, k's go to the kernels.
    relu=False: the heads fold into one fp32 query a row, scored as its bf16 parts
    (`folded_parts`; bf16 q and k). Host syncs: one (whether any row is redone), plus one a
    batch with rows to redo (which)."""
    if order not in ("score", "key", "any"):
        raise ValueError(f"order must be 'score', 'key' or 'any', got {order!r}")

    # The scan's slots leave each row's survivors in key order (the default filter's only).
    keys_in_order = filter_fn is None and options.scores_sm90_scan_slots
    part_major = not relu and options.scores_sm90_folded_part_major
    filter_fn = filter_fn or default_filter(options, relu)
    B, T = q.shape[:2]
    cap = survivor_cap(topk)
    if B * T == 0:
        if stats is not None:
            stats.zero_()
        return (torch.empty(B, T, topk, dtype=torch.int32, device=q.device),
                torch.empty(B, T, topk, dtype=torch.float32, device=q.device))
    if (q_scale is None) != (k_scale is None):
        raise ValueError("q_scale and k_scale go together (e4m3 q and k)")
    if not relu and q_scale is not None:
        raise ValueError("relu=False takes bf16 q and k (the fp8 query folds into fp32)")
    # q's per-(token, head) scale leaves the ReLU into the head weight (fp8_quant's scheme)
    w_eff = w if q_scale is None else w.float() * q_scale
    q_in = q
    if not relu:
        q_in, w_eff = folded_parts(q, w, part_major=part_major)
    keyed = {"relu": relu} if k_scale is None else {"k_scale": k_scale, "relu": relu}
    tau = sample_thresholds(q_in, k, w_eff, topk, options.scores_sm90_samples, options=options,
                            table_fn=table_fn, k_scale=k_scale, relu=relu)
    indices = torch.empty(B, T, topk, dtype=torch.int32, device=q.device)
    scores = torch.empty(B, T, topk, dtype=torch.float32, device=q.device)
    select = select_fn or partial(select_survivors, keys_in_order=keys_in_order)
    redo = torch.zeros(B, T, dtype=torch.bool, device=q.device)
    for t0, t1 in row_chunks(B, T, topk):
        keys, counts = filter_fn(q_in, k, w_eff, tau[:, t0:t1].contiguous(), t0, t1, cap,
                                 **keyed)
        indices[:, t0:t1], scores[:, t0:t1] = select(keys, counts, topk, order=order,
                                                     options=options)
        redo[:, t0:t1] = missed_rows(counts, t0, topk)
        del keys, counts
    n_redo = int(redo.sum())  # a host sync: whether any row is redone
    if stats is not None:
        stats.copy_(torch.tensor([n_redo, B * T]))
    if n_redo:
        redo_rows(q, k, w, topk, redo, indices, scores, order=order, options=options,
                  q_scale=q_scale, k_scale=k_scale, relu=relu)
    return indices, scores


def missed_rows(counts: torch.Tensor, t0: int, topk: int) -> torch.Tensor:
    """bool [B, n]: the rows t0 .. t0 + n - 1 whose survivor counts (int32 [B, n]) fall short
    of min(topk, visible keys) or overflow the cap, which `redo_rows` selects again."""
    n = counts.shape[1]
    need = torch.clamp(torch.arange(t0 + 1, t0 + n + 1, device=counts.device), max=topk)
    return (counts < need) | (counts > survivor_cap(topk))


def default_filter(options: HyTopKOptions, relu: bool = True) -> FilterFn:
    """`indexer_filter_sm90` as `hytopk_sm90` calls it under `options` (the folded parts
    part-major told so, an injected filter reads q's strides; the transposed head sum)."""
    from megatron_hyscale.ops.kernels.indexer_scores_sm90 import indexer_filter_sm90

    return partial(indexer_filter_sm90, defer_store=options.scores_sm90_defer_store,
                   scan_slots=options.scores_sm90_scan_slots,
                   mma_ahead=options.scores_sm90_mma_ahead, stages=options.scores_sm90_stages,
                   **_variant_kwargs(options, relu))


def _variant_kwargs(options: HyTopKOptions, relu: bool) -> dict[str, bool]:
    """The Gluon kernels' variant arguments under `options`, those on only: the folded parts
    part-major (relu=False), the transposed head sum (ReLU)."""
    if not relu:
        return {"part_major": True} if options.scores_sm90_folded_part_major else {}
    return {"head_sum_transpose": True} if options.scores_sm90_head_sum_transpose else {}


def redo_rows(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int,
              redo: torch.Tensor, indices: torch.Tensor, scores: torch.Tensor, *, order: str,
              options: HyTopKOptions, q_scale: torch.Tensor | None = None,
              k_scale: torch.Tensor | None = None, relu: bool = True) -> None:
    """The rows marked in redo (bool [B, T]) selected again by the Triton kernel over all
    their visible keys, written into indices and scores in place (`hytopk_sm90`'s inputs, q
    and w before folding). A host sync a batch (which rows)."""
    kpos = torch.arange(q.shape[1], device=q.device)[None]
    for b in range(q.shape[0]):
        rows = redo[b].nonzero()[:, 0]
        n = rows.numel()
        if n:
            pad = -n % REDO_ROWS_MULTIPLE
            rows_in = torch.cat([rows, rows[-1:].expand(pad)])
            scales = {} if q_scale is None else dict(
                q_scale=q_scale[b:b + 1, rows_in], k_scale=k_scale[b:b + 1])
            idx, val = hk.hytopk_triton(
                q[b:b + 1, rows_in], k[b:b + 1], w[b:b + 1, rows_in], topk, relu=relu,
                q_positions=rows_in[None], k_positions=kpos, causal=True, options=options,
                ordered=order != "any", key_order=order == "key", **scales)
            indices[b, rows], scores[b, rows] = idx[0, :n], val[0, :n]


def select_survivors(keys: torch.Tensor, counts: torch.Tensor, topk: int, *, order: str,
                     options: HyTopKOptions, keys_in_order: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k of its survivors: keys int64 [B, n, cap] as `indexer_filter_sm90`
    writes them (compacted in place; a row's slots past min(count, cap) are not read), counts
    int32 [B, n] -> indices int32 and scores fp32 [B, n, topk] in `order` ("score":
    descending score, ties to the smaller index; "key": increasing index; "any": the set,
    empty slots last). keys_in_order: each row's survivors lie in increasing index (the
    filter's scan slots), which the select's compaction keeps, so order "key" needs no sort.
    Without a sort and with options.scores_sm90_direct_select the rows are written straight
    from the buffers (`survivor_select.select_rows`, keys left as they are). A row with more
    survivors than cap comes back wrong: the caller redoes it."""
    B, n, cap = keys.shape
    sort = order == "score" or (order == "key" and not keys_in_order)
    if options.scores_sm90_direct_select and not sort:
        idx, val = survivor_select.select_rows(keys.view(B * n, cap), counts.view(B * n), topk,
                                               num_warps=options.num_warps)
        return idx.view(B, n, topk), val.view(B, n, topk)
    idx, val = hk.write_rows(keys.view(B * n, cap), counts.view(B * n), topk,
                             ordered=sort, key_order=order == "key", select=True,
                             options=options)
    return idx.view(B, n, topk), val.view(B, n, topk)

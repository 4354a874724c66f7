"""Benchmark exact top-k selection over lightning-indexer scores (HyTopK).

For each config and sequence length T (B = 1, S = T, causal; config qsa: S = T / 4 blocks,
4 heads, constant weights, as the QSA layer calls it) it times, in one run:
  hytopk     HyTopK Triton kernel (exact, streaming, no score table), key-tile pruning off
  hytopk_default  what ops.hytopk runs with its default options: on Hopper from
             HyTopKOptions.scores_sm90_min_keys keys (16K) the Gluon scores' selection
             (HyTopKOptions.scores_sm90=None), else the Triton kernel;
             the "own" time scripts/measured_defaults.py compares with cuDNN's where a record
             has it; reports same_as_hytopk (equal to the Triton kernel's rows);
             hytopk_default_key: the same in key order, as the layers call it (compared with
             the default's rows sorted by key), measured_defaults' own time against cudnn_key
  hytopk_prune  the same with exact key-tile pruning on (tiles whose centroid / radius score
             bound is below every row's running threshold are skipped); also reports the share
             of key tiles pruned (tiles skipped / tiles a row block would visit)
  scoreonly  the same kernel with the top-k maintenance removed (GEMM + ReLU/weight/head-sum
             epilogue, each row's max written): splits GEMM from selection
  hytopk_heads_on_m, scoreonly_heads_on_m  the same two with the other GEMM orientation
             (Q @ K_tile^T, heads on the MMA's M: the head sum crosses warps), for comparison
             with the default (K_tile @ Q^T, HyTopKOptions.keys_on_m) in the same run
  hytopk_scan_slots  HyTopK with the other candidate append (a CTA-wide test and prefix sum per
             tile instead of a slot per survivor from an atomic counter;
             HyTopKOptions.atomic_slots=False)
  hytopk_sort_bitonic  HyTopK with HyTopKOptions.row_sort="bitonic" (Triton's tl.sort, the
             in-kernel row sort before "bitonic_regs"); reports same_as_hytopk
  hytopk_folded_fp32  relu=False only: the folded query as one fp32 head on tf32x3 products
             (HyTopKOptions.folded_parts=False) against the default's three bf16 parts
  hytopk_fp8  HyTopK with precision="fp8" (ops/fp8_quant.py): e4m3 q and k with per-token
             power-of-two scales, fp8 tensor-core products; timed with its quantization (also
             reported alone, quant_ms), x_floor against the same bf16 GEMM floor (issue #21's
             goal: at most 0.65x at 128K), and overlap_vs_bf16: the mean share of each row's
             bf16 HyTopK selection that the fp8 one keeps (to 128K; per input kind, so
             --inputs structured recency give it on trained-like scores)
  hytopk_fp8_promote32  the same with HyTopKOptions.fp8_imprecise_acc=32 (each 32-channel
             fp8 MMA step added to an fp32 accumulator)
  scoreonly_fp8  the score-only kernel on the quantized q and k (splits the fp8 GEMM from the
             selection; quantization not timed)
  hytopk_fp8_scores_sm90  precision="fp8" on the Gluon scores (HyTopKOptions.scores_sm90: fp8
             wgmma products, the sample on the Gluon table), with its quantization; reports
             overlap_vs_bf16 and redone_rows_share; scoreonly_sm90_fp8: the Gluon scores alone
             on the quantized q and k (quantization not timed)
  hytopk_plain  HyTopK with every select variant of HyTopKOptions off (the kernel before
             them; all on is the default since 2026-12-03)
  hytopk_sort, hytopk_head_major, hytopk_lean, hytopk_sample, hytopk_bounded  HyTopK with one
             select variant of HyTopKOptions each, the others off (issue #21: a select that costs
             little whatever the head count): sort_in_kernel (each row sorted and decoded in the
             kernel, no `finish` pass), head_major (pair-major GEMM columns: with 4 padded heads,
             each score in one lane), lean_filter (one int32 visibility compare, one key compare),
             sample_keys=1024 (a sampled first threshold a row; reports the share of rows that got
             one and the row blocks redone), bounded_select (the compaction's select skips the bits
             all candidates share)
  hytopk_select  all of them together (= hytopk); hytopk_select_unordered the same with
             ordered=False
             (decode without the sort: the difference is the in-kernel sort's time)
  scoreonly_head_major  the score-only kernel with head_major (the GEMM and head sum alone)
  scoreonly_sm90  the warp-specialized Gluon scores-only kernel (a TMA producer warp, two
             consumer warpgroups ping-ponged; `kernels/indexer_scores_sm90.py`), ReLU configs
             with 32 / 64 heads, and norelu (the folded query as 4 bf16 "heads": 3 parts and
             a zero one, 32 rows a consumer; its folding timed with it); reports
             max_diff_vs_scoreonly (its row maxima against the Triton scores-only kernel's);
             scoreonly_sm90_free: the same without the ping-pong; scoreonly_sm90_ahead: with
             each product issued before the last one's epilogue (scores_sm90_mma_ahead);
             scoreonly_sm90_part_major: the folded parts part-major
             (scores_sm90_folded_part_major; as scoreonly_sm90 with ReLU);
             scoreonly_sm90_transpose: _ahead with the head sum's quad step as a layout
             change (scores_sm90_head_sum_transpose; as _ahead without ReLU)
  hytopk_scores_sm90  HyTopK on those Gluon scores (HyTopKOptions.scores_sm90,
             `kernels/hytopk_sm90.py`): sampled thresholds, the Gluon filter appending each
             row's survivors, HyTopK's select over them, missed rows redone by the Triton
             kernel (norelu too: issue #21's folded query; its survivors stored right after
             their atomics); reports redone_rows_share and phase_ms (sample, filter, select timed
             apart, select_torch: torch.topk's select, which it replaced, sample_gluon:
             the sample on the Gluon table, sample_topk: the sample's torch.topk alone, and
             sample_pick: the radix pick in its place, `row_rank.rank_values`);
             hytopk_scores_sm90_immediate: the filter storing each survivor right after its
             slot atomic (scores_sm90_defer_store=False); hytopk_scores_sm90_gluon_sample:
             the sample scored by the Gluon kernel's table epilogue (scores_sm90_sample_table;
             the phases' sample_gluon times it alone); hytopk_scores_sm90_gluon_sample_x4: the
             same with 4x the sampled keys (scores_sm90_samples=8192: each row's threshold
             ranked among 4x the samples, fewer rows redone past 128K);
             hytopk_scores_sm90_radix_pick: the Gluon sample with each row's threshold picked
             by `row_rank.rank_values` (scores_sm90_sample_pick="radix"; the phases'
             sample_pick times it alone) instead of torch.topk;
             hytopk_scores_sm90_scan_slots: that with the filter's slots from a scan over each
             key tile, no atomics (scores_sm90_scan_slots; the phases' filter_scan times the
             filter alone so); hytopk_scores_sm90_radix_pick_key, _scan_slots_key: the two in
             key order (the layers' order; the scan's key-ordered buffers skip the row sort;
             compared with the default's rows sorted by key); hytopk_scores_sm90_ahead:
             _scan_slots with each consumer's next product issued before the last tile's
             epilogue (scores_sm90_mma_ahead); _ahead_key, _ahead6_key: that in key order, 4
             and 6 key tiles in flight; _part_major_key: _scan_slots_key with the folded
             query's parts part-major (scores_sm90_folded_part_major; the same as
             _scan_slots_key with ReLU), _part_major_ahead_key: that with the product ahead;
             hytopk_scores_sm90_transpose_key: today's default path in key order with the
             head sum's quad step as a layout change (scores_sm90_head_sum_transpose);
             hytopk_scores_sm90_fixed_sample_key: today's default path in key order with
             the sample fixed at scores_sm90_samples keys (scores_sm90_sample_min_rank=None:
             as before it, past 128K keys at top-2048 fewer samples a row's threshold ranks
             among, more rows redone); hytopk_scores_sm90_rank96_key: that with
             scores_sm90_sample_min_rank=96 (twice the sample from 64K keys at top-2048);
             hytopk_scores_sm90_current: today's default path (score order);
             hytopk_scores_sm90_current_key: that in key order (the layers'), reporting
             path_ms (its steps as the op runs them, timed apart: fold, sample, filter,
             select, redo, total; `default_path_phases`)
  (each variant reports same_as_hytopk: its outputs equal HyTopK's default bit for bit, to
  128K; where not, same_rows_as_hytopk: the share of rows whose selected set equals the
  Triton kernel's, as the library methods report it)
  finish     HyTopK's last pass alone (the torch sort that orders and decodes each row)
  naive      megatron-core 0.19.2 `fused_qk_topk_naive` (full [T, H, S] fp32 logits); OOM shown
  chunked    the common chunked path: per-head bf16 logits for a row block, ReLU, head sum as a
             batched product with the weights, causal mask, torch.topk
  table      table-then-select: HyTopK's fused scoring pass writes an fp32 [rows, S] score block,
             then torch.topk on it
  cudnn      HyScale's cudnn backend (ops/backends/cudnn_selection.py): cuDNN-frontend's SM90
             indexer scores in 1 GiB row chunks, keys cropped to each chunk's causal end, then
             cuDNN's deterministic radix top-k (needs scripts/gpu_cudnn.sh; ReLU configs only);
             cudnn_key: its rows in key order as they come (no sort by score), what the layers
             take from it
  stock_cudnn  megatron-core's own cudnn-backend selection (dsa_cudnn_kernels._indexer_topk_bshd),
             what a stock DSA layer with dsa_kernel_backend="cudnn" runs
  stock_tilelang  megatron-core's own tilelang-backend selection
             (dsa_tilelang_kernels.run_fused_qk_topk), what a stock DSA layer with
             dsa_kernel_backend="tilelang" runs: per block of 8192 query rows, TileLang's indexer
             writes an fp32 [8192, S] score table, then torch.topk (needs TileLang:
             scripts/gpu_tilelang.sh; the table is freed block by block and after the method)
  (the three report same_rows_as_hytopk: the share of rows whose set equals HyTopK's, to 128K;
  each is called once untimed at every length before its timings, for the JIT compiles)
and reports time (median of CUDA-event timings), peak extra memory (max_memory_allocated over
the inputs) and the ratio to the indexer GEMM floor: causal FLOPs T(T+1)/2 * H * D * 2 over the
bf16 matmul rate measured in the same run (an 8192^3 bf16 matmul).

Inputs: "random" (bf16 normal; the worst case for pruning) or "structured", which mimics a
trained indexer: each query favours recent keys (a rotary-like recency component: q_t . k_s
contains sum_i cos((t - s) f_i) over 16 low frequencies) plus a few heavy-hitter keys (64 keys
with a large component along a direction every query has positive weight on), over small noise.
"recency" is a variant built so that a per-tile bound can separate old keys from recent ones:
an ALiBi-like linear bias (k_s has s / RECENCY_TOKENS on dim 0, every query a positive weight
on it, so the score falls by about 1 per RECENCY_TOKENS tokens of distance), the same heavy
hitters, noise 0.1 (in bf16 the bias is quantized: 8 significant bits). On "random" and
"structured" inputs the centroid / radius bound lies above the threshold: the high-frequency
rotary terms and the noise spread each tile's keys over a radius larger than the score gaps.
A CPU estimate (2026-11-30; T = 16K, 8 heads, 2048 kept, 64-key tiles, 8-row blocks, each
row's final threshold, so an upper estimate) found 0% of the tiles prunable for "structured"
and 64% for "recency"; the GPU run measures the real share.

--captured PATH runs on a trained indexer's tensors instead: the demo (`bash scripts/run.sh
demo`) writes its first layer's q, k and weights on a held-out batch to
outputs/demo/indexer_capture.pt (256 tokens: it shows what the bound prunes on a trained
indexer, not speed); a training run writes its first DSA layer's at a chosen iteration
(`python -m megatron_hyscale.evaluate --capture-indexer-at N`, megatron_hyscale.indexer_capture;
`gpu_session.sh evaluate hyscale` then `captured-selection`: GLM-5.1's indexer trained on text
at 16K tokens).

Writes a table to stdout, JSON and a PNG (time and memory against T, log scales) to --out.
Needs a CUDA GPU (every mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyscale_bench.measure import (  # noqa: E402
    commit,
    copy_tbps,
    log,
    matmul_tflops,
    require_cuda,
    save_record,
    time_ms,
)
from hyscale_bench.stock_kernels import tilelang_unavailable  # noqa: E402
from megatron_hyscale.ops import hytopk  # noqa: E402
from megatron_hyscale.ops.block_pool import block_visibility_positions  # noqa: E402
from megatron_hyscale.ops.fp8_quant import quantize_indexer, selection_overlap  # noqa: E402
from megatron_hyscale.ops.kernels import hytopk as hk  # noqa: E402
from megatron_hyscale.ops.kernels.options import SELECT_VARIANTS_OFF, HyTopKOptions  # noqa: E402

GiB = 1 << 30
TAG = ""
# Sequence length of the untimed call that compiles each kernel before the timed runs.
WARM_T = 4096


def warm_length(cfg):
    """The warm-up length of a config: WARM_T times its key ratio. The kernel's persistent grid
    size is a compile-time constant (min(row blocks, 2 programs an SM)); QSA's 16-row blocks
    at 4096 tokens are 256, under the H200's 264, so its warm-up compiled another kernel and
    the first timed call at 512K paid the compile (2157.7 ms recorded on 2026-11-30, one
    sample, against 460 ms in the sweep)."""
    return WARM_T * KEY_RATIO.get(cfg, 1)


# Keys from which every config's rows sample a first threshold (`HyTopKOptions.sample_keys`:
# S >= SAMPLE_MIN_BUFFERS candidate buffers, 4 x 4096 slots for top-2048), a second binary that
# the 4K warm-up does not build: on 2026-12-03 the first 16K call of each config compiled it
# inside its timing (9.9-24.0 s recorded for a ~7 ms selection).
SAMPLED_WARM_KEYS = 16384
CONFIGS = {
    # name: (H, D, topk, relu)
    "dsv32": (64, 128, 2048, True),  # DeepSeek-V3.2 / GLM-5 DSA indexer
    "glm51": (32, 128, 2048, True),  # GLM-5.1
    "v4flash": (64, 128, 512, True),  # DeepSeek-V4-Flash CSA top-512
    "norelu": (32, 128, 2048, False),  # GLM-5 configs with ReLU disabled
    "qsa": (4, 128, 512, True),  # Qwen3.8-Flash-Next QSA: 4 heads over blocks of 4 tokens
}
# Tokens per selectable key (QSA scores mean-pooled blocks of 4): S = T // ratio keys, key s
# visible from the query at position 4 s + 3 on (its block complete), as the QSA layer runs it.
KEY_RATIO = {"qsa": 4}
# Configs without learned head weights (QSA sums its heads with one scale): w is constant.
NO_HEAD_WEIGHTS = ("qsa",)
# Methods built for S = T token keys only (their masks assume it).
TOKEN_KEY_METHODS = ("naive", "chunked", "table", "cudnn", "cudnn_key", "stock_cudnn",
                     "stock_tilelang")
ALL_T = [16384, 32768, 65536, 131072, 262144, 1048576]
# Baselines that would take minutes per call beyond these lengths are not run (shown as "-"):
# lengths for S = T and 64 heads, other configs compared by their work T x S x H.
MAX_T = {"naive": 32768, "chunked": 131072, "table": 131072, "scoreonly": 131072,
         "hytopk_prune": 131072, "hytopk_heads_on_m": 131072, "scoreonly_heads_on_m": 131072,
         "hytopk_scan_slots": 131072, "hytopk_folded_fp32": 131072, "finish": 1048576,
         "hytopk_sort_bitonic": 131072, "hytopk_occ3": 131072, "hytopk_append_tl": 1048576,
         "hytopk_key_tma": 1048576, "scoreonly_key_tma": 131072,
         "hytopk_occ3_s3": 131072, "scoreonly_occ3": 131072,
         "hytopk_fp8_promote32": 131072, "scoreonly_fp8": 131072,
         "scoreonly_sm90": 131072, "scoreonly_sm90_free": 131072,
         "scoreonly_sm90_ahead": 131072,
         "hytopk_default": 1048576, "hytopk_default_key": 1048576,
         "hytopk_fp8_scores_sm90": 1048576, "scoreonly_sm90_fp8": 131072,
         # megatron's cudnn selection scores every chunk after the first with per-head fp32
         # torch matmuls (dsa_cudnn_kernels._compute_indexer_scores_chunk_with_global_rows)
         "stock_cudnn": 65536,
         # megatron's tilelang selection writes a [8192, S] fp32 table a block: quadratic in
         # T (its indexer calls took 14.8 s of a GLM-5.1 layer step at 256K, bench_layer's
         # breakdown of 2026-11-30)
         "stock_tilelang": 262144}
# Score-table bytes per row block for the chunked and table baselines.
TABLE_BYTES = 4 * GiB
# "recency" inputs: tokens of distance per unit of the linear recency bias.
RECENCY_TOKENS = 256


def peak_extra(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


# --captured: a trained indexer's tensors (megatron_hyscale.demo writes indexer_capture.pt).
CAPTURED: dict = {}


def load_captured(path):
    """Register the capture as config "captured" (its heads, dim, top-k, ReLU); returns T."""
    cap = torch.load(path)
    q = cap["q"][:1]  # one sequence, as every other input here
    CAPTURED.update(q=q, k=cap["k"][:1], w=cap["weights"][:1])
    CONFIGS["captured"] = (q.shape[2], q.shape[3], int(cap["topk"]), bool(cap["relu"]))
    return q.shape[1]


def config_inputs(T, cfg, kind):
    """make_inputs for a config: its key ratio, and constant weights where it has none."""
    H, D = CONFIGS[cfg][:2]
    q, k, w = make_inputs(T, H, D, kind, ratio=KEY_RATIO.get(cfg, 1))
    if cfg in NO_HEAD_WEIGHTS:
        w = torch.full_like(w, (H * D) ** -0.5)
    return q, k, w


def make_inputs(T, H, D, kind, seed=0, ratio=1):
    """q [1, T, H, D], k [1, T // ratio, D], w [1, T, H] (ratio > 1: random inputs only)."""
    if kind == "captured":  # fp32 as captured; T, H and D are the capture's
        return tuple(CAPTURED[n].to("cuda") for n in ("q", "k", "w"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "random":
        q = torch.randn(1, T, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, T // ratio, D, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(1, T, H, device="cuda", generator=g) * (H * D) ** -0.5
        return q, k, w
    # Structured: recency (rotary-like, dims 0..31) + heavy hitters (dim 32) + noise.
    n_freq, n_hitters = 16, 64
    pos = torch.arange(T, device="cuda", dtype=torch.float32)
    freq = 1.0 / (4.0 * 4.0 ** torch.arange(n_freq, device="cuda", dtype=torch.float32))
    ang = pos[:, None] * freq[None, :]
    rot = torch.cat([ang.cos(), ang.sin()], dim=-1)  # [T, 32]: rot_t . rot_s = sum cos((t-s)f)
    k = 0.3 * torch.randn(1, T, D, device="cuda", generator=g)
    k[0, :, :2 * n_freq] += rot
    hitters = torch.randperm(T, device="cuda", generator=g)[:n_hitters]
    k[0, hitters, 2 * n_freq] += 6.0
    q = 0.3 * torch.randn(1, T, H, D, device="cuda", generator=g)
    q[0, :, :, :2 * n_freq] += rot[:, None, :]
    q[0, :, :, 2 * n_freq] += 1.0
    w = torch.rand(1, T, H, device="cuda", generator=g) * (H * D) ** -0.5
    if kind == "recency":  # linear recency bias (dim 0), hitters (dim 32), less noise
        k = 0.1 * torch.randn(1, T, D, device="cuda", generator=g)
        k[0, :, 0] = pos / RECENCY_TOKENS
        k[0, hitters, 2 * n_freq] += 6.0
        q = 0.1 * torch.randn(1, T, H, D, device="cuda", generator=g)
        q[0, :, :, 0] = 0.5 + torch.rand(T, H, device="cuda", generator=g)
        q[0, :, :, 2 * n_freq] += 1.0
    return q.to(torch.bfloat16), k.to(torch.bfloat16), w


def positions(T, S):
    """Query and key positions: S = T tokens (the last T of S when S > T), or S = T // r
    blocks of r tokens, key s at its block's last token (visible once the block is complete)."""
    if S < T:
        return (torch.arange(T, device="cuda")[None],
                block_visibility_positions(S, T // S, "cuda")[None])
    return (torch.arange(T, device="cuda") + S - T)[None], torch.arange(S, device="cuda")[None]


def floor_ms(T, S, H, D, rate):
    """Indexer GEMM floor: every visible (query, key) pair's H dot products of D, at `rate`."""
    if S < T:
        r = T // S
        t = torch.arange(T, dtype=torch.float64)
        pairs = float(torch.clamp(torch.floor((t + 1) / r), max=S).sum())
    else:
        pairs = T * (T + 1) / 2
    return pairs * H * D * 2 / rate * 1e3


def run_hytopk(q, k, w, topk, relu, options=HyTopKOptions.DEFAULT, prune_stats=None,
               ordered=True, sample_stats=None):
    # The kernel entry that hytopk(..., backend="triton") calls after validating its inputs:
    # the validation's isfinite pass allocates a bool copy of q (8 GiB at 1M tokens), which is
    # not part of the selection and would hide the kernel's own peak memory.
    qpos, kpos = positions(q.shape[1], k.shape[1])
    return hk.hytopk_triton(q, k, w, topk, relu=relu, q_positions=qpos, k_positions=kpos,
                            causal=True, options=options, prune_stats=prune_stats,
                            ordered=ordered, sample_stats=sample_stats)


# The select variants (issue #21), each as HyTopKOptions fields; hytopk_select takes them all
# (the default), hytopk_plain none. A method turns on its fields and the others off.
SELECT_VARIANTS = {
    "hytopk_sort": dict(sort_in_kernel=True),
    "hytopk_head_major": dict(head_major=True),
    "hytopk_lean": dict(lean_filter=True),
    "hytopk_sample": dict(sample_keys=1024),
    "hytopk_bounded": dict(bounded_select=True),
}
SELECT_VARIANTS["hytopk_select"] = {f: v for fields in SELECT_VARIANTS.values()
                                    for f, v in fields.items()}
SELECT_VARIANTS["hytopk_plain"] = {}


def select_variant(name, ordered=True):
    """A method running HyTopK with the HyTopKOptions fields of SELECT_VARIANTS[name] on and
    the other select variants off."""
    options = replace(HyTopKOptions.DEFAULT, **dict(SELECT_VARIANTS_OFF, **SELECT_VARIANTS[name]))

    def run(q, k, w, topk, relu, sample_stats=None):
        return run_hytopk(q, k, w, topk, relu, options, ordered=ordered,
                          sample_stats=sample_stats)

    return run


# The default's outputs for the last (inputs, T) a variant was compared at (one at a time: two
# 128K x 2048 outputs take 2 GiB).
_DEFAULT_OUTPUTS: dict = {}
# Leading values of each input summed into `default_outputs`' key.
INPUT_SAMPLE = 4096


def default_outputs(q, k, w, topk, relu):
    """The default kernel's (indices, scores) on these inputs, kept for the next variant (each
    method gets fresh inputs of the same seed, often at the same addresses). Keyed by relu,
    the inputs' addresses and a sample of their values: two configs of one geometry (GLM-5.1
    and the folded query) get equal inputs, and other input kinds of the same shapes may land
    at the addresses the last ones freed."""
    sample = torch.stack([t.flatten()[:INPUT_SAMPLE].float().sum() for t in (q, k, w)])
    key = (q.data_ptr(), k.data_ptr(), w.data_ptr(), q.shape, k.shape, topk, relu,
           tuple(sample.tolist()))
    if key not in _DEFAULT_OUTPUTS:
        _DEFAULT_OUTPUTS.clear()
        _DEFAULT_OUTPUTS[key] = run_hytopk(q, k, w, topk, relu)
    return _DEFAULT_OUTPUTS[key]


def same_as_default(out, q, k, w, topk, relu, ordered=True, key_order=False):
    """Whether a variant's outputs equal the default kernel's bit for bit (unordered: the
    same sets, each row sorted by index first; key_order: the variant's rows as they come
    against the default's sorted by index, empty slots last)."""
    ref_i, ref_s = default_outputs(q, k, w, topk, relu)
    got_i, got_s = out
    if not ordered or key_order:
        order = ref_i.to(torch.int64).masked_fill(ref_i < 0, 1 << 40).argsort(-1)
        ref_i, ref_s = ref_i.gather(-1, order), ref_s.gather(-1, order)
    if not ordered:
        order = got_i.to(torch.int64).masked_fill(got_i < 0, 1 << 40).argsort(-1)
        got_i, got_s = got_i.gather(-1, order), got_s.gather(-1, order)
    return torch.equal(got_i, ref_i) and torch.equal(got_s, ref_s)


def row_sort_micro(rows, topk, reps):
    """Time the row output alone (`hk.write_rows`: load, sort, decode, store) on rows of
    topk random distinct packed keys, for every HyTopKOptions.row_sort and torch.sort of the
    same keys; checks each against the default bit for bit. The grid is the select kernel's
    (programs_per_sm programs an SM)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(rows, topk, device="cuda", generator=g)
    bits = scores.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    index = torch.randperm(4 * topk, device="cuda", generator=g)[:topk].to(torch.int64)
    keys = torch.cat([(ordered << 32) | (0xFFFFFFFF - index),
                      torch.zeros_like(ordered)], dim=1)  # cap = 2 topk, as the kernel's
    counts = torch.full((rows,), topk, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * HyTopKOptions.DEFAULT.programs_per_sm
    recs, ref = [], None
    for name in hk.ROW_SORTS:
        opts = replace(HyTopKOptions.DEFAULT, row_sort=name)
        out = hk.write_rows(keys, counts, topk, options=opts, programs=programs)
        ref = ref or out
        same = torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        ms = time_ms(lambda o=opts: hk.write_rows(keys, counts, topk, options=o,
                                                  programs=programs), reps=reps, warmup=1)
        recs.append({"method": f"write_rows_{name}", "rows": rows, "topk": topk, "ms": ms,
                     "same_as_default": same})
    ms = time_ms(lambda: keys[:, :topk].sort(dim=-1, descending=True), reps=reps, warmup=1)
    recs.append({"method": "torch_sort", "rows": rows, "topk": topk, "ms": ms})
    for r in recs:
        log(f"row sort micro {r['method']:24s} {r['ms']:8.3f} ms"
            + (f"  same as default {r['same_as_default']}" if "same_as_default" in r else ""))
    return recs


def run_hytopk_fp8(q, k, w, topk, relu, options=HyTopKOptions.DEFAULT):
    """What hytopk(..., precision="fp8", backend="triton") runs after its input checks: the
    quantization, then the kernel on e4m3 q and k."""
    q8, q_scale, k8, k_scale = quantize_indexer(q, k)
    qpos, kpos = positions(q.shape[1], k.shape[1])
    return hk.hytopk_triton(q8, k8, w, topk, relu=relu, q_positions=qpos, k_positions=kpos,
                            causal=True, options=options, q_scale=q_scale, k_scale=k_scale)


# Quantized copies for scoreonly_fp8, made once an input (their time is not the kernel's).
_FP8_INPUTS: dict = {}


def quantized_once(q, k):
    """`quantize_indexer(q, k)`, kept for the last input: the scores-only methods' kernels are
    timed without the quantization."""
    key = (q.data_ptr(), k.data_ptr(), q.shape, k.shape)
    if key not in _FP8_INPUTS:
        _FP8_INPUTS.clear()
        _FP8_INPUTS[key] = quantize_indexer(q, k)
    return _FP8_INPUTS[key]


def run_scoreonly_fp8(q, k, w, topk, relu):
    q8, q_scale, k8, k_scale = quantized_once(q, k)
    qpos, kpos = positions(q.shape[1], k.shape[1])
    return hk._launch(q8, k8, w, 1, relu=relu, q_positions=qpos, k_positions=kpos, causal=True,
                      mode=hk.MODE_SCORES_ONLY, q_scale=q_scale, k_scale=k_scale)


def overlap_with_bf16(idx, q, k, w, topk, relu):
    """Mean over rows of the share of the bf16 HyTopK selection that `idx` also selected."""
    ref = run_hytopk(q, k, w, topk, relu)[0]
    return selection_overlap(idx, ref).mean().item()


def pruned_share(q, k, w, topk, relu):
    """Share of key tiles the pruning skips (tiles skipped / tiles the row blocks would visit),
    and whether the outputs equal the unpruned kernel's bit for bit."""
    stats = torch.zeros(2, dtype=torch.int64, device="cuda")
    on = run_hytopk(q, k, w, topk, relu, replace(HyTopKOptions.DEFAULT, prune=True), stats)
    off = run_hytopk(q, k, w, topk, relu, replace(HyTopKOptions.DEFAULT, prune=False))
    same = torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    pruned, considered = stats.tolist()
    return pruned / max(considered, 1), same


def run_scoreonly(q, k, w, topk, relu, options=HyTopKOptions.DEFAULT):
    qpos, kpos = positions(q.shape[1], k.shape[1])
    return hk._launch(q, k, w, 1, relu=relu, q_positions=qpos, k_positions=kpos, causal=True,
                      mode=hk.MODE_SCORES_ONLY, options=options)


def run_scoreonly_sm90(q, k, w, topk, relu, pingpong=True, mma_ahead=False, part_major=False,
                       head_sum_transpose=False):
    """The warp-specialized Gluon scores (`kernels/indexer_scores_sm90.py`): each causal row's
    largest score, as `scoreonly` writes; ReLU configs with 32 or 64 heads of 128 dims, or
    without ReLU the folded query's bf16 parts (their folding timed with them). mma_ahead:
    each product issued before the last one's epilogue (scores_sm90_mma_ahead); part_major:
    the folded parts stored part-major (scores_sm90_folded_part_major; no effect with
    ReLU); head_sum_transpose: the head sum's quad step as a layout change
    (scores_sm90_head_sum_transpose; ReLU only, no effect without)."""
    from megatron_hyscale.ops.kernels.hytopk_sm90 import folded_parts
    from megatron_hyscale.ops.kernels.indexer_scores_sm90 import indexer_row_max_sm90

    part_major = part_major and not relu
    if not relu:
        q, w = folded_parts(q, w, part_major=part_major)
    return indexer_row_max_sm90(q, k, w, pingpong=pingpong, relu=relu, mma_ahead=mma_ahead,
                                part_major=part_major,
                                head_sum_transpose=head_sum_transpose and relu)


def run_scoreonly_sm90_fp8(q, k, w, topk, relu):
    """The Gluon scores on e4m3 q and k (fp8 wgmma; quantized once an input, as
    scoreonly_fp8): each causal row's largest score."""
    from megatron_hyscale.ops.kernels.indexer_scores_sm90 import indexer_row_max_sm90

    if not relu:
        raise ValueError("scoreonly_sm90_fp8 scores under ReLU only")
    q8, q_scale, k8, k_scale = quantized_once(q, k)
    return indexer_row_max_sm90(q8, k8, w * q_scale, k_scale=k_scale)


def run_hytopk_fp8_scores_sm90(q, k, w, topk, relu, stats=None):
    """What hytopk(..., precision="fp8", options=HyTopKOptions(scores_sm90=True)) runs: the
    quantization, then HyTopK on the Gluon scores' fp8 products (the sample on the Gluon
    table)."""
    from megatron_hyscale.ops.kernels import hytopk_sm90

    if not relu:
        raise ValueError("hytopk_fp8_scores_sm90 scores under ReLU only")
    q8, q_scale, k8, k_scale = quantize_indexer(q, k)
    opts = replace(HyTopKOptions.DEFAULT, scores_sm90=True)
    return hytopk_sm90.hytopk_sm90(q8, k8, w, topk, options=opts, stats=stats,
                                   q_scale=q_scale, k_scale=k_scale)


def run_hytopk_default(q, k, w, topk, relu, order="score"):
    """What `ops.hytopk` runs with its default options (on Hopper from
    HyTopKOptions.scores_sm90_min_keys keys the Gluon scores' selection, else the Triton
    kernel), without its finite-value checks (as the layers call it; they ask order "key")."""
    return hytopk(q, k, w, topk, relu=relu, backend="triton", check_values=False, order=order)


# The Gluon path of 2026-12-06 (the Triton sample, torch.topk's pick, a slot atomic a survivor
# stored under the next product): `run_hytopk_scores_sm90`'s base, so that a GLUON_SELECTIONS
# entry keeps its meaning when HyTopKOptions.DEFAULT changes. Other scores_sm90_* fields:
# DEFAULT's.
FIRST_GLUON_PATH = dict(defer_store=True, sample_table=False, sample_pick="topk",
                        scan_slots=False, mma_ahead=False, folded_part_major=False,
                        direct_select=False, sample_min_rank=None)


def run_hytopk_scores_sm90(q, k, w, topk, relu, stats=None, order="score", **fields):
    """HyTopK from the warp-specialized Gluon scores (`kernels/hytopk_sm90.py`,
    HyTopKOptions.scores_sm90): sampled thresholds, the Gluon filter, a select over the
    survivors, the missed rows redone by the Triton kernel. ReLU configs with 32 or 64 heads,
    or without ReLU any head count (the folded query's bf16 parts). fields: HyTopKOptions'
    scores_sm90_<field> values over FIRST_GLUON_PATH's (an unknown one raises); order: the
    rows' order ("key": the layers')."""
    from megatron_hyscale.ops.kernels import hytopk_sm90

    opts = replace(HyTopKOptions.DEFAULT, scores_sm90=True,
                   **{f"scores_sm90_{name}": value
                      for name, value in {**FIRST_GLUON_PATH, **fields}.items()})
    return hytopk_sm90.hytopk_sm90(q, k, w, topk, options=opts, stats=stats, relu=relu,
                                   order=order)


def scores_sm90_phases(q, k, w, topk, reps, relu=True):
    """hytopk_scores_sm90's phases timed apart on the same inputs (ms): the sampled thresholds,
    the Gluon filter over all row chunks, the select over the survivors (`select_survivors`,
    on a copy of the first chunk's buffer once a chunk, the copy's time taken off, its
    decode and order included), and torch.topk alone over the same buffers (select_torch: the
    select it replaced, without that path's decode and key-order sort); select_key: the
    select in key order over the scan slots' buffers (the layers' case, no row sort),
    select_key_direct: that written straight to the rows (scores_sm90_direct_select), and
    select_key_direct_equal whether their rows are equal; the rest (redone
    rows, masks) is the difference. sample_topk: the sample's torch.topk alone, as often as
    the sample runs it, over one chunk's table; sample_pick: `row_rank.rank_values` (the
    radix pick) in its place; filter_scan: the filter with its slots from a scan (no atomics,
    scores_sm90_scan_slots). relu=False: on the folded query's parts."""
    from megatron_hyscale.ops.kernels import hytopk_sm90, row_rank
    from megatron_hyscale.ops.kernels.indexer_scores_sm90 import indexer_filter_sm90

    # The phases of hytopk_scores_sm90's row (the Triton sample; sample_gluon times the other).
    # the compacting select (select_key_direct times the direct one beside it)
    opts = replace(HyTopKOptions.DEFAULT, scores_sm90=True, scores_sm90_sample_table=False,
                   scores_sm90_sample_pick="topk", scores_sm90_scan_slots=False,
                   scores_sm90_folded_part_major=False,  # the parts below: (token, part)
                   scores_sm90_direct_select=False)
    if not relu:
        q, w = hytopk_sm90.folded_parts(q, w)
    B, T = q.shape[:2]
    cap = hytopk_sm90.survivor_cap(topk)
    tau = hytopk_sm90.sample_thresholds(q, k, w, topk, opts.scores_sm90_samples, options=opts,
                                        relu=relu)
    chunks = hytopk_sm90.row_chunks(B, T, topk)

    def filter_all(scan_slots=False):
        for t0, t1 in chunks:
            indexer_filter_sm90(q, k, w, tau[:, t0:t1].contiguous(), t0, t1, cap,
                                defer_store=opts.scores_sm90_defer_store, relu=relu,
                                scan_slots=scan_slots)

    t1 = chunks[0][1]
    keys, counts = indexer_filter_sm90(q, k, w, tau[:, :t1].contiguous(), 0, t1, cap,
                                       relu=relu)
    # The filter leaves a row's slots past its count unwritten: torch.topk's timing (it reads
    # every slot) wants defined keys there.
    keys.masked_fill_(torch.arange(cap, device=keys.device) >= counts[..., None],
                      torch.iinfo(torch.int64).min)
    spare = torch.empty_like(keys)

    def copy_all():
        for _ in chunks:
            spare.copy_(keys)

    def select_all():  # the select compacts its buffer in place: a fresh copy each time
        for _ in chunks:
            spare.copy_(keys)
            hytopk_sm90.select_survivors(spare, counts, topk, order="score", options=opts)

    def select_torch_all():
        for _ in chunks:
            torch.topk(keys, topk, dim=-1)

    copy = time_ms(copy_all, reps=reps, warmup=1)
    # The sample's threshold pick alone: torch.topk over the last sample chunk's Gluon table
    # (every row seeing keys), as often as the sample has chunks.
    from megatron_hyscale.ops.kernels.indexer_scores_sm90 import indexer_table_sm90

    plan = hytopk_sm90.sample_plan(T, topk, opts.scores_sm90_samples, opts)
    stride = plan.stride
    s0 = max(0, T - plan.chunk_rows)
    sample_chunks = len(plan.chunks)
    try:
        table = indexer_table_sm90(q[:1], k[:1, ::stride].contiguous(), w[:1], stride, s0, T,
                                   relu=relu)[0]
        rank = math.ceil(hytopk_sm90.SURVIVOR_MARGIN * topk * table.shape[1] / T)

        def sample_topk_all():
            for _ in range(B * sample_chunks):
                torch.topk(table, rank, dim=1)

        sample_topk = time_ms(sample_topk_all, reps=reps, warmup=1)
    except Exception as exc:  # noqa: BLE001  (reported, not hidden)
        print(f"sample_topk failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        table, sample_topk = None, None
    sample_pick = None
    if table is not None:
        try:  # the newer kernel: its failure must not cost torch.topk's time
            ranks = torch.full((table.shape[0],), rank, device=table.device)

            def sample_pick_all():
                for _ in range(B * sample_chunks):
                    row_rank.rank_values(table, ranks)

            sample_pick = time_ms(sample_pick_all, reps=reps, warmup=1)
            if not torch.equal(row_rank.rank_values(table, ranks).view(torch.int32),
                               row_rank.rank_values_reference(table, ranks).view(torch.int32)):
                print("sample_pick: rank_values differ from torch.topk's", file=sys.stderr)
                sample_pick = float("nan")
        except Exception as exc:  # noqa: BLE001  (reported, not hidden)
            print(f"sample_pick failed: {type(exc).__name__}: {str(exc)[:300]}",
                  file=sys.stderr)
    try:  # the newer variant: its failure must not cost the other phases' timings
        filter_scan = time_ms(lambda: filter_all(scan_slots=True), reps=reps, warmup=1)
    except Exception as exc:  # noqa: BLE001  (reported, not hidden)
        print(f"filter_scan failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        filter_scan = None
    select_key = select_key_direct = direct_equal = None
    try:  # the newer kernels: their failure must not cost the other phases' timings
        # In key order over the scan slots' buffers, as the layers select: the compacting
        # select (its copy's time taken off) and the direct one (no copy: keys left as they are).
        scan_keys, scan_counts = indexer_filter_sm90(q, k, w, tau[:, :t1].contiguous(), 0, t1,
                                                     cap, relu=relu, scan_slots=True)
        direct = replace(opts, scores_sm90_direct_select=True)

        def select_key_all(options, fresh):
            for _ in chunks:
                if fresh:
                    spare.copy_(scan_keys)
                hytopk_sm90.select_survivors(spare if fresh else scan_keys, scan_counts, topk,
                                             order="key", options=options, keys_in_order=True)

        select_key = max(0.0, time_ms(lambda: select_key_all(opts, True), reps=reps,
                                      warmup=1) - copy)
        select_key_direct = time_ms(lambda: select_key_all(direct, False), reps=reps, warmup=1)
        spare.copy_(scan_keys)
        want = hytopk_sm90.select_survivors(spare, scan_counts, topk, order="key",
                                            options=opts, keys_in_order=True)
        got = hytopk_sm90.select_survivors(scan_keys, scan_counts, topk, order="key",
                                           options=direct, keys_in_order=True)
        direct_equal = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
        if not direct_equal:
            print("select_key_direct: rows differ from the compacting select's", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001  (reported, not hidden)
        print(f"select_key failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
    gluon = replace(opts, scores_sm90_sample_table=True)
    try:  # the newer kernel: its failure must not cost the other phases' timings
        sample_gluon = time_ms(lambda: hytopk_sm90.sample_thresholds(
            q, k, w, topk, opts.scores_sm90_samples, options=gluon, relu=relu), reps=reps,
            warmup=1)
    except Exception as exc:  # noqa: BLE001  (reported, not hidden)
        print(f"sample_gluon failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        sample_gluon = None
    return {"sample": time_ms(lambda: hytopk_sm90.sample_thresholds(
                q, k, w, topk, opts.scores_sm90_samples, options=opts, relu=relu), reps=reps,
                warmup=1),
            "sample_gluon": sample_gluon,
            "sample_topk": sample_topk,
            "sample_pick": sample_pick,
            "filter": time_ms(filter_all, reps=reps, warmup=1),
            "filter_scan": filter_scan,
            "select": max(0.0, time_ms(select_all, reps=reps, warmup=1) - copy),
            "select_key": select_key,
            "select_key_direct": select_key_direct,
            "select_key_direct_equal": direct_equal,
            "select_torch": time_ms(select_torch_all, reps=reps, warmup=1)}


def default_path_phases(q, k, w, topk, reps, relu=True, order="key"):
    """The steps of `hytopk_sm90` as HyTopKOptions.DEFAULT runs them (the layers' order "key"),
    timed apart on the same inputs (ms): fold (relu=False: the folded query's parts), sample
    (the thresholds), filter (every row chunk's survivors, the buffers kept), select (every
    chunk's select over those buffers; a compacting select on copies, their time taken off),
    redo (the Triton kernel over the rows this call redoes, redone_rows their count) and
    total (the op in one call: its sum with what lies between them, the masks and output
    writes)."""
    from megatron_hyscale.ops.kernels import hytopk_sm90

    opts = replace(HyTopKOptions.DEFAULT, scores_sm90=True)
    part_major = not relu and opts.scores_sm90_folded_part_major

    def fold():
        return (q, w) if relu else hytopk_sm90.folded_parts(q, w, part_major=part_major)

    q_in, w_in = fold()
    B, T = q.shape[:2]
    cap = hytopk_sm90.survivor_cap(topk)
    filter_fn = hytopk_sm90.default_filter(opts, relu)

    def sample():
        return hytopk_sm90.sample_thresholds(q_in, k, w_in, topk, opts.scores_sm90_samples,
                                             options=opts, relu=relu)

    tau = sample()
    chunks = hytopk_sm90.row_chunks(B, T, topk)
    buffers = []

    def filter_all():
        buffers.clear()
        for t0, t1 in chunks:
            buffers.append(filter_fn(q_in, k, w_in, tau[:, t0:t1].contiguous(), t0, t1, cap,
                                     relu=relu))

    filter_ms = time_ms(filter_all, reps=reps, warmup=1)
    in_place = not (opts.scores_sm90_direct_select and opts.scores_sm90_scan_slots
                    and order == "key")  # the compacting select rewrites its buffer
    spare = torch.empty_like(buffers[0][0]) if in_place else None

    def copy_all():
        for keys, _ in buffers:
            spare[:, :keys.shape[1]].copy_(keys)

    def select_all():
        for keys, counts in buffers:
            if in_place:
                spare[:, :keys.shape[1]].copy_(keys)
                keys = spare[:, :keys.shape[1]]
            hytopk_sm90.select_survivors(keys, counts, topk, order=order, options=opts,
                                         keys_in_order=opts.scores_sm90_scan_slots)

    select_ms = time_ms(select_all, reps=reps, warmup=1)
    if in_place:
        select_ms = max(0.0, select_ms - time_ms(copy_all, reps=reps, warmup=1))
    redo = torch.cat([hytopk_sm90.missed_rows(counts, t0, topk)
                      for (t0, _), (_, counts) in zip(chunks, buffers)], dim=1)
    buffers.clear()
    indices = torch.empty(B, T, topk, dtype=torch.int32, device=q.device)
    scores = torch.empty(B, T, topk, dtype=torch.float32, device=q.device)
    n_redo = int(redo.sum())
    redo_ms = time_ms(lambda: hytopk_sm90.redo_rows(
        q, k, w, topk, redo, indices, scores, order=order, options=opts, relu=relu),
        reps=reps, warmup=1) if n_redo else 0.0
    return {"fold": 0.0 if relu else time_ms(fold, reps=reps, warmup=1),
            "sample": time_ms(sample, reps=reps, warmup=1),
            "filter": filter_ms, "select": select_ms, "redo": redo_ms, "redone_rows": n_redo,
            "total": time_ms(lambda: hytopk_sm90.hytopk_sm90(q, k, w, topk, options=opts,
                                                             relu=relu, order=order),
                             reps=reps, warmup=1)}


def max_diff_vs_scoreonly(out, q, k, w, relu):
    """Largest |difference| between a scores-only method's row maxima and the Triton
    scores-only kernel's (fp32 rounding order differs), over rows with a visible key."""
    ref = run_scoreonly(q, k, w, 1, relu)[1].reshape(-1)  # (indices, row maxima)
    got = out.reshape(-1)
    ok = torch.isfinite(ref)
    if not torch.equal(ok, torch.isfinite(got)):
        return float("inf")
    return (got[ok] - ref[ok]).abs().max().item()


_FINISH_BUFFERS: dict = {}


def run_finish(q, k, w, topk, relu):
    """HyTopK's last pass alone: the row-chunked torch sort that orders and decodes the kernel's
    unsorted packed keys (timed on buffers of the output's shape, reused across calls)."""
    shape = (q.shape[0], q.shape[1], min(topk, k.shape[1]))
    if shape not in _FINISH_BUFFERS:
        _FINISH_BUFFERS.clear()
        hi = torch.randint(-2**31, 2**31 - 1, shape, device="cuda", dtype=torch.int32)
        _FINISH_BUFFERS[shape] = (torch.randint_like(hi, 0, 2**31 - 1), hi.view(torch.float32))
    idx, scores = _FINISH_BUFFERS[shape]
    hk._finish(idx, scores)
    return idx


def run_naive(q, k, w, topk, relu):
    from megatron.core.transformer.experimental_attention_variant.dsa import fused_qk_topk_naive

    T, S = q.shape[1], k.shape[1]
    mask = torch.full((T, S), float("-inf"), device="cuda").triu_(1 + S - T)
    _, idx = fused_qk_topk_naive(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1),
                                 topk, mask=mask, use_relu=relu)
    return idx


def run_chunked(q, k, w, topk, relu):
    T, H, D = q.shape[1:]
    S = k.shape[1]
    rows = max(1, TABLE_BYTES // (H * S * 2))
    kk = min(topk, S)
    out = torch.empty(T, kk, dtype=torch.int64, device="cuda")
    kt = k[0].t()
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        logits = (q[0, t0:t1].reshape(-1, D) @ kt).view(t1 - t0, H, S)
        if relu:
            logits.relu_()
        s = torch.bmm(w[0, t0:t1, None, :].to(logits.dtype), logits).squeeze(1).float()
        del logits
        t = torch.arange(t0, t1, device="cuda") + S - T
        s.masked_fill_(torch.arange(S, device="cuda")[None, :] > t[:, None], float("-inf"))
        out[t0:t1] = s.topk(kk, dim=-1).indices
    return out


def run_table(q, k, w, topk, relu):
    T = q.shape[1]
    S = k.shape[1]
    r = hk._prepare(q, k, w, relu, None)[4]
    rows = max(r, (TABLE_BYTES // (S * 4)) // r * r)
    kk = min(topk, S)
    qpos = (torch.arange(T, device="cuda") + S - T)[None]
    kpos = torch.arange(S, device="cuda")[None]
    table = torch.empty(rows, S, device="cuda")
    out = torch.empty(T, kk, dtype=torch.int64, device="cuda")
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        hk.score_table(q, k, w, relu=relu, q_positions=qpos, k_positions=kpos, causal=True,
                       t0=t0, t1=t1, table=table)
        out[t0:t1] = table[: t1 - t0].topk(kk, dim=-1).indices
    return out


def run_cudnn(q, k, w, topk, relu, ordered=True):
    """HyScale's cudnn backend: cuDNN's SM90 scores in 1 GiB row chunks (keys cropped to the
    chunk's causal end, each chunk's global offset passed), radix top-k, HyTopK's order
    (ordered=False: key order, as cuDNN's rows come)."""
    from megatron_hyscale.ops.backends.cudnn_selection import cudnn_selection

    qpos = (torch.arange(q.shape[1], device="cuda") + k.shape[1] - q.shape[1])[None]
    return cudnn_selection(q, k, w, topk, qpos=qpos, ordered=ordered)[0]


def run_stock_cudnn(q, k, w, topk, relu):
    """megatron-core 0.19.2's cudnn backend selection, as its DSA layer calls it."""
    from megatron.core.transformer.experimental_attention_variant import dsa_cudnn_kernels

    return dsa_cudnn_kernels._indexer_topk_bshd(q, k, w, topk, return_scores=False)[0]


# Query rows a block in megatron-core's TileLang selection (DSAttention's
# fused_indexer_block_size default): each block's fp32 [rows, S] score table is written, then
# torch.topk; 4 GiB at 128K, 8 GiB at 256K.
TILELANG_BLOCK_ROWS = 8192


def run_stock_tilelang(q, k, w, topk, relu):
    """megatron-core 0.19.2's tilelang backend selection, as its DSA layer calls it
    (dsa_kernels.run_fused_qk_topk): [S, B, ...] tensors, each row's causal key bounds
    [0, t + 1) (build_fused_indexer_varlen_bounds), blocks of TILELANG_BLOCK_ROWS rows."""
    from megatron.core.transformer.experimental_attention_variant import dsa_tilelang_kernels

    T = q.shape[1]
    ends = torch.arange(1, T + 1, device=q.device, dtype=torch.int32)
    starts = torch.zeros_like(ends)
    out = dsa_tilelang_kernels.run_fused_qk_topk(
        q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1), topk, starts, ends,
        TILELANG_BLOCK_ROWS, use_relu=relu)
    if out is None:  # the stock layer would fall back to its unfused path: not what is timed
        raise RuntimeError("megatron-core's TileLang selection declined these inputs")
    return out[0]


def with_options(run, **fields):
    """A method: `run` (run_hytopk, run_scoreonly or run_hytopk_fp8) with these HyTopKOptions
    fields changed from the defaults."""
    options = replace(HyTopKOptions.DEFAULT, **fields)

    def method(q, k, w, topk, relu):
        return run(q, k, w, topk, relu, options)

    return method


# Three programs an SM instead of two (the profiled kernels wait on their own wgmma with 8 warps
# an SM): the select kernel capped at 168 registers (its 255 hold an SM to 2 programs), two
# stages where three would not fit V3.2's shared memory three times.
OCC3 = dict(programs_per_sm=3, maxnreg=168, num_stages=2)
# Methods that run a kernel with some HyTopKOptions fields changed: name -> (runner, fields).
OPTION_METHODS = {
    "hytopk_prune": (run_hytopk, dict(prune=True)),
    "hytopk_heads_on_m": (run_hytopk, dict(keys_on_m=False)),
    "hytopk_scan_slots": (run_hytopk, dict(atomic_slots=False)),
    "hytopk_folded_fp32": (run_hytopk, dict(folded_parts=False)),
    "hytopk_sort_bitonic": (run_hytopk, dict(row_sort="bitonic")),  # the previous row sort
    "hytopk_append_tl": (run_hytopk, dict(append_ptx=False)),  # tl.store / tl.atomic_add
    "hytopk_key_tma": (run_hytopk, dict(key_tma=True)),  # key tiles through TMA
    "scoreonly_key_tma": (run_scoreonly, dict(key_tma=True)),
    "hytopk_occ3": (run_hytopk, OCC3),
    "hytopk_occ3_s3": (run_hytopk, dict(OCC3, num_stages=3)),
    "scoreonly_occ3": (run_scoreonly, dict(OCC3, maxnreg=None)),
    "scoreonly_heads_on_m": (run_scoreonly, dict(keys_on_m=False)),
    "scoreonly_head_major": (run_scoreonly, dict(head_major=True)),
    "hytopk_fp8_promote32": (run_hytopk_fp8, dict(fp8_imprecise_acc=32)),
}


# HyTopK's Gluon path (`run_hytopk_scores_sm90`) by its arguments, one entry a method: each is
# a variant compared with the default's rows (VARIANT_METHODS; in key order those with order
# "key": KEY_ORDER_METHODS), runs on Gluon kernels (GLUON_METHODS) and at every length.
_TABLE_RADIX = dict(sample_table=True, sample_pick="radix")
_SCAN_KEY = dict(_TABLE_RADIX, scan_slots=True, order="key")
GLUON_SELECTIONS = {
    "hytopk_scores_sm90": {},
    "hytopk_scores_sm90_immediate": dict(defer_store=False),
    "hytopk_scores_sm90_gluon_sample": dict(sample_table=True),
    "hytopk_scores_sm90_gluon_sample_x4": dict(sample_table=True, samples=8192),
    "hytopk_scores_sm90_radix_pick": _TABLE_RADIX,
    "hytopk_scores_sm90_scan_slots": dict(_TABLE_RADIX, scan_slots=True),
    "hytopk_scores_sm90_ahead": dict(_TABLE_RADIX, scan_slots=True, mma_ahead=True),
    "hytopk_scores_sm90_part_major": dict(_TABLE_RADIX, scan_slots=True, folded_part_major=True),
    # In key order, as the layers select: the scan's buffers need no row sort then.
    "hytopk_scores_sm90_radix_pick_key": dict(_TABLE_RADIX, order="key"),
    "hytopk_scores_sm90_scan_slots_key": _SCAN_KEY,
    # That with each product issued before the last one's epilogue, 4 and 6 key tiles in flight.
    "hytopk_scores_sm90_ahead_key": dict(_SCAN_KEY, mma_ahead=True),
    "hytopk_scores_sm90_ahead6_key": dict(_SCAN_KEY, mma_ahead=True, stages=6),
    # The folded query's parts part-major (no effect with ReLU), and that with the product ahead.
    "hytopk_scores_sm90_part_major_key": dict(_SCAN_KEY, folded_part_major=True),
    "hytopk_scores_sm90_part_major_ahead_key": dict(_SCAN_KEY, folded_part_major=True,
                                                    mma_ahead=True),
    # Today's default path (2026-12-07): the product ahead, the folded parts part-major, the
    # survivors' select written straight to the rows (in score order the row sort remains).
    "hytopk_scores_sm90_current": dict(_TABLE_RADIX, scan_slots=True, mma_ahead=True,
                                       folded_part_major=True, direct_select=True,
                                       sample_min_rank=48),
    "hytopk_scores_sm90_current_key": dict(_SCAN_KEY, mma_ahead=True, folded_part_major=True,
                                           direct_select=True, sample_min_rank=48),
    # The survivors' select written straight to the rows (no in-place compaction).
    "hytopk_scores_sm90_direct_key": dict(_SCAN_KEY, direct_select=True),
    "hytopk_scores_sm90_part_major_direct_key": dict(_SCAN_KEY, folded_part_major=True,
                                                     direct_select=True),
    # Today's default path in key order with the sample fixed at scores_sm90_samples keys
    # (as before scores_sm90_sample_min_rank: the same below 128K keys at top-2048).
    "hytopk_scores_sm90_fixed_sample_key": dict(_SCAN_KEY, mma_ahead=True,
                                                folded_part_major=True, direct_select=True,
                                                sample_min_rank=None),
    # That with twice the sample (a row's threshold near its 96th best sampled key: from 64K
    # keys at top-2048), fewer rows redone for a sample table twice as wide.
    "hytopk_scores_sm90_rank96_key": dict(_SCAN_KEY, mma_ahead=True, folded_part_major=True,
                                          direct_select=True, sample_min_rank=96),
    # Today's default path in key order with the head sum's quad step as a layout change.
    "hytopk_scores_sm90_transpose_key": dict(_SCAN_KEY, mma_ahead=True, folded_part_major=True,
                                             direct_select=True, head_sum_transpose=True,
                                             sample_min_rank=48),
}


METHODS = {
    "hytopk": run_hytopk,
    "hytopk_default": run_hytopk_default,
    "hytopk_default_key": functools.partial(run_hytopk_default, order="key"),
    "scoreonly": run_scoreonly,
    "hytopk_fp8": run_hytopk_fp8,
    "scoreonly_fp8": run_scoreonly_fp8,
    "scoreonly_sm90": run_scoreonly_sm90,
    "scoreonly_sm90_free": functools.partial(run_scoreonly_sm90, pingpong=False),
    "scoreonly_sm90_ahead": functools.partial(run_scoreonly_sm90, mma_ahead=True),
    "scoreonly_sm90_part_major": functools.partial(run_scoreonly_sm90, part_major=True),
    "scoreonly_sm90_transpose": functools.partial(run_scoreonly_sm90, mma_ahead=True,
                                                  head_sum_transpose=True),
    **{name: functools.partial(run_hytopk_scores_sm90, **fields)
       for name, fields in GLUON_SELECTIONS.items()},
    "hytopk_fp8_scores_sm90": run_hytopk_fp8_scores_sm90,
    "scoreonly_sm90_fp8": run_scoreonly_sm90_fp8,
    **{name: with_options(run, **fields) for name, (run, fields) in OPTION_METHODS.items()},
    **{name: select_variant(name) for name in SELECT_VARIANTS},
    "hytopk_select_unordered": select_variant("hytopk_select", ordered=False),
    "finish": run_finish,
    "naive": run_naive,
    "chunked": run_chunked,
    "table": run_table,
    "cudnn": run_cudnn,
    "cudnn_key": functools.partial(run_cudnn, ordered=False),
    "stock_cudnn": run_stock_cudnn,
    "stock_tilelang": run_stock_tilelang,
}
# Library paths: cuDNN's DSA indexer applies ReLU and takes token keys only.
LIBRARY_METHODS = ("cudnn", "cudnn_key", "stock_cudnn")
# Paths compared with HyTopK row by row, each compiled untimed at every length: the library
# paths and megatron's TileLang selection (its kernels take any length: the call keeps JIT
# work and first-touch allocations out of the timings, as for cuDNN).
COMPARED_METHODS = LIBRARY_METHODS + ("stock_tilelang",)


# (method, config) pairs already compiled with 64-bit integer arguments (see bench_one), and
# the methods that launch the HyTopK kernel (table-then-select's scoring pass included).
WIDE_COMPILED = set()
# The select variants, compared with the default kernel's outputs (same_as_hytopk).
VARIANT_METHODS = tuple(SELECT_VARIANTS) + ("hytopk_select_unordered", "hytopk_sort_bitonic",
                                             "hytopk_occ3", "hytopk_occ3_s3",
                                             "hytopk_append_tl", "hytopk_key_tma",
                                             *GLUON_SELECTIONS,
                                             "hytopk_default", "hytopk_default_key")
# What ops.hytopk runs by default (it switches kernels with the length: a first call at a
# length may compile, so it is made untimed).
DEFAULT_METHODS = ("hytopk_default", "hytopk_default_key")
KERNEL_METHODS = VARIANT_METHODS + ("scoreonly_head_major", "scoreonly_occ3",
                                     "scoreonly_key_tma") + (
                  "hytopk", "hytopk_prune", "hytopk_heads_on_m", "hytopk_scan_slots",
                  "hytopk_folded_fp32",
                  "scoreonly", "scoreonly_heads_on_m", "table", "hytopk_fp8",
                  "hytopk_fp8_promote32", "scoreonly_fp8")
# The fp8 selections, compared with the bf16 one (overlap_vs_bf16) at every length to 128K.
FP8_METHODS = ("hytopk_fp8", "hytopk_fp8_promote32", "hytopk_fp8_scores_sm90")
# Issue #21's goal for the fp8 selection at 128K: this fraction of the bf16 GEMM floor.
FP8_GOAL_X_FLOOR = 0.65


def bench_one(method, T, cfg, kind, rate, reps, extras=True):
    """One method's record at one length; extras=False: its time and memory alone (the
    later rounds of `--rounds`: the comparisons and phases ran in the first)."""
    H, D, topk, relu = CONFIGS[cfg]
    q, k, w = config_inputs(T, cfg, kind)
    fn = METHODS[method]
    floor = floor_ms(T, k.shape[1], H, D, rate)
    rec = {"method": method, "config": cfg, "T": T, "S": k.shape[1], "inputs": kind,
           "floor_ms": floor, "H": H, "D": D, "topk": topk, "relu": relu}
    try:
        # Triton passes an integer argument of 2^31 or more as 64-bit: a second binary, which
        # the 4K warm-up did not build. The HyTopK kernel's largest is the batch stride of the
        # query it gets (T x H x D under ReLU, e.g. 256K x 64 x 128 = 2^31; T x D for the
        # folded relu=False query) or of k: run the first such length once untimed.
        q_stride = T * (H if relu else 1) * D
        if (method in KERNEL_METHODS and max(q_stride, k.stride(0)) >= 2**31
                and (method, cfg) not in WIDE_COMPILED):
            fn(q, k, w, topk, relu)
            WIDE_COMPILED.add((method, cfg))
        # cuDNN's kernels are JIT-compiled per shape (each chunk's cropped key count, each
        # top-k width): compile this length's untimed (on 2026-12-01 a 64-head first call at
        # 64K took 4.3 s against 59 ms for 32 heads once compiled). megatron's TileLang
        # kernels take dynamic lengths (compiled once a head count, at the 4K warm-up), but
        # get the same untimed call.
        # hytopk_default switches kernels with the length (the Gluon path from 16K keys): its
        # first call at a length may compile, untimed too.
        if method in COMPARED_METHODS or method in DEFAULT_METHODS:
            fn(q, k, w, topk, relu)
        # First call: peak memory and one event-timed run (the warm-ups compiled the kernels:
        # at 4K, and above for 64-bit arguments). Long runs stop there.
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def timed():
            a.record()
            out = fn(q, k, w, topk, relu)
            b.record()
            return out

        mem = peak_extra(timed)
        first_ms = a.elapsed_time(b)
        if first_ms > 2000:
            ms, n = first_ms, 1
        else:
            n = reps
            ms = time_ms(lambda: fn(q, k, w, topk, relu), reps=n, warmup=1)
        rec.update(ms=ms, mem_gib=mem / GiB, x_floor=ms / floor, reps=n)
        if not extras:
            torch.cuda.empty_cache()
            return rec
        if method == "hytopk_prune":
            share, same = pruned_share(q, k, w, topk, relu)
            rec.update(pruned_share=share, same_as_unpruned=same)
        if method == "hytopk_fp8":
            rec.update(quant_ms=time_ms(lambda: quantize_indexer(q, k), reps=n, warmup=1),
                       goal_x_floor=FP8_GOAL_X_FLOOR)
        if method in FP8_METHODS and T <= SAME_SET_MAX_T:
            rec.update(overlap_vs_bf16=overlap_with_bf16(fn(q, k, w, topk, relu)[0], q, k, w,
                                                         topk, relu))
        if method in VARIANT_METHODS and T <= SAME_SET_MAX_T:
            rec.update(agreement_with_hytopk(method, fn(q, k, w, topk, relu), q, k, w, topk,
                                             relu))
        if "sample_keys" in SELECT_VARIANTS.get(method.removesuffix("_unordered"), {}):
            stats = torch.zeros(2, dtype=torch.int32, device="cuda")
            fn(q, k, w, topk, relu, sample_stats=stats)
            guessed, redone = stats.tolist()
            rec.update(sampled_rows_share=guessed / (q.shape[0] * q.shape[1]),
                       redone_blocks=redone)
        if method.startswith("hytopk_scores_sm90") or method == "hytopk_fp8_scores_sm90":
            stats = torch.zeros(2, dtype=torch.int64, device="cuda")
            fn(q, k, w, topk, relu, stats=stats)
            rec.update(redone_rows_share=stats[0].item() / stats[1].item())
            if method == "hytopk_scores_sm90":
                rec.update(phase_ms=scores_sm90_phases(q, k, w, topk, n, relu))
            if method == "hytopk_scores_sm90_current_key":
                rec.update(path_ms=default_path_phases(q, k, w, topk, n, relu))
        if method in SM90_SCORE_METHODS:
            rec.update(max_diff_vs_scoreonly=max_diff_vs_scoreonly(
                fn(q, k, w, topk, relu), q, k, w, relu))
        if method in COMPARED_METHODS and T <= SAME_SET_MAX_T:
            rec.update(same_rows_as_hytopk=same_sets_as_hytopk(fn(q, k, w, topk, relu),
                                                                q, k, w, topk, relu))
    except torch.OutOfMemoryError:
        rec.update(ms=None, mem_gib=None, x_floor=None, status="OOM")
    torch.cuda.empty_cache()
    return rec


def round_order(methods: list[str], rounds: int) -> list[str]:
    """The methods as `--rounds` times them: each round rotated one place, so each method
    runs first once every len(methods) rounds (the first timed after a length change ran 3-4%
    slower on an H100, and a machine's clocks drift between rounds)."""
    n = len(methods)
    return [methods[(r + i) % n] for r in range(rounds) for i in range(n)]


def merge_rounds(recs: list[dict]) -> list[dict]:
    """One record a method from its rounds (same config, length and inputs), in first-round
    order: the first round's record (its comparisons and phases), ms the median of the rounds'
    (ms_rounds: each round's, in order), x_floor from it. A round without a time (OOM) leaves
    ms_rounds a None and the median to the others (memory and status from the first round
    with a time)."""
    merged: dict[str, dict] = {}
    for rec in recs:
        first = merged.setdefault(rec["method"], {**rec, "ms_rounds": []})
        first["ms_rounds"].append(rec.get("ms"))
        if first.get("ms") is None and rec.get("ms") is not None:
            # the first round ran out of memory, this one did not: its memory and status
            first.update(mem_gib=rec.get("mem_gib"), ms=rec["ms"])
            first.pop("status", None)
    for rec in merged.values():
        times = [t for t in rec["ms_rounds"] if t is not None]
        if times:
            rec["ms"] = statistics.median(times)
            rec["x_floor"] = rec["ms"] / rec["floor_ms"]
    return list(merged.values())


# The Gluon scores-only methods, compared with the Triton scores-only kernel's row maxima.
SM90_SCORE_METHODS = ("scoreonly_sm90", "scoreonly_sm90_free", "scoreonly_sm90_ahead",
                      "scoreonly_sm90_transpose")
# Methods on Gluon kernels: Hopper only (no interpreter).
GLUON_METHODS = SM90_SCORE_METHODS + (*GLUON_SELECTIONS, "hytopk_fp8_scores_sm90",
                                      "scoreonly_sm90_fp8")
# Longest T at which the library paths' selections are compared with HyTopK's, row by row.
SAME_SET_MAX_T = 131072


def same_sets_as_hytopk(idx, q, k, w, topk, relu, ref=None):
    """Share of rows whose selected set equals HyTopK's Triton kernel's (in any order; -1
    slots ignored): the same reference at every length, whichever path the default runs.
    ref: that kernel's indices where the caller has them."""
    ref = (run_hytopk(q, k, w, topk, relu)[0] if ref is None else ref)[0].long()
    got = idx.reshape(ref.shape).long()
    return (got.sort(-1).values == ref.sort(-1).values).all(-1).float().mean().item()


# Variants whose rows come in no order (compared as sets), and in key order (compared with
# the default's rows sorted by index: a broken key order shows).
SET_COMPARED_METHODS = ("hytopk_select_unordered",)
KEY_ORDER_METHODS = (*(name for name, fields in GLUON_SELECTIONS.items()
                       if fields.get("order") == "key"), "hytopk_default_key")


def agreement_with_hytopk(method, out, q, k, w, topk, relu):
    """A variant's record fields: same_as_hytopk (its outputs the default kernel's bit for bit;
    unordered methods: the same sets) and, where not, same_rows_as_hytopk (the share of rows
    whose selected set is the Triton kernel's: scores summed in another fp32 order can swap
    near-tied keys at a row's boundary)."""
    same = same_as_default(out, q, k, w, topk, relu,
                           ordered=method not in SET_COMPARED_METHODS,
                           key_order=method in KEY_ORDER_METHODS)
    if same:
        return {"same_as_hytopk": True}
    ref = default_outputs(q, k, w, topk, relu)[0]  # kept by same_as_default: not rerun
    return {"same_as_hytopk": False,
            "same_rows_as_hytopk": same_sets_as_hytopk(out[0], q, k, w, topk, relu, ref)}


def library_unavailable_reason(method, cfg):
    """Why a library method (or megatron's TileLang selection) cannot run this config here
    (None when it can)."""
    if method == "stock_tilelang":
        captured = CAPTURED.get("q")
        if cfg == "captured" and (captured is None or captured.dtype != torch.bfloat16):
            what = "not loaded" if captured is None else str(captured.dtype)
            return f"megatron's TileLang selection takes bf16 inputs; the capture is {what}"
        return tilelang_unavailable()
    if method not in LIBRARY_METHODS:
        return None
    if not CONFIGS[cfg][3]:
        return "no ReLU: cuDNN's DSA indexer always applies it"
    from megatron_hyscale.ops.backends.availability import CUDNN, library_unavailable

    return library_unavailable(CUDNN, torch.device("cuda"))


def check_structured_exact(T, cfg):
    """HyTopK on structured inputs must equal the reference (checked at the smallest T)."""
    H, D, topk, relu = CONFIGS[cfg]
    q, k, w = make_inputs(T, H, D, "structured")
    a = hytopk(q, k, w, topk, relu=relu, backend="triton")
    b = hytopk(q, k, w, topk, relu=relu, backend="reference")
    # bf16 inputs: the order of fp32 sums differs; report the share of identical rows.
    return (a[0] == b[0]).all(-1).float().mean().item()


# Launch variants the sweep times: (warps, stages, programs per SM, keys per tile, keys on M,
# query rows a program or None for the default, smallest candidate buffer a row or None for
# HyTopKOptions.min_cap); the first is the kernel's default (3 stages since 2026-11-30; every
# variant runs with the default HyTopKOptions.group_slack_div, 2 since then, 4 before). Rows 4
# with 64 heads makes the GEMM's N 256: half the L2 reads of each key tile per FLOP (compiled
# for sm_90a: 249 registers, no spills, 1 program/SM).
SWEEP_VARIANTS = ((4, 3, 2, 64, True, None, None), (4, 2, 2, 64, False, None, None),
                  (8, 2, 1, 64, True, 4, None), (8, 3, 1, 64, True, 4, None),
                  (8, 2, 2, 128, True, None, None), (4, 2, 2, 64, True, None, None),
                  (4, 2, 3, 64, True, None, None), (8, 2, 1, 128, True, None, None),
                  (8, 2, 2, 64, False, None, None), (4, 2, 2, 64, True, None, 8192))
# With few heads (QSA's 4) every score costs little GEMM, and the per-row work (candidate
# appends, buffer compactions) dominates: rows a program, tile width, and a larger buffer
# (fewer compactions: QSA's top 512 in a 1024-entry buffer compacts every ~384 candidates).
SWEEP_VARIANTS_SMALL_HEADS = ((4, 3, 2, 64, True, None, None), (4, 2, 2, 64, True, None, 2048),
                              (4, 2, 2, 64, True, None, 4096), (4, 2, 2, 64, True, 8, 2048),
                              (4, 2, 2, 128, True, None, 2048), (4, 2, 3, 64, True, None, 2048),
                              (4, 2, 2, 64, True, 32, 2048), (4, 2, 2, 64, True, None, 1024))


# Without ReLU each row is one folded query, which with bf16 keys runs as three bf16 parts on
# the keys-on-M path (4 padded heads, 16 rows a program by default): rows a program and the
# tile, as for QSA's 4 heads, and a larger buffer (top-2048 here against QSA's 512).
SWEEP_VARIANTS_FOLDED = ((4, 3, 2, 64, True, None, None), (4, 3, 2, 64, True, 8, None),
                         (4, 3, 2, 64, True, 32, None), (4, 3, 2, 128, True, None, None),
                         (4, 2, 2, 64, True, None, None), (4, 3, 3, 64, True, None, None),
                         (4, 3, 2, 64, True, None, 8192))


def _sweep_variants(cfg):
    """The launch variants `sweep` times for config `cfg`."""
    heads, _, _, relu = CONFIGS[cfg]
    if not relu:
        return SWEEP_VARIANTS_FOLDED
    return SWEEP_VARIANTS_SMALL_HEADS if heads < hk.SMALL_HEADS else SWEEP_VARIANTS


def _sweep_setup(T, cfg):
    """Random inputs of config `cfg` at length T, their positions, and the GEMM floor (ms)."""
    H, D, _, _ = CONFIGS[cfg]
    q, k, w = config_inputs(T, cfg, "random")
    qpos, kpos = positions(T, k.shape[1])
    return (q, k, w), qpos, kpos, floor_ms(T, k.shape[1], H, D, matmul_tflops() * 1e12)


def _time_variant(tag, cfg, T, name, programs_per_sm, inputs, launch, floor, reps):
    """Time hk._launch(*inputs, top-k, **launch) with `programs_per_sm`, log one line and
    return its record; a variant that fails (e.g. does not fit in shared memory) is logged and
    recorded as such."""
    q, k, w = inputs
    topk = CONFIGS[cfg][2]
    launch = dict(launch, options=replace(launch["options"], programs_per_sm=programs_per_sm))
    label = f"{tag} {cfg} T={T} mode={launch['mode']} {name}"
    rec = {"config": cfg, "T": T, "mode": "select" if launch["mode"] == hk.MODE_SELECT
           else "scores_only", "variant": name, "floor_ms": floor}
    try:
        ms = time_ms(lambda: hk._launch(q, k, w, topk, **launch), reps=reps)
        log(f"{label}: {ms:.2f} ms  x{ms / floor:.2f} floor")
        rec.update(ms=ms, x_floor=ms / floor)
    except Exception as err:
        log(f"{label} failed: {err!r:.200}")
        rec.update(error=f"{err!r:.200}")
    return rec


def sweep(T, cfg, reps):
    """Time kernel launch variants (warps, pipeline stages, programs per SM, tile) for tuning."""
    inputs, qpos, kpos, floor = _sweep_setup(T, cfg)
    relu = CONFIGS[cfg][3]
    variants = _sweep_variants(cfg)
    recs = []
    for mode in (hk.MODE_SCORES_ONLY, hk.MODE_SELECT):
        for nw, ns, pps, bn, kom, rows, cap in variants:
            if mode == hk.MODE_SCORES_ONLY and cap is not None:
                continue  # the buffer does not exist without the top-k
            options = replace(HyTopKOptions.DEFAULT, block_n=bn, num_warps=nw, num_stages=ns,
                              keys_on_m=kom, rows=rows,
                              min_cap=cap or HyTopKOptions.DEFAULT.min_cap)
            launch = dict(relu=relu, q_positions=qpos, k_positions=kpos, causal=True,
                          mode=mode, options=options)
            name = (f"warps={nw} stages={ns} per_sm={pps} bn={bn} keys_on_m={kom} "
                    f"rows={rows or 'default'} min_cap={cap or 'default'}")
            recs.append(_time_variant("sweep", cfg, T, name, pps, inputs, launch, floor, reps))
    return recs


# Tile-group variants (buffer slack divisor, i.e. HyTopKOptions.group_slack_div, pipeline
# stages, programs per SM, smallest buffer or None for HyTopKOptions.min_cap). The kernel
# streams key tiles in groups of NT = slack / (divisor x BN) and checks its buffers between
# groups: larger groups mean fewer checks but earlier compactions.
GROUP_SWEEP_VARIANTS = ((4, 2, 2, None), (2, 2, 2, None), (1, 2, 2, None), (4, 3, 2, None),
                        (2, 3, 2, None), (1, 3, 2, None), (4, 2, 2, 8192), (2, 2, 2, 8192),
                        (4, 3, 2, 8192), (2, 3, 3, None), (1, 3, 3, None))


def group_sweep(T, cfg, reps):
    """Time score-only and select per tile-group variant (see GROUP_SWEEP_VARIANTS). Both modes
    launch with the config's top-k, so score-only has the select mode's groups (the
    `scoreonly` method launches top-1, whose larger slack makes longer groups; the group size
    did not change the score-only time on the H200, 2026-11-30)."""
    inputs, qpos, kpos, floor = _sweep_setup(T, cfg)
    recs = []
    for div, ns, pps, cap in GROUP_SWEEP_VARIANTS:
        for mode in (hk.MODE_SCORES_ONLY, hk.MODE_SELECT):
            options = replace(HyTopKOptions.DEFAULT, num_stages=ns, group_slack_div=div,
                              min_cap=cap or HyTopKOptions.DEFAULT.min_cap)
            launch = dict(relu=CONFIGS[cfg][3], q_positions=qpos, k_positions=kpos, causal=True,
                          mode=mode, options=options)
            name = f"div={div} stages={ns} per_sm={pps} min_cap={cap or 'default'}"
            recs.append(_time_variant("groups", cfg, T, name, pps, inputs, launch, floor, reps))
    return recs


# What hytopk_default ran: the defaults of the day (scripts/measured_defaults.py trusts a
# record's hytopk_default row as the current default's time only if they are today's).
DEFAULT_OPTIONS_META = {"hytopk_default_options": dataclasses.asdict(HyTopKOptions.DEFAULT)}


def write_json(records, dev, rate, bw, out):
    for cfg in sorted({r["config"] for r in records}):
        save_record(f"bench_selection{TAG}", cfg, [r for r in records if r["config"] == cfg],
                    matmul=rate / 1e12, copy=bw / 1e12, extra=DEFAULT_OPTIONS_META)
    meta = {"device": dev, "matmul_tflops": rate / 1e12, "copy_tbps": bw / 1e12,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
            "git": commit(), **DEFAULT_OPTIONS_META}
    with open(os.path.join(out, f"bench_selection{TAG}.json"), "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)


def summary(records, kinds, configs, Ts):
    """Markdown table: one row per (inputs, config, T); baselines as 'ms (GiB)'."""
    by = {(r["inputs"], r["config"], r["T"], r["method"]): r for r in records}

    def cell(key):
        r = by.get(key)
        if r is None:
            return "-"
        if r.get("status") == "OOM":
            return "OOM"
        return f"{r['ms']:.1f} ({r['mem_gib']:.2f})"

    def ratio(key, h):
        r = by.get(key)
        if r is None or r.get("ms") is None or h.get("ms") is None:
            return "-"
        return f"{r['ms'] / h['ms']:.1f}x"

    head = ("| inputs | config | T | floor ms | HyTopK ms | x floor | HyTopK GiB | score-only ms"
            " | naive ms (GiB) | chunked ms (GiB) | table ms (GiB) | chunked/HyTopK"
            " | table/HyTopK | pruned HyTopK ms | pruned share | prune speed-up"
            " | table/pruned | heads-on-M HyTopK ms | heads-on-M score-only ms"
            " | scan-slots HyTopK ms | finish ms |")
    log_table_head(head)
    for kind in kinds:
        for cfg in configs:
            for T in Ts:
                h = by.get((kind, cfg, T, "hytopk"))
                if h is None:
                    continue
                so = by.get((kind, cfg, T, "scoreonly"))
                hm = by.get((kind, cfg, T, "hytopk_heads_on_m")) or {}
                sm = by.get((kind, cfg, T, "scoreonly_heads_on_m")) or {}
                ss = by.get((kind, cfg, T, "hytopk_scan_slots")) or {}
                fi = by.get((kind, cfg, T, "finish")) or {}
                hp = by.get((kind, cfg, T, "hytopk_prune")) or {}
                key = (kind, cfg, T)
                share = hp.get("pruned_share")
                share = "-" if share is None else (
                    f"{share:.1%}" + ("" if hp.get("same_as_unpruned") else " NOT EXACT"))
                log(f"| {kind} | {cfg} | {T} | {h['floor_ms']:.1f} | {fmt(h.get('ms'), '.1f')} "
                    f"| {fmt(h.get('x_floor'), '.2f')} | {fmt(h.get('mem_gib'), '.2f')} "
                    f"| {fmt(so.get('ms') if so else None, '.1f')} | {cell(key + ('naive',))} "
                    f"| {cell(key + ('chunked',))} | {cell(key + ('table',))} "
                    f"| {ratio(key + ('chunked',), h)} | {ratio(key + ('table',), h)} "
                    f"| {fmt(hp.get('ms'), '.1f')} | {share} "
                    f"| {ratio(key + ('hytopk',), hp) if hp else '-'} "
                    f"| {ratio(key + ('table',), hp) if hp else '-'} "
                    f"| {fmt(hm.get('ms'), '.1f')} | {fmt(sm.get('ms'), '.1f')} "
                    f"| {fmt(ss.get('ms'), '.1f')} | {fmt(fi.get('ms'), '.1f')} |")


# The select variants' table: (column, method).
VARIANT_COLUMNS = (("none ms", "hytopk_plain"), ("sort ms", "hytopk_sort"),
                   ("head-major ms", "hytopk_head_major"), ("lean ms", "hytopk_lean"),
                   ("sample ms", "hytopk_sample"),
                   ("bounded ms", "hytopk_bounded"), ("all ms", "hytopk_select"),
                   ("all unordered ms", "hytopk_select_unordered"),
                   ("tl.sort ms", "hytopk_sort_bitonic"))


def variant_summary(records, kinds, configs, Ts):
    """Markdown table of the select variants against HyTopK's default, its finish pass and
    scoring alone; a variant whose outputs differ from the default's is marked NOT EXACT."""
    by = {(r["inputs"], r["config"], r["T"], r["method"]): r for r in records}
    if not any(m for *_, m in by if m in VARIANT_METHODS):
        return

    def cell(key):
        r = by.get(key) or {}
        text = fmt(r.get("ms"), ".1f")
        if r.get("same_as_hytopk") is False:
            text += " NOT EXACT"
        if r.get("redone_blocks"):
            text += f" ({r['redone_blocks']} redone)"
        return text

    log_table_head("| inputs | config | T | HyTopK ms | finish ms | score-only ms"
                   " | score-only head-major ms | "
                   + " | ".join(c for c, _ in VARIANT_COLUMNS) + " |")
    for key in itertools.product(kinds, configs, Ts):
        if any(key + (m,) in by for _, m in VARIANT_COLUMNS):
            methods = ("hytopk", "finish", "scoreonly", "scoreonly_head_major") + tuple(
                m for _, m in VARIANT_COLUMNS)
            log("| " + " | ".join([str(x) for x in key] + [cell(key + (m,)) for m in methods])
                + " |")


def log_table_head(head):
    """A blank line, a markdown table's head and its separator row."""
    log("")
    log(head)
    log("|" + "---|" * (head.count("|") - 1))


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series = {}
    for r in records:
        if r.get("ms") is None:
            continue
        series.setdefault((r["config"], r["inputs"], r["method"]), []).append(r)
    for (cfg, kind, method), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["T"])
        label = f"{method} {cfg} {kind}"
        axes[0].plot([r["T"] for r in rs], [r["ms"] for r in rs], "o-", label=label)
        axes[1].plot([r["T"] for r in rs], [max(r["mem_gib"], 1e-3) for r in rs], "o-",
                     label=label)
    floors = sorted({(r["T"], r["floor_ms"]) for r in records if r["config"] == "dsv32"})
    if floors:
        axes[0].plot(*zip(*floors), "k--", label="GEMM floor dsv32")
    for ax, yl in zip(axes, ["time (ms)", "peak extra memory (GiB)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Needs a CUDA GPU (every mode): without one it exits "
                                       "with status 2 before writing anything.")
    p.add_argument("--T", type=int, nargs="*", default=None,
                   help="sequence lengths (default: 16K to 1M; 16K and 32K with --quick)")
    p.add_argument("--configs", nargs="*", default=["dsv32", "glm51", "v4flash", "norelu"],
                   choices=list(CONFIGS),
                   help="indexer shapes: dsv32 (DeepSeek-V3.2 / GLM-5, 64 heads), glm51 (32 "
                        "heads), v4flash (DeepSeek-V4-Flash CSA, top-512), norelu (no ReLU), "
                        "qsa (Qwen3.8 QSA, 4 heads over blocks of 4); default all but qsa")
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS),
                   help="what to time (see the module docstring); default all")
    p.add_argument("--inputs", nargs="*", default=["random"],
                   choices=["random", "structured", "recency"],
                   help="input kinds: random (default; the worst case for pruning), "
                        "structured (recency + heavy hitters, like a trained indexer), recency "
                        "(a linear recency bias a tile bound can prune)")
    p.add_argument("--captured", default=None,
                   help="a trained indexer's q / k / weights (the demo's indexer_capture.pt): "
                        "runs at the capture's own length, heads, top-k and ReLU setting")
    p.add_argument("--secondary-max-T", type=int, default=131072,
                   help="configs other than dsv32 run only up to this T")
    p.add_argument("--reps", type=int, default=5,
                   help="timed calls per method and length (the median is kept)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the methods this many times at each length, each round's order "
                        "rotated one place; a record keeps the median of its rounds' times "
                        "(ms_rounds: each round's) and the first round's comparisons")
    p.add_argument("--quick", action="store_true", help="T in {16K, 32K}, 2 reps")
    p.add_argument("--sweep", action="store_true", help="time kernel variants and exit")
    p.add_argument("--group-sweep", action="store_true",
                   help="time tile-group variants (GROUP_SWEEP_VARIANTS) and exit")
    p.add_argument("--row-sort-micro", action="store_true",
                   help="time only the row output (sort + decode) of each HyTopKOptions.row_sort "
                        "and torch.sort on [T or 131072, 2048] random distinct keys, and exit")
    p.add_argument("--tag", default="", help="suffix for the JSON and PNG names")
    p.add_argument("--out", default=os.environ.get("OUT", "outputs"),
                   help="folder for bench_selection.json and the PNG (default: $OUT, else "
                        "outputs); records also go to $HYSCALE_RESULTS (default "
                        "benchmarks/results/)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    require_cuda("bench_selection.py")
    if args.captured and not os.path.isfile(args.captured):
        p.error(f"--captured {args.captured}: no such file (bash scripts/run.sh demo writes "
                "outputs/demo/indexer_capture.pt)")
    global TAG
    TAG = args.tag
    Ts = args.T or ([16384, 32768] if args.quick else ALL_T)
    if args.captured:
        Ts, args.configs, args.inputs = [load_captured(args.captured)], ["captured"], ["captured"]
    reps = 2 if args.quick else args.reps
    os.makedirs(args.out, exist_ok=True)

    if args.row_sort_micro:
        rows = (args.T or [131072])[0]
        rate, bw = matmul_tflops(), copy_tbps()
        recs = row_sort_micro(rows, 2048, reps)
        path = save_record(f"bench_selection_row_sort{TAG}", "micro", recs, matmul=rate, copy=bw)
        log(f"record: {path}")
        return
    if args.sweep or args.group_sweep:
        kind, fn = ("groups", group_sweep) if args.group_sweep else ("sweep", sweep)
        rate, bw = matmul_tflops(), copy_tbps()
        for cfg in args.configs:
            recs = [r for T in Ts for r in fn(T, cfg, reps)]
            path = save_record(f"bench_selection_{kind}{TAG}", cfg, recs, matmul=rate, copy=bw)
            log(f"record: {path}")
        return
    dev = torch.cuda.get_device_name()
    rate = matmul_tflops() * 1e12
    bw = copy_tbps() * 1e12
    log(f"device {dev}; bf16 matmul {rate / 1e12:.0f} TFLOP/s; copy {bw / 1e12:.2f} TB/s")
    records = []
    warmed = set()
    for kind in args.inputs:
        for cfg in args.configs:
            for T in Ts:
                if cfg != "dsv32" and T > args.secondary_max_T:
                    continue
                first_rec = len(records)
                for turn, method in enumerate(round_order(args.methods, args.rounds)):
                    # the limits are for S = T and 64 heads: compare the work, T x S x H
                    work = T * (T // KEY_RATIO.get(cfg, 1)) * CONFIGS[cfg][0]
                    if work > MAX_T.get(method, 1 << 40) ** 2 * 64:
                        continue
                    if cfg in KEY_RATIO and method in TOKEN_KEY_METHODS:
                        if (cfg, method) not in warmed:  # their masks assume a key per token
                            log(f"{cfg} {method}: not run (token keys only; {cfg} has "
                                f"{KEY_RATIO[cfg]} tokens a key)")
                            warmed.add((cfg, method))
                        continue
                    why_not = library_unavailable_reason(method, cfg)
                    if why_not:
                        if (cfg, method) not in warmed:
                            log(f"{cfg} {method}: not run ({why_not})")
                            warmed.add((cfg, method))
                        continue
                    if (cfg, method) not in warmed:  # compile / import outside the timings
                        H, D, topk, relu = CONFIGS[cfg]
                        warm = (make_inputs(WARM_T, H, D, "captured") if args.captured
                                else config_inputs(warm_length(cfg), cfg, "random"))
                        METHODS[method](*warm, topk, relu)
                        if method in KERNEL_METHODS and not args.captured:
                            METHODS[method](*config_inputs(
                                SAMPLED_WARM_KEYS * KEY_RATIO.get(cfg, 1), cfg, "random"),
                                topk, relu)
                        warmed.add((cfg, method))
                    if kind != "random" and method in ("naive", "chunked"):
                        continue  # dense paths: their time does not depend on the inputs
                    rec = bench_one(method, T, cfg, kind, rate, reps,
                                    extras=turn < len(args.methods))
                    records.append(rec)
                    write_json(records, dev, rate, bw, args.out)
                    log(f"{kind:10s} {cfg:8s} T={T:8d} {method:10s} "
                        f"{fmt(rec.get('ms'), '10.2f')} ms  {fmt(rec.get('mem_gib'), '7.2f')} GiB"
                        f"  x{fmt(rec.get('x_floor'), '.2f')} floor {rec.get('status', '')}"
                        + (f"  pruned {rec['pruned_share']:.1%} identical "
                           f"{rec['same_as_unpruned']}" if "pruned_share" in rec else "")
                        + (f"  overlap with bf16 {rec['overlap_vs_bf16']:.4f}"
                           if "overlap_vs_bf16" in rec else "")
                        + (f"  same as hytopk {rec['same_as_hytopk']}"
                           if "same_as_hytopk" in rec else "")
                        + (f" (same sets on {rec['same_rows_as_hytopk']:.4%} of rows)"
                           if "same_rows_as_hytopk" in rec else "")
                        + (f"  max diff vs scoreonly {rec['max_diff_vs_scoreonly']:.2e}"
                           if "max_diff_vs_scoreonly" in rec else "")
                        + (f"  sampled rows {rec['sampled_rows_share']:.1%} redone blocks "
                           f"{rec['redone_blocks']}" if "sampled_rows_share" in rec else "")
                        + (f"  redone rows {rec['redone_rows_share']:.2%}"
                           if "redone_rows_share" in rec else "")
                        + ("  phases ms " + " ".join(
                            f"{n} {v:.1f}" if isinstance(v, float)
                            else f"{n} {'-' if v is None else v}"
                            for n, v in rec["phase_ms"].items()) if "phase_ms" in rec else "")
                        + ("  path ms " + " ".join(
                            f"{n} {v:.1f}" if isinstance(v, float) else f"{n} {v}"
                            for n, v in rec["path_ms"].items()) if "path_ms" in rec else ""))
                if args.rounds > 1:
                    records[first_rec:] = merge_rounds(records[first_rec:])
                    write_json(records, dev, rate, bw, args.out)
    if "structured" in args.inputs:
        share = check_structured_exact(16384, "dsv32")
        log(f"structured T=16384: share of rows identical to the reference {share:.4f}")

    summary(records, args.inputs, args.configs, Ts)
    variant_summary(records, args.inputs, args.configs, Ts)
    write_json(records, dev, rate, bw, args.out)
    try:
        plot(records, os.path.join(args.out, f"bench_selection{TAG}.png"))
    except Exception as err:  # the table and JSON matter more than the plot
        log(f"plot failed: {err}")
    if math.isnan(rate):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""One sparse-attention layer, forward + backward under full recompute: HyScale vs its baseline.

Models (`--model`):
- dsa: GLM-5.1's MLA + DSA layer; baseline = megatron-core 0.19.2's stock DSAttention (kernel
  backend "none") on the same weights. For dsa at CP 1 the step is also broken down (selection,
  sparse attention, indexer loss) as before. `--stock-kernel-backend tilelang` adds a second
  stock row, `stock_tilelang`: the same DSAttention with dsa_kernel_backend="tilelang" (its
  TileLang indexer fwd/bwd, sparse-MLA fwd/bwd and sparse indexer-loss kernels; shapes they
  decline fall back to the PyTorch path, and the row's `fused_kernels` counts which ran).
  It needs CUDA and the tilelang package (scripts/tilelang_carry.sh, scripts/gpu_tilelang.sh).
  `--stock-kernel-backend cudnn` adds `stock_cudnn` likewise: dsa_kernel_backend="cudnn"
  (cuDNN-frontend's SM90 indexer + radix top-k, FlashMLA's forward, cuDNN's backward and fused
  indexer loss: scripts/cudnn_carry.sh, scripts/gpu_cudnn.sh).
- csa / hca: DeepSeek-V4-Flash's attention with compress ratio 4 (CSA: indexer 64 x 128 picks
  the top 512 compressed entries + 128-token window) / 128 (HCA: dense over compressed entries +
  window); hidden 4096, 64 heads, shared K = V of 512. Baseline = the module's `baseline=True`
  (materialized scores per row block + torch.topk, recompute selects again).
- qsa: Qwen3.8-Flash-Next's QSA layer (hidden 2560, GQA 24 / 2 heads of 256, indexer 4 x 128
  over blocks of 4, budget 2048); baseline = the module's `baseline=True`.

For each sequence length: time (median after a warm-up; CUDA events on a GPU, perf_counter on
the CPU), peak extra memory, the time spent in selection inside one step (and its share of the
step), and the selection-replay counters of one step. Prints a table, writes JSON (and a PNG
when matplotlib is there) under --out.

Packed sequences (`--packed N [N ...]`, dsa at CP 1 only): for each T the same T hidden states
are also run as one packed THD sequence of N documents (megatron's PackedSeqParams,
qkv_format="thd", cu_seqlens of the documents; each document attends to and selects over its
own keys only), on the same module and weights, rows `hyscale_packed_N`. Document lengths
(`--packed-split`): even (T split as equally as whole tokens allow) or uneven (log-normal
shares drawn from random.Random(PACKED_SEED + N): a few long documents, many short; row
`hyscale_packed_N_uneven`), or both. Each packed row has measure's fields plus its documents'
lengths, `per_token_vs_unpacked` (its step time over the unpacked row's, the same tokens; the
goal is at most PACKED_GOAL = 1.10), `visible_keys_vs_unpacked` (causal key pairs), and
`fallback_warnings` / `fallback_reasons` / `path`: every forward in which HyScale's layer
ran megatron's DSAttention forward instead of its own path is counted (each call of it), and a
row with any says path "stock fallback". The unpacked
`hyscale` row carries the same count. The stock rows of backend none (`stock`) and cudnn
(`stock_cudnn`), which take THD, get packed rows too where they run (`stock_packed_N`, ...);
stock_tilelang does not.

Context parallelism: launched by torchrun with `--cp N` and WORLD_SIZE = N (x D, below), megatron is
initialised with context_parallel_size = N (NCCL on GPUs, gloo with --device cpu), the layer
is built with cp_comm_type="allgather", and each rank gets its zigzag share (chunks r and
2N-1-r of 2N) of the same global input; time and peak memory are reported per rank (the JSON
keeps every rank; the table shows the slowest rank and the largest peak). With `--dp D` the
world is CP x D ranks: D replicas of the CP group (consecutive ranks, megatron's default order)
run the same input side by side, so a 4 x 8 GPU job keeps every CP all-gather inside a node;
the replicas' gradient all-reduce (one layer's weights) is not part of the step. All four
layers support CP (allgather).

Run as `python -m hyscale_bench.layer` (installed) or `python scripts/bench_layer.py` (a
checkout), the same command line:

    python -m hyscale_bench.layer                                  # dsa, T = 8K .. 256K
    python -m hyscale_bench.layer --model csa --seq 65536 131072
    torchrun --nproc-per-node 2 -m hyscale_bench.layer --model qsa --cp 2 --seq 1048576 \
        --skip-baseline
    python -m hyscale_bench.layer --model qsa --device cpu --tiny  # CPU smoke (seconds)
    python -m hyscale_bench.layer --seq 131072 --packed 8 64 --packed-split both --skip-stock
    PYTHONPATH=.carry/site:$PYTHONPATH python3 scripts/bench_layer.py --stock-kernel-backend \
        tilelang                                    # + stock DSA on megatron's TileLang kernels
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import UTC, datetime
from functools import partial
from itertools import accumulate, product
from pathlib import Path
from typing import Any

import torch

from hyscale_bench.measure import GPU_SCRIPT_EPILOG

MODELS = ("dsa", "csa", "hca", "qsa")
STOCK_KERNEL_BACKENDS = ("none", "tilelang", "cudnn")
TILELANG_FLAG = "--stock-kernel-backend tilelang"
CUDNN_FLAG = "--stock-kernel-backend cudnn"

GLM51 = dict(
    hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
    qk_head_dim=192, qk_pos_emb_head_dim=64, v_head_dim=256,
    dsa_indexer_n_heads=32, dsa_indexer_head_dim=128, dsa_indexer_topk=2048,
)
# DeepSeek-V4-Flash attention (DESIGN.md "Model geometries"); the rest are the config defaults
# of DeepseekV4TransformerConfig (head 512, rope 64, q_lora 1024, 8 x 1024 output groups,
# window 128, indexer 64 x 128 top-512).
V4_FLASH = dict(hidden_size=4096, num_attention_heads=64, v4_head_dim=512, v4_rope_head_dim=64,
                v4_q_lora_rank=1024, v4_o_groups=8, v4_o_lora_rank=1024, v4_sliding_window=128,
                v4_index_n_heads=64, v4_index_head_dim=128, v4_index_topk=512)
V4_RATIOS = {"csa": 4, "hca": 128}
# Qwen3.8-Flash-Next QSA layer. rotary_percent 0.25 is Qwen3-Next's partial RoPE (an
# assumption for 3.8; it changes the RoPE cost only, not the selection or the attention).
QSA_REAL = dict(hidden_size=2560, num_attention_heads=24, num_query_groups=2, kv_channels=256,
                qsa_indexer_n_heads=4, qsa_indexer_head_dim=128, qsa_indexer_budget=2048,
                qsa_block_size=4)
QSA_ROTARY_PERCENT = 0.25

# --tiny: the same code paths at sizes a CPU runs in well under a second per step. The selection
# sizes stay below the number of visible keys so that the top-k really selects.
TINY = {
    "dsa": dict(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, dsa_indexer_n_heads=4,
                dsa_indexer_head_dim=16, dsa_indexer_topk=32),
    "v4": dict(hidden_size=32, num_attention_heads=4, v4_head_dim=16, v4_rope_head_dim=8,
               v4_q_lora_rank=24, v4_o_groups=2, v4_o_lora_rank=8, v4_sliding_window=8,
               v4_index_n_heads=8, v4_index_head_dim=16, v4_index_topk=8),
    "qsa": dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                qsa_indexer_n_heads=4, qsa_indexer_head_dim=16, qsa_indexer_budget=32,
                qsa_block_size=4),
}
TINY_V4_RATIOS = {"csa": 4, "hca": 8}  # HCA's 128 would compress nothing at tiny T
TINY_SEQ = [128]

# --packed: the goal (at most 10% slower per token than the unpacked sequence), the
# document-length splits and the uneven split's seed.
PACKED_GOAL = 1.10
PACKED_SPLITS = ("even", "uneven", "both")
PACKED_SEED = 2026
# The stock rows that also run packed THD (megatron's none and cudnn backends take it).
PACKED_STOCK_ROWS = ("stock", "stock_cudnn")
# HyScale's comparison rows that also run packed THD, in each selection mode as the main row
# (--compare-selection-lse: the selection's log-sum-exp serves packed documents too).
PACKED_HYSCALE_ROWS = ("hyscale_row_pass_lse",)


def build_parser() -> argparse.ArgumentParser:
    """The script's argument parser (the launch examples' tests parse their commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=GPU_SCRIPT_EPILOG)
    p.add_argument("--model", choices=MODELS, default="dsa",
                   help="layer: dsa (GLM-5.1), csa / hca (DeepSeek-V4-Flash), qsa (Qwen3.8)")
    p.add_argument("--seq", type=int, nargs="+", default=None,
                   help="global sequence lengths (tokens, batch 1); default 8K .. 256K "
                        f"({TINY_SEQ} with --tiny)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median is reported)")
    p.add_argument("--skip-stock", "--skip-baseline", dest="skip_baseline",
                   action="store_true", help="measure HyScale only")
    p.add_argument("--stock-max-seq", "--baseline-max-seq", dest="baseline_max_seq", type=int,
                   default=65536, metavar="T",
                   help="do not try the baseline above this global length")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size; > 1 needs torchrun with WORLD_SIZE = CP x DP")
    p.add_argument("--dp", type=int, default=1,
                   help="independent replicas of the CP group (megatron's data-parallel "
                        "dimension): WORLD_SIZE = CP x DP; each replica runs the same input")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: smoke runs (fp32, perf_counter timing, RSS as peak memory)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny geometry (for --device cpu smoke tests of every code path)")
    p.add_argument("--no-relu", action="store_true", help="dsa: dsa_indexer_scoring_relu=False")
    p.add_argument("--dense-loss", action="store_true",
                   help="dsa: dense indexer KL (warm-up stage) instead of the sparse one")
    p.add_argument("--loss-coeff", type=float, default=0.01, help="dsa_indexer_loss_coeff")
    p.add_argument("--attention-bwd", choices=("auto", "split", "fused", "sm90"),
                   default="auto",
                   help="HyScale's sparse-attention backward: auto, the defaults (on Hopper "
                        "the warp-specialized Gluon backward where it applies, "
                        "AttentionKernelOptions.bwd_sm90; Triton elsewhere); split, the "
                        "Triton dQ pass then dK/dV pass; fused, the Triton single pass "
                        "(bwd_fused); sm90, the Gluon one where it applies")
    p.add_argument("--loss-kl-in-rows", action="store_true",
                   help="HyScale's indexer loss on the attention-backward path: the KL from "
                        "the row pass's second gathered pass (IndexerLossKernelOptions."
                        "kl_in_bwd=False, the previous default) instead of the indexer "
                        "backward's recomputed scores")
    p.add_argument("--attention-lockstep", nargs="?", const="all",
                   choices=("off", "dkv", "all"), default=None,
                   help="HyScale's Triton attention kernels in lockstep (Attention"
                        "KernelOptions.fwd_lockstep, dq_lockstep, dkv_lockstep; QSA then "
                        "selects in key order): off, none of them; dkv, the dK/dV pass only; "
                        "all (the bare flag), the three, and the Gluon warp-specialized forward "
                        "where it runs. Default: the layer's own (the QSA layer paces dK/dV, "
                        "layers.qsa.QSA_ATTENTION_OPTIONS; the others nothing). HCA's prefix "
                        "runs the Gluon kernels, unpaced: with --attention-prefix triton to "
                        "pace its Triton kernels")
    p.add_argument("--hytopk-scores-sm90", choices=("default", "on", "off"), nargs="?",
                   const="on", default="default",
                   help="the DSA layer's selection from the warp-specialized Gluon scores "
                        "(config.hytopk_options with HyTopKOptions.scores_sm90; where HyScale's "
                        "own HyTopK runs: --hyscale-kernel-backend own, or the "
                        "--compare-own-kernels row): default, HyTopKOptions' own (on Hopper "
                        "from scores_sm90_min_keys, 16K keys); on (the bare flag), wherever "
                        "it can run; off, the Triton kernel")
    p.add_argument("--hytopk-sample-pick", choices=("topk", "radix"), default=None,
                   help="the Gluon selection's threshold pick (HyTopKOptions."
                        "scores_sm90_sample_pick): topk (torch.topk over the sample table) or "
                        "radix (row_rank.rank_values); default: HyTopKOptions' own")
    p.add_argument("--hytopk-scan-slots", choices=("on", "off"), default=None,
                   help="the Gluon filter's survivor slots (HyTopKOptions.scores_sm90_scan_"
                        "slots): on, from a scan, no atomics, the layer's key-ordered rows "
                        "without the select's row sort; off, a relaxed atomic a survivor; "
                        "default: HyTopKOptions' own")
    p.add_argument("--loss-lockstep", action="store_true",
                   help="the indexer loss's backward in lockstep (IndexerLossKernelOptions."
                        "bwd_lockstep)")
    p.add_argument("--compare-selection-lse", action="store_true",
                   help="dsa: also time the layer with the indexer loss's row pass gathering "
                        "its own index-score log-sum-exp (config.hyscale_indexer_lse = "
                        "'row_pass'), row hyscale_row_pass_lse, beside the "
                        "default's from the selection's scores")
    p.add_argument("--loss-key-passes", type=int, default=None, metavar="N",
                   help="the Gluon indexer-loss backward in N key passes (IndexerLossKernel"
                        "Options.bwd_key_passes; default: the option's own, 0: by size)")
    p.add_argument("--compare-loss-key-passes", type=int, default=None, metavar="N",
                   help="dsa: also time the layer with the indexer loss's Gluon backward in N "
                        "key passes (IndexerLossKernelOptions.bwd_key_passes = N), row "
                        "hyscale_loss_key_passes, beside the run's own options")
    p.add_argument("--compare-hytopk-atomics", action="store_true",
                   help="dsa: also time the layer with the Gluon selection as it was before "
                        "2026-12-07: torch.topk's threshold pick and a slot atomic a survivor "
                        "(HyTopKOptions.scores_sm90_sample_pick='topk', scores_sm90_scan_"
                        "slots=False; the layer's key-ordered rows then need the select's row "
                        "sort), row hyscale_hytopk_atomics, beside the run's own options")
    p.add_argument("--loss-bwd-triton", action="store_true",
                   help="the indexer loss's backward on the Triton kernel (IndexerLossKernel"
                        "Options.bwd_sm90=False; the default on Hopper is the Gluon kernel)")
    p.add_argument("--attention-fwd", choices=("auto", "gluon", "gluon_ws", "triton"),
                   default="auto",
                   help="HyScale's sparse-attention forward on Hopper: auto, the defaults (the "
                        "warp-specialized Gluon forward where it applies, fwd_sm90_ws); gluon, "
                        "the plain Gluon kernel (fwd_sm90_ws=False); gluon_ws; triton "
                        "(fwd_sm90=False)")
    p.add_argument("--attention-prefix", choices=("auto", "sm90", "triton"), default="auto",
                   help="hca: the dense prefix's attention kernels on Hopper: auto, the default "
                        "(the Gluon kernels, AttentionKernelOptions.prefix_sm90); sm90; triton "
                        "(prefix_sm90=False)")
    p.add_argument("--stock-kernel-backend", choices=STOCK_KERNEL_BACKENDS, default="none",
                   help="dsa: tilelang also times the stock DSAttention with megatron-core's "
                        "TileLang kernels (dsa_kernel_backend='tilelang') as a second stock row, "
                        "stock_tilelang, next to the PyTorch one (needs CUDA and the tilelang "
                        "package: scripts/tilelang_carry.sh, scripts/gpu_tilelang.sh); cudnn "
                        "likewise adds stock_cudnn (cuDNN-frontend's DSA kernels + FlashMLA, "
                        "what Megatron-Bridge's GLM-5 recipes run: scripts/cudnn_carry.sh, "
                        "scripts/gpu_cudnn.sh); default none: the PyTorch stock row only")
    p.add_argument("--hyscale-kernel-backend", choices=("best", "own", "cudnn"), default="best",
                   help="the kernels HyScale's layer asks its ops for (layers/kernel_backend.py): "
                        "best = the faster of HyScale's and the installed library's per op and "
                        "shape as measured (default), own = HyScale's only, cudnn = the "
                        "library's wherever it runs")
    p.add_argument("--compare-own-kernels", action="store_true",
                   help="also time HyScale's layer on its own kernels only (row hyscale_own), "
                        "on the same weights")
    p.add_argument("--compare-indexer-target", action="store_true",
                   help="dsa: also time HyScale's layer on its own kernels with the sparse "
                        "indexer loss's target from the attention backward (row "
                        "hyscale_own_target_in_bwd: config.hyscale_indexer_target = "
                        "attention_backward, which the default 'auto' picks on own "
                        "kernels), on the same weights; with --compare-own-kernels the row "
                        "hyscale_own is then the same layer with the separate target pass")
    p.add_argument("--compare-mla-projections", action="store_true",
                   help="dsa: also time HyScale's layer with megatron's absorbed-MLA "
                        "projections (row hyscale_megatron_projections: "
                        "config.hyscale_mla_projections = megatron, its einsums, RoPE and "
                        "concatenations instead of HyScale's in-place ones), on the same "
                        "weights and kernels")
    p.add_argument("--fused-stock-max-seq", type=int, default=1 << 30, metavar="T",
                   help="longest T the --stock-kernel-backend row runs at (default: every T; "
                        "an out-of-memory length is recorded as such)")
    p.add_argument("--transformer-impl", choices=("local", "transformer_engine"),
                   default="local",
                   help="dsa: the layer's linears and norms from megatron's local (torch) "
                        "modules (default) or Transformer Engine's (transformer_engine must "
                        "import; scripts/te_carry.sh and scripts/gpu_te.sh bring it to the lent "
                        "H200)")
    p.add_argument("--row-chunk", type=int, default=None, metavar="ROWS",
                   help="dsa / csa / hca: HyScale's attention runs its local query rows ROWS "
                        "at a time, each part checkpointed (HyScaleMLASelfAttention, "
                        "v4_row_chunk; for 1M tokens at CP 2)")
    p.add_argument("--packed", type=int, nargs="+", default=None, metavar="N",
                   help="dsa at CP 1: also time HyScale's layer (and the stock rows of backend "
                        "none / cudnn) on the same T tokens packed as one THD sequence of N "
                        "documents (PackedSeqParams, qkv_format='thd'), rows hyscale_packed_N, "
                        "with the per-token time against the unpacked row (the goal: at most "
                        f"{PACKED_GOAL:.2f}x) and the fallback warnings counted")
    p.add_argument("--packed-split", choices=PACKED_SPLITS, default=None,
                   help="with --packed: the documents' lengths: even (T split as equally as "
                        "whole tokens allow, the default), uneven (log-normal lengths from a "
                        f"generator seeded {PACKED_SEED} + N, rows hyscale_packed_N_uneven) or "
                        "both")
    p.add_argument("--packed-selection", choices=("per_document", "batched", "both"),
                   default=None,
                   help="with --packed: how HyScale's packed rows select (config."
                        "hyscale_packed_selection): one call a document (per_document, the "
                        "default), documents batched into few calls (batched, rows "
                        "hyscale_packed_N_batched), or both side by side")
    p.add_argument("--profile-copies", type=int, default=0, metavar="N",
                   help="after each row's timing, run one more step counting every copying "
                        "operator at dispatch (copy_, cat, clone, _to_copy, index_select) and "
                        "record the N (operator, caller) pairs that wrote the most bytes, the "
                        "caller being the innermost megatron / HyScale-layer frame "
                        "(`copy_profile`): where a step's copies come from; runs on the CPU "
                        "too (bytes scale with the length)")
    p.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                   help="after each row's timing, profile one more step (torch.profiler) and "
                        "record its N most expensive operators by self device time "
                        "(`kernel_profile`: name, ms, calls), the device-busy total and the "
                        "step's wall time, so a row's time can be split into its kernels and "
                        "host stalls (default 0: off)")
    p.add_argument("--out", default="outputs/bench_layer", help="output folder")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.cp < 1 or args.dp < 1:
        p.error("--cp and --dp must be >= 1")
    if args.seq is None:
        args.seq = list(TINY_SEQ) if args.tiny else [8192, 16384, 32768, 65536, 131072, 262144]
    if any(t < 1 for t in args.seq):
        p.error("--seq values must be positive")
    bad = [t for t in args.seq if t % (2 * args.cp)]
    if bad:
        p.error(f"--seq values must be divisible by 2 x cp = {2 * args.cp} (zigzag layout): {bad}")
    if args.stock_kernel_backend != "none":
        if args.model != "dsa":
            p.error("--stock-kernel-backend applies to --model dsa only (the stock DSAttention)")
        if args.skip_baseline:
            p.error("--stock-kernel-backend times a stock layer: drop --skip-stock")
    if args.transformer_impl == "transformer_engine":
        if args.model != "dsa":
            p.error("--transformer-impl transformer_engine applies to --model dsa only")
        from megatron_hyscale.specs import te_available

        if not te_available():
            p.error("--transformer-impl transformer_engine: transformer_engine does not import "
                    "here (on the lent H200: scripts/te_carry.sh, then scripts/gpu_te.sh 1-5)")
    if args.packed is not None:
        if args.model != "dsa":
            p.error("--packed applies to --model dsa only (HyScale's DSA layer runs packed THD "
                    "sequences itself; the CSA, HCA and QSA layers do not take them)")
        if args.cp != 1 or args.dp != 1:
            p.error("--packed runs at --cp 1 --dp 1 only (this benchmark's packed rows do "
                    "not split the packed sequence per document over the ranks, megatron's THD "
                    "split, nor replicate it over data parallelism; the layer itself runs "
                    "packed THD under context parallelism: tests/parallel/"
                    "test_cp_dsa_packed.py)")
        too_many = [n for n in args.packed if n < 1 or n > min(args.seq)]
        if too_many:
            p.error(f"--packed N must be between 1 and the shortest --seq ({min(args.seq)}): "
                    f"{too_many}")
        args.packed = list(dict.fromkeys(args.packed))  # once each, in the order given
        args.packed_split = args.packed_split or "even"
    elif args.packed_split is not None:
        p.error("--packed-split needs --packed N")
    if args.packed_selection is not None and args.packed is None:
        p.error("--packed-selection needs --packed N")
    for flag in ("loss_key_passes", "compare_loss_key_passes"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.compare_loss_key_passes is not None and args.model != "dsa":
        p.error("--compare-loss-key-passes needs --model dsa (the sparse indexer loss's "
                "backward)")
    if args.compare_hytopk_atomics and args.model != "dsa":
        p.error("--compare-hytopk-atomics needs --model dsa (the DSA layer's selection)")
    if args.compare_mla_projections and args.model != "dsa":
        p.error("--compare-mla-projections needs --model dsa (absorbed MLA)")
    if args.compare_selection_lse and (args.model != "dsa" or args.dense_loss
                                       or args.loss_kl_in_rows):
        p.error("--compare-selection-lse needs --model dsa and the sparse loss (not "
                "--dense-loss), with the KL in the backward (not --loss-kl-in-rows): the "
                "selection's log-sum-exp serves that row pass only")
    if args.compare_indexer_target and (args.model != "dsa" or args.dense_loss):
        p.error("--compare-indexer-target needs --model dsa and the sparse loss (not "
                "--dense-loss): the target from the attention backward is the sparse loss's")
    if args.row_chunk is not None:
        if args.model == "qsa":
            p.error("--row-chunk applies to --model dsa, csa and hca")
        if args.row_chunk < 1:
            p.error("--row-chunk must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# Process setup
# ---------------------------------------------------------------------------------------------

def check_request(args: argparse.Namespace) -> None:
    """Refuse what cannot run (exit 2 with the reason) before importing megatron."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.cp * args.dp:
        fail(f"bench_layer.py: WORLD_SIZE is {world} but --cp {args.cp} x --dp {args.dp} is "
             f"{args.cp * args.dp}; launch with `torchrun --nproc-per-node "
             f"{args.cp * args.dp} scripts/bench_layer.py --cp {args.cp} --dp {args.dp} ...` "
             "(CP and DP are the only parallelism here)")
    if args.device == "cuda":
        from hyscale_bench.measure import require_cuda

        require_cuda("bench_layer.py --device cuda", hint="run it on the GPU machine, or use "
                     "--device cpu --tiny for a CPU smoke run")
    if args.stock_kernel_backend == "tilelang":
        check_tilelang(args)
    if args.stock_kernel_backend == "cudnn":
        check_cudnn(args)


def check_cudnn(args: argparse.Namespace) -> None:
    """Refuse --stock-kernel-backend cudnn (exit 2) where megatron's cudnn DSA cannot run."""
    if args.device != "cuda":
        fail(f"bench_layer.py: {CUDNN_FLAG} needs --device cuda (Hopper)")
    from megatron.core.utils import _missing_cudnn_dsa_kernel_dependencies

    missing = _missing_cudnn_dsa_kernel_dependencies()
    if missing:
        fail(f"bench_layer.py: {CUDNN_FLAG}: megatron-core cannot load its cudnn DSA kernels "
             f"({', '.join(missing)} missing); install them (scripts/cudnn_carry.sh here, "
             "scripts/gpu_cudnn.sh on the GPU machine) or leave the flag out")


def check_tilelang(args: argparse.Namespace) -> None:
    """Refuse --stock-kernel-backend tilelang (exit 2) where megatron's TileLang DSA cannot run.

    Checked before anything is built or written: a run that measured HyScale and then died
    building the TileLang stock layer would leave a half-written JSON behind.
    """
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # a missing dependency or library raises more than ImportError
        fail(f"bench_layer.py: {TILELANG_FLAG} needs the tilelang package, which does not "
             f"import here ({type(exc).__name__}: {exc}); install it (scripts/tilelang_carry.sh "
             "here, scripts/gpu_tilelang.sh on the GPU machine) or leave the flag out")
    if args.device != "cuda":
        fail(f"bench_layer.py: {TILELANG_FLAG} needs --device cuda (TileLang builds CUDA "
             "kernels; megatron-core refuses the backend without a GPU)")
    # megatron imports its kernel modules behind try/except and turns the backend down at config
    # time when any is missing (e.g. a TileLang API it needs is absent): ask it up front.
    from megatron.core.utils import _missing_tilelang_dsa_kernel_dependencies

    missing = _missing_tilelang_dsa_kernel_dependencies()
    if missing:
        fail(f"bench_layer.py: {TILELANG_FLAG}: megatron-core cannot load its TileLang DSA "
             f"kernels ({', '.join(missing)} missing) although tilelang imports")


def init_distributed(args: argparse.Namespace) -> Any:
    """Megatron's groups for CP = args.cp (x DP = args.dp); returns the CP group (None at 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hyscale_bench.cpu import init_single_process

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        init_single_process()
        return None
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    # megatron's default order (tp-cp-ep-dp-pp) makes each CP group consecutive ranks: with
    # 8 GPUs a node and CP 8, every CP all-gather stays on the node's NVLink.
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=args.cp)
    model_parallel_cuda_manual_seed(1234)
    return parallel_state.get_context_parallel_group()


def fail(message: str) -> None:
    """Print the reason to stderr (rank 0 only under torchrun) and exit 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    sys.exit(2)


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def log(msg: str) -> None:
    if rank() == 0:
        print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------

class Layer:
    """One attention module and how to call it on [s, b, h] hidden states."""

    def __init__(self, module: torch.nn.Module, call: Callable[[torch.Tensor], torch.Tensor],
                 hidden_size: int, selection_hooks: list[tuple[Any, str]],
                 fused_hooks: list[tuple[Any, str]] | None = None) -> None:
        self.module = module
        self.call = call
        self.hidden_size = hidden_size
        # (object, method name) pairs whose time counts as selection (indexer + top-k)
        self.selection_hooks = selection_hooks
        # (object, function name) pairs of optional fused kernels that return None when they
        # decline a shape: counted, so a row can tell kernels that ran from a silent fallback
        self.fused_hooks = fused_hooks or []


def _common_fields(args: argparse.Namespace) -> dict[str, Any]:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return dict(
        num_layers=1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        context_parallel_size=args.cp, cp_comm_type="allgather" if args.cp > 1 else None,
    )


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def _precision_fields(dtype: torch.dtype) -> dict[str, Any]:
    """The config fields of a module built in `dtype` (params_dtype, bf16)."""
    return dict(params_dtype=dtype, bf16=dtype == torch.bfloat16)


def build_dsa(args: argparse.Namespace, baseline: bool, kernel_backend: str = "none", *,
              dtype: torch.dtype | None = None, overrides: dict[str, Any] | None = None
              ) -> Layer:
    """GLM-5.1's attention: HyScale, or (`baseline`) the stock DSAttention on `kernel_backend`.

    `dtype`: the parameters' and config's precision (default: bf16 on CUDA, fp32 on the CPU);
    `overrides`: config fields that win over the geometry and the command line's (e.g. fewer
    heads)."""
    from megatron.core.transformer.spec_utils import build_module

    from hyscale_bench.models import tiny_dsa_config
    from megatron_hyscale.specs import get_dsa_layer_specs

    geometry = TINY["dsa"] if args.tiny else GLM51
    dtype = dtype or _dtype(args)
    fields = dict(
        ffn_hidden_size=4 * geometry["hidden_size"], dsa_indexer_loss_coeff=args.loss_coeff,
        dsa_indexer_use_sparse_loss=not args.dense_loss,
        dsa_indexer_scoring_relu=not args.no_relu, dsa_kernel_backend=kernel_backend,
        transformer_impl=args.transformer_impl, **_common_fields(args), **geometry,
    )
    fields.update(_precision_fields(dtype), **(overrides or {}))
    cfg = tiny_dsa_config(**fields)
    row_chunk = None if baseline else args.row_chunk
    spec = get_dsa_layer_specs(cfg, stock=baseline, row_chunk=row_chunk)[0].submodules \
        .self_attention
    torch.manual_seed(0)
    # Megatron wraps models in Float16Module; the local norms are created in fp32.
    # TransformerLayer passes the config's cp_comm_type to its attention; built alone, the
    # attention would default to "p2p", which DSA under CP refuses.
    attn = build_module(spec, config=cfg, layer_number=1, cp_comm_type=cfg.cp_comm_type
                        ).to(args.device, dtype)
    core = attn.core_attention
    if baseline:
        # stock: the indexer projections, then the module-level score table + torch.topk
        from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa

        hooks = [(core.indexer, "forward_before_topk"), (stock_dsa, "fused_qk_topk_naive")]
    else:
        hooks = [(core.indexer, "forward_before_topk"), (core, "_selection")]
    fused: list[tuple[Any, str]] = []
    if kernel_backend == "tilelang":
        from megatron.core.transformer.experimental_attention_variant import dsa_kernels
        from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

        # TileLang's indexer kernels (scores + top-k; with and without the loss's scores) are
        # its selection; the naive one above stays for the shapes they decline.
        hooks += [(tilelang_dsa, "lighting_indexer"), (tilelang_dsa, "lighting_indexer_indices")]
        fused = [(dsa_kernels, name) for name in FUSED_DSA_HOOKS]
    if kernel_backend == "cudnn":
        from megatron.core.transformer.experimental_attention_variant import (
            dsa_cudnn_kernels,
            dsa_kernels,
        )

        # cuDNN's score chunks + radix top-k are its selection (inside the fused hooks too).
        hooks += [(dsa_cudnn_kernels, "_indexer_topk_bshd")]
        fused = [(dsa_kernels, name) for name in (*FUSED_DSA_HOOKS, "run_fused_dsa_attention")]
    return Layer(attn, lambda h: attn(h, None)[0], cfg.hidden_size, hooks, fused)


# megatron's backend-neutral hooks (dsa_kernels), each returning None when its backend declines.
FUSED_DSA_HOOKS = ("run_fused_qk_topk", "run_fused_qk_topk_with_loss",
                   "run_fused_absorbed_sparse_attention")


def build_v4(args: argparse.Namespace, baseline: bool, *, dtype: torch.dtype | None = None,
             overrides: dict[str, Any] | None = None) -> Layer:
    """DeepSeek-V4-Flash's CSA / HCA attention (args.model); `dtype`, `overrides`: as build_dsa."""
    from megatron.core.transformer.spec_utils import build_module

    from hyscale_bench.models import LOCAL_UNFUSED_FIELDS
    from megatron_hyscale.layers.deepseek_v4 import DeepseekV4TransformerConfig
    from megatron_hyscale.specs.deepseek_v4 import get_v4_layer_specs

    geometry = TINY["v4"] if args.tiny else V4_FLASH
    ratio = (TINY_V4_RATIOS if args.tiny else V4_RATIOS)[args.model]
    fields = dict(
        ffn_hidden_size=2 * geometry["hidden_size"], v4_compress_ratios=[ratio], v4_csa_ratio=4,
        normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, **LOCAL_UNFUSED_FIELDS,
        **_common_fields(args), **geometry,
        v4_row_chunk=None if baseline else args.row_chunk,
    )
    dtype = dtype or _dtype(args)
    fields.update(_precision_fields(dtype), **(overrides or {}))
    cfg = DeepseekV4TransformerConfig(**fields)
    spec = get_v4_layer_specs(cfg, baseline=baseline)[0].submodules.self_attention
    torch.manual_seed(0)
    attn = build_module(spec, config=cfg, layer_number=1).to(args.device, dtype)
    hooks = [(attn, "_csa_select")] if attn.is_csa else []
    return Layer(attn, lambda h: attn(h)[0], cfg.hidden_size, hooks)


def build_qsa(args: argparse.Namespace, baseline: bool, *, dtype: torch.dtype | None = None,
              overrides: dict[str, Any] | None = None) -> Layer:
    """Qwen3.8-Flash-Next's QSA attention; `dtype`, `overrides`: as build_dsa."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    from hyscale_bench.models import LOCAL_UNFUSED_FIELDS
    from megatron_hyscale.layers.qsa import QSATransformerConfig
    from megatron_hyscale.specs.qsa import get_qsa_attention_spec

    geometry = TINY["qsa"] if args.tiny else QSA_REAL
    dtype = dtype or _dtype(args)
    fields = dict(
        ffn_hidden_size=2 * geometry["hidden_size"], normalization="RMSNorm",
        layernorm_epsilon=1e-6, add_bias_linear=False, hidden_dropout=0.0,
        **LOCAL_UNFUSED_FIELDS, **_common_fields(args), **geometry,
    )
    fields.update(_precision_fields(dtype), **(overrides or {}))
    cfg = QSATransformerConfig(**fields)
    spec = get_qsa_attention_spec(cfg, baseline=baseline)
    torch.manual_seed(0)
    attn = build_module(spec, config=cfg, layer_number=1, cp_comm_type=cfg.cp_comm_type
                        ).to(args.device, dtype)
    rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=QSA_ROTARY_PERCENT,
                           rotary_base=10000, use_cpu_initialization=True)
    rope.inv_freq = rope.inv_freq.to(args.device)  # a plain attribute, not a buffer

    def call(h: torch.Tensor) -> torch.Tensor:
        # As GPTModel: frequencies for the global length, sliced to this CP rank's zigzag rows.
        emb = rope(h.shape[0] * args.cp)
        return attn(h, None, rotary_pos_emb=emb)[0]

    core = attn.core_attention
    return Layer(attn, call, cfg.hidden_size,
                 [(core.indexer, "forward"), (core, "_select_blocks")])


BUILDERS = {"dsa": build_dsa, "csa": build_v4, "hca": build_v4, "qsa": build_qsa}


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_step_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median ms over `reps` runs after one warm-up (CUDA events on a GPU, perf_counter on CPU)."""
    if device == "cuda":
        from hyscale_bench.measure import time_ms

        return time_ms(fn, reps=reps)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def matmul_rate(device: str) -> float:
    """bf16 matmul TFLOP/s on a GPU (the floor's rate); a small fp32 matmul's on the CPU."""
    if device == "cuda":
        from hyscale_bench.measure import matmul_tflops

        return matmul_tflops()
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    ms = time_step_ms(lambda: a @ b, "cpu", 5)
    return 2 * n**3 / max(ms, 1e-6) / 1e9


def copy_rate(device: str) -> float:
    """Device-to-device copy TB/s on a GPU (the record's copy rate, measured beside the matmul
    rate); NaN on the CPU, whose runs write no record."""
    if device == "cuda":
        from hyscale_bench.measure import copy_tbps

        return copy_tbps()
    return float("nan")


def layer_step(layer: Layer, hidden: torch.Tensor, grad: torch.Tensor) -> None:
    """Forward + backward with the layer's forward checkpointed (full recompute)."""
    from megatron.core import tensor_parallel

    hidden.grad = None
    out = tensor_parallel.checkpoint(layer.call, False, hidden)
    out.backward(grad.view(out.shape))  # the same tokens; packed THD may drop the batch dim


class SelectionTimer:
    """Wraps the layer's selection methods and adds up their time within one step.

    CUDA events are recorded around each call and read after the step (no sync inside it).
    """

    def __init__(self, layer: Layer, device: str) -> None:
        self.layer, self.device = layer, device
        self.spans: list[tuple[Any, Any]] = []
        self.calls = 0
        self.saved: list[tuple[Any, str, Any, bool]] = []

    def __enter__(self) -> SelectionTimer:
        for obj, name in self.layer.selection_hooks:
            original = getattr(obj, name)
            # a module function is replaced and put back; a method is shadowed by an
            # instance attribute and un-shadowed afterwards
            self.saved.append((obj, name, original, name in vars(obj)))

            def wrapped(*a: Any, _orig: Callable = original, **kw: Any) -> Any:
                self.calls += 1
                if self.device == "cuda":
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    result = _orig(*a, **kw)
                    end.record()
                else:
                    start = time.perf_counter()
                    result = _orig(*a, **kw)
                    end = time.perf_counter()
                self.spans.append((start, end))
                return result

            setattr(obj, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name, original, own in reversed(self.saved):
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
        self.saved.clear()

    def total_ms(self) -> float:
        sync(self.device)
        if self.device == "cuda":
            return sum(s.elapsed_time(e) for s, e in self.spans)
        return sum((e - s) * 1e3 for s, e in self.spans)


class FusedHookCounter:
    """Counts, per fused-kernel hook, the calls that ran (a result) and those declined (None)."""

    def __init__(self, hooks: list[tuple[Any, str]]) -> None:
        self.hooks = hooks
        self.counts = {name: {"used": 0, "declined": 0} for _, name in hooks}
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> FusedHookCounter:
        for obj, name in self.hooks:
            original = getattr(obj, name)
            self.saved.append((obj, name, original))

            def counted(*a: Any, _orig: Callable = original, _name: str = name, **kw: Any) -> Any:
                result = _orig(*a, **kw)
                self.counts[_name]["declined" if result is None else "used"] += 1
                return result

            setattr(obj, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name, original in reversed(self.saved):
            setattr(obj, name, original)
        self.saved.clear()


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def make_input(T: int, layer: Layer, args: argparse.Namespace) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """This rank's zigzag share of one global [T, 1, h] input and output gradient."""
    from megatron_hyscale.parallel import zigzag_split

    g = torch.Generator(device=args.device).manual_seed(1)
    shape = (T, 1, layer.hidden_size)
    hidden = torch.randn(shape, generator=g, device=args.device, dtype=_dtype(args)) * 0.5
    grad = torch.randn(shape, generator=g, device=args.device, dtype=_dtype(args))
    if args.cp > 1:  # every rank drew the same global tensors: keep chunks r and 2cp-1-r
        from megatron.core import parallel_state

        cp_rank = parallel_state.get_context_parallel_rank()
        hidden = zigzag_split(hidden, args.cp, cp_rank, dim=0).contiguous()
        grad = zigzag_split(grad, args.cp, cp_rank, dim=0).contiguous()
    return hidden.requires_grad_(), grad


@contextmanager
def hyscale_warnings() -> Iterator[list[str]]:
    """The texts of HyScale's warnings raised inside (a fast kernel declined or disabled, a
    fallback taken), filled on exit; each is still shown. HyScale warns once a process per
    cause, so a cause is recorded by the first row that met it."""
    found: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            try:
                yield found
            finally:
                found.extend(str(w.message) for w in caught
                             if str(w.message).startswith("HyScale"))
    finally:  # shown once the normal display is back, also when the row failed
        for w in caught:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def measure(layer: Layer, T: int, args: argparse.Namespace) -> dict[str, Any]:
    """Time, peak memory, in-step selection time and replay counters of one layer at length T,
    HyScale's warnings raised meanwhile (`hyscale_warnings`) and, for a HyScale layer, the
    selection's options (`hytopk_options`)."""
    with hyscale_warnings() as found:
        result = _measure(layer, T, args)
    result["hyscale_warnings"] = found
    config = layer.module.config
    if hasattr(config, "hytopk_options"):  # a HyScale layer (`hyscale_layer` sets it)
        # the selection's kernel options the row ran (None: HyTopKOptions.DEFAULT)
        options = config.hytopk_options
        result["hytopk_options"] = None if options is None else asdict(options)
    return result


def _measure(layer: Layer, T: int, args: argparse.Namespace) -> dict[str, Any]:
    from megatron_hyscale import replay

    hidden, grad = make_input(T, layer, args)
    sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        rss0 = peak_rss_gib()
    replay.reset_stats()
    ms = time_step_ms(lambda: layer_step(layer, hidden, grad), args.device, args.repeats)
    if args.device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    else:  # process RSS high-water growth: coarse, but a number the smoke test can check
        peak = max(0.0, peak_rss_gib() - rss0)
    result: dict[str, Any] = {"fwd_bwd_ms": ms, "peak_extra_gib": peak,
                              "steps_timed": args.repeats + 1}
    # One more, instrumented step: selection time inside it and its replay counters.
    replay.reset_stats()
    with SelectionTimer(layer, args.device) as timer, FusedHookCounter(layer.fused_hooks) as fused:
        layer_step(layer, hidden, grad)
    stats = replay.get_stats()
    result["selections_computed"] = int(stats["selections_computed"])
    result["selections_replayed"] = int(stats["selections_replayed"])
    if layer.selection_hooks:
        sel = timer.total_ms()
        result["selection_in_step_ms"] = sel
        result["selection_share"] = sel / ms if ms > 0 else 0.0
        result["selection_calls"] = timer.calls
    else:  # HCA selects nothing (dense over its compressed entries + window)
        result["selection_in_step_ms"] = None
        result["selection_share"] = None
    if layer.fused_hooks:
        result["fused_kernels"] = fused.counts
    if args.profile_kernels > 0:
        result["kernel_profile"] = profile_step(layer, hidden, grad, args)
    if args.profile_copies > 0:
        result["copy_profile"] = profile_copies(layer, hidden, grad, args)
    replay.clear()
    return result


# The operators that write a copy of their input (the step's copies and concatenations).
COPY_OPS = ("aten.copy_", "aten.cat", "aten.clone", "aten._to_copy", "aten.index_select")
# Frames of these packages name a copy's caller (torch's own frames say nothing about why). On
# the CPU the ops run their plain-torch references (`megatron_hyscale/ops/reference.py`):
# copies named there are the stand-ins', not the GPU kernels'.
CALLER_PACKAGES = ("megatron_hyscale/", "megatron/core")


def profile_copies(layer: Layer, hidden: torch.Tensor, grad: torch.Tensor,
                   args: argparse.Namespace) -> list[dict[str, Any]]:
    """One step with every copying operator (COPY_OPS) counted at dispatch: the
    `args.profile_copies` (operator, caller) pairs that wrote the most bytes, each {name, gib,
    calls, caller}, caller the innermost CALLER_PACKAGES frame ("autograd" for the autograd
    engine's own ops, which no Python frame calls). Bytes, not time: a copy's time is about
    twice its bytes over the copy rate, and at other lengths they scale with the tensors (rows
    x heads x dims)."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    written: dict[tuple[str, str], list[float]] = {}

    class CopyCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args_=(), kwargs=None):
            out = func(*args_, **(kwargs or {}))
            name = str(func.overloadpacket)
            if name in COPY_OPS and isinstance(out, torch.Tensor):
                frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                          for f in traceback.extract_stack()
                          if any(pkg in f.filename for pkg in CALLER_PACKAGES)]
                caller = frames[-1] if frames else "autograd"
                entry = written.setdefault((name, caller), [0.0, 0])
                entry[0] += out.numel() * out.element_size()
                entry[1] += 1
            return out

    sync(args.device)
    with CopyCounter():
        layer_step(layer, hidden, grad)
    sync(args.device)
    top = sorted(written.items(), key=lambda kv: kv[1][0], reverse=True)[:args.profile_copies]
    out = [{"name": name, "gib": b / 2**30, "calls": int(n), "caller": caller}
           for (name, caller), (b, n) in top]
    total = sum(b for b, _ in written.values()) / 2**30
    log(f"  copies: {total:.3f} GiB written a step by {sum(n for _, n in written.values())} "
        f"copying operators; the top {len(out)}:")
    for item in out:
        log(f"    {item['gib']:9.4f} GiB {item['calls']:5d}x  {item['name']:18s} "
            f"<- {item['caller'][:110]}")
    return out


def profile_step(layer: Layer, hidden: torch.Tensor, grad: torch.Tensor,
                 args: argparse.Namespace) -> dict[str, Any]:
    """One step under torch.profiler: its wall ms, the device-busy ms (the device-side
    events' time: kernels, copies) and the `args.profile_kernels` operators with the most self
    device time (on the CPU: self CPU time), each {name, ms, calls}. Busy well under wall means
    the host (launch overhead, syncs, Python loops) sets the pace."""
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(args.device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        layer_step(layer, hidden, grad)
        sync(args.device)
        wall_ms = (time.perf_counter() - t0) * 1e3

    def self_us(e: Any) -> float:
        if not cuda:
            return float(e.self_cpu_time_total)
        return float(getattr(e, "self_device_time_total", None)
                     or getattr(e, "self_cuda_time_total", 0.0))

    # On a GPU an operator launched from Python (an autograd Function) is charged its kernels'
    # time as well: the busy total counts device-side events (kernels, copies) only.
    events = sorted(prof.key_averages(), key=self_us, reverse=True)
    top = [{"name": e.key[:120], "ms": self_us(e) / 1e3, "calls": int(e.count)}
           for e in events[:args.profile_kernels] if self_us(e) > 0]
    on_device = [e for e in events
                 if not cuda or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(self_us(e) for e in on_device) / 1e3
    log(f"  profile: wall {wall_ms:.1f} ms, {'device' if cuda else 'cpu'} busy {busy_ms:.1f} ms")
    for item in top:
        log(f"    {item['ms']:9.2f} ms {item['calls']:6d}x  {item['name']}")
    return {"wall_ms": wall_ms, "busy_ms": busy_ms, "top": top}


# ---------------------------------------------------------------------------------------------
# Packed THD sequences (--packed)
# ---------------------------------------------------------------------------------------------

def packed_lengths(T: int, n: int, split: str) -> list[int]:
    """The lengths of n documents packing T tokens (each at least one token, summing to T).

    even: as equal as whole tokens allow (the first T % n one token longer). uneven: shares
    drawn log-normal (mu 0, sigma 1: a few long documents and many short ones) from
    random.Random(PACKED_SEED + n), rounded down, the remainder added one token at a time to
    the longest documents; deterministic, and the JSON records the lengths.
    """
    if split == "even":
        q, r = divmod(T, n)
        return [q + (i < r) for i in range(n)]
    rng = random.Random(PACKED_SEED + n)
    weights = [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
    total = sum(weights)
    lengths = [max(1, int(T * w / total)) for w in weights]
    longest = sorted(range(n), key=lambda i: (-lengths[i], i))
    i = 0
    while sum(lengths) != T:  # off by fewer than n tokens either way
        j = longest[i % n]
        if sum(lengths) < T:
            lengths[j] += 1
        elif lengths[j] > 1:
            lengths[j] -= 1
        i += 1
    return lengths


def packed_splits(args: argparse.Namespace) -> list[str]:
    return ["even", "uneven"] if args.packed_split == "both" else [args.packed_split]


def packed_selections(args: argparse.Namespace) -> list[str]:
    """HyScale's packed rows' selection modes (layers/kernel_backend.packed_selection)."""
    mode = args.packed_selection or "per_document"
    return ["per_document", "batched"] if mode == "both" else [mode]


def packed_name(base: str, n: int, split: str, selection: str = "per_document") -> str:
    """The row key: hyscale_packed_8, stock_packed_8_uneven, hyscale_packed_64_batched, ..."""
    return (f"{base}_packed_{n}" + ("_uneven" if split == "uneven" else "")
            + ("_batched" if selection == "batched" else ""))


PACKED_KEY = re.compile(r"_packed_\d+(_uneven)?(_batched)?$")


def packed_seq_params(lengths: list[int], device: str) -> Any:
    """megatron's PackedSeqParams for documents of these lengths back to back (no padding)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def packed_layer(layer: Layer, params: Any) -> Layer:
    """The same module (weights, hooks) called on a packed THD sequence."""
    attn = layer.module
    return Layer(attn, lambda h: attn(h, None, packed_seq_params=params)[0], layer.hidden_size,
                 layer.selection_hooks, layer.fused_hooks)


def visible_pairs(lengths: list[int]) -> int:
    """Causal (query, key) pairs: each document's rows see their own document's keys only."""
    return sum(n * (n + 1) // 2 for n in lengths)


class FallbackCounter:
    """Counts the forwards in which HyScale's DSA layer ran megatron-core's DSAttention forward
    (a stock fallback): every call of `DSAttention.forward` on a HyScale layer, however reached
    (a warning would show once a process; this counts each), with the layer class that made it
    as the reason. HyScale's layer has no fallback today: a count says one came back.
    """

    REASON = "{cls} ran megatron-core's DSAttention.forward"

    def __init__(self) -> None:
        self.count = 0
        self.reasons: dict[str, int] = {}

    def __enter__(self) -> FallbackCounter:
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

        from megatron_hyscale.layers.dsa import HyScaleDSAttention

        self.original = original = DSAttention.forward

        def counted(layer: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(layer, HyScaleDSAttention):
                self.count += 1
                reason = self.REASON.format(cls=type(layer).__name__)
                self.reasons[reason] = self.reasons.get(reason, 0) + 1
            return original(layer, *args, **kwargs)

        DSAttention.forward = counted
        return self

    def __exit__(self, *exc: object) -> None:
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

        DSAttention.forward = self.original


def measure_hyscale(layer: Layer, T: int, args: argparse.Namespace) -> dict[str, Any]:
    """`measure`, with the forwards that fell back to the stock path counted (--packed)."""
    with FallbackCounter() as fallbacks:
        rec = measure(layer, T, args)
    rec["fallback_warnings"] = fallbacks.count
    rec["fallback_reasons"] = sorted(fallbacks.reasons)
    # Both signs of HyScale's own path: no fallback, and its selection ran (and was replayed).
    own = fallbacks.count == 0 and rec["selections_computed"] > 0
    rec["path"] = "hyscale" if own else "stock fallback"
    return rec


def measure_packed(layer: Layer, T: int, args: argparse.Namespace, n: int, split: str,
                   unpacked: Any, *, hyscale: bool) -> Any:
    """One packed row: `layer` on the same T hidden states as n documents (packed_lengths).

    Besides measure's fields: the documents, the step time per token against the unpacked
    row's (`per_token_vs_unpacked`, the goal at most PACKED_GOAL) and the causal key pairs
    against the unpacked sequence's; for HyScale, the fallback warnings (measure_hyscale).
    """
    lengths = packed_lengths(T, n, split)
    params = packed_seq_params(lengths, args.device)
    run_one = measure_hyscale if hyscale else measure
    # An error costs this row only (recorded as "error: ..."), not the run's other rows.
    rec = guarded(partial(run_one, packed_layer(layer, params), T, args), args.device,
                  keep_going=True)
    if not isinstance(rec, dict):
        return rec
    ratio = (rec["fwd_bwd_ms"] / unpacked["fwd_bwd_ms"] if isinstance(unpacked, dict)
             else None)  # the same T tokens: the step-time ratio is the per-token one
    rec.update({
        "documents": n, "split": split, "doc_lengths": lengths,
        "per_token_vs_unpacked": ratio,
        "within_goal": None if ratio is None else ratio <= PACKED_GOAL,
        "visible_keys_vs_unpacked": visible_pairs(lengths) / visible_pairs([T]),
    })
    return rec


def measure_hyscale_packed(row: dict[str, Any], key: str, layer: Layer, T: int,
                           args: argparse.Namespace, packed: list[tuple[int, str]]) -> None:
    """The packed rows of HyScale's row `key` (the same module and hidden states as its
    unpacked row, CP 1 only), in each selection mode: row[packed_name(key, ...)]."""
    from megatron_hyscale import replay

    config = layer.module.config
    for (n, split), mode in product(packed, packed_selections(args)):
        name = packed_name(key, n, split, mode)
        log(f"[T={T}] {name} ...")
        config.hyscale_packed_selection = mode
        try:
            row[name] = measure_packed(layer, T, args, n, split, row[key], hyscale=True)
        finally:
            config.hyscale_packed_selection = None
        if isinstance(row[name], dict):  # else the row's error message
            row[name]["packed_selection"] = mode
        replay.clear()


def attention_kernel_options(args: argparse.Namespace) -> Any:
    """HyScale's sparse-attention kernel variants for this run (--attention-bwd,
    --attention-fwd). They reach the kernels HyScale runs itself: with --hyscale-kernel-backend
    best the library's run where the measured table says so (--compare-own-kernels times the
    layer on HyScale's own kernels beside it)."""
    from megatron_hyscale.layers.qsa import QSA_ATTENTION_OPTIONS
    from megatron_hyscale.ops import AttentionKernelOptions

    # Each layer's own default when no flag changes it (what the layer runs without options).
    base = QSA_ATTENTION_OPTIONS if args.model == "qsa" else AttentionKernelOptions.DEFAULT
    changes: dict[str, bool] = {
        "split": dict(bwd_sm90=False), "fused": dict(bwd_fused=True, bwd_sm90=False),
        "sm90": dict(bwd_sm90=True)}.get(args.attention_bwd, {})
    changes |= {"gluon": dict(fwd_sm90=True, fwd_sm90_ws=False),
                "gluon_ws": dict(fwd_sm90=True, fwd_sm90_ws=True),
                "triton": dict(fwd_sm90=False, fwd_sm90_ws=False)}.get(args.attention_fwd, {})
    if args.attention_prefix != "auto":
        changes["prefix_sm90"] = args.attention_prefix == "sm90"
    if args.attention_lockstep is not None:
        paced = {"off": (), "dkv": ("dkv_lockstep",),
                 "all": ("fwd_lockstep", "dq_lockstep", "dkv_lockstep")}[args.attention_lockstep]
        changes |= {name: name in paced for name in ("fwd_lockstep", "dq_lockstep",
                                                      "dkv_lockstep")}
    return replace(base, **changes)


def hytopk_options(args: argparse.Namespace) -> Any:
    """HyTopK's kernel variant for this run (--hytopk-scores-sm90, --hytopk-sample-pick,
    --hytopk-scan-slots); None: its DEFAULT."""
    from megatron_hyscale.ops import HyTopKOptions

    setting = {"default": None, "on": True, "off": False}[args.hytopk_scores_sm90]
    changes = {} if setting is None else {"scores_sm90": setting}
    if args.hytopk_sample_pick is not None:
        changes["scores_sm90_sample_pick"] = args.hytopk_sample_pick
    if args.hytopk_scan_slots is not None:
        changes["scores_sm90_scan_slots"] = args.hytopk_scan_slots == "on"
    return replace(HyTopKOptions.DEFAULT, **changes) if changes else None


def indexer_loss_kernel_options(args: argparse.Namespace) -> Any:
    """HyScale's indexer-loss kernel variants for this run (--loss-kl-in-rows,
    --loss-lockstep, --loss-bwd-triton, --loss-key-passes)."""
    from megatron_hyscale.ops import IndexerLossKernelOptions

    changes = dict(kl_in_bwd=False) if args.loss_kl_in_rows else {}
    if args.loss_lockstep:
        changes["bwd_lockstep"] = True
    if args.loss_key_passes is not None:
        changes["bwd_key_passes"] = args.loss_key_passes
    if args.loss_bwd_triton:
        changes["bwd_sm90"] = False
    return replace(IndexerLossKernelOptions.DEFAULT, **changes)


def component_times(attn: torch.nn.Module, hidden: torch.Tensor,
                    args: argparse.Namespace) -> dict[str, float]:
    """dsa at CP 1: HyScale's pieces on the layer's own tensors: selection, attention, loss."""
    from megatron_hyscale.ops import hytopk, indexer_kl_loss, sparse_attention

    core = attn.core_attention
    with torch.no_grad():
        q_abs, kv, qr = attn.get_query_key_value_tensors(hidden, None, None)
        qi, ki, wi = core.indexer.forward_before_topk(hidden, qr, None)
    query, key = q_abs.transpose(0, 1), kv.transpose(0, 1)
    qi, ki, wi = qi.transpose(0, 1), ki.transpose(0, 1), wi.transpose(0, 1)
    relu = not args.no_relu
    sel = lambda: hytopk(qi, ki, wi, core.index_topk, relu=relu,  # noqa: E731
                         options=hytopk_options(args))
    indices, _ = sel()
    reps, dev = args.repeats, args.device
    times = {"selection_ms": time_step_ms(sel, dev, reps)}
    q_req = query.detach().requires_grad_()
    k_req = key.detach().requires_grad_()
    dv = attn.config.kv_lora_rank
    options = attention_kernel_options(args)

    def attn_fwd() -> None:
        with torch.no_grad():
            sparse_attention(query, key, None, indices, core.softmax_scale, dv=dv,
                             options=options)

    def attn_fwd_bwd() -> None:
        out = sparse_attention(q_req, k_req, None, indices, core.softmax_scale, dv=dv,
                               options=options)
        out.backward(torch.ones_like(out))

    times["attention_fwd_ms"] = time_step_ms(attn_fwd, dev, reps)
    times["attention_fwd_bwd_ms"] = time_step_ms(attn_fwd_bwd, dev, reps)
    qi_r, wi_r, ki_r = (t.detach().requires_grad_() for t in (qi, wi, ki))

    def loss_fwd_bwd() -> None:
        loss = indexer_kl_loss(qi_r, wi_r, ki_r, query, key, indices, core.softmax_scale,
                               args.loss_coeff, sparse=not args.dense_loss, relu=relu)
        loss.backward()

    times["indexer_loss_fwd_bwd_ms"] = time_step_ms(loss_fwd_bwd, dev, reps)
    return times


def selection_floor_ms(model: str, T: int, args: argparse.Namespace, rate_tflops: float,
                       layer: Layer) -> float | None:
    """The indexer GEMM of this rank's rows at the measured matmul rate (causal half)."""
    cfg = layer.module.config
    if model == "dsa":
        keys, heads, dim = T, cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim
    elif model == "csa":
        keys, heads, dim = T // 4, cfg.v4_index_n_heads, cfg.v4_index_head_dim
    elif model == "qsa":
        keys, heads, dim = T // cfg.qsa_block_size, cfg.qsa_indexer_n_heads, \
            cfg.qsa_indexer_head_dim
    else:
        return None
    flop = T / args.cp * keys / 2 * heads * dim * 2
    return flop / (rate_tflops * 1e12) * 1e3


def layer_floor_ms(model: str, T: int, args: argparse.Namespace, rate_tflops: float,
                   layer: Layer) -> float | None:
    """DSA: the matmul FLOP this rank's step cannot avoid, at the measured matmul rate.

    Per row: the linears (down / up projections, the absorbed MLA products, the output
    projection, the indexer's projections) 4x their forward (forward, recompute, backward 2x);
    sparse attention over topk keys (QK on kv_lora + rope, PV on kv_lora) 4.5x (backward 2.5x);
    the indexer loss (target scores and indexer logits on the selected keys) forward twice plus
    the logits' backward; the selection scan once (replayed in the recompute).
    """
    if model != "dsa":
        return None
    c = layer.module.config
    h, H, nope, rope, dv = (c.hidden_size, c.num_attention_heads, c.qk_head_dim,
                            c.qk_pos_emb_head_dim, c.v_head_dim)
    ql, kl, HI, DI, k = (c.q_lora_rank, c.kv_lora_rank, c.dsa_indexer_n_heads,
                         c.dsa_indexer_head_dim, c.dsa_indexer_topk)
    linear = (h * ql + ql * H * (nope + rope) + h * (kl + rope) + H * nope * kl + H * kl * dv
              + H * dv * h + ql * HI * DI + h * DI + h * HI)
    attention = H * k * ((kl + rope) + kl)
    target, logits = H * k * (kl + rope), HI * DI * k
    per_row = 4 * linear + 4.5 * attention + 2 * (target + logits) + 2 * logits
    rows = T / args.cp
    flop = 2 * rows * per_row + 2 * rows * T / 2 * HI * DI
    return flop / (rate_tflops * 1e12) * 1e3


def gather_ranks(value: Any) -> list[Any]:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def combine(per_rank: list[Any]) -> Any:
    """Rank 0's record with the slowest time and the largest peak over ranks, plus all ranks."""
    if len(per_rank) == 1 or not isinstance(per_rank[0], dict):
        return per_rank[0]
    failed = [r for r in per_rank if not isinstance(r, dict)]
    if failed:  # one rank's "OOM" / "error: ..." is the step's outcome
        return failed[0]
    first = dict(per_rank[0])
    first["fwd_bwd_ms"] = max(r["fwd_bwd_ms"] for r in per_rank)
    first["peak_extra_gib"] = max(r["peak_extra_gib"] for r in per_rank)
    first["per_rank"] = [{k: r.get(k) for k in ("fwd_bwd_ms", "peak_extra_gib",
                                                 "selection_in_step_ms")} for r in per_rank]
    return first


def guarded(fn: Callable[[], dict[str, Any]], device: str, *, keep_going: bool = False) -> Any:
    """fn's record, or "OOM"; with `keep_going` any other error becomes an "error: ..." record.

    keep_going is for the TileLang stock row: a kernel that fails to JIT-compile on the
    GPU should cost that row, not the HyScale and stock numbers of the whole run.
    """
    try:
        return fn()
    except torch.OutOfMemoryError:
        return "OOM"
    except Exception as exc:
        if not keep_going:
            raise
        import traceback

        traceback.print_exc()
        return f"error: {type(exc).__name__}: {str(exc)[:300]}"
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_request(args)
    import contextlib

    from hyscale_bench.cpu import megatron_on_cpu

    ctx = megatron_on_cpu() if args.device == "cpu" else contextlib.nullcontext()
    with ctx:
        try:
            return run(args)
        finally:
            shutdown_distributed()


def shutdown_distributed() -> None:
    """Tear the process groups down before exit: a gloo group left alive at interpreter exit
    can abort the process ("terminate called without an active exception") after the run."""
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    from megatron_hyscale import replay

    init_distributed(args)
    out_dir = Path(args.out)
    if rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    rate, copy = matmul_rate(args.device), copy_rate(args.device)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    base_name = "stock" if args.model == "dsa" else "baseline"
    tiny = " (tiny)" if args.tiny else ""
    log(f"device: {device_name} x {args.cp * args.dp} (CP {args.cp}, DP {args.dp})  "
        f"model: {args.model}{tiny}  matmul: {rate:.1f} TFLOP/s")
    build = BUILDERS[args.model]

    def hyscale_layer(**settings: Any) -> Layer:
        """A HyScale layer with this run's kernel options (its attention layers pass their
        config's options to the ops) and the config `settings` its row compares."""
        layer = build(args, baseline=False)
        config = layer.module.config
        config.attention_kernel_options = attention_kernel_options(args)
        config.indexer_loss_kernel_options = indexer_loss_kernel_options(args)
        config.hytopk_options = hytopk_options(args)
        config.hyscale_kernel_backend = args.hyscale_kernel_backend
        for name, value in settings.items():
            setattr(config, name, value)
        return layer

    # With --compare-mla-projections / --compare-selection-lse the main row's setting is
    # pinned, not read from $HYSCALE_MLA_PROJECTIONS / $HYSCALE_INDEXER_LSE: the rows must differ.
    pinned = ({"hyscale_mla_projections": "hyscale"} if args.compare_mla_projections else {})
    pinned |= {"hyscale_indexer_lse": "selection"} if args.compare_selection_lse else {}
    hyscale = hyscale_layer(**pinned)
    bases: list[tuple[str, Layer]] = []  # (row key, layer), each on HyScale's weights
    if args.compare_own_kernels:
        # with --compare-indexer-target, the other side of that comparison
        target = {"hyscale_indexer_target": "separate"} if args.compare_indexer_target else {}
        bases.append(("hyscale_own", hyscale_layer(hyscale_kernel_backend="own", **target)))
    if args.compare_indexer_target:
        bases.append(("hyscale_own_target_in_bwd",
                      hyscale_layer(hyscale_kernel_backend="own",
                                    hyscale_indexer_target="attention_backward")))
    if args.compare_selection_lse:
        bases.append(("hyscale_row_pass_lse", hyscale_layer(hyscale_indexer_lse="row_pass")))
    if args.compare_loss_key_passes is not None:
        bases.append(("hyscale_loss_key_passes", hyscale_layer(
            indexer_loss_kernel_options=replace(indexer_loss_kernel_options(args),
                                                bwd_key_passes=args.compare_loss_key_passes))))
    if args.compare_hytopk_atomics:
        from megatron_hyscale.ops import HyTopKOptions

        bases.append(("hyscale_hytopk_atomics", hyscale_layer(hytopk_options=replace(
            hytopk_options(args) or HyTopKOptions.DEFAULT, scores_sm90_sample_pick="topk",
            scores_sm90_scan_slots=False))))
    if args.compare_mla_projections:
        bases.append(("hyscale_megatron_projections",
                      hyscale_layer(hyscale_mla_projections="megatron")))
    if not args.skip_baseline:
        bases.append((base_name, build(args, baseline=True)))
    if args.stock_kernel_backend in ("tilelang", "cudnn"):
        backend = args.stock_kernel_backend
        bases.append((f"{base_name}_{backend}",
                      build_dsa(args, baseline=True, kernel_backend=backend)))
    for _, base in bases:
        base.module.load_state_dict(hyscale.module.state_dict())
    base_names = [name for name, _ in bases] or [base_name]
    rows: list[dict[str, Any]] = []
    for T in args.seq:
        row: dict[str, Any] = {"T": T, "cp": args.cp, "T_local": T // args.cp,
                               "selection_floor_ms": selection_floor_ms(args.model, T, args,
                                                                        rate, hyscale),
                               "layer_floor_ms": layer_floor_ms(args.model, T, args, rate,
                                                                hyscale)}
        t0 = time.time()
        log(f"[T={T}] HyScale ...")
        rec = guarded(partial(measure_hyscale if args.packed else measure, hyscale, T, args),
                      args.device)
        if isinstance(rec, dict) and args.model == "dsa" and args.cp == 1:
            hidden, _ = make_input(T, hyscale, args)
            parts = guarded(partial(component_times, hyscale.module, hidden.detach(), args),
                            args.device)
            if isinstance(parts, dict):
                rec.update(parts)
        row["hyscale"] = combine(gather_ranks(rec))
        replay.clear()
        packed = [(n, split) for n in args.packed or () for split in packed_splits(args)]
        measure_hyscale_packed(row, "hyscale", hyscale, T, args, packed)
        for name, base in bases:
            # the fused stock backends are not bound by the unfused path's score table
            limit = (args.baseline_max_seq if name == base_name else
                     1 << 62 if name.startswith("hyscale_") else args.fused_stock_max_seq)
            if T > limit:
                row[name] = "skipped"
                continue
            log(f"[T={T}] {name} ...")
            row[name] = combine(gather_ranks(guarded(partial(measure, base, T, args),
                                                     args.device, keep_going=name != base_name)))
            if name in PACKED_HYSCALE_ROWS:
                measure_hyscale_packed(row, name, base, T, args, packed)
            if name in PACKED_STOCK_ROWS:  # megatron's none and cudnn backends take THD
                for n, split in packed:
                    key = packed_name(name, n, split)
                    log(f"[T={T}] {key} ...")
                    row[key] = measure_packed(base, T, args, n, split, row[name], hyscale=False)
        if not bases:
            row[base_name] = "skipped"
        if len(base_names) > 1:  # the single-stock JSON keeps its earlier keys
            row["speedup"] = {name: _speedup(row["hyscale"], row[name]) for name in base_names}
        log(f"[T={T}] done in {time.time() - t0:.0f} s: {row}")
        rows.append(row)
        if rank() == 0:
            write_json(out_dir, args, device_name, rate, copy, base_names, rows)
    if rank() == 0:
        print_table(rows, base_names)
        plot(rows, out_dir, args, base_names)
    if torch.distributed.is_initialized() and args.cp * args.dp > 1:
        torch.distributed.barrier()
    return 0


def write_json(out_dir: Path, args: argparse.Namespace, device: str, rate: float, copy: float,
               base_names: list[str], rows: list[dict[str, Any]]) -> None:
    payload = {
        "model": args.model, "tiny": args.tiny, "device": device, "cp": args.cp, "dp": args.dp,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")), "matmul_tflops": rate,
        "copy_tbps": copy,
        "baseline_name": base_names[0], "date": datetime.now(UTC).isoformat(),
        "command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "rows": rows,
    }
    if len(base_names) > 1:
        payload["baseline_names"] = base_names
        payload["stock_kernel_backend"] = args.stock_kernel_backend
    if args.packed:
        payload["packed"] = packed_meta(args)
    (out_dir / f"bench_layer_{args.model}.json").write_text(json.dumps(payload, indent=1))
    if device != "cpu":  # the performance history keeps GPU runs only
        from hyscale_bench.measure import save_record

        config = f"{args.model}-cp{args.cp}" + (f"-{args.stock_kernel_backend}"
                                                if len(base_names) > 1 else "")
        config += "-packed" if args.packed else ""
        extra = {"baseline_names": base_names, "args": vars(args)}
        if args.packed:
            extra["packed"] = packed_meta(args)
        save_record("bench_layer", config, rows, matmul=rate, copy=copy, extra=extra)
    if args.model == "dsa":  # the name earlier runs (and BENCHMARKS.md) used
        (out_dir / "bench_layer.json").write_text(json.dumps(payload, indent=1))


def packed_meta(args: argparse.Namespace) -> dict[str, Any]:
    """What the packed rows are (the JSON's "packed" entry)."""
    return {"documents": args.packed, "split": args.packed_split, "splits": packed_splits(args),
            "selections": packed_selections(args),
            "goal_per_token_vs_unpacked": PACKED_GOAL, "uneven_seed": PACKED_SEED,
            "uneven_lengths": "log-normal(0, 1) shares of T from random.Random(seed + N)",
            "stock_rows_packed_where_timed": list(PACKED_STOCK_ROWS),
            "hyscale_rows_packed_where_timed": list(PACKED_HYSCALE_ROWS)}


def _f(v: Any, key: str, digits: int = 1) -> str:
    if isinstance(v, dict):
        x = v.get(key)
        return "-" if x is None else f"{x:.{digits}f}"
    return "error" if str(v).startswith("error") else str(v)  # the JSON keeps the message


def _speedup(hyscale: Any, stock: Any) -> float | None:
    """How many times faster HyScale's step is than the stock one (None without both)."""
    if isinstance(hyscale, dict) and isinstance(stock, dict):
        return stock["fwd_bwd_ms"] / hyscale["fwd_bwd_ms"]
    return None


def print_table(rows: list[dict[str, Any]], base_names: list[str]) -> None:
    # With one stock row the table is the one earlier runs printed; each further stock row
    # adds its own four columns, speed-up included.
    head = ("| T | CP | HyScale fwd+bwd ms | peak GiB/GPU | selection in step ms (share) |"
            " selection floor ms | computed / replayed |")
    for name in base_names:
        speedup = f"speed-up vs {name}" if len(base_names) > 1 else "speed-up"
        head += (f" {name} fwd+bwd ms | {name} peak GiB/GPU | {name} selection ms (share) |"
                 f" {speedup} |")
    print("\n" + head)
    print("|---" * (7 + 4 * len(base_names)) + "|")
    for r in rows:
        cells = [str(r["T"]), str(r["cp"])]
        for name in ("hyscale", *base_names):
            v = r[name]
            cells += [_f(v, "fwd_bwd_ms"), _f(v, "peak_extra_gib", 2)]
            if isinstance(v, dict) and v.get("selection_in_step_ms") is not None:
                cells.append(f"{v['selection_in_step_ms']:.1f} ({v['selection_share']:.0%})")
            else:
                cells.append("-")
            if name == "hyscale":
                floor = r["selection_floor_ms"]
                cells.append("-" if floor is None else f"{floor:.2f}")
                cells.append(f"{v['selections_computed']} / {v['selections_replayed']}"
                             if isinstance(v, dict) else "-")
            else:
                ratio = _speedup(r["hyscale"], v)
                cells.append("-" if ratio is None else f"{ratio:.2f}x")
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        floor, v = r.get("layer_floor_ms"), r["hyscale"]
        if floor and isinstance(v, dict):
            print(f"T={r['T']}: layer matmul floor {floor:.1f} ms; HyScale's step "
                  f"{v['fwd_bwd_ms'] / floor:.2f}x the floor")
    for r in rows:  # which of megatron's fused kernels ran in the instrumented step
        for name in base_names:
            v = r[name]
            if isinstance(v, dict) and "fused_kernels" in v:
                counts = ", ".join(f"{hook} {c['used']}/{c['declined']}"
                                   for hook, c in v["fused_kernels"].items())
                print(f"{name} at T={r['T']}: fused kernels used/declined: {counts}")
    print_packed_table(rows)
    dsa = [r for r in rows if isinstance(r["hyscale"], dict) and "selection_ms" in r["hyscale"]]
    if dsa:
        print("\n| T | selection ms (isolated) | attention fwd ms | attention fwd+bwd ms |"
              " indexer loss fwd+bwd ms |")
        print("|---|---|---|---|---|")
        for r in dsa:
            h = r["hyscale"]
            print(f"| {r['T']} | {h['selection_ms']:.1f} | {h['attention_fwd_ms']:.1f} | "
                  f"{h['attention_fwd_bwd_ms']:.1f} | {h['indexer_loss_fwd_bwd_ms']:.1f} |")


def packed_cells(v: Any) -> list[str]:
    """A packed row's cells after T and its name (print_packed_table)."""
    if not isinstance(v, dict):
        return [_f(v, "")] + ["-"] * 7
    lengths = v["doc_lengths"]
    size = (f"{lengths[0]} tokens" if min(lengths) == max(lengths)
            else f"{min(lengths)}-{max(lengths)} tokens")
    ratio = v.get("per_token_vs_unpacked")
    if ratio is None:
        per_token = "-"
    else:
        per_token = f"{ratio:.2f}x" + (" (goal met)" if v["within_goal"] else
                                       f" (over the {PACKED_GOAL:.2f}x goal)")
    if "path" not in v:
        path = "stock"
    elif v["path"] == "hyscale":
        path = f"HyScale ({v['fallback_warnings']} fallback warnings)"
    else:
        path = (f"STOCK FALLBACK ({v['fallback_warnings']} fallback warnings: "
                + "; ".join(v["fallback_reasons"]).replace("|", "/") + ")")
    sel = v.get("selection_in_step_ms")
    return [f"{v['documents']} {v['split']}, {size}", _f(v, "fwd_bwd_ms"),
            _f(v, "peak_extra_gib", 2),
            "-" if sel is None else f"{sel:.1f} ({v['selection_share']:.0%})",
            f"{v['selections_computed']} / {v['selections_replayed']}", per_token,
            f"{v['visible_keys_vs_unpacked']:.3f}", path]


def print_packed_table(rows: list[dict[str, Any]]) -> None:
    """--packed: each packed row against its unpacked row (same T tokens, same weights)."""
    packed = [(r, key) for r in rows for key in r if PACKED_KEY.search(key)]
    if not packed:
        return
    print("\n| T | packed row | documents | fwd+bwd ms | peak GiB/GPU | selection in step ms "
          "(share) | computed / replayed | per-token time vs unpacked | causal key pairs vs "
          "unpacked | path |")
    print("|---" * 10 + "|")
    for r, key in packed:
        print("| " + " | ".join([str(r["T"]), key, *packed_cells(r[key])]) + " |")


def plot(rows: list[dict[str, Any]], out_dir: Path, args: argparse.Namespace,
         base_names: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("hyscale", *base_names):
        pts = [(r["T"], r[name]) for r in rows if isinstance(r[name], dict)]
        if pts:
            axes[0].plot([t for t, _ in pts], [m["fwd_bwd_ms"] for _, m in pts], "o-", label=name)
            axes[1].plot([t for t, _ in pts], [max(m["peak_extra_gib"], 1e-6) for _, m in pts],
                         "o-", label=name)
    for ax, label in zip(axes, ("fwd+bwd ms (full recompute)", "peak extra GiB per GPU")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens, global)")
        ax.set_ylabel(label)
        ax.legend()
    titles = {"dsa": "DSA layer, GLM-5.1", "csa": "CSA layer, DeepSeek-V4-Flash",
              "hca": "HCA layer, DeepSeek-V4-Flash", "qsa": "QSA layer, Qwen3.8-Flash-Next"}
    fig.suptitle(f"{titles[args.model]} geometry{' (tiny)' if args.tiny else ''}, CP {args.cp}")
    fig.tight_layout()
    fig.savefig(out_dir / f"bench_layer_{args.model}.png", dpi=120)
    if args.model == "dsa":  # the name earlier runs used
        fig.savefig(out_dir / "bench_layer.png", dpi=120)
    plt.close(fig)


def cli() -> None:
    """The command line: `python -m hyscale_bench.layer`, `scripts/bench_layer.py`."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())


if __name__ == "__main__":
    cli()

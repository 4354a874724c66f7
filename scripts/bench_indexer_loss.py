"""Benchmark HyScale's Triton sparse indexer KL loss (forward, backward) against the reference.

Shape: GLM-5.1 DSA (main attention 64 query heads over 1 absorbed KV head of 576 = 512 + 64;
indexer 32 heads x 128; top-2048), optionally DeepSeek-V3.2 (128 heads, indexer 64 x 128);
T queries over S = T keys, B = 1, bf16. Indices: one random visible key per stratum of K
equal strata of the row's visible keys (distinct, causal, spread over the whole prefix).

Rates are ratios to the bf16 matmul rate measured in the same run (8192^3 torch.matmul).
FLOP counts are what the kernels execute over the valid slots n (summed over rows):
target 2 passes x 2 n Hq Dqk (per-head softmax statistics, then probabilities), loss
2 passes x 2 n H_I D_I, backward 3 x 2 n H_I D_I (scores recomputed, dq, dk). "useful" counts
one pass of each forward product and the two backward products. "w/ lse": the target pass
given the attention forward's log-sum-exp (one pass instead of two: the DSA layer's path; the
fwd column times the op without it). Baseline: the plain-torch
reference (`backend="reference"`, chunked, checkpointed) where T <= --ref-max-t. The stock
cudnn backend's kernels (cuDNN-frontend's sparse indexer-score and target recompute, a torch
KL, cuDNN's indexer backward; HyScale's `backend="cudnn"`), with the attention's lse given to
it and to a second Triton run, where scripts/gpu_cudnn.sh installed them (--no-library skips).
Stock TileLang (--no-tilelang skips): megatron-core's sparse-KL loss as its tilelang backend
runs it (`tilelang_dsa.fused_qk_topk_lighting_with_streaming_sparse_kl`: per block of 8192 rows
TileLang's indexer writes an fp32 [8192, T] score table, the selected scores are read from it,
then per 512 rows TileLang's target and KL kernels; backward: TileLang's indexer backward),
given this benchmark's indices in place of its own top-k so that its loss is comparable (the
top-k itself is bench_selection.py's stock_tilelang); "scores" times the table pass alone,
which the stock layer shares with its selection. TileLang's target takes no lse. Needs
TileLang (scripts/gpu_tilelang.sh): without it the run says why once and goes on.

  python scripts/bench_indexer_loss.py                   # T in 16K, 64K, 128K, GLM-5.1
  python scripts/bench_indexer_loss.py --quick           # T = 16K, fewer repeats
  python scripts/bench_indexer_loss.py --shapes glm51 v32 --t 131072 --deterministic
  python scripts/bench_indexer_loss.py --t 32768 --target-tilings 32x2 64x2 64x1

"from dQ" (--no-from-dq skips): the target emitted by the attention backward's dQ kernel
(`sparse_attention_bwd_with_target`, issue #20 item 3): the attention backward with and without
it, so the loss on that path costs the difference plus the loss and backward kernels.

--target-tilings times the target pass (the heaviest launch) at each (keys per step x stages)
tiling and exits; a tiling that does not fit is reported.

--variants NAME... times the loss row pass and the backward kernel under IndexerLossKernelOptions
variants (LOSS_VARIANTS) beside the default, in one run, then exits: each alone and back to
back as the attention op's backward runs them (rows then backward, or the fused kernel), with
each variant's largest difference from the default's outputs; writes
bench_indexer_loss_variants.json.

  python scripts/bench_indexer_loss.py --t 32768 131072 --shapes glm51 v32 --variants all

Needs a CUDA GPU (every mode).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import replace
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyscale_bench.measure import (  # noqa: E402
    copy_tbps,
    log,
    matmul_tflops,
    parse_tiling,
    require_cuda,
    save_record,
    time_ms,
)
from hyscale_bench.stock_kernels import tilelang_unavailable  # noqa: E402
from megatron_hyscale.ops.indexer_loss import index_lse_from_scores, indexer_kl_loss  # noqa: E402
from megatron_hyscale.ops.kernels import indexer_loss as kern  # noqa: E402
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions  # noqa: E402
from megatron_hyscale.ops.sparse_attention import sparse_attention  # noqa: E402

# name: (Hq, Hkv, Dqk, H_I, D_I, K)
SHAPES = {"glm51": (64, 1, 576, 32, 128, 2048), "v32": (128, 1, 576, 64, 128, 2048)}
MATMUL_N = 8192
INDEX_ROWS_PER_CHUNK = 16384  # rows of index generation at a time (bounds its temporaries)


def spread_indices(T, K, seed=0):
    """int32 [1, T, K]: distinct visible keys, one random key per stratum (see docstring)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.empty((1, T, K), device="cuda", dtype=torch.int32)
    j = torch.arange(K, device="cuda")[None, :]
    for t0 in range(0, T, INDEX_ROWS_PER_CHUNK):
        t1 = min(T, t0 + INDEX_ROWS_PER_CHUNK)
        n = torch.arange(t0, t1, device="cuda")[:, None] + 1
        lo, hi = (j * n) // K, ((j + 1) * n) // K
        u = torch.rand((t1 - t0, K), generator=g, device="cuda")
        strat = torch.minimum(lo + (u * (hi - lo)).long(), hi - 1)
        out[0, t0:t1] = torch.where(n >= K, strat, torch.where(j < n, j, -1)).to(torch.int32)
    return out


def make_inputs(shape, T, seed=0):
    Hq, Hkv, Dqk, H_I, D_I, K = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g, device="cuda") * sc).to(torch.bfloat16)
    x = dict(q_index=r(1, T, H_I, D_I, sc=0.3).requires_grad_(),
             weights=r(1, T, H_I, sc=H_I ** -0.5).requires_grad_(),
             k_index=r(1, T, D_I, sc=0.3).requires_grad_(),
             query=r(1, T, Hq, Dqk), key=r(1, T, Hkv, Dqk))
    return x, spread_indices(T, K, seed)


def flops(shape, n_valid):
    Hq, _, Dqk, H_I, D_I, _ = SHAPES[shape]
    target, index = 2 * n_valid * Hq * Dqk, 2 * n_valid * H_I * D_I
    return dict(fwd=2 * target + 2 * index, bwd=3 * index, fwd_useful=target + index,
                bwd_useful=2 * index)


def time_loss(loss_fn, params, warmup, reps):
    """Median forward, backward and forward+backward ms, peak memory over the inputs (GiB)
    and the value of the loss `loss_fn()` returns, differentiated in `params`."""
    with torch.no_grad():
        fwd_ms = time_ms(loss_fn, reps=reps, warmup=warmup)
    loss = loss_fn()
    bwd_ms = time_ms(lambda: torch.autograd.grad(loss, params, retain_graph=True),
                     reps=reps, warmup=warmup)
    loss = None  # frees the graph before the memory measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(loss_fn(), params)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    with torch.no_grad():
        value = loss_fn().item()
    return dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms, total_ms=fwd_ms + bwd_ms, extra_peak_gib=peak,
                loss=value)


def bench(x, idx, backend, warmup, reps, deterministic=False, attention_lse=None):
    """time_loss() of one backend (attention_lse: the attention forward's, as the DSA layer
    passes it)."""
    scale = x["query"].shape[-1] ** -0.5
    params = (x["q_index"], x["weights"], x["k_index"])
    kw = dict(deterministic=deterministic) if backend == "triton" else {}

    def fwd():
        # check_values=False: the kernels are timed, not the input checks (the layers skip
        # them too)
        return indexer_kl_loss(*params, x["query"], x["key"], idx, scale, LOSS_COEFF,
                               sparse=True, backend=backend, attention_lse=attention_lse,
                               check_values=False, **kw)

    return time_loss(fwd, params, warmup, reps)


def cudnn_unavailable():
    from megatron_hyscale.ops.backends.availability import CUDNN, library_unavailable

    return library_unavailable(CUDNN, torch.device("cuda"))


# Query rows a block in megatron-core's TileLang indexer (DSAttention's
# fused_indexer_block_size default): an fp32 [rows, T] score table each.
TILELANG_BLOCK_ROWS = 8192
LOSS_COEFF = 0.1  # every loss here (HyScale's backends, TileLang's)


def tilelang_loss_unavailable():
    """None when megatron-core's TileLang indexer-loss kernels can run here, else why not."""
    why_not = tilelang_unavailable()
    if why_not:
        return why_not
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    missing = [name for name in ("lighting_indexer", "SparseIndexerKLLoss",
                                 "sparse_indexer_target_interface")
               if getattr(tilelang_dsa, name, None) is None]
    if missing:
        return f"megatron-core's TileLang kernels do not import: {', '.join(missing)}"
    return None


def tilelang_bounds(T, device):
    """Each row's causal key bounds [0, t + 1), int32, as DSAttention builds them."""
    ends = torch.arange(1, T + 1, device=device, dtype=torch.int32)
    return torch.zeros_like(ends), ends


def tilelang_loss(x, idx, scale):
    """megatron-core's TileLang sparse-KL loss (its streaming loop and kernels, [S, B, ...]
    tensors as DSAttention passes them, B = 1: views), with `idx` as the selection: its
    lighting_indexer is called with these indices (the block's rows found from their causal
    ends) instead of selecting its own top-k. Returns the loss (differentiable in q_index,
    weights and k_index)."""
    from types import SimpleNamespace

    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    T = idx.shape[1]
    starts, ends = tilelang_bounds(T, idx.device)
    indexer = tilelang_dsa.lighting_indexer
    if indexer is None:  # megatron's loop returns None without it: the layer falls back
        raise RuntimeError("megatron-core's TileLang indexer loss declined these inputs (its "
                           "TileLang indexer did not import)")

    def given_indices(index_q, index_k, index_w, ks, ke, topk, topk_indices=None, use_relu=True):
        t0 = int(ke[0]) - 1  # the block's first row (its causal end is t0 + 1)
        return indexer(index_q, index_k, index_w, ks, ke, topk,
                       topk_indices=idx[0, t0:t0 + index_q.shape[0]], use_relu=use_relu)

    tilelang_dsa.lighting_indexer = given_indices
    try:
        out = tilelang_dsa.fused_qk_topk_lighting_with_streaming_sparse_kl(
            q=x["q_index"].transpose(0, 1), k=x["k_index"].transpose(0, 1),
            weights=x["weights"].transpose(0, 1), index_topk=idx.shape[-1], starts=starts,
            ends=ends, block_size=TILELANG_BLOCK_ROWS, query=x["query"].transpose(0, 1),
            key=x["key"].transpose(0, 1), softmax_scale=scale, loss_coeff=LOSS_COEFF,
            pg_collection=SimpleNamespace(tp=None), use_relu=True)
    finally:
        tilelang_dsa.lighting_indexer = indexer
    if out is None:  # the stock layer would fall back to its reference path: not timed here
        raise RuntimeError("megatron-core's TileLang indexer loss declined these inputs")
    return out[1]


def tilelang_scores(x, idx):
    """The TileLang loss path's index-score pass alone: per block, the fp32 [rows, T] table
    and the selected entries read from it (no loss, no gradient)."""
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    T = idx.shape[1]
    starts, ends = tilelang_bounds(T, idx.device)
    q, k = x["q_index"][0].detach(), x["k_index"][0].detach()
    w = x["weights"][0].detach().float()
    with torch.no_grad():
        for t0 in range(0, T, TILELANG_BLOCK_ROWS):
            t1 = min(T, t0 + TILELANG_BLOCK_ROWS)
            tilelang_dsa.lighting_indexer(q[t0:t1], k, w[t0:t1], starts[t0:t1], ends[t0:t1],
                                          idx.shape[-1], topk_indices=idx[0, t0:t1])


def bench_tilelang(x, idx, warmup, reps):
    """time_loss() of megatron's TileLang loss, and its score pass alone ("scores_ms")."""
    scale = x["query"].shape[-1] ** -0.5
    params = (x["q_index"], x["weights"], x["k_index"])
    row = time_loss(lambda: tilelang_loss(x, idx, scale), params, warmup, reps)
    row["scores_ms"] = time_ms(lambda: tilelang_scores(x, idx), reps=reps, warmup=warmup)
    return row


def tilelang_entry(x, idx, warmup, reps, said):
    """The row's "tilelang" entry: bench_tilelang's dict, "OOM", or "not run: <why>"; each
    reason is logged once a run (`said` holds those logged)."""
    why_not = tilelang_loss_unavailable()
    if why_not:
        if why_not not in said:
            log(f"tilelang: not run ({why_not})")
            said.add(why_not)
        return f"not run: {why_not}"
    torch.cuda.empty_cache()
    try:
        return bench_tilelang(x, idx, warmup, reps)
    except torch.OutOfMemoryError:
        return "OOM"
    finally:
        torch.cuda.empty_cache()


def bench_parts(x, idx, warmup, reps):
    """Each Triton launch on its own: target (select + target), loss, backward."""
    scale = x["query"].shape[-1] ** -0.5
    T = idx.shape[1]
    qpos = torch.arange(T, device="cuda")[None]
    kpos = qpos
    q, w, k = (x[n].detach() for n in ("q_index", "weights", "k_index"))
    target = lambda: kern.attention_target(x["query"], x["key"], idx, qpos, kpos, scale)
    p = target()
    ms_target = time_ms(target, reps=reps, warmup=warmup)
    p_norm = p.clone()
    # The loss pass normalizes p in place; normalizing a normalized p repeats the same work.
    _, lse, psum = kern.indexer_loss_rows(q, w, k, idx, p_norm, True)
    ms_loss = time_ms(lambda: kern.indexer_loss_rows(q, w, k, idx, p_norm, True),
                      reps=reps, warmup=warmup)
    grad = torch.ones((), device="cuda")
    ms_bwd = time_ms(lambda: kern.indexer_loss_bwd(q, w, k, idx, p_norm, lse, psum, grad,
                                                   1.0 / T, True), reps=reps, warmup=warmup)
    # The layer's path: the attention forward's log-sum-exp replaces the target's first pass.
    _, attn_lse = sparse_attention(x["query"], x["key"], None, idx, scale,
                                   dv=min(512, x["query"].shape[-1]), return_lse=True)
    ms_target_lse = time_ms(lambda: kern.attention_target(
        x["query"], x["key"], idx, qpos, kpos, scale, attention_lse=attn_lse),
        reps=reps, warmup=warmup)
    return dict(target_ms=ms_target, target_with_lse_ms=ms_target_lse, loss_ms=ms_loss,
                bwd_kernel_ms=ms_bwd)


def bench_target_from_dq(x, idx, warmup, reps):
    """The target from the attention backward's dQ kernel (issue #20 item 3): the attention
    backward (dQ + dK/dV) with and without emitting it, and how far its target is from
    `attention_target`'s (given the same lse). The loss's cost on that path is the difference
    plus the loss and backward kernels (`loss_ms`, `bwd_kernel_ms`)."""
    from megatron_hyscale.ops.kernels import sparse_attention as attn

    scale = x["query"].shape[-1] ** -0.5
    q, k = x["query"], x["key"]
    dv = min(512, q.shape[-1])
    out, lse = attn.sparse_attention_fwd(q, k, None, idx, scale, dv=dv)
    dout = torch.randn_like(out)
    args = (q, k, None, idx, scale, out, lse, dout)
    plain = time_ms(lambda: attn.sparse_attention_bwd(*args, dv=dv), reps=reps, warmup=warmup)
    with_target = time_ms(lambda: attn.sparse_attention_bwd_with_target(*args, dv=dv),
                          reps=reps, warmup=warmup)
    target = attn.sparse_attention_bwd_with_target(*args, dv=dv)[4]
    pos = torch.arange(idx.shape[1], device=idx.device)[None]
    ref = kern.attention_target(q, k, idx, pos, pos, scale, attention_lse=lse)
    diff = float((target - ref).abs().max())
    return dict(attn_bwd_ms=plain, attn_bwd_with_target_ms=with_target,
                target_in_dq_ms=with_target - plain, target_from_dq_max_abs_diff=diff)


def target_sweep(shapes, Ts, tilings, warmup, reps, out_dir):
    """ms of the target pass per tiling (IndexerLossKernelOptions.target_tilings forced to it);
    writes JSON."""
    rows, default = [], IndexerLossKernelOptions.DEFAULT.target_tilings
    for shape in shapes:
        for T in Ts:
            x, idx = make_inputs(shape, T)
            pos = torch.arange(T, device="cuda")[None]
            target = partial(kern.attention_target, x["query"], x["key"], idx, pos, pos,
                             x["query"].shape[-1] ** -0.5)
            for tiling in tilings:
                options = replace(IndexerLossKernelOptions.DEFAULT, target_tilings=(tiling,))
                kern._tiling_cache.clear()
                try:
                    ms = time_ms(partial(target, options=options), reps=reps, warmup=warmup)
                except RuntimeError as err:  # no fit is reported, not fatal
                    ms = f"failed: {str(err)[:80]}"
                rows.append(dict(shape=shape, T=T, block_n=tiling[0], stages=tiling[1],
                                 target_ms=ms))
                log(f"target {shape} T={T} tiling {tiling[0]}x{tiling[1]}: "
                    + (f"{ms:.2f} ms" if isinstance(ms, float) else ms))
    kern._tiling_cache.clear()
    with open(os.path.join(out_dir, "bench_indexer_loss_target_sweep.json"), "w") as f:
        json.dump(dict(command=" ".join(sys.argv), default=default, rows=rows), f, indent=1)


# IndexerLossKernelOptions fields of the row-pass and backward variants (see options.py). The
# Triton backward's own tunings (warps, registers, tilings, lockstep) take bwd_sm90=False: on
# Hopper the default backward is the Gluon kernel, which they do not tune.
TRITON_BWD = dict(bwd_sm90=False)
# The variant whose row pass takes the selection's log-sum-exp (not an options field: the DSA
# layer's hyscale_indexer_lse = "selection" hands the op `index_lse`).
SELECTION_LSE = "selection_lse"
LOSS_VARIANTS = {
    "one_pass": dict(loss_one_pass=True),
    "fused": dict(fused_rows_bwd=True),
    "kl_in_bwd": dict(kl_in_bwd=True),
    # the backward's persistent programs paced together (the stratified rows are in key
    # order, as the DSA layer's)
    "lockstep": dict(bwd_lockstep=True, **TRITON_BWD),
    "lockstep2": dict(bwd_lockstep=True, bwd_lockstep_slack=2, **TRITON_BWD),
    "lockstep_1sm": dict(bwd_lockstep=True, bwd_lockstep_programs_per_sm=1,
                         **TRITON_BWD),
    # the same pace in the Hopper (Gluon) backward: each consumer's rows by waves; a wider
    # slack waits less and keeps more of dk_index live (a tile's keys span about T / 32 rows of
    # it on the stratified rows, 2 MiB at 128K: 8 tiles stay within the 50 MiB L2)
    "bwd_sm90_lockstep": dict(bwd_lockstep=True),
    "bwd_sm90_lockstep4": dict(bwd_lockstep=True, bwd_lockstep_slack=4),
    "bwd_sm90_lockstep8": dict(bwd_lockstep=True, bwd_lockstep_slack=8),
    "warps8": dict(bwd_num_warps=8, loss_num_warps=8, **TRITON_BWD),
    "warps8_r128": dict(bwd_num_warps=8, bwd_maxnreg=128, **TRITON_BWD),
    "r168": dict(bwd_maxnreg=168, **TRITON_BWD),
    "n32x2": dict(index_tilings=((32, 2),), **TRITON_BWD),
    # deeper pipelines: from 3 stages Triton's pipeliner turns the gathered key rows into
    # asynchronous copies (cp.async) issued a tile ahead (sm_90a SASS, GLM-5.1's backward
    # tile: 5 -> 13 LDGSTS, 24 -> 16 LDG), the latency the 2026-12-06 probe found dominant
    "n64x3": dict(index_tilings=((64, 3),), **TRITON_BWD),
    "n32x3": dict(index_tilings=((32, 3),), **TRITON_BWD),
    "n32x4": dict(index_tilings=((32, 4),), **TRITON_BWD),
    "n64x4": dict(index_tilings=((64, 4),), **TRITON_BWD),
    "n32x2_r128": dict(index_tilings=((32, 2),), bwd_maxnreg=128, **TRITON_BWD),
    "fused_warps8": dict(fused_rows_bwd=True, bwd_num_warps=8),
    "fused_warps8_r128": dict(fused_rows_bwd=True, bwd_num_warps=8, bwd_maxnreg=128),
    "one_pass_fused_warps8_r128": dict(loss_one_pass=True, fused_rows_bwd=True,
                                       bwd_num_warps=8, bwd_maxnreg=128),
    # the backward on the Triton kernel (the default before 2026-12-06: on Hopper the
    # warp-specialized Gluon kernel, bwd_sm90, the row KL in it as kl_in_bwd is)
    "triton_bwd": dict(TRITON_BWD),
    # the Gluon backward without the KL terms (the row pass keeps its own KL pass) ...
    "bwd_sm90_no_kl": dict(bwd_sm90=True, kl_in_bwd=False),
    # ... and the Triton backward without them: bwd_sm90_no_kl's baseline of the same work
    "no_kl_in_bwd": dict(kl_in_bwd=False, **TRITON_BWD),
    # the row pass as the DSA layer runs it (hyscale_indexer_lse "selection"): the index scores'
    # log-sum-exp from the selection's scores (`index_lse_from_scores` over a [B, T, K] fp32
    # tensor, timed in the row pass) and the target normalized without a gather
    # (`normalize_target`)
    SELECTION_LSE: dict(),
    # the Gluon backward in N key passes (bwd_key_passes; the default 0 picks by size; the
    # stratified rows are in key order, valid keys first, as HyTopK's key-ordered output):
    # with the gathered row pass, and as the DSA layer runs it, on the selection's
    # log-sum-exp (key_passes1: one pass, the form before 2026-12-07)
    "key_passes1": dict(bwd_key_passes=1),
    "key_passes2": dict(bwd_key_passes=2),
    "key_passes4": dict(bwd_key_passes=4),
    f"{SELECTION_LSE}_key_passes1": dict(bwd_key_passes=1),
    f"{SELECTION_LSE}_key_passes2": dict(bwd_key_passes=2),
    f"{SELECTION_LSE}_key_passes3": dict(bwd_key_passes=3),
    f"{SELECTION_LSE}_key_passes4": dict(bwd_key_passes=4),
    f"{SELECTION_LSE}_key_passes8": dict(bwd_key_passes=8),
}


def loss_variant_row(x, idx, options, warmup, reps, deterministic, reference=None,
                     selection_lse=False):
    """ms of the row pass, the backward kernel and the two back to back under `options` (and
    the deterministic pair when asked); the outputs' largest differences from `reference`
    (the default's (kl, dq, dw, dk)). selection_lse: the row pass is the log-sum-exp of a
    selection's [B, T, K] scores (their values: this run's index scores' row log-sum-exp,
    taken once untimed) and `normalize_target`. Returns (row, outputs)."""
    scale = x["query"].shape[-1] ** -0.5
    T = idx.shape[1]
    pos = torch.arange(T, device=idx.device)[None]
    q, w, k = (x[n].detach() for n in ("q_index", "weights", "k_index"))
    p0 = kern.attention_target(x["query"], x["key"], idx, pos, pos, scale)
    grad = torch.ones((), device=idx.device)
    kern._tiling_cache.clear()
    p = p0.clone()
    # kl_in_bwd: the row pass without its KL pass, the KL from the backward kernel.
    kl_in_bwd = options.kl_in_bwd and not options.fused_rows_bwd
    if options.fused_rows_bwd:
        kl, dq, dw, dk = kern.indexer_loss_rows_bwd(q, w, k, idx, p, grad, 1.0 / T, True,
                                                    options=options)
    else:
        kl, lse, psum = kern.indexer_loss_rows(q, w, k, idx, p, True, options,
                                               with_kl=not kl_in_bwd)
        dq, dw, dk, *kl_bwd = kern.indexer_loss_bwd(q, w, k, idx, p, lse, psum, grad, 1.0 / T,
                                                    True, options=options, with_kl=kl_in_bwd,
                                                    keys_ascending=True)
        kl = kl_bwd[0] if kl_in_bwd else kl
    # The row pass normalizes p in place; normalizing a normalized p repeats the same work.
    rows = partial(kern.indexer_loss_rows, q, w, k, idx, p, True, options,
                   with_kl=not kl_in_bwd)
    _, lse, psum = rows()
    if selection_lse:
        # A stand-in for HyTopK's scores with the same log-sum-exp a row: the row's lse at
        # its first valid slot, -inf elsewhere (logsumexp's cost does not depend on values).
        scores = torch.full(idx.shape, float("-inf"), device=idx.device)
        scores[..., 0] = lse
        given = index_lse_from_scores(scores)

        def rows():
            return None, index_lse_from_scores(scores), kern.normalize_target(p, options)

        p = p0.clone()
        psum = kern.normalize_target(p, options)
        dq, dw, dk, kl = kern.indexer_loss_bwd(q, w, k, idx, p, given, psum, grad, 1.0 / T,
                                               True, options=options, with_kl=True,
                                               keys_ascending=True)
    bwd = partial(kern.indexer_loss_bwd, q, w, k, idx, p, lse, psum, grad, 1.0 / T, True,
                  options=options, with_kl=kl_in_bwd, keys_ascending=True)

    def pair(det=False):
        if selection_lse:
            _, lse_, psum_ = rows()
            return kern.indexer_loss_bwd(q, w, k, idx, p, lse_, psum_, grad, 1.0 / T, True,
                                         det, options, with_kl=True, keys_ascending=True)
        if options.fused_rows_bwd:
            return kern.indexer_loss_rows_bwd(q, w, k, idx, p, grad, 1.0 / T, True, det,
                                              options)
        _, lse_, psum_ = kern.indexer_loss_rows(q, w, k, idx, p, True, options,
                                                with_kl=not kl_in_bwd)
        return kern.indexer_loss_bwd(q, w, k, idx, p, lse_, psum_, grad, 1.0 / T, True, det,
                                     options, with_kl=kl_in_bwd, keys_ascending=True)

    row = dict(rows_ms=time_ms(rows, reps=reps, warmup=warmup),
               bwd_kernel_ms=time_ms(bwd, reps=reps, warmup=warmup),
               rows_bwd_ms=time_ms(pair, reps=reps, warmup=warmup),
               tilings={"/".join(map(str, key[:1])): v for key, v in kern._tiling_cache.items()})
    if deterministic:
        row["rows_bwd_det_ms"] = time_ms(partial(pair, True), reps=reps, warmup=warmup)
    outputs = (kl.sum(), dq, dw, dk)
    if reference is not None:
        row["kl_sum_rel_diff"] = float((outputs[0] - reference[0]).abs()
                                       / reference[0].abs().clamp_min(1e-30))
        for name, a, b in zip(("dq", "dw", "dk"), outputs[1:], reference[1:]):
            row[f"{name}_max_abs_diff"] = float((a.float() - b.float()).abs().max())
            row[f"{name}_max_abs"] = float(b.float().abs().max())
    kern._tiling_cache.clear()
    return row, outputs


def loss_variant_sweep(shapes, Ts, names, deterministic, warmup, reps, out_dir):
    """Each of `names` (LOSS_VARIANTS, or "all") beside the default per shape and T; JSON."""
    names = list(LOSS_VARIANTS) if names == ["all"] else names
    mm, bw = matmul_tflops(), copy_tbps()
    meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                command=" ".join(sys.argv), torch=torch.__version__, matmul_tflops=mm, copy_tbps=bw,
                variants={n: {k: list(v) if isinstance(v, tuple) else v
                              for k, v in LOSS_VARIANTS[n].items()} for n in names},
                results=[])
    path = os.path.join(out_dir, "bench_indexer_loss_variants.json")
    for shape in shapes:
        for T in Ts:
            x, idx = make_inputs(shape, T)
            entry = dict(shape=shape, T=T)
            default, ref = loss_variant_row(x, idx, IndexerLossKernelOptions.DEFAULT, warmup,
                                            reps, deterministic)
            entry["default"] = default
            log(f"{shape} T={T} default: rows {default['rows_ms']:.2f} bwd "
                f"{default['bwd_kernel_ms']:.2f} both {default['rows_bwd_ms']:.2f} ms")
            for name in names:
                options = replace(IndexerLossKernelOptions.DEFAULT, **LOSS_VARIANTS[name])
                try:
                    row, _ = loss_variant_row(x, idx, options, warmup, reps, deterministic, ref,
                                              selection_lse=name.startswith(SELECTION_LSE))
                except RuntimeError as err:  # no tiling fits: reported, not fatal
                    row = f"failed: {str(err)[:120]}"
                    log(f"{shape} T={T} {name}: {row}")
                else:
                    log(f"{shape} T={T} {name}: rows {row['rows_ms']:.2f} bwd "
                        f"{row['bwd_kernel_ms']:.2f} both {row['rows_bwd_ms']:.2f} ms "
                        f"({row['rows_bwd_ms'] / default['rows_bwd_ms']:.3f}x); kl rel diff "
                        f"{row['kl_sum_rel_diff']:.1e}, dk max diff "
                        f"{row['dk_max_abs_diff']:.1e} of {row['dk_max_abs']:.1e}")
                entry[name] = row
            meta["results"].append(entry)
            with open(path, "w") as fh:
                json.dump(meta, fh, indent=1)
            save_record("bench_indexer_loss_variants", "-".join(shapes), meta["results"],
                        matmul=mm, copy=bw, extra={"variants": meta["variants"]})
            # ref holds the default's gradients at this T: not to be held through the next T.
            del x, idx, ref
            torch.cuda.empty_cache()
    log(f"wrote {path}")


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Needs a CUDA GPU (every mode): without one it exits "
                                        "with status 2 before writing anything.")
    ap.add_argument("--t", type=int, nargs="+", default=[16384, 65536, 131072],
                    help="sequence lengths T (queries = keys; default 16K, 64K, 128K)")
    ap.add_argument("--shapes", nargs="+", default=["glm51"], choices=sorted(SHAPES),
                    help="glm51: GLM-5.1 DSA (64 heads, indexer 32 x 128; the default); v32: "
                         "DeepSeek-V3.2 (128 heads, indexer 64 x 128)")
    ap.add_argument("--ref-max-t", type=int, default=16384,
                    help="longest T at which the plain-torch reference is timed too")
    ap.add_argument("--deterministic", action="store_true",
                    help="also time the deterministic backward (k_index's gradient "
                         "without fp32 atomics)")
    ap.add_argument("--quick", action="store_true", help="T = 16K only, fewer repeats")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    ap.add_argument("--reps", type=int, default=5, help="timed calls (the median is kept)")
    ap.add_argument("--no-library", action="store_true",
                    help="skip cuDNN's loss kernels (the stock cudnn backend's), run where "
                         "scripts/gpu_cudnn.sh installed them")
    ap.add_argument("--no-from-dq", action="store_true",
                    help="skip the target from the attention backward's dQ kernel (the "
                         "attention backward timed with and without it)")
    ap.add_argument("--no-tilelang", action="store_true",
                    help="skip megatron-core's TileLang loss kernels (the stock tilelang "
                         "backend's), run where scripts/gpu_tilelang.sh installed TileLang")
    ap.add_argument("--out", default="results",
                    help="folder for bench_indexer_loss.json (default results); records also "
                         "go to $HYSCALE_RESULTS (default benchmarks/results/)")
    ap.add_argument("--target-tilings", nargs="+", type=parse_tiling, default=None,
                    metavar="NxS",
                    help="time the target pass at each tiling (keys per step x stages, e.g. "
                         "32x2), write bench_indexer_loss_target_sweep.json, then exit")
    ap.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                    choices=sorted(LOSS_VARIANTS) + ["all"],
                    help="time the row pass and backward under these IndexerLossKernelOptions "
                         "variants beside the default (--deterministic adds the deterministic "
                         "pair), write bench_indexer_loss_variants.json, then exit")
    args = ap.parse_args()
    require_cuda("bench_indexer_loss.py")
    if args.quick:
        args.t, args.reps, args.warmup = [16384], 3, 1
    os.makedirs(args.out, exist_ok=True)
    if args.target_tilings:
        target_sweep(args.shapes, args.t, args.target_tilings, args.warmup, args.reps, args.out)
        return
    if args.variants:
        loss_variant_sweep(args.shapes, args.t, args.variants, args.deterministic, args.warmup,
                           args.reps, args.out)
        return
    json_path = os.path.join(args.out, "bench_indexer_loss.json")
    mm, bw = matmul_tflops(), copy_tbps()
    meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                command=" ".join(sys.argv), torch=torch.__version__, matmul_tflops=mm, copy_tbps=bw,
                results=[])
    log(f"{meta['device']}  bf16 matmul {mm:.0f} TFLOP/s  ({meta['date']})")
    header = (f"{'shape':6} {'T':>7} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'%mm':>5} "
              f"{'bwd TF/s':>9} {'%mm':>5} {'target':>7} {'w/ lse':>7} {'loss':>6} {'bwdk':>6} "
              f"{'GiB':>6} "
              f"{'det bwd':>8} {'ref ms':>9} {'x ref':>6}")
    log(header)
    tilelang_said = set()  # reasons TileLang did not run, each logged once
    for shape in args.shapes:
        for T in args.t:
            x, idx = make_inputs(shape, T)
            n_valid = int((idx >= 0).sum())
            f = flops(shape, n_valid)
            Hq, _, Dqk, H_I, _, _ = SHAPES[shape]
            row = dict(shape=shape, T=T, n_valid=n_valid, flops=f, Hq=Hq, Dqk=Dqk, H_I=H_I)
            row["triton"] = bench(x, idx, "triton", args.warmup, args.reps)
            row.update(bench_parts(x, idx, args.warmup, args.reps))
            if not args.no_from_dq:
                row.update(bench_target_from_dq(x, idx, args.warmup, args.reps))
                row["from_dq_loss_ms"] = (row["target_in_dq_ms"] + row["loss_ms"]
                                          + row["bwd_kernel_ms"])
                log(f"{shape:6} {T:>7} target from the dQ kernel: attention backward "
                    f"{row['attn_bwd_ms']:.2f} -> {row['attn_bwd_with_target_ms']:.2f} ms, so "
                    f"the loss on that path {row['from_dq_loss_ms']:.2f} ms (target pass w/ "
                    f"lse {row['target_with_lse_ms']:.2f} ms); largest difference from "
                    f"attention_target {row['target_from_dq_max_abs_diff']:.2e}")
            if not args.no_library:
                why_not = cudnn_unavailable()
                if why_not:
                    row["cudnn"] = f"not run: {why_not}"
                else:  # both given the attention's lse, as the DSA layer runs them
                    _, lse = sparse_attention(x["query"], x["key"], None, idx,
                                              x["query"].shape[-1] ** -0.5, dv=512,
                                              return_lse=True)
                    row["triton_lse"] = bench(x, idx, "triton", args.warmup, args.reps,
                                              attention_lse=lse)
                    row["cudnn"] = bench(x, idx, "cudnn", args.warmup, args.reps,
                                         attention_lse=lse)
                    del lse
                    c, t = row["cudnn"], row["triton_lse"]
                    log(f"{shape:6} {T:>7} with the attention's lse: triton {t['fwd_ms']:.2f} + "
                        f"{t['bwd_ms']:.2f} ms, cudnn {c['fwd_ms']:.2f} + {c['bwd_ms']:.2f} ms; "
                        f"loss {t['loss']:.6g} / {c['loss']:.6g}")
            if not args.no_tilelang:
                row["tilelang"] = tilelang_entry(x, idx, args.warmup, args.reps, tilelang_said)
                if isinstance(row["tilelang"], dict) and "triton_lse" not in row:
                    _, lse = sparse_attention(x["query"], x["key"], None, idx,
                                              x["query"].shape[-1] ** -0.5, dv=512,
                                              return_lse=True)
                    row["triton_lse"] = bench(x, idx, "triton", args.warmup, args.reps,
                                              attention_lse=lse)
                    del lse
                tl = row["tilelang"]
                if isinstance(tl, dict):
                    t = row["triton_lse"]
                    log(f"{shape:6} {T:>7} tilelang {tl['fwd_ms']:.2f} + {tl['bwd_ms']:.2f} ms "
                        f"(its score table pass {tl['scores_ms']:.2f} ms), triton with the "
                        f"attention's lse {t['fwd_ms']:.2f} + {t['bwd_ms']:.2f} ms; loss "
                        f"{row['triton']['loss']:.6g} / {tl['loss']:.6g}")
            if args.deterministic:
                row["triton_det"] = bench(x, idx, "triton", args.warmup, args.reps, True)
            if T <= args.ref_max_t:
                try:
                    row["reference"] = bench(x, idx, "reference", 1, 2)
                except torch.OutOfMemoryError:
                    row["reference"] = "OOM"
            tr = row["triton"]
            fwd_tf = f["fwd"] / tr["fwd_ms"] / 1e9
            bwd_tf = f["bwd"] / tr["bwd_ms"] / 1e9
            row.update(fwd_tflops=fwd_tf, bwd_tflops=bwd_tf, fwd_frac=fwd_tf / mm,
                       bwd_frac=bwd_tf / mm)
            ref = row.get("reference")
            ref_ms = ref["total_ms"] if isinstance(ref, dict) else None
            det = row.get("triton_det")
            log(f"{shape:6} {T:>7} {tr['fwd_ms']:>8.2f} {tr['bwd_ms']:>8.2f} {fwd_tf:>9.0f} "
                f"{100 * fwd_tf / mm:>5.1f} {bwd_tf:>9.0f} {100 * bwd_tf / mm:>5.1f} "
                f"{row['target_ms']:>7.2f} {row['target_with_lse_ms']:>7.2f} "
                f"{row['loss_ms']:>6.2f} {row['bwd_kernel_ms']:>6.2f} "
                f"{tr['extra_peak_gib']:>6.2f} {fmt(det and det['bwd_ms'], '.2f'):>8} "
                f"{'OOM' if ref == 'OOM' else fmt(ref_ms, '.1f'):>9} "
                f"{fmt(ref_ms and ref_ms / tr['total_ms'], '.1f'):>6}")
            meta["results"].append(row)
            with open(json_path, "w") as fh:
                json.dump(meta, fh, indent=1)
            save_record("bench_indexer_loss", shape,
                        [r for r in meta["results"] if r["shape"] == shape], matmul=mm, copy=bw)
            del x, idx
            torch.cuda.empty_cache()
    log(f"wrote {json_path}")


if __name__ == "__main__":
    main()

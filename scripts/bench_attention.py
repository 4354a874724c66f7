"""Benchmark HyScale's sparse attention kernels (forward, backward, deterministic backward).

On an H100 / H200 the forward and backward of absorbed MLA (GLM-5.1, V3.2) and of DeepSeek-V4's
K = V (CSA; HCA with its dense prefix) run the warp-specialized Gluon kernels by default
(`ops/kernels/sparse_mla_fwd_ws_sm90.py`, `sparse_mla_bwd_sm90.py`; the tables' "fwd
kernel" / "bwd kernel" columns), the other shapes (QSA) the Triton kernels; `--fwd-kernel
gluon` / `triton` and `--bwd-kernel triton` time the previous kernels instead, `--fwd-also` /
`--bwd-also` beside the main ones in the same process.

Shapes: GLM-5.1 / DeepSeek-V3.2 absorbed MLA (1 KV head, Dqk 576, V = first 512
channels of K, 64 / 128 heads, top-2048; glm51-tp2: GLM-5.1's 32 heads a rank at tensor
parallelism 2), DeepSeek-V4 CSA (K = V of 512, sink, 640 keys),
QSA (GQA 24 / 2 heads of 256, per-KV-head indices, 2052 keys), T queries over S = T keys, bf16,
and DeepSeek-V4 HCA (every visible entry of T / 128 as a generated prefix + a 128-token window;
FLOPs counted over each row's own keys).
Indices (`--indices`): "random" (default), distinct pseudo-random keys per row
((a + j * step) mod S, step odd), all valid: the worst case for the gather (no reuse between
neighbouring queries); "window", the K keys ending at the row ((t - j) mod S): neighbouring
rows share all but one key, the best case (the L2 cache serves the gathers), which bounds
what the kernels reach when the gathers cost nothing. The two bracket a trained selection.
"sorted": the random keys, each row in increasing key order (the same work; whether neighbouring
programs reading their rows in key order share the L2 cache).

Rates are ratios to the bf16 matmul rate measured in the same run (8192^3 torch.matmul on random
data). Memory floors: the bytes the kernels must move (gathered bf16 key / value rows; in the
backward, two gathers and the fp32 dK / dV atomics' read and write) over the copy bandwidth
measured in the same run; with random indices a pass cannot beat it by much (L2 reuse only).
FLOP counts: forward 2 * T * Hq * K * (Dqk + Dv); backward 2 * T * Hq * K * (3 Dqk + 2 Dv)
(QK^T recomputed once, dP, dQ, dK, dV; the kernels' extra recompute is not counted as work).
Library kernels (the stock cudnn backend's, in the same run, through HyScale's backend
`ops/backends/library_attention.py`): FlashMLA's SM90 sparse forward and cuDNN-frontend's SM90
backward, for the shapes they take (one KV head, 512 value channels: glm51, v32, csa); columns
"cudnn fwd / bwd". Baseline: megatron-core 0.19.2's stock unfused path
(`_unfused_absorbed_dsa_fn` for absorbed MLA, `unfused_dsa_fn` otherwise), run where it fits
(OOM printed) and T <= --stock-max-t.
Stock TileLang (columns "tilelang fwd / bwd", --no-tilelang skips): megatron-core's TileLang
sparse MLA as the stock tilelang backend runs it (`dsa_tilelang_kernels.
run_fused_absorbed_sparse_attention`: TileLang's forward; its backward recomputes the forward,
then runs TileLang's backward), for the shapes it takes (glm51, v32: 576 / 512 channels, one
KV head), on the same inputs, its forward checked against HyScale's like the library's; needs
TileLang (scripts/gpu_tilelang.sh): without it the run says why once and goes on.

  python scripts/bench_attention.py                 # T in 16K, 64K, 128K, all shapes
  python scripts/bench_attention.py --quick         # T = 16K, fewer repeats
  python scripts/bench_attention.py --shapes glm51 v32 --t 131072 --out /tmp/res
  python scripts/bench_attention.py --bwd-sweep --shapes glm51 --t 32768
  python scripts/bench_attention.py --bwd-sweep --shapes glm51 --t 32768 --tilings 64x1 \
      --bwd-variants no_carry main_first          # the previous defaults beside today's
  python scripts/bench_attention.py --bwd-sweep --shapes csa hca --t 65536 --tilings 32x2 \
      64x1 --bwd-variants no_carry --sweep-parts dq dkv   # fewer columns (no slow ones)
  python scripts/bench_attention.py --shapes v32 --t 131072 --head-blocks split
  python scripts/bench_attention.py --shapes glm51 --t 131072 --fwd-no-softmax  # forward split
  python scripts/bench_attention.py --shapes glm51 v32 --fwd-only --fwd-kernel triton
  python scripts/bench_attention.py --shapes glm51 v32 --fwd-only --fwd-kernel gluon_ws
  python scripts/bench_attention.py --shapes glm51 v32 csa --fwd-only --fwd-also gluon_ws
  python scripts/bench_attention.py --shapes glm51 v32 csa --no-deterministic --bwd-also sm90

--bwd-sweep times the two backward kernels apart, for each (keys per step, stages) tiling that
fits: dQ, dK/dV with its fp32 atomics, dK/dV in the measurement-only discard mode (the same
products, no accumulation; the difference is the cost of the atomics), dK/dV in its
previous orientation (keys on the MMA's M, AttentionKernelOptions.dkv_channels_on_m=False),
and the single fused backward pass (AttentionKernelOptions.bwd_fused=True); with
--bwd-variants, the kernel each named variant changes, with it on (BWD_VARIANTS; dK/dV ones
with and without atomics); --sweep-parts keeps some of the default's columns.
Table and JSON (bench_attention_bwd_sweep.json, and the record in benchmarks/results/).

Needs a CUDA GPU (every mode).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
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
from megatron_hyscale.ops.kernels import sparse_attention as kern  # noqa: E402
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions  # noqa: E402
from megatron_hyscale.ops.kernels.sparse_attention import sparse_attention_triton  # noqa: E402

# name: (Hq, Hkv, Dqk, separate v width or None, dv, sink, per-KV-head indices, K)
SHAPES = {
    "glm51": (64, 1, 576, None, 512, False, False, 2048),
    # GLM-5.1 under tensor parallelism 2: 32 query heads a rank (the Hopper kernels pad them)
    "glm51-tp2": (32, 1, 576, None, 512, False, False, 2048),
    "v32": (128, 1, 576, None, 512, False, False, 2048),
    "csa": (64, 1, 512, None, None, True, False, 640),
    "qsa": (24, 2, 256, 256, None, False, True, 2052),
    # DeepSeek-V4 HCA: every visible entry of T / 128 (a generated prefix) + a 128-token window
    "hca": (64, 1, 512, None, None, True, False, 128),
}
# Shapes whose rows attend to a dense prefix of compressed entries (the compress ratio).
PREFIX_RATIO = {"hca": 128}


def make_inputs(shape, T, seed=0, indices="random"):
    Hq, Hkv, D, vdim, dv, has_sink, per_head, K = SHAPES[shape]
    if shape in PREFIX_RATIO:
        return make_prefix_inputs(shape, T, seed)
    S = T
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = (torch.randn(1, S, Hkv, vdim, device="cuda", dtype=torch.bfloat16, generator=g)
         if vdim else None)
    sink = torch.randn(Hq, device="cuda", generator=g) if has_sink else None
    rows = T * (Hkv if per_head else 1)
    if indices == "window":  # row t: keys t, t - 1, ..., t - K + 1 (mod S), distinct
        t = torch.arange(rows, device="cuda")[:, None] // (Hkv if per_head else 1)
        idx = (t - torch.arange(K, device="cuda")) % S
    else:
        start = torch.randint(0, S, (rows, 1), device="cuda", generator=g)
        step = 2 * torch.randint(0, S // 2, (rows, 1), device="cuda", generator=g) + 1
        # S is a power of two and step odd, so the K entries of a row are distinct.
        idx = (start + torch.arange(K, device="cuda") * step) % S
        if indices == "sorted":
            idx = idx.sort(dim=-1).values
    idx = idx.to(torch.int32).view(1, T, Hkv, K) if per_head else idx.to(torch.int32).view(
        1, T, K)
    width = dv or (vdim if vdim else D)
    return dict(q=q, k=k, v=v, idx=idx, sink=sink, dv=dv, scale=D ** -0.5, width=width,
                prefix=None,
                flop_fwd=2 * T * Hq * K * (D + width),
                flop_bwd=2 * T * Hq * K * (3 * D + 2 * width),
                **gather_bytes(T * Hkv * K, D, vdim))


def gather_bytes(slots, D, vdim):
    """Bytes the kernels must move at least, for `slots` (query, KV head, key) triples: the
    forward reads each selected bf16 key row (and value row when V is separate); the backward
    reads them again in each of its two kernels and adds fp32 dK (dV) rows with atomics (a read
    and a write each). Over the copy bandwidth this is each pass's memory floor: random indices
    (this benchmark's) give the gathers no reuse beyond what the L2 cache happens to hold."""
    row = D + (vdim or 0)
    return dict(bytes_fwd=slots * row * 2, bytes_bwd=slots * row * (2 * 2 + 2 * 4))


def make_prefix_inputs(shape, T, seed=0):
    """HCA: keys [T / m compressed entries ; T raw tokens]; row t attends to its visible entries
    (floor((t + 1) / m), generated from prefix_lengths) and its window of raw tokens."""
    Hq, _, D, _, _, _, _, W = SHAPES[shape]
    m = PREFIX_RATIO[shape]
    N = T // m
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, N + T, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = torch.randn(Hq, device="cuda", generator=g)
    pos = torch.arange(T, device="cuda")
    prefix = ((pos + 1) // m).clamp(max=N).to(torch.int32)[None]
    win = pos[:, None] - torch.arange(W - 1, -1, -1, device="cuda")[None]
    idx = torch.where(win >= 0, N + win, -1).to(torch.int32)[None]
    keys_per_row = prefix.sum().item() + (idx >= 0).sum().item()
    return dict(q=q, k=k, v=None, idx=idx, sink=sink, dv=None, scale=D ** -0.5, width=D,
                prefix=prefix, flop_fwd=2 * Hq * keys_per_row * 2 * D,
                flop_bwd=2 * Hq * keys_per_row * 5 * D, **gather_bytes(keys_per_row, D, None))


def explicit_indices(inp):
    """The same keys listed: [B, T, max prefix + K] (stock path; a prefix shape only)."""
    n = inp["prefix"].long()
    slots = torch.arange(int(n.max()), device=n.device)
    pre = torch.where(slots < n[..., None], slots, -1)
    return torch.cat([pre, inp["idx"].long()], dim=-1)


def forward_kernel(inp, options):
    """Which forward `sparse_attention` ran on these inputs with these options: "flashmla"
    (FlashMLA's, `fwd_flashmla`), "gluon-sm90" (the Hopper absorbed-MLA kernel),
    "gluon-ws-sm90" (its warp-specialized form; "-lockstep" in lockstep) or "triton" (asked
    after the run: a variant that failed is disabled)."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    dv = kern._Geometry(q, k, v, inp["dv"]).dv
    if options.fwd_flashmla:
        from megatron_hyscale.ops.backends.library_attention import flashmla_forward_unsupported

        if flashmla_forward_unsupported(q, k, v, inp["idx"], dv,
                                        prefix_lengths=inp["prefix"]) is None:
            return "flashmla"
        options = replace(options, fwd_flashmla=False)
    hopper = kern.hopper_forward(q, k, v, dv, inp["sink"], inp["prefix"], options=options,
                                 warn=False)
    if hopper is None:
        paced = options.fwd_lockstep and options.fwd_softmax
        return f"triton-lockstep{options.triton_lockstep_slack}" if paced else "triton"
    if inp["prefix"] is not None:  # the Gluon kernels run a dense prefix unpaced
        options = replace(options, fwd_lockstep=False)
    return options.forward_kernel_name()


def bench_ours(inp, warmup, reps, deterministic_too, fwd_only=False,
               options=AttentionKernelOptions.DEFAULT):
    q, k, v, sink = inp["q"], inp["k"], inp["v"], inp["sink"]
    leaves = [x.requires_grad_() for x in (q, k, v, sink) if x is not None]

    def fwd():
        with torch.no_grad():
            return sparse_attention_triton(q, k, v, inp["idx"], inp["scale"], dv=inp["dv"],
                                           sink=sink, prefix_lengths=inp["prefix"],
                                           options=options)

    res = {"fwd_ms": time_ms(fwd, reps=reps, warmup=warmup)}
    # Forward only: when asked, and for the measurement-only forward (no meaningful backward).
    if fwd_only or not options.fwd_softmax:
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        return res
    out = sparse_attention_triton(q, k, v, inp["idx"], inp["scale"], dv=inp["dv"], sink=sink,
                                  prefix_lengths=inp["prefix"], options=options)
    grad = torch.randn_like(out)
    res["peak_fwd_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30

    def bwd():
        torch.autograd.grad(out, leaves, grad, retain_graph=True)

    res["bwd_ms"] = time_ms(bwd, reps=reps, warmup=warmup)
    if deterministic_too:
        out_d = sparse_attention_triton(q, k, v, inp["idx"], inp["scale"], dv=inp["dv"],
                                        sink=sink, deterministic=True,
                                        prefix_lengths=inp["prefix"], options=options)
        res["bwd_det_ms"] = time_ms(
            lambda: torch.autograd.grad(out_d, leaves, grad, retain_graph=True),
            reps=reps, warmup=warmup)
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return res


# --fwd-kernel / --fwd-also names -> the AttentionKernelOptions fields that select the forward.
# Every own kernel's entry clears fwd_flashmla, so that a --fwd-also column beside
# --fwd-kernel flashmla times the own kernel, not FlashMLA's again.
_OWN = dict(fwd_flashmla=False)
FWD_KERNELS = {"auto": {},  # the defaults (AttentionKernelOptions.DEFAULT)
               "gluon": dict(_OWN, fwd_sm90=True, fwd_sm90_ws=False),
               "gluon_ws": dict(_OWN, fwd_sm90=True, fwd_sm90_ws=True, fwd_lockstep=False),
               "gluon_ws_lockstep": dict(_OWN, fwd_sm90=True, fwd_sm90_ws=True,
                                         fwd_lockstep=True),
               # the Triton forward in lockstep (QSA, HCA's prefix on the Triton kernels; with
               # --indices sorted)
               "triton_lockstep": dict(_OWN, fwd_lockstep=True, prefix_sm90=False),
               # FlashMLA's forward inside HyScale's autograd function (`fwd_flashmla`)
               "flashmla": dict(fwd_flashmla=True),
               "triton": dict(_OWN, fwd_sm90=False, fwd_sm90_ws=False)}


def rel_diff(got: torch.Tensor, want: torch.Tensor, rows: int = 4096) -> float:
    """||got - want|| / ||want|| in fp64 sums over chunks of `rows` along dim 1 (T): no fp32
    copy of a whole [B, T, H, D] tensor (V3.2's dq at 128K is 19 GB in bf16)."""
    if want.dim() < 2:  # the sink's gradient [Hq]
        got, want = got[None, :, None], want[None, :, None]
    num = den = 0.0
    for t0 in range(0, want.shape[1], rows):
        a, b = got[:, t0:t0 + rows].float(), want[:, t0:t0 + rows].float()
        num += float((a - b).square().sum(dtype=torch.float64))
        den += float(b.square().sum(dtype=torch.float64))
    return (num / max(den, 1e-60)) ** 0.5


def bench_fwd_also(inp, warmup, reps, options, names):
    """The forward with each kernel in `names` (FWD_KERNELS) on the same inputs, in the same
    process as the main one: fwd_<name>_ms, which kernel ran (fwd_<name>_kernel), and its
    output's relative difference from the main options' output (fwd_<name>_rel_diff)."""
    q, k, v, sink = (x.detach() if x is not None else None
                     for x in (inp["q"], inp["k"], inp["v"], inp["sink"]))

    def forward(opts):
        with torch.no_grad():
            return sparse_attention_triton(q, k, v, inp["idx"], inp["scale"], dv=inp["dv"],
                                           sink=sink, prefix_lengths=inp["prefix"],
                                           options=opts)

    ref = forward(options)
    res = {}
    for name in names:
        opts = replace(options, **FWD_KERNELS[name])
        out = forward(opts)
        res[f"fwd_{name}_rel_diff"] = rel_diff(out, ref)
        del out
        res[f"fwd_{name}_ms"] = time_ms(lambda opts=opts: forward(opts), reps=reps,
                                        warmup=warmup)
        res[f"fwd_{name}_kernel"] = forward_kernel(inp, opts)
    return res


# --bwd-kernel / --bwd-also names -> the AttentionKernelOptions fields that select the backward.
BWD_KERNELS = {"auto": {}, "triton": dict(bwd_sm90=False),
               "sm90": dict(bwd_sm90=True, bwd_dk_vec4=False, bwd_lockstep=False),
               "sm90_red16": dict(bwd_sm90=True, bwd_dk_vec4=True, bwd_lockstep=False),
               "sm90_lockstep": dict(bwd_sm90=True, bwd_dk_vec4=True, bwd_lockstep=True),
               "sm90_lockstep2": dict(bwd_sm90=True, bwd_dk_vec4=True, bwd_lockstep=True,
                                      bwd_lockstep_slack=2),
               # the Triton backward kernels in lockstep (QSA, HCA's prefix on the Triton
               # kernels; with --indices sorted)
               "triton_lockstep": dict(dkv_lockstep=True, dq_lockstep=True, prefix_sm90=False),
               "triton_lockstep_dkv": dict(dkv_lockstep=True, prefix_sm90=False),
               "triton_lockstep2": dict(dkv_lockstep=True, dq_lockstep=True,
                                        triton_lockstep_slack=2, prefix_sm90=False),
               "triton_lockstep_1sm": dict(dkv_lockstep=True, dq_lockstep=True,
                                           triton_lockstep_programs_per_sm=1,
                                           prefix_sm90=False)}


def backward_kernel(inp, options):
    """Which backward ran on these inputs with these options: "gluon-ws-sm90" (the Hopper
    warp-specialized backward, `sparse_mla_bwd_sm90`; "-red16" with 16-byte dK atomics,
    "-lockstepN" in lockstep with a slack of N) or "triton" ("-dq-dkv-lockstepN": its dQ and
    dK/dV kernels in lockstep; asked after the run: a variant that failed is disabled)."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    paced = "-".join(n for n, on in (("dq", options.dq_lockstep), ("dkv", options.dkv_lockstep))
                     if on)
    triton_name = "triton" + (f"-{paced}-lockstep{options.triton_lockstep_slack}"
                              if paced else "")
    if not options.bwd_sm90:
        return triton_name
    bwd, _ = kern.hopper_backward_module()
    dv = kern._Geometry(q, k, v, inp["dv"]).dv
    if inp["prefix"] is not None:
        if not options.prefix_sm90:
            return triton_name
        options = replace(options, bwd_lockstep=False)  # a dense prefix runs unpaced
    if bwd is None or not bwd.applies(q, k, v, dv, inp["prefix"]):
        return triton_name
    return options.backward_kernel_name()


def bench_bwd_also(inp, warmup, reps, options, names):
    """The backward with each kernel in `names` (BWD_KERNELS) on the same inputs and output
    gradient, in the same process as the main one: bwd_<name>_ms, which kernel ran
    (bwd_<name>_kernel), and the largest relative difference of its gradients from the main
    options' (bwd_<name>_rel_diff, over q, k, v and the sink)."""
    def run(opts):
        leaves = [x.detach().clone().requires_grad_() if x is not None else None
                  for x in (inp["q"], inp["k"], inp["v"], inp["sink"])]
        out = sparse_attention_triton(leaves[0], leaves[1], leaves[2], inp["idx"], inp["scale"],
                                      dv=inp["dv"], sink=leaves[3], prefix_lengths=inp["prefix"],
                                      options=opts)
        return out, [x for x in leaves if x is not None]

    out, leaves = run(options)
    grad = torch.randn(out.shape, device=out.device, generator=torch.Generator(
        device=out.device).manual_seed(1)).to(out.dtype)
    ref = list(torch.autograd.grad(out, leaves, grad))  # in their dtypes: see rel_diff
    del out, leaves
    res = {}
    for name in names:
        opts = replace(options, **BWD_KERNELS[name])
        try:
            out, leaves = run(opts)
            got = torch.autograd.grad(out, leaves, grad, retain_graph=True)
        except torch.OutOfMemoryError:  # the comparison holds a second set of gradients
            res[f"bwd_{name}_ms"] = "OOM"
            torch.cuda.empty_cache()
            continue
        res[f"bwd_{name}_rel_diff"] = max(rel_diff(a, b) for a, b in zip(got, ref, strict=True))
        del got
        res[f"bwd_{name}_ms"] = time_ms(
            lambda out=out, leaves=leaves: torch.autograd.grad(out, leaves, grad,
                                                               retain_graph=True),
            reps=reps, warmup=warmup)
        res[f"bwd_{name}_kernel"] = backward_kernel(inp, opts)
        del out, leaves
    return res


def bench_library(inp, warmup, reps):
    """FlashMLA's SM90 forward and cuDNN's SM90 backward (stock cudnn backend's kernels) through
    HyScale's library backend, on the same inputs; None where they cannot run this shape."""
    from megatron_hyscale.ops.backends.library_attention import (
        library_attention,
        library_attention_unsupported,
    )

    q, k, sink = inp["q"].detach(), inp["k"].detach(), inp["sink"]
    reason = library_attention_unsupported(q, k, inp["v"], inp["idx"], inp["dv"],
                                           prefix_lengths=inp["prefix"], deterministic=False)
    if reason:
        return {"lib_status": reason}
    sink = None if sink is None else sink.detach()
    res = {}
    with torch.no_grad():
        res["lib_fwd_ms"] = time_ms(lambda: library_attention(q, k, inp["idx"], inp["scale"],
                                                              sink=sink),
                                    reps=reps, warmup=warmup)
    leaves = [x.clone().requires_grad_() for x in (q, k)]
    out, _ = library_attention(*leaves, inp["idx"], inp["scale"], sink=sink)
    grad = torch.randn_like(out)
    res["lib_bwd_ms"] = time_ms(lambda: torch.autograd.grad(out, leaves, grad,
                                                            retain_graph=True),
                                reps=reps, warmup=warmup)
    # the same result as HyScale's kernels (bf16 rounding apart)
    with torch.no_grad():
        ours = sparse_attention_triton(q, k, inp["v"], inp["idx"], inp["scale"], dv=inp["dv"],
                                       sink=sink, prefix_lengths=inp["prefix"])
    res["lib_out_rel_err"] = rel_err(out, ours)
    return res


def rel_err(out, ref, rows=4096):
    """||out - ref|| / ||ref|| over [B, T, ...] tensors, in fp32 blocks of `rows` queries (the
    whole-tensor fp32 copies would take 3 x 32 GiB for V3.2's output at 128K)."""
    num = den = 0.0
    for t0 in range(0, ref.shape[1], rows):
        a, b = out[:, t0:t0 + rows].float(), ref[:, t0:t0 + rows].float()
        num += (a - b).square().sum().item()
        den += b.square().sum().item()
    return (num / den) ** 0.5 if den else float("nan")


def tilelang_unsupported(shape):
    """Why megatron's TileLang SparseMLA cannot run this shape (None when it can): its
    absorbed path takes 576 key / 512 value channels, one KV head shared by a power of two
    >= 16 query heads, no sink, a top-k multiple of 64 (dsa_tilelang_kernels)."""
    Hq, Hkv, D, vdim, dv, has_sink, per_head, K = SHAPES[shape]
    if (D, dv, Hkv, vdim, has_sink, per_head) != (576, 512, 1, None, False, False) or (
            shape in PREFIX_RATIO):
        return "TileLang's SparseMLA takes absorbed MLA only (576 / 512 channels, 1 KV head)"
    if Hq < 16 or Hq & (Hq - 1) or K % 64:
        return f"TileLang's SparseMLA takes 2^n >= 16 heads and top-k % 64 == 0 ({Hq}, {K})"
    return None


def tilelang_attention(q, k, indices, scale, dv):
    """megatron-core's TileLang sparse MLA as the stock tilelang backend calls it
    (dsa_tilelang_kernels.run_fused_absorbed_sparse_attention on [S, B, H, D] tensors; with
    B = 1 the layout changes are views) on q [1, T, H, 576], k [1, S, 1, 576], indices
    [1, T, K]: out [1, T, H, dv], differentiable in q and k."""
    from megatron.core.transformer.experimental_attention_variant import dsa_tilelang_kernels

    out = dsa_tilelang_kernels.run_fused_absorbed_sparse_attention(
        q.transpose(0, 1), k.transpose(0, 1), indices, scale, dv)
    if out is None:  # the stock layer would fall back to its unfused path: not timed here
        raise RuntimeError("megatron-core's TileLang SparseMLA declined these inputs")
    return out.transpose(0, 1)


def bench_tilelang(inp, warmup, reps, res, fwd_only=False):
    """tilelang_attention on the same inputs: forward and (unless fwd_only) backward ms, its
    forward's error against HyScale's kernel (the library columns' check) and its peak memory
    over the inputs, written into `res` as they come (an OOM in the backward keeps the
    forward's)."""
    idx, scale = inp["idx"], inp["scale"]
    run = partial(tilelang_attention, indices=idx, scale=scale, dv=inp["width"])
    q, k = inp["q"].detach(), inp["k"].detach()  # no copies: the tensors HyScale's run had
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        ours = sparse_attention_triton(q, k, None, idx, scale, dv=inp["dv"])
        out = run(q, k)
        res["tl_out_rel_err"] = rel_err(out, ours)
        del out, ours
        res["tl_fwd_ms"] = time_ms(lambda: run(q, k), reps=reps, warmup=warmup)
    if fwd_only:
        res["tl_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        return res
    leaves = [q.requires_grad_(), k.requires_grad_()]
    out = run(*leaves)
    grad = torch.randn_like(out)
    res["tl_bwd_ms"] = time_ms(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True),
                               reps=reps, warmup=warmup)
    res["tl_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return res


def tilelang_columns(shape, inp, warmup, reps, said, fwd_only=False):
    """The row's TileLang entries: timings (the forward's only with fwd_only), or "tl_status"
    saying why there are none; each reason is logged once a run (`said` holds those
    logged)."""
    unsupported = tilelang_unsupported(shape)
    why_not = unsupported or tilelang_unavailable()
    if why_not:
        said_key = (shape if unsupported else None, why_not)
        if said_key not in said:
            log(f"tilelang: not run{f' for {shape}' if unsupported else ''} ({why_not})")
            said.add(said_key)
        return {"tl_status": f"not run: {why_not}"}
    res = {}
    torch.cuda.empty_cache()
    try:
        bench_tilelang(inp, warmup, reps, res, fwd_only)
    except torch.OutOfMemoryError:
        res["tl_status"] = "OOM"
    torch.cuda.empty_cache()
    return res


def bench_stock(shape, inp, warmup, reps):
    """megatron-core 0.19.2's unfused sparse path, [S, B, H, D] layout; fwd and fwd+bwd times."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    Hq, Hkv, D, vdim, dv, has_sink, per_head, K = SHAPES[shape]
    q = inp["q"].detach().transpose(0, 1).contiguous()
    k = inp["k"].detach().transpose(0, 1).contiguous()
    idx = inp["idx"].long() if inp["prefix"] is None else explicit_indices(inp)
    if per_head:  # the stock path shares one index list across heads: use KV head 0's
        idx = idx[:, :, 0]
    if inp["v"] is None and dv is not None:  # absorbed MLA
        fn = lambda q, k, v: dsa._unfused_absorbed_dsa_fn(q, k, idx, inp["scale"], dv)
        v = None
    else:
        v = (k if inp["v"] is None else inp["v"].detach().transpose(0, 1).contiguous())
        if Hkv > 1:  # stock accepts 1 or Hq KV heads: expand GQA
            k = k.repeat_interleave(Hq // Hkv, dim=2)
            v = v.repeat_interleave(Hq // Hkv, dim=2)
        fn = lambda q, k, v: dsa.unfused_dsa_fn(q, k, v, idx, inp["scale"])
    res = {}
    try:
        with torch.no_grad():
            res["fwd_ms"] = time_ms(lambda: fn(q, k, v), reps=reps, warmup=warmup)
    except torch.OutOfMemoryError:
        res["fwd_ms"] = "OOM"
    torch.cuda.empty_cache()
    try:
        qq, kk = q.requires_grad_(), k.requires_grad_()
        vv = v.requires_grad_() if v is not None and v is not k else v

        def fwd_bwd():
            out = fn(qq, kk, vv)
            out.backward(torch.ones_like(out))

        res["fwd_bwd_ms"] = time_ms(fwd_bwd, reps=reps, warmup=warmup)
    except torch.OutOfMemoryError:
        res["fwd_bwd_ms"] = "OOM"
    except Exception as exc:  # noqa: BLE001 - report what the stock path refuses
        res["fwd_bwd_ms"] = f"error: {type(exc).__name__}"
    torch.cuda.empty_cache()
    return res


SWEEP_TILINGS = ((16, 1), (16, 2), (32, 1), (32, 2), (64, 1), (64, 2))
# Backward variants --bwd-sweep can time beside the default (--bwd-variants): name -> (the
# kernel it changes, AttentionKernelOptions fields). A dK/dV variant adds the columns
# dkv_<name>_ms and dkv_<name>_no_atomics_ms, a dQ variant dq_<name>_ms, timed in the same
# process and tiling as the default's dkv_ms / dq_ms. no_carry and main_first are the
# previous defaults (dkv_carry and dq_tail_first off).
BWD_VARIANTS = {
    "no_carry": ("dkv", dict(dkv_carry=False)),
    "main_first": ("dq", dict(dq_tail_first=False)),
}
# --bwd-sweep's columns for the default options (--sweep-parts picks some).
SWEEP_PARTS = ("dq", "dkv", "dkv_no_atomics", "dkv_keys_on_m", "fused")


def bwd_sweep(shapes, Ts, reps, out_dir, mm, tilings=SWEEP_TILINGS,
              options=AttentionKernelOptions.DEFAULT, variants=(), sweep_parts=SWEEP_PARTS):
    """Time `sweep_parts` (SWEEP_PARTS' names: dQ, dK/dV, dK/dV without atomics, keys on M, the
    fused pass) per tiling (the other variants as `options`), and the kernel each of
    `variants` (BWD_VARIANTS' names) changes with it on; returns the rows."""
    rows = []
    names = ("dq_tilings", "dkv_tilings", "narrow_dq_tilings", "narrow_dkv_tilings")
    for T in Ts:
        for shape in shapes:
            inp = make_inputs(shape, T)
            q, k, v, idx, sink, dv, scale = (inp[n] for n in ("q", "k", "v", "idx", "sink",
                                                               "dv", "scale"))
            pre = inp["prefix"]
            out, lse = kern.sparse_attention_fwd(q, k, v, idx, scale, dv=dv, sink=sink,
                                                 prefix_lengths=pre, options=options)
            dout = torch.randn_like(out)
            _, delta, _ = kern.sparse_attention_bwd_dq(q, k, v, idx, scale, out, lse, dout,
                                                       dv=dv, sink=sink, prefix_lengths=pre,
                                                       options=options)
            for tiling in tilings:
                row = dict(shape=shape, T=T, block_n=tiling[0], stages=tiling[1])
                at_tiling = replace(options, **{n: (tiling,) for n in names})
                # the single-pass backward at the sweep's tiling; the dK/dV kernel's previous
                # orientation (keys on the MMA's M)
                fused = replace(at_tiling, bwd_fused=True, bwd_fused_tilings=(tiling,))
                keys_on_m = replace(at_tiling, dkv_channels_on_m=False)
                kern._tiling_cache.clear()
                dq_args = (q, k, v, idx, scale, out, lse, dout)
                dkv_args = (q, k, v, idx, scale, lse, dout, delta)
                parts = {
                    "dq_ms": partial(kern.sparse_attention_bwd_dq, *dq_args, dv=dv, sink=sink,
                                     prefix_lengths=pre, options=at_tiling),
                    "dkv_ms": partial(kern.sparse_attention_bwd_dkv, *dkv_args, dv=dv,
                                      prefix_lengths=pre, options=at_tiling),
                    "dkv_no_atomics_ms": partial(kern.sparse_attention_bwd_dkv, *dkv_args, dv=dv,
                                                 mode=kern.MODE_DISCARD, prefix_lengths=pre,
                                                 options=at_tiling),
                    "dkv_keys_on_m_ms": partial(kern.sparse_attention_bwd_dkv, *dkv_args, dv=dv,
                                                prefix_lengths=pre, options=keys_on_m),
                    "fused_ms": partial(kern.sparse_attention_bwd, *dq_args, dv=dv, sink=sink,
                                        prefix_lengths=pre, options=fused),
                }
                parts = {n: fn for n, fn in parts.items() if n.removesuffix("_ms") in sweep_parts}
                for variant in variants:
                    kernel, fields = BWD_VARIANTS[variant]
                    with_variant = replace(at_tiling, **fields)
                    if kernel == "dq":
                        parts[f"dq_{variant}_ms"] = partial(
                            kern.sparse_attention_bwd_dq, *dq_args, dv=dv, sink=sink,
                            prefix_lengths=pre, options=with_variant)
                        continue
                    parts[f"dkv_{variant}_ms"] = partial(
                        kern.sparse_attention_bwd_dkv, *dkv_args, dv=dv, prefix_lengths=pre,
                        options=with_variant)
                    parts[f"dkv_{variant}_no_atomics_ms"] = partial(
                        kern.sparse_attention_bwd_dkv, *dkv_args, dv=dv, mode=kern.MODE_DISCARD,
                        prefix_lengths=pre, options=with_variant)
                for name, fn in parts.items():
                    try:
                        row[name] = time_ms(fn, reps=reps, warmup=1)
                    except Exception as err:  # a tiling that does not fit is reported, not fatal
                        row[name] = f"failed: {type(err).__name__}"
                if all(isinstance(row.get(n), float) for n in ("dq_ms", "dkv_ms")):
                    row["bwd_frac"] = inp["flop_bwd"] / (row["dq_ms"] + row["dkv_ms"]) / 1e9 / mm
                rows.append(row)
                log(f"sweep {shape} T={T} tiling {tiling}: " + ", ".join(
                    f"{n} {fmt(row[n], '.2f')}" for n in parts) + f", bwd/matmul "
                    f"{fmt(row.get('bwd_frac', '-'), '.1%')}")
                with open(os.path.join(out_dir, "bench_attention_bwd_sweep.json"), "w") as f:
                    json.dump(dict(matmul_tflops=mm, command=" ".join(sys.argv), rows=rows), f,
                              indent=1)
            del inp, out, lse, dout, delta
            torch.cuda.empty_cache()
    kern._tiling_cache.clear()
    log("\n| shape | T | keys x stages | dQ ms | dK/dV ms | dK/dV without atomics ms |"
        " dK/dV keys on M ms | fused bwd ms | bwd / matmul (dQ + dK/dV) |"
        "\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['shape']} | {r['T']} | {r['block_n']} x {r['stages']} | "
            f"{fmt(r.get('dq_ms', '-'), '.1f')} | {fmt(r.get('dkv_ms', '-'), '.1f')} | "
            f"{fmt(r.get('dkv_no_atomics_ms', '-'), '.1f')} | "
            f"{fmt(r.get('dkv_keys_on_m_ms', '-'), '.1f')} | "
            f"{fmt(r.get('fused_ms', '-'), '.1f')} | {fmt(r.get('bwd_frac', '-'), '.1%')} |")
    for variant in variants:
        if BWD_VARIANTS[variant][0] == "dq":
            log(f"\n| shape | T | keys x stages | dQ ms | dQ {variant} ms |\n|---|---|---|---|---|")
            for r in rows:
                log(f"| {r['shape']} | {r['T']} | {r['block_n']} x {r['stages']} | "
                    f"{fmt(r.get('dq_ms', '-'), '.1f')} | {fmt(r[f'dq_{variant}_ms'], '.1f')} |")
            continue
        log(f"\n| shape | T | keys x stages | dK/dV ms | dK/dV {variant} ms | dK/dV without "
            f"atomics ms | dK/dV {variant} without atomics ms |\n|---|---|---|---|---|---|---|")
        for r in rows:
            log(f"| {r['shape']} | {r['T']} | {r['block_n']} x {r['stages']} | "
                f"{fmt(r.get('dkv_ms', '-'), '.1f')} | {fmt(r[f'dkv_{variant}_ms'], '.1f')} | "
                f"{fmt(r.get('dkv_no_atomics_ms', '-'), '.1f')} | "
                f"{fmt(r[f'dkv_{variant}_no_atomics_ms'], '.1f')} |")
    return rows


def fmt(x, spec=".1f"):
    return format(x, spec) if isinstance(x, float) else str(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Needs a CUDA GPU (every mode): without one it exits "
                                        "with status 2 before writing anything.")
    ap.add_argument("--t", type=int, nargs="+", default=[16384, 65536, 131072],
                    help="sequence lengths T (queries = keys; default 16K, 64K, 128K)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                    help="glm51 / v32: GLM-5.1 / DeepSeek-V3.2 absorbed MLA (64 / 128 heads); "
                         "csa / hca: DeepSeek-V4's CSA / HCA; qsa: Qwen3.8's QSA (GQA "
                         "24 / 2); default all")
    ap.add_argument("--quick", action="store_true", help="T = 16K only, fewer repeats")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed calls per measurement (the median is kept)")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="skip the deterministic backward's timing")
    ap.add_argument("--no-stock", action="store_true",
                    help="skip megatron-core's unfused stock path (out of memory past 16K)")
    ap.add_argument("--no-library", action="store_true",
                    help="skip FlashMLA's forward + cuDNN's backward (the stock cudnn "
                         "backend's kernels; run where scripts/gpu_cudnn.sh installed them)")
    ap.add_argument("--no-tilelang", action="store_true",
                    help="skip megatron-core's TileLang sparse MLA forward + backward (the "
                         "stock tilelang backend's kernels; run where scripts/gpu_tilelang.sh "
                         "installed TileLang)")
    ap.add_argument("--indices", choices=("random", "window", "sorted"), default="random",
                    help="random keys per row (worst case for the gathers), each row's last "
                         "K keys (best case: neighbouring rows share them), or the random keys "
                         "in increasing order in each row")
    ap.add_argument("--stock-max-t", type=int, default=16384,
                    help="run the stock path only up to this T (its time grows fast)")
    ap.add_argument("--out", default="bench_attention_out",
                    help="folder for bench_attention.json / .md / .png (default "
                         "bench_attention_out); records also go to $HYSCALE_RESULTS (default "
                         "benchmarks/results/)")
    ap.add_argument("--bwd-sweep", action="store_true",
                    help="time dQ, dK/dV and dK/dV without atomics per tiling, then exit")
    ap.add_argument("--tilings", nargs="+", type=parse_tiling, default=list(SWEEP_TILINGS),
                    metavar="NxS", help="--bwd-sweep's tilings, keys per step x stages (a "
                    "tiling that faults ends the process: give one a run to isolate it)")
    ap.add_argument("--bwd-variants", nargs="+", default=[], choices=list(BWD_VARIANTS),
                    help="--bwd-sweep: also time the backward kernels with these variants "
                         "beside the default, in the same process (no_carry: the dK/dV kernel "
                         "with AttentionKernelOptions.dkv_carry off, with and without atomics; "
                         "main_first: the dQ kernel with dq_tail_first off)")
    ap.add_argument("--sweep-parts", nargs="+", default=list(SWEEP_PARTS), choices=SWEEP_PARTS,
                    help="--bwd-sweep: the default options' columns to time (all by default; "
                         "dkv_keys_on_m is about 8x the others' time)")
    ap.add_argument("--head-blocks", choices=("adjacent", "split"), default="adjacent",
                    help="launch order of a query's head-block programs: next to each other "
                         "(the default, AttentionKernelOptions.head_blocks_adjacent) or a "
                         "(queries, blocks) grid; matters with 128 heads (V3.2); several KV "
                         "heads (QSA) always run split")
    ap.add_argument("--fwd-no-softmax", action="store_true",
                    help="measurement only: the forward without its online softmax (raw scores "
                         "as P; AttentionKernelOptions.fwd_softmax=False), to split the "
                         "softmax's time from the gathers and MMAs; only the forward is timed")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only")
    ap.add_argument("--fwd-also", nargs="+", default=[], choices=tuple(FWD_KERNELS),
                    help="also time the forward with these kernels, in the same process on the "
                         "same inputs (columns fwd_<name>_ms, the kernel that ran, and the "
                         "output's relative difference from the main forward's)")
    ap.add_argument("--bwd-also", nargs="+", default=[], choices=tuple(BWD_KERNELS),
                    help="also time the backward with these kernels on the same inputs, in "
                         "the same process (columns bwd_<name>_ms, and the gradients' relative "
                         "difference from the main backward's)")
    ap.add_argument("--bwd-kernel", choices=tuple(BWD_KERNELS), default="auto",
                    help="auto: the defaults (the Hopper warp-specialized Gluon backward where "
                         "it applies, AttentionKernelOptions.bwd_sm90, 16-byte atomics and in "
                         "lockstep; Triton elsewhere); "
                         "triton: always the Triton backward (dQ, then dK / dV); sm90: the "
                         "Gluon one where it applies, 8-byte dK atomics, not in lockstep; "
                         "sm90_red16: the same with 16-byte ones "
                         "(AttentionKernelOptions.bwd_dk_vec4); "
                         "sm90_lockstep(2): 16-byte, one program an SM paced together with a "
                         "slack of 1 (2) key tiles, rows sorted (bwd_lockstep)")
    ap.add_argument("--fwd-kernel", choices=tuple(FWD_KERNELS), default="auto",
                    help="auto: the defaults (the warp-specialized Gluon forward where it "
                         "applies, AttentionKernelOptions.fwd_sm90_ws; Triton elsewhere); "
                         "gluon: the plain Gluon forward (fwd_sm90_ws=False); gluon_ws: the "
                         "warp-specialized one; gluon_ws_lockstep: that one in lockstep "
                         "(fwd_lockstep); triton: always the Triton forward")
    args = ap.parse_args()
    require_cuda("bench_attention.py")
    options = replace(AttentionKernelOptions.DEFAULT,
                      head_blocks_adjacent=args.head_blocks == "adjacent",
                      fwd_softmax=not args.fwd_no_softmax,
                      **FWD_KERNELS[args.fwd_kernel],  # (no-softmax: Triton's only)
                      **BWD_KERNELS[args.bwd_kernel])
    if args.quick:
        args.t, args.reps = [16384], 3
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name()
    log(f"# {dev}, torch {torch.__version__}, {datetime.datetime.now().isoformat()}")
    mm, bw = matmul_tflops(), copy_tbps()
    log(f"# bf16 matmul {mm:.0f} TFLOP/s, copy {bw:.2f} TB/s (measured now)")
    if args.bwd_sweep:
        rows = bwd_sweep(args.shapes, args.t, args.reps, args.out, mm, args.tilings, options,
                         args.bwd_variants, args.sweep_parts)
        log("record: " + save_record("bench_attention_bwd_sweep", "-".join(args.shapes), rows,
                                     matmul=mm, copy=bw))
        return
    meta = dict(device=dev, date=datetime.date.today().isoformat(), command=" ".join(sys.argv),
                matmul_tflops=mm, copy_tbps=bw, head_blocks=args.head_blocks,
                fwd_softmax=not args.fwd_no_softmax, fwd_kernel=args.fwd_kernel,
                bwd_kernel=args.bwd_kernel, rows=[])
    json_path = os.path.join(args.out, "bench_attention.json")
    tilelang_said = set()  # reasons TileLang did not run, each logged once
    for T in args.t:
        for shape in args.shapes:
            t0 = time.time()
            torch.cuda.reset_peak_memory_stats()
            inp = make_inputs(shape, T, indices=args.indices)
            Hq, _, Dqk, _, _, has_sink, _, K = SHAPES[shape]
            row = dict(shape=shape, T=T, K=K, Hq=Hq, Dqk=Dqk, Dv=inp["width"], sink=has_sink,
                       indices=args.indices,
                       fwd_floor_ms=max(inp["flop_fwd"] / mm / 1e9,
                                        inp["bytes_fwd"] / bw / 1e9),
                       fwd_mem_floor_ms=inp["bytes_fwd"] / bw / 1e9,
                       bwd_mem_floor_ms=inp["bytes_bwd"] / bw / 1e9)
            try:
                row.update(bench_ours(inp, 1, args.reps, not args.no_deterministic,
                                      args.fwd_only, options))
                row["fwd_kernel"] = forward_kernel(inp, options)
            except torch.OutOfMemoryError:
                row["fwd_ms"] = "OOM"
            if isinstance(row.get("fwd_ms"), float):
                row["fwd_tflops"] = inp["flop_fwd"] / row["fwd_ms"] / 1e9
                row["fwd_frac"] = row["fwd_tflops"] / mm
            if args.fwd_also and isinstance(row.get("fwd_ms"), float):
                row.update(bench_fwd_also(inp, 1, args.reps, options, args.fwd_also))
                for name in args.fwd_also:
                    row[f"fwd_{name}_frac"] = inp["flop_fwd"] / row[f"fwd_{name}_ms"] / 1e9 / mm
            if isinstance(row.get("bwd_ms"), float):
                row["bwd_kernel"] = backward_kernel(inp, options)
                row["bwd_tflops"] = inp["flop_bwd"] / row["bwd_ms"] / 1e9
                row["bwd_frac"] = row["bwd_tflops"] / mm
                if "bwd_det_ms" in row:
                    row["det_cost"] = row["bwd_det_ms"] / row["bwd_ms"]
                if args.bwd_also:
                    row.update(bench_bwd_also(inp, 1, args.reps, options, args.bwd_also))
                    for name in args.bwd_also:
                        if isinstance(row[f"bwd_{name}_ms"], float):
                            row[f"bwd_{name}_frac"] = (inp["flop_bwd"] / row[f"bwd_{name}_ms"]
                                                       / 1e9 / mm)
            if not args.no_library:
                try:
                    row.update(bench_library(inp, 1, args.reps))
                except torch.OutOfMemoryError:
                    row["lib_status"] = "OOM"
                for key, flop in (("lib_fwd", inp["flop_fwd"]), ("lib_bwd", inp["flop_bwd"])):
                    if isinstance(row.get(f"{key}_ms"), float):
                        row[f"{key}_frac"] = flop / row[f"{key}_ms"] / 1e9 / mm
                torch.cuda.empty_cache()
            if not args.no_tilelang:
                row.update(tilelang_columns(shape, inp, 1, args.reps, tilelang_said,
                                            args.fwd_only or args.fwd_no_softmax))
                for key, flop in (("tl_fwd", inp["flop_fwd"]), ("tl_bwd", inp["flop_bwd"])):
                    if isinstance(row.get(f"{key}_ms"), float):
                        row[f"{key}_frac"] = flop / row[f"{key}_ms"] / 1e9 / mm
            if not args.no_stock and T <= args.stock_max_t:
                stock = bench_stock(shape, inp, 0, 1)  # one run: the stock path is slow
                row["stock_fwd_ms"], row["stock_fwd_bwd_ms"] = stock["fwd_ms"], stock[
                    "fwd_bwd_ms"]
            elif not args.no_stock:
                row["stock_fwd_ms"] = row["stock_fwd_bwd_ms"] = "skipped (T)"
            del inp
            torch.cuda.empty_cache()
            meta["rows"].append(row)
            meta["tilings"] = {str(key[0]) + str(dict(key[3])): val
                               for key, val in kern._tiling_cache.items()}
            with open(json_path, "w") as f:
                json.dump(meta, f, indent=1)
            for shape_name in sorted({r["shape"] for r in meta["rows"]}):
                save_record("bench_attention", shape_name,
                            [r for r in meta["rows"] if r["shape"] == shape_name],
                            matmul=mm, copy=bw, extra={"indices": args.indices,
                                                        "fwd_kernel": args.fwd_kernel,
                                                        "fwd_also": args.fwd_also,
                                                        "bwd_kernel": args.bwd_kernel,
                                                        "bwd_also": args.bwd_also})
            g = lambda key, spec=".2f", row=row: fmt(row.get(key, "-"), spec)
            log(f"{shape:6s} T={T:6d} fwd {g('fwd_ms')} ms ({g('fwd_frac', '.0%')}) "
                f"bwd {g('bwd_ms')} ms ({g('bwd_frac', '.0%')}) det x{g('det_cost')} "
                f"cudnn/flashmla fwd {g('lib_fwd_ms')} ({g('lib_fwd_frac', '.0%')}) bwd "
                f"{g('lib_bwd_ms')} ({g('lib_bwd_frac', '.0%')}) "
                f"tilelang fwd {g('tl_fwd_ms')} ({g('tl_fwd_frac', '.0%')}) bwd "
                f"{g('tl_bwd_ms')} ({g('tl_bwd_frac', '.0%')}) "
                f"stock fwd {g('stock_fwd_ms', '.1f')} fwd+bwd {g('stock_fwd_bwd_ms', '.1f')} "
                f"peak {g('peak_gib', '.1f')} GiB [{time.time() - t0:.0f}s]"
                + "".join(f" | {n} fwd {g(f'fwd_{n}_ms')} ms ({g(f'fwd_{n}_frac', '.0%')}, "
                          f"{row.get(f'fwd_{n}_kernel', '-')}, rel diff "
                          f"{g(f'fwd_{n}_rel_diff', '.1e')})" for n in args.fwd_also)
                + "".join(f" | {n} bwd {g(f'bwd_{n}_ms')} ms ({g(f'bwd_{n}_frac', '.0%')}, "
                          f"{row.get(f'bwd_{n}_kernel', '-')}, rel diff "
                          f"{g(f'bwd_{n}_rel_diff', '.1e')})" for n in args.bwd_also))

    head = ("| shape | T | K | fwd kernel | fwd ms | fwd TFLOP/s | fwd / matmul | "
            "fwd gather floor ms | bwd ms | bwd TFLOP/s | bwd / matmul | bwd memory floor ms | "
            "det bwd ms (x) | cudnn fwd ms (/ matmul) | cudnn bwd ms (/ matmul) | "
            "tilelang fwd ms (/ matmul) | tilelang bwd ms (/ matmul) | stock fwd ms | "
            "stock fwd+bwd ms | peak GiB |")
    lines = [head, "|" + "---|" * 20]
    for r in meta["rows"]:
        det = (f"{r['bwd_det_ms']:.1f} (x{r['det_cost']:.2f})" if "bwd_det_ms" in r else "-")
        lines.append(
            f"| {r['shape']} | {r['T']} | {r['K']} | {r.get('fwd_kernel', '-')} | "
            f"{fmt(r.get('fwd_ms'), '.2f')} | "
            f"{fmt(r.get('fwd_tflops', '-'), '.0f')} | {fmt(r.get('fwd_frac', '-'), '.0%')} | "
            f"{fmt(r['fwd_mem_floor_ms'], '.1f')} | "
            f"{fmt(r.get('bwd_ms', '-'), '.2f')} | {fmt(r.get('bwd_tflops', '-'), '.0f')} | "
            f"{fmt(r.get('bwd_frac', '-'), '.0%')} | {fmt(r['bwd_mem_floor_ms'], '.1f')} | "
            f"{det} | {fmt(r.get('lib_fwd_ms', '-'), '.2f')} "
            f"({fmt(r.get('lib_fwd_frac', '-'), '.0%')}) | {fmt(r.get('lib_bwd_ms', '-'), '.2f')} "
            f"({fmt(r.get('lib_bwd_frac', '-'), '.0%')}) | "
            f"{fmt(r.get('tl_fwd_ms', '-'), '.2f')} ({fmt(r.get('tl_fwd_frac', '-'), '.0%')}) | "
            f"{fmt(r.get('tl_bwd_ms', '-'), '.2f')} ({fmt(r.get('tl_bwd_frac', '-'), '.0%')}) | "
            f"{fmt(r.get('stock_fwd_ms', '-'), '.1f')} | "
            f"{fmt(r.get('stock_fwd_bwd_ms', '-'), '.1f')} | {fmt(r.get('peak_gib', '-'))} |")
    if args.fwd_also:
        lines += ["", "| shape | T | fwd kernel | fwd ms (/ matmul) | " + " | ".join(
            f"{name}: kernel, ms (/ matmul), speed-up, rel. diff" for name in args.fwd_also)
            + " |", "|---" * (4 + len(args.fwd_also)) + "|"]
        for r in meta["rows"]:
            cells = [f"{r.get(f'fwd_{n}_kernel', '-')}, {fmt(r.get(f'fwd_{n}_ms', '-'), '.2f')} "
                     f"({fmt(r.get(f'fwd_{n}_frac', '-'), '.0%')}), "
                     + (f"{r['fwd_ms'] / r[f'fwd_{n}_ms']:.2f}x"
                        if isinstance(r.get(f"fwd_{n}_ms"), float) else "-")
                     + f", {fmt(r.get(f'fwd_{n}_rel_diff', '-'), '.1e')}"
                     for n in args.fwd_also]
            lines.append(f"| {r['shape']} | {r['T']} | {r.get('fwd_kernel', '-')} | "
                         f"{fmt(r.get('fwd_ms', '-'), '.2f')} "
                         f"({fmt(r.get('fwd_frac', '-'), '.0%')}) | " + " | ".join(cells) + " |")
    if args.bwd_also:
        lines += ["", "| shape | T | bwd kernel | bwd ms (/ matmul) | cudnn bwd ms | " + " | ".join(
            f"{name}: kernel, ms (/ matmul), speed-up, vs cudnn, rel. diff"
            for name in args.bwd_also) + " |", "|---" * (5 + len(args.bwd_also)) + "|"]
        for r in meta["rows"]:
            cells = []
            for n in args.bwd_also:
                ms = r.get(f"bwd_{n}_ms")
                timed = isinstance(ms, float)
                lib = r.get("lib_bwd_ms")
                cells.append(
                    f"{r.get(f'bwd_{n}_kernel', '-')}, {fmt(ms if timed else '-', '.2f')} "
                    f"({fmt(r.get(f'bwd_{n}_frac', '-'), '.0%')}), "
                    + (f"{r['bwd_ms'] / ms:.2f}x" if timed else "-") + ", "
                    + (f"{lib / ms:.2f}x" if timed and isinstance(lib, float) else "-")
                    + f", {fmt(r.get(f'bwd_{n}_rel_diff', '-'), '.1e')}")
            lines.append(f"| {r['shape']} | {r['T']} | {r.get('bwd_kernel', '-')} | "
                         f"{fmt(r.get('bwd_ms', '-'), '.2f')} "
                         f"({fmt(r.get('bwd_frac', '-'), '.0%')}) | "
                         f"{fmt(r.get('lib_bwd_ms', '-'), '.2f')} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench_attention.md"), "w") as f:
        f.write(f"{meta['device']}, {meta['date']}, bf16 matmul {mm:.0f} TFLOP/s, copy "
                f"{bw:.2f} TB/s\n\n`{meta['command']}`\n\n{table}\n")
    log(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for shape in args.shapes:
            rs = [r for r in meta["rows"] if r["shape"] == shape and "fwd_frac" in r]
            ax.plot([r["T"] for r in rs], [r["fwd_frac"] for r in rs], "o-", label=f"{shape} fwd")
            rb = [r for r in rs if "bwd_frac" in r]  # none for a forward-only variant
            if rb:
                ax.plot([r["T"] for r in rb], [r["bwd_frac"] for r in rb], "s--",
                        label=f"{shape} bwd")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (queries = keys)")
        ax.set_ylabel("fraction of measured bf16 matmul rate")
        ax.axhline(0.5, color="gray", lw=0.5)
        ax.axhline(0.3, color="gray", lw=0.5, ls="--")
        ax.legend(fontsize=7)
        ax.set_title(f"HyScale sparse attention, {dev}")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_attention.png"), dpi=120)
    except ImportError:
        log("# matplotlib missing: no plot")


if __name__ == "__main__":
    main()

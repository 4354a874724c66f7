"""Benchmark HyScale's Triton dense (warm-up) indexer KL loss against the plain-torch reference.

Shape: GLM-5.1 DSA by default (main attention 64 query heads over 1 absorbed KV head of 576 =
512 + 64; indexer 32 heads x 128), optionally DeepSeek-V3.2 (128 heads: two head blocks a row;
indexer 64 x 128); T queries over S = T keys, causal, B = 1, bf16 inputs, relu on.

Per T: the Triton op's forward with autograd (which computes the gradients too: the dense
kernel's backward is done in its forward and scaled in backward), its forward + backward, the
loss alone (no autograd: the loss pass without gradient work), the deterministic mode
(--deterministic), and peak memory over the forward + backward
(`torch.cuda.max_memory_allocated` above the inputs). The reference (`backend="reference"`,
row chunks, checkpointed) is timed where T <= --ref-max-t, with its loss and gradients compared.
FLOP counts over the n = T (T + 1) / 2 visible pairs: the main attention's 2 passes x 2 n Hq
Dqk, the index scores' 2 passes x 2 n H_I D_I and the gradients' 2 x 2 n H_I D_I; rates are
ratios to the bf16 matmul rate measured in the same run, also copy bandwidth recorded.

  python scripts/bench_indexer_loss_dense.py                      # T in 4K, 8K, 16K, GLM-5.1
  python scripts/bench_indexer_loss_dense.py --t 16384 --shapes glm51 v32 --deterministic
  python scripts/bench_indexer_loss_dense.py --tilings 32x2 64x1   # options.target_tilings
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyscale_bench.measure import (  # noqa: E402
    copy_tbps,
    log,
    matmul_tflops,
    parse_tiling,
    require_cuda,
    save_record,
    time_ms,
)
from megatron_hyscale.ops.indexer_loss import indexer_kl_loss  # noqa: E402
from megatron_hyscale.ops.kernels import indexer_loss_dense as kern  # noqa: E402
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions  # noqa: E402

# name: (Hq, Hkv, Dqk, H_I, D_I)
SHAPES = {"glm51": (64, 1, 576, 32, 128), "v32": (128, 1, 576, 64, 128)}
LOSS_COEFF = 0.1
INDEXER = ("q_index", "weights", "k_index")


def make_inputs(shape, T, seed=0):
    Hq, Hkv, Dqk, H_I, D_I = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(
        torch.bfloat16)
    x = dict(q_index=r(1, T, H_I, D_I, scale=0.3), weights=r(1, T, H_I, scale=H_I ** -0.5),
             k_index=r(1, T, D_I, scale=0.3), query=r(1, T, Hq, Dqk), key=r(1, T, Hkv, Dqk))
    for n in INDEXER:
        x[n].requires_grad_()
    return x


def flops(shape, T):
    Hq, _, Dqk, H_I, D_I = SHAPES[shape]
    n = T * (T + 1) // 2
    return dict(main=2 * 2 * n * Hq * Dqk, index=4 * 2 * n * H_I * D_I)


def loss_fn(x, backend, options=None, deterministic=False):
    kw = dict(options=options) if options is not None else {}
    return indexer_kl_loss(x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], None,
                           x["query"].shape[-1] ** -0.5, LOSS_COEFF, sparse=False,
                           backend=backend, check_values=False, deterministic=deterministic,
                           **kw)


def grads(x, backend, **kw):
    loss = loss_fn(x, backend, **kw)
    return loss.detach(), torch.autograd.grad(loss, tuple(x[n] for n in INDEXER))


def peak_gib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30, out


def bench(x, backend, warmup, reps, **kw):
    gib, (loss, _) = peak_gib(lambda: grads(x, backend, **kw))
    total = time_ms(lambda: grads(x, backend, **kw), reps=reps, warmup=warmup)
    fwd = time_ms(lambda: loss_fn(x, backend, **kw), reps=reps, warmup=warmup)
    with torch.no_grad():
        loss_only = time_ms(lambda: loss_fn(x, backend, **kw), reps=reps, warmup=warmup)
    return dict(fwd_ms=fwd, fwd_bwd_ms=total, bwd_ms=total - fwd, loss_only_ms=loss_only,
                peak_gib=gib, loss=float(loss))


def compare(x, options):
    """Relative differences of the Triton loss and gradients from the fp32 reference's."""
    loss, g = grads(x, "triton", options=options)
    y = {n: v.detach().float().requires_grad_(n in INDEXER) for n, v in x.items()}
    r_loss, r_g = grads(y, "reference")
    out = dict(loss_rel=float((loss - r_loss).abs() / r_loss.abs()))
    for n, a, b in zip(INDEXER, g, r_g, strict=True):
        out[f"{n}_rel_l2"] = float((a.float() - b).norm() / b.norm())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Needs a CUDA GPU: without one it exits with status 2 "
                                        "before writing anything.")
    ap.add_argument("--t", type=int, nargs="+", default=[4096, 8192, 16384],
                    help="sequence lengths T (queries = keys; default 4K, 8K, 16K)")
    ap.add_argument("--shapes", nargs="+", default=["glm51"], choices=sorted(SHAPES),
                    help="model shapes: GLM-5.1 (32 index heads, 64 x 576 attention) and / or "
                         "DeepSeek-V3.2 (64 index heads, 128 x 576; default: glm51)")
    ap.add_argument("--ref-max-t", type=int, default=16384,
                    help="longest T at which the reference is timed and compared")
    ap.add_argument("--deterministic", action="store_true",
                    help="also time the deterministic mode (fixed-point dk, two loss passes)")
    ap.add_argument("--tilings", nargs="+", type=parse_tiling, default=None, metavar="NxS",
                    help="IndexerLossKernelOptions.target_tilings for both dense kernels "
                         "(keys per step x stages, best first); default: its DEFAULT")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    ap.add_argument("--reps", type=int, default=3, help="timed calls (the median is kept)")
    args = ap.parse_args()
    require_cuda("bench_indexer_loss_dense.py")
    options = IndexerLossKernelOptions.DEFAULT
    if args.tilings:
        options = replace(options, target_tilings=tuple(args.tilings))
    mm, bw = matmul_tflops(), copy_tbps()
    log(f"{torch.cuda.get_device_name()}  bf16 matmul {mm:.0f} TFLOP/s  copy {bw:.2f} TB/s")
    log(f"{'shape':6} {'T':>6} {'fwd ms':>8} {'f+b ms':>8} {'loss ms':>8} {'TF/s':>6} {'%mm':>5} "
        f"{'GiB':>6} {'tiling':>7} {'det ms':>8} {'ref ms':>9} {'ref GiB':>8} {'x ref':>6}")
    for shape in args.shapes:
        records = []
        for T in args.t:
            x = make_inputs(shape, T)
            f = flops(shape, T)
            row = dict(shape=shape, T=T, flops=f)
            row["triton"] = bench(x, "auto", args.warmup, args.reps, options=options)
            key = [k for k in kern._tiling_cache if k[0] == "loss"]
            row["tiling"] = kern._tiling_cache[key[-1]] if key else None
            if args.deterministic:
                row["triton_det"] = bench(x, "auto", args.warmup, args.reps, options=options,
                                          deterministic=True)
            if T <= args.ref_max_t:
                try:
                    row["reference"] = bench(x, "reference", 0, 1)
                    row["accuracy"] = compare(x, options)
                except torch.OutOfMemoryError:
                    row["reference"] = "OOM"
            tr = row["triton"]
            tf = (f["main"] + f["index"]) / tr["fwd_bwd_ms"] / 1e9
            row.update(tflops=tf, frac_matmul=tf / mm)
            ref = row.get("reference")
            det = row.get("triton_det")
            tiling = "x".join(map(str, row["tiling"])) if row["tiling"] else "-"
            log(f"{shape:6} {T:>6} {tr['fwd_ms']:>8.2f} {tr['fwd_bwd_ms']:>8.2f} "
                f"{tr['loss_only_ms']:>8.2f} {tf:>6.0f} {100 * tf / mm:>4.0f}% "
                f"{tr['peak_gib']:>6.2f} {tiling:>7} "
                f"{det['fwd_bwd_ms'] if det else float('nan'):>8.2f} "
                f"{ref['fwd_bwd_ms'] if isinstance(ref, dict) else float('nan'):>9.2f} "
                f"{ref['peak_gib'] if isinstance(ref, dict) else float('nan'):>8.2f} "
                f"{ref['fwd_bwd_ms'] / tr['fwd_bwd_ms'] if isinstance(ref, dict) else 0:>6.1f}")
            if "accuracy" in row:
                log(f"{shape:6} {T:>6} against the fp32 reference: " + ", ".join(
                    f"{k} {v:.2e}" for k, v in row["accuracy"].items()))
            records.append(row)
            del x
            torch.cuda.empty_cache()
            log("record: " + save_record("bench_indexer_loss_dense", shape, records, matmul=mm,
                                         copy=bw))


if __name__ == "__main__":
    main()

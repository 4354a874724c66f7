"""Where the sparse indexer loss's backward kernel spends its time.

    python scripts/probe_indexer_bwd.py [--t 32768 131072] [--shapes glm51 v32]

The backward (`kernels/indexer_loss.py`'s Triton kernel, one program a query row, or on Hopper
the warp-specialized Gluon one, `kernels/indexer_loss_bwd_sm90.py`: --kernels picks, each
case run on each) gathers each selected key's 128-wide k_index row, recomputes the scores and
adds a 128-wide fp32 row into dk_index per (row, slot) with vector atomics. On the same inputs
(`bench_indexer_loss.py`'s: random keys, one per stratum, each row in key order) it times the
kernel alone:

  spread      the default (atomics into dk_index, fp32 [T, 128]: 64 MiB at 128K); each case
              times `indexer_loss_bwd` whole (its dk_index zero-fill and bf16 cast: ~0.1 ms)
  discard     the same products without dk's atomics (MODE_DISCARD; the Gluon kernel: one
              scalar atomic a key row and 64 channels instead of 64): the atomics' share
  shuffled    the same keys, each row's slots in random order (the rows' key order is what
              keeps concurrent rows' atomics near each other)
  window      keys drawn from each row's last --window keys (the active part of dk_index
              L2-resident): whether dk's L2 misses or the atomics themselves bound it
  halves      the spread rows in two launches, one for the keys below T / 2 and one above
              (the other slots masked invalid; ms is the two together): dk's live range
              halved, as a key-split backward would have it. The masked slots are still
              multiplied (the kernel's tile loop runs every slot), so the two launches do
              twice the products: only a time below the default's reads as a gain

Measurement only: a record in benchmarks/results (or $HYSCALE_RESULTS), one row per case with
its time against the default's.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import replace
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_indexer_loss import SHAPES, make_inputs  # noqa: E402

from hyscale_bench.measure import (  # noqa: E402
    copy_tbps,
    log,
    matmul_tflops,
    require_cuda,
    save_record,
    time_ms,
)
from megatron_hyscale.ops.kernels import indexer_loss as kern  # noqa: E402
from megatron_hyscale.ops.kernels.common import MODE_ATOMIC, MODE_DISCARD  # noqa: E402
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions  # noqa: E402

# Rows of the window indices drawn at a time (T x window fp32 at once would be 8 GiB at 128K).
WINDOW_ROWS_PER_CHUNK = 2048
CASES = ("spread", "discard", "shuffled", "window", "halves")


def window_indices(T: int, K: int, window: int, seed: int = 0) -> torch.Tensor:
    """int32 [1, T, K]: row t's keys drawn without repeats from its last max(window, K) keys
    (those it sees: t - width + 1 .. t, at least key 0), in key order; -1 in the slots past
    the keys a row sees (rows t < K only, as in the spread indices)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.empty((1, T, K), device="cuda", dtype=torch.int32)
    width = max(window, K)
    offset = torch.arange(width, device="cuda")[None]
    for t0 in range(0, T, WINDOW_ROWS_PER_CHUNK):
        t1 = min(T, t0 + WINDOW_ROWS_PER_CHUNK)
        rows = torch.arange(t0, t1, device="cuda")[:, None]
        # offsets past the row's first key rank last: a short row takes all it sees
        u = torch.rand((t1 - t0, width), generator=g, device="cuda")
        u = torch.where(offset <= rows, u, -1.0)
        keys = rows - u.topk(K).indices
        keys = torch.where(keys >= 0, keys, torch.full_like(keys, 1 << 40)).sort(-1).values
        out[0, t0:t1] = torch.where(keys < (1 << 40), keys, -1).to(torch.int32)
    return out


def shuffled(idx: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    order = torch.rand(idx.shape, generator=g, device="cuda").argsort(-1)
    return idx.gather(-1, order)


def prepared(x: dict, idx: torch.Tensor) -> tuple:
    """(q, w, k, idx, p, lse, psum): the normalized target and row statistics the backward
    reads, from the attention's target on these indices."""
    T = idx.shape[1]
    pos = torch.arange(T, device="cuda")[None]
    q, w, k = (x[n].detach() for n in ("q_index", "weights", "k_index"))
    p = kern.attention_target(x["query"], x["key"], idx, pos, pos, x["query"].shape[-1] ** -0.5)
    _, lse, psum = kern.indexer_loss_rows(q, w, k, idx, p, True)
    return q, w, k, idx, p, lse, psum


# The backward kernels --kernels names: IndexerLossKernelOptions.bwd_sm90 for each.
KERNELS = {"triton": False, "sm90": True}


def bwd(args: tuple, mode: int = MODE_ATOMIC, kernel: str = "triton") -> None:
    q, w, k, idx, p, lse, psum = args
    grad = torch.ones((), device="cuda")
    options = replace(IndexerLossKernelOptions.DEFAULT, bwd_sm90=KERNELS[kernel])
    kern.indexer_loss_bwd(q, w, k, idx, p, lse, psum, grad, 1.0 / idx.shape[1], True,
                          mode=mode, options=options)


def probe(shape: str, T: int, window: int, reps: int, kernel: str = "triton",
          cases: tuple[str, ...] = CASES) -> list[dict]:
    x, idx = make_inputs(shape, T)
    K = idx.shape[-1]
    base = prepared(x, idx)
    rows = []
    run = partial(bwd, kernel=kernel)

    def record(case: str, ms: float, **extra) -> None:
        ratio = ms / rows[0]["ms"] if rows else 1.0
        # the (keys per step, stages) each launch took: the cases compare one tiling
        tilings = sorted({v for key, v in kern._tiling_cache.items() if key[0] == "bwd"})
        kern._tiling_cache.clear()
        rows.append(dict(shape=shape, T=T, K=K, kernel=kernel, case=case, ms=ms,
                         vs_spread=ratio, tilings=tilings, **extra))
        log(f"{shape} T={T} {kernel:6s} {case:9s} {ms:8.2f} ms  ({ratio:.2f}x the default's "
            "time)")

    record("spread", time_ms(lambda: run(base), reps=reps, warmup=1))
    if "discard" in cases:
        record("discard", time_ms(lambda: run(base, MODE_DISCARD), reps=reps, warmup=1))
    if "shuffled" in cases:
        record("shuffled", time_ms(partial(run, prepared(x, shuffled(idx))), reps=reps,
                                   warmup=1))
    if "window" in cases:
        record("window", time_ms(partial(run, prepared(x, window_indices(T, K, window))),
                                 reps=reps, warmup=1), window=window)
    if "halves" in cases:
        q, w, k, idx_, p, lse, psum = base
        low = idx_ < T // 2
        halves = [(q, w, k, idx_, torch.where(part & (p >= 0), p, kern.INVALID), lse, psum)
                  for part in (low, ~low)]
        record("halves", time_ms(lambda: [run(h) for h in halves], reps=reps, warmup=1))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", type=int, nargs="+", default=[32768, 131072],
                    help="sequence lengths (S = T, causal)")
    ap.add_argument("--shapes", nargs="+", default=["glm51", "v32"], choices=sorted(SHAPES),
                    help="indexer geometries (bench_indexer_loss.py's)")
    ap.add_argument("--window", type=int, default=16384,
                    help="keys a row of the window case draws from (its last ones)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls (the median is kept)")
    ap.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=["triton", "sm90"],
                    help="the backward kernels to probe, each case on each (sm90: the Gluon "
                         "one, Hopper only; default both)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                    help="which cases (default all; spread, the baseline, always runs)")
    args = ap.parse_args()
    require_cuda("probe_indexer_bwd.py")
    if args.window < 1:
        ap.error(f"--window must be >= 1, got {args.window}")
    if "sm90" in args.kernels and torch.cuda.get_device_capability()[0] != 9:
        ap.error("--kernels sm90: the Gluon backward runs on a Hopper GPU only (elsewhere the "
                 "Triton one would be timed in its place)")
    # where the Gluon kernel applies but cannot run, the Triton one would be timed in its place
    warnings.filterwarnings("error", message=".*indexer-loss backward.*")
    mm, cp = matmul_tflops(), copy_tbps()
    rows = []
    for shape in args.shapes:
        for T in args.t:
            for kernel in args.kernels:
                rows += probe(shape, T, args.window, args.reps, kernel, tuple(args.cases))
                torch.cuda.empty_cache()
    path = save_record("probe_indexer_bwd", "-".join(args.shapes), rows, matmul=mm, copy=cp)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

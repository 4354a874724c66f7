"""One HyTopK call inside a CUDA profiler range, for Nsight Compute.

Runs a `bench_selection.py` method (warmed up first, so the profiled call compiles nothing)
between cudaProfilerStart and cudaProfilerStop, for example:

    ncu --profile-from-start off --kernel-name regex:_hytopk_kernel --launch-count 1 \\
        --set full --clock-control none -o norelu python3 scripts/profile_selection.py \\
        --config norelu --T 131072 --method hytopk

`gpu_session.sh ncu-selection` runs its cases this way and `scripts/ncu_summary.py` turns the
reports' CSV exports into a record (stall reasons, hot-loop size, the hottest SASS lines).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_selection import CONFIGS, METHODS, make_inputs  # noqa: E402

from hyscale_bench.measure import require_cuda  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="norelu",
                   help="indexer shape (bench_selection.py's CONFIGS)")
    p.add_argument("--T", type=int, default=131072, help="tokens (queries = keys)")
    p.add_argument("--method", choices=sorted(METHODS), default="hytopk",
                   help="bench_selection.py method to run")
    p.add_argument("--inputs", choices=("random", "structured"), default="random",
                   help="input kind (bench_selection.make_inputs)")
    p.add_argument("--warmup", type=int, default=2, help="calls before the profiled one")
    args = p.parse_args(argv)
    require_cuda("profile_selection.py")
    heads, dim, topk, relu = CONFIGS[args.config]
    q, k, w = make_inputs(args.T, heads, dim, args.inputs)
    fn = METHODS[args.method]
    for _ in range(args.warmup):
        fn(q, k, w, topk, relu)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(q, k, w, topk, relu)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {args.method} {args.config} T={args.T}")


if __name__ == "__main__":
    main()

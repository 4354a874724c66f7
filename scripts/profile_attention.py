"""One sparse-attention backward (or forward) inside a CUDA profiler range, for Nsight Compute.

Builds `bench_attention.py`'s inputs for a shape, runs the forward once and the backward
`--warmup` times (so the profiled call compiles nothing), then one backward between
cudaProfilerStart and cudaProfilerStop. `--kernel` picks the backward: HyScale's
warp-specialized Gluon one ("sm90"; "sm90_red16" with 16-byte dK atomics, "sm90_lockstep"
in lockstep), its Triton one ("triton") or the stock cudnn backend's (cuDNN-frontend's SM90
backward, "cudnn"; after scripts/gpu_cudnn.sh); `--forward`: the forward instead (HyScale's
default, "sm90", or FlashMLA's, "cudnn"). For example:

    ncu --profile-from-start off --kernel-name regex:_sparse_mla_bwd_kernel --launch-count 1 \\
        --set full --clock-control none -o glm51 python3 scripts/profile_attention.py \\
        --shape glm51 --T 131072 --kernel sm90

`--list` runs the profiled call under torch.profiler instead and prints each CUDA kernel's
time, longest first, and a last line `LONGEST <name>` (how `gpu_session.sh ncu-attention`
finds the library's kernel name for ncu's --kernel-name).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import BWD_KERNELS, SHAPES, make_inputs  # noqa: E402

from hyscale_bench.measure import require_cuda  # noqa: E402
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions  # noqa: E402
from megatron_hyscale.ops.kernels.sparse_attention import sparse_attention_triton  # noqa: E402

KERNELS = ("sm90", "sm90_red16", "sm90_lockstep", "sm90_lockstep2", "triton", "cudnn")
# --forward: HyScale's default forward ("sm90": the warp-specialized Gluon one where it applies)
# or FlashMLA's ("cudnn": the stock cudnn backend's forward).
FWD_KERNELS = ("sm90", "cudnn")


def forward_call(inp: dict, kernel: str):
    """A function running one forward of `kernel` on `inp` (no autograd)."""
    q, k, v, sink = (x.detach() if x is not None else None
                     for x in (inp["q"], inp["k"], inp["v"], inp["sink"]))
    if kernel == "cudnn":
        from megatron_hyscale.ops.backends.library_attention import library_attention

        def run():
            with torch.no_grad():
                library_attention(q, k, inp["idx"], inp["scale"], sink=sink)
        return run

    def run():
        with torch.no_grad():
            sparse_attention_triton(q, k, v, inp["idx"], inp["scale"], dv=inp["dv"], sink=sink,
                                    prefix_lengths=inp["prefix"])
    return run


def backward_call(inp: dict, kernel: str):
    """A function running one backward of `kernel` on `inp` (the forward done once here)."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None
              for x in (inp["q"], inp["k"], inp["v"], inp["sink"])]
    if kernel == "cudnn":
        from megatron_hyscale.ops.backends.library_attention import library_attention

        out, _ = library_attention(leaves[0], leaves[1], inp["idx"], inp["scale"],
                                   sink=leaves[3])
    else:
        opts = replace(AttentionKernelOptions.DEFAULT, **BWD_KERNELS[kernel])
        out = sparse_attention_triton(leaves[0], leaves[1], leaves[2], inp["idx"],
                                      inp["scale"], dv=inp["dv"], sink=leaves[3],
                                      prefix_lengths=inp["prefix"], options=opts)
    leaves = [x for x in leaves if x is not None and x.requires_grad]
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="glm51",
                   help="bench_attention.py shape")
    p.add_argument("--T", type=int, default=131072, help="queries (= keys)")
    p.add_argument("--kernel", choices=KERNELS, default="sm90",
                   help="backward to profile (with --forward: the forward, sm90 or cudnn)")
    p.add_argument("--forward", action="store_true",
                   help="profile the forward instead: HyScale's default (sm90) or FlashMLA's "
                        "(cudnn)")
    p.add_argument("--indices", choices=("random", "window", "sorted"), default="random",
                   help="bench_attention.make_inputs index kind")
    p.add_argument("--warmup", type=int, default=2, help="backward calls before the profiled one")
    p.add_argument("--list", action="store_true",
                   help="print the profiled call's CUDA kernels (torch.profiler), no range")
    args = p.parse_args(argv)
    if args.forward and args.kernel not in FWD_KERNELS:
        p.error(f"--kernel {args.kernel}: with --forward, one of {', '.join(FWD_KERNELS)}")
    require_cuda("profile_attention.py")
    inp = make_inputs(args.shape, args.T, indices=args.indices)
    bwd = forward_call(inp, args.kernel) if args.forward else backward_call(inp, args.kernel)
    for _ in range(args.warmup):
        bwd()
    torch.cuda.synchronize()
    if args.list:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            bwd()
            torch.cuda.synchronize()
        times: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name] = times.get(e.name, 0.0) + e.device_time_total / 1e3
        ranked = sorted(times.items(), key=lambda kv: -kv[1])
        for name, ms in ranked:
            print(f"{ms:10.3f} ms  {name[:200]}")
        print(f"LONGEST {ranked[0][0]}")
        return
    torch.cuda.cudart().cudaProfilerStart()
    bwd()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled the {args.kernel} {'forward' if args.forward else 'backward'}, "
          f"{args.shape} T={args.T}")


if __name__ == "__main__":
    main()

"""Context-parallel check on real devices: one HyScale attention layer at CP = world size against
CP = 1, on the same weights and input, under torchrun.

    torchrun --nproc-per-node 2 scripts/check_cp.py --seq 32768          # two H200s, NCCL
    torchrun --nproc-per-node 2 scripts/check_cp.py --model csa --seq 32768
    torchrun --nproc-per-node 2 scripts/check_cp.py --device cpu --tiny  # gloo smoke (CI)

The layer and its geometry are bench_layer.py's `--model` (dsa: GLM-5.1's attention; csa / hca:
DeepSeek-V4-Flash's; qsa: Qwen3.8-Flash-Next's; `--tiny` for the small ones). Every
rank first runs the whole sequence at CP = 1, then megatron is re-initialized with
context_parallel_size = world size and each rank runs its zigzag share (chunks r and
2 cp - 1 - r). Compared on every rank, after gathering the shares: the layer output and the
input gradient (relative Frobenius error), each parameter's gradient (summed over the CP group:
the loss is a sum over tokens, so the shares' gradients add up), and the selected indices of
each local row against the CP = 1 row at the same global position (the share of rows whose
index set is identical; HCA selects nothing). The indexer loss is off (its per-rank mean
would need megatron's DDP averaging; the CPU tests in tests/parallel cover it). bf16 on CUDA:
the indexer projections of a half-length batch may round differently, so a few rows may select
differently at near-ties; the check passes when at least --min-same-rows of the rows are
identical and the errors are below the tolerances. Prints a table, writes check_cp.json, exits
1 on failure. --device cuda (the default where a GPU is visible) needs one CUDA GPU a process:
without CUDA it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hyscale_bench.layer as bench_layer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="--device cuda needs a CUDA GPU a process (NCCL): "
                                       "without one it exits with status 2 before writing "
                                       "anything; --device cpu --tiny is the gloo smoke check.")
    p.add_argument("--model", choices=bench_layer.MODELS, default="dsa",
                   help="the layer (bench_layer.py's --model)")
    p.add_argument("--seq", type=int, default=32768, help="global sequence length")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: NCCL, one GPU a process, bf16 (the default where CUDA is "
                        "visible); cpu: gloo, fp32")
    p.add_argument("--tiny", action="store_true",
                   help="bench_layer.py's tiny geometry of --model (a CPU smoke check)")
    p.add_argument("--out-tol", type=float, default=1e-2, help="output relative error bound")
    p.add_argument("--grad-tol", type=float, default=3e-2, help="gradient relative error bound")
    p.add_argument("--min-same-rows", type=float, default=0.99,
                   help="share of rows whose selected index set must equal CP = 1's (bf16: "
                        "a row whose indexer projections round differently at half the "
                        "batch may swap a near-tie at the top-k boundary)")
    p.add_argument("--out", default="outputs/check_cp", help="output folder")
    args = p.parse_args(argv)
    if args.device == "cuda":  # checked first: without a GPU nothing else matters
        from hyscale_bench.measure import require_cuda

        require_cuda("check_cp.py --device cuda", hint="run it on the GPU machine, or use "
                     "--device cpu --tiny (under torchrun) for the gloo smoke check")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        p.error("run under torchrun with 2 or more processes (CP = world size)")
    if args.seq % (2 * world):
        p.error(f"--seq must be divisible by 2 x world size = {2 * world} (zigzag layout)")
    return args


def run_layer(bargs: argparse.Namespace, T: int) -> dict[str, Any]:
    """One forward + backward of a fresh HyScale layer at bargs.cp; outputs on this rank."""
    layer = bench_layer.BUILDERS[bargs.model](bargs, baseline=False)
    picked: list[torch.Tensor] = []
    hook = None
    if layer.selection_hooks:  # the last hook is the layer's selection (indices or blocks)
        obj, name = layer.selection_hooks[-1]
        original = getattr(obj, name)

        def selection(*a: Any, **kw: Any) -> Any:
            result = original(*a, **kw)
            # the indices, (indices, ...), or a selection record with .indices (V4 CSA)
            if isinstance(result, torch.Tensor):
                indices = result
            else:
                indices = result[0] if isinstance(result, tuple) else result.indices
            picked.append(indices.detach().clone())
            return result

        setattr(obj, name, selection)
        hook = (obj, name)
    hidden, grad = bench_layer.make_input(T, layer, bargs)
    out = layer.call(hidden)
    out.backward(grad)
    if hook is not None:
        delattr(*hook)
    grads = {n: p.grad.detach().float().clone() for n, p in layer.module.named_parameters()
             if p.grad is not None}
    return dict(out=out.detach().float(), x_grad=hidden.grad.detach().float(), grads=grads,
                indices=picked[0][0] if picked else None)  # [T_local, ...] of batch 0


def gather_shares(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """Every rank's zigzag share along dim 0 -> the whole sequence."""
    from megatron_hyscale.parallel import zigzag_merge

    parts = [torch.empty_like(x) for _ in range(cp)]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return zigzag_merge(parts, dim=0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(args: argparse.Namespace) -> dict[str, Any]:
    from hyscale_bench.distributed import init_model_parallel
    from megatron_hyscale import replay
    from megatron_hyscale.parallel import zigzag_positions

    world = int(os.environ["WORLD_SIZE"])
    base = ["--model", args.model, "--device", args.device, "--seq", str(args.seq),
            "--loss-coeff", "0"] + (["--tiny"] if args.tiny else [])
    results = {}
    for cp in (1, world):
        group = init_model_parallel(cp)
        bargs = bench_layer.parse_args(base + ["--cp", str(cp)])
        replay.clear()
        results[cp] = run_layer(bargs, args.seq)
        results[cp]["group"] = group
    one, many = results[1], results[world]
    group, rank = many["group"], many["group"].rank()
    out = gather_shares(many["out"], group, world)
    x_grad = gather_shares(many["x_grad"], group, world)
    for g in many["grads"].values():
        torch.distributed.all_reduce(g, group=group)
    if one["indices"] is not None:
        rows = zigzag_positions(args.seq // world, world, rank, device=one["indices"].device)
        same = (one["indices"][rows].sort(-1).values == many["indices"].sort(-1).values)
        same = same.flatten(1).all(-1)  # a row: every KV head's (QSA) indices
        same_rows = torch.tensor([same.sum().item(), same.numel()], dtype=torch.float64,
                                 device=out.device)
    else:  # a layer that selects nothing (HCA)
        same_rows = torch.ones(2, dtype=torch.float64, device=out.device)
    torch.distributed.all_reduce(same_rows, group=group)
    grad_err = {n: rel(many["grads"][n], g) for n, g in one["grads"].items()}
    report = dict(
        model=args.model, seq=args.seq, cp=world, device=args.device, tiny=args.tiny,
        out_rel_err=rel(out, one["out"]), x_grad_rel_err=rel(x_grad, one["x_grad"]),
        max_param_grad_rel_err=max(grad_err.values()),
        worst_param=max(grad_err, key=grad_err.get),
        same_param_set=set(many["grads"]) == set(one["grads"]),
        same_index_rows=same_rows[0].item() / same_rows[1].item(),
    )
    report["passed"] = bool(
        report["out_rel_err"] <= args.out_tol and report["x_grad_rel_err"] <= args.grad_tol
        and report["max_param_grad_rel_err"] <= args.grad_tol and report["same_param_set"]
        and report["same_index_rows"] >= args.min_same_rows)
    return report


def main(argv: list[str] | None = None) -> int:
    import contextlib

    from hyscale_bench.cpu import megatron_on_cpu

    args = parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        with megatron_on_cpu() if args.device == "cpu" else contextlib.nullcontext():
            report = check(args)
    finally:
        bench_layer.shutdown_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "check_cp.json").write_text(json.dumps(report, indent=1))
        print("| model | T | CP | output rel err | input grad rel err | max param grad rel err "
              "(param) | rows with the same indices | passed |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| {report['model']} | {report['seq']} | {report['cp']} | "
              f"{report['out_rel_err']:.2e} | "
              f"{report['x_grad_rel_err']:.2e} | {report['max_param_grad_rel_err']:.2e} "
              f"({report['worst_param']}) | {report['same_index_rows']:.4%} | "
              f"{report['passed']} |", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

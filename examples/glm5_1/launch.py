#!/usr/bin/env python3
"""Launch GLM-5.1 with HyScale's DSA layer through Megatron-LM: the logic behind the scripts.

    launch.py full          the 512-GPU, 1M-token run (Slurm: srun + torchrun, one per node)
    launch.py small         the scaled-down model on 1 or 2 GPUs (torchrun)
    launch.py side-by-side  stock DSA spec, then HyScale's, same configuration; prints both
    launch.py memory        the per-GPU memory estimate of a configuration

Every subcommand takes --dry-run: print the memory estimate and the exact commands (with their
environment), run nothing, exit 0; no GPU, Slurm or Megatron-LM needed. Without it, the
commands need MEGATRON_LM_DIR (a Megatron-LM checkout holding pretrain_gpt.py) and, for the
full configuration, a Slurm allocation. Arguments after `--` go to pretrain_gpt.py as they are
(data, tokenizer, checkpoints: later arguments override the defaults printed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import glm5_1_config as cfg  # noqa: E402  (also puts the repository root on sys.path)

from megatron_hyscale.launch import logparse  # noqa: E402
from megatron_hyscale.launch.command import (  # noqa: E402
    Command,
    LaunchError,
    megatron_lm_dir,
    pretrain_script,
    print_command,
    slurm_master_addr,
    srun_torchrun,
    torchrun,
    training_env,
)
from megatron_hyscale.launch.memory import Layout, ModelGeometry, estimate, format_table  # noqa: E402


def _add_layout_options(p: argparse.ArgumentParser, *, full: bool) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="print the memory estimate and the commands, run nothing")
    p.add_argument("--seq-length", type=int, help="tokens per sequence")
    p.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--train-iters", type=int, help="iterations to run")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter of the training processes (torch, megatron, HyScale)")
    p.add_argument("--transformer-impl", choices=cfg.TRANSFORMER_IMPLS,
                   default="transformer_engine",
                   help="transformer_engine (default: TE modules, grouped expert GEMMs, fused "
                        "permutation) or local (megatron's torch modules, for a machine "
                        "without Transformer Engine)")
    p.add_argument("--gpu-mem-gib", type=float,
                   help="GPU memory the estimate is checked against (default: 96 for the full "
                        "configuration (H20), 140 for the scaled one (H200), 80 for the small "
                        "one)")
    if full:
        p.add_argument("--nodes", type=int, default=64, help="Slurm nodes (default 64)")
        p.add_argument("--gpus-per-node", type=int, default=8)
        for name in ("tp", "cp", "pp", "ep", "vpp"):
            p.add_argument(f"--{name}", type=int, help=f"override the {name.upper()} size")
        p.add_argument("--first-stage-layers", type=int,
                       help="layers on the first pipeline stage (default 9)")
        p.add_argument("--last-stage-layers", type=int,
                       help="layers on the last pipeline stage (default 9)")
        p.add_argument("--grad-reduce-in-bf16", action="store_true",
                       help="bf16 main gradients (saves 2 bytes/parameter; for 80 GB GPUs)")
        p.add_argument("--port", type=int, default=29500, help="torchrun rendezvous port")
    else:
        p.add_argument("--gpus", type=int, default=None, choices=(1, 2),
                       help="1: no parallelism; 2: CP 2 and EP 2")


def _split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    full = sub.add_parser("full", help="the 512-GPU, 1M-token run under Slurm")
    _add_layout_options(full, full=True)
    full.add_argument("--spec", choices=tuple(cfg.SPECS), default="hyscale")
    small = sub.add_parser("small", help="the scaled-down model on 1 or 2 GPUs")
    _add_layout_options(small, full=False)
    small.add_argument("--spec", choices=tuple(cfg.SPECS), default="hyscale")
    for name, help_text in (("side-by-side", "stock then HyScale, same configuration"),
                            ("memory", "print the per-GPU memory estimate")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", choices=("small", "full", "scaled"), default="small",
                       help="small: the 1-2 GPU model; full: GLM-5.1 on 512 GPUs; scaled: "
                            "GLM-5.1's full attention width, 4 layers, on 1-8 GPUs of one "
                            "host at 128K tokens a GPU (CP = EP = GPUs)")
        _add_layout_options(p, full=True)
        p.add_argument("--gpus", type=int, choices=(1, 2, 4, 8), default=None,
                       help="GPUs of the small (1 or 2, default 2) or scaled (1, 2, 4 or 8, "
                            "default 8) configuration")
        p.add_argument("--stock-backend", choices=("reference", "tilelang"),
                       default="reference",
                       help="stock DSA's kernels: reference (megatron's torch path) or "
                            "tilelang (side-by-side passes --dsa-kernel-backend tilelang to "
                            "the stock run; TileLang must import there); the estimate follows")
        if name == "side-by-side":
            p.add_argument("--output-dir", type=Path, default=Path("glm5_1_side_by_side"),
                           help="where stock.log, hyscale.log and summary.txt go")
            p.add_argument("--skip-iters", type=int, default=2,
                           help="warm-up iterations left out of the timing (default 2)")
            p.add_argument("--only", choices=("stock", "hyscale"),
                           help="run one side only, e.g. HyScale at a length stock's score "
                                "tables cannot fit (the scaled configuration's default); the "
                                "other column stays empty")
            p.add_argument("--parse-only", nargs=2, type=Path, metavar=("STOCK_LOG", "HYSCALE_LOG"),
                           help="run nothing: compare two existing Megatron-LM logs")
    return parser


def resolve(args: argparse.Namespace) -> tuple[ModelGeometry, Layout, bool]:
    """(model, layout, is_full) from the subcommand and the overrides."""
    is_full = args.command == "full" or getattr(args, "config", "small") == "full"
    if is_full:
        layout = cfg.FULL_LAYOUT
        overrides = {k: getattr(args, k) for k in ("tp", "cp", "pp", "ep", "vpp")
                     if getattr(args, k, None) is not None}
        for key, attr in (("first_stage_layers", "first_stage_layers"),
                          ("last_stage_layers", "last_stage_layers")):
            if getattr(args, attr, None) is not None:
                overrides[key] = getattr(args, attr)
        overrides["gpus"] = args.nodes * args.gpus_per_node
        if args.seq_length:
            overrides["seq_length"] = args.seq_length
        if args.global_batch_size:
            overrides["global_batch"] = args.global_batch_size
        if getattr(args, "grad_reduce_in_bf16", False):
            overrides["grad_bytes"] = 2
        layout = replace(layout, **overrides)
        model = cfg.GLM5_1
    elif getattr(args, "config", "small") == "scaled":
        layout = cfg.scaled_layout(args.gpus or 8, args.seq_length, args.global_batch_size or 2)
        model = cfg.GLM5_1_SCALED
    else:
        gpus = args.gpus or (2 if args.command == "side-by-side" else 1)
        default_seq = (cfg.SIDE_BY_SIDE_SEQ_LENGTH if args.command == "side-by-side"
                       else cfg.SMALL_SEQ_LENGTH)
        layout = cfg.small_layout(gpus, args.seq_length or default_seq,
                                  args.global_batch_size or 4)
        model = cfg.GLM5_1_SMALL
    layout.validate(model)
    return model, layout, is_full


def memory_report(model: ModelGeometry, layout: Layout, is_full: bool,
                  stock_backend: str = "reference") -> str:
    gpu = cfg.GPU_GIB if is_full else cfg.SMALL_GPU_GIB
    stages = estimate(model, layout, stock_backend=stock_backend)
    return format_table(model, layout, stages, stock_backend=stock_backend, gpu_gib=gpu)


def gpu_capacity(args: argparse.Namespace, is_full: bool) -> float:
    """GiB a GPU the estimate is checked against: --gpu-mem-gib, else 96 for the full layout
    (H20), 140 for the scaled one (an H200 host), 80 for the small one."""
    if args.gpu_mem_gib:
        return args.gpu_mem_gib
    if is_full:
        return cfg.GPU_GIB["H20"]
    scaled = getattr(args, "config", "small") == "scaled"
    return cfg.SMALL_GPU_GIB["H200" if scaled else "H800"]


def check_fit(model: ModelGeometry, layout: Layout, capacity: float, variant: str,
              stock_backend: str = "reference") -> str | None:
    """A warning when the estimate exceeds `capacity` GiB (None when it fits)."""
    stages = estimate(model, layout, stock_backend=stock_backend)
    peak = max(s.total(variant) for s in stages) / 2**30
    if peak <= capacity:
        return None
    return (f"WARNING: the {variant} run is estimated at {peak:.1f} GiB per GPU, above "
            f"--gpu-mem-gib {capacity:.0f}; it will likely run out of memory")


def make_command(model: ModelGeometry, layout: Layout, is_full: bool, args: argparse.Namespace,
                 spec: str, extra: list[str], *, dry_run: bool) -> Command:
    checkout = megatron_lm_dir(required=not dry_run)
    iters = args.train_iters or (10 if is_full else 50)
    if args.command == "side-by-side" and not args.train_iters:
        iters = 6 if is_full else 30
    margs = cfg.megatron_args(model, layout, spec=spec, train_iters=iters, extra=extra,
                              transformer_impl=args.transformer_impl)
    script = pretrain_script(checkout)
    env = training_env(checkout)
    if args.command == "side-by-side":
        # per-iteration selection / attention / indexer-loss / communication times in both
        # logs (megatron_hyscale.phase_times; the summary reads them back)
        env[logparse.PHASE_TIMES_ENV] = "1"
    if is_full:
        master = slurm_master_addr(required=not dry_run)
        argv = srun_torchrun(args.python, args.nodes, args.gpus_per_node, script, margs,
                             master_addr=master, port=args.port)
    else:
        argv = torchrun(args.python, layout.gpus, script, margs)
    return Command(argv=argv, env=env, label=spec)


def run_single(args: argparse.Namespace, extra: list[str]) -> int:
    megatron_lm_dir(required=not args.dry_run)  # fail before printing anything
    model, layout, is_full = resolve(args)
    print(memory_report(model, layout, is_full))
    capacity = gpu_capacity(args, is_full)
    warning = check_fit(model, layout, capacity, "hyscale" if args.spec == "hyscale" else "stock")
    if warning:
        print(warning)
    if is_full and not args.dry_run:
        allocated = int(os.environ.get("SLURM_JOB_NUM_NODES", "0") or 0)
        if allocated and allocated < args.nodes:
            raise LaunchError(f"the allocation has {allocated} nodes; the run needs {args.nodes}")
    cmd = make_command(model, layout, is_full, args, args.spec, extra, dry_run=args.dry_run)
    print()
    print_command(cmd)
    if args.dry_run:
        print("# dry run: nothing was started")
        return 0
    return cmd.run()


def run_side_by_side(args: argparse.Namespace, extra: list[str]) -> int:
    if not args.parse_only:
        megatron_lm_dir(required=not args.dry_run)  # fail before printing anything
    model, layout, is_full = resolve(args)
    out: Path = args.output_dir
    logs = {"stock": out / "stock.log", "hyscale": out / "hyscale.log"}
    codes: dict[str, int | None] = {"stock": None, "hyscale": None}
    variants = (args.only,) if args.only else ("stock", "hyscale")
    if args.parse_only:
        logs = {"stock": args.parse_only[0], "hyscale": args.parse_only[1]}
        variants = ("stock", "hyscale")
    else:
        print(memory_report(model, layout, is_full, args.stock_backend))
        capacity = gpu_capacity(args, is_full)
        for variant in variants:
            warning = check_fit(model, layout, capacity, variant, args.stock_backend)
            if warning:
                print(warning)
        # stock first, then HyScale: identical arguments except --spec (same seed, same data)
        # and, for stock, its kernel backend (HyScale's layer has its own kernels)
        stock_extra = (["--dsa-kernel-backend", "tilelang"]
                       if args.stock_backend == "tilelang" else [])
        cmds = [make_command(model, layout, is_full, args, spec,
                             (stock_extra if spec == "stock" else []) + extra,
                             dry_run=args.dry_run)
                for spec in variants]
        print()
        for cmd in cmds:
            print(f"# log: {logs[cmd.label]}")
            print_command(cmd)
        if args.dry_run:
            print("# dry run: nothing was started")
            return 0
        for cmd in cmds:
            print(f"\n=== {cmd.label}: {time.strftime('%H:%M:%S')} ===", flush=True)
            codes[cmd.label] = cmd.run(logs[cmd.label])
    summaries, records = [], []
    for variant in ("stock", "hyscale"):
        # a side not run this time stays empty (its log may be an earlier run's)
        ran = variant in variants and logs[variant].is_file()
        text = logs[variant].read_text(errors="replace") if ran else ""
        recs = logparse.parse_megatron_log(text)
        records.append(recs)
        summaries.append(logparse.summarize(
            variant, recs, seq_length=layout.seq_length, gpus=layout.gpus,
            skip=args.skip_iters, exit_code=codes[variant],
            peak_allocated_mib=logparse.peak_allocated_mib(text),
            phase_ms=logparse.phase_times(text, skip=args.skip_iters)))
    table = logparse.side_by_side(summaries[0], summaries[1], records[0], records[1])
    print("\n" + table)
    if not args.parse_only:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.txt").write_text(table + "\n")
    return 0 if all(c in (0, None) for c in codes.values()) else 1


def main(argv: list[str] | None = None) -> int:
    own, extra = _split_extra(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(own)
    try:
        if args.command == "memory":
            model, layout, is_full = resolve(args)
            print(memory_report(model, layout, is_full, args.stock_backend))
            return 0
        if args.command == "side-by-side":
            return run_side_by_side(args, extra)
        return run_single(args, extra)
    except (LaunchError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

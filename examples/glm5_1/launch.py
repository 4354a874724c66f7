#!/usr/bin/env python3
"""Launch GLM-5.1 with HyScale's DSA layer through Megatron-LM: the logic behind the scripts.

    launch.py full          the 512-GPU, 1M-token run (Slurm: srun + torchrun, one per node)
    launch.py small         the scaled-down model on 1 or 2 GPUs (torchrun)
    launch.py side-by-side  stock DSA spec, then HyScale's, same configuration; prints both
                            (optionally then HyScale alone at a longer length: one H200 runs
                            stock cudnn at L, HyScale at L and HyScale at 2L in one call);
                            --checkpoint-dir splits runs longer than one call (checkpoint,
                            exit before --time-limit, resume: megatron_hyscale/launch/resume.py)
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
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import glm5_1_config as cfg  # noqa: E402  (also puts the repository root on sys.path)

from megatron_hyscale.launch import logparse, resume  # noqa: E402
from megatron_hyscale.launch.command import (  # noqa: E402
    HYSCALE_TRAINER,
    TIMED_OUT,
    Command,
    LaunchError,
    launch_env,
    megatron_lm_dir,
    pretrain_script,
    print_command,
    slurm_master_addr,
    srun_torchrun,
    torchrun,
    training_env,
)
from megatron_hyscale.launch.memory import (  # noqa: E402
    STOCK_BACKENDS,
    Layout,
    ModelGeometry,
    estimate,
    format_table,
    longest_fitting_length,
)

# The kernels HyScale's layers use in a side-by-side run: the measured best of its own and the
# installed libraries' (megatron_hyscale/layers/kernel_backend.py), so with the cudnn extra
# installed HyScale also runs cuDNN / FlashMLA where those are faster.
HYSCALE_KERNELS = {"HYSCALE_KERNEL_BACKEND": "best"}


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
            p.add_argument(f"--{name}", type=int,
                           help=f"override the {name.upper()} size (small and scaled "
                                "configurations: CP = EP = GPUs unless given)")
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
        p.add_argument("--stock-backend", choices=STOCK_BACKENDS, default="reference",
                       help="stock DSA's kernels (megatron-core's dsa_kernel_backend): "
                            "reference (its torch path, 'none'), tilelang or cudnn "
                            "(cuDNN-frontend's DSA kernels + FlashMLA: side-by-side passes "
                            "--dsa-kernel-backend tilelang|cudnn to the stock run, whose "
                            "Python must import them; HyScale's run gets "
                            "HYSCALE_KERNEL_BACKEND=best); the estimate follows")
        p.add_argument("--num-layers", type=int,
                       help="decoder layers of the small or scaled model (default 4; the first "
                            "stays dense, the rest are MoE; at least 2): fewer layers, shorter "
                            "iterations and less memory for weights and Adam state")
        if name == "side-by-side":
            p.add_argument("--output-dir", type=Path, default=Path("glm5_1_side_by_side"),
                           help="where stock.log, hyscale.log (hyscale_alone.log), summary.txt "
                                "and the JSON record go")
            p.add_argument("--skip-iters", type=int, default=2,
                           help="warm-up iterations left out of the timing (default 2)")
            p.add_argument("--only", choices=("stock", "hyscale"),
                           help="run one side only, e.g. HyScale at a length stock's score "
                                "tables cannot fit (the scaled configuration's default); the "
                                "other column stays empty")
            p.add_argument("--hyscale-alone-at", type=_alone_length, metavar="LENGTH|Nx",
                           help="after the runs at --seq-length, run HyScale alone at LENGTH "
                                "tokens, or at N times --seq-length ('2x'), e.g. a length "
                                "stock does not fit: same arguments but the length and "
                                "--alone-iters; log hyscale_alone.log, its own column in the "
                                "summary")
            p.add_argument("--alone-iters", type=int, default=4,
                           help="iterations of the --hyscale-alone-at run (default 4; its "
                                "first --skip-iters are not timed)")
            p.add_argument("--time-limit", type=float, metavar="SECONDS",
                           help="wall-clock budget of the whole invocation: a run still going "
                                "when it is spent is stopped (its process group killed; the "
                                "summary marks it) and later runs are not started; summary.txt "
                                "is rewritten after every run, the JSON record written at the "
                                "end either way. With --checkpoint-dir each run is also passed "
                                "Megatron-LM's --exit-duration-in-mins (the whole minutes that "
                                "end at least a minute before what is left of the budget when "
                                "it starts), so that it saves a checkpoint and exits before the "
                                "kill")
            p.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                           help="runs longer than one call: each run saves to and resumes from "
                                "DIR/stock, DIR/hyscale, DIR/hyscale-alone (Megatron-LM's --save "
                                "/ --load / --save-interval); the same command run again "
                                "continues from the last checkpoint, appending to the run's log "
                                "after a '[hyscale] resumed' line (the timing leaves each "
                                "process's first --skip-iters out), and does not re-run a run "
                                "whose log already shows its last iteration (--train-iters, "
                                "--alone-iters); exit status 1 while a run is unfinished")
            p.add_argument("--checkpoint-interval", type=int, default=100, metavar="N",
                           help="with --checkpoint-dir: iterations between checkpoints "
                                "(default 100; a run stopped by --exit-duration-in-mins saves "
                                "one as it stops, and Megatron-LM saves one at the end)")
            p.add_argument("--min-loss-steps", type=int, default=20,
                           help="iterations both runs must log an lm loss at for the loss "
                                "comparison to pass (default 20)")
            p.add_argument("--loss-rtol", type=float, default=1e-2,
                           help="largest relative lm-loss gap between stock and HyScale at any "
                                "compared iteration for the comparison to pass (default 0.01)")
            p.add_argument("--parse-only", nargs="+", type=Path,
                           metavar="LOG",
                           help="run nothing: compare existing Megatron-LM logs, STOCK_LOG "
                                "HYSCALE_LOG [HYSCALE_ALONE_LOG] (the third at "
                                "--hyscale-alone-at)")
    return parser


def _alone_length(text: str) -> int | str:
    """--hyscale-alone-at: a token count, or 'Nx' (N times --seq-length, resolved later)."""
    if text.endswith("x"):
        factor = text[:-1]
        if not factor.isdigit() or int(factor) < 1:
            raise argparse.ArgumentTypeError(f"expected LENGTH or Nx (e.g. 2x), got {text!r}")
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected LENGTH or Nx (e.g. 2x), got {text!r}")
    return int(text)


def alone_layout(args: argparse.Namespace, layout: Layout) -> Layout | None:
    """The layout of the --hyscale-alone-at run (None without one): `layout` at its length."""
    at = getattr(args, "hyscale_alone_at", None)
    if at is None:
        return None
    seq = layout.seq_length * int(at[:-1]) if isinstance(at, str) else at
    return Layout(**{**layout.__dict__, "seq_length": seq})


LAYOUT_OVERRIDES = ("tp", "cp", "pp", "ep", "vpp", "first_stage_layers", "last_stage_layers")


def _layout_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The parallel sizes given on the command line (--tp, --cp, --pp, --ep, --vpp, the stage
    layer counts), for every configuration: the small and scaled ones start from CP = EP = GPUs,
    so e.g. PP 2 on 2 GPUs needs --cp 1 as well (Layout.validate names the mismatch)."""
    return {k: getattr(args, k) for k in LAYOUT_OVERRIDES if getattr(args, k, None) is not None}


def resolve(args: argparse.Namespace) -> tuple[ModelGeometry, Layout, bool]:
    """(model, layout, is_full) from the subcommand and the overrides."""
    is_full = args.command == "full" or getattr(args, "config", "small") == "full"
    if is_full:
        layout = cfg.FULL_LAYOUT
        overrides = _layout_overrides(args)
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
        layout = replace(layout, **_layout_overrides(args))
        model = cfg.with_layers(cfg.GLM5_1_SCALED, getattr(args, "num_layers", None))
    else:
        gpus = args.gpus or (2 if args.command == "side-by-side" else 1)
        default_seq = (cfg.SIDE_BY_SIDE_SEQ_LENGTH if args.command == "side-by-side"
                       else cfg.SMALL_SEQ_LENGTH)
        layout = cfg.small_layout(gpus, args.seq_length or default_seq,
                                  args.global_batch_size or 4)
        layout = replace(layout, **_layout_overrides(args))
        model = cfg.with_layers(cfg.GLM5_1_SMALL, getattr(args, "num_layers", None))
    if is_full and getattr(args, "num_layers", None) is not None:
        raise ValueError("--num-layers applies to the small and scaled configurations; the "
                         "full one is GLM-5.1's 78 layers")
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


def fit_lengths(model: ModelGeometry, layout: Layout, capacity: float,
                stock_backend: str = "reference") -> str:
    """The longest sequence each side fits into `capacity` GiB by the estimate (this layout's
    GPUs, parallelism, batch and model kept; multiples of 8192 tokens)."""
    found = {v: longest_fitting_length(model, layout, capacity, v, stock_backend=stock_backend)
             for v in ("stock", "hyscale")}
    text = {v: f"{n} tokens" if n else "nothing" for v, n in found.items()}
    return (f"longest sequence within {capacity:.0f} GiB a GPU by the estimate (this layout and "
            f"model, {layout.gpus} GPU{'s' if layout.gpus > 1 else ''}): stock DSA "
            f"({stock_backend}) {text['stock']}, HyScale {text['hyscale']}")


def check_fit(model: ModelGeometry, layout: Layout, capacity: float, variant: str,
              stock_backend: str = "reference") -> str | None:
    """A warning when the estimate exceeds `capacity` GiB (None when it fits)."""
    stages = estimate(model, layout, stock_backend=stock_backend)
    peak = max(s.total(variant) for s in stages) / 2**30
    if peak <= capacity:
        return None
    return (f"WARNING: the {variant} run is estimated at {peak:.1f} GiB per GPU, above "
            f"--gpu-mem-gib {capacity:.0f}; it will likely run out of memory")


def train_iters(args: argparse.Namespace, is_full: bool) -> int:
    """--train-iters, else 10 (full) or 50; side by side 6 (full) or 30."""
    if args.train_iters:
        return args.train_iters
    if args.command == "side-by-side":
        return 6 if is_full else 30
    return 10 if is_full else 50


def make_command(model: ModelGeometry, layout: Layout, is_full: bool, args: argparse.Namespace,
                 spec: str, extra: list[str], *, dry_run: bool, iters: int | None = None,
                 label: str | None = None, trainer: str = "megatron-lm",
                 checkout: Path | None = None) -> Command:
    """The launch of one run. trainer: megatron-lm (pretrain_gpt.py from `checkout`, default
    $MEGATRON_LM_DIR) or hyscale (`python -m megatron_hyscale.launch.train_gpt`, HyScale's own
    minimal entry point: same arguments, no Megatron-LM checkout needed)."""
    if trainer == "hyscale":
        script, module, env = HYSCALE_TRAINER, True, launch_env()
    else:
        checkout = checkout or megatron_lm_dir(required=not dry_run)
        script, module, env = pretrain_script(checkout), False, training_env(checkout)
    iters = iters or train_iters(args, is_full)
    own = []
    if args.command == "side-by-side":
        # Megatron reports the allocator after the first two iterations; once more after the
        # last, so the peak covers the whole run
        own = ["--log-memory-interval", str(iters)]
    margs = cfg.megatron_args(model, layout, spec=spec, train_iters=iters, extra=own + extra,
                              transformer_impl=args.transformer_impl)
    if args.command == "side-by-side":
        # per-iteration selection / attention / indexer-loss / communication times in both
        # logs (megatron_hyscale.phase_times; the summary reads them back)
        env[logparse.PHASE_TIMES_ENV] = "1"
        if args.stock_backend == "cudnn":
            env.update(HYSCALE_KERNELS)  # both runs: the environments differ in nothing
    if is_full:
        master = slurm_master_addr(required=not dry_run)
        argv = srun_torchrun(args.python, args.nodes, args.gpus_per_node, script, margs,
                             master_addr=master, port=args.port, module=module)
    else:
        argv = torchrun(args.python, layout.gpus, script, margs, module=module)
    return Command(argv=argv, env=env, label=label or spec)


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


ALONE = "hyscale-alone"  # label of the --hyscale-alone-at run
LOG_NAMES = {"stock": "stock.log", "hyscale": "hyscale.log", ALONE: "hyscale_alone.log"}


def side_command(args: argparse.Namespace, model: ModelGeometry, layout: Layout,
                 alone: Layout | None, is_full: bool, variant: str, extra: list[str], *,
                 budget_s: float | None = None) -> Command:
    """The launch of one side-by-side run: stock and HyScale identical but for the spec and,
    for stock, its kernel backend (HyScale's layer has its own kernels); HyScale alone at its
    length and --alone-iters. With --checkpoint-dir, its checkpoint arguments (DIR/<variant>)
    and, given `budget_s` (the seconds it may take), --exit-duration-in-mins."""
    own = []
    if args.checkpoint_dir is not None:
        own += resume.checkpoint_args(args.checkpoint_dir / variant, args.checkpoint_interval)
        if budget_s is not None:
            own += resume.exit_duration_args(budget_s)
    if variant == ALONE:
        return make_command(model, alone, is_full, args, "hyscale", own + extra,
                            dry_run=args.dry_run, iters=args.alone_iters, label=ALONE)
    if variant == "stock" and args.stock_backend != "reference":
        own += ["--dsa-kernel-backend", args.stock_backend]
    return make_command(model, layout, is_full, args, variant, own + extra,
                        dry_run=args.dry_run)


def final_iteration(args: argparse.Namespace, label: str) -> int:
    """The last iteration of a side-by-side run: --alone-iters for HyScale alone, else
    --train-iters (or its default)."""
    return args.alone_iters if label == ALONE else train_iters(args, args.config == "full")


def finished_earlier(args: argparse.Namespace, label: str, log: Path) -> int | None:
    """With --checkpoint-dir, the last iteration `log` shows when it is the run's final one
    (the run is not started again); else None."""
    if args.checkpoint_dir is None:
        return None
    last = resume.last_iteration(log)
    return last if last is not None and last >= final_iteration(args, label) else None


def run_side_by_side(args: argparse.Namespace, extra: list[str]) -> int:
    started = time.monotonic()
    if not args.parse_only:
        megatron_lm_dir(required=not args.dry_run)  # fail before printing anything
    model, layout, is_full = resolve(args)
    alone = alone_layout(args, layout)
    if alone is not None:
        alone.validate(model)
    out: Path = args.output_dir
    logs = {label: out / name for label, name in LOG_NAMES.items()}
    codes: dict[str, int | None] = {label: None for label in LOG_NAMES}
    variants = [args.only] if args.only else ["stock", "hyscale"]
    if args.checkpoint_interval < 1:
        raise ValueError(f"--checkpoint-interval must be >= 1, got {args.checkpoint_interval}")
    if alone is not None:
        variants.append(ALONE)
    if args.parse_only:
        if len(args.parse_only) not in (2, 3):
            raise ValueError("--parse-only takes STOCK_LOG HYSCALE_LOG [HYSCALE_ALONE_LOG]")
        if len(args.parse_only) == 3 and alone is None:
            raise ValueError("a third --parse-only log needs --hyscale-alone-at (its length)")
        variants = ["stock", "hyscale", ALONE][:len(args.parse_only)]
        logs = dict(zip(variants, args.parse_only))
    else:
        capacity = gpu_capacity(args, is_full)
        print(memory_report(model, layout, is_full, args.stock_backend))
        print(fit_lengths(model, layout, capacity, args.stock_backend))
        for variant in variants:
            if variant == ALONE:
                continue
            warning = check_fit(model, layout, capacity, variant, args.stock_backend)
            if warning:
                print(warning)
        if alone is not None:
            print(f"\nHyScale alone at {alone.seq_length} tokens (--hyscale-alone-at):")
            print(memory_report(model, alone, is_full, args.stock_backend))
            warning = check_fit(model, alone, capacity, "hyscale", args.stock_backend)
            if warning:
                print(warning)
        # stock first, then HyScale: identical arguments except --spec (same seed, same data)
        # and, for stock, its kernel backend
        def command(variant: str, budget_s: float | None) -> Command:
            return side_command(args, model, layout, alone, is_full, variant, extra,
                                budget_s=budget_s)

        shown = None  # the budget of a run started now (its --exit-duration-in-mins)
        if args.time_limit and args.checkpoint_dir is not None:
            shown = args.time_limit - (time.monotonic() - started)
        print()
        for variant in variants:
            print(f"# log: {logs[variant]}")
            print_command(command(variant, shown))
        if args.time_limit:
            print(f"# time limit: {args.time_limit:.0f} s for all {len(variants)} runs")
            if shown is not None:
                print("# --exit-duration-in-mins: from what is left of it when each run "
                      f"starts (shown: {shown:.0f} s, as if it started now)")
        if args.dry_run:
            print("# dry run: nothing was started")
            return 0
        out.mkdir(parents=True, exist_ok=True)
        for variant in variants:
            log, ckpt = logs[variant], None
            if args.checkpoint_dir is not None:
                ckpt = args.checkpoint_dir / variant
                done = finished_earlier(args, variant, log)
                if done is not None:
                    print(f"\n=== {variant}: finished in an earlier call ({log} shows "
                          f"iteration {done}), not run again ===", flush=True)
                    codes[variant] = 0
                    continue
            left = None
            if args.time_limit:
                left = args.time_limit - (time.monotonic() - started)
            resumed = ckpt is not None and resume.has_checkpoint(ckpt)
            print(f"\n=== {variant}: {time.strftime('%H:%M:%S')}"
                  f"{', resuming from ' + str(ckpt) if resumed else ''} ===", flush=True)
            codes[variant] = resume.run_logged(command(variant, left), log, resume=resumed,
                                               timeout_s=left)
            write_summary(args, model, layout, alone, logs, codes, variants)
        table = write_summary(args, model, layout, alone, logs, codes, variants, record=True)
        print("\n" + table)
        unfinished = [v for v in variants if args.checkpoint_dir is not None
                      and finished_earlier(args, v, logs[v]) is None]
        return 0 if all(codes[v] == 0 for v in variants) and not unfinished else 1
    table = summary_text(args, layout, alone, logs, codes, variants)
    print("\n" + table)
    return 0


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.is_file() else ""


def run_summaries(args: argparse.Namespace, layout: Layout, alone: Layout | None,
                  logs: dict[str, Path], codes: dict[str, int | None], variants: list[str]
                  ) -> dict[str, tuple[logparse.RunSummary, list[logparse.IterationRecord], int]]:
    """label -> (summary, records, sequence length) of stock, HyScale and HyScale alone (a
    side not run this time stays empty: its log may be an earlier run's)."""
    found = {}
    for label in LOG_NAMES:
        if label == ALONE and alone is None:
            continue
        text = _read(logs[label]) if label in variants else ""
        seq = alone.seq_length if label == ALONE and alone is not None else layout.seq_length
        code = codes[label]
        recs = logparse.parse_megatron_log(text)
        name = f"hyscale {seq // 1024}K" if label == ALONE else label
        summary = logparse.summarize(
            name, recs, seq_length=seq, gpus=layout.gpus, skip=args.skip_iters, exit_code=code,
            peak_allocated_mib=logparse.peak_allocated_mib(text),
            phase_ms=logparse.phase_times(text, skip=args.skip_iters))
        if code == TIMED_OUT:
            summary.note = "stopped at --time-limit" + (
                f" after {summary.iterations} iterations" if recs else " (see its log)")
        last = max((r.iteration for r in recs), default=0)
        if (args.checkpoint_dir is not None and code is not None
                and last < final_iteration(args, label)):
            # stopped by --exit-duration-in-mins (saved) or killed: the next call resumes
            unfinished = (f"at iteration {last} of {final_iteration(args, label)}: the same "
                          "command resumes it")
            summary.note = f"{summary.note}; {unfinished}" if summary.note else unfinished
        found[label] = (summary, recs, seq)
    return found


def summary_text(args: argparse.Namespace, layout: Layout, alone: Layout | None,
                 logs: dict[str, Path], codes: dict[str, int | None], variants: list[str],
                 runs: dict | None = None) -> str:
    """The side-by-side table, the loss verdict and, with --hyscale-alone-at, all three runs."""
    runs = runs or run_summaries(args, layout, alone, logs, codes, variants)
    (sa, ra, _), (sb, rb, _) = runs["stock"], runs["hyscale"]
    parts = [f"stock DSA backend: {args.stock_backend}; sequence {layout.seq_length} tokens on "
             f"{layout.gpus} GPU{'s' if layout.gpus > 1 else ''}",
             logparse.side_by_side(sa, sb, ra, rb)]
    if ra and rb:
        agreement = logparse.loss_agreement(ra, rb)
        parts.append(agreement.verdict(args.min_loss_steps, args.loss_rtol))
    if ALONE in runs:
        sc = runs[ALONE][0]
        parts.append(f"All runs (HyScale alone at {runs[ALONE][2]} tokens, "
                     f"{sc.iterations} iterations logged):\n" + logparse.runs_table([sa, sb, sc]))
    return "\n\n".join(parts)


def _device_and_torch(python: str) -> tuple[str, str | None]:
    """The GPU's name and torch's version as the training interpreter sees them."""
    code = ("import torch; print(torch.__version__); print(torch.cuda.get_device_name() "
            "if torch.cuda.is_available() else 'cpu')")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                             timeout=120).stdout.split("\n")
        return (out[1].strip() or "unknown"), (out[0].strip() or None)
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown", None


def write_summary(args: argparse.Namespace, model: ModelGeometry, layout: Layout,
                  alone: Layout | None, logs: dict[str, Path], codes: dict[str, int | None],
                  variants: list[str], *, record: bool = False) -> str:
    """summary.txt in --output-dir (after every run, so that a stopped invocation leaves one);
    with record, also the JSON benchmark record of the runs made. Returns the summary."""
    runs = run_summaries(args, layout, alone, logs, codes, variants)
    table = summary_text(args, layout, alone, logs, codes, variants, runs)
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(table + "\n")
    if not record:
        return table
    entries = []
    for label in variants:
        summary, recs, seq = runs[label]
        backend = args.stock_backend if label == "stock" else HYSCALE_KERNELS[
            "HYSCALE_KERNEL_BACKEND"]
        entries.append(logparse.summary_record(
            summary, recs, seq_length=seq, gpus=layout.gpus, kernels=backend,
            exit_code=codes[label], log=logs[label].name))
    extra: dict = {"model": model.name, "num_layers": model.num_layers,
                   "global_batch": layout.global_batch, "stock_backend": args.stock_backend,
                   "transformer_impl": args.transformer_impl, "skip_iters": args.skip_iters}
    if "stock" in runs and "hyscale" in runs and runs["stock"][1] and runs["hyscale"][1]:
        agreement = logparse.loss_agreement(runs["stock"][1], runs["hyscale"][1])
        extra["loss_agreement"] = {"iterations": agreement.compared,
                                   "max_rel_gap": agreement.max_rel_gap,
                                   "at_iteration": agreement.at_iteration,
                                   "min_steps": args.min_loss_steps, "rtol": args.loss_rtol}
    device, torch_version = _device_and_torch(args.python)
    config = f"glm5_1-{args.config}-{layout.gpus}gpu-{args.stock_backend}"
    path = logparse.save_record(
        out, "side_by_side", config, entries, device=device, torch_version=torch_version,
        root=cfg.REPO_ROOT, extra=extra,
        command=" ".join(shlex.quote(a) for a in ["examples/glm5_1/launch.py", "side-by-side",
                                                    *args.invocation[1:]]))
    print(f"# record: {path}")
    return table


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    own, extra = _split_extra(given)
    args = build_parser().parse_args(own)
    args.invocation = given  # for the benchmark record
    try:
        if args.command == "memory":
            model, layout, is_full = resolve(args)
            print(memory_report(model, layout, is_full, args.stock_backend))
            print(fit_lengths(model, layout, gpu_capacity(args, is_full), args.stock_backend))
            return 0
        if args.command == "side-by-side":
            return run_side_by_side(args, extra)
        return run_single(args, extra)
    except (LaunchError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Layer-run launches of `hyscale_bench.layer` (the V4-Flash and Qwen3.8 examples' logic).

A layer run times one attention layer (forward + backward under full recompute) at a long
sequence, HyScale against its baseline, on one GPU, a node (torchrun) or several nodes (srun +
one torchrun per node). `main(example, argv)` is the command line of an example's launch.py:

    launch.py full    the 32-GPU (4 x 8) run at 1M tokens (Slurm)
    launch.py small   the scaled-down run on 1 or 2 GPUs
    launch.py memory  the per-GPU memory estimate of a layer at T and CP

Every subcommand takes --dry-run: print the memory estimate and the exact commands, run
nothing, exit 0 (no GPU, Slurm or torch needed). Without it the prerequisites are checked first
(a Slurm allocation of enough nodes for `full`, enough NVIDIA GPUs for `small`, an interpreter
with torch and megatron-core) and a missing one stops the launch with a message naming it.
Standard library only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace

from megatron_hyscale.launch.command import (
    Command,
    LaunchError,
    launch_env,
    print_command,
    slurm_master_addr,
    srun_torchrun,
    torchrun,
)
from megatron_hyscale.launch.layer_memory import GIB, estimate_layer, format_layer_table

# Run by module name: it resolves wherever the packages are installed (a wheel has no scripts/).
BENCH_MODULE = "hyscale_bench.layer"
# Bytes per token that allgather CP gathers from the other ranks (bf16): the keys / values the
# sparse attention reads and the indexer's raw keys.
CP_GATHER_BYTES_PER_TOKEN = {
    "qsa": 2 * 2 * 256 * 2 + 128 * 2,  # k and v (2 KV heads of 256), indexer key 128
    "dsa": 576 * 2 + 128 * 2,  # kv latent + rope (576), indexer key 128
    "csa": 512 * 2 + 128 * 2,  # raw K = V (512) and indexer input, were CSA CP-aware
    "hca": 512 * 2,
}
# Effective all-gather bandwidth per GPU assumed by the traffic estimate (GB/s): NVLink inside
# an H800 / H200 node (NCCL all-gather bus bandwidth, conservative), and one 400 Gb/s NIC per
# GPU across nodes.
NVLINK_GBPS = 150.0
IB_GBPS = 45.0


@dataclass(frozen=True)
class LayerRun:
    """One bench_layer.py launch: model, lengths and the CP x DP layout on nodes x GPUs."""

    label: str
    model: str
    seq: tuple[int, ...]
    nodes: int = 1
    gpus_per_node: int = 1
    cp: int = 1
    dp: int = 1
    repeats: int = 3
    out: str = "outputs/bench_layer"
    baseline_max_seq: int | None = None  # None: the largest length the estimate fits
    skip_baseline: bool = False
    row_chunk: int | None = None  # HyScale's attention rows per checkpointed part (dsa/csa/hca)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> None:
        if self.world != self.cp * self.dp:
            raise LaunchError(f"{self.nodes} nodes x {self.gpus_per_node} GPUs = {self.world} "
                              f"GPUs, but CP {self.cp} x DP {self.dp} = {self.cp * self.dp}")
        bad = [t for t in self.seq if t % (2 * self.cp)]
        if bad:
            raise LaunchError(f"sequence lengths {bad} are not multiples of 2 x CP = "
                              f"{2 * self.cp} (megatron's zigzag layout)")
        if self.cp > 1 and self.gpus_per_node % self.cp and self.cp % self.gpus_per_node:
            raise LaunchError(f"CP {self.cp} neither divides nor is a multiple of the "
                              f"{self.gpus_per_node} GPUs per node")
        if self.row_chunk is not None and (self.model == "qsa" or self.row_chunk < 1):
            raise LaunchError(f"row chunks ({self.row_chunk}) need a positive row count and a "
                              f"dsa / csa / hca layer, not {self.model}")

    def hyscale_gib(self, T: int) -> float:
        """HyScale's estimated GiB per GPU at T (with this run's row chunks)."""
        return estimate_layer(self.model, T, self.cp, "hyscale", self.row_chunk).total() / GIB

    def bench_args(self, gpu_gib: float) -> list[str]:
        """bench_layer.py's arguments (the baseline limit from the memory estimate)."""
        args = ["--model", self.model, "--seq", *map(str, self.seq), "--repeats",
                str(self.repeats), "--out", self.out]
        if self.cp > 1 or self.dp > 1:
            args += ["--cp", str(self.cp), "--dp", str(self.dp)]
        if self.row_chunk is not None:
            args += ["--row-chunk", str(self.row_chunk)]
        limit = self.baseline_max_seq
        if limit is None:
            fitting = [t for t in self.seq
                       if estimate_layer(self.model, t, self.cp, "baseline").total() / GIB
                       <= gpu_gib]
            limit = max(fitting) if fitting else None
        if self.skip_baseline or limit is None:
            args.append("--skip-baseline")
        else:
            args += ["--baseline-max-seq", str(limit)]
        return args


@dataclass(frozen=True)
class Example:
    """What an example folder launches: its models, its 32-GPU run, its small runs."""

    name: str
    models: tuple[str, ...]
    full: LayerRun
    small: dict[int, LayerRun]  # by GPU count (1, 2)
    full_gpu_gib: float = 80.0  # H800 (the paper's 32-GPU runs)
    small_gpu_gib: float = 139.0  # one H200 as torch sees it
    notes: tuple[str, ...] = field(default_factory=tuple)


def build_command(run: LayerRun, python: str, gpu_gib: float, *, dry_run: bool,
                  port: int = 29500) -> Command:
    """python (1 GPU), torchrun (one node) or srun + torchrun (several nodes)."""
    args = run.bench_args(gpu_gib)
    if run.nodes > 1:
        master = slurm_master_addr(required=not dry_run)
        argv = srun_torchrun(python, run.nodes, run.gpus_per_node, BENCH_MODULE, args,
                             master_addr=master, port=port, module=True)
    elif run.world > 1:
        argv = torchrun(python, run.world, BENCH_MODULE, args, module=True)
    else:
        argv = [python, "-m", BENCH_MODULE, *args]
    return Command(argv=argv, env=launch_env(), label=f"{run.label}: {run.model}")


def cp_traffic(model: str, T: int, cp: int, gbps: float) -> tuple[float, float]:
    """(GiB each GPU receives per CP all-gather, ms of one step's CP traffic at `gbps` GB/s)."""
    if cp == 1:
        return 0.0, 0.0
    gather = (T - T // cp) * CP_GATHER_BYTES_PER_TOKEN[model]
    # forward + recompute gather, backward reduce-scatters the (fp32-accumulated) gradients:
    # about four gathers' worth of bytes per step
    return gather / GIB, 4 * gather / (gbps * 1e9) * 1e3


def traffic_lines(run: LayerRun, T: int) -> list[str]:
    """The chosen layout's CP traffic, and the all-nodes CP alternative's, for comparison."""
    if run.cp == 1:
        return [f"T = {T}: CP 1, no context-parallel traffic"]
    inside = run.cp <= run.gpus_per_node
    gib, ms = cp_traffic(run.model, T, run.cp, NVLINK_GBPS if inside else IB_GBPS)
    where = "inside a node (NVLink" if inside else "across nodes (InfiniBand"
    lines = [f"CP traffic, T = {T}: CP {run.cp} {where}, "
             f"{NVLINK_GBPS if inside else IB_GBPS:.0f} GB/s assumed): {gib:.2f} GiB received "
             f"per all-gather per GPU, ~{ms:.0f} ms of traffic per step"]
    if run.nodes > 1 and inside:
        alt_gib, alt_ms = cp_traffic(run.model, T, run.world, IB_GBPS)
        lines.append(f"alternative CP {run.world} over all nodes (InfiniBand, {IB_GBPS:.0f} GB/s "
                     f"assumed): {alt_gib:.2f} GiB per all-gather per GPU, ~{alt_ms:.0f} ms per "
                     f"step, for one sequence per step instead of {run.dp}")
    return lines


def report(run: LayerRun, gpu_gib: float) -> str:
    """Memory table at the longest length, a one-line estimate per length, CP traffic."""
    lines = [f"# {run.label}: bench_layer.py --model {run.model}, {run.nodes} node(s) x "
             f"{run.gpus_per_node} GPU(s), CP {run.cp} x DP {run.dp}, checked against "
             f"{gpu_gib:.0f} GiB per GPU", ""]
    lines.append(format_layer_table(run.model, max(run.seq), run.cp, gpu_gib,
                                    row_chunk=run.row_chunk))
    lines += ["", "| T | HyScale GiB/GPU | baseline GiB/GPU |", "|---|---|---|"]
    for t in run.seq:
        h = run.hyscale_gib(t)
        b = estimate_layer(run.model, t, run.cp, "baseline").total() / GIB
        lines.append(f"| {t} | {h:.1f} | {b:.1f}{'' if b <= gpu_gib else ' (skipped)'} |")
    lines += ["", *traffic_lines(run, max(run.seq))]
    return "\n".join(lines)


def check_python(python: str) -> None:
    """The bench interpreter must import torch and megatron-core (checked before launching)."""
    try:
        proc = subprocess.run([python, "-c", "import torch, megatron.core"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LaunchError(f"cannot run the bench interpreter {python!r}: {err}") from err
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LaunchError(f"{python} cannot import torch and megatron-core ({last}); pass "
                          "--python with the environment of requirements/ (torch, "
                          "megatron-core 0.19.2, triton) or set HYSCALE_PYTHON")


def check_local_gpus(needed: int) -> None:
    """At least `needed` NVIDIA GPUs on this machine (nvidia-smi -L)."""
    if shutil.which("nvidia-smi") is None:
        raise LaunchError(f"no NVIDIA GPU found (nvidia-smi is not on PATH); this run needs "
                          f"{needed} GPU(s). --dry-run prints the commands anywhere.")
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    found = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    if found < needed:
        raise LaunchError(f"this run needs {needed} GPU(s); nvidia-smi lists {found}")


def check_slurm_nodes(needed: int) -> None:
    allocated = int(os.environ.get("SLURM_JOB_NUM_NODES", "0") or 0)
    if not allocated:
        raise LaunchError(f"no Slurm allocation (SLURM_JOB_NUM_NODES is unset): submit the "
                          f".sbatch file, or run inside `salloc --nodes {needed}`; --dry-run "
                          "prints the commands anywhere.")
    if allocated < needed:
        raise LaunchError(f"the allocation has {allocated} nodes; the run needs {needed}")


def build_parser(example: Example) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"examples/{example.name}/launch.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("full", "the 32-GPU (4 x 8) 1M-token layer run (Slurm)"),
                            ("small", "the scaled-down run on 1 or 2 GPUs"),
                            ("memory", "print the per-GPU memory estimate")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--model", choices=example.models, default=None,
                       help=f"layer (default {example.full.model})")
        p.add_argument("--seq", type=int, nargs="+", help="sequence lengths (global tokens)")
        p.add_argument("--gpu-mem-gib", type=float,
                       help=f"GPU memory the estimate is checked against (default "
                            f"{example.full_gpu_gib:.0f} for full, {example.small_gpu_gib:.0f} "
                            "for small / memory)")
        p.add_argument("--row-chunk", type=int, default=None, metavar="ROWS",
                       help="HyScale's attention rows per checkpointed part (dsa / csa / hca; "
                            "default: the run's own, none for memory)")
        if name == "memory":
            p.add_argument("--cp", type=int, default=1)
            continue
        p.add_argument("--dry-run", action="store_true",
                       help="print the memory estimate and the commands, run nothing")
        p.add_argument("--python", default=os.environ.get("HYSCALE_PYTHON", sys.executable),
                       help="interpreter of the bench processes (torch, megatron-core, HyScale)")
        p.add_argument("--repeats", type=int, help="timed repeats per length")
        p.add_argument("--out", help="bench_layer.py output folder")
        p.add_argument("--skip-baseline", action="store_true", help="HyScale only")
        p.add_argument("--baseline-max-seq", type=int,
                       help="longest length the baseline is tried at (default: the longest "
                            "its memory estimate fits; bench_layer.py records an OOM as such)")
        if name == "full":
            p.add_argument("--nodes", type=int, default=example.full.nodes)
            p.add_argument("--gpus-per-node", type=int, default=example.full.gpus_per_node)
            p.add_argument("--cp", type=int, help=f"CP size (default {example.full.cp}; DP = "
                                                  "GPUs / CP)")
            p.add_argument("--port", type=int, default=29500, help="rendezvous port")
        else:
            p.add_argument("--gpus", type=int, choices=sorted(example.small), default=1)
    return parser


def resolve(example: Example, args: argparse.Namespace) -> tuple[LayerRun, float]:
    if args.command == "full":
        run = example.full
        cp = args.cp or run.cp
        world = args.nodes * args.gpus_per_node
        if cp < 1 or world % cp:
            raise LaunchError(f"CP {cp} does not divide the {world} GPUs")
        run = replace(run, nodes=args.nodes, gpus_per_node=args.gpus_per_node, cp=cp,
                      dp=world // cp)
        gpu = args.gpu_mem_gib or example.full_gpu_gib
    else:
        run = example.small[args.gpus]
        gpu = args.gpu_mem_gib or example.small_gpu_gib
    changes: dict[str, object] = {}
    if args.model:
        changes["model"] = args.model
    if args.seq:
        changes["seq"] = tuple(args.seq)
    for key in ("repeats", "out"):
        if getattr(args, key, None):
            changes[key] = getattr(args, key)
    if getattr(args, "baseline_max_seq", None):
        changes["baseline_max_seq"] = args.baseline_max_seq
    if getattr(args, "skip_baseline", False):
        changes["skip_baseline"] = True
    if args.row_chunk is not None:
        changes["row_chunk"] = args.row_chunk
    run = replace(run, **changes)
    run.validate()
    return run, gpu


def main(example: Example, argv: list[str] | None = None) -> int:
    args = build_parser(example).parse_args(argv)
    try:
        if args.command == "memory":
            model = args.model or example.full.model
            gpu = args.gpu_mem_gib or example.small_gpu_gib
            for t in args.seq or list(example.full.seq):
                print(format_layer_table(model, t, args.cp, gpu, row_chunk=args.row_chunk)
                      + "\n")
            return 0
        run, gpu = resolve(example, args)
        if not args.dry_run:
            if args.command == "full":
                check_slurm_nodes(run.nodes)
            else:
                check_local_gpus(run.world)
            check_python(args.python)
        print(report(run, gpu))
        for note in example.notes:
            print(f"# note: {note}")
        worst = max(run.hyscale_gib(t) for t in run.seq)
        if worst > gpu:
            print(f"WARNING: HyScale's estimate reaches {worst:.1f} GiB per GPU, above "
                  f"{gpu:.0f} GiB: the longest lengths will likely run out of memory "
                  "(bench_layer.py records them as OOM)")
        cmd = build_command(run, args.python, gpu, dry_run=args.dry_run,
                            port=getattr(args, "port", 29500))
        print()
        print_command(cmd)
        if args.dry_run:
            print("# dry run: nothing was started")
            return 0
        return cmd.run()
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

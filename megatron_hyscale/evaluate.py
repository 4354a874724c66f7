"""The go / no-go evaluation: a GPT pretraining run twice, stock DSA then HyScale.

    python -m megatron_hyscale.evaluate [options]          run both, write the report
    python -m megatron_hyscale.evaluate --dry-run ...      print the plan, run nothing

Both runs get the same model, layout, seed and data and differ only in the layer spec (stock
megatron-core DSA, or HyScale's) and, for stock, its kernel backend: the strongest one the
training interpreter imports (cudnn when cuDNN-frontend's DSA kernels and FlashMLA do, else
tilelang, else megatron's torch path; `--stock-backend` overrides). The HyScale run also prints
its selection agreement with stock on its own weights and batch every `--agreement-every`
iterations (megatron_hyscale.selection_agreement). The output folder gets stock.log,
hyscale.log, report.md, loss.png, agreement.png, phases.png and results.json.

The report, section by section: the loss curves overlaid and their relative gap per step;
tokens/s, model TFLOP/s per GPU and MFU (against the matmul rate measured on the GPU, or
--matmul-tflops, else "not measured"), peak memory per GPU and the selection / attention /
indexer-loss / communication times per iteration; selection agreement per layer over training
(Jaccard of the two top-k sets, and how often they differ only by tied scores) beside each
run's indexer loss; GPU-hours and cost per billion tokens at --usd-per-gpu-hour; the exact
commands, versions, device and commit.

The trainer (`--trainer`): megatron-lm, Megatron-LM's own pretrain_gpt.py, found through
MEGATRON_LM_DIR or the checkout's .carry/megatron_lm (pretrain_gpt.py and the two files it
imports: scripts/megatron_lm_carry.sh copies them); the default when one is found, and what real
evaluations should run. Or hyscale: megatron_hyscale.launch.train_gpt, HyScale's own minimal
entry point on the megatron-core wheel's megatron.training (same arguments, same training loop
and log; no SFT / FIM / packed documents), for a machine without a Megatron-LM checkout (CI).
Without a checkout and without `--trainer hyscale` the evaluation stops, saying so: it never
switches trainer by itself. The report names the trainer.

Configurations: `tiny` (a 2-layer GLM-shaped model for a CPU smoke run: CI runs it on gloo),
`small` and `scaled` (examples/glm5_1: GLM-5.1's attention geometry; `scaled` is its full
attention width). On a machine without a GPU (`--device cpu`) the runs go through
`hyscale_bench.pretrain_cpu`, which redirects megatron.training's CUDA calls; timings there
are for plumbing only.

A run longer than one sitting: `--checkpoint-dir` saves each run every `--checkpoint-interval`
iterations and resumes it from there when the same command runs again (its log is appended
after a `[hyscale] resumed` line, and each process's warm-up iterations are left out of the
timing: megatron_hyscale.launch.logparse), `--time-limit` stops a run in time to save
(Megatron-LM's --exit-duration-in-mins, whole minutes), and `--only stock|hyscale` /
`--report-only` split the work between calls (megatron_hyscale.launch.resume).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from megatron_hyscale.launch import logparse, resume
from megatron_hyscale.launch.command import (
    CARRIED_MEGATRON_LM,
    HYSCALE_TRAINER,
    MEGATRON_ENV,
    REPO_ROOT,
    TRAINERS,
    Command,
    LaunchError,
    find_megatron_lm,
    print_command,
)
from megatron_hyscale.launch.memory import STOCK_BACKENDS, Layout, ModelGeometry

VARIANTS = ("stock", "hyscale")
CONFIGS = ("tiny", "small", "scaled")
CPU_RUNNER = "hyscale_bench.pretrain_cpu"
# Megatron-LM flags that need a GPU (bf16 math, fused kernels, the distributed optimizer's
# overlapped buckets): dropped from a CPU run, which keeps fp32 and plain Adam.
CPU_DROPPED_FLAGS = ("--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--overlap-param-gather", "--cross-entropy-loss-fusion")
REPORT_SECTIONS = ("Setup", "Loss", "Throughput and memory", "Phase breakdown",
                   "Selection agreement", "Cost", "Commands and versions")
NOT_MEASURED = "not measured"


# --------------------------------------------------------------------------- configuration


def glm_config() -> ModuleType:
    """examples/glm5_1/glm5_1_config.py (the GLM-5.1 arguments), imported from the checkout."""
    return _load_example("glm5_1_config")


def glm_launch() -> ModuleType:
    """examples/glm5_1/launch.py (side-by-side's command builder and checks)."""
    glm_config()
    return _load_example("launch")


def _load_example(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    path = REPO_ROOT / "examples" / "glm5_1" / f"{name}.py"
    if not path.is_file():
        raise LaunchError(f"{path} is missing: the evaluation runs from a HyScale checkout "
                          "(it builds its commands with examples/glm5_1)")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_model() -> ModelGeometry:
    """GLM-5.1's structure (MLA, DSA indexer, one dense layer then MoE) at a size a 2-core CPU
    trains a step of in a fraction of a second: for the smoke run, not for numbers."""
    return replace(glm_config().GLM5_1_SMALL, name="GLM-5.1-tiny", num_layers=2, hidden=128,
                   ffn_hidden=256, num_heads=4, q_lora_rank=64, kv_lora_rank=32,
                   qk_nope_dim=16, qk_rope_dim=16, v_dim=16, indexer_heads=4, indexer_dim=32,
                   topk=64, num_experts=4, moe_ffn_hidden=64, shared_ffn_hidden=64,
                   router_topk=2, first_dense_layers=1, vocab_size=512)


# --------------------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Every option of the evaluation, documented in --help."""
    p = argparse.ArgumentParser(
        prog="python -m megatron_hyscale.evaluate", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what runs")
    g.add_argument("--config", choices=CONFIGS, default="tiny",
                   help="model: tiny (CPU smoke run, 2 layers, hidden 128), small (GLM-5.1's "
                        "attention head dims, hidden 2048, 4 layers) or scaled (GLM-5.1's full "
                        "attention width: hidden 6144, 64 heads, indexer 32 x 128 top-2048; "
                        "4 layers). Default tiny")
    g.add_argument("--num-layers", type=_positive_int,
                   help="decoder layers of the small or scaled model (at least 2; the first "
                        "is dense, the rest MoE)")
    g.add_argument("--gpus", type=int, choices=(1, 2, 4, 8),
                   help="GPUs of one host (small: 1 or 2; scaled: 1-8 with CP = EP = GPUs); "
                        "default 1")
    g.add_argument("--seq-length", type=_positive_int,
                   help="tokens per sequence (default: tiny 256, small 16384, scaled 131072 a "
                        "GPU)")
    g.add_argument("--global-batch-size", type=_positive_int,
                   help="sequences per optimizer step (default: tiny 2, small 4, scaled 2)")
    g.add_argument("--train-iters", type=_positive_int, default=300,
                   help="iterations of each run (default 300)")
    g.add_argument("--seed", type=int, default=1234,
                   help="Megatron-LM's --seed, the same for both runs (weights, data order)")
    g.add_argument("--stock-backend", choices=("auto", *STOCK_BACKENDS), default="auto",
                   help="stock DSA's kernels (megatron-core's dsa_kernel_backend): auto (the "
                        "strongest the training interpreter imports: cudnn if cudnn and "
                        "flash_mla import on a GPU, then tilelang, then reference, megatron's "
                        "torch path), or one of them")
    g.add_argument("--transformer-impl", choices=("transformer_engine", "local"),
                   help="Megatron modules: transformer_engine, or local (torch; what a machine "
                        "without Transformer Engine needs). Default: transformer_engine when "
                        "the training interpreter imports it, else local")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when the training interpreter sees a GPU; cpu runs the "
                        "trainer through hyscale_bench.pretrain_cpu on gloo (fp32)")
    g.add_argument("--trainer", choices=TRAINERS,
                   help="the training entry point: megatron-lm (Megatron-LM's pretrain_gpt.py "
                        "from $MEGATRON_LM_DIR, else .carry/megatron_lm; the default when one "
                        "is found, and an error when none is) or hyscale (python -m "
                        f"{HYSCALE_TRAINER}: HyScale's own minimal entry point on "
                        "megatron.training, for machines without a Megatron-LM checkout, e.g. "
                        "CI; real evaluations should use megatron-lm)")
    g.add_argument("--python", default=sys.executable,
                   help="interpreter of the training processes (torch, megatron-core, HyScale; "
                        "default: this one)")
    g.add_argument("--only", choices=VARIANTS,
                   help="run one side only (the other's log in --output-dir, if any, still "
                        "goes into the report): split the evaluation between calls")
    d = p.add_argument_group("data")
    d.add_argument("--data", default="stdlib", metavar="{mock,stdlib,PATH}",
                   help="mock: Megatron's random tokens; stdlib (default): the Python standard "
                        "library's sources as UTF-8 bytes (megatron_hyscale/launch/corpus.py), "
                        "built on demand into --data-cache; PATH: your own Megatron indexed "
                        "dataset prefix (PATH.bin and PATH.idx, tokens below --vocab-size of the "
                        "config, NullTokenizer's end-of-document id vocab_size - 1)")
    d.add_argument("--data-cache", type=Path,
                   help="folder of built corpora (default: $HYSCALE_DATA_CACHE, else "
                        "~/.cache/hyscale/corpus)")
    d.add_argument("--corpus-limit-mb", type=_nonnegative_float,
                   help="stdlib corpus: stop after this many MiB of text (default: all "
                        "sources, about 30-60 MiB)")
    m = p.add_argument_group("measurements")
    m.add_argument("--agreement-every", type=_positive_int, default=50,
                   help="HyScale run: compare its top-k with stock's on the same weights and "
                        "batch at iteration 1 and every N iterations (default 50)")
    m.add_argument("--agreement-rows", type=_positive_int, default=256,
                   help="query rows sampled per layer for the agreement (default 256)")
    m.add_argument("--capture-indexer-at", type=_positive_int, default=None, metavar="N",
                   help="HyScale run: save its first DSA layer's indexer q, k and weights "
                        "(first sequence) at iteration N to --capture-indexer-path, for "
                        "scripts/bench_selection.py --captured (megatron_hyscale."
                        "indexer_capture); default: no capture")
    m.add_argument("--capture-indexer-path", type=Path, default=None, metavar="PATH",
                   help="where --capture-indexer-at writes (default: OUTPUT_DIR/"
                        "indexer_capture.pt)")
    m.add_argument("--skip-iters", type=int, default=2,
                   help="warm-up iterations left out of the timing (default 2)")
    m.add_argument("--matmul-tflops", type=_nonnegative_float,
                   help="the GPU's dense bf16 matmul rate for MFU; default: measured before the "
                        "runs on a GPU, 'not measured' on a CPU")
    m.add_argument("--usd-per-gpu-hour", type=_nonnegative_float,
                   help="price of one GPU-hour: the report's cost per billion tokens (without "
                        "it, GPU-hours only)")
    m.add_argument("--gpu-mem-gib", type=_nonnegative_float,
                   help="GPU memory the estimate is checked against (default: the config's, "
                        "80 or 140 GiB)")
    o = p.add_argument_group("output and long runs")
    o.add_argument("--output-dir", type=Path, default=Path("outputs/evaluate"),
                   help="where the logs, report.md, the PNGs and results.json go (default "
                        "outputs/evaluate)")
    o.add_argument("--checkpoint-dir", type=Path,
                   help="save each run here (DIR/stock, DIR/hyscale) every "
                        "--checkpoint-interval iterations and resume from it when the command "
                        "runs again; logs are appended (after a '[hyscale] resumed' line)")
    o.add_argument("--checkpoint-interval", type=_positive_int, default=100,
                   help="iterations between checkpoints (default 100)")
    o.add_argument("--time-limit", type=_nonnegative_float, metavar="SECONDS",
                   help="wall-clock budget of this call: each run is asked to save and exit "
                        "(Megatron-LM's --exit-duration-in-mins: the whole minutes that end "
                        "at least a minute before its share) before it is spent, and stopped "
                        "if it overruns")
    o.add_argument("--report-only", action="store_true",
                   help="run nothing: write the report from the logs in --output-dir")
    o.add_argument("--dry-run", action="store_true",
                   help="print the plan (both commands, the memory estimate), run nothing")
    return p


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """What the evaluation runs: both commands and what the report needs to know of them."""

    args: argparse.Namespace
    model: ModelGeometry
    layout: Layout
    device: str
    trainer: str
    checkout: Path | None  # the Megatron-LM checkout (trainer megatron-lm; None in a dry run)
    stock_backend: str
    backend_reasons: list[str]
    data: str
    data_note: str
    commands: dict[str, Command]
    estimate: str

    @property
    def logs(self) -> dict[str, Path]:
        return {v: self.args.output_dir / f"{v}.log" for v in VARIANTS}


_PROBE = r"""
import json, importlib.util
out = {"cuda": False, "device": "cpu", "torch": None, "te": False, "reasons": {}}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        out["device"] = torch.cuda.get_device_name()
except Exception as err:
    out["reasons"]["torch"] = repr(err)
out["te"] = importlib.util.find_spec("transformer_engine") is not None
if out["cuda"]:
    try:
        from megatron_hyscale.ops.backends.availability import CUDNN, FLASHMLA, library_unavailable
        dev = torch.device("cuda")
        why = library_unavailable(CUDNN, dev) or library_unavailable(FLASHMLA, dev)
        if why:
            out["reasons"]["cudnn"] = why
    except Exception as err:
        out["reasons"]["cudnn"] = repr(err)
    try:
        from hyscale_bench.stock_kernels import tilelang_unavailable
        why = tilelang_unavailable()
        if why:
            out["reasons"]["tilelang"] = why
    except Exception as err:
        out["reasons"]["tilelang"] = repr(err)
else:
    out["reasons"]["cudnn"] = out["reasons"]["tilelang"] = "no CUDA device"
try:
    import triton
    out["triton"] = triton.__version__
except Exception:
    out["triton"] = None
try:
    from megatron.core.package_info import __version__ as mcore
    out["megatron_core"] = mcore
except Exception:
    out["megatron_core"] = None
print(json.dumps(out))
"""


def probe_interpreter(python: str) -> dict[str, Any]:
    """What the training interpreter has: CUDA and its device, Transformer Engine, the stock
    backends' libraries (with the reason each is missing), torch / triton / megatron-core
    versions. Run in that interpreter (it may not be this one)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LaunchError(f"--python {python} does not run: {err}") from err
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise LaunchError(f"--python {python} could not report its torch / megatron setup:\n"
                          f"{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def choose_stock_backend(requested: str, probe: dict[str, Any]) -> tuple[str, list[str]]:
    """(backend, the reasons stronger ones were passed over): cudnn, then tilelang, then
    reference (megatron's torch path), unless one is asked for."""
    if requested != "auto":
        return requested, []
    reasons = []
    for backend in ("cudnn", "tilelang"):
        why = probe["reasons"].get(backend)
        if why is None:
            return backend, reasons
        reasons.append(f"{backend}: {why}")
    return "reference", reasons


def resolve_trainer(args: argparse.Namespace) -> tuple[str, Path | None]:
    """(trainer, Megatron-LM checkout): --trainer, else megatron-lm when a checkout is found.
    Without one, megatron-lm is an error (a dry run prints $MEGATRON_LM_DIR instead): the
    evaluation never falls back to the other trainer by itself."""
    if args.trainer == "hyscale":
        return "hyscale", None
    checkout = find_megatron_lm()
    if checkout is None and not args.dry_run:
        raise LaunchError(
            f"no Megatron-LM checkout: {MEGATRON_ENV} is not set and "
            f"{CARRIED_MEGATRON_LM} has no pretrain_gpt.py. Point "
            f"{MEGATRON_ENV} at one, or run `bash scripts/megatron_lm_carry.sh "
            "MEGATRON_LM_GIT_DIR`, or pass `--trainer hyscale` to train with HyScale's own "
            f"entry point ({HYSCALE_TRAINER}) instead of Megatron-LM's pretrain_gpt.py")
    return "megatron-lm", checkout


def trainer_note(plan: Plan) -> str:
    """The trainer, in words, for the plan and the report."""
    if plan.trainer == "hyscale":
        return (f"hyscale: `python -m {HYSCALE_TRAINER}`, HyScale's own minimal GPT entry "
                "point on megatron-core's megatron.training (not Megatron-LM's "
                "pretrain_gpt.py)")
    if plan.checkout is None:
        return f"megatron-lm: ${MEGATRON_ENV}/pretrain_gpt.py"
    source = plan.checkout / "SOURCE"  # scripts/megatron_lm_carry.sh writes the ref and commit
    return (f"megatron-lm: Megatron-LM's pretrain_gpt.py from {plan.checkout}"
            + (f" ({source.read_text().strip()})" if source.is_file() else ""))


def resolve_model(args: argparse.Namespace) -> tuple[ModelGeometry, Layout]:
    """The model and layout of --config with the overrides (validated)."""
    cfg = glm_config()
    if args.config == "tiny":
        if args.num_layers is not None:
            raise ValueError("--num-layers applies to the small and scaled configurations")
        if args.gpus not in (None, 1):
            raise ValueError("--config tiny runs on one process; --gpus must be 1")
        model = tiny_model()
        layout = cfg.small_layout(1, args.seq_length or 256, args.global_batch_size or 2)
        layout.validate(model)
        return model, layout
    ns = argparse.Namespace(command="side-by-side", config=args.config,
                            gpus=args.gpus or 1, seq_length=args.seq_length,
                            global_batch_size=args.global_batch_size,
                            num_layers=args.num_layers)
    model, layout, _ = glm_launch().resolve(ns)
    return model, layout


def resolve_data(args: argparse.Namespace, model: ModelGeometry, *, build: bool
                 ) -> tuple[list[str], str, str]:
    """(Megatron-LM data arguments, the --data choice, a note for the report). stdlib is built
    (once, cached) only when `build`; a dry run shows where it would go."""
    if args.data == "mock":
        return ["--mock-data"], "mock", "Megatron's mock dataset (random tokens)"
    if args.data == "stdlib":
        from megatron_hyscale.launch.corpus import corpus_key, ensure_stdlib_corpus

        cache = args.data_cache or Path(os.environ.get(
            "HYSCALE_DATA_CACHE", Path.home() / ".cache" / "hyscale" / "corpus"))
        limit = None if args.corpus_limit_mb is None else int(args.corpus_limit_mb * 2**20)
        if build:
            prefix, manifest = ensure_stdlib_corpus(cache, model.vocab_size, limit)
            note = (f"the Python {manifest['python']} standard library's sources "
                    f"({manifest['documents']} files, {manifest['tokens']:,} byte tokens, "
                    f"end-of-document id {manifest['eod_id']})")
        else:
            prefix = cache / corpus_key(model.vocab_size, limit) / "stdlib_text_document"
            note = "the Python standard library's sources (built before the runs)"
        return ["--data-path", str(prefix), "--split", "100,0,0"], "stdlib", note
    prefix = Path(args.data)
    missing = [str(prefix) + s for s in (".bin", ".idx") if not Path(str(prefix) + s).is_file()]
    if missing:
        raise ValueError(f"--data {args.data}: not mock, stdlib or an indexed dataset prefix "
                         f"({', '.join(missing)} missing)")
    return (["--data-path", str(prefix), "--split", "100,0,0"], str(prefix),
            f"the indexed dataset {prefix}")


def _cpu_command(cmd: Command, trainer: str) -> Command:
    """A GPU command turned into a CPU one: the trainer (pretrain_gpt.py, or `-m` HyScale's)
    run by hyscale_bench.pretrain_cpu, the GPU-only flags dropped."""
    argv = [a for a in cmd.argv if a not in CPU_DROPPED_FLAGS]
    if trainer == "hyscale":
        at = argv.index(HYSCALE_TRAINER) - 1  # its `-m`
    else:
        at = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    return Command(argv=argv[:at] + ["-m", CPU_RUNNER] + argv[at:],
                   env={**cmd.env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                   label=cmd.label)


def build_plan(args: argparse.Namespace, probe: dict[str, Any] | None, *, build_data: bool
               ) -> Plan:
    """Both commands, from examples/glm5_1's side-by-side builder (one source for the
    arguments), plus the evaluation's own: seed, data, throughput log, agreement, checkpoints."""
    launch = glm_launch()
    model, layout = resolve_model(args)
    probe = probe or {"cuda": False, "te": False, "reasons": {
        "cudnn": "not probed (dry run)", "tilelang": "not probed (dry run)"}}
    device = args.device if args.device != "auto" else ("cuda" if probe["cuda"] else "cpu")
    if device == "cuda" and args.dry_run is False and not probe["cuda"]:
        raise LaunchError(f"--device cuda, but --python {args.python} sees no CUDA device")
    stock_backend, reasons = choose_stock_backend(args.stock_backend, probe)
    if device == "cpu" and stock_backend != "reference":
        raise ValueError(f"--stock-backend {stock_backend} needs a GPU; on a CPU stock runs "
                         "its reference (torch) path")
    trainer, checkout = resolve_trainer(args)
    impl = args.transformer_impl or ("transformer_engine" if probe.get("te") else "local")
    data_args, data, data_note = resolve_data(args, model, build=build_data)
    ns = argparse.Namespace(command="side-by-side", python=args.python, transformer_impl=impl,
                            stock_backend=stock_backend, config=args.config,
                            train_iters=args.train_iters)
    common = ["--seed", str(args.seed), "--log-throughput", *data_args]
    if args.config == "tiny":
        common += ["--moe-token-dispatcher-type", "allgather"]
    if args.time_limit:
        # Megatron-LM checks this after each iteration; leave room to save and start the other
        common += resume.exit_duration_args(
            args.time_limit / (1 if args.only else len(VARIANTS)))
    commands = {}
    for variant in VARIANTS:
        own = list(common)
        if variant == "stock" and stock_backend != "reference":
            own += ["--dsa-kernel-backend", stock_backend]
        if args.checkpoint_dir is not None:
            own += resume.checkpoint_args(args.checkpoint_dir / variant,
                                          args.checkpoint_interval)
        cmd = launch.make_command(model, layout, False, ns, variant, own,
                                  dry_run=args.dry_run, iters=args.train_iters, label=variant,
                                  trainer=trainer, checkout=checkout)
        if variant == "hyscale":
            cmd.env[logparse.AGREEMENT_ENV] = str(args.agreement_every)
            cmd.env[logparse.AGREEMENT_ROWS_ENV] = str(args.agreement_rows)
            if args.capture_indexer_at is not None:
                cmd.env[logparse.INDEXER_CAPTURE_ENV] = str(
                    args.capture_indexer_path or args.output_dir / "indexer_capture.pt")
                cmd.env[logparse.INDEXER_CAPTURE_AT_ENV] = str(args.capture_indexer_at)
        if data != "mock":
            cmd.argv = [w for w in cmd.argv if w != "--mock-data"]
        if device == "cpu":
            cmd = _cpu_command(cmd, trainer)
        cmd.argv += list(args.megatron_extra)  # after `--`: the user's last word
        commands[variant] = cmd
    capacity = args.gpu_mem_gib or (80.0 if args.config in ("tiny", "small") else 140.0)
    estimate = "\n".join([
        launch.memory_report(model, layout, False, stock_backend),
        launch.fit_lengths(model, layout, capacity, stock_backend),
        *(w for v in VARIANTS
          if (w := launch.check_fit(model, layout, capacity, v, stock_backend)))])
    return Plan(args, model, layout, device, trainer, checkout, stock_backend, reasons, data,
                data_note, commands, estimate)


def print_plan(plan: Plan) -> None:
    a = plan.args
    print(f"# evaluation: {plan.model.name}, {plan.model.num_layers} layers, sequence "
          f"{plan.layout.seq_length}, global batch {plan.layout.global_batch}, "
          f"{plan.layout.gpus} {'GPU' if plan.device == 'cuda' else 'process'}"
          f"{'s' if plan.layout.gpus > 1 else ''} ({plan.device}), {a.train_iters} iterations "
          f"each, seed {a.seed}")
    print(f"# trainer: {trainer_note(plan)}")
    print(f"# stock DSA backend: {plan.stock_backend}"
          + (f" (passed over: {'; '.join(plan.backend_reasons)})" if plan.backend_reasons
             else ""))
    print(f"# data: {plan.data_note}")
    print(plan.estimate)
    for variant, cmd in plan.commands.items():
        print(f"# log: {plan.logs[variant]}")
        print_command(cmd)


# --------------------------------------------------------------------------- runs


def run_plan(plan: Plan) -> dict[str, int | None]:
    """Run stock then HyScale (or --only one); each run's output is teed to its log (appended
    after a resume marker when its --checkpoint-dir holds a checkpoint to resume from:
    megatron_hyscale.launch.resume). Returns the exit codes."""
    a = plan.args
    a.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    codes: dict[str, int | None] = {v: None for v in VARIANTS}
    variants = [a.only] if a.only else list(VARIANTS)
    for i, variant in enumerate(variants):
        left = None
        if a.time_limit:
            left = a.time_limit - (time.monotonic() - started)
            left = left / (len(variants) - i)  # an equal share of what is left
        resumed = (a.checkpoint_dir is not None
                   and resume.has_checkpoint(a.checkpoint_dir / variant))
        print(f"\n=== {variant} ({i + 1}/{len(variants)}): {time.strftime('%H:%M:%S')}"
              f"{', resuming from ' + str(a.checkpoint_dir / variant) if resumed else ''} ===",
              flush=True)
        codes[variant] = resume.run_logged(plan.commands[variant], plan.logs[variant],
                                           resume=resumed, timeout_s=left)
        _exit_code_file(a.output_dir, variant).write_text(f"{codes[variant]}\n")
        print(f"=== {variant}: exit {codes[variant]} ===", flush=True)
    return codes


def _exit_code_file(output_dir: Path, variant: str) -> Path:
    return output_dir / f"{variant}.exit"


def recorded_exit_codes(output_dir: Path) -> dict[str, int | None]:
    """Each variant's exit code as its last run wrote it into output_dir (None: never run
    there), so a report written in a later call (--only, --report-only) still has it."""
    codes: dict[str, int | None] = {}
    for variant in VARIANTS:
        try:
            codes[variant] = int(_exit_code_file(output_dir, variant).read_text().strip())
        except (OSError, ValueError):
            codes[variant] = None
    return codes


def measure_matmul_tflops(python: str) -> float | None:
    """The GPU's dense bf16 matmul rate (hyscale_bench.measure.matmul_tflops), in the training
    interpreter; None when it fails (the report says 'not measured' and why is printed)."""
    code = "from hyscale_bench.measure import matmul_tflops; print(matmul_tflops())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True,
                              timeout=600, env=env)
        return float(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        print(f"warning: the matmul rate could not be measured ({err}); MFU is 'not measured' "
              "(pass --matmul-tflops)", file=sys.stderr)
        return None


# --------------------------------------------------------------------------- the report


def model_flops_per_iteration(model: ModelGeometry, layout: Layout) -> float:
    """Model FLOPs of one iteration (forward + backward, recompute not counted, the MFU
    convention), the same formula for both runs:
    6 x (active parameters - the input embedding) per token (every matmul, MoE at its top-k,
    the output layer), plus per layer and token the absorbed-MLA sparse attention over
    min(top-k, visible keys) keys (6 x heads x keys x (kv_lora + rope + kv_lora)) and the
    indexer's scan of the visible keys (forward only: 2 x H_I x D_I x keys)."""
    tokens = layout.global_batch * layout.seq_length
    t = layout.seq_length
    dense = 6.0 * (model.active_params() - model.embedding_params()) * tokens
    # mean over causal rows of min(topk, row + 1) and of (row + 1)
    k = min(model.topk, t)
    mean_selected = (k * (k + 1) / 2 + k * (t - k)) / t
    mean_visible = (t + 1) / 2
    d_qk = model.kv_lora_rank + model.qk_rope_dim
    attention = 6.0 * model.num_heads * mean_selected * (d_qk + model.kv_lora_rank)
    indexer = 2.0 * model.indexer_heads * model.indexer_dim * mean_visible
    return dense + model.num_layers * (attention + indexer) * tokens


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _f(value: float | None, spec: str, none: str = NOT_MEASURED) -> str:
    return format(value, spec) if _finite(value) else none


def collect(plan: Plan, codes: dict[str, int | None], matmul: float | None) -> dict[str, Any]:
    """Everything the report shows, from the two logs (results.json holds the same)."""
    a = plan.args
    flops = model_flops_per_iteration(plan.model, plan.layout)
    runs: dict[str, Any] = {}
    for variant in VARIANTS:
        log = plan.logs[variant]
        text = log.read_text(errors="replace") if log.is_file() else ""
        recs = logparse.parse_megatron_log(text)
        summary = logparse.summarize(
            variant, recs, seq_length=plan.layout.seq_length, gpus=plan.layout.gpus,
            skip=a.skip_iters, exit_code=codes.get(variant),
            peak_allocated_mib=logparse.peak_allocated_mib(text),
            phase_ms=logparse.phase_times(text, skip=a.skip_iters))
        tflops = (flops / (summary.mean_iteration_ms / 1e3) / plan.layout.gpus / 1e12
                  if _finite(summary.mean_iteration_ms) and summary.mean_iteration_ms else None)
        gpu_hours = (1e9 / summary.tokens_per_s / 3600.0 * plan.layout.gpus
                     if summary.tokens_per_s else None)
        runs[variant] = {
            "summary": summary, "records": recs, "tflops_per_gpu": tflops,
            "mfu": tflops / matmul if _finite(tflops) and matmul else None,
            "gpu_hours_per_billion_tokens": gpu_hours,
            "usd_per_billion_tokens": (gpu_hours * a.usd_per_gpu_hour
                                       if gpu_hours is not None and a.usd_per_gpu_hour
                                       is not None else None),
            "agreement": logparse.selection_agreement(text) if variant == "hyscale" else [],
            "indexer_capture": logparse.indexer_capture(text),
        }
    return {"runs": runs, "flops_per_iteration": flops, "matmul_tflops": matmul}


def loss_gaps(stock: list[logparse.IterationRecord], hyscale: list[logparse.IterationRecord]
              ) -> list[tuple[int, float, float, float]]:
    """(iteration, stock loss, HyScale loss, relative gap |h - s| / |s|) where both logged."""
    by_h = {r.iteration: r.lm_loss for r in hyscale if r.lm_loss is not None}
    return [(r.iteration, r.lm_loss, by_h[r.iteration],
             abs(by_h[r.iteration] - r.lm_loss) / max(abs(r.lm_loss), 1e-30))
            for r in stock if r.lm_loss is not None and r.iteration in by_h]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise LaunchError("the report's figures need matplotlib: pip install "
                          "'megatron-hyscale[demo]' (or matplotlib)") from err
    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    return plt


def plot_loss(gaps: list[tuple[int, float, float, float]], path: Path) -> None:
    """Both lm-loss curves overlaid (top) and their relative gap per step (bottom)."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps = [g[0] for g in gaps]
    top.plot(steps, [g[1] for g in gaps], label="stock", color="tab:red", lw=1.0, ls="--")
    top.plot(steps, [g[2] for g in gaps], label="HyScale", color="tab:blue", lw=1.6)
    top.set(ylabel="lm loss", title="lm loss, same configuration, seed and data")
    top.legend()
    bottom.plot(steps, [max(g[3], 1e-12) for g in gaps], color="tab:purple")
    bottom.set(xlabel="iteration", ylabel="|HyScale - stock| / stock", yscale="log")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_agreement(points: list[logparse.AgreementPoint], path: Path) -> None:
    """Per layer over training: Jaccard of the two top-k sets, and the share of rows whose sets
    differ only by tied scores."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for layer in sorted({p.layer for p in points}):
        mine = [p for p in points if p.layer == layer]
        line, = ax.plot([p.step for p in mine], [p.jaccard for p in mine], marker="o",
                        label=f"layer {layer}: Jaccard")
        ax.plot([p.step for p in mine], [p.score_match for p in mine], marker="x", ls=":",
                color=line.get_color(), label=f"layer {layer}: same scores")
    ax.set(xlabel="iteration", ylim=(0, 1.02),
           title="HyScale's top-k against stock's, same weights and batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_phases(runs: dict[str, Any], path: Path) -> None:
    """Selection / attention / indexer loss / communication ms per iteration, one bar a run."""
    from megatron_hyscale.phase_spans import PHASES

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(VARIANTS)
    for phase in PHASES:
        values = [runs[v]["summary"].phase_ms.get(phase, 0.0) for v in VARIANTS]
        ax.bar(list(VARIANTS), values, bottom=bottom, label=phase.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="ms per iteration (slowest rank)", title="DSA phases per iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(plan: Plan, codes: dict[str, int | None], matmul: float | None,
                 probe: dict[str, Any]) -> Path:
    """report.md, loss.png, agreement.png, phases.png and results.json in --output-dir."""
    from megatron_hyscale.phase_spans import PHASES

    a, out = plan.args, plan.args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    data = collect(plan, codes, matmul)
    runs = data["runs"]
    s, h = runs["stock"]["summary"], runs["hyscale"]["summary"]
    gaps = loss_gaps(runs["stock"]["records"], runs["hyscale"]["records"])
    points = runs["hyscale"]["agreement"]
    figures = []
    if gaps:
        plot_loss(gaps, out / "loss.png")
        figures.append("loss.png")
    if points:
        plot_agreement(points, out / "agreement.png")
        figures.append("agreement.png")
    if s.phase_ms or h.phase_ms:
        plot_phases(runs, out / "phases.png")
        figures.append("phases.png")
    cpu = plan.device == "cpu"
    unit = "GPU" if not cpu else "process"
    lines = [f"# HyScale evaluation: {plan.model.name}", ""]
    lines += [f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `python -m "
              "megatron_hyscale.evaluate`." + (" CPU smoke run: the numbers exercise the "
                                               "pipeline, they say nothing about a GPU." if cpu
                                               else ""), ""]
    lines += ["## Setup", "",
              "| | |", "| --- | --- |",
              f"| model | {plan.model.name}: {plan.model.num_layers} layers, hidden "
              f"{plan.model.hidden}, {plan.model.num_heads} MLA heads, indexer "
              f"{plan.model.indexer_heads} x {plan.model.indexer_dim} top-{plan.model.topk}, "
              f"{plan.model.num_experts} experts top-{plan.model.router_topk} |",
              f"| layout | {plan.layout.gpus} {unit}(s), TP {plan.layout.tp}, CP "
              f"{plan.layout.cp}, EP {plan.layout.ep}, sequence {plan.layout.seq_length}, "
              f"global batch {plan.layout.global_batch} |",
              f"| iterations | {a.train_iters} each, seed {a.seed}, first {a.skip_iters} not "
              "timed |",
              f"| data | {plan.data_note} |",
              f"| stock DSA backend | {plan.stock_backend}"
              + (f" (passed over: {'; '.join(plan.backend_reasons)})" if plan.backend_reasons
                 else "") + " |",
              f"| exit codes | stock {codes.get('stock')}, HyScale {codes.get('hyscale')} |",
              ""]
    lines += ["## Loss", ""]
    if gaps:
        worst = max(gaps, key=lambda g: g[3])
        mean_gap = sum(g[3] for g in gaps) / len(gaps)
        lines += ["![lm loss](loss.png)", "",
                  f"{len(gaps)} iterations logged by both; largest relative gap "
                  f"{worst[3]:.3e} at iteration {worst[0]}; mean {mean_gap:.3e}; "
                  f"last: stock {gaps[-1][1]:.6f}, HyScale {gaps[-1][2]:.6f}.", "",
                  "| iteration | stock lm loss | HyScale lm loss | relative gap |",
                  "| ---: | ---: | ---: | ---: |"]
        step = max(1, len(gaps) // 20)
        shown = gaps[::step] + ([gaps[-1]] if (len(gaps) - 1) % step else [])
        lines += [f"| {g[0]} | {g[1]:.6f} | {g[2]:.6f} | {g[3]:.3e} |" for g in shown]
    else:
        lines.append("No iteration was logged by both runs (see the logs).")
    lines.append("")
    mem_label = ("peak resident memory per process (GiB, CPU)" if cpu
                 else "peak allocated memory per GPU (GiB)")
    rows = [
        ("iterations logged (timed)", lambda r: f"{r['summary'].iterations} "
                                                f"({r['summary'].timed_iterations})"),
        ("mean iteration time (ms)", lambda r: _f(r["summary"].mean_iteration_ms, ".1f")),
        ("tokens/s", lambda r: _f(r["summary"].tokens_per_s, ",.1f")),
        (f"tokens/s per {unit}", lambda r: _f(r["summary"].tokens_per_s_per_gpu, ",.1f")),
        (f"model TFLOP/s per {unit}", lambda r: _f(r["tflops_per_gpu"], ".4g")),
        ("MFU", lambda r: _f(None if r["mfu"] is None else 100 * r["mfu"], ".2f") + (
            " %" if r["mfu"] is not None else "")),
        (mem_label, lambda r: _f(None if r["summary"].peak_allocated_mib is None
                                 else r["summary"].peak_allocated_mib / 1024, ".2f")),
    ]
    lines += ["## Throughput and memory", "",
              "| | stock | HyScale |", "| --- | ---: | ---: |"]
    lines += [f"| {label} | {fn(runs['stock'])} | {fn(runs['hyscale'])} |" for label, fn in rows]
    speedup = (h.tokens_per_s / s.tokens_per_s if h.tokens_per_s and s.tokens_per_s else None)
    lines += ["", f"Speed-up HyScale / stock: {_f(speedup, '.2f')}x. Model FLOPs per iteration "
              f"{data['flops_per_iteration']:.4g} (`model_flops_per_iteration`: 6 x active "
              "parameters per token plus the sparse attention and the indexer scan; recompute "
              "not counted). Matmul rate for MFU: "
              + (f"{matmul:.1f} TFLOP/s" + (" (measured)" if a.matmul_tflops is None else
                                            " (--matmul-tflops)") if matmul else NOT_MEASURED)
              + ".", ""]
    lines += ["## Phase breakdown", ""]
    if s.phase_ms or h.phase_ms:
        lines += ["![phases](phases.png)", "",
                  "ms per iteration, slowest rank, inclusive times on the compute stream "
                  "(megatron_hyscale/phase_times.py):", "",
                  "| phase | stock | HyScale |", "| --- | ---: | ---: |"]
        lines += [f"| {p.replace('_', ' ')} | {_f(s.phase_ms.get(p), '.2f')} | "
                  f"{_f(h.phase_ms.get(p), '.2f')} |" for p in PHASES]
    else:
        lines.append("No phase times in the logs.")
    lines.append("")
    lines += ["## Selection agreement", ""]
    if points:
        by_step_idx: dict[int, dict[str, float]] = {}
        for variant in VARIANTS:
            for r in runs[variant]["records"]:
                if r.indexer_loss is not None:
                    by_step_idx.setdefault(r.iteration, {})[variant] = r.indexer_loss
        lines += ["![agreement](agreement.png)", "",
                  "At each measured iteration, each HyScale DSA layer's indexer on the HyScale "
                  "run's current weights and batch selects with HyScale's op and with "
                  "megatron-core's stock selection (`fused_qk_topk_naive`) for "
                  f"{points[0].rows} sampled query rows (megatron_hyscale/"
                  "selection_agreement.py). Jaccard: |A & B| / |A | B|; same scores: rows whose "
                  "two sets hold the same scores (both exact, differing only among ties). "
                  "Indexer loss: each run's logged value at that iteration (mean over layers).",
                  "", "| iteration | layer | Jaccard | same scores | indexer loss stock | "
                  "indexer loss HyScale |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for p in points:
            il = by_step_idx.get(p.step, {})
            lines.append(f"| {p.step} | {p.layer} | {p.jaccard:.4f} | {p.score_match:.4f} | "
                         f"{_f(il.get('stock'), '.4e', '-')} | "
                         f"{_f(il.get('hyscale'), '.4e', '-')} |")
        lines += ["", f"Mean Jaccard over all: {sum(p.jaccard for p in points) / len(points):.4f}; "
                  f"lowest {min(p.jaccard for p in points):.4f}."]
    else:
        lines.append("No agreement lines in the HyScale log (see its log).")
    capture = runs["hyscale"].get("indexer_capture")
    if capture:
        lines += ["", f"The HyScale run's layer {capture['layer']} indexer at iteration "
                  f"{capture['iteration']} ({capture['T']} tokens) is saved in "
                  f"`{capture['path']}`: `python scripts/bench_selection.py --captured "
                  f"{capture['path']}` times HyTopK (and its key-tile pruning) on it."]
    lines.append("")
    no_price = "no --usd-per-gpu-hour"
    lines += ["## Cost", "",
              "| | stock | HyScale |", "| --- | ---: | ---: |",
              f"| {unit}-hours per billion tokens | "
              f"{_f(runs['stock']['gpu_hours_per_billion_tokens'], ',.2f')} | "
              f"{_f(runs['hyscale']['gpu_hours_per_billion_tokens'], ',.2f')} |",
              f"| USD per billion tokens at {_f(a.usd_per_gpu_hour, '.2f', 'no price')} per "
              f"{unit}-hour | {_f(runs['stock']['usd_per_billion_tokens'], ',.2f', no_price)} | "
              f"{_f(runs['hyscale']['usd_per_billion_tokens'], ',.2f', no_price)} |",
              ""]
    commit = logparse._git_commit(REPO_ROOT)
    lines += ["## Commands and versions", "",
              f"- device: {probe.get('device', 'unknown')} ({plan.device})",
              f"- torch {probe.get('torch')}, triton {probe.get('triton')}, megatron-core "
              f"{probe.get('megatron_core')}, HyScale commit {commit}",
              f"- trainer: {trainer_note(plan)}",
              "- evaluation: `" + " ".join(shlex.quote(w) for w in
                                          ["python", "-m", "megatron_hyscale.evaluate",
                                           *a.invocation]) + "`", ""]
    for variant, cmd in plan.commands.items():
        lines += [f"{variant}:", "", "```", cmd.render(), "```", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    results = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
                 "device": probe.get("device"), "torch": probe.get("torch"),
                 "triton": probe.get("triton"), "megatron_core": probe.get("megatron_core"),
                 "trainer": plan.trainer, "stock_backend": plan.stock_backend,
                 "data": plan.data,
                 "matmul_tflops": matmul, "flops_per_iteration": data["flops_per_iteration"]},
        "runs": {v: logparse.summary_record(
            r["summary"], r["records"], seq_length=plan.layout.seq_length,
            gpus=plan.layout.gpus, tflops_per_gpu=r["tflops_per_gpu"], mfu=r["mfu"],
            gpu_hours_per_billion_tokens=r["gpu_hours_per_billion_tokens"],
            usd_per_billion_tokens=r["usd_per_billion_tokens"], exit_code=codes.get(v))
            for v, r in runs.items()},
        "agreement": [p.__dict__ for p in points],
        "indexer_capture": runs["hyscale"].get("indexer_capture"),
        "figures": figures,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return report


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Parse, plan, run (unless --dry-run / --report-only), report. Exit 0 when both runs
    (or the one asked for) finished, 1 when one failed, 2 on a bad argument or setup."""
    given = list(sys.argv[1:] if argv is None else argv)
    own, extra = (given[:given.index("--")], given[given.index("--") + 1:]) if "--" in given \
        else (given, [])
    parser = build_parser()
    args = parser.parse_args(own)
    args.invocation, args.megatron_extra = given, extra
    try:
        if args.report_only and (args.dry_run or args.only):
            raise ValueError("--report-only writes the report from existing logs; it takes "
                             "neither --dry-run nor --only")
        if args.skip_iters < 0:
            raise ValueError(f"--skip-iters must be >= 0, got {args.skip_iters}")
        resolve_trainer(args)  # fail before anything is built or printed
        probe = None
        if not args.dry_run or args.device == "auto":
            try:
                probe = probe_interpreter(args.python)
            except LaunchError as err:
                if not args.dry_run:
                    raise
                print(f"# could not ask --python what it has ({err}); planning for a CPU and "
                      "the reference stock backend (pass --device / --stock-backend)")
        plan = build_plan(args, probe, build_data=not args.dry_run and not args.report_only)
        print_plan(plan)
        if args.dry_run:
            print("# dry run: nothing was started")
            return 0
        assert probe is not None
        if not args.report_only:
            run_plan(plan)
        codes = recorded_exit_codes(args.output_dir)
        matmul = args.matmul_tflops
        if matmul is None and plan.device == "cuda":
            matmul = measure_matmul_tflops(args.python)
        report = write_report(plan, codes, matmul, probe)
        print(f"\nwrote {report} (and results.json, the figures) in {args.output_dir}")
    except (LaunchError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    ran = [args.only] if args.only else ([] if args.report_only else list(VARIANTS))
    return 0 if all(codes[v] == 0 for v in ran) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Measurement helpers shared by the benchmark scripts (CUDA only).

Every speed figure is a ratio against floors measured in the same run: `matmul_tflops()` (a
large bf16 matmul) and `copy_tbps()` (a device-to-device copy, bytes read plus written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

MATMUL_N = 8192
COPY_BYTES = 4 << 30


# The epilog of every GPU benchmark's --help (require_cuda enforces it).
GPU_SCRIPT_EPILOG = ("--device cuda (the default) needs a CUDA GPU: without one it exits with "
                     "status 2 before writing anything;\n--device cpu --tiny is a CPU smoke run "
                     "(seconds).")


def log(msg: str) -> None:
    print(msg, flush=True)


def time_ms(fn: Callable[[], object], *, reps: int = 3, warmup: int = 1) -> float:
    """Median milliseconds of `fn` over `reps` CUDA-event timings after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops(n: int = MATMUL_N, reps: int = 10) -> float:
    """Measured bf16 matmul rate in TFLOP/s (n x n x n, random data)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, reps=reps, warmup=3)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_tbps(nbytes: int = COPY_BYTES, reps: int = 10) -> float:
    """Measured device-to-device copy bandwidth in TB/s (bytes read + written)."""
    x = torch.empty(nbytes // 4, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), reps=reps, warmup=2)
    return 2 * nbytes / (ms * 1e-3) / 1e12


def parse_tiling(text: str) -> tuple[int, int]:
    """An argparse type: "16x2" -> (16, 2), keys per step x pipeline stages."""
    try:
        block_n, stages = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not keys x stages, e.g. 16x2") from None
    return block_n, stages


# Where benchmark records go: the repository's performance history (tracked, small JSON).
RESULTS_DIR_ENV = "HYSCALE_RESULTS"
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def results_dir() -> str:
    """$HYSCALE_RESULTS, else the checkout's benchmarks/results/ when this package runs from a
    source tree, else benchmarks/results/ under the current directory (an installed wheel has
    no checkout to write into)."""
    if os.environ.get(RESULTS_DIR_ENV):
        return os.environ[RESULTS_DIR_ENV]
    if os.path.isfile(os.path.join(_CHECKOUT, "pyproject.toml")):
        return os.path.join(_CHECKOUT, "benchmarks", "results")
    return os.path.join(os.getcwd(), "benchmarks", "results")


def commit() -> str:
    """The commit measured: $HYSCALE_COMMIT (set by the GPU session, whose copy of the tree
    has no .git), else `git rev-parse`, with '+dirty' for uncommitted changes."""
    if os.environ.get("HYSCALE_COMMIT"):
        return os.environ["HYSCALE_COMMIT"]
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
    head = run("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")


def _same_command(path: str, command: str) -> bool:
    """A record of the same command is updated in place (scripts save after every length)."""
    try:
        with open(path) as f:
            return json.load(f)["meta"]["command"] == command
    except (OSError, ValueError, KeyError):
        return False


def save_record(script: str, config: str, records: list[dict], *, matmul: float, copy: float,
                extra: dict | None = None) -> str:
    """Write `records` (one entry per method and length) with the run's meta to
    `results_dir()` (benchmarks/results/ by default) as <date>-<device>-<script>-<config>.json
    (another command's record of the same day gets a -2, -3 ... suffix); returns the path.
    matmul / copy: the TFLOP/s and TB/s measured in the same run."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    date = time.strftime("%Y-%m-%d")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device, "commit": commit(),
            "command": " ".join(shlex.quote(a) for a in sys.argv), "matmul_tflops": matmul,
            "copy_tbps": copy, "torch": torch.__version__, **(extra or {})}
    folder = results_dir()
    os.makedirs(folder, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", device.lower()).strip("-")
    path = os.path.join(folder, f"{date}-{slug}-{script}-{config}.json")
    run = 2
    while os.path.exists(path) and not _same_command(path, meta["command"]):
        path = os.path.join(folder, f"{date}-{slug}-{script}-{config}-{run}.json")
        run += 1
    with open(path, "w") as f:
        json.dump(_strict({"meta": meta, "records": records}), f, indent=1, default=str,
                  allow_nan=False)
    return path


def _strict(value: Any) -> Any:
    """`value` with every non-finite float as None: a rate or difference not measured (NaN on
    the CPU, a broken run) is JSON null, which every JSON reader parses, unlike NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def require_cuda(script_name: str, hint: str = "run it on the GPU machine") -> None:
    """Exit with status 2 and one line on stderr unless torch sees a CUDA device.

    GPU-only scripts call it at the top of main(), after parsing their arguments (so --help
    works anywhere) and before they build inputs or write any output. script_name names the
    script and, where only some modes need the GPU, the mode ("bench_layer.py --device cuda");
    hint says what to do instead. Under torchrun only rank 0 prints the line.
    """
    if torch.cuda.is_available():
        return
    if os.environ.get("RANK", "0") == "0":
        print(f"{script_name} needs a CUDA GPU (none is visible); {hint}", file=sys.stderr,
              flush=True)
    raise SystemExit(2)

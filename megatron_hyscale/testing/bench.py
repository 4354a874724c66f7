"""Measurement helpers shared by the benchmark scripts (CUDA only).

Every speed figure is a ratio against floors measured in the same run: `matmul_tflops()` (a
large bf16 matmul) and `copy_tbps()` (a device-to-device copy, bytes read plus written).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

MATMUL_N = 8192
COPY_BYTES = 4 << 30


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

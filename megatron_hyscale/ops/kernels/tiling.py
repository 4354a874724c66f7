"""Launching a Triton kernel with the first tiling that fits the device, remembered per key.

Tilings are (keys per step, pipeline stages) pairs, best first. One that fails to compile or
launch for lack of shared memory or registers (Triton's OutOfResources) is skipped and the
next one tried; the one that ran is cached under the caller's key (kernel, dtypes and the
constexprs that shape it), so later calls launch it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from triton.runtime.errors import OutOfResources


def launch_first_fitting(kernel: Any, grid: tuple, args: tuple, const: dict,
                         tilings: Sequence[tuple[int, int]], num_warps: int,
                         cache: dict[tuple, tuple[int, int]], key: tuple, what: str) -> None:
    """kernel[grid](*args, **const, BLOCK_N=, num_warps=, num_stages=) with cache[key] if known,
    else with the first of `tilings` that runs; RuntimeError naming `what` if none does."""
    if key in cache:
        block_n, stages = cache[key]
        kernel[grid](*args, **const, BLOCK_N=block_n, num_warps=num_warps, num_stages=stages)
        return
    errors = []
    for block_n, stages in tilings:
        try:
            kernel[grid](*args, **const, BLOCK_N=block_n, num_warps=num_warps,
                         num_stages=stages)
        except OutOfResources as exc:
            errors.append(f"{block_n}x{stages}: {exc}")
            continue
        cache[key] = (block_n, stages)
        return
    raise RuntimeError(f"no {what} tiling fits this device: " + "; ".join(errors))

"""Row chunks: the attention layers' per-row work in checkpointed parts (validation and the
settings they cannot run with).

A part is recomputed by `torch.utils.checkpoint` in backward. Megatron recomputes FP8 / FP4
layers through Transformer Engine's own checkpoint (a plain recompute would update the amax
history a second time and quantize with other scales), and skips recompute while capturing
CUDA graphs; delayed weight-gradient computation splits the backward the parts rely on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def check_row_chunk(value: object, name: str = "row_chunk") -> int | None:
    """A positive int or None (no parts)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


def row_chunk_conflict(config: Any) -> str | None:
    """The first setting of `config` that row chunks cannot run with, named; None if none."""
    if getattr(config, "fp8", None):
        return f"fp8={config.fp8!r}"
    if getattr(config, "fp4", None):
        return f"fp4={config.fp4!r}"
    if getattr(config, "enable_cuda_graph", False) or getattr(config, "external_cuda_graph",
                                                              False):
        return "CUDA graphs"
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none"):
        return f"cuda_graph_impl={config.cuda_graph_impl!r}"
    if getattr(config, "delay_wgrad_compute", False):
        return "delay_wgrad_compute=True"
    return None


def run_in_row_parts(rows_forward: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                     rows: int, chunk: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows_forward(r0, r1)` -> (the output of rows r0 .. r1 - 1, their detached loss) for each
    part of `chunk` rows, each under its own activation checkpoint (recomputed in backward);
    returns the outputs concatenated along `dim` and the losses summed."""
    outputs, losses = [], []
    for r0 in range(0, rows, chunk):
        output, loss = torch.utils.checkpoint.checkpoint(
            rows_forward, r0, min(rows, r0 + chunk), use_reentrant=False,
            preserve_rng_state=False)
        outputs.append(output)
        losses.append(loss)
    return torch.cat(outputs, dim=dim), torch.stack(losses).sum()

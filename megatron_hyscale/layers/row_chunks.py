"""Row chunks: the attention layers' per-row work in checkpointed parts (validation and the
settings they cannot run with).

A part is recomputed by `torch.utils.checkpoint` in backward. Megatron recomputes FP8 / FP4
layers through Transformer Engine's own checkpoint (a plain recompute would update the amax
history a second time and quantize with other scales), and skips recompute while capturing
CUDA graphs; delayed weight-gradient computation splits the backward the parts rely on.

Tensors every part reads (the whole sequence's keys, weights shared by all rows) receive their
gradient as one addend per part, and autograd adds addends in the tensor's dtype: with bf16
keys and 16 parts, 15 bf16 roundings of a growing sum instead of one. `run_in_row_parts` takes
them as `shared`, upcasts each once to fp32 (`ops.reference.fp32_accumulating`) and gives each
part a copy in the original dtype made inside the part's checkpoint, so the parts' addends are
summed in fp32 and the total is cast back once (the same rule as the chunked op references).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_hyscale.ops.reference import fp32_accumulating


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


def run_in_row_parts(rows_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                     rows: int, chunk: int, dim: int,
                     shared: Sequence[torch.Tensor | None] = ()
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows_forward(r0, r1, *shared)` -> (the output of rows r0 .. r1 - 1, their detached
    loss) for each part of `chunk` rows, each under its own activation checkpoint (recomputed
    in backward); returns the outputs concatenated along `dim` and the losses summed.

    `shared`: tensors (or None) every part reads whole; each part gets them in their own dtype,
    their gradient is summed over the parts in fp32 (see the module doc).
    """
    dtypes = [None if x is None else x.dtype for x in shared]
    wide = [fp32_accumulating(x) for x in shared]

    def part(r0: int, r1: int, *xs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The cast runs inside the checkpoint: the narrow copy is not kept between forward and
        # backward, and its backward hands the part's addend to the fp32 sum.
        narrow = [x if x is None else x.to(dtype) for x, dtype in zip(xs, dtypes, strict=True)]
        return rows_forward(r0, r1, *narrow)

    outputs, losses = [], []
    for r0 in range(0, rows, chunk):
        output, loss = torch.utils.checkpoint.checkpoint(
            part, r0, min(rows, r0 + chunk), *wide, use_reentrant=False,
            preserve_rng_state=False)
        outputs.append(output)
        losses.append(loss)
    return torch.cat(outputs, dim=dim), torch.stack(losses).sum()

"""Row chunks: the attention layers' per-row work in checkpointed parts (validation and the
settings they cannot run with).

A part is recomputed by `torch.utils.checkpoint` in backward. Megatron recomputes FP8 / FP4
layers through Transformer Engine's own checkpoint (a plain recompute would update the amax
history a second time and quantize with other scales), and skips recompute while capturing
CUDA graphs; delayed weight-gradient computation splits the backward the parts rely on.

Tensors every part reads (the whole sequence's keys, weights shared by all rows) receive their
gradient as one addend per part, and autograd adds addends in the tensor's dtype: with bf16
keys and 16 parts, 15 bf16 roundings of a growing sum instead of one. `run_in_row_parts` takes
them as `shared`: each part reads the tensor itself, and its gradient addend goes, as fp32, to
an fp32 stand-in (`_Anchor`: an expanded zero, no memory) where autograd sums the parts in
fp32; the stand-in's backward casts the total to the tensor's dtype once (the rule of the
chunked op references, `ops.reference._fp32_accumulating`). The cost is the fp32 sum and one
part's fp32 addend during backward, no fp32 copy of the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


class _Anchor(torch.autograd.Function):
    """An fp32 stand-in for x that the parts' gradient addends are summed into (in fp32);
    forward allocates nothing (an expanded zero), backward casts the total to x's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return x.new_zeros((), dtype=torch.float32).expand(x.shape)

    @staticmethod
    def backward(ctx: Any, total: torch.Tensor) -> torch.Tensor:
        return total.to(ctx.dtype)


class _ReadShared(torch.autograd.Function):
    """x itself, whose gradient goes to the anchor as an fp32 addend instead of to x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad.float()


def _anchor(x: torch.Tensor | None) -> torch.Tensor | None:
    """x's fp32 stand-in where autograd would sum its gradient in low precision, else None."""
    if x is None or not (torch.is_grad_enabled() and x.requires_grad):
        return None
    return _Anchor.apply(x) if x.dtype in (torch.bfloat16, torch.float16) else None


def run_in_row_parts(rows_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                     rows: int, chunk: int, dim: int,
                     shared: Sequence[torch.Tensor | None] = ()
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows_forward(r0, r1, *shared)` -> (the output of rows r0 .. r1 - 1, their detached
    loss) for each part of `chunk` rows, each under its own activation checkpoint (recomputed
    in backward); returns the outputs concatenated along `dim` and the losses summed.

    `shared`: tensors (or None) every part reads whole; each part gets them as they are, and
    their gradient is summed over the parts in fp32 (see the module doc).
    """
    anchors = [_anchor(x) for x in shared]
    n = len(anchors)

    def part(r0: int, r1: int, *xs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        reads = [x if a is None else _ReadShared.apply(x, a) for x, a in zip(xs[:n], xs[n:],
                                                                            strict=True)]
        return rows_forward(r0, r1, *reads)

    outputs, losses = [], []
    for r0 in range(0, rows, chunk):
        output, loss = torch.utils.checkpoint.checkpoint(
            part, r0, min(rows, r0 + chunk), *shared, *anchors, use_reentrant=False,
            preserve_rng_state=False)
        outputs.append(output)
        losses.append(loss)
    return torch.cat(outputs, dim=dim), torch.stack(losses).sum()

"""Packed THD test helpers: PackedSeqParams for documents, a training step of an attention layer
and the per-document reference (the layer on each document alone) it is compared with."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)


def cu_seqlens(lengths: Sequence[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]."""
    return [0, *torch.tensor(list(lengths)).cumsum(0).tolist()]


def thd_params(lengths: Sequence[int], padded: Sequence[int] | None = None,
               device: torch.device | str | None = None) -> PackedSeqParams:
    """megatron's PackedSeqParams of documents of `lengths` (and `padded` storage rows)."""
    cu = torch.tensor(cu_seqlens(lengths), dtype=torch.int32, device=device)
    extra = {}
    if padded is not None:
        pad = torch.tensor(cu_seqlens(padded), dtype=torch.int32, device=device)
        extra = dict(cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad)
    longest = max(padded or lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest, **extra)


class Step(NamedTuple):
    out: torch.Tensor  # [T, 1, h]
    x_grad: torch.Tensor
    grads: dict[str, torch.Tensor]
    logged: float  # the indexer loss in megatron's tracker (0 without one)


def train_step(layer: torch.nn.Module, call: Callable[[torch.Tensor], torch.Tensor],
               x: torch.Tensor, r: torch.Tensor, recompute: bool = False) -> Step:
    """call(x) (the layer's output) and the backward of sum(out * r), under megatron's
    checkpoint with `recompute`."""
    layer.train()
    layer.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    h = x.clone().requires_grad_()
    out = tensor_parallel.checkpoint(call, False, h) if recompute else call(h)
    (out * r).sum().backward()
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    logged = float(values.sum()) if values is not None else 0.0
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return Step(out.detach(), h.grad, grads, logged)


def joined(steps: Sequence[Step]) -> Step:
    """Documents' steps as one packed step: rows concatenated, gradients and losses summed."""
    grads: dict[str, torch.Tensor] = {}
    for step in steps:
        for name, grad in step.grads.items():
            grads[name] = grads[name] + grad if name in grads else grad
    return Step(torch.cat([s.out for s in steps]), torch.cat([s.x_grad for s in steps]), grads,
                sum(s.logged for s in steps))


def assert_steps_close(got: Step, want: Step, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got.out, want.out, rtol=rtol, atol=atol)
    torch.testing.assert_close(got.x_grad, want.x_grad, rtol=rtol, atol=atol)
    assert set(got.grads) == set(want.grads)
    for name in want.grads:
        torch.testing.assert_close(got.grads[name], want.grads[name], rtol=rtol, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert math.isclose(got.logged, want.logged, rel_tol=rtol, abs_tol=1e-7), \
        f"indexer loss {got.logged} != {want.logged}"

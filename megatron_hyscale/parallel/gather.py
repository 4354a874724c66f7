"""All-gather over the context-parallel group into global sequence order, with its backward.

Forward: every rank contributes its local [L, ...] tensor (zigzag chunks r and 2cp-1-r); the
result is the whole [cp * L, ...] sequence in global token order. Backward: each rank holds the
gradient of *its own* loss with respect to the whole sequence; the owners' gradient is the sum
over ranks, so the gradient is put back in rank-major order and reduce-scattered (sum) - the
same contract as megatron's `gather_from_sequence_parallel_region` (whose backward is a
reduce-scatter), plus the zigzag reorder folded in.

Both take an optional `order` (`layout.RowOrder`): the rows of a packed THD sequence, which
megatron splits per document (`layout.thd_split`), are put in global order by that index
instead of the zigzag chunk reorder.

The reduce-scatter adds one addend per rank. In bf16 / fp16 a ring of cp ranks rounds a growing
sum cp - 1 times (NCCL and gloo sum in the tensor's dtype); with more than 2 ranks the gradient
is reduce-scattered in fp32 and cast back once (the rule of the chunked references and row
parts). At cp = 2 one addition of two addends is rounded once either way, so it stays in the
tensor's dtype (no extra bytes on the measured CP 2 runs); above that the collective moves
twice the bytes of a bf16 one.

`start_all_gather_to_global` is the same all-gather started asynchronously: the caller keeps
computing (HyScaleDSAttention runs the indexer projections, gathers the indexer keys and runs
HyTopK, which need none of the main KV) and calls `.wait()` where it needs the result; the
backward is the same reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_hyscale.parallel.layout import RowOrder, global_to_rank_major, rank_major_to_global


def _to_global(gathered: torch.Tensor, size: int, order: RowOrder | None) -> torch.Tensor:
    if order is None:
        return rank_major_to_global(gathered, size, dim=0)
    return gathered.index_select(0, order.to_global)


def _to_rank_major(grad: torch.Tensor, size: int, order: RowOrder | None) -> torch.Tensor:
    if order is None:
        return global_to_rank_major(grad, size, dim=0).contiguous()
    return grad.index_select(0, order.to_rank_major)


def _reduce_scatter_to_owners(grad: torch.Tensor, group: dist.ProcessGroup,
                              order: RowOrder | None) -> torch.Tensor:
    size = dist.get_world_size(group)
    dtype = grad.dtype
    # More than two addends of low precision: sum them in fp32, round once (module doc).
    wide = size > 2 and dtype in (torch.bfloat16, torch.float16)
    grad = _to_rank_major(grad.float() if wide else grad, size, order)
    out = grad.new_empty((grad.size(0) // size, *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, grad, group=group)
    return out.to(dtype)


class _AllGatherToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup,
                order: RowOrder | None) -> torch.Tensor:
        ctx.group, ctx.order = group, order
        size = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return _to_global(out, size, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_to_owners(grad, ctx.group, ctx.order), None, None


def _check_local(x: torch.Tensor, group: dist.ProcessGroup, order: RowOrder | None,
                 what: str) -> None:
    if order is None and x.size(0) % 2 != 0:
        raise ValueError(f"{what}: local length {x.size(0)} must be even (two zigzag chunks "
                         "per rank)")
    if order is not None and order.to_global.numel() != dist.get_world_size(group) * x.size(0):
        raise ValueError(f"{what}: the order covers {order.to_global.numel()} rows, the "
                         f"gather gives {dist.get_world_size(group)} x {x.size(0)}")


def all_gather_to_global(x: torch.Tensor, group: dist.ProcessGroup | None,
                         order: RowOrder | None = None) -> torch.Tensor:
    """[L, ...] local shard -> [cp * L, ...] global order; gradients reduce to owners.

    Args:
        x: this rank's tokens along dim 0 (sequence-first, megatron's [s, b, ...] layout);
            L must be even (two zigzag chunks) when `order` is None.
        group: the context-parallel group; None or size 1 returns `x` unchanged.
        order: None for megatron's zigzag chunks; a packed THD sequence's
            `layout.thd_gather_order`.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    _check_local(x, group, order, "all_gather_to_global")
    return _AllGatherToGlobal.apply(x, group, order)


class _FinishGather(torch.autograd.Function):
    """Autograd node of an asynchronous all-gather: forward returns the (already gathered)
    rank-major buffer in global order; backward reduce-scatters like _AllGatherToGlobal."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gathered: torch.Tensor,
                group: dist.ProcessGroup, order: RowOrder | None) -> torch.Tensor:
        ctx.group, ctx.order = group, order
        return _to_global(gathered, dist.get_world_size(group), order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _reduce_scatter_to_owners(grad, ctx.group, ctx.order), None, None, None


class PendingGather:
    """An all-gather in flight (from start_all_gather_to_global); `wait()` gives the result."""

    def __init__(self, x: torch.Tensor, group: dist.ProcessGroup | None,
                 order: RowOrder | None = None) -> None:
        self.x, self.group, self.order, self.work, self.out = x, group, order, None, None
        if group is not None and dist.get_world_size(group) > 1:
            size = dist.get_world_size(group)
            self.out = x.new_empty((size * x.size(0), *x.shape[1:]))
            # The input is read by the collective while the caller computes on: keep it alive
            # and unchanged (it is this rank's key shard, which nothing writes).
            self.send = x.detach().contiguous()
            self.work = dist.all_gather_into_tensor(self.out, self.send, group=group,
                                                    async_op=True)

    def wait(self) -> torch.Tensor:
        """[cp * L, ...] in global order, differentiable in x (gradients reduce to owners)."""
        if self.work is None:
            return self.x
        self.work.wait()
        self.work = None
        return _FinishGather.apply(self.x, self.out, self.group, self.order)


def start_all_gather_to_global(x: torch.Tensor, group: dist.ProcessGroup | None,
                               order: RowOrder | None = None) -> PendingGather:
    """Start `all_gather_to_global(x, group, order)` asynchronously; see PendingGather.wait."""
    if group is not None and dist.get_world_size(group) > 1:
        _check_local(x, group, order, "start_all_gather_to_global")
    return PendingGather(x, group, order)

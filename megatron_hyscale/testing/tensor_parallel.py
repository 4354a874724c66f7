"""Tensor-parallel test helpers: a TP-1 layer's weights (or gradients) split the way megatron
splits the same layer's parameters over TP, and megatron's TP gradient reduction run on a bare
layer.

A parameter megatron shards over TP carries `tensor_model_parallel` and `partition_dim`;
`tp_shard` cuts the matching slice out of the TP-1 tensor by those marks (equal contiguous
parts, as megatron's column- and row-parallel linears own them: for QSA's gated `linear_qkv`
one whole KV group's rows a rank). Anything else is replicated and compared whole.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


def tp_shard(param: torch.Tensor, full: torch.Tensor, tp_size: int, tp_rank: int
             ) -> torch.Tensor:
    """TP rank `tp_rank`'s part of the TP-1 tensor `full` (a weight or its gradient), by
    megatron's marks on the TP-`tp_size` parameter `param`."""
    if getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
    return full


def load_tp_shards(module: torch.nn.Module, weights: dict[str, torch.Tensor], tp_size: int,
                   tp_rank: int) -> None:
    """Copy into `module` (built at TP `tp_size`) this rank's parts of TP-1 `weights`, keyed
    by parameter name."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(tp_shard(param, weights[name], tp_size, tp_rank))


def tp_shards(module: torch.nn.Module, full: dict[str, torch.Tensor], tp_size: int,
              tp_rank: int) -> dict[str, torch.Tensor]:
    """This rank's parts of the TP-1 tensors `full` (e.g. TP 1's gradients), by the marks on
    `module`'s parameters of the same names."""
    params = dict(module.named_parameters())
    return {name: tp_shard(params[name], t, tp_size, tp_rank) for name, t in full.items()}


def reduce_tp_grads(module: torch.nn.Module, config: Any, tp_group: Any) -> None:
    """megatron's TP reduction of the replicated parameters' gradients (`finalize_model_grads`'
    `_allreduce_non_tensor_model_parallel_grads`, run by the DDP training step) on a bare
    module's `.grad`: summed over TP for sequence-parallel or q/k-layernorm marks, averaged for
    `average_gradients_across_tp_domain`."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    # It reads a model chunk's ddp_config and walks its module's parameters.
    chunk = SimpleNamespace(ddp_config=DistributedDataParallelConfig(), module=module)
    _allreduce_non_tensor_model_parallel_grads([chunk], config, tp_group)

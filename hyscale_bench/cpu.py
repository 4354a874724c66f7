"""Run megatron-core on a CPU (tests, the demo, benchmarks): redirect its hard-coded CUDA calls.

megatron-core assumes CUDA in a handful of places: `torch.cuda.current_device()` as a device
argument, the CUDA RNG state get/set in `tensor_parallel.random` (the RNG tracker and
`model_parallel_cuda_manual_seed`), `torch.cuda.manual_seed` / `get_rng_state` inside
the tracker, and the context-parallel RoPE slice (`get_pos_emb_on_this_cp_rank` builds its index
in pinned memory and moves it with `.cuda()`). `megatron_on_cpu()` patches exactly those, for the
duration of a `with` block,
to their CPU equivalents; nothing is changed unless a caller enters it. `init_single_process()`
creates a one-rank gloo world and megatron's model-parallel groups (all of size 1).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import torch

from hyscale_bench.distributed import free_port


def _cpu_get_rng_state(device: object = "cuda", clone: bool = False,
                       graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: object = -1,
                       graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron's CP RoPE slice (chunks r and 2cp-1-r of 2cp) with a CPU index."""
    cp, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
    picked = chunks.index_select(seq_dim, torch.tensor([rank, 2 * cp - rank - 1]))
    return picked.reshape(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 1:])


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Patch megatron-core's hard-coded CUDA calls to CPU ones inside the block.

    Under it, a "CUDA" RNG fork in megatron is a fork of the CPU generator, and tensors
    megatron places on `torch.cuda.current_device()` land on the CPU.
    """
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )
    from megatron.core.tensor_parallel import random as mrandom

    with contextlib.ExitStack() as stack:
        for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
            if hasattr(module, "get_pos_emb_on_this_cp_rank"):  # imported by name there
                stack.enter_context(mock.patch.object(
                    module, "get_pos_emb_on_this_cp_rank", _cpu_pos_emb_on_this_cp_rank))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(torch.cuda, "get_rng_state", _cpu_get_rng_state))
        stack.enter_context(mock.patch.object(torch.cuda, "set_rng_state", _cpu_set_rng_state))
        stack.enter_context(mock.patch.object(torch.cuda, "manual_seed", torch.manual_seed))
        stack.enter_context(mock.patch.object(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state))
        stack.enter_context(mock.patch.object(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state))
        yield


def init_single_process(seed: int = 1234) -> None:
    """One-rank gloo world + megatron model-parallel groups of size 1 (idempotent).

    Call it inside `megatron_on_cpu()` when no GPU is used: it seeds megatron's RNG tracker.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend=backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)

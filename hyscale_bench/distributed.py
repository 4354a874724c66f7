"""megatron-core's process groups for benchmarks, checks and tests on one machine.

`init_model_parallel(cp)` (re)builds megatron's groups for context parallelism `cp` over the
current world (a torchrun job, or a test's spawned ranks); `free_port()` finds a rendezvous
port for a world started here.
"""

from __future__ import annotations

import socket
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_model_parallel(cp: int, seed: int = 1234) -> Any:
    """megatron's groups for TP 1, PP 1 and context parallelism `cp` over the current world (torn
    down first if they exist), its RNG tracker seeded; returns the CP group (None at 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(seed)
    return parallel_state.get_context_parallel_group() if cp > 1 else None

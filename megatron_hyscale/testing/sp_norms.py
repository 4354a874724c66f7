"""megatron's torch norms under sequence parallelism, for tests on CPU.

`WrappedTorchNorm` refuses `sequence_parallel=True` (TE's norms mark their weights so that
megatron all-reduces their gradients over TP; the torch ones do not). A norm computes the same
thing either way, so `torch_norms_accept_sequence_parallel()` builds them from a copy of the
config without SP and gives their parameters TE's mark: a test can then build a layer with
sequence parallelism from the local (torch) specs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any
from unittest import mock


@contextlib.contextmanager
def torch_norms_accept_sequence_parallel() -> Iterator[None]:
    """Inside the block, `WrappedTorchNorm` builds its norm as without SP, weights marked."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build_norm = WrappedTorchNorm.__new__

    def build_without_sp(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build_norm(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    with mock.patch.object(WrappedTorchNorm, "__new__", build_without_sp):
        yield

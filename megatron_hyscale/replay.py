"""Selection replay: the recompute pass reuses the indices its first forward selected.

Under megatron's activation recompute (full or selective `core_attn`) a layer's forward runs
twice: once inside `tensor_parallel.checkpoint` (no graph kept) and again in backward. The
first run records its top-k indices here; the recompute pops them instead of scanning the
indexer again, so the scan runs once per layer per micro-batch and the recomputed forward is
bit-identical to the first. Each layer owns a FIFO: with several micro-batches in flight
(pipeline schedules) recompute consumes them in the order they were recorded.

Phases, read from megatron's own state:
- "record": inside a checkpointed forward (`is_checkpointing()`) outside backward;
- "replay": inside backward (`torch._C._current_graph_task_id() != -1`) while checkpointing;
- "off": anything else (no recompute: nothing is stored).
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

# A layer holding more unconsumed entries than this is leaking (forwards never followed by a
# backward, e.g. a no_grad forward under recompute): fail loudly rather than grow forever.
MAX_PENDING_PER_LAYER = 64

_stats = {"selections_computed": 0, "selections_replayed": 0}
_stores: weakref.WeakSet[SelectionReplay] = weakref.WeakSet()


class ReplayError(RuntimeError):
    """Misuse of selection replay: nothing recorded, a changed shape, or leftover entries."""


def current_phase() -> str:
    """'record', 'replay' or 'off' for the code running now (see module docstring)."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    if not is_checkpointing():
        return "off"
    return "replay" if torch._C._current_graph_task_id() != -1 else "record"


def get_stats() -> dict[str, int]:
    """Counts since the last reset: `selections_computed`, `selections_replayed`."""
    return dict(_stats)


def reset_stats() -> None:
    for key in _stats:
        _stats[key] = 0


def count_computed() -> None:
    _stats["selections_computed"] += 1


def pending_entries() -> int:
    """Entries recorded and not yet replayed, over every live store."""
    return sum(len(s) for s in _stores)


def assert_drained() -> None:
    """Raise ReplayError if any recorded selection was never replayed (call after a step)."""
    leftovers = [(s.name, len(s)) for s in _stores if len(s)]
    if leftovers:
        raise ReplayError(
            f"selection replay: entries recorded but never replayed at the end of the step: "
            f"{leftovers}. A checkpointed forward ran without its backward; call "
            "megatron_hyscale.replay.clear() after forward-only passes under recompute."
        )


def clear() -> None:
    """Drop every pending entry (after a forward-only pass that ran under recompute)."""
    for store in _stores:
        store.queue.clear()


@dataclass(eq=False)
class SelectionReplay:
    """FIFO of one layer's recorded selections (indices, and the tensors the loss reuses)."""

    name: str
    queue: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        _stores.add(self)

    def __len__(self) -> int:
        return len(self.queue)

    def record(self, indices: torch.Tensor) -> None:
        if len(self.queue) >= MAX_PENDING_PER_LAYER:
            raise ReplayError(
                f"{self.name}: {len(self.queue)} selections recorded and none replayed; "
                "checkpointed forwards are not followed by their backward"
            )
        self.queue.append(indices)

    def replay(self, expected_shape: tuple[int, ...]) -> torch.Tensor:
        if not self.queue:
            raise ReplayError(
                f"{self.name}: recompute asked for a recorded selection but none was recorded "
                "(the first forward did not run under checkpointing?)"
            )
        indices = self.queue.popleft()
        if tuple(indices.shape) != tuple(expected_shape):
            raise ReplayError(
                f"{self.name}: recorded selection has shape {tuple(indices.shape)} but the "
                f"recompute expects {tuple(expected_shape)}"
            )
        _stats["selections_replayed"] += 1
        return indices

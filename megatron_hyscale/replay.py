"""Selection replay: the recompute pass reuses the indices its first forward selected.

Under megatron's activation recompute (full or selective `core_attn`) a layer's forward runs
twice: once inside `tensor_parallel.checkpoint` (no graph kept) and again in backward. The
first run records its top-k indices here; the recompute pops them instead of scanning the
indexer again, so the scan runs once per layer per micro-batch and the recomputed forward is
bit-identical to the first. Each layer owns a FIFO: with several micro-batches in flight
(pipeline schedules) recompute consumes them in the order they were recorded.

Phases, read from megatron's own state:
- "record": inside a checkpointed forward (`is_checkpointing()`, grad off as megatron's
  `CheckpointFunction` runs it) outside backward;
- "replay": inside backward (`torch._C._current_graph_task_id() != -1`) while checkpointing;
- "off": anything else (no recompute: nothing is stored), also a grad-enabled forward while
  megatron's flag is left set by a checkpointed function that raised.

The protocol every HyScale layer follows is `SelectionReplay.select(shape, compute)`: in the
replay phase it pops the layer's oldest recorded selection (which must have `shape`); otherwise
it calls `compute()` (timed as the layer's selection phase, `phase_spans`), counts the
selection as computed and, in the record phase, records it.
`replaying()` tells a layer beforehand whether it may skip the indexer's forward. What travels
with a selection (the DSA layer's selected scores' log-sum-exp) travels in the same entry:
`compute` returns the pair (indices, companion) and `select` returns the pair, recorded,
offloaded and replayed together, so the two cannot get out of step.
A store made with `replays=False` belongs to a baseline selection that, like the stock layers,
selects again in the recompute: its phase is always "off".

`configure(offload=True)` keeps the recorded indices (and companions) in pinned host memory
between a forward and its recompute (int32 T x k per layer: 8 GiB at 1M tokens and k = 2048):
the device-to-host copies run on a side stream, and each replay starts the host-to-device
copies of the entry most recently recorded, which is the next one the usual recompute order
(layers in reverse) asks for.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_hyscale import phase_spans

# A layer holding more unconsumed entries than this is leaking (forwards never followed by a
# backward, e.g. a no_grad forward under recompute): fail loudly rather than grow forever.
MAX_PENDING_PER_LAYER = 64

_stats = {"selections_computed": 0, "selections_replayed": 0, "selections_offloaded": 0}
_config = {"offload": False}
_stores: weakref.WeakSet[SelectionReplay] = weakref.WeakSet()


class ReplayError(RuntimeError):
    """Misuse of selection replay: nothing recorded, a changed shape, or leftover entries."""


def current_phase() -> str:
    """'record', 'replay' or 'off' for the code running now (see module docstring)."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    if not is_checkpointing():
        return "off"
    if torch._C._current_graph_task_id() != -1:
        return "replay"
    # megatron's CheckpointFunction runs its forward under no_grad; a forward with grad on while
    # the flag is set is no checkpointed one: the flag is stale (megatron leaves it set when a
    # checkpointed function raised), and recording would strand entries no backward replays.
    return "off" if torch.is_grad_enabled() else "record"


def get_stats() -> dict[str, int]:
    """Counts since the last reset: `selections_computed`, `selections_replayed`,
    `selections_offloaded` (a pair counts once)."""
    return dict(_stats)


def reset_stats() -> None:
    for key in _stats:
        _stats[key] = 0


def configure(*, offload: bool | None = None) -> None:
    """Set replay options; `offload`: keep recorded selections (indices and companions) in
    (pinned) host memory."""
    if offload is not None:
        if not isinstance(offload, bool):
            raise ValueError(f"offload must be a bool, got {offload!r}")
        _config["offload"] = offload


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
    _offloaded.clear()


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}
# Offloaded entries not yet replayed, in record order (the prefetch takes the newest).
_offloaded: list[_Entry] = []
# One host copy per recorded tensor (index-sharing layers record the source layer's tensor):
# id -> (weak reference to the device tensor, host copy, its copy event).
_host_copies: dict[int, tuple[weakref.ref, torch.Tensor, object]] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return _copy_streams[device]


class _Copy:
    """One recorded tensor: on its device, or in host memory with its copy events."""

    __slots__ = ("tensor", "device", "host", "host_ready", "back", "back_ready")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.device = tensor.device
        self.host = self.host_ready = self.back = self.back_ready = None

    @property
    def shape(self) -> tuple[int, ...]:
        t = self.tensor if self.tensor is not None else self.host
        return tuple(t.shape)

    def offload(self) -> None:
        tensor = self.tensor
        cached = _host_copies.get(id(tensor))
        if cached is not None and cached[0]() is tensor:
            _, self.host, self.host_ready = cached
        elif tensor.is_cuda:
            stream = _copy_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(tensor, non_blocking=True)
                self.host_ready = torch.cuda.Event()
                self.host_ready.record(stream)
            tensor.record_stream(stream)  # keep its memory until the copy is done
        else:
            self.host = tensor.clone()
        for key in [k for k, (ref, _, _) in _host_copies.items() if ref() is None]:
            del _host_copies[key]
        _host_copies[id(tensor)] = (weakref.ref(tensor), self.host, self.host_ready)
        self.tensor = None

    def prefetch(self) -> None:
        """Start the copy back to the device (no-op if already started)."""
        if self.back is not None or self.tensor is not None:
            return
        if self.device.type != "cuda":
            self.back = self.host.clone()
            return
        current = torch.cuda.current_stream(self.device)
        stream = _copy_stream(self.device)
        self.back = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        stream.wait_stream(current)  # the allocation above belongs to the current stream
        with torch.cuda.stream(stream):
            stream.wait_event(self.host_ready)
            self.back.copy_(self.host, non_blocking=True)
            self.back_ready = torch.cuda.Event()
            self.back_ready.record(stream)
        self.back.record_stream(stream)

    def take(self) -> torch.Tensor:
        """The tensor on its device, ready for the current stream."""
        if self.tensor is not None:
            return self.tensor
        self.prefetch()
        if self.back_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.back_ready)
        return self.back


# What `compute` returns and `select` gives back: int32 indices, or the pair (indices,
# companion) of a selection that carries a tensor of its own.
Selected = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class _Entry:
    """A recorded selection: its indices and, where it has one, its companion tensor."""

    __slots__ = ("copies", "paired", "offloaded")

    def __init__(self, selected: Selected) -> None:
        self.paired = isinstance(selected, tuple)
        self.copies = [_Copy(t) for t in (selected if self.paired else (selected,))]
        self.offloaded = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The indices' shape."""
        return self.copies[0].shape

    def offload(self) -> None:
        for copy in self.copies:
            copy.offload()
        self.offloaded = True
        _offloaded.append(self)
        _stats["selections_offloaded"] += 1

    def prefetch(self) -> None:
        for copy in self.copies:
            copy.prefetch()

    def take(self) -> Selected:
        """The recorded selection on its device, in the form it was recorded."""
        if self.offloaded:
            _offloaded.remove(self)
            self.offloaded = False
        tensors = tuple(copy.take() for copy in self.copies)
        return tensors if self.paired else tensors[0]


@dataclass(eq=False)
class SelectionReplay:
    """One layer's selection protocol and the FIFO of its recorded selections (int32 indices,
    or pairs (indices, companion)).

    `replays=False`: the layer's selection is a baseline that selects again in the recompute
    (nothing is recorded; every selection counts as computed).
    """

    name: str
    replays: bool = True
    queue: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        _stores.add(self)

    def __len__(self) -> int:
        return len(self.queue)

    def phase(self) -> str:
        """'record', 'replay' or 'off' for this layer now ('off' when it does not replay)."""
        return current_phase() if self.replays else "off"

    def replaying(self) -> bool:
        """True when `select` will replay: the layer needs no indexer output for it."""
        return self.phase() == "replay"

    def select(self, shape: tuple[int, ...], compute: Callable[[], Selected], *,
               shared: bool = False) -> Selected:
        """The layer's selection of this forward, of `shape`: replayed, or computed (counted,
        and recorded when a recompute will follow).

        `compute` returns the int32 indices, or the pair (indices, companion) where something
        travels with them (the DSA layer's selected scores' log-sum-exp); `select` returns the
        same form, the pair recorded and replayed as one entry. `shape` is the indices'.
        `shared=True`: `compute` returns a selection another layer made (DSA index sharing);
        it is recorded and replayed like any, but not counted as computed.
        """
        phase = self.phase()
        if phase == "replay":
            return self.replay(shape)
        if shared:
            selected = compute()
        else:
            with phase_spans.span(phase_spans.SELECTION):  # every layer's selection phase
                selected = compute()
        if isinstance(selected, tuple) and not (
                len(selected) == 2 and all(isinstance(t, torch.Tensor) for t in selected)):
            raise ReplayError(f"{self.name}: a selection is int32 indices or the pair (indices, "
                              f"companion) of tensors, got a tuple of {len(selected)}: "
                              f"{[type(t).__name__ for t in selected]}")
        indices = selected[0] if isinstance(selected, tuple) else selected
        if tuple(indices.shape) != tuple(shape):
            raise ReplayError(f"{self.name}: the selection has shape {tuple(indices.shape)}, "
                              f"expected {tuple(shape)}")
        if not shared:
            _stats["selections_computed"] += 1
        if phase == "record":
            self.record(selected)
        return selected

    def record(self, selected: Selected) -> None:
        """Keep `selected` (indices, or the pair (indices, companion)) for the recompute."""
        if len(self.queue) >= MAX_PENDING_PER_LAYER:
            raise ReplayError(
                f"{self.name}: {len(self.queue)} selections recorded and none replayed; "
                "checkpointed forwards are not followed by their backward"
            )
        entry = _Entry(selected)
        if _config["offload"]:
            entry.offload()
        self.queue.append(entry)

    def replay(self, expected_shape: tuple[int, ...]) -> Selected:
        """The oldest recorded selection, in the form it was recorded; its indices must have
        `expected_shape`."""
        if not self.queue:
            raise ReplayError(
                f"{self.name}: recompute asked for a recorded selection but none was recorded "
                "(the first forward did not run under checkpointing?)"
            )
        entry = self.queue.popleft()
        if entry.shape != tuple(expected_shape):
            if entry.offloaded:  # dropped: no later replay may prefetch it
                _offloaded.remove(entry)
            raise ReplayError(
                f"{self.name}: recorded selection has shape {entry.shape} but the "
                f"recompute expects {tuple(expected_shape)}"
            )
        selected = entry.take()
        if _offloaded:
            _offloaded[-1].prefetch()  # the next recompute, in the usual reverse order
        _stats["selections_replayed"] += 1
        return selected

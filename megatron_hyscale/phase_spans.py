"""Phase spans: where HyScale's layers mark their selection, attention, indexer loss and exposed
communication, for `megatron_hyscale.phase_times`.

The layers name their spans in their own code, so a renamed import cannot turn the timing off:
- `span(phase)`: a context manager around a forward-only region (no gradient flows through
  it); `replay.SelectionReplay.select` puts the selection of every layer in one;
- `timed(phase, fn)`: `fn` with its forward and, for inputs that require gradients, its
  backward timed; a layer binds the ops it calls this way once, at import;
- `timed_start(phase, start)`: a function that starts an asynchronous collective (a
  `parallel.gather.PendingGather`): only the result's `.wait()` and the gradient's way back
  are timed, since the caller computes while it transfers.

Nothing is timed until a recorder is installed (`phase_times.enable_from_env`, with
HYSCALE_PHASE_TIMES=1): until then `span` returns one shared no-op context manager and the
timed functions call straight through, at the cost of one global read.
This module imports only the standard library, so any layer (and the log parser) may use it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

SELECTION = "selection"
ATTENTION = "attention"
INDEXER_LOSS = "indexer_loss"
COMMUNICATION = "communication"
PHASES = (SELECTION, ATTENTION, INDEXER_LOSS, COMMUNICATION)


class Recorder(Protocol):
    """What `phase_times.PhaseTimer` provides to time the spans."""

    def region(self, phase: str) -> AbstractContextManager[None]: ...

    def call(self, phase: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...

    def start(self, phase: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...


_recorder: Recorder | None = None
_NO_SPAN = contextlib.nullcontext()


def install(recorder: Recorder) -> None:
    """Time every span from now on with `recorder` (replaces any installed one)."""
    global _recorder
    _recorder = recorder


def uninstall(recorder: Recorder | None = None) -> None:
    """Stop timing (only if `recorder`, when given, is the installed one)."""
    global _recorder
    if recorder is None or _recorder is recorder:
        _recorder = None


def installed() -> Recorder | None:
    """The recorder timing the spans now, or None."""
    return _recorder


def check_phase(phase: str) -> str:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return phase


def span(phase: str) -> AbstractContextManager[None]:
    """A forward-only region of `phase` (a shared no-op when nothing records)."""
    recorder = _recorder
    return _NO_SPAN if recorder is None else recorder.region(phase)


def timed(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, its forward (and backward) counted as `phase` whenever a recorder is installed."""
    check_phase(phase)

    @functools.wraps(fn)
    def timed_fn(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None:
            return fn(*args, **kwargs)
        return recorder.call(phase, fn, args, kwargs)

    timed_fn.phase = phase
    return timed_fn


def timed_start(phase: str, start: Callable[..., Any]) -> Callable[..., Any]:
    """`start` (returns an object with `.wait()`), the wait and the backward timed as `phase`."""
    check_phase(phase)

    @functools.wraps(start)
    def timed_start_fn(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None:
            return start(*args, **kwargs)
        return recorder.start(phase, start, args, kwargs)

    timed_start_fn.phase = phase
    return timed_start_fn

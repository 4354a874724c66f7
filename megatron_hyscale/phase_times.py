"""Per-iteration time of a DSA model's attention phases: selection, sparse attention, indexer
loss and exposed communication, for HyScale's layers and for stock megatron-core's.

Enabled by HYSCALE_PHASE_TIMES=1 in a Megatron-LM run that uses HyScale's `--spec` entry points
(`hyscale_dsa_layer_spec` or `stock_dsa_layer_spec`, `hyscale_qsa_layer_spec` or
`baseline_qsa_layer_spec`; `examples/glm5_1/launch.py side-by-side` sets it), or by
`enable_from_env` itself. HyScale's layers (DSA, DeepSeek-V4, QSA) mark their phases
themselves with `megatron_hyscale.phase_spans`, which this module's timer records once
installed; stock megatron-core cannot be changed, so the functions that make up its phases are
wrapped where its layers look them up (a module attribute):

  phase          HyScale's layers (phase_spans)          stock (megatron-core's dsa module)
  selection      SelectionReplay.select's compute (HyTopK fused_qk_topk_naive, the fused
                 or a baseline selector; a replay is     backends' run_fused_qk_topk and
                 not a selection)                        run_fused_qk_topk_with_loss (with
                                                         its indexer loss), cuDNN's
                                                         _indexer_topk_bshd
  attention      sparse_attention                        _run_sparse_attention, TileLang's
                                                         run_fused_absorbed_sparse_attention,
                                                         cuDNN's _run_sparse_attention_forward
                                                         and _run_sparse_attention_backward
  indexer_loss   indexer_kl_loss                         compute_dsa_indexer_loss,
                                                         bwd_fused_indexer_loss_naive, cuDNN's
                                                         _compute_{sparse,dense}_indexer_loss
                                                         _and_grads

The cudnn backend runs its three phases inside one fused autograd function
(`run_fused_dsa_attention`), so its pieces are timed, not that call.
  communication  the wait of start_all_gather_to_global, gather_from_sequence_parallel_region
                 all_gather_to_global (V4, QSA indexer)

Each call's forward is timed between two CUDA events on the current stream (perf_counter on
the CPU); for a call whose tensor inputs require gradients, identity autograd nodes around it
time its backward too (from its outputs' gradients arriving to its inputs' gradients leaving).
Times are inclusive and on the compute stream: communication is what the stream waits for,
not the NCCL kernels' own time (HyScale starts its K / V gather before HyTopK and times only
the wait after it; stock's gather blocks). A call nested in another timed call or region
counts once, for the outer phase. The identity marks return views of their tensors: a target
that modified a marked input in place would make autograd refuse it (none of these does).

Megatron-LM's `train_step` is wrapped to close a step: after each one, every rank synchronizes
and prints one line per step to its log,

    [hyscale phases] rank 0 step 3: selection 812.4 ms (8), attention 301.2 ms (16), ...

(ms, then the number of timed spans), which `launch.logparse.phase_times` reads back.
Every rank prints its own line; the summary takes the slowest rank per step.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_hyscale import phase_spans
from megatron_hyscale.launch.logparse import PHASE_LINE_PREFIX as LINE_PREFIX
from megatron_hyscale.launch.logparse import PHASE_TIMES_ENV as ENV
from megatron_hyscale.phase_spans import PHASES

_STOCK_DSA = "megatron.core.transformer.experimental_attention_variant.dsa"
_STOCK_KERNELS = "megatron.core.transformer.experimental_attention_variant.dsa_kernels"
_STOCK_CUDNN = "megatron.core.transformer.experimental_attention_variant.dsa_cudnn_kernels"
# Functions wrapped by name, per variant: (module, attribute, phase, kind); kind "call" times a
# function, "pending" a started gather whose .wait() ends the span. Missing attributes are
# skipped (megatron versions differ). HyScale's layers need none: they mark their own spans
# (`phase_spans`), so "hyscale" installs the timer there instead.
TARGETS: dict[str, tuple[tuple[str, str, str, str], ...]] = {
    "hyscale": (),
    "stock": (
        (_STOCK_DSA, "fused_qk_topk_naive", "selection", "call"),
        (_STOCK_KERNELS, "run_fused_qk_topk", "selection", "call"),
        # TileLang's fused selection + indexer loss: counted as selection (one kernel chain)
        (_STOCK_KERNELS, "run_fused_qk_topk_with_loss", "selection", "call"),
        (_STOCK_DSA, "_run_sparse_attention", "attention", "call"),
        (_STOCK_KERNELS, "run_fused_absorbed_sparse_attention", "attention", "call"),
        # cuDNN's fused DSA function, piece by piece (called by name from its forward and
        # backward; with gradients off there, so nothing is marked twice)
        (_STOCK_CUDNN, "_indexer_topk_bshd", "selection", "call"),
        (_STOCK_CUDNN, "_run_sparse_attention_forward", "attention", "call"),
        (_STOCK_CUDNN, "_run_sparse_attention_backward", "attention", "call"),
        (_STOCK_CUDNN, "_compute_sparse_indexer_loss_and_grads", "indexer_loss", "call"),
        (_STOCK_CUDNN, "_compute_dense_indexer_loss_and_grads", "indexer_loss", "call"),
        (_STOCK_DSA, "compute_dsa_indexer_loss", "indexer_loss", "call"),
        (_STOCK_DSA, "bwd_fused_indexer_loss_naive", "indexer_loss", "call"),
        (_STOCK_DSA, "gather_from_sequence_parallel_region", "communication", "call"),
    ),
}


class _Clock:
    """A point on the compute stream: a recorded CUDA event, or perf_counter on the CPU."""

    def __init__(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event: Any = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.event = time.perf_counter()

    def ms_until(self, end: _Clock) -> float:
        if isinstance(self.event, float):
            return (end.event - self.event) * 1e3
        return self.event.elapsed_time(end.event)


class _Span:
    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.start: _Clock | None = None
        self.end: _Clock | None = None

    def open(self) -> None:
        self.start = _Clock()

    def close(self) -> None:
        self.end = _Clock()


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward calls `hook` (when the gradients reach this point)."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


def _mark(tensors: list[torch.Tensor], hook: Callable[[], None]) -> list[torch.Tensor]:
    return list(_BackwardMark.apply(hook, *tensors))


def _grad_positions(args: tuple, kwargs: dict) -> tuple[list[int], list[str]]:
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    keys = [k for k, a in kwargs.items() if isinstance(a, torch.Tensor) and a.requires_grad]
    return pos, keys


class _TimedPending:
    """A started gather whose wait() is timed: only the wait, since the work between start and
    wait (HyTopK) is not waiting; its output marked for the backward span."""

    def __init__(self, pending: Any, timer: PhaseTimer, phase: str, back: _Span | None) -> None:
        self._pending, self._timer, self._phase, self._back = pending, timer, phase, back

    def wait(self) -> Any:
        span = _Span(self._phase)
        self._timer.spans.append(span)
        span.open()
        out = self._pending.wait()
        span.close()
        return self._timer._mark_outputs(out, self._back)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pending, name)


class PhaseTimer:
    """Records HyScale's phase spans and wraps stock's target functions; collects the spans
    per step (see the module doc). Implements `phase_spans.Recorder`."""

    def __init__(self) -> None:
        self.spans: list[_Span] = []
        self.depth = 0
        self.step = 0
        self._saved: list[tuple[Any, str, Any]] = []

    # -- installation ---------------------------------------------------------------------
    def install(self, variant: str,
                targets: tuple[tuple[str, str, str, str], ...] | None = None) -> list[str]:
        """Time `variant`: hyscale installs this timer as `phase_spans`' recorder, and the
        variant's targets (or the given (module, attribute, phase, kind) targets) are wrapped;
        returns 'module.attribute' of each function wrapped."""
        if variant not in TARGETS:
            raise ValueError(f"variant must be one of {sorted(TARGETS)}, got {variant!r}")
        if targets is None:
            targets = TARGETS[variant]
        for _, _, phase, _ in targets:
            phase_spans.check_phase(phase)
        if variant == "hyscale":
            phase_spans.install(self)
        done = []
        for module_name, attr, phase, kind in targets:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            fn = getattr(module, attr, None)
            if fn is None or getattr(fn, "_hyscale_phase", None):
                continue
            wrapped = self._wrap_pending(fn, phase) if kind == "pending" else self._wrap(fn, phase)
            wrapped._hyscale_phase = phase
            self._saved.append((module, attr, fn))
            setattr(module, attr, wrapped)
            done.append(f"{module_name}.{attr}")
        return done

    def uninstall(self) -> None:
        phase_spans.uninstall(self)
        for module, attr, fn in reversed(self._saved):
            setattr(module, attr, fn)
        self._saved.clear()

    # -- phase_spans.Recorder -------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, phase: str) -> Iterator[None]:
        """A forward-only span (nothing of it runs in backward)."""
        phase_spans.check_phase(phase)
        if self.depth:
            yield
            return
        span = _Span(phase)
        self.spans.append(span)
        self.depth += 1
        try:
            span.open()
            yield
            span.close()
        finally:
            self.depth -= 1

    def call(self, phase: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """fn(*args, **kwargs), its forward and backward timed as `phase`."""
        if self.depth:
            return fn(*args, **kwargs)
        args, kwargs, back = self._backward_span(phase, args, kwargs)
        with self.region(phase):
            out = fn(*args, **kwargs)
        return self._mark_outputs(out, back)

    def start(self, phase: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """fn(*args, **kwargs) starts a collective: its wait() and backward timed as `phase`."""
        args, kwargs, back = self._backward_span(phase, args, kwargs)
        return _TimedPending(fn(*args, **kwargs), self, phase, back)

    # -- wrappers -------------------------------------------------------------------------
    def _backward_span(self, phase: str, args: tuple, kwargs: dict
                       ) -> tuple[tuple, dict, _Span | None]:
        """Mark the inputs that require grad: their gradients leaving closes the backward."""
        if not torch.is_grad_enabled():
            return args, kwargs, None
        pos, keys = _grad_positions(args, kwargs)
        if not pos and not keys:
            return args, kwargs, None
        span = _Span(phase)
        marked = _mark([args[i] for i in pos] + [kwargs[k] for k in keys], span.close)
        args = tuple(marked[pos.index(i)] if i in pos else a for i, a in enumerate(args))
        kwargs = {k: (marked[len(pos) + keys.index(k)] if k in keys else a)
                  for k, a in kwargs.items()}
        self.spans.append(span)
        return args, kwargs, span

    @staticmethod
    def _mark_outputs(out: Any, span: _Span | None) -> Any:
        """Mark the outputs that require grad: their gradients arriving opens the backward."""
        if span is None:
            return out
        items = list(out) if isinstance(out, (tuple, list)) else [out]
        idx = [i for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            span.start = span.end = None  # nothing flows back through this call
            return out
        marked = _mark([items[i] for i in idx], span.open)
        for j, i in enumerate(idx):
            items[i] = marked[j]
        if isinstance(out, tuple):
            return type(out)(items) if not hasattr(out, "_fields") else type(out)(*items)
        return items if isinstance(out, list) else items[0]

    def _wrap(self, fn: Callable, phase: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            return self.call(phase, fn, args, kwargs)

        return timed

    def _wrap_pending(self, fn: Callable, phase: str) -> Callable:
        @functools.wraps(fn)
        def started(*args: Any, **kwargs: Any) -> Any:
            return self.start(phase, fn, args, kwargs)

        return started

    # -- steps ----------------------------------------------------------------------------
    def end_step(self) -> dict[str, tuple[float, int]]:
        """Close the step: synchronize, sum each phase's finished spans (ms, count), reset."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        totals = {p: (0.0, 0) for p in PHASES}
        for s in self.spans:
            if s.start is not None and s.end is not None:
                ms, n = totals[s.phase]
                totals[s.phase] = (ms + s.start.ms_until(s.end), n + 1)
        self.spans = [s for s in self.spans if s.start is not None and s.end is None]
        self.step += 1
        return totals

    def log_step(self, rank: int) -> str:
        totals = self.end_step()
        items = ", ".join(f"{p} {ms:.1f} ms ({n})" for p, (ms, n) in totals.items())
        line = f"{LINE_PREFIX} rank {rank} step {self.step}: {items}"
        print(line, flush=True)
        return line


_TIMER: PhaseTimer | None = None


def enable_from_env(variant: str) -> PhaseTimer | None:
    """With HYSCALE_PHASE_TIMES=1: time `variant` (hyscale: HyScale's layers' phase spans;
    stock: megatron-core's functions, wrapped once a process) and wrap Megatron-LM's
    train_step, so each step prints its line. Returns the timer, or None when off."""
    global _TIMER
    if os.environ.get(ENV, "") not in ("1", "true", "yes"):
        return None
    if _TIMER is None:
        _TIMER = PhaseTimer()
        _wrap_train_step(_TIMER)
    _TIMER.install(variant)
    return _TIMER


def disable() -> None:
    """Undo enable_from_env: put every wrapped function back, train_step included."""
    global _TIMER
    if _TIMER is not None:
        _TIMER.uninstall()
        _TIMER = None


def _wrap_train_step(timer: PhaseTimer) -> bool:
    """Close a step after Megatron-LM's train_step (training.py looks it up at call time)."""
    try:
        training = importlib.import_module("megatron.training.training")
    except Exception:  # not a Megatron-LM run (megatron-core alone)
        return False
    step = getattr(training, "train_step", None)
    if step is None or getattr(step, "_hyscale_phase", None):
        return False

    @functools.wraps(step)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        timer.spans.clear()  # spans from outside a step (evaluation) are not this step's
        out = step(*args, **kwargs)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        timer.log_step(rank)
        return out

    train_step._hyscale_phase = "step"
    timer._saved.append((training, "train_step", step))  # uninstall() puts it back
    training.train_step = train_step
    return True

"""megatron_hyscale.phase_times: per-phase spans (forward and backward), steps, the log line;
megatron_hyscale.phase_spans, the spans HyScale's layers mark themselves (free when off), and
the rule that nothing of HyScale's is timed by patching a name."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

import megatron_hyscale.layers.deepseek_v4 as v4_layers
import megatron_hyscale.layers.dsa as dsa_layers
import megatron_hyscale.layers.qsa as qsa_layers
from megatron_hyscale import phase_spans, phase_times, replay
from megatron_hyscale.launch.logparse import parse_phase_line as parse_line
from megatron_hyscale.phase_times import PhaseTimer

SLEEP = 0.02


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * SLEEP)
        return g * 2


@pytest.fixture
def fake_module():
    mod = types.ModuleType("hyscale_fake_ops")

    def select(x):
        time.sleep(SLEEP)
        return x.argmax(-1)

    def attend(q, *, scale=1.0):
        time.sleep(SLEEP)
        return _SlowBackward.apply(q) * scale, mod.select(q)  # nested: counts once

    class _Pending:
        def __init__(self, t):
            self.t = t

        def wait(self):
            time.sleep(SLEEP)
            return self.t * 1

    def gather(t):
        return _Pending(t)

    mod.select, mod.attend, mod.gather = select, attend, gather
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


TARGETS = (("hyscale_fake_ops", "select", "selection", "call"),
           ("hyscale_fake_ops", "attend", "attention", "call"),
           ("hyscale_fake_ops", "gather", "communication", "pending"),
           ("hyscale_fake_ops", "missing", "selection", "call"))


def test_spans_forward_backward_nesting_and_steps(fake_module, capsys):
    timer = PhaseTimer()
    assert timer.install("hyscale", TARGETS) == [
        "hyscale_fake_ops.select", "hyscale_fake_ops.attend", "hyscale_fake_ops.gather"]
    x = torch.randn(4, 8, requires_grad=True)
    fake_module.select(x.detach())
    pending = fake_module.gather(x)
    time.sleep(3 * SLEEP)  # work between start and wait (HyTopK's place) is not communication
    y = pending.wait()  # requires grad: its backward is timed as well
    out, _ = fake_module.attend(y, scale=3.0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 6.0))  # the marks are identities
    totals = timer.end_step()
    # select: its own call only (the call inside attend is attention's)
    assert totals["selection"][1] == 1 and totals["selection"][0] >= SLEEP * 1e3
    # attention: forward and backward spans; the backward holds the 2 x SLEEP sleep
    assert totals["attention"][1] == 2 and totals["attention"][0] >= 3 * SLEEP * 1e3
    assert totals["communication"][1] == 2  # the wait, and its (instant) backward
    assert SLEEP * 1e3 <= totals["communication"][0] < 2.5 * SLEEP * 1e3
    assert totals["indexer_loss"] == (0.0, 0)
    line = timer.log_step(rank=3)
    assert capsys.readouterr().out.strip() == line
    rank, step, phases = parse_line("some prefix " + line)
    assert (rank, step) == (3, 2) and phases["selection"] == 0.0 and set(phases) == set(
        phase_times.PHASES)
    timer.uninstall()
    assert not hasattr(fake_module.select, "_hyscale_phase")


def test_unknown_variant_or_phase_is_refused(fake_module):
    with pytest.raises(ValueError, match="variant"):
        PhaseTimer().install("mla")
    with pytest.raises(ValueError, match="phase"):
        PhaseTimer().install("hyscale", (("hyscale_fake_ops", "select", "topk", "call"),))


def test_off_without_the_environment_variable(monkeypatch):
    monkeypatch.delenv(phase_times.ENV, raising=False)
    assert phase_times.enable_from_env("hyscale") is None


def test_megatron_lm_train_step_closes_a_step(monkeypatch, capsys):
    """The wrap Megatron-LM's training loop goes through (`train()` looks `train_step` up in
    megatron.training.training at call time): each step prints its line; spans recorded
    outside a step (evaluation) are dropped."""
    training = pytest.importorskip("megatron.training.training")
    calls = []
    monkeypatch.setattr(training, "train_step", lambda *a, **k: calls.append(a) or "out")
    timer = PhaseTimer()
    assert phase_times._wrap_train_step(timer)
    assert not phase_times._wrap_train_step(timer)  # once
    stale = phase_times._Span("selection")
    stale.open()
    stale.close()
    timer.spans.append(stale)  # e.g. an evaluation's forward before the step
    assert training.train_step(1, 2) == "out" and calls == [(1, 2)]
    rank, step, phases = parse_line(capsys.readouterr().out)
    assert (rank, step) == (0, 1) and phases["selection"] == 0.0
    timer.uninstall()  # the original train_step is back: no more lines
    assert training.train_step(3) == "out" and calls[-1] == (3,)
    assert not getattr(training.train_step, "_hyscale_phase", None)
    assert capsys.readouterr().out == ""


def test_spans_cost_nothing_when_off():
    """No recorder: one shared no-op region, and the timed functions call straight through
    (their results are the function's own objects: no identity node added)."""
    assert phase_spans.installed() is None
    assert phase_spans.span("selection") is phase_spans.span("attention")
    with phase_spans.span("selection"):
        pass
    x = torch.randn(3, requires_grad=True)
    same = phase_spans.timed(phase_spans.ATTENTION, lambda t: t)
    assert same(x) is x and same.phase == "attention"
    pending = types.SimpleNamespace(wait=lambda: x)
    start = phase_spans.timed_start(phase_spans.COMMUNICATION, lambda t: pending)
    assert start(x) is pending
    with pytest.raises(ValueError, match="phase"):
        phase_spans.timed("topk", lambda: None)


def test_explicit_spans_forward_backward_nesting_and_waits():
    """The API HyScale's layers use, recorded by an installed PhaseTimer: a region, a timed
    call inside it (counts once, for the region), a timed call with its backward, and a
    started gather whose wait alone is timed."""
    def attend(q):
        time.sleep(SLEEP)
        return _SlowBackward.apply(q)

    class Pending:
        def __init__(self, t):
            self.t = t

        def wait(self):
            time.sleep(SLEEP)
            return self.t * 1

    attend = phase_spans.timed(phase_spans.ATTENTION, attend)
    gather = phase_spans.timed_start(phase_spans.COMMUNICATION, Pending)
    timer = PhaseTimer()
    assert timer.install("hyscale") == []  # nothing patched by name
    try:
        assert phase_spans.installed() is timer
        x = torch.randn(4, 8, requires_grad=True)
        with phase_spans.span(phase_spans.SELECTION):
            time.sleep(SLEEP)
            attend(x.detach())  # nested: selection's
        pending = gather(x)
        time.sleep(3 * SLEEP)  # computing while it transfers: not communication
        attend(pending.wait()).sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))  # the marks are identities
        totals = timer.end_step()
    finally:
        timer.uninstall()
    assert phase_spans.installed() is None
    assert totals["selection"][1] == 1 and totals["selection"][0] >= 2 * SLEEP * 1e3
    assert totals["attention"][1] == 2 and totals["attention"][0] >= 3 * SLEEP * 1e3
    assert totals["communication"][1] == 2  # the wait, and its (instant) backward
    assert SLEEP * 1e3 <= totals["communication"][0] < 2.5 * SLEEP * 1e3
    assert totals["indexer_loss"] == (0.0, 0)


def test_selection_protocol_times_computed_selections_only():
    """`SelectionReplay.select` is every layer's selection span: a computed selection is one,
    a shared one (DSA index sharing) is not."""
    store = replay.SelectionReplay("timed layer")
    timer = PhaseTimer()
    timer.install("hyscale")
    try:
        store.select((1, 2), lambda: torch.zeros(1, 2, dtype=torch.int32))
        store.select((1, 2), lambda: torch.zeros(1, 2, dtype=torch.int32), shared=True)
        totals = timer.end_step()
    finally:
        timer.uninstall()
    assert totals["selection"][1] == 1


# What each HyScale layer module binds through phase_spans: (module, name, phase).
LAYER_SPANS = [
    (dsa_layers, "sparse_attention", "attention"),
    (dsa_layers, "indexer_kl_loss", "indexer_loss"),
    (dsa_layers, "start_all_gather_to_global", "communication"),
    (v4_layers, "sparse_attention", "attention"),
    (v4_layers, "indexer_kl_loss", "indexer_loss"),
    (v4_layers, "all_gather_to_global", "communication"),
    (qsa_layers, "sparse_attention", "attention"),
    (qsa_layers, "indexer_kl_loss", "indexer_loss"),
    (qsa_layers, "all_gather_to_global", "communication"),
    (qsa_layers, "start_all_gather_to_global", "communication"),
]


def test_hyscale_is_timed_by_its_own_spans_not_by_names():
    """HyScale's timing cannot be turned off by renaming an import: no target patches a
    megatron_hyscale module by name, and each layer module's ops are its timed bindings (an
    op imported again under the same name would replace one and fail here; the layer tests in
    tests/layers/test_phase_times_layers.py catch any other way of calling an op untimed)."""
    assert phase_times.TARGETS["hyscale"] == ()
    for variant, targets in phase_times.TARGETS.items():
        assert not [t for t in targets if t[0].startswith("megatron_hyscale")], variant
    for module, name, phase in LAYER_SPANS:
        assert getattr(getattr(module, name), "phase", None) == phase, (module.__name__, name)
    assert phase_spans.PHASES == phase_times.PHASES


def test_every_stock_target_exists_in_megatron_core():
    """A target megatron-core renamed would be skipped silently at install: each one must name
    a function of the pinned megatron-core (cuDNN's fused DSA pieces included)."""
    import importlib

    missing = []
    for module_name, attr, _, _ in phase_times.TARGETS["stock"]:
        module = importlib.import_module(module_name)
        if not callable(getattr(module, attr, None)):
            missing.append(f"{module_name}.{attr}")
    assert not missing, missing
    phases = {attr: phase for m, attr, phase, _ in phase_times.TARGETS["stock"]
              if m.endswith("dsa_cudnn_kernels")}
    assert set(phases.values()) == {"selection", "attention", "indexer_loss"}

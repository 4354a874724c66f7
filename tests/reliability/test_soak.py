"""Soak: many training steps of the tiny HyScale DSA GPT under full activation recompute with
megatron's DDP and optimizer; nothing may grow with the step count (the replay store, live
tensors and objects, the resident set size: `megatron_hyscale.testing.soak` says what is
checked and how). The step time is reported here and checked by the GPU run, whose clock a
shared 2-core CI machine does not disturb.

200 steps run by default (about 15-30 s on a 2-core CPU), 1000 with `pytest -m slow`. On the
GPU the same run is `python -m megatron_hyscale.testing.soak --steps 300 --device cuda`
(`scripts/gpu_session.sh soak`).
"""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.testing import soak


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("steps", [200, pytest.param(1000, marks=pytest.mark.slow)])
def test_soak_full_recompute_nothing_grows(steps, offload):
    if torch.cuda.is_available() and not offload:
        pytest.skip("CPU test (the timing and memory checks read the host process)")
    # Timing is the GPU run's check (gpu_session.sh soak, its record): here it is reported only.
    result = soak.run_soak(steps, offload=offload, time_growth=None)
    print(result.summary())
    assert not result.failures, result.summary()


def test_a_growing_store_is_caught(monkeypatch):
    """The checks can fail: a replay store that keeps one tensor more every step."""
    from megatron_hyscale import replay

    kept: list[torch.Tensor] = []
    original = replay.SelectionReplay.select

    def leaky_select(self, *args, **kwargs):
        selected = original(self, *args, **kwargs)  # indices, or (indices, companion)
        kept.append((selected[0] if isinstance(selected, tuple) else selected).clone())
        return selected

    monkeypatch.setattr(replay.SelectionReplay, "select", leaky_select)
    result = soak.run_soak(20, offload=False)
    assert any("live tensor bytes" in f for f in result.failures), result.summary()


def test_command_line_writes_a_record(tmp_path, monkeypatch):
    """`python -m megatron_hyscale.testing.soak --device cpu` (the GPU stage's command on a
    CPU): one record entry per mode, no failed check, exit status 0."""
    import json

    if torch.cuda.is_available():
        pytest.skip("--device cpu is refused where a GPU is visible")
    monkeypatch.setenv("HYSCALE_RESULTS", str(tmp_path))
    assert soak.main(["--device", "cpu", "--steps", "10", "--modes", "offload"]) == 0
    (path,) = tmp_path.glob("*-soak-dsa-10.json")
    record = json.loads(path.read_text())
    assert record["meta"]["device"] == "cpu"
    (entry,) = record["records"]
    assert entry["method"] == "soak-offload" and entry["steps"] == 10 and not entry["failures"]
    assert entry["end"]["bookkeeping"] == entry["start"]["bookkeeping"]


def test_the_step_time_check_can_fail():
    """The GPU run's step-time check (off in the CPU tests above): a last tenth of steps at
    1.5x the second tenth's median fails it, 1.4x passes, and None skips it."""
    snap = soak.Snapshot(tensor_bytes=1, objects=1, rss=1, bookkeeping={}, cuda_allocated=None)

    def result(slowdown: float) -> soak.SoakResult:
        times = [0.01] * 90 + [0.01 * slowdown] * 10
        return soak.SoakResult(100, False, "cpu", 2, times, snap, snap, None)

    assert soak._end_checks(result(1.5), soak.TIME_GROWTH) == ["step time 10.00 -> 15.00 ms"]
    assert soak._end_checks(result(1.4), soak.TIME_GROWTH) == []
    assert soak._end_checks(result(3.0), None) == []

"""Soak: many training steps of the tiny HyScale DSA GPT under full activation recompute with
megatron's DDP and optimizer; nothing may grow with the step count (the replay store, live
tensors and objects, the resident set size, the step time: `megatron_hyscale.testing.soak`
says what is checked and how).

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
    result = soak.run_soak(steps, offload=offload)
    print(result.summary())
    assert not result.failures, result.summary()


def test_a_growing_store_is_caught(monkeypatch):
    """The checks can fail: a replay store that keeps one tensor more every step."""
    from megatron_hyscale import replay

    kept: list[torch.Tensor] = []
    original = replay.SelectionReplay.select

    def leaky_select(self, *args, **kwargs):
        indices = original(self, *args, **kwargs)
        kept.append(indices.clone())
        return indices

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

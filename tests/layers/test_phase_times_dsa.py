"""megatron_hyscale.phase_times on tiny DSA GPT models, HyScale's and stock megatron-core's."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_hyscale import phase_times
from megatron_hyscale.testing.models import build_gpt, default_device, tiny_dsa_config

DEVICE = default_device()


@pytest.mark.parametrize("variant", ["hyscale", "stock"])
def test_dsa_models_report_every_phase(variant, monkeypatch):
    """The real targets on a tiny DSA model, HyScale's and stock megatron-core's: selection,
    attention (forward and backward) and the indexer loss are all seen."""
    monkeypatch.setenv(phase_times.ENV, "1")
    import megatron_hyscale.layers.dsa as dsa_layers

    if variant == "hyscale":  # a slow selection must not show up as communication
        fast = dsa_layers.hytopk

        def slow_hytopk(*args, **kwargs):
            time.sleep(0.05)
            return fast(*args, **kwargs)

        monkeypatch.setattr(dsa_layers, "hytopk", slow_hytopk)
    try:
        timer = phase_times.enable_from_env(variant)
        assert timer is not None
        torch.manual_seed(0)
        model = build_gpt(tiny_dsa_config(), stock=variant == "stock", vocab_size=61,
                          max_sequence_length=64)
        model.train()
        ids = torch.randint(0, 61, (1, 64), device=DEVICE)
        pos = torch.arange(64, device=DEVICE)[None]
        model(ids, pos, None, labels=ids).mean().backward()
        totals = timer.end_step()
    finally:
        phase_times.disable()
    assert totals["selection"][1] >= 1, totals
    assert totals["attention"][1] >= 2, totals  # forward + backward
    assert totals["indexer_loss"][1] >= 1, totals
    if variant == "hyscale":
        assert totals["selection"][0] >= 50.0
        assert totals["communication"][0] < 25.0, totals  # one process: no gather to wait on
    assert not hasattr(dsa_layers.hytopk, "_hyscale_phase")  # disable() put it back

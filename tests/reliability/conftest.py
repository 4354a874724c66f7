"""Megatron-core set-up for the reliability tests (checkpoints, resume, soak): on the GPU where
there is one, else on the CPU with megatron's training pieces redirected
(`hyscale_bench.cpu.megatron_on_cpu`, `testing.training.training_on_cpu`).

Tests here marked `slow` (the 1000-step soak, the kill-and-resume runs beyond DSA) are skipped
unless the marker expression asks for them (`pytest -m slow tests/reliability`, or `-m "slow or
not gpu"`): `scripts/run.sh test` deselects nothing, and the default run of this folder stays
within about three minutes on a 2-core CPU.
"""

import contextlib
import os

import pytest

from hyscale_bench.cpu import init_single_process, megatron_on_cpu
from hyscale_bench.models import default_device
from megatron_hyscale import replay
from megatron_hyscale.testing.training import training_on_cpu

DEVICE = default_device()
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow reliability case: run with `pytest -m slow`")
    for item in items:
        if "slow" in item.keywords and str(item.path).startswith(HERE + os.sep):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def megatron_env():
    with megatron_on_cpu() if DEVICE.type == "cpu" else contextlib.nullcontext():
        init_single_process()
        yield


@pytest.fixture(autouse=True)
def training_env():
    """megatron's optimizer / DDP / checkpoint writer on the CPU, and no replay entry left
    over from (or to) another test."""
    replay.clear()
    with training_on_cpu():
        yield
    replay.clear()

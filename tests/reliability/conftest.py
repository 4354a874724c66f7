"""Megatron-core set-up for the reliability tests (checkpoints, resume, soak): on the GPU where
there is one, else on the CPU with megatron's training pieces redirected
(`testing.cpu.megatron_on_cpu`, `testing.training.training_on_cpu`)."""

import contextlib

import pytest

from megatron_hyscale import replay
from megatron_hyscale.testing.cpu import init_single_process, megatron_on_cpu
from megatron_hyscale.testing.models import default_device
from megatron_hyscale.testing.training import training_on_cpu

DEVICE = default_device()


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

"""Megatron-core set-up for layer tests: on the GPU where there is one, else on the CPU."""

import contextlib

import pytest

from hyscale_bench.cpu import init_single_process, megatron_on_cpu
from hyscale_bench.models import default_device

DEVICE = default_device()


@pytest.fixture(scope="session", autouse=True)
def megatron_env():
    # The CPU patches must not be active on a CUDA machine (they point megatron at the CPU).
    with megatron_on_cpu() if DEVICE.type == "cpu" else contextlib.nullcontext():
        init_single_process()
        yield


@pytest.fixture(autouse=True)
def empty_loss_tracker():
    """megatron's indexer-loss tracker is a process-wide dict sized by the first model that
    logs: a test's models (often one layer) must not leave it behind for the next test's."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    DSAIndexerLossLoggingHelper.tracker.clear()
    yield
    DSAIndexerLossLoggingHelper.tracker.clear()

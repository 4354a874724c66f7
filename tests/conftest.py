"""Test-session setup: Triton's interpreter on CPU-only machines, and the `gpu` marker."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit body is defined: Triton reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

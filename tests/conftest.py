"""Test-session setup: Triton's interpreter on CPU-only machines, the `gpu` marker, and each
failure written out as it happens when $HYSCALE_FAILURE_LOG names a file."""

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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append a failed test's id and traceback to $HYSCALE_FAILURE_LOG at once: a GPU call cut
    off by its time limit never reaches pytest's closing summary (scripts/gpu_session.sh)."""
    path = os.environ.get("HYSCALE_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n\n")

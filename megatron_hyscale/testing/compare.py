"""Assertions shared by the tests that compare two runs of a model (gradients by name)."""

from __future__ import annotations

import torch


def assert_grads_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                       rtol: float, atol: float, what: str = "") -> None:
    """The same parameters have gradients, and each is close to the expected one."""
    assert set(got) == set(expected), (what, sorted(set(got) ^ set(expected)))
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{what} {n}: {m}".strip())

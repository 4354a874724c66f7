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


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, what: str, rel: float) -> None:
    """Within `rel` of the expected tensor's own scale (rtol and atol = rel x max|want|):
    gradients of one layer span 1e-8 .. 1e-4, so any fixed atol leaves the smallest unchecked."""
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * want.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def assert_rows_hold_sorted_sets(indices: torch.Tensor, scores: torch.Tensor,
                                 sorted_indices: torch.Tensor, sorted_scores: torch.Tensor
                                 ) -> None:
    """Top-k rows in any order (HyTopK's ordered=False) hold exactly the sorted rows' entries
    (index with its score), their -1 slots last: sorting them by (score desc, index asc)
    gives the sorted rows bit for bit."""
    # index ascending (-1 slots last), then a stable sort by score descending
    by_index = torch.where(indices >= 0, indices, torch.iinfo(indices.dtype).max).argsort(dim=-1)
    i1, s1 = indices.gather(-1, by_index), scores.gather(-1, by_index)
    by_score = s1.argsort(dim=-1, descending=True, stable=True)
    assert torch.equal(i1.gather(-1, by_score), sorted_indices)
    assert torch.equal(s1.gather(-1, by_score), sorted_scores)
    n_valid = (indices >= 0).sum(-1, keepdim=True)
    slots = torch.arange(indices.shape[-1], device=indices.device)
    assert torch.equal(indices >= 0, slots < n_valid), "-1 slots are not last"

"""The Hopper sparse-MLA forward's input checks, on CPU (its kernel runs in
tests/ops/test_sparse_mla_fwd_sm90_gpu.py; its compiled form in tests/scripts)."""

from __future__ import annotations

import torch

from megatron_hyscale.ops.kernels import sparse_mla_fwd_sm90 as sm90


def test_contiguous_absorbed_mla_inputs_have_no_layout_problem():
    q = torch.zeros(1, 4, 64, 576, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 1, 576, dtype=torch.bfloat16)
    assert sm90.layout_problem(q, k) is None


def test_layout_problems_name_the_tensor_and_the_cause():
    k = torch.zeros(1, 8, 1, 576, dtype=torch.bfloat16)
    odd_rows = torch.zeros(1, 4, 64, 579, dtype=torch.bfloat16)[..., :576]
    assert "q's strides" in sm90.layout_problem(odd_rows, k)
    channels_strided = torch.zeros(1, 8, 1, 1152, dtype=torch.bfloat16)[..., ::2]
    q = torch.zeros(1, 4, 64, 576, dtype=torch.bfloat16)
    assert "k's strides" in sm90.layout_problem(q, channels_strided)
    shifted = torch.zeros(1 * 4 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(1, 4, 64, 576)
    assert sm90.layout_problem(shifted, k) == "q is not 16-byte aligned"


def test_cpu_tensors_are_never_its_case():
    q = torch.zeros(1, 4, 64, 576, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 1, 576, dtype=torch.bfloat16)
    assert not sm90.applies(q, k, None, 512, None, None)

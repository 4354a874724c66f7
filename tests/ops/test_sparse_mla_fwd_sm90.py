"""The Hopper sparse-MLA forward's input checks, on CPU (its kernel runs in
tests/ops/test_sparse_mla_fwd_sm90_gpu.py; its compiled form in tests/scripts)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="Gluon's Hopper API (tested with Triton 3.6)")
from megatron_hyscale.ops import checks  # noqa: E402
from megatron_hyscale.ops.kernels import sparse_mla_fwd_sm90 as sm90  # noqa: E402


def _qk(d=576, q_width=None, k_width=None):
    q = torch.zeros(1, 4, 64, q_width or d, dtype=torch.bfloat16)[..., :d]
    k = torch.zeros(1, 8, 1, k_width or d, dtype=torch.bfloat16)[..., :d]
    return q, k


def test_contiguous_absorbed_mla_inputs_have_no_layout_problem():
    assert sm90.layout_problem(*_qk()) is None
    assert sm90.layout_problem(*_qk(q_width=640)) is None  # rows of 640: a multiple of 16


def test_layout_problems_name_the_tensor_and_the_cause():
    cause, detail = sm90.layout_problem(*_qk(q_width=584))  # 8 x 73: 16-byte rows, still not
    assert cause.startswith("q's rows") and "584" in detail  # provably aligned to Triton
    cause, _ = sm90.layout_problem(*_qk(k_width=579))
    assert cause.startswith("k's rows")
    q, _ = _qk()
    strided = torch.zeros(1, 8, 1, 1152, dtype=torch.bfloat16)[..., ::2]
    assert sm90.layout_problem(q, strided)[0].startswith("k's rows")
    _, k = _qk()
    shifted = torch.zeros(4 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(1, 4, 64, 576)
    assert sm90.layout_problem(shifted, k) == ("q is not 16-byte aligned", "")


def test_k_head_stride_is_not_checked():
    """k has one head; its stride is never used, so an odd one is no problem."""
    q, _ = _qk()
    k = torch.zeros(1, 8, 1, 576, dtype=torch.bfloat16).as_strided((1, 8, 1, 576),
                                                                   (8 * 576, 576, 3, 1))
    assert sm90.layout_problem(q, k) is None


def test_cpu_tensors_are_never_its_case():
    q, k = _qk()
    assert not sm90.applies(q, k, None, 512, None, None)


def test_warnings_are_once_per_cause_and_disable_is_per_variant(monkeypatch):
    monkeypatch.setattr(checks, "_warned", set())  # no warning given yet in this process
    with pytest.warns(RuntimeWarning, match="q's rows.*strides \\(1"):
        sm90.warn_cannot_run("q's rows are not aligned", "strides (1, 2)")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sm90.warn_cannot_run("q's rows are not aligned", "strides (3, 4)")  # same cause: silent
    q, _ = _qk()
    key = sm90.variant(q)
    try:
        with pytest.warns(RuntimeWarning, match="CompilationError"):
            sm90.disable(key, "CompilationError: at 1:2\nlong MLIR dump ...")
        assert key in sm90._disabled
        assert sm90.variant(_qk(d=320)[0]) not in sm90._disabled  # other variants unaffected
    finally:
        sm90._disabled.discard(key)


def test_the_warp_specialized_kernel_is_its_own_variant():
    """A failure of one of the two Gluon forwards (plain, warp-specialized) leaves the other
    selectable."""
    q, _ = _qk()
    key = sm90.variant(q, ws=True)
    assert key != sm90.variant(q)
    sm90._disabled.add(key)
    try:
        assert key in sm90._disabled and sm90.variant(q) not in sm90._disabled
    finally:
        sm90._disabled.discard(key)


@pytest.mark.parametrize("name", ["sink", "prefix_lengths"])
def test_a_sink_or_a_prefix_is_refused_by_the_plain_kernel_before_anything_runs(name):
    from megatron_hyscale.ops.kernels.options import AttentionKernelOptions

    q, k = _qk()
    idx = torch.zeros(1, 4, 8, dtype=torch.int32)
    given = torch.zeros(64) if name == "sink" else torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"{name}: only the warp-specialized"):
        sm90.sparse_mla_fwd_sm90(q, k, idx, 0.1, **{name: given},
                                 options=replace(AttentionKernelOptions.DEFAULT,
                                                 fwd_sm90_ws=False))


def test_a_prefix_is_its_own_variant():
    """A failure of the prefix form (HCA's) leaves the form without one selectable, and the
    other way round."""
    q, _ = _qk()
    with_prefix, without = sm90.variant(q, ws=True, prefix=True), sm90.variant(q, ws=True)
    assert with_prefix != without
    sm90._disabled.add(with_prefix)
    try:
        assert without not in sm90._disabled
    finally:
        sm90._disabled.discard(with_prefix)


def test_both_gluon_kernels_share_the_tiles_the_wrapper_builds_layouts_for():
    """The wrapper builds the warp-specialized kernel's shared layouts too: same heads a
    program, same keys a tile, and a P tile the shape of the tail it is written over."""
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_ws_sm90 as ws

    assert (ws.BLOCK_H, ws.BLOCK_N) == (sm90.BLOCK_H, sm90.BLOCK_N)
    assert ws.BLOCK_N == sm90.TAIL

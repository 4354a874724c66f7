"""The Hopper sparse-MLA backward's input checks and dispatch, on CPU (its kernel runs in
tests/ops/test_sparse_mla_bwd_sm90_gpu.py; its compiled form in tests/scripts)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="Gluon's Hopper API (tested with Triton 3.6)")
from megatron_hyscale.ops import checks  # noqa: E402
from megatron_hyscale.ops.kernels import sparse_mla_bwd_sm90 as bwd  # noqa: E402
from megatron_hyscale.ops.kernels.gluon_common import kernel_strides  # noqa: E402
from megatron_hyscale.ops.kernels.options import (  # noqa: E402
    AttentionKernelOptions,
    IndexerLossKernelOptions,
)


def _tensors(d=576, q_width=None, k_width=None, dout_width=None, out_stride=1):
    q = torch.zeros(1, 4, 64, q_width or d, dtype=torch.bfloat16)[..., :d]
    k = torch.zeros(1, 8, 1, k_width or d, dtype=torch.bfloat16)[..., :d]
    dv = 1 << (d.bit_length() - 1)
    dout = torch.zeros(1, 4, 64, dout_width or dv, dtype=torch.bfloat16)[..., :dv]
    out = torch.zeros(1, 4, 64, dv * out_stride, dtype=torch.bfloat16)[..., ::out_stride]
    return q, k, out, dout


def test_contiguous_inputs_have_no_layout_problem():
    assert bwd.layout_problem(*_tensors()) is None
    assert bwd.layout_problem(*_tensors(q_width=640, dout_width=640)) is None


def test_layout_problems_name_the_tensor_and_the_cause():
    cause, detail = bwd.layout_problem(*_tensors(dout_width=584))
    assert cause.startswith("dout's rows") and "584" in detail
    assert bwd.layout_problem(*_tensors(q_width=584))[0].startswith("q's rows")
    assert bwd.layout_problem(*_tensors(k_width=579))[0].startswith("k's rows")
    assert bwd.layout_problem(*_tensors(out_stride=2))[0] == "out's channels are not unit-stride"


def test_a_single_sequences_batch_stride_is_not_checked():
    """The DSA layer's dout of one sequence is the V up-projection's einsum gradient, heads
    outermost: strides (1, 512, T * 512, 1). Its batch stride is never stepped along: the
    kernel takes it as 0. With two sequences the same odd batch stride is refused."""
    q, k, out, _ = _tensors()
    T = q.shape[1]
    dout = torch.zeros(64, T, 1, 512, dtype=torch.bfloat16).permute(2, 1, 0, 3)
    assert dout.stride() == (512, 512, T * 512, 1) and dout.shape == (1, T, 64, 512)
    layer_dout = dout.as_strided(dout.shape, (1, 512, T * 512, 1))
    assert bwd.layout_problem(q, k, out, layer_dout) is None
    assert kernel_strides(layer_dout, 3) == (0, 512, T * 512)
    two = torch.zeros(2 * T * 64 * 512 + 1, dtype=torch.bfloat16)
    odd = two.as_strided((2, T, 64, 512), (T * 64 * 512 + 1, 64 * 512, 512, 1))
    q2, k2 = q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1).contiguous()
    cause, detail = bwd.layout_problem(q2.contiguous(), k2, out.expand(2, -1, -1, -1), odd)
    assert cause.startswith("dout's rows") and str(T * 64 * 512 + 1) in detail


def test_cpu_tensors_are_never_its_case():
    q, k, _, _ = _tensors()
    assert not bwd.applies(q, k, None, 512, None)


def test_a_prefix_is_its_own_variant():
    q, _, _, _ = _tensors()
    assert bwd.variant(q, True) != bwd.variant(q)


def test_disable_is_per_variant_and_warns_once_per_cause(monkeypatch):
    monkeypatch.setattr(checks, "_warned", set())
    q, _, _, _ = _tensors()
    key = bwd.variant(q)
    try:
        with pytest.warns(RuntimeWarning, match="backward cannot run.*CompilationError"):
            bwd.disable(key, "CompilationError: at 1:2\nlong MLIR dump ...")
        assert key in bwd._disabled
        assert bwd.variant(_tensors(d=320)[0]) not in bwd._disabled
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            bwd.warn_cannot_run(f"{key}: CompilationError: at 1:2")  # same cause: silent
    finally:
        bwd._disabled.discard(key)


def test_off_hopper_the_option_changes_nothing():
    """On CPU (the interpreter) bwd_sm90 is not applicable: the Triton backward runs, silently,
    with the same gradients."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run under the interpreter here")
    from megatron_hyscale.ops.kernels import sparse_attention as sa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 16, 32, generator=g)
    k = torch.randn(1, 24, 1, 32, generator=g)
    idx = torch.stack([torch.randperm(24, generator=g)[:10] for _ in range(3)]).view(1, 3, 10)
    out, lse = sa.sparse_attention_fwd(q, k, None, idx.int(), 0.2, dv=16)
    dout = torch.randn_like(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on = sa.sparse_attention_bwd(q, k, None, idx.int(), 0.2, out, lse, dout, dv=16,
                                     options=replace(AttentionKernelOptions.DEFAULT,
                                                     bwd_sm90=True))
    off = sa.sparse_attention_bwd(q, k, None, idx.int(), 0.2, out, lse, dout, dv=16)
    for a, b in zip(on, off, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_the_kernel_tiles_fit_the_forward_layouts():
    """The wrapper takes its shared layouts from the Gluon forward's (`shared_layouts`): same
    heads a program and keys a tile; a P / dS tile is [keys x heads], square."""
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_sm90 as fwd

    assert (bwd.BLOCK_H, bwd.BLOCK_N) == (fwd.BLOCK_H, fwd.BLOCK_N)
    assert bwd.BLOCK_H == bwd.BLOCK_N
    # 240 + 240 + 24 registers a thread for the three warpgroups: within the SM's 64K.
    assert (2 * bwd.CONSUMER_REGS + bwd.PRODUCER_REGS) * 128 <= 65536


def test_head_counts_it_takes():
    """Multiples of 64 heads, or fewer (one padded block: tensor parallelism's share of
    GLM-5.1's 64); not 96 (a block and a half)."""
    assert [h for h in (8, 16, 32, 64, 96, 128, 192) if bwd.heads_fit(h)] == [
        8, 16, 32, 64, 128, 192]


@pytest.mark.parametrize("slack", [0, -1, 1.5, None])
def test_lockstep_slack_is_checked_first(slack):
    """A slack that is not an int >= 1 is refused before anything is allocated or launched
    (CPU tensors: the check comes before any device work)."""
    q = torch.zeros(1, 4, 64, 576, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lockstep_slack must be an int >= 1"):
        bwd.sparse_mla_bwd_sm90(q, k, torch.zeros(1, 4, 8, dtype=torch.int32), 0.1,
                                torch.zeros(1, 4, 64, 512, dtype=torch.bfloat16),
                                torch.zeros(1, 4, 64), torch.zeros(1, 4, 64, 512,
                                                                   dtype=torch.bfloat16),
                                torch.zeros(1, 8, 1, 576), lockstep=True, lockstep_slack=slack)


@pytest.mark.parametrize("cls,name", [
    (AttentionKernelOptions, "bwd_lockstep_slack"), (AttentionKernelOptions, "fwd_lockstep_slack"),
    (AttentionKernelOptions, "triton_lockstep_slack"),
    (AttentionKernelOptions, "triton_lockstep_programs_per_sm"),
    (IndexerLossKernelOptions, "bwd_lockstep_slack"),
    (IndexerLossKernelOptions, "bwd_lockstep_programs_per_sm")])
@pytest.mark.parametrize("value", [0, -2, 1.0, True])
def test_lockstep_slack_option_is_checked_when_made(cls, name, value):
    """The options objects refuse a slack or a program count that is not an int >= 1 when
    they are made: at launch the dispatcher would take the failure for the kernel's, disable
    it and fall back."""
    with pytest.raises(ValueError, match=f"{cls.__name__}.{name} must be an int >= 1"):
        replace(cls.DEFAULT, **{name: value})
    assert getattr(replace(cls.DEFAULT, **{name: 3}), name) == 3


@pytest.mark.parametrize("name", ["fwd_flashmla", "bwd_lockstep", "dkv_lockstep", "dq_lockstep",
                                  "fwd_sm90", "prefix_sm90"])
def test_switches_must_be_bools(name):
    with pytest.raises(ValueError, match=f"AttentionKernelOptions.{name} must be a bool"):
        replace(AttentionKernelOptions.DEFAULT, **{name: 1})

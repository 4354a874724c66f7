"""The Hopper indexer-loss backward's option, its refusals and its dispatch, on CPU (its
kernel runs in tests/ops/test_indexer_loss_bwd_sm90_gpu.py; its compiled form in
tests/scripts/test_inspect_sm90.py)."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="Gluon's Hopper API (tested with Triton 3.6)")
from megatron_hyscale.ops import checks  # noqa: E402
from megatron_hyscale.ops.kernels import common  # noqa: E402
from megatron_hyscale.ops.kernels import indexer_loss as kern  # noqa: E402
from megatron_hyscale.ops.kernels import indexer_loss_bwd_sm90 as sm90  # noqa: E402
from megatron_hyscale.ops.kernels.common import MODE_DISCARD  # noqa: E402
from megatron_hyscale.ops.kernels.key_split import (  # noqa: E402
    AUTO_KEY_PASSES,
    KEY_BYTES,
    ONE_PASS_BYTES,
)
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions  # noqa: E402

SM90 = replace(IndexerLossKernelOptions.DEFAULT, bwd_sm90=True)
# The most keys one pass takes by default (`key_split.auto_key_passes`).
KEY_BYTES_KEYS = ONE_PASS_BYTES // KEY_BYTES


@pytest.mark.parametrize("value", [-1, 1.0, True, None])
def test_key_passes_option_is_checked_when_made(value):
    with pytest.raises(ValueError, match="bwd_key_passes must be an int >= 0"):
        replace(IndexerLossKernelOptions.DEFAULT, bwd_key_passes=value)
    assert replace(IndexerLossKernelOptions.DEFAULT, bwd_key_passes=3).bwd_key_passes == 3


def _tensors(H=32, D=128, B=1, T=4, S=8, K=6, dtype=torch.bfloat16, q_width=None,
             k_width=None, idx_dtype=torch.int32, w_dtype=torch.float32):
    q = torch.zeros(B, T, H, q_width or D, dtype=dtype)[..., :D]
    w = torch.zeros(B, T, H, dtype=w_dtype)
    k = torch.zeros(B, S, k_width or D, dtype=dtype)[..., :D]
    idx = torch.zeros(B, T, K, dtype=idx_dtype)
    p = torch.zeros(B, T, K)
    row = torch.zeros(B, T)
    return q, w, k, idx, p, row, row


def test_option_is_on_by_default_and_must_be_a_bool():
    assert IndexerLossKernelOptions.DEFAULT.bwd_sm90 is True
    assert SM90.bwd_sm90 is True
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="IndexerLossKernelOptions.bwd_sm90 must be a bool"):
            IndexerLossKernelOptions(bwd_sm90=bad)


def test_cpu_tensors_of_its_shape_are_refused_for_the_device_alone():
    """Also with the row KL (with_kl: the default kl_in_bwd's call), which the kernel takes."""
    for H in sm90.HEADS:
        for idx_dtype in (torch.int32, torch.int64):
            for w_dtype in (torch.float32, torch.bfloat16):
                for with_kl in (False, True):
                    why = sm90.unsupported(*_tensors(H=H, idx_dtype=idx_dtype, w_dtype=w_dtype),
                                           with_kl=with_kl)
                    assert why.startswith("tensors on cpu"), why


@pytest.mark.parametrize("kwargs, cause", [
    (dict(deterministic=True), "deterministic=True"),
    (dict(deterministic=True, with_kl=True), "deterministic=True"),
    (dict(mode=4), "mode=4"),
    (dict(deterministic=True, lockstep=True), "deterministic=True"),
])
def test_the_triton_kernels_modes_are_declined(kwargs, cause):
    assert sm90.unsupported(*_tensors(), **kwargs).startswith(cause)


def test_lockstep_is_the_kernels_own():
    """bwd_lockstep (any slack) is the kernel's LOCKSTEP: on CPU tensors only the device is
    named; its variant key differs from the unpaced one's and by slack."""
    for slack in (1, 2):
        why = sm90.unsupported(*_tensors(), lockstep=True, lockstep_slack=slack, with_kl=True)
        assert why.startswith("tensors on cpu"), why
    q, w, _, idx, *_ = _tensors()
    keys = {sm90.variant(q, w, idx, True, True),
            sm90.variant(q, w, idx, True, True, lockstep=True),
            sm90.variant(q, w, idx, True, True, lockstep=True, lockstep_slack=2)}
    assert len(keys) == 3
    assert sm90.variant(q, w, idx, True, True, lockstep=False, lockstep_slack=2) == \
        sm90.variant(q, w, idx, True, True)  # the slack is no variant unpaced
    # the measurement mode compiles another kernel: its failure must not disable the gradients'
    assert sm90.variant(q, w, idx, True, True, mode=MODE_DISCARD) != \
        sm90.variant(q, w, idx, True, True)


def test_the_lockstep_launch_counts_waves(monkeypatch):
    """The wrapper's launch on CPU tensors (the kernel intercepted; `common.sm_count` gives
    INTERPRETER_SMS programs there): unpaced, min(pairs, SMs) programs and no counters; in
    lockstep, one zeroed int32 counter a wave of pairs and the slack as SYNC_SLACK."""
    from megatron_hyscale.ops.kernels import common

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((grid, a, k))

    monkeypatch.setattr(sm90, "_indexer_loss_bwd_kernel", Kernel())
    for T in (13, 2, 1):  # 7 pairs (the last one row): 3 waves; one pair; one row
        args = _case(T=T, B=1)
        for lockstep, slack in ((False, 1), (True, 1), (True, 3)):
            launches.clear()
            sm90.indexer_loss_bwd_sm90(*args, torch.tensor(1.3), 0.7, True, with_kl=True,
                                       lockstep=lockstep, lockstep_slack=slack)
            (grid, a, k), = launches
            pairs = (T + 1) // 2
            programs = min(pairs, common.INTERPRETER_SMS)
            assert grid == (programs,) and a[17:19] == (programs, T)
            assert a[16] is args[5] and not k["RANGED"]  # one pass
            assert a[11] is a[9] and a[12] is a[10]  # the outputs stored directly
            assert k["LOCKSTEP"] is lockstep and k["SYNC_SPINS"] == common.SYNC_SPINS
            sync = a[15]
            if lockstep:
                assert k["SYNC_SLACK"] == slack
                assert sync.dtype == torch.int32 and not sync.any()
                assert sync.shape == ((pairs + programs - 1) // programs,)
            else:
                assert sync is args[5]  # lse stands in, never read
    with pytest.raises(ValueError, match="lockstep_slack"):
        sm90.indexer_loss_bwd_sm90(*_case(), torch.tensor(1.3), 0.7, True, lockstep=True,
                                   lockstep_slack=0)


def test_key_passes_launch_a_pass_each(monkeypatch):
    """bwd_key_passes: the wrapper (the kernel intercepted) splits the rows once
    (`key_split`, the same tensor for every launch) and launches each pass, all with fp32 dq /
    dw buffers (a row that spans passes sums there) and the outputs, which it returns in the
    inputs' dtypes; a pass count that is not an int >= 1, or passes with lockstep, are
    refused."""
    from megatron_hyscale.ops.kernels.key_split import key_split_reference

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((a, k))

    monkeypatch.setattr(sm90, "_indexer_loss_bwd_kernel", Kernel())
    args = list(_case(T=5, B=2, S=10))
    args[3] = torch.where(args[3] < 0, 99, args[3]).sort(-1).values  # keys in order, -1 last
    args[3] = torch.where(args[3] == 99, -1, args[3])
    w16 = args[1].to(torch.bfloat16)
    for weights in (args[1], w16):
        launches.clear()
        dq, dw, dk, kl = sm90.indexer_loss_bwd_sm90(args[0], weights, *args[2:],
                                                    torch.tensor(1.3), 0.7, True, with_kl=True,
                                                    key_passes=3)
        assert [k["RANGED"] for _, k in launches] == [True] * 3
        assert [a[23] for a, _ in launches] == [0, 1, 2] and launches[0][0][22] == 4
        split = launches[0][0][16]
        assert all(a[16] is split for a, _ in launches)
        assert torch.equal(split, key_split_reference(args[3], 10, 3))
        assert all(a[9].dtype == a[10].dtype == torch.float32 for a, _ in launches)
        # every pass may write a row's outputs (its last pass with slots)
        assert all(a[11] is dq and a[12] is dw for a, _ in launches)
        assert all(a[9] is not dq and a[9].is_contiguous() for a, _ in launches)
        assert all(a[9].stride() == dq.stride() and a[10].stride() == dw.stride()
                   for a, _ in launches)
        assert dq.dtype == torch.bfloat16 and dw.dtype == weights.dtype
        assert dq.shape == args[0].shape and dw.shape == weights.shape
    empty = [x[:, :0] for x in _case(T=5, B=1)]  # no rows: no launch, the inputs' dtypes
    launches.clear()
    dq, dw, _ = sm90.indexer_loss_bwd_sm90(*empty, torch.tensor(1.3), 0.7, True, key_passes=2)
    assert not launches and (dq.dtype, dw.dtype) == (torch.bfloat16, torch.float32)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="key_passes must be an int >= 1"):
            sm90.indexer_loss_bwd_sm90(*args, torch.tensor(1.3), 0.7, True, key_passes=bad)
    with pytest.raises(ValueError, match="key_passes > 1 does not pace"):
        sm90.indexer_loss_bwd_sm90(*args, torch.tensor(1.3), 0.7, True, key_passes=2,
                                   lockstep=True)
    why = sm90.unsupported(*_tensors(), key_passes=2, lockstep=True)
    assert why.startswith("bwd_key_passes > 1 with bwd_lockstep"), why
    q, w, _, idx, *_ = _tensors()
    assert sm90.variant(q, w, idx, True, True, key_passes=2) == \
        sm90.variant(q, w, idx, True, True, key_passes=4) != sm90.variant(q, w, idx, True, True)


def test_the_dispatch_passes_key_passes_where_keys_increase(monkeypatch):
    """`indexer_loss_bwd` hands the kernel options.bwd_key_passes only where the caller says
    each row's keys increase (keys_ascending) and the backward is not paced; else one pass."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    seen = []
    monkeypatch.setattr(sm90, "run_if_supported",
                        lambda *a, key_passes, **k: seen.append(key_passes) or a[:3])
    args = _case()
    opts = replace(SM90, bwd_key_passes=4)
    for options, ascending in ((opts, True), (opts, False), (replace(opts, bwd_lockstep=True),
                                                             True), (SM90, True)):
        kern.indexer_loss_bwd(*args, torch.tensor(1.0), 0.5, True, options=options,
                              keys_ascending=ascending)
    assert seen == [4, 1, 1, 1]
    # The default (0) by size: one pass while dk_index and k_index fit half the L2, else 3.
    assert IndexerLossKernelOptions.DEFAULT.bwd_key_passes == 0
    seen.clear()
    for keys in (KEY_BYTES_KEYS, KEY_BYTES_KEYS + 1):
        k = torch.zeros(2, keys, 128, dtype=torch.bfloat16)
        kern.indexer_loss_bwd(args[0], args[1], k, *args[3:], torch.tensor(1.0), 0.5, True,
                              options=SM90, keys_ascending=True)
    assert seen == [1, AUTO_KEY_PASSES]


@pytest.mark.parametrize("tensors, cause", [
    (dict(dtype=torch.float16), "q_index / k_index dtypes"),
    (dict(w_dtype=torch.float16), "weights dtype"),
    (dict(idx_dtype=torch.int16), "indices dtype"),
    (dict(H=16), "index heads"),
    (dict(H=48), "index heads"),
    (dict(D=64), "head dim"),
    (dict(q_width=136), "q_index's rows"),
    (dict(k_width=132), "k_index's rows"),
])
def test_shapes_dtypes_and_layouts_it_cannot_take_are_named(tensors, cause):
    assert sm90.unsupported(*_tensors(**tensors)).startswith(cause)


def test_fp32_statistics_are_required():
    q, w, k, idx, p, lse, psum = _tensors()
    assert sm90.unsupported(q, w, k, idx, p.double(), lse, psum).startswith("p, lse and psum")


def _case(seed=0, B=2, T=6, S=10, H=32, K=24):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(B, T, H, generator=g) * 0.2
    k = torch.randn(B, S, 128, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, S, (B, T, K), generator=g, dtype=torch.int32)
    p = torch.rand(B, T, K, generator=g)
    p = torch.where(idx >= 0, p / p.sum(-1, keepdim=True), torch.full_like(p, -1.0))
    lse = torch.randn(B, T, generator=g)
    psum = torch.where(idx >= 0, p, 0.0).sum(-1)
    return q, w, k, idx, p, lse, psum


def test_it_applies_to_bf16_index_heads_on_hopper_only(monkeypatch):
    """On the CPU (CI) it never applies; on a Hopper GPU (the capability faked) to bf16 q / k
    with 32 or 64 heads of 128, in the default accumulation mode, paced or not (lockstep: its
    LOCKSTEP), never deterministic."""
    q, w, k, *_ = _tensors()
    assert not sm90.applies(q, k)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sm90.applies(q, k) and sm90.applies(*_tensors(H=64)[0:3:2])
    for kwargs in (dict(deterministic=True), dict(mode=4),
                   dict(deterministic=True, lockstep=True)):
        assert not sm90.applies(q, k, **kwargs), kwargs
    assert sm90.applies(q, k, lockstep=True) and sm90.applies(q, k, lockstep=True,
                                                                mode=MODE_DISCARD)
    assert sm90.applies(q, k, mode=MODE_DISCARD)  # the measurement mode has its form
    for tensors in (dict(H=4), dict(H=16), dict(D=64), dict(dtype=torch.float16)):
        t = _tensors(**tensors)
        assert not sm90.applies(t[0], t[2]), tensors
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not sm90.applies(q, k)


def _dispatch(args, with_kl=False):
    return sm90.run_if_supported(*args, torch.tensor(1.3), 0.7, True, deterministic=False,
                                 with_kl=with_kl, mode=0, lockstep=False)


def test_where_it_applies_a_refusal_warns_once_a_cause(monkeypatch):
    """Made to apply on the CPU (`applies` faked), calls `unsupported` refuses return None (the
    Triton kernel's turn) after one warning a cause: the device's for both KL forms, and a q
    layout's once for three row widths (its strides are not in the cause)."""
    monkeypatch.setattr(checks, "_warned", set())
    monkeypatch.setattr(sm90, "applies", lambda *a, **k: True)
    args = _case()
    with pytest.warns(RuntimeWarning, match="cannot run \\(tensors on cpu") as rec:
        assert _dispatch(args) is None
        assert _dispatch(args, with_kl=True) is None
    assert len([w for w in rec if "indexer-loss" in str(w.message)]) == 1
    with pytest.warns(RuntimeWarning, match="q_index's rows are not multiples") as rec:
        for width in (130, 132, 136):
            q = torch.zeros(2, 6, 32, width, dtype=torch.bfloat16)[..., 1:129]
            assert _dispatch((q, *args[1:])) is None
    assert len([w for w in rec if "indexer-loss" in str(w.message)]) == 1


def test_a_failed_launch_disables_its_variant_after_one_warning(monkeypatch):
    """A kernel that raises: None (the Triton kernel's turn) after one warning naming the
    error; the same variant then does not apply (silent); another KL form still tries; an
    out-of-memory error is raised, not taken for the kernel's failure."""
    monkeypatch.setattr(checks, "_warned", set())
    monkeypatch.setattr(sm90, "unsupported", lambda *a, **k: None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    calls = []

    def broken(*a, discard=False, **lockstep):
        calls.append(a[-1])
        raise RuntimeError("PTX assembly failed\nlong log")

    monkeypatch.setattr(sm90, "indexer_loss_bwd_sm90", broken)
    args = _case()
    key = sm90.variant(args[0], args[1], args[3], True, False)
    try:
        with pytest.warns(RuntimeWarning, match="cannot run .*RuntimeError: PTX assembly failed"):
            assert _dispatch(args) is None
        assert key in sm90._disabled
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _dispatch(args) is None  # disabled: not tried, not said again
        assert calls == [False]
        with pytest.warns(RuntimeWarning):
            assert _dispatch(args, with_kl=True) is None  # its own variant: tried
        assert calls == [False, True]
        seen = []
        monkeypatch.setattr(sm90, "indexer_loss_bwd_sm90",
                            lambda *a, discard=False, **kw: seen.append((discard, kw))
                            or a[:3])
        sm90._disabled.clear()
        sm90.run_if_supported(*args, torch.tensor(1.3), 0.7, True, deterministic=False,
                              with_kl=False, mode=MODE_DISCARD, lockstep=False)
        assert seen == [(True, dict(lockstep=False, lockstep_slack=1, key_passes=1))]
        seen.clear()
        sm90.run_if_supported(*args, torch.tensor(1.3), 0.7, True, deterministic=False,
                              with_kl=True, mode=0, lockstep=True, lockstep_slack=2)
        assert seen == [(False, dict(lockstep=True, lockstep_slack=2, key_passes=1))]  # paced

        def oom(*a, discard=False, **lockstep):
            raise torch.OutOfMemoryError("CUDA out of memory")

        monkeypatch.setattr(sm90, "indexer_loss_bwd_sm90", oom)
        sm90._disabled.clear()
        with pytest.raises(torch.OutOfMemoryError):
            _dispatch(args)
        assert not sm90._disabled
    finally:
        sm90._disabled.clear()


def test_a_failed_key_passes_variant_runs_one_pass(monkeypatch):
    """The key passes' variant failing to compile or launch: one warning, its variant disabled,
    and the same call runs one Gluon pass (not the Triton backward); later calls asking for
    passes go to one pass at once, without the warning again."""
    monkeypatch.setattr(checks, "_warned", set())
    monkeypatch.setattr(sm90, "unsupported", lambda *a, **k: None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    calls = []

    def kernel(*a, key_passes=1, **kw):
        calls.append(key_passes)
        if key_passes > 1:
            raise RuntimeError("PTX assembly failed")
        return a[:3]

    monkeypatch.setattr(sm90, "indexer_loss_bwd_sm90", kernel)
    args = _case()
    run = lambda: sm90.run_if_supported(*args, torch.tensor(1.3), 0.7, True,  # noqa: E731
                                        deterministic=False, with_kl=False, mode=0,
                                        lockstep=False, key_passes=3)
    try:
        with pytest.warns(RuntimeWarning, match="cannot run .*RuntimeError: PTX assembly"):
            assert run()[0] is args[0]
        assert calls == [3, 1]
        assert sm90.variant(args[0], args[1], args[3], True, False, key_passes=3) in sm90._disabled
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert run()[0] is args[0]
        assert calls == [3, 1, 1]
    finally:
        sm90._disabled.clear()


def test_a_gluon_module_that_does_not_load_warns_once(monkeypatch):
    """On a Hopper GPU with a Triton whose Gluon cannot load the kernel module: one warning,
    the Triton kernel, and the import not tried again."""
    import sys

    monkeypatch.setattr(checks, "_warned", set())
    common.gluon_module.cache_clear()
    from megatron_hyscale.ops import kernels

    monkeypatch.setitem(sys.modules, "megatron_hyscale.ops.kernels.indexer_loss_bwd_sm90", None)
    monkeypatch.delattr(kernels, "indexer_loss_bwd_sm90")
    try:
        with pytest.warns(RuntimeWarning, match="cannot be loaded"):
            assert kern._hopper_backward_module() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kern._hopper_backward_module() is None
        info = common.gluon_module.cache_info()
        assert (info.misses, info.hits) == (1, 1)  # the import tried once
    finally:
        common.gluon_module.cache_clear()


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_default_on_cpu_is_the_triton_kernel_without_a_word(deterministic):
    """On the CPU the option on (the default) changes nothing: no warning, the Triton path's
    outputs bitwise, the deterministic mode's too."""
    args = _case(seed=1, H=64)
    grad = torch.tensor(0.9)
    opts = replace(IndexerLossKernelOptions.DEFAULT, block_n=16)
    want = kern.indexer_loss_bwd(*args, grad, 0.5, True, deterministic,
                                 options=replace(opts, bwd_sm90=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kern.indexer_loss_bwd(*args, grad, 0.5, True, deterministic, options=opts)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_disable_is_per_variant_and_warns_once(monkeypatch):
    monkeypatch.setattr(checks, "_warned", set())
    q, w, k, idx, *_ = _tensors()
    key = sm90.variant(q, w, idx, True, False)
    try:
        with pytest.warns(RuntimeWarning,
                          match="indexer-loss backward cannot run.*CompilationError"):
            sm90.disable(key, "CompilationError: at 1:2\nlong MLIR dump ...")
        assert key in sm90._disabled
        assert sm90.variant(*_tensors(H=64)[:2], idx, True, False) not in sm90._disabled
        assert sm90.variant(q, w, idx, False, False) not in sm90._disabled
        assert sm90.variant(q, w, idx, True, True) not in sm90._disabled
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sm90.warn_cannot_run(f"{key}: CompilationError: at 1:2")  # same cause: silent
    finally:
        sm90._disabled.discard(key)

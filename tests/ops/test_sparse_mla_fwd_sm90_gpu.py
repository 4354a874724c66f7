"""The Hopper (Gluon) sparse-MLA forward on the GPU against the fp32 reference and the Triton
forward: GLM-5.1 and DeepSeek-V3.2 shapes (and 32 / 16 heads, padded, warp-specialized only),
both launch orders, key counts off the 64-key tile and none at all, empty and half-empty rows,
int64 and per-KV-head index layouts, batch 2, strided queries, fp16, the 128 / 256-channel
variants, and the dispatch of `sparse_attention` (which kernel runs, the warning when it
cannot). Each case runs three forms: the plain kernel, the warp-specialized one
(`AttentionKernelOptions.fwd_sm90_ws`; odd tile counts leave its second consumer a tile of no
key) and that one in lockstep (`fwd_lockstep`: one program an SM, sorted rows, over several
waves too).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from megatron_hyscale.ops.kernels.options import AttentionKernelOptions

pytestmark = pytest.mark.gpu

OUT_TOL = 1e-2  # bf16 operands, fp32 accumulation, as tests/ops/test_sparse_attention_gpu.py
# Two bf16 outputs of the same sums added in other orders (the lockstep forward visits each
# row's keys sorted): each rounded to bf16 once, so they may differ by one bf16 step (2^-8
# relative) anywhere; their norm-relative difference stays below it. It was 2.08e-3 for the
# lockstep forward on an H100 and an H200 (2026-12-05) against 2e-3 asked before.
BF16_STEP = 2.0 ** -8


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")


def inputs(hq, T, S, K, seed, B=1, dtype=torch.bfloat16, d=576):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, hq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, S, 1, d, device="cuda", generator=g).to(dtype)
    idx = torch.rand(B * T, S, device="cuda", generator=g).topk(K, dim=-1).indices
    idx = idx.view(B, T, K).to(torch.int32)
    idx[:, min(7, T - 1), K // 2:] = -1  # a half-empty row
    idx[:, min(11, T - 1)] = -1  # a row with no valid index
    if K > 3:
        idx[:, 0, 1::3] = -1  # holes in the middle of a row
    return q, k, idx, d ** -0.5


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def reference(q, k, idx, scale, sink=None):
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    dv = 1 << (q.shape[-1].bit_length() - 1)  # V = K's power-of-two main part
    return sparse_attention(q.float(), k.float(), None, idx, scale, dv=dv, sink=sink,
                            return_lse=True, backend="reference")


# The plain Gluon forward, the warp-specialized one, and that one in lockstep (fwd_lockstep).
KERNELS = pytest.mark.parametrize("ws", [False, True, "lockstep"],
                                  ids=["gluon", "ws", "ws_lockstep"])


def run(q, k, idx, scale, adjacent=True, ws=False, sink=None, slack=1):
    from megatron_hyscale.ops.kernels.sparse_mla_fwd_sm90 import sparse_mla_fwd_sm90

    # adjacent: the launch order the Triton kernels share (common.launch_grid)
    options = replace(AttentionKernelOptions.DEFAULT, head_blocks_adjacent=adjacent,
                      fwd_sm90_ws=bool(ws), fwd_lockstep=ws == "lockstep",
                      fwd_lockstep_slack=slack)
    return sparse_mla_fwd_sm90(q, k, idx, scale, sink=sink, options=options)


def check(out, lse, ref_out, ref_lse):
    assert torch.isfinite(out).all()
    assert rel(out, ref_out) < OUT_TOL
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)  # -inf exactly where the row is empty
    assert (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-2
    empty = ~fin
    if empty.any():
        assert (out.float().abs().amax(-1)[empty] == 0).all()


@needs_hopper
@KERNELS
@pytest.mark.parametrize("hq,K,adjacent", [(64, 2048, True), (128, 2048, True),
                                           (128, 2048, False), (64, 2000, True),
                                           (64, 130, True), (64, 100, True), (64, 5, True)])
def test_matches_reference(hq, K, adjacent, ws):
    q, k, idx, scale = inputs(hq, 64, 4096, K, seed=hq + K)
    out, lse = run(q, k, idx, scale, adjacent, ws)
    ref_out, ref_lse = reference(q, k, idx, scale)
    check(out, lse, ref_out, ref_lse)


@needs_hopper
@pytest.mark.parametrize("hq,T,K,slack", [(64, 300, 640, 1), (128, 200, 2048, 2),
                                         (32, 140, 700, 1)])
def test_lockstep_over_several_waves(hq, T, K, slack):
    """More work items than SMs (a last wave part-full), rows sorted in the wrapper (the
    caller's indices untouched), slack 1 and 2, 32 heads padded: the reference's output."""
    q, k, idx, scale = inputs(hq, T, 4096, K, seed=T + K)
    before = idx.clone()
    out, lse = run(q, k, idx, scale, ws="lockstep", slack=slack)
    assert torch.equal(idx, before)
    check(out, lse, *reference(q, k, idx, scale))


@needs_hopper
@pytest.mark.parametrize("hq,K", [(32, 2048), (16, 130)])
def test_warp_specialized_kernel_pads_fewer_heads(hq, K):
    """Tensor parallelism's share of GLM-5.1's 64 heads: one block padded with zero queries,
    their rows not stored (the plain kernel takes multiples of 64 only)."""
    q, k, idx, scale = inputs(hq, 64, 4096, K, seed=hq + K)
    out, lse = run(q, k, idx, scale, ws=True)
    assert out.shape[2] == lse.shape[2] == hq
    check(out, lse, *reference(q, k, idx, scale))


@needs_hopper
@KERNELS
@pytest.mark.parametrize("d", [192, 320])
def test_narrower_variants_match_reference(d, ws):
    q, k, idx, scale = inputs(64, 64, 2048, 700, seed=d, d=d)
    check(*run(q, k, idx, scale, ws=ws), *reference(q, k, idx, scale))


@needs_hopper
@KERNELS
def test_no_slot_at_all_gives_empty_rows(ws):
    q, k, _, scale = inputs(64, 8, 256, 4, seed=1)
    idx = torch.empty(1, 8, 0, device="cuda", dtype=torch.int32)
    out, lse = run(q, k, idx, scale, ws=ws)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@needs_hopper
@KERNELS
def test_agrees_with_the_triton_forward(ws):
    from megatron_hyscale.ops.kernels import sparse_attention as sa

    q, k, idx, scale = inputs(64, 256, 8192, 2048, seed=3)
    out, lse = run(q, k, idx, scale, ws=ws)
    t_out, t_lse = sa.sparse_attention_fwd(
        q, k, None, idx, scale, dv=512,
        options=replace(AttentionKernelOptions.DEFAULT, fwd_sm90=False))
    assert rel(out, t_out) < BF16_STEP
    fin = torch.isfinite(t_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - t_lse[fin]).abs().max().item() < 1e-3


@needs_hopper
@KERNELS
def test_batch_int64_per_head_indices_strided_q_and_fp16(ws):
    q, k, idx, scale = inputs(64, 48, 2048, 300, seed=5, B=2, dtype=torch.float16)
    # Strided queries: a view into wider rows (row stride 640, still 16-byte aligned).
    wide = torch.zeros(*q.shape[:-1], 640, device="cuda", dtype=q.dtype)
    wide[..., :576] = q
    qs = wide[..., :576]
    out, lse = run(qs, k, idx.long()[:, :, None, :], scale, ws=ws)
    ref_out, ref_lse = reference(q, k, idx, scale)
    check(out, lse, ref_out, ref_lse)


@needs_hopper
@KERNELS
def test_integer_valued_inputs_give_the_reference_scores(ws):
    """Small integers make every q . k exact in fp32: the log-sum-exp then depends only on the
    softmax's own rounding, so it must match the reference to fp32 accuracy."""
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randint(-2, 3, (1, 32, 64, 576), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randint(-2, 3, (1, 1024, 1, 576), device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.rand(32, 1024, device="cuda", generator=g).topk(640, dim=-1).indices
    idx = idx.view(1, 32, 640).to(torch.int32)
    scale = 1 / 64  # a power of two: the scaled scores stay exact
    out, lse = run(q, k, idx, scale, ws=ws)
    ref_out, ref_lse = reference(q, k, idx, scale)
    assert (lse - ref_lse).abs().max().item() < 1e-4
    assert rel(out, ref_out) < OUT_TOL


@needs_hopper
def test_sparse_attention_dispatches_to_it_and_differentiates():
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_sm90 as sm90
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    finished = []
    real = sm90.sparse_mla_fwd_sm90

    def counting(*a, **kw):
        res = real(*a, **kw)
        finished.append(1)  # only a call that returned counts (a failure falls back)
        return res

    q, k, idx, scale = inputs(64, 32, 1024, 256, seed=11)
    q.requires_grad_(True)
    sm90.sparse_mla_fwd_sm90 = counting
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning either
            out = sparse_attention(q, k, None, idx, scale, dv=512)
        # A sink (DeepSeek-V4) is the warp-specialized kernel's (the default): a call, no
        # warning; the plain kernel (fwd_sm90_ws=False) leaves it to Triton: no call.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sparse_attention(q.detach(), k, None, idx, scale, dv=512,
                             sink=torch.zeros(64, device="cuda"))
            sparse_attention(q.detach(), k, None, idx, scale, dv=512,
                             sink=torch.zeros(64, device="cuda"),
                             options=replace(AttentionKernelOptions.DEFAULT,
                                             fwd_sm90_ws=False))
    finally:
        sm90.sparse_mla_fwd_sm90 = real
    assert finished == [1, 1] and not sm90._disabled
    ref_out, _ = reference(q.detach(), k, idx, scale)
    assert rel(out, ref_out) < OUT_TOL
    out.float().square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@needs_hopper
@pytest.mark.parametrize("width", [579, 584])  # 579: rows of odd bytes; 584 = 8 x 73
def test_unaligned_rows_warn_once_and_use_the_triton_forward(width, monkeypatch):
    from megatron_hyscale.ops import checks
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_sm90 as sm90
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    q, k, idx, scale = inputs(64, 16, 512, 128, seed=13)
    wide = torch.zeros(1, 16, 64, width, device="cuda", dtype=q.dtype)
    wide[..., :576] = q
    qs = wide[..., :576]
    monkeypatch.setattr(checks, "_warned", set())  # the other width warned already
    with pytest.warns(RuntimeWarning, match="q's rows"):
        out = sparse_attention(qs, k, None, idx, scale, dv=512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        sparse_attention(qs, k, None, idx, scale, dv=512)
    assert not sm90._disabled  # a layout problem is not a failure: nothing disabled
    ref_out, _ = reference(q, k, idx, scale)
    assert rel(out, ref_out) < OUT_TOL


@needs_hopper
def test_warp_specialized_kernel_agrees_with_the_plain_one_and_is_dispatched(monkeypatch):
    """Both Gluon kernels on the same inputs (V3.2's two head blocks, a partial last tile), and
    `sparse_attention` with fwd_sm90_ws runs the warp-specialized one without a warning."""
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_sm90 as sm90
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_ws_sm90 as ws_mod
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    q, k, idx, scale = inputs(128, 128, 8192, 1984, seed=17)
    out, lse = run(q, k, idx, scale)
    ws_out, ws_lse = run(q, k, idx, scale, ws=True)
    assert rel(ws_out, out) < 2e-3
    assert torch.equal(torch.isfinite(ws_lse), torch.isfinite(lse))
    fin = torch.isfinite(lse)
    assert (ws_lse[fin] - lse[fin]).abs().max().item() < 1e-3
    calls = []
    real = ws_mod.launch

    def counting(*a, **kw):
        res = real(*a, **kw)
        calls.append(1)
        return res

    monkeypatch.setattr(ws_mod, "launch", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = sparse_attention(q, k, None, idx, scale, dv=512, options=replace(
            AttentionKernelOptions.DEFAULT, fwd_sm90_ws=True))
    assert calls == [1] and not sm90._disabled
    assert rel(got, ws_out) == 0.0


@needs_hopper
@pytest.mark.parametrize("d,K", [(512, 640), (256, 700), (512, 5)])
def test_warp_specialized_kernel_takes_k_equal_v_and_a_sink(d, K, monkeypatch):
    """DeepSeek-V4's form (CSA: K = V of 512 channels, no tail, a sink a head): every row's lse
    is finite (the sink joins each denominator), the row without keys writes zeros and lse =
    its sink; and `sparse_attention` runs it there only with fwd_sm90_ws (the default since
    2026-12-05)."""
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_ws_sm90 as ws_mod
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    q, k, idx, scale = inputs(64, 64, 2048, K, seed=d + K, d=d)
    sink = torch.randn(64, device="cuda")
    out, lse = run(q, k, idx, scale, ws=True, sink=sink)
    ref_out, ref_lse = reference(q, k, idx, scale, sink=sink)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel(out, ref_out) < OUT_TOL
    assert (lse - ref_lse).abs().max().item() < 1e-2
    assert (out[:, 11] == 0).all() and torch.allclose(lse[0, 11], sink)  # the empty row
    calls = []
    real = ws_mod.launch

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ws_mod, "launch", counting)
    got = sparse_attention(q, k, None, idx, scale, sink=sink, options=replace(
        AttentionKernelOptions.DEFAULT, fwd_sm90_ws=True))
    sparse_attention(q, k, None, idx, scale, sink=sink, options=replace(  # the Triton one
        AttentionKernelOptions.DEFAULT, fwd_sm90_ws=False))
    assert calls == [1] and rel(got, out) == 0.0


@needs_hopper
def test_warp_specialized_kernel_with_no_slot_at_all_gives_the_sink():
    q, k, _, scale = inputs(64, 8, 256, 4, seed=2, d=512)
    idx = torch.empty(1, 8, 0, device="cuda", dtype=torch.int32)
    sink = torch.randn(64, device="cuda")
    out, lse = run(q, k, idx, scale, ws=True, sink=sink)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sink.expand(1, 8, 64))


def _hca_inputs(B=2, T=48, S=512, K=128, seed=5, hq=64):
    """HCA's form: K = V of 512 channels, a sink a head, each row a dense prefix of keys
    0 .. n - 1 (0, inside one tile, on tile edges, several tiles) before K listed keys from
    n on (holes, a half-empty row, a row with none)."""
    q, k, _, scale = inputs(hq, T, S, 4, seed=seed, B=B, d=512)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    pre = torch.randint(0, 300, (B, T), device="cuda", generator=g, dtype=torch.int32)
    pre[:, :8] = torch.tensor([0, 1, 63, 64, 65, 127, 128, 129], device="cuda",
                              dtype=torch.int32)
    listed = torch.rand(B * T, S - 300, device="cuda", generator=g).topk(K, dim=-1).indices
    idx = (listed.view(B, T, K) + 300).to(torch.int32)  # past every prefix: distinct keys
    idx[:, 3, K // 2:] = -1
    idx[:, 9] = -1
    idx[:, 0, 1::3] = -1
    return q, k, idx, pre, scale


@needs_hopper
@pytest.mark.parametrize("hq,K,lockstep", [(64, 128, False), (64, 5, False), (32, 128, True),
                                           (128, 128, False)])
def test_warp_specialized_kernel_takes_a_dense_prefix(hq, K, lockstep, monkeypatch):
    """DeepSeek-V4's HCA form (`prefix_lengths`): each row's own count of key tiles, against
    the fp32 reference and the Triton forward; row 0 of batch 0 with neither prefix nor listed
    keys holds the sink only; `sparse_attention` runs it there under
    `AttentionKernelOptions.prefix_sm90` (the default) only. 32 heads: one padded block;
    128: two blocks; lockstep asked: runs unpaced."""
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_ws_sm90 as ws_mod
    from megatron_hyscale.ops.kernels.sparse_mla_fwd_sm90 import sparse_mla_fwd_sm90
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    def unpaced(*args, **kwargs):
        raise AssertionError("a dense prefix runs unpaced")

    monkeypatch.setattr(ws_mod, "lockstep_plan", unpaced)
    q, k, idx, pre, scale = _hca_inputs(K=K, seed=K + hq, hq=hq)
    idx[0, 0] = -1  # row 0 of batch 0: prefix 0 and no listed key
    sink = torch.randn(hq, device="cuda")
    options = replace(AttentionKernelOptions.DEFAULT, fwd_sm90_ws=True, prefix_sm90=True,
                      fwd_lockstep=lockstep)
    out, lse = sparse_mla_fwd_sm90(q, k, idx, scale, sink=sink, options=options,
                                   prefix_lengths=pre)
    ref_out, ref_lse = sparse_attention(q.float(), k.float(), None, idx, scale, sink=sink,
                                        prefix_lengths=pre, return_lse=True,
                                        backend="reference")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel(out, ref_out) < OUT_TOL
    assert (lse - ref_lse).abs().max().item() < 1e-2
    assert (out[0, 0] == 0).all() and torch.allclose(lse[0, 0], sink)
    tri_out, tri_lse = sparse_attention(q, k, None, idx, scale, sink=sink, prefix_lengths=pre,
                                        return_lse=True, options=replace(
                                            options, fwd_sm90=False))
    assert rel(out, tri_out) < BF16_STEP
    assert (lse - tri_lse).abs().max().item() < 1e-4
    calls = []
    real = ws_mod.launch

    def counting(*a, **kw):
        calls.append(kw.get("prefix_lengths") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(ws_mod, "launch", counting)
    got = sparse_attention(q, k, None, idx, scale, sink=sink, prefix_lengths=pre,
                           options=options)
    assert calls == [True] and rel(got, out) == 0.0
    # prefix_sm90=False: the Triton forward
    sparse_attention(q, k, None, idx, scale, sink=sink, prefix_lengths=pre,
                     options=replace(options, prefix_sm90=False))
    assert calls == [True]


@needs_hopper
def test_warp_specialized_kernel_with_a_prefix_and_no_listed_slot():
    """No listed slot at all (indices [B, T, 0]): the prefix alone, as the reference."""
    from megatron_hyscale.ops.kernels.sparse_mla_fwd_sm90 import sparse_mla_fwd_sm90
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    q, k, idx, pre, scale = _hca_inputs(B=1, T=16)
    none = idx[..., :0]
    sink = torch.randn(64, device="cuda")
    out, lse = sparse_mla_fwd_sm90(q, k, none, scale, sink=sink, prefix_lengths=pre,
                                   options=replace(AttentionKernelOptions.DEFAULT,
                                                   fwd_sm90_ws=True))
    ref_out, ref_lse = sparse_attention(q.float(), k.float(), None, none, scale, sink=sink,
                                        prefix_lengths=pre, return_lse=True,
                                        backend="reference")
    assert rel(out, ref_out) < OUT_TOL
    assert (lse - ref_lse).abs().max().item() < 1e-2

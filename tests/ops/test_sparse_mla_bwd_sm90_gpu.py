"""The Hopper (Gluon) warp-specialized sparse-MLA backward (`AttentionKernelOptions.bwd_sm90`, with
8- and 16-byte dK atomics: `bwd_dk_vec4`, and in lockstep: `bwd_lockstep`) on the GPU, against
the Triton backward (same bf16 roundings of P and dS: only the fp32 summation order differs) and
the fp32 reference: GLM-5.1 and DeepSeek-V3.2 shapes (one and two head blocks, both launch
orders; 32 and 16 heads, tensor parallelism's share, padded to one block), DeepSeek-V4's K = V
with a sink, key counts off the 64-key tile and none at all, empty and half-empty rows, the
lse's gradient, the indexer loss's target, batch 2 with int64 per-KV-head indices, strided
queries and fp16, integer-valued inputs, and the dispatch (which kernel runs, the warnings when
it cannot).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from megatron_hyscale.ops.kernels.options import AttentionKernelOptions

pytestmark = pytest.mark.gpu

GRAD_TOL = 2e-2  # against the fp32 reference: dS is rounded to bf16 before its products
SAME_TOL = 5e-3  # against the Triton backward: bf16 outputs, fp32 order only
SM90 = replace(AttentionKernelOptions.DEFAULT, bwd_sm90=True)
TRITON = replace(AttentionKernelOptions.DEFAULT, bwd_sm90=False)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")


def inputs(hq, T, S, K, seed, B=1, dtype=torch.bfloat16, d=576, sink=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, hq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, S, 1, d, device="cuda", generator=g).to(dtype)
    idx = torch.rand(B * T, S, device="cuda", generator=g).topk(K, dim=-1).indices
    idx = idx.view(B, T, K).to(torch.int32)
    idx[:, min(7, T - 1), K // 2:] = -1  # a half-empty row
    idx[:, min(11, T - 1)] = -1  # a row with no valid index
    if K > 3:
        idx[:, 0, 1::3] = -1  # holes in the middle of a row
    s = torch.randn(hq, device="cuda", generator=g) if sink else None
    dout = torch.randn(B, T, hq, 1 << (d.bit_length() - 1), device="cuda", generator=g)
    return q, k, idx, s, dout.to(dtype), d ** -0.5


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def forward(q, k, idx, scale, sink):
    from megatron_hyscale.ops.kernels import sparse_attention as sa

    dv = 1 << (q.shape[-1].bit_length() - 1)
    return sa.sparse_attention_fwd(q, k, None, idx, scale, dv=dv, sink=sink)


def backward(q, k, idx, scale, sink, out, lse, dout, options, dlse=None, target=False,
             keys_ascending=False):
    """(dq, dk, dsink[, target]) of the kernel backward under `options`, counting launches of
    the Gluon kernel."""
    from megatron_hyscale.ops.kernels import sparse_attention as sa

    dv = 1 << (q.shape[-1].bit_length() - 1)
    if target:
        dq, dk, dvv, dsink, tgt = sa.sparse_attention_bwd_with_target(
            q, k, None, idx, scale, out, lse, dout, dlse=dlse, dv=dv, sink=sink, options=options,
            keys_ascending=keys_ascending)
        assert dvv is None
        return dq, dk, dsink, tgt
    dq, dk, dvv, dsink = sa.sparse_attention_bwd(q, k, None, idx, scale, out, lse, dout,
                                                 dlse=dlse, dv=dv, sink=sink, options=options,
                                                 keys_ascending=keys_ascending)
    assert dvv is None
    return dq, dk, dsink


class _Calls(list):
    """One 1 a completed call; `kw`: each call's keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.kw: list[dict] = []


@pytest.fixture
def launches(monkeypatch):
    """The Gluon backward's completed calls (a failing one falls back and does not count)."""
    from megatron_hyscale.ops.kernels import sparse_mla_bwd_sm90 as bwd

    calls = _Calls()
    real = bwd.sparse_mla_bwd_sm90

    def counting(*a, **kw):
        res = real(*a, **kw)
        calls.append(1)
        calls.kw.append(kw)
        return res

    monkeypatch.setattr(bwd, "sparse_mla_bwd_sm90", counting)
    return calls


@pytest.fixture(params=["red8", "red16", "lockstep"])
def sm90(request):
    """The Gluon backward with 8-byte and with 16-byte dK atomics
    (`AttentionKernelOptions.bwd_dk_vec4`), and in lockstep (`bwd_lockstep`: one program an
    SM over the work items, rows sorted unless a target is emitted)."""
    return replace(SM90, bwd_dk_vec4=request.param != "red8",
                   bwd_lockstep=request.param == "lockstep")


def check_same(got, want):
    names = ("dq", "dk", "dsink", "target")[:len(want)]
    for name, a, b in zip(names, got, want, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < SAME_TOL, (name, rel(a, b))


@needs_hopper
@pytest.mark.parametrize("hq,K,adjacent", [(64, 2048, True), (128, 2048, True),
                                           (128, 2048, False), (64, 2000, True),
                                           (64, 130, True), (64, 100, True), (64, 5, True),
                                           (32, 2048, True), (16, 300, True)])
def test_matches_the_triton_backward(hq, K, adjacent, launches, sm90):
    """32 and 16 heads: tensor parallelism's share of GLM-5.1's 64, one block padded."""
    q, k, idx, _, dout, scale = inputs(hq, 64, 4096, K, seed=hq + K)
    out, lse = forward(q, k, idx, scale, None)
    got = backward(q, k, idx, scale, None, out, lse, dout,
                   replace(sm90, head_blocks_adjacent=adjacent))
    want = backward(q, k, idx, scale, None, out, lse, dout, TRITON)
    assert launches == [1] and launches.kw[0]["dk_vec4"] == sm90.bwd_dk_vec4
    check_same(got, want)
    assert torch.equal(got[0][0, 11], torch.zeros_like(got[0][0, 11]))  # the empty row


@needs_hopper
@pytest.mark.parametrize("hq,T,slack", [(64, 300, 1), (128, 200, 2), (32, 140, 1)])
def test_lockstep_over_several_waves(hq, T, slack, launches):
    """More work items than SMs (a last wave part-full), the rows sorted in the wrapper (the
    caller's indices untouched), the slack 1 and 2: the default backward's gradients."""
    q, k, idx, _, dout, scale = inputs(hq, T, 4096, 640, seed=T + slack)
    before = idx.clone()
    out, lse = forward(q, k, idx, scale, None)
    lock = replace(SM90, bwd_dk_vec4=True, bwd_lockstep=True, bwd_lockstep_slack=slack)
    got = backward(q, k, idx, scale, None, out, lse, dout, lock)
    want = backward(q, k, idx, scale, None, out, lse, dout, replace(SM90, bwd_lockstep=False))
    assert launches == [1, 1] and launches.kw[0]["lockstep"] and not launches.kw[1]["lockstep"]
    assert torch.equal(idx, before)
    check_same(got, want)


@needs_hopper
@pytest.mark.parametrize("hq", [64, 128])
def test_lockstep_on_rows_already_in_key_order(hq, launches):
    """keys_ascending (the DSA layer's HyTopK rows, order="key": ascending, -1 last): the
    wrapper runs the rows as they are and writes the target in place; the same gradients and
    target as the sorting lockstep and the unpaced backward."""
    from megatron_hyscale.ops.key_order import sort_rows_by_key

    q, k, idx, _, dout, scale = inputs(hq, 300, 4096, 640, seed=hq + 1)
    sort_rows_by_key(idx)
    out, lse = forward(q, k, idx, scale, None)
    lock = replace(SM90, bwd_dk_vec4=True, bwd_lockstep=True)
    got = backward(q, k, idx, scale, None, out, lse, dout, lock, target=True,
                   keys_ascending=True)
    sorting = backward(q, k, idx, scale, None, out, lse, dout, lock, target=True)
    unpaced = backward(q, k, idx, scale, None, out, lse, dout,
                       replace(lock, bwd_lockstep=False), target=True)
    assert [kw["keys_ascending"] for kw in launches.kw] == [True, False, False]
    check_same(got, sorting)
    check_same(got, unpaced)
    assert torch.equal(got[3] < 0, idx < 0)


@needs_hopper
def test_matches_the_fp32_reference_through_autograd(launches):
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    q, k, idx, _, dout, scale = inputs(64, 128, 2048, 700, seed=2)
    leaves = [x.clone().requires_grad_(True) for x in (q, k)]
    out = sparse_attention(*leaves[:2], None, idx, scale, dv=512, options=SM90)
    out.backward(dout)
    ref = [x.detach().float().requires_grad_(True) for x in (q, k)]
    sparse_attention(*ref, None, idx, scale, dv=512, backend="reference").backward(dout.float())
    assert launches == [1]
    for got, want in zip(leaves, ref, strict=True):
        assert rel(got.grad, want.grad) < GRAD_TOL


@needs_hopper
def test_lse_gradient_and_the_indexer_target(launches, sm90):
    """The lse's gradient enters dS; the target (P summed over the heads at each slot) is the
    Triton dQ kernel's, one head block (stored, -1 at unused slots), two (added), and one
    padded (32 heads)."""
    for hq in (64, 128, 32):
        q, k, idx, _, dout, scale = inputs(hq, 64, 4096, 1000, seed=hq)
        out, lse = forward(q, k, idx, scale, None)
        dlse = torch.randn_like(lse)
        got = backward(q, k, idx, scale, None, out, lse, dout, sm90, dlse=dlse, target=True)
        want = backward(q, k, idx, scale, None, out, lse, dout, TRITON, dlse=dlse, target=True)
        check_same(got, want)
        assert torch.equal(got[3] < 0, idx < 0)
        valid = idx >= 0
        assert (got[3][valid] - want[3][valid]).abs().max().item() < 1e-5
    assert launches == [1, 1, 1]


@needs_hopper
@pytest.mark.parametrize("hq,K", [(64, 640), (64, 130), (32, 640)])
def test_k_equals_v_with_a_sink(hq, K, launches, sm90):
    """DeepSeek-V4's CSA / window form: 512 channels, no tail, V = K, a sink per head (32
    heads: padded, the padded heads' sink terms not written)."""
    q, k, idx, sink, dout, scale = inputs(hq, 64, 2048, K, seed=K, d=512, sink=True)
    out, lse = forward(q, k, idx, scale, sink)
    got = backward(q, k, idx, scale, sink, out, lse, dout, sm90)
    want = backward(q, k, idx, scale, sink, out, lse, dout, TRITON)
    assert launches == [1]
    check_same(got, want)


@needs_hopper
@pytest.mark.parametrize("d", [192, 320])
def test_narrower_variants(d, launches, sm90):
    q, k, idx, _, dout, scale = inputs(64, 64, 2048, 700, seed=d, d=d)
    out, lse = forward(q, k, idx, scale, None)
    check_same(backward(q, k, idx, scale, None, out, lse, dout, sm90),
               backward(q, k, idx, scale, None, out, lse, dout, TRITON))
    assert launches == [1]


@needs_hopper
def test_batch_int64_per_head_indices_strided_q_and_fp16(launches, sm90):
    q, k, idx, _, dout, scale = inputs(64, 48, 2048, 300, seed=5, B=2, dtype=torch.float16)
    wide = torch.zeros(*q.shape[:-1], 640, device="cuda", dtype=q.dtype)
    wide[..., :576] = q
    qs = wide[..., :576]  # row stride 640: a view, still 16-byte aligned
    idx4 = idx.long()[:, :, None, :]
    out, lse = forward(q, k, idx, scale, None)
    got = backward(qs, k, idx4, scale, None, out, lse, dout, sm90)
    want = backward(q, k, idx, scale, None, out, lse, dout, TRITON)
    assert launches == [1]
    check_same(got, want)


@needs_hopper
def test_the_dsa_layers_dout_and_target(launches, sm90):
    """The DSA layer's dout: the gradient of its V up-projection (einsum "bshc,hdc->sbhd" of
    one sequence), heads outermost with a batch stride of 1, which the kernel takes as 0; the
    indexer loss's target emitted (the layer's default path)."""
    q, k, idx, _, _, scale = inputs(64, 96, 4096, 2048, seed=21)
    out, lse = forward(q, k, idx, scale, None)
    g = torch.Generator(device="cuda").manual_seed(22)
    up_v = torch.randn(64, 128, 512, device="cuda", generator=g).to(q.dtype)
    grad = torch.randn(96, 1, 64, 128, device="cuda", generator=g).to(q.dtype)
    out_req = out.detach().requires_grad_()
    torch.einsum("bshc,hdc->sbhd", out_req, up_v).backward(grad)
    dout = out_req.grad
    if dout.stride(0) % 16 == 0:  # torch's einsum made another layout: force the layer's
        dout = torch.empty_strided(dout.shape, (1, 512, 96 * 512, 1), device="cuda",
                                   dtype=dout.dtype).copy_(dout)
    got = backward(q, k, idx, scale, None, out, lse, dout, sm90, target=True)
    want = backward(q, k, idx, scale, None, out, lse, dout.contiguous(), TRITON, target=True)
    assert launches == [1]
    check_same(got, want)


@needs_hopper
def test_no_slot_at_all(launches):
    q, k, _, sink, dout, scale = inputs(64, 8, 256, 4, seed=1, d=512, sink=True)
    idx = torch.empty(1, 8, 0, device="cuda", dtype=torch.int32)
    out, lse = forward(q, k, idx, scale, sink)
    dq, dk, dsink = backward(q, k, idx, scale, sink, out, lse, dout, SM90)
    want = backward(q, k, idx, scale, sink, out, lse, dout, TRITON)
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))
    assert rel(dsink, want[2]) < SAME_TOL
    assert launches == [1]


@needs_hopper
def test_integer_valued_inputs(launches, sm90):
    """Small integers make every q . k exact in fp32: P then differs from the Triton
    backward's only where Delta's summation order does."""
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randint(-2, 3, (1, 32, 64, 576), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randint(-2, 3, (1, 1024, 1, 576), device="cuda", generator=g).to(torch.bfloat16)
    dout = torch.randint(-2, 3, (1, 32, 64, 512), device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.rand(32, 1024, device="cuda", generator=g).topk(640, dim=-1).indices
    idx = idx.view(1, 32, 640).to(torch.int32)
    out, lse = forward(q, k, idx, 1 / 64, None)
    got = backward(q, k, idx, 1 / 64, None, out, lse, dout, sm90)
    want = backward(q, k, idx, 1 / 64, None, out, lse, dout, TRITON)
    check_same(got, want)
    assert launches == [1]


@needs_hopper
def test_deterministic_and_unaligned_rows_warn_and_run_the_triton_backward(launches,
                                                                          monkeypatch):
    from megatron_hyscale.ops import checks
    from megatron_hyscale.ops.kernels import sparse_mla_bwd_sm90 as bwd

    monkeypatch.setattr(checks, "_warned", set())
    q, k, idx, _, dout, scale = inputs(64, 16, 512, 128, seed=13)
    out, lse = forward(q, k, idx, scale, None)
    from megatron_hyscale.ops.kernels import sparse_attention as sa

    with pytest.warns(RuntimeWarning, match="deterministic"):
        det = sa.sparse_attention_bwd(q, k, None, idx, scale, out, lse, dout, dv=512,
                                      deterministic=True, options=SM90)
    wide = torch.zeros(1, 16, 64, 584, device="cuda", dtype=dout.dtype)
    wide[..., :512] = dout
    with pytest.warns(RuntimeWarning, match="dout's rows"):
        odd = backward(q, k, idx, scale, None, out, lse, wide[..., :512], SM90)
    assert launches == [] and not bwd._disabled
    want = backward(q, k, idx, scale, None, out, lse, dout, TRITON)
    check_same((det[0], det[1], None), want)
    check_same(odd, want)


@needs_hopper
def test_other_shapes_run_the_triton_backward_silently(launches):
    """QSA-like GQA (two KV heads, separate V) is not this kernel's case: no call, no warning."""
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(1, 16, 8, 256, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, 256, 2, 256, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(1, 256, 2, 256, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.rand(16 * 2, 256, device="cuda", generator=g).topk(64, dim=-1).indices
    idx = idx.view(1, 16, 2, 64).to(torch.int32)
    from megatron_hyscale.ops.kernels import sparse_attention as sa

    out, lse = sa.sparse_attention_fwd(q, k, v, idx, 1 / 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sa.sparse_attention_bwd(q, k, v, idx, 1 / 16, out, lse, torch.ones_like(out),
                                options=SM90)
    assert launches == []


def _row_rel(a, b):
    """Largest relative difference of one query row's [heads x D] block (a dropped or doubled
    key shows in its own row, not diluted by the others)."""
    a, b = a.float().flatten(2), b.float().flatten(2)
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).max().item()


@needs_hopper
@pytest.mark.parametrize("hq,K", [(64, 128), (64, 5), (32, 128), (64, 0)])
def test_k_equals_v_with_a_sink_and_a_dense_prefix(hq, K, launches, sm90, monkeypatch):
    """DeepSeek-V4's HCA form (`prefix_lengths`: keys 0 .. n - 1 before the listed ones, n
    from 0 over several tiles; lockstep asked runs unpaced; 32 heads: one padded block; no
    listed slot at all; `AttentionKernelOptions.prefix_sm90`, the default): against the Triton
    backward (also row by row) and the fp32 reference's gradients (autograd)."""
    from megatron_hyscale.ops.kernels import sparse_attention as sa
    from megatron_hyscale.ops.kernels import sparse_mla_bwd_sm90 as bwd
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    def unpaced(*args, **kwargs):
        raise AssertionError("a dense prefix runs unpaced")

    monkeypatch.setattr(bwd, "lockstep_plan", unpaced)
    B, T, S = 2, 48, 512
    q, k, _, sink, dout, scale = inputs(hq, T, S, 4, seed=K + hq, B=B, d=512, sink=True)
    g = torch.Generator(device="cuda").manual_seed(K)
    pre = torch.randint(0, 300, (B, T), device="cuda", generator=g, dtype=torch.int32)
    pre[:, :8] = torch.tensor([0, 1, 63, 64, 65, 127, 128, 129], device="cuda",
                              dtype=torch.int32)
    listed = torch.rand(B * T, S - 300, device="cuda", generator=g).topk(K, dim=-1).indices
    idx = (listed.view(B, T, K) + 300).to(torch.int32)  # past every prefix: distinct keys
    if K:
        idx[:, 3, K // 2:] = -1
        idx[:, 9] = -1
        idx[0, 0] = -1  # prefix 0 and no listed key: the sink only
    out, lse = sa.sparse_attention_fwd(q, k, None, idx, scale, dv=512, sink=sink,
                                       prefix_lengths=pre)
    # prefix_sm90=False: the Triton backward
    sa.sparse_attention_bwd(q, k, None, idx, scale, out, lse, dout, dv=512, sink=sink,
                            prefix_lengths=pre, options=replace(sm90, prefix_sm90=False))
    assert launches == []
    got = sa.sparse_attention_bwd(q, k, None, idx, scale, out, lse, dout, dv=512, sink=sink,
                                  prefix_lengths=pre, options=sm90)  # prefix_sm90 by default
    want = sa.sparse_attention_bwd(q, k, None, idx, scale, out, lse, dout, dv=512, sink=sink,
                                   prefix_lengths=pre, options=TRITON)
    assert launches == [1] and launches.kw[0]["prefix_lengths"] is pre
    assert got[2] is None and want[2] is None
    check_same((got[0], got[1], got[3]), (want[0], want[1], want[3]))
    assert _row_rel(got[0], want[0]) < 1e-2  # the sink-only row's dq: 0 in both

    leaves = [x.detach().float().requires_grad_() for x in (q, k, sink)]
    ref = sparse_attention(*leaves[:2], None, idx, scale, sink=leaves[2], prefix_lengths=pre,
                           backend="reference")
    ref.backward(dout.float())
    for name, a, b in zip(("dq", "dk", "dsink"), (got[0], got[1], got[3]),
                          (x.grad for x in leaves), strict=True):
        assert rel(a, b.to(a.dtype).view(a.shape)) < GRAD_TOL, name

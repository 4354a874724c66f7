"""Library backends (cuDNN-frontend's DSA kernels, FlashMLA) against HyScale's references, on
the H200 with `scripts/gpu_cudnn.sh` installed (skipped where the libraries do not import).

Selection: integer-valued inputs make every fp32 sum exact, so the cuDNN path must return
HyTopK's reference indices and scores bit for bit, ties (smaller index first), all-zero rows,
-0.0 scores, rows with fewer visible keys than k, non-contiguous inputs and batch 2 included.
Attention and the indexer loss run bf16 kernels against fp32 references on the same inputs:
cosine / relative-error bounds as the Triton GPU tests use.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_hyscale.ops import hytopk, indexer_kl_loss, sparse_attention
from megatron_hyscale.ops.backends.availability import CUDNN, FLASHMLA, library_unavailable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def needs(*libraries):
    for lib in libraries:
        reason = library_unavailable(lib, torch.device("cuda")) if torch.cuda.is_available() \
            else "needs CUDA"
        if reason:
            pytest.skip(reason)


def int_inputs(B, T, S, H, D, seed, lo=-3, hi=4):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(lo, hi, (B, T, H, D), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randint(lo, hi, (B, S, D), device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (B, T, H), device="cuda", generator=g).to(torch.float32)
    return q, k, w


def assert_selection_exact(q, k, w, topk, **kw):
    from megatron_hyscale.ops.backends.cudnn_selection import (
        cudnn_selection,
        cudnn_selection_unsupported,
    )
    from megatron_hyscale.ops.checks import normalize_positions

    B, T = q.shape[:2]
    S = k.shape[1]
    qpos = normalize_positions("q_positions", kw.get("q_positions"), B, T, S - T, q.device)
    kpos = normalize_positions("k_positions", None, B, S, 0, q.device)
    assert cudnn_selection_unsupported(q, k, w, relu=True, causal=True, kpos=kpos) is None
    ref_i, ref_s = hytopk(q, k, w, topk, backend="reference", **kw)
    got_i, got_s = cudnn_selection(q, k, w, topk, qpos=qpos)
    torch.cuda.synchronize()
    assert got_i.dtype == torch.int32 and got_s.dtype == torch.float32
    bad = (got_i != ref_i).any(-1)
    assert not bad.any(), f"{int(bad.sum())} rows differ, first {torch.nonzero(bad)[0].tolist()}"
    assert torch.equal(got_s, ref_s)


@pytest.mark.parametrize("B,T,H,topk", [(1, 4096, 64, 2048), (2, 3000, 32, 1000),
                                        (1, 1024, 64, 2048)])
def test_cudnn_selection_equals_reference_on_integer_inputs(B, T, H, topk):
    needs(CUDNN)
    assert_selection_exact(*int_inputs(B, T, T, H, 128, seed=T), topk)


def test_cudnn_selection_ties_zero_rows_and_negative_zero():
    """Few distinct values: most scores tie; w <= 0 rows score -0.0 / +0.0 only."""
    needs(CUDNN)
    q, k, w = int_inputs(1, 2048, 2048, 64, 128, seed=1, lo=0, hi=2)
    w[:, ::3] = 0.0  # all-zero rows: the smallest indices win
    w[:, 1::3] = -w[:, 1::3].abs()  # non-positive weights: every score is -0.0 or below
    assert_selection_exact(q, k, w, 2048)


def test_cudnn_selection_in_key_order():
    """order="key" on cuDNN's path (its unsorted rows, then `ops/key_order.py`): the
    reference's rows in increasing key order, scores moved with them."""
    needs(CUDNN)
    from megatron_hyscale.ops.key_order import sort_rows_by_key

    q, k, w = int_inputs(2, 3000, 3000, 32, 128, seed=4)
    ref_i, ref_s = hytopk(q, k, w, 1000, backend="reference")
    sort_rows_by_key(ref_i, ref_s)
    got_i, got_s = hytopk(q, k, w, 1000, backend="cudnn", order="key")
    assert torch.equal(got_i, ref_i) and torch.equal(got_s, ref_s)


def test_cudnn_selection_many_chunks_noncontiguous_and_cp_positions():
    """Several 1 GiB score chunks, a strided q, and CP-style rows (two position runs)."""
    needs(CUDNN)
    T = 16384
    q, k, w = int_inputs(1, T, 2 * T, 64, 256, seed=2)
    q = q[..., ::2]  # non-contiguous head dim
    k = k[..., ::2].contiguous()
    # rows 0..T/2-1 at positions 0.., rows T/2.. at positions 1.5 T..: zigzag CP's two runs
    pos = torch.cat([torch.arange(T // 2), torch.arange(T // 2) + 3 * T // 2]).cuda()
    assert_selection_exact(q, k, w, 2048, q_positions=pos)


def gla_attention_inputs(B, T, S, H, D, K, seed, *, holes=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, S, 1, D, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.arange(T, device="cuda") + S - T
    r = torch.rand(B, T, S, device="cuda", generator=g)
    r = r.masked_fill(torch.arange(S, device="cuda").view(1, 1, S) > pos.view(1, T, 1), -1)
    idx = r.topk(min(K, S), dim=-1)
    idx = torch.where(idx.values >= 0, idx.indices, -1).int()
    if holes:
        idx[:, ::7, ::5] = -1  # -1 before valid slots: the backend must compact
        idx[:, 3] = -1  # a row without slots
    return q, k, idx


ATTENTION_CASES = [(64, 576, 2048, False), (16, 576, 300, False), (64, 512, 512, True),
                   (128, 576, 1024, False)]


def check_attention_against_reference(attend, H, D, K, sink, seed):
    """attend(q, k, idx, scale, dv, sink) -> (out, lse), differentiable, on bf16 inputs with
    holes and an empty row 3: out / lse against the fp32 reference, the gradients' cosines."""
    B, T = 2, 1024
    q, k, idx = gla_attention_inputs(B, T, T, H, D, K, seed=seed)
    dv = 512 if D == 576 else None
    s = torch.randn(H, device="cuda") if sink else None
    scale = D**-0.5
    qr, kr = q.float().requires_grad_(), k.float().requires_grad_()
    sr = None if s is None else s.clone().requires_grad_()
    out_r, lse_r = sparse_attention(qr, kr, None, idx, scale, dv=dv, sink=sr, return_lse=True,
                                    backend="reference")
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    sl = None if s is None else s.clone().requires_grad_()
    out, lse = attend(ql, kl, idx, scale, dv, sl)
    rel = ((out.float() - out_r).norm() / out_r.norm()).item()
    assert rel < 1e-2, rel
    finite = torch.isfinite(lse_r)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - lse_r[finite]).abs().max().item() < 1e-2
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3]))  # the row without slots
    dout = torch.randn_like(out_r)
    out_r.backward(dout)
    out.backward(dout.to(out.dtype))
    pairs = [("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad)]
    if sink:
        pairs.append(("dsink", sl.grad, sr.grad))
    for name, got, want in pairs:
        cos = torch.nn.functional.cosine_similarity(got.float().flatten(), want.flatten(), 0)
        assert cos.item() > 0.999, (name, cos.item())
    assert torch.equal(ql.grad[:, 3], torch.zeros_like(ql.grad[:, 3]))


@pytest.mark.parametrize("H,D,K,sink", ATTENTION_CASES)
def test_library_attention_matches_reference(H, D, K, sink):
    needs(CUDNN, FLASHMLA)
    from megatron_hyscale.ops.backends.library_attention import (
        library_attention,
        library_attention_unsupported,
    )

    def attend(q, k, idx, scale, dv, s):
        assert library_attention_unsupported(q, k, None, idx, dv, prefix_lengths=None,
                                             deterministic=False) is None
        return library_attention(q, k, idx, scale, sink=s)

    check_attention_against_reference(attend, H, D, K, sink, seed=H + K)


@pytest.mark.parametrize("H,D,K,sink", ATTENTION_CASES)
def test_flashmla_forward_with_hyscale_backward_matches_reference(H, D, K, sink):
    """`AttentionKernelOptions.fwd_flashmla`: FlashMLA's forward, HyScale's (Gluon) backward
    on its output and lse; the layouts as the library pair's test, the empty row included."""
    needs(FLASHMLA)
    from dataclasses import replace

    from megatron_hyscale.ops.kernels.options import AttentionKernelOptions
    from megatron_hyscale.ops.kernels.sparse_attention import sparse_attention_triton

    options = replace(AttentionKernelOptions.DEFAULT, fwd_flashmla=True)

    def attend(q, k, idx, scale, dv, s):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*fwd_flashmla")  # FlashMLA must run
            return sparse_attention_triton(q, k, None, idx, scale, dv=dv, sink=s,
                                           return_lse=True, options=options)

    check_attention_against_reference(attend, H, D, K, sink, seed=3 * H + K)


@pytest.mark.parametrize("B,H_I,with_lse,K", [(1, 64, True, 512), (2, 32, False, 512),
                                               (2, 32, True, 2048)])
def test_cudnn_indexer_loss_matches_reference(B, H_I, with_lse, K):
    """K = 2048 over 2048 keys: every row but the last holds fewer than K keys (half the slots
    empty on average, as in a packed sequence of short documents); the empty slots reach cuDNN's
    backward as key -1 and must add nothing, key 0's gradient included."""
    needs(CUDNN, FLASHMLA)
    from megatron_hyscale.ops.backends.cudnn_indexer_loss import (
        cudnn_indexer_loss,
        cudnn_indexer_loss_unsupported,
    )
    from megatron_hyscale.ops.checks import normalize_positions

    T, H, D = 2048, 64, 576
    g = torch.Generator(device="cuda").manual_seed(B * H_I)
    qi = torch.randn(B, T, H_I, 128, device="cuda", generator=g).to(torch.bfloat16)
    ki = torch.randn(B, T, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(B, T, H_I, device="cuda", generator=g) * H_I**-0.5).to(torch.bfloat16)
    query, key, idx = gla_attention_inputs(B, T, T, H, D, K, seed=7, holes=False)
    scale = D**-0.5
    lse = None
    if with_lse:
        _, lse = sparse_attention(query, key, None, idx, scale, dv=512, return_lse=True)
    kpos = normalize_positions("k_positions", None, B, T, 0, qi.device)
    qpos = normalize_positions("q_positions", None, B, T, 0, qi.device)
    assert cudnn_indexer_loss_unsupported(qi, w, query, key, sparse=True, relu=True, kpos=kpos,
                                          attention_lse=lse) is None
    leaves = [x.clone().requires_grad_() for x in (qi, w, ki)]
    ref = indexer_kl_loss(*(x.float() for x in leaves[:2]), leaves[2].float(), query.float(),
                          key.float(), idx, scale, 0.01, sparse=True, backend="reference")
    ref.backward()
    mine = [x.clone().requires_grad_() for x in (qi, w, ki)]
    got = cudnn_indexer_loss(mine[0], mine[1], mine[2], query, key, idx, scale, 0.01, qpos=qpos,
                             attention_lse=lse)
    assert abs(got.item() - ref.item()) <= 2e-3 * abs(ref.item()), (got.item(), ref.item())
    (got * 3.0).backward()  # backward scales the stored gradients by the incoming one
    for name, a, b in zip(("q_index", "weights", "k_index"), mine, leaves):
        cos = torch.nn.functional.cosine_similarity(a.grad.float().flatten(),
                                                    3.0 * b.grad.flatten().float(), 0)
        assert cos.item() > 0.999, (name, cos.item())
        ratio = a.grad.float().norm() / (3.0 * b.grad.float().norm())
        assert abs(ratio.item() - 1) < 1e-2, (name, ratio.item())
    # Key 0 is visible to every row: the row megatron's layout sends every empty slot to.
    k0, want0 = mine[2].grad[:, 0].float(), 3.0 * leaves[2].grad[:, 0].float()
    assert (k0 - want0).norm() <= 2e-2 * want0.norm(), ((k0 - want0).norm(), want0.norm())


def test_host_known_positions_and_trusted_slots_change_nothing():
    """The sync-free forms the layers use (positions known on the host, HyTopK's slot layout
    vouched for) give bit-identical results to the forms that read them back."""
    needs(CUDNN, FLASHMLA)
    from megatron_hyscale.ops.backends.cudnn_indexer_loss import cudnn_indexer_loss
    from megatron_hyscale.ops.backends.cudnn_selection import cudnn_selection
    from megatron_hyscale.ops.backends.library_attention import library_attention
    from megatron_hyscale.ops.checks import normalize_positions

    # Several score chunks (T x S x 4 B over 1 GiB) with queries at S - T ..: q_start = S - T.
    T, S = 6144, 49152
    q, k, w = int_inputs(1, T, S, 64, 128, seed=5)
    qpos = normalize_positions("q_positions", None, 1, T, S - T, q.device)
    read_i, read_s = cudnn_selection(q, k, w, 2048, qpos=qpos)
    host_i, host_s = cudnn_selection(q, k, w, 2048, qpos=qpos, q_start=S - T)
    assert torch.equal(read_i, host_i) and torch.equal(read_s, host_s)

    B, T, H, D, K = 2, 2048, 64, 576, 512
    query, key, idx = gla_attention_inputs(B, T, T, H, D, K, seed=9, holes=False)
    outs = []
    for trusted in (False, True):
        ql, kl = query.clone().requires_grad_(), key.clone().requires_grad_()
        out, lse = library_attention(ql, kl, idx, D**-0.5, hytopk_layout=trusted)
        out.float().pow(2).sum().backward()
        outs.append((out, lse, ql.grad, kl.grad))
    # forward bit for bit; the gradients within the backward's atomic-order noise (cuDNN adds
    # dK with atomics: two runs of the same inputs differ in the last bits)
    assert_same_forward_close_grads(outs, n_forward=2)  # out, lse; then dq, dk

    g = torch.Generator(device="cuda").manual_seed(3)
    qi = torch.randn(B, T, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    ki = torch.randn(B, T, 128, device="cuda", generator=g).to(torch.bfloat16)
    wi = (torch.randn(B, T, 32, device="cuda", generator=g) * 32**-0.5).to(torch.bfloat16)
    qpos = normalize_positions("q_positions", None, B, T, 0, qi.device)
    losses = []
    for trusted in (False, True):
        leaves = [x.clone().requires_grad_() for x in (qi, wi, ki)]
        loss = cudnn_indexer_loss(*leaves, query, key, idx, D**-0.5, 0.01, qpos=qpos,
                                  attention_lse=outs[0][1].detach(), hytopk_layout=trusted)
        loss.backward()
        losses.append((loss, *(x.grad for x in leaves)))
    assert_same_forward_close_grads(losses, n_forward=1)  # loss; then its three grads


def assert_same_forward_close_grads(pair, *, n_forward: int):
    first, second = pair
    for a, b in zip(first[:n_forward], second[:n_forward]):
        assert torch.equal(a, b)
    for a, b in zip(first[n_forward:], second[n_forward:]):
        cos = torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), 0)
        assert cos.item() > 0.99999, cos.item()
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2 * scale)

"""Sparse attention with the indexer loss in its backward (the target from the dQ kernel), under
the interpreter on CPU (also runs on CUDA).

Against the two ops it replaces, on the same inputs: `sparse_attention_triton` (out and lse
bitwise, q / k gradients bitwise: the dQ kernel's target costs no change) and
`indexer_kl_loss_triton(..., attention_lse=lse)` (the loss handed to on_loss and the indexer's
gradients, to the target's fp32 rounding) and the fp64 reference; ReLU and folded scoring, a
row mask (mean over the valid rows), the per-token loss, batch 2 with an empty row and rows
seeing fewer keys than slots, two head blocks (atomic target), deterministic mode bitwise. The
anchor is 0, carries the loss's gradient linearly, and the backward reports the loss once.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megatron_hyscale.ops import reference  # noqa: E402
from megatron_hyscale.ops.indexer_loss import index_lse_from_scores  # noqa: E402
from megatron_hyscale.ops.kernels.attention_indexer_loss import (  # noqa: E402
    sparse_attention_indexer_loss_triton,
)
from megatron_hyscale.ops.kernels.indexer_loss import indexer_kl_loss_triton  # noqa: E402
from megatron_hyscale.ops.kernels.options import (  # noqa: E402
    AttentionKernelOptions,
    IndexerLossKernelOptions,
)
from megatron_hyscale.ops.kernels.sparse_attention import sparse_attention_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE, COEFF = 0.3, 0.7
# Key tiles of 16 in every kernel, so rows span several tiles with a ragged tail.
ATTN = replace(AttentionKernelOptions.DEFAULT, fwd_tilings=((16, 1),), dq_tilings=((16, 1),),
               dkv_tilings=((16, 1),), narrow_dq_tilings=((16, 1),),
               narrow_dkv_tilings=((16, 1),), bwd_fused_tilings=((16, 1),))
LOSS = replace(IndexerLossKernelOptions.DEFAULT, block_n=16)


def case(B=2, T=6, S=30, Hq=4, D=24, dv=16, H_I=3, D_I=8, K=12, seed=0):
    """GLM-5.1's absorbed form in small (one KV head, 24 = 16 + 8 channels, V = K's main 16):
    inputs, HyTopK-like indices (each row's distinct visible keys in random slot order, -1 in
    the rest: query t at position S - T + t, so every row sees at least S - T + 1 keys, and
    the first rows fewer than K when S - T + 1 < K), row (0, 1) empty, and positions."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)
    qpos = torch.arange(T) + (S - T)
    idx = torch.full((B, T, K), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            keys = torch.randperm(int(qpos[t]) + 1, generator=g)[:K]
            idx[b, t, torch.randperm(K, generator=g)[: keys.numel()]] = keys
    idx[0, 1] = -1
    x = dict(q=r(B, T, Hq, D) * 0.7, k=r(B, S, 1, D) * 0.7, q_index=r(B, T, H_I, D_I),
             weights=r(B, T, H_I) * 0.5, k_index=r(B, S, D_I))
    return x, idx.to(DEVICE), qpos.expand(B, T).to(DEVICE), dv


def leaves(x):
    return {n: t.detach().clone().requires_grad_() for n, t in x.items()}


def fused_run(x, idx, dv, *, grad_out, anchor_grad=1.0, **kw):
    """out, lse, anchor, the reported losses and every gradient of the fused op."""
    y = leaves(x)
    reported = []
    out, lse, anchor = sparse_attention_indexer_loss_triton(
        y["q"], y["k"], None, idx, SCALE, q_index=y["q_index"], weights=y["weights"],
        k_index=y["k_index"], loss_coeff=COEFF, dv=dv, options=ATTN, loss_options=LOSS,
        on_loss=reported.append, **kw)
    ((out * grad_out).sum() + anchor * anchor_grad).backward()
    return out.detach(), lse.detach(), anchor.detach(), reported, {n: t.grad for n, t in y.items()}


def separate_run(x, idx, qpos, dv, *, grad_out, relu=True, per_token=False,
                 query_valid_rows=None, deterministic=False):
    """The same from sparse_attention_triton and indexer_kl_loss_triton(attention_lse=lse)."""
    y = leaves(x)
    out, lse = sparse_attention_triton(y["q"], y["k"], None, idx, SCALE, dv=dv, return_lse=True,
                                       deterministic=deterministic, options=ATTN)
    kpos = torch.arange(x["k"].shape[1], device=DEVICE).expand(x["k"].shape[0], -1)
    loss = indexer_kl_loss_triton(
        y["q_index"], y["weights"], y["k_index"], y["q"].detach(), y["k"].detach(), idx, SCALE,
        COEFF, relu=relu, q_positions=qpos, k_positions=kpos,
        calculate_per_token_loss=per_token, deterministic=deterministic,
        attention_lse=lse.detach(), options=LOSS, query_valid_rows=query_valid_rows)
    ((out * grad_out).sum() + loss).backward()
    return out.detach(), lse.detach(), loss.detach(), {n: t.grad for n, t in y.items()}


def same_attention_grad(a, b, name):
    """Bitwise under the interpreter; on a GPU dK's fp32 atomics add in any order, so close
    (dQ has no atomics: bitwise there too)."""
    if DEVICE == "cpu" or name == "q":
        assert torch.equal(a, b), name
    else:
        assert_close(a, b)


def assert_close(a, b, rtol=2e-5):
    # Indexer gradients are sums of (softmax - target) terms that cancel: the absolute
    # tolerance is taken relative to the tensor's largest entry.
    atol = max(1e-7, rtol * float(b.abs().max()))
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("relu,per_token,masked", [
    (True, False, False), (False, False, False), (True, True, False), (True, False, True),
    (False, True, True)])
def test_equals_the_two_ops(relu, per_token, masked):
    x, idx, qpos, dv = case(seed=1 + 2 * relu + 4 * per_token + 8 * masked)
    grad_out = torch.randn(2, 6, 4, dv, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    rows = None
    if masked:
        rows = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
        rows[1, 2:4] = False
    kw = dict(relu=relu, calculate_per_token_loss=per_token, query_valid_rows=rows)
    out, lse, anchor, reported, grads = fused_run(x, idx, dv, grad_out=grad_out, **kw)
    s_out, s_lse, s_loss, s_grads = separate_run(x, idx, qpos, dv, grad_out=grad_out,
                                                 relu=relu, per_token=per_token,
                                                 query_valid_rows=rows)
    assert torch.equal(out, s_out) and torch.equal(lse, s_lse)
    assert anchor.item() == 0.0 and anchor.dtype == torch.float32
    assert len(reported) == 1 and reported[0].dim() == 0
    assert float(s_loss) > 0
    assert_close(reported[0], s_loss)
    for name in ("q", "k"):  # the target leaves the attention's gradients as they were
        same_attention_grad(grads[name], s_grads[name], name)
    for name in ("q_index", "weights", "k_index"):
        assert s_grads[name].abs().max() > 0, name
        assert_close(grads[name], s_grads[name])
    if masked:  # the masked rows take no part in the loss
        assert (grads["q_index"][1, 2:4] == 0).all() and (grads["weights"][1, 2:4] == 0).all()
    # and against the fp64 reference
    ref = reference.indexer_loss_reference(
        x["q_index"].double(), x["weights"].double(), x["k_index"].double(), x["q"].double(),
        x["k"].double(), idx, SCALE, COEFF, sparse=True, relu=relu, q_positions=qpos,
        k_positions=torch.arange(x["k"].shape[1], device=DEVICE).expand(2, -1),
        calculate_per_token_loss=per_token, query_valid_rows=rows)
    assert_close(reported[0].double(), ref.double(), rtol=1e-4)


def test_two_head_blocks_add_their_targets():
    """80 query heads run as two head blocks of 64 whose target parts meet by atomic adds:
    the loss still equals the separate ops'."""
    x, idx, qpos, _ = case(B=1, T=3, Hq=80, D=16, dv=None, seed=7)
    grad_out = torch.randn(1, 3, 80, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    _, _, _, reported, grads = fused_run(x, idx, None, grad_out=grad_out, relu=True)
    _, _, s_loss, s_grads = separate_run(x, idx, qpos, None, grad_out=grad_out)
    assert_close(reported[0], s_loss)
    for name in ("q_index", "weights", "k_index"):
        assert_close(grads[name], s_grads[name])


def test_anchor_carries_the_loss_gradient_linearly():
    """Scaling the anchor's gradient (the auto-scaler's main-loss scale) scales the indexer's
    gradients and nothing else; an unused anchor gives the indexer no gradient at all."""
    x, idx, _, dv = case(seed=11)
    grad_out = torch.randn(2, 6, 4, dv, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    *_, one = fused_run(x, idx, dv, grad_out=grad_out, anchor_grad=1.0, relu=True)
    *_, reported, three = fused_run(x, idx, dv, grad_out=grad_out, anchor_grad=3.0, relu=True)
    assert len(reported) == 1
    for name in ("q", "k"):
        same_attention_grad(one[name], three[name], name)
    for name in ("q_index", "weights", "k_index"):
        assert_close(three[name], 3.0 * one[name])
    y = leaves(x)
    reported = []
    out, _, _ = sparse_attention_indexer_loss_triton(
        y["q"], y["k"], None, idx, SCALE, q_index=y["q_index"], weights=y["weights"],
        k_index=y["k_index"], loss_coeff=COEFF, relu=True, dv=dv, options=ATTN,
        loss_options=LOSS, on_loss=reported.append)
    (out * grad_out).sum().backward()
    assert len(reported) == 1  # the loss is still reported
    assert y["q_index"].grad is None and y["k_index"].grad is None


def test_deterministic_is_bitwise_repeatable():
    x, idx, _, dv = case(seed=13)
    grad_out = torch.randn(2, 6, 4, dv, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    runs = [fused_run(x, idx, dv, grad_out=grad_out, relu=True, deterministic=True)
            for _ in range(2)]
    (_, _, _, rep_a, a), (_, _, _, rep_b, b) = runs
    assert torch.equal(rep_a[0], rep_b[0])
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_public_op_checks_its_arguments():
    """ops.sparse_attention_indexer_loss: the same result as the kernel function; ValueErrors
    that name the argument for what it cannot take."""
    from megatron_hyscale.ops import sparse_attention_indexer_loss

    x, idx, _, dv = case(B=1, T=4, seed=17)
    kw = dict(q_index=x["q_index"], weights=x["weights"], k_index=x["k_index"],
              loss_coeff=COEFF, dv=dv, options=ATTN, loss_options=LOSS)
    out, lse, anchor = sparse_attention_indexer_loss(x["q"], x["k"], None, idx, SCALE, **kw)
    k_out, k_lse, _ = sparse_attention_indexer_loss_triton(x["q"], x["k"], None, idx, SCALE,
                                                           relu=True, **kw)
    assert torch.equal(out, k_out) and torch.equal(lse, k_lse) and anchor.item() == 0.0
    two_heads = idx.unsqueeze(2).expand(-1, -1, 2, -1)
    with pytest.raises(ValueError, match="indices must be shared by the KV heads"):
        sparse_attention_indexer_loss(x["q"], x["k"].expand(-1, -1, 2, -1), None, two_heads,
                                      SCALE, **kw)
    with pytest.raises(ValueError, match="on_loss must be callable"):
        sparse_attention_indexer_loss(x["q"], x["k"], None, idx, SCALE, on_loss=1, **kw)
    with pytest.raises(ValueError, match="loss_options must be IndexerLossKernelOptions"):
        sparse_attention_indexer_loss(x["q"], x["k"], None, idx, SCALE,
                                      **{**kw, "loss_options": ATTN})
    with pytest.raises(ValueError, match="weights must be"):
        sparse_attention_indexer_loss(x["q"], x["k"], None, idx, SCALE,
                                      **{**kw, "weights": x["weights"][:, :2]})
    for bad, words in ((torch.zeros(1, 3, device=DEVICE), "index_lse must be \\[B, T\\]"),
                       (torch.zeros(1, 4, dtype=torch.int32, device=DEVICE),
                        "index_lse dtype must be"),
                       (torch.zeros(1, 4, dtype=torch.bfloat16, device=DEVICE),
                        "index_lse dtype must be"),
                       (torch.zeros(4, device=DEVICE), "index_lse must have 2 dims")):
        with pytest.raises(ValueError, match=words):
            sparse_attention_indexer_loss(x["q"], x["k"], None, idx, SCALE, index_lse=bad, **kw)


def selected_scores(x, idx, relu):
    """The index scores of each row's selected slots (fp32 [B, T, K], -inf at -1 slots), as
    HyTopK returns them: sum_h w_h act(q_index_h . k_index[idx])."""
    keys = x["k_index"][torch.arange(idx.shape[0], device=DEVICE)[:, None, None],
                        idx.clamp_min(0)]                               # [B, T, K, D_I]
    dots = torch.einsum("bthd,btkd->bthk", x["q_index"], keys)
    act = dots.relu() if relu else dots
    scores = (x["weights"].unsqueeze(-1) * act).sum(2)
    return scores.masked_fill(idx < 0, float("-inf"))


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
def test_index_lse_from_scores(kernel, monkeypatch):
    """The Triton read (CUDA, or the interpreter) and torch's form off it: torch.logsumexp
    over each row's selected scores, 0 for a row without one; batch 2, a strided view, K over
    one tile (300 at block_n 128)."""
    from megatron_hyscale.ops import indexer_loss

    if not kernel:
        if DEVICE != "cpu":
            pytest.skip("torch's form runs off CUDA only")
        monkeypatch.setattr(indexer_loss, "triton_interpret", lambda: False)
    g = torch.Generator().manual_seed(4)
    scores = (torch.randn(2, 5, 600, generator=g) * 8).to(DEVICE)[:, :, ::2]  # K 300, strided
    scores[scores < -9] = float("-inf")
    scores[0, 1] = float("-inf")
    want = torch.logsumexp(scores, -1)
    for block_n in (None, 128):
        got = index_lse_from_scores(scores, block_n)
        assert got.dtype == torch.float32 and got.shape == (2, 5)
        assert got[0, 1] == 0.0  # no selected key: the row pass's 0, not -inf
        keep = torch.isfinite(want)
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="scores must have 3 dims"):
        index_lse_from_scores(scores[0])


@pytest.mark.parametrize("relu,masked", [(True, False), (False, False), (True, True)])
def test_index_lse_skips_the_gathered_row_pass(relu, masked, monkeypatch):
    """Given the selection's log-sum-exp (`index_lse`), the backward only normalizes the
    target (no `indexer_loss_rows`): the same loss and indexer gradients as the row pass's,
    to fp32 rounding; the attention's results bitwise. Row (0, 1) has no slot (its lse 0)."""
    from megatron_hyscale.ops.kernels import attention_indexer_loss as ail

    x, idx, _, dv = case(seed=21 + relu + 2 * masked)
    grad_out = torch.randn(2, 6, 4, dv, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    rows = None
    if masked:
        rows = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
        rows[0, 3:5] = False
    kw = dict(relu=relu, query_valid_rows=rows)
    want = fused_run(x, idx, dv, grad_out=grad_out, **kw)
    index_lse = index_lse_from_scores(selected_scores(x, idx, relu))
    assert index_lse[0, 1] == 0.0

    row_passes, normalized = [], []
    real_rows, real_norm = ail.indexer_loss_rows, ail.normalize_target
    monkeypatch.setattr(ail, "indexer_loss_rows",
                        lambda *a, **k: row_passes.append(1) or real_rows(*a, **k))
    monkeypatch.setattr(ail, "normalize_target",
                        lambda *a, **k: normalized.append(1) or real_norm(*a, **k))
    got = fused_run(x, idx, dv, grad_out=grad_out, index_lse=index_lse, **kw)
    assert row_passes == [] and normalized == [1]
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    assert float(want[3][0]) > 0
    assert_close(got[3][0], want[3][0])
    for name in ("q", "k"):
        same_attention_grad(got[4][name], want[4][name], name)
    for name in ("q_index", "weights", "k_index"):
        assert want[4][name].abs().max() > 0, name
        assert_close(got[4][name], want[4][name])
    # a wrong log-sum-exp changes the gradients: the given one is what the backward used
    shifted = fused_run(x, idx, dv, grad_out=grad_out, index_lse=index_lse + 0.5, **kw)
    assert not torch.allclose(shifted[4]["q_index"], want[4]["q_index"], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("K", [12, 200])
def test_normalize_target_is_the_row_pass_without_its_gather(K):
    """`normalize_target`: the target normalized in place and its sums, bitwise the row pass's
    (`indexer_loss_rows(..., with_kl=False)`) at the same tile size (options.block_n), within
    fp32 rounding at its own wide tiles (one of 16 slots, or 256 over 200); -1 slots
    untouched, a row without a slot summing to 0."""
    from megatron_hyscale.ops.kernels.indexer_loss import indexer_loss_rows, normalize_target

    x, idx, _, _ = case(S=300, K=K, seed=31)
    g = torch.Generator().manual_seed(2)
    p = torch.rand(idx.shape, generator=g).to(DEVICE)
    p = torch.where(idx >= 0, p, torch.full_like(p, -1.0))
    want_p, got_p, wide_p = p.clone(), p.clone(), p.clone()
    _, _, want_psum = indexer_loss_rows(x["q_index"], x["weights"], x["k_index"], idx, want_p,
                                        True, LOSS, with_kl=False)
    got_psum = normalize_target(got_p, LOSS)
    assert torch.equal(got_p, want_p) and torch.equal(got_psum, want_psum)
    wide_psum = normalize_target(wide_p)
    torch.testing.assert_close(wide_p, want_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(wide_psum, want_psum, rtol=1e-6, atol=1e-7)
    for q, s in ((got_p, got_psum), (wide_p, wide_psum)):
        assert (q[idx < 0] == -1.0).all() and s[0, 1] == 0.0
        torch.testing.assert_close(s[0, 0], torch.tensor(1.0, device=DEVICE))

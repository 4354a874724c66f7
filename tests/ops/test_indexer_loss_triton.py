"""Sparse indexer KL loss Triton kernels under the interpreter (CPU), against the reference.

Tiny fp32 cases (the interpreter's bf16 arithmetic is wrong): value and the gradients of
q_index, weights and k_index, ReLU on and off (off folds the weights into the query), -1 slots,
repeated indices, selected-but-invisible keys, rows with no valid slot, B > 1, non-contiguous
(sbhd transposed) inputs, GQA and MQA key heads, several query-head blocks, per-token loss, the
deterministic dK mode and the tensor-parallel split (target, all-reduce, loss). Key tiles of 16
make rows span two tiles with a ragged tail.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megatron_hyscale.ops import reference  # noqa: E402
from megatron_hyscale.ops.indexer_loss import indexer_kl_loss  # noqa: E402
from megatron_hyscale.ops.kernels import indexer_loss as kern  # noqa: E402
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Key tiles of 16 in every kernel.
TILES_16 = replace(IndexerLossKernelOptions.DEFAULT, block_n=16)
SCALE, COEFF = 0.3, 0.7


def make_case(B=2, T=10, S=12, H_I=3, D_I=8, Hq=4, Hkv=1, Dqk=24, K=20, seed=0):
    """Inputs, indices and default positions (query t at position S - T + t, key s at s)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)
    idx = torch.randint(-1, S, (B, T, K), generator=g)
    idx[:, :, K - 1] = idx[:, :, 2]  # a repeated index counts once (in any slot order)
    idx[:, :, K // 2] = idx[:, :, 2]
    idx[0, 3] = -1  # a row with no slot at all
    if B > 1:
        idx[1, 0, :4] = torch.tensor([S - 1, S - 2, S - 1, 0])  # invisible to the first row
    x = dict(
        q_index=r(B, T, H_I, D_I).requires_grad_(),
        weights=(r(B, T, H_I) * 0.5).requires_grad_(),
        k_index=r(B, S, D_I).requires_grad_(),
        query=r(B, T, Hq, Dqk) * 0.7,
        key=r(B, S, Hkv, Dqk) * 0.7,
    )
    qpos = (torch.arange(T, device=DEVICE) + (S - T)).expand(B, T)
    kpos = torch.arange(S, device=DEVICE).expand(B, S)
    return x, idx.to(DEVICE), qpos, kpos


def ref_loss(x, idx, qpos, kpos, relu=True, per_token=False, query=None,
             query_valid_rows=None):
    loss = reference.indexer_loss_reference(
        x["q_index"], x["weights"], x["k_index"], x["query"] if query is None else query,
        x["key"], idx, SCALE, COEFF, sparse=True, relu=relu, q_positions=qpos,
        k_positions=kpos, calculate_per_token_loss=per_token,
        query_valid_rows=query_valid_rows)
    return loss.detach(), torch.autograd.grad(loss, (x["q_index"], x["weights"], x["k_index"]))


def tri_loss(x, idx, qpos, kpos, relu=True, per_token=False, query=None, options=TILES_16,
             **kw):
    loss = kern.indexer_kl_loss_triton(
        x["q_index"], x["weights"], x["k_index"], x["query"] if query is None else query,
        x["key"], idx, SCALE, COEFF, relu=relu, q_positions=qpos, k_positions=kpos,
        calculate_per_token_loss=per_token, options=options, **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    return loss.detach(), torch.autograd.grad(loss, (x["q_index"], x["weights"], x["k_index"]))


def assert_close(a, b, rtol=2e-5):
    # Gradients are sums of (softmax - target) terms that cancel: the absolute tolerance is
    # taken relative to the tensor's largest entry.
    atol = max(1e-7, rtol * float(b.abs().max()))
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def check_against_reference(x, idx, qpos, kpos, **kw):
    r_loss, r_grads = ref_loss(x, idx, qpos, kpos, **{
        k: v for k, v in kw.items() if k in ("relu", "per_token", "query", "query_valid_rows")})
    t_loss, t_grads = tri_loss(x, idx, qpos, kpos, **kw)
    assert r_loss > 0
    assert_close(t_loss, r_loss)
    for name, g, rg in zip(("q_index", "weights", "k_index"), t_grads, r_grads):
        assert g.dtype == x[name].dtype and g.shape == x[name].shape
        assert rg.abs().max() > 0, name
        assert_close(g, rg)
    return t_loss, t_grads


@pytest.mark.parametrize("relu,Hkv", [(True, 1), (True, 2), (False, 1), (False, 2)])
def test_matches_reference(relu, Hkv):
    x, idx, qpos, kpos = make_case(Hkv=Hkv, seed=int(relu) + 2 * Hkv)
    _, grads = check_against_reference(x, idx, qpos, kpos, relu=relu)
    assert (grads[0][0, 3] == 0).all() and (grads[1][0, 3] == 0).all()  # the empty row


def test_per_token_loss_is_the_sum():
    x, idx, qpos, kpos = make_case(seed=5)
    check_against_reference(x, idx, qpos, kpos, per_token=True)


def test_several_query_head_blocks():
    # 40 query heads over 16-head blocks: three blocks (the last one ragged) add into the
    # target one after another; Dqk 20 = 16 + a 4-wide tail.
    x, idx, qpos, kpos = make_case(B=1, T=6, S=8, Hq=40, Dqk=20, K=9, seed=7)
    check_against_reference(x, idx, qpos, kpos, options=replace(TILES_16, max_block_h=16))


def test_rows_without_visible_keys_and_shard_positions():
    # Keys start at position 4: rows at positions 0..3 see nothing (zero KL and gradient, still
    # counted in the mean); the rows are a context-parallel shard's two zigzag chunks.
    T, S = 8, 12
    x, idx, _, _ = make_case(B=2, T=T, S=S, K=10, seed=9)
    qpos = torch.cat([torch.arange(0, 4), torch.arange(12, 16)]).to(DEVICE)
    kpos = (torch.arange(S) + 4).to(DEVICE).expand(2, S)
    qpos = qpos.expand(2, T)
    _, grads = check_against_reference(x, idx, qpos, kpos)
    assert (grads[0][:, :4] == 0).all() and (grads[1][:, :4] == 0).all()


def test_non_contiguous_sbhd_inputs():
    # megatron holds [T, B, ...] tensors and passes them transposed; indices too.
    x, idx, qpos, kpos = make_case(seed=11)
    sb = {n: t.detach().transpose(0, 1).contiguous().transpose(0, 1) for n, t in x.items()}
    for n in ("q_index", "weights", "k_index"):
        sb[n].requires_grad_()
        assert not sb[n].is_contiguous()
    idx_sb = idx.transpose(0, 1).contiguous().transpose(0, 1).to(torch.int32)
    check_against_reference(sb, idx_sb, qpos, kpos)


def test_large_logits_stay_finite():
    # Attention logits in the hundreds: both softmaxes shift by their row max; target entries
    # underflow to 0 and meet the eps clamp in the KL.
    x, idx, qpos, kpos = make_case(seed=13)
    x["query"] = x["query"] * 40
    with torch.no_grad():
        x["q_index"].mul_(10)
    loss, grads = check_against_reference(x, idx, qpos, kpos)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("relu,per_token", [(True, False), (False, False), (True, True)])
def test_query_valid_rows(relu, per_token):
    """Rows outside query_valid_rows (bool [B, T]; a [1, T] mask broadcast over the batch)
    get no valid slot: zero KL and gradient, and the mean is over the valid rows."""
    x, idx, qpos, kpos = make_case(seed=31 + int(relu))
    g = torch.Generator().manual_seed(2)
    mask = (torch.rand(2, 10, generator=g) > 0.4).to(DEVICE)
    mask[1, 0] = True  # the row whose slots are invisible
    _, grads = check_against_reference(x, idx, qpos, kpos, relu=relu, per_token=per_token,
                                       query_valid_rows=mask)
    assert (grads[0][~mask] == 0).all() and (grads[1][~mask] == 0).all()
    shared = mask[:1].expand(2, 10)
    check_against_reference(x, idx, qpos, kpos, query_valid_rows=shared)
    none = torch.zeros(2, 10, dtype=torch.bool, device=DEVICE)
    loss, grads = tri_loss(x, idx, qpos, kpos, query_valid_rows=none)
    assert loss.item() == 0.0 and all((gr == 0).all() for gr in grads)


def test_deterministic_dk_is_repeatable_and_matches():
    x, idx, qpos, kpos = make_case(seed=15)
    _, g1 = check_against_reference(x, idx, qpos, kpos, deterministic=True)
    _, g2 = tri_loss(x, idx, qpos, kpos, deterministic=True)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_tensor_parallel_split_adds_the_other_ranks_heads(monkeypatch):
    # Rank 0 holds query heads 0..1, rank 1 heads 2..3: the target pass, an all-reduce that adds
    # rank 1's head sums, then the loss pass must give the loss over all four heads.
    x, idx, qpos, kpos = make_case(seed=17)
    other = kern.attention_target(x["query"][:, :, 2:], x["key"], idx, qpos, kpos, SCALE,
                                  options=TILES_16)
    calls = []

    def fake_all_reduce(t, group=None):
        calls.append(group)
        t.add_(other)  # invalid slots: -1 + -1 stays negative

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    group = object()
    r_loss, r_grads = ref_loss(x, idx, qpos, kpos)
    t_loss, t_grads = tri_loss(x, idx, qpos, kpos, query=x["query"][:, :, :2], tp_group=group)
    assert calls == [group]
    assert_close(t_loss, r_loss)
    for g, rg in zip(t_grads, r_grads):
        assert_close(g, rg)
    # Without the other heads the loss differs: the test can fail.
    half, _ = ref_loss(x, idx, qpos, kpos, query=x["query"][:, :, :2])
    assert not torch.allclose(half, r_loss)


def test_select_flags_valid_slots_once():
    # Row positions 5 (keys 0..5 visible): -1, invisible 7, repeated 3 (first kept), 0, 5.
    idx = torch.tensor([[[3, -1, 7, 3, 0, 5, 3, 6]]], device=DEVICE)
    p = kern.attention_target(torch.zeros(1, 1, 2, 16, device=DEVICE),
                              torch.zeros(1, 8, 1, 16, device=DEVICE), idx,
                              torch.tensor([[5]], device=DEVICE),
                              torch.arange(8, device=DEVICE)[None], 1.0, options=TILES_16)
    # Equal logits: each of the 3 kept keys gets 1/3 from each of the 2 heads.
    expect = torch.tensor([[[2 / 3, -1, -1, -1, 2 / 3, 2 / 3, -1, -1]]], device=DEVICE)
    torch.testing.assert_close(p, expect)


def test_public_entry_point_and_empty_inputs():
    x, idx, qpos, kpos = make_case(B=1, T=5, S=6, K=4, seed=19)
    args = (x["q_index"], x["weights"], x["k_index"], x["query"], x["key"])
    t = indexer_kl_loss(*args, idx, SCALE, COEFF, sparse=True, backend="triton")
    r = indexer_kl_loss(*args, idx, SCALE, COEFF, sparse=True, backend="reference")
    assert_close(t.detach(), r.detach())
    t = indexer_kl_loss(*args, idx, SCALE, COEFF, sparse=True, backend="triton",
                        options=TILES_16)  # the options reach the kernels
    assert_close(t.detach(), r.detach())
    with pytest.raises(ValueError, match="options must be IndexerLossKernelOptions or None"):
        indexer_kl_loss(*args, idx, SCALE, COEFF, sparse=True, options=16)
    # The dense loss has its own kernel (tests/ops/test_indexer_loss_dense_triton.py).
    t = indexer_kl_loss(*args, None, SCALE, COEFF, sparse=False, backend="triton")
    r = indexer_kl_loss(*args, None, SCALE, COEFF, sparse=False, backend="reference")
    assert_close(t.detach(), r.detach())
    # No slots at all: loss 0 and zero gradients, as the reference.
    empty = idx[..., :0]
    loss = indexer_kl_loss(*args, empty, SCALE, COEFF, sparse=True, backend="triton")
    grads = torch.autograd.grad(loss, (x["q_index"], x["weights"], x["k_index"]))
    assert loss.item() == 0.0 and all((g == 0).all() for g in grads)


def distinct_visible_indices(B, T, S, K, qpos, seed):
    """[B, T, K]: each row's distinct visible keys in random order, -1 padded (as HyTopK's
    output: the precondition of attention_lse)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, T, K), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            visible = torch.randperm(int(qpos[b, t]) + 1, generator=g)[:K]
            idx[b, t, : visible.numel()] = visible
    return idx.to(DEVICE)


@pytest.mark.parametrize("Hkv,block_h", [(1, 64), (2, 16)])
def test_attention_lse_replaces_the_first_pass(Hkv, block_h):
    """With the main attention's log-sum-exp over the same (distinct, visible) slots, the
    kernel skips its max / sum pass: value and gradients unchanged, kernel and reference. An
    lse skewed across heads changes the loss, so the kernel does read it."""
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    options = replace(TILES_16, max_block_h=block_h)  # 2 head blocks of 16 when 16
    x, _, qpos, kpos = make_case(B=2, T=7, S=12, Hq=32, Hkv=Hkv, K=6, seed=23)
    idx = distinct_visible_indices(2, 7, 12, 6, qpos.cpu(), seed=23)
    idx[0, 2] = -1  # an empty row: lse -inf, adds nothing
    _, lse = sparse_attention(x["query"], x["key"], None, idx, SCALE, return_lse=True,
                              backend="reference")
    assert torch.isinf(lse[0, 2]).all() and torch.isfinite(lse[1]).all()
    r_loss, r_grads = ref_loss(x, idx, qpos, kpos)
    # One shift for every head would cancel in the target's normalization: skew per head.
    skew = torch.linspace(0.0, 2.0, lse.shape[-1], device=DEVICE)
    tri = lambda *a, **kw: tri_loss(*a, options=options, **kw)
    for loss_fn in (tri, ref_lse_loss):
        loss, grads = loss_fn(x, idx, qpos, kpos, attention_lse=lse)
        assert_close(loss, r_loss)
        for g, rg in zip(grads, r_grads):
            assert_close(g, rg)
        skewed, _ = loss_fn(x, idx, qpos, kpos, attention_lse=lse + skew)
        assert (skewed - r_loss).abs() > 1e-3 * r_loss.abs()


def ref_lse_loss(x, idx, qpos, kpos, attention_lse):
    loss = reference.indexer_loss_reference(
        x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], idx, SCALE, COEFF,
        sparse=True, relu=True, q_positions=qpos, k_positions=kpos,
        calculate_per_token_loss=False, attention_lse=attention_lse)
    return loss.detach(), torch.autograd.grad(loss, (x["q_index"], x["weights"], x["k_index"]))


def test_attention_lse_is_validated():
    x, idx, qpos, kpos = make_case(B=1, T=5, S=6, Hq=4, K=4, seed=29)
    args = (x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], idx, SCALE, COEFF)
    lse = torch.zeros(1, 5, 4, device=DEVICE)
    with pytest.raises(ValueError, match="attention_lse needs sparse=True"):
        indexer_kl_loss(*args, sparse=False, attention_lse=lse, backend="reference")
    with pytest.raises(ValueError, match=r"attention_lse must be \[B, T, Hq\]"):
        indexer_kl_loss(*args, sparse=True, attention_lse=lse[:, :, :3], backend="reference")
    with pytest.raises(ValueError, match="attention_lse"):
        indexer_kl_loss(*args, sparse=True, attention_lse=lse.double(), backend="reference")


def test_causal_false_sees_every_selected_key():
    """causal=False (the DSA layer under an explicit mask, whose selection honours the mask):
    the kernel counts the selected keys past the diagonal too, as the reference does."""
    x, idx, _, _ = make_case(seed=13)

    def loss(backend, causal):
        got = indexer_kl_loss(x["q_index"], x["weights"], x["k_index"], x["query"], x["key"],
                              idx, SCALE, COEFF, sparse=True, causal=causal, backend=backend,
                              options=TILES_16)
        return got.detach(), torch.autograd.grad(got, (x["q_index"], x["weights"],
                                                       x["k_index"]))

    want, want_grads = loss("reference", False)
    got, grads = loss("triton", False)
    assert_close(got, want)
    for g, w in zip(grads, want_grads, strict=True):
        assert_close(g, w)
    assert not torch.allclose(loss("reference", True)[0], want)  # the case has future keys

"""indexer_kl_loss against megatron-core 0.19.2's DSA indexer loss (value and custom backward).

megatron is called exactly as DSAttention calls it for a causal mask with TP = 1: varlen bounds
starts = 0, ends = arange(1, sq + 1) (or q_positions + 1 for shards), sbhd layout, the MQA key
expanded to every query head, a process-group stand-in whose tp has size 1.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from megatron_hyscale.ops import reference
from megatron_hyscale.ops.indexer_loss import indexer_kl_loss

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.experimental_attention_variant import dsa as mdsa

PG_TP1 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))


def make_inputs(B=2, T=24, S=None, H_I=3, D_I=8, Hq=4, Hkv=1, Dqk=12, seed=0,
                dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)
    return dict(
        q_index=r(B, T, H_I, D_I).requires_grad_(),
        weights=(r(B, T, H_I) * 0.5).requires_grad_(),
        k_index=r(B, S, D_I).requires_grad_(),
        query=r(B, T, Hq, Dqk) * 0.7,
        key=r(B, S, Hkv, Dqk) * 0.7,
    )


def to_megatron(x, Hq):
    """Our [B, T, ...] tensors in megatron's [T, B, ...] layout; key expanded to Hq heads."""
    query = x["query"].transpose(0, 1)
    key = x["key"].repeat_interleave(Hq // x["key"].shape[2], dim=2).transpose(0, 1)
    return (x["q_index"].transpose(0, 1), x["weights"].transpose(0, 1),
            x["k_index"].transpose(0, 1), query, key)


def megatron_fused(x, topk, scale, coeff, sparse, relu, per_token, q_positions=None,
                   key_positions=None, query_valid_rows=None):
    """FusedDSAIndexerLoss (selection, value, custom backward) as DSAttention calls it."""
    q, w, k, query, key = to_megatron(x, x["query"].shape[2])
    sq, sk = q.shape[0], k.shape[0]
    qpos = torch.arange(sq) if q_positions is None else q_positions
    starts = torch.zeros(sq, dtype=torch.int64)
    ends = (qpos.to(torch.int64) + 1).clamp(max=sk) if key_positions is None else qpos + 1
    topk_indices, loss = mdsa.FusedDSAIndexerLoss.apply(
        q, w, k, query.detach(), key.detach(), scale, topk, coeff, None, sparse, PG_TP1,
        starts, ends, key_positions, query_valid_rows, per_token, relu,
    )
    grads = torch.autograd.grad(loss, (x["q_index"], x["weights"], x["k_index"]))
    return topk_indices, loss.detach(), grads, (starts, ends)


def megatron_value(x, topk_indices, scale, coeff, sparse, relu, per_token, bounds,
                   key_positions=None):
    """compute_dsa_indexer_loss on _compute_index_scores, as the reference path computes it."""
    q, w, k, query, key = to_megatron(x, x["query"].shape[2])
    with torch.no_grad():
        scores = mdsa._compute_index_scores(q, w, k, use_relu=relu)
        return mdsa.compute_dsa_indexer_loss(
            scores, topk_indices, query, key, scale, coeff, sparse, PG_TP1,
            varlen_starts=bounds[0], varlen_ends=bounds[1], key_positions=key_positions,
            calculate_per_token_loss=per_token,
        )


def ours(x, topk_indices, scale, coeff, sparse, relu, per_token, **kw):
    loss = indexer_kl_loss(
        x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], topk_indices, scale,
        coeff, sparse=sparse, relu=relu, calculate_per_token_loss=per_token,
        backend="reference", **kw,
    )
    grads = torch.autograd.grad(loss, (x["q_index"], x["weights"], x["k_index"]))
    return loss.detach(), grads


def assert_close(a, b, rtol=1e-5, atol=1e-7):
    # Gradients are sums of (softmax - target) terms that cancel: the absolute tolerance is
    # taken relative to the tensor's largest entry.
    atol = max(atol, rtol * float(b.abs().max())) if b.numel() else atol
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("Hkv", [1, 2])
def test_matches_megatron(sparse, relu, per_token, Hkv):
    x = make_inputs(Hkv=Hkv, seed=int(sparse) + 2 * int(relu) + 4 * int(per_token) + 8 * Hkv)
    scale, coeff, topk = 12 ** -0.5, 0.37, 8
    idx, m_loss, m_grads, bounds = megatron_fused(x, topk, scale, coeff, sparse, relu, per_token)
    assert (idx == -1).any() and (idx >= 0).any()  # early rows see fewer than topk keys
    m_value = megatron_value(x, idx, scale, coeff, sparse, relu, per_token, bounds)
    assert_close(m_value, m_loss)
    loss, grads = ours(x, idx, scale, coeff, sparse, relu, per_token)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, m_loss)
    for g, mg in zip(grads, m_grads):
        assert g.abs().max() > 0
        assert_close(g, mg)


def test_sparse_and_dense_differ_and_per_token_scales():
    # Guards the parametrized test against passing for a degenerate reason.
    x = make_inputs(seed=5)
    idx, *_ = megatron_fused(x, 6, 0.3, 1.0, True, True, False)
    dense, _ = ours(x, idx, 0.3, 1.0, False, True, False)
    sparse, _ = ours(x, idx, 0.3, 1.0, True, True, False)
    total, _ = ours(x, idx, 0.3, 1.0, True, True, True)
    assert not torch.allclose(dense, sparse)
    assert_close(total, sparse * (2 * 24))


def test_shard_positions_match_megatron_varlen():
    # A context-parallel rank's rows (2*cp zigzag chunks 0 and 3 of 4), keys all S.
    S, c = 32, 8
    qpos = torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)])
    x = make_inputs(T=2 * c, S=S, seed=11)
    for sparse in (False, True):
        idx, m_loss, m_grads, bounds = megatron_fused(x, 6, 0.25, 0.5, sparse, True, False,
                                                      q_positions=qpos)
        m_value = megatron_value(x, idx, 0.25, 0.5, sparse, True, False, bounds)
        assert_close(m_value, m_loss)
        loss, grads = ours(x, idx, 0.25, 0.5, sparse, True, False, q_positions=qpos)
        assert_close(loss, m_loss)
        for g, mg in zip(grads, m_grads):
            assert_close(g, mg)


def test_rows_without_visible_keys_match_megatron():
    # Keys start at position 5: rows 0..4 see nothing (zero KL, zero gradient, still counted
    # in the mean), as megatron's key_positions bounds give.
    T = 12
    kpos = torch.arange(T) + 5
    x = make_inputs(T=T, seed=13)
    for sparse in (False, True):
        idx, m_loss, m_grads, bounds = megatron_fused(
            x, 4, 0.3, 1.0, sparse, True, False, key_positions=kpos)
        assert (idx[:, :5] == -1).all()
        loss, grads = ours(x, idx, 0.3, 1.0, sparse, True, False, k_positions=kpos)
        assert_close(loss, m_loss)
        for g, mg in zip(grads, m_grads):
            assert torch.isfinite(g).all()
            assert_close(g, mg)
        assert (grads[0][:, :5] == 0).all()


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_query_valid_rows_match_megatron(sparse, per_token):
    """Rows outside query_valid_rows (a packed batch's padding, real_token_mask_q) add nothing
    and get no gradient; the mean is over the valid rows, per batch entry ([B, T]) or shared
    ([T]); none valid: loss 0 (the count is clamped at 1), as megatron's."""
    x = make_inputs(B=2, T=16, seed=17 + int(sparse) + 2 * int(per_token))
    g = torch.Generator().manual_seed(5)
    shared = torch.rand(16, generator=g) > 0.4
    per_row = torch.rand(2, 16, generator=g) > 0.5
    for mask in (shared, per_row, torch.zeros(16, dtype=torch.bool)):
        full = mask.expand(2, 16)
        idx, m_loss, m_grads, _ = megatron_fused(x, 6, 0.3, 0.7, sparse, True, per_token,
                                                 query_valid_rows=full)
        loss, grads = ours(x, idx, 0.3, 0.7, sparse, True, per_token, query_valid_rows=mask)
        assert_close(loss, m_loss)
        for gr, mg in zip(grads, m_grads):
            assert_close(gr, mg)
        assert (grads[0][~full] == 0).all() and (grads[1][~full] == 0).all()
        if not full.any():
            assert loss == 0
    # The mask changes the value: the test can fail.
    unmasked, _ = ours(x, idx, 0.3, 0.7, sparse, True, per_token)
    masked, _ = ours(x, idx, 0.3, 0.7, sparse, True, per_token, query_valid_rows=shared)
    assert not torch.allclose(unmasked, masked)


def test_query_valid_rows_are_validated():
    x = make_inputs(B=2, T=8, seed=19)
    args = (x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], None, 0.3, 1.0)
    for bad, match in ((torch.ones(8), "query_valid_rows dtype"),
                       (torch.ones(7, dtype=torch.bool), r"query_valid_rows must be \[T=8\]"),
                       (torch.ones(3, 8, dtype=torch.bool), r"\[B=2, T\]"),
                       (torch.ones(2, 8, 1, dtype=torch.bool), "1 or 2 dims")):
        with pytest.raises(ValueError, match=match):
            indexer_kl_loss(*args, sparse=False, backend="reference", query_valid_rows=bad)


def test_target_is_detached():
    x = make_inputs(seed=3)
    query = x["query"].clone().requires_grad_()
    key = x["key"].clone().requires_grad_()
    idx = torch.arange(8).expand(2, 24, 8).contiguous()
    for sparse in (False, True):
        loss = indexer_kl_loss(x["q_index"], x["weights"], x["k_index"], query, key, idx, 0.3,
                               1.0, sparse=sparse, backend="reference")
        loss.backward()
        assert query.grad is None and key.grad is None
        assert x["q_index"].grad is not None and x["q_index"].grad.abs().max() > 0
        # Nothing flows to the main attention even when only it asks for gradients.
        x2 = {n: t.detach() for n, t in x.items()}
        loss2 = indexer_kl_loss(x2["q_index"], x2["weights"], x2["k_index"], query, key, idx,
                                0.3, 1.0, sparse=sparse)
        assert not loss2.requires_grad


def test_chunking_does_not_change_value_or_grads(monkeypatch):
    x = make_inputs(B=2, T=40, Hkv=2, seed=17)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, 40, (2, 40, 7), generator=g)
    idx[:, :, 3] = idx[:, :, 2]  # repeated index: counts once, as megatron's scatter does
    for sparse in (False, True):
        full, full_g = ours(x, idx, 0.2, 1.0, sparse, True, False)
        monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 1)  # one query row per chunk
        small, small_g = ours(x, idx, 0.2, 1.0, sparse, True, False)
        monkeypatch.undo()
        assert_close(small, full)
        for a, b in zip(small_g, full_g):
            assert_close(a, b)


def test_repeated_and_invisible_selected_indices_match_megatron():
    x = make_inputs(seed=19)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(-1, 24, (2, 24, 9), generator=g)  # many not causally visible
    idx[:, :, 4] = idx[:, :, 1]
    _, m_loss, m_grads, bounds = megatron_fused(x, 8, 0.3, 1.0, True, True, False)
    m_value = megatron_value(x, idx, 0.3, 1.0, True, True, False, bounds)
    loss, _ = ours(x, idx, 0.3, 1.0, True, True, False)
    assert_close(loss, m_value)


def test_bf16_inputs_follow_fp32_math():
    x = make_inputs(seed=23, dtype=torch.bfloat16)
    idx, m_loss, m_grads, _ = megatron_fused(x, 8, 0.3, 1.0, True, True, False)
    loss, grads = ours(x, idx, 0.3, 1.0, True, True, False)
    assert_close(loss, m_loss, rtol=1e-4, atol=1e-6)
    for g, mg in zip(grads, m_grads):
        assert g.dtype == torch.bfloat16
        assert_close(g.float(), mg.float(), rtol=2e-2, atol=1e-4)


def test_long_sequence_runs_chunked():
    # 2K tokens dense: the dense path never builds a [T, S] tensor (chunked rows).
    T = 2048
    x = make_inputs(B=1, T=T, H_I=1, D_I=4, Hq=1, Dqk=4, seed=29)
    loss = indexer_kl_loss(x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], None,
                           0.5, 1.0, sparse=False)
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() > 0
    assert torch.isfinite(x["k_index"].grad).all()


def test_32k_tokens_sparse_is_additive_over_row_shards():
    # 32K tokens, sparse loss over a causal sliding selection: the per-token KL sum of the
    # whole sequence equals the sums over two row shards (given their positions).
    T, K = 32768, 16
    x = make_inputs(B=1, T=T, H_I=2, D_I=4, Hq=2, Dqk=4, seed=37)
    idx = torch.arange(T)[:, None] - torch.arange(K) * 37
    idx = idx.masked_fill(idx < 0, -1).unsqueeze(0)
    args = lambda r: (x["q_index"][:, r], x["weights"][:, r], x["k_index"], x["query"][:, r],
                      x["key"], idx[:, r], 0.5, 1.0)
    whole = indexer_kl_loss(*args(slice(None)), sparse=True, calculate_per_token_loss=True)
    whole.backward()
    assert torch.isfinite(x["k_index"].grad).all()
    pos = torch.arange(T)
    half = T // 2
    parts = [indexer_kl_loss(*args(slice(a, b)), sparse=True, calculate_per_token_loss=True,
                             q_positions=pos[a:b]) for a, b in ((0, half), (half, T))]
    assert_close(parts[0] + parts[1], whole.detach())
    assert parts[0] > 0 and parts[1] > 0


def _args(**over):
    x = {n: t.detach() for n, t in make_inputs(B=1, T=6, seed=0).items()}
    idx = torch.zeros(1, 6, 2, dtype=torch.int64)
    a = dict(q_index=x["q_index"], weights=x["weights"], k_index=x["k_index"],
             query=x["query"], key=x["key"], topk_indices=idx, softmax_scale=0.5, loss_coeff=1.0)
    kw = dict(sparse=True)
    for n, v in over.items():
        (a if n in a else kw)[n] = v
    return a, kw


@pytest.mark.parametrize("name,value,match", [
    ("q_index", torch.zeros(1, 6, 3), "q_index"),
    ("q_index", torch.zeros(1, 6, 3, 8, dtype=torch.int32), "q_index"),
    ("weights", torch.zeros(1, 6, 2), "weights"),
    ("k_index", torch.zeros(1, 6, 7), "k_index"),
    ("k_index", torch.zeros(1, 6, 8, dtype=torch.float64), "k_index"),
    ("query", torch.zeros(1, 5, 4, 12), "query"),
    ("key", torch.zeros(1, 6, 1, 11), "key"),
    ("key", torch.zeros(1, 6, 3, 12), "key"),
    ("key", torch.zeros(1, 6, 1, 12, dtype=torch.bfloat16), "key"),
    ("topk_indices", torch.zeros(1, 6, 2), "topk_indices"),
    ("topk_indices", torch.zeros(1, 5, 2, dtype=torch.int64), "topk_indices"),
    ("topk_indices", torch.full((1, 6, 2), 6), "topk_indices"),
    ("topk_indices", torch.full((1, 6, 2), -2), "topk_indices"),
    ("topk_indices", None, "topk_indices"),
    ("softmax_scale", 0.0, "softmax_scale"),
    ("softmax_scale", float("nan"), "softmax_scale"),
    ("loss_coeff", float("inf"), "loss_coeff"),
    ("loss_coeff", True, "loss_coeff"),
    ("sparse", 1, "sparse"),
    ("relu", None, "relu"),
    ("calculate_per_token_loss", 0, "calculate_per_token_loss"),
    ("q_positions", torch.arange(5), "q_positions"),
    ("k_positions", torch.arange(6.0), "k_positions"),
    ("q_positions", torch.arange(6, device="meta"), "q_positions"),
    ("backend", "cuda", "backend"),
])
def test_validation_errors(name, value, match):
    a, kw = _args(**{name: value})
    with pytest.raises(ValueError, match=match):
        indexer_kl_loss(*a.values(), **kw)


@pytest.mark.parametrize("name", ["q_index", "weights", "k_index", "query", "key"])
def test_nan_inf_rejected(name):
    a, kw = _args()
    bad = a[name].clone()
    bad.view(-1)[3] = float("nan") if name != "key" else float("inf")
    a[name] = bad
    with pytest.raises(ValueError, match=name):
        indexer_kl_loss(*a.values(), **kw)


def test_triton_dense_declines_what_it_cannot_take(monkeypatch):
    # The dense warm-up loss has a Triton kernel (tests/ops/test_indexer_loss_dense_triton.py);
    # an explicit mask or a tensor-parallel split of the heads stays on the reference, and
    # asking backend='triton' for them names the cause.
    a, kw = _args()
    kw["sparse"] = False
    with pytest.raises(ValueError, match="visible"):
        indexer_kl_loss(*a.values(), **kw, backend="triton",
                        visible=torch.ones(6, 6, dtype=torch.bool))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="tp_group"):
        indexer_kl_loss(*a.values(), **kw, backend="triton", tp_group=object())


def test_large_logits_stay_finite_and_match_megatron():
    # Attention logits in the hundreds (and indexer scores too): both softmaxes must shift by
    # the row max; target entries underflow to 0 and hit megatron's eps clamp in the KL.
    x = make_inputs(seed=31)
    x["query"] = x["query"] * 40
    with torch.no_grad():
        x["q_index"].mul_(10)
    for sparse in (False, True):
        idx, m_loss, m_grads, _ = megatron_fused(x, 8, 0.5, 1.0, sparse, False, False)
        loss, grads = ours(x, idx, 0.5, 1.0, sparse, False, False)
        assert torch.isfinite(loss)
        assert_close(loss, m_loss)
        for g, mg in zip(grads, m_grads):
            assert_close(g, mg)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("mask_shape", ["per-batch", "shared"])
def test_explicit_mask_matches_megatron(sparse, mask_shape):
    """An explicit key mask (megatron's attention_mask with attn_mask_type=None: an additive
    -inf mask, no causality): visible=~mask with causal=False gives megatron's value and
    gradients, with random holes, a row that sees no key (KL 0, counted in the mean) and rows
    seeing fewer keys than top-k."""
    B, T = 2, 24
    x = make_inputs(B=B, T=T, seed=21 + int(sparse))
    g = torch.Generator().manual_seed(22)
    visible = torch.rand(B if mask_shape == "per-batch" else 1, T, T, generator=g) > 0.5
    visible[:, 5] = False
    float_mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    q, w, k, query, key = to_megatron(x, x["query"].shape[2])
    idx, m_loss = mdsa.FusedDSAIndexerLoss.apply(
        q, w, k, query.detach(), key.detach(), 0.3, 8, 0.5, float_mask.expand(B, T, T), sparse,
        PG_TP1, None, None, None, None, False, True)
    m_grads = torch.autograd.grad(m_loss, (x["q_index"], x["weights"], x["k_index"]))
    assert (idx[:, 5] == -1).all() and ((idx >= 0).sum(-1) < 8).any()
    loss, grads = ours(x, idx, 0.3, 0.5, sparse, True, False, causal=False,
                       visible=visible if mask_shape == "per-batch" else visible[0])
    assert_close(loss, m_loss.detach())
    for got, want in zip(grads, m_grads, strict=True):
        assert want.abs().max() > 0
        assert_close(got, want)
    # The mask matters: without it (causal=False alone) the dense loss differs.
    if not sparse:
        other, _ = ours(x, idx, 0.3, 0.5, sparse, True, False, causal=False)
        assert not torch.allclose(other, loss)


def test_explicit_mask_is_checked():
    x = make_inputs(B=1, T=6)
    idx = torch.zeros(1, 6, 2, dtype=torch.int64)
    kw = dict(sparse=False, relu=True, per_token=False)
    with pytest.raises(ValueError, match="visible"):
        ours(x, idx, 0.3, 1.0, visible=torch.ones(6, 6), **kw)
    with pytest.raises(ValueError, match="visible"):
        ours(x, idx, 0.3, 1.0, visible=torch.ones(6, 5, dtype=torch.bool), **kw)
    with pytest.raises(ValueError, match="visible"):
        indexer_kl_loss(x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], idx,
                        0.3, 1.0, sparse=True, visible=torch.ones(6, 6, dtype=torch.bool),
                        backend="triton")

"""Bad inputs to the ops (issue #23, item 6): repeated indices, backend="triton" on a CPU tensor
without Triton's interpreter, NaN / Inf in the indexer inputs (stock's behaviour against ours).
"""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch

from megatron_hyscale.ops import checks, hytopk, indexer_kl_loss, sparse_attention

# The modules (the package re-exports the functions under the same names).
sparse_attention_module = importlib.import_module("megatron_hyscale.ops.sparse_attention")
indexer_loss_module = importlib.import_module("megatron_hyscale.ops.indexer_loss")

B, T, S, HQ, HKV, D = 2, 5, 9, 4, 2, 8


def attention_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, D, generator=g)
    k = torch.randn(B, S, HKV, D, generator=g)
    v = torch.randn(B, S, HKV, D, generator=g)
    idx = torch.stack([torch.randperm(S, generator=g)[:4] for _ in range(B * T * HKV)])
    idx = idx.view(B, T, HKV, 4).int()
    idx[0, 1, 0, 3] = -1  # -1 slots may repeat: they are no key
    idx[0, 1, 0, 2] = -1
    return q, k, v, idx


def loss_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    q_index, weights, k_index = r(B, T, 3, 8), r(B, T, 3), r(B, S, 8)
    query, key = r(B, T, HQ, D), r(B, S, 1, D)
    idx = torch.stack([torch.randperm(S, generator=g)[:4] for _ in range(B * T)]).view(B, T, 4)
    return q_index, weights, k_index, query, key, idx.int()


# ------------------------------------------------------------------------------------------
# Repeated indices
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_head", [True, False], ids=["per-kv-head", "shared"])
def test_sparse_attention_rejects_a_repeated_index_naming_the_first_row(per_head):
    q, k, v, idx = attention_inputs()
    if not per_head:
        idx = idx[:, :, 0].contiguous()
    row = idx[1, 3] if not per_head else idx[1, 3, 1]
    row[2] = row[0]  # (batch 1, row 3[, kv head 1]) lists row[0] twice
    later = idx[1, 4] if not per_head else idx[1, 4, 0]
    later[1] = later[0]  # a later row too: the first one is named
    where = "batch 1, row 3, kv head 1" if per_head else "batch 1, row 3"
    with pytest.raises(ValueError, match=rf"indices repeats key {int(row[0])} in one row "
                                         rf"\({where}\).*check_values=False"):
        sparse_attention(q, k, v, idx, 0.3)


def test_repeated_index_found_across_check_slices_and_in_strided_indices(monkeypatch):
    monkeypatch.setattr(checks, "DISTINCT_CHECK_ELEMENTS", 8)  # one row per slice
    q, k, v, idx = attention_inputs()
    wide = torch.full((B, T, HKV, 8), -1, dtype=torch.int32)
    wide[..., ::2] = idx  # a strided view: every other slot
    strided = wide[..., ::2]
    assert not strided.is_contiguous()
    sparse_attention(q, k, v, strided, 0.3)  # distinct: accepted
    strided[1, 4, 0, 3] = strided[1, 4, 0, 1]
    with pytest.raises(ValueError, match=r"\(batch 1, row 4, kv head 0\)"):
        sparse_attention(q, k, v, strided, 0.3)


def test_unchecked_repeat_counts_twice_lse_up_by_ln2():
    """What check_values guards against: with the check off a doubled key counts twice."""
    q, k, v, _ = attention_inputs()
    one = torch.tensor([[3, -1]], dtype=torch.int32).expand(B, T, HKV, 2).contiguous()
    two = torch.tensor([[3, 3]], dtype=torch.int32).expand(B, T, HKV, 2).contiguous()
    _, lse1 = sparse_attention(q, k, v, one, 0.3, return_lse=True)
    _, lse2 = sparse_attention(q, k, v, two, 0.3, return_lse=True, check_values=False)
    torch.testing.assert_close(lse2 - lse1, torch.full_like(lse1, math.log(2)))
    with pytest.raises(ValueError, match="repeats key 3"):
        sparse_attention(q, k, v, two, 0.3)


def test_listed_prefix_key_is_checked_only_with_check_values():
    q, k, v, _ = attention_inputs()
    g = torch.Generator().manual_seed(1)
    idx = 2 + torch.stack([torch.randperm(S - 2, generator=g)[:4] for _ in range(B * T * HKV)])
    idx = idx.view(B, T, HKV, 4).int()  # distinct, every listed key past the prefix
    idx[0, 0, 0, 0] = 1  # row (0, 0) lists key 1 of its prefix 0 .. 1
    prefix = torch.full((B, T), 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="prefix"):
        sparse_attention(q, k, v, idx, 0.3, prefix_lengths=prefix)
    sparse_attention(q, k, v, idx, 0.3, prefix_lengths=prefix, check_values=False)


def test_check_values_must_be_a_bool():
    q, k, v, idx = attention_inputs()
    with pytest.raises(ValueError, match="check_values"):
        sparse_attention(q, k, v, idx, 0.3, check_values=1)
    with pytest.raises(ValueError, match="check_values"):
        indexer_kl_loss(*loss_inputs(), 0.3, 1.0, sparse=True, check_values="yes")


def count_checks(monkeypatch) -> dict[str, int]:
    """Count the duplicate check's entries and its sorts (the only sorts and syncs it adds)."""
    calls = {"check": 0, "sort": 0}
    check, repeats = checks.check_distinct_indices, checks._repeats

    def counted_check(*a, **kw):
        calls["check"] += 1
        return check(*a, **kw)

    def counted_repeats(*a, **kw):
        calls["sort"] += 1
        return repeats(*a, **kw)

    for module in (sparse_attention_module, indexer_loss_module):
        monkeypatch.setattr(module, "check_distinct_indices", counted_check)
    monkeypatch.setattr(checks, "_repeats", counted_repeats)
    return calls


def test_layers_hot_path_skips_the_check(monkeypatch):
    """check_values=False (what the layers pass) runs no duplicate check, so no sort and no
    host sync of it; the default runs it once per call."""
    calls = count_checks(monkeypatch)
    q, k, v, idx = attention_inputs()
    q.requires_grad_()
    sparse_attention(q, k, v, idx, 0.3, check_values=False).sum().backward()
    sparse_attention(q, k, None, idx[:, :, 0], 0.3, check_values=False)  # shared indices
    q_index, weights, k_index, query, key, sel = loss_inputs()
    lse = sparse_attention(query, key, None, sel, 0.3, return_lse=True, check_values=False)[1]
    indexer_kl_loss(q_index, weights, k_index, query, key, sel, 0.3, 1.0, sparse=True,
                    attention_lse=lse, check_values=False)
    assert calls == {"check": 0, "sort": 0}
    sparse_attention(q, k, v, idx, 0.3)
    assert calls == {"check": 1, "sort": 1}


def test_indexer_loss_checks_repeats_only_where_it_relies_on_distinct_indices(monkeypatch):
    q_index, weights, k_index, query, key, sel = loss_inputs()
    lse = sparse_attention(query, key, None, sel, 0.3, return_lse=True)[1]
    sel[1, 2, 3] = sel[1, 2, 0]
    args = (q_index, weights, k_index, query, key, sel, 0.3, 1.0)
    # No attention_lse: a repeated index is legal and counts once, as in megatron.
    calls = count_checks(monkeypatch)
    indexer_kl_loss(*args, sparse=True)
    indexer_kl_loss(*args, sparse=False)
    assert calls["check"] == 0
    # With the attention's lse the slots must be the attention's, distinct.
    with pytest.raises(ValueError, match=r"topk_indices repeats key \d+ in one row "
                                         r"\(batch 1, row 2\)"):
        indexer_kl_loss(*args, sparse=True, attention_lse=lse)
    indexer_kl_loss(*args, sparse=True, attention_lse=lse, check_values=False)


# ------------------------------------------------------------------------------------------
# backend="triton" on CPU tensors
# ------------------------------------------------------------------------------------------


def hytopk_call(backend):
    q_index, weights, k_index = loss_inputs()[:3]
    return hytopk(q_index, k_index, weights, 3, backend=backend)


def attention_call(backend):
    q, k, v, idx = attention_inputs()
    return sparse_attention(q, k, v, idx, 0.3, backend=backend)


def loss_call(backend):
    return indexer_kl_loss(*loss_inputs(), 0.3, 1.0, sparse=True, backend=backend)


OP_CALLS = [hytopk_call, attention_call, loss_call]


@pytest.mark.parametrize("call", OP_CALLS, ids=["hytopk", "sparse_attention", "indexer_loss"])
def test_triton_backend_on_cpu_without_interpreter_is_refused(call, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not checks.triton_interpret()
    with pytest.raises(ValueError, match=r"backend='triton'.*cpu.*TRITON_INTERPRET=1.*CUDA"):
        call("triton")


@pytest.mark.parametrize("call", OP_CALLS, ids=["hytopk", "sparse_attention", "indexer_loss"])
def test_auto_backend_on_cpu_without_interpreter_runs_the_reference(call, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    got = call("auto")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    want = call("reference")
    for a, b in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b)


def test_triton_interpret_follows_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert checks.triton_interpret()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not checks.triton_interpret()


# ------------------------------------------------------------------------------------------
# NaN / Inf in the indexer inputs
# ------------------------------------------------------------------------------------------


def test_nan_indexer_key_stock_selects_it_past_the_mask_hytopk_refuses():
    """Stock (megatron-core 0.19.2's fused_qk_topk_naive) checks nothing: torch.topk ranks NaN
    first, so every row picks a NaN key, also rows the causal mask hides it from. HyTopK
    raises ValueError naming k instead (its contract, also in training: see its docstring)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            fused_qk_topk_naive,
        )
    g = torch.Generator().manual_seed(3)
    n, H, Dh = 6, 2, 4
    q, k, w = torch.randn(n, 1, H, Dh, generator=g), torch.randn(n, 1, Dh, generator=g), \
        torch.randn(n, 1, H, generator=g)
    k[4] = float("nan")
    mask = torch.triu(torch.full((n, n), float("-inf")), 1)
    _, stock = fused_qk_topk_naive(q, k, w, 2, mask=mask)
    assert (stock[0, :, 0] == 4).all()  # rows 0 .. 3 cannot see key 4, and pick it first
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        hytopk(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1), 2)


@pytest.mark.parametrize("name", ["q_index", "weights", "k_index"])
def test_non_finite_indexer_input_to_the_loss_is_refused(name):
    args = dict(zip(("q_index", "weights", "k_index", "query", "key", "topk_indices"),
                    loss_inputs()))
    args[name] = args[name].clone()
    args[name].view(-1)[1] = float("inf")
    with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
        indexer_kl_loss(*args.values(), 0.3, 1.0, sparse=True)

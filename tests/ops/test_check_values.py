"""`check_values=False`: the ops skip every check that reads tensor values (each a host sync)
and tell the library backends what the caller vouches for; the default keeps every check."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_hyscale.ops import checks, hytopk, indexer_kl_loss, sparse_attention
from megatron_hyscale.ops.backends import cudnn_indexer_loss, cudnn_selection, library_attention


def selection_inputs(B=1, T=16, S=16, H=2, D=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, T, H, D, generator=g), torch.randn(B, S, D, generator=g),
            torch.randn(B, T, H, generator=g))


def attention_inputs(B=1, T=16, H=2, D=8, K=4):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, T, 1, D, generator=g)
    idx, _ = hytopk(*selection_inputs(B, T, T), K, backend="reference")
    return q, k, idx


@pytest.fixture
def value_checks(monkeypatch):
    """Counts the value checks the ops make (each one reads the tensor back to the host)."""
    calls = []
    for name in ("check_finite", "check_index_range"):
        original = getattr(checks, name)

        def counted(*a, _orig=original, _name=name, **kw):
            calls.append(_name)
            return _orig(*a, **kw)

        for module in ("hytopk", "sparse_attention", "indexer_loss"):
            # the package's names are the ops (functions): patch their modules
            target = importlib.import_module(f"megatron_hyscale.ops.{module}")
            if hasattr(target, name):
                monkeypatch.setattr(target, name, counted)
    return calls


def test_default_checks_values_and_false_skips_them(value_checks):
    q, k, w = selection_inputs()
    hytopk(q, k, w, 4, backend="reference")
    assert value_checks.count("check_finite") == 3
    value_checks.clear()
    hytopk(q, k, w, 4, backend="reference", check_values=False)
    assert value_checks == []

    query, key, idx = attention_inputs()
    sparse_attention(query, key, None, idx, 0.5, backend="reference")
    assert "check_index_range" in value_checks and "check_finite" in value_checks
    value_checks.clear()
    sparse_attention(query, key, None, idx, 0.5, backend="reference", check_values=False)
    assert value_checks == []

    qi, ki, wi = selection_inputs()
    indexer_kl_loss(qi, wi, ki, query, key, idx, 0.5, 0.1, sparse=True, backend="reference")
    assert "check_index_range" in value_checks and "check_finite" in value_checks
    value_checks.clear()
    indexer_kl_loss(qi, wi, ki, query, key, idx, 0.5, 0.1, sparse=True, backend="reference",
                    check_values=False)
    assert value_checks == []


def test_default_still_refuses_bad_values():
    q, k, w = selection_inputs()
    q[0, 3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="q contains NaN"):
        hytopk(q, k, w, 4, backend="reference")
    query, key, idx = attention_inputs()
    idx[0, 5, 0] = 99
    with pytest.raises(ValueError, match="indices must lie in"):
        sparse_attention(query, key, None, idx, 0.5, backend="reference")


@pytest.mark.parametrize("op", ["hytopk", "sparse_attention", "indexer_kl_loss"])
def test_check_values_must_be_a_bool(op):
    q, k, w = selection_inputs()
    query, key, idx = attention_inputs()
    call = {
        "hytopk": lambda v: hytopk(q, k, w, 4, backend="reference", check_values=v),
        "sparse_attention": lambda v: sparse_attention(query, key, None, idx, 0.5,
                                                       backend="reference", check_values=v),
        "indexer_kl_loss": lambda v: indexer_kl_loss(q, w, k, query, key, idx, 0.5, 0.1,
                                                     sparse=True, backend="reference",
                                                     check_values=v),
    }[op]
    with pytest.raises(ValueError, match="check_values must be a bool"):
        call(1)


@pytest.fixture
def fake_library(monkeypatch):
    """The library backends as recorders: every call 'runs' and returns the reference's shape."""
    seen = {}

    def record(name, result):
        def fake(*a, **kw):
            seen[name] = kw
            return result(*a)
        return fake

    for module, fn in ((cudnn_selection, "cudnn_selection_unsupported"),
                       (library_attention, "library_attention_unsupported"),
                       (library_attention, "flashmla_forward_unsupported"),
                       (library_attention, "cudnn_backward_unsupported"),
                       (cudnn_indexer_loss, "cudnn_indexer_loss_unsupported")):
        monkeypatch.setattr(module, fn, lambda *a, _fn=fn, **kw: seen.__setitem__(_fn, kw))
    monkeypatch.setattr(cudnn_selection, "cudnn_selection", record(
        "selection", lambda q, k, w, topk: hytopk(q, k, w, topk, backend="reference")))
    monkeypatch.setattr(library_attention, "library_attention", record(
        "attention", lambda q, k, idx, scale: sparse_attention(q, k, None, idx, scale,
                                                               backend="reference",
                                                               return_lse=True)))
    monkeypatch.setattr(cudnn_indexer_loss, "cudnn_indexer_loss", record(
        "loss", lambda *a: torch.zeros(())))
    return seen


def test_default_positions_and_trusted_slots_reach_the_library(fake_library):
    q, k, w = selection_inputs(T=8, S=16)
    hytopk(q, k, w, 4, backend="cudnn", check_values=False)
    assert fake_library["selection"]["q_start"] == 8  # S - T, known without a read-back
    assert fake_library["cudnn_selection_unsupported"]["kpos"] is None
    hytopk(q, k, w, 4, backend="cudnn", q_positions=torch.arange(8) + 8,
           k_positions=torch.arange(16))
    assert fake_library["selection"]["q_start"] is None
    assert torch.equal(fake_library["cudnn_selection_unsupported"]["kpos"],
                       torch.arange(16)[None])

    query, key, idx = attention_inputs()
    sparse_attention(query, key, None, idx, 0.5, backend="cudnn", check_values=False,
                     hytopk_layout=True)
    assert fake_library["attention"]["hytopk_layout"] is True
    sparse_attention(query, key, None, idx, 0.5, backend="cudnn", check_values=False)
    assert fake_library["attention"]["hytopk_layout"] is False

    qi, ki, wi = selection_inputs()
    lse = torch.zeros(query.shape[:3])
    indexer_kl_loss(qi, wi, ki, query, key, idx, 0.5, 0.1, sparse=True, backend="cudnn",
                    attention_lse=lse, check_values=False, hytopk_layout=True)
    assert fake_library["loss"]["hytopk_layout"] is True
    assert fake_library["cudnn_indexer_loss_unsupported"]["kpos"] is None
    indexer_kl_loss(qi, wi, ki, query, key, idx, 0.5, 0.1, sparse=True, backend="cudnn",
                    attention_lse=lse, k_positions=torch.arange(16))
    assert fake_library["loss"]["hytopk_layout"] is False
    assert fake_library["cudnn_indexer_loss_unsupported"]["kpos"] is not None


def test_known_valid_first_skips_only_the_layout_test():
    from megatron_hyscale.ops.backends.slots import valid_first

    idx = torch.tensor([[[3, 1, -1], [0, -1, -1]]], dtype=torch.int32)
    got, length = valid_first(idx, known_valid_first=True)
    assert torch.equal(got, idx) and length.tolist() == [[2, 1]]

"""Library backends on CPU: slot layouts, and the reasons a call cannot run on them."""

from __future__ import annotations

import torch

from megatron_hyscale.ops.backends.availability import CUDNN, FLASHMLA, library_unavailable
from megatron_hyscale.ops.backends.cudnn_indexer_loss import cudnn_indexer_loss_unsupported
from megatron_hyscale.ops.backends.cudnn_selection import (
    _contiguous_runs,
    cudnn_selection_unsupported,
)
from megatron_hyscale.ops.backends.library_attention import library_attention_unsupported
from megatron_hyscale.ops.backends.slots import flat_key_ids, valid_first


def test_valid_first_keeps_order_and_counts():
    idx = torch.tensor([[[5, -1, 3, -1, 7], [-1, -1, -1, -1, -1], [1, 2, 3, 4, 0]]])
    got, length = valid_first(idx)
    assert got.tolist() == [[[5, 3, 7, -1, -1], [-1] * 5, [1, 2, 3, 4, 0]]]
    assert length.tolist() == [[3, 0, 5]] and length.dtype == torch.int32
    assert got.dtype == torch.int32 and got.is_contiguous()


def test_valid_first_leaves_compact_rows_alone():
    idx = torch.tensor([[[4, 2, -1], [0, -1, -1]]], dtype=torch.int32)
    got, length = valid_first(idx)
    assert torch.equal(got, idx) and length.tolist() == [[2, 1]]


def test_flat_key_ids_offsets_each_batch_and_keeps_empty_slots():
    idx = torch.tensor([[[0, 2, -1]], [[1, -1, 3]]], dtype=torch.int32)
    assert flat_key_ids(idx, 10).tolist() == [[[0, 2, -1]], [[11, -1, 13]]]
    assert flat_key_ids(idx[:1], 10) is not None


def test_contiguous_runs_split_where_positions_jump():
    pos = torch.tensor([[0, 1, 2, 10, 11, 4], [5, 6, 7, 15, 16, 9]])
    assert _contiguous_runs(pos) == [(0, 3), (3, 5), (5, 6)]
    assert _contiguous_runs(torch.arange(4)[None]) == [(0, 4)]


def test_unsupported_calls_name_their_reason_on_cpu():
    q = torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    w = torch.zeros(1, 8, 4)
    kpos = torch.arange(8)[None]
    reason = cudnn_selection_unsupported(q, k, w, relu=True, causal=True, kpos=kpos)
    assert reason and "CUDA" in reason
    for lib in (CUDNN, FLASHMLA):
        assert "CUDA" in library_unavailable(lib, torch.device("cpu"))
    query = torch.zeros(1, 8, 64, 576, dtype=torch.bfloat16)
    key = torch.zeros(1, 8, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 8, 4, dtype=torch.int32)
    assert library_attention_unsupported(query, key, None, idx, 512, prefix_lengths=None,
                                         deterministic=False)
    assert cudnn_indexer_loss_unsupported(q, w, query, key, sparse=True, relu=True, kpos=kpos,
                                          attention_lse=None)


def test_cudnn_backend_on_cpu_warns_once_and_runs_hyscale(recwarn):
    import warnings

    from megatron_hyscale.ops import hytopk, indexer_kl_loss, sparse_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 2, 8, generator=g)
    k = torch.randn(1, 16, 8, generator=g)
    w = torch.randn(1, 16, 2, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got = hytopk(q, k, w, 4, backend="cudnn")
    ref = hytopk(q, k, w, 4, backend="reference")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    msgs = [str(c.message) for c in caught if "backend='cudnn'" in str(c.message)]
    assert len(msgs) == 1 and "CUDA" in msgs[0], msgs  # once, naming why

    qa = torch.randn(1, 16, 2, 8, generator=g)
    ka = torch.randn(1, 16, 1, 8, generator=g)
    idx = ref[0]
    out = sparse_attention(qa, ka, None, idx, 0.3, backend="best")
    assert torch.equal(out, sparse_attention(qa, ka, None, idx, 0.3, backend="reference"))
    loss = indexer_kl_loss(q, w, k, qa, ka, idx, 0.3, 0.1, sparse=True, backend="cudnn")
    want = indexer_kl_loss(q, w, k, qa, ka, idx, 0.3, 0.1, sparse=True, backend="reference")
    assert torch.equal(loss, want)


def test_a_row_mask_keeps_the_loss_off_the_library(monkeypatch):
    """cuDNN's indexer kernels weigh every row: with query_valid_rows the op does not take
    them, even where they could run the call (stood in here), and says why once."""
    import warnings

    from megatron_hyscale.ops import indexer_kl_loss
    from megatron_hyscale.ops.backends import cudnn_indexer_loss as lib

    def refuse(*args, **kwargs):
        raise AssertionError("the library ran a masked indexer loss")

    monkeypatch.setattr(lib, "cudnn_indexer_loss_unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(lib, "cudnn_indexer_loss", refuse)
    g = torch.Generator().manual_seed(1)
    q, k, w = (torch.randn(1, 16, 2, 8, generator=g), torch.randn(1, 16, 8, generator=g),
               torch.randn(1, 16, 2, generator=g))
    qa, ka = torch.randn(1, 16, 2, 8, generator=g), torch.randn(1, 16, 1, 8, generator=g)
    idx = torch.arange(4, dtype=torch.int32).expand(1, 16, 4).contiguous()
    mask = torch.arange(16) % 3 != 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss = indexer_kl_loss(q, w, k, qa, ka, idx, 0.3, 0.1, sparse=True,
                                   backend="cudnn", query_valid_rows=mask)
    msgs = [str(c.message) for c in caught if "backend='cudnn'" in str(c.message)]
    assert len(msgs) == 1 and "query_valid_rows" in msgs[0], msgs
    want = indexer_kl_loss(q, w, k, qa, ka, idx, 0.3, 0.1, sparse=True, backend="reference",
                           query_valid_rows=mask)
    assert torch.equal(loss, want)


def test_unknown_backend_is_refused_by_name():
    import pytest

    from megatron_hyscale.ops import hytopk

    x = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="backend"):
        hytopk(x, torch.zeros(1, 4, 8), torch.zeros(1, 4, 1), 2, backend="flash")


def test_measured_table_picks_the_faster_kernel_at_the_nearest_length(tmp_path, monkeypatch):
    import json

    from megatron_hyscale.ops.backends import measured

    table = tmp_path / "t.json"
    entries = [dict(op="selection", shape="S", T=16384, own_ms=10.0, library_ms=5.0, source="a"),
               dict(op="selection", shape="S", T=262144, own_ms=900.0, library_ms=1000.0,
                    source="b")]
    table.write_text(json.dumps({"entries": entries}))
    monkeypatch.setattr(measured, "TABLE_PATH", table)
    assert measured.faster_backend("selection", "S", 8192)[0] == measured.LIBRARY
    assert measured.faster_backend("selection", "S", 1 << 20)[0] == measured.OWN
    pick, why = measured.faster_backend("selection", "other", 8192)
    assert pick == measured.OWN and "never measured" in why


def test_measured_table_reads_the_running_devices_entries(tmp_path, monkeypatch):
    """Entries measured on the running device decide; a device that never measured the shape
    reads those of the device that measured it most, and says which."""
    import json

    from megatron_hyscale.ops.backends import measured

    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    att = dict(op="attention", shape="A", T=131072, source="s", own_ms=0.0, library_ms=0.0)
    entries = [dict(op="selection", shape="S", T=16384, own_ms=10.0, library_ms=5.0,
                    source="a", device=h200),
               dict(op="selection", shape="S", T=16384, own_ms=4.0, library_ms=5.0,
                    source="b", device=h100),
               dict(att, own_fwd_bwd_ms=[100.0, 400.0], library_fwd_bwd_ms=[90.0, 600.0],
                    device=h200),
               dict(att, own_fwd_bwd_ms=[100.0, 700.0], library_fwd_bwd_ms=[90.0, 600.0],
                    device=h100)]
    table = tmp_path / "devices.json"
    table.write_text(json.dumps({"entries": entries}))
    monkeypatch.setattr(measured, "TABLE_PATH", table)
    assert measured.faster_backend("selection", "S", 16384, device=h200)[0] == measured.LIBRARY
    assert measured.faster_backend("selection", "S", 16384, device=h100)[0] == measured.OWN
    assert measured.attention_plan("A", 131072, device=h200)[0] == measured.FLASHMLA_FORWARD
    assert measured.attention_plan("A", 131072, device=h100)[0] == measured.LIBRARY_PAIR
    # Ties on entry counts go to the first name in sorted order: H100 here.
    pick, why = measured.faster_backend("selection", "S", 16384, device="NVIDIA A100")
    assert pick == measured.OWN and f"on {h100}" in why
    entries.append(dict(entries[0], T=65536))  # H200 now measured "S" most
    entries += [dict(entries[1], shape="other", T=T) for T in (1, 2, 3)]  # other shapes: no say
    table.write_text(json.dumps({"entries": entries}))
    measured._entries.cache_clear()
    pick, why = measured.faster_backend("selection", "S", 16384, device="NVIDIA A100")
    assert pick == measured.LIBRARY and f"on {h200}" in why
    measured._entries.cache_clear()

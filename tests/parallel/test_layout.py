"""parallel.cp_row_layout: the CP group and the local rows' global positions every HyScale
attention layer reads (DSA, V4, QSA), on stand-in groups (no processes needed)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_hyscale.parallel import cp_row_layout, zigzag_positions
from megatron_hyscale.parallel import layout as layout_module
from megatron_hyscale.testing.distributed import FakeGroup


@pytest.fixture
def distributed(monkeypatch):
    monkeypatch.setattr(layout_module.dist, "is_initialized", lambda: True)


def test_without_cp_the_rows_are_0_to_rows():
    for pg in (None, types.SimpleNamespace(cp=None), types.SimpleNamespace()):
        rows = cp_row_layout(pg, 7, "cpu", layer="L", key_rows=7)
        assert rows.group is None and rows.size == 1
        assert torch.equal(rows.positions, torch.arange(7))


def test_cp_rows_are_the_zigzag_chunks(distributed):
    group = FakeGroup(4, 1)
    rows = cp_row_layout(types.SimpleNamespace(cp=group), 6, "cpu", layer="L", key_rows=6)
    assert rows.group is group and rows.size == 4
    assert torch.equal(rows.positions, zigzag_positions(6, 4, 1))
    assert rows.positions.tolist() == [3, 4, 5, 18, 19, 20]  # chunks 1 and 6 of 8
    one = cp_row_layout(types.SimpleNamespace(cp=FakeGroup(1, 0)), 5, "cpu", layer="L")
    assert one.group is None and torch.equal(one.positions, torch.arange(5))


def test_cp_rows_must_be_two_chunks_and_match_the_keys(distributed):
    pg = types.SimpleNamespace(cp=FakeGroup(2, 0))
    with pytest.raises(ValueError, match="MyLayer under context parallelism.*even"):
        cp_row_layout(pg, 7, "cpu", layer="MyLayer")
    with pytest.raises(ValueError, match="as many local key rows"):
        cp_row_layout(pg, 8, "cpu", layer="MyLayer", key_rows=6)


def test_a_layer_built_alone_takes_megatrons_cp_group(distributed, monkeypatch):
    from megatron.core import parallel_state

    group = FakeGroup(2, 1)
    monkeypatch.setattr(parallel_state, "get_context_parallel_group",
                        lambda check_initialized=True: group)
    rows = cp_row_layout(None, 4, "cpu", layer="L",
                         config=types.SimpleNamespace(context_parallel_size=2))
    assert rows.group is group and rows.positions.tolist() == [2, 3, 4, 5]
    # A pg_collection wins over the global group; a config asking for CP 1 takes none.
    assert cp_row_layout(types.SimpleNamespace(cp=None), 4, "cpu", layer="L",
                         config=types.SimpleNamespace(context_parallel_size=2)).group is None
    assert cp_row_layout(None, 4, "cpu", layer="L",
                         config=types.SimpleNamespace(context_parallel_size=1)).group is None

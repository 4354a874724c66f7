"""bench_selection's select-variant methods (issue #21) and their table, on CPU.

The methods run through the Triton interpreter on tiny integer-valued inputs (the bench builds
its positions on CUDA, so they are rebuilt on the CPU here, as for the fp8 methods, whose
module sets the interpreter up): each equals the op, and the comparison with the default kernel
that the bench records says so; the table renders from hand-made records.
"""

from __future__ import annotations

import pytest
import torch
from test_bench_selection_fp8 import cpu_positions, sel  # noqa: F401 (sel: a fixture)

from megatron_hyscale.ops import hytopk
from megatron_hyscale.testing.compare import assert_rows_hold_sorted_sets


def test_select_methods_select_as_the_op(sel, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sel, "positions", cpu_positions)
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-2, 3, (1, 16, 4, 32), generator=g).float()
    k = torch.randint(-2, 3, (1, 16, 32), generator=g).float()
    w = torch.randint(-2, 3, (1, 16, 4), generator=g).float()
    want = hytopk(q, k, w, 6, backend="reference")
    want_key = hytopk(q, k, w, 6, backend="reference", order="key")
    assert set(sel.SELECT_VARIANTS) <= set(sel.VARIANT_METHODS) <= set(sel.KERNEL_METHODS)
    assert sel.SELECT_VARIANTS["hytopk_select"]["sort_in_kernel"] is True
    assert "hytopk_default_key" in sel.KEY_ORDER_METHODS
    for method in sel.VARIANT_METHODS:
        if method in sel.GLUON_METHODS:  # Hopper only: tests/ops/test_hytopk_sm90.py
            continue
        got = sel.METHODS[method](q, k, w, 6, True)
        ordered = method != "hytopk_select_unordered"
        key_order = method in sel.KEY_ORDER_METHODS
        if key_order:  # the layers' order, as the default's rows sorted by key
            assert torch.equal(got[0], want_key[0]) and torch.equal(got[1], want_key[1]), method
        elif ordered:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), method
        else:
            assert_rows_hold_sorted_sets(got[0], got[1], want[0], want[1])
        assert sel.same_as_default(got, q, k, w, 6, True, ordered=ordered,
                                   key_order=key_order), method
        if key_order:  # its rows are not the default's order
            assert not sel.same_as_default(got, q, k, w, 6, True), method
    # The comparison can fail: a row out of order is not the default's output.
    assert not sel.same_as_default((want[0].flip(-1), want[1].flip(-1)), q, k, w, 6, True)
    stats = torch.zeros(2, dtype=torch.int32)
    sel.METHODS["hytopk_sample"](q, k, w, 6, True, sample_stats=stats)
    assert stats.tolist() == [0, 0]  # 16 keys: too few to sample
    best = sel.METHODS["scoreonly_head_major"](q, k, w, 6, True)[1][..., 0]  # each row's max score
    assert torch.equal(best, want[1][..., 0])


def test_gluon_selections_are_declared_once(sel):  # noqa: F811
    """Each entry of GLUON_SELECTIONS is a method that hands its fields to
    run_hytopk_scores_sm90 (HyTopKOptions), a variant compared with the default, a Gluon
    method (not run off Hopper), unlimited in length, and in KEY_ORDER_METHODS exactly when it
    asks for key order."""
    assert {"hytopk_scores_sm90_ahead_key", "hytopk_scores_sm90_scan_slots"} <= set(
        sel.GLUON_SELECTIONS)
    for name, fields in sel.GLUON_SELECTIONS.items():
        assert sel.METHODS[name].func is sel.run_hytopk_scores_sm90, name
        assert sel.METHODS[name].keywords == fields, name
        assert name in sel.VARIANT_METHODS and name in sel.GLUON_METHODS, name
        assert name not in sel.MAX_T, name
        assert (name in sel.KEY_ORDER_METHODS) == (fields.get("order") == "key"), name
    assert sel.GLUON_SELECTIONS["hytopk_scores_sm90_ahead6_key"] == dict(
        sel.GLUON_SELECTIONS["hytopk_scores_sm90_ahead_key"], stages=6)


def test_gluon_selection_fields_reach_the_options(sel, monkeypatch):  # noqa: F811
    """run_hytopk_scores_sm90 hands hytopk_sm90 the first Gluon path's options with the
    method's fields over them (DEFAULT's for the rest), and refuses a field HyTopKOptions lacks
    instead of ignoring it."""
    from megatron_hyscale.ops.kernels import hytopk_sm90

    seen = []
    monkeypatch.setattr(hytopk_sm90, "hytopk_sm90",
                        lambda *a, options, **kw: seen.append((options, kw["order"])))
    sel.METHODS["hytopk_scores_sm90_part_major_ahead_key"](None, None, None, 4, False)
    (opts, order), = seen
    assert order == "key" and opts.scores_sm90 is True
    assert (opts.scores_sm90_folded_part_major, opts.scores_sm90_mma_ahead,
            opts.scores_sm90_scan_slots, opts.scores_sm90_sample_pick,
            opts.scores_sm90_defer_store) == (True, True, True, "radix", True)
    assert opts.scores_sm90_stages == sel.HyTopKOptions.DEFAULT.scores_sm90_stages
    seen.clear()
    sel.METHODS["hytopk_scores_sm90"](None, None, None, 4, True)
    assert (seen[0][0].scores_sm90_sample_table, seen[0][0].scores_sm90_sample_pick,
            seen[0][0].scores_sm90_scan_slots) == (False, "topk", False)
    with pytest.raises(TypeError, match="scores_sm90_mma_behind"):
        sel.run_hytopk_scores_sm90(None, None, None, 4, True, mma_behind=True)


def test_a_variant_that_differs_reports_its_share_of_equal_rows(sel, monkeypatch):  # noqa: F811
    """Bitwise equal: no share; a row out of order: not equal, every set equal; one row's
    set changed: that row alone counted out."""
    monkeypatch.setattr(sel, "positions", cpu_positions)
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-2, 3, (1, 16, 4, 32), generator=g).float()
    k = torch.randint(-2, 3, (1, 16, 32), generator=g).float()
    w = torch.randint(-2, 3, (1, 16, 4), generator=g).float()
    idx, score = sel.run_hytopk(q, k, w, 6, True)
    assert sel.agreement_with_hytopk("hytopk_default", (idx, score), q, k, w, 6, True) == {
        "same_as_hytopk": True}
    flipped = (idx.flip(-1), score.flip(-1))
    assert sel.agreement_with_hytopk("hytopk_default", flipped, q, k, w, 6, True) == {
        "same_as_hytopk": False, "same_rows_as_hytopk": 1.0}
    other = idx.clone()
    row = 15  # all 16 keys visible: a key outside its top 6 replaces its first slot
    other[0, row, 0] = next(j for j in range(16) if j not in idx[0, row].tolist())
    got = sel.agreement_with_hytopk("hytopk_default", (other, score), q, k, w, 6, True)
    assert got == {"same_as_hytopk": False, "same_rows_as_hytopk": 15 / 16}


def test_variant_table_renders_times_and_flags(sel, capsys):  # noqa: F811
    base = {"config": "norelu", "T": 131072, "inputs": "random"}
    records = [dict(base, method="hytopk", ms=172.9), dict(base, method="finish", ms=33.0),
               dict(base, method="scoreonly", ms=37.5),
               dict(base, method="hytopk_sort", ms=140.0, same_as_hytopk=True),
               dict(base, method="hytopk_sample", ms=90.0, same_as_hytopk=True,
                    sampled_rows_share=0.87, redone_blocks=3),
               dict(base, method="hytopk_select", ms=60.0, same_as_hytopk=False)]
    sel.variant_summary(records, ["random"], ["norelu"], [131072])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| random")]
    (row,) = lines
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:6] == ["random", "norelu", "131072", "172.9", "33.0", "37.5"]
    assert "140.0" in cells and "90.0 (3 redone)" in cells and "60.0 NOT EXACT" in cells
    sel.variant_summary(records[:3], ["random"], ["norelu"], [131072])
    assert capsys.readouterr().out == ""  # no variant timed, no table


def test_the_default_outputs_kept_are_those_of_the_relu_asked(sel, monkeypatch):  # noqa: F811
    """GLM-5.1 and the folded query share a geometry, so the bench gives them equal inputs,
    often at the same addresses: the kept default outputs must be the asked relu's (a stale
    ReLU entry made the folded query's Gluon rows look wrong on 98% of rows, 2026-12-07)."""
    monkeypatch.setattr(sel, "positions", cpu_positions)
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-2, 3, (1, 16, 4, 32), generator=g).float()
    k = torch.randint(-2, 3, (1, 16, 32), generator=g).float()
    w = torch.randint(-2, 3, (1, 16, 4), generator=g).float()
    with_relu = sel.default_outputs(q, k, w, 6, True)
    without = sel.default_outputs(q, k, w, 6, False)
    assert torch.equal(without[0], hytopk(q, k, w, 6, relu=False, backend="reference")[0])
    assert not torch.equal(with_relu[0], without[0])  # the inputs tell the two apart
    assert sel.same_as_default(without, q, k, w, 6, False)
    assert not sel.same_as_default(with_relu, q, k, w, 6, False)
    # Other inputs at the same addresses (another input kind in the memory the last freed).
    q.copy_(torch.randint(-2, 3, q.shape, generator=g).float())
    assert torch.equal(sel.default_outputs(q, k, w, 6, False)[0],
                       hytopk(q, k, w, 6, relu=False, backend="reference")[0])

"""bench_selection's fp8 methods and benchmark_tables' fp8 table, on CPU.

The methods run through the Triton interpreter on tiny integer-valued inputs (whose fp8 copies
are exact, so the fp8 selection is the bf16 one: overlap 1); the bench builds its positions on
CUDA, so they are rebuilt on the CPU here. The table renders from hand-made records.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from test_stock_tilelang_columns import load  # noqa: E402

from megatron_hyscale.ops import hytopk  # noqa: E402


@pytest.fixture(scope="module")
def sel():
    return load("bench_selection")


def cpu_positions(T, S):
    """bench_selection.positions for S = T token keys, on the CPU."""
    return (torch.arange(T) + S - T)[None], torch.arange(S)[None]


def test_fp8_methods_select_as_the_op(sel, monkeypatch):
    monkeypatch.setattr(sel, "positions", cpu_positions)
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-3, 4, (1, 24, 4, 32), generator=g).float()
    k = torch.randint(-3, 4, (1, 24, 32), generator=g).float() * 8  # scales differ from q's
    w = torch.randint(-2, 3, (1, 24, 4), generator=g).float()
    want = hytopk(q, k, w, 6, backend="reference", precision="fp8")
    for method in sel.FP8_METHODS:
        if method in sel.GLUON_METHODS:  # Hopper only: tests/ops/test_hytopk_sm90.py
            continue
        got = sel.METHODS[method](q, k, w, 6, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), method
    assert sel.overlap_with_bf16(want[0], q, k, w, 6, True) == 1.0
    best = sel.run_scoreonly_fp8(q, k, w, 6, True)[1][..., 0]  # each row's max score
    assert torch.equal(best, want[1][..., 0])
    # Every Triton fp8 method is timed like a kernel method (64-bit argument warm-up).
    triton = set(sel.FP8_METHODS) - set(sel.GLUON_METHODS)
    assert triton | {"scoreonly_fp8"} <= set(sel.KERNEL_METHODS) and "hytopk_fp8" in triton


def test_fp8_table_renders_time_floor_and_overlap():
    tables = load("benchmark_tables")
    base = {"config": "dsv32", "T": 131072, "floor_ms": 180.0, "reps": 2}
    records = [
        dict(base, method="hytopk", inputs="random", ms=480.0, mem_gib=3.0),
        dict(base, method="hytopk_fp8", inputs="random", ms=240.0, x_floor=240 / 180,
             quant_ms=12.5, goal_x_floor=0.65, overlap_vs_bf16=0.9312, mem_gib=2.0),
        dict(base, method="hytopk_fp8_promote32", inputs="random", ms=260.0,
             overlap_vs_bf16=0.9401, mem_gib=2.0),
        dict(base, method="hytopk_fp8", inputs="structured", ms=200.0, x_floor=200 / 180,
             quant_ms=12.0, goal_x_floor=0.65, overlap_vs_bf16=0.995, mem_gib=2.0),
    ]
    lines = tables.fp8_selection(records)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("|") and not line.startswith("|---")]
    head, random_row, structured_row = rows
    random_row, structured_row = dict(zip(head, random_row)), dict(zip(head, structured_row))
    assert random_row["fp8 x bf16 floor (goal)"] == "1.33 (0.65)"
    assert random_row["fp8 speed vs bf16"] == "2.00x"
    assert random_row["fp8 rows' share of the bf16 selection"] == "93.12%"
    assert random_row["promote-every-32 ms (share)"] == "260.0 (94.01%)"
    assert random_row["of which quantization ms"] == "12.5"
    assert structured_row["bf16 HyTopK ms"] == "-"  # not measured on those inputs
    assert structured_row["fp8 rows' share of the bf16 selection"] == "99.50%"
    assert tables.fp8_selection(records[:1]) == []  # no fp8 rows, no table
    # The selection table carries it below its own.
    assert tables.selection(records)[-len(lines):] == lines

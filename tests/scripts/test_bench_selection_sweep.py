"""bench_selection's launch sweeps leave records, on CPU: each variant's time (or its error)
as one record of config, length, mode and variant, so BENCHMARKS.md can cite a JSON for them.

The kernel launch and the timer are stand-ins: what is checked is the bookkeeping.
"""

from __future__ import annotations

import pytest
import torch
from test_stock_tilelang_columns import load


@pytest.fixture(scope="module")
def sel():
    return load("bench_selection")


def test_sweep_records_every_variant_and_its_failures(sel, monkeypatch):
    inputs = tuple(torch.zeros(1) for _ in range(3))
    monkeypatch.setattr(sel, "_sweep_setup", lambda T, cfg: (inputs, None, None, 10.0))
    calls = []

    def fake_time(fn, reps):
        calls.append(reps)
        if len(calls) == 2:
            raise RuntimeError("out of shared memory")
        return 25.0

    monkeypatch.setattr(sel, "time_ms", fake_time)
    recs = sel.sweep(131072, "norelu", 2)
    variants = sel._sweep_variants("norelu")
    with_cap = sum(cap is not None for *_, cap in variants)
    assert len(recs) == 2 * len(variants) - with_cap  # scoring alone has no buffer to size
    assert {r["mode"] for r in recs} == {"scores_only", "select"}
    assert recs[1]["error"].startswith("RuntimeError") and "ms" not in recs[1]
    ok = [r for i, r in enumerate(recs) if i != 1]
    assert all(r["ms"] == 25.0 and r["x_floor"] == 2.5 and r["T"] == 131072 for r in ok)
    assert all(r["config"] == "norelu" and "rows=" in r["variant"] for r in recs)


def test_rounds_rotate_the_order_and_keep_each_methods_median(sel):
    """--rounds: each round's order rotated one place (each method first once in every
    len(methods) rounds); the merged record is the first round's (its comparisons), its time
    the median of the rounds' (ms_rounds in round order), x_floor from it; an OOM round
    (ms None) is left out of the median."""
    assert sel.round_order(["a", "b", "c"], 3) == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert sel.round_order(["a", "b"], 1) == ["a", "b"]
    recs = [dict(method="a", ms=10.0, floor_ms=5.0, x_floor=2.0, same_as_hytopk=True),
            dict(method="b", ms=30.0, floor_ms=5.0, x_floor=6.0),
            dict(method="b", ms=20.0, floor_ms=5.0, x_floor=4.0),
            dict(method="a", ms=14.0, floor_ms=5.0, x_floor=2.8),
            dict(method="a", ms=None, floor_ms=5.0, x_floor=None, status="OOM"),
            dict(method="b", ms=26.0, floor_ms=5.0, x_floor=5.2)]
    a, b = sel.merge_rounds(recs)
    assert (a["method"], a["ms_rounds"], a["ms"], a["x_floor"]) == ("a", [10.0, 14.0, None],
                                                                  12.0, 2.4)
    assert a["same_as_hytopk"] is True and "status" not in a
    assert (b["ms_rounds"], b["ms"], b["x_floor"]) == ([30.0, 20.0, 26.0], 26.0, 5.2)
    assert recs[0]["ms"] == 10.0  # the inputs are left as they were
    # a first round out of memory: the memory and status of the first round with a time
    (c,) = sel.merge_rounds([dict(method="c", ms=None, mem_gib=None, floor_ms=5.0,
                                  x_floor=None, status="OOM"),
                             dict(method="c", ms=8.0, mem_gib=3.0, floor_ms=5.0, x_floor=1.6)])
    assert (c["ms"], c["mem_gib"], c["ms_rounds"]) == (8.0, 3.0, [None, 8.0])
    assert "status" not in c


def test_rounds_below_one_are_refused(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_selection.py"
    proc = subprocess.run([sys.executable, str(script), "--rounds", "0"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "--rounds must be >= 1, got 0" in proc.stderr

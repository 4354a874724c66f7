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

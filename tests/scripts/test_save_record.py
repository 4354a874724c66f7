"""hyscale_bench.measure.save_record writes strict JSON: a rate not measured is null."""
from __future__ import annotations

import json
import math

import pytest

from hyscale_bench import measure


def _refuse(constant: str) -> None:
    raise ValueError(f"non-standard JSON constant {constant}")


def test_unmeasured_rates_and_values_are_null(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYSCALE_RESULTS", str(tmp_path))
    monkeypatch.setenv("HYSCALE_COMMIT", "abc1234")
    records = [{"T": 16384, "ms": 1.5, "rel_diff": math.nan, "pair": (math.inf, 2.0)}]
    path = measure.save_record("bench_x", "glm51", records, matmul=780.0, copy=math.nan)
    with open(path) as f:
        data = json.loads(f.read(), parse_constant=_refuse)
    assert data["meta"]["copy_tbps"] is None and data["meta"]["matmul_tflops"] == 780.0
    assert data["records"] == [{"T": 16384, "ms": 1.5, "rel_diff": None, "pair": [None, 2.0]}]

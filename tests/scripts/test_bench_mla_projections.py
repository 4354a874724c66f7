"""scripts/bench_mla_projections.py's CPU smoke run: both ops on both paths, the RoPE of
HyScale's in-place query bitwise megatron's, the V up projection's output the einsum's."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_mla_projections  # noqa: E402


def test_tiny_cpu_run_compares_both_ops(monkeypatch) -> None:
    rows = []
    monkeypatch.setattr(bench_mla_projections, "case",
                        lambda *a, real=bench_mla_projections.case: rows.extend(real(*a))
                        or rows)
    assert bench_mla_projections.main(["--device", "cpu", "--tiny"]) == 0
    assert [r["op"] for r in rows] == ["query", "values"]
    assert rows[0]["rope_bitwise"] is True
    assert rows[0]["gemm_max_abs_diff"] < 1e-2 and rows[1]["gemm_max_abs_diff"] < 1e-2

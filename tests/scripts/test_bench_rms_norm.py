"""scripts/bench_rms_norm.py's CPU smoke run (the Triton kernel under the interpreter): every
kernel at both shapes, each within one bf16 rounding of the chunked form; the query's norm +
RoPE in one kernel and in two, bit for bit under the interpreter."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_rms_norm  # noqa: E402


def test_tiny_cpu_run_compares_every_kernel(monkeypatch) -> None:
    rows = []
    monkeypatch.setattr(bench_rms_norm, "case",
                        lambda *a, real=bench_rms_norm.case: rows.extend(real(*a)) or rows)
    assert bench_rms_norm.main(["--device", "cpu", "--tiny"]) == 0
    assert [(r["op"], r["kernel"]) for r in rows] == [
        (op, k) for op in ("query", "entries") for k in ("fused", "triton", "chunked")] + [
        ("query_norm_rope", "one_kernel"), ("query_norm_rope", "two_kernels")]
    assert rows[0]["shape"] == [16, 64, 512] and rows[3]["shape"] == [4, 512]
    norms = rows[:6]
    assert all(r["max_abs_diff_vs_chunked"] < 0.05 for r in norms)
    assert [r["max_abs_diff_vs_chunked"] for r in norms if r["kernel"] == "chunked"] == [0, 0]
    assert all(r["bitwise_two_kernels"] is True for r in rows[6:])

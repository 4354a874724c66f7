"""hyscale_bench.accuracy (scripts/accuracy.py): the comparison logic, and a CPU smoke run.

The GPU numbers (bf16 against float64) come from the H200; here `--device cpu --tiny` (fp32
against float64) runs every model end to end in one subprocess (about 15 s: the megatron
import, then seconds a case), and the verdict logic is checked on synthetic numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyscale_bench import accuracy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "accuracy.py"
TIMEOUT_S = 300
# Parameters each model's table must list (a few of each module's, by megatron's names).
EXPECTED_PARAMS = {
    "dsa": ["linear_q_down_proj.weight", "linear_kv_up_proj.weight", "linear_proj.weight",
            "core_attention.indexer.linear_wq_b.weight",
            "core_attention.indexer.linear_weights_proj.weight"],
    "csa": ["sinks", "linear_q_a.weight", "compressor.linear_kv.weight",
            "indexer.linear_q_b.weight", "indexer.compressor.linear_gate.weight"],
    "qsa": ["linear_qkv.weight", "linear_proj.weight",
            "core_attention.indexer.linear_qk.weight"],
}


# ---------------------------------------------------------------------------------------------
# The comparison, on synthetic numbers
# ---------------------------------------------------------------------------------------------

def test_within_flags_hyscale_larger() -> None:
    assert accuracy.within(1.0e-3, 1.0e-3) is True
    assert accuracy.within(1.04e-3, 1.0e-3) is True  # inside the 1.05x slack
    assert accuracy.within(1.06e-3, 1.0e-3) is False  # HyScale larger: flagged
    assert accuracy.within(2.0e-3, 1.0e-3, slack=2.5) is True
    assert accuracy.within(0.0, 0.0) is True
    assert accuracy.within(1e-9, 0.0) is False
    assert accuracy.within(math.nan, 1e-3) is False
    assert accuracy.within(None, 1e-3) is None and accuracy.within(1e-3, None) is None


def test_compare_rows_ratio_and_verdict() -> None:
    hyscale = {"output": 2e-3, "indexer loss": 1e-3, "input grad": 5e-3, "grad w": 3e-3}
    stock = {"output": 2e-3, "indexer loss": 4e-3, "input grad": 2e-3, "grad w": None}
    rows = accuracy.compare(hyscale, stock, slack=1.05)
    assert [r["tensor"] for r in rows] == list(hyscale)
    by = {r["tensor"]: r for r in rows}
    assert by["output"]["ratio"] == pytest.approx(1.0) and by["output"]["ok"] is True
    assert by["indexer loss"]["ratio"] == pytest.approx(0.25) and by["indexer loss"]["ok"]
    assert by["input grad"]["ratio"] == pytest.approx(2.5) and by["input grad"]["ok"] is False
    assert by["grad w"]["ratio"] is None and by["grad w"]["ok"] is None
    assert all(r["ok"] is None for r in accuracy.compare(hyscale, None))
    table = accuracy.format_table(rows, 1.05)
    assert "| input grad | 5.00e-03 | 2.00e-03 | 2.500 | NO |" in table
    assert "| output | 2.00e-03 | 2.00e-03 | 1.000 | yes |" in table
    assert "| grad w | 3.00e-03 | - | - | n/a |" in table
    compared, passed, failing = accuracy.summary(
        [{"model": "dsa", "T": 4096, "loss": "sparse", "rows": rows}])
    assert (compared, passed) == (3, 2) and failing == ["dsa T=4096 sparse: input grad (2.5x)"]


def test_relative_error_and_selection_difference() -> None:
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert accuracy.relative_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert accuracy.relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert accuracy.relative_error(torch.ones(2), torch.zeros(2)) == math.inf
    a = torch.tensor([[[0, 1, 2], [3, 4, -1]]], dtype=torch.int32)
    b = torch.tensor([[[2, 1, 0], [3, 5, -1]]], dtype=torch.int64)  # same set, then not
    assert accuracy.selection_rows_differ(a, b) == pytest.approx(0.5)
    assert accuracy.selection_rows_differ(a, None) is None


def test_matmul_counter_sees_low_precision_products() -> None:
    with accuracy.MatmulPrecision() as counter:
        x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        (x @ x).sum().backward()
        torch.randn(3, 3) @ torch.randn(3, 3)  # fp32: counted as low precision
    assert counter.total >= 3 and counter.low == 1


# ---------------------------------------------------------------------------------------------
# The CPU smoke run
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                              Path, Path]:
    tmp = tmp_path_factory.mktemp("accuracy")
    out, results = tmp / "out", tmp / "results"
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HYSCALE_RESULTS=str(results))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out",
                           str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=TIMEOUT_S)
    return proc, out, results


def test_smoke_table_rows_and_errors(smoke: tuple) -> None:
    proc, out, _ = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads((out / "accuracy.json").read_text())["cases"]
    assert {(c["model"], c["loss"]) for c in cases} == {
        (m, loss) for m in accuracy.MODELS for loss in accuracy.LOSSES}
    for case in cases:
        names = [r["tensor"] for r in case["rows"]]
        assert names[:3] == ["output", "indexer loss", "input grad"], names
        grads = names[3:]
        assert grads and all(n.startswith("grad ") for n in grads)
        assert len(set(grads)) == len(grads)
        for param in EXPECTED_PARAMS[case["model"]]:
            assert f"grad {param}" in grads, (case["model"], param)
        assert case["stock_status"] == "ran"
        assert case["reference_matmuls"] > 0 and case["reference_low_precision_matmuls"] == 0
        assert case["selection_rows_differ"] is not None
        assert 0.0 <= case["selection_rows_differ"] < 0.2
        assert not case["recompute_selection_changed"]
        for r in case["rows"]:
            for key in ("hyscale_err", "stock_err"):
                err = r[key]
                assert err is not None and math.isfinite(err), (case["model"], r)
                # fp32 against float64: ~1e-7 relative; the KL loss value and the indexer's
                # gradients (its target minus its prediction) cancel, and lose more.
                bound = 1e-5 if r["tensor"] in ("output", "input grad") else 1e-2
                assert err < bound, (case["model"], case["loss"], r)
            assert r["ok"] in (True, False)
        # The table printed for the case, one line per tensor.
        header = f"### {case['model']} T={case['T']} loss={case['loss']} "
        assert header in proc.stdout
    assert "HyScale <= stock (x1.05) for " in proc.stdout


def test_smoke_writes_record(smoke: tuple) -> None:
    proc, _, results = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = list(results.glob("*-accuracy-dsa-csa-qsa-tiny.json"))
    assert len(records) == 1, list(results.iterdir())
    data = json.loads(records[0].read_text())
    assert data["meta"]["passed"] <= data["meta"]["compared"]
    assert len(data["records"]) == len(accuracy.MODELS) * len(accuracy.LOSSES)
    assert f"record: {records[0]}" in proc.stdout

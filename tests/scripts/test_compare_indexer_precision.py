"""scripts/compare_indexer_precision.py: the demo trained with
unquantized and with fp8 selection, compared. CPU smoke: both runs happen (the fp8 one really
selects on quantized tensors: its first-step loss differs), every field is filled, and the
overlap measure is right on known sets."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_indexer_precision.py"
_spec = importlib.util.spec_from_file_location("_compare_indexer_precision", SCRIPT)
ip = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ip)


def test_jaccard_rows_on_known_sets():
    a = torch.tensor([[[0, 1, 2, -1], [3, 4, -1, -1], [-1, -1, -1, -1]]])
    b = torch.tensor([[[2, 1, 0, -1], [3, 5, -1, -1], [-1, -1, -1, -1]]])
    mean, equal = ip.jaccard_rows(a, b)
    assert math.isclose(mean, (1.0 + 1 / 3 + 1.0) / 3)
    assert math.isclose(equal, 2 / 3)


def test_two_short_runs_are_compared(tmp_path, monkeypatch):
    monkeypatch.setenv("HYSCALE_RESULTS", str(tmp_path / "results"))
    out = tmp_path / "out"
    result = ip.main(["--steps", "3", "--device", "cpu", "--out", str(out), "--record", "--",
                      "--log-every", "3", "--seq-len", "128", "--topk", "64", "--batch-size", "2"])
    saved = json.loads((out / "comparison.json").read_text())
    assert saved["steps"] == [1, 2, 3] == result["steps"]
    assert set(saved["loss"]) == {"bf16", "fp8"}
    assert saved["loss"]["bf16"] != saved["loss"]["fp8"]  # fp8 selection changed something
    assert len(saved["relative_loss_gap"]) == 3 and saved["max_relative_loss_gap"] > 0
    for name in ("trained_bf16_run", "trained_fp8_run", "random"):
        o = saved["topk_overlap"][name]
        assert 0.5 < o["jaccard"] <= 1.0 and 0.0 <= o["rows_equal"] <= 1.0
    assert saved["final"]["fp8"]["recall"] and saved["final"]["bf16"]["accuracy"] >= 0
    (record,) = list((tmp_path / "results").glob("*-indexer_precision-demo.json"))
    data = json.loads(record.read_text())
    assert data["records"][0]["method"] == "indexer_precision"
    assert data["meta"]["loss"]["fp8"] == saved["loss"]["fp8"]

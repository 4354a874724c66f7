"""scripts/check_cp.py under torchrun with gloo on CPU (the GPU run uses NCCL on two H200s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "2", str(ROOT / "scripts" / "check_cp.py"), "--device", "cpu",
           "--tiny", "--seq", "128", "--out", str(tmp_path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_cp2_equals_cp1_on_cpu(tmp_path: Path) -> None:
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "check_cp.json").read_text())
    assert report["passed"] and report["cp"] == 2 and report["same_param_set"]
    assert report["same_index_rows"] == 1.0  # fp32: every row selects the same keys
    assert report["out_rel_err"] < 1e-5 and report["max_param_grad_rel_err"] < 1e-5
    assert "| dsa | 128 | 2 |" in proc.stdout


def test_v4_and_qsa_layers(tmp_path: Path) -> None:
    # CSA (selects compressed entries) and QSA (selects blocks per KV head) under CP 2.
    for model in ("csa", "qsa"):
        out = tmp_path / model
        proc = _run(out, "--model", model)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        report = json.loads((out / "check_cp.json").read_text())
        assert report["model"] == model and report["passed"]
        assert report["same_index_rows"] == 1.0 and report["out_rel_err"] < 1e-5


def test_fails_beyond_its_tolerance(tmp_path: Path) -> None:
    # The fp32 reduction order differs between CP 1 and 2: a zero tolerance must fail.
    proc = _run(tmp_path, "--grad-tol", "0")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert json.loads((tmp_path / "check_cp.json").read_text())["passed"] is False

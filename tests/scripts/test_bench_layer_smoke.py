"""Smoke test of scripts/bench_layer.py: `--device cpu --tiny` runs each layer end to end.

The benchmark's GPU numbers come from the H200; CI only checks that every code path of the
script (build HyScale and baseline on the same weights, full-recompute step, in-step selection
timing, replay counters, CP init + zigzag split under torchrun with gloo, JSON/table output)
runs and reports finite numbers of the expected shape, and that unsupported requests (CSA / HCA
under CP, a CP size that is not the world size) stop with exit code 2 and a reason.
Each subprocess takes about 5 s (megatron import), the two CP runs about 8 s.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_layer.py"
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args: list[str], out: Path, *, nproc: int = 1) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), *args, "--device", "cpu", "--tiny", "--repeats", "1",
           "--out", str(out)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(nproc), *cmd[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=TIMEOUT_S)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _check_record(rec: Any, *, selects: bool, replays: bool) -> None:
    assert isinstance(rec, dict), rec
    assert _finite(rec["fwd_bwd_ms"]) and rec["fwd_bwd_ms"] > 0
    assert _finite(rec["peak_extra_gib"]) and rec["peak_extra_gib"] >= 0
    if selects:
        assert _finite(rec["selection_in_step_ms"]) and rec["selection_in_step_ms"] > 0
        assert _finite(rec["selection_share"]) and 0 < rec["selection_share"]
        assert rec["selection_calls"] >= 2  # the first forward and the recompute both call it
    else:
        assert rec["selection_in_step_ms"] is None and rec["selection_share"] is None
    if replays:  # one scan in the first forward, replayed by the recompute
        assert (rec["selections_computed"], rec["selections_replayed"]) == (1, 1)


def _load(out: Path, model: str, proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / f"bench_layer_{model}.json").read_text())
    assert data["model"] == model and data["tiny"] is True and data["device"] == "cpu"
    assert _finite(data["matmul_tflops"]) and data["matmul_tflops"] > 0
    assert "| T | CP | HyScale fwd+bwd ms" in proc.stdout  # the table was printed
    return data


@pytest.mark.parametrize("model", ["dsa", "csa", "hca", "qsa"])
def test_tiny_cpu_run(model: str, tmp_path: Path) -> None:
    data = _load(tmp_path, model, _run(["--model", model], tmp_path))
    base = "stock" if model == "dsa" else "baseline"
    assert data["baseline_name"] == base and data["cp"] == 1
    (row,) = data["rows"]
    assert row["T"] == 128 and row["T_local"] == 128
    selects = model != "hca"
    assert _finite(row["selection_floor_ms"]) if selects else row["selection_floor_ms"] is None
    _check_record(row["hyscale"], selects=selects, replays=selects)
    _check_record(row[base], selects=selects, replays=False)
    if model in ("csa", "qsa"):  # the baseline selects again in the recompute: no replay
        assert (row[base]["selections_computed"], row[base]["selections_replayed"]) == (2, 0)
    if model == "dsa":  # the CP-1 breakdown of the DSA step is still there
        for key in ("selection_ms", "attention_fwd_ms", "attention_fwd_bwd_ms",
                    "indexer_loss_fwd_bwd_ms"):
            assert _finite(row["hyscale"][key]), key
        assert (tmp_path / "bench_layer.json").is_file()


@pytest.mark.parametrize("model,dp", [("dsa", 1), ("qsa", 2), ("csa", 1), ("hca", 1)])
def test_tiny_cpu_context_parallel(model: str, dp: int, tmp_path: Path) -> None:
    """CP 2 under torchrun (gloo); qsa also with 2 replicas (the 4 x 8 layout's CP x DP).

    HCA selects nothing (dense over its compressed entries), so it has no selection figures."""
    args = ["--model", model, "--cp", "2", "--dp", str(dp)]
    data = _load(tmp_path, model, _run(args, tmp_path, nproc=2 * dp))
    assert data["cp"] == 2 and data["dp"] == dp and data["world_size"] == 2 * dp
    (row,) = data["rows"]
    assert row["T"] == 128 and row["T_local"] == 64
    base = data["baseline_name"]
    for name in ("hyscale", base):
        rec = row[name]
        _check_record(rec, selects=model != "hca", replays=name == "hyscale" and model != "hca")
        assert len(rec["per_rank"]) == 2 * dp
        assert rec["fwd_bwd_ms"] == max(r["fwd_bwd_ms"] for r in rec["per_rank"])


def test_cp_must_equal_world_size(tmp_path: Path) -> None:
    proc = _run(["--model", "qsa", "--cp", "2"], tmp_path)  # no torchrun: WORLD_SIZE 1
    assert proc.returncode == 2
    assert "WORLD_SIZE is 1 but --cp 2 x --dp 1 is 2" in proc.stderr


def test_parser_checks() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_layer
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    args = bench_layer.parse_args(["--model", "qsa", "--cp", "2", "--seq", "1048576",
                                   "--skip-baseline"])
    assert (args.model, args.cp, args.seq, args.skip_baseline) == ("qsa", 2, [1048576], True)
    assert bench_layer.parse_args([]).model == "dsa"  # default unchanged
    assert bench_layer.parse_args(["--skip-stock"]).skip_baseline  # the old spelling works
    for bad in (["--seq", "100", "--cp", "3"], ["--model", "mla"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(bad)

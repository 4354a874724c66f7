"""Smoke test of hyscale_bench.layer (scripts/bench_layer.py): `--device cpu --tiny` runs each layer
end to end.

The benchmark's GPU numbers come from the H200; CI only checks that every code path of the
script (build HyScale and baseline on the same weights, full-recompute step, in-step selection
timing, replay counters, CP init + zigzag split under torchrun with gloo, JSON/table output)
runs and reports finite numbers of the expected shape, and that unsupported requests (CSA / HCA
under CP, a CP size that is not the world size) stop with exit code 2 and a reason.
Each subprocess takes about 5 s (megatron import), the two CP runs about 8 s.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import types
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import hyscale_bench.layer as bench_layer

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
    assert isinstance(row["hyscale"]["hyscale_warnings"], list)
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


@pytest.mark.parametrize("model", ["dsa", "csa"])
def test_tiny_cpu_row_chunks_under_context_parallelism(model: str, tmp_path: Path) -> None:
    """CP 2 with the attention's 64 local rows in parts of 24 (24, 24, 16)."""
    args = ["--model", model, "--cp", "2", "--row-chunk", "24", "--skip-stock"]
    data = _load(tmp_path, model, _run(args, tmp_path, nproc=2))
    assert data["args"]["row_chunk"] == 24
    (row,) = data["rows"]
    _check_record(row["hyscale"], selects=True, replays=True)


def test_row_chunk_flag_checks() -> None:
    assert bench_layer.parse_args([]).row_chunk is None
    assert bench_layer.parse_args(["--row-chunk", "131072"]).row_chunk == 131072
    for bad in (["--row-chunk", "0"], ["--model", "qsa", "--row-chunk", "64"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(bad)


def test_cp_must_equal_world_size(tmp_path: Path) -> None:
    proc = _run(["--model", "qsa", "--cp", "2"], tmp_path)  # no torchrun: WORLD_SIZE 1
    assert proc.returncode == 2
    assert "WORLD_SIZE is 1 but --cp 2 x --dp 1 is 2" in proc.stderr


def test_parser_checks() -> None:
    args = bench_layer.parse_args(["--model", "qsa", "--cp", "2", "--seq", "1048576",
                                   "--skip-baseline"])
    assert (args.model, args.cp, args.seq, args.skip_baseline) == ("qsa", 2, [1048576], True)
    assert bench_layer.parse_args([]).model == "dsa"  # default unchanged
    assert bench_layer.parse_args(["--skip-stock"]).skip_baseline  # the old spelling works
    for bad in (["--seq", "100", "--cp", "3"], ["--model", "mla"], ["--repeats", "0"],
                ["--attention-bwd", "single"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(bad)
    assert bench_layer.parse_args([]).attention_bwd == "auto"
    assert bench_layer.parse_args(["--attention-bwd", "fused"]).attention_bwd == "fused"


def test_attention_kernel_flags_set_only_their_options() -> None:
    from megatron_hyscale.ops import AttentionKernelOptions

    default = AttentionKernelOptions.DEFAULT
    assert bench_layer.attention_kernel_options(bench_layer.parse_args([])) == default
    cases = {("--attention-bwd", "sm90"): dict(bwd_sm90=True),
             ("--attention-bwd", "split"): dict(bwd_sm90=False),
             ("--attention-bwd", "fused"): dict(bwd_fused=True, bwd_sm90=False),
             ("--attention-fwd", "gluon_ws"): dict(fwd_sm90_ws=True),
             ("--attention-fwd", "gluon"): dict(fwd_sm90_ws=False),
             ("--attention-fwd", "triton"): dict(fwd_sm90=False, fwd_sm90_ws=False),
             ("--attention-lockstep",): dict(fwd_lockstep=True, dq_lockstep=True,
                                             dkv_lockstep=True),
             ("--attention-lockstep", "dkv"): dict(dkv_lockstep=True)}
    for flags, changed in cases.items():
        got = bench_layer.attention_kernel_options(bench_layer.parse_args(list(flags)))
        assert got == replace(default, **changed), flags
    # QSA's default paces dK/dV (layers.qsa.QSA_ATTENTION_OPTIONS); "off" turns it off.
    from megatron_hyscale.layers.qsa import QSA_ATTENTION_OPTIONS

    qsa = ["--model", "qsa"]
    assert bench_layer.attention_kernel_options(bench_layer.parse_args(qsa)) \
        == QSA_ATTENTION_OPTIONS
    assert bench_layer.attention_kernel_options(bench_layer.parse_args(
        qsa + ["--attention-lockstep", "off"])) == replace(QSA_ATTENTION_OPTIONS,
                                                           dkv_lockstep=False)
    from megatron_hyscale.ops import IndexerLossKernelOptions

    loss_default = IndexerLossKernelOptions.DEFAULT
    assert bench_layer.indexer_loss_kernel_options(bench_layer.parse_args([])) == loss_default
    assert bench_layer.indexer_loss_kernel_options(
        bench_layer.parse_args(["--loss-kl-in-rows"])) == replace(loss_default, kl_in_bwd=False)
    assert bench_layer.indexer_loss_kernel_options(
        bench_layer.parse_args(["--loss-lockstep"])) == replace(loss_default, bwd_lockstep=True)
    assert bench_layer.indexer_loss_kernel_options(
        bench_layer.parse_args(["--loss-bwd-triton"])) == replace(loss_default, bwd_sm90=False)
    from megatron_hyscale.ops import HyTopKOptions

    assert bench_layer.hytopk_options(bench_layer.parse_args([])) is None
    assert bench_layer.hytopk_options(bench_layer.parse_args(["--hytopk-scores-sm90"])) \
        == HyTopKOptions(scores_sm90=True)
    assert bench_layer.hytopk_options(bench_layer.parse_args(["--hytopk-scores-sm90", "off"])) \
        == HyTopKOptions(scores_sm90=False)
    assert bench_layer.hytopk_options(bench_layer.parse_args(
        ["--hytopk-sample-pick", "topk", "--hytopk-scan-slots", "off"])) == HyTopKOptions(
        scores_sm90_sample_pick="topk", scores_sm90_scan_slots=False)
    assert bench_layer.hytopk_options(bench_layer.parse_args(
        ["--hytopk-scan-slots", "on"])) == HyTopKOptions(scores_sm90_scan_slots=True)


def test_stock_kernel_backend_flag_parses() -> None:
    assert bench_layer.parse_args([]).stock_kernel_backend == "none"  # default: PyTorch stock
    args = bench_layer.parse_args(["--stock-kernel-backend", "tilelang", "--seq", "8192"])
    assert (args.model, args.stock_kernel_backend, args.seq) == ("dsa", "tilelang", [8192])
    assert "--stock-kernel-backend" in bench_layer.build_parser().format_help()
    # an unknown backend, a model without a stock DSAttention, or no stock row at all
    args = bench_layer.parse_args(["--stock-kernel-backend", "cudnn"])
    assert args.stock_kernel_backend == "cudnn"
    for bad in (["--stock-kernel-backend", "bogus"],
                ["--stock-kernel-backend", "tilelang", "--model", "qsa"],
                ["--stock-kernel-backend", "tilelang", "--skip-stock"]):
        with pytest.raises(SystemExit) as exc:
            bench_layer.parse_args(bad)
        assert exc.value.code == 2, bad


def test_stock_kernel_backend_tilelang_refused_here(tmp_path: Path) -> None:
    """No tilelang (or no GPU): exit 2 naming the flag, before any output is written."""
    out = tmp_path / "out"
    proc = _run(["--model", "dsa", "--stock-kernel-backend", "tilelang"], out)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--stock-kernel-backend tilelang" in proc.stderr
    if importlib.util.find_spec("tilelang") is None:  # the CPU CI venv
        assert "needs the tilelang package" in proc.stderr
    else:  # installed, but this run asks for the CPU
        assert "needs --device cuda" in proc.stderr
    assert not out.exists()
    assert "HyScale" not in proc.stdout  # nothing was built or measured


def test_stock_kernel_backend_cudnn_refused_on_cpu(tmp_path: Path) -> None:
    """The cudnn stock row needs a Hopper GPU: exit 2 naming the flag, nothing written."""
    out = tmp_path / "out"
    proc = _run(["--model", "dsa", "--stock-kernel-backend", "cudnn"], out)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--stock-kernel-backend cudnn needs --device cuda" in proc.stderr
    assert not out.exists()
    assert "HyScale" not in proc.stdout


def test_single_stock_json_and_table_unchanged(tmp_path: Path) -> None:
    """Without the flag the dsa JSON and table keep their earlier keys and columns."""
    proc = _run(["--model", "dsa"], tmp_path)
    data = _load(tmp_path, "dsa", proc)
    assert "baseline_names" not in data and "stock_kernel_backend" not in data
    (row,) = data["rows"]
    assert set(row) == {"T", "cp", "T_local", "selection_floor_ms", "layer_floor_ms", "hyscale",
                        "stock"}
    assert "fused_kernels" not in row["stock"]
    assert ("| T | CP | HyScale fwd+bwd ms | peak GiB/GPU | selection in step ms (share) |"
            " selection floor ms | computed / replayed | stock fwd+bwd ms |"
            " stock peak GiB/GPU | stock selection ms (share) | speed-up |\n"
            + "|---" * 11 + "|\n") in proc.stdout
    assert "stock_tilelang" not in proc.stdout


def test_two_stock_rows_table_and_json(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The stock + stock_tilelang layout (the GPU run's) on made-up records."""

    def rec(ms: float) -> dict[str, Any]:
        return {"fwd_bwd_ms": ms, "peak_extra_gib": 1.0, "selection_in_step_ms": 1.0,
                "selection_share": 0.1, "selections_computed": 1, "selections_replayed": 1}

    tl = rec(5.0) | {"fused_kernels": {"run_fused_qk_topk": {"used": 1, "declined": 0}}}
    rows = [{"T": 8192, "cp": 1, "selection_floor_ms": 0.5, "hyscale": rec(2.0),
             "stock": rec(8.0), "stock_tilelang": tl},
            {"T": 16384, "cp": 1, "selection_floor_ms": 1.0, "hyscale": rec(4.0),
             "stock": "skipped", "stock_tilelang": "error: RuntimeError: nvcc | failed"}]
    names = ["stock", "stock_tilelang"]
    bench_layer.print_table(rows, names)
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if line.startswith("| T | CP |"))
    assert "speed-up vs stock |" in head and head.endswith("speed-up vs stock_tilelang |")
    first = next(line for line in lines if line.startswith("| 8192 |"))
    cells = [c.strip() for c in first.strip("|").split("|")]
    assert len(cells) == head.count("|") - 1 == 15
    assert (cells[10], cells[14]) == ("4.00x", "2.50x")
    second = next(line for line in lines if line.startswith("| 16384 |"))
    assert second.count("|") == head.count("|")  # an error message does not break the row
    assert any("fused kernels used/declined: run_fused_qk_topk 1/0" in line for line in lines)
    assert bench_layer._speedup(rec(2.0), rec(5.0)) == 2.5
    assert bench_layer._speedup(rec(2.0), "OOM") is None

    args = bench_layer.parse_args(["--stock-kernel-backend", "tilelang", "--seq", "8192"])
    bench_layer.write_json(tmp_path, args, "cpu", 1.0, 3.5, names, rows)
    data = json.loads((tmp_path / "bench_layer_dsa.json").read_text())
    assert data["baseline_name"] == "stock" and data["baseline_names"] == names
    assert (data["matmul_tflops"], data["copy_tbps"]) == (1.0, 3.5)
    assert data["stock_kernel_backend"] == "tilelang"


def test_fused_hook_counter_counts_and_restores() -> None:
    hooks = types.SimpleNamespace(ran=lambda x: x * 2, declines=lambda x: None)
    originals = (hooks.ran, hooks.declines)
    with bench_layer.FusedHookCounter([(hooks, "ran"), (hooks, "declines")]) as counter:
        assert hooks.ran(3) == 6 and hooks.ran(1) == 2 and hooks.declines(3) is None
    assert counter.counts == {"ran": {"used": 2, "declined": 0},
                              "declines": {"used": 0, "declined": 1}}
    assert (hooks.ran, hooks.declines) == originals


def test_hyscale_warnings_are_recorded_and_still_shown() -> None:
    """A row records HyScale's warnings (a declined fast path), also when it fails, and they
    are still shown; other warnings are shown, not recorded."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with bench_layer.hyscale_warnings() as found:
            warnings.warn("HyScale: the probe kernel cannot run (a cause); using the "
                          "reference", RuntimeWarning, stacklevel=1)
            warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert found == ["HyScale: the probe kernel cannot run (a cause); using the reference"]
    assert [str(w.message)[:17] for w in shown] == ["HyScale: the prob", "unrelated"]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError), bench_layer.hyscale_warnings() as failed:
            warnings.warn("HyScale: declined before the failure", RuntimeWarning,
                          stacklevel=1)
            raise RuntimeError("kernel failed")
    assert failed == ["HyScale: declined before the failure"]
    assert [str(w.message) for w in shown] == failed  # shown though the row failed


def test_guarded_keeps_going_only_when_asked() -> None:

    def broken() -> dict[str, Any]:
        raise RuntimeError("kernel compile failed")

    assert bench_layer.guarded(broken, "cpu", keep_going=True).startswith(
        "error: RuntimeError: kernel compile failed")
    with pytest.raises(RuntimeError):
        bench_layer.guarded(broken, "cpu")
    assert bench_layer.combine([{"fwd_bwd_ms": 1.0, "peak_extra_gib": 0.0}, "OOM"]) == "OOM"


def test_layer_floor_at_glm5_1_geometry() -> None:
    """The DSA layer floor at 1M tokens, CP 2, counted by hand: linears 174.4M MACs a row (x4),
    attention 142.6M (x4.5), loss target 75.5M and logits 8.4M (x2, logits' backward x2 more),
    and the causal indexer scan 524288 x 524288 x 4096 once: 3.85e15 FLOP, the scan being
    exactly the selection floor."""
    import types

    layer = types.SimpleNamespace(module=types.SimpleNamespace(
        config=types.SimpleNamespace(**bench_layer.GLM51)))
    args = types.SimpleNamespace(cp=2)
    T, rate = 1 << 20, 1000.0  # TFLOP/s: ms = FLOP / 1e12
    floor = bench_layer.layer_floor_ms("dsa", T, args, rate, layer)
    rows = T / 2
    by_hand = 2 * rows * (4 * 174_391_296 + 4.5 * 142_606_336 + 2 * (75_497_472 + 8_388_608)
                          + 2 * 8_388_608) + 2 * rows * rows * 4096
    assert floor == pytest.approx(by_hand / 1e12)
    scan = bench_layer.selection_floor_ms("dsa", T, args, rate, layer)
    assert scan == pytest.approx(2 * rows * rows * 4096 / 1e12)
    assert bench_layer.layer_floor_ms("csa", T, args, rate, layer) is None


# --- --packed: the same tokens as one packed THD sequence of N documents ----------------------

def test_tiny_cpu_packed_rows(tmp_path: Path) -> None:
    """`--packed 3` (both splits): HyScale's own path on the packed rows (no fallback
    warning, its selection computed once and replayed), the stock rows packed beside them."""
    proc = _run(["--model", "dsa", "--packed", "3", "--packed-split", "both"], tmp_path)
    data = _load(tmp_path, "dsa", proc)
    assert data["packed"]["documents"] == [3] and data["packed"]["splits"] == ["even", "uneven"]
    assert data["packed"]["goal_per_token_vs_unpacked"] == bench_layer.PACKED_GOAL
    (row,) = data["rows"]
    assert {"hyscale_packed_3", "hyscale_packed_3_uneven", "stock_packed_3",
            "stock_packed_3_uneven"} <= set(row)
    unpacked = row["hyscale"]
    assert (unpacked["fallback_warnings"], unpacked["path"]) == (0, "hyscale")
    for name in ("hyscale_packed_3", "hyscale_packed_3_uneven", "stock_packed_3",
                 "stock_packed_3_uneven"):
        rec = row[name]
        hyscale = name.startswith("hyscale")
        _check_record(rec, selects=True, replays=hyscale)
        assert rec["documents"] == 3 and sum(rec["doc_lengths"]) == 128
        base = row["hyscale" if hyscale else "stock"]
        assert rec["per_token_vs_unpacked"] == pytest.approx(rec["fwd_bwd_ms"]
                                                             / base["fwd_bwd_ms"])
        assert rec["within_goal"] == (rec["per_token_vs_unpacked"] <= bench_layer.PACKED_GOAL)
        assert 0 < rec["visible_keys_vs_unpacked"] < 0.5  # three documents: about a third
        if hyscale:
            assert (rec["fallback_warnings"], rec["fallback_reasons"], rec["path"]) == (
                0, [], "hyscale")
        else:
            assert "path" not in rec
    assert row["hyscale_packed_3"]["doc_lengths"] == [43, 43, 42]
    assert row["hyscale_packed_3_uneven"]["doc_lengths"] == bench_layer.packed_lengths(
        128, 3, "uneven")
    assert "| T | packed row | documents |" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("| 128 | hyscale_packed_3 |"))
    assert "3 even, 42-43 tokens" in line and line.endswith("| HyScale (0 fallback warnings) |")
    assert "HyScaleDSAttention" not in proc.stderr  # no fallback warning was given


def test_packed_flag_checks(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_layer.parse_args(["--packed", "8", "64", "8", "--seq", "131072"])
    assert (args.packed, args.packed_split) == ([8, 64], "even")
    assert bench_layer.parse_args([]).packed is None
    assert bench_layer.parse_args(["--packed", "2", "--packed-split", "both"]).packed_split \
        == "both"
    refused = {("--packed", "3", "--model", "csa"): "--packed applies to --model dsa only",
               ("--packed", "3", "--model", "qsa"): "--packed applies to --model dsa only",
               ("--packed", "3", "--cp", "2"): "--packed runs at --cp 1 --dp 1 only (this "
                                                 "benchmark's packed rows do not split",
               ("--packed", "3", "--dp", "2"): "--packed runs at --cp 1 --dp 1 only",
               ("--packed", "0"): "--packed N must be between 1 and",
               ("--packed", "129", "--tiny"): "--packed N must be between 1 and the shortest",
               ("--packed-split", "uneven"): "--packed-split needs --packed"}
    for argv, message in refused.items():
        with pytest.raises(SystemExit) as exc:
            bench_layer.parse_args(list(argv))
        assert exc.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


def test_packed_lengths() -> None:
    assert bench_layer.packed_lengths(131072, 8, "even") == [16384] * 8
    assert bench_layer.packed_lengths(130, 3, "even") == [44, 43, 43]
    assert bench_layer.packed_lengths(5, 5, "uneven") == [1] * 5
    for T, n in ((131072, 8), (131072, 64), (128, 3), (1000, 999)):
        lengths = bench_layer.packed_lengths(T, n, "uneven")
        assert len(lengths) == n and sum(lengths) == T and min(lengths) >= 1
        assert lengths == bench_layer.packed_lengths(T, n, "uneven")  # seeded
    uneven = bench_layer.packed_lengths(131072, 64, "uneven")
    assert max(uneven) > 4 * min(uneven)
    assert bench_layer.visible_pairs([4, 4]) == 20 and bench_layer.visible_pairs([8]) == 36


def test_fallback_is_counted_and_marks_the_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that runs megatron's DSAttention.forward on HyScale's layer (a stock
    fallback) counts, each call (a stock layer's does not), and the row says it ran the stock
    fallback."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    from megatron_hyscale.layers.dsa import HyScaleDSAttention

    monkeypatch.setattr(DSAttention, "forward", lambda self, *a, **kw: "stock")
    stub = DSAttention.forward
    hyscale_layer = HyScaleDSAttention.__new__(HyScaleDSAttention)
    stock_layer = DSAttention.__new__(DSAttention)

    def fake_measure(layer: Any, T: int, args: Any) -> dict[str, Any]:
        for _ in range(3):
            assert DSAttention.forward(hyscale_layer) == "stock"
        DSAttention.forward(stock_layer)
        return {"fwd_bwd_ms": 2.0, "peak_extra_gib": 0.0, "selections_computed": 0,
                "selections_replayed": 0, "selection_in_step_ms": 1.0, "selection_share": 0.5}

    monkeypatch.setattr(bench_layer, "measure", fake_measure)
    rec = bench_layer.measure_hyscale(None, 128, None)
    assert DSAttention.forward is stub  # put back
    assert rec["fallback_warnings"] == 3 and rec["path"] == "stock fallback"
    reason = "HyScaleDSAttention ran megatron-core's DSAttention.forward"
    assert rec["fallback_reasons"] == [reason]
    args = bench_layer.parse_args(["--packed", "2", "--tiny", "--device", "cpu"])
    monkeypatch.setattr(bench_layer, "packed_seq_params", lambda lengths, device: None)
    monkeypatch.setattr(bench_layer, "packed_layer", lambda layer, params: layer)
    packed = bench_layer.measure_packed(None, 128, args, 2, "even", {"fwd_bwd_ms": 4.0},
                                        hyscale=True)
    assert packed["path"] == "stock fallback" and packed["per_token_vs_unpacked"] == 0.5
    assert packed["within_goal"] is True and packed["doc_lengths"] == [64, 64]
    cells = bench_layer.packed_cells(packed)
    assert cells[-1].startswith(f"STOCK FALLBACK (3 fallback warnings: {reason}")
    assert bench_layer.packed_cells("OOM")[0] == "OOM"


def _tables(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
            path: Path) -> list[list[dict[str, str]]]:
    """benchmark_tables.py on one record: its tables, each a list of {header: cell}."""
    spec = importlib.util.spec_from_file_location("_packed_tables",
                                                  ROOT / "scripts" / "benchmark_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["benchmark_tables.py", str(path)])
    assert module.main() == 0
    found: list[list[dict[str, str]]] = []
    head = None
    for line in capsys.readouterr().out.splitlines():
        if not line.startswith("|"):
            head = None
        elif not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if head is None:
                head = cells
                found.append([])
            else:
                found[-1].append(dict(zip(head, cells)))
    return found


def test_benchmark_tables_render_packed_rows(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    def rec(ms: float, **extra: Any) -> dict[str, Any]:
        return {"fwd_bwd_ms": ms, "peak_extra_gib": 50.0, "selection_in_step_ms": 100.0,
                "selection_share": 0.1, "selections_computed": 1, "selections_replayed": 1,
                **extra}

    def packed(ms: float, n: int, split: str, lengths: list[int], **extra: Any) -> dict:
        return rec(ms, documents=n, split=split, doc_lengths=lengths,
                   per_token_vs_unpacked=ms / 1300.0, within_goal=ms / 1300.0 <= 1.1,
                   visible_keys_vs_unpacked=1 / n, **extra)

    ok = dict(fallback_warnings=0, fallback_reasons=[], path="hyscale")
    row = {"T": 131072, "cp": 1, "T_local": 131072, "selection_floor_ms": 90.0,
           "layer_floor_ms": 620.0, "hyscale": rec(1300.0, **ok), "stock": "skipped",
           "hyscale_packed_8": packed(1170.0, 8, "even", [16384] * 8, **ok),
           "hyscale_packed_8_uneven": packed(1235.0, 8, "uneven", [6979, 36508, 87585], **ok),
           "hyscale_packed_64": packed(1560.0, 64, "even", [2048] * 64,
                                       fallback_warnings=5, path="stock fallback",
                                       fallback_reasons=["HyScaleDSAttention: why"]),
           "hyscale_packed_64_uneven": "error: RuntimeError: boom"}
    meta = {"device": "NVIDIA H200", "date": "2026-12-02 04:00:00 UTC", "commit": "abc1234",
            "matmul_tflops": 750.0, "command": "synthetic",
            "packed": {"documents": [8, 64], "goal_per_token_vs_unpacked": 1.1}}
    path = tmp_path / "2026-12-02-nvidia-h200-bench_layer-dsa-cp1-packed.json"
    path.write_text(json.dumps({"meta": meta, "records": [row]}))
    main, extra = _tables(monkeypatch, capsys, path)
    assert list(main[0]) == ["T", "layer floor ms", "hyscale fwd+bwd ms (GiB)",
                             "stock fwd+bwd ms (GiB)", "hyscale vs stock"]  # no packed column
    by_row = {r["packed row"]: r for r in extra}
    assert list(by_row) == ["hyscale_packed_8", "hyscale_packed_8_uneven", "hyscale_packed_64",
                            "hyscale_packed_64_uneven"]
    even = by_row["hyscale_packed_8"]
    assert even["documents (tokens each)"] == "8 even (16384)"
    assert even["fwd+bwd ms (GiB)"] == "1170.0 (50.0)"
    assert even["per-token time vs unpacked"] == "0.90x"
    assert even["causal key pairs vs unpacked"] == "0.125" and even["path"] == "HyScale"
    assert by_row["hyscale_packed_8_uneven"]["documents (tokens each)"] == \
        "8 uneven (6979-87585)"
    slow = by_row["hyscale_packed_64"]
    assert slow["per-token time vs unpacked"] == "1.20x (over 1.10x)"
    assert slow["path"] == "**stock fallback** (5 fallback warnings)"
    assert by_row["hyscale_packed_64_uneven"]["documents (tokens each)"] == \
        "error: RuntimeError: boom"


def test_profile_kernels_records_top_operators(tmp_path: Path) -> None:
    """`--profile-kernels N`: each HyScale row gets one profiled step with at most N operators,
    sorted by time, whose times fit inside the busy total; without the flag no row has one."""
    proc = _run(["--model", "dsa", "--skip-stock", "--profile-kernels", "4", "--packed", "2"],
                tmp_path)
    data = _load(tmp_path, "dsa", proc)
    row = data["rows"][0]
    for name in ("hyscale", "hyscale_packed_2"):
        prof = row[name]["kernel_profile"]
        assert _finite(prof["wall_ms"]) and prof["wall_ms"] > 0
        assert _finite(prof["busy_ms"]) and prof["busy_ms"] > 0
        top = prof["top"]
        assert 1 <= len(top) <= 4
        times = [item["ms"] for item in top]
        assert times == sorted(times, reverse=True) and sum(times) <= prof["busy_ms"] + 1e-6
        assert all(item["calls"] >= 1 and item["name"] for item in top)
    assert "  profile: wall " in proc.stdout
    assert bench_layer.parse_args([]).profile_kernels == 0


def test_profile_copies_names_their_callers(tmp_path: Path) -> None:
    """`--profile-copies N`: the HyScale row gets at most N (copying operator, caller) pairs,
    sorted by bytes written, each named by its innermost megatron / megatron_hyscale frame (or
    the autograd engine): megatron's RoPE concatenations (the key's) among them, none of
    megatron's absorbed-MLA query copies (HyScale's layer makes its query in place)."""
    proc = _run(["--model", "dsa", "--skip-stock", "--profile-copies", "40"], tmp_path)
    data = _load(tmp_path, "dsa", proc)
    copies = data["rows"][0]["hyscale"]["copy_profile"]
    assert 1 <= len(copies) <= 40
    sizes = [c["gib"] for c in copies]
    assert sizes == sorted(sizes, reverse=True) and all(g > 0 for g in sizes)
    assert {c["name"] for c in copies} <= set(bench_layer.COPY_OPS)
    assert all(c["calls"] >= 1 for c in copies)
    assert all(c["caller"] == "autograd" or any(p in c["caller"] for p in
                                                bench_layer.CALLER_PACKAGES) for c in copies)
    assert any("rope_utils.py" in c["caller"] and c["name"] == "aten.cat" for c in copies)
    assert not any("experimental_attention_variant/absorbed_mla.py" in c["caller"]
                   for c in copies)
    assert "  copies: " in proc.stdout
    assert bench_layer.parse_args([]).profile_copies == 0


def test_packed_selection_both_modes_rows(tmp_path: Path) -> None:
    """`--packed-selection both`: each packed HyScale row twice, per document and batched, on
    HyScale's own path, the batched row named `_batched` and in the packed table; the mode
    needs --packed."""
    proc = _run(["--model", "dsa", "--skip-stock", "--packed", "3", "--packed-selection",
                 "both"], tmp_path)
    data = _load(tmp_path, "dsa", proc)
    row = data["rows"][0]
    assert data["packed"]["selections"] == ["per_document", "batched"]
    for name, mode in (("hyscale_packed_3", "per_document"),
                       ("hyscale_packed_3_batched", "batched")):
        rec = row[name]
        assert rec["packed_selection"] == mode and rec["path"] == "hyscale"
        _check_record(rec, selects=True, replays=True)
    assert any(x.startswith("| 128 | hyscale_packed_3_batched |") for x in proc.stdout.splitlines())
    with pytest.raises(SystemExit):
        bench_layer.parse_args(["--packed-selection", "batched"])


def test_tiny_cpu_packed_rows_in_row_chunks(tmp_path: Path) -> None:
    """`--packed 3 --row-chunk 48`: the row-chunked layer on packed documents, own path."""
    proc = _run(["--model", "dsa", "--skip-stock", "--packed", "3", "--row-chunk", "48"],
                tmp_path)
    rec = _load(tmp_path, "dsa", proc)["rows"][0]["hyscale_packed_3"]
    assert rec["path"] == "hyscale"
    _check_record(rec, selects=True, replays=True)


def test_compare_indexer_target_row(tmp_path: Path) -> None:
    """`--compare-indexer-target`: the row hyscale_own_target_in_bwd (own kernels, the sparse
    loss's target from the attention backward, under Triton's interpreter here) beside
    hyscale_own, finite; refused for other models and the dense loss."""
    proc = _run(["--model", "dsa", "--skip-stock", "--compare-own-kernels",
                 "--compare-indexer-target"], tmp_path)
    data = _load(tmp_path, "dsa", proc)
    row = data["rows"][0]
    for name in ("hyscale_own", "hyscale_own_target_in_bwd"):
        _check_record(row[name], selects=True, replays=True)
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py, off CUDA
    assert "needs HyScale's Triton kernels" not in proc.stderr  # the row ran its path
    for bad in (["--model", "csa", "--compare-indexer-target"],
                ["--dense-loss", "--compare-indexer-target"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(bad)


def test_compare_mla_projections_row(tmp_path: Path) -> None:
    """`--compare-mla-projections`: the row hyscale_megatron_projections (megatron's einsums,
    RoPE and concatenations around the same core) beside hyscale, finite; refused for models
    without absorbed MLA."""
    proc = _run(["--model", "dsa", "--skip-stock", "--compare-mla-projections"], tmp_path)
    row = _load(tmp_path, "dsa", proc)["rows"][0]
    _check_record(row["hyscale_megatron_projections"], selects=True, replays=True)
    with pytest.raises(SystemExit):
        bench_layer.parse_args(["--model", "csa", "--compare-mla-projections"])


def test_compare_selection_lse_row(tmp_path: Path) -> None:
    """`--compare-selection-lse`: the row hyscale_row_pass_lse (the indexer loss's row pass
    takes its own log-sum-exp) beside hyscale, finite, one selection a step either way (on the
    CPU both rows take the separate target pass: the plumbing only); refused for other
    models, the dense loss and the KL in the row pass."""
    proc = _run(["--model", "dsa", "--skip-stock", "--compare-selection-lse"], tmp_path)
    row = _load(tmp_path, "dsa", proc)["rows"][0]
    for name in ("hyscale", "hyscale_row_pass_lse"):
        _check_record(row[name], selects=True, replays=True)
    assert not any("_packed_" in key for key in row)
    for bad in (["--model", "qsa", "--compare-selection-lse"],
                ["--dense-loss", "--compare-selection-lse"],
                ["--loss-kl-in-rows", "--compare-selection-lse"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(bad)


def test_compare_selection_lse_packed_rows(tmp_path: Path) -> None:
    """`--compare-selection-lse --packed 3 --packed-selection both`: the row-pass comparison
    gets packed rows in each selection mode too, on its own path, each per token against its
    own unpacked row (not the main row's)."""
    proc = _run(["--model", "dsa", "--skip-stock", "--compare-selection-lse", "--packed", "3",
                 "--packed-selection", "both"], tmp_path)
    data = _load(tmp_path, "dsa", proc)
    row = data["rows"][0]
    assert data["packed"]["hyscale_rows_packed_where_timed"] == ["hyscale_row_pass_lse"]
    for base in ("hyscale", "hyscale_row_pass_lse"):
        for name, mode in ((f"{base}_packed_3", "per_document"),
                           (f"{base}_packed_3_batched", "batched")):
            rec = row[name]
            assert (rec["path"], rec["packed_selection"]) == ("hyscale", mode), name
            _check_record(rec, selects=True, replays=True)
            assert rec["per_token_vs_unpacked"] == pytest.approx(
                rec["fwd_bwd_ms"] / row[base]["fwd_bwd_ms"])


def test_loss_key_passes_flag() -> None:
    """`--loss-key-passes N` reaches IndexerLossKernelOptions.bwd_key_passes; below 1 refused."""
    args = bench_layer.parse_args(["--loss-key-passes", "3"])
    assert bench_layer.indexer_loss_kernel_options(args).bwd_key_passes == 3
    assert bench_layer.indexer_loss_kernel_options(bench_layer.parse_args([])).bwd_key_passes == 0
    for bad in (["--loss-key-passes", "0"], ["--compare-loss-key-passes", "0"],
                ["--model", "csa", "--compare-loss-key-passes", "2"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(bad)


def test_compare_loss_key_passes_row(tmp_path: Path) -> None:
    """`--compare-loss-key-passes 2`: the row hyscale_loss_key_passes beside hyscale, finite
    (on the CPU the Triton backward runs either way: the plumbing only)."""
    proc = _run(["--model", "dsa", "--skip-stock", "--compare-loss-key-passes", "2"], tmp_path)
    row = _load(tmp_path, "dsa", proc)["rows"][0]
    for name in ("hyscale", "hyscale_loss_key_passes"):
        _check_record(row[name], selects=True, replays=True)
    assert _load(tmp_path, "dsa", proc)["args"]["compare_loss_key_passes"] == 2


def test_compare_hytopk_atomics_row(tmp_path: Path) -> None:
    """`--compare-hytopk-atomics`: the row hyscale_hytopk_atomics beside hyscale, finite (on
    the CPU the Gluon selection does not run: the plumbing only); refused outside the DSA
    layer."""
    proc = _run(["--model", "dsa", "--skip-stock", "--compare-hytopk-atomics"], tmp_path)
    row = _load(tmp_path, "dsa", proc)["rows"][0]
    for name in ("hyscale", "hyscale_hytopk_atomics"):
        _check_record(row[name], selects=True, replays=True)
    # Each row names the selection options it ran: the run's own (the defaults), and
    # torch.topk's pick with the atomics beside them.
    assert row["hyscale"]["hytopk_options"] is None
    atomics = row["hyscale_hytopk_atomics"]["hytopk_options"]
    assert (atomics["scores_sm90_sample_pick"], atomics["scores_sm90_scan_slots"]) == ("topk",
                                                                                      False)
    with pytest.raises(SystemExit):
        bench_layer.parse_args(["--model", "csa", "--compare-hytopk-atomics"])

"""`python -m megatron_hyscale.evaluate`: its command line, its plan, and a real CPU run.

The CPU run trains the tiny GLM-shaped model for a few iterations on gloo (through
hyscale_bench.pretrain_cpu), stock then HyScale, on the standard-library corpus, and checks that
every section of report.md is filled from the runs' numbers. Its trainer: megatron-lm
(Megatron-LM's pretrain_gpt.py) where a checkout is found ($MEGATRON_LM_DIR, else the
checkout's .carry/megatron_lm from `bash scripts/megatron_lm_carry.sh MEGATRON_LM_GIT_DIR`),
else hyscale (megatron_hyscale.launch.train_gpt, which needs only the megatron-core wheel: what
CI, which cannot fetch Megatron-LM, runs). One trainer a session: each run takes about 80 s on
2 cores; the test's id names the one that ran.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_dryrun import ROOT, clean_env, printed_commands

from megatron_hyscale import evaluate
from megatron_hyscale.launch import logparse, resume
from megatron_hyscale.launch.command import HYSCALE_TRAINER_BANNER


def run_evaluate(*args: str, env: dict[str, str] | None = None, timeout: int = 120
                 ) -> subprocess.CompletedProcess[str]:
    env = env or clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "megatron_hyscale.evaluate", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def test_help_documents_every_option() -> None:
    parser = evaluate.build_parser()
    undocumented = [a.option_strings for a in parser._actions
                    if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert not undocumented
    text = parser.format_help()
    for option in ("--data", "--usd-per-gpu-hour", "--matmul-tflops", "--agreement-every",
                   "--checkpoint-dir", "--time-limit", "--dry-run", "--stock-backend",
                   "--trainer"):
        assert option in text


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = run_evaluate("--dry-run", "--device", "cpu", "--stock-backend", "reference",
                          "--train-iters", "7", "--data", "mock", "--output-dir", str(out),
                          "--", "--lr", "3e-4")
    assert result.returncode == 0, result.stderr
    assert "per-GPU memory, GiB" in result.stdout and "longest sequence" in result.stdout
    commands = printed_commands(result.stdout)
    assert [c[0] for c in commands] == ["stock", "hyscale"]
    (_, stock_env, stock), (_, hys_env, hys) = commands
    for argv in (stock, hys):
        # pretrain_gpt.py through the CPU runner, GPU-only flags dropped, same seed and data
        assert argv[argv.index("-m") + 1] == "torch.distributed.run"
        assert "hyscale_bench.pretrain_cpu" in argv and "--bf16" not in argv
        assert argv[argv.index("--seed") + 1] == "1234"
        assert argv[argv.index("--train-iters") + 1] == "7"
        assert "--mock-data" in argv and argv[-2:] == ["--lr", "3e-4"]
    assert stock[stock.index("--spec") + 2] == "stock_dsa_layer_spec"
    assert hys[hys.index("--spec") + 2] == "hyscale_dsa_layer_spec"
    assert hys_env["HYSCALE_SELECTION_AGREEMENT"] == "50"
    assert "HYSCALE_SELECTION_AGREEMENT" not in stock_env
    assert "HYSCALE_INDEXER_CAPTURE" not in hys_env  # only when asked (--capture-indexer-at)
    assert stock_env["HYSCALE_PHASE_TIMES"] == hys_env["HYSCALE_PHASE_TIMES"] == "1"
    assert not out.exists()


def test_the_indexer_capture_goes_to_the_hyscale_run_only(tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = run_evaluate("--dry-run", "--device", "cpu", "--stock-backend", "reference",
                          "--data", "mock", "--output-dir", str(out),
                          "--capture-indexer-at", "7")
    assert result.returncode == 0, result.stderr
    (_, stock_env, _), (_, hys_env, _) = printed_commands(result.stdout)
    assert hys_env["HYSCALE_INDEXER_CAPTURE"] == str(out / "indexer_capture.pt")
    assert hys_env["HYSCALE_INDEXER_CAPTURE_AT"] == "7"
    assert "HYSCALE_INDEXER_CAPTURE" not in stock_env


def test_gpu_plan_passes_the_stock_backend() -> None:
    result = run_evaluate("--dry-run", "--device", "cuda", "--stock-backend", "cudnn",
                          "--config", "scaled", "--num-layers", "2", "--seq-length", "32768",
                          "--global-batch-size", "1", "--data", "mock",
                          "--checkpoint-dir", "ckpt", "--time-limit", "540")
    assert result.returncode == 0, result.stderr
    (_, stock_env, stock), (_, _, hys) = printed_commands(result.stdout)
    assert stock[stock.index("--dsa-kernel-backend") + 1] == "cudnn"
    assert "--dsa-kernel-backend" not in hys and "--bf16" in hys
    assert stock_env["HYSCALE_KERNEL_BACKEND"] == "best"
    assert stock[stock.index("--save") + 1] == "ckpt/stock"
    assert stock[stock.index("--load") + 1] == "ckpt/stock"
    assert stock[stock.index("--save-interval") + 1] == "100"
    # half of 540 s each, in the whole minutes Megatron-LM parses (an int), a minute to spare
    assert stock[stock.index("--exit-duration-in-mins") + 1] == "3"
    assert hys[hys.index("--save") + 1] == hys[hys.index("--load") + 1] == "ckpt/hyscale"


def test_a_run_with_a_checkpoint_continues_its_log(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--checkpoint-dir: a run whose folder holds a completed checkpoint (Megatron-LM's tracker
    file) appends to its log after the resume marker, so that logparse times each process
    apart; a run without one (no folder, or a save that never completed) starts it afresh."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    args = evaluate.build_parser().parse_args([
        "--device", "cpu", "--trainer", "hyscale", "--stock-backend", "reference", "--data",
        "mock", "--train-iters", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-interval",
        "2", "--output-dir", str(out), "--time-limit", "540"])
    args.invocation, args.megatron_extra = [], []
    plan = evaluate.build_plan(args, None, build_data=False)
    for variant, cmd in plan.commands.items():
        argv = cmd.argv
        assert argv[argv.index("--save") + 1] == argv[argv.index("--load") + 1] == str(
            ckpt / variant)
        assert argv[argv.index("--save-interval") + 1] == "2"
    ran = []

    def fake_run(cmd: object, log: Path | None = None, *, timeout_s: float | None = None,
                 append: bool = False) -> int:
        ran.append((cmd.label, append))
        with open(log, "a" if append else "w") as f:
            f.write(f"{cmd.label} process {len(ran)}\n")
        return 0

    monkeypatch.setattr(evaluate.Command, "run", fake_run)
    assert evaluate.run_plan(plan) == {"stock": 0, "hyscale": 0}
    assert ran == [("stock", False), ("hyscale", False)]
    (ckpt / "stock").mkdir(parents=True)
    (ckpt / "stock" / resume.TRACKER).write_text("2")
    (ckpt / "hyscale").mkdir()  # a save that never completed: Megatron-LM starts afresh
    assert evaluate.run_plan(plan) == {"stock": 0, "hyscale": 0}
    assert ran[2:] == [("stock", True), ("hyscale", False)]
    first, marker, second = (out / "stock.log").read_text().splitlines()
    assert (first, second) == ("stock process 1", "stock process 3")
    assert marker.startswith(logparse.RESUME_MARKER)
    assert (out / "hyscale.log").read_text() == "hyscale process 4\n"


def test_exit_codes_outlive_the_call_that_ran_them(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--only stock, then --only hyscale in another call (the H200 runs split so): the report
    written by the second call still has the first run's exit code."""
    out = tmp_path / "out"
    codes = {"stock": 3, "hyscale": 0}
    monkeypatch.setattr(evaluate.Command, "run",
                        lambda cmd, log=None, **kw: codes[cmd.label])
    assert evaluate.recorded_exit_codes(out) == {"stock": None, "hyscale": None}
    for only in ("stock", "hyscale"):
        args = evaluate.build_parser().parse_args([
            "--device", "cpu", "--trainer", "hyscale", "--stock-backend", "reference",
            "--data", "mock", "--train-iters", "4", "--output-dir", str(out), "--only", only])
        args.invocation, args.megatron_extra = [], []
        evaluate.run_plan(evaluate.build_plan(args, None, build_data=False))
    assert evaluate.recorded_exit_codes(out) == {"stock": 3, "hyscale": 0}


@pytest.mark.parametrize("args, message", [
    (["--data", "/nonexistent/prefix"], "--data /nonexistent/prefix"),
    (["--config", "tiny", "--num-layers", "3"], "--num-layers"),
    (["--device", "cpu", "--stock-backend", "cudnn"], "--stock-backend cudnn needs a GPU"),
])
def test_bad_arguments_name_the_argument(args: list[str], message: str) -> None:
    result = run_evaluate("--dry-run", "--device", "cpu", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_train_iters_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        evaluate.build_parser().parse_args(["--train-iters", "0"])


def test_stock_backend_choice() -> None:
    everything = {"reasons": {}}
    assert evaluate.choose_stock_backend("auto", everything) == ("cudnn", [])
    no_cudnn = {"reasons": {"cudnn": "cudnn does not import"}}
    assert evaluate.choose_stock_backend("auto", no_cudnn) == (
        "tilelang", ["cudnn: cudnn does not import"])
    neither = {"reasons": {"cudnn": "a", "tilelang": "b"}}
    assert evaluate.choose_stock_backend("auto", neither) == ("reference",
                                                              ["cudnn: a", "tilelang: b"])
    assert evaluate.choose_stock_backend("tilelang", neither) == ("tilelang", [])


def test_model_flops_count_the_sparse_attention() -> None:
    model = evaluate.tiny_model()
    cfg = evaluate.glm_config()
    short = evaluate.model_flops_per_iteration(model, cfg.small_layout(1, 256, 2))
    long = evaluate.model_flops_per_iteration(model, cfg.small_layout(1, 512, 2))
    dense = 6.0 * (model.active_params() - model.embedding_params()) * 512
    assert short > dense  # attention and indexer on top of the matmuls
    assert long > 2 * short  # twice the tokens, and each sees more keys


def test_trainer_choice(tmp_path: Path) -> None:
    """hyscale runs HyScale's entry point through the CPU runner; megatron-lm without a
    checkout is an error that names --trainer hyscale (no silent fallback)."""
    result = run_evaluate("--dry-run", "--device", "cpu", "--trainer", "hyscale",
                          "--data", "mock")
    assert result.returncode == 0, result.stderr
    assert "# trainer: hyscale" in result.stdout
    for _, env, argv in printed_commands(result.stdout):
        runner = argv.index("hyscale_bench.pretrain_cpu")
        assert argv[runner + 1:runner + 3] == ["-m", "megatron_hyscale.launch.train_gpt"]
        assert not any(a.endswith("pretrain_gpt.py") for a in argv)
        assert "MEGATRON_LM_DIR" not in env["PYTHONPATH"]
    if megatron_lm() is None:  # a bare clone: the default needs a checkout
        result = run_evaluate("--device", "cpu", "--data", "mock", "--train-iters", "1",
                              "--output-dir", str(tmp_path / "never"))
        assert result.returncode == 2
        assert "no Megatron-LM checkout" in result.stderr
        assert "--trainer hyscale" in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / "never").exists()


def megatron_lm() -> Path | None:
    for candidate in (os.environ.get("MEGATRON_LM_DIR"), str(ROOT / ".carry" / "megatron_lm")):
        if candidate and (Path(candidate) / "pretrain_gpt.py").is_file():
            return Path(candidate)
    return None


NUMBER = re.compile(r"-?[0-9][0-9,]*\.?[0-9]*(?:e[-+]?[0-9]+)?")


def section(report: str, name: str) -> str:
    parts = re.split(r"^## ", report, flags=re.M)
    found = [p for p in parts if p.startswith(name + "\n")]
    assert found, f"report.md has no '## {name}' section"
    return found[0]


def table_cells(text: str, label: str) -> list[str]:
    rows = [line for line in text.splitlines() if line.startswith(f"| {label}")]
    assert rows, f"no table row {label!r}"
    return [c.strip() for c in rows[0].strip("|").split("|")][1:]


def as_number(cell: str) -> float:
    m = NUMBER.search(cell)
    assert m, f"not a number: {cell!r}"
    value = float(m.group(0).replace(",", ""))
    assert math.isfinite(value)
    return value


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["megatron-lm" if megatron_lm() else "hyscale"])
def test_cpu_evaluation_fills_every_section(tmp_path: Path, trainer: str) -> None:
    """Both runs on the CPU with `trainer`, then every report section from their numbers."""
    checkout = megatron_lm()
    out = tmp_path / "eval"
    env = clean_env(OMP_NUM_THREADS="1")
    if trainer == "megatron-lm":
        env["MEGATRON_LM_DIR"] = str(checkout)
    result = run_evaluate(
        "--trainer", trainer,
        "--device", "cpu", "--train-iters", "4", "--agreement-every", "2",
        "--agreement-rows", "32", "--data", "stdlib", "--corpus-limit-mb", "0.25",
        "--data-cache", str(tmp_path / "corpus"), "--output-dir", str(out),
        "--usd-per-gpu-hour", "2.5", "--matmul-tflops", "0.5", "--capture-indexer-at", "4",
        env=env, timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = (out / "report.md").read_text()
    assert "not measured" not in report and "nan" not in report.lower()
    for name in evaluate.REPORT_SECTIONS:
        section(report, name)
    for png in ("loss.png", "agreement.png", "phases.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, png

    setup = section(report, "Setup")
    assert "standard library" in setup and "exit codes | stock 0, HyScale 0" in setup

    loss = section(report, "Loss")
    rows = [line for line in loss.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 4
    for row in rows:
        _, s, h, gap = (c.strip() for c in row.strip("|").split("|"))
        assert 0 < as_number(s) < 10 and 0 < as_number(h) < 10
        assert as_number(gap) < 1e-3  # same weights, seed and data: the curves coincide

    perf = section(report, "Throughput and memory")
    for label in ("tokens/s per process", "model TFLOP/s per process", "MFU",
                  "peak resident memory"):
        assert all(as_number(c) > 0 for c in table_cells(perf, label)), label

    phases = section(report, "Phase breakdown")
    for label in ("selection", "attention", "indexer loss"):
        assert all(as_number(c) > 0 for c in table_cells(phases, label)), label

    agreement = section(report, "Selection agreement")
    rows = [line for line in agreement.splitlines() if re.match(r"\| \d+ \| \d+ \|", line)]
    assert {row.split("|")[1].strip() for row in rows} == {"1", "2", "4"}  # iterations
    assert {row.split("|")[2].strip() for row in rows} == {"1", "2"}  # both layers
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert 0.5 < as_number(cells[2]) <= 1.0  # Jaccard: both exact, ties aside
        assert as_number(cells[3]) == 1.0  # same scores: every row an exact top-k
        assert as_number(cells[4]) > 0 and as_number(cells[5]) > 0
    # the HyScale run's first layer's indexer at its last iteration, for bench_selection.py
    capture = torch.load(out / "indexer_capture.pt")
    seq = capture["q"].shape[1]
    assert capture["q"].shape[0] == 1 and capture["k"].shape[:2] == (1, seq)
    assert capture["weights"].shape == (1, seq, capture["q"].shape[2])
    assert "layer 1, iteration 4" in capture["source"]
    assert f"`{out / 'indexer_capture.pt'}`" in agreement
    results = json.loads((out / "results.json").read_text())
    assert results["indexer_capture"]["iteration"] == 4

    cost = section(report, "Cost")
    hours = [as_number(c) for c in table_cells(cost, "process-hours per billion")]
    usd = [as_number(c) for c in table_cells(cost, "USD per billion")]
    assert all(v > 0 for v in hours)
    assert usd == pytest.approx([2.5 * v for v in hours], rel=1e-2)

    versions = section(report, "Commands and versions")
    assert "megatron-core 0.19" in versions and f"- trainer: {trainer}: " in versions
    hyscale_entry = "megatron_hyscale.launch.train_gpt"
    for variant in evaluate.VARIANTS:
        log = (out / f"{variant}.log").read_text()
        assert (HYSCALE_TRAINER_BANNER in log) == (trainer == "hyscale"), variant
    if trainer == "hyscale":
        commands = "".join(versions.split("```")[1::2])
        assert hyscale_entry in commands and "pretrain_gpt.py" not in commands
    else:
        assert f"pretrain_gpt.py from {checkout}" in versions and hyscale_entry not in versions
    assert json.loads((out / "results.json").read_text())["meta"]["trainer"] == trainer
    assert re.search(r"HyScale commit [0-9a-f]{7}", versions)


"""The demo end to end at a tiny size (CPU, in-process), its argument checks and its metric."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_hyscale import demo
from megatron_hyscale.testing.recall import selection_recall

TINY = ["--steps", "4", "--seq-len", "96", "--topk", "20", "--batch-size", "2",
        "--near-queries", "2", "--log-every", "2", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("demo")
    metrics = demo.main([*TINY, "--out", str(out)])
    return metrics, out


def test_writes_plot_and_json(tiny_run: tuple[dict, Path]) -> None:
    metrics, out = tiny_run
    png = out / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["max_abs_loss_diff"] == metrics["max_abs_loss_diff"]
    assert [r["step"] for r in on_disk["history"]["hyscale"]] == [1, 2, 3, 4]


def test_indexer_capture_is_the_trained_selection(tiny_run: tuple[dict, Path]) -> None:
    """indexer_capture.pt holds layer 1's indexer tensors on the held-out batch, batch-first,
    with the demo's ReLU setting and top-k, in the form `ops.hytopk` (and bench_selection.py
    --captured) takes."""
    from megatron_hyscale.ops import hytopk

    metrics, out = tiny_run
    cap = torch.load(out / "indexer_capture.pt")
    assert metrics["indexer_capture"] == str(out / "indexer_capture.pt")
    B, T, H, D = cap["q"].shape
    assert (B, T) == (2, 96) and cap["k"].shape == (B, T, D) and cap["weights"].shape == (B, T, H)
    assert cap["topk"] == 20 and cap["relu"] is False  # the demo's default: ReLU off
    idx, scores = hytopk(cap["q"], cap["k"], cap["weights"], cap["topk"], relu=cap["relu"])
    assert idx.shape == (B, T, 20) and torch.isfinite(scores[:, -1]).all()
    # Causal: row t selects only keys <= t, and the last row sees enough keys to fill its top-k.
    assert (idx <= torch.arange(T)[None, :, None]).all() and (idx[:, -1] >= 0).all()


def test_losses_finite_and_hyscale_matches_stock(tiny_run: tuple[dict, Path]) -> None:
    metrics, _ = tiny_run
    hy, st = metrics["history"]["hyscale"], metrics["history"]["stock"]
    assert len(hy) == len(st) == 4
    for a, b in zip(hy, st, strict=True):
        assert math.isfinite(a["loss"]) and math.isfinite(b["loss"])
        # Same weights, same batches, same Adam: only rounding may separate the two curves.
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), a["step"]
        assert a["indexer_kl"] == pytest.approx(b["indexer_kl"], rel=1e-3, abs=1e-6)
        assert all(math.isfinite(v) and v >= 0 for v in a["indexer_kl"])
    assert metrics["max_abs_loss_diff"] < 1e-5
    assert metrics["agree_until_step"] == 4
    # The exactness check proper: the stock layer on HyScale's weights, at every step.
    assert metrics["max_abs_loss_diff_same_weights"] < 1e-5
    for a in hy:
        assert a["loss"] == pytest.approx(a["stock_loss_same_weights"], rel=1e-6, abs=1e-6)


def test_recall_in_unit_interval(tiny_run: tuple[dict, Path]) -> None:
    metrics, _ = tiny_run
    assert [e["step"] for e in metrics["recall_log"]] == [0, 2, 4]
    for entry in metrics["recall_log"]:
        for name in ("hyscale", "stock"):
            layers = entry[name]
            assert len(layers) == 2
            for r in layers:
                for key in ("recall", "covered_mass", "fact_hit", "jaccard_vs_stock"):
                    assert 0.0 <= r[key] <= 1.0, (name, key, r[key])
                assert r["mass_set_size"] >= 1
                # ReLU off (the default): continuous scores, no ties, so HyScale's exact top-k
                # and stock's are the same set on the same weights
                assert r["jaccard_vs_stock"] == pytest.approx(1.0, abs=0.02), (name, r)
    assert "jaccard_vs_stock" in metrics["recall_definition"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--topk", "0"], "--topk"),
        (["--topk", "96", "--seq-len", "96"], "--topk"),
        (["--seq-len", "40"], "--seq-len"),
        (["--steps", "0"], "--steps"),
        (["--lr", "-1"], "--lr"),
        (["--far-queries", "9", "--pairs", "8"], "--far-queries"),
        (["--topk", "8"], "--topk"),  # not above the densely attended facts + near queries
        (["--keys", "11"], "--keys"),
    ],
)
def test_bad_arguments_name_the_argument(argv: list[str], names: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=names):
        demo.main([*TINY, *argv, "--out", str(tmp_path)])
    assert not (tmp_path / "metrics.json").exists()


def test_selection_recall_by_hand() -> None:
    # Row mass 0.5, 0.3, 0.15, 0.05: the 90% set is keys {0, 1, 2} (0.8 < 0.9 <= 0.95).
    probs = torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])
    stats = selection_recall(probs, torch.tensor([[[0, 2, -1]]]), mass=0.9)
    assert stats["recall"] == pytest.approx(2 / 3)
    assert stats["covered_mass"] == pytest.approx(0.65)
    assert stats["mass_set_size"] == 3
    full = selection_recall(probs, torch.tensor([[[3, 2, 1, 0]]]))
    assert full["recall"] == 1.0 and full["covered_mass"] == pytest.approx(1.0)


def test_task_answers_are_the_paired_values() -> None:
    task = demo.RecallTask(128, n_near=3)
    batch = task.sample(4, torch.Generator().manual_seed(0))
    ids, targets, fact_pos = batch["ids"], batch["targets"], batch["fact_pos"]
    rows = task.answer_rows()
    assert torch.equal(ids[:, rows + 1], targets)
    facts = ids.gather(1, fact_pos)  # the fact token each query needs
    assert torch.equal(facts // task.n_values, ids[:, rows] - task.key_base)
    assert torch.equal(facts % task.n_values, targets - task.value_base)
    filler = ids[:, task.filler_start : task.far_start]
    assert bool((filler >= task.filler_base).all())


def test_plot_gives_every_curve_its_own_colour_and_legend_entry(
        tiny_run: tuple[dict, Path]) -> None:
    import matplotlib.colors
    import matplotlib.pyplot as plt

    metrics, _ = tiny_run
    fig = demo.curves_figure(metrics["history"], metrics["recall_log"], chance=0.25)
    try:
        loss, accuracy, recall = fig.axes
        assert len(accuracy.get_lines()) == 5  # far and near of both models, and chance
        # recall, fact-in-top-k and Jaccard against stock's top-k of both layers
        assert len(recall.get_lines()) == 6
        assert "layer 2: Jaccard vs stock top-k" in [x.get_label() for x in recall.get_lines()]
        for ax in fig.axes:
            lines = ax.get_lines()
            colours = [matplotlib.colors.to_hex(line.get_color()) for line in lines]
            assert len(set(colours)) == len(colours), (ax.get_title(), colours)
            labels = [line.get_label() for line in lines]
            assert not any(label.startswith("_") for label in labels), labels
            assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
    finally:
        plt.close(fig)


def test_threads_default_to_one_and_are_restored(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    seen: list[int] = []
    monkeypatch.setattr(demo, "_train_and_report",
                        lambda args, task: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    demo.main([*TINY, "--out", str(tmp_path)])
    demo.main([*TINY, "--threads", "3", "--out", str(tmp_path)])
    demo.main([*TINY, "--threads", "0", "--out", str(tmp_path)])
    assert seen == [1, 3, before]
    assert torch.get_num_threads() == before


def _demo_cli(out: Path, *extra: str) -> subprocess.Popen:
    # Each process picks its own rendezvous port (this one's MASTER_PORT is taken).
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "megatron_hyscale.demo", *TINY, "--out",
                             str(out), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def test_cli_output_is_quiet_and_prints_the_table_once(tmp_path: Path) -> None:
    """A fresh process (megatron-core's import-time warnings included): none of the known
    megatron-core warnings, one step table, the thread count; --all-warnings shows them."""
    from megatron_hyscale.testing.quiet import MEGATRON_LOG_MESSAGES, MEGATRON_WARNINGS

    quiet, loud = _demo_cli(tmp_path / "quiet"), _demo_cli(tmp_path / "loud", "--all-warnings")
    out, _ = quiet.communicate(timeout=600)
    loud_out, _ = loud.communicate(timeout=600)
    assert quiet.returncode == 0 and loud.returncode == 0, out[-3000:] + loud_out[-3000:]
    for pattern in [w.message for w in MEGATRON_WARNINGS] + [m for _, m in MEGATRON_LOG_MESSAGES]:
        assert not re.search(pattern, out), pattern
    assert "Warning" not in out, out[:3000]
    assert re.search(r"full scope is deprecated", loud_out)  # the filters did the hiding
    assert re.search(r"GPTModel IS DEPRECATED", loud_out)
    header = demo.table_lines([], both=True)[0]
    assert out.count(header) == loud_out.count(header) == 1
    assert "with 1 intra-op thread (--threads)" in out
    assert demo.RECALL_NOTE in out  # why recall and accuracy can disagree, where recall is shown


# --------------------------------------------------------------------------- scripts/run.sh

RUN_SH = Path(__file__).resolve().parents[1] / "scripts" / "run.sh"


def _find_python(tmp_path: Path, programs: dict[str, str], env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess:
    """run.sh's find_python with a PATH holding only `programs` (name -> "new": a Python
    >= 3.12, this one; "old": one that reports an older version; "pyenv": a fake pyenv whose
    root is tmp_path / "pyenv") plus the tools the function uses."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("ls", "sort"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name, kind in programs.items():
        path = bin_dir / name
        if kind == "new":
            path.symlink_to(sys.executable)
        elif kind == "old":  # what Python < 3.12 answers to the version check
            path.write_text("#!/bin/sh\nexit 1\n")
            path.chmod(0o755)
        elif kind == "pyenv":  # `pyenv root` answers; `pyenv which` finds nothing, as a
            path.write_text(  # pyenv whose selected version has no python3.12 does
                f'#!/bin/sh\n[ "$1" = root ] && echo {tmp_path / "pyenv"} && exit 0\nexit 127\n')
            path.chmod(0o755)
    script = f'source "{RUN_SH}"; find_python'
    return subprocess.run([shutil.which("bash"), "-c", script], capture_output=True, text=True,
                          env={"PATH": str(bin_dir), "HOME": str(tmp_path), **(env or {})})


def _pyenv_version(tmp_path: Path, version: str, kind: str) -> str:
    path = tmp_path / "pyenv" / "versions" / version / "bin" / "python3"
    path.parent.mkdir(parents=True)
    if kind == "new":
        path.symlink_to(sys.executable)
    else:
        path.write_text("#!/bin/sh\nexit 1\n")
        path.chmod(0o755)
    return str(path)


def test_run_sh_takes_the_first_new_enough_python_on_path(tmp_path: Path) -> None:
    got = _find_python(tmp_path, {"python3.12": "old", "python3.13": "new", "python3": "new"})
    assert got.returncode == 0 and got.stdout.strip() == str(tmp_path / "bin" / "python3.13")


def test_run_sh_falls_back_to_pyenv_versions_preferring_3_12(tmp_path: Path) -> None:
    _pyenv_version(tmp_path, "3.11.7", "old")
    _pyenv_version(tmp_path, "3.13.0", "new")
    wanted = _pyenv_version(tmp_path, "3.12.1", "new")
    got = _find_python(tmp_path, {"python3": "old", "pyenv": "pyenv"})
    assert got.returncode == 0 and got.stdout.strip() == wanted


def test_run_sh_says_how_to_choose_when_none_is_found(tmp_path: Path) -> None:
    got = _find_python(tmp_path, {"python3": "old"})
    assert got.returncode == 1 and got.stdout == ""
    assert "no Python >= 3.12" in got.stderr and "HYSCALE_PYTHON" in got.stderr


def test_run_sh_hyscale_python_is_taken_alone(tmp_path: Path) -> None:
    old = tmp_path / "old-python"
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    got = _find_python(tmp_path, {"python3": "new"}, env={"HYSCALE_PYTHON": str(old)})
    assert got.returncode == 1 and f"HYSCALE_PYTHON={old}" in got.stderr  # no silent fallback
    got = _find_python(tmp_path / "2", {"python3": "old"},
                       env={"HYSCALE_PYTHON": sys.executable})
    assert got.returncode == 0 and got.stdout.strip() == sys.executable


def test_run_sh_has_no_machine_specific_interpreter() -> None:
    text = RUN_SH.read_text()
    assert "/root/" not in text and ".pyenv/versions/3." not in text

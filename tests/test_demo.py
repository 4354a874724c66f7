"""The demo end to end at a tiny size (CPU, in-process), its argument checks and its metric."""

from __future__ import annotations

import json
import math
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
                for key in ("recall", "covered_mass", "fact_hit"):
                    assert 0.0 <= r[key] <= 1.0, (name, key, r[key])
                assert r["mass_set_size"] >= 1


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

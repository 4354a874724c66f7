"""The training run's indexer capture (megatron_hyscale.indexer_capture): the environment, the
one write at the asked iteration from the first layer that runs, the format
scripts/bench_selection.py --captured reads, and what is never written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_hyscale import indexer_capture

ROOT = Path(__file__).resolve().parents[1]


class _Indexer:
    index_topk = 16

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def forward_before_topk(self, x, qr):
        sq, b = x.shape[:2]
        q = torch.arange(sq * b * 4 * 8, dtype=torch.float32).view(sq, b, 4, 8) + self.offset
        k = x[..., :8] * 2
        w = qr[..., :4] + 1
        return q.to(torch.bfloat16), k.to(torch.bfloat16), w


class _Config:
    dsa_indexer_scoring_relu = False


class _CoreAttention(torch.nn.Module):
    def __init__(self, layer_number: int, skip_topk: bool = False) -> None:
        super().__init__()
        self.layer_number, self.skip_topk = layer_number, skip_topk
        self.indexer, self.config = _Indexer(float(layer_number)), _Config()

    def forward(self, query, key, value, attention_mask, x=None, qr=None, **kwargs):
        return query


def _run(module, it, monkeypatch, x, qr):
    monkeypatch.setattr(indexer_capture, "iteration_now", lambda: it)
    module(None, None, None, None, x=x, qr=qr)


@pytest.fixture
def env(monkeypatch, tmp_path):
    path = tmp_path / "cap" / "indexer_capture.pt"
    monkeypatch.setenv(indexer_capture.PATH_ENV, str(path))
    monkeypatch.setenv(indexer_capture.AT_ENV, "3")
    monkeypatch.setattr(indexer_capture, "_hook", None)
    return path


def test_environment(monkeypatch):
    monkeypatch.delenv(indexer_capture.PATH_ENV, raising=False)
    assert indexer_capture.from_env() is None
    monkeypatch.setenv(indexer_capture.PATH_ENV, "/tmp/x.pt")
    for bad in ("", "0", "two"):
        monkeypatch.setenv(indexer_capture.AT_ENV, bad)
        with pytest.raises(ValueError, match=indexer_capture.AT_ENV):
            indexer_capture.from_env()
    monkeypatch.setenv(indexer_capture.AT_ENV, "300")
    assert indexer_capture.from_env() == (Path("/tmp/x.pt"), 300)


def test_first_layer_at_the_iteration_writes_once(env, monkeypatch):
    sharing, first, second = _CoreAttention(1, skip_topk=True), _CoreAttention(2), _CoreAttention(3)
    for m in (sharing, first, second):
        assert indexer_capture.attach_from_env(m)
    x = torch.randn(5, 2, 12)
    qr = torch.randn(5, 2, 6)
    _run(first, 2, monkeypatch, x, qr)
    assert not env.exists()  # not the iteration
    _run(sharing, 3, monkeypatch, x, qr)
    assert not env.exists()  # an index-sharing layer has no selection of its own
    _run(first, 3, monkeypatch, x, qr)
    _run(second, 3, monkeypatch, x, qr)
    cap = torch.load(env)
    assert cap["q"].shape == (1, 5, 4, 8) and cap["q"].dtype == torch.bfloat16
    assert cap["k"].shape == (1, 5, 8) and cap["weights"].shape == (1, 5, 4)
    want_q, want_k, want_w = first.indexer.forward_before_topk(x[:, :1], qr[:, :1])
    assert torch.equal(cap["q"], want_q.transpose(0, 1))  # layer 2's, sequence 0, batch-first
    assert torch.equal(cap["k"], want_k.transpose(0, 1))
    assert torch.equal(cap["weights"], want_w.transpose(0, 1).float())
    assert (cap["relu"], cap["topk"]) == (False, 16) and "layer 2" in cap["source"]
    assert not list(env.parent.glob("*.tmp"))
    env.unlink()
    _run(first, 3, monkeypatch, x, qr)  # the hook has written: never again
    assert not env.exists()


def test_evaluation_mode_and_other_iterations_write_nothing(env, monkeypatch):
    module = _CoreAttention(1)
    indexer_capture.attach_from_env(module)
    module.eval()
    _run(module, 3, monkeypatch, torch.randn(4, 1, 12), torch.randn(4, 1, 6))
    assert not env.exists()


def test_bench_selection_reads_the_capture(env, monkeypatch):
    module = _CoreAttention(1)
    indexer_capture.attach_from_env(module)
    _run(module, 3, monkeypatch, torch.randn(7, 1, 12), torch.randn(7, 1, 6))
    spec = importlib.util.spec_from_file_location("_capture_bench_selection",
                                                  ROOT / "scripts" / "bench_selection.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.load_captured(str(env)) == 7
    assert bench.CONFIGS["captured"] == (4, 8, 16, False)


def test_the_log_line_is_read_back(env, monkeypatch, capsys):
    from megatron_hyscale.launch import logparse

    module = _CoreAttention(4)
    indexer_capture.attach_from_env(module)
    _run(module, 3, monkeypatch, torch.randn(6, 1, 12), torch.randn(6, 1, 6))
    text = "iteration 3/ 10 | ...\n" + capsys.readouterr().out
    assert logparse.indexer_capture(text) == {"layer": 4, "iteration": 3, "T": 6,
                                              "path": str(env)}
    assert logparse.indexer_capture("no such line") is None

"""bench_indexer_loss.py's "from dQ" columns (issue #20 item 3): the attention backward timed
with and without the dQ kernel's target, and the target checked against `attention_target`.
Runs the benchmark's function on a tiny GLM-5.1-like input (576 -> 24 channels with a tail,
V = K's main part) with a stand-in timer that calls each function once (under the interpreter
on CPU)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_target_from_dq_columns(monkeypatch):
    spec = importlib.util.spec_from_file_location("_from_dq_bench_indexer_loss",
                                                  ROOT / "scripts" / "bench_indexer_loss.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    timed = []

    def once(fn, reps, warmup):
        fn()
        timed.append(fn)
        return 2.0 if len(timed) == 2 else 1.5  # the second call: with the target

    monkeypatch.setattr(bench, "time_ms", once)
    g = torch.Generator().manual_seed(0)
    T, S, K = 5, 5, 4
    idx = torch.full((1, T, K), -1, dtype=torch.int32)
    for t in range(T):  # distinct visible keys, as the benchmark's spread indices
        keys = torch.randperm(t + 1, generator=g)[:K]
        idx[0, t, : keys.numel()] = keys.int()
    x = dict(query=torch.randn(1, T, 4, 24, generator=g).to(DEVICE),
             key=torch.randn(1, S, 1, 24, generator=g).to(DEVICE))
    row = bench.bench_target_from_dq(x, idx.to(DEVICE), warmup=0, reps=1)
    assert len(timed) == 2
    assert row["attn_bwd_ms"] == 1.5 and row["attn_bwd_with_target_ms"] == 2.0
    assert row["target_in_dq_ms"] == 0.5
    assert 0.0 <= row["target_from_dq_max_abs_diff"] < 1e-5

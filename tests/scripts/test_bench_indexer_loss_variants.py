"""bench_indexer_loss.py --variants: each IndexerLossKernelOptions variant's row (the row pass,
the backward and the two back to back) on a tiny input with a stand-in timer that calls each
function once (under the interpreter on CPU); the fused, one-pass and KL-from-the-backward
variants' outputs agree with the default's, and every name maps to valid options."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def load_bench():
    spec = importlib.util.spec_from_file_location("_variants_bench_indexer_loss",
                                                  ROOT / "scripts" / "bench_indexer_loss.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_variant_rows(monkeypatch):
    bench = load_bench()
    calls = []

    def once(fn, reps, warmup):
        fn()
        calls.append(fn)
        return 1.0

    monkeypatch.setattr(bench, "time_ms", once)
    for fields in bench.LOSS_VARIANTS.values():  # every name is a valid options change
        replace(IndexerLossKernelOptions.DEFAULT, **fields)
    g = torch.Generator().manual_seed(0)
    T, K = 6, 4
    idx = torch.full((1, T, K), -1, dtype=torch.int32)
    for t in range(T):
        keys = torch.randperm(t + 1, generator=g)[:K]
        idx[0, t, : keys.numel()] = keys.int()
    x = dict(q_index=torch.randn(1, T, 3, 8, generator=g), weights=torch.randn(1, T, 3,
                                                                               generator=g),
             k_index=torch.randn(1, T, 8, generator=g), query=torch.randn(1, T, 4, 24,
                                                                          generator=g),
             key=torch.randn(1, T, 1, 24, generator=g))
    x = {n: t.to(DEVICE) for n, t in x.items()}
    base = replace(IndexerLossKernelOptions.DEFAULT, block_n=16)
    default, ref = bench.loss_variant_row(x, idx.to(DEVICE), base, 0, 1, True)
    assert len(calls) == 4 and default["rows_bwd_det_ms"] == 1.0
    for name in ("fused", "one_pass", "kl_in_bwd"):
        options = replace(base, **bench.LOSS_VARIANTS[name])
        row, _ = bench.loss_variant_row(x, idx.to(DEVICE), options, 0, 1, False, ref)
        assert row["rows_ms"] == row["bwd_kernel_ms"] == row["rows_bwd_ms"] == 1.0
        assert row["kl_sum_rel_diff"] < 1e-5, name
        for n in ("dq", "dw", "dk"):
            assert row[f"{n}_max_abs_diff"] <= 1e-5 * max(row[f"{n}_max_abs"], 1.0), (name, n)

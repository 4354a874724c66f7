"""bench_attention.py --bwd-sweep --bwd-variants: each named backward variant is timed beside the
default in the same sweep row, with its option on and nothing else changed. Runs the sweep's
code on a tiny GLM-5.1-like input (576 -> 24 channels with a tail, V = K's main part) with a
stand-in timer that calls each function once (under the interpreter on CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _load_bench():
    spec = importlib.util.spec_from_file_location("_variants_bench_attention",
                                                  ROOT / "scripts" / "bench_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_times_each_variant_beside_the_default(tmp_path, monkeypatch):
    bench = _load_bench()
    timed = []  # the options of every timed call, in order

    def once(fn, reps, warmup):
        fn()
        timed.append((fn.func.__name__, fn.keywords["options"]))
        return 1.0

    def tiny_inputs(shape, T):
        g = torch.Generator().manual_seed(0)
        idx = torch.stack([torch.randperm(40, generator=g)[:20] for _ in range(T)])
        return dict(q=torch.randn(1, T, 4, 24, generator=g).to(DEVICE),
                    k=torch.randn(1, 40, 1, 24, generator=g).to(DEVICE), v=None,
                    idx=idx.view(1, T, 20).int().to(DEVICE), sink=None, dv=16,
                    scale=24 ** -0.5, prefix=None, flop_bwd=1e9)

    monkeypatch.setattr(bench, "time_ms", once)
    monkeypatch.setattr(bench, "make_inputs", tiny_inputs)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    (row,) = bench.bwd_sweep(["glm51"], [3], 1, str(tmp_path), 1.0, tilings=((16, 1),),
                             variants=tuple(bench.BWD_VARIANTS))
    for name, (kernel, fields) in bench.BWD_VARIANTS.items():
        columns = [f"{kernel}_{name}_ms"] + ([f"dkv_{name}_no_atomics_ms"] if kernel == "dkv"
                                             else [])
        for column in columns:
            assert row[column] == 1.0, column
        runs = [(fn, o) for fn, o in timed if all(getattr(o, f) == v for f, v in fields.items())]
        # the variant's own calls, and only on the kernel it changes; at the sweep's tiling
        assert len(runs) == len(columns)
        assert all(fn == f"sparse_attention_bwd_{kernel}" for fn, _ in runs)
        assert all(o.dq_tilings == ((16, 1),) and o.dkv_tilings == ((16, 1),) for _, o in runs)
    # the default columns ran with the default options' values of every variant's fields
    default = bench.AttentionKernelOptions.DEFAULT
    fields = {f for _, changed in bench.BWD_VARIANTS.values() for f in changed}
    assert sum(all(getattr(o, f) == getattr(default, f) for f in fields) for _, o in timed) == 5

    # --sweep-parts: only the named default columns (and every variant's)
    timed.clear()
    (row,) = bench.bwd_sweep(["glm51"], [3], 1, str(tmp_path), 1.0, tilings=((16, 1),),
                             variants=("no_carry",), sweep_parts=("dq", "dkv"))
    assert {c for c in row if c.endswith("_ms")} == {
        "dq_ms", "dkv_ms", "dkv_no_carry_ms", "dkv_no_carry_no_atomics_ms"}
    assert len(timed) == 4

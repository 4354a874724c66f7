"""bench_attention.py --bwd-sweep --bwd-variants: each named backward variant is timed beside the
default in the same sweep row, with its option on and nothing else changed. Runs the sweep's
code on a tiny GLM-5.1-like input (576 -> 24 channels with a tail, V = K's main part) with a
stand-in timer that calls each function once (under the interpreter on CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
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


def test_benchmark_tables_renders_a_sweep_record(tmp_path, monkeypatch, capsys):
    """benchmark_tables.py takes a bench_attention_bwd_sweep record for what it is (not for a
    --tag'd bench_attention record, whose renderer would fail on it): every timed column, the
    failures as written."""
    spec = importlib.util.spec_from_file_location("_tables", ROOT / "scripts" /
                                                  "benchmark_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    meta = {"device": "NVIDIA H200", "date": "2026-12-03 15:56 UTC", "commit": "abc1234",
            "matmul_tflops": 780.0, "command": "synthetic"}
    rows = [dict(shape="csa", T=65536, block_n=32, stages=2, dq_ms=81.9, dkv_ms=59.7,
                 dkv_no_carry_ms="failed: RuntimeError"),
            dict(shape="csa", T=65536, block_n=64, stages=1, dq_ms=37.1, dkv_ms=90.8,
                 dkv_no_carry_ms=90.9)]
    path = tmp_path / "2026-12-03-nvidia-h200-bench_attention_bwd_sweep-csa.json"
    path.write_text(json.dumps({"meta": meta, "records": rows}))
    monkeypatch.setattr(sys, "argv", ["benchmark_tables.py", str(path)])
    assert tables.main() == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| shape | T | keys x stages | dq ms | dkv ms | dkv_no_carry ms |"
    assert lines[1] == "| csa | 65536 | 64 x 1 | 37.1 | 90.8 | 90.9 |"
    assert lines[2] == "| csa | 65536 | 32 x 2 | 81.9 | 59.7 | failed: RuntimeError |"


def _tiny_inputs(seed, T=3):
    """A GLM-5.1-like input for bench_fwd_also / bench_bwd_also (24 channels: 16 + a tail)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(40, generator=g)[:20] for _ in range(T)])
    return dict(q=torch.randn(1, T, 4, 24, generator=g).to(DEVICE),
                k=torch.randn(1, 40, 1, 24, generator=g).to(DEVICE), v=None,
                idx=idx.view(1, T, 20).int().to(DEVICE), sink=None, dv=16, scale=24 ** -0.5,
                prefix=None)


def _record_options(bench, monkeypatch):
    """The options of every sparse_attention_triton call the benchmark makes, in order."""
    calls = []
    real = bench.sparse_attention_triton

    def recording(*args, options, **kwargs):
        calls.append(options)
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(bench, "sparse_attention_triton", recording)
    return calls


def test_fwd_also_times_each_forward_kernel_on_the_same_inputs(monkeypatch):
    """--fwd-also: each named forward runs with its options (and only those changed) on the
    main run's inputs; its output is compared with the main forward's."""
    bench = _load_bench()
    calls = _record_options(bench, monkeypatch)
    monkeypatch.setattr(bench, "time_ms", lambda fn, reps, warmup: (fn(), 2.0)[1])
    inp = _tiny_inputs(seed=1)
    options = bench.AttentionKernelOptions.DEFAULT
    res = bench.bench_fwd_also(inp, 0, 1, options, ["gluon_ws", "triton"])
    assert res["fwd_gluon_ws_ms"] == 2.0 and res["fwd_triton_ms"] == 2.0
    # the main forward, then per name: its comparison run and its timed run
    assert [(o.fwd_sm90, o.fwd_sm90_ws) for o in calls] == [
        (True, True), (True, True), (True, True), (False, False), (False, False)]
    assert all(o.dq_tilings == options.dq_tilings for o in calls)
    if DEVICE == "cpu":  # every forward is the Triton one here: the same output
        assert res["fwd_gluon_ws_rel_diff"] == 0.0 and res["fwd_gluon_ws_kernel"] == "triton"


def test_bwd_also_times_each_backward_kernel_on_the_same_inputs(monkeypatch):
    """--bwd-also: each named backward runs under its options (only the backward's field
    changed; the forward carries them into autograd) on the main run's inputs and output
    gradient; its gradients are compared with the main backward's."""
    bench = _load_bench()
    calls = _record_options(bench, monkeypatch)
    timed = []
    monkeypatch.setattr(bench, "time_ms", lambda fn, reps, warmup: (timed.append(fn()), 3.0)[1])
    inp = _tiny_inputs(seed=2)
    options = replace(bench.AttentionKernelOptions.DEFAULT, bwd_sm90=False)
    res = bench.bench_bwd_also(inp, 0, 1, options, ["sm90"])
    assert res["bwd_sm90_ms"] == 3.0
    assert [o.bwd_sm90 for o in calls] == [False, True]
    assert all(o.dq_tilings == options.dq_tilings and o.fwd_sm90 == options.fwd_sm90
               for o in calls)
    assert len(timed) == 1 and len(timed[0]) == 2  # dq and dk: a gradient for each leaf
    if DEVICE == "cpu":  # the Triton backward either way here: the same gradients
        assert res["bwd_sm90_rel_diff"] == 0.0 and res["bwd_sm90_kernel"] == "triton"

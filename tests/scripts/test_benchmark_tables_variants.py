"""benchmark_tables' variant tables on CPU: HyTopK's kernel variants beside the default of the
same run, the row-sort micro-benchmark, the indexer loss's variants and the dense loss, and
which renderer a record's file name picks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark_tables.py"


def load():
    spec = importlib.util.spec_from_file_location("benchmark_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(lines):
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines
             if line.startswith("|") and not line.startswith("|---")]
    return [dict(zip(table[0], r)) for r in table[1:]]


def test_selection_variants_speed_up_and_equality():
    tables = load()
    base = {"config": "norelu", "T": 131072, "inputs": "random", "reps": 2, "floor_ms": 95.6}
    records = [dict(base, method="hytopk", ms=121.3),
               dict(base, method="hytopk_sort_regs", ms=106.5, same_as_hytopk=True),
               dict(base, method="hytopk_sort_bitonic", ms=122.2, same_as_hytopk=False,
                    same_rows_as_hytopk=0.99971)]
    (row,) = rows(tables.kernel_variants(records))
    assert row["HyTopK ms"] == "121.3"
    assert row["hytopk_sort_regs ms (speed-up, rows equal)"] == "106.5 (1.14x, yes)"
    bitonic = row["hytopk_sort_bitonic ms (speed-up, rows equal)"]
    assert bitonic == "122.2 (0.99x, NO, sets 99.9710%)"
    assert tables.kernel_variants(records[:1]) == []  # no variant, no table
    assert tables.selection(records)[-4:] == tables.kernel_variants(records)


def test_single_first_calls_are_starred_where_they_stand():
    """A method timed by one first call (over 2 s, reps 1) carries the footnote's star in its
    own cell, whichever column it is (megatron's cudnn selection at 64K on 2026-12-04)."""
    tables = load()
    base = {"config": "dsv32", "T": 65536, "inputs": "random", "floor_ms": 46.3, "reps": 2}
    records = [dict(base, method="hytopk", ms=103.4, mem_gib=1.02),
               dict(base, method="stock_cudnn", ms=3922.0, reps=1),
               dict(base, method="table", ms=127.2)]
    lines = tables.selection(records)
    (row,) = rows(lines)
    assert row["megatron cudnn selection ms"] == "3922.0 *"
    assert row["HyTopK ms (GiB)"] == "103.4 (1.02)" and row["table-then-select ms"] == "127.2"
    assert any("single first call" in line for line in lines)
    records[1]["reps"] = 3
    (row,) = rows(tables.selection(records))
    assert row["megatron cudnn selection ms"] == "3922.0"
    assert not any("single first call" in line for line in tables.selection(records))


def test_loss_variants_and_dense_tables():
    tables = load()
    default = dict(rows_ms=37.9, bwd_kernel_ms=91.8, rows_bwd_ms=129.5)
    one_pass = dict(rows_ms=26.9, bwd_kernel_ms=91.8, rows_bwd_ms=118.2, kl_sum_rel_diff=6.2e-7,
                    dk_max_abs_diff=1.9e-9)
    got = rows(tables.indexer_loss_variants([dict(shape="glm51", T=131072, default=default,
                                                  one_pass=one_pass, fused="failed: x")]))
    assert [r["variant"] for r in got] == ["default", "one_pass", "fused"]
    assert got[1]["both ms (speed-up)"] == "118.2 (1.10x)"
    assert got[2]["row pass ms"] == "failed: x"
    dense = rows(tables.indexer_loss_dense([dict(
        shape="glm51", T=4096, frac_matmul=0.11, triton=dict(fwd_bwd_ms=18.3, peak_gib=0.16),
        reference=dict(fwd_bwd_ms=322.8, peak_gib=0.29), accuracy=dict(loss_rel=5.9e-7))]))
    assert dense[0]["Triton speed-up"] == "17.64x"
    assert dense[0]["reference fwd + bwd ms (GiB)"] == "322.8 (0.29)"


def test_record_names_pick_their_renderer():
    tables = load()
    micro = rows(tables.row_sort_micro([dict(method="write_rows_bitonic", rows=8, topk=4,
                                             ms=1.5, same_as_default=True)]))
    assert micro[0]["same as the default"] == "yes"
    order = list(tables.RENDER)
    # the longer names first: a tagged bench_selection record would otherwise take them
    assert order.index("bench_selection_row_sort") < order.index("bench_selection")
    assert order.index("bench_indexer_loss_variants") < order.index("bench_indexer_loss")
    assert order.index("bench_indexer_loss_dense") < order.index("bench_indexer_loss")


def test_attention_other_kernels_of_the_same_run():
    """bench_attention --fwd-also / --bwd-also: a table per part after the main one, each named
    kernel's time against the main kernel's and the library's (a speed-up of 2.00x: twice as
    fast); none without them."""
    tables = load()
    base = {"shape": "glm51", "T": 16384, "fwd_ms": 10.0, "fwd_frac": 0.5, "bwd_ms": 70.0,
            "bwd_frac": 0.2, "bwd_kernel": "triton", "lib_bwd_ms": 30.0, "lib_fwd_ms": 8.0}
    assert tables.attention_also([base]) == []
    record = dict(base, bwd_sm90_ms=35.0, bwd_sm90_frac=0.4, bwd_sm90_kernel="gluon-ws-sm90",
                  bwd_sm90_rel_diff=1e-3, fwd_gluon_ws_ms=8.0, fwd_gluon_ws_kernel="gluon-ws-sm90")
    lines = tables.attention([record])
    fwd_at = next(i for i, line in enumerate(lines) if "fwd kernel" in line)
    bwd_at = next(i for i, line in enumerate(lines) if "bwd kernel" in line)
    assert 0 < fwd_at < bwd_at
    (fwd,) = rows(lines[fwd_at:bwd_at])
    assert fwd["gluon_ws: kernel, ms (/ matmul), speed-up, vs FlashMLA, rel. diff"] == (
        "gluon-ws-sm90, 8.0 (-), 1.25x, 1.00x, -")
    (bwd,) = rows(lines[bwd_at:])
    assert bwd["sm90: kernel, ms (/ matmul), speed-up, vs cuDNN, rel. diff"] == (
        "gluon-ws-sm90, 35.0 (40%), 2.00x, 0.86x, 1.0e-03")


def test_scores_only_table():
    """bench_selection's scoreonly* methods get their own table (ms, x floor, difference from
    the Triton scores-only kernel's row maxima); a run without them gets none."""
    tables = load()
    base = {"config": "glm51", "T": 131072, "inputs": "random", "reps": 3, "floor_ms": 92.144}
    records = [dict(base, method="scoreonly", ms=157.77, x_floor=1.712),
               dict(base, method="scoreonly_sm90", ms=112.5, x_floor=1.221,
                    max_diff_vs_scoreonly=0.0)]
    got = rows(tables.scores_only(records))
    assert [r["method"] for r in got] == ["scoreonly", "scoreonly_sm90"]
    assert got[1]["ms"] == "112.50" and got[1]["x GEMM floor"] == "1.22"
    assert got[1]["max diff vs scoreonly"] == "0.0e+00" and got[0]["max diff vs scoreonly"] == "-"
    assert tables.scores_only([dict(base, method="hytopk", ms=200.0)]) == []
    assert tables.selection(records)[-4:] == tables.scores_only(records)[-4:]


def test_scores_sm90_phase_table():
    """hytopk_scores_sm90 records: time, redone share and the phases with their remainder."""
    tables = load()
    base = {"config": "dsv32", "T": 131072, "inputs": "random", "reps": 3, "floor_ms": 181.9}
    records = [dict(base, method="hytopk", ms=387.7),
               dict(base, method="hytopk_scores_sm90", ms=346.2, x_floor=1.903,
                    redone_rows_share=0.017,
                    phase_ms={"sample": 20.0, "filter": 220.0, "select": 60.0})]
    (row,) = rows(tables.scores_sm90_phases(records))
    assert row["on the Gluon scores ms"] == "346.2" and row["rows redone"] == "1.70%"
    assert (row["sample ms"], row["filter ms"], row["select ms"]) == ("20.0", "220.0", "60.0")
    assert row["rest ms"] == "46.2"
    assert tables.scores_sm90_phases(records[:1]) == []
    # a record from before the phases were timed: its time, no parts
    (old,) = rows(tables.scores_sm90_phases([dict(records[1], phase_ms=None)]))
    assert old["sample ms"] == "-" and old["rest ms"] == "-"

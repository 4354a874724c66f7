"""megatron-core's TileLang kernels as stock rows of the three kernel benchmarks, on CPU.

bench_selection's `stock_tilelang` method, bench_attention's and bench_indexer_loss's TileLang
columns (--no-tilelang skips them): their options parse; without TileLang each run says why in
one line (once, not once a length) and goes on with HyScale's rows; megatron's TileLang entry
points declining is an error, never a silent fallback. benchmark_tables.py renders records with
the TileLang entries, and measured_defaults.py never makes a stock row a HyScale kernel choice.
The calls into megatron (layouts, causal row bounds, 8192-row blocks, the loss's given-indices
wrapper) run with torch stand-ins for TileLang's kernels and must equal HyScale's references.

`import tilelang` is made to fail (sys.modules["tilelang"] = None), so the refusal paths are the
same on a machine that has TileLang. The scripts are imported once a module (~2 s each).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
# How each script names the missing package (ImportError's subclass for a None module entry).
MISSING = "tilelang does not import (ModuleNotFoundError: "


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_tl_test_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sel():
    return load("bench_selection")


@pytest.fixture(scope="module")
def att():
    return load("bench_attention")


@pytest.fixture(scope="module")
def loss():
    return load("bench_indexer_loss")


@pytest.fixture
def no_tilelang(monkeypatch):
    """`import tilelang` raises ModuleNotFoundError, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "tilelang", None)


class Parsed(Exception):
    """Raised by the patched require_cuda: the arguments parsed."""


def parses(module, monkeypatch, argv: list[str]) -> bool:
    """True when main() gets past argument parsing with `argv` (it stops there)."""
    def stop(*args, **kwargs):
        raise Parsed

    monkeypatch.setattr(module, "require_cuda", stop)
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    try:
        module.main()
    except Parsed:
        return True
    except SystemExit:
        return False
    raise AssertionError("main() returned before require_cuda")


# --- argument parsing -------------------------------------------------------------------------

def test_selection_accepts_the_stock_tilelang_method(sel, monkeypatch, capsys) -> None:
    assert "stock_tilelang" in sel.METHODS
    assert parses(sel, monkeypatch, ["--methods", "hytopk", "cudnn", "stock_tilelang"])
    assert not parses(sel, monkeypatch, ["--methods", "stock_tilelang_typo"])
    assert "invalid choice" in capsys.readouterr().err


def test_attention_and_loss_accept_no_tilelang(att, loss, monkeypatch) -> None:
    assert parses(att, monkeypatch, ["--no-tilelang", "--shapes", "glm51", "v32"])
    assert parses(loss, monkeypatch, ["--no-tilelang", "--t", "32768"])
    assert parses(att, monkeypatch, ["--shapes", "glm51"])  # TileLang columns on by default
    assert parses(loss, monkeypatch, ["--t", "32768"])


# --- bench_selection: the refusal and the run going on ---------------------------------------

def fake_selection_run(sel, monkeypatch, bench_one, argv: list[str]) -> list[list[dict]]:
    """bench_selection.main() on CPU with bench_one in place of the timings (the 4K warm-up
    calls of hytopk and hytopk_default do nothing): each written record list, in order."""
    written = []
    monkeypatch.setattr(sel, "require_cuda", lambda *a, **k: None)
    monkeypatch.setattr(sel, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(sel, "copy_tbps", lambda: 4.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(sel, "config_inputs", lambda T, cfg, kind: (None, None, None))
    for name in ("hytopk", "hytopk_default"):
        monkeypatch.setitem(sel.METHODS, name, lambda *a: None)
    monkeypatch.setattr(sel, "bench_one", bench_one)
    monkeypatch.setattr(sel, "write_json", lambda records, *a: written.append(list(records)))
    monkeypatch.setattr(sel, "plot", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["bench_selection.py", *argv])
    sel.main()
    return written


def test_selection_run_without_tilelang_says_why_once_a_config_and_goes_on(
        sel, monkeypatch, capsys, no_tilelang, tmp_path) -> None:
    def bench_one(method, T, cfg, kind, rate, reps, extras=True):
        assert method == "hytopk", method  # stock_tilelang never reaches a timing
        return {"method": method, "config": cfg, "T": T, "inputs": kind, "floor_ms": 1.0,
                "ms": 2.0, "mem_gib": 0.5, "x_floor": 2.0}

    written = fake_selection_run(sel, monkeypatch, bench_one, [
        "--methods", "hytopk", "stock_tilelang", "--configs", "glm51", "dsv32", "--T", "16384",
        "32768", "--out", str(tmp_path)])  # no exit: the run goes on
    out = capsys.readouterr().out
    refusals = [line for line in out.splitlines() if "stock_tilelang: not run" in line]
    assert len(refusals) == 2, out  # once a config, not once a length
    for cfg, line in zip(("glm51", "dsv32"), refusals):
        assert line.startswith(f"{cfg} stock_tilelang: not run ({MISSING}"), line
    records = written[-1]
    assert sorted((r["config"], r["T"], r["method"]) for r in records) == sorted(
        (c, T, "hytopk") for c in ("glm51", "dsv32") for T in (16384, 32768))


def test_selection_tilelang_reason_is_not_cudnns(sel, no_tilelang) -> None:
    # cuDNN refuses configs without ReLU; TileLang takes them (use_relu), so only its own
    # availability is the reason there, and the fp32 capture is refused for its dtype.
    assert "cuDNN" in sel.library_unavailable_reason("cudnn", "norelu")
    why = sel.library_unavailable_reason("stock_tilelang", "norelu")
    assert why.startswith(MISSING), why
    assert "bf16" in sel.library_unavailable_reason("stock_tilelang", "captured")
    assert sel.library_unavailable_reason("hytopk", "glm51") is None
    assert "stock_tilelang" in sel.TOKEN_KEY_METHODS  # S = T keys only, like cuDNN's
    assert "stock_tilelang" in sel.COMPARED_METHODS  # untimed call a length, rows compared


def test_stock_tilelang_selection_declining_is_an_error(sel, no_tilelang) -> None:
    # Without TileLang megatron's hook returns None (the stock layer then falls back to its
    # unfused path): the benchmark raises instead of timing something else.
    q = torch.zeros(1, 8, 4, 16, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 16, dtype=torch.bfloat16)
    w = torch.zeros(1, 8, 4)
    with pytest.raises(RuntimeError, match="TileLang selection declined"):
        sel.run_stock_tilelang(q, k, w, 4, True)


# --- bench_attention ---------------------------------------------------------------------------

def test_attention_tilelang_columns_say_why_once(att, capsys, no_tilelang) -> None:
    said = set()
    rows = [att.tilelang_columns(shape, None, 1, 2, said)
            for shape in ("glm51", "v32", "glm51", "csa", "csa")]
    for row in rows:
        assert set(row) == {"tl_status"} and row["tl_status"].startswith("not run: "), row
    assert rows[0]["tl_status"].startswith(f"not run: {MISSING}")
    assert "absorbed MLA only" in rows[3]["tl_status"]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines  # the import once, csa's shape once
    assert lines[0].startswith(f"tilelang: not run ({MISSING}")
    assert lines[1].startswith("tilelang: not run for csa (TileLang's SparseMLA takes absorbed")


def test_attention_tilelang_shapes(att) -> None:
    assert att.tilelang_unsupported("glm51") is None
    assert att.tilelang_unsupported("v32") is None
    for shape in ("csa", "qsa", "hca"):
        assert att.tilelang_unsupported(shape), shape


def test_attention_rel_err_in_blocks(att) -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 37, 3, 8, generator=g).to(torch.bfloat16)
    out = (ref.float() + 0.01 * torch.randn(1, 37, 3, 8, generator=g)).to(torch.bfloat16)
    whole = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert att.rel_err(out, ref, rows=5) == pytest.approx(whole, rel=1e-5)


# --- bench_indexer_loss ------------------------------------------------------------------------

def test_loss_tilelang_entry_says_why_once(loss, capsys, no_tilelang) -> None:
    said = set()
    entries = [loss.tilelang_entry(None, None, 1, 2, said) for _ in range(3)]
    for entry in entries:
        assert entry.startswith(f"not run: {MISSING}"), entry
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tilelang: not run (tilelang does not"), lines


def test_loss_tilelang_declining_is_an_error_and_restores_megatron(loss, no_tilelang) -> None:
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    before = tilelang_dsa.lighting_indexer
    bf16 = dict(dtype=torch.bfloat16)
    x = dict(q_index=torch.zeros(1, 8, 8, 16, **bf16), weights=torch.zeros(1, 8, 8, **bf16),
             k_index=torch.zeros(1, 8, 16, **bf16), query=torch.zeros(1, 8, 4, 64, **bf16),
             key=torch.zeros(1, 8, 1, 64, **bf16))
    idx = torch.zeros(1, 8, 64, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="TileLang indexer loss declined"):
        loss.tilelang_loss(x, idx, 0.125)
    assert tilelang_dsa.lighting_indexer is before  # the given-indices wrapper is removed


# --- benchmark_tables.py -----------------------------------------------------------------------

META = {"device": "NVIDIA H200", "date": "2026-12-02 03:00:00 UTC", "commit": "abc1234",
        "matmul_tflops": 800.0, "command": "synthetic"}


def write_record(folder: Path, script: str, records: list[dict], meta: dict | None = None
                 ) -> Path:
    path = folder / f"2026-12-02-nvidia-h200-{script}-glm51.json"
    path.write_text(json.dumps({"meta": META | (meta or {}), "records": records}))
    return path


def tables(monkeypatch, capsys, *paths: Path) -> dict[str, list[dict[str, str]]]:
    """Run benchmark_tables.py; each table's rows as {header: cell}, by the record's name."""
    module = load("benchmark_tables")
    monkeypatch.setattr(sys, "argv", ["benchmark_tables.py", *map(str, paths)])
    assert module.main() == 0
    out, result, name, head = capsys.readouterr().out, {}, None, None
    for line in out.splitlines():
        if line.startswith("`"):
            name, head = line.split("`")[1], None
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if head is None:
                head = cells
            else:
                result.setdefault(name, []).append(dict(zip(head, cells)))
    return result


SELECTION = [
    {"method": "hytopk", "config": "glm51", "T": 131072, "inputs": "random", "floor_ms": 90.0,
     "ms": 300.0, "mem_gib": 2.9, "reps": 2, "H": 32, "D": 128, "topk": 2048},
    {"method": "cudnn", "config": "glm51", "T": 131072, "inputs": "random", "floor_ms": 90.0,
     "ms": 200.0, "mem_gib": 5.1, "reps": 2, "same_rows_as_hytopk": 0.9998},
    {"method": "stock_tilelang", "config": "glm51", "T": 131072, "inputs": "random",
     "floor_ms": 90.0, "ms": 900.0, "mem_gib": 4.5, "reps": 2, "same_rows_as_hytopk": 0.995},
    {"method": "stock_tilelang", "config": "glm51", "T": 262144, "inputs": "random",
     "floor_ms": 360.0, "ms": None, "mem_gib": None, "status": "OOM"},
]
ATTENTION = [{"shape": "glm51", "T": 131072, "K": 2048, "Hq": 64, "Dqk": 576, "Dv": 512,
              "sink": False, "indices": "random", "fwd_ms": 100.0, "fwd_frac": 0.46,
              "bwd_ms": 900.0, "bwd_frac": 0.13, "lib_fwd_ms": 80.0, "lib_fwd_frac": 0.55,
              "lib_bwd_ms": 450.0, "lib_bwd_frac": 0.26, "tl_fwd_ms": 150.0, "tl_fwd_frac": 0.3,
              "tl_bwd_ms": 1800.0, "tl_bwd_frac": 0.065, "tl_out_rel_err": 0.004}]
LOSS = [{"shape": "glm51", "T": 131072, "Hq": 64, "Dqk": 576, "H_I": 32,
         "triton": {"total_ms": 630.0, "loss": 0.0191258},
         "triton_lse": {"total_ms": 400.0, "loss": 0.0191258},
         "cudnn": {"total_ms": 200.0, "loss": 0.0191259},
         "tilelang": {"total_ms": 800.0, "scores_ms": 500.0, "loss": 0.0191257}},
        {"shape": "glm51", "T": 32768, "Hq": 64, "Dqk": 576, "H_I": 32,
         "triton": {"total_ms": 150.0, "loss": 0.0191313},
         "cudnn": "not run: cudnn does not import", "tilelang": "not run: tilelang does not"}]


def test_tables_render_the_tilelang_entries(monkeypatch, capsys, tmp_path) -> None:
    paths = [write_record(tmp_path, s, r) for s, r in (("bench_selection", SELECTION),
                                                     ("bench_attention", ATTENTION),
                                                     ("bench_indexer_loss", LOSS))]
    got = tables(monkeypatch, capsys, *paths)
    s128, s256 = got[paths[0].name]
    assert s128["megatron tilelang selection ms (GiB)"] == "900.0 (4.50)"
    assert s128["HyTopK speed vs TileLang"] == "3.00x"
    assert s128["HyTopK speed vs cuDNN"] == "0.67x"
    assert s128["rows equal to HyTopK's (cuDNN / TileLang)"] == "99.98% / 99.50%"
    assert s256["megatron tilelang selection ms (GiB)"] == "OOM"
    assert s256["HyTopK ms (GiB)"] == "-"
    (a,) = got[paths[1].name]
    assert a["TileLang fwd ms (/ matmul)"] == "150.0 (30%)"
    assert a["TileLang bwd ms (/ matmul)"] == "1800.0 (6%)"
    assert a["fwd: HyScale vs TileLang"] == "1.50x" and a["bwd: HyScale vs TileLang"] == "2.00x"
    assert a["bwd: HyScale vs cuDNN"] == "0.50x"
    short, long = got[paths[2].name]  # sorted by T
    assert long["TileLang fwd + bwd ms (its score-table pass)"] == "800.0 (500.0)"
    assert long["HyScale (lse given) vs TileLang"] == "2.00x"
    assert long["HyScale vs cuDNN"] == "0.50x"
    assert long["loss Triton / cuDNN / TileLang"] == "0.0191258 / 0.0191259 / 0.0191257"
    assert short["TileLang fwd + bwd ms (its score-table pass)"] == "not run"
    assert short["HyScale (lse given) vs TileLang"] == "-"
    assert short["loss Triton / cuDNN / TileLang"] == "-"


# --- measured_defaults.py ----------------------------------------------------------------------

def test_measured_defaults_never_picks_a_stock_row(tmp_path) -> None:
    md = load("measured_defaults")
    # Stock rows faster than everything, and no HyScale library row: no entry at all.
    stock_only_sel = [dict(r) for r in SELECTION if r["method"] != "cudnn"] + [
        {"method": "stock_cudnn", "config": "glm51", "T": 131072, "inputs": "random",
         "ms": 1.0, "mem_gib": 1.0}]
    for r in stock_only_sel:
        if r["method"] == "stock_tilelang" and r.get("ms"):
            r["ms"] = 2.0
    stock_only_att = [{k: v for k, v in ATTENTION[0].items() if not k.startswith("lib_")}]
    stock_only_loss = [{k: v for k, v in LOSS[0].items() if k != "cudnn"}]
    stock_only_loss[0]["tilelang"] = {"total_ms": 1.0, "loss": 0.02}
    folder = tmp_path / "stock_only"
    folder.mkdir()
    for script, records in (("bench_selection", stock_only_sel),
                            ("bench_attention", stock_only_att),
                            ("bench_indexer_loss", stock_only_loss)):
        assert md.entries_from(str(write_record(folder, script, records))) == [], script

    # With the library rows present, the library side is the library's, never a stock time.
    folder = tmp_path / "both"
    folder.mkdir()
    entries = []
    for script, records in (("bench_selection", SELECTION + stock_only_sel[-1:]),
                            ("bench_attention", ATTENTION), ("bench_indexer_loss", LOSS)):
        entries += md.entries_from(str(write_record(folder, script, records)))
    entries = md.table(entries)  # the attention's forward and backward joined
    by_op = {e["op"]: e for e in entries}
    assert len(entries) == 3, entries
    assert (by_op["selection"]["own_ms"], by_op["selection"]["library_ms"]) == (300.0, 200.0)
    assert (by_op["attention"]["own_ms"], by_op["attention"]["library_ms"]) == (1000.0, 530.0)
    assert (by_op["indexer_loss"]["own_ms"], by_op["indexer_loss"]["library_ms"]) == (400.0,
                                                                                       200.0)


def test_measured_defaults_takes_the_default_selection_where_a_record_has_it(
        tmp_path, monkeypatch) -> None:
    """The own selection time is what ops.hytopk runs by default at that length: hytopk_default
    where the record timed it; else the Gluon path (hytopk_scores_sm90) from
    HyTopKOptions.scores_sm90_min_keys keys (without ReLU scores_sm90_folded_min_keys); else
    the Triton kernel (hytopk)."""
    import dataclasses

    from megatron_hyscale.ops import HyTopKOptions

    md = load("measured_defaults")
    long_t = HyTopKOptions.DEFAULT.scores_sm90_min_keys * 2
    short_t = HyTopKOptions.DEFAULT.scores_sm90_min_keys // 2
    pair = [dict(r, T=long_t) for r in SELECTION[:2]]  # hytopk 300 ms, cudnn 200 ms

    def found(*records):
        return sorted((e["T"], e["own_ms"], e["library_ms"], e["own_kernel"]) for e in
                      md.entries_from(str(write_record(tmp_path, "bench_selection", records))))

    gluon = dict(pair[0], method="hytopk_scores_sm90", ms=250.0)
    default = dict(pair[0], method="hytopk_default", ms=180.0)
    assert found(*pair) == [(long_t, 300.0, 200.0, "hytopk")]
    assert found(*pair, gluon) == [(long_t, 250.0, 200.0, "hytopk_scores_sm90")]
    assert found(*pair, gluon, default) == [(long_t, 180.0, 200.0, "hytopk_default")]
    short = [dict(r, T=short_t) for r in (*pair, gluon)]  # below the Gluon path's length
    assert found(*short) == [(short_t, 300.0, 200.0, "hytopk")]
    oom = dict(gluon, ms=None, status="OOM")  # an untimed method gives way to the next
    assert found(*pair, oom) == [(long_t, 300.0, 200.0, "hytopk")]
    # Without ReLU the Gluon path starts at scores_sm90_folded_min_keys (None: never).
    unfolded = [dict(r, relu=False) for r in (*pair, gluon)]
    if HyTopKOptions.DEFAULT.scores_sm90_folded_min_keys is not None:
        assert HyTopKOptions.DEFAULT.scores_sm90_folded_min_keys <= long_t
        assert found(*unfolded) == [(long_t, 250.0, 200.0, "hytopk_scores_sm90")]
    folded = dataclasses.replace(HyTopKOptions.DEFAULT,
                                 scores_sm90_folded_min_keys=long_t * 2)
    monkeypatch.setattr(HyTopKOptions, "DEFAULT", folded)
    assert found(*unfolded) == [(long_t, 300.0, 200.0, "hytopk")]
    assert found(*pair, gluon) == [(long_t, 250.0, 200.0, "hytopk_scores_sm90")]
    monkeypatch.setattr(HyTopKOptions, "DEFAULT", dataclasses.replace(
        folded, scores_sm90_folded_min_keys=None))
    assert found(*unfolded) == [(long_t, 300.0, 200.0, "hytopk")]
    monkeypatch.undo()

    # Across records: a newer record that timed only the Triton kernel does not displace the
    # Gluon path's time; a newer one of the same method does.
    older = md.entries_from(str(write_record(tmp_path, "bench_selection", [*pair, gluon])))
    newer = md.entries_from(str(write_record(tmp_path, "bench_selection",
                                             [dict(r, ms=r["ms"] + 1) for r in pair])))
    for e in newer:
        e["stamp"] = "9999"
    (kept,) = md.table(older + newer)
    assert (kept["own_ms"], kept["own_kernel"]) == (250.0, "hytopk_scores_sm90")
    newest = [dict(e, stamp="9999", own_ms=240.0) for e in older]
    (kept,) = md.table(older + newest)
    assert kept["own_ms"] == 240.0 and "rank" not in kept and "stamp" not in kept


def test_measured_defaults_trusts_hytopk_default_only_under_todays_defaults(tmp_path) -> None:
    """hytopk_default is the default of the day the record ran: a record naming today's
    HyTopKOptions.DEFAULT (bench_selection's meta) gives its time; an older record's gives
    way to the method running today's default path (the Gluon path with the sample and slots
    today's default takes), unless its options name that same path, and where it names
    another method's path, it ranks as that method (first); without options named, as the
    older default's slot."""
    import dataclasses

    from megatron_hyscale.ops import HyTopKOptions

    md = load("measured_defaults")
    default = HyTopKOptions.DEFAULT
    long_t = default.scores_sm90_min_keys * 2
    pair = [dict(r, T=long_t) for r in SELECTION[:2]]  # hytopk 300 ms, cudnn 200 ms
    path_method, others = md.gluon_path_methods(default)
    other_key, other_method = next((k, m) for k, m in md.GLUON_METHODS.items()
                                   if m and m != path_method and k[0] == default
                                   .scores_sm90_sample_table)
    rows = [*pair, dict(pair[0], method="hytopk_default", ms=180.0),
            dict(pair[0], method=path_method, ms=170.0),
            dict(pair[0], method=other_method, ms=160.0)]

    def named(**changes):
        return {"hytopk_default_options": dataclasses.asdict(dataclasses.replace(default,
                                                                                 **changes))}

    today = named()
    same_path = named(scores_sm90_min_keys=default.scores_sm90_min_keys + 1)
    other_path = named(**dict(zip(md.GLUON_FIELDS, other_key, strict=True)))
    triton = named(scores_sm90=False)

    def own(meta):
        (e,) = md.entries_from(str(write_record(tmp_path, "bench_selection", rows, meta)))
        return e["own_ms"], e["own_kernel"]

    assert own(today) == (180.0, "hytopk_default")
    # A record naming the options before fields were added: a missing field ran its added
    # value (ADDED_SELECTION_FIELDS), so where those are today's defaults it ran today's.
    newer = ("scores_sm90_mma_ahead", "scores_sm90_stages", "scores_sm90_folded_part_major",
             "scores_sm90_direct_select")
    unnamed = {k: v for k, v in today["hytopk_default_options"].items() if k not in newer}
    still_today = all(getattr(default, f) == md.ADDED_SELECTION_FIELDS[f] for f in newer)
    assert own({"hytopk_default_options": unnamed}) == (
        (180.0, "hytopk_default") if still_today else (170.0, path_method))
    assert own(same_path) == (180.0, "hytopk_default")  # it ran the path's configuration
    assert own(other_path) == (170.0, path_method)
    assert own(triton) == (170.0, path_method)
    assert own(None) == (170.0, path_method)
    # Without the path's method: an older default that ran another Gluon method's path
    # ranks as that method, first; one that ran the Triton kernel (or unnamed options) after
    # the Gluon methods with today's sample table.
    rows.pop(3)
    assert own(other_path) == (180.0, "hytopk_default")
    assert own(triton) == (160.0, other_method)
    assert own(None) == (160.0, other_method)
    rows[2]["ms"] = 150.0
    assert own(triton) == (160.0, other_method)
    # A record from before a field existed ran its value of then (ADDED_SELECTION_FIELDS):
    # options naming neither the pick nor the slots (nor the later fields) ran torch.topk's
    # pick and the atomics.
    before = {k: v for k, v in named()["hytopk_default_options"].items()
              if k not in ("scores_sm90_sample_pick", "scores_sm90_scan_slots", *newer)}
    then = md.GLUON_METHODS[(default.scores_sm90_sample_table, "topk", False, False, 4, False,
                             False)]
    rows[3:] = [dict(pair[0], method=then, ms=160.0)]
    assert own({"hytopk_default_options": before}) == (150.0, "hytopk_default")
    assert own(triton) == (160.0, then)

    # Across records a method ranks alike whatever defaults each ran: a newer record of
    # today's defaults without a hytopk_default row displaces an older one's same method.
    path_rows = [*pair, dict(pair[0], method=path_method, ms=170.0)]
    old = md.entries_from(str(write_record(tmp_path, "bench_selection", path_rows)))
    new = md.entries_from(str(write_record(
        tmp_path, "bench_selection", [dict(r, ms=r["ms"] - 20) for r in path_rows], today)))
    for e in new:
        e["stamp"] = "9999"
    (kept,) = md.table(old + new)
    assert (kept["own_ms"], kept["own_kernel"]) == (150.0, path_method)


def test_measured_defaults_prefers_the_layers_key_order(tmp_path) -> None:
    """A record of today's defaults with both sides in key order (hytopk_default_key,
    cudnn_key: the layers' order) gives that pair, over its own score-order pair and over a
    newer record's; a record of older defaults gives its score-order pair only."""
    import dataclasses

    from megatron_hyscale.ops import HyTopKOptions

    md = load("measured_defaults")
    pair = SELECTION[:2]  # hytopk 300 ms, cudnn 200 ms, at 128K
    rows = [*pair, dict(pair[0], method="hytopk_default", ms=180.0),
            dict(pair[0], method="hytopk_default_key", ms=150.0),
            dict(pair[1], method="cudnn_key", ms=190.0)]
    today = {"hytopk_default_options": dataclasses.asdict(HyTopKOptions.DEFAULT)}
    older = {"hytopk_default_options": dataclasses.asdict(dataclasses.replace(
        HyTopKOptions.DEFAULT, scores_sm90_samples=HyTopKOptions.DEFAULT.scores_sm90_samples
        + 1))}

    def found(records, meta):
        return md.entries_from(str(write_record(tmp_path, "bench_selection", records, meta)))

    (kept,) = found(rows, today)  # one entry: the pair nearest the layers' call
    assert (kept["own_ms"], kept["library_ms"], kept["own_kernel"]) == (
        150.0, 190.0, "hytopk_default_key")
    newer = found(rows[:3], today)  # score order only, newer
    for e in newer:
        e["stamp"] = "9999"
    (kept,) = md.table(found(rows, today) + newer)
    assert kept["own_kernel"] == "hytopk_default_key"
    old = found(rows, older)
    assert [e["own_kernel"] for e in old] == ["hytopk_default"]  # its named options ran it
    without_lib = found(rows[:4], today)
    assert [e["own_kernel"] for e in without_lib] == ["hytopk_default"]


def test_measured_defaults_times_the_kernels_the_defaults_run(tmp_path) -> None:
    """Per side, the time of the kernel the defaults run now (a --*-also column whose relative
    difference is finite; a NaN one is a broken run), else the run's main kernel; FlashMLA's
    forward inside HyScale's function (--fwd-kernel flashmla) is never HyScale's time."""
    md = load("measured_defaults")
    fwd, bwd = md.CURRENT_KERNELS["fwd"], md.CURRENT_KERNELS["bwd"]
    base = {k: v for k, v in ATTENTION[0].items() if not k.startswith("tl_")}
    rows = [
        dict(base, T=1024, fwd_kernel="flashmla", fwd_ms=70.0, fwd_gluon_ws_kernel=fwd,
             fwd_gluon_ws_ms=85.0, fwd_gluon_ws_rel_diff=1e-3, bwd_kernel="older",
             bwd_ms=600.0, bwd_x_kernel=bwd, bwd_x_ms=350.0, bwd_x_rel_diff=2e-5),
        dict(base, T=2048, fwd_kernel="flashmla", fwd_ms=70.0, bwd_kernel="older",
             bwd_ms=600.0, bwd_x_kernel=bwd, bwd_x_ms=350.0, bwd_x_rel_diff=float("nan")),
    ]
    folder = tmp_path / "current"
    folder.mkdir()
    entries = md.table(md.entries_from(str(write_record(folder, "bench_attention", rows))))
    by_t = {e["T"]: e for e in entries}
    assert by_t[1024]["own_fwd_bwd_ms"] == [85.0, 350.0]
    assert by_t[1024]["own_kernels"] == [fwd, bwd]
    assert 2048 not in by_t  # no HyScale forward timed: no joined entry
    sides = [(e["side"], e["own_kernel"], e["own_ms"]) for e in md.entries_from(
        str(next(folder.iterdir()))) if e["T"] == 2048]
    assert sides == [("bwd", "older", 600.0)]  # the NaN run not taken: the main stands in


# --- the glue to megatron's TileLang entry points, with torch stand-ins for its kernels -------
# TileLang does not run here: megatron's kernel wrappers are replaced by plain-torch ones with
# their contracts (layouts, row bounds, -1 / -inf conventions), so what runs is the benchmarks'
# calls into megatron (layouts, causal bounds, blocks, the given-indices wrapper) and megatron's
# own loops around the kernels. Their results must equal HyScale's references on the same input.

def fake_logits(index_q, index_k, weights, ks, ke, use_relu=True):
    """TileLang's indexer_fwd_interface contract: fp32 [rows, S], -inf outside [ks, ke)."""
    s = torch.einsum("thd,sd->tsh", index_q.float(), index_k.float())
    s = (s.relu() if use_relu else s) * weights.float()[:, None, :]
    logits = s.sum(-1)
    cols = torch.arange(index_k.shape[0])[None, :]
    return logits.masked_fill((cols < ks[:, None]) | (cols >= ke[:, None]), float("-inf"))


def inputs(T, H, D, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, H, D, generator=g).to(dtype),
            torch.randn(1, T, D, generator=g).to(dtype),
            torch.rand(1, T, H, generator=g) * (H * D) ** -0.5)


def test_stock_tilelang_selection_glue_matches_hytopk(sel, monkeypatch) -> None:
    from megatron.core.transformer.experimental_attention_variant.ops import indexer, tilelang_dsa

    from megatron_hyscale.ops import hytopk

    calls = []

    def indices_only(index_q, index_k, index_w, ks, ke, topk, use_relu=True):
        calls.append((index_q.shape[0], int(ke[0]), int(ke[-1])))
        logits = fake_logits(index_q, index_k, index_w, ks, ke, use_relu)
        return indexer._select_topk_from_logits(logits, topk, mask_invalid=False)[1]

    monkeypatch.setattr(tilelang_dsa, "lighting_indexer_indices", indices_only)
    monkeypatch.setattr(sel, "TILELANG_BLOCK_ROWS", 16)  # 4 blocks of 16 rows
    q, k, w = inputs(64, 4, 32)
    got = sel.run_stock_tilelang(q, k, w, 8, True)
    assert calls == [(16, 1, 16), (16, 17, 32), (16, 33, 48), (16, 49, 64)]  # causal ends
    assert got.shape == (1, 64, 8) and got.dtype == torch.int32
    ref = hytopk(q, k, w, 8, relu=True, backend="reference")[0]
    assert (got[0, :7] < 0).sum(-1).tolist() == [7 - t for t in range(7)]  # -1 past visible
    assert torch.equal(got[0].long().sort(-1).values, ref[0].long().sort(-1).values)


class FakeSparseMLA:
    """SparseMLA.apply's contract: q [B, T, H, 576], kv [B, S, 1, 576], indices [B, T, 1, K]
    -> (out [B, T, H, 512], lse [B, T, H]); V is kv's first 512 channels."""

    seen: list = []

    @staticmethod
    def apply(q, kv, indices, scale):
        FakeSparseMLA.seen.append((tuple(q.shape), tuple(kv.shape), tuple(indices.shape)))
        idx = indices[0, :, 0].long()
        sel = kv[0, idx.clamp(min=0), 0].float()  # [T, K, 576]
        s = torch.einsum("thd,tkd->thk", q[0].float(), sel) * scale
        s = s.masked_fill((idx < 0)[:, None, :], float("-inf"))
        out = torch.einsum("thk,tkd->thd", s.softmax(-1), sel[..., :512])
        return out[None].to(q.dtype), torch.logsumexp(s, -1)[None]


def test_stock_tilelang_attention_glue_matches_hyscale(att, monkeypatch) -> None:
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_dsa

    from megatron_hyscale.ops.sparse_attention import sparse_attention

    monkeypatch.setattr(tilelang_dsa, "SparseMLA", FakeSparseMLA)
    FakeSparseMLA.seen.clear()
    T, H, K = 128, 16, 64
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, T, H, 576, generator=g).to(torch.bfloat16)
    k = torch.randn(1, T, 1, 576, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(T)])[None].int()
    out = att.tilelang_attention(q, k, idx, 576 ** -0.5, 512)
    assert FakeSparseMLA.seen == [((1, T, H, 576), (1, T, 1, 576), (1, T, 1, K))]
    ref = sparse_attention(q, k, None, idx, 576 ** -0.5, dv=512, backend="reference")
    assert out.shape == ref.shape == (1, T, H, 512)
    assert att.rel_err(out, ref) < 1e-2  # bf16 outputs
    with pytest.raises(RuntimeError, match="SparseMLA declined"):  # 48 heads: megatron declines
        att.tilelang_attention(q[:, :, :12].repeat(1, 1, 4, 1), k, idx, 576 ** -0.5, 512)


def test_stock_tilelang_loss_glue_matches_hyscale(loss, monkeypatch) -> None:
    from megatron.core.transformer.experimental_attention_variant.ops import indexer, tilelang_dsa

    from megatron_hyscale.ops.indexer_loss import indexer_kl_loss

    def lighting_indexer(index_q, index_k, weights, ks, ke, topk, topk_indices=None,
                         use_relu=True):  # differentiable by torch instead of TileLang's bwd
        logits = fake_logits(index_q, index_k, weights, ks, ke, use_relu)
        if topk_indices is None:
            return indexer._select_topk_from_logits(logits, topk)
        return indexer.pytorch_extract_topk_scores(logits, topk_indices), topk_indices

    monkeypatch.setattr(tilelang_dsa, "lighting_indexer", lighting_indexer)
    monkeypatch.setattr(loss, "TILELANG_BLOCK_ROWS", 16)  # 4 blocks: the wrapper finds each
    T, H_I, D_I, Hq, Dqk, K = 64, 8, 32, 4, 48, 8
    g = torch.Generator().manual_seed(2)
    q_index, k_index, _ = inputs(T, H_I, D_I, seed=3)
    x = dict(q_index=q_index.requires_grad_(),
             weights=(torch.randn(1, T, H_I, generator=g) * 0.3).to(torch.bfloat16)
             .requires_grad_(),
             k_index=k_index.requires_grad_(),
             query=torch.randn(1, T, Hq, Dqk, generator=g).to(torch.bfloat16),
             key=torch.randn(1, T, 1, Dqk, generator=g).to(torch.bfloat16))
    rows = []
    for t in range(T):  # distinct visible keys, -1 past the row's t + 1
        keys = torch.randperm(t + 1, generator=g)[:K]
        rows.append(torch.cat([keys, keys.new_full((K - keys.numel(),), -1)]))
    idx = torch.stack(rows)[None].int()
    scale = Dqk ** -0.5
    params = (x["q_index"], x["weights"], x["k_index"])
    got = loss.tilelang_loss(x, idx, scale)
    got_grads = torch.autograd.grad(got, params)
    assert tilelang_dsa.lighting_indexer is lighting_indexer  # the wrapper is removed again
    ref = indexer_kl_loss(*params, x["query"], x["key"], idx, scale, loss.LOSS_COEFF,
                          sparse=True, backend="reference")
    ref_grads = torch.autograd.grad(ref, params)
    assert got.item() == pytest.approx(ref.item(), rel=1e-4)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-4)


def test_measured_defaults_keeps_devices_apart(tmp_path) -> None:
    """Records of two devices give two entries for the same (op, shape, T), each from its own
    device's record, even where the other device's record is newer; the attention's sides are
    joined only within one device (an H100 forward never meets an H200 backward)."""
    md = load("measured_defaults")
    paths = []
    for device, date, own in (("NVIDIA H200", "2026-12-02 10:00 UTC", 300.0),
                              ("NVIDIA H100 80GB HBM3", "2026-12-03 10:00 UTC", 100.0)):
        folder = tmp_path / device.split()[1]
        folder.mkdir()
        rows = [dict(r, ms=own) if r["method"] == "hytopk" else r for r in SELECTION]
        path = write_record(folder, "bench_selection", rows)
        path.write_text(json.dumps({"meta": dict(META, device=device, date=date),
                                    "records": rows}))
        paths.append(path)
    # An H100 record with the backward only: no H100 attention entry, the H200's one stays.
    folder = tmp_path / "att"
    folder.mkdir()
    att = write_record(folder, "bench_attention", ATTENTION)
    bwd_only = [{k: v for k, v in ATTENTION[0].items() if not k.startswith("fwd")}]
    h100_att = folder / "2026-12-03-nvidia-h100-bench_attention-glm51.json"
    h100_att.write_text(json.dumps({"meta": dict(META, device="NVIDIA H100 80GB HBM3",
                                                 date="2026-12-03 10:00 UTC"),
                                    "records": bwd_only}))
    found = [e for p in (*paths, att, h100_att) for e in md.entries_from(str(p))]
    entries = md.table(found)
    sel = {e["device"]: e["own_ms"] for e in entries if e["op"] == "selection"}
    assert sel == {"NVIDIA H200": 300.0, "NVIDIA H100 80GB HBM3": 100.0}
    att_devices = [e["device"] for e in entries if e["op"] == "attention"]
    assert att_devices == [META["device"]]


def test_measured_defaults_names_the_method_of_todays_gluon_path() -> None:
    """bench_selection has a method running the Gluon path as today's HyTopKOptions.DEFAULT
    samples and filters (else the measured table would take another method's time for the
    default's): `GLUON_METHODS` names it, and bench_selection knows every name there."""
    from megatron_hyscale.ops import HyTopKOptions

    md, bench = load("measured_defaults"), load("bench_selection")
    path, others = md.gluon_path_methods(HyTopKOptions.DEFAULT)
    assert path and path not in others
    assert set(md.GLUON_METHODS.values()) <= set(bench.METHODS)
    # each key is what its method runs (bench_selection declares the fields once)
    default = dataclasses.asdict(HyTopKOptions.DEFAULT)
    for key, name in md.GLUON_METHODS.items():
        fields = {**bench.FIRST_GLUON_PATH, **bench.GLUON_SELECTIONS[name]}
        ran = {**default, **{f"scores_sm90_{k}": v for k, v in fields.items()}}
        assert md.gluon_key(ran) == key, name


def test_selection_rounds_rotate_and_merge_in_the_run(sel, monkeypatch, tmp_path) -> None:
    """bench_selection --rounds 2: at each length the methods run in rotated order (the
    comparisons and phases in the first round only), and the written records hold one record
    a method with the median of its rounds."""
    calls = []

    def bench_one(method, T, cfg, kind, rate, reps, extras=True):
        calls.append((T, method, extras))
        ms = 10.0 + len(calls)
        return {"method": method, "config": cfg, "T": T, "inputs": kind, "floor_ms": 1.0,
                "ms": ms, "mem_gib": 0.5, "x_floor": ms}

    written = fake_selection_run(sel, monkeypatch, bench_one, [
        "--methods", "hytopk", "hytopk_default", "--configs", "glm51", "--T", "16384", "32768",
        "--rounds", "2", "--out", str(tmp_path)])
    assert calls == [(16384, "hytopk", True), (16384, "hytopk_default", True),
                     (16384, "hytopk_default", False), (16384, "hytopk", False),
                     (32768, "hytopk", True), (32768, "hytopk_default", True),
                     (32768, "hytopk_default", False), (32768, "hytopk", False)]
    records = written[-1]
    assert [(r["T"], r["method"], r["ms_rounds"], r["ms"]) for r in records] == [
        (16384, "hytopk", [11.0, 14.0], 12.5), (16384, "hytopk_default", [12.0, 13.0], 12.5),
        (32768, "hytopk", [15.0, 18.0], 16.5), (32768, "hytopk_default", [16.0, 17.0], 16.5)]

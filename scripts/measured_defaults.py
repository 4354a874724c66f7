"""Regenerate megatron_hyscale/ops/backends/measured_defaults.json from benchmark records.

    python scripts/measured_defaults.py [RECORD.json ...]   # default: benchmarks/results/*.json

For each op the layers can run on a library kernel, takes every record where HyScale's own
kernel and the library's ran in the same run on the same shape and length, and keeps the
newest per (op, shape, T): bench_selection (methods hytopk / cudnn), bench_attention
(fwd_ms + bwd_ms against lib_fwd_ms + lib_bwd_ms, random indices), bench_indexer_loss (triton_lse /
cudnn, both with the attention's log-sum-exp). The layers then pick, per op and shape, the
faster of the two at the nearest measured length (ops/backends/measured.py).

Only HyScale's own kernels and its library backend enter the table: the stock baselines the
same runs measure (bench_selection's stock_cudnn and stock_tilelang, bench_attention's tl_*
TileLang columns, bench_indexer_loss's "tilelang" entry) are megatron-core's own paths, not
kernels HyScale can dispatch to, and are never read here.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_hyscale.ops.backends.measured import (  # noqa: E402
    TABLE_PATH,
    attention_shape,
    loss_shape,
    selection_shape,
)

# What each record names HyScale's own kernel and its library backend: (own, library). Every
# other method, column or entry of a record (stock baselines included) is ignored.
SELECTION_METHODS = ("hytopk", "cudnn")
ATTENTION_COLUMNS = (("fwd_ms", "bwd_ms"), ("lib_fwd_ms", "lib_bwd_ms"))
LOSS_ENTRIES = ("triton_lse", "cudnn")


def entries_from(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    meta, records = data.get("meta", {}), data.get("records", [])
    script = os.path.basename(path)
    out = []
    source = f"{script}, {meta.get('date', '?')}, commit {meta.get('commit', '?')}"
    stamp = meta.get("date", "")
    if "bench_selection" in script:
        # Sweep and variant records carry other fields; a single first call (reps 1, over 2 s)
        # may hold a JIT compile: neither is a comparison.
        by = {(r["config"], r["T"], r["inputs"], r["method"]): r for r in records
              if {"config", "T", "inputs", "method"} <= r.keys() and r.get("reps") != 1}
        own_method, lib_method = SELECTION_METHODS
        for (cfg, T, inputs, method), own in by.items():
            lib = by.get((cfg, T, inputs, lib_method))
            if method != own_method or inputs != "random" or not lib or "H" not in own:
                continue
            if isinstance(own.get("ms"), float) and isinstance(lib.get("ms"), float):
                out.append(dict(op="selection", T=T, own_ms=own["ms"], library_ms=lib["ms"],
                                shape=selection_shape(own["H"], own["D"], own["topk"]),
                                source=source, stamp=stamp))
    elif "bench_attention" in script:
        for r in records:
            if r.get("indices") != "random" or "Hq" not in r:
                continue
            shape = attention_shape(r["Hq"], r["Dqk"], r["Dv"], r["sink"])
            times = [r.get(k) for k in (*ATTENTION_COLUMNS[0], *ATTENTION_COLUMNS[1])]
            if all(isinstance(t, float) for t in times):
                out.append(dict(op="attention", T=r["T"], own_ms=times[0] + times[1],
                                library_ms=times[2] + times[3], shape=shape, source=source,
                                stamp=stamp, own_fwd_bwd_ms=times[:2],
                                library_fwd_bwd_ms=times[2:]))
    elif "bench_indexer_loss" in script:
        for r in records:
            own, lib = (r.get(k) for k in LOSS_ENTRIES)
            if isinstance(own, dict) and isinstance(lib, dict) and "Hq" in r:
                out.append(dict(op="indexer_loss", T=r["T"], own_ms=own["total_ms"],
                                library_ms=lib["total_ms"], source=source, stamp=stamp,
                                shape=loss_shape(r["Hq"], r["Dqk"], r["H_I"])))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", help="record files (default: benchmarks/results)")
    parser.add_argument("--out", type=Path, default=TABLE_PATH, help="table to write")
    args = parser.parse_args()
    paths = args.records or sorted(glob.glob(str(ROOT / "benchmarks/results/*.json")))
    newest: dict[tuple, dict] = {}
    for path in paths:
        for e in entries_from(path):
            key = (e["op"], e["shape"], e["T"])
            if key not in newest or e["stamp"] >= newest[key]["stamp"]:
                newest[key] = e
    entries = [{k: v for k, v in e.items() if k != "stamp"}
               for _, e in sorted(newest.items())]
    args.out.write_text(json.dumps({"generated_by": "scripts/measured_defaults.py",
                                    "entries": entries}, indent=1) + "\n")
    for e in entries:
        pick = "library" if e["library_ms"] < e["own_ms"] else "own"
        print(f"{e['op']:14s} {e['shape']:22s} T={e['T']:>8d} own {e['own_ms']:9.1f} ms  "
              f"library {e['library_ms']:9.1f} ms  -> {pick}")
    print(f"wrote {len(entries)} entries to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

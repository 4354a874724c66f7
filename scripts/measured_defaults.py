"""Regenerate megatron_hyscale/ops/backends/measured_defaults.json from benchmark records.

    python scripts/measured_defaults.py [RECORD.json ...]   # default: benchmarks/results/*.json

For each op the layers can run on a library kernel, takes every record where HyScale's own
kernel and the library's ran in the same run on the same shape and length, and keeps the
newest per (op, shape, T): bench_selection (HyScale's default selection / cudnn; in key
order, the layers', where a record of today's defaults timed both, `KEY_ORDER_PAIR`),
bench_attention (per side, random indices: the forward the defaults run against lib_fwd_ms,
FlashMLA's; the backward against lib_bwd_ms, cuDNN's; each side from the newest record that
timed the default kernel, else the newest older one, `own_kernels` says which),
bench_indexer_loss (triton_lse / cudnn, both with the attention's log-sum-exp). The layers
then pick, per op and shape, the faster at the nearest measured length
(ops/backends/measured.py); for the attention, the fastest of the library pair, FlashMLA's
forward with HyScale's backward, and HyScale's pair.

Only HyScale's own kernels and its library backend enter the table: the stock baselines the
same runs measure (bench_selection's stock_cudnn and stock_tilelang, bench_attention's tl_*
TileLang columns, bench_indexer_loss's "tilelang" entry) are megatron-core's own paths, not
kernels HyScale can dispatch to, and are never read here.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_hyscale.ops.backends import measured  # noqa: E402
from megatron_hyscale.ops.backends.measured import (  # noqa: E402
    TABLE_PATH,
    attention_shape,
    loss_shape,
    selection_shape,
)
from megatron_hyscale.ops.kernels.options import (  # noqa: E402
    AttentionKernelOptions,
    HyTopKOptions,
)

# What each record names HyScale's own kernel and its library backend. Every other method,
# column or entry of a record (stock baselines included) is ignored. The own selection: what
# ops.hytopk runs by default, as timed (hytopk_default) where the record's defaults are
# today's, else the method that runs what today's default runs at that length
# (`own_selection_methods`); the library's: cuDNN's.
LIBRARY_SELECTION_METHOD = "cudnn"
# The pair in the layers' order (key order: no sort by score on either side), timed by records
# since 2026-12-07: today's default in key order ranks first among the own methods, against
# cuDNN's rows in key order.
KEY_ORDER_PAIR = ("hytopk_default_key", "cudnn_key")
# The HyTopKOptions fields that tell bench_selection's Gluon-path methods apart (`gluon_key`):
# the sample's table, its threshold pick, the filter's slots, its product ahead, its ring, the
# folded parts' layout, the select without compaction.
GLUON_FIELDS = ("scores_sm90_sample_table", "scores_sm90_sample_pick", "scores_sm90_scan_slots",
                "scores_sm90_mma_ahead", "scores_sm90_stages", "scores_sm90_folded_part_major",
                "scores_sm90_direct_select")
# Those methods by GLUON_FIELDS' values. Newest first: where a record lacks the default's
# method, the nearest one it has stands for it (in key order, the layers', each was timed
# slower than the next newer one on an H100, same runs; in score order within a few percent
# of it; the product ahead, the parts part-major and the direct select timed in key order on
# 2026-12-07).
GLUON_METHODS = {(True, "radix", True, True, 4, True, True): "hytopk_scores_sm90_current",
                 (True, "radix", True, False, 4, True, False): "hytopk_scores_sm90_part_major",
                 (True, "radix", True, True, 4, False, False): "hytopk_scores_sm90_ahead",
                 (True, "radix", True, False, 4, False, False): "hytopk_scores_sm90_scan_slots",
                 (True, "radix", False, False, 4, False, False):
                     "hytopk_scores_sm90_radix_pick",
                 (True, "topk", False, False, 4, False, False): "hytopk_scores_sm90_gluon_sample",
                 (False, "topk", False, False, 4, False, False): "hytopk_scores_sm90"}
# The attention's own times are those of the kernels the defaults run (a record names the
# kernel of each time); lib_fwd_ms / lib_bwd_ms are FlashMLA's forward and cuDNN's backward.
LIBRARY_FORWARD = "flashmla"
CURRENT_KERNELS = {"fwd": AttentionKernelOptions.DEFAULT.forward_kernel_name(),
                   "bwd": AttentionKernelOptions.DEFAULT.backward_kernel_name()}
LOSS_ENTRIES = ("triton_lse", "cudnn")


def own_times(r: dict, side: str) -> dict[str, float]:
    """{kernel name: ms} of HyScale's kernels a bench_attention row timed for `side` ("fwd" or
    "bwd"): the main one first, then the --fwd-also / --bwd-also ones whose outputs agreed with
    it (a finite relative difference; a NaN, or null since records are strict JSON, marks a
    broken run)."""
    times = {}
    if isinstance(r.get(f"{side}_ms"), float):  # records before 2026-12-05 name no kernel
        times[r.get(f"{side}_kernel", "unnamed")] = r[f"{side}_ms"]
    # FlashMLA's forward inside HyScale's function (`--fwd-kernel flashmla`) is the library's.
    times.pop(LIBRARY_FORWARD, None)
    for key, kernel in r.items():
        prefix = f"{side}_"
        if kernel == LIBRARY_FORWARD:
            continue
        if not (key.startswith(prefix) and key.endswith("_kernel")) or key == f"{side}_kernel":
            continue
        name = key[len(prefix):-len("_kernel")]
        ms, diff = r.get(f"{prefix}{name}_ms"), r.get(f"{prefix}{name}_rel_diff")
        if isinstance(ms, float) and isinstance(diff, float) and math.isfinite(diff):
            times.setdefault(kernel, ms)
    return times


# HyTopKOptions fields added after records began naming the defaults they ran (2026-12-06), at
# the value that matches what those records' defaults did. scores_sm90_sample_min_rank's 48
# grows the sample only past 128K keys at top-2048, longer than every such record's rows.
ADDED_SELECTION_FIELDS = {"scores_sm90_sample_min_rank": 48,
                          "scores_sm90_sample_pick": "topk", "scores_sm90_scan_slots": False,
                          "scores_sm90_folded_min_keys": None, "scores_sm90_mma_ahead": False,
                          "scores_sm90_stages": 4, "scores_sm90_folded_part_major": False,
                          "scores_sm90_direct_select": False}


def gluon_key(options: dict) -> tuple:
    """GLUON_METHODS' key of HyTopKOptions fields given as a dict."""
    return tuple(options.get(name) for name in GLUON_FIELDS)


def default_options_ran(meta: dict) -> dict | None:
    """The HyTopKOptions fields a bench_selection record's hytopk_default ran (its meta's
    hytopk_default_options, named since 2026-12-06; a field added since at
    `ADDED_SELECTION_FIELDS`' value), or None where the record names none."""
    named = meta.get("hytopk_default_options")
    return {**ADDED_SELECTION_FIELDS, **named} if isinstance(named, dict) else None


def current_defaults(meta: dict) -> bool:
    """Whether a bench_selection record's hytopk_default ran today's HyTopKOptions.DEFAULT
    (`default_options_ran`; records naming none are not trusted)."""
    today = json.loads(json.dumps(dataclasses.asdict(HyTopKOptions.DEFAULT)))
    return default_options_ran(meta) == today


def older_default_method(meta: dict, keys: int, relu: bool = True) -> str | None:
    """The bench_selection method running what a record's hytopk_default ran over `keys` keys
    (its meta's hytopk_default_options, fields added since at `ADDED_SELECTION_FIELDS`): a
    `GLUON_METHODS` entry, "hytopk" (the Triton kernel), or None (the record names no
    options, or its default's Gluon path has no method)."""
    opts = default_options_ran(meta)
    if opts is None:
        return None
    min_keys = opts.get("scores_sm90_min_keys") if relu else opts["scores_sm90_folded_min_keys"]
    if opts.get("scores_sm90") is False or min_keys is None or keys < min_keys:
        return "hytopk"
    return GLUON_METHODS.get(gluon_key(opts))


def own_selection_methods(keys: int, defaults_current: bool = True,
                          relu: bool = True) -> tuple[str, ...]:
    """The methods whose time stands for HyScale's default selection over `keys` keys, best
    first: where the record ran today's defaults, hytopk_default_key (the layers' order,
    against cuDNN's in key order: `library_method`), then hytopk_default; the method running
    today's default path (on Hopper from HyTopKOptions.scores_sm90_min_keys keys, without ReLU
    from scores_sm90_folded_min_keys, None: never, the Gluon path with the sample and slots
    the default takes, `GLUON_METHODS`; the records that hold it ran on Hopper, else the
    Triton kernel); on the Gluon path, the other Gluon methods with the default's sample
    table, newest first (the same path but an older pick or slots: nearer
    today's than an older default, which may have run the Triton kernel at that length);
    hytopk_default of older defaults; the Gluon methods with the other sample table; the
    Triton kernel (hytopk). Fixed slots ("" where a record has no such method), so a method
    has the same rank in every record and the newer of two equal ranks wins (`table`)."""
    default = HyTopKOptions.DEFAULT
    path, others = gluon_path_methods(default)
    same_table = [key[0] == default.scores_sm90_sample_table for key in GLUON_METHODS]
    near = tuple(m if same else "" for m, same in zip(others, same_table, strict=True))
    far = tuple("" if same else m for m, same in zip(others, same_table, strict=True))
    min_keys = default.scores_sm90_min_keys if relu else default.scores_sm90_folded_min_keys
    gluon = default.scores_sm90 is not False and min_keys is not None and keys >= min_keys
    if not gluon:
        path, near, far = "hytopk", ("",) * len(near), ("",) * len(far)
    current = KEY_ORDER_PAIR[0], "hytopk_default"
    return (*(current if defaults_current else ("", "")), path, *near,
            "" if defaults_current else "hytopk_default", *far, "hytopk")


def library_method(own_method: str) -> str:
    """The library method an own selection method is compared with: cuDNN's in the same order
    (key order for `KEY_ORDER_PAIR`'s, else score order)."""
    return KEY_ORDER_PAIR[1] if own_method == KEY_ORDER_PAIR[0] else LIBRARY_SELECTION_METHOD


def gluon_path_methods(options: HyTopKOptions) -> tuple[str, tuple[str, ...]]:
    """The bench_selection method running the Gluon path with options' sample ("" if none
    does), and every Gluon method in `GLUON_METHODS`' order with that one's slot left ""."""
    key = gluon_key(dataclasses.asdict(options))
    return (GLUON_METHODS.get(key, ""),
            tuple("" if k == key else m for k, m in GLUON_METHODS.items()))


def entries_from(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    meta, records = data.get("meta", {}), data.get("records", [])
    script = os.path.basename(path)
    out = []
    source = f"{script}, {meta.get('date', '?')}, commit {meta.get('commit', '?')}"
    stamp = meta.get("date", "")
    # A record naming no device gives entries that match any (measured.py).
    device = meta.get("device")
    if "bench_selection" in script:
        # Sweep and variant records carry other fields; a single first call (reps 1, over 2 s)
        # may hold a JIT compile: neither is a comparison.
        by = {(r["config"], r["T"], r["inputs"], r["method"]): r for r in records
              if {"config", "T", "inputs", "method"} <= r.keys() and r.get("reps") != 1}
        defaults_current = current_defaults(meta)

        def timed(cfg: str, T: int, inputs: str, method: str) -> bool:
            return isinstance(by.get((cfg, T, inputs, method), {}).get("ms"), float)

        for (cfg, T, inputs, method), own in by.items():
            keys, relu = own.get("S", T), own.get("relu", True)
            own_methods = own_selection_methods(keys, defaults_current, relu)
            order = [m for m in own_methods if m]
            ranks = {m: len(own_methods) - i for i, m in enumerate(own_methods) if m}
            # An older default that ran one of the methods ranks as that method, first.
            ran = None if defaults_current else older_default_method(meta, keys, relu)
            if ran in ranks:
                order.remove("hytopk_default")
                order.insert(order.index(ran), "hytopk_default")
                ranks["hytopk_default"] = ranks[ran]
            if method not in ranks or inputs != "random" or "H" not in own:
                continue
            # the first own method the record timed at this length with its library method
            # (an OOM row has no time)
            first = next((m for m in order if timed(cfg, T, inputs, m)
                          and timed(cfg, T, inputs, library_method(m))), None)
            if first != method:
                continue
            lib = by[(cfg, T, inputs, library_method(method))]
            # rank: an entry of a method nearer the default wins over a newer one of a
            # farther method (a Triton-only record must not displace the Gluon path's time)
            out.append(dict(op="selection", T=T, own_ms=own["ms"], library_ms=lib["ms"],
                            shape=selection_shape(own["H"], own["D"], own["topk"]),
                            own_kernel=method, rank=ranks[method], source=source,
                            stamp=stamp, device=device))
    elif "bench_attention" in script:
        for r in records:
            if r.get("indices") != "random" or "Hq" not in r:
                continue
            shape = attention_shape(r["Hq"], r["Dqk"], r["Dv"], r["sink"])
            for side in ("fwd", "bwd"):
                lib = r.get(f"lib_{side}_ms")
                own = own_times(r, side)
                if not isinstance(lib, float) or not own:
                    continue
                name = CURRENT_KERNELS[side]
                # Without the default's time, the run's main kernel stands in (the default
                # when it was recorded; a faster --*-also variant may be off by default).
                kernel, ms = (name, own[name]) if name in own else next(iter(own.items()))
                out.append(dict(op="attention", side=side, T=r["T"], shape=shape, own_ms=ms,
                                library_ms=lib, own_kernel=kernel, current=kernel == name,
                                source=source, stamp=stamp, device=device))
    elif "bench_indexer_loss" in script:
        for r in records:
            own, lib = (r.get(k) for k in LOSS_ENTRIES)
            if isinstance(own, dict) and isinstance(lib, dict) and "Hq" in r:
                out.append(dict(op="indexer_loss", T=r["T"], own_ms=own["total_ms"],
                                library_ms=lib["total_ms"], source=source, stamp=stamp,
                                shape=loss_shape(r["Hq"], r["Dqk"], r["H_I"]),
                                device=device))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", help="record files (default: benchmarks/results)")
    parser.add_argument("--out", type=Path, default=TABLE_PATH, help="table to write")
    args = parser.parse_args()
    paths = args.records or sorted(glob.glob(str(ROOT / "benchmarks/results/*.json")))
    entries = table([e for path in paths for e in entries_from(path)])
    args.out.write_text(json.dumps({"generated_by": "scripts/measured_defaults.py",
                                    "entries": entries}, indent=1) + "\n")
    for e in entries:
        if e["op"] == "attention":
            pick = measured.plan_for(e)
        else:
            pick = "library" if e["library_ms"] < e["own_ms"] else "own"
        print(f"{e.get('device', '?')[:20]:20s} {e['op']:14s} {e['shape']:22s} T={e['T']:>8d} "
              f"own {e['own_ms']:9.1f} ms  "
              f"library {e['library_ms']:9.1f} ms  -> {pick}")
    print(f"wrote {len(entries)} entries to {args.out}")
    return 0


def _rank(entry: dict) -> tuple:
    """Which of two entries for one key the table keeps: the larger (the attention's kernels
    the defaults run, the selection's method nearest the default, then the newer)."""
    return entry.get("current", True), entry.get("rank", 0), entry["stamp"]


def table(found: list[dict]) -> list[dict]:
    """The newest entry per (device, op, shape, T); for the selection, the newest of the method
    nearest the default (`own_selection_methods`: rank); for the attention, per side, the newest
    that timed the kernels the defaults run now (`CURRENT_KERNELS`), else the newest of older
    ones, the two sides (of the same device) joined into one entry where both were measured.
    Devices stay apart: a kernel's rank against the library differs between an H100 and an
    H200 (memory bandwidth), and the layers read the running device's entries."""
    newest: dict[tuple, dict] = {}
    for e in found:
        key = (e["op"], e["shape"], e["T"], e.get("side"), e["device"] or "")
        if key not in newest or _rank(e) >= _rank(newest[key]):
            newest[key] = e
    entries = []
    for (op, shape, T, side, device), e in sorted(newest.items(), key=lambda kv: str(kv[0])):
        if op != "attention":
            entries.append({k: v for k, v in e.items() if k not in ("stamp", "rank")})
        elif side == "fwd" and (op, shape, T, "bwd", device) in newest:
            b = newest[(op, shape, T, "bwd", device)]
            source = (e["source"] if e["source"] == b["source"]
                      else f"forward: {e['source']}; backward: {b['source']}")
            entries.append(dict(op=op, T=T, own_ms=e["own_ms"] + b["own_ms"],
                                library_ms=e["library_ms"] + b["library_ms"], shape=shape,
                                source=source, own_fwd_bwd_ms=[e["own_ms"], b["own_ms"]],
                                library_fwd_bwd_ms=[e["library_ms"], b["library_ms"]],
                                own_kernels=[e["own_kernel"], b["own_kernel"]],
                                device=device))
    for e in entries:
        if not e.get("device"):
            e.pop("device", None)
    return sorted(entries, key=lambda e: (e.get("device", ""), e["op"], e["shape"], e["T"]))


if __name__ == "__main__":
    raise SystemExit(main())

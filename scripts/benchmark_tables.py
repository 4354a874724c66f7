"""Markdown tables for BENCHMARKS.md from benchmark records (benchmarks/results/*.json).

    python scripts/benchmark_tables.py RECORD.json [RECORD.json ...]

One table per record, HyScale beside the strongest stock kernels measured in the same run:
bench_selection (HyTopK, cuDNN's chunked scores + radix top-k through HyScale's backend,
megatron-core's own cudnn and tilelang selections, table-then-select, the GEMM floor),
bench_attention (HyScale's forward / backward against FlashMLA's / cuDNN's and megatron-core's
TileLang sparse MLA), bench_attention_bwd_sweep (the backward kernels per tiling and variant),
bench_indexer_loss (Triton against cuDNN's kernels, both given the
attention's lse, and megatron-core's TileLang loss), bench_layer (HyScale's layer against
each stock backend; with `--packed`, a second table of the packed THD rows against the unpacked
ones: per-token time, causal key pairs, and whether HyScale's own path ran) and accuracy (each
tensor's error against float64, HyScale's and stock's). A column whose method is not in the
record shows "-". Each table names its record, commit, command and the matmul rate it was
measured against; nothing in it is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re


def fmt(x, spec=".1f", missing="-"):
    if isinstance(x, (int, float)) and x == x:
        return format(x, spec)
    return missing if x is None else str(x)


def ratio(a, b):
    """b / a: how many times faster a is than b (None without both)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0:
        return f"{b / a:.2f}x"
    return "-"


def selection(records):
    by = {(r["config"], r["T"], r["method"]): r for r in records if r.get("inputs") == "random"}
    keys = sorted({(c, T) for c, T, _ in by})
    lines = ["| config | T | GEMM floor ms | HyTopK ms (GiB) | cuDNN chunks + top-k ms (GiB) |"
             " megatron cudnn selection ms | megatron tilelang selection ms (GiB) |"
             " table-then-select ms | HyTopK speed vs cuDNN | HyTopK speed vs TileLang |"
             " rows equal to HyTopK's (cuDNN / TileLang) |", "|---" * 11 + "|"]
    for cfg, T in keys:
        def get(m, key="ms", cfg=cfg, T=T):
            return (by.get((cfg, T, m)) or {}).get(key)

        def ms(m):
            first = " *" if get(m, "reps") == 1 else ""  # one call over 2 s: no median
            return f"{fmt(get(m))}{first}" if get(m) else fmt(get(m, "status"))

        def cell(m):
            return f"{ms(m)} ({fmt(get(m, 'mem_gib'), '.2f')})" if get(m) else ms(m)

        def speed(m):
            return "-" if get(m, "reps") == 1 else ratio(get("hytopk"), get(m))

        same = " / ".join(fmt(get(m, "same_rows_as_hytopk"), ".2%")
                          for m in ("cudnn", "stock_tilelang"))
        floor = fmt(get("hytopk", "floor_ms") or get("stock_tilelang", "floor_ms"))
        lines.append(f"| {cfg} | {T} | {floor} | {cell('hytopk')} | "
                     f"{cell('cudnn')} | {ms('stock_cudnn')} | {cell('stock_tilelang')} | "
                     f"{ms('table')} | {speed('cudnn')} | {speed('stock_tilelang')} | "
                     f"{same} |")
    if any(r.get("reps") == 1 for r in records):
        lines.append("\n\\* a single first call (over 2 s), no median: it may hold JIT compiles")
    return (lines + kernel_variants(records) + fp8_selection(records) + scores_only(records)
            + scores_sm90_phases(records))


def scores_sm90_phases(records):
    """HyTopK on the Gluon scores (bench_selection's hytopk_scores_sm90): its time, the share of
    rows redone by the Triton kernel, and its phases timed apart."""
    rows = [r for r in records if r.get("method") == "hytopk_scores_sm90" and r.get("ms")]
    if not rows:
        return []
    lines = ["", "| config | T | on the Gluon scores ms | x GEMM floor | rows redone | "
             "sample ms | filter ms | select ms | rest ms | torch.topk select ms | "
             "sample on the Gluon table ms |",
             "|---" * 11 + "|"]
    for r in sorted(rows, key=lambda r: (r["config"], r["T"])):
        ph = r.get("phase_ms") or {}
        parts = [ph.get(n) for n in ("sample", "filter", "select")]
        rest = r["ms"] - sum(parts) if all(isinstance(p, float) for p in parts) else None
        lines.append(f"| {r['config']} | {r['T']} | {fmt(r['ms'])} | "
                     f"{fmt(r.get('x_floor'), '.2f')} | {fmt(r.get('redone_rows_share'), '.2%')} | "
                     + " | ".join(fmt(p) for p in parts)
                     + f" | {fmt(rest)} | {fmt(ph.get('select_torch'))} | "
                     f"{fmt(ph.get('sample_gluon'))} |")
    return lines


def scores_only(records):
    """The scores-only kernels (bench_selection's scoreonly* methods: each causal row's largest
    score, no top-k) beside the GEMM floor, and each one's largest difference from the Triton
    scores-only kernel's row maxima."""
    rows = [r for r in records if r.get("method", "").startswith("scoreonly")]
    if not rows:
        return []
    lines = ["", "| config | T | GEMM floor ms | method | ms | x GEMM floor | "
             "max diff vs scoreonly |", "|---" * 7 + "|"]
    for r in sorted(rows, key=lambda r: (r["config"], r["T"])):
        lines.append(f"| {r['config']} | {r['T']} | {fmt(r.get('floor_ms'))} | {r['method']} | "
                     f"{fmt(r.get('ms'), '.2f')} | {fmt(r.get('x_floor'), '.2f')} | "
                     f"{fmt(r.get('max_diff_vs_scoreonly'), '.1e')} |")
    return lines


# bench_selection methods the two tables above show; any other hytopk_* method is a variant.
SHOWN_METHODS = {"hytopk", "hytopk_fp8", "hytopk_fp8_promote32"}


def kernel_variants(records):
    """HyTopK's kernel variants (hytopk_* methods, HyTopKOptions) beside the default of the same
    run: time, its ratio to the default, and whether every row equals the default's."""
    by = {(r["config"], r["T"], r["method"]): r for r in records if "method" in r}
    methods = list(dict.fromkeys(m for _, _, m in by
                                 if m.startswith("hytopk_") and m not in SHOWN_METHODS))
    if not methods:
        return []
    lines = ["", "| config | T | HyTopK ms | " + " | ".join(f"{m} ms (speed-up, rows equal)"
                                                         for m in methods) + " |",
             "|---" * (3 + len(methods)) + "|"]
    for cfg, T in sorted({(c, T) for c, T, _ in by}):
        base = (by.get((cfg, T, "hytopk")) or {}).get("ms")
        cells = []
        for m in methods:
            r = by.get((cfg, T, m)) or {}
            same = {True: "yes", False: "NO"}.get(r.get("same_as_hytopk"), "-")
            if "same_rows_as_hytopk" in r:  # not bitwise: how many rows hold the same set
                same += f", sets {r['same_rows_as_hytopk']:.4%}"
            cells.append(f"{fmt(r.get('ms'))} ({ratio(r.get('ms'), base)}, {same})")
        lines.append(f"| {cfg} | {T} | {fmt(base)} | " + " | ".join(cells) + " |")
    return lines


def row_sort_micro(records):
    """bench_selection --row-sort-micro: the row output alone per HyTopKOptions.row_sort, and
    torch.sort of the same keys."""
    lines = ["| method | rows x topk | ms | same as the default |", "|---" * 4 + "|"]
    for r in records:
        same = {True: "yes", False: "NO"}.get(r.get("same_as_default"), "-")
        lines.append(f"| {r['method']} | {r['rows']} x {r['topk']} | {fmt(r['ms'], '.2f')} | "
                     f"{same} |")
    return lines


def indexer_loss_variants(records):
    """bench_indexer_loss --variants: the row pass, the backward kernel and both (or the fused
    kernel) per IndexerLossKernelOptions variant beside the default of the same run."""
    names = list(dict.fromkeys(k for r in records for k in r if k not in ("shape", "T")))
    lines = ["| shape | T | variant | row pass ms | backward ms | both ms (speed-up) | KL rel."
             " diff | dk max diff |", "|---" * 8 + "|"]
    for r in sorted(records, key=lambda r: (r["shape"], r["T"])):
        base = r["default"]["rows_bwd_ms"]
        for n in names:
            v = r.get(n)
            if not isinstance(v, dict):
                lines.append(f"| {r['shape']} | {r['T']} | {n} | {v or '-'} | | | | |")
                continue
            lines.append(f"| {r['shape']} | {r['T']} | {n} | {fmt(v['rows_ms'])} | "
                         f"{fmt(v['bwd_kernel_ms'])} | {fmt(v['rows_bwd_ms'])} "
                         f"({ratio(v['rows_bwd_ms'], base)}) | "
                         f"{fmt(v.get('kl_sum_rel_diff'), '.1e')} | "
                         f"{fmt(v.get('dk_max_abs_diff'), '.1e')} |")
    return lines


def indexer_loss_dense(records):
    """bench_indexer_loss_dense: the dense (warm-up) loss, Triton against the reference."""
    lines = ["| shape | T | Triton fwd + bwd ms (GiB) | / matmul | reference fwd + bwd ms (GiB) |"
             " Triton speed-up | loss rel. diff | k_index grad rel. L2 |", "|---" * 8 + "|"]
    for r in sorted(records, key=lambda r: (r["shape"], r["T"])):
        t, ref, acc = r.get("triton") or {}, r.get("reference") or {}, r.get("accuracy") or {}
        lines.append(f"| {r['shape']} | {r['T']} | {fmt(t.get('fwd_bwd_ms'))} "
                     f"({fmt(t.get('peak_gib'), '.2f')}) | {fmt(r.get('frac_matmul'), '.0%')} | "
                     f"{fmt(ref.get('fwd_bwd_ms'))} ({fmt(ref.get('peak_gib'), '.2f')}) | "
                     f"{ratio(t.get('fwd_bwd_ms'), ref.get('fwd_bwd_ms'))} | "
                     f"{fmt(acc.get('loss_rel'), '.1e')} | "
                     f"{fmt(acc.get('k_index_rel_l2'), '.1e')} |")
    return lines


def fp8_selection(records):
    """HyTopK's fp8 selection beside the bf16 one, per input kind (random and trained-like):
    time against the bf16 GEMM floor (issue #21's goal: 0.65x at 128K) and the share of the
    bf16 selection it keeps. No lines for a record without fp8 rows."""
    by = {(r["inputs"], r["config"], r["T"], r["method"]): r for r in records if "inputs" in r}
    keys = sorted({(i, c, T) for i, c, T, m in by if m == "hytopk_fp8"})
    if not keys:
        return []
    lines = ["", "| inputs | config | T | bf16 HyTopK ms | fp8 HyTopK ms | fp8 x bf16 floor "
             "(goal) | of which quantization ms | fp8 speed vs bf16 | fp8 rows' share of the "
             "bf16 selection | promote-every-32 ms (share) | fp8 score-only ms |",
             "|---" * 11 + "|"]
    for key in keys:
        def get(m, field="ms", key=key):
            return (by.get(key + (m,)) or {}).get(field)

        lines.append(
            f"| {' | '.join(map(str, key))} | {fmt(get('hytopk'))} | {fmt(get('hytopk_fp8'))} | "
            f"{fmt(get('hytopk_fp8', 'x_floor'), '.2f')} "
            f"({fmt(get('hytopk_fp8', 'goal_x_floor'), '.2f')}) | "
            f"{fmt(get('hytopk_fp8', 'quant_ms'))} | {ratio(get('hytopk_fp8'), get('hytopk'))} | "
            f"{fmt(get('hytopk_fp8', 'overlap_vs_bf16'), '.2%')} | "
            f"{fmt(get('hytopk_fp8_promote32'))} "
            f"({fmt(get('hytopk_fp8_promote32', 'overlap_vs_bf16'), '.2%')}) | "
            f"{fmt(get('scoreonly_fp8'))} |")
    return lines


def attention(records):
    lines = ["| shape | T | HyScale fwd ms (/ matmul) | FlashMLA fwd ms (/ matmul) |"
             " TileLang fwd ms (/ matmul) | HyScale bwd ms (/ matmul) | cuDNN bwd ms (/ matmul) |"
             " TileLang bwd ms (/ matmul) | fwd: HyScale vs FlashMLA | bwd: HyScale vs cuDNN |"
             " fwd: HyScale vs TileLang | bwd: HyScale vs TileLang |", "|---" * 12 + "|"]
    for r in sorted(records, key=lambda r: (r["shape"], r["T"])):
        def pair(k, r=r):
            return f"{fmt(r.get(k + '_ms'), '.1f')} ({fmt(r.get(k + '_frac'), '.0%')})"

        lines.append(f"| {r['shape']} | {r['T']} | {pair('fwd')} | {pair('lib_fwd')} | "
                     f"{pair('tl_fwd')} | {pair('bwd')} | {pair('lib_bwd')} | "
                     f"{pair('tl_bwd')} | "
                     f"{ratio(r.get('fwd_ms'), r.get('lib_fwd_ms'))} | "
                     f"{ratio(r.get('bwd_ms'), r.get('lib_bwd_ms'))} | "
                     f"{ratio(r.get('fwd_ms'), r.get('tl_fwd_ms'))} | "
                     f"{ratio(r.get('bwd_ms'), r.get('tl_bwd_ms'))} |")
    return lines + attention_also(records)


def attention_also(records):
    """bench_attention --fwd-also / --bwd-also: the other kernels timed in the same process on
    the same inputs, beside the main one and the library's (FlashMLA forward, cuDNN
    backward)."""
    lines = []
    for part, lib in (("fwd", "FlashMLA"), ("bwd", "cuDNN")):
        names = sorted({m.group(1) for r in records for key in r
                        for m in [re.fullmatch(rf"{part}_(\w+)_kernel", key)] if m})
        if not names:
            continue
        lines += ["", f"| shape | T | {part} kernel | {part} ms (/ matmul) | {lib} {part} ms | "
                  + " | ".join(f"{n}: kernel, ms (/ matmul), speed-up, vs {lib}, rel. diff"
                               for n in names) + " |", "|---" * (5 + len(names)) + "|"]
        for r in sorted(records, key=lambda r: (r["shape"], r["T"])):
            cells = [f"{r.get(f'{part}_{n}_kernel', '-')}, "
                     f"{fmt(r.get(f'{part}_{n}_ms'), '.1f')} "
                     f"({fmt(r.get(f'{part}_{n}_frac'), '.0%')}), "
                     f"{ratio(r.get(f'{part}_{n}_ms'), r.get(f'{part}_ms'))}, "
                     f"{ratio(r.get(f'{part}_{n}_ms'), r.get(f'lib_{part}_ms'))}, "
                     f"{fmt(r.get(f'{part}_{n}_rel_diff'), '.1e')}" for n in names]
            lines.append(f"| {r['shape']} | {r['T']} | {r.get(f'{part}_kernel', '-')} | "
                         f"{fmt(r.get(f'{part}_ms'), '.1f')} "
                         f"({fmt(r.get(f'{part}_frac'), '.0%')}) | "
                         f"{fmt(r.get(f'lib_{part}_ms'), '.1f')} | " + " | ".join(cells) + " |")
    return lines


def indexer_loss(records):
    lines = ["| shape | T | Triton fwd + bwd ms | Triton, attention lse given | target from the"
             " dQ kernel: its cost in the attention backward + loss + backward ms | cuDNN kernels,"
             " lse given | TileLang fwd + bwd ms (its score-table pass) | HyScale vs cuDNN |"
             " HyScale (lse given) vs TileLang | loss Triton / cuDNN / TileLang |",
             "|---" * 10 + "|"]
    for r in sorted(records, key=lambda r: (r["shape"], r["T"])):
        t, tl, c = r.get("triton") or {}, r.get("triton_lse"), r.get("cudnn")
        g = r.get("tilelang")
        tl = tl if isinstance(tl, dict) else {}
        c_ms = c.get("total_ms") if isinstance(c, dict) else c
        g_total = g.get("total_ms") if isinstance(g, dict) else None
        g_ms = (f"{fmt(g_total)} ({fmt(g.get('scores_ms'))})" if isinstance(g, dict)
                else fmt(g) if g in (None, "OOM") else "not run")
        if isinstance(c, dict) or isinstance(g, dict):
            losses = " / ".join(fmt(v.get("loss"), ".6g") if isinstance(v, dict) else "-"
                                for v in (tl or t, c, g))
        else:
            losses = "-"
        lines.append(f"| {r['shape']} | {r['T']} | {fmt(t.get('total_ms'))} | "
                     f"{fmt(tl.get('total_ms'))} | {fmt(r.get('from_dq_loss_ms'))} | "
                     f"{fmt(c_ms)} | {g_ms} | "
                     f"{ratio(tl.get('total_ms'), c_ms if isinstance(c, dict) else None)} | "
                     f"{ratio(tl.get('total_ms'), g_total)} | "
                     f"{losses} |")
    return lines


PACKED_KEY = re.compile(r"_packed_\d+(_uneven)?(_batched)?$")  # bench_layer --packed rows


def layer(records, meta):
    names = [n for n in records[0] if n not in ("T", "cp", "T_local", "selection_floor_ms",
                                                 "layer_floor_ms", "speedup")
             and not PACKED_KEY.search(n)] if records else []
    head = "| T | layer floor ms | " + " | ".join(f"{n} fwd+bwd ms (GiB)" for n in names)
    head += " | " + " | ".join(f"hyscale vs {n}" for n in names if n != "hyscale") + " |"
    lines = [head, "|---" * (2 + 2 * len(names) - 1) + "|"]
    for r in records:
        cells = [str(r["T"]), fmt(r.get("layer_floor_ms"))]
        for n in names:
            v = r.get(n)
            cells.append(f"{fmt(v.get('fwd_bwd_ms'))} ({fmt(v.get('peak_extra_gib'), '.1f')})"
                         if isinstance(v, dict) else fmt(v))
        h = r.get("hyscale")
        for n in names:
            if n != "hyscale":
                v = r.get(n)
                cells.append(ratio(h.get("fwd_bwd_ms") if isinstance(h, dict) else None,
                                   v.get("fwd_bwd_ms") if isinstance(v, dict) else None))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + packed_layer(records, meta)


def packed_layer(records, meta):
    """bench_layer --packed: each packed row against the unpacked row it was timed beside."""
    rows = [(r, k) for r in records for k in r if PACKED_KEY.search(k)]
    if not rows:
        return []
    goal = (meta.get("packed") or {}).get("goal_per_token_vs_unpacked", 1.10)
    lines = ["", "| T | packed row | documents (tokens each) | fwd+bwd ms (GiB) |"
             " selection in step ms | per-token time vs unpacked | causal key pairs vs"
             " unpacked | path |", "|---" * 8 + "|"]
    for r, k in rows:
        v = r[k]
        if not isinstance(v, dict):
            lines.append(f"| {r['T']} | {k} | " + " | ".join([fmt(v)] + ["-"] * 5) + " |")
            continue
        lengths = v.get("doc_lengths") or []
        size = (fmt(lengths[0], "d") if lengths and min(lengths) == max(lengths)
                else f"{min(lengths)}-{max(lengths)}" if lengths else "-")
        per_token = v.get("per_token_vs_unpacked")
        per_token = ("-" if per_token is None else f"{per_token:.2f}x" + (
            "" if per_token <= goal else f" (over {goal:.2f}x)"))
        path = v.get("path", "stock")
        if path != "stock":
            warned = v.get("fallback_warnings", 0)
            path = ("HyScale" if path == "hyscale" else "**stock fallback**") + (
                f" ({warned} fallback warnings)" if warned else "")
        lines.append(f"| {r['T']} | {k} | {v.get('documents')} {v.get('split')} ({size}) | "
                     f"{fmt(v.get('fwd_bwd_ms'))} ({fmt(v.get('peak_extra_gib'), '.1f')}) | "
                     f"{fmt(v.get('selection_in_step_ms'))} | {per_token} | "
                     f"{fmt(v.get('visible_keys_vs_unpacked'), '.3f')} | {path} |")
    return lines


def _err(x):
    return fmt(x, ".2e")


def accuracy(records, meta):
    """accuracy records (hyscale_bench.accuracy): per case, every tensor's relative error
    against float64, HyScale's and stock's, their ratio and the verdict."""
    slack = meta.get("slack", 1.05)
    lines = [f"HyScale <= stock (x{slack:g}) for {meta.get('passed')} of "
             f"{meta.get('compared')} tensors compared.", ""]
    for case in records:
        differ = case.get("selection_rows_differ")
        lines += [f"**{case['model']} T={case['T']}, {case['loss']} loss** ({case['geometry']}; "
                  f"{case['low_precision']} against float64; stock = {case['stock']}: "
                  f"{case['stock_status']}; float64 reference: "
                  f"{case.get('reference_status', 'ran')}; rows whose selection differs "
                  "HyScale vs stock: "
                  f"{'-' if differ is None else format(differ, '.2%')}; reference matmuls not "
                  f"in float64: {case.get('reference_low_precision_matmuls')})", "",
                  f"| tensor | HyScale err | stock err | HyScale / stock | HyScale <= stock "
                  f"(x{slack:g}) |", "|---|---|---|---|---|"]
        for r in case["rows"]:
            ok = "n/a" if r["ok"] is None else ("yes" if r["ok"] else "NO")
            lines.append(f"| {r['tensor']} | {_err(r['hyscale_err'])} | {_err(r['stock_err'])} "
                         f"| {fmt(r['ratio'], '.3f')} | {ok} |")
        lines.append("")
    return lines


def bwd_sweep(records):
    """bench_attention --bwd-sweep: the backward kernels timed apart per tiling, every column the
    run timed (the default options' and each variant's), in the record's order."""
    columns = list(dict.fromkeys(k for r in records for k in r if k.endswith("_ms")))
    lines = ["| shape | T | keys x stages | " + " | ".join(c.removesuffix("_ms") + " ms"
                                                         for c in columns) + " |",
             "|---" * (3 + len(columns)) + "|"]
    for r in sorted(records, key=lambda r: (r["shape"], r["T"], -r["block_n"], r["stages"])):
        lines.append(f"| {r['shape']} | {r['T']} | {r['block_n']} x {r['stages']} | "
                     + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return lines


# A record's script is matched in this order: bench_attention_bwd_sweep before bench_attention,
# whose --tag'd records (bench_attention_<tag>) it would otherwise take; the same for
# bench_selection_row_sort and the bench_indexer_loss_* records.
RENDER = {"bench_selection_row_sort": row_sort_micro, "bench_selection": selection,
          "bench_attention_bwd_sweep": bwd_sweep, "bench_attention": attention,
          "bench_indexer_loss_variants": indexer_loss_variants,
          "bench_indexer_loss_dense": indexer_loss_dense, "bench_indexer_loss": indexer_loss}
WITH_META = {"bench_layer": layer, "accuracy": accuracy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="record files from benchmarks/results/")
    args = parser.parse_args()
    for path in args.records:
        with open(path) as f:
            data = json.load(f)
        meta, records = data["meta"], data["records"]
        name = os.path.basename(path)
        # a record's script, with or without the run's --tag (bench_selection_fp8-...)
        script = next((s for s in (*RENDER, *WITH_META)
                       if re.search(rf"-{s}(_[A-Za-z0-9_]+)?-", name)), None)
        if script is None:
            print(f"<!-- {name}: no table for this record -->")
            continue
        rate = meta.get("matmul_tflops")
        # An accuracy run measures no rate (its record holds NaN): say so, not "nan TFLOP/s".
        rate = (f"matmul {fmt(rate, '.0f')} TFLOP/s" if isinstance(rate, (int, float))
                and rate == rate else "matmul rate not measured")
        print(f"`{name}` ({meta['device']}, {meta['date']}, commit {meta['commit']}, {rate}): "
              f"`{meta['command']}`\n")
        lines = (WITH_META[script](records, meta) if script in WITH_META
                 else RENDER[script](records))
        print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

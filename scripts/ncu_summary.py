"""Summarise Nsight Compute reports of one kernel into a benchmark record.

Reads, per case, the CSV exports that `gpu_session.sh ncu-selection` writes (`ncu --import R
--page details --csv` and `--page source --csv --print-source sass`) and records: the launch
and throughput metrics, the warp-stall reasons over all samples, the instructions executed
per hot-loop iteration (the loop is the block of SASS lines executed most often, weighted by
its length), and the hottest SASS lines. For example:

    python3 scripts/ncu_summary.py --dir DIR --cases norelu_131072_hytopk dsv32_65536_scoreonly \\
        --commit b3fa41e --date "2026-12-04 19:02 UTC" --command "gpu_session.sh ncu-selection"

writes benchmarks/results/<date>-nvidia-h200-ncu_selection.json (or --out).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import sys

DETAIL_METRICS = ("Duration", "Registers Per Thread", "Achieved Occupancy", "Issue Slots Busy",
                  "No Eligible", "Warp Cycles Per Issued Instruction", "Compute (SM) Throughput",
                  "L2 Cache Throughput", "Executed Ipc Active", "Block Limit Registers",
                  "Block Limit Shared Mem", "Dynamic Shared Memory Per Block",
                  "Local Memory Spilling Requests", "Grid Size", "Block Size",
                  "DRAM Throughput", "Memory Throughput", "L1/TEX Hit Rate", "L2 Hit Rate",
                  "Mem Busy", "Max Bandwidth", "Mem Pipes Busy")
# Raw counters a profile may add with ncu --metrics (gpu_session.sh ncu-attention does): kept
# under their own names.
RAW_PREFIXES = ("dram__", "lts__", "l1tex__", "sm__", "smsp__")
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
TOP_LINES = 12


def _rows(path: str) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if line.startswith('"')))


def details(path: str) -> dict[str, str]:
    """The DETAIL_METRICS and raw counters of a details-page CSV, as 'value unit' strings (a
    name met again with another unit, like Memory Throughput in % and in byte/s, keeps both:
    the second as 'name [unit]')."""
    out, units = {}, {}
    for row in _rows(path):
        name = row.get("Metric Name") or ""
        if name not in DETAIL_METRICS and not name.startswith(RAW_PREFIXES):
            continue
        unit = row["Metric Unit"] or ""
        value = f"{row['Metric Value']} {unit}".strip()
        if name not in out:
            out[name], units[name] = value, unit
        elif unit != units[name]:
            out.setdefault(f"{name} [{unit}]", value)
    return out


def sass(path: str) -> dict:
    """Stall shares, instructions a hot-loop iteration and the hottest lines of a SASS-page
    CSV (its first line names the kernel)."""
    with open(path) as f:
        lines = f.read().splitlines()[1:]
    rows = list(csv.DictReader(lines))
    if not rows or SAMPLES not in rows[0]:
        raise ValueError(f"{path}: not an ncu SASS source page ({lines[:1]})")
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = collections.Counter()
    for r in rows:
        for c in reasons:
            total[c] += int(r[c] or 0)
    n_samples = sum(total.values())
    by_count: dict[int, list[dict[str, str]]] = collections.defaultdict(list)
    for r in rows:
        by_count[int(r[EXECUTED] or 0)].append(r)
    # The hot loop: the execution count that the most instructions were executed at.
    loop_count = max(by_count, key=lambda n: n * len(by_count[n]))
    loop = by_count[loop_count]
    ops = collections.Counter(
        (r["Source"].split()[1] if r["Source"].strip().startswith("@") else
         r["Source"].split()[0]).split(".")[0] for r in loop)
    hottest = sorted(rows, key=lambda r: -int(r[SAMPLES] or 0))[:TOP_LINES]
    return {
        "samples": n_samples,
        "warp_instructions": sum(int(r[EXECUTED] or 0) for r in rows),
        "stall_share": {c.removeprefix("stall_"): round(v / n_samples, 4)
                        for c, v in total.most_common() if v},
        "loop_executions": loop_count,
        "loop_instructions": len(loop),
        "loop_sample_share": round(sum(int(r[SAMPLES] or 0) for r in loop) / n_samples, 4),
        "loop_ops": dict(ops.most_common()),
        "hottest_lines": [{"sass": r["Source"].strip(), "samples": int(r[SAMPLES] or 0),
                           "executed": int(r[EXECUTED] or 0),
                           "top_stall": max(reasons, key=lambda c: int(r[c] or 0))
                           .removeprefix("stall_")} for r in hottest],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="folder with CASE_details.csv, CASE_sass.csv")
    p.add_argument("--cases", nargs="+", required=True, help="case names (config_T_method)")
    p.add_argument("--commit", required=True, help="commit the profiled kernels came from")
    p.add_argument("--date", required=True, help="when the profiles ran (UTC)")
    p.add_argument("--device", default="NVIDIA H200", help="device profiled")
    p.add_argument("--command", required=True, help="the command that produced the CSVs")
    p.add_argument("--kind", default="ncu_selection",
                   help="record name after the date and device (ncu_selection, ncu_attention)")
    p.add_argument("--out", help="record path (default: benchmarks/results/<date>-"
                                 "<device>-<kind>.json)")
    args = p.parse_args(argv)
    cases = {}
    for case in args.cases:
        d = os.path.join(args.dir, f"{case}_details.csv")
        s = os.path.join(args.dir, f"{case}_sass.csv")
        for path in (d, s):
            if not os.path.isfile(path):
                p.error(f"--cases {case}: {path} is missing")
        cases[case] = {"details": details(d), **sass(s)}
    record = {"meta": {"date": args.date, "device": args.device, "commit": args.commit,
                       "command": args.command, "matmul_tflops": None, "copy_tbps": None,
                       "note": "Nsight Compute, --set full --clock-control none: one call "
                               "of each case; counters, not timings"},
              "cases": cases}
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "results",
        f"{args.date[:10]}-{args.device.lower().replace(' ', '-')}-{args.kind}.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    for case, c in cases.items():
        stalls = ", ".join(f"{k} {v:.0%}" for k, v in list(c["stall_share"].items())[:4])
        print(f"{case}: {c['details'].get('Duration', '?')}, issue slots busy "
              f"{c['details'].get('Issue Slots Busy', '?')}; loop {c['loop_instructions']} "
              f"instructions ({c['loop_sample_share']:.0%} of samples); stalls: {stalls}")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""scripts/ncu_summary.py: Nsight Compute CSV exports into a benchmark record."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ncu_summary.py"
STALLS = ("stall_barrier", "stall_wait", "stall_barrier (Not Issued)")


def _write_csv(path: Path, first_line: str, cols: list[str], rows: list[list[str]]) -> None:
    """A CSV as ncu exports it: a line of its own first, then quoted columns and rows."""
    with path.open("w", newline="") as f:
        f.write(first_line + "\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(cols)
        w.writerows(rows)


def _write_details(path: Path) -> None:
    kernel = ["0", "_k", "(128, 1, 1)"]
    _write_csv(path, "==PROF== a line ncu prints first",
               ["ID", "Kernel Name", "Block Size", "Section Name", "Metric Name", "Metric Unit",
                "Metric Value"],
               [kernel + ["GPU Speed Of Light Throughput", "Duration", "ms", "96.80"],
                kernel + ["Compute Workload Analysis", "Issue Slots Busy", "%", "34.51"],
                kernel + ["Other", "Something Else", "", "1"],
                kernel + ["GPU Speed Of Light Throughput", "Memory Throughput", "%", "61.2"],
                kernel + ["Memory Workload Analysis", "Memory Throughput", "Tbyte/s", "2.93"],
                kernel + ["Memory Workload Analysis", "L2 Hit Rate", "%", "71.5"],
                kernel + ["Command line profiler metrics", "dram__bytes_read.sum", "Gbyte",
                          "301.2"],
                kernel + ["Command line profiler metrics", "gpu__time_duration.sum", "ms",
                          "96.8"]])


def _write_sass(path: Path) -> None:
    # A 3-instruction loop run 100 times, a prologue run once; the loop's wait has most samples.
    _write_csv(path, '"Kernel Name","_hytopk_kernel",',
               ["Address", "Source", "Warp Stall Sampling (All Samples)",
                "Instructions Executed", *STALLS],
               [["0x0", "      LDC R1, c[0x0][0x28]", "2", "1", "0", "2", "0"],
                ["0x10", "      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", "10", "100", "0",
                 "10", "0"],
                ["0x20", "      WARPGROUP.DEPBAR.LE gsb0, 0x0", "60", "100", "60", "0", "60"],
                ["0x30", "      @P0 STG.E.64 desc[UR4][R2.64], R4", "28", "100", "8", "20",
                 "0"]])


def test_record_from_csv_exports(tmp_path: Path) -> None:
    _write_details(tmp_path / "case_details.csv")
    _write_sass(tmp_path / "case_sass.csv")
    out = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--cases", "case",
                           "--commit", "abc1234", "--date", "2026-12-04 19:02 UTC", "--command",
                           "test", "--kind", "ncu_attention", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert rec["meta"]["commit"] == "abc1234" and rec["meta"]["matmul_tflops"] is None
    case = rec["cases"]["case"]
    # The second Memory Throughput (another unit) is kept apart; raw counters by their names,
    # other metrics left out.
    assert case["details"] == {"Duration": "96.80 ms", "Issue Slots Busy": "34.51 %",
                               "Memory Throughput": "61.2 %",
                               "Memory Throughput [Tbyte/s]": "2.93 Tbyte/s",
                               "L2 Hit Rate": "71.5 %", "dram__bytes_read.sum": "301.2 Gbyte"}
    assert case["samples"] == 100  # the "Not Issued" column is not counted twice
    assert case["stall_share"] == {"barrier": 0.68, "wait": 0.32}
    assert (case["loop_executions"], case["loop_instructions"]) == (100, 3)
    assert case["loop_sample_share"] == 0.98
    assert case["loop_ops"] == {"HGMMA": 1, "WARPGROUP": 1, "STG": 1}
    assert case["hottest_lines"][0]["sass"].startswith("WARPGROUP.DEPBAR")
    assert case["hottest_lines"][0]["top_stall"] == "barrier"
    assert case["warp_instructions"] == 301
    assert "case: 96.80 ms, issue slots busy 34.51 %; loop 3 instructions" in proc.stdout


def test_missing_export_names_the_case(tmp_path: Path) -> None:
    _write_details(tmp_path / "case_details.csv")
    out = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--cases", "case",
                           "--commit", "c", "--date", "2026-12-04", "--command", "t", "--out",
                           str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--cases case:" in proc.stderr and "case_sass.csv is missing" in proc.stderr
    assert not out.exists()

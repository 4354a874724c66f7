"""Read Megatron-LM training logs: per-iteration time and losses, and a side-by-side summary.

Megatron-LM (`megatron/training/training.py`, `training_log`) prints one line per logged
iteration, fields separated by ' | ', e.g.

    [2026-01-01 12:00:00.000000] iteration        3/      10 | consumed samples:    12 |
    elapsed time per iteration (ms): 5123.4 | learning rate: 1.000000E-05 |
    global batch size:     4 | lm loss: 1.052341E+01 | indexer loss: 3.120000E-01 | ...

(on one line). `elapsed time per iteration (ms)` is averaged over the log interval; losses are
averaged over the interval too. Lines from other ranks or tools are ignored. Each rank also
reports its CUDA allocator after the first logged iterations:

    [Rank 0] (after 2 iterations) memory (MB) | allocated: 11842.11 | max allocated: 74207.15 |
    reserved: 86016.00 | max reserved: 86016.00

of which `peak_allocated_mib` keeps the largest `max allocated` over ranks and iterations.

Process segments. A run split over several calls (checkpoint, exit, load and continue:
`megatron_hyscale/launch/resume.py`) appends each new process's output to the same log, so a
log is one or more segments, one per process. The rule: a segment boundary is either line
that says a new process starts here,

    [hyscale] resumed ...                      (RESUME_MARKER, at the start of the line: the
                                                launchers write it before appending)
      successfully loaded checkpoint from DIR [ t 1/1, ... ] at iteration 12
                                               (Megatron-LM's checkpointing.load_checkpoint)

and a boundary opens a new segment only once the current one has logged a training iteration
or a phase-times step, so the marker followed by the resumed process's load line is one
boundary, and a first process that loads a checkpoint (--load on a fresh log) stays segment 0.
Each process warms up again (compiles, allocator), so `summarize` and `phase_times` leave the
first `skip` iterations (steps) of EACH segment out of the timing; the phase-times step number
counts the steps of its process (it restarts at 1), so phase steps are keyed by (segment,
step). A log without a boundary is one segment, parsed as it always was.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_hyscale.phase_spans import PHASES

# megatron_hyscale.phase_times (HYSCALE_PHASE_TIMES=1) prints one line per rank and step:
#   [hyscale phases] rank 0 step 3: selection 812.4 ms (8), attention 301.2 ms (16), ...
PHASE_TIMES_ENV = "HYSCALE_PHASE_TIMES"
PHASE_LINE_PREFIX = "[hyscale phases]"
_PHASE_LINE = re.compile(r"\[hyscale phases\] rank (\d+) step (\d+): (.*)$")
_PHASE_ITEM = re.compile(r"(\w+) ([0-9.]+) ms \((\d+)\)")
# megatron_hyscale.selection_agreement (HYSCALE_SELECTION_AGREEMENT=N) prints, per DSA layer:
#   [hyscale agreement] rank 0 step 5 layer 1: jaccard 0.998047 score_match 1.000000 rows 256
AGREEMENT_ENV = "HYSCALE_SELECTION_AGREEMENT"
AGREEMENT_ROWS_ENV = "HYSCALE_SELECTION_AGREEMENT_ROWS"
AGREEMENT_LINE_PREFIX = "[hyscale agreement]"
_AGREEMENT_LINE = re.compile(
    r"\[hyscale agreement\] rank (\d+) step (\d+) layer (\d+): jaccard ([0-9.eE+-]+) "
    r"score_match ([0-9.eE+-]+) rows (\d+)")
# megatron_hyscale.indexer_capture (HYSCALE_INDEXER_CAPTURE=PATH, HYSCALE_INDEXER_CAPTURE_AT=N)
# prints once it wrote PATH:
#   [hyscale] indexer capture: layer 1 iteration 300 T=16384 -> PATH
INDEXER_CAPTURE_ENV = "HYSCALE_INDEXER_CAPTURE"
INDEXER_CAPTURE_AT_ENV = "HYSCALE_INDEXER_CAPTURE_AT"
INDEXER_CAPTURE_LINE_PREFIX = "[hyscale] indexer capture:"
_INDEXER_CAPTURE_LINE = re.compile(
    r"\[hyscale\] indexer capture: layer (\d+) iteration (\d+) T=(\d+) -> (.+)$")
# The line the launchers write before appending a resumed process's output to a log.
RESUME_MARKER = "[hyscale] resumed"
# Megatron-LM's `print_rank_0` once a checkpoint is loaded (megatron/training/checkpointing.py).
_CHECKPOINT_LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration\s+\d+")
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_MAX_ALLOCATED = re.compile(r"memory \(MB\).*?\|\s*max allocated:\s*([0-9.]+)")
_FIELD = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 _()/\-]*?)\s*:\s*([-+0-9.eEnaNinf]+)\s*$")


@dataclass
class IterationRecord:
    """One logged iteration; `fields` holds every numeric 'name: value' pair of the line."""

    iteration: int
    elapsed_ms: float
    lm_loss: float | None = None
    indexer_loss: float | None = None
    global_batch_size: int | None = None
    fields: dict[str, float] = field(default_factory=dict)
    segment: int = 0  # the process that logged it (0: the first; see the module doc)


def _iteration_match(line: str) -> re.Match | None:
    """The `iteration N/M |` of a training-iteration line (None for any other line)."""
    match = _ITERATION.search(line)
    return match if match is not None and "elapsed time per iteration (ms)" in line else None


def is_segment_boundary(line: str) -> bool:
    """Whether `line` says a new process starts: the launchers' RESUME_MARKER or Megatron-LM's
    `successfully loaded checkpoint from ... at iteration N` (the module doc has the rule)."""
    return line.startswith(RESUME_MARKER) or _CHECKPOINT_LOADED.search(line) is not None


def segment_lines(text: str) -> list[tuple[int, str]]:
    """(segment, line) of every line of a log, segments numbered from 0 (the module doc)."""
    found, segment, logged = [], 0, False
    for line in text.splitlines():
        if is_segment_boundary(line):
            if logged:
                segment, logged = segment + 1, False
        elif _iteration_match(line) is not None or _PHASE_LINE.search(line) is not None:
            logged = True
        found.append((segment, line))
    return found


def parse_megatron_log(text: str) -> list[IterationRecord]:
    """Every training-iteration line of a Megatron-LM log, in order (skips evaluation lines),
    each with the process segment it is in."""
    records = []
    for segment, line in segment_lines(text):
        match = _iteration_match(line)
        if match is None:
            continue
        fields: dict[str, float] = {}
        for part in line[match.end():].split("|"):
            kv = _FIELD.match(part)
            if kv:
                try:
                    fields[kv.group(1).strip()] = float(kv.group(2))
                except ValueError:
                    continue
        gbs = fields.get("global batch size")
        records.append(IterationRecord(
            iteration=int(match.group(1)),
            elapsed_ms=fields["elapsed time per iteration (ms)"],
            lm_loss=fields.get("lm loss"),
            indexer_loss=fields.get("indexer loss"),
            global_batch_size=int(gbs) if gbs is not None else None,
            fields=fields,
            segment=segment,
        ))
    return records


def peak_allocated_mib(text: str) -> float | None:
    """The largest `max allocated` (MiB, torch.cuda.max_memory_allocated) any rank reported."""
    values = [float(m.group(1)) for m in _MAX_ALLOCATED.finditer(text)]
    return max(values) if values else None


@dataclass
class RunSummary:
    """Throughput and losses of one run, warm-up iterations excluded from the timing."""

    name: str
    iterations: int
    timed_iterations: int
    mean_iteration_ms: float | None
    tokens_per_s: float | None
    tokens_per_s_per_gpu: float | None
    first_lm_loss: float | None
    last_lm_loss: float | None
    last_indexer_loss: float | None
    note: str = ""
    peak_allocated_mib: float | None = None
    phase_ms: dict[str, float] = field(default_factory=dict)  # phase_times(log text)


def parse_phase_line(line: str) -> tuple[int, int, dict[str, float]] | None:
    """(rank, step, {phase: ms}) of one phase-times line, or None."""
    m = _PHASE_LINE.search(line)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), {p: float(ms) for p, ms, _ in
                                               _PHASE_ITEM.findall(m.group(3))}


def phase_times(text: str, skip: int = 2) -> dict[str, float]:
    """Mean ms per step of each phase over the steps after the first `skip` of each process
    segment (steps keyed by (segment, step): a resumed process counts from 1 again), each
    step taken at its slowest rank ({} when the log has no phase-times lines). As `summarize`,
    if every step falls in the warm-up windows the last one counts."""
    per_step: dict[tuple[int, int], dict[str, float]] = {}
    for segment, line in segment_lines(text):
        parsed = parse_phase_line(line)
        if parsed is None:
            continue
        _, step, phases = parsed
        slot = per_step.setdefault((segment, step), {})
        for p, ms in phases.items():
            slot[p] = max(slot.get(p, 0.0), ms)
    steps = sorted(per_step)
    timed = [s for s in steps if s[1] > skip] or steps[-1:]
    if not timed:
        return {}
    return {p: sum(per_step[s].get(p, 0.0) for s in timed) / len(timed) for p in PHASES}


@dataclass
class AgreementPoint:
    """One layer at one iteration: HyScale's top-k against stock's on the same weights."""

    step: int
    layer: int
    jaccard: float
    score_match: float
    rows: int


def selection_agreement(text: str) -> list[AgreementPoint]:
    """Every agreement line of a log, averaged over the ranks that printed the same (step,
    layer) (their batches differ under data parallelism), sorted by step then layer."""
    found: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
    for line in text.splitlines():
        m = _AGREEMENT_LINE.search(line)
        if m:
            found.setdefault((int(m.group(2)), int(m.group(3))), []).append(
                (float(m.group(4)), float(m.group(5)), int(m.group(6))))
    return [AgreementPoint(step, layer, sum(v[0] for v in vals) / len(vals),
                           sum(v[1] for v in vals) / len(vals), sum(v[2] for v in vals))
            for (step, layer), vals in sorted(found.items())]


def indexer_capture(text: str) -> dict[str, Any] | None:
    """The last indexer-capture line of a log as {'layer', 'iteration', 'T', 'path'}, or None."""
    found = None
    for line in text.splitlines():
        m = _INDEXER_CAPTURE_LINE.search(line)
        if m:
            found = {"layer": int(m.group(1)), "iteration": int(m.group(2)),
                     "T": int(m.group(3)), "path": m.group(4).strip()}
    return found


def summarize(name: str, records: list[IterationRecord], *, seq_length: int, gpus: int,
              skip: int = 2, exit_code: int | None = 0,
              peak_allocated_mib: float | None = None,
              phase_ms: dict[str, float] | None = None) -> RunSummary:
    """Mean time over the iterations after the first `skip` of each process segment (compile,
    allocator warm-up: a resumed process warms up again; the module doc has the segments).

    tokens/s = global batch size x seq_length / mean iteration time. If every iteration falls
    in the warm-up window, the last one is timed rather than none. `peak_allocated_mib`: what
    `peak_allocated_mib(log text)` found, and `phase_ms` what `phase_times(log text)` found,
    carried into the summary.
    """
    note = "" if exit_code in (0, None) else f"exited with code {exit_code}"
    if not records:
        note = note or "no iterations logged"
        return RunSummary(name, 0, 0, None, None, None, None, None, None,
                          note=f"{note} (see its log)", peak_allocated_mib=peak_allocated_mib,
                          phase_ms=dict(phase_ms or {}))
    by_segment: dict[int, list[IterationRecord]] = {}
    for r in records:
        by_segment.setdefault(r.segment, []).append(r)
    timed = [r for seg in by_segment.values() for r in seg[skip:]] or records[-1:]
    mean_ms = sum(r.elapsed_ms for r in timed) / len(timed)
    gbs = timed[-1].global_batch_size
    tokens_per_s = gbs * seq_length / (mean_ms / 1000.0) if gbs and mean_ms > 0 else None
    losses = [r.lm_loss for r in records if r.lm_loss is not None]
    indexer = [r.indexer_loss for r in records if r.indexer_loss is not None]
    return RunSummary(
        name=name,
        iterations=len(records),
        timed_iterations=len(timed),
        mean_iteration_ms=mean_ms,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / gpus if tokens_per_s else None,
        first_lm_loss=losses[0] if losses else None,
        last_lm_loss=losses[-1] if losses else None,
        last_indexer_loss=indexer[-1] if indexer else None,
        note=note,
        peak_allocated_mib=peak_allocated_mib,
        phase_ms=dict(phase_ms or {}),
    )


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _gib(mib: float | None) -> float | None:
    return None if mib is None else mib / 1024.0


def runs_table(runs: list[RunSummary]) -> str:
    """Throughput, losses, peak memory and phase times of runs, one column each."""
    rows = [
        ("iterations logged (timed)", [f"{r.iterations} ({r.timed_iterations})" for r in runs]),
        ("mean iteration time (ms)", [_fmt(r.mean_iteration_ms, ".1f") for r in runs]),
        ("tokens/s", [_fmt(r.tokens_per_s, ",.0f") for r in runs]),
        ("tokens/s per GPU", [_fmt(r.tokens_per_s_per_gpu, ",.1f") for r in runs]),
        ("lm loss (first -> last)",
         [f"{_fmt(r.first_lm_loss, '.4f')} -> {_fmt(r.last_lm_loss, '.4f')}" for r in runs]),
        ("indexer loss (last)", [_fmt(r.last_indexer_loss, ".4g") for r in runs]),
        ("max allocated per GPU (GiB)", [_fmt(_gib(r.peak_allocated_mib), ".1f") for r in runs]),
    ]
    if any(r.phase_ms for r in runs):
        # inclusive times on the compute stream, slowest GPU of each iteration
        rows += [(f"{p.replace('_', ' ')} ms / iteration",
                  [_fmt(r.phase_ms.get(p), ".1f") for r in runs]) for p in PHASES]
    rows.append(("note", [r.note or "-" for r in runs]))
    w0 = max(len(label) for label, _ in rows) + 2
    widths = [max(len(r.name), *(len(cells[i]) for _, cells in rows)) + 2
              for i, r in enumerate(runs)]
    lines = ["".ljust(w0) + "".join(r.name.rjust(w) for r, w in zip(runs, widths))]
    lines += [label.ljust(w0) + "".join(c.rjust(w) for c, w in zip(cells, widths))
              for label, cells in rows]
    return "\n".join(lines)


@dataclass
class LossAgreement:
    """lm loss of two runs compared at the iterations both logged one."""

    compared: int  # iterations with an lm loss in both runs
    max_rel_gap: float | None  # largest |a - b| / |a| over them (None when none compared)
    at_iteration: int | None  # where it is

    def verdict(self, min_steps: int, rtol: float) -> str:
        """One line: how many iterations, the largest gap, and whether both bounds hold."""
        if not self.compared or self.max_rel_gap is None:
            return "lm loss agreement: no iteration logged by both runs"
        ok = self.compared >= min_steps and self.max_rel_gap <= rtol
        return (f"lm loss agreement: {self.compared} iterations compared, largest relative gap "
                f"{self.max_rel_gap:.2e} (iteration {self.at_iteration}); "
                f"{'PASS' if ok else 'FAIL'} (needs >= {min_steps} iterations and gap <= "
                f"{rtol:g})")


def loss_agreement(records_a: list[IterationRecord],
                   records_b: list[IterationRecord]) -> LossAgreement:
    """The largest relative lm-loss gap |a - b| / |a| over the iterations both runs logged
    (a: the reference run, stock). An iteration logged twice (a process stopped after it and
    before its checkpoint, then resumed from an earlier one) counts once, at its last value."""
    by_a = {r.iteration: r.lm_loss for r in records_a if r.lm_loss is not None}
    by_b = {r.iteration: r.lm_loss for r in records_b if r.lm_loss is not None}
    gaps = [(abs(loss - by_b[it]) / max(abs(loss), 1e-30), it)
            for it, loss in by_a.items() if it in by_b]
    if not gaps:
        return LossAgreement(0, None, None)
    gap, at = max(gaps)
    return LossAgreement(len(gaps), gap, at)


def side_by_side(a: RunSummary, b: RunSummary, records_a: list[IterationRecord],
                 records_b: list[IterationRecord]) -> str:
    """Throughput and losses of two runs beside each other, then the per-iteration losses."""
    lines = runs_table([a, b]).split("\n")
    if a.tokens_per_s and b.tokens_per_s:
        lines.append(f"speed-up {b.name} / {a.name}: {b.tokens_per_s / a.tokens_per_s:.2f}x")
    by_iter_a = {r.iteration: r for r in records_a}
    by_iter_b = {r.iteration: r for r in records_b}
    iterations = sorted(set(by_iter_a) | set(by_iter_b))
    if iterations:
        lines += ["", f"{'iteration':>9}  {'lm loss ' + a.name:>22}  {'lm loss ' + b.name:>22}"
                  f"  {'ms ' + a.name:>14}  {'ms ' + b.name:>14}"]
        for it in iterations:
            ra, rb = by_iter_a.get(it), by_iter_b.get(it)
            lines.append(
                f"{it:>9}  {_fmt(ra.lm_loss if ra else None, '.6f'):>22}"
                f"  {_fmt(rb.lm_loss if rb else None, '.6f'):>22}"
                f"  {_fmt(ra.elapsed_ms if ra else None, '.1f'):>14}"
                f"  {_fmt(rb.elapsed_ms if rb else None, '.1f'):>14}"
            )
    return "\n".join(lines)


def summary_record(run: RunSummary, records: list[IterationRecord], *, seq_length: int,
                   gpus: int, **extra: object) -> dict:
    """One run as a benchmark-record entry: throughput, peak memory, phase times and the lm
    loss of every logged iteration."""
    return {
        "method": run.name, "T": seq_length, "gpus": gpus,
        "iterations": run.iterations, "timed_iterations": run.timed_iterations,
        "mean_iteration_ms": run.mean_iteration_ms, "tokens_per_s": run.tokens_per_s,
        "tokens_per_s_per_gpu": run.tokens_per_s_per_gpu,
        "peak_allocated_gib": _gib(run.peak_allocated_mib),
        "phase_ms": dict(run.phase_ms),
        "lm_loss": {str(r.iteration): r.lm_loss for r in records},
        "indexer_loss": {str(r.iteration): r.indexer_loss for r in records},
        "iteration_ms": {str(r.iteration): r.elapsed_ms for r in records},
        "note": run.note, **extra,
    }


def _git_commit(root: Path) -> str:
    """$HYSCALE_COMMIT (a GPU session's tree copy has no .git), else `git rev-parse` in root,
    '+dirty' for uncommitted changes (as hyscale_bench.measure.commit)."""
    if os.environ.get("HYSCALE_COMMIT"):
        return os.environ["HYSCALE_COMMIT"]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def save_record(folder: Path, script: str, config: str, records: list[dict], *, command: str,
                device: str, torch_version: str | None, root: Path,
                extra: dict | None = None) -> Path:
    """Write `records` with the run's meta as <date>-<device>-<script>-<config>.json in folder,
    the fields of benchmarks/results/ (hyscale_bench.measure.save_record's): meta date,
    device, commit, command, matmul_tflops, copy_tbps, torch, then `extra`. A launcher runs no
    GPU code itself, so the matmul and copy rates are null (not measured in this run)."""
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device,
            "commit": _git_commit(root), "command": command, "matmul_tflops": None,
            "copy_tbps": None, "torch": torch_version, **(extra or {})}
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", device.lower()).strip("-") or "unknown"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.strftime('%Y-%m-%d')}-{slug}-{script}-{config}.json"
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=1, default=str) + "\n")
    return path

"""Runs longer than one call: checkpoint, stop in time, resume, one log across processes.

A device call is limited in time (the machine keeps its disk between calls made back to back),
so a long Megatron-LM run is split over calls. Each call starts pretrain_gpt.py with

    --save DIR --load DIR --save-interval N      (checkpoint_args)
    --exit-duration-in-mins M                    (exit_duration_args, from the call's budget)

Megatron-LM checks the duration after every training iteration (megatron/training/
training.py, checkpoint_and_decide_exit: minutes since the process started, all-reduced so
that every rank decides alike); once past it, it saves a checkpoint (when --save is set and
that iteration did not save one already) and exits with status 0. The launcher's own kill at
the end of the budget stays as the backstop. The next call's process loads the latest
checkpoint in DIR (the iteration its latest_checkpointed_iteration.txt names; without that file
Megatron-LM starts from scratch) and continues. `run_logged` appends that process's output to
the same log after a `logparse.RESUME_MARKER` line, and logparse reads each process as a segment
of its own (whose warm-up iterations are again left out of the timing).

Used by `python -m megatron_hyscale.evaluate` and `examples/glm5_1/launch.py side-by-side`.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron_hyscale.launch.command import Command
from megatron_hyscale.launch.logparse import RESUME_MARKER, parse_megatron_log

# Megatron-LM's checkpoint tracker (checkpointing.get_checkpoint_tracker_filename): written
# once a save has completed; what --load reads to find the iteration to continue from.
TRACKER = "latest_checkpointed_iteration.txt"
# Left of a budget, at least, for what follows the duration: the iteration under way when it
# passes, the checkpoint's save, the exit (and the seconds between the launcher starting the
# process and Megatron-LM starting its clock, at the import of megatron.training.training).
EXIT_MARGIN_S = 60.0
# Megatron-LM parses --exit-duration-in-mins as an integer (`int | None` in
# training_config.py) and treats 0 as "no limit": one minute is the least it can be asked.
MIN_EXIT_MIN = 1


def checkpoint_args(directory: Path, interval: int) -> list[str]:
    """Save to and resume from `directory`, a checkpoint every `interval` iterations."""
    ckpt = str(directory)
    return ["--save", ckpt, "--load", ckpt, "--save-interval", str(interval)]


def exit_duration_args(budget_s: float) -> list[str]:
    """`--exit-duration-in-mins` for a process given `budget_s` seconds: the whole minutes
    (what Megatron-LM parses) that end at least EXIT_MARGIN_S before the budget does (540 s:
    8, 539 s: 7), and at least MIN_EXIT_MIN."""
    minutes = max(int((budget_s - EXIT_MARGIN_S) // 60), MIN_EXIT_MIN)
    return ["--exit-duration-in-mins", str(minutes)]


def has_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a completed Megatron-LM checkpoint (its tracker file): what
    a process started with `--load directory` continues from."""
    return (directory / TRACKER).is_file()


def last_iteration(log: Path) -> int | None:
    """The highest training iteration `log` shows (None: no log, or no iteration in it)."""
    if not log.is_file():
        return None
    return max((r.iteration for r in parse_megatron_log(log.read_text(errors="replace"))),
               default=None)


def run_logged(cmd: Command, log: Path, *, resume: bool, timeout_s: float | None = None,
               note: str = "") -> int:
    """Run `cmd` with its output teed to `log`; returns its exit status (Command.run's).

    With `resume` and a log already there, the log is kept: a `RESUME_MARKER` line (followed
    by `note`) goes at its end, then the new process's output is appended (logparse's segment
    rule). Otherwise the log is written afresh. A run given no time (timeout_s <= 0) starts
    nothing and gets no marker."""
    if not (resume and log.is_file()):
        return cmd.run(log, timeout_s=timeout_s)
    if timeout_s is None or timeout_s > 0:
        # the marker starts a line of its own even after a process killed mid-line
        with open(log, "rb") as f:
            f.seek(max(f.seek(0, 2) - 1, 0))
            newline = "" if f.read(1) in (b"", b"\n") else "\n"
        marker = (f"{RESUME_MARKER} {time.strftime('%Y-%m-%d %H:%M:%S')}: a new process "
                  f"continues this log{note}\n")
        print(marker, end="", flush=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(newline + marker)
    return cmd.run(log, timeout_s=timeout_s, append=True)

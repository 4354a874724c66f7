"""What the launch-script tests share: a bare environment, running a script, and reading the
command blocks its dry run prints (`launch.command.print_command`)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_hyscale.launch.command import COMMAND_BEGIN, COMMAND_END

ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without Megatron-LM, Slurm or torchrun variables, so dry runs
    see a bare machine; HYSCALE_PYTHON is this interpreter."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEGATRON_LM_DIR", "MASTER_ADDR", "WORLD_SIZE", "RANK")
           and not k.startswith("SLURM_")}
    env["HYSCALE_PYTHON"] = sys.executable
    env.update(extra)
    return env


def run_script(path: Path, *args: str, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(path), *args], capture_output=True, text=True,
                          env=env or clean_env(), cwd=ROOT, timeout=120)


def printed_commands(stdout: str) -> list[tuple[str, dict[str, str], list[str]]]:
    """(label, env, argv after `env K=V ...`) of every command block a dry run printed."""
    begin, end = COMMAND_BEGIN.split("{label}")
    found = []
    for block in stdout.split(begin)[1:]:
        label, rest = block.split(end + "\n", 1)
        words = shlex.split(rest.split(COMMAND_END)[0].replace("\\\n", " "))
        assert words[0] == "env"
        env = {}
        i = 1
        while "=" in words[i] and not words[i].startswith("-"):
            key, value = words[i].split("=", 1)
            env[key] = value
            i += 1
        found.append((label, env, words[i:]))
    return found

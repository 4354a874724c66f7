"""Run this checkout's `scripts/inspect_sm90.py` (the sm_90a compile report) from a test.

As a subprocess: test modules import the kernels under TRITON_INTERPRET=1, and the tool needs
them compiled, so the child runs without it (or with it, `interpret=True`, to test the tool's
refusal).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "inspect_sm90.py"


def run_inspect_sm90(*args: str, interpret: bool = False, timeout: float = 600
                     ) -> subprocess.CompletedProcess[str]:
    """`python scripts/inspect_sm90.py ARGS` from the repository root; its output captured."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)

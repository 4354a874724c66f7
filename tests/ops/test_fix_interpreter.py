"""common.fix_interpreter applies wherever Triton interprets: TRITON_INTERPRET=1 and the other
spellings Triton accepts (true), else not at all (each in a fresh process: Triton reads the
variable once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A bf16 product in the interpreter: without the fix its tl.dot multiplies the raw bf16 bits as
# integers; with it the operands are widened to fp32 first.
SCRIPT = """
import torch, triton, triton.language as tl
from triton.runtime import interpreter
from megatron_hyscale.ops.kernels.common import fix_interpreter

fix_interpreter()
print("patched", getattr(interpreter._patch_lang_tensor, "_hyscale_fixed", False))

@triton.jit
def dot16(a_ptr, b_ptr, c_ptr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
    tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b))

a = torch.arange(256, dtype=torch.float32).reshape(16, 16).remainder(7).sub(3).bfloat16()
b = torch.arange(256, dtype=torch.float32).reshape(16, 16).remainder(5).sub(2).bfloat16()
c = torch.empty(16, 16)
dot16[(1,)](a, b, c)
print("exact", torch.equal(c, a.float() @ b.float()))
"""


def run(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if value is not None:
        env["TRITON_INTERPRET"] = value
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("value", ["1", "true"])
def test_patches_apply_under_every_interpreter_spelling(value):
    out = run(value)
    assert "patched True" in out, out[-2000:]
    assert "exact True" in out, out[-2000:]


def test_nothing_is_patched_without_the_interpreter():
    out = run(None)
    assert "patched False" in out, out[-2000:]

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

@triton.jit
def to_bf16(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))

# Halfway cases both ways, a carry into the exponent, the largest finite, infinities, NaN.
x = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(0)),
               torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 3 * 2**-9, 2 - 2**-9, 3.4e38,
                             float("inf"), -float("inf"), -0.0, 1e-40])])
x = torch.cat([x, torch.zeros(4096 - x.numel())])
y = torch.empty(4096, dtype=torch.bfloat16)
to_bf16[(1,)](x, y, N=4096)
print("nearest", torch.equal(y, x.bfloat16()))
nan = torch.full((16,), float("nan"))
to_bf16[(1,)](nan, y[:16], N=16)
print("nan", bool(y[:16].isnan().all()))
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
    assert "nearest True" in out and "nan True" in out, out[-2000:]


def test_nothing_is_patched_without_the_interpreter():
    out = run(None)
    assert "patched False" in out, out[-2000:]


def test_the_unpatched_interpreter_truncates(monkeypatch):
    """The cast fix is needed (the test above can fail): Triton's own conversion truncates."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter._convert_float, "__wrapped__", interpreter._convert_float)
    x = np.array([1 + 3 * 2**-9], dtype=np.float32)  # above halfway: nearest rounds up
    bits = convert(x, tl.float32, tl.bfloat16, None).view(np.uint16)
    assert int(bits[0]) == 0x3F80  # 1.0: truncated (nearest would be 0x3F81)

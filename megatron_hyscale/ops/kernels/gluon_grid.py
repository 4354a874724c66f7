"""Which (batch, query, head block) a Gluon kernel's program computes, for both grid forms of
`common.launch_grid` (decoded as `sparse_attention._coords` does for the Triton kernels: a
Gluon kernel cannot call a Triton function)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def program_coords(T, NG: gl.constexpr):
    """(batch, query, head block) of this program: NG > 0, a 1-D grid with a query's NG head
    blocks adjacent; NG = 0, a (B x T, blocks) grid."""
    if NG > 0:
        pid = gl.program_id(0).to(gl.int64)
        pid_q = pid // NG
        hb = (pid % NG).to(gl.int32)
    else:
        pid_q = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1)
    return pid_q // T, pid_q % T, hb

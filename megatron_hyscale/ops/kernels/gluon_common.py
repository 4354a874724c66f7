"""Device functions the Gluon kernels share (a Gluon kernel cannot call a Triton function):
which (batch, query, head block) a program or a lockstep work item computes, a block's query
heads, a row's dense prefix and its slots' keys, the lockstep pace, the cp.async gather of a
block of rows, an opaque zero that keeps shared-memory descriptors inside a loop; and the
strides their launches pass."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp


@gluon.jit
def program_coords(T, NG: gl.constexpr):
    """(batch, query, head block) of this program, for both grid forms of
    `common.launch_grid` (decoded as `sparse_attention._coords` does for the Triton kernels):
    NG > 0, a 1-D grid with a query's NG head blocks adjacent; NG = 0, a (B x T, blocks) grid."""
    if NG > 0:
        pid = gl.program_id(0).to(gl.int64)
        pid_q = pid // NG
        hb = (pid % NG).to(gl.int32)
    else:
        pid_q = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1)
    return pid_q // T, pid_q % T, hb




@gluon.jit
def item_coords(w, T, NHB):
    """(batch, query, head block) of lockstep work item w (a query's NHB head blocks
    adjacent); 64-bit, as program_coords': t x a query stride passes 2^31 (GLM-5.1's q at
    128K)."""
    w = w.to(gl.int64)
    q = w // NHB
    return q // T, q % T, (w % NHB).to(gl.int32)


@gluon.jit
def work_item_count(pid, P, W, LOCKSTEP: gl.constexpr):
    """Work items this program computes: in lockstep, W items taken every P-th from pid; else
    its own one."""
    if LOCKSTEP:
        n_items = gl.cdiv(W - pid, P)
    else:
        n_items = 1
    return n_items


@gluon.jit
def work_item_coords(pid, n, P, T, NHB, NG: gl.constexpr, LOCKSTEP: gl.constexpr):
    """(batch, query, head block) of this program's n-th work item (`work_item_count`)."""
    if LOCKSTEP:
        b, t, hb = item_coords(pid + n * P, T, NHB)
    else:
        b, t, hb = program_coords(T, NG)
    return b, t, hb


@gluon.jit
def query_heads(hb, H, BLOCK_H: gl.constexpr, PAD_HEADS: gl.constexpr, layout: gl.constexpr):
    """(head indices int64, which are real heads) of head block hb, in `layout` (a slice):
    with PAD_HEADS the rows past the H heads read head 0's row, masked off."""
    heads = (hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=layout)).to(gl.int64)
    if PAD_HEADS:
        every = heads < H
        heads = gl.where(every, heads, 0)
    else:
        every = gl.full([BLOCK_H], 1, gl.int1, layout=layout)
    return heads, every


@gluon.jit
def prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX: gl.constexpr):
    """Keys 0 .. n - 1 that row (b, t) attends before its listed indices (HCA's dense prefix,
    `sparse_attention`'s prefix_lengths); 0 without a prefix."""
    if HAS_PREFIX:
        n_pre = gl.load(pre_ptr + b * spb + t * spt).to(gl.int32)
    else:
        n_pre = 0
    return n_pre


@gluon.jit
def slot_keys(idx_base, sik, offs, NK, n_pre, HAS_PREFIX: gl.constexpr):
    """Key index of each slot in offs (-1 for an unused slot or one past the row's n_pre + NK):
    with HAS_PREFIX, slot j < n_pre is key j and slot j >= n_pre the listed index j - n_pre,
    as the Triton kernels' `sparse_attention._load_rows`."""
    if HAS_PREFIX:
        listed = offs - n_pre
        idx = gl.load(idx_base + listed * sik, mask=(listed >= 0) & (listed < NK), other=-1)
        idx = gl.where(listed < 0, offs, idx)
    else:
        idx = gl.load(idx_base + offs * sik, mask=offs < NK, other=-1)
    return idx


@gluon.jit
def item_steps(n_steps, n_pre, NK, SLOTS: gl.constexpr, HAS_PREFIX: gl.constexpr):
    """Key steps (of SLOTS slots each) of a work item: the launch's n_steps, or with a dense
    prefix the row's own (its n_pre + NK slots)."""
    if HAS_PREFIX:
        n_it = gl.cdiv(n_pre + NK, SLOTS)
    else:
        n_it = n_steps
    return n_it


@gluon.jit
def steps_before(done, n, n_steps, HAS_PREFIX: gl.constexpr):
    """Key steps before a program's n-th work item, which the mbarriers' phases count: the sum
    of the earlier items' own counts (`done`) with a dense prefix, else n x the launch's
    n_steps (the same number)."""
    if HAS_PREFIX:
        base = done
    else:
        base = n * n_steps
    return base


@gluon.jit
def lockstep_wait(count_ptr, need, SPINS: gl.constexpr):
    """Spin (at most SPINS reads) until a wave's counter reaches `need`: a pace, not a
    dependency (nothing is read that the counted programs wrote), so giving up is safe."""
    seen = gl.load(count_ptr, volatile=True)
    spins = 0
    while (seen < need) & (spins < SPINS):
        seen = gl.load(count_ptr, volatile=True)
        spins += 1


@gluon.jit
def gather_rows(dst, rows, valid, WIDTH: gl.constexpr, layout: gl.constexpr):
    """cp.async the block rows[:, None] + [0, WIDTH) into dst [len(rows) x WIDTH], rows that
    are not `valid` zero-filled; rows (pointers) and valid in SliceLayout(1, layout). One call
    a block: Triton puts a barrier between two copies into the same buffer."""
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    mask = valid[:, None] & gl.full([rows.shape[0], WIDTH], 1, gl.int1, layout=layout)
    cp.async_copy_global_to_shared(dst, rows[:, None] + cols[None, :], mask=mask)


@gluon.jit
def opaque_zero(x):
    """0, computed where it is used: indexing shared memory with it keeps the wgmma descriptors
    of a fixed buffer in the loop. A partition that always reads the same buffers otherwise
    has LLVM hoist all of its products' 64-bit k-step descriptors out of the loop, where they
    spill."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


def kernel_strides(x: torch.Tensor, n: int) -> tuple[int, ...]:
    """x's first n strides as the Gluon kernels take them: a size-1 dimension's as 0. It is
    never stepped along, so its stride is arbitrary (a transposed view's batch stride of 1, as
    the DSA layer's dout of one sequence has), and 0 passes the kernels' stride checks
    (`sparse_mla_fwd_sm90.STRIDE_MULTIPLE`) and keeps Triton's proof of 16-byte alignment."""
    return tuple(0 if size == 1 else st
                 for size, st in zip(x.shape[:n], x.stride()[:n], strict=True))

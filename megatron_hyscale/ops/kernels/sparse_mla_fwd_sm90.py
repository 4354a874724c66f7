"""Sparse attention forward for absorbed MLA on Hopper (sm_90), in Gluon.

Shapes: q [B, T, Hq, D_MAIN + D_TAIL] bf16 / fp16 (576 = 512 + 64 for DSA), k [B, S, 1, same],
V = k[..., :D_MAIN]; indices int32 / int64 [B, T, K] or [B, T, 1, K] (-1 = unused slot).
out [B, T, Hq, D_MAIN] in q's dtype, lse fp32 [B, T, Hq] (natural log; -inf for a row with no
valid index). The Triton forward's results (`sparse_attention._fwd_kernel`) up to fp32 rounding
order. `sparse_attention.sparse_attention_fwd` dispatches here; this module imports only the
pieces the kernels share (`common`), never the Triton kernels' module.

Algorithm: one program per (query, block of 64 heads), two warpgroups. The selected key rows are
gathered with cp.async into two shared tiles; tile j + 1's gather is issued before tile j's
S = Q K^T, so it overlaps tile j's two products and its softmax. Triton's pipeliner issued it
after the P V product instead, leaving only that product to hide it behind: its compiled loop
waits for every outstanding copy at the top (`DEPBAR.LE SB0, 0x0`). Products are async wgmma
(each warpgroup: S for half the keys, O for half the value channels), online base-2 softmax.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from megatron_hyscale.ops.checks import KernelVariants
from megatron_hyscale.ops.kernels.common import LN2_JIT, LOG2E, launch_grid, on_hopper
from megatron_hyscale.ops.kernels.gluon_common import kernel_strides, program_coords
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions

# Query heads a program (the products' M: one wgmma tile height per warpgroup).
BLOCK_H = 64
# Keys a step. The [64 x 576] bf16 query, two [64 x 576] key tiles and P's [64 x 64] take 224.5
# of the H200's 227 KiB of shared memory; 32 keys would leave room for a third key tile but
# halve each warpgroup's S product (64 x 16: its shared-memory operand reads then bound the
# tensor core).
BLOCK_N = 64
NUM_WARPS = 8
# The row strides of q and k must be multiples of this many elements: the copies move 16 bytes
# (8 elements) and Triton proves their alignment only from integer arguments divisible by 16
# (a stride of 8 x an odd number compiles to 2-byte copies, which cp.async cannot do).
STRIDE_MULTIPLE = 16
# The tail channels after the power-of-two main part (576 = 512 + 64): the gathers' layout
# covers 64 channels a row, so narrower tails are left to the Triton forward.
TAIL = 64


@gluon.jit
def _gather_rows(dst, base, rows, cols, stride_row):
    """cp.async the [rows x cols] block base[rows[:, None] * stride_row + cols[None, :]]."""
    cp.async_copy_global_to_shared(dst, base + rows[:, None] * stride_row + cols[None, :])


@gluon.jit
def _tile_rows(idx_base, sik, n0, NK, layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key rows of slots n0 .. n0 + BLOCK_N in `layout` (row 0 for -1 and past NK: those
    slots are masked out of the scores, so any in-range row will do)."""
    offs = n0 + gl.arange(0, BLOCK_N, layout=layout)
    idx = gl.load(idx_base + offs * sik, mask=offs < NK, other=-1).to(gl.int64)
    return gl.where(idx >= 0, idx, 0)


@gluon.jit
def _tile_valid(idx_base, sik, n0, NK, layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Which slots n0 .. n0 + BLOCK_N hold a key, in `layout`. The loop reads a tile's indices
    twice, here in the scores' layout and in `_tile_rows` in the gathers': the second read hits
    L1, where converting one layout to the other costs a shared-memory round trip and a
    barrier."""
    offs = n0 + gl.arange(0, BLOCK_N, layout=layout)
    return gl.load(idx_base + offs * sik, mask=offs < NK, other=-1) >= 0


@gluon.jit
def _sparse_mla_fwd_kernel(
    q_ptr, k_ptr, idx_ptr, out_ptr, lse_ptr,
    T, NK, qk_scale,
    sqb, sqt, sqh, skb, sks, sib, sit, sik, sob, sot, soh, slb, slt, slh,
    D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    NG: gl.constexpr, q_main_sl: gl.constexpr, q_tail_sl: gl.constexpr,
    k_main_sl: gl.constexpr, k_tail_sl: gl.constexpr, p_sl: gl.constexpr,
):
    """out[h] = softmax(q[h] . K_sel * scale) @ K_sel[:, :D_MAIN] for one query's head block.

    Every channel stride is 1 and every row stride a multiple of STRIDE_MULTIPLE; NK >= 1 (the
    wrapper checks both).
    NG: the grid's form (`gluon_common.program_coords`).
    """
    b, t, hb = program_coords(T, NG)

    # S [heads x keys] and O [heads x channels]: warps 4 x 2, so each warpgroup holds S for half
    # the keys and O for half the channels; P V reads P from shared memory (both halves).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_MAIN // 2, 16])
    # Gathers: 16-byte vectors, a warp covering 4 rows x 64 channels.
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, ld_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, ld_layout)

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_main_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_MAIN], q_main_sl)
    q_tail_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_TAIL], q_tail_sl)
    k_main_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_MAIN], k_main_sl)
    k_tail_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_TAIL], k_tail_sl)
    p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)

    cols_m = gl.arange(0, D_MAIN, layout=col_l)
    cols_t = D_MAIN + gl.arange(0, D_TAIL, layout=col_l)
    heads = (hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_l)).to(gl.int64)
    q_base = q_ptr + b * sqb + t * sqt
    k_base = k_ptr + b * skb
    idx_base = idx_ptr + b * sib + t * sit

    # Prologue: the query and tile 0 in one copy group; tile 1's rows into registers.
    _gather_rows(q_main_s, q_base, heads, cols_m, sqh)
    _gather_rows(q_tail_s, q_base, heads, cols_t, sqh)
    rows = _tile_rows(idx_base, sik, 0, NK, row_l, BLOCK_N)
    _gather_rows(k_main_s.index(0), k_base, rows, cols_m, sks)
    _gather_rows(k_tail_s.index(0), k_base, rows, cols_t, sks)
    cp.commit_group()
    rows_next = _tile_rows(idx_base, sik, BLOCK_N, NK, row_l, BLOCK_N)
    valid = _tile_valid(idx_base, sik, 0, NK, gl.SliceLayout(0, s_layout), BLOCK_N)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    # Each thread's share of the row sums, reduced over the keys once after the loop (a
    # reduction a tile would cost three barriers).
    l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    o = gl.zeros([BLOCK_H, D_MAIN], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)

    n_tiles = gl.cdiv(NK, BLOCK_N)
    for j in range(n_tiles):
        buf = j % 2
        # Tile j landed (this thread's copies), visible to the tensor cores (async proxy) and
        # from every thread (the barrier). Both warpgroups finished tile j - 1's P V before the
        # barrier, so its buffer takes tile j + 1 now, while tile j is computed. (Issuing it
        # before this wait, two tiles in flight, measured no faster: BENCHMARKS.md.)
        cp.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        if j + 1 < n_tiles:
            _gather_rows(k_main_s.index(1 - buf), k_base, rows_next, cols_m, sks)
            _gather_rows(k_tail_s.index(1 - buf), k_base, rows_next, cols_t, sks)
        cp.commit_group()  # empty after the last tile: the next wait counts groups, not copies
        rows_next = _tile_rows(idx_base, sik, (j + 2) * BLOCK_N, NK, row_l, BLOCK_N)
        valid_next = _tile_valid(idx_base, sik, (j + 1) * BLOCK_N, NK,
                                 gl.SliceLayout(0, s_layout), BLOCK_N)

        # Each product is waited for before any register of its accumulator is touched: an
        # accumulator read while a wgmma is in flight makes ptxas serialize every wgmma of the
        # kernel (C7514), the 36 k-steps of Q K^T included.
        s = warpgroup_mma(q_main_s, k_main_s.index(buf).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma(q_tail_s, k_tail_s.index(buf).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # A row with no valid key so far keeps m = -inf; shift by 0 there so no inf - inf.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_part = l_part * alpha[:, None] + p
        m_i = m_new
        # Every tile rescales O (128 multiplies a thread): skipping it while the max stays put
        # (a branch around the rescale) compiled with 148 bytes of spills in this loop.
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        # P's two halves meet in shared memory. The previous tile's P V (its reader) was
        # waited for in both warpgroups before this tile's first barrier.
        p_s.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        o = warpgroup_mma(p_s, k_main_s.index(buf), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        valid = valid_next

    # Every copy landed at the last tile's wait (NK >= 1); the reduction below may reuse
    # shared memory the key tiles occupied, so no copy may still be in flight.
    cp.wait_group(0)
    l_i = gl.sum(l_part, axis=1)
    nonempty = l_i > 0.0
    lse2 = gl.where(nonempty, m_i + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))
    inv_l = gl.convert_layout(1.0 / gl.where(nonempty, l_i, 1.0), gl.SliceLayout(1, o_layout))
    out = (o * inv_l[:, None]).to(dtype)
    o_heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + b * sob + t * sot + o_heads[:, None] * soh + o_cols[None, :], out)
    l_heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + b * slb + t * slt + l_heads * slh, lse2 * LN2_JIT)


# --------------------------------------------------------------------------- launch


def variant(q: torch.Tensor, ws: bool = False, prefix: bool = False) -> tuple:
    """The compiled variant a call needs (dtype, channels, query heads, the warp-specialized
    kernel or not, a dense prefix or not): what a failure disables."""
    return q.dtype, q.shape[-1], q.shape[2], ws, prefix


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, dv: int,
            sink: torch.Tensor | None, prefix_lengths: torch.Tensor | None,
            ws: bool = False) -> bool:
    """Whether these inputs are this kernel's case: absorbed MLA on Hopper, q and k both bf16 or
    both fp16, one KV head, query heads a multiple of BLOCK_H, no dense prefix, and the variant
    (ws: the warp-specialized kernel's) not disabled by an earlier failure. Channels: a main
    part of 128 / 256 / 512 (V) and a tail of TAIL, the gathers' row width. The
    warp-specialized kernel also takes DeepSeek-V4's K = V (no tail: v None, dv = all of K),
    a sink, a dense prefix (HCA's prefix_lengths) and fewer than BLOCK_H query heads (one
    block padded with zero queries whose rows are not stored: tensor parallelism's share of
    GLM-5.1's 64)."""
    if not on_hopper(q):
        return False
    d = q.shape[-1]
    d_main = 1 << (d.bit_length() - 1)
    tails = (0, TAIL) if ws else (TAIL,)
    return (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v is None
            and dv == d_main and d_main in (128, 256, 512) and d - d_main in tails
            and k.shape[2] == 1 and (q.shape[2] % BLOCK_H == 0 or ws and q.shape[2] < BLOCK_H)
            and (ws or sink is None and prefix_lengths is None)
            and variant(q, ws, prefix_lengths is not None) not in _disabled)


def layout_problem(q: torch.Tensor, k: torch.Tensor) -> tuple[str, str] | None:
    """(cause, detail) of what keeps q / k from the kernel's 16-byte copies, None if nothing:
    the strides it uses (q's batch, token and head rows; k's batch and key rows) must be
    multiples of STRIDE_MULTIPLE, the channels unit-stride, the data 16-byte aligned."""
    for name, x, rows in (("q", q, kernel_strides(q, 3)), ("k", k, kernel_strides(k, 2))):
        if x.stride(-1) != 1 or any(st % STRIDE_MULTIPLE for st in rows):
            return (f"{name}'s rows are not multiples of {STRIDE_MULTIPLE} unit-stride elements",
                    f"strides {tuple(x.stride())}")
        if x.data_ptr() % 16:
            return f"{name} is not 16-byte aligned", ""
    return None


_layouts: dict[tuple, tuple] = {}


def shared_layouts(dtype: torch.dtype, d_main: int, d_tail: int) -> tuple:
    """NVMMA layouts of q's and a key tile's main and tail parts and of a P tile, for the
    Gluon forwards and the backward (`sparse_mla_bwd_sm90`, whose dO tile is q's main part's
    shape and whose P / dS tiles are [keys x heads] of the same square shape); d_tail > 0."""
    key = (dtype, d_main, d_tail)
    if key not in _layouts:
        gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
        nv = gl.NVMMASharedLayout.get_default_for
        _layouts[key] = (nv([BLOCK_H, d_main], gdt), nv([BLOCK_H, d_tail], gdt),
                         nv([BLOCK_N, d_main], gdt), nv([BLOCK_N, d_tail], gdt),
                         nv([BLOCK_H, BLOCK_N], gdt))
    return _layouts[key]


def sparse_mla_fwd_sm90(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor,
                        softmax_scale: float, *, sink: torch.Tensor | None = None,
                        options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT,
                        keys_ascending: bool = False,
                        prefix_lengths: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, Hq, D_MAIN], lse fp32 [B, T, Hq]) on inputs that `applies` and
    `layout_problem` accept (sink [Hq]: the warp-specialized kernel's only). A query's head
    blocks (V3.2: two) launch as the Triton kernels' do (`common.launch_grid`,
    options.head_blocks_adjacent); options.fwd_sm90_ws runs the warp-specialized kernel
    (`sparse_mla_fwd_ws_sm90`) instead; the other options are the dispatcher's
    (`sparse_attention.hopper_forward`). keys_ascending: each row's valid keys increase
    already (the lockstep forward skips its sort). prefix_lengths (int [B, T], the
    warp-specialized kernel's only): row (b, t) also attends keys 0 .. n - 1 before its
    indices (HCA's dense prefix)."""
    for name, given in (("sink", sink), ("prefix_lengths", prefix_lengths)):
        if given is not None and not options.fwd_sm90_ws:
            raise ValueError(f"{name}: only the warp-specialized forward (options.fwd_sm90_ws) "
                             "takes one")
    B, T, Hq, d = q.shape
    d_main = 1 << (d.bit_length() - 1)
    out = torch.empty((B, T, Hq, d_main), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, T, Hq), device=q.device, dtype=torch.float32)
    if B * T == 0:
        return out, lse
    if indices.shape[-1] == 0 and prefix_lengths is not None:
        # No listed slot, only the prefix: one unused slot keeps the kernel's NK >= 1.
        indices = indices.new_full((*indices.shape[:-1], 1), -1)
    if indices.shape[-1] == 0:  # no slot at all: every row is empty (lse = its sink if any)
        if sink is not None:
            return out.zero_(), lse.copy_(sink.float().expand(B, T, Hq))
        return out.zero_(), lse.fill_(float("-inf"))
    if indices.dim() == 4:
        indices = indices[:, :, 0]
    # Fewer heads than a block (the warp-specialized kernel's padded block): one program.
    grid, ng = launch_grid(B * T, 1, max(Hq // BLOCK_H, 1), options.head_blocks_adjacent)
    # Without a tail (the warp-specialized kernel's K = V) the tail layouts go unused.
    layouts = shared_layouts(q.dtype, d_main, d - d_main or TAIL)
    if options.fwd_sm90_ws:
        from megatron_hyscale.ops.kernels import sparse_mla_fwd_ws_sm90

        sparse_mla_fwd_ws_sm90.launch(q, k, indices, sink, out, lse, softmax_scale, grid, ng,
                                      layouts, lockstep=options.fwd_lockstep,
                                      lockstep_slack=options.fwd_lockstep_slack,
                                      keys_ascending=keys_ascending,
                                      prefix_lengths=prefix_lengths)
        return out, lse
    sqb, sqt, sqh = kernel_strides(q, 3)
    skb, sks = kernel_strides(k, 2)
    sib, sit, sik = indices.stride()
    sob, sot, soh, _ = out.stride()
    _sparse_mla_fwd_kernel[grid](
        q, k, indices, out, lse, T, indices.shape[-1], softmax_scale * LOG2E,
        sqb, sqt, sqh, skb, sks, sib, sit, sik, sob, sot, soh, *lse.stride(),
        D_MAIN=d_main, D_TAIL=d - d_main, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, NG=ng,
        q_main_sl=layouts[0], q_tail_sl=layouts[1], k_main_sl=layouts[2], k_tail_sl=layouts[3],
        p_sl=layouts[4], num_warps=NUM_WARPS,
    )
    return out, lse


# Variants (`variant`) that failed to compile or launch in this process (`applies` refuses them),
# and the warnings when the kernel cannot run.
_variants = KernelVariants("sparse-mla-fwd-sm90", "Hopper sparse-MLA forward", "Triton forward")
_disabled = _variants.disabled
warn_cannot_run = _variants.warn_cannot_run
disable = _variants.disable

"""Sparse attention forward for absorbed MLA on Hopper (sm_90a), warp-specialized, in Gluon.

Shapes: q [B, T, Hq, D_MAIN + D_TAIL] bf16 / fp16, D_MAIN 128 / 256 / 512 and D_TAIL 64
(absorbed MLA: GLM-5.1, V3.2) or 0 (DeepSeek-V4's K = V: CSA, HCA, the window), k [B, S, 1,
same], V = k[..., :D_MAIN], indices [B, T, K] with -1 unused, optional sink [Hq] (a logit added
to each softmax denominator only), optional prefix_lengths int [B, T] (HCA: row t's slots are
keys 0 .. n_t - 1, then its indices; its own iteration count); out [B, T, Hq, D_MAIN], lse fp32
natural log (-inf for a row without keys or sink). The Triton forward's results
(`sparse_attention._fwd_kernel`) up to fp32 rounding order. `sparse_mla_fwd_sm90`'s wrapper
runs this kernel (`launch`) under `AttentionKernelOptions.fwd_sm90_ws`.

Algorithm: one program per (query, 64 heads), three warpgroups. A producer warpgroup gathers the
selected key rows with cp.async into two stages, each in two halves (channels below D_MAIN / 2;
the rest with the tail), completion counted on mbarriers. Consumer c computes S = Q K^T for the
key tiles of stage c (even tiles, odd tiles); the two exchange their running maxima and P
through shared memory, and each accumulates O for its half of the value channels over both
tiles (its own P from registers, the other's from shared memory): one consumer's softmax runs
under the other's products, no consumer issues a gather, and the half of a stage that only its
own consumer reads is refilled while the iteration still runs.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from megatron_hyscale.ops.kernels.common import (
    LN2_JIT,
    LOG2E,
    LOG2E_JIT,
    SYNC_SPINS,
    lockstep_plan,
)
from megatron_hyscale.ops.kernels.gluon_common import (
    gather_rows,
    item_steps,
    kernel_strides,
    lockstep_wait,
    opaque_zero,
    prefix_length,
    query_heads,
    slot_keys,
    steps_before,
    work_item_coords,
    work_item_count,
)

# Query heads a program: the products' M, one wgmma tile height, so each consumer holds all of
# them (its S is [64 heads x 64 keys], its O [64 heads x D_MAIN / 2]). BLOCK_H and BLOCK_N are
# those of `sparse_mla_fwd_sm90`, whose wrapper builds the shared layouts of both kernels.
BLOCK_H = 64
# Keys a tile. It must equal the tail width: with a tail, consumer 0's P tile [BLOCK_H x
# BLOCK_N] is written over stage 0's tail channels [BLOCK_N x 64] (same shape, same shared
# layout) once its S product has read them; consumer 1's has a buffer of its own (without a
# tail both do). That is what lets the query, two key stages and both P tiles of absorbed MLA
# fit the H200's 227 KiB (225 KiB used).
BLOCK_N = 64
# Warps: consumer 0 is the default partition (the kernel's num_warps); consumer 1 and the
# producer are workers. Registers are set per warpgroup: a consumer holds O's half (128 fp32),
# S (32), P in fp32 and bf16 (48) and the softmax state; the producer holds its four rows'
# addresses (a gather's other copies are immediate offsets). 2 x 232 + 40 = 504 of the 512 a
# thread the SM's 64K registers allow three warpgroups.
CONSUMER_WARPS = 4
PRODUCER_WARPS = 4
CONSUMER_REGS = 232
PRODUCER_REGS = 40
# Registers a thread at launch, before the partitions rebalance them: 384 threads x 168 fit 64K.
MAXNREG = 168

# Buffers. Stage c holds key tile 2i + c of iteration i in two halves: L (main channels below
# HALF = D_MAIN / 2) and R (the other main channels and the tail). Readers:
#   L0: consumer 0's S and its own P V (V channels below HALF);
#   R0: consumer 0's S, then consumer 1's P V with P0 (V channels from HALF), P0 itself being
#       written over R0's tail after consumer 0's S (without a tail, P0 has its own buffer);
#   R1: consumer 1's S and its own P V;
#   L1: consumer 1's S, then consumer 0's P V with P1 (P1 in its own buffer).
# So L0 and R1 are free once their consumer's own P V is done, mid-iteration, and the producer
# refills them (in that order, then R0, L1) while the iteration finishes; each consumer starts
# its S with the half refilled first (L0, R1).
#
# mbarrier protocol. wait(bar, p) returns once the phase of parity p completed; a fresh barrier
# counts its (previous) phase of parity 1 as completed. Every arrival of a 4-warp consumer is one
# thread's, after Triton's partition barrier (bar.sync of its 128 threads), so it follows all
# four warps' preceding instructions; a producer arrival is per thread (cp.async's arrive fires
# once that thread's earlier copies landed), hence the counts of 128. Half h = 2 c + (0: L, 1:
# R). Iteration i (tiles 2i and 2i + 1, parity i & 1):
#   q_bar      (count 128): the query's gather landed; the consumers wait parity 0, once.
#   ready[h]   (count 128): half h of this iteration's tile landed.
#   empty[h]   (count 1): half h's last reader (above) is done with it; the producer waits parity
#              (i & 1) ^ 1 before refilling it (iteration 0 passes at once). A half's other
#              reader finished before: consumer c's S reads R0 / L1 before it publishes the P
#              that the last reader waits for.
#   m_ready[0] (count 1): consumer 0's max over the running max and tile 2i, in m_s[0].
#   m_ready[1] (count 1): consumer 1's new running max (m_s[0] and tile 2i + 1), in m_s[1].
#   p_ready[c] (count 1): consumer c's P (scaled to the new running max) in shared memory.
#   l_ready[c] (count 1, once): consumer c's row sums in l_s[c] after the loop.
# No barrier completes a phase twice ahead of a waiter: m_ready[0]'s next arrival follows
# consumer 0's wait on m_ready[1], which follows consumer 1's wait on m_ready[0]; m_ready[1]'s
# next arrival follows consumer 1's next wait on m_ready[0]; p_ready[c]'s next arrival follows
# consumer c's wait on m_ready[1 - c] of the next iteration, which the other arrives only after
# its wait on p_ready[c]. The same orders keep m_s and the P buffers from being overwritten
# before they are read.
L = gl.constexpr(0)
R = gl.constexpr(1)


@gluon.jit
def _fill_half(k_main_s, k_tail_s, ready, empty, stage: gl.constexpr, half: gl.constexpr,
               rows, valid, parity, D_MAIN: gl.constexpr, D_TAIL: gl.constexpr,
               layout: gl.constexpr):
    """Wait for half `half` of stage `stage` to be free, gather it, count it on its barrier."""
    HALF: gl.constexpr = D_MAIN // 2
    h: gl.constexpr = 2 * stage + half
    mbarrier.wait(empty.index(h), parity ^ 1)
    main = k_main_s.index(stage).slice(half * HALF, HALF, dim=1)
    gather_rows(main, rows + half * HALF, valid, HALF, layout)
    if half == R and D_TAIL > 0:
        gather_rows(k_tail_s.index(stage), rows + D_MAIN, valid, D_TAIL, layout)
    cp.mbarrier_arrive(ready.index(h), increment_count=False)


@gluon.jit
def _tile_rows(idx_base, sik, k_base, sks, j, NK, n_pre, row_l: gl.constexpr,
               BLOCK_N: gl.constexpr, HAS_PREFIX: gl.constexpr):
    """(row pointers, which hold a key) of key tile j's slots (`gluon_common.slot_keys`)."""
    offs = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=row_l)
    idx = slot_keys(idx_base, sik, offs, NK, n_pre, HAS_PREFIX)
    valid = idx >= 0
    return k_base + gl.where(valid, idx, 0).to(gl.int64) * sks, valid


@gluon.jit
def _producer(q_ptr, k_ptr, idx_ptr, pre_ptr, sync_ptr, q_main_s, q_tail_s, k_main_s,
              k_tail_s, bars, pid, T, NHB, P, W, H, NK, n_iter, sqb, sqt, sqh, skb, sks, sib,
              sit, sik, spb, spt,
              D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr,
              BLOCK_N: gl.constexpr, PAD_HEADS: gl.constexpr, NG: gl.constexpr,
              HAS_PREFIX: gl.constexpr, LOCKSTEP: gl.constexpr, SYNC_SLACK: gl.constexpr,
              SYNC_SPINS: gl.constexpr, WARPS: gl.constexpr):
    """The query block once a work item (PAD_HEADS: rows past the H heads zero-filled), then
    each iteration's halves in the order they are freed: L0, R1 (mid-iteration), R0, L1 (at
    its end). LOCKSTEP: the items pid, pid + P, ...; before an iteration's gathers, wait
    (bounded) until the wave's counter holds the starts of every program at the iteration
    SYNC_SLACK before (their total, as `sparse_mla_bwd_sm90`'s lockstep, by two-tile
    iterations), and count this one's start. HAS_PREFIX: each item's own iteration count, the
    barriers' parity from the iterations of the program's items so far."""
    q_bar, q_empty, ready, empty = bars[0], bars[1], bars[2], bars[3]
    # A warp covers 4 rows x 64 channels in 16-byte vectors (one swizzle atom a row); 4 warps,
    # 16 rows a pass; a thread's copies of a row differ by immediate offsets only.
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, ld_layout)
    done = 0  # iterations of the earlier items: the barriers' phase
    for n in range(work_item_count(pid, P, W, LOCKSTEP)):
        b, t, hb = work_item_coords(pid, n, P, T, NHB, NG, LOCKSTEP)
        n_pre = prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX)
        n_it = item_steps(n_iter, n_pre, NK, 2 * BLOCK_N, HAS_PREFIX)
        if LOCKSTEP:
            active = gl.minimum(P, W - n * P)
            # The consumers' last S products of the previous item read the query block.
            mbarrier.wait(q_empty, (n & 1) ^ 1)
        heads, every = query_heads(hb, H, BLOCK_H, PAD_HEADS, row_l)
        q_rows = q_ptr + b * sqb + t * sqt + heads * sqh
        gather_rows(q_main_s.index(0), q_rows, every, D_MAIN, ld_layout)
        if D_TAIL > 0:
            gather_rows(q_tail_s.index(0), q_rows + D_MAIN, every, D_TAIL, ld_layout)
        cp.mbarrier_arrive(q_bar, increment_count=False)

        idx_base = idx_ptr + b * sib + t * sit
        k_base = k_ptr + b * skb
        for i in range(n_it):
            ph = (steps_before(done, n, n_iter, HAS_PREFIX) + i) & 1
            rows0, valid0 = _tile_rows(idx_base, sik, k_base, sks, 2 * i, NK, n_pre, row_l,
                                       BLOCK_N, HAS_PREFIX)
            rows1, valid1 = _tile_rows(idx_base, sik, k_base, sks, 2 * i + 1, NK, n_pre, row_l,
                                       BLOCK_N, HAS_PREFIX)
            if LOCKSTEP:
                if i >= SYNC_SLACK:
                    lockstep_wait(sync_ptr + n, active * (i - SYNC_SLACK + 1), SYNC_SPINS)
            _fill_half(k_main_s, k_tail_s, ready, empty, 0, L, rows0, valid0, ph, D_MAIN,
                       D_TAIL, ld_layout)
            if LOCKSTEP:
                # One count a program (the replicated scalar's atomic runs once).
                gl.atomic_add(sync_ptr + n, 1, sem="relaxed")
            _fill_half(k_main_s, k_tail_s, ready, empty, 1, R, rows1, valid1, ph, D_MAIN,
                       D_TAIL, ld_layout)
            _fill_half(k_main_s, k_tail_s, ready, empty, 0, R, rows0, valid0, ph, D_MAIN,
                       D_TAIL, ld_layout)
            _fill_half(k_main_s, k_tail_s, ready, empty, 1, L, rows1, valid1, ph, D_MAIN,
                       D_TAIL, ld_layout)
        done += n_it


@gluon.jit
def _s_half(acc, q_main, q_tail, k_stage, k_tail, ready, stage: gl.constexpr,
            half: gl.constexpr, parity, first: gl.constexpr, HALF: gl.constexpr,
            HAS_TAIL: gl.constexpr):
    """Wait for half `half` of the stage and add its channels' part of Q K^T to acc (async)."""
    mbarrier.wait(ready.index(2 * stage + half), parity)
    # The rows came through cp.async (generic proxy); the products read them through the async
    # proxy.
    fence_async_shared()
    acc = warpgroup_mma(q_main.slice(half * HALF, HALF, dim=1),
                        k_stage.slice(half * HALF, HALF, dim=1).permute((1, 0)), acc,
                        use_acc=not first, is_async=True)
    if half == R and HAS_TAIL:
        acc = warpgroup_mma(q_tail, k_tail.permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _consumer(c: gl.constexpr, q_main_s, q_tail_s, k_main_s, k_tail_s, p0_s, p1_s, m_s, l_s,
              bars, idx_ptr, pre_ptr, sink_ptr, out_ptr, lse_ptr, pid, T, NHB, P, W, H, NK,
              n_iter, qk_scale, sib, sit, sik, spb, spt, sob, sot, soh, slb, slt, slh,
              D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr,
              BLOCK_N: gl.constexpr, HAS_SINK: gl.constexpr, PAD_HEADS: gl.constexpr,
              NG: gl.constexpr, HAS_PREFIX: gl.constexpr, LOCKSTEP: gl.constexpr):
    """S for the tiles of stage c, O for value channels c * D_MAIN / 2 .. (c + 1) * D_MAIN / 2
    over every tile; stores its half of out, and consumer 0 the lse. LOCKSTEP: the work
    items pid, pid + P, ... one after the other.

    Each iteration's S is issued at its top. FlashMLA issues consumer 0's next S before its
    last P V completes; here that makes S's accumulator loop-carried while in flight, and
    ptxas then serializes every wgmma of the kernel (compiled for sm_90a, 2026-12-04)."""
    q_bar, q_empty, ready, empty, m_ready, p_ready, l_ready = bars
    HALF: gl.constexpr = D_MAIN // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_main_s.dtype
    # Consumer 0 starts with the half refilled first in its stage (L0), consumer 1 with R1.
    FIRST: gl.constexpr = L if c == 0 else R

    done = 0  # iterations of the earlier items: the barriers' phase
    for n in range(work_item_count(pid, P, W, LOCKSTEP)):
        b, t, hb = work_item_coords(pid, n, P, T, NHB, NG, LOCKSTEP)
        n_pre = prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX)
        n_it = item_steps(n_iter, n_pre, NK, 2 * BLOCK_N, HAS_PREFIX)
        idx_base = idx_ptr + b * sib + t * sit
        slots = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
        o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, n & 1)
        for i in range(n_it):
            ph = (steps_before(done, n, n_iter, HAS_PREFIX) + i) & 1
            offs = (2 * i + c) * BLOCK_N + slots
            valid = slot_keys(idx_base, sik, offs, NK, n_pre, HAS_PREFIX) >= 0
            zero = opaque_zero(i)
            q_main, q_tail = q_main_s.index(zero), q_tail_s.index(zero)
            k_own, k_own_tail = k_main_s.index(c + zero), k_tail_s.index(c + zero)
            # Each product is waited for before its accumulator is touched (ptxas serializes
            # every wgmma of a kernel whose accumulator is read in flight: C7514).
            s = _s_half(s_zero, q_main, q_tail, k_own, k_own_tail, ready, c, FIRST, ph, True, HALF,
                        D_TAIL > 0)
            s = _s_half(s, q_main, q_tail, k_own, k_own_tail, ready, c, 1 - FIRST, ph, False, HALF,
                        D_TAIL > 0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
            tile_max = gl.max(s, axis=1)
            if c == 0:
                # Consumer 0 goes first with a provisional max (its tile only) and rescales once
                # consumer 1 has the new running max.
                m_tile = gl.maximum(m_i, tile_max)
                m_s.index(0).store(m_tile)
                mbarrier.arrive(m_ready.index(0), count=1)
            else:
                mbarrier.wait(m_ready.index(0), ph)
                m_tile = gl.maximum(m_s.index(0).load(row_s), tile_max)
                m_s.index(1).store(m_tile)
                mbarrier.arrive(m_ready.index(1), count=1)
            # A row with no valid key so far keeps m = -inf; shift by 0 there so no inf - inf.
            m_use = gl.where(m_tile == float("-inf"), 0.0, m_tile)
            p = gl.exp2(s - m_use[:, None])
            alpha = gl.exp2(m_i - m_use)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            o = o * gl.convert_layout(alpha, row_o)[:, None]
            p_low = p.to(dtype)
            # Own tile's P V for this consumer's value channels: L0 (c = 0) or R1 (c = 1).
            o = warpgroup_mma(gl.convert_layout(p_low, p_layout),
                              k_own.slice(c * HALF, HALF, dim=1), o, is_async=True)
            if c == 0:
                mbarrier.wait(m_ready.index(1), ph)
                m_new = m_s.index(1).load(row_s)
                # m_new >= m_tile; where m_tile = -inf this row's P and O are 0 (any finite factor).
                f = gl.where(m_tile == float("-inf"), 1.0, gl.exp2(m_tile - m_new))
                # With a tail, P0 takes the place of the tail channels that S has read (waited
                # above).
                p0_s.store((p * f[:, None]).to(dtype))
                fence_async_shared()
                mbarrier.arrive(p_ready.index(0), count=1)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                mbarrier.arrive(empty.index(2 * 0 + L), count=1)
                o = o * gl.convert_layout(f, row_o)[:, None]
                l_i = l_i * f
                m_i = m_new
                mbarrier.wait(p_ready.index(1), ph)
                o = warpgroup_mma(p1_s, k_main_s.index(1 + zero).slice(0, HALF, dim=1), o,
                                  is_async=True)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                mbarrier.arrive(empty.index(2 * 1 + L), count=1)
            else:
                p1_s.store(p_low)
                fence_async_shared()
                mbarrier.arrive(p_ready.index(1), count=1)
                m_i = m_tile
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                mbarrier.arrive(empty.index(2 * 1 + R), count=1)
                mbarrier.wait(p_ready.index(0), ph)
                o = warpgroup_mma(p0_s, k_main_s.index(zero).slice(HALF, HALF, dim=1), o,
                                  is_async=True)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                mbarrier.arrive(empty.index(2 * 0 + R), count=1)
        done += n_it

        if LOCKSTEP:
            # This item's products are done with the query block: the producer may gather the
            # next item's.
            mbarrier.arrive(q_empty, count=1)
        # Both consumers' row sums are relative to the same running max: add them.
        l_s.index(c).store(l_i)
        mbarrier.arrive(l_ready.index(c), count=1)
        mbarrier.wait(l_ready.index(1 - c), n & 1)
        l_i = l_i + l_s.index(1 - c).load(row_s)
        l_heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
        if HAS_SINK:
            # The sink joins the denominator only (as the Triton forward): a row without keys
            # writes zeros and lse = sink.
            sink2 = gl.load(sink_ptr + l_heads, mask=l_heads < H, other=0.0).to(gl.float32)
            sink2 = sink2 * LOG2E_JIT
            m_f = gl.maximum(m_i, sink2)
            rescale = gl.exp2(m_i - m_f)
            l_f = l_i * rescale + gl.exp2(sink2 - m_f)
            o_scale = rescale / l_f
            lse2 = m_f + gl.log2(l_f)
        else:
            nonempty = l_i > 0.0
            o_scale = 1.0 / gl.where(nonempty, l_i, 1.0)
            lse2 = gl.where(nonempty, m_i + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))
        out = (o * gl.convert_layout(o_scale, row_o)[:, None]).to(dtype)
        o_heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_o)
        o_cols = c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = out_ptr + b * sob + t * sot + o_heads[:, None] * soh + o_cols[None, :]
        if PAD_HEADS:  # the padded heads' rows (zero queries) are not outputs
            gl.store(o_ptrs, out, mask=(o_heads < H)[:, None] & (o_cols < D_MAIN)[None, :])
            if c == 0:
                gl.store(lse_ptr + b * slb + t * slt + l_heads * slh, lse2 * LN2_JIT,
                         mask=l_heads < H)
        else:
            gl.store(o_ptrs, out)
            if c == 0:
                gl.store(lse_ptr + b * slb + t * slt + l_heads * slh, lse2 * LN2_JIT)


# NHB not specialized (as the backward's: a constant 1 lets LLVM hoist per-item values).
@gluon.jit(do_not_specialize=["NHB"])
def _sparse_mla_fwd_ws_kernel(
    q_ptr, k_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, lse_ptr, sync_ptr,
    T, H, NK, NHB, P, W, qk_scale,
    sqb, sqt, sqh, skb, sks, sib, sit, sik, spb, spt, sob, sot, soh, slb, slt, slh,
    D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    NG: gl.constexpr, HAS_SINK: gl.constexpr, PAD_HEADS: gl.constexpr, HAS_PREFIX: gl.constexpr,
    LOCKSTEP: gl.constexpr, SYNC_SLACK: gl.constexpr, SYNC_SPINS: gl.constexpr,
    q_main_sl: gl.constexpr, q_tail_sl: gl.constexpr, k_main_sl: gl.constexpr,
    k_tail_sl: gl.constexpr, p_sl: gl.constexpr,
    CONSUMER_WARPS: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """out[h] = softmax(q[h] . K_sel * scale (+ sink)) @ K_sel[:, :D_MAIN] for one query's head
    block.

    Row strides multiples of 16 elements, unit-stride channels, NK >= 1 (the wrapper checks).
    NG: the grid's form (`gluon_common.program_coords`). LOCKSTEP: a grid of P programs over
    W work items (NHB head blocks a query, adjacent), program pid taking items pid, pid + P,
    ...; sync_ptr: one zeroed int32 iteration counter a wave of P items. HAS_PREFIX (not with
    LOCKSTEP): row (b, t) attends keys 0 .. pre[b, t] - 1, then its listed indices; n_iter is
    then each item's own.
    """
    pid = gl.program_id(0)
    n_iter = gl.cdiv(NK, 2 * BLOCK_N)

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_main_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_MAIN], q_main_sl)
    k_main_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_MAIN], k_main_sl)
    if D_TAIL > 0:
        q_tail_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_TAIL], q_tail_sl)
        k_tail_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_TAIL], k_tail_sl)
        p0_s = k_tail_s.index(0)
    else:  # no tail to read: the main buffers stand in for the arguments, never read as tails
        q_tail_s = q_main_s
        k_tail_s = k_main_s
        p0_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)
    p1_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)
    row_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    m_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], row_sl)
    l_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], row_sl)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [4, 1], bar_layout)
    m_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    l_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    producer_threads: gl.constexpr = PRODUCER_WARPS * 32
    mbarrier.init(q_bar, count=producer_threads)
    mbarrier.init(q_empty, count=2)
    for h in gl.static_range(4):
        mbarrier.init(ready.index(h), count=producer_threads)
        mbarrier.init(empty.index(h), count=1)
    for c in gl.static_range(2):
        mbarrier.init(m_ready.index(c), count=1)
        mbarrier.init(p_ready.index(c), count=1)
        mbarrier.init(l_ready.index(c), count=1)
    fence_async_shared()
    bars = (q_bar, q_empty, ready, empty, m_ready, p_ready, l_ready)
    # Each partition's arguments written out: constexprs gathered into a tuple variable first
    # would reach the partitions as runtime values.
    gl.warp_specialize([
        (_consumer, (0, q_main_s, q_tail_s, k_main_s, k_tail_s, p0_s, p1_s, m_s, l_s, bars,
                     idx_ptr, pre_ptr, sink_ptr, out_ptr, lse_ptr, pid, T, NHB, P, W, H, NK,
                     n_iter, qk_scale, sib, sit, sik, spb, spt, sob, sot, soh, slb, slt, slh,
                     D_MAIN, D_TAIL, BLOCK_H, BLOCK_N, HAS_SINK, PAD_HEADS, NG, HAS_PREFIX,
                     LOCKSTEP)),
        (_consumer, (1, q_main_s, q_tail_s, k_main_s, k_tail_s, p0_s, p1_s, m_s, l_s, bars,
                     idx_ptr, pre_ptr, sink_ptr, out_ptr, lse_ptr, pid, T, NHB, P, W, H, NK,
                     n_iter, qk_scale, sib, sit, sik, spb, spt, sob, sot, soh, slb, slt, slh,
                     D_MAIN, D_TAIL, BLOCK_H, BLOCK_N, HAS_SINK, PAD_HEADS, NG, HAS_PREFIX,
                     LOCKSTEP)),
        (_producer, (q_ptr, k_ptr, idx_ptr, pre_ptr, sync_ptr, q_main_s, q_tail_s, k_main_s,
                     k_tail_s, (q_bar, q_empty, ready, empty), pid, T, NHB, P, W, H, NK,
                     n_iter, sqb, sqt, sqh, skb, sks, sib, sit, sik, spb, spt, D_MAIN, D_TAIL,
                     BLOCK_H, BLOCK_N, PAD_HEADS, NG, HAS_PREFIX, LOCKSTEP, SYNC_SLACK,
                     SYNC_SPINS, PRODUCER_WARPS)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------- launch


def launch(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor | None,
           out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, grid: tuple,
           ng: int, layouts: tuple, lockstep: bool = False, lockstep_slack: int = 1,
           keys_ascending: bool = False,
           prefix_lengths: torch.Tensor | None = None) -> None:
    """Fill out [B, T, Hq, D_MAIN] and lse [B, T, Hq] for `sparse_mla_fwd_sm90`, whose wrapper
    checked the inputs (`applies`: a tail of 0 or BLOCK_N channels; `layout_problem`), took
    care of empty calls, made indices [B, T, K] with K >= 1, chose the grid
    (`common.launch_grid`: ng head blocks adjacent, or 0) and the shared layouts (its
    `shared_layouts`: q's and a key tile's main and tail parts, a P tile, the last also the
    tail's, which P0 is written over). lockstep: one program an SM over the query head blocks,
    each row's keys sorted here (not where keys_ascending: the caller's rows are in that
    order already, `ops/key_order.py`), the programs of a wave kept within lockstep_slack
    two-tile iterations of each other (`common.lockstep_plan`), so that their key gathers hit
    L2. prefix_lengths (int [B, T], HCA's dense prefix): row (b, t) also attends keys
    0 .. n - 1 before its indices; it runs unpaced (the pace counts equal iterations a row,
    and every row reads the same prefix keys from L2 anyway)."""
    if prefix_lengths is not None:
        lockstep = False
    d = q.shape[-1]
    d_main = out.shape[-1]
    sqb, sqt, sqh = kernel_strides(q, 3)
    skb, sks = kernel_strides(k, 2)
    q_main_sl, q_tail_sl, k_main_sl, k_tail_sl, p_sl = layouts
    n_hb = max(q.shape[2] // BLOCK_H, 1)
    work = q.shape[0] * q.shape[1] * n_hb
    programs, sync = work, lse
    if lockstep:
        programs, sync = lockstep_plan(work, q.device, lockstep_slack)
        grid, ng = (programs,), n_hb
        if not keys_ascending:
            indices = indices.sort(dim=-1).values
    # Without a prefix: a placeholder pointer and zero strides (no compiled variant of their
    # own).
    pre, pre_strides = ((prefix_lengths, kernel_strides(prefix_lengths, 2))
                        if prefix_lengths is not None else (indices, (0, 0)))
    _sparse_mla_fwd_ws_kernel[grid](
        q, k, indices, pre, sink.contiguous() if sink is not None else lse, out, lse, sync,
        q.shape[1], q.shape[2], indices.shape[-1], n_hb, programs, work, softmax_scale * LOG2E,
        sqb, sqt, sqh, skb, sks, *indices.stride(), *pre_strides,
        *out.stride()[:3], *lse.stride(),
        D_MAIN=d_main, D_TAIL=d - d_main, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, NG=ng,
        HAS_SINK=sink is not None, PAD_HEADS=q.shape[2] < BLOCK_H,
        HAS_PREFIX=prefix_lengths is not None,
        LOCKSTEP=lockstep, SYNC_SLACK=lockstep_slack, SYNC_SPINS=SYNC_SPINS,
        q_main_sl=q_main_sl, q_tail_sl=q_tail_sl, k_main_sl=k_main_sl, k_tail_sl=k_tail_sl,
        p_sl=p_sl, CONSUMER_WARPS=CONSUMER_WARPS, PRODUCER_WARPS=PRODUCER_WARPS,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=CONSUMER_WARPS, maxnreg=MAXNREG,
    )

"""Sparse attention backward for absorbed MLA and DeepSeek-V4's K = V on Hopper (sm_90a),
warp-specialized, in Gluon.

Shapes: q [B, T, Hq, D_MAIN + D_TAIL] bf16 / fp16 (D_MAIN 128 / 256 / 512, D_TAIL 64: GLM-5.1,
V3.2; or 0: DeepSeek-V4's K = V), k [B, S, 1, same], V = k[..., :D_MAIN]; indices [B, T, K] (-1
unused, distinct within a row); out, dout [B, T, Hq, D_MAIN]; lse (and its gradient dlse) fp32
[B, T, Hq]; optional sink [Hq]; optional prefix_lengths int [B, T] (HCA: row t's slots are
keys 0 .. n_t - 1, then its indices; its own tile count). Writes dq [B, T, Hq, D] in q's dtype
and adds dK (dV merged into its first D_MAIN channels) into an fp32 [B, S, 1, D] buffer with
atomics; with a sink, each (query, head)'s -p_sink * Delta into an fp32 [B, T, Hq] buffer. The
Triton backward's results (`sparse_attention._bwd_dq_kernel` with FUSE_DKV) up to fp32 rounding
order.

Algorithm: one program per (query, 64 heads), three warpgroups, every product computed once.
A producer warpgroup gathers q and dO once and then each 64-key tile's rows with cp.async.
Consumer c takes keys 32c .. 32c + 31 of a tile for S = Q K^T, P = exp(S - lse), dP = dO V^T
and dS = P (dP - Delta) scale, and stores P and dS transposed ([keys x heads]) into shared
memory; then, over all 64 keys, dQ += dS K for its half of the channels and dK = dS^T Q + P^T dO
for its half (64-channel products), added into the key rows from registers. The key tile is
released after the dQ products, so the next tile's gather runs under the dK products and their
atomics, which bound the kernel (T x K x D fp32 additions).
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

from megatron_hyscale.ops.checks import KernelVariants
from megatron_hyscale.ops.kernels.common import (
    LOG2E,
    LOG2E_JIT,
    SYNC_SPINS,
    lockstep_plan,
    on_hopper,
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
from megatron_hyscale.ops.kernels.sparse_mla_fwd_sm90 import STRIDE_MULTIPLE, TAIL

# Query heads a program: the M of S, dP and dQ (one wgmma tile height) and the K of dK's
# products. Shared memory holds q and dO [64 x D_MAIN] and one key tile [64 x D]: at D = 576
# that is 208 KiB of the H200's 227 (P and dS transposed: 16 KiB more), so one key tile, not a
# ring: the producer refills it while the consumers run the dK products and atomics.
BLOCK_H = 64
# Keys a tile: dK's M (64 keys, so its accumulator rows are key rows and a thread's atomics
# cover consecutive channels of one row); each consumer's S and dP take half of them.
BLOCK_N = 64
# Channels of one dK product: a [64 keys x 64] fp32 accumulator is 32 registers a thread. A
# chunk's products are waited for before its atomics: issuing the next chunk's first (two
# accumulators live) made ptxas serialize every wgmma of consumer 1, which also holds the dQ
# tail (160 registers of dQ; compiled for sm_90a, 2026-12-05).
DK_CHUNK = gl.constexpr(64)
# DK_VEC4: each dK chunk leaves the wgmma accumulator layout (a thread holds 2 neighbouring
# channels of each 8-channel group) for this one, where it holds 4 consecutive channels: lanes
# 2m and 2m + 1 swap halves (warp shuffles) and every atomic becomes a 16-byte
# REDG.E.ADD.F32x4, half the reduction instructions and L2 requests. Bases over (key row,
# channel) of a [64 x 64] chunk: registers (channels 1, 2; row 8; channels 16, 32), lanes
# (channels 8, 4; rows 1, 2, 4), warps (rows 16, 32): a warp keeps its 16 rows.
RED_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]],
    lane_bases=[[0, 8], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
# Partitions: consumer 0 is the default one (the kernel's num_warps), consumer 1 and the
# producer are workers. A consumer holds its dQ half (128 fp32 registers; consumer 1 also the
# tail's 32), S and dP (16 each), P and dS, and one dK chunk at a time; the producer a key
# tile's row addresses. 2 x 240 + 24 = 504 of the 512 a thread the SM's 64K registers allow
# three warpgroups (at 232 consumer 1 reloaded spilled addresses in its loop).
CONSUMER_WARPS = 4
PRODUCER_WARPS = 4
CONSUMER_REGS = 240
PRODUCER_REGS = 24
MAXNREG = 168
# Channels a Delta load covers at a time (Delta = rowsum(dO * O) for the consumer's half).
DELTA_CHUNK = gl.constexpr(64)

# mbarrier protocol (wait(bar, p) returns once the phase of parity p completed; a fresh barrier
# counts its phase of parity 1 as completed). A consumer's arrival is one thread's after the
# partition barrier, so it follows its four warps' earlier work; the producer's are cp.async
# arrivals, one a thread, hence counts of 128. Iteration i (key tile i, parity i & 1):
#   q_bar      (128): q and dO landed; the consumers wait parity 0 once.
#   k_ready    (128): tile i landed.
#   k_empty    (2):   both consumers' dQ products of tile i are done (the last readers of the
#                     key tile: S and dP read it before); before gathering tile i the
#                     producer waits parity (i & 1) ^ 1, tile i - 1's release (tile 0 passes
#                     at once: the fresh barrier).
#   ps_ready[c] (1):  consumer c's halves of P and dS of tile i are in shared memory.
#   ps_empty   (2):   both consumers' dK products of tile i are done (the last readers of P and
#                     dS); consumer c waits parity (i & 1) ^ 1 before storing tile i's.
#   d_ready[c] (1, once): consumer c's half of Delta is in d_s[c].
# No barrier completes a phase twice ahead of its waiter: consumer c arrives on ps_ready[c] for
# tile i + 1 only after ps_empty(i), which needs the other consumer's arrival after its wait on
# ps_ready[c](i); k_empty(i + 1) needs k_ready(i + 1), which the producer arrives only after
# waiting k_empty(i); ps_empty(i + 1) needs both ps_ready(i + 1), each after ps_empty(i).


@gluon.jit
def _slot_index(idx_base, sik, n0, NK, n_pre, slots, HAS_PREFIX: gl.constexpr):
    """Key index of slots n0 + slots (`gluon_common.slot_keys`: -1 for an unused slot or one
    past the row's slots)."""
    return slot_keys(idx_base, sik, n0 + slots, NK, n_pre, HAS_PREFIX)


@gluon.jit
def _producer(q_ptr, k_ptr, idx_ptr, pre_ptr, dout_ptr, sync_ptr, q_main_s, q_tail_s, do_s,
              k_main_s, k_tail_s, q_bar, q_empty, k_ready, k_empty, pid, T, NHB, P, W, H, NK,
              n_tiles, sqb, sqt, sqh, skb, sks, sib, sit, sik, spb, spt, sdob, sdot, sdoh,
              D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr,
              BLOCK_N: gl.constexpr, PAD_HEADS: gl.constexpr, NG: gl.constexpr,
              HAS_PREFIX: gl.constexpr, LOCKSTEP: gl.constexpr, SYNC_SLACK: gl.constexpr,
              SYNC_SPINS: gl.constexpr, WARPS: gl.constexpr):
    """q and dO once a work item (PAD_HEADS: rows past the H heads zero-filled), then each key
    tile once the consumers' dQ products released the last. LOCKSTEP: the program's items
    pid, pid + P, ...; before a tile's gather, wait (bounded) until the wave's counter holds
    the starts of every program at the tile SYNC_SLACK before (their total: a fast program's
    extra starts count too), and count this one's start. HAS_PREFIX: each item's own tile
    count, the barriers' parity from the tiles of the program's items so far."""
    # A warp covers 4 rows x 64 channels in 16-byte vectors (one swizzle atom a row).
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, ld_layout)
    slots = gl.arange(0, BLOCK_N, layout=row_l)
    done = 0  # key tiles of the earlier items: the barriers' phase
    for n in range(work_item_count(pid, P, W, LOCKSTEP)):
        b, t, hb = work_item_coords(pid, n, P, T, NHB, NG, LOCKSTEP)
        n_pre = prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX)
        n_it = item_steps(n_tiles, n_pre, NK, BLOCK_N, HAS_PREFIX)
        if LOCKSTEP:
            active = gl.minimum(P, W - n * P)
            # The consumers are done with the last item's q and dO.
            mbarrier.wait(q_empty, (n & 1) ^ 1)
        heads, every = query_heads(hb, H, BLOCK_H, PAD_HEADS, row_l)
        q_rows = q_ptr + b * sqb + t * sqt + heads * sqh
        gather_rows(q_main_s, q_rows, every, D_MAIN, ld_layout)
        if D_TAIL > 0:
            gather_rows(q_tail_s, q_rows + D_MAIN, every, D_TAIL, ld_layout)
        gather_rows(do_s, dout_ptr + b * sdob + t * sdot + heads * sdoh, every, D_MAIN,
                    ld_layout)
        cp.mbarrier_arrive(q_bar, increment_count=False)

        idx_base = idx_ptr + b * sib + t * sit
        k_base = k_ptr + b * skb
        for j in range(n_it):
            g = steps_before(done, n, n_tiles, HAS_PREFIX) + j
            idx = _slot_index(idx_base, sik, j * BLOCK_N, NK, n_pre, slots, HAS_PREFIX)
            valid = idx >= 0
            rows = k_base + gl.where(valid, idx, 0).to(gl.int64) * sks
            mbarrier.wait(k_empty, (g & 1) ^ 1)
            if LOCKSTEP:
                if j >= SYNC_SLACK:
                    lockstep_wait(sync_ptr + n, active * (j - SYNC_SLACK + 1), SYNC_SPINS)
            gather_rows(k_main_s, rows, valid, D_MAIN, ld_layout)
            if D_TAIL > 0:
                gather_rows(k_tail_s, rows + D_MAIN, valid, D_TAIL, ld_layout)
            cp.mbarrier_arrive(k_ready, increment_count=False)
            if LOCKSTEP:
                # One count a program (the replicated scalar's atomic runs once).
                gl.atomic_add(sync_ptr + n, 1, sem="relaxed")
        done += n_it


@gluon.jit
def _delta_half(c: gl.constexpr, out_ptr, dout_ptr, b, t, hb, H, sob, sot, soh, sdob, sdot,
                sdoh, D_MAIN: gl.constexpr, BLOCK_H: gl.constexpr, PAD_HEADS: gl.constexpr,
                row_s: gl.constexpr):
    """sum of dO * O over channels c * D_MAIN / 2 .. (c + 1) * D_MAIN / 2, fp32 [BLOCK_H] (0
    for padded heads)."""
    HALF: gl.constexpr = D_MAIN // 2
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads = (hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))).to(gl.int64)
    cols = gl.arange(0, DELTA_CHUNK, layout=gl.SliceLayout(0, layout))
    o_rows = out_ptr + b * sob + t * sot + heads * soh
    do_rows = dout_ptr + b * sdob + t * sdot + heads * sdoh
    acc = gl.zeros([BLOCK_H, DELTA_CHUNK], gl.float32, layout=layout)
    for ch in gl.static_range(HALF // DELTA_CHUNK):
        col = c * HALF + ch * DELTA_CHUNK + cols
        if PAD_HEADS:
            m = (heads < H)[:, None] & (col < D_MAIN)[None, :]
            o = gl.load(o_rows[:, None] + col[None, :], mask=m, other=0.0).to(gl.float32)
            do = gl.load(do_rows[:, None] + col[None, :], mask=m, other=0.0).to(gl.float32)
        else:
            o = gl.load(o_rows[:, None] + col[None, :]).to(gl.float32)
            do = gl.load(do_rows[:, None] + col[None, :]).to(gl.float32)
        acc += o * do
    return gl.convert_layout(gl.sum(acc, axis=1), row_s)


@gluon.jit
def _dk_chunk(ds_t, p_t, q_part, do_part, col0, rows, valid, acc_layout: gl.constexpr,
              KEYS: gl.constexpr, WIDTH: gl.constexpr, WITH_DV: gl.constexpr,
              DK_VEC4: gl.constexpr):
    """Add dK's chunk dS^T q (+ P^T dO: dV, merged) [KEYS x WIDTH] into the key rows (fp32
    atomics; `rows` hold the rows' addresses, col0 the chunk's first channel; rows and valid
    in RED_LAYOUT's row slice with DK_VEC4, else in acc_layout's)."""
    acc = gl.zeros([KEYS, WIDTH], gl.float32, layout=acc_layout)
    acc = warpgroup_mma(ds_t, q_part, acc, use_acc=False, is_async=True)
    if WITH_DV:
        acc = warpgroup_mma(p_t, do_part, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    # The chunk's offset goes into the row addresses: added to the channel offsets instead, the
    # compiler hoists every chunk's (64-bit, 8 pairs a thread) out of the key loop, where they
    # spill. The channels stay a plain range, so a thread's neighbours make one vector atomic.
    # ptxas puts a branch around each predicated REDG (3 instructions more an atomic); an
    # inline `@p red...v2.f32` compiles the same (sm_90a, 2026-12-05).
    if DK_VEC4:
        acc = gl.convert_layout(acc, RED_LAYOUT)
        cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, RED_LAYOUT))
        mask = valid[:, None] & gl.full([KEYS, WIDTH], 1, gl.int1, layout=RED_LAYOUT)
        gl.atomic_add((rows + col0)[:, None] + cols[None, :], acc, mask=mask, sem="relaxed")
    else:
        cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, acc_layout))
        mask = valid[:, None] & gl.full([KEYS, WIDTH], 1, gl.int1, layout=acc_layout)
        gl.atomic_add((rows + col0)[:, None] + cols[None, :], acc, mask=mask, sem="relaxed")


@gluon.jit
def _consumer(c: gl.constexpr, q_main_s, q_tail_s, do_s, k_main_s, k_tail_s, p_t_s, ds_t_s,
              d_s, bars, idx_ptr, pre_ptr, out_ptr, dout_ptr, lse_ptr, dlse_ptr, sink_ptr,
              dq_ptr, dk_ptr, dsink_ptr, tgt_ptr, pid, T, NHB, P, W, H, NK, n_tiles, qk_scale,
              sm_scale, sib, sit, sik, spb, spt, sob, sot, soh, sdob, sdot, sdoh, slb, slt, slh,
              sdqb, sdqt, sdqh, sdkb, sdks, stg, stb, stt, stk,
              D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr,
              BLOCK_N: gl.constexpr, HAS_DLSE: gl.constexpr, HAS_SINK: gl.constexpr,
              TARGET: gl.constexpr, TARGET_ATOMIC: gl.constexpr, PAD_HEADS: gl.constexpr,
              DK_VEC4: gl.constexpr, NG: gl.constexpr, HAS_PREFIX: gl.constexpr,
              LOCKSTEP: gl.constexpr):
    """S, P, dP, dS for keys c * HALF_N .. of each tile; dQ for channels c * D_MAIN / 2 ..
    (consumer 1 also the tail), dK for the same main channels (consumer 0 also the tail).
    PAD_HEADS (fewer than BLOCK_H heads): the rows past H have zero q and dO and an lse of
    +inf, so their P, dS and Delta are 0 and they add nothing; their dq is not stored.
    LOCKSTEP: the program's work items pid, pid + P, ... one after the other. HAS_PREFIX (no
    TARGET): each row's own tile count (`gluon_common.item_steps`)."""
    q_bar, q_empty, k_ready, k_empty, ps_ready, ps_empty, d_ready = bars
    HALF: gl.constexpr = D_MAIN // 2
    HALF_N: gl.constexpr = BLOCK_N // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DK_CHUNK, 16])
    # The tail's dK chunk (consumer 0): D_TAIL channels (64 wide, or a placeholder width).
    dkt_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, max(D_TAIL, 8), 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_main_s.dtype

    done = 0  # key tiles of the earlier items: the barriers' phase
    for n in range(work_item_count(pid, P, W, LOCKSTEP)):
        b, t, hb = work_item_coords(pid, n, P, T, NHB, NG, LOCKSTEP)
        n_pre = prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX)
        n_it = item_steps(n_tiles, n_pre, NK, BLOCK_N, HAS_PREFIX)
        heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
        stat = b * slb + t * slt + heads * slh
        h_ok = heads < H
        if PAD_HEADS:
            lse2 = gl.load(lse_ptr + stat, mask=h_ok, other=float("inf")) * LOG2E_JIT
        else:
            lse2 = gl.load(lse_ptr + stat) * LOG2E_JIT
        # Delta = dO . O (- dlse), each consumer summing half the channels; both add the
        # halves in the same order.
        d_s.index(c).store(_delta_half(c, out_ptr, dout_ptr, b, t, hb, H, sob, sot, soh, sdob,
                                       sdot, sdoh, D_MAIN, BLOCK_H, PAD_HEADS, row_s))
        mbarrier.arrive(d_ready.index(c), count=1)
        mbarrier.wait(d_ready.index(1 - c), n & 1)
        delta = d_s.index(0).load(row_s) + d_s.index(1).load(row_s)
        if HAS_DLSE:
            # d lse / d s_j = p_j: the lse's gradient enters dS as -dlse inside (dP - Delta).
            delta -= gl.load(dlse_ptr + stat, mask=h_ok, other=0.0)
        if HAS_SINK:
            if c == 0:
                sink2 = gl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(gl.float32)
                sink2 *= LOG2E_JIT
                gl.store(dsink_ptr + stat, -gl.exp2(sink2 - lse2) * delta, mask=h_ok)
        lse2 = gl.where(lse2 == float("-inf"), 0.0, lse2)  # a row without keys: every p is 0
        if TARGET:
            tgt_base = tgt_ptr + hb * stg + b * stb + t * stt

        idx_base = idx_ptr + b * sib + t * sit
        slots_s = c * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, s_layout))
        if DK_VEC4:
            slots_k = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, RED_LAYOUT))
        else:
            slots_k = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk_layout))
        dk_base = dk_ptr + b * sdkb
        s_zero = gl.zeros([BLOCK_H, HALF_N], gl.float32, layout=s_layout)
        dq = gl.zeros([BLOCK_H, HALF], gl.float32, layout=dq_layout)
        if c == 1 and D_TAIL > 0:
            dqt_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_TAIL, 16])
            dq_tail = gl.zeros([BLOCK_H, D_TAIL], gl.float32, layout=dqt_layout)

        mbarrier.wait(q_bar, n & 1)
        for j in range(n_it):
            ph = (steps_before(done, n, n_tiles, HAS_PREFIX) + j) & 1
            zero = opaque_zero(j)
            q_main, do_t = q_main_s.index(zero), do_s.index(zero)
            k_main, k_tail = k_main_s.index(zero), k_tail_s.index(zero)
            p_t, ds_t = p_t_s.index(zero), ds_t_s.index(zero)
            k_own = k_main.slice(c * HALF_N, HALF_N, dim=0)
            valid = _slot_index(idx_base, sik, j * BLOCK_N, NK, n_pre, slots_s,
                                HAS_PREFIX) >= 0

            mbarrier.wait(k_ready, ph)
            # The rows came through cp.async (generic proxy); the products read them through
            # the async proxy.
            fence_async_shared()
            s = warpgroup_mma(q_main, k_own.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            if D_TAIL > 0:
                s = warpgroup_mma(q_tail_s.index(zero),
                                  k_tail.slice(c * HALF_N, HALF_N, dim=0).permute((1, 0)), s,
                                  is_async=True)
            dp = warpgroup_mma(do_t, k_own.permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            p = gl.exp2(gl.where(valid[None, :], s * qk_scale, float("-inf")) - lse2[:, None])
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
            ds = p * (dp - delta[:, None]) * sm_scale

            # P and dS transposed, this consumer's key rows, once both consumers are done with
            # the last tile's.
            mbarrier.wait(ps_empty, ph ^ 1)
            p_t.slice(c * HALF_N, HALF_N, dim=0).store(gl.permute(p.to(dtype), (1, 0)))
            ds_t.slice(c * HALF_N, HALF_N, dim=0).store(gl.permute(ds.to(dtype), (1, 0)))
            fence_async_shared()
            mbarrier.arrive(ps_ready.index(c), count=1)
            if TARGET:
                # The indexer loss's target: P summed over this program's heads at each slot.
                offs = j * BLOCK_N + slots_s
                head_sum = gl.sum(p, axis=0)
                if TARGET_ATOMIC:
                    gl.atomic_add(tgt_base + offs * stk, head_sum, mask=valid, sem="relaxed")
                else:
                    gl.store(tgt_base + offs * stk, gl.where(valid, head_sum, -1.0),
                             mask=offs < NK)
            mbarrier.wait(ps_ready.index(0), ph)
            mbarrier.wait(ps_ready.index(1), ph)

            # dQ += dS K over the tile's 64 keys, this consumer's channels.
            ds_heads = ds_t.permute((1, 0))
            dq = warpgroup_mma(ds_heads, k_main.slice(c * HALF, HALF, dim=1), dq,
                               is_async=True)
            if c == 1 and D_TAIL > 0:
                dq_tail = warpgroup_mma(ds_heads, k_tail, dq_tail, is_async=True)
                dq, dq_tail = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dq_tail))
            else:
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
            mbarrier.arrive(k_empty, count=1)

            # dK (+ dV) of the tile's 64 keys for this consumer's main channels (consumer 0
            # also the tail), added into the key rows.
            idx_k = _slot_index(idx_base, sik, j * BLOCK_N, NK, n_pre, slots_k, HAS_PREFIX)
            valid_k = idx_k >= 0
            rows = dk_base + gl.where(valid_k, idx_k, 0).to(gl.int64) * sdks
            for ch in gl.static_range(HALF // DK_CHUNK):
                # (An unannotated name would turn the offset into a runtime value: written
                # out.)
                _dk_chunk(ds_t, p_t, q_main.slice(c * HALF + ch * DK_CHUNK, DK_CHUNK, dim=1),
                          do_t.slice(c * HALF + ch * DK_CHUNK, DK_CHUNK, dim=1),
                          c * HALF + ch * DK_CHUNK, rows, valid_k, dk_layout, BLOCK_N,
                          DK_CHUNK, True, DK_VEC4)
            if c == 0 and D_TAIL > 0:
                _dk_chunk(ds_t, p_t, q_tail_s.index(zero), q_tail_s.index(zero), D_MAIN, rows,
                          valid_k, dkt_layout, BLOCK_N, D_TAIL, False, DK_VEC4)
            mbarrier.arrive(ps_empty, count=1)
        done += n_it
        if LOCKSTEP:
            # The item's last readers of q and dO in shared memory are done: the producer may
            # gather the next item's.
            mbarrier.arrive(q_empty, count=1)

        # dQ already carries the softmax scale (inside dS).
        dq_heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, dq_layout))
        dq_rows = dq_ptr + b * sdqb + t * sdqt + dq_heads.to(gl.int64) * sdqh
        dq_cols = c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, dq_layout))
        if PAD_HEADS:
            gl.store(dq_rows[:, None] + dq_cols[None, :], dq.to(dtype),
                     mask=(dq_heads < H)[:, None] & (dq_cols < D_MAIN)[None, :])
        else:
            gl.store(dq_rows[:, None] + dq_cols[None, :], dq.to(dtype))
        if c == 1 and D_TAIL > 0:
            t_heads = hb * BLOCK_H + gl.arange(0, BLOCK_H,
                                               layout=gl.SliceLayout(1, dqt_layout))
            t_rows = dq_ptr + b * sdqb + t * sdqt + t_heads.to(gl.int64) * sdqh
            t_cols = D_MAIN + gl.arange(0, D_TAIL, layout=gl.SliceLayout(0, dqt_layout))
            if PAD_HEADS:
                gl.store(t_rows[:, None] + t_cols[None, :], dq_tail.to(dtype),
                         mask=(t_heads < H)[:, None] & (t_cols < D_MAIN + D_TAIL)[None, :])
            else:
                gl.store(t_rows[:, None] + t_cols[None, :], dq_tail.to(dtype))


# NHB not specialized: at 1 (GLM-5.1) the constant head block let LLVM hoist more of the
# consumers' per-item values out of the item loop, where they spilled inside the key loop
# (27 reloads a tile; sm_90a, 2026-12-05).
@gluon.jit(do_not_specialize=["NHB"])
def _sparse_mla_bwd_kernel(
    q_ptr, k_ptr, idx_ptr, pre_ptr, out_ptr, dout_ptr, lse_ptr, dlse_ptr, sink_ptr,
    dq_ptr, dk_ptr, dsink_ptr, tgt_ptr, sync_ptr,
    T, H, NK, NHB, P, W, qk_scale, sm_scale,
    sqb, sqt, sqh, skb, sks, sib, sit, sik, spb, spt, sob, sot, soh, sdob, sdot, sdoh,
    slb, slt, slh,
    sdqb, sdqt, sdqh, sdkb, sdks, stg, stb, stt, stk,
    D_MAIN: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    NG: gl.constexpr, HAS_DLSE: gl.constexpr, HAS_SINK: gl.constexpr, TARGET: gl.constexpr,
    TARGET_ATOMIC: gl.constexpr, PAD_HEADS: gl.constexpr, DK_VEC4: gl.constexpr,
    HAS_PREFIX: gl.constexpr, LOCKSTEP: gl.constexpr, SYNC_SLACK: gl.constexpr,
    SYNC_SPINS: gl.constexpr,
    q_main_sl: gl.constexpr, q_tail_sl: gl.constexpr, k_main_sl: gl.constexpr,
    k_tail_sl: gl.constexpr, p_sl: gl.constexpr,
    CONSUMER_WARPS: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """dq, the dK / dV additions (and the sink terms, the target) of one query's head block.

    Row strides of q, k and dout multiples of 16 elements, unit-stride channels everywhere, NK
    >= 1 (the wrapper checks). NG: the grid's form (`gluon_common.program_coords`). LOCKSTEP:
    a grid of P programs over W work items (NHB head blocks a query, adjacent), program pid
    taking items pid, pid + P, ...; sync_ptr: one zeroed int32 tile counter a wave of P items.
    HAS_PREFIX (not with LOCKSTEP or TARGET): row (b, t) attends keys 0 .. pre[b, t] - 1, then
    its listed indices.
    """
    pid = gl.program_id(0)
    n_tiles = gl.cdiv(NK, BLOCK_N)

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Leading dims of 1: the consumers index them with `gluon_common.opaque_zero`.
    q_main_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_MAIN], q_main_sl)
    do_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_MAIN], q_main_sl)
    k_main_s = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D_MAIN], k_main_sl)
    if D_TAIL > 0:
        q_tail_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_TAIL], q_tail_sl)
        k_tail_s = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D_TAIL], k_tail_sl)
    else:  # never read as tails
        q_tail_s = q_main_s
        k_tail_s = k_main_s
    p_t_s = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_H], p_sl)
    ds_t_s = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_H], p_sl)
    row_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    d_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], row_sl)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ps_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    ps_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    d_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    producer_threads: gl.constexpr = PRODUCER_WARPS * 32
    mbarrier.init(q_bar, count=producer_threads)
    mbarrier.init(k_ready, count=producer_threads)
    mbarrier.init(k_empty, count=2)
    mbarrier.init(q_empty, count=2)
    mbarrier.init(ps_empty, count=2)
    for c in gl.static_range(2):
        mbarrier.init(ps_ready.index(c), count=1)
        mbarrier.init(d_ready.index(c), count=1)
    fence_async_shared()
    bars = (q_bar, q_empty, k_ready, k_empty, ps_ready, ps_empty, d_ready)
    # Each partition's arguments written out: constexprs gathered into a tuple variable first
    # would reach the partitions as runtime values.
    gl.warp_specialize([
        (_consumer, (0, q_main_s, q_tail_s, do_s, k_main_s, k_tail_s, p_t_s, ds_t_s, d_s, bars,
                     idx_ptr, pre_ptr, out_ptr, dout_ptr, lse_ptr, dlse_ptr, sink_ptr, dq_ptr,
                     dk_ptr, dsink_ptr, tgt_ptr, pid, T, NHB, P, W, H, NK, n_tiles, qk_scale,
                     sm_scale, sib, sit, sik, spb, spt, sob, sot, soh, sdob, sdot, sdoh, slb,
                     slt, slh, sdqb, sdqt, sdqh, sdkb, sdks, stg, stb, stt, stk, D_MAIN, D_TAIL,
                     BLOCK_H, BLOCK_N, HAS_DLSE, HAS_SINK, TARGET, TARGET_ATOMIC, PAD_HEADS,
                     DK_VEC4, NG, HAS_PREFIX, LOCKSTEP)),
        (_consumer, (1, q_main_s, q_tail_s, do_s, k_main_s, k_tail_s, p_t_s, ds_t_s, d_s, bars,
                     idx_ptr, pre_ptr, out_ptr, dout_ptr, lse_ptr, dlse_ptr, sink_ptr, dq_ptr,
                     dk_ptr, dsink_ptr, tgt_ptr, pid, T, NHB, P, W, H, NK, n_tiles, qk_scale,
                     sm_scale, sib, sit, sik, spb, spt, sob, sot, soh, sdob, sdot, sdoh, slb,
                     slt, slh, sdqb, sdqt, sdqh, sdkb, sdks, stg, stb, stt, stk, D_MAIN, D_TAIL,
                     BLOCK_H, BLOCK_N, HAS_DLSE, HAS_SINK, TARGET, TARGET_ATOMIC, PAD_HEADS,
                     DK_VEC4, NG, HAS_PREFIX, LOCKSTEP)),
        (_producer, (q_ptr, k_ptr, idx_ptr, pre_ptr, dout_ptr, sync_ptr, q_main_s.index(0),
                     q_tail_s.index(0), do_s.index(0), k_main_s.index(0), k_tail_s.index(0),
                     q_bar, q_empty, k_ready, k_empty, pid, T, NHB, P, W, H, NK, n_tiles, sqb,
                     sqt, sqh, skb, sks, sib, sit, sik, spb, spt, sdob, sdot, sdoh, D_MAIN,
                     D_TAIL, BLOCK_H, BLOCK_N, PAD_HEADS, NG, HAS_PREFIX, LOCKSTEP, SYNC_SLACK,
                     SYNC_SPINS, PRODUCER_WARPS)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------- launch


def variant(q: torch.Tensor, prefix: bool = False) -> tuple:
    """The compiled variant a call needs (dtype, channels, query heads, a dense prefix or not):
    what a failure disables."""
    return q.dtype, q.shape[-1], q.shape[2], prefix


def heads_fit(heads: int) -> bool:
    """Query heads (of the one KV head) the kernel takes: a multiple of BLOCK_H, or fewer (one
    block padded with heads that add nothing: tensor parallelism's share of GLM-5.1's 64)."""
    return heads % BLOCK_H == 0 or 0 < heads < BLOCK_H


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, dv: int,
            prefix_lengths: torch.Tensor | None) -> bool:
    """Whether these inputs are this kernel's case: on Hopper, q and k both bf16 or both fp16,
    one KV head, V = K's main part of 128 / 256 / 512 channels (v None, dv = that part), a
    tail of 0 or TAIL channels, query heads that fit (`heads_fit`), and the variant not
    disabled by an earlier failure. A sink and a dense prefix (HCA's) are taken."""
    if not on_hopper(q):
        return False
    d = q.shape[-1]
    d_main = 1 << (d.bit_length() - 1)
    return (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v is None
            and dv == d_main and d_main in (128, 256, 512) and d - d_main in (0, TAIL)
            and k.shape[2] == 1 and heads_fit(q.shape[2])
            and variant(q, prefix_lengths is not None) not in _disabled)


def layout_problem(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor,
                   dout: torch.Tensor) -> tuple[str, str] | None:
    """(cause, detail) of what keeps the inputs from the kernel, None if nothing: q, k and dout
    are copied 16 bytes at a time (their row strides multiples of STRIDE_MULTIPLE elements,
    unit-stride channels, 16-byte aligned data); out's channels are read unit-stride."""
    for name, x, rows in (("q", q, kernel_strides(q, 3)), ("k", k, kernel_strides(k, 2)),
                          ("dout", dout, kernel_strides(dout, 3))):
        if x.stride(-1) != 1 or any(st % STRIDE_MULTIPLE for st in rows):
            return (f"{name}'s rows are not multiples of {STRIDE_MULTIPLE} unit-stride elements",
                    f"strides {tuple(x.stride())}")
        if x.data_ptr() % 16:
            return f"{name} is not 16-byte aligned", ""
    if out.stride(-1) != 1:
        return "out's channels are not unit-stride", f"strides {tuple(out.stride())}"
    return None


def sparse_mla_bwd_sm90(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor,
                        softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, dk: torch.Tensor, *, dlse: torch.Tensor | None = None,
                        sink: torch.Tensor | None = None,
                        target: tuple[torch.Tensor, tuple[int, ...], bool] | None = None,
                        head_blocks_adjacent: bool = True, dk_vec4: bool = False,
                        lockstep: bool = False, lockstep_slack: int = 1,
                        keys_ascending: bool = False,
                        prefix_lengths: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dq [B, T, Hq, D] in q's dtype, the sink terms fp32 [B, T, Hq] or None) on inputs that
    `applies` and `layout_problem` accept; adds dK (dV merged) into dk, fp32 [B, S, 1, D].
    dlse: the lse's gradient (lse's strides), or None. target: (buffer, its (head block, b, t,
    slot) strides, add atomically) for the indexer loss's target (`sparse_attention.
    _TargetBuffer`), or None. A query's head blocks launch as the Triton kernels' do
    (`common.launch_grid`). dk_vec4: 16-byte dK atomics (`RED_LAYOUT`) instead of 8-byte
    ones. lockstep: one program an SM, each taking every P-th work item (query head block),
    rows in increasing key order (sorted here; a target is written in that order and scattered
    back to the caller's slots), the programs of a wave kept within lockstep_slack key tiles of
    each other (a bounded wait), so that at any time they gather and add into the same few
    32-ths of the keys and the L2 cache serves the dK additions
    (`AttentionKernelOptions.bwd_lockstep`). keys_ascending: each row's valid keys increase
    already (`ops/key_order.py`): lockstep runs them as they are, no sort, no permutation, the
    target written in place. prefix_lengths (int [B, T], HCA's dense prefix; no target): row
    (b, t) also attends keys 0 .. n - 1 before its indices; unpaced (the pace counts equal
    tiles a row)."""
    if prefix_lengths is not None:
        if target is not None:
            raise ValueError("target: the indexer loss's target has no slots for a dense "
                             "prefix (prefix_lengths)")
        lockstep = False
    from megatron_hyscale.ops.kernels.common import launch_grid
    from megatron_hyscale.ops.kernels.sparse_mla_fwd_sm90 import shared_layouts

    B, T, Hq, d = q.shape
    d_main = 1 << (d.bit_length() - 1)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dsink = torch.empty_like(lse) if sink is not None else None
    if B * T == 0:
        return dq, dsink
    if indices.dim() == 4:
        indices = indices[:, :, 0]
    if indices.shape[-1] == 0 and prefix_lengths is not None:
        # No listed slot, only the prefix: one unused slot keeps the kernel's NK >= 1.
        indices = indices.new_full((*indices.shape[:-1], 1), -1)
    # Fewer heads than a block (tensor parallelism's share of GLM-5.1's 64): one padded block.
    n_hb = max(Hq // BLOCK_H, 1)
    grid, ng = launch_grid(B * T, 1, n_hb, head_blocks_adjacent)
    work = B * T * n_hb
    programs, sync = work, indices
    if lockstep:
        programs, sync = lockstep_plan(work, q.device, lockstep_slack)
        grid, ng = (programs,), n_hb
    if lockstep and not keys_ascending:
        indices, perm, slot_target = _key_order(indices, target)
    else:
        perm, slot_target = None, target
    q_main_sl, q_tail_sl, k_main_sl, k_tail_sl, p_sl = shared_layouts(q.dtype, d_main,
                                                                       d - d_main or TAIL)
    tgt, tgt_strides, tgt_atomic = (slot_target if slot_target is not None
                                    else (lse, (0,) * 4, False))
    # Without a prefix: a placeholder pointer and zero strides (no compiled variant of their
    # own).
    pre, pre_strides = ((prefix_lengths, kernel_strides(prefix_lengths, 2))
                        if prefix_lengths is not None else (indices, (0, 0)))
    _sparse_mla_bwd_kernel[grid](
        q, k, indices, pre, out, dout, lse, dlse if dlse is not None else lse,
        sink.contiguous() if sink is not None else lse, dq, dk,
        dsink if dsink is not None else lse, tgt, sync,
        T, Hq, indices.shape[-1], n_hb, programs, work, softmax_scale * LOG2E, softmax_scale,
        *kernel_strides(q, 3), *kernel_strides(k, 2), *indices.stride(), *pre_strides,
        *out.stride()[:3],
        *kernel_strides(dout, 3), *lse.stride(), *dq.stride()[:3], *dk.stride()[:2], *tgt_strides,
        D_MAIN=d_main, D_TAIL=d - d_main, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, NG=ng,
        HAS_DLSE=dlse is not None, HAS_SINK=sink is not None, TARGET=target is not None,
        TARGET_ATOMIC=tgt_atomic, PAD_HEADS=Hq < BLOCK_H, DK_VEC4=dk_vec4,
        HAS_PREFIX=prefix_lengths is not None, LOCKSTEP=lockstep, SYNC_SLACK=lockstep_slack,
        SYNC_SPINS=SYNC_SPINS,
        q_main_sl=q_main_sl, q_tail_sl=q_tail_sl, k_main_sl=k_main_sl, k_tail_sl=k_tail_sl,
        p_sl=p_sl, CONSUMER_WARPS=CONSUMER_WARPS, PRODUCER_WARPS=PRODUCER_WARPS,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=CONSUMER_WARPS, maxnreg=MAXNREG,
    )
    if perm is not None:  # the target's slots back in the caller's order
        buf = target[0]
        buf.scatter_(-1, perm.expand(buf.shape), tgt)
    return dq, dsink


def _key_order(indices: torch.Tensor, target: tuple | None
               ) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
    """(each row's indices in increasing order, the permutation or None, the target to write
    into): with a target, a buffer like the caller's that the kernel fills in sorted slot
    order, scattered back by the permutation after it."""
    if target is None:
        return indices.sort(dim=-1).values, None, None
    indices, perm = indices.sort(dim=-1)
    buf, strides, atomic = target
    # Added into zeros when atomic; every slot stored otherwise (-1 where unused).
    tmp = torch.zeros_like(buf) if atomic else torch.empty_like(buf)
    if tmp.stride() != buf.stride():
        raise ValueError(f"target: a buffer of strides {tuple(buf.stride())} (dense expected)")
    return indices, perm, (tmp, strides, atomic)


# Variants (`variant`) that failed to compile or launch in this process (`applies` refuses them),
# and the warnings when the kernel cannot run.
_variants = KernelVariants("sparse-mla-bwd-sm90", "Hopper sparse-MLA backward", "Triton backward")
_disabled = _variants.disabled
warn_cannot_run = _variants.warn_cannot_run
disable = _variants.disable

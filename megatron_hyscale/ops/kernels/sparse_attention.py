"""Sparse attention over selected indices: Triton forward and backward kernels.

Shapes: q [B, T, Hq, Dqk]; k [B, S, Hkv, Dqk]; v [B, S, Hkv, Dv] or None (V = first dv channels
of K); indices int32/int64 [B, T, Hkv, K] or [B, T, K] (-1 = unused slot); sink fp [Hq] or None;
prefix_lengths int [B, T] or None (row t also attends to keys 0 .. n_t - 1, generated in-kernel).
Query head h reads KV head h // (Hq / Hkv). out [B, T, Hq, Dv] in q's dtype; lse fp32 [B, T, Hq]
(natural log, the sink included in the sum; -inf for a row with no valid index and no sink).

One program per (query, KV head, block of up to 64 query heads): all heads of a KV group share
the gathered key rows, so the head dim is the MMA's M dimension (MQA: 64 heads x 576 dims times
576 dims x keys). Head dims that are not a power of two are split into a power-of-two main part
and a tail (576 = 512 + 64); when V is the main part of K (absorbed MLA, DeepSeek-V4's K = V) the
gathered K tile is reused as V. Head dims under MIN_DOT are zero-padded to it by the wrapper.
fp32 accumulation, base-2 online softmax. On Hopper the forward of absorbed MLA (one KV head,
V = K's main part, no sink or prefix: GLM-5.1, V3.2) runs the Gluon kernel of
`sparse_mla_fwd_sm90` instead (`AttentionKernelOptions.fwd_sm90`; its warp-specialized form by
default, `fwd_sm90_ws`, which also takes DeepSeek-V4's K = V with a sink and HCA's dense
prefix), the same results.

Backward: one kernel per query computes dQ (no atomics), the row's Delta = dO . O and the sink
gradient terms; a second kernel recomputes P and dS per query and adds dK / dV tiles into fp32
buffers with atomics, computing dK^T = q^T dS and dV^T = dO^T P with the channels as the MMA's M
(`dkv_channels_on_m`; the keys as M before; `dkv_carry` adds each key tile's dK / dV one
iteration later). `bwd_fused` does both in the dQ kernel's single pass. Variants and tilings
come in an `AttentionKernelOptions` (`kernels/options.py`). `sparse_attention_bwd_with_target`
also has the dQ kernel sum each P tile over its heads: the DSA indexer loss's target, without
`indexer_loss.attention_target`'s second gather of the selected keys. On Hopper,
`bwd_sm90` runs the backward of absorbed MLA and of K = V (a sink, a dense prefix) as one
warp-specialized Gluon kernel instead (`sparse_mla_bwd_sm90`, target included; not under
`deterministic`).
`deterministic=True` replaces the fp32 atomics by two passes: an order-free atomic max of each
key row's contributions, then int64 fixed-point atomic adds on a per-row power-of-two scale
(integer addition is associative, so the result does not depend on the order of the atomics;
resolution 2^-44 of the row's largest contribution).
"""

from __future__ import annotations

from types import ModuleType

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.checks import triton_interpret, warn_once
from megatron_hyscale.ops.kernels.common import (
    LN2_JIT,
    LOG2E,
    LOG2E_JIT,
    MAX_BLOCK_H,
    MIN_DOT,
    MODE_ATOMIC,
    MODE_DISCARD,
    MODE_FIXED,
    MODE_ROWMAX,
    SYNC_SPINS,
    WIDE_TILE,
    accumulate,
    channel_split,
    dot_precision,
    fix_interpreter,
    fixed_point_scale,
    gluon_module,
    launch_grid,
    lockstep_plan,
    lockstep_step,
    on_hopper,
)
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions, Tilings
from megatron_hyscale.ops.kernels.tiling import launch_first_fitting

fix_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1

# Shared memory budget used to rank tilings before trying them (H100/H200: 227 KiB a block).
SMEM_BUDGET = 220 * 1024


# --------------------------------------------------------------------------- jit bodies


@triton.jit
def _coords(T, NHB, G, NG: tl.constexpr, BLOCK_H: tl.constexpr):
    """(b, t, kv head, query-head offsets within the group, head mask) of this program.

    NG = 0: a (B x T, KV heads x head blocks) grid. NG > 0 (head_blocks_adjacent, one KV
    head): a 1-D grid of B x T x NG programs, NG = its head blocks, a query's programs adjacent.
    """
    if NG > 0:
        pid = tl.program_id(0).to(tl.int64)
        pid_q = pid // NG
        pid_g = (pid % NG).to(tl.int32)
    else:
        pid_q = tl.program_id(0).to(tl.int64)
        pid_g = tl.program_id(1)
    return _group_coords(pid_q, pid_g, T, NHB, G, BLOCK_H)


@triton.jit
def _group_coords(pid_q, pid_g, T, NHB, G, BLOCK_H: tl.constexpr):
    """(b, t, kv head, query-head offsets within the group, head mask) of query pid_q (int64,
    b * T + t) and head group pid_g (kv head * NHB + head block)."""
    b = pid_q // T
    t = pid_q % T
    kvh = pid_g // NHB
    offs_h = (pid_g % NHB) * BLOCK_H + tl.arange(0, BLOCK_H)
    return b, t, kvh, offs_h, offs_h < G


@triton.jit
def _work_item_coords(item, n_queries, T, NHB, G, NG: tl.constexpr, BLOCK_H: tl.constexpr):
    """`_coords` of work item `item` of a persistent launch, in the order the grid of `_coords`
    runs its programs: NG > 0, a query's NG head blocks adjacent; else every query of head
    group 0, then of group 1, ..."""
    item = item + tl.zeros([], tl.int64)
    if NG > 0:
        pid_q = item // NG
        pid_g = (item % NG).to(tl.int32)
    else:
        pid_q = item % n_queries
        pid_g = (item // n_queries).to(tl.int32)
    return _group_coords(pid_q, pid_g, T, NHB, G, BLOCK_H)


@triton.jit
def _load_q(q_ptr, b, t, heads, h_mask, sqb, sqt, sqh, sqd, D: tl.constexpr,
            D_MAIN: tl.constexpr, D_TAIL: tl.constexpr):
    """This query's [heads x D_MAIN] main channels and [heads x D_TAIL] tail channels (the main
    part again when there is no tail: unused then)."""
    q_rows = q_ptr + b * sqb + t * sqt + heads[:, None] * sqh
    q_main = tl.load(q_rows + tl.arange(0, D_MAIN)[None, :] * sqd, mask=h_mask[:, None],
                     other=0.0)
    q_tail = q_main
    if D_TAIL > 0:
        offs_dt = D_MAIN + tl.arange(0, D_TAIL)
        q_tail = tl.load(q_rows + offs_dt[None, :] * sqd,
                         mask=h_mask[:, None] & (offs_dt[None, :] < D), other=0.0)
    return q_main, q_tail


@triton.jit
def _prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX: tl.constexpr):
    """Keys 0 .. n - 1 this row attends before its listed indices (0 without a prefix)."""
    if HAS_PREFIX:
        n = tl.load(pre_ptr + b * spb + t * spt).to(tl.int32)
    else:
        n = tl.zeros([], dtype=tl.int32)
    return n


@triton.jit
def _load_rows(idx_base, sik, n0, NK, n_pre, BLOCK_N: tl.constexpr, HAS_PREFIX: tl.constexpr):
    """Key rows of slots n0 .. n0 + BLOCK_N (row 0 where invalid) and their validity.

    With HAS_PREFIX, slot j < n_pre is key j (the row's dense prefix) and slot j >= n_pre is
    listed index j - n_pre; without, slot j is listed index j (the same code as before the
    prefix existed: sm_90a SASS of the GLM-5.1 forward loop, 1087 against 1279 instructions)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if HAS_PREFIX:
        e = offs_n - n_pre
        idx = tl.load(idx_base + e * sik, mask=(e >= 0) & (e < NK), other=-1).to(tl.int64)
        idx = tl.where(offs_n < n_pre, offs_n.to(tl.int64), idx)
    else:
        idx = tl.load(idx_base + offs_n * sik, mask=offs_n < NK, other=-1).to(tl.int64)
    valid = idx >= 0
    return tl.where(valid, idx, 0), valid


@triton.jit
def _fwd_item(
    b, t, kvh, offs_h, h_mask, wave_ptr, active,
    q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, lse_ptr,
    T, NK, G, NHB, qk_scale,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
    sib, sit, sih, sik, spb, spt, sob, sot, soh, sod, slb, slt, slh,
    D: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, HAS_PREFIX: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, V_IS_K_MAIN: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    SOFTMAX: tl.constexpr, LOCKSTEP: tl.constexpr, SYNC_SLACK: tl.constexpr,
    SYNC_SPINS: tl.constexpr, SYNC_PTX: tl.constexpr,
):
    """`_fwd_kernel`'s work for one (query, head block) at its coordinates; LOCKSTEP as
    `_dkv_item`'s."""
    heads = kvh * G + offs_h
    offs_dm = tl.arange(0, D_MAIN)
    q_main, q_tail = _load_q(q_ptr, b, t, heads, h_mask, sqb, sqt, sqh, sqd, D, D_MAIN, D_TAIL)
    if D_TAIL > 0:
        offs_dt = D_MAIN + tl.arange(0, D_TAIL)
    offs_v = tl.arange(0, DV_PAD)
    k_base = k_ptr + b * skb + kvh * skh
    v_base = v_ptr + b * svb + kvh * svh
    idx_base = idx_ptr + b * sib + t * sit + kvh * sih
    n_pre = _prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_PAD], tl.float32)
    for n0 in range(0, n_pre + NK, BLOCK_N):
        if LOCKSTEP:
            lockstep_step(wave_ptr, active * (n0 // BLOCK_N - SYNC_SLACK + 1), SYNC_SPINS,
                          SYNC_PTX)
        rows, valid = _load_rows(idx_base, sik, n0, NK, n_pre, BLOCK_N, HAS_PREFIX)
        k_main = tl.load(k_base + rows[:, None] * sks + offs_dm[None, :] * skd,
                         mask=valid[:, None], other=0.0)
        s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
        if D_TAIL > 0:
            k_tail = tl.load(k_base + rows[:, None] * sks + offs_dt[None, :] * skd,
                             mask=valid[:, None] & (offs_dt[None, :] < D), other=0.0)
            s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
        if SOFTMAX:
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row with no valid key so far keeps m = -inf; shift by 0 there so no inf - inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
        else:
            p = tl.where(valid[None, :], s, 0.0)
            m_new = m_i
            alpha = tl.full([BLOCK_H], 1.0, tl.float32)
            l_i = tl.full([BLOCK_H], 1.0, tl.float32)
        if V_IS_K_MAIN:
            v_tile = k_main
        else:
            v_tile = tl.load(v_base + rows[:, None] * svs + offs_v[None, :] * svd,
                             mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile,
                                            input_precision=PRECISION)
        m_i = m_new

    if HAS_SINK:
        sink2 = tl.load(sink_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * LOG2E_JIT
        m_f = tl.maximum(m_i, sink2)
        rescale = tl.exp2(m_i - m_f)
        l_f = l_i * rescale + tl.exp2(sink2 - m_f)
        out = acc * (rescale / l_f)[:, None]
        lse2 = m_f + tl.log2(l_f)
    else:
        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_ptrs = out_ptr + b * sob + t * sot + heads[:, None] * soh + offs_v[None, :] * sod
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=h_mask[:, None] & (offs_v[None, :] < DV))
    tl.store(lse_ptr + b * slb + t * slt + heads * slh, lse2 * LN2_JIT, mask=h_mask)



@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, lse_ptr,
    sync_ptr, programs, work, n_queries,
    T, NK, G, NHB, qk_scale,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
    sib, sit, sih, sik, spb, spt, sob, sot, soh, sod, slb, slt, slh,
    D: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, HAS_PREFIX: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, V_IS_K_MAIN: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, NG: tl.constexpr,
    SOFTMAX: tl.constexpr = True, LOCKSTEP: tl.constexpr = False,
    SYNC_SLACK: tl.constexpr = 1, SYNC_SPINS: tl.constexpr = 64, SYNC_PTX: tl.constexpr = True,
):
    """out[h] = softmax(q[h] . K_sel * scale (+ sink)) @ V_sel for one query's head block.

    s = [heads x Dqk] @ [Dqk x keys] on gathered rows, online base-2 softmax, acc += P @ V_sel
    in fp32; -1 slots score -inf; a row with no valid key (and no sink) writes zeros.
    SOFTMAX=False (measurement only, fwd_softmax): P is the masked raw scores; lse is -inf.
    LOCKSTEP: persistent programs over the work items, paced by their waves' counters, as
    `_bwd_dkv_kernel`'s (AttentionKernelOptions.fwd_lockstep, for the shapes this kernel runs).
    """
    if LOCKSTEP:
        for item in range(tl.program_id(0), work, programs):
            wave = item // programs
            b, t, kvh, offs_h, h_mask = _work_item_coords(item, n_queries, T, NHB, G, NG,
                                                          BLOCK_H)
            _fwd_item(b, t, kvh, offs_h, h_mask, sync_ptr + wave,
                      tl.minimum(programs, work - wave * programs),
                      q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, lse_ptr,
                      T, NK, G, NHB, qk_scale, sqb, sqt, sqh, sqd, skb, sks, skh, skd,
                      svb, svs, svh, svd, sib, sit, sih, sik, spb, spt, sob, sot, soh, sod,
                      slb, slt, slh, D, D_MAIN, D_TAIL, HAS_PREFIX, DV, DV_PAD, V_IS_K_MAIN,
                      HAS_SINK, BLOCK_H, BLOCK_N, PRECISION, SOFTMAX, True, SYNC_SLACK,
                      SYNC_SPINS, SYNC_PTX)
    else:  # straight-line, as `_bwd_dkv_kernel`'s
        b, t, kvh, offs_h, h_mask = _coords(T, NHB, G, NG, BLOCK_H)
        _fwd_item(b, t, kvh, offs_h, h_mask, sync_ptr, 0,
                  q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, lse_ptr,
                  T, NK, G, NHB, qk_scale, sqb, sqt, sqh, sqd, skb, sks, skh, skd,
                  svb, svs, svh, svd, sib, sit, sih, sik, spb, spt, sob, sot, soh, sod,
                  slb, slt, slh, D, D_MAIN, D_TAIL, HAS_PREFIX, DV, DV_PAD, V_IS_K_MAIN,
                  HAS_SINK, BLOCK_H, BLOCK_N, PRECISION, SOFTMAX, False, SYNC_SLACK,
                  SYNC_SPINS, SYNC_PTX)


@triton.jit
def _dkv_bases(dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr, b, kvh,
               sdkb, sdkh, sdvb, sdvh, srb, srh):
    """Bases of batch b, KV head kvh in the dK / dV accumulators and their row statistics."""
    rows = b * srb + kvh * srh
    return (dk_ptr + b * sdkb + kvh * sdkh, dv_ptr + b * sdvb + kvh * sdvh,
            rowmax_k_ptr + rows, rowmax_v_ptr + rows, scale_k_ptr + rows, scale_v_ptr + rows)


@triton.jit
def _dkv_tiles_channels_on_m(q_main, do, p, ds, V_IS_K_MAIN: tl.constexpr,
                             PRECISION: tl.constexpr):
    """(dK main [keys x D_MAIN], dV^T [DV_PAD x keys]) of one key tile with the channels on the
    MMA's M: dK^T = q^T dS (+ dV^T = dO^T P when V is K's main part, then merged)."""
    dv_tt = tl.dot(tl.trans(do), p.to(do.dtype), input_precision=PRECISION)
    if V_IS_K_MAIN:
        dk_tt = tl.dot(tl.trans(q_main), ds, acc=dv_tt, input_precision=PRECISION)
    else:
        dk_tt = tl.dot(tl.trans(q_main), ds, input_precision=PRECISION)
    return tl.trans(dk_tt), dv_tt


@triton.jit
def _dkv_add(base, stat_base, scale_base, rows, valid, tile, offs, s_row, s_col, n_cols, srs,
             MODE: tl.constexpr):
    """Add a [keys x channels] tile (channels offs, < n_cols real) into its key rows of one
    dK or dV accumulator (see common.accumulate). Callers add the main dK tile before computing the
    tail's, so that two such fp32 tiles are never live together (sm_90a, fused backward
    16 x 1: 212 bytes of spills against 696 when they were)."""
    accumulate(base + rows[:, None] * s_row + offs[None, :] * s_col, tile, rows, valid,
                offs[None, :] < n_cols, stat_base, scale_base, srs, MODE)


@triton.jit
def _dkv_gather(k_base, v_base, rows, valid, sks, skd, svs, svd, D: tl.constexpr,
                D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, DV: tl.constexpr,
                DV_PAD: tl.constexpr, V_IS_K_MAIN: tl.constexpr):
    """The key tile's main and tail channels and its V tile (k_main again for an absent tail or
    when V is K's main part), as the dK/dV kernel's loop gathers them."""
    offs_dm = tl.arange(0, D_MAIN)
    k_main = tl.load(k_base + rows[:, None] * sks + offs_dm[None, :] * skd,
                     mask=valid[:, None], other=0.0)
    k_tail = k_main
    if D_TAIL > 0:
        offs_dt = D_MAIN + tl.arange(0, D_TAIL)
        k_tail = tl.load(k_base + rows[:, None] * sks + offs_dt[None, :] * skd,
                         mask=valid[:, None] & (offs_dt[None, :] < D), other=0.0)
    v_tile = k_main
    if not V_IS_K_MAIN:
        offs_v = tl.arange(0, DV_PAD)
        v_tile = tl.load(v_base + rows[:, None] * svs + offs_v[None, :] * svd,
                         mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0)
    return k_main, k_tail, v_tile


@triton.jit
def _dkv_p_ds(q_main, q_tail, do, k_main, k_tail, v_tile, valid, lse2, delta, qk_scale,
              sm_scale, D_TAIL: tl.constexpr, PRECISION: tl.constexpr):
    """P and scale * dS of one key tile, [heads x keys] in q's dtype, with the heads on the
    MMA's M: the channels-on-M dK/dV kernel's first half, as its inline code computes it
    except that S's main and tail parts are added as two fp32 tiles (see below)."""
    s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
    if D_TAIL > 0:
        # Both products pass a select (invalid keys score -inf below anyway) so that Triton
        # does not fold the addition into one's accumulator: that makes the other a chained
        # dot, laid out with every warp on M (the tail product first, then a layout change).
        s = (tl.where(valid[None, :], s, 0.0)
             + tl.where(valid[None, :],
                        tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION), 0.0))
    p = tl.exp2(tl.where(valid[None, :], s * qk_scale, float("-inf")) - lse2[:, None])
    dp = tl.dot(do, tl.trans(v_tile), input_precision=PRECISION)
    ds = (p * (dp - delta[:, None]) * sm_scale).to(q_main.dtype)
    return p.to(do.dtype), ds


@triton.jit
def _dkv_add_tile_channels_on_m(q_main, q_tail, do, p, ds, rows, valid, dk_base, dv_base,
                                rmk_base, rmv_base, fxk_base, fxv_base, sdks, sdkd, sdvs, sdvd,
                                srs, D: tl.constexpr, D_MAIN: tl.constexpr,
                                D_TAIL: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                                V_IS_K_MAIN: tl.constexpr, MODE: tl.constexpr,
                                PRECISION: tl.constexpr):
    """The channels-on-M dK/dV kernel's second half for one key tile: dK^T = q^T dS (+ dV^T =
    dO^T P) and the tail, added into the key rows: a separate dV (its own product), the dK
    tail, then the dK main part. Each address gets its addends in the inline code's order
    (dV, dK main, dK tail: where dV and dK share a buffer, V = K's first dv channels, dV's
    come first either way, and the tail and the main part are other channels). dK's tail
    before its main part frees dS's shared copy before the main tile's transposition takes
    its scratch. p is already in dO's dtype (the inline code converts it inside the
    product)."""
    if not V_IS_K_MAIN:
        dv_tt = tl.dot(tl.trans(do), p, input_precision=PRECISION)
        _dkv_add(dv_base, rmv_base, fxv_base, rows, valid, tl.trans(dv_tt),
                 tl.arange(0, DV_PAD), sdvs, sdvd, DV, srs, MODE)
    if D_TAIL > 0:
        dk_tail = tl.trans(tl.dot(tl.trans(q_tail), ds, input_precision=PRECISION))
        _dkv_add(dk_base, rmk_base, fxk_base, rows, valid, dk_tail,
                 D_MAIN + tl.arange(0, D_TAIL), sdks, sdkd, D, srs, MODE)
    if V_IS_K_MAIN:
        dk_main, _ = _dkv_tiles_channels_on_m(q_main, do, p, ds, True, PRECISION)
    else:
        dk_main = tl.trans(tl.dot(tl.trans(q_main), ds, input_precision=PRECISION))
    _dkv_add(dk_base, rmk_base, fxk_base, rows, valid, dk_main, tl.arange(0, D_MAIN), sdks,
             sdkd, D, srs, MODE)


@triton.jit
def _dq_item(
    b, t, kvh, offs_h, h_mask, wave_ptr, active,
    q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, dout_ptr, lse_ptr, dlse_ptr,
    dq_ptr, delta_ptr, dsink_ptr,
    dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr, tgt_ptr,
    T, NK, G, NHB, qk_scale, sm_scale,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
    sib, sit, sih, sik, spb, spt, sob, sot, soh, sod, sdob, sdot, sdoh, sdod, slb, slt, slh,
    sdqb, sdqt, sdqh, sdqd,
    sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, srb, srs, srh, stg, stb, stt, stk,
    D: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, HAS_PREFIX: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, V_IS_K_MAIN: tl.constexpr, HAS_SINK: tl.constexpr,
    HAS_DLSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FUSE_DKV: tl.constexpr, MODE: tl.constexpr,
    TAIL_FIRST: tl.constexpr, TARGET: tl.constexpr, TARGET_ATOMIC: tl.constexpr,
    LOCKSTEP: tl.constexpr, SYNC_SLACK: tl.constexpr, SYNC_SPINS: tl.constexpr,
    SYNC_PTX: tl.constexpr,
):
    """`_bwd_dq_kernel`'s work for one (query, head block) at its coordinates; LOCKSTEP as
    `_dkv_item`'s."""
    heads = kvh * G + offs_h
    offs_dm = tl.arange(0, D_MAIN)
    offs_v = tl.arange(0, DV_PAD)
    v_mask = offs_v[None, :] < DV
    q_main, q_tail = _load_q(q_ptr, b, t, heads, h_mask, sqb, sqt, sqh, sqd, D, D_MAIN, D_TAIL)
    if D_TAIL > 0:
        offs_dt = D_MAIN + tl.arange(0, D_TAIL)
        dt_mask = offs_dt[None, :] < D
    hv_mask = h_mask[:, None] & v_mask
    do = tl.load(dout_ptr + b * sdob + t * sdot + heads[:, None] * sdoh + offs_v[None, :] * sdod,
                 mask=hv_mask, other=0.0)
    o = tl.load(out_ptr + b * sob + t * sot + heads[:, None] * soh + offs_v[None, :] * sod,
                mask=hv_mask, other=0.0)
    stat = b * slb + t * slt + heads * slh
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    if HAS_DLSE:
        # d lse / d s_j = p_j: the lse's gradient enters dS as -dlse inside (dP - Delta).
        delta -= tl.load(dlse_ptr + stat, mask=h_mask, other=0.0)
    tl.store(delta_ptr + stat, delta, mask=h_mask)
    lse2 = tl.load(lse_ptr + stat, mask=h_mask, other=0.0) * LOG2E_JIT
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * LOG2E_JIT
        tl.store(dsink_ptr + stat, -tl.exp2(sink2 - lse2) * delta, mask=h_mask)
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # empty row: every p is exp2(-inf) = 0
    if TARGET:
        # Padded heads' p becomes exp2(s - inf) = 0 instead of 1, so the target's head sum
        # needs no mask in the loop. Their dS is p * (0 - 0) = 0 and their dO and q are 0
        # either way: dQ, dK and dV are bitwise the same.
        lse2 = tl.where(h_mask, lse2, float("inf"))
        # This program's slice: _coords' program group (KV head, head block).
        grp = kvh * NHB + tl.min(offs_h, axis=0) // BLOCK_H
        tgt_base = tgt_ptr + grp * stg + b * stb + t * stt

    k_base = k_ptr + b * skb + kvh * skh
    v_base = v_ptr + b * svb + kvh * svh
    idx_base = idx_ptr + b * sib + t * sit + kvh * sih
    n_pre = _prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX)
    if FUSE_DKV:
        dk_base, dv_base, rmk_base, rmv_base, fxk_base, fxv_base = _dkv_bases(
            dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr, b, kvh, sdkb,
            sdkh, sdvb, sdvh, srb, srh)
    dq_main = tl.zeros([BLOCK_H, D_MAIN], tl.float32)
    if D_TAIL > 0:
        dq_tail = tl.zeros([BLOCK_H, D_TAIL], tl.float32)
    for n0 in range(0, n_pre + NK, BLOCK_N):
        if LOCKSTEP:
            lockstep_step(wave_ptr, active * (n0 // BLOCK_N - SYNC_SLACK + 1), SYNC_SPINS,
                          SYNC_PTX)
        rows, valid = _load_rows(idx_base, sik, n0, NK, n_pre, BLOCK_N, HAS_PREFIX)
        if TAIL_FIRST and D_TAIL > 0:
            # dq_tail_first: the tail's gather and product before the main part's, so that
            # the gathers are not all held in registers at once (the default order spills the
            # mask's key indices across the product).
            k_tail = tl.load(k_base + rows[:, None] * sks + offs_dt[None, :] * skd,
                             mask=valid[:, None] & dt_mask, other=0.0)
            s = tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
            k_main = tl.load(k_base + rows[:, None] * sks + offs_dm[None, :] * skd,
                             mask=valid[:, None], other=0.0)
            s = tl.dot(q_main, tl.trans(k_main), acc=s, input_precision=PRECISION)
        else:
            k_main = tl.load(k_base + rows[:, None] * sks + offs_dm[None, :] * skd,
                             mask=valid[:, None], other=0.0)
            s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
            if D_TAIL > 0:
                k_tail = tl.load(k_base + rows[:, None] * sks + offs_dt[None, :] * skd,
                                 mask=valid[:, None] & dt_mask, other=0.0)
                s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
        p = tl.exp2(tl.where(valid[None, :], s * qk_scale, float("-inf")) - lse2[:, None])
        if V_IS_K_MAIN:
            v_tile = k_main
        else:
            v_tile = tl.load(v_base + rows[:, None] * svs + offs_v[None, :] * svd,
                             mask=valid[:, None] & v_mask, other=0.0)
        dp = tl.dot(do, tl.trans(v_tile), input_precision=PRECISION)
        if FUSE_DKV:
            # dS carries the scale here (dK needs it inside the product; dQ then needs none).
            ds = (p * (dp - delta[:, None]) * sm_scale).to(k_main.dtype)
        else:
            ds = (p * (dp - delta[:, None])).to(k_main.dtype)
        if TARGET:
            # A column sum of the tile in registers (across warps through shared memory when
            # the heads span several warps); slot = n0 + j without a prefix.
            offs_n = n0 + tl.arange(0, BLOCK_N)
            head_sum = tl.sum(p, axis=0)
            if TARGET_ATOMIC:
                tl.atomic_add(tgt_base + offs_n * stk, head_sum, mask=valid, sem="relaxed")
            else:
                tl.store(tgt_base + offs_n * stk, tl.where(valid, head_sum, -1.0),
                         mask=offs_n < NK)
        dq_main += tl.dot(ds, k_main, input_precision=PRECISION)
        if D_TAIL > 0:
            dq_tail += tl.dot(ds, k_tail, input_precision=PRECISION)
        if FUSE_DKV:
            dk_main, dv_tt = _dkv_tiles_channels_on_m(q_main, do, p, ds, V_IS_K_MAIN, PRECISION)
            if not V_IS_K_MAIN:
                _dkv_add(dv_base, rmv_base, fxv_base, rows, valid, tl.trans(dv_tt), offs_v,
                         sdvs, sdvd, DV, srs, MODE)
            _dkv_add(dk_base, rmk_base, fxk_base, rows, valid, dk_main, offs_dm, sdks, sdkd, D,
                     srs, MODE)
            if D_TAIL > 0:
                dk_tail = tl.trans(tl.dot(tl.trans(q_tail), ds, input_precision=PRECISION))
                _dkv_add(dk_base, rmk_base, fxk_base, rows, valid, dk_tail, offs_dt, sdks, sdkd,
                         D, srs, MODE)

    if FUSE_DKV:
        dq_scale = 1.0
    else:
        dq_scale = sm_scale
    dq_rows = dq_ptr + b * sdqb + t * sdqt + heads[:, None] * sdqh
    tl.store(dq_rows + offs_dm[None, :] * sdqd, (dq_main * dq_scale).to(dq_ptr.dtype.element_ty),
             mask=h_mask[:, None])
    if D_TAIL > 0:
        tl.store(dq_rows + offs_dt[None, :] * sdqd,
                 (dq_tail * dq_scale).to(dq_ptr.dtype.element_ty), mask=h_mask[:, None] & dt_mask)


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, dout_ptr, lse_ptr, dlse_ptr,
    dq_ptr, delta_ptr, dsink_ptr,
    dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr, tgt_ptr,
    sync_ptr, programs, work, n_queries,
    T, NK, G, NHB, qk_scale, sm_scale,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
    sib, sit, sih, sik, spb, spt, sob, sot, soh, sod, sdob, sdot, sdoh, sdod, slb, slt, slh,
    sdqb, sdqt, sdqh, sdqd,
    sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, srb, srs, srh, stg, stb, stt, stk,
    D: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, HAS_PREFIX: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, V_IS_K_MAIN: tl.constexpr, HAS_SINK: tl.constexpr,
    HAS_DLSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FUSE_DKV: tl.constexpr, MODE: tl.constexpr, NG: tl.constexpr,
    TAIL_FIRST: tl.constexpr = False, TARGET: tl.constexpr = False,
    TARGET_ATOMIC: tl.constexpr = False, LOCKSTEP: tl.constexpr = False,
    SYNC_SLACK: tl.constexpr = 1, SYNC_SPINS: tl.constexpr = 64, SYNC_PTX: tl.constexpr = True,
):
    """dQ for one query's head block; also writes Delta = dO . O - dlse and sink terms.

    P = exp2(s - lse2) from the saved lse, dP = dO @ V_sel^T, dS = P * (dP - Delta),
    dQ = scale * dS @ K_sel (fp32 accumulators, no atomics: the program owns its rows).
    Delta and the per-(query, head) sink term -p_sink * Delta go to [B, T, Hq] fp32 buffers.
    FUSE_DKV: the same pass also adds this head block's dK / dV tiles into the key rows (the
    channels on M: dK^T = scale * q^T dS + dV^T, dV^T = dO^T P, per MODE, as _bwd_dkv_kernel),
    so S and dP are computed and the key rows gathered once for the whole backward.
    TAIL_FIRST: S's tail channels first (AttentionKernelOptions.dq_tail_first).
    TARGET (no prefix, no sink): also the indexer loss's target, P's sum over this block's
    heads at each listed slot, into slice stg * (KV head * NHB + head block) of tgt [B, T, NK]:
    stored (-1 at invalid slots), or TARGET_ATOMIC added at the valid slots (two contributors).
    LOCKSTEP: persistent programs over the work items, paced by their waves' counters, as
    `_bwd_dkv_kernel`'s (AttentionKernelOptions.dq_lockstep).
    """
    if LOCKSTEP:
        for item in range(tl.program_id(0), work, programs):
            wave = item // programs
            b, t, kvh, offs_h, h_mask = _work_item_coords(item, n_queries, T, NHB, G, NG,
                                                          BLOCK_H)
            _dq_item(b, t, kvh, offs_h, h_mask, sync_ptr + wave,
                     tl.minimum(programs, work - wave * programs),
                     q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, dout_ptr, lse_ptr,
                     dlse_ptr, dq_ptr, delta_ptr, dsink_ptr, dk_ptr, dv_ptr, rowmax_k_ptr,
                     rowmax_v_ptr, scale_k_ptr, scale_v_ptr, tgt_ptr, T, NK, G, NHB, qk_scale,
                     sm_scale, sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                     sib, sit, sih, sik, spb, spt, sob, sot, soh, sod, sdob, sdot, sdoh, sdod,
                     slb, slt, slh, sdqb, sdqt, sdqh, sdqd, sdkb, sdks, sdkh, sdkd, sdvb, sdvs,
                     sdvh, sdvd, srb, srs, srh, stg, stb, stt, stk, D, D_MAIN, D_TAIL, HAS_PREFIX,
                     DV, DV_PAD, V_IS_K_MAIN, HAS_SINK, HAS_DLSE, BLOCK_H, BLOCK_N, PRECISION,
                     FUSE_DKV, MODE, TAIL_FIRST, TARGET, TARGET_ATOMIC,
                     True, SYNC_SLACK, SYNC_SPINS, SYNC_PTX)
    else:  # straight-line, as `_bwd_dkv_kernel`'s
        b, t, kvh, offs_h, h_mask = _coords(T, NHB, G, NG, BLOCK_H)
        _dq_item(b, t, kvh, offs_h, h_mask, sync_ptr, 0,
                 q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, sink_ptr, out_ptr, dout_ptr, lse_ptr,
                 dlse_ptr, dq_ptr, delta_ptr, dsink_ptr, dk_ptr, dv_ptr, rowmax_k_ptr,
                 rowmax_v_ptr, scale_k_ptr, scale_v_ptr, tgt_ptr, T, NK, G, NHB, qk_scale,
                 sm_scale, sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                 sib, sit, sih, sik, spb, spt, sob, sot, soh, sod, sdob, sdot, sdoh, sdod,
                 slb, slt, slh, sdqb, sdqt, sdqh, sdqd, sdkb, sdks, sdkh, sdkd, sdvb, sdvs,
                 sdvh, sdvd, srb, srs, srh, stg, stb, stt, stk, D, D_MAIN, D_TAIL, HAS_PREFIX,
                 DV, DV_PAD, V_IS_K_MAIN, HAS_SINK, HAS_DLSE, BLOCK_H, BLOCK_N, PRECISION,
                 FUSE_DKV, MODE, TAIL_FIRST, TARGET, TARGET_ATOMIC,
                 False, SYNC_SLACK, SYNC_SPINS, SYNC_PTX)


@triton.jit
def _dkv_item(
    b, t, kvh, offs_h, h_mask, wave_ptr, active,
    q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, dout_ptr, lse_ptr, delta_ptr,
    dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr,
    T, NK, G, NHB, qk_scale, sm_scale,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
    sib, sit, sih, sik, spb, spt, sdob, sdot, sdoh, sdod, slb, slt, slh,
    sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, srb, srs, srh,
    D: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, HAS_PREFIX: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, V_IS_K_MAIN: tl.constexpr,
    MODE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, CHANNELS_ON_M: tl.constexpr, CARRY: tl.constexpr,
    LOCKSTEP: tl.constexpr, SYNC_SLACK: tl.constexpr, SYNC_SPINS: tl.constexpr,
    SYNC_PTX: tl.constexpr,
):
    """`_bwd_dkv_kernel`'s work for one (query, head block) at its coordinates. LOCKSTEP: before
    each key tile i, count this program's start in its wave's counter (wave_ptr) and wait
    until the `active` programs of the wave have together made the starts of all of them at
    tile i - SYNC_SLACK (`common.lockstep_step`)."""
    heads = kvh * G + offs_h
    offs_dm = tl.arange(0, D_MAIN)
    offs_v = tl.arange(0, DV_PAD)
    v_mask = offs_v[None, :] < DV
    q_main, q_tail = _load_q(q_ptr, b, t, heads, h_mask, sqb, sqt, sqh, sqd, D, D_MAIN, D_TAIL)
    if D_TAIL > 0:
        offs_dt = D_MAIN + tl.arange(0, D_TAIL)
        dt_mask = offs_dt[None, :] < D
    do = tl.load(dout_ptr + b * sdob + t * sdot + heads[:, None] * sdoh + offs_v[None, :] * sdod,
                 mask=h_mask[:, None] & v_mask, other=0.0)
    stat = b * slb + t * slt + heads * slh
    delta = tl.load(delta_ptr + stat, mask=h_mask, other=0.0)
    lse2 = tl.load(lse_ptr + stat, mask=h_mask, other=0.0) * LOG2E_JIT
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)

    k_base = k_ptr + b * skb + kvh * skh
    v_base = v_ptr + b * svb + kvh * svh
    idx_base = idx_ptr + b * sib + t * sit + kvh * sih
    n_pre = _prefix_length(pre_ptr, b, t, spb, spt, HAS_PREFIX)
    dk_base, dv_base, rmk_base, rmv_base, fxk_base, fxv_base = _dkv_bases(
        dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr, b, kvh, sdkb, sdkh,
        sdvb, sdvh, srb, srh)
    if CARRY:
        # dkv_carry (channels on M only): tile n's P and dS are carried to the next iteration,
        # which adds tile n's dK / dV before computing tile n + 1's P and dS. S and dP then
        # feed no product of their own iteration, so Triton does not take them for a chained
        # dot (which it lays out with every warp on M: at 64 heads and 8 warps both
        # warpgroups computed the whole of S and dP) and splits them over the two
        # warpgroups. Only P and dS cross iterations: the key rows are reloaded for the
        # atomics, since rows carried in each layout the atomics use spilled (800 B).
        if LOCKSTEP:
            lockstep_step(wave_ptr, active * (1 - SYNC_SLACK), SYNC_SPINS, SYNC_PTX)
        rows, valid = _load_rows(idx_base, sik, 0, NK, n_pre, BLOCK_N, HAS_PREFIX)
        k_main, k_tail, v_tile = _dkv_gather(k_base, v_base, rows, valid, sks, skd, svs, svd, D,
                                             D_MAIN, D_TAIL, DV, DV_PAD, V_IS_K_MAIN)
        p_c, ds_c = _dkv_p_ds(q_main, q_tail, do, k_main, k_tail, v_tile, valid, lse2, delta,
                              qk_scale, sm_scale, D_TAIL, PRECISION)
        for n0 in range(BLOCK_N, n_pre + NK, BLOCK_N):
            if LOCKSTEP:
                lockstep_step(wave_ptr, active * (n0 // BLOCK_N - SYNC_SLACK + 1), SYNC_SPINS,
                              SYNC_PTX)
            rows, valid = _load_rows(idx_base, sik, n0 - BLOCK_N, NK, n_pre, BLOCK_N, HAS_PREFIX)
            _dkv_add_tile_channels_on_m(q_main, q_tail, do, p_c, ds_c, rows, valid, dk_base,
                                        dv_base, rmk_base, rmv_base, fxk_base, fxv_base, sdks,
                                        sdkd, sdvs, sdvd, srs, D, D_MAIN, D_TAIL, DV, DV_PAD,
                                        V_IS_K_MAIN, MODE, PRECISION)
            rows, valid = _load_rows(idx_base, sik, n0, NK, n_pre, BLOCK_N, HAS_PREFIX)
            k_main, k_tail, v_tile = _dkv_gather(k_base, v_base, rows, valid, sks, skd, svs,
                                                 svd, D, D_MAIN, D_TAIL, DV, DV_PAD,
                                                 V_IS_K_MAIN)
            p_c, ds_c = _dkv_p_ds(q_main, q_tail, do, k_main, k_tail, v_tile, valid, lse2,
                                  delta, qk_scale, sm_scale, D_TAIL, PRECISION)
        n_last = tl.maximum((n_pre + NK - 1) // BLOCK_N, 0) * BLOCK_N
        rows, valid = _load_rows(idx_base, sik, n_last, NK, n_pre, BLOCK_N, HAS_PREFIX)
        _dkv_add_tile_channels_on_m(q_main, q_tail, do, p_c, ds_c, rows, valid, dk_base,
                                    dv_base, rmk_base, rmv_base, fxk_base, fxv_base, sdks, sdkd,
                                    sdvs, sdvd, srs, D, D_MAIN, D_TAIL, DV, DV_PAD, V_IS_K_MAIN,
                                    MODE, PRECISION)
        return
    for n0 in range(0, n_pre + NK, BLOCK_N):
        if LOCKSTEP:
            lockstep_step(wave_ptr, active * (n0 // BLOCK_N - SYNC_SLACK + 1), SYNC_SPINS,
                          SYNC_PTX)
        rows, valid = _load_rows(idx_base, sik, n0, NK, n_pre, BLOCK_N, HAS_PREFIX)
        k_main = tl.load(k_base + rows[:, None] * sks + offs_dm[None, :] * skd,
                         mask=valid[:, None], other=0.0)
        if D_TAIL > 0:
            k_tail = tl.load(k_base + rows[:, None] * sks + offs_dt[None, :] * skd,
                             mask=valid[:, None] & dt_mask, other=0.0)
        if V_IS_K_MAIN:
            v_tile = k_main
        else:
            v_tile = tl.load(v_base + rows[:, None] * svs + offs_v[None, :] * svd,
                             mask=valid[:, None] & v_mask, other=0.0)
        if CHANNELS_ON_M:
            # Heads on M for S and dP, channels on M for dK^T = q^T dS and dV^T = dO^T P: every
            # product is wgmma-sized (M >= 64) whatever the key tile; the tiles are transposed
            # back (a layout change) for the row-wise accumulation.
            s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
            if D_TAIL > 0:
                s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
            p = tl.exp2(tl.where(valid[None, :], s * qk_scale, float("-inf")) - lse2[:, None])
            dp = tl.dot(do, tl.trans(v_tile), input_precision=PRECISION)
            ds = (p * (dp - delta[:, None]) * sm_scale).to(q_main.dtype)
            dk_main, dv_tt = _dkv_tiles_channels_on_m(q_main, do, p, ds, V_IS_K_MAIN, PRECISION)
            dv_t = tl.trans(dv_tt)
        else:
            s_t = tl.dot(k_main, tl.trans(q_main), input_precision=PRECISION)
            if D_TAIL > 0:
                s_t += tl.dot(k_tail, tl.trans(q_tail), input_precision=PRECISION)
            p_t = tl.exp2(tl.where(valid[:, None], s_t * qk_scale, float("-inf"))
                          - lse2[None, :])
            dp_t = tl.dot(v_tile, tl.trans(do), input_precision=PRECISION)
            ds_t = (p_t * (dp_t - delta[None, :]) * sm_scale).to(q_main.dtype)
            dv_t = tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            if V_IS_K_MAIN:
                dk_main = tl.dot(ds_t, q_main, acc=dv_t, input_precision=PRECISION)
            else:
                dk_main = tl.dot(ds_t, q_main, input_precision=PRECISION)
        if not V_IS_K_MAIN:
            _dkv_add(dv_base, rmv_base, fxv_base, rows, valid, dv_t, offs_v, sdvs, sdvd, DV, srs,
                     MODE)
        _dkv_add(dk_base, rmk_base, fxk_base, rows, valid, dk_main, offs_dm, sdks, sdkd, D, srs,
                 MODE)
        if D_TAIL > 0:
            if CHANNELS_ON_M:
                dk_tail = tl.trans(tl.dot(tl.trans(q_tail), ds, input_precision=PRECISION))
            else:
                dk_tail = tl.dot(ds_t, q_tail, input_precision=PRECISION)
            _dkv_add(dk_base, rmk_base, fxk_base, rows, valid, dk_tail, offs_dt, sdks, sdkd, D,
                     srs, MODE)


@triton.jit
def _bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, dout_ptr, lse_ptr, delta_ptr,
    dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr,
    sync_ptr, programs, work, n_queries,
    T, NK, G, NHB, qk_scale, sm_scale,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
    sib, sit, sih, sik, spb, spt, sdob, sdot, sdoh, sdod, slb, slt, slh,
    sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, srb, srs, srh,
    D: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, HAS_PREFIX: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, V_IS_K_MAIN: tl.constexpr,
    MODE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, CHANNELS_ON_M: tl.constexpr, NG: tl.constexpr,
    CARRY: tl.constexpr = False, LOCKSTEP: tl.constexpr = False,
    SYNC_SLACK: tl.constexpr = 1, SYNC_SPINS: tl.constexpr = 64, SYNC_PTX: tl.constexpr = True,
):
    """dK / dV contributions of one query's head block, added into the selected key rows.

    S = q @ K_sel^T, P = exp2(S - lse2), dP = dO @ V_sel^T, dS = P * (dP - Delta); then
    CHANNELS_ON_M: dK^T = scale * q^T @ dS and dV^T = dO^T @ P (the channels as the MMA's M);
    else the same with the keys as M (dK_tile = scale * dS^T @ q, dV_tile = P^T @ dO). dV is
    merged into dK's first channels when V is K's main part; tiles are accumulated per MODE
    (fp32 atomics or fixed point). CARRY (channels on M only): each tile's products run one
    iteration later (AttentionKernelOptions.dkv_carry). LOCKSTEP: `programs` persistent
    programs take work items p, p + programs, ... of the `work` (query, head block) items, in
    the order the grid of `_coords` runs them (`_work_item_coords`; n_queries = B x T), the
    programs of a wave (a counter each in sync_ptr) kept within SYNC_SLACK key tiles of each
    other (AttentionKernelOptions.dkv_lockstep); else one program an item.
    """
    if LOCKSTEP:
        for item in range(tl.program_id(0), work, programs):
            wave = item // programs
            b, t, kvh, offs_h, h_mask = _work_item_coords(item, n_queries, T, NHB, G, NG,
                                                          BLOCK_H)
            _dkv_item(b, t, kvh, offs_h, h_mask, sync_ptr + wave,
                      tl.minimum(programs, work - wave * programs),
                      q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, dout_ptr, lse_ptr, delta_ptr,
                      dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr,
                      T, NK, G, NHB, qk_scale, sm_scale,
                      sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                      sib, sit, sih, sik, spb, spt, sdob, sdot, sdoh, sdod, slb, slt, slh,
                      sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, srb, srs, srh,
                      D, D_MAIN, D_TAIL, HAS_PREFIX, DV, DV_PAD, V_IS_K_MAIN, MODE, BLOCK_H,
                      BLOCK_N, PRECISION, CHANNELS_ON_M, CARRY, True, SYNC_SLACK, SYNC_SPINS,
                      SYNC_PTX)
    else:
        # Straight-line, not a one-trip item loop: compiled for sm_90a, the loop form spilled
        # 1.3 KB (GLM-5.1) / 1.0 KB (HCA) into the default's tile loop.
        b, t, kvh, offs_h, h_mask = _coords(T, NHB, G, NG, BLOCK_H)
        _dkv_item(b, t, kvh, offs_h, h_mask, sync_ptr, 0,
                  q_ptr, k_ptr, v_ptr, idx_ptr, pre_ptr, dout_ptr, lse_ptr, delta_ptr,
                  dk_ptr, dv_ptr, rowmax_k_ptr, rowmax_v_ptr, scale_k_ptr, scale_v_ptr,
                  T, NK, G, NHB, qk_scale, sm_scale,
                  sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                  sib, sit, sih, sik, spb, spt, sdob, sdot, sdoh, sdod, slb, slt, slh,
                  sdkb, sdks, sdkh, sdkd, sdvb, sdvs, sdvh, sdvd, srb, srs, srh,
                  D, D_MAIN, D_TAIL, HAS_PREFIX, DV, DV_PAD, V_IS_K_MAIN, MODE, BLOCK_H,
                  BLOCK_N, PRECISION, CHANNELS_ON_M, CARRY, False, SYNC_SLACK, SYNC_SPINS,
                  SYNC_PTX)


# --------------------------------------------------------------------------- launch wrappers


class _Geometry:
    """Static sizes of one call: head blocking, channel split, and the V source."""

    def __init__(self, q, k, v, dv):
        _, _, hq, d = q.shape
        hkv = k.shape[2]
        self.G = hq // hkv
        self.block_h = min(MAX_BLOCK_H, max(MIN_DOT, triton.next_power_of_2(self.G)))
        self.nhb = triton.cdiv(self.G, self.block_h)
        if d < MIN_DOT:  # sparse_attention_triton pads; the launchers below read whole tiles
            raise ValueError(f"the kernels need a head dim of at least {MIN_DOT}, got {d} "
                             "(sparse_attention_triton zero-pads narrower heads)")
        self.D = d
        self.d_main, self.d_tail = channel_split(d)
        self.dv = v.shape[-1] if v is not None else (dv if dv is not None else d)
        self.dv_pad = max(MIN_DOT, triton.next_power_of_2(self.dv))
        # V read from K's already-gathered main tile (absorbed MLA: dv = 512 = main part of 576).
        self.v_is_k_main = v is None and self.dv == self.d_main
        self.wide = self.block_h * max(self.dv_pad, self.d_main) >= WIDE_TILE
        self.precision = dot_precision(q.dtype)

    def num_warps(self, kernel: str, options: AttentionKernelOptions) -> int:
        """Warps of `kernel` ("fwd", "dq" or "dkv"): its wide count for a large tile, else 4."""
        if not self.wide:
            return 4
        return {"fwd": options.fwd_wide_warps, "dq": options.dq_wide_warps,
                "dkv": options.dkv_wide_warps}[kernel]

    def const(self):
        return dict(D=self.D, D_MAIN=self.d_main, D_TAIL=self.d_tail, DV=self.dv,
                    DV_PAD=self.dv_pad, V_IS_K_MAIN=self.v_is_k_main, BLOCK_H=self.block_h,
                    PRECISION=self.precision)

    def smem_bytes(self, block_n, stages, elem, resident):
        """Rough shared memory of a tiling: resident [heads x dims] tiles + staged key tiles."""
        dims = self.d_main + self.d_tail
        staged = block_n * (dims + (0 if self.v_is_k_main else self.dv_pad)) * elem
        return resident * elem + staged * max(stages, 1)


_tiling_cache: dict[tuple, tuple[int, int]] = {}


def _launch(kernel, grid, args, const, geo, tilings: Tilings, resident, elem, key,
            options: AttentionKernelOptions):
    """Launch with the first tiling whose estimated shared memory fits (the last one if none
    does) that runs; remember it per (kernel, geometry, tilings, warps) key."""
    warps = geo.num_warps(key[0], options)
    key = key + (warps,)
    if key not in _tiling_cache:  # the shared-memory filter matters only for the first launch
        fitting = [tl_ for tl_ in tilings if geo.smem_bytes(*tl_, elem, resident) <= SMEM_BUDGET]
        tilings = fitting or tilings[-1:]
    launch_first_fitting(kernel, grid, args, const, tilings, warps, _tiling_cache, key,
                         "sparse-attention")


def _strides4(x):
    return tuple(x.stride())


def _index_strides(indices):
    """(b, t, kv head, slot) strides; [B, T, K] indices are shared by every KV head."""
    if indices.dim() == 3:
        sb, st, sk = indices.stride()
        return sb, st, 0, sk
    return tuple(indices.stride())


def _prefix_args(prefix_lengths, placeholder):
    """(tensor, its (b, t) strides) of the rows' dense-prefix lengths; a placeholder if none."""
    if prefix_lengths is None:
        return placeholder, (0, 0)
    return prefix_lengths, tuple(prefix_lengths.stride())


def _v_source(k, v, geo):
    """The tensor V is read from and its strides (K itself when v is None)."""
    src = k if v is None else v
    return src, _strides4(src)


def sparse_attention_fwd(q, k, v, indices, softmax_scale, dv=None, sink=None,
                         prefix_lengths=None,
                         options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT,
                         hytopk_layout: bool = False, keys_ascending: bool = False):
    """Forward launch: returns out [B, T, Hq, dv] (q's dtype) and lse fp32 [B, T, Hq].

    prefix_lengths: optional int [B, T]; row (b, t) also attends to keys 0 .. n - 1 before its
    listed indices (which must not repeat them). hytopk_layout: every row lists its valid
    slots first and holds one (HyTopK's causal output), which spares FlashMLA's forward
    (options.fwd_flashmla) its layout test and host syncs. keys_ascending: each row's valid
    keys increase (`ops/key_order.py`), which spares the lockstep kernels their sort."""
    B, T, Hq, _ = q.shape
    geo = _Geometry(q, k, v, dv)
    done = None
    if options.fwd_flashmla:
        done = _flashmla_forward(q, k, v, indices, softmax_scale, geo.dv, sink, prefix_lengths,
                                 hytopk_layout)
    if done is None:
        done = _sm90_forward(q, k, v, indices, softmax_scale, geo.dv, sink, prefix_lengths,
                             options, keys_ascending)
    if done is not None:
        return done
    NK = indices.shape[-1]
    out = torch.empty((B, T, Hq, geo.dv), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, T, Hq), device=q.device, dtype=torch.float32)
    v_src, v_str = _v_source(k, v, geo)
    grid, ng = launch_grid(B * T, k.shape[2], geo.nhb, options.head_blocks_adjacent)
    resident = geo.block_h * (geo.d_main + geo.d_tail)
    tilings = options.fwd_tilings
    lockstep = options.fwd_lockstep and options.fwd_softmax
    work = B * T * k.shape[2] * geo.nhb
    programs, sync = work, lse
    if lockstep and work > 0:
        programs, sync = lockstep_plan(
            work, q.device, options.triton_lockstep_slack,
            _resident_programs(geo, tilings, resident, q.element_size(),
                               options.triton_lockstep_programs_per_sm))
        grid = (programs,)
    pre, pre_str = _prefix_args(prefix_lengths, lse)
    args = (q, k, v_src, indices, pre, sink if sink is not None else lse, out, lse,
            sync, programs, work, B * T, T, NK, geo.G, geo.nhb, softmax_scale * LOG2E,
            *_strides4(q), *_strides4(k), *v_str, *_index_strides(indices), *pre_str,
            *_strides4(out), *lse.stride())
    const = dict(geo.const(), HAS_SINK=sink is not None, HAS_PREFIX=prefix_lengths is not None,
                 NG=ng, SOFTMAX=options.fwd_softmax)
    if lockstep:  # absent otherwise: the default launch's constexprs as before
        const.update(LOCKSTEP=True, SYNC_SLACK=options.triton_lockstep_slack,
                     SYNC_SPINS=SYNC_SPINS, SYNC_PTX=not triton_interpret())
    _launch(_fwd_kernel, grid, args, const, geo, tilings, resident, q.element_size(),
            ("fwd", q.dtype, tilings, tuple(sorted(const.items()))), options)
    return out, lse


def hopper_forward_module() -> tuple[ModuleType | None, str]:
    """(`sparse_mla_fwd_sm90`, "") or (None, why it cannot be loaded: `common.gluon_module`)."""
    return gluon_module("sparse_mla_fwd_sm90")


def hopper_forward(q, k, v, dv, sink, prefix_lengths, *,
                   options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT,
                   warn: bool = True):
    """The `sparse_mla_fwd_sm90` module when `sparse_attention_fwd` runs its Hopper forward on
    these inputs, else None (then the Triton forward runs: silently for another shape, device,
    options.fwd_sm90 = False, a dense prefix without options.prefix_sm90 or a variant that
    failed before; with one warning per cause, under
    `warn`, when the shape is absorbed MLA on Hopper and the kernel still cannot run: no Gluon,
    or a layout its copies cannot take)."""
    if not (options.fwd_sm90 and options.fwd_softmax and q.is_cuda):
        return None
    if prefix_lengths is not None and not options.prefix_sm90:
        return None
    sm90, import_error = hopper_forward_module()
    if sm90 is None:
        if warn and on_hopper(q):
            warn_once("sparse-mla-fwd-sm90: import", "HyScale: the Hopper sparse-MLA forward "
                      f"cannot be loaded ({import_error}); using the Triton forward",
                      stacklevel=4)
        return None
    if not sm90.applies(q, k, v, dv, sink, prefix_lengths, ws=options.fwd_sm90_ws):
        return None
    problem = sm90.layout_problem(q, k)
    if problem is not None:
        if warn:
            sm90.warn_cannot_run(*problem)
        return None
    return sm90


def _sm90_forward(q, k, v, indices, softmax_scale, dv, sink, prefix_lengths, options,
                  keys_ascending=False):
    """(out, lse) from the Hopper absorbed-MLA forward, or None where it does not run
    (`hopper_forward`) or this variant fails (one warning; the variant is not tried again:
    `sparse_mla_fwd_sm90.disable`)."""
    sm90 = hopper_forward(q, k, v, dv, sink, prefix_lengths, options=options)
    if sm90 is None:
        return None
    try:
        return sm90.sparse_mla_fwd_sm90(q, k, indices, softmax_scale, sink=sink,
                                        options=options, keys_ascending=keys_ascending,
                                        prefix_lengths=prefix_lengths)
    except torch.OutOfMemoryError:
        raise  # not the kernel's failure: the Triton forward would need the same memory
    except Exception as exc:  # this variant failed to compile or launch: say so, keep training
        sm90.disable(sm90.variant(q, options.fwd_sm90_ws, prefix_lengths is not None),
                     f"{type(exc).__name__}: {exc}")
        return None


def _flashmla_forward(q, k, v, indices, softmax_scale, dv, sink, prefix_lengths, hytopk_layout):
    """(out, lse) from FlashMLA's sparse forward (`AttentionKernelOptions.fwd_flashmla`), or
    None (one warning naming why) where it cannot run these inputs."""
    from megatron_hyscale.ops.backends.library_attention import (
        flashmla_forward,
        flashmla_forward_unsupported,
    )

    reason = flashmla_forward_unsupported(q, k, v, indices, dv, prefix_lengths=prefix_lengths)
    if reason:
        warn_once(f"fwd-flashmla: {reason}", "HyScale: AttentionKernelOptions.fwd_flashmla: "
                  f"FlashMLA's forward cannot run this call ({reason}); running HyScale's "
                  "forward", stacklevel=5)
        return None
    fwd = flashmla_forward(q, k, indices, softmax_scale, sink=sink, hytopk_layout=hytopk_layout)
    # A view of padded rows (fewer query heads than the kernel's 64) would keep the padding
    # alive until the backward.
    return fwd.out.contiguous(), fwd.lse


class _DkvAccumulators:
    """dK / dV accumulation buffers of one backward and their per-key-row statistics: fp32
    (atomic adds) or int64 fixed point (deterministic), rowmax / scale rows when needed."""

    def __init__(self, q, k, v, geo, lse, deterministic, with_rowmax):
        B, S, Hkv = k.shape[:3]
        acc_dtype = torch.int64 if deterministic else torch.float32
        self.dk = torch.zeros((B, S, Hkv, geo.D), device=q.device, dtype=acc_dtype)
        self.separate_v = v is not None
        self.dv = (torch.zeros((B, S, Hkv, geo.dv), device=q.device, dtype=acc_dtype)
                   if self.separate_v else self.dk)
        if deterministic or with_rowmax:
            self.rowmax_k = torch.zeros((B, S, Hkv), device=q.device, dtype=torch.float32)
            self.rowmax_v = torch.zeros_like(self.rowmax_k) if self.separate_v else self.rowmax_k
        else:
            self.rowmax_k = self.rowmax_v = lse  # unused placeholders
        self.scale_k, self.scale_v = self.rowmax_k, self.rowmax_v
        self.exp_k = self.exp_v = None

    def ptrs(self):
        return (self.dk, self.dv, self.rowmax_k, self.rowmax_v, self.scale_k, self.scale_v)

    def strides(self):
        return (*_strides4(self.dk), *_strides4(self.dv), *self.rowmax_k.stride())

    def set_scales(self, n_contrib):
        """After the MODE_ROWMAX pass: power-of-two scales for the MODE_FIXED pass."""
        self.scale_k, self.exp_k = fixed_point_scale(self.rowmax_k, n_contrib)
        self.scale_v, self.exp_v = (fixed_point_scale(self.rowmax_v, n_contrib)
                                    if self.separate_v else (self.scale_k, self.exp_k))

    def result(self, k, v):
        """(dk, dv or None) in k's / v's dtype."""
        if self.exp_k is None:
            return self.dk.to(k.dtype), self.dv.to(v.dtype) if self.separate_v else None
        dk = torch.ldexp(self.dk.double(), -self.exp_k.unsqueeze(-1)).to(k.dtype)
        dv = (torch.ldexp(self.dv.double(), -self.exp_v.unsqueeze(-1)).to(v.dtype)
              if self.separate_v else None)
        return dk, dv


class _TargetBuffer:
    """The indexer loss's target emitted by the dQ kernel (TARGET): fp32 [B, T, NK], the
    head sum of P at each slot (before L1 normalisation), -1 where indices < 0.

    Each of a query's Hkv x NHB programs adds its heads' part. How the parts meet is chosen
    for the cheapest hot loop that keeps the result bitwise repeatable: one program (GLM-5.1)
    stores its tile, -1 included (no fill, no atomics, no pass on the host); two (V3.2's two
    head blocks, two KV heads sharing indices) add into zeros with fp32 atomics, exact in
    either order since 0 + a + b = 0 + b + a; more store into a slice each ([n, B, T, NK])
    that the host sums in a fixed order (an fp32 atomic sum of three or more depends on the
    order). In the loop an atomic is one REDG where the store is one STG, and it saves a
    second [B, T, NK] buffer (1 GiB at 128K x 2048 slots) and the host's sum.

    Compiled for sm_90a (`inspect_sm90.py --preset sparse-attention-glm51
    sparse-attention-glm51-dq-target`, GLM-5.1, dQ 64 x 1; untimed): the head sum spans the
    4 warps on M, so it runs through shuffles and shared memory: hot loop 1364 -> 1631
    instructions (SHFL 0 -> 50, STS 18 -> 39, LDS 0 -> 18, BAR 3 -> 7, FADD 64 -> 130),
    spills 152 / 156 -> 184 / 176 B (LDL / STL 20 / 4 -> 25 / 6 a tile: the kernel is at 255
    registers already), shared memory +1 KiB, HGMMA 144 unchanged. The sum runs after dS,
    which reads the same P: placed before dP's product it kept P live across it and spilled
    224 / 216 B (LDL / STL 36 / 17). V3.2 (128 heads, two programs, atomics), the sum before
    dP: 1392 -> 1660, LDL / STL 28 / 9 -> 51 / 32, spills 260 -> 360 B.
    """

    def __init__(self, q, k, indices, geo, sink, prefix_lengths):
        self.check(indices, sink, prefix_lengths)
        B, T = q.shape[:2]
        NK = indices.shape[-1]
        self.n = k.shape[2] * geo.nhb
        self.atomic = self.n == 2
        self.indices = indices if indices.dim() == 3 else indices[:, :, 0]
        shape = (B, T, NK) if self.n <= 2 else (self.n, B, T, NK)
        # The stores cover every slot < NK of their slice; the atomics add into zeros.
        fill = torch.zeros if self.atomic else torch.empty
        self.buf = fill(shape, device=q.device, dtype=torch.float32)

    @staticmethod
    def check(indices, sink, prefix_lengths):
        """ValueError, naming the argument, for what the target does not cover."""
        if sink is not None:
            raise ValueError("emit_target: not with a sink (its probability is no slot's)")
        if prefix_lengths is not None:
            raise ValueError("emit_target: not with prefix_lengths (the target covers only "
                             "the listed indices)")
        if indices.dim() == 4 and indices.shape[2] > 1:
            raise ValueError("emit_target: indices must be shared by the KV heads ([B, T, K] "
                             f"or one KV head), got per-KV-head indices {tuple(indices.shape)}")

    def args(self):
        """(buffer, its (slice, b, t, slot) strides) for the kernel."""
        strides = self.buf.stride()
        return self.buf, (strides if self.n > 2 else (0, *strides))

    def result(self):
        """The target, once the kernel has run."""
        if self.n == 1:
            return self.buf  # the kernel stored every slot, -1 included
        if self.atomic:
            total = self.buf
        else:
            total = self.buf[0]
            for part in self.buf[1:]:  # in slice order: bitwise repeatable
                total = total + part
        return torch.where(self.indices >= 0, total, -1.0)


def sparse_attention_bwd_dq(q, k, v, indices, softmax_scale, out, lse, dout, dlse=None,
                            dv=None, sink=None, prefix_lengths=None, dkv=None,
                            mode=MODE_ATOMIC,
                            options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT,
                            emit_target: bool = False):
    """dQ launch: returns (dq, delta fp32 [B, T, Hq], dsink or None), and the indexer loss's
    target fp32 [B, T, K] as a fourth output under `emit_target` (`_TargetBuffer`; no sink or
    prefix, indices shared by the KV heads: ValueError otherwise).

    dkv: a _DkvAccumulators to fuse the dK / dV accumulation (per `mode`) into this pass (at
    options.bwd_fused_tilings)."""
    B, T, Hq, _ = q.shape
    geo = _Geometry(q, k, v, dv)
    target = (_TargetBuffer(q, k, indices, geo, sink, prefix_lengths) if emit_target
              else None)
    NK = indices.shape[-1]
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    delta = torch.empty((B, T, Hq), device=q.device, dtype=torch.float32)
    dsink_part = torch.empty_like(delta) if sink is not None else delta
    v_src, v_str = _v_source(k, v, geo)
    grid, ng = launch_grid(B * T, k.shape[2], geo.nhb, options.head_blocks_adjacent)
    resident = geo.block_h * (geo.d_main + geo.d_tail + geo.dv_pad)
    fused = dkv is not None
    if fused:
        tilings = options.bwd_fused_tilings
    else:
        tilings = _bwd_tilings(geo, options.dq_tilings, options.narrow_dq_tilings)
    # Paced only with fp32 atomics or none (the deterministic passes' order is fixed anyway).
    lockstep = options.dq_lockstep and (not fused or mode == MODE_ATOMIC)
    work = B * T * k.shape[2] * geo.nhb
    programs, sync = work, lse
    if lockstep and work > 0:
        programs, sync = lockstep_plan(
            work, q.device, options.triton_lockstep_slack,
            _resident_programs(geo, tilings, resident, q.element_size(),
                               options.triton_lockstep_programs_per_sm))
        grid = (programs,)
    dlse_t = dlse if dlse is not None else lse
    pre, pre_str = _prefix_args(prefix_lengths, lse)
    dkv_ptrs = dkv.ptrs() if fused else (lse,) * 6
    dkv_strides = dkv.strides() if fused else (0,) * 11
    tgt, tgt_strides = target.args() if target is not None else (lse, (0,) * 4)
    args = (q, k, v_src, indices, pre, sink if sink is not None else lse, out, dout, lse,
            dlse_t, dq, delta, dsink_part, *dkv_ptrs, tgt, sync, programs, work, B * T, T, NK,
            geo.G, geo.nhb,
            softmax_scale * LOG2E, softmax_scale, *_strides4(q), *_strides4(k), *v_str,
            *_index_strides(indices), *pre_str, *_strides4(out), *_strides4(dout),
            *lse.stride(), *_strides4(dq), *dkv_strides, *tgt_strides)
    const = dict(geo.const(), HAS_SINK=sink is not None, HAS_DLSE=dlse is not None,
                 HAS_PREFIX=prefix_lengths is not None, FUSE_DKV=fused,
                 MODE=mode if fused else MODE_ATOMIC, NG=ng,
                 TAIL_FIRST=options.dq_tail_first and not fused)
    if target is not None:  # absent otherwise: the default launch's constexprs as before
        const.update(TARGET=True, TARGET_ATOMIC=target.atomic)
    if lockstep:
        const.update(LOCKSTEP=True, SYNC_SLACK=options.triton_lockstep_slack,
                     SYNC_SPINS=SYNC_SPINS, SYNC_PTX=not triton_interpret())
    _launch(_bwd_dq_kernel, grid, args, const, geo, tilings, resident, q.element_size(),
            ("dq", q.dtype, tilings, tuple(sorted(const.items()))), options)
    dsink = dsink_part.sum(dim=(0, 1)).to(sink.dtype) if sink is not None else None
    if target is not None:
        return dq, delta, dsink, target.result()
    return dq, delta, dsink


def _bwd_tilings(geo, wide: Tilings, narrow: Tilings) -> Tilings:
    """The backward tiling order for this geometry's head block (see
    AttentionKernelOptions.dq_tilings)."""
    return wide if geo.block_h >= MAX_BLOCK_H else narrow


def sparse_attention_bwd_dkv(q, k, v, indices, softmax_scale, lse, dout, delta, dv=None,
                             deterministic=False, mode=None, prefix_lengths=None,
                             options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT):
    """dK / dV launches (delta from sparse_attention_bwd_dq): returns (dk, dv or None).

    mode=MODE_DISCARD (measurement only) runs the kernel once without accumulating and returns
    the fp32 [B, S, Hkv] discard buffer in place of dk."""
    B, T, Hq, _ = q.shape
    Hkv = k.shape[2]
    geo = _Geometry(q, k, v, dv)
    NK = indices.shape[-1]
    elem = q.element_size()
    v_src, v_str = _v_source(k, v, geo)
    acc = _DkvAccumulators(q, k, v, geo, lse, deterministic, mode == MODE_DISCARD)

    dims = geo.d_main + geo.d_tail + geo.dv_pad
    bh_dkv = geo.block_h
    copies = 1 if options.dkv_channels_on_m else 2  # q and dO held in one or two MMA layouts
    while bh_dkv > MIN_DOT and copies * bh_dkv * dims * elem > options.dkv_resident_budget:
        bh_dkv //= 2
    nhb_dkv = triton.cdiv(geo.G, bh_dkv)
    grid_dkv, ng_dkv = launch_grid(B * T, Hkv, nhb_dkv, options.head_blocks_adjacent)
    # The deterministic passes run unpaced: the pace serves the fp32 atomics' L2 hits.
    lockstep = options.dkv_lockstep and not deterministic and mode != MODE_DISCARD
    work = B * T * Hkv * nhb_dkv
    programs, sync = work, lse
    if lockstep and work > 0:
        programs, sync = lockstep_plan(
            work, q.device, options.triton_lockstep_slack,
            _resident_programs(geo, _bwd_tilings(geo, options.dkv_tilings,
                                                 options.narrow_dkv_tilings),
                               copies * bh_dkv * dims, elem,
                               options.triton_lockstep_programs_per_sm))
        grid_dkv = (programs,)

    pre, pre_str = _prefix_args(prefix_lengths, lse)

    def run(mode):
        args = (q, k, v_src, indices, pre, dout, lse, delta, *acc.ptrs(), sync, programs, work,
                B * T, T, NK, geo.G, nhb_dkv, softmax_scale * LOG2E, softmax_scale,
                *_strides4(q), *_strides4(k), *v_str, *_index_strides(indices), *pre_str,
                *_strides4(dout), *lse.stride(), *acc.strides())
        const = dict(geo.const(), MODE=mode, BLOCK_H=bh_dkv,
                     HAS_PREFIX=prefix_lengths is not None,
                     CHANNELS_ON_M=options.dkv_channels_on_m, NG=ng_dkv,
                     CARRY=options.dkv_carry and options.dkv_channels_on_m)
        if lockstep:  # absent otherwise: the default launch's constexprs as before
            const.update(LOCKSTEP=True, SYNC_SLACK=options.triton_lockstep_slack,
                         SYNC_SPINS=SYNC_SPINS, SYNC_PTX=not triton_interpret())
        tilings = _bwd_tilings(geo, options.dkv_tilings, options.narrow_dkv_tilings)
        _launch(_bwd_dkv_kernel, grid_dkv, args, const, geo, tilings, copies * bh_dkv * dims,
                elem, ("dkv", q.dtype, tilings, tuple(sorted(const.items()))), options)

    if mode == MODE_DISCARD:
        run(MODE_DISCARD)
        return acc.rowmax_k, None
    if not deterministic:
        run(MODE_ATOMIC)
        return acc.result(k, v)
    run(MODE_ROWMAX)
    acc.set_scales(2 * T * nhb_dkv)  # <= one dK and one dV addend per (query, head block)
    run(MODE_FIXED)
    return acc.result(k, v)


# Shared memory an H100 / H200 SM holds for resident programs (228 KiB), and what each
# program's block reserves on top of its own.
SM_SHARED_BYTES = 228 * 1024
BLOCK_RESERVED_SHARED = 1024


def _resident_programs(geo, tilings, resident, elem, cap: int) -> int:
    """Lockstep programs an SM for a Triton kernel: `cap`, fewer where the first of `tilings`
    that fits (as `_launch` picks it) leaves shared memory for fewer: a program that is not
    resident would arrive only after the others finished (GLM-5.1's and HCA's dK/dV programs
    take over 200 KiB, one an SM; QSA's 57 KiB). Registers are not counted (QSA's dK/dV at 255
    a thread x 4 warps leave room for exactly two); a tiling the launch falls back to is not
    known here."""
    sizes = [geo.smem_bytes(n, st, elem, resident) for n, st in tilings]
    smem = next((b for b in sizes if b <= SMEM_BUDGET), sizes[-1])
    fit = SM_SHARED_BYTES // (smem + BLOCK_RESERVED_SHARED)
    return max(1, min(cap, fit))


def sparse_attention_bwd(q, k, v, indices, softmax_scale, out, lse, dout, dlse=None, dv=None,
                         sink=None, deterministic=False, prefix_lengths=None,
                         options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT,
                         keys_ascending: bool = False):
    """Backward launches: returns (dq, dk, dv or None, dsink or None).

    options.bwd_fused: one pass computes dQ and adds dK / dV (two passes when deterministic);
    else the dQ launch, then the dK / dV launch. keys_ascending: as `sparse_attention_fwd`'s."""
    return _backward(q, k, v, indices, softmax_scale, out, lse, dout, dlse, dv, sink,
                     deterministic, prefix_lengths, options, emit_target=False,
                     keys_ascending=keys_ascending)[:4]


def sparse_attention_bwd_with_target(
        q, k, v, indices, softmax_scale, out, lse, dout, dlse=None, dv=None, sink=None,
        deterministic=False, prefix_lengths=None,
        options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT,
        keys_ascending: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """`sparse_attention_bwd`'s (dq, dk, dv or None, dsink or None) and the DSA indexer loss's
    target: fp32 [B, T, K], sum_h softmax_j(scale * q_h . k_{indices_j}) at each slot j (not yet
    L1-normalised), -1 where indices < 0. The dQ kernel sums the P tile it already has, in
    place of `indexer_loss.attention_target`'s second gather of the selected keys; the same
    values as that function given the forward's lse (where the indices are distinct and
    visible, as the attention has them). Bitwise repeatable (`_TargetBuffer`), also without
    `deterministic`. ValueError for a sink, prefix_lengths or per-KV-head indices of several
    KV heads (one head-summed target per slot needs slots shared by every head).
    keys_ascending: as `sparse_attention_fwd`'s."""
    return _backward(q, k, v, indices, softmax_scale, out, lse, dout, dlse, dv, sink,
                     deterministic, prefix_lengths, options, emit_target=True,
                     keys_ascending=keys_ascending)


def hopper_backward_module() -> tuple[ModuleType | None, str]:
    """(`sparse_mla_bwd_sm90`, "") or (None, why it cannot be loaded: `common.gluon_module`)."""
    return gluon_module("sparse_mla_bwd_sm90")


def _sm90_backward(q, k, v, indices, softmax_scale, out, lse, dout, dlse, dv, sink,
                   deterministic, prefix_lengths, options, emit_target, keys_ascending=False):
    """(dq, dk, None, dsink or None, the target or None) from the Hopper backward
    (options.bwd_sm90), or None where it does not run: silently for another shape or device,
    or a dense prefix without options.prefix_sm90;
    with one warning per cause where it is the shape's kernel on Hopper and still cannot run
    (no Gluon, deterministic=True, a layout its copies cannot take), or where this variant
    fails (it is not tried again: `sparse_mla_bwd_sm90.disable`)."""
    if not (options.bwd_sm90 and q.is_cuda):
        return None
    if prefix_lengths is not None and not options.prefix_sm90:
        return None
    bwd, import_error = hopper_backward_module()
    if bwd is None:
        if on_hopper(q):
            warn_once("sparse-mla-bwd-sm90: import", "HyScale: the Hopper sparse-MLA backward "
                      f"cannot be loaded ({import_error}); using the Triton backward",
                      stacklevel=5)
        return None
    geo = _Geometry(q, k, v, dv)
    if not bwd.applies(q, k, v, geo.dv, prefix_lengths):
        return None
    if deterministic:
        bwd.warn_cannot_run("deterministic=True (its dK additions are fp32 atomics; the Triton "
                            "backward's fixed point is bitwise repeatable)")
        return None
    problem = bwd.layout_problem(q, k, out, dout)
    if problem is not None:
        bwd.warn_cannot_run(*problem)
        return None
    acc = _DkvAccumulators(q, k, v, geo, lse, False, False)
    target = _TargetBuffer(q, k, indices, geo, sink, prefix_lengths) if emit_target else None
    try:
        dq, dsink_part = bwd.sparse_mla_bwd_sm90(
            q, k, indices, softmax_scale, out, lse, dout, acc.dk, dlse=dlse, sink=sink,
            target=(*target.args(), target.atomic) if target is not None else None,
            head_blocks_adjacent=options.head_blocks_adjacent, dk_vec4=options.bwd_dk_vec4,
            lockstep=options.bwd_lockstep, lockstep_slack=options.bwd_lockstep_slack,
            keys_ascending=keys_ascending, prefix_lengths=prefix_lengths)
    except torch.OutOfMemoryError:
        raise  # not the kernel's failure: the Triton backward would need the same memory
    except Exception as exc:  # this variant failed to compile or launch: say so, keep training
        bwd.disable(bwd.variant(q, prefix_lengths is not None), f"{type(exc).__name__}: {exc}")
        return None
    dk, _ = acc.result(k, v)
    dsink = dsink_part.sum(dim=(0, 1)).to(sink.dtype) if sink is not None else None
    return dq, dk, None, dsink, target.result() if target is not None else None


def _backward(q, k, v, indices, softmax_scale, out, lse, dout, dlse, dv, sink, deterministic,
              prefix_lengths, options, emit_target, keys_ascending=False):
    """(dq, dk, dv or None, dsink or None, the target or None)."""
    if emit_target:  # before any launch (the fused deterministic backward's first pass)
        _TargetBuffer.check(indices, sink, prefix_lengths)
    done = _sm90_backward(q, k, v, indices, softmax_scale, out, lse, dout, dlse, dv, sink,
                          deterministic, prefix_lengths, options, emit_target, keys_ascending)
    if done is not None:
        return done
    kw = dict(dlse=dlse, dv=dv, sink=sink, prefix_lengths=prefix_lengths, options=options)
    if not options.bwd_fused:
        dq, delta, dsink, *target = sparse_attention_bwd_dq(
            q, k, v, indices, softmax_scale, out, lse, dout, **kw, emit_target=emit_target)
        dk, dvv = sparse_attention_bwd_dkv(q, k, v, indices, softmax_scale, lse, dout, delta,
                                           dv=dv, deterministic=deterministic,
                                           prefix_lengths=prefix_lengths, options=options)
        return dq, dk, dvv, dsink, (target or [None])[0]
    geo = _Geometry(q, k, v, dv)
    acc = _DkvAccumulators(q, k, v, geo, lse, deterministic, False)
    if deterministic:
        # The target in the second pass only (an atomic one would be added twice).
        sparse_attention_bwd_dq(q, k, v, indices, softmax_scale, out, lse, dout, **kw, dkv=acc,
                                mode=MODE_ROWMAX)
        acc.set_scales(2 * q.shape[1] * geo.nhb)
        mode = MODE_FIXED
    else:
        mode = MODE_ATOMIC
    dq, _, dsink, *target = sparse_attention_bwd_dq(
        q, k, v, indices, softmax_scale, out, lse, dout, **kw, dkv=acc, mode=mode,
        emit_target=emit_target)
    dk, dvv = acc.result(k, v)
    return dq, dk, dvv, dsink, (target or [None])[0]


class SparseAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, indices, sink, prefix lengths, out and lse; backward runs
    two kernels (one fused) with the forward's options."""

    @staticmethod
    def forward(ctx, q, k, v, indices, sink, softmax_scale, dv, deterministic, prefix_lengths,
                options, hytopk_layout, keys_ascending):
        ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient
        out, lse = sparse_attention_fwd(q, k, v, indices, softmax_scale, dv=dv, sink=sink,
                                        prefix_lengths=prefix_lengths, options=options,
                                        hytopk_layout=hytopk_layout,
                                        keys_ascending=keys_ascending)
        ctx.save_for_backward(q, k, v, indices, sink, prefix_lengths, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.dv = dv
        ctx.deterministic = deterministic
        ctx.options = options
        ctx.keys_ascending = keys_ascending
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, indices, sink, prefix_lengths, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None:
            # The dQ kernel reads dlse with lse's strides; the gradient of lse.sum() is an
            # expanded (stride-0) tensor.
            dlse = dlse.contiguous()
        dq, dk, dvv, dsink = sparse_attention_bwd(
            q, k, v, indices, ctx.softmax_scale, out, lse, dout, dlse=dlse, dv=ctx.dv,
            sink=sink, deterministic=ctx.deterministic, prefix_lengths=prefix_lengths,
            options=ctx.options, keys_ascending=ctx.keys_ascending)
        return dq, dk, dvv, None, dsink, None, None, None, None, None, None, None


def pad_head_dim(q, k, v, dv):
    """(q, k, dv) with the head dim zero-padded to MIN_DOT where it is under it: the kernels
    read channels in tiles of at least MIN_DOT (tl.dot's smallest K); zero channels leave every
    q . k unchanged, and F.pad's backward slices the gradients. dv: V's width when V is K's
    first channels (v None), which padding must not widen."""
    if q.shape[-1] >= MIN_DOT:
        return q, k, dv
    if v is None:
        dv = q.shape[-1] if dv is None else dv
    pad = (0, MIN_DOT - q.shape[-1])
    return torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad), dv


def sparse_attention_triton(q, k, v, indices, softmax_scale, *, dv=None, sink=None,
                            return_lse=False, deterministic=False, prefix_lengths=None,
                            options: AttentionKernelOptions = AttentionKernelOptions.DEFAULT,
                            hytopk_layout: bool = False, keys_ascending: bool = False):
    """Sparse attention over selected indices on validated inputs (see the module docstring).

    Differentiable in q, k, v and sink. `deterministic=True` makes dK / dV bitwise repeatable
    (fixed-point accumulation, one extra pass of the dK/dV kernel). `prefix_lengths` int
    [B, T]: each row also attends to keys 0 .. n - 1 before its listed indices (generated in
    the kernels, never materialized; the loops run n + K slots a row). `options`: the kernels'
    variants and tilings, forward and backward (`fwd_flashmla`: FlashMLA's forward, this
    module's backward). `hytopk_layout`, `keys_ascending`: as `sparse_attention_fwd`'s.
    """
    q, k, dv = pad_head_dim(q, k, v, dv)
    out, lse = SparseAttentionFunction.apply(q, k, v, indices, sink, float(softmax_scale), dv,
                                             bool(deterministic), prefix_lengths, options,
                                             bool(hytopk_layout), bool(keys_ascending))
    return (out, lse) if return_lse else out

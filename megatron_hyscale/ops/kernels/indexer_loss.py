"""DSA indexer KL loss over the selected keys (sparse form): Triton forward and backward.

Shapes: q_index [B, T, H_I, D_I], weights [B, T, H_I], k_index [B, S, D_I] (bf16, fp16 or fp32;
with relu=False the caller folds the weights into an fp32 q, see `indexer_kl_loss_triton`);
query [B, T, Hq, Dqk], key [B, S, Hkv, Dqk] (detached); topk_indices int32/int64 [B, T, K], -1
padded; positions int64 [B, T] / [B, S]. Returns the fp32 scalar loss; the gradients reach
q_index, weights and k_index. No [T, S] tensor: all work is per query row over its K slots.

Algorithm, one program per query row, in four launches:
1. select: sort the row's (index, slot) keys, drop -1, invisible and repeated indices (a
   repeated index counts once, as megatron's scatter into a mask does); flags in p (0 / -1).
2. target: per block of query heads, pass 1 gets each head's softmax max and sum over the
   valid slots ([heads x Dqk] @ [Dqk x keys], Dqk = 512 + 64 for MLA), pass 2 recomputes the
   logits and adds sum_h softmax_h into p (unnormalized; all-reduced over tp ranks in torch).
   Given the main attention's log-sum-exp over the same slots (its forward computes it
   anyway), pass 1 is skipped: softmax_h = exp(logit - lse_h).
3. loss: pass 1 gets the index scores' log-sum-exp and the target's sum, pass 2 recomputes
   the scores, writes the L1-normalized target back into p and sums the row's KL terms.
Backward (one launch, scores recomputed): g = (softmax(s) * sum(p) - p) * grad * coeff / rows,
dq = (g w act') @ K_sel, dw = act(L) @ g, dk rows += (g w act')^T @ q with fp32 atomics (or the
sparse-attention kernel's order-free fixed-point mode when deterministic).

Saved for backward: p (fp32 [B, T, K], the normalized target; < 0 at invalid slots) and two
fp32 [B, T] row statistics, besides the inputs. A caller that has the loss's gradient when its
rows run (the attention backward emitting the target) may run 3 and the backward as one kernel
(`indexer_loss_rows_bwd`, IndexerLossKernelOptions.fused_rows_bwd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.checks import triton_interpret
from megatron_hyscale.ops.kernels.common import (
    INDEXER_LOSS_EPS,
    LN2_JIT,
    LOG2E,
    LOG2E_JIT,
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
    indexer_grad_buffers,
    lockstep_plan,
    lockstep_step,
    on_hopper,
)
from megatron_hyscale.ops.kernels.key_split import auto_key_passes
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions, Tilings
from megatron_hyscale.ops.kernels.tiling import launch_first_fitting

fix_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1
EPS = INDEXER_LOSS_EPS  # the loss modules' name for it (indexer_loss_dense imports it)
_EPS = tl.constexpr(EPS)
# p holds this at slots that take no part in the loss (-1, invisible, or a repeated index);
# valid slots hold a target value >= 0, so the sign alone is the validity (also after a tp
# all-reduce, which sums the sentinels to -tp).
INVALID = -1.0
_INVALID = tl.constexpr(INVALID)
# `selected_scores_lse`'s and `normalize_target`'s programs (one a row, no gather): the row's
# slots in tiles of up to this many (one tile at top-2048: normalize_target's second sum reads
# the row's 8 KiB from L1 / L2), 4 warps.
ROW_MAX_TILE = 2048
ROW_WARPS = 4



# --------------------------------------------------------------------------- jit bodies


@triton.jit
def _dup_combine(last_l, flag_l, last_r, flag_r):
    """Scan over sorted indices: flag = 1 where an element equals its predecessor.

    A segment is (its last index, flag of its last element); flag -1 marks a one-element
    segment whose predecessor is not known yet, resolved against the left segment's last.
    """
    flag = tl.where(flag_r >= 0, flag_r, (last_r == last_l).to(tl.int32))
    return last_r, flag


@triton.jit
def _select_kernel(
    idx_ptr, qpos_ptr, kpos_ptr, p_ptr, rv_ptr, T, S, NK,
    sib, sit, sik, sqpb, sqpt, skpb, skps, spb, spt, spk, srvb, srvt,
    KP: tl.constexpr, HAS_ROW_MASK: tl.constexpr,
):
    """p[b, t, slot] = 0 where the slot's key is selected, visible and first of its value; else -1.

    Sorting (index * KP + slot) puts repeats of an index next to each other, smallest slot first.
    HAS_ROW_MASK: a row whose rv (bool [B, T]) is False gets no valid slot, so the later
    kernels give it zero KL and zero gradient.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    slots = tl.arange(0, KP)
    idx = tl.load(idx_ptr + b * sib + t * sit + slots * sik, mask=slots < NK, other=-1)
    idx = idx.to(tl.int64)
    sel = idx >= 0
    if HAS_ROW_MASK:
        sel = sel & (tl.load(rv_ptr + b * srvb + t * srvt) != 0)
    kp = tl.load(kpos_ptr + b * skpb + tl.where(sel, idx, 0) * skps, mask=sel, other=0)
    qp = tl.load(qpos_ptr + b * sqpb + t * sqpt)
    visible = sel & (kp <= qp)
    keys = tl.sort(tl.where(visible, idx, S) * KP + slots)
    key_idx = keys // KP
    slot = keys % KP
    _, repeat = tl.associative_scan((key_idx, tl.full([KP], -1, tl.int32)), 0, _dup_combine)
    keep = (key_idx < S) & (repeat != 1)
    tl.store(p_ptr + b * spb + t * spt + slot * spk, tl.where(keep, 0.0, _INVALID),
             mask=slot < NK)


@triton.jit
def _load_slots(idx_base, sik, p_base, spk, n0, NK, BLOCK_N: tl.constexpr):
    """Slots n0 .. n0 + BLOCK_N: key rows (0 where invalid), validity, p values and p pointers."""
    offs = n0 + tl.arange(0, BLOCK_N)
    inside = offs < NK
    idx = tl.load(idx_base + offs * sik, mask=inside, other=0).to(tl.int64)
    p_ptrs = p_base + offs * spk
    p = tl.load(p_ptrs, mask=inside, other=_INVALID)
    valid = p >= 0.0
    return tl.where(valid, idx, 0), valid, p, p_ptrs


@triton.jit
def _attn_logits(q_main, q_tail, k_base, sks, skd, rows, valid, offs_dm, offs_dt, D,
                 qk_scale2, D_TAIL: tl.constexpr, PRECISION: tl.constexpr):
    """Base-2 attention logits [heads x keys] of gathered key rows; -inf at invalid slots."""
    k_main = tl.load(k_base + rows[:, None] * sks + offs_dm[None, :] * skd,
                     mask=valid[:, None] & (offs_dm[None, :] < D), other=0.0)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
    if D_TAIL > 0:
        k_tail = tl.load(k_base + rows[:, None] * sks + offs_dt[None, :] * skd,
                         mask=valid[:, None] & (offs_dt[None, :] < D), other=0.0)
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
    return tl.where(valid[None, :], s * qk_scale2, float("-inf"))


@triton.jit
def _target_kernel(
    q_ptr, k_ptr, idx_ptr, p_ptr, lse_ptr,
    T, NK, G, NHB, NGRP, D, qk_scale2,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, sib, sit, sik, spb, spt, spk, slb, slt, slh,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, HAS_LSE: tl.constexpr,
):
    """p[b, t, j] += sum_h softmax_j(scale * query[t, h] . key[idx_j, h // G]) at valid slots j.

    The NGRP = Hkv * NHB head blocks run in turn in this program, so the head sum needs no
    atomics. A head whose row has no valid slot adds 0 (megatron's eps-clamped denominator).
    HAS_LSE: lse [B, T, Hq] (natural log, -inf for an empty row) replaces pass 1.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    offs_dm = tl.arange(0, D_MAIN)
    if D_TAIL > 0:
        offs_dt = D_MAIN + tl.arange(0, D_TAIL)
    else:
        offs_dt = offs_dm  # unused
    idx_base = idx_ptr + b * sib + t * sit
    p_base = p_ptr + b * spb + t * spt
    for grp in range(0, NGRP):
        kvh = grp // NHB
        offs_h = (grp % NHB) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = offs_h < G
        q_rows = q_ptr + b * sqb + t * sqt + (kvh * G + offs_h)[:, None] * sqh
        q_main = tl.load(q_rows + offs_dm[None, :] * sqd,
                         mask=h_mask[:, None] & (offs_dm[None, :] < D), other=0.0)
        if D_TAIL > 0:
            q_tail = tl.load(q_rows + offs_dt[None, :] * sqd,
                             mask=h_mask[:, None] & (offs_dt[None, :] < D), other=0.0)
        else:
            q_tail = q_main  # unused
        k_base = k_ptr + b * skb + kvh * skh

        if HAS_LSE:
            lse = tl.load(lse_ptr + b * slb + t * slt + (kvh * G + offs_h) * slh, mask=h_mask,
                          other=float("-inf")) * LOG2E_JIT
            m_use = tl.where(lse == float("-inf"), 0.0, lse)
            inv_l = tl.where(h_mask & (lse > float("-inf")), 1.0, 0.0)
        else:
            # Pass 1: each head's running max and sum over the valid slots (base 2).
            m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_H], tl.float32)
            for n0 in range(0, NK, BLOCK_N):
                rows, valid, _, _ = _load_slots(idx_base, sik, p_base, spk, n0, NK, BLOCK_N)
                s = _attn_logits(q_main, q_tail, k_base, sks, skd, rows, valid, offs_dm,
                                 offs_dt, D, qk_scale2, D_TAIL, PRECISION)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                # No valid slot yet: m stays -inf; shift by 0 there so no inf - inf.
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), axis=1)
                m_i = m_new
            m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
            # Padded heads (their q is 0, so they would spread 1 / n) and empty rows add
            # nothing.
            inv_l = tl.where(h_mask & (l_i > 0.0), 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)

        # Pass 2: recompute the logits; add the head sum of the probabilities into p.
        for n0 in range(0, NK, BLOCK_N):
            rows, valid, p_old, p_ptrs = _load_slots(idx_base, sik, p_base, spk, n0, NK,
                                                     BLOCK_N)
            s = _attn_logits(q_main, q_tail, k_base, sks, skd, rows, valid, offs_dm, offs_dt, D,
                             qk_scale2, D_TAIL, PRECISION)
            add = tl.sum(tl.exp2(s - m_use[:, None]) * inv_l[:, None], axis=0)
            tl.store(p_ptrs, p_old + add, mask=valid)
        # The next head block reads back p, possibly in other threads than wrote it.
        tl.debug_barrier()


@triton.jit
def index_scores(q, w, k_base, sks, skd, rows, valid, offs_d, D, RELU: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Gathered k_index tile [keys x D], head logits L [heads x keys], act(L), scores [keys]."""
    kt = tl.load(k_base + rows[:, None] * sks + offs_d[None, :] * skd,
                 mask=valid[:, None] & (offs_d[None, :] < D), other=0.0).to(q.dtype)
    logits = tl.dot(q, tl.trans(kt), input_precision=PRECISION)
    if RELU:
        act = tl.maximum(logits, 0.0)
    else:
        act = logits
    return kt, logits, act, tl.sum(act * w[:, None], axis=0)


@triton.jit
def load_index_query(qi_ptr, w_ptr, b, t, H, D, sqb, sqt, sqh, sqd, swb, swt, swh,
                      BLOCK_H: tl.constexpr, D_PAD: tl.constexpr):
    """The row's indexer query [heads x D] (zero padded) and fp32 head weights [heads]."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    q = tl.load(qi_ptr + b * sqb + t * sqt + offs_h[:, None] * sqh + offs_d[None, :] * sqd,
                mask=(offs_h[:, None] < H) & (offs_d[None, :] < D), other=0.0)
    w = tl.load(w_ptr + b * swb + t * swt + offs_h * swh, mask=offs_h < H, other=0.0)
    return q, w.to(tl.float32), offs_h, offs_d


@triton.jit
def lse_step(m_i, l_i, s, valid):
    """One key tile of a running log-sum-exp of the scores s where valid (base 2 inside): the
    new max, the shift this tile used (0 while no score was valid) and the new sum."""
    s2 = tl.where(valid, s * LOG2E_JIT, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s2, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_use, l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s2 - m_use), axis=0)


@triton.jit
def lse_of(m_i, l_i):
    """The natural log-sum-exp of a finished lse_step run (0 for a run with no valid score)."""
    nonempty = l_i > 0.0
    return tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * LN2_JIT, 0.0)


@triton.jit
def _row_stats(q, w, k_base, sks, skd, idx_base, sik, p_base, spk, offs_d, NK, D,
               RELU: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Pass 1 of a row: the index scores' log-sum-exp (natural; 0 for an empty row) and the
    target's clamped sum (the normalization's denominator)."""
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    total = tl.zeros([], tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        rows, valid, p, _ = _load_slots(idx_base, sik, p_base, spk, n0, NK, BLOCK_N)
        _, _, _, s = index_scores(q, w, k_base, sks, skd, rows, valid, offs_d, D, RELU,
                                   PRECISION)
        m_i, _, l_i = lse_step(m_i, l_i, s, valid)
        total += tl.sum(tl.where(valid, p, 0.0), axis=0)
    return lse_of(m_i, l_i), tl.maximum(total, _EPS)


@triton.jit
def _target_sum(p_base, spk, NK, BLOCK_N: tl.constexpr):
    """The target's clamped sum over the row's valid slots (p alone, no gather), summed tile
    by tile as `_row_stats` sums it."""
    total = tl.zeros([], tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        p = tl.load(p_base + offs * spk, mask=offs < NK, other=_INVALID)
        total += tl.sum(tl.where(p >= 0.0, p, 0.0), axis=0)
    return tl.maximum(total, _EPS)


@triton.jit
def _kl_terms(pn, s, lse, valid):
    """A tile's KL terms summed: pn * (log max(pn, eps) - (s - lse)) over its valid slots."""
    term = pn * (tl.log(tl.maximum(pn, _EPS)) - (s - lse))
    return tl.sum(tl.where(valid, term, 0.0), axis=0)


@triton.jit
def _normalize_target(p_base, spk, NK, den, BLOCK_N: tl.constexpr, STORE: tl.constexpr):
    """sum of pn = p / den over the row's valid slots (p alone, no gather), tile by tile as the
    loss's second pass sums it; STORE: pn written over p."""
    psum = tl.zeros([], tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        p_ptrs = p_base + offs * spk
        p = tl.load(p_ptrs, mask=offs < NK, other=_INVALID)
        pn = tl.where(p >= 0.0, p / den, 0.0)
        psum += tl.sum(pn, axis=0)
        if STORE:
            tl.store(p_ptrs, pn, mask=p >= 0.0)
    return psum


@triton.jit
def _scores_lse_kernel(s_ptr, lse_ptr, T, NK, ssb, sst, ssk, srb, srt, BLOCK_N: tl.constexpr):
    """Row (b, t)'s natural log-sum-exp of its selected scores (-inf at unused slots; 0 for a
    row without one), one read of the row, `_row_stats`' running form over BLOCK_N tiles."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    s_base = s_ptr + b * ssb + t * sst
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        s = tl.load(s_base + offs * ssk, mask=offs < NK, other=float("-inf")).to(tl.float32)
        m_i, _, l_i = lse_step(m_i, l_i, s, s > float("-inf"))
    tl.store(lse_ptr + b * srb + t * srt, lse_of(m_i, l_i))


@triton.jit
def _normalize_target_kernel(p_ptr, psum_ptr, T, NK, spb, spt, spk, srb, srt,
                             BLOCK_N: tl.constexpr):
    """The loss row pass without its gathered pass (KL=False, the index scores' log-sum-exp
    given): row (b, t)'s target L1-normalized in place over its valid slots, and the sum of
    the normalized values; `_loss_kernel`'s tile sums at the same BLOCK_N."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    p_base = p_ptr + b * spb + t * spt
    den = _target_sum(p_base, spk, NK, BLOCK_N)
    psum = _normalize_target(p_base, spk, NK, den, BLOCK_N, True)
    tl.store(psum_ptr + b * srb + t * srt, psum)


@triton.jit
def _loss_kernel(
    qi_ptr, w_ptr, ki_ptr, idx_ptr, p_ptr, kl_ptr, lse_ptr, psum_ptr,
    T, NK, H, D,
    sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, sib, sit, sik, spb, spt, spk, srb, srt,
    RELU: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, ONE_PASS: tl.constexpr = False, KL: tl.constexpr = True,
):
    """Row KL(p / sum p || softmax(s)) over the valid slots; p normalized in place.

    s_j = sum_h w_h act(q_h . k_index[idx_j]). Pass 1: log-sum-exp of s and sum of p; pass 2:
    recompute s (cheaper than keeping it) and sum pn * (log max(pn, eps) - (s - lse)).
    Writes the row's KL, lse (0 for an empty row) and sum of the normalized target.
    ONE_PASS: sum p first (no gather), then one gathered pass with an online log-sum-exp;
    KL = sum pn log pn - sum pn (s - c) + (lse - c) sum pn, c the first valid tile's max.
    KL=False (the backward kernel sums the KL terms: IndexerLossKernelOptions.kl_in_bwd): pass
    1, then p normalized without a gather; no KL written.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    q, w, offs_h, offs_d = load_index_query(qi_ptr, w_ptr, b, t, H, D, sqb, sqt, sqh, sqd,
                                             swb, swt, swh, BLOCK_H, D_PAD)
    k_base = ki_ptr + b * skb
    idx_base = idx_ptr + b * sib + t * sit
    p_base = p_ptr + b * spb + t * spt

    kl = tl.zeros([], tl.float32)
    psum = tl.zeros([], tl.float32)
    if ONE_PASS:
        den = _target_sum(p_base, spk, NK, BLOCK_N)
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.zeros([], tl.float32)
        # Reference shift c (natural log): keeps sum pn s and lse sum pn from cancelling at
        # large scores; the first tile with a valid slot sets it (no pn > 0 before it).
        c = tl.zeros([], tl.float32)
        plogp = tl.zeros([], tl.float32)
        ps = tl.zeros([], tl.float32)
        for n0 in range(0, NK, BLOCK_N):
            rows, valid, p, p_ptrs = _load_slots(idx_base, sik, p_base, spk, n0, NK, BLOCK_N)
            _, _, _, s = index_scores(q, w, k_base, sks, skd, rows, valid, offs_d, D, RELU,
                                       PRECISION)
            m_new, m_use, l_i = lse_step(m_i, l_i, s, valid)
            c = tl.where(m_i == float("-inf"), m_use * LN2_JIT, c)
            m_i = m_new
            pn = tl.where(valid, p / den, 0.0)
            plogp += tl.sum(tl.where(valid, pn * tl.log(tl.maximum(pn, _EPS)), 0.0), axis=0)
            ps += tl.sum(tl.where(valid, pn * (s - c), 0.0), axis=0)
            psum += tl.sum(pn, axis=0)
            tl.store(p_ptrs, pn, mask=valid)
        lse = lse_of(m_i, l_i)
        kl = plogp - ps + tl.where(l_i > 0.0, lse - c, 0.0) * psum
    elif KL:
        lse, den = _row_stats(q, w, k_base, sks, skd, idx_base, sik, p_base, spk, offs_d, NK,
                              D, RELU, BLOCK_N, PRECISION)
        for n0 in range(0, NK, BLOCK_N):
            rows, valid, p, p_ptrs = _load_slots(idx_base, sik, p_base, spk, n0, NK, BLOCK_N)
            _, _, _, s = index_scores(q, w, k_base, sks, skd, rows, valid, offs_d, D, RELU,
                                       PRECISION)
            pn = tl.where(valid, p / den, 0.0)
            kl += _kl_terms(pn, s, lse, valid)
            psum += tl.sum(pn, axis=0)
            tl.store(p_ptrs, pn, mask=valid)
    else:
        lse, den = _row_stats(q, w, k_base, sks, skd, idx_base, sik, p_base, spk, offs_d, NK,
                              D, RELU, BLOCK_N, PRECISION)
        psum = _normalize_target(p_base, spk, NK, den, BLOCK_N, True)
    row = b * srb + t * srt
    if KL:
        tl.store(kl_ptr + row, kl)
    tl.store(lse_ptr + row, lse)
    tl.store(psum_ptr + row, psum)


@triton.jit
def _grad_step(q, w, dq, dw, rows, valid, pn, lse, psum, g_scale, k_base, sks, skd, offs_d, D,
               dk_base, sdks, sdkd, d_mask, rm_base, fx_base, srms,
               RELU: tl.constexpr, PRECISION: tl.constexpr, MODE: tl.constexpr,
               KL: tl.constexpr = False):
    """One key tile of the backward: dq and dw accumulated, dk rows added by MODE; with KL
    also the tile's KL terms from its recomputed scores (else 0), taken before the products
    so that the scores are not held across them (V3.2's kernel spilled more otherwise)."""
    kt, logits, act, s = index_scores(q, w, k_base, sks, skd, rows, valid, offs_d, D, RELU,
                                       PRECISION)
    kl_tile = _kl_terms(pn, s, lse, valid) if KL else 0.0
    # -inf at invalid slots: their s is from a zeroed key row and exp(s - lse) could overflow.
    prob = tl.exp(tl.where(valid, s - lse, float("-inf")))
    g = tl.where(valid, (prob * psum - pn) * g_scale, 0.0)
    dw += tl.sum(act * g[None, :], axis=1)
    g_l = w[:, None] * g[None, :]
    if RELU:
        g_l = tl.where(logits > 0.0, g_l, 0.0)  # ReLU'(0) = 0, as torch's
    dq += tl.dot(g_l.to(kt.dtype), kt, input_precision=PRECISION)
    dk_t = tl.dot(tl.trans(g_l).to(q.dtype), q, input_precision=PRECISION)
    accumulate(dk_base + rows[:, None] * sdks + offs_d[None, :] * sdkd, dk_t, rows, valid,
               d_mask, rm_base, fx_base, srms, MODE)
    return dq, dw, kl_tile


@triton.jit
def _bwd_row(
    pid, qi_ptr, w_ptr, ki_ptr, idx_ptr, p_ptr, lse_ptr, psum_ptr, grad_ptr, coeff,
    dq_ptr, dw_ptr, dk_ptr, rowmax_ptr, scale_ptr, kl_ptr, wave_ptr, active,
    T, NK, H, D,
    sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, sib, sit, sik, spb, spt, spk, srb, srt,
    sdqb, sdqt, sdqh, sdqd, sdwb, sdwt, sdwh, sdkb, sdks, sdkd, srmb, srms,
    RELU: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, MODE: tl.constexpr, KL: tl.constexpr, LOCKSTEP: tl.constexpr,
    SYNC_SLACK: tl.constexpr, SYNC_SPINS: tl.constexpr, SYNC_PTX: tl.constexpr,
):
    """`_bwd_kernel`'s work for row pid (b * T + t). LOCKSTEP: before each key tile i, count
    this program's start in its wave's counter (wave_ptr) and wait until the `active` programs
    of the wave have together made the starts of all of them at tile i - SYNC_SLACK
    (`common.lockstep_step`)."""
    b = pid // T
    t = pid % T
    q, w, offs_h, offs_d = load_index_query(qi_ptr, w_ptr, b, t, H, D, sqb, sqt, sqh, sqd,
                                             swb, swt, swh, BLOCK_H, D_PAD)
    row = b * srb + t * srt
    lse = tl.load(lse_ptr + row)
    psum = tl.load(psum_ptr + row)
    g_scale = tl.load(grad_ptr).to(tl.float32) * coeff
    k_base = ki_ptr + b * skb
    idx_base = idx_ptr + b * sib + t * sit
    p_base = p_ptr + b * spb + t * spt
    dk_base = dk_ptr + b * sdkb
    rm_base = rowmax_ptr + b * srmb
    fx_base = scale_ptr + b * srmb
    d_mask = offs_d[None, :] < D

    dq = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    kl = tl.zeros([], tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        if LOCKSTEP:
            lockstep_step(wave_ptr, active * (n0 // BLOCK_N - SYNC_SLACK + 1), SYNC_SPINS,
                          SYNC_PTX)
        rows, valid, pn, _ = _load_slots(idx_base, sik, p_base, spk, n0, NK, BLOCK_N)
        dq, dw, kl_tile = _grad_step(q, w, dq, dw, rows, valid, pn, lse, psum, g_scale, k_base,
                                     sks, skd, offs_d, D, dk_base, sdks, sdkd, d_mask, rm_base,
                                     fx_base, srms, RELU, PRECISION, MODE, KL)
        kl += kl_tile
    if MODE != 1:  # the row-max pass of the deterministic mode writes only its maxima
        _store_row_grads(dq_ptr, dw_ptr, dq, dw, b, t, offs_h, offs_d, H, d_mask, sdqb, sdqt,
                         sdqh, sdqd, sdwb, sdwt, sdwh)
        if KL:
            tl.store(kl_ptr + row, kl)


@triton.jit
def _bwd_kernel(
    qi_ptr, w_ptr, ki_ptr, idx_ptr, p_ptr, lse_ptr, psum_ptr, grad_ptr, coeff,
    dq_ptr, dw_ptr, dk_ptr, rowmax_ptr, scale_ptr, kl_ptr, sync_ptr, programs, work,
    T, NK, H, D,
    sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, sib, sit, sik, spb, spt, spk, srb, srt,
    sdqb, sdqt, sdqh, sdqd, sdwb, sdwt, sdwh, sdkb, sdks, sdkd, srmb, srms,
    RELU: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, MODE: tl.constexpr, KL: tl.constexpr = False,
    LOCKSTEP: tl.constexpr = False, SYNC_SLACK: tl.constexpr = 1,
    SYNC_SPINS: tl.constexpr = 64, SYNC_PTX: tl.constexpr = True,
):
    """dq_index, dweights of one row (owned, no atomics) and its dk_index contributions.

    d loss / d s_j = g_j = (softmax(s)_j * sum(pn) - pn_j) * grad * coeff at valid slots;
    dw_h = sum_j g_j act(L_hj); with G_hj = g_j w_h act'(L_hj): dq = G @ K_sel, and the
    [keys x D] tile G^T @ q goes into dk's selected rows by MODE (fp32 atomics or fixed point).
    KL: also the row's KL from the recomputed scores into kl (the loss kernel's second-pass
    terms; IndexerLossKernelOptions.kl_in_bwd), in the pass that writes the gradients.
    LOCKSTEP: `programs` persistent programs take rows p, p + programs, ... of the `work`
    rows, the programs of a wave (one counter each in sync) kept within SYNC_SLACK key tiles
    of each other (IndexerLossKernelOptions.bwd_lockstep); else one program a row.
    """
    if LOCKSTEP:
        for item in range(tl.program_id(0), work, programs):
            wave = item // programs
            _bwd_row(item + tl.zeros([], tl.int64), qi_ptr, w_ptr, ki_ptr, idx_ptr, p_ptr, lse_ptr,
                     psum_ptr, grad_ptr, coeff, dq_ptr, dw_ptr, dk_ptr, rowmax_ptr, scale_ptr,
                     kl_ptr, sync_ptr + wave, tl.minimum(programs, work - wave * programs),
                     T, NK, H, D, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, sib, sit,
                     sik, spb, spt, spk, srb, srt, sdqb, sdqt, sdqh, sdqd, sdwb, sdwt, sdwh,
                     sdkb, sdks, sdkd, srmb, srms, RELU, BLOCK_H, D_PAD, BLOCK_N, PRECISION,
                     MODE, KL, True, SYNC_SLACK, SYNC_SPINS, SYNC_PTX)
    else:
        _bwd_row(tl.program_id(0).to(tl.int64), qi_ptr, w_ptr, ki_ptr, idx_ptr, p_ptr,
                 lse_ptr, psum_ptr, grad_ptr, coeff, dq_ptr, dw_ptr, dk_ptr, rowmax_ptr,
                 scale_ptr, kl_ptr, sync_ptr, 0, T, NK, H, D, sqb, sqt, sqh, sqd, swb, swt,
                 swh, skb, sks, skd, sib, sit, sik, spb, spt, spk, srb, srt, sdqb, sdqt, sdqh,
                 sdqd, sdwb, sdwt, sdwh, sdkb, sdks, sdkd, srmb, srms, RELU, BLOCK_H, D_PAD,
                 BLOCK_N, PRECISION, MODE, KL, False, SYNC_SLACK, SYNC_SPINS, SYNC_PTX)


@triton.jit
def _store_row_grads(dq_ptr, dw_ptr, dq, dw, b, t, offs_h, offs_d, H, d_mask, sdqb, sdqt, sdqh,
                     sdqd, sdwb, sdwt, sdwh):
    h_mask = offs_h < H
    tl.store(dq_ptr + b * sdqb + t * sdqt + offs_h[:, None] * sdqh + offs_d[None, :] * sdqd,
             dq.to(dq_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask)
    tl.store(dw_ptr + b * sdwb + t * sdwt + offs_h * sdwh, dw.to(dw_ptr.dtype.element_ty),
             mask=h_mask)


@triton.jit
def _rows_bwd_kernel(
    qi_ptr, w_ptr, ki_ptr, idx_ptr, p_ptr, kl_ptr, lse_ptr, psum_ptr, grad_ptr, coeff,
    dq_ptr, dw_ptr, dk_ptr, rowmax_ptr, scale_ptr,
    T, NK, H, D,
    sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, sib, sit, sik, spb, spt, spk, srb, srt,
    sdqb, sdqt, sdqh, sdqd, sdwb, sdwt, sdwh, sdkb, sdks, sdkd, srmb, srms,
    RELU: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, MODE: tl.constexpr,
):
    """`_loss_kernel` and `_bwd_kernel` of one row in one program, when the gradient is known.

    Pass 1 (`_row_stats`): lse and the target's sum; a p-only pass: sum of pn; pass 2: the
    backward's tile step, whose recomputed scores also give the KL terms (the loss kernel's
    second pass). Writes what both kernels write (kl, lse, psum, pn in p, the gradients).
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    q, w, offs_h, offs_d = load_index_query(qi_ptr, w_ptr, b, t, H, D, sqb, sqt, sqh, sqd,
                                             swb, swt, swh, BLOCK_H, D_PAD)
    k_base = ki_ptr + b * skb
    idx_base = idx_ptr + b * sib + t * sit
    p_base = p_ptr + b * spb + t * spt
    lse, den = _row_stats(q, w, k_base, sks, skd, idx_base, sik, p_base, spk, offs_d, NK, D,
                          RELU, BLOCK_N, PRECISION)
    # The gradient needs sum(pn) before its first tile: the sum the loss kernel takes in its
    # second pass, in the same tile order.
    psum = _normalize_target(p_base, spk, NK, den, BLOCK_N, False)

    g_scale = tl.load(grad_ptr).to(tl.float32) * coeff
    dk_base = dk_ptr + b * sdkb
    rm_base = rowmax_ptr + b * srmb
    fx_base = scale_ptr + b * srmb
    d_mask = offs_d[None, :] < D
    dq = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    kl = tl.zeros([], tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        rows, valid, p, p_ptrs = _load_slots(idx_base, sik, p_base, spk, n0, NK, BLOCK_N)
        pn = tl.where(valid, p / den, 0.0)
        dq, dw, kl_tile = _grad_step(q, w, dq, dw, rows, valid, pn, lse, psum, g_scale, k_base,
                                     sks, skd, offs_d, D, dk_base, sdks, sdkd, d_mask, rm_base,
                                     fx_base, srms, RELU, PRECISION, MODE, True)
        kl += kl_tile
        tl.store(p_ptrs, pn, mask=valid)
    row = b * srb + t * srt
    tl.store(kl_ptr + row, kl)
    tl.store(lse_ptr + row, lse)
    tl.store(psum_ptr + row, psum)
    if MODE != 1:
        _store_row_grads(dq_ptr, dw_ptr, dq, dw, b, t, offs_h, offs_d, H, d_mask, sdqb, sdqt,
                         sdqh, sdqd, sdwb, sdwt, sdwh)


# --------------------------------------------------------------------------- launch wrappers


_tiling_cache: dict[tuple, tuple[int, int]] = {}


def _launch(kernel, grid, args, const, tilings: Tilings, num_warps, key,
            options: IndexerLossKernelOptions):
    """Launch with the first of `tilings` that fits (or at options.block_n, one stage);
    remember it per (key, tilings)."""
    if options.block_n is not None:
        kernel[grid](*args, **const, BLOCK_N=options.block_n, num_warps=num_warps,
                     num_stages=1)
        return
    launch_first_fitting(kernel, grid, args, const, tilings, num_warps, _tiling_cache,
                         key + (tilings,), "indexer-loss")


def _index_geometry(q_index, num_warps=None):
    """The loss and backward kernels' constexprs and warps (num_warps: the options' override
    or None)."""
    H, D = q_index.shape[2], q_index.shape[3]
    block_h = max(MIN_DOT, triton.next_power_of_2(H))
    d_pad = max(MIN_DOT, triton.next_power_of_2(D))
    if num_warps is None:
        num_warps = 8 if block_h * d_pad >= WIDE_TILE else 4  # 8 once the resident tile is large
    return dict(BLOCK_H=block_h, D_PAD=d_pad, PRECISION=dot_precision(q_index.dtype)), num_warps


def _bwd_launch(q_index, options: IndexerLossKernelOptions):
    """The backward kernels' constexprs (with Triton's `maxnreg` launch option when set) and
    warps: the options' bwd_num_warps / bwd_maxnreg, else the narrow setting for at most
    narrow_max_heads index heads, else `_index_geometry`'s."""
    narrow = q_index.shape[2] <= options.narrow_max_heads
    warps = options.bwd_num_warps
    maxnreg = options.bwd_maxnreg
    if warps is None and narrow:
        warps = options.narrow_bwd_warps
        maxnreg = options.narrow_bwd_maxnreg if maxnreg is None else maxnreg
    const, num_warps = _index_geometry(q_index, warps)
    if maxnreg is not None:  # a launch option, passed with the constexprs
        const["maxnreg"] = maxnreg
    return const, num_warps


def _target_geometry(query, key, max_block_h):
    Hq, D = query.shape[2], query.shape[3]
    G = Hq // key.shape[2]
    block_h = min(max_block_h, max(MIN_DOT, triton.next_power_of_2(G)))
    d_main, d_tail = channel_split(D)
    num_warps = 8 if block_h * d_main >= WIDE_TILE else 4
    const = dict(D_MAIN=d_main, D_TAIL=d_tail, BLOCK_H=block_h,
                 PRECISION=dot_precision(query.dtype))
    return G, triton.cdiv(G, block_h), const, num_warps


def attention_target(query, key, indices, q_positions, k_positions, softmax_scale,
                     attention_lse=None,
                     options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT,
                     query_valid_rows=None):
    """fp32 [B, T, K]: head-summed main-attention probabilities at the valid slots, -1 elsewhere.

    Not yet normalized (a tp all-reduce may add other ranks' heads first). attention_lse: fp32
    [B, T, Hq], the attention's log-sum-exp over exactly the valid slots (one pass, not two).
    query_valid_rows: bool [B, T] or None; the rows outside it have no valid slot.
    """
    B, T = query.shape[:2]
    S, Hkv = key.shape[1], key.shape[2]
    NK = indices.shape[-1]
    p = torch.empty((B, T, NK), device=query.device, dtype=torch.float32)
    grid = (B * T,)
    has_mask = query_valid_rows is not None
    # Read as bytes (a bool pointer's loads differ between Triton's backends).
    rv = query_valid_rows.view(torch.uint8) if has_mask else p
    _select_kernel[grid](
        indices, q_positions, k_positions, p, rv, T, S, NK, *indices.stride(),
        *q_positions.stride(), *k_positions.stride(), *p.stride(),
        *(rv.stride() if has_mask else (0, 0)),
        KP=max(MIN_DOT, triton.next_power_of_2(NK)), HAS_ROW_MASK=has_mask, num_warps=4,
    )
    G, nhb, const, num_warps = _target_geometry(query, key, options.max_block_h)
    has_lse = attention_lse is not None
    lse = attention_lse if has_lse else p
    args = (query, key, indices, p, lse, T, NK, G, nhb, Hkv * nhb, query.shape[3],
            softmax_scale * LOG2E, *query.stride(), *key.stride(), *indices.stride(),
            *p.stride(), *(lse.stride() if has_lse else (0, 0, 0)))
    const = dict(const, HAS_LSE=has_lse)
    _launch(_target_kernel, grid, args, const, options.target_tilings, num_warps,
            ("target", query.dtype, tuple(sorted(const.items()))), options)
    return p


def indexer_loss_rows(q_index, weights, k_index, indices, p, relu,
                      options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT,
                      with_kl: bool = True):
    """Per-row KL fp32 [B, T] from the head-summed target p (normalized in place), plus the
    rows' index-score log-sum-exp and normalized-target sum (fp32 [B, T] each) for backward.
    with_kl=False: no KL (None in its place; `indexer_loss_bwd(..., with_kl=True)` returns it)
    and one gathered pass fewer."""
    B, T, H, D = q_index.shape
    NK = indices.shape[-1]
    kl, lse, psum = (torch.empty((B, T), device=q_index.device, dtype=torch.float32)
                     for _ in range(3))
    const, num_warps = _index_geometry(q_index, options.loss_num_warps)
    const.update(RELU=relu, ONE_PASS=options.loss_one_pass and with_kl)
    if not with_kl:  # absent otherwise: the default launch's constexprs as before
        const["KL"] = False
    args = (q_index, weights, k_index, indices, p, kl, lse, psum, T, NK, H, D,
            *q_index.stride(), *weights.stride(), *k_index.stride(), *indices.stride(),
            *p.stride(), *kl.stride())
    _launch(_loss_kernel, (B * T,), args, const, options.index_tilings, num_warps,
            ("loss", q_index.dtype, k_index.dtype, tuple(sorted(const.items()))), options)
    return (kl if with_kl else None), lse, psum


def _per_row(kernel, x: torch.Tensor, block_n: int | None) -> torch.Tensor:
    """Launch `kernel(x, out, T, NK, x's strides, out's strides)` one program a row of x
    (fp32 [B, T, NK]) in tiles of block_n slots (None: the row in one tile, up to
    ROW_MAX_TILE); out fp32 [B, T]."""
    B, T, NK = x.shape
    out = torch.empty((B, T), device=x.device, dtype=torch.float32)
    if B * T:
        kernel[(B * T,)](x, out, T, NK, *x.stride(), *out.stride(),
                         BLOCK_N=block_n or min(triton.next_power_of_2(NK), ROW_MAX_TILE),
                         num_warps=ROW_WARPS)
    return out


def selected_scores_lse(scores: torch.Tensor, block_n: int | None = None) -> torch.Tensor:
    """Each row's natural log-sum-exp of its selected scores (fp32 [B, T, K], -inf at unused
    slots): fp32 [B, T], 0 for a row without a selected key; one read of the scores, no
    temporary (torch.logsumexp makes a second [B, T, K] tensor and five passes). Tiles of up
    to ROW_MAX_TILE slots, or block_n."""
    return _per_row(_scores_lse_kernel, scores, block_n)


def normalize_target(p: torch.Tensor,
                     options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT
                     ) -> torch.Tensor:
    """`indexer_loss_rows(..., with_kl=False)` for a caller that has each row's index-score
    log-sum-exp already (the DSA layer's `hyscale_indexer_lse` "selection"): p (fp32 [B, T, K], the
    head-summed target, < 0 at invalid slots) L1-normalized in place over each row's valid
    slots, no key gathered; returns the rows' normalized sums (fp32 [B, T], its `psum`). Its
    sums run over wide tiles (the row pass's 64-slot ones cost it 3.7 ms at 128K on an H100,
    2026-12-06), so they equal the row pass's to fp32 rounding order; bitwise at
    options.block_n, which both then use."""
    return _per_row(_normalize_target_kernel, p, options.block_n)


def _hopper_backward_module():
    """`kernels/indexer_loss_bwd_sm90` (Gluon, `common.gluon_module`: loaded once a process)
    where the Hopper backward may run; None after one warning where it does not load."""
    module, why = gluon_module("indexer_loss_bwd_sm90")
    if module is None:
        from megatron_hyscale.ops.checks import warn_once

        warn_once("indexer-loss-bwd-sm90: import", "HyScale: the Hopper indexer-loss backward "
                  f"cannot be loaded ({why}); using the Triton backward")
    return module


def indexer_loss_bwd(q_index, weights, k_index, indices, p, lse, psum, grad, coeff, relu,
                     deterministic=False,
                     options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT,
                     with_kl: bool = False, mode: int = MODE_ATOMIC,
                     keys_ascending: bool = False):
    """Gradients (dq_index, dweights, dk_index) in their inputs' dtypes; with_kl: also the row
    KL fp32 [B, T] from the recomputed scores (after `indexer_loss_rows(..., with_kl=False)`),
    a fourth output. keys_ascending: each row's valid indices increase first, -1 after
    (HyTopK's key-ordered output), which `options.bwd_key_passes` needs (one pass without).
    mode=MODE_DISCARD (measurement only: the kernel's time without dk's
    atomics) runs the same products and reduces each dk tile to one number a key row, stored
    without atomics (the Hopper kernel: added, one scalar atomic a row and chunk); its third
    output is that buffer (fp32 [B, S]; the Hopper kernel's [B, S, D]), not a gradient."""
    if mode not in (MODE_ATOMIC, MODE_DISCARD) or (deterministic and mode == MODE_DISCARD):
        raise ValueError(f"mode must be MODE_ATOMIC ({MODE_ATOMIC}) or, not deterministic, "
                         f"MODE_DISCARD ({MODE_DISCARD}); got {mode!r}")
    sm90 = (_hopper_backward_module() if options.bwd_sm90 and on_hopper(q_index)
            else None)
    if sm90 is not None:
        passes = options.bwd_key_passes or auto_key_passes(k_index.shape[1])
        passes = passes if keys_ascending and not options.bwd_lockstep else 1
        done = sm90.run_if_supported(q_index, weights, k_index, indices, p, lse, psum, grad,
                                     coeff, relu, deterministic=deterministic, with_kl=with_kl,
                                     mode=mode, lockstep=options.bwd_lockstep,
                                     lockstep_slack=options.bwd_lockstep_slack,
                                     key_passes=passes)
        if done is not None:
            return done
    B, T, H, D = q_index.shape
    S = k_index.shape[1]
    NK = indices.shape[-1]
    dev = q_index.device
    dq, dw, dk_acc = indexer_grad_buffers(q_index, weights, k_index, deterministic)
    discard = mode == MODE_DISCARD
    rowmax = (torch.zeros((B, S), device=dev, dtype=torch.float32) if deterministic or discard
              else lse)
    grad = grad.detach().reshape(1).to(device=dev, dtype=torch.float32)
    kl = torch.empty((B, T), device=dev, dtype=torch.float32) if with_kl else lse
    const, num_warps = _bwd_launch(q_index, options)
    const["RELU"] = relu
    if with_kl:  # absent otherwise: the default launch's constexprs as before
        const["KL"] = True
    # The deterministic passes run unpaced: their order is fixed anyway, and the pace serves
    # the fp32 atomics' L2 hits.
    lockstep = options.bwd_lockstep and not deterministic
    work = B * T
    programs, sync = work, lse
    if lockstep and work > 0:
        programs, sync = lockstep_plan(work, dev, options.bwd_lockstep_slack,
                                       options.bwd_lockstep_programs_per_sm)
        const.update(LOCKSTEP=True, SYNC_SLACK=options.bwd_lockstep_slack,
                     SYNC_SPINS=SYNC_SPINS, SYNC_PTX=not triton_interpret())

    def run(mode, scale):
        args = (q_index, weights, k_index, indices, p, lse, psum, grad, coeff, dq, dw, dk_acc,
                rowmax, scale, kl, sync, programs, work, T, NK, H, D, *q_index.stride(),
                *weights.stride(), *k_index.stride(), *indices.stride(), *p.stride(),
                *lse.stride(), *dq.stride(), *dw.stride(), *dk_acc.stride(), *rowmax.stride())
        c = dict(const, MODE=mode)
        _launch(_bwd_kernel, (programs,), args, c, options.index_tilings, num_warps,
                ("bwd", q_index.dtype, k_index.dtype, tuple(sorted(c.items()))), options)

    if discard:
        run(MODE_DISCARD, rowmax)
        dk = rowmax
    elif not deterministic:
        run(MODE_ATOMIC, rowmax)
        dk = dk_acc.to(k_index.dtype)
    else:
        run(MODE_ROWMAX, rowmax)
        # Repeated indices are dropped, so a dk element gets at most one addend per query row.
        scale, exp = fixed_point_scale(rowmax, T)
        run(MODE_FIXED, scale)
        dk = torch.ldexp(dk_acc.double(), -exp.unsqueeze(-1)).to(k_index.dtype)
    return (dq, dw, dk, kl) if with_kl else (dq, dw, dk)


def indexer_loss_rows_bwd(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor,
                          indices: torch.Tensor, p: torch.Tensor, grad: torch.Tensor,
                          coeff: float, relu: bool, deterministic: bool = False,
                          options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`indexer_loss_rows` then `indexer_loss_bwd` (the row KL fp32 [B, T] and the gradients),
    for a caller that has the loss's gradient when it needs the rows: one launch, two gathered
    passes over a row instead of three (the deterministic mode adds its fixed-point pass)."""
    B, T, H, D = q_index.shape
    S = k_index.shape[1]
    NK = indices.shape[-1]
    dev = q_index.device
    kl, lse, psum = (torch.empty((B, T), device=dev, dtype=torch.float32) for _ in range(3))
    dq, dw, dk_acc = indexer_grad_buffers(q_index, weights, k_index, deterministic)
    rowmax = torch.zeros((B, S), device=dev, dtype=torch.float32) if deterministic else lse
    grad = grad.detach().reshape(1).to(device=dev, dtype=torch.float32)
    const, num_warps = _bwd_launch(q_index, options)
    const.update(RELU=relu, MODE=MODE_ROWMAX if deterministic else MODE_ATOMIC)
    args = (q_index, weights, k_index, indices, p, kl, lse, psum, grad, coeff, dq, dw, dk_acc,
            rowmax, rowmax, T, NK, H, D, *q_index.stride(), *weights.stride(),
            *k_index.stride(), *indices.stride(), *p.stride(), *kl.stride(), *dq.stride(),
            *dw.stride(), *dk_acc.stride(), *rowmax.stride())
    _launch(_rows_bwd_kernel, (B * T,), args, const, options.index_tilings, num_warps,
            ("rows_bwd", q_index.dtype, k_index.dtype, tuple(sorted(const.items()))), options)
    if not deterministic:
        return kl, dq, dw, dk_acc.to(k_index.dtype)
    # p now holds the normalized target, lse and psum the row statistics: the plain backward's
    # fixed-point pass (with the row maxima just taken) completes the gradients.
    scale, exp = fixed_point_scale(rowmax, T)
    # (kl, sync, programs, work): no KL, unpaced, one program a row.
    args = (q_index, weights, k_index, indices, p, lse, psum, grad, coeff, dq, dw, dk_acc,
            rowmax, scale, lse, lse, B * T, B * T, T, NK, H, D, *q_index.stride(),
            *weights.stride(), *k_index.stride(), *indices.stride(), *p.stride(), *lse.stride(),
            *dq.stride(), *dw.stride(), *dk_acc.stride(), *rowmax.stride())
    c = dict(const, MODE=MODE_FIXED)
    _launch(_bwd_kernel, (B * T,), args, c, options.index_tilings, num_warps,
            ("bwd", q_index.dtype, k_index.dtype, tuple(sorted(c.items()))), options)
    dk = torch.ldexp(dk_acc.double(), -exp.unsqueeze(-1)).to(k_index.dtype)
    return kl, dq, dw, dk


class IndexerKLLossFunction(torch.autograd.Function):
    """Autograd wrapper: saves the indexer inputs, the normalized target p and row stats; the
    backward runs with the forward's options."""

    @staticmethod
    def forward(ctx, q_index, weights, k_index, query, key, indices, q_positions, k_positions,
                softmax_scale, coeff, relu, tp_group, deterministic, options, attention_lse,
                query_valid_rows=None):
        p = attention_target(query, key, indices, q_positions, k_positions, softmax_scale,
                             attention_lse, options, query_valid_rows)
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            torch.distributed.all_reduce(p, group=tp_group)  # the other ranks' query heads
        kl, lse, psum = indexer_loss_rows(q_index, weights, k_index, indices, p, relu, options)
        ctx.save_for_backward(q_index, weights, k_index, indices, p, lse, psum)
        ctx.coeff, ctx.relu, ctx.deterministic, ctx.options = coeff, relu, deterministic, options
        return kl.sum() * coeff

    @staticmethod
    def backward(ctx, grad):
        q_index, weights, k_index, indices, p, lse, psum = ctx.saved_tensors
        dq, dw, dk = indexer_loss_bwd(q_index, weights, k_index, indices, p, lse, psum, grad,
                                      ctx.coeff, ctx.relu, ctx.deterministic, ctx.options)
        return (dq, dw, dk) + (None,) * 13


def indexer_kl_loss_triton(q_index, weights, k_index, query, key, topk_indices, softmax_scale,
                           loss_coeff, *, relu, q_positions, k_positions,
                           calculate_per_token_loss, tp_group=None, deterministic=False,
                           attention_lse=None,
                           options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT,
                           query_valid_rows=None):
    """Sparse DSA indexer KL loss on validated inputs (see ops.indexer_kl_loss).

    q_positions / k_positions: int64 [B, T] / [B, S]. `deterministic=True` makes dk_index
    bitwise repeatable (fixed-point accumulation, one extra backward pass). attention_lse: see
    ops.indexer_kl_loss. options: the kernels' tilings (options.block_n forces the keys per
    step, tests), forward and backward. query_valid_rows: bool [B, T] or None, the rows that
    take part; the mean is then over them (a device scalar: no host sync).
    """
    B, T = q_index.shape[:2]
    rows = B * T
    if rows == 0:  # nothing to launch; keep the graph so backward gives zero gradients
        return (q_index.sum() + weights.sum() + k_index.sum()).float() * 0.0
    if topk_indices.shape[-1] == 0:  # one empty slot keeps the kernels' tiles non-empty
        topk_indices = topk_indices.new_full((B, T, 1), -1)
    coeff, count = loss_scaling(loss_coeff, rows, calculate_per_token_loss, query_valid_rows)
    if not relu:
        q_index, weights = fold_index_query(q_index, weights)
    loss = IndexerKLLossFunction.apply(
        q_index, weights, k_index, query.detach(), key.detach(), topk_indices, q_positions,
        k_positions, float(softmax_scale), coeff, relu, tp_group, bool(deterministic), options,
        None if attention_lse is None else attention_lse.detach(), query_valid_rows)
    return loss if count is None else loss / count


def loss_scaling(loss_coeff, rows, per_token, query_valid_rows):
    """(the kernels' coefficient, the count the loss is then divided by or None): the KL sum
    times loss_coeff when per-token; with a row mask the mean over its valid rows (at least
    one, a device scalar: no host sync), as megatron's; else the mean over the rows."""
    if per_token:
        return float(loss_coeff), None
    if query_valid_rows is not None:
        return float(loss_coeff), query_valid_rows.sum(dtype=torch.float32).clamp_min(1.0)
    return float(loss_coeff) / rows, None


def fold_index_query(q_index, weights):
    """Without ReLU, sum_h w_h (q_h . k) = (sum_h w_h q_h) . k: one fp32 query a row (1/H_I of
    the work) and unit weights; autograd carries the gradient back through the fold."""
    B, T = q_index.shape[:2]
    folded = torch.einsum("bthd,bth->btd", q_index.float(), weights.float()).unsqueeze(2)
    return folded, torch.ones((B, T, 1), device=q_index.device, dtype=torch.float32)

"""DSA indexer KL loss over every visible key (dense warm-up form): Triton forward and backward.

Shapes: q_index [B, T, H_I, D_I], weights [B, T, H_I], k_index [B, S, D_I] (bf16, fp16 or
fp32); query [B, T, Hq, Dqk], key [B, S, Hkv, Dqk] (detached); positions int64 [B, T] / [B, S].
Returns the fp32 scalar loss; the gradients reach q_index, weights and k_index. No [T, S]
tensor: per-row statistics only (two fp32 [B, T, Hq] and a few [B, T]).

Algorithm, one program per query row (rows with the most keys launched first), two launches:
1. stats: per head block, a flash-style pass over the row's keys gets each main-attention head's
   max m_h and 1 / (sum_s exp(l_hs - m_h) * Hq); then a pass gets the index scores' lse.
2. loss: per key tile recompute the head-summed target pn_s = sum_h exp(l_hs - m_h) / (l_h Hq)
   (already L1-normalized: each head adds 1) and the index scores I_s; add
   pn_s (log max(pn_s, eps) - I_s + lse) to the row's KL and, when gradients are wanted,
   g_s = coeff (softmax(I)_s - pn_s): dw_h = sum_s g_s act(L_hs), with G_hs = g_s w_h act'(L_hs)
   dq = G @ K and dk += G^T @ q (fp32 atomics, or the order-free fixed-point mode).
The backward is computed in the forward (unit output gradient) and scaled by the real one in
`backward`: the loss is a scalar, and a separate backward would recompute the main attention a
third time (the dominant cost: Hq x Dqk against H_I x D_I per key). Without autograd the loss
pass skips the gradient work. Deterministic mode: the loss pass runs twice (row maxima of the dk
contributions, then the fixed-point sums), as the sparse kernel's backward does.

Key s is visible to row t iff k_positions[s] <= q_positions[t]; a row scans keys 0 .. n_t - 1,
n_t = 1 + the last visible key (`key_ends`), and masks the rest by position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.kernels.common import (
    LOG2E,
    MIN_DOT,
    MODE_ATOMIC,
    MODE_FIXED,
    MODE_ROWMAX,
    WIDE_TILE,
    accumulate,
    channel_split,
    dot_precision,
    fix_interpreter,
    fixed_point_scale,
)
from megatron_hyscale.ops.kernels.indexer_loss import (
    EPS,
    index_scores,
    load_index_query,
    loss_scaling,
    lse_of,
    lse_step,
)
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions, Tilings
from megatron_hyscale.ops.kernels.tiling import launch_first_fitting

fix_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1
_EPS = tl.constexpr(EPS)
_NEG_INF = tl.constexpr(float("-inf"))


# --------------------------------------------------------------------------- jit bodies


@triton.jit
def _row_of(B, T):
    """(b, t) of this program: rows in descending t (the longest causal rows start first)."""
    pid = tl.program_id(0).to(tl.int64)
    return pid % B, T - 1 - pid // B


@triton.jit
def _key_tile(kpos_base, skps, n0, n_end, qp, BLOCK_N: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N: their indices, in-range mask and visibility to the row."""
    offs = n0 + tl.arange(0, BLOCK_N)
    inside = offs < n_end
    kp = tl.load(kpos_base + offs * skps, mask=inside, other=0)
    return offs, inside, inside & (kp <= qp)


@triton.jit
def _main_query(q_row, k_ptr_b, skh, grp, NHB, G, sqh, sqd, D, m_ptr_r, il_ptr_r, smh,
                D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_H: tl.constexpr):
    """Head block `grp` of the row: query [heads x D_MAIN] (+ tail), its key head's base, the
    head indices and mask, and (from the stats pass) each head's max and scaled 1 / sum."""
    kvh = grp // NHB
    offs_h = (grp % NHB) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < G
    heads = kvh * G + offs_h
    offs_dm = tl.arange(0, D_MAIN)
    q_rows = q_row + heads[:, None] * sqh
    q_main = tl.load(q_rows + offs_dm[None, :] * sqd,
                     mask=h_mask[:, None] & (offs_dm[None, :] < D), other=0.0)
    if D_TAIL > 0:
        offs_dt = D_MAIN + tl.arange(0, D_TAIL)
        q_tail = tl.load(q_rows + offs_dt[None, :] * sqd,
                         mask=h_mask[:, None] & (offs_dt[None, :] < D), other=0.0)
    else:
        q_tail = q_main  # unused
    m = tl.load(m_ptr_r + heads * smh, mask=h_mask, other=0.0)
    il = tl.load(il_ptr_r + heads * smh, mask=h_mask, other=0.0)
    return q_main, q_tail, k_ptr_b + kvh * skh, heads, h_mask, m, il


@triton.jit
def _main_logits(q_main, q_tail, k_base, sks, skd, offs_n, inside, visible, D, qk_scale2,
                 D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, PRECISION: tl.constexpr):
    """Base-2 main-attention logits [heads x keys] of a contiguous key tile; -inf where the
    key is not visible."""
    offs_dm = tl.arange(0, D_MAIN)
    k_main = tl.load(k_base + offs_n[:, None] * sks + offs_dm[None, :] * skd,
                     mask=inside[:, None] & (offs_dm[None, :] < D), other=0.0)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
    if D_TAIL > 0:
        offs_dt = D_MAIN + tl.arange(0, D_TAIL)
        k_tail = tl.load(k_base + offs_n[:, None] * sks + offs_dt[None, :] * skd,
                         mask=inside[:, None] & (offs_dt[None, :] < D), other=0.0)
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
    return tl.where(visible[None, :], s * qk_scale2, _NEG_INF)


@triton.jit
def _dense_stats_kernel(
    q_ptr, k_ptr, qi_ptr, w_ptr, ki_ptr, qpos_ptr, kpos_ptr, nend_ptr, m_ptr, il_ptr, lse_ptr,
    B, T, G, NHB, NGRP, D, HI, DI, qk_scale2, inv_heads,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, sqib, sqit, sqih, sqid, swb, swt, swh,
    skib, skis, skid, sqpb, sqpt, skpb, skps, snb, snt, smb, smt, smh, slb, slt,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BH_I: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PRECISION_I: tl.constexpr, RELU: tl.constexpr,
):
    """Per-row statistics: m [B, T, Hq] (base-2 max of each head's logits, 0 when empty),
    il [B, T, Hq] = 1 / (sum_s exp2(l_hs - m_h) * Hq) (0 when empty) and lse [B, T] (natural
    log-sum-exp of the index scores, 0 when empty), all fp32, over the row's visible keys.
    Head blocks one after another, each a running max / sum over key tiles; then the scores."""
    b, t = _row_of(B, T)
    n_end = tl.load(nend_ptr + b * snb + t * snt)
    qp = tl.load(qpos_ptr + b * sqpb + t * sqpt)
    kpos_base = kpos_ptr + b * skpb
    q_row = q_ptr + b * sqb + t * sqt
    m_row = m_ptr + b * smb + t * smt
    il_row = il_ptr + b * smb + t * smt
    for grp in range(0, NGRP):
        q_main, q_tail, k_base, heads, h_mask, _m_old, _il_old = _main_query(
            q_row, k_ptr + b * skb, skh, grp, NHB, G, sqh, sqd, D, m_row, il_row, smh,
            D_MAIN, D_TAIL, BLOCK_H)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        for n0 in range(0, n_end, BLOCK_N):
            offs_n, inside, visible = _key_tile(kpos_base, skps, n0, n_end, qp, BLOCK_N)
            s = _main_logits(q_main, q_tail, k_base, sks, skd, offs_n, inside, visible, D,
                             qk_scale2, D_MAIN, D_TAIL, PRECISION)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no inf - inf
            l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), axis=1)
            m_i = m_new
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        il = tl.where(l_i > 0.0, inv_heads / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        tl.store(m_row + heads * smh, m_use, mask=h_mask)
        tl.store(il_row + heads * smh, il, mask=h_mask)

    qi, w, _offs_h, offs_d = load_index_query(qi_ptr, w_ptr, b, t, HI, DI, sqib, sqit, sqih,
                                              sqid, swb, swt, swh, BH_I, D_PAD)
    ki_base = ki_ptr + b * skib
    m_s = tl.full([], float("-inf"), tl.float32)
    l_s = tl.zeros([], tl.float32)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n, inside, visible = _key_tile(kpos_base, skps, n0, n_end, qp, BLOCK_N)
        _kt, _logits, _act, s = index_scores(qi, w, ki_base, skis, skid, offs_n, inside,
                                             offs_d, DI, RELU, PRECISION_I)
        m_s, _, l_s = lse_step(m_s, l_s, s, visible)
    tl.store(lse_ptr + b * slb + t * slt, lse_of(m_s, l_s))


@triton.jit
def _group_target(q_main, q_tail, k_base, m, il, sks, skd, offs_n, inside, visible, D,
                  qk_scale2, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
                  PRECISION: tl.constexpr):
    """sum over the block's heads of exp2(l_hs - m_h) * il_h: its share of the target tile."""
    s = _main_logits(q_main, q_tail, k_base, sks, skd, offs_n, inside, visible, D, qk_scale2,
                     D_MAIN, D_TAIL, PRECISION)
    return tl.sum(tl.exp2(s - m[:, None]) * il[:, None], axis=0)


@triton.jit
def _dense_loss_kernel(
    q_ptr, k_ptr, qi_ptr, w_ptr, ki_ptr, qpos_ptr, kpos_ptr, nend_ptr, m_ptr, il_ptr, lse_ptr,
    kl_ptr, dq_ptr, dw_ptr, dk_ptr, rowmax_ptr, scale_ptr, gscale,
    B, T, G, NHB, NGRP, D, HI, DI, qk_scale2,
    sqb, sqt, sqh, sqd, skb, sks, skh, skd, sqib, sqit, sqih, sqid, swb, swt, swh,
    skib, skis, skid, sqpb, sqpt, skpb, skps, snb, snt, smb, smt, smh, slb, slt,
    sdqb, sdqt, sdqh, sdqd, sdwb, sdwt, sdwh, sdkb, sdks, sdkd, srmb, srms,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BH_I: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PRECISION_I: tl.constexpr, RELU: tl.constexpr, ONE_GROUP: tl.constexpr,
    WITH_GRAD: tl.constexpr, MODE: tl.constexpr,
):
    """Row KL fp32 [B, T] and, WITH_GRAD, dq_index / dweights (fp32, owned per row) and the
    row's dk_index contributions (by MODE into dk; gradients of coeff = gscale times the KL).

    Per key tile: the normalized target pn from the head blocks (ONE_GROUP: one block, its
    query kept resident), the index scores I, KL terms pn (log max(pn, eps) - I + lse), then
    g = gscale (exp(I - lse) - pn) into dw, dq and dk as the sparse kernel's backward.
    """
    b, t = _row_of(B, T)
    n_end = tl.load(nend_ptr + b * snb + t * snt)
    qp = tl.load(qpos_ptr + b * sqpb + t * sqpt)
    kpos_base = kpos_ptr + b * skpb
    q_row = q_ptr + b * sqb + t * sqt
    m_row = m_ptr + b * smb + t * smt
    il_row = il_ptr + b * smb + t * smt
    k_ptr_b = k_ptr + b * skb
    qi, w, offs_h, offs_d = load_index_query(qi_ptr, w_ptr, b, t, HI, DI, sqib, sqit, sqih,
                                             sqid, swb, swt, swh, BH_I, D_PAD)
    lse = tl.load(lse_ptr + b * slb + t * slt)
    ki_base = ki_ptr + b * skib
    dk_base = dk_ptr + b * sdkb
    rm_base = rowmax_ptr + b * srmb
    fx_base = scale_ptr + b * srmb
    d_mask = offs_d[None, :] < DI
    if ONE_GROUP:
        q_main, q_tail, k_base, _heads, _h_mask, m, il = _main_query(
            q_row, k_ptr_b, skh, 0, NHB, G, sqh, sqd, D, m_row, il_row, smh, D_MAIN, D_TAIL,
            BLOCK_H)

    kl = tl.zeros([], tl.float32)
    dq = tl.zeros([BH_I, D_PAD], tl.float32)
    dw = tl.zeros([BH_I], tl.float32)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n, inside, visible = _key_tile(kpos_base, skps, n0, n_end, qp, BLOCK_N)
        if ONE_GROUP:
            pn = _group_target(q_main, q_tail, k_base, m, il, sks, skd, offs_n, inside,
                               visible, D, qk_scale2, D_MAIN, D_TAIL, PRECISION)
        else:
            pn = tl.zeros([BLOCK_N], tl.float32)
            for grp in range(0, NGRP):
                gq_main, gq_tail, gk_base, _g_heads, _g_mask, gm, gil = _main_query(
                    q_row, k_ptr_b, skh, grp, NHB, G, sqh, sqd, D, m_row, il_row, smh,
                    D_MAIN, D_TAIL, BLOCK_H)
                pn += _group_target(gq_main, gq_tail, gk_base, gm, gil, sks, skd, offs_n,
                                    inside, visible, D, qk_scale2, D_MAIN, D_TAIL, PRECISION)
        kt, logits, act, s = index_scores(qi, w, ki_base, skis, skid, offs_n, inside, offs_d,
                                          DI, RELU, PRECISION_I)
        logp = s - lse
        term = pn * (tl.log(tl.maximum(pn, _EPS)) - logp)
        kl += tl.sum(tl.where(visible, term, 0.0), axis=0)
        if WITH_GRAD:
            # -inf where not visible: an out-of-range key's s is from a zeroed row. The sparse
            # backward's grad_step would do the same arithmetic, but its load masked by the
            # visible keys and its psum factor compile to 15 more instructions a tile here.
            prob = tl.exp(tl.where(visible, logp, float("-inf")))
            g = tl.where(visible, (prob - pn) * gscale, 0.0)
            dw += tl.sum(act * g[None, :], axis=1)
            g_l = w[:, None] * g[None, :]
            if RELU:
                g_l = tl.where(logits > 0.0, g_l, 0.0)  # ReLU'(0) = 0, as torch's
            dq += tl.dot(g_l.to(kt.dtype), kt, input_precision=PRECISION_I)
            dk_t = tl.dot(tl.trans(g_l).to(qi.dtype), qi, input_precision=PRECISION_I)
            accumulate(dk_base + offs_n[:, None] * sdks + offs_d[None, :] * sdkd, dk_t, offs_n,
                       visible, d_mask, rm_base, fx_base, srms, MODE)
    tl.store(kl_ptr + b * slb + t * slt, kl)
    if WITH_GRAD:
        if MODE != 1:  # the row-max pass of the deterministic mode writes only its maxima
            h_mask = offs_h < HI
            tl.store(dq_ptr + b * sdqb + t * sdqt + offs_h[:, None] * sdqh
                     + offs_d[None, :] * sdqd, dq, mask=h_mask[:, None] & d_mask)
            tl.store(dw_ptr + b * sdwb + t * sdwt + offs_h * sdwh, dw, mask=h_mask)


# --------------------------------------------------------------------------- launch wrappers


_tiling_cache: dict[tuple, tuple[int, int]] = {}


def _launch(kernel, grid, args, const, tilings: Tilings, num_warps, key,
            options: IndexerLossKernelOptions):
    """Launch with the first of `tilings` that fits (or at options.block_n, one stage)."""
    if options.block_n is not None:
        kernel[grid](*args, **const, BLOCK_N=options.block_n, num_warps=num_warps,
                     num_stages=1)
        return
    launch_first_fitting(kernel, grid, args, const, tilings, num_warps, _tiling_cache,
                         key + (tilings,), "dense indexer-loss")


def key_ends(q_positions, k_positions, query_valid_rows=None):
    """int64 [B, T]: 1 + the last key visible to each row (0 for none, or for a row outside
    query_valid_rows); keys past it are never visible. Positions int64 [B, T] / [B, S], in any
    order: the suffix minima of k_positions are sorted, so a binary search finds it."""
    B, T = q_positions.shape
    if k_positions.shape[1] == 0:
        return torch.zeros((B, T), dtype=torch.int64, device=q_positions.device)
    suffix_min = k_positions.flip(1).cummin(dim=1).values.flip(1).contiguous()
    ends = torch.searchsorted(suffix_min, q_positions.contiguous(), right=True)
    if query_valid_rows is not None:
        ends = ends * query_valid_rows
    return ends


def _geometry(q_index, query, key, max_block_h):
    """Constexprs, (G, head blocks a KV head, head blocks a row) and warps of both kernels."""
    HI, DI = q_index.shape[2], q_index.shape[3]
    Hq, D = query.shape[2], query.shape[3]
    G = Hq // key.shape[2]
    block_h = min(max_block_h, max(MIN_DOT, triton.next_power_of_2(G)))
    nhb = triton.cdiv(G, block_h)
    d_main, d_tail = channel_split(D)
    bh_i = max(MIN_DOT, triton.next_power_of_2(HI))
    d_pad = max(MIN_DOT, triton.next_power_of_2(DI))
    wide = block_h * d_main >= WIDE_TILE or bh_i * d_pad >= WIDE_TILE
    const = dict(D_MAIN=d_main, D_TAIL=d_tail, BLOCK_H=block_h, BH_I=bh_i, D_PAD=d_pad,
                 PRECISION=dot_precision(query.dtype), PRECISION_I=dot_precision(q_index.dtype))
    return const, (G, nhb, key.shape[2] * nhb), 8 if wide else 4


def dense_indexer_loss_rows(q_index, weights, k_index, query, key, q_positions, k_positions,
                            ends, softmax_scale, relu, coeff=1.0, with_grad=False,
                            deterministic=False,
                            options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT):
    """Per-row KL fp32 [B, T] and, with_grad, the gradients of coeff * sum(KL): fp32 dq_index
    [B, T, H_I, D_I], dweights [B, T, H_I] and dk_index [B, S, D_I] (else Nones).

    ends: `key_ends` of the positions. options: target_tilings (keys per step, stages) for
    both kernels, max_block_h the main-attention heads a program's MMA; block_n forces one.
    """
    B, T, HI, DI = q_index.shape
    S, Hq = key.shape[1], query.shape[2]
    dev = q_index.device
    const, (G, nhb, ngrp), num_warps = _geometry(q_index, query, key, options.max_block_h)
    const["RELU"] = bool(relu)
    f32 = dict(device=dev, dtype=torch.float32)
    m, il = torch.empty((B, T, Hq), **f32), torch.empty((B, T, Hq), **f32)
    lse, kl = torch.empty((B, T), **f32), torch.empty((B, T), **f32)
    grid = (B * T,)
    qk_scale2 = float(softmax_scale) * LOG2E
    common = (B, T, G, nhb, ngrp, query.shape[3], HI, DI, qk_scale2)
    strides = (*query.stride(), *key.stride(), *q_index.stride(), *weights.stride(),
               *k_index.stride(), *q_positions.stride(), *k_positions.stride(), *ends.stride(),
               *m.stride(), *lse.stride())
    ptrs = (query, key, q_index, weights, k_index, q_positions, k_positions, ends, m, il, lse)
    _launch(_dense_stats_kernel, grid, (*ptrs, *common, 1.0 / Hq, *strides), const,
            options.target_tilings, num_warps,
            ("stats", query.dtype, q_index.dtype, k_index.dtype, tuple(sorted(const.items()))),
            options)

    if with_grad:
        dq = torch.empty((B, T, HI, DI), **f32)
        dw = torch.empty((B, T, HI), **f32)
        dk_acc = torch.zeros((B, S, DI), device=dev,
                             dtype=torch.int64 if deterministic else torch.float32)
        rowmax = torch.zeros((B, S), **f32) if deterministic else lse
    else:
        dq, dw, dk_acc, rowmax = kl, kl, kl, lse  # unread

    def run(mode, scale):
        args = (*ptrs, kl, dq, dw, dk_acc, rowmax, scale, float(coeff), *common, *strides,
                *(dq.stride() if with_grad else (0,) * 4),
                *(dw.stride() if with_grad else (0,) * 3),
                *(dk_acc.stride() if with_grad else (0,) * 3),
                *(rowmax.stride() if with_grad and deterministic else (0, 0)))
        c = dict(const, ONE_GROUP=ngrp == 1, WITH_GRAD=bool(with_grad), MODE=mode)
        _launch(_dense_loss_kernel, grid, args, c, options.target_tilings, num_warps,
                ("loss", query.dtype, q_index.dtype, k_index.dtype, tuple(sorted(c.items()))),
                options)

    if not with_grad:
        run(MODE_ATOMIC, lse)
        return kl, None, None, None
    if not deterministic:
        run(MODE_ATOMIC, rowmax)
        return kl, dq, dw, dk_acc
    run(MODE_ROWMAX, rowmax)
    # A dk element gets at most one addend per query row of its batch.
    scale, exp = fixed_point_scale(rowmax, T)
    run(MODE_FIXED, scale)
    dk = torch.ldexp(dk_acc.double(), -exp.unsqueeze(-1)).float()
    return kl, dq, dw, dk


class DenseIndexerKLLossFunction(torch.autograd.Function):
    """Autograd wrapper: the forward computes the gradients of coeff * sum(KL) along with the
    loss (when any indexer input needs one) and saves them; backward scales them by the
    output gradient and casts them to the inputs' dtypes."""

    @staticmethod
    def forward(ctx, q_index, weights, k_index, query, key, q_positions, k_positions, ends,
                softmax_scale, coeff, relu, deterministic, options):
        with_grad = any(ctx.needs_input_grad[:3])
        kl, dq, dw, dk = dense_indexer_loss_rows(
            q_index, weights, k_index, query, key, q_positions, k_positions, ends,
            softmax_scale, relu, coeff, with_grad, deterministic, options)
        if with_grad:
            ctx.save_for_backward(dq, dw, dk)
        ctx.dtypes = (q_index.dtype, weights.dtype, k_index.dtype)
        return kl.sum() * coeff

    @staticmethod
    def backward(ctx, grad):
        dq, dw, dk = ctx.saved_tensors
        g = grad.detach().float()
        grads = tuple((x * g).to(dt) for x, dt in zip((dq, dw, dk), ctx.dtypes, strict=True))
        return grads + (None,) * 10


def dense_indexer_kl_loss_triton(
    q_index, weights, k_index, query, key, softmax_scale, loss_coeff, *, relu, q_positions,
    k_positions, calculate_per_token_loss, deterministic=False,
    options: IndexerLossKernelOptions = IndexerLossKernelOptions.DEFAULT, query_valid_rows=None,
):
    """Dense DSA indexer KL loss on validated inputs (see ops.indexer_kl_loss, sparse=False).

    q_positions / k_positions: int64 [B, T] / [B, S] (causal=False already applied by the
    caller). No tp split (the head-summed target of other ranks' heads would need a [T, S]
    exchange). `deterministic=True` makes dk_index bitwise repeatable (fixed-point, the loss
    pass twice). query_valid_rows: bool [B, T] or None; the mean is then over its rows.
    """
    B, T = q_index.shape[:2]
    rows = B * T
    if rows == 0 or k_index.shape[1] == 0:  # keep the graph: zero loss and gradients
        return (q_index.sum() + weights.sum() + k_index.sum()).float() * 0.0
    coeff, count = loss_scaling(loss_coeff, rows, calculate_per_token_loss, query_valid_rows)
    # relu=False keeps the heads (no fold into one fp32 query as the sparse op does): the fold's
    # fp32 products run on CUDA cores here (sm_90a, GLM-5.1: 2383 SASS instructions a key tile
    # with 89 local loads, against 1335 and none for the heads' bf16 tensor-core products), and
    # the head sum then follows the reference's order of operations.
    ends = key_ends(q_positions, k_positions, query_valid_rows)
    loss = DenseIndexerKLLossFunction.apply(
        q_index, weights, k_index, query.detach(), key.detach(), q_positions, k_positions, ends,
        float(softmax_scale), coeff, bool(relu), bool(deterministic), options)
    return loss if count is None else loss / count


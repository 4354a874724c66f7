"""The DSA indexer KL loss's backward on Hopper (sm_90a): a warp-specialized Gluon kernel.

Shapes: q_index bf16 [B, T, H, D] (H = 32 or 64, D = 128), weights fp32 / bf16 [B, T, H],
k_index bf16 [B, S, D], indices int32 / int64 [B, T, K], p fp32 [B, T, K] (the normalized
target, < 0 at slots that take no part: -1, invisible, repeated), lse and psum fp32 [B, T], grad
a scalar tensor, coeff a float. Returns (dq in q's dtype, dw in weights' dtype, dk in k's dtype
through an fp32 accumulator), and with with_kl the row KL fp32 [B, T] from the recomputed scores
as a fourth output: `indexer_loss.indexer_loss_bwd`'s results (its MODE_ATOMIC, with or without
the KL) up to fp32 rounding order.

Algorithm: persistent programs, each taking pairs of query rows; consumer warpgroup c takes the
pair's row c, so one row's atomics and softmax run under the other's products. A producer
warpgroup loads a row's q once (double-buffered across rows) and, a ring of stages ahead, each
64-slot tile's gathered k_index rows, target values and indices (cp.async). Per tile the keys
go on wgmma's M (64 rows: 32 heads still fill it): S^T = K Q^T [keys x H]; in registers the
score s_j = sum_h w_h act(S_jh), g_j = (exp(s_j - lse) psum - pn_j) grad coeff at valid slots,
dw_h += g_j act(S_jh), G^T = g_j w_h act'(S_jh) (bf16, to shared memory); with the KL (a
constexpr: no work without it) each valid slot's term pn_j (log max(pn_j, EPS) - (s_j - lse))
(`indexer_loss._kl_terms`) added into the row's per-slot fp32 partial sums, reduced across the
warpgroup at the row's end. dQ^T [D x H] += K^T G^T, and dK = G^T Q in two 64-channel chunks
added into the fp32 dk rows with 16-byte atomics. The key tile is released after the dQ
product, so the next gathers run under the dK products and their atomics.

LOCKSTEP (`IndexerLossKernelOptions.bwd_lockstep`): each consumer counts its start of a key tile
in its wave's counter (wave n: every program's n-th pair) and waits, bounded, until the wave's
rows have together started the tile bwd_lockstep_slack before: on rows in increasing key order
the wave's dk additions then fall into the same few key ranges, which the L2 cache serves.
"""

from __future__ import annotations

import torch
import triton
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
from megatron_hyscale.ops.kernels import common
from megatron_hyscale.ops.kernels.common import (
    INDEXER_LOSS_EPS,
    MODE_ATOMIC,
    MODE_DISCARD,
    SYNC_SPINS,
    lockstep_plan,
)
from megatron_hyscale.ops.kernels.gluon_common import (
    gather_rows,
    kernel_strides,
    lockstep_wait,
    opaque_zero,
)
from megatron_hyscale.ops.kernels.key_split import key_split
from megatron_hyscale.ops.kernels.sparse_mla_bwd_sm90 import RED_LAYOUT
from megatron_hyscale.ops.kernels.sparse_mla_fwd_sm90 import STRIDE_MULTIPLE

# Index heads the kernel takes: the N of S^T and dQ^T (a multiple of 16 up to 64, so a row's
# scores fit one accumulator; GLM-5.1 has 32, DeepSeek-V3.2 64).
HEADS = (32, 64)
# Channels of q_index and k_index: the K of S^T, the M of dQ^T, two dK chunks.
HEAD_DIM = 128
# Slots a tile: wgmma's M for S^T and dK (one warpgroup's tile height) and the K of dQ^T. The
# Triton kernel's tile too, so a row's slots split the same way.
BLOCK_N = 64
# Channels of one dK product: RED_LAYOUT's [64 x 64] chunk, 32 fp32 registers a thread.
DK_CHUNK = gl.constexpr(64)
# The clamp of the target's log in the KL terms.
_EPS = gl.constexpr(INDEXER_LOSS_EPS)
# Key tiles in flight a consumer. A tile is 16 KiB of key rows (plus 0.5-0.75 KiB of target and
# indices); with two consumers' double-buffered queries (16 KiB each at 64 heads) and G^T tiles
# three stages take 181 KiB of the 227 a block may have (compiled for sm_90a: 185,512 B at 64
# heads, 143,528 B at 32, int32 indices): the gathers are L2 / DRAM latency bound, so the
# deepest ring that fits, with room left for the compiler's scratch.
NUM_STAGES = 3
# A consumer's query buffers: the producer loads the next row's q while the consumer still
# multiplies with the last one's, so a row starts without waiting for its q.
Q_BUFFERS = 2
# Partitions: consumer 0 is the default one (the kernel's num_warps), consumer 1 and the
# producer are workers. A consumer holds dQ^T (H fp32 registers), the dw partial sums and S^T
# (H / 2 each), one dK chunk (32) and the tile's row addresses; the producer a tile's row
# addresses and slot values. 2 x 232 + 40 = 504: the 3 x 168 a thread the SM's 64K registers
# allow three warpgroups (setmaxnreg moves registers within that).
CONSUMER_WARPS = 4
PRODUCER_WARPS = 4
CONSUMER_REGS = 232
PRODUCER_REGS = 40
MAXNREG = 168

# mbarrier protocol (wait(bar, p) returns once the phase of parity p completed; a fresh barrier
# counts its phase of parity 1 as completed). A consumer's arrival is one thread's after the
# partition barrier; the producer's are cp.async arrivals, one a thread (counts of 128).
# Consumer c's n-th row (item n) uses query buffer c * Q_BUFFERS + n % Q_BUFFERS, round
# u = n // Q_BUFFERS; its g-th tile overall (g: the tiles of its earlier rows plus j; one pass,
# every row has n_tiles; RANGED, each row its own count, which producer and consumer both take
# from `_row_slots`) uses stage c * NUM_STAGES + g % NUM_STAGES, round v = g // NUM_STAGES.
#   q_ready[i] (128): the row's q landed; the consumer waits parity u & 1.
#   q_empty[i] (1):   the consumer's last product reading that q is done (after the row's last
#                     tile); the producer waits parity (u & 1) ^ 1 before loading into it.
#   ready[s]   (128): the tile's key rows, target values and indices landed; parity v & 1.
#   empty[s]   (1):   the consumer read the stage (dQ^T product done, slot values loaded); the
#                     producer waits parity (v & 1) ^ 1 before gathering into it.
# No barrier completes a phase twice ahead of its waiter: the producer arrives on a buffer's
# ready barrier for round v + 1 only after the empty barrier's round v, which the consumer
# arrives after its wait on ready for round v (the same for q_ready / q_empty). The producer
# serves the two consumers tile by tile in turn, and only rows that exist (a last pair may
# have one row: consumer 1's items are a prefix of consumer 0's).


@gluon.jit
def _row_coords(pid, n, P, c: gl.constexpr, T):
    """(batch, query) of consumer c's n-th row, int64: row 2 (pid + n P) + c of B x T."""
    r = (2 * (pid + n * P) + c).to(gl.int64)
    return r // T, r % T


@gluon.jit
def _items(pid, P, R, c: gl.constexpr):
    """Rows consumer c of program pid computes: pairs pid, pid + P, ... whose row c exists."""
    return gl.maximum(gl.cdiv((R - c + 1) // 2 - pid, P), 0)


@gluon.jit
def _row_slots(split_ptr, pid, n, P, c: gl.constexpr, R, s_split, pass_idx, NK, n_tiles,
               BLOCK_N: gl.constexpr, RANGED: gl.constexpr):
    """(lo, hi, first tile, tiles) of consumer c's n-th row in this launch: RANGED, the row's
    slots [lo, hi) of key pass pass_idx (`key_split.key_split`'s row, s_split its stride),
    else all NK slots; no tiles where the row does not exist (a last pair's second row)."""
    r = (2 * (pid + n * P) + c).to(gl.int64)
    exists = r < R
    if RANGED:
        at = split_ptr + gl.where(exists, r, 0) * s_split + pass_idx
        lo = gl.load(at)
        hi = gl.load(at + 1)
        j0 = lo // BLOCK_N
        tiles = gl.where(exists & (hi > lo), gl.cdiv(hi, BLOCK_N) - j0, 0)
    else:
        lo = 0
        hi = NK
        j0 = 0
        tiles = gl.where(exists, n_tiles, 0)
    return lo, hi, j0, tiles


@gluon.jit
def _row_end(split_ptr, pid, n, P, c: gl.constexpr, s_split, NK, RANGED: gl.constexpr):
    """Where consumer c's n-th row (one that exists) ends its slots over all passes: RANGED,
    the count of its valid slots (`key_split`'s last column), else NK."""
    if RANGED:
        r = (2 * (pid + n * P) + c).to(gl.int64)
        return gl.load(split_ptr + r * s_split + (s_split - 1))
    else:
        return NK


@gluon.jit
def _producer(q_ptr, k_ptr, idx_ptr, p_ptr, split_ptr, q_s, k_s, pv_s, ix_s, bars, pid, P, R,
              T, NK, n_tiles, s_split, pass_idx, sqb, sqt, sqh, skb, sks, sib, sit, sik, spb,
              spt, spk, H: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr, RANGED: gl.constexpr,
              WARPS: gl.constexpr):
    """Each row's q, then its tiles, both consumers' in turn. A slot is gathered only where p
    marks it valid (the rest zero-filled, so -1 and invisible indices are never read) and, with
    RANGED, where it lies in the row's slots of this pass; the target values and indices are
    copied as they are (past NK zero-filled: the consumers mask by NK and the pass). The two
    consumers' rows may have different tile counts (RANGED): each ring's position is counted
    (g0, g1)."""
    q_ready, q_empty, ready, empty = bars
    # A warp covers 4 rows x 64 channels in 16-byte vectors (one swizzle atom a row).
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, ld_layout)
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    heads = gl.arange(0, H, layout=row_l).to(gl.int64)
    every = gl.full([H], 1, gl.int1, layout=row_l)
    slots = gl.arange(0, BLOCK_N, layout=row_l)
    vslots = gl.arange(0, BLOCK_N, layout=vec_l)
    g0 = 0
    g1 = 0
    for n in range(_items(pid, P, R, 0)):
        qi = n % Q_BUFFERS
        qph = ((n // Q_BUFFERS) & 1) ^ 1
        lo0, hi0, j00, tiles0 = _row_slots(split_ptr, pid, n, P, 0, R, s_split, pass_idx, NK,
                                           n_tiles, BLOCK_N, RANGED)
        lo1, hi1, j01, tiles1 = _row_slots(split_ptr, pid, n, P, 1, R, s_split, pass_idx, NK,
                                           n_tiles, BLOCK_N, RANGED)
        for c in gl.static_range(2):
            if n < _items(pid, P, R, c):
                b, t = _row_coords(pid, n, P, c, T)
                # A row without tiles in this pass (RANGED) only passes its buffer through:
                # its q is zero-filled, not read.
                if c == 0:
                    has_tiles = tiles0 > 0
                else:
                    has_tiles = tiles1 > 0
                mbarrier.wait(q_empty.index(c * Q_BUFFERS + qi), qph)
                gather_rows(q_s.index(c * Q_BUFFERS + qi), q_ptr + b * sqb + t * sqt + heads * sqh,
                            every & has_tiles, D, ld_layout)
                cp.mbarrier_arrive(q_ready.index(c * Q_BUFFERS + qi), increment_count=False)
        for jj in range(gl.maximum(tiles0, tiles1)):
            for c in gl.static_range(2):
                if c == 0:
                    lo, hi, j, tiles, g = lo0, hi0, j00 + jj, tiles0, g0 + jj
                else:
                    lo, hi, j, tiles, g = lo1, hi1, j01 + jj, tiles1, g1 + jj
                if jj < tiles:
                    ph = ((g // NUM_STAGES) & 1) ^ 1
                    st = c * NUM_STAGES + g % NUM_STAGES
                    b, t = _row_coords(pid, n, P, c, T)
                    idx_base = idx_ptr + b * sib + t * sit
                    p_base = p_ptr + b * spb + t * spt
                    offs = j * BLOCK_N + slots
                    inside = offs < NK
                    # Loaded before the wait: their latency runs under it.
                    pv = gl.load(p_base + offs * spk, mask=inside, other=-1.0)
                    idx = gl.load(idx_base + offs * sik, mask=inside, other=0)
                    valid = pv >= 0.0
                    if RANGED:
                        valid = valid & (offs >= lo) & (offs < hi)
                    rows = k_ptr + b * skb + gl.where(valid, idx, 0).to(gl.int32) * sks
                    voffs = j * BLOCK_N + vslots
                    vin = voffs < NK
                    mbarrier.wait(empty.index(st), ph)
                    gather_rows(k_s.index(st), rows, valid, D, ld_layout)
                    cp.async_copy_global_to_shared(pv_s.index(st), p_base + voffs * spk, mask=vin)
                    cp.async_copy_global_to_shared(ix_s.index(st), idx_base + voffs * sik,
                                                   mask=vin)
                    cp.mbarrier_arrive(ready.index(st), increment_count=False)
        g0 += tiles0
        g1 += tiles1


@gluon.jit
def _dk_chunk(g_t, q_part, col0, rows, valid, acc_layout: gl.constexpr, KEYS: gl.constexpr,
              DISCARD: gl.constexpr):
    """dK's chunk G^T q[:, col0:col0 + 64] [KEYS x 64] added into the key rows (`rows`: their
    addresses, `valid`: which slots add; both in RED_LAYOUT's row slice) with 16-byte fp32
    atomics (`sparse_mla_bwd_sm90.RED_LAYOUT`). DISCARD (measurement only): each row's sum
    of the chunk added into its first channel instead, one scalar atomic a row (64 times
    fewer), the products kept."""
    acc = gl.zeros([KEYS, DK_CHUNK], gl.float32, layout=acc_layout)
    acc = warpgroup_mma(g_t, q_part, acc, use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    acc = gl.convert_layout(acc, RED_LAYOUT)
    if DISCARD:
        gl.atomic_add(rows + col0, gl.sum(acc, axis=1), mask=valid, sem="relaxed")
    else:
        cols = gl.arange(0, DK_CHUNK, layout=gl.SliceLayout(0, RED_LAYOUT))
        mask = valid[:, None] & gl.full([KEYS, DK_CHUNK], 1, gl.int1, layout=RED_LAYOUT)
        # The chunk's offset goes into the row addresses (as the attention backward's): the
        # channels stay a plain range, a thread's four neighbours one vector atomic.
        gl.atomic_add((rows + col0)[:, None] + cols[None, :], acc, mask=mask, sem="relaxed")


@gluon.jit
def _consumer(c: gl.constexpr, q_s, k_s, pv_s, ix_s, g_s, bars, w_ptr, lse_ptr, psum_ptr,
              grad_ptr, coeff, dq_ptr, dw_ptr, dq_out_ptr, dw_out_ptr, dk_ptr, kl_ptr, sync_ptr,
              split_ptr, pid, P, R,
              T, NK, n_tiles, s_split, pass_idx, swb, swt, swh, slb, slt, ssb, sst, sdqb, sdqt,
              sdqh, sdwb, sdwt, sdwh, sdkb, sdks, H: gl.constexpr, D: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr,
              RELU: gl.constexpr, KL: gl.constexpr, DISCARD: gl.constexpr,
              LOCKSTEP: gl.constexpr, SYNC_SLACK: gl.constexpr, SYNC_SPINS: gl.constexpr,
              RANGED: gl.constexpr):
    """Rows 2 (pid + n P) + c, n = 0, 1, ...: per tile S^T, the slot gradients g, dw, G^T,
    dQ^T and the dK additions (KL: and the slots' KL terms); at a row's end dq and dw stored
    (owned: no atomics), KL: the row's KL too. LOCKSTEP: row n is in wave n (counter sync_ptr +
    n), whose rows are 2 n P .. 2 (n + 1) P - 1 of the R (fewer in a last partial wave, and
    one fewer where a last pair has one row): both consumers of every program count there.
    Before tile j the consumer counts its start, then waits (at most SYNC_SPINS reads) until
    the count holds the starts of all of the wave's rows at tile j - SYNC_SLACK (a total: a
    fast row's extra starts count too). Every row has n_tiles tiles, so the count it waits for
    is one that every row of the wave makes; a pace, not a dependency (nothing counted is
    read), so giving up is safe. RANGED: only the row's slots of key pass pass_idx
    (`_row_slots`; not with LOCKSTEP, whose count assumes equal tiles), a row whose slots span
    passes summed in the fp32 buffers dq_ptr, dw_ptr and kl_ptr until its last pass with slots
    writes dq_out_ptr, dw_out_ptr (the outputs, the buffers' strides; one pass: the outputs
    themselves)."""
    q_ready, q_empty, ready, empty = bars
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DK_CHUNK, 16])
    key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    head_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    red_row: gl.constexpr = gl.SliceLayout(1, RED_LAYOUT)
    dtype: gl.constexpr = q_s.dtype

    heads = gl.arange(0, H, layout=head_l)
    slots = gl.arange(0, BLOCK_N, layout=key_l)
    slots_k = gl.arange(0, BLOCK_N, layout=red_row)
    chans = gl.arange(0, D, layout=key_l)  # dQ^T's rows: s_layout over [D x H]
    s_zero = gl.zeros([BLOCK_N, H], gl.float32, layout=s_layout)
    g_scale = gl.load(grad_ptr).to(gl.float32) * coeff
    g_t = g_s.index(c)

    g_first = 0  # the row's first position in the consumer's ring
    for n in range(_items(pid, P, R, c)):
        b, t = _row_coords(pid, n, P, c, T)
        lo, hi, j0, tiles = _row_slots(split_ptr, pid, n, P, c, R, s_split, pass_idx, NK,
                                       n_tiles, BLOCK_N, RANGED)
        end = _row_end(split_ptr, pid, n, P, c, s_split, NK, RANGED)
        w = gl.load(w_ptr + b * swb + t * swt + heads * swh).to(gl.float32)
        lse = gl.load(lse_ptr + b * slb + t * slt)
        psum = gl.load(psum_ptr + b * ssb + t * sst)
        dk_base = dk_ptr + b * sdkb
        dq_t = gl.zeros([D, H], gl.float32, layout=s_layout)
        dw_part = gl.zeros([BLOCK_N, H], gl.float32, layout=s_layout)
        if KL:
            # The row's KL terms slot by slot (two fp32 registers a thread), reduced at its end.
            kl_part = gl.zeros([BLOCK_N], gl.float32, layout=key_l)
        if LOCKSTEP:
            wave_ptr = sync_ptr + n
            wave_rows = gl.minimum(2 * P, R - 2 * n * P)
        qi = c * Q_BUFFERS + n % Q_BUFFERS
        mbarrier.wait(q_ready.index(qi), (n // Q_BUFFERS) & 1)
        for jj in range(tiles):
            j = j0 + jj
            if LOCKSTEP:
                # One count a consumer (the replicated scalar's atomic runs once).
                gl.atomic_add(wave_ptr, 1, sem="relaxed")
                if j >= SYNC_SLACK:
                    lockstep_wait(wave_ptr, wave_rows * (j - SYNC_SLACK + 1), SYNC_SPINS)
            g = g_first + jj
            st = c * NUM_STAGES + g % NUM_STAGES
            # Indexed with an opaque zero: the query's wgmma descriptors stay in the loop
            # (`gluon_common.opaque_zero`).
            q_row = q_s.index(qi + opaque_zero(j))
            k_t = k_s.index(st)
            mbarrier.wait(ready.index(st), (g // NUM_STAGES) & 1)
            # The rows came through cp.async (generic proxy); wgmma reads them through the
            # async proxy.
            fence_async_shared()
            s = warpgroup_mma(k_t, q_row.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # The slot values, in the scores' and the atomics' layouts, under the product.
            pn = pv_s.index(st).load(key_l)
            offs = j * BLOCK_N + slots
            offs_k = j * BLOCK_N + slots_k
            valid = (pn >= 0.0) & (offs < NK)
            valid_k = (pv_s.index(st).load(red_row) >= 0.0) & (offs_k < NK)
            if RANGED:
                valid = valid & (offs >= lo) & (offs < hi)
                valid_k = valid_k & (offs_k >= lo) & (offs_k < hi)
            idx_k = ix_s.index(st).load(red_row)
            # 32-bit row offsets (the wrapper checks S x D < 2^31): a 64-bit product needs the
            # stride's sign word, which ptxas hoisted out of the partition and spilled.
            rows = dk_base + gl.where(valid_k, idx_k, 0).to(gl.int32) * sdks
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

            if RELU:
                act = gl.maximum(s, 0.0)
            else:
                act = s
            score = gl.sum(act * w[None, :], axis=1)
            if KL:
                # `indexer_loss._kl_terms`' terms, before the products (the scores not held
                # across them).
                term = pn * (gl.log(gl.maximum(pn, _EPS)) - (score - lse))
                kl_part += gl.where(valid, term, 0.0)
            # -inf at invalid slots: their score is from a zeroed key row (`_grad_step`).
            prob = gl.exp(gl.where(valid, score - lse, float("-inf")))
            gj = gl.where(valid, (prob * psum - pn) * g_scale, 0.0)
            dw_part += act * gj[:, None]
            g_l = w[None, :] * gj[:, None]
            if RELU:
                # ReLU'(0) = 0, as torch's; act > 0 where S > 0 (S itself need not stay live).
                g_l = gl.where(act > 0.0, g_l, 0.0)
            g_t.store(g_l.to(dtype))
            fence_async_shared()

            # dQ^T [D x H] += K^T G^T; the first dK chunk behind it.
            dq_t = warpgroup_mma(k_t.permute((1, 0)), g_t, dq_t, is_async=True)
            dq_t = warpgroup_mma_wait(num_outstanding=0, deps=(dq_t,))
            mbarrier.arrive(empty.index(st), count=1)
            _dk_chunk(g_t, q_row.slice(0, DK_CHUNK, dim=1), 0, rows, valid_k, dk_layout,
                      BLOCK_N, DISCARD)
            _dk_chunk(g_t, q_row.slice(DK_CHUNK, DK_CHUNK, dim=1), DK_CHUNK, rows, valid_k,
                      dk_layout, BLOCK_N, DISCARD)
        g_first += tiles
        # The row's last reader of its q is done: the producer may load a later row's.
        mbarrier.arrive(q_empty.index(qi), count=1)

        dw_off = b * sdwb + t * sdwt + heads * sdwh
        dq_off = b * sdqb + t * sdqt + heads[None, :] * sdqh + chans[:, None]
        dw_row = gl.sum(dw_part, axis=0)
        # kl is the wrapper's contiguous fp32 [B, T]: no strides held across the row.
        kl_at = kl_ptr + b * T + t
        if RANGED:
            # The row's first pass with slots stores, a later one adds into the fp32 buffers,
            # and its last pass with slots writes the outputs; a row with no slot at all gets
            # zeros from pass 0. Only rows whose slots span passes go through the buffers. Four
            # plain branches (each one read-add-write or one write): a branch that yields the
            # MMA-layout dq to a shared store spills it.
            if (tiles > 0) | ((end == 0) & (pass_idx == 0)):
                if hi >= end:  # no slots in later passes: the outputs
                    if lo > 0:  # slots in earlier passes: their sums added
                        gl.store(dw_out_ptr + dw_off, (gl.load(dw_ptr + dw_off) + dw_row).to(
                            dw_out_ptr.dtype.element_ty))
                        gl.store(dq_out_ptr + dq_off, (gl.load(dq_ptr + dq_off) + dq_t).to(
                            dq_out_ptr.dtype.element_ty))
                    else:
                        gl.store(dw_out_ptr + dw_off, dw_row.to(dw_out_ptr.dtype.element_ty))
                        gl.store(dq_out_ptr + dq_off, dq_t.to(dq_out_ptr.dtype.element_ty))
                else:
                    if lo > 0:
                        gl.store(dw_ptr + dw_off, gl.load(dw_ptr + dw_off) + dw_row)
                        gl.store(dq_ptr + dq_off, gl.load(dq_ptr + dq_off) + dq_t)
                    else:
                        gl.store(dw_ptr + dw_off, dw_row)
                        gl.store(dq_ptr + dq_off, dq_t)
                if KL:
                    kl_row = gl.sum(kl_part, axis=0) + gl.load(kl_at, mask=lo > 0, other=0.0)
                    gl.store(kl_at, kl_row)
        else:
            gl.store(dw_out_ptr + dw_off, dw_row.to(dw_out_ptr.dtype.element_ty))
            gl.store(dq_out_ptr + dq_off, dq_t.to(dq_out_ptr.dtype.element_ty))
            if KL:
                gl.store(kl_at, gl.sum(kl_part, axis=0))


# pass_idx not specialized: every key pass runs one compiled kernel (Triton would make 0, 1
# and the rest three).
@gluon.jit(do_not_specialize=["pass_idx"])
def _indexer_loss_bwd_kernel(
    q_ptr, w_ptr, k_ptr, idx_ptr, p_ptr, lse_ptr, psum_ptr, grad_ptr, coeff,
    dq_ptr, dw_ptr, dq_out_ptr, dw_out_ptr, dk_ptr, kl_ptr, sync_ptr, split_ptr, P, R, T, NK,
    n_tiles, s_split, pass_idx,
    sqb, sqt, sqh, swb, swt, swh, skb, sks, sib, sit, sik, spb, spt, spk, slb, slt, ssb, sst,
    sdqb, sdqt, sdqh, sdwb, sdwt, sdwh, sdkb, sdks,
    H: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    Q_BUFFERS: gl.constexpr, RELU: gl.constexpr, KL: gl.constexpr, DISCARD: gl.constexpr,
    LOCKSTEP: gl.constexpr, SYNC_SLACK: gl.constexpr, SYNC_SPINS: gl.constexpr,
    RANGED: gl.constexpr,
    q_sl: gl.constexpr, k_sl: gl.constexpr, g_sl: gl.constexpr,
    CONSUMER_WARPS: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """dq, dw of the program's rows (R = B x T of them, taken two at a time, every P-th pair)
    and their dk additions; KL: also each row's KL into kl_ptr (contiguous [B, T]). LOCKSTEP: the
    consumers paced by the waves' zeroed int32 counters in sync_ptr (`_consumer`), SYNC_SLACK
    >= 1. RANGED: key pass pass_idx of the rows' slots in split_ptr (int32, row stride
    s_split), dq, dw summed in the fp32 dq_ptr, dw_ptr and written to dq_out_ptr, dw_out_ptr
    (their strides) at each row's last pass with slots (one pass: the same tensors). Unit-stride
    channels of q, k, dq; row strides of q and k multiples of 16 elements (the wrapper
    checks)."""
    pid = gl.program_id(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_s = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS, H, D], q_sl)
    k_s = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, BLOCK_N, D], k_sl)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    pv_s = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, BLOCK_N], vec_sl)
    ix_s = gl.allocate_shared_memory(idx_ptr.dtype.element_ty, [2 * NUM_STAGES, BLOCK_N],
                                     vec_sl)
    g_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, H], g_sl)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFFERS, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFFERS, 1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], bar_layout)
    producer_threads: gl.constexpr = PRODUCER_WARPS * 32
    for i in gl.static_range(2 * Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=producer_threads)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(2 * NUM_STAGES):
        mbarrier.init(ready.index(i), count=producer_threads)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    bars = (q_ready, q_empty, ready, empty)
    # Each partition's arguments written out: constexprs gathered into a tuple variable first
    # would reach the partitions as runtime values.
    gl.warp_specialize([
        (_consumer, (0, q_s, k_s, pv_s, ix_s, g_s, bars, w_ptr, lse_ptr, psum_ptr, grad_ptr,
                     coeff, dq_ptr, dw_ptr, dq_out_ptr, dw_out_ptr, dk_ptr, kl_ptr, sync_ptr,
                     split_ptr, pid, P, R, T, NK, n_tiles, s_split, pass_idx, swb, swt, swh,
                     slb, slt, ssb, sst, sdqb, sdqt, sdqh, sdwb, sdwt, sdwh, sdkb, sdks, H, D,
                     BLOCK_N, NUM_STAGES, Q_BUFFERS, RELU, KL, DISCARD, LOCKSTEP, SYNC_SLACK,
                     SYNC_SPINS, RANGED)),
        (_consumer, (1, q_s, k_s, pv_s, ix_s, g_s, bars, w_ptr, lse_ptr, psum_ptr, grad_ptr,
                     coeff, dq_ptr, dw_ptr, dq_out_ptr, dw_out_ptr, dk_ptr, kl_ptr, sync_ptr,
                     split_ptr, pid, P, R, T, NK, n_tiles, s_split, pass_idx, swb, swt, swh,
                     slb, slt, ssb, sst, sdqb, sdqt, sdqh, sdwb, sdwt, sdwh, sdkb, sdks, H, D,
                     BLOCK_N, NUM_STAGES, Q_BUFFERS, RELU, KL, DISCARD, LOCKSTEP, SYNC_SLACK,
                     SYNC_SPINS, RANGED)),
        (_producer, (q_ptr, k_ptr, idx_ptr, p_ptr, split_ptr, q_s, k_s, pv_s, ix_s, bars, pid,
                     P, R, T, NK, n_tiles, s_split, pass_idx, sqb, sqt, sqh, skb, sks, sib,
                     sit, sik, spb, spt, spk, H, D, BLOCK_N, NUM_STAGES, Q_BUFFERS, RANGED,
                     PRODUCER_WARPS)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------- launch


def variant(q_index: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
            relu: bool, with_kl: bool = False, lockstep: bool = False,
            lockstep_slack: int = 1, mode: int = MODE_ATOMIC, key_passes: int = 1) -> tuple:
    """The compiled variant a call needs: what a failure disables (lockstep: with its slack,
    a constexpr; mode: MODE_DISCARD's measurement compiles another kernel, whose failure must
    not disable the gradients' one; key passes: the RANGED kernels)."""
    return (q_index.dtype, q_index.shape[2], weights.dtype, indices.dtype, bool(relu),
            bool(with_kl), lockstep_slack if lockstep else 0, mode, key_passes > 1)


def _layout_problem(name: str, x: torch.Tensor, rows: tuple[int, ...]) -> str | None:
    """Why x's rows cannot be copied 16 bytes at a time, or None (no strides in the text: one
    warning a cause, whatever the shape)."""
    if x.stride(-1) != 1 or any(st % STRIDE_MULTIPLE for st in rows):
        return f"{name}'s rows are not multiples of {STRIDE_MULTIPLE} unit-stride elements"
    if x.data_ptr() % 16:
        return f"{name} is not 16-byte aligned"
    return None


def applies(q_index: torch.Tensor, k_index: torch.Tensor, *, deterministic: bool = False,
            mode: int = MODE_ATOMIC, lockstep: bool = False,
            failed: tuple | None = None) -> bool:
    """Whether the kernel is meant for this call: bf16 index heads of a count it takes, on a
    Hopper GPU, the default accumulation mode (or MODE_DISCARD's measurement), paced or not
    (lockstep: the kernel's LOCKSTEP), and its compiled variant (`failed`: the call's
    `variant`) not failed earlier in this process (that failure warned once). Where it is not,
    the Triton kernel runs without a word (another model, device or mode); where it is but
    `unsupported` names a reason, after one warning."""
    del lockstep  # both forms are the kernel's
    return (not deterministic and mode in (MODE_ATOMIC, MODE_DISCARD)
            and q_index.dtype == torch.bfloat16 and k_index.dtype == torch.bfloat16
            and q_index.dim() == 4 and q_index.shape[2] in HEADS
            and q_index.shape[3] == HEAD_DIM and common.on_hopper(q_index)
            and failed not in _disabled)


def unsupported(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor,
                indices: torch.Tensor, p: torch.Tensor, lse: torch.Tensor, psum: torch.Tensor,
                *, relu: bool = True, deterministic: bool = False, with_kl: bool = False,
                mode: int = MODE_ATOMIC, lockstep: bool = False, lockstep_slack: int = 1,
                key_passes: int = 1) -> str | None:
    """Why `indexer_loss_bwd_sm90` cannot take this call (the Triton kernel's then), or None.
    The options first, then dtypes, shapes and layouts, then the device: on a CPU tensor a call
    that would otherwise run says so last. with_kl and lockstep either way (the kernel sums the
    row KL, and paces its programs with LOCKSTEP)."""
    if deterministic:
        return "deterministic=True (dk's fixed-point mode is the Triton kernel's)"
    if mode not in (MODE_ATOMIC, MODE_DISCARD):
        return f"mode={mode} (MODE_ATOMIC's fp32 atomics, or MODE_DISCARD's measurement)"
    if key_passes > 1 and lockstep:
        return "bwd_key_passes > 1 with bwd_lockstep (the pace counts equal tiles a row)"
    if q_index.dtype != torch.bfloat16 or k_index.dtype != torch.bfloat16:
        return f"q_index / k_index dtypes {q_index.dtype} / {k_index.dtype} (bf16 only)"
    if weights.dtype not in (torch.float32, torch.bfloat16):
        return f"weights dtype {weights.dtype} (fp32 or bf16)"
    if indices.dtype not in (torch.int32, torch.int64):
        return f"indices dtype {indices.dtype} (int32 or int64)"
    if any(x.dtype != torch.float32 for x in (p, lse, psum)):
        return "p, lse and psum must be fp32"
    if q_index.dim() != 4 or q_index.shape[2] not in HEADS:
        return f"index heads {tuple(q_index.shape)[2:3]} (one of {HEADS})"
    if q_index.shape[3] != HEAD_DIM or k_index.shape[-1] != HEAD_DIM:
        return (f"head dims {q_index.shape[3]} / {k_index.shape[-1]} of q_index / k_index "
                f"({HEAD_DIM} only)")
    for problem in (_layout_problem("q_index", q_index, kernel_strides(q_index, 3)),
                    _layout_problem("k_index", k_index, kernel_strides(k_index, 2))):
        if problem is not None:
            return problem
    if k_index.shape[1] * max(k_index.stride(1), HEAD_DIM) >= 2**31:
        return "k_index: a batch's key rows must lie within 2^31 elements"
    if not q_index.is_cuda:
        return f"tensors on {q_index.device} (a CUDA device only)"
    if torch.cuda.get_device_capability(q_index.device)[0] != 9:
        return "not a Hopper GPU (sm_90a only)"
    key = variant(q_index, weights, indices, relu, with_kl, lockstep, lockstep_slack, mode,
                  key_passes)
    if key in _disabled:
        return f"variant {key} failed earlier"
    return None


_layouts: dict[int, tuple] = {}


def _shared_layouts(heads: int) -> tuple:
    """NVMMA layouts of a query [H x D], a key tile [BLOCK_N x D] and a G^T tile [BLOCK_N x H]."""
    if heads not in _layouts:
        nv = gl.NVMMASharedLayout.get_default_for
        _layouts[heads] = (nv([heads, HEAD_DIM], gl.bfloat16),
                           nv([BLOCK_N, HEAD_DIM], gl.bfloat16), nv([BLOCK_N, heads], gl.bfloat16))
    return _layouts[heads]


def indexer_loss_bwd_sm90(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor,
                          indices: torch.Tensor, p: torch.Tensor, lse: torch.Tensor,
                          psum: torch.Tensor, grad: torch.Tensor, coeff: float, relu: bool,
                          with_kl: bool = False, discard: bool = False, lockstep: bool = False,
                          lockstep_slack: int = 1, key_passes: int = 1
                          ) -> tuple[torch.Tensor, ...]:
    """(dq_index, dweights, dk_index), with with_kl also the row KL fp32 [B, T], on a call
    `unsupported` accepts (see the module docstring); `indexer_loss.indexer_loss_bwd`'s
    contract without its options. discard (measurement only, `indexer_loss_bwd`'s
    MODE_DISCARD): the same products with one scalar atomic a key row and chunk instead of dk's
    128; the third output then is that fp32 [B, S, D] buffer, not a gradient. lockstep: the
    programs of a wave paced within lockstep_slack key tiles of each other (an int >= 1, else
    ValueError; `common.lockstep_plan`), on zeroed counters, one a wave; the same results up to
    fp32 rounding order. key_passes > 1 (`IndexerLossKernelOptions.bwd_key_passes`; each row's
    valid slots first, -1 after, which the results need, in increasing key order, which the
    gain needs; not with lockstep): one launch
    a key range of S / key_passes keys, each row's slots of that range only, so the live part
    of the fp32 dk accumulator is 1 / key_passes of it; the dq and dw of a row whose slots
    span passes summed in fp32 buffers (B x T x H x D x 4 bytes more) and cast into the
    outputs by its last pass with slots."""
    B, T, H, D = q_index.shape
    NK = indices.shape[-1]
    dev = q_index.device
    if isinstance(key_passes, bool) or not isinstance(key_passes, int) or key_passes < 1:
        raise ValueError(f"key_passes must be an int >= 1, got {key_passes!r}")
    if key_passes > 1 and lockstep:
        raise ValueError("key_passes > 1 does not pace (lockstep=False)")
    dq, dw, dk_acc = common.indexer_grad_buffers(q_index, weights, k_index)
    # Without the KL lse stands in for its buffer (never written: KL is a constexpr).
    kl = torch.empty((B, T), device=dev, dtype=torch.float32) if with_kl else lse
    rows = B * T
    if rows == 0:
        dk = dk_acc.to(k_index.dtype)
        return (dq, dw, dk, kl) if with_kl else (dq, dw, dk)
    # With passes, rows that span them add into fp32 buffers (fp32 weights' dw already is one);
    # one pass stores the outputs directly.
    dq_out, dw_out = dq, dw
    if key_passes > 1:
        dq = torch.empty(dq.shape, device=dev, dtype=torch.float32)
        dw = dw if dw.dtype == torch.float32 else torch.empty(dw.shape, device=dev,
                                                             dtype=torch.float32)
    grad = grad.detach().reshape(1).to(device=dev, dtype=torch.float32)
    # One program an SM (its 12 warps take the SM's registers), each over pairs of rows; in
    # lockstep a wave is the programs' n-th pairs, one zeroed counter each (unpaced: lse stands
    # in for the counters, never read).
    if lockstep:
        programs, sync = lockstep_plan(triton.cdiv(rows, 2), dev, lockstep_slack)
    else:
        programs, sync = min(triton.cdiv(rows, 2), common.sm_count(dev)), lse
    q_sl, k_sl, g_sl = _shared_layouts(H)
    # One pass: the split is never read (lse stands in for it).
    split = key_split(indices, k_index.shape[1], key_passes) if key_passes > 1 else lse
    for pass_idx in range(key_passes):
        _indexer_loss_bwd_kernel[(programs,)](
            q_index, weights, k_index, indices, p, lse, psum, grad, float(coeff), dq, dw,
            dq_out, dw_out, dk_acc, kl, sync, split, programs, rows, T, NK,
            triton.cdiv(NK, BLOCK_N), key_passes + 1, pass_idx,
            *kernel_strides(q_index, 3), *weights.stride(), *kernel_strides(k_index, 2),
            *indices.stride(), *p.stride(), *lse.stride(), *psum.stride(), *dq.stride()[:3],
            *dw.stride(), *dk_acc.stride()[:2],
            H=H, D=D, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, Q_BUFFERS=Q_BUFFERS,
            RELU=bool(relu), KL=bool(with_kl), DISCARD=bool(discard), LOCKSTEP=bool(lockstep),
            SYNC_SLACK=lockstep_slack if lockstep else 1, SYNC_SPINS=SYNC_SPINS,
            RANGED=key_passes > 1,
            q_sl=q_sl, k_sl=k_sl, g_sl=g_sl, CONSUMER_WARPS=CONSUMER_WARPS,
            PRODUCER_WARPS=PRODUCER_WARPS, CONSUMER_REGS=CONSUMER_REGS,
            PRODUCER_REGS=PRODUCER_REGS, num_warps=CONSUMER_WARPS, maxnreg=MAXNREG,
        )
    dk = dk_acc if discard else dk_acc.to(k_index.dtype)
    return (dq_out, dw_out, dk, kl) if with_kl else (dq_out, dw_out, dk)


def run_if_supported(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor,
                     indices: torch.Tensor, p: torch.Tensor, lse: torch.Tensor,
                     psum: torch.Tensor, grad: torch.Tensor, coeff: float, relu: bool, *,
                     deterministic: bool, with_kl: bool, mode: int, lockstep: bool,
                     lockstep_slack: int = 1, key_passes: int = 1
                     ) -> tuple[torch.Tensor, ...] | None:
    """`indexer_loss_bwd_sm90`'s gradients (with_kl: and the row KL, `indexer_loss_bwd`'s four
    outputs), or None: silently where it does not apply (`applies`), after one warning per
    cause where it applies but cannot run (`unsupported`) or its variant fails to compile or
    launch (not tried again). lockstep, lockstep_slack, key_passes: `IndexerLossKernelOptions.
    bwd_lockstep`, `bwd_lockstep_slack` and `bwd_key_passes` (the caller passes 1 where the
    rows' keys are not known to increase); where the key passes' variant failed (now or
    earlier, one warning), one pass runs."""
    if key_passes > 1 and variant(q_index, weights, indices, relu, with_kl, lockstep,
                                  lockstep_slack, mode, key_passes) in _disabled:
        key_passes = 1
    key = variant(q_index, weights, indices, relu, with_kl, lockstep, lockstep_slack, mode,
                  key_passes)
    if not applies(q_index, k_index, deterministic=deterministic, mode=mode, lockstep=lockstep,
                   failed=key):
        return None
    why = unsupported(q_index, weights, k_index, indices, p, lse, psum, relu=relu,
                      deterministic=deterministic, with_kl=with_kl, mode=mode, lockstep=lockstep,
                      lockstep_slack=lockstep_slack, key_passes=key_passes)
    if why is not None:
        warn_cannot_run(why)
        return None
    try:
        return indexer_loss_bwd_sm90(q_index, weights, k_index, indices, p, lse, psum, grad,
                                     coeff, relu, with_kl, discard=mode == MODE_DISCARD,
                                     lockstep=lockstep, lockstep_slack=lockstep_slack,
                                     key_passes=key_passes)
    except torch.OutOfMemoryError:
        raise  # not the kernel's failure: the Triton kernel would need the same memory
    except Exception as exc:  # this variant failed to compile or launch: say so, keep training
        disable(key, f"{type(exc).__name__}: {exc}")
        if key_passes == 1:
            return None
        return run_if_supported(q_index, weights, k_index, indices, p, lse, psum, grad, coeff,
                                relu, deterministic=deterministic, with_kl=with_kl, mode=mode,
                                lockstep=lockstep, lockstep_slack=lockstep_slack)


# Variants (`variant`) that failed to compile or launch in this process (`applies` passes them
# over), and the warnings when the kernel cannot run.
_variants = KernelVariants("indexer-loss-bwd-sm90", "Hopper indexer-loss backward",
                           "Triton backward")
_disabled = _variants.disabled
warn_cannot_run = _variants.warn_cannot_run
disable = _variants.disable

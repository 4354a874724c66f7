"""The DSA indexer's causal row maxima on Hopper (sm_90a): a warp-specialized Gluon kernel.

Shapes: q bf16 [B, T, H, D] (D = 128, H = 32 or 64), k bf16 [B, S, D] (one key head, S == T),
w fp32 [B, T, H]. out fp32 [B, T]: out[b, t] = max over s <= t of
score[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h] . k[b, s]), fp32 accumulation. Without
ReLU (relu=False) q is the folded query's bf16 parts (H = 4: three parts and a zero one, w 1
and 0; `hytopk.bf16_parts`) and the score their weighted sum of products. The scoring
cost of HyTopK alone (`hytopk.MODE_SCORES_ONLY`), with the compute split FA3-style. Or e4m3 q and
k (`ops/fp8_quant.py`: HyTopK's precision="fp8"): fp8 products, w the head weights times q's
per-(token, head) scale, k_scale fp32 [B, S] multiplying each key's head sum (the scales are
powers of two: they leave the ReLU).

`indexer_filter_sm90` runs the same products with another epilogue (FILTER): each visible score
at or above its row's threshold is appended to the row's survivor list as HyTopK's packed int64
key (score, then the smaller index), a relaxed atomic counter a row or a scan over the key
tile giving the slot (slots past a row's survivors are left unwritten); the threshold comes
from the caller (`kernels/hytopk_sm90.py` samples it), the exact top-k of the survivors is
the caller's.

`indexer_table_sm90` runs them with a third epilogue (TABLE): each visible score into a table
fp32 [B, rows, keys], against every key_stride-th key of the sequence (k the sampled keys,
key j at position j x key_stride): HyTopK on the Gluon scores' sampled thresholds.

Algorithm: one program per 2 x ROWS query rows. A one-warp producer streams the key tiles through
a shared-memory ring (TMA, mbarriers); two consumer warpgroups each own ROWS rows (their heads on
the wgmma's N, the keys on M) and multiply the same tiles, so one consumer's ReLU x weight x
head-sum epilogue runs while the other's wgmma does.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megatron_hyscale.ops.checks import check_same_device, check_tensor
from megatron_hyscale.ops.kernels.common import MAX_TMA_ROWS
from megatron_hyscale.ops.kernels.options import HyTopKOptions, check_stages

# Head dimension: the wgmma's K (8 k-steps of 16).
HEAD_DIM = 128
# (query row, head) pairs a consumer: the wgmma's N. V3.2 (64 heads): 2 rows; GLM-5.1 (32): 4.
PAIRS = 128
# Keys a tile: the wgmma's M, one tile height for a warpgroup. The keys go on M so that the head
# sum runs along N, inside a thread and its quad (no shared memory), and each consumer keeps its
# rows' running maxima in registers as [keys x rows] until the end.
BLOCK_S = 64
# Key tiles in flight by default: HyTopKOptions.scores_sm90_stages' default, written once
# there (`check_stages` bounds a caller's). Each is 16 KiB; with the two consumers' 32 KiB
# query blocks 4 take the program to 128 KiB of shared memory: one program an SM either way
# (its 12 warps hold the SM's registers), and 4 tiles ahead are 4 x 2 products (~4K cycles)
# to hide a load behind.
NUM_STAGES = HyTopKOptions.scores_sm90_stages
# Warps: the default partition (consumer 0) is the kernel's num_warps; consumer 1 and the
# producer are workers (9 warps, padded to 3 warpgroups: registers are set by warpgroup). The
# producer only issues TMA and waits on barriers: the fewest registers setmaxnreg allows. Each
# consumer holds a 64-register accumulator, its 32 weights and the epilogue: 240, the rest of
# the 3 x 128 x MAXNREG registers after the producer's warpgroup (the default partition gets
# what is left, also 240).
CONSUMER_WARPS = 4
PRODUCER_WARPS = 1
PRODUCER_REGS = 24
CONSUMER_REGS = 240
# Registers a thread at launch, before the partitions rebalance them: 384 threads x 168 fit the
# SM's 64K.
MAXNREG = 168
HEADS = (32, 64)
# Without ReLU (`relu=False`) the head sum folds into one fp32 query a row, taken as its three
# bf16 parts plus a zero one (`hytopk.bf16_parts`), each a head of weight 1 (0 for the pad): 4
# "heads", 32 rows a consumer. The products' sum over the parts is the folded query's dot.
FOLDED_HEADS = (4,)
# The wgmma's K a k-step: 32 bytes of each operand row (bf16: 16 channels, e4m3: 32).
MMA_K_BY_DTYPE = {torch.bfloat16: 16, torch.float8_e4m3fn: 32}
# The survivors' packed keys: (score bits ordered as ints) << 32 | (LOW32 - key index), so a
# larger key is a higher score, then a smaller index (HyTopK's `_pack`).
LOW32 = gl.constexpr((1 << 32) - 1)

# mbarrier protocol. A barrier counts arrivals; its phase completes when all arrived and, after an
# `expect`, all the bytes announced landed. `wait(bar, p)` returns once the phase of parity p
# completed; a fresh barrier counts its (previous) phase of parity 1 as completed. Arrivals from a
# 4-warp consumer are one thread's, after Triton's partition barrier (bar.sync of its 128
# threads), so they follow all four warps' preceding instructions.
#   q_bar[c]  (count 1): the producer's expect (its arrival + 32 KiB) for consumer c's query
#             block; consumer c waits parity 0, once.
#   ready[i]  (count 1): the producer's expect (its arrival + 16 KiB) for the key tile in stage
#             i. Tile j (stage j % NUM_STAGES, round u = j // NUM_STAGES): the consumers wait
#             parity u & 1.
#   empty[i]  (count 2): each consumer arrives once its wgmma on stage i completed
#             (warpgroup_mma_wait). The producer waits parity (u & 1) ^ 1 before loading tile j
#             into stage i: round 0 passes at once (the fresh barrier), round u waits for both
#             consumers' release of round u - 1.
#   turn[c]   (count 1, PINGPONG only): the other consumer's arrival right after issuing its
#             wgmma for a tile. Consumer 0 issues tile j after consumer 1 issued tile j - 1
#             (turn[0], parity (j & 1) ^ 1: tile 0 passes at once), consumer 1 issues tile j
#             after consumer 0 issued tile j (turn[1], parity j & 1). The tensor core then runs
#             their products alternately, one consumer's epilogue under the other's product;
#             without it the two can settle in lockstep, both epilogues at once and the tensor
#             core idle. It orders issue only: no data depends on it.
# Every partition runs the same n_tiles iterations (a consumer whose rows end a tile earlier
# multiplies a fully masked tile), so each phase of each barrier gets all its arrivals.
# MMA_AHEAD: every partition runs the same n_loads = 2 x ceil(n_tiles / 2) + 1 tiles instead
# (the pairs, then the chain's last product); the last tile's empty phase never completes, and
# nothing waits on it. A consumer releases tile j before it waits for tile j + 1, as without. No
# barrier can complete a phase twice ahead of a waiter (which would flip the parity it waits
# for): ready[i]'s next phase needs the producer past empty[i], which needs both consumers past
# ready[i]; empty[i]'s next phase needs the next ready[i]; turn[c]'s next phase needs the other
# consumer past turn[1 - c], which needs consumer c past turn[c].


@gluon.jit
def _producer(q_desc, k_desc, q_s, k_s, bars, q_row0, q_row_cap, q_part_stride, k_row0,
              n_tiles, ROWS: gl.constexpr, H: gl.constexpr, BLOCK_S: gl.constexpr,
              NUM_STAGES: gl.constexpr, MMA_AHEAD: gl.constexpr, PART_MAJOR: gl.constexpr):
    """Both consumers' query blocks, then key tiles 0 .. n_tiles - 1 through the ring (with
    MMA_AHEAD the last one again, once or twice: `_consumer`'s padded tile and chain end).
    PART_MAJOR: a consumer's block is its ROWS rows of each part in turn (q_part_stride rows
    apart in q_desc), so that its columns run (part, row)."""
    q_bar, ready, empty, _ = bars
    for c in gl.static_range(2):
        # A block of rows all past the last token starts at that token instead: its rows are
        # never stored, and no box lies wholly outside the tensor (partly is TMA's zero fill;
        # PART_MAJOR's boxes past T read the next part's or batch's tokens, as unused).
        if PART_MAJOR:
            row = gl.minimum(q_row0 + c * ROWS, q_row_cap)
            mbarrier.expect(q_bar.index(c), H * q_desc.block_type.nbytes)
            for p in gl.static_range(H):
                tma.async_copy_global_to_shared(q_desc, [row + p * q_part_stride, 0],
                                                q_bar.index(c),
                                                q_s.index(c).slice(p * ROWS, ROWS))
        else:
            row = gl.minimum(q_row0 + c * ROWS * H, q_row_cap)
            mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row, 0], q_bar.index(c), q_s.index(c))
    n_loads = n_tiles
    if MMA_AHEAD:  # the consumers' tile pairs (an odd count's last one padded), then one more
        n_loads = (n_tiles + 1) // 2 * 2 + 1
    for j in range(n_loads):
        i = j % NUM_STAGES
        mbarrier.wait(empty.index(i), ((j // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(i), k_desc.block_type.nbytes)
        row = k_row0 + gl.minimum(j, n_tiles - 1) * BLOCK_S
        tma.async_copy_global_to_shared(k_desc, [row, 0], ready.index(i), k_s.index(i))


@gluon.jit
def _pack_key(score, index):
    """HyTopK's int64 key of (score, index); -0.0 packs as +0.0 (-0.0 + 0.0 = +0.0). An int32
    index (>= 0; `_survivors`' INDEX32) gives the low word LOW32 - index as ~index
    zero-extended: no 64-bit subtraction a key."""
    bits = (score + 0.0).to(gl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    if index.dtype == gl.int32:
        low = (~index).to(gl.uint32, bitcast=True).to(gl.int64)
    else:
        low = LOW32 - index.to(gl.int64)
    return (ordered.to(gl.int64) << 32) | low


@gluon.jit
def _survivors(s, j, rows, in_chunk, tau, BLOCK_S: gl.constexpr, flt_layout: gl.constexpr,
               INDEX32: gl.constexpr = False, VISIBLE: gl.constexpr = False):
    """Key tile j's scores s [BLOCK_S x ROWS] (rows `rows`) in flt_layout: (the scores, their
    keys' indices [BLOCK_S x ROWS], int64 or with INDEX32 int32, which are visible and >= their
    row's threshold tau). VISIBLE: every row sees the whole tile and tau is NaN for rows
    outside the chunk (no score passes it), so the threshold alone decides."""
    s = gl.convert_layout(s, flt_layout)
    keys = j * BLOCK_S + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, flt_layout))
    if VISIBLE:
        keep = s >= tau[None, :]
    else:
        keep = ((keys[:, None] <= rows[None, :]) & in_chunk[None, :]) & (s >= tau[None, :])
    index_type: gl.constexpr = gl.int32 if INDEX32 else gl.int64
    return s, keys[:, None] + gl.zeros(s.shape, index_type, flt_layout), keep


@gluon.jit
def _claim_slots(s, j, rows, in_chunk, row_slot, tau, cnt_ptr, BLOCK_S: gl.constexpr,
                 flt_layout: gl.constexpr):
    """Each `_survivors` of key tile j takes the next slot of its row (a relaxed atomic on
    the row's count). Returns (slot, packed key, kept) for `_store_survivors`. In flt_layout,
    one element a thread: the reduced layout broadcasts each score over four lanes, which
    would count it four times."""
    s, index, keep = _survivors(s, j, rows, in_chunk, tau, BLOCK_S, flt_layout)
    pos = gl.atomic_add(cnt_ptr + row_slot, gl.full(s.shape, 1, gl.int32, flt_layout),
                        mask=keep, sem="relaxed")
    return pos, _pack_key(s, index), keep


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _scan_slots(s, j, rows, in_chunk, tau, count, BLOCK_S: gl.constexpr,
                flt_layout: gl.constexpr, INDEX32: gl.constexpr = False,
                VISIBLE: gl.constexpr = False):
    """`_claim_slots` without atomics (SCAN_SLOTS): a consumer owns its rows over every key
    tile, so each survivor's slot is its row's count so far (count [ROWS], in registers) plus
    the survivors before it in the tile (a scan over the tile's keys). flt_layout: the scan's
    (`_scan_layout`); INDEX32, VISIBLE: `_survivors`'. Returns (slot, packed key, kept, the
    rows' counts after the tile)."""
    s, index, keep = _survivors(s, j, rows, in_chunk, tau, BLOCK_S, flt_layout, INDEX32,
                                VISIBLE)
    ones = keep.to(gl.int32)
    pos = count[None, :] + gl.associative_scan(ones, 0, _add) - ones
    return pos, _pack_key(s, index), keep, count + gl.sum(ones, axis=0)


@gluon.jit
def _store_survivors(buf_ptr, row_slot, pos, key, keep, CAP: gl.constexpr):
    """The claimed keys into their rows' slots below CAP (a row's count goes on past CAP)."""
    gl.store(buf_ptr + row_slot * CAP + pos, key, mask=keep & (pos < CAP))


@gluon.jit
def _store_table(s, j, rows, in_chunk, row_off, out_ptr, sok, key_stride,
                 BLOCK_S: gl.constexpr, flt_layout: gl.constexpr):
    """Key tile j's scores s [BLOCK_S x ROWS] into the table: keys j x BLOCK_S + i at positions
    (j x BLOCK_S + i) x key_stride, those a row sees (row_off: its rows' offsets). In
    flt_layout, one element a thread: each score stored once, 16 keys of a row in a warp."""
    s = gl.convert_layout(s, flt_layout)
    keys = j * BLOCK_S + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, flt_layout))
    # int64: a key past the last (the tile's tail, up to BLOCK_S - 1 of them) times a large
    # stride must not wrap round to a position a row sees
    seen = ((keys.to(gl.int64) * key_stride)[:, None] <= rows[None, :]) & in_chunk[None, :]
    gl.store(out_ptr + row_off[None, :] + keys.to(gl.int64)[:, None] * sok, s, mask=seen)


@gluon.jit
def _issue_product(c: gl.constexpr, k_s, q_op, regs, ready, turn, j, NUM_STAGES: gl.constexpr,
                   PINGPONG: gl.constexpr):
    """Consumer c's product of key tile j, [keys x (row, head)], issued (async) once the tile
    landed and, with PINGPONG, the other consumer issued its previous one. regs: the
    accumulator it overwrites (not added: use_acc off), whose registers it takes."""
    i = j % NUM_STAGES
    mbarrier.wait(ready.index(i), (j // NUM_STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(c), (j & 1) ^ (1 - c))
    acc = warpgroup_mma(k_s.index(i), q_op, regs, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - c), count=1)
    return acc


@gluon.jit
def _key_scales(j, keys, ks_ptr, b, sksb, skss, n_keys, BLOCK_S: gl.constexpr,
                KEY_SCALE: gl.constexpr):
    """Key tile j's keys' scales (e4m3 keys, KEY_SCALE; loaded under the product), else
    unused zeros."""
    k_idx = j * BLOCK_S + keys
    if KEY_SCALE:
        return gl.load(ks_ptr + b * sksb + k_idx * skss, mask=k_idx < n_keys, other=0.0)
    else:
        return k_idx.to(gl.float32) * 0.0


@gluon.jit
def _head_sum_transposed(x, ROWS: gl.constexpr, H: gl.constexpr, BLOCK_S: gl.constexpr,
                         red_layout: gl.constexpr):
    """x [BLOCK_S keys x (row, head)] in the accumulator's layout (a head's column bits: 1 the
    register pair, 2 and 4 the quad's lanes, 8 and up column registers) summed over its heads
    into red_layout, each score in one thread: each thread's heads first (as the plain sum),
    then its quad's four partial sums brought into one thread by a layout change
    (`_partials_layout`: inside the quad, or for the scan filter straight into the scan's
    layout) and added there in the plain sum's butterfly order ((lanes 0 + 2) + (1 + 3)), so
    the scores are bitwise the same."""
    x = gl.permute(gl.reshape(x, [BLOCK_S, ROWS, H // 8, 4, 2]), [0, 1, 3, 2, 4])
    x = gl.sum(gl.reshape(x, [BLOCK_S, ROWS, 4, H // 4]), axis=3)  # [keys, rows, quad lane]
    x = gl.convert_layout(x, _partials_layout(red_layout, ROWS))
    x = gl.sum(gl.reshape(x, [BLOCK_S, ROWS, 2, 2]), axis=2)  # lane bit 1 (xor 2) first
    return gl.sum(x, axis=2)


@gluon.jit
def _tile_epilogue(acc, j, w, k_scale, keys, rows, f_rows, in_chunk, tau, row_slot, row_off, m,
                   count, cnt_ptr, buf_ptr, out_ptr, sok, key_stride, ROWS: gl.constexpr,
                   H: gl.constexpr, BLOCK_S: gl.constexpr, red_layout: gl.constexpr,
                   flt_layout: gl.constexpr, FILTER: gl.constexpr, CAP: gl.constexpr,
                   DEFER_STORE: gl.constexpr, TABLE: gl.constexpr, KEY_SCALE: gl.constexpr,
                   RELU: gl.constexpr, SCAN_SLOTS: gl.constexpr, PART_MAJOR: gl.constexpr,
                   VISIBLE: gl.constexpr, HEAD_SUM_TRANSPOSE: gl.constexpr):
    """Key tile j's completed product acc [keys x (row, head)]: ReLU x w, the head sum, then
    the epilogue's work (`_consumer`). PART_MAJOR: acc [keys x (part, row)], the parts summed
    as they are (weights 1; the zero part's products are zeros) inside each thread.
    HEAD_SUM_TRANSPOSE: the head sum's quad step by `_head_sum_transposed`. VISIBLE:
    the scan filter's tile seen whole by every row (`_survivors`). Returns the state the tiles
    carry: (the running maxima m, the scan's counts, the survivors pending a deferred store:
    slots, keys, kept)."""
    if PART_MAJOR:
        s = gl.sum(gl.reshape(acc, [BLOCK_S, H, ROWS]), axis=1)
    else:
        if RELU:
            x = gl.maximum(acc, 0.0) * w[None, :]
        else:
            x = acc * w[None, :]
        if HEAD_SUM_TRANSPOSE:
            s = _head_sum_transposed(x, ROWS, H, BLOCK_S, red_layout)
        else:
            s = gl.sum(gl.reshape(x, [BLOCK_S, ROWS, H]), axis=2)
    s = gl.convert_layout(s, red_layout, assert_trivial=True)
    if KEY_SCALE:
        s = s * k_scale[:, None]
    pos = gl.zeros([BLOCK_S, ROWS], gl.int32, layout=flt_layout)
    key = gl.zeros([BLOCK_S, ROWS], gl.int64, layout=flt_layout)
    keep = pos != 0
    if FILTER:
        if SCAN_SLOTS:
            pos, key, keep, count = _scan_slots(s, j, f_rows, in_chunk, tau, count, BLOCK_S,
                                                flt_layout, PART_MAJOR, VISIBLE)
        else:
            pos, key, keep = _claim_slots(s, j, f_rows, in_chunk, row_slot, tau, cnt_ptr,
                                          BLOCK_S, flt_layout)
        if not DEFER_STORE:
            _store_survivors(buf_ptr, row_slot, pos, key, keep, CAP)
    elif TABLE:
        _store_table(s, j, f_rows, in_chunk, row_off, out_ptr, sok, key_stride, BLOCK_S,
                     flt_layout)
    else:
        visible = (j * BLOCK_S + keys)[:, None] <= rows[None, :]
        m = gl.maximum(m, gl.where(visible, s, float("-inf")))
    return m, count, pos, key, keep


@gluon.jit
def _consumer(c: gl.constexpr, q_s, k_s, bars, w_ptr, out_ptr, b, t_base, T, n_tiles,
              swb, swt, swh, sob, sot, sok, key_stride, n_keys, ks_ptr, sksb, skss, tau_ptr,
              cnt_ptr, buf_ptr, t_lo, t_hi, n_rows, ROWS: gl.constexpr, H: gl.constexpr,
              BLOCK_S: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
              red_layout: gl.constexpr, FILTER: gl.constexpr, CAP: gl.constexpr,
              flt_layout: gl.constexpr, DEFER_STORE: gl.constexpr, TABLE: gl.constexpr,
              MMA_K: gl.constexpr, KEY_SCALE: gl.constexpr, RELU: gl.constexpr,
              SCAN_SLOTS: gl.constexpr, MMA_AHEAD: gl.constexpr,
              PART_MAJOR: gl.constexpr, HEAD_SUM_TRANSPOSE: gl.constexpr):
    """Rows t0 .. t0 + ROWS - 1 (t0 = t_base + c * ROWS): each key tile's scores as
    [keys x (row, head)] = K_tile Q^T on wgmma, then ReLU x w, the head sum (N, in registers),
    the causal mask and a running max per (key slot, row); the max over key slots at the end.
    FILTER: instead of the max, the survivors at or above the row's threshold are appended
    (`_claim_slots`, `_store_survivors`; rows outside [t_lo, t_hi) write nothing).
    DEFER_STORE: a tile's survivors are stored while the next tile's product runs, so the
    consumer does not wait for its slot atomics' return before its next wgmma.
    SCAN_SLOTS: the slots from the rows' counts in registers and a scan over each tile's keys
    (`_scan_slots`), the counts stored at the end, instead of an atomic a survivor.
    TABLE: each visible score (key j at position j x key_stride) into out[b, row - t_lo, j]
    (strides sob, sot, sok) for rows in [t_lo, t_hi); the rest is the caller's fill.
    MMA_K: the wgmma's K (16 for bf16, 32 for e4m3); KEY_SCALE: each key's head sum times
    ks[b, key] (strides sksb, skss: e4m3 keys' scales). RELU=False: the heads' products
    weighted and summed as they are (the folded query's bf16 parts, weights 1).
    MMA_AHEAD: tile j + 1's product is issued before tile j's epilogue, so the tensor core
    has this consumer's next product queued while the epilogue runs (two accumulators live;
    the tiles in pairs, an odd count's last one a masked tile past the keys; one more product
    ends the chain unread). PART_MAJOR (relu=False): the block's columns run (part, row), w
    unread (`_tile_epilogue`). HEAD_SUM_TRANSPOSE: the head sum's quad step as a layout change
    (`_head_sum_transposed`); with SCAN_SLOTS, the tiles seen whole in a loop of their own
    (as PART_MAJOR's)."""
    q_bar, ready, empty, turn = bars
    N: gl.constexpr = ROWS * H
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, MMA_K])
    t0 = t_base + c * ROWS

    # w for this thread's (row, head) columns, once; rows past T weigh 0 (never stored).
    n = gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout))
    wt = t0 + n // H
    w = gl.load(w_ptr + b * swb + wt * swt + (n % H) * swh, mask=wt < T, other=0.0)

    keys = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, red_layout))
    rows = t0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, red_layout))
    m = gl.full([BLOCK_S, ROWS], float("-inf"), gl.float32, layout=red_layout)
    zero = gl.zeros([BLOCK_S, N], gl.float32, layout=acc_layout)
    # The epilogues' state, each epilogue's own set below (the others' go unused).
    f_rows = t0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, flt_layout))
    in_chunk = (f_rows >= t_lo) & (f_rows < t_hi)
    tau = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, flt_layout))
    count = gl.zeros([ROWS], gl.int32, layout=gl.SliceLayout(0, flt_layout))
    row_slot = gl.zeros([BLOCK_S, ROWS], gl.int64, layout=flt_layout)
    row_off = f_rows.to(gl.int64)
    # nothing pending before the first tile (DEFER_STORE)
    pend_pos = gl.zeros([BLOCK_S, ROWS], gl.int32, layout=flt_layout)
    pend_key = gl.zeros([BLOCK_S, ROWS], gl.int64, layout=flt_layout)
    pend_keep = pend_pos != 0
    # PART_MAJOR's and HEAD_SUM_TRANSPOSE's scan filter runs the key tiles that every row of
    # the consumer sees whole (keys up to t0) in a loop of their own, without the causal and
    # chunk tests (`_survivors`' VISIBLE: with 32 rows a consumer they are 16 tests a thread a
    # tile, and their predicates crowd the scan's), then the rest with them. Other variants
    # keep one loop.
    SPLIT: gl.constexpr = FILTER and SCAN_SLOTS and (PART_MAJOR or HEAD_SUM_TRANSPOSE)
    n_seen = gl.minimum((t0 + 1) // BLOCK_S, n_tiles)
    if FILTER:
        # rows outside the chunk get +inf (NaN when SPLIT, which >= never passes): no score
        # passes it
        tau = gl.load(tau_ptr + b * n_rows + (f_rows - t_lo), mask=in_chunk,
                      other=float("nan") if SPLIT else float("inf"))
        row_slot = ((b * n_rows + (f_rows - t_lo)).to(gl.int64)[None, :]
                    + gl.zeros([BLOCK_S, ROWS], gl.int64, layout=flt_layout))
    if TABLE:
        row_off = b * sob + (f_rows - t_lo).to(gl.int64) * sot

    mbarrier.wait(q_bar.index(c), 0)
    q_op = q_s.index(c).permute((1, 0))  # [D x (row, head)]: K-major B operand
    if MMA_AHEAD:
        # Two accumulators in turn over tile pairs (tile n_tiles when n_tiles is odd: every
        # key past the rows, masked): each tile's product waited for, the next one issued, then
        # the epilogue. ptxas serializes every wgmma (C7514) if registers are read between a
        # product's issue and its wait that a product issued in that span writes, or if an
        # accumulator in flight is copied: so no product is issued before the last one's wait,
        # and the one carried round the loop reuses its predecessor's registers. The chain ends
        # with one more product, of the last tile again, never read.
        acc_a = _issue_product(c, k_s, q_op, zero, ready, turn, 0, NUM_STAGES, PINGPONG)
        for seg in gl.static_range(2 if SPLIT else 1):  # the tiles seen whole, the rest
            visible = SPLIT and seg == 0
            j_lo = n_seen // 2 * 2 if seg == 1 else 0  # pairs: an even boundary
            j_hi = n_seen // 2 * 2 if visible else n_tiles
            for j in range(j_lo, j_hi, 2):
                acc_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a,))
                mbarrier.arrive(empty.index(j % NUM_STAGES), count=1)
                acc_b = _issue_product(c, k_s, q_op, zero, ready, turn, j + 1, NUM_STAGES,
                                       PINGPONG)
                k_scale = _key_scales(j, keys, ks_ptr, b, sksb, skss, n_keys, BLOCK_S,
                                      KEY_SCALE)
                if DEFER_STORE:  # the last tile's, under this tile's product
                    _store_survivors(buf_ptr, row_slot, pend_pos, pend_key, pend_keep, CAP)
                m, count, pend_pos, pend_key, pend_keep = _tile_epilogue(
                    acc_a, j, w, k_scale, keys, rows, f_rows, in_chunk, tau, row_slot, row_off, m,
                    count, cnt_ptr, buf_ptr, out_ptr, sok, key_stride, ROWS, H, BLOCK_S,
                    red_layout, flt_layout, FILTER, CAP, DEFER_STORE, TABLE, KEY_SCALE, RELU,
                    SCAN_SLOTS, PART_MAJOR, visible, HEAD_SUM_TRANSPOSE)
                acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b,))
                mbarrier.arrive(empty.index((j + 1) % NUM_STAGES), count=1)
                acc_a = _issue_product(c, k_s, q_op, acc_a, ready, turn, j + 2, NUM_STAGES,
                                       PINGPONG)
                k_scale = _key_scales(j + 1, keys, ks_ptr, b, sksb, skss, n_keys, BLOCK_S,
                                      KEY_SCALE)
                if DEFER_STORE:
                    _store_survivors(buf_ptr, row_slot, pend_pos, pend_key, pend_keep, CAP)
                m, count, pend_pos, pend_key, pend_keep = _tile_epilogue(
                    acc_b, j + 1, w, k_scale, keys, rows, f_rows, in_chunk, tau, row_slot, row_off,
                    m, count, cnt_ptr, buf_ptr, out_ptr, sok, key_stride, ROWS, H, BLOCK_S,
                    red_layout, flt_layout, FILTER, CAP, DEFER_STORE, TABLE, KEY_SCALE, RELU,
                    SCAN_SLOTS, PART_MAJOR, visible, HEAD_SUM_TRANSPOSE)
        warpgroup_mma_wait(num_outstanding=0, deps=(acc_a,))
    else:
        for seg in gl.static_range(2 if SPLIT else 1):  # the tiles seen whole, the rest
            visible = SPLIT and seg == 0
            j_lo = n_seen if seg == 1 else 0
            j_hi = n_seen if visible else n_tiles
            for j in range(j_lo, j_hi):
                acc = _issue_product(c, k_s, q_op, zero, ready, turn, j, NUM_STAGES, PINGPONG)
                k_scale = _key_scales(j, keys, ks_ptr, b, sksb, skss, n_keys, BLOCK_S,
                                      KEY_SCALE)
                if DEFER_STORE:  # the last tile's, under this tile's product
                    _store_survivors(buf_ptr, row_slot, pend_pos, pend_key, pend_keep, CAP)
                # The stage is free once the product that reads it completed; the accumulator is
                # not touched before this wait (ptxas would serialize every wgmma otherwise:
                # C7514).
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(j % NUM_STAGES), count=1)
                m, count, pend_pos, pend_key, pend_keep = _tile_epilogue(
                    acc, j, w, k_scale, keys, rows, f_rows, in_chunk, tau, row_slot, row_off, m,
                    count, cnt_ptr, buf_ptr, out_ptr, sok, key_stride, ROWS, H, BLOCK_S,
                    red_layout, flt_layout, FILTER, CAP, DEFER_STORE, TABLE, KEY_SCALE, RELU,
                    SCAN_SLOTS, PART_MAJOR, visible, HEAD_SUM_TRANSPOSE)

    if FILTER:
        if DEFER_STORE:
            _store_survivors(buf_ptr, row_slot, pend_pos, pend_key, pend_keep, CAP)
        if SCAN_SLOTS:
            gl.store(cnt_ptr + b * n_rows + (f_rows - t_lo), count, mask=in_chunk)
    elif not TABLE:
        row_max = gl.max(m, axis=0)
        gl.store(out_ptr + b * sob + rows * sot, row_max, mask=rows < T)


@gluon.jit
def _indexer_scores_kernel(q_desc, k_desc, w_ptr, out_ptr, B, T, n_blocks,
                           swb, swt, swh, sob, sot, sok, key_stride, n_keys, ks_ptr, sksb,
                           skss, tau_ptr, cnt_ptr, buf_ptr, t_lo, t_hi,
                           H: gl.constexpr, ROWS: gl.constexpr, BLOCK_S: gl.constexpr,
                           NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                           red_layout: gl.constexpr, FILTER: gl.constexpr, CAP: gl.constexpr,
                           flt_layout: gl.constexpr, DEFER_STORE: gl.constexpr,
                           TABLE: gl.constexpr, MMA_K: gl.constexpr, KEY_SCALE: gl.constexpr,
                           RELU: gl.constexpr, SCAN_SLOTS: gl.constexpr,
                           MMA_AHEAD: gl.constexpr, PART_MAJOR: gl.constexpr,
                           HEAD_SUM_TRANSPOSE: gl.constexpr, CONSUMER_WARPS: gl.constexpr,
                           PRODUCER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr):
    """One program: query rows t_base .. t_base + 2 * ROWS - 1 of batch b, from t_lo, against
    the keys k_desc holds (n_keys a batch, key j at position j x key_stride: 1 and T but in
    TABLE). Program 0 takes the last row block (the most key tiles): the long programs start
    first, the short ones fill the tail."""
    pid = gl.program_id(0)
    b = (pid % B).to(gl.int64)
    t_base = t_lo + (n_blocks - 1 - pid // B) * (2 * ROWS)
    n_rows = t_hi - t_lo
    last_row = gl.minimum(t_base + 2 * ROWS - 1, T - 1)
    n_tiles = gl.minimum(last_row // key_stride, n_keys - 1) // BLOCK_S + 1
    if PART_MAJOR:  # q_desc: [B * H * T, D] rows, part p of token t at (b * H + p) * T + t
        q_row0 = (b * H * T + t_base).to(gl.int32)
        q_row_cap = (b * H * T + T - 1).to(gl.int32)
    else:  # q_desc: [B * T * H, D] rows, (token, head) pairs
        q_row0 = (b * T + t_base).to(gl.int32) * H
        q_row_cap = (B * T - 1) * H
    k_row0 = (b * n_keys).to(gl.int32)

    q_s = gl.allocate_shared_memory(q_desc.dtype, [2, ROWS * H, q_desc.block_type.shape[1]],
                                    q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape,
                                    k_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    # The initialized barriers must be visible to the TMA unit (async proxy) before its first
    # complete_tx; the workers see them through warp_specialize's entry barrier.
    fence_async_shared()
    bars = (q_bar, ready, empty, turn)

    gl.warp_specialize([
        (_consumer, (0, q_s, k_s, bars, w_ptr, out_ptr, b, t_base, T, n_tiles,
                     swb, swt, swh, sob, sot, sok, key_stride, n_keys, ks_ptr, sksb, skss,
                     tau_ptr, cnt_ptr, buf_ptr, t_lo, t_hi, n_rows, ROWS, H, BLOCK_S,
                     NUM_STAGES, PINGPONG, red_layout, FILTER, CAP, flt_layout, DEFER_STORE,
                     TABLE, MMA_K, KEY_SCALE, RELU, SCAN_SLOTS, MMA_AHEAD, PART_MAJOR,
                     HEAD_SUM_TRANSPOSE)),
        (_consumer, (1, q_s, k_s, bars, w_ptr, out_ptr, b, t_base, T, n_tiles,
                     swb, swt, swh, sob, sot, sok, key_stride, n_keys, ks_ptr, sksb, skss,
                     tau_ptr, cnt_ptr, buf_ptr, t_lo, t_hi, n_rows, ROWS, H, BLOCK_S,
                     NUM_STAGES, PINGPONG, red_layout, FILTER, CAP, flt_layout, DEFER_STORE,
                     TABLE, MMA_K, KEY_SCALE, RELU, SCAN_SLOTS, MMA_AHEAD, PART_MAJOR,
                     HEAD_SUM_TRANSPOSE)),
        (_producer, (q_desc, k_desc, q_s, k_s, bars, q_row0, q_row_cap, T, k_row0, n_tiles,
                     ROWS, H, BLOCK_S, NUM_STAGES, MMA_AHEAD, PART_MAJOR)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------- launch


def _reduced_layout(rows: int, heads: int) -> gl.DistributedLinearLayout:
    """The head-summed scores' layout, [BLOCK_S keys x rows]: what summing the wgmma
    accumulator [keys x (row, head)] over its heads leaves. Keys as in the accumulator (lanes
    / 4 and one register bit: 8 apart, warps: 16 apart); the rows on the accumulator's column
    bits above the heads (column registers, and for fewer than 8 heads the quad's upper lane
    bit); the bits that held heads (a register pair, the quad's lanes, the low column
    registers) removed or, for lanes, broadcast."""
    n = rows * heads
    # accumulator columns of its register bits above the first two (the pair, +8 keys)
    col_regs = [8 << i for i in range((n // 8).bit_length() - 1)]
    reg = [[8, 0]] + [[0, col // heads] for col in col_regs if col >= heads]
    # the quad's lanes hold columns 2 and 4
    quad = [[0, col // heads] if col >= heads else [0, 0] for col in (2, 4)]
    lane = quad + [[1, 0], [2, 0], [4, 0]]
    warp = [[16, 0], [32, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [BLOCK_S, rows])


@gluon.constexpr_function
def _quad_bases(rows: int) -> tuple[list, list]:
    """`_transposed_sum_layout`'s register and lane bases over (key, row): the quad's two lane
    bits take the row bits (2 or 1: GLM-5.1's 4 rows, V3.2's 2), then the +8 key bit; what is
    left of (+8 key, rows) stays in registers."""
    if rows not in (2, 4):
        raise ValueError(f"the transposed head sum takes 2 or 4 rows, got {rows}")
    bits = [[0, 1 << i] for i in range(rows.bit_length() - 1)] + [[8, 0]]
    return bits[2:], bits[:2] + [[1, 0], [2, 0], [4, 0]]


@gluon.constexpr_function
def _quad_layout(rows):
    """[BLOCK_S keys x rows x 4]: each thread's partial head sums of its quad's four lanes in
    its registers (the last axis), the rows (then the +8 key bit) on the quad's lanes."""
    reg, lane = _quad_bases(int(rows))
    return gl.DistributedLinearLayout([b + [0] for b in reg] + [[0, 0, 1], [0, 0, 2]],
                                      [b + [0] for b in lane], [[16, 0, 0], [32, 0, 0]], [],
                                      [BLOCK_S, int(rows), 4])


@gluon.constexpr_function
def _partials_layout(red_layout, rows):
    """The quad's partial sums' layout, [BLOCK_S keys x rows x 4], for the scores' layout
    red_layout: a blocked one (the scan filter's) with the four partials in each thread's
    registers, so one layout change takes them from the accumulator to the scan; else
    `_quad_layout`."""
    if isinstance(red_layout, gl.BlockedLayout):
        return gl.BlockedLayout(list(red_layout.size_per_thread) + [4],
                                list(red_layout.threads_per_warp) + [1],
                                list(red_layout.warps_per_cta) + [1],
                                [2] + list(red_layout.order))
    return _quad_layout(rows)


def _transposed_sum_layout(rows: int) -> gl.DistributedLinearLayout:
    """The head-summed scores' layout, [BLOCK_S keys x rows], with HEAD_SUM_TRANSPOSE: each
    score in one thread (`_quad_layout` summed over its last axis). Keys as
    `_reduced_layout`'s."""
    reg, lane = _quad_bases(rows)
    return gl.DistributedLinearLayout(reg, lane, [[16, 0], [32, 0]], [], [BLOCK_S, rows])


def _part_sum_layout(rows: int, parts: int) -> gl.DistributedLinearLayout:
    """The parts-summed scores' layout, [BLOCK_S keys x rows], for the accumulator's columns
    in (part, row) order (PART_MAJOR): the rows on the column bits below the parts (the
    register pair, the quad's lanes, the low column registers), the column registers above
    (the parts) removed, so each thread sums its rows' parts alone and holds each score once.
    Keys as `_reduced_layout`'s."""
    if rows < 8 or rows * parts != PAIRS:
        raise ValueError(f"the part-major layout needs 8 rows or more and rows x parts = "
                         f"{PAIRS}, got {rows} x {parts}")
    col_regs = [8 << i for i in range((PAIRS // 8).bit_length() - 1)]
    reg = [[0, 1], [8, 0]] + [[0, col] for col in col_regs if col < rows]
    lane = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    warp = [[16, 0], [32, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [BLOCK_S, rows])


def _filter_layout(rows: int) -> gl.BlockedLayout:
    """[BLOCK_S keys x rows] with every element in exactly one of the consumer's 128 threads
    (the survivors' atomics must run once per score): 64 keys over 16 lanes x 4 warps, the rows
    over 2 lanes and rows / 2 registers."""
    if rows % 2:
        raise ValueError(f"the survivors' layout needs an even count of rows, got {rows}")
    return gl.BlockedLayout([1, max(1, rows // 2)], [16, 2], [CONSUMER_WARPS, 1], [1, 0])


def _scan_layout(rows: int) -> gl.BlockedLayout:
    """[BLOCK_S keys x rows] for `_scan_slots`: a key tile's keys inside one warp (32 lanes x
    BLOCK_S / 32 registers), the rows over the warps (fewer rows than warps: repeated, which
    a scan allows), so the scan over keys and the rows' sums need no shared memory."""
    return gl.BlockedLayout([BLOCK_S // 32, max(1, rows // CONSUMER_WARPS)], [32, 1],
                            [1, CONSUMER_WARPS], [0, 1])


def _row_scan_layout(rows: int) -> gl.BlockedLayout:
    """[BLOCK_S keys x rows] for `_scan_slots` with many rows (PART_MAJOR's 32): one row a
    thread, its keys over the fewest lanes (32 rows: 16 keys a thread, 4 lanes), so the scan
    runs mostly inside the thread (two shuffle steps instead of a warp's five a row)."""
    if rows % CONSUMER_WARPS or 32 % (rows // CONSUMER_WARPS):
        raise ValueError(f"one row a thread needs rows / {CONSUMER_WARPS} warps dividing 32, "
                         f"got {rows} rows")
    lanes_on_keys = 32 // (rows // CONSUMER_WARPS)
    return gl.BlockedLayout([BLOCK_S // lanes_on_keys, 1], [lanes_on_keys, 32 // lanes_on_keys],
                            [1, CONSUMER_WARPS], [0, 1])


_layouts: dict[tuple, tuple] = {}
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


def _shared_layouts(heads: int, dtype: torch.dtype, transpose: bool = False) -> tuple:
    """(q's and k's shared-memory layouts, the head-summed scores' layout (transpose:
    HEAD_SUM_TRANSPOSE's), the survivors' atomic layout)."""
    key = heads, dtype, transpose
    if key not in _layouts:
        nv = gl.NVMMASharedLayout.get_default_for
        rows = PAIRS // heads
        _layouts[key] = (nv([PAIRS, HEAD_DIM], _GL_DTYPES[dtype]),
                         nv([BLOCK_S, HEAD_DIM], _GL_DTYPES[dtype]),
                         _transposed_sum_layout(rows) if transpose else
                         _reduced_layout(rows, heads),
                         _filter_layout(rows))
    return _layouts[key]


def check_inputs(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, key_stride: int = 1,
                 k_scale: torch.Tensor | None = None, relu: bool = True,
                 part_major: bool = False, head_sum_transpose: bool = False) -> None:
    """ValueError naming the argument that `indexer_row_max_sm90` cannot take (k: the keys at
    positions 0, key_stride, 2 x key_stride, ... of the T-token sequence; k_scale: fp32 [B, S]
    with e4m3 q and k, None with bf16; relu=False: FOLDED_HEADS bf16 parts; part_major: with
    relu=False, q's parts stored part-major, [B, H, T, D] permuted to [B, T, H, D];
    head_sum_transpose: ReLU's heads, HEADS)."""
    check_tensor("q", q, ndim=4, dtypes=tuple(MMA_K_BY_DTYPE))  # [B, T, H, D]
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,))  # [B, S, D]
    check_tensor("w", w, ndim=3, dtypes=(torch.float32,))  # [B, T, H]
    check_same_device(q=q, k=k, w=w)
    B, T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"q: head dim must be {HEAD_DIM}, got {D}")
    heads = HEADS if relu else FOLDED_HEADS
    if H not in heads:
        what = "" if relu else " without ReLU (the folded query's bf16 parts)"
        raise ValueError(f"q: heads must be one of {heads}{what}, got {H}")
    if head_sum_transpose and (not relu or H not in HEADS):
        raise ValueError(f"head_sum_transpose takes ReLU's heads {HEADS}, got {H} heads with "
                         f"relu={relu}")
    if not relu and q.dtype != torch.bfloat16:
        raise ValueError(f"q: without ReLU the folded query's parts are bf16, got {q.dtype}")
    n_keys = -(-T // key_stride)
    check_keys(k, (B, n_keys, D),
               "(S == T: causal)" if key_stride == 1 else f"(every {key_stride}-th of T keys)")
    if w.shape != (B, T, H):
        raise ValueError(f"w must be [B, T, H] = {(B, T, H)}, got {tuple(w.shape)}")
    if q.dtype == torch.bfloat16:
        if k_scale is not None:
            raise ValueError("k_scale goes with e4m3 q and k only (bf16 given)")
    else:
        if k_scale is None:
            raise ValueError("k_scale (fp32 [B, S]) is required with e4m3 q and k")
        check_tensor("k_scale", k_scale, ndim=2, dtypes=(torch.float32,))
        if k_scale.shape != (B, n_keys):
            raise ValueError(f"k_scale must be [B, S] = {(B, n_keys)}, got "
                             f"{tuple(k_scale.shape)}")
        check_same_device(q=q, k_scale=k_scale)
    # TMA reads q as [B * T * H, D] rows (part_major: [B * H * T, D]) and k as [B * S, D] rows:
    # 16-byte rows and row strides, 16-byte aligned data, the batch / token / head strides
    # packed into one row index.
    row = 16 // q.element_size()  # elements in TMA's 16 bytes (bf16 8, e4m3 16)
    sqb, sqt, sqh, sqd = q.stride()
    if part_major:
        if relu:
            raise ValueError("part_major takes the folded query's parts (relu=False)")
        if sqd != 1 or sqt % row or sqh != T * sqt or (B > 1 and sqb != H * sqh):
            raise ValueError(f"q must be part-major, readable as [B * H * T, D] rows (a "
                             f"[B, H, T, D] tensor permuted to [B, T, H, D], unit-stride "
                             f"channels, a token stride that is a multiple of {row}); got "
                             f"strides {q.stride()}")
    elif sqd != 1 or sqh % row or sqt != H * sqh or (B > 1 and sqb != T * sqt):
        raise ValueError(f"q must be readable as [B * T * H, D] rows (unit-stride channels, a "
                         f"head stride that is a multiple of {row}, packed heads, tokens and "
                         f"batches); got strides {q.stride()}")
    if q.data_ptr() % 16:
        raise ValueError("q must be 16-byte aligned for TMA")
    if B * T * H > MAX_TMA_ROWS:
        raise ValueError(f"q: B * T * H = {B * T * H} rows exceed TMA's int32 coordinates")


def check_keys(k: torch.Tensor, shape: tuple[int, int, int], what: str = "") -> None:
    """ValueError unless k is [B, S, D] = shape and TMA can read it as [B * S, D] rows."""
    if tuple(k.shape) != tuple(shape):
        raise ValueError(f"k must be [B, S, D] = {tuple(shape)} {what}, got {tuple(k.shape)}")
    row = 16 // k.element_size()
    skb, sks, skd = k.stride()
    if skd != 1 or sks % row or (shape[0] > 1 and skb != shape[1] * sks):
        raise ValueError(f"k must be readable as [B * S, D] rows (unit-stride channels, a key "
                         f"stride that is a multiple of {row}, packed batches); got strides "
                         f"{k.stride()}")
    if k.data_ptr() % 16:
        raise ValueError("k must be 16-byte aligned for TMA")


def indexer_row_max_sm90(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *,
                         pingpong: bool = True, k_scale: torch.Tensor | None = None,
                         relu: bool = True, mma_ahead: bool = False,
                         stages: int = NUM_STAGES, part_major: bool = False,
                         head_sum_transpose: bool = False) -> torch.Tensor:
    """out fp32 [B, T]: each causal row's largest indexer score (key s visible to row t iff
    s <= t). Hopper only: the caller checks the device. pingpong: order the two consumers'
    products alternately (the `turn` barriers); False lets them issue freely. e4m3 q and k:
    k_scale fp32 [B, S], w already times q's scales (module doc). relu=False: q the folded
    query's FOLDED_HEADS bf16 parts, w their weights (1, the pad 0). mma_ahead: each
    consumer issues the next key tile's product before the last one's epilogue
    (`_consumer`'s MMA_AHEAD); stages: key tiles in flight (`check_stages`). part_major
    (relu=False): q's parts stored part-major (`hytopk_sm90.folded_parts(part_major=True)`),
    each thread summing its rows' parts in registers (`_consumer`'s PART_MAJOR; w unread:
    the parts weigh 1, the zero pad's products are zeros). head_sum_transpose (ReLU's 32 or
    64 heads): the head sum's last two steps as a layout change inside each quad of lanes,
    each score then in one thread (`_head_sum_transposed`; bitwise the same scores)."""
    check_inputs(q, k, w, k_scale=k_scale, relu=relu, part_major=part_major,
                 head_sum_transpose=head_sum_transpose)
    check_stages(stages)
    B, T, H, D = q.shape
    out = torch.empty((B, T), device=q.device, dtype=torch.float32)
    if B * T == 0:
        return out
    _launch(q, k, w, out, 0, T, pingpong=pingpong, k_scale=k_scale, relu=relu,
            mma_ahead=mma_ahead, stages=stages, part_major=part_major,
            head_sum_transpose=head_sum_transpose)
    return out


def indexer_filter_sm90(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, tau: torch.Tensor,
                        t_lo: int, t_hi: int, cap: int, *, pingpong: bool = True,
                        defer_store: bool = True, k_scale: torch.Tensor | None = None,
                        relu: bool = True, scan_slots: bool = False,
                        mma_ahead: bool = False, stages: int = NUM_STAGES,
                        part_major: bool = False,
                        head_sum_transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The survivors of query rows [t_lo, t_hi): keys int64 [B, t_hi - t_lo, cap] (HyTopK's
    packed keys of the visible scores >= tau of each row, in no order, the first min(count,
    cap) slots written, the rest left as allocated: readers go by the counts) and counts int32
    [B, t_hi - t_lo] (all survivors, also those past cap). tau: fp32 [B, t_hi - t_lo]
    thresholds (-inf: every visible key).
    defer_store: store a key tile's survivors under the next tile's product (False: right
    after their slot atomics return, as first built; relu=False always: its 32 rows' pending
    survivors would not fit the registers, compiled for sm_90a). k_scale, relu: as
    `indexer_row_max_sm90`'s. scan_slots: each survivor's slot from its row's count in
    registers and a scan over the key tile, no atomics (the survivors in key order; a consumer
    owns its rows; stored at once, defer_store ignored: nothing returns late); False: a
    relaxed atomic a survivor. mma_ahead, stages: as `indexer_row_max_sm90`'s (mma_ahead
    ignored for relu=False with the atomics: its registers would spill, as defer_store's),
    part_major, head_sum_transpose: as `indexer_row_max_sm90`'s. Hopper only: the caller
    checks the device."""
    check_inputs(q, k, w, k_scale=k_scale, relu=relu, part_major=part_major,
                 head_sum_transpose=head_sum_transpose)
    check_stages(stages)
    B, T, H, D = q.shape
    n = t_hi - t_lo
    if not 0 <= t_lo <= t_hi <= T:
        raise ValueError(f"t_lo, t_hi must satisfy 0 <= t_lo <= t_hi <= T = {T}; got "
                         f"{t_lo}, {t_hi}")
    if cap < 1:
        raise ValueError(f"cap must be positive, got {cap}")
    check_tensor("tau", tau, ndim=2, dtypes=(torch.float32,))
    if tau.shape != (B, n) or not tau.is_contiguous():
        raise ValueError(f"tau must be contiguous fp32 [B, t_hi - t_lo] = {(B, n)}, got "
                         f"{tuple(tau.shape)} with strides {tau.stride()}")
    check_same_device(q=q, tau=tau)
    # Not filled: a row's slots past its count are never read (4 GiB of fill at 128K).
    keys = torch.empty((B, n, cap), device=q.device, dtype=torch.int64)
    counts = torch.zeros((B, n), device=q.device, dtype=torch.int32)
    if B * n:
        _launch(q, k, w, None, t_lo, t_hi, pingpong=pingpong,
                survivors=(tau, counts, keys, cap),
                defer_store=defer_store and relu and not scan_slots,
                k_scale=k_scale, relu=relu, scan_slots=scan_slots,
                mma_ahead=mma_ahead and (relu or scan_slots), stages=stages,
                part_major=part_major, head_sum_transpose=head_sum_transpose)
    return keys, counts


def indexer_table_sm90(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, key_stride: int,
                       t_lo: int, t_hi: int, *, pingpong: bool = True,
                       k_scale: torch.Tensor | None = None, relu: bool = True,
                       part_major: bool = False, head_sum_transpose: bool = False
                       ) -> torch.Tensor:
    """fp32 [B, t_hi - t_lo, S]: the scores of query rows [t_lo, t_hi) against k [B, S, D],
    every key_stride-th key of the T-token sequence (key j at position j x key_stride, S =
    ceil(T / key_stride): `k_full[:, ::key_stride]`), -inf where a row does not see the key
    (j x key_stride > t). HyTopK's sampled thresholds on the Gluon scores (`hytopk_sm90.
    sample_thresholds`). k_scale: the sampled keys' scales, as `indexer_row_max_sm90`'s; relu,
    part_major, head_sum_transpose: as its. Hopper only: the caller checks the device."""
    if isinstance(key_stride, bool) or not (isinstance(key_stride, int) and key_stride >= 1):
        raise ValueError(f"key_stride must be an int >= 1, got {key_stride!r}")
    check_inputs(q, k, w, key_stride, k_scale, relu, part_major, head_sum_transpose)
    B, T = q.shape[:2]
    if not 0 <= t_lo <= t_hi <= T:
        raise ValueError(f"t_lo, t_hi must satisfy 0 <= t_lo <= t_hi <= T = {T}; got "
                         f"{t_lo}, {t_hi}")
    table = torch.full((B, t_hi - t_lo, k.shape[1]), float("-inf"), device=q.device,
                       dtype=torch.float32)
    if table.numel():
        _launch(q, k, w, table, t_lo, t_hi, pingpong=pingpong, table=True,
                key_stride=key_stride, k_scale=k_scale, relu=relu, part_major=part_major,
                head_sum_transpose=head_sum_transpose)
    return table


def _launch(q, k, w, out, t_lo, t_hi, *, pingpong, survivors=None, defer_store=True,
            table=False, key_stride=1, k_scale=None, relu=True, scan_slots=False,
            mma_ahead=False, stages=NUM_STAGES, part_major=False, head_sum_transpose=False):
    """One launch over query rows [t_lo, t_hi): the row maxima into out, or with survivors =
    (tau, counts, keys, cap) the survivors (defer_store: `_consumer`'s DEFER_STORE), or with
    table the scores into out [B, t_hi - t_lo, S] against keys every key_stride-th; k_scale
    with e4m3 q and k; scan_slots, mma_ahead, part_major, head_sum_transpose: `_consumer`'s
    SCAN_SLOTS, MMA_AHEAD, PART_MAJOR, HEAD_SUM_TRANSPOSE (ReLU's 32 or 64 heads, or bf16 /
    e4m3 with them; not the folded parts); stages: key tiles in flight (checked by the
    callers: `check_stages`)."""
    B, T, H, D = q.shape
    rows = PAIRS // H
    q_layout, k_layout, red_layout, flt_layout = _shared_layouts(H, q.dtype, head_sum_transpose)
    scan_slots = survivors is not None and scan_slots
    if scan_slots:
        flt_layout = _row_scan_layout(rows) if part_major else _scan_layout(rows)
        if head_sum_transpose:  # the partial sums straight into the scan's layout
            red_layout = flt_layout
    if part_major:  # a box of ROWS tokens a part (`_producer`)
        red_layout = _part_sum_layout(rows, H)
        q_desc = TensorDescriptor(q, [B * H * T, D], [q.stride(1), 1], [rows, D], q_layout)
    else:
        q_desc = TensorDescriptor(q, [B * T * H, D], [q.stride(2), 1], [PAIRS, D], q_layout)
    n_keys = k.shape[1]
    k_desc = TensorDescriptor(k, [B * n_keys, D], [k.stride(1), 1], [BLOCK_S, D], k_layout)
    n_blocks = -(-(t_hi - t_lo) // (2 * rows))
    if survivors is None:
        tau = counts = keys = out  # not read: FILTER is off
        # the table's (b, row, key) strides; the row maxima's (b, t) and a key stride unused
        cap, out_strides = 1, out.stride() if table else (*out.stride(), 0)
    else:
        tau, counts, keys, cap = survivors
        out, out_strides = tau, (0, 0, 0)  # not written: FILTER is on
    _indexer_scores_kernel[(B * n_blocks,)](
        q_desc, k_desc, w, out, B, T, n_blocks, *w.stride(), *out_strides, key_stride, n_keys,
        w if k_scale is None else k_scale,  # not read without KEY_SCALE
        *((0, 0) if k_scale is None else k_scale.stride()),
        tau, counts, keys, t_lo, t_hi,
        H=H, ROWS=rows, BLOCK_S=BLOCK_S, NUM_STAGES=stages, PINGPONG=pingpong,
        red_layout=red_layout, FILTER=survivors is not None, CAP=cap, flt_layout=flt_layout,
        DEFER_STORE=survivors is not None and defer_store, TABLE=table,
        MMA_K=MMA_K_BY_DTYPE[q.dtype], KEY_SCALE=k_scale is not None, RELU=relu,
        SCAN_SLOTS=scan_slots, MMA_AHEAD=mma_ahead, PART_MAJOR=part_major,
        HEAD_SUM_TRANSPOSE=head_sum_transpose,
        CONSUMER_WARPS=CONSUMER_WARPS, PRODUCER_WARPS=PRODUCER_WARPS,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=CONSUMER_WARPS, maxnreg=MAXNREG,
    )

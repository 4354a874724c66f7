"""HyTopK Triton kernel: fused indexer scoring and exact streaming top-k, no score table.

Shapes: q [B, T, H, D], k [B, S, D] (bf16, fp16 or fp32; or e4m3 with fp32 scales q_scale
[B, T, H] and k_scale [B, S], `ops/fp8_quant.py`), weights [B, T, H] (any float), positions int64
[B, T] / [B, S]. Returns indices int32 [B, T, topk] and scores fp32 [B, T, topk].
Algorithm: a persistent grid; each program takes blocks of R query rows (R x H (row, head)
pairs: the GEMM's N with the key tile as M, `HyTopKOptions.keys_on_m`), streams key tiles from
the diagonal backwards, computes fp32 scores, drops those under the row's running threshold,
appends survivors as packed int64 keys (order-preserving score bits << 32 | ~index) to a
per-row buffer of CAP >= max(topk + block_n, min_cap) entries (each at a slot from the row's
atomic counter, `atomic_slots`; as inline PTX in the scores' registers, `append_ptx`), and
when the buffer may overflow keeps its top-k, found by a bitwise radix select (the k-th key
becomes the new threshold). The row's top-k set is written
unsorted; a row-chunked torch pass decodes it, sorted unless the caller asks for the set only
(`sort_in_kernel`: the kernel sorts and decodes each row itself). `sample_keys`: each row's
threshold starts from a guess made on a sample of its keys, and a block whose guess proves
too high is redone without one by a second launch. Variants and tunings come in a
`HyTopKOptions` (`kernels/options.py`).

FP8 (e4m3 q and k): the same kernel with fp8 tensor-core products accumulated in fp32; q's
per-(token, head) scale is folded into the head weight before the launch and k's per-token scale
multiplies each key's head sum (scales are positive powers of two, so both commute with the ReLU
and are exact), as DeepSeek-V3.2's fp8_index applies them.

Without ReLU the head sum folds into one fp32 query a row (sum_h w_h q_h); with bf16 keys the
kernel takes it as three bf16 parts whose sum is that query exactly (`bf16_parts`), each a head
of weight 1, so it runs the same keys-on-M bf16 path as a four-head indexer.

Key-tile pruning (`HyTopKOptions.prune`): a pre-pass (_key_tile_bounds) stores, per key tile j
of BN keys, a centroid c_j and a radius rho_j that covers the rounding of the kernel's own dot
products. Before a group of tiles, each program computes an upper bound U[t, j] on every score
the kernel could compute in tile j for its rows t (one [R * HP, D] x [D, G] product against the
group's centroids), and skips the tiles whose bound lies strictly below the running threshold
of every row that can see them. The kept tiles' keys are the same as without pruning (a
skipped key could never have entered the buffer), so the outputs are bit-identical.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.checks import triton_interpret, warn_once
from megatron_hyscale.ops.fp8_quant import FP8_DTYPE, dequantize
from megatron_hyscale.ops.kernels.common import (
    MAX_TMA_BOX,
    MAX_TMA_ROWS,
    MIN_DOT,
    fix_interpreter,
)
from megatron_hyscale.ops.kernels.options import HyTopKOptions

fix_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1

# GEMM rows per program (R query rows x padded heads): 128 feeds wgmma a full-height tile.
GEMM_ROWS = 128
# The same with fewer than SMALL_HEADS (padded) heads a row, e.g. QSA's 4: 16 rows of 4 heads.
# The per-row selection work then dominates the tiny GEMM, and 32 rows (128 // 4) kept too much
# of it in registers: compiled for sm_90a (keys on M), 16 rows run a 939-instruction tile loop
# without spills where 32 rows ran 3686 (heads on M) with 129 spill loads / stores.
SMALL_HEADS = 32
SMALL_HEADS_GEMM_ROWS = 64
# relu=False folds the heads into one fp32 query a row; with bf16 keys the kernel takes it as
# this many bf16 parts (bf16_parts), each a head of weight 1 (padded to 4: QSA's path).
FOLDED_PARTS = 3
# Query rows per program for the folded query of other key dtypes (fp32 operands, rows on M).
ROWS_NO_RELU = 32
# Temporary bytes per row chunk of the final sort-and-decode pass.
FINISH_CHUNK_BYTES = 256 << 20
# `HyTopKOptions.head_major` applies with the keys on M, 4 to HEAD_MAJOR_MAX_HEADS padded heads
# and at least HEAD_MAJOR_MIN_ROWS rows a program: a wgmma accumulator spreads each 8 columns of
# N over a register pair in 4 lanes, so 4 rows' head pairs fill those columns and a row's heads
# stay in one thread, where the head sum can repeat the row-major order (see _head_sum). With 2
# heads the two orders coincide. Not 8 padded heads: on the H200 (2026-12-03) 6 heads padded to
# 8 selected differently from the row-major order in 14 of 8192 random rows (near-ties). The
# sum tree is the same; the select kernel's PTX (`inspect_sm90.py`, HEAD_MAJOR at HP 8) fuses a
# head pair's two weight products into one FMA the other way round in half of the rows
# (fma(x1, w1, x0 * w0) where row-major has fma(x0, w0, x1 * w1)): the compiler's contraction,
# which the kernel does not pin. So 5 to 8 heads keep the row-major columns (no model HyScale
# targets has 5 to 8 indexer heads).
HEAD_MAJOR_MAX_HEADS = 4
HEAD_MAJOR_MIN_ROWS = 4
# `HyTopKOptions.maxnreg`: ptxas's range of registers a thread on sm_90.
MIN_MAXNREG = 24
MAX_MAXNREG = 255
_LOW32 = 0xFFFFFFFF
_KEY_MIN = -(1 << 63)

# Dot products of fp32 operands: "tf32x3" runs three TF32 tensor-core products (hi * hi +
# hi * lo + lo * hi), dropping only lo * lo (relative 2^-22 of each product, far inside the
# fp32 rounding bound the GPU tests allow, and exact for integer values below 2^11 such as the
# exactness tests'). "ieee" is exact fp32 on CUDA cores: compiled for sm_90a the relu=False
# kernel then spills 3688 bytes a thread, against 568 with "tf32x3" (not yet timed).
FP32_DOT_PRECISION = tl.constexpr("tf32x3")
# fp32 operations per product term that the pruning bound counts for such a dot (see _launch).
TF32X3_OPS_PER_TERM = 4
# Smallest K of an fp8 product: Hopper's fp8 wgmma takes 32 channels a step.
FP8_MIN_DOT = 32

# `HyTopKOptions.sample_keys`: a row block samples its keys when its rows see at least this many
# candidate buffers' worth of keys (below, the stream compacts a few times at most anyway).
SAMPLE_MIN_BUFFERS = tl.constexpr(4)
# The sampled guess is the sample's j-th largest key with j = e + SAMPLE_SIGMAS sqrt(e) + 2,
# e = topk * sample / visible keys: the expected number of top-k keys in the sample plus this
# many standard deviations. That count is binomial (a sample without replacement only narrows
# it), about Poisson(e), whose tail past j is 5e-5 to 2.4e-4 for e from 128 down to 2: the
# chance that a row's guess lies above its k-th key and its block is redone.
SAMPLE_SIGMAS = tl.constexpr(4.0)

# Modes: the real kernel, and two measurement variants that share the same GEMM loop.
MODE_SELECT = 0  # exact top-k
MODE_SCORES_ONLY = 1  # GEMM + ReLU/weight/head-sum epilogue, no top-k (writes each row's max)
MODE_TABLE = 2  # write the row block's scores to a [rows, S] table (table-then-select baseline)

# Upper bound on the relative error of one fp32 operation anywhere in the score computation
# (a product, an addition of the tensor-core or CUDA-core accumulation, a square root): 4x the
# unit roundoff 2^-24 of round-to-nearest. Tensor cores may truncate instead of rounding when
# they accumulate (Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021: error up to
# 2^-23 per addition), so 2^-22 keeps a factor of 2 of margin over that too.
EPS_OP = 2.0**-22
# Padding of the bound's slack coefficient over the (2 H + 5) EPS_OP the proof needs (see
# _slack_coef): room for one or two extra roundings the compiler might introduce.
SLACK_EXTRA_OPS = 16
# fp64 elements per chunk of the bound pre-pass (bounds its temporaries to ~64 MiB each).
BOUND_CHUNK_ELEMS = 8 << 20


@triton.jit
def _low32_mask():
    return (tl.full([], 1, tl.int64) << 32) - 1


@triton.jit
def _pack(score, index):
    """int64 key: larger key = higher score, then smaller index; -0.0 packs as +0.0."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (_low32_mask() - index.to(tl.int64))


@triton.jit
def _pack_lean(score, index):
    """_pack with the -0.0 fold as one IEEE addition (-0.0 + 0.0 = +0.0 in round to nearest,
    every other value unchanged, subnormals included: the kernels do not flush them) instead of
    a compare and a select."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (_low32_mask() - index.to(tl.int64))


@triton.jit
def _unpack_score(key):
    hi = (key >> 32).to(tl.int32)
    bits = hi ^ ((hi >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _unpack_index(key):
    return (_low32_mask() - (key & _low32_mask())).to(tl.int32)


@triton.jit
def _logits(a, b, RELU: tl.constexpr, IEEE: tl.constexpr, FP8_ACC: tl.constexpr):
    """a @ b^T with fp32 accumulation, ReLU'd when RELU; fp32 operands (IEEE: fp32 inputs or
    the folded relu=False query) go through FP32_DOT_PRECISION. FP8_ACC: e4m3 operands' channels
    summed in the tensor core's own adder before each fp32 addition (None: Triton's default,
    all of them on Hopper; `HyTopKOptions.fp8_imprecise_acc`)."""
    if IEEE:
        out = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)),
                     input_precision=FP32_DOT_PRECISION)
    else:
        out = tl.dot(a, tl.trans(b), max_num_imprecise_acc=FP8_ACC)
    if RELU:
        out = tl.maximum(out, 0.0)
    return out


@triton.jit
def _per_row(v, KEYS_ON_M: tl.constexpr):
    """A per-row vector [R] broadcast against a tile of scores ([BN, R] or [R, BN])."""
    if KEYS_ON_M:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def _per_key(v, KEYS_ON_M: tl.constexpr):
    """A per-key vector [BN] broadcast against a tile of scores ([BN, R] or [R, BN])."""
    if KEYS_ON_M:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def _head_sum(x, BN: tl.constexpr, R: tl.constexpr, HP: tl.constexpr,
              HEAD_MAJOR: tl.constexpr):
    """Weighted logits [BN, R * HP] (keys on M) summed over each row's heads: [BN, R].

    The wgmma accumulator gives lane q of a quad the register pair of columns 8j + 2q, 8j + 2q
    + 1 in each 8-column block j. Row-major columns (r * HP + h) spread a row's heads over the
    lanes of its quad: Triton adds each register pair (heads 2p, 2p + 1, the weight products
    fused into one FMA), then the pairs across lanes xor 2, then xor 1, leaving each score in
    two or four lanes. Pair-major columns (HEAD_MAJOR: (h // 2) * 2R + 2r + h % 2, with 4 or 8
    padded heads and at least 4 rows) keep each head pair in a register pair too, and all of a
    row's pairs in one thread: the sums below add the same pairs (the same FMAs, PTX checked
    with Triton 3.6) and then the pairs in the lanes' order, so the scores are the same bit for
    bit (fp32 addition commutes but does not associate), without shuffles, one lane a score.
    """
    if HEAD_MAJOR:
        pairs = tl.sum(tl.reshape(x, [BN, HP // 2, R, 2]), axis=3)  # heads 2p, 2p + 1
        if HP == 8:  # pair p = 2 q1 + q0 lies in lane q: xor 2 (q1) first, then xor 1
            return tl.sum(tl.sum(tl.reshape(pairs, [BN, 2, 2, R]), axis=1), axis=1)
        elif HP == 4:
            return tl.sum(pairs, axis=1)
        else:
            return tl.reshape(pairs, [BN, R])
    else:
        return tl.sum(tl.reshape(x, [BN, R, HP]), axis=2)


@triton.jit
def _head_sum_rows(x, R: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
                   HEAD_MAJOR: tl.constexpr):
    """[R * HP, G] (GEMM rows in the kernel's order) summed over each row's heads: [R, G]."""
    if HEAD_MAJOR:
        return tl.sum(tl.sum(tl.reshape(x, [HP // 2, R, 2, G]), axis=2), axis=0)
    else:
        return tl.sum(tl.reshape(x, [R, HP, G]), axis=1)


@triton.jit
def _pick(vec, offs, i):
    """vec[i] as a scalar (i may be a run-time value)."""
    return tl.sum(tl.where(offs == i, vec, 0), axis=0)


@triton.jit
def _kth_largest(buf, k):
    """Exact k-th largest int64 of buf (k <= number of real entries): bitwise radix select.

    Builds the answer from the top bit down, keeping a bit when at least k keys lie at or above
    the prefix: 32 count-reductions over registers for the score half of the keys, and 32 more
    for the index half only when the k-th score is tied (packed keys are distinct, so without
    a tie the one key with that score is the answer).
    """
    sign = tl.full([], -9223372036854775807 - 1, tl.int64)
    ukey = (buf ^ sign).to(tl.uint64, bitcast=True)  # signed order -> unsigned order
    zero = tl.zeros([], dtype=tl.uint32)
    return _kth_of_halves((ukey >> 32).to(tl.uint32), (ukey & 0xFFFFFFFF).to(tl.uint32), k,
                          zero, 0, zero, 0) ^ sign


@triton.jit
def _radix_select(x, k, p, start):
    """The k-th largest of the uint32 x (counted at or above each trial), its bits from 31 -
    start down given the bits above (p: what every candidate shares): one count reduction a
    bit."""
    one = tl.full([], 1, tl.uint32)
    for i in range(start, 32):
        trial = p | (one << (p * 0 + (31 - i)))
        if tl.sum((x >= trial).to(tl.int32), axis=0) >= k:
            p = trial
    return p


@triton.jit
def _kth_of_halves(hi, lo, k, p_hi, hi_from, p_lo, lo_from):
    """_kth_largest on the unsigned halves of the keys (unsigned order), the select of each
    half starting at bit 31 - *_from with the bits above it given (p_hi, p_lo: what every
    candidate shares); returns the key in unsigned order."""
    one = tl.full([], 1, tl.uint32)
    p_hi = _radix_select(hi, k, p_hi, hi_from)
    # p_hi is the k-th largest score half; the answer is the (k - n_gt)-th largest index half
    # among the keys whose score half equals it.
    tie = hi == p_hi
    n_tie = tl.sum(tie.to(tl.int32), axis=0)
    if n_tie == 1:
        p_lo = tl.max(tl.where(tie, lo, 0), axis=0)
    else:
        rank = k - tl.sum((hi > p_hi).to(tl.int32), axis=0)
        for i in range(lo_from, 32):
            trial = p_lo | (one << (p_lo * 0 + (31 - i)))
            if tl.sum((tie & (lo >= trial)).to(tl.int32), axis=0) >= rank:
                p_lo = trial
    kth = (p_hi.to(tl.uint64) << 32) | p_lo.to(tl.uint64)
    return kth.to(tl.int64, bitcast=True)


@triton.jit
def _bit_length(x):
    """Bits of the uint32 x (0 for 0), or one more when the nearest fp32 of x is the next power
    of two (x = 2^b - small): never fewer. The fp32 exponent gives it without a count-leading-
    zeros instruction (which the interpreter lacks)."""
    e = (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126
    return tl.where(x == 0, 0, tl.minimum(e, 32))


@triton.jit
def _high_bits(x, n_low):
    """x (uint32) with its n_low lowest bits cleared (0 <= n_low <= 32)."""
    ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    low = tl.where(n_low > 0, ones >> (tl.maximum(32 - n_low, 0) + x * 0), x * 0)
    return x ^ (x & low)


@triton.jit
def _kth_largest_bounded(buf, k, floor, n_index):
    """_kth_largest when every real key of buf is >= floor and every index < n_index (keys
    hold 2^32 - 1 - index in their low half): the bits that all keys from floor to the largest
    one share are the answer's too, and so are the low halves' top bits (all ones), so the
    select starts below them. One max reduction buys 32 - bit_length(floor ^ max) score rounds
    (the buffer's scores span a few binades above the row's threshold: most exponent bits are
    shared) and 32 - bit_length(n_index - 1) index rounds."""
    sign = tl.full([], -9223372036854775807 - 1, tl.int64)
    ukey = (buf ^ sign).to(tl.uint64, bitcast=True)  # signed order -> unsigned order
    hi = (ukey >> 32).to(tl.uint32)
    top = tl.max(hi, axis=0)
    free_hi = _bit_length((((floor ^ sign).to(tl.uint64, bitcast=True)) >> 32).to(tl.uint32)
                          ^ top)
    free_lo = _bit_length((n_index - 1).to(tl.uint32))
    return _kth_of_halves(hi, (ukey & 0xFFFFFFFF).to(tl.uint32), k, _high_bits(top, free_hi),
                          32 - free_hi, _high_bits(tl.full([], 0xFFFFFFFF, tl.uint32), free_lo),
                          32 - free_lo) ^ sign


@triton.jit
def _compact_row(row_ptr, offs_c, n, k, floor=None, n_index=None):
    """Keep the k largest of the n keys at row_ptr (keys are distinct), packed to the front, in
    their current order; return the k-th largest key (the row's new threshold). With floor (a
    key no larger than any of them) and n_index (indices are below it): the bounded select."""
    key_min = tl.full([], -9223372036854775807 - 1, tl.int64)
    tl.debug_barrier()  # appends by other threads are visible
    buf = tl.load(row_ptr + offs_c, mask=offs_c < n, other=key_min)
    if floor is None:
        kth = _kth_largest(buf, k)
    else:
        kth = _kth_largest_bounded(buf, k, floor, n_index)
    keep = (buf >= kth) & (offs_c < n)
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # every thread has read the row before it is overwritten
    tl.store(row_ptr + slot, buf, mask=keep)
    return kth


# HyTopKOptions.row_sort values, as the kernels' ROW_SORT constexpr.
ROW_SORTS = {"bitonic": 0, "bitonic_regs": 1}
# The row's sort-index bits that bitonic_regs compares inside a thread (see _sort_axis).
SORT_REG_BITS = tl.constexpr(4)


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.constexpr_function
def _sort_axis(n, j):
    """Hypercube axis (0 outermost, of n) on which bitonic_regs runs its steps on sort-index bit
    j. Any bijection sorts (the row starts as a set; the ranks come out permuted alike, see
    _sort_desc_regs). This one serves the layout Triton gives a [2048] int64 load with 4 warps
    (element bit 0: registers, 1-5: lanes, 6-7: warps, 8-10: registers): bit j takes part in
    n - j of the 66 steps, so the low bits go to registers, the next to lanes (shuffles) and
    the top two, used 3 times in all, to warps (shared memory and a barrier)."""
    pref = [0] + list(range(8, n)) + list(range(1, min(n, 6))) + list(range(6, min(n, 8)))
    return n - 1 - pref[j]


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _axis_bit(N: tl.constexpr, ax: tl.constexpr):
    """0 / 1 along hypercube axis ax of [2] * N, broadcast along the others."""
    return tl.reshape(tl.arange(0, 2), [1] * ax + [2] + [1] * (N - 1 - ax))


@triton.jit
def _exchange(h, ax: tl.constexpr, desc, N: tl.constexpr, PAIRED: tl.constexpr):
    """One bitonic compare-exchange of the hypercube h ([2] * N int64) along axis ax: each pair
    ordered ascending, or descending where desc (broadcast over h) is 1. PAIRED (an axis held in
    registers): the pair split apart, one comparison and two selects a pair; else each element
    takes its partner (an xor reduction over the axis: a shuffle across lanes) and keeps the
    lower or the higher, one comparison an element."""
    if PAIRED:
        A: tl.constexpr = 2**ax
        C: tl.constexpr = 2 ** (N - 1 - ax)
        lo, hi = tl.split(tl.permute(tl.reshape(h, [A, 2, C]), (0, 2, 1)))
        d, _ = tl.split(tl.permute(tl.reshape(desc + tl.zeros(h.shape, tl.int32), [A, 2, C]),
                                   (0, 2, 1)))
        swap = (lo > hi) != (d != 0)
        pair = tl.join(tl.where(swap, hi, lo), tl.where(swap, lo, hi))
        return tl.reshape(tl.permute(pair, (0, 2, 1)), [2] * N)
    else:
        other = h ^ tl.reduce(h, ax, _xor, keep_dims=True)
        return tl.where((h > other) != (desc ^ _axis_bit(N, ax)), other, h)


@triton.jit
def _bitonic_merge_stage(h, s: tl.constexpr, N: tl.constexpr):
    """Stage s (1..N) of a bitonic sort over sort-index bits: runs of 2^s sorted, alternately
    ascending and descending by bit s (the last stage descending)."""
    if s < N:
        desc = _axis_bit(N, _sort_axis(N, s))
    else:
        desc = tl.full([1] * N, 1, tl.int32)
    for i in tl.static_range(s):
        h = _exchange(h, _sort_axis(N, s - 1 - i), desc, N, s - 1 - i < SORT_REG_BITS)
    return h


@triton.jit
def _sort_desc_regs(buf, KP: tl.constexpr):
    """buf [KP] int64 (KP a power of two >= 2) sorted descending by a bitonic network whose
    steps on the most used sort-index bits run inside a thread (_sort_axis): returns the keys
    and each one's rank (int32 [KP]). Element e holds rank sum_j bit _sort_axis(j) of e << j:
    scattering by rank writes the row in order without moving the keys between threads."""
    N: tl.constexpr = _log2(KP)
    h = tl.reshape(buf, [2] * N)
    rank = tl.zeros([1] * N, tl.int32)
    for s in tl.static_range(1, N + 1):
        h = _bitonic_merge_stage(h, s, N)
        rank = rank + (_axis_bit(N, _sort_axis(N, s - 1)) << (s - 1))
    return tl.reshape(h, [KP]), tl.reshape(rank + tl.zeros(h.shape, tl.int32), [KP])


@triton.jit
def _swap_halves(key, key_min):
    """The packed key with its 32-bit halves swapped ((LOW32 - index) high, the score's bits
    low), INT64_MIN (an empty slot) kept: sorted descending, such keys give increasing key
    indices (every LOW32 - index of an index below 2^31 - 1 lies above INT64_MIN's high half).
    Its own inverse."""
    low = _low32_mask()
    return tl.where(key == key_min, key, ((key & low) << 32) | ((key >> 32) & low))


@triton.jit
def _write_row(row_ptr, n, out_off, out_idx_ptr, out_score_ptr, TOPK: tl.constexpr,
               KP: tl.constexpr, ORDERED: tl.constexpr, ROW_SORT: tl.constexpr,
               KEY_ORDER: tl.constexpr = False):
    """Decode the row's n <= TOPK keys (at row_ptr) into indices and scores at out_off, sorted
    by key (score desc, index asc) when ORDERED, by increasing index with KEY_ORDER too, -1 /
    -inf after them: what _finish does, without the round trip of the packed halves through
    global memory. KP: TOPK rounded up to a power of two, the sort's width (empty slots hold
    INT64_MIN, which sorts last). ROW_SORT: `ROW_SORTS[HyTopKOptions.row_sort]` (tl.sort, or
    _sort_desc_regs)."""
    key_min = tl.full([], -9223372036854775807 - 1, tl.int64)
    offs = tl.arange(0, KP)
    buf = tl.load(row_ptr + offs, mask=offs < n, other=key_min)
    pos = offs
    if ORDERED:
        if KEY_ORDER:
            buf = _swap_halves(buf, key_min)
        if ROW_SORT == 1 and KP > 1:
            buf, pos = _sort_desc_regs(buf, KP)
        else:
            buf = tl.sort(buf, descending=True)
        if KEY_ORDER:
            buf = _swap_halves(buf, key_min)
    empty = buf == key_min
    score = tl.where(empty, float("-inf"), _unpack_score(buf))
    index = tl.where(empty, -1, _unpack_index(buf))
    tl.store(out_score_ptr + out_off + pos, score.to(tl.int32, bitcast=True), mask=pos < TOPK)
    tl.store(out_idx_ptr + out_off + pos, index, mask=pos < TOPK)


@triton.jit
def _write_rows_kernel(keys_ptr, count_ptr, out_idx_ptr, out_score_ptr, n_rows, CAP,
                       TOPK: tl.constexpr, KP: tl.constexpr, ORDERED: tl.constexpr,
                       ROW_SORT: tl.constexpr, KEY_ORDER: tl.constexpr = False,
                       SELECT: tl.constexpr = False, CP: tl.constexpr = 1):
    """_write_row alone over rows (tests, `bench_selection.py --row-sort-micro`,
    `inspect_sm90.py`; with SELECT the survivors' select of `hytopk_sm90`): keys int64
    [rows, CAP] (a row's first count[r] <= TOPK entries are its distinct keys), outputs int32
    [rows, TOPK] (scores as their fp32 bits). SELECT: a count may exceed TOPK, and CAP (read
    as CAP: the row's first CAP keys, whose top-k the caller then discards; CP is CAP rounded
    up to a power of two): such a row's TOPK largest keys are first compacted to its front in
    place (`_compact_row`'s radix select), then written."""
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        r64 = r + tl.zeros([], tl.int64)
        n = tl.load(count_ptr + r)
        if SELECT:
            n = tl.minimum(n, CAP)
            if n > TOPK:
                _compact_row(keys_ptr + r64 * CAP, tl.arange(0, CP), n, TOPK)
                tl.debug_barrier()  # the compacted row is visible to every thread
                n = n * 0 + TOPK
        _write_row(keys_ptr + r64 * CAP, n, r64 * TOPK, out_idx_ptr, out_score_ptr, TOPK, KP,
                   ORDERED, ROW_SORT, KEY_ORDER)


def write_rows(keys: torch.Tensor, counts: torch.Tensor, topk: int, *, ordered: bool = True,
               options: HyTopKOptions = HyTopKOptions.DEFAULT, programs: int | None = None,
               key_order: bool = False, select: bool = False) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """The select kernel's row output alone (and, select=True, the survivors' select of
    `hytopk_sm90.select_survivors`): keys int64 [rows, cap] (packed, distinct within a
    row's first counts[r] <= topk entries), counts int32 [rows] -> indices int32 and scores
    fp32 [rows, topk], as the kernel writes them with options.row_sort (by increasing index
    with key_order; ordered=False: in buffer order, empty slots last). programs: the grid
    (default: one program a row). select: counts may exceed topk, and cap (the first
    min(count, cap) entries are a row's distinct keys): each row's topk largest of those are
    taken, compacting keys in place (its contents past a row's first topk are then
    undefined)."""
    rows, cap = keys.shape
    if select and not keys.is_contiguous():
        raise ValueError("keys must be contiguous with select=True (compacted in place)")
    indices = torch.empty(rows, topk, dtype=torch.int32, device=keys.device)
    scores = torch.empty(rows, topk, dtype=torch.float32, device=keys.device)
    if rows == 0:
        return indices, scores
    _write_rows_kernel[(programs or max(1, rows),)](
        keys.contiguous(), counts.to(torch.int32).contiguous(), indices,
        scores.view(torch.int32), rows, cap, TOPK=topk, KP=triton.next_power_of_2(topk),
        ORDERED=ordered, ROW_SORT=_row_sort_code(options), KEY_ORDER=ordered and key_order,
        SELECT=select, CP=triton.next_power_of_2(cap) if select else 1,
        num_warps=options.num_warps)
    return indices, scores


def _row_sort_code(options: HyTopKOptions) -> int:
    if options.row_sort not in ROW_SORTS:
        raise ValueError(f"options.row_sort must be one of {list(ROW_SORTS)}, got "
                         f"{options.row_sort!r}")
    return ROW_SORTS[options.row_sort]


# The atomic-slot append in the scores' own register layout (`HyTopKOptions.append_ptx`):
# inline PTX, one predicated instruction a score. tl.store and tl.atomic_add of the same values
# first move them, their pointers and masks into the blocked layout of Triton's coalescing pass,
# through shared memory and barriers on every key tile (the slots are scattered, so there is
# nothing to coalesce).
_STORE_B64_WHERE = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                                "@p st.global.b64 [$1], $2; mov.b32 $0, 0; }")
_ADD_ONE_WHERE = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; "
                              "@p atom.relaxed.gpu.global.add.u32 $0, [$1], 1; }")


@triton.jit
def _store_where(ptr, value, mask, PTX: tl.constexpr):
    """tl.store(ptr, value, mask=mask) of int64 values; PTX: as one st.global each."""
    if PTX:
        tl.inline_asm_elementwise(_STORE_B64_WHERE, "=r,l,l,r",
                                  [ptr.to(tl.int64), value, mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _slot_add(ptr, mask, PTX: tl.constexpr):
    """tl.atomic_add(ptr, 1, mask=mask, sem="relaxed") on int32 counters: the old values (0
    where mask is off, with PTX); PTX: as one atom.global each."""
    if PTX:
        return tl.inline_asm_elementwise(_ADD_ONE_WHERE, "=r,l,r",
                                         [ptr.to(tl.int64), mask.to(tl.int32)],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.atomic_add(ptr, 1, mask=mask, sem="relaxed")


@triton.jit
def _tile_scores(kt, s, qt, w, ks_ptr, kpos_ptr, b, S, hi, qpos, row_ok, R: tl.constexpr,
                 HP: tl.constexpr, BN: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr,
                 FP8_ACC: tl.constexpr, KEYS_ON_M: tl.constexpr, HEAD_MAJOR: tl.constexpr,
                 K_SCALED: tl.constexpr, CAUSAL: tl.constexpr, LEAN: tl.constexpr):
    """Scores of the BN keys kt (key indices s; rows past S zero) for the block's R rows, and
    which (key, row) pairs are visible. Both stay in the GEMM's orientation: [BN, R] (keys x
    rows) with KEYS_ON_M, [R, BN] otherwise; transposing them to one orientation costs a
    shared-memory round trip and barriers on every tile (compiled for sm_90a with QSA's 4
    heads: 8 barriers a tile)."""
    s_ok = s < S
    if KEYS_ON_M:
        # K_tile @ Q^T: the (row, head) pairs are the MMA's N, so the head sum reduces within
        # each thread and its quad (no shared memory).
        logits_t = _logits(kt, qt, RELU, IEEE, FP8_ACC) * w[None, :]
        scores = _head_sum(logits_t, BN, R, HP, HEAD_MAJOR)
    else:
        logits = _logits(qt, kt, RELU, IEEE, FP8_ACC) * w[:, None]
        if HP == 1:
            scores = logits
        else:
            scores = tl.sum(tl.reshape(logits, [R, HP, BN]), axis=1)
    if K_SCALED:
        # k's scale after the head sum: one multiply a score, not one a logit.
        k_scale = tl.load(ks_ptr + b * S + s, mask=s_ok, other=0.0)
        scores = scores * _per_key(k_scale, KEYS_ON_M)
    if CAUSAL and LEAN:
        # Positions as int32 ranks (see _position_ranks), -1 for rows past T, INT32_MAX for
        # keys past S: one compare says it all (s < hi follows from kpos <= qpos).
        k_rank = tl.load(kpos_ptr + b * S + s, mask=s_ok, other=2147483647)
        vis = _per_key(k_rank, KEYS_ON_M) <= _per_row(qpos, KEYS_ON_M)
    else:
        vis = _per_row(row_ok, KEYS_ON_M) & _per_key(s_ok, KEYS_ON_M)
        if CAUSAL:
            kpos = tl.load(kpos_ptr + b * S + s, mask=s_ok, other=0)
            vis = (vis & (_per_key(s, KEYS_ON_M) < _per_row(hi, KEYS_ON_M))
                   & (_per_key(kpos, KEYS_ON_M) <= _per_row(qpos, KEYS_ON_M)))
    return scores, vis


@triton.jit
def _sample_guess(scratch, thr, thr_score, k_base, qt, w, ks_ptr, kpos_ptr, b, S, hi, qpos,
                  row_ok, stride_ks, stride_kd, offs_d, d_ok, offs_n, offs_r, R: tl.constexpr,
                  HP: tl.constexpr, BN: tl.constexpr, RELU: tl.constexpr, IEEE: tl.constexpr,
                  FP8_ACC: tl.constexpr, KEYS_ON_M: tl.constexpr, HEAD_MAJOR: tl.constexpr,
                  K_SCALED: tl.constexpr, CAUSAL: tl.constexpr, LEAN: tl.constexpr,
                  CAP: tl.constexpr, TOPK: tl.constexpr, NSAMP: tl.constexpr,
                  BOUNDED_SELECT: tl.constexpr):
    """A first threshold for each row of the block, guessed from NSAMP evenly spaced keys
    (`HyTopKOptions.sample_keys`): returns the rows' thr, thr_score and which rows got a guess.

    The sample is scored like any tile and written to the rows' buffers (slots 0 .. NSAMP - 1,
    INT64_MIN where not visible); a row's guess is the j-th largest of its sample (see
    SAMPLE_SIGMAS), and its stream then keeps only keys at or above it. That is exact if at
    least TOPK of the row's keys reach the guess, which the caller checks at the end of the
    stream (else the block is redone without guesses); the buffer slots are free again once
    this returns. Rows that see fewer than SAMPLE_MIN_BUFFERS buffers' worth of keys, or
    whose sample holds fewer than j visible keys, keep thr = INT64_MIN.
    """
    key_min = tl.full([], -9223372036854775807 - 1, tl.int64)
    n_max = tl.max(hi, axis=0)
    guessed = offs_r < 0
    if n_max >= SAMPLE_MIN_BUFFERS * CAP:
        m_vis = tl.zeros([R], dtype=tl.int32)
        for i in range(NSAMP // BN):
            j = i * BN + offs_n
            s = (j.to(tl.int64) * n_max // NSAMP).to(tl.int32)  # distinct: n_max > NSAMP
            kt = tl.load(k_base + s[:, None].to(tl.int64) * stride_ks
                         + offs_d[None, :] * stride_kd, mask=d_ok[None, :], other=0.0)
            scores, vis = _tile_scores(
                kt, s, qt, w, ks_ptr, kpos_ptr, b, S, hi, qpos, row_ok, R, HP, BN, RELU, IEEE,
                FP8_ACC, KEYS_ON_M, HEAD_MAJOR, K_SCALED, CAUSAL, LEAN)
            if LEAN:
                keys = tl.where(vis, _pack_lean(scores, _per_key(s, KEYS_ON_M)), key_min)
            else:
                keys = tl.where(vis, _pack(scores, _per_key(s, KEYS_ON_M)), key_min)
            tl.store(scratch + _per_row(offs_r, KEYS_ON_M) * CAP + _per_key(j, KEYS_ON_M), keys)
            if KEYS_ON_M:
                m_vis += tl.sum(vis.to(tl.int32), axis=0)
            else:
                m_vis += tl.sum(vis.to(tl.int32), axis=1)
        tl.debug_barrier()  # the sample is stored
        offs_s = tl.arange(0, NSAMP)
        for r in range(R):
            m = _pick(m_vis, offs_r, r)
            n = _pick(hi, offs_r, r)
            e = TOPK * m.to(tl.float32) / tl.maximum(n, 1).to(tl.float32)
            j_r = (e + SAMPLE_SIGMAS * tl.sqrt(e)).to(tl.int32) + 2
            if (n >= SAMPLE_MIN_BUFFERS * CAP) & (j_r <= m):
                sample = tl.load(scratch + r * CAP + offs_s)
                if BOUNDED_SELECT:
                    lowest = tl.min(tl.where(sample == key_min, -key_min - 1, sample), axis=0)
                    g = _kth_largest_bounded(sample, j_r, lowest, S)
                else:
                    g = _kth_largest(sample, j_r)
                thr = tl.where(offs_r == r, g - 1, thr)  # keys > g - 1: keys >= g
                thr_score = tl.where(offs_r == r, _unpack_score(g), thr_score)
                guessed = guessed | (offs_r == r)
        tl.debug_barrier()  # every thread has read the sample before the stream appends
    return thr, thr_score, guessed


@triton.jit
def _hytopk_kernel(
    q_ptr, k_ptr, k_desc, w_ptr, qpos_ptr, kpos_ptr, ks_ptr, hi_ptr, order_ptr,
    out_idx_ptr, out_score_ptr, scratch_ptr, count_ptr, table_ptr, cent_ptr, rho_ptr, stats_ptr,
    fail_ptr, T, S, H, n_blocks, blocks_per_batch, table_t0, n_key_tiles, slack,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kd,
    stride_wb, stride_wt, stride_wh,
    D: tl.constexpr, TOPK: tl.constexpr, CAP: tl.constexpr,
    R: tl.constexpr, HP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr,
    RELU: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, MODE: tl.constexpr,
    PRUNE: tl.constexpr, G: tl.constexpr, KEYS_ON_M: tl.constexpr,
    ATOMIC_SLOTS: tl.constexpr, K_SCALED: tl.constexpr, FP8_ACC: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, SORT_OUT: tl.constexpr, ORDERED: tl.constexpr,
    KP: tl.constexpr, NSAMP: tl.constexpr, N_BLOCKS_ON_DEVICE: tl.constexpr,
    LEAN: tl.constexpr, BOUNDED_SELECT: tl.constexpr, ROW_SORT: tl.constexpr,
    APPEND_PTX: tl.constexpr, KEY_TMA: tl.constexpr, KEY_ORDER: tl.constexpr = False,
):
    """One persistent program: blocks of R query rows (R * HP GEMM rows), key tiles of BN.

    With PRUNE (MODE_SELECT only), cent_ptr [B, n_key_tiles, D] (k's dtype) and rho_ptr
    [B, n_key_tiles] fp32 come from _key_tile_bounds, slack from _slack_coef, and stats_ptr
    int64 [programs, 2] receives each program's (tiles pruned, tiles considered). Each group of
    NT tiles (padded to G >= 16 for tl.dot) gets its bound before its first tile:
      A[m, j] = q_m . c_j (computed like the main GEMM), n_m = ||q_m|| (fp32),
      B[m, j] = A[m, j] + n_m * rho_j          >= every logit the kernel computes in tile j,
      U[t, j] = sum_h w+[t, h] act(B[t h, j]) (w+ = max(w, 0) under ReLU; w == 1 otherwise),
      X[t, j] = U[t, j] + slack * sum_h |w[t, h]| (|A| + n * rho)   >= every score of tile j,
    and tile j is skipped when X[t, j] < thr_score[t] for every row t that sees it. The
    threshold only changes between groups, so one decision per group is exact.

    With K_SCALED (e4m3 q and k), ks_ptr [B, S] fp32 holds k's per-token scales, multiplied
    into each key's head sum (q's scales are already in w_ptr).

    KEY_TMA (`HyTopKOptions.key_tma`): the streamed key tiles come through k_desc, a TMA
    descriptor of k as [B * S, D] rows in [BN, BD] boxes (a tile's rows past its batch's S
    read the next batch's keys, or TMA's zeros past the end: either way they are not visible),
    so the compute warps issue no per-row copies; else k_desc is None and the tiles are loaded
    from k_ptr. The sampled keys of NSAMP are gathered from k_ptr either way.
    """
    M: tl.constexpr = R * HP
    pid = tl.program_id(0)
    offs_m = tl.arange(0, M)
    if HEAD_MAJOR:  # pair-major (see _head_sum): head 2 (m // 2R) + m % 2 of row (m // 2) % R
        m_row = (offs_m // 2) % R
        m_head = (offs_m // (2 * R)) * 2 + offs_m % 2
    else:
        m_row = offs_m // HP
        m_head = offs_m % HP
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    offs_c = tl.arange(0, CAP)
    # A compile-time-true mask when D is a power of two: a run-time mask along the contiguous
    # head dim would stop 16-byte async copies, and with them Triton's software pipelining.
    d_ok = offs_d < D
    scratch = scratch_ptr + pid.to(tl.int64) * (R * CAP)
    counts = count_ptr + pid * R  # ATOMIC_SLOTS: each row's fill, in global memory
    key_min = tl.full([], -9223372036854775807 - 1, tl.int64)
    offs_g = tl.arange(0, G)
    n_pruned = tl.zeros([], dtype=tl.int64)
    n_considered = tl.zeros([], dtype=tl.int64)

    if N_BLOCKS_ON_DEVICE:  # a redo of the blocks whose sampled guesses failed (see _launch)
        n_blocks = tl.load(fail_ptr)
    # Blocks come sorted by decreasing work; striding them over programs balances the load.
    # The grid's size, read on the device: as a compiled-in value it would change with the
    # row count of short sequences (fewer row blocks than programs).
    for it in range(pid, n_blocks, tl.num_programs(0)):
        blk = tl.load(order_ptr + it)
        b = blk // blocks_per_batch
        t0 = (blk % blocks_per_batch) * R
        rows = t0 + offs_r
        row_ok = rows < T
        hi = tl.load(hi_ptr + b * T + rows, mask=row_ok, other=0)
        if LEAN:  # int32 ranks (causal), -1 past T: such rows see no key
            qpos = tl.load(qpos_ptr + b * T + rows, mask=row_ok, other=-1)
        else:
            qpos = tl.load(qpos_ptr + b * T + rows, mask=row_ok, other=0)
        n_tiles = tl.cdiv(tl.max(hi, axis=0), BN)

        m_ok = ((t0 + m_row) < T) & (m_head < H)
        q_off = (b.to(tl.int64) * stride_qb + (t0 + m_row).to(tl.int64) * stride_qt
                 + m_head * stride_qh)
        qt = tl.load(q_ptr + q_off[:, None] + offs_d[None, :] * stride_qd,
                     mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        w_off = b.to(tl.int64) * stride_wb + (t0 + m_row).to(tl.int64) * stride_wt
        w = tl.load(w_ptr + w_off + m_head * stride_wh, mask=m_ok, other=0.0).to(tl.float32)
        if PRUNE:
            # Per GEMM row: ||q_m|| in fp32, and the weight of its bound (heads with w <= 0
            # add at most 0 to a ReLU score; without ReLU the folded query, or each of its bf16
            # parts, has w == 1).
            q_f32 = qt.to(tl.float32)
            q_norm = tl.sqrt_rn(tl.sum(q_f32 * q_f32, axis=1))
            if RELU:
                w_pos = tl.where(w > 0.0, w, 0.0)
            else:
                w_pos = w
            w_abs = tl.abs(w)
            cent_base = cent_ptr + b.to(tl.int64) * n_key_tiles * D
            n_considered += n_tiles

        count = tl.zeros([R], dtype=tl.int32)
        if MODE == 0 and ATOMIC_SLOTS:
            tl.store(counts + offs_r, count)
            tl.debug_barrier()
        thr = tl.full([R], -9223372036854775807 - 1, tl.int64)
        thr_score = tl.full([R], float("-inf"), tl.float32)
        best = tl.full([R], float("-inf"), tl.float32)
        k_base = k_ptr + b.to(tl.int64) * stride_kb
        if MODE == 0 and NSAMP > 0:
            thr, thr_score, guessed = _sample_guess(
                scratch, thr, thr_score, k_base, qt, w, ks_ptr, kpos_ptr, b, S, hi, qpos,
                row_ok, stride_ks, stride_kd, offs_d, d_ok, offs_n, offs_r, R, HP, BN, RELU,
                IEEE, FP8_ACC, KEYS_ON_M, HEAD_MAJOR, K_SCALED, CAUSAL, LEAN, CAP, TOPK, NSAMP,
                BOUNDED_SELECT)
        # Diagonal first: under causal masking the nearest keys tend to score highest, so the
        # threshold rises early and later tiles are rejected by one compare. Tiles come in
        # groups of NT: the inner loop has no nested loop, so Triton pipelines its loads, and
        # the buffer (count <= CAP - NT * BN at a group's start) cannot overflow inside it.
        for g in range(tl.cdiv(n_tiles, NT)):
            if PRUNE:
                # Tiles of this group (the g * NT + jj-th from the diagonal, jj < NT).
                tile_g = n_tiles - 1 - (g * NT + offs_g)
                in_g = (offs_g < NT) & (tile_g >= 0)
                cent = tl.load(cent_base + tile_g[:, None].to(tl.int64) * D + offs_d[None, :],
                               mask=in_g[:, None] & d_ok[None, :], other=0.0)
                rho = tl.load(rho_ptr + b.to(tl.int64) * n_key_tiles + tile_g, mask=in_g,
                              other=0.0)
                a_c = _logits(qt, cent, False, IEEE, FP8_ACC)  # computed like the key tiles' logits
                reach = q_norm[:, None] * rho[None, :]
                bnd = a_c + reach
                if RELU:
                    bnd = tl.maximum(bnd, 0.0)
                u_m = bnd * w_pos[:, None]
                mag_m = (tl.abs(a_c) + reach) * w_abs[:, None]
                if HP == 1:
                    u_t = u_m
                    mag_t = mag_m
                else:
                    u_t = _head_sum_rows(u_m, R, HP, G, HEAD_MAJOR)
                    mag_t = _head_sum_rows(mag_m, R, HP, G, HEAD_MAJOR)
                x_t = u_t + slack * mag_t  # [R, G]: >= every score of the tile (see _slack_coef)
                # A row sees a tile if one of its keys lies below the row's end (hi); keys at
                # or past hi are masked, so rows that see nothing never block a skip.
                sees = row_ok[:, None] & ((tile_g * BN)[None, :] < hi[:, None])
                blocked = sees & ~(x_t < thr_score[:, None])
                keep = in_g & (tl.max(blocked.to(tl.int32), axis=0) > 0)
                n_pruned += tl.sum((in_g & ~keep).to(tl.int64), axis=0)
                keep_rank = tl.cumsum(keep.to(tl.int32), axis=0) - 1
                i_lo = 0
                i_hi = tl.sum(keep.to(tl.int32), axis=0)
            else:
                i_lo = g * NT
                i_hi = tl.minimum(n_tiles, g * NT + NT)
            if MODE == 0 and ATOMIC_SLOTS:  # survivors of the last tile, not yet stored
                if KEYS_ON_M:
                    p_keys = tl.zeros([BN, R], dtype=tl.int64)
                    p_slot = tl.zeros([BN, R], dtype=tl.int32)
                    p_surv = tl.zeros([BN, R], dtype=tl.int1)
                else:
                    p_keys = tl.zeros([R, BN], dtype=tl.int64)
                    p_slot = tl.zeros([R, BN], dtype=tl.int32)
                    p_surv = tl.zeros([R, BN], dtype=tl.int1)
            for i in range(i_lo, i_hi):
                if PRUNE:  # the i-th kept tile of the group
                    tile = tl.sum(tl.where(keep & (keep_rank == i), tile_g, 0), axis=0)
                else:
                    tile = n_tiles - 1 - i
                s = tile * BN + offs_n
                if KEY_TMA:
                    kt = k_desc.load([b * S + tile * BN, 0])
                else:
                    kt = tl.load(k_base + s[:, None].to(tl.int64) * stride_ks
                                 + offs_d[None, :] * stride_kd,
                                 mask=(s < S)[:, None] & d_ok[None, :], other=0.0)
                scores, vis = _tile_scores(
                    kt, s, qt, w, ks_ptr, kpos_ptr, b, S, hi, qpos, row_ok, R, HP, BN, RELU,
                    IEEE, FP8_ACC, KEYS_ON_M, HEAD_MAJOR, K_SCALED, CAUSAL, LEAN)
                if MODE == 0 and ATOMIC_SLOTS:
                    # Each survivor takes its slot from its row's counter (an atomic add in
                    # L2, predicated off for the other lanes): no scan and no barrier per tile.
                    # Slots come in any order; the buffer is a set, compacted by value.
                    if LEAN:  # keys > thr implies scores >= thr_score: one int64 compare
                        keys = _pack_lean(scores, _per_key(s, KEYS_ON_M))
                        surv = vis & (keys > _per_row(thr, KEYS_ON_M))
                    else:
                        cand = vis & (scores >= _per_row(thr_score, KEYS_ON_M))
                        keys = _pack(scores, _per_key(s, KEYS_ON_M))
                        surv = cand & (keys > _per_row(thr, KEYS_ON_M))
                    # The previous tile's survivors are stored now, a tile after their atomics
                    # were issued: the GEMM in between hides the atomics' L2 round trip.
                    _store_where(scratch + _per_row(offs_r, KEYS_ON_M) * CAP + p_slot, p_keys,
                                 p_surv, APPEND_PTX)
                    p_slot = _slot_add(
                        counts + _per_row(offs_r, KEYS_ON_M) + 0 * _per_key(s, KEYS_ON_M), surv,
                        APPEND_PTX)
                    p_keys = keys
                    p_surv = surv
                elif MODE == 0:
                    # Cheap fp32 pre-filter; the exact int64 comparison runs only on tiles with
                    # a candidate (a score equal to the threshold's can still win on its index).
                    cand = vis & (scores >= _per_row(thr_score, KEYS_ON_M))
                    if tl.max(cand.to(tl.int32)) > 0:
                        if LEAN:
                            keys = _pack_lean(scores, _per_key(s, KEYS_ON_M))
                        else:
                            keys = _pack(scores, _per_key(s, KEYS_ON_M))
                        surv = (cand & (keys > _per_row(thr, KEYS_ON_M))).to(tl.int32)
                        if KEYS_ON_M:
                            slot = count[None, :] + tl.cumsum(surv, axis=0) - 1
                            count += tl.sum(surv, axis=0)
                        else:
                            slot = count[:, None] + tl.cumsum(surv, axis=1) - 1
                            count += tl.sum(surv, axis=1)
                        tl.store(scratch + _per_row(offs_r, KEYS_ON_M) * CAP + slot, keys,
                                 mask=surv > 0)
                elif MODE == 1:
                    masked = tl.where(vis, scores, float("-inf"))
                    if KEYS_ON_M:
                        best = tl.maximum(best, tl.max(masked, axis=0))
                    else:
                        best = tl.maximum(best, tl.max(masked, axis=1))
                else:
                    s_ok = s < S
                    t_row = (rows - table_t0).to(tl.int64)
                    tl.store(table_ptr + _per_row(t_row, KEYS_ON_M) * S
                             + _per_key(s, KEYS_ON_M),
                             tl.where(vis, scores, float("-inf")),
                             mask=_per_row(row_ok, KEYS_ON_M) & _per_key(s_ok, KEYS_ON_M))
            if MODE == 0:
                if ATOMIC_SLOTS:
                    _store_where(scratch + _per_row(offs_r, KEYS_ON_M) * CAP + p_slot, p_keys,
                                 p_surv, APPEND_PTX)
                    tl.debug_barrier()  # every append of the group has its slot and is stored
                    count = tl.load(counts + offs_r, volatile=True)
                if tl.max(count) > CAP - NT * BN:
                    # A row might overflow in the next group: keep its top TOPK.
                    for r in range(R):
                        c_r = _pick(count, offs_r, r)
                        if c_r > CAP - NT * BN:
                            if BOUNDED_SELECT:
                                thr_r = _compact_row(scratch + r * CAP, offs_c, c_r, TOPK,
                                                     _pick(thr, offs_r, r), S)
                            else:
                                thr_r = _compact_row(scratch + r * CAP, offs_c, c_r, TOPK)
                            thr = tl.where(offs_r == r, thr_r, thr)
                            thr_score = tl.where(offs_r == r, _unpack_score(thr_r), thr_score)
                            count = tl.where(offs_r == r, TOPK, count)
                    if ATOMIC_SLOTS:
                        tl.debug_barrier()  # every thread has read the counters
                        tl.store(counts + offs_r, count)
                        tl.debug_barrier()

        out_row = (b * T + rows).to(tl.int64) * TOPK
        if MODE == 0 and NSAMP > 0:
            # A guessed row that kept fewer than TOPK keys had a guess above its k-th key: the
            # block goes on the list that the launch without guesses redoes.
            if tl.max((guessed & (count < TOPK)).to(tl.int32), axis=0) > 0:
                tl.store(fail_ptr + 2 + tl.atomic_add(fail_ptr, 1), blk)
            tl.atomic_add(fail_ptr + 1, tl.sum(guessed.to(tl.int32), axis=0))
        if MODE == 0:
            for r in range(R):
                if t0 + r < T:
                    c_r = _pick(count, offs_r, r)
                    if c_r > TOPK:
                        if BOUNDED_SELECT:
                            _compact_row(scratch + r * CAP, offs_c, c_r, TOPK,
                                         _pick(thr, offs_r, r), S)
                        else:
                            _compact_row(scratch + r * CAP, offs_c, c_r, TOPK)
                        c_r = TOPK
                    tl.debug_barrier()
                    if SORT_OUT:
                        _write_row(scratch + r * CAP, c_r, _pick(out_row, offs_r, r),
                                   out_idx_ptr, out_score_ptr, TOPK, KP, ORDERED, ROW_SORT,
                                   KEY_ORDER)
                    else:
                        # The row's exact top-k set, unsorted, as the two 32-bit halves of
                        # its packed keys (high half in the scores, low half in the indices);
                        # _finish sorts and decodes.
                        buf = tl.load(scratch + r * CAP + offs_c, mask=offs_c < c_r,
                                      other=key_min)
                        o = _pick(out_row, offs_r, r) + offs_c
                        tl.store(out_score_ptr + o, (buf >> 32).to(tl.int32),
                                 mask=offs_c < TOPK)
                        tl.store(out_idx_ptr + o, buf.to(tl.int32), mask=offs_c < TOPK)
            tl.debug_barrier()  # the next block reuses this scratch
        elif MODE == 1:
            tl.store(out_score_ptr + out_row, best, mask=row_ok)
    if PRUNE:
        tl.store(stats_ptr + pid * 2, n_pruned)
        tl.store(stats_ptr + pid * 2 + 1, n_considered)


def _num_programs(device: torch.device, n_blocks: int, options: HyTopKOptions) -> int:
    """Persistent programs: options.num_programs if set, else programs_per_sm a CUDA SM (at
    most one a row block), or interpret_programs under the interpreter."""
    if options.num_programs is not None:
        return options.num_programs
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_blocks, sms * options.programs_per_sm))
    return max(1, min(n_blocks, options.interpret_programs))


def _visible_hi(q_positions, k_positions, causal, T, S):
    """Per row, one past the last visible key index (int32 [B, T]); exact for any positions.

    The suffix minimum of k_positions is non-decreasing, so the last s with
    min(kpos[s:]) <= qpos[t] is the last visible key, found by a binary search.
    """
    B = q_positions.shape[0]
    if not causal:
        return torch.full((B, T), S, dtype=torch.int32, device=q_positions.device)
    suffix_min = k_positions.flip(-1).cummin(-1).values.flip(-1).contiguous()
    hi = torch.searchsorted(suffix_min, q_positions.contiguous(), right=True)
    return hi.to(torch.int32)


def _position_ranks(q_positions, k_positions):
    """int32 ranks [B, T] / [B, S] of the positions among each batch's q and k positions
    together: equal positions share a rank, so kpos[s] <= qpos[t] iff krank[s] <= qrank[t]
    (`HyTopKOptions.lean_filter`: one int32 compare a score instead of two int64 ones)."""
    merged = torch.cat([q_positions, k_positions], dim=-1).sort(dim=-1).values.contiguous()
    rank = [torch.searchsorted(merged, p.contiguous()).to(torch.int32)
            for p in (q_positions, k_positions)]
    return rank[0], rank[1]


def _prepare(q, k, weights, relu, rows, q_scale=None, folded_parts=True):
    """Kernel operands: for relu=False the weights fold into q (one dot product per key); for
    e4m3 q under ReLU, q's per-(token, head) scale folds into the weights (exact: powers of
    two; the caller dequantizes fp8 inputs for relu=False, see _launch)."""
    if relu:
        H = q.shape[2]
        hp = triton.next_power_of_2(H)
        gemm_rows = SMALL_HEADS_GEMM_ROWS if 1 < hp < SMALL_HEADS else GEMM_ROWS
        r = rows or max(1, gemm_rows // hp)
        if q_scale is not None:
            weights = weights.float() * q_scale
        return q, k, weights, hp, r, q.dtype == torch.float32
    if folded_parts and k.dtype == torch.bfloat16:
        # The folded query's three bf16 parts, each a "head" of weight 1: bf16 products
        # (exact, as k is bf16) on the keys-on-M path QSA's four heads take, instead of fp32
        # operands on CUDA-core tf32x3 products with the rows on M (compiled for sm_90a: 664
        # bytes spilled, 108 local loads in the tile loop).
        parts, ones = folded_heads(q, weights)
        hp = triton.next_power_of_2(FOLDED_PARTS)
        return parts, k, ones, hp, rows or max(1, SMALL_HEADS_GEMM_ROWS // hp), False
    q_eff = folded_query(q, weights)
    # Other key dtypes: the dot runs in fp32 (tf32x3) to stay within fp32 rounding.
    ones = torch.ones(q.shape[:2] + (1,), dtype=torch.float32, device=q.device)
    return q_eff.unsqueeze(2), k, ones, 1, rows or ROWS_NO_RELU, True


def folded_query(q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 [B, T, D]: sum_h w[t, h] q[t, h], one query a row. Without ReLU the head sum folds:
    sum_h w[t, h] (q[t, h] . k[s]) == (sum_h w[t, h] q[t, h]) . k[s]."""
    return torch.einsum("bthd,bth->btd", q.float(), weights.float())


def folded_heads(q: torch.Tensor, weights: torch.Tensor, heads: int = FOLDED_PARTS, *,
                 part_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The folded query (`folded_query`) as bf16 "heads": its FOLDED_PARTS bf16 parts
    (`bf16_parts`, summing to it exactly) of weight 1, then zero heads of weight 0 up to
    `heads` (the Gluon kernels take 4): bf16 [B, T, heads, D] and fp32 weights [B, T, heads].
    part_major: the heads stored [B, heads, T, D] (the view returned is permuted to [B, T,
    heads, D])."""
    parts = bf16_parts(folded_query(q, weights))
    B, T, n, D = parts.shape
    if heads == n and not part_major:
        return parts, torch.ones((B, T, n), dtype=torch.float32, device=q.device)
    if part_major:
        q_h = torch.zeros((B, heads, T, D), dtype=torch.bfloat16,
                          device=q.device).permute(0, 2, 1, 3)
    else:
        q_h = torch.zeros((B, T, heads, D), dtype=torch.bfloat16, device=q.device)
    q_h[:, :, :n] = parts
    w_h = torch.zeros((B, T, heads), dtype=torch.float32, device=q.device)
    w_h[:, :, :n] = 1.0
    return q_h, w_h


def bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """fp32 x [..., D] as FOLDED_PARTS bf16 terms [..., 3, D] whose sum is x exactly.

    Each part is the round-to-nearest bf16 (8 significant bits) of what the earlier parts left:
    x - hi is exact in fp32 and spans at most 16 of x's 24 significand bits, its remainder
    after the second part at most 8, which the third holds exactly. Exact for 2^-110 <= |x| <
    2^127 and for 0 (bf16 has fp32's exponents but a subnormal step of 2^-133): below, the
    parts miss x by less than 2^-133; at or past 2^127 hi may round to inf.
    """
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.stack((hi, mid, lo), dim=-2)


def _gamma(n: int) -> float:
    """gamma_n = n e / (1 - n e), e = EPS_OP: the relative error bound of n fp32 operations.

    Standard (Higham, Accuracy and Stability, 3.1): for any summation order,
    |fl(sum_i x_i y_i) - sum_i x_i y_i| <= gamma_n sum_i |x_i y_i| (n = terms, products
    included), and a sum of n non-negative terms is computed with relative error <= gamma_n.
    """
    return n * EPS_OP / (1.0 - n * EPS_OP)


# Relative margin on the fp64 evaluation of the radii in _key_tile_bounds: each radius is a
# norm of at most 2 * 128 + few operations in fp64 (relative error < 1e-13), far below this.
FP64_MARGIN = 2.0**-30


def _key_tile_bounds(k, bn, d_dot):
    """Per key tile of bn keys: centroid c_j (k's dtype, [B, n_tiles, D]) and radius rho_j
    (fp32 [B, n_tiles]) such that, for every key s of tile j and every query row m,
        fl_kernel(q_m . k_s) <= fl_kernel(q_m . c_j) + fl(||q_m||) * rho_j,
    where fl_kernel is the kernel's fp32 dot product (any order, d_dot terms, per-operation
    error <= EPS_OP) and fl(||q_m||) the kernel's fp32 norm. Proof, exact arithmetic on the
    stored values: q.k_s = q.c + q.(k_s - c) <= q.c + ||q|| r_j with r_j = max_s ||k_s - c||;
    the kernel's dots err by at most gamma_D ||q|| ||k_s|| and gamma_D ||q|| ||c||, so
        fl(q.k_s) <= fl(q.c) + ||q|| (r_j + gamma_D (max_s ||k_s|| + ||c||));
    and ||q|| <= fl(||q||) (1 + gamma_{2D+2}) (a non-negative sum of D squares loses at most
    gamma_D, the square root one more operation). rho_j is that product, evaluated in fp64,
    raised by FP64_MARGIN and rounded up to fp32. c_j may be any vector: it is the tile mean
    rounded to k's dtype, so the kernel's centroid product runs exactly like its key product.

    O(S * D) work in fp64, in key chunks of about BOUND_CHUNK_ELEMS elements; a partial last
    tile is padded by repeating its last key (the padding changes neither bound's validity).
    """
    B, S, D = k.shape
    n_tiles = triton.cdiv(S, bn)
    cent = torch.empty(B, n_tiles, D, dtype=k.dtype, device=k.device)
    rho = torch.empty(B, n_tiles, dtype=torch.float32, device=k.device)
    g_dot, g_norm = _gamma(d_dot), _gamma(2 * d_dot + 2)
    step = max(1, BOUND_CHUNK_ELEMS // (B * bn * D)) * bn
    for s0 in range(0, S, step):
        s1 = min(S, s0 + step)
        kc = k[:, s0:s1].double()
        pad = -(s1 - s0) % bn
        if pad:
            kc = torch.cat([kc, kc[:, -1:].expand(B, pad, D)], dim=1)
        kc = kc.view(B, -1, bn, D)
        c = kc.mean(dim=2).to(k.dtype)
        c64 = c.double()
        radius = (kc - c64[:, :, None]).norm(dim=-1).amax(-1)
        k_norm = kc.norm(dim=-1).amax(-1)
        rho64 = (radius + g_dot * (k_norm + c64.norm(dim=-1))) * (1 + g_norm) * (1 + FP64_MARGIN)
        rho32 = rho64.float()
        rho32 = torch.where(rho32.double() < rho64,
                            torch.nextafter(rho32, torch.full_like(rho32, float("inf"))), rho32)
        j0 = s0 // bn
        cent[:, j0:j0 + kc.shape[1]] = c
        rho[:, j0:j0 + kc.shape[1]] = rho32
    return cent, rho


def _slack_coef(hp: int) -> float:
    """Coefficient of the bound's slack: X = U + coef * Mag >= every score the kernel computes.

    With B_m = A_m + n_m rho_j >= fl(logit_m) (_key_tile_bounds), m_m = |A_m| + n_m rho_j,
    Mag = sum_h |w_h| m_h and e = EPS_OP (hats: the fp32 values the kernel computes):
    - the score: under ReLU, s^ = fl(sum_h fl(w_h relu(L^_h))) <= sum_h w_h relu(L^_h)
      + gamma_H Mag' with Mag' = sum_h |w_h| relu(L^_h) <= Mag (relu(L^) <= relu(B) <= m), and
      heads with w <= 0 add at most 0, so sum_h w_h relu(L^_h) <= sum_h w+_h relu(B_h).
      Without ReLU the heads are the folded query (H = 1) or its bf16 parts, all with w = 1 >=
      0, so sum_h w_h L^_h <= sum_h w_h B_h and the same bound holds with act = identity.
    - B^_h = fl(A_h + fl(n_h rho)) (2 roundings): act(B_h) <= act(B^_h) + gamma_2 m_h.
    - U^ = fl(sum_h fl(w+_h act(B^_h))) >= sum_h w+_h act(B^_h) - gamma_H (1 + gamma_2) Mag.
    - Mag^ (computed) >= (1 - gamma_{H+2}) Mag (non-negative terms, H + 2 operations).
    So s^ <= U^ + (gamma_2 + 2 gamma_H (1 + gamma_2)) Mag <= U^ + (2H + 3) e Mag^ (1 + O(He)).
    The kernel computes X^ = fl(U^ + fl(coef Mag^)) >= U^ + coef Mag^ - e (|U^| + 2 coef Mag^),
    and |U^| <= (1 + O(He)) Mag^, so coef = (2H + 5) e suffices up to O(H^2 e^2); SLACK_EXTRA_OPS
    more operations keep a wide margin. A tile is skipped only if X^ < thr_score strictly, so
    every key of it has s^ < thr_score: none could enter the buffer (a key equal to the
    threshold's score might still win on its index, hence strict).
    """
    return (2 * hp + 5 + SLACK_EXTRA_OPS) * EPS_OP


def _key_descriptor(k: torch.Tensor, bn: int, bd: int) -> Any:
    """A TMA descriptor (triton.tools.tensor_descriptor.TensorDescriptor) of k [B, S, D] as
    [B * S, D] rows in [bn, bd] boxes (`HyTopKOptions.key_tma`), or None with one warning naming
    why TMA cannot read k (then the tiles are loaded as without the option): a Triton with
    host-side descriptors, a Hopper or later GPU (the interpreter runs it on CPU tensors),
    the batches packed rows (stride(0) = S * stride(1) when B > 1), the channels unit-stride,
    the rows and the data 16-byte aligned, B * S within TMA's int32 coordinates (k's rows as
    one [B * S, D] tensor) and the padded head dim bd within its box."""
    B, S, D = k.shape
    row_bytes = k.stride(1) * k.element_size()
    try:  # host-side TMA descriptors (tested with Triton 3.6)
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        TensorDescriptor = None
    if TensorDescriptor is None:
        why = f"this Triton ({triton.__version__}) has no host-side TMA descriptors"
    elif k.is_cuda and torch.cuda.get_device_capability(k.device)[0] < 9:
        why = "the GPU has no TMA (before Hopper)"
    elif k.stride(2) != 1 or row_bytes % 16 or k.data_ptr() % 16:
        why = f"k's rows are not 16-byte aligned unit-stride rows (strides {tuple(k.stride())})"
    elif B > 1 and k.stride(0) != S * k.stride(1):
        why = f"k's batches are not packed rows (strides {tuple(k.stride())})"
    elif B * S > MAX_TMA_ROWS:
        why = f"B * S = {B * S} keys exceed TMA's int32 coordinates"
    elif bd > MAX_TMA_BOX:
        why = f"a key row of {bd} channels exceeds TMA's {MAX_TMA_BOX}-element box"
    else:
        return TensorDescriptor(k, [B * S, D], [k.stride(1), 1], [bn, bd])
    warn_once(f"hytopk-key-tma: {why.split(' (')[0]}",
              f"HyTopK: options.key_tma cannot run ({why}); loading key tiles without TMA",
              stacklevel=4)
    return None


def _launch(q, k, weights, topk, *, relu, q_positions, k_positions, causal,
            options: HyTopKOptions = HyTopKOptions.DEFAULT, mode=MODE_SELECT, table=None,
            table_rows=None, prune_stats=None, ordered=True, q_scale=None, k_scale=None,
            sample_stats=None, key_order=False):
    """Run the kernel in `mode` with the variant and tiling of `options` (pruning in
    MODE_SELECT only; with one head a row the rows stay on the MMA's M whatever keys_on_m
    says). prune_stats: optional int64 tensor [2] that receives (key tiles pruned, key tiles
    considered), each counted once per row block. ordered: sort each row (else the set in
    kernel order, -1 slots last), by increasing key index with key_order. q_scale [B, T, H],
    k_scale [B, S]: fp32 scales of e4m3 q and k (both required then, neither otherwise).
    sample_stats: optional int32 tensor [2] that receives (rows given a sampled guess, row
    blocks redone because a guess failed) under options.sample_keys."""
    B, T, _, D = q.shape
    S = k.shape[1]
    fp8 = q.dtype == FP8_DTYPE
    if (fp8, fp8) != (k.dtype == FP8_DTYPE, q_scale is not None) or (q_scale is None) != (
            k_scale is None):
        raise ValueError("e4m3 q and k come with q_scale and k_scale, other dtypes without")
    if fp8 and options.prune:
        raise ValueError("options.prune is not supported with e4m3 q and k: its bound assumes "
                         "the bf16 kernel's products and one scale for every key")
    if fp8 and not relu:
        # One folded fp32 query a row: its product is 1/H of the ReLU kernel's and runs in
        # fp32 anyway, so the kernel scores the exactly dequantized values.
        q, k = dequantize(q, q_scale), dequantize(k, k_scale)
        q_scale = k_scale = None
        fp8 = False
    qk, kk_, w, hp, r, ieee = _prepare(q, k, weights, relu, options.rows, q_scale,
                                       options.folded_parts)
    H = qk.shape[2]
    bn = options.block_n
    # topk, not min(topk, S), sizes the buffer and is the kernel's TOPK: a compiled-in value
    # that would otherwise change with every packed document shorter than topk, each length a
    # compile. Such rows never fill their buffer and leave their empty slots, as rows with
    # fewer than topk visible keys always do.
    cap = triton.next_power_of_2(max(topk + bn, options.min_cap))
    # Tiles per group: 1/group_slack_div of the buffer's slack, so a row compacts only after
    # the rest of the slack has filled (compactions stay rare) while a group cannot overflow.
    nt = max(1, (cap - topk) // (options.group_slack_div * bn))
    hi = _visible_hi(q_positions, k_positions, causal, T, S)
    lean = options.lean_filter and mode == MODE_SELECT
    if lean and causal:
        qpos, kpos = _position_ranks(q_positions, k_positions)
    else:
        qpos = q_positions.contiguous()
        kpos = k_positions.contiguous()

    blocks_per_batch = triton.cdiv(T, r)
    t_lo, t_hi = (0, T) if table_rows is None else table_rows
    hi_pad = torch.zeros(B, blocks_per_batch * r, dtype=torch.int32, device=q.device)
    hi_pad[:, t_lo:t_hi] = hi[:, t_lo:t_hi]
    block_work = hi_pad.view(B, blocks_per_batch, r).amax(-1).flatten()
    block_ids = torch.arange(block_work.numel(), device=q.device)
    if table_rows is not None:  # only the blocks of the table's rows (t_lo, t_hi multiples of r)
        lo_blk, hi_blk = t_lo // r, triton.cdiv(t_hi, r)
        sel = ((block_ids % blocks_per_batch) >= lo_blk) & ((block_ids % blocks_per_batch) < hi_blk)
        block_ids, block_work = block_ids[sel], block_work[sel]
    order = block_ids[torch.argsort(block_work, descending=True, stable=True)].to(torch.int32)
    n_blocks = order.numel()
    nprog = _num_programs(q.device, n_blocks, options)

    indices = torch.empty(B, T, topk, dtype=torch.int32, device=q.device)
    scores = torch.empty(B, T, topk, dtype=torch.float32, device=q.device)
    scratch_elems = nprog * r * cap if mode == MODE_SELECT else 1
    scratch = torch.empty(scratch_elems, dtype=torch.int64, device=q.device)
    counts = torch.empty(nprog * r if mode == MODE_SELECT else 1, dtype=torch.int32,
                         device=q.device)
    if table is None:
        table = scratch
    out_scores = scores.view(torch.int32) if mode == MODE_SELECT else scores
    prune = options.prune and mode == MODE_SELECT
    bd = max(FP8_MIN_DOT if fp8 else MIN_DOT, triton.next_power_of_2(D))
    keys_on_m = options.keys_on_m and hp > 1
    head_major = (options.head_major and keys_on_m and hp <= HEAD_MAJOR_MAX_HEADS
                  and r >= HEAD_MAJOR_MIN_ROWS)
    sort_out = options.sort_in_kernel and mode == MODE_SELECT
    # Inline PTX runs once per register copy of a score: only the pair-major columns hold
    # each score in one lane (the row-major head sum leaves it in every lane of the quad,
    # whose copies would each append it; a first-copy check there was timed slower,
    # BENCHMARKS.md 2026-12-04). The interpreter has no PTX: tl.store / tl.atomic_add there.
    append_ptx = (options.append_ptx and options.atomic_slots and head_major
                  and not triton_interpret())
    row_sort = _row_sort_code(options)
    k_desc = _key_descriptor(kk_, bn, bd) if options.key_tma else None
    if prune:
        # fp32 operands run as three TF32 products: 3 D accumulations plus the split's
        # rounding (< 3 more operations), so the dot-product bound counts 4 D operations.
        cent, rho = _key_tile_bounds(kk_, bn, bd * (TF32X3_OPS_PER_TERM if ieee else 1))
        stats = torch.zeros(nprog, 2, dtype=torch.int64, device=q.device)
    else:
        cent = rho = stats = scratch
    # k's scales (fp8), else any tensor: the kernel never reads it.
    k_scales = k_scale.contiguous() if fp8 else kpos
    fp8_acc = None
    if fp8 and options.fp8_imprecise_acc is not None:
        fp8_acc = min(options.fp8_imprecise_acc, bd)  # Triton rejects more than the dot's K
    nsamp = options.sample_keys if mode == MODE_SELECT else 0
    if nsamp and (nsamp & (nsamp - 1) or nsamp < bn):
        raise ValueError(f"options.sample_keys must be a power of two of at least block_n "
                         f"({bn}), or 0; got {nsamp}")
    # The sample lands in the candidate buffer (a power of two of at least topk + block_n).
    nsamp = min(nsamp, cap)
    if S < SAMPLE_MIN_BUFFERS.value * cap:
        nsamp = 0  # no row can see enough keys to sample: spare the redo launch
    # With sampled guesses: the count of blocks to redo without them, the count of rows that
    # got a guess, and the list of the blocks to redo.
    fails = torch.zeros(2 + n_blocks if nsamp else 1, dtype=torch.int32, device=q.device)

    # Triton's register cap travels with the launch options, only when set.
    if options.maxnreg is not None and not MIN_MAXNREG <= options.maxnreg <= MAX_MAXNREG:
        raise ValueError(f"options.maxnreg must be None or from {MIN_MAXNREG} to {MAX_MAXNREG} "
                         f"registers a thread; got {options.maxnreg}")
    reg_cap = {} if options.maxnreg is None else {"maxnreg": options.maxnreg}

    def launch(order, n_blocks, stats, nsamp, redo):
        _hytopk_kernel[(nprog,)](
            qk, kk_, k_desc, w, qpos, kpos, k_scales, hi, order, indices, out_scores, scratch,
            counts,
            table, cent, rho, stats, fails,
            T, S, H, n_blocks, blocks_per_batch, t_lo, triton.cdiv(S, bn), _slack_coef(hp),
            qk.stride(0), qk.stride(1), qk.stride(2), qk.stride(3),
            kk_.stride(0), kk_.stride(1), kk_.stride(2),
            w.stride(0), w.stride(1), w.stride(2),
            D=D, TOPK=topk, CAP=cap, R=r, HP=hp, BD=bd, BN=bn, NT=nt,
            RELU=relu, CAUSAL=causal, IEEE=ieee, MODE=mode,
            PRUNE=prune, G=max(16, triton.next_power_of_2(nt)),
            KEYS_ON_M=keys_on_m, ATOMIC_SLOTS=options.atomic_slots,
            K_SCALED=fp8, FP8_ACC=fp8_acc, HEAD_MAJOR=head_major, SORT_OUT=sort_out,
            ORDERED=sort_out and ordered, KP=triton.next_power_of_2(topk), NSAMP=nsamp,
            N_BLOCKS_ON_DEVICE=redo, LEAN=lean, BOUNDED_SELECT=options.bounded_select,
            ROW_SORT=row_sort, APPEND_PTX=append_ptx, KEY_TMA=k_desc is not None,
            KEY_ORDER=sort_out and ordered and key_order,
            num_warps=options.num_warps, num_stages=options.num_stages, **reg_cap,
        )

    launch(order, n_blocks, stats, nsamp, False)
    if nsamp:
        # The blocks whose guesses failed, redone without guesses (their outputs overwritten);
        # the count stays on the device, so no host sync: without failures every program
        # reads 0 and exits.
        redo_stats = torch.zeros_like(stats) if prune else stats
        launch(fails[2:], 0, redo_stats, 0, True)
        if prune:
            stats += redo_stats
    if prune_stats is not None:
        prune_stats.copy_(stats.sum(0) if prune else torch.zeros_like(prune_stats))
    if sample_stats is not None:
        sample_stats.copy_(fails[:2].flip(0) if nsamp else torch.zeros_like(sample_stats))
    if mode == MODE_SELECT and not sort_out:
        _finish(indices, scores, ordered, key_order)
    return indices, scores


def _swap_halves_torch(key: torch.Tensor) -> torch.Tensor:
    """The kernel's `_swap_halves` on int64 keys (INT64_MIN, an empty slot, kept)."""
    return torch.where(key == _KEY_MIN, key, ((key & _LOW32) << 32) | ((key >> 32) & _LOW32))


def _finish(indices, scores, ordered=True, key_order=False):
    """Sort each row's packed keys (score desc, index asc; by increasing index with
    key_order) and decode them, in place; without `ordered`, decode only (the kernel already
    wrote empty slots after the real ones).

    On entry scores holds the high and indices the low 32 bits of each key (INT64_MIN marks an
    empty slot). Row chunks bound the temporaries to about FINISH_CHUNK_BYTES.
    """
    B, T, K = indices.shape
    hi_bits, lo_bits = scores.view(torch.int32), indices
    step = max(1, FINISH_CHUNK_BYTES // (16 * K))
    for b in range(B):
        for t0 in range(0, T, step):
            hi = hi_bits[b, t0:t0 + step].to(torch.int64)
            lo = lo_bits[b, t0:t0 + step].to(torch.int64) & _LOW32
            key = (hi << 32) | lo
            if ordered and key_order:
                key = _swap_halves_torch(_swap_halves_torch(key).sort(dim=-1,
                                                                      descending=True).values)
            elif ordered:
                key = key.sort(dim=-1, descending=True).values
            indices[b, t0:t0 + step], scores[b, t0:t0 + step] = decode_keys(key)


def decode_keys(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's packed int64 keys -> (indices int32, scores fp32); an empty slot
    (INT64_MIN) -> (-1, -inf)."""
    empty = key == _KEY_MIN
    hi32 = (key >> 32).to(torch.int32)
    bits = hi32 ^ ((hi32 >> 31) & 0x7FFFFFFF)
    score = bits.view(torch.float32).masked_fill(empty, float("-inf"))
    index = (_LOW32 - (key & _LOW32)).to(torch.int32).masked_fill(empty, -1)
    return index, score


def hytopk_triton(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *,
                  relu: bool, q_positions: torch.Tensor, k_positions: torch.Tensor,
                  causal: bool, options: HyTopKOptions = HyTopKOptions.DEFAULT,
                  prune_stats: torch.Tensor | None = None, ordered: bool = True,
                  q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                  sample_stats: torch.Tensor | None = None, key_order: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact HyTopK on validated inputs (positions int64 [B, T] / [B, S]); see module doc.

    options: the kernel variant (the outputs are identical for every one). prune_stats:
    optional int64 [2] tensor that receives (key tiles pruned, key tiles considered) when
    options.prune. ordered=False: each row's set in kernel order; key_order (with ordered):
    each row by increasing key index (`ops.hytopk(order="key")`). q_scale, k_scale: the fp32
    scales of e4m3 q and k (`fp8_quant.quantize_indexer`). sample_stats: optional int32 [2]
    tensor that receives (rows given a sampled threshold, row blocks redone without) when
    options.sample_keys."""
    return _launch(q, k, weights, topk, relu=relu, q_positions=q_positions,
                   k_positions=k_positions, causal=causal, options=options,
                   prune_stats=prune_stats, ordered=ordered, q_scale=q_scale, k_scale=k_scale,
                   sample_stats=sample_stats, key_order=key_order)


def score_table(q, k, weights, *, relu, q_positions, k_positions, causal, t0, t1, table,
                options: HyTopKOptions = HyTopKOptions.DEFAULT):
    """Write fp32 scores of query rows [t0, t1) of batch 0 into table [t1 - t0, S] (-inf where
    masked). The scoring half of a table-then-select baseline; B must be 1 and t0 a multiple of
    the row block."""
    table.fill_(float("-inf"))  # keys past the last visited tile are never written
    _launch(q, k, weights, 1, relu=relu, q_positions=q_positions, k_positions=k_positions,
            causal=causal, options=options, mode=MODE_TABLE, table=table, table_rows=(t0, t1))
    return table

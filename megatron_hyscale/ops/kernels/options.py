"""Kernel variants and tunings, as frozen option objects passed down from the ops API.

Each op takes `options=None` (its class's DEFAULT, what the defaults were measured to be best
at) and hands the object to its launchers, so a variant is chosen per call, never by a
process-wide flag. Every variant gives the same results (bitwise, or to fp32 rounding where a
field says so); they differ in speed, memory or compiled shape. Tests and benchmarks derive
others with `dataclasses.replace(HyTopKOptions.DEFAULT, prune=True)`.

No torch or triton import here: the ops API imports this module before it knows whether the
kernels can load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# HyTopKOptions.scores_sm90_sample_pick's values.
SAMPLE_PICKS = ("radix", "topk")
# HyTopKOptions.scores_sm90_stages' range (`indexer_scores_sm90`: a consumer releases each key
# tile before it waits for the next, with the product ahead too, so 2 suffice; 8 tiles of 16
# KiB beside the query blocks and the folded query's scan scratch stay under the 227 KiB of
# shared memory a block).
SCORES_SM90_STAGES = (2, 8)


def check_stages(stages: int, name: str = "stages") -> None:
    """ValueError naming `name` unless stages (the Gluon scores' key tiles in flight) is an int
    in SCORES_SM90_STAGES."""
    lo, hi = SCORES_SM90_STAGES
    if isinstance(stages, bool) or not (isinstance(stages, int) and lo <= stages <= hi):
        raise ValueError(f"{name} must be an int from {lo} to {hi}, got {stages!r}")


@dataclass(frozen=True)
class HyTopKOptions:
    """Variants and tunings of the HyTopK kernel (`kernels/hytopk.py`); the outputs are
    identical for every value."""

    # Keys per streamed tile (64 keys x 128 GEMM rows with 4 warps measured fastest on the H200
    # of the tiles tried, 2026-11-29: 3.1x the GEMM floor for scoring alone against 3.9x for 128
    # keys with 8 warps); the buffer slack (CAP - topk) is at least one tile.
    block_n: int = 64
    # Query rows per program; None: from the head count (GEMM_ROWS // padded heads, see
    # `hytopk._prepare`).
    rows: int | None = None
    num_warps: int = 4
    # Three stages measured faster than two on the H200 (2026-11-30, `bench_selection.py
    # --group-sweep`, 128K, select mode): DeepSeek-V3.2 496 -> 482 ms with group_slack_div 2,
    # V4-Flash's CSA indexer 439 -> 389, QSA (512K) 457 -> 436; scoring alone 361 -> 308 ms.
    num_stages: int = 3
    # Persistent programs per SM; scratch is (programs x R x CAP) int64, independent of T.
    programs_per_sm: int = 2
    # Programs used under TRITON_INTERPRET=1 (any count is correct; few keep the scratch small).
    interpret_programs: int = 3
    # A fixed number of programs instead of the two above (tests); None: by the device.
    num_programs: int | None = None
    # Smallest candidate buffer a row (entries, rounded up to a power of two; at least topk + one
    # tile): the slack above topk sets how often a row is compacted. Measured on the H200
    # (2026-11-30) for the top-512 configurations, whose buffer was 1024 before: QSA (4 heads
    # over T / 4 blocks) at 512K tokens 549 ms with 1024, 460 with 2048, 473 with 4096;
    # V4-Flash's CSA indexer (64 heads) at 128K 500 ms with 1024, 453 with 2048, 473 with 4096.
    # Top-2048 rows already have 4096 (8192 was slower: 608 against 497 ms at 128K).
    min_cap: int = 2048
    # A tile group may fill at most 1/group_slack_div of the buffer slack (see
    # `hytopk._launch`). 2 with three stages measured best or tied of 1, 2 and 4 (QSA: 436.5
    # against 436.2 ms with 4); 1 compacts at nearly every group (+35% to +180%).
    group_slack_div: int = 2
    # GEMM orientation under ReLU: K_tile @ Q^T puts the (row, head) pairs on the MMA's N, where
    # the accumulator keeps a row's heads in one thread and its quad, so the weighted head sum
    # is register FMAs plus a shuffle or two; Q @ K_tile^T (False) puts the heads on M, and once
    # a row has more heads than one warp's 16 accumulator rows its head sum crosses warps,
    # through shared memory. Compiled for sm_90a here (2026-11-30, Triton 3.6,
    # `scripts/inspect_sm90.py`, 64 heads, 64-key tiles), the scores-only tile loop has 397 SASS
    # instructions a thread against 931 (104 SHFL, 78 shared-memory accesses against 16 and 12),
    # the select loop 456 against 1851. Timed on the H200 (2026-12-03, V3.2's indexer at 128K):
    # 487.6 ms against 1217.2 with the heads on M. relu=False folds the heads into one query a
    # row: with bf16 keys its three bf16 parts are the heads (this setting applies); with other
    # key dtypes it is one fp32 head and the rows stay on M whatever this says.
    keys_on_m: bool = True
    # Candidate append: each survivor takes its buffer slot with an atomic add on its row's
    # counter (global memory; only lanes holding a survivor issue it) and is stored one tile
    # later, so the next tile's GEMM hides the atomic's round trip. False: a CTA-wide test and
    # prefix sum on every tile with a candidate, which on random inputs at 128K is nearly every
    # tile. Compiled for sm_90a (64 heads, keys on M), the select loop has 456 SASS instructions
    # and 3 barriers a tile against 554 and 16. Timed on the H200 (2026-12-03, V3.2's indexer
    # at 128K): 487.6 ms against 524.9 with the scan.
    atomic_slots: bool = True
    # Key-tile pruning by a centroid / radius score bound (the select mode only). Off by
    # default: on inputs without structure (random) no tile is ever pruned and the bound only
    # costs time; the GPU benchmark measures both settings (bench_selection.py --methods
    # hytopk hytopk_prune).
    prune: bool = False
    # relu=False with bf16 keys: the folded query (sum_h w_h q_h, fp32) as three bf16 parts
    # whose sum is it exactly, run as 4 padded heads on the keys-on-M bf16 path (compiled for
    # sm_90a, 2026-12-03: 887 SASS instructions a tile on wgmma, no local memory in the loop);
    # False: one fp32 head on tf32x3 products with the rows on M (2724 instructions, 192
    # mma.sync and 170 local-memory accesses a tile). Timed on the H200 (2026-12-03,
    # bench_selection.py hytopk against hytopk_folded_fp32): 10.8 / 62.9 / 172.9 ms at 16K /
    # 64K / 128K against 12.9 / 87.0 / 259.4.
    folded_parts: bool = True
    # precision="fp8" only (the outputs may differ in fp32 rounding between values): how many
    # channels of an e4m3 product the tensor core sums in its own adder before the sum joins
    # an fp32 register (Triton's max_num_imprecise_acc; capped at the padded head dim). None
    # keeps Triton's Hopper default, every channel: a 128-channel head is one fp32 addition,
    # which is DeepSeek-V3's promotion interval of 128 (its report: Hopper's fp8 MMA keeps
    # about 14 bits while it accumulates). 32 adds each 32-channel wgmma step to an fp32
    # accumulator (fp32 accumulation proper) at four CUDA-core additions a logit, in the
    # epilogue that already limits the kernel. Exact either way on integer-valued inputs.
    # Compiled for sm_90a (2026-12-02, `scripts/inspect_sm90.py --preset hytopk-dsv32-fp8
    # hytopk-dsv32-fp8-promote32`, 64 heads, 64-key tiles): None runs 4 QGMMA (fp8 wgmma) and
    # 416 SASS instructions a tile (bf16: 8 HGMMA, 460) without local memory in the loop; 32
    # runs 689 with 200 FADD, 50 local-memory loads (404 bytes spilled) and serialized wgmma.
    # Timed on the H200 (2026-12-02, V3.2's indexer at 128K, bench_selection.py hytopk_fp8
    # against hytopk_fp8_promote32): 400.1 ms with None against 580.1 with 32.
    fp8_imprecise_acc: int | None = None
    # Each row's top-k set sorted (score desc, index asc; `tl.sort` of the packed int64 keys)
    # and decoded into indices and scores by the kernel itself, which then writes the outputs
    # directly; ordered=False decodes without the sort. False: the kernel writes the two
    # 32-bit halves of the packed keys and a torch pass (`hytopk._finish`) sorts and decodes
    # them (33 ms of V3.2's 487.6 at 128K on the H200, 2026-12-03). Compiled for sm_90a
    # (2026-12-03, `inspect_sm90.py`), the 2048-key sort adds about 8600 SASS instructions to
    # the kernel, outside its tile loop (the folded query's 7080 -> 15712, V3.2's 6128 ->
    # 14896), without new spills in the loop. On by default: no slower alone on the H200 and
    # it drops the pass's 0.9 GiB at 128K (BENCHMARKS.md, "HyTopK's select variants").
    sort_in_kernel: bool = True
    # GEMM column order with the keys on M: pair-major ((head pair, row, head of the pair)) instead
    # of (row, head), for 4 padded heads and at least 4 rows a program (QSA's 4 heads, the folded
    # relu=False query's 3 bf16 parts; other shapes ignore it, see `hytopk.HEAD_MAJOR_MAX_HEADS`). A
    # row's heads then lie in one thread's registers: no shuffle, and each score in one lane instead
    # of two, so the per-score selection work halves. The head sum repeats the row-major order term
    # for term (`hytopk._head_sum`). Compiled for sm_90a (2026-12-03, `inspect_sm90.py --preset
    # hytopk-norelu hytopk-norelu-head-major`): the folded query's select loop 887 -> 609 SASS
    # instructions a tile (scores alone 433 -> 322), QSA's 847 -> 608. On by default (the folded
    # query's selection 10% faster at 128K on the H200).
    head_major: bool = True
    # Keys a row block samples (evenly spaced over its visible range; a power of two from block_n
    # up, capped at the candidate buffer's size) to guess each row's threshold before its stream; 0:
    # no guess. Without one a row's threshold starts at -inf and only rises when its buffer fills:
    # on random inputs a row of 64K keys appends some 12K of them and compacts about 8 times
    # (top-2048, 4096-entry buffers). With the guess (the sample's j-th largest, j a few standard
    # deviations above the expected count of top-k keys in the sample) it appends about 1.8 topk
    # keys and compacts once or twice, for 16 more key tiles a block (1024 keys). A guess above the
    # row's k-th key is caught by the count at the end and the block redone without guesses by a
    # second launch (`hytopk._sample_guess`), so the outputs are the same whatever the inputs. 1024
    # by default (the largest single gain of the variants on the H200 at 128K).
    sample_keys: int = 1024
    # Less per-score work in the select tile loop: visibility as one int32 compare of position
    # ranks (`hytopk._position_ranks`, computed with the launch) instead of two int64 compares
    # and two int32 ones, no fp32 pre-compare before the int64 key compare in the atomic
    # append (the key compare implies it), and -0.0 folded by an addition of +0.0 instead of a
    # compare and a select. Compiled for sm_90a (2026-12-03): the folded query's select loop
    # 887 -> 641 SASS instructions a tile (about 590 with head_major), V3.2's 460 -> 419. On by
    # default (V3.2's selection 8% faster at 128K on the H200).
    lean_filter: bool = True
    # The compaction's bitwise select starts below the bits that every candidate shares: in
    # the score half those of the row's threshold and its largest candidate (one max reduction
    # first), in the index half the top bits that every index below S leaves set
    # (`hytopk._kth_largest_bounded`). Each skipped bit is one count reduction fewer (a round
    # of shuffles, shared memory and a barrier over the 4096-entry buffer). Rows compacted
    # together were tried instead (one reduction for several rows' counts): compiled for
    # sm_90a, 2 rows at a time spilled into the tile loop (52 local loads a tile, 2026-12-03).
    # On by default (alone within 1% on the H200; no slower with the others).
    bounded_select: bool = True
    # The in-kernel sort of each row's packed keys (sort_in_kernel, ordered): "bitonic" is
    # Triton's `tl.sort`, whose steps on the low sort-index bits (11 + 10 + 9 + ... of the 66
    # for 2048 keys) cross lanes, and whose bits 6 and 7 cross warps (9 steps through shared
    # memory). "bitonic_regs" (`hytopk._sort_desc_regs`) runs the same network with the
    # sort-index bits mapped to the layout by use: bits 0-3 inside a thread (a pair compared
    # once and selected twice), 4-8 across lanes, 9-10 across warps (3 steps); the same sorted
    # row, written by rank (scattered stores). Compiled for sm_90a (2026-12-03,
    # `inspect_sm90.py --preset hytopk-write-rows hytopk-write-rows-regs hytopk-norelu
    # hytopk-norelu-sort-regs`, 2048 keys, 4 warps): the row write alone 8224 -> 6344 SASS
    # instructions (ISETP 2871 -> 2173, SEL 2800 -> 2577, SHFL 1344 -> 896, STS / LDS 224 ->
    # 104 each, BAR 21 -> 17, STG 8 -> 32); the folded query's select kernel 15608 -> 13184, tile
    # loop unchanged (587). Timed on the H200 (2026-12-03, `bench_selection.py --methods hytopk
    # hytopk_sort_regs`, rows bit-identical): the folded query at 128K 121.3 -> 106.5 ms, at 16K
    # 11.4 -> 9.0 ms; V3.2's indexer at 128K 390.6 -> 384.9 ms; the row write alone on 131072
    # rows (`--row-sort-micro`) 23.3 -> 13.1 ms (torch.sort of the same keys 14.8). Default
    # since; "bitonic" is the previous kernel (`bench_selection.py` method
    # `hytopk_sort_bitonic`).
    row_sort: str = "bitonic_regs"
    # The atomic-slot append (`atomic_slots`) as inline PTX in the scores' register layout
    # (`hytopk._store_where`, `_slot_add`) instead of tl.store / tl.atomic_add, whose operands
    # Triton's coalescing pass first moves into a blocked layout through shared memory on every
    # key tile. Applies where each score lies in one lane (pair-major columns, `head_major`):
    # the row-major head sum leaves a score in every lane of a quad, and PTX runs once per
    # copy. Compiled for sm_90a (2026-12-04, `inspect_sm90.py --preset hytopk-norelu`): the
    # folded query's tile loop 587 -> 441 SASS instructions (STS 12 -> 0, LDS 13 -> 3, BAR 10
    # -> 2, no spills); Nsight Compute on the H200 had put 11% of its stall samples on barriers.
    # Timed on the H200 (2026-12-04, `bench_selection.py` methods hytopk, hytopk_append_tl):
    # folded query 8.49 -> 7.21 ms at 16K, 104.97 -> 83.28 at 128K; QSA at 512K 284.7 ->
    # 209.3; rows bit-identical (GPU tests, and the benchmark's comparison up to 128K).
    # Under TRITON_INTERPRET=1 the tl forms run whatever this says (no PTX there).
    append_ptx: bool = True
    # The streamed key tiles (contiguous rows of k) come through one TMA copy a tile instead of
    # per-thread cp.async copies: Nsight Compute put the compute warps' copy addresses (IMAD,
    # LEA) and LDGSTS at ~17% of V3.2's samples at 64K (2026-12-04, record ncu_selection-2).
    # Same keys, same outputs. Needs packed 16-byte rows (`hytopk._key_descriptor` warns once
    # and loads without TMA otherwise). Timed on the H200 (2026-12-05, `bench_selection.py
    # --methods hytopk hytopk_key_tma`, rows identical): no faster, V3.2 379.2 -> 378.0 ms at
    # 128K, GLM-5.1 244.6 -> 245.7, the folded query 82.8 -> 80.5 (7.6 -> 7.9 at 16K); the
    # scores-only kernel 311.1 -> 343.9 for V3.2. Off.
    key_tma: bool = False
    # Registers a thread (Triton's `maxnreg` launch option); None: the compiler's choice. The
    # select kernel takes 255 (its end-of-block compaction and sort), which holds an SM to two
    # programs; 168 lets three fit (`programs_per_sm=3`, with num_stages 2 for V3.2's shared
    # memory), at 22 / 40 spill loads a tile (V3.2 / folded). Timed on the H200 (2026-12-04,
    # `bench_selection.py` hytopk_occ3): V3.2 13.1 -> 11.8 ms at 16K but 380.0 -> 388.5 at
    # 128K, GLM-5.1 244.0 -> 270.9 at 128K, the folded query within 1.5%: not a default.
    maxnreg: int | None = None
    # The selection from the warp-specialized Gluon indexer scores (`kernels/hytopk_sm90.py`;
    # the scores alone ran at 1.15-1.24x the GEMM floor on an H100): a threshold per row from
    # every (T / scores_sm90_samples)-th key's score (more keys at long T:
    # scores_sm90_sample_min_rank), the Gluon kernel appending each row's
    # scores at or above it, the exact top-k of those survivors; rows whose threshold missed
    # (too few or too many survivors) are redone by the Triton kernel, so the outputs are
    # exact whatever the sample, for the scores each row was selected on (the Gluon kernel's
    # fp32 sums: near-tied bf16 scores may order otherwise than the Triton kernel's;
    # integer-valued inputs give the reference's rows). Host syncs: one a call, plus one a
    # batch with rows to redo. A compile or launch failure warns once and runs Triton. Runs on
    # Hopper, causal with S == T at the default positions, no prune: with ReLU 32 or 64 heads
    # of 128 dims, bf16 q and k or precision="fp8" (e4m3 products on the tensor cores);
    # without, bf16 with any head count of 128 dims (the folded query's parts, `folded_parts`).
    # None (default): on where it can run, for S >= scores_sm90_min_keys (without ReLU
    # scores_sm90_folded_min_keys), the Triton kernel elsewhere without a word (a shape it
    # does not take is not a failure); True: wherever it can run, one warning naming why
    # elsewhere; False: never.
    # Timed against the Triton kernel in the same runs (`bench_selection.py --methods hytopk
    # hytopk_scores_sm90 cudnn`, rows equal to the Triton kernel's at every length): on an H100
    # (2026-12-05 16:15 UTC) V3.2 12.4 / 94.9 / 331.7 ms at 16K / 64K / 128K against 12.8 /
    # 103.0 / 391.6, GLM-5.1 11.3 / 59.3 / 193.1 against 11.2 / 71.2 / 245.7; on an H200
    # (12:57 UTC, before the deferred store and the radix select) 1.12x / 1.15x at 128K, 1.05x
    # at GLM-5.1's 64K, 0.83x at 16K. BENCHMARKS.md has the records.
    scores_sm90: bool | None = None
    # The shortest key range (S) the default (scores_sm90=None) takes the Gluon path for. With
    # the Gluon sample table (below) it was faster than the Triton kernel from 16K on the H200
    # (2026-12-06 03:04 UTC, same run: V3.2 12.0 / 85.9 / 304.3 ms at 16K / 64K / 128K against
    # 12.8 / 102.8 / 379.2, GLM-5.1 9.6 / 56.1 / 181.9 against 10.6 / 73.1 / 245.0, rows
    # equal); shorter ranges were not timed.
    scores_sm90_min_keys: int = 16384
    # The same for the folded query (relu=False, `hytopk_sm90.folded_parts`); None: the default
    # leaves the folded query to the Triton kernel at every length. With the radix pick and
    # the scan slots its Gluon path was faster than the Triton kernel at every length timed,
    # on an H100 (2026-12-07, same runs, the same sets on every row): 7.97 / 12.22 / 27.54 /
    # 69.1-71.1 ms at 16K / 32K / 64K / 128K in score order, 5.90 / 9.05 / 20.49 / 55.9-60.2
    # in key order (the layers'), against 8.46 / 13.14 / 31.60 / 80.1-80.6; shorter ranges
    # were not timed. (With the Triton sample, 2026-12-06: 95.9 against 81.2 ms at 128K.)
    scores_sm90_folded_min_keys: int | None = 16384
    # Keys scored for the thresholds (every max(1, ceil(S / this))-th key, for every row), at
    # least; more at long S by scores_sm90_sample_min_rank.
    scores_sm90_samples: int = 2048
    # The sample grows with S so that a row's threshold is about its r-th best sampled key,
    # r >= this (stride <= SURVIVOR_MARGIN x topk / this): the survivor count's relative error
    # goes as 1 / sqrt(r), and a row off by more than the margin is redone by the Triton kernel
    # (one row scan over all its keys). With a fixed 2048 keys r falls as 1 / S: 48 at 128K and
    # top-2048, where 1.6-1.7% of rows were redone (H100, 2026-12-07, random inputs), 6 at 1M,
    # where a model of the sampled quantile gives ~40%. 48 keeps 128K's sample (2048 keys at
    # top-2048) and grows it beyond (4096 keys at 256K, 16384 at 1M; at most
    # `row_rank.MAX_COLUMNS` with sample_pick "radix"). A smaller topk grows it from shorter
    # S (top-1024 from 64K, top-512 from 32K: 4x the sample at 128K), untimed so far.
    # None: exactly scores_sm90_samples.
    scores_sm90_sample_min_rank: int | None = 48
    # With the slot atomics (scores_sm90_scan_slots=False) and ReLU: the Gluon filter stores a
    # key tile's survivors while the next tile's product runs, not right after their slot
    # atomics return (which stalls the consumer on an L2 round trip most tiles); False: stored
    # right after, as first built (2026-12-05), kept to compare in the same run. No effect
    # with the scan slots (the default: nothing returns late) or without ReLU.
    scores_sm90_defer_store: bool = True
    # The thresholds' sample scored by the same Gluon kernel (its table epilogue, every
    # sampled key against every row: `indexer_table_sm90`) instead of HyTopK's Triton
    # score-table kernel, which takes the sample phase to 20-35 ms at 128K. Same thresholds to
    # fp32 rounding order. On: on the H200 (2026-12-06, same run, rows equal; BENCHMARKS.md)
    # the Gluon path with it was 1.02-1.09x the one with the Triton sample at 64K-128K for V3.2
    # and GLM-5.1, and 1.11-1.13x the Triton kernel at 16K (the Gluon path with the Triton
    # sample was not timed there); False: the Triton table, kept to compare.
    scores_sm90_sample_table: bool = True
    # How each row's threshold is picked from its sample scores: "radix" (default;
    # `row_rank.rank_values`: one Triton program a row, its r-th largest value built bit by
    # bit in registers, one read of the table, at most `row_rank.MAX_COLUMNS` samples) or
    # "topk" (torch.topk over the table, then the row's rank), kept to compare. Same values.
    # On an H100 (2026-12-07, same run, rows equal) the pick took 1.8 ms at 128K against
    # torch.topk's 6.9, and the Gluon path with it ran 1.00-1.08x as fast (GLM-5.1 178.3 /
    # 179.2 against 181.6 / 178.8 ms, V3.2 297.1 against 308.1, the folded query 67.9-68.8
    # against 73.0-74.4).
    scores_sm90_sample_pick: str = "radix"
    # How the Gluon filter gives each survivor its slot: True (default) a scan over each key
    # tile's keys plus the row's count so far, kept in registers (a consumer owns its rows over
    # every key tile), no atomics, the survivors in key order, stored at once, so order "key"
    # (the layers') needs no row sort; False a relaxed atomic on its row's count a survivor
    # (each waits for an L2 round trip, deferred under the next product:
    # `scores_sm90_defer_store`), kept to compare. On an H100 (2026-12-07, same runs, rows
    # equal, both with the radix pick) at 128K in key order: GLM-5.1 156.0 / 161.7 ms
    # against 175.2 / 178.6, V3.2 292.1 against 299.6, the folded query 55.9-60.2 against
    # 69.1-73.3; in score order within -6% / +4% of the atomics at 128K, 3-13% shorter at
    # 16K-64K. The DSA layer's step (GLM-5.1, 128K) 1093.9 against 1106.7 ms, its selection
    # 189.3 against 216.6.
    scores_sm90_scan_slots: bool = True
    # The Gluon filter's consumers issue each key tile's product before the last tile's
    # epilogue (ReLU x weight, head sum, filter), so one product of each runs under its own
    # epilogue as well as under the other consumer's (without it a consumer's next product
    # waits for its epilogue: an H100 profile of 2026-12-07, GLM-5.1 at 128K, had the tensor
    # core busy 55% of the filter's time, its epilogue longer than the other consumer's
    # product). Same survivors. On an H100 (2026-12-07, same runs, key order, rows equal to
    # the default's): GLM-5.1 at 128K 151.8 against 160.0 ms, V3.2 267.1 against 290.0, V3.2
    # at 64K 73.0 against 75.7; the scores alone (GLM-5.1, 128K) 101.6 against 111.8. Default
    # since (records `bench_selection_mma_ahead-*`, `_scores_ahead-*`, `_glm_ab*`; with 6 key
    # tiles in flight mixed: 148.3 / 278.3 ms). No effect without ReLU and without the scan
    # slots (its two accumulators and the pending atomics' slots would spill, compiled for
    # sm_90a), as scores_sm90_defer_store.
    scores_sm90_mma_ahead: bool = True
    # Key tiles (16 KiB each) the Gluon filter keeps in flight (SCORES_SM90_STAGES: 2 to 8):
    # how far the producer's loads run ahead of the products.
    scores_sm90_stages: int = 4
    # The folded query (relu=False) on the Gluon kernels with its bf16 parts stored part-major
    # ([B, parts, T, D]; `hytopk_sm90.folded_parts`): a consumer's product columns run (part,
    # row), so each thread sums its rows' parts in registers (no weights, no shuffles); the
    # filter's scan holds one row a thread (16 keys) instead of eight rows over a warp's
    # lanes, and the key tiles every row of a consumer sees whole run without the causal and
    # chunk tests. Compiled for sm_90a, the filter with the scan slots: 441 instructions a key
    # tile (486 on the diagonal tiles) against 702. Same survivors; scores equal to fp32
    # rounding order (the parts summed in another order). On an H100 (2026-12-07, same runs,
    # key order, the same sets as the default's on every row): 128K 46.7 against 61.2 ms (with
    # the product ahead 45.0), 64K 20.4 against 23.4, 32K 9.9 against 10.4-10.6; the scores
    # alone at 128K 12.5 against 17.5. Default since (records `bench_selection_part_major-*`,
    # `_folded_short-*`). No effect with ReLU.
    scores_sm90_folded_part_major: bool = True
    # The survivors' select where no row sort follows (order "key" on the scan slots' buffers,
    # the layers' case, or order "any") writes each row straight from its buffer
    # (`survivor_select.select_rows`): the k-th key from the score halves alone, starting below
    # the bits every survivor's score shares (the index halves only for a tie straddling k),
    # then each kept key decoded and stored at its rank among them, instead of compacting the
    # buffer in place and reading it back (`hytopk.write_rows(select=True)`). The row's keys,
    # their score halves and their index halves are never held at once: compiled for sm_90a,
    # far fewer registers (the compacting select holds 250, two programs an SM). Same rows.
    # On an H100 (2026-12-07, `bench_selection.py` phases over the same 128K scan-slot
    # buffers, rows equal): 4.3 against 6.4 ms (GLM-5.1), 4.5 against 6.2 (the folded query).
    # Default since (records `bench_selection_direct_phases-*`, `_direct_select-*`).
    scores_sm90_direct_select: bool = True
    # With ReLU (32 or 64 heads, bf16 or e4m3), the head sum's last two steps (over the four
    # lanes of a quad, which the wgmma accumulator spreads a row's heads over) as a layout
    # change instead of two butterfly shuffles: each thread adds four partial sums in
    # registers, in the butterfly's order (bitwise the same scores), and each score is then
    # held by one thread instead of four. In the scan filter the partials go straight into
    # the scan's layout (one change, where the default stores each score four times), and the
    # key tiles its rows see whole run without the causal and chunk tests (as the folded
    # parts' part-major filter). Compiled for sm_90a (`inspect_sm90.py --preset
    # indexer-filter-sm90-glm51-transpose`, two key tiles a loop): the GLM-5.1 filter 487
    # instructions on the tiles seen whole (505 on the diagonal ones) against 564 (SHFL 12
    # against 44, the same 10 partition barriers), V3.2 488 / 501 against 529, the GLM-5.1
    # scores alone 386 against 458 (one more barrier). Off until timed on a Hopper GPU.
    scores_sm90_head_sum_transpose: bool = False

    def __post_init__(self) -> None:
        if not (self.scores_sm90 is None or isinstance(self.scores_sm90, bool)):
            raise ValueError(f"HyTopKOptions.scores_sm90 must be None, True or False, got "
                             f"{self.scores_sm90!r}")
        for name in ("scores_sm90_scan_slots", "scores_sm90_mma_ahead",
                     "scores_sm90_folded_part_major", "scores_sm90_direct_select",
                     "scores_sm90_head_sum_transpose"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HyTopKOptions.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        check_stages(self.scores_sm90_stages, "HyTopKOptions.scores_sm90_stages")
        if self.scores_sm90_sample_pick not in SAMPLE_PICKS:
            raise ValueError(f"HyTopKOptions.scores_sm90_sample_pick must be one of "
                             f"{SAMPLE_PICKS}, got {self.scores_sm90_sample_pick!r}")
        for name in ("scores_sm90_min_keys", "scores_sm90_folded_min_keys",
                     "scores_sm90_sample_min_rank"):
            value = getattr(self, name)
            if value is None and name != "scores_sm90_min_keys":
                continue
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
                raise ValueError(f"HyTopKOptions.{name} must be an int >= 1"
                                 f"{'' if name == 'scores_sm90_min_keys' else ' or None'}, "
                                 f"got {value!r}")

    DEFAULT: ClassVar[HyTopKOptions]


HyTopKOptions.DEFAULT = HyTopKOptions()

# The HyTopKOptions fields of issue #21's select variants, each set to "off": the kernel as it
# was before them (`dataclasses.replace(HyTopKOptions.DEFAULT, **SELECT_VARIANTS_OFF)`), which
# tests and bench_selection.py compare the variants against.
SELECT_VARIANTS_OFF = {"sort_in_kernel": False, "head_major": False, "lean_filter": False,
                       "bounded_select": False, "sample_keys": 0, "append_ptx": False}


# (keys per step, pipeline stages) pairs, best first: a tiling that fails to compile or launch
# for lack of shared memory or registers is skipped and the next one tried (`tiling.py`).
Tilings = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class AttentionKernelOptions:
    """Variants and tunings of the sparse-attention kernels (`kernels/sparse_attention.py`,
    `kernels/sparse_mla_fwd_sm90.py`, `kernels/sparse_mla_bwd_sm90.py`). The results agree to
    fp32 rounding order for every value (bitwise for the launch order), except
    fwd_softmax=False, a measurement-only forward."""

    # Launch order of a query's head-block programs when it has one KV head (the heads of one KV
    # head split over several programs: V3.2's 128 heads in two blocks of 64, the dK/dV kernel's
    # halved blocks). False: a (B x T, programs) grid, so a query's second head block runs about
    # B x T programs after its first. True: a 1-D grid with a query's head blocks adjacent,
    # running at about the same time, so the second one's gathers of the same key rows can hit
    # L2. Exact either way (only the order changes). One program a query (GLM-5.1, CSA): no
    # difference. Timed on the H200 (2026-11-30, `bench_attention.py --t 131072 --shapes v32
    # --head-blocks {split,adjacent}`, random indices): V3.2 forward 325.5 -> 307.6 ms, backward
    # 1901.9 -> 1663.4 ms. Several KV heads always run split (`common.launch_grid`): their
    # indices differ, so adjacent programs gather different rows, and the split grid keeps a KV
    # head's neighbouring queries (which share their sliding-window keys) together. QSA's 2 KV
    # heads: its 512K layer step outside the selection (mostly this kernel) took 5088 ms split
    # and 5279-5287 adjacent (H200, 2026-11-30, `bench_layer.py --model qsa --seq 524288`).
    head_blocks_adjacent: bool = True
    # Measurement only (`bench_attention.py --fwd-no-softmax`): False makes the forward use the
    # raw scores as P (no running max, exp2 or rescale) to time the gathers and the two MMAs
    # without the softmax's CUDA-core work. Only the forward's time means anything: its outputs
    # are not attention (zeros with a sink) and its lse is -inf (the benchmark times no
    # backward then). Always the Triton forward.
    fwd_softmax: bool = True
    # The forward of absorbed MLA (one KV head, V = K's power-of-two main part, no sink or
    # prefix: GLM-5.1, DeepSeek-V3.2; fwd_sm90_ws also takes V4's sink and, under prefix_sm90,
    # HCA's prefix) on Hopper runs the Gluon kernel of `sparse_mla_fwd_sm90`,
    # whose gathers overlap the products; every other shape and device runs the Triton
    # `_fwd_kernel`. False: always `_fwd_kernel` (`bench_attention.py --fwd-kernel triton`
    # times it beside the Gluon one).
    fwd_sm90: bool = True
    # With fwd_sm90, the warp-specialized form of that forward (`sparse_mla_fwd_ws_sm90`: a
    # cp.async producer warpgroup and two consumer warpgroups that split the key tiles for S
    # and the value channels for O, exchanging maxima and P through shared memory, so one's
    # softmax runs under the other's products; FlashMLA's SM90 organisation). It also takes
    # DeepSeek-V4's K = V with a sink (CSA, the window: 512 channels, no tail), which otherwise
    # runs the Triton forward, and fewer than 64 query heads (tensor parallelism's share of
    # GLM-5.1's 64: one block padded with zero queries; the plain kernel takes multiples of 64
    # only). Same results up to fp32 rounding order. Timed on the H200 (2026-12-05,
    # `bench_attention.py --fwd-also gluon_ws`, same process, random indices), against the
    # plain Gluon forward: GLM-5.1 11.8 -> 8.0 / 49.2 -> 40.4 / 100.4 -> 89.8 ms at 16K / 64K
    # / 128K, V3.2 23.1 -> 15.9 / 95.0 -> 76.2 / 191.8 -> 155.4; CSA (Triton before) 5.6 ->
    # 3.2 / 23.8 -> 13.2 / 47.9 -> 29.4; 0.92-1.03x FlashMLA's in the same runs. On by default.
    fwd_sm90_ws: bool = True
    # With fwd_sm90_ws, the forward in lockstep, as the backward's `bwd_lockstep`: one program
    # an SM over the query head blocks, each row's keys sorted first, the programs of a wave
    # kept within fwd_lockstep_slack two-tile iterations (128 keys) of each other by a bounded
    # counter wait, so that their key gathers fall in the same few 16-ths of the keys and hit
    # L2 (GLM-5.1's bf16 keys are 151 MB at 128K, three times the L2; the forward reaches 77%
    # of the matmul rate at 16K, 57-59% at 128K). Compiled for sm_90a, not yet run on a GPU:
    # off until tested and timed (`bench_attention.py --fwd-also gluon_ws_lockstep`). The
    # Triton forward (QSA, HCA with prefix_sm90 off: the shapes the Gluon ones do not take) is
    # paced the same way under it, by key tiles, with the Triton kernels' triton_lockstep_slack
    # and triton_lockstep_programs_per_sm (tested under the interpreter, compiled, not yet
    # timed).
    fwd_lockstep: bool = False
    # Two-tile iterations a program may lead the slowest of its wave by (an int >= 1;
    # ValueError otherwise).
    fwd_lockstep_slack: int = 1
    # DeepSeek-V4 HCA's dense prefix (`sparse_attention(prefix_lengths=...)`: row t attends keys
    # 0 .. n_t - 1 before its listed window) on the Hopper Gluon kernels, the forward under
    # fwd_sm90_ws and the backward under bwd_sm90 (each row its own count of key tiles;
    # unpaced: lockstep counts equal tiles a row). False: HCA runs the Triton kernels. The HCA
    # layer at 128K on an H100 (2026-12-06, `bench_layer.py --model hca` against
    # `--attention-prefix triton`, consecutive processes): 532.8 -> 370.3 ms a step (forward +
    # backward, full recompute), the same peak memory. On.
    prefix_sm90: bool = True
    # The forward on FlashMLA's SM90 sparse kernel (`pip install megatron-hyscale[cudnn]`; bf16,
    # one KV head, 512 value channels from K's 576 or 512) inside HyScale's autograd function,
    # whose backward (HyScale's: `bwd_sm90`, deterministic if asked) then runs on FlashMLA's
    # output and log-sum-exp, and can emit the indexer loss's target
    # (`ops.sparse_attention_indexer_loss`). For where FlashMLA's forward is faster and
    # HyScale's backward is faster than cuDNN's (the library pair's): `backend="best"` sets it
    # from the measured table (`ops/backends/measured.py`). Where FlashMLA cannot run the call
    # one warning names why and HyScale's forward runs. Off by default (the table decides).
    fwd_flashmla: bool = False
    # One backward pass (the dQ kernel with FUSE_DKV: S, P, dP and dS computed once, the key
    # rows gathered once) instead of a dQ pass and a dK/dV pass. Off until timed: compiled for
    # sm_90a (GLM-5.1, 16 keys x 1 stage) its key loop has 1388 SASS instructions a thread (34
    # of them spill loads / stores) where the two passes have about 2020 per 16 keys (dQ 32 x 2:
    # 1315 per 32; dK/dV 16 x 2: 1366); `bench_attention.py --bwd-sweep` times both.
    bwd_fused: bool = False
    # The backward of absorbed MLA and DeepSeek-V4's K = V (one KV head, V = K's main part of
    # 128 / 256 / 512 channels, a tail of 0 or 64, heads a multiple of 64 or fewer: tensor
    # parallelism's share, one block padded; a prefix under prefix_sm90; a sink taken) on
    # Hopper as one warp-specialized Gluon kernel (`sparse_mla_bwd_sm90`): a cp.async producer
    # warpgroup gathers each 64-key tile once; two consumer warpgroups compute S, P, dP and dS
    # once (32 keys each), exchange P and dS through shared memory and each accumulate dQ and
    # add dK (dV merged) for half the channels, from registers with REDG.F32x2 atomics. The
    # Triton backward computes S and dP twice (its dQ and dK/dV passes). Same results up to
    # fp32 rounding order; deterministic=True keeps the Triton backward's fixed-point accumulation
    # (one warning). Timed on the H200 (2026-12-05, `bench_attention.py --bwd-also sm90`,
    # same process, random indices) against the Triton backward: GLM-5.1 75.6 -> 41.7 / 342.5
    # -> 279.0 / 723.0 -> 605.8 ms at 16K / 64K / 128K, V3.2 149.6 -> 81.1 / 614.4 -> 445.9
    # (969 at 128K in another run), CSA 23.3 -> 13.4 / 98.3 -> 79.2, GLM-5.1 at TP 2 (32
    # heads) 99.1 -> 40.5 / 407.1 -> 277.1; cuDNN's SM90 backward is still 1.2-1.4x faster
    # (BENCHMARKS.md). On by default; compiled for sm_90a without spills in its consumers'
    # loops (`inspect_sm90.py --preset sparse-mla-bwd-sm90-glm51`).
    bwd_sm90: bool = True
    # With bwd_sm90, the dK atomics 16 bytes wide (REDG.E.ADD.F32x4) instead of 8: each dK chunk
    # moves from the wgmma accumulator layout (a thread holds 2 neighbouring channels of each
    # 8-channel group) to one where a thread holds 4 consecutive channels, lanes 2m and 2m + 1
    # swapping halves with warp shuffles (`sparse_mla_bwd_sm90.RED_LAYOUT`). Half the reduction
    # instructions and L2 requests for the same bytes. Why: Nsight Compute on the H200
    # (2026-12-05, `gpu_session.sh ncu-attention`, GLM-5.1 at 128K, random indices) found the
    # backward and cuDNN's issuing the same reduction sectors (29.0 G) and DRAM bytes (1.43 TB),
    # but the backward's warps stalled 30% on the memory-instruction queue (lg throttle; cuDNN 0%,
    # whose loop has half the REDGs and two shuffles each: 16-byte reductions). Compiled for
    # sm_90a: the consumers' loop REDGs 80 -> 40 plus 80 SHFL, one spill reload more a tile in
    # consumer 1 (`inspect_sm90.py --preset sparse-mla-bwd-sm90-glm51-vec4`). Same results up to
    # fp32 rounding order. Timed on the H200 (2026-12-05, `bench_attention.py --bwd-also
    # sm90_red16`, same process): GLM-5.1 42.2 -> 36.8 ms at 16K, 602.6 -> 553.9 at 128K. On by
    # default (`--bwd-also sm90` times the 8-byte form).
    bwd_dk_vec4: bool = True
    # With bwd_sm90, the backward as one program an SM (each taking every P-th query head block)
    # with each row's keys in increasing order (sorted first; the indexer loss's per-slot target,
    # when the call emits it, scattered back to the caller's slots) and the programs of a wave
    # paced together: before gathering key tile j a program waits (at most
    # `common.SYNC_SPINS` reads of a counter) until its wave's programs have together made the
    # starts of all of them at tile j - bwd_lockstep_slack (a total: a fast program's extra
    # starts count too). At any time the programs then gather and add into about
    # (2 x slack + 1) / 32-ths of the key range (2048 keys in 64-key tiles), whose fp32 dK rows
    # and bf16 key rows fit the L2 cache: at 128K the dK buffer alone is 302 MB, six times the L2,
    # and Nsight Compute (2026-12-05, GLM-5.1, random indices) found 55% of the backward's
    # reductions hitting L2 and 1.43 TB of DRAM traffic, the same bytes as cuDNN's backward (42%):
    # the gap to the matmul rate is this traffic, and at 16K, where everything fits, the same
    # kernel runs 1.9x faster a query. A pace, not a dependency: the results are the unpaced
    # form's up to fp32 rounding order, and a program that never arrives (an SM held by another
    # kernel) costs the others a bounded wait a tile. Timed on the H200 (2026-12-05,
    # `bench_attention.py --bwd-also sm90_lockstep`, same process as cuDNN's SM90 backward, random
    # indices): GLM-5.1 602.6 -> 358.9 ms at 128K (1.37x cuDNN's 492.3; 34% of the matmul rate),
    # 42.2 -> 37.1 at 16K (cuDNN 30.5); V3.2 439.9 -> 311.1 at 64K (cuDNN 337.2), 667.1 at 128K
    # (cuDNN 719.5); CSA 78.7 -> 63.5 / 169.0 -> 146.3 at 64K / 128K (cuDNN 65.7 / 142.8). The
    # sort costs a [B, T, K] values and an int64 permutation for the call (3 GiB at GLM-5.1's
    # 128K; with the indexer target, the layer's path on own kernels, also a target buffer to
    # scatter back from: 4 GiB); nothing for rows already in key order (`keys_ascending`, the
    # DSA layer's HyTopK rows, `ops.hytopk(order="key")`). On by default (`--bwd-also
    # sm90_red16` times the form without it).
    bwd_lockstep: bool = True
    # Key tiles a program may lead the slowest of its wave by (an int >= 1; ValueError
    # otherwise, when the options are made): more tolerates uneven programs, fewer keeps the
    # window smaller.
    bwd_lockstep_slack: int = 1
    # dK/dV kernel orientation: keys on M (dK_tile = dS^T @ q with M = the key tile, which at 32
    # keys is below wgmma's 64 and compiles to mma.sync) or the channels on M (dK^T = q^T @ dS:
    # M = 512 / 576, every product wgmma-sized; q and dO in one layout each, so no head-block
    # halving).
    dkv_channels_on_m: bool = True
    # The dQ kernel gathers a key tile's tail channels (576 = 512 + 64) and takes their product
    # with q first, then the main ones, accumulating S in the same fp32 tile. Why: in the
    # default order the loop issues all of the tile's gathers at its top (16 + 2 LDG.128 a
    # thread) and holds them in registers until they are stored to shared memory, so the key
    # indices it loads early for P's validity mask (index pairs in S's accumulator layout) are
    # spilled across the S product (STL.64 then LDL.64, 8 a tile). Tail first, the small tail
    # tile is stored and its product issued before the main gathers, and those indices stay
    # in registers; but the main gathers then go out in two waves (6, then 10 LDG.128 as the
    # first ones are stored), which may expose more latency: only timing decides. Bitwise
    # the default under the interpreter (fp32 addition commutes); on a GPU the tensor core
    # adds the main part onto the tail's sum instead of the reverse (fp32 rounding). Compiled
    # for sm_90a (2026-12-03, `inspect_sm90.py --preset sparse-attention-glm51
    # sparse-attention-glm51-dq-tail-first`, dQ 64 x 1): 255 -> 255 registers, spills 252 ->
    # 152 B, hot loop 1437 -> 1364 instructions, LDL / STL 38 / 20 -> 20 / 4, HGMMA 144 and BAR
    # 3 unchanged. Timed on the H200 (2026-12-03, `bench_attention.py --bwd-sweep --tilings
    # 64x1 --bwd-variants tail_first`, random indices): GLM-5.1 dQ 65.3 -> 62.0 ms at 32K,
    # 275.8 -> 260.4 at 128K; V3.2 532.8 -> 503.7 at 128K. Not in the fused backward's pass
    # (its loop went 1547 -> 1597 instructions, spills unchanged); no effect without a tail
    # (power-of-two head dims).
    dq_tail_first: bool = True
    # The channels-on-M dK/dV kernel adds each key tile's dK / dV one loop iteration later: tile
    # n's P and dS (bf16) are carried and their products run before tile n + 1's S and dP, the
    # last tile's after the loop. Why: Triton lays a dot out with every warp on M when its
    # result feeds another dot in the same iteration (a "chained" dot); at 64 heads (M = 64)
    # and 8 warps that put both warpgroups on all 64 rows, so each computed the whole of S and
    # dP (68 of the loop's 172 HGMMA a thread were that copy, and the softmax's FMUL / MUFU
    # doubled). Carried, S and dP are split over the warpgroups. The dK tail's product and
    # atomics come before the main ones (other addresses), so dS's shared copy is free before
    # the main tile's transposition needs its scratch: that makes 32 keys x 2 stages fit
    # (229376 bytes of shared memory; the default needs 233600, over the H200's 232448). Same
    # products, the same atomics per address in the same order within a program: bitwise the
    # default under the interpreter; on a GPU, fp32 rounding (S's 512 + 64 channel parts added
    # as two fp32 tiles, not in one accumulator) and the atomics' order. Compiled for sm_90a
    # (2026-12-03, `inspect_sm90.py --preset sparse-attention-glm51
    # sparse-attention-glm51-dkv-carry sparse-attention-glm51-dkv-carry-32x2`), 64 x 1: 255 ->
    # 255 registers, spills 132 -> 404 B (stores; loads 132 -> 332 B, mostly outside the loop),
    # hot loop 2499 -> 2114 instructions, HGMMA 172 -> 104, FMUL 96 -> 48, MUFU 32 -> 16, BAR 22
    # -> 21, LDL / STL 22 / 3 -> 29 / 3, shared memory 212992 B either way; 32 x 2 (cp.async
    # double buffer): 1292 instructions per 32 keys, 4 B of spills. CSA (512 dims, 640 keys)
    # 2190 -> 1795 and HCA (512 dims, prefix) 2919 -> 2321 instructions, HGMMA 160 -> 96, but
    # spills 0 -> 200 and 204 B (LDL 20 a tile); QSA (16-head blocks, mma.sync) 779 -> 715; with
    # deterministic=True (GLM-5.1) the fixed-point pass 4005 -> 3623 instructions, spills 1592
    # -> 2644 B. Timed on the H200 (2026-12-03, `bench_attention.py --bwd-sweep --tilings 64x1
    # 32x2 --bwd-variants carry` at e808e04, random indices): at 64 x 1 a little faster
    # (GLM-5.1 152.9 -> 145.0 ms at 32K, 678.6 -> 657.5 at 128K), and at 32 x 2, which only the
    # carry fits, GLM-5.1 94.7 / 213.8 / 462.2 ms at 32K / 64K / 128K against the default's
    # 152.9 / 327.3 / 678.6 at 64 x 1, V3.2 364.9 / 733.7 against 552.0 / 1129.6 at 64K / 128K;
    # at 64K DeepSeek-V4's CSA 90.9 -> 59.7 ms and HCA 41.6 -> 36.0, QSA (16 x 2) 359.3 -> 360.0
    # (2f36847, `--shapes csa hca --tilings 32x2 64x1 --bwd-variants no_carry`): hence 32 x 2
    # first in dkv_tilings. With it off, 32 x 2 does not fit and the launch falls back to
    # 64 x 1 (tiling.py). Ignored with the keys on M.
    dkv_carry: bool = True
    # The Triton dK/dV kernel in lockstep (the Gluon backward's `bwd_lockstep` for the shapes
    # it does not take: QSA's two KV heads of 12 query heads, HCA's prefix with prefix_sm90
    # off): persistent
    # programs (triton_lockstep_programs_per_sm an SM, fewer where the tiling's shared memory
    # leaves room for fewer: `sparse_attention._resident_programs`) over the
    # (query, head block) items in the grid's order, each program's start of a key tile counted
    # in its wave's counter, and a program waiting (at most SYNC_SPINS reads) until the count
    # says its wave started the tile triton_lockstep_slack before (on average over the wave:
    # `common.lockstep_step`); the count and the wait are one
    # inline-PTX block, so the tile loop stays pipelined. On rows in key order the programs then
    # add into the same few key ranges of dK / dV at a time, which L2 serves (QSA's fp32 dK and
    # dV are 512 MiB at 128K, and every (query, KV head, slot) adds 512 channels: about 1.1 TB
    # of reductions). A pace, not a dependency: the same results to fp32 rounding order;
    # deterministic runs unpaced. Compiled for sm_90a (`inspect_sm90.py --preset
    # sparse-attention-qsa-dkv-lockstep`): QSA's tile loop 715 -> 753 SASS instructions (one
    # more load and reduction, the copies still pipelined), 248 -> 255 registers, no spill.
    # Off: tested under the interpreter, not yet timed (`gpu_session.sh lockstep-triton`;
    # `bench_attention.py --indices sorted --bwd-also triton_lockstep`). The QSA layer selects
    # in key order when it is on (`HyScaleQSAttention._paced`).
    dkv_lockstep: bool = False
    # The Triton dQ kernel paced the same way (its gathers of K and V, 268 MB of bf16 for QSA
    # at 128K, from the same key ranges at a time; no atomics of its own but the fused pass's
    # and the indexer target's). Off: tested under the interpreter, not yet timed.
    dq_lockstep: bool = False
    # The Triton kernels' slack (key tiles, an int >= 1) and programs an SM at most, under
    # dkv_lockstep, dq_lockstep and (for the Triton forward) fwd_lockstep.
    triton_lockstep_slack: int = 1
    triton_lockstep_programs_per_sm: int = 2
    # The dK/dV kernel with the keys on M reads q and dO in two MMA layouts (B of K @ q^T and of
    # dS^T @ q), which Triton keeps as two shared-memory copies; its head block is halved until
    # both copies fit in this many bytes (measured on the H200: 64 heads x (576 + 512) dims
    # asked for 311 KiB).
    dkv_resident_budget: int = 160 * 1024
    fwd_tilings: Tilings = ((64, 2), (32, 2), (64, 1), (32, 1), (16, 1))
    # Per backward kernel, for programs of MAX_BLOCK_H heads (GLM-5.1, V3.2, V4 CSA / HCA).
    # Timed on the H200 (2026-11-30, `bench_attention.py --bwd-sweep --shapes glm51 --t 32768`,
    # one process per tiling): dQ 65 ms at 64 x 1 against 106 at 32 x 2; dK/dV 153 ms at 64 x 1
    # against 214 at 16 x 2 (64 x 1 spills 132 bytes a thread and is still the fastest); the
    # GLM-5.1 backward at 128K went from 1377 to 944 ms. dK/dV with the channels on M faults
    # (illegal address) at 32 x 1 and 16 x 1 for the 512 / 576-dim shapes (GLM-5.1, CSA; QSA
    # runs them): not in the list until that is understood. dK/dV's 32 x 2 fits with dkv_carry
    # only (without it 233600 bytes of shared memory against the H200's 232448), and is then
    # the fastest (dkv_carry's timings).
    dq_tilings: Tilings = ((64, 1), (32, 2), (32, 1), (16, 1))
    dkv_tilings: Tilings = ((32, 2), (64, 1), (16, 2))
    # Programs of fewer heads (QSA: 12 query heads a KV head, 16-row blocks): the orders above
    # made the QSA backward at 128K slower (1296 against 904 ms), so they keep the earlier ones.
    narrow_dq_tilings: Tilings = ((32, 2), (64, 1), (32, 1), (16, 1))
    narrow_dkv_tilings: Tilings = ((16, 2), (32, 1), (16, 1))
    # The fused backward's: only 16 x 2. On the H200 (2026-11-30,
    # tests/ops/test_sparse_attention_gpu.py) 32 x 1 gave a wrong dK for the 512/576-dim shapes
    # (relative error 239 and 761) and 16 x 1 an illegal address, as the channels-on-M dK/dV
    # kernel does at one stage.
    bwd_fused_tilings: Tilings = ((16, 2),)
    # Warps a program once the accumulator tile is large (>= common.WIDE_TILE fp32), else 4;
    # per kernel, since the backward kernels hold a second [heads x dims] fp32 accumulator's
    # worth.
    fwd_wide_warps: int = 8
    dq_wide_warps: int = 8
    dkv_wide_warps: int = 8

    DEFAULT: ClassVar[AttentionKernelOptions]

    def __post_init__(self) -> None:
        # Checked here, not at launch: a kernel launch's failure disables the Gluon variant
        # and falls back (with a warning), which would hide a wrong setting.
        for name in ("fwd_flashmla", "fwd_sm90", "fwd_sm90_ws", "fwd_lockstep", "prefix_sm90",
                     "bwd_sm90", "bwd_lockstep", "bwd_dk_vec4", "dkv_lockstep", "dq_lockstep"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AttentionKernelOptions.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
        for name in ("bwd_lockstep_slack", "fwd_lockstep_slack", "triton_lockstep_slack",
                     "triton_lockstep_programs_per_sm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
                raise ValueError(f"AttentionKernelOptions.{name} must be an int >= 1, got "
                                 f"{value!r}")

    def forward_kernel_name(self) -> str:
        """The forward these options run where the Hopper kernels take the shape, as benchmark
        records name it: "flashmla", "gluon-ws-sm90" ("-lockstep" in lockstep), "gluon-sm90"
        or "triton" (`scripts/measured_defaults.py` matches records against the defaults')."""
        if self.fwd_flashmla:
            return "flashmla"
        if not (self.fwd_sm90 and self.fwd_softmax):
            return "triton"
        if self.fwd_sm90_ws:
            return "gluon-ws-sm90-lockstep" if self.fwd_lockstep else "gluon-ws-sm90"
        return "gluon-sm90"

    def backward_kernel_name(self) -> str:
        """The backward these options run where the Hopper kernel takes the shape:
        "gluon-ws-sm90" ("-red16" with 16-byte dK atomics, "-lockstepN" in lockstep with a slack
        of N) or "triton"."""
        if not self.bwd_sm90:
            return "triton"
        if self.bwd_lockstep:
            return f"gluon-ws-sm90-lockstep{self.bwd_lockstep_slack}"
        return "gluon-ws-sm90-red16" if self.bwd_dk_vec4 else "gluon-ws-sm90"


AttentionKernelOptions.DEFAULT = AttentionKernelOptions()


@dataclass(frozen=True)
class IndexerLossKernelOptions:
    """Tilings of the indexer KL loss kernels (`kernels/indexer_loss.py`); the results agree to
    fp32 rounding order for every value."""

    # The target kernel's query heads per program (its MMA's M), as in the sparse-attention
    # forward: a [64 x 576] bf16 query block stays resident; more heads loop over head blocks.
    max_block_h: int = 64
    target_tilings: Tilings = ((32, 2), (64, 1), (32, 1), (16, 1))
    # The loss and backward kernels' (indexer scores over the selected keys). Three stages
    # first: from three, Triton's pipeliner issues a tile's gathered key rows as asynchronous
    # copies a tile ahead (sm_90a, GLM-5.1's backward tile: 5 -> 13 LDGSTS, 24 -> 16 LDG), and
    # the backward is latency-bound on those gathers. Timed on an H100 (2026-12-06,
    # `bench_indexer_loss.py --variants n64x3`, row pass + backward at 128K): GLM-5.1 113.8 ->
    # 93.5 ms, V3.2 143.0 -> 116.9 (the KL identical, dk to the atomics' order); 32-key tiles
    # at three or four stages slower than it (GLM-5.1 slower than two stages, V3.2 1.05x),
    # 64 at four as three. `inspect_sm90.py --preset indexer-loss-glm51-n64x2` builds the old.
    index_tilings: Tilings = ((64, 3), (64, 2), (32, 2), (64, 1), (32, 1), (16, 1))
    # Keys per step forced for every kernel, one stage (tests); None: the first tiling above
    # that fits.
    block_n: int | None = None
    # The variants below: compiled for sm_90a (2026-12-04, Triton 3.6, 64 keys x 2 stages,
    # `inspect_sm90.py --preset indexer-loss-glm51-index ...`; counts are SASS instructions a
    # thread per 64-key tile, x warps = per program). GLM-5.1 (32 x 128) default: row pass 4
    # warps, 92 registers, pass 1 408 + pass 2 505; backward 4 warps, 255 registers (8 / 4 B
    # spilled), 1048 (16 REDG.E.ADD.F32x4, 2 HGMMA, 64 HMMA, 9 BAR: dk's tile goes through
    # shared memory to reach 4-wide atomics), so an SM holds 2 backward programs (8 warps).
    # V3.2 (64 x 128): row pass 716 + 1098, backward 1386 at 255 registers (20 / 12 B spilled).
    #
    # Warps a program of the backward kernel (and of the fused row pass + backward); None: 4,
    # or 8 once the resident [heads x D] tile is large (`indexer_loss._index_geometry`). GLM-5.1
    # at 8: 166 registers, no spill, 539 a tile (x 8 warps: 4312 against 4192), still 1 program
    # (8 warps) an SM; V3.2 at 8: 201 registers, 1095 (8760 against 5544). Timed on the H200
    # (2026-12-03, `bench_indexer_loss.py --variants`, 128K) with bwd_maxnreg 128: GLM-5.1's
    # backward 91.8 -> 83.0 ms, V3.2's 102.7 -> 143.1 ms: the default for narrow heads only
    # (narrow_* below).
    bwd_num_warps: int | None = None
    # The same for the loss row pass (GLM-5.1 at 8: 324 + 411, 80 registers). Untimed.
    loss_num_warps: int | None = None
    # Registers a thread at most for the backward kernel (and the fused one), ptxas's
    # .maxnreg, passed as a launch option; None: the compiler's choice. Why: occupancy. GLM-5.1
    # with 8 warps at 128: 126 registers, no spill, 585 a tile (4680 a program against 4192),
    # and 2 programs (16 warps) an SM instead of 8 warps: the gathers' and atomics' latency
    # has twice the warps to hide behind. 4 warps at 168: 108 / 100 B spilled, 23 local loads
    # a tile (3 programs an SM). Timed with bwd_num_warps 8 (above).
    bwd_maxnreg: int | None = None
    # Where both of the above are None: up to narrow_max_heads index heads the backward runs
    # narrow_bwd_warps warps at narrow_bwd_maxnreg registers (the timing above: GLM-5.1's 32
    # heads 91.8 -> 83.0 ms at 128K, V3.2's 64 slower); more heads keep `_index_geometry`'s.
    narrow_max_heads: int = 32
    narrow_bwd_warps: int = 8
    narrow_bwd_maxnreg: int | None = 128
    # The backward in lockstep, as the attention backward's `bwd_lockstep`: persistent programs
    # (bwd_lockstep_programs_per_sm an SM: the default's 8 warps at 128 registers, or 4 at 255,
    # leave room for two) over the rows, each program's start of a key tile counted in its
    # wave's counter, and a program waiting (at most SYNC_SPINS counter reads) until the count
    # says its wave started the tile bwd_lockstep_slack before (on average over the wave:
    # `common.lockstep_step`). On rows in increasing key order (the
    # DSA layer's, `ops.hytopk(order="key")`) the programs then add their dk_index tiles into
    # the same few key ranges at a time, which the L2 cache serves: dk_index is fp32 [S, 128],
    # 64 MiB at 128K (the H200's L2 is 50 MiB), and each (row, slot) adds a 128-wide row of it.
    # A pace, not a dependency: the same results up to fp32 rounding order. The separate
    # backward kernel only (not fused_rows_bwd's); deterministic runs unpaced. Off: tested
    # under the interpreter, compiled for sm_90a (`inspect_sm90.py --preset
    # indexer-loss-glm51-lockstep`), not yet timed (`bench_indexer_loss.py --variants
    # lockstep`). With bwd_sm90 (the default on Hopper) the Gluon backward takes the pace
    # instead (one program an SM: bwd_lockstep_programs_per_sm unused), for its dk atomics,
    # which bound it at 128K (2026-12-06 probe: 76.3 ms, 54.0 with dk L2-resident): compiled
    # for sm_90a (`--preset indexer-loss-bwd-sm90-glm51-lockstep`, no spill in the tile loops);
    # its GPU test passes (bitwise the unpaced kernel on integer inputs), but on an H100
    # (2026-12-06, GLM-5.1 at 128K, `--variants bwd_sm90_lockstep`, same process) the paced
    # backward took 82.5 ms against 69.5 unpaced (row pass + backward 102.9 against 90.6), and
    # a wider slack is slower still (another H100, same process: 65.3 unpaced, 81.6 / 88.2 /
    # 95.0 ms at slack 1 / 4 / 8): the cost is not the waiting.
    bwd_lockstep: bool = False
    bwd_lockstep_slack: int = 1
    bwd_lockstep_programs_per_sm: int = 2
    # The loss row pass in one gathered pass instead of two: sum p first (p alone, no gather),
    # then one pass that takes the online log-sum-exp and sum pn log pn, sum pn (s - c) (c the
    # first valid tile's max), KL = sum pn log pn - sum pn (s - c) + (lse - c) sum pn. p's
    # normalized values, lse and sum pn are the default's bitwise under the interpreter (the
    # same sums in the same order), so the gradients too; the KL to fp32 rounding (another
    # association). For `indexer_kl_loss`'s forward (the fused path below doesn't use it).
    # Compiled: GLM-5.1 537 a tile once (against 408 + 505 in two gathered passes), 86
    # registers. Timed on the H200 (2026-12-03, `bench_indexer_loss.py --variants`, 128K): the
    # row pass 37.9 -> 26.9 ms for GLM-5.1, 67.3 -> 31.7 ms for V3.2 (KL relative difference
    # 6e-7 there, gradients as the default's). Off: the formula subtracts terms of order log K
    # to get the KL, so a small KL loses digits (the tiny GPT test, KL 6e-6: 1.3e-3 relative
    # against stock's, where the two passes add per-slot terms that are small themselves);
    # gradients are bitwise either way. To keep the speed, the KL terms could come from the
    # backward's recomputed scores where the loss is only read there (the attention-backward
    # path).
    loss_one_pass: bool = False
    # Where the loss's gradient is known when its rows run (the attention backward that emits
    # the target, `attention_indexer_loss.py`): the row pass and the backward as one kernel
    # (`indexer_loss.indexer_loss_rows_bwd`): pass 1 (lse, target sum), a p-only pass (sum pn),
    # pass 2 the backward's tile step, whose recomputed scores also give the KL terms. Two
    # gathered passes over a row instead of three and one launch fewer. Bitwise the separate
    # kernels under the interpreter (every sum in the same order; dk to the atomics' order, or
    # bitwise in the deterministic mode). Compiled: GLM-5.1 4 warps 416 + 1378 a tile (7176 a
    # program against 7844 for the two kernels), 255 registers, 28 / 16 B spilled; with 8 warps
    # and bwd_maxnreg 128, 329 + 740 (8552), 60 B spilled, 16 warps an SM. V3.2 at 4 warps
    # spills 248 / 260 B (61 local loads a tile). Timed on the H200 (2026-12-03, 128K, row pass
    # + backward): slower, GLM-5.1 129.5 -> 144.7 ms, V3.2 169.5 -> 179.3 ms (with 8 warps and
    # bwd_maxnreg 128: 155.3 / 295.8). Off.
    fused_rows_bwd: bool = False
    # Also where the loss is computed in the attention backward, but as two kernels: the row
    # pass takes only the index scores' log-sum-exp and the target's sum (one gathered pass,
    # then p normalized without a gather, `indexer_loss_rows(..., with_kl=False)`) and the
    # backward kernel, which recomputes the scores anyway, sums the KL terms from them
    # (`indexer_loss_bwd(..., with_kl=True)`): the row pass's second gathered pass goes, and
    # each kernel keeps its own warps and registers (the fused kernel's cost it occupancy).
    # The default's terms in its tile order: the KL bitwise under the interpreter at equal tile
    # sizes, lse, sum pn, p and the gradients bitwise; no cancelling sums (loss_one_pass's
    # problem), each term is small where the KL is. The backward takes a tile's terms before
    # its products (after them the scores were held across the products: V3.2 spilled 31 / 25
    # local loads / stores a tile). Compiled for sm_90a (2026-12-05, `inspect_sm90.py --preset
    # indexer-loss-glm51-index indexer-loss-glm51-kl-in-bwd indexer-loss-v32-index
    # indexer-loss-v32-kl-in-bwd`): GLM-5.1's row-pass kernel 1608 -> 936 SASS instructions
    # (its 505-instruction second-pass tile gone), its backward tile 585 -> 663 (8 / 4 B
    # spilled, outside the loop); V3.2's row pass 2568 -> 1264 (a 1098-instruction tile gone),
    # its backward tile 1386 -> 1847 (5 / 2 local loads / stores a tile; the log of each slot's
    # target runs in every thread that holds the slot). Timed on the H200 (2026-12-05,
    # `bench_indexer_loss.py --variants kl_in_bwd`, row pass + backward): GLM-5.1 27.7 -> 26.1
    # / 121.1 -> 110.1 ms at 32K / 128K, V3.2 38.5 -> 32.5 / 169.9 -> 143.5, the KL and the
    # gradients identical to the default's on the GPU too. On by default; the standalone
    # `indexer_kl_loss` returns its value in the forward and ignores it.
    kl_in_bwd: bool = True
    # The backward (`indexer_loss_bwd`) as the warp-specialized Gluon kernel on Hopper
    # (`kernels/indexer_loss_bwd_sm90.py`: a cp.async producer warpgroup gathering the key tiles
    # a ring ahead, two wgmma consumer warpgroups on two query rows, keys on the MMA's M, the
    # row KL summed in the same pass), for the Triton kernel latency-bound on its gathers. It
    # applies to bf16 index heads of 32 or 64 x 128 on a Hopper GPU, not deterministic, not in
    # lockstep; elsewhere the Triton kernel runs without a word (QSA's 4 heads, the CPU), and
    # where it applies but cannot run (a layout, a failed compile) after one warning a cause.
    # Timed on an H100 (2026-12-06, `bench_indexer_loss.py --variants bwd_sm90`, row pass +
    # backward, the KL in the backward both): GLM-5.1 22.7 -> 19.0 ms at 32K, 94.1 -> 90.2 at 128K;
    # V3.2 28.0 -> 20.6, 116.6 -> 103.6; dk to the atomics' order, the KL sums equal to the
    # benchmark's print (per row within 1e-5 in the GPU tests). At 128K the backward alone gains
    # less (GLM-5.1 73.6 -> 69.3 ms; at 32K 17.6 -> 13.8), not yet measured why (dk's fp32
    # sums, 64 MiB at 128K, no longer fit the 50 MiB L2); without the KL (the standalone
    # `indexer_kl_loss`, kl_in_bwd=False) GLM-5.1's at 128K is slower than the Triton one's
    # (74.0-75.9 against 72.1-72.2 ms; V3.2 and 32K faster). On by default; compiled:
    # `inspect_sm90.py --preset indexer-loss-bwd-sm90-glm51 indexer-loss-bwd-sm90-v32`.
    bwd_sm90: bool = True
    # The Gluon backward (bwd_sm90) in key passes: one launch a range of S / bwd_key_passes
    # keys, each row's slots of that range only (`key_split`); a row whose slots span passes
    # sums its dq and dw in fp32 buffers (B x T x H x D x 4 bytes more) until its last pass
    # with slots writes the outputs, the KL likewise. Why: the backward is bound by dk_index's
    # fp32 atomics, 64 MiB at 128K against a 50 MiB L2 (2026-12-06 probe on an H100: 76.3 ms,
    # 54.0 with every row's keys in its last 16K); a pass's live part of dk_index (and of
    # k_index's gathers) is 1 / bwd_key_passes of it. Costs a pass: q read again for the rows
    # with slots in it, the fp32 dq read and written for rows that span it, a partly masked
    # tile a row at each boundary. Needs each row's valid keys increasing first, -1 after
    # (HyTopK's key-ordered output: the DSA layer's, `keys_ascending` on the attention-backward
    # path); elsewhere (the standalone `indexer_kl_loss`) and with bwd_lockstep one pass runs. The
    # Triton backward has no passes. The same results up to fp32 rounding order (bitwise on
    # integer inputs, GPU tests). 0 (the default): `key_split.auto_key_passes`, one pass while
    # dk_index and k_index fit half the L2 (up to ~34K keys), else AUTO_KEY_PASSES (3). Timed
    # on an H100 (2026-12-07 03:37 UTC, `bench_indexer_loss.py --variants
    # selection_lse_key_passesN`, row pass + backward on the selection's log-sum-exp, same
    # process): GLM-5.1 at 128K 74.74 -> 64.42 / 58.26 / 58.84 ms at 2 / 3 / 4 passes, V3.2
    # 78.33 -> 68.43 / 64.54 / 66.10; the GLM-5.1 layer's step 1119.7 -> 1095.7 ms, its peak
    # 47.16 -> 49.21 GiB; at 32K slower (00:01 UTC, before rows within one pass skipped the
    # buffers: GLM-5.1 14.16 -> 14.84 / 15.14 at 2 / 3, V3.2 14.41 -> 15.91 / 16.46). Other
    # lengths untimed.
    bwd_key_passes: int = 0

    DEFAULT: ClassVar[IndexerLossKernelOptions]

    def __post_init__(self) -> None:
        # Checked here: a launch that fails on them would read as the kernel's failure.
        for name in ("bwd_sm90",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"IndexerLossKernelOptions.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
        for name in ("bwd_lockstep_slack", "bwd_lockstep_programs_per_sm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
                raise ValueError(f"IndexerLossKernelOptions.{name} must be an int >= 1, got "
                                 f"{value!r}")
        value = self.bwd_key_passes
        if isinstance(value, bool) or not (isinstance(value, int) and value >= 0):
            raise ValueError("IndexerLossKernelOptions.bwd_key_passes must be an int >= 0 (0: "
                             f"by size), got {value!r}")


IndexerLossKernelOptions.DEFAULT = IndexerLossKernelOptions()

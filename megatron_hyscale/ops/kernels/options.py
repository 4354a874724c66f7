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
    # the select loop 456 against 1851. Not yet timed on a GPU (bench_selection.py compares
    # both). With one head a row (relu=False's folded query) there is no head sum, and the rows
    # stay on M whatever this says.
    keys_on_m: bool = True
    # Candidate append: each survivor takes its buffer slot with an atomic add on its row's
    # counter (global memory; only lanes holding a survivor issue it) and is stored one tile
    # later, so the next tile's GEMM hides the atomic's round trip. False: a CTA-wide test and
    # prefix sum on every tile with a candidate, which on random inputs at 128K is nearly every
    # tile. Compiled for sm_90a (64 heads, keys on M), the select loop has 456 SASS instructions
    # and 3 barriers a tile against 554 and 16. Not yet timed on a GPU (bench_selection.py
    # compares both).
    atomic_slots: bool = True
    # Key-tile pruning by a centroid / radius score bound (the select mode only). Off by
    # default: on inputs without structure (random) no tile is ever pruned and the bound only
    # costs time; the GPU benchmark measures both settings (bench_selection.py --prune both).
    prune: bool = False

    DEFAULT: ClassVar[HyTopKOptions]


HyTopKOptions.DEFAULT = HyTopKOptions()

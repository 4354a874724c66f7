"""Context-parallel helpers: megatron's zigzag sequence layout and a KV all-gather.

- `layout`: where this rank's tokens sit in the global sequence (2 x cp chunks, rank r holds
  chunks r and 2cp-1-r), splitting a full sequence the way megatron's data loader does, and
  the permutations between the gathered (rank-major) order and the global order, the same for
  packed THD sequences, which megatron splits per document (`thd_positions`, `thd_split`,
  `thd_gather_order`, `thd_merge`), and `cp_row_layout`: an attention layer's CP group and its
  local rows' global positions.
- `gather`: `all_gather_to_global(x, group)`, an all-gather over the CP group that returns the
  global sequence order (a packed THD sequence's given a `RowOrder`) and whose backward
  reduce-scatters the gradient to the owners, and `start_all_gather_to_global`, the same
  started asynchronously (`.wait()` for the result).
"""

from megatron_hyscale.parallel.gather import all_gather_to_global, start_all_gather_to_global
from megatron_hyscale.parallel.layout import (
    CPRowLayout,
    RowOrder,
    cp_row_layout,
    global_to_rank_major,
    rank_major_to_global,
    thd_gather_order,
    thd_merge,
    thd_positions,
    thd_split,
    zigzag_merge,
    zigzag_positions,
    zigzag_split,
)

__all__ = [
    "CPRowLayout",
    "RowOrder",
    "all_gather_to_global",
    "cp_row_layout",
    "global_to_rank_major",
    "rank_major_to_global",
    "start_all_gather_to_global",
    "thd_gather_order",
    "thd_merge",
    "thd_positions",
    "thd_split",
    "zigzag_merge",
    "zigzag_positions",
    "zigzag_split",
]

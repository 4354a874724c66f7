"""Each row's slot ranges by key range: where a backward split into key passes starts and ends a
row in each pass (`IndexerLossKernelOptions.bwd_key_passes`).

Shapes: indices int32 / int64 [B, T, K] whose rows hold their valid keys (>= 0) first, -1 after
them, in increasing key order (HyTopK's key-ordered layout, `keys_ascending`), S the key count,
passes P >= 1. Returns int32 [B * T, P + 1]: column 0 is 0, column p (1 .. P) the number of the
row's slots whose key is below p * S // P. With that layout pass p's keys are exactly the row's
slots [split[r, p], split[r, p + 1]), and the last column counts the row's valid slots (the -1
tail belongs to no pass). Valid slots first is what a backward's results need (the passes then
cover each valid slot once, whatever the order); the increasing order is what bounds each
pass's keys (a -1 between valid slots would drop the slots after it).

Algorithm: one program a row; each block of its indices is compared with the P bounds at once
and the counts summed, one read of the indices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.kernels.common import fix_interpreter

fix_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1
# Slots a program compares at a time ([KEY_BLOCK x next_power_of_2(P)] booleans).
KEY_BLOCK = 512
# `auto_key_passes`: bytes a key costs a backward pass (its fp32 dk_index row of 128 and its
# bf16 k_index row), the live bytes one pass may keep (half the 50 MiB L2 of an H100 / H200:
# 32K keys, 24 MiB, ran faster in one pass), and the passes beyond that: the fastest count
# measured at 128K (96 MiB; 2026-12-07, H100: GLM-5.1 and V3.2 both fastest at 3 of 2 / 3 / 4
# / 8, and again of 1 / 2 / 3 / 4 once rows within one pass skipped the fp32 buffers). Lengths
# between and beyond are untimed.
KEY_BYTES = 128 * 4 + 128 * 2
ONE_PASS_BYTES = 25 * 2**20
AUTO_KEY_PASSES = 3


def auto_key_passes(keys: int) -> int:
    """The key passes `IndexerLossKernelOptions.bwd_key_passes = 0` runs over `keys` keys."""
    return 1 if keys * KEY_BYTES <= ONE_PASS_BYTES else AUTO_KEY_PASSES


@triton.jit
def _key_split_kernel(idx_ptr, split_ptr, T, NK, S, sib, sit, sik, PASSES: tl.constexpr,
                      P2: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = idx_ptr + (r // T) * sib + (r % T) * sit
    cols = tl.arange(0, P2) + 1
    bounds = cols.to(tl.int64) * S // PASSES
    counts = tl.zeros([P2], tl.int32)
    for k0 in range(0, NK, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(base + offs * sik, mask=offs < NK, other=-1).to(tl.int64)
        below = (idx[:, None] >= 0) & (idx[:, None] < bounds[None, :])
        counts += tl.sum(below.to(tl.int32), axis=0)
    row = split_ptr + r * (PASSES + 1)
    tl.store(row + cols, counts, mask=cols <= PASSES)
    tl.store(row, 0)


def key_split(indices: torch.Tensor, keys: int, passes: int) -> torch.Tensor:
    """int32 [B * T, passes + 1] (module docstring) for indices [B, T, K] over `keys` keys."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be an int >= 1, got {passes!r}")
    B, T, NK = indices.shape
    split = torch.empty((B * T, passes + 1), dtype=torch.int32, device=indices.device)
    if B * T:
        _key_split_kernel[(B * T,)](
            indices, split, T, NK, keys, *indices.stride(), PASSES=passes,
            P2=triton.next_power_of_2(passes), BLOCK_K=KEY_BLOCK, num_warps=4)
    return split


def key_split_reference(indices: torch.Tensor, keys: int, passes: int) -> torch.Tensor:
    """`key_split` in plain torch."""
    B, T, NK = indices.shape
    bounds = torch.arange(1, passes + 1, device=indices.device, dtype=torch.int64) * keys // passes
    idx = indices.reshape(B * T, NK, 1).long()
    counts = ((idx >= 0) & (idx < bounds)).sum(1, dtype=torch.int32)
    return torch.cat([torch.zeros(B * T, 1, dtype=torch.int32, device=indices.device), counts], 1)

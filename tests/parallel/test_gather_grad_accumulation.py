"""The CP all-gather's backward adds the ranks' gradient addends in fp32 (issue #23, 3).

`parallel.all_gather_to_global` (the DSA / V4 / QSA layers' key and indexer-key gathers)
reduce-scatters each rank's gradient of the whole sequence back to the owners. In bf16 the
collective sums in bf16: over 4 gloo ranks, 3 roundings of a growing sum. With the addends
summed in fp32 and cast once, every element of a rank's gradient is within one bf16 rounding
(relative 2^-8) of the exact sum; before the fix 441 of rank 0's 2048 were not (relative
error up to 1 where the addends cancel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hyscale.testing.distributed import run_workers

WORLD = 4  # above 2: two addends are rounded once whatever the dtype
L, D = 8, 256  # local rows (two zigzag chunks of 4), channels
ONE_ROUNDING = 2.0 ** -8  # bf16's unit roundoff


def _body(rank: int, result: dict) -> None:
    from megatron_hyscale.parallel import all_gather_to_global

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(L, D, generator=g).bfloat16().requires_grad_()
    # This rank's loss reads the whole gathered sequence with its own weights: the gradient
    # of the whole sequence it hands back is `upstream`.
    upstream = torch.randn(WORLD * L, D, generator=g).bfloat16()
    gathered = all_gather_to_global(x, dist.group.WORLD)
    assert gathered.dtype == torch.bfloat16 and gathered.shape == (WORLD * L, D)
    torch.autograd.backward(gathered, upstream)
    everything: list = [None] * WORLD
    dist.all_gather_object(everything, (x.grad, upstream))
    result["ranks"] = everything


def test_reduce_scatter_sums_bf16_gradients_in_fp32():
    from megatron_hyscale.parallel import zigzag_positions

    ranks = run_workers(_body, WORLD, timeout_s=120)["ranks"]
    total = sum(up.double() for _, up in ranks)  # the exact sum of the addends
    checked = 0
    for rank, (grad, _) in enumerate(ranks):
        assert grad.dtype == torch.bfloat16
        # Rank r owns the global rows of its two zigzag chunks, in its local order.
        expected = total[zigzag_positions(L, WORLD, rank)]
        err = (grad.double() - expected).abs()
        bound = ONE_ROUNDING * expected.abs()
        worst = (err / expected.abs().clamp_min(1e-30)).max().item()
        assert (err <= bound).all(), (
            f"rank {rank}: {(err > bound).sum().item()} of {err.numel()} gradient elements "
            f"beyond one bf16 rounding of the exact sum (worst relative error {worst:.3g})")
        checked += err.numel()
    assert checked == WORLD * L * D

"""launch_first_fitting: skips tilings that run out of resources, caches the one that ran."""

from __future__ import annotations

import pytest
from triton.runtime.errors import OutOfResources

from megatron_hyscale.ops.kernels.tiling import launch_first_fitting


class FakeKernel:
    """`kernel[grid](...)` that records its launches and runs out of shared memory above
    `max_block_n` keys a step."""

    def __init__(self, max_block_n: int) -> None:
        self.max_block_n, self.launches = max_block_n, []

    def __getitem__(self, grid):
        def launch(*args, BLOCK_N, num_warps, num_stages, **const):
            if BLOCK_N > self.max_block_n:
                raise OutOfResources(BLOCK_N * 1024, self.max_block_n * 1024, "shared memory")
            self.launches.append((grid, args, const, BLOCK_N, num_warps, num_stages))
        return launch


def test_first_fitting_tiling_runs_and_is_cached() -> None:
    kernel, cache = FakeKernel(max_block_n=32), {}
    tilings = ((64, 2), (32, 2), (16, 1))
    launch_first_fitting(kernel, (3,), ("a",), {"C": 1}, tilings, 8, cache, ("k",), "test")
    assert kernel.launches == [((3,), ("a",), {"C": 1}, 32, 8, 2)] and cache == {("k",): (32, 2)}
    kernel.max_block_n = 1024  # a cached tiling is launched directly, not re-searched
    launch_first_fitting(kernel, (3,), ("a",), {"C": 1}, tilings, 8, cache, ("k",), "test")
    assert kernel.launches[-1][3:] == (32, 8, 2)


def test_no_tiling_fits_names_the_op_and_every_try() -> None:
    kernel, cache = FakeKernel(max_block_n=8), {}
    with pytest.raises(RuntimeError, match=r"no widget tiling fits .*64x2.*16x1"):
        launch_first_fitting(kernel, (1,), (), {}, ((64, 2), (16, 1)), 4, cache, ("k",),
                             "widget")
    assert cache == {} and kernel.launches == []

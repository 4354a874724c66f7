"""Multi-process tests on one machine: spawn ranks, bound their run time, collect a result.

A test gives `run_workers` a module-level `body(rank, result)`: each spawned rank joins a gloo
process group on 127.0.0.1 (one intra-op thread), runs the body, which fills the dict `result`,
and saves it with `torch.save` (rank 0 always; another rank when it fails, under the key
"worker_error" holding the traceback). A body builds megatron's groups with
`hyscale_bench.distributed.init_model_parallel`.

`FakeGroup(size, rank)` stands in for a process group where only its size and rank are read
(layout code tested without processes).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyscale_bench.distributed import free_port


class FakeGroup:
    """A process group's size() and rank(), nothing else."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _rank_main(rank: int, port: int, out_path: str, nprocs: int,
               body: Callable[[int, dict], None]) -> None:
    """One spawned rank: the process group, the body, the saved result (see the module doc)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nprocs)
    result: dict = {}
    try:
        body(rank, result)
    except BaseException:
        result = {"worker_error": f"rank {rank}:\n{traceback.format_exc()}"}
    finally:
        if rank == 0 or "worker_error" in result:
            torch.save(result, f"{out_path}.{rank}")
        dist.destroy_process_group()


def run_workers(body: Callable[[int, dict], None], nprocs: int, timeout_s: float) -> dict:
    """Run `body` on `nprocs` spawned gloo ranks and return rank 0's result dict.

    A rank stuck in a collective its peer never joins must not hang the test session: after
    `timeout_s` every rank is killed and RuntimeError raised; any rank's saved
    "worker_error" is raised too, with all their tracebacks.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
            context = mp.spawn(_rank_main, args=(free_port(), out, nprocs, body),
                               nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in context.processes:
                    proc.kill()
                raise RuntimeError(f"workers did not finish in {timeout_s} s")
        found = {rank: torch.load(f"{out}.{rank}", weights_only=False)
                 for rank in range(nprocs) if os.path.exists(f"{out}.{rank}")}
    errors = [r["worker_error"] for r in found.values() if "worker_error" in r]
    if errors:
        raise RuntimeError("\n".join(errors))
    return found[0]


def worker_ranks(results: dict, key: Any) -> list[dict]:
    """`results[key]["ranks"]`, every rank's dict of one case (a body that all-gathers them),
    where a rank that raised stored {"error": traceback}: the test fails with the first."""
    import pytest

    ranks = results[key]["ranks"]
    for got in ranks:
        if "error" in got:
            pytest.fail(got["error"], pytrace=False)
    return ranks


def worker_result(results: dict, key: Any) -> dict:
    """`results[key]` from a `run_workers` body that stores {"error": traceback} for a case
    that raised (so the other cases still run): the test of that case fails with it."""
    import pytest

    got = results[key]
    if "error" in got:
        pytest.fail(got["error"], pytrace=False)
    return got

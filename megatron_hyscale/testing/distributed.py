"""Multi-process tests on one machine: spawn ranks, bound their run time, collect a result.

A worker is `worker(rank, port, out_path)`: it joins a process group on 127.0.0.1:`port`,
does its work and saves a dict with `torch.save` to f"{out_path}.{rank}" (rank 0 always; other
ranks when they fail, under the key "worker_error" holding the traceback).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(worker: Callable[[int, int, str], None], nprocs: int,
                timeout_s: float) -> dict:
    """Spawn `nprocs` ranks of `worker` (one intra-op thread each) and return rank 0's dict.

    A rank stuck in a collective its peer never joins must not hang the test session: after
    `timeout_s` every rank is killed and RuntimeError raised; any rank's saved
    "worker_error" is raised too, with all their tracebacks.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
            context = mp.spawn(worker, args=(free_port(), out), nprocs=nprocs, join=False)
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

"""Soak: many training steps of the tiny HyScale DSA GPT under full activation recompute (every
layer's selection recorded in the forward and replayed in the recompute) with megatron's DDP and
optimizer. Nothing may grow with the step count:

- the selection replay store: no pending entry after any step, each step computes and replays
  exactly one selection per layer, and the module-level bookkeeping (live stores, offloaded
  entries, host copies) keeps its size;
- memory: the bytes of live tensors (every tensor the garbage collector can see, storages
  counted once) and the number of live Python objects are what they were after the warm-up;
  the resident set size grows by less than `RSS_TOLERANCE` (allocator noise);
- step time: the median of the last tenth of the steps is within 1.5x of the median of the
  tenth after the warm-up tenth (process CPU time, which other processes on a shared machine
  disturb much less than wall time).

200 steps run by default (about 15-30 s on a 2-core CPU), 1000 with `pytest -m slow`.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import pytest
import torch

from megatron_hyscale import replay
from megatron_hyscale.testing.training import FULL_RECOMPUTE, Trainer

RSS_TOLERANCE = 32 * 2**20
# Python objects: torch's autograd / dispatcher caches add about 40 weak references and builtin
# methods over the first ~100 steps, then nothing (measured up to 400 steps); a leak of one
# object per step would show at 1000 steps.
OBJECT_TOLERANCE = 100


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes() -> tuple[int, int]:
    """(bytes of the distinct storages of every live tensor, number of live Python objects).

    The objects are counted before the storages are looked at: `untyped_storage()` gives a
    storage a Python object that lives as long as the storage does.
    """
    gc.collect()
    objects = gc.get_objects()
    n_objects = len(objects)
    storages: dict[int, int] = {}
    for obj in objects:
        try:
            # type(), not isinstance: the latter reads __class__, which some lazy module
            # attributes (torch.distributed.reduce_op) answer with a deprecation warning
            if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # tensors without storage (e.g. functional wrappers)
            continue
    del objects
    return sum(storages.values()), n_objects


def replay_bookkeeping() -> dict[str, int]:
    return {"stores": len(replay._stores), "offloaded": len(replay._offloaded),
            "host_copies": len(replay._host_copies), "pending": replay.pending_entries()}


@pytest.fixture
def offload(request):
    replay.configure(offload=request.param)
    yield request.param
    replay.configure(offload=False)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"], indirect=True)
@pytest.mark.parametrize("steps", [200, pytest.param(1000, marks=pytest.mark.slow)])
def test_soak_full_recompute_nothing_grows(steps, offload):
    if torch.cuda.is_available() and not offload:
        pytest.skip("CPU test (the timing and memory checks read the host process)")
    run = Trainer("dsa", stock=False, warmup=10, decay_steps=steps, **FULL_RECOMPUTE)
    n_layers = run.config.num_layers
    tenth = steps // 10
    times: list[float] = []
    replay.reset_stats()
    start = None
    for i in range(steps):
        t0 = time.process_time()
        loss = run.train_step().loss
        times.append(time.process_time() - t0)
        assert torch.isfinite(loss), f"step {i}: loss {loss}"
        stats = replay.get_stats()
        assert stats["selections_computed"] == stats["selections_replayed"] == n_layers * (i + 1)
        assert replay.pending_entries() == 0, f"step {i}: {replay_bookkeeping()}"
        if i == tenth - 1:  # after the warm-up tenth
            live_tensor_bytes()  # once first: the storages' Python objects (see its docstring)
            start = (live_tensor_bytes(), rss_bytes(), replay_bookkeeping())
    end = (live_tensor_bytes(), rss_bytes(), replay_bookkeeping())
    (tensor_bytes0, objects0), rss0, book0 = start
    (tensor_bytes1, objects1), rss1, book1 = end

    assert book1 == book0
    if offload:
        assert replay.get_stats()["selections_offloaded"] == n_layers * steps
    assert tensor_bytes1 == tensor_bytes0, (tensor_bytes0, tensor_bytes1)
    assert objects1 - objects0 < OBJECT_TOLERANCE, (objects0, objects1)
    assert rss1 - rss0 < RSS_TOLERANCE, (rss0, rss1)
    first = statistics.median(times[tenth:2 * tenth])
    last = statistics.median(times[-tenth:])
    print(f"soak {steps} steps (offload={offload}): tensor bytes {tensor_bytes0} -> "
          f"{tensor_bytes1}, objects {objects0} -> {objects1}, RSS {rss0 / 2**20:.1f} -> "
          f"{rss1 / 2**20:.1f} MiB, step CPU time median {first * 1e3:.1f} -> {last * 1e3:.1f} ms")
    assert last < 1.5 * first, (first, last)

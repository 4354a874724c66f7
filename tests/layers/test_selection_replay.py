"""The selection protocol itself (`replay.SelectionReplay.select`): its phase rules, the
per-layer FIFO over micro-batches in flight, the counters, baseline and shared selections.
Layer-level replay is covered by test_dsa_replay.py, test_csa.py, test_qsa.py and the CP tests."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from megatron.core import tensor_parallel

from megatron_hyscale import replay

SHAPE = (1, 2, 3)


def indices(value: int) -> torch.Tensor:
    return torch.full(SHAPE, value, dtype=torch.int32)


class Layer:
    """A stand-in layer: its forward selects through `store`, computing `next` when asked."""

    def __init__(self, name: str, *, replays: bool = True, shared: bool = False) -> None:
        self.store = replay.SelectionReplay(name, replays=replays)
        self.shared = shared
        self.next = 0
        self.computed: list[int] = []  # values computed, in call order
        self.seen: list[tuple[str, bool, int]] = []  # (phase, replaying(), value) per forward

    def compute(self) -> torch.Tensor:
        self.computed.append(self.next)
        return indices(self.next)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, replaying = self.store.phase(), self.store.replaying()
        picked = self.store.select(SHAPE, self.compute, shared=self.shared)
        self.seen.append((phase, replaying, int(picked[0, 0, 0])))
        return x * (1 + picked.float().sum())


def checkpointed(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    return tensor_parallel.checkpoint(layer.forward, False, x)


@pytest.fixture(autouse=True)
def clean_stores():
    replay.clear()
    replay.reset_stats()
    yield
    replay.clear()


def test_without_recompute_it_computes_and_stores_nothing():
    layer = Layer("plain")
    x = torch.ones(2, requires_grad=True)
    layer.next = 4
    layer.forward(x).sum().backward()
    assert layer.seen == [("off", False, 4)] and layer.computed == [4]
    assert len(layer.store) == 0 and replay.pending_entries() == 0
    assert replay.get_stats()["selections_computed"] == 1
    assert replay.get_stats()["selections_replayed"] == 0


def test_recompute_replays_the_first_forwards_selection():
    layer = Layer("ckpt")
    x = torch.ones(2, requires_grad=True)
    layer.next = 7
    out = checkpointed(layer, x)
    assert layer.seen == [("record", False, 7)] and len(layer.store) == 1
    layer.next = 8  # a recompute that selected again would see 8
    out.sum().backward()
    assert layer.seen[1] == ("replay", True, 7)
    assert layer.computed == [7]  # compute ran once
    torch.testing.assert_close(x.grad, torch.full((2,), 1.0 + 7 * 6))
    stats = replay.get_stats()
    assert stats["selections_computed"] == 1 and stats["selections_replayed"] == 1
    replay.assert_drained()


def test_fifo_per_layer_over_micro_batches_in_flight():
    """A pipeline stage: every micro-batch's forward (layers in order), then the backwards in
    the same micro-batch order, each recomputing its layers in reverse: every recompute gets
    its own micro-batch's selection of its own layer."""
    layers = [Layer("first"), Layer("second")]
    outs = []
    for mb in range(3):
        h = torch.ones(2, requires_grad=True)
        for i, layer in enumerate(layers):
            layer.next = 10 * mb + i
            h = checkpointed(layer, h)
        outs.append(h)
    assert [len(layer.store) for layer in layers] == [3, 3]
    assert replay.pending_entries() == 6
    for layer in layers:
        layer.next = -1  # never computed again
    for out in outs:
        out.sum().backward()
    for i, layer in enumerate(layers):
        first = [value for phase, _, value in layer.seen if phase == "record"]
        again = [value for phase, _, value in layer.seen if phase == "replay"]
        assert first == again == [i, 10 + i, 20 + i], layer.seen
        assert -1 not in layer.computed
    stats = replay.get_stats()
    assert stats["selections_computed"] == 6 and stats["selections_replayed"] == 6
    replay.assert_drained()


def test_a_baseline_store_selects_again_and_records_nothing():
    layer = Layer("baseline", replays=False)
    x = torch.ones(2, requires_grad=True)
    layer.next = 3
    out = checkpointed(layer, x)
    assert len(layer.store) == 0
    layer.next = 3
    out.sum().backward()
    assert layer.seen == [("off", False, 3), ("off", False, 3)] and layer.computed == [3, 3]
    stats = replay.get_stats()
    assert stats["selections_computed"] == 2 and stats["selections_replayed"] == 0
    replay.assert_drained()


def test_a_shared_selection_is_recorded_and_replayed_but_not_counted():
    layer = Layer("index-sharing", shared=True)
    x = torch.ones(2, requires_grad=True)
    layer.next = 5
    out = checkpointed(layer, x)
    out.sum().backward()
    assert [value for _, _, value in layer.seen] == [5, 5] and layer.computed == [5]
    stats = replay.get_stats()
    assert stats["selections_computed"] == 0 and stats["selections_replayed"] == 1


def test_a_selection_of_the_wrong_shape_is_refused():
    store = replay.SelectionReplay("wrong shape")
    with pytest.raises(replay.ReplayError, match=r"wrong shape: the selection has shape"):
        store.select((1, 2, 4), lambda: indices(0))
    assert replay.get_stats()["selections_computed"] == 0


def test_a_flag_left_set_by_a_failed_checkpoint_records_nothing():
    """megatron leaves is_checkpointing() set when the checkpointed function raises; a later
    training forward (grad on, no recompute) must neither record (nothing would replay it)
    nor replay, and a real checkpointed forward still records."""
    from megatron.core.tensor_parallel import random as tp_random

    def failing(x):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        tensor_parallel.checkpoint(failing, False, torch.ones(2, requires_grad=True))
    try:
        assert tp_random.is_checkpointing()  # megatron's behaviour this guards against
        layer = Layer("after_failure")
        x = torch.ones(2, requires_grad=True)
        layer.next = 3
        layer.forward(x).sum().backward()
        assert layer.seen == [("off", False, 3)] and len(layer.store) == 0
        assert replay.pending_entries() == 0
    finally:
        tp_random._unset_checkpointing()
    layer.next = 5
    checkpointed(layer, x).sum().backward()
    assert [phase for phase, _, _ in layer.seen[1:]] == ["record", "replay"]
    assert layer.computed == [3, 5] and len(layer.store) == 0


@pytest.mark.parametrize("offload", [False, True])
def test_a_selection_with_its_companion_is_replayed_as_one_entry(offload):
    """`compute` returning (indices, companion) (the DSA layer's selected scores' log-sum-exp):
    over micro-batches in flight each recompute gets its own pair back, as a pair, from one
    entry (counted once), also through host memory; the indices' shape is what is checked."""
    store = replay.SelectionReplay("paired")
    outs, computed = [], []

    def forward(x: torch.Tensor, value: int) -> torch.Tensor:
        def compute():
            computed.append(value)
            return indices(value), torch.full((1, 2), value + 0.5)

        picked, companion = store.select(SHAPE, compute)
        seen.append((store.phase(), int(picked[0, 0, 0]), float(companion[0, 1])))
        return x * (1 + picked.float().sum() + companion.sum())

    seen: list[tuple[str, int, float]] = []
    replay.configure(offload=offload)
    try:
        for mb in range(3):
            outs.append(tensor_parallel.checkpoint(partial(forward, value=mb), False,
                                                   torch.ones(2, requires_grad=True)))
        assert len(store) == 3 and replay.pending_entries() == 3
        copies = [copy for entry in store.queue for copy in entry.copies]
        assert len(copies) == 6  # indices and companion, each kept (on the host if offloaded)
        assert all((c.tensor is None and c.host is not None) == offload for c in copies)
        for out in outs:
            out.sum().backward()
    finally:
        replay.configure(offload=False)
    assert computed == [0, 1, 2]  # never again in the recompute
    assert seen == [("record", 0, 0.5), ("record", 1, 1.5), ("record", 2, 2.5),
                    ("replay", 0, 0.5), ("replay", 1, 1.5), ("replay", 2, 2.5)]
    stats = replay.get_stats()
    assert stats["selections_computed"] == 3 and stats["selections_replayed"] == 3
    assert stats["selections_offloaded"] == (3 if offload else 0)
    assert not replay._offloaded
    replay.assert_drained()


@pytest.mark.parametrize("offload", [False, True])
def test_a_paired_selection_is_checked_on_its_indices_shape(offload):
    """The indices' shape is checked on record and on replay; an offloaded entry refused on
    replay leaves nothing for a later replay to prefetch."""
    store = replay.SelectionReplay("paired shape")
    with pytest.raises(replay.ReplayError, match=r"paired shape: the selection has shape"):
        store.select((1, 2, 4), lambda: (indices(0), torch.zeros(1, 2)))
    replay.configure(offload=offload)
    try:
        store.record((indices(1), torch.zeros(1, 2)))
    finally:
        replay.configure(offload=False)
    assert len(replay._offloaded) == (1 if offload else 0)
    with pytest.raises(replay.ReplayError, match=r"recorded selection has shape \(1, 2, 3\)"):
        store.replay((1, 2, 4))
    assert not replay._offloaded and replay.pending_entries() == 0


@pytest.mark.parametrize("selected", [
    (indices(0),), (indices(0), torch.zeros(1, 2), torch.zeros(1, 2)), (indices(0), None)],
    ids=["one", "three", "not-a-tensor"])
def test_a_tuple_other_than_a_pair_of_tensors_is_refused(selected):
    store = replay.SelectionReplay("bad tuple")
    with pytest.raises(replay.ReplayError, match=r"bad tuple: a selection is int32 indices or "
                                                 r"the pair"):
        store.select(SHAPE, lambda: selected)
    assert replay.get_stats()["selections_computed"] == 0 and len(store) == 0

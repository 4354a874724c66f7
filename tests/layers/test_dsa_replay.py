"""Selection replay in the DSA layer: micro-batches in flight, index sharing, misuse."""

from __future__ import annotations

import gc

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)

from hyscale_bench.models import build_gpt, default_device, tiny_dsa_config
from megatron_hyscale import replay

DEVICE = default_device()

VOCAB, T, B = 97, 256, 1
FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)



def micro_batches(n: int):
    g = torch.Generator().manual_seed(11)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    return [(torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE), pos,
             torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)) for _ in range(n)]


def pipelined_grads(model, mbs) -> dict[str, torch.Tensor]:
    """All forwards first, then the backwards in the same order (a pipeline stage's view)."""
    model.train()
    model.zero_grad(set_to_none=True)
    losses = [model(ids, pos, None, labels=labels).mean() for ids, pos, labels in mbs]
    for loss in losses:
        loss.backward()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def build(stock: bool, **overrides):
    cfg = tiny_dsa_config(num_layers=4, dsa_indexer_topk_freq=2, **overrides)
    torch.manual_seed(5)
    return build_gpt(cfg, stock=stock, vocab_size=VOCAB, max_sequence_length=T)


def test_index_sharing_with_micro_batches_in_flight_matches_no_recompute():
    mbs = micro_batches(3)
    reference = build(stock=False)
    expected = pipelined_grads(reference, mbs)
    model = build(stock=False, **FULL_UNIFORM)
    model.load_state_dict(reference.state_dict())
    replay.reset_stats()
    got = pipelined_grads(model, mbs)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    stats = replay.get_stats()
    assert stats["selections_computed"] == 3 * 2  # 3 micro-batches x 2 computing layers
    assert stats["selections_replayed"] == 3 * 4  # every layer's recompute replays
    assert replay.pending_entries() == 0


def test_stock_index_sharing_reads_another_micro_batch_under_recompute():
    """The premise of the test above: megatron-core 0.19.2's stock layer gets this wrong."""
    mbs = micro_batches(2)
    reference = build(stock=True)
    expected = pipelined_grads(reference, mbs)
    model = build(stock=True, **FULL_UNIFORM)
    model.load_state_dict(reference.state_dict())
    got = pipelined_grads(model, mbs)
    worst = max((got[n] - g).abs().max().item() for n, g in expected.items())
    assert worst > 1e-3


def test_recompute_without_record_raises_and_leftovers_are_reported():
    store = replay.SelectionReplay("test layer")
    with pytest.raises(replay.ReplayError, match="none was recorded"):
        store.replay((1, 2, 3))
    store.record(torch.zeros(1, 2, 3, dtype=torch.int32))
    with pytest.raises(replay.ReplayError, match="shape"):
        store.replay((1, 2, 4))
    store.record(torch.zeros(1, 2, 3, dtype=torch.int32))
    with pytest.raises(replay.ReplayError, match="never replayed"):
        replay.assert_drained()
    replay.clear()
    replay.assert_drained()


def test_forward_only_under_recompute_is_caught(monkeypatch):
    monkeypatch.setattr(replay, "MAX_PENDING_PER_LAYER", 3)
    model = build(stock=False, **FULL_UNIFORM)
    model.train()
    (ids, pos, labels), = micro_batches(1)
    for _ in range(3):
        model(ids, pos, None, labels=labels)  # checkpointed forwards, no backward
    with pytest.raises(replay.ReplayError, match="none replayed"):
        model(ids, pos, None, labels=labels)
    replay.clear()


def live_tensor_bytes() -> int:
    """Bytes held by live tensors: CUDA's allocator count on the GPU; on CPU the storages of
    every tensor the garbage collector can reach (a leak of recorded indices shows in both)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # plain tensors only: torch.compile's FakeTensors (left by another test) have no data
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_100_steps_leave_no_growth_in_memory_or_the_replay_store():
    model = build(stock=False, **FULL_UNIFORM)
    mbs = micro_batches(2)
    grads = pipelined_grads(model, mbs)  # the first step allocates gradients and caches
    del grads
    before = live_tensor_bytes()
    for _ in range(100):
        grads = pipelined_grads(model, mbs)
        assert replay.pending_entries() == 0 and not replay._offloaded
        del grads
    assert live_tensor_bytes() == before
    stats = replay.get_stats()
    assert stats["selections_replayed"] >= 100 * 2 * 4  # every step replayed: the test ran


def test_offload_keeps_entries_on_host_and_changes_nothing():
    mbs = micro_batches(2)
    # Bitwise on the GPU too: deterministic_mode turns the kernels' fp32 atomics off.
    model = build(stock=False, deterministic_mode=True, **FULL_UNIFORM)
    expected = pipelined_grads(model, mbs)
    replay.configure(offload=True)
    try:
        replay.reset_stats()
        model.train()
        model.zero_grad(set_to_none=True)
        losses = [model(ids, pos, None, labels=labels).mean() for ids, pos, labels in mbs]
        stores = [s for s in replay._stores if len(s)]
        entries = [e for s in stores for e in s.queue]
        assert len(entries) == 2 * 4
        copies = [c for e in entries for c in e.copies]
        assert all(c.tensor is None and c.host.device.type == "cpu" for c in copies)
        for loss in losses:
            loss.backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    finally:
        replay.configure(offload=False)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    stats = replay.get_stats()
    assert stats["selections_offloaded"] == 8 and stats["selections_replayed"] == 8
    assert replay.pending_entries() == 0 and not replay._offloaded


def test_configure_rejects_bad_values():
    with pytest.raises(ValueError, match="offload"):
        replay.configure(offload="yes")

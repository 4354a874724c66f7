"""Megatron distributed checkpoints (`torch_dist`) cross between the stock and HyScale specs.

For DSA the counterpart is megatron-core's own `DSAttention` (`stock=True`); megatron-core has
no V4 (CSA) or QSA module, so there it is HyScale's baseline selection (`baseline=True`: score
table + torch.topk, selection again in the recompute). A tiny GPT trained a few steps with the
counterpart spec is saved (model + megatron optimizer + scheduler + RNG), loaded into the HyScale
spec, saved again and loaded back into the counterpart: every tensor survives bitwise, and one
more training step of each gives the loss and gradients of continuing the original (bitwise for
the copy of the same spec; fp32 rounding across specs, as in tests/layers/test_dsa_layer.py).

A checkpoint taken mid-run under full activation recompute holds no selection replay state
(`replay.assert_drained()` holds at save, and `Trainer.save` refuses a store with pending entries),
and resuming from it continues the run bitwise.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron_hyscale import replay
from megatron_hyscale.testing.training import (
    CHECKPOINT_WARNING_FILTERS,
    FULL_RECOMPUTE,
    KINDS,
    Trainer,
    batch_at,
    topk_ties_by_index,
)

pytestmark = pytest.mark.filterwarnings(*CHECKPOINT_WARNING_FILTERS)

# On the GPU the backward kernels (HyScale's Triton ones, which the V4 / QSA counterparts share)
# add key gradients with atomics, so two runs agree bitwise only in megatron's deterministic
# mode, the contract these bitwise checks hold HyScale to there; the CPU runs (CI) keep the
# default configuration, where the reference ops are deterministic anyway.
ON_GPU = torch.cuda.is_available()


def overrides(kind: str, **extra) -> dict:
    return {**FULL_RECOMPUTE, "deterministic_mode": ON_GPU, **extra}


def needs_transformers(kind: str) -> None:
    # the V4 and QSA tiny configs are built beside transformers' (testing.deepseek_v4 / qsa)
    if kind == "v4":
        pytest.importorskip("transformers.models.deepseek_v4")
    if kind == "qsa":
        pytest.importorskip("transformers.models.qwen4_exp")


@pytest.fixture(autouse=True)
def ties_by_index():
    with topk_ties_by_index():
        yield


def tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint carries: parameters, Adam moments and step counts."""
    names = {id(p): n for n, p in trainer.module.named_parameters()}
    out = {f"param.{n}": p.detach() for n, p in trainer.module.named_parameters()}
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for param, per_param in opt.optimizer.state.items():
            for key, value in per_param.items():
                out[f"optimizer.{names[id(param)]}.{key}"] = torch.as_tensor(value)
    return out


def assert_same_tensors(got: Trainer, expected: Trainer) -> None:
    a, b = tensors(got), tensors(expected)
    assert set(a) == set(b)
    assert any(k.endswith("exp_avg_sq") for k in a), "no optimizer state: nothing was tested"
    for name, value in b.items():
        assert torch.equal(a[name], value), name
    assert got.step == expected.step
    assert got.scheduler.get_lr(got.optimizer.param_groups[0]) == \
        expected.scheduler.get_lr(expected.optimizer.param_groups[0])


def shard_layout(sharded: dict) -> dict[str, tuple]:
    """key -> (global shape, offset, fragmentation) of every ShardedTensor; ShardedObjects too."""
    out: dict[str, tuple] = {}

    def walk(x) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        elif isinstance(x, ShardedTensor):
            out[x.key] = (tuple(x.global_shape), tuple(x.global_offset),
                          tuple(x.axis_fragmentations), x.dtype)
        elif isinstance(x, ShardedObject):
            out[x.key] = (tuple(x.global_shape), tuple(x.global_offset))

    walk(sharded)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_state_dict_layout_matches_the_counterpart(kind):
    """HyScale's modules keep the stock names and shapes: the checkpoint layouts are equal."""
    needs_transformers(kind)
    stock = Trainer(kind, stock=True, **overrides(kind))
    ours = Trainer(kind, stock=False, **overrides(kind))
    stock_sd = stock._sharded_state_dict(is_loading=False)
    ours_sd = ours._sharded_state_dict(is_loading=False)
    for part in ("model", "optimizer"):
        s, o = shard_layout(stock_sd[part]), shard_layout(ours_sd[part])
        assert sorted(o) == sorted(s), part
        assert o == s, part
    assert not [k for k in shard_layout(ours_sd) if "replay" in k.lower()]


@pytest.mark.parametrize("kind", KINDS)
def test_counterpart_to_hyscale_and_back(kind, tmp_path):
    needs_transformers(kind)
    stock = Trainer(kind, stock=True, **overrides(kind))
    for _ in range(2):
        stock.train_step()
    stock.save(str(tmp_path / "stock"))

    # other seeds: the loaded state, not the initialization, must make them equal
    ours = Trainer(kind, stock=False, seed=99, **overrides(kind))
    ours.load(str(tmp_path / "stock"))
    assert_same_tensors(ours, stock)
    ours.save(str(tmp_path / "hyscale"))
    back = Trainer(kind, stock=True, seed=77, **overrides(kind))
    back.load(str(tmp_path / "hyscale"))
    assert_same_tensors(back, stock)

    # one more step of each: the continuation of the original
    replay.reset_stats()
    expected = stock.train_step(keep_grads=True)
    got_back = back.train_step(keep_grads=True)
    stats = replay.get_stats()
    assert stats["selections_replayed"] == 0  # the counterparts select again in the recompute
    got = ours.train_step(keep_grads=True)
    n_selecting = 1 if kind == "v4" else 2  # V4's window-only layer selects nothing
    stats = replay.get_stats()
    assert stats["selections_replayed"] == n_selecting, stats  # HyScale replayed its own
    replay.assert_drained()

    assert torch.equal(got_back.loss, expected.loss)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-6)
    assert set(got.grads) == set(expected.grads) == set(got_back.grads)
    assert any(".indexer." in n for n in expected.grads), "indexer untrained: a weak test"
    for name, grad in expected.grads.items():
        assert torch.equal(got_back.grads[name], grad), name
        torch.testing.assert_close(got.grads[name], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # and the optimizer steps that followed agree too
    for (name, p), q in zip(stock.module.named_parameters(), ours.module.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_mid_run_checkpoint_under_recompute_holds_no_replay_state(kind, tmp_path):
    needs_transformers(kind)
    run = Trainer(kind, stock=False, hidden_dropout=0.1, **overrides(kind))
    replay.reset_stats()
    for _ in range(3):
        run.train_step()
        assert replay.pending_entries() == 0
    stats = replay.get_stats()
    assert stats["selections_replayed"] == stats["selections_computed"] > 0, stats
    replay.assert_drained()
    run.save(str(tmp_path / "mid"))

    # the RNGs are this process's: continue the original first, then resume (load sets them)
    expected = [run.train_step(keep_grads=True) for _ in range(2)]
    resumed = Trainer(kind, stock=False, seed=5, hidden_dropout=0.1, **overrides(kind))
    resumed.load(str(tmp_path / "mid"))
    for want in expected:
        got = resumed.train_step(keep_grads=True)
        assert torch.equal(got.loss, want.loss)
        assert set(got.grads) == set(want.grads)
        for name, grad in want.grads.items():
            assert torch.equal(got.grads[name], grad), name
    assert_same_tensors(resumed, run)
    replay.assert_drained()


def test_save_refuses_pending_replay_entries(tmp_path):
    """A forward under recompute without its backward leaves a recorded selection: a checkpoint
    taken then would silently drop it, so `save` raises; after `replay.clear()` it saves."""
    run = Trainer("dsa", stock=False, **FULL_RECOMPUTE)
    run.train_step()
    ids, pos, labels = batch_at("dsa", 0)
    run.model.train()
    run.model(ids, pos, None, labels=labels)  # no backward
    assert replay.pending_entries() == 2
    with pytest.raises(replay.ReplayError, match="never replayed"):
        run.save(str(tmp_path / "bad"))
    replay.clear()
    run.save(str(tmp_path / "good"))


def test_v4_mixed_layers_save_with_the_default_config(tmp_path):
    """Window, CSA and HCA layers carry different parameters: megatron stacks a tensor over the
    layers unless keys are per layer, and one only some layers have failed its validation
    ('Invalid access pattern'); DeepseekV4TransformerConfig asks for per-layer keys when its
    compress ratios mix kinds."""
    pytest.importorskip("transformers.models.deepseek_v4")
    run = Trainer("v4", stock=False)  # compress ratios [0, 4]: window layer + CSA layer
    assert run.module.config.hetereogenous_dist_checkpoint
    run.save(str(tmp_path / "v4"))


def _two_rank_body(directory: str, rank: int, result: dict) -> None:
    """Each of 2 data-parallel ranks (own batches): stock trains 2 steps and saves; HyScale
    loads, then both take one more step (DDP all-reduces the gradients over gloo)."""
    import contextlib

    from hyscale_bench.cpu import megatron_on_cpu
    from hyscale_bench.distributed import init_model_parallel
    from megatron_hyscale.testing.quiet import quiet_megatron
    from megatron_hyscale.testing.training import training_on_cpu

    cpu = megatron_on_cpu() if not torch.cuda.is_available() else contextlib.nullcontext()
    with quiet_megatron(), cpu, training_on_cpu(), topk_ties_by_index():
        init_model_parallel(1)
        stock = Trainer("dsa", stock=True, data_seed=rank, **FULL_RECOMPUTE)
        for _ in range(2):
            stock.train_step()
        stock.save(directory)
        ours = Trainer("dsa", stock=False, seed=99, data_seed=rank, **FULL_RECOMPUTE)
        ours.load(directory)
        assert_same_tensors(ours, stock)
        expected, got = stock.train_step(keep_grads=True), ours.train_step(keep_grads=True)
        # the ranks saw different batches, and DDP made their gradients one
        losses = [torch.zeros(()) for _ in range(2)]
        torch.distributed.all_gather(losses, got.loss)
        grad_sums = [torch.zeros(()) for _ in range(2)]
        torch.distributed.all_gather(grad_sums, sum(g.double().abs().sum() for g in
                                                    got.grads.values()).float())
        result.update(losses=losses, grad_sums=grad_sums,expected=expected, got=got,
                      params={n: p.detach().clone() for n, p in ours.module.named_parameters()},
                      stock_params={n: p.detach().clone()
                                    for n, p in stock.module.named_parameters()})


@pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < 2,
                    reason="two ranks on one GPU: gloo takes no CUDA all-gather and NCCL no "
                           "shared device; the CPU run (CI) covers the sharded layout")
def test_counterpart_to_hyscale_at_two_data_parallel_ranks(tmp_path):
    import functools

    from megatron_hyscale.testing.distributed import run_workers

    result = run_workers(functools.partial(_two_rank_body, str(tmp_path / "ckpt")), nprocs=2,
                         timeout_s=240)
    expected, got = result["expected"], result["got"]
    assert not torch.equal(result["losses"][0], result["losses"][1])
    assert torch.equal(result["grad_sums"][0], result["grad_sums"][1])
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-6)
    for name, grad in expected.grads.items():
        torch.testing.assert_close(got.grads[name], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for name, p in result["stock_params"].items():
        torch.testing.assert_close(result["params"][name], p, rtol=1e-5, atol=1e-7)

"""Context-parallel HyScale QSA: CP = 2 (two gloo processes) gives the same step as CP = 1.

Two processes are spawned once for the file. Each runs a tiny 2-layer QSA GPTModel at CP = 1
(both ranks computing the whole sequence), then re-initializes megatron with
context_parallel_size=2 and runs the same weights on its zigzag half (chunks r and 3 - r of 4,
as megatron's `get_batch_on_this_cp_rank`). T = 72: the 18-token chunks are not a multiple of
the block size, so blocks straddle the chunk borders and must be pooled over the gathered
sequence. Compared: LM loss and parameter gradients (averaged over CP, as megatron's DDP over
the dp x cp group does), logits (reassembled), replay counters, the optional indexer loss.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.distributed as dist

from hyscale_bench.distributed import init_model_parallel
from megatron_hyscale.parallel import zigzag_merge, zigzag_split
from megatron_hyscale.testing.distributed import run_workers, worker_result

WORLD = 2
VOCAB, T, B = 97, 72, 2
WORKER_TIMEOUT_S = 300
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SCENARIOS: dict[str, dict] = {
    "plain": {},
    "full-recompute": dict(FULL),
    "selective-recompute-indexer-loss": dict(recompute_granularity="selective",
                                             recompute_modules=["core_attn"],
                                             qsa_indexer_loss_coeff=0.5),
    "baseline-full-recompute": dict(FULL, baseline=True),
}


def _build(cp: int, overrides: dict):
    from megatron.core.models.gpt import GPTModel

    from megatron_hyscale.specs.qsa import get_qsa_block_spec
    from megatron_hyscale.testing.qsa import tiny_qsa_configs

    overrides = dict(overrides)
    baseline = overrides.pop("baseline", False)
    cfg, _ = tiny_qsa_configs(num_layers=2, context_parallel_size=cp,
                              cp_comm_type="allgather" if cp > 1 else None, **overrides)
    torch.manual_seed(7)
    return GPTModel(
        config=cfg, transformer_layer_spec=get_qsa_block_spec(cfg, baseline=baseline),
        vocab_size=VOCAB, max_sequence_length=T, position_embedding_type="rope",
        rotary_percent=0.5, rotary_base=10000, share_embeddings_and_output_weights=False,
    )


def _gather_seq(x: torch.Tensor, cp_group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp_group.size())]
    dist.all_gather(parts, x.contiguous(), group=cp_group)
    return zigzag_merge(parts, dim=dim)


def _run(model, cp_group) -> dict:
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    from megatron_hyscale import replay

    cp = cp_group.size() if cp_group is not None else 1
    rank = cp_group.rank() if cp_group is not None else 0
    g = torch.Generator().manual_seed(0)
    full = (torch.randint(0, VOCAB, (B, T), generator=g), torch.arange(T).expand(B, T),
            torch.randint(0, VOCAB, (B, T), generator=g))
    ids, pos, labels = (zigzag_split(t, cp, rank, dim=1) for t in full)
    model.train()
    model.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    replay.reset_stats()
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    replay.assert_drained()
    stats = replay.get_stats()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    idx_loss = values.clone() if values is not None else torch.zeros(2)
    DSAIndexerLossLoggingHelper.tracker.clear()
    with torch.no_grad():
        model.eval()
        logits = model(ids, pos, None)
    loss = loss.detach()
    if cp > 1:
        for t in (loss, idx_loss, *grads.values()):
            dist.all_reduce(t, group=cp_group, op=dist.ReduceOp.AVG)
        logits = _gather_seq(logits, cp_group, dim=1)
    return dict(loss=loss, logits=logits, grads=grads, stats=stats, indexer_loss=idx_loss)


def _body(rank: int, result: dict) -> None:
    from hyscale_bench.cpu import megatron_on_cpu

    with megatron_on_cpu():
        states = {}
        for cp in (1, WORLD):
            cp_group = init_model_parallel(cp)
            for name, overrides in SCENARIOS.items():
                model = _build(cp, overrides)
                if name in states:
                    model.load_state_dict(states[name], strict=True)
                else:
                    states[name] = copy.deepcopy(model.state_dict())
                try:
                    result[(name, cp)] = _run(model, cp_group)
                except Exception:
                    result[(name, cp)] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_workers(_body, WORLD, WORKER_TIMEOUT_S)


def _get(results: dict, name: str, cp: int) -> dict:
    return worker_result(results, (name, cp))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_cp2_matches_cp1(results, name):
    one, two = _get(results, name, 1), _get(results, name, WORLD)
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two["loss"], one["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two["indexer_loss"], one["indexer_loss"], rtol=1e-5, atol=1e-7)
    assert set(two["grads"]) == set(one["grads"])
    for n, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][n], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")
    has_indexer_grads = any(".indexer." in n for n in one["grads"])
    assert has_indexer_grads == ("indexer-loss" in name)
    if "indexer-loss" in name:
        assert float(one["indexer_loss"].abs().sum()) > 0
    # Counted over the training step (2 layers): each layer selects in its forward; the
    # recompute replays (HyScale) or selects again (baseline).
    stats = two["stats"]
    if name == "plain":
        assert (stats["selections_computed"], stats["selections_replayed"]) == (2, 0)
    elif name.startswith("baseline"):
        assert (stats["selections_computed"], stats["selections_replayed"]) == (4, 0)
    else:
        assert (stats["selections_computed"], stats["selections_replayed"]) == (2, 2)

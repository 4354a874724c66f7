"""Tensor x context parallelism: HyScale's DSA attention equals megatron-core's DSAttention at
TP = 2 + SP x CP = 2 (four gloo processes, fp32, CPU), on every rank, and runs its own path.

megatron's rank order puts TP innermost: ranks 0, 1 are the TP pair of CP rank 0, ranks 2, 3
that of CP rank 1. Each rank builds the stock and the HyScale absorbed-MLA attention (heads
split over TP, the indexer replicated) on the same weights and feeds its rows of one input as
megatron lays them out: the CP rank's zigzag chunks r and 3 - r of 4, then the TP rank's
contiguous sequence-parallel half of those. Per rank, output rows, the input gradient, every
parameter gradient and the logged indexer loss (value and reduction groups) must match, each
within a tolerance relative to its own scale, for the dense and the sparse indexer loss and
the per-token one (dense KL, summed over the rows), each without and with full recompute (the
attention under `tensor_parallel.checkpoint`, as megatron's full recompute runs a layer: the
recompute replays the selection). Stock megatron refuses TP > 1 without SP for the absorbed
layout, so SP is on throughout; the norms are built as torch's without SP
(`testing.sp_norms`), which changes nothing that the comparison sees.

No stock fallback may run on HyScale's side: a call of DSAttention.forward from a HyScale
layer (its fallback) is counted (`hyscale_bench.layer.FallbackCounter`), a HyScaleDSAttention
warning is recorded, and each step must have computed exactly one HyTopK selection (replayed
once under recompute).
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_hyscale.parallel import zigzag_split
from megatron_hyscale.testing.compare import assert_close_to_scale
from megatron_hyscale.testing.distributed import run_workers, worker_result

TP, CP = 2, 2
WORLD = TP * CP
T, B, HIDDEN = 96, 2, 64  # 48 rows per CP rank, 24 per rank after the SP split
WORKER_TIMEOUT_S = 300
LOSSES: dict[str, dict] = {
    "dense-loss": dict(dsa_indexer_use_sparse_loss=False),
    "sparse-loss": dict(dsa_indexer_use_sparse_loss=True),
    "per-token-loss": dict(calculate_per_token_loss=True),
}
SCENARIOS = [f"{loss}{suffix}" for loss in LOSSES for suffix in ("", "-full-recompute")]
# Sequence-local query rows (the core attention called with x's rows as its query, keys
# gathered over TP then CP; `testing.dsa_core.sequence_local_steps`): no indexer loss there.
NO_LOSS = dict(dsa_indexer_loss_coeff=0.0)
LOCAL_ROWS = {
    "absorbed": dict(fields=NO_LOSS),
    "absorbed-mask-recompute": dict(fields=NO_LOSS, mask=True, recompute=True),
    "value-layout": dict(fields=NO_LOSS, value=True),
    "indexer-loss-raises": dict(fields={}, raises=True),
}


def _group_ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _assert_same_across_cp(module: torch.nn.Module, cp_group: Any) -> None:
    """Every weight equal on the CP peers (a TP shard is seeded by the TP rank alone): the four
    ranks hold one model, or the comparison would pass on a model that is none."""
    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    peers = [torch.empty_like(flat) for _ in range(CP)]
    dist.all_gather(peers, flat, group=cp_group)
    assert all(torch.equal(p, flat) for p in peers), "weights differ over the CP group"


def _step(attn: torch.nn.Module, local: torch.Tensor, recompute: bool) -> dict:
    """One forward + backward of the attention on this rank's rows; what the test compares."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    from hyscale_bench.layer import FallbackCounter
    from megatron_hyscale import replay

    attn.train()
    attn.zero_grad(set_to_none=True)
    h = local.clone().requires_grad_()
    DSAIndexerLossLoggingHelper.tracker.clear()
    replay.reset_stats()
    call = lambda x: attn(x, None)[0]  # noqa: E731
    with warnings.catch_warnings(record=True) as caught, FallbackCounter() as fallbacks:
        warnings.simplefilter("always")
        out = tensor_parallel.checkpoint(call, False, h) if recompute else call(h)
        out.pow(2).mean().backward()
    replay.assert_drained()
    tracker = DSAIndexerLossLoggingHelper.tracker
    seen = dict(
        out=out.detach(), dh=h.grad,
        grads={n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None},
        indexer_loss=tracker["values"].clone(),
        loss_groups=(_group_ranks(tracker.get("reduce_group")),
                     _group_ranks(tracker.get("avg_group"))),
        warnings=[str(w.message) for w in caught if "HyScaleDSAttention" in str(w.message)],
        fallbacks=fallbacks.count, stats=replay.get_stats())
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    return seen


def _body(rank: int, result: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from hyscale_bench.cpu import megatron_on_cpu
    from hyscale_bench.models import tiny_dsa_config
    from megatron_hyscale.specs import get_dsa_layer_specs
    from megatron_hyscale.testing.dsa_core import sequence_local_steps
    from megatron_hyscale.testing.sp_norms import torch_norms_accept_sequence_parallel
    from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

    seen: dict = {}
    with megatron_on_cpu(), stock_topk_breaks_ties_by_index(), \
            torch_norms_accept_sequence_parallel():
        parallel_state.initialize_model_parallel(TP, 1, context_parallel_size=CP)
        model_parallel_cuda_manual_seed(1234)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        cp_group = parallel_state.get_context_parallel_group()
        full = torch.randn(T, B, HIDDEN, generator=torch.Generator().manual_seed(5))
        local = zigzag_split(full, CP, cp_group.rank(), dim=0).chunk(TP, dim=0)[tp_rank]
        for name in SCENARIOS:
            loss = name.removesuffix("-full-recompute")
            cfg = tiny_dsa_config(num_layers=1, tensor_model_parallel_size=TP,
                                  context_parallel_size=CP, cp_comm_type="allgather",
                                  sequence_parallel=True, dsa_indexer_topk=16, **LOSSES[loss])

            def build(stock: bool, cfg: Any = cfg) -> torch.nn.Module:
                spec = get_dsa_layer_specs(cfg, stock=stock)[0].submodules.self_attention
                torch.manual_seed(0)
                # A TransformerLayer passes the config's cp_comm_type on; built alone, the
                # attention would get "p2p", which DSA under CP refuses.
                return build_module(spec, config=cfg, layer_number=1,
                                    cp_comm_type=cfg.cp_comm_type)

            try:
                stock, hyscale = build(True), build(False)
                hyscale.load_state_dict(stock.state_dict(), strict=True)
                _assert_same_across_cp(stock, cp_group)
                recompute = name != loss
                seen[name] = {label: _step(attn, local, recompute)
                              for label, attn in (("stock", stock), ("hyscale", hyscale))}
            except Exception:
                # Kept with its scenario (every rank fails alike: the collectives are
                # symmetric), so that the other scenarios still run.
                seen[name] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
        # This rank's rows: its CP rank's zigzag chunks, then its TP rank's half of those.
        rows = zigzag_split(torch.arange(T), CP, cp_group.rank(), dim=0).chunk(TP)[tp_rank]
        for name, case in LOCAL_ROWS.items():
            cfg = tiny_dsa_config(num_layers=1, tensor_model_parallel_size=TP,
                                  context_parallel_size=CP, cp_comm_type="allgather",
                                  sequence_parallel=True, dsa_indexer_topk=16, **case["fields"])
            try:
                seen[("local-rows", name)] = sequence_local_steps(
                    cfg, case, rows=rows, seq_len=T, rank_seed=100 + tp_rank)
            except Exception:
                seen[("local-rows", name)] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    everyone = [None] * WORLD if rank == 0 else None
    dist.gather_object(seen, everyone, dst=0)
    if rank == 0:
        result.update({(name, r): got[name] for r, got in enumerate(everyone) for name in got})


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_workers(_body, WORLD, WORKER_TIMEOUT_S)


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tp2_sp_cp2_matches_stock_on_its_own_path(runs, scenario, rank):
    got = worker_result(runs, (scenario, rank))
    stock, hyscale = got["stock"], got["hyscale"]
    assert hyscale["fallbacks"] == 0, f"{hyscale['fallbacks']} stock fallback forward(s)"
    assert hyscale["warnings"] == []
    replayed = 1 if scenario.endswith("-full-recompute") else 0
    stats = hyscale["stats"]
    assert (stats["selections_computed"], stats["selections_replayed"]) == (1, replayed), stats
    assert stock["out"].shape == (T // WORLD, B, HIDDEN)
    assert_close_to_scale(hyscale["out"], stock["out"], "output", 1e-5)
    assert_close_to_scale(hyscale["dh"], stock["dh"], "input gradient", 1e-5)
    # Stock logs the per-rank loss with the CP group to average (per-token: to sum) it over.
    cp_peers = [rank % TP + TP * c for c in range(CP)]
    want_groups = (cp_peers, None) if "per-token" in scenario else (None, cp_peers)
    assert stock["loss_groups"] == want_groups
    assert hyscale["loss_groups"] == want_groups
    assert stock["indexer_loss"].abs().sum() > 0, "the indexer loss never ran"
    # The KL is a small difference of near-equal terms: the sparse loss's value, summed in
    # another order than stock's table, differs by ~1e-4 relative (as without TP or CP), while
    # its gradients agree far closer.
    assert_close_to_scale(hyscale["indexer_loss"], stock["indexer_loss"], "indexer loss", 5e-4)
    assert set(hyscale["grads"]) == set(stock["grads"])
    assert any(".indexer." in n for n in stock["grads"]), "no indexer gradient"
    for name, want in stock["grads"].items():
        # The indexer's gradients come from that KL alone: looser than the main path's.
        assert_close_to_scale(hyscale["grads"][name], want, name,
                              1e-4 if ".indexer." in name else 1e-5)


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("case", list(LOCAL_ROWS))
def test_sequence_local_query_rows_under_cp_match_stock_on_its_own_path(runs, case, rank):
    from megatron_hyscale.testing.dsa_core import assert_sequence_local_steps_match

    assert_sequence_local_steps_match(worker_result(runs, (("local-rows", case), rank)),
                                      LOCAL_ROWS[case])

"""Tensor parallelism with sequence parallelism: HyScale's DSA attention equals megatron-core's
DSAttention at TP = 2 + SP (two gloo processes, fp32, CPU), and runs its own path.

Both ranks build the stock and the HyScale absorbed-MLA attention (heads split over TP, the
indexer replicated: it gathers the sequence-parallel rows itself, and the indexer loss's
target is summed over the TP group); each rank feeds its sequence-parallel half of one input.
Output rows, the input gradient and every parameter gradient (per rank) must match, dense and
sparse loss, with full recompute. megatron's torch norms refuse sequence parallelism (TE's
mark their weights for the TP gradient all-reduce); the norms here are built as torch's
(`testing.sp_norms`), which changes nothing that the comparison sees.

Sequence-local query rows (stock's `sequence_parallel_query_is_local`: the core attention
called with x's local rows as its query; key and value local or gathered, gathered over TP by
the layer): per rank, output and every gradient equal stock's without the indexer loss
(absorbed and per-head value layouts, an explicit mask, packed documents, recompute, eval),
no stock forward runs on HyScale's side, and with the loss both raise stock's RuntimeError.
So do the TP-gathered query rows with a key of local rows, indexer loss included.
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_hyscale.testing.compare import assert_close_to_scale
from megatron_hyscale.testing.distributed import run_workers, worker_result

WORLD = 2
T, HIDDEN = 96, 64
WORKER_TIMEOUT_S = 300
SCENARIOS = {"dense-loss": dict(dsa_indexer_use_sparse_loss=False),
             "sparse-loss-recompute": dict(dsa_indexer_use_sparse_loss=True)}
# Sequence-local query rows, the core attention called directly (see the module doc).
NO_LOSS = dict(dsa_indexer_loss_coeff=0.0)
LOCAL_ROWS = {
    "absorbed": dict(fields=NO_LOSS),
    "absorbed-recompute": dict(fields=NO_LOSS, recompute=True),
    "absorbed-eval": dict(fields={}, train=False),  # the loss's coefficient set, not training
    "absorbed-key-gathered": dict(fields=NO_LOSS, key_gathered=True),
    "absorbed-mask": dict(fields=NO_LOSS, mask=True),
    # Packed THD documents (one crossing the ranks' boundary at row 48) over the whole rows.
    "absorbed-packed": dict(fields=NO_LOSS, documents=(30, 40, 26)),
    "value-layout-recompute": dict(fields=NO_LOSS, value=True, recompute=True),
    "indexer-loss-raises": dict(fields={}, raises=True),
    # The query's rows all there (MLA's layout), the key's local: stock gathers it; with loss.
    "full-query-local-key-loss": dict(fields={}, loss=True, full_query=True),
}


def _body(rank: int, result: dict) -> None:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )
    from megatron.core.transformer.spec_utils import build_module

    from hyscale_bench.cpu import megatron_on_cpu
    from hyscale_bench.models import tiny_dsa_config
    from megatron_hyscale import replay
    from megatron_hyscale.specs import get_dsa_layer_specs
    from megatron_hyscale.testing.sp_norms import torch_norms_accept_sequence_parallel
    from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

    with megatron_on_cpu(), stock_topk_breaks_ties_by_index(), \
            torch_norms_accept_sequence_parallel():
        parallel_state.initialize_model_parallel(WORLD, 1)
        model_parallel_cuda_manual_seed(1234)
        for name, fields in SCENARIOS.items():
            cfg = tiny_dsa_config(num_layers=1, tensor_model_parallel_size=WORLD,
                                  sequence_parallel=True, dsa_indexer_topk=16, **fields)

            def build(stock, cfg=cfg):
                spec = get_dsa_layer_specs(cfg, stock=stock)[0].submodules.self_attention
                torch.manual_seed(0)
                return build_module(spec, config=cfg, layer_number=1)

            stock, hyscale = build(True), build(False)
            hyscale.load_state_dict(stock.state_dict(), strict=True)
            g = torch.Generator().manual_seed(5)
            full = torch.randn(T, 1, HIDDEN, generator=g)
            local = full[rank * T // WORLD:(rank + 1) * T // WORLD]
            recompute = "recompute" in name
            seen = {}
            for label, attn in (("stock", stock), ("hyscale", hyscale)):
                attn.train()
                h = local.clone().requires_grad_()
                DSAIndexerLossLoggingHelper.tracker.clear()
                replay.reset_stats()
                call = lambda x, a=attn: a(x, None)[0]  # noqa: E731
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = (tensor_parallel.checkpoint(call, False, h) if recompute
                           else call(h))
                    out.pow(2).mean().backward()
                seen[label] = dict(
                    out=out.detach(), dh=h.grad,
                    grads={n: p.grad.clone() for n, p in attn.named_parameters()
                           if p.grad is not None},
                    fallback=[str(w.message) for w in caught
                              if "HyScaleDSAttention" in str(w.message)],
                    stats=replay.get_stats())
                DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
                replay.clear()
            result[name] = seen
        local_rows = {}
        for name, case in LOCAL_ROWS.items():
            try:
                local_rows[name] = _local_rows_case(rank, case)
            except Exception:
                # Kept with its case (both ranks fail alike: the collectives are symmetric).
                local_rows[name] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
        everyone = [None] * WORLD if rank == 0 else None
        dist.gather_object(local_rows, everyone, dst=0)
        if rank == 0:
            result.update({("local-rows", name, r): got[name] for r, got in enumerate(everyone)
                           for name in LOCAL_ROWS})


def _local_rows_case(rank: int, case: dict) -> dict:
    """One case of sequence-local query rows on this rank (`testing.dsa_core`)."""
    from hyscale_bench.models import tiny_dsa_config
    from megatron_hyscale.testing.dsa_core import sequence_local_steps

    cfg = tiny_dsa_config(num_layers=1, tensor_model_parallel_size=WORLD,
                          sequence_parallel=True, dsa_indexer_topk=16, **case["fields"])
    rows = torch.arange(rank * T // WORLD, (rank + 1) * T // WORLD)
    every = torch.arange(T)
    return sequence_local_steps(cfg, case, rows=rows, seq_len=T, rank_seed=100 + rank,
                                key_rows=every if case.get("key_gathered") else None,
                                query_rows=every if case.get("full_query") else None)


@pytest.fixture(scope="module")
def runs():
    return run_workers(_body, WORLD, WORKER_TIMEOUT_S)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tp2_sp_matches_stock_on_its_own_path(runs, scenario):
    stock, hyscale = runs[scenario]["stock"], runs[scenario]["hyscale"]
    assert hyscale["fallback"] == [], hyscale["fallback"]
    assert hyscale["stats"]["selections_computed"] == 1
    assert_close_to_scale(hyscale["out"], stock["out"], "output", 1e-5)
    assert_close_to_scale(hyscale["dh"], stock["dh"], "input gradient", 1e-5)
    assert set(hyscale["grads"]) == set(stock["grads"])
    assert any(".indexer." in n for n in stock["grads"]), "the indexer loss never ran"
    for name, want in stock["grads"].items():
        # The indexer's gradients come from the KL alone: looser than the main path's.
        assert_close_to_scale(hyscale["grads"][name], want, name,
                              1e-4 if ".indexer." in name else 1e-5)


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("case", list(LOCAL_ROWS))
def test_sequence_local_query_rows_match_stock_on_its_own_path(runs, case, rank):
    from megatron_hyscale.testing.dsa_core import assert_sequence_local_steps_match

    assert_sequence_local_steps_match(worker_result(runs, ("local-rows", case, rank)),
                                      LOCAL_ROWS[case])

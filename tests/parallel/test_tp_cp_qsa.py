"""Tensor x context parallelism for HyScale's QSA attention: TP = 2 x CP = 2, with and without
sequence parallelism, gives the step of TP = 1 x CP = 1 on the same weights (four gloo
processes, fp32, CPU).

Rank 0 runs the `HyScaleQSASelfAttention` at TP 1 x CP 1 on the whole input (the reference,
sent to every rank); then megatron is re-initialized with TP 2 and CP 2 and each rank runs the
same weights split over its TP group (one KV group's heads and the matching `linear_proj`
columns a rank, the indexer replicated) on its CP rank's rows: zigzag chunks r and 3 - r of 4
(megatron's `get_batch_on_this_cp_rank`), or for packed THD documents each document's chunks
(`parallel.thd_split`); under SP each TP rank holds half of those rows (megatron's
sequence-parallel layout of the CP rank's rows). T = 88: the 22-row zigzag chunks are not a
multiple of the block size, so blocks straddle the chunk borders. Packed documents of 12, 52
and 32 rows: the first has fewer blocks than the budget, and under SP the TP border (row 24 of
the CP rank's 48) cuts the second. Every step runs under full recompute (the selection
replayed) with the indexer loss on: dense and sparse, a mean over the rows or per-token, and a
real_token_mask_q (the CP rank's rows of it, which under SP are the rows the query has,
gathered over TP) leaving each document's later rows out of the loss.

Compared per rank with TP 1 x CP 1: the output and the input gradient at the rank's rows; the
parameter gradients after megatron's TP gradient reduction (`testing.tensor_parallel.
reduce_tp_grads`) and summed over CP (the step's loss is a sum over rows): a TP-sharded
parameter's against the matching slice of TP 1's, a replicated one (the q/k norms, the
indexer) against the whole. A mean indexer loss is each CP rank's mean over its own rows (as
stock DSA's), as many on each, so the indexer's gradients summed over CP are CP times TP 1's;
the logged loss, reduced the way megatron reduces it for logging
(`DSAIndexerLossLoggingHelper.reduce_loss_in_tracker`: averaged, or summed when per-token,
over CP), equals TP 1's. Before the TP reduction the indexer's gradients must be equal on the
two TP ranks of a CP rank (each computes the whole replicated indexer). HyScale's own path must
run: no HyScale warning, the selection computed once and replayed once, the indexer on all of
the CP rank's rows.

megatron's torch norms refuse sequence parallelism; the norms here are built as torch's and
their weights marked `sequence_parallel` as Transformer Engine's norms mark them, so the
gradient reduction sees the marks of a real SP run.
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from megatron_hyscale.parallel import thd_split, zigzag_split
from megatron_hyscale.testing.compare import assert_close_to_scale
from megatron_hyscale.testing.distributed import run_workers, worker_ranks
from megatron_hyscale.testing.packed import cu_seqlens, prefix_mask, thd_params
from megatron_hyscale.testing.tensor_parallel import load_tp_shards, reduce_tp_grads, tp_shards

TP, CP = 2, 2
WORLD = TP * CP
B, T, H = 2, 88, 64  # 22 blocks of 4; the budget (8 blocks) binds for the later rows
WORKER_TIMEOUT_S = 300
DOCUMENTS = (12, 52, 32)  # batch 1; each a multiple of 2 * CP (megatron's THD split)
VALID = (10, 30, 9)  # the masked case's rows in the loss: cuts chunks on both CP ranks
CASES: dict[str, dict] = {
    "dense-loss": dict(sparse=False),
    "sparse-loss-per-token": dict(sparse=True, per_token=True),
    "packed-sparse-loss": dict(sparse=True, documents=DOCUMENTS),
    "packed-dense-loss-per-token": dict(sparse=False, per_token=True, documents=DOCUMENTS),
    "packed-masked-sparse-loss-per-token": dict(sparse=True, per_token=True,
                                                documents=DOCUMENTS, valid=VALID),
}
LAYOUTS = {"tp2-cp2": False, "tp2-cp2-sp": True}


def _build(tp: int, cp: int, sp: bool, spec: dict):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hyscale.specs.qsa import get_qsa_attention_spec
    from megatron_hyscale.testing.qsa import tiny_qsa_configs

    cfg, hcfg = tiny_qsa_configs(tensor_model_parallel_size=tp, sequence_parallel=sp,
                                 context_parallel_size=cp,
                                 cp_comm_type="allgather" if cp > 1 else None,
                                 qsa_indexer_loss_coeff=0.5,
                                 qsa_indexer_use_sparse_loss=spec["sparse"],
                                 calculate_per_token_loss=spec.get("per_token", False))
    layer = build_module(get_qsa_attention_spec(cfg), config=cfg, layer_number=1,
                         cp_comm_type=cfg.cp_comm_type)
    return layer, cfg, hcfg


def _weights(layer) -> dict[str, torch.Tensor]:
    """Deterministic TP-1 weights (norm weights around 1, as trained ones)."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, p in sorted(layer.named_parameters()):
        w = torch.randn(p.shape, generator=g)
        out[name] = 1 + 0.3 * w if "layernorm" in name else 0.2 * w
    return out


def _rope(hcfg, documents: tuple[int, ...] | None, cp_group) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    params = hcfg.rope_parameters
    rope = RotaryEmbedding(kv_channels=hcfg.head_dim,
                           rotary_percent=params["partial_rotary_factor"],
                           rotary_base=params["rope_theta"], use_cpu_initialization=True,
                           cp_group=cp_group)
    # As megatron's GPTModel: packed, the positions within a document (the layer splits them
    # per document under CP); else the CP rank's zigzag rows of the whole sequence's table
    # (under SP too: the query rows are gathered over TP).
    if documents is not None:
        return rope(max(documents), packed_seq=True)
    return rope(T)


def _rows(documents: tuple[int, ...] | None) -> tuple[slice, slice]:
    """The case's part of the inputs: packed documents are one sequence (batch 1)."""
    if documents is None:
        return slice(0, T), slice(None)
    return slice(0, sum(documents)), slice(0, 1)


def _cp_rows(t: torch.Tensor, documents: tuple[int, ...] | None, cp_rank: int) -> torch.Tensor:
    """The CP rank's rows of a whole sequence [T, ...] (megatron's data loader's split)."""
    if documents is None:
        return zigzag_split(t, CP, cp_rank, dim=0)
    return thd_split(t, cu_seqlens(documents), CP, cp_rank, dim=0)


def _rank_rows(t: torch.Tensor, documents: tuple[int, ...] | None, cp_rank: int, tp_rank: int,
               sp: bool) -> torch.Tensor:
    """The rows of a whole sequence a TP x CP rank holds: the CP rank's, their TP rank's
    contiguous part under SP."""
    t = _cp_rows(t, documents, cp_rank)
    return t.chunk(TP, dim=0)[tp_rank] if sp else t


def _packed_params(spec: dict, cp_rank: int | None):
    """The case's PackedSeqParams (None: unpacked), with the CP rank's rows of the mask (the
    whole mask at cp_rank None)."""
    documents = spec.get("documents")
    if documents is None:
        return None
    params = thd_params(documents)
    if "valid" in spec:
        mask = prefix_mask(spec["valid"], documents)
        params.real_token_mask_q = mask if cp_rank is None else _cp_rows(mask, documents, cp_rank)
    return params


def _step(layer, cfg, freqs: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, packed,
          groups: tuple | None) -> dict:
    """One training step under full recompute: forward, backward of sum(out * dy), then at
    TP x CP (`groups` = (tp, cp)) megatron's TP gradient reduction, the gradients summed over
    CP and the logged indexer loss reduced; what the comparison reads."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    from megatron_hyscale import replay

    layer.train()
    layer.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    replay.reset_stats()
    indexer_rows = []
    hook = layer.core_attention.indexer.register_forward_pre_hook(
        lambda _m, args: indexer_rows.append(args[0].shape[0]))
    h = x.clone().requires_grad_()
    call = lambda t: layer(t, None, rotary_pos_emb=freqs, packed_seq_params=packed)[0]  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tensor_parallel.checkpoint(call, False, h)
        out.backward(dy)
    hook.remove()
    replay.assert_drained()
    raw = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    if groups is not None:
        tp_group, cp_group = groups
        reduce_tp_grads(layer, cfg, tp_group)
        for p in layer.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp_group)
        DSAIndexerLossLoggingHelper.reduce_loss_in_tracker()
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    DSAIndexerLossLoggingHelper.tracker.clear()
    return dict(
        out=out.detach(), dx=h.grad, raw=raw,
        grads={n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None},
        sharded={n: getattr(p, "tensor_model_parallel", False)
                 for n, p in layer.named_parameters()},
        indexer_loss=values.clone() if values is not None else None,
        indexer_rows=indexer_rows, stats=replay.get_stats(),
        warnings=[str(w.message) for w in caught if "HyScale" in str(w.message)])


def _expected(ref: dict, layer, spec: dict, cp_rank: int, tp_rank: int, sp: bool) -> dict:
    """TP 1 x CP 1's step as this rank should see it: its rows, its parameter slices, the
    indexer's gradients CP times for a mean loss (the module doc)."""
    documents = spec.get("documents")
    times = 1 if spec.get("per_token") else CP
    grads = {n: g * times if ".indexer." in n else g for n, g in ref["grads"].items()}
    return dict(out=_rank_rows(ref["out"], documents, cp_rank, tp_rank, sp),
                dx=_rank_rows(ref["dx"], documents, cp_rank, tp_rank, sp),
                grads=tp_shards(layer, grads, TP, tp_rank), indexer_loss=ref["indexer_loss"],
                indexer_rows=_cp_rows(ref["out"], documents, cp_rank).shape[0])


def _body(rank: int, result: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hyscale_bench.cpu import megatron_on_cpu
    from megatron_hyscale.testing.sp_norms import torch_norms_accept_sequence_parallel

    g = torch.Generator().manual_seed(5)
    rows = max(T, sum(DOCUMENTS))
    x, dy = torch.randn(rows, B, H, generator=g), torch.randn(rows, B, H, generator=g)
    with megatron_on_cpu(), torch_norms_accept_sequence_parallel():
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
        refs, weights = {}, {}
        for case, spec in CASES.items():
            layer, cfg, hcfg = _build(1, 1, False, spec)
            weights[case] = _weights(layer)
            if rank != 0:  # one reference is enough: the others wait at the broadcast
                continue
            load_tp_shards(layer, weights[case], 1, 0)
            documents = spec.get("documents")
            rows = _rows(documents)
            refs[case] = _step(layer, cfg, _rope(hcfg, documents, None), x[rows], dy[rows],
                               _packed_params(spec, None), None)
        sent = [refs]
        dist.broadcast_object_list(sent, src=0)
        refs = sent[0]
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(TP, 1, context_parallel_size=CP)
        model_parallel_cuda_manual_seed(1234)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        cp_group = parallel_state.get_context_parallel_group()
        tp_rank, cp_rank = tp_group.rank(), cp_group.rank()
        for (layout, sp), (case, spec) in (
                (a, b) for a in LAYOUTS.items() for b in CASES.items()):
            try:
                layer, cfg, hcfg = _build(TP, CP, sp, spec)
                load_tp_shards(layer, weights[case], TP, tp_rank)
                documents = spec.get("documents")
                rows = _rows(documents)
                got = _step(layer, cfg, _rope(hcfg, documents, cp_group),
                            _rank_rows(x[rows], documents, cp_rank, tp_rank, sp),
                            _rank_rows(dy[rows], documents, cp_rank, tp_rank, sp),
                            _packed_params(spec, cp_rank), (tp_group, cp_group))
                got["want"] = _expected(refs[case], layer, spec, cp_rank, tp_rank, sp)
                got["coords"] = (tp_rank, cp_rank)
            except Exception:
                got = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
            every = [None] * WORLD
            dist.all_gather_object(every, got)
            result[(layout, case)] = {"ranks": every}
        result["refs"] = refs


@pytest.fixture(scope="module")
def results() -> dict:
    return run_workers(_body, WORLD, WORKER_TIMEOUT_S)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp2_cp2_matches_tp1_cp1(results, layout, case):
    ranks = worker_ranks(results, (layout, case))
    ref = results["refs"][case]
    assert float(ref["indexer_loss"].abs().sum()) > 0, "the indexer loss never ran"
    assert any(".indexer." in n for n in ref["grads"]), "the indexer got no gradient"
    assert sorted(got["coords"] for got in ranks) == [(t, c) for t in range(TP)
                                                      for c in range(CP)]
    for got in ranks:
        want, where = got["want"], "tp {} cp {}".format(*got["coords"])
        # HyScale's own path ran: no warning, the selection computed once and replayed by the
        # recompute, the indexer on every row of the CP rank (gathered over TP under SP).
        assert got["warnings"] == [], got["warnings"]
        assert (got["stats"]["selections_computed"], got["stats"]["selections_replayed"]) \
            == (1, 1), got["stats"]
        assert got["indexer_rows"] == [want["indexer_rows"]] * 2, got["indexer_rows"]
        torch.testing.assert_close(got["out"], want["out"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, w=where: f"{w} output: {m}")
        assert_close_to_scale(got["dx"], want["dx"], f"{where} input gradient", 1e-5)
        torch.testing.assert_close(got["indexer_loss"], want["indexer_loss"], rtol=1e-5,
                                   atol=1e-7, msg=lambda m, w=where: f"{w} indexer loss: {m}")
        assert set(got["grads"]) == set(want["grads"])
        for name, grad in want["grads"].items():
            assert_close_to_scale(got["grads"][name], grad, f"{where} {name}", 1e-5)
    # The replicated indexer is computed whole on each TP rank of a CP rank: equal raw
    # gradients on both.
    indexer = [n for n in ranks[0]["raw"] if ".indexer." in n]
    assert indexer
    by_cp = {}
    for got in ranks:
        by_cp.setdefault(got["coords"][1], []).append(got["raw"])
    for first, second in by_cp.values():
        for name in indexer:
            torch.testing.assert_close(second[name], first[name], rtol=0, atol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
    # Megatron's marks: the heads' projections are split, nothing of the indexer is.
    assert ranks[0]["sharded"]["linear_qkv.weight"] and ranks[0]["sharded"]["linear_proj.weight"]
    assert not any(ranks[0]["sharded"][n] for n in indexer)

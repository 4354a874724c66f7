"""Tensor parallelism for HyScale's QSA attention: TP = 2, with and without sequence parallelism,
gives the step of TP = 1 on the same weights (two gloo processes, fp32, CPU).

Each rank first runs the `HyScaleQSASelfAttention` at TP 1 (megatron initialized with TP 1:
both ranks compute the whole layer), then re-initializes megatron with TP 2 and runs the same
weights split over the two ranks (the query / gate / key / value heads of one KV group and the
matching `linear_proj` columns per rank; the indexer replicated). Without SP each rank feeds
the whole input; with SP its half of the rows (megatron's sequence-parallel layout: the
column-parallel `linear_qkv` gathers the rows, the row-parallel `linear_proj` reduce-scatters,
the indexer gathers them itself). Every step runs under full recompute (the selection is
replayed) with the indexer loss on, dense and sparse, so the indexer's gradient path and its
target summed over the TP group's heads are checked.

Compared with TP 1: the output and input gradient (the rank's rows under SP); the parameter
gradients after megatron's TP gradient reduction (`finalize_model_grads`'
`_allreduce_non_tensor_model_parallel_grads`, which the DDP training step runs): a TP-sharded
parameter's gradient against the matching slice of TP 1's, a replicated one (the main q/k
norms, whose per-rank gradients are partial sums over the rank's heads and which megatron sums
over TP; the indexer's weights, whose per-rank gradients are already whole and which it
averages) against the whole of TP 1's. The raw indexer gradients must also be equal on both
ranks before that reduction (each rank computes the whole replicated indexer). The indexer
loss logged must equal TP 1's.

megatron's torch norms refuse sequence parallelism; the norms here are built as torch's and
their weights marked `sequence_parallel` as Transformer Engine's norms mark them, so the
gradient reduction sees the marks of a real SP run.
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from megatron_hyscale.testing.distributed import run_workers, worker_ranks
from megatron_hyscale.testing.tensor_parallel import load_tp_shards, reduce_tp_grads, tp_shards

WORLD = 2
B, T = 2, 96  # 24 blocks of 4; the budget (8 blocks) binds for the later rows
WORKER_TIMEOUT_S = 300
# Packed documents (batch 1): under SP the rank border (row 48) cuts the second one.
DOCUMENTS = (40, 30, 26)
CASES = {"dense-loss": dict(sparse=False), "sparse-loss": dict(sparse=True),
         "packed-sparse-loss": dict(sparse=True, documents=DOCUMENTS)}
LAYOUTS = {"tp2": False, "tp2-sp": True}


def _build(tp: int, sp: bool, sparse: bool):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hyscale.specs.qsa import get_qsa_attention_spec
    from megatron_hyscale.testing.qsa import tiny_qsa_configs

    cfg, hcfg = tiny_qsa_configs(tensor_model_parallel_size=tp, sequence_parallel=sp,
                                 qsa_indexer_loss_coeff=0.5,
                                 qsa_indexer_use_sparse_loss=sparse)
    return build_module(get_qsa_attention_spec(cfg), config=cfg, layer_number=1), cfg, hcfg


def _weights(layer) -> dict[str, torch.Tensor]:
    """Deterministic TP-1 weights (norm weights around 1, as trained ones)."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, p in sorted(layer.named_parameters()):
        w = torch.randn(p.shape, generator=g)
        out[name] = 1 + 0.3 * w if "layernorm" in name else 0.2 * w
    return out


def _rope(hcfg) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    params = hcfg.rope_parameters
    # Every row's frequencies: under SP megatron's GPTModel also hands the attention the
    # whole sequence's table (the query rows are gathered).
    return RotaryEmbedding(kv_channels=hcfg.head_dim,
                           rotary_percent=params["partial_rotary_factor"],
                           rotary_base=params["rope_theta"], use_cpu_initialization=True)(T)


def _packed_params(documents: tuple[int, ...] | None):
    """megatron's PackedSeqParams of back-to-back documents (None: one unpacked batch)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if documents is None:
        return None
    cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(documents), max_seqlen_kv=max(documents))


def _step(layer, cfg, hcfg, x: torch.Tensor, dy: torch.Tensor, tp_group,
          documents: tuple[int, ...] | None) -> dict:
    """One training step under full recompute: forward, backward of sum(out * dy), megatron's
    TP gradient reduction; what the comparison reads."""
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
    freqs, packed = _rope(hcfg), _packed_params(documents)
    h = x.clone().requires_grad_()
    call = lambda t: layer(t, None, rotary_pos_emb=freqs, packed_seq_params=packed)[0]  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tensor_parallel.checkpoint(call, False, h)
        out.backward(dy)
    hook.remove()
    replay.assert_drained()
    raw = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    if tp_group is not None:
        reduce_tp_grads(layer, cfg, tp_group)
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


def _expected(ref: dict, layer, rank: int, rows: slice) -> dict:
    """TP 1's step as this TP-2 rank should see it: its rows, its parameter slices."""
    return dict(out=ref["out"][rows], dx=ref["dx"][rows],
                grads=tp_shards(layer, ref["grads"], WORLD, rank),
                indexer_loss=ref["indexer_loss"])


def _body(rank: int, result: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hyscale_bench.cpu import megatron_on_cpu
    from megatron_hyscale.testing.sp_norms import torch_norms_accept_sequence_parallel

    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(T, B, 64, generator=g), torch.randn(T, B, 64, generator=g)
    with megatron_on_cpu(), torch_norms_accept_sequence_parallel():
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
        refs, weights = {}, {}
        for case, spec in CASES.items():
            layer, cfg, hcfg = _build(1, False, spec["sparse"])
            weights[case] = _weights(layer)
            load_tp_shards(layer, weights[case], 1, 0)
            documents = spec.get("documents")
            batch = slice(0, 1) if documents else slice(None)
            refs[case] = _step(layer, cfg, hcfg, x[:, batch], dy[:, batch], None, documents)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(WORLD, 1)
        model_parallel_cuda_manual_seed(1234)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for (layout, sp), (case, spec) in (
                (a, b) for a in LAYOUTS.items() for b in CASES.items()):
            try:
                layer, cfg, hcfg = _build(WORLD, sp, spec["sparse"])
                load_tp_shards(layer, weights[case], WORLD, rank)
                documents = spec.get("documents")
                batch = slice(0, 1) if documents else slice(None)
                rows = slice(rank * T // WORLD, (rank + 1) * T // WORLD) if sp else slice(None)
                got = _step(layer, cfg, hcfg, x[rows, batch], dy[rows, batch], tp_group,
                            documents)
                got["want"] = _expected(refs[case], layer, rank, rows)
            except Exception:
                got = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
            both = [None] * WORLD
            dist.all_gather_object(both, got)
            result[(layout, case)] = {"ranks": both}
        result["refs"] = refs


@pytest.fixture(scope="module")
def results() -> dict:
    return run_workers(_body, WORLD, WORKER_TIMEOUT_S)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp2_matches_tp1(results, layout, case):
    ranks = worker_ranks(results, (layout, case))
    ref = results["refs"][case]
    assert float(ref["indexer_loss"].abs().sum()) > 0, "the indexer loss never ran"
    assert any(".indexer." in n for n in ref["grads"]), "the indexer got no gradient"
    for rank, got in enumerate(ranks):
        want = got["want"]
        # HyScale's own path ran: no warning, the selection computed once and replayed by the
        # recompute, the indexer on every row of the sequence (gathered under SP).
        assert got["warnings"] == [], got["warnings"]
        assert (got["stats"]["selections_computed"], got["stats"]["selections_replayed"]) \
            == (1, 1), got["stats"]
        assert got["indexer_rows"] == [T, T], got["indexer_rows"]
        torch.testing.assert_close(got["out"], want["out"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["dx"], want["dx"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got["indexer_loss"], want["indexer_loss"], rtol=1e-5,
                                   atol=1e-7)
        assert set(got["grads"]) == set(want["grads"])
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
    # The replicated indexer is computed whole on each rank: equal raw gradients on both.
    indexer = [n for n in ranks[0]["raw"] if ".indexer." in n]
    assert indexer
    for name in indexer:
        torch.testing.assert_close(ranks[1]["raw"][name], ranks[0]["raw"][name], rtol=0, atol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # Megatron's marks: the heads' projections are split, nothing of the indexer is.
    assert ranks[0]["sharded"]["linear_qkv.weight"] and ranks[0]["sharded"]["linear_proj.weight"]
    assert not any(ranks[0]["sharded"][n] for n in indexer)

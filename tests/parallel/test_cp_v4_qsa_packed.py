"""Packed THD sequences under context parallelism: HyScale's V4 (window, CSA, HCA) and QSA
layers at CP = 2 (two gloo processes) give the CP = 1 run of the same layer.

Under CP each rank holds chunks r and 3 - r of every document (megatron's THD split,
`parallel.thd_split`) and the cu_seqlens describe the whole sequence; the layers all-gather
their keys (and the compressors' projections) in the packed global order. Documents of uneven
length: for V4 (CSA ratio 3, HCA 8, top-k 3, window 5) none is a multiple of the CSA ratio and
the first has fewer entries than top-k; for QSA (blocks of 4, budget 8 blocks) the first has
fewer blocks than the budget; the padded scenarios (cu_seqlens_q_padded) have real lengths
that are multiples of neither. Compared: the output and the input gradient (reassembled), every
parameter gradient (summed over CP: the loss is a sum over tokens), the logged indexer loss
(per-token, summed over CP), and the replay counters under full recompute.

The masked scenarios leave each document's rows after its first MASKS[name] out of the
indexer loss (real_token_mask_q, this rank's rows of it: megatron's THD split of the mask;
with padded documents, their real rows). A per-token loss is the KL sum over the valid rows,
summed over CP. A mean loss is each rank's mean over its own (valid) rows (as stock DSA's),
and megatron averages the ranks' gradients: with as many (valid) rows on each rank (HALVES, or
no mask) that average is the CP = 1 mean, so the indexer's gradients and the logged loss summed
over CP are compared at CP times CP = 1's.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from hyscale_bench.distributed import init_model_parallel
from megatron_hyscale.parallel import thd_merge, thd_split
from megatron_hyscale.testing.distributed import run_workers, worker_result
from megatron_hyscale.testing.packed import cu_seqlens, prefix_mask, thd_params

WORLD = 2
LENGTHS = (8, 40, 28)  # divisible by 2 * CP
REAL = (7, 37, 26)  # the padded scenarios' real tokens
WORKER_TIMEOUT_S = 300
LOSS = dict(calculate_per_token_loss=True)
# name -> (layer: 0 window / 1 CSA / 2 HCA / "qsa", overrides, recompute, padded)
SCENARIOS: dict[str, tuple] = {
    "window": (0, {}, False, False),
    "csa-recompute": (1, {}, True, False),
    "csa-dense-loss": (1, dict(v4_indexer_loss_coeff=0.5, v4_indexer_use_sparse_loss=False,
                               **LOSS), False, False),
    "csa-sparse-loss-recompute": (1, dict(v4_indexer_loss_coeff=0.5, **LOSS), True, False),
    "csa-padded": (1, {}, False, True),
    "hca-recompute": (2, {}, True, False),
    "hca-padded": (2, {}, False, True),
    "qsa-recompute": ("qsa", {}, True, False),
    "qsa-dense-loss": ("qsa", dict(qsa_indexer_loss_coeff=0.5, **LOSS), False, False),
    "qsa-sparse-loss-recompute": ("qsa", dict(qsa_indexer_loss_coeff=0.5,
                                              qsa_indexer_use_sparse_loss=True, **LOSS),
                                  True, False),
    "qsa-padded": ("qsa", {}, False, True),
    "csa-dense-loss-masked": (1, dict(v4_indexer_loss_coeff=0.5, v4_indexer_use_sparse_loss=False,
                                      **LOSS), False, False),
    "csa-sparse-loss-masked-recompute": (1, dict(v4_indexer_loss_coeff=0.5, **LOSS), True,
                                         False),
    "csa-sparse-loss-padded-masked": (1, dict(v4_indexer_loss_coeff=0.5, **LOSS), False, True),
    "csa-sparse-mean-loss-masked": (1, dict(v4_indexer_loss_coeff=0.5), False, False),
    "csa-dense-mean-loss-masked-row-chunks": (1, dict(v4_indexer_loss_coeff=0.5, v4_row_chunk=16,
                                                      v4_indexer_use_sparse_loss=False),
                                              False, False),
    "qsa-dense-loss-masked": ("qsa", dict(qsa_indexer_loss_coeff=0.5, **LOSS), False, False),
    "qsa-sparse-loss-masked-recompute": ("qsa", dict(qsa_indexer_loss_coeff=0.5,
                                                     qsa_indexer_use_sparse_loss=True, **LOSS),
                                         True, False),
    "qsa-dense-mean-loss-masked": ("qsa", dict(qsa_indexer_loss_coeff=0.5), False, False),
    # Each document's share of the dense mean is of the local rows (it was of the gathered
    # sequence's, half the loss at CP 2).
    "qsa-dense-mean-loss": ("qsa", dict(qsa_indexer_loss_coeff=0.5), False, False),
}
# The masked scenarios' valid rows: each document's first ones. VALID cuts the second document
# across both ranks' chunks (chunks of 10: rows 25..39 are in chunk 2, rank 1, and chunk 3,
# rank 0) and the third within rank 0's last chunk; HALVES keeps the first two of the four
# chunks of the second and third documents, one a rank: 21 valid rows on each.
VALID = (8, 25, 21)
HALVES = (8, 20, 14)
MASKS = {name: (REAL if SCENARIOS[name][3] else HALVES if "mean" in name else VALID)
         for name in SCENARIOS if "masked" in name}


def _params(name: str, cp: int, rank: int):
    """The scenario's packed layout, with its real_token_mask_q (this rank's rows) if masked."""
    padded = SCENARIOS[name][3]
    params = thd_params(REAL, LENGTHS) if padded else thd_params(LENGTHS)
    if name in MASKS:
        params.real_token_mask_q = thd_split(prefix_mask(MASKS[name], LENGTHS),
                                             cu_seqlens(LENGTHS), cp, rank, dim=0)
    return params


def _build(kind, cp: int, overrides: dict):
    """(layer, its call on [t, 1, h] rows) at context parallelism cp, same weights at any cp."""
    cp_args = dict(context_parallel_size=cp, cp_comm_type="allgather" if cp > 1 else None)
    if kind == "qsa":
        from megatron.core.models.common.embeddings.rotary_pos_embedding import (
            RotaryEmbedding,
        )
        from megatron.core.transformer.spec_utils import build_module

        from megatron_hyscale.specs.qsa import get_qsa_attention_spec
        from megatron_hyscale.testing.qsa import tiny_qsa_configs

        cfg, hcfg = tiny_qsa_configs(deterministic_mode=True, **cp_args, **overrides)
        layer = build_module(get_qsa_attention_spec(cfg), config=cfg, layer_number=1,
                             cp_comm_type=cfg.cp_comm_type)
        freqs = RotaryEmbedding(kv_channels=hcfg.head_dim, rotary_percent=0.5,
                                rotary_base=10000, use_cpu_initialization=True)(
                                    max(LENGTHS), packed_seq=True)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in sorted(layer.named_parameters()):
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.2 * noise)
        return layer, lambda h, params: layer(h, None, rotary_pos_emb=freqs,
                                              packed_seq_params=params)[0]
    from hyscale_bench.models import randomize_, tiny_v4_config
    from megatron_hyscale.layers.deepseek_v4 import HyScaleV4Attention

    cfg = tiny_v4_config(csa_ratio=3, hca_ratio=8, window=5, index_topk=3, **cp_args,
                         **overrides)
    layer = HyScaleV4Attention(cfg, layer_number=kind + 1, cp_comm_type=cfg.cp_comm_type)
    randomize_(layer, seed=kind)
    return layer, lambda h, params: layer(h, None, packed_seq_params=params)[0]


def _gather(x: torch.Tensor, cp_group, cu) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp_group.size())]
    dist.all_gather(parts, x.contiguous(), group=cp_group)
    return thd_merge(parts, cu, dim=0)


def _step(name: str, cp_group) -> dict:
    from megatron.core import tensor_parallel
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    from megatron_hyscale import replay

    kind, overrides, recompute, _ = SCENARIOS[name]
    cp = 1 if cp_group is None else cp_group.size()
    rank = 0 if cp_group is None else cp_group.rank()
    layer, call = _build(kind, cp, overrides)
    layer.train()
    cu = cu_seqlens(LENGTHS)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(cu[-1], 1, layer.config.hidden_size, generator=g)
    weights = torch.randn(cu[-1], 1, layer.config.hidden_size, generator=g)
    h = thd_split(full, cu, cp, rank, dim=0).clone().requires_grad_(True)
    r = thd_split(weights, cu, cp, rank, dim=0)
    params = _params(name, cp, rank)
    DSAIndexerLossLoggingHelper.tracker.clear()
    replay.reset_stats()
    fn = lambda x: call(x, params)  # noqa: E731
    out = tensor_parallel.checkpoint(fn, False, h) if recompute else fn(h)
    (out * r).sum().backward()
    replay.assert_drained()
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    logged = values.clone() if values is not None else torch.zeros(1)
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    out, h_grad = out.detach(), h.grad
    if cp > 1:
        dist.all_reduce(logged, group=cp_group)
        for grad in grads.values():
            dist.all_reduce(grad, group=cp_group)
        out, h_grad = _gather(out, cp_group, cu), _gather(h_grad, cp_group, cu)
    return dict(out=out, h_grad=h_grad, grads=grads, loss=logged, stats=replay.get_stats())


def _body(rank: int, result: dict) -> None:
    from hyscale_bench.cpu import megatron_on_cpu

    with megatron_on_cpu():
        for cp in (1, WORLD):
            cp_group = init_model_parallel(cp)
            for name in SCENARIOS:
                try:
                    result[(name, cp)] = _step(name, cp_group)
                except Exception:
                    result[(name, cp)] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_workers(_body, WORLD, WORKER_TIMEOUT_S)


def _get(results: dict, name: str, cp: int) -> dict:
    return worker_result(results, (name, cp))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_cp2_packed_equals_cp1(results, name):
    one, two = _get(results, name, 1), _get(results, name, WORLD)
    torch.testing.assert_close(two["out"], one["out"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two["h_grad"], one["h_grad"], rtol=1e-5, atol=1e-6)
    assert set(two["grads"]) == set(one["grads"])
    # A mean indexer loss: each rank's mean (module doc), so the sums over CP are CP times.
    times = WORLD if "mean" in name else 1
    for param, grad in one["grads"].items():
        scale = times if "indexer" in param else 1
        torch.testing.assert_close(two["grads"][param] / scale, grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, p=param: f"{p}: {m}")
    torch.testing.assert_close(two["loss"] / times, one["loss"], rtol=1e-5, atol=1e-7)
    if "loss" in name:
        assert float(one["loss"].sum()) > 0
        assert any("indexer" in p for p in one["grads"]), "the indexer loss never ran"
    kind, _, recompute, _ = SCENARIOS[name]
    selects = kind in (1, "qsa")
    for got in (one, two):
        assert got["stats"]["selections_computed"] == int(selects)
        assert got["stats"]["selections_replayed"] == int(selects and recompute)

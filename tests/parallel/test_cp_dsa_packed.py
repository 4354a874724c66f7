"""Packed THD sequences under context parallelism: HyScale's DSA layer at CP = 2 (two gloo
processes) against megatron-core's DSAttention at CP = 2 and against its own CP = 1 run.

Three documents of uneven length (the first shorter than top-k) packed in one sequence; under
CP each rank holds chunks r and 3 - r of every document (megatron's THD split,
`parallel.thd_split`, as TE's `thd_get_partitioned_indices`), the cu_seqlens describe the whole
sequence. The MLA + DSA self-attention layer (stock and HyScale on identical weights) runs one
training step per scenario: dense / sparse indexer loss, per-token loss, full recompute (the
selection replayed), padded documents (cu_seqlens_q_padded, real tokens fewer), padded rows
masked out of the indexer loss (real_token_mask_q, each rank's local rows: mean and per-token
loss), two layers sharing one selection (dsa_indexer_topk_freq=2), and HyScale's MLA layer in
checkpointed row parts that cut documents (row_chunk; stock whole), and the sparse loss in
the attention backward with each document's selection giving its rows' index log-sum-exps.
Rank 0 keeps what it saw; the tests compare
- outputs (reassembled), the logged indexer loss (reduced over CP as megatron's tracker does
  with the groups the layer gave it), every parameter gradient (averaged over CP; summed for
  per-token losses) and the input gradient;
- HyScale CP = 2 against stock CP = 2 and against HyScale CP = 1 (whose selection must equal
  the CP = 2 rows at their global rows exactly), and stock CP = 2 against stock CP = 1 (with
  a row mask and a mean loss each rank's mean is over its own valid rows, which differ in
  number, so the logged loss and the indexer's gradients differ from CP = 1's by design, in
  stock as in HyScale: the rest is compared);
- that HyScale's own path ran: no forward fell back to the stock one (counted, as the layer
  benchmark counts them) and its selection ran (replay counters), replayed under recompute.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from hyscale_bench.distributed import init_model_parallel
from megatron_hyscale.parallel import (
    all_gather_to_global,
    thd_gather_order,
    thd_merge,
    thd_positions,
    thd_split,
)
from megatron_hyscale.testing.distributed import FakeGroup, run_workers

WORLD = 2
HIDDEN, TOPK = 64, 16
LENGTHS = (12, 40, 28)  # divisible by 2 * CP; the first document is shorter than top-k
REAL_LENGTHS = (9, 37, 28)  # the padded scenario: real tokens, padded to LENGTHS
RTOL, ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
WORKER_TIMEOUT_S = 300
SCENARIOS: dict[str, dict] = {
    "dense-loss": {},
    "sparse-loss": dict(dsa_indexer_use_sparse_loss=True),
    "dense-loss-recompute": dict(recompute=True),
    "sparse-loss-recompute-no-relu": dict(dsa_indexer_use_sparse_loss=True,
                                          dsa_indexer_scoring_relu=False, recompute=True),
    "per-token-loss": dict(calculate_per_token_loss=True),
    "padded-documents": dict(padded=True, dsa_indexer_use_sparse_loss=True),
    "real-token-mask": dict(padded=True, masked=True, dsa_indexer_use_sparse_loss=True),
    "real-token-mask-per-token-recompute": dict(padded=True, masked=True, recompute=True,
                                                calculate_per_token_loss=True),
    "index-share": dict(num_layers=2, dsa_indexer_topk_freq=2),
    # The indexer's head weights zeroed: every score is 0 and the selection is decided by the
    # tie order alone (key index ascending, in global rows), exactly.
    "tied-scores": dict(tied=True),
    # HyScale's MLA layer in checkpointed parts of ROW_CHUNK local rows (parts cut documents:
    # each row's RoPE at its position in its document); stock runs whole.
    "row-chunks-sparse-recompute": dict(row_chunk=True, dsa_indexer_use_sparse_loss=True,
                                        recompute=True),
    "row-chunks-dense-masked": dict(row_chunk=True, padded=True, masked=True),
    # The sparse loss in the attention backward (Triton's interpreter on CPU), its rows' index
    # log-sum-exps from each document's selection at the rows' in-document positions, replayed.
    "sparse-loss-recompute-target-in-backward": dict(target_in_backward=True, recompute=True,
                                           dsa_indexer_use_sparse_loss=True),
}
ROW_CHUNK = 14  # local rows: 80 at CP = 1 (6 parts), 40 at CP = 2 (3 parts)


def _cu(lengths) -> list[int]:
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


# ---------------------------------------------------------------------------------------------
# Layout helpers (single process)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3])
def test_thd_layout_matches_megatron(cp):
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    lengths = [6 * cp, 2 * cp, 0, 10 * cp]
    cu = _cu(lengths)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    full = torch.arange(cu[-1])
    parts = [thd_split(full, cu, cp, r, dim=0) for r in range(cp)]
    for r, part in enumerate(parts):
        expected = dsa_layout.build_packed_allgather_cp_local_positions(
            cu_t, cp, r, torch.device("cpu"), output_size=cu[-1] // cp,
            cu_seqlens_cover_output=True)
        torch.testing.assert_close(thd_positions(cu, cp, r), expected)
        torch.testing.assert_close(part, expected)
    _, reorder = dsa_layout.build_packed_allgather_cp_query_positions_and_key_reorder(
        cu_t, cu_t, cp, 0, torch.device("cpu"), local_output_size=cu[-1] // cp,
        query_cu_seqlens_cover_output=True, key_cu_seqlens_cover_output=True)
    gathered = torch.cat(parts)
    order = thd_gather_order(cu, cp)
    torch.testing.assert_close(order.to_global, reorder)
    torch.testing.assert_close(gathered[order.to_global], full)
    torch.testing.assert_close(full[order.to_rank_major], gathered)
    x = torch.randn(3, cu[-1], 2)
    torch.testing.assert_close(thd_merge([thd_split(x, cu, cp, r, 1) for r in range(cp)], cu, 1),
                               x)


def test_thd_layout_rejects_documents_not_divisible():
    with pytest.raises(ValueError, match=r"divisible by 2 \* cp = 4.*\[8, 6\]"):
        thd_positions([0, 8, 14], 2, 0)
    with pytest.raises(ValueError, match="out of range"):
        thd_positions([0, 8], 2, 2)
    with pytest.raises(ValueError, match="must rise from 0"):
        thd_positions([0, 8, 4], 1, 0)


def test_packed_layout_under_cp():
    """The layer's view of its rows: documents in the whole sequence and locally, the local
    rows' global rows and positions in their document, the gather order."""
    from megatron_hyscale.layers.packed import packed_layout

    cu = _cu(LENGTHS)
    layout = packed_layout(_params(padded=False), 40, torch.device("cpu"), layer="L",
                           group=FakeGroup(2, 1))
    assert layout.documents == ((0, 12), (12, 52), (52, 80))
    assert layout.local == ((0, 6), (6, 26), (26, 40))
    torch.testing.assert_close(layout.positions, thd_positions(cu, 2, 1))
    assert layout.positions[:6].tolist() == [3, 4, 5, 6, 7, 8]
    assert layout.offsets[:6].tolist() == [3, 4, 5, 6, 7, 8]
    assert layout.offsets[6:16].tolist() == list(range(10, 20))
    assert layout.offsets[16:26].tolist() == list(range(20, 30))
    torch.testing.assert_close(layout.key_order.to_global, thd_gather_order(cu, 2).to_global)
    # Padded documents: their storage rows (cu_seqlens_q_padded) count.
    padded = packed_layout(_params(padded=True), 40, torch.device("cpu"), layer="L",
                           group=FakeGroup(2, 0))
    assert padded.documents == layout.documents
    plain = packed_layout(_params(padded=False), 80, torch.device("cpu"), layer="L")
    assert plain.documents == plain.local == layout.documents and plain.positions is None


def test_packed_layout_errors_name_the_layer_and_argument():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hyscale.layers.packed import packed_layout

    def params(cu, **extra):
        cu = torch.tensor(cu, dtype=torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, **extra)

    cpu, group = torch.device("cpu"), FakeGroup(2, 0)
    with pytest.raises(ValueError, match=r"HyScaleDSAttention: packed THD under context "
                       r"parallelism 2 .* 2 \* cp = 4 .* cu_seqlens_q lengths \[10, 70\]"):
        packed_layout(params([0, 10, 80]), 40, cpu, layer="HyScaleDSAttention", group=group)
    padded = torch.tensor([0, 14, 80], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q_padded lengths \[14, 66\]"):
        packed_layout(params([0, 10, 80], cu_seqlens_q_padded=padded,
                             cu_seqlens_kv_padded=padded), 40, cpu, layer="L", group=group)
    with pytest.raises(ValueError, match=r"L: packed cu_seqlens must rise from 0 to the 80 rows "
                       r"of the whole sequence \(40 local rows x context parallelism 2\)"):
        packed_layout(params([0, 12, 76]), 40, cpu, layer="L", group=group)


# ---------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _cpu_patches() -> Iterator[None]:
    """megatron on CPU (its CP RoPE slice included) and the tie-deterministic stock top-k."""
    from hyscale_bench.cpu import megatron_on_cpu
    from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

    with megatron_on_cpu(), stock_topk_breaks_ties_by_index():
        yield


def _params(padded: bool, masked: bool = False, cp: int = 1, rank: int = 0):
    """The packed layout; `masked`: real_token_mask_q marks each document's real tokens (its
    first REAL_LENGTHS rows), as this rank's local rows (megatron's THD split of the mask)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = REAL_LENGTHS if padded else LENGTHS
    cu = torch.tensor(_cu(lengths), dtype=torch.int32)
    extra = {}
    if padded:
        cu_padded = torch.tensor(_cu(LENGTHS), dtype=torch.int32)
        extra = dict(cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS), **extra)
    if masked:
        real = torch.cat([torch.arange(n) < r for n, r in zip(LENGTHS, REAL_LENGTHS)])
        params.real_token_mask_q = thd_split(real, _cu(LENGTHS), cp, rank, dim=0)
    return params


def _build(cfg, stock: bool, state: dict | None, tied: bool = False,
           row_chunk: int | None = None):
    """The scenario's attention layers (one per layer), on the weights in `state` if given;
    `tied`: the indexer's head weights zeroed (all index scores tie); `row_chunk`: HyScale's
    layers in parts of that many rows."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hyscale.specs import get_dsa_layer_specs

    torch.manual_seed(0)
    # As megatron's TransformerLayer builds its attention (cp_comm_type from the config).
    extra = {} if cfg.cp_comm_type is None else dict(cp_comm_type=cfg.cp_comm_type)
    layers = torch.nn.ModuleList(
        build_module(spec.submodules.self_attention, config=cfg, layer_number=n + 1, **extra)
        for n, spec in enumerate(get_dsa_layer_specs(cfg, stock=stock,
                                                     row_chunk=None if stock else row_chunk)))
    if state is not None:
        layers.load_state_dict(state, strict=True)
    if tied:
        with torch.no_grad():
            for layer in layers:
                layer.core_attention.indexer.linear_weights_proj.weight.zero_()
    return layers


def _step(layers, cfg, cp_group, params, recompute: bool, record: list) -> dict:
    """One training step of the layers on this rank's share; reduced over CP on rank 0's side."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    from hyscale_bench.layer import FallbackCounter
    from megatron_hyscale import replay

    cp = 1 if cp_group is None else cp_group.size()
    rank = 0 if cp_group is None else cp_group.rank()
    cu = _cu(LENGTHS)
    full = torch.randn(cu[-1], 1, HIDDEN, generator=torch.Generator().manual_seed(3))
    h = thd_split(full, cu, cp, rank, dim=0).clone().requires_grad_(True)
    per_token = cfg.calculate_per_token_loss
    layers.train()
    layers.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    replay.reset_stats()
    record.clear()

    def forward(x):
        for layer in layers:
            x = layer(x, None, packed_seq_params=params)[0]
        return x

    with FallbackCounter() as fallbacks:
        out = tensor_parallel.checkpoint(forward, False, h) if recompute else forward(h)
        # Each rank's loss: the mean over its rows (per-token: its share of the global sum's
        # mean); the step's gradient is their average over CP (per-token: their sum).
        loss = out.pow(2).sum() / cu[-1] if per_token else out.pow(2).mean()
        loss.backward()
    replay.assert_drained()
    tracker = DSAIndexerLossLoggingHelper.tracker
    logged = tracker["values"].clone()
    groups = (tracker.get("reduce_group"), tracker.get("avg_group"))
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    grads = {n: p.grad.clone() for n, p in layers.named_parameters() if p.grad is not None}
    # The input's gradient holds every rank's loss (the keys' gradients are reduce-scattered
    # to their owners): at CP = 2 the mean losses add up to twice the global mean.
    h_grad = h.grad / (1 if per_token else cp)
    out, indices = out.detach(), [i.clone() for i in record]
    if cp > 1:
        expected = (cp_group, None) if per_token else (None, cp_group)
        assert groups == expected, f"indexer loss tracker groups (reduce, avg) = {groups}"
        op = dist.ReduceOp.SUM if per_token else dist.ReduceOp.AVG
        dist.all_reduce(logged, group=cp_group, op=op)
        for g in grads.values():
            dist.all_reduce(g, group=cp_group, op=op)
        out, h_grad = _gather(out, cp_group, cu), _gather(h_grad, cp_group, cu)
        indices = [_gather(i.transpose(0, 1), cp_group, cu).transpose(0, 1) for i in indices]
    return dict(out=out, h_grad=h_grad, grads=grads, indexer_loss=logged, indices=indices,
                stats=replay.get_stats(), fallbacks=fallbacks.count,
                reasons=sorted(fallbacks.reasons))


def _gather(x: torch.Tensor, cp_group, cu) -> torch.Tensor:
    """Every rank's THD share of `x` (rows first) -> the whole packed sequence."""
    parts = [torch.empty_like(x) for _ in range(cp_group.size())]
    dist.all_gather(parts, x.contiguous(), group=cp_group)
    return thd_merge(parts, cu, dim=0)


def _check_gather(cp_group) -> None:
    """all_gather_to_global with a THD order: forward = the whole sequence, backward = sum over
    ranks, back at the owners."""
    cu = _cu(LENGTHS)
    cp, rank = cp_group.size(), cp_group.rank()
    full = torch.randn(cu[-1], 3, generator=torch.Generator().manual_seed(3))
    weights = torch.randn(cp, cu[-1], 3, generator=torch.Generator().manual_seed(4))
    local = thd_split(full, cu, cp, rank, dim=0).clone().requires_grad_(True)
    gathered = all_gather_to_global(local, cp_group, thd_gather_order(cu, cp))
    torch.testing.assert_close(gathered, full)
    (gathered * weights[rank]).sum().backward()
    torch.testing.assert_close(local.grad, thd_split(weights.sum(0), cu, cp, rank, dim=0))


def _body(rank: int, result: dict) -> None:
    from unittest import mock

    from hyscale_bench.models import tiny_dsa_config
    from megatron_hyscale.layers.dsa import HyScaleDSAttention

    record: list = []
    with_lse: list = []  # one entry a selection that gave the loss its log-sum-exps
    original = HyScaleDSAttention._selection

    def recording(self, *args, **kwargs):
        # Each layer's selection of a forward (computed, replayed or shared), as it returns it.
        got = original(self, *args, **kwargs)
        record.append(got[0].clone())  # (indices, the selected scores' log-sum-exp)
        if got[1] is not None:
            with_lse.append(1)
        return got

    with _cpu_patches(), mock.patch.object(HyScaleDSAttention, "_selection", recording):
        states: dict = {}
        for cp in (1, WORLD):
            cp_group = init_model_parallel(cp)
            if cp > 1:
                _check_gather(cp_group)
            for name, overrides in SCENARIOS.items():
                overrides = dict(overrides)
                recompute = overrides.pop("recompute", False)
                padded = overrides.pop("padded", False)
                masked = overrides.pop("masked", False)
                tied = overrides.pop("tied", False)
                row_chunk = ROW_CHUNK if overrides.pop("row_chunk", False) else None
                target_in_backward = overrides.pop("target_in_backward", False)
                cfg = tiny_dsa_config(dsa_indexer_topk=TOPK, context_parallel_size=cp,
                                      cp_comm_type="allgather" if cp > 1 else None,
                                      **{"num_layers": 1, **overrides})
                if target_in_backward:  # HyScale's setting (stock's layer does not read it)
                    cfg.hyscale_indexer_target = "attention_backward"
                for kind in ("stock", "hyscale"):
                    try:
                        layers = _build(cfg, stock=kind == "stock", state=states.get(name),
                                        tied=tied, row_chunk=row_chunk)
                        states.setdefault(name, layers.state_dict())
                        params = _params(padded, masked, cp,
                                         0 if cp_group is None else cp_group.rank())
                        before = len(with_lse)
                        result[(name, kind, cp)] = _step(layers, cfg, cp_group, params,
                                                         recompute, record)
                        result[(name, kind, cp)]["lse_selections"] = len(with_lse) - before
                    except Exception:
                        # Both ranks fail alike (the checks are symmetric); the tests say why.
                        result[(name, kind, cp)] = {
                            "error": f"rank {rank}:\n{traceback.format_exc()}"}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_workers(_body, WORLD, WORKER_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------

def _ok(results: dict, key: tuple) -> dict:
    if "error" in results[key]:
        pytest.fail(f"{key}: the run failed:\n{results[key]['error']}", pytrace=False)
    return results[key]


# A row mask with a mean loss: each CP rank's mean is over its own valid rows (34 and 40 of
# 40 here), so the loss logged as their average and the indexer's gradients are not CP = 1's.
CP_MEANS_DIFFER = {"real-token-mask", "row-chunks-dense-masked"}


def assert_same_step(got: dict, expected: dict, what: str, *, loss_atol: float = 1e-12,
                     indexer: bool = True) -> None:
    """Outputs, input gradient, indexer loss and every parameter gradient (`indexer` False:
    not the indexer loss and the indexer's gradients, which come from it alone)."""
    torch.testing.assert_close(got["out"], expected["out"], rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(got["h_grad"], expected["h_grad"], rtol=GRAD_RTOL,
                               atol=GRAD_ATOL, msg=lambda m: f"{what} input gradient: {m}")
    assert expected["indexer_loss"].abs().sum() > 0, "the indexer loss never ran"
    if indexer:
        torch.testing.assert_close(got["indexer_loss"], expected["indexer_loss"], rtol=RTOL,
                                   atol=loss_atol, msg=lambda m: f"{what} indexer loss: {m}")
    else:
        assert not torch.allclose(got["indexer_loss"], expected["indexer_loss"])
    assert set(got["grads"]) == set(expected["grads"])
    assert any(".indexer." in n for n in expected["grads"]), "no indexer gradient"
    for name, grad in expected["grads"].items():
        if not indexer and ".indexer." in name:
            continue
        torch.testing.assert_close(got["grads"][name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m, n=name: f"{what} grad {n}: {m}")


def assert_own_path(res: dict, scenario: str) -> None:
    assert res["fallbacks"] == 0, f"{scenario}: fell back to stock: {res['reasons']}"
    computed = 1
    replayed = 1 if "recompute" in scenario else 0
    assert (res["stats"]["selections_computed"], res["stats"]["selections_replayed"]) == (
        computed, replayed), f"{scenario}: replay counters {res['stats']}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_hyscale_cp2_matches_stock_cp2(results, scenario):
    got = _ok(results, (scenario, "hyscale", WORLD))
    assert_own_path(got, scenario)
    assert_same_step(got, _ok(results, (scenario, "stock", WORLD)),
                     f"{scenario} HyScale vs stock at CP=2", loss_atol=ATOL)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_hyscale_cp2_matches_cp1(results, scenario):
    cp1, cp2 = _ok(results, (scenario, "hyscale", 1)), _ok(results, (scenario, "hyscale", WORLD))
    assert_own_path(cp1, scenario)
    assert_same_step(cp2, cp1, f"{scenario} HyScale CP=2 vs CP=1",
                     indexer=scenario not in CP_MEANS_DIFFER)
    # The same selection, row for row, in global packed rows.
    assert len(cp2["indices"]) == len(cp1["indices"]) > 0
    for n, (a, b) in enumerate(zip(cp2["indices"], cp1["indices"], strict=True)):
        assert torch.equal(a, b), f"{scenario}: selection {n} differs"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_stock_cp2_matches_cp1(results, scenario):
    assert_same_step(_ok(results, (scenario, "stock", WORLD)),
                     _ok(results, (scenario, "stock", 1)), f"{scenario} stock CP=2 vs CP=1",
                     loss_atol=ATOL, indexer=scenario not in CP_MEANS_DIFFER)


@pytest.mark.parametrize("cp", [1, WORLD])
def test_the_loss_in_the_backward_takes_each_documents_lse(results, cp):
    """The sparse loss in the attention backward: the selections (first forward and replayed
    recompute) carry their rows' log-sum-exps, here under CP too; the step matching stock's is
    `test_hyscale_cp2_matches_stock_cp2`'s."""
    res = _ok(results, ("sparse-loss-recompute-target-in-backward", "hyscale", cp))
    assert res["lse_selections"] == 2  # the forward's and the recompute's (replayed)
    assert _ok(results, ("dense-loss", "hyscale", cp))["lse_selections"] == 0  # none to take


def test_selection_stays_in_each_document(results):
    """Every selected key is of the row's own document and at or before it; a document
    shorter than top-k selects all its visible keys; with all scores tied, each row selects
    its document's first keys, in order."""
    (indices,) = _ok(results, ("dense-loss", "hyscale", WORLD))["indices"]
    (tied,) = _ok(results, ("tied-scores", "hyscale", WORLD))["indices"]
    cu = _cu(LENGTHS)
    for start, end in zip(cu, cu[1:]):
        rows = indices[0, start:end]
        valid = rows >= 0
        row_pos = torch.arange(start, end).unsqueeze(-1).expand_as(rows)
        assert bool((rows[valid] >= start).all()), "a row selected another document's key"
        assert bool((rows[valid] <= row_pos[valid]).all()), "a row selected a later key"
        assert valid.sum(-1).tolist() == [min(TOPK, i + 1) for i in range(end - start)]
        for i in range(end - start):
            n = min(TOPK, i + 1)
            expected = list(range(start, start + n)) + [-1] * (TOPK - n)
            assert tied[0, start + i].tolist() == expected, f"row {start + i}"

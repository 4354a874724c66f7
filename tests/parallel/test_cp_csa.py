"""Context-parallel HyScaleV4Attention: CP = 2 (two gloo processes) gives the same layer as CP = 1.

Two processes are spawned once for the file. Each builds the same tiny fp32 V4 attention
layers (window-only, CSA, HCA) with the same random weights, runs them at CP = 1 on the whole
sequence (both ranks alike), then re-initializes megatron with context_parallel_size=2 and
runs them on its zigzag half (chunks r and 3 - r of 4, as megatron's
`get_batch_on_this_cp_rank`). T = 44: chunks of 11 tokens, so every chunk border (11, 22, 33)
falls inside a compression window of the CSA ratio 3 and the HCA ratio 8 (and 11 is no
multiple of 4 for the CSA ratio 4 case), T is no multiple of 3 or 8, and the 7-token sliding
window reaches across the borders. Compared: the output (reassembled), the input gradient
(reassembled), every parameter gradient (summed over CP: the loss is a sum over tokens, each
rank holding its own tokens' share), and the replay counters under full recompute
(`tensor_parallel.checkpoint`). One more case runs a 3-layer GPTModel with V4's pattern
(window, CSA, HCA) from `get_v4_block_spec` under full recompute, so that the CP group and
cp_comm_type come through megatron's TransformerLayer and the batch split is megatron's
(LM loss, logits and every parameter gradient, averaged over CP as megatron's DDP does).
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from hyscale_bench.distributed import init_model_parallel
from hyscale_bench.models import randomize_
from megatron_hyscale.parallel import zigzag_merge, zigzag_split
from megatron_hyscale.testing.compare import assert_grads_close
from megatron_hyscale.testing.distributed import run_workers, worker_result

WORLD = 2
T, B = 44, 2
VOCAB = 53
WORKER_TIMEOUT_S = 300
# name -> (compress ratio, CSA ratio, config overrides, full recompute, pass pg_collection)
SCENARIOS: dict[str, tuple[int, int, dict, bool, bool]] = {
    "window": (0, 3, {}, False, True),
    "window-full-recompute-global-cp-group": (0, 3, {}, True, False),
    "csa": (3, 3, {}, False, True),
    "csa-full-recompute": (3, 3, {}, True, True),
    "csa-ratio4-full-recompute": (4, 4, {}, True, False),
    "csa-baseline-full-recompute": (3, 3, dict(v4_baseline=True, v4_baseline_row_block=5),
                                    True, True),
    "csa-indexer-loss-full-recompute": (3, 3, dict(v4_indexer_loss_coeff=0.5,
                                                   calculate_per_token_loss=True), True, True),
    "hca": (8, 3, {}, False, True),
    "hca-full-recompute": (8, 3, {}, True, True),
    # Chunks of 12 tokens, whole windows of ratio 3, 4 and 6: the compressors pool their own
    # chunks (cp_mode "chunks") instead of gathering the projections.
    "csa-chunks": (3, 3, {}, False, True),
    "csa-ratio4-chunks-indexer-loss-full-recompute": (
        4, 4, dict(v4_indexer_loss_coeff=0.5, calculate_per_token_loss=True), True, True),
    "hca-chunks-full-recompute": (6, 3, {}, True, True),
    # A 16-token window: its 15 earlier tokens reach past the 11-token chunk before, so the
    # raw keys are all-gathered instead of a halo per chunk.
    "window-wide-gather": (0, 3, dict(v4_sliding_window=16), False, True),
    "hca-wide-window-gather": (8, 3, dict(v4_sliding_window=16), True, True),
    # v4_row_chunk: the local rows in checkpointed parts of 8 (22 rows at CP 2: 8, 8, 6).
    "csa-indexer-loss-full-recompute-row-chunks": (
        3, 3, dict(v4_indexer_loss_coeff=0.5, calculate_per_token_loss=True, v4_row_chunk=8),
        True, True),
    "hca-full-recompute-row-chunks": (8, 3, dict(v4_row_chunk=8), True, True),
}
# Row-chunked scenario -> the same scenario without row chunks.
ROW_CHUNK_TWINS = {"csa-indexer-loss-full-recompute-row-chunks": "csa-indexer-loss-full-recompute",
                   "hca-full-recompute-row-chunks": "hca-full-recompute"}
# Sequence length per scenario (default T); 48 = 4 chunks of 12 at CP = 2.
SEQ = {"csa-chunks": 48, "csa-ratio4-chunks-indexer-loss-full-recompute": 48,
       "hca-chunks-full-recompute": 48}


def _config(cp: int, ratio: int, csa_ratio: int, overrides: dict):
    from megatron_hyscale.layers.deepseek_v4 import DeepseekV4TransformerConfig

    fields = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        v4_head_dim=16, v4_rope_head_dim=8, v4_q_lora_rank=24, v4_o_groups=2, v4_o_lora_rank=8,
        v4_sliding_window=7, v4_compress_ratios=[ratio], v4_csa_ratio=csa_ratio,
        v4_index_n_heads=8, v4_index_head_dim=16, v4_index_topk=3,
        normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local",
        params_dtype=torch.float32, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
        context_parallel_size=cp, cp_comm_type="allgather" if cp > 1 else None,
    )
    fields.update(overrides)
    return DeepseekV4TransformerConfig(**fields)


def _run_gpt(cp_group) -> dict:
    """A 3-layer GPT (window, CSA, HCA) train step with full recompute, reduced over CP."""
    from megatron.core.models.gpt import GPTModel

    from megatron_hyscale import replay
    from megatron_hyscale.phase_times import PhaseTimer
    from megatron_hyscale.specs.deepseek_v4 import get_v4_block_spec

    cp = cp_group.size() if cp_group is not None else 1
    rank = cp_group.rank() if cp_group is not None else 0
    cfg = _config(cp, 0, 3, dict(num_layers=3, v4_compress_ratios=[0, 3, 8],
                                 recompute_granularity="full", recompute_method="uniform",
                                 recompute_num_layers=1))
    torch.manual_seed(3)
    model = GPTModel(config=cfg, transformer_layer_spec=get_v4_block_spec(cfg), vocab_size=VOCAB,
                     max_sequence_length=T, share_embeddings_and_output_weights=False,
                     position_embedding_type="none")
    for i, layer in enumerate(model.decoder.layers):
        randomize_(layer.self_attention, seed=100 + i)
    g = torch.Generator().manual_seed(0)
    full = (torch.randint(0, VOCAB, (B, T), generator=g), torch.arange(T).expand(B, T),
            torch.randint(0, VOCAB, (B, T), generator=g))
    ids, pos, labels = (zigzag_split(t, cp, rank, dim=1) for t in full)
    model.train()
    replay.reset_stats()
    timer = PhaseTimer()  # the layers' phase spans, timed at both CP sizes alike
    timer.install("hyscale")
    try:
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        phases = {p: n for p, (_, n) in timer.end_step().items()}
    finally:
        timer.uninstall()
    replay.assert_drained()
    stats = replay.get_stats()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        model.eval()
        logits = model(ids, pos, None)
    loss = loss.detach()
    if cp > 1:
        # Each rank's loss is the mean over its own tokens (equally many per rank): the
        # CP-average of the gradients is the gradient of the global mean.
        for t in (loss, *grads.values()):
            dist.all_reduce(t, group=cp_group, op=dist.ReduceOp.AVG)
        logits = _gather_seq(logits, cp_group, 1)
    return dict(loss=loss, logits=logits, grads=grads, stats=stats, phases=phases,
                names=[n for n, _ in model.named_parameters()])


def _gather_seq(x: torch.Tensor, cp_group, dim: int) -> torch.Tensor:
    """Every rank's zigzag part of `x` -> the full sequence along `dim`."""
    parts = [torch.empty_like(x) for _ in range(cp_group.size())]
    dist.all_gather(parts, x.contiguous(), group=cp_group)
    return zigzag_merge(parts, dim=dim)


def _run(name: str, cp_group) -> dict:
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    from megatron_hyscale import replay
    from megatron_hyscale.layers.deepseek_v4 import HyScaleV4Attention, V4Compressor

    ratio, csa_ratio, overrides, recompute, pass_pg = SCENARIOS[name]
    seq = SEQ.get(name, T)
    cp = cp_group.size() if cp_group is not None else 1
    rank = cp_group.rank() if cp_group is not None else 0
    cfg = _config(cp, ratio, csa_ratio, overrides)
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]) \
        if pass_pg else None
    layer = HyScaleV4Attention(cfg, layer_number=1, pg_collection=pg,
                               cp_comm_type=cfg.cp_comm_type)
    randomize_(layer, seed=ratio + 10 * csa_ratio)
    layer.train()
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(seq, B, cfg.hidden_size, generator=g)
    r_full = torch.randn(seq, B, cfg.hidden_size, generator=g)
    x = zigzag_split(x_full, cp, rank, dim=0).clone().requires_grad_(True)
    r = zigzag_split(r_full, cp, rank, dim=0)

    DSAIndexerLossLoggingHelper.tracker.clear()
    replay.reset_stats()
    if recompute:
        out = tensor_parallel.checkpoint(lambda h: layer(h)[0], False, x)
    else:
        out = layer(x)[0]
    (out * r).sum().backward()
    replay.assert_drained()
    stats = replay.get_stats()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    idx_loss = values.clone() if values is not None else torch.zeros(1)
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    out, x_grad = out.detach(), x.grad
    if cp > 1:
        for grad in grads.values():
            dist.all_reduce(grad, group=cp_group)  # the rank losses sum to the CP = 1 loss
        dist.all_reduce(idx_loss, group=cp_group)  # per-token: each rank's share of the sum
        out, x_grad = _gather_seq(out, cp_group, 0), _gather_seq(x_grad, cp_group, 0)
    cp_modes = sorted({m.cp_mode for m in layer.modules() if isinstance(m, V4Compressor)},
                      key=str)
    return dict(out=out, x_grad=x_grad, grads=grads, stats=stats, indexer_loss=idx_loss,
                names=[n for n, _ in layer.named_parameters()], cp_modes=cp_modes,
                window_mode=layer.window_cp_mode)


def _body(rank: int, result: dict) -> None:
    from hyscale_bench.cpu import megatron_on_cpu

    with megatron_on_cpu():
        for cp in (1, WORLD):
            cp_group = init_model_parallel(cp)
            for name in [*SCENARIOS, "gpt"]:
                try:
                    run = _run_gpt(cp_group) if name == "gpt" else _run(name, cp_group)
                    result[(name, cp)] = run
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
    ratio, csa_ratio, overrides, recompute, _ = SCENARIOS[name]
    torch.testing.assert_close(two["out"], one["out"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two["x_grad"], one["x_grad"], rtol=1e-5, atol=1e-5)
    # Every parameter: the same set has a gradient, and the gradients agree. Without the
    # indexer loss the CSA indexer gets none (its top-k cuts the graph), at both CP sizes.
    assert set(two["grads"]) == set(one["grads"])
    has_indexer_grads = any(n.startswith("indexer.") for n in one["grads"])
    assert has_indexer_grads == ("indexer-loss" in name)
    expected_params = {n for n in one["names"] if not n.startswith("indexer.")}
    assert expected_params <= set(one["grads"])
    for n, grad in one["grads"].items():
        assert grad.abs().sum() > 0, n
        torch.testing.assert_close(two["grads"][n], grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")
    if "indexer-loss" in name:
        assert float(one["indexer_loss"].abs().sum()) > 0
        torch.testing.assert_close(two["indexer_loss"], one["indexer_loss"], rtol=1e-5,
                                   atol=1e-7)
    # One CSA selection per forward; full recompute replays it (HyScale) or selects again
    # (baseline). Window and HCA layers select nothing.
    computed_replayed = (0, 0)
    if ratio == csa_ratio:
        if not recompute:
            computed_replayed = (1, 0)
        elif overrides.get("v4_baseline"):
            computed_replayed = (2, 0)
        else:
            computed_replayed = (1, 1)
    for res in (one, two):
        stats = res["stats"]
        assert (stats["selections_computed"], stats["selections_replayed"]) == computed_replayed
    # Which CP path the compressors took (window layers have none).
    mode = "chunks" if name in SEQ else "gather"
    assert one["cp_modes"] == ([] if ratio == 0 else [None])
    assert two["cp_modes"] == ([] if ratio == 0 else [mode])
    assert one["window_mode"] is None
    assert two["window_mode"] == ("gather" if "gather" in name else "halo")


@pytest.mark.parametrize("cp", [1, WORLD])
@pytest.mark.parametrize("name", list(ROW_CHUNK_TWINS))
def test_row_chunks_match_the_whole_layer(results, name, cp):
    parts, whole = _get(results, name, cp), _get(results, ROW_CHUNK_TWINS[name], cp)
    torch.testing.assert_close(parts["out"], whole["out"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts["x_grad"], whole["x_grad"], rtol=1e-5, atol=1e-5)
    assert_grads_close(parts["grads"], whole["grads"], rtol=1e-4, atol=1e-5, what=name)
    torch.testing.assert_close(parts["indexer_loss"], whole["indexer_loss"], rtol=1e-5,
                               atol=1e-7)
    assert parts["stats"] == whole["stats"]


def test_gpt_v4_pattern_cp2_matches_cp1(results):
    one, two = _get(results, "gpt", 1), _get(results, "gpt", WORLD)
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two["loss"], one["loss"], rtol=1e-5, atol=1e-6)
    assert set(two["grads"]) == set(one["grads"])
    assert {n for n in one["names"] if ".indexer." not in n} == set(one["grads"])
    for n, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][n], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")
    # The CSA layer selects once and its recompute replays; window and HCA select nothing.
    for res in (one, two):
        assert (res["stats"]["selections_computed"], res["stats"]["selections_replayed"]) == (1, 1)
    # Phase spans: the one selection (a replay is none), every layer's attention forward (and
    # recompute) and backward; the window halos and compressed entries are gathered at CP 2
    # (forward, recompute and their reduce-scatters), nothing at CP 1.
    for res in (one, two):
        assert res["phases"]["selection"] == 1 and res["phases"]["attention"] >= 9, res["phases"]
        assert res["phases"]["indexer_loss"] == 0
    assert one["phases"]["communication"] == 0 and two["phases"]["communication"] > 0

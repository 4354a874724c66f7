"""HyScale's QSA attention against transformers' Qwen4ExpTextAttention on the same weights.

transformers (`qwen4_exp`, the independent oracle) and HyScaleQSASelfAttention get identical
weights through `testing.qsa.hf_to_megatron_qsa_state_dict`; outputs, the input gradient
and every parameter gradient must match in fp32 (on the GPU where there is one, with HyScale's
kernels; else on CPU with the references), for sequences that are not a multiple of
the block size and for queries that see fewer complete blocks than the budget (T = 70, budget 8
blocks: queries t < 31 attend to every complete block).

transformers selects with `torch.topk`, whose choice among tied scores is unspecified. The
indexer's ReLU makes a block's score exactly 0 whenever all 4 heads' logits are negative (about
1 block in 16), so a query with fewer than `budget` positive blocks has a tie at the cut-off,
and the two implementations may pick different (equally valid) zero blocks. The inputs are
continuous random values and the seed is one where no query has such a tie; `no_ties_at_cutoff`
checks it, so a change of seed or sizes cannot silently weaken the comparison.

The layers run with `deterministic_mode` (no fp32 atomics in the kernels' backward), so the
bitwise comparisons (replay against no replay, the loss leaving the main gradients) hold on
the GPU too.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)
from megatron.core.transformer.spec_utils import build_module
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention

from hyscale_bench.models import default_device
from megatron_hyscale import replay
from megatron_hyscale.layers.qsa import HyScaleQSAttention
from megatron_hyscale.ops.block_pool import block_scores
from megatron_hyscale.specs.qsa import get_qsa_attention_spec
from megatron_hyscale.testing.qsa import (
    hf_causal_mask,
    hf_position_embeddings,
    hf_to_megatron_qsa_state_dict,
    megatron_to_hf_qsa_state_dict,
    tiny_qsa_configs,
)

DEVICE = default_device()
B, HIDDEN = 2, 64


@pytest.fixture(autouse=True)
def clean_indexer_loss_tracker():
    """The optional indexer loss is logged in megatron's (global) DSA loss tracker."""
    DSAIndexerLossLoggingHelper.tracker.clear()
    yield
    DSAIndexerLossLoggingHelper.tracker.clear()
SEED = 0
RTOL, ATOL = 1e-5, 1e-5


def build_pair(*, baseline: bool = False, seed: int = SEED, **overrides):
    """(transformers attention with random weights, HyScale attention with the same weights)."""
    mcfg, hcfg = tiny_qsa_configs(**{"deterministic_mode": True, **overrides})
    torch.manual_seed(seed)
    hf = Qwen4ExpTextAttention(hcfg, layer_idx=0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # Norm weights are zero at init (scale 1 + w): give them random values too.
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.2))
    ours = build_module(get_qsa_attention_spec(mcfg, baseline=baseline), config=mcfg,
                        layer_number=1)
    missing, unexpected = ours.load_state_dict(
        hf_to_megatron_qsa_state_dict(hf.state_dict(), mcfg), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    return hf.to(DEVICE), ours.to(DEVICE), mcfg, hcfg


def inputs(T: int, seed: int = SEED, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(B, T, hidden, generator=g).to(DEVICE),
            torch.randn(B, T, hidden, generator=g).to(DEVICE))


def rope(hcfg, T: int) -> torch.Tensor:
    """megatron's RoPE frequencies [T, 1, 1, rot] for transformers' rope parameters."""
    params = hcfg.rope_parameters
    return RotaryEmbedding(kv_channels=hcfg.head_dim,
                           rotary_percent=params["partial_rotary_factor"],
                           rotary_base=params["rope_theta"],
                           use_cpu_initialization=True)(T).to(DEVICE)


def hf_extras(hcfg, T: int):
    """transformers' (cos, sin) position embeddings and causal mask, on DEVICE."""
    cos, sin = hf_position_embeddings(hcfg, B, T)
    return (cos.to(DEVICE), sin.to(DEVICE)), hf_causal_mask(B, T).to(DEVICE)


def run_hf(hf, hcfg, x, dy):
    x = x.clone().requires_grad_(True)
    hf.zero_grad(set_to_none=True)
    T = x.shape[1]
    out, _ = hf(x, *hf_extras(hcfg, T))
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def run_ours(ours, hcfg, x, dy, *, checkpoint: bool = False):
    """Forward + backward in megatron's [s, b, h] layout; returns [b, s, h] tensors."""
    xs = x.transpose(0, 1).contiguous().requires_grad_(True)
    ours.zero_grad(set_to_none=True)
    freqs = rope(hcfg, x.shape[1])
    fn = lambda h: ours(h, None, rotary_pos_emb=freqs)[0]
    out = tensor_parallel.checkpoint(fn, False, xs) if checkpoint else fn(xs)
    out.backward(dy.transpose(0, 1))
    grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    return out.detach().transpose(0, 1), xs.grad.transpose(0, 1), grads


def no_ties_at_cutoff(ours, hcfg, x) -> bool:
    """True if every query's budget-th and next visible block scores differ (see docstring)."""
    core = ours.core_attention
    with torch.no_grad():
        q, keys = core.indexer(x.transpose(0, 1), rope(hcfg, x.shape[1]))
        scores = block_scores(q, keys, core.index_scale)
    k, bs = core.block_topk, core.block_size
    for t in range(x.shape[1]):
        visible = (t + 1) // bs
        if visible <= k:
            continue
        top = scores[:, t, :visible].sort(dim=-1, descending=True).values
        if bool(((top[:, k - 1] - top[:, k]).abs() < 1e-5).any()):
            return False
    return True


def assert_grads_match(ours_grads, hf_grads, mcfg, atol: float = 1e-5):
    mapped = megatron_to_hf_qsa_state_dict(ours_grads, mcfg, gradients=True)
    # The selection is a top-k: no gradient reaches the indexer in either implementation.
    assert not any(n.startswith("indexer.") for n in hf_grads)
    assert set(mapped) == set(hf_grads), (sorted(mapped), sorted(hf_grads))
    for name, grad in hf_grads.items():
        torch.testing.assert_close(mapped[name], grad, rtol=1e-4, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("T", [70, 37, 3])
@pytest.mark.parametrize("baseline", [False, True], ids=["hyscale", "baseline"])
def test_selection_matches_transformers(T, baseline):
    """Selected token sets (blocks + tail) equal transformers' indexer mask, row by row."""
    hf, ours, mcfg, hcfg = build_pair(baseline=baseline)
    x, _ = inputs(T)
    assert no_ties_at_cutoff(ours, hcfg, x), "seed has a tie at the top-k cut-off"
    with torch.no_grad():
        hf_mask = hf.indexer(x, *hf_extras(hcfg, T), None)
        expected = hf_mask[:, 0] == 0  # [B, T, T] True where attended
        core = ours.core_attention
        freqs = rope(hcfg, T)
        captured = {}
        original = core._select_blocks

        def spy(*args, **kwargs):
            captured["blocks"] = original(*args, **kwargs)
            return captured["blocks"]

        core._select_blocks = spy
        ours(x.transpose(0, 1), None, rotary_pos_emb=freqs)
    from megatron_hyscale.ops.block_pool import expand_blocks

    tokens = expand_blocks(captured["blocks"], torch.arange(T, device=DEVICE), 4).long()
    got = torch.zeros(B, T, T + 1, dtype=torch.bool, device=DEVICE)
    got.scatter_(-1, torch.where(tokens >= 0, tokens, T), True)
    assert torch.equal(got[..., :T], expected)
    if T == 70:  # the budget binds for late queries and not for early ones
        counts = expected.sum(-1)
        assert int(counts[:, 30].max()) == 31 and int(counts[:, 69].max()) == 8 * 4 + 2


@pytest.mark.parametrize("T", [70, 37, 3])
@pytest.mark.parametrize("baseline", [False, True], ids=["hyscale", "baseline"])
def test_forward_backward_match_transformers(T, baseline):
    hf, ours, mcfg, hcfg = build_pair(baseline=baseline)
    x, dy = inputs(T)
    assert no_ties_at_cutoff(ours, hcfg, x), "seed has a tie at the top-k cut-off"
    hf_out, hf_dx, hf_grads = run_hf(hf, hcfg, x, dy)
    out, dx, grads = run_ours(ours, hcfg, x, dy)
    assert hf_out.abs().max() > 0.1
    torch.testing.assert_close(out, hf_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dx, hf_dx, rtol=1e-4, atol=1e-5)
    assert_grads_match(grads, hf_grads, mcfg)


def test_dkv_lockstep_selects_in_key_order_and_still_matches_transformers():
    """The layer's side of AttentionKernelOptions.dkv_lockstep (outside deterministic_mode,
    which runs the kernel unpaced): the selection comes in increasing block order (what the
    lockstep dK/dV kernel paces by, -1 last) and the layer's outputs and gradients are still
    transformers' (the attention is the same sum over the same slots). The paced kernel itself:
    tests/ops/test_sparse_attention_triton.py (on CPU the layer runs the reference ops)."""
    from megatron_hyscale.ops.kernels.options import AttentionKernelOptions

    hf, ours, mcfg, hcfg = build_pair(deterministic_mode=False)
    mcfg.attention_kernel_options = AttentionKernelOptions(dkv_lockstep=True)
    core = ours.core_attention
    assert core._paced()
    mcfg.deterministic_mode = True
    assert not core._paced()  # dK/dV unpaced there: no sort for it
    for name in ("dq_lockstep", "fwd_lockstep"):  # paced in deterministic_mode too
        mcfg.attention_kernel_options = AttentionKernelOptions(**{name: True})
        assert core._paced(), name
    mcfg.attention_kernel_options = AttentionKernelOptions(dkv_lockstep=True)
    mcfg.deterministic_mode = False
    captured = []
    original = core._select_blocks
    core._select_blocks = lambda *a, **kw: captured.append(original(*a, **kw)) or captured[-1]
    x, dy = inputs(70)
    hf_out, hf_dx, hf_grads = run_hf(hf, hcfg, x, dy)
    out, dx, grads = run_ours(ours, hcfg, x, dy)
    blocks = captured[0]
    valid = blocks >= 0
    assert valid.any() and not (valid[..., 1:] & ~valid[..., :-1]).any()  # -1 last
    assert ((blocks[..., 1:] > blocks[..., :-1]) | ~valid[..., 1:]).all()
    torch.testing.assert_close(out, hf_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dx, hf_dx, rtol=1e-4, atol=1e-5)
    assert_grads_match(grads, hf_grads, mcfg)


def test_default_attention_options_pace_dkv_only():
    """With no config.attention_kernel_options the layer runs QSA_ATTENTION_OPTIONS: the dK/dV
    pass in lockstep (so its blocks come in key order) and nothing else paced; a config that
    names options (the kernels' DEFAULT: none paced) is obeyed as given."""
    from megatron_hyscale.layers.qsa import QSA_ATTENTION_OPTIONS
    from megatron_hyscale.ops.kernels.options import AttentionKernelOptions

    _, ours, mcfg, _ = build_pair(deterministic_mode=False)
    core = ours.core_attention
    mcfg.attention_kernel_options = None
    assert core._attention_options() is QSA_ATTENTION_OPTIONS
    assert QSA_ATTENTION_OPTIONS.dkv_lockstep
    assert not (QSA_ATTENTION_OPTIONS.dq_lockstep or QSA_ATTENTION_OPTIONS.fwd_lockstep)
    assert core._paced()
    mcfg.attention_kernel_options = AttentionKernelOptions.DEFAULT
    assert core._attention_options() is AttentionKernelOptions.DEFAULT
    assert not core._paced()


def test_a_wrong_selection_is_caught():
    """The comparison can fail: dropping one selected block changes the output."""
    hf, ours, mcfg, hcfg = build_pair()
    x, dy = inputs(70)
    hf_out, _, _ = run_hf(hf, hcfg, x, dy)
    core = ours.core_attention
    original = core._select_blocks

    def drop_first(*args, **kwargs):
        blocks = original(*args, **kwargs).clone()
        blocks[..., 0] = -1
        return blocks

    core._select_blocks = drop_first
    out, _, _ = run_ours(ours, hcfg, x, dy)
    assert (out - hf_out).abs().max() > 1e-3


def test_replay_under_checkpoint_computes_once_and_is_bit_identical():
    _, ours, mcfg, hcfg = build_pair()
    ours.train()
    x, dy = inputs(70)
    replay.reset_stats()
    plain = run_ours(ours, hcfg, x, dy)
    assert replay.get_stats()["selections_computed"] == 1
    replay.reset_stats()
    ckpt = run_ours(ours, hcfg, x, dy, checkpoint=True)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 1 and stats["selections_replayed"] == 1
    replay.assert_drained()
    assert torch.equal(ckpt[0], plain[0]) and torch.equal(ckpt[1], plain[1])
    for name, grad in plain[2].items():
        assert torch.equal(ckpt[2][name], grad), name


def test_baseline_recomputes_the_selection_without_replay():
    _, hys, mcfg, hcfg = build_pair()
    _, base, _, _ = build_pair(baseline=True)
    x, dy = inputs(70)
    expected = run_ours(hys, hcfg, x, dy)
    replay.reset_stats()
    got = run_ours(base, hcfg, x, dy, checkpoint=True)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 2 and stats["selections_replayed"] == 0
    replay.assert_drained()
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-6)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-6)


def test_selective_core_attn_recompute_replays():
    _, ours, mcfg, hcfg = build_pair(recompute_granularity="selective",
                                  recompute_modules=["core_attn"])
    _, plain_model, _, _ = build_pair()
    ours.train()
    assert ours.checkpoint_core_attention
    x, dy = inputs(70)
    expected = run_ours(plain_model, hcfg, x, dy)
    replay.reset_stats()
    got = run_ours(ours, hcfg, x, dy)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 1 and stats["selections_replayed"] == 1
    assert torch.equal(got[0], expected[0])
    for name, grad in expected[2].items():
        assert torch.equal(got[2][name], grad), name


def test_indexer_loss_is_off_by_default_and_trains_only_the_indexer_when_on():
    _, plain, mcfg, hcfg = build_pair()
    _, with_loss, _, _ = build_pair(qsa_indexer_loss_coeff=0.5)
    x, dy = inputs(70)
    expected = run_ours(plain, hcfg, x, dy)
    assert not any(".indexer." in n for n in expected[2])
    got = run_ours(with_loss, hcfg, x, dy)
    indexer = {n: g for n, g in got[2].items() if ".indexer." in n}
    assert set(indexer) == {f"core_attention.indexer.{p}.weight"
                            for p in ("linear_qk", "q_layernorm", "k_layernorm")}
    assert all(g.abs().max() > 0 for g in indexer.values())
    # The loss does not touch the main model: same output, input and main-weight gradients.
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for name, grad in expected[2].items():
        assert torch.equal(got[2][name], grad), name


def test_weight_mapping_round_trips():
    hf, _, mcfg, hcfg = build_pair()
    state = hf.state_dict()
    back = megatron_to_hf_qsa_state_dict(hf_to_megatron_qsa_state_dict(state, mcfg), mcfg)
    assert set(back) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(back[name], value, rtol=0, atol=1e-7)


def test_core_attention_class_and_parameter_names():
    _, ours, _, _ = build_pair()
    assert isinstance(ours.core_attention, HyScaleQSAttention)
    assert sorted(n for n, _ in ours.named_parameters()) == sorted([
        "linear_qkv.weight", "linear_proj.weight", "q_layernorm.weight", "k_layernorm.weight",
        "core_attention.indexer.linear_qk.weight", "core_attention.indexer.q_layernorm.weight",
        "core_attention.indexer.k_layernorm.weight",
    ])


def smallest_index_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties broken by the smaller index (HyTopK's order)."""
    assert largest
    values, order = torch.sort(self, dim=dim, descending=True, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), order.narrow(dim, 0, k)))


GEOMETRIES = {
    # Qwen3.8-Flash-Next's heads (24 / 2 of 256, RoPE on 64 dims, indexer 4 x 128) on a small
    # hidden size and budget (16 blocks), T = 90 (22 complete blocks + 2 tokens).
    "flash-next-heads": dict(T=90, hidden_size=128, num_heads=24, num_kv_heads=2, head_dim=256,
                             partial_rotary_factor=0.25, indexer_heads=4,
                             indexer_head_dim=128, budget=64),
    # Full RoPE on the whole indexer head, 3 query heads per KV head, a 3-block budget.
    "full-rope-gqa3": dict(T=45, hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8,
                           partial_rotary_factor=1.0, indexer_heads=4, indexer_head_dim=8,
                           budget=12),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_other_geometries_match_transformers(name, monkeypatch):
    """Ties at the cut-off are likely here: transformers gets the smallest-index topk."""
    geometry = dict(GEOMETRIES[name])
    T = geometry.pop("T")
    hf, ours, mcfg, hcfg = build_pair(**geometry)
    x, dy = inputs(T, hidden=geometry["hidden_size"])
    monkeypatch.setattr(torch.Tensor, "topk", smallest_index_topk)
    hf_out, hf_dx, hf_grads = run_hf(hf, hcfg, x, dy)
    monkeypatch.undo()
    out, dx, grads = run_ours(ours, hcfg, x, dy)
    assert hf_out.abs().max() > 0.1
    torch.testing.assert_close(out, hf_out, rtol=RTOL, atol=ATOL)
    # 24 heads of 256: more fp32 terms per gradient entry (a few of ~1e6 differ by ~1.5e-5).
    torch.testing.assert_close(dx, hf_dx, rtol=1e-4, atol=5e-5)
    assert_grads_match(grads, hf_grads, mcfg, atol=5e-5)


def test_ties_at_the_cutoff_match_a_smallest_index_topk(monkeypatch):
    """A seed with zero-score ties at the cut-off: transformers with a tie-deterministic topk
    (smaller block first, HyTopK's documented order) matches HyScale exactly."""
    hf, ours, mcfg, hcfg = build_pair(seed=1)
    x, dy = inputs(70, seed=1)
    assert not no_ties_at_cutoff(ours, hcfg, x), "this seed should have ties at the cut-off"
    monkeypatch.setattr(torch.Tensor, "topk", smallest_index_topk)
    hf_out, hf_dx, hf_grads = run_hf(hf, hcfg, x, dy)
    monkeypatch.undo()
    out, dx, grads = run_ours(ours, hcfg, x, dy)
    torch.testing.assert_close(out, hf_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dx, hf_dx, rtol=1e-4, atol=1e-5)
    assert_grads_match(grads, hf_grads, mcfg)


def test_baseline_chunked_rows_select_the_same_blocks(monkeypatch):
    from megatron_hyscale.layers import qsa

    _, hys, mcfg, hcfg = build_pair()
    _, base, _, _ = build_pair(baseline=True)
    x, dy = inputs(70)
    expected = run_ours(hys, hcfg, x, dy)
    # 2 x 4 heads x 17 blocks per row: 5 query rows per chunk.
    monkeypatch.setattr(qsa, "BASELINE_CHUNK_ELEMENTS", B * 4 * 17 * 5)
    got = run_ours(base, hcfg, x, dy)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_indexer_loss_value_is_the_block_kl(sparse):
    """The optional loss: KL(target || softmax(indexer block scores)) over visible blocks,
    target = main attention over block-mean keys, softmax per head, summed, L1-normalized."""
    coeff = 0.5
    _, ours, mcfg, hcfg = build_pair(qsa_indexer_loss_coeff=coeff,
                                  qsa_indexer_use_sparse_loss=sparse)
    core = ours.core_attention
    captured = {}
    original = core._indexer_loss

    def spy(*args):
        captured["args"], captured["loss"] = args, original(*args)
        return captured["loss"]

    core._indexer_loss = spy
    x, dy = inputs(70)
    run_ours(ours, hcfg, x, dy)
    q_idx, keys, query, key, blocks, qpos = (a.detach() for a in captured["args"][:6])
    Bn, T, Hq, hn = query.shape
    nb, hkv = keys.shape[1], key.shape[2]
    kbar = key[:, : nb * 4].reshape(Bn, nb, 4, hkv, hn).mean(2)
    kbar = kbar.repeat_interleave(Hq // hkv, dim=2)  # [B, nb, Hq, hn]
    visible = (torch.arange(nb, device=DEVICE) * 4 + 3)[None, :] <= qpos[:, None]  # [T, nb]
    if sparse:
        chosen = torch.zeros(Bn, T, nb + 1, dtype=torch.bool, device=DEVICE)
        chosen.scatter_(-1, torch.where(blocks >= 0, blocks, nb).long(), True)
        visible = visible & chosen[..., :nb]
    else:
        visible = visible.expand(Bn, T, nb)
    logits = torch.einsum("bthd,bnhd->bthn", query, kbar) * core.softmax_scale
    probs = logits.masked_fill(~visible[:, :, None], float("-inf")).softmax(-1).nan_to_num()
    target = probs.sum(2)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-10)
    scores = block_scores(q_idx, keys, core.index_scale)
    logp = scores.masked_fill(~visible, float("-inf")).log_softmax(-1)
    logp = logp.masked_fill(~visible, 0.0).nan_to_num()
    kl = (target * (target.clamp_min(1e-10).log() - logp)).sum()
    torch.testing.assert_close(captured["loss"].detach(), coeff * kl / (Bn * T),
                               rtol=1e-5, atol=1e-7)
    assert captured["loss"] > 0
    logged = DSAIndexerLossLoggingHelper.tracker["values"]
    torch.testing.assert_close(logged, captured["loss"].detach().reshape(1))


def test_a_causal_mask_is_accepted_and_other_masks_are_refused():
    _, ours, mcfg, hcfg = build_pair()
    x, _ = inputs(21)
    xs, freqs = x.transpose(0, 1), rope(hcfg, 21)
    with torch.no_grad():
        expected = ours(xs, None, rotary_pos_emb=freqs)[0]
        causal = torch.ones(21, 21, dtype=torch.bool, device=DEVICE).triu(1)
        causal = causal.expand(B, 1, 21, 21)
        assert torch.equal(ours(xs, causal, rotary_pos_emb=freqs)[0], expected)
        padded = causal.clone()
        padded[0, :, :, :2] = True  # left padding in the first sequence
        with pytest.raises(NotImplementedError, match="causal mask"):
            ours(xs, padded, rotary_pos_emb=freqs)


def test_bf16_runs_and_stays_near_fp32():
    """bf16 parameters and inputs: finite, bf16 output near the fp32 layer's (loose: rounding
    can also move a block across the cut-off, which the fp32 tests cover exactly)."""
    _, ours32, mcfg, hcfg = build_pair()
    _, ours16, _, _ = build_pair(params_dtype=torch.bfloat16)
    x, dy = inputs(70)
    out32 = run_ours(ours32, hcfg, x, dy)[0]
    out16, dx16, grads16 = run_ours(ours16, hcfg, x.bfloat16(), dy.bfloat16())
    assert out16.dtype == torch.bfloat16 and bool(torch.isfinite(out16).all())
    assert bool(torch.isfinite(dx16).all()) and all(bool(torch.isfinite(g).all())
                                                    for g in grads16.values())
    err = (out16.float() - out32).abs()
    assert float(err.median()) < 2e-2 * float(out32.abs().max())


@pytest.mark.parametrize("bad", [dict(budget=30), dict(attention_dropout=0.1),
                                 dict(attention_output_gate=False), dict(indexer_heads=0)])
def test_config_rejects_what_qsa_cannot_do(bad):
    with pytest.raises(ValueError):
        tiny_qsa_configs(**bad)

"""QSA layers in a megatron-core GPTModel (specs.qsa): recompute + replay, baseline, hybrid spec.

Gated DeltaNet cannot be instantiated here (megatron-core's GatedDeltaNet needs the `fla`
package and a Transformer Engine fused norm + linear): the hybrid 3 GDN : 1 QSA spec is checked
for its layout only; the models that run are QSA in every layer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from hyscale_bench.models import default_device
from megatron_hyscale import replay
from megatron_hyscale.layers.qsa import (
    HyScaleQSASelfAttention,
    HyScaleQSAttention,
    HyTopKBlockSelector,
    ScoreTableBlockSelector,
)
from megatron_hyscale.specs.qsa import get_qsa_block_spec, get_qsa_layer_specs
from megatron_hyscale.testing.qsa import tiny_qsa_configs

DEVICE = default_device()
VOCAB, T, B = 97, 70, 2
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def build(*, baseline: bool = False, **overrides) -> GPTModel:
    """On the GPU where there is one; deterministic_mode (no fp32 atomics in the kernels'
    backward) so that the bitwise comparisons below hold there too."""
    cfg, _ = tiny_qsa_configs(num_layers=2, deterministic_mode=True, **overrides)
    torch.manual_seed(7)
    return GPTModel(
        config=cfg, transformer_layer_spec=get_qsa_block_spec(cfg, baseline=baseline),
        vocab_size=VOCAB, max_sequence_length=T, position_embedding_type="rope",
        rotary_percent=0.5, rotary_base=10000, share_embeddings_and_output_weights=False,
    ).to(DEVICE)


def step(model: GPTModel, n_micro: int = 1):
    """Forwards of n micro-batches, then their backwards (a pipeline stage's order)."""
    model.train()
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(3)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    losses = []
    for _ in range(n_micro):
        ids = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
        labels = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
        losses.append(model(ids, pos, None, labels=labels).mean())
    for loss in losses:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack([x.detach() for x in losses]), grads


def test_gpt_full_recompute_replays_each_layer_and_matches_no_recompute():
    reference = build()
    expected_loss, expected = step(reference, n_micro=2)
    model = build(**FULL)
    model.load_state_dict(reference.state_dict())
    assert sum(isinstance(m, HyScaleQSAttention) for m in model.modules()) == 2
    replay.reset_stats()
    loss, got = step(model, n_micro=2)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 2 * 2 and stats["selections_replayed"] == 2 * 2
    replay.assert_drained()
    assert torch.equal(loss, expected_loss)
    assert set(got) == set(expected) and not any(".indexer." in n for n in got)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")


def smallest_index_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties broken by the smaller index (HyTopK's order); values first."""
    assert largest
    values, order = torch.sort(self, dim=dim, descending=True, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), order.narrow(dim, 0, k)))


def test_gpt_baseline_matches_hyscale_on_the_same_weights(monkeypatch):
    """The baseline's torch.topk may pick other zero-score blocks at a tied cut-off (the
    ReLU'd block scores of random weights tie at 0 often): it gets a tie-deterministic topk."""
    monkeypatch.setattr(torch.Tensor, "topk", smallest_index_topk)
    hyscale = build()
    baseline = build(baseline=True, **FULL)
    baseline.load_state_dict(hyscale.state_dict())
    expected_loss, expected = step(hyscale)
    replay.reset_stats()
    loss, got = step(baseline)
    stats = replay.get_stats()  # 2 layers, each selecting in its forward and its recompute
    assert stats["selections_computed"] == 4 and stats["selections_replayed"] == 0
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


def test_hybrid_spec_is_three_gated_deltanet_to_one_qsa():
    cfg, _ = tiny_qsa_configs(num_layers=8, experimental_attention_variant="gated_delta_net",
                              linear_attention_freq=4, linear_num_key_heads=2,
                              linear_num_value_heads=2, linear_key_head_dim=16,
                              linear_value_head_dim=16, linear_conv_kernel_dim=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = get_qsa_layer_specs(cfg)
    kinds = [s.submodules.self_attention.module for s in specs]
    assert kinds == [GatedDeltaNet] * 3 + [HyScaleQSASelfAttention] + \
        [GatedDeltaNet] * 3 + [HyScaleQSASelfAttention]
    assert specs[3].submodules.self_attention is specs[7].submodules.self_attention
    # With local linears megatron's GatedDeltaNet has no fused norm + linear: say so.
    assert any("GatedDeltaNet" in str(w.message) for w in caught)


def test_qsa_spec_rejects_a_config_without_the_output_gate():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hyscale.specs.qsa import get_qsa_attention_spec

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                            qk_layernorm=True, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="QSATransformerConfig"):
        get_qsa_attention_spec(cfg)


@pytest.mark.parametrize("baseline", [False, True], ids=["hyscale", "baseline"])
def test_spec_entry_points_build_the_same_model(baseline):
    from megatron_hyscale.specs.qsa import baseline_qsa_layer_spec, hyscale_qsa_layer_spec

    reference = build(baseline=baseline)
    cfg = reference.config
    torch.manual_seed(7)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=baseline_qsa_layer_spec if baseline else hyscale_qsa_layer_spec,
        vocab_size=VOCAB, max_sequence_length=T, position_embedding_type="rope",
        rotary_percent=0.5, rotary_base=10000, share_embeddings_and_output_weights=False,
    ).to(DEVICE)
    assert list(model.state_dict()) == list(reference.state_dict())
    model.load_state_dict(reference.state_dict())
    cores = [m for m in model.modules() if isinstance(m, HyScaleQSAttention)]
    kind = ScoreTableBlockSelector if baseline else HyTopKBlockSelector
    assert len(cores) == 2 and all(type(c.selector) is kind for c in cores)
    assert all(c.selection_replay.replays is not baseline for c in cores)
    assert torch.equal(step(model)[0], step(reference)[0])

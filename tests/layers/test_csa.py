"""HyScaleV4Attention (window / CSA / HCA) against transformers' DeepseekV4Attention.

Same weights (`testing.deepseek_v4.load_from_transformers`), fp32, tiny sizes, positions
0..T-1. Forward output, input gradient and every parameter gradient are compared; a parameter
transformers never uses (its grad is None: the indexer, whose top-k cuts the graph, or a
compressor with no complete window yet) must get no or an all-zero gradient here. Inputs are
continuous random values: transformers' torch.topk is not tie-deterministic.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import tensor_parallel

import megatron_hyscale.layers.deepseek_v4 as csa_module
from megatron_hyscale import replay
from megatron_hyscale.layers.deepseek_v4 import HyScaleV4Attention, window_indices
from megatron_hyscale.ops.compress import default_inv_freq

dsv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from hyscale_bench.models import randomize_  # noqa: E402
from megatron_hyscale.testing.deepseek_v4 import (  # noqa: E402
    hf_to_hyscale_name,
    load_from_transformers,
    tiny_v4_configs,
    transformers_attention_forward,
)

TOL = dict(rtol=1e-4, atol=1e-5)
WINDOW, CSA_M, HCA_M, TOPK = 5, 4, 8, 3


def build_pair(layer: int, seed: int = 0, **cfg_overrides):
    """(ours, transformers' module, transformers' config) for layer kind 0 / 1 / 2."""
    ours_cfg, hf_cfg = tiny_v4_configs(csa_ratio=CSA_M, hca_ratio=cfg_overrides.pop("hca", HCA_M),
                                       window=cfg_overrides.pop("window", WINDOW),
                                       index_topk=cfg_overrides.pop("index_topk", TOPK),
                                       **cfg_overrides)
    hf = dsv4.DeepseekV4Attention(hf_cfg, layer)
    randomize_(hf, seed=seed)
    ours = HyScaleV4Attention(ours_cfg, layer_number=layer + 1)
    load_from_transformers(ours, hf)
    return ours, hf, hf_cfg


def run_ours(ours, x: torch.Tensor) -> torch.Tensor:
    """[B, T, h] in and out (the module itself is [s, b, h])."""
    return ours(x.transpose(0, 1))[0].transpose(0, 1)


def compare(ours, hf, hf_cfg, T: int, B: int = 2, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, hf_cfg.hidden_size, generator=g, requires_grad=True)
    ref = transformers_attention_forward(hf, hf_cfg, x)
    xo = x.detach().clone().requires_grad_(True)
    got = run_ours(ours, xo)
    torch.testing.assert_close(got, ref, **TOL)
    r = torch.randn(ref.shape, generator=g)
    (ref * r).sum().backward()
    (got * r).sum().backward()
    torch.testing.assert_close(xo.grad, x.grad, **TOL)
    theirs = {hf_to_hyscale_name(n): p for n, p in hf.named_parameters()}
    compared = 0
    for name, p in ours.named_parameters():
        expected = theirs[name].grad
        if expected is None:
            assert p.grad is None or not p.grad.any(), f"{name}: unexpected gradient"
            continue
        assert p.grad is not None, f"{name}: missing gradient"
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        compared += 1
    assert compared >= 8  # the attention's own parameters at least


@pytest.mark.parametrize("T", [3, 23])
def test_window_layer_matches_transformers(T):
    ours, hf, cfg = build_pair(0)
    assert ours.compressor is None and ours.indexer is None
    compare(ours, hf, cfg, T)


@pytest.mark.parametrize("T", [3, 23, 37])
def test_csa_layer_matches_transformers(T):
    """T = 3: nothing compressed; 23, 37: not multiples of 4, early rows see < top-k entries."""
    ours, hf, cfg = build_pair(1, seed=T)
    assert ours.is_csa
    compare(ours, hf, cfg, T)


@pytest.mark.parametrize("T,hca", [(5, HCA_M), (29, HCA_M), (270, 128)])
def test_hca_layer_matches_transformers(T, hca):
    ours, hf, cfg = build_pair(2, seed=T, hca=hca)
    assert ours.compressor is not None and ours.indexer is None
    compare(ours, hf, cfg, T)


def test_csa_selection_is_transformers_indexer_selection(monkeypatch):
    """The compressed entries attended are exactly transformers' indexer picks (as sets)."""
    T, B = 37, 2
    ours, hf, cfg = build_pair(1, seed=3)
    seen = []
    real = csa_module.sparse_attention

    def spy(q, k, v, indices, *args, **kwargs):
        seen.append(indices)
        return real(q, k, v, indices, *args, **kwargs)

    monkeypatch.setattr(csa_module, "sparse_attention", spy)
    x = torch.randn(B, T, cfg.hidden_size)
    with torch.no_grad():
        run_ours(ours, x)
        pos = torch.arange(T).expand(B, T)
        q_residual = hf.q_a_norm(hf.q_a_proj(x))
        expected = hf.compressor.indexer(x, q_residual, pos, None, 1)  # [B, T, k], -1 invalid
    n_entries = T // CSA_M
    picked = seen[0][..., :TOPK]  # [selected compressed ; window]
    assert (picked < n_entries).all()
    for b in range(B):
        for t in range(T):
            want = {int(i) for i in expected[b, t] if i >= 0}
            assert {int(i) for i in picked[b, t] if i >= 0} == want, (b, t)
            assert len(want) == min(TOPK, (t + 1) // CSA_M)
    # The window part is the last WINDOW raw tokens, offset past the compressed entries.
    assert torch.equal(seen[0][0, :, TOPK:], window_indices(T, WINDOW, n_entries, x.device))


def _checkpointed_grads(ours, x, r):
    xo = x.detach().clone().requires_grad_(True)
    ours.zero_grad(set_to_none=True)
    out = tensor_parallel.checkpoint(lambda h: ours(h)[0], False, xo.transpose(0, 1))
    (out.transpose(0, 1) * r).sum().backward()
    return xo.grad, {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}


def test_csa_replay_under_checkpoint_computes_once_and_matches():
    T = 37
    ours, _, cfg = build_pair(1, seed=5)
    x = torch.randn(2, T, cfg.hidden_size)
    r = torch.randn(2, T, cfg.hidden_size)
    xo = x.clone().requires_grad_(True)
    (run_ours(ours, xo) * r).sum().backward()
    expected = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    replay.reset_stats()
    x_grad, grads = _checkpointed_grads(ours, x, r)
    assert replay.get_stats()["selections_computed"] == 1
    assert replay.get_stats()["selections_replayed"] == 1
    assert replay.pending_entries() == 0
    torch.testing.assert_close(x_grad, xo.grad, rtol=0, atol=0)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0)


def test_baseline_mode_equals_hyscale_mode_and_does_not_replay():
    T = 37
    ours, _, cfg = build_pair(1, seed=7)
    base, _, _ = build_pair(1, seed=7, v4_baseline=True, v4_baseline_row_block=8)
    assert base.selector == csa_module.ScoreTableEntrySelector(row_block=8)
    assert isinstance(ours.selector, csa_module.HyTopKEntrySelector)
    assert not base.selection_replay.replays and ours.selection_replay.replays
    x = torch.randn(2, T, cfg.hidden_size)
    r = torch.randn(2, T, cfg.hidden_size)
    replay.reset_stats()
    g_ours = _checkpointed_grads(ours, x, r)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 1 and stats["selections_replayed"] == 1
    replay.reset_stats()
    g_base = _checkpointed_grads(base, x, r)
    stats = replay.get_stats()
    assert stats["selections_computed"] == 2 and stats["selections_replayed"] == 0
    torch.testing.assert_close(g_base[0], g_ours[0], **TOL)
    for name, grad in g_ours[1].items():
        torch.testing.assert_close(g_base[1][name], grad, **TOL)


@pytest.mark.parametrize("sparse", [True, False])
def test_indexer_kl_loss_option_trains_only_the_indexer(sparse):
    T = 37
    ours, _, cfg = build_pair(1, seed=9, v4_indexer_loss_coeff=0.5,
                              v4_indexer_use_sparse_loss=sparse)
    plain, _, _ = build_pair(1, seed=9)
    x = torch.randn(2, T, cfg.hidden_size)
    r = torch.randn(2, T, cfg.hidden_size)
    out = run_ours(ours, x.clone().requires_grad_(True))
    out_plain = run_ours(plain, x.clone().requires_grad_(True))
    torch.testing.assert_close(out, out_plain, rtol=0, atol=0)  # the loss leaves the output
    (out * r).sum().backward()
    (out_plain * r).sum().backward()
    plain_grads = dict(plain.named_parameters())
    for name, p in ours.named_parameters():
        if name.startswith("indexer."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            assert plain_grads[name].grad is None, name  # off by default: no indexer gradient
        else:
            torch.testing.assert_close(p.grad, plain_grads[name].grad, rtol=0, atol=0)
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_yarn_compress_rope_matches_transformers(layer):
    """V4-Flash's checkpoint asks for YaRN on the compress RoPE (CSA / HCA layers only)."""
    yarn = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
            "beta_slow": 1.0}
    ours, hf, cfg = build_pair(layer, seed=11, yarn=yarn)
    rotary = dsv4.DeepseekV4RotaryEmbedding(cfg)
    kind = "compress" if layer else "main"
    torch.testing.assert_close(ours.inv_freq, getattr(rotary, f"{kind}_inv_freq"), rtol=1e-6,
                               atol=0)
    if layer:  # the scaling really changes the frequencies
        assert not torch.allclose(ours.inv_freq, default_inv_freq(8, cfg.compress_rope_theta))
    compare(ours, hf, cfg, 37)


@pytest.mark.parametrize("layer", [1, 2])
def test_v4_flash_head_geometry_matches_transformers(layer):
    """V4-Flash's per-head sizes (512 / rope 64, indexer 128 / rope 64) with few heads."""
    geometry = dict(hidden_size=64, num_attention_heads=2, head_dim=512, rope_dim=64,
                    q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=4,
                    index_head_dim=128)
    ours, hf, cfg = build_pair(layer, seed=13, geometry=geometry, window=8, index_topk=4)
    compare(ours, hf, cfg, 45, B=1)


def test_csa_replay_is_fifo_over_micro_batches_in_flight():
    """Two checkpointed forwards, then their backwards in order (a pipeline stage's view)."""
    T = 37
    ours, _, cfg = build_pair(1, seed=15)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, T, cfg.hidden_size, generator=g) for _ in range(2)]
    rs = [torch.randn(2, T, cfg.hidden_size, generator=g) for _ in range(2)]
    for x, r in zip(xs, rs, strict=True):
        (run_ours(ours, x) * r).sum().backward()
    expected = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    ours.zero_grad(set_to_none=True)
    replay.reset_stats()
    # Reentrant checkpointing needs an input that requires grad (as hidden states do).
    outs = [tensor_parallel.checkpoint(lambda h: ours(h)[0], False,
                                       x.transpose(0, 1).requires_grad_(True)) for x in xs]
    assert replay.pending_entries() == 2
    for out, r in zip(outs, rs, strict=True):
        (out.transpose(0, 1) * r).sum().backward()
    stats = replay.get_stats()
    assert stats["selections_computed"] == 2 and stats["selections_replayed"] == 2
    assert replay.pending_entries() == 0
    for name, grad in expected.items():
        torch.testing.assert_close(ours.get_parameter(name).grad, grad, rtol=1e-6, atol=1e-7)

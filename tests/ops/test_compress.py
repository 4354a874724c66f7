"""V4 compressors (CSA overlapping, HCA) and interleaved RoPE against transformers' DeepseekV4."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.ops.compress import (
    apply_interleaved_rope,
    compress,
    compress_overlapping,
    compressed_key_positions,
    compressed_visible_count,
    default_inv_freq,
    rope_cos_sin,
)

dsv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from hyscale_bench.models import randomize_  # noqa: E402
from megatron_hyscale.testing.deepseek_v4 import tiny_v4_configs  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


def _ours(hf: torch.nn.Module, x: torch.Tensor, eps: float, overlap: bool) -> torch.Tensor:
    """Our compressor on the oracle's own projections and parameters."""
    fn = compress_overlapping if overlap else compress
    inv_freq = hf.rotary_emb.compress_inv_freq
    return fn(hf.kv_proj(x), hf.gate_proj(x), hf.position_bias, hf.compress_rate,
              norm_weight=hf.kv_norm.weight, eps=eps, inv_freq=inv_freq)


@pytest.mark.parametrize("T", [3, 4, 17, 24])
def test_csa_compressor_matches_transformers_forward_and_backward(T):
    _, cfg = tiny_v4_configs(csa_ratio=4)
    hf = dsv4.DeepseekV4CSACompressor(cfg)
    randomize_(hf, seed=T)
    x = torch.randn(2, T, cfg.hidden_size, requires_grad=True)
    q_residual = torch.randn(2, T, cfg.q_lora_rank)
    pos = torch.arange(T).expand(2, T)
    ref = hf(x, q_residual, pos, None, 0)[0].squeeze(1)  # [B, N, D]
    xo = x.detach().clone().requires_grad_(True)
    got = _ours(hf, xo, cfg.rms_norm_eps, overlap=True)
    assert got.shape == (2, T // 4, cfg.head_dim)
    torch.testing.assert_close(got, ref, **TOL)
    if T < 4:
        return
    r = torch.randn_like(ref)
    params = [hf.kv_proj.weight, hf.gate_proj.weight, hf.position_bias, hf.kv_norm.weight]
    g_ref = torch.autograd.grad((ref * r).sum(), [x, *params])
    g_got = torch.autograd.grad((got * r).sum(), [xo, *params])
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("T,ratio", [(7, 8), (29, 8), (300, 128)])
def test_hca_compressor_matches_transformers_forward_and_backward(T, ratio):
    _, cfg = tiny_v4_configs(hca_ratio=ratio)
    hf = dsv4.DeepseekV4HCACompressor(cfg)
    randomize_(hf, seed=T)
    x = torch.randn(2, T, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(T).expand(2, T)
    ref = hf(x, None, pos, None, 0)[0].squeeze(1)
    xo = x.detach().clone().requires_grad_(True)
    got = _ours(hf, xo, cfg.rms_norm_eps, overlap=False)
    assert got.shape == (2, T // ratio, cfg.head_dim)
    torch.testing.assert_close(got, ref, **TOL)
    if T < ratio:
        return
    r = torch.randn_like(ref)
    params = [hf.kv_proj.weight, hf.gate_proj.weight, hf.position_bias, hf.kv_norm.weight]
    g_ref = torch.autograd.grad((ref * r).sum(), [x, *params])
    g_got = torch.autograd.grad((got * r).sum(), [xo, *params])
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_overlap_reads_the_previous_window():
    """Entry i depends on window i-1's Ca half and not on window i+1: width 2m, stride m."""
    torch.manual_seed(0)
    D, m = 4, 4
    kv = torch.randn(1, 16, 2 * D, requires_grad=True)
    gate, bias = torch.randn(1, 16, 2 * D), torch.randn(m, 2 * D)
    out = compress_overlapping(kv, gate, bias, m, norm_weight=None, eps=1e-6, inv_freq=None)
    (grad,) = torch.autograd.grad(out[0, 2].sum(), kv)
    touched = grad[0].abs().sum(-1) > 0
    assert touched.tolist() == [False] * 4 + [True] * 8 + [False] * 4
    assert (grad[0, 4:8, D:] == 0).all() and (grad[0, 8:12, :D] == 0).all()


def test_interleaved_rope_matches_transformers_and_inverts():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 16)
    inv_freq = default_inv_freq(8, 10000.0)
    cos, sin = rope_cos_sin(torch.arange(7), inv_freq)
    ref = dsv4.apply_rotary_pos_emb(x.transpose(1, 2), cos[None], sin[None]).transpose(1, 2)
    got = apply_interleaved_rope(x, cos, sin, heads=True)
    torch.testing.assert_close(got, ref, **TOL)
    assert torch.equal(got[..., :8], x[..., :8])  # only the trailing rope channels turn
    back = apply_interleaved_rope(got, cos, sin, heads=True, inverse=True)
    torch.testing.assert_close(back, x, **TOL)


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_key_positions_encode_the_visibility_rule(ratio):
    """k_pos[s] <= t  <=>  s < floor((t + 1) / ratio), for every (t, s)."""
    T = 3 * ratio + 5
    t = torch.arange(T).unsqueeze(1)
    s = torch.arange(T // ratio + 2).unsqueeze(0)
    rule = s < compressed_visible_count(t, ratio)
    via_positions = compressed_key_positions(s.shape[1], ratio).unsqueeze(0) <= t
    assert torch.equal(rule, via_positions)

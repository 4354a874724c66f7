"""ops.compress.apply_interleaved_rope: the plain-op rotation's values and gradients, bit for
bit, with one gradient tensor in backward instead of three."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.ops.compress import apply_interleaved_rope, rope_cos_sin


def plain(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: bool,
          inverse: bool) -> torch.Tensor:
    """The slice / rotate / cat form the autograd Function replaces."""
    r = 2 * cos.shape[-1]
    if heads:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-r], x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat([nope, rotated.flatten(-2).to(x.dtype)], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,inverse", [(False, False), (True, False), (True, True)])
def test_matches_plain_ops_bitwise(dtype, heads, inverse):
    g = torch.Generator().manual_seed(0)
    B, T, H, D, R = 2, 7, 3, 24, 8
    shape = (B, T, H, D) if heads else (B, T, D)
    x = torch.randn(shape, generator=g).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(T) * 3, 1.0 / (50.0 ** (torch.arange(R // 2) / R)))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = apply_interleaved_rope(xa, cos, sin, heads=heads, inverse=inverse)
    yb = plain(xb, cos, sin, heads, inverse)
    ya.backward(grad)
    yb.backward(grad)
    assert ya.dtype == dtype and ya.is_contiguous()
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)


def test_saves_only_the_angles():
    x = torch.randn(4, 16, 2, 32, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(16), torch.ones(4))
    y = apply_interleaved_rope(x, cos, sin, heads=True)
    assert [t.shape for t in y.grad_fn.saved_tensors] == [cos.unsqueeze(-2).shape] * 2
    y.backward(torch.ones_like(y))
    assert x.grad.shape == x.shape

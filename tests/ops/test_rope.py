"""ops.compress.apply_interleaved_rope: the plain-op rotation's values and gradients, bit for
bit (the torch path and the Triton kernel, under the interpreter here), with one gradient tensor
in backward instead of three."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_hyscale.ops.compress import apply_interleaved_rope, rope_cos_sin
from megatron_hyscale.testing.inspect_sm90 import run_inspect_sm90


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


def with_signed_zeros(x: torch.Tensor) -> torch.Tensor:
    """x with a few +0 and -0 entries (the rotation must keep torch's signs of zero)."""
    x = x.clone()
    flat = x.view(-1)
    flat[::7] = 0.0
    flat[3::11] = -0.0
    return x


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,inverse,batched", [(False, False, False), (True, False, False),
                                                   (True, True, False), (True, False, True),
                                                   (False, True, True)])
def test_matches_plain_ops_bitwise(dtype, heads, inverse, batched, kernel):
    g = torch.Generator().manual_seed(0)
    B, T, H, D, R = 2, 7, 3, 24, 8
    shape = (B, T, H, D) if heads else (B, T, D)
    x = with_signed_zeros(torch.randn(shape, generator=g).to(dtype))
    if heads:  # non-contiguous: heads and time swapped in memory
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    grad = with_signed_zeros(torch.randn(shape, generator=g).to(dtype))
    positions = torch.arange(T) * 3
    if batched:  # packed documents: each sequence its own positions (one angle exactly 0)
        positions = torch.stack([positions, torch.arange(T).flip(0)])
    cos, sin = rope_cos_sin(positions, 1.0 / (50.0 ** (torch.arange(R // 2) / R)))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = apply_interleaved_rope(xa, cos, sin, heads=heads, inverse=inverse, kernel=kernel)
    yb = plain(xb, cos, sin, heads, inverse)
    ya.backward(grad)
    yb.backward(grad)
    assert ya.dtype == dtype and ya.is_contiguous()
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # signs of zero included
    assert torch.equal(ya.view(bits), yb.view(bits))
    # The plain form's backward sums its slices' zero-filled gradients (-0 becomes +0): equal
    # values; bit for bit between the torch path's rotation and the kernel's.
    assert torch.equal(xa.grad, xb.grad)
    xc = x.clone().requires_grad_()
    apply_interleaved_rope(xc, cos, sin, heads=heads, inverse=inverse,
                           kernel="torch").backward(grad)
    assert torch.equal(xa.grad.view(bits), xc.grad.view(bits))


def test_saves_only_the_angles():
    x = torch.randn(4, 16, 2, 32, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(16), torch.ones(4))
    y = apply_interleaved_rope(x, cos, sin, heads=True)
    assert [t.shape for t in y.grad_fn.saved_tensors] == [cos.shape] * 2
    y.backward(torch.ones_like(y))
    assert x.grad.shape == x.shape


def test_bad_shapes_and_kernel_names_are_refused():
    cos, sin = rope_cos_sin(torch.arange(5), torch.ones(2))
    x = torch.randn(2, 5, 3, 8)
    with pytest.raises(ValueError, match="cos and sin must be"):
        apply_interleaved_rope(x, cos[:4], sin[:4], heads=True)
    with pytest.raises(ValueError, match="cos and sin must be"):
        apply_interleaved_rope(x, cos.expand(3, 5, 2), sin.expand(3, 5, 2), heads=True)
    with pytest.raises(ValueError, match=r"x must be \[B, T, H, D\]"):
        apply_interleaved_rope(x[:, :, 0], cos, sin, heads=True)
    with pytest.raises(ValueError, match="even number"):
        apply_interleaved_rope(torch.randn(2, 5, 3, 7), cos, sin, heads=True)
    with pytest.raises(ValueError, match="kernel must be"):
        apply_interleaved_rope(x, cos, sin, heads=True, kernel="cuda")


def test_the_kernel_rounds_each_product_when_compiled(tmp_path):
    """Compiled for sm_90a (scripts/inspect_sm90.py, no GPU needed), the kernel keeps torch's
    roundings: the fp32 products and sums as separate FMUL / FADD, no FFMA (a fused
    multiply-add skips the product's rounding, which the interpreter would not show)."""
    proc = run_inspect_sm90("--preset", "interleaved-rope-bf16", "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sass,) = [f.read_text() for f in tmp_path.glob("interleaved-rope-*.sass")]
    assert re.search(r"\bFMUL\b", sass) and re.search(r"\bFADD\b", sass)
    assert not re.search(r"\bFFMA\b", sass)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_on_cuda_is_the_torch_rotation_bitwise():
    """V4-Flash's query (64 heads x 512, 64 rotary) and its compressed entries (no head axis,
    per-sequence positions): the default on CUDA (the kernel) equals the torch path bit for
    bit, forward and backward, inverse too."""
    g = torch.Generator(device="cuda").manual_seed(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(32, device="cuda") / 32))
    for shape, heads, batched in (((2, 1024, 64, 512), True, False), ((2, 4096, 512), False, True)):
        x = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        grad = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        T = shape[1]
        positions = torch.arange(T, device="cuda") * 4 + 3
        if batched:
            positions = torch.stack([positions, torch.arange(T, device="cuda")])
        cos, sin = rope_cos_sin(positions, inv_freq)
        for inverse in (False, True):
            got = {}
            for kernel in ("auto", "torch"):
                xa = x.clone().requires_grad_()
                y = apply_interleaved_rope(xa, cos, sin, heads=heads, inverse=inverse,
                                           kernel=kernel)
                y.backward(grad)
                got[kernel] = (y.view(torch.int16), xa.grad.view(torch.int16))
            assert torch.equal(got["auto"][0], got["torch"][0]), (shape, inverse)
            assert torch.equal(got["auto"][1], got["torch"][1]), (shape, inverse)

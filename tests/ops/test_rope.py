"""ops.compress.apply_interleaved_rope: the plain-op rotation's values and gradients, bit for
bit (the torch path and the Triton kernel, under the interpreter here), with one gradient tensor
in backward instead of three; ops.compress.rms_norm_rope: the norm and the rotation in one
kernel, bit for bit the two ops under the interpreter (to rounding on the GPU)."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch

from megatron_hyscale.ops.compress import apply_interleaved_rope, rms_norm_rope, rope_cos_sin
from megatron_hyscale.ops.rms_norm import rms_norm
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


def norm_then_rope(x, w, cos, sin, heads, kernel):
    """The two ops rms_norm_rope replaces, with their values and x's (and w's) gradients."""
    norm = "triton" if kernel == "triton" else "chunked"
    return apply_interleaved_rope(rms_norm(x, w, 1e-6, kernel=norm), cos, sin, heads=heads,
                                  kernel=kernel)


def values_and_grads(fn, x, w, grad):
    xa = x.clone().requires_grad_()
    wa = None if w is None else w.clone().requires_grad_()
    y = fn(xa, wa)
    y.backward(grad)
    return [t.view(torch.int16) for t in (y, xa.grad)] + ([] if wa is None else [wa.grad])


def norm_rope_inputs(heads: bool, batched: bool, weight_dtype: torch.dtype | None):
    g = torch.Generator().manual_seed(4)
    B, T, H, D, R = 2, 15, 3, 24, 8
    shape = (B, T, H, D) if heads else (B, T * 8, D)
    x = with_signed_zeros(torch.randn(shape, generator=g)).to(torch.bfloat16)
    x[0, 1] = 0.0
    if heads:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    w = None if weight_dtype is None else (torch.rand(D, generator=g) + 0.5).to(weight_dtype)
    grad = with_signed_zeros(torch.randn(shape, generator=g)).to(torch.bfloat16)
    positions = torch.arange(shape[1]) * 4
    if batched:
        positions = torch.stack([positions, torch.arange(shape[1]).flip(0)])
    cos, sin = rope_cos_sin(positions, 1.0 / (50.0 ** (torch.arange(R // 2) / R)))
    return x, w, grad, cos, sin


NORM_ROPE_CASES = [(True, False, None), (True, True, None), (False, True, torch.float32),
                   (False, False, torch.bfloat16)]


@pytest.mark.parametrize("heads,batched,weight_dtype", NORM_ROPE_CASES)
def test_rms_norm_rope_is_the_two_kernels_bitwise(heads, batched, weight_dtype):
    """Under the interpreter, values and gradients (x's, the weight's) bit for bit the Triton
    norm then the Triton rotation: V4's query form (heads, no weight) and the compressed
    entries' (a weight, per-sequence positions), signed zeros, a zero row, more row blocks than
    the backward's programs, x's heads and time swapped in memory."""
    x, w, grad, cos, sin = norm_rope_inputs(heads, batched, weight_dtype)
    got = values_and_grads(lambda a, b: rms_norm_rope(a, b, 1e-6, cos, sin, heads=heads,
                                                      kernel="triton"), x, w, grad)
    want = values_and_grads(lambda a, b: norm_then_rope(a, b, cos, sin, heads, "triton"), x,
                            w, grad)
    assert len(got) == len(want) == (2 if w is None else 3)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("heads,batched,weight_dtype", NORM_ROPE_CASES)
def test_rms_norm_rope_on_the_torch_path_is_the_plain_form(heads, batched, weight_dtype):
    """kernel="torch": the plain fp32 norm, rounded, then the plain slice / rotate / cat form,
    to the norm's rounding (its mean may sum in another order); the gradients to bf16
    tolerance."""
    x, w, grad, cos, sin = norm_rope_inputs(heads, batched, weight_dtype)

    def plain_norm_rope(a, b):
        af = a.float()
        y = af * torch.rsqrt(af.square().mean(-1, keepdim=True) + 1e-6)
        y = (y if b is None else y * b.float()).to(a.dtype)
        return plain(y, cos, sin, heads, False)

    got = values_and_grads(lambda a, b: rms_norm_rope(a, b, 1e-6, cos, sin, heads=heads,
                                                      kernel="torch"), x, w, grad)
    want = values_and_grads(plain_norm_rope, x, w, grad)
    (ya, dxa), (yb, dxb) = ([t.view(torch.bfloat16) for t in v[:2]] for v in (got, want))
    torch.testing.assert_close(ya, yb, atol=1.6e-2, rtol=8e-3)
    torch.testing.assert_close(dxa, dxb, atol=2e-2, rtol=2e-2)
    if w is not None:
        torch.testing.assert_close(got[2].float(), want[2].float(), atol=0.1, rtol=2e-2)


def test_rms_norm_rope_refuses_bad_inputs():
    cos, sin = rope_cos_sin(torch.arange(5), torch.ones(2))
    x = torch.randn(2, 5, 3, 8)
    with pytest.raises(ValueError, match="cos and sin must be"):
        rms_norm_rope(x, None, 1e-6, cos[:4], sin[:4], heads=True)
    with pytest.raises(ValueError, match=r"x must be \[B, T, D\]"):
        rms_norm_rope(x, None, 1e-6, cos, sin)
    with pytest.raises(ValueError, match="kernel must be"):
        rms_norm_rope(x, None, 1e-6, cos, sin, heads=True, kernel="chunked")
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm_rope(x, torch.ones(7), 1e-6, cos, sin, heads=True)
    from megatron_hyscale.ops.kernels.rms_norm import Rope

    with pytest.raises(ValueError, match="rope runs on the Triton kernels only"):
        rms_norm(x, None, 1e-6, kernel="chunked", rope=Rope(cos, sin, 3))
    # rms_norm's own rope argument is checked against x too
    bf16 = torch.bfloat16
    for rope, match in ((Rope(cos[:4], sin[:4], 3), "cos and sin must be"),
                        (Rope(cos, sin, 2), "heads 2"),
                        (Rope(cos.double(), sin.double(), 3), "fp32"),
                        (Rope(cos.expand(3, 5, 2), sin.expand(3, 5, 2), 3), "cos and sin must be"),
                        (Rope(torch.ones(5, 8), torch.ones(5, 8), 3), "the rope dim 16")):
        with pytest.raises(ValueError, match=match):
            rms_norm(x.to(bf16), None, 1e-6, kernel="triton", rope=rope)


def test_the_norm_kernels_round_each_product_when_compiled(tmp_path):
    """The norm with its RoPE epilogue compiled for sm_90a: no FFMA in the forward or the
    backward (the separate rotation rounds each product; the fused form must too)."""
    proc = run_inspect_sm90("--preset", "rms-norm-rope-bf16", "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    sass = [f.read_text() for f in sorted(tmp_path.glob("rms-norm-rope-*.sass"))]
    assert len(sass) == 2  # forward, backward
    for text in sass:
        assert re.search(r"\bFMUL\b", text) and re.search(r"\bFADD\b", text)
        assert not re.search(r"\bFFMA\b", text)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_rope_on_cuda_is_the_two_kernels_to_rounding():
    """V4-Flash's query (64 heads x 512, 64 rotary, no weight) and its compressed entries (a
    weight, per-sequence positions): the fused kernel against the Triton norm then the Triton
    rotation, and against the chunked norm then the torch rotation. The same formulas, but the
    compiler may lay the row sums out differently in the two compiled kernels (another fp32
    sum order: measured on an H100, 2026-12-06, the values equal, the gradients not bit for
    bit), so: values within one bf16 rounding (of the pair's inputs: absolute where the turn
    cancels) on fewer than 1% of elements, gradients to bf16 tolerance."""
    g = torch.Generator(device="cuda").manual_seed(1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(32, device="cuda") / 32))
    for shape, heads, batched in (((1, 2048, 64, 512), True, False),
                                  ((2, 4096, 512), False, True)):
        x = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        w = None if heads else (torch.rand(512, device="cuda", generator=g) + 0.5)
        grad = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
        positions = torch.arange(shape[1], device="cuda") * 4
        if batched:
            positions = torch.stack([positions, torch.arange(shape[1], device="cuda")])
        cos, sin = rope_cos_sin(positions, inv_freq)
        got = values_and_grads(partial(rms_norm_rope, eps=1e-6, cos=cos, sin=sin, heads=heads),
                               x, w, grad)
        for kernel in ("triton", "torch"):
            want = values_and_grads(partial(norm_then_rope, cos=cos, sin=sin, heads=heads,
                                            kernel=kernel), x, w, grad)
            (ya, dxa), (yb, dxb) = ([t.view(torch.bfloat16) for t in v[:2]] for v in (got, want))
            torch.testing.assert_close(ya, yb, atol=1.6e-2, rtol=8e-3)
            assert (ya != yb).float().mean() < 0.01, (shape, kernel)
            torch.testing.assert_close(dxa, dxb, atol=2e-2, rtol=2e-2)
            if w is not None:
                torch.testing.assert_close(got[2], want[2], atol=0.5, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_rope_past_two_to_the_31_elements_on_cuda():
    """V4's query past 2^31 elements (65,544 tokens x 64 heads x 512), the layer's path at 128K:
    the last tokens' values and gradients are the two ops' on those tokens alone."""
    T, tail = 2**16 + 8, 16
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, T, 64, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    grad = torch.randn(x.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(T, device="cuda"),
                            1.0 / (10000.0 ** (torch.arange(32, device="cuda") / 32)))
    xa = x.requires_grad_()
    y = rms_norm_rope(xa, None, 1e-6, cos, sin, heads=True)
    y.backward(grad)
    xt = x[:, -tail:].detach().clone().requires_grad_()
    want = norm_then_rope(xt, None, cos[-tail:], sin[-tail:], True, "triton")
    want.backward(grad[:, -tail:])
    torch.testing.assert_close(y[:, -tail:], want, atol=1.6e-2, rtol=8e-3)
    torch.testing.assert_close(xa.grad[:, -tail:], xt.grad, atol=2e-2, rtol=2e-2)


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

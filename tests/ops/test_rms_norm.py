"""ops.rms_norm: values and gradients of the plain fp32 form (the chunked torch ops, torch's
fused kernels and HyScale's Triton kernels, the latter under the interpreter on the CPU); saves
only x and a scale a row."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.ops import rms_norm as rms_module
from megatron_hyscale.ops.rms_norm import rms_norm


def plain(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (out if weight is None else out * weight.float()).to(x.dtype)


@pytest.mark.parametrize("kernel", ["chunked", "fused", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [False, True])
def test_matches_plain_form_values_and_grads(monkeypatch, dtype, with_weight, kernel):
    # 3 rows a chunk: 2 x 5 x 3 = 30 rows in 10 chunks, the last dim a transposed (strided) view
    monkeypatch.setattr(rms_module, "CHUNK_BYTES", 3 * 4 * 12)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, 12, 3, generator=g).to(dtype)
    x = base.permute(0, 1, 3, 2)  # [2, 5, 3, 12], non-contiguous
    assert not x.is_contiguous()
    w = (torch.rand(12, generator=g) + 0.5).to(dtype) if with_weight else None
    grad = torch.randn(x.shape, generator=g).to(dtype)

    xa = x.detach().clone().requires_grad_()
    wa = None if w is None else w.detach().clone().requires_grad_()
    ya = rms_norm(xa, wa, 1e-6, kernel=kernel)
    ya.backward(grad)
    xb = x.detach().clone().requires_grad_()
    wb = None if w is None else w.detach().clone().requires_grad_()
    yb = plain(xb, wb, 1e-6)
    yb.backward(grad)

    assert ya.dtype == dtype and ya.shape == x.shape
    # the same fp32 ops row by row; the mean may sum in another order (1-ulp differences)
    torch.testing.assert_close(ya, yb, atol=0, rtol=1e-6 if dtype == torch.float32 else 8e-3)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    if with_weight:
        torch.testing.assert_close(wa.grad, wb.grad, **tol)


def saved_beside_x(x: torch.Tensor, **kwargs) -> int:
    """Bytes autograd saves for rms_norm(x) other than x itself (asserted saved, not copied)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x, None, 1e-6, **kwargs)
    assert any(t.data_ptr() == x.data_ptr() for t in saved)
    return sum(t.numel() * t.element_size() for t in saved if t.data_ptr() != x.data_ptr())


@pytest.mark.parametrize("kernel", ["chunked", "fused", "triton"])
def test_saves_only_the_input_and_a_scale_per_row(kernel):
    x = torch.randn(64, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    assert saved_beside_x(x, kernel=kernel) == 64 * 8 * 4  # rstd: one fp32 a row


@pytest.mark.parametrize("with_weight", [False, True])
def test_inputs_over_one_fused_launch_go_in_row_chunks(monkeypatch, with_weight):
    """Past FUSED_MAX_ELEMENTS (torch's kernels index a row in 32 bits) the fused kernels run
    on row chunks, each under the limit, with the single launch's values and gradients; a
    weighted norm that large they refuse (the Triton kernels take it)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 16, generator=g).to(torch.bfloat16)
    w = (torch.rand(16, generator=g) + 0.5).to(torch.bfloat16) if with_weight else None
    grad = torch.randn(x.shape, generator=g).to(torch.bfloat16)

    def run():
        xa = x.clone().requires_grad_()
        y = rms_norm(xa, w, 1e-6, kernel="auto" if with_weight else "fused")
        y.backward(grad)
        return y, xa.grad

    want = run()
    fwd, bwd = rms_module._FUSED
    sizes = []
    monkeypatch.setattr(rms_module, "_FUSED", (
        lambda x2, *a: sizes.append(x2.numel()) or fwd(x2, *a),
        lambda g2, x2, *a: sizes.append(x2.numel()) or bwd(g2, x2, *a)))
    monkeypatch.setattr(rms_module, "FUSED_MAX_ELEMENTS", 5 * 16 + 3)  # 5 rows a launch
    if with_weight:
        with pytest.raises(ValueError, match="more than one fused launch takes"):
            rms_norm(x, w, 1e-6, kernel="fused")
        return
    got = run()
    assert sizes == [80, 80, 80, 48] * 2  # 18 rows: 5 + 5 + 5 + 3, forward then backward
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,rows_strided", [(24, False), (24, True), (3000, False)])
def test_the_triton_kernels_over_many_row_blocks(weight_dtype, width, rows_strided):
    """More row blocks than the backward's persistent programs (each adds several blocks into
    its weight-gradient row), widths that are no power of two (3000: two rows a block), rows
    of x a strided view (their stride passed to the kernels, no copy), a weight of x's or
    another dtype (fp32 with bf16 x: the fused kernel declines that one) and not contiguous,
    a zero row and signed zeros (their signs kept): the plain form's values and gradients."""
    g = torch.Generator().manual_seed(5)
    lead = (40, 7) if width < 1000 else (3, 5)  # 280 rows in 18 blocks of 16; 15 in 8 of 2
    x = torch.randn(*lead, width + 8, generator=g).to(torch.bfloat16)
    x = x[..., :width] if rows_strided else x[..., :width].contiguous()
    x[1, 2] = 0.0
    x[2, 1, ::3] = -0.0
    w = None
    if weight_dtype is not None:
        w = (torch.rand(2 * width, generator=g) + 0.5).to(weight_dtype)[::2]
    grad = torch.randn(x.shape, generator=g).to(torch.bfloat16)
    got, want = [], []
    for fn, out in ((lambda a, b: rms_norm(a, b, 1e-6, kernel="triton"), got),
                    (lambda a, b: plain(a, b, 1e-6), want)):
        xa = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)
        xa.requires_grad_()
        wa = None if w is None else w.clone().requires_grad_()
        y = fn(xa, wa)
        y.backward(grad)
        out += [y, xa.grad] + ([] if wa is None else [wa.grad])
    assert got[0].dtype == torch.bfloat16
    zeros = x == 0
    assert torch.equal(got[0][zeros].view(torch.int16), want[0][zeros].view(torch.int16))
    assert (got[0][zeros].view(torch.int16) < 0).any()  # some -0.0 kept
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=8e-3)
    torch.testing.assert_close(got[1], want[1], atol=2e-2, rtol=2e-2)
    if w is not None:
        assert got[2].dtype == weight_dtype
        torch.testing.assert_close(got[2].float(), want[2].float(), atol=0.1, rtol=2e-2)


def test_rows_too_wide_for_the_triton_kernels():
    x = torch.randn(2, 16385)
    with pytest.raises(ValueError, match="rows of 16385 channels, wider than"):
        rms_norm(x, None, 1e-6, kernel="triton")
    torch.testing.assert_close(rms_norm(x, None, 1e-6), plain(x, None, 1e-6))  # chunked


def test_the_triton_kernel_off_cuda_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(rms_module, "triton_interpret", lambda: False)
    with pytest.raises(ValueError, match="kernel='triton' got x on cpu"):
        rms_norm(torch.randn(4, 8), None, 1e-6, kernel="triton")


def test_rejects_a_weight_of_the_wrong_width():
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(4, 8), torch.ones(7), 1e-6)


def test_auto_runs_the_chunked_ops_off_cuda(monkeypatch):
    calls = []
    for fn in (rms_module._FusedRMSNorm, rms_module._TritonRMSNorm):
        monkeypatch.setattr(fn, "apply", lambda *a, fn=fn: calls.append(fn))
    rms_norm(torch.randn(4, 8), None, 1e-6)
    assert calls == []
    rms_norm(torch.randn(4, 8), None, 1e-6, kernel="fused")
    rms_norm(torch.randn(4, 8), None, 1e-6, kernel="triton")
    assert calls == [rms_module._FusedRMSNorm, rms_module._TritonRMSNorm]


def test_bad_kernel_names_and_a_missing_fused_kernel_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="kernel must be"):
        rms_norm(torch.randn(4, 8), None, 1e-6, kernel="cuda")
    with pytest.raises(ValueError, match="weight's dtype torch.float32 is not the input's"):
        rms_norm(torch.randn(4, 8).bfloat16(), torch.ones(8), 1e-6, kernel="fused")
    monkeypatch.setattr(rms_module, "_FUSED", None)
    with pytest.raises(ValueError, match="_fused_rms_norm"):
        rms_norm(torch.randn(4, 8), None, 1e-6, kernel="fused")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel,weight_dtype", [
    ("fused", None), ("fused", torch.bfloat16), ("triton", None), ("triton", torch.bfloat16),
    ("triton", torch.float32)])
def test_the_cuda_kernels_are_the_chunked_form_to_rounding(kernel, weight_dtype):
    """V4-Flash's query norm (64 heads x 512, no weight) and the compressor's weighted norm (a
    weight of x's dtype, or fp32, which torch's fused kernel declines): torch's fused kernels
    and HyScale's Triton ones within one bf16 rounding of the chunked form's values (fp32 sums
    in another order), gradients to bf16 tolerance, x and rstd saved only."""
    g = torch.Generator(device="cuda").manual_seed(2)
    shape = (1, 2048, 64, 512) if weight_dtype is None else (2, 4096, 512)
    x = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    w = None if weight_dtype is None else \
        (torch.rand(shape[-1], device="cuda", generator=g) + 0.5).to(weight_dtype)
    grad = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    outs = {}
    for name in (kernel, "chunked"):
        xa = x.clone().requires_grad_()
        wa = None if w is None else w.clone().requires_grad_()
        y = rms_norm(xa, wa, 1e-6, kernel=name)
        y.backward(grad)
        outs[name] = (y, xa.grad, None if wa is None else wa.grad)
    (ya, dxa, dwa), (yb, dxb, dwb) = outs[kernel], outs["chunked"]
    rows = x.numel() // shape[-1]
    assert saved_beside_x(x.clone().requires_grad_(), kernel=kernel) == rows * 4
    torch.testing.assert_close(ya, yb, atol=0, rtol=8e-3)
    assert (ya != yb).float().mean() < 0.01  # a few 1-ulp differences at most
    torch.testing.assert_close(dxa, dxb, atol=2e-2, rtol=2e-2)
    if w is not None:
        assert dwa.dtype == weight_dtype
        torch.testing.assert_close(dwa.float(), dwb.float(), atol=0.5, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_runs_the_triton_kernels_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(rms_module._TritonRMSNorm, "apply", lambda *a: calls.append(a) or a[0])
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    rms_norm(x, None, 1e-6)
    rms_norm(x, torch.ones(512, device="cuda"), 1e-6)  # an fp32 weight too
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["fused", "triton"])
def test_more_than_two_to_the_31_elements_on_cuda(kernel):
    """V4's query norm past 2^31 elements (65K tokens x 64 heads x 512): the fused kernels in
    row chunks (torch 2.11's index a row in 32 bits), the Triton ones in one launch (64-bit
    offsets); the last rows' values and gradients are the plain form's on those rows."""
    rows, width = 2**22 + 8, 512
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, width, device="cuda", generator=g, dtype=torch.bfloat16)
    grad = torch.randn(rows, width, device="cuda", generator=g, dtype=torch.bfloat16)
    xa = x.requires_grad_()
    y = rms_norm(xa, None, 1e-6, kernel=kernel)
    y.backward(grad)
    tail = slice(rows - 1024, rows)
    xt = x[tail].detach().clone().requires_grad_()
    want = plain(xt, None, 1e-6)
    want.backward(grad[tail])
    torch.testing.assert_close(y[tail], want, atol=0, rtol=8e-3)
    torch.testing.assert_close(xa.grad[tail], xt.grad, atol=2e-2, rtol=2e-2)

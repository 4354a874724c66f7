"""ops.rms_norm: values and gradients of the plain fp32 form; saves only x and a scale a row."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.ops import rms_norm as rms_module
from megatron_hyscale.ops.rms_norm import rms_norm


def plain(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (out if weight is None else out * weight.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [False, True])
def test_matches_plain_form_values_and_grads(monkeypatch, dtype, with_weight):
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
    ya = rms_norm(xa, wa, 1e-6)
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


def test_saves_only_the_input_and_a_scale_per_row():
    x = torch.randn(64, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x, None, 1e-6)
    new_bytes = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() != x.data_ptr())
    assert new_bytes == 64 * 8 * 4  # rstd: one fp32 a row; x itself is not a copy
    assert any(t.data_ptr() == x.data_ptr() for t in saved)


def test_rejects_a_weight_of_the_wrong_width():
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(4, 8), torch.ones(7), 1e-6)

"""Packed THD test helpers: PackedSeqParams for documents, a training step of an attention layer
and the per-document reference (the layer on each document alone) it is compared with."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)


def cu_seqlens(lengths: Sequence[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]."""
    return [0, *torch.tensor(list(lengths)).cumsum(0).tolist()]


def document_prefix_rows(valid: Sequence[int], stored: Sequence[int],
                         device: torch.device | str | None = None) -> torch.Tensor:
    """int64 packed rows of each document's first `valid` rows, the documents occupying
    `stored` rows each (back to back), on `device` (default the CPU)."""
    return torch.cat([torch.arange(a, a + n, device=device)
                      for a, n in zip(cu_seqlens(stored)[:-1], valid, strict=True)])


def prefix_mask(valid: Sequence[int], stored: Sequence[int],
                device: torch.device | str | None = None) -> torch.Tensor:
    """bool [sum(stored)]: True at each document's first `valid` rows (a real_token_mask_q that
    leaves the other rows out of the indexer loss), on `device` (default the CPU)."""
    mask = torch.zeros(sum(stored), dtype=torch.bool, device=device)
    mask[document_prefix_rows(valid, stored, device)] = True
    return mask


def thd_params(lengths: Sequence[int], padded: Sequence[int] | None = None,
               device: torch.device | str | None = None) -> PackedSeqParams:
    """megatron's PackedSeqParams of documents of `lengths` (and `padded` storage rows)."""
    cu = torch.tensor(cu_seqlens(lengths), dtype=torch.int32, device=device)
    extra = {}
    if padded is not None:
        pad = torch.tensor(cu_seqlens(padded), dtype=torch.int32, device=device)
        extra = dict(cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad)
    longest = max(padded or lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest, **extra)


class Step(NamedTuple):
    out: torch.Tensor  # [T, 1, h]
    x_grad: torch.Tensor
    grads: dict[str, torch.Tensor]
    logged: float  # the indexer loss in megatron's tracker (0 without one)


def train_step(layer: torch.nn.Module, call: Callable[[torch.Tensor], torch.Tensor],
               x: torch.Tensor, r: torch.Tensor, recompute: bool = False) -> Step:
    """call(x) (the layer's output) and the backward of sum(out * r), under megatron's
    checkpoint with `recompute`."""
    layer.train()
    layer.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    h = x.clone().requires_grad_()
    out = tensor_parallel.checkpoint(call, False, h) if recompute else call(h)
    (out * r).sum().backward()
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    logged = float(values.sum()) if values is not None else 0.0
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return Step(out.detach(), h.grad, grads, logged)


def joined(steps: Sequence[Step]) -> Step:
    """Documents' steps as one packed step: rows concatenated, gradients and losses summed."""
    grads: dict[str, torch.Tensor] = {}
    for step in steps:
        for name, grad in step.grads.items():
            grads[name] = grads[name] + grad if name in grads else grad
    return Step(torch.cat([s.out for s in steps]), torch.cat([s.x_grad for s in steps]), grads,
                sum(s.logged for s in steps))


# On CUDA a packed run and each document's own run multiply matrices of other row counts, for
# which cuBLAS picks other kernels (other summation orders), and the kernels' fp32 atomics add in
# any order: the two agree to a few roundings of each tensor's scale, not elementwise to a fixed
# atol (2026-12-03 on the H200: up to 1.7e-6 against 1e-6, elementwise relative 1e-4 near zero).
# A wrong row or document is off by the tensor's own scale.
CUDA_SCALE_REL = 1e-4


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float,
                 what: str = "") -> None:
    """torch.testing.assert_close, on CUDA with both tolerances at least CUDA_SCALE_REL of the
    expected tensor's largest magnitude (see there); on the CPU exactly as given."""
    if want.is_cuda and want.numel():
        scale = want.abs().max().item()
        rtol, atol = max(rtol, CUDA_SCALE_REL), max(atol, CUDA_SCALE_REL * scale)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                               msg=(lambda m: f"{what}: {m}") if what else None)


def assert_steps_close(got: Step, want: Step, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert_close(got.out, want.out, rtol, atol, "output")
    assert_close(got.x_grad, want.x_grad, rtol, atol, "input gradient")
    assert set(got.grads) == set(want.grads)
    for name in want.grads:
        assert_close(got.grads[name], want.grads[name], rtol, 1e-5, name)
    assert math.isclose(got.logged, want.logged, rel_tol=rtol, abs_tol=1e-7), \
        f"indexer loss {got.logged} != {want.logged}"


def check_prefix_mask(run: Callable[[torch.Tensor, torch.Tensor, PackedSeqParams], Step],
                      alone: Callable[[torch.Tensor, torch.Tensor, Sequence[int], int | None],
                                      Step],
                      x: torch.Tensor, r: torch.Tensor, lengths: Sequence[int],
                      valid: Sequence[int], *, padded: Sequence[int] | None = None,
                      per_token: bool = False, indexer: str = "indexer.",
                      atol: float = 1e-6) -> None:
    """A layer's packed step with each document's rows after its first `valid` left out of the
    indexer loss (real_token_mask_q) against its references (`assert_mask_changes_the_loss_only`).

    run(x, r, params): the layer's packed training step (`train_step`); alone(x, r, lengths,
    coeff_share): the layer on each document of x alone, joined, each document's indexer-loss
    coefficient scaled by its rows / coeff_share (None: unscaled, per-token). Documents of
    `lengths` (stored in `padded` rows each where given, cu_seqlens_q_padded); the loss
    weights r are zeroed on the masked rows. atol: the outputs' and the input gradients'
    against the alone runs (`assert_steps_close`). The rows, the mask and the cu_seqlens are
    made on x's device, the layer's: megatron's RoPE and the layer read them with x.
    """
    stored, device = padded or lengths, x.device
    rows = document_prefix_rows(valid, stored, device)
    r_valid = torch.zeros_like(r)
    r_valid[rows] = r[rows]
    masked = thd_params(lengths, padded, device)
    masked.real_token_mask_q = prefix_mask(valid, stored, device)
    got = run(x, r_valid, masked)
    want = alone(x[rows], r[rows], valid, None if per_token else sum(valid))
    assert want.logged > 0
    unmasked = run(x, r_valid, thd_params(lengths, padded, device))
    assert_mask_changes_the_loss_only(got, want, unmasked, rows, indexer, atol)


def assert_mask_changes_the_loss_only(masked: Step, alone: Step, unmasked: Step,
                                      valid_rows: torch.Tensor, indexer: str,
                                      atol: float = 1e-6) -> None:
    """A packed step with rows masked out of the indexer loss (real_token_mask_q; its loss
    weights zero on the masked rows) against
    - `alone`: the layer on each document's valid rows alone (joined; each document's rows-mean
      loss coefficient scaled by its share of the valid rows, as the masked mean weighs it):
      the valid rows' outputs and input gradients, every parameter gradient (the indexer's
      from the masked loss) and the logged loss; the masked rows get no input gradient;
    - `unmasked`: the same step without the mask: the same outputs on every row (the masked
      rows still select and attend), input gradient and gradients outside the indexer
      (parameter names containing `indexer`); the indexer's gradients and the logged loss
      differ (the mask changes the loss only, and this comparison can fail).
    """
    assert_steps_close(masked._replace(out=masked.out[valid_rows],
                                       x_grad=masked.x_grad[valid_rows]), alone, atol=atol)
    rest = torch.ones(masked.out.shape[0], dtype=torch.bool, device=masked.out.device)
    rest[valid_rows] = False
    assert bool(rest.any()), "the mask leaves no row out"
    assert bool((masked.x_grad[rest] == 0).all())
    assert torch.equal(masked.out, unmasked.out)
    assert_close(masked.x_grad, unmasked.x_grad, 1e-6, 1e-7, "input gradient, unmasked")
    assert set(masked.grads) == set(unmasked.grads)
    assert any(indexer in n for n in masked.grads), "the indexer loss never ran"
    for name, grad in masked.grads.items():
        if indexer not in name:
            assert_close(grad, unmasked.grads[name], 1e-6, 1e-7, f"{name}, unmasked")
    weights = [n for n in masked.grads if indexer in n]
    assert any(not torch.allclose(masked.grads[n], unmasked.grads[n]) for n in weights)
    assert not math.isclose(masked.logged, unmasked.logged, rel_tol=1e-4)

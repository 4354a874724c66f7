"""Test helpers for GPT models with multi-token-prediction (MTP) layers: which attention each
DSA layer runs, one training step, and HyScale's model against stock's on the same weights."""

from __future__ import annotations

import torch

from megatron_hyscale.testing.compare import assert_grads_close


def core_attention_types(module: torch.nn.Module | None) -> dict[str, type]:
    """Every attention layer's core attention below `module`: name -> class."""
    if module is None:
        return {}
    return {name: type(m) for name, m in module.named_modules()
            if name.endswith(".core_attention")}


def assert_dsa_everywhere(model: torch.nn.Module, expected: type) -> None:
    """The decoder and the MTP block both have DSA layers, each exactly `expected`."""
    from megatron_hyscale.layers.dsa import HyScaleDSAttention

    for part in ("decoder", "mtp"):
        kinds = core_attention_types(getattr(model, part, None))
        assert kinds, f"the model has no {part} attention"
        wrong = {name: kind.__name__ for name, kind in kinds.items() if kind is not expected}
        hyscale = "HyScale's" if expected is HyScaleDSAttention else expected.__name__
        assert not wrong, f"{part} layers not on {hyscale} DSA: {wrong}"


def mtp_step(model: torch.nn.Module, *, vocab: int, seq: int, batch: int = 2,
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward on seeded tokens and labels: the loss (the MTP layers' loss
    included, through megatron's MTP loss hook) and every parameter's gradient."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    labels = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    model.train()
    model.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    positions = torch.arange(seq, device=device).expand(batch, seq)
    loss = model(ids, positions, None, labels=labels).mean()
    loss.backward()
    DSAIndexerLossLoggingHelper.tracker.clear()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def assert_mtp_model_matches_stock(hyscale: torch.nn.Module, stock: torch.nn.Module, *,
                                   vocab: int, seq: int, what: str) -> None:
    """`stock` gets `hyscale`'s weights (same parameter names); one training step each gives
    the same loss and gradients, the MTP layers' included."""
    from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

    stock.load_state_dict(hyscale.state_dict(), strict=True)
    loss, grads = mtp_step(hyscale, vocab=vocab, seq=seq)
    with stock_topk_breaks_ties_by_index():
        expected_loss, expected_grads = mtp_step(stock, vocab=vocab, seq=seq)
    assert torch.isfinite(loss)
    assert any(n.startswith("mtp.") for n in expected_grads), "no MTP gradient"
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, expected_grads, rtol=1e-4, atol=1e-6, what=what)

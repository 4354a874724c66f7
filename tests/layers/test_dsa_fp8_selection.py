"""HyScaleDSAttention with config.hyscale_indexer_precision = "fp8": only the selection changes.

A tiny GPT (MLA + DSA, 2 layers, T = 256 > top-32, dense indexer loss) runs a training step
with the fp8 selection, then with the bf16 one, then bf16 again with the fp8 run's indices
replayed: the last must give the fp8 run's loss and gradients bit for bit, so the indexer loss
and every gradient path saw the same (unquantized) tensors and only the choice of keys differed.
"""

from __future__ import annotations

import pytest
import torch

import megatron_hyscale.layers.dsa as dsa_layer
from hyscale_bench.models import build_gpt, default_device, tiny_dsa_config
from megatron_hyscale.layers.kernel_backend import PRECISION_ENV

DEVICE = default_device()
VOCAB, T, B = 97, 256, 2


def train_step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean LM loss (forward + backward) on a fixed batch; returns the loss and the grads."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    labels = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def test_fp8_precision_changes_only_the_selection(monkeypatch):
    monkeypatch.delenv(PRECISION_ENV, raising=False)
    torch.manual_seed(1234)
    model = build_gpt(tiny_dsa_config(), stock=False, vocab_size=VOCAB, max_sequence_length=T)
    real_hytopk = dsa_layer.hytopk
    calls: list[tuple[str, torch.Tensor]] = []

    def spy(*args, **kwargs):
        out = real_hytopk(*args, **kwargs)
        if kwargs["precision"] == "fp8":  # the fp8 reference on the layer's indexer tensors
            want = real_hytopk(*args, **dict(kwargs, backend="reference"))
            assert torch.equal(out[0], want[0])
        calls.append((kwargs["precision"], out[0].clone()))
        return out

    monkeypatch.setattr(dsa_layer, "hytopk", spy)
    model.config.hyscale_indexer_precision = "fp8"
    loss_fp8, grads_fp8 = train_step(model)
    fp8_calls, calls[:] = list(calls), []
    assert [p for p, _ in fp8_calls] == ["fp8", "fp8"]  # one selection a layer

    model.config.hyscale_indexer_precision = "bf16"
    loss_bf16, _ = train_step(model)
    assert [p for p, _ in calls] == ["bf16", "bf16"]
    # Quantization moved some selections (else the replay below would prove nothing).
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(fp8_calls, calls, strict=True))
    assert not torch.equal(loss_fp8, loss_bf16)

    # bf16 with the fp8 run's indices: the same step bit for bit.
    replayed = iter([idx for _, idx in fp8_calls])
    monkeypatch.setattr(dsa_layer, "hytopk", lambda *a, **kw: (next(replayed), None))
    loss_replay, grads_replay = train_step(model)
    assert torch.equal(loss_replay, loss_fp8)
    assert set(grads_replay) == set(grads_fp8)
    indexer = [n for n in grads_fp8 if ".indexer." in n]
    assert indexer and any(grads_fp8[n].abs().sum() > 0 for n in indexer)
    for name, grad in grads_fp8.items():
        assert torch.equal(grads_replay[name], grad), name


def test_bad_precision_names_the_config_field(monkeypatch):
    monkeypatch.delenv(PRECISION_ENV, raising=False)
    torch.manual_seed(0)
    model = build_gpt(tiny_dsa_config(), stock=False, vocab_size=VOCAB, max_sequence_length=T)
    model.config.hyscale_indexer_precision = "fp4"
    with pytest.raises(ValueError, match="config.hyscale_indexer_precision"):
        train_step(model)

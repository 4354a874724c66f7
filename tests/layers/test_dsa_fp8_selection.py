"""HyScaleDSAttention with config.hyscale_indexer_precision = "fp8": only the selection changes.

A tiny GPT (MLA + DSA, 2 layers, T = 256 > top-32, dense indexer loss) runs a training step
and an eval forward (`test_dsa_layer.run_step`) with the fp8 selection, then with the bf16 one,
then bf16 again with the fp8 run's indices replayed: the last must give the fp8 run's loss,
logits, indexer losses and gradients bit for bit, so the indexer loss and every gradient path
saw the same (unquantized) tensors and only the choice of keys differed.

On the GPU the model runs in `deterministic_mode` (the backward kernels' fp32 atomics off, so
the replayed step can be bitwise), and the fp8 Triton selection is checked against the fp8
reference by its selected scores: the kernel and the reference sum the same products in a
different precision (the fp8 MMA's own adder), so keys whose scores nearly tie may swap (the
GPU op tests hold the indices exactly on integer-valued inputs).
"""

from __future__ import annotations

import pytest
import torch
from test_dsa_layer import VOCAB, T, run_step

import megatron_hyscale.layers.dsa as dsa_layer
from hyscale_bench.models import build_gpt, tiny_dsa_config
from megatron_hyscale.layers.kernel_backend import PRECISION_ENV


def test_fp8_precision_changes_only_the_selection(monkeypatch):
    monkeypatch.delenv(PRECISION_ENV, raising=False)
    torch.manual_seed(1234)
    on_gpu = torch.cuda.is_available()
    model = build_gpt(tiny_dsa_config(deterministic_mode=on_gpu), stock=False,
                      vocab_size=VOCAB, max_sequence_length=T)
    real_hytopk = dsa_layer.hytopk
    calls: list[tuple[str, torch.Tensor]] = []

    def spy(*args, **kwargs):
        out = real_hytopk(*args, **kwargs)
        if kwargs["precision"] == "fp8":  # the fp8 reference on the layer's indexer tensors
            want = real_hytopk(*args, **dict(kwargs, backend="reference"))
            if out[0].is_cuda:
                # The fp8 MMA sums a head's products in its own precision (about 14 bits),
                # the reference in fp32: selected scores agree to 1e-2 of the row's largest
                # selected |score| (measured on the H200: up to 8e-3 relative elementwise,
                # 5.5e-6 absolute). Not the top score: near a row's start the top can be
                # close to 0 while the other selected scores are large and negative.
                got_s, want_s = out[1].sort(-1).values, want[1].sort(-1).values
                assert torch.equal(out[0] < 0, want[0] < 0)
                finite = torch.isfinite(want_s)
                assert torch.equal(finite, torch.isfinite(got_s))
                scale = torch.where(finite, want_s.abs(), 0.0).amax(-1, keepdim=True)
                gap = torch.where(finite, (got_s - want_s).abs(), 0.0)
                assert (gap <= 1e-2 * scale.clamp_min(1e-6)).all()
            else:
                assert torch.equal(out[0], want[0])
        calls.append((kwargs["precision"], out[0].clone()))
        return out

    monkeypatch.setattr(dsa_layer, "hytopk", spy)
    model.config.hyscale_indexer_precision = "fp8"
    fp8_step = run_step(model)
    fp8_calls, calls[:] = list(calls), []
    assert [p for p, _ in fp8_calls] == ["fp8"] * 4  # a selection a layer a forward

    model.config.hyscale_indexer_precision = "bf16"
    bf16_step = run_step(model)
    assert [p for p, _ in calls] == ["bf16"] * 4
    # Quantization moved some selections (else the replay below would prove nothing).
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(fp8_calls, calls, strict=True))
    assert not torch.equal(fp8_step[0], bf16_step[0])

    # bf16 with the fp8 run's indices: the same step bit for bit.
    replayed = iter([idx for _, idx in fp8_calls])
    monkeypatch.setattr(dsa_layer, "hytopk", lambda *a, **kw: (next(replayed), None))
    *replay_outputs, grads_replay = run_step(model)
    *fp8_outputs, grads_fp8 = fp8_step
    for got, want in zip(replay_outputs, fp8_outputs, strict=True):  # loss, logits, KL losses
        assert torch.equal(got, want)
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
        run_step(model)

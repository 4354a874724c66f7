"""Row parts add the gradients of what they all read in fp32 (issue #23, 3; `layers.row_chunks`).

HyScale's row-chunked DSA (MLA) and DeepSeek-V4 attention run their query rows in checkpointed
parts that each read the whole key sequence, the indexer keys and weights shared by every row
(MLA's absorbed K / V up-projections, V4's attention sinks). Autograd adds the parts' gradient
addends in the tensor's dtype: in a bf16 model with 128 parts, 127 bf16 roundings of a growing
sum instead of one.

Oracle: the same bf16 model without row parts on the same weights and batch, where each op
call sums all rows' addends in fp32 and rounds once. With the parts' addends summed in fp32
(each part's addend rounded once), the chunked gradients stay within one bf16 rounding
(2^-8, normwise) of the unchunked ones (measured 1.4e-3 to 3.4e-3 here). Summed in bf16 (the
code before the fix) they were not: MLA's key gradient 6.9e-3, its kv up-projection 1.3e-2,
its indexer keys 6.3e-3; V4's keys 7.0e-3, its indexer keys 8.3e-3 (its sinks, 4 values each
a sum over every row, stayed within the bound either way).

Not covered, and not changed: megatron's linear modules called inside every part
(`linear_q_up_proj`, `linear_proj`, V4's `linear_q_b` and output projections). With megatron's
`gradient_accumulation_fusion` (Transformer Engine / megatron linears with DDP) each part's
weight gradient is added straight into the fp32 `main_grad`; with plain torch linears (as
here) autograd sums the parts in the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)

from hyscale_bench.models import build_gpt, default_device, tiny_dsa_config
from megatron_hyscale.layers.dsa import HyScaleDSAttention

DEVICE = default_device()
pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU test (bf16 reference ops)")

VOCAB, B = 97, 1
T, ROWS_PER_PART = 512, 4  # 128 parts
ONE_ROUNDING = 2.0 ** -8  # bf16's unit roundoff


def normwise(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def train_step(model: torch.nn.Module, seq: int) -> dict[str, torch.Tensor]:
    """One forward + backward on a fixed batch; every parameter gradient (and "key": the
    gradient of the DSA core's key input, where `capture_key` is on)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (B, seq), generator=g).to(DEVICE)
    labels = torch.randint(0, VOCAB, (B, seq), generator=g).to(DEVICE)
    pos = torch.arange(seq, device=DEVICE).expand(B, seq)
    model.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    model(ids, pos, None, labels=labels).float().mean().backward()
    DSAIndexerLossLoggingHelper.tracker.clear()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_parts_add_like_one_call(build: Callable[[int | None], torch.nn.Module], seq: int,
                                   watched: dict[str, str], extra: Callable[[], dict] = dict,
                                   ) -> dict[str, float]:
    """Chunked and unchunked bf16 models on one set of weights: each watched gradient (label ->
    parameter name or "key") within ONE_ROUNDING normwise."""
    whole = build(None)
    chunked = build(ROWS_PER_PART)
    chunked.load_state_dict(whole.state_dict())
    expected = {**train_step(whole, seq), **extra()}
    got = {**train_step(chunked, seq), **extra()}
    errors = {}
    for label, name in watched.items():
        assert got[name].dtype == torch.bfloat16, name
        assert expected[name].abs().sum() > 0, f"{label}: no gradient"
        errors[label] = normwise(got[name], expected[name])
    bad = {k: f"{v:.3g}" for k, v in errors.items() if v > ONE_ROUNDING}
    assert not bad, f"row parts' gradients beyond one bf16 rounding ({ONE_ROUNDING:.3g}) of " \
                    f"the unchunked layer's: {bad}"
    return errors


def keep_key_gradient(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str,
                      position: int) -> Callable[[], dict]:
    """Wraps `owner.name` to keep the gradient of its argument at `position` (the whole key
    sequence the attention reads, chunked or not); returns a function that takes it."""
    keys: list[torch.Tensor] = []
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args[position].retain_grad()
        keys.append(args[position])
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)

    def take() -> dict:
        assert len(keys) == 1, len(keys)  # one attention layer, one forward
        return {"key": keys.pop().grad}
    return take


def test_mla_row_parts_sum_shared_gradients_in_fp32(monkeypatch):
    # HyScaleDSAttention.prepare(self, key, ...): the (absorbed) key of all local rows
    key_gradient = keep_key_gradient(monkeypatch, HyScaleDSAttention, "prepare", 1)

    def build(row_chunk: int | None) -> torch.nn.Module:
        cfg = tiny_dsa_config(num_layers=1, params_dtype=torch.bfloat16, bf16=True,
                              dsa_indexer_use_sparse_loss=True, dsa_indexer_topk=64)
        torch.manual_seed(0)
        return build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T,
                         row_chunk=row_chunk)

    attn = "decoder.layers.0.self_attention."
    assert_parts_add_like_one_call(build, T, {
        "key": "key",
        "absorbed K / V up-projection": attn + "linear_kv_up_proj.weight",
        "indexer keys": attn + "core_attention.indexer.linear_wk.weight",
    }, key_gradient)


# V4 (one CSA layer with its indexer loss): the parts' shared tensors and what they feed.
V4_CASES = {
    "keys": "key",
    "attention sinks": "decoder.layers.0.self_attention.sinks",
    "indexer keys (its compressor)":
        "decoder.layers.0.self_attention.indexer.compressor.linear_kv.weight",
}


def test_v4_row_parts_sum_shared_gradients_in_fp32(monkeypatch):
    pytest.importorskip("transformers.models.deepseek_v4")
    from megatron.core.models.gpt import GPTModel

    from megatron_hyscale.layers import deepseek_v4
    from megatron_hyscale.specs.deepseek_v4 import get_v4_block_spec
    from megatron_hyscale.testing.deepseek_v4 import tiny_v4_configs

    def build(row_chunk: int | None) -> torch.nn.Module:
        cfg, _ = tiny_v4_configs(compress_ratios=[4], index_topk=16, window=16,
                                 v4_indexer_loss_coeff=0.1, v4_indexer_use_sparse_loss=True,
                                 params_dtype=torch.bfloat16, bf16=True, v4_row_chunk=row_chunk)
        torch.manual_seed(0)
        return GPTModel(config=cfg, transformer_layer_spec=get_v4_block_spec(cfg),
                        vocab_size=VOCAB, max_sequence_length=T, pre_process=True,
                        post_process=True, share_embeddings_and_output_weights=False,
                        position_embedding_type="none").to(DEVICE)

    # _RowInputs(q_latent, cos, sin, keys, ...): [compressed entries ; raw tokens]
    key_gradient = keep_key_gradient(monkeypatch, deepseek_v4, "_RowInputs", 3)
    assert_parts_add_like_one_call(build, T, V4_CASES, key_gradient)

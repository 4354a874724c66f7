"""megatron-core's DSAttention and HyScale's, called directly on the same weights (tests only).

For the inputs an MLA layer does not make but the core attention takes: per-head K and V (the
non-absorbed layout), query rows left sequence-local under sequence-parallel TP, an explicit
attention mask. `build_core_pair` builds both cores from the DSA spec (HyScale's loads the
stock one's state dict); `core_step` (`training_step` of any module) runs one forward (+
backward of a fixed function of the output) and returns what the tests compare, with the stock
forwards a HyScale layer ran counted (`hyscale_bench.layer.FallbackCounter`) and its
selections (`replay.get_stats`);
`assert_core_steps_match` compares two steps, each tensor within a tolerance relative to its
own scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_hyscale.testing.compare import assert_close_to_scale


def build_core_pair(cfg: Any, *, k_channels: int, v_channels: int,
                    softmax_scale: float | None = None,
                    attn_mask_type: Any = "causal") -> tuple[torch.nn.Module, torch.nn.Module]:
    """(stock DSAttention, HyScaleDSAttention) of layer 1 built from `cfg` on the same weights
    (megatron's global process groups); attn_mask_type "causal" (default) or None."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hyscale.specs import get_dsa_layer_specs

    mask_type = AttnMaskType.causal if attn_mask_type == "causal" else attn_mask_type

    def build(stock: bool) -> torch.nn.Module:
        spec = get_dsa_layer_specs(cfg, stock=stock)[0].submodules.self_attention
        torch.manual_seed(0)
        extra = {} if cfg.cp_comm_type is None else {"cp_comm_type": cfg.cp_comm_type}
        return build_module(spec.submodules.core_attention, config=cfg, layer_number=1,
                            attn_mask_type=mask_type, attention_type="self",
                            softmax_scale=softmax_scale, k_channels=k_channels,
                            v_channels=v_channels, **extra)

    stock, hyscale = build(True), build(False)
    hyscale.load_state_dict(stock.state_dict(), strict=True)
    return stock, hyscale


def training_step(module: torch.nn.Module, forward: Callable[..., torch.Tensor],
                  inputs: dict[str, torch.Tensor], *, recompute: bool = False,
                  train: bool = True) -> dict:
    """One forward(*inputs) of `module` (and, when training, backward of mean(out ** 2)).

    inputs: the differentiable inputs by name, copied as leaves (their gradients come back);
    recompute: the forward under `tensor_parallel.checkpoint`, as megatron's full recompute
    runs a layer. Returns out, the inputs' gradients (`dinputs`), the parameters' (`grads`),
    the logged indexer loss (None if none), the stock DSAttention forwards a HyScale layer ran
    (`fallbacks`) and the replay stats.
    """
    from megatron.core import tensor_parallel
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    from hyscale_bench.layer import FallbackCounter
    from megatron_hyscale import replay

    module.train(train)
    module.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    replay.reset_stats()
    leaves = {n: t.detach().clone().requires_grad_(train) for n, t in inputs.items()}
    with FallbackCounter() as fallbacks, torch.set_grad_enabled(train):
        out = (tensor_parallel.checkpoint(forward, False, *leaves.values()) if recompute
               else forward(*leaves.values()))
        if train:
            out.pow(2).mean().backward()
    if train:
        replay.assert_drained()
    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    seen = dict(
        out=out.detach(),
        dinputs={n: t.grad for n, t in leaves.items() if t.grad is not None},
        grads={n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None},
        indexer_loss=None if values is None else values.clone(),
        fallbacks=fallbacks.count, stats=replay.get_stats())
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    replay.clear()
    return seen


def core_step(core: torch.nn.Module, tensors: dict[str, torch.Tensor], *,
              recompute: bool = False, train: bool = True, **forward_kwargs: Any) -> dict:
    """`training_step` of a core attention: tensors are forward's differentiable inputs by
    name (query, key, value, up_v_weight: those given), forward_kwargs the rest
    (attention_mask, x, qr, attn_mask_type, packed_seq_params)."""
    names = list(tensors)

    def call(*args: torch.Tensor) -> torch.Tensor:
        given = dict(zip(names, args, strict=True))
        return core(given["query"], given["key"], given.get("value"),
                    forward_kwargs.get("attention_mask"), forward_kwargs["x"],
                    forward_kwargs["qr"], attn_mask_type=forward_kwargs.get("attn_mask_type"),
                    packed_seq_params=forward_kwargs.get("packed_seq_params"),
                    up_v_weight=given.get("up_v_weight"))

    return training_step(core, call, tensors, recompute=recompute, train=train)


def assert_core_steps_match(got: dict, want: dict, *, rel: float = 1e-5,
                            indexer_rel: float = 1e-4, loss_rel: float = 5e-4) -> None:
    """HyScale's `core_step` (got) equals stock's (want): output, input and parameter
    gradients (the indexer's, from the KL alone, within indexer_rel), the logged indexer
    loss; HyScale ran no stock forward."""
    assert got["fallbacks"] == 0, f"{got['fallbacks']} stock fallback forward(s)"
    assert_close_to_scale(got["out"], want["out"], "output", rel)
    assert set(got["dinputs"]) == set(want["dinputs"])
    for name, grad in want["dinputs"].items():
        assert_close_to_scale(got["dinputs"][name], grad, f"d{name}", rel)
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        # The indexer's gradients come from the KL alone: looser than the main path's.
        assert_close_to_scale(got["grads"][name], grad, name,
                              indexer_rel if ".indexer." in f".{name}" else rel)
    if want["indexer_loss"] is None:
        assert got["indexer_loss"] is None or not got["indexer_loss"].any()
    else:
        assert_close_to_scale(got["indexer_loss"], want["indexer_loss"], "indexer loss",
                              loss_rel)


# The query heads of one TP rank in `sequence_local_steps`, and tiny_dsa_config's MLA widths.
LOCAL_HEADS, LATENT, ROPE, V_HEAD = 2, 32, 8, 16


def sequence_local_steps(cfg: Any, case: dict, *, rows: torch.Tensor, seq_len: int,
                         rank_seed: int, key_rows: torch.Tensor | None = None,
                         query_rows: torch.Tensor | None = None) -> dict:
    """Stock's and HyScale's `core_step` on this rank's sequence-local query rows (stock's
    `sequence_parallel_query_is_local`): one sequence of `seq_len` tokens (batch 1), of which
    this rank holds `rows` (their global indices, in its order) of x, qr and, unless
    `query_rows` / `key_rows` name other rows (e.g. the TP-gathered ones), the query and the
    key and value.

    case: "value" (per-head K and V instead of the absorbed layout), "mask" (an explicit mask,
    attn_mask_type=None: random holes, the last 10 keys and row seq_len // 2 + 3 masked),
    "documents" (packed THD document lengths), "recompute", "train" (default True).
    rank_seed: this TP rank's query heads (and up_v_weight) are its own.
    Returns {"stock": ..., "hyscale": ...}, each a core_step or {"raised": its RuntimeError}.
    """
    from megatron.core.transformer.enums import AttnMaskType

    value = case.get("value", False)
    dk = cfg.qk_head_dim + ROPE if value else LATENT + ROPE
    stock, hyscale = build_core_pair(cfg, k_channels=dk, v_channels=V_HEAD if value else LATENT,
                                     attn_mask_type=None if case.get("mask") else "causal")
    g = torch.Generator().manual_seed(7)
    T = seq_len
    key_rows = rows if key_rows is None else key_rows
    query_rows = rows if query_rows is None else query_rows
    x = torch.randn(T, 1, cfg.hidden_size, generator=g)
    qr = torch.randn(T, 1, cfg.q_lora_rank, generator=g)
    g_rank = torch.Generator().manual_seed(rank_seed)
    tensors = dict(query=torch.randn(len(query_rows), 1, LOCAL_HEADS, dk, generator=g_rank),
                   key=torch.randn(T, 1, LOCAL_HEADS if value else 1, dk, generator=g)[key_rows])
    if value:
        tensors["value"] = torch.randn(T, 1, LOCAL_HEADS, V_HEAD, generator=g)[key_rows]
    else:
        tensors["up_v_weight"] = torch.randn(LOCAL_HEADS, V_HEAD, LATENT, generator=g_rank)
    rest = dict(x=x[rows], qr=qr[rows], attn_mask_type=AttnMaskType.causal)
    if case.get("documents"):
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = case["documents"]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        rest["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths))
    if case.get("mask"):
        masked = torch.rand(1, 1, T, T, generator=g) < 0.3
        masked[:, :, :, T - 10:] = True  # padded keys
        masked[:, :, T // 2 + 3] = True  # a row that sees no key
        rest.update(attention_mask=masked[:, :, query_rows], attn_mask_type=None)
    steps = {}
    for label, core in (("stock", stock), ("hyscale", hyscale)):
        try:
            steps[label] = core_step(core, tensors, recompute=case.get("recompute", False),
                                     train=case.get("train", True), **rest)
        except RuntimeError as err:
            steps[label] = {"raised": str(err)}
    return steps


def assert_sequence_local_steps_match(steps: dict, case: dict) -> None:
    """`sequence_local_steps`' two results agree: stock's RuntimeError for the indexer loss
    raised by both (case "raises"), or HyScale's step equal to stock's on its own path (no
    stock forward, one selection, replayed once under recompute), with an indexer loss where
    the case says "loss"."""
    stock, hyscale = steps["stock"], steps["hyscale"]
    if case.get("raises"):
        assert "sequence-local TP query shards cannot form a global-head target" in (
            stock["raised"]), stock
        assert hyscale == stock, hyscale
        return
    assert "raised" not in stock and "raised" not in hyscale, (stock, hyscale)
    assert_core_steps_match(hyscale, stock)
    if case.get("loss"):
        assert stock["indexer_loss"].abs().sum() > 0 and stock["grads"], "no indexer loss"
    else:
        assert stock["indexer_loss"] is None
    train = case.get("train", True)
    want = {"query", "key", "value" if case.get("value") else "up_v_weight"} if train else set()
    assert set(stock["dinputs"]) == want
    stats = hyscale["stats"]
    assert (stats["selections_computed"], stats["selections_replayed"]) == (
        1, 1 if case.get("recompute") else 0)

"""Warn when a model's decoder runs HyScale's DSA but its multi-token-prediction layers do not.

A GPT model's MTP block comes from its own spec (`mtp_block_spec`), which the builder derives
apart from the decoder's: Megatron-LM's `pretrain_gpt.py` derives it from megatron-core's own
layer specs (ignoring `--spec`), and with no decoder layer on the MTP's pipeline stage megatron's
and Bridge's builders fall back to a stock layer spec. Such a model builds and trains, its MTP
layers on megatron-core's `DSAttention` (or dense attention) beside HyScale's decoder.

HyScale's DSA spec builders call `note_dsa_spec(config, stock=...)`; where the config has MTP
layers, that installs (once a process) a torch module-registration hook which, when a model
assigns its `mtp` block (GPTModel does, after its `decoder`), compares the two: decoder on
HyScale's DSA (or, on a stage without decoder layers, HyScale's spec the latest one built
here) and an MTP core attention that is not HyScale's gives one RuntimeWarning naming the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_hyscale.ops.checks import warn_once

WARNING_KEY = "mtp-attention-not-hyscale"
FIX = (
    "build the MTP block from HyScale's spec: in Python "
    "megatron_hyscale.specs.get_dsa_mtp_block_spec(config); from Megatron-LM's pretrain_gpt.py "
    "`--spec megatron_hyscale.specs hyscale_dsa_block_spec` with "
    "patches/megatron_lm_mtp_spec.patch applied; through Megatron-Bridge "
    "megatron_hyscale.bridge.use_hyscale(provider). Either way the pipeline stage holding the "
    "MTP layers must also hold a decoder layer (README: 'DSA with MTP layers')"
)

_state: dict[str, Any] = {"hook": None, "expect_hyscale": False}


def note_dsa_spec(config: Any, *, stock: bool) -> None:
    """Record that HyScale's (`stock=False`) or the stock DSA spec was built for `config`; with
    MTP layers in the config, make sure the registration hook is installed."""
    if not getattr(config, "mtp_num_layers", None):
        return
    _state["expect_hyscale"] = not stock
    if _state["hook"] is None:
        _state["hook"] = torch.nn.modules.module.register_module_module_registration_hook(
            _on_register)


def _core_attentions(module: torch.nn.Module | None) -> dict[str, type]:
    if module is None:
        return {}
    return {name: type(m) for name, m in module.named_modules()
            if name == "core_attention" or name.endswith(".core_attention")}


def mtp_attention_mismatch(decoder: torch.nn.Module | None, mtp: torch.nn.Module,
                           *, expect_hyscale: bool | None = None) -> dict[str, type]:
    """The MTP core attentions (name -> class) that are not HyScale's DSA, where the decoder
    runs HyScale's DSA; {} otherwise. Without decoder attention (a pipeline stage holding only
    MTP layers) `expect_hyscale` says whether the model is HyScale's."""
    from megatron_hyscale.layers.dsa import HyScaleDSAttention

    decoder_kinds = _core_attentions(decoder).values()
    if decoder_kinds:
        hyscale = any(issubclass(kind, HyScaleDSAttention) for kind in decoder_kinds)
    else:
        hyscale = bool(expect_hyscale)
    if not hyscale:
        return {}
    return {name: kind for name, kind in _core_attentions(mtp).items()
            if not issubclass(kind, HyScaleDSAttention)}


def check_mtp_attention(model: torch.nn.Module, mtp: torch.nn.Module | None = None) -> bool:
    """Warn once (RuntimeWarning) if `model`'s MTP layers do not run HyScale's DSA while its
    decoder does; returns whether they match (True where there is nothing to compare)."""
    mtp = mtp if mtp is not None else getattr(model, "mtp", None)
    if mtp is None:
        return True
    other = mtp_attention_mismatch(getattr(model, "decoder", None), mtp,
                                   expect_hyscale=_state["expect_hyscale"])
    if not other:
        return True
    kinds = sorted({f"{kind.__module__}.{kind.__qualname__}" for kind in other.values()})
    warn_once(WARNING_KEY, (
        f"HyScale: the decoder runs HyScale's DSA but {len(other)} multi-token-prediction "
        f"attention module(s) ({', '.join(sorted(other))}) run {', '.join(kinds)}: the MTP "
        f"block spec did not come from HyScale's spec. To fix, {FIX}."), stacklevel=3)
    return False


def _on_register(module: torch.nn.Module, name: str, submodule: Any) -> None:
    if name == "mtp" and isinstance(submodule, torch.nn.Module):
        check_mtp_attention(module, submodule)

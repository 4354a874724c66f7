"""Logging an attention layer's indexer loss the way megatron-core's DSA layer does."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)


def log_indexer_loss(loss: torch.Tensor, config: Any, layer_number: int, cp_group: Any) -> None:
    """Put a layer's detached indexer loss in megatron's tracker. Under CP each rank's loss
    covers its own rows (a mean over them, or a sum when per-token), so the logged value is
    averaged (or summed) over the CP group, as stock."""
    per_token = bool(config.calculate_per_token_loss)
    DSAIndexerLossLoggingHelper.save_loss_to_tracker(
        loss=loss, layer_number=layer_number, num_layers=config.num_layers,
        reduce_group=cp_group if per_token else None,
        avg_group=None if per_token else cp_group,
    )

"""Pure tensor ops (no Megatron imports): HyTopK, sparse attention, the indexer KL loss."""

from megatron_hyscale.ops.hytopk import hytopk

__all__ = ["hytopk"]

"""Pure tensor ops (no Megatron imports): HyTopK, sparse attention, the indexer KL loss, the two
in one (the loss's target from the attention backward), and the option objects that choose
their kernels' variants."""

from megatron_hyscale.ops.attention_indexer_loss import sparse_attention_indexer_loss
from megatron_hyscale.ops.hytopk import hytopk
from megatron_hyscale.ops.indexer_loss import indexer_kl_loss
from megatron_hyscale.ops.kernels.options import (
    AttentionKernelOptions,
    HyTopKOptions,
    IndexerLossKernelOptions,
)
from megatron_hyscale.ops.sparse_attention import sparse_attention

__all__ = [
    "AttentionKernelOptions",
    "HyTopKOptions",
    "IndexerLossKernelOptions",
    "hytopk",
    "indexer_kl_loss",
    "sparse_attention",
    "sparse_attention_indexer_loss",
]

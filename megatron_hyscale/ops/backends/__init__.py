"""Library kernels under HyScale's op contracts (optional: `pip install megatron-hyscale[cudnn]`).

The kernels megatron-core's `cudnn` DSA backend runs on Hopper: cuDNN-frontend's SM90 indexer
scores and radix top-k, its sparse-attention backward and indexer-loss kernels, and FlashMLA's
sparse forward (built by scripts/build_flashmla.py). Each entry point takes the same inputs
and returns the same outputs as HyScale's own op, and each has a `*_unsupported` function
that returns None when the library can run a call, or the reason it cannot, so the caller can
say why it keeps HyScale's kernel. Which kernel is faster for a shape is decided by
measurement (`backends.measured`), not here.
"""

from megatron_hyscale.ops.backends.availability import library_unavailable

__all__ = ["library_unavailable"]

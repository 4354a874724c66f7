"""A local (torch) linear for modules megatron builds with `TELinear(parallel_mode=...)`.

megatron-core has no non-TE class for the DSA indexer's duplicated projections; this one takes
the same constructor arguments, keeps the same parameter name (`weight`) and returns
`(output, bias)` like megatron's linears, so a TE checkpoint's tensors load into it.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class LocalLinear(torch.nn.Module):
    """y = x W^T (+ b), weights replicated on every tensor-parallel rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool = False,
        parallel_mode: str | None = "duplicated",
        **unused: object,
    ) -> None:
        super().__init__()
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(
                f"LocalLinear supports parallel_mode='duplicated' only, got {parallel_mode!r}; "
                "use Transformer Engine linears for tensor-parallel projections"
            )
        if skip_weight_param_allocation:
            raise ValueError("LocalLinear does not support skip_weight_param_allocation=True")
        self.skip_bias_add = skip_bias_add
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        if config.perform_initialization:
            init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None

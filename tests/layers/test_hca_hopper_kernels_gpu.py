"""On a Hopper GPU DeepSeek-V4's HCA layer runs its attention (a dense prefix of compressed
entries, then the window) on HyScale's Gluon kernels, not their Triton fallbacks
(`AttentionKernelOptions.prefix_sm90`): the layer as the benchmark builds and steps it (V4-Flash
geometry, one sequence, full recompute), the warp-specialized forward and the Gluon backward
launched with the prefix, and no HyScale warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available()
                            and torch.cuda.get_device_capability()[0] == 9),
                       reason="needs a Hopper (sm_90) GPU"),
]

T = 4096


def test_the_hca_step_runs_the_gluon_kernels_with_its_prefix(monkeypatch):
    from hyscale_bench import layer as bench_layer
    from megatron_hyscale.ops import checks
    from megatron_hyscale.ops.kernels import sparse_mla_bwd_sm90, sparse_mla_fwd_ws_sm90

    monkeypatch.setattr(checks, "_warned", set())  # a cause said earlier is said again
    launched = {"fwd": [], "bwd": []}

    def counting(name, real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            launched[name].append(kwargs.get("prefix_lengths") is not None)
            return out
        return call

    monkeypatch.setattr(sparse_mla_fwd_ws_sm90, "launch",
                        counting("fwd", sparse_mla_fwd_ws_sm90.launch))
    monkeypatch.setattr(sparse_mla_bwd_sm90, "sparse_mla_bwd_sm90",
                        counting("bwd", sparse_mla_bwd_sm90.sparse_mla_bwd_sm90))
    args = bench_layer.parse_args(["--model", "hca", "--seq", str(T)])
    bench_layer.init_distributed(args)
    layer = bench_layer.build_v4(args, baseline=False)
    hidden, grad = bench_layer.make_input(T, layer, args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bench_layer.layer_step(layer, hidden, grad)
        torch.cuda.synchronize()
    said = [str(w.message) for w in caught if str(w.message).startswith("HyScale")]
    assert said == []
    # the forward twice (the step's and the recompute's), the backward once, each with the
    # prefix
    assert launched == {"fwd": [True, True], "bwd": [True]}, launched

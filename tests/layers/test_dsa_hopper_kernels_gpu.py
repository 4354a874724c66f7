"""On a Hopper GPU the DSA layer's step runs HyScale's Gluon attention kernels, not their Triton
fallbacks: GLM-5.1's attention geometry (MLA absorbed, 64 heads, 576 / 512 channels) through
`hyscale_bench.layer` as the benchmark builds and steps it (one sequence, full recompute, own
kernels), with the warp-specialized forward, the Gluon backward (target emitted for the
indexer loss) and the indexer loss's Gluon backward each launched, and no HyScale warning.
Until 2026-12-05 one sequence's dout (the V up-projection's einsum gradient, batch stride 1)
failed the backward's layout check: the layer ran the Triton backward at every length, which
only a profile showed.
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


def test_the_step_runs_the_gluon_forward_and_backward(monkeypatch):
    from hyscale_bench import layer as bench_layer
    from megatron_hyscale.ops import checks
    from megatron_hyscale.ops.kernels import (
        indexer_loss_bwd_sm90,
        sparse_mla_bwd_sm90,
        sparse_mla_fwd_ws_sm90,
    )

    monkeypatch.setattr(checks, "_warned", set())  # a cause said earlier is said again

    launched = {"fwd": 0, "bwd": 0, "loss_bwd": 0}

    def counting(name, real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            launched[name] += 1
            return out
        return call

    monkeypatch.setattr(sparse_mla_fwd_ws_sm90, "launch",
                        counting("fwd", sparse_mla_fwd_ws_sm90.launch))
    monkeypatch.setattr(sparse_mla_bwd_sm90, "sparse_mla_bwd_sm90",
                        counting("bwd", sparse_mla_bwd_sm90.sparse_mla_bwd_sm90))
    monkeypatch.setattr(indexer_loss_bwd_sm90, "indexer_loss_bwd_sm90",
                        counting("loss_bwd", indexer_loss_bwd_sm90.indexer_loss_bwd_sm90))
    args = bench_layer.parse_args(["--model", "dsa", "--seq", str(T),
                                   "--hyscale-kernel-backend", "own"])
    bench_layer.init_distributed(args)
    layer = bench_layer.build_dsa(args, baseline=False)
    layer.module.config.hyscale_kernel_backend = "own"
    hidden, grad = bench_layer.make_input(T, layer, args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bench_layer.layer_step(layer, hidden, grad)
        torch.cuda.synchronize()
    said = [str(w.message) for w in caught if str(w.message).startswith("HyScale")]
    assert said == []
    # the forward twice (the step's and the recompute's), each backward once
    assert launched == {"fwd": 2, "bwd": 1, "loss_bwd": 1}, launched
    assert torch.isfinite(hidden.grad).all()

"""On a Hopper GPU the layers' steps run HyScale's Gluon kernels, not their Triton fallbacks,
each layer as `hyscale_bench.layer` builds and steps it (one sequence, full recompute), with no
HyScale warning:
- the DSA layer (GLM-5.1's attention geometry: MLA absorbed, 64 heads, 576 / 512 channels, own
  kernels): the warp-specialized forward, the Gluon backward (target emitted for the indexer
  loss) and the indexer loss's Gluon backward, its row pass on the selection's log-sum-exp
  (no gathered pass). Until 2026-12-05 one sequence's dout (the V
  up-projection's einsum gradient, batch stride 1) failed the backward's layout check: the
  layer ran the Triton backward at every length, which only a profile showed.
- DeepSeek-V4's HCA layer (V4-Flash geometry): its attention (a dense prefix of compressed
  entries, then the window) on the warp-specialized forward and the Gluon backward with the
  prefix (`AttentionKernelOptions.prefix_sm90`).
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


def _step(monkeypatch, argv: list[str], build: str, patched: dict[str, tuple]
          ) -> dict[str, list[dict]]:
    """Each patched function's calls (their keyword arguments) in one step of the layer that
    `hyscale_bench.layer.<build>` makes from `argv`; asserts that no HyScale warning was said
    and that the input's gradient is finite. patched: name -> (module, function name)."""
    from hyscale_bench import layer as bench_layer
    from megatron_hyscale.ops import checks

    monkeypatch.setattr(checks, "_warned", set())  # a cause said earlier is said again
    launched: dict[str, list[dict]] = {name: [] for name in patched}

    def counting(name, real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            launched[name].append(kwargs)
            return out
        return call

    for name, (module, attr) in patched.items():
        monkeypatch.setattr(module, attr, counting(name, getattr(module, attr)))
    args = bench_layer.parse_args(argv)
    bench_layer.init_distributed(args)
    layer = getattr(bench_layer, build)(args, baseline=False)
    layer.module.config.hyscale_kernel_backend = args.hyscale_kernel_backend
    hidden, grad = bench_layer.make_input(T, layer, args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bench_layer.layer_step(layer, hidden, grad)
        torch.cuda.synchronize()
    said = [str(w.message) for w in caught if str(w.message).startswith("HyScale")]
    assert said == []
    assert torch.isfinite(hidden.grad).all()
    return launched


def test_the_step_runs_the_gluon_forward_and_backward(monkeypatch):
    from megatron_hyscale.ops.kernels import (
        attention_indexer_loss,
        indexer_loss_bwd_sm90,
        sparse_mla_bwd_sm90,
        sparse_mla_fwd_ws_sm90,
    )

    launched = _step(monkeypatch, ["--model", "dsa", "--seq", str(T),
                                   "--hyscale-kernel-backend", "own"], "build_dsa", {
        "fwd": (sparse_mla_fwd_ws_sm90, "launch"),
        "bwd": (sparse_mla_bwd_sm90, "sparse_mla_bwd_sm90"),
        "loss_bwd": (indexer_loss_bwd_sm90, "indexer_loss_bwd_sm90"),
        "loss_rows": (attention_indexer_loss, "indexer_loss_rows"),
        "loss_rows_given_lse": (attention_indexer_loss, "normalize_target")})
    # the forward twice (the step's and the recompute's), each backward once; the loss's row
    # pass on the selection's log-sum-exp (no gathered pass)
    counts = {name: len(calls) for name, calls in launched.items()}
    assert counts == {"fwd": 2, "bwd": 1, "loss_bwd": 1, "loss_rows": 0,
                      "loss_rows_given_lse": 1}, counts


def test_the_hca_step_runs_the_gluon_kernels_with_its_prefix(monkeypatch):
    from megatron_hyscale.ops.kernels import sparse_mla_bwd_sm90, sparse_mla_fwd_ws_sm90

    launched = _step(monkeypatch, ["--model", "hca", "--seq", str(T)], "build_v4", {
        "fwd": (sparse_mla_fwd_ws_sm90, "launch"),
        "bwd": (sparse_mla_bwd_sm90, "sparse_mla_bwd_sm90")})
    # the forward twice (the step's and the recompute's), the backward once, each with the
    # prefix
    prefixed = {name: [kw.get("prefix_lengths") is not None for kw in calls]
                for name, calls in launched.items()}
    assert prefixed == {"fwd": [True, True], "bwd": [True]}, prefixed

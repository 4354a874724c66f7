"""Regression tests named after failure modes reported publicly against sparse-attention
training stacks (issue #23). Each test's docstring names the report it guards against.

- DSA index sharing + full / selective recompute with several micro-batches in flight gives
  silently wrong logits: tests/parallel/test_pp_dsa.py::
  test_public_failure_index_sharing_recompute_several_micro_batches (it reuses that module's
  PP 2 + virtual-pipeline runs, which take minutes to make).
- Pipeline stages dropping packed-sequence metadata: tests/parallel/test_pp_dsa.py::
  test_public_failure_packed_metadata_reaches_the_second_stage (PP 2 with packed THD
  micro-batches, on that module's pipeline helpers).
- HyTopK's index arithmetic crossing 2^31 at 256K tokens: `test_hytopk_offsets_past_2_31_*`.
- DSA with multi-token-prediction layers: `test_dsa_with_mtp_layers_*`.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hyscale_bench.models import default_device, tiny_dsa_config
from megatron_hyscale import replay

DEVICE = default_device()
INT32_LIMIT = 2**31


# ---------------------------------------------------------------------------------------------
# 256K tokens: index arithmetic past 2^31
# ---------------------------------------------------------------------------------------------
# DeepSeek-V3.2's indexer (64 heads x 128) at 256K tokens: q has 2^18 * 2^13 = 2^31 elements a
# batch, so its batch stride and its last rows' offsets no longer fit in int32.
T_256K, H_V32, D_V32, TOPK_V32 = 256 * 1024, 64, 128, 2048
# Kernel arguments whose products with a row / batch / key index reach 2^31 at 256K tokens.
WIDE_STRIDES = ("stride_qb", "stride_qt", "stride_kb", "stride_ks", "stride_wb", "stride_wt",
                "TOPK")


class _Recorder:
    """Stands in for the Triton kernel: records the launch's arguments by name."""

    def __init__(self, kernel: Any) -> None:
        self.names = kernel.arg_names
        self.calls: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls.append({**dict(zip(self.names, args, strict=False)), **kwargs})
        return launch


def test_hytopk_offsets_past_2_31_are_64_bit_on_the_host(monkeypatch):
    """Guards the public reports of top-k / indexer kernels that overflow int32 index
    arithmetic at 256K tokens (B*T*T tables, or T*heads*dim offsets > 2^31), corrupting rows
    past the limit. HyScale's HyTopK launch at 256K tokens of V3.2's indexer, recorded without
    running it (meta tensors, the kernel call intercepted): the batch stride it passes is
    2^31, which Triton's launcher types as a 64-bit integer (`mangle_type`, the host-side rule
    that decides a 64-bit argument); the row stride fits int32 while the last row's offset
    does not, so the kernel itself must widen the row index before multiplying
    (`test_hytopk_offsets_past_2_31_are_widened_in_the_kernel`)."""
    from triton.runtime.jit import mangle_type

    from megatron_hyscale.ops.kernels import hytopk as kernels

    B = 2  # a second batch row: its offsets start at the batch stride
    q = torch.empty(B, T_256K, H_V32, D_V32, dtype=torch.bfloat16, device="meta")
    k = torch.empty(B, T_256K, D_V32, dtype=torch.bfloat16, device="meta")
    w = torch.empty(B, T_256K, H_V32, dtype=torch.float32, device="meta")
    pos = torch.empty(B, T_256K, dtype=torch.int64, device="meta")
    recorder = _Recorder(kernels._hytopk_kernel)
    monkeypatch.setattr(kernels, "_hytopk_kernel", recorder)
    kernels._launch(q, k, w, TOPK_V32, relu=True, q_positions=pos, k_positions=pos, causal=True)
    # The launch with sampled thresholds, then the one that redoes failed guesses: same strides.
    args, redo = recorder.calls
    assert args["NSAMP"] > 0 and redo["N_BLOCKS_ON_DEVICE"]
    assert redo["stride_qb"] == args["stride_qb"]
    assert args["q_ptr"].shape == q.shape  # the operand the strides below describe
    assert args["stride_qb"] == T_256K * H_V32 * D_V32 == INT32_LIMIT
    assert mangle_type(args["stride_qb"]) == "i64"
    assert mangle_type(args["stride_qt"]) == "i32"
    last_row = (T_256K - 1) * args["stride_qt"] + (H_V32 - 1) * args["stride_qh"] + D_V32 - 1
    assert last_row >= INT32_LIMIT // 2 and (B - 1) * args["stride_qb"] + last_row > INT32_LIMIT
    # The outputs' rows: (b * T + t) * TOPK reaches 2^31 from B = 4 at 256K tokens.
    assert 4 * T_256K * args["TOPK"] >= INT32_LIMIT


def _products_with(tree: ast.AST, names: tuple[str, ...]) -> Iterator[tuple[ast.BinOp, ast.expr]]:
    """(product, its other operand) for every `x * name` / `name * x` in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for this, other in ((node.left, node.right), (node.right, node.left)):
                if isinstance(this, ast.Name) and this.id in names:
                    yield node, other


def _is_int64_cast(node: ast.expr) -> bool:
    """`<expr>.to(tl.int64)`."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "to" and len(node.args) == 1
            and ast.unparse(node.args[0]) == "tl.int64")


def test_hytopk_offsets_past_2_31_are_widened_in_the_kernel():
    """Guards the same public reports (int32 overflow of index offsets at 256K tokens) inside
    the kernel: every product of a row, batch or key index with one of the strides that reach
    2^31 (`WIDE_STRIDES`) multiplies an index already cast to int64, so no int32 product can
    wrap whatever type Triton gives the stride. (Read from the kernel's source: the CPU
    interpreter cannot reach offsets of 2^31 elements, `test_hytopk_256k_rows_match_the_
    reference_on_the_gpu` runs them.)"""
    from megatron_hyscale.ops.kernels import hytopk as kernels

    fn = kernels._hytopk_kernel
    source = inspect.getsource(getattr(fn, "fn", fn))
    products = list(_products_with(ast.parse(source), WIDE_STRIDES))
    seen = {ast.unparse(p) for p, _ in products}
    # The products this test exists for (a rename must not make it vacuous).
    for needed in ("stride_qb", "stride_qt", "stride_kb", "stride_ks", "stride_wb", "TOPK"):
        assert any(needed in p for p in seen), f"no product with {needed} in the kernel"
    narrow = [ast.unparse(p) for p, other in products if not _is_int64_cast(other)]
    assert not narrow, f"products that may wrap in int32 at 256K tokens: {narrow}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hytopk_256k_rows_match_the_reference_on_the_gpu():
    """Guards the public reports of int32 offset overflow at 256K tokens on the device: HyTopK
    over 256K tokens of V3.2's indexer (64 x 128, top-2048, bf16), batch 2 so the second
    batch row starts at element 2^31, against the plain-torch reference on rows before and
    past the int32 limit. Integer-valued inputs make every fp32 score exact, so the rows must
    be equal (indices and scores)."""
    from megatron_hyscale.ops import hytopk

    B, T, H, D = 2, T_256K, H_V32, D_V32
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(-3, 4, (B, T, H, D), device="cuda", generator=g).bfloat16()
    k = torch.randint(-3, 4, (B, T, D), device="cuda", generator=g).bfloat16()
    w = torch.randint(-2, 3, (B, T, H), device="cuda", generator=g).float()
    indices, scores = hytopk(q, k, w, TOPK_V32, relu=True, backend="triton")
    # Rows of both batches: the first, the last before (T-1) * H * D crosses 2^31 (never,
    # for b = 0), and the last rows, whose q offsets exceed 2^31 in batch 1.
    rows = torch.tensor([0, 4095, T // 2, T - 2, T - 1], device="cuda")
    ref_idx, ref_scores = hytopk(q[:, rows], k, w[:, rows], TOPK_V32, relu=True,
                                 q_positions=rows, backend="reference")
    torch.testing.assert_close(indices[:, rows], ref_idx, rtol=0, atol=0)
    torch.testing.assert_close(scores[:, rows], ref_scores, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# DSA with multi-token-prediction layers
# ---------------------------------------------------------------------------------------------
VOCAB, T, B = 97, 64, 2
MTP_VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {},
    "full-recompute": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "index-share": dict(num_layers=4, dsa_indexer_topk_freq=2),
}


def _mtp_gpt(config: Any, *, stock: bool) -> Any:
    """Tiny GPT with MLA + (HyScale | stock) DSA decoder layers and `config.mtp_num_layers`
    MTP layers built by megatron-core's `get_gpt_mtp_block_spec` from the decoder block spec
    (as Megatron-Bridge's GPT provider does; local linears, since stock's own DSA builder
    needs Transformer Engine)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from megatron_hyscale.specs import get_dsa_block_spec

    block = get_dsa_block_spec(config, stock=stock)
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    torch.manual_seed(7)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=VOCAB,
                     max_sequence_length=T, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False,
                     position_embedding_type="none", mtp_block_spec=mtp)
    return model.to(DEVICE)


def _mtp_step(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from megatron_hyscale.testing.mtp import mtp_step

    return mtp_step(model, vocab=VOCAB, seq=T, batch=B)


@pytest.mark.parametrize("variant", list(MTP_VARIANTS))
def test_dsa_with_mtp_layers_matches_stock(variant):
    """Guards the public reports that DSA cannot be combined with multi-token-prediction
    layers (stock's spec builder asserting for DSA + MTP). A tiny MLA + DSA GPT with one MTP
    layer (`mtp_num_layers=1`, megatron-core's `get_gpt_mtp_block_spec` on HyScale's block
    spec): the MTP layer's attention is HyScale's DSA, forward + backward run, and the loss
    and every gradient (the MTP layer's included) equal stock megatron-core's spec on the
    same weights; with full recompute the MTP layer's selection is replayed too. Stock's
    index sharing under recompute is wrong on its own (test_pp_dsa.py), so the index-sharing
    case has no recompute."""
    from megatron_hyscale.layers.dsa import HyScaleDSAttention
    from megatron_hyscale.testing.compare import assert_grads_close
    from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

    config = tiny_dsa_config(mtp_num_layers=1, mtp_loss_scaling_factor=0.3,
                             **MTP_VARIANTS[variant])
    hyscale = _mtp_gpt(config, stock=False)
    mtp_attention = [m for m in hyscale.mtp.modules() if isinstance(m, HyScaleDSAttention)]
    assert len(mtp_attention) == 1, "the MTP layer does not run HyScale's DSA"
    stock = _mtp_gpt(config, stock=True)
    stock.load_state_dict(hyscale.state_dict(), strict=True)
    replay.reset_stats()
    loss, grads = _mtp_step(hyscale)
    stats = replay.get_stats()
    with stock_topk_breaks_ties_by_index():
        expected_loss, expected_grads = _mtp_step(stock)
    assert torch.isfinite(loss)
    assert any(n.startswith("mtp.") for n in expected_grads), "no MTP gradient"
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, expected_grads, rtol=1e-4, atol=1e-6, what=f"MTP {variant}")
    decoder_layers = config.num_layers
    computing = decoder_layers // 2 if variant == "index-share" else decoder_layers
    recomputed = variant == "full-recompute"
    # Every decoder layer that selects, plus the MTP layer (megatron numbers its inner layer
    # 1, like the first decoder layer: its index-share slot and logged loss are stock's too),
    # selects once a forward.
    assert stats["selections_computed"] == computing + 1, stats
    assert stats["selections_replayed"] == (stats["selections_computed"] if recomputed else 0)
    assert replay.pending_entries() == 0

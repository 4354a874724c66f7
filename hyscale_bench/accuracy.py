"""Accuracy against float64: HyScale's layer and its stock counterpart, each on the same weights.

For each model (`--model`: dsa = GLM-5.1's MLA + DSA layer, csa = DeepSeek-V4-Flash's CSA
attention, qsa = Qwen3.8-Flash-Next's QSA attention), sequence length (`--seq`) and indexer
loss (`--loss dense sparse`), one forward + backward under full recompute
(`tensor_parallel.checkpoint`, as `hyscale_bench.layer` times it) on fixed bf16 inputs, of:
- HyScale: the layer `hyscale_bench.layer` builds (its kernels as `--hyscale-kernel-backend`
  asks, the measured best by default);
- stock: for dsa megatron-core's DSAttention on dsa_kernel_backend="none" (its plain torch
  path); for csa / qsa the module's baseline mode (a score table + torch.topk selection, as in
  `hyscale_bench.layer`), whose attention and loss run the same ops as HyScale's;
- the float64 reference (below),
and per tensor (the output, the indexer loss value, the input gradient, every parameter's
gradient) the relative error ||x - ref|| / ||ref|| in float64, HyScale's and stock's, their
ratio and the verdict "HyScale <= stock" within a slack (`--slack`, 1.05x: run-to-run noise of
the atomics-accumulated gradients).

Design choices:
- **Same function, same selection.** A top-k selection is discontinuous: where the bf16 run and
  a float64 run pick different keys at a near-tie, their outputs and gradients differ by a
  selection change, not by arithmetic. So the reference never selects: it is forced to the
  selection of the run it is compared with (`SelectionReplay.select` of its module returns the
  given indices), and each low-precision run gets its own reference run when the two runs'
  selections differ (HyScale's HyTopK keeps the smaller index at exact ties, torch.topk an
  unspecified one: QSA's zero-score blocks tie often). The errors then measure arithmetic
  only; the share of rows whose selected set differs between HyScale and stock is reported
  beside them (`selection_rows_differ`).
- **The float64 reference is HyScale's module on its plain-torch reference ops in float64**,
  not megatron's DSAttention cast to float64: the stock path hard-codes fp32 (`.float()` on
  every score table, fp32 masks it asserts on) and builds [sq, b, H, sk] score tables that
  would need 256 GiB at 16K in float64 (1 TiB at 64K), while the reference ops
  (`ops/reference.py`: chunked rows, each chunk checkpointed) are memory-bounded at any
  length. Their semantics are those of megatron's DSAttention and of transformers' V4 / QSA
  modules (tests/ops, tests/layers compare them); here the stock column's small error on the
  CPU smoke run (fp32 against float64) checks the same once more. The module is built with
  params_dtype float64 and loads the bf16 weights (exact upcast); the inputs are the bf16
  inputs upcast. During the reference run `Tensor.float()` keeps float64 tensors float64
  (the references and megatron's norms call it to accumulate in fp32), the layers' op calls go
  straight to the reference functions, and a dispatch mode counts every matrix product whose
  operands are not float64 (`reference_low_precision_matmuls`, expected 0: the RoPE tables,
  computed in fp32 by megatron in every run alike, are elementwise).
- **Geometry.** csa and qsa run their real geometry at any length (their baselines' score
  tables are per row block). Stock DSA's plain path materializes fp32 [sq, H, sk] tables and
  runs out of memory at 16K with GLM-5.1's 64 attention and 32 indexer heads, so by default
  dsa above 8K runs with 8 attention heads and 8 indexer heads (everything else GLM-5.1's;
  the table header says so; HyScale's forward then runs its Triton kernel, the Hopper Gluon
  one taking 64 heads a block), and above 16K, where even one head's tables do not fit with
  stock's copies, HyScale against float64 alone, with 16 attention heads (the float64
  module's activations at 64 heads, [T, 64, 576] per tensor, would need about 130 GB at 64K)
  and GLM-5.1's 32 indexer heads. `--heads` / `--indexer-heads` choose the heads instead. A
  run out of memory is recorded as "OOM" for that column (stock) or case (reference).
- **Indexer losses.** dsa's loss as configured (`--loss`; coefficient `--loss-coeff`); csa and
  qsa switch on their optional DSA-style KL loss (v4_indexer_loss_coeff,
  qsa_indexer_loss_coeff) with the same coefficient and form, so that their indexers'
  parameters get gradients to compare.
- `--device cpu --tiny`: fp32 plays the low precision (tiny geometry, seconds); the smoke test
  of the whole path. On a CPU HyScale's layer runs its plain-torch reference ops too, so
  there the table compares those (in fp32) with stock's plain path, not HyScale's kernels.
  It found one real difference: the indexer loss's backward through torch's log_softmax
  lost a factor growing with the number of keys on the indexer's gradients (fixed in
  `ops/reference.py`, see BENCHMARKS.md).

Run as `python -m hyscale_bench.accuracy` or `python scripts/accuracy.py`:

    python scripts/accuracy.py --model dsa csa qsa --seq 4096 16384 --loss dense sparse
    python scripts/accuracy.py --model dsa --seq 65536 --loss sparse   # HyScale vs fp64 only
    python scripts/accuracy.py --device cpu --tiny                     # CPU smoke (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from hyscale_bench.measure import GPU_SCRIPT_EPILOG

MODELS = ("dsa", "csa", "qsa")
LOSSES = ("dense", "sparse")
SLACK = 1.05
DEFAULT_SEQ = [4096, 16384]
TINY_SEQ = [128]
# dsa above FULL_DSA_MAX_SEQ: the stock layer's fp32 score tables need fewer heads to fit on
# a 141 GB H200; above REDUCED_DSA_MAX_SEQ they do not fit with any, and stock is skipped.
FULL_DSA_MAX_SEQ = 8192
REDUCED_DSA_MAX_SEQ = 16384
REDUCED_DSA_HEADS = 8
REDUCED_DSA_INDEXER_HEADS = 8
LONG_DSA_HEADS = 16  # above REDUCED_DSA_MAX_SEQ: the float64 module's activations fit


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=GPU_SCRIPT_EPILOG)
    p.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS),
                   help="layers: dsa (GLM-5.1), csa (DeepSeek-V4-Flash), qsa (Qwen3.8)")
    p.add_argument("--seq", type=int, nargs="+", default=None,
                   help=f"sequence lengths (tokens, batch 1); default {DEFAULT_SEQ} "
                        f"({TINY_SEQ} with --tiny)")
    p.add_argument("--loss", nargs="+", choices=LOSSES, default=list(LOSSES),
                   help="indexer KL loss forms: dense (warm-up) and / or sparse (over the "
                        "selected keys)")
    p.add_argument("--loss-coeff", type=float, default=0.01,
                   help="indexer loss coefficient (dsa_indexer_loss_coeff; csa / qsa switch "
                        "their optional loss on with it)")
    p.add_argument("--heads", type=int, default=None,
                   help="dsa: attention heads (default: GLM-5.1's 64 up to 8K, "
                        f"{REDUCED_DSA_HEADS} to 16K so that stock fits, {LONG_DSA_HEADS} "
                        "beyond so that the float64 reference fits)")
    p.add_argument("--indexer-heads", type=int, default=None,
                   help="dsa: indexer heads (default: GLM-5.1's 32 up to 8K, "
                        f"{REDUCED_DSA_INDEXER_HEADS} to 16K, 32 beyond)")
    p.add_argument("--stock-max-seq", type=int, default=None, metavar="T",
                   help="dsa: run stock up to this length (default: 16K, where its score "
                        "tables fit with the default heads; OOM is recorded as such)")
    p.add_argument("--hyscale-kernel-backend", choices=("best", "own", "cudnn"), default="best",
                   help="the kernels HyScale's layer runs: best (the measured faster per op, "
                        "the default), own (HyScale's only), cudnn (the library's)")
    p.add_argument("--slack", type=float, default=SLACK,
                   help="the verdict allows HyScale's error up to this many times stock's")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: smoke runs (fp32 as the low precision)")
    p.add_argument("--tiny", action="store_true", help="tiny geometry (CPU smoke runs)")
    p.add_argument("--out", default="outputs/accuracy", help="output folder (accuracy.json)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = list(TINY_SEQ) if args.tiny else list(DEFAULT_SEQ)
    if any(t < 8 for t in args.seq):
        p.error("--seq values must be >= 8")
    if args.slack < 1.0:
        p.error("--slack must be >= 1")
    for name in ("heads", "indexer_heads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# The comparison (pure functions: unit-tested with synthetic numbers)
# ---------------------------------------------------------------------------------------------

def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are 0, inf when only ref is 0)."""
    ref64 = ref.detach().to(torch.float64)
    diff = (x.detach().to(device=ref64.device, dtype=torch.float64) - ref64).norm().item()
    norm = ref64.norm().item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def within(hyscale_err: float | None, stock_err: float | None, slack: float = SLACK) -> bool | None:
    """The verdict "HyScale <= stock": HyScale's error at most `slack` x stock's (None
    where either is missing). Both exactly 0 (e.g. the same fp32 weights' gradient) passes."""
    if hyscale_err is None or stock_err is None:
        return None
    if math.isnan(hyscale_err) or math.isnan(stock_err):
        return False
    return hyscale_err <= slack * stock_err


def compare(hyscale: dict[str, float | None], stock: dict[str, float | None] | None,
            slack: float = SLACK) -> list[dict[str, Any]]:
    """Table rows, in `hyscale`'s order: tensor, both errors, their ratio and the verdict."""
    rows = []
    for name, h in hyscale.items():
        s = None if stock is None else stock.get(name)
        if h is None or s is None:
            ratio = None
        elif s == 0.0:
            ratio = 1.0 if h == 0.0 else math.inf
        else:
            ratio = h / s
        rows.append({"tensor": name, "hyscale_err": h, "stock_err": s, "ratio": ratio,
                     "ok": within(h, s, slack)})
    return rows


def verdict_cell(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "NO")


def _num(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    if math.isinf(v) or math.isnan(v):
        return str(v)
    return f"{v:.{digits}e}"


def format_table(rows: list[dict[str, Any]], slack: float) -> str:
    lines = [f"| tensor | HyScale err | stock err | HyScale / stock | HyScale <= stock "
             f"(x{slack:g}) |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['tensor']} | {_num(r['hyscale_err'])} | {_num(r['stock_err'])} | "
                     f"{ratio} | {verdict_cell(r['ok'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# One run: forward + backward, with the selection captured or forced
# ---------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    output: torch.Tensor
    loss: torch.Tensor | None
    input_grad: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    selections: list[torch.Tensor] = field(default_factory=list)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The compared tensors by table row name."""
        out: dict[str, torch.Tensor | None] = {"output": self.output, "indexer loss": self.loss,
                                               "input grad": self.input_grad}
        out.update({f"grad {name}": g for name, g in self.grads.items()})
        return out

    def selection(self) -> torch.Tensor | None:
        """The selection the gradients used (the recompute's, the last one made)."""
        return self.selections[-1] if self.selections else None


@contextlib.contextmanager
def selection_hook(module: torch.nn.Module, captured: list[torch.Tensor],
                   forced: torch.Tensor | None = None) -> Iterator[None]:
    """Capture (or, with `forced`, replace) the module's selections.

    HyScale's layers and the csa / qsa baselines select through `SelectionReplay.select`;
    megatron's DSAttention through `dsa.fused_qk_topk_naive` (its plain path).
    """
    from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa

    stores = [m.selection_replay for m in module.modules() if hasattr(m, "selection_replay")]
    with contextlib.ExitStack() as stack:
        for store in stores:
            original = store.select

            def select(shape: tuple[int, ...], compute: Callable[[], Any], *a: Any,
                       _orig: Callable = original, **kw: Any) -> Any:
                # A forced selection is the indices alone: what travels with a computed one
                # (the DSA layer's selected scores' log-sum-exp) would not match them, and
                # without it the layer's indexer loss takes its own.
                if forced is not None:
                    if tuple(forced.shape) != tuple(shape):
                        raise ValueError(f"forced selection {tuple(forced.shape)} is not the "
                                         f"layer's {tuple(shape)}")
                    got = forced.to(torch.int32)
                else:
                    got = _orig(shape, compute, *a, **kw)
                indices = got[0] if isinstance(got, tuple) else got
                captured.append(indices.detach().clone())
                return got

            store.select = select
            stack.callback(vars(store).pop, "select", None)
        if not stores:
            naive = stock_dsa.fused_qk_topk_naive

            def fused_qk_topk_naive(*a: Any, **kw: Any) -> Any:
                scores, indices = naive(*a, **kw)
                if forced is not None:
                    indices = forced.to(device=indices.device, dtype=indices.dtype)
                captured.append(indices.detach().to(torch.int32))
                return scores, indices

            stack.enter_context(mock.patch.object(stock_dsa, "fused_qk_topk_naive",
                                                  fused_qk_topk_naive))
        yield


@contextlib.contextmanager
def loss_hook(captured: list[torch.Tensor]) -> Iterator[None]:
    """Capture every indexer loss attached to an output (megatron's DSAIndexerLossAutoScaler,
    which the stock and HyScale DSA, V4 and QSA layers all use)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossAutoScaler,
    )

    original = DSAIndexerLossAutoScaler.apply

    def apply(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        captured.append(loss.detach().clone())
        return original(output, loss)

    with mock.patch.object(DSAIndexerLossAutoScaler, "apply", apply):
        yield


def run_step(layer: Any, hidden: torch.Tensor, grad: torch.Tensor,
             forced: torch.Tensor | None = None) -> RunResult:
    """One forward + backward under full recompute; the results detached and cloned."""
    from megatron.core import tensor_parallel

    from megatron_hyscale import replay

    module = layer.module
    module.zero_grad(set_to_none=True)
    x = hidden.detach().clone().requires_grad_()
    selections: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    replay.clear()
    with selection_hook(module, selections, forced), loss_hook(losses):
        out = tensor_parallel.checkpoint(layer.call, False, x)
        out.backward(grad)
    replay.clear()
    grads = {name: None if p.grad is None else p.grad.detach().clone()
             for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return RunResult(out.detach().clone(), losses[-1] if losses else None,
                     x.grad.detach().clone(), grads, selections)


# ---------------------------------------------------------------------------------------------
# The float64 reference
# ---------------------------------------------------------------------------------------------

def _reference_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                                indices: torch.Tensor, softmax_scale: float, *,
                                dv: int | None = None, sink: torch.Tensor | None = None,
                                return_lse: bool = False,
                                prefix_lengths: torch.Tensor | None = None,
                                **_kernel_options: Any) -> Any:
    """`ops.sparse_attention` on its plain-torch reference, any float dtype (float64 here)."""
    from megatron_hyscale.ops import reference

    out, lse = reference.sparse_attention_reference(q, k, v, indices, float(softmax_scale),
                                                    dv=dv, sink=sink,
                                                    prefix_lengths=prefix_lengths)
    return (out, lse) if return_lse else out


def _reference_indexer_kl_loss(q_index: torch.Tensor, weights: torch.Tensor,
                               k_index: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               topk_indices: torch.Tensor | None, softmax_scale: float,
                               loss_coeff: float, *, sparse: bool, relu: bool = True,
                               q_positions: torch.Tensor | None = None,
                               k_positions: torch.Tensor | None = None,
                               calculate_per_token_loss: bool = False, tp_group: Any = None,
                               attention_lse: torch.Tensor | None = None,
                               **_kernel_options: Any) -> torch.Tensor:
    """`ops.indexer_kl_loss` on its plain-torch reference, any float dtype (float64 here)."""
    from megatron_hyscale.ops import reference
    from megatron_hyscale.ops.checks import normalize_positions

    B, T = q_index.shape[:2]
    S = k_index.shape[1]
    qpos = normalize_positions("q_positions", q_positions, B, T, S - T, q_index.device)
    kpos = normalize_positions("k_positions", k_positions, B, S, 0, q_index.device)
    return reference.indexer_loss_reference(
        q_index, weights, k_index, query, key, topk_indices, float(softmax_scale),
        float(loss_coeff), sparse=sparse, relu=relu, q_positions=qpos, k_positions=kpos,
        calculate_per_token_loss=calculate_per_token_loss, tp_group=tp_group,
        attention_lse=attention_lse)


class MatmulPrecision(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products (forward and backward) with a non-float64 float operand."""

    def __init__(self) -> None:
        super().__init__()
        aten = torch.ops.aten
        self.ops = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.mv,
                    aten.addmv, aten.dot}
        self.low = 0
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func.overloadpacket in self.ops:
            self.total += 1
            if any(isinstance(a, torch.Tensor) and a.is_floating_point()
                   and a.dtype != torch.float64 for a in args):
                self.low += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def float64_reference() -> Iterator[MatmulPrecision]:
    """The reference run's patches: fp64 stays fp64 under `.float()`, the layers' ops run
    their plain-torch references; yields the matmul precision counter."""
    from megatron_hyscale.layers import deepseek_v4, dsa, qsa

    tensor_float = torch.Tensor.float

    def keep_float64(self: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        return self if self.dtype == torch.float64 else tensor_float(self, *a, **kw)

    from megatron_hyscale.ops import checks

    counter = MatmulPrecision()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.Tensor, "float", keep_float64))
        # The ops' argument checks (pooling, compression) accept float64 inputs too.
        stack.enter_context(mock.patch.object(checks.check_tensor, "__kwdefaults__", {
            "dtypes": (*checks.FLOAT_DTYPES, torch.float64)}))
        for module in (dsa, deepseek_v4, qsa):
            stack.enter_context(mock.patch.object(module, "sparse_attention",
                                                  _reference_sparse_attention))
            stack.enter_context(mock.patch.object(module, "indexer_kl_loss",
                                                  _reference_indexer_kl_loss))
        stack.enter_context(counter)
        yield counter


def run_reference(layer: Any, hidden: torch.Tensor, grad: torch.Tensor,
                  forced: torch.Tensor | None) -> tuple[RunResult, tuple[int, int]]:
    """The float64 run on `forced`'s selection; with (matmuls not in float64, all matmuls)."""
    with float64_reference() as counter:
        result = run_step(layer, hidden.to(torch.float64), grad.to(torch.float64), forced)
    return result, (counter.low, counter.total)


def selection_rows_differ(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """Share of rows whose selected sets differ (order within a row ignored)."""
    if a is None or b is None:
        return None
    if a.shape != b.shape:
        return 1.0
    sa = a.to(torch.int64).sort(dim=-1).values
    sb = b.to(torch.int64).to(sa.device).sort(dim=-1).values
    if sa.numel() == 0:
        return 0.0
    return (sa != sb).any(dim=-1).float().mean().item()


def errors(result: RunResult, ref: RunResult) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    ref_tensors = ref.tensors()
    for name, x in result.tensors().items():
        r = ref_tensors.get(name)
        out[name] = None if x is None or r is None else relative_error(x, r)
    return out


# ---------------------------------------------------------------------------------------------
# One case: a model, a length, a loss form
# ---------------------------------------------------------------------------------------------

def layer_args(args: argparse.Namespace, model: str, loss: str) -> argparse.Namespace:
    """The namespace `hyscale_bench.layer`'s builders read."""
    return argparse.Namespace(model=model, tiny=args.tiny, device=args.device, cp=1, dp=1,
                              loss_coeff=args.loss_coeff, dense_loss=loss == "dense",
                              no_relu=False, row_chunk=None, transformer_impl="local")


def dsa_heads(args: argparse.Namespace, T: int) -> tuple[dict[str, Any], str, bool]:
    """dsa's head overrides at length T, the geometry's description, whether stock runs."""
    from hyscale_bench.layer import GLM51, TINY

    geometry = TINY["dsa"] if args.tiny else GLM51
    full = (geometry["num_attention_heads"], geometry["dsa_indexer_n_heads"])
    if args.tiny or T <= FULL_DSA_MAX_SEQ:
        auto = full
    elif T <= REDUCED_DSA_MAX_SEQ:
        auto = (REDUCED_DSA_HEADS, REDUCED_DSA_INDEXER_HEADS)
    else:
        auto = (LONG_DSA_HEADS, full[1])
    heads = args.heads or auto[0]
    indexer_heads = args.indexer_heads or auto[1]
    stock_max = args.stock_max_seq or (1 << 62 if args.tiny else REDUCED_DSA_MAX_SEQ)
    overrides = {"num_attention_heads": heads, "dsa_indexer_n_heads": indexer_heads}
    name = "tiny" if args.tiny else "GLM-5.1"
    reduced = "" if (heads, indexer_heads) == full else ", REDUCED heads"
    desc = f"{name} geometry{reduced}: {heads} attention heads, {indexer_heads} indexer heads"
    return overrides, desc, T <= stock_max


def build(model: str, largs: argparse.Namespace, *, baseline: bool, dtype: torch.dtype | None,
          overrides: dict[str, Any]) -> Any:
    from hyscale_bench.layer import build_dsa, build_qsa, build_v4

    builder = {"dsa": build_dsa, "csa": build_v4, "qsa": build_qsa}[model]
    return builder(largs, baseline, dtype=dtype, overrides=overrides)


def model_overrides(model: str, args: argparse.Namespace, loss: str) -> dict[str, Any]:
    if model == "csa":
        return {"v4_indexer_loss_coeff": args.loss_coeff,
                "v4_indexer_use_sparse_loss": loss == "sparse"}
    if model == "qsa":
        return {"qsa_indexer_loss_coeff": args.loss_coeff,
                "qsa_indexer_use_sparse_loss": loss == "sparse"}
    return {}


def make_inputs(T: int, hidden_size: int, device: str, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed [T, 1, h] input and output gradient in the low precision (as bench_layer's)."""
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn((T, 1, hidden_size), generator=g, device=device) * 0.5
    grad = torch.randn((T, 1, hidden_size), generator=g, device=device)
    return hidden.to(dtype), grad.to(dtype)


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def run_case(args: argparse.Namespace, model: str, T: int, loss: str) -> dict[str, Any]:
    """Errors of HyScale and stock against float64 for one model, length and loss form."""
    t0 = time.time()
    largs = layer_args(args, model, loss)
    overrides = model_overrides(model, args, loss)
    geometry, run_stock = "real geometry", True
    if model == "dsa":
        heads, geometry, run_stock = dsa_heads(args, T)
        overrides.update(heads)
    elif args.tiny:
        geometry = "tiny geometry"
    low = torch.bfloat16 if args.device == "cuda" else torch.float32
    hyscale = build(model, largs, baseline=False, dtype=low, overrides=overrides)
    hyscale.module.config.hyscale_kernel_backend = args.hyscale_kernel_backend
    state = hyscale.module.state_dict()
    hidden, grad = make_inputs(T, hyscale.hidden_size, args.device, low)
    result_h = run_step(hyscale, hidden, grad)
    del hyscale
    _free(args.device)
    result_s: RunResult | str | None = None
    if run_stock:
        stock = build(model, largs, baseline=True, dtype=low, overrides=overrides)
        stock.module.load_state_dict(state)
        try:
            result_s = run_step(stock, hidden, grad)
        except torch.OutOfMemoryError:
            result_s = "OOM"
        del stock
        _free(args.device)
    else:
        result_s = "skipped"
    ref_layer = build(model, largs, baseline=False, dtype=torch.float64, overrides=overrides)
    ref_layer.module.load_state_dict(state)  # the low-precision weights, upcast exactly
    reference_status = "ran"
    try:
        ref_h, (low_matmuls, matmuls) = run_reference(ref_layer, hidden, grad,
                                                      result_h.selection())
    except torch.OutOfMemoryError:
        reference_status, low_matmuls, matmuls = "OOM", 0, 0
        ref_h = None
        _free(args.device)
    err_h = {name: None for name in result_h.tensors()} if ref_h is None else \
        errors(result_h, ref_h)
    err_s, differ = None, None
    if ref_h is not None and isinstance(result_s, RunResult):
        differ = selection_rows_differ(result_h.selection(), result_s.selection())
        ref_s = ref_h
        if differ:  # stock's own selection: a reference run of its own
            del ref_h, ref_s
            _free(args.device)
            try:
                ref_s, (low_s, total_s) = run_reference(ref_layer, hidden, grad,
                                                        result_s.selection())
                low_matmuls, matmuls = low_matmuls + low_s, matmuls + total_s
            except torch.OutOfMemoryError:
                reference_status, ref_s = "OOM on stock's selection", None
                _free(args.device)
        if ref_s is not None:
            err_s = errors(result_s, ref_s)
        del ref_s
    del ref_layer
    _free(args.device)
    rows = compare(err_h, err_s, args.slack)
    stock_name = "megatron DSAttention (plain torch)" if model == "dsa" else "baseline mode"
    return {
        "model": model, "T": T, "loss": loss, "geometry": geometry,
        "low_precision": str(low).removeprefix("torch."), "stock": stock_name,
        "stock_status": "ran" if isinstance(result_s, RunResult) else result_s,
        "reference_status": reference_status,
        "selection_rows_differ": differ,
        "recompute_selection_changed": _recompute_changed(result_h)
        or (isinstance(result_s, RunResult) and _recompute_changed(result_s)),
        "reference_low_precision_matmuls": low_matmuls, "reference_matmuls": matmuls,
        "loss_value": None if result_h.loss is None else result_h.loss.item(),
        "rows": rows, "seconds": time.time() - t0,
    }


def _recompute_changed(result: RunResult) -> bool:
    """Whether a run's selections within its step (first forward, recompute) differ."""
    first = result.selections[0] if result.selections else None
    return any(selection_rows_differ(first, s) for s in result.selections[1:])


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def case_header(case: dict[str, Any]) -> str:
    differ = case["selection_rows_differ"]
    differ = "-" if differ is None else f"{differ:.2%}"
    return (f"### {case['model']} T={case['T']} loss={case['loss']} ({case['geometry']}; "
            f"{case['low_precision']} against float64; stock = {case['stock']}: "
            f"{case['stock_status']}; float64 reference: {case['reference_status']}; "
            f"rows whose selection differs HyScale vs stock: {differ}; "
            f"reference matmuls not in float64: {case['reference_low_precision_matmuls']} of "
            f"{case['reference_matmuls']})")


def summary(cases: list[dict[str, Any]]) -> tuple[int, int, list[str]]:
    """(tensors compared, tensors where HyScale is within the slack, the failing ones)."""
    compared = passed = 0
    failing = []
    for case in cases:
        for r in case["rows"]:
            if r["ok"] is None:
                continue
            compared += 1
            if r["ok"]:
                passed += 1
            else:
                failing.append(f"{case['model']} T={case['T']} {case['loss']}: {r['tensor']} "
                               f"({r['ratio']:.3g}x)")
    return compared, passed, failing


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        from hyscale_bench.measure import require_cuda

        require_cuda("accuracy.py --device cuda", hint="run it on the GPU machine, or use "
                     "--device cpu --tiny for a CPU smoke run")
    from hyscale_bench.cpu import init_single_process, megatron_on_cpu

    ctx = megatron_on_cpu() if args.device == "cpu" else contextlib.nullcontext()
    with ctx:
        init_single_process()
        try:
            return run(args)
        finally:
            from hyscale_bench.layer import shutdown_distributed

            shutdown_distributed()


def run(args: argparse.Namespace) -> int:
    from hyscale_bench.measure import save_record

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {device}  models: {' '.join(args.model)}  T: {args.seq}  "
          f"losses: {' '.join(args.loss)}", flush=True)
    cases: list[dict[str, Any]] = []
    for model in args.model:
        for T in args.seq:
            for loss in args.loss:
                print(f"[{model} T={T} {loss}] ...", flush=True)
                case = run_case(args, model, T, loss)
                cases.append(case)
                print(f"\n{case_header(case)}\n{format_table(case['rows'], args.slack)}\n"
                      f"({case['seconds']:.0f} s)", flush=True)
                payload = {"device": device, "args": vars(args),
                           "command": " ".join([sys.executable, *sys.argv]), "cases": cases}
                (out_dir / "accuracy.json").write_text(json.dumps(payload, indent=1))
    compared, passed, failing = summary(cases)
    print(f"\nHyScale <= stock (x{args.slack:g}) for {passed} of {compared} tensors compared"
          + ("" if not failing else ": larger for " + "; ".join(failing)))
    config = "-".join(args.model) + ("-tiny" if args.tiny else "")
    path = save_record("accuracy", config, cases, matmul=float("nan"), copy=float("nan"),
                       extra={"args": vars(args), "slack": args.slack,
                              "compared": compared, "passed": passed})
    print(f"record: {path}")
    return 0


def cli() -> None:
    """The command line: `python -m hyscale_bench.accuracy`, `scripts/accuracy.py`."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())


if __name__ == "__main__":
    cli()

"""Which kernels HyScale's layers ask the ops for: the measured best installed, or their own.

`config.hyscale_kernel_backend` (set it on the TransformerConfig the model is built from), else
$HYSCALE_KERNEL_BACKEND (for Megatron-LM's `--spec` launches, which build the config from the
command line), else "best":
- "best": per op and shape, the faster of HyScale's kernel and the library's (cuDNN-frontend's
  DSA kernels and FlashMLA, `pip install megatron-hyscale[cudnn]`), as measured in
  ops/backends/measured_defaults.json; for the attention the fastest of three pairs (FlashMLA +
  cuDNN, FlashMLA's forward + HyScale's backward, HyScale's two); the library only where it is
  installed and can run the call. Each op says once which it runs.
- "own": HyScale's Triton / Gluon kernels only (the reference on CPU).
- "cudnn": the library wherever it can run the call (one warning names each case it cannot).

The indexer's selection precision comes the same way: `config.hyscale_indexer_precision`, else
$HYSCALE_INDEXER_PRECISION, else "bf16"; "fp8" selects on e4m3 copies of the indexer's q and k
(`ops.hytopk(precision="fp8")`). Only the selection: the indexer loss and its gradients keep
the bf16 tensors.

The sparse indexer loss's target (the head-summed attention probability of each selected key):
`config.hyscale_indexer_target`, else $HYSCALE_INDEXER_TARGET, else "auto". "separate": its own
pass over the selected keys in the layer's forward (`ops.indexer_kl_loss` with the attention's
lse); "attention_backward": emitted by the attention backward's dQ kernel, which then runs the
loss and its gradient (`ops/kernels/attention_indexer_loss.py`; HyScale's Triton attention and
loss kernels whatever the backend setting, the loss logged from the backward, its time
counted in the attention's phase); "auto": "attention_backward" where the attention's backward
is HyScale's anyway (CUDA tensors, and the backend setting does not pick the library pair for
the call; FlashMLA's forward with HyScale's backward counts as HyScale's), "separate"
elsewhere (the library pair's backward emits no target, and cuDNN's loss beside it was
measured faster than HyScale's attention backward with the target: see BENCHMARKS.md). Only
for the sparse loss without an explicit attention mask and in a training forward with
gradients; other calls run the separate path, as do tensors off CUDA without Triton's
interpreter (an explicit "attention_backward" warns once).

Where the sparse loss runs in the attention backward, each row's index-score log-sum-exp:
`config.hyscale_indexer_lse`, else $HYSCALE_INDEXER_LSE, else "selection": HyScaleDSAttention
takes it from the selected keys' scores when it selects (HyTopK returns them anyway;
`ops.indexer_loss.selected_scores_lse`: one read of the [T, K] fp32 scores), keeps it with the
replayed indices ([T] fp32 in the same replay entry) and hands it to the loss
(`ops.sparse_attention_indexer_loss(index_lse=...)`), whose row pass then only normalizes the
target (`normalize_target`, no key gathered); one sequence or packed THD documents (each
document's rows from its own selection), a bf16 selection, the loss's `kl_in_bwd` on and
`fused_rows_bwd` off. "row_pass": the loss's row pass gathers the keys and takes its own.
An explicit attention mask always takes the row pass. The loss's recomputed scores may differ
from the selection's by fp32 summation order, so the loss and gradients agree with the row
pass's to that rounding, not bitwise; the recompute's scores must be the first forward's
(megatron's recompute is bit-identical). Where the attention then runs the library pair (the
separate target pass) the log-sum-exp goes unused. BENCHMARKS.md has the timings
(`bench_indexer_loss.py --variants selection_lse`, `bench_layer.py --compare-selection-lse`).

Packed THD sequences select per document: `config.hyscale_packed_selection`, else
$HYSCALE_PACKED_SELECTION, else "per_document" (one selection call a document) or "batched"
(documents of similar length batched into one call, `layers/packed_selection.py`: the same
indices in fewer launches; the default once measured faster on the GPU).

Absorbed MLA's projections around the core attention: `config.hyscale_mla_projections`, else
$HYSCALE_MLA_PROJECTIONS, else "hyscale": `HyScaleMLASelfAttention` makes the query, key and
compressed query itself where it can (`_chunking_unsupported` lists where not: tensor-parallel
size > 1, RoPE fusion, selective recompute of the up projection, a packed format other than
THD, dynamic CP, FP8 / FP4, CUDA graphs, delayed weight gradients; and inference), the
absorbed query's GEMM and RoPE written in place (`ops/absorbed_mla.py`; megatron's ops for
the query under `rotary_interleaved`), and the V up projection likewise for a batch of one;
"megatron": AbsorbedMLA's own einsums, RoPE and concatenations. Same values (the RoPE bitwise,
the GEMMs the same products up to their kernels' rounding); kept for comparison.
"""

from __future__ import annotations

import os

from megatron_hyscale.ops.fp8_quant import PRECISIONS

ENV = "HYSCALE_KERNEL_BACKEND"
CHOICES = {"best": "best", "own": "auto", "cudnn": "cudnn"}
PRECISION_ENV = "HYSCALE_INDEXER_PRECISION"
PACKED_SELECTION_ENV = "HYSCALE_PACKED_SELECTION"
PACKED_SELECTION_MODES = ("per_document", "batched")
INDEXER_TARGET_ENV = "HYSCALE_INDEXER_TARGET"
INDEXER_TARGETS = ("auto", "separate", "attention_backward")
INDEXER_LSE_ENV = "HYSCALE_INDEXER_LSE"
INDEXER_LSE_SOURCES = ("selection", "row_pass")
MLA_PROJECTIONS_ENV = "HYSCALE_MLA_PROJECTIONS"
MLA_PROJECTIONS = ("hyscale", "megatron")


def _setting(config: object, attr: str, env: str, default: str, choices) -> str:
    """config.<attr>, else $<env>, else `default`; ValueError naming the source if not in
    `choices`."""
    from_config = getattr(config, attr, None)
    value = from_config or os.environ.get(env) or default
    if value not in choices:
        source = f"config.{attr}" if from_config else env
        raise ValueError(f"{source} must be one of {sorted(choices)}, got {value!r}")
    return value


def kernel_backend(config: object) -> str:
    """The ops' `backend=` argument for a layer built from `config`."""
    return CHOICES[_setting(config, "hyscale_kernel_backend", ENV, "best", CHOICES)]


def indexer_precision(config: object) -> str:
    """The selection's `precision=` argument (`ops.hytopk`) for a layer built from `config`."""
    return _setting(config, "hyscale_indexer_precision", PRECISION_ENV, "bf16", PRECISIONS)


def packed_selection(config: object) -> str:
    """How a packed THD sequence's documents select: "per_document" or "batched"."""
    return _setting(config, "hyscale_packed_selection", PACKED_SELECTION_ENV, "per_document",
                    PACKED_SELECTION_MODES)


def indexer_target(config: object) -> str:
    """Where the sparse indexer loss's target comes from: "auto", "separate" or
    "attention_backward"."""
    return _setting(config, "hyscale_indexer_target", INDEXER_TARGET_ENV, "auto",
                    INDEXER_TARGETS)


def indexer_lse(config: object) -> str:
    """Where the sparse loss in the attention backward takes each row's index-score
    log-sum-exp: "selection" (from the selected keys' scores) or "row_pass" (its own pass)."""
    return _setting(config, "hyscale_indexer_lse", INDEXER_LSE_ENV, "selection",
                    INDEXER_LSE_SOURCES)


def mla_projections(config: object) -> str:
    """Whose absorbed-MLA projections the layer runs: "hyscale" (in place) or "megatron"."""
    return _setting(config, "hyscale_mla_projections", MLA_PROJECTIONS_ENV, "hyscale",
                    MLA_PROJECTIONS)

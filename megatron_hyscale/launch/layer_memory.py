"""Per-GPU memory estimate of one attention layer run by `scripts/bench_layer.py`.

The estimate is an accounting model, not a measurement: it adds up the tensors alive at the
peak of one forward + backward step of a single attention layer under full recompute
(`tensor_parallel.checkpoint`), for this GPU's T / CP query rows, so that a sequence length and
a context-parallel layout can be checked on paper before a job is submitted. bench_layer.py
measures the real peak (`torch.cuda.max_memory_allocated`) beside it; the two are compared in
the examples' READMEs, and this model is to be corrected where they disagree.

What is counted (bytes; 1 GiB = 2**30; activations bf16 unless said):
- static: the layer's weights and their gradients (bf16 each: bench_layer has no optimizer and
  no DDP fp32 main gradients), the input, its gradient and the output gradient ([T/CP, h] each);
- the working set of the recomputed forward plus the backward of the layer: the projections'
  outputs the backward reads, the keys / values all-gathered over the whole sequence under CP
  (allgather CP: every rank holds the global K / V and accumulates their gradients in fp32
  before the reduce-scatter), the sparse-attention output, its log-sum-exp and the query
  gradient (in the query's dtype), the index tensor fed to the sparse attention, and a fixed
  WORKSPACE_GIB (kernel and library workspaces, allocator rounding; measured);
- selection: HyScale keeps O(T/CP x k) (HyTopK's int32 indices + fp32 scores, and the replay
  store's int32 indices held from the first forward to the recompute); the baseline
  materializes a score table: DSA stock [T/CP, H_I, T] fp32 logits + the head sum; V4's
  baseline [4096-row block, H_I, N] fp32 logits + [block, N] scores; QSA's baseline a chunk of
  2**28 fp32 logits (+ ReLU'd copy and head sum);
- a fixed reserve for the CUDA context, NCCL buffers and allocator fragmentation.

Calibration (BENCHMARKS.md, "DSA layer", one H200, 2026-11-30): HyScale's measured peak extra
was 3.25 / 5.77 / 11.52 / 23.03 / 46.40 / 92.07 GiB at T = 8K .. 256K; this model says 3.3 /
6.3 / 12.2 / 24.0 / 47.6 / 94.9 (2 to 9 % high). Until 2026-11-30 it counted the query
gradient in fp32 (the dQ kernel writes bf16) and was 10 to 25 % high. At 1M tokens, CP 2,
rows in parts of 128K (two H200s, the same day) it says 76.57 GiB, measured 76.25. Stock's
score-table factor is fitted to its one measured point (below). CSA / HCA / QSA (H200, third
GPU session of 2026-11-30, after V4's query norm and RoPE stopped keeping fp32 copies):
CSA 50.5 / 100.5 GiB at 128K / 256K (model 55.1 / 109.8), at 1M CP 2 in parts of 128K 66.3
(76.6); HCA 49.7 / 98.9 (51.2 / 102.0); QSA 23.9 / 95.1 at 128K / 512K (23.6 / 93.2: 1 to 2 %
low), at 1M CP 2 96.6 (96.4). QSA's item for megatron's unfused q / k norm backward was added
from scripts/profile_layer_memory.py; V4's baseline factor is fitted.

Simplifications (each shifts the total by well under 10 %): norms, biases and RoPE tables are
ignored; temporaries of a single elementwise op are not counted unless they are [T, ...] sized;
the forward's and the backward's largest transients are assumed not to coexist (the larger
counts). Standard library only: dry runs need nothing but Python.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
RESERVE_GIB = 3.0  # CUDA context + NCCL + fragmentation (measured order on H100/H200 runs)
# Above the counted tensors at every T (kernel / cuBLAS workspaces, allocator rounding): the
# 2026-11-30 H200 DSA peak at 8K was 0.3 GiB above them.
WORKSPACE_GIB = 0.35
V4_BASELINE_ROW_BLOCK = 4096  # DeepseekV4TransformerConfig.v4_baseline_row_block
QSA_BASELINE_CHUNK_ELEMENTS = 1 << 28  # megatron_hyscale.layers.qsa.BASELINE_CHUNK_ELEMENTS
# V4's baseline: [4096-row block, H_I, N] fp32 score blocks (the logits, their ReLU, the weighted
# product before the head sum) on top of the layer's working set. Its peak comes in a forward
# (the selection), when the backward's gradients are not alive, so the sum of the two items
# overcounts; the factor is fitted to the total measured on the H200 (2026-11-30): CSA at 32K /
# 128K, 25.8 / 102.3 GiB (this model: 26.2 / 103.7).
V4_BASELINE_BLOCK_COPIES = 1.5
# megatron's unfused q / k RMSNorm (the local spec, torch ops) leaves three fp32 [n, H, d]
# gradients alive in QSA's backward (scripts/profile_layer_memory.py, H200, 2026-11-30: two
# MulBackward0 and one ToCopyBackward0 of 3 GiB each at 128K).
QSA_NORM_FP32_GRADS = 3
# Stock DSA keeps many [T, H_I, T]-sized fp32 tensors alive at once (logits, ReLU, weighted
# product, the dense KL's attention scores and their gradients). Calibrated on the one stock
# point measured on the H200 (BENCHMARKS.md, GLM-5.1 layer, T = 8192: 122.8 GiB peak extra):
# 122.8 GiB / (8192^2 x 32 x 4 B) = 15.3 copies.
STOCK_DSA_TABLE_COPIES = 15.0


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer as bench_layer.py builds it (`kind`: dsa, csa, hca or qsa)."""

    kind: str
    hidden: int
    heads: int
    head_dim: int  # qk head dim (DSA: absorbed kv_lora + rope; V4: the shared K = V head)
    v_dim: int  # value dim per head fed to the output projection
    kv_heads: int  # key / value heads held per token (MLA / V4: one latent head)
    q_lora: int  # query low-rank width (0: none)
    indexer_heads: int
    indexer_dim: int
    topk: int  # entries selected per query (DSA tokens, CSA compressed entries, QSA blocks)
    window: int = 0  # V4 sliding window
    ratio: int = 1  # V4 compress ratio / QSA block size
    params: int = 0  # the layer's parameter count

    def keys(self, T: int) -> int:
        """Number of selectable keys for a sequence of T tokens."""
        return T // self.ratio


# GLM-5.1 DSA layer (bench_layer.py GLM51): MLA 64 heads, q_lora 2048, kv_lora 512, rope 64,
# qk_nope 192, v 256; indexer 32 x 128 top-2048.
GLM51_DSA = LayerGeometry(
    kind="dsa", hidden=6144, heads=64, head_dim=512 + 64, v_dim=256, kv_heads=1, q_lora=2048,
    indexer_heads=32, indexer_dim=128, topk=2048,
    params=(6144 * 2048 + 2048 * 64 * 256 + 6144 * 576 + 512 * 64 * (192 + 256)
            + 64 * 256 * 6144 + 2048 * 32 * 128 + 6144 * 128 + 6144 * 32),
)
_V4_PARAMS = (4096 * 1024 + 1024 * 64 * 512 + 4096 * 512  # q_a, q_b, kv
              + 64 * 512 * 1024 + 8 * 1024 * 4096)  # grouped o_a (8 groups of 4096 -> 1024), o_b
V4_CSA = LayerGeometry(
    kind="csa", hidden=4096, heads=64, head_dim=512, v_dim=512, kv_heads=1, q_lora=1024,
    indexer_heads=64, indexer_dim=128, topk=512, window=128, ratio=4,
    params=_V4_PARAMS + 2 * 4096 * 2 * 512  # compressor kv + gate (overlapping: 2 x dim)
    + 1024 * 64 * 128 + 4096 * 64 + 2 * 4096 * 2 * 128,  # indexer q_b, weights, compressor
)
V4_HCA = LayerGeometry(
    kind="hca", hidden=4096, heads=64, head_dim=512, v_dim=512, kv_heads=1, q_lora=1024,
    indexer_heads=0, indexer_dim=0, topk=0, window=128, ratio=128,
    params=_V4_PARAMS + 2 * 4096 * 512,
)
QSA_LAYER = LayerGeometry(
    kind="qsa", hidden=2560, heads=24, head_dim=256, v_dim=256, kv_heads=2, q_lora=0,
    indexer_heads=4, indexer_dim=128, topk=512, ratio=4,
    params=2560 * 2 * (2 * 12 + 2) * 256 + 24 * 256 * 2560 + 2560 * 5 * 128,
)
GEOMETRIES = {"dsa": GLM51_DSA, "csa": V4_CSA, "hca": V4_HCA, "qsa": QSA_LAYER}


def _attention_working(g: LayerGeometry, T: int, n: int, cp: int, c: int
                       ) -> dict[str, float]:
    """Bytes of the working set shared by HyScale and the baseline (everything but selection).

    c: rows whose per-row activations live at once (n, or the row_chunk of DSA / CSA / HCA:
    the queries, the attention output and their gradients, the output projection's input)."""
    bf, f32, i32 = 2, 4, 4
    h, H = g.hidden, g.heads
    items: dict[str, float] = {}
    gathered = T if cp > 1 else n  # allgather CP: the whole sequence's keys on every rank
    if g.kind == "dsa":
        items["projections (q latent, absorbed q, kv latent)"] = bf * (
            n * g.q_lora * 2 + c * H * g.head_dim * 2 + n * 576 * 2)
        items["gathered kv latent + fp32 grad"] = gathered * 576 * (bf + f32)
        items["indexer q / k / weights"] = n * bf * g.indexer_heads * g.indexer_dim \
            + gathered * g.indexer_dim * bf + n * g.indexer_heads * f32
        idx_cols = g.topk
        out_dim = 512  # absorbed attention output per head (kv_lora), then V up-projection
        shared_keys = gathered * (576 + g.indexer_dim)  # the keys every part reads
    elif g.kind in ("csa", "hca"):
        N = gathered // g.ratio
        items["projections (q latent, q raw / normed / rotated, kv)"] = bf * (
            n * g.q_lora * 2 + c * H * g.head_dim * 3 + n * g.head_dim * 3)
        overlap = 2 if g.kind == "csa" else 1
        items["compressor (kv, gate, fp32 softmax)"] = n * overlap * g.head_dim * (2 * bf + f32)
        # Raw keys: the local rows plus a halo of window - 1 tokens per zigzag chunk under CP.
        raw = n + (2 * (g.window - 1) if cp > 1 else 0)
        items["keys [compressed ; raw] + fp32 grad"] = (N + raw) * g.head_dim * (bf + f32)
        shared_keys = (N + raw) * g.head_dim + (N * g.indexer_dim if g.kind == "csa" else 0)
        if g.kind == "csa":
            items["indexer q / weights / compressor"] = n * bf * g.indexer_heads * g.indexer_dim \
                + n * g.indexer_heads * f32 + n * 2 * g.indexer_dim * (2 * bf + f32)
            idx_cols = g.topk + g.window
        else:  # HCA: every visible entry as a generated prefix (one int32 a row) + the window
            idx_cols = 1 + g.window
        out_dim = g.head_dim
    elif g.kind == "qsa":
        kv = g.kv_heads * g.head_dim
        items["projections (qkv+gate, q/k normed + rotated)"] = n * bf * (
            H * g.head_dim * 2 + kv * 2 + H * g.head_dim * 2 + kv)
        items["gathered k, v + fp32 grads"] = gathered * kv * 2 * (bf + f32)
        items["indexer q, gathered raw keys, pooled blocks"] = \
            n * (g.indexer_heads + 1) * g.indexer_dim * bf + gathered * g.indexer_dim * bf \
            + gathered // g.ratio * g.indexer_dim * f32
        idx_cols = g.topk * g.ratio + g.ratio - 1  # tokens of the selected blocks + the tail
        out_dim = g.head_dim
        items["q / k RMSNorm backward (fp32 [n, H, d] grads)"] = \
            QSA_NORM_FP32_GRADS * n * H * g.head_dim * f32
    else:
        raise ValueError(f"unknown layer kind {g.kind!r}")
    items["sparse-attention indices (int32)"] = n * idx_cols * i32
    # dq leaves the dQ kernel in the query's dtype (each row's is one program's registers).
    items["attention out + lse + dq"] = c * H * (out_dim * bf + f32 + g.head_dim * bf)
    items["output projection in/out"] = (c * H * g.v_dim + n * h) * bf
    items["kernel workspaces, allocator rounding"] = WORKSPACE_GIB * GIB
    if c < n:
        # The parts' gradients of the keys they all read are summed in fp32 (layers.row_chunks:
        # the sum and one part's fp32 addend), and a part's indexer loss holds its fp32
        # [rows, topk] target.
        items["row parts: shared-key fp32 gradient sums, a part's loss target"] = \
            shared_keys * 2 * f32 + c * g.topk * f32
    return items


def _selection(g: LayerGeometry, T: int, n: int, cp: int, variant: str) -> dict[str, float]:
    f32, i32 = 4, 4
    if g.kind == "hca" or g.topk == 0:
        return {}
    gathered = T if cp > 1 else n
    S = gathered // g.ratio  # selectable keys (DSA: tokens, CSA: entries, QSA: blocks)
    if variant == "hyscale":
        return {"HyTopK indices + scores": n * g.topk * (i32 + f32),
                "replay store (int32, first forward -> recompute)": n * g.topk * i32}
    if g.kind == "dsa":  # stock reference path: per-head logits, their copies, no chunking
        return {f"stock score tables ({STOCK_DSA_TABLE_COPIES:.0f} x [T/CP, H_I, T] fp32)":
                n * S * f32 * g.indexer_heads * STOCK_DSA_TABLE_COPIES}
    if g.kind == "csa":
        rows = min(n, V4_BASELINE_ROW_BLOCK)
        return {f"baseline score blocks ({V4_BASELINE_BLOCK_COPIES} x [4096, H_I, N] fp32) + "
                "fp32 q/k copies": rows * S * f32 * g.indexer_heads * V4_BASELINE_BLOCK_COPIES
                + (rows * g.indexer_heads + S) * g.indexer_dim * f32}
    # QSA baseline: chunks of 2**28 fp32 per-head logits, their ReLU and the head sum
    chunk = min(QSA_BASELINE_CHUNK_ELEMENTS, n * g.indexer_heads * S)
    return {"baseline logits chunk (fp32, x2 + head sum)": chunk * f32 * 2
            + chunk // g.indexer_heads * f32}


@dataclass
class LayerMemory:
    """The estimate's items (bytes) for one variant."""

    variant: str
    static: dict[str, float]
    working: dict[str, float]
    selection: dict[str, float]

    def total(self) -> float:
        return (sum(self.static.values()) + sum(self.working.values())
                + sum(self.selection.values()) + RESERVE_GIB * GIB)

    def peak_extra(self) -> float:
        """What bench_layer.py reports as peak extra (above weights and inputs)."""
        return sum(self.working.values()) + sum(self.selection.values())


def estimate_layer(model: str, T: int, cp: int = 1, variant: str = "hyscale",
                   row_chunk: int | None = None) -> LayerMemory:
    """Per-GPU memory of bench_layer.py's `--model model --seq T --cp cp [--row-chunk]` step."""
    if model not in GEOMETRIES:
        raise ValueError(f"model must be one of {sorted(GEOMETRIES)}, got {model!r}")
    if row_chunk is not None and (model == "qsa" or variant != "hyscale" or row_chunk < 1):
        raise ValueError(f"row_chunk applies to HyScale's dsa / csa / hca layers, a positive "
                         f"row count; got {row_chunk!r} for {model} / {variant}")
    if variant not in ("hyscale", "baseline"):
        raise ValueError(f"variant must be hyscale or baseline, got {variant!r}")
    if cp < 1 or T < 1 or T % (2 * cp):
        raise ValueError(f"sequence length {T} must be a positive multiple of 2 x CP = {2 * cp}")
    g = GEOMETRIES[model]
    n = T // cp
    static = {"weights + grads (bf16)": g.params * 4.0, "input, its grad, output grad":
              3.0 * n * g.hidden * 2}
    c = n if row_chunk is None else min(n, row_chunk)
    return LayerMemory(variant, static, _attention_working(g, T, n, cp, c),
                       _selection(g, T, n, cp, variant))


def format_layer_table(model: str, T: int, cp: int, gpu_gib: float,
                       variants: tuple[str, ...] = ("hyscale", "baseline"),
                       row_chunk: int | None = None) -> str:
    """A Markdown table of the estimate's items per variant, with totals against gpu_gib
    (row_chunk: HyScale's rows per part, the baseline has none)."""
    ests = [estimate_layer(model, T, cp, v, row_chunk if v == "hyscale" else None)
            for v in variants]
    names: list[str] = []
    for e in ests:
        for part in (e.static, e.working, e.selection):
            names += [k for k in part if k not in names]
    head = f"Per-GPU memory estimate, {model} layer, T = {T}, CP = {cp} (T/CP = {T // cp}), GiB"
    if row_chunk is not None:
        head += f", HyScale's attention rows in parts of {row_chunk}"
    lines = [head, "", "| item | " + " | ".join(variants) + " |",
             "|---|" + "---|" * len(variants)]
    for name in names:
        cells = []
        for e in ests:
            v = {**e.static, **e.working, **e.selection}.get(name)
            cells.append("-" if v is None else f"{v / GIB:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| reserve (CUDA context, NCCL, fragmentation) | "
                 + " | ".join(f"{RESERVE_GIB:.2f}" for _ in ests) + " |")
    lines.append("| **total per GPU** | " + " | ".join(f"**{e.total() / GIB:.1f}**" for e in ests)
                 + " |")
    fits = ["fits" if e.total() / GIB <= gpu_gib else "DOES NOT FIT" for e in ests]
    lines.append(f"| against {gpu_gib:.0f} GiB | " + " | ".join(fits) + " |")
    return "\n".join(lines)

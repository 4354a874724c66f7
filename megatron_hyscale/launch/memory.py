"""Per-GPU memory estimate for an MLA + DSA + MoE model under Megatron's parallel layouts.

The estimate is an accounting model, not a measurement: it adds up the tensors that must live
on a GPU at the peak of a training step, per pipeline stage, so that a layout can be chosen and
checked on paper before a 512-GPU job is submitted. What it counts (bytes; 1 GiB = 2**30):

- weights (bf16, 2 B/param), main gradients (`grad_bytes`, 4 by default: Megatron accumulates
  and reduces bf16 training's gradients in fp32 unless `--grad-reduce-in-bf16`), Adam state
  (fp32 master + m + v = 12 B/param) sharded by the distributed optimizer over the DP x CP
  group (non-expert weights) or the expert-data-parallel group (expert weights);
- stored activations under full recompute (`--recompute-granularity full --recompute-method
  uniform --recompute-num-layers 1`): each layer keeps only its input, [T/CP/TP(SP), h] bf16,
  per micro-batch in flight on that stage (1F1B: stage r holds PP - r micro-batches;
  interleaved: Megatron's warm-up count);
- HyScale's selection-replay store: the int32 [T/CP, k] indices of every layer's first forward,
  kept until its recompute, with the same in-flight count as the layer inputs;
- the working set of the one layer being recomputed and back-propagated (its saved forward
  tensors plus the larger of the attention / MLP backward transients), including the
  context-parallel all-gather of the latent KV and the indexer keys over the whole sequence;
- DSA selection buffers: HyScale keeps O(T_local x k) (indices + scores); stock megatron-core
  writes a score table, [T_local, H_I, T] fp32 logits plus the head sum with its reference
  backend, or [8192, T] fp32 per query block with the TileLang backend (both counted on top of
  the working set); its cudnn backend (`cudnn_selection_bytes`) scores row chunks of at most 1
  GiB (after the first, per head in fp32), runs the radix top-k with up to 2 GiB of scratch and
  keeps a dozen [T_local, k] buffers for its fused sparse indexer loss in the forward, and in
  the backward copies the attention's q, output, output gradient and indices twice (cat +
  index_select) around cuDNN's kernel. Those parts are alive in different phases of the layer's
  recompute and backward, never with the logits (the loss's backward has run before any
  layer's recompute), so stock cudnn's peak is the largest of them (`cudnn_layer_phases`): the
  attention forward (its forward parts on the attention's saved tensors), the MLP's recompute
  and backward (the attention's and MLP's saved tensors and the larger transient, as HyScale's
  working set, plus the int32 indices and indexer gradients the fused function keeps for its
  backward), the attention backward (the MLP's tensors freed: the attention's saved tensors
  and transient, its output gradient, the row copies and what the fused function kept), or
  the logits;
- the logits of the output layer on the last stage ([T/CP, V/TP]: bf16 logits, the fp32
  softmax the loss keeps and the fp32 gradient before its cast, LOGITS_BYTES per entry);
- a fixed reserve for the CUDA context, NCCL buffers and allocator fragmentation.

Calibration: one measured training run (BENCHMARKS.md, "Side by side with vanilla
Megatron-LM", two H200s, 2026-11-30; the small model at 16K, CP 2, EP 2; Megatron's `max
allocated`, which leaves out the reserve): HyScale 23.6 GiB, stock 72.5. Before it this model
said 18.9 and 35.0. Two terms were fitted to it, the logits (6 to 10 bytes an entry) and the
stock score table (STOCK_TABLE_COPIES copies of [T_local, H_I + 1, T] fp32 live at once, 1
before): it now says 23.6 and 72.7. One point fits two numbers, so treat other layouts'
figures as estimates to a few GiB; `tests/examples/test_glm5_1_launch.py` keeps this point.
The reference and TileLang tables are added to the working set (a sum over phases, which the
fitted copies absorb; TileLang's block is not measured).

The cudnn backend's terms are counted from megatron-core 0.19.2's source
(dsa_cudnn_kernels.py), nothing fitted. Two measured training runs check them (BENCHMARKS.md,
"Megatron-LM side by side on one H200" and "... at 64K on one H200", 2026-12-02, records
`benchmarks/results/2026-12-02-nvidia-h200-side_by_side-glm5_1-scaled-1gpu-cudnn{,-64k}.json`:
GLM-5.1 at full attention width, 2 layers, one H200, `--transformer-impl local`; `max
allocated`, reserve left out): stock cudnn 52.9 / 78.5 GiB at 32K / 64K, HyScale 52.5 / 77.7.
Until 2026-12-02 this model added the layer's whole cudnn extra to the working set and to the
logits' phase alike and said 60.4 / 93.6 for stock (+14 % / +19 %); by phases it says 53.3 /
79.5 (+0.9 % / +1.3 %): stock's peak is its attention backward (row copies 13.0 / 26.0 GiB on
the attention's tensors), which is about as large as the MLP phase that sets HyScale's; the
logits (10 / 20 GiB) are below both. HyScale's figure, unchanged, is 48.9 / 70.6 (-7 % / -9 %):
its MLP phase is short. A CPU profile (torch's memory timeline, 2026-12-02) of megatron-core's
MoE layer as this run builds it (local SequentialMLP, all-to-all dispatcher at EP 1) holds
three [T x router top-k, h] bf16 copies beside the experts' saved tensors at its forward's peak
(the dispatched tokens kept by MoELayer.forward, the experts' outputs and their concatenation),
where `_mlp_working` counts two (3.0 GiB at 32K); HyScale's library kernels also keep int32
indices and the indexer gradients (0.5 GiB); with both it would say 52.4 / 77.6. Not changed
here: the same term moves every variant's figure in every MoE layout, and its count with EP > 1
or Transformer Engine's grouped experts is not measured. The `tests/examples` calibration test
keeps both runs within stated bounds.

The layer-level comparison (BENCHMARKS.md, "The DSA layer against stock cudnn", one H200,
2026-12-01: one GLM-5.1 DSA layer forward + backward with recompute, stock cudnn's peak minus
HyScale's: 10.8 GiB at 32K, 43.0 at 128K): `selection_bytes`'s "stock_cudnn" (the larger of the
forward's parts and the backward's row copies) minus HyScale's buffers says 12.5 and 50.0,
about 16 % high.

Known simplifications (kept because they shift totals by a few GiB at most): norms and biases
are ignored, MoE tokens are assumed evenly spread over experts (no capacity factor: a hot
expert adds to the MoE working set), the loss/logits and the layer working set are not alive
together (the larger one counts), and the layer's working set adds the attention's and the
MLP's saved tensors to the larger of their transients (the attention's backward runs after the
MLP's has freed its tensors: an upper bound, kept for HyScale, the reference and TileLang).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30
# Rows per query block of megatron-core's TileLang DSA backend (DESIGN.md).
STOCK_TILELANG_BLOCK_ROWS = 8192
# Bytes per logits entry at the loss: bf16 logits + fp32 softmax + fp32 gradient (calibrated,
# see the module docstring).
LOGITS_BYTES = 10
# Score tables of stock's reference backend alive at once (calibrated, see the docstring).
STOCK_TABLE_COPIES = 3
# The stock DSA kernel backends the estimate knows (megatron-core's `dsa_kernel_backend`, with
# "reference" for its torch path, `none`).
STOCK_BACKENDS = ("reference", "tilelang", "cudnn")
# megatron-core 0.19.2's cudnn backend (dsa_cudnn_kernels.py): indexer scores in row chunks of at
# most _INDEXER_SCORE_CHUNK_MAX_BYTES (rows a multiple of _INDEXER_SCORE_CHUNK_ROW_ALIGNMENT),
# cuDNN's radix top-k with _TOPK_WRAPPER_MAX_SCRATCH_BYTES of int32 scratch (2 per key), and
# the indexer backward padded to 64 indexer heads (its SM90 kernel needs them).
CUDNN_SCORE_CHUNK_BYTES = 2**30
CUDNN_TOPK_SCRATCH_BYTES = 2 * 2**30
CUDNN_ROW_ALIGNMENT = 512
CUDNN_INDEXER_BWD_HEADS = 64
# Bytes per [T_local, k] entry the cudnn backend's forward holds at its peak, counted from its
# source and rounded up (a conservative count, not a measurement): top-k indices and scores as
# selected and compacted (int32 + fp32, twice), the int64 compaction sort keys and order (2 x 8),
# the attention's clamped global indices (int32, saved for backward), and the sparse indexer
# loss's log-probabilities, probabilities, target, clamped probabilities (4 x fp32) and
# backward indices (int32).
CUDNN_TOPK_ENTRY_BYTES = 48
# Copies of the attention's q [T, H, kv_lora + rope], output and output gradient [T, H, kv_lora]
# (bf16) and of its int32 [T, k] indices alive in the cudnn backend's sparse-attention backward:
# each is concatenated with a zero row, then index_select-ed to the rows with a selection, before
# cuDNN's kernel runs.
CUDNN_BWD_ROW_COPIES = 2
# The stock-only row of `estimate` per backend: the score table counted on top of the working
# set (reference, tilelang), or what cudnn's largest phase adds to it.
STOCK_EXTRA_ROWS = {"reference": "stock score table", "tilelang": "stock score table",
                    "cudnn": "stock cudnn extra at its peak"}


@dataclass(frozen=True)
class ModelGeometry:
    """An MLA + DSA + MoE decoder (the fields of a DeepSeek-V3.2 / GLM-5 style config)."""

    name: str
    num_layers: int
    hidden: int
    ffn_hidden: int  # dense-layer MLP width (SwiGLU: 3 matrices)
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    indexer_heads: int
    indexer_dim: int
    topk: int
    num_experts: int
    moe_ffn_hidden: int
    shared_ffn_hidden: int  # total width of the shared expert(s); 0 for none
    router_topk: int
    first_dense_layers: int
    vocab_size: int
    untied_embeddings: bool = True

    def attention_params(self) -> int:
        """MLA projections plus the DSA indexer of one layer."""
        h, heads = self.hidden, self.num_heads
        q_head = self.qk_nope_dim + self.qk_rope_dim
        mla = (
            h * self.q_lora_rank  # q down
            + self.q_lora_rank * heads * q_head  # q up
            + h * (self.kv_lora_rank + self.qk_rope_dim)  # kv down (+ shared rope key)
            + self.kv_lora_rank * heads * (self.qk_nope_dim + self.v_dim)  # kv up
            + heads * self.v_dim * h  # output projection
        )
        indexer = (
            self.q_lora_rank * self.indexer_heads * self.indexer_dim  # wq_b
            + h * self.indexer_dim  # wk
            + h * self.indexer_heads  # head weights
        )
        return mla + indexer

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.ffn_hidden

    def expert_params(self) -> int:
        """Routed experts of one MoE layer (these are the expert-parallel weights)."""
        return self.num_experts * 3 * self.hidden * self.moe_ffn_hidden

    def moe_nonexpert_params(self) -> int:
        """Shared expert and router of one MoE layer (tensor-parallel, not expert-parallel)."""
        return 3 * self.hidden * self.shared_ffn_hidden + self.hidden * self.num_experts

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden

    def is_moe(self, layer: int) -> bool:
        """Layer index (0-based): the first `first_dense_layers` are dense, the rest MoE."""
        return layer >= self.first_dense_layers

    def total_params(self) -> int:
        total = self.num_layers * self.attention_params()
        for layer in range(self.num_layers):
            if self.is_moe(layer):
                total += self.expert_params() + self.moe_nonexpert_params()
            else:
                total += self.dense_mlp_params()
        return total + self.embedding_params() * (2 if self.untied_embeddings else 1)

    def active_params(self) -> int:
        """Parameters used per token (router_topk of the routed experts)."""
        routed_unused = self.expert_params() * (1 - self.router_topk / self.num_experts)
        moe_layers = self.num_layers - self.first_dense_layers
        return self.total_params() - int(moe_layers * routed_unused)


@dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout and batch shape (one sequence per micro-batch by default)."""

    gpus: int
    seq_length: int
    global_batch: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    micro_batch: int = 1
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    grad_bytes: int = 4  # fp32 main grads; 2 with --grad-reduce-in-bf16
    distributed_optimizer: bool = True

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.ep * self.etp * self.pp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage, as Megatron splits them."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if self.pp == 1:
            return [num_layers]
        head = [first] if first is not None else []
        tail = [last] if last is not None else []
        middle_stages = self.pp - len(head) - len(tail)
        rest = num_layers - sum(head) - sum(tail)
        if middle_stages == 0:
            if rest != 0:
                raise ValueError(f"first/last stage layers do not add up to {num_layers}")
            return head + tail
        if rest <= 0 or rest % middle_stages:
            raise ValueError(
                f"{rest} layers do not split evenly over {middle_stages} middle pipeline stages"
            )
        return head + [rest // middle_stages] * middle_stages + tail

    def validate(self, model: ModelGeometry) -> None:
        """Raise ValueError naming the first constraint (Megatron's or DSA's) the layout breaks."""
        model_parallel = self.tp * self.cp * self.pp
        if self.gpus < model_parallel or self.gpus % model_parallel:
            raise ValueError(f"layout: gpus={self.gpus} is not a multiple of TP x CP x PP = "
                             f"{model_parallel}")
        checks = [
            ((self.tp * self.cp * self.dp) % (self.ep * self.etp) == 0,
             f"EP x ETP = {self.ep * self.etp} must divide TP x CP x DP = "
             f"{self.tp * self.cp * self.dp} (Megatron folds experts over those ranks)"),
            (model.num_experts % self.ep == 0,
             f"{model.num_experts} experts do not split over EP={self.ep}"),
            (model.num_heads % self.tp == 0, f"{model.num_heads} heads do not split over TP"),
            (self.cp == 1 or self.seq_length % (2 * self.cp) == 0,
             f"seq_length={self.seq_length} must be a multiple of 2 x CP = {2 * self.cp} "
             "(causal load balancing gives each CP rank two chunks)"),
            (self.global_batch % (self.micro_batch * self.dp) == 0,
             f"global batch {self.global_batch} is not a multiple of micro-batch x DP = "
             f"{self.micro_batch * self.dp}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"layout: {message}")
        stages = self.stage_layers(model.num_layers)
        if sum(stages) != model.num_layers or min(stages) < 1:
            raise ValueError(f"layout: pipeline stages {stages} do not hold {model.num_layers}")
        if self.vpp > 1 and any(n % self.vpp for n in stages):
            raise ValueError(f"layout: stage layer counts {stages} do not split into "
                             f"VPP={self.vpp}")

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage `stage` holds at its peak (units of its layers).

        1F1B: stage r runs PP - r - 1 warm-up forwards plus one before its first backward.
        Interleaved (VPP = v): Megatron's warm-up is 2 (PP - r - 1) + (v - 1) PP model chunks of
        L_stage / v layers, plus one; expressed here in whole-stage units (rounded up).
        """
        m = self.num_microbatches
        if self.vpp == 1:
            return min(m, self.pp - stage)
        chunks = 2 * (self.pp - stage - 1) + (self.vpp - 1) * self.pp + 1
        return min(m, math.ceil(chunks / self.vpp))


@dataclass
class StageMemory:
    """Bytes on one GPU of one pipeline stage, by component (see the module docstring)."""

    stage: int
    layers: int
    rows: dict[str, float] = field(default_factory=dict)
    hyscale_only: tuple[str, ...] = ("selection replay store", "HyScale selection buffers")
    stock_only: tuple[str, ...] = ("stock score table", "stock cudnn extra at its peak")

    def total(self, variant: str = "hyscale") -> float:
        skip = self.stock_only if variant == "hyscale" else self.hyscale_only
        return sum(v for k, v in self.rows.items() if k not in skip)


def _attention_working(model: ModelGeometry, layout: Layout) -> tuple[float, float]:
    """(saved forward bytes, backward transient bytes) of one DSA layer's attention on a rank."""
    t = layout.seq_length // layout.cp * layout.micro_batch  # local query rows
    full = layout.seq_length * layout.micro_batch  # keys after the CP all-gather
    heads = model.num_heads // layout.tp
    latent = model.kv_lora_rank + model.qk_rope_dim
    saved = 2 * (
        t * model.hidden  # normed input (all-gathered over TP when SP)
        + 2 * t * model.q_lora_rank  # q latent and its norm
        + t * latent  # local kv latent
        + full * latent  # all-gathered latent KV (allgather CP)
        + t * heads * (model.qk_nope_dim + model.qk_rope_dim)  # q heads
        + t * heads * latent  # absorbed q
        + t * heads * model.kv_lora_rank  # attention output in the latent space
        + t * heads * model.v_dim  # after the V up projection
        + t * model.indexer_heads * model.indexer_dim  # indexer q
        + full * model.indexer_dim  # all-gathered indexer keys
    ) + 4 * (t * model.indexer_heads + t * heads)  # indexer head weights, log-sum-exp (fp32)
    transient = 4 * (full * latent + full * model.indexer_dim) + 2 * (
        t * heads * latent + t * model.hidden  # fp32 KV / key grads before reduce-scatter
    )
    return float(saved), float(transient)


def _mlp_working(model: ModelGeometry, layout: Layout, moe: bool) -> tuple[float, float]:
    """(saved, transient) bytes of one layer's MLP on a rank (tokens sharded by TP under SP)."""
    n = layout.seq_length // layout.cp // layout.tp * layout.micro_batch
    h = model.hidden
    if not moe:
        f = model.ffn_hidden // layout.tp
        return float(2 * n * (h + 3 * f)), float(2 * n * (h + 2 * f))
    slots = n * model.router_topk  # token copies after dispatch (balanced routing)
    f = model.moe_ffn_hidden // layout.etp
    saved = 2 * slots * (h + 3 * f)  # fc1 input, fc1 output, activation output
    saved += 2 * n * (h + 3 * model.shared_ffn_hidden // layout.tp) + 8 * n * model.num_experts
    transient = 2 * 2 * slots * h  # all-to-all send and receive buffers
    return float(saved), float(transient)


def _chunk_rows(rows: int, bytes_per_row: int, max_bytes: int, alignment: int) -> int:
    """megatron-core's `_bytes_to_chunk_rows`: rows fitting max_bytes, rounded down to
    `alignment` when at least that many fit, at most `rows`."""
    chunk = max(1, max_bytes // max(1, bytes_per_row))
    if chunk >= alignment:
        chunk = chunk // alignment * alignment
    return min(rows, chunk)


def _cudnn_indexer_grads(model: ModelGeometry, t: int) -> int:
    """Bytes of the indexer gradients the cudnn backend's fused forward precomputes for t query
    rows and keeps for its backward (q, k bf16, head weights fp32)."""
    return t * (2 * model.indexer_heads * model.indexer_dim + 2 * model.indexer_dim
                + 4 * model.indexer_heads)


def cudnn_selection_bytes(model: ModelGeometry, layout: Layout) -> dict[str, float]:
    """Stock megatron-core's cudnn backend, one layer on one rank, by part (bytes; see
    dsa_cudnn_kernels.py of megatron-core 0.19.2). The forward parts (selection and the fused
    sparse indexer loss) are all taken as live at once, though the score chunks and the top-k
    scratch are freed before the loss allocates its buffers; "stock_cudnn" in selection_bytes
    is the larger of their sum and the backward's row copies (the layer-level extra), and
    `cudnn_layer_phases` places them in the layer's phases for `estimate` (module docstring)."""
    t = layout.seq_length // layout.cp * layout.micro_batch
    full = layout.seq_length  # keys (all-gathered under CP)
    score_rows = _chunk_rows(t, 4 * full, CUDNN_SCORE_CHUNK_BYTES, CUDNN_ROW_ALIGNMENT)
    topk_rows = _chunk_rows(score_rows, 2 * 4 * full, CUDNN_TOPK_SCRATCH_BYTES,
                            CUDNN_ROW_ALIGNMENT)
    heads = max(model.indexer_heads, CUDNN_INDEXER_BWD_HEADS)
    # after a first chunk on cuDNN, every chunk is scored per head by fp32 torch matmuls: one
    # head's [rows, keys] product beside the running sum (plus the keys in fp32)
    per_head = 4 * score_rows * full + 4 * full * model.indexer_dim if score_rows < t else 0
    latent = model.kv_lora_rank + model.qk_rope_dim
    attn_heads = model.num_heads // layout.tp
    return {
        "score chunk (fp32 rows x keys)": float(4 * score_rows * full),
        "per-head fp32 scores (chunks after the first)": float(per_head),
        "radix top-k scratch": float(2 * 4 * topk_rows * full),
        "[T, k] buffers (top-k, indexer loss)": float(CUDNN_TOPK_ENTRY_BYTES * t * model.topk),
        # the indexer backward's padded q and its gradient (bf16), plus the indexer gradients
        # its forward precomputes and keeps for backward
        "indexer backward": float(2 * 2 * t * heads * model.indexer_dim
                                  + _cudnn_indexer_grads(model, t)),
        # backward, not alive with the parts above
        "attention backward row copies": float(CUDNN_BWD_ROW_COPIES * (
            2 * t * attn_heads * (latent + 2 * model.kv_lora_rank) + 4 * t * model.topk)),
    }


_CUDNN_BWD = "attention backward row copies"


def cudnn_layer_phases(model: ModelGeometry, layout: Layout, *, moe: bool) -> dict[str, float]:
    """Stock cudnn: the working set of the layer (MoE or dense) being recomputed and
    back-propagated, on one rank, in each phase where part of the backend's extra is alive
    (bytes; the module docstring). The layer peaks at the largest; the output layer's logits
    are alive with none of them.

    - attention forward (the first forward's and the recompute's fused call): the attention's
      saved tensors (at most) and all of the forward's parts of `cudnn_selection_bytes`;
    - MLP (its recompute and backward): the attention's and the MLP's saved tensors, the larger
      transient (as HyScale's working set) and what the fused function keeps for its backward
      (the clamped int32 [T_local, k] indices and the indexer gradients it precomputes);
    - attention backward (the MLP's saved tensors are freed by then): the attention's saved
      tensors and transient, the attention output's gradient dO [T_local, H, kv_lora] bf16,
      the row copies and what the fused function kept.
    """
    parts = cudnn_selection_bytes(model, layout)
    t = layout.seq_length // layout.cp * layout.micro_batch
    heads = model.num_heads // layout.tp
    kept = 4 * t * model.topk + _cudnn_indexer_grads(model, t)
    d_out = 2 * t * heads * model.kv_lora_rank
    attn_saved, attn_transient = _attention_working(model, layout)
    mlp_saved, mlp_transient = _mlp_working(model, layout, moe)
    forward = sum(v for k, v in parts.items() if k != _CUDNN_BWD)
    return {
        "attention forward": attn_saved + forward,
        "MLP": attn_saved + mlp_saved + max(attn_transient, mlp_transient) + kept,
        "attention backward": attn_saved + attn_transient + d_out + parts[_CUDNN_BWD] + kept,
    }


def selection_bytes(model: ModelGeometry, layout: Layout) -> dict[str, float]:
    """DSA selection memory of one layer on one rank: HyScale vs stock megatron-core."""
    t = layout.seq_length // layout.cp * layout.micro_batch
    full = layout.seq_length * layout.micro_batch
    cudnn = cudnn_selection_bytes(model, layout)
    return {
        # int32 indices + fp32 scores: O(T_local x k), never a table.
        "hyscale": float(t * model.topk * 8),
        # reference backend: fp32 [T_local, b, H_I, T] logits, then the head sum [T_local, T],
        # with their ReLU / weighted copies (STOCK_TABLE_COPIES).
        "stock_reference": float(STOCK_TABLE_COPIES * 4 * t * full * (model.indexer_heads + 1)),
        # TileLang backend: one [8192, T] fp32 block (plus torch.topk over it).
        "stock_tilelang": float(4 * min(t, STOCK_TILELANG_BLOCK_ROWS) * full),
        # cudnn backend: the forward's score chunks, top-k scratch and [T_local, k] loss
        # buffers, or the backward's row copies, whichever is larger (one layer's extra; in a
        # training step `estimate` counts it by phases, `cudnn_layer_phases`)
        "stock_cudnn": max(sum(v for k, v in cudnn.items() if k != _CUDNN_BWD),
                           cudnn[_CUDNN_BWD]),
    }


def estimate(
    model: ModelGeometry,
    layout: Layout,
    *,
    stock_backend: str = "reference",
    reserve_gib: float = 6.0,
) -> list[StageMemory]:
    """Per-GPU memory of each pipeline stage (bytes in `StageMemory.rows`); stock_backend is
    one of STOCK_BACKENDS."""
    if stock_backend not in STOCK_BACKENDS:
        raise ValueError(f"stock_backend must be one of {STOCK_BACKENDS}, got {stock_backend!r}")
    layout.validate(model)
    stages = layout.stage_layers(model.num_layers)
    t = layout.seq_length // layout.cp * layout.micro_batch
    tokens_per_rank = t // layout.tp if layout.sequence_parallel else t
    layer_input = 2.0 * tokens_per_rank * model.hidden
    replay_entry = 4.0 * t * model.topk  # int32 indices per layer per micro-batch
    sel = selection_bytes(model, layout)
    attn_saved, attn_transient = _attention_working(model, layout)
    moe_saved, moe_transient = _mlp_working(model, layout, moe=True)
    dense_saved, dense_transient = _mlp_working(model, layout, moe=False)
    nonexpert_shard = layout.dp * layout.cp if layout.distributed_optimizer else 1
    expert_shard = layout.expert_dp if layout.distributed_optimizer else 1
    per_param_nonexpert = 2 + layout.grad_bytes + 12 / nonexpert_shard
    per_param_expert = 2 + layout.grad_bytes + 12 / expert_shard
    padded_vocab = math.ceil(model.vocab_size / (128 * layout.tp)) * 128 * layout.tp

    result = []
    first_layer = 0
    for stage, count in enumerate(stages):
        layers = range(first_layer, first_layer + count)
        first_layer += count
        moe_layers = sum(model.is_moe(i) for i in layers)
        nonexpert = count * model.attention_params() + moe_layers * model.moe_nonexpert_params()
        nonexpert += (count - moe_layers) * model.dense_mlp_params()
        if stage == 0:
            nonexpert += model.embedding_params()
        if stage == len(stages) - 1 and (model.untied_embeddings or len(stages) > 1):
            nonexpert += model.embedding_params()
        nonexpert /= layout.tp
        expert = moe_layers * model.expert_params() / (layout.ep * layout.etp)
        in_flight = layout.in_flight(stage)
        mlp = (moe_saved, moe_transient) if moe_layers else (dense_saved, dense_transient)
        layer = attn_saved + mlp[0] + max(attn_transient, mlp[1])
        logits = 0.0
        if stage == len(stages) - 1:
            logits = t * padded_vocab / layout.tp * LOGITS_BYTES
        # the layer being recomputed and back-propagated, or the loss, whichever is larger
        common = max(layer, logits)
        if stock_backend == "cudnn":
            # its extra is alive in phases of the layer, never with the logits: stock's peak is
            # the largest phase (or the logits), above the common working set by this much
            phases = cudnn_layer_phases(model, layout, moe=moe_layers > 0)
            stock_extra = max(logits, *phases.values()) - common
        else:
            stock_extra = sel[f"stock_{stock_backend}"]
        rows = {
            "weights (bf16)": 2 * (nonexpert + expert),
            f"main grads ({'fp32' if layout.grad_bytes == 4 else 'bf16'})":
                layout.grad_bytes * (nonexpert + expert),
            "Adam state (distributed)":
                nonexpert * (per_param_nonexpert - 2 - layout.grad_bytes)
                + expert * (per_param_expert - 2 - layout.grad_bytes),
            "layer inputs (full recompute)": layer_input * count * in_flight,
            "selection replay store": replay_entry * count * in_flight,
            "working set (1 layer / logits)": common,
            "HyScale selection buffers": sel["hyscale"],
            STOCK_EXTRA_ROWS[stock_backend]: stock_extra,
            "reserve (context, NCCL, fragments)": reserve_gib * GIB,
        }
        result.append(StageMemory(stage=stage, layers=count, rows=rows))
    return result


def peak_gib(stages: list[StageMemory], variant: str = "hyscale") -> float:
    return max(s.total(variant) for s in stages) / GIB


def longest_fitting_length(model: ModelGeometry, layout: Layout, capacity_gib: float,
                           variant: str, *, stock_backend: str = "reference",
                           step: int = 8192, limit: int = 1 << 22) -> int | None:
    """The longest sequence length, a multiple of `step` up to `limit`, at which `variant`'s
    estimated peak stays within `capacity_gib` (None if not even `step` does); every other
    field of `layout` kept. The estimate grows with the length, so the search stops at the
    first length that does not fit."""
    best = None
    for seq in range(step, limit + 1, step):
        candidate = Layout(**{**layout.__dict__, "seq_length": seq})
        try:
            candidate.validate(model)
        except ValueError:
            continue
        stages = estimate(model, candidate, stock_backend=stock_backend)
        if peak_gib(stages, variant) > capacity_gib:
            break
        best = seq
    return best


def format_table(
    model: ModelGeometry, layout: Layout, stages: list[StageMemory], *,
    stock_backend: str = "reference", gpu_gib: dict[str, float] | None = None,
) -> str:
    """A plain-text table: components by pipeline stage, in GiB, with totals and fit verdicts."""
    # Stages with identical rows (the middle ones) print once, labelled with their range.
    groups: list[tuple[str, StageMemory]] = []
    for s in stages:
        if groups and groups[-1][1].rows == s.rows and 0 < s.stage < len(stages) - 1:
            label = groups[-1][0].split("-")[0]
            groups[-1] = (f"{label}-{s.stage}", groups[-1][1])
        else:
            groups.append((str(s.stage), s))
    names = list(stages[0].rows)
    width = max(len(n) for n in names + ["total, stock DSA (" + stock_backend + ")"]) + 2
    col = 11
    lines = [
        f"{model.name}: {model.total_params() / 1e9:.0f}B parameters "
        f"({model.active_params() / 1e9:.0f}B active); layout TP={layout.tp} CP={layout.cp} "
        f"PP={layout.pp} VPP={layout.vpp} EP={layout.ep} ETP={layout.etp} DP={layout.dp} "
        f"on {layout.gpus} GPUs",
        f"sequence {layout.seq_length} tokens, {layout.seq_length // layout.cp} per CP rank, "
        f"micro-batch {layout.micro_batch}, global batch {layout.global_batch} "
        f"({layout.num_microbatches} micro-batches per step), full recompute",
        "",
        "per-GPU memory, GiB".ljust(width) + "".join(
            f"stage {label}".rjust(col) for label, _ in groups
        ),
        "layers".ljust(width) + "".join(str(s.layers).rjust(col) for _, s in groups),
        "micro-batches in flight".ljust(width) + "".join(
            str(layout.in_flight(s.stage)).rjust(col) for _, s in groups
        ),
    ]
    for name in names:
        lines.append(name.ljust(width) + "".join(
            f"{s.rows[name] / GIB:{col}.1f}" for _, s in groups
        ))
    lines.append("total, HyScale DSA".ljust(width) + "".join(
        f"{s.total('hyscale') / GIB:{col}.1f}" for _, s in groups
    ))
    lines.append(f"total, stock DSA ({stock_backend})".ljust(width) + "".join(
        f"{s.total('stock') / GIB:{col}.1f}" for _, s in groups
    ))
    for gpu, capacity in (gpu_gib or {}).items():
        verdicts = []
        for variant in ("hyscale", "stock"):
            peak = peak_gib(stages, variant)
            verdict = "fits" if peak <= capacity else "does NOT fit"
            verdicts.append(f"{'HyScale' if variant == 'hyscale' else 'stock'} {verdict} "
                            f"({peak:.1f} GiB peak)")
        lines.append(f"{gpu} ({capacity:.0f} GiB): " + "; ".join(verdicts))
    return "\n".join(lines)

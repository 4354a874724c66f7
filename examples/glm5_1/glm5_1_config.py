"""GLM-5.1 as Megatron-LM arguments: the model, the 512-GPU 1M-token layout, a 1-2 GPU variant.

The one place the GLM-5.1 configuration lives; every launch script in this folder imports it.
Standard library only, so dry runs need neither torch nor Megatron-LM.

Model (public GLM-5 / GLM-5.1 config, `glm_moe_dsa` in transformers): 78 layers, hidden 6144,
MLA with 64 heads (q_lora 2048, kv_lora 512, qk_nope 192, rope 64, v 256), DSA indexer 32 heads
x 128 keeping the top 2048 keys, MoE with 256 routed experts (width 2048) + 1 shared expert,
top-8 sigmoid routing with an expert-bias (aux-loss-free) balancer and scaling factor 2.5, the
first 3 layers dense (width 12288), vocabulary 154880, untied embeddings, RMSNorm eps 1e-5.

Assumptions where the public config does not settle a training argument (see README.md):
- `rope_theta`: RoPE base 1e6 (take the checkpoint's config.json value when loading released
  weights; it changes neither throughput nor memory). Plain RoPE (no YaRN) for the benchmark.
- the indexer keeps ReLU scoring (megatron's default) and no Hadamard rotation
  (`--no-dsa-indexer-rotate-activation`); indexer RoPE interleaved as in GLM's config.
- the indexer trains with the sparse KL (restricted to the selected keys, the DSA sparse
  training stage): the dense KL needs full attention over 1M keys.
- the multi-token-prediction layer (num_nextn_predict_layers = 1) is left out: it does not touch
  DSA and Megatron builds it from its own spec.
- a small sequence-wise auxiliary loss (1e-4) beside the expert bias, as in DeepSeek-V3.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from megatron_hyscale.launch.memory import Layout, ModelGeometry  # noqa: E402

GLM5_1 = ModelGeometry(
    name="GLM-5.1",
    num_layers=78,
    hidden=6144,
    ffn_hidden=12288,
    num_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_dim=192,
    qk_rope_dim=64,
    v_dim=256,
    indexer_heads=32,
    indexer_dim=128,
    topk=2048,
    num_experts=256,
    moe_ffn_hidden=2048,
    shared_ffn_hidden=2048,
    router_topk=8,
    first_dense_layers=3,
    vocab_size=154880,
)

# Scaled-down GLM-5.1 for one or two GPUs: the attention geometry per head, the indexer
# (32 x 128, top-2048) and the routing (top-8, 1 shared expert, first layer dense) are GLM's;
# depth, width, head count and expert count are cut so that it trains on one GPU at 32K tokens.
GLM5_1_SMALL = replace(
    GLM5_1,
    name="GLM-5.1-small",
    num_layers=4,
    hidden=2048,
    ffn_hidden=5632,
    num_heads=16,
    q_lora_rank=1024,
    num_experts=16,
    moe_ffn_hidden=1024,
    shared_ffn_hidden=1024,
    first_dense_layers=1,
)

# GLM-5.1 at its full attention width for 1 to 8 GPUs (issue 7's run): every attention and
# indexer dimension and the routing are GLM's; depth, expert count and vocabulary are cut (4
# layers, the first dense; 16 experts; 32K tokens, since 128K tokens a GPU of GLM's 154880-way
# fp32 logits alone would take 74 GiB) so that one host holds it with 128K tokens a GPU.
GLM5_1_SCALED = replace(
    GLM5_1,
    name="GLM-5.1-scaled",
    num_layers=4,
    num_experts=16,
    first_dense_layers=1,
    vocab_size=32768,
)
SCALED_TOKENS_PER_GPU = 131072  # 1M tokens on 8 GPUs at CP 8; 256K on 2


def with_layers(model: ModelGeometry, num_layers: int | None) -> ModelGeometry:
    """`model` with `num_layers` decoder layers (None: unchanged); its first dense layers stay
    dense (at most num_layers - 1 of them, so that a MoE layer remains), the rest are MoE."""
    if num_layers is None:
        return model
    if num_layers < 2:
        raise ValueError(f"num_layers must be at least 2 (a dense and a MoE layer), got "
                         f"{num_layers}")
    return replace(model, num_layers=num_layers,
                   first_dense_layers=min(model.first_dense_layers, num_layers - 1))

ROPE_BASE = 1_000_000  # assumption, see the module docstring
INDEXER_LOSS_COEFF = 0.01

# The 512-GPU, 1M-token layout (64 nodes x 8 GPUs); README.md "Parallel layout" says why.
#   TP 1: HyScale's fast path does not run sequence-parallel TP yet (it would fall back to the
#         stock layer), MoE with TP > 1 requires SP, and the DSA indexer is replicated over TP
#         ranks, so TP would multiply the dominant 1M-token cost (the indexer scan) instead of
#         dividing it; CP divides it.
#   CP 64: 16384 tokens per rank (two zigzag chunks of 8192); per-rank stored activations and
#         HyScale's O(T_local x k) selection shrink with CP; DSA's CP is allgather.
#   PP 8: with TP 1 the 19B non-expert weights must be split by the pipeline; 9/10x6/9 layers.
#   EP 64 (ETP 1): 4 experts per rank; EP x PP = 512 keeps each expert on exactly one GPU.
#   DP 1, micro-batch 1 (one 1M sequence), 64 micro-batches per step: 64M tokens per step,
#         pipeline bubble 7/71 = 10%. No VPP: it would raise stage 0's in-flight activations.
FULL_LAYOUT = Layout(
    gpus=512,
    seq_length=1024 * 1024,
    global_batch=64,
    tp=1,
    cp=64,
    pp=8,
    ep=64,
    etp=1,
    vpp=1,
    first_stage_layers=9,
    last_stage_layers=9,
)

SMALL_SEQ_LENGTH = 32768
# The side-by-side default: stock's score tables at 32K on 2 GPUs (about 190 GiB a GPU by the
# calibrated estimate) do not fit an H200; at 16K they ran (72.5 GiB, 2026-11-30).
SIDE_BY_SIDE_SEQ_LENGTH = 16384


def small_layout(gpus: int = 1, seq_length: int = SMALL_SEQ_LENGTH, global_batch: int = 4
                 ) -> Layout:
    """1 GPU: no parallelism. 2 GPUs: CP 2 (exercises DSA's context parallelism) and EP 2."""
    if gpus not in (1, 2):
        raise ValueError(f"the small configuration runs on 1 or 2 GPUs, not {gpus}")
    return Layout(gpus=gpus, seq_length=seq_length, global_batch=global_batch, cp=gpus, ep=gpus)


def scaled_layout(gpus: int = 8, seq_length: int | None = None, global_batch: int = 2
                  ) -> Layout:
    """The scaled model on one host: CP = EP = gpus (1, 2, 4 or 8), SCALED_TOKENS_PER_GPU tokens
    a GPU unless seq_length says otherwise; two sequences a step (replay with 2 in flight)."""
    if gpus not in (1, 2, 4, 8):
        raise ValueError(f"the scaled configuration runs on 1, 2, 4 or 8 GPUs, not {gpus}")
    seq = seq_length or SCALED_TOKENS_PER_GPU * gpus
    return Layout(gpus=gpus, seq_length=seq, global_batch=global_batch, cp=gpus, ep=gpus)


# GPU classes the layouts are checked against (GiB the estimate may use, whole device).
GPU_GIB = {"H20": 96.0, "H800": 80.0}
SMALL_GPU_GIB = {"H800": 80.0, "H200": 140.0}

SPECS = {
    "hyscale": ("megatron_hyscale.specs", "hyscale_dsa_layer_spec"),
    "stock": ("megatron_hyscale.specs", "stock_dsa_layer_spec"),
}


def model_args(model: ModelGeometry) -> list[str]:
    """Architecture: MLA, DSA indexer, MoE, norms and embeddings."""
    moe_layers = model.num_layers - model.first_dense_layers
    return [
        "--num-layers", str(model.num_layers),
        "--hidden-size", str(model.hidden),
        "--ffn-hidden-size", str(model.ffn_hidden),
        "--num-attention-heads", str(model.num_heads),
        "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-5",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--vocab-size", str(model.vocab_size),
        "--position-embedding-type", "rope",
        "--rope-type", "rope",
        "--rotary-base", str(ROPE_BASE),
        "--no-rope-fusion",  # megatron-core asserts it off for DSAttention
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--init-method-std", "0.02",
        # MLA
        "--multi-latent-attention",
        "--q-lora-rank", str(model.q_lora_rank),
        "--kv-lora-rank", str(model.kv_lora_rank),
        "--qk-head-dim", str(model.qk_nope_dim),
        "--qk-pos-emb-head-dim", str(model.qk_rope_dim),
        "--v-head-dim", str(model.v_dim),
        # DSA
        "--experimental-attention-variant", "dsa",
        "--dsa-indexer-n-heads", str(model.indexer_heads),
        "--dsa-indexer-head-dim", str(model.indexer_dim),
        "--dsa-indexer-topk", str(model.topk),
        "--dsa-indexer-loss-coeff", str(INDEXER_LOSS_COEFF),
        "--dsa-indexer-use-sparse-loss",
        "--dsa-indexer-rope-interleaved",
        "--no-dsa-indexer-rotate-activation",
        # MoE
        "--num-experts", str(model.num_experts),
        "--moe-layer-freq", f"([0]*{model.first_dense_layers}+[1]*{moe_layers})",
        "--moe-ffn-hidden-size", str(model.moe_ffn_hidden),
        "--moe-shared-expert-intermediate-size", str(model.shared_ffn_hidden),
        "--moe-router-topk", str(model.router_topk),
        "--moe-router-score-function", "sigmoid",
        "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "1e-3",
        "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-aux-loss-coeff", "1e-4",
        "--moe-router-dtype", "fp32",
        "--moe-token-dispatcher-type", "alltoall",
    ]


# Transformer Engine implementations: "transformer_engine" (the default; grouped expert GEMMs and
# fused token permutation) or "local" (megatron's torch modules, for machines without TE).
TRANSFORMER_IMPLS = ("transformer_engine", "local")


def impl_args(transformer_impl: str = "transformer_engine") -> list[str]:
    """The module implementation and the MoE fusions that need Transformer Engine."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, "
                         f"got {transformer_impl!r}")
    if transformer_impl == "local":
        # Megatron defaults to kernels that come with TE or apex: the persistent layer norm and
        # the fused weight-gradient accumulation of its local linears.
        return ["--transformer-impl", "local", "--no-persist-layer-norm",
                "--no-gradient-accumulation-fusion"]
    args = ["--transformer-impl", "transformer_engine", "--moe-grouped-gemm",
            "--moe-permute-fusion"]
    # Megatron's output layer is its own ColumnParallelLinear even under TE, and its fused
    # weight-gradient accumulation is apex's extension: without apex, Megatron stops at start-up.
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        args.append("--no-gradient-accumulation-fusion")
    return args


def parallel_args(layout: Layout) -> list[str]:
    """Parallelism, recompute and batch shape."""
    args = [
        "--tensor-model-parallel-size", str(layout.tp),
        "--pipeline-model-parallel-size", str(layout.pp),
        "--context-parallel-size", str(layout.cp),
        "--expert-model-parallel-size", str(layout.ep),
        "--expert-tensor-parallel-size", str(layout.etp),
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        # full recompute of every layer: only layer inputs (and HyScale's selections) are kept
        "--recompute-granularity", "full",
        "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
        "--micro-batch-size", str(layout.micro_batch),
        "--global-batch-size", str(layout.global_batch),
        "--seq-length", str(layout.seq_length),
        "--max-position-embeddings", str(layout.seq_length),
    ]
    if layout.cp > 1:
        args += ["--cp-comm-type", "allgather"]  # the only CP type DSA supports
    if layout.tp > 1:
        args += ["--sequence-parallel"]  # required by MoE with TP > 1
    if layout.pp > 1 and layout.first_stage_layers is not None:
        args += ["--decoder-first-pipeline-num-layers", str(layout.first_stage_layers)]
    if layout.pp > 1 and layout.last_stage_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", str(layout.last_stage_layers)]
    if layout.vpp > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(layout.vpp)]
    if layout.grad_bytes == 2:
        args += ["--grad-reduce-in-bf16"]
    return args


def training_args(train_iters: int) -> list[str]:
    """Optimizer, precision, logging, and mock data (override with your own after `--`)."""
    return [
        "--bf16",
        "--optimizer", "adam",
        "--lr", "1e-5",
        "--min-lr", "1e-6",
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "0",
        "--weight-decay", "0.1",
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--clip-grad", "1.0",
        "--train-iters", str(train_iters),
        "--eval-iters", "0",
        # no evaluation, but Megatron-LM divides by the interval when it sizes the datasets
        "--eval-interval", str(train_iters),
        "--log-interval", "1",
        "--distributed-timeout-minutes", "60",  # a 1M-token iteration takes minutes
        # a [T, T] mask at 1M tokens would be 1 TiB; DSA builds its causal selection itself
        "--no-create-attention-mask-in-dataloader",
        "--cross-entropy-loss-fusion",
        "--mock-data",
        "--tokenizer-type", "NullTokenizer",
    ]


def megatron_args(model: ModelGeometry, layout: Layout, *, spec: str = "hyscale",
                  train_iters: int = 10, extra: list[str] | None = None,
                  transformer_impl: str = "transformer_engine") -> list[str]:
    """The full Megatron-LM argument list for `pretrain_gpt.py` (`spec`: hyscale | stock;
    `transformer_impl`: transformer_engine | local, see `impl_args`)."""
    layout.validate(model)
    module, name = SPECS[spec]
    return (model_args(model) + impl_args(transformer_impl) + parallel_args(layout)
            + training_args(train_iters) + ["--spec", module, name] + list(extra or []))

"""Demo: train a tiny MLA + DSA GPT with HyScale's layer spec, megatron-core's stock spec beside it.

The task is synthetic long-range associative recall, where the sparse selection decides the
answer: each sequence opens with a few facts (key/value pairs, one fact token naming a key k
and its value v), then "near" queries `k v` (short range: these rows see fewer keys than the
top-k, so they attend densely and teach the model the lookup), then distractor filler, and the
last tokens are "far" queries `k v`, hundreds of tokens after the facts. Only the answers v are
scored. A far query row attends to `--topk` of its ~`--seq-len` keys, so it is answered only if
the lightning indexer learns to put the right fact token in its top-k.

Both models start from the same weights (the stock model is built, its state dict is loaded
into the HyScale model), see the same batches in the same order and use the same torch Adam,
so their loss curves coincide until fp32 rounding differences, amplified by training, make the
two runs drift apart. Exactness is therefore measured on identical weights: at every step a
third model with the stock layer is loaded with HyScale's current weights and scores the same
batch; the demo reports the largest loss difference of that comparison, and how long the two
independent curves stayed together. It also reports
the indexer's recall (`megatron_hyscale.testing.recall`): the share of the keys that hold 90%
of the true (dense, head-averaged) attention of each answer row that the indexer's top-k
selected, per layer, and how often the top-k held the fact token the answer needs.

Run: `python -m megatron_hyscale.demo` (CPU: a few minutes; `--device cuda` or auto on a GPU).
Outputs (`--out`, default outputs/demo/): metrics.json and curves.png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VOCAB_SIZE = 128
AGREE_TOL = 1e-4  # |loss HyScale - loss stock| below this counts as the same curve


# --------------------------------------------------------------------------- the task


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """Synthetic associative recall: `n_pairs` facts up front, near and far queries about them.

    Vocabulary (VOCAB_SIZE = 128 ids): fact tokens [0, n_keys * n_values) (id = key *
    n_values + value: one token per key/value pair), key tokens, value tokens, and the rest
    filler. One sequence reads

        fact_1 .. fact_P | key value (x n_near) | filler ... | key value (x n_far)

    with distinct keys among the facts and each query's key drawn from them. The logits at a
    query key's position are scored against its value (an "answer row"). Near queries sit
    right after the facts, where a row sees fewer keys than the top-k, so attention there is
    dense: they teach the main attention the lookup. Far queries sit at the end, hundreds of
    tokens away: they are answered only if the indexer's top-k holds the right fact token.
    """

    seq_len: int
    n_pairs: int = 8
    n_near: int = 4
    n_far: int = 8
    n_keys: int = 8
    n_values: int = 8
    min_filler: int = 64

    def __post_init__(self) -> None:
        if self.n_pairs > self.n_keys:
            raise ValueError(f"n_pairs ({self.n_pairs}) must be <= n_keys ({self.n_keys})")
        if not 1 <= self.n_far <= self.n_pairs:
            raise ValueError(f"n_far ({self.n_far}) must be in [1, n_pairs = {self.n_pairs}]")
        if self.n_near < 0:
            raise ValueError(f"n_near must be >= 0, got {self.n_near}")
        if self.filler_base >= VOCAB_SIZE:
            raise ValueError("the task's fact, key and value tokens do not fit the vocabulary")

    @property
    def key_base(self) -> int:
        return self.n_keys * self.n_values

    @property
    def value_base(self) -> int:
        return self.key_base + self.n_keys

    @property
    def filler_base(self) -> int:
        return self.value_base + self.n_values

    @property
    def filler_start(self) -> int:
        return self.n_pairs + 2 * self.n_near

    @property
    def far_start(self) -> int:
        return self.seq_len - 2 * self.n_far

    @property
    def min_seq_len(self) -> int:
        """Facts, near queries, at least `min_filler` distractors, far queries."""
        return self.filler_start + self.min_filler + 2 * self.n_far

    def far_slice(self) -> slice:
        """The far queries' columns in answer_rows() / targets / fact_pos."""
        return slice(self.n_near, self.n_near + self.n_far)

    def answer_rows(self) -> torch.Tensor:
        """int64 [n_near + n_far]: positions whose next-token logits must name an answer."""
        near = torch.arange(self.n_pairs, self.filler_start, 2)
        return torch.cat([near, torch.arange(self.far_start, self.seq_len, 2)])

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """ids [B, T]; per answer row (near, then far): targets and fact_pos [B, n_near + n_far].

        fact_pos is the position of the fact token that holds the answer (the "needle").
        """
        b, p = batch_size, self.n_pairs
        keys = torch.argsort(torch.rand(b, self.n_keys, generator=generator), dim=1)[:, :p]
        values = torch.randint(0, self.n_values, (b, p), generator=generator)
        ids = torch.randint(self.filler_base, VOCAB_SIZE, (b, self.seq_len), generator=generator)
        ids[:, :p] = keys * self.n_values + values
        # Near queries may repeat a fact; far ones do not, so that no far query can copy its
        # answer from an earlier far query next to it: each needs a long-range lookup.
        near = torch.randint(0, p, (b, self.n_near), generator=generator)
        far = torch.argsort(torch.rand(b, p, generator=generator), dim=1)[:, : self.n_far]
        asked = torch.cat([near, far], dim=1)
        rows = self.answer_rows()
        ids[:, rows] = self.key_base + keys.gather(1, asked)
        targets = self.value_base + values.gather(1, asked)
        ids[:, rows + 1] = targets
        return {"ids": ids, "targets": targets, "fact_pos": asked}


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (all arguments have defaults sized for a 2-core CPU)."""
    p = argparse.ArgumentParser(
        prog="python -m megatron_hyscale.demo",
        description="Train a tiny MLA + DSA GPT on long-range associative recall with "
        "HyScale's layer spec and megatron-core's stock spec from the same weights; print "
        "loss, accuracy, tokens/s, indexer loss and recall; write a plot and a JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per model")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--topk", type=int, default=64,
                   help="keys each query attends to (DSA indexer top-k); below --seq-len")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=1234, help="seed for weights and data")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available")
    p.add_argument("--out", type=Path, default=Path("outputs/demo"),
                   help="folder for metrics.json and curves.png")
    p.add_argument("--no-stock", action="store_true",
                   help="skip the side-by-side megatron-core stock DSA run")
    p.add_argument("--log-every", type=int, default=50, help="print a table row every N steps")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (FFN: 2x)")
    p.add_argument("--keys", type=int, default=4,
                   help="distinct keys and distinct values of the task (chance: 1/keys)")
    p.add_argument("--pairs", type=int, default=4, help="key/value facts per sequence")
    p.add_argument("--near-queries", type=int, default=24,
                   help="queries right after the facts (dense attention: teaches the lookup)")
    p.add_argument("--far-queries", type=int, default=4,
                   help="queries at the end of the sequence (need the indexer to find the fact)")
    p.add_argument("--indexer-loss-coeff", type=float, default=1.0,
                   help="weight of the indexer's KL loss (dsa_indexer_loss_coeff)")
    p.add_argument("--indexer-relu", choices=("on", "off"), default="off",
                   help="ReLU on each indexer head's logit (DeepSeek-V3.2: on; GLM-5: off). With "
                   "ReLU, keys whose heads are all negative score exactly 0 and tie; stock's "
                   "torch.topk breaks such ties arbitrarily, HyScale by the smaller index, so "
                   "the two runs may pick different keys and their losses drift apart")
    p.add_argument("--indexer-precision", choices=("bf16", "fp8"), default="bf16",
                   help="HyScale's selection precision (config.hyscale_indexer_precision): bf16 "
                   "scores the indexer's q and k as they are (fp32 on a CPU), fp8 their e4m3 "
                   "copies with per-token scales (ops.hytopk(precision='fp8')); the indexer loss "
                   "keeps the unquantized tensors. Stock always selects unquantized")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's default, one per core). One is the "
                   "fastest for the demo's many small ops, and it keeps its speed when other "
                   "processes share the cores (two threads per op then wait on each other)")
    p.add_argument("--all-warnings", action="store_true",
                   help="also show megatron-core's known deprecation and fallback warnings "
                   "(hidden by default; megatron_hyscale.testing.quiet lists each)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def validate_args(args: argparse.Namespace) -> RecallTask:
    """Reject bad arguments with a ValueError that names the argument; return the task."""
    for name in ("steps", "seq_len", "topk", "batch_size", "log_every", "layers", "hidden", "keys",
                 "pairs",
                 "far_queries"):
        value = getattr(args, name)
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    if args.indexer_loss_coeff < 0:
        raise ValueError(f"--indexer-loss-coeff must be >= 0, got {args.indexer_loss_coeff}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if args.near_queries < 0:
        raise ValueError(f"--near-queries must be >= 0, got {args.near_queries}")
    if args.far_queries > args.pairs:
        raise ValueError(f"--far-queries ({args.far_queries}) must be <= --pairs ({args.pairs}): "
                         "each far query asks about a different fact")
    if args.keys * (args.keys + 2) >= VOCAB_SIZE:
        raise ValueError(f"--keys {args.keys}: facts, keys and values must fit the {VOCAB_SIZE} "
                         "token vocabulary with room for filler (at most 10)")
    if args.pairs > args.keys:
        raise ValueError(f"--pairs ({args.pairs}) must be <= --keys ({args.keys}): each fact "
                         "has its own key")
    task = RecallTask(args.seq_len, n_pairs=args.pairs, n_near=args.near_queries,
                      n_far=args.far_queries, n_keys=args.keys, n_values=args.keys)
    if args.seq_len < task.min_seq_len:
        raise ValueError(
            f"--seq-len must be >= {task.min_seq_len} for {args.pairs} facts, "
            f"{args.near_queries} near and {args.far_queries} far queries and "
            f"{task.min_filler} filler tokens between them, got {args.seq_len}"
        )
    if args.topk <= task.filler_start:
        raise ValueError(
            f"--topk must be > {task.filler_start} (the facts and near queries, which are "
            f"meant to be attended densely), got {args.topk}"
        )
    if args.topk >= args.seq_len:
        raise ValueError(
            f"--topk must be < --seq-len ({args.seq_len}) so that the selection matters, "
            f"got {args.topk}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    return task


# --------------------------------------------------------------------------- models


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


@contextlib.contextmanager
def megatron_runtime(device: torch.device, seed: int) -> Iterator[None]:
    """megatron-core's process groups and RNG tracker; its CUDA calls redirected on a CPU."""
    from hyscale_bench.cpu import init_single_process, megatron_on_cpu

    with megatron_on_cpu() if device.type == "cpu" else contextlib.nullcontext():
        init_single_process(seed)
        yield


def build_models(args: argparse.Namespace, device: torch.device) -> dict[str, torch.nn.Module]:
    """The HyScale model (and the stock one unless --no-stock), both with the stock weights.

    The stock model is always built first, from the seed, and its state dict is loaded into the
    HyScale model (strict): HyScale's initial weights do not depend on --no-stock, and the load
    itself shows that a stock checkpoint fits HyScale's modules.
    """
    from hyscale_bench.models import build_gpt, tiny_dsa_config

    config = tiny_dsa_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=2 * args.hidden,
        dsa_indexer_topk=args.topk,
        dsa_indexer_loss_coeff=args.indexer_loss_coeff,
        dsa_indexer_scoring_relu=args.indexer_relu == "on",
    )
    torch.manual_seed(args.seed)
    stock = build_gpt(config, stock=True, vocab_size=VOCAB_SIZE,
                      max_sequence_length=args.seq_len)
    hyscale = build_gpt(config, stock=False, vocab_size=VOCAB_SIZE,
                        max_sequence_length=args.seq_len)
    hyscale.load_state_dict(stock.state_dict(), strict=True)
    for attention in core_attentions(hyscale):  # the stock layers never read it
        attention.config.hyscale_indexer_precision = args.indexer_precision
    models = {"hyscale": hyscale.to(device)}
    if not args.no_stock:
        models["stock"] = stock.to(device)
        # Not trained: each step it gets HyScale's current weights and scores the same batch,
        # so the two layers are compared on identical weights at every step of the run.
        models["stock_check"] = build_gpt(config, stock=True, vocab_size=VOCAB_SIZE,
                                          max_sequence_length=args.seq_len).to(device)
    return models


def core_attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each layer's DSA core-attention module (stock DSAttention or HyScale's), in layer order."""
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


# --------------------------------------------------------------------------- training


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _take_indexer_loss(coeff: float) -> list[float]:
    """This step's indexer KL per layer (the logged loss / coeff); then clear the tracker."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    out = [] if values is None or coeff == 0 else (values.detach().cpu() / coeff).tolist()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    return out


def answer_loss(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy on the answer rows only; returns (loss, answer logits [B, answers, V])."""
    logits = model(ids, positions, None)  # [B, T, V]; no labels: we score the answers only
    answer_logits = logits.index_select(1, rows).float()
    loss = F.cross_entropy(answer_logits.reshape(-1, answer_logits.size(-1)), targets.reshape(-1))
    return loss, answer_logits


@torch.no_grad()
def stock_loss_on(weights_of: torch.nn.Module, stock: torch.nn.Module,
                  batch: dict[str, torch.Tensor], task: RecallTask,
                  device: torch.device) -> float:
    """The stock layer's answer loss on `weights_of`'s current weights and this batch."""
    stock.load_state_dict(weights_of.state_dict(), strict=True)
    stock.train()  # the same mode (and so the same code path) as the training forward
    ids = batch["ids"].to(device)
    positions = torch.arange(task.seq_len, device=device).expand_as(ids)
    loss, _ = answer_loss(stock, ids, positions, task.answer_rows().to(device),
                          batch["targets"].to(device))
    return loss.item()


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
    task: RecallTask, coeff: float, device: torch.device,
) -> dict[str, Any]:
    """One forward/backward/Adam step on the answer rows; loss, accuracy, seconds, indexer KL."""
    _take_indexer_loss(coeff)  # a stale value (an aborted step, the other model) must not leak
    ids = batch["ids"].to(device)
    targets = batch["targets"].to(device)
    positions = torch.arange(task.seq_len, device=device).expand_as(ids)
    rows = task.answer_rows().to(device)
    _sync(device)
    start = time.perf_counter()
    loss, answer_logits = answer_loss(model, ids, positions, rows, targets)
    loss.backward()  # the indexer's KL joins through megatron's DSAIndexerLossAutoScaler
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    seconds = time.perf_counter() - start
    correct = (answer_logits.argmax(-1) == targets).float()
    far = task.far_slice()
    return {
        "loss": loss.item(),
        "accuracy": correct[:, far].mean().item(),  # far queries: where selection matters
        "near_accuracy": correct[:, : task.n_near].mean().item() if task.n_near else None,
        "seconds": seconds,
        "indexer_kl": _take_indexer_loss(coeff),
    }


@torch.no_grad()
def _core_attention_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                           task: RecallTask, device: torch.device
                           ) -> dict[int, inspect.BoundArguments]:
    """Each layer's core-attention call arguments on `batch` (an eval-mode forward, captured by
    forward pre-hooks, so whatever the module does inside)."""
    captured: dict[int, inspect.BoundArguments] = {}

    def hook(index: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        captured[index] = inspect.signature(module.forward).bind(*args, **kwargs)

    handles = [
        m.register_forward_pre_hook(
            lambda mod, a, kw, i=i: hook(i, mod, a, kw), with_kwargs=True
        )
        for i, m in enumerate(core_attentions(model))
    ]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = batch["ids"].to(device)
            model(ids, torch.arange(task.seq_len, device=device).expand_as(ids), None)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return captured


def capture_indexer(model: torch.nn.Module, batch: dict[str, torch.Tensor], task: RecallTask,
                    topk: int, device: torch.device) -> dict[str, Any]:
    """The trained first layer's lightning-indexer tensors on `batch`, for
    scripts/bench_selection.py (`--captured`): q fp32 [B, T, H, D], k [B, T, D], weights
    [B, T, H] (batch-first, as `ops.hytopk` takes them), its ReLU setting and the top-k."""
    module = core_attentions(model)[0]
    a = _core_attention_inputs(model, batch, task, device)[0].arguments
    with torch.no_grad():
        q, k, w = module.indexer.forward_before_topk(a["x"], a["qr"])
    return {"q": q.transpose(0, 1).float().cpu().contiguous(),
            "k": k.transpose(0, 1).float().cpu().contiguous(),
            "weights": w.transpose(0, 1).float().cpu().contiguous(),
            "relu": bool(module.config.dsa_indexer_scoring_relu), "topk": topk,
            "source": "megatron_hyscale.demo (recall task), layer 1, held-out batch"}


def measure_recall(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], task: RecallTask, topk: int,
    device: torch.device, mass: float = 0.9,
) -> list[dict[str, float]]:
    """Per layer: the indexer's recall of the 90%-mass keys of the far answer rows (eval mode),
    and the Jaccard overlap of its top-k (HyScale's `hytopk`) with stock megatron-core's
    selection (`fused_qk_topk_naive`) on the same weights and rows (`jaccard_vs_stock`).

    The core-attention inputs are captured by a forward pre-hook (so this works whatever the
    module does inside); the indexer's selection is recomputed from them with `hytopk`, the
    exact DSA top-k, and compared with the dense attention from the same query and key.
    """
    from megatron_hyscale.ops import hytopk
    from megatron_hyscale.selection_agreement import jaccard, stock_topk
    from megatron_hyscale.testing.recall import head_mean_attention, selection_recall

    modules = core_attentions(model)
    captured = _core_attention_inputs(model, batch, task, device)

    # Far rows only: near rows see fewer keys than the top-k, so their recall is always 1.
    rows = task.answer_rows()[task.far_slice()].to(device)
    fact_pos = batch["fact_pos"][:, task.far_slice()].to(device)  # [B, Q]: the needed fact
    relu = bool(getattr(modules[0].config, "dsa_indexer_scoring_relu", True))
    results: list[dict[str, float]] = []
    selections: dict[int, torch.Tensor] = {}
    for i, module in enumerate(modules):
        a = captured[i].arguments
        if getattr(module, "indexer", None) is not None:
            q, k, w = module.indexer.forward_before_topk(a["x"], a["qr"])
            # sbhd -> bshd; only the answer rows, at their positions in the sequence.
            selected, _ = hytopk(
                q.index_select(0, rows).transpose(0, 1).float(), k.transpose(0, 1).float(),
                w.index_select(0, rows).transpose(0, 1).float(), topk, relu=relu,
                q_positions=rows,
            )
            # stock megatron-core's selection on the same weights and rows
            _, stock_selected = stock_topk(q.index_select(0, rows), k, w.index_select(0, rows),
                                           topk, rows, relu=relu)
            selections[module.layer_number] = selected, stock_selected
        else:  # an index-sharing layer reuses its source layer's selection
            selected, stock_selected = selections[module.source_layer]
        probs = head_mean_attention(a["query"], a["key"], rows, module.softmax_scale)
        stats = selection_recall(probs, selected, mass=mass)
        stats["jaccard_vs_stock"] = jaccard(selected, stock_selected).mean().item()
        stats["fact_hit"] = (selected.long() == fact_pos[..., None]).any(-1).float().mean().item()
        results.append(stats)
    return results


# --------------------------------------------------------------------------- reporting


def _fmt_pair(values: Sequence[float | None], fmt: str) -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def format_row(step: int, window: dict[str, list[dict[str, Any]]],
               recall: list[dict[str, float]] | None) -> list[str]:
    """One table row from the last `log_every` steps of each model (means over the window)."""
    names = ("hyscale", "stock")

    def mean(name: str, key: str) -> float | None:
        recs = window.get(name)
        if not recs:
            return None
        if key == "tokens_per_s":
            return sum(r["tokens"] for r in recs) / sum(r["seconds"] for r in recs)
        if key == "indexer_kl":
            vals = [sum(r[key]) / len(r[key]) for r in recs if r[key]]
            return sum(vals) / len(vals) if vals else None
        return sum(r[key] for r in recs) / len(recs)

    return [
        str(step),
        _fmt_pair([mean(n, "loss") for n in names if n in window], ".4f"),
        _fmt_pair([mean(n, "accuracy") for n in names if n in window], ".3f"),
        _fmt_pair([mean(n, "tokens_per_s") for n in names if n in window], ".0f"),
        _fmt_pair([mean(n, "indexer_kl") for n in names if n in window], ".2e"),
        "-" if recall is None else " ".join(f"{r['recall']:.2f}" for r in recall),
        "-" if recall is None else " ".join(f"{r['fact_hit']:.2f}" for r in recall),
    ]


# Printed under the per-model recall figures: why recall and accuracy can disagree.
RECALL_NOTE = (
    "  (recall@90% compares the top-k with the layer's dense attention over all keys, what the "
    "indexer loss imitates, not with the fact the answer needs: a diffuse attention, whose 90% "
    "mass set is larger than the top-k, caps it at top-k / set size even when the fact is always "
    "selected, and an attention peaked on the wrong keys scores high, so a run can have the "
    "higher recall and the lower accuracy; 'fact in top-k' is the figure that tracks accuracy)"
)

HEADER = ["step", "answer loss", "far-query acc", "tokens/s", "indexer KL",
          "recall@90% (per layer)", "fact in top-k"]


def table_lines(rows: list[list[str]], both: bool, header: bool = True) -> list[str]:
    """Fixed-width table lines (so rows printed one at a time line up); pairs are 'H / S'."""
    head = [h + (" H / S" if both and i in (1, 2, 3, 4) else "") for i, h in enumerate(HEADER)]
    # Fixed widths (the header's, or what the values need) so single rows line up.
    widths = [max(len(h), w) for h, w in zip(head, (6, 17, 13, 13, 19, 12, 12))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))
    top = [line(head), "  ".join("-" * w for w in widths)] if header else []
    return top + [line(r) for r in rows]


# One colour per curve (the same model's far and near queries included) and one legend entry
# each: (model, queries) in the loss / accuracy panels, recall and fact-in-top-k per layer.
CURVE_COLOURS = {("hyscale", "far"): "tab:blue", ("hyscale", "near"): "tab:cyan",
                 ("stock", "far"): "tab:red", ("stock", "near"): "tab:orange"}
RECALL_COLOURS = ("tab:purple", "tab:green", "tab:brown", "tab:pink", "tab:olive", "tab:gray",
                  "black", "gold")


def curves_figure(history: dict[str, list[dict[str, Any]]], recall_log: list[dict[str, Any]],
                  chance: float) -> Any:
    """The figure of `plot_curves`: loss, accuracy (far and near queries) and recall panels."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CI or the GPU machine
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"hyscale": dict(lw=2.0), "stock": dict(lw=1.0, ls="--")}
    for name, recs in history.items():
        steps = [r["step"] for r in recs]
        far = dict(styles[name], color=CURVE_COLOURS[name, "far"])
        axes[0].plot(steps, [r["loss"] for r in recs], label=name, **far)
        axes[1].plot(steps, [r["accuracy"] for r in recs], label=f"{name}: far queries", **far)
        if recs and recs[0].get("near_accuracy") is not None:
            near = dict(styles[name], color=CURVE_COLOURS[name, "near"], lw=0.8)
            axes[1].plot(steps, [r["near_accuracy"] for r in recs], alpha=0.7,
                         label=f"{name}: near queries", **near)
    axes[0].set(title="answer loss (cross-entropy)", xlabel="step", yscale="log")
    axes[1].axhline(chance, color="gray", lw=0.8, ls=":", label="chance")
    axes[1].set(title="answer accuracy (per training batch)", xlabel="step", ylim=(0, 1.02))
    for layer in range(len(recall_log[0]["hyscale"]) if recall_log else 0):
        steps = [r["step"] for r in recall_log]
        n = len(RECALL_COLOURS)  # beyond 2 layers the colours repeat
        axes[2].plot(steps, [r["hyscale"][layer]["recall"] for r in recall_log], marker="o",
                     color=RECALL_COLOURS[3 * layer % n], label=f"layer {layer + 1}: recall@90%")
        axes[2].plot(steps, [r["hyscale"][layer]["fact_hit"] for r in recall_log], marker="x",
                     ls=":", color=RECALL_COLOURS[(3 * layer + 1) % n],
                     label=f"layer {layer + 1}: fact in top-k")
        axes[2].plot(steps, [r["hyscale"][layer]["jaccard_vs_stock"] for r in recall_log],
                     marker="s", ls="--", lw=0.8, color=RECALL_COLOURS[(3 * layer + 2) % n],
                     label=f"layer {layer + 1}: Jaccard vs stock top-k")
    axes[2].set(title="HyScale indexer recall and agreement with stock (far answer rows, "
                "held-out batch)", xlabel="step",
                ylim=(0, 1.02))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_curves(history: dict[str, list[dict[str, Any]]], recall_log: list[dict[str, Any]],
                path: Path, chance: float) -> None:
    """Loss and accuracy of both models per step (and HyScale's recall), saved as a PNG."""
    import matplotlib.pyplot as plt

    fig = curves_figure(history, recall_log, chance)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train, report and write outputs; return the metrics written to metrics.json.

    megatron-core's known warnings are hidden unless --all-warnings (HyScale's show); torch's
    thread count is set from --threads for the run and restored after it.
    """
    from megatron_hyscale.testing.quiet import quiet_megatron

    task = validate_args(args)
    threads_before = torch.get_num_threads()
    with contextlib.nullcontext() if args.all_warnings else quiet_megatron():
        try:
            if args.threads:
                torch.set_num_threads(args.threads)
            return _train_and_report(args, task)
        finally:
            torch.set_num_threads(threads_before)


def _train_and_report(args: argparse.Namespace, task: RecallTask) -> dict[str, Any]:
    device = resolve_device(args.device)
    from tqdm.auto import tqdm

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    with megatron_runtime(device, args.seed):
        models = build_models(args, device)
        checker = models.pop("stock_check", None)
        optimizers = {n: torch.optim.Adam(m.parameters(), lr=args.lr) for n, m in models.items()}
        both = "stock" in models
        max_same_diff = 0.0
        # A fixed held-out batch for recall: the same for every measurement and both models.
        eval_batch = task.sample(args.batch_size, torch.Generator().manual_seed(args.seed + 1))
        history: dict[str, list[dict[str, Any]]] = {n: [] for n in models}
        recall_log: list[dict[str, Any]] = []
        rows: list[list[str]] = []
        max_diff = 0.0
        tokens = args.batch_size * args.seq_len

        def log_recall(step: int) -> list[dict[str, float]]:
            entry = {"step": step, **{n: measure_recall(m, eval_batch, task, args.topk, device)
                                      for n, m in models.items()}}
            recall_log.append(entry)
            return entry["hyscale"]

        threads = torch.get_num_threads()
        print(f"HyScale demo: {args.layers}-layer MLA + DSA GPT, seq {args.seq_len}, top-k "
              f"{args.topk}, batch {args.batch_size}, {args.steps} steps on {device} with "
              f"{threads} intra-op thread{'' if threads == 1 else 's'} (--threads); "
              f"{task.n_pairs} facts, {task.n_near} near and {task.n_far} far queries; chance "
              f"accuracy "
              f"{1 / task.n_values:.3f}" + ("; HyScale / stock side by side" if both else "")
              + ("; HyScale selects on fp8 copies of the indexer's q and k"
                 if args.indexer_precision == "fp8" else ""))
        rows.append(format_row(0, {n: [] for n in models}, log_recall(0)))
        print("\n".join(table_lines(rows, both)))
        window: dict[str, list[dict[str, Any]]] = {n: [] for n in models}
        bar = tqdm(range(1, args.steps + 1), desc="training", unit="step",
                   disable=args.no_progress, dynamic_ncols=True)
        for step in bar:
            # Each step's batch depends only on (seed, step): same data, same order for both.
            batch = task.sample(args.batch_size,
                                torch.Generator().manual_seed(args.seed * 1_000_003 + step))
            if both:
                same_weights = stock_loss_on(models["hyscale"], checker, batch, task, device)
            for name, model in models.items():
                rec = train_step(model, optimizers[name], batch, task,
                                 args.indexer_loss_coeff, device)
                if not math.isfinite(rec["loss"]):
                    raise FloatingPointError(f"{name} loss is {rec['loss']} at step {step}")
                rec.update(step=step, tokens=tokens)
                history[name].append(rec)
                window[name].append(rec)
            if both:
                max_diff = max(max_diff, abs(history["hyscale"][-1]["loss"]
                                             - history["stock"][-1]["loss"]))
                same_diff = abs(history["hyscale"][-1]["loss"] - same_weights)
                history["hyscale"][-1]["stock_loss_same_weights"] = same_weights
                max_same_diff = max(max_same_diff, same_diff)
            bar.set_postfix(loss=f"{history['hyscale'][-1]['loss']:.3f}",
                            acc=f"{history['hyscale'][-1]['accuracy']:.2f}")
            if step % args.log_every == 0 or step == args.steps:
                recall = log_recall(step)
                rows.append(format_row(step, window, recall))
                window = {n: [] for n in models}
                bar.write(table_lines(rows[-1:], both, header=False)[0])
        bar.close()
        capture = capture_indexer(models["hyscale"], eval_batch, task, args.topk, device)

    final = recall_log[-1]
    agree_until, agree_max = 0, 0.0
    if both:
        for h, st in zip(history["hyscale"], history["stock"]):
            diff = abs(h["loss"] - st["loss"])
            if diff > AGREE_TOL:
                break
            agree_until, agree_max = h["step"], max(agree_max, diff)
    summary = {
        name: {
            "final_loss": sum(r["loss"] for r in recs[-args.log_every:])
            / len(recs[-args.log_every:]),
            "final_accuracy": sum(r["accuracy"] for r in recs[-args.log_every:])
            / len(recs[-args.log_every:]),
            "tokens_per_s": sum(r["tokens"] for r in recs) / sum(r["seconds"] for r in recs),
            "recall": final[name],
        }
        for name, recs in history.items()
    }
    metrics = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": str(device),
        "task": dataclasses.asdict(task) | {"chance_accuracy": 1 / task.n_values},
        "recall_definition": (
            "per layer, over the answer rows of a fixed held-out batch: the smallest set of keys "
            "holding >= 90% of the row's dense causal attention probability (mean over heads) "
            "and the share of it inside the indexer's exact top-k (recall), the attention mass "
            "on the top-k (covered_mass), and how often the top-k held the fact token the "
            "answer needs (fact_hit); jaccard_vs_stock: |A & B| / |A | B| of HyScale's top-k "
            "and stock megatron-core's (fused_qk_topk_naive) on the same weights and rows"
        ),
        # Exactness: at every step, the stock layer scored on HyScale's current weights.
        "max_abs_loss_diff_same_weights": max_same_diff if both else None,
        "max_abs_loss_diff": max_diff if both else None,
        # Two runs that differ only in rounding drift apart once training amplifies it (a
        # near-tied top-k flips, Adam follows): report how long the curves stayed together.
        "agree_tolerance": AGREE_TOL,
        "agree_until_step": agree_until if both else None,
        "max_abs_loss_diff_while_agreeing": agree_max if both else None,
        "summary": summary,
        "history": history,
        "recall_log": recall_log,
    }
    capture_path = out / "indexer_capture.pt"
    torch.save(capture, capture_path)
    metrics["indexer_capture"] = str(capture_path)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot_curves(history, recall_log, out / "curves.png", 1 / task.n_values)

    print()
    for name, s in summary.items():
        per_layer = ", ".join(
            f"layer {i + 1}: recall {r['recall']:.3f}, covered mass {r['covered_mass']:.3f}, "
            f"fact in top-k {r['fact_hit']:.3f} (90%-mass set: {r['mass_set_size']:.1f} keys), "
            f"Jaccard vs stock's top-k {r['jaccard_vs_stock']:.3f}"
            for i, r in enumerate(s["recall"])
        )
        print(f"{name:>7}: final loss {s['final_loss']:.4f}, accuracy {s['final_accuracy']:.3f}, "
              f"{s['tokens_per_s']:.0f} tokens/s; indexer {per_layer}")
    print(RECALL_NOTE)
    if both:
        print(f"same weights, every step: largest |loss HyScale - loss stock| = "
              f"{max_same_diff:.3e} over {args.steps} steps (the stock layer scored on HyScale's "
              "current weights and batch)")
        print(f"two independent runs: largest |loss HyScale - loss stock| = {max_diff:.3e}; "
              f"within {AGREE_TOL:g} at every step up to step {agree_until} (largest there "
              f"{agree_max:.3e})")
        if agree_until < args.steps:
            print("  (then the independent runs drift apart: fp32 rounding differences between "
                  "the implementations flip near-tied choices and Adam amplifies them; their "
                  "final accuracies differ by chance, not by method)")
    print(f"wrote {out / 'metrics.json'}, {out / 'curves.png'} and {capture_path} (the trained "
          "indexer's q, k and weights: scripts/bench_selection.py --captured)")
    return metrics


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse `argv` (default: the command line) and run the demo; return its metrics."""
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    main()

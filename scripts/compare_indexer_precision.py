"""FP8 against bf16 selection in training: the demo trained twice, then the top-k overlap.

Issue #21 item 4 asks for the FP8 indexer's effect on training, not only on one selection: the
demo (`megatron_hyscale.demo`: a tiny MLA + DSA GPT on long-range associative recall, where the
indexer's top-k decides the answer) runs twice from the same weights, data and seed, HyScale's
layer only, once selecting on the indexer's q and k as they are and once on their e4m3 copies
(`--indexer-precision fp8`; the indexer loss keeps the unquantized tensors either way). The
record holds both loss curves and their gap per step, the final loss, accuracy and indexer
recall of each, and the top-k overlap of the two precisions on the same tensors: the trained
indexer of each run on the held-out batch (`demo.capture_indexer`) and random inputs of the
same shape, each row's Jaccard |A & B| / |A | B| and the share of rows whose sets are equal.

On a CPU the runs are fp32 (the demo's), so "bf16" means unquantized there, and fp8 selection
runs the reference on the quantized tensors (the same selection the Triton kernel makes).

    python scripts/compare_indexer_precision.py                # 400 steps each, a few minutes
    python scripts/compare_indexer_precision.py --steps 100 --seeds 3 --record   # + a record
    python scripts/compare_indexer_precision.py -- --layers 3  # after --: more demo options

A command line of the checkout (it runs the demo, which the benchmark package does not import).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PRECISIONS = ("bf16", "fp8")
# |loss fp8 - loss bf16| at most this counts as the same curve (the demo's AGREE_TOL).
AGREE_TOL = 1e-4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python scripts/compare_indexer_precision.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of each run")
    p.add_argument("--seed", type=int, default=1234, help="the demo's seed (weights and data)")
    p.add_argument("--seeds", type=int, default=1,
                   help="runs per precision, seeds --seed, --seed + 1, ...: a tiny model's runs "
                        "that differ in one selection drift apart (as two seeds do), so the "
                        "final figures are compared over seeds")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available (the demo's --device)")
    p.add_argument("--out", type=Path, default=Path("outputs/indexer_precision"),
                   help="folder for comparison.json, curves.png and the two demo runs")
    p.add_argument("--record", action="store_true",
                   help="also write the JSON record to benchmarks/results/ ($HYSCALE_RESULTS)")
    p.add_argument("demo_args", nargs="*", metavar="-- DEMO_ARGS",
                   help="further megatron_hyscale.demo options for both runs (after --)")
    return p


def demo_args(args: argparse.Namespace, precision: str, seed: int) -> list[str]:
    return ["--steps", str(args.steps), "--seed", str(seed), "--device", args.device,
            "--no-stock", "--no-progress", "--indexer-precision", precision,
            "--out", str(args.out / f"{precision}-seed{seed}"), *args.demo_args]


def jaccard_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(mean Jaccard of the rows' index sets, share of rows with equal sets); -1 slots are empty;
    rows empty in both count as equal (Jaccard 1)."""
    rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    scores, equal = [], 0
    for x, y in zip(rows_a.tolist(), rows_b.tolist(), strict=True):
        sx, sy = {i for i in x if i >= 0}, {i for i in y if i >= 0}
        union = len(sx | sy)
        scores.append(len(sx & sy) / union if union else 1.0)
        equal += sx == sy
    return sum(scores) / len(scores), equal / len(scores)


def overlap(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, relu: bool
            ) -> dict[str, float]:
    """Top-k overlap of fp8 and unquantized selection on the same q [B, T, H, D], k, w."""
    from megatron_hyscale.ops import hytopk

    full = hytopk(q, k, w, topk, relu=relu)[0]
    fp8 = hytopk(q, k, w, topk, relu=relu, precision="fp8")[0]
    mean, same = jaccard_rows(full, fp8)
    return {"jaccard": mean, "rows_equal": same}


def run_demo(args: argparse.Namespace, precision: str, seed: int) -> dict[str, Any]:
    from megatron_hyscale import demo

    argv = demo_args(args, precision, seed)
    print(f"=== {precision} selection: python -m megatron_hyscale.demo {' '.join(argv)}",
          flush=True)
    return demo.run(demo.build_parser().parse_args(argv))


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """The first seed's runs in full (curves, gaps, overlaps), and every seed's final figures
    (`per_seed`, with their means: `mean_final`)."""
    seeds = [args.seed + i for i in range(args.seeds)]
    per_seed = []
    for seed in seeds:
        runs_s = {p: run_demo(args, p, seed) for p in PRECISIONS}
        per_seed.append({"seed": seed, **{p: {
            "loss": runs_s[p]["summary"]["hyscale"]["final_loss"],
            "accuracy": runs_s[p]["summary"]["hyscale"]["final_accuracy"],
            "fact_in_topk": [r["fact_hit"] for r in runs_s[p]["summary"]["hyscale"]["recall"]],
            "recall": [r["recall"] for r in runs_s[p]["summary"]["hyscale"]["recall"]]}
            for p in PRECISIONS}})
        if seed == seeds[0]:
            runs = runs_s
    mean_final = {p: {key: sum(s[p][key] for s in per_seed) / len(per_seed)
                      for key in ("loss", "accuracy")} for p in PRECISIONS}
    hist = {p: runs[p]["history"]["hyscale"] for p in PRECISIONS}
    steps = [r["step"] for r in hist["bf16"]]
    gaps = [abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12)
            for a, b in zip(hist["bf16"], hist["fp8"], strict=True)]
    agree_until = 0
    for a, b in zip(hist["bf16"], hist["fp8"], strict=True):
        if abs(a["loss"] - b["loss"]) > AGREE_TOL:
            break
        agree_until = a["step"]
    overlaps: dict[str, Any] = {}
    for p in PRECISIONS:
        cap = torch.load(runs[p]["indexer_capture"])
        overlaps[f"trained_{p}_run"] = overlap(cap["q"], cap["k"], cap["weights"], cap["topk"],
                                               cap["relu"])
    g = torch.Generator().manual_seed(args.seed)
    q, k, w = (torch.randn(cap["q"].shape, generator=g), torch.randn(cap["k"].shape, generator=g),
               torch.randn(cap["weights"].shape, generator=g))
    overlaps["random"] = overlap(q, k, w, cap["topk"], cap["relu"])
    summary = {p: runs[p]["summary"]["hyscale"] for p in PRECISIONS}
    return {
        "steps": steps,
        "loss": {p: [r["loss"] for r in hist[p]] for p in PRECISIONS},
        "relative_loss_gap": gaps,
        "max_relative_loss_gap": max(gaps),
        "final_relative_loss_gap": gaps[-1],
        "agree_until_step": agree_until,
        "agree_tolerance": AGREE_TOL,
        "final": {p: {"loss": s["final_loss"], "accuracy": s["final_accuracy"],
                      "recall": s["recall"]} for p, s in summary.items()},
        "topk_overlap": overlaps,
        "per_seed": per_seed,
        "mean_final": mean_final,
        "device": runs["bf16"]["device"],
        "demo_args": {p: demo_args(args, p, args.seed) for p in PRECISIONS},
    }


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for p in PRECISIONS:
        top.plot(result["steps"], result["loss"][p], label=f"{p} selection", lw=1)
    top.set_ylabel("answer loss")
    top.legend()
    bottom.semilogy(result["steps"], [max(g, 1e-12) for g in result["relative_loss_gap"]], lw=1)
    bottom.set_ylabel("|fp8 - bf16| / bf16")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(result: dict[str, Any]) -> str:
    f = result["final"]
    lines = ["| selection | final loss | final accuracy | recall (layer 1) | fact in top-k "
             "(layer 1) |", "|---|---|---|---|---|"]
    for p in PRECISIONS:
        r = f[p]["recall"][0]
        lines.append(f"| {p} | {f[p]['loss']:.4f} | {f[p]['accuracy']:.3f} | "
                     f"{r['recall']:.3f} | {r['fact_hit']:.3f} |")
    if len(result["per_seed"]) > 1:
        lines += ["", "| seed | " + " | ".join(f"{p} final loss | {p} accuracy"
                                              for p in PRECISIONS) + " |",
                  "|---" * (1 + 2 * len(PRECISIONS)) + "|"]
        for s in result["per_seed"]:
            lines.append(f"| {s['seed']} | " + " | ".join(
                f"{s[p]['loss']:.4f} | {s[p]['accuracy']:.3f}" for p in PRECISIONS) + " |")
        m = result["mean_final"]
        lines.append("| mean | " + " | ".join(
            f"{m[p]['loss']:.4f} | {m[p]['accuracy']:.3f}" for p in PRECISIONS) + " |")
    lines.append("")
    lines.append(f"loss curves (seed {result['per_seed'][0]['seed']}): largest relative gap "
                 f"{result['max_relative_loss_gap']:.2e}, "
                 f"final {result['final_relative_loss_gap']:.2e}; within {AGREE_TOL:g} "
                 f"(absolute) up to step {result['agree_until_step']}")
    for name, o in result["topk_overlap"].items():
        lines.append(f"top-k overlap fp8 vs unquantized, {name.replace('_', ' ')} inputs: "
                     f"Jaccard {o['jaccard']:.4f}, rows equal {o['rows_equal']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    for name in ("steps", "seeds"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name} must be > 0, got {getattr(args, name)}")
    result = compare(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comparison.json").write_text(json.dumps(result, indent=1))
    plotted = plot(result, args.out / "curves.png")
    print("\n" + report(result))
    print(f"wrote {args.out / 'comparison.json'}"
          + (f" and {args.out / 'curves.png'}" if plotted else ""))
    if args.record:
        from hyscale_bench.measure import save_record

        entries = [{"method": "indexer_precision", **{k: v for k, v in result.items()
                                                       if k not in ("loss", "steps")}}]
        path = save_record("indexer_precision", "demo", entries, matmul=math.nan,
                           copy=math.nan, extra={"loss": result["loss"]})
        print(f"record: {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

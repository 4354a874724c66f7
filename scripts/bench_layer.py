"""One DSA attention layer (GLM-5.1 geometry), forward + backward under full recompute.

HyScale's layer against megatron-core 0.19.2's stock DSAttention (kernel backend "none") on
the same weights in the same process, for each sequence length: time (median of CUDA-event
timings after a warm-up), peak extra memory, and for HyScale a breakdown (selection, sparse
attention, indexer loss, the rest) with the share of the step that selection replay saves.
Prints a table, writes JSON (and a PNG plot when matplotlib is there) under --out.

    python scripts/bench_layer.py                      # T = 8K .. 256K
    python scripts/bench_layer.py --seq 8192 16384 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_hyscale.testing.bench import matmul_tflops, time_ms  # noqa: E402

GLM51 = dict(
    hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
    qk_head_dim=192, qk_pos_emb_head_dim=64, v_head_dim=256,
    dsa_indexer_n_heads=32, dsa_indexer_head_dim=128, dsa_indexer_topk=2048,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+",
                   default=[8192, 16384, 32768, 65536, 131072, 262144],
                   help="sequence lengths (tokens, batch 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median is reported)")
    p.add_argument("--skip-stock", action="store_true", help="measure HyScale only")
    p.add_argument("--stock-max-seq", type=int, default=65536,
                   help="do not try stock above this length (it runs out of memory earlier)")
    p.add_argument("--no-relu", action="store_true", help="dsa_indexer_scoring_relu=False")
    p.add_argument("--dense-loss", action="store_true",
                   help="dense indexer KL (warm-up stage) instead of the sparse one")
    p.add_argument("--loss-coeff", type=float, default=0.01, help="dsa_indexer_loss_coeff")
    p.add_argument("--out", default="outputs/bench_layer", help="output folder")
    args = p.parse_args()
    for name in ("repeats",):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if any(t < 1 for t in args.seq):
        p.error("--seq values must be positive")
    return args


def build_attention(args: argparse.Namespace, stock: bool):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hyscale.specs import get_dsa_layer_specs
    from megatron_hyscale.testing.models import tiny_dsa_config

    cfg = tiny_dsa_config(
        num_layers=1, ffn_hidden_size=4 * GLM51["hidden_size"], params_dtype=torch.bfloat16,
        bf16=True, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1, dsa_indexer_loss_coeff=args.loss_coeff,
        dsa_indexer_use_sparse_loss=not args.dense_loss,
        dsa_indexer_scoring_relu=not args.no_relu, **GLM51,
    )
    spec = get_dsa_layer_specs(cfg, stock=stock)[0].submodules.self_attention
    torch.manual_seed(0)
    # Megatron wraps models in Float16Module; the local norms are created in fp32.
    return build_module(spec, config=cfg, layer_number=1).to("cuda", torch.bfloat16)


def layer_step(attn, hidden: torch.Tensor, grad: torch.Tensor) -> None:
    """Forward + backward with the layer's forward checkpointed (full recompute)."""
    from megatron.core import tensor_parallel

    hidden.grad = None
    out = tensor_parallel.checkpoint(lambda h: attn(h, None)[0], False, hidden)
    out.backward(grad)


def component_times(attn, hidden: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    """HyScale's pieces on the layer's own tensors: selection, attention, loss (ms)."""
    from megatron_hyscale.ops import hytopk, indexer_kl_loss, sparse_attention

    core = attn.core_attention
    with torch.no_grad():
        q_abs, kv, qr = attn.get_query_key_value_tensors(hidden, None, None)
        qi, ki, wi = core.indexer.forward_before_topk(hidden, qr, None)
    query, key = q_abs.transpose(0, 1), kv.transpose(0, 1)
    qi, ki, wi = qi.transpose(0, 1), ki.transpose(0, 1), wi.transpose(0, 1)
    relu = not args.no_relu
    sel = lambda: hytopk(qi, ki, wi, core.index_topk, relu=relu)  # noqa: E731
    indices, _ = sel()
    times = {"selection_ms": time_ms(sel, reps=args.repeats)}
    q_req = query.detach().requires_grad_()
    k_req = key.detach().requires_grad_()
    dv = attn.config.kv_lora_rank

    def attn_fwd():
        with torch.no_grad():
            sparse_attention(query, key, None, indices, core.softmax_scale, dv=dv)

    def attn_fwd_bwd():
        out = sparse_attention(q_req, k_req, None, indices, core.softmax_scale, dv=dv)
        out.backward(torch.ones_like(out))

    times["attention_fwd_ms"] = time_ms(attn_fwd, reps=args.repeats)
    times["attention_fwd_bwd_ms"] = time_ms(attn_fwd_bwd, reps=args.repeats)
    qi_r, wi_r, ki_r = (t.detach().requires_grad_() for t in (qi, wi, ki))

    def loss_fwd_bwd():
        loss = indexer_kl_loss(qi_r, wi_r, ki_r, query, key, indices, core.softmax_scale,
                               args.loss_coeff, sparse=not args.dense_loss, relu=relu)
        loss.backward()

    times["indexer_loss_fwd_bwd_ms"] = time_ms(loss_fwd_bwd, reps=args.repeats)
    return times


def measure(attn, T: int, args: argparse.Namespace, hidden_size: int) -> dict[str, float]:
    torch.manual_seed(1)
    hidden = torch.randn(T, 1, hidden_size, device="cuda", dtype=torch.bfloat16) * 0.5
    hidden.requires_grad_()
    grad = torch.randn_like(hidden)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = time_ms(lambda: layer_step(attn, hidden, grad), reps=args.repeats)
    peak = torch.cuda.max_memory_allocated() - base
    return {"fwd_bwd_ms": ms, "peak_extra_gib": peak / 2**30}


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer.py needs a CUDA device")
    from megatron_hyscale import replay
    from megatron_hyscale.testing.cpu import init_single_process

    init_single_process()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rate = matmul_tflops()
    print(f"device: {torch.cuda.get_device_name()}  bf16 matmul: {rate:.0f} TFLOP/s", flush=True)
    hyscale = build_attention(args, stock=False)
    stock = None if args.skip_stock else build_attention(args, stock=True)
    if stock is not None:
        stock.load_state_dict(hyscale.state_dict())
    H, D = GLM51["dsa_indexer_n_heads"], GLM51["dsa_indexer_head_dim"]
    rows = []
    for T in args.seq:
        row: dict[str, object] = {"T": T}
        # Indexer GEMM floor (causal half) at the measured matmul rate.
        row["selection_floor_ms"] = T * T / 2 * H * D * 2 / (rate * 1e12) * 1e3
        t0 = time.time()
        print(f"[T={T}] HyScale ...", flush=True)
        replay.reset_stats()
        try:
            row["hyscale"] = measure(hyscale, T, args, GLM51["hidden_size"])
            row["hyscale"].update(replay.get_stats())
            row["hyscale"].update(component_times(hyscale, torch.randn(
                T, 1, GLM51["hidden_size"], device="cuda", dtype=torch.bfloat16) * 0.5, args))
        except torch.OutOfMemoryError:
            row["hyscale"] = "OOM"
        replay.clear()
        torch.cuda.empty_cache()
        if stock is not None and T <= args.stock_max_seq:
            print(f"[T={T}] stock ...", flush=True)
            try:
                row["stock"] = measure(stock, T, args, GLM51["hidden_size"])
            except torch.OutOfMemoryError:
                row["stock"] = "OOM"
            torch.cuda.empty_cache()
        else:
            row["stock"] = "skipped"
        print(f"[T={T}] done in {time.time() - t0:.0f} s: {row}", flush=True)
        rows.append(row)
        (out_dir / "bench_layer.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "matmul_tflops": rate,
             "args": vars(args), "rows": rows}, indent=1))
    print_table(rows)
    plot(rows, out_dir)


def fmt(v: object, key: str, digits: int = 1) -> str:
    if isinstance(v, dict):
        return f"{v[key]:.{digits}f}"
    return str(v)


def print_table(rows: list[dict]) -> None:
    print("\n| T | HyScale fwd+bwd ms | peak GiB | selection ms (floor) | attention fwd+bwd ms |"
          " indexer loss ms | replay saves | stock fwd+bwd ms | stock peak GiB | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        h, s = r["hyscale"], r["stock"]
        if isinstance(h, dict):
            saved = h["selection_ms"] / (h["fwd_bwd_ms"] + h["selection_ms"])
            hs = (f"{h['fwd_bwd_ms']:.1f} | {h['peak_extra_gib']:.2f} | "
                  f"{h['selection_ms']:.1f} ({r['selection_floor_ms']:.1f}) | "
                  f"{h['attention_fwd_bwd_ms']:.1f} | {h['indexer_loss_fwd_bwd_ms']:.1f} | "
                  f"{saved:.0%}")
        else:
            hs = " | ".join([str(h)] * 6)
        speed = (f"{s['fwd_bwd_ms'] / h['fwd_bwd_ms']:.1f}x"
                 if isinstance(s, dict) and isinstance(h, dict) else "-")
        print(f"| {r['T']} | {hs} | {fmt(s, 'fwd_bwd_ms')} | {fmt(s, 'peak_extra_gib', 2)} |"
              f" {speed} |")


def plot(rows: list[dict], out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("hyscale", "stock"):
        pts = [(r["T"], r[name]) for r in rows if isinstance(r[name], dict)]
        if pts:
            axes[0].plot([t for t, _ in pts], [m["fwd_bwd_ms"] for _, m in pts], "o-", label=name)
            axes[1].plot([t for t, _ in pts], [m["peak_extra_gib"] for _, m in pts], "o-",
                         label=name)
    for ax, label in zip(axes, ("fwd+bwd ms (full recompute)", "peak extra GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("DSA layer, GLM-5.1 geometry")
    fig.tight_layout()
    fig.savefig(out_dir / "bench_layer.png", dpi=120)


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()

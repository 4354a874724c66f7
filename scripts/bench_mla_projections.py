"""Absorbed MLA's projections around the core attention: megatron's ops against HyScale's in place.

    python scripts/bench_mla_projections.py [--seq 32768 131072]

At GLM-5.1's widths (64 heads, q 192 + 64 -> absorbed 512 + 64, v 256), forward + backward of
  query   megatron's split, einsum, contiguous copy, RoPE (unfused, MLA-interleaved) and cat,
          against `ops.absorbed_mla.absorbed_query` (the GEMM into the final buffer, one RoPE
          kernel beside it);
  values  the V up projection: einsum + reshape against `ops.absorbed_mla.project_values`;
each with the bytes the GEMMs alone must move and the copy rate measured in the same run, so
the time above the GEMMs reads against the copy floor. The layer runs each of them twice a
step under full recompute (bench_layer.py --compare-mla-projections times the layer).
A record in benchmarks/results (or $HYSCALE_RESULTS).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyscale_bench.measure import (  # noqa: E402
    GPU_SCRIPT_EPILOG,
    copy_tbps,
    log,
    matmul_tflops,
    require_cuda,
    save_record,
    time_ms,
)
from megatron_hyscale.ops.absorbed_mla import absorbed_query, project_values  # noqa: E402

HEADS, NOPE, ROPE, LATENT, VDIM = 64, 192, 64, 512, 256


def megatron_query(q, k_up, freqs):
    """AbsorbedMLA's unfused query path (as tests/ops/test_absorbed_mla.py's reference)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    q_no_pe, q_pos_emb = torch.split(q, [NOPE, ROPE], dim=-1)
    q_absorbed = torch.einsum("...nd,ndk->...nk", q_no_pe, k_up).contiguous()
    q_pos_emb = _apply_rotary_pos_emb_bshd(q_pos_emb, freqs, mla_rotary_interleaved=True)
    return torch.cat([q_absorbed, q_pos_emb], dim=-1)


def fwd_bwd(fn, inputs, grad):
    def run():
        out = fn()
        torch.autograd.grad(out, inputs, grad)
    return run


def case(T: int, device: str, reps: int) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    q = torch.randn(T, 1, HEADS, NOPE + ROPE, device=device, generator=g).to(bf16)
    q.requires_grad_(True)
    k_up = (torch.randn(HEADS, NOPE, LATENT, device=device, generator=g) / 14).to(bf16)
    k_up.requires_grad_(True)
    pos = torch.arange(T, device=device, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device=device).float() / ROPE))
    freqs = torch.cat([torch.outer(pos, inv)] * 2, dim=-1).view(T, 1, 1, ROPE)
    cos, sin = (f(freqs).to(bf16).view(T, ROPE) for f in (torch.cos, torch.sin))
    qgrad = torch.randn(T, 1, HEADS, LATENT + ROPE, device=device, generator=g).to(bf16)
    out = torch.randn(1, T, HEADS, LATENT, device=device, generator=g).to(bf16)
    out.requires_grad_(True)
    v_up = (torch.randn(HEADS, VDIM, LATENT, device=device, generator=g) / 22).to(bf16)
    v_up.requires_grad_(True)
    vgrad = torch.randn(T, 1, HEADS * VDIM, device=device, generator=g).to(bf16)
    timer = (lambda fn: time_ms(fn, reps=reps, warmup=1)) if device == "cuda" else (
        lambda fn: (fn(), float("nan"))[1])
    rows = []
    for name, ours, theirs, inputs, grad in (
        ("query", lambda: absorbed_query(q, k_up, cos, sin),
         lambda: megatron_query(q, k_up, freqs), (q, k_up), qgrad),
        ("values", lambda: project_values(out, v_up),
         lambda: torch.einsum("bshc,hdc->sbhd", out, v_up).reshape(T, 1, -1), (out, v_up),
         vgrad),
    ):
        with torch.no_grad():
            a, b = ours(), theirs()
            # RoPE bitwise; the GEMMs' outputs may round apart where cuBLAS picks other kernels
            rope_same = bool(torch.equal(a[..., LATENT:], b[..., LATENT:])) if name == "query" \
                else None
            gemm_diff = float((a[..., :LATENT] - b[..., :LATENT]).abs().max()) if name == \
                "query" else float((a - b).abs().max())
            del a, b
        ms_ours = timer(fwd_bwd(ours, inputs, grad))
        ms_theirs = timer(fwd_bwd(theirs, inputs, grad))
        rows.append({"T": T, "op": name, "hyscale_ms": ms_ours, "megatron_ms": ms_theirs,
                     "saved_ms": ms_theirs - ms_ours, "speedup": ms_theirs / ms_ours,
                     "rope_bitwise": rope_same, "gemm_max_abs_diff": gemm_diff})
        log(f"T={T} {name}: HyScale {ms_ours:.2f} ms, megatron {ms_theirs:.2f} ms "
            f"({ms_theirs / ms_ours:.2f}x), RoPE bitwise {rope_same}, GEMM max diff "
            f"{gemm_diff:.3g}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=GPU_SCRIPT_EPILOG)
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072],
                   help="token counts (default 32768 131072)")
    p.add_argument("--reps", type=int, default=5, help="timed repeats, median (default 5)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default) or cpu (with --tiny: a smoke run, nothing timed)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: T = 64")
    args = p.parse_args(argv)
    if args.device == "cuda":
        require_cuda("bench_mla_projections.py --device cuda")
    seqs = [64] if args.tiny else args.seq
    rate = matmul_tflops() if args.device == "cuda" else float("nan")
    copy = copy_tbps() if args.device == "cuda" else float("nan")
    log(f"matmul {rate:.0f} TFLOP/s, copy {copy:.2f} TB/s")
    rows = [r for T in seqs for r in case(T, args.device, args.reps)]
    if args.device == "cuda":
        path = save_record("bench_mla_projections", "glm51", rows, matmul=rate, copy=copy)
        log(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

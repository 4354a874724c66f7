"""`ops.rms_norm`'s kernels, forward + backward, at DeepSeek-V4-Flash's shapes.

    python scripts/bench_rms_norm.py [--seq 32768 131072]

  query   the per-head query norm: [T, 64, 512] bf16, no weight (4.3 G elements at 128K, past
          the 2^31 that one launch of torch 2.11's fused kernels takes: it runs in row chunks
          and copies each chunk's output);
  entries the compressor's weighted norm: [T / 4, 512] bf16, a bf16 weight.
Each kernel ("fused": torch's, "triton": HyScale's, "chunked": the row-chunked torch ops),
its time beside the copy floor (the bytes one read and one write a direction must move at the
copy rate measured in the same run), and its largest difference from the chunked form. Then
the query's norm and RoPE as the layer runs them (`compress.rms_norm_rope`: one Triton kernel a
direction) against the two Triton kernels one after the other, and how far apart their values
and gradients are.
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
from megatron_hyscale.ops.compress import (  # noqa: E402
    apply_interleaved_rope,
    default_inv_freq,
    rms_norm_rope,
    rope_cos_sin,
)
from megatron_hyscale.ops.rms_norm import rms_norm  # noqa: E402

HEADS, WIDTH, COMPRESS, ROPE = 64, 512, 4, 64
KERNELS = ("fused", "triton", "chunked")


def shapes(T: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    return {"query": ((T, HEADS, WIDTH), False), "entries": ((T // COMPRESS, WIDTH), True)}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 1 << 16) -> float:
    """max |a - b| in fp32, a block of rows at a time (V4's query at 128K is 8 GiB in bf16)."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    return max((float((a[r:r + rows].float() - b[r:r + rows].float()).abs().max())
                for r in range(0, a.shape[0], rows)), default=0.0)


def one_shape(T: int, name: str, shape: tuple[int, ...], weighted: bool, device: str,
              reps: int, kernels: tuple[str, ...], copy: float) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
    x.requires_grad_(True)
    w = None
    if weighted:
        w = (torch.rand(WIDTH, device=device, generator=g) + 0.5).to(torch.bfloat16)
        w.requires_grad_(True)
    grad = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
    inputs = (x,) if w is None else (x, w)
    # forward: read x, write y; backward: read x and dy, write dx (bf16)
    floor_ms = 5 * x.numel() * 2 / (copy * 1e12) * 1e3
    with torch.no_grad():
        want = rms_norm(x, w, 1e-6, kernel="chunked")
    rows = []
    for kernel in kernels:
        def run(kernel: str = kernel) -> None:
            out = rms_norm(x, w, 1e-6, kernel=kernel)
            torch.autograd.grad(out, inputs, grad)
        with torch.no_grad():
            diff = max_abs_diff(rms_norm(x, w, 1e-6, kernel=kernel), want)
        ms = time_ms(run, reps=reps, warmup=1) if device == "cuda" else (run(), float("nan"))[1]
        rows.append({"T": T, "op": name, "shape": list(shape), "weighted": weighted,
                     "kernel": kernel, "ms": ms, "copy_floor_ms": floor_ms,
                     "x_floor": ms / floor_ms, "max_abs_diff_vs_chunked": diff})
        log(f"T={T} {name} {kernel}: {ms:.2f} ms ({ms / floor_ms:.2f}x the copy floor "
            f"{floor_ms:.2f}), max diff vs chunked {diff:.3g}")
    return rows


def query_rope(T: int, device: str, reps: int, copy: float) -> list[dict]:
    """The query's norm + RoPE, fused against the norm kernel then the RoPE kernel."""
    g = torch.Generator(device=device).manual_seed(1)
    shape = (1, T, HEADS, WIDTH)
    x = torch.randn(shape, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(T, device=device),
                            default_inv_freq(ROPE, 10000.0, device=device))
    forms = {
        "one_kernel": lambda: rms_norm_rope(x, None, 1e-6, cos, sin, heads=True, kernel="triton"),
        "two_kernels": lambda: apply_interleaved_rope(rms_norm(x, None, 1e-6, kernel="triton"),
                                                   cos, sin, heads=True, kernel="triton"),
    }
    floors = {"one_kernel": 5, "two_kernels": 9}  # tensor passes: 2 + 3; the RoPE adds 2 + 2
    outs, rows = {}, []
    for name, fn in forms.items():
        y = fn()
        outs[name] = (y.detach().view(torch.int16),
                      torch.autograd.grad(y, x, grad)[0].view(torch.int16))
        del y
        ms = time_ms(lambda fn=fn: torch.autograd.grad(fn(), x, grad), reps=reps, warmup=1) \
            if device == "cuda" else float("nan")
        floor_ms = floors[name] * x.numel() * 2 / (copy * 1e12) * 1e3
        rows.append({"T": T, "op": "query_norm_rope", "shape": list(shape), "weighted": False,
                     "kernel": name, "ms": ms, "copy_floor_ms": floor_ms,
                     "x_floor": ms / floor_ms})
    (ya, dxa), (yb, dxb) = outs["one_kernel"], outs["two_kernels"]
    same = bool(torch.equal(ya, yb) and torch.equal(dxa, dxb))
    bf16 = torch.bfloat16
    compare = {"bitwise_two_kernels": same,
               "y_share_differing": float((ya != yb).float().mean()),
               "y_max_abs_diff": max_abs_diff(ya.view(bf16), yb.view(bf16)),
               "dx_max_abs_diff": max_abs_diff(dxa.view(bf16), dxb.view(bf16))}
    for r in rows:
        r.update(compare)
        log(f"T={T} query norm + RoPE {r['kernel']}: {r['ms']:.2f} ms ({r['x_floor']:.2f}x its "
            f"copy floor {r['copy_floor_ms']:.2f}); one kernel against two: bitwise {same}, "
            f"{compare['y_share_differing']:.2e} of y differ, max diff y "
            f"{compare['y_max_abs_diff']:.3g}, dx {compare['dx_max_abs_diff']:.3g}")
    return rows


def case(T: int, device: str, reps: int, kernels: tuple[str, ...], copy: float) -> list[dict]:
    rows = [r for name, (shape, weighted) in shapes(T).items()
            for r in one_shape(T, name, shape, weighted, device, reps, kernels, copy)]
    return rows + query_rope(T, device, reps, copy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=GPU_SCRIPT_EPILOG)
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072],
                   help="token counts (default 32768 131072)")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                   help=f"rms_norm kernels to time (default {' '.join(KERNELS)})")
    p.add_argument("--reps", type=int, default=5, help="timed repeats, median (default 5)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default) or cpu (with --tiny: a smoke run, nothing timed; the "
                        "Triton kernel needs TRITON_INTERPRET=1 there)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: T = 16")
    args = p.parse_args(argv)
    if args.device == "cuda":
        require_cuda("bench_rms_norm.py --device cuda")
    seqs = [16] if args.tiny else args.seq
    rate = matmul_tflops() if args.device == "cuda" else float("nan")
    copy = copy_tbps() if args.device == "cuda" else float("nan")
    log(f"matmul {rate:.0f} TFLOP/s, copy {copy:.2f} TB/s")
    rows = [r for T in seqs for r in case(T, args.device, args.reps, tuple(args.kernels), copy)]
    if args.device == "cuda":
        path = save_record("bench_rms_norm", "v4", rows, matmul=rate, copy=copy)
        log(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check, on a GPU machine, that the library kernels megatron-core's cudnn DSA backend uses run.

    PYTHONPATH=.carry/site:$PYTHONPATH python scripts/check_cudnn_backend.py [--signatures]

Imports cuDNN-frontend's DSA namespace and FlashMLA's sparse forward, asks megatron-core which
of its cudnn-backend dependencies are missing, and runs each kernel once on a small DSA problem
(4096 tokens, GLM-5.1's attention and indexer widths) against HyScale's reference ops. Exits
non-zero when any of them is missing or disagrees. --signatures also prints the wrappers'
signatures (the DSA namespace is JIT-compiled CuTe-DSL code whose arguments change between
releases). Needs a CUDA GPU (Hopper): without one it exits with status 2.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Needs a CUDA GPU (Hopper): without one it exits "
                                            "with status 2.")
    parser.add_argument("--signatures", action="store_true",
                        help="print the DSA namespace's wrapper signatures and docstrings")
    args = parser.parse_args()
    from hyscale_bench.measure import require_cuda

    require_cuda("check_cudnn_backend.py", hint="run it on the GPU machine (Hopper), after "
                 "scripts/gpu_cudnn.sh")
    failures: list[str] = []
    try:
        from cudnn import DSA
    except Exception as err:  # report the cause, whatever the import raised
        failures.append(f"cudnn DSA: {type(err).__name__}: {err}")
        DSA = None
    try:
        from flash_mla import flash_mla_sparse_fwd
    except Exception as err:
        failures.append(f"flash_mla: {type(err).__name__}: {err}")
        flash_mla_sparse_fwd = None
    from megatron.core.utils import _missing_cudnn_dsa_kernel_dependencies

    missing = _missing_cudnn_dsa_kernel_dependencies()
    print(f"megatron-core cudnn backend: {'ready' if not missing else 'missing ' + str(missing)}")
    if DSA is not None and args.signatures:
        for name in sorted(dir(DSA)):
            obj = getattr(DSA, name)
            if callable(obj) and not name.startswith("_"):
                try:
                    sig = str(inspect.signature(obj))
                except (TypeError, ValueError):
                    sig = "(?)"
                doc = (inspect.getdoc(obj) or "").strip().replace("\n", " ")[:600]
                print(f"DSA.{name}{sig}\n    {doc}")
    if DSA is not None:
        failures += check_selection(DSA)
    if DSA is not None and flash_mla_sparse_fwd is not None:
        failures += check_attention(DSA, flash_mla_sparse_fwd)
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


def check_selection(DSA) -> list[str]:
    """cuDNN's indexer scores + deterministic radix top-k against HyScale's reference."""
    import torch

    from megatron_hyscale.ops import hytopk

    torch.manual_seed(0)
    B, T, H, D, K = 1, 4096, 64, 128, 2048
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(B, T, H, device="cuda", dtype=torch.float32)
    try:
        scores = DSA.indexer_forward_wrapper(q, k.unsqueeze(2), w, ratio=1, sm_scale=1.0)["scores"]
        seq_lens = torch.arange(1, T + 1, device="cuda", dtype=torch.int32)
        got = DSA.indexer_top_k_wrapper(scores.view(T, T), seq_lens, top_k=K, next_n=1,
                                        deterministic=True)["indices"].view(B, T, K)
    except Exception as err:
        return [f"cuDNN selection: {type(err).__name__}: {err}"]
    ref, _ = hytopk(q, k, w, K, backend="reference")
    got = torch.where(got < torch.arange(1, T + 1, device="cuda").view(1, T, 1), got, -1)
    same = (got.sort(-1).values == ref.sort(-1).values).all(-1).float().mean().item()
    print(f"cuDNN selection at T={T}: {same:.4%} of rows hold HyTopK's reference set")
    return [] if same == 1.0 else [f"cuDNN selection differs on {1 - same:.2%} of rows"]


def check_attention(DSA, flash_mla_sparse_fwd) -> list[str]:
    """FlashMLA's forward and cuDNN's SM90 backward against HyScale's reference."""
    import torch

    from megatron_hyscale.ops import sparse_attention

    torch.manual_seed(0)
    T, H, Dqk, Dv, K = 4096, 64, 576, 512, 2048
    scale = Dqk**-0.5
    q = torch.randn(T, H, Dqk, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T, Dqk, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(T, device="cuda").view(T, 1)
    idx = torch.rand(T, T, device="cuda").masked_fill(torch.arange(T, device="cuda") > pos, -1)
    idx = idx.topk(K, dim=-1).indices.int()
    length = (pos.view(T) + 1).clamp(max=K).int()
    idx = torch.where(torch.arange(K, device="cuda").view(1, K) < length.view(T, 1), idx, -1)
    idx = idx.sort(-1, descending=True).values  # valid slots first, as topk_length expects
    out_ref, lse_ref = sparse_attention(q[None].float(), kv[None, :, None].float(), None,
                                        idx[None], scale, dv=Dv, return_lse=True,
                                        backend="reference")
    failures = []
    try:
        out, _, lse = flash_mla_sparse_fwd(q, kv.unsqueeze(1), idx.unsqueeze(1), scale, d_v=Dv,
                                           attn_sink=None, topk_length=length)
        err = ((out.float() - out_ref[0]).norm() / out_ref[0].norm()).item()
        lse_err = (lse - lse_ref[0]).abs().max().item()
        print(f"FlashMLA forward at T={T}: out relative error {err:.2e}, lse max error "
              f"{lse_err:.2e}")
        if err > 1e-2 or lse_err > 1e-2:
            failures.append(f"FlashMLA forward error {err:.2e} / lse {lse_err:.2e}")
    except Exception as err:
        return [f"FlashMLA forward: {type(err).__name__}: {err}"]
    try:
        dout = torch.randn_like(out)
        sink = torch.full((H,), float("-inf"), device="cuda")
        grads = DSA.sparse_attention_backward_wrapper(
            q, kv, out, dout, lse, sink, idx.clamp_min(0), softmax_scale=scale,
            topk_length=length)
        qr = q[None].float().requires_grad_()
        kr = kv[None, :, None].float().requires_grad_()
        o = sparse_attention(qr, kr, None, idx[None], scale, dv=Dv, backend="reference")
        o.backward(dout[None].float())
        for name, got, want in (("dq", grads["dq"], qr.grad[0]),
                                ("dkv", grads["dkv"], kr.grad[0, :, 0])):
            cos = torch.nn.functional.cosine_similarity(got.float().flatten(), want.flatten(),
                                                        dim=0).item()
            print(f"cuDNN sparse-attention backward at T={T}: {name} cosine {cos:.6f}")
            if cos < 0.999:
                failures.append(f"cuDNN backward {name} cosine {cos:.6f}")
    except Exception as err:
        failures.append(f"cuDNN backward: {type(err).__name__}: {err}")
    return failures


if __name__ == "__main__":
    raise SystemExit(main())

"""Sparse indexer KL loss Triton kernels on a GPU at real shapes, against the fp32 reference.

GLM-5.1 (Hq 64, Dqk 576 = 512 + 64, H_I 32 x 128, top-2048) and DeepSeek-V3.2 (Hq 128: two
query-head blocks; H_I 64) shapes with bf16 inputs, a QSA-like GQA case, fp32 inputs, the
deterministic dK mode, and peak memory (no [T, S] tensor). Run with `pytest -m gpu` on the H200.

Tolerances: the kernels read the same bf16 values the reference reads in fp32 and multiply
them exactly in fp32, so the loss agrees to fp32 summation order (relative 1e-4). Gradients
round each dS-weighted term to bf16 for the MMA and are returned in bf16: relative L2 error
below 1e-2 and max error below 2e-2 of the largest entry.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.ops.indexer_loss import indexer_kl_loss

pytestmark = pytest.mark.gpu
DEV = "cuda"


def spread_indices(B, T, S, K, seed=0):
    """Distinct visible keys per row (causal, query t at position S - T + t): for rows that see
    more than K keys one random key per stratum of K equal strata; else all keys, -1 after."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = torch.arange(T, device=DEV)[:, None] + (S - T)
    n = t + 1  # visible keys
    j = torch.arange(K, device=DEV)[None, :]
    lo, hi = (j * n) // K, ((j + 1) * n) // K
    u = torch.rand((B, T, K), generator=g, device=DEV)
    strat = torch.minimum(lo + (u * (hi - lo)).long(), hi - 1)  # u * width may round up to it
    idx = torch.where(n >= K, strat, torch.where(j < n, j, -1))
    return idx.to(torch.int32)


def make(B=1, T=4096, S=None, Hq=64, Hkv=1, Dqk=576, H_I=32, D_I=128, K=2048,
         dtype=torch.bfloat16, seed=0):
    S = T if S is None else S
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, device=DEV) * s).to(dtype)
    x = dict(q_index=r(B, T, H_I, D_I, s=0.3), weights=r(B, T, H_I, s=H_I ** -0.5),
             k_index=r(B, S, D_I, s=0.3), query=r(B, T, Hq, Dqk), key=r(B, S, Hkv, Dqk))
    for n in ("q_index", "weights", "k_index"):
        x[n].requires_grad_()
    return x, spread_indices(B, T, S, K, seed)


def run(x, idx, backend, relu=True, deterministic=False, fp32=False, attention_lse=None):
    t = {n: v.detach().float().requires_grad_(v.requires_grad) if fp32 else v
         for n, v in x.items()}
    scale = x["query"].shape[-1] ** -0.5
    kw = dict(deterministic=deterministic) if backend == "triton" else {}
    if attention_lse is not None:
        kw["attention_lse"] = attention_lse
    loss = indexer_kl_loss(t["q_index"], t["weights"], t["k_index"], t["query"], t["key"], idx,
                           scale, 0.1, sparse=True, relu=relu, backend=backend, **kw)
    grads = torch.autograd.grad(loss, (t["q_index"], t["weights"], t["k_index"]))
    return loss.detach(), grads


def check(x, idx, relu=True, grad_l2=1e-2, grad_max=2e-2, loss_rtol=1e-4, attention_lse=None):
    loss, grads = run(x, idx, "triton", relu=relu, attention_lse=attention_lse)
    r_loss, r_grads = run(x, idx, "reference", relu=relu, fp32=True)
    assert torch.isfinite(loss) and r_loss > 0
    torch.testing.assert_close(loss, r_loss, rtol=loss_rtol, atol=0)
    for name, g, rg in zip(("q_index", "weights", "k_index"), grads, r_grads):
        assert g.dtype == x[name].dtype and torch.isfinite(g).all(), name
        g, rg = g.float(), rg.float()
        assert rg.abs().max() > 0, name
        l2 = (g - rg).norm() / rg.norm()
        assert l2 < grad_l2, (name, float(l2))
        assert (g - rg).abs().max() <= grad_max * rg.abs().max(), name
    return loss, grads


def test_glm_shape_bf16():
    x, idx = make()
    check(x, idx)


def test_glm_shape_with_the_attention_kernels_lse():
    """The layer's path: the sparse-attention kernel's log-sum-exp over the same slots replaces
    the target's first pass; the result stays within the same bounds of the reference."""
    from megatron_hyscale.ops.sparse_attention import sparse_attention

    x, idx = make(seed=4)
    _, lse = sparse_attention(x["query"], x["key"], None, idx, x["query"].shape[-1] ** -0.5,
                              dv=512, return_lse=True)
    check(x, idx, attention_lse=lse)


def test_v32_shape_two_head_blocks_relu_off():
    # 128 query heads (two blocks of 64), 64 indexer heads; relu off folds the weights.
    x, idx = make(T=1024, Hq=128, H_I=64, seed=1)
    check(x, idx, relu=False)
    check(x, idx, relu=True)


def test_batched_gqa_and_ragged_keys():
    # QSA-like GQA (24 query / 2 KV heads of 256), B = 2, S > T (a later chunk of rows),
    # K not a power of two.
    x, idx = make(B=2, T=768, S=1280, Hq=24, Hkv=2, Dqk=256, H_I=4, D_I=128, K=1000, seed=2)
    check(x, idx)


def test_fp32_inputs_tight():
    x, idx = make(T=512, K=256, dtype=torch.float32, seed=3)
    check(x, idx, grad_l2=1e-4, grad_max=1e-4, loss_rtol=1e-5)


def test_repeated_and_invisible_indices():
    x, idx = make(T=1024, K=512, seed=4)
    idx = idx.clone()
    idx[..., 7] = idx[..., 3]  # repeated
    idx[..., 9] = 1023  # invisible to all rows but the last
    idx[0, 5] = -1  # a row with nothing
    check(x, idx)


def test_deterministic_is_bitwise_repeatable():
    x, idx = make(T=2048, seed=5)
    _, g1 = run(x, idx, "triton", deterministic=True)
    _, g2 = run(x, idx, "triton", deterministic=True)
    _, ga = run(x, idx, "triton")
    for a, b, c in zip(g1, g2, ga):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-2,
                                   atol=1e-2 * float(c.abs().max()))


def test_memory_has_no_score_table():
    # 16K tokens: a [T, S] fp32 table would be 1 GiB; the kernels keep the target (T x K fp32,
    # 128 MiB) and row statistics, and return dq (bf16 [T, H_I, D_I]) and dk via an fp32 buffer.
    T, K, H_I, D_I = 16384, 2048, 32, 128
    x, idx = make(T=T, K=K, seed=6)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run(x, idx, "triton")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    allowed = T * K * 4 + T * H_I * D_I * 2 + T * D_I * (4 + 2) + (128 << 20)
    assert extra < allowed, (extra, allowed)

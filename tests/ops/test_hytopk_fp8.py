"""HyTopK with precision="fp8": the quantization, the reference on the quantized inputs, and the
Triton kernel's fp8 path (under the interpreter on CPU, which runs e4m3 dot products).

Integer-valued inputs quantize exactly (small integers times a power-of-two scale are e4m3
values), so precision="fp8" must then give the bf16 path's outputs bit for bit, kernel and
reference alike. Random inputs: the kernel's selection equals the reference's on the same
quantized inputs. The GPU cases at the end run on the H200 (`pytest -m gpu`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from test_hytopk_triton import DEVICE, int_inputs, kernel_options  # noqa: E402

from megatron_hyscale.ops import HyTopKOptions, fp8_quant, hytopk  # noqa: E402
from megatron_hyscale.ops.backends import dispatch  # noqa: E402
from megatron_hyscale.ops.fp8_quant import (  # noqa: E402
    FP8_DTYPE,
    dequantize,
    quantize_indexer,
    quantize_rows,
    selection_overlap,
)
from megatron_hyscale.ops.hytopk import validate_hytopk_inputs  # noqa: E402
from megatron_hyscale.ops.kernels import hytopk as kernel  # noqa: E402


def both_backends(q, k, w, topk, block_n=16, **kw):
    """fp8 outputs of the reference and of the kernel (small tiles: many compactions)."""
    ref = hytopk(q, k, w, topk, backend="reference", precision="fp8", **kw)
    out = hytopk(q, k, w, topk, backend="triton", precision="fp8",
                 options=kernel_options(block_n), **kw)
    return ref, out


def assert_fp8_equals_bf16(q, k, w, topk, **kw):
    """Exactly quantizable inputs: both fp8 backends give the bf16 reference's outputs."""
    bf16 = hytopk(q, k, w, topk, backend="reference", **kw)
    for got in both_backends(q, k, w, topk, **kw):
        assert torch.equal(got[0], bf16[0]), (got[0], bf16[0])
        assert torch.equal(got[1], bf16[1]), (got[1], bf16[1])
        assert not torch.signbit(got[1][got[1] == 0]).any()  # -0.0 comes out as +0.0
    return bf16


# ----------------------------------------------------------------------------------------------
# The argument and the quantization
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["fp16", "FP8", None, 8])
def test_precision_is_validated(bad):
    q, k, w = int_inputs(1, 4, 4, 2, 16, seed=0)
    with pytest.raises(ValueError, match="precision must be one of"):
        hytopk(q, k, w, 2, precision=bad)


def test_prune_with_fp8_raises():
    q, k, w = int_inputs(1, 4, 4, 2, 16, seed=0)
    with pytest.raises(ValueError, match="options.prune"):
        hytopk(q, k, w, 2, precision="fp8", options=replace(HyTopKOptions.DEFAULT, prune=True))


def test_scales_are_deepseeks_ue8m0():
    # One scale per (token, head) for q and per token for k: the smallest power of two at or
    # above amax / 448 (amax floored at 1e-4), so the largest |value| lands in (224, 448]
    # (224 itself once rounded to e4m3).
    amax = torch.tensor([448.0, 449.0, 3.0, 1.0, 0.0, 896.0, 0.5])
    want = torch.tensor([1.0, 2.0, 2.0**-7, 2.0**-8, 2.0**-22, 2.0, 2.0**-9])
    assert torch.equal(fp8_quant.pow2_scale(amax), want)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 3, 32, generator=g) * torch.rand(2, 5, 3, 1, generator=g) * 100
    k = torch.randn(2, 7, 32, generator=g)
    q8, sq, k8, sk = quantize_indexer(q, k)
    assert (q8.dtype, k8.dtype, sq.dtype, sk.dtype) == (FP8_DTYPE, FP8_DTYPE, torch.float32,
                                                      torch.float32)
    assert sq.shape == (2, 5, 3) and sk.shape == (2, 7)
    for x, x8, s in ((q, q8, sq), (k, k8, sk)):
        assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))  # powers of two
        top = x8.float().abs().amax(-1)
        assert (top >= 224).all() and (top <= 448).all()
        # e4m3 rounding: 2^-4 relative for normal values, half the 2^-9 spacing below them.
        err = (dequantize(x8, s) - x).abs()
        assert (err <= x.abs() * 2.0**-4 + s[..., None] * 2.0**-10).all()


def test_quantization_exact_on_small_integers_zero_rows_and_noncontiguous(monkeypatch):
    q, k, _ = int_inputs(2, 6, 9, 3, 16, seed=1, lo=-7, hi=8)
    q[0, 2] = 0.0  # an all-zero row: the amax floor gives a finite scale and zeros
    q[1, 3, 1, :4] = -0.0
    q8, sq, k8, sk = quantize_indexer(q, k)
    assert torch.equal(dequantize(q8, sq), q) and torch.equal(dequantize(k8, sk), k)
    assert torch.isfinite(sq).all() and (q8[0, 2].float() == 0).all()
    # Strides and chunking do not change the values (q's chunks along T).
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    monkeypatch.setattr(fp8_quant, "CHUNK_ELEMENTS", 40)
    q8c, sqc = quantize_rows(qt)
    assert torch.equal(q8c.view(torch.uint8), q8.view(torch.uint8)) and torch.equal(sqc, sq)


def test_scales_are_applied_as_deepseeks_fp8_index():
    # The fp8 reference's scores are sum_h w sq relu(q8 . k8) times sk (the kernel's placement
    # of the scales), computed here in fp64 from the quantized tensors.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 12, 4, 32, generator=g).bfloat16()
    k = torch.randn(1, 12, 32, generator=g).bfloat16()
    w = torch.randn(1, 12, 4, generator=g)
    idx, scores = hytopk(q, k, w, 5, backend="reference", precision="fp8")
    q8, sq, k8, sk = quantize_indexer(q, k)
    dots = torch.einsum("bthd,bsd->bths", q8.double(), k8.double()).relu()
    want = (dots * (w.double() * sq.double())[..., None]).sum(2) * sk.double()[:, None, :]
    got = want.gather(-1, idx.long().clamp_min(0)).masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(scores.double(), got, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Exactness: integer-valued inputs give the bf16 outputs (reference and kernel)
# ----------------------------------------------------------------------------------------------


def test_exact_ties_compaction_batch2_and_per_row_scales():
    # Values in {-1, 0, 1}: constant ties; 48 keys in 16-key tiles with top 6 compact often.
    # Rows scaled by different powers of two get different scales, still exact.
    q, k, w = int_inputs(2, 20, 48, 4, 16, seed=1, lo=-1, hi=2)
    q = q * 2.0 ** torch.randint(-3, 4, (2, 20, 4, 1), generator=torch.Generator().manual_seed(0))
    k = k * 4.0
    assert_fp8_equals_bf16(q, k, w, 6)


def test_exact_with_sampled_thresholds():
    """fp8 scores through the sampling pass (rows that see 640 keys sample 128 of them: topk 40
    in 128-entry buffers with 32-key tiles; non-causal) and the stream: the bf16 outputs."""
    q, k, w = int_inputs(1, 8, 640, 4, 32, seed=21, lo=-1, hi=2)
    bf16 = hytopk(q, k, w, 40, backend="reference", causal=False)
    qpos, kpos = validate_hytopk_inputs(q, k, w, 40, None, None)
    q8, qs, k8, ks = quantize_indexer(q, k)
    stats = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = kernel._launch(q8, k8, w, 40, relu=True, causal=False, q_positions=qpos,
                         k_positions=kpos, q_scale=qs, k_scale=ks, sample_stats=stats,
                         options=kernel_options(block_n=32, sample_keys=1024))
    assert torch.equal(out[0], bf16[0]) and torch.equal(out[1], bf16[1])
    assert stats[0].item() == 8  # every row took a guess


def test_exact_all_zero_rows_negative_zero_and_fewer_visible_than_k():
    q, k, w = int_inputs(1, 16, 40, 2, 16, seed=2)
    k = k.abs()
    q[0, :8] = -q[0, :8].abs()  # ReLU zeroes every logit: order by key index alone
    w[0, :8] = -1.0  # ... and the zeros are -0.0 times the weights
    q[0, 8] = 0.0  # an all-zero query row (the amax floor's scale)
    idx, _ = assert_fp8_equals_bf16(q, k, w, 7)
    assert idx[0, 0, 0].item() == 0
    q, k, w = int_inputs(1, 10, 10, 4, 16, seed=3)
    idx, _ = assert_fp8_equals_bf16(q, k, w, 16)  # topk > S: -1 / -inf past the visible keys
    assert (idx[0, 0, 1:] == -1).all()


def test_exact_noncontiguous_shard_positions_relu_false_noncausal():
    q, k, w = int_inputs(1, 21, 33, 5, 8, seed=13)  # 5 heads padded to 8, D = 8 padded to 32
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    pos = torch.cat([torch.arange(4, 12), torch.arange(36, 49)]).view(1, -1).to(DEVICE)
    assert_fp8_equals_bf16(q, k, w, 10, q_positions=pos)
    q, k, w = int_inputs(2, 18, 44, 4, 16, seed=4)
    assert_fp8_equals_bf16(q, k, w, 9, relu=False)
    assert_fp8_equals_bf16(q, k, w, 9, causal=False)


@pytest.mark.parametrize("keys_on_m,atomic_slots,key_tma", [(False, False, False),
                                                             (True, True, False),
                                                             (True, True, True)])
def test_exact_kernel_variants(keys_on_m, atomic_slots, key_tma):
    q, k, w = int_inputs(2, 20, 48, 4, 16, seed=5, lo=-1, hi=2)
    bf16 = hytopk(q, k, w, 6, backend="reference")
    # The fp8 MMA's promotion interval reaches the kernel (the interpreter sums exactly anyway;
    # the GPU tests run both); key_tma: the e4m3 key tiles through the TMA descriptor.
    options = replace(kernel_options(16), keys_on_m=keys_on_m, atomic_slots=atomic_slots,
                      fp8_imprecise_acc=32 if keys_on_m else None, key_tma=key_tma)
    out = hytopk(q, k, w, 6, backend="triton", precision="fp8", options=options)
    assert torch.equal(out[0], bf16[0]) and torch.equal(out[1], bf16[1])


# ----------------------------------------------------------------------------------------------
# Random inputs: the kernel against the reference on the same quantized inputs
# ----------------------------------------------------------------------------------------------


def random_inputs(B, T, S, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(DEVICE, torch.bfloat16)
    k = torch.randn(B, S, D, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(B, T, H, generator=g) * (H * D) ** -0.5).to(DEVICE)
    return q, k, w


@pytest.mark.parametrize("relu", [True, False])
def test_random_kernel_selects_as_reference_on_quantized_inputs(relu):
    q, k, w = random_inputs(2, 24, 64, 4, 32, seed=7)
    ref, out = both_backends(q, k, w, 10, relu=relu)
    assert torch.equal(out[0], ref[0])
    # fp32 sums in another order: the scores agree to rounding.
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-6)
    # ... and quantization did change them: the test is not the bf16 path's twice.
    bf16 = hytopk(q, k, w, 10, relu=relu, backend="reference")
    assert not torch.equal(bf16[1], ref[1])


# ----------------------------------------------------------------------------------------------
# The overlap measure, and the cuDNN backend's refusal
# ----------------------------------------------------------------------------------------------


def test_selection_overlap_counts_shared_keys(monkeypatch):
    a = torch.tensor([[[3, 1, 2, -1], [5, 6, 7, 8], [-1, -1, -1, -1], [0, 1, 2, 3]]])
    b = torch.tensor([[[1, 2, 3, 9], [8, 9, 10, 11], [-1, -1, -1, -1], [-1, -1, 3, 0]]])
    want = torch.tensor([[3 / 4, 1 / 4, 1.0, 2 / 2]])
    assert torch.equal(selection_overlap(a, b), want)
    # Different widths, and the row chunks of long inputs.
    g = torch.Generator().manual_seed(0)
    x = torch.stack([torch.randperm(50, generator=g)[:12] for _ in range(30)])
    y = torch.stack([torch.randperm(50, generator=g)[:8] for _ in range(30)])
    brute = torch.tensor([len(set(r.tolist()) & set(s.tolist())) / 8 for r, s in zip(x, y)])
    monkeypatch.setattr(fp8_quant, "OVERLAP_CHUNK_ELEMENTS", 50)
    assert torch.allclose(selection_overlap(x, y), brute)
    with pytest.raises(ValueError, match="same leading dims"):
        selection_overlap(x, y[:5])


def test_overlap_with_bf16_selection_random_and_integer():
    # Random inputs: e4m3 keeps 4 significant bits, so rows near their k-th score swap keys;
    # most of the top-k stays. Integer inputs quantize exactly: the overlap is 1.
    q, k, w = random_inputs(1, 96, 96, 8, 64, seed=11)
    fp8 = hytopk(q, k, w, 16, backend="reference", precision="fp8")[0]
    bf16 = hytopk(q, k, w, 16, backend="reference")[0]
    overlap = selection_overlap(fp8, bf16)
    assert overlap.shape == (1, 96)
    assert overlap.mean().item() > 0.8, overlap.mean().item()
    assert overlap.min().item() < 1.0  # quantization moved some rows' selections
    qi, ki, wi = int_inputs(1, 30, 30, 4, 16, seed=12)
    fi = hytopk(qi, ki, wi, 8, backend="reference", precision="fp8")[0]
    bi = hytopk(qi, ki, wi, 8, backend="reference")[0]
    assert (selection_overlap(fi, bi) == 1).all()


def test_cudnn_backend_warns_and_runs_hyscales_fp8(monkeypatch):
    # As if cuDNN could run the call: fp8 still cannot, so one warning names why and the fp8
    # selection runs on HyScale's path (never the library's).
    from megatron_hyscale.ops.backends import cudnn_selection as cs

    monkeypatch.setattr(cs, "cudnn_selection_unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(cs, "cudnn_selection", lambda *a, **kw: pytest.fail("library ran"))
    monkeypatch.setattr(dispatch, "_announced", set())
    q, k, w = int_inputs(1, 12, 12, 2, 16, seed=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hytopk(q, k, w, 4, backend="cudnn", precision="fp8")
    assert any("precision='fp8'" in str(c.message) for c in caught), [str(c.message)
                                                                       for c in caught]
    want = hytopk(q, k, w, 4, backend="reference", precision="fp8")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------------------------
# GPU (the H200): realistic sizes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("acc", [None, 32])
@pytest.mark.parametrize("T,H,topk", [(8192, 64, 2048), (8192, 32, 1000), (8192, 4, 512)])
def test_gpu_integer_inputs_exact(T, H, topk, acc):
    g = torch.Generator(device="cuda").manual_seed(T + H)
    q = torch.randint(-3, 4, (1, T, H, 128), device="cuda", generator=g).bfloat16()
    k = torch.randint(-3, 4, (1, T, 128), device="cuda", generator=g).bfloat16()
    w = torch.randint(-2, 3, (1, T, H), device="cuda", generator=g).float()
    bf16 = hytopk(q, k, w, topk, backend="reference")
    out = hytopk(q, k, w, topk, backend="triton", precision="fp8",
                 options=replace(HyTopKOptions.DEFAULT, fp8_imprecise_acc=acc))
    assert torch.equal(out[0], bf16[0]) and torch.equal(out[1], bf16[1])


@pytest.mark.gpu
def test_gpu_integer_inputs_exact_with_key_tma():
    """HyTopKOptions.key_tma with e4m3 keys (one byte a channel: the TMA box's rows are 128 B)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randint(-3, 4, (2, 4096, 64, 128), device="cuda", generator=g).bfloat16()
    k = torch.randint(-3, 4, (2, 4096, 128), device="cuda", generator=g).bfloat16()
    w = torch.randint(-2, 3, (2, 4096, 64), device="cuda", generator=g).float()
    bf16 = hytopk(q, k, w, 2048, backend="reference")
    out = hytopk(q, k, w, 2048, backend="triton", precision="fp8",
                 options=replace(HyTopKOptions.DEFAULT, key_tma=True))
    assert torch.equal(out[0], bf16[0]) and torch.equal(out[1], bf16[1])


@pytest.mark.gpu
@pytest.mark.parametrize("acc", [None, 32])
def test_gpu_random_matches_reference_on_quantized_inputs(acc):
    # The fp8 MMA sums its products in its own precision (acc None: all 128 channels), so the
    # scores differ from the fp32 reference's by more than fp32 rounding: compare the scores to
    # a loose tolerance and the selections by overlap (floors well under what a correct kernel
    # gives, not measured figures: the print records those).
    q, k, w = random_inputs(1, 16384, 16384, 64, 128, seed=21)
    ref = hytopk(q, k, w, 2048, backend="reference", precision="fp8")
    out = hytopk(q, k, w, 2048, backend="triton", precision="fp8",
                 options=replace(HyTopKOptions.DEFAULT, fp8_imprecise_acc=acc))
    bf16 = hytopk(q, k, w, 2048, backend="triton")
    same = selection_overlap(out[0], ref[0]).mean().item()
    vs_bf16 = selection_overlap(out[0], bf16[0]).mean().item()
    print(f"fp8 acc={acc}: overlap with the fp8 reference {same:.6f}, with bf16 {vs_bf16:.4f}")
    assert same > 0.98
    assert vs_bf16 > 0.7
    assert torch.equal(out[0] < 0, ref[0] < 0)
    scale = ref[1][..., :1].abs().clamp_min(1e-6)  # each row's top score
    assert ((out[1] - ref[1]).abs().nan_to_num(0.0) <= 1e-2 * scale).all()

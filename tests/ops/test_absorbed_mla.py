"""ops.absorbed_mla: the absorbed query and the V up projection written in place equal
megatron-core's einsum / RoPE / concatenation, values and gradients, bit for bit.

Integer-valued q and weights keep the GEMMs' fp32 sums exact, so the products must agree
exactly; the RoPE factors are arbitrary (megatron's own cos / sin of random frequencies), so
its roundings are checked. Both the Triton kernel (the interpreter here, CUDA on the GPU) and
the plain-torch path run.
"""

from __future__ import annotations

import re

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron_hyscale.ops import absorbed_mla
from megatron_hyscale.ops.absorbed_mla import absorbed_query, project_values
from megatron_hyscale.testing.inspect_sm90 import run_inspect_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
S, B, N, D, R, C, DV = 33, 2, 5, 12, 8, 16, 6  # 330 (row, batch, head) triples: 3 programs


def integers(*shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(DEVICE, dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, the signs of zeros included (torch.equal has -0.0 == 0.0)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def megatron_query(q, k_up, freqs, mscale):
    """AbsorbedMLA's unfused path (absorbed_mla.py): split, einsum, contiguous, RoPE, cat."""
    d = k_up.size(1)
    q_no_pe, q_pos_emb = torch.split(q, [d, q.size(-1) - d], dim=-1)
    q_absorbed = torch.einsum("...nd,ndk->...nk", q_no_pe, k_up).contiguous()
    q_pos_emb = _apply_rotary_pos_emb_bshd(q_pos_emb, freqs, mla_rotary_interleaved=True,
                                           mscale=mscale)
    return torch.cat([q_absorbed, q_pos_emb], dim=-1)


def rope_factors(freqs, mscale, dtype):
    return [(f(freqs) * mscale).to(dtype).view(freqs.size(0), -1) for f in (torch.cos,
                                                                             torch.sin)]


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":
        if DEVICE == "cuda":
            pytest.skip("CUDA tensors always take the kernel")
        monkeypatch.setattr(absorbed_mla, "triton_interpret", lambda: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-q"])
def test_absorbed_query_is_megatrons_bitwise(path, dtype, strided):
    q = integers(S, B, N, D + R + (3 if strided else 0), seed=1, dtype=dtype)
    if strided:  # the up projection's output seen through a wider buffer
        q = q[..., 3:]
    q.requires_grad_(True)
    k_up = integers(N, D, C, seed=2, dtype=dtype).requires_grad_(True)
    g = torch.Generator().manual_seed(3)
    freqs = (torch.rand(S, 1, 1, R, generator=g) * 40).to(DEVICE)
    mscale = 1.25
    cos, sin = rope_factors(freqs, mscale, dtype)
    got = absorbed_query(q, k_up, cos, sin)
    want = megatron_query(q, k_up, freqs, mscale)
    assert got.is_contiguous() and got.shape == (S, B, N, C + R)
    # The GEMM parts as values (an exact zero's sign depends on the GEMM kernel's start), the
    # RoPE part bit for bit.
    assert torch.equal(got, want) and same_bits(got[..., C:], want[..., C:])
    grad = integers(*got.shape, seed=7, dtype=dtype)  # exact sums in any GEMM's order
    got_dq, got_dk = torch.autograd.grad(got, (q, k_up), grad)
    want_dq, want_dk = torch.autograd.grad(want, (q, k_up), grad)
    assert torch.equal(got_dq, want_dq) and torch.equal(got_dk, want_dk)
    assert same_bits(got_dq[..., D:], want_dq[..., D:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_signed_zeros_are_megatrons(path, dtype):
    """Position 0 (sin = 0, cos = 1) with -0.0 and +0.0 in the rotary inputs and in the
    gradient: each zero's sign as megatron's negate-then-add gives it."""
    q = integers(S, B, N, D + R, seed=1, dtype=dtype)
    # The interleaved (lo, hi) pairs: (+0, -0) in the first half, (-0, +0) in the second.
    zeros = torch.tensor([0.0, -0.0], dtype=dtype, device=DEVICE).repeat(R // 2)
    zeros[R // 2:] = -zeros[R // 2:]
    q[..., D:] = zeros
    q.requires_grad_(True)
    k_up = integers(N, D, C, seed=2, dtype=dtype)
    freqs = torch.linspace(0.0, 2.0, S).view(S, 1, 1, 1).expand(S, 1, 1, R).contiguous()
    freqs[::2] = 0.0  # sin = +0, cos = 1 on the even rows
    freqs = freqs.to(DEVICE)
    cos, sin = rope_factors(freqs, 1.0, dtype)
    got = absorbed_query(q, k_up, cos, sin)
    want = megatron_query(q, k_up, freqs, 1.0)
    assert same_bits(got[..., C:], want[..., C:])
    grad = torch.zeros(got.shape, dtype=dtype, device=DEVICE)
    grad[..., C:] = zeros
    (got_dq,) = torch.autograd.grad(got, q, grad)
    (want_dq,) = torch.autograd.grad(want, q, grad)
    assert same_bits(got_dq[..., D:], want_dq[..., D:])


def test_a_wrong_rotation_is_caught(path):
    """The comparison can fail: the halves' roles swapped (non-interleaved RoPE) differ."""
    q = integers(S, 1, N, D + R, seed=1)
    k_up = integers(N, D, C, seed=2)
    freqs = torch.linspace(0.1, 3.0, S * R).view(S, 1, 1, R).to(DEVICE)
    cos, sin = rope_factors(freqs, 1.0, q.dtype)
    got = absorbed_query(q, k_up, cos, sin)
    plain = _apply_rotary_pos_emb_bshd(q[..., D:], freqs, mla_rotary_interleaved=False)
    assert not torch.equal(got[..., C:], plain)


def test_absorbed_query_inputs_are_checked():
    q, k_up = integers(S, B, N, D + R, seed=1), integers(N, D, C, seed=2)
    cos = sin = torch.ones(S, R, dtype=q.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="k_up_weight"):
        absorbed_query(q, integers(N + 1, D, C, seed=2), cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        absorbed_query(q, k_up, cos[:-1], sin)
    with pytest.raises(ValueError, match="sin must be"):
        absorbed_query(q, k_up, cos, sin.float())
    with pytest.raises(ValueError, match="rotary part"):
        absorbed_query(q[..., :-2], k_up, cos[:, :-2], sin[:, :-2])


@pytest.mark.parametrize("batch", [1, 2])
def test_project_values_is_the_einsum_bitwise(batch):
    out = integers(batch, S, N, C, seed=4).requires_grad_(True)
    v_up = integers(N, DV, C, seed=5).requires_grad_(True)
    got = project_values(out, v_up)
    want = torch.einsum("bshc,hdc->sbhd", out, v_up).reshape(S, batch, -1)
    assert got.shape == (S, batch, N * DV) and torch.equal(got, want)
    grad = integers(*got.shape, seed=6)
    for a, b in zip(torch.autograd.grad(got, (out, v_up), grad),
                    torch.autograd.grad(want, (out, v_up), grad), strict=True):
        assert torch.equal(a, b)


def test_project_values_checks_the_heads():
    with pytest.raises(ValueError, match="v_up_weight"):
        project_values(integers(1, S, N, C, seed=4), integers(N, DV, C + 1, seed=5))


@pytest.mark.gpu
def test_glm_width_on_the_gpu_matches_megatron():
    """GLM-5.1's widths (64 heads, 192 + 64 -> 512 + 64) at 4K rows: the GEMM as the
    einsum's (cuBLAS may pick another kernel for the strided output: fp32-rounding close),
    the RoPE bitwise, the gradients likewise."""
    g = torch.Generator(device="cuda").manual_seed(0)
    s, n, d, r, c = 4096, 64, 192, 64, 512
    q = torch.randn(s, 1, n, d + r, device="cuda", generator=g).bfloat16().requires_grad_()
    k_up = (torch.randn(n, d, c, device="cuda", generator=g) / 14).bfloat16().requires_grad_()
    pos = torch.arange(s, device="cuda", dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, device="cuda").float() / r))
    freqs = torch.cat([torch.outer(pos, inv)] * 2, dim=-1).view(s, 1, 1, r)
    cos, sin = rope_factors(freqs, 1.0, torch.bfloat16)
    got = absorbed_query(q, k_up, cos, sin)
    want = megatron_query(q, k_up, freqs, 1.0)
    assert torch.equal(got[..., c:], want[..., c:])
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    grad = torch.randn(got.shape, device="cuda", generator=g).bfloat16()
    for a, b in zip(torch.autograd.grad(got, (q, k_up), grad),
                    torch.autograd.grad(want, (q, k_up), grad), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_rope_kernel_rounds_each_product_when_compiled(tmp_path):
    """Compiled for sm_90a (scripts/inspect_sm90.py, no GPU needed), the RoPE kernel keeps
    megatron's roundings: products and sums as separate FMUL / FADD, no fused multiply-add
    (an FFMA skips the product's rounding; an HFMA2 is what a bf16 cast-and-back around the
    product turned into, which differed from megatron on the H200)."""
    proc = run_inspect_sm90("--preset", "mla-rope-bf16", "mla-rope-fp32", "--sass-out",
                            str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(tmp_path.glob("mla-rope-*.sass"))
    assert len(files) == 4  # forward and backward, bf16 and fp32
    for f in files:
        sass = f.read_text()
        assert re.search(r"\bFMUL\b", sass) and re.search(r"\bFADD\b", sass), f.name
        # (HFMA2.MMA R, -RZ, RZ, imm: ptxas's way of setting a register to a constant)
        fused = [line for line in sass.splitlines() if re.search(r"\b(FFMA|HFMA2)\b", line)
                 and not re.search(r"HFMA2\.MMA R\d+, -RZ, RZ,", line)]
        assert fused == [], f.name

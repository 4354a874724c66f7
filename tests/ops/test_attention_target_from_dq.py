"""The indexer loss's target emitted by the sparse-attention dQ kernel (TARGET), under the
interpreter on CPU (also runs on CUDA).

`sparse_attention_bwd_with_target` must give `indexer_loss.attention_target`'s values (with the
forward's lse) and an fp64 head-summed softmax: a tail head dim with V = K's main part (absorbed
MLA), one program a query (stored), two (two head blocks, or two KV heads sharing the indices:
atomic adds) and three (three KV heads: per-program slices), B = 2, -1 slots, an empty row,
rows with fewer visible keys than slots, tied keys, non-contiguous inputs. Also: bitwise
repeatable, the fused backward's target the same, the gradients unchanged by emitting it, and
the ValueErrors for what it does not cover.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megatron_hyscale.ops.kernels import sparse_attention as kern  # noqa: E402
from megatron_hyscale.ops.kernels.common import MAX_BLOCK_H  # noqa: E402
from megatron_hyscale.ops.kernels.indexer_loss import attention_target  # noqa: E402
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-5  # fp32 kernels vs the fp64 reference, relative to the reference's largest entry

# Key tiles of 16 so rows span several tiles with a ragged tail, in every kernel.
SMALL = replace(AttentionKernelOptions.DEFAULT, fwd_tilings=((16, 1),), dq_tilings=((16, 1),),
                dkv_tilings=((16, 1),), narrow_dq_tilings=((16, 1),),
                narrow_dkv_tilings=((16, 1),), bwd_fused_tilings=((16, 1),))
FUSED = replace(SMALL, bwd_fused=True)

CASES = {
    # name: (B, T, S, Hq, Hkv, D, v_dim or None, dv, NK, 4-D indices); programs a query =
    # Hkv x head blocks of MAX_BLOCK_H (64) heads.
    # GLM-5.1's form: one KV head, 24 = 16 + 8 channels, V = K's main 16; one program (stored).
    "absorbed_tail": (2, 5, 40, 4, 1, 24, None, 16, 20, False),
    # The same with [B, T, 1, K] indices (one KV head's own).
    "absorbed_tail_4d_indices": (2, 3, 40, 4, 1, 24, None, 16, 20, True),
    # 80 heads: two head blocks of 64 (V3.2's two programs): atomic adds.
    "two_head_blocks": (1, 3, 30, 80, 1, 16, None, None, 17, False),
    # Two KV heads sharing [B, T, K] indices, separate V: atomic adds.
    "gqa_shared_indices": (2, 3, 36, 4, 2, 16, 24, None, 18, False),
    # Three KV heads sharing the indices: one slice each, summed in order.
    "three_kv_heads": (2, 3, 36, 6, 3, 24, 16, None, 19, False),
}


def visible_indices(B, T, S, NK, gen, four_d):
    """Row t of query position 7 t + 3 lists distinct keys at positions <= its own (so rows
    0 .. 2 have fewer visible keys than NK), in random slot order with -1 in the rest, some
    scattered -1 holes, and row (B - 1, T - 1) empty. Also the positions."""
    q_pos = (7 * torch.arange(T) + 3).expand(B, T).contiguous()
    idx = torch.full((B, T, NK), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            keys = torch.randperm(min(int(q_pos[b, t]) + 1, S), generator=gen)[:NK]
            idx[b, t, torch.randperm(NK, generator=gen)[: keys.numel()]] = keys
    idx[..., 3::7] = -1
    idx[B - 1, T - 1] = -1
    k_pos = torch.arange(S).expand(B, S).contiguous()
    idx = idx.unsqueeze(2) if four_d else idx
    return idx.to(DEVICE), q_pos.to(DEVICE), k_pos.to(DEVICE)


def build(case, seed, integer=False):
    """Inputs of a case; keys 1 and 2 identical and key 4 equal to key 3 (ties). integer:
    small integer-valued q, k, v, so every product and sum of s is exact in fp32."""
    B, T, S, Hq, Hkv, D, vdim, dv, NK, four_d = CASES[case]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randint(-2, 3, shape, generator=g).float() if integer else \
            torch.randn(*shape, generator=g)

    q, k = rand(B, T, Hq, D), rand(B, S, Hkv, D)
    k[:, 2] = k[:, 1]
    k[:, 4] = k[:, 3]
    v = rand(B, S, Hkv, vdim).to(DEVICE) if vdim else None
    idx, q_pos, k_pos = visible_indices(B, T, S, NK, g, four_d)
    scale = 0.25 if integer else D ** -0.5
    return dict(q=q.to(DEVICE), k=k.to(DEVICE), v=v, indices=idx, dv=dv, scale=scale,
                q_pos=q_pos, k_pos=k_pos)


def forward(x, options=SMALL):
    out, lse = kern.sparse_attention_fwd(x["q"], x["k"], x["v"], x["indices"], x["scale"],
                                         dv=x["dv"], options=options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    return out, lse, dout


def backward(x, out, lse, dout, with_target, options=SMALL, deterministic=False):
    fn = kern.sparse_attention_bwd_with_target if with_target else kern.sparse_attention_bwd
    return fn(x["q"], x["k"], x["v"], x["indices"], x["scale"], out, lse, dout, dv=x["dv"],
              deterministic=deterministic, options=options)


def reference_target(q, k, indices, scale):
    """fp64 sum_h softmax_j(scale * q_h . k_{indices_j}) at valid slots, -1 elsewhere."""
    q, k = q.double(), k.double()
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    idx = indices if indices.dim() == 3 else indices[:, :, 0]
    valid = idx >= 0
    bi = torch.arange(B, device=q.device)[:, None, None]
    ks = k[bi, idx.clamp(min=0).long()]  # [B, T, K, Hkv, D]
    s = torch.einsum("btgxd,btjgd->btgxj", q.view(B, T, Hkv, Hq // Hkv, D), ks) * scale
    p = torch.softmax(s.masked_fill(~valid[:, :, None, None, :], float("-inf")), dim=-1)
    return torch.where(valid, p.nan_to_num(0.0).sum(dim=(2, 3)), -1.0)


def close(name, got, ref):
    assert got is not None and not torch.isnan(got).any(), f"{name}: NaN or missing"
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= TOL * (1.0 + ref.abs().max().item()), f"{name}: max error {err}"


def check_target(target, x, lse):
    """Against attention_target (given lse) and the fp64 reference; -1 exactly where the
    indices are; the empty row all -1; tied keys' slots equal."""
    idx = x["indices"] if x["indices"].dim() == 3 else x["indices"][:, :, 0]
    B, T, NK = idx.shape
    assert target.shape == (B, T, NK) and target.dtype == torch.float32
    assert torch.equal(target < 0, idx < 0) and (target[idx < 0] == -1).all()
    assert (target[B - 1, T - 1] == -1).all()
    ref = reference_target(x["q"], x["k"], x["indices"], x["scale"])
    close("target vs fp64", target, ref)
    by_loss = attention_target(x["q"], x["k"], idx, x["q_pos"], x["k_pos"], x["scale"],
                               attention_lse=lse)
    close("target vs attention_target", target, by_loss)
    # Each valid row's target sums to its head count (every head's softmax sums to 1).
    rows = (idx >= 0).any(-1)
    sums = torch.where(target > 0, target, 0.0).sum(-1)[rows]
    close("row sums", sums, torch.full_like(sums, x["q"].shape[2]))
    for b in range(B):
        for t in range(T):
            slot = {int(i): j for j, i in enumerate(idx[b, t].tolist()) if i >= 0}
            for a, c in ((1, 2), (3, 4)):
                if a in slot and c in slot:
                    assert target[b, t, slot[a]] == target[b, t, slot[c]]


@pytest.mark.parametrize("case", list(CASES))
def test_target_matches_attention_target_and_fp64(case):
    x = build(case, seed=len(case))
    Hq, Hkv = x["q"].shape[2], x["k"].shape[2]
    if case == "two_head_blocks":
        assert Hq // Hkv > MAX_BLOCK_H  # several head blocks a query
    out, lse, dout = forward(x)
    *_, target = backward(x, out, lse, dout, True)
    check_target(target, x, lse)
    # The dQ launch alone: the same target as a fourth output.
    dq, delta, dsink, alone = kern.sparse_attention_bwd_dq(
        x["q"], x["k"], x["v"], x["indices"], x["scale"], out, lse, dout, dv=x["dv"],
        options=SMALL, emit_target=True)
    assert dsink is None and torch.equal(alone, target)
    assert len(kern.sparse_attention_bwd_dq(x["q"], x["k"], x["v"], x["indices"], x["scale"],
                                            out, lse, dout, dv=x["dv"], options=SMALL)) == 3


def test_non_contiguous_inputs():
    """q sliced from a transposed tensor, k transposed, v and indices strided (two KV heads
    sharing the indices)."""
    x = build("gqa_shared_indices", seed=3)
    B, T, Hq, D = x["q"].shape
    S, Hkv = x["k"].shape[1:3]
    wide_q = torch.zeros(B, Hq, T, D + 8, device=DEVICE)
    wide_q.transpose(1, 2)[..., 4:4 + D] = x["q"]
    x["q"] = wide_q.transpose(1, 2)[..., 4:4 + D]
    x["k"] = x["k"].transpose(0, 1).contiguous().transpose(0, 1)
    wide_v = torch.zeros(B, S, Hkv, 2 * x["v"].shape[-1], device=DEVICE)
    wide_v[..., ::2] = x["v"]
    x["v"] = wide_v[..., ::2]
    wide_idx = torch.zeros(*x["indices"].shape[:2], 2 * x["indices"].shape[-1],
                           dtype=x["indices"].dtype, device=DEVICE)
    wide_idx[..., ::2] = x["indices"]
    x["indices"] = wide_idx[..., ::2]
    assert not any(x[n].is_contiguous() for n in ("q", "k", "v", "indices"))
    out, lse, dout = forward(x)
    *_, target = backward(x, out, lse, dout, True)
    check_target(target, x, lse)


@pytest.mark.parametrize("case", ["absorbed_tail", "two_head_blocks", "three_kv_heads"])
def test_fused_backward_gives_the_same_target(case):
    """bwd_fused (one pass, also deterministic: its two passes must not add the target twice):
    on integer inputs S and P are exact, so the target is bitwise the split backward's."""
    x = build(case, seed=11, integer=True)
    out, lse, dout = forward(x)
    *_, split = backward(x, out, lse, dout, True)
    check_target(split, x, lse)
    for deterministic in (False, True):
        *_, fused = backward(x, out, lse, dout, True, options=FUSED, deterministic=deterministic)
        assert torch.equal(fused, split)


@pytest.mark.parametrize("fused", [False, True], ids=["split-bwd", "fused-bwd"])
@pytest.mark.parametrize("case", ["absorbed_tail", "two_head_blocks", "gqa_shared_indices",
                                  "three_kv_heads"])
def test_deterministic_target_is_bitwise_repeatable(case, fused):
    x = build(case, seed=5)
    out, lse, dout = forward(x)
    options = FUSED if fused else SMALL
    runs = [backward(x, out, lse, dout, True, options=options, deterministic=True)
            for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("fused", [False, True], ids=["split-bwd", "fused-bwd"])
@pytest.mark.parametrize("case", ["absorbed_tail", "two_head_blocks", "gqa_shared_indices"])
def test_gradients_unchanged_by_the_target(case, fused, deterministic):
    """dq (no atomics) is bitwise the same with the target emitted; dk / dv too where their
    accumulation is order-free (deterministic, or one program at a time: the interpreter)."""
    x = build(case, seed=9)
    out, lse, dout = forward(x)
    options = FUSED if fused else SMALL
    plain = backward(x, out, lse, dout, False, options=options, deterministic=deterministic)
    with_target = backward(x, out, lse, dout, True, options=options,
                           deterministic=deterministic)
    assert len(plain) == 4 and len(with_target) == 5
    assert torch.equal(plain[0], with_target[0])
    for a, b in zip(plain[1:], with_target[1:4], strict=True):
        if a is None:
            assert b is None
        elif deterministic or DEVICE == "cpu":
            assert torch.equal(a, b)
        else:
            close("dk / dv", b, a)
    assert with_target[3] is None  # no sink: no dsink


def test_unsupported_inputs_raise():
    x = build("absorbed_tail", seed=2)
    out, lse, dout = forward(x)
    args = (x["q"], x["k"], x["v"], x["indices"], x["scale"], out, lse, dout)
    kw = dict(dv=x["dv"], options=SMALL)
    sink = torch.zeros(x["q"].shape[2], device=DEVICE)
    with pytest.raises(ValueError, match="sink"):
        kern.sparse_attention_bwd_with_target(*args, sink=sink, **kw)
    prefix = torch.zeros(x["q"].shape[:2], dtype=torch.int32, device=DEVICE)
    for fused in (SMALL, FUSED):  # raised before the fused deterministic first pass
        with pytest.raises(ValueError, match="prefix_lengths"):
            kern.sparse_attention_bwd_with_target(*args, prefix_lengths=prefix, deterministic=True,
                                                  dv=x["dv"], options=fused)
    with pytest.raises(ValueError, match="sink"):
        kern.sparse_attention_bwd_dq(*args, sink=sink, emit_target=True, **kw)

    g = build("gqa_shared_indices", seed=2)
    B, T, NK = g["indices"].shape
    per_head = g["indices"].unsqueeze(2).expand(B, T, 2, NK)
    out, lse = kern.sparse_attention_fwd(g["q"], g["k"], g["v"], per_head, g["scale"],
                                         options=SMALL)
    with pytest.raises(ValueError, match="indices"):
        kern.sparse_attention_bwd_with_target(g["q"], g["k"], g["v"], per_head, g["scale"], out,
                                              lse, torch.zeros_like(out), options=SMALL)

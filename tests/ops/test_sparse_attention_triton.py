"""Sparse-attention Triton kernels under the interpreter (CPU), against a dense fp64 oracle.

Tiny fp32 cases (the interpreter's bf16 arithmetic is wrong): MQA with V = K's first dv channels
(absorbed MLA), K = V with a per-head sink, GQA with per-KV-head indices and a separate V, two
head blocks per query, head dims under 16, -1 slots, rows with no valid index, B > 1,
non-contiguous inputs, the lse and its gradient, and the deterministic (fixed-point) dK / dV
mode. Key tiles of 16 make every row span several tiles with a ragged tail.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megatron_hyscale.ops.kernels import common  # noqa: E402
from megatron_hyscale.ops.kernels import sparse_attention as kern  # noqa: E402
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-5  # fp32 kernels vs the fp64 oracle, relative to the reference's largest entry


def dense_oracle(q, k, v, indices, scale, dv=None, sink=None):
    """fp64 out [B, T, Hq, dv] and lse [B, T, Hq] (sink included; -inf for an empty row)."""
    q, k = q.double(), k.double()
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    v = (k[..., : (dv or D)] if v is None else v).double()
    if indices.dim() == 3:
        indices = indices.unsqueeze(2).expand(B, T, Hkv, indices.shape[-1])
    valid = indices >= 0
    safe = indices.clamp(min=0).long()
    bi = torch.arange(B, device=q.device)[:, None, None, None]
    gi = torch.arange(Hkv, device=q.device)[None, None, :, None]
    ks, vs = k[bi, safe, gi], v[bi, safe, gi]  # [B, T, Hkv, K, D]
    s = torch.einsum("btgxd,btgjd->btgxj", q.reshape(B, T, Hkv, G, D), ks) * scale
    s = s.masked_fill(~valid[:, :, :, None, :], float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, 1, Hkv, G, 1).expand(B, T, Hkv, G, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    if sink is not None:
        p = p[..., :-1]
    out = torch.einsum("btgxj,btgjd->btgxd", p, vs)
    return out.reshape(B, T, Hq, -1), lse.reshape(B, T, Hq)


def make_indices(B, T, Hkv, S, NK, gen, per_head, dtype):
    """Distinct indices per row, some -1 slots, row (0, 1) partly empty, row (B-1, T-1) empty."""
    rows = B * T * (Hkv if per_head else 1)
    idx = torch.stack([torch.randperm(S, generator=gen)[:NK] for _ in range(rows)])
    idx = idx.view(B, T, Hkv, NK) if per_head else idx.view(B, T, NK)
    idx[0, 1, ..., NK // 3:] = -1
    idx[..., 2::5] = -1  # scattered holes
    idx[B - 1, T - 1] = -1
    return idx.to(dtype).to(DEVICE)


def close(name, got, ref):
    assert got is not None and not torch.isnan(got).any(), f"{name}: NaN or missing"
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= TOL * (1.0 + ref.abs().max().item()), f"{name}: max error {err}"


# Key tiles of 16 so rows span several tiles, in every kernel (the default variants otherwise).
SMALL = replace(AttentionKernelOptions.DEFAULT, fwd_tilings=((16, 1),), dq_tilings=((16, 1),),
                dkv_tilings=((16, 1),), narrow_dq_tilings=((16, 1),),
                narrow_dkv_tilings=((16, 1),), bwd_fused_tilings=((16, 1),))


CASES = {
    # name: (B, T, S, Hq, Hkv, D, v_dim or None, dv, sink, per-head indices, NK, index dtype)
    "mqa_absorbed_dv": (2, 3, 40, 4, 1, 24, None, 16, False, False, 37, torch.int32),
    "kv_shared_sink": (2, 2, 48, 4, 1, 32, None, None, True, True, 40, torch.int64),
    "absorbed_dv_not_main": (1, 3, 30, 3, 1, 24, None, 20, True, False, 21, torch.int64),
    "gqa_per_head": (2, 2, 36, 6, 2, 16, 16, None, True, True, 33, torch.int64),
    "gqa_wide_v": (1, 3, 24, 4, 2, 16, 24, None, False, False, 18, torch.int32),
    "two_head_blocks": (1, 2, 20, 80, 1, 16, None, None, True, False, 17, torch.int32),
    # head dims under tl.dot's 16 (zero-padded channels): GQA 3 with a V of 8, and K = V
    "tiny_head_dim_gqa3": (2, 3, 30, 6, 2, 8, 8, None, False, False, 13, torch.int32),
    "tiny_head_dim_kv_shared": (1, 3, 20, 4, 1, 12, None, None, True, True, 11, torch.int64),
}


def build(case, seed):
    B, T, S, Hq, Hkv, D, vdim, dv, has_sink, per_head, NK, idt = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(DEVICE)
    k = torch.randn(B, S, Hkv, D, generator=g).to(DEVICE)
    v = torch.randn(B, S, Hkv, vdim, generator=g).to(DEVICE) if vdim else None
    sink = torch.randn(Hq, generator=g).to(DEVICE) if has_sink else None
    idx = make_indices(B, T, Hkv, S, NK, g, per_head, idt)
    return q, k, v, idx, sink, dv, D ** -0.5


def run_both(q, k, v, idx, sink, dv, scale, deterministic, lse_weight=None, seed=0,
             options=SMALL):
    """Kernel (with options) and oracle forward + backward of sum(out * g) (+ sum(lse * w));
    returns both."""
    leaves = [x for x in (q, k, v, sink) if x is not None]
    results = []
    for use_kernel in (True, False):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        it = iter(xs)
        qq, kk = next(it), next(it)
        vv = next(it) if v is not None else None
        ss = next(it) if sink is not None else None
        if use_kernel:
            out, lse = kern.sparse_attention_triton(qq, kk, vv, idx, scale, dv=dv, sink=ss,
                                                    return_lse=True, deterministic=deterministic,
                                                    options=options)
        else:
            out, lse = dense_oracle(qq, kk, vv, idx, scale, dv=dv, sink=ss)
        gen = torch.Generator().manual_seed(seed + 1)
        go = torch.randn(out.shape, generator=gen).to(DEVICE)
        loss = (out * go.to(out.dtype)).sum()
        if lse_weight is not None:
            finite = torch.isfinite(lse)
            loss = loss + (torch.where(finite, lse, 0.0) * lse_weight.to(lse.dtype)).sum()
        loss.backward()
        results.append((out.detach(), lse.detach(), [x.grad for x in xs]))
    return results


@pytest.mark.parametrize("variant", ["dkv-channels-on-m", "dkv-keys-on-m", "fused", "dkv-no-carry",
                                     "dq-main-first", "dkv-lockstep", "dkv-lockstep-keys-on-m",
                                     "dkv-lockstep2-no-carry", "dq-lockstep", "dq-lockstep-fused",
                                     "fwd-lockstep"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients(case, deterministic, variant, monkeypatch):
    # Every backward layout against the oracle: the separate dK/dV kernel in both orientations
    # (dkv_channels_on_m), the single pass that fuses it into the dQ kernel (bwd_fused), the
    # channels-on-M kernel adding each tile's dK / dV in its own iteration (dkv_carry off; the
    # default carries them one iteration), the dQ kernel taking S's main channels first
    # (dq_tail_first off; the default takes the tail first), and the dK/dV kernel in lockstep
    # (dkv_lockstep: persistent programs over several waves under the interpreter's 3 "SMs",
    # the last part-full, with each layout; deterministic runs unpaced), and the dQ kernel in
    # lockstep, alone and as the fused pass (dq_lockstep), and the forward (fwd_lockstep).
    dkv_lockstep = variant.startswith("dkv-lockstep")
    dq_lockstep = variant.startswith("dq-lockstep")
    options = replace(SMALL, dkv_channels_on_m=not variant.endswith("keys-on-m"),
                      bwd_fused=variant in ("fused", "dq-lockstep-fused"),
                      dkv_carry=not variant.endswith("no-carry"),
                      dq_tail_first=variant != "dq-main-first", dkv_lockstep=dkv_lockstep,
                      dq_lockstep=dq_lockstep, fwd_lockstep=variant == "fwd-lockstep",
                      triton_lockstep_slack=2 if variant.startswith("dkv-lockstep2") else 1,
                      triton_lockstep_programs_per_sm=1 if "lockstep" in variant else 2)
    q, k, v, idx, sink, dv, scale = build(case, seed=len(case))
    plans = []
    real_plan = kern.lockstep_plan
    monkeypatch.setattr(kern, "lockstep_plan",
                        lambda *a, **kw: plans.append(a[0]) or real_plan(*a, **kw))
    (out, lse, grads), (rout, rlse, rgrads) = run_both(q, k, v, idx, sink, dv, scale,
                                                       deterministic, options=options)
    # The paced launches happen (they ask for a plan), but not for the deterministic dK/dV
    # passes (dkv_lockstep, the fused pass), which run unpaced.
    unpaced = deterministic and (variant.startswith("dkv") or variant == "dq-lockstep-fused")
    assert bool(plans) == ("lockstep" in variant and not unpaced), (variant, plans)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == rout.shape and lse.shape == rlse.shape
    close("out", out, rout)
    assert torch.equal(torch.isinf(lse), torch.isinf(rlse))
    close("lse", torch.where(torch.isinf(lse), 0.0, lse), torch.where(torch.isinf(rlse), 0, rlse))
    names = ["dq", "dk"] + (["dv"] if v is not None else []) + (["dsink"] if sink is not None
                                                                 else [])
    for name, got, ref in zip(names, grads, rgrads, strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        close(name, got, ref)
    # The row with no valid index: zeros out, lse -inf without a sink and = sink with one.
    B, T = q.shape[:2]
    assert torch.equal(out[B - 1, T - 1], torch.zeros_like(out[B - 1, T - 1]))
    if sink is None:
        assert torch.isinf(lse[B - 1, T - 1]).all()
    else:
        close("empty-row lse", lse[B - 1, T - 1], sink)


@pytest.mark.parametrize("fused", [False, True], ids=["split-bwd", "fused-bwd"])
@pytest.mark.parametrize("case", ["two_head_blocks", "gqa_per_head", "tiny_head_dim_gqa3"])
def test_adjacent_head_blocks_give_the_same_results(case, fused, monkeypatch):
    """head_blocks_adjacent changes only the launch order (a 1-D grid, a query's head blocks
    next to each other): every output and gradient is bitwise the split grid's. Cases with
    several KV heads check that they keep the split grid with the option on. A small dK/dV
    budget gives that kernel more head blocks than the forward's (3 against 2 for
    two_head_blocks)."""
    q, k, v, idx, sink, dv, scale = build(case, seed=7)
    real_grid, grids, runs = kern.launch_grid, [], []
    monkeypatch.setattr(kern, "launch_grid",  # a spy: records every launch's grid
                        lambda *a: grids.append((a, real_grid(*a))) or grids[-1][1])
    for adjacent in (False, True):
        options = replace(SMALL, dkv_resident_budget=4096, bwd_fused=fused,
                          head_blocks_adjacent=adjacent)
        grids.clear()
        (out, lse, grads), _ = run_both(q, k, v, idx, sink, dv, scale, deterministic=True,
                                        options=options)
        runs.append([out, lse, *grads])
        # every launch used the grid this order asks for: 1-D (NG > 0) when adjacent and the
        # query's programs are head blocks of one KV head (they share its indices)
        assert grids and all((len(g) == 1 and ng > 0) == (adjacent and kv == 1 and nhb > 1)
                             for (_, kv, nhb, _), (g, ng) in grids)
        if adjacent and case == "two_head_blocks":
            assert any(len(g) == 1 for _, (g, _) in grids)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_gradient_of_a_summed_lse():
    """lse.sum()'s gradient is an expanded (stride-0) tensor: the kernels must not read it with
    lse's strides."""
    q, k, v, idx, sink, dv, scale = build("gqa_per_head", seed=3)
    grads = []
    for use_kernel in (True, False):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        if use_kernel:
            _, lse = kern.sparse_attention_triton(qq, kk, vv, idx, scale, sink=sink,
                                                  return_lse=True, options=SMALL)
        else:
            _, lse = dense_oracle(qq, kk, vv, idx, scale, sink=sink)
        lse.sum().backward()
        grads.append((qq.grad, kk.grad))
    for got, ref in zip(*grads, strict=True):
        close("d(lse.sum())", got, ref)


def test_lse_gradient():
    q, k, v, idx, sink, dv, scale = build("kv_shared_sink", seed=3)
    w = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(9)).to(DEVICE)
    (_, _, grads), (_, _, rgrads) = run_both(q, k, v, idx, sink, dv, scale, False, lse_weight=w)
    for name, got, ref in zip(["dq", "dk", "dsink"], grads, rgrads, strict=True):
        close(name, got, ref)


def non_contiguous_case():
    """q sliced out of a transposed tensor, k transposed, v and int64 indices strided: B = 2,
    2 KV heads of 2 query heads each, no sink."""
    g = torch.Generator().manual_seed(5)
    B, T, S, Hq, Hkv, D, NK = 2, 3, 48, 4, 2, 16, 20
    q = torch.randn(B, Hq, T, D + 8, generator=g).to(DEVICE).transpose(1, 2)[..., 4:4 + D]
    k = torch.randn(S, B, Hkv, D, generator=g).to(DEVICE).transpose(0, 1)
    v = torch.randn(B, S, Hkv, 2 * D, generator=g).to(DEVICE)[..., ::2]
    idx = make_indices(B, T, Hkv, S, 2 * NK, g, True, torch.int64)[..., ::2]
    return q, k, v, idx, None, None, D ** -0.5


def test_non_contiguous_inputs():
    q, k, v, idx, _, _, scale = non_contiguous_case()
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous()
                or idx.is_contiguous())
    (out, lse, grads), (rout, rlse, rgrads) = run_both(q, k, v, idx, None, None, scale, False)
    close("out", out, rout)
    for name, got, ref in zip(["dq", "dk", "dv"], grads, rgrads, strict=True):
        close(name, got, ref)


def test_deterministic_repeatable_and_close_to_atomic():
    q, k, v, idx, sink, dv, scale = build("gqa_per_head", seed=11)
    runs = [run_both(q, k, v, idx, sink, dv, scale, True)[0][2] for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    atomic = run_both(q, k, v, idx, sink, dv, scale, False)[0][2]
    for a, b in zip(runs[0], atomic, strict=True):
        close("deterministic vs atomic", a, b)


def test_fixed_point_scale_bounds_sum():
    """n addends of size <= rowmax, scaled, fit in 2^FIXED_BITS; zero rows get scale 1."""
    rowmax = torch.tensor([0.0, 1e-30, 3.0, 1e20])
    scale, exp = common.fixed_point_scale(rowmax, 1000)
    assert scale[0] == 1.0 and exp[0] == 0
    assert (rowmax.double() * scale.double() * 1000 <= 2.0 ** common.FIXED_BITS).all()
    # At least 2^(FIXED_BITS - 1) of headroom is used (the scale is the largest safe one),
    # except where it is capped.
    ok = rowmax.double() * scale.double() * 1000 * 2 > 2.0 ** common.FIXED_BITS
    assert ok[2:].all()


def test_matches_project_reference_when_present():
    api = pytest.importorskip("megatron_hyscale.ops.sparse_attention")
    q, k, v, idx, sink, dv, scale = build("kv_shared_sink", seed=2)
    ref_out, ref_lse = api.sparse_attention(q, k, v, idx, scale, dv=dv, sink=sink,
                                            return_lse=True, backend="reference")
    out, lse = kern.sparse_attention_triton(q, k, v, idx, scale, dv=dv, sink=sink,
                                            return_lse=True, options=SMALL)
    close("out", out, ref_out)
    close("lse", lse, ref_lse)
    # The public entry point hands its options to the kernels; anything else is refused.
    out, lse = api.sparse_attention(q, k, v, idx, scale, dv=dv, sink=sink, return_lse=True,
                                    backend="triton", options=SMALL)
    close("out", out, ref_out)
    close("lse", lse, ref_lse)
    with pytest.raises(ValueError, match="options must be AttentionKernelOptions or None"):
        api.sparse_attention(q, k, v, idx, scale, dv=dv, sink=sink, backend="triton",
                             options=SMALL.fwd_tilings)


@pytest.mark.parametrize("case", ["two_head_blocks", "mqa_absorbed_dv"])
def test_dkv_head_block_smaller_than_forward(case):
    """The dK/dV kernel halves its head block when q and dO would overflow shared memory."""
    options = replace(SMALL, dkv_resident_budget=1024)
    q, k, v, idx, sink, dv, scale = build(case, seed=4)
    for deterministic in (False, True):
        (_, _, grads), (_, _, rgrads) = run_both(q, k, v, idx, sink, dv, scale, deterministic,
                                                 options=options)
        for got, ref in zip(grads, rgrads, strict=True):
            close("grad", got, ref)


def test_split_backward_and_discard_mode():
    """sparse_attention_bwd = the dQ launch then the dK/dV launch; the measurement-only discard
    mode runs the dK/dV kernel without accumulating: keys nobody selected stay 0, dk untouched."""
    q, k, v, idx, sink, dv, scale = build("mqa_absorbed_dv", seed=5)
    kw = dict(dv=dv, options=SMALL)
    out, lse = kern.sparse_attention_fwd(q, k, v, idx, scale, sink=sink, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    full = kern.sparse_attention_bwd(q, k, v, idx, scale, out, lse, dout, sink=sink, **kw)
    dq, delta, dsink = kern.sparse_attention_bwd_dq(q, k, v, idx, scale, out, lse, dout,
                                                    sink=sink, **kw)
    dk, dvv = kern.sparse_attention_bwd_dkv(q, k, v, idx, scale, lse, dout, delta, **kw)
    assert torch.equal(dq, full[0]) and dvv is None and full[2] is None
    close("dk", dk, full[1])
    buf, none = kern.sparse_attention_bwd_dkv(q, k, v, idx, scale, lse, dout, delta, **kw,
                                              mode=common.MODE_DISCARD)
    B, S, Hkv = k.shape[:3]
    assert none is None and buf.shape == (B, S, Hkv) and torch.isfinite(buf).all()
    picked = torch.zeros(B, S, dtype=torch.bool, device=DEVICE)
    for b in range(B):
        flat = idx[b].reshape(-1).long()
        picked[b, flat[flat >= 0]] = True
    assert (buf[..., 0][~picked] == 0).all() and (buf[..., 0][picked] != 0).any()


def prefix_case(B, T, S, Hkv, NK, per_head, seed, split=20):
    """Rows with a dense prefix 0 .. n - 1 (n random in [0, split], some 0, one = split) and
    listed indices >= split (distinct, some -1); the oracle's explicit form of the same."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, split + 1, (B, T), generator=g)
    n[0, 0], n[-1, -1] = 0, split
    rows = B * T * (Hkv if per_head else 1)
    idx = torch.stack([split + torch.randperm(S - split, generator=g)[:NK] for _ in range(rows)])
    idx = idx.view(B, T, Hkv, NK) if per_head else idx.view(B, T, NK)
    idx[0, 0] = -1  # prefix 0 and nothing listed: an empty row
    idx[-1, 0, ..., ::2] = -1
    slots = torch.arange(split)
    pre = torch.where(slots < n[..., None], slots, -1)
    if per_head:
        pre = pre[:, :, None].expand(B, T, Hkv, split)
    full = torch.cat([pre, idx], dim=-1)
    return n.to(DEVICE), idx.to(DEVICE), full.to(DEVICE)


@pytest.mark.parametrize("fused", [False, True], ids=["split-bwd", "fused-bwd"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-kv-head"])
def test_dense_prefix_equals_explicit_indices(per_head, deterministic, fused):
    """prefix_lengths (generated slots 0 .. n - 1, HCA's visible entries) + listed indices give
    the values and every gradient of the same keys listed explicitly, with a sink, GQA or MQA,
    rows whose prefix is 0, empty rows, and prefixes crossing the 16-key tiles; both backward
    layouts."""
    options = replace(SMALL, bwd_fused=fused)
    B, T, S, NK = 2, 3, 40, 9
    Hq, Hkv, D = (4, 2, 16) if per_head else (4, 1, 24)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, T, Hq, D, generator=g).to(DEVICE)
    k = torch.randn(B, S, Hkv, D, generator=g).to(DEVICE)
    v = torch.randn(B, S, Hkv, D, generator=g).to(DEVICE) if per_head else None
    sink = torch.randn(Hq, generator=g).to(DEVICE)
    n, idx, full = prefix_case(B, T, S, Hkv, NK, per_head, seed=8)
    dv = None if per_head else 16
    leaves = [x for x in (q, k, v, sink) if x is not None]
    grads = []
    for use_prefix in (True, False):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        qq, kk = xs[0], xs[1]
        vv, ss = (xs[2], xs[3]) if per_head else (None, xs[2])
        if use_prefix:
            out, lse = kern.sparse_attention_triton(qq, kk, vv, idx, D ** -0.5, dv=dv, sink=ss,
                                                    return_lse=True, deterministic=deterministic,
                                                    prefix_lengths=n, options=options)
        else:
            out, lse = dense_oracle(qq, kk, vv, full, D ** -0.5, dv=dv, sink=ss)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        (out * go.to(out.dtype)).sum().backward()
        grads.append((out.detach(), lse.detach(), [x.grad for x in xs]))
    (out, lse, gk), (ref_out, ref_lse, gr) = grads
    close("out", out, ref_out)
    close("lse", lse, ref_lse)
    for name, a, b in zip(("q", "k", "v/sink", "sink"), gk, gr):
        close(f"grad {name}", a, b)


@pytest.mark.parametrize("case", ["mqa_absorbed_dv", "gqa_per_head"])
def test_forward_without_softmax_is_raw_scores_times_v(case):
    """fwd_softmax=False (bench_attention.py --fwd-no-softmax, measurement only) still gathers
    every valid key and runs both products: out = sum over valid slots of (q . k) v, unscaled."""
    q, k, v, idx, sink, dv, scale = build(case, seed=11)
    out, _ = kern.sparse_attention_fwd(q, k, v, idx, scale, dv=dv,
                                       options=replace(SMALL, fwd_softmax=False))
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    vv = (k[..., : (dv or D)] if v is None else v).double()
    full = idx if idx.dim() == 4 else idx.unsqueeze(2).expand(B, T, Hkv, idx.shape[-1])
    safe = full.clamp(min=0).long()
    bi = torch.arange(B)[:, None, None, None]
    gi = torch.arange(Hkv)[None, None, :, None]
    s = torch.einsum("btgxd,btgjd->btgxj", q.double().reshape(B, T, Hkv, Hq // Hkv, D),
                     k.double()[bi, safe, gi])
    s = s.masked_fill(~(full >= 0)[:, :, :, None, :], 0.0)
    ref = torch.einsum("btgxj,btgjd->btgxd", s, vv[bi, safe, gi]).reshape(B, T, Hq, -1)
    close("raw-score forward", out, ref)


def ties_case(seed):
    """MQA with V = K's first 16 channels whose keys come in identical pairs (every row's
    scores tie pairwise), rows listing both keys of a pair and rows with fewer visible keys
    than slots (-1), B = 2, non-contiguous q and k."""
    g = torch.Generator().manual_seed(seed)
    B, T, S, Hq, D, NK = 2, 3, 24, 4, 24, 21
    q = torch.randn(B, Hq, T, D, generator=g).to(DEVICE).transpose(1, 2)
    half = torch.randn(B, S // 2, 1, D, generator=g)
    k = torch.cat([half, half], dim=1).transpose(0, 1).contiguous().transpose(0, 1).to(DEVICE)
    idx = make_indices(B, T, 1, S, NK, g, False, torch.int32)
    idx[0, 0, :S // 2] = torch.arange(S // 2, device=DEVICE)  # both keys of each pair
    idx[0, 0, S // 2:] = torch.arange(S // 2, S - 3, device=DEVICE)
    assert not (q.is_contiguous() or k.is_contiguous())
    return q, k, None, idx, None, 16, D ** -0.5


# Backward variants that change only the order of independent operations: the option fields
# that turn the default's order (dkv_carry and dq_tail_first on) back into the previous one.
BITWISE_VARIANTS = {"dkv-no-carry": dict(dkv_carry=False),
                    "dq-main-first": dict(dq_tail_first=False)}


@pytest.mark.parametrize("variant", list(BITWISE_VARIANTS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", [*CASES, "ties", "non_contiguous", "prefix"])
def test_bwd_variant_equals_the_default(case, deterministic, variant):
    """dkv_carry adds each key tile's dK / dV one loop iteration later with the same products in
    the same order; dq_tail_first adds S's main channels onto its tail's instead of the
    reverse (fp32 addition commutes). So under the interpreter (one program at a time) every
    output and gradient with either off is bitwise the default's (both on); on a GPU the
    atomics' order and the compiled products' rounding differ, so there it is close. Also
    against the oracle (so that a wrong default cannot hide a wrong variant): ties, -1 slots
    and empty rows, B = 2, non-contiguous inputs, dense prefixes (rows whose last tile holds
    only prefix keys or only -1 slots)."""
    prefix = None
    if case == "ties":
        q, k, v, idx, sink, dv, scale = ties_case(seed=13)
    elif case == "non_contiguous":
        q, k, v, idx, sink, dv, scale = non_contiguous_case()
    elif case == "prefix":
        g = torch.Generator().manual_seed(7)
        B, T, S, Hq, D = 2, 3, 40, 4, 24
        q = torch.randn(B, T, Hq, D, generator=g).to(DEVICE)
        k = torch.randn(B, S, 1, D, generator=g).to(DEVICE)
        sink = torch.randn(Hq, generator=g).to(DEVICE)
        prefix, idx, full = prefix_case(B, T, S, 1, 9, False, seed=8)
        v, dv, scale = None, 16, D ** -0.5
    else:
        q, k, v, idx, sink, dv, scale = build(case, seed=3 * len(case))
    runs = []
    for on in (False, True):
        options = replace(SMALL, **BITWISE_VARIANTS[variant]) if on else SMALL
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sink) if x is not None]
        it = iter(leaves)
        qq, kk = next(it), next(it)
        vv = next(it) if v is not None else None
        ss = next(it) if sink is not None else None
        out, lse = kern.sparse_attention_triton(qq, kk, vv, idx, scale, dv=dv, sink=ss,
                                                return_lse=True, deterministic=deterministic,
                                                prefix_lengths=prefix, options=options)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        (out * go).sum().backward()
        runs.append([out.detach(), *(x.grad for x in leaves)])
    for a, b in zip(*runs, strict=True):
        if DEVICE == "cpu":
            assert torch.equal(a, b)
        else:
            close(variant, b, a)
    if case != "prefix":  # the prefix rows' oracle is test_dense_prefix_equals_explicit_indices
        (out, _, grads), (rout, _, rgrads) = run_both(
            q, k, v, idx, sink, dv, scale, deterministic, seed=0,
            options=replace(SMALL, **BITWISE_VARIANTS[variant]))
        close("out", out, rout)
        for got, ref in zip(grads, rgrads, strict=True):
            close("grad", got, ref)

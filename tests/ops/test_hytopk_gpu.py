"""HyTopK Triton kernel on a GPU at realistic sizes, against the plain-torch reference.

Integer-valued inputs: every product and partial sum is an integer below 2^24, so any fp32
summation order gives the same scores and the output must equal the reference bit for bit.

Random bf16 inputs: the kernel and the reference sum the same fp32 products in different orders
(tensor-core tiles versus einsum). For one (t, s), the standard bound on a length-n fp32 sum
gives |fl(score) - score| <= n * eps * sum_h |w_h| * sum_d |q_hd k_d| with n = D + H + 1 and
eps = 2^-24 (unit roundoff) for either side, so the two computed scores differ by at most
2 * (D + H + 1) * eps * A(t, s) with A(t, s) = sum_h |w_h| * sum_d |q_hd| |k_sd|. By
Cauchy-Schwarz A(t, s) <= A_t = sum_h |w_h| * ||q_h|| * max_s ||k_s||. The rule tested: each
returned score is within E_t = 2 * (D + H + 1) * eps * A_t of the exact (fp64) score of that
key, rows are sorted by (score desc, index asc), and the selected set equals the reference's
except for keys whose exact score is within 2 * E_t of the reference's k-th score.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_hyscale.ops import hytopk
from megatron_hyscale.testing.compare import assert_rows_hold_sorted_sets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

EPS32 = 2.0**-24


def int_inputs(B, T, S, H, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(-3, 4, (B, T, H, D), device="cuda", generator=g).to(dtype)
    k = torch.randint(-3, 4, (B, S, D), device="cuda", generator=g).to(dtype)
    w = torch.randint(-2, 3, (B, T, H), device="cuda", generator=g).to(torch.float32)
    return q, k, w


def assert_exact(q, k, w, topk, **kw):
    ref_i, ref_s = hytopk(q, k, w, topk, backend="reference", **kw)
    out_i, out_s = hytopk(q, k, w, topk, backend="triton", **kw)
    torch.cuda.synchronize()
    assert out_i.dtype == torch.int32 and out_s.dtype == torch.float32
    mism = (out_i != ref_i).any(-1).sum().item()
    assert mism == 0, f"{mism} rows differ in indices"
    assert torch.equal(out_s, ref_s)


@pytest.mark.parametrize(
    "T,H,D,topk,relu",
    [
        (16384, 64, 128, 2048, True),
        (8192, 64, 128, 4096, True),
        (8192, 32, 128, 1000, True),
        (8192, 32, 64, 1024, False),
        (8192, 4, 128, 512, True),
        (4096, 64, 64, 2048, False),
    ],
)
def test_integer_inputs_exact(T, H, D, topk, relu):
    q, k, w = int_inputs(1, T, T, H, D, torch.bfloat16, seed=T + H + topk)
    assert_exact(q, k, w, topk, relu=relu)


def test_integer_inputs_batch_shard_positions_fp16():
    # B = 2, a context-parallel style shard: queries are two non-contiguous chunks of the
    # sequence, keys are the whole sequence, per-batch positions.
    B, S, H, D, topk, c = 2, 8192, 64, 128, 2048, 1024
    q, k, w = int_inputs(B, 2 * c, S, H, D, torch.float16, seed=7)
    qpos = torch.cat([torch.arange(c, 2 * c), torch.arange(S - 2 * c, S - c)]).cuda()
    qpos = torch.stack([qpos, qpos + 5])
    assert_exact(q, k, w, topk, relu=True, q_positions=qpos)


def test_integer_inputs_noncausal_noncontiguous():
    q, k, w = int_inputs(1, 4096, 8192, 32, 128, torch.bfloat16, seed=11)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous [B, T, H, D]
    assert not q.is_contiguous()
    assert_exact(q, k, w, 2048, relu=True, causal=False)


@pytest.mark.parametrize("H", [64, 32])
def test_integer_inputs_exact_heads_on_m(H):
    # The non-default GEMM orientation (heads on the MMA's M; bench_selection compares both).
    from megatron_hyscale.ops.kernels.hytopk import hytopk_triton
    from megatron_hyscale.ops.kernels.options import HyTopKOptions

    T, topk = 8192, 2048
    q, k, w = int_inputs(1, T, T, H, 128, torch.bfloat16, seed=H + 1)
    pos = torch.arange(T, device="cuda")[None]
    ref_i, ref_s = hytopk(q, k, w, topk, backend="reference")
    for keys_on_m in (False, True):
        options = replace(HyTopKOptions.DEFAULT, keys_on_m=keys_on_m)
        out_i, out_s = hytopk_triton(q, k, w, topk, relu=True, q_positions=pos, k_positions=pos,
                                     causal=True, options=options)
        assert torch.equal(out_i, ref_i) and torch.equal(out_s, ref_s), keys_on_m


def exact_scores(q, k, w, idx, relu, rows=64):
    """fp64 scores of the keys idx [B, T, K] (-1 gives -inf), in row chunks."""
    B, T, H, D = q.shape
    out = torch.empty(idx.shape, dtype=torch.float64, device=q.device)
    for t0 in range(0, T, rows):
        ii = idx[:, t0:t0 + rows].long()
        kk = torch.gather(k.double(), 1, ii.clamp(min=0).flatten(1)[..., None].expand(-1, -1, D))
        kk = kk.view(B, ii.shape[1], ii.shape[2], D)
        logits = torch.einsum("bthd,btkd->btkh", q[:, t0:t0 + rows].double(), kk)
        if relu:
            logits = logits.relu()
        s = (logits * w[:, t0:t0 + rows, None, :].double()).sum(-1)
        out[:, t0:t0 + rows] = s.masked_fill(ii < 0, float("-inf"))
    return out


@pytest.mark.parametrize(
    "T,H,D,topk,relu",
    [(16384, 64, 128, 2048, True), (8192, 32, 128, 1000, True), (8192, 4, 64, 512, True),
     (8192, 32, 128, 2048, False)],
)
def test_random_bf16_rule(T, H, D, topk, relu):
    g = torch.Generator(device="cuda").manual_seed(T + H + D + topk)
    q = torch.randn(1, T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, T, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(1, T, H, device="cuda", generator=g) * (H * D) ** -0.5
    ref_i, ref_s = hytopk(q, k, w, topk, relu=relu, backend="reference")
    out_i, out_s = hytopk(q, k, w, topk, relu=relu, backend="triton")

    k_norm_max = k.double().norm(dim=-1).amax(-1)  # [B]
    a_t = (w.double().abs() * q.double().norm(dim=-1)).sum(-1) * k_norm_max[:, None]  # [B, T]
    e_t = 2 * (D + H + 1) * EPS32 * a_t

    # Structure: -1 exactly where the reference has -1, no duplicates, sorted by the total order.
    assert torch.equal(out_i < 0, ref_i < 0)
    valid = out_i >= 0
    srt = out_i.sort(-1).values
    assert not ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()
    s0, s1, i0, i1 = out_s[..., :-1], out_s[..., 1:], out_i[..., :-1], out_i[..., 1:]
    ordered = (s0 > s1) | ((s0 == s1) & (i0 < i1)) | (i1 < 0)
    assert ordered.all()

    # Returned scores are within E_t of the exact score of their key.
    exact_out = exact_scores(q, k, w, out_i, relu)
    err = (out_s.double() - exact_out).abs().masked_fill(~valid, 0)
    assert (err <= e_t[..., None]).all(), f"max score error {err.max().item()}"

    # Selected set equals the reference's except near the k-th score.
    B, T = out_i.shape[:2]
    S = k.shape[1]
    row = torch.arange(B * T, device="cuda").view(B, T, 1) * S
    ours = (row + out_i)[valid]
    refs = (row + ref_i)[ref_i >= 0]
    only_ours = ~torch.isin(ours, refs)
    only_ref = ~torch.isin(refs, ours)
    kth = ref_s.gather(-1, (ref_i >= 0).sum(-1, keepdim=True).clamp(min=1) - 1).double()
    band = 2 * e_t.view(-1)
    rows_of = torch.arange(B * T, device="cuda").view(B, T, 1)
    for idx, sel, ok in ((out_i, only_ours, valid), (ref_i, only_ref, ref_i >= 0)):
        rows = rows_of.expand_as(idx)[ok][sel]
        keys = idx[ok][sel].long()
        if rows.numel() == 0:
            continue
        logits = torch.einsum("nhd,nd->nh", q.reshape(B * T, H, D)[rows].double(),
                              k.reshape(B * S, D)[keys].double())
        if relu:
            logits = logits.relu()
        exact = (logits * w.reshape(B * T, H)[rows].double()).sum(-1)
        dist = (exact - kth.view(-1)[rows]).abs()
        assert (dist <= band[rows]).all(), (
            f"{rows.numel()} keys differ from the reference; max distance to the k-th score "
            f"{dist.max().item()} exceeds the band {band[rows].max().item()}")
    # Mismatches must be rare: they need a score tie within rounding at the k-th place.
    assert only_ours.sum().item() <= 0.001 * ours.numel() + 16


def structured_int_inputs(T, H, D, dtype, seed, ramp_every=64, n_hitters=16):
    """Integer-valued inputs shaped like a trained indexer's (as in test_hytopk_triton.py):
    dim 0 of k a ramp in the key position (every query weights it positively: recent keys
    score highest), a few heavy hitters (dim 1), sparse {-1, 0, 1} noise elsewhere; head 0
    weighs 3 and the last head -1. All values are exact in bf16 (ramp and hitters <= 256 at
    T = 16384) and every partial score an integer below 2^24."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def noise(*shape):
        vals = torch.randint(-1, 2, shape, device="cuda", generator=g)
        return (vals * (torch.rand(shape, device="cuda", generator=g) < 0.25)).float()

    k = noise(1, T, D)
    k[..., 0] = (torch.arange(T, device="cuda") // ramp_every).float()
    k[..., 1] = 0.0
    hitters = torch.randperm(T, device="cuda", generator=g)[:n_hitters]
    k[0, hitters, 1] = float(T // ramp_every)
    q = noise(1, T, H, D)
    q[..., 0] = torch.randint(1, 3, (1, T, H), device="cuda", generator=g).float()
    q[..., 1] = 1.0
    w = torch.randint(0, 4, (1, T, H), device="cuda", generator=g).float()
    w[..., 0], w[..., -1] = 3.0, -1.0
    return q.to(dtype), k.to(dtype), w


@pytest.mark.parametrize("relu", [True, False])
def test_structured_pruning_exact(relu):
    from megatron_hyscale.ops.kernels import hytopk as kernel
    from megatron_hyscale.ops.kernels.options import HyTopKOptions

    T, H, D, topk = 16384, 64, 128, 2048
    q, k, w = structured_int_inputs(T, H, D, torch.bfloat16, seed=3)
    assert float(k.float().abs().max()) <= 256  # exact in bf16
    ref_i, ref_s = hytopk(q, k, w, topk, relu=relu, backend="reference")
    qpos = torch.arange(T, device="cuda")[None]
    outs = {}
    for prune in (False, True):
        stats = torch.zeros(2, dtype=torch.int64, device="cuda")
        outs[prune] = kernel.hytopk_triton(q, k, w, topk, relu=relu, q_positions=qpos,
                                           k_positions=qpos, causal=True,
                                           options=replace(HyTopKOptions.DEFAULT, prune=prune),
                                           prune_stats=stats)
        torch.cuda.synchronize()
        assert torch.equal(outs[prune][0], ref_i), f"prune={prune}: indices differ"
        assert torch.equal(outs[prune][1], ref_s), f"prune={prune}: scores differ"
    pruned, considered = stats.tolist()
    print(f"relu={relu}: pruned {pruned} of {considered} key tiles "
          f"({pruned / considered:.1%})")
    assert 0 < pruned < considered


@pytest.mark.parametrize("relu", [True, False])
def test_recency_bf16_pruning_identical_to_unpruned(relu):
    # Continuous bf16 inputs with a linear recency bias (scripts/bench_selection.py "recency"):
    # pruning must fire, and since a pruned tile only holds keys the kernel would have rejected
    # anyway, the outputs equal the unpruned kernel's bit for bit (not just within rounding).
    from megatron_hyscale.ops.kernels import hytopk as kernel
    from megatron_hyscale.ops.kernels.options import HyTopKOptions

    T, H, D, topk = 16384, 64, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(5)
    k = 0.1 * torch.randn(1, T, D, device="cuda", generator=g)
    k[0, :, 0] = torch.arange(T, device="cuda") / 256.0
    k[0, torch.randperm(T, device="cuda", generator=g)[:64], 1] += 6.0
    q = 0.1 * torch.randn(1, T, H, D, device="cuda", generator=g)
    q[..., 0] = 0.5 + torch.rand(1, T, H, device="cuda", generator=g)
    q[..., 1] += 1.0
    w = torch.rand(1, T, H, device="cuda", generator=g) * (H * D) ** -0.5
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    qpos = torch.arange(T, device="cuda")[None]
    stats = torch.zeros(2, dtype=torch.int64, device="cuda")
    kw = dict(relu=relu, q_positions=qpos, k_positions=qpos, causal=True)
    on = kernel.hytopk_triton(q, k, w, topk, options=replace(HyTopKOptions.DEFAULT, prune=True),
                              prune_stats=stats, **kw)
    off = kernel.hytopk_triton(q, k, w, topk, **kw)  # DEFAULT: prune=False
    torch.cuda.synchronize()
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    pruned, considered = stats.tolist()
    print(f"relu={relu}: pruned {pruned} of {considered} key tiles ({pruned / considered:.1%})")
    assert pruned > 0


@pytest.mark.parametrize("H,topk,ratio", [(4, 512, 4), (64, 512, 1)])
def test_unordered_rows_are_the_ordered_sets(H, topk, ratio):
    """order="any" (QSA's layer outside deterministic_mode) on the compiled kernel: each row
    holds the sorted output's set, -1 slots last; QSA's and CSA's shapes, integer inputs."""
    T = 8192
    q, k, w = int_inputs(1, T, T // ratio, H, 128, torch.bfloat16, seed=7)
    kpos = torch.arange(T // ratio, device="cuda") * ratio + ratio - 1
    kw = dict(q_positions=torch.arange(T, device="cuda"), k_positions=kpos)
    ord_i, ord_s = hytopk(q, k, w, topk, backend="triton", **kw)
    un_i, un_s = hytopk(q, k, w, topk, backend="triton", order="any", **kw)
    assert (ord_i == -1).any()
    assert_rows_hold_sorted_sets(un_i, un_s, ord_i, ord_s)


# ---------------------------------------------------------------------------------------------
# Select variants (issue #21): bit for bit the default kernel's outputs, on random bf16 inputs
# too (where any change in the fp32 summation order would show)
# ---------------------------------------------------------------------------------------------

SELECT_VARIANTS = {
    "sort": dict(sort_in_kernel=True),
    "head_major": dict(head_major=True),
    "lean": dict(lean_filter=True),
    "bounded": dict(bounded_select=True),
    "sample": dict(sample_keys=1024),
    # inline PTX appends: applies with the pair-major columns only (hytopk._launch)
    "append_ptx": dict(append_ptx=True, head_major=True),
    "key_tma": dict(key_tma=True),  # key tiles through TMA (not a select variant: same keys)
}
SELECT_VARIANTS["all"] = {f: v for fields in SELECT_VARIANTS.values() for f, v in fields.items()}
# (T, H, D, topk, relu): the folded relu=False query (its 3 bf16 parts: pair-major columns
# with 4 padded heads), V3.2's indexer, QSA's 4 heads (pair-major columns; their head sums
# must repeat the row-major order term for term) and 6 heads padded to 8 (row-major whatever
# head_major says: `hytopk.HEAD_MAJOR_MAX_HEADS`).
SELECT_SHAPES = {"norelu": (8192, 32, 128, 2048, False), "dsv32": (8192, 64, 128, 2048, True),
                 "heads4": (8192, 4, 128, 512, True), "heads6": (8192, 6, 128, 512, True)}
# Every variant on the folded query (issue #21's target); the pair-major columns with real
# head weights; all variants on V3.2's 64 heads. About 15 kernels to compile.
SELECT_CASES = ([("norelu", v) for v in SELECT_VARIANTS]
                + [("heads4", "head_major"), ("heads6", "head_major"), ("dsv32", "all"),
                   ("heads4", "append_ptx"), ("heads4", "all"), ("dsv32", "key_tma"),
                   ("heads4", "key_tma")])


def run_options(q, k, w, topk, relu, fields=None, ordered=True, sample_stats=None):
    """HyTopK with the select variants in `fields` on and the others off."""
    from megatron_hyscale.ops.kernels.hytopk import hytopk_triton
    from megatron_hyscale.ops.kernels.options import SELECT_VARIANTS_OFF, HyTopKOptions

    pos = torch.arange(q.shape[1], device="cuda")[None]
    options = replace(HyTopKOptions.DEFAULT, **dict(SELECT_VARIANTS_OFF, **(fields or {})))
    out = hytopk_triton(q, k, w, topk, relu=relu, q_positions=pos, k_positions=pos,
                        causal=True, options=options,
                        ordered=ordered, sample_stats=sample_stats)
    torch.cuda.synchronize()
    return out


def random_bf16(T, H, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, T, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(1, T, H, device="cuda", generator=g) * (H * D) ** -0.5
    return q, k, w


@pytest.mark.parametrize("shape,variant", SELECT_CASES)
def test_select_variants_identical_to_default(shape, variant):
    """Integer inputs: the variant equals the reference. Random bf16 inputs: it equals the
    kernel with every select variant off bit for bit (indices and scores), sorted and, for the
    in-kernel sort alone, as unordered sets."""
    T, H, D, topk, relu = SELECT_SHAPES[shape]
    fields = SELECT_VARIANTS[variant]
    q, k, w = int_inputs(1, T, T, H, D, torch.bfloat16, seed=T + H)
    ref_i, ref_s = hytopk(q, k, w, topk, relu=relu, backend="reference")
    out_i, out_s = run_options(q, k, w, topk, relu, fields)
    assert torch.equal(out_i, ref_i) and torch.equal(out_s, ref_s), "integer inputs"
    q, k, w = random_bf16(T, H, D, seed=T + H + 1)
    base_i, base_s = run_options(q, k, w, topk, relu)
    out_i, out_s = run_options(q, k, w, topk, relu, fields)
    mism = (out_i != base_i).any(-1).sum().item()
    assert mism == 0 and torch.equal(out_s, base_s), f"{mism} rows differ from the default"
    if variant == "sort":
        un_i, un_s = run_options(q, k, w, topk, relu, fields, ordered=False)
        assert_rows_hold_sorted_sets(un_i, un_s, base_i, base_s)


@pytest.mark.parametrize("kind", ["random", "recency"])
def test_sampled_thresholds_at_scale(kind):
    """sample_keys at 32K tokens (rows past 16K keys sample 1024 of them), all variants, the
    folded query (the kernels the cases above compiled): the outputs are those of the kernel with
    every select variant off, bit for bit. Random inputs: the rows past 16K get a guess and almost
    no block is redone (a guess fails with probability about 1e-4 a row: some 16K rows guessed,
    about one block redone). Recency-biased inputs (recent keys score highest, as a trained
    indexer's): guesses may fail more often, and are redone."""
    T, H, D, topk = 32768, 32, 128, 2048
    q, k, w = random_bf16(T, H, D, seed=17)
    if kind == "recency":
        pos = torch.arange(T, device="cuda")
        k = (k.float() * 0.1).index_put_((torch.zeros_like(pos), pos, torch.zeros_like(pos)),
                                         pos / 256.0).to(torch.bfloat16)
        q = q.clone()
        q[..., 0] = 1.0
        w = w.abs()
    stats = torch.zeros(2, dtype=torch.int32, device="cuda")
    base = run_options(q, k, w, topk, False)
    out = run_options(q, k, w, topk, False, dict(SELECT_VARIANTS["all"]), sample_stats=stats)
    assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])
    guessed, redone = stats.tolist()
    print(f"{kind}: {guessed} of {T} rows guessed, {redone} blocks redone")
    if kind == "random":  # at most 1% of the 2048 row blocks
        assert guessed >= T // 3 and redone <= 20

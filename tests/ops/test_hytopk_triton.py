"""HyTopK Triton kernel under the Triton interpreter (CPU), against the plain-torch reference.

Inputs are small integers in fp32, so every score is an exact integer and the kernel must match
the reference bit for bit: indices, scores, -1 / -inf padding, tie order (smaller index first).
The interpreter's bf16 arithmetic is wrong, so only fp32 runs here; cases are tiny because the
interpreter is slow. Small key tiles (block_n=16) make the candidate buffer compact many times.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megatron_hyscale.ops import hytopk  # noqa: E402
from megatron_hyscale.ops.hytopk import validate_hytopk_inputs  # noqa: E402
from megatron_hyscale.ops.kernels import hytopk as kernel  # noqa: E402
from megatron_hyscale.ops.kernels.options import (  # noqa: E402
    SELECT_VARIANTS_OFF,
    HyTopKOptions,
)
from megatron_hyscale.ops.key_order import sort_rows_by_key  # noqa: E402
from megatron_hyscale.ops.reference import order_key  # noqa: E402
from megatron_hyscale.testing.compare import assert_rows_hold_sorted_sets  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def int_inputs(B, T, S, H, D, seed, lo=-2, hi=3, wlo=-2, whi=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(lo, hi, (B, T, H, D), generator=g).float()
    k = torch.randint(lo, hi, (B, S, D), generator=g).float()
    w = torch.randint(wlo, whi, (B, T, H), generator=g).float()
    return q.to(DEVICE), k.to(DEVICE), w.to(DEVICE)


def kernel_options(block_n=16, min_cap=None, **fields):
    """HyTopKOptions with key tiles of block_n (None: the default) and buffers of topk + one
    tile unless min_cap is given (the default min_cap would never fill); fields left None keep
    their default."""
    fields = {n: v for n, v in fields.items() if v is not None}
    if block_n is not None:
        fields["block_n"] = block_n
    return replace(HyTopKOptions.DEFAULT, min_cap=0 if min_cap is None else min_cap, **fields)


def check(q, k, w, topk, block_n=16, rows=None, num_programs=None, group_slack_div=None,
          prunes=(False, True), keys_on_m=None, atomic_slots=None, min_cap=None, variant=None,
          **kw):
    """Kernel (with the given tiling, and the HyTopKOptions fields in `variant`), with key-tile
    pruning off and on, against the reference; exact equality. Returns the last run's outputs
    and its (tiles pruned, tiles considered)."""
    ref_i, ref_s = hytopk(q, k, w, topk, backend="reference", **kw)
    qpos, kpos = validate_hytopk_inputs(q, k, w, topk, kw.get("q_positions"),
                                        kw.get("k_positions"))
    for prune in prunes:
        stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
        options = kernel_options(block_n, min_cap, rows=rows, num_programs=num_programs,
                                 group_slack_div=group_slack_div, prune=prune,
                                 keys_on_m=keys_on_m, atomic_slots=atomic_slots,
                                 **(variant or {}))
        out_i, out_s = kernel._launch(
            q, k, w, topk, relu=kw.get("relu", True), causal=kw.get("causal", True),
            q_positions=qpos, k_positions=kpos, options=options, prune_stats=stats)
        assert out_i.dtype == torch.int32 and out_s.dtype == torch.float32
        assert out_i.shape == ref_i.shape and out_s.shape == ref_s.shape
        assert torch.equal(out_i, ref_i), (prune, out_i, ref_i)
        assert torch.equal(out_s, ref_s), (prune, out_s, ref_s)
        # -0.0 and +0.0 tie, and the output holds +0.0 like the reference.
        assert not torch.signbit(out_s[out_s == 0]).any()
        if not prune:
            assert stats.tolist() == [0, 0]
    return out_i, out_s, stats.tolist()


def test_public_api_triton_backend():
    q, k, w = int_inputs(1, 12, 12, 4, 16, seed=0)
    ref = hytopk(q, k, w, 5, backend="reference")
    out = hytopk(q, k, w, 5, backend="triton")
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    # A variant reaches the kernel through the public API (and any variant gives the outputs).
    out = hytopk(q, k, w, 5, backend="triton", options=kernel_options(prune=True))
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    with pytest.raises(ValueError, match="options must be HyTopKOptions or None"):
        hytopk(q, k, w, 5, backend="triton", options={"prune": True})


def test_ties_and_compaction_batch2():
    # Values in {-1, 0, 1}: scores collide constantly; 48 keys with 16-key tiles and topk 6
    # force several compactions; B = 2 with different data per batch.
    q, k, w = int_inputs(2, 20, 48, 4, 16, seed=1, lo=-1, hi=2)
    check(q, k, w, 6)


def test_all_zero_relu_rows_and_negative_zero():
    # Queries whose logits are all <= 0 give all-zero ReLU rows (scores 0 or -0.0 with negative
    # weights): the order is then by key index alone.
    q, k, w = int_inputs(1, 16, 40, 2, 16, seed=2)
    k = k.abs()
    q[0, :8] = -q[0, :8].abs()
    w[0, :8] = -1.0
    out_i, out_s, _ = check(q, k, w, 7)
    assert torch.equal(out_i[0, 0, :1], torch.tensor([0], dtype=torch.int32, device=DEVICE))


def test_fewer_visible_than_k_and_topk_above_s():
    q, k, w = int_inputs(1, 10, 10, 4, 16, seed=3)
    out_i, _, _ = check(q, k, w, 16)  # topk > S: -1 / -inf beyond the visible keys
    assert (out_i[0, 0, 1:] == -1).all()


def test_documents_shorter_than_topk_share_one_compiled_kernel(monkeypatch):
    """Packed documents shorter than topk (each a selection of its own length S < topk) launch
    the kernel with the same compiled-in values, so a batch of many document lengths costs one
    compile, not one per length; each length is still exact against the reference."""
    launches = []
    real = kernel._hytopk_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({n: v for n, v in kwargs.items() if n.isupper()})
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernel, "_hytopk_kernel", Recorder())
    topk = 24
    for S, seed in ((7, 1), (13, 2), (24, 3), (40, 4)):
        q, k, w = int_inputs(1, S, S, 4, 16, seed=seed)
        out_i, _, _ = check(q, k, w, topk, prunes=(False,), min_cap=64)
        assert (out_i[0, -1, min(S, topk):] == -1).all()
    assert len(launches) == 4
    assert all(c == launches[0] for c in launches), [
        {n: v for n, v in c.items() if v != launches[0][n]} for c in launches]


@pytest.mark.parametrize("keys_on_m,atomic_slots,min_cap",
                         [(False, False, None), (True, False, None), (False, True, None),
                          (True, True, None), (True, True, 64)])
def test_kernel_variants(keys_on_m, atomic_slots, min_cap):
    # Both GEMM orientations (heads on the MMA's M, the head sum across warps, or on its N,
    # within a thread's quad), both candidate appends (a prefix sum per tile, or a slot per
    # survivor from an atomic counter) and a larger candidate buffer (fewer compactions): the
    # same ties-heavy, compacting, -0.0, batch-2, shard-position and tile-group cases, exact.
    v = dict(keys_on_m=keys_on_m, atomic_slots=atomic_slots, min_cap=min_cap)
    q, k, w = int_inputs(2, 20, 48, 4, 16, seed=1, lo=-1, hi=2)
    check(q, k, w, 6, **v)
    q, k, w = int_inputs(1, 16, 40, 2, 16, seed=2)
    k, w = k.abs(), w.clone()
    q[0, :8] = -q[0, :8].abs()
    w[0, :8] = -1.0
    check(q, k, w, 7, prunes=(False,), **v)
    q, k, w = int_inputs(1, 21, 33, 5, 8, seed=13)  # 5 heads padded to 8
    pos = torch.cat([torch.arange(4, 12), torch.arange(36, 49)]).view(1, -1).to(DEVICE)
    check(q, k, w, 10, q_positions=pos, prunes=(False,), **v)
    q, k, w = int_inputs(1, 6, 300, 2, 16, seed=12, lo=-1, hi=2)  # groups of 3 tiles
    check(q, k, w, 70, group_slack_div=1, prunes=(False,), **v)


def test_relu_false_and_noncausal():
    q, k, w = int_inputs(1, 18, 44, 4, 16, seed=4)
    check(q, k, w, 9, relu=False)
    check(q, k, w, 9, relu=True, causal=False)


def test_relu_false_noncausal_negative_weights():
    q, k, w = int_inputs(1, 9, 30, 3, 8, seed=5, wlo=-3, whi=0)
    check(q, k, w, 11, relu=False, causal=False)


def test_bf16_parts_sum_to_the_fp32_value_exactly():
    """The folded query's three bf16 parts add up to it exactly over 2^-110 .. 2^127 (values
    with all 24 significand bits set, both signs, 0 and -0.0), and miss it by less than bf16's
    subnormal step 2^-133 below that."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4096, generator=g).sign() * torch.logspace(-110, 126.9, 4096, base=2.0)
    x = x * (1 + torch.rand(4096, generator=g))
    full = torch.tensor([1 + 2.0**-23 - 2.0**-22, 2 - 2.0**-23, 2.0**126 * (2 - 2.0**-23),
                         2.0**-110 * (2 - 2.0**-23), 0.0, -0.0])
    x = torch.cat([x.float(), full, -full]).view(-1, 4)
    parts = kernel.bf16_parts(x)
    assert parts.dtype == torch.bfloat16 and parts.shape == (x.shape[0], 3, 4)
    hi, mid, lo = parts.double().unbind(-2)
    assert torch.equal(hi + mid + lo, x.double())
    assert (lo != 0).any()  # the third part is needed
    tiny = torch.tensor([1e-41, -3e-40, 2.0**-120 * 1.999, 1e-45]).view(1, 4)
    err = kernel.bf16_parts(tiny).double().sum(-2) - tiny.double()
    assert (err.abs() < 2.0**-133).all()


@pytest.mark.parametrize("causal", [True, False])
def test_relu_false_bf16_keys_take_the_folded_parts_exactly(monkeypatch, causal):
    """relu=False with bf16 keys: the folded query goes in as three bf16 parts on the
    keys-on-M path (4 padded heads); integer inputs keep every product and sum exact, so the
    selection equals the reference's bit for bit: ties, negative weights, -0.0, batch 2,
    fewer visible keys than topk, non-contiguous inputs, a tiny topk that compacts."""
    launches = []
    real = kernel._hytopk_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((args[0].dtype, kwargs["HP"], kwargs["KEYS_ON_M"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernel, "_hytopk_kernel", Recorder())
    q, k, w = int_inputs(2, 20, 40, 4, 16, seed=8, lo=-1, hi=2, wlo=-3, whi=3)
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    q[1, 3] = -0.0
    check(q, k, w, 6, relu=False, causal=causal)
    check(q, k, w, 50, relu=False, causal=causal, prunes=(False,))  # topk > visible keys
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous views
    check(qt[:, 2:17], k[:, ::1], w[:, 2:17], 9, relu=False, causal=causal, prunes=(False,))
    assert launches and all(x == (torch.bfloat16, 4, True) for x in launches), launches


def test_shard_positions_per_batch_noncontiguous():
    # Context-parallel style: two non-contiguous query chunks, per-batch positions, and
    # non-contiguous q / k / weights views.
    B, S, H, D = 2, 48, 4, 16
    qb, kb, wb = int_inputs(B, 16, S, H, 2 * D, seed=6)
    q = qb[..., ::2]
    k = kb[..., 1::2]
    w = wb.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or w.is_contiguous())
    pos = torch.cat([torch.arange(4, 12), torch.arange(36, 44)])
    qpos = torch.stack([pos, pos + 3]).to(DEVICE)
    check(q, k, w, 5, q_positions=qpos)


def test_unsorted_key_positions():
    # Key positions need not be sorted: visibility is by comparison, not by index.
    q, k, w = int_inputs(1, 12, 36, 4, 16, seed=7)
    g = torch.Generator().manual_seed(0)
    kpos = torch.randperm(36, generator=g).to(DEVICE)
    qpos = torch.arange(0, 36, 3).to(DEVICE)
    check(q, k, w, 8, q_positions=qpos, k_positions=kpos)


@pytest.mark.parametrize("H,D,rows", [(1, 16, 16), (5, 8, None), (3, 64, 8)])
def test_head_padding_and_tilings(H, D, rows):
    q, k, w = int_inputs(1, 21, 33, H, D, seed=8 + H)
    check(q, k, w, 10, rows=rows, num_programs=2)


def test_tile_groups_and_compaction():
    # topk 70 with 16-key tiles: buffer 128, groups of 3 tiles, compaction past 80 entries.
    q, k, w = int_inputs(1, 6, 300, 2, 16, seed=12, lo=-1, hi=2)
    check(q, k, w, 70, group_slack_div=1)


def test_default_tile_size():
    q, k, w = int_inputs(1, 8, 150, 2, 16, seed=9)
    check(q, k, w, 20, block_n=None)


def test_kernel_would_fail_on_wrong_order():
    # Guard that the comparison can fail: a reversed row is not equal to the reference.
    q, k, w = int_inputs(1, 6, 20, 2, 16, seed=10)
    out_i, _, _ = check(q, k, w, 4)
    ref_i, _ = hytopk(q, k, w, 4, backend="reference")
    assert not torch.equal(out_i.flip(-1), ref_i)


# ---------------------------------------------------------------------------------------------
# Key-tile pruning (prune=True): exact, and it must fire on structured inputs
# ---------------------------------------------------------------------------------------------


def structured_int_inputs(B, T, S, H, D, seed, ramp_every=4, n_hitters=3):
    """Integer-valued inputs shaped like a trained indexer's: recent keys score highest (dim 0
    of k is a ramp in the key position, every query weights it positively), a few heavy-hitter
    keys (a large dim-1 component every query weights positively), sparse {-1, 0, 1} noise on
    the other dims, head weights in {0, 1, 2, 3} with one negative head."""
    g = torch.Generator().manual_seed(seed)
    noise_k = torch.randint(-1, 2, (B, S, D), generator=g) * (torch.rand(B, S, D, generator=g)
                                                              < 0.25)
    noise_q = torch.randint(-1, 2, (B, T, H, D), generator=g) * (
        torch.rand(B, T, H, D, generator=g) < 0.25)
    k = noise_k.float()
    k[..., 0] = (torch.arange(S) // ramp_every).float()
    k[..., 1] = 0.0
    for b in range(B):
        k[b, torch.randperm(S, generator=g)[:n_hitters], 1] = float(S // ramp_every)
    q = noise_q.float()
    q[..., 0] = torch.randint(1, 3, (B, T, H), generator=g).float()
    q[..., 1] = 1.0
    # Head 0 weighs 3 and the last head -1 (a head ReLU must drop from the bound), so every
    # row favours recent keys, also with ReLU off (folded query: dim 0 >= 3 - 2).
    w = torch.randint(0, 4, (B, T, H), generator=g).float()
    w[..., 0], w[..., -1] = 3.0, -1.0
    return q.to(DEVICE), k.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("relu", [True, False])
def test_pruning_fires_on_structured_inputs(relu):
    q, k, w = structured_int_inputs(2, 24, 192, 4, 16, seed=20)
    _, _, (pruned, considered) = check(q, k, w, 6, relu=relu)
    assert 0 < pruned < considered, (pruned, considered)


def test_pruning_structured_shard_noncontiguous():
    # Context-parallel shard positions, per batch, non-contiguous q / k / weights views.
    B, S, H, D = 2, 160, 4, 16
    qb, kb, wb = structured_int_inputs(B, 16, S, H, 2 * D, seed=21)
    q, k = qb[..., ::2], kb[..., ::2]
    w = wb.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or w.is_contiguous())
    pos = torch.cat([torch.arange(60, 68), torch.arange(140, 148)])
    qpos = torch.stack([pos, pos + 5]).to(DEVICE)
    _, _, (pruned, _) = check(q, k, w, 5, q_positions=qpos)
    assert pruned > 0


def test_pruning_topk_above_visible_keys():
    # Rows that see fewer keys than topk never get a threshold: nothing may be skipped for them.
    q, k, w = structured_int_inputs(1, 40, 40, 2, 16, seed=22)
    check(q, k, w, 12, rows=8)


def equal_key_tiles(S, D, tile_scores, block_n):
    """Keys constant within each tile (radius 0: the bound is tight up to its slack):
    k[s] = tile_scores[s // block_n] * e_0 (+ e_1 for the last tile, unused by the query)."""
    k = torch.zeros(1, S, D)
    k[0, :, 0] = torch.tensor(tile_scores, dtype=torch.float32).repeat_interleave(block_n)[:S]
    return k


def test_pruning_tight_bound_ties_at_threshold():
    # The diagonal tiles score 10 per key; some far tiles score exactly 10 too (they tie with
    # the threshold and win on their smaller index, so they must not be skipped), the others
    # score 9 (just below: skipped). One query head with weight 1: score = 10 or 9 exactly.
    bn, D = 16, 16
    tile_scores = [9, 10, 9, 9, 10, 9, 10, 10, 10, 10]
    S = bn * len(tile_scores)
    k = equal_key_tiles(S, D, tile_scores, bn).to(DEVICE)
    T = 8
    q = torch.zeros(1, T, 1, D, device=DEVICE)
    q[..., 0] = 1.0
    w = torch.ones(1, T, 1, device=DEVICE)
    topk = 20  # 64 keys score 10: the top 20 are the 16 of tile 1 and the first 4 of tile 4
    out_i, out_s, (pruned, considered) = check(q, k, w, topk, block_n=bn)
    assert torch.equal(out_i[0, -1, :16].cpu(), torch.arange(16, 32, dtype=torch.int32))
    assert (out_s == 10).all()
    assert pruned > 0  # the 9-tiles behind the first compaction are skipped


def test_pruning_tight_bound_negative_zero_and_zero_threshold():
    # ReLU rows whose every logit is <= 0 have threshold 0 and bound 0: ties at 0, nothing
    # skipped; negative weights make -0.0 scores that must tie with +0.0.
    bn, D, S, T = 16, 16, 96, 6
    k = equal_key_tiles(S, D, [-1, -2, -1, -3, -1, -1], bn).to(DEVICE)
    q = torch.zeros(1, T, 2, D, device=DEVICE)
    q[..., 0] = 1.0
    w = torch.tensor([[[1.0, -1.0]]], device=DEVICE).expand(1, T, 2).contiguous()
    out_i, out_s, (pruned, _) = check(q, k, w, 5, block_n=bn)
    assert pruned == 0
    assert torch.equal(out_i[0, 0].cpu(), torch.arange(5, dtype=torch.int32))


def test_tile_bound_covers_fp32_dot_products():
    # The bound of _key_tile_bounds against fp32 dot products in several summation orders, on
    # continuous inputs with a large common offset (centroid products far from zero).
    g = torch.Generator().manual_seed(30)
    D, bn = 64, 16
    k = torch.randn(1, 256, D, generator=g) * 0.01 + torch.randn(1, 1, D, generator=g) * 100
    q = torch.randn(64, D, generator=g)
    cent, rho = kernel._key_tile_bounds(k, bn, D)
    qn = q.square().sum(-1).sqrt()
    bound = (q @ cent[0].t()) + qn[:, None] * rho[0][None, :]  # [64, tiles]
    for logits in (q @ k[0].t(), (q[:, None, :] * k[0][None]).flip(-1).cumsum(-1)[..., -1]):
        tight = logits.view(64, -1, bn).amax(-1)
        assert (tight <= bound).all()
    exact = (q.double() @ k[0].double().t()).view(64, -1, bn).amax(-1)
    assert (bound.double() - exact).min() >= 0


@triton.jit
def _kth_probe(buf_ptr, k_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    buf = tl.load(buf_ptr + offs)
    tl.store(out_ptr, kernel._kth_largest(buf, tl.load(k_ptr)))


# Indices of the keys select_buffer packs are below this.
PROBE_INDICES = 5000


def select_buffer(ties, n_real=40, N=64):
    """n_real packed (score, index) keys, as the kernel compacts them, at random places of an
    N-entry buffer padded with key_min; returns the buffer and the keys sorted descending.
    ties: "none", "score" (scores in -3..2) or "all_equal_scores" (the index half decides)."""
    g = torch.Generator().manual_seed(3)
    if ties == "none":
        scores = torch.randperm(1000, generator=g)[:n_real].float() - 500.0
    elif ties == "score":
        scores = torch.randint(-3, 3, (n_real,), generator=g).float()
    else:
        scores = torch.zeros(n_real)
    idx = torch.randperm(PROBE_INDICES, generator=g)[:n_real]
    row = torch.zeros(PROBE_INDICES)
    row[idx] = scores
    keys = order_key(row)[idx]
    buf = torch.full((N,), -(1 << 63), dtype=torch.int64)
    buf[torch.randperm(N, generator=g)[:n_real]] = keys
    return buf, keys.sort(descending=True).values


@pytest.mark.parametrize("ties", ["none", "score", "all_equal_scores"])
def test_kth_largest_radix_select(ties):
    """The compaction's k-th largest packed key: exact with and without tied scores (the index
    half decides), with key_min padding, for every k."""
    buf, expected = select_buffer(ties)
    N, n_real = buf.numel(), expected.numel()
    for k in (1, 2, n_real // 2, n_real - 1, n_real):
        out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        _kth_probe[(1,)](buf.to(DEVICE), torch.tensor([k], device=DEVICE), out, N=N)
        assert out.item() == expected[k - 1].item(), (ties, k)


@pytest.mark.parametrize("keys_on_m,atomic_slots",
                         [(False, False), (True, False), (False, True), (True, True)])
def test_unordered_rows_hold_the_same_set(keys_on_m, atomic_slots):
    """ordered=False skips the final sort: per row the reference's set (indices with their
    scores), -1 / -inf slots last; S = T causal (early rows see fewer than topk keys) and
    topk + one tile buffers (rows compact), in every kernel variant; the public API too."""
    q, k, w = int_inputs(2, 40, 40, 4, 16, seed=5, lo=-1, hi=2)
    topk = 12
    ref_i, ref_s = hytopk(q, k, w, topk, backend="reference")
    qpos, kpos = validate_hytopk_inputs(q, k, w, topk, None, None)
    options = kernel_options(keys_on_m=keys_on_m, atomic_slots=atomic_slots)
    runs = [kernel._launch(q, k, w, topk, relu=True, causal=True, q_positions=qpos,
                           k_positions=kpos, options=options, ordered=False)]
    if keys_on_m and atomic_slots:
        runs.append(hytopk(q, k, w, topk, backend="triton", order="any"))
    assert (ref_i == -1).any()  # the case is there
    for out_i, out_s in runs:
        assert_rows_hold_sorted_sets(out_i, out_s, ref_i, ref_s)


# ---------------------------------------------------------------------------------------------
# Select variants (issue #21): in-kernel sort, pair-major GEMM columns, lean filter, bounded
# select, sampled first threshold (all on by default since 2026-12-03); each on or off must give
# the reference's outputs exactly
# ---------------------------------------------------------------------------------------------

# Every select variant at once; sample_keys=16 is one 16-key tile of samples.
ALL_SELECT = dict(sort_in_kernel=True, head_major=True, lean_filter=True, bounded_select=True,
                  sample_keys=16)


def shard_case():
    """5 heads padded to 8 (pair-major columns with 8 rows) at context-parallel shard
    positions; 33 keys with topk 10 in 32-entry buffers compact every 16-key tile."""
    q, k, w = int_inputs(1, 21, 33, 5, 8, seed=13)
    pos = torch.cat([torch.arange(4, 12), torch.arange(36, 49)]).view(1, -1).to(DEVICE)
    return (q, k, w, 10), dict(q_positions=pos)


def negative_zero_case():
    """All-zero ReLU rows with -0.0 scores (negative weights): the order by index alone."""
    q, k, w = int_inputs(1, 16, 40, 2, 16, seed=2)
    q[0, :8] = -q[0, :8].abs()
    w[0, :8] = -1.0
    return (q, k.abs(), w, 7), {}


def unsorted_positions_case():
    q, k, w = int_inputs(1, 12, 36, 4, 16, seed=7)
    kpos = torch.randperm(36, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return (q, k, w, 8), dict(q_positions=torch.arange(0, 36, 3).to(DEVICE), k_positions=kpos)


@pytest.mark.parametrize("variants", ["all", "none"])
def test_all_select_variants_on_the_adversarial_cases(variants):
    """All select variants together, and none of them: all-zero ReLU rows with -0.0 (ties
    everywhere), pair-major columns at shard positions (a compaction every tile), unsorted key
    positions, relu=False with fewer visible keys than topk, non-contiguous q / k / weights at
    per-batch positions (batch 2)."""
    v = dict(variant=ALL_SELECT if variants == "all" else SELECT_VARIANTS_OFF, prunes=(False,))
    for case in (negative_zero_case, shard_case, unsorted_positions_case):
        args, kw = case()
        check(*args, **kw, **v)
    q, k, w = int_inputs(1, 10, 10, 4, 16, seed=3)
    check(q, k, w, 16, relu=False, **v)
    qb, kb, wb = int_inputs(2, 16, 48, 4, 32, seed=6)
    qpos = torch.cat([torch.arange(4, 12), torch.arange(36, 44)])
    check(qb[..., ::2], kb[..., 1::2], wb.transpose(1, 2).contiguous().transpose(1, 2), 5,
          q_positions=torch.stack([qpos, qpos + 3]).to(DEVICE), **v)


def test_all_select_variants_on_the_other_paths():
    """The same with the heads on M and the prefix-sum append (lean_filter's rank compare and
    the sort meet other layouts; pair-major columns do not apply)."""
    for case in (negative_zero_case, shard_case, unsorted_positions_case):
        args, kw = case()
        check(*args, **kw, keys_on_m=False, atomic_slots=False, prunes=(False,),
              variant=ALL_SELECT)


@pytest.mark.parametrize("field", ["sort_in_kernel", "head_major", "lean_filter",
                                   "bounded_select"])
def test_each_select_variant_alone(field):
    """Each variant by itself (the others off), with key-tile pruning on (its bound sums the
    heads in the GEMM's row order too)."""
    args, kw = shard_case()
    check(*args, **kw, prunes=(True,), variant=dict(SELECT_VARIANTS_OFF, **{field: True}))


def test_default_sample_keys_fit_small_buffers():
    """The default sample (1024 keys) caps at the candidate buffer, so small top-k run with the
    defaults: topk 40 with 32-key tiles has 128-entry buffers, and rows that see 600 keys
    (non-causal; at least 4 buffers' worth) sample 128 of them and stay exact; rows that see
    at most 64 keys take no guess; a sample size that is no power of two, or below one key
    tile, is refused by name."""
    assert HyTopKOptions.DEFAULT.sample_keys == 1024
    q, k, w = int_inputs(1, 8, 600, 4, 16, seed=4, lo=-1, hi=2)
    guessed, _ = sampled(q, k, w, 40, dict(sample_keys=1024), causal=False)
    assert guessed == 8
    q, k, w = int_inputs(1, 8, 64, 4, 16, seed=5)
    assert sampled(q, k, w, 5, {}) == [0, 0]
    qpos, kpos = validate_hytopk_inputs(q, k, w, 5, None, None)
    for bad in (48, 8):
        with pytest.raises(ValueError, match="sample_keys"):
            kernel._launch(q, k, w, 5, relu=True, causal=True, q_positions=qpos,
                           k_positions=kpos, options=kernel_options(sample_keys=bad))


def test_maxnreg_checked_by_name_and_passed_to_the_launch():
    """HyTopKOptions.maxnreg: a cap outside ptxas's 24-255 registers is refused by name before
    anything runs; one inside runs exact (that it reaches ptxas: test_inspect_sm90.py)."""
    q, k, w = int_inputs(1, 24, 24, 4, 16, seed=6)
    qpos, kpos = validate_hytopk_inputs(q, k, w, 5, None, None)
    for bad in (0, 16, 256):
        with pytest.raises(ValueError, match="options.maxnreg"):
            kernel._launch(q, k, w, 5, relu=True, causal=True, q_positions=qpos,
                           k_positions=kpos, options=kernel_options(maxnreg=bad))
    check(q, k, w, 5, prunes=(False,), variant=dict(maxnreg=168))


def sampled(q, k, w, topk, variant, **kw):
    """The kernel with sampled thresholds against the reference (kw: causal, q_positions,
    k_positions); returns (rows given a guess, row blocks redone)."""
    stats = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    ref_i, ref_s = hytopk(q, k, w, topk, backend="reference", **kw)
    qpos, kpos = validate_hytopk_inputs(q, k, w, topk, kw.get("q_positions"),
                                        kw.get("k_positions"))
    out_i, out_s = kernel._launch(q, k, w, topk, relu=True, causal=kw.get("causal", True),
                                  q_positions=qpos, k_positions=kpos, sample_stats=stats,
                                  options=kernel_options(block_n=32, **variant))
    assert torch.equal(out_i, ref_i) and torch.equal(out_s, ref_s)
    return stats.tolist()


def test_sampled_thresholds_guess_and_stay_exact():
    """512 keys, top 8 in 64-entry buffers: every row samples 32 keys and starts from a guess
    (non-causal: all rows see all keys); ties in {-1, 0, 1}; with the other variants."""
    q, k, w = int_inputs(1, 8, 512, 4, 16, seed=3, lo=-1, hi=2)
    assert sampled(q, k, w, 8, dict(ALL_SELECT, sample_keys=32), causal=False) == [8, 0]


@pytest.mark.parametrize("layout", ["cp_shard", "unsorted_keys"])
def test_sampled_thresholds_at_shard_and_unsorted_positions(layout):
    """The default sample (capped at 128-entry buffers: topk 40, 32-key tiles) with rows at
    context-parallel shard positions (two chunks, causal) and with keys in a random position
    order (a row's visible keys are not a prefix of its index range, so its sample also holds
    keys it cannot see): exact against the reference either way, batch 2 with per-batch
    positions, and the rows that see 512 keys or more take a guess."""
    S = 640
    q, k, w = int_inputs(2, 16, S, 4, 16, seed=8, lo=-1, hi=2)
    qpos = torch.cat([torch.arange(560, 568), torch.arange(632, 640)])
    kw = dict(q_positions=torch.stack([qpos, qpos - 1]).to(DEVICE))
    if layout == "unsorted_keys":
        perm = torch.randperm(S, generator=torch.Generator().manual_seed(3))
        kw["k_positions"] = torch.stack([perm, perm.flip(0)]).to(DEVICE)
    guessed, _ = sampled(q, k, w, 40, dict(sample_keys=1024), **kw)
    assert guessed > 0


def test_sampled_threshold_above_the_kth_key_is_redone():
    """The sample hits the only high keys: 8 keys score 10, all of them at sampled positions
    (every 8th key from 0), the rest at most 5. Each row's guess (its sample's 8th largest)
    then lies above its 12th key, the count at the end of the stream says so, and the block is
    redone without guesses: the outputs are still the reference's."""
    S, T = 256, 6
    k = torch.zeros(1, S, 16)
    k[0, :, 0] = torch.randint(0, 6, (S,), generator=torch.Generator().manual_seed(1)).float()
    k[0, torch.arange(8) * 8, 0] = 10.0
    q = torch.zeros(1, T, 4, 16)
    q[..., 0] = 1.0
    w = torch.zeros(1, T, 4)
    w[..., 0] = 1.0
    q, k, w = q.to(DEVICE), k.to(DEVICE), w.to(DEVICE)
    assert sampled(q, k, w, 12, dict(sample_keys=32), causal=False) == [T, 1]


@pytest.mark.parametrize("order", ["score", "key", "any"])
@pytest.mark.parametrize("sort_in_kernel", [True, False])
def test_row_orders_through_the_public_api(order, sort_in_kernel):
    """Each order through the public API, the kernel's row sort or the torch pass: "score"
    rows equal the reference; "key" rows its sets in increasing key order (scores moved with
    them), "any" rows its sets, both with the -1 slots last (S = T causal: early rows see
    fewer than topk)."""
    q, k, w = int_inputs(2, 16, 16, 4, 16, seed=5, lo=-1, hi=2)
    ref_i, ref_s = hytopk(q, k, w, 12, backend="reference")
    out_i, out_s = hytopk(q, k, w, 12, backend="triton", order=order,
                          options=kernel_options(sort_in_kernel=sort_in_kernel,
                                                 lean_filter=True))
    assert (ref_i == -1).any()
    if order == "any":
        assert_rows_hold_sorted_sets(out_i, out_s, ref_i, ref_s)
        return
    if order == "key":
        ref_i, ref_s = ref_i.clone(), ref_s.clone()
        sort_rows_by_key(ref_i, ref_s)
        valid = out_i >= 0
        assert (out_i[..., 1:] > out_i[..., :-1])[valid[..., 1:]].all()
    assert torch.equal(out_i, ref_i) and torch.equal(out_s, ref_s)
    assert torch.equal(hytopk(q, k, w, 12, backend="reference", order=order)[0], ref_i)


@triton.jit
def _kth_bounded_probe(buf_ptr, k_ptr, floor_ptr, out_ptr, n_index, N: tl.constexpr):
    offs = tl.arange(0, N)
    buf = tl.load(buf_ptr + offs)
    tl.store(out_ptr, kernel._kth_largest_bounded(buf, tl.load(k_ptr), tl.load(floor_ptr),
                                                  n_index))


@pytest.mark.parametrize("ties", ["none", "score", "all_equal_scores"])
def test_kth_largest_bounded_select(ties):
    """The bounded select gives _kth_largest's answer for every k, with the floor at the
    smallest key, below it, and at the floor's extremes (INT64_MIN: nothing skipped)."""
    buf, expected = select_buffer(ties)
    N, n_real = buf.numel(), expected.numel()
    for floor in (expected[-1].item(), expected[-1].item() - (5 << 32), -(1 << 63)):
        for k in (1, 2, n_real // 2, n_real - 1, n_real):
            out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
            _kth_bounded_probe[(1,)](buf.to(DEVICE), torch.tensor([k], device=DEVICE),
                                     torch.tensor([floor], device=DEVICE), out,
                                     PROBE_INDICES, N=N)
            assert out.item() == expected[k - 1].item(), (ties, floor, k)


def test_key_tma_gives_the_same_rows():
    """options.key_tma: the key tiles through one TMA descriptor of k as [B * S, D] rows (the
    interpreter runs its loads too): B = 2 with S off the tile (a tile's rows past S read the
    next batch's keys, which must stay invisible), noncausal and causal, pruning on and off,
    ties."""
    q, k, w = int_inputs(2, 20, 41, 4, 16, seed=31, lo=-1, hi=2)
    check(q, k, w, 6, variant={"key_tma": True})
    check(q, k, w, 6, variant={"key_tma": True}, causal=False, prunes=(False,))


def test_key_tma_on_unpacked_keys_warns_once_and_loads_without_it(monkeypatch):
    from megatron_hyscale.ops import checks

    monkeypatch.setattr(checks, "_warned", set())
    q, k, w = int_inputs(2, 12, 24, 4, 16, seed=32)
    wide = torch.zeros(2, 24, 32, device=DEVICE)
    wide[..., :16] = k
    with pytest.warns(RuntimeWarning, match="key_tma cannot run.*batches are not packed"):
        check(q, wide.as_strided((2, 24, 16), (24 * 32 + 8, 32, 1)), w, 5,
              variant={"key_tma": True}, prunes=(False,))


def test_key_tma_refuses_rows_wider_than_a_tma_box(monkeypatch):
    from megatron_hyscale.ops import checks

    monkeypatch.setattr(checks, "_warned", set())
    k = torch.zeros(1, 8, 512)
    with pytest.warns(RuntimeWarning, match="512 channels exceeds TMA's 256-element box"):
        assert kernel._key_descriptor(k, 16, 512) is None
    assert kernel._key_descriptor(torch.zeros(1, 8, 128), 16, 128) is not None

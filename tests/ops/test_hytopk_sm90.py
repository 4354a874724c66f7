"""HyTopK from the Gluon scores (`kernels/hytopk_sm90.py`, `HyTopKOptions.scores_sm90`).

CPU: the sampled thresholds, the select over the survivors and the redo of the rows whose
threshold missed, with a plain-torch filter of `indexer_filter_sm90`'s contract in place of the
Gluon kernel (Triton's interpreter runs the sample's score table and the redo); outputs equal
to the reference's bit for bit on integer-valued inputs (every fp32 sum exact). GPU (Hopper):
the Gluon filter itself against the same plain-torch filter, and the op at real sizes.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from megatron_hyscale.ops import HyTopKOptions, hytopk
from megatron_hyscale.ops.kernels import hytopk_sm90, row_rank

INT64_MIN = torch.iinfo(torch.int64).min
# What the plain-torch filter leaves in a row's slots past its survivors: the largest key, so a
# select that read past a row's count would take it (the Gluon filter leaves them unwritten).
UNWRITTEN = torch.iinfo(torch.int64).max
LOW32 = (1 << 32) - 1
# Triton's interpreter on CPU-only machines (tests/conftest.py), the kernels on a GPU.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def pack(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """HyTopK's int64 key (larger: higher score, then smaller index; -0.0 as +0.0)."""
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered << 32) | (LOW32 - index.to(torch.int64))


def exact_scores(q, k, w, relu=True):
    """fp32 [B, T, S] scores (exact on integer inputs), -inf where s > t."""
    dots = torch.einsum("bthd,bsd->bths", q.double(), k.double())
    if relu:
        dots = dots.clamp_min(0)
    scores = (dots * w.double()[..., None]).sum(2).float()
    T, S = q.shape[1], k.shape[1]
    rows = torch.arange(T, device=q.device)[:, None]
    causal = torch.arange(S, device=q.device)[None, :] <= rows
    return scores.masked_fill(~causal, float("-inf"))


def scaled_keys(k, k_scale):
    """k as the kernels score it: e4m3 keys times their scales (exact in fp64)."""
    return k if k_scale is None else k.double() * k_scale.double()[..., None]


def torch_filter(q, k, w, tau, t_lo, t_hi, cap, *, drop_last=False, shuffle_seed=0,
                 k_scale=None, relu=True):
    """`indexer_filter_sm90`'s contract in plain torch: each row's visible scores >= tau as
    packed keys, in a shuffled order (the kernel's is its atomics', or key order with the
    scan slots), UNWRITTEN after (the kernel leaves those slots as allocated); counts of all
    survivors. drop_last: a broken filter that loses each row's last survivor. k_scale:
    e4m3 keys' scales (w then carries q's); relu=False: q the folded query's parts."""
    scores = exact_scores(q, scaled_keys(k, k_scale), w, relu)[:, t_lo:t_hi]
    B, n, S = scores.shape
    keep = (scores >= tau[..., None]) & torch.isfinite(scores)
    keys = torch.full((B, n, cap), UNWRITTEN, dtype=torch.int64, device=q.device)
    counts = keep.sum(-1).to(torch.int32)
    g = torch.Generator().manual_seed(shuffle_seed)
    for b in range(B):
        for r in range(n):
            idx = keep[b, r].nonzero()[:, 0]
            if drop_last and idx.numel():
                idx = idx[:-1]
            idx = idx[torch.randperm(idx.numel(), generator=g).to(idx.device)][:cap]
            keys[b, r, :idx.numel()] = pack(scores[b, r, idx], idx)
    return keys, counts


def torch_select(keys, counts, topk, *, order, options):
    """`select_survivors`' contract in plain torch: each row's topk largest of its first
    min(count, cap) keys, decoded, by score ("score", "any") or by increasing index ("key"),
    empty slots (-1, -inf) last."""
    del options
    cap = keys.shape[-1]
    valid = torch.arange(cap, device=keys.device) < counts.clamp(max=cap)[..., None]
    best = torch.where(valid, keys, INT64_MIN).topk(topk, dim=-1).values
    empty = best == INT64_MIN
    idx = torch.where(empty, -1, LOW32 - (best & LOW32)).to(torch.int32)
    bits = (best >> 32).to(torch.int32)
    val = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).view(torch.float32)
    val = torch.where(empty, float("-inf"), val)
    if order == "key":
        pos = torch.where(empty, 1 << 40, idx.long()).argsort(-1)
        idx, val = idx.gather(-1, pos), val.gather(-1, pos)
    return idx, val


def by_index(idx, val):
    """Rows sorted by index (empty slots, -1, first): order "any"'s sets compared as sets."""
    pos = idx.argsort(-1)
    return idx.gather(-1, pos), val.gather(-1, pos)


def assert_empty_last(idx):
    """Each row's empty slots (-1) after all its selected ones."""
    filled = (idx >= 0).sum(-1, keepdim=True)
    assert ((idx >= 0) == (torch.arange(idx.shape[-1], device=idx.device) < filled)).all()


def int_inputs(B, T, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (B, T, H, D), generator=g).to(torch.bfloat16)
    k = torch.randint(-3, 4, (B, T, D), generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (B, T, H), generator=g).float()
    return q.to(DEV), k.to(DEV), w.to(DEV)


def run(q, k, w, topk, samples, filter_fn=torch_filter, order="score", select_fn=torch_select):
    """The op with plain-torch filter and select (the interpreter runs the sample's table and
    the redo); select_fn=None: the select kernel."""
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_samples=samples,
                         scores_sm90_sample_min_rank=None,  # the sample as given
                         scores_sm90_sample_table=False, interpret_programs=2)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    got = hytopk_sm90.hytopk_sm90(q, k, w, topk, options=opts, order=order,
                                  filter_fn=filter_fn, select_fn=select_fn, stats=stats)
    return got, stats


@pytest.mark.parametrize("order", ["key", "any"])
def test_other_orders_hold_the_same_rows(order):
    """order="key": the reference's rows sorted by index (-1 last); "any": the same sets, -1
    slots last, each score still with its index. Samples of 1 and 16 (redone rows in both)."""
    from megatron_hyscale.ops.key_order import sort_rows_by_key

    q, k, w = int_inputs(2, 90, 2, 16, seed=11)
    want = [t.clone() for t in hytopk(q, k, w, 12, backend="reference")]
    for samples in (1, 16):
        (idx, val), stats = run(q, k, w, 12, samples, order=order)
        if order == "key":
            key_idx, key_val = (t.clone() for t in want)
            sort_rows_by_key(key_idx, key_val)
            assert torch.equal(idx, key_idx) and torch.equal(val, key_val)
        else:
            valid = idx >= 0
            assert not (valid[..., 1:] & ~valid[..., :-1]).any()  # -1 last
            got_idx, got_perm = idx.sort(-1)
            want_idx, want_perm = want[0].sort(-1)
            assert torch.equal(got_idx, want_idx)
            assert torch.equal(val.gather(-1, got_perm), want[1].gather(-1, want_perm))
        assert stats[0] > 0


@pytest.mark.parametrize("samples", [8, 64, 1])
def test_matches_the_reference_on_integer_inputs(samples):
    """Batch 2, rows seeing fewer keys than topk, ties (integer scores tie often), and a
    sample of 1 key (thresholds far off: most rows redone) still give the reference's rows."""
    q, k, w = int_inputs(2, 96, 2, 16, seed=samples)
    want = hytopk(q, k, w, 12, backend="reference")
    (idx, val), stats = run(q, k, w, 12, samples)
    assert torch.equal(idx, want[0]) and torch.equal(val, want[1])
    assert stats[1] == 2 * 96
    if samples == 1:
        assert stats[0] > 0  # the redo path ran


def test_adversarial_rows():
    """All-zero query rows (every score 0: all tie at the threshold, the row overflows the cap
    and is redone), a negatively weighted row (-0.0 and negative scores), duplicated keys, and
    a non-contiguous w."""
    q, k, w = int_inputs(2, 80, 2, 16, seed=7)
    q[:, 40] = 0
    q[1, 79] = 0
    w[:, 50] = -(w[:, 50].abs() + 1)
    k[:, 30:45] = k[:, 10:11]
    w_nc = torch.cat([w, w], dim=-1)[..., :2]
    assert not w_nc.is_contiguous()
    want = hytopk(q, k, w, 10, backend="reference")
    (idx, val), stats = run(q, k, w_nc, 10, 16)
    assert torch.equal(idx, want[0]) and torch.equal(val, want[1])
    assert stats[0] > 0  # the all-zero rows overflowed


@pytest.mark.parametrize("order", ["score", "key", "any"])
def test_row_chunks(monkeypatch, order):
    """Survivor buffers of 7 rows and sample tables of 64 rows (the chunk loops past their
    first chunk): the same rows as in one chunk, in every order."""
    q, k, w = int_inputs(2, 150, 2, 16, seed=4)
    whole, _ = run(q, k, w, 12, 16, order=order)
    cap = hytopk_sm90.survivor_cap(12)
    monkeypatch.setattr(hytopk_sm90, "CHUNK_BYTES", 8 * cap * 2 * 7)
    monkeypatch.setattr(hytopk_sm90, "SAMPLE_CHUNK_ROWS", 64)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[4:6])
        return torch_filter(*args, **kwargs)

    got, _ = run(q, k, w, 12, 16, filter_fn=counted, order=order)
    assert calls[:2] == [(0, 7), (7, 14)] and calls[-1] == (147, 150)
    if order == "any":  # each row's set (its order is the survivors' buffer order)
        got, whole = by_index(*got), by_index(*whole)
    assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1])


def torch_table(q, k_sampled, w, stride, t_lo, t_hi, k_scale=None, relu=True):
    """`indexer_table_sm90`'s contract in plain torch: rows [t_lo, t_hi) against the sampled
    keys (key j at position j x stride), -inf where a row does not see the key."""
    T = q.shape[1]
    k_sampled = scaled_keys(k_sampled, k_scale)
    full = torch.zeros(q.shape[0], T, k_sampled.shape[-1], dtype=k_sampled.dtype,
                       device=k_sampled.device)
    full[:, ::stride] = k_sampled
    return exact_scores(q, full, w, relu)[:, t_lo:t_hi, ::stride]


@pytest.mark.parametrize("samples", [16, 5, 1000])
def test_thresholds_from_a_table_function_equal_the_triton_tables(monkeypatch, samples):
    """The sampled thresholds from a table function (the Gluon table's contract, here plain
    torch) equal those from HyTopK's Triton score-table kernel (the interpreter) on integer
    inputs, batch 2, sample tables of 64 rows (the chunk loop), strides 10 / 30 / 1, picked
    by either scores_sm90_sample_pick; and the option routes to the Gluon table (a spy in its
    place)."""
    monkeypatch.setattr(hytopk_sm90, "SAMPLE_CHUNK_ROWS", 64)
    q, k, w = int_inputs(2, 150, 2, 16, seed=samples)
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_sample_min_rank=None,
                         scores_sm90_sample_table=False, interpret_programs=2)
    want = hytopk_sm90.sample_thresholds(q, k, w, 8, samples, options=opts)
    calls = []

    def table(*args, **kwargs):
        calls.append(args[3:])
        return torch_table(*args, **kwargs)

    got = hytopk_sm90.sample_thresholds(q, k, w, 8, samples, options=opts, table_fn=table)
    assert torch.equal(got, want)
    other = "topk" if opts.scores_sm90_sample_pick == "radix" else "radix"  # same thresholds
    assert torch.equal(hytopk_sm90.sample_thresholds(
        q, k, w, 8, samples, options=replace(opts, scores_sm90_sample_pick=other),
        table_fn=table), want)
    stride = -(-150 // samples)
    assert calls[0] == (stride, 0, 64) and calls[-1] == (stride, 128, 150)
    assert len(calls) == 4 * 3  # a call a batch and chunk of rows, twice
    from megatron_hyscale.ops.kernels import indexer_scores_sm90

    monkeypatch.setattr(indexer_scores_sm90, "indexer_table_sm90", table)
    gluon = replace(opts, scores_sm90_sample_table=True)
    assert torch.equal(hytopk_sm90.sample_thresholds(q, k, w, 8, samples, options=gluon), want)
    assert len(calls) == 6 * 3


def test_a_failing_gluon_table_warns_once_and_the_triton_table_runs(monkeypatch):
    """The Gluon sample table failing (simulated) is said once, its variant (head count,
    part-major, transposed head sum) refused afterwards, and the thresholds are the Triton
    table's; an injected table's failure is the caller's and propagates."""
    from megatron_hyscale.ops import checks
    from megatron_hyscale.ops.kernels import indexer_scores_sm90

    monkeypatch.setattr(checks, "_warned", set())
    monkeypatch.setattr(hytopk_sm90, "TABLE_VARIANTS", hytopk_sm90.KernelVariants(
        "hytopk-sample-table", "Gluon sample table", "Triton score-table kernel"))
    tries, variants = [], []

    def failing(*args, **kwargs):
        tries.append(1)
        variants.append({name: kwargs[name] for name in ("part_major", "head_sum_transpose")
                         if name in kwargs})
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(indexer_scores_sm90, "indexer_table_sm90", failing)
    q, k, w = int_inputs(1, 90, 2, 16, seed=3)
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_sample_min_rank=None,
                         scores_sm90_sample_table=False, interpret_programs=2)
    want = hytopk_sm90.sample_thresholds(q, k, w, 8, 16, options=opts)
    gluon = replace(opts, scores_sm90_sample_table=True)
    with pytest.warns(RuntimeWarning, match="Gluon sample table cannot run.*simulated"):
        got = hytopk_sm90.sample_thresholds(q, k, w, 8, 16, options=gluon)
    assert torch.equal(got, want) and tries == [1] and variants == [{}]
    assert hytopk_sm90.TABLE_VARIANTS.disabled == {(2, False, False)}
    assert torch.equal(hytopk_sm90.sample_thresholds(q, k, w, 8, 16, options=gluon), want)
    assert tries == [1]  # refused afterwards
    # a variant by head count and layout: the folded parts stored part-major are another
    parts, parts_w = hytopk_sm90.folded_parts(q, w, part_major=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hytopk_sm90.sample_thresholds(parts, k, parts_w, 8, 16, options=gluon, relu=False)
    assert tries == [1, 1] and variants[-1] == {"part_major": True}
    assert hytopk_sm90.TABLE_VARIANTS.disabled == {(2, False, False), (4, True, False)}
    # the transposed head sum (ReLU) is another, told to the kernel; not the folded parts'
    transposed = replace(gluon, scores_sm90_head_sum_transpose=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(hytopk_sm90.sample_thresholds(q, k, w, 8, 16, options=transposed),
                           want)
        hytopk_sm90.sample_thresholds(parts, k, parts_w, 8, 16, options=transposed, relu=False)
    assert tries == [1, 1, 1] and variants[-1] == {"head_sum_transpose": True}
    assert hytopk_sm90.TABLE_VARIANTS.disabled == {(2, False, False), (4, True, False),
                                                   (2, False, True)}
    with pytest.raises(RuntimeError, match="simulated"):
        hytopk_sm90.sample_thresholds(q, k, w, 8, 16, options=opts, table_fn=failing)


def two_scales(q, k):
    """Integer-valued q and k whose e4m3 scales differ from key to key, token to token and
    batch to batch (amax 1 or 1.5 against 3: still exact in e4m3 at their scales)."""
    k, q = k.clone(), q.clone()
    k[:, ::5] = k[:, ::5].sign()  # amax 1: half the others' scale
    k[1, 1::3] = k[1, 1::3] * 0.5  # batch 1 only
    q[:, ::7, 1] = q[:, ::7, 1].sign()
    q[1, 2::5, 0] = q[1, 2::5, 0] * 0.5
    return q, k


@pytest.mark.parametrize("order", ["score", "key"])
def test_fp8_matches_the_reference_on_the_same_quantized_inputs(order):
    """precision="fp8" on the Gluon path's contract (plain-torch filter, table and select;
    the interpreter runs the redo's fp8 Triton kernel): e4m3 q and k with their scales, q's
    folded into the head weights, k's applied to each key's head sum, give the reference's
    rows on the same quantized inputs (integer-valued: every product exact), batch 2, a sample
    of 16 keys (some rows redone)."""
    from megatron_hyscale.ops import fp8_quant

    q, k, w = int_inputs(2, 96, 2, 16, seed=11)
    q, k = two_scales(q, k)
    q8, q_scale, k8, k_scale = fp8_quant.quantize_indexer(q, k)
    assert not torch.equal(k_scale[0], k_scale[1]) and not torch.equal(q_scale[0], q_scale[1])
    assert k_scale.unique().numel() > 1 and q_scale.unique().numel() > 1
    want = hytopk(q, k, w, 12, precision="fp8", backend="reference", order=order)
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_samples=16,
                         scores_sm90_sample_min_rank=None, interpret_programs=2)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    got = hytopk_sm90.hytopk_sm90(q8, k8, w, 12, options=opts, order=order,
                                  filter_fn=torch_filter, select_fn=torch_select,
                                  table_fn=torch_table, stats=stats, q_scale=q_scale,
                                  k_scale=k_scale)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert stats[0] > 0  # the fp8 redo ran
    with pytest.raises(ValueError, match="q_scale and k_scale go together"):
        hytopk_sm90.hytopk_sm90(q8, k8, w, 12, options=opts, q_scale=q_scale,
                                filter_fn=torch_filter, table_fn=torch_table)


def test_exact_sampling_needs_no_redo():
    """With every key sampled (samples >= T) each threshold sits at rank 1.5 x topk of the
    row's visible keys, so no row is redone (untied scores: continuous inputs, 4 heads so
    that few keys score exactly 0 after the ReLU)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 128, 4, 16, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(1, 128, 16, generator=g).to(DEV, torch.bfloat16)
    w = torch.rand(1, 128, 4, generator=g).to(DEV)
    (idx, _), stats = run(q, k, w, 8, 128)
    assert stats[0] == 0
    assert torch.equal(idx, hytopk(q, k, w, 8, backend="reference")[0])


def test_a_broken_filter_is_caught():
    """The comparison can fail: a filter that loses one survivor a row changes the rows whose
    count still passes."""
    q, k, w = int_inputs(1, 64, 2, 16, seed=3)
    want = hytopk(q, k, w, 8, backend="reference")

    def broken(*args, **kwargs):
        return torch_filter(*args, drop_last=True, **kwargs)

    (idx, _), _ = run(q, k, w, 8, 64, filter_fn=broken)
    assert not torch.equal(idx, want[0])


def test_the_op_warns_and_runs_the_triton_kernel_where_it_cannot_run(monkeypatch):
    """Off Hopper (and on it: 2 heads of 16 are not the Gluon kernel's shape) one warning
    names why and the Triton kernel's rows come back."""
    from megatron_hyscale.ops import checks

    monkeypatch.setattr(checks, "_warned", set())
    q, k, w = int_inputs(1, 40, 2, 16, seed=1)
    opts = HyTopKOptions(scores_sm90=True, interpret_programs=2)
    with pytest.warns(RuntimeWarning, match=r"scores_sm90\) cannot run"):
        got = hytopk(q, k, w, 6, backend="triton", options=opts)
    want = hytopk(q, k, w, 6, backend="reference")
    assert torch.equal(got[0], want[0])


def test_the_default_runs_the_triton_kernel_quietly_where_the_gluon_path_cannot(monkeypatch,
                                                                                recwarn):
    """scores_sm90=None (the default): a call the Gluon path cannot take (here: off Hopper, or
    2 heads of 16) runs the Triton kernel with no warning."""
    from megatron_hyscale.ops import checks

    monkeypatch.setattr(checks, "_warned", set())
    q, k, w = int_inputs(1, 40, 2, 16, seed=1)
    opts = HyTopKOptions(interpret_programs=2, scores_sm90_min_keys=1)
    assert HyTopKOptions.DEFAULT.scores_sm90 is None
    got = hytopk(q, k, w, 6, backend="triton", options=opts)
    assert not [r for r in recwarn if "scores_sm90" in str(r.message)]
    assert torch.equal(got[0], hytopk(q, k, w, 6, backend="reference")[0])


@pytest.mark.parametrize("setting, keys, min_keys, capturing, runs", [
    (None, 64, 64, False, True), (None, 64, 65, False, False), (True, 64, 65, False, True),
    (False, 64, 1, False, False), (None, 64, 64, True, False)])
def test_which_calls_take_the_gluon_path(monkeypatch, setting, keys, min_keys, capturing, runs):
    """The default takes the Gluon path from scores_sm90_min_keys keys on (shorter rows: the
    Triton kernel, measured faster there or not measured) and not while a CUDA graph is
    captured (its host sync), True at any length, False never; each where the path can run
    (`unsupported` stubbed to "can", the path to the reference)."""
    import importlib

    op_module = importlib.import_module("megatron_hyscale.ops.hytopk")
    monkeypatch.setattr(op_module, "_capturing_graph", lambda t: capturing)
    taken = []

    def gluon(q, k, w, topk, options, order, q_scale=None, k_scale=None, relu=True):
        taken.append(k.shape[1])
        return hytopk(q, k, w, topk, backend="reference")

    monkeypatch.setattr(hytopk_sm90, "unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(hytopk_sm90, "hytopk_sm90", gluon)
    q, k, w = int_inputs(1, keys, 2, 16, seed=2)
    opts = HyTopKOptions(scores_sm90=setting, scores_sm90_min_keys=min_keys,
                         interpret_programs=2)
    got = hytopk(q, k, w, 5, backend="triton", options=opts)
    assert taken == ([keys] if runs else [])
    assert torch.equal(got[0], hytopk(q, k, w, 5, backend="reference")[0])


def test_no_graph_is_captured_off_cuda():
    """The capture check asks CUDA only for CUDA tensors (asking without a driver raises)."""
    import importlib

    op_module = importlib.import_module("megatron_hyscale.ops.hytopk")
    assert op_module._capturing_graph(torch.zeros(1)) is False


@pytest.mark.parametrize("folded_min_keys, default_runs", [(None, False), (64, True),
                                                            (65, False)])
def test_the_folded_query_takes_the_gluon_path_from_its_own_length(monkeypatch, folded_min_keys,
                                                                  default_runs):
    """relu=False: the Gluon path (its folded variant) runs when asked (True); by default from
    scores_sm90_folded_min_keys keys on (None: never), whatever scores_sm90_min_keys says;
    the rows are the reference's either way."""
    taken = []

    def gluon(q, k, w, topk, options, order, q_scale=None, k_scale=None, relu=True):
        taken.append(relu)
        return hytopk(q, k, w, topk, relu=relu, backend="reference")

    monkeypatch.setattr(hytopk_sm90, "unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(hytopk_sm90, "hytopk_sm90", gluon)
    q, k, w = int_inputs(1, 64, 2, 16, seed=5)
    want = hytopk(q, k, w, 5, relu=False, backend="reference")
    for setting, runs in ((None, [False] if default_runs else []), (True, [False])):
        taken.clear()
        opts = HyTopKOptions(scores_sm90=setting, scores_sm90_min_keys=1, interpret_programs=2,
                             scores_sm90_folded_min_keys=folded_min_keys)
        got = hytopk(q, k, w, 5, relu=False, backend="triton", options=opts)
        assert taken == runs
        assert torch.equal(got[0], want[0])


def test_folded_parts_part_major_hold_the_same_values():
    """folded_parts(part_major=True): the same parts and weights, stored [B, 4, T, D] (a view
    permuted to [B, T, 4, D]), as the kernels' part_major reads them."""
    q, k, w = int_inputs(2, 9, 3, 16, seed=4)
    rows, rows_w = hytopk_sm90.folded_parts(q, w * 101.0)
    parts, parts_w = hytopk_sm90.folded_parts(q, w * 101.0, part_major=True)
    assert torch.equal(parts, rows) and torch.equal(parts_w, rows_w)
    assert parts.permute(0, 2, 1, 3).is_contiguous()
    assert not rows.permute(0, 2, 1, 3).is_contiguous()
    assert (rows[:, :, 1] != 0).any() and not rows[:, :, 3].any()


def test_folded_parts_sum_to_the_folded_query():
    """relu=False's operands: sum_h w_h q_h as three bf16 parts (their fp32 sum is it exactly)
    and a zero part, weights 1, 1, 1, 0; packed for TMA."""
    q, _, w = int_inputs(2, 9, 3, 16, seed=4)
    w = w * 97.0 + 0.375  # a folded query of more than 8 significant bits
    q4, w4 = hytopk_sm90.folded_parts(q, w)
    folded = torch.einsum("bthd,bth->btd", q.float(), w)
    assert q4.dtype == torch.bfloat16 and q4.shape == (2, 9, 4, 16) and q4.is_contiguous()
    assert torch.equal(q4[:, :, 3], torch.zeros_like(q4[:, :, 3]))
    assert not torch.equal(q4[:, :, 1], torch.zeros_like(q4[:, :, 1]))  # two parts used
    assert torch.equal(q4[:, :, :3].float().sum(2), folded)
    ones = torch.tensor([1.0, 1.0, 1.0, 0.0], device=DEV).expand(2, 9, 4)
    assert w4.dtype == torch.float32 and torch.equal(w4, ones)
    from megatron_hyscale.ops.kernels import indexer_scores_sm90

    assert indexer_scores_sm90.FOLDED_HEADS == (hytopk_sm90.FOLDED_GLUON_HEADS,)


@pytest.mark.parametrize("samples", [16, 1])
def test_folded_query_matches_the_reference(samples):
    """relu=False on the Gluon path's contract (plain-torch filter and select over the folded
    query's parts; the interpreter runs the sample's Triton table and the redo, both folding
    the heads themselves): the reference's rows, batch 2, 3 heads whose weighted sum needs two
    bf16 parts, ties; a sample of 1 key redoes rows."""
    q, k, w = int_inputs(2, 90, 3, 16, seed=21)
    w = w * 101.0
    want = hytopk(q, k, w, 12, relu=False, backend="reference")
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_samples=samples,
                         scores_sm90_sample_min_rank=None,  # the sample as given
                         scores_sm90_sample_table=False, interpret_programs=2)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    seen = []

    def parts_filter(q_in, k_in, w_in, *args, **kwargs):  # what the Gluon filter would get
        seen.append((q_in.shape[2], q_in.dtype, tuple(w_in[0, 0].tolist()), kwargs["relu"]))
        return torch_filter(q_in, k_in, w_in, *args, **kwargs)

    got = hytopk_sm90.hytopk_sm90(q, k, w, 12, options=opts, filter_fn=parts_filter,
                                  select_fn=torch_select, stats=stats, relu=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert seen and set(seen) == {(4, torch.bfloat16, (1.0, 1.0, 1.0, 0.0), False)}
    if samples == 1:
        assert stats[0] > 0


@pytest.mark.parametrize("field, value", [("scores_sm90", 1), ("scores_sm90", "auto"),
                                          ("scores_sm90_min_keys", 0),
                                          ("scores_sm90_min_keys", True),
                                          ("scores_sm90_folded_min_keys", 0),
                                          ("scores_sm90_folded_min_keys", 2.0),
                                          ("scores_sm90_sample_min_rank", 0),
                                          ("scores_sm90_sample_min_rank", True),
                                          ("scores_sm90_sample_pick", "sort"),
                                          ("scores_sm90_scan_slots", 1),
                                          ("scores_sm90_mma_ahead", None),
                                          ("scores_sm90_folded_part_major", 0),
                                          ("scores_sm90_stages", 1),
                                          ("scores_sm90_stages", 9),
                                          ("scores_sm90_stages", True)])
def test_bad_gluon_path_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"HyTopKOptions.{field}"):
        HyTopKOptions(**{field: value})


def test_bad_sample_count_is_refused(monkeypatch):
    """A sample count below 1 is refused anywhere; one over what the radix pick holds where
    the Gluon path could run (a Hopper GPU), since the radix pick is the default, and not
    with the torch.topk pick; elsewhere the device is the reason."""
    q, k, w = int_inputs(1, 8, 2, 16, seed=0)

    def why(options):
        return hytopk_sm90.unsupported(q, k, w, relu=True, causal=True, default_positions=True,
                                       precision="bf16", options=options)

    with pytest.raises(ValueError, match="scores_sm90_samples"):
        why(HyTopKOptions(scores_sm90_samples=0))
    wide = HyTopKOptions(scores_sm90_samples=row_rank.MAX_COLUMNS + 1)
    monkeypatch.setattr(hytopk_sm90, "on_hopper", lambda t: False)  # any machine's tensors
    assert "Hopper" in why(wide)
    monkeypatch.setattr(hytopk_sm90, "on_hopper", lambda t: True)
    with pytest.raises(ValueError, match="scores_sm90_samples = 16385 .*sample_pick='radix'"):
        why(wide)
    why(replace(wide, scores_sm90_sample_pick="topk"))  # past the pick's check: no raise


def test_the_sample_grows_past_128k_keys_at_top_2048():
    """scores_sm90_sample_min_rank: 2048 sampled keys up to 128K keys at top-2048 (stride 64: a
    row's threshold about its 48th best sample), then stride 64 (4096 at 256K, 16384 at 1M), at
    most what the radix pick holds (not with the torch.topk pick), never below the option's
    count nor past the keys; None: the option's count. Wide samples take fewer table rows a
    chunk (whole quanta, at least one)."""
    count, opts = hytopk_sm90.sample_count, HyTopKOptions.DEFAULT
    assert opts.scores_sm90_sample_min_rank == 48 and opts.scores_sm90_sample_pick == "radix"
    assert [count(T, 2048, 2048, opts) for T in (16384, 131072, 131073, 262144, 1 << 20)] == [
        2048, 2048, 2049, 4096, 16384]
    assert count(1 << 21, 2048, 2048, opts) == row_rank.MAX_COLUMNS
    topk_pick = replace(opts, scores_sm90_sample_pick="topk")
    assert count(1 << 21, 2048, 2048, topk_pick) == 32768
    assert count(131072, 512, 2048, opts) == 8192  # stride 16 at top-512
    assert count(1 << 20, 2048, 32768, topk_pick) == 32768  # the option's count at least
    assert count(150, 8, 16, opts) == 150  # stride 1: every key
    fixed = replace(opts, scores_sm90_sample_min_rank=None)
    assert count(1 << 20, 2048, 2048, fixed) == 2048
    assert [hytopk_sm90.sample_chunk_rows(n) for n in (16, 2048, 16384, 32768, 1 << 20)] == [
        8192, 8192, 8192, 4096, hytopk_sm90.SAMPLE_ROW_QUANTUM]


def test_the_thresholds_take_the_grown_sample():
    """sample_thresholds scores every floor(SURVIVOR_MARGIN x topk / min rank)-th key where the
    option's sample is sparser (min rank 3 at top-8: every 4th key, not every 10th), the same
    thresholds as a sample of that many keys given outright."""
    q, k, w = int_inputs(2, 150, 2, 16, seed=9)
    strides = []

    def table(*args, **kwargs):
        strides.append(args[3])
        return torch_table(*args, **kwargs)

    opts = HyTopKOptions(scores_sm90=True, scores_sm90_sample_min_rank=3,
                         scores_sm90_sample_table=False, interpret_programs=2)
    grown = hytopk_sm90.sample_thresholds(q, k, w, 8, 15, options=opts, table_fn=table)
    assert set(strides) == {4}
    fixed = replace(opts, scores_sm90_sample_min_rank=None)
    assert torch.equal(grown, hytopk_sm90.sample_thresholds(q, k, w, 8, 38, options=fixed,
                                                            table_fn=table))
    assert set(strides) == {4}
    hytopk_sm90.sample_thresholds(q, k, w, 8, 15, options=fixed, table_fn=table)
    assert strides[-1] == 10


def test_rows_seeing_at_most_the_cap_keep_every_key(monkeypatch):
    """A row seeing at most survivor_cap(topk) keys gets no threshold (-inf): all its keys
    survive and it is never redone, where a threshold from a one-key sample misses most rows
    past topk; the later rows are redone and the output is the reference's."""
    q, k, w = int_inputs(2, 96, 2, 16, seed=5)
    cap = hytopk_sm90.survivor_cap(12)
    redone = []
    redo = hytopk_sm90.redo_rows

    def spy(*args, **kwargs):
        redone.append(args[4].clone())
        return redo(*args, **kwargs)

    monkeypatch.setattr(hytopk_sm90, "redo_rows", spy)
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_samples=1,
                         scores_sm90_sample_min_rank=None, scores_sm90_sample_table=False,
                         interpret_programs=2)
    tau = hytopk_sm90.sample_thresholds(q, k, w, 12, 1, options=opts)
    assert bool(torch.isinf(tau[:, :cap]).all()) and bool(torch.isfinite(tau[:, cap:]).all())
    want = hytopk(q, k, w, 12, backend="reference")
    (idx, val), stats = run(q, k, w, 12, 1)
    assert torch.equal(idx, want[0]) and torch.equal(val, want[1])
    (mask,) = redone
    assert not mask[:, :cap].any() and mask[:, cap:].any()
    assert stats[0] == mask.sum()


def test_the_folded_query_on_the_fp32_triton_variant_is_not_taken(monkeypatch):
    """relu=False with options.folded_parts=False (the Triton kernel's fp32 folded query) is
    a reason not to take the Gluon path, which scores the bf16 parts."""
    monkeypatch.setattr(hytopk_sm90, "on_hopper", lambda t: True)
    q, k, w = int_inputs(1, 8, 2, 128, seed=0)
    def why(options):
        return hytopk_sm90.unsupported(q.bfloat16(), k.bfloat16(), w, relu=False, causal=True,
                                       default_positions=True, precision="bf16",
                                       options=options)

    assert why(HyTopKOptions()) is None
    assert "folded_parts" in why(HyTopKOptions(folded_parts=False))


def test_redone_rows_go_in_fixed_multiples(monkeypatch):
    """The Triton redo always gets a row count that is a multiple of REDO_ROWS_MULTIPLE (so a
    count that changes every call compiles no new kernel), padded with a repeated row whose
    output is dropped: the rows still equal the reference's."""
    q, k, w = int_inputs(2, 96, 2, 16, seed=1)
    monkeypatch.setattr(hytopk_sm90, "REDO_ROWS_MULTIPLE", 16)
    launched = []
    real = hytopk_sm90.hk.hytopk_triton

    def spy(q_rows, *args, **kwargs):
        launched.append(q_rows.shape[1])
        return real(q_rows, *args, **kwargs)

    monkeypatch.setattr(hytopk_sm90.hk, "hytopk_triton", spy)
    (idx, val), stats = run(q, k, w, 12, 1)  # one sampled key: most rows redone
    want = hytopk(q, k, w, 12, backend="reference")
    assert torch.equal(idx, want[0]) and torch.equal(val, want[1])
    assert launched and all(n % 16 == 0 for n in launched), launched
    assert sum(launched) > stats[0] >= sum(launched) - 16 * len(launched)  # padded


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("order", ["score", "key", "any"])
def test_select_survivors_takes_each_rows_top_k(order, direct):
    """The select kernel over survivor buffers (HyTopK's radix select and row sort): rows with
    more survivors than topk (ties in score: the smaller index wins), exactly topk, fewer
    (empty slots last), none, and over the cap (wrong, the caller redoes it, but no fault):
    each row's top-k of its first count keys, in `order`, as the plain-torch select gives
    them ("any": the same set, empty slots last); with and without the direct select
    (scores_sm90_direct_select: "any" only, "score" sorts)."""
    g = torch.Generator().manual_seed(0)
    B, n, cap, topk = 2, 6, 16, 5
    scores = torch.randint(-4, 5, (B, n, cap), generator=g).float()
    index = torch.stack([torch.randperm(100, generator=g)[:cap] for _ in range(B * n)])
    keys = pack(scores, index.view(B, n, cap))
    counts = torch.tensor([[16, 5, 3, 0, 9, 16], [12, 7, 1, 5, 16, 20]], dtype=torch.int32)
    keys = torch.where(torch.arange(cap) < counts.clamp(max=cap)[..., None], keys, UNWRITTEN)
    opts = HyTopKOptions(interpret_programs=2, scores_sm90_direct_select=direct)
    idx, val = hytopk_sm90.select_survivors(keys.clone().to(DEV), counts.to(DEV), topk,
                                            order=order, options=opts)
    want_idx, want_val = torch_select(keys, counts, topk, order=order, options=opts)
    idx, val = idx.cpu(), val.cpu()
    ok = counts <= cap  # the last row overflowed
    if order == "any":
        assert_empty_last(idx)
        (idx, val), (want_idx, want_val) = by_index(idx, val), by_index(want_idx, want_val)
    assert torch.equal(idx[ok], want_idx[ok]) and torch.equal(val[ok], want_val[ok])


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("order", ["score", "key"])
def test_select_survivors_of_key_ordered_buffers(order, direct):
    """keys_in_order (the scan slots' buffers: each row's survivors by increasing index): the
    same rows as the plain-torch select in either order, order "key" without the row sort;
    rows with more survivors than topk (ties: the smaller index wins), fewer, none."""
    g = torch.Generator().manual_seed(1)
    B, n, cap, topk = 2, 5, 16, 5
    scores = torch.randint(-4, 5, (B, n, cap), generator=g).float()
    index = torch.stack([torch.randperm(100, generator=g)[:cap].sort().values
                         for _ in range(B * n)]).view(B, n, cap)
    counts = torch.tensor([[16, 5, 3, 0, 9], [12, 7, 1, 5, 16]], dtype=torch.int32)
    keys = torch.where(torch.arange(cap) < counts[..., None], pack(scores, index), UNWRITTEN)
    opts = HyTopKOptions(interpret_programs=2, scores_sm90_direct_select=direct)
    idx, val = hytopk_sm90.select_survivors(keys.clone().to(DEV), counts.to(DEV), topk,
                                            order=order, options=opts, keys_in_order=True)
    want_idx, want_val = torch_select(keys, counts, topk, order=order, options=opts)
    assert torch.equal(idx.cpu(), want_idx) and torch.equal(val.cpu(), want_val)


def test_only_the_scan_filters_buffers_skip_the_sort(monkeypatch):
    """hytopk_sm90 tells the select its buffers are in key order for its own filter with
    scores_sm90_scan_slots, which it asks for; not without the option, nor for an injected
    filter (whose order is its own). The Gluon filter stands in as the torch filter; it is
    handed the options' product-ahead and stages too."""
    from megatron_hyscale.ops.kernels import indexer_scores_sm90

    seen, scans, tunings = [], [], set()

    def spy(keys, counts, topk, *, order, options, keys_in_order=False):
        seen.append(keys_in_order)
        return torch_select(keys, counts, topk, order=order, options=options)

    def gluon_filter(*args, defer_store, scan_slots, mma_ahead, stages, **kwargs):
        assert "part_major" not in kwargs  # relu=True
        scans.append(scan_slots)
        tunings.add((mma_ahead, stages))
        return torch_filter(*args, **kwargs)

    monkeypatch.setattr(hytopk_sm90, "select_survivors", spy)
    monkeypatch.setattr(indexer_scores_sm90, "indexer_filter_sm90", gluon_filter)
    q, k, w = int_inputs(1, 40, 2, 16, seed=2)
    want = hytopk(q, k, w, 6, backend="reference", order="key")
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_scan_slots=True, interpret_programs=2)
    for scan, injected in ((True, False), (False, False), (True, True)):
        seen.clear(), scans.clear()
        got = hytopk_sm90.hytopk_sm90(
            q, k, w, 6, options=replace(opts, scores_sm90_scan_slots=scan), order="key",
            table_fn=torch_table, filter_fn=torch_filter if injected else None)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert seen and set(seen) == {scan and not injected}
        assert scans == ([] if injected else [scan] * len(scans)) and (injected or scans)
    assert tunings == {(opts.scores_sm90_mma_ahead, opts.scores_sm90_stages)}
    tunings.clear()
    hytopk_sm90.hytopk_sm90(q, k, w, 6, table_fn=torch_table, options=replace(
        opts, scores_sm90_mma_ahead=not opts.scores_sm90_mma_ahead, scores_sm90_stages=7))
    assert tunings == {(not opts.scores_sm90_mma_ahead, 7)}


def test_folded_part_major_reaches_the_filter_and_table(monkeypatch):
    """relu=False with scores_sm90_folded_part_major: hytopk_sm90 builds the folded parts
    part-major and asks the Gluon filter and sample table to read them so; without the
    option it asks neither, and the parts are (token, head)-major. Rows equal the
    reference's either way (the torch filter and table stand in for the Gluon ones)."""
    from megatron_hyscale.ops.kernels import indexer_scores_sm90

    filters, tables = [], []

    def gluon_filter(q, *args, defer_store, scan_slots, mma_ahead, stages, part_major=False,
                     **kwargs):
        filters.append((part_major, q.permute(0, 2, 1, 3).is_contiguous()))
        return torch_filter(q, *args, **kwargs)

    def gluon_table(q, *args, part_major=False, **kwargs):
        tables.append(part_major)
        return torch_table(q, *args, **kwargs)

    monkeypatch.setattr(indexer_scores_sm90, "indexer_filter_sm90", gluon_filter)
    monkeypatch.setattr(indexer_scores_sm90, "indexer_table_sm90", gluon_table)
    q, k, w = int_inputs(1, 40, 2, 16, seed=3)
    want = hytopk(q, k, w, 6, relu=False, backend="reference", order="key")
    opts = HyTopKOptions(scores_sm90=True, interpret_programs=2)
    for part_major in (True, False):
        filters.clear(), tables.clear()
        got = hytopk_sm90.hytopk_sm90(
            q, k, w, 6, relu=False, order="key", select_fn=torch_select,
            options=replace(opts, scores_sm90_folded_part_major=part_major))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert filters and set(filters) == {(part_major, part_major)}
        assert tables and set(tables) == {part_major}


def test_head_sum_transpose_reaches_the_filter_and_table(monkeypatch):
    """scores_sm90_head_sum_transpose: with ReLU hytopk_sm90 asks the Gluon filter and sample
    table for the transposed head sum; without the option, and without ReLU (the folded
    parts) whatever the option, it asks neither. Rows equal the reference's (the torch
    filter and table stand in for the Gluon ones)."""
    from megatron_hyscale.ops.kernels import indexer_scores_sm90

    asked = []

    def gluon_filter(*args, defer_store, scan_slots, mma_ahead, stages, part_major=False,
                     head_sum_transpose=False, **kwargs):
        asked.append(("filter", head_sum_transpose))
        return torch_filter(*args, **kwargs)

    def gluon_table(*args, part_major=False, head_sum_transpose=False, **kwargs):
        asked.append(("table", head_sum_transpose))
        return torch_table(*args, **kwargs)

    monkeypatch.setattr(indexer_scores_sm90, "indexer_filter_sm90", gluon_filter)
    monkeypatch.setattr(indexer_scores_sm90, "indexer_table_sm90", gluon_table)
    q, k, w = int_inputs(1, 40, 2, 16, seed=4)
    opts = HyTopKOptions(scores_sm90=True, interpret_programs=2)
    for relu, transpose in ((True, True), (True, False), (False, True)):
        asked.clear()
        want = hytopk(q, k, w, 6, relu=relu, backend="reference", order="key")
        got = hytopk_sm90.hytopk_sm90(
            q, k, w, 6, relu=relu, order="key", select_fn=torch_select,
            options=replace(opts, scores_sm90_head_sum_transpose=transpose))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert {what for what, _ in asked} == {"filter", "table"}
        assert {told for _, told in asked} == {relu and transpose}


def test_bench_path_phases_time_the_ops_own_steps(monkeypatch):
    """scripts/bench_selection.py's `default_path_phases` runs the op's own steps (the torch
    filter, table and select standing in for the Gluon ones, three row chunks, each step
    timed by a counting stand-in): every step reported, the filter once a chunk, the rows it
    redoes those the op redoes (an all-zero row over the cap among them)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_selection.py"
    spec = importlib.util.spec_from_file_location("_bench_selection_path", path)
    sel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sel)
    filtered = []

    def gluon_filter(*args, **kwargs):
        filtered.append(args[4:6])
        return torch_filter(*args, **kwargs)

    sample = hytopk_sm90.sample_thresholds
    monkeypatch.setattr(hytopk_sm90, "default_filter", lambda options, relu=True: gluon_filter)
    monkeypatch.setattr(hytopk_sm90, "sample_thresholds",
                        lambda *a, **kw: sample(*a, **{**kw, "table_fn": torch_table}))
    monkeypatch.setattr(hytopk_sm90, "select_survivors",
                        lambda keys, counts, topk, *, order, options, keys_in_order=False:
                        torch_select(keys, counts, topk, order=order, options=options))
    monkeypatch.setattr(hytopk_sm90, "CHUNK_BYTES", 8 * hytopk_sm90.survivor_cap(6) * 16)
    monkeypatch.setattr(HyTopKOptions, "DEFAULT", replace(
        HyTopKOptions.DEFAULT, scores_sm90_samples=4, scores_sm90_sample_min_rank=None,
        interpret_programs=2))
    timed = []
    monkeypatch.setattr(sel, "time_ms", lambda fn, reps, warmup: timed.append(fn()) or 1.0)
    q, k, w = int_inputs(1, 40, 2, 16, seed=6)
    q[0, 30] = 0  # every score 0: over the cap, redone
    phases = sel.default_path_phases(q, k, w, 6, 1)
    assert set(phases) == {"fold", "sample", "filter", "select", "redo", "redone_rows", "total"}
    chunks = hytopk_sm90.row_chunks(1, 40, 6)
    assert len(chunks) == 3 and filtered[:3] == chunks
    stats = torch.zeros(2, dtype=torch.int64)
    hytopk_sm90.hytopk_sm90(q, k, w, 6, options=HyTopKOptions.DEFAULT, order="key",
                            stats=stats)
    assert phases["redone_rows"] == int(stats[0]) > 0
    assert phases["redo"] == phases["filter"] == phases["total"] == 1.0
    # the op's own result among the timed calls: the reference's rows in key order
    want = hytopk(q, k, w, 6, backend="reference", order="key")
    idx, val = timed[-1]
    assert torch.equal(idx, want[0]) and torch.equal(val, want[1])


@pytest.mark.parametrize("order", ["score", "key", "any"])
def test_the_op_on_the_select_kernel(order):
    """The op with the select kernel itself (the other CPU tests use the plain-torch select):
    batch 2, rows seeing fewer keys than topk, ties, a few rows redone ("any": each row's set,
    its empty slots last)."""
    q, k, w = int_inputs(2, 24, 2, 16, seed=5)
    want = hytopk(q, k, w, 6, backend="reference", order="score" if order == "any" else order)
    (idx, val), _ = run(q, k, w, 6, 4, order=order, select_fn=None)
    if order == "any":
        assert_empty_last(idx)
        (idx, val), want = by_index(idx, val), by_index(*want)
    assert torch.equal(idx, want[0]) and torch.equal(val, want[1])


# --------------------------------------------------------------------------- GPU (Hopper)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")


def survivors(keys: torch.Tensor, counts: torch.Tensor, cap: int) -> list[torch.Tensor]:
    """Each row's written keys, sorted (the kernel writes them in its atomics' order)."""
    flat, n = keys.flatten(0, 1), counts.flatten().clamp(max=cap)
    return [flat[r, :int(n[r])].sort().values for r in range(flat.shape[0])]


def assert_gluon_filter_matches(filter_fn, q, k, w, scan_slots=False, mma_ahead=False,
                                part_major=False, open_rows=False, **kwargs):
    """The Gluon filter's counts and survivors (rows 1000 .. 1530, cap 4096, each row's 300th
    best score its threshold) equal the torch filter's on the same inputs (kwargs: k_scale,
    relu; scan_slots, mma_ahead, part_major: the Gluon filter's, the torch filter has no such
    choice). open_rows: rows 1003 and 1100 at -inf (every visible key), 1101 at +inf (none)."""
    tuning = {"part_major": True} if part_major else {}
    t_lo, t_hi, cap = 1000, 1531, 4096
    keys = scaled_keys(k, kwargs.get("k_scale"))
    scores = exact_scores(q, keys, w, kwargs.get("relu", True))[:, t_lo:t_hi]
    tau = scores.topk(300, dim=-1).values[..., -1].float().contiguous()
    if open_rows:
        tau[:, [3, 100]], tau[:, 101] = float("-inf"), float("inf")
    got = filter_fn(q, k, w, tau, t_lo, t_hi, cap, scan_slots=scan_slots,
                    mma_ahead=mma_ahead, **tuning, **kwargs)
    want = torch_filter(q, k, w, tau, t_lo, t_hi, cap, **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(got[1], want[1])
    for g, wnt in zip(survivors(got[0], got[1], cap), survivors(*want, cap), strict=True):
        assert torch.equal(g, wnt)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("defer_store, scan_slots, ahead", [
    (True, False, {}), (False, False, {}), (False, True, {}),
    (False, True, {"mma_ahead": True}), (True, False, {"mma_ahead": True, "stages": 2}),
    (False, True, {"mma_ahead": True, "stages": 7})])
@pytest.mark.parametrize("H", [64, 32])
def test_gluon_filter_matches_the_torch_filter(H, defer_store, scan_slots, ahead):
    """indexer_filter_sm90 on integer inputs, batch 2, a chunk of rows [100, 1031) off every
    block boundary: the same counts as the torch filter, and where a row's survivors fit the
    cap the same keys; rows over the cap wrote cap of their survivors. Thresholds at each row's
    40th score (ties at it included), -inf for a few rows (every visible key), +inf for one.
    Both stores (under the next tile's product, and at once), the last tile's included; slots
    by atomics or by the scan (scan_slots: each row's survivors in increasing key order, the
    first cap of them for a row over the cap); each product issued before the last one's
    epilogue (ahead: mma_ahead, with the default, the fewest and more key tiles in flight)."""
    from megatron_hyscale.ops.kernels.indexer_scores_sm90 import indexer_filter_sm90

    B, T, cap, t_lo = 2, 1031, 64, 100
    q, k, w = int_inputs(B, T, H, 128, seed=H)
    q[:, 500] = 0  # every score 0: all tie at the threshold, over the cap
    scores = exact_scores(q, k, w)[:, t_lo:]
    tau = scores.topk(40, dim=-1).values[..., -1].contiguous()
    tau[:, :3] = float("-inf")
    tau[1, 7] = float("inf")
    got = indexer_filter_sm90(q, k, w, tau, t_lo, T, cap, defer_store=defer_store,
                              scan_slots=scan_slots, **ahead)
    want = torch_filter(q, k, w, tau, t_lo, T, T)  # every survivor
    torch.cuda.synchronize()
    assert torch.equal(got[1], want[1])
    assert (got[1][:, :3] == torch.arange(t_lo + 1, t_lo + 4, device=DEV)).all()
    assert got[1][1, 7] == 0 and (got[1][:, 400] > cap).all()
    for g, wnt, n in zip(survivors(got[0], got[1], cap), survivors(*want, T),
                         got[1].flatten().tolist()):
        if n <= cap:
            assert torch.equal(g, wnt)
        else:  # cap distinct ones of the row's survivors
            assert g.numel() == cap and g.unique().numel() == cap
            assert torch.isin(g, wnt).all()
    if scan_slots:  # in key order as written: the first min(count, cap) visible survivors
        written = LOW32 - (got[0] & LOW32)
        for r, n in enumerate(got[1].flatten().tolist()):
            row = written.flatten(0, 1)[r, :min(n, cap)]
            assert bool((row[1:] > row[:-1]).all()), r
            b, t = divmod(r, T - t_lo)
            first = LOW32 - (want[0][b, t, :want[1][b, t]] & LOW32)
            first = first.sort().values[:min(n, cap)]
            assert torch.equal(row, first), r


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("scan_slots, mma_ahead, direct, transpose", [
    (False, False, False, False), (True, False, False, False), (True, True, False, False),
    (True, False, True, False), (True, True, True, True)])
@pytest.mark.parametrize("H", [64, 32])
def test_the_op_matches_the_reference_at_real_size(H, scan_slots, mma_ahead, direct,
                                                   transpose):
    """hytopk(options.scores_sm90) at T = 8192 + 5, topk 2048, batch 2, integer inputs (ties;
    rows past the cap's 4096 keys on a sampled threshold), an all-zero row past the cap
    (redone): the reference's rows bit for bit, in score and in key
    order (scan_slots: the filter's key-ordered buffers, order "key" without the row sort;
    mma_ahead: scores_sm90_mma_ahead; direct: scores_sm90_direct_select; transpose:
    scores_sm90_head_sum_transpose, in the filter and the sample table)."""
    from megatron_hyscale.ops.key_order import sort_rows_by_key

    q, k, w = int_inputs(2, 8197, H, 128, seed=H + 1)
    q[0, 6000] = 0  # every score 0, 6001 keys: all tie at the threshold, over the cap, redone
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_scan_slots=scan_slots,
                         scores_sm90_mma_ahead=mma_ahead, scores_sm90_direct_select=direct,
                         scores_sm90_head_sum_transpose=transpose)
    got = hytopk(q, k, w, 2048, options=opts)
    want = [t.contiguous() for t in hytopk(q, k, w, 2048, backend="reference")]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    hytopk_sm90.hytopk_sm90(q, k, w, 2048, options=opts, stats=stats)
    assert 0 < stats[0] < stats[1], stats
    key = hytopk(q, k, w, 2048, options=opts, order="key")
    sort_rows_by_key(*want)
    assert torch.equal(key[0], want[0]) and torch.equal(key[1], want[1])
    # the Gluon path ran (the op falls back to the Triton kernel after a failure), its table too
    assert (H, 2048, "bf16", transpose) not in hytopk_sm90.VARIANTS.disabled
    assert (H, False, transpose) not in hytopk_sm90.TABLE_VARIANTS.disabled


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("H", [64, 32])
def test_fp8_gluon_filter_and_op(H, monkeypatch):
    """e4m3 q and k (integer-valued, scales varying by key, token and batch): the Gluon
    filter's counts and survivors equal the plain-torch filter's on the same quantized
    inputs, and ops.hytopk(precision="fp8", options.scores_sm90: fp8 products, the sample on
    the Gluon table) runs the Gluon filter and gives the reference's rows at T = 4101, batch
    2 (rows past the cap's 2048 keys on a sampled threshold)."""
    from megatron_hyscale.ops import fp8_quant
    from megatron_hyscale.ops.kernels import indexer_scores_sm90

    indexer_filter_sm90 = indexer_scores_sm90.indexer_filter_sm90
    q, k, w = int_inputs(2, 4101, H, 128, seed=H + 7)
    q, k = two_scales(q, k)
    q8, q_scale, k8, k_scale = fp8_quant.quantize_indexer(q, k)
    w_eff = w * q_scale
    assert_gluon_filter_matches(indexer_filter_sm90, q8, k8, w_eff, k_scale=k_scale)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return indexer_filter_sm90(*args, **kwargs)

    monkeypatch.setattr(indexer_scores_sm90, "indexer_filter_sm90", counted)
    rows = hytopk(q, k, w, 1024, options=HyTopKOptions(scores_sm90=True), precision="fp8")
    ref = [t.contiguous() for t in hytopk(q, k, w, 1024, precision="fp8", backend="reference")]
    assert torch.equal(rows[0], ref[0]) and torch.equal(rows[1], ref[1])
    assert calls and (H, 1024, "fp8", False) not in hytopk_sm90.VARIANTS.disabled
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    hytopk_sm90.hytopk_sm90(q8, k8, w, 1024, options=HyTopKOptions(scores_sm90=True),
                            stats=stats, q_scale=q_scale, k_scale=k_scale)
    assert stats[0] <= 0.05 * stats[1], stats  # the thresholds (the fp8 table) near right


@pytest.mark.gpu
@needs_hopper
def test_folded_gluon_filter_and_op(monkeypatch):
    """relu=False (the folded query's bf16 parts, 4 "heads", 32 rows a consumer): the Gluon
    filter's counts and survivors equal the torch filter's on the same parts, and
    ops.hytopk(relu=False, options.scores_sm90=True) runs it and gives the reference's rows at
    T = 4101, batch 2 (integer inputs, a folded query of two bf16 parts; rows past the cap's
    2048 keys on a sampled threshold); random bf16 at 8K:
    the Triton kernel's rows on nearly every row."""
    from megatron_hyscale.ops.kernels import indexer_scores_sm90

    indexer_filter_sm90 = indexer_scores_sm90.indexer_filter_sm90
    q, k, w = int_inputs(2, 4101, 32, 128, seed=9)
    w = w * 101.0
    q4, w4 = hytopk_sm90.folded_parts(q, w)
    assert_gluon_filter_matches(indexer_filter_sm90, q4, k, w4, relu=False)
    assert_gluon_filter_matches(indexer_filter_sm90, q4, k, w4, relu=False, scan_slots=True)
    assert_gluon_filter_matches(indexer_filter_sm90, q4, k, w4, relu=False, scan_slots=True,
                                mma_ahead=True)
    q4p, w4p = hytopk_sm90.folded_parts(q, w, part_major=True)
    for ahead in (False, True):  # the parts part-major (scores_sm90_folded_part_major)
        assert_gluon_filter_matches(indexer_filter_sm90, q4p, k, w4p, relu=False,
                                    scan_slots=True, mma_ahead=ahead, part_major=True,
                                    open_rows=True)
    assert_gluon_filter_matches(indexer_filter_sm90, q4p, k, w4p, relu=False, part_major=True,
                                open_rows=True)  # with the slot atomics
    calls = []

    def counted(*args, **kwargs):
        calls.append((kwargs.get("relu"), kwargs.get("part_major")))
        return indexer_filter_sm90(*args, **kwargs)

    monkeypatch.setattr(indexer_scores_sm90, "indexer_filter_sm90", counted)
    opts = HyTopKOptions(scores_sm90=True)  # the parts part-major by default
    rows = hytopk(q, k, w, 1024, relu=False,
                  options=replace(opts, scores_sm90_folded_part_major=False))
    ref = [t.contiguous() for t in hytopk(q, k, w, 1024, relu=False, backend="reference")]
    assert torch.equal(rows[0], ref[0]) and torch.equal(rows[1], ref[1])
    assert calls and set(calls) == {(False, None)}
    calls.clear()
    rows = hytopk(q, k, w, 1024, relu=False, order="key", options=opts)
    ref_key = hytopk(q, k, w, 1024, relu=False, backend="reference", order="key")
    assert torch.equal(rows[0], ref_key[0]) and torch.equal(rows[1], ref_key[1])
    assert calls and set(calls) == {(False, True)}
    assert not hytopk_sm90.TABLE_VARIANTS.disabled  # both layouts' Gluon tables ran
    assert ("folded", 1024, "bf16", False) not in hytopk_sm90.VARIANTS.disabled
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8192, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, 8192, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(1, 8192, 32, device="cuda", generator=g)
    stats = torch.zeros(2, dtype=torch.int64, device="cuda")
    got = hytopk_sm90.hytopk_sm90(q, k, w, 2048, options=opts, stats=stats, relu=False)[0]
    want = hytopk(q, k, w, 2048, relu=False, backend="triton",
                  options=HyTopKOptions(scores_sm90=False))[0]
    same = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean()
    assert same >= 0.999, same
    assert stats[0] <= 0.01 * stats[1], stats


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("H", [64, 32])
def test_gluon_sample_table_gives_the_same_thresholds_and_rows(H):
    """scores_sm90_sample_table: the thresholds from the Gluon table equal the Triton table's
    on integer inputs (T = 8197, batch 2: rows past the cap's 4096 keys take them), by either
    scores_sm90_sample_pick, and the op's rows are the reference's."""
    q, k, w = int_inputs(2, 8197, H, 128, seed=H + 3)
    opts = HyTopKOptions(scores_sm90=True, scores_sm90_sample_table=False)
    gluon = replace(opts, scores_sm90_sample_table=True)
    want = hytopk_sm90.sample_thresholds(q, k, w, 2048, 512, options=opts)
    ref = [t.contiguous() for t in hytopk(q, k, w, 2048, backend="reference")]
    for pick in ("topk", "radix"):
        picked = replace(gluon, scores_sm90_sample_pick=pick)
        got = hytopk_sm90.sample_thresholds(q, k, w, 2048, 512, options=picked)
        assert torch.equal(got, want)
        rows = hytopk(q, k, w, 2048, options=picked)
        assert torch.equal(rows[0], ref[0]) and torch.equal(rows[1], ref[1])


@pytest.mark.gpu
@needs_hopper
def test_random_bf16_rows_equal_the_triton_kernels():
    """Random bf16 at 8K: the same sets as the Triton kernel's (the two score orders agree)
    on nearly every row; few rows redone."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8192, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, 8192, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(1, 8192, 64, device="cuda", generator=g)
    stats = torch.zeros(2, dtype=torch.int64, device="cuda")
    got = hytopk_sm90.hytopk_sm90(q, k, w, 2048, options=HyTopKOptions(scores_sm90=True),
                                  stats=stats)[0]
    want = hytopk(q, k, w, 2048, backend="triton")[0]
    same = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean()
    assert same >= 0.999, same
    assert stats[0] <= 0.01 * stats[1], stats


def test_a_failing_kernel_warns_once_and_runs_triton(monkeypatch):
    """A compile or launch failure of the Gluon path (simulated) is said once, its (heads,
    topk, precision, transposed head sum) variant refused afterwards, and the Triton kernel's
    rows come back each time; the transposed head sum's failure leaves the plain variant
    running."""
    from megatron_hyscale.ops import checks

    monkeypatch.setattr(checks, "_warned", set())
    monkeypatch.setattr(hytopk_sm90, "VARIANTS", hytopk_sm90.KernelVariants(
        "hytopk-scores-sm90", "HyTopK on the Gluon scores", "Triton kernel"))
    monkeypatch.setattr(hytopk_sm90, "unsupported", lambda *a, **kw: None)
    tries = []

    def failing(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(hytopk_sm90, "hytopk_sm90", failing)
    q, k, w = int_inputs(1, 40, 2, 16, seed=2)
    opts = HyTopKOptions(scores_sm90=True, interpret_programs=2)
    want = hytopk(q, k, w, 6, backend="reference")
    with pytest.warns(RuntimeWarning, match="simulated launch failure"):
        got = hytopk(q, k, w, 6, backend="triton", options=opts)
    again = hytopk(q, k, w, 6, backend="triton", options=opts)
    assert tries == [1]
    assert torch.equal(got[0], want[0]) and torch.equal(again[0], want[0])
    assert hytopk_sm90.VARIANTS.disabled == {(2, 6, "bf16", False)}
    transposed = replace(opts, scores_sm90_head_sum_transpose=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(hytopk(q, k, w, 6, backend="triton", options=transposed)[0],
                           want[0])
    assert tries == [1, 1]
    assert hytopk_sm90.VARIANTS.disabled == {(2, 6, "bf16", False), (2, 6, "bf16", True)}

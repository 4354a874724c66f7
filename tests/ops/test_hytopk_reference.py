"""HyTopK reference (and the public hytopk with backend="reference") against a straightforward
oracle: exact fp64 scores and a Python sort with key (-score, index).

Inputs are small integers or multiples of 1/4, so every score is exact in fp32 and fp64 alike:
the comparison is bit-exact, ties included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_hyscale.ops import reference
from megatron_hyscale.ops.hytopk import hytopk


def oracle(q, k, w, topk, *, relu=True, q_positions=None, k_positions=None, causal=True,
           rows=None, visible=None):
    """indices int32 [B, T', topk], scores fp32 [B, T', topk] for the given rows (default all)."""
    B, T, H, D = q.shape
    S = k.shape[1]
    rows = list(range(T)) if rows is None else rows
    logits = torch.einsum("bthd,bsd->bths", q[:, rows].double(), k.double())
    if relu:
        logits = logits.relu()
    scores = (logits * w[:, rows].double().unsqueeze(-1)).sum(2)  # [B, len(rows), S]
    qpos = torch.arange(T) + (S - T) if q_positions is None else q_positions
    kpos = torch.arange(S) if k_positions is None else k_positions
    qpos = qpos.expand(B, T) if qpos.dim() == 1 else qpos
    kpos = kpos.expand(B, S) if kpos.dim() == 1 else kpos
    out_i = torch.full((B, len(rows), topk), -1, dtype=torch.int32)
    out_s = torch.full((B, len(rows), topk), float("-inf"))
    for b in range(B):
        for r, t in enumerate(rows):
            row = scores[b, r].tolist()
            cand = [(row[s], s) for s in range(S) if not causal or kpos[b, s] <= qpos[b, t]]
            if visible is not None:  # an explicit mask [T, S] or [B or 1, T, S]
                cand = [c for c in cand if visible.expand(B, T, S)[b, t, c[1]]]
            cand.sort(key=lambda c: (-c[0], c[1]))  # -0.0 == 0.0 in Python: a tie
            for j, (sc, s) in enumerate(cand[:topk]):
                out_i[b, r, j] = s
                out_s[b, r, j] = sc
    return out_i, out_s


def both(q, k, w, topk, **kw):
    """Run the public op and the bare reference; check they agree; return the public result."""
    idx, sc = hytopk(q, k, w, topk, backend="reference", **kw)
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    qpos = kw.pop("q_positions", None)
    kpos = kw.pop("k_positions", None)
    qpos = torch.arange(T) + (S - T) if qpos is None else qpos
    kpos = torch.arange(S) if kpos is None else kpos
    kw.setdefault("relu", True)
    kw.setdefault("causal", True)
    if kw.get("visible") is not None and kw["visible"].dim() == 2:  # the op's [T, S] form
        kw["visible"] = kw["visible"].unsqueeze(0)
    idx2, sc2 = reference.hytopk_reference(
        q, k, w, topk, q_positions=qpos.expand(B, T).long(), k_positions=kpos.expand(B, S).long(),
        **kw)
    assert torch.equal(idx, idx2) and torch.equal(sc, sc2)
    return idx, sc


def check(q, k, w, topk, **kw):
    idx, sc = both(q, k, w, topk, **dict(kw))
    ref_i, ref_s = oracle(q, k, w, topk, **kw)
    assert idx.dtype == torch.int32 and sc.dtype == torch.float32
    assert idx.shape == sc.shape == (q.shape[0], q.shape[1], topk)
    assert torch.equal(idx, ref_i), (idx, ref_i)
    assert torch.equal(sc, ref_s)
    return idx, sc


def ints(*shape, lo=-3, hi=4, seed=0, div=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).float() / div


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_dyadic_inputs(relu, seed):
    B, T, S, H, D = 2, 9, 13, 3, 5
    q, k = ints(B, T, H, D, seed=seed, div=4), ints(B, S, D, seed=seed + 10, div=4)
    w = ints(B, T, H, lo=-4, hi=5, seed=seed + 20, div=4)
    check(q, k, w, 4, relu=relu)


@pytest.mark.parametrize("relu", [True, False])
def test_massive_ties(relu):
    # Values in {0, 1}: most scores collide, so the index order decides nearly everything.
    B, T, S, H, D = 2, 12, 16, 2, 2
    q, k = ints(B, T, H, D, lo=0, hi=2, seed=1), ints(B, S, D, lo=0, hi=2, seed=2)
    w = ints(B, T, H, lo=0, hi=2, seed=3)
    idx, sc = check(q, k, w, 6, relu=relu)
    assert (sc[:, :, 1:] == sc[:, :, :-1]).float().mean() > 0.5  # the case really is tie-heavy


def test_all_zero_relu_rows():
    # relu on negative logits: every score of the row is zero -> pure index order.
    q = -torch.ones(1, 4, 2, 3)
    k = torch.ones(1, 6, 3)
    w = -torch.ones(1, 4, 2)
    s = reference.indexer_scores(q, k, w, relu=True)
    assert (s == 0).all()
    idx, sc = check(q, k, w, 3, causal=False)
    assert (idx == torch.tensor([0, 1, 2], dtype=torch.int32)).all() and (sc == 0).all()


def test_negative_zero_ties_positive_zero():
    # torch's head sum happens to return +0.0, but a kernel may produce -0.0: the total order
    # must treat both zeros as equal (index order), and order everything else by value.
    s = torch.tensor([[0.5, -0.0, 0.0, -0.0, 0.0, -1.0, float("-inf"), 1e-30]])
    top = reference.order_key(s).topk(s.shape[-1], dim=-1).values
    order = (reference._LOW32 - (top & reference._LOW32)).tolist()
    assert order == [[0, 7, 1, 2, 3, 4, 5, 6]]
    want = sorted(range(8), key=lambda i: (-float(s[0, i]), i))
    assert order[0] == want
    # Through the public op (relu off, scores +-0 and negatives, massive ties on zero).
    q = torch.tensor([[1.0, 1.0], [1.0, -1.0]]).view(1, 1, 2, 2)
    k = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, -0.0], [-0.0, 1.0], [5.0, 0.0]]).view(1, 5, 2)
    idx, sc = check(q, k, -torch.ones(1, 1, 2), 5, relu=False, causal=False)
    assert idx[0, 0].tolist() == [0, 1, 2, 3, 4]  # key 4 scores -10


def test_fewer_visible_keys_than_topk_and_topk_above_s():
    B, T, S = 2, 6, 6
    q, k, w = ints(B, T, 2, 3, seed=4), ints(B, S, 3, seed=5), ints(B, T, 2, lo=1, seed=6)
    idx, sc = check(q, k, w, 4)
    assert (idx[:, 0, 1:] == -1).all() and torch.isneginf(sc[:, 0, 1:]).all()
    idx, sc = check(q, k, w, 9)  # topk > S
    assert (idx[:, :, S:] == -1).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_shape", ["per-batch", "shared"])
def test_explicit_mask(causal, mask_shape):
    # An explicit key mask (visible): random holes, one row seeing nothing, rows with fewer
    # visible keys than topk; tie-heavy {0, 1} inputs so the index order decides a lot.
    B, T, S, H, D = 2, 12, 16, 2, 2
    q, k = ints(B, T, H, D, lo=0, hi=2, seed=7), ints(B, S, D, lo=0, hi=2, seed=8)
    w = ints(B, T, H, lo=0, hi=2, seed=9)
    g = torch.Generator().manual_seed(10)
    visible = torch.rand(B if mask_shape == "per-batch" else 1, T, S, generator=g) > 0.4
    visible[:, 3] = False
    if mask_shape == "shared":
        visible = visible[0]
    idx, sc = check(q, k, w, 6, causal=causal, visible=visible)
    assert (idx[:, 3] == -1).all() and torch.isneginf(sc[:, 3]).all()
    assert ((idx >= 0).sum(-1) < 6).any() and ((idx >= 0).sum(-1) == 6).any()


def test_explicit_mask_is_checked_and_runs_on_the_reference():
    q, k, w = GOOD["q"], GOOD["k"], GOOD["weights"]
    T, S = q.shape[1], k.shape[1]
    for bad in (torch.ones(T, S), torch.ones(T, S + 1, dtype=torch.bool),
                torch.ones(3, T, S, dtype=torch.bool)):
        with pytest.raises(ValueError, match="visible"):
            hytopk(q, k, w, 2, visible=bad)
    for backend in ("triton", "cudnn"):
        with pytest.raises(ValueError, match="visible"):
            hytopk(q, k, w, 2, visible=torch.ones(T, S, dtype=torch.bool), backend=backend)
    # "best" and "auto" hand a mask to the reference: all visible = causal=False.
    for backend in ("best", "auto"):
        got = hytopk(q, k, w, 2, visible=torch.ones(T, S, dtype=torch.bool), causal=False,
                     backend=backend)
        want = hytopk(q, k, w, 2, causal=False, backend="reference")
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_zigzag_shard_positions():
    # Context-parallel rank 0 of cp = 2: query chunks 0 and 3 of 4; all S keys.
    c = 4
    S = 4 * c
    qpos = torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)])
    q, k, w = ints(2, 2 * c, 2, 3, seed=7), ints(2, S, 3, seed=8), ints(2, 2 * c, 2, seed=9)
    check(q, k, w, 5, q_positions=qpos)
    check(q, k, w, 5, q_positions=qpos.int(), k_positions=torch.arange(S, dtype=torch.int32))


def test_per_batch_positions_and_unsorted_keys():
    B, T, S = 2, 5, 8
    q, k, w = ints(B, T, 2, 3, seed=10), ints(B, S, 3, seed=11), ints(B, T, 2, seed=12)
    qpos = torch.stack([torch.arange(T) + 3, torch.arange(T) * 2])
    kpos = torch.stack([torch.randperm(S, generator=torch.Generator().manual_seed(0)),
                        torch.arange(S)])
    check(q, k, w, 3, q_positions=qpos, k_positions=kpos)


def test_causal_false():
    q, k, w = ints(1, 4, 2, 3, seed=13), ints(1, 9, 3, seed=14), ints(1, 4, 2, seed=15)
    idx, _ = check(q, k, w, 5, causal=False)
    assert (idx >= 0).all()


def test_non_contiguous_and_low_precision_inputs():
    q = ints(2, 3, 7, 4, seed=16).transpose(1, 2)  # [2, 7, 3, 4], non-contiguous
    k = ints(2, 4, 10, seed=17).transpose(1, 2)
    w = ints(2, 3, 7, seed=18).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or w.is_contiguous())
    check(q, k, w, 4)
    check(q.bfloat16(), k.bfloat16(), w, 4)  # small integers are exact in bf16


def test_chunking_does_not_change_results(monkeypatch):
    T = S = 2048
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-4, 5, (1, T, 2, 4), generator=g).float()
    k = torch.randint(-4, 5, (1, S, 4), generator=g).float()
    w = torch.randint(-2, 3, (1, T, 2), generator=g).float()
    full = hytopk(q, k, w, 16, backend="reference")
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 3 * S * 2 + 5)  # 3 rows per chunk
    small = hytopk(q, k, w, 16, backend="reference")
    assert torch.equal(full[0], small[0]) and torch.equal(full[1], small[1])
    rows = [0, 1, 2, 1023, 2046, 2047]
    ref_i, ref_s = oracle(q, k, w, 16, rows=rows)
    assert torch.equal(small[0][:, rows], ref_i) and torch.equal(small[1][:, rows], ref_s)


_SCRIPT_32K = textwrap.dedent("""
    import json, sys, torch
    from megatron_hyscale.ops import reference
    from megatron_hyscale.ops.hytopk import hytopk
    reference.CHUNK_ELEMENTS = 1 << 20
    T = 32768
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-4, 5, (1, T, 1, 2), generator=g).float()
    k = torch.randint(-4, 5, (1, T, 2), generator=g).float()
    w = torch.ones(1, T, 1)
    def status(field):  # KiB, from /proc/self/status
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    # Reset the peak-RSS mark (VmHWM) so that it measures this call, not importing torch.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    idx, sc = hytopk(q, k, w, 8, backend="reference")
    after = status("VmHWM")
    rows = [0, 5, T // 2, T - 1]
    torch.save(dict(q=q, k=k, w=w, idx=idx[:, rows], sc=sc[:, rows]), sys.argv[1])
    print(json.dumps(dict(extra_kib=after - before, rows=rows)))
""")


def test_32k_tokens_bounded_memory(tmp_path):
    # A separate process, so that its peak RSS (VmHWM, reset before the call) measures this
    # call alone. One thread: the
    # time stays a few seconds even on a busy 2-core machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "r.pt"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT_32K, str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    table_kib = 32768 * 32768 * 4 // 1024  # an fp32 [T, S] score table: 4 GiB
    assert info["extra_kib"] < table_kib // 16, info  # < 256 MiB of extra peak memory
    r = torch.load(out)
    ref_i, ref_s = oracle(r["q"], r["k"], r["w"], 8, rows=info["rows"])
    assert torch.equal(r["idx"], ref_i) and torch.equal(r["sc"], ref_s)


GOOD = dict(q=torch.zeros(1, 4, 2, 3), k=torch.zeros(1, 5, 3), weights=torch.zeros(1, 4, 2),
            topk=2)


@pytest.mark.parametrize("over,match", [
    (dict(q=torch.zeros(1, 4, 3)), "q"),
    (dict(q=torch.zeros(1, 4, 2, 3, dtype=torch.float64)), "q"),
    (dict(q=[[0.0]]), "q"),
    (dict(k=torch.zeros(1, 5, 3, 1)), "k"),
    (dict(k=torch.zeros(1, 5, 4)), "k"),
    (dict(k=torch.zeros(2, 5, 3)), "k"),
    (dict(k=torch.zeros(1, 5, 3, dtype=torch.bfloat16)), "k"),
    (dict(k=torch.zeros(1, 5, 3, dtype=torch.int32)), "k"),
    (dict(weights=torch.zeros(1, 4, 3)), "weights"),
    (dict(weights=torch.zeros(1, 4)), "weights"),
    (dict(weights=torch.zeros(1, 4, 2, dtype=torch.int64)), "weights"),
    (dict(topk=0), "topk"),
    (dict(topk=-1), "topk"),
    (dict(topk=True), "topk"),
    (dict(topk=2.0), "topk"),
    (dict(q_positions=torch.arange(3)), "q_positions"),
    (dict(q_positions=torch.zeros(2, 4, dtype=torch.int64)), "q_positions"),
    (dict(q_positions=torch.arange(4.0)), "q_positions"),
    (dict(k_positions=torch.arange(6)), "k_positions"),
    (dict(k_positions=torch.arange(5, dtype=torch.int16)), "k_positions"),
    (dict(k_positions=torch.arange(5, device="meta")), "k_positions"),
    (dict(backend="cuda"), "backend"),
])
def test_validation_errors(over, match):
    a = {**GOOD, **over}
    pos = [a.pop(n) for n in ("q", "k", "weights", "topk")]
    with pytest.raises(ValueError, match=match):
        hytopk(*pos, **a)


@pytest.mark.parametrize("name", ["q", "k", "weights"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_rejected(name, bad):
    a = dict(GOOD)
    t = a[name].clone()
    t.view(-1)[2] = bad
    a[name] = t
    with pytest.raises(ValueError, match=name):
        hytopk(a["q"], a["k"], a["weights"], 2)


def test_weights_device_mismatch_named():
    with pytest.raises(ValueError, match="weights"):
        hytopk(GOOD["q"], GOOD["k"], torch.zeros(1, 4, 2, device="meta"), 2)

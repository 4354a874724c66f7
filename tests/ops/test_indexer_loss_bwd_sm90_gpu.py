"""The warp-specialized Gluon indexer-loss backward (IndexerLossKernelOptions.bwd_sm90) on a
Hopper GPU, against the Triton backward and the fp32 reference. Run with `pytest -m gpu`.

- Exact: integer-valued q_index, k_index and weights (the logits and scores exact in fp32), a
  target of multiples of 1/64 and an lse far above every score (softmax 0: g = -pn grad coeff,
  a multiple of 1/256), so every product and sum of dq, dw and dk is exact in any order: the
  Gluon and Triton outputs equal bitwise, without and with the row KL (with_kl). The KL's
  terms pn (log max(pn, eps) - (s - lse)) are integers where pn is 0 or 1 (some rows have only
  those: their KL equal bitwise), elsewhere all positive (lse far above s): fp32 rounding of
  the sum's order. -1 slots, repeated and invisible indices (flagged in p by the select
  kernel), rows that see fewer keys than slots and one with no slot, a ragged last tile (K
  not a multiple of 64), batch 2, 32 and 64 heads, int32 / int64 indices, non-contiguous fp32
  and bf16 weights.
- The softmax path: the row pass's own lse and sum pn, random bf16 inputs; the Triton
  backward's outputs to fp32 order (and a rare bf16 rounding of G), its KL (with_kl) to 1e-5.
- Real size (T 4096, top-2048) through the default loss path, the attention op with the loss
  in its backward (`sparse_attention_indexer_loss_triton`, kl_in_bwd on: the row KL from the
  Gluon backward): the loss and the gradients against the Triton backward's and the fp32
  reference's, and no warning (the Gluon kernel ran).
- Lockstep (`bwd_lockstep`, the kernel's LOCKSTEP): the exact integer case (three waves on an
  H100 / H200, the last partial) and an odd row count (a last wave of one row), bitwise the
  unpaced Triton backward's, through the dispatch (slack 1) and the wrapper (slack 2).
- Key passes (`bwd_key_passes`, the kernel's RANGED): the exact integer case in key order
  (rows whose slots skip passes too), 2 to 5 passes, bitwise the Triton backward's; one pass
  where the caller does not say the keys increase; random bf16 inputs to fp32 order.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from megatron_hyscale.ops.indexer_loss import indexer_kl_loss
from megatron_hyscale.ops.kernels import indexer_loss as kern
from megatron_hyscale.ops.kernels.attention_indexer_loss import (
    sparse_attention_indexer_loss_triton,
)
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions

pytestmark = pytest.mark.gpu
DEV = "cuda"
# `indexer_loss_bwd` reads neither's kl_in_bwd (its with_kl says): the defaults otherwise.
SM90 = replace(IndexerLossKernelOptions.DEFAULT, bwd_sm90=True)
TRITON = replace(IndexerLossKernelOptions.DEFAULT, bwd_sm90=False)
SAME_TOL = 5e-3  # against the Triton backward: bf16 outputs, fp32 order only
KL_TOL = 1e-5  # the row KL against the Triton backward's: fp32 order only
GRAD_L2, GRAD_MAX = 1e-2, 2e-2  # against the fp32 reference (test_indexer_loss_gpu.py's)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")


@pytest.fixture
def sm90_calls(monkeypatch):
    """Counts the Gluon kernel's launches (the fast path really ran, nothing fell back), and
    which ran in lockstep."""
    from megatron_hyscale.ops.kernels import indexer_loss_bwd_sm90 as sm90

    calls = _Calls()
    real = sm90.indexer_loss_bwd_sm90

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        calls.lockstep.append(kwargs.get("lockstep", False))
        calls.key_passes.append(kwargs.get("key_passes", 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(sm90, "indexer_loss_bwd_sm90", spy)
    return calls


class _Calls(list):
    """The launches' q shapes, whether each ran in lockstep, and in how many key passes."""

    def __init__(self):
        super().__init__()
        self.lockstep = []
        self.key_passes = []


def _no_fallback_warning(record) -> None:
    msgs = [str(w.message) for w in record if "indexer-loss backward" in str(w.message)]
    assert not msgs, msgs


def _indices(B, T, S, K, g):
    """Random keys with -1 slots, repeats (the second copy of a key in a row) and keys a row
    cannot see (causal: key s > t); rows t < K see fewer keys than slots."""
    idx = torch.randint(-1, S, (B, T, K), device=DEV, generator=g)
    if K > 1:
        idx[:, :, K - 1] = idx[:, :, 1]  # a repeated index
    # Rows seeing few keys: exactly their visible ones, then -1 (or invisible keys).
    for t in range(min(T, 40)):
        n = min(t + 1, K)
        idx[:, t, :n] = torch.arange(n, device=DEV)
        idx[:, t, n:] = -1 if t % 2 else S - 1
    if T > 5:
        idx[:, 3, :] = -1  # a row with no slot
        idx[:, 5, K // 2:] = -1  # half a row empty
    return idx


def _target_flags(idx, B, T, S, g):
    """p's validity from the select kernel (0 valid, -1 not), as the loss computes it."""
    query = torch.randn(B, T, 4, 64, device=DEV, generator=g).to(torch.bfloat16)
    key = torch.randn(B, S, 1, 64, device=DEV, generator=g).to(torch.bfloat16)
    pos = torch.arange(T, device=DEV)[None].expand(B, T)
    kpos = torch.arange(S, device=DEV)[None].expand(B, S)
    return kern.attention_target(query, key, idx, pos, kpos, 0.125) >= 0


def _weights(B, T, H, dtype, g, scale=1.0, integer=False):
    """Non-contiguous [B, T, H] weights (heads strided by T)."""
    w = torch.randn(B, H, T, device=DEV, generator=g) * scale
    if integer:
        w = w.round().clamp(-2, 2)
    return w.to(dtype).transpose(1, 2)


def _run(args, options, with_kl=False, keys_ascending=False):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = kern.indexer_loss_bwd(*args, options=options, with_kl=with_kl,
                                    keys_ascending=keys_ascending)
    assert len(out) == (4 if with_kl else 3)
    return out, record


@needs_hopper
@pytest.mark.parametrize("H", [32, 64])
@pytest.mark.parametrize("idx_dtype, w_dtype", [(torch.int32, torch.float32),
                                                 (torch.int64, torch.bfloat16)])
def test_exact_on_integer_inputs(H, idx_dtype, w_dtype, sm90_calls):
    B, T, S, K = 2, 300, 300, 200
    g = torch.Generator(device=DEV).manual_seed(H)
    q = torch.randint(-2, 3, (B, T, H, 128), device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randint(-2, 3, (B, S, 128), device=DEV, generator=g).to(torch.bfloat16)
    w = _weights(B, T, H, w_dtype, g, integer=True)
    idx = _indices(B, T, S, K, g)
    valid = _target_flags(idx, B, T, S, g)
    pn = torch.randint(0, 65, (B, T, K), device=DEV, generator=g).float() / 64
    # Every third row's target 0 or 1 only: its KL terms are integers (lse - s), exact.
    pn[:, ::3] = torch.randint(0, 2, (B, (T + 2) // 3, K), device=DEV, generator=g).float()
    p = torch.where(valid, pn, -1.0)  # row 3: no slot takes part (`_indices`)
    lse = torch.full((B, T), 1e4, device=DEV)  # softmax 0 at every slot
    psum = torch.ones((B, T), device=DEV)
    args = (q, w, k, idx.to(idx_dtype), p, lse, psum, torch.tensor(1.0, device=DEV), 0.25,
            True)
    want, _ = _run(args, TRITON)
    want_kl, _ = _run(args, TRITON, with_kl=True)
    got, record = _run(args, SM90)
    got_kl, record_kl = _run(args, SM90, with_kl=True)
    _no_fallback_warning(record + record_kl)
    assert len(sm90_calls) == 2
    assert float(want[2].float().abs().max()) > 0 and float(want[1].float().abs().max()) > 0
    for out in (got, got_kl[:3], want_kl[:3]):
        for name, a, b in zip(("dq", "dw", "dk"), out, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), (name, float((a.float() - b.float()).abs().max()))
    kl, ref = got_kl[3], want_kl[3]
    assert kl.dtype == torch.float32 and kl.shape == (B, T)
    assert torch.isfinite(kl).all()
    terms_exact = ((p < 0) | (p == 0) | (p == 1)).all(-1)
    assert int(terms_exact.sum()) >= B * (T // 3) and int((~terms_exact).sum()) > 0
    assert float(ref[terms_exact].abs().max()) > 0
    assert torch.equal(kl[terms_exact], ref[terms_exact]), float(
        (kl - ref)[terms_exact].abs().max())
    assert torch.equal(kl[:, 3], torch.zeros_like(kl[:, 3]))  # the row with no slot
    assert not got[0][:, 3].any() and not got[1][:, 3].any()
    # Positive terms: the sum's order alone, a relative rounding of the row's value.
    err = ((kl - ref).abs() / ref.abs().clamp_min(1.0))[~terms_exact]
    assert float(err.max()) <= KL_TOL, float(err.max())


def _integer_case(B, T, S, K, H, seed, key_order=False, key_windows=False):
    """`indexer_loss_bwd`'s arguments on integer q / k / w with a 0-or-1 target and the softmax
    0 (lse 1e4): every product and sum exact in any order, the KL terms integers. key_order:
    each row's slots in increasing key order, -1 last (the DSA layer's order="key").
    key_windows (T > 40): the last three rows (which see every key where S <= T) take keys
    only from the last sixth of S, from the first and last sixths (none between), and from
    the middle sixth: with 3 to 5 key passes, rows without slots in the first passes, with a
    pass between two that has none, and with slots in one middle pass only."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randint(-2, 3, (B, T, H, 128), device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randint(-2, 3, (B, S, 128), device=DEV, generator=g).to(torch.bfloat16)
    w = _weights(B, T, H, torch.float32, g, integer=True)
    idx = _indices(B, T, S, K, g)
    if key_windows and T > 40:
        sixth = S // 6
        last = torch.randint(S - sixth, S, (B, K), device=DEV, generator=g)
        first = torch.randint(0, sixth, (B, K), device=DEV, generator=g)
        idx[:, T - 3] = last
        idx[:, T - 2] = torch.where(torch.arange(K, device=DEV) % 2 == 0, first, last)
        idx[:, T - 1] = torch.randint(S // 2 - sixth // 2, S // 2 + sixth // 2, (B, K),
                                      device=DEV, generator=g)
    if key_order:
        idx = torch.where(idx < 0, S + 1, idx).sort(-1).values
        idx = torch.where(idx > S, -1, idx)
    valid = _target_flags(idx, B, T, S, g)
    pn = torch.randint(0, 2, (B, T, K), device=DEV, generator=g).float()
    p = torch.where(valid, pn, -1.0)
    lse = torch.full((B, T), 1e4, device=DEV)
    psum = torch.ones((B, T), device=DEV)
    return q, w, k, idx, p, lse, psum, torch.tensor(1.0, device=DEV), 0.25, True


@needs_hopper
@pytest.mark.parametrize("T, K", [(1, 1), (3, 63), (131, 64), (265, 65), (40, 130)])
def test_edge_shapes_bitwise_on_integer_inputs(T, K, sm90_calls):
    """Row counts that leave the last pair one row short, fewer pairs than SMs (a single row
    too), a single partial key tile, exactly one tile, one tile and one key: dq and dw bit for
    bit the Triton backward's, dk too (integer inputs, the softmax 0: every sum exact), the KL
    of rows whose terms are integers too, with and without the KL."""
    args = _integer_case(1, T, T + 8, K, 32, T * 1000 + K)
    for with_kl in (False, True):
        want, _ = _run(args, TRITON, with_kl=with_kl)
        got, record = _run(args, SM90, with_kl=with_kl)
        _no_fallback_warning(record)
        names = ("dq", "dw", "dk", "kl")[:len(want)]
        for name, a, b in zip(names, got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, T, K)
    assert len(sm90_calls) == 2


def _close(a, b, tol, name):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), name
    scale = float(b.abs().max())
    assert scale > 0, name
    assert float((a - b).abs().max()) <= tol * scale, (name, float((a - b).abs().max()), scale)


@needs_hopper
@pytest.mark.parametrize("H, relu", [(32, True), (64, True), (32, False)])
def test_softmax_path_matches_the_triton_backward(H, relu, sm90_calls):
    B, T, S, K = 2, 512, 512, 320
    g = torch.Generator(device=DEV).manual_seed(7 + H)
    q = (torch.randn(B, T, H, 128, device=DEV, generator=g) * 0.3).to(torch.bfloat16)
    k = (torch.randn(B, S, 128, device=DEV, generator=g) * 0.3).to(torch.bfloat16)
    w = _weights(B, T, H, torch.float32, g, scale=H ** -0.5)
    idx = _indices(B, T, S, K, g)
    valid = _target_flags(idx, B, T, S, g)
    p = torch.where(valid, torch.rand(B, T, K, device=DEV, generator=g), -1.0)
    # p normalized in place; the row pass's own KL (its second gathered pass) beside.
    rows_kl, lse, psum = kern.indexer_loss_rows(q, w, k, idx, p, relu)
    args = (q, w, k, idx, p, lse, psum, torch.tensor(1.3, device=DEV), 0.7 / T, relu)
    want, _ = _run(args, TRITON, with_kl=True)
    got, record = _run(args, SM90, with_kl=True)
    got_no_kl, record_no_kl = _run(args, SM90)
    _no_fallback_warning(record + record_no_kl)
    assert len(sm90_calls) == 2
    assert len(got) == len(want) == 4 and len(got_no_kl) == 3
    for name, a, b in zip(("dq", "dw", "dk"), got[:3], want[:3], strict=True):
        assert a.dtype == b.dtype, name
        _close(a, b, SAME_TOL, name)
    # The KL changes none of the gradients: dq and dw bit for bit (no atomics), dk to the
    # atomics' order (two launches add in two orders).
    for name, a, b in zip(("dq", "dw"), got_no_kl[:2], got[:2], strict=True):
        assert torch.equal(a, b), name
    _close(got_no_kl[2], got[2], SAME_TOL, "dk")
    kl = got[3]
    assert kl.dtype == torch.float32 and kl.shape == (B, T)
    _close(kl, want[3], KL_TOL, "kl")
    _close(kl, rows_kl, KL_TOL, "kl against the row pass's")


def _spread_indices(B, T, S, K, g):
    """Distinct visible keys a row (one random key per stratum for rows seeing more than K
    keys; else all of them, -1 after): the DSA layer's top-k shape."""
    t = torch.arange(T, device=DEV)[:, None] + (S - T)
    n = t + 1
    j = torch.arange(K, device=DEV)[None, :]
    lo, hi = (j * n) // K, ((j + 1) * n) // K
    u = torch.rand((B, T, K), generator=g, device=DEV)
    strat = torch.minimum(lo + (u * (hi - lo)).long(), hi - 1)
    return torch.where(n >= K, strat, torch.where(j < n, j, -1)).to(torch.int32)


def _fused_loss_grads(x, idx, loss_options):
    """The default loss path: the attention op with the loss in its backward (the row pass
    without its KL pass, the KL from the indexer backward: kl_in_bwd). (loss, gradients)."""
    t = {n: v.detach().requires_grad_(v.requires_grad) for n, v in x.items()}
    reported = []
    _, _, anchor = sparse_attention_indexer_loss_triton(
        t["query"], t["key"], None, idx, x["query"].shape[-1] ** -0.5, q_index=t["q_index"],
        weights=t["weights"], k_index=t["k_index"], loss_coeff=0.1, relu=True, dv=512,
        loss_options=loss_options, on_loss=reported.append)
    grads = torch.autograd.grad(anchor, (t["q_index"], t["weights"], t["k_index"]))
    assert len(reported) == 1
    return reported[0], grads


def _reference_loss_grads(x, idx):
    """The fp32 reference's (loss, gradients) on the same (bf16-valued) inputs."""
    t = {n: v.detach().float().requires_grad_(v.requires_grad) for n, v in x.items()}
    loss = indexer_kl_loss(t["q_index"], t["weights"], t["k_index"], t["query"], t["key"], idx,
                           x["query"].shape[-1] ** -0.5, 0.1, sparse=True, relu=True,
                           backend="reference")
    return loss.detach(), torch.autograd.grad(loss, (t["q_index"], t["weights"], t["k_index"]))


@needs_hopper
@pytest.mark.parametrize("H_I, Hq", [(32, 64), (64, 128)])
def test_real_size_against_the_reference(H_I, Hq, sm90_calls):
    T, K = 4096, 2048
    g = torch.Generator(device=DEV).manual_seed(H_I)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, device=DEV) * s).to(
        torch.bfloat16)
    x = dict(q_index=r(1, T, H_I, 128, s=0.3), weights=r(1, T, H_I, s=H_I ** -0.5),
             k_index=r(1, T, 128, s=0.3), query=r(1, T, Hq, 576), key=r(1, T, 1, 576))
    for n in ("q_index", "weights", "k_index"):
        x[n].requires_grad_()
    idx = _spread_indices(1, T, T, K, g)
    assert SM90.kl_in_bwd and TRITON.kl_in_bwd and not SM90.fused_rows_bwd
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss, got = _fused_loss_grads(x, idx, SM90)
    _no_fallback_warning(record)
    assert len(sm90_calls) == 1
    want_loss, want = _fused_loss_grads(x, idx, TRITON)
    ref_loss, ref = _reference_loss_grads(x, idx)
    loss, want_loss, ref_loss = float(loss), float(want_loss), float(ref_loss)
    assert abs(loss - want_loss) <= KL_TOL * abs(want_loss), (loss, want_loss)
    assert abs(loss - ref_loss) <= 1e-3 * abs(ref_loss), (loss, ref_loss)
    for name, a, b, rb in zip(("q_index", "weights", "k_index"), got, want, ref, strict=True):
        assert a.dtype == x[name].dtype, name
        _close(a, b, SAME_TOL, name)
        a, rb = a.float(), rb.float()
        assert float((a - rb).norm() / rb.norm()) < GRAD_L2, name
        assert float((a - rb).abs().max()) <= GRAD_MAX * float(rb.abs().max()), name


@needs_hopper
@pytest.mark.parametrize("B, T, S, K, H", [(2, 300, 300, 200, 32), (1, 265, 273, 65, 64)])
def test_lockstep_bitwise_on_integer_inputs(B, T, S, K, H, sm90_calls):
    """The paced kernel (`bwd_lockstep`) only orders the work: on integer inputs (every sum
    exact) dq, dw, dk and the integer-term KL rows bit for bit the unpaced Triton backward's.
    600 rows: 300 pairs, three waves of 132 programs (H100: 132 SMs), the last partial; 265
    rows: 133 pairs, the last pair one row short, alone in its wave. Through the dispatch
    (slack 1: the option's default) and the wrapper with slack 2."""
    from megatron_hyscale.ops.kernels import indexer_loss_bwd_sm90 as sm90

    args = _integer_case(B, T, S, K, H, T * 7 + H, key_order=True)
    paced = replace(SM90, bwd_lockstep=True)
    for with_kl in (False, True):
        want, _ = _run(args, TRITON, with_kl=with_kl)
        got, record = _run(args, paced, with_kl=with_kl)
        _no_fallback_warning(record)
        slack2 = sm90.indexer_loss_bwd_sm90(*args, with_kl=with_kl, lockstep=True,
                                            lockstep_slack=2)
        assert float(want[2].float().abs().max()) > 0
        names = ("dq", "dw", "dk", "kl")[:len(want)]
        for out in (got, slack2):
            for name, a, b in zip(names, out, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (name, T, K, with_kl)
    assert sm90_calls.lockstep == [True] * 4


@needs_hopper
@pytest.mark.parametrize("B, T, S, K, H", [(2, 300, 300, 200, 32), (1, 265, 1000, 130, 64)])
@pytest.mark.parametrize("idx_dtype, w_dtype", [(torch.int64, torch.float32),
                                                 (torch.int32, torch.bfloat16)])
def test_key_passes_bitwise_on_integer_inputs(B, T, S, K, H, idx_dtype, w_dtype, sm90_calls):
    """The backward in key passes (`bwd_key_passes`) only splits the work: on integer inputs in
    key order (every sum exact) dq, dw, dk and the integer-term KL rows bit for bit the Triton
    backward's, for 2 to 5 passes (rows with no slot in a pass, in the first passes, in a pass
    between two with slots, in every pass; pass boundaries inside tiles), int32 (HyTopK's)
    and int64 indices, fp32 and bf16 weights (a row spanning passes sums dw in fp32, then
    casts), through the dispatch (keys_ascending) and the wrapper. Without keys_ascending
    the dispatch runs one pass."""
    from megatron_hyscale.ops.kernels import indexer_loss_bwd_sm90 as sm90

    q, w, k, idx, *rest = _integer_case(B, T, S, K, H, T * 11 + H, key_order=True,
                                        key_windows=True)
    args = (q, w.to(w_dtype), k, idx.to(idx_dtype), *rest)
    for with_kl in (False, True):
        want, _ = _run(args, TRITON, with_kl=with_kl)
        assert float(want[2].float().abs().max()) > 0
        if S <= T:  # the window rows see their keys: gradients from the later passes
            assert (want[0][:, T - 3:].float().abs().flatten(2).amax(-1) > 0).all()
        names = ("dq", "dw", "dk", "kl")[:len(want)]
        outs = []
        for passes in (2, 3):
            got, record = _run(args, replace(SM90, bwd_key_passes=passes), with_kl=with_kl,
                               keys_ascending=True)
            _no_fallback_warning(record)
            outs.append(got)
        outs.append(sm90.indexer_loss_bwd_sm90(*args, with_kl=with_kl, key_passes=5))
        for out in outs:
            for name, a, b in zip(names, out, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (name, T, K, with_kl)
    assert sm90_calls.key_passes == [2, 3, 5] * 2
    _run(args, replace(SM90, bwd_key_passes=4), keys_ascending=False)
    assert sm90_calls.key_passes[-1] == 1


@needs_hopper
def test_key_passes_softmax_path_matches_one_pass(sm90_calls):
    """Random bf16 inputs in key order with the softmax alive (the row pass's lse and sum pn):
    four key passes give one pass's dq, dw, dk and KL to fp32 order."""
    B, T, S, K, H = 1, 1024, 1024, 256, 32
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(B, T, H, 128, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(B, S, 128, device=DEV, generator=g).to(torch.bfloat16)
    w = _weights(B, T, H, torch.float32, g, scale=0.1)
    idx = _indices(B, T, S, K, g)
    idx = torch.where(idx < 0, S + 1, idx).sort(-1).values
    idx = torch.where(idx > S, -1, idx)
    valid = _target_flags(idx, B, T, S, g)
    pn = torch.rand(B, T, K, device=DEV, generator=g)
    p = torch.where(valid, pn, -1.0)
    # the row pass normalizes p in place
    _, lse, psum = kern.indexer_loss_rows(q, w, k, idx, p, True, SM90, with_kl=False)
    args = (q, w, k, idx, p, lse, psum, torch.tensor(1.0, device=DEV), 0.5, True)
    want, _ = _run(args, SM90, with_kl=True, keys_ascending=True)
    got, record = _run(args, replace(SM90, bwd_key_passes=4), with_kl=True,
                       keys_ascending=True)
    _no_fallback_warning(record)
    for name, a, b in zip(("dq", "dw", "dk"), got[:3], want[:3], strict=True):
        assert a.dtype == b.dtype, name
        _close(a, b, SAME_TOL, name)
    torch.testing.assert_close(got[3], want[3], rtol=KL_TOL, atol=KL_TOL)
    assert sm90_calls.key_passes == [1, 4]

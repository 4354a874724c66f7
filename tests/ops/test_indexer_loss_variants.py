"""IndexerLossKernelOptions' row-pass and backward variants against the default, under the
interpreter on CPU (also runs on CUDA).

- loss_one_pass: p's normalized values, lse and sum pn bitwise (the same sums in the same
  order), the row KL to fp32 rounding (summed in another association); so the gradients are
  bitwise too (the backward reads only p, lse and sum pn).
- fused_rows_bwd (`indexer_loss_rows_bwd`, and the attention op that calls it): KL, lse, sum pn,
  p, dq_index and dweights bitwise (every sum in the default's order); dk_index to fp32 rounding
  with atomics (bitwise under the interpreter, which runs the programs in order) and bitwise in
  the deterministic mode.
- kl_in_bwd (the row pass without its KL pass, `indexer_loss_bwd(..., with_kl=True)` sums the
  KL terms; and the attention op that runs them): KL, lse, sum pn, p, dq_index and dweights
  bitwise (the same terms in the same order at the same tile size), dk_index as fused_rows_bwd.
- bwd_lockstep (persistent programs over the rows, paced by their waves' counters): every
  per-row output bitwise, dk_index to fp32 rounding (its atomics add in another row order).
- bwd_num_warps, loss_num_warps, bwd_maxnreg: launch options only (the interpreter ignores
  them; on a GPU the reduction trees may differ): the outputs to fp32 rounding.
Inputs: ties (repeated key rows, an all-zero query row), -1 slots, rows seeing fewer keys than
slots, repeated and invisible indices, a row with no slot, batch 2, non-contiguous inputs,
ReLU on and off (off folds the weights into one fp32 query), the per-token loss.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megatron_hyscale.ops.kernels import indexer_loss as kern  # noqa: E402
from megatron_hyscale.ops.kernels.attention_indexer_loss import (  # noqa: E402
    sparse_attention_indexer_loss_triton,
)
from megatron_hyscale.ops.kernels.options import (  # noqa: E402
    AttentionKernelOptions,
    IndexerLossKernelOptions,
)
from megatron_hyscale.ops.key_order import sort_rows_by_key  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SCALE, COEFF = 0.3, 0.7
# Key tiles of 16, so rows span two tiles with a ragged tail. The baseline is the two-pass row
# pass with its own KL (the default before loss_one_pass and kl_in_bwd): the fused kernel's
# sums follow its order, and "one_pass" and "kl_in_bwd" are measured against it.
DEFAULT = replace(IndexerLossKernelOptions.DEFAULT, block_n=16, loss_one_pass=False,
                  kl_in_bwd=False)
VARIANTS = {
    "one_pass": replace(DEFAULT, loss_one_pass=True),
    "fused": replace(DEFAULT, fused_rows_bwd=True),
    "kl_in_bwd": replace(DEFAULT, kl_in_bwd=True),
    "warps8": replace(DEFAULT, bwd_num_warps=8, loss_num_warps=8),
    "maxnreg": replace(DEFAULT, bwd_num_warps=8, bwd_maxnreg=128),
    "fused_warps8": replace(DEFAULT, fused_rows_bwd=True, bwd_num_warps=8, bwd_maxnreg=128),
    # Persistent programs (3 "SMs" under the interpreter, 2 programs each: several waves, the
    # last part-full) paced by a bounded wait.
    "lockstep": replace(DEFAULT, bwd_lockstep=True),
    "lockstep2": replace(DEFAULT, bwd_lockstep=True, bwd_lockstep_slack=2,
                         bwd_lockstep_programs_per_sm=1),
}
# Rows in another order than the default's one program a row: dk_index's atomics add in
# another order (fp32 rounding); every per-row output is bitwise.
ROW_ORDER_VARIANTS = ("lockstep", "lockstep2")


def make_case(B=2, T=10, S=12, H_I=3, D_I=8, Hq=4, Dqk=24, K=20, seed=0, contiguous=True):
    """Inputs with ties and degenerate rows, indices, positions (query t at S - T + t)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)
    idx = torch.randint(-1, S, (B, T, K), generator=g)
    idx[:, :, K - 1] = idx[:, :, 2]  # repeated index: counts once
    idx[0, min(3, T - 1)] = -1  # a row with no slot
    if B > 1:
        idx[1, 0, :4] = torch.tensor([S - 1, S - 2, S - 1, 0])  # invisible to the first row
    k_index = r(B, S, D_I)
    k_index[:, 5] = k_index[:, 4]  # tied scores
    q_index = r(B, T, H_I, D_I)
    q_index[B - 1, T // 2] = 0.0  # every score of the row 0: a row of ties
    x = dict(q_index=q_index, weights=r(B, T, H_I) * 0.5, k_index=k_index,
             query=r(B, T, Hq, Dqk) * 0.7, key=r(B, S, 1, Dqk) * 0.7)
    if not contiguous:  # sbhd storage, as megatron's layers hold them
        x = {n: t.transpose(0, 1).contiguous().transpose(0, 1) for n, t in x.items()}
    x = {n: t.to(DEVICE) for n, t in x.items()}
    qpos = (torch.arange(T, device=DEVICE) + (S - T)).expand(B, T)
    kpos = torch.arange(S, device=DEVICE).expand(B, S)
    return x, idx.to(DEVICE), qpos, kpos


def index_inputs(x, relu):
    if relu:
        return x["q_index"], x["weights"]
    return kern.fold_index_query(x["q_index"], x["weights"])


def target(x, idx, qpos, kpos):
    return kern.attention_target(x["query"], x["key"], idx, qpos, kpos, SCALE)


def rows_then_bwd(q, w, k, idx, p, relu, deterministic, options):
    """The default's two launches: (kl, lse, psum, p after, dq, dw, dk)."""
    p = p.clone()
    kl, lse, psum = kern.indexer_loss_rows(q, w, k, idx, p, relu, options)
    grad = torch.tensor(1.3, device=DEVICE)
    dq, dw, dk = kern.indexer_loss_bwd(q, w, k, idx, p, lse, psum, grad, COEFF, relu,
                                       deterministic, options)
    return kl, lse, psum, p, dq, dw, dk


def assert_close(a, b, rtol=2e-5):
    # Gradients are sums of (softmax - target) terms that cancel: the absolute tolerance is
    # taken relative to the tensor's largest entry.
    atol = max(1e-7, rtol * float(b.abs().max()))
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def same(a, b, bitwise, name):
    if bitwise:
        assert torch.equal(a, b), name
    else:
        assert_close(a, b)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_one_pass_row_statistics_bitwise_kl_close(relu, contiguous):
    x, idx, qpos, kpos = make_case(contiguous=contiguous)
    q, w = index_inputs(x, relu)
    p = target(x, idx, qpos, kpos)
    ref = rows_then_bwd(q, w, x["k_index"], idx, p, relu, False, DEFAULT)
    got = rows_then_bwd(q, w, x["k_index"], idx, p, relu, False, VARIANTS["one_pass"])
    assert_close(got[0], ref[0], rtol=1e-5)
    for i, name in enumerate(("kl", "lse", "psum", "p", "dq", "dw", "dk")):
        if i:
            same(got[i], ref[i], INTERPRETED or name in ("p",), name)
    assert float(ref[0].abs().max()) > 0  # not vacuous


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_fused_rows_bwd_equals_the_two_launches(relu, deterministic, contiguous):
    x, idx, qpos, kpos = make_case(contiguous=contiguous)
    q, w = index_inputs(x, relu)
    p = target(x, idx, qpos, kpos)
    ref = rows_then_bwd(q, w, x["k_index"], idx, p, relu, deterministic, DEFAULT)
    p_fused = p.clone()
    kl, dq, dw, dk = kern.indexer_loss_rows_bwd(q, w, x["k_index"], idx, p_fused,
                                                torch.tensor(1.3, device=DEVICE), COEFF, relu,
                                                deterministic, VARIANTS["fused"])
    for got, want, name in ((kl, ref[0], "kl"), (p_fused, ref[3], "p"), (dq, ref[4], "dq"),
                            (dw, ref[5], "dw")):
        same(got, want, INTERPRETED, name)
    same(dk, ref[6], INTERPRETED or deterministic, "dk")
    assert float(dk.float().abs().max()) > 0


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_kl_from_the_backward_equals_the_row_pass(relu, deterministic, contiguous):
    x, idx, qpos, kpos = make_case(contiguous=contiguous)
    q, w = index_inputs(x, relu)
    p = target(x, idx, qpos, kpos)
    ref = rows_then_bwd(q, w, x["k_index"], idx, p, relu, deterministic, DEFAULT)
    options = VARIANTS["kl_in_bwd"]
    p_new = p.clone()
    no_kl, lse, psum = kern.indexer_loss_rows(q, w, x["k_index"], idx, p_new, relu, options,
                                              with_kl=False)
    assert no_kl is None
    dq, dw, dk, kl = kern.indexer_loss_bwd(q, w, x["k_index"], idx, p_new, lse, psum,
                                           torch.tensor(1.3, device=DEVICE), COEFF, relu,
                                           deterministic, options, with_kl=True)
    for got, want, name in ((kl, ref[0], "kl"), (lse, ref[1], "lse"), (psum, ref[2], "psum"),
                            (p_new, ref[3], "p"), (dq, ref[4], "dq"), (dw, ref[5], "dw")):
        same(got, want, INTERPRETED or name in ("lse", "psum", "p"), name)
    same(dk, ref[6], INTERPRETED or deterministic, "dk")
    assert float(ref[0].abs().max()) > 0 and float(dk.float().abs().max()) > 0


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("relu,per_token", [(True, False), (False, True)])
def test_loss_op_with_each_variant(name, relu, per_token):
    """indexer_kl_loss_triton end to end (batch 2, ties, -1 slots, repeats): loss and grads."""
    x, idx, qpos, kpos = make_case()

    def run(options):
        y = {n: t.clone().requires_grad_(n in ("q_index", "weights", "k_index"))
             for n, t in x.items()}
        loss = kern.indexer_kl_loss_triton(
            y["q_index"], y["weights"], y["k_index"], y["query"], y["key"], idx, SCALE, COEFF,
            relu=relu, q_positions=qpos, k_positions=kpos, calculate_per_token_loss=per_token,
            options=options)
        grads = torch.autograd.grad(loss, (y["q_index"], y["weights"], y["k_index"]))
        return loss.detach(), grads

    loss, grads = run(VARIANTS[name])
    ref_loss, ref_grads = run(DEFAULT)
    # one_pass sums the KL in another association; the others are the default's launches.
    same(loss, ref_loss, INTERPRETED and name != "one_pass", "loss")
    assert_close(loss, ref_loss, rtol=1e-5)
    for g, r, n in zip(grads, ref_grads, ("dq", "dw", "dk")):
        same(g, r, INTERPRETED and not (name in ROW_ORDER_VARIANTS and n == "dk"), n)


def attention_case(B=2, T=6, S=30, Hq=4, D=24, H_I=3, D_I=8, K=12, seed=0):
    """HyTopK-like indices (distinct, visible, -1 in the rest, an empty row, rows seeing fewer
    keys than slots), as the attention op requires; the index key rows 4 and 5 tied."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)
    qpos = torch.arange(T) + (S - T)
    idx = torch.full((B, T, K), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            keys = torch.randperm(int(qpos[t]) + 1, generator=g)[:K]
            idx[b, t, torch.randperm(K, generator=g)[: keys.numel()]] = keys
    idx[0, 1] = -1
    x = dict(q=r(B, T, Hq, D) * 0.7, k=r(B, S, 1, D) * 0.7, q_index=r(B, T, H_I, D_I),
             weights=r(B, T, H_I) * 0.5, k_index=r(B, S, D_I))
    x["k_index"][:, 5] = x["k_index"][:, 4]
    return {n: t.to(DEVICE) for n, t in x.items()}, idx.to(DEVICE)


ATTN = replace(AttentionKernelOptions.DEFAULT, fwd_tilings=((16, 1),), dq_tilings=((16, 1),),
               dkv_tilings=((16, 1),), narrow_dq_tilings=((16, 1),),
               narrow_dkv_tilings=((16, 1),), bwd_fused_tilings=((16, 1),))


@pytest.mark.parametrize("variant", ["fused", "kl_in_bwd", "lockstep"])
@pytest.mark.parametrize("relu,per_token,deterministic", [
    (True, False, False), (False, True, False), (True, False, True)])
def test_attention_op_loss_in_the_backward(relu, per_token, deterministic, variant):
    """The call site: the attention backward's loss rows and indexer backward fused, the KL
    from the indexer backward (kl_in_bwd), or its programs in lockstep (the rows sorted by
    key first, as the DSA layer's; deterministic runs unpaced, bitwise)."""
    x, idx = attention_case()
    if variant == "lockstep":
        sort_rows_by_key(idx)

    def run(loss_options):
        y = {n: t.clone().requires_grad_() for n, t in x.items()}
        reported = []
        out, _, anchor = sparse_attention_indexer_loss_triton(
            y["q"], y["k"], None, idx, SCALE, q_index=y["q_index"], weights=y["weights"],
            k_index=y["k_index"], loss_coeff=COEFF, relu=relu, dv=16,
            calculate_per_token_loss=per_token, deterministic=deterministic, options=ATTN,
            loss_options=loss_options, on_loss=reported.append)
        (out.sum() + anchor * 1.3).backward()
        return reported, {n: t.grad for n, t in y.items()}

    loss, grads = run(VARIANTS[variant])
    ref_loss, ref_grads = run(DEFAULT)
    assert len(loss) == len(ref_loss) == 1
    same(loss[0], ref_loss[0], INTERPRETED, "loss")
    reordered = variant in ROW_ORDER_VARIANTS and not deterministic
    for n in ("q_index", "weights", "k_index"):
        same(grads[n], ref_grads[n], (INTERPRETED and not (reordered and n == "k_index"))
             or (deterministic and n == "k_index"), n)
    for n in ("q", "k"):  # the attention's own gradients are untouched by the loss options
        same(grads[n], ref_grads[n], INTERPRETED or n == "q", n)


def test_fused_rows_bwd_all_invalid_rows():
    """Every slot -1: zero KL and zero gradients, as the default."""
    x, idx, qpos, kpos = make_case(B=1, T=3, S=8, K=4)
    idx = torch.full_like(idx, -1)
    p = target(x, idx, qpos, kpos)
    kl, dq, dw, dk = kern.indexer_loss_rows_bwd(x["q_index"], x["weights"], x["k_index"], idx,
                                                p, torch.tensor(1.0, device=DEVICE), COEFF,
                                                True, False, VARIANTS["fused"])
    for t in (kl, dq, dw, dk):
        assert not t.abs().any()


def test_backward_launch_narrow_heads_default_and_overrides():
    """Up to narrow_max_heads index heads the backward runs the narrow warps and register cap
    (measured faster for GLM-5.1's 32 heads, slower for V3.2's 64); explicit options win."""
    from megatron_hyscale.ops.kernels.indexer_loss import _bwd_launch

    base = IndexerLossKernelOptions.DEFAULT
    narrow, wide = torch.zeros(1, 4, 32, 128), torch.zeros(1, 4, 64, 128)
    const, warps = _bwd_launch(narrow, base)
    assert (warps, const["maxnreg"]) == (base.narrow_bwd_warps, base.narrow_bwd_maxnreg)
    const, warps = _bwd_launch(wide, base)
    assert warps == 4 and "maxnreg" not in const
    const, warps = _bwd_launch(narrow, replace(base, bwd_num_warps=4))
    assert warps == 4 and "maxnreg" not in const
    const, warps = _bwd_launch(narrow, replace(base, bwd_maxnreg=168))
    assert (warps, const["maxnreg"]) == (base.narrow_bwd_warps, 168)
    const, warps = _bwd_launch(narrow, replace(base, narrow_max_heads=16))
    assert warps == 4 and "maxnreg" not in const


def test_the_discard_mode_times_the_same_row_work():
    """mode=MODE_DISCARD (measurement only: the backward without dk's atomics) gives the
    default's dq_index and dweights bitwise and writes each selected key's slot of its [B, S]
    buffer (a key no row selects stays 0); the deterministic mode refuses it."""
    from megatron_hyscale.ops.kernels.common import MODE_DISCARD

    x, idx, qpos, kpos = make_case()
    q, w = index_inputs(x, True)
    p = target(x, idx, qpos, kpos)
    _, lse, psum = kern.indexer_loss_rows(q, w, x["k_index"], idx, p, True, DEFAULT)
    grad = torch.tensor(1.3, device=DEVICE)
    dq, dw, _ = kern.indexer_loss_bwd(q, w, x["k_index"], idx, p, lse, psum, grad, COEFF,
                                      True, options=DEFAULT)
    dq_d, dw_d, buf = kern.indexer_loss_bwd(q, w, x["k_index"], idx, p, lse, psum, grad, COEFF,
                                            True, options=DEFAULT, mode=MODE_DISCARD)
    assert torch.equal(dq_d, dq) and torch.equal(dw_d, dw)
    B, S = x["k_index"].shape[:2]
    assert buf.shape == (B, S) and buf.dtype == torch.float32
    selected = torch.zeros(B, S, dtype=torch.bool, device=DEVICE)
    for b in range(B):
        valid = p[b] >= 0
        selected[b, idx[b][valid].long()] = True
    assert (buf[~selected] == 0).all() and (buf[selected] != 0).any()
    with pytest.raises(ValueError, match="MODE_DISCARD"):
        kern.indexer_loss_bwd(q, w, x["k_index"], idx, p, lse, psum, grad, COEFF, True,
                              deterministic=True, options=DEFAULT, mode=MODE_DISCARD)

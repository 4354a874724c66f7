"""FlashMLA's forward feeding HyScale's backward (`AttentionKernelOptions.fwd_flashmla`, the
"flashmla_forward" attention plan), on CPU under the interpreter with a stand-in for FlashMLA.

The stand-in keeps FlashMLA's contract (flattened rows, query heads padded to 64, flat key ids
with a per-row length, the sink in the denominator but not in the returned lse, garbage in a
row without slots) and computes with the fp32 reference, so what is tested is HyScale's glue:
the layouts in, the lse and out back, the empty-row fix, and HyScale's backward on them, which
must give the gradients of HyScale's own pair. The plan's choice (`measured.attention_plan`,
`dispatch.attention_plan`) is tested on tables written here. The real kernel:
tests/ops/test_library_backends_gpu.py.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megatron_hyscale.ops import reference  # noqa: E402
from megatron_hyscale.ops.backends import dispatch, library_attention, measured  # noqa: E402
from megatron_hyscale.ops.kernels.options import AttentionKernelOptions  # noqa: E402
from megatron_hyscale.ops.kernels.sparse_attention import sparse_attention_triton  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a stand-in for FlashMLA on CPU; on CUDA the real one")

SCALE = 0.3
TILES = dict(fwd_tilings=((16, 1),), dq_tilings=((16, 1),), dkv_tilings=((16, 1),),
             narrow_dq_tilings=((16, 1),), narrow_dkv_tilings=((16, 1),),
             bwd_fused_tilings=((16, 1),))
OWN = replace(AttentionKernelOptions.DEFAULT, **TILES)
VIA_FLASHMLA = replace(OWN, fwd_flashmla=True)


def stand_in(calls):
    """FlashMLA's flash_mla_sparse_fwd contract, computed by the fp32 reference."""
    def sparse_fwd(q, kv, ids, scale, *, d_v, attn_sink, topk_length):
        calls.append(dict(q=tuple(q.shape), ids=tuple(ids.shape), contiguous=q.is_contiguous()))
        slot = torch.arange(ids.shape[-1])
        rows = torch.where(slot < topk_length[:, None].long(), ids[:, 0].long(), -1)
        out, lse = reference.sparse_attention_reference(q[None].float(), kv[None, :, :, :].float(),
                                                        None, rows[None], scale, dv=d_v)
        out, lse = out[0], lse[0]
        with_sink = torch.logaddexp(lse, attn_sink)
        out = out * torch.exp(lse - with_sink).nan_to_num(0.0)[..., None]
        empty = topk_length == 0  # FlashMLA's rows without slots: not the contract's values
        out[empty], lse[empty] = float("nan"), float("inf")
        return out.to(q.dtype), lse.clone(), lse
    return sparse_fwd


@pytest.fixture
def flashmla(monkeypatch):
    """The stand-in in place of FlashMLA (value width that of the cases); returns its calls."""
    calls = []
    monkeypatch.setattr(library_attention, "flash_mla_sparse_fwd", lambda: stand_in(calls))
    monkeypatch.setattr(library_attention, "flashmla_forward_unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(library_attention, "VALUE_CHANNELS", 16)
    return calls


def case(B=2, T=6, S=20, Hq=4, D=24, K=8, sink=False, valid_first=False, seed=0):
    """Absorbed MLA in small (V = K's first 16 of 24 channels) or, with a sink, K = V of 16:
    rows of distinct visible keys; unless valid_first, -1 slots among the valid ones and row
    (1, 2) without any (what FlashMLA's layout and empty-row handling must mend)."""
    g = torch.Generator().manual_seed(seed)
    D = 16 if sink else D
    idx = torch.full((B, T, K), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            keys = torch.randperm(S - T + t + 1, generator=g)[:K]
            if valid_first:
                idx[b, t, :keys.numel()] = keys
            else:
                idx[b, t, torch.randperm(K, generator=g)[:keys.numel()]] = keys
    if not valid_first:
        idx[1, 2] = -1
        idx[0, 0, 0] = -1  # a -1 before valid slots
    x = dict(q=torch.randn(B, T, Hq, D, generator=g), k=torch.randn(B, S, 1, D, generator=g))
    if sink:
        x["sink"] = torch.randn(Hq, generator=g)
    return x, idx, (None if sink else 16)


def run(x, idx, dv, options, **kw):
    y = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    out, lse = sparse_attention_triton(y["q"], y["k"], None, idx, SCALE, dv=dv,
                                       sink=y.get("sink"), return_lse=True, options=options,
                                       **kw)
    g = torch.Generator().manual_seed(7)
    ((out * torch.randn(out.shape, generator=g)).sum() + lse.nan_to_num(0, 0, 0).sum()).backward()
    return out.detach(), lse.detach(), {n: t.grad for n, t in y.items()}


@pytest.mark.parametrize("sink,valid_first,Hq", [(False, False, 4), (True, False, 4),
                                                 (False, True, 64), (True, True, 2)])
def test_flashmla_forward_gives_hyscales_values_and_gradients(flashmla, sink, valid_first, Hq):
    x, idx, dv = case(sink=sink, valid_first=valid_first, Hq=Hq, seed=Hq + 2 * sink)
    want = run(x, idx, dv, OWN)
    got = run(x, idx, dv, VIA_FLASHMLA, hytopk_layout=valid_first)
    assert len(flashmla) == 1
    assert flashmla[0]["q"] == (2 * 6, 64, x["q"].shape[-1]) and flashmla[0]["contiguous"]
    assert flashmla[0]["ids"][-1] == library_attention.TOPK_ALIGNMENT
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5)
    if not valid_first:  # the row without slots: the contract's zeros and -inf
        assert torch.equal(got[0][1, 2], torch.zeros_like(got[0][1, 2]))
        want_lse = x["sink"] if sink else torch.full((Hq,), float("-inf"))
        torch.testing.assert_close(got[1][1, 2], want_lse)
        assert torch.equal(got[2]["q"][1, 2], torch.zeros_like(got[2]["q"][1, 2]))


def test_fwd_flashmla_that_cannot_run_warns_once_and_runs_hyscales_forward():
    from megatron_hyscale.ops import checks

    checks._warned.discard("fwd-flashmla: flashmla runs on CUDA tensors only (got cpu)")
    x, idx, dv = case()
    want = run(x, idx, dv, OWN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [run(x, idx, dv, VIA_FLASHMLA) for _ in range(2)]
    msgs = [str(c.message) for c in caught if "fwd_flashmla" in str(c.message)]
    assert len(msgs) == 1 and "CUDA" in msgs[0], msgs
    for g in got:
        assert torch.equal(g[0], want[0]) and torch.equal(g[1], want[1])


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Writes a measured table of attention entries: (shape, T, own fwd, own bwd, lib fwd,
    lib bwd)."""
    def write(*rows):
        entries = [dict(op="attention", shape=s, T=T, own_ms=of + ob, library_ms=lf + lb,
                        own_fwd_bwd_ms=[of, ob], library_fwd_bwd_ms=[lf, lb], source="test")
                   for s, T, of, ob, lf, lb in rows]
        path = tmp_path / "table.json"
        path.write_text(json.dumps({"entries": entries}))
        monkeypatch.setattr(measured, "TABLE_PATH", path)
        measured._entries.cache_clear()
    yield write
    measured._entries.cache_clear()


def test_the_plan_is_the_fastest_allowed_pair_at_the_nearest_length(table):
    table(("A", 16384, 8.0, 37.0, 8.0, 30.0), ("A", 131072, 85.0, 359.0, 83.0, 492.0),
          ("B", 65536, 70.0, 300.0, 70.0, 300.0), ("C", 65536, 60.0, 400.0, 70.0, 300.0))
    plan = lambda shape, T, *allowed: measured.attention_plan(  # noqa: E731
        shape, T, allowed or tuple(measured.PLAN_NAMES))[0]
    assert plan("A", 8192) == measured.LIBRARY_PAIR  # cuDNN's backward faster at 16K
    assert plan("A", 1 << 20) == measured.FLASHMLA_FORWARD  # FlashMLA's forward, own backward
    assert plan("A", 1 << 20, measured.OWN_PAIR) == measured.OWN_PAIR
    # The pair not allowed (an indexer target to emit), equal forwards: HyScale's kept.
    assert plan("A", 8192, measured.OWN_PAIR, measured.FLASHMLA_FORWARD) == measured.OWN_PAIR
    assert plan("A", 1 << 20, measured.OWN_PAIR, measured.FLASHMLA_FORWARD) == \
        measured.FLASHMLA_FORWARD
    assert plan("B", 65536) == measured.OWN_PAIR  # equal times keep HyScale's kernels
    assert plan("C", 65536) == measured.LIBRARY_PAIR  # 370 against 460 own, 370 + 30 mixed
    got, why = measured.attention_plan("D", 65536)
    assert got == measured.OWN_PAIR and "never measured" in why
    with pytest.raises(ValueError, match="allowed"):
        measured.attention_plan("A", 8192, (measured.LIBRARY_PAIR,))


def _inputs(H=64, D=576, T=8):
    return (torch.zeros(1, T, H, D, dtype=torch.bfloat16),
            torch.zeros(1, T, 1, D, dtype=torch.bfloat16), torch.zeros(1, T, 4, dtype=torch.int32))


@pytest.fixture
def libraries_run(monkeypatch):
    """Both libraries installed and able to run every call (stood in)."""
    monkeypatch.setattr(dispatch, "library_unavailable", lambda *a, **kw: None)
    monkeypatch.setattr(library_attention, "flashmla_forward_unsupported", lambda *a, **kw: None)
    monkeypatch.setattr(library_attention, "library_unavailable", lambda *a, **kw: None)


def test_dispatch_takes_the_measured_plan_and_what_can_run(table, libraries_run):
    from megatron_hyscale.ops import checks

    table((measured.attention_shape(64, 576, 512, False), 131072, 85.0, 359.0, 83.0, 492.0))
    q, k, idx = _inputs()
    ask = lambda **kw: dispatch.attention_plan(  # noqa: E731
        q, k, None, idx, dv=512, sink=None, prefix_lengths=None,
        **{"backend": "best", "deterministic": False, **kw})
    assert ask() == measured.FLASHMLA_FORWARD
    assert ask(backend="auto") == ask(backend="triton") == measured.OWN_PAIR
    assert ask(backend="cudnn") == measured.LIBRARY_PAIR
    checks._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # No deterministic cuDNN backward: FlashMLA's forward with HyScale's backward.
        assert ask(backend="cudnn", deterministic=True) == measured.FLASHMLA_FORWARD
        assert ask(backend="cudnn", library_backward=False) == measured.FLASHMLA_FORWARD
    msgs = [str(c.message) for c in caught]
    assert len(msgs) == 2 and "deterministic" in msgs[0] and "target" in msgs[1], msgs
    table((measured.attention_shape(64, 576, 512, False), 131072, 85.0, 600.0, 83.0, 492.0))
    assert ask() == measured.LIBRARY_PAIR
    assert ask(library_backward=False) == measured.FLASHMLA_FORWARD
    assert not dispatch.attention_uses_library(q, k, None, idx, backend="best", dv=512,
                                               sink=None, deterministic=True,
                                               prefix_lengths=None)


def test_the_attention_indexer_loss_op_runs_flashmlas_forward_where_best(flashmla, table,
                                                                         monkeypatch):
    """backend="best" with a table that favours FlashMLA's forward: the fused op's forward is
    the stand-in's, its backward (and loss) HyScale's, the results those of backend="auto"."""
    from megatron_hyscale.ops import sparse_attention_indexer_loss

    monkeypatch.setattr(dispatch, "library_unavailable", lambda *a, **kw: None)
    x, idx, dv = case(valid_first=True, seed=3)
    table((measured.attention_shape(4, 24, 16, False), 6, 10.0, 50.0, 5.0, 80.0))
    g = torch.Generator().manual_seed(4)
    index = dict(q_index=torch.randn(2, 6, 3, 8, generator=g),
                 weights=torch.randn(2, 6, 3, generator=g),
                 k_index=torch.randn(2, 20, 8, generator=g))

    def fused(backend):
        y = {n: t.detach().clone().requires_grad_() for n, t in {**x, **index}.items()}
        losses = []
        out, _, anchor = sparse_attention_indexer_loss(
            y["q"], y["k"], None, idx.to(torch.int32), SCALE, q_index=y["q_index"],
            weights=y["weights"], k_index=y["k_index"], loss_coeff=0.5, dv=dv,
            options=OWN, on_loss=losses.append, backend=backend, hytopk_layout=True)
        (out.float().sum() + anchor).backward()
        return out.detach(), losses, {n: t.grad for n, t in y.items()}

    want = fused("auto")
    assert flashmla == []
    got = fused("best")
    assert len(flashmla) == 1
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1][0], want[1][0], rtol=1e-5, atol=1e-7)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5)

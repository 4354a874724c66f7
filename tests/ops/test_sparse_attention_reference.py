"""sparse_attention (reference backend) against an independent dense formulation and against
megatron-core 0.19.2's unfused DSA attention (absorbed MLA and explicit-value forms)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_hyscale.ops import reference
from megatron_hyscale.ops.sparse_attention import sparse_attention

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.experimental_attention_variant import dsa as mdsa


def dense_oracle(q, k, v, indices, scale, dv=None, sink=None):
    """fp64 masked softmax over a full [T, S] table built from the indices (tiny sizes only)."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if indices.dim() == 3:
        indices = indices.unsqueeze(2).expand(B, T, Hkv, indices.shape[-1])
    value = v if v is not None else k[..., : (D if dv is None else dv)]
    mask = torch.zeros(B, T, Hkv, S, dtype=torch.bool)
    for b, t, h, j in torch.nonzero(indices >= 0).tolist():
        mask[b, t, h, indices[b, t, h, j]] = True
    mask = mask.repeat_interleave(G, dim=2)  # query head h reads KV head h // G
    kk = k.double().repeat_interleave(G, dim=2)
    vv = value.double().repeat_interleave(G, dim=2)
    logits = torch.einsum("bthd,bshd->bths", q.double(), kk) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    if sink is not None:
        logits = torch.cat([logits, sink.double().view(1, 1, Hq, 1).expand(B, T, Hq, 1)], -1)
        mask = torch.cat([mask, torch.ones(B, T, Hq, 1, dtype=torch.bool)], -1)
    nonempty = mask.any(-1, keepdim=True)
    safe = torch.where(nonempty, logits, torch.zeros_like(logits))
    p = torch.softmax(safe, -1) * nonempty
    lse = torch.where(nonempty.squeeze(-1), torch.logsumexp(safe, -1), float("-inf"))
    out = torch.einsum("bths,bshd->bthd", p[..., :S], vv)
    return out.to(q.dtype), lse.float()


def random_indices(B, T, S, K, *, heads=None, causal=False, seed=0, drop=0.2):
    """Distinct per row, -1 slots sprinkled in (and past the visible keys when causal)."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, K) if heads is None else (B, T, heads, K)
    r = torch.rand(*shape[:-1], S, generator=g)
    if causal:  # query t (of T = S) sees keys 0..t
        r = r.masked_fill(torch.arange(S) > torch.arange(T).view(T, *([1] * (r.dim() - 3)), 1),
                          float("-inf"))
    val, idx = r.topk(min(K, S), dim=-1)
    idx = idx.masked_fill(val == float("-inf"), -1)
    idx = idx.masked_fill(torch.rand(idx.shape, generator=g) < drop, -1)
    return idx


def make(B, T, S, Hq, Hkv, D, Dv=None, seed=0, sink=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).requires_grad_()
    k = torch.randn(B, S, Hkv, D, generator=g).requires_grad_()
    v = None if Dv is None else torch.randn(B, S, Hkv, Dv, generator=g).requires_grad_()
    s = (torch.randn(Hq, generator=g) * 2).requires_grad_() if sink else None
    return q, k, v, s


def grads_of(out, lse, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g)
    w_lse = torch.randn(lse.shape, generator=g)
    live = [x for x in inputs if x is not None]
    # lse of an empty row is -inf: leave it out of the objective.
    obj = (out.float() * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0) * w_lse).sum()
    return torch.autograd.grad(obj, live)


def close(a, b, rtol=1e-5):
    atol = rtol * max(1.0, float(b.detach().abs().max())) if b.numel() else rtol
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


CASES = {
    # name: (B, T, S, Hq, Hkv, D, Dv (None: V=None), dv, per-KV-head indices, sink)
    "mha_v": (2, 7, 11, 3, 3, 8, 5, None, False, False),
    "mqa_absorbed_dv": (2, 9, 13, 4, 1, 24, None, 16, False, False),
    "mqa_kv_shared": (1, 8, 10, 4, 1, 12, None, None, False, True),
    "gqa_per_head_indices": (2, 6, 12, 6, 2, 8, 6, None, True, False),
    "gqa_sink": (2, 6, 12, 6, 2, 8, 6, None, True, True),
    "gqa_v_none_sink": (1, 5, 9, 6, 3, 10, None, 4, True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_oracle(case):
    B, T, S, Hq, Hkv, D, Dv, dv, per_head, with_sink = CASES[case]
    q, k, v, sink = make(B, T, S, Hq, Hkv, D, Dv, seed=len(case), sink=with_sink)
    idx = random_indices(B, T, S, 5, heads=Hkv if per_head else None, seed=len(case))
    idx[0, 0] = -1  # a query with no valid index
    scale = D ** -0.5
    out, lse = sparse_attention(q, k, v, idx, scale, dv=dv, sink=sink, return_lse=True,
                                backend="reference")
    ref_out, ref_lse = dense_oracle(q, k, v, idx, scale, dv=dv, sink=sink)
    Dv_expect = Dv if Dv is not None else (dv or D)
    assert out.shape == (B, T, Hq, Dv_expect) and out.dtype == q.dtype
    assert lse.shape == (B, T, Hq) and lse.dtype == torch.float32
    close(out, ref_out)
    close(lse, ref_lse)
    if not with_sink:
        assert (out[0, 0] == 0).all() and torch.isneginf(lse[0, 0]).all()
    inputs = (q, k, v, sink)
    for g, rg in zip(grads_of(out, lse, inputs), grads_of(ref_out, ref_lse, inputs)):
        assert torch.isfinite(g).all()
        close(g, rg)


def test_empty_rows_give_zero_output_and_zero_grads():
    q, k, v, _ = make(1, 4, 6, 2, 1, 8, 8)
    idx = torch.full((1, 4, 3), -1)
    idx[0, 2] = torch.tensor([0, 5, -1])
    out, lse = sparse_attention(q, k, v, idx, 0.3, return_lse=True, backend="reference")
    assert (out[0, [0, 1, 3]] == 0).all() and torch.isneginf(lse[0, [0, 1, 3]]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[0, [0, 1, 3]] == 0).all() and q.grad[0, 2].abs().max() > 0
    assert (k.grad[0, 1:5] == 0).all() and k.grad[0, 0].abs().max() > 0


def test_sink_only_row_has_zero_output_finite_lse_and_sink_grad():
    q, k, v, sink = make(1, 2, 4, 2, 1, 4, 4, sink=True)
    idx = torch.tensor([[[-1, -1], [1, 2]]])
    out, lse = sparse_attention(q, k, v, idx, 0.5, sink=sink, return_lse=True)
    assert (out[0, 0] == 0).all()
    torch.testing.assert_close(lse[0, 0], sink.detach())  # the sink alone is the denominator
    (out.sum() + lse.sum()).backward()
    assert torch.isfinite(sink.grad).all() and sink.grad.abs().min() > 0


def test_int32_and_int64_indices_agree_and_slot_order_is_irrelevant():
    q, k, v, _ = make(2, 5, 9, 4, 1, 8, 8, seed=3)
    idx = random_indices(2, 5, 9, 4, seed=3)
    a = sparse_attention(q, k, v, idx.int(), 0.4)
    b = sparse_attention(q, k, v, idx.flip(-1), 0.4)
    close(a, b)


def test_chunking_and_non_contiguous_inputs(monkeypatch):
    q, k, v, sink = make(2, 12, 10, 4, 2, 8, 6, seed=4, sink=True)
    idx = random_indices(2, 12, 10, 5, heads=2, seed=4)
    full = sparse_attention(q, k, v, idx, 0.3, sink=sink, return_lse=True)
    g_full = grads_of(*full, (q, k, v, sink))
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 1)  # one row per chunk
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    kt = k.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not qt.is_contiguous() and not kt.is_contiguous()
    small = sparse_attention(qt, kt, v, idx.transpose(1, 2).contiguous().transpose(1, 2), 0.3,
                             sink=sink, return_lse=True)
    g_small = grads_of(*small, (qt, kt, v, sink))
    close(small[0], full[0])
    close(small[1], full[1])
    for a, b in zip(g_small, g_full):
        close(a, b)


def test_bf16_output_dtype_and_fp32_math():
    q, k, v, _ = make(1, 6, 8, 4, 1, 16, None)
    idx = random_indices(1, 6, 8, 4, seed=5)
    qb, kb = q.detach().bfloat16(), k.detach().bfloat16()
    out, lse = sparse_attention(qb, kb, None, idx, 0.25, dv=8, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, _ = dense_oracle(qb.float(), kb.float(), None, idx, 0.25, dv=8)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def _sbhd(x):
    return x.transpose(0, 1)


@pytest.mark.parametrize("B,T,Hq,Dqk,dv,K", [(2, 24, 4, 24, 16, 6), (1, 40, 8, 20, 12, 16)])
def test_matches_megatron_absorbed_mla(B, T, Hq, Dqk, dv, K):
    # DSA absorbed form (576 = 512 latent + 64 rope, scaled down): MQA, V = K[..., :dv].
    q, k, _, _ = make(B, T, T, Hq, 1, Dqk, seed=T)
    idx = random_indices(B, T, T, K, causal=True, seed=T)
    assert (idx == -1).any()
    scale = Dqk ** -0.5
    ours = sparse_attention(q, k, None, idx, scale, dv=dv, backend="reference")
    theirs = mdsa._unfused_absorbed_dsa_fn(
        _sbhd(q), _sbhd(k), idx, scale, dv, varlen_starts=torch.zeros(T, dtype=torch.int64),
        varlen_ends=torch.arange(1, T + 1))
    close(ours, _sbhd(theirs))
    for a, b in zip(grads_of(ours, torch.zeros(B, T, Hq), (q, k)),
                    grads_of(_sbhd(theirs), torch.zeros(B, T, Hq), (q, k))):
        close(a, b)


@pytest.mark.parametrize("Hkv", [1, 3])
def test_matches_megatron_unfused_dsa(Hkv):
    B, T, Hq, D, Dv = 2, 20, 3, 8, 6
    q, k, v, _ = make(B, T, T, Hq, Hkv, D, Dv, seed=Hkv)
    idx = random_indices(B, T, T, 7, causal=True, seed=Hkv)
    ours = sparse_attention(q, k, v, idx, 0.35, backend="reference")
    theirs = mdsa.unfused_dsa_fn(_sbhd(q), _sbhd(k), _sbhd(v), idx, 0.35,
                                 varlen_starts=torch.zeros(T, dtype=torch.int64),
                                 varlen_ends=torch.arange(1, T + 1))
    theirs = _sbhd(theirs.view(T, B, Hq, Dv))
    close(ours, theirs)
    for a, b in zip(grads_of(ours, torch.zeros(B, T, Hq), (q, k, v)),
                    grads_of(theirs, torch.zeros(B, T, Hq), (q, k, v))):
        close(a, b)


def test_32k_tokens_on_cpu():
    # DeepSeek-V4-like shared KV at 32K tokens: memory is bounded by the chunked gather.
    B, T, Hq, D, K = 1, 32768, 2, 8, 16
    q, k, _, sink = make(B, T, T, Hq, 1, D, sink=True, seed=7)
    idx = torch.arange(T)[:, None] - torch.arange(K) * 37  # distinct, causal, sliding back
    idx = idx.masked_fill(idx < 0, -1).unsqueeze(0)
    out, lse = sparse_attention(q, k, None, idx, D ** -0.5, sink=sink, return_lse=True)
    (out.sum() + lse.sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    rows = torch.tensor([0, 1, 777, T - 1])
    ref, ref_lse = dense_oracle(q[:, rows], k, None, idx[:, rows], D ** -0.5, sink=sink)
    close(out[:, rows], ref)
    close(lse[:, rows], ref_lse)


ARGS = dict(
    q=torch.zeros(1, 3, 4, 8), k=torch.zeros(1, 5, 2, 8), v=torch.zeros(1, 5, 2, 6),
    indices=torch.tensor([[[0, 1], [2, -1], [0, 4]]]), softmax_scale=0.5,  # distinct per row
)


@pytest.mark.parametrize("over,match", [
    (dict(q=torch.zeros(1, 3, 4)), "q"),
    (dict(q=torch.zeros(1, 3, 4, 8, dtype=torch.float64)), "q"),
    (dict(k=torch.zeros(1, 5, 2, 7)), "k"),
    (dict(k=torch.zeros(2, 5, 2, 8)), "k"),
    (dict(k=torch.zeros(1, 5, 3, 8)), "k"),
    (dict(k=torch.zeros(1, 0, 2, 8)), "k"),
    (dict(k=torch.zeros(1, 5, 2, 8, dtype=torch.bfloat16)), "k"),
    (dict(v=torch.zeros(1, 4, 2, 6)), "v"),
    (dict(v=torch.zeros(1, 5, 2, 6, dtype=torch.float16)), "v"),
    (dict(dv=4), "dv"),
    (dict(v=None, dv=9), "dv"),
    (dict(v=None, dv=0), "dv"),
    (dict(v=None, dv=True), "dv"),
    (dict(indices=torch.zeros(1, 3, 2)), "indices"),
    (dict(indices=torch.zeros(1, 3, 2, dtype=torch.int16)), "indices"),
    (dict(indices=torch.zeros(1, 4, 2, dtype=torch.int64)), "indices"),
    (dict(indices=torch.zeros(1, 3, 3, 2, dtype=torch.int64)), "indices"),
    (dict(indices=torch.full((1, 3, 2), 5)), "indices"),
    (dict(indices=torch.full((1, 3, 2), -2)), "indices"),
    (dict(indices=torch.zeros(1, 3, 2, dtype=torch.int64, device="meta")), "indices"),
    (dict(softmax_scale=0.0), "softmax_scale"),
    (dict(softmax_scale=-1.0), "softmax_scale"),
    (dict(softmax_scale=float("inf")), "softmax_scale"),
    (dict(softmax_scale=True), "softmax_scale"),
    (dict(sink=torch.zeros(3)), "sink"),
    (dict(sink=torch.zeros(4, dtype=torch.int32)), "sink"),
    (dict(backend="cuda"), "backend"),
    (dict(prefix_lengths=torch.zeros(1, 3, dtype=torch.float32)), "prefix_lengths"),
    (dict(prefix_lengths=torch.zeros(1, 4, dtype=torch.int64)), "prefix_lengths"),
    (dict(prefix_lengths=torch.full((1, 3), 6)), "prefix_lengths"),
    (dict(prefix_lengths=torch.full((1, 3), -1)), "prefix_lengths"),
    (dict(prefix_lengths=torch.full((1, 3), 1)), "prefix"),  # index 0 listed again
])
def test_validation_errors(over, match):
    a = {**ARGS, **over}
    kw = {n: a.pop(n) for n in ("dv", "sink", "backend", "prefix_lengths") if n in a}
    with pytest.raises(ValueError, match=match):
        sparse_attention(*a.values(), **kw)


@pytest.mark.parametrize("name", ["q", "k", "v", "sink"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_rejected(name, bad):
    a = {**ARGS, "sink": torch.zeros(4)}
    t = a[name].clone()
    t.view(-1)[1] = bad
    a[name] = t
    sink = a.pop("sink")
    with pytest.raises(ValueError, match=name):
        sparse_attention(*a.values(), sink=sink)


def test_auto_on_cpu_is_the_reference():
    out = sparse_attention(*ARGS.values(), backend="auto")
    torch.testing.assert_close(out, sparse_attention(*ARGS.values(), backend="reference"))


@pytest.mark.parametrize("per_head", [False, True])
def test_dense_prefix_equals_explicit_indices(per_head, monkeypatch):
    """prefix_lengths n: keys 0 .. n - 1 before the listed indices, as if listed (tiny chunks,
    so the prefix is expanded chunk by chunk); values, lse and gradients."""
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 64)
    B, T, S, Hq, Hkv, D, split, NK = 2, 7, 30, 4, 2, 8, 12, 5
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, Hq, D, generator=g, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, generator=g, requires_grad=True)
    n = torch.randint(0, split + 1, (B, T), generator=g)
    n[0, 0] = 0
    shape = (B, T, Hkv, NK) if per_head else (B, T, NK)
    idx = split + torch.stack([torch.randperm(S - split, generator=g)[:NK]
                               for _ in range(math.prod(shape[:-1]))]).view(shape)
    idx[0, 0] = -1
    slots = torch.arange(split)
    pre = torch.where(slots < n[..., None], slots, -1)
    if per_head:
        pre = pre[:, :, None].expand(B, T, Hkv, split)
    full = torch.cat([pre, idx], dim=-1)
    out, lse = sparse_attention(q, k, None, idx, 0.3, return_lse=True, prefix_lengths=n)
    ref, ref_lse = dense_oracle(q.detach(), k.detach(), None, full, 0.3)
    close(out, ref)
    close(lse, ref_lse)
    grads = torch.autograd.grad(out.sum(), (q, k))
    out2 = sparse_attention(q, k, None, full, 0.3)
    for a, b in zip(grads, torch.autograd.grad(out2.sum(), (q, k)), strict=True):
        torch.testing.assert_close(a, b)

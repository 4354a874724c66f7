"""Dense (warm-up) indexer KL loss Triton kernels under the interpreter (CPU), against the
reference; and, marked `gpu`, at GLM-5.1's shapes on the H200.

Tiny cases (the interpreter is slow): value and the gradients of q_index, weights and k_index,
ReLU on and off (off folds the weights into the query), absorbed MLA (one KV head, Dqk with a
tail past its power-of-two part) and per-head keys (several KV heads), several query-head
blocks, B = 2, non-contiguous inputs, context-parallel and per-batch positions (rows that see
no key or few keys), causal=False, query_valid_rows, the per-token loss, the deterministic dK
mode, bf16 inputs, and the routing of the public entry point. Key tiles of 16 make rows span
several tiles with a ragged tail.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from megatron_hyscale.ops import reference  # noqa: E402
from megatron_hyscale.ops.indexer_loss import indexer_kl_loss  # noqa: E402
from megatron_hyscale.ops.kernels import indexer_loss_dense as kern  # noqa: E402
from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILES_16 = replace(IndexerLossKernelOptions.DEFAULT, block_n=16)  # key tiles of 16
SCALE, COEFF = 0.3, 0.7
INDEXER = ("q_index", "weights", "k_index")


def make_case(B=2, T=10, S=20, H_I=3, D_I=8, Hq=4, Hkv=1, Dqk=24, seed=0, dtype=torch.float32,
              integer=False):
    """Inputs and default positions (query t at position S - T + t, key s at s). integer: small
    integer-valued inputs (exact products and sums in fp32)."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        r = lambda *shape: torch.randint(-2, 3, shape, generator=g).float().to(DEVICE, dtype)
    else:
        r = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype)
    x = dict(q_index=r(B, T, H_I, D_I), weights=r(B, T, H_I) * 0.5, k_index=r(B, S, D_I),
             query=r(B, T, Hq, Dqk) * (1.0 if integer else 0.7),
             key=r(B, S, Hkv, Dqk) * (1.0 if integer else 0.7))
    for n in INDEXER:
        x[n].requires_grad_()
    qpos = (torch.arange(T, device=DEVICE) + (S - T)).expand(B, T)
    kpos = torch.arange(S, device=DEVICE).expand(B, S)
    return x, qpos, kpos


def grads_of(loss, x):
    return loss.detach(), torch.autograd.grad(loss, tuple(x[n] for n in INDEXER))


def ref_loss(x, qpos, kpos, relu=True, per_token=False, query_valid_rows=None):
    f = lambda n: x[n].detach().float().requires_grad_(n in INDEXER)  # fp32 reference
    y = {n: f(n) for n in x}
    loss = reference.indexer_loss_reference(
        y["q_index"], y["weights"], y["k_index"], y["query"], y["key"], None, SCALE, COEFF,
        sparse=False, relu=relu, q_positions=qpos, k_positions=kpos,
        calculate_per_token_loss=per_token, query_valid_rows=query_valid_rows)
    return grads_of(loss, y)


def tri_loss(x, qpos, kpos, relu=True, per_token=False, options=TILES_16, **kw):
    loss = kern.dense_indexer_kl_loss_triton(
        x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], SCALE, COEFF,
        relu=relu, q_positions=qpos, k_positions=kpos, calculate_per_token_loss=per_token,
        options=options, **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    return grads_of(loss, x)


def assert_close(a, b, rtol=2e-5):
    # Gradients are sums of (softmax - target) terms that cancel: the absolute tolerance is
    # taken relative to the tensor's largest entry.
    atol = max(1e-7, rtol * float(b.abs().max()))
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


def check_against_reference(x, qpos, kpos, rtol=2e-5, grad_rtol=None, **kw):
    ref_kw = {k: v for k, v in kw.items() if k in ("relu", "per_token", "query_valid_rows")}
    r_loss, r_grads = ref_loss(x, qpos, kpos, **ref_kw)
    t_loss, t_grads = tri_loss(x, qpos, kpos, **kw)
    assert r_loss > 0
    assert_close(t_loss, r_loss, rtol)
    for name, g, rg in zip(INDEXER, t_grads, r_grads, strict=True):
        assert g.dtype == x[name].dtype and g.shape == x[name].shape, name
        assert rg.abs().max() > 0, name
        assert_close(g, rg, grad_rtol or rtol)
    return t_loss, t_grads


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("layout", ["absorbed_mla", "per_head_k"])
def test_matches_reference(relu, layout):
    # absorbed MLA: one KV head, Dqk 24 = 16 + an 8-wide tail (576 = 512 + 64 at scale);
    # per-head K: 6 query heads over 3 KV heads (groups of 2), 3 head blocks a row.
    shape = dict(Hq=4, Hkv=1, Dqk=24) if layout == "absorbed_mla" else dict(Hq=6, Hkv=3, Dqk=16)
    x, qpos, kpos = make_case(seed=int(relu) + 3 * len(layout), **shape)
    check_against_reference(x, qpos, kpos, relu=relu)


def test_integer_inputs_are_tight():
    """Integer-valued inputs: every product and score exact in fp32; what remains is the
    softmaxes' rounding and summation order."""
    x, qpos, kpos = make_case(seed=3, integer=True)
    with torch.no_grad():
        x["weights"].mul_(0.25)  # scores in a few units keep the softmax spread
    check_against_reference(x, qpos, kpos, rtol=2e-6, grad_rtol=5e-6)


def test_several_query_head_blocks():
    # 40 query heads in blocks of 16 (the last one ragged): three blocks add into the target
    # of each key tile; with 2 KV heads, 2 x 2 blocks of 20 heads.
    x, qpos, kpos = make_case(B=1, T=6, S=9, Hq=40, Dqk=20, seed=7)
    check_against_reference(x, qpos, kpos, options=replace(TILES_16, max_block_h=16))
    x, qpos, kpos = make_case(B=1, T=6, S=9, Hq=40, Hkv=2, Dqk=20, seed=8)
    check_against_reference(x, qpos, kpos, options=replace(TILES_16, max_block_h=16))


def test_first_rows_see_few_keys():
    # S == T: row t sees keys 0..t (row 0 one key, its target and prediction both 1: KL 0).
    x, qpos, kpos = make_case(T=20, S=20, seed=9)
    check_against_reference(x, qpos, kpos)


def test_shard_and_per_batch_positions():
    # A context-parallel shard's two zigzag chunks (positions 0..3 and 12..15) over keys at
    # positions 4..23: rows 0..3 see nothing (zero KL and gradient, still in the mean). Batch
    # 1's keys are in another (unsorted) order, so the scan ends differ per batch.
    T, S = 8, 20
    x, _, _ = make_case(T=T, S=S, seed=10)
    qpos = torch.cat([torch.arange(0, 4), torch.arange(12, 16)]).to(DEVICE).expand(2, T)
    kpos = torch.stack([torch.arange(S) + 4, torch.randperm(
        S, generator=torch.Generator().manual_seed(0)) + 4]).to(DEVICE)
    _, grads = check_against_reference(x, qpos, kpos)
    assert (grads[0][:, :4] == 0).all() and (grads[1][:, :4] == 0).all()
    ends = kern.key_ends(qpos, kpos)
    assert ends[0, 4] == 9 and ends[0, 0] == 0 and ends[1, 7] <= S


def test_non_contiguous_sbhd_inputs():
    # megatron holds [T, B, ...] tensors and passes them transposed.
    x, qpos, kpos = make_case(seed=11)
    sb = {n: t.detach().transpose(0, 1).contiguous().transpose(0, 1) for n, t in x.items()}
    for n in INDEXER:
        sb[n].requires_grad_()
        assert not sb[n].is_contiguous()
    check_against_reference(sb, qpos, kpos)


def test_large_logits_stay_finite():
    x, qpos, kpos = make_case(seed=13)
    x["query"] = x["query"] * 40
    with torch.no_grad():
        x["q_index"].mul_(10)
    loss, grads = check_against_reference(x, qpos, kpos, rtol=1e-4)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


def test_per_token_loss_is_the_sum():
    x, qpos, kpos = make_case(seed=15)
    check_against_reference(x, qpos, kpos, per_token=True)


@pytest.mark.parametrize("relu,per_token", [(True, False), (False, True)])
def test_query_valid_rows(relu, per_token):
    x, qpos, kpos = make_case(seed=17 + int(relu))
    mask = (torch.rand(2, 10, generator=torch.Generator().manual_seed(2)) > 0.4).to(DEVICE)
    _, grads = check_against_reference(x, qpos, kpos, relu=relu, per_token=per_token,
                                       query_valid_rows=mask)
    assert (grads[0][~mask] == 0).all() and (grads[1][~mask] == 0).all()
    none = torch.zeros(2, 10, dtype=torch.bool, device=DEVICE)
    loss, grads = tri_loss(x, qpos, kpos, query_valid_rows=none)
    assert loss.item() == 0.0 and all((g == 0).all() for g in grads)


def test_deterministic_dk_is_repeatable_and_matches():
    x, qpos, kpos = make_case(seed=19)
    _, g1 = check_against_reference(x, qpos, kpos, deterministic=True)
    _, g2 = tri_loss(x, qpos, kpos, deterministic=True)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)


def test_bf16_inputs():
    # The reference reads the same bf16 values in fp32; the kernels' products are exact and
    # the gradient's MMAs round (softmax - target) weights to bf16, and the gradients are
    # returned in bf16.
    x, qpos, kpos = make_case(seed=21, dtype=torch.bfloat16)
    check_against_reference(x, qpos, kpos, rtol=1e-4, grad_rtol=2e-2)


def test_loss_without_autograd_and_output_gradient():
    x, qpos, kpos = make_case(seed=23)
    plain = lambda: kern.dense_indexer_kl_loss_triton(
        x["q_index"], x["weights"], x["k_index"], x["query"], x["key"], SCALE, COEFF, relu=True,
        q_positions=qpos, k_positions=kpos, calculate_per_token_loss=False, options=TILES_16)
    with torch.no_grad():  # the loss pass without its gradient work
        no_grad = plain()
    loss, grads = tri_loss(x, qpos, kpos)
    assert torch.equal(no_grad, loss)
    # The gradients saved by the forward are scaled by the output gradient in backward.
    _, grads3 = grads_of(plain() * -3.0, x)
    for g, g3 in zip(grads, grads3, strict=True):
        assert_close(g3, -3.0 * g)


def test_default_tilings_and_public_entry_point():
    """backend='triton' with sparse=False runs the dense kernel (no warning, default tilings and
    forced ones), causal=False sees every key; what it cannot take raises ValueError."""
    x, qpos, kpos = make_case(B=1, T=5, S=7, seed=25)
    args = tuple(x[n] for n in ("q_index", "weights", "k_index", "query", "key"))

    def call(backend, **kw):
        return grads_of(indexer_kl_loss(*args, None, SCALE, COEFF, sparse=False,
                                        backend=backend, **kw), x)

    for kw in ({}, {"options": TILES_16}, {"causal": False}):
        want, want_grads = call("reference", **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got, got_grads = call("triton", **kw)
        assert_close(got, want)
        for g, w in zip(got_grads, want_grads, strict=True):
            assert_close(g, w)
    assert not torch.allclose(call("reference")[0], call("reference", causal=False)[0])
    visible = torch.ones(5, 7, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="visible"):
        indexer_kl_loss(*args, None, SCALE, COEFF, sparse=False, visible=visible,
                        backend="triton")


def test_tp_split_dense_is_the_reference(monkeypatch):
    """A tp_group of size > 1: backend='triton' raises ValueError naming it; 'auto' runs the
    reference (which all-reduces the target)."""
    x, qpos, kpos = make_case(B=1, T=5, S=7, seed=27)
    args = tuple(x[n] for n in ("q_index", "weights", "k_index", "query", "key"))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None: calls.append(t))
    with pytest.raises(ValueError, match="tp_group"):
        indexer_kl_loss(*args, None, SCALE, COEFF, sparse=False, tp_group=object(),
                        backend="triton")
    indexer_kl_loss(*args, None, SCALE, COEFF, sparse=False, tp_group=object(), backend="auto")
    assert calls


def test_empty_inputs():
    # No keys: loss 0 and zero gradients, as the reference.
    x, qpos, kpos = make_case(B=1, T=4, S=6, seed=29)
    k0 = x["k_index"].detach()[:, :0].requires_grad_()
    loss = kern.dense_indexer_kl_loss_triton(
        x["q_index"], x["weights"], k0, x["query"], x["key"][:, :0], SCALE, COEFF, relu=True,
        q_positions=qpos, k_positions=kpos[:, :0], calculate_per_token_loss=False)
    grads = torch.autograd.grad(loss, (x["q_index"], x["weights"]))
    assert loss.item() == 0.0 and all((g == 0).all() for g in grads)


# --------------------------------------------------------------------------- GPU, real size


def _gpu_case(T, B=1, Hq=64, Hkv=1, Dqk=576, H_I=32, D_I=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, device="cuda") * s).to(dtype)
    x = dict(q_index=r(B, T, H_I, D_I, s=0.3), weights=r(B, T, H_I, s=H_I ** -0.5),
             k_index=r(B, T, D_I, s=0.3), query=r(B, T, Hq, Dqk), key=r(B, T, Hkv, Dqk))
    for n in INDEXER:
        x[n].requires_grad_()
    return x


def _gpu_run(x, backend, fp32=False, **kw):
    t = {n: v.detach().float().requires_grad_(v.requires_grad) if fp32 else v
         for n, v in x.items()}
    loss = indexer_kl_loss(t["q_index"], t["weights"], t["k_index"], t["query"], t["key"], None,
                           x["query"].shape[-1] ** -0.5, 0.1, sparse=False, backend=backend,
                           check_values=False, **kw)
    return grads_of(loss, t)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_glm51_shape_t4096(deterministic):
    """GLM-5.1 (Hq 64, Dqk 576 = 512 + 64, one KV head; indexer 32 x 128), T = 4096, bf16:
    'auto' on CUDA runs the dense kernel (no warning) and agrees with the fp32 reference (loss
    to fp32 summation order; bf16-rounded gradients within 1e-2 relative L2); the
    deterministic mode is bitwise repeatable; peak memory holds no [T, S] table."""
    x = _gpu_case(4096)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, grads = _gpu_run(x, "auto", deterministic=deterministic)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    T, H_I, D_I = 4096, 32, 128
    assert extra < 4 * T * H_I * D_I * 4 + (64 << 20), extra  # a [T, T] fp32 table: 64 MiB
    r_loss, r_grads = _gpu_run(x, "reference", fp32=True)
    torch.testing.assert_close(loss, r_loss, rtol=1e-4, atol=0)
    for name, g, rg in zip(INDEXER, grads, r_grads, strict=True):
        g, rg = g.float(), rg.float()
        assert torch.isfinite(g).all() and rg.abs().max() > 0, name
        assert (g - rg).norm() / rg.norm() < 1e-2, name
    if deterministic:
        _, again = _gpu_run(x, "auto", deterministic=True)
        for a, b in zip(grads, again, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_gqa_relu_off():
    # Per-head keys (24 query / 2 KV heads of 256), relu off (folded query), B = 2.
    x = _gpu_case(1024, B=2, Hq=24, Hkv=2, Dqk=256, H_I=4)
    loss, grads = _gpu_run(x, "triton", relu=False)
    r_loss, r_grads = _gpu_run(x, "reference", fp32=True, relu=False)
    torch.testing.assert_close(loss, r_loss, rtol=1e-4, atol=0)
    for g, rg in zip(grads, r_grads, strict=True):
        assert (g.float() - rg).norm() / rg.norm() < 1e-2

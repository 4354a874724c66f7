"""config.hyscale_indexer_target = "attention_backward": the sparse indexer loss's target from the
attention backward's dQ kernel (`ops.sparse_attention_indexer_loss`), against megatron-core's
DSAttention on identical weights (fp32, CPU: HyScale's Triton kernels under the interpreter).

A tiny GPTModel (MLA + DSA, 2 layers) built twice from one state dict: logits, LM loss, the
logged indexer loss (now logged from the backward) and every parameter gradient (the
indexer's from its loss) match stock's, with ReLU and folded scoring, with full recompute
(the loss logged once per layer, not once per forward), and with a row mask (padded rows out
of the loss's mean); the core attention with per-head K and V too. The setting is checked by
name.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)

from hyscale_bench.models import build_gpt, default_device, tiny_dsa_config
from megatron_hyscale.layers import dsa
from megatron_hyscale.layers.kernel_backend import indexer_lse, indexer_target
from megatron_hyscale.ops.kernels import attention_indexer_loss as ail
from megatron_hyscale.testing.dsa_core import assert_core_steps_match, build_core_pair, core_step
from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

DEVICE = default_device()
VOCAB, T, B, TOPK = 97, 48, 2, 16
RECOMPUTE = {"none": {}, "full-uniform": dict(recompute_granularity="full",
                                              recompute_method="uniform",
                                              recompute_num_layers=1)}


@pytest.fixture(autouse=True)
def stock_ties_by_index():
    with stock_topk_breaks_ties_by_index():
        yield


def run_step(model):
    """Forward + backward of the mean LM loss: loss, logits, logged indexer losses, grads, and
    the indexer losses logged before the backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    labels = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    DSAIndexerLossLoggingHelper.tracker.clear()
    loss = model(ids, pos, None, labels=labels).mean()
    before = DSAIndexerLossLoggingHelper.tracker.get("values")
    before = torch.zeros(0) if before is None else before.clone()
    loss.backward()
    values = DSAIndexerLossLoggingHelper.tracker["values"].clone()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    with torch.no_grad():
        model.eval()
        logits = model(ids, pos, None)
        model.train()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logits.detach(), values, grads, before


def count_calls(monkeypatch):
    """The layer's calls of ops.sparse_attention_indexer_loss (a list that grows)."""
    calls = []
    real = dsa.sparse_attention_indexer_loss

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dsa, "sparse_attention_indexer_loss", spy)
    return calls


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "folded"])
def test_model_matches_stock(recompute, relu, monkeypatch):
    cfg = tiny_dsa_config(dsa_indexer_use_sparse_loss=True, dsa_indexer_scoring_relu=relu,
                          dsa_indexer_topk=TOPK, **RECOMPUTE[recompute])
    torch.manual_seed(1234)
    stock = build_gpt(cfg, stock=True, vocab_size=VOCAB, max_sequence_length=T).to(DEVICE)
    hyscale = build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T).to(DEVICE)
    hyscale.load_state_dict(stock.state_dict(), strict=True)
    want = run_step(stock)
    calls = count_calls(monkeypatch)
    cfg.hyscale_indexer_target = "attention_backward"  # stock ignores it
    try:
        got = run_step(hyscale)
        # the op ran in each layer's forward with gradients (and in the recompute's, which
        # the first forward of full recompute skips: no gradients there), never in eval
        assert len(calls) == 2
        cfg.hyscale_indexer_target = "separate"
        separate = run_step(hyscale)
        assert len(calls) == 2
    finally:
        del cfg.hyscale_indexer_target
    # logged from the backward: nothing before it; the separate path logs in the forward
    # (under full recompute in the recompute's forward, itself in the backward)
    assert not got[4].any()
    if recompute == "none":
        torch.testing.assert_close(separate[4], separate[2])
    for res in (got, separate):
        torch.testing.assert_close(res[1], want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res[0], want[0], rtol=1e-5, atol=1e-6)
        assert want[2].abs().sum() > 0, "the indexer loss never ran"
        # each layer's loss logged once a step, as stock's (not 0, not twice under recompute)
        torch.testing.assert_close(res[2], want[2], rtol=1e-3, atol=0.0)
        assert set(res[3]) == set(want[3])
        assert any(".indexer." in n for n in want[3])
        for name, grad in want[3].items():
            torch.testing.assert_close(res[3][name], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_kl_from_the_indexer_backward_changes_nothing(monkeypatch):
    """config.indexer_loss_kernel_options with kl_in_bwd (the loss's KL summed by the indexer
    backward, one gathered row pass fewer): the same logged losses and gradients."""
    from dataclasses import replace

    from megatron_hyscale.ops import IndexerLossKernelOptions

    kl_from_bwd = []
    real = ail.indexer_loss_bwd

    def spy(*args, with_kl=False, **kwargs):
        kl_from_bwd.append(with_kl)
        return real(*args, with_kl=with_kl, **kwargs)

    monkeypatch.setattr(ail, "indexer_loss_bwd", spy)
    cfg = tiny_dsa_config(dsa_indexer_use_sparse_loss=True, dsa_indexer_topk=TOPK)
    torch.manual_seed(1234)
    model = build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T).to(DEVICE)
    cfg.hyscale_indexer_target = "attention_backward"
    try:
        # The row pass's log-sum-exp both times (the selection's has its own test below).
        cfg.hyscale_indexer_lse = "row_pass"
        cfg.indexer_loss_kernel_options = replace(IndexerLossKernelOptions.DEFAULT,
                                                  kl_in_bwd=False)
        want = run_step(model)
        assert kl_from_bwd == [False, False]  # the row pass's KL, 2 layers
        cfg.indexer_loss_kernel_options = replace(IndexerLossKernelOptions.DEFAULT,
                                                  kl_in_bwd=True)
        got = run_step(model)
        assert kl_from_bwd[2:] == [True, True]
    finally:
        del cfg.hyscale_indexer_target, cfg.hyscale_indexer_lse
        cfg.__dict__.pop("indexer_loss_kernel_options", None)
    assert want[2].abs().sum() > 0, "the indexer loss never ran"
    for a, b in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)
    assert set(got[3]) == set(want[3])
    for name, grad in want[3].items():
        # On a GPU the attention backward's dK fp32 atomics add in any order: entries near 0
        # (an embedding row) then differ by ~1e-9 between two steps (an H100, 2026-12-06).
        atol = 1e-9 if DEVICE.type == "cpu" else 1e-6 * float(grad.abs().max())
        torch.testing.assert_close(got[3][name], grad, rtol=1e-6, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def row_passes(monkeypatch) -> list[str]:
    """The loss's row passes, in call order (a list that grows): "rows" for the gathered pass,
    "given" for the target's normalization alone (the log-sum-exp given)."""
    passes: list[str] = []
    real_rows, real_norm = ail.indexer_loss_rows, ail.normalize_target
    monkeypatch.setattr(ail, "indexer_loss_rows",
                        lambda *a, **k: passes.append("rows") or real_rows(*a, **k))
    monkeypatch.setattr(ail, "normalize_target",
                        lambda *a, **k: passes.append("given") or real_norm(*a, **k))
    return passes


def assert_grads_close(got: dict, want: dict) -> None:
    """Gradients with the selection's log-sum-exp against the row pass's. The indexer's come
    from g = softmax(s) * psum - pn, near-equal terms in the tiny GPT (its KL is about 6e-6),
    so the two log-sum-exps' fp32 rounding (1e-7 relative) shows at about 1e-5 of each
    gradient's largest entry (an H100, 2026-12-06: up to 1.4e-5): atol 1e-4 of it there. The
    rest see the loss only through the attention, as before (on a GPU also its dK atomics'
    order)."""
    for name, grad in want.items():
        scale = float(grad.abs().max())
        if ".indexer." in name:
            atol = 1e-4 * scale
        else:
            atol = 1e-8 if DEVICE.type == "cpu" else 1e-6 * scale
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_lse_from_the_selection_changes_nothing(recompute, monkeypatch):
    """hyscale_indexer_lse "selection" (the default): the layer takes each row's index-score
    log-sum-exp from its selection (replayed with the indices under recompute) and the loss's
    row pass gathers nothing; "row_pass", the row pass runs. The same logged losses and
    gradients, to fp32 rounding; the replay stores drained."""
    from megatron_hyscale import replay

    monkeypatch.delenv("HYSCALE_INDEXER_LSE", raising=False)
    passes = row_passes(monkeypatch)
    given = []
    real_op = dsa.sparse_attention_indexer_loss

    def op(*args, index_lse=None, **kwargs):
        given.append(index_lse is not None)
        return real_op(*args, index_lse=index_lse, **kwargs)

    monkeypatch.setattr(dsa, "sparse_attention_indexer_loss", op)
    cfg = tiny_dsa_config(dsa_indexer_use_sparse_loss=True, dsa_indexer_topk=TOPK,
                          **RECOMPUTE[recompute])
    torch.manual_seed(1234)
    model = build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T).to(DEVICE)
    cfg.hyscale_indexer_target = "attention_backward"
    try:
        cfg.hyscale_indexer_lse = "row_pass"
        want = run_step(model)
        assert passes == ["rows", "rows"] and given == [False, False]  # 2 layers
        del cfg.hyscale_indexer_lse
        replay.reset_stats()
        got = run_step(model)
        assert passes[2:] == ["given", "given"] and given[2:] == [True, True]
    finally:
        del cfg.hyscale_indexer_target
        cfg.__dict__.pop("indexer_loss_kernel_options", None)
    stats = replay.get_stats()
    # one selection a layer, replayed (not computed again) by the recompute, lse beside it
    assert stats["selections_computed"] == 4  # and 2 in the eval forward of run_step
    assert stats["selections_replayed"] == (2 if recompute != "none" else 0)
    replay.assert_drained()
    assert want[2].abs().sum() > 0, "the indexer loss never ran"
    for a, b in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)
    # The logged KL is small here (about 6e-6): the two log-sum-exps' fp32 rounding (torch's
    # over the selection's scores, the kernel's base-2 one) moves it by up to about 1e-9,
    # far below the fp32 error of the KL's own sum of O(1) terms (stock's too); the
    # tolerance is the one the layer's tests hold against stock.
    torch.testing.assert_close(got[2], want[2], rtol=1e-3, atol=0.0)
    assert set(got[3]) == set(want[3])
    assert_grads_close(got[3], want[3])


@pytest.mark.parametrize("recompute", [False, True])
def test_core_with_per_head_values_matches_stock(recompute, monkeypatch):
    """The non-absorbed layout (per-head K and V: four KV heads sharing the indices, whose
    target parts the dQ kernel stores one slice each), through the core attention."""
    heads, hn, hnv = 4, 24, 16
    cfg = tiny_dsa_config(num_layers=1, dsa_indexer_topk=TOPK, dsa_indexer_use_sparse_loss=True)
    stock, hyscale = (m.to(DEVICE) for m in build_core_pair(cfg, k_channels=hn, v_channels=hnv))
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    tensors = dict(query=r(T, B, heads, hn), key=r(T, B, heads, hn), value=r(T, B, heads, hnv))
    rest = dict(x=r(T, B, 64), qr=r(T, B, 32), attn_mask_type=AttnMaskType.causal)
    want = core_step(stock, tensors, recompute=recompute, **rest)
    calls = count_calls(monkeypatch)
    cfg.hyscale_indexer_target = "attention_backward"
    try:
        got = core_step(hyscale, tensors, recompute=recompute, **rest)
    finally:
        del cfg.hyscale_indexer_target
    assert len(calls) == 1
    assert want["indexer_loss"].abs().sum() > 0
    assert_core_steps_match(got, want)


@pytest.mark.parametrize("setting, attr, env, default, other, bad", [
    (indexer_target, "hyscale_indexer_target", "HYSCALE_INDEXER_TARGET", "auto",
     "attention_backward", "dq"),
    (indexer_lse, "hyscale_indexer_lse", "HYSCALE_INDEXER_LSE", "selection", "row_pass", True),
])
def test_setting_is_checked_by_name(setting, attr, env, default, other, bad, monkeypatch):
    """config.<attr>, else $<env>, else the default; a bad value named by its source."""
    monkeypatch.delenv(env, raising=False)
    assert setting(types.SimpleNamespace()) == default
    monkeypatch.setenv(env, other)
    assert setting(types.SimpleNamespace()) == other
    assert setting(types.SimpleNamespace(**{attr: default})) == default
    with pytest.raises(ValueError, match=f"config.{attr} must be one of"):
        setting(types.SimpleNamespace(**{attr: bad}))
    monkeypatch.setenv(env, "forward")
    with pytest.raises(ValueError, match=f"{env} must be one of"):
        setting(types.SimpleNamespace())


def test_the_row_pass_setting_reaches_the_layer(monkeypatch):
    """$HYSCALE_INDEXER_LSE=row_pass (a `--spec` launch's way) keeps the loss's gathered row
    pass in a layer whose config says nothing."""
    passes = row_passes(monkeypatch)
    monkeypatch.setenv("HYSCALE_INDEXER_LSE", "row_pass")
    cfg = tiny_dsa_config(dsa_indexer_use_sparse_loss=True, dsa_indexer_topk=TOPK)
    torch.manual_seed(1234)
    model = build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T).to(DEVICE)
    cfg.hyscale_indexer_target = "attention_backward"
    try:
        run_step(model)
    finally:
        del cfg.hyscale_indexer_target
    assert passes == ["rows", "rows"]


def core_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    tensors = dict(query=r(T, B, 4, 24), key=r(T, B, 4, 24), value=r(T, B, 4, 16))
    return tensors, dict(x=r(T, B, 64), qr=r(T, B, 32), attn_mask_type=AttnMaskType.causal)


@pytest.mark.parametrize("library", [False, True], ids=["own-kernels", "library-attention"])
def test_auto_takes_the_target_from_the_backward_where_hyscale_kernels_run(library,
                                                                           monkeypatch):
    """The default ("auto"): on CUDA the fused op runs unless the backend gives the attention
    to the library pair (whose backward emits no target); off CUDA the separate pass (the
    reference ops), without a warning. The same results as stock either way."""
    from megatron_hyscale.ops import checks

    monkeypatch.delenv("HYSCALE_INDEXER_TARGET", raising=False)
    monkeypatch.setattr(checks, "_warned", set())
    asked = []

    def library_pair(*args, **kwargs):
        asked.append(kwargs["backend"])
        return library

    monkeypatch.setattr(dsa, "attention_uses_library", library_pair)
    calls = count_calls(monkeypatch)
    cfg = tiny_dsa_config(num_layers=1, dsa_indexer_topk=TOPK, dsa_indexer_use_sparse_loss=True)
    stock, hyscale = (m.to(DEVICE) for m in build_core_pair(cfg, k_channels=24, v_channels=16))
    tensors, rest = core_tensors(5)
    want = core_step(stock, tensors, **rest)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = core_step(hyscale, tensors, **rest)
    on_gpu = DEVICE.type == "cuda"
    assert len(calls) == (1 if on_gpu and not library else 0)
    assert asked == (["best"] if on_gpu else [])  # the layer's default kernel backend
    assert want["indexer_loss"].abs().sum() > 0
    assert_core_steps_match(got, want)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the case of tensors off CUDA (the CPU suite)")
def test_without_triton_it_says_why_and_runs_the_separate_pass(monkeypatch):
    """Off CUDA and without Triton's interpreter the kernels cannot run: one warning naming
    the setting, then the separate target pass (the same results as stock)."""
    from megatron_hyscale.ops import checks

    monkeypatch.setattr(checks, "_warned", set())
    monkeypatch.setattr(dsa, "triton_interpret", lambda: False)
    calls = count_calls(monkeypatch)
    cfg = tiny_dsa_config(num_layers=1, dsa_indexer_topk=TOPK, dsa_indexer_use_sparse_loss=True)
    stock, hyscale = build_core_pair(cfg, k_channels=24, v_channels=16)
    g = torch.Generator().manual_seed(4)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    tensors = dict(query=r(T, B, 4, 24), key=r(T, B, 4, 24), value=r(T, B, 4, 16))
    rest = dict(x=r(T, B, 64), qr=r(T, B, 32), attn_mask_type=AttnMaskType.causal)
    want = core_step(stock, tensors, **rest)
    cfg.hyscale_indexer_target = "attention_backward"
    try:
        with pytest.warns(RuntimeWarning, match="hyscale_indexer_target='attention_backward' "
                                                "needs HyScale's Triton kernels"):
            got = core_step(hyscale, tensors, **rest)
    finally:
        del cfg.hyscale_indexer_target
    assert not calls
    assert_core_steps_match(got, want)


def test_config_hytopk_options_reach_the_selection(monkeypatch):
    """config.hytopk_options is the options every DSA selection call gets (None: HyTopK's
    DEFAULT); scores_sm90, which cannot run this tiny model's indexer (on a GPU it warns and
    runs the Triton kernel; on CPU the reference runs), selects the same keys."""
    from megatron_hyscale.ops import HyTopKOptions

    seen = []
    real = dsa.hytopk

    def spy(*args, options=None, **kwargs):
        seen.append(options)
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(dsa, "hytopk", spy)
    cfg = tiny_dsa_config(dsa_indexer_use_sparse_loss=True, dsa_indexer_topk=TOPK)
    torch.manual_seed(1234)
    model = build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T).to(DEVICE)
    want = run_step(model)
    assert seen and all(o is None for o in seen)
    opts = HyTopKOptions(scores_sm90=True)
    cfg.hytopk_options = opts
    try:
        got = run_step(model)
    finally:
        del cfg.hytopk_options
    assert seen[-1] is opts
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("projections", ["hyscale", "megatron"])
def test_one_sequences_backward_inputs_suit_the_hopper_backward(monkeypatch, projections):
    """What the layer hands the attention backward for one sequence passes the Hopper
    kernel's layout check, so on an H100 / H200 the layer runs it rather than the Triton
    backward, whichever V up projection made dout: HyScale's in place (contiguous) or
    megatron's einsum (B = 1: heads outermost, batch stride 1, which the check read before
    2026-12-05). The kernel's narrowest absorbed geometry (128 latent + 64 rope channels);
    the target's path, which runs HyScale's Triton kernels here (the separate path's
    attention is the reference on CPU; its dout is the same projection's)."""
    gluon_bwd = pytest.importorskip("megatron_hyscale.ops.kernels.sparse_mla_bwd_sm90",
                                    reason="Gluon's Hopper API (tested with Triton 3.6)")
    from megatron_hyscale.ops.kernels import sparse_attention as sa

    seen = []
    real = sa._backward

    def spy(q, k, v, indices, scale, out, lse, dout, *args, **kwargs):
        seen.append((q, k, v, out, dout))
        return real(q, k, v, indices, scale, out, lse, dout, *args, **kwargs)

    monkeypatch.setattr(sa, "_backward", spy)
    cfg = tiny_dsa_config(num_layers=1, dsa_indexer_use_sparse_loss=True,
                          dsa_indexer_topk=TOPK, kv_lora_rank=128, qk_pos_emb_head_dim=64,
                          dsa_indexer_head_dim=96)
    cfg.hyscale_indexer_target = "attention_backward"
    cfg.hyscale_mla_projections = projections
    torch.manual_seed(5)
    model = build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T).to(DEVICE)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(6))
    ids = ids.to(DEVICE)
    pos = torch.arange(T, device=DEVICE)[None]
    model(ids, pos, None, labels=ids).mean().backward()
    assert len(seen) == 1
    q, k, v, out, dout = seen[0]
    assert v is None and q.shape[0] == dout.shape[0] == 1 and q.shape[-1] == 192
    if projections == "megatron":
        assert dout.stride(0) % gluon_bwd.STRIDE_MULTIPLE, "B = 1's odd batch stride is the case"
    assert gluon_bwd.layout_problem(q, k, out, dout) is None, dout.stride()


def test_lse_travels_with_micro_batches_in_flight_and_offload(monkeypatch):
    """Three micro-batches' forwards first, then their backwards (a pipeline stage's order),
    under full recompute with index sharing (4 layers, 2 select), the replay store offloaded:
    each layer's log-sum-exps go to the host with its indices and come back in order, the
    loss's row pass gathers nothing, and the gradients are the row pass's (hyscale_indexer_lse
    "row_pass") to fp32 rounding."""
    from megatron_hyscale import replay
    from tests.layers.test_dsa_replay import FULL_UNIFORM, pipelined_grads

    row_passes = []
    real_rows = ail.indexer_loss_rows
    monkeypatch.setattr(ail, "indexer_loss_rows",
                        lambda *a, **k: row_passes.append(1) or real_rows(*a, **k))
    cfg = tiny_dsa_config(num_layers=4, dsa_indexer_topk_freq=2, dsa_indexer_topk=TOPK,
                          dsa_indexer_use_sparse_loss=True, **FULL_UNIFORM)
    torch.manual_seed(5)
    model = build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T).to(DEVICE)
    g = torch.Generator().manual_seed(11)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    mbs = [(torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE), pos,
            torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)) for _ in range(3)]
    cfg.hyscale_indexer_target = "attention_backward"
    try:
        cfg.hyscale_indexer_lse = "row_pass"
        want = pipelined_grads(model, mbs)
        assert len(row_passes) == 3 * 2  # micro-batches x selecting layers
        cfg.hyscale_indexer_lse = "selection"
        replay.configure(offload=True)
        replay.reset_stats()
        got = pipelined_grads(model, mbs)
    finally:
        replay.configure(offload=False)
        del cfg.hyscale_indexer_target, cfg.hyscale_indexer_lse
    assert len(row_passes) == 3 * 2  # none more
    stats = replay.get_stats()
    # one entry a selection (its log-sum-exp inside it): 2 computing layers x 3 micro-batches,
    # every layer's recompute replaying its (shared) indices
    assert stats["selections_offloaded"] == 3 * 4 and stats["selections_replayed"] == 3 * 4
    assert replay.pending_entries() == 0 and not replay._offloaded
    assert_grads_close(got, want)


@pytest.mark.parametrize("mode", ["per_document", "batched"])
@pytest.mark.parametrize("recompute", [False, True])
def test_packed_documents_take_the_lse_from_their_selection(mode, recompute, monkeypatch):
    """Packed THD documents (one shorter than top-k, each in padded storage: rows of no
    document between them): each document's selection gives its rows' log-sum-exps (replayed
    with the indices), the loss's row pass gathers nothing, and the output, input and
    parameter gradients and the logged loss are the row pass's (hyscale_indexer_lse
    "row_pass") to fp32 rounding."""
    from tests.layers.test_dsa_packed import build_pair, hyscale_step, packed_params

    passes = row_passes(monkeypatch)
    padded = torch.tensor([0, 16, 56, 80], dtype=torch.int32, device=DEVICE)
    params = packed_params((13, 40, 27), padded=padded)
    _, layer = build_pair(dsa_indexer_use_sparse_loss=True)
    layer.config.hyscale_packed_selection = mode
    layer.config.hyscale_indexer_target = "attention_backward"
    hidden = torch.randn(80, 1, 64, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    layer.config.hyscale_indexer_lse = "row_pass"
    want = hyscale_step(layer, hidden, params, recompute)
    assert passes == ["rows"]
    layer.config.hyscale_indexer_lse = "selection"
    got = hyscale_step(layer, hidden, params, recompute)
    assert passes == ["rows", "given"]
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-8)
    assert any(".indexer." in n for n in want[2]), "no indexer gradient: the loss never ran"
    assert_grads_close(got[2], want[2])
    assert want[3].abs().sum() > 0
    torch.testing.assert_close(got[3], want[3], rtol=1e-3, atol=0.0)

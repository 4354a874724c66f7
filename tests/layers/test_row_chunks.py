"""HyScaleMLASelfAttention with row chunks equals the unchunked HyScale layer.

Same weights, fp32: the GPT's loss, logits, indexer losses and every gradient agree (the parts
only change summation order: the indexer loss is a sum of row-weighted means), with and
without full recompute (the selection still runs once per layer per forward), with index
sharing, the sparse and the dense indexer loss, and a ragged last part. On the GPU with
`deterministic_mode`, as the kernels' fp32 atomics would otherwise differ in the last bits.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossLoggingHelper,
)

from hyscale_bench.models import build_gpt, default_device, tiny_dsa_config
from megatron_hyscale import replay
from megatron_hyscale.layers.mla import HyScaleMLASelfAttention
from megatron_hyscale.specs import ROW_CHUNK_ENV, get_dsa_layer_specs, row_chunk_from_env
from megatron_hyscale.testing.compare import assert_grads_close

DEVICE = default_device()
VOCAB, T, B = 97, 100, 2
CHUNK = 36  # parts of 36, 36 and 28 rows
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
VARIANTS = {
    "dense-loss": {},
    "sparse-loss": dict(dsa_indexer_use_sparse_loss=True),
    "index-share": dict(num_layers=4, dsa_indexer_topk_freq=2,
                        dsa_indexer_use_sparse_loss=True),
}


def build(row_chunk: int | None, **overrides):
    cfg = tiny_dsa_config(deterministic_mode=True, **overrides)
    torch.manual_seed(21)
    return build_gpt(cfg, stock=False, vocab_size=VOCAB, max_sequence_length=T,
                     row_chunk=row_chunk)


def step(model):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    labels = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    model.train()
    model.zero_grad(set_to_none=True)
    DSAIndexerLossLoggingHelper.tracker.clear()
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    logged = DSAIndexerLossLoggingHelper.tracker["values"].clone()
    DSAIndexerLossLoggingHelper.tracker.clear()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        model.eval()
        logits = model(ids, pos, None)
    return loss.detach(), logits, logged, grads


def assert_same_losses_and_grads(logged, e_logged, grads, e_grads) -> None:
    """The logged indexer losses and every gradient agree (the indexer's included)."""
    assert e_logged.abs().sum() > 0
    torch.testing.assert_close(logged, e_logged, rtol=1e-4, atol=1e-9)
    assert any(".indexer." in n for n in e_grads)
    assert_grads_close(grads, e_grads, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recompute"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_row_chunks_match_the_whole_layer(variant, recompute):
    overrides = dict(VARIANTS[variant], **(FULL if recompute else {}))
    whole = build(None, **overrides)
    chunked = build(CHUNK, **overrides)
    chunked.load_state_dict(whole.state_dict())
    assert all(isinstance(m, HyScaleMLASelfAttention) and m.row_chunk == CHUNK
               for m in chunked.modules() if isinstance(m, HyScaleMLASelfAttention))
    expected = step(whole)
    replay.reset_stats()
    got = step(chunked)
    stats = replay.get_stats()
    n_layers = chunked.config.num_layers
    computing = n_layers // 2 if variant == "index-share" else n_layers
    # train step + eval logits: one selection per computing layer per forward; the recompute
    # replays it, the parts' own recompute in backward does not select at all.
    assert stats["selections_computed"] == 2 * computing
    assert stats["selections_replayed"] == (n_layers if recompute else 0)
    assert replay.pending_entries() == 0
    loss, logits, logged, grads = got
    e_loss, e_logits, e_logged, e_grads = expected
    torch.testing.assert_close(loss, e_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, e_logits, rtol=1e-5, atol=1e-5)
    assert_same_losses_and_grads(logged, e_logged, grads, e_grads)


def test_a_wrong_part_is_caught(monkeypatch):
    """The comparison can fail: a part that skips its last row changes the output."""
    whole, chunked = build(None), build(CHUNK)
    chunked.load_state_dict(whole.state_dict())
    original = HyScaleMLASelfAttention._rows_forward

    def drop_last_row(self, q_compressed, freqs, state, r0, r1, *args):
        out, loss = original(self, q_compressed, freqs, state, r0, r1, *args)
        return torch.cat([out[:-1], torch.zeros_like(out[-1:])]), loss

    monkeypatch.setattr(HyScaleMLASelfAttention, "_rows_forward", drop_last_row)
    assert (step(chunked)[1] - step(whole)[1]).abs().max() > 1e-3


def test_short_sequences_take_the_stock_forward(monkeypatch):
    """At most row_chunk rows: AbsorbedMLASelfAttention's own forward, unchanged."""
    model = build(T)
    calls = []
    monkeypatch.setattr(HyScaleMLASelfAttention, "_chunked_forward",
                        lambda self, *a: calls.append(1))
    step(model)
    assert not calls


def test_row_chunk_is_validated(monkeypatch):
    cfg = tiny_dsa_config()
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="row_chunk"):
            get_dsa_layer_specs(cfg, row_chunk=bad)
    with pytest.raises(ValueError, match="stock"):
        get_dsa_layer_specs(cfg, stock=True, row_chunk=64)
    monkeypatch.setenv(ROW_CHUNK_ENV, "4096")
    assert row_chunk_from_env() == 4096
    monkeypatch.setenv(ROW_CHUNK_ENV, "many")
    with pytest.raises(ValueError, match=ROW_CHUNK_ENV):
        row_chunk_from_env()
    monkeypatch.setenv(ROW_CHUNK_ENV, "")
    assert row_chunk_from_env() is None


@pytest.mark.parametrize("field,value,named", [
    ("apply_rope_fusion", True, "apply_rope_fusion"), ("fp8", "e4m3", "fp8"),
    ("fp4", "nvfp4", "fp4"), ("delay_wgrad_compute", True, "delay_wgrad_compute"),
])
def test_unsupported_settings_raise_naming_them(field, value, named):
    model = build(CHUNK)
    cfg = next(m for m in model.modules() if isinstance(m, HyScaleMLASelfAttention)).config
    original = getattr(cfg, field)
    setattr(cfg, field, value)  # after construction: only the forward's check sees it
    try:
        with pytest.raises(NotImplementedError, match=named):
            step(model)
    finally:
        setattr(cfg, field, original)


def test_the_stock_forwards_argument_checks_hold_with_row_chunks():
    model = build(CHUNK)
    attn = next(m for m in model.modules() if isinstance(m, HyScaleMLASelfAttention))
    x = torch.zeros(T, B, model.config.hidden_size, device=DEVICE)
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        attn(x, None, rotary_pos_emb=torch.zeros(T, 1, 1, 8, device=DEVICE))
    with pytest.raises(NotImplementedError, match="key_value_states"):
        attn(x, None, key_value_states=x)


def _attention(row_chunk: int | None, **overrides) -> torch.nn.Module:
    from megatron.core.transformer.spec_utils import build_module

    cfg = tiny_dsa_config(num_layers=1, deterministic_mode=True, **overrides)
    spec = get_dsa_layer_specs(cfg, row_chunk=row_chunk)[0].submodules.self_attention
    torch.manual_seed(0)
    return build_module(spec, config=cfg, layer_number=1).to(DEVICE)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recompute"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-loss", "sparse-loss"])
def test_packed_documents_in_row_parts_match_the_whole_layer(sparse, recompute):
    """Parts of 36 rows cut the packed documents (13, 40, 27, 20 rows): each row takes the
    RoPE of its position in its document, as megatron's per-document RoPE in the unchunked
    layer (whose packed path equals stock's, tests/layers/test_dsa_packed.py)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    whole = _attention(None, dsa_indexer_use_sparse_loss=sparse)
    chunked = _attention(CHUNK, dsa_indexer_use_sparse_loss=sparse)
    chunked.load_state_dict(whole.state_dict())
    cu = torch.tensor([0, 13, 53, 80, T], dtype=torch.int32, device=DEVICE)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=40, max_seqlen_kv=40)
    hidden = torch.randn(T, 1, whole.config.hidden_size,
                         generator=torch.Generator().manual_seed(8)).to(DEVICE)
    from tests.layers.test_dsa_packed import step  # one training step on packed rows

    out, h_grad, e_grads, e_logged = step(whole, hidden, params, recompute)
    got_out, got_h_grad, grads, logged = step(chunked, hidden, params, recompute)
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_h_grad, h_grad, rtol=1e-4, atol=1e-7)
    assert_same_losses_and_grads(logged, e_logged, grads, e_grads)


def test_packed_positions_are_per_document():
    """The comparison can fail: RoPE at other positions than the rows' own changes the output;
    a single document spanning the rows equals the unpacked layer."""
    from megatron.core.packed_seq_params import PackedSeqParams

    whole, chunked = _attention(None), _attention(CHUNK)
    chunked.load_state_dict(whole.state_dict())
    cu = torch.tensor([0, 13, 53, 80, T], dtype=torch.int32, device=DEVICE)
    one = torch.tensor([0, T], dtype=torch.int32, device=DEVICE)
    two = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=40, max_seqlen_kv=40)
    hidden = torch.randn(T, 1, whole.config.hidden_size,
                         generator=torch.Generator().manual_seed(8)).to(DEVICE)
    with torch.no_grad():
        whole.eval()
        chunked.eval()
        want = whole(hidden, None, packed_seq_params=two)[0]
        got = chunked(hidden, None, packed_seq_params=two)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        with pytest.MonkeyPatch.context() as mp:  # every row at position 0
            mp.setattr("megatron_hyscale.layers.mla.document_rows",
                       lambda layout, device: type("Rows", (), {"offsets": torch.zeros(
                           T, dtype=torch.int64, device=device)})())
            shifted = chunked(hidden, None, packed_seq_params=two)[0]
        assert not torch.allclose(shifted, want, atol=1e-4)
        single = PackedSeqParams(qkv_format="thd", cu_seqlens_q=one, cu_seqlens_kv=one,
                                 max_seqlen_q=T, max_seqlen_kv=T)
        torch.testing.assert_close(chunked(hidden, None, packed_seq_params=single)[0],
                                   whole(hidden, None)[0], rtol=1e-5, atol=1e-6)


# GLM-5.1's attention geometry (DESIGN.md; scripts/bench_layer.py's GLM51).
GLM51 = dict(hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
             qk_head_dim=192, qk_pos_emb_head_dim=64, v_head_dim=256, dsa_indexer_n_heads=32,
             dsa_indexer_head_dim=128, dsa_indexer_topk=2048)


def _glm_attention(row_chunk: int | None):
    from megatron.core.transformer.spec_utils import build_module

    cfg = tiny_dsa_config(num_layers=1, ffn_hidden_size=4 * 6144, params_dtype=torch.bfloat16,
                          bf16=True, dsa_indexer_use_sparse_loss=True, deterministic_mode=True,
                          **GLM51)
    spec = get_dsa_layer_specs(cfg, row_chunk=row_chunk)[0].submodules.self_attention
    torch.manual_seed(0)
    return build_module(spec, config=cfg, layer_number=1).to("cuda", torch.bfloat16)


@pytest.mark.gpu
def test_gpu_glm_geometry_parts_match_and_lower_the_peak():
    """GLM-5.1's layer at 16K tokens, bf16, with the Triton kernels: in parts of 4096 rows the
    output and input gradient stay within bf16 rounding of the whole layer's, and the peak
    memory of forward + backward drops (the per-row activations exist one part at a time)."""
    T = 16384
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, 1, GLM51["hidden_size"], device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn_like(x)
    runs = {}
    whole = _glm_attention(None)
    for chunk in (None, 4096):
        attn = _glm_attention(chunk)
        attn.load_state_dict(whole.state_dict())
        attn.train()
        xi = x.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = attn(xi, None)[0]
        out.backward(dy)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        runs[chunk] = (out.detach().float(), xi.grad.float(), peak)
        del attn, out, xi
        DSAIndexerLossLoggingHelper.tracker.clear()
    (o_w, g_w, peak_w), (o_c, g_c, peak_c) = runs[None], runs[4096]
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(o_c, o_w) < 1e-2 and rel(g_c, g_w) < 2e-2, (rel(o_c, o_w), rel(g_c, g_w))
    assert peak_c < 0.8 * peak_w, (peak_c, peak_w)

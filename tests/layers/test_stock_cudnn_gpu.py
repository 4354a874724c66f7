"""The stock cudnn baseline itself is right: megatron-core's DSAttention on
dsa_kernel_backend="cudnn" (cuDNN-frontend + FlashMLA) equals the same layer on "none" (its
PyTorch path) on identical weights and inputs, within bf16 rounding; and HyScale's layer on the
library kernels equals both. Needs a Hopper GPU with scripts/gpu_cudnn.sh's packages.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# MLA with FlashMLA's 512 latent channels, 16 heads (padded to 64 by megatron), GLM-5.1's
# indexer (32 x 128, top-2048), 4096 tokens: the `none` path's fp32 score table fits.
GEOMETRY = dict(hidden_size=1024, num_attention_heads=16, q_lora_rank=256, kv_lora_rank=512,
                qk_head_dim=64, qk_pos_emb_head_dim=64, v_head_dim=64, dsa_indexer_n_heads=32,
                dsa_indexer_head_dim=128, dsa_indexer_topk=2048)
T = 4096


def build(kernel_backend: str, stock: bool, hyscale_kernels: str | None = None):
    from megatron.core.transformer.spec_utils import build_module

    from hyscale_bench.models import tiny_dsa_config
    from megatron_hyscale.specs import get_dsa_layer_specs

    cfg = tiny_dsa_config(ffn_hidden_size=4096, num_layers=1, params_dtype=torch.bfloat16,
                          bf16=True, dsa_indexer_loss_coeff=0.01,
                          dsa_indexer_use_sparse_loss=True, dsa_kernel_backend=kernel_backend,
                          **GEOMETRY)
    spec = get_dsa_layer_specs(cfg, stock=stock)[0].submodules.self_attention
    torch.manual_seed(0)
    attn = build_module(spec, config=cfg, layer_number=1).cuda().to(torch.bfloat16)
    if hyscale_kernels:
        attn.config.hyscale_kernel_backend = hyscale_kernels
    return attn


def step(attn, hidden):
    attn.train()
    h = hidden.clone().requires_grad_()
    out = attn(h, None)[0]
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.float().clone() for n, p in attn.named_parameters() if p.grad is not None}
    return out.float().detach(), h.grad.float(), grads


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()


def test_stock_cudnn_equals_stock_none_and_hyscale_on_the_library():
    from megatron.core.utils import _missing_cudnn_dsa_kernel_dependencies

    missing = _missing_cudnn_dsa_kernel_dependencies()
    if missing:
        pytest.skip(f"megatron-core's cudnn backend misses {missing}")
    none = build("none", stock=True)
    layers = {"stock_cudnn": build("cudnn", stock=True),
              "hyscale_cudnn": build("none", stock=False, hyscale_kernels="cudnn")}
    for layer in layers.values():
        layer.load_state_dict(none.state_dict())
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(T, 1, GEOMETRY["hidden_size"], device="cuda", generator=g)
    hidden = hidden.to(torch.bfloat16)
    out_n, dh_n, grads_n = step(none, hidden)
    for name, layer in layers.items():
        out, dh, grads = step(layer, hidden)
        assert cos(out, out_n) > 0.999, (name, "output", cos(out, out_n))
        assert cos(dh, dh_n) > 0.999, (name, "input gradient", cos(dh, dh_n))
        assert grads.keys() == grads_n.keys(), name
        for pname, grad in grads.items():
            assert cos(grad, grads_n[pname]) > 0.99, (name, pname, cos(grad, grads_n[pname]))


def test_hyscale_layer_on_the_library_makes_no_host_sync():
    """At CP 1 HyScale's DSA layer on the library kernels (forward, recompute and backward)
    reads nothing back to the host from its own code: each such sync stalls the launch queue
    (measured: 28 per step before, worth about 4% of the 8K step)."""
    import warnings

    from megatron.core import tensor_parallel
    from megatron.core.utils import _missing_cudnn_dsa_kernel_dependencies

    from megatron_hyscale import replay

    missing = _missing_cudnn_dsa_kernel_dependencies()
    if missing:
        pytest.skip(f"megatron-core's cudnn backend misses {missing}")
    attn = build("none", stock=False, hyscale_kernels="cudnn")
    g = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(T, 1, GEOMETRY["hidden_size"], device="cuda", generator=g)
    hidden = hidden.to(torch.bfloat16).requires_grad_()

    def layer_step():
        out = tensor_parallel.checkpoint(lambda h: attn(h, None)[0], False, hidden)
        out.float().pow(2).mean().backward()

    layer_step()  # compiles and announces its kernels
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            layer_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    replay.clear()
    ours = [f"{w.filename}:{w.lineno}" for w in caught
            if "synchroniz" in str(w.message) and "megatron_hyscale" in w.filename]
    assert not ours, f"host syncs in HyScale's code: {ours}"


def test_hyscale_packed_thd_equals_stock_none():
    """Packed THD at a real size (4096 rows in documents of 1000, 2048 and 1048 tokens, the
    first shorter than top-k): HyScale's own path (no fallback) on the measured-best kernels
    against stock on `none`, same weights."""
    import warnings

    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = (1000, 2048, 1048)
    cu = torch.tensor([0, 1000, 3048, 4096], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    none = build("none", stock=True)
    hyscale = build("none", stock=False, hyscale_kernels="best")
    hyscale.load_state_dict(none.state_dict())
    g = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(T, 1, GEOMETRY["hidden_size"], device="cuda", generator=g)
    hidden = hidden.to(torch.bfloat16)
    results = []
    for attn in (none, hyscale):
        attn.train()
        h = hidden.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="HyScaleDSAttention",
                                    category=RuntimeWarning)
            out = attn(h, None, packed_seq_params=params)[0]
        out.float().pow(2).mean().backward()
        results.append((out.float().detach(), h.grad.float(),
                        {n: p.grad.float().clone() for n, p in attn.named_parameters()
                         if p.grad is not None}))
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    DSAIndexerLossLoggingHelper.tracker.clear()  # process-wide, sized by the first logger
    (out_n, dh_n, grads_n), (out_h, dh_h, grads_h) = results
    assert cos(out_h, out_n) > 0.999 and cos(dh_h, dh_n) > 0.999
    assert grads_h.keys() == grads_n.keys()
    for pname, grad in grads_h.items():
        assert cos(grad, grads_n[pname]) > 0.99, (pname, cos(grad, grads_n[pname]))

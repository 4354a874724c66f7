"""HyScale's DSA layer on Transformer Engine's linears and norms (`transformer_impl=
"transformer_engine"`, the TE path of its specs), against megatron-core's stock DSAttention built
by the same spec on the same weights: output, input gradient and every parameter's gradient,
with full recompute (selection replayed). Needs a GPU with transformer_engine importable
(scripts/te_carry.sh, scripts/gpu_te.sh on the lent H200); skipped, saying so, without it.
"""

from __future__ import annotations

import pytest
import torch
from test_stock_cudnn_gpu import GEOMETRY, T, cos  # the same shape and measure

from megatron_hyscale.specs import te_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not te_available(), reason="transformer_engine does not import"),
]

def build(stock: bool):
    from megatron.core.transformer.spec_utils import build_module

    from hyscale_bench.models import tiny_dsa_config
    from megatron_hyscale.specs import get_dsa_layer_specs

    cfg = tiny_dsa_config(transformer_impl="transformer_engine", ffn_hidden_size=4096,
                          num_layers=1, params_dtype=torch.bfloat16, bf16=True,
                          use_cpu_initialization=False, dsa_indexer_loss_coeff=0.01,
                          dsa_indexer_use_sparse_loss=True, recompute_granularity="full",
                          recompute_method="uniform", recompute_num_layers=1, **GEOMETRY)
    spec = get_dsa_layer_specs(cfg, stock=stock)[0].submodules.self_attention
    torch.manual_seed(0)
    return build_module(spec, config=cfg, layer_number=1).cuda().to(torch.bfloat16)


def step(attn, hidden):
    from megatron.core import tensor_parallel

    attn.train()
    h = hidden.clone().requires_grad_()
    out = tensor_parallel.checkpoint(lambda x: attn(x, None)[0], False, h)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.float().clone() for n, p in attn.named_parameters() if p.grad is not None}
    return out.float().detach(), h.grad.float(), grads


def test_te_linears_in_hyscale_and_stock_layers_agree_under_recompute():
    stock, hyscale = build(stock=True), build(stock=False)
    te_modules = [type(m).__module__ for m in hyscale.modules()
                  if type(m).__module__.startswith(("transformer_engine",
                                                    "megatron.core.extensions"))]
    assert te_modules, "the TE path built no Transformer Engine module"
    hyscale.load_state_dict(stock.state_dict())
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(T, 1, GEOMETRY["hidden_size"], device="cuda", generator=g)
    hidden = hidden.to(torch.bfloat16)
    out_s, dh_s, grads_s = step(stock, hidden)
    out_h, dh_h, grads_h = step(hyscale, hidden)
    assert cos(out_h, out_s) > 0.999, cos(out_h, out_s)
    assert cos(dh_h, dh_s) > 0.999, cos(dh_h, dh_s)
    assert grads_h.keys() == grads_s.keys()
    for name, grad in grads_h.items():
        assert cos(grad, grads_s[name]) > 0.99, (name, cos(grad, grads_s[name]))

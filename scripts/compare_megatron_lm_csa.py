"""HyScale's DeepSeek-V4 attention beside Megatron-LM's own CSA (`csa.py`, `dev` branch), on CPU.

Megatron-LM's DeepSeek-V4 attention lives on its `dev` branch only
(megatron/core/transformer/experimental_attention_variant/csa.py; checked at commit f0fdb2d6,
PR #4458), for a newer megatron-core than the 0.19.2 HyScale pins. This script loads that file
by path (nothing of it is part of HyScale) and runs its `CompressedSparseAttention` for window
(ratio 0), CSA (4) and HCA (8) layers next to `HyScaleV4Attention` on the same random weights,
fp32, and prints the largest output difference per layer and length.

What is shimmed so that it runs with megatron-core 0.19.2 (each a stand-in for a piece the dev
branch adds, not a change of semantics):
- `fused_mla_rope_inplace` (imported unguarded, missing in 0.19.2): None, the unfused path;
- `apply_rotary_pos_emb(inverse=, mla_output_remove_interleaving=)`: HyScale's own rotary
  function with those two options (csa.py rotates the output back);
- the indexer's Hadamard rotation (`rotate_activation`, a CUDA package): the identity, or with
  --hadamard an explicit orthonormal Hadamard matrix (scores are equal either way, up to
  rounding: the rotation is applied to both q and k);
- `fused_qk_topk_naive`: scores ReLU'd, weighted, summed, masked, then torch.topk, as at that
  commit (0.19.2's version fills masked picks with -1, which csa.py reads as the last token);
- the config fields `csa_window_size` and `csa_dense_mode`, set on an MLATransformerConfig.
The outer projections of Megatron-LM's `DSv4HybridSelfAttention` (it needs Transformer Engine)
are HyScale's own modules here: the comparison covers the core attention (compressors,
indexer, selection, window, sinks, sparse softmax), which is where the two implementations
differ in code.

Get the file, then run (exit 0 when every difference is within --tol):
  git -C /path/to/Megatron-LM show f0fdb2d6:megatron/core/transformer/\\
experimental_attention_variant/csa.py > /tmp/mlm_csa.py
  python scripts/compare_megatron_lm_csa.py --csa /tmp/mlm_csa.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

RATIOS = (0, 4, 8)  # window only, CSA (the CSA ratio), HCA (any other positive ratio)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csa", required=True,
                   help="Megatron-LM's csa.py (dev branch), e.g. from `git show f0fdb2d6:...`")
    p.add_argument("--seq", type=int, nargs="+", default=[3, 40],
                   help="sequence lengths (3: no compressed entry yet; 40: several)")
    p.add_argument("--hadamard", action="store_true",
                   help="rotate the indexer's q and k by an explicit Hadamard matrix")
    p.add_argument("--tol", type=float, default=1e-5, help="largest accepted difference")
    p.add_argument("--out", default=None, help="also write the results here (JSON)")
    args = p.parse_args(argv)
    if not os.path.isfile(args.csa):
        p.error(f"--csa: no such file {args.csa!r}")
    if any(t < 1 for t in args.seq):
        p.error("--seq values must be positive")
    return args


def rotary(t: torch.Tensor, freqs: torch.Tensor, config: object = None, cu_seqlens: object = None,
           mscale: float = 1.0, cp_group: object = None, mla_rotary_interleaved: bool = False,
           inverse: bool = False, mla_output_remove_interleaving: bool = False) -> torch.Tensor:
    """megatron-core 0.19.2's bshd rotary embedding plus the dev branch's two options:
    `inverse` rotates back (the angles negated), `mla_output_remove_interleaving` restores the
    interleaved channel order of the rotated part."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if freqs.dim() == t.dim() + 1 and freqs.size(-2) == 1:
        freqs = freqs.squeeze(-2)
    out = _apply_rotary_pos_emb_bshd(t, -freqs if inverse else freqs, mscale=mscale,
                                     mla_rotary_interleaved=mla_rotary_interleaved)
    if not (mla_rotary_interleaved and mla_output_remove_interleaving):
        return out
    rot = freqs.shape[-1]
    a, b = out[..., :rot].chunk(2, dim=-1)
    return torch.cat((torch.stack((a, b), dim=-1).flatten(-2), out[..., rot:]), dim=-1)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ H / sqrt(n), H the Sylvester Hadamard matrix of x's (power-of-two) last size."""
    n = x.size(-1)
    h = torch.ones(1, 1, dtype=x.dtype)
    while h.size(0) < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x @ (h * n ** -0.5)


def topk_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer scores sum_h w_h ReLU(q_h . k) [b, s, t] (+ mask) and their top-k indices."""
    s = torch.einsum("sbhd,tbd->sbht", q.float(), k.float()).relu()
    s = (s * weights.unsqueeze(-1)).sum(2).transpose(0, 1)
    if mask is not None:
        s = s + mask
    return s, s.topk(min(topk, k.size(0)), dim=-1)[1]


def load_csa(path: str, use_hadamard: bool) -> types.ModuleType:
    import megatron.core.fusions.fused_mla_yarn_rope_apply as fused_rope

    if not hasattr(fused_rope, "fused_mla_rope_inplace"):
        fused_rope.fused_mla_rope_inplace = None  # absent in 0.19.2: the unfused path runs
    spec = importlib.util.spec_from_file_location("megatron_lm_csa", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.apply_rotary_pos_emb = rotary
    module.rotate_activation = hadamard if use_hadamard else (lambda x: x)
    module.fused_qk_topk_naive = topk_scores
    return module


# HyScale parameter name -> Megatron-LM core-attention parameter name.
def weight_map() -> dict[str, str]:
    names = {"sinks": "attn_sink",
             "indexer.linear_q_b.weight": "indexer.linear_wq_b.weight",
             "indexer.linear_weights.weight": "indexer.linear_weights_proj.weight"}
    for prefix in ("compressor.", "indexer.compressor."):
        names.update({prefix + "linear_kv.weight": prefix + "linear_wkv.weight",
                      prefix + "linear_gate.weight": prefix + "linear_wgate.weight",
                      prefix + "position_bias": prefix + "ape",
                      prefix + "kv_norm.weight": prefix + "norm.weight"})
    return names


def compare_layer(csa: types.ModuleType, ratio: int, T: int, seed: int = 0) -> float:
    """max |Megatron-LM - HyScale| of one layer's output for T tokens."""
    from megatron.core.models.common.embeddings import RotaryEmbedding
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from hyscale_bench import models
    from megatron_hyscale.layers.deepseek_v4 import HyScaleV4Attention
    from megatron_hyscale.layers.linear import LocalLinear

    cfg = models.tiny_v4_config(csa_ratio=4, hca_ratio=8, window=5, index_topk=3)
    g = models.TINY_V4_GEOMETRY
    layer = RATIOS.index(ratio) + 1
    torch.manual_seed(seed)
    ours = HyScaleV4Attention(cfg, layer_number=layer).eval()
    models.randomize_(ours, seed)
    theta = cfg.v4_compress_rope_theta if ratio else cfg.v4_rope_theta
    nope = g["head_dim"] - g["rope_dim"]
    mcfg = MLATransformerConfig(
        num_layers=len(RATIOS), hidden_size=g["hidden_size"],
        num_attention_heads=g["num_attention_heads"], v_head_dim=g["head_dim"],
        qk_head_dim=nope, qk_pos_emb_head_dim=g["rope_dim"], q_lora_rank=g["q_lora_rank"],
        kv_lora_rank=nope, rope_type="rope", rotary_base=theta, layernorm_epsilon=1e-6,
        dsa_indexer_n_heads=g["index_n_heads"], dsa_indexer_head_dim=g["index_head_dim"],
        dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.0, params_dtype=torch.float32,
        add_bias_linear=False, **models.LOCAL_UNFUSED_FIELDS)
    mcfg.csa_window_size, mcfg.csa_dense_mode = cfg.v4_sliding_window, False  # dev-only fields
    rope = RotaryEmbedding(g["rope_dim"], rotary_percent=1.0, rotary_base=theta,
                           use_cpu_initialization=True)
    compressor = ModuleSpec(module=csa.Compressor, submodules=csa.CompressorSubmodules(
        linear_wkv=LocalLinear, linear_wgate=LocalLinear, norm=WrappedTorchNorm))
    indexer = ModuleSpec(module=csa.CSAIndexer, submodules=csa.CSAIndexerSubmodules(
        linear_wq_b=LocalLinear, linear_weights_proj=LocalLinear, compressor=compressor))
    pg = types.SimpleNamespace(cp=torch.distributed.new_group([0]), tp=None)
    theirs = csa.CompressedSparseAttention(
        mcfg, csa.CompressedSparseAttentionSubmodules(compressor=compressor, indexer=indexer),
        layer_number=layer, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=pg, rotary_pos_emb=rope, compress_ratio=ratio).eval()
    ours_p, theirs_p = dict(ours.named_parameters()), dict(theirs.named_parameters())
    mapping = {h: m for h, m in weight_map().items() if h in ours_p}
    missing = set(theirs_p) - set(mapping.values())
    if missing:
        raise RuntimeError(f"Megatron-LM parameters with no HyScale counterpart: {sorted(missing)}")
    with torch.no_grad():
        for h, m in mapping.items():
            theirs_p[m].copy_(ours_p[h])
        x = torch.randn(T, 1, g["hidden_size"], generator=torch.Generator().manual_seed(seed))
        expected = ours(x)[0]
        # DSv4HybridSelfAttention's outer projections, on HyScale's modules and weights.
        qr = ours.q_a_norm(ours.linear_q_a(x)[0])
        q = ours.linear_q_b(qr)[0].view(T, 1, g["num_attention_heads"], g["head_dim"])
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6)
        kv = ours.kv_norm(ours.linear_kv(x)[0]).unsqueeze(-2)
        freqs = rope(T)

        def rotate(z: torch.Tensor, inverse: bool = False) -> torch.Tensor:
            return torch.cat([z[..., :nope], rotary(
                z[..., nope:], freqs, mla_rotary_interleaved=True, inverse=inverse,
                mla_output_remove_interleaving=True)], dim=-1)

        q, kv = rotate(q), rotate(kv)
        out = theirs(q, kv, kv, None, x=x, qr=qr)
        out = rotate(out.view(T, 1, g["num_attention_heads"], -1), inverse=True)
        out = ours.linear_o_a(out.reshape(T, 1, cfg.v4_o_groups, -1))
        got = ours.linear_o_b(out)[0]
    return float((got - expected).abs().max())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hyscale_bench.cpu import init_single_process, megatron_on_cpu

    rows = []
    with megatron_on_cpu():
        init_single_process()
        csa = load_csa(args.csa, args.hadamard)
        for ratio in RATIOS:
            for T in args.seq:
                diff = compare_layer(csa, ratio, T)
                rows.append(dict(ratio=ratio, T=T, max_abs_diff=diff, ok=diff <= args.tol))
                print(f"ratio {ratio:3d} ({['window', 'CSA', 'HCA'][RATIOS.index(ratio)]}), "
                      f"T = {T:4d}: max |Megatron-LM - HyScale| = {diff:.2e} "
                      f"({'ok' if diff <= args.tol else 'OVER ' + format(args.tol, '.0e')})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(csa=os.path.abspath(args.csa), hadamard=args.hadamard, tol=args.tol,
                           rows=rows), f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

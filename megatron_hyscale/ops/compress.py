"""DeepSeek-V4 KV compressors (CSA and HCA) and V4's interleaved partial RoPE (plain torch; on
CUDA the RoPE and the norm before it run Triton kernels with the same roundings).

Semantics follow transformers' `deepseek_v4` (the independent oracle, >= 5.17) in its
stateless (no cache, whole-sequence) mode, which is the training mode:

- Only complete windows are compressed: a sequence of T tokens yields N = T // m entries and
  the trailing T % m tokens are ignored (they are reached through the sliding window only).
- Entry i pools window i (tokens [i*m, (i+1)*m)); it is positioned (RoPE) at i*m, the window's
  first token, although it summarizes tokens up to (i+1)*m - 1. Causality is therefore not in
  the position but in the visibility rule `compressed_visible_count`: entry i is visible to
  query t iff i < floor((t + 1) / m), i.e. iff its whole window is at or before t.
- HCA (`compress`, m' = 128 in V4-Flash): entry i = sum over the m slots j of window i of
  softmax_j(gate[j] + position_bias[j]) * kv[j], the softmax taken per channel.
- CSA (`compress_overlapping`, m = 4): each token projects to 2*D channels, two series
  Ca = [..., :D] and Cb = [..., D:]. Entry i pools 2m slots: Ca of window i-1 (slots 0..m-1)
  and Cb of window i (slots m..2m-1), softmax per channel over the 2m slots, with the learned
  bias position_bias[j] ([m, 2D], the same bias row for the j-th token of any window). Width 2m,
  stride m. Entry 0 has no previous window: its Ca slots get weight 0 (a -inf gate).
- Then RMSNorm over D (fp32, with a weight), then RoPE on the trailing `2 * len(inv_freq)`
  channels at position i*m.

RoPE here is V4's *interleaved* variant on the *trailing* rope channels: pairs (2j, 2j+1) of
the rope slice rotate by angle pos * inv_freq[j]. The main attention also applies the inverse
rotation (angle -pos * inv_freq) to its output at the query position (`inverse=True`).

Everything here is differentiable and has no Megatron imports.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from megatron_hyscale.ops.checks import check_rope_shapes
from megatron_hyscale.ops.rms_norm import rms_norm


def default_inv_freq(rope_dim: int, theta: float, device: torch.device | str | None = None
                     ) -> torch.Tensor:
    """fp32 [rope_dim // 2] inverse frequencies 1 / theta^(2j / rope_dim) (RoPE 'default')."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim
    return 1.0 / (theta ** exponents)


def yarn_inv_freq(rope_dim: int, theta: float, *, factor: float,
                  original_max_position_embeddings: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [rope_dim // 2] YaRN inverse frequencies (arXiv 2309.00071, "NTK-by-parts").

    Pair j keeps its original frequency (extrapolation) when it turns more than beta_fast times
    over the original context, is divided by `factor` (interpolation) when it turns fewer than
    beta_slow times, and blends linearly in between. The pair index where a frequency turns r
    times over L positions is d * ln(L / (2 pi r)) / (2 ln theta); with `truncate` the blend
    range is widened to whole pair indices (floor / ceil). V4 uses YaRN for the compress RoPE
    with the attention factor fixed to 1 (cos / sin are not rescaled), so only the frequencies
    matter here.
    """
    base = default_inv_freq(rope_dim, theta, device)

    def pair_index(rotations: float) -> float:
        return rope_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(theta))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)  # rope_dim - 1, not half: as transformers
    if high == low:
        high += 0.001  # a step instead of a ramp; avoids dividing by zero
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device=device) - low)
            / (high - low)).clamp(0, 1)  # 0: keep the frequency, 1: interpolate it
    return base / factor * ramp + base * (1 - ramp)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin of shape [*positions.shape, len(inv_freq)] (one angle per channel pair)."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)
    return angles.cos(), angles.sin()


def _rotate_pairs(rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 rotation of channel pairs (2j, 2j+1) by the angles of cos / sin, re-interleaved."""
    even, odd = rope[..., 0::2], rope[..., 1::2]
    # (even, odd) -> (even cos - odd sin, odd cos + even sin)
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


class _InterleavedRope(torch.autograd.Function):
    """The rotation of x's trailing channels, whose backward writes one gradient tensor.

    As plain ops (slice, rotate, cat), autograd's backward builds a zero-filled full-size
    gradient for each slice and adds them: three [..., D] tensors for one rotation (V4's
    queries: 2 GiB each at 32K tokens). The gradient of a rotation is the opposite rotation,
    computed here the same way (fp32, then x's dtype). With `triton` both directions run
    `kernels/interleaved_rope.py` (one read and one write of the tensor, bitwise these ops).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_axis: bool,
                triton: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.head_axis, ctx.triton = head_axis, triton
        return _rotate(x, cos, sin, head_axis, triton)

    @staticmethod
    @once_differentiable  # the kernel's output has no graph: no double backward on either path
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin, ctx.head_axis, ctx.triton), None, None, None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_axis: bool,
            triton: bool) -> torch.Tensor:
    """x rotated by (cos, sin) ([T, R/2] or [B, T, R/2]), a new contiguous tensor."""
    if triton:
        from megatron_hyscale.ops.kernels.interleaved_rope import interleaved_rope

        return interleaved_rope(x, cos, sin, x.shape[2] if head_axis else 1)
    if head_axis:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rope_dim = 2 * cos.shape[-1]
    out = x.clone(memory_format=torch.contiguous_format)
    out[..., -rope_dim:] = _rotate_pairs(x[..., -rope_dim:].float(), cos, sin)
    return out


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                           heads: bool = False, inverse: bool = False,
                           kernel: Literal["auto", "triton", "torch"] = "auto") -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x, pairing channels (2j, 2j+1).

    Args:
        x: [B, T, D] or, with heads=True, [B, T, H, D]; the rope slice is x[..., D - R:] with
            R = 2 * cos.shape[-1] (even D - R).
        cos, sin: [T, R/2] or [B, T, R/2] (B may be 1) from `rope_cos_sin` (broadcast over the
            head axis when heads=True).
        heads: x has a head axis before the channels.
        inverse: rotate by the opposite angle (V4 undoes the values' rotation on the output).
        kernel: "triton" one Triton kernel a direction, "torch" the plain ops, "auto"
            (default) Triton on CUDA, torch elsewhere; the values are the same bit for bit.

    Returns:
        x's dtype and shape (contiguous); the rotation itself is computed in fp32 (as V4 does).
    """
    cos, sin = _rope_inputs(x, cos, sin, heads, kernel)
    if inverse:
        sin = -sin
    triton = kernel == "triton" or (kernel == "auto" and x.is_cuda)
    return _InterleavedRope.apply(x, cos, sin, heads, triton)


def _rope_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: bool,
                 kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check x, cos, sin and kernel as `apply_interleaved_rope` takes them; cos and sin fp32,
    [T, R/2] where one batch row serves all."""
    check_rope_shapes(x, cos, sin, heads)
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'torch', got {kernel!r}")
    if cos.dim() == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    return cos.float(), sin.float()


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, *, heads: bool = False,
                  kernel: Literal["auto", "triton", "torch"] = "auto") -> torch.Tensor:
    """`apply_interleaved_rope(rms_norm(x, weight, eps), cos, sin, heads=heads)`: the same
    formulas and roundings (on the GPU the norm's row sums may add in another order than the
    norm-only kernel's: 1-ulp differences of the scale).

    x, cos, sin, heads as `apply_interleaved_rope` takes them; weight as `rms_norm`. kernel:
    "triton" one Triton kernel a direction (`kernels/rms_norm.py` with its RoPE epilogue: one
    read and one write of x where the two ops make two each), "torch" the chunked norm then the
    torch rotation (on any device), "auto" (default) Triton on CUDA, else the two ops as each
    picks its own (on the CPU: "torch"; on CUDA rows too wide for the kernels).
    """
    cos, sin = _rope_inputs(x, cos, sin, heads, kernel)
    fused = kernel == "triton"
    if kernel == "auto" and x.is_cuda:
        from megatron_hyscale.ops.kernels.rms_norm import unsupported_width

        fused = unsupported_width(x.shape[-1]) is None
    if fused:
        from megatron_hyscale.ops.kernels.rms_norm import Rope

        return rms_norm(x, weight, eps, kernel="triton",
                        rope=Rope(cos, sin, x.shape[2] if heads else 1))
    norm = "chunked" if kernel == "torch" else "auto"
    return apply_interleaved_rope(rms_norm(x, weight, eps, kernel=norm), cos, sin, heads=heads,
                                  kernel=kernel)


def compressed_visible_count(q_positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """floor((t + 1) / ratio): how many compressed entries query position t may read."""
    return torch.div(q_positions + 1, ratio, rounding_mode="floor")


def compressed_key_positions(num_entries: int, ratio: int,
                             device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [N] positions (i + 1) * ratio - 1 (the last token of window i).

    With these, the usual causal rule k_pos[i] <= t (HyTopK, the indexer loss) is exactly
    V4's i < floor((t + 1) / ratio): (i+1)*m - 1 <= t <=> (i+1)*m <= t+1 <=> i+1 <= floor((t+1)/m).
    (They are visibility positions only; RoPE uses i * ratio.)
    """
    return (torch.arange(num_entries, device=device, dtype=torch.int64) + 1) * ratio - 1


def _windows(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """[B, T, C] -> [B, T // ratio, ratio, C] over the complete windows (remainder dropped)."""
    B, T, C = x.shape
    n = T // ratio
    return x[:, : n * ratio].reshape(B, n, ratio, C)


def _finish(pooled: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
            ratio: int, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm then RoPE at position i * ratio for entries [B, N, D]."""
    if inv_freq is None or pooled.shape[1] == 0:
        return rms_norm(pooled, norm_weight, eps)
    positions = torch.arange(pooled.shape[1], device=pooled.device) * ratio
    cos, sin = rope_cos_sin(positions, inv_freq.to(pooled.device))
    return rms_norm_rope(pooled, norm_weight, eps, cos, sin)


def compress(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, ratio: int, *,
             norm_weight: torch.Tensor | None, eps: float,
             inv_freq: torch.Tensor | None) -> torch.Tensor:
    """HCA compressor: non-overlapping softmax-gated pooling of `ratio` tokens per entry.

    Args:
        kv: [B, T, D] projected tokens (V4: `compressor.kv_proj(x)`).
        gate: [B, T, D] gate logits (V4: `compressor.gate_proj(x)`).
        position_bias: [ratio, D] learned bias added to the gate of the j-th token of a window.
        ratio: window width and stride m' (128 in V4-Flash); T need not be a multiple.
        norm_weight: [D] RMSNorm weight (None: unweighted); eps: its epsilon.
        inv_freq: [R/2] RoPE inverse frequencies for the trailing R channels (None: no RoPE).

    Returns:
        [B, T // ratio, D] compressed entries (kv's dtype); entry i at RoPE position i * ratio.
    """
    if kv.shape != gate.shape or position_bias.shape != (ratio, kv.shape[-1]):
        raise ValueError(f"kv {tuple(kv.shape)} / gate {tuple(gate.shape)} / position_bias "
                         f"{tuple(position_bias.shape)} do not match ratio {ratio}")
    kv_w = _windows(kv, ratio)
    logits = _windows(gate, ratio) + position_bias
    probs = logits.softmax(dim=2, dtype=torch.float32).to(kv.dtype)  # per channel over slots
    return _finish((kv_w * probs).sum(dim=2), norm_weight, eps, ratio, inv_freq)


def compress_overlapping(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                         ratio: int, *, norm_weight: torch.Tensor | None, eps: float,
                         inv_freq: torch.Tensor | None) -> torch.Tensor:
    """CSA compressor: overlapping windows of width 2*ratio, stride ratio (see module doc).

    Args:
        kv: [B, T, 2D] projected tokens; [..., :D] is series Ca (read by the next window's
            entry), [..., D:] series Cb (read by its own window's entry).
        gate: [B, T, 2D] gate logits, same layout.
        position_bias: [ratio, 2D] learned gate bias per slot within a window.
        ratio: stride m (4 in V4-Flash); T need not be a multiple.
        norm_weight: [D] RMSNorm weight (None: unweighted); eps: its epsilon.
        inv_freq: [R/2] RoPE inverse frequencies for the trailing R channels (None: no RoPE).

    Returns:
        [B, T // ratio, D] compressed entries; entry i pools Ca of window i-1 and Cb of window i.
    """
    if kv.shape != gate.shape or kv.shape[-1] % 2 or position_bias.shape != (ratio, kv.shape[-1]):
        raise ValueError(f"kv {tuple(kv.shape)} / gate {tuple(gate.shape)} / position_bias "
                         f"{tuple(position_bias.shape)} do not match ratio {ratio} and 2D channels")
    D = kv.shape[-1] // 2
    kv_w = _windows(kv, ratio)                       # [B, N, m, 2D]
    logits = _windows(gate, ratio) + position_bias   # [B, N, m, 2D]
    B, N = kv_w.shape[:2]
    # Ca of the previous window; entry 0 gets a virtual window of zero values and -inf gates,
    # so its softmax runs over its own Cb slots only ([:, :N]: N may be 0).
    prev_kv = torch.cat([kv_w.new_zeros(B, 1, ratio, D), kv_w[:, :-1, :, :D]], dim=1)[:, :N]
    prev_logits = torch.cat(
        [logits.new_full((B, 1, ratio, D), float("-inf")), logits[:, :-1, :, :D]], dim=1)[:, :N]
    slots_kv = torch.cat([prev_kv, kv_w[..., D:]], dim=2)                # [B, N, 2m, D]
    slots_logits = torch.cat([prev_logits, logits[..., D:]], dim=2)
    probs = slots_logits.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    return _finish((slots_kv * probs).sum(dim=2), norm_weight, eps, ratio, inv_freq)

"""FP8 (e4m3) quantization of the lightning indexer's q and k, and the overlap of two selections.

The scheme is DeepSeek-V3.2's inference indexer (`inference/model.py` `Indexer.forward`,
`inference/kernel.py` `act_quant` and `fp8_index`, with its config's `scale_fmt="ue8m0"`):
- q [B, T, H, D]: one scale per (token, head); k [B, S, D]: one scale per token. (act_quant
  takes one scale per 128 channels, which is the whole head at V3.2's head dim of 128; here a
  scale always covers one head's D channels, whatever D is.)
- scale = 2^ceil(log2(max(amax, 1e-4) / 448)), a power of two (ue8m0), and
  x8 = e4m3(clamp(x / scale, -448, 448)), rounded to nearest even.
- score[t, s] = sum_h w[t, h] * relu(sq[t, h] * sk[s] * (q8[t, h] . k8[s])), the dot product
  accumulated in fp32. Scales are positive, so they leave the ReLU: the score is
  sk[s] * sum_h (w[t, h] * sq[t, h]) * relu(q8[t, h] . k8[s]), which is where the kernel applies
  them (q's scale folded into the head weight, k's multiplying the head sum), as DeepSeek's
  fp8_index does.
Power-of-two scales make every one of those multiplications exact in fp32, and the dequantized
values x8 * scale exact in fp32 and bf16 (4 significant bits), so the reference on the
dequantized tensors computes the same scores as the kernel up to the order of its fp32 sums:
bit for bit on integer-valued inputs.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# DeepSeek's act_quant floor on a block's amax: an all-zero row gets a finite scale.
AMAX_FLOOR = 1e-4
# Elements per chunk of the fp32 temporaries (256 MiB): q at 128K tokens x 64 x 128 is 1G.
CHUNK_ELEMENTS = 1 << 26
PRECISIONS = ("bf16", "fp8")


def check_precision(precision: object) -> str:
    """`precision` itself, or ValueError naming the argument."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return precision


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The ue8m0 scale of fp32 amax values: the smallest power of two >= max(amax, floor) / 448.

    Taken from the exponent (frexp), not from log2, so an exact power of two is not rounded up
    by a log's error; x / scale may still exceed 448 by the quotient's rounding, and the
    quantizer clamps it as DeepSeek's does.
    """
    mant, exp = torch.frexp(amax.float().clamp_min(AMAX_FLOOR) / FP8_MAX)
    return torch.ldexp(torch.ones_like(mant), torch.where(mant == 0.5, exp - 1, exp))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values (x's shape) and fp32 scales (x.shape[:-1]), one scale per last-dim row.

    x: [B, N, ..., D], any float dtype, any strides; chunked along dim 1 so the fp32
    temporaries stay near CHUNK_ELEMENTS.
    """
    x8 = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    per_index = max(1, x.numel() // max(1, x.shape[1]))
    step = max(1, CHUNK_ELEMENTS // per_index)
    for i0 in range(0, x.shape[1], step):
        xc = x[:, i0:i0 + step].float()
        s = pow2_scale(xc.abs().amax(-1))
        # Division by a power of two is exact; the cast is the only rounding.
        x8[:, i0:i0 + step] = (xc / s[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[:, i0:i0 + step] = s
    return x8, scale


def quantize_indexer(q: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q8 [B, T, H, D], q_scale fp32 [B, T, H], k8 [B, S, D], k_scale fp32 [B, S])."""
    q8, q_scale = quantize_rows(q)
    k8, k_scale = quantize_rows(k)
    return q8, q_scale, k8, k_scale


def dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 x8 * scale (exact: a 4-bit significand times a power of two)."""
    return x8.float() * scale[..., None]


# Index pairs per chunk of the overlap's sort (int64 temporaries of about 256 MiB).
OVERLAP_CHUNK_ELEMENTS = 1 << 25


def selection_overlap(indices: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row, the fraction of the reference's selected keys that `indices` also selected.

    indices, reference: int [..., k] (k may differ), each row's valid entries distinct, -1
    for an empty slot. Returns fp32 [...]: |A & B| / |B| (1 for a row whose reference is
    empty). A sort of the two rows together finds the shared keys (a key present in both is
    the only way to get two equal neighbours), in row chunks, so it runs at 128K rows x 2048.
    """
    lead = indices.shape[:-1]
    if reference.shape[:-1] != lead:
        raise ValueError(f"indices {tuple(indices.shape)} and reference "
                         f"{tuple(reference.shape)} must have the same leading dims")
    a = indices.reshape(-1, indices.shape[-1]).long()
    b = reference.reshape(-1, reference.shape[-1]).long()
    out = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    width = a.shape[1] + b.shape[1]
    step = max(1, OVERLAP_CHUNK_ELEMENTS // max(1, width))
    for r0 in range(0, a.shape[0], step):
        ac, bc = a[r0:r0 + step], b[r0:r0 + step]
        # Empty slots become distinct negatives so they never pair up.
        pad = -1 - torch.arange(width, device=a.device)
        both = torch.cat([ac, bc], dim=1)
        both = torch.where(both >= 0, both, pad).sort(dim=1).values
        shared = ((both[:, 1:] == both[:, :-1]) & (both[:, 1:] >= 0)).sum(1).float()
        n_ref = (bc >= 0).sum(1).float()
        out[r0:r0 + step] = torch.where(n_ref > 0, shared / n_ref.clamp_min(1.0), 1.0)
    return out.view(lead)

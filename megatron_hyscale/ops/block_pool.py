"""QSA (Qwen3.8-Flash-Next) block pooling, block visibility and block-to-token expansion.

QSA's indexer scores mean-pooled blocks of `block_size` (4) consecutive keys instead of tokens,
keeps the top `budget // block_size` blocks of each query and attends to their tokens plus the
partial causal tail (the query's own incomplete block). These are the plain-torch pieces around
that selection; the scoring itself runs through `ops.hytopk` (or `select_blocks_reference`, the
materialized baseline). No Megatron imports.

Semantics (those of transformers' `Qwen4ExpTextQSAIndexer` on a causal mask without padding):
- Only complete blocks are pooled: a sequence of S tokens has `S // block_size` blocks; block b
  covers tokens [b * block_size, (b + 1) * block_size). The keys of a trailing incomplete block
  are reached only through the tails.
- Query at position t sees the complete blocks among tokens 0..t: block b is visible iff
  b < (t + 1) // block_size. As positions for HyTopK's rule `k_pos <= q_pos`: give block b the
  position of its last token, k_pos[b] = b * block_size + block_size - 1, and the query its own
  position. Then k_pos[b] <= t  <=>  (b + 1) * block_size <= t + 1  <=>  b < (t + 1) // block_size.
- Pooling is the fp32 mean of the block's raw keys, cast back to the keys' dtype (the caller
  then applies the key RMSNorm and RoPE at the block's first position, `block_first_positions`).
- The selected blocks expand to their block_size tokens each; the tail is tokens
  [((t + 1) // block_size) * block_size, t], 0 to block_size - 1 tokens, always attended. A query
  whose own block is complete (t + 1 divisible by block_size) has an empty tail, and its own
  token is attended only if its block is selected.
"""

from __future__ import annotations

import torch

from megatron_hyscale.ops.checks import INT_DTYPES, check_positive_int, check_tensor


def num_complete_blocks(seq_len: int, block_size: int) -> int:
    """Number of complete blocks of `block_size` tokens in a sequence of `seq_len` tokens."""
    check_positive_int("block_size", block_size)
    return seq_len // block_size


def pool_blocks(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean over each complete block of `block_size` consecutive keys.

    Args:
        keys: [B, S, D] raw (un-normalized, un-rotated) keys; S need not be a multiple of
            block_size.

    Returns:
        [B, S // block_size, D] pooled keys in keys' dtype: the mean is taken in fp32 and cast
        back (as transformers does), so bf16 runs round once, after the mean.
    """
    check_tensor("keys", keys, ndim=3)
    check_positive_int("block_size", block_size)
    B, S, D = keys.shape
    nb = S // block_size
    blocks = keys[:, : nb * block_size].reshape(B, nb, block_size, D)
    return blocks.float().mean(dim=2).to(keys.dtype)


def block_first_positions(
    num_blocks: int, block_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 [num_blocks] token index of each block's first token (where its RoPE is taken)."""
    return torch.arange(num_blocks, device=device, dtype=torch.int64) * block_size


def block_visibility_positions(
    num_blocks: int, block_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 [num_blocks] HyTopK key positions: each block's last token, b * bs + bs - 1.

    With these, HyTopK's `k_positions[b] <= q_positions[t]` is exactly QSA's
    `b < (t + 1) // block_size` (see the module docstring).
    """
    return block_first_positions(num_blocks, block_size, device) + (block_size - 1)


def expand_blocks(
    block_indices: torch.Tensor, q_positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Token indices of the selected blocks followed by each query's causal tail.

    Args:
        block_indices: int32/int64 [B, T, Kb] selected block ids (-1 = empty slot), e.g.
            HyTopK's output. Kb may be 0.
        q_positions: int [T] or [B, T] position of each query in the key sequence (token index;
            keys are numbered from 0 in sequence order).
        block_size: tokens per block.

    Returns:
        int32 [B, T, Kb * block_size + block_size - 1]: for slot j < Kb the tokens
        block * bs + [0, bs) (or -1 for an empty slot), then the tail tokens
        ((t + 1) // bs) * bs + [0, bs - 1) that are <= t (-1 past the tail). Entries within a
        row are distinct: selected blocks are complete (end at or before the tail's start).
    """
    check_tensor("block_indices", block_indices, ndim=3, dtypes=INT_DTYPES)
    check_tensor("q_positions", q_positions, ndim=(1, 2), dtypes=INT_DTYPES)
    check_positive_int("block_size", block_size)
    B, T, Kb = block_indices.shape
    device = block_indices.device
    qpos = q_positions.to(device=device, dtype=torch.int64)
    if tuple(qpos.shape) not in ((T,), (B, T)):
        raise ValueError(f"q_positions must be [T={T}] or [B={B}, T={T}], got "
                         f"{tuple(q_positions.shape)}")
    qpos = qpos.expand(B, T)
    offsets = torch.arange(block_size, device=device, dtype=torch.int64)
    blocks = block_indices.to(torch.int64)
    tokens = blocks.unsqueeze(-1) * block_size + offsets  # [B, T, Kb, bs]
    tokens = tokens.masked_fill(blocks.unsqueeze(-1) < 0, -1).reshape(B, T, Kb * block_size)
    tail_start = torch.div(qpos + 1, block_size, rounding_mode="floor") * block_size
    tail = tail_start.unsqueeze(-1) + offsets[: block_size - 1]  # [B, T, bs - 1]
    tail = tail.masked_fill(tail > qpos.unsqueeze(-1), -1)
    return torch.cat([tokens, tail], dim=-1).to(torch.int32)


def block_scores(
    q: torch.Tensor, block_keys: torch.Tensor, scale: float, *, relu: bool = True
) -> torch.Tensor:
    """Materialized QSA block scores: scale * sum_h act(q[t, h] . k[b]) in fp32.

    Args:
        q: [B, T, H, D] indexer queries (normalized and rotated).
        block_keys: [B, NB, D] pooled, normalized, rotated block keys.
        scale: the score scale (transformers uses D^-0.5; it does not change the ranking).

    Returns:
        fp32 [B, T, NB]; no visibility mask applied.
    """
    logits = torch.einsum("bthd,bnd->bthn", q.float(), block_keys.float())
    if relu:
        logits = logits.relu()
    return logits.sum(dim=2) * scale


def select_blocks_reference(
    q: torch.Tensor,
    block_keys: torch.Tensor,
    topk: int,
    *,
    scale: float,
    q_positions: torch.Tensor,
    block_size: int,
    relu: bool = True,
    rows_per_chunk: int | None = None,
) -> torch.Tensor:
    """The baseline selection: block scores materialized, masked, then `torch.topk`.

    This is the stock-style path (a [rows, NB] score table per chunk of query rows, and
    torch.topk, whose choice among tied scores is unspecified), kept to compare HyTopK against.

    Args:
        q: [B, T, H, D] indexer queries; block_keys: [B, NB, D] block keys.
        topk: blocks kept per query (the budget in blocks).
        scale: score scale; q_positions: int [T] token position of each query.
        rows_per_chunk: query rows scored at once (None: all T).

    Returns:
        int32 [B, T, topk] selected block ids, -1 where a query sees fewer than topk blocks
        (and everywhere when NB == 0). Order within a row: torch.topk's (score descending).
    """
    check_tensor("q", q, ndim=4)
    check_tensor("block_keys", block_keys, ndim=3)
    check_positive_int("topk", topk)
    B, T = q.shape[:2]
    nb = block_keys.shape[1]
    out = torch.full((B, T, topk), -1, dtype=torch.int32, device=q.device)
    if nb == 0:
        return out
    kk = min(topk, nb)
    qpos = q_positions.to(device=q.device, dtype=torch.int64).reshape(-1)
    kpos = block_visibility_positions(nb, block_size, q.device)
    step = rows_per_chunk or T
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        scores = block_scores(q[:, t0:t1], block_keys, scale, relu=relu)  # [B, t, NB]
        visible = kpos.unsqueeze(0) <= qpos[t0:t1].unsqueeze(1)  # [t, NB]
        scores = scores.masked_fill(~visible, float("-inf"))
        top_scores, top = scores.topk(kk, dim=-1)
        out[:, t0:t1, :kk] = top.masked_fill(top_scores == float("-inf"), -1).to(torch.int32)
    return out

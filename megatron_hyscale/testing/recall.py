"""The indexer's recall of the true attention: which keys carry the mass, and were they selected?

For one query row t of one layer, the true attention is the dense causal softmax of the main
(absorbed MLA) attention, averaged over the heads: p[t, s] = mean_h softmax_s(q[t,h] . k[s] *
scale) over the visible keys s <= t. This is the distribution the DSA indexer's KL loss trains
towards (megatron-core sums the heads and L1-normalizes, which is the same). The "mass set" of
the row is the smallest set of keys whose p sums to at least `mass` (0.9 by default), taken in
descending p (ties broken by the smaller key index, so the set is well defined). The row's
recall is |mass set ∩ indexer's top-k| / |mass set|, and the row's covered mass is the sum of
p over the indexer's top-k. Both are averaged over the rows asked for (here: the rows whose
next token is an answer of the recall task) and the batch.

Everything here is plain torch on the tensors the layer already sees, so it works the same for
megatron-core's stock DSAttention and for HyScale's drop-in.
"""

from __future__ import annotations

import torch


def head_mean_attention(
    query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Dense causal attention probabilities of `rows`, averaged over heads.

    Args:
        query: [sq, b, heads, d] (megatron's sbhd layout; absorbed MLA query).
        key: [sk, b, 1 or heads, d] (absorbed MLA: one latent head shared by all query heads).
        rows: int64 [R] query positions (row t sees keys s <= t + sk - sq).
        softmax_scale: the attention's logit scale.

    Returns:
        fp32 [b, R, sk], each row summing to 1 over its visible keys.
    """
    sq, sk = query.size(0), key.size(0)
    q = query.index_select(0, rows).float()  # [R, b, h, d]
    k = key.float()
    if k.size(2) == 1:
        k = k.expand(-1, -1, q.size(2), -1)
    logits = torch.einsum("rbhd,sbhd->bhrs", q, k) * softmax_scale
    visible = torch.arange(sk, device=q.device)[None, :] <= (rows[:, None] + (sk - sq))
    logits = logits.masked_fill(~visible[None, None], float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=1)


def selection_recall(
    probs: torch.Tensor, selected: torch.Tensor, mass: float = 0.9
) -> dict[str, float]:
    """Recall of the mass set by the selected keys, and the attention mass the selection covers.

    Args:
        probs: fp32 [b, R, sk] attention rows (each sums to 1), e.g. `head_mean_attention`.
        selected: int [b, R, k] selected key indices per row; -1 entries are ignored.
        mass: the share of each row's attention that defines its mass set, in (0, 1].

    Returns:
        {"recall": mean over rows of |mass set ∩ selected| / |mass set|,
         "covered_mass": mean over rows of the attention mass on the selected keys,
         "mass_set_size": mean size of the mass set}.
    """
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    b, r, sk = probs.shape
    if selected.shape[:2] != (b, r):
        raise ValueError(f"selected must be [{b}, {r}, k], got {tuple(selected.shape)}")
    # Stable sort on -p keeps equal probabilities in key order: the mass set is deterministic.
    order = torch.sort(-probs, dim=-1, stable=True).indices
    sorted_p = probs.gather(-1, order)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each key
    # A key joins the set while the mass before it is still short of the target. The tolerance
    # keeps fp32 rounding of a row that sums to 1 from adding a spurious extra key.
    in_set_sorted = before < mass - 1e-6
    in_set = torch.zeros_like(in_set_sorted).scatter(-1, order, in_set_sorted)

    valid = selected >= 0
    # Count hits per key (scatter-add, so a -1 slot clamped onto key 0 cannot erase a real one).
    chosen = torch.zeros(b, r, sk, dtype=torch.int32, device=probs.device)
    chosen = chosen.scatter_add_(-1, selected.long().clamp_min(0), valid.int()) > 0
    set_size = in_set.sum(-1).float()
    hits = (in_set & chosen).sum(-1).float()
    covered = (probs * chosen).sum(-1)
    return {
        "recall": (hits / set_size).mean().item(),
        "covered_mass": covered.mean().item(),
        "mass_set_size": set_size.mean().item(),
    }

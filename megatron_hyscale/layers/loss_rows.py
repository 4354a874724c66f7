"""How an attention layer's indexer loss weighs its query rows: padded rows left out
(`packed_seq_params.real_token_mask_q`), the loss cut into row parts.

megatron-core's DSA indexer loss is the mean of the rows' KL over the local query rows (their
sum with `calculate_per_token_loss`). A packed batch's `real_token_mask_q` marks the real rows
(this rank's local rows under context parallelism, as stock reads it): the padded ones still
select and attend, but take no part in the loss, whose mean is then over the valid rows.

A layer computes its loss in parts (row parts, packed documents): each part adds the share of
its rows (`IndexerLossRows.share`, with its rows' slice of the mask, `part`); with a mask every
part adds its valid rows' KL sum and `finish` divides the total once by the layer's valid-row
count, so the parts add up to the mean over the valid rows. The DSA, DeepSeek-V4 CSA and QSA
layers share this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.experimental_attention_variant import dsa_masking


@dataclass(frozen=True)
class IndexerLossRows:
    """The weighing of a layer's indexer loss over its `rows` local query rows."""

    rows: int
    per_token: bool  # megatron's calculate_per_token_loss: the KL sum, not the mean
    # real_token_mask_q as bool [b, rows] (rows outside it are left out of the loss) and its
    # fp32 count, at least 1 (the loss's mean is over it); None: every row counts.
    valid: torch.Tensor | None = None
    count: torch.Tensor | None = None

    @property
    def sums(self) -> bool:
        """Whether each part is its rows' KL sum (`calculate_per_token_loss` for the op): a
        per-token loss, or a row mask (whose mean `finish` takes)."""
        return self.per_token or self.valid is not None

    def share(self, n: int) -> float:
        """The loss coefficient's factor for a part of n rows: all of it when the part is a
        sum, else its share n / rows of the rows' mean."""
        return 1.0 if self.sums else n / self.rows

    def part(self, r0: int, r1: int) -> torch.Tensor | None:
        """The mask of the rows r0 .. r1 - 1 (the op's query_valid_rows), None without one."""
        return None if self.valid is None else self.valid[:, r0:r1]

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        """The parts' total as the layer's loss: with a mask (and a mean loss) divided by the
        valid rows' count."""
        return loss / self.count if self.valid is not None and not self.per_token else loss


def indexer_loss_rows(packed_seq_params: Any, *, b: int, rows: int, per_token: bool,
                      device: torch.device, layer: str) -> IndexerLossRows:
    """The weighing of an indexer loss over `rows` local query rows of batch size b, with the
    row mask `packed_seq_params.real_token_mask_q` where there is one (megatron's
    `extract_query_valid_rows_from_packed_seq_params` shapes it: [rows], [1, rows] or
    [b, rows]; else ValueError naming `layer` and the argument)."""
    try:
        valid = dsa_masking.extract_query_valid_rows_from_packed_seq_params(
            packed_seq_params, b=b, sq=rows, device=device)
    except ValueError as err:
        raise ValueError(f"{layer}: packed_seq_params.real_token_mask_q must cover the "
                         f"{rows} local query rows: {err}") from err
    count = None if valid is None else valid.sum(dtype=torch.float32).clamp_min(1.0)
    return IndexerLossRows(rows, per_token, valid, count)

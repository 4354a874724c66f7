"""`kernels/key_split.key_split`: each row's slot ranges by key range (the Gluon indexer-loss
backward's key passes), against its plain-torch reference and against what a pass needs: the
slots [split[p], split[p + 1]) hold exactly the row's keys in [p S // P, (p + 1) S // P)."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.ops.kernels.key_split import KEY_BLOCK, key_split, key_split_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _key_ordered(B, T, S, K, dtype, seed):
    """Rows of distinct keys in increasing order, then -1: some full, some short, one empty."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, T, K), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            n = min(K, S) if t % 3 else int(torch.randint(0, min(K, S) + 1, (1,), generator=g))
            idx[b, t, :n] = torch.randperm(S, generator=g)[:n].sort().values
    idx[0, 0] = -1  # a row with no key
    return idx.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("passes", [1, 2, 3, 5])
def test_matches_the_reference_and_splits_by_key(dtype, passes):
    B, T, S, K = 2, 7, 1001, KEY_BLOCK + 37  # K past one block, S not a multiple of passes
    idx = _key_ordered(B, T, S, K, dtype, seed=passes)
    got = key_split(idx, S, passes)
    assert got.dtype == torch.int32 and got.shape == (B * T, passes + 1)
    assert torch.equal(got, key_split_reference(idx, S, passes))
    rows = idx.reshape(B * T, K).long().cpu()
    split = got.cpu()
    for r in range(B * T):
        valid = int((rows[r] >= 0).sum())
        assert split[r, 0] == 0 and split[r, -1] == valid
        for p in range(passes):
            keys = rows[r, split[r, p]:split[r, p + 1]]
            assert bool(((keys >= p * S // passes) & (keys < (p + 1) * S // passes)).all())


def test_non_contiguous_indices():
    idx = _key_ordered(3, 5, 200, 64, torch.int32, seed=9).transpose(0, 1)  # batch stride 64
    assert not idx.is_contiguous()
    assert torch.equal(key_split(idx, 200, 4), key_split_reference(idx.contiguous(), 200, 4))


def test_empty_and_bad_passes():
    assert key_split(torch.empty(1, 0, 8, dtype=torch.int32, device=DEVICE), 8, 2).shape == (0, 3)
    idx = torch.zeros(1, 1, 4, dtype=torch.int32, device=DEVICE)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="passes must be an int >= 1"):
            key_split(idx, 8, bad)

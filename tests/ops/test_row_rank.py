"""row_rank.rank_values (the sample's threshold pick) against torch.topk's, under the Triton
interpreter on CPU, or on the GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from megatron_hyscale.ops.kernels import row_rank

# CPU tensors under the interpreter (tests/conftest.py sets it where there is no GPU), else CUDA.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def adversarial_table(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Small integers (many ties), with rows of -inf, of -0.0 beside 0.0, of subnormals, of
    one value, of huge magnitudes and of -inf tails (a row seeing few keys)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-3, 4, (rows, cols), generator=g).float()
    t[0] = float("-inf")
    t[1, : cols // 2], t[1, cols // 2:] = -0.0, 0.0
    t[2] = torch.randn(cols, generator=g) * 1e-40
    t[3] = 5.0
    t[4] = torch.randn(cols, generator=g) * 3e38
    t[5, 3:] = float("-inf")
    t[6] = -torch.rand(cols, generator=g)
    return t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [1, 7, 100, 2048])
def test_rank_values_equal_torch_topk(device, cols):
    """Ranks 1, the row's width and random ones between, on ties, -inf rows, -0.0 / 0.0 (a
    rank in the -0.0 half), subnormals, values near fp32's largest, rows of negatives, a width
    that is not a power of two; the values bit for bit."""
    table = adversarial_table(12, cols, seed=cols).to(device)
    g = torch.Generator().manual_seed(1)
    rank = torch.randint(1, cols + 1, (12,), generator=g)
    # rows 0 and 1 at their last rank: -inf, and the -0.0 half of a -0.0 / 0.0 row
    rank[0], rank[1], rank[-1] = 1, cols, cols
    rank = rank.to(device)
    got = row_rank.rank_values(table, rank)
    want = row_rank.rank_values_reference(table, rank)
    assert torch.equal(got, want)
    # -0.0 given as 0.0 (torch.equal takes them as equal: the bits tell)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.signbit(got[1])
    # the reference is torch.topk's value at the row's rank
    sorted_rows = table.sort(dim=1, descending=True).values
    assert torch.equal(want, sorted_rows.gather(1, rank[:, None] - 1)[:, 0] + 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_rank_values_on_strided_tables_and_int32_ranks(device):
    """A transposed (column-major) table and a row-sliced one, ranks as int32 or int64."""
    base = adversarial_table(40, 33, seed=5).to(device)
    table = base.t().contiguous().t()
    rank = torch.arange(1, 41, device=device).clamp(max=33)
    assert torch.equal(row_rank.rank_values(table, rank.int()),
                       row_rank.rank_values_reference(base, rank))
    sliced = base[::3]
    assert torch.equal(row_rank.rank_values(sliced, rank[::3]),
                       row_rank.rank_values_reference(sliced, rank[::3]))


def test_rank_values_reject_bad_inputs():
    table = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="table must be fp32"):
        row_rank.rank_values(table.double(), torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="rank must be an integer tensor"):
        row_rank.rank_values(table, torch.ones(4))
    with pytest.raises(ValueError, match=r"rank must have shape \(4,\)"):
        row_rank.rank_values(table, torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="no columns"):
        row_rank.rank_values(torch.zeros(4, 0), torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="at most"):
        row_rank.rank_values(torch.zeros(1, row_rank.MAX_COLUMNS + 1), torch.ones(1).long())
    assert row_rank.rank_values(torch.zeros(0, 8), torch.ones(0).long()).shape == (0,)


@pytest.mark.gpu
def test_rank_values_on_a_sample_table_at_scale():
    """A sample table as `sample_thresholds` builds it at 128K (8192 rows, 2048 sampled keys,
    -inf past each row's visible samples, bf16-rounded scores: ties), at its ranks."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, cols, stride = 8192, 2048, 64
    t = torch.arange(131072 - rows, 131072, device="cuda")
    table = torch.randn(rows, cols, device="cuda", generator=g).bfloat16().float()
    seen = t // stride + 1
    table[torch.arange(cols, device="cuda")[None] >= seen[:, None]] = float("-inf")
    table[:, ::7] = 0.0
    rank = torch.ceil(1.5 * 2048 * seen / (t + 1)).long().clamp(1)
    for r in (rank, torch.full_like(rank, 1), torch.full_like(rank, cols - 1)):
        assert torch.equal(row_rank.rank_values(table, r),
                           row_rank.rank_values_reference(table, r))

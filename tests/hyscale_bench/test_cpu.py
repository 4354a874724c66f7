"""The CPU redirect helper patches megatron's CUDA calls only inside its block."""

import torch
from megatron.core.tensor_parallel import random as mrandom

from hyscale_bench.cpu import init_single_process, megatron_on_cpu


def test_patches_are_scoped_to_the_block():
    before = (torch.cuda.current_device, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    with megatron_on_cpu():
        assert torch.cuda.current_device() == "cpu"
        assert isinstance(mrandom._get_cuda_rng_state(), torch.Tensor)
    after = (torch.cuda.current_device, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    assert before == after


def test_megatron_rng_fork_is_reproducible_on_cpu():
    with megatron_on_cpu():
        init_single_process(seed=7)
        tracker = mrandom.get_cuda_rng_tracker()
        outside_before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        # The fork restores the outer generator and advances its own stream.
        assert torch.equal(torch.get_rng_state(), outside_before)
        with tracker.fork():
            b = torch.rand(4)
        assert not torch.equal(a, b)
        init_single_process(seed=7)  # reseeding restarts the forked stream
        with mrandom.get_cuda_rng_tracker().fork():
            assert torch.equal(torch.rand(4), a)


def test_context_parallel_rope_slice_on_cpu():
    from megatron.core.models.common.embeddings import rope_utils

    class Group:
        def size(self):
            return 2

        def rank(self):
            return 1

    emb = torch.arange(16.0).view(8, 1, 1, 2)  # 8 positions = 2 * cp chunks of 2
    with megatron_on_cpu():
        got = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, Group())
    # rank 1 of cp 2 holds chunks 1 and 2 (positions 2, 3, 4, 5)
    assert torch.equal(got.flatten(), torch.arange(4.0, 12.0))

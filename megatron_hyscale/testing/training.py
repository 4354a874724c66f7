"""A tiny megatron-core training loop with distributed checkpoints (tests/reliability).

`Trainer` wraps one tiny GPT (DSA, V4 or QSA attention; HyScale or its stock / baseline
counterpart) in megatron's `DistributedDataParallel`, with megatron's optimizer
(`get_megatron_optimizer`: Adam, fp32) and its `OptimizerParamScheduler` (warm-up + cosine, so
the learning rate depends on the step), and saves / loads everything a resume needs as one
megatron distributed checkpoint (`dist_checkpointing.save/load`, `torch_dist` format):

- "model": the model's `sharded_state_dict()`;
- "optimizer": the optimizer's `sharded_state_dict(model_sd)` (Adam moments, step counts);
- "rng": a ShardedObject per rank: python `random`, numpy, the torch CPU generator, the CUDA
  generator where there is one, and megatron's RNG tracker states (`get_cuda_rng_tracker()`;
  on a CPU the tracker forks the CPU generator, `hyscale_bench.cpu.megatron_on_cpu`);
- "scheduler": `OptimizerParamScheduler.state_dict()` (learning rate, weight decay counters);
- "step": the number of steps taken. The data order is a function of the step alone (batch i is
  drawn from a generator seeded with `data_seed + i`), so the step is the data position.

What an exact resume needs (and `Trainer.load` restores): the parameters, the optimizer state, the
scheduler state, every RNG (dropout draws from the torch generator and from megatron's tracker)
and the data position. It must not need any selection replay state: a checkpoint is taken between
steps, when every selection recorded under activation recompute has been replayed; `save`
asserts it (`replay.assert_drained()`).

On a CPU, megatron's optimizer, DDP and checkpoint writer hard-code a few CUDA calls; the
`training_on_cpu()` context redirects them (see its docstring). Gradient clipping stays off
there (`clip_grad=0`): megatron's `clip_grad_by_total_norm_fp32` asserts CUDA tensors.

Run as a module it is the child process of the kill-and-resume test:
`python -m megatron_hyscale.testing.training --kind dsa --steps 6 --save-at 3 --ckpt DIR
--log LOSSES` appends one JSON line per step to LOSSES, saves at step 3 and prints "saved";
`--resume DIR` starts from a checkpoint instead of from scratch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import numpy as np
import torch

from megatron_hyscale import replay

KINDS = ("dsa", "v4", "qsa")
VOCAB = 61
# Sequence length and micro-batch size per kind: T above each model's top-k / budget, so the
# selection is sparse (DSA top-32 of 64; V4 window 16 + top-8 of 16 compressed entries; QSA
# 32-token budget of 48).
SEQ = {"dsa": 64, "v4": 64, "qsa": 48}
BATCH = 2
FULL_RECOMPUTE: dict[str, Any] = dict(recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=1)


# ---------------------------------------------------------------------------------------------
# megatron's optimizer, DDP and checkpoint writer on a CPU
# ---------------------------------------------------------------------------------------------
class _CpuTorch:
    """`torch` as megatron's optimizer modules see it: `device='cuda'` scalars land on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **kwargs)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **kwargs)


class _NoStream:
    """The current "CUDA stream" on a CPU: nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


@contextlib.contextmanager
def training_on_cpu() -> Iterator[None]:
    """Redirect the CUDA calls megatron's training pieces make, inside the block (no-op with CUDA).

    - `megatron.core.optimizer.optimizer`, `.clip_grads` and `megatron.core.utils` create
      `device='cuda'` scalars (the FP32 optimizer's loss scale, the grad-norm buffers): they see a
      `torch` whose `tensor` / `zeros` drop the device argument;
    - DDP's grad sync asks for `torch.cuda.current_stream()` (to wait on CUDA-graph events) and
      the checkpoint writer calls `torch.cuda.synchronize()`: a no-op stream and a no-op sync;
    - the checkpoint writer logs its memory with psutil, which megatron-core does not depend
      on: without psutil the log reads 0.
    Use inside `hyscale_bench.cpu.megatron_on_cpu()`. DistributedOptimizer is not covered: it checks
    `param.type() == 'torch.cuda.FloatTensor'` for every parameter.
    """
    if torch.cuda.is_available():
        yield
        return
    import megatron.core.utils as core_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as optimizer_module

    with contextlib.ExitStack() as stack:
        for module in (optimizer_module, clip_grads, core_utils):
            stack.enter_context(mock.patch.object(module, "torch", _CpuTorch()))
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream",
                                              lambda *a, **k: _NoStream()))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None))
        if not getattr(filesystem_async, "HAVE_PSUTIL", True):
            stack.enter_context(mock.patch.object(filesystem_async, "_process_memory",
                                                  lambda: 0))
        yield


# ---------------------------------------------------------------------------------------------
# tiny models
# ---------------------------------------------------------------------------------------------
def tiny_config(kind: str, **overrides: Any) -> Any:
    """The kind's tiny transformer config (2 layers, fp32, local linears); overrides win."""
    if kind == "dsa":
        from hyscale_bench.models import tiny_dsa_config

        return tiny_dsa_config(**overrides)
    if kind == "v4":
        from megatron_hyscale.testing.deepseek_v4 import tiny_v4_configs

        # layer 1: sliding window only; layer 2: CSA (ratio 4) with the indexer and its KL loss
        fields = dict(compress_ratios=[0, 4], index_topk=8, window=16,
                      v4_indexer_loss_coeff=0.1)
        fields.update(overrides)
        return tiny_v4_configs(**fields)[0]
    if kind == "qsa":
        from megatron_hyscale.testing.qsa import tiny_qsa_configs

        fields = dict(num_layers=2, qsa_indexer_loss_coeff=0.1)
        fields.update(overrides)
        return tiny_qsa_configs(**fields)[0]
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def build_model(kind: str, config: Any, *, stock: bool) -> Any:
    """GPTModel of `kind` on the CPU generator's current state; `stock`: megatron-core's DSA
    (kind "dsa") or HyScale's baseline selection (V4, QSA: megatron-core has neither)."""
    from megatron.core.models.gpt import GPTModel

    from hyscale_bench.models import build_gpt, default_device

    if kind == "dsa":
        return build_gpt(config, stock=stock, vocab_size=VOCAB, max_sequence_length=SEQ[kind])
    if kind == "v4":
        from megatron_hyscale.specs.deepseek_v4 import get_v4_block_spec

        spec = get_v4_block_spec(config, baseline=stock)
        extra: dict[str, Any] = dict(position_embedding_type="none")
    else:
        from megatron_hyscale.specs.qsa import get_qsa_block_spec

        spec = get_qsa_block_spec(config, baseline=stock)
        extra = dict(position_embedding_type="rope", rotary_percent=0.5, rotary_base=10000)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ[kind], pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, **extra)
    return model.to(default_device())


def batch_at(kind: str, step: int, data_seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The micro-batch of training step `step` (0-based): a function of (data_seed, step)."""
    from hyscale_bench.models import default_device

    device = default_device()
    T = SEQ[kind]
    g = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
    ids = torch.randint(0, VOCAB, (BATCH, T), generator=g).to(device)
    labels = torch.randint(0, VOCAB, (BATCH, T), generator=g).to(device)
    return ids, torch.arange(T, device=device).expand(BATCH, T), labels


@contextlib.contextmanager
def topk_ties_by_index() -> Iterator[None]:
    """Stock / baseline selections break top-k ties by the smaller index, as HyTopK does
    (`torch.topk`'s choice among ties is unspecified; ReLU'd scores tie at 0 often)."""
    from megatron_hyscale.testing.stock import stock_topk_breaks_ties_by_index

    original = torch.topk

    def smallest_index_topk(x, k, dim=-1, largest=True, sorted=True, *, out=None):
        if not largest or out is not None:
            return original(x, k, dim=dim, largest=largest, sorted=sorted, out=out)
        values, order = torch.sort(x, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), order.narrow(dim, 0, k)))

    with stock_topk_breaks_ties_by_index(), \
            mock.patch.object(torch, "topk", smallest_index_topk), \
            mock.patch.object(torch.Tensor, "topk", smallest_index_topk):
        yield


# ---------------------------------------------------------------------------------------------
# RNG states
# ---------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every generator a step draws from (megatron-LM's checkpoint keeps the same ones)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state["cuda_rng_state"] is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def seed_everything(seed: int) -> None:
    """python, numpy, torch and megatron's RNG tracker, as a fresh training run does."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    loss: torch.Tensor  # the LM loss (mean over tokens), detached
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # main_grad per parameter


class Trainer:
    """One tiny GPT + megatron DDP + megatron optimizer + LR scheduler, on one data stream.

    seed: parameter initialization and the RNG streams (dropout). data_seed: the batches.
    """

    def __init__(self, kind: str, *, stock: bool = False, seed: int = 1234, data_seed: int = 0,
                 lr: float = 1e-3, warmup: int = 2, decay_steps: int = 1000,
                 **config_overrides: Any) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.kind, self.stock, self.data_seed = kind, stock, data_seed
        self.config = tiny_config(kind, **config_overrides)
        seed_everything(seed)
        module = build_model(kind, self.config, stock=stock)
        self.model = DistributedDataParallel(
            self.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.01,
                            bf16=False, fp16=False, params_dtype=torch.float32,
                            clip_grad=0.0),
            [self.model])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=warmup,
            lr_decay_steps=decay_steps, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
            wd_incr_steps=decay_steps, wd_incr_style="constant")
        self.step = 0

    @property
    def module(self) -> Any:
        """The GPTModel inside DDP."""
        return self.model.module

    def forward_backward(self, keep_grads: bool = False) -> StepResult:
        """This step's forward and backward (gradients in the DDP buffers), no update."""
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossLoggingHelper,
        )

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        DSAIndexerLossLoggingHelper.tracker.clear()
        ids, pos, labels = batch_at(self.kind, self.step, self.data_seed)
        loss = self.model(ids, pos, None, labels=labels).mean()
        loss.backward()
        self.model.finish_grad_sync()
        grads = {}
        if keep_grads:
            grads = {n: p.main_grad.detach().clone() for n, p in self.module.named_parameters()
                     if getattr(p, "main_grad", None) is not None}
        return StepResult(loss.detach(), grads)

    def train_step(self, keep_grads: bool = False) -> StepResult:
        """One training step: forward, backward, optimizer step, scheduler step."""
        result = self.forward_backward(keep_grads)
        update_successful, _, _ = self.optimizer.step()
        if not update_successful:
            raise RuntimeError(f"optimizer step {self.step} skipped (inf / nan gradients)")
        self.scheduler.step(increment=1)
        self.step += 1
        return result

    # -- checkpoints -----------------------------------------------------------------------------
    def _sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        rank = torch.distributed.get_rank()
        world = torch.distributed.get_world_size()
        model_sd = self.module.sharded_state_dict()
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
            "rng": ShardedObject("rng_state", rng_state(), (world,), (rank,)),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def save(self, directory: str) -> None:
        """A distributed checkpoint of everything a resume needs (see the module docstring)."""
        from megatron.core import dist_checkpointing

        # Between steps every recorded selection has been replayed: nothing of the selection
        # replay may be (or needs to be) part of a checkpoint.
        replay.assert_drained()
        os.makedirs(directory, exist_ok=True)
        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), directory)

    def load(self, directory: str, *, rng: bool = True) -> None:
        """Restore a `save` (of this or of the counterpart spec); `rng=False` keeps this
        process's generators (to show that a resume needs them)."""
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), directory)
        self.module.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if rng:
            set_rng_state(state["rng"])


# ---------------------------------------------------------------------------------------------
# the child process of the kill-and-resume test
# ---------------------------------------------------------------------------------------------
def _child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=KINDS, default="dsa")
    parser.add_argument("--steps", type=int, required=True, help="run until this step count")
    parser.add_argument("--save-at", type=int, default=None, help="save after this many steps")
    parser.add_argument("--ckpt", default=None, help="checkpoint directory to save to")
    parser.add_argument("--resume", default=None, help="checkpoint directory to start from")
    parser.add_argument("--log", required=True, help="file to append JSON lines to")
    parser.add_argument("--config", default="{}", help="JSON config overrides")
    args = parser.parse_args(argv)

    from hyscale_bench.cpu import init_single_process, megatron_on_cpu
    from megatron_hyscale.testing.quiet import quiet_megatron

    with quiet_megatron(), megatron_on_cpu() if not torch.cuda.is_available() \
            else contextlib.nullcontext(), training_on_cpu():
        init_single_process()
        trainer = Trainer(args.kind, **json.loads(args.config))
        if args.resume:
            trainer.load(args.resume)
        with open(args.log, "a") as log:
            while trainer.step < args.steps:
                step = trainer.step
                loss = trainer.train_step().loss
                log.write(json.dumps({"step": step, "loss": loss.item(),
                                      "hex": loss.item().hex()}) + "\n")
                log.flush()
                if args.save_at is not None and trainer.step == args.save_at:
                    trainer.save(args.ckpt)
                    print("saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))


# What megatron's and torch's checkpoint code say on every save / load (pytest filters).
CHECKPOINT_WARNING_FILTERS = (
    # megatron's own deprecation notice, printed on every dist_checkpointing.save
    "ignore:MCore's async save is deprecated",
    # importing megatron.core.optimizer imports its experimental MIMO config
    "ignore:MimoModelConfig is experimental:UserWarning",
    # torch.distributed.checkpoint's notices on every save / load
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning",
    "ignore:The argument order of load has been changed:UserWarning",
    "ignore:Please use DTensor instead and we are deprecating ShardedTensor:FutureWarning",
)

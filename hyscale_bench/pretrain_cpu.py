"""Run Megatron-LM's `pretrain_gpt.py` on CPUs (gloo): the evaluation's CPU smoke run.

    torchrun --nproc-per-node 1 -m hyscale_bench.pretrain_cpu PRETRAIN_GPT_PY [megatron args]
    torchrun --nproc-per-node 1 -m hyscale_bench.pretrain_cpu -m megatron_hyscale.launch.train_gpt \
        [megatron args]

The second form runs HyScale's own entry point (the evaluation's `--trainer hyscale`, for a
machine without a Megatron-LM checkout) the same way: it calls the same megatron.training.

Megatron-LM's training loop (`megatron.training`) assumes CUDA throughout: `device='cuda'`
factory calls, `.cuda()` moves, `torch.cuda.synchronize` in its timers, `set_device` in its
distributed setup, the allocator's statistics in its memory report. Nothing of that changes the
arithmetic, so this module redirects those calls to the CPU for the whole process and then runs
the script as `python pretrain_gpt.py` would (same `__main__`, same argv; a module as
`python -m` would). Why not a CPU mode in Megatron-LM: it has none
(`initialize_megatron(allow_no_cuda=True)` is not reachable from `pretrain`), and the CI
machine has no GPU but must run the real training loop.

What a CPU run reports differently, by design:
- the allocator's "max allocated" is the process's peak resident memory (`ru_maxrss`), the only
  memory figure a CPU has; the evaluation report labels it so.
- the process group is gloo (`--distributed-backend gloo` is appended unless given).
Use it for correctness and plumbing only: timings on a CPU say nothing about a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import resource
import runpy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from hyscale_bench.cpu import megatron_on_cpu

# torch factories megatron.training calls with device='cuda' (or a CUDA index)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "linspace")


def _cpu_device(device: Any) -> Any:
    """'cuda', 'cuda:N', torch.device('cuda') or an int index -> 'cpu'; anything else as is."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


def _on_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)
    return wrapped


def _peak_rss_bytes(*_: Any, **__: Any) -> int:
    """The process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tensor_to(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original(self, *args, **kwargs)
    return to


def _prebuilt_helpers() -> None:
    """megatron.training compiles the dataset helpers with `make` in the installed package,
    which a megatron-core wheel cannot (it ships them built, without the Makefile): use the
    built module, and fail naming it when it is missing."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as err:
        raise RuntimeError("megatron.core.datasets.helpers_cpp is not built in this "
                           "megatron-core installation; the dataset index cannot be "
                           f"built ({err})") from err
    print("> dataset helpers: using the built megatron.core.datasets.helpers_cpp", flush=True)


def _clip_grad_by_total_norm(parameters: Any, max_norm: float, total_norm: Any,
                             use_decoupled_grad: bool = False) -> None:
    """megatron's clip_grad_by_total_norm_fp32 (same scaling), without its assertion that the
    gradients are CUDA tensors."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(coeff, torch.Tensor):
        coeff = coeff.clamp_max(1.0)
    elif coeff >= 1.0:
        return
    for param in parameters:
        grad = param.decoupled_grad if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(coeff)


class _Stream:
    """torch.cuda.Stream stand-in: every operation already runs in order on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def megatron_training_on_cpu() -> Iterator[None]:
    """megatron-core's CPU redirections (`hyscale_bench.cpu.megatron_on_cpu`) plus
    megatron.training's: CUDA factories, moves, synchronization, streams and memory queries."""
    noop = lambda *a, **k: None  # noqa: E731
    with contextlib.ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        patch = lambda obj, name, value: stack.enter_context(  # noqa: E731
            mock.patch.object(obj, name, value))
        for name in _FACTORIES:
            patch(torch, name, _on_cpu(getattr(torch, name)))
        from megatron.core.datasets import utils as dataset_utils
        from megatron.training import training

        patch(dataset_utils, "compile_helpers", _prebuilt_helpers)
        from megatron.core.optimizer import clip_grads
        from megatron.core.optimizer import optimizer as core_optimizer

        for module in (clip_grads, core_optimizer):
            patch(module, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm)

        patch(training, "initialize_megatron",
              functools.partial(training.initialize_megatron, allow_no_cuda=True))
        patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
        patch(torch.Tensor, "to", _tensor_to(torch.Tensor.to))
        patch(torch.nn.Module, "cuda", lambda self, *a, **k: self)
        patch(torch.cuda, "device_count", lambda: 1)  # megatron sets up its groups only then
        patch(torch.cuda, "set_device", noop)
        patch(torch.cuda, "synchronize", noop)
        patch(torch.cuda, "empty_cache", noop)
        patch(torch.cuda, "Stream", _Stream)
        patch(torch.cuda, "current_stream", lambda *a, **k: _Stream())
        patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        patch(torch.cuda, "memory_allocated", lambda *a, **k: 0)
        patch(torch.cuda, "memory_reserved", _peak_rss_bytes)
        patch(torch.cuda, "max_memory_allocated", _peak_rss_bytes)
        patch(torch.cuda, "max_memory_reserved", _peak_rss_bytes)
        patch(torch.cuda, "reset_peak_memory_stats", noop)
        yield


USAGE = ("usage: torchrun ... -m hyscale_bench.pretrain_cpu {PRETRAIN_GPT_PY | -m MODULE} "
         "[ARGS]")


def main(argv: list[str] | None = None) -> int:
    """Run `argv[0]` (pretrain_gpt.py), or the module after `-m` (HyScale's
    megatron_hyscale.launch.train_gpt), with the rest as its arguments, on the CPU."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module = None
    if argv[:1] == ["-m"] and len(argv) > 1:
        module, args = argv[1], argv[2:]
    elif argv and argv[0].endswith(".py"):
        script, args = Path(argv[0]), argv[1:]
        if not script.is_file():
            print(f"error: {script} does not exist (the pretrain_gpt.py to run)",
                  file=sys.stderr)
            return 2
    else:
        print(USAGE, file=sys.stderr)
        return 2
    if "--distributed-backend" not in args:
        args += ["--distributed-backend", "gloo"]
    with megatron_training_on_cpu():
        if module is not None:
            sys.argv = [module, *args]  # run_module puts the module's file in argv[0]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [str(script), *args]
            sys.path.insert(0, str(script.parent))  # its gpt_builders / model_provider imports
            runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

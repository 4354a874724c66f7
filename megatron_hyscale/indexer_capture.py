"""A trained DSA indexer's tensors from inside a training run, for `scripts/bench_selection.py
--captured` (HyTopK's speed and its exact key-tile pruning on a trained selection).

Enabled by HYSCALE_INDEXER_CAPTURE=PATH and HYSCALE_INDEXER_CAPTURE_AT=N in a Megatron-LM run of
HyScale's DSA spec (`python -m megatron_hyscale.evaluate --capture-indexer-at N` sets both for
its HyScale run). At training iteration N, the first HyScale DSA layer whose forward runs (not
the recompute) computes its indexer's q, k and head weights from its inputs
(`indexer.forward_before_topk`, no gradient) and rank 0 saves the first sequence's to PATH in
the format the demo writes (`demo.capture_indexer`): q [1, T, H, D], k [1, T, D], weights
[1, T, H], batch-first, in the indexer's own dtype (bf16 in a GPU run: 134 MiB for GLM-5.1's
32 x 128 heads at 16K), with its ReLU setting, the top-k and where it came from. Nothing else
in the run changes. Not captured (warned once, naming why): context parallelism (each rank
holds a key shard) and packed THD sequences.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megatron_hyscale.launch.logparse import INDEXER_CAPTURE_AT_ENV as AT_ENV
from megatron_hyscale.launch.logparse import INDEXER_CAPTURE_ENV as PATH_ENV
from megatron_hyscale.launch.logparse import INDEXER_CAPTURE_LINE_PREFIX as LINE_PREFIX
from megatron_hyscale.ops.checks import warn_once
from megatron_hyscale.selection_agreement import iteration_now, unsupported_reason


def from_env() -> tuple[Path, int] | None:
    """(PATH, N) of HYSCALE_INDEXER_CAPTURE / _AT, None when the path is unset; a bad or
    missing iteration is an error naming the variable."""
    path = os.environ.get(PATH_ENV, "").strip()
    if not path:
        return None
    text = os.environ.get(AT_ENV, "").strip()
    try:
        at = int(text)
    except ValueError:
        at = 0
    if at < 1:
        raise ValueError(f"{AT_ENV} must be a training iteration >= 1 when {PATH_ENV} is set, "
                         f"got {text!r}")
    return Path(path), at


def capture(module: Any, x: torch.Tensor, qr: torch.Tensor, source: str) -> dict[str, Any]:
    """One DSA core-attention module's indexer tensors on its inputs x [sq, b, h] and qr
    [sq, b, q_lora], the first sequence, batch-first, on the CPU."""
    with torch.no_grad():
        q, k, w = module.indexer.forward_before_topk(x.detach()[:, :1], qr.detach()[:, :1])
    return {"q": q.transpose(0, 1).cpu().contiguous(),
            "k": k.transpose(0, 1).cpu().contiguous(),
            "weights": w.transpose(0, 1).float().cpu().contiguous(),
            "relu": bool(getattr(module.config, "dsa_indexer_scoring_relu", True)),
            "topk": int(module.indexer.index_topk), "source": source}


class IndexerCapture:
    """A forward pre-hook shared by a process's HyScale DSA core-attention modules: the first
    one to run a training forward at iteration `at` saves its indexer's tensors to `path`."""

    def __init__(self, path: Path, at: int) -> None:
        self.path, self.at = path, at
        self.done = False

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.done or not module.training or iteration_now() != self.at:
            return
        if torch._C._current_graph_task_id() != -1:  # the recompute inside backward
            return
        if getattr(module, "skip_topk", False):  # an index-sharing layer: the next one's
            return
        self.done = True  # one try, even if this layer cannot be captured
        reason = unsupported_reason(module, kwargs)
        if reason is not None:
            warn_once(f"hyscale-indexer-capture:{reason}",
                      f"indexer capture ({PATH_ENV}) not written: {reason}")
            return
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank != 0:
            return
        names = ("query", "key", "value", "attention_mask", "x", "qr")
        bound = dict(zip(names, args)) | kwargs
        source = (f"training run, layer {module.layer_number}, iteration {self.at}, "
                  "first sequence of the micro-batch")
        data = capture(module, bound["x"], bound["qr"], source)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(data, tmp)
        os.replace(tmp, self.path)  # never a half-written capture at PATH
        print(f"{LINE_PREFIX} layer {module.layer_number} iteration {self.at} "
              f"T={data['q'].shape[1]} -> {self.path}", flush=True)


_hook: IndexerCapture | None = None


def attach_from_env(core_attention: torch.nn.Module) -> bool:
    """With HYSCALE_INDEXER_CAPTURE set: hook `core_attention` (a HyScale DSA module) with the
    process's capture hook. Returns whether it was hooked."""
    global _hook
    setting = from_env()
    if setting is None or getattr(core_attention, "indexer", None) is None:
        return False
    if _hook is None or (_hook.path, _hook.at) != setting:
        _hook = IndexerCapture(*setting)
    core_attention.register_forward_pre_hook(_hook, with_kwargs=True)
    return True

"""Whether cuDNN-frontend's DSA kernels and FlashMLA's sparse forward can be imported here."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

CUDNN = "cudnn"  # cuDNN-frontend's DSA namespace (nvidia-cudnn-frontend >= 1.32)
FLASHMLA = "flashmla"  # FlashMLA's flash_mla_sparse_fwd (deepseek-ai/FlashMLA, nv_dev)
HOPPER = (9, 0)


@functools.cache
def _import(library: str) -> tuple[object | None, str | None]:
    """(module or function, None) or (None, why it does not import); asked once a process."""
    try:
        if library == CUDNN:
            from cudnn import DSA

            return DSA, None
        if library == FLASHMLA:
            from flash_mla import flash_mla_sparse_fwd

            return flash_mla_sparse_fwd, None
    except Exception as err:  # any import failure (missing wheel, ABI, CUDA) means "absent"
        return None, f"{library} does not import ({type(err).__name__}: {err})"
    raise ValueError(f"unknown library {library!r}")


def library_unavailable(library: str, device: torch.device | None = None) -> str | None:
    """None when `library` imports and `device` is a Hopper GPU, else the reason it cannot run."""
    if device is not None:
        if device.type != "cuda":
            return f"{library} runs on CUDA tensors only (got {device.type})"
        if torch.cuda.get_device_capability(device) != HOPPER:
            return (f"{library}'s kernels are built here for Hopper (sm_90) only, this GPU is "
                    f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    return _import(library)[1]


def cudnn_dsa() -> ModuleType:
    """cuDNN-frontend's DSA namespace; call library_unavailable(CUDNN) first."""
    module, reason = _import(CUDNN)
    if module is None:
        raise RuntimeError(reason)
    return module


def flash_mla_sparse_fwd():
    """FlashMLA's sparse prefill forward; call library_unavailable(FLASHMLA) first."""
    fn, reason = _import(FLASHMLA)
    if fn is None:
        raise RuntimeError(reason)
    return fn

"""Which kernels HyScale's layers ask the ops for: the measured best installed, or their own.

`config.hyscale_kernel_backend` (set it on the TransformerConfig the model is built from), else
$HYSCALE_KERNEL_BACKEND (for Megatron-LM's `--spec` launches, which build the config from the
command line), else "best":
- "best": per op and shape, the faster of HyScale's kernel and the library's (cuDNN-frontend's
  DSA kernels and FlashMLA, `pip install megatron-hyscale[cudnn]`), as measured in
  ops/backends/measured_defaults.json; the library only where it is installed and can run the
  call. Each op says once which it runs.
- "own": HyScale's Triton / Gluon kernels only (the reference on CPU).
- "cudnn": the library wherever it can run the call (one warning names each case it cannot).
"""

from __future__ import annotations

import os

ENV = "HYSCALE_KERNEL_BACKEND"
CHOICES = {"best": "best", "own": "auto", "cudnn": "cudnn"}


def kernel_backend(config: object) -> str:
    """The ops' `backend=` argument for a layer built from `config`."""
    value = getattr(config, "hyscale_kernel_backend", None) or os.environ.get(ENV) or "best"
    if value not in CHOICES:
        source = ("config.hyscale_kernel_backend" if getattr(config, "hyscale_kernel_backend",
                                                             None) else ENV)
        raise ValueError(f"{source} must be one of {sorted(CHOICES)}, got {value!r}")
    return CHOICES[value]

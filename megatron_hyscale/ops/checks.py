"""Input validation shared by the ops (every failure is a ValueError naming the argument), and
the one-time warnings of a fast path that cannot run."""

from __future__ import annotations

import math
import os
import warnings

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    x: object,
    *,
    ndim: int | tuple[int, ...],
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dims, got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {x.dtype}")
    return x


# Elements per isfinite() slice: its bool temporary stays at 64 MiB even for 1M-token inputs.
FINITE_CHECK_ELEMENTS = 1 << 26


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise if x has NaN or Inf; slices its longest dim so no full-size temporary is made."""
    if not x.is_floating_point() or x.numel() == 0:
        return
    dim = max(range(x.dim()), key=lambda d: x.shape[d])
    step = max(1, FINITE_CHECK_ELEMENTS // max(1, x.numel() // x.shape[dim]))
    ok = torch.ones((), dtype=torch.bool, device=x.device)
    for start in range(0, x.shape[dim], step):
        ok &= torch.isfinite(x.narrow(dim, start, min(step, x.shape[dim] - start))).all()
    if not bool(ok):  # the one host sync the ops make on their inputs
        raise ValueError(f"{name} contains NaN or Inf")


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_same_device(**tensors: torch.Tensor | None) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_backend(backend: str, allowed: tuple[str, ...] = ("auto", "triton", "reference")) -> str:
    if backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")
    return backend


def check_options[T](name: str, value: object, cls: type[T]) -> T:
    """A kernel option object of class cls (`kernels/options.py`); None gives cls.DEFAULT."""
    if value is None:
        return cls.DEFAULT
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be {cls.__name__} or None, got {type(value).__name__}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_softmax_scale(value: object) -> float:
    """softmax_scale must be a finite real number > 0 (bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {value!r}")
    return float(value)


def check_index_range(name: str, indices: torch.Tensor, num_keys: int) -> None:
    """Every entry must be -1 (ignored) or a key index in [0, num_keys)."""
    if indices.numel() == 0:
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < -1 or hi >= num_keys:
        raise ValueError(f"{name} must lie in [-1, {num_keys}) (-1 = no key), got values in "
                         f"[{lo}, {hi}]")


# Index entries per slice of the duplicate check: its sort buffers stay at about 200 MiB.
DISTINCT_CHECK_ELEMENTS = 1 << 24


def _repeats(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row sorted, mask [..., K - 1] of sorted slots equal to the one before, -1 ignored)."""
    ordered = rows.sort(dim=-1).values
    return ordered, (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)


def check_distinct_indices(name: str, indices: torch.Tensor,
                           row_dims: tuple[str, ...] = ("batch", "row", "kv head")) -> None:
    """Raise if a row of `indices` [B, T, (H,) K] lists a key twice (-1 slots ignored).

    Runs on the indices' device without a Python loop over rows: each row sorted, neighbours
    compared, a slice of rows at a time (bounded temporaries), folded into one flag: one host
    sync, the final bool. Only when it fires does it look for the first offending row, named
    by `row_dims` (one label per leading dim) with the repeated key.
    """
    K = indices.shape[-1]
    if K < 2 or indices.numel() == 0:
        return
    dim = 1 if indices.dim() > 2 else 0  # slice along the query rows
    n = indices.shape[dim]
    step = max(1, DISTINCT_CHECK_ELEMENTS // max(1, indices.numel() // max(1, n)))
    found = torch.zeros((), dtype=torch.bool, device=indices.device)
    for start in range(0, n, step):
        found |= _repeats(indices.narrow(dim, start, min(step, n - start)))[1].any()
    if not bool(found):  # the check's one host sync
        return
    for start in range(0, n, step):  # error path only: find the first offending row
        ordered, dup = _repeats(indices.narrow(dim, start, min(step, n - start)))
        where = dup.nonzero()
        if where.numel():
            pos = where[0].tolist()
            key = int(ordered[tuple(pos)])
            pos[dim] += start
            row = ", ".join(f"{label} {i}" for label, i in zip(row_dims, pos[:-1]))
            raise ValueError(
                f"{name} repeats key {key} in one row ({row}): indices must be distinct within "
                "a row (-1 aside), a repeated key would be counted twice. check_values=False "
                "skips this check for indices distinct by construction (HyTopK's)")


def check_rope_shapes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      heads: bool) -> None:
    """DeepSeek-V4's interleaved RoPE of x's trailing 2 x cos.shape[-1] channels: x [B, T, D]
    or, with heads, [B, T, H, D], an even number of other channels, cos and sin [T, R/2] or
    [B, T, R/2] (B may be 1); ValueError naming what does not fit."""
    rope_dim = 2 * cos.shape[-1]
    if x.shape[-1] < rope_dim or (x.shape[-1] - rope_dim) % 2:
        raise ValueError(f"x has {x.shape[-1]} channels: the rope dim {rope_dim} needs at least "
                         "as many and an even number of others")
    if x.dim() != (4 if heads else 3):
        raise ValueError(f"x must be [B, T, {'H, ' if heads else ''}D] (heads={heads}), got "
                         f"shape {tuple(x.shape)}")
    B, T = x.shape[:2]
    if (cos.shape != sin.shape or cos.dim() not in (2, 3) or cos.shape[-2] != T
            or (cos.dim() == 3 and cos.shape[0] not in (1, B))):
        raise ValueError(f"cos and sin must be [T, R/2] or [B, T, R/2] for x of shape "
                         f"{tuple(x.shape)}, got {tuple(cos.shape)} and {tuple(sin.shape)}")


def triton_interpret() -> bool:
    """Whether Triton runs its kernels in the interpreter (TRITON_INTERPRET=1)."""
    try:
        from triton import knobs
    except ImportError:  # an older Triton without knobs, or none: read the variable itself
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on",
                                                                            "yes")
    return bool(knobs.runtime.interpret)


def check_triton_device(backend: str, x: torch.Tensor) -> None:
    """backend='triton' needs CUDA tensors, or CPU ones under Triton's interpreter."""
    if backend == "triton" and not x.is_cuda and not triton_interpret():
        raise ValueError(
            f"backend='triton' got tensors on {x.device}, where the Triton kernels run only in "
            "Triton's interpreter: set TRITON_INTERPRET=1 (before the kernels are imported), "
            "use CUDA tensors, or use backend='reference' (or 'auto', which picks it off CUDA)")


def normalize_positions(
    name: str, positions: torch.Tensor | None, batch: int, length: int, default_start: int,
    device: torch.device,
) -> torch.Tensor:
    """Return int64 positions of shape [batch, length] (validated; default arange + start)."""
    if positions is None:
        return (torch.arange(length, device=device, dtype=torch.int64) + default_start).expand(
            batch, length
        )
    check_tensor(name, positions, ndim=(1, 2), dtypes=INT_DTYPES)
    if positions.device != device:
        raise ValueError(f"{name} is on {positions.device} but q is on {device}")
    if positions.dim() == 1:
        if positions.shape[0] != length:
            raise ValueError(f"{name} must have {length} entries, got {positions.shape[0]}")
        positions = positions.unsqueeze(0).expand(batch, length)
    elif tuple(positions.shape) != (batch, length):
        raise ValueError(f"{name} must be [{length}] or [{batch}, {length}], got "
                         f"{tuple(positions.shape)}")
    return positions.to(torch.int64)


def normalize_visible(
    name: str, visible: torch.Tensor | None, batch: int, rows: int, keys: int,
    device: torch.device,
) -> torch.Tensor | None:
    """An explicit key mask (True: row t may see key s) checked and viewed as [batch or 1,
    rows, keys]: bool [rows, keys], [1, rows, keys] or [batch, rows, keys] on `device`. None
    stays None."""
    if visible is None:
        return None
    check_tensor(name, visible, ndim=(2, 3), dtypes=(torch.bool,))
    if visible.device != device:
        raise ValueError(f"{name} is on {visible.device} but q is on {device}")
    if visible.dim() == 2:
        visible = visible.unsqueeze(0)
    if tuple(visible.shape[1:]) != (rows, keys) or visible.shape[0] not in (1, batch):
        raise ValueError(f"{name} must be [T={rows}, S={keys}], [1, T, S] or [B={batch}, T, S], "
                         f"got {tuple(visible.shape)}")
    return visible


# Keys of the warnings given so far (this process).
_warned: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn the first time a fast path is declined for `key` (its cause), naming why; later
    calls with the same key stay quiet. stacklevel counts from this function (3: the caller's
    caller)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


class KernelVariants:
    """A fast kernel's compiled variants that failed in this process (`disabled`: its
    `applies` refuses them) and the warnings saying why it did not run (once per cause)."""

    def __init__(self, key: str, kernel: str, fallback: str):
        self.key, self.kernel, self.fallback = key, kernel, fallback
        self.disabled: set[tuple] = set()

    def warn_cannot_run(self, cause: str, detail: str = "", stacklevel: int = 4) -> None:
        """One warning per distinct cause (`detail` varies within one); the default stacklevel
        points at the caller of the op's launcher."""
        text = f"{cause}: {detail}" if detail else cause
        warn_once(f"{self.key}: {cause}", f"HyScale: the {self.kernel} cannot run ({text}); "
                  f"using the {self.fallback}", stacklevel=stacklevel + 1)

    def disable(self, variant: tuple, reason: str) -> None:
        """Stop using one compiled variant after it failed, with one warning (the reason cut
        to its first line)."""
        self.disabled.add(variant)
        first = reason.splitlines()[0][:300] if reason else "failed"
        self.warn_cannot_run(f"{variant}: {first}", stacklevel=5)

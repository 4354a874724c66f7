"""Which kernel is faster, per op and shape, as measured: HyScale's own or a library's.

`measured_defaults.json` beside this file is written by `scripts/measured_defaults.py` from
the benchmark records in benchmarks/results/ (each entry: op, shape, T, both times, the
record it came from, the device it ran on). `faster_backend` answers for the measured length
nearest to T (on a log scale) of the same op and shape, from the entries measured on the
running device (by name), else from those of the device that measured the shape most; a shape never
measured keeps HyScale's own kernel. The attention has three plans (`attention_plan`): the
library pair, FlashMLA's forward with HyScale's backward, or HyScale's pair; its entries hold
both sides' times.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("measured_defaults.json")
OWN = "triton"
LIBRARY = "cudnn"
OPS = ("selection", "attention", "indexer_loss")
# The attention's plans (forward kernel, backward kernel). HyScale's forward with cuDNN's
# backward is not one: cuDNN's backward reads FlashMLA's padded rows and sink-free lse.
LIBRARY_PAIR = "library"
FLASHMLA_FORWARD = "flashmla_forward"
OWN_PAIR = "own"
PLAN_NAMES = {LIBRARY_PAIR: "FlashMLA's forward and cuDNN's backward",
              FLASHMLA_FORWARD: "FlashMLA's forward and HyScale's backward",
              OWN_PAIR: "HyScale's forward and backward"}


@functools.cache
def _entries(path: Path) -> tuple[dict, ...]:
    if not path.exists():
        return ()
    with open(path) as f:
        return tuple(json.load(f)["entries"])


@functools.cache
def _device_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def running_device() -> str | None:
    """The current CUDA device's name, as the benchmark records spell it; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return _device_name(torch.cuda.current_device())


def _rows(op: str, shape: str, device: str | None) -> tuple[list[dict], str]:
    """The table's entries for `op` on `shape` measured on `device` where it has any, else on
    the device with the most entries for them (ties: the first name); with that device's name.
    Entries that name no device (hand-written tables) match any."""
    rows = [e for e in _entries(TABLE_PATH) if e["op"] == op and e["shape"] == shape]
    named = [e["device"] for e in rows if e.get("device")]
    if not named:
        return rows, ""
    if device not in named:
        device = max(sorted(set(named)), key=named.count)
    return [e for e in rows if e.get("device") in (None, device)], device


def _on(device: str) -> str:
    return f" on {device}" if device else ""


def selection_shape(heads: int, head_dim: int, topk: int) -> str:
    return f"H{heads}xD{head_dim}-k{topk}"


def attention_shape(heads: int, key_dim: int, value_dim: int, sink: bool) -> str:
    return f"H{heads}-D{key_dim}-V{value_dim}" + ("-sink" if sink else "")


def loss_shape(heads: int, key_dim: int, index_heads: int) -> str:
    return f"H{heads}-D{key_dim}-HI{index_heads}"


def faster_backend(op: str, shape: str, T: int, device: str | None = None
                   ) -> tuple[str, str]:
    """(OWN or LIBRARY, why) for `op` on `shape` at T tokens, from the measured table (entries
    of `device`, default the running one, where it was measured)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    rows, measured_on = _rows(op, shape, device or running_device())
    if not rows:
        return OWN, f"{op} on {shape} was never measured against the library"
    near = min(rows, key=lambda e: abs(math.log(e["T"]) - math.log(max(T, 1))))
    pick = LIBRARY if near["library_ms"] < near["own_ms"] else OWN
    return pick, (f"{op} on {shape}: measured{_on(measured_on)} at T={near['T']} "
                  f"{near['own_ms']:.1f} ms own vs {near['library_ms']:.1f} ms {LIBRARY} "
                  f"({near['source']})")


def plan_for(entry: dict, allowed: tuple[str, ...] = tuple(PLAN_NAMES)) -> str:
    """Of the `allowed` plans, the one whose forward + backward times in an attention entry of
    the table add up to the least; ties keep HyScale's kernels."""
    (own_f, own_b), (lib_f, lib_b) = entry["own_fwd_bwd_ms"], entry["library_fwd_bwd_ms"]
    cost = {OWN_PAIR: own_f + own_b, FLASHMLA_FORWARD: lib_f + own_b,
            LIBRARY_PAIR: lib_f + lib_b}
    preference = (OWN_PAIR, FLASHMLA_FORWARD, LIBRARY_PAIR)  # on equal times
    return min(allowed, key=lambda p: (cost[p], preference.index(p)))


def attention_plan(shape: str, T: int, allowed: tuple[str, ...] = tuple(PLAN_NAMES),
                   device: str | None = None) -> tuple[str, str]:
    """(plan, why): `plan_for` the measured length nearest to T (each side's two kernels timed
    in the same run; entries of `device`, default the running one, where it was measured). A
    shape never measured keeps HyScale's pair, which `allowed` must hold."""
    if OWN_PAIR not in allowed or any(p not in PLAN_NAMES for p in allowed):
        raise ValueError(f"allowed plans must be among {tuple(PLAN_NAMES)} and hold {OWN_PAIR!r}, "
                         f"got {allowed!r}")
    rows, measured_on = _rows("attention", shape, device or running_device())
    if not rows:
        return OWN_PAIR, f"attention on {shape} was never measured against the library"
    near = min(rows, key=lambda e: abs(math.log(e["T"]) - math.log(max(T, 1))))
    (own_f, own_b), (lib_f, lib_b) = near["own_fwd_bwd_ms"], near["library_fwd_bwd_ms"]
    return plan_for(near, allowed), (
        f"attention on {shape}: measured{_on(measured_on)} at T={near['T']} forward "
        f"{own_f:.1f} ms own vs "
        f"{lib_f:.1f} FlashMLA, backward {own_b:.1f} own vs {lib_b:.1f} cuDNN "
        f"({near['source']})")

"""Which kernel is faster, per op and shape, as measured: HyScale's own or a library's.

`measured_defaults.json` beside this file is written by `scripts/measured_defaults.py` from
the benchmark records in benchmarks/results/ (each entry: op, shape, T, both times, the
record it came from). `faster_backend` answers for the measured length nearest to T (on a log
scale) of the same op and shape; a shape never measured keeps HyScale's own kernel.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("measured_defaults.json")
OWN = "triton"
LIBRARY = "cudnn"
# attention: forward + backward (the library pair runs both or neither)
OPS = ("selection", "attention", "indexer_loss")


@functools.cache
def _entries(path: Path) -> tuple[dict, ...]:
    if not path.exists():
        return ()
    with open(path) as f:
        return tuple(json.load(f)["entries"])


def selection_shape(heads: int, head_dim: int, topk: int) -> str:
    return f"H{heads}xD{head_dim}-k{topk}"


def attention_shape(heads: int, key_dim: int, value_dim: int, sink: bool) -> str:
    return f"H{heads}-D{key_dim}-V{value_dim}" + ("-sink" if sink else "")


def loss_shape(heads: int, key_dim: int, index_heads: int) -> str:
    return f"H{heads}-D{key_dim}-HI{index_heads}"


def faster_backend(op: str, shape: str, T: int) -> tuple[str, str]:
    """(OWN or LIBRARY, why) for `op` on `shape` at T tokens, from the measured table."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    rows = [e for e in _entries(TABLE_PATH) if e["op"] == op and e["shape"] == shape]
    if not rows:
        return OWN, f"{op} on {shape} was never measured against the library"
    near = min(rows, key=lambda e: abs(math.log(e["T"]) - math.log(max(T, 1))))
    pick = LIBRARY if near["library_ms"] < near["own_ms"] else OWN
    return pick, (f"{op} on {shape}: measured at T={near['T']} {near['own_ms']:.1f} ms own "
                  f"vs {near['library_ms']:.1f} ms {LIBRARY} ({near['source']})")

"""Where one layer step's peak memory goes: the CUDA blocks alive at the step's peak, by the
source line that allocated them (torch's allocator history, `torch.cuda.memory`).

bench_layer.py reports one number, the peak extra memory of a forward + backward step under full
recompute; launch/layer_memory.py estimates it item by item. When the two disagree, this script
shows which allocations make the difference:

    python scripts/profile_layer_memory.py --model csa --seq 32768
    python scripts/profile_layer_memory.py --model qsa --seq 131072 --baseline
    python scripts/profile_layer_memory.py --model csa --seq 131072 --row-chunk 32768

It builds the layer exactly as bench_layer.py does (same geometry, input and step), runs one
warm-up step, then records the allocator's history over one more step and replays it: the peak
is the largest sum of live blocks allocated during the step (what bench_layer's peak extra
counts), and the blocks alive at that moment are grouped by their innermost frame outside
torch's own files. Prints a table (GiB, share, block count, site) and the stack of the
allocation that reached the peak (forward, recompute or backward), writes JSON to --out. Needs
a CUDA GPU: without one it exits with status 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 2**30
# Frames from these files say nothing about who asked for the memory.
LIBRARY_MARKERS = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")
ALLOC, FREE = "alloc", "free_requested"
# Allocator events kept (a 1M-token step stays far below; a full history would hide the peak).
MAX_ENTRIES = 2_000_000
# An autograd node in a C++ frame (stacks="all"): which backward formula allocated a gradient.
BACKWARD_NODE = re.compile(r"(\w+Backward\w*)")


def _user_frames(frames: list[dict[str, Any]]) -> Iterable[str]:
    """'file:line function' of each frame outside torch's own files, innermost first."""
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and not any(m in name for m in LIBRARY_MARKERS):
            yield f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}"


def site_of(frames: list[dict[str, Any]]) -> str:
    """'file:line function' of the innermost frame outside torch (frames: innermost first),
    with the innermost autograd node (e.g. 'MulBackward0') when a backward formula allocated
    the block: inside backward the Python stack only shows who called backward."""
    node = next((m.group(1) for f in frames
                 if (m := BACKWARD_NODE.search(str(f.get("name", ""))))), None)
    suffix = f" <- {node}" if node else ""
    site = next(iter(_user_frames(frames)), None)
    if site is not None:
        return site + suffix
    return ("(torch internal)" if frames else "(no stack)") + suffix


def user_stack(frames: list[dict[str, Any]], depth: int = 12) -> list[str]:
    """The innermost `depth` frames outside torch, innermost first."""
    return list(itertools.islice(_user_frames(frames), depth))


def peak_live_blocks(trace: Iterable[dict[str, Any]]) -> tuple[int, list[dict[str, Any]], int]:
    """Replay allocator events: (peak bytes, blocks alive at the peak, index of the peak event).

    Counts only blocks allocated within the trace (those alive before it are the baseline that
    bench_layer subtracts); a block is freed at its `free_requested` event. The first time the
    running sum reaches its maximum is the peak.
    """
    events = list(trace)
    live: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        if e.get("action") == ALLOC:
            live[e["addr"]] = i
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e.get("action") == FREE and e["addr"] in live:
            del live[e["addr"]]
            total -= e["size"]
    alive: dict[int, dict[str, Any]] = {}
    for e in events[: peak_at + 1]:
        if e.get("action") == ALLOC:
            alive[e["addr"]] = e
        elif e.get("action") == FREE:
            alive.pop(e["addr"], None)
    return peak, list(alive.values()), peak_at


def by_site(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Blocks grouped by allocation site, largest first."""
    groups: dict[str, dict[str, Any]] = {}
    for b in blocks:
        g = groups.setdefault(site_of(b.get("frames", [])), {"bytes": 0, "blocks": 0,
                                                             "sizes": []})
        g["bytes"] += b["size"]
        g["blocks"] += 1
        g["sizes"].append(b["size"])
    rows = [{"site": s, "bytes": g["bytes"], "blocks": g["blocks"],
             "largest_gib": max(g["sizes"]) / GiB} for s, g in groups.items()]
    return sorted(rows, key=lambda r: -r["bytes"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                epilog="Needs a CUDA GPU: without one it exits with status 2 "
                                       "before writing anything.")
    p.add_argument("--model", choices=("dsa", "csa", "hca", "qsa"), default="csa",
                   help="the layer (bench_layer.py's --model; default csa)")
    p.add_argument("--seq", type=int, default=32768, help="sequence length (tokens, batch 1)")
    p.add_argument("--baseline", action="store_true", help="the baseline / stock layer")
    p.add_argument("--row-chunk", type=int, default=None, help="as bench_layer.py --row-chunk")
    p.add_argument("--top", type=int, default=25, help="sites to print")
    p.add_argument("--out", default="outputs/profile_layer_memory",
                   help="folder for the JSON (default outputs/profile_layer_memory)")
    args = p.parse_args(argv)
    from hyscale_bench.measure import require_cuda

    require_cuda("profile_layer_memory.py", hint="run it on the GPU machine (it reads CUDA's "
                 "allocator history)")
    import hyscale_bench.layer as bl
    from megatron_hyscale import replay

    largv = ["--model", args.model, "--seq", str(args.seq), "--repeats", "1"]
    if args.row_chunk:
        largv += ["--row-chunk", str(args.row_chunk)]
    largs = bl.parse_args(largv)
    bl.init_distributed(largs)
    layer = bl.BUILDERS[args.model](largs, baseline=args.baseline)
    hidden, grad = bl.make_input(args.seq, layer, largs)
    bl.layer_step(layer, hidden, grad)  # compile the kernels, settle the allocator
    torch.cuda.synchronize()
    replay.clear()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(stacks="all", max_entries=MAX_ENTRIES)
    bl.layer_step(layer, hidden, grad)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = (torch.cuda.max_memory_allocated() - base) / GiB
    trace = snap["device_traces"][torch.cuda.current_device()]
    if len(trace) >= MAX_ENTRIES:
        print(f"profile_layer_memory.py: the allocator history filled its {MAX_ENTRIES} "
              "entries; the step's first events are lost and the peak below may be wrong",
              file=sys.stderr)
    peak, blocks, at = peak_live_blocks(trace)
    rows = by_site(blocks)
    name = "baseline" if args.baseline else "hyscale"
    print(f"{args.model} {name} T={args.seq}: peak of the step's allocations {peak / GiB:.2f} "
          f"GiB (max_memory_allocated - base: {measured:.2f} GiB), {len(blocks)} blocks alive")
    print("| GiB | share | blocks | largest GiB | allocated at |")
    print("|---|---|---|---|---|")
    for r in rows[: args.top]:
        print(f"| {r['bytes'] / GiB:.2f} | {r['bytes'] / max(peak, 1):.0%} | {r['blocks']} "
              f"| {r['largest_gib']:.2f} | {r['site']} |")
    peak_stack = user_stack(trace[at].get("frames", [])) if at >= 0 else []
    print("the allocation that reached the peak:\n  " + "\n  ".join(peak_stack))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"memory_{args.model}_{name}_{args.seq}.json", "w") as f:
        json.dump({"model": args.model, "variant": name, "T": args.seq,
                   "row_chunk": args.row_chunk, "peak_gib": peak / GiB,
                   "max_allocated_extra_gib": measured, "sites": rows,
                   "peak_stack": peak_stack}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

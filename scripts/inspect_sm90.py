"""Compile HyScale's Triton kernels for the H200 (sm_90a) on a machine without a GPU, and report
what the compiler made of them: registers, spills, shared memory, and the instruction mix of the
hot loop.

Each kernel is compiled exactly as its launch wrapper would launch it: the wrapper runs on CPU
tensors of the real shapes and dtypes, the `kernel[grid](...)` call is intercepted, and its
arguments are specialized with Triton's own rules (ints equal to 1 become constants, 16-byte
alignment and divisibility by 16 become attributes). ptxas and cuobjdump come with the Triton
wheel. The hot loop is the innermost loop that holds a tensor-core instruction (HGMMA / QGMMA /
HMMA); of several (HyTopK's sampling pass before its key-tile loop), the last in the binary.
Use it to compare kernel variants before spending GPU time: instruction counts and spills are
facts about the binary; time still has to be measured on the GPU.

    python scripts/inspect_sm90.py --preset hytopk-dsv32 [--sass-out DIR]
    python scripts/inspect_sm90.py --list
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature

try:  # Gluon (tested with Triton 3.6): the Hopper sparse-MLA forward presets need it
    from triton.experimental.gluon._runtime import GluonASTSource
except ImportError:
    GluonASTSource = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_hyscale.ops.checks import triton_interpret  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# Instructions shown in the loop summary, by opcode (the rest are counted in the total).
# QGMMA: Hopper's fp8 wgmma (HyTopK's precision="fp8").
# Global atomics are REDG / ATOMG (their width is in the suffix: REDG.E.ADD.F32x4 adds 4 floats).
SHOWN_OPS = ("HGMMA", "QGMMA", "WARPGROUP", "HMMA", "BAR", "SHFL", "STS", "LDS", "LDG", "STG",
             "LDGSTS", "REDG", "ATOMG", "RED", "ATOM", "FFMA", "FMUL", "FADD", "FMNMX", "MUFU",
             "LDL", "STL")


@dataclass
class Launch:
    """One intercepted `kernel[grid](*args, **kwargs)` call."""

    fn: JITFunction
    grid: Any
    args: tuple
    kwargs: dict


@dataclass
class Report:
    name: str
    instructions: int  # in the whole kernel
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int
    loop_instructions: int
    loop_ops: dict[str, int] = field(default_factory=dict)
    # ptxas's "Potential Performance Loss" notes (e.g. C7514: every wgmma serialized).
    perf_warnings: list[str] = field(default_factory=list)
    # Instructions of every innermost MMA loop, by address (a kernel compiling one loop in two
    # forms, or one a partition, has several; the hot loop is the last).
    mma_loop_sizes: list[int] = field(default_factory=list)
    sass: str = ""

    def line(self) -> str:
        ops = " ".join(f"{k}={v}" for k, v in self.loop_ops.items() if v)
        notes = "".join(f"\n  ptxas: {w}" for w in self.perf_warnings)
        loops = (f" (MMA loops {' / '.join(map(str, self.mma_loop_sizes))})"
                 if len(set(self.mma_loop_sizes)) > 1 else "")
        return (f"{self.name}: {self.instructions} instrs, {self.registers} regs, spills "
                f"{self.spill_stores}/"
                f"{self.spill_loads} B st/ld, stack {self.stack_bytes} B, smem "
                f"{self.shared_bytes} B | hot loop {self.loop_instructions} instrs: "
                f"{ops}{loops}{notes}")


class _Recorder:
    """Stands in for a JITFunction: `rec[grid](...)` records the call instead of launching."""

    def __init__(self, fn: JITFunction, calls: list[Launch]):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls.append(Launch(self.fn, grid, args, kwargs))

        return launch


@contextlib.contextmanager
def intercept(module: Any, *names: str) -> Iterator[list[Launch]]:
    """Replace the named @triton.jit kernels of `module` by recorders for the duration."""
    calls: list[Launch] = []
    saved = {n: getattr(module, n) for n in names}
    try:
        for n, fn in saved.items():
            setattr(module, n, _Recorder(fn, calls))
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


def compile_launch(launch: Launch) -> Any:
    """Compile one recorded launch for sm_90a with Triton's launch-time specialization."""
    fn = launch.fn
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{fn!r} is not a compiled Triton kernel: run without TRITON_INTERPRET")
    backend = CUDABackend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, options, bound,
                                                          specialization, options)
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    if source is None:
        raise RuntimeError(f"{fn!r} is a Gluon kernel: this Triton has no Gluon")
    return triton.compile(source(fn, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__)


def _ptxas(ptx: str, workdir: str) -> tuple[str, str]:
    src, cubin = os.path.join(workdir, "k.ptx"), os.path.join(workdir, "k.cubin")
    with open(src, "w") as f:
        f.write(ptx)
    info = subprocess.run([os.path.join(_BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", src, "-o",
                           cubin], capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-sass", cubin],
                          capture_output=True, text=True, check=True).stdout
    return info, sass


def _instructions(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def hot_loop(sass: str) -> list[str]:
    """Instructions of the hot loop: the last of `mma_loops`."""
    loops = mma_loops(sass)
    return loops[-1] if loops else []


def mma_loops(sass: str) -> list[list[str]]:
    """Instructions of each MMA loop, by address: for each MMA the smallest loop (a backward
    branch's span) around it; of those, the innermost ones (a loop around a pruning bound's
    MMA also holds the key-tile loop)."""
    ins = _instructions(sass)
    # Out-of-line blocks after the kernel's last EXIT (an mbarrier wait's retry: try again,
    # then jump back into the loop) are no loop's back edge.
    end = max((a for a, t in ins if t == "EXIT"), default=ins[-1][0] if ins else 0)
    spans = [(int(m.group(1), 16), a) for a, t in ins
             for m in [re.search(r"BRA\b.*?(0x[0-9a-f]+)", t)]
             if m and int(m.group(1), 16) <= a <= end]
    around = set()
    for a, t in ins:
        if "HGMMA" in t or "QGMMA" in t or "HMMA" in t:
            inside = [sp for sp in spans if sp[0] <= a <= sp[1]]
            if inside:
                around.add(min(inside, key=lambda sp: sp[1] - sp[0]))
    inner = [sp for sp in around
             if not any(o != sp and sp[0] <= o[0] and o[1] <= sp[1] for o in around)]
    return [[t for a, t in ins if lo <= a <= hi] for lo, hi in sorted(inner)]


def report(name: str, launch: Launch) -> Report:
    compiled = compile_launch(launch)
    with tempfile.TemporaryDirectory() as d:
        info, sass = _ptxas(compiled.asm["ptx"], d)

    def num(pattern: str) -> int:
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    loops = mma_loops(sass)
    loop = loops[-1] if loops else []
    counts: collections.Counter[str] = collections.Counter()
    for t in loop:
        op = re.sub(r"^@!?U?P[T\d]+\s+", "", t).split()[0].split(".")[0]
        counts[op] += 1
    return Report(name, len(_instructions(sass)), num(r"Used (\d+) registers"),
                  num(r"(\d+) bytes spill stores"),
                  num(r"(\d+) bytes spill loads"), num(r"(\d+) bytes stack frame"),
                  compiled.metadata.shared, len(loop), {k: counts[k] for k in SHOWN_OPS},
                  re.findall(r"Potential Performance Loss[^\n]*", info),
                  [len(lp) for lp in loops], sass)


# --------------------------------------------------------------------------- presets


def _hytopk(H: int, D: int, topk: int, relu: bool, T: int = 8192, mode: int = 0,
            fp8: bool = False, key_order: bool = False, **options: Any) -> list[Launch]:
    """HyTopK's launch in `mode` (hytopk.MODE_*); fp8: on e4m3 q and k with their scales
    (precision="fp8"); key_order: rows by increasing index (order="key"); options:
    HyTopKOptions fields to change."""
    from megatron_hyscale.ops.fp8_quant import quantize_indexer
    from megatron_hyscale.ops.kernels import hytopk as hk
    from megatron_hyscale.ops.kernels.options import HyTopKOptions

    q = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
    k = torch.zeros(1, T, D, dtype=torch.bfloat16)
    w = torch.zeros(1, T, H, dtype=torch.float32)
    scales = {}
    if fp8:
        q, scales["q_scale"], k, scales["k_scale"] = quantize_indexer(q, k)
    pos = torch.arange(T)[None]
    default = HyTopKOptions.DEFAULT
    # On CPU the wrapper sizes the persistent grid by interpret_programs: the H200's 132 SMs.
    opts = replace(default, interpret_programs=132 * default.programs_per_sm, **options)
    with intercept(hk, "_hytopk_kernel") as calls:
        hk._launch(q, k, w, topk, relu=relu, q_positions=pos, k_positions=pos, causal=True,
                   options=opts, mode=mode, key_order=key_order, **scales)
    return calls


def _write_rows(topk: int, rows: int = 264, select: bool = False, key_order: bool = False,
                ordered: bool = True, **options: Any) -> list[Launch]:
    """HyTopK's row output alone (`hytopk.write_rows`: load, sort, decode, store of each
    row's packed keys) over rows of a 2 x topk buffer; options: HyTopKOptions fields (such as
    row_sort); select, key_order, ordered: write_rows' (select: the survivors' select of
    `hytopk_sm90.select_survivors`, a radix select over the 2 x topk buffer first; ordered
    False: no row sort, as for the scan slots' key-ordered buffers). No MMA: read the whole
    kernel's counts."""
    from megatron_hyscale.ops.kernels import hytopk as hk
    from megatron_hyscale.ops.kernels.options import HyTopKOptions

    keys = torch.zeros(rows, 2 * topk, dtype=torch.int64)
    counts = torch.zeros(rows, dtype=torch.int32)
    with intercept(hk, "_write_rows_kernel") as calls:
        hk.write_rows(keys, counts, topk, options=replace(HyTopKOptions.DEFAULT, **options),
                      programs=132 * 2, select=select, key_order=key_order, ordered=ordered)
    return calls


def _select_rows(topk: int, rows: int = 264) -> list[Launch]:
    """The survivors' select written straight to the rows (`survivor_select.select_rows`,
    HyTopKOptions.scores_sm90_direct_select) over rows of a 2 x topk buffer. No MMA: read the
    whole kernel's counts."""
    from megatron_hyscale.ops.kernels import survivor_select

    keys = torch.zeros(rows, 2 * topk, dtype=torch.int64)
    counts = torch.zeros(rows, dtype=torch.int32)
    with intercept(survivor_select, "_select_rows_kernel") as calls:
        survivor_select.select_rows(keys, counts, topk)
    return calls


def _row_rank(columns: int = 2048, rows: int = 8192) -> list[Launch]:
    """The sample's threshold pick (`row_rank.rank_values`, scores_sm90_sample_pick="radix") on
    a sample table's chunk (SAMPLE_CHUNK_ROWS rows of 2048 sampled keys). No MMA: read the
    whole kernel's counts."""
    from megatron_hyscale.ops.kernels import row_rank

    with intercept(row_rank, "_rank_value_kernel") as calls:
        row_rank.rank_values(torch.zeros(rows, columns), torch.ones(rows, dtype=torch.long))
    return calls


def _mla_rope(dtype: torch.dtype) -> list[Launch]:
    """The absorbed query's RoPE (`mla_rope`: forward, then backward) on GLM-5.1's 64 heads of
    64 rotary dims, the query a strided view as `absorbed_query` passes it. No MMA: read the
    whole kernel's counts (megatron rounds each product: no FFMA / HFMA2 may appear)."""
    from megatron_hyscale.ops.kernels import mla_rope

    q = torch.zeros(64, 1, 64, 256, dtype=dtype)[..., 192:]
    cos = torch.zeros(64, 64, dtype=dtype)
    with intercept(mla_rope, "_mla_rope_kernel") as calls:
        mla_rope.mla_rope_fwd(q, cos, cos, torch.empty_like(q))
        mla_rope.mla_rope_bwd(q, cos, cos, torch.empty_like(q))
    return calls


def _interleaved_rope(dtype: torch.dtype) -> list[Launch]:
    """DeepSeek-V4's query RoPE (`interleaved_rope`, 64 heads of 512 channels, 64 rotary): one
    launch (the backward is the same kernel). No MMA: read the whole kernel's counts (torch
    rounds each fp32 product before the sum: no FFMA may appear)."""
    from megatron_hyscale.ops.kernels import interleaved_rope

    x = torch.zeros(1, 32, 64, 512, dtype=dtype)
    cos = torch.zeros(32, 32)
    with intercept(interleaved_rope, "_interleaved_rope_kernel") as calls:
        interleaved_rope.interleaved_rope(x, cos, cos, 64)
    return calls


def _rms_norm_rope(dtype: torch.dtype) -> list[Launch]:
    """DeepSeek-V4's query norm with its RoPE epilogue (`kernels/rms_norm.py`, 64 heads of 512
    channels, 64 rotary): forward, then backward. No MMA: read the whole kernels' counts (the
    separate norm and rotation round each fp32 product: no FFMA may appear)."""
    from megatron_hyscale.ops.kernels import rms_norm

    x = torch.zeros(1, 32, 64, 512, dtype=dtype)
    cos = torch.zeros(32, 32)
    rope = rms_norm.Rope(cos, cos, 64)
    with intercept(rms_norm, "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel") as calls:
        _, rstd = rms_norm.rms_norm_fwd(x, None, 1e-6, rope)
        rms_norm.rms_norm_bwd(x, x, None, rstd, False, rope)
    return calls


def _sparse_attention(hq: int, hkv: int, d: int, dv: int | None, topk: int, T: int = 256,
                      prefix: bool = False, dq_target: bool = False, **options: Any
                      ) -> list[Launch]:
    """Forward, dQ and dK/dV launches; options: AttentionKernelOptions fields to change (such
    as dq_tilings). prefix: rows also attend to a generated dense key prefix (HCA). dq_target:
    only the dQ launch, emitting the indexer loss's target (TARGET)."""
    from megatron_hyscale.ops.kernels import sparse_attention as sa
    from megatron_hyscale.ops.kernels.options import AttentionKernelOptions

    opts = replace(AttentionKernelOptions.DEFAULT, **options)
    sa._tiling_cache.clear()  # each launch records its first tiling, not a remembered one
    try:
        return _sparse_attention_calls(sa, hq, hkv, d, dv, topk, T, prefix, opts, dq_target)
    finally:
        sa._tiling_cache.clear()


def _sparse_attention_calls(sa: Any, hq: int, hkv: int, d: int, dv: int | None, topk: int,
                            T: int, prefix: bool, options: Any, dq_target: bool = False
                            ) -> list[Launch]:
    q = torch.zeros(1, T, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(1, T, hkv, d, dtype=torch.bfloat16)
    v = None if dv is None else torch.zeros(1, T, hkv, dv, dtype=torch.bfloat16)
    idx = torch.zeros(1, T, hkv, topk, dtype=torch.int32)
    kw = dict(dv=min(d, 512) if dv is None else None,
              prefix_lengths=torch.zeros(1, T, dtype=torch.int32) if prefix else None,
              options=options)
    names = [n for n in dir(sa) if n.startswith("_") and n.endswith("_kernel")]
    if dq_target:
        out = torch.zeros(1, T, hq, kw["dv"] or dv, dtype=torch.bfloat16)
        with intercept(sa, *names) as calls:
            sa.sparse_attention_bwd_dq(q, k, v, idx, d ** -0.5, out, torch.zeros(1, T, hq),
                                       torch.zeros_like(out), **kw, emit_target=True)
        return calls
    with intercept(sa, *names) as calls:
        out, lse = sa.sparse_attention_fwd(q, k, v, idx, d ** -0.5, **kw)
        sa.sparse_attention_bwd(q, k, v, idx, d ** -0.5, out, lse, torch.zeros_like(out), **kw)
    return calls


def _sparse_mla_fwd_sm90(hq: int, d: int, topk: int, T: int = 256, ws: bool = False,
                         sink: bool = False, lockstep: bool = False,
                         prefix: bool = False) -> list[Launch]:
    """The Gluon sparse-MLA forward (Hopper only; absorbed MLA, one KV head); ws: its
    warp-specialized form (`AttentionKernelOptions.fwd_sm90_ws`: a cp.async producer warpgroup,
    two consumer warpgroups), which also takes K = V without a tail and a sink (CSA) and a
    dense prefix (prefix: HCA's); lockstep: that form in lockstep (`fwd_lockstep`)."""
    from megatron_hyscale.ops.kernels import common
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_sm90 as fwd
    from megatron_hyscale.ops.kernels import sparse_mla_fwd_ws_sm90 as fwd_ws
    from megatron_hyscale.ops.kernels.options import AttentionKernelOptions

    q = torch.zeros(1, T, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(1, T, 1, d, dtype=torch.bfloat16)
    idx = torch.zeros(1, T, topk, dtype=torch.int32)
    options = replace(AttentionKernelOptions.DEFAULT, fwd_sm90_ws=ws, fwd_lockstep=lockstep)
    module, kernel = (fwd_ws, "_sparse_mla_fwd_ws_kernel") if ws else (fwd,
                                                                      "_sparse_mla_fwd_kernel")
    # CPU tensors here: the H200's 132 SMs stand in for the device's count.
    with intercept(module, kernel) as calls, \
            mock.patch.object(common, "sm_count", lambda device: 132):
        fwd.sparse_mla_fwd_sm90(q, k, idx, d ** -0.5, options=options,
                                sink=torch.zeros(hq) if sink else None,
                                prefix_lengths=torch.zeros(1, T, dtype=torch.int32)
                                if prefix else None)
    return calls


def _sparse_mla_bwd_sm90(hq: int, d: int, topk: int, T: int = 256, sink: bool = False,
                         dlse: bool = False, target: bool = False,
                         dk_vec4: bool = False, lockstep: bool = False,
                         prefix: bool = False) -> list[Launch]:
    """The warp-specialized Gluon sparse-MLA backward (Hopper only; `AttentionKernelOptions.
    bwd_sm90`: a cp.async producer warpgroup, two consumer warpgroups); with the lse's
    gradient, a sink (CSA: K = V, no tail) or the indexer loss's target; dk_vec4: 16-byte dK
    atomics (`AttentionKernelOptions.bwd_dk_vec4`); lockstep: one program an SM, the programs
    paced together (`bwd_lockstep`; unpaced with a prefix); prefix: HCA's dense prefix."""
    from megatron_hyscale.ops.kernels import sparse_mla_bwd_sm90 as bwd

    d_main = 1 << (d.bit_length() - 1)
    q = torch.zeros(1, T, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(1, T, 1, d, dtype=torch.bfloat16)
    out = torch.zeros(1, T, hq, d_main, dtype=torch.bfloat16)
    lse = torch.zeros(1, T, hq)
    idx = torch.zeros(1, T, topk, dtype=torch.int32)
    dk = torch.zeros(1, T, 1, d)
    tgt = torch.zeros(1, T, topk)
    from megatron_hyscale.ops.kernels import common

    # CPU tensors here: the H200's 132 SMs stand in for the device's count.
    with intercept(bwd, "_sparse_mla_bwd_kernel") as calls, \
            mock.patch.object(common, "sm_count", lambda device: 132):
        bwd.sparse_mla_bwd_sm90(q, k, idx, d ** -0.5, out, lse, torch.zeros_like(out), dk,
                                dlse=torch.zeros_like(lse) if dlse else None,
                                sink=torch.zeros(hq) if sink else None,
                                target=(tgt, (0, *tgt.stride()), hq > 64) if target else None,
                                dk_vec4=dk_vec4, lockstep=lockstep,
                                prefix_lengths=torch.zeros(1, T, dtype=torch.int32)
                                if prefix else None)
    return calls


def _indexer_inputs(h: int, T: int, S: int, fp8: bool, part_major: bool = False) -> tuple:
    """CPU (q, k, w, k_scale) of the Gluon indexer scores: bf16, or e4m3 with k's scales;
    part_major: q stored [B, H, T, D] (the folded parts' `part_major` layout)."""
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q = (torch.zeros(1, h, T, 128, dtype=dtype).permute(0, 2, 1, 3) if part_major
         else torch.zeros(1, T, h, 128, dtype=dtype))
    return (q, torch.zeros(1, S, 128, dtype=dtype),
            torch.zeros(1, T, h, dtype=torch.float32), torch.ones(1, S) if fp8 else None)


def _indexer_scores_sm90(h: int, T: int = 4096, fp8: bool = False, relu: bool = True,
                         **ahead: Any) -> list[Launch]:
    """The warp-specialized Gluon indexer scores (Hopper only; `indexer_row_max_sm90`: each
    causal row's largest score, HyTopK's scores-only measurement), h heads of 128 dims; fp8:
    e4m3 q and k (HyTopK's precision="fp8"); relu=False: h the folded query's bf16 parts;
    ahead: mma_ahead, stages, part_major, head_sum_transpose (`HyTopKOptions.
    scores_sm90_mma_ahead`, `_stages`, `_folded_part_major`, `_head_sum_transpose`)."""
    from megatron_hyscale.ops.kernels import indexer_scores_sm90 as scores

    q, k, w, ks = _indexer_inputs(h, T, T, fp8, ahead.get("part_major", False))
    with intercept(scores, "_indexer_scores_kernel") as calls:
        scores.indexer_row_max_sm90(q, k, w, k_scale=ks, relu=relu, **ahead)
    return calls


def _indexer_filter_sm90(h: int, topk: int = 2048, T: int = 4096,
                         defer_store: bool = True, fp8: bool = False, relu: bool = True,
                         scan_slots: bool = False, **ahead: Any) -> list[Launch]:
    """The same kernel's FILTER epilogue (`indexer_filter_sm90`: each row's scores at or above
    its threshold appended to its survivor list), the cap `kernels/hytopk_sm90.py` uses;
    defer_store, scan_slots as `HyTopKOptions.scores_sm90_defer_store`, `_scan_slots`; relu,
    ahead as `_indexer_scores_sm90`'s."""
    from megatron_hyscale.ops.kernels import hytopk_sm90
    from megatron_hyscale.ops.kernels import indexer_scores_sm90 as scores

    q, k, w, ks = _indexer_inputs(h, T, T, fp8, ahead.get("part_major", False))
    tau = torch.zeros(1, T)
    with intercept(scores, "_indexer_scores_kernel") as calls:
        scores.indexer_filter_sm90(q, k, w, tau, 0, T, hytopk_sm90.survivor_cap(topk),
                                   defer_store=defer_store, k_scale=ks, relu=relu,
                                   scan_slots=scan_slots, **ahead)
    return calls


def _indexer_table_sm90(h: int, T: int = 131072, samples: int = 2048,
                        fp8: bool = False, relu: bool = True, **variant: Any) -> list[Launch]:
    """The same kernel's TABLE epilogue (`indexer_table_sm90`: every row's scores against every
    (T / samples)-th key, HyTopK on the Gluon scores' sampled thresholds), on a chunk of
    `hytopk_sm90.SAMPLE_CHUNK_ROWS` rows; relu as `_indexer_scores_sm90`'s; variant:
    head_sum_transpose."""
    from megatron_hyscale.ops.kernels import hytopk_sm90
    from megatron_hyscale.ops.kernels import indexer_scores_sm90 as scores

    stride = -(-T // samples)
    rows = hytopk_sm90.SAMPLE_CHUNK_ROWS
    q, k, w, ks = _indexer_inputs(h, T, -(-T // stride), fp8)
    with intercept(scores, "_indexer_scores_kernel") as calls:
        scores.indexer_table_sm90(q, k, w, stride, T - rows, T, k_scale=ks, relu=relu,
                                  **variant)
    return calls


def _indexer_loss(hi: int, di: int, hq: int, d: int, topk: int, T: int = 256, **options: Any
                  ) -> list[Launch]:
    """select, target, loss and backward launches of the sparse indexer KL loss; options:
    IndexerLossKernelOptions fields to change."""
    from megatron_hyscale.ops.kernels import indexer_loss as il
    from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions

    qi = torch.zeros(1, T, hi, di, dtype=torch.bfloat16)
    w = torch.zeros(1, T, hi, dtype=torch.float32)
    ki = torch.zeros(1, T, di, dtype=torch.bfloat16)
    query = torch.zeros(1, T, hq, d, dtype=torch.bfloat16)
    key = torch.zeros(1, T, 1, d, dtype=torch.bfloat16)
    idx = torch.zeros(1, T, topk, dtype=torch.int32)
    pos = torch.arange(T)[None]
    names = [n for n in dir(il) if n.startswith("_") and n.endswith("_kernel")]
    opts = replace(IndexerLossKernelOptions.DEFAULT, **options)
    with intercept(il, *names) as calls:
        il._tiling_cache.clear()
        p = il.attention_target(query, key, idx, pos, pos, d ** -0.5, options=opts)
        # The DSA layer's path: the attention's log-sum-exp replaces the first pass.
        il.attention_target(query, key, idx, pos, pos, d ** -0.5,
                            attention_lse=torch.zeros(1, T, hq), options=opts)
        kl, lse, psum = il.indexer_loss_rows(qi, w, ki, idx, p, True, options=opts)
        il.indexer_loss_bwd(qi, w, ki, idx, p, lse, psum, torch.ones(()), 0.01, True,
                            options=opts)
        il._tiling_cache.clear()
    return calls


def _indexer_loss_bwd_sm90(hi: int, T: int = 256, lockstep: bool = False,
                           key_passes: int = 1) -> list[Launch]:
    """The warp-specialized Gluon indexer-loss backward (Hopper only; `IndexerLossKernelOptions.
    bwd_sm90`), as `indexer_loss_bwd` launches it by default: hi index heads of 128 dims,
    top-2048, the row KL in the backward (`kl_in_bwd`: with_kl=True); lockstep: its consumers
    paced (`bwd_lockstep`, slack 1); key_passes: `bwd_key_passes` (the split kernel, then the
    RANGED launch that every pass runs)."""
    from megatron_hyscale.ops.kernels import indexer_loss_bwd_sm90 as sm90
    from megatron_hyscale.ops.kernels import key_split

    qi = torch.zeros(1, T, hi, 128, dtype=torch.bfloat16)
    w = torch.zeros(1, T, hi, dtype=torch.float32)
    ki = torch.zeros(1, T, 128, dtype=torch.bfloat16)
    idx = torch.zeros(1, T, 2048, dtype=torch.int32)
    p = torch.zeros(1, T, 2048)
    row = torch.zeros(1, T)
    # CPU tensors here: `unsupported` would refuse them, so the wrapper is called directly
    # (its grid on CPU: the H200's 132 SMs, `indexer_loss_bwd_sm90.CPU_SMS`).
    with intercept(sm90, "_indexer_loss_bwd_kernel") as calls, \
            intercept(key_split, "_key_split_kernel") as split_calls:
        assert sm90.unsupported(qi, w, ki, idx, p, row, row,
                                with_kl=True).startswith("tensors on cpu")
        sm90.indexer_loss_bwd_sm90(qi, w, ki, idx, p, row, row, torch.ones(()), 0.01, True,
                                   with_kl=True, lockstep=lockstep, key_passes=key_passes)
    # The passes differ only in pass_idx (a run-time argument): one launch compiles them all.
    return split_calls + calls[:1]


def _indexer_loss_dense(hi: int, di: int, hq: int, hkv: int, d: int, T: int = 256,
                        relu: bool = True, fold: bool = False, deterministic: bool = False,
                        **options: Any
                        ) -> list[Launch]:
    """stats and loss (with gradients) launches of the dense indexer KL loss
    (`kernels/indexer_loss_dense.py`), bf16 inputs; fold: relu=False's query folded into one fp32
    head (what the sparse op does; the dense op keeps the heads); options:
    IndexerLossKernelOptions fields to change."""
    from megatron_hyscale.ops.kernels import indexer_loss_dense as dl
    from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions

    qi = torch.zeros(1, T, hi, di, dtype=torch.bfloat16)
    w = torch.zeros(1, T, hi, dtype=torch.float32)
    if fold:
        qi, w = torch.zeros(1, T, 1, di), torch.ones(1, T, 1)
    ki = torch.zeros(1, T, di, dtype=torch.bfloat16)
    query = torch.zeros(1, T, hq, d, dtype=torch.bfloat16)
    key = torch.zeros(1, T, hkv, d, dtype=torch.bfloat16)
    pos = torch.arange(T)[None]
    opts = replace(IndexerLossKernelOptions.DEFAULT, **options)
    with intercept(dl, "_dense_stats_kernel", "_dense_loss_kernel") as calls:
        dl._tiling_cache.clear()
        dl.dense_indexer_loss_rows(qi, w, ki, query, key, pos, pos, dl.key_ends(pos, pos),
                                   d ** -0.5, relu, 0.01, True, deterministic, options=opts)
        dl._tiling_cache.clear()
    return calls


def _indexer_loss_index(hi: int, T: int = 256, fused: bool = False, **options: Any
                        ) -> list[Launch]:
    """The indexer loss's index-score kernels alone (GLM-5.1: hi = 32, V3.2: 64; 128 dims,
    top-2048): the row pass and the backward, or with fused=True the fused row pass +
    backward (`indexer_loss_rows_bwd`); options: IndexerLossKernelOptions fields to change."""
    from megatron_hyscale.ops.kernels import indexer_loss as il
    from megatron_hyscale.ops.kernels.options import IndexerLossKernelOptions

    qi = torch.zeros(1, T, hi, 128, dtype=torch.bfloat16)
    w = torch.zeros(1, T, hi, dtype=torch.float32)
    ki = torch.zeros(1, T, 128, dtype=torch.bfloat16)
    idx = torch.zeros(1, T, 2048, dtype=torch.int32)
    p = torch.zeros(1, T, 2048)
    opts = replace(IndexerLossKernelOptions.DEFAULT, **options)
    with intercept(il, "_loss_kernel", "_bwd_kernel", "_rows_bwd_kernel") as calls:
        il._tiling_cache.clear()
        if fused:
            il.indexer_loss_rows_bwd(qi, w, ki, idx, p, torch.ones(()), 0.01, True,
                                     options=opts)
        else:
            row = torch.zeros(1, T)
            il.indexer_loss_rows(qi, w, ki, idx, p, True, options=opts,
                                 with_kl=not opts.kl_in_bwd)
            il.indexer_loss_bwd(qi, w, ki, idx, p, row, row, torch.ones(()), 0.01, True,
                                options=opts, with_kl=opts.kl_in_bwd)
        il._tiling_cache.clear()
    return calls


# The indexer loss's row pass and backward variants (IndexerLossKernelOptions, issue: the
# backward at ~10% of the matmul rate), beside their default.
INDEXER_LOSS_VARIANT_PRESETS: dict[str, Callable[[], list[Launch]]] = {
    "indexer-loss-glm51-index": lambda: _indexer_loss_index(32),
    "indexer-loss-glm51-one-pass": lambda: _indexer_loss_index(32, loss_one_pass=True),
    "indexer-loss-glm51-fused": lambda: _indexer_loss_index(32, fused=True),
    "indexer-loss-glm51-kl-in-bwd": lambda: _indexer_loss_index(32, kl_in_bwd=True),
    "indexer-loss-v32-kl-in-bwd": lambda: _indexer_loss_index(64, kl_in_bwd=True),
    "indexer-loss-glm51-lockstep": lambda: _indexer_loss_index(32, kl_in_bwd=True,
                                                               bwd_lockstep=True),
    "indexer-loss-v32-lockstep": lambda: _indexer_loss_index(64, kl_in_bwd=True,
                                                             bwd_lockstep=True),
    "indexer-loss-glm51-bwd-w8": lambda: _indexer_loss_index(32, bwd_num_warps=8,
                                                             loss_num_warps=8),
    "indexer-loss-glm51-fused-w8": lambda: _indexer_loss_index(32, fused=True, bwd_num_warps=8),
    "indexer-loss-glm51-n32x2": lambda: _indexer_loss_index(32, index_tilings=((32, 2),)),
    "indexer-loss-glm51-n128x2": lambda: _indexer_loss_index(32, index_tilings=((128, 2),),
                                                             bwd_num_warps=8, loss_num_warps=8),
    "indexer-loss-glm51-n64x3": lambda: _indexer_loss_index(32, index_tilings=((64, 3),)),
    # the default before 2026-12-06 (two stages: the gathers not issued a tile ahead)
    "indexer-loss-glm51-n64x2": lambda: _indexer_loss_index(32, index_tilings=((64, 2),)),
    "indexer-loss-v32-index": lambda: _indexer_loss_index(64),
    "indexer-loss-v32-fused": lambda: _indexer_loss_index(64, fused=True),
    "indexer-loss-glm51-r168": lambda: _indexer_loss_index(32, bwd_maxnreg=168),
    "indexer-loss-glm51-w8-r128": lambda: _indexer_loss_index(32, bwd_num_warps=8,
                                                              bwd_maxnreg=128),
    "indexer-loss-glm51-fused-w8-r128": lambda: _indexer_loss_index(
        32, fused=True, bwd_num_warps=8, bwd_maxnreg=128),
    "indexer-loss-glm51-n32x2-r128": lambda: _indexer_loss_index(
        32, index_tilings=((32, 2),), bwd_maxnreg=128),
    "indexer-loss-v32-bwd-w8": lambda: _indexer_loss_index(64, bwd_num_warps=8,
                                                           loss_num_warps=8),
    "indexer-loss-v32-fused-w8": lambda: _indexer_loss_index(64, fused=True, bwd_num_warps=8),
}

# Sequence length of the presets with sampled thresholds: a row block samples only when its rows
# see 4 candidate buffers' worth of keys (16K at top-2048), so 8K would compile no sampling.
SAMPLED_T = 16384
# Every select variant of HyTopKOptions at once (bench_selection.py's hytopk_select).
SELECT_VARIANTS = dict(head_major=True, lean_filter=True, sort_in_kernel=True,
                       sample_keys=1024, bounded_select=True)

# The backward's defaults before dkv_carry and dq_tail_first were timed (2026-12-03).
PREVIOUS_BWD = dict(dkv_carry=False, dq_tail_first=False, dkv_tilings=((64, 1), (16, 2)))

PRESETS: dict[str, Callable[[], list[Launch]]] = {
    "hytopk-dsv32": lambda: _hytopk(64, 128, 2048, True),
    "hytopk-dsv32-key-order": lambda: _hytopk(64, 128, 2048, True, key_order=True),
    "hytopk-dsv32-heads-on-m": lambda: _hytopk(64, 128, 2048, True, keys_on_m=False),
    "hytopk-dsv32-scoreonly": lambda: _hytopk(64, 128, 1, True, mode=1),
    "hytopk-dsv32-r168": lambda: _hytopk(64, 128, 2048, True, maxnreg=168, num_stages=2),
    "hytopk-glm51-r168": lambda: _hytopk(32, 128, 2048, True, maxnreg=168, num_stages=2),
    "hytopk-norelu-r168": lambda: _hytopk(32, 128, 2048, False, maxnreg=168),
    "hytopk-dsv32-scoreonly-heads-on-m": lambda: _hytopk(64, 128, 1, True, mode=1,
                                                         keys_on_m=False),
    "hytopk-dsv32-scan-slots": lambda: _hytopk(64, 128, 2048, True, atomic_slots=False),
    "hytopk-dsv32-fp8": lambda: _hytopk(64, 128, 2048, True, fp8=True),
    "hytopk-dsv32-fp8-scoreonly": lambda: _hytopk(64, 128, 1, True, mode=1, fp8=True),
    "hytopk-dsv32-fp8-promote32": lambda: _hytopk(64, 128, 2048, True, fp8=True,
                                                  fp8_imprecise_acc=32),
    "hytopk-glm51": lambda: _hytopk(32, 128, 2048, True),
    # The key tiles through TMA (HyTopKOptions.key_tma).
    "hytopk-dsv32-key-tma": lambda: _hytopk(64, 128, 2048, True, key_tma=True),
    "hytopk-glm51-key-tma": lambda: _hytopk(32, 128, 2048, True, key_tma=True),
    "hytopk-norelu-key-tma": lambda: _hytopk(32, 128, 2048, False, key_tma=True),
    "hytopk-qsa": lambda: _hytopk(4, 128, 512, True),
    "hytopk-qsa-scoreonly": lambda: _hytopk(4, 128, 1, True, mode=1),
    "hytopk-norelu": lambda: _hytopk(32, 128, 2048, False),
    # HyTopKOptions' select variants (issue #21): one at a time, then all together.
    "hytopk-norelu-head-major": lambda: _hytopk(32, 128, 2048, False, head_major=True),
    "hytopk-norelu-lean": lambda: _hytopk(32, 128, 2048, False, lean_filter=True),
    "hytopk-norelu-sort": lambda: _hytopk(32, 128, 2048, False, sort_in_kernel=True),
    "hytopk-norelu-sample": lambda: _hytopk(32, 128, 2048, False, sample_keys=1024, T=SAMPLED_T),
    "hytopk-norelu-bounded": lambda: _hytopk(32, 128, 2048, False, bounded_select=True),
    "hytopk-norelu-select": lambda: _hytopk(32, 128, 2048, False, **SELECT_VARIANTS, T=SAMPLED_T),
    "hytopk-dsv32-lean": lambda: _hytopk(64, 128, 2048, True, lean_filter=True),
    "hytopk-dsv32-sort": lambda: _hytopk(64, 128, 2048, True, sort_in_kernel=True),
    "hytopk-dsv32-sample": lambda: _hytopk(64, 128, 2048, True, sample_keys=1024, T=SAMPLED_T),
    "hytopk-dsv32-select": lambda: _hytopk(64, 128, 2048, True, **SELECT_VARIANTS, T=SAMPLED_T),
    "hytopk-qsa-head-major": lambda: _hytopk(4, 128, 512, True, head_major=True),
    # HyTopKOptions.row_sort: the row output alone, then in the select kernel (folded query).
    "hytopk-write-rows": lambda: _write_rows(2048),
    "hytopk-write-rows-regs": lambda: _write_rows(2048, row_sort="bitonic_regs"),
    "hytopk-select-survivors": lambda: _write_rows(2048, select=True, key_order=True),
    "row-rank": lambda: _row_rank(),
    "row-rank-widest": lambda: _row_rank(columns=1 << 14, rows=64),
    # The same over the scan slots' key-ordered buffers: order "key" without the row sort.
    "hytopk-select-survivors-in-order": lambda: _write_rows(2048, select=True, ordered=False),
    # That written straight to the rows (HyTopKOptions.scores_sm90_direct_select).
    "hytopk-select-rows-direct": lambda: _select_rows(2048),
    "hytopk-norelu-sort-regs": lambda: _hytopk(32, 128, 2048, False, row_sort="bitonic_regs"),
    # A head dim below tl.dot's 16 (tests' tiny geometries): must still compile.
    "hytopk-tiny-head-dim": lambda: _hytopk(4, 8, 16, True, T=256),
    "sparse-attention-glm51": lambda: _sparse_attention(64, 1, 576, None, 2048),
    # The dQ kernel also emitting the indexer loss's target (sparse_attention_bwd_with_target).
    "sparse-attention-glm51-dq-target": lambda: _sparse_attention(64, 1, 576, None, 2048,
                                                                  dq_target=True),
    "sparse-attention-glm51-no-softmax": lambda: _sparse_attention(64, 1, 576, None, 2048,
                                                                   fwd_softmax=False),
    # AttentionKernelOptions' backward variants (timed 2026-12-03), beside the default above:
    # the previous default (no carry, dK/dV at 64 x 1, the dQ tail last) and the carry at 64 x 1.
    "sparse-attention-glm51-previous": lambda: _sparse_attention(
        64, 1, 576, None, 2048, **PREVIOUS_BWD),
    "sparse-attention-glm51-dkv-carry-64x1": lambda: _sparse_attention(
        64, 1, 576, None, 2048, dkv_tilings=((64, 1),)),
    "sparse-attention-hca-previous": lambda: _sparse_attention(64, 1, 512, None, 128,
                                                               prefix=True, **PREVIOUS_BWD),
    "sparse-attention-qsa-previous": lambda: _sparse_attention(24, 2, 256, 256, 2052,
                                                               **PREVIOUS_BWD),
    "sparse-mla-fwd-sm90-glm51": lambda: _sparse_mla_fwd_sm90(64, 576, 2048),
    "sparse-mla-fwd-sm90-v32": lambda: _sparse_mla_fwd_sm90(128, 576, 2048),
    "sparse-mla-fwd-ws-sm90-glm51": lambda: _sparse_mla_fwd_sm90(64, 576, 2048, ws=True),
    "sparse-mla-fwd-ws-sm90-v32": lambda: _sparse_mla_fwd_sm90(128, 576, 2048, ws=True),
    "sparse-mla-fwd-ws-sm90-csa": lambda: _sparse_mla_fwd_sm90(64, 512, 640, ws=True,
                                                               sink=True),
    # HCA: a window of 128 listed keys after a dense prefix of compressed entries.
    "sparse-mla-fwd-ws-sm90-hca": lambda: _sparse_mla_fwd_sm90(64, 512, 128, ws=True,
                                                               sink=True, prefix=True),
    "sparse-mla-fwd-ws-sm90-glm51-tp2": lambda: _sparse_mla_fwd_sm90(32, 576, 2048, ws=True),
    "sparse-mla-fwd-ws-sm90-glm51-lockstep": lambda: _sparse_mla_fwd_sm90(64, 576, 2048,
                                                                          ws=True,
                                                                          lockstep=True),
    "sparse-mla-fwd-ws-sm90-v32-lockstep": lambda: _sparse_mla_fwd_sm90(128, 576, 2048,
                                                                        ws=True,
                                                                        lockstep=True),
    "sparse-mla-bwd-sm90-glm51": lambda: _sparse_mla_bwd_sm90(64, 576, 2048),
    "sparse-mla-bwd-sm90-v32": lambda: _sparse_mla_bwd_sm90(128, 576, 2048),
    "sparse-mla-bwd-sm90-csa": lambda: _sparse_mla_bwd_sm90(64, 512, 640, sink=True),
    # HCA as the layer runs it (dK atomics 16 bytes wide, lockstep asked: unpaced with a prefix).
    "sparse-mla-bwd-sm90-hca": lambda: _sparse_mla_bwd_sm90(64, 512, 128, sink=True,
                                                            dk_vec4=True, lockstep=True,
                                                            prefix=True),
    "sparse-mla-bwd-sm90-glm51-target": lambda: _sparse_mla_bwd_sm90(64, 576, 2048, dlse=True,
                                                                     target=True),
    # The RoPE kernels, MLA's and V4's (no FMA may appear: tests/ops/test_absorbed_mla.py,
    # tests/ops/test_rope.py).
    "mla-rope-bf16": lambda: _mla_rope(torch.bfloat16),
    "mla-rope-fp32": lambda: _mla_rope(torch.float32),
    "interleaved-rope-bf16": lambda: _interleaved_rope(torch.bfloat16),
    "rms-norm-rope-bf16": lambda: _rms_norm_rope(torch.bfloat16),
    # GLM-5.1 under tensor parallelism 2 (32 heads a rank: one block padded to 64).
    "sparse-mla-bwd-sm90-glm51-tp2": lambda: _sparse_mla_bwd_sm90(32, 576, 2048),
    "sparse-mla-bwd-sm90-glm51-vec4": lambda: _sparse_mla_bwd_sm90(64, 576, 2048, dk_vec4=True),
    "sparse-mla-bwd-sm90-glm51-lockstep": lambda: _sparse_mla_bwd_sm90(64, 576, 2048,
                                                                       dk_vec4=True,
                                                                       lockstep=True),
    "sparse-mla-bwd-sm90-v32-lockstep": lambda: _sparse_mla_bwd_sm90(128, 576, 2048,
                                                                     dk_vec4=True,
                                                                     lockstep=True),
    "sparse-mla-bwd-sm90-csa-vec4": lambda: _sparse_mla_bwd_sm90(64, 512, 640, sink=True,
                                                                 dk_vec4=True),
    # The warp-specialized indexer scores (a TMA producer warp, two wgmma consumer warpgroups).
    "indexer-scores-sm90-dsv32": lambda: _indexer_scores_sm90(64),
    "indexer-scores-sm90-glm51": lambda: _indexer_scores_sm90(32),
    "indexer-filter-sm90-dsv32": lambda: _indexer_filter_sm90(64),
    "indexer-filter-sm90-glm51": lambda: _indexer_filter_sm90(32),
    "indexer-filter-sm90-dsv32-scan": lambda: _indexer_filter_sm90(64, scan_slots=True),
    "indexer-filter-sm90-glm51-scan": lambda: _indexer_filter_sm90(32, scan_slots=True),
    "indexer-filter-sm90-folded-scan": lambda: _indexer_filter_sm90(4, relu=False,
                                                                    scan_slots=True),
    "indexer-filter-sm90-dsv32-immediate": lambda: _indexer_filter_sm90(64, defer_store=False),
    # Each consumer's next product issued before its epilogue (scores_sm90_mma_ahead), with
    # the default 4 key tiles in flight and with 6.
    "indexer-scores-sm90-glm51-ahead": lambda: _indexer_scores_sm90(32, mma_ahead=True),
    "indexer-filter-sm90-dsv32-scan-ahead": lambda: _indexer_filter_sm90(
        64, scan_slots=True, mma_ahead=True),
    "indexer-filter-sm90-glm51-scan-ahead": lambda: _indexer_filter_sm90(
        32, scan_slots=True, mma_ahead=True),
    "indexer-filter-sm90-glm51-scan-ahead6": lambda: _indexer_filter_sm90(
        32, scan_slots=True, mma_ahead=True, stages=6),
    "indexer-filter-sm90-folded-scan-ahead": lambda: _indexer_filter_sm90(
        4, relu=False, scan_slots=True, mma_ahead=True),
    "indexer-filter-sm90-folded-ahead": lambda: _indexer_filter_sm90(4, relu=False,
                                                                     mma_ahead=True),
    "indexer-filter-sm90-glm51-scan-ahead8": lambda: _indexer_filter_sm90(
        32, scan_slots=True, mma_ahead=True, stages=8),
    # The folded query's parts stored part-major: each thread sums its rows' parts in registers
    # (scores_sm90_folded_part_major).
    "indexer-scores-sm90-folded-part-major": lambda: _indexer_scores_sm90(4, relu=False,
                                                                         part_major=True),
    "indexer-filter-sm90-folded-scan-part-major": lambda: _indexer_filter_sm90(
        4, relu=False, scan_slots=True, part_major=True),
    "indexer-filter-sm90-folded-scan-part-major-ahead": lambda: _indexer_filter_sm90(
        4, relu=False, scan_slots=True, part_major=True, mma_ahead=True),
    # The head sum's quad step as a layout change, each score in one thread
    # (scores_sm90_head_sum_transpose), on today's default filter, scores and table.
    "indexer-filter-sm90-glm51-transpose": lambda: _indexer_filter_sm90(
        32, scan_slots=True, mma_ahead=True, head_sum_transpose=True),
    "indexer-filter-sm90-dsv32-transpose": lambda: _indexer_filter_sm90(
        64, scan_slots=True, mma_ahead=True, head_sum_transpose=True),
    "indexer-filter-sm90-dsv32-fp8-transpose": lambda: _indexer_filter_sm90(
        64, fp8=True, scan_slots=True, mma_ahead=True, head_sum_transpose=True),
    "indexer-scores-sm90-glm51-transpose": lambda: _indexer_scores_sm90(
        32, mma_ahead=True, head_sum_transpose=True),
    "indexer-table-sm90-glm51-transpose": lambda: _indexer_table_sm90(
        32, head_sum_transpose=True),
    "indexer-table-sm90-dsv32-fp8-transpose": lambda: _indexer_table_sm90(
        64, fp8=True, head_sum_transpose=True),
    "indexer-table-sm90-dsv32": lambda: _indexer_table_sm90(64),
    "indexer-table-sm90-glm51": lambda: _indexer_table_sm90(32),
    "indexer-scores-sm90-dsv32-fp8": lambda: _indexer_scores_sm90(64, fp8=True),
    "indexer-filter-sm90-dsv32-fp8": lambda: _indexer_filter_sm90(64, fp8=True),
    "indexer-filter-sm90-glm51-fp8": lambda: _indexer_filter_sm90(32, fp8=True),
    "indexer-table-sm90-dsv32-fp8": lambda: _indexer_table_sm90(64, fp8=True),
    # Without ReLU: the folded query as 4 bf16 "heads" (3 parts + a zero one), 32 rows a
    # consumer.
    "indexer-scores-sm90-folded": lambda: _indexer_scores_sm90(4, relu=False),
    "indexer-filter-sm90-folded": lambda: _indexer_filter_sm90(4, relu=False),
    "indexer-filter-sm90-folded-immediate": lambda: _indexer_filter_sm90(4, relu=False,
                                                                         defer_store=False),
    "indexer-table-sm90-folded": lambda: _indexer_table_sm90(4, relu=False),
    "sparse-attention-hca": lambda: _sparse_attention(64, 1, 512, None, 128, prefix=True),
    "sparse-attention-qsa": lambda: _sparse_attention(24, 2, 256, 256, 2052),
    "sparse-attention-qsa-dkv-lockstep": lambda: _sparse_attention(24, 2, 256, 256, 2052,
                                                                   dkv_lockstep=True),
    "sparse-attention-qsa-lockstep": lambda: _sparse_attention(24, 2, 256, 256, 2052,
                                                               dkv_lockstep=True,
                                                               dq_lockstep=True,
                                                               fwd_lockstep=True),
    "indexer-loss-glm51": lambda: _indexer_loss(32, 128, 64, 576, 2048),
    # The dense (warm-up) loss: GLM-5.1 (one head block a row, its query resident), relu off
    # (the heads kept; -folded: one fp32 query, as the sparse op's fold), V3.2 (two head
    # blocks), QSA-like per-head keys (2 KV heads).
    "indexer-loss-dense-glm51": lambda: _indexer_loss_dense(32, 128, 64, 1, 576),
    "indexer-loss-dense-glm51-norelu": lambda: _indexer_loss_dense(32, 128, 64, 1, 576,
                                                                   relu=False),
    "indexer-loss-dense-glm51-norelu-folded": lambda: _indexer_loss_dense(
        32, 128, 64, 1, 576, relu=False, fold=True),
    "indexer-loss-dense-v32": lambda: _indexer_loss_dense(64, 128, 128, 1, 576),
    "indexer-loss-dense-qsa": lambda: _indexer_loss_dense(4, 128, 24, 2, 256),
    **INDEXER_LOSS_VARIANT_PRESETS,
    # The warp-specialized Gluon backward (IndexerLossKernelOptions.bwd_sm90).
    "indexer-loss-bwd-sm90-glm51": lambda: _indexer_loss_bwd_sm90(32),
    "indexer-loss-bwd-sm90-v32": lambda: _indexer_loss_bwd_sm90(64),
    "indexer-loss-bwd-sm90-glm51-lockstep": lambda: _indexer_loss_bwd_sm90(32, lockstep=True),
    "indexer-loss-bwd-sm90-glm51-passes": lambda: _indexer_loss_bwd_sm90(32, key_passes=4),
    "indexer-loss-bwd-sm90-v32-passes": lambda: _indexer_loss_bwd_sm90(64, key_passes=4),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="*", default=["hytopk-dsv32", "hytopk-dsv32-heads-on-m"],
                   help="which kernels to compile (see --list)")
    p.add_argument("--list", action="store_true", help="print the presets and exit")
    p.add_argument("--sass-out", default=None, help="also write each kernel's SASS here")
    p.add_argument("--json", default=None, help="also write the reports (without SASS) here")
    p.add_argument("--record", default=None, metavar="CONFIG",
                   help="also save the reports as a benchmark record (date, commit, command; "
                   "hyscale_bench.measure.save_record) named inspect_sm90-CONFIG, the figures "
                   "BENCHMARKS.md cites from a compile")
    args = p.parse_args(argv)
    if triton_interpret():
        p.error(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')} is set: the kernels "
                "would be interpreted, not compiled")
    if args.list:
        print("\n".join(PRESETS))
        return 0
    unknown = [n for n in args.preset if n not in PRESETS]
    if unknown:
        p.error(f"--preset: unknown {unknown}; choose from {list(PRESETS)}")
    reports = []
    for name in args.preset:
        for i, launch in enumerate(PRESETS[name]()):
            label = f"{name}[{i}] {launch.fn.__name__}"
            rep = report(label, launch)
            reports.append({k: v for k, v in vars(rep).items() if k != "sass"}
                           | {"preset": name, "constexprs": {k: v for k, v in
                                                             launch.kwargs.items()
                                                             if isinstance(v, int | bool)}})
            print(rep.line(), flush=True)
            if args.sass_out:
                os.makedirs(args.sass_out, exist_ok=True)
                path = os.path.join(args.sass_out, f"{name}_{i}_{launch.fn.__name__}.sass")
                with open(path, "w") as f:
                    f.write(rep.sass)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    if args.record:
        from hyscale_bench.measure import save_record

        # a compile measures no rate: both null
        path = save_record("inspect_sm90", args.record, reports, matmul=float("nan"),
                           copy=float("nan"), extra={"target": "sm_90a", "triton":
                                                     triton.__version__})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

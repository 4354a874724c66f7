"""What the Triton kernels share: constants, the accumulation modes and their helpers, the
attention launch grid, the channel split, the dot precision, and the interpreter fix.

One definition each, so that no kernel module reads another's private names.
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType

import torch
import triton
import triton.language as tl

from megatron_hyscale.ops.checks import triton_interpret

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# The same constants inside @triton.jit bodies (globals read there must be constexpr).
LOG2E_JIT = tl.constexpr(LOG2E)
LN2_JIT = tl.constexpr(LN2)

# megatron-core's INDEXER_LOSS_EPS: the clamp of the indexer loss's target normalization and of
# its log (the loss kernels, Triton and Gluon).
INDEXER_LOSS_EPS = 1e-10


def on_hopper(t: torch.Tensor) -> bool:
    """Whether t lies on a Hopper (sm_90) GPU: the Gluon kernels' device."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9


def indexer_grad_buffers(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor,
                         fixed_point: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer loss backward's outputs: dq_index and dweights (written whole, in their
    inputs' dtypes) and dk_index's zeroed accumulator [B, S, D] (fp32 for atomics, int64 for
    the deterministic fixed-point sums)."""
    B, S, D = k_index.shape[0], k_index.shape[1], q_index.shape[3]
    dev = q_index.device
    return (torch.empty(q_index.shape, device=dev, dtype=q_index.dtype),
            torch.empty(weights.shape, device=dev, dtype=weights.dtype),
            torch.zeros((B, S, D), device=dev,
                        dtype=torch.int64 if fixed_point else torch.float32))


# tl.dot needs every dimension >= 16 (heads, keys and channels are padded up to it).
MIN_DOT = 16
# Query heads per program of the attention-shaped kernels (sparse attention, the indexer
# loss's target): the MMA's M. 64 is one wgmma tile height; a [64 x 512] fp32 accumulator
# already takes 128 registers a thread over 8 warps, so 128 heads use two programs.
MAX_BLOCK_H = 64
# Warps a program: the wide count once the resident tile is large (>= 64 x 256), else 4.
WIDE_TILE = 64 * 256

# Accumulation of [keys x channels] gradient tiles into key rows (sparse attention's dK / dV,
# the indexer loss's dk_index): `accumulate`'s MODE.
MODE_ATOMIC = 0  # fp32 atomic adds (fast; the rounding depends on the atomics' order)
MODE_ROWMAX = 1  # deterministic pass 1: atomic max of |contribution| per key row
MODE_FIXED = 2  # deterministic pass 2: int64 fixed-point atomic adds (order-free)
# Measurement only: the same products, each tile reduced to one number and stored to a per-key-row
# slot with a plain store (no atomics), so `bench_attention.py --bwd-sweep` can time the kernel
# without its accumulation. Its output is not a gradient.
MODE_DISCARD = 3
# TMA: coordinates are int32, and a box spans at most 256 elements a dimension.
MAX_TMA_ROWS = 2**31 - 1
MAX_TMA_BOX = 256
# Bits of the int64 accumulators used by the sum of one element's contributions (63 is the
# sign-free maximum; one bit spare for the rounding of each addend).
FIXED_BITS = 62
# Largest power-of-two scale (an fp32 must hold it).
MAX_SCALE_EXP = 120


@triton.jit
def accumulate(ptrs, tile, rows, valid, col_mask, rowmax_base, scale_base, srs,
               MODE: tl.constexpr):
    """Add a [keys x channels] fp32 tile into its key rows, by the given MODE."""
    mask = valid[:, None] & col_mask
    if MODE == 0:
        tl.atomic_add(ptrs, tile, mask=mask, sem="relaxed")
    elif MODE == 1:
        tl.atomic_max(rowmax_base + rows * srs, tl.max(tl.abs(tile), axis=1), mask=valid,
                      sem="relaxed")
    elif MODE == 3:
        tl.store(rowmax_base + rows * srs, tl.sum(tl.where(mask, tile, 0.0), axis=1), mask=valid)
    else:
        fx = tl.load(scale_base + rows * srs, mask=valid, other=0.0)
        fixed = tl.floor(tile * fx[:, None] + 0.5).to(tl.int64)
        tl.atomic_add(ptrs, fixed, mask=mask, sem="relaxed")


def fixed_point_scale(rowmax: torch.Tensor, n_contrib: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row power-of-two scales (fp32) and their exponents so that n_contrib addends of size
    <= rowmax fit 2^FIXED_BITS (MODE_FIXED's accumulators)."""
    rm = rowmax.double()
    exp = torch.floor(FIXED_BITS - math.log2(max(n_contrib, 1)) - torch.log2(rm))
    exp = torch.where(rm > 0, exp, torch.zeros_like(exp)).clamp(max=MAX_SCALE_EXP)
    return torch.ldexp(torch.ones_like(rm), exp).float(), exp


def launch_grid(queries: int, kv_heads: int, head_blocks: int, adjacent: bool
                ) -> tuple[tuple[int, ...], int]:
    """(launch grid, the kernels' NG) for kv_heads x head_blocks programs a query.

    adjacent (and one KV head split over several head blocks): a 1-D grid of queries x NG
    programs with a query's head blocks next to each other (they gather the same key rows);
    else a (queries, programs) grid and NG = 0. The sparse-attention kernels and the Hopper
    forward decode their program ids from this."""
    programs = kv_heads * head_blocks
    if adjacent and kv_heads == 1 and head_blocks > 1:
        return (queries * programs,), programs
    return (queries, programs), 0


def lockstep_plan(work: int, device: torch.device, slack: int, per_sm: int = 1
                  ) -> tuple[int, torch.Tensor]:
    """(programs, zeroed int32 counters, one a wave) for a lockstep kernel: per_sm programs an
    SM (those that are resident at once; at most `work`), program p taking work items p, p +
    programs, ...; ValueError unless slack (the tiles a program may lead its wave by) is an
    int >= 1."""
    if isinstance(slack, bool) or not (isinstance(slack, int) and slack >= 1):
        raise ValueError(f"lockstep_slack must be an int >= 1 (key tiles a program may lead "
                         f"the slowest of its wave by), got {slack!r}")
    programs = min(work, sm_count(device) * per_sm)
    return programs, torch.zeros(triton.cdiv(work, programs), device=device, dtype=torch.int32)


# Lockstep kernels (`lockstep_plan`): reads of a wave's counter a program makes at most before
# its next tile anyway (about 0.5 us each, an L2 round trip): a program that never arrives (an
# SM another kernel holds) costs each tile this much and nothing else.
SYNC_SPINS = 64
# One lockstep step as one inline-PTX block (`lockstep_step`): thread 0 counts the program's
# start of a tile in its wave's counter, then every thread reads the counter (at most $3 times)
# until it reaches $2. A `while` in the tile loop instead keeps Triton from pipelining the loop's
# key gathers (compiled for sm_90a: no cp.async left in it); the asm is one opaque op. ${:uid}
# makes the labels unique per inlined copy; "nounroll" keeps ptxas from unrolling the spin
# (64 reads a tile in the hot loop otherwise). The reads go to a register of the block's own
# and reach $0 only at the end: $0 is not early-clobber, so it may share a register with $2.
_LOCKSTEP_STEP = tl.constexpr(
    "{ .reg .pred p; .reg .b32 t, n, v; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
    "@p red.relaxed.gpu.global.add.u32 [$1], 1; mov.u32 n, 0; "
    "WAIT${:uid}: .pragma \"nounroll\"; ld.volatile.global.b32 v, [$1]; "
    "setp.lt.s32 p, v, $2; "
    "@!p bra DONE${:uid}; add.u32 n, n, 1; setp.lt.u32 p, n, $3; @p bra WAIT${:uid}; "
    "DONE${:uid}: mov.b32 $0, v; }")


@triton.jit
def lockstep_step(count_ptr, need, SPINS: tl.constexpr, PTX: tl.constexpr):
    """Count this program's start of a key tile in its wave's counter, then spin (at most SPINS
    reads) until the counter reaches `need`, the starts the wave's programs make together when
    each has started the tile SYNC_SLACK before (a fast program's extra starts count too, so
    it is a bound on the spread on average, not per program): a pace, not a dependency
    (nothing the counted programs wrote is read), so giving up is safe. PTX: as one
    inline-asm block (the interpreter runs the tl form)."""
    if PTX:
        tl.inline_asm_elementwise(_LOCKSTEP_STEP, "=r,l,r,r",
                                  [count_ptr.to(tl.int64), need.to(tl.int32),
                                   tl.full([], SPINS, tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_add(count_ptr, 1, sem="relaxed")
        seen = tl.load(count_ptr, volatile=True)
        spins = 1
        while (seen < need) & (spins < SPINS):
            seen = tl.load(count_ptr, volatile=True)
            spins += 1


# Programs a lockstep launch runs off CUDA (Triton's interpreter, one program after another):
# enough for several waves in a test's few rows, each waiting out its SYNC_SPINS alone.
INTERPRETER_SMS = 3


@functools.cache
def gluon_module(name: str) -> tuple[ModuleType | None, str]:
    """(the kernels module `name` of this package, "") or (None, why it cannot be loaded):
    tried once a process, since a Triton without Gluon's Hopper API (tested: 3.6), or an older
    one whose layouts differ, will not gain it later."""
    try:
        return importlib.import_module(f"{__package__}.{name}"), ""
    except (ImportError, AttributeError, TypeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (INTERPRETER_SMS off CUDA): persistent grids."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def channel_split(d: int) -> tuple[int, int]:
    """(main, tail) channel tiles of a head dim: a power-of-two main part (>= MIN_DOT) and the
    rest padded to a power of two (>= MIN_DOT), 0 when there is none (576 = 512 + 64)."""
    d_main = max(MIN_DOT, 1 << (d.bit_length() - 1))
    rest = d - d_main
    d_tail = max(MIN_DOT, triton.next_power_of_2(rest)) if rest > 0 else 0
    return d_main, d_tail


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of this dtype: fp32 inputs get exact fp32 products
    (the interpreter and the CPU tests); bf16 / fp16 products are exact in the MMA anyway,
    accumulated in fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fix_interpreter() -> None:
    """Under Triton's interpreter (TRITON_INTERPRET=1, or true / on / yes, which Triton also
    reads), fix two of Triton 3.6's interpreter bugs (else nothing).

    - Run-time loop bounds with numpy >= 2.4: the interpreter holds scalars as 1-element
      arrays and converts them with int(), which numpy 2.4 rejects for arrays of one
      dimension; read the single element instead.
    - bf16 products: the interpreter stores bf16 as raw uint16 bits and its tl.dot multiplies
      those bits as integers; widen bf16 operands to fp32 first (exact), as it already widens
      fp8 ones.
    - fp32 -> bf16 casts: the interpreter truncates (and its "rtne" mode rounds half up without
      carrying into the exponent); round to nearest even, as the GPU's `.to(tl.bfloat16)` and
      torch do, so a kernel that rounds where torch rounds matches it bit for bit here too.
    Every kernel module calls this at import.
    """
    if not triton_interpret():
        return
    import numpy as np  # the interpreter's own dependency
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_hyscale_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._hyscale_fixed = True
    interpreter._patch_lang_tensor = patched

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision,
                          max_num_imprecise_acc)

    builder.create_dot = dot

    convert_float = interpreter._convert_float
    toward_zero = interpreter._ir.ROUNDING_MODE.RTZ

    def rounded(data, src_type, dst_type, rounding_mode):
        if src_type != tl.float32 or dst_type != tl.bfloat16 or rounding_mode == toward_zero:
            return convert_float(data, src_type, dst_type, rounding_mode)
        values = np.array(data, dtype=np.float32)  # a copy, any shape (0-d included)
        bits = values.view(np.uint32).astype(np.uint64)
        nearest = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(values)
        # A NaN keeps its sign and a quiet payload instead of rounding into infinity.
        nearest = np.where(nan, (bits >> 16) | 0x40, nearest)
        return nearest.astype(np.uint16)

    rounded.__wrapped__ = convert_float
    interpreter._convert_float = rounded

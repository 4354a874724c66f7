"""The warp-specialized Hopper indexer scores (ops/kernels/indexer_scores_sm90.py).

CPU: the input checks, and the kernel's compiled form for sm_90a (scripts/inspect_sm90.py, run
as a subprocess: this session may interpret Triton kernels, the tool needs them compiled).
GPU (Hopper): each causal row's largest score against a plain-torch fp64 reference. Integer-valued
inputs make every fp32 product and partial sum an integer below 2^24, so any summation order
gives the reference bit for bit. Random bf16 inputs: one score is a length-D dot product, a ReLU
and a length-H weighted sum, so the kernel's fp32 score is within (D + H + 1) * eps * A(t, s) of
the exact one (eps = 2^-24, A(t, s) = sum_h |w_h| sum_d |q_hd k_sd|), and so is the max over s;
by Cauchy-Schwarz A(t, s) <= A_t = sum_h |w_h| ||q_h|| max_s ||k_s||. Tested with twice that.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="Gluon's Hopper API (tested with Triton 3.6)")
from megatron_hyscale.ops.kernels import indexer_scores_sm90 as sm90  # noqa: E402
from megatron_hyscale.testing.inspect_sm90 import run_inspect_sm90  # noqa: E402

PRESETS = {"indexer-scores-sm90-dsv32": 64, "indexer-scores-sm90-glm51": 32}
EPS32 = 2.0**-24
# The H200's shared memory a block.
SMEM_LIMIT = 232448


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")


# --------------------------------------------------------------------------- CPU: inputs


def _cpu(B=1, T=8, H=64, D=128):
    return (torch.zeros(B, T, H, D, dtype=torch.bfloat16),
            torch.zeros(B, T, D, dtype=torch.bfloat16), torch.zeros(B, T, H))


def test_valid_inputs_pass_the_checks():
    sm90.check_inputs(*_cpu())
    sm90.check_inputs(*_cpu(B=2, H=32))
    # padded rows: q's heads and k's keys 8-element multiples apart, still packed
    q = torch.zeros(2, 8, 64, 136, dtype=torch.bfloat16)[..., :128]
    k = torch.zeros(2, 8, 144, dtype=torch.bfloat16)[..., :128]
    sm90.check_inputs(q, k, torch.zeros(2, 8, 64))


def _misaligned_q():
    flat = torch.zeros(8 * 64 * 128 + 1, dtype=torch.bfloat16)
    return flat[1:].view(1, 8, 64, 128)


@pytest.mark.parametrize("arg,change,pattern", [
    ("q", lambda q, k, w: (q[0], k, w), r"^q must have 4 dims"),
    ("k", lambda q, k, w: (q, k[..., None], w), r"^k must have 3 dims"),
    ("w", lambda q, k, w: (q, k, w[..., 0]), r"^w must have 3 dims"),
    ("q", lambda q, k, w: (q.half(), k, w),
     r"^q dtype must be one of \['torch.bfloat16', 'torch.float8_e4m3fn'\]"),
    ("k", lambda q, k, w: (q, k.float(), w), r"^k dtype must be one of \['torch.bfloat16'\]"),
    ("w", lambda q, k, w: (q, k, w.bfloat16()), r"^w dtype must be one of \['torch.float32'\]"),
    ("q", lambda q, k, w: (q[..., :64], k[..., :64], w), r"^q: head dim must be 128"),
    ("q", lambda q, k, w: (q[:, :, :16], k, w[:, :, :16]), r"^q: heads must be one of"),
    ("k", lambda q, k, w: (q, k[:, :4], w), r"^k must be \[B, S, D\].*S == T"),
    ("w", lambda q, k, w: (q, k, w[:, :4]), r"^w must be \[B, T, H\]"),
    ("q", lambda q, k, w: (torch.zeros(1, 64, 8, 128, dtype=torch.bfloat16).transpose(1, 2), k,
                           w), r"^q must be readable as \[B \* T \* H, D\] rows"),
    ("q", lambda q, k, w: (torch.zeros(1, 8, 64, 256, dtype=torch.bfloat16)[..., ::2], k, w),
     r"^q must be readable"),
    ("k", lambda q, k, w: (q, torch.zeros(1, 8, 132, dtype=torch.bfloat16)[..., :128], w),
     r"^k must be readable as \[B \* S, D\] rows"),
    ("q", lambda q, k, w: (_misaligned_q(), k, w), r"^q must be 16-byte aligned"),
])
def test_bad_inputs_raise_naming_the_argument(arg, change, pattern):
    """Validation runs before anything is launched: these are CPU tensors."""
    with pytest.raises(ValueError, match=pattern) as info:
        sm90.indexer_row_max_sm90(*change(*_cpu()))
    assert str(info.value).startswith(arg)


def test_key_scales_go_with_fp8_only():
    """e4m3 q and k need k_scale fp32 [B, S]; bf16 ones take none; q and k share a dtype."""
    q, k, w = _cpu(B=2, T=8)
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    sm90.check_inputs(q8, k8, w, k_scale=torch.ones(2, 8))
    with pytest.raises(ValueError, match="^k_scale goes with e4m3 q and k only"):
        sm90.indexer_row_max_sm90(q, k, w, k_scale=torch.ones(2, 8))
    with pytest.raises(ValueError, match=r"^k_scale \(fp32 \[B, S\]\) is required"):
        sm90.indexer_row_max_sm90(q8, k8, w)
    with pytest.raises(ValueError, match=r"^k_scale must be \[B, S\] = \(2, 8\)"):
        sm90.indexer_row_max_sm90(q8, k8, w, k_scale=torch.ones(2, 4))
    with pytest.raises(ValueError, match="^k_scale dtype must be one of"):
        sm90.indexer_row_max_sm90(q8, k8, w, k_scale=torch.ones(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^k dtype must be one of \['torch.float8_e4m3fn'\]"):
        sm90.indexer_row_max_sm90(q8, k, w, k_scale=torch.ones(2, 8))
    # TMA's 16 bytes are 16 e4m3 elements: a key stride of 136 (272 bytes in bf16) is refused
    k_pad = torch.zeros(2, 8, 136, dtype=torch.bfloat16)[..., :128]
    sm90.check_inputs(q, k_pad, w)
    k8_pad = torch.zeros(2, 8, 136, dtype=torch.float8_e4m3fn)[..., :128]
    with pytest.raises(ValueError, match="^k must be readable.*a multiple of 16"):
        sm90.check_inputs(q8, k8_pad, w, k_scale=torch.ones(2, 8))


def test_the_folded_query_takes_four_bf16_parts():
    """relu=False: q is the folded query's parts, FOLDED_HEADS of them, bf16 only; the ReLU
    head counts are refused without ReLU and the parts' count with it."""
    sm90.check_inputs(*_cpu(H=4), relu=False)
    with pytest.raises(ValueError, match=r"^q: heads must be one of \(4,\) without ReLU"):
        sm90.indexer_row_max_sm90(*_cpu(H=32), relu=False)
    with pytest.raises(ValueError, match=r"^q: heads must be one of \(32, 64\), got 4"):
        sm90.indexer_row_max_sm90(*_cpu(H=4))
    q, k, w = _cpu(H=4)
    with pytest.raises(ValueError, match="^q: without ReLU the folded query's parts are bf16"):
        sm90.check_inputs(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), w,
                          k_scale=torch.ones(1, 8), relu=False)
    with pytest.raises(ValueError, match=r"^k must be \[B, S, D\]"):
        sm90.indexer_filter_sm90(q, k[:, :4], w, torch.zeros(1, 8), 0, 8, 16, relu=False)


def test_part_major_parts_are_checked():
    """part_major: q the folded parts stored [B, H, T, D] (a permuted view), relu=False only;
    a (token, head)-major q is refused naming q, and part_major with ReLU naming it."""
    q, k, w = _cpu(B=2, H=4)
    part_major = q.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    sm90.check_inputs(part_major, k, w, relu=False, part_major=True)
    sm90.check_inputs(part_major[:1], k[:1], w[:1], relu=False, part_major=True)
    with pytest.raises(ValueError, match=r"^q must be part-major"):
        sm90.indexer_row_max_sm90(q, k, w, relu=False, part_major=True)
    with pytest.raises(ValueError, match=r"^q must be readable as \[B \* T \* H, D\]"):
        sm90.indexer_row_max_sm90(part_major, k, w, relu=False)
    with pytest.raises(ValueError, match="^part_major takes the folded query's parts"):
        sm90.check_inputs(*_cpu(H=32), part_major=True)


def test_head_sum_transpose_takes_relu_heads():
    """head_sum_transpose: ReLU's 32 or 64 heads (bf16 or e4m3); the folded parts (4 heads,
    relu=False) are refused naming it, before any launch."""
    sm90.check_inputs(*_cpu(H=32), head_sum_transpose=True)
    sm90.check_inputs(*_cpu(H=64), head_sum_transpose=True)
    q, k, w = _cpu(H=4)
    for call in (lambda: sm90.indexer_row_max_sm90(q, k, w, relu=False, head_sum_transpose=True),
                 lambda: sm90.indexer_filter_sm90(q, k, w, torch.zeros(1, 8), 0, 8, 16,
                                                  relu=False, head_sum_transpose=True),
                 lambda: sm90.indexer_table_sm90(q, k, w, 1, 0, 8, relu=False,
                                                 head_sum_transpose=True)):
        with pytest.raises(ValueError, match="^head_sum_transpose takes ReLU's heads"):
            call()


def test_unpacked_batches_are_refused():
    q, k, w = _cpu(B=2)
    k2 = torch.zeros(2, 16, 128, dtype=torch.bfloat16)[:, :8]  # batch stride 16 keys, not 8
    with pytest.raises(ValueError, match="^k must be readable"):
        sm90.indexer_row_max_sm90(q, k2, w)
    q2 = torch.zeros(2, 16, 64, 128, dtype=torch.bfloat16)[:, :8]
    with pytest.raises(ValueError, match="^q must be readable"):
        sm90.indexer_row_max_sm90(q2, k, w)


@pytest.mark.parametrize("stages", [1, 9, True, 4.0, "4"])
def test_stages_outside_the_range_raise_naming_it(stages):
    q, k, w = _cpu()
    with pytest.raises(ValueError, match="stages must be an int from 2 to 8"):
        sm90.indexer_row_max_sm90(q, k, w, stages=stages)
    with pytest.raises(ValueError, match="stages must be an int from 2 to 8"):
        sm90.indexer_filter_sm90(q, k, w, torch.zeros(1, 8), 0, 8, 16, stages=stages)


def test_table_checks_its_arguments():
    """`indexer_table_sm90`: k holds every key_stride-th of T keys (ceil(T / stride) of them),
    the stride an int >= 1, the rows within [0, T]; checked before any launch (CPU tensors)."""
    q, _, w = _cpu(T=10)
    k = torch.zeros(1, 4, 128, dtype=torch.bfloat16)  # keys 0, 3, 6, 9 of 10
    sm90.check_inputs(q, k, w, 3)
    with pytest.raises(ValueError, match=r"^k must be \[B, S, D\] = \(1, 2, 128\) \(every 8"):
        sm90.indexer_table_sm90(q, k, w, 8, 0, 10)
    for stride in (0, 1.5, True):
        with pytest.raises(ValueError, match="^key_stride must be an int >= 1"):
            sm90.indexer_table_sm90(q, k, w, stride, 0, 10)
    with pytest.raises(ValueError, match="^t_lo, t_hi must satisfy"):
        sm90.indexer_table_sm90(q, k, w, 3, 4, 11)
    empty = sm90.indexer_table_sm90(q, k, w, 3, 5, 5)  # no row: nothing launched
    assert empty.shape == (1, 0, 4) and empty.dtype == torch.float32
    # batch 2: the sampled keys packed ([B * S, D] rows, as TMA reads them) pass; a view of
    # the whole sequence's keys (batch stride T keys) is refused, not read wrongly
    q2, k2_full, w2 = _cpu(B=2, T=10)
    sm90.check_inputs(q2, k2_full[:, ::3].contiguous(), w2, 3)
    with pytest.raises(ValueError, match=r"^k must be readable as \[B \* S, D\] rows"):
        sm90.check_inputs(q2, k2_full[:, :4], w2, 3)


# --------------------------------------------------------------------------- CPU: compiled


def test_presets_compile_warp_specialized_without_spills(tmp_path: Path):
    """Both presets compile for sm_90a: no local memory at all; the consumer's key-tile loop
    issues one [64 keys x 128 pairs x 128 dims] product (8 HGMMA) and keeps the head sum in
    registers (quad shuffles, no shared memory); two consumers' products in the kernel (16
    HGMMA), a TMA producer (UTMALDG), the partitions' register budgets (setmaxnreg: 24 for the
    producer's warpgroup, 240 for the consumers), and each consumer's two single-thread
    mbarrier arrivals a tile (the stage's release, the other consumer's turn)."""
    out = tmp_path / "r.json"
    proc = run_inspect_sm90("--preset", *PRESETS, "--json", str(out), "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(out.read_text())
    assert [r["preset"] for r in reports] == list(PRESETS)
    for rep in reports:
        heads = PRESETS[rep["preset"]]
        c = rep["constexprs"]
        assert (c["H"], c["ROWS"], c["BLOCK_S"]) == (heads, 128 // heads, 64)
        assert c["PINGPONG"] is True and c["num_warps"] == 4
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["stack_bytes"] == 0
        assert rep["perf_warnings"] == []  # no wgmma serialized (C7514)
        assert 2 * 32768 + c["NUM_STAGES"] * 16384 <= rep["shared_bytes"] <= SMEM_LIMIT
        ops = rep["loop_ops"]
        assert ops["HGMMA"] == 8 and ops["HMMA"] == 0
        assert ops["LDL"] == 0 and ops["STL"] == 0 and ops["LDS"] == 0 and ops["STS"] == 0
        # head sum: log2(4 lanes) shuffle levels x 2 key rows x ROWS sums a thread
        assert ops["SHFL"] == 2 * 2 * c["ROWS"]
        assert ops["LDG"] == 0 and ops["STG"] == 0  # w loaded once, out stored once
        sass = (tmp_path / f"{rep['preset']}_0__indexer_scores_kernel.sass").read_text()
        assert len(re.findall(r"\bHGMMA\.", sass)) == 16
        assert not re.search(r"\b(LDL|STL)\b", sass)
        assert "UTMALDG" in sass and "LDGSTS" not in sass
        assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x18\b", sass)  # producer: 24
        assert re.search(r"USETMAXREG\.\w+\.CTAPOOL (UP0, )?0xf0\b", sass)  # consumers: 240
        assert len(re.findall(r"SYNCS\.ARRIVE\.TRANS64\.A1T0", sass)) == 4


def _epilogue_reports(tmp_path: Path, *presets: str, gemm: str = "HGMMA", steps: int = 8
                      ) -> list[dict]:
    """The presets' compile reports, each without local memory or a serialized wgmma, its loop
    holding the one product (8 HGMMA: bf16 K-steps of 16; 4 QGMMA for e4m3)."""
    out = tmp_path / "e.json"
    proc = run_inspect_sm90("--preset", *presets, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(out.read_text())
    assert [r["preset"] for r in reports] == list(presets)
    for rep in reports:
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["stack_bytes"] == 0
        assert rep["perf_warnings"] == []
        ops = rep["loop_ops"]
        assert ops[gemm] == steps and ops["LDL"] == 0 and ops["STL"] == 0
    return reports


def test_filter_presets_compile_without_spills(tmp_path: Path):
    """The FILTER epilogue (`indexer_filter_sm90`) keeps the loop's product and head sum, adds
    one relaxed atomic and one store a survivor slot of each thread (one element a thread: no
    broadcast copy counted twice), and spills nothing."""
    for rep in _epilogue_reports(tmp_path, "indexer-filter-sm90-dsv32",
                                 "indexer-filter-sm90-glm51"):
        c, ops = rep["constexprs"], rep["loop_ops"]
        assert c["FILTER"] is True and c["CAP"] == 4096
        per_thread = max(1, c["ROWS"] // 2)  # BLOCK_S x ROWS over 128 threads
        assert ops["ATOMG"] == per_thread and ops["STG"] == per_thread


def test_scan_slot_presets_compile_without_atomics(tmp_path: Path):
    """The filter with its slots from a scan (`_scan_slots`, scores_sm90_scan_slots): the same
    product, no atomics, the survivors stored at once (no deferred store), one store a key and
    row of each thread in the scan layout (a tile's keys in one warp: BLOCK_S / 32 a thread,
    the rows over the warps), no spill; every row count (2, 4 and the folded query's 32)."""
    for rep in _epilogue_reports(tmp_path, "indexer-filter-sm90-dsv32-scan",
                                 "indexer-filter-sm90-glm51-scan",
                                 "indexer-filter-sm90-folded-scan"):
        c, ops = rep["constexprs"], rep["loop_ops"]
        assert c["FILTER"] is True and c["SCAN_SLOTS"] is True and c["DEFER_STORE"] is False
        assert ops["ATOMG"] == 0 and ops.get("ATOMS", 0) == 0
        assert ops["STG"] == (64 // 32) * max(1, c["ROWS"] // 4)


def test_products_ahead_presets_compile_unserialized(tmp_path: Path):
    """mma_ahead (scores_sm90_mma_ahead): the loop runs two key tiles, each product (8 HGMMA)
    with one wgmma fence and one wait (ptxas serialized none: every HGMMA with its own wait
    would give 16 each), on two accumulators; no spill; the scores-only and filter epilogues
    (every row count), 6 and 8 key tiles in flight in their shared memory. The folded query
    with the slot atomics runs without it (its registers would spill): one product a loop."""
    ahead = {"indexer-scores-sm90-glm51-ahead": 4, "indexer-filter-sm90-dsv32-scan-ahead": 4,
             "indexer-filter-sm90-glm51-scan-ahead": 4,
             "indexer-filter-sm90-glm51-scan-ahead6": 6,
             "indexer-filter-sm90-glm51-scan-ahead8": 8,
             "indexer-filter-sm90-folded-scan-ahead": 4}
    for rep in _epilogue_reports(tmp_path, *ahead, steps=16):
        c, ops = rep["constexprs"], rep["loop_ops"]
        assert c["MMA_AHEAD"] is True and ops["WARPGROUP"] == 4, rep["preset"]
        assert c["NUM_STAGES"] == ahead[rep["preset"]], rep["preset"]
        assert 2 * 32768 + c["NUM_STAGES"] * 16384 <= rep["shared_bytes"] <= SMEM_LIMIT
    (atomics,) = _epilogue_reports(tmp_path, "indexer-filter-sm90-folded-ahead")
    assert atomics["constexprs"]["MMA_AHEAD"] is False
    assert atomics["constexprs"]["SCAN_SLOTS"] is False


def test_part_major_presets_sum_parts_in_registers(tmp_path: Path):
    """part_major (scores_sm90_folded_part_major): the folded query's columns run (part, row),
    so no shuffle sums a row's parts (the scores-only loop has none; the filter's only the
    scan's, one row a thread over 4 lanes: 2 steps and the row total's), no weight multiply,
    no spill, one store a key of each thread's row; fewer instructions a tile than the
    (row, part) order, under 70% of them in the loop over the tiles seen whole (the diagonal
    tiles' loop, the causal tests in, is the hot loop measured); with and without the product
    ahead."""
    names = ("indexer-scores-sm90-folded-part-major", "indexer-filter-sm90-folded-scan-part-major",
             "indexer-scores-sm90-folded", "indexer-filter-sm90-folded-scan")
    scores, filt, old_scores, old_filt = _epilogue_reports(tmp_path, *names)
    for rep in (scores, filt):
        assert rep["constexprs"]["PART_MAJOR"] is True and rep["constexprs"]["H"] == 4
        assert rep["loop_ops"].get("FMUL", 0) == rep["loop_ops"].get("FFMA", 0) == 0
    assert scores["loop_ops"].get("SHFL", 0) == 0 and filt["loop_ops"]["SHFL"] <= 8
    assert filt["loop_ops"]["STG"] == 64 // 4 and filt["loop_ops"]["ATOMG"] == 0
    assert scores["loop_instructions"] < old_scores["loop_instructions"]
    assert filt["loop_instructions"] < old_filt["loop_instructions"]
    # two loops a consumer: the tiles seen whole (no causal test), then the diagonal ones
    assert len(filt["mma_loop_sizes"]) == 2 * len(old_filt["mma_loop_sizes"]) == 4
    assert min(filt["mma_loop_sizes"]) < 0.7 * old_filt["loop_instructions"]
    (ahead,) = _epilogue_reports(tmp_path, "indexer-filter-sm90-folded-scan-part-major-ahead",
                                 steps=16)
    assert ahead["constexprs"]["MMA_AHEAD"] is True and ahead["loop_ops"]["WARPGROUP"] == 4


def test_head_sum_transpose_presets_hold_each_score_once(tmp_path: Path):
    """head_sum_transpose (scores_sm90_head_sum_transpose): the quad's partial head sums
    change hands through shared memory instead of butterfly shuffles, so the scores alone
    shuffle nothing, the filter only for its scan (GLM-5.1 and V3.2, the default filter's
    options, fp8 too), reaching the scan layout in the same change (no more partition
    barriers than without, half the plain stores at most); fewer loop instructions than the
    same kernels without it, no spill, no serialized wgmma; the scan filter in two loops a
    consumer (the tiles seen whole without the causal tests, fewer instructions, then the
    diagonal ones)."""
    pairs = {"indexer-filter-sm90-glm51-transpose": "indexer-filter-sm90-glm51-scan-ahead",
             "indexer-filter-sm90-dsv32-transpose": "indexer-filter-sm90-dsv32-scan-ahead",
             "indexer-scores-sm90-glm51-transpose": "indexer-scores-sm90-glm51-ahead"}
    reports = _epilogue_reports(tmp_path, *pairs, *pairs.values(), steps=16)
    by_name = {rep["preset"]: rep for rep in reports}
    for new, old in pairs.items():
        new_r, old_r = by_name[new], by_name[old]
        assert new_r["constexprs"]["HEAD_SUM_TRANSPOSE"] is True, new
        assert old_r["constexprs"]["HEAD_SUM_TRANSPOSE"] is False, old
        assert new_r["loop_instructions"] < old_r["loop_instructions"], new
        assert new_r["loop_ops"]["SHFL"] < old_r["loop_ops"]["SHFL"], new
        assert new_r["loop_ops"]["STS"] <= max(4, old_r["loop_ops"]["STS"] // 2), new
        if "filter" in new:
            assert new_r["loop_ops"]["BAR"] <= old_r["loop_ops"]["BAR"], new
    assert by_name["indexer-scores-sm90-glm51-transpose"]["loop_ops"]["SHFL"] == 0
    for name in ("indexer-filter-sm90-glm51-transpose", "indexer-filter-sm90-dsv32-transpose"):
        seen, diagonal = by_name[name]["mma_loop_sizes"][:2]
        assert len(by_name[name]["mma_loop_sizes"]) == 4 and seen < diagonal, name
    for name in ("indexer-filter-sm90-glm51-transpose", "indexer-filter-sm90-dsv32-transpose"):
        assert by_name[name]["loop_ops"]["SHFL"] <= 12, name  # the scan's: 6 a tile
    for rep in _epilogue_reports(tmp_path, "indexer-filter-sm90-dsv32-fp8-transpose",
                                 gemm="QGMMA", steps=8) + _epilogue_reports(
            tmp_path, "indexer-table-sm90-dsv32-fp8-transpose", gemm="QGMMA",
            steps=4) + _epilogue_reports(tmp_path, "indexer-table-sm90-glm51-transpose"):
        assert rep["constexprs"]["HEAD_SUM_TRANSPOSE"] is True
        assert rep["loop_ops"]["SHFL"] <= 12, rep["preset"]


def test_fp8_presets_compile_without_spills(tmp_path: Path):
    """e4m3 q and k (HyTopK's precision="fp8"): the same loops on fp8 wgmma (4 QGMMA of K = 32
    a [64 x 128 x 128] product, no HGMMA), the keys' scales loaded under the product (2 LDG a
    tile), half the shared memory, no spill; every epilogue."""
    reports = _epilogue_reports(tmp_path, "indexer-scores-sm90-dsv32-fp8",
                                "indexer-filter-sm90-dsv32-fp8", "indexer-filter-sm90-glm51-fp8",
                                "indexer-table-sm90-dsv32-fp8", gemm="QGMMA", steps=4)
    for rep in reports:
        c, ops = rep["constexprs"], rep["loop_ops"]
        assert c["MMA_K"] == 32 and c["KEY_SCALE"] is True and ops["HGMMA"] == 0
        assert ops["LDG"] == 2 and rep["shared_bytes"] < 2 * 32768 + 4 * 16384


def test_table_presets_compile_without_spills(tmp_path: Path):
    """The TABLE epilogue (`indexer_table_sm90`, HyTopK's sampled thresholds): the loop's
    product and head sum, one store a thread's score (one element a thread), no atomics, no
    spill."""
    for rep in _epilogue_reports(tmp_path, "indexer-table-sm90-dsv32",
                                 "indexer-table-sm90-glm51"):
        c, ops = rep["constexprs"], rep["loop_ops"]
        assert c["TABLE"] is True and c["FILTER"] is False
        assert ops["ATOMG"] == 0 and ops["STG"] == max(1, c["ROWS"] // 2)


def test_folded_presets_compile_without_spills(tmp_path: Path):
    """Without ReLU (the folded query's 3 bf16 parts and a zero one as 4 "heads", 32 rows a
    consumer): the scores-only, filter (survivors stored right after their atomics, as
    `indexer_filter_sm90` runs it for relu=False) and table epilogues keep the one product, sum
    each row's parts over a register pair and one lane bit, and spill nothing; no max (ReLU)
    in the scores-only loop but the running row maximum's."""
    reports = _epilogue_reports(tmp_path, "indexer-scores-sm90-folded",
                                "indexer-filter-sm90-folded-immediate",
                                "indexer-table-sm90-folded")
    for rep in reports:
        c, ops = rep["constexprs"], rep["loop_ops"]
        assert (c["H"], c["ROWS"], c["RELU"]) == (4, 32, False)
        # one lane-bit level x 2 key rows x the ROWS / 2 rows a thread holds
        assert ops["SHFL"] == c["ROWS"]
    scores, filt, table = (r["loop_ops"] for r in reports)
    assert scores["FMNMX"] == 2 * 32 // 2  # running maxima: 2 key rows x 16 rows a thread
    assert reports[1]["constexprs"]["DEFER_STORE"] is False
    assert filt["ATOMG"] == filt["STG"] == 16 and table["ATOMG"] == 0 and table["STG"] == 16


# --------------------------------------------------------------------------- GPU


def reference(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, chunk: int = 128
              ) -> torch.Tensor:
    """fp64 [B, T]: max over s <= t of sum_h w[t, h] relu(q[t, h] . k[s]), a chunk of rows at a
    time."""
    B, T, H, _ = q.shape
    out = torch.empty(B, T, dtype=torch.float64, device=q.device)
    kd = k.double()
    keys = torch.arange(T, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        dots = torch.einsum("bthd,bsd->bths", q[:, t0:t1].double(), kd[:, :t1])
        scores = (dots.clamp_min(0) * w[:, t0:t1, :, None].double()).sum(2)
        visible = keys[None, :t1] <= torch.arange(t0, t1, device=q.device)[:, None]
        out[:, t0:t1] = scores.masked_fill(~visible, float("-inf")).amax(-1)
    return out


def int_inputs(B, T, H, seed, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(-3, 4, (B, T, H, D), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randint(-3, 4, (B, T, D), device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (B, T, H), device="cuda", generator=g).to(torch.float32)
    return q, k, w


def run(q, k, w, pingpong=True):
    out = sm90.indexer_row_max_sm90(q, k, w, pingpong=pingpong)
    torch.cuda.synchronize()
    assert out.dtype == torch.float32 and out.shape == q.shape[:2]
    return out


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("H", [64, 32])
@pytest.mark.parametrize("T", [128 + 7, 4096])
def test_integer_inputs_exact(T, H, pingpong):
    q, k, w = int_inputs(2, T, H, seed=T + H)
    out = run(q, k, w, pingpong)
    ref = reference(q, k, w)
    assert torch.equal(out, ref.float()), (out - ref.float()).abs().max()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("stages", [2, 4, 6])
@pytest.mark.parametrize("H", [64, 32])
@pytest.mark.parametrize("T", [128 + 7, 64 * 4 + 1, 4096])
def test_products_ahead_exact(T, H, stages):
    """mma_ahead (each consumer's next key tile's product issued before the last one's
    epilogue, the tiles in pairs): the reference's maxima on integer inputs, batch 2, programs
    with an odd and an even count of key tiles (T = 135: 3 tiles for the last block; 257: 5,
    4 for the one before), ring depths from the least (2)."""
    q, k, w = int_inputs(2, T, H, seed=T + H + stages)
    out = sm90.indexer_row_max_sm90(q, k, w, mma_ahead=True, stages=stages)
    torch.cuda.synchronize()
    ref = reference(q, k, w)
    assert torch.equal(out, ref.float()), (out - ref.float()).abs().max()


def folded_reference(q, k, w):
    """fp64 [B, T]: max over s <= t of (sum_h w[t, h] q[t, h]) . k[s] (relu=False)."""
    folded = (q.double() * w.double()[..., None]).sum(2)
    scores = torch.einsum("btd,bsd->bts", folded, k.double())
    T = q.shape[1]
    visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~visible, float("-inf")).amax(-1)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mma_ahead", [False, True])
@pytest.mark.parametrize("T", [128 + 7, 64 * 4 + 1, 2048])
def test_folded_part_major_exact(T, mma_ahead):
    """part_major: the folded query's parts stored part-major give the reference's row
    maxima (integer inputs, a folded query of two bf16 parts, batch 2; rows past T in a
    block read the next part's tokens, never stored) and the same table as the (token,
    head)-major parts, every 7th key sampled."""
    from megatron_hyscale.ops.kernels import hytopk_sm90

    q, k, w = int_inputs(2, T, 32, seed=T + 5)
    w = w * 101.0
    rows_q, rows_w = hytopk_sm90.folded_parts(q, w)
    parts_q, parts_w = hytopk_sm90.folded_parts(q, w, part_major=True)
    assert (rows_q[..., 1, :] != 0).any() and torch.equal(parts_q, rows_q)
    got = sm90.indexer_row_max_sm90(parts_q, k, parts_w, relu=False, part_major=True,
                                    mma_ahead=mma_ahead)
    old = sm90.indexer_row_max_sm90(rows_q, k, rows_w, relu=False)
    want = folded_reference(q, k, w).float()
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(old, want)
    k7 = k[:, ::7].contiguous()
    table = sm90.indexer_table_sm90(parts_q, k7, parts_w, 7, 3, T, relu=False, part_major=True)
    assert torch.equal(table, sm90.indexer_table_sm90(rows_q, k7, rows_w, 7, 3, T, relu=False))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mma_ahead", [False, True])
@pytest.mark.parametrize("H", [64, 32])
@pytest.mark.parametrize("T", [128 + 7, 64 * 4 + 1, 4096])
def test_head_sum_transpose_bitwise(T, H, mma_ahead):
    """head_sum_transpose: the same fp32 sums in the same order, so on random inputs (where
    another order would round otherwise), bf16 and e4m3, the row maxima, the table and the
    filter's survivors (scan slots: keys and counts; atomic slots: counts and each row's set;
    batch 2; a chunk of rows starting off a program's block and ending before T, so that the
    scan's tiles seen whole hold rows outside it) are bitwise those without it."""
    from megatron_hyscale.ops import fp8_quant

    g = torch.Generator(device="cuda").manual_seed(T + H)
    q = torch.randn(2, T, H, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(2, T, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(2, T, H, device="cuda", generator=g)
    q8, q_scale, k8, k_scale = fp8_quant.quantize_indexer(q, k)
    t_lo, t_hi = T // 3 | 1, T - 37
    for inputs, ks in (((q, k, w), {}), ((q8, k8, w * q_scale), {"k_scale": k_scale})):
        for kwargs in ({}, {"mma_ahead": mma_ahead}):
            want = sm90.indexer_row_max_sm90(*inputs, **ks, **kwargs)
            got = sm90.indexer_row_max_sm90(*inputs, head_sum_transpose=True, **ks, **kwargs)
            assert torch.equal(got, want), (got - want).abs().max()
        k7 = inputs[1][:, ::7].contiguous()
        k7s = {} if not ks else {"k_scale": k_scale[:, ::7].contiguous()}
        table = sm90.indexer_table_sm90(inputs[0], k7, inputs[2], 7, 3, T, **k7s)
        assert torch.equal(sm90.indexer_table_sm90(inputs[0], k7, inputs[2], 7, 3, T,
                                                   head_sum_transpose=True, **k7s), table)
        # each row's best key passes, and those within half its magnitude below it
        tau = (want - 0.5 * want.abs())[:, t_lo:t_hi].contiguous()
        args = (*inputs, tau, t_lo, t_hi, 4096)
        for scan in (True, False):
            tuning = dict(scan_slots=scan, mma_ahead=mma_ahead, **ks)
            keys, counts = sm90.indexer_filter_sm90(*args, head_sum_transpose=True, **tuning)
            keys0, counts0 = sm90.indexer_filter_sm90(*args, **tuning)
            assert torch.equal(counts, counts0) and (counts > 0).all(), scan
            written = torch.arange(4096, device="cuda") < counts[..., None]
            if not scan:  # the atomics' order varies from run to run: each row's set
                unset = torch.iinfo(torch.int64).min
                keys, keys0 = (torch.where(written, t, unset).sort(-1, descending=True)[0]
                               for t in (keys, keys0))
            assert torch.equal(keys[written], keys0[written]), scan


def fp8_inputs(T, H, seed):
    """e4m3 q, k (fp8_quant's scheme) of integer-valued inputs whose scales differ by key,
    token and batch (exact in e4m3 at their scales), the weights with q's scales in them, k's
    scales, and the dequantized q and k."""
    from megatron_hyscale.ops import fp8_quant

    q, k, w = int_inputs(2, T, H, seed=seed)
    k[:, ::5] = k[:, ::5].sign()
    k[1, 1::3] = k[1, 1::3] * 0.5
    q[1, 2::5, 0] = q[1, 2::5, 0] * 0.5
    q8, q_scale, k8, k_scale = fp8_quant.quantize_indexer(q, k)
    assert not torch.equal(k_scale[0], k_scale[1]) and k_scale.unique().numel() > 2
    return (q8, k8, w * q_scale, k_scale, fp8_quant.dequantize(q8, q_scale),
            fp8_quant.dequantize(k8, k_scale), w)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("H", [64, 32])
def test_fp8_integer_inputs_exact(H):
    """e4m3 q and k: each row's max equals the fp64 reference on the dequantized inputs, with
    q's scales in the head weights and k's passed to the kernel."""
    q8, k8, w_eff, k_scale, q, k, w = fp8_inputs(1031, H, seed=H + 5)
    out = sm90.indexer_row_max_sm90(q8, k8, w_eff, k_scale=k_scale)
    torch.cuda.synchronize()
    ref = reference(q, k, w)
    assert torch.equal(out, ref.float()), (out - ref.float()).abs().max()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("H", [64, 32])
@pytest.mark.parametrize("T", [128 + 7, 4096])
def test_random_bf16_within_the_rounding_bound(T, H):
    g = torch.Generator(device="cuda").manual_seed(T * H)
    B, D = 2, 128
    q = torch.randn(B, T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, T, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(B, T, H, device="cuda", generator=g)
    out = run(q, k, w)
    ref = reference(q, k, w)
    k_max = k.double().norm(dim=-1).amax(-1, keepdim=True)  # [B, 1]
    a_t = (w.double().abs() * q.double().norm(dim=-1)).sum(-1) * k_max
    bound = 2 * (D + H + 1) * EPS32 * a_t
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("H", [64, 32])
def test_adversarial_rows(H):
    """All-zero query rows (every visible score 0), tied keys, a row whose dot products are all
    negative (ReLU zeroes them: max 0), a row weighted only negatively, row 0 seeing exactly one
    key, rows on both sides of the two consumers' and the tiles' boundaries; T off every tile."""
    B, T = 2, 128 + 7
    q, k, w = int_inputs(B, T, H, seed=H)
    q[:, 5] = 0  # all-zero rows
    q[1, T - 1] = 0  # ... also the last row of the last (partial) program
    k[:, 40:60] = k[:, 20:21]  # ties: 20 copies of one key
    k[:, :, 0] = 5  # every key's channel 0 large and positive
    q[:, 70] = 0
    q[:, 70, :, 0] = -100  # row 70: each dot product -500, ReLU'd to 0
    w[:, 70] = w[:, 70].abs() + 1
    w[:, 71] = -(w[:, 71].abs() + 1)  # row 71: only negative weights
    out = run(q, k, w)
    ref = reference(q, k, w).float()
    assert torch.equal(out, ref)
    assert (out[:, 5] == 0).all() and (out[:, 70] == 0).all() and (out[1, T - 1] == 0)
    assert (out[:, 71] <= 0).all()
    one_key = (torch.einsum("bhd,bd->bh", q[:, 0].double(), k[:, 0].double()).clamp_min(0)
               * w[:, 0].double()).sum(-1)
    assert torch.equal(out[:, 0], one_key.float())


@pytest.mark.gpu
@needs_hopper
def test_padded_rows_and_batch_one():
    """TMA row strides other than D (q's heads 136 elements apart, k's keys 144) and B = 1."""
    q, k, w = int_inputs(1, 1000, 64, seed=3)
    qp = torch.zeros(1, 1000, 64, 136, dtype=torch.bfloat16, device="cuda")[..., :128]
    kp = torch.zeros(1, 1000, 144, dtype=torch.bfloat16, device="cuda")[..., :128]
    qp.copy_(q)
    kp.copy_(k)
    assert torch.equal(run(qp, kp, w), reference(q, k, w).float())


def table_reference(q, k, w, stride, t_lo, t_hi):
    """fp64 [B, t_hi - t_lo, ceil(T / stride)]: rows [t_lo, t_hi) against every stride-th key
    (-inf where key j x stride > row)."""
    ks = k[:, ::stride].double()
    dots = torch.einsum("bthd,bsd->bths", q[:, t_lo:t_hi].double(), ks)
    scores = (dots.clamp_min(0) * w[:, t_lo:t_hi, :, None].double()).sum(2)
    pos = torch.arange(ks.shape[1], device=q.device) * stride
    seen = pos[None, :] <= torch.arange(t_lo, t_hi, device=q.device)[:, None]
    return scores.masked_fill(~seen, float("-inf"))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("H", [64, 32])
@pytest.mark.parametrize("stride", [1, 7, 64])
def test_table_integer_inputs_exact(H, stride):
    """Batch 2, rows [100, 1031) (off every block boundary), every stride-th key: the table
    equals the fp64 reference bit for bit on integer inputs, -inf where a row does not see
    the key; a row of zero queries scores 0 on every key it sees."""
    B, T, t_lo = 2, 1031, 100
    q, k, w = int_inputs(B, T, H, seed=stride + H)
    q[:, 500] = 0
    got = sm90.indexer_table_sm90(q, k[:, ::stride].contiguous(), w, stride, t_lo, T)
    torch.cuda.synchronize()
    want = table_reference(q, k, w, stride, t_lo, T)
    assert got.shape == want.shape and torch.equal(got.double(), want)
    assert (got[:, 500 - t_lo][:, : 500 // stride + 1] == 0).all()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("H", [64, 32])
def test_fp8_table_exact(H):
    """The TABLE epilogue on e4m3 q and k against every 7th key, the sampled keys' scales
    passed: the fp64 reference on the dequantized inputs bit for bit, batch 2."""
    q8, k8, w_eff, k_scale, q, k, w = fp8_inputs(1031, H, seed=H + 9)
    got = sm90.indexer_table_sm90(q8, k8[:, ::7].contiguous(), w_eff, 7, 100, 1031,
                                  k_scale=k_scale[:, ::7].contiguous())
    torch.cuda.synchronize()
    assert torch.equal(got.double(), table_reference(q, k, w, 7, 100, 1031))


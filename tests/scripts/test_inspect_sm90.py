"""scripts/inspect_sm90.py: compiles a kernel's real launch for sm_90a without a GPU.

Run as a subprocess: other test modules import the kernels under TRITON_INTERPRET=1, and the
tool needs them compiled."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_hyscale.testing.inspect_sm90 import run_inspect_sm90 as _run


def test_hytopk_launch_compiles_for_sm90(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-dsv32-scoreonly", "hytopk-qsa", "hytopk-tiny-head-dim",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # QSA's selection at 8K tokens samples thresholds (top-512: rows past 4K keys), so its
    # second launch redoes failed guesses; the score-only and 256-token launches are single.
    scores, qsa, qsa_redo, tiny = json.loads(out.read_text())
    assert qsa["constexprs"]["NSAMP"] > 0 and qsa_redo["constexprs"]["N_BLOCKS_ON_DEVICE"]
    assert tiny["constexprs"]["BD"] == 16  # head dim 8, zero-padded to tl.dot's minimum
    # The recorded launch is the real one: the wrapper's choices reach the compiler.
    assert scores["constexprs"]["KEYS_ON_M"] is True and scores["constexprs"]["MODE"] == 1
    assert qsa["constexprs"]["KEYS_ON_M"] is True and qsa["constexprs"]["R"] == 16  # 4 heads
    for rep in (scores, qsa):
        assert 0 < rep["registers"] <= 255 and rep["shared_bytes"] > 0
        assert rep["loop_ops"]["HGMMA"] > 0 and rep["loop_instructions"] > 0
    assert "hot loop" in proc.stdout


def test_bad_requests_are_named() -> None:
    proc = _run("--preset", "no-such-kernel")
    assert proc.returncode == 2 and "--preset" in proc.stderr
    proc = _run("--preset", "hytopk-qsa", interpret=True)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr


def test_record_holds_the_reports_and_the_run(tmp_path: Path, monkeypatch) -> None:
    """--record CONFIG saves the reports as a benchmark record (strict JSON: the rates not
    measured are null) with the target and the command."""
    monkeypatch.setenv("HYSCALE_RESULTS", str(tmp_path))
    monkeypatch.setenv("HYSCALE_COMMIT", "abc1234")
    proc = _run("--preset", "row-rank", "--record", "probe")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("*-inspect_sm90-probe.json")
    data = json.loads(path.read_text(), parse_constant=lambda c: 1 / 0)
    meta, (rec,) = data["meta"], data["records"]
    assert meta["target"] == "sm_90a" and meta["commit"] == "abc1234"
    assert meta["matmul_tflops"] is None and "--record probe" in meta["command"]
    assert rec["preset"] == "row-rank" and rec["instructions"] > 0
    assert rec["mma_loop_sizes"] == []  # no MMA in the row rank


def test_default_kernels_keep_their_compiled_shape(tmp_path: Path) -> None:
    """Guards on the defaults chosen from compiled code and GPU timings (Triton pinned at 3.6):
    HyTopK's select kernel (keys on M) runs wgmma in its hot loop without touching local
    memory; the dK/dV kernel (channels on M, the carry) runs wgmma at its default 32 x 2 tiling
    and spills almost nothing (AttentionKernelOptions.dkv_carry, dkv_tilings).
    A change that silently drops them to mma.sync or further into local memory fails here
    before it costs GPU time."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-dsv32", "sparse-attention-glm51", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = {r["name"].split("] ")[1]: r for r in json.loads(out.read_text())}
    select = reports["_hytopk_kernel"]
    # no local memory in the tile loop (a few bytes spilled around the compaction are fine)
    assert select["spill_stores"] <= 64 and select["loop_ops"]["HGMMA"] > 0
    assert select["loop_ops"].get("LDL", 0) == 0 and select["loop_ops"].get("STL", 0) == 0
    assert select["loop_ops"]["SHFL"] < 32  # the head sum stays in registers (heads on N)
    dkv = reports["_bwd_dkv_kernel"]
    assert dkv["constexprs"]["CARRY"] is True
    assert (dkv["constexprs"]["BLOCK_N"], dkv["constexprs"]["num_stages"]) == (32, 2)
    assert dkv["spill_stores"] <= 16 and dkv["loop_ops"]["HMMA"] == 0
    assert dkv["loop_ops"]["HGMMA"] > 0 and dkv["shared_bytes"] <= 232448
    assert reports["_bwd_dq_kernel"]["constexprs"]["TAIL_FIRST"] is True


def test_bwd_variants_compile_as_documented(tmp_path: Path) -> None:
    """The backward's defaults against the previous ones do what they are for (the counts in
    AttentionKernelOptions' comments). dkv_carry: at 64 heads and 8 warps the uncarried dK/dV
    kernel computes S and dP in both warpgroups (a chained dot is laid out with every warp on
    M), 68 of its 172 HGMMA a tile being that copy; carried, it issues 104 at the same 64 x 1
    tiling and still fits the H200's shared memory (232448 bytes a block). dq_tail_first: the
    dQ kernel spills less and touches local memory less in its loop."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-attention-glm51", "sparse-attention-glm51-previous",
                "sparse-attention-glm51-dkv-carry-64x1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = {(r["preset"].removeprefix("sparse-attention-glm51"), r["name"].split("] ")[1]): r
               for r in json.loads(out.read_text())}
    previous = reports["-previous", "_bwd_dkv_kernel"]
    carry = reports["-dkv-carry-64x1", "_bwd_dkv_kernel"]
    assert previous["constexprs"]["CARRY"] is False and carry["constexprs"]["CARRY"] is True
    assert previous["constexprs"]["BLOCK_N"] == 64 and carry["constexprs"]["BLOCK_N"] == 64
    assert carry["shared_bytes"] <= 232448
    assert carry["loop_ops"]["HGMMA"] < previous["loop_ops"]["HGMMA"] - 48
    assert carry["loop_instructions"] < previous["loop_instructions"]
    assert carry["loop_ops"]["BAR"] <= previous["loop_ops"]["BAR"]
    dq, tail_first = reports["-previous", "_bwd_dq_kernel"], reports["", "_bwd_dq_kernel"]
    assert dq["constexprs"]["TAIL_FIRST"] is False and tail_first["constexprs"]["TAIL_FIRST"]
    assert tail_first["spill_stores"] < dq["spill_stores"]
    local = ("LDL", "STL")
    assert (sum(tail_first["loop_ops"][o] for o in local)
            < sum(dq["loop_ops"][o] for o in local))
    assert tail_first["loop_ops"]["HGMMA"] == dq["loop_ops"]["HGMMA"]


def test_dq_target_keeps_the_dq_kernels_products(tmp_path: Path) -> None:
    """The dQ kernel with the indexer loss's target (TARGET, sparse_attention_bwd_with_target)
    issues the same wgmma as without it and sums P after dS, so that P is not held across dP's
    product: a few more local-memory accesses a tile than the default, not twice as many."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-attention-glm51", "sparse-attention-glm51-dq-target",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = {(r["preset"], r["name"].split("] ")[1]): r for r in json.loads(out.read_text())}
    default = reports["sparse-attention-glm51", "_bwd_dq_kernel"]
    target = reports["sparse-attention-glm51-dq-target", "_bwd_dq_kernel"]
    assert target["constexprs"]["TARGET"] is True
    assert not default["constexprs"].get("TARGET", False)  # the default launch passes none
    assert target["loop_ops"]["HGMMA"] == default["loop_ops"]["HGMMA"]
    assert target["shared_bytes"] <= 232448
    local = ("LDL", "STL")
    assert (sum(target["loop_ops"].get(o, 0) for o in local)
            <= sum(default["loop_ops"].get(o, 0) for o in local) + 12)
    assert target["spill_stores"] <= 192


def test_hopper_sparse_mla_forward_keeps_its_wgmma_pipeline(tmp_path: Path) -> None:
    """The Gluon forward (ops/kernels/sparse_mla_fwd_sm90.py) compiles for sm_90a without spills
    and without ptxas serializing its wgmma: any accumulator read while a product is in flight
    makes ptxas wait after every HGMMA (note C7514), which would turn Q K^T's 36 k-steps into
    36 round trips. Per key tile the loop issues 36 + 4 HGMMA (Q K^T over 512 + 64 channels at
    16 a step, P V over 64 keys) and waits twice (after Q K^T, after P V)."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-mla-fwd-sm90-glm51", "sparse-mla-fwd-sm90-v32",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    glm, v32 = json.loads(out.read_text())
    assert glm["constexprs"]["NG"] == 0 and v32["constexprs"]["NG"] == 2  # V3.2: 2 blocks
    for rep in (glm, v32):
        assert rep["perf_warnings"] == []
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0
        assert rep["loop_ops"]["HGMMA"] == 40
        # WARPGROUP.ARRIVE before each of the three products, WARPGROUP.DEPBAR after two.
        assert rep["loop_ops"]["WARPGROUP"] <= 6
        assert rep["loop_ops"]["LDGSTS"] > 0  # the next tile's gather is in the loop
        assert rep["shared_bytes"] <= 232448  # the H200's shared memory a block


def test_warp_specialized_sparse_mla_forward_compiles_its_partitions(tmp_path: Path) -> None:
    """The warp-specialized Gluon forward (ops/kernels/sparse_mla_fwd_ws_sm90.py) compiles for
    sm_90a with no local memory and no serialized wgmma (C7514), for absorbed MLA and for
    DeepSeek-V4's K = V with a sink (CSA). A consumer's loop (one key tile's S over 512 + 64
    channels: 36 HGMMA, 32 without the tail; P V for its half of the channels over its own
    tile with P in registers and over the other's with P in shared memory: 4 + 4) issues no
    gather (the producer's cp.async, completion counted on each stage half's mbarrier) and
    writes its P with stmatrix; the partitions' register budgets are 232 (consumers) and 40
    (producer)."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-mla-fwd-ws-sm90-glm51", "sparse-mla-fwd-ws-sm90-v32",
                "sparse-mla-fwd-ws-sm90-csa", "sparse-mla-fwd-ws-sm90-glm51-tp2", "--json",
                str(out), "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    glm, v32, csa, tp2 = json.loads(out.read_text())
    assert glm["constexprs"]["NG"] == 0 and v32["constexprs"]["NG"] == 2  # V3.2: 2 blocks
    assert csa["constexprs"]["D_TAIL"] == 0 and csa["constexprs"]["HAS_SINK"] is True
    assert tp2["constexprs"]["PAD_HEADS"] is True  # 32 heads: one block padded
    for rep in (glm, v32, csa, tp2):
        assert rep["perf_warnings"] == []
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["stack_bytes"] == 0
        assert rep["shared_bytes"] <= 232448  # the H200's shared memory a block
        ops = rep["loop_ops"]
        # S: 32 k-steps over the 512 main channels (+ 4 over the tail); P V: 4 + 4
        assert ops["HGMMA"] == (44 if rep["constexprs"]["D_TAIL"] else 40)
        assert ops["LDGSTS"] == 0 and ops["LDL"] == 0 and ops["STL"] == 0
        sass = next(tmp_path.glob(f"{rep['preset']}_0_*.sass")).read_text()
        assert "STSM" in sass  # P to shared memory by stmatrix
        # the query's and the four stage halves' cp.async arrivals (one a producer thread)
        assert sass.count("ARRIVES.LDGSTSBAR") == 5
        assert "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8" in sass  # 232 for consumer 1
        assert "USETMAXREG.DEALLOC.CTAPOOL 0x28" in sass  # 40 for the producer


def test_warp_specialized_sparse_mla_backward_compiles_its_partitions(tmp_path: Path) -> None:
    """The warp-specialized Gluon backward (ops/kernels/sparse_mla_bwd_sm90.py) compiles for
    sm_90a with no serialized wgmma (C7514) and shared memory within the H200's, for absorbed
    MLA (one and two head blocks) and DeepSeek-V4's K = V with a sink. Consumer 0's key loop
    (the hot loop found) has no local memory: S over 512 + 64 channels (36 HGMMA, 32 without
    the tail) and dP (32) for its 32 keys, dQ over the tile's 64 keys (4), and four 64-channel
    dK products of two wgmma each (32; with the tail's product, 4 more), added into the key
    rows with two-float atomics (REDG.E.ADD.F32x2, 16 a chunk a thread). No consumer issues a
    gather: the producer's two cp.async arrivals (q + dO, and the key tile) are the only ones.
    Register budgets 240 (consumers) and 24 (producer). The same with 32 heads (GLM-5.1 at
    tensor parallelism 2: one block padded)."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-mla-bwd-sm90-glm51", "sparse-mla-bwd-sm90-v32",
                "sparse-mla-bwd-sm90-csa", "sparse-mla-bwd-sm90-glm51-tp2", "--json", str(out),
                "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    glm, v32, csa, tp2 = json.loads(out.read_text())
    assert glm["constexprs"]["NG"] == 0 and v32["constexprs"]["NG"] == 2
    assert csa["constexprs"]["D_TAIL"] == 0 and csa["constexprs"]["HAS_SINK"] is True
    assert tp2["constexprs"]["PAD_HEADS"] is True and glm["constexprs"]["PAD_HEADS"] is False
    for rep in (glm, v32, csa, tp2):
        tail = rep["constexprs"]["D_TAIL"] > 0
        assert rep["perf_warnings"] == []
        assert rep["shared_bytes"] <= 232448
        ops = rep["loop_ops"]
        assert ops["HGMMA"] == (108 if tail else 100)
        assert ops["REDG"] == (80 if tail else 64)
        assert ops["LDL"] == 0 and ops["STL"] == 0 and ops["LDGSTS"] == 0
        sass = next(tmp_path.glob(f"{rep['preset']}_0_*.sass")).read_text()
        assert "REDG.E.ADD.F32x2" in sass and "REDG.E.ADD.F32 " not in sass
        assert sass.count("ARRIVES.LDGSTSBAR") == 2
        assert "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0" in sass  # 240 for consumer 1
        assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in sass  # 24 for the producer


def test_sparse_mla_backward_16_byte_dk_atomics(tmp_path: Path) -> None:
    """AttentionKernelOptions.bwd_dk_vec4: every dK atomic is a 16-byte REDG.E.ADD.F32x4 (none
    of 8 or 4 bytes), half as many in consumer 0's key loop (40 with the tail, 32 without) for
    two lane shuffles each (the accumulator's pairs swapped between neighbouring lanes, no
    shared memory), the same products, and still no local memory in that loop."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-mla-bwd-sm90-glm51-vec4", "sparse-mla-bwd-sm90-csa-vec4",
                "--json", str(out), "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rep in json.loads(out.read_text()):
        assert rep["constexprs"]["DK_VEC4"] is True and rep["perf_warnings"] == []
        tail = rep["constexprs"]["D_TAIL"] > 0
        ops = rep["loop_ops"]
        assert ops["HGMMA"] == (108 if tail else 100)
        assert ops["REDG"] == (40 if tail else 32) and ops["SHFL"] == 2 * ops["REDG"]
        assert ops["LDL"] == 0 and ops["STL"] == 0
        sass = next(tmp_path.glob(f"{rep['preset']}_0_*.sass")).read_text()
        assert "REDG.E.ADD.F32x4" in sass
        assert "REDG.E.ADD.F32x2" not in sass and "REDG.E.ADD.F32 " not in sass


def test_sparse_mla_backward_lockstep_compiles_like_the_default(tmp_path: Path) -> None:
    """AttentionKernelOptions.bwd_lockstep: the item loop around the key loops leaves consumer
    0's key loop as the 16-byte form's (the same products and atomics, no local memory) for
    GLM-5.1 (one head block: NHB not specialized to 1, which spilled) and V3.2 (two); the
    wave counter read with volatile loads (no cache between polls) and added once a tile (one
    warp-aggregated REDG)."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-mla-bwd-sm90-glm51-lockstep",
                "sparse-mla-bwd-sm90-v32-lockstep", "--json", str(out), "--sass-out",
                str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rep in json.loads(out.read_text()):
        assert rep["constexprs"]["LOCKSTEP"] is True and rep["perf_warnings"] == []
        ops = rep["loop_ops"]
        assert ops["HGMMA"] == 108 and ops["REDG"] == 40
        assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0
        sass = next(tmp_path.glob(f"{rep['preset']}_0_*.sass")).read_text()
        assert "LDG.E.STRONG.SYS" in sass
        assert sass.count("REDG.E.ADD.STRONG.GPU") == 1


def test_sparse_mla_forward_lockstep_compiles_without_spills(tmp_path: Path) -> None:
    """AttentionKernelOptions.fwd_lockstep: the warp-specialized forward with its item loop
    keeps the default's hot loop (the same products, no local memory anywhere, one and two
    head blocks), reads the wave counter with volatile loads and adds to it once an iteration
    (one warp-aggregated REDG)."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-mla-fwd-ws-sm90-glm51", "sparse-mla-fwd-ws-sm90-glm51-lockstep",
                "sparse-mla-fwd-ws-sm90-v32-lockstep", "--json", str(out), "--sass-out",
                str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    default, *lockstep = json.loads(out.read_text())
    for rep in lockstep:
        assert rep["constexprs"]["LOCKSTEP"] is True and rep["perf_warnings"] == []
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0
        assert rep["loop_ops"]["HGMMA"] == default["loop_ops"]["HGMMA"]
        sass = next(tmp_path.glob(f"{rep['preset']}_0_*.sass")).read_text()
        assert "LDG.E.STRONG.SYS" in sass
        assert sass.count("REDG.E.ADD.STRONG.GPU") == 1


def test_indexer_loss_backward_lockstep_keeps_the_pipelined_tile_loop(tmp_path: Path) -> None:
    """IndexerLossKernelOptions.bwd_lockstep: the count and the bounded wait as one inline-PTX
    block leave GLM-5.1's tile loop pipelined as the default's (its cp.async copies, products
    and 16-byte dk atomics; no local memory), the counter added once a tile by one thread and
    read by volatile loads in a loop ptxas did not unroll (one load in the tile loop)."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "indexer-loss-glm51-kl-in-bwd", "indexer-loss-glm51-lockstep",
                "--json", str(out), "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    default, lockstep = (r for r in json.loads(out.read_text())
                         if r["name"].endswith("_bwd_kernel"))
    assert lockstep["constexprs"]["LOCKSTEP"] is True and not default["constexprs"].get(
        "LOCKSTEP")
    ops, base = lockstep["loop_ops"], default["loop_ops"]
    for op in ("HGMMA", "HMMA", "LDGSTS"):
        assert ops[op] == base[op] > 0, op
    assert ops["REDG"] == base["REDG"] + 1 and ops["LDG"] == base["LDG"] + 1
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0
    sass = next(tmp_path.glob("indexer-loss-glm51-lockstep_1_*.sass")).read_text()
    assert sass.count("LDG.E.STRONG.SYS") == 1 and sass.count("REDG.E.ADD.STRONG.GPU") == 1


def test_triton_dkv_lockstep_keeps_the_pipelined_tile_loop(tmp_path: Path) -> None:
    """AttentionKernelOptions.dkv_lockstep on QSA's shape (2 KV heads of 12 query heads, 256
    channels): the dK/dV kernel's tile loop keeps the default's cp.async copies, products and
    atomics without local memory, plus the count's reduction and one volatile read."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-attention-qsa", "sparse-attention-qsa-dkv-lockstep",
                "--json", str(out), "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    default, lockstep = (r for r in json.loads(out.read_text())
                         if r["name"].endswith("_bwd_dkv_kernel"))
    assert lockstep["constexprs"]["LOCKSTEP"] is True and "LOCKSTEP" not in default["constexprs"]
    ops, base = lockstep["loop_ops"], default["loop_ops"]
    for op in ("HGMMA", "HMMA", "LDGSTS"):
        assert ops[op] == base[op] > 0, op
    assert ops["REDG"] == base["REDG"] + 1 and ops["LDG"] == base["LDG"] + 1
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0
    # dkv_carry (the default) gathers the first tile before its loop: two copies of the step.
    sass = next(tmp_path.glob("sparse-attention-qsa-dkv-lockstep_2_*.sass")).read_text()
    assert sass.count("LDG.E.STRONG.SYS") == 2 and sass.count("REDG.E.ADD.STRONG.GPU") == 2


def test_triton_forward_and_dq_lockstep_keep_their_pipelined_loops(tmp_path: Path) -> None:
    """fwd_lockstep / dq_lockstep on QSA's shape: the forward's and the dQ kernel's tile loops
    keep the default's copies and products without local memory, plus the count's reduction
    and one volatile read each."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-attention-qsa", "sparse-attention-qsa-lockstep",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = json.loads(out.read_text())
    for kernel in ("_fwd_kernel", "_bwd_dq_kernel"):
        default, lockstep = (r for r in reports if r["name"].endswith(kernel))
        assert lockstep["constexprs"]["LOCKSTEP"] is True, kernel
        ops, base = lockstep["loop_ops"], default["loop_ops"]
        for op in ("HMMA", "LDGSTS"):
            assert ops[op] == base[op] > 0, (kernel, op)
        assert ops.get("REDG", 0) == base.get("REDG", 0) + 1, kernel
        assert ops["LDG"] == base["LDG"] + 1, kernel
        assert ops.get("LDL", 0) == 0 and lockstep["spill_loads"] == 0, kernel


def test_key_tma_takes_the_key_copies_out_of_the_tile_loop(tmp_path: Path) -> None:
    """HyTopKOptions.key_tma: the tile loop has no per-thread copies (LDGSTS) left, one TMA
    load (UTMALDG) a tile and its mbarrier, the same products, and fewer instructions than the
    default loop (the copies' address arithmetic goes)."""
    out = tmp_path / "r.json"
    names = ("hytopk-dsv32", "hytopk-dsv32-key-tma", "hytopk-norelu", "hytopk-norelu-key-tma")
    proc = _run("--preset", *names, "--json", str(out), "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = {r["preset"]: r for r in json.loads(out.read_text())}
    for base in ("hytopk-dsv32", "hytopk-norelu"):
        default, tma = reports[base], reports[base + "-key-tma"]
        assert tma["constexprs"]["KEY_TMA"] is True and default["constexprs"]["KEY_TMA"] is False
        assert default["loop_ops"]["LDGSTS"] > 0 and tma["loop_ops"]["LDGSTS"] == 0
        assert tma["loop_ops"]["HGMMA"] == default["loop_ops"]["HGMMA"]
        assert tma["loop_instructions"] < default["loop_instructions"]
        assert tma["spill_stores"] <= default["spill_stores"]
        sass = next(tmp_path.glob(f"{base}-key-tma_0_*.sass")).read_text()
        assert "UTMALDG" in sass


def test_folded_hytopk_runs_bf16_wgmma(tmp_path: Path) -> None:
    """relu=False with bf16 keys: the folded query's three bf16 parts run as padded heads on
    the keys-on-M path, so the tile loop multiplies on bf16 wgmma without local memory (the
    fp32 tf32x3 form ran 192 mma.sync and 170 local-memory accesses a tile)."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-norelu", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rep,) = json.loads(out.read_text())
    assert rep["constexprs"]["HP"] == 4 and rep["constexprs"]["KEYS_ON_M"] is True
    assert rep["constexprs"]["IEEE"] is False
    assert rep["loop_ops"]["HGMMA"] > 0 and rep["loop_ops"].get("HMMA", 0) == 0
    assert rep["loop_ops"].get("LDL", 0) == 0 and rep["loop_ops"].get("STL", 0) == 0


def test_fp8_hytopk_runs_fp8_wgmma(tmp_path: Path) -> None:
    """precision="fp8": the select kernel's tile loop multiplies e4m3 operands on Hopper's fp8
    wgmma (QGMMA, 32 channels a step: 4 for a 128-channel head), not bf16 or CUDA-core FMAs,
    and k's per-key scale adds no local-memory traffic to it."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-dsv32-fp8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rep,) = json.loads(out.read_text())
    assert rep["constexprs"]["K_SCALED"] is True and rep["constexprs"]["BD"] == 128
    assert rep["loop_ops"]["QGMMA"] == 4 and rep["loop_ops"]["HGMMA"] == 0
    assert rep["loop_ops"].get("LDL", 0) == 0 and rep["loop_ops"].get("STL", 0) == 0


def test_select_variants_compile_lean_tile_loops(tmp_path: Path) -> None:
    """HyTopKOptions' select variants all together (issue #21) on the folded relu=False query:
    the key-tile loop (the last loop with wgmma: the sampling pass comes first) keeps wgmma and
    no local memory, and is shorter than the default's (pair-major columns: each score in one
    lane; one compare a score); the in-kernel 2048-key sort compiles without spilling more than
    a few bytes; the launch that redoes failed guesses is recorded too."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-norelu-select", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    select, redo = json.loads(out.read_text())
    assert select["constexprs"]["HEAD_MAJOR"] is True and select["constexprs"]["SORT_OUT"]
    assert select["constexprs"]["NSAMP"] == 1024 and redo["constexprs"]["NSAMP"] == 0
    assert redo["constexprs"]["N_BLOCKS_ON_DEVICE"] is True
    for rep in (select, redo):
        assert rep["loop_ops"]["HGMMA"] > 0
        assert rep["loop_ops"].get("LDL", 0) == 0 and rep["loop_ops"].get("STL", 0) == 0
        assert rep["loop_instructions"] < DEFAULT_NORELU_LOOP * 3 // 4  # 587 on 2026-12-03
        assert rep["spill_stores"] <= 256
        assert rep["instructions"] > DEFAULT_NORELU_KERNEL + 4000  # the unrolled sort


def test_append_ptx_keeps_the_append_out_of_shared_memory(tmp_path: Path) -> None:
    """HyTopKOptions.append_ptx (default): with pair-major columns (the folded query) each
    score's append is one predicated store and one atomic in the scores' own registers, with
    no shared-memory round trip a tile (tl.store / tl.atomic_add: 12 STS.128, 13 LDS and 10
    barriers a tile, 2026-12-04); row-major columns (V3.2's 64 heads, each score in four lanes)
    keep the tl forms."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-norelu", "hytopk-dsv32", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    folded, v32 = json.loads(out.read_text())
    assert folded["constexprs"]["APPEND_PTX"] is True and folded["constexprs"]["HEAD_MAJOR"]
    ops = folded["loop_ops"]
    scores_a_thread = 64 * 16 // 128  # 64-key tiles x 16 rows over 128 threads
    assert ops["STG"] == ops["ATOMG"] == scores_a_thread
    assert ops.get("STS", 0) == 0 and ops["BAR"] <= 2
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0
    assert v32["constexprs"]["APPEND_PTX"] is False and v32["constexprs"]["HEAD_MAJOR"] is False


def test_maxnreg_caps_the_compiled_registers(tmp_path: Path) -> None:
    """HyTopKOptions.maxnreg reaches ptxas: the select kernel (255 registers uncapped) compiles
    to at most 168 with maxnreg 168."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-norelu-r168", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rep,) = json.loads(out.read_text())
    assert rep["registers"] <= 168


# The default select kernel for the folded relu=False query (Triton 3.6, 2026-12-03): SASS
# instructions in its tile loop and in all.
DEFAULT_NORELU_LOOP = 887
DEFAULT_NORELU_KERNEL = 7080


def test_warp_specialized_indexer_loss_backward_compiles_its_partitions(tmp_path: Path) -> None:
    """The warp-specialized Gluon indexer-loss backward (ops/kernels/indexer_loss_bwd_sm90.py,
    IndexerLossKernelOptions.bwd_sm90) compiles for sm_90a with no serialized wgmma (C7514)
    and shared memory within the H200's, for GLM-5.1's 32 index heads and V3.2's 64, launched
    with the row KL (with_kl: the default kl_in_bwd's call). A consumer's key loop (the hot
    loop found), its KL terms included, has no local memory and no gather: S^T over 128
    channels (8 HGMMA), dQ^T's 128 channels over 64 keys (8), two 64-channel dK chunks over the
    heads (2 x H / 16), added into the key rows with 16 sixteen-byte atomics a thread
    (REDG.E.ADD.F32x4 only). The producer's cp.async arrivals (q, the key tile: one each a
    consumer) are the only ones; register budgets 232 (consumers) and 40 (producer)."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "indexer-loss-bwd-sm90-glm51", "indexer-loss-bwd-sm90-v32",
                "--json", str(out), "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    glm, v32 = json.loads(out.read_text())
    assert glm["constexprs"]["H"] == 32 and v32["constexprs"]["H"] == 64
    assert glm["constexprs"]["KL"] is True and v32["constexprs"]["KL"] is True
    for rep in (glm, v32):
        heads = rep["constexprs"]["H"]
        assert rep["perf_warnings"] == []
        assert rep["shared_bytes"] <= 232448
        ops = rep["loop_ops"]
        assert ops["HGMMA"] == 8 + 8 + 2 * heads // 16
        assert ops["REDG"] == 16
        assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 and ops.get("LDGSTS", 0) == 0
        sass = next(tmp_path.glob(f"{rep['preset']}_0_*.sass")).read_text()
        assert "REDG.E.ADD.F32x4" in sass
        assert "REDG.E.ADD.F32x2" not in sass and "REDG.E.ADD.F32 " not in sass
        assert sass.count("ARRIVES.LDGSTSBAR") == 4
        assert "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8" in sass  # 232 for consumer 1
        assert "USETMAXREG.DEALLOC.CTAPOOL 0x28" in sass  # 40 for the producer


def test_indexer_loss_backward_in_key_passes_compiles_like_the_default(tmp_path: Path) -> None:
    """IndexerLossKernelOptions.bwd_key_passes: the row split (`key_split`) and the backward's
    RANGED launch (every pass the same compiled kernel: which rows store, add into the fp32
    dq / dw or write the outputs is decided per row at run time) compile for sm_90a with the
    default's hot loop: the same products and 16 sixteen-byte dK atomics, no local memory in
    it, no serialized wgmma."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "indexer-loss-bwd-sm90-glm51-passes", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    split, ranged = json.loads(out.read_text())
    assert split["name"].endswith("_key_split_kernel") and split["constexprs"]["PASSES"] == 4
    assert split["spill_stores"] == 0 and split["spill_loads"] == 0
    c = ranged["constexprs"]
    assert c["RANGED"] is True and c["KL"] is True
    assert ranged["perf_warnings"] == [] and ranged["shared_bytes"] <= 232448
    ops = ranged["loop_ops"]
    assert ops["HGMMA"] == 8 + 8 + 2 * 32 // 16 and ops["REDG"] == 16
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0 and ops.get("LDGSTS", 0) == 0


def test_gluon_kernels_with_hcas_dense_prefix_compile_without_local_memory(tmp_path: Path
                                                                           ) -> None:
    """AttentionKernelOptions.prefix_sm90 (DeepSeek-V4 HCA: a dense prefix before the listed
    window, each row its own tile count): the warp-specialized forward and the Gluon backward
    compile with HAS_PREFIX, unpaced (LOCKSTEP off although the backward's lockstep is asked),
    the hot loops' products and atomics those of the K = V form without a prefix (forward S
    32 + P V 8 HGMMA; backward 100 HGMMA and 32 16-byte dK atomics) and no local memory in
    them; the forward none at all."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "sparse-mla-fwd-ws-sm90-hca", "sparse-mla-bwd-sm90-hca", "--json",
                str(out), "--sass-out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    fwd, bwd = json.loads(out.read_text())
    for rep in (fwd, bwd):
        c = rep["constexprs"]
        assert c["HAS_PREFIX"] is True and c["LOCKSTEP"] is False and c["D_TAIL"] == 0
        assert rep["perf_warnings"] == [] and rep["shared_bytes"] <= 232448
        assert rep["loop_ops"]["LDL"] == 0 and rep["loop_ops"]["STL"] == 0
    assert fwd["spill_stores"] == 0 and fwd["spill_loads"] == 0
    assert fwd["loop_ops"]["HGMMA"] == 40
    assert bwd["loop_ops"]["HGMMA"] == 100 and bwd["loop_ops"]["REDG"] == 32
    sass = next(tmp_path.glob("sparse-mla-bwd-sm90-hca_0_*.sass")).read_text()
    assert "REDG.E.ADD.F32x4" in sass


def test_select_over_key_ordered_buffers_has_no_row_sort(tmp_path: Path) -> None:
    """The survivors' select for the scan slots' key-ordered buffers (order "key" without the
    row sort, `select_survivors(keys_in_order=True)`) compiles without the sort: ORDERED off,
    under half the sorting select's instructions and shared memory, no spill."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-select-survivors", "hytopk-select-survivors-in-order",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    sorting, in_order = json.loads(out.read_text())
    assert sorting["constexprs"]["ORDERED"] is True and sorting["constexprs"]["KEY_ORDER"]
    assert in_order["constexprs"]["ORDERED"] is False and in_order["constexprs"]["SELECT"]
    assert 2 * in_order["instructions"] < sorting["instructions"]
    assert in_order["shared_bytes"] < sorting["shared_bytes"]
    assert in_order["spill_stores"] == 0 and in_order["spill_loads"] == 0


def test_direct_select_holds_a_fraction_of_the_compacting_selects_registers(tmp_path: Path
                                                                            ) -> None:
    """The survivors' select written straight to the rows (scores_sm90_direct_select) holds
    one half of the keys at a time and decodes them in chunks: under 128 registers a thread
    (four programs an SM) where the compacting select over the same buffers holds over 200
    (two), fewer instructions, no spill."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "hytopk-select-survivors-in-order", "hytopk-select-rows-direct",
                "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    compacting, direct = json.loads(out.read_text())
    assert direct["constexprs"]["CP"] == 4096 and direct["constexprs"]["CHUNK"] == 1024
    assert direct["registers"] < 128 < 200 < compacting["registers"]
    assert direct["instructions"] < compacting["instructions"]
    assert direct["spill_stores"] == 0 and direct["spill_loads"] == 0


def test_row_rank_compiles_for_sm90(tmp_path: Path) -> None:
    """The sample's radix pick compiles for sm_90a (the interpreter does not enforce Triton's
    rule that a kernel reads only constexpr globals), at the sample's 2048 columns and the
    widest row it takes, without a spill."""
    out = tmp_path / "r.json"
    proc = _run("--preset", "row-rank", "row-rank-widest", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rep, block in zip(json.loads(out.read_text()), (2048, 1 << 14), strict=True):
        assert rep["constexprs"]["BLOCK"] == block and rep["constexprs"]["NUM_BITS"] == 32
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0

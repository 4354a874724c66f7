#!/usr/bin/env bash
# One lent-GPU session in a few full calls (each under the device tool's 10-minute limit), run
# from the repository root on the H200 with `carry: [".whl"]`:
#   bash scripts/gpu_session.sh verify [ops|hytopk|layers]  # GPU op tests (HyTopK, sparse
#                                         # attention, indexer loss) + the layer tests on CUDA
#                                         # (~4 min warm; on a fresh machine ~16 min: run
#                                         # `verify ops`, `verify hytopk`, `verify layers` as
#                                         # three calls)
#   bash scripts/gpu_session.sh tests PATH...  # the named test files or nodes on CUDA in one
#                                         # pytest (GPU-marked ones included), each failure's
#                                         # traceback to failures.log as it happens; the limit
#                                         # TESTS_TIMEOUT (400 s)
#   bash scripts/gpu_session.sh kernels   # HyTopK variants, launch and tile-group sweeps at
#                                         # 128K, pruning on structured inputs, the captured
#                                         # indexer                                    (~9 min)
#   bash scripts/gpu_session.sh attention # the backward tiling sweep, L2-resident gathers
#                                         # (--indices window), V3.2's head-block launch order,
#                                         # the indexer-loss benchmark and its target-pass
#                                         # tilings                                    (~9 min)
#   bash scripts/gpu_session.sh fwd-split # issue 4's forward gap: GLM-5.1 at 128K with and
#                                         # without the online softmax (measurement only),
#                                         # random and L2-resident indices            (~3 min)
#   bash scripts/gpu_session.sh attention-table  # bench_attention.py: every shape at 16K,
#                                         # 64K and 128K (stock at 16K), then the Triton forward
#                                         # alone at the DSA shapes                  (~5 min)
#   bash scripts/gpu_session.sh layer [T...]  # bench_layer.py, DSA, GLM-5.1 geometry   (~3 min)
#   bash scripts/gpu_session.sh layer-packed [T...]  # issue #22 item 5: bench_layer.py --seq
#                                         # 131072 --packed 8 64 --skip-stock: HyScale's DSA
#                                         # layer on one 128K THD sequence of 8 / 64 equal
#                                         # documents against the unpacked 128K sequence (goal:
#                                         # at most 1.10x per token), fallback warnings counted,
#                                         # $REPEATS timed steps (3)                     (~2 min)
#                                         # PACKED_SPLIT=both adds the seeded uneven lengths
#                                         # (+1-3 min: HyTopK compiles once per document shorter
#                                         # than top-k, 43 of the uneven 64); PACKED_DOCS="8 64"
#   bash scripts/gpu_session.sh accuracy  # accuracy.py: bf16 HyScale and stock against
#                                         # float64 on the same weights, every tensor: DSA at
#                                         # 4K (GLM-5.1) and 16K (8 + 8 heads), dense and
#                                         # sparse loss; CSA and QSA at 16K      (~4-6 min)
#   bash scripts/gpu_session.sh models [csa|hca|qsa...] [T...] # bench_layer.py for
#                                         # DeepSeek-V4's CSA and HCA layers and the QSA layer
#                                         # against their baseline modes, 32K-256K (QSA
#                                         # 128K-512K)          (all three ~13 min at most)
#   bash scripts/gpu_session.sh memory [MODEL:T[:baseline] ...]  # where a layer step's peak
#                                         # memory goes (profile_layer_memory.py), default
#                                         # csa:32768 hca:32768 qsa:131072    (~1 min each)
#   bash scripts/gpu_session.sh qsa-selection [T]  # HyTopK on QSA's shape (4 heads over
#                                         # T / 4 blocks, top 512): launch sweep, score-only
#                                         # split, the finishing sort; default T 524288 (~3 min)
#   bash scripts/gpu_session.sh soak [STEPS]  # issue #23 item 7: STEPS (300) training steps
#                                         # of the tiny DSA GPT under full recompute, the
#                                         # replay store on the GPU, then offloaded: no growth
#                                         # of the store, allocated memory or step time
#                                         # (megatron_hyscale.testing.soak); its record in the
#                                         # stage's folder, exit 1 if a check failed  (~2 min)
#   bash scripts/gpu_session.sh side1-long PART  # issue #19 item 3: the one-H200 pair at
#                                         # 128K (stock's longest fit) over several calls
#                                         # with checkpoint and resume: PART stock (2-3
#                                         # calls), hyscale, alone (155,648), summary; about
#                                         # 30 min of device time on one GPU. On
#                                         # nvidia-h200-x2: PART pair (stock on GPU 0, HyScale
#                                         # and HyScale alone on GPU 1 at the same time; ~3
#                                         # calls), then summary: about 25 min
#   bash scripts/gpu_session.sh evaluate PART  # issue #24: the evaluation report on the
#                                         # H200, 300 iterations each on real text: PART
#                                         # stock, hyscale (which writes the report),
#                                         # report; at 16K one call each (~6 and ~5 min)
#   bash scripts/gpu_session.sh indexer-target  # issue #20 item 3: the loss's target from
#                                         # the attention backward: GPU tests, the dQ kernel
#                                         # with it against the target pass, the layer with
#                                         # and without it (own kernels)          (~8 min)
#   bash scripts/gpu_session.sh loss-variants  # issue #20: the indexer loss's row-pass and
#                                         # backward variants (IndexerLossKernelOptions) at 32K
#                                         # and 128K, GLM-5.1 and V3.2; the dense (warm-up)
#                                         # loss's GPU tests and its Triton path against the
#                                         # reference, 4K-16K; LOSS_VARIANTS names the
#                                         # variants, LOSS_DENSE=0 skips the dense part (~5 min)
#   bash scripts/gpu_session.sh ncu-selection  # issue #21: Nsight Compute on one HyTopK
#                                         # call a case (NCU_CASES, config:T:method): stall
#                                         # reasons, issue slots, per-line SASS samples; a
#                                         # record by ncu_summary.py                (~3 min)
#   bash scripts/gpu_session.sh norms     # issue #20 item 5: DeepSeek-V4's norms on the Triton
#                                         # kernels (ops.rms_norm kernel="triton", and the query's
#                                         # norm + RoPE in one kernel): their GPU tests, then
#                                         # bench_rms_norm.py at NORMS_T (32K, 128K) against
#                                         # torch's fused kernel and the chunked ops  (~2 min)
#   bash scripts/gpu_session.sh loss-bwd-sm90  # issue #20 item 3: the warp-specialized Gluon
#                                         # indexer-loss backward (IndexerLossKernelOptions.
#                                         # bwd_sm90, the default): a smoke case first (a hang
#                                         # stops the stage), its GPU tests, then timed beside
#                                         # the Triton backward (the KL in the backward, both),
#                                         # itself in lockstep, and both without the KL,
#                                         # GLM-5.1 / V3.2 at 32K and 128K, one process each
#                                         # (LOSS_BWD_RUNS)                           (~7 min)
#   bash scripts/gpu_session.sh selection-lse  # issue #20 item 3: the indexer loss's row
#                                         # pass with the selection's log-sum-exp
#                                         # (config.hyscale_indexer_lse = "selection"): the
#                                         # op's and the layer's tests on CUDA, the row pass +
#                                         # backward beside the gathered row pass (GLM-5.1 and
#                                         # V3.2 at 32K and 128K, one process each: LSE_RUNS),
#                                         # then the GLM-5.1 layer at LSE_LAYER_T (128K) with
#                                         # and without it; LSE_LAYER_FLAGS adds bench_layer
#                                         # flags (e.g. "--stock-kernel-backend cudnn
#                                         # --fused-stock-max-seq 131072" after
#                                         # scripts/gpu_cudnn.sh 1 and 2); LSE_TESTS=0 skips
#                                         # the tests, LSE_TEST_FILES names others,
#                                         # LSE_VARIANTS adds bench_indexer_loss variants
#                                         # (LSE_RUN_S: a run's limit, 150 s),
#                                         # LSE_LAYER=0 skips the layer             (~6 min)
#   bash scripts/gpu_session.sh loss-bwd-probe  # issue #20 item 3: where the indexer loss's
#                                         # backward kernel spends its time
#                                         # (probe_indexer_bwd.py: without dk's atomics, rows'
#                                         # slots shuffled, keys in a window, dk in two halves;
#                                         # GLM-5.1 and V3.2 at PROBE_T; the Triton and the
#                                         # Gluon kernel, PROBE_KERNELS), then one GLM-5.1 128K
#                                         # Gluon backward under Nsight Compute (L2 reductions,
#                                         # their hit rate, DRAM bytes, warp stalls) (~5 min)
#   bash scripts/gpu_session.sh mla-projections [T...]  # issue #20 item 5: the absorbed-MLA
#                                         # projections written in place: GPU tests, the two
#                                         # projections alone, then the GLM-5.1 DSA layer (8K,
#                                         # 128K) with HyScale's and with megatron's
#                                         # projections, same run (~6 min; MLA_LAYER=0: ~1)
#   bash scripts/gpu_session.sh ncu-attention  # issue #20 item 2: Nsight Compute on one
#                                         # sparse-attention backward a case (NCU_ATTN_CASES,
#                                         # shape:T:kernel[:fwd], kernel sm90 / triton / cudnn
#                                         # (fwd: the forward, sm90 or cudnn = FlashMLA); cudnn
#                                         # after scripts/gpu_cudnn.sh 1 and 2): each case's
#                                         # kernels by time (torch.profiler), then the longest
#                                         # under ncu with DRAM / L2 reduction counters; a
#                                         # record by ncu_summary.py                (~4 min)
#   bash scripts/gpu_session.sh scores-sm90 [ncu]  # issue #21 item 1: the warp-specialized
#                                         # Gluon scores-only kernel, its GPU tests (a smoke
#                                         # case first: a hang stops the stage), then timed
#                                         # beside the Triton scores-only kernel, V3.2 /
#                                         # GLM-5.1 at 16K and 128K (~3 min); ncu: then both
#                                         # under Nsight Compute, V3.2 at 64K      (+2 min)
#   bash scripts/gpu_session.sh filter-sm90  # issue #21: HyTopK on the Gluon scores
#                                         # (HyTopKOptions.scores_sm90): its GPU tests (the
#                                         # filter first under a short timeout), then timed
#                                         # beside the default, the filter's first build
#                                         # (scores_sm90_defer_store off), the Gluon scores
#                                         # alone and cuDNN's selection where installed,
#                                         # V3.2 / GLM-5.1 at 16K and 128K
#                                         # (FILTER_T, FILTER_BENCH_S)            (~5 min)
#   bash scripts/gpu_session.sh sample-pick [tests|bench]  # issue #21: the sample's
#                                         # threshold pick by row_rank.rank_values
#                                         # (scores_sm90_sample_pick="radix", the default since
#                                         # 2026-12-07) against torch.topk, and the filter's
#                                         # slots by a scan (scores_sm90_scan_slots, default;
#                                         # key order without the row sort) against atomics:
#                                         # their GPU tests (~3 min), then today's defaults
#                                         # (hytopk_default, _key: the layers' order) and the
#                                         # Gluon path with each beside the Triton kernel and,
#                                         # where installed, cuDNN's (cudnn, cudnn_key: the
#                                         # pairs measured_defaults.py reads), GLM-5.1 / V3.2 /
#                                         # the folded query at PICK_T (16K 64K 128K), then the
#                                         # phases at 128K (sample_pick beside sample_topk,
#                                         # filter_scan beside filter)                (~6 min)
#   bash scripts/gpu_session.sh mma-ahead PART  # issue #21 items 1-2: the Gluon filter's
#                                         # consumers issuing each product before the last
#                                         # tile's epilogue (scores_sm90_mma_ahead; 4 and 6
#                                         # key tiles in flight) and the folded query's parts
#                                         # part-major (scores_sm90_folded_part_major). PART
#                                         # tests: their GPU tests, smoke first (~5 min);
#                                         # bench: timed beside today's default in key order,
#                                         # GLM-5.1 / V3.2 / the folded query at AHEAD_T
#                                         # (16K 64K 128K), the folded query part-major, the
#                                         # scores alone at 128K, the op against its path
#                                         # called directly at 16K (ten repetitions) (~8 min)
#   bash scripts/gpu_session.sh direct-select  # issue #21 item 2: the survivors' select
#                                         # written straight to the rows
#                                         # (scores_sm90_direct_select): its GPU tests, then
#                                         # timed beside the compacting select in key order,
#                                         # GLM-5.1 and the folded query at DIRECT_T (16K 64K
#                                         # 128K), and the select phases apart at 128K (~6 min)
#   bash scripts/gpu_session.sh selection-rounds  # today's default selection (key order)
#                                         # against cuDNN's, GLM-5.1 / V3.2 / the folded
#                                         # query at ROUNDS_T (16K 64K 128K), ROUNDS rounds
#                                         # (2) in rotated order: the pairs measured_defaults.py
#                                         # reads, without the first-after-a-length-change
#                                         # bias (gpu_cudnn.sh 1 and 2 first)     (~5 min)
#   bash scripts/gpu_session.sh head-sum-transpose  # the transposed head sum's tests, then
#                                         # timed beside today's default and cuDNN (key order)
#                                         # and the scores alone, GLM-5.1 and V3.2 at
#                                         # TRANSPOSE_T (16K 128K), 2 rotated rounds (~7 min;
#                                         # gpu_cudnn.sh 1 and 2 first)
#   bash scripts/gpu_session.sh path-phases  # the default path's steps timed apart
#                                         # (path_ms: fold, sample, filter, select, redo,
#                                         # total) beside cuDNN at PATH_T (16K 128K),
#                                         # warnings shown; then the folded phases at 128K
#                                         # (~5 min; gpu_cudnn.sh 1 and 2 first)
#   bash scripts/gpu_session.sh sample-growth  # the sample grown past 128K keys
#                                         # (scores_sm90_sample_min_rank) against the fixed
#                                         # 2048-key one and cuDNN, key order, GLM-5.1 and V3.2
#                                         # at GROWTH_T (16K 128K 256K), redone rows shown,
#                                         # 2 rounds (~5 min; gpu_cudnn.sh 1 and 2 first)
#   bash scripts/gpu_session.sh profile-layers  # issues #20 items 4-5: one profiled step
#                                         # (bench_layer.py --profile-kernels) of the QSA
#                                         # layer at 512K (PROFILE_QSA_T) and the GLM-5.1 DSA
#                                         # layer at 128K (PROFILE_DSA_T), HyScale only: where
#                                         # their time goes; PROFILE_MODELS="qsa" for one
#                                         # (also csa, hca), PROFILE_TESTS=0 skips the layer
#                                         # kernels' test                          (~3 min)
#   bash scripts/gpu_session.sh key-tma   # issue #21: HyTopK's key tiles through TMA
#                                         # (HyTopKOptions.key_tma): its GPU tests, then timed
#                                         # beside the default, V3.2 / GLM-5.1 / the folded
#                                         # query at 16K and 128K, select and scores-only
#                                         #                                         (~4 min)
#   bash scripts/gpu_session.sh fwd-ws    # issue #20 item 1: the warp-specialized Gluon
#                                         # sparse-MLA forward: a smoke case first (a hang
#                                         # stops the stage), the forward's GPU tests (both
#                                         # Gluon kernels), then the forward alone, GLM-5.1 /
#                                         # V3.2 / CSA at 16K-128K, the default kernels (plain
#                                         # Gluon; Triton for CSA) then warp-specialized,
#                                         # FlashMLA in both runs when scripts/gpu_cudnn.sh 1
#                                         # and 2 ran before on this machine        (~6 min)
#   bash scripts/gpu_session.sh bwd-sm90  # issue #20 item 2: the warp-specialized Gluon
#                                         # sparse-MLA backward: a smoke case first (a hang
#                                         # stops the stage), its GPU tests against the Triton
#                                         # backward, then the backward of GLM-5.1 / V3.2 / CSA
#                                         # / GLM-5.1 at TP 2 (32 heads) at 16K-128K, Triton
#                                         # then warp-specialized in one process, cuDNN's
#                                         # when scripts/gpu_cudnn.sh 1 and 2 ran before on
#                                         # this machine                            (~8 min)
#   bash scripts/gpu_session.sh bwd-atomics PART  # issue #20 item 2: the backward's 16-byte
#                                         # dK atomics and its lockstep mode (Attention-
#                                         # KernelOptions.bwd_dk_vec4, bwd_lockstep). PART
#                                         # tests: smoke cases (a hang stops the stage), then
#                                         # the backward's GPU tests of the new forms (~4 min);
#                                         # bench: 8-byte, 16-byte, lockstep slack 1 and 2 in
#                                         # one process beside cuDNN's, $BENCH_SHAPES (glm51
#                                         # csa) at 16K and 128K (~6 min); fwd: the forward
#                                         # in lockstep (fwd_lockstep): its GPU tests, then
#                                         # timed beside the default and FlashMLA's, GLM-5.1 /
#                                         # V3.2 / CSA at 16K and 128K (~5 min); ncu: Nsight
#                                         # Compute on the 16-byte and the lockstep backward,
#                                         # GLM-5.1 at 128K (~3 min). cuDNN's and FlashMLA's
#                                         # after scripts/gpu_cudnn.sh 1, 2
#   bash scripts/gpu_session.sh captured-selection  # issue #21 item 3: HyTopK with and
#                                         # without key-tile pruning, table-then-select and
#                                         # cuDNN on the trained indexer `evaluate hyscale`
#                                         # captured on this machine ($CAPTURE)      (~2 min)
#   bash scripts/gpu_session.sh reliability [FILES]  # issue #23: tests/reliability on
#                                         # CUDA, one pytest a file, slow cases and the 256K
#                                         # HyTopK test included (checkpoint round trips,
#                                         # resume, failure modes, soak)               (~8 min)
#   bash scripts/gpu_session.sh accuracy-64k  # accuracy.py, DSA at 64K, HyScale against
#                                         # float64 alone, dense and sparse loss      (~4 min)
#   bash scripts/gpu_session.sh selection # HyTopK and its score-only split at 128K for
#                                         # DeepSeek-V3.2 and V4-Flash's CSA, at 512K for QSA,
#                                         # each kernel default as it stands; the folded query
#                                         # beside naive / chunked / table, 16K-128K (~5 min)
#   bash scripts/gpu_session.sh cudnn-verify   # after scripts/gpu_cudnn.sh 1 and 2 in the
#                                         # calls before (machine warm): the library backends'
#                                         # GPU tests, then the verify stage           (~5 min)
#   bash scripts/gpu_session.sh cudnn-kernels  # selection, attention and indexer loss: HyScale's
#                                         # kernels against cuDNN's / FlashMLA's in the same
#                                         # runs, DSA shapes, 16K-256K                 (~8 min)
#   bash scripts/gpu_session.sh cudnn-tests    # the library backends' GPU tests and the
#                                         # stock-cudnn layer tests (equality, no host sync)
#                                         #                                            (~2 min)
#   bash scripts/gpu_session.sh flashmla-pair  # FlashMLA's forward with HyScale's backward
#                                         # (`fwd_flashmla`): its GPU tests, then the pair
#                                         # timed beside the library pair in one process
#                                         # (bench_attention.py --fwd-kernel flashmla), GLM-5.1
#                                         # V3.2 CSA at 16K-128K ($PAIR_T)              (~5 min)
#   bash scripts/gpu_session.sh lockstep-triton {tests|bench}  # the Triton kernels' lockstep
#                                         # variants (indexer backward, QSA's forward, dQ and
#                                         # dK/dV): their interpreter tests on CUDA (~4 min), or
#                                         # timed beside the defaults (bench_indexer_loss.py
#                                         # --variants, bench_attention.py --shapes qsa --indices
#                                         # sorted --bwd-also / --fwd-also)           (~8 min)
#                                         # LOCKSTEP_T="524288" LOCKSTEP_LOSS=0: QSA at 512K
#                                         # only (the layer's length)                 (~3 min)
#   bash scripts/gpu_session.sh cudnn-layer [T...]  # bench_layer.py, GLM-5.1 DSA: HyScale
#                                         # (own kernels, then the measured best per op)
#                                         # against stock on dsa_kernel_backend="cudnn"
#                                         # (and "none" at 8K), $REPEATS timed steps (3);
#                                         # $LAYER_FLAGS: more bench_layer flags (the own
#                                         # kernels' variants: --attention-bwd sm90)  (~5 min)
#   bash scripts/gpu_session.sh cudnn-loss  # issue #20 item 3 against stock cudnn's loss
#                                         # kernels in one call: bench_indexer_loss.py's default
#                                         # mode (cuDNN's given the attention's lse, HyScale's
#                                         # target from the dQ kernel), then --variants
#                                         # selection_lse; LOSS_RUNS (glm51:131072) (~3 min)
#                                         # The cudnn-* and flashmla-pair stages pack their files into
#                                         # $OUT/<stage>.tgz, records in results/ inside.
#   bash scripts/gpu_session.sh pair 'STAGE [ARGS]' 'STAGE [ARGS]'  # on nvidia-h200-x2: two
#                                         # one-GPU stages at once, one a GPU, e.g.
#                                         # pair 'models csa hca' 'models qsa' or
#                                         # pair kernels attention; files in results.tgz;
#                                         # 'STAGE A; STAGE B' runs two stages in turn
#   bash scripts/gpu_session.sh pp2       # on nvidia-h200-x2 with carry [".whl",
#                                         # ".carry/megatron_lm"], after gpu_cudnn.sh 1 and 2:
#                                         # Megatron-LM at PP 2 x VPP 2, stock cudnn then
#                                         # HyScale, losses compared (issue #22)    (~6 min)
#   bash scripts/gpu_session.sh cp2 [T...]  # on nvidia-h200-x2: CP 2 against CP 1 (NCCL,
#                                         # DSA / CSA / QSA layers at 32K), then DSA at CP 2
#                                         # at 128K / 256K / 512K                      (~9 min)
#   bash scripts/gpu_session.sh cp2-1m [dsa|csa|hca|qsa]  # on nvidia-h200-x2: the layer at
#                                         # 1M tokens, CP 2, attention rows in parts of 128K (DSA
#                                         # 102 GiB a GPU by launch/layer_memory.py, 213 GiB
#                                         # unchunked; CSA 94 / 235)                   (~5 min)
#   bash scripts/gpu_session.sh tilelang-kernels [selection|attention-loss]  # after
#                                         # gpu_cudnn.sh 1, 2 and gpu_tilelang.sh 1, 2 (machine
#                                         # warm): megatron's TileLang kernels beside HyScale's
#                                         # and cuDNN's, same runs; selection (~4-5 min), then
#                                         # attention + indexer loss (~5-6 min): two calls
#   bash scripts/gpu_session.sh fp8       # the FP8 indexer: its GPU tests, then bench_selection.py
#                                         # fp8 against bf16 (floor ratio, overlap), 16K-128K
#                                         # random and 128K trained-like inputs     (~8 min)
#   bash scripts/gpu_session.sh te [T...]  # after gpu_cudnn.sh 1, 2 and gpu_te.sh 1-5 (machine
#                                         # warm): the Transformer Engine layer test and
#                                         # bench_layer.py with TE against stock cudnn, 8K and
#                                         # 32K by default                          (~4 min)
#   bash scripts/gpu_session.sh side1 [ARGS...]  # one H200, after gpu_cudnn.sh 1 and 2
#                                         # (machine warm), carry [".whl",
#                                         # ".carry/megatron_lm"]: Megatron-LM side by side,
#                                         # stock cudnn then HyScale at $SIDE1_SEQ (32K) for 22
#                                         # iterations, HyScale alone at 2x  (~6 min, 8 at most)
#   bash scripts/gpu_session.sh side2     # on nvidia-h200-x2 with carry [".whl",
#                                         # ".carry/megatron_lm"] (scripts/megatron_lm_carry.sh):
#                                         # stock Megatron-LM DSA then HyScale, the small
#                                         # GLM-5.1 at 16K, CP 2, 10 iterations, tokens/s and
#                                         # losses (~5.5 min; side2 ARGS...: side_by_side.sh
#                                         # options instead of those three)
#                                         # HyScale alone at the scaled configuration's own
#                                         # 256K: side2 --config scaled --only hyscale
#                                         # --train-iters 6 (129 GiB a GPU by the estimate)
#                                         # Stock on TileLang: gpu_tilelang.sh 1 and 2 first,
#                                         # then PYTHONPATH=$PWD/.carry/site:$PYTHONPATH
#                                         # bash scripts/gpu_session.sh side2 --stock-backend
#                                         # tilelang --seq-length 16384 --train-iters 10
# Logs and JSON go under ${OUT:-outputs/gpu_session}/<stage>. TileLang's stock backend needs
# two more calls (scripts/gpu_tilelang.sh).
set -uo pipefail
stage=${1:-}
shift || true
case "$stage" in
  verify|tests|kernels|attention|attention-table|fwd-split|layer|layer-packed|accuracy|models|memory|qsa-selection|selection|soak|cp2|cp2-1m|side1|side2\
  |pair|cudnn-verify|cudnn-tests|cudnn-kernels|cudnn-layer|tilelang-kernels|te|fp8|reliability\
  |flashmla-pair|lockstep-triton|accuracy-64k|side1-long|evaluate|pp2|indexer-target|loss-variants|ncu-selection\
  |ncu-attention|scores-sm90|filter-sm90|fwd-ws|key-tma|bwd-sm90|bwd-atomics|captured-selection\
  |profile-layers|loss-bwd-probe|mla-projections|norms|loss-bwd-sm90|selection-lse|cudnn-loss\
  |sample-pick|mma-ahead|direct-select|selection-rounds|path-phases|head-sum-transpose\
  |sample-growth) ;;
  *) echo "usage: bash scripts/gpu_session.sh {verify|tests|kernels|attention|attention-table" \
       "|fwd-split|layer|layer-packed|accuracy" \
       "|models|memory|qsa-selection|selection|soak|cp2|cp2-1m|side1|side2|pair|cudnn-verify" \
       "|cudnn-tests|cudnn-kernels|cudnn-layer|flashmla-pair|lockstep-triton" \
       "|tilelang-kernels|te|fp8" \
       "|reliability" \
       "|accuracy-64k|side1-long|evaluate|pp2|indexer-target|loss-variants|ncu-selection" \
       "|ncu-attention|scores-sm90|filter-sm90|fwd-ws|key-tma|bwd-sm90|bwd-atomics" \
       "|captured-selection|profile-layers|loss-bwd-probe|mla-projections|norms" \
       "|loss-bwd-sm90|selection-lse|cudnn-loss|sample-pick|mma-ahead|direct-select" \
       "|selection-rounds|path-phases|head-sum-transpose|sample-growth}" \
       "[ARGS...]" >&2
     exit 2 ;;
esac
# A stage's PART, checked before any set-up spends device time.
if [ "$stage" = mma-ahead ] && [[ ! "${1:-}" =~ ^(tests|bench)$ ]]; then
  echo "usage: bash scripts/gpu_session.sh mma-ahead {tests|bench}" >&2; exit 2
fi
out=${OUT:-outputs/gpu_session}/$stage
mkdir -p "$out"
# The device's copy of the tree may carry a stale .git: records name the commit measured only
# if the caller exports it (HYSCALE_COMMIT=$(git rev-parse --short HEAD) here, before the call).
[ -n "${HYSCALE_COMMIT:-}" ] || echo "gpu_session.sh: HYSCALE_COMMIT is not set; records will" \
  "name the copy's git HEAD, which may not be the tree measured" >&2
# pytest's closing count line of a log ("3 passed, 1 failed in 9.5s"; the last line can be a
# NCCL shutdown warning), else its last line (a run cut off by its timeout)
verdict() { grep -E "^=* *[0-9]+ (passed|failed|error|skipped|deselected)" "$1" | tail -1 \
  | grep . || tail -1 "$1"; }
# A warp-specialized kernel's mbarrier fault hangs rather than fails: `smoke FILE K_EXPR` runs
# the cases of FILE matching K_EXPR under a short timeout (return 1 if they do not pass);
# `smoke_then_tests FILE K_EXPR [K]` then all of FILE's GPU tests (those matching K, if given);
# verdicts in $out/summary.txt.
smoke() {
  timeout 120 python3 -m pytest -x -q -rfE -p no:cacheprovider -m gpu "$1" -k "$2" \
    > "$out/smoke.log" 2>&1
  local rc=$?
  echo "smoke rc=$rc: $(verdict "$out/smoke.log")" | tee "$out/summary.txt"
  [ $rc -eq 0 ] || { grep -h -E "^(FAILED|ERROR|E   )" "$out/smoke.log" | cut -c1-300 \
    | head -20; return 1; }
}
# `stage_tests SECONDS K_EXPR FILE...`: the GPU tests of the files matching K_EXPR under a
# timeout, the verdict in $out/summary.txt and the call's output; returns pytest's status.
stage_tests() {
  local limit=$1 expr=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu "$@" -k "$expr" \
    > "$out/tests.log" 2>&1
  local rc=$?
  echo "tests rc=$rc: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
  grep -h -E "^(FAILED|ERROR)|^E  " "$out/tests.log" | cut -c1-300 | head -20
  return $rc
}
smoke_then_tests() {
  smoke "$1" "$2" || return 1
  local only=()
  [ -n "${3:-}" ] && only=(-k "$3")
  timeout 360 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu "$1" "${only[@]}" \
    > "$out/tests.log" 2>&1
  echo "tests rc=$?: $(verdict "$out/tests.log")" | tee -a "$out/summary.txt"
  grep -h -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-300 | head -20
  return 0
}
if ! python3 -c "import megatron.core" 2>/dev/null; then
  compgen -G ".whl/*.whl" > /dev/null || { echo "gpu_session.sh: megatron-core is not" \
    "installed and .whl/ holds no wheel: call the device with carry [\".whl\"]" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$(pwd):${PYTHONPATH:-} PYTHONUNBUFFERED=1
# The library kernels scripts/gpu_cudnn.sh installed on this (warm) machine, if it did.
if [ -d .carry/site/nvidia_cutlass_dsl ]; then
  export PYTHONPATH=$(pwd)/.carry/site:$(pwd)/.carry/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
fi
case "$stage" in
  cudnn-*|tilelang-kernels|loss-variants|ncu-selection|ncu-attention|scores-sm90|filter-sm90\
  |profile-layers|models|loss-bwd-probe|mla-projections|norms|loss-bwd-sm90|selection-lse\
  |fwd-ws|key-tma|bwd-sm90|bwd-atomics|flashmla-pair|lockstep-triton|sample-pick|mma-ahead\
  |direct-select|selection-rounds|path-phases|head-sum-transpose|sample-growth)
    case "$stage" in cudnn-*|tilelang-kernels|flashmla-pair|selection-rounds|path-phases\
      |head-sum-transpose|sample-growth)
      [ -d .carry/site/nvidia_cutlass_dsl ] || {
        echo "gpu_session.sh $stage: run scripts/gpu_cudnn.sh 1 and 2 first (same warm machine)" \
          >&2
        exit 2; } ;;
    esac
    # The device tool brings back 8 files, 2 folders deep: the stage packs its folder at the end.
    pack=${OUT:-outputs/gpu_session}/$stage.tgz
    out=/tmp/gpu_session/$stage
    rm -rf "$out"; mkdir -p "$out/results"
    export HYSCALE_RESULTS=$out/results
    trap 'tar -czf "$pack" -C "$out" . && rm -rf "${OUT:-outputs/gpu_session}/$stage"' EXIT ;;
esac
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u;
  git log -1 --format='%h %s' 2>/dev/null; } | tee "$out/device.txt"

case "$stage" in
  verify)
    # One pytest per file so each has its own verdict; the full logs go into one file
    # ($out/tests.log: the device tool brings back only a few files a call), the verdicts into
    # $out/summary.txt and the call's output. Exit status: 1 if any file failed.
    : > "$out/tests.log"; : > "$out/summary.txt"; : > "$out/failures.log"
    # tests/conftest.py appends each failure's traceback here as it happens.
    HYSCALE_FAILURE_LOG=$(cd "$out" && pwd)/failures.log; export HYSCALE_FAILURE_LOG
    # `verify ops`, `verify hytopk` or `verify layers` runs one part: on a fresh machine
    # (2026-12-07, H100, cold Triton cache) the indexer-loss, sparse-attention and forward
    # files took ~60 + 175 + 80 s, HyTopK's 357 s and the layers ~300 s, more than one call's
    # 600 s together; warm, `verify` alone fits one call (~4 min).
    part=${1:-all}
    case "$part" in
      all) specs="indexer_loss:100 sparse_attention:240 sparse_mla_fwd_sm90:120 hytopk:420" ;;
      ops) specs="indexer_loss:100 sparse_attention:240 sparse_mla_fwd_sm90:120" ;;
      hytopk) specs="hytopk:420" ;;
      layers) specs="" ;;
      *) echo "gpu_session.sh verify: [ops|hytopk|layers]" >&2; exit 2 ;;
    esac
    fail=0
    for spec in $specs; do
      f=tests/ops/test_${spec%%:*}_gpu.py name=test_${spec%%:*}_gpu
      echo "=== $name" >> "$out/tests.log"
      timeout ${spec##*:} python3 -m pytest -q -rfE -m gpu "$f" -p no:cacheprovider \
        > "$out/current.log" 2>&1
      rc=$?
      [ $rc -eq 0 ] || fail=1
      cat "$out/current.log" >> "$out/tests.log"
      echo "$name rc=$rc: $(verdict "$out/current.log")" | tee -a "$out/summary.txt"
    done
    if [ "$part" = ops ] || [ "$part" = hytopk ]; then
      rm -f "$out/current.log"
      grep -h -E "^(FAILED|E  )|^[^ ]*\.py:[0-9]+: " "$out/failures.log" | cut -c1-400 | head -40 || true
      exit $fail
    fi
    echo "=== layers" >> "$out/tests.log"
    # About 300 s for the 235 tests on a fresh machine (2026-12-03: 177 in 230 s); a failure's
    # traceback reaches failures.log when it happens, even if the call runs out of time later.
    timeout "${LAYERS_TIMEOUT:-420}" python3 -m pytest -q -rfE --tb=line tests/layers \
      -p no:cacheprovider > "$out/current.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fail=1
    cat "$out/current.log" >> "$out/tests.log"
    echo "layers rc=$rc: $(verdict "$out/current.log")" | tee -a "$out/summary.txt"
    rm -f "$out/current.log"
    grep -h -E "^(FAILED|E  )|^[^ ]*\.py:[0-9]+: " "$out/failures.log" | cut -c1-400 | head -40 || true
    exit $fail
    ;;
  tests)
    [ $# -gt 0 ] || { echo "gpu_session.sh tests: name the test files or nodes" >&2; exit 2; }
    : > "$out/failures.log"
    HYSCALE_FAILURE_LOG=$(cd "$out" && pwd)/failures.log; export HYSCALE_FAILURE_LOG
    timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider "$@" \
      > "$out/tests.log" 2>&1
    rc=$?
    echo "tests rc=$rc: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
    grep -h -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-300 | head -40 || true
    grep -h -E "^E  |^[^ ]*\.py:[0-9]+: " "$out/failures.log" | cut -c1-300 | head -40 || true
    exit $rc
    ;;
  kernels)
    timeout 180 python3 scripts/bench_selection.py --T 131072 --configs dsv32 --reps 2 \
      --methods hytopk hytopk_heads_on_m hytopk_scan_slots scoreonly scoreonly_heads_on_m finish \
      table chunked --out "$out" 2>&1 | tee "$out/bench_selection.log"
    # Launch variants of the keys-on-M kernel (never timed since it became the default),
    # among them 4 query rows a program (the GEMM's N 256: half the key-tile reads per FLOP).
    timeout 150 python3 scripts/bench_selection.py --sweep --T 131072 --configs dsv32 \
      --reps 2 --out "$out" 2>&1 | grep -E "^sweep|Error|Timeout" \
      | tee "$out/bench_selection_sweep.log"
    # Tile-group size and pipeline depth (GROUP_SWEEP_VARIANTS), scoring alone and select.
    timeout 100 python3 scripts/bench_selection.py --group-sweep --T 131072 --configs dsv32 \
      --reps 2 --out "$out" 2>&1 | grep -E "^groups|Error|Timeout" \
      | tee "$out/bench_selection_groups.log"
    # Issue 3's structured inputs: exact key-tile pruning (share pruned, speed-up, identical
    # selection) on the recency + heavy-hitter generator.
    timeout 90 python3 scripts/bench_selection.py --T 131072 --configs dsv32 --reps 2 \
      --inputs recency --methods hytopk hytopk_prune table --tag _recency --out "$out" 2>&1 \
      | tail -6 | tee "$out/bench_selection_recency.log"
    # The demo's trained indexer (carry "outputs/demo/indexer_capture.pt" when it exists):
    # what the pruning bound skips on a trained indexer, exactness against the reference.
    if [ -f outputs/demo/indexer_capture.pt ]; then
      timeout 60 python3 scripts/bench_selection.py --captured outputs/demo/indexer_capture.pt \
        --methods hytopk hytopk_prune table --reps 2 --tag _captured --out "$out" 2>&1 \
        | tail -8 | tee "$out/bench_selection_captured.log"
    fi
    ;;
  attention)
    # One process per tiling: dK/dV at 32 x 1 and 16 x 1 faults for the 576-dim shape (an
    # illegal address poisons the process), see sparse_attention.DKV_TILINGS.
    for t in 16x2 32x2 64x1 64x2; do
      timeout 50 python3 scripts/bench_attention.py --bwd-sweep --shapes glm51 --t 32768 \
        --reps 2 --tilings $t --out "$out/sweep_$t" 2>&1 | grep "^sweep" \
        | tee -a "$out/bench_attention_sweep.log"
    done
    # Issue 4's gap, measured: the same kernels at 128K when the gathers hit the L2 cache
    # (each row's last K keys) against the random-index table.
    timeout 90 python3 scripts/bench_attention.py --t 131072 --shapes glm51 csa --reps 2 \
      --indices window --no-stock --no-deterministic --out "$out/window" 2>&1 \
      | grep "T=" | tee "$out/bench_attention_window.log"
    # V3.2's 128 heads run as two programs a query: their launch order (HEAD_BLOCKS_ADJACENT)
    # decides whether the second one's gathers can hit L2.
    for order in split adjacent; do
      timeout 90 python3 scripts/bench_attention.py --t 131072 --shapes v32 --reps 2 \
        --no-stock --no-deterministic --head-blocks $order --out "$out/heads_$order" 2>&1 \
        | grep -E "T=|Error" | sed "s/^/$order: /" | tee -a "$out/bench_attention_head_blocks.log"
    done
    timeout 170 python3 scripts/bench_indexer_loss.py --out "$out" 2>&1 \
      | tee "$out/bench_indexer_loss.log"
    # The target pass (3x the attention forward on 2026-11-30) per tiling.
    timeout 60 python3 scripts/bench_indexer_loss.py --t 32768 --reps 3 \
      --target-tilings 32x2 64x2 64x1 32x1 16x2 --out "$out" 2>&1 | grep "^target" \
      | tee "$out/bench_indexer_loss_target.log"
    ;;
  fwd-split)
    # Issue 4's forward gap split: the same forward without its online softmax (measurement
    # only, FWD_SOFTMAX = False) against the real one, random and L2-resident indices.
    for ind in random window; do
      for sm in "" --fwd-no-softmax; do
        timeout 60 python3 scripts/bench_attention.py --t 131072 --shapes glm51 --reps 2 \
          --no-stock --no-deterministic --indices $ind $sm --out "$out/fwd_${ind}${sm}" 2>&1 \
          | grep -E "T=|Error" | sed "s/^/$ind ${sm:-softmax}: /" \
          | tee -a "$out/bench_attention_fwd_split.log"
      done
    done
    ;;
  attention-table)
    # Issue 4's table: every shape at 16K / 64K / 128K (stock at 16K), the deterministic
    # backward's cost, then the Triton forward alone at the DSA shapes, same GPU.
    timeout 330 python3 scripts/bench_attention.py --reps 2 --out "$out/default" 2>&1 \
      | grep -E "matmul|T=|Error" | tee "$out/bench_attention.log"
    timeout 90 python3 scripts/bench_attention.py --reps 3 --shapes glm51 v32 --fwd-only \
      --fwd-kernel triton --no-stock --out "$out/triton_fwd" 2>&1 \
      | grep -E "matmul|T=|Error" | sed "s/^/triton fwd: /" | tee -a "$out/bench_attention.log"
    ;;
  layer)
    seqs=${*:-8192 16384 32768 65536 131072 262144}
    timeout 560 python3 scripts/bench_layer.py --seq $seqs --repeats 1 --out "$out" 2>&1 \
      | tee "$out/bench_layer.log"
    ;;
  soak)
    # The checks' figures and verdicts in the call's output and soak.log, the record (one
    # entry per mode) in the stage's folder.
    HYSCALE_RESULTS=$out timeout 170 python3 -m megatron_hyscale.testing.soak \
      --steps "${1:-300}" --device cuda 2>&1 | grep -v -i warn | tee "$out/soak.log"
    exit "${PIPESTATUS[0]}"
    ;;
  te)
    # Issue #22 item 6, after scripts/gpu_cudnn.sh 1-2 and scripts/gpu_te.sh 1-5 (warm): the
    # TE layer test (HyScale == stock on TE's linears, under recompute), then one bench_layer.py
    # row pair with TE against stock cudnn. The side by side takes TE by itself from here on
    # (side1 picks transformer_engine whenever it imports).
    python3 -c "import transformer_engine.pytorch" 2>/dev/null || {
      echo "gpu_session.sh te: transformer_engine does not import: run scripts/gpu_te.sh 1-5" >&2
      exit 2; }
    timeout 240 python3 -m pytest -q -m gpu tests/layers/test_dsa_te_gpu.py \
      tests/layers/test_stock_cudnn_gpu.py 2>&1 | tail -15 | tee "$out/tests.log"
    HYSCALE_RESULTS=$out timeout 300 python3 scripts/bench_layer.py --seq ${*:-8192 32768} \
      --transformer-impl transformer_engine --stock-kernel-backend cudnn --stock-max-seq 32768 \
      --repeats "${REPEATS:-3}" --out "$out" 2>&1 | tee "$out/bench_layer.log" \
      | grep -E "^\||Error|Traceback|T=.*floor"
    ;;
  layer-packed)
    seqs=${*:-131072}
    # The whole log in bench_layer.log; the tables, errors and any HyScale fallback warning
    # (the JSON counts them per row: fallback_warnings, path) in the call's output. The
    # benchmarks/results record (benchmark_tables.py renders it) lands in the stage's folder.
    # PROFILE=N: one profiled step a row, its N costliest operators in the log and the JSON.
    # PACKED_SELECTION: per_document, batched or both (default: both, rows side by side).
    # LAYER_FLAGS: more bench_layer flags (--compare-selection-lse: the row pass's own
    # log-sum-exp beside the selection's, packed rows too).
    # shellcheck disable=SC2086  # flags split on purpose
    HYSCALE_RESULTS=$out timeout "${LAYER_PACKED_TIMEOUT:-420}" python3 scripts/bench_layer.py \
      --seq $seqs --packed ${PACKED_DOCS:-8 64} \
      --packed-split "${PACKED_SPLIT:-even}" --skip-stock --repeats "${REPEATS:-3}" \
      --profile-kernels "${PROFILE:-0}" --packed-selection "${PACKED_SELECTION:-both}" \
      ${LAYER_FLAGS:-} --out "$out" 2>&1 | tee "$out/bench_layer.log" \
      | grep -E "^\||Error|Traceback|T=.*floor|HyScaleDSAttention|profile:|^ +[0-9.]+ ms +[0-9]+x"
    ;;
  accuracy)
    # Two processes (each compiles its kernels once): DSA at 4K and 16K, both loss forms, then
    # CSA and QSA at 16K. The two records land in $out itself (7 files in all, so the device
    # tool brings every one back): copy them to benchmarks/results/; tables in the logs.
    export HYSCALE_RESULTS=$out
    timeout 300 python3 scripts/accuracy.py --model dsa --seq 4096 16384 --loss dense sparse \
      --out "$out" 2>&1 | grep -v Warning | tee "$out/accuracy_dsa.log"
    timeout 210 python3 scripts/accuracy.py --model csa qsa --seq 16384 --loss dense sparse \
      --out "$out/v4_qsa" 2>&1 | grep -v Warning | tee "$out/accuracy_csa_qsa.log"
    ;;
  accuracy-64k)
    # Issue #23 item 4 at 64K: HyScale's DSA layer against float64 alone (stock's plain path
    # builds fp32 score tables that do not fit there), both loss forms; the record in $out.
    HYSCALE_RESULTS=$out timeout "${ACCURACY_TIMEOUT:-300}" python3 scripts/accuracy.py \
      --model dsa --seq 65536 --loss dense sparse --out "$out" 2>&1 | grep -v Warning \
      | tee "$out/accuracy_dsa_64k.log" | tail -40
    ;;
  evaluate)
    # Issue #24 item 3: python -m megatron_hyscale.evaluate on the H200, GLM-5.1 at full
    # attention width (2 layers: the launcher's least, a dense and a MoE layer), EVAL_SEQ
    # tokens, 300 iterations each on the standard library corpus, over calls on one warm
    # machine: PART stock, hyscale (its call writes report.md and the PNGs from both logs),
    # report (again, e.g. after a failed part; or --report-only on the logs anywhere).
    # Measured 2026-12-03 at 16384 (the default): stock 549 ms an iteration, its call 368 s;
    # HyScale 485 ms, 320 s; each call with a 50-70 s checkpoint save at the end, which only
    # EVAL_CHECKPOINT=1 asks for (a run longer than a call: 32K's stock takes ~2.9 s an
    # iteration, ~1,300 s over three calls, more than a session with cuDNN's install).
    # After scripts/gpu_cudnn.sh 1 and 2 (stock cudnn) with .carry/megatron_lm carried.
    [ -f .carry/megatron_lm/pretrain_gpt.py ] || {
      echo "gpu_session.sh evaluate: carry .carry/megatron_lm (scripts/megatron_lm_carry.sh)" >&2
      exit 2; }
    ds=$(python3 -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))")
    [ -f "$ds/Makefile" ] || printf 'default:\n\t@true\n' > "$ds/Makefile"
    part=${1:-}; shift || true
    run_dir=outputs/evaluate_h200  # kept on the machine between calls (ignored by git)
    only=()
    case "$part" in
      stock) only=(--only stock) ;;
      hyscale) rm -rf "$run_dir/ckpt/stock"; only=(--only hyscale) ;;  # 23 GB checkpoints
      report) only=(--report-only) ;;
      *) echo "usage: gpu_session.sh evaluate {stock|hyscale|report}" >&2; exit 2 ;;
    esac
    ckpt=()
    [ "${EVAL_CHECKPOINT:-0}" = 1 ] && ckpt=(--checkpoint-dir "$run_dir/ckpt" --checkpoint-interval 1000)
    # The HyScale run's trained indexer at its last iteration, for the captured-selection stage
    # (kept on the machine: 134 MiB at 16K, over what a call brings back).
    capture=()
    [ "$part" = hyscale ] && capture=(--capture-indexer-at "${EVAL_ITERS:-300}"
                                      --capture-indexer-path "$run_dir/indexer_capture.pt")
    MEGATRON_LM_DIR=$(pwd)/.carry/megatron_lm timeout 580 python3 -m megatron_hyscale.evaluate \
      --config scaled --gpus 1 --num-layers 2 --global-batch-size 1 \
      --seq-length "${EVAL_SEQ:-16384}" --train-iters "${EVAL_ITERS:-300}" \
      --stock-backend cudnn --transformer-impl local --output-dir "$run_dir/out" \
      "${ckpt[@]}" "${capture[@]}" --time-limit 540 --usd-per-gpu-hour "${USD_PER_GPU_HOUR:-3.5}" \
      "${only[@]}" "$@" 2>&1 \
      | grep -v Warning | tail -40
    rc=${PIPESTATUS[0]}
    cp -r "$run_dir/out/." "$out/" 2>/dev/null
    exit "$rc"
    ;;
  captured-selection)
    # Issue #21 item 3: HyTopK on a trained indexer, the one `evaluate hyscale` captured on
    # this warm machine (GLM-5.1's indexer trained on text at EVAL_SEQ tokens): with and
    # without exact key-tile pruning (the share pruned, output identical), beside
    # table-then-select and cuDNN's selection (after gpu_cudnn.sh 1 and 2) in the same run.
    cap=${CAPTURE:-outputs/evaluate_h200/indexer_capture.pt}
    [ -f "$cap" ] || { echo "gpu_session.sh captured-selection: no $cap (run" \
      "gpu_session.sh evaluate hyscale on this machine first)" >&2; exit 2; }
    HYSCALE_RESULTS=$out timeout 300 python3 scripts/bench_selection.py --captured "$cap" \
      --reps 3 --methods hytopk hytopk_prune table cudnn --tag _captured --out "$out" 2>&1 \
      | grep -v -i warn \
      | tee "$out/bench_selection_captured.log" | grep -E "captured|Error" ;;
  reliability)
    # Issue #23 on the GPU: checkpoint round trips (stock <-> HyScale specs, DSA, V4, QSA),
    # exact resume after SIGKILL, the public failure modes (the 256K HyTopK test included) and
    # the soak, on CUDA (testing.training picks it when there is one); slow cases included.
    # One pytest a file, each test bounded (pytest-timeout, on the image), so a slow case cannot
    # swallow the other files' summaries; the first failures' messages in the call's output.
    per_test=()
    python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${PER_TEST_TIMEOUT:-150}")
    rc=0
    for f in ${*:-tests/reliability/test_checkpoint_roundtrip.py tests/reliability/test_exact_resume.py \
               tests/reliability/test_public_failure_modes.py tests/reliability/test_soak.py}; do
      timeout "${RELIABILITY_TIMEOUT:-240}" python3 -m pytest -q -rfEs --tb=short "${per_test[@]}" \
        -m "slow or not slow" "$f" -p no:cacheprovider > "$out/current.log" 2>&1 || rc=1
      cat "$out/current.log" >> "$out/tests.log"
      echo "$f: $(verdict "$out/current.log")" | tee -a "$out/summary.txt"
      grep -E "^(FAILED|ERROR)|^E  " "$out/current.log" | cut -c1-300 | head -12
    done
    rm -f "$out/current.log"
    exit $rc
    ;;
  profile-layers)
    # HyScale's layers only (the baselines were timed beside them before), one timed step
    # each and one profiled step: the 20 operators with the most device time. PROFILE_MODELS:
    # which (default "qsa dsa"; also csa, hca: PROFILE_V4_T, default 131072); PROFILE_FLAGS:
    # more bench_layer flags for the DSA layer (e.g. "--hytopk-scores-sm90
    # --compare-own-kernels --compare-indexer-target": the loss's target from the attention
    # backward against its own pass, each row profiled). First, that the DSA and HCA layers'
    # steps run the Gluon forward and backward at all (no fallback, no warning);
    # PROFILE_TESTS=0 skips those tests.
    if [ "${PROFILE_TESTS:-1}" != 0 ]; then
      timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
        tests/layers/test_layer_hopper_kernels_gpu.py > "$out/tests.log" 2>&1
      echo "layer kernels test rc=$?: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
      grep -h -E "^(FAILED|ERROR|E  )" "$out/tests.log" | cut -c1-300 | head -12
    fi
    for model in ${PROFILE_MODELS:-qsa dsa}; do
      seq=${PROFILE_QSA_T:-524288} budget=200 flags=()
      case $model in
        dsa) seq=${PROFILE_DSA_T:-131072} budget=${PROFILE_DSA_S:-240}
             read -r -a flags <<< "${PROFILE_FLAGS:-}" ;;
        csa|hca) seq=${PROFILE_V4_T:-131072} budget=200 ;;
      esac
      timeout $budget python3 scripts/bench_layer.py --model "$model" --seq "$seq" \
        --repeats 1 --skip-stock --profile-kernels 20 "${flags[@]}" --out "$out" 2>&1 \
        | tee "$out/profile_$model.full.log" | grep -v -i warn \
        | grep -E "profile|ms .*x |^\| T|^\| [0-9]|Error" | tee "$out/profile_$model.log"
      # the fast paths declined or disabled (each row's also in the JSON: hyscale_warnings)
      grep -o "HyScale: .*" "$out/profile_$model.full.log" | sort | uniq -c | cut -c1-400
    done ;;
  models)
    models=(); seqs=()
    for a in "$@"; do case $a in csa|hca|qsa) models+=("$a") ;; *) seqs+=("$a") ;; esac; done
    [ ${#models[@]} -gt 0 ] || models=(csa hca qsa)
    for model in "${models[@]}"; do
      # Default lengths, measured on one H200 (2026-11-30): CSA / HCA to 256K (HyScale 100.5 /
      # 98.9 GiB), their baseline to 128K (CSA's 102.3 GiB; ~214 at 256K by
      # launch/layer_memory.py); QSA and its baseline to 512K (95.1 / 95.1 GiB).
      run=("${seqs[@]}") limit=131072 budget=240
      [ "$model" = qsa ] && limit=524288 budget=300
      if [ ${#run[@]} -eq 0 ]; then
        run=(32768 65536 131072 262144)
        [ "$model" = qsa ] && run=(131072 262144 524288)
      fi
      # LAYER_FLAGS: more bench_layer flags (e.g. "--attention-lockstep off": QSA without its
      # default dK/dV lockstep; --loss-lockstep).
      # shellcheck disable=SC2086  # flags split on purpose
      timeout $budget python3 scripts/bench_layer.py --model $model --seq "${run[@]}" \
        --repeats 1 --stock-max-seq $limit ${LAYER_FLAGS:-} --out "$out" 2>&1 | grep -v Warning \
        | grep -E -A12 "^\| T|Error" | tee "$out/bench_layer_$model.log"
    done
    ;;
  memory)
    for spec in ${*:-csa:32768 hca:32768 qsa:131072}; do
      IFS=: read -r model seq variant <<< "$spec"
      flag=(); [ "${variant:-}" = baseline ] && flag=(--baseline)
      timeout 150 python3 scripts/profile_layer_memory.py --model "$model" --seq "$seq" \
        "${flag[@]}" --top 20 --out "$out" 2>&1 | grep -v Warning \
        | tee -a "$out/profile_layer_memory.log"
    done
    ;;
  qsa-selection)
    seq=${1:-524288}
    timeout 200 python3 scripts/bench_selection.py --sweep --T "$seq" --configs qsa --reps 2 \
      --out "$out" 2>&1 | grep -E "^sweep|Error" | tee "$out/bench_selection_qsa_sweep.log"
    timeout 150 python3 scripts/bench_selection.py --T "$seq" --configs qsa --reps 2 \
      --secondary-max-T "$seq" --methods hytopk scoreonly finish --tag _qsa --out "$out" 2>&1 \
      | tail -5 | tee "$out/bench_selection_qsa.log"
    ;;
  fp8)
    # The FP8 indexer (ops.hytopk precision="fp8"): its GPU tests (exact on integer inputs,
    # equal to the reference on the same quantized random inputs; the Gluon fp8 kernels'
    # too), then speed against the bf16 GEMM floor with the overlap against bf16 selection,
    # random and trained-like inputs (FP8_METHODS: which; the Gluon ones run on Hopper).
    timeout 150 python3 -m pytest -q -m gpu tests/ops/test_hytopk_fp8.py -p no:cacheprovider \
      2>&1 | tail -8 | tee "$out/tests.log"
    timeout 150 python3 -m pytest -q -rfE -m gpu tests/ops/test_indexer_scores_sm90.py \
      tests/ops/test_hytopk_sm90.py -k fp8 -p no:cacheprovider 2>&1 | tail -8 \
      | tee "$out/tests_sm90_fp8.log"
    # shellcheck disable=SC2086  # methods split on purpose
    timeout 240 python3 scripts/bench_selection.py --configs dsv32 glm51 --T 16384 65536 131072 \
      --reps 2 --methods ${FP8_METHODS:-hytopk hytopk_fp8 hytopk_fp8_scores_sm90 scoreonly \
      scoreonly_fp8 scoreonly_sm90_fp8} \
      --inputs random --tag _fp8 --out "$out" 2>&1 | tail -30 | tee "$out/bench_selection_fp8.log"
    timeout 150 python3 scripts/bench_selection.py --configs dsv32 --T 131072 --reps 2 \
      --methods hytopk hytopk_fp8 --inputs structured recency --tag _fp8_trained --out "$out" \
      2>&1 | tail -12 | tee "$out/bench_selection_fp8_trained.log"
    ;;
  indexer-target)
    # Issue #20 item 3: the sparse indexer loss's target from the attention backward's dQ
    # kernel. Its GPU tests (op, layer), then the dQ kernel with and without the target beside
    # the target pass (bench_indexer_loss's "from dQ" columns, GLM-5.1 and V3.2), then the
    # GLM-5.1 layer on HyScale's own kernels with the separate target pass (hyscale_own) and
    # with the target from the backward (hyscale_own_target_in_bwd).              (~8 min)
    : > "$out/failures.log"
    HYSCALE_FAILURE_LOG=$(cd "$out" && pwd)/failures.log; export HYSCALE_FAILURE_LOG
    export HYSCALE_RESULTS=$out/results  # the scripts' records come back with the stage
    timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider \
      tests/ops/test_attention_target_from_dq.py tests/ops/test_attention_indexer_loss.py \
      tests/layers/test_dsa_indexer_target.py > "$out/tests.log" 2>&1
    rc=$?
    echo "tests rc=$rc: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
    timeout 150 python3 scripts/bench_indexer_loss.py --t 32768 131072 --shapes glm51 v32 \
      --reps 2 --warmup 1 --no-library --no-tilelang --out "$out" 2>&1 | grep -v -i warn \
      | tee "$out/bench_indexer_loss.log" | grep -E "from the dQ|Error"
    timeout 200 python3 scripts/bench_layer.py --model dsa --seq 32768 131072 --skip-stock \
      --hyscale-kernel-backend own --compare-own-kernels --compare-indexer-target --repeats 2 \
      --out "$out" 2>&1 | grep -v -i warn | tail -12 | tee "$out/bench_layer.log"
    exit $rc
    ;;
  loss-variants)
    # Issue #20: IndexerLossKernelOptions' variants beside the default (each one's largest
    # difference from it recorded), then the dense loss's Triton path. Records in $out/results.
    # LOSS_VARIANTS: the names to time (kl_in_bwd: the KL from the indexer backward).
    timeout 240 python3 scripts/bench_indexer_loss.py --t 32768 131072 --shapes glm51 v32 \
      --variants ${LOSS_VARIANTS:-kl_in_bwd fused one_pass} \
      --out "$out" 2>&1 | grep -v -i warn | grep -E "T=|Error|failed" \
      | tee "$out/bench_indexer_loss_variants.log"
    [ "${LOSS_DENSE:-1}" = 0 ] && exit 0  # LOSS_DENSE=0: the variants alone
    timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
      tests/ops/test_indexer_loss_dense_triton.py > "$out/tests_dense.log" 2>&1
    echo "dense tests rc=$?: $(verdict "$out/tests_dense.log")" | tee "$out/summary.txt"
    timeout 150 python3 scripts/bench_indexer_loss_dense.py --deterministic 2>&1 \
      | grep -v -i warn | tail -12 | tee "$out/bench_indexer_loss_dense.log"
    ;;
  loss-bwd-sm90)
    smoke_then_tests tests/ops/test_indexer_loss_bwd_sm90_gpu.py "exact and 32" || exit 1
    # One process a shape and length: V3.2 at 128K after a shorter run in the same process did
    # not fit the H100's 80 GB. LOSS_BWD_RUNS: which (shape:T), default all four.
    for run in ${LOSS_BWD_RUNS:-glm51:32768 glm51:131072 v32:32768 v32:131072}; do
      timeout 150 python3 scripts/bench_indexer_loss.py --t "${run#*:}" --shapes "${run%%:*}" \
        --variants triton_bwd bwd_sm90_lockstep no_kl_in_bwd bwd_sm90_no_kl \
        --out "$out/${run/:/_}" 2>&1 \
        | grep -v -i warn | grep -E "T=|Error|failed" | tee -a "$out/bench_indexer_loss_variants.log"
    done ;;
  selection-lse)
    if [ "${LSE_TESTS:-1}" != 0 ]; then  # LSE_TESTS=0: the timings alone
      : > "$out/failures.log"
      HYSCALE_FAILURE_LOG=$(cd "$out" && pwd)/failures.log; export HYSCALE_FAILURE_LOG
      # shellcheck disable=SC2086  # files split on purpose
      timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
        ${LSE_TEST_FILES:-tests/ops/test_attention_indexer_loss.py \
        tests/layers/test_dsa_indexer_target.py tests/layers/test_layer_hopper_kernels_gpu.py} \
        > "$out/tests.log" 2>&1
      echo "tests rc=$?: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
      grep -h -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-300 | head -20
    fi
    for run in ${LSE_RUNS:-glm51:32768 glm51:131072 v32:32768 v32:131072}; do
      # shellcheck disable=SC2086  # variants split on purpose
      timeout "${LSE_RUN_S:-150}" python3 scripts/bench_indexer_loss.py --t "${run#*:}" \
        --shapes "${run%%:*}" --variants selection_lse ${LSE_VARIANTS:-} --out "$out/${run/:/_}" 2>&1 \
        | grep -v -i warn | grep -E "T=|Error|failed" | tee -a "$out/bench_indexer_loss_variants.log"
    done
    [ "${LSE_LAYER:-1}" = 0 ] && exit 0  # LSE_LAYER=0: no layer
    # shellcheck disable=SC2086  # flags split on purpose
    timeout "${LSE_LAYER_S:-300}" python3 scripts/bench_layer.py --model dsa \
      --seq ${LSE_LAYER_T:-131072} --repeats "${REPEATS:-2}" --skip-stock \
      --compare-selection-lse ${LSE_LAYER_FLAGS:-} --out "$out" 2>&1 | grep -v Warning \
      | grep -E -A8 "^\| T|Error" | tee "$out/bench_layer.log"
    ;;
  norms)
    timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/ops/test_rms_norm.py \
      tests/ops/test_rope.py > "$out/tests.log" 2>&1
    echo "tests rc=$?: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
    grep -h -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-300 | head -20
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout 200 python3 scripts/bench_rms_norm.py --seq ${NORMS_T:-32768 131072} --reps 3 2>&1 \
      | grep -v -i warn | grep -E "^T=|matmul|Error|error" | tee "$out/bench_rms_norm.log" ;;
  scores-sm90)
    # Issue #21 item 1.
    smoke_then_tests tests/ops/test_indexer_scores_sm90.py "adversarial and 64" || exit 1
    timeout 240 python3 scripts/bench_selection.py --T 16384 131072 --configs dsv32 glm51 \
      --reps 3 --methods scoreonly scoreonly_sm90 scoreonly_sm90_free --tag _scores_sm90 \
      --out "$out" 2>&1 | grep -v -i warn | grep -E "^random|Error|error" \
      | tee "$out/bench_selection_scores_sm90.log"
    # ARG ncu: then both scores-only kernels under Nsight Compute (~2 min), packed inside.
    if [ "${1:-}" = ncu ]; then
      NCU_CASES="dsv32:65536:scoreonly_sm90 dsv32:65536:scoreonly" OUT=$out bash "$0" \
        ncu-selection
    fi ;;
  filter-sm90)
    # Issue #21 items 1-2: HyTopK on the Gluon scores (HyTopKOptions.scores_sm90): the
    # filter's GPU test first under a short timeout (an mbarrier fault hangs), then the op's
    # GPU tests (~2 min), then timed beside the default HyTopK (FILTER_BENCH_S, ~5 min).
    smoke_then_tests tests/ops/test_hytopk_sm90.py "test_gluon_filter and 64" || exit 1
    # The table epilogue (the sample on the Gluon kernel, scores_sm90_sample_table).
    timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
      tests/ops/test_indexer_scores_sm90.py -k table > "$out/tests_table.log" 2>&1
    echo "table tests rc=$?: $(verdict "$out/tests_table.log")" | tee -a "$out/summary.txt"
    grep -h -E "^(FAILED|ERROR)" "$out/tests_table.log" | cut -c1-300 | head -10
    # cuDNN's selection in the same run where scripts/gpu_cudnn.sh installed it.
    library=()
    [ -d .carry/site/nvidia_cutlass_dsl ] && library=(cudnn)
    # FILTER_CONFIGS, FILTER_METHODS: fewer configs or methods (cuDNN's is added as above).
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout ${FILTER_BENCH_S:-300} python3 scripts/bench_selection.py --T ${FILTER_T:-16384 131072} \
      --configs ${FILTER_CONFIGS:-dsv32 glm51} --reps 3 --methods ${FILTER_METHODS:-hytopk \
      hytopk_scores_sm90 hytopk_scores_sm90_gluon_sample scoreonly_sm90} "${library[@]}" \
      --tag _filter_sm90 \
      --out "$out" 2>&1 | grep -v -i warn | grep -E "^random|Error|error" \
      | tee "$out/bench_selection_filter_sm90.log" ;;
  sample-pick)
    # PART: tests (~3 min), bench (~6 min), or both in turn (default; over one call's limit
    # on a cold machine). The scan slots' filter first under a short timeout (a fault may
    # hang): without it no scan method and no phases (they time its filter too). PICK_TESTS_S,
    # PICK_BENCH_S: the tests' and the bench's limits; PICK_TESTS_K: fewer tests (a -k
    # expression); PICK_CONFIGS: fewer configs; PICK_PHASES=0: no phases.
    part=${1:-all}
    scan=(hytopk_scores_sm90_scan_slots hytopk_scores_sm90_radix_pick_key
          hytopk_scores_sm90_scan_slots_key)
    timeout 150 python3 -m pytest -x -q -rfE -p no:cacheprovider -m gpu \
      tests/ops/test_hytopk_sm90.py -k "gluon_filter_matches and False-True" \
      > "$out/smoke.log" 2>&1 || scan=()
    echo "scan slots smoke: $(verdict "$out/smoke.log")" | tee "$out/summary.txt"
    grep -h -E "^(FAILED|ERROR)" "$out/smoke.log" | cut -c1-300 | head -5
    if [ "$part" != bench ]; then
      timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/ops/test_row_rank.py \
        > "$out/tests.log" 2>&1
      echo "row_rank tests rc=$?: $(verdict "$out/tests.log")" | tee -a "$out/summary.txt"
      timeout "${PICK_TESTS_S:-300}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
        tests/ops/test_hytopk_sm90.py -k "${PICK_TESTS_K:-sample_table or gluon_filter or real_size}" \
        >> "$out/tests.log" 2>&1
      echo "sample table, filter, op tests rc=$?: $(verdict "$out/tests.log")" \
        | tee -a "$out/summary.txt"
      grep -h -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-300 | head -10
    fi
    [ "$part" = tests ] && exit 0
    library=()
    [ -d .carry/site/nvidia_cutlass_dsl ] && library=(cudnn cudnn_key)
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout ${PICK_BENCH_S:-330} python3 scripts/bench_selection.py --T ${PICK_T:-16384 65536 131072} \
      --configs ${PICK_CONFIGS:-glm51 dsv32 norelu} --reps 3 --methods hytopk hytopk_default \
      hytopk_default_key \
      hytopk_scores_sm90_gluon_sample hytopk_scores_sm90_radix_pick "${scan[@]}" "${library[@]}" \
      --tag _sample_pick --out "$out" 2>&1 \
      | grep -v -i warn | grep -E "^random|Error|error" | tee "$out/bench_selection_pick.log"
    [ ${#scan[@]} -gt 0 ] || exit 1
    [ "${PICK_PHASES:-1}" = 0 ] && exit 0  # PICK_PHASES=0: no phases
    timeout 150 python3 scripts/bench_selection.py --T 131072 --configs glm51 norelu --reps 2 \
      --methods hytopk_scores_sm90 --tag _pick_phases --out "$out" 2>&1 | grep -v -i warn \
      | grep -E "^random|Error|error|sample" | tee "$out/bench_selection_phases.log" ;;
  mma-ahead)
    # Issue #21 items 1-2: each Gluon consumer's next key tile's product issued before its
    # last tile's epilogue (HyTopKOptions.scores_sm90_mma_ahead, scores_sm90_stages), and the
    # folded query's parts part-major (scores_sm90_folded_part_major). tests: the smallest
    # row-max cases first (a fault may hang), then the kernel tests, then the filter's and the
    # op's. bench: timed beside today's default (key order, the layers') in the same process,
    # beside the same path without it called the same way (the op added 1.3-1.9 ms at 16K),
    # cuDNN's where installed, and the scores alone beside the default scores. AHEAD_T,
    # AHEAD_CONFIGS, AHEAD_BENCH_S: the bench's lengths, configs and limit.
    case "${1:-}" in
      tests)
        smoke_then_tests tests/ops/test_indexer_scores_sm90.py \
          "test_products_ahead_exact and 135 or test_folded_part_major_exact and 135" \
          "products_ahead or stages or part_major" || exit 1
        # AHEAD_OP_TESTS: the op tests' -k (default: also the real-size ones); the three
        # steps' limits (120 + 360 + AHEAD_TESTS_S) must fit the caller's.
        timeout "${AHEAD_TESTS_S:-100}" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
          tests/ops/test_hytopk_sm90.py \
          -k "${AHEAD_OP_TESTS:-gluon_filter_matches or real_size or folded_gluon}" \
          > "$out/tests_op.log" 2>&1
        echo "filter and op tests rc=$?: $(verdict "$out/tests_op.log")" \
          | tee -a "$out/summary.txt"
        grep -h -E "^(FAILED|ERROR)" "$out/tests_op.log" | cut -c1-300 | head -10
        exit 0 ;;
      bench) ;;
      *) echo "usage: bash scripts/gpu_session.sh mma-ahead {tests|bench}" >&2; exit 2 ;;
    esac
    # A fault may hang: the smallest cases of both first (bench alone, without tests before).
    smoke tests/ops/test_indexer_scores_sm90.py \
      "test_products_ahead_exact and 135 and 4- or test_folded_part_major_exact and 135" || exit 1
    library=()
    [ -d .carry/site/nvidia_cutlass_dsl ] && library=(cudnn_key)
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout "${AHEAD_BENCH_S:-270}" python3 scripts/bench_selection.py \
      --T ${AHEAD_T:-16384 65536 131072} --configs ${AHEAD_CONFIGS:-glm51 dsv32} \
      --reps 3 --methods hytopk_default_key hytopk_scores_sm90_scan_slots_key \
      hytopk_scores_sm90_ahead_key hytopk_scores_sm90_ahead6_key "${library[@]}" \
      --tag _mma_ahead --out "$out" 2>&1 \
      | grep -v -i warn | grep -E "^random|Error|error" | tee "$out/bench_selection_ahead.log"
    # The folded query (no cuDNN path without ReLU): the product ahead, the parts part-major,
    # both.
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout 130 python3 scripts/bench_selection.py --T ${AHEAD_T:-16384 65536 131072} \
      --configs norelu --reps 3 --methods hytopk_default_key hytopk_scores_sm90_scan_slots_key \
      hytopk_scores_sm90_ahead_key hytopk_scores_sm90_part_major_key \
      hytopk_scores_sm90_part_major_ahead_key \
      --tag _part_major --out "$out" 2>&1 | grep -v -i warn \
      | grep -E "^random|Error|error" | tee "$out/bench_selection_part_major.log"
    timeout 80 python3 scripts/bench_selection.py --T 131072 --configs glm51 norelu --reps 3 \
      --methods scoreonly_sm90 scoreonly_sm90_ahead scoreonly_sm90_part_major \
      --tag _scores_ahead --out "$out" 2>&1 \
      | grep -v -i warn | grep -E "^random|Error|error" | tee "$out/bench_selection_scores.log"
    # At 16K the op (hytopk_default_key) took 1.3-1.9 ms more than the same path called
    # directly (_scan_slots_key) on 2026-12-07, three repetitions each: ten here.
    timeout 80 python3 scripts/bench_selection.py --T 16384 --configs glm51 dsv32 --reps 10 \
      --methods hytopk_default_key hytopk_scores_sm90_scan_slots_key \
      hytopk_scores_sm90_ahead_key --tag _op_16k --out "$out" 2>&1 | grep -v -i warn \
      | grep -E "^random|Error|error" | tee "$out/bench_selection_op_16k.log"
    ;;
  direct-select)
    # Issue #21 item 2: the survivors' select written straight to the rows (no in-place
    # compaction, HyTopKOptions.scores_sm90_direct_select). Its tests (the kernel against the
    # compacting select at real sizes, the op against the reference), then timed beside the
    # compacting select in key order (the layers'), then the phases at 128K (select_key,
    # select_key_direct: the two selects alone over the same scan-slot buffers).
    stage_tests 150 "select_rows or (real_size and True-False-True)" \
      tests/ops/test_survivor_select.py tests/ops/test_hytopk_sm90.py || exit 1
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout "${DIRECT_BENCH_S:-240}" python3 scripts/bench_selection.py \
      --T ${DIRECT_T:-16384 65536 131072} --configs glm51 norelu --reps 3 --rounds 2 \
      --methods hytopk_scores_sm90_scan_slots_key hytopk_scores_sm90_direct_key \
      --tag _direct_select --out "$out" 2>&1 | grep -v -i warn \
      | grep -E "^random|Error|error" | tee "$out/bench_selection_direct.log"
    timeout 150 python3 scripts/bench_selection.py --T 131072 --configs glm51 norelu --reps 2 \
      --methods hytopk_scores_sm90 --tag _direct_phases --out "$out" 2>&1 | grep -v -i warn \
      | grep -E "^random|Error|error|select" | tee "$out/bench_selection_direct_phases.log"
    ;;
  selection-rounds)
    # The layers' selection pairs (hytopk_default_key, cudnn_key) timed in ROUNDS rotated
    # rounds: on 2026-12-07 an H100's times moved 10-20% between processes and the first method
    # after a length change ran 3-4% slower, which decided V3.2's 64K entry of the measured
    # table by 0.3%.
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout "${ROUNDS_S:-320}" python3 scripts/bench_selection.py \
      --T ${ROUNDS_T:-16384 65536 131072} --configs glm51 dsv32 norelu --reps 3 \
      --rounds "${ROUNDS:-2}" --methods hytopk_default_key cudnn_key --tag _rounds \
      --out "$out" 2>&1 | grep -v -i warn | grep -E "^random|Error|error" \
      | tee "$out/bench_selection_rounds.log"
    ;;
  head-sum-transpose)
    # Issue #21 item 1: the head sum's quad step as a layout change
    # (HyTopKOptions.scores_sm90_head_sum_transpose). Its tests (bitwise the plain kernels'
    # scores, table and survivors on random inputs; the op against the reference), then timed
    # beside today's default and cuDNN's selection (the strongest stock path on Hopper) in key
    # order, and the scores alone, in rotated rounds.
    stage_tests "${TRANSPOSE_TESTS_S:-420}" \
      "head_sum_transpose or (real_size and True-True-True-True)" \
      tests/ops/test_indexer_scores_sm90.py tests/ops/test_hytopk_sm90.py || exit 1
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout "${TRANSPOSE_BENCH_S:-300}" python3 scripts/bench_selection.py \
      --T ${TRANSPOSE_T:-16384 131072} --configs glm51 dsv32 --reps 3 --rounds 2 \
      --methods hytopk_scores_sm90_current_key hytopk_scores_sm90_transpose_key cudnn_key \
      scoreonly_sm90_ahead scoreonly_sm90_transpose --tag _transpose --out "$out" 2>&1 \
      | grep -v -i warn | grep -E "^random|Error|error" | cut -c1-400 \
      | tee "$out/bench_selection_transpose.log"
    ;;
  sample-growth)
    # Issue #21: the thresholds' sample grown past 128K keys (scores_sm90_sample_min_rank, a
    # row's threshold at about its 48th best sampled key) against the fixed 2048-key sample
    # (hytopk_scores_sm90_fixed_sample_key) and a sample twice as wide from 64K keys
    # (hytopk_scores_sm90_rank96_key), beside cuDNN's selection in key order, with the
    # redone rows' share and the default path's steps (path_ms: rows 2048 .. 4095 no longer
    # redone at 16K). 256K: ~0.6 s (GLM-5.1) to 1.2 s (V3.2) a call on an H100.
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout "${GROWTH_S:-420}" python3 scripts/bench_selection.py \
      --T ${GROWTH_T:-16384 131072 262144} --configs glm51 dsv32 --reps 2 --rounds 2 \
      --methods hytopk_scores_sm90_current_key hytopk_scores_sm90_fixed_sample_key \
      hytopk_scores_sm90_rank96_key cudnn_key \
      --tag _sample_growth --out "$out" 2>&1 | grep -v -i warn \
      | grep -E "^random|Error|error" | cut -c1-400 | tee "$out/bench_selection_sample_growth.log"
    ;;
  path-phases)
    # Issue #21: the default path's steps timed apart (hytopk_scores_sm90_current_key's path_ms:
    # fold, sample, filter, select, redo, total) beside cuDNN's selection in key order, warnings
    # kept so that a kernel falling back to another shows; then the folded phases (their sample_gluon took 36 ms on 2026-12-07
    # against 9.4 before: a Gluon table's fallback?), warnings kept.
    # shellcheck disable=SC2086  # lengths split on purpose
    timeout "${PATH_S:-300}" python3 scripts/bench_selection.py --T ${PATH_T:-16384 131072} \
      --configs glm51 dsv32 norelu --reps 3 --methods hytopk_scores_sm90_current_key cudnn_key \
      --tag _path --out "$out" 2>&1 | tee "$out/bench_selection_path.log" \
      | grep -E "^random|Error|error|[Ww]arn|fell|instead" | cut -c1-600
    timeout 150 python3 scripts/bench_selection.py --T 131072 --configs norelu --reps 2 \
      --methods hytopk_scores_sm90 --tag _folded_phases --out "$out" 2>&1 \
      | tee "$out/bench_selection_folded_phases.log" \
      | grep -E "^random|Error|error|[Ww]arn|fell|instead|sample" | cut -c1-600
    ;;
  key-tma)
    # Issue #21: the key tiles through TMA. The TMA cases of the select-variant tests first
    # (integer inputs = the reference; random bf16 = the default kernel bit for bit).
    timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu \
      tests/ops/test_hytopk_gpu.py tests/ops/test_hytopk_fp8.py -k key_tma \
      > "$out/tests.log" 2>&1
    echo "tests rc=$?: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
    grep -h -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-300 | head -20
    timeout 280 python3 scripts/bench_selection.py --T 16384 131072 \
      --configs dsv32 glm51 norelu --reps 3 \
      --methods hytopk hytopk_key_tma scoreonly scoreonly_key_tma --tag _key_tma \
      --out "$out" 2>&1 | grep -v -i warn | grep -E "^random|Error|error" \
      | tee "$out/bench_selection_key_tma.log" ;;
  fwd-ws)
    # Issue #20 item 1: a small case of the warp-specialized kernel first.
    smoke_then_tests tests/ops/test_sparse_mla_fwd_sm90_gpu.py \
      "test_matches_reference and 64-130-True-ws" || exit 1
    # The previous forwards (plain Gluon; Triton for CSA), the warp-specialized one (the
    # default since 2026-12-05) in the same process on the same inputs (--fwd-also),
    # FlashMLA's when gpu_cudnn.sh installed it.
    timeout 300 python3 scripts/bench_attention.py --t 16384 65536 131072 \
      --shapes glm51 v32 csa --fwd-only --fwd-kernel gluon --fwd-also gluon_ws --reps 3 \
      --no-stock --no-tilelang \
      --out "$out" 2>&1 | grep -v -i warn | tee "$out/bench_attention_fwd_ws.log" \
      | grep -E "T=|Error" ;;
  bwd-sm90)
    # Issue #20 item 2: a small case of the warp-specialized backward first.
    smoke_then_tests tests/ops/test_sparse_mla_bwd_sm90_gpu.py \
      "test_matches_the_triton_backward and 64-130-True" || exit 1
    # The Triton backward, the warp-specialized one (the default since 2026-12-05) in the same
    # process on the same inputs and output gradient (--bwd-also), cuDNN's when gpu_cudnn.sh
    # installed it.
    timeout 480 python3 scripts/bench_attention.py --t 16384 65536 131072 \
      --shapes glm51 v32 csa glm51-tp2 --no-deterministic --bwd-kernel triton --bwd-also sm90 \
      --reps 3 --no-stock \
      --no-tilelang --out "$out" 2>&1 | grep -v -i warn \
      | tee "$out/bench_attention_bwd_sm90.log" | grep -E "T=|Error" ;;
  bwd-atomics)
    # Issue #20 item 2: the backward's dK atomics 16 bytes wide (bwd_dk_vec4) and its
    # lockstep mode (bwd_lockstep), same process, same inputs and output gradient as the
    # 8-byte default, cuDNN's beside them.
    case "${1:-}" in
      tests)
        # The 8-byte default passed every case on 2026-12-05: the new forms' cases only.
        smoke_then_tests tests/ops/test_sparse_mla_bwd_sm90_gpu.py \
          "(test_matches_the_triton_backward and red16-64-130-True) or (test_lockstep_over_several_waves and 64-300)" \
          "not red8" || exit 1 ;;
      bench)
        # shellcheck disable=SC2086  # shape names, split on purpose
        timeout 560 python3 scripts/bench_attention.py --t 16384 131072 \
          --shapes ${BENCH_SHAPES:-glm51 csa} --no-deterministic --bwd-kernel sm90 \
          --bwd-also sm90_red16 sm90_lockstep sm90_lockstep2 --reps 3 --no-stock \
          --no-tilelang --out "$out" 2>&1 | grep -v -i warn \
          | tee "$out/bench_attention_bwd_atomics.log" | grep -E "T=|Error" ;;
      fwd)
        # The forward in lockstep (fwd_lockstep, compiled only until now): its GPU tests (a
        # smoke case first), then timed beside the warp-specialized default and FlashMLA's.
        smoke_then_tests tests/ops/test_sparse_mla_fwd_sm90_gpu.py \
          "test_lockstep_over_several_waves and 64-300" "ws_lockstep or lockstep_over" \
          || exit 1
        # shellcheck disable=SC2086  # shape names, split on purpose
        timeout 300 python3 scripts/bench_attention.py --t 16384 131072 \
          --shapes ${BENCH_SHAPES:-glm51 v32 csa} --fwd-only --fwd-kernel gluon_ws \
          --fwd-also gluon_ws_lockstep --reps 3 --no-stock --no-tilelang --out "$out" 2>&1 \
          | grep -v -i warn | tee "$out/bench_attention_fwd_lockstep.log" \
          | grep -E "T=|Error" ;;
      ncu)
        NCU_ATTN_CASES=${NCU_ATTN_CASES:-"glm51:131072:sm90_red16 glm51:131072:sm90_lockstep"} \
          OUT=$out/ncu bash "$0" ncu-attention | tail -3
        tar -xzf "$out/ncu/ncu-attention.tgz" -C "$out" ./results 2>/dev/null
        rm -rf "$out/ncu" ;;
      *) echo "usage: gpu_session.sh bwd-atomics {tests|bench|fwd|ncu}" >&2; exit 2 ;;
    esac ;;
  ncu-selection)
    # Issue #21: where HyTopK's time goes, from the hardware counters (Nsight Compute, full
    # set: warp stall reasons, issue-slot use, per-SASS-line samples) for one call of each
    # NCU_CASES entry (config:T:method, scripts/profile_selection.py). Per case the details
    # and SASS pages as CSV (the .ncu-rep stays on the machine: too large to bring back),
    # summarised into a record by scripts/ncu_summary.py.
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    [ -n "$ncu_bin" ] || { echo "gpu_session.sh ncu-selection: no ncu on this machine" >&2
      exit 1; }
    cases=()
    for c in ${NCU_CASES:-norelu:131072:hytopk norelu:131072:scoreonly dsv32:65536:scoreonly \
               dsv32:65536:hytopk}; do
      IFS=: read -r cfg t method <<< "$c"
      name=${cfg}_${t}_${method} rep=/tmp/gpu_session/ncu_${cfg}_${t}_${method}
      timeout 240 "$ncu_bin" --profile-from-start off \
        --kernel-name 'regex:_hytopk_kernel|_indexer_row_max_kernel' \
        --launch-count 1 --set full --clock-control none -f -o "$rep" \
        python3 scripts/profile_selection.py --config "$cfg" --T "$t" --method "$method" \
        > "$out/$name.log" 2>&1
      echo "$name rc=$?: $(grep -v -i warn "$out/$name.log" | tail -1)"
      "$ncu_bin" --import "$rep.ncu-rep" --page details --csv > "$out/${name}_details.csv" 2>&1
      "$ncu_bin" --import "$rep.ncu-rep" --page source --csv --print-source sass \
        > "$out/${name}_sass.csv" 2>&1
      cases+=("$name")
    done
    python3 scripts/ncu_summary.py --dir "$out" --cases "${cases[@]}" \
      --commit "${HYSCALE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" \
      --date "$(date -u '+%Y-%m-%d %H:%M UTC')" --command "bash scripts/gpu_session.sh $stage" \
      --out "$HYSCALE_RESULTS/$(date -u +%F)-nvidia-h200-ncu_selection.json"
    ;;
  loss-bwd-probe)
    # shellcheck disable=SC2086  # lengths split on purpose
    # PROBE_KERNELS: the backward kernels each case runs on (default both: triton sm90).
    timeout 300 python3 scripts/probe_indexer_bwd.py --t ${PROBE_T:-32768 131072} \
      --kernels ${PROBE_KERNELS:-triton sm90} 2>&1 | grep -v -i warn | tee "$out/probe.log"
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    [ -n "$ncu_bin" ] || { echo "gpu_session.sh loss-bwd-probe: no ncu on this machine" >&2
      exit 1; }
    raw=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_red.sum
    raw=$raw,lts__t_sectors_op_read.sum,lts__t_sector_op_red_hit_rate.pct
    raw=$raw,lts__t_sector_op_read_hit_rate.pct,gpu__time_duration.sum
    # The first backward launch: the default case's warm-up (its record goes to /tmp).
    HYSCALE_RESULTS=/tmp/gpu_session/ncu_probe timeout 200 "$ncu_bin" --kernel-name \
      regex:_bwd_kernel --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --metrics "$raw" --clock-control none \
      python3 scripts/probe_indexer_bwd.py --t 131072 --shapes glm51 --reps 1 --kernels sm90 \
      --cases spread > "$out/ncu_bwd.log" 2>&1
    echo "ncu rc=$?"
    # The L2 table's reduction rows: whether dk's atomics hold the L2 at its peak.
    grep -E "dram__|lts__|gpu__time|Throughput|Stall|Warp Cycles|Hit Rate|Busy|Issue|Red" \
      "$out/ncu_bwd.log" | head -80
    ;;
  ncu-attention)
    # Issue #20 item 2: where the sparse-attention backward's time goes, HyScale's against
    # cuDNN's on the same inputs. Per case: its kernels by time (profile_attention.py --list),
    # then the longest under Nsight Compute (full set + DRAM bytes and L2 reductions; without
    # the extra counters if this ncu does not know them), CSV exports summarised into a record.
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    [ -n "$ncu_bin" ] || { echo "gpu_session.sh ncu-attention: no ncu on this machine" >&2
      exit 1; }
    raw=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_red.sum
    raw=$raw,lts__t_sectors_op_atom.sum,lts__t_sectors_op_read.sum,lts__t_sector_op_red_hit_rate.pct
    cases=()
    for c in ${NCU_ATTN_CASES:-glm51:16384:sm90 glm51:16384:cudnn glm51:131072:sm90 \
               glm51:131072:cudnn}; do
      # shape:T:kernel[:fwd] (fwd: the forward, kernel sm90 or cudnn = FlashMLA's)
      IFS=: read -r shape t kernel pass <<< "$c"
      fwd=() name=${shape}_${t}_${kernel}
      [ "${pass:-}" = fwd ] && fwd=(--forward) name=${name}_fwd
      rep=/tmp/gpu_session/ncu_$name
      timeout 200 python3 scripts/profile_attention.py --shape "$shape" --T "$t" \
        --kernel "$kernel" "${fwd[@]}" --list > "$out/${name}_kernels.log" 2>&1
      longest=$(sed -n 's/^LONGEST //p' "$out/${name}_kernels.log")
      [ -n "$longest" ] || { echo "$name: no kernel list"; tail -3 "$out/${name}_kernels.log"
        continue; }
      # ncu matches the function name without its parameters or templates: its leading word.
      base=$(sed -E 's/[^A-Za-z0-9_].*//' <<< "$longest")
      grep -v -i warn "$out/${name}_kernels.log" | head -4
      for metrics in "--metrics $raw" ""; do
        # shellcheck disable=SC2086  # the metrics flag and its value, split on purpose
        timeout 240 "$ncu_bin" --profile-from-start off --kernel-name "regex:^$base" \
          --launch-count 1 --set full $metrics --clock-control none -f -o "$rep" \
          python3 scripts/profile_attention.py --shape "$shape" --T "$t" --kernel "$kernel" \
          "${fwd[@]}" > "$out/$name.log" 2>&1
        rc=$?
        [ $rc -ne 0 ] && grep -q -i "metric" "$out/$name.log" || break
      done
      echo "$name rc=$rc: $(grep -v -i warn "$out/$name.log" | tail -1)"
      "$ncu_bin" --import "$rep.ncu-rep" --page details --csv > "$out/${name}_details.csv" 2>&1
      "$ncu_bin" --import "$rep.ncu-rep" --page source --csv --print-source sass \
        > "$out/${name}_sass.csv" 2>&1
      cases+=("$name")
    done
    python3 scripts/ncu_summary.py --dir "$out" --cases "${cases[@]}" --kind ncu_attention \
      --commit "${HYSCALE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" \
      --date "$(date -u '+%Y-%m-%d %H:%M UTC')" --command "bash scripts/gpu_session.sh $stage" \
      --out "$HYSCALE_RESULTS/$(date -u +%F)-nvidia-h200-ncu_attention.json"
    ;;
  selection)
    timeout 150 python3 scripts/bench_selection.py --T 131072 --configs dsv32 v4flash --reps 2 \
      --methods hytopk scoreonly --out "$out" 2>&1 | tail -4 | tee "$out/bench_selection.log"
    timeout 100 python3 scripts/bench_selection.py --T 524288 --configs qsa --reps 2 \
      --secondary-max-T 524288 --methods hytopk finish --tag _qsa --out "$out" 2>&1 \
      | tail -3 | tee "$out/bench_selection_qsa.log"
    # The folded (no-ReLU) query beside its stock paths in the same run: cuDNN's indexer always
    # applies ReLU, so they are megatron's `none` (the naive table, to 32K) and the table paths.
    timeout 200 python3 scripts/bench_selection.py --T 16384 32768 131072 --configs norelu \
      --reps 2 --methods hytopk naive chunked table --tag _folded_stock --out "$out" 2>&1 \
      | grep -E "^random|Error|error" | tee "$out/bench_selection_folded_stock.log"
    ;;
  cudnn-verify)
    fail=0
    timeout 240 python3 -m pytest -q -rfE -m gpu tests/ops/test_library_backends_gpu.py \
      -p no:cacheprovider > "$out/library_tests.log" 2>&1 || fail=1
    grep -E "^(FAILED|ERROR|E   )" "$out/library_tests.log" | cut -c1-300 | head -20
    tail -1 "$out/library_tests.log"
    # CUDNN_VERIFY_LIBRARY_ONLY=1: the library tests alone (the kernels' verify ran already).
    [ -n "${CUDNN_VERIFY_LIBRARY_ONLY:-}" ] || OUT=$out bash "$0" verify || fail=1
    exit $fail
    ;;
  cudnn-kernels)
    # hytopk_default: what ops.hytopk runs (the Gluon path from 16K keys), the measured
    # table's own time; hytopk: the Triton kernel.
    timeout 240 python3 scripts/bench_selection.py --T ${CUDNN_SELECTION_T:-16384 65536 131072} \
      --configs dsv32 glm51 v4flash --secondary-max-T 131072 --reps 2 \
      --methods hytopk hytopk_default cudnn stock_cudnn table --out "$out" 2>&1 | grep -v -i warn \
      | tee "$out/bench_selection.log" | grep -E "T=|not run|Error"
    timeout 200 python3 scripts/bench_attention.py --t 16384 65536 131072 \
      --shapes glm51 v32 csa --reps 2 --no-stock --no-deterministic --out "$out" 2>&1 \
      | grep -v -i warn | tee "$out/bench_attention.log" | grep -E "T=|Error"
    timeout 200 python3 scripts/bench_indexer_loss.py --t 32768 131072 --shapes glm51 \
      --reps 2 --out "$out" 2>&1 | grep -v -i warn | tee "$out/bench_indexer_loss.log"
    ;;
  cudnn-loss)
    # Issue #20 item 3 against the stock cudnn path, in one call: the default mode (HyScale's
    # loss with the target from the attention's dQ kernel, cuDNN's loss kernels, both given
    # the attention's lse), then the row pass + backward with the selection's log-sum-exp
    # (the DSA layer's path) and LOSS_VARIANTS beside it (e.g. "bwd_sm90_lockstep4"). LOSS_RUNS:
    # shape:T pairs, one process each (default GLM-5.1 at 128K; ~2 min each).
    # shellcheck disable=SC2086  # variants split on purpose
    for run in ${LOSS_RUNS:-glm51:131072}; do
      timeout 240 python3 scripts/bench_indexer_loss.py --t "${run#*:}" --shapes "${run%%:*}" \
        --reps 3 --no-tilelang --out "$out/${run/:/_}" 2>&1 | grep -v -i warn \
        | tee -a "$out/bench_indexer_loss.log" | grep -E "T=|target from|cudnn|Error"
      timeout 150 python3 scripts/bench_indexer_loss.py --t "${run#*:}" --shapes "${run%%:*}" \
        --variants selection_lse ${LOSS_VARIANTS:-} --out "$out/${run/:/_}_lse" 2>&1 \
        | grep -v -i warn \
        | grep -E "T=|Error|failed" | tee -a "$out/bench_indexer_loss_variants.log"
    done ;;
  cudnn-tests)
    fail=0
    for f in tests/ops/test_library_backends_gpu.py tests/layers/test_stock_cudnn_gpu.py; do
      timeout 200 python3 -m pytest -q -rfE -m gpu "$f" -p no:cacheprovider \
        > "$out/current.log" 2>&1 || fail=1
      cat "$out/current.log" >> "$out/tests.log"
      echo "$f: $(verdict "$out/current.log")" | tee -a "$out/summary.txt"
    done
    rm -f "$out/current.log"
    grep -h -E "^(FAILED|ERROR|E  )|^/.*\.py:[0-9]+: " "$out/tests.log" | cut -c1-400 | head -40 || true
    exit $fail
    ;;
  tilelang-kernels)
    python3 -c "import tilelang" 2>/dev/null || {
      echo "gpu_session.sh tilelang-kernels: run scripts/gpu_tilelang.sh 1 and 2 first" >&2
      exit 2; }
    if [ "${1:-selection}" = selection ]; then
      timeout 400 python3 scripts/bench_selection.py --T 16384 65536 131072 262144 \
        --configs dsv32 glm51 --secondary-max-T 131072 --reps 2 \
        --methods hytopk cudnn stock_tilelang --out "$out" 2>&1 | grep -v -i warn \
        | tee "$out/bench_selection.log" | grep -E "T=|not run|Error"
    else
      timeout 330 python3 scripts/bench_attention.py --t 16384 65536 131072 --shapes glm51 v32 \
        --reps 2 --no-stock --no-deterministic --out "$out" 2>&1 | grep -v -i warn \
        | tee "$out/bench_attention.log" | grep -E "T=|not run|Error"
      timeout 240 python3 scripts/bench_indexer_loss.py --t 32768 131072 --shapes glm51 --reps 2 \
        --warmup 1 --out "$out" 2>&1 | grep -v -i warn | tee "$out/bench_indexer_loss.log"
    fi
    ;;
  flashmla-pair)
    timeout 200 python3 -m pytest -q -rfE -m gpu tests/ops/test_library_backends_gpu.py \
      -k "flashmla_forward or library_attention" -p no:cacheprovider > "$out/tests.log" 2>&1
    rc=$?
    echo "flashmla-pair tests: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
    grep -h -E "^(FAILED|ERROR|E  )" "$out/tests.log" | cut -c1-400 | head -20 || true
    timeout 330 python3 scripts/bench_attention.py --t ${PAIR_T:-16384 65536 131072} \
      --shapes glm51 v32 csa --reps 2 --no-stock --no-tilelang --no-deterministic \
      --fwd-kernel flashmla --fwd-also gluon_ws --out "$out" 2>&1 | grep -v -i warn \
      | tee "$out/bench_attention.log" | grep -E "T=|Error|^\|"
    exit $rc
    ;;
  lockstep-triton)
    # PART: tests (the interpreter tests on CUDA, ~4 min) or bench (the timings, ~8 min);
    # each fits one call.
    case "${1:-tests}" in
      tests)
        timeout 420 python3 -m pytest -q -rfE -p no:cacheprovider \
          tests/ops/test_indexer_loss_variants.py tests/ops/test_sparse_attention_triton.py \
          -k "lockstep" > "$out/tests.log" 2>&1
        rc=$?
        echo "lockstep-triton tests: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
        grep -h -E "^(FAILED|ERROR|E  )" "$out/tests.log" | cut -c1-400 | head -20 || true
        exit $rc ;;
      bench)
        # LOCKSTEP_T: the QSA lengths (e.g. 524288: the layer's 512K, where the pace's window
        # outgrows the L2); LOCKSTEP_LOSS=0 skips the indexer-loss variants.
        if [ "${LOCKSTEP_LOSS:-1}" != 0 ]; then
          timeout 200 python3 scripts/bench_indexer_loss.py --t 32768 131072 --shapes glm51 \
            v32 --variants lockstep lockstep2 lockstep_1sm --out "$out" 2>&1 \
            | grep -v -i warn | grep -E "T=|Error|failed" \
            | tee "$out/bench_indexer_loss_variants.log"
        fi
        # shellcheck disable=SC2086  # lengths split on purpose
        timeout 330 python3 scripts/bench_attention.py --t ${LOCKSTEP_T:-65536 131072} --shapes qsa \
          --indices sorted --bwd-also triton_lockstep triton_lockstep_dkv triton_lockstep2 \
          triton_lockstep_1sm --fwd-also triton_lockstep \
          --reps 2 --no-stock --no-tilelang --no-deterministic --out "$out" 2>&1 \
          | grep -v -i warn | tee "$out/bench_attention.log" | grep -E "T=|Error|^\|" ;;
      *) echo "usage: bash scripts/gpu_session.sh lockstep-triton {tests|bench}" >&2; exit 2 ;;
    esac
    ;;
  mla-projections)
    # The absorbed-MLA projections written in place (ops/absorbed_mla.py): their GPU tests and
    # the DSA layer's on CUDA, then the GLM-5.1 DSA layer with HyScale's projections (row
    # hyscale) and with megatron's (row hyscale_megatron_projections) on the same weights and
    # kernels ("best": the library's where gpu_cudnn.sh installed it on this machine).
    # MLA_TESTS: fewer test files when device time is short.
    # shellcheck disable=SC2086  # a list of paths, split on purpose
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
      ${MLA_TESTS:-tests/ops/test_absorbed_mla.py tests/layers/test_dsa_layer.py \
      tests/layers/test_layer_hopper_kernels_gpu.py} > "$out/tests.log" 2>&1
    echo "tests rc=$?: $(verdict "$out/tests.log")" | tee "$out/summary.txt"
    grep -h -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-300 | head -20
    # The two projections alone (forward + backward, 32K and 128K), then the layer unless
    # MLA_LAYER=0 (when device time is short).
    timeout 150 python3 scripts/bench_mla_projections.py --reps 3 2>&1 \
      | tee "$out/bench_mla_projections.log" | grep -E "^T=|matmul|Error"
    [ "${MLA_LAYER:-1}" = 0 ] && exit 0
    timeout 420 python3 scripts/bench_layer.py --seq ${*:-8192 131072} --repeats "${REPEATS:-2}" \
      --skip-stock --compare-mla-projections ${LAYER_FLAGS:-} --out "$out" 2>&1 \
      | grep -v -i warn | tee "$out/bench_layer.log" | grep -E "^\||Error|T=.*floor"
    ;;
  cudnn-layer)
    seqs=${*:-8192 16384 32768 131072 262144}
    # "best" reads the measured table: the repository's records plus those this warm machine's
    # earlier stages wrote (cudnn-kernels, filter-sm90, ...), when there are any.
    here=(/tmp/gpu_session/*/results/*.json)
    if [ -f "${here[0]}" ]; then
      python3 scripts/measured_defaults.py benchmarks/results/*.json "${here[@]}" \
        | tee "$out/measured_defaults.log" | grep -E "selection|wrote"
    fi
    # Stock cudnn's own selection scores every chunk after the first with per-head torch
    # matmuls: 17 s a step at 128K, so it stops there. LAYER_FLAGS: more bench_layer flags,
    # e.g. "--attention-bwd sm90 --attention-fwd gluon_ws" (HyScale's own kernels with the
    # opt-in Hopper variants: the hyscale_own column).
    timeout 540 python3 scripts/bench_layer.py --seq $seqs --repeats "${REPEATS:-3}" \
      --stock-max-seq 8192 --stock-kernel-backend cudnn --fused-stock-max-seq 131072 \
      --compare-own-kernels ${LAYER_FLAGS:-} --out "$out" 2>&1 | grep -v -i warn \
      | tee "$out/bench_layer.log" | grep -E "^\||Error|T=.*floor|fused kernels"
    ;;
  pair)
    # Two one-GPU stages at once on nvidia-h200-x2, one a GPU; their files packed into
    # $out/results.tgz (the device tool brings back at most 8 files a call).
    [ $# -eq 2 ] || { echo "usage: bash scripts/gpu_session.sh pair 'STAGE [ARGS]'" \
                        "'STAGE [ARGS]'" >&2; exit 2; }
    specs=("$1" "$2") pids=()
    for i in 0 1; do
      # Stages separated by ';' run one after the other on the same GPU.
      (
        rc_i=0
        IFS=';' read -ra stages <<< "${specs[$i]}"
        for st in "${stages[@]}"; do
          # shellcheck disable=SC2086  # a stage and its arguments, split on purpose
          OUT=$out/gpu$i CUDA_VISIBLE_DEVICES=$i bash "$0" $st || rc_i=1
        done
        exit $rc_i
      ) > "$out/gpu$i.log" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for i in 0 1; do echo "=== GPU $i: ${specs[$i]}"; grep -v -i "warn" "$out/gpu$i.log" | tail -60; done
    tar -czf "$out/results.tgz" -C "$out" gpu0 gpu1 gpu0.log gpu1.log \
      && rm -rf "$out/gpu0" "$out/gpu1"
    exit $rc
    ;;
  cp2)
    run2=(python3 -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2)
    for model in dsa csa qsa; do
      timeout 100 "${run2[@]}" scripts/check_cp.py --model $model --seq 32768 \
        --out "$out/check_cp_$model" 2>&1 | grep -v Warning | tail -4 | tee -a "$out/check_cp.log"
    done
    seqs=${*:-131072 262144 524288}
    timeout 250 "${run2[@]}" scripts/bench_layer.py --model dsa --cp 2 --seq $seqs \
      --skip-stock --repeats 1 --out "$out" 2>&1 | grep -v Warning | tee "$out/bench_layer_cp2.log"
    ;;
  cp2-1m)
    model=${1:-dsa}
    chunks=(--row-chunk 131072)
    [ "$model" = qsa ] && chunks=()  # QSA fits whole (71 GiB a GPU by the estimate)
    timeout 560 python3 -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 \
      scripts/bench_layer.py --model "$model" --cp 2 --seq 1048576 "${chunks[@]}" \
      --skip-stock --repeats 1 --out "$out" 2>&1 | grep -v Warning \
      | tee "$out/bench_layer_cp2_1m_$model.log"
    ;;
  side1|side1-long|side2|pp2)
    [ -f .carry/megatron_lm/pretrain_gpt.py ] || {
      echo "gpu_session.sh $stage: carry .carry/megatron_lm (scripts/megatron_lm_carry.sh)" >&2
      exit 2; }
    # Megatron-LM's training runs `make` in megatron/core/datasets at start-up; the wheel ships
    # the helpers compiled (helpers_cpp*.so) but no Makefile, so make would fail: give it one
    # with nothing to do.
    ds=$(python3 -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))")
    [ -n "$ds" ] || { echo "gpu_session.sh $stage: megatron.core does not import" >&2; exit 1; }
    [ -f "$ds/Makefile" ] || printf 'default:\n\t@true\n' > "$ds/Makefile"
    # Transformer Engine where scripts/gpu_te.sh installed it on this warm machine (the image
    # has none), else megatron's torch modules.
    impl=transformer_engine
    python3 -c "import transformer_engine" 2>/dev/null || impl=local
    if [ "$stage" = side1-long ]; then
      # Issue #19 item 3 at stock cudnn's longest fitting length on one H200 (131,072 tokens by
      # the recalibrated estimate; SIDE1_SEQ), 22 iterations each, over several calls on one
      # warm machine (examples/glm5_1/README.md, "Runs longer than one call"): PART stock (2-3
      # calls, ~40 s an iteration), hyscale, alone (HyScale at SIDE1_ALONE: the longest it
      # fits, 155,648 by the estimate; twice stock's length fits neither), summary.
      [ -d .carry/site/nvidia_cutlass_dsl ] || {
        echo "gpu_session.sh side1-long: run scripts/gpu_cudnn.sh 1 and 2 first (same warm machine)" >&2
        exit 2; }
      part=${1:-}; shift || true
      run_dir=outputs/side1_long  # kept on the machine between calls (ignored by git)
      only=()
      case "$part" in
        pair)
          # nvidia-h200-x2: stock on GPU 0 while GPU 1 runs HyScale's pair run and then HyScale
          # alone, each a one-GPU run as on one H200 (separate GPUs, so neither slows the
          # other's timing); the same command again resumes what is unfinished (stock needs
          # about three calls at 128K, ~36 s an iteration), then `side1-long summary`.
          [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || {
            echo "gpu_session.sh side1-long pair: needs two GPUs (nvidia-h200-x2)" >&2; exit 2; }
          common=(--gpus 1 --config scaled --stock-backend cudnn --num-layers 2
            --global-batch-size 1 --seq-length "${SIDE1_SEQ:-131072}" --train-iters 22
            --transformer-impl $impl --output-dir "$run_dir/out" --checkpoint-dir "$run_dir/ckpt")
          export MEGATRON_LM_DIR=$(pwd)/.carry/megatron_lm HYSCALE_PYTHON=python3
          CUDA_VISIBLE_DEVICES=0 timeout 575 bash examples/glm5_1/side_by_side.sh "${common[@]}" \
            --time-limit 540 --only stock "$@" > "$out/pair_stock.log" 2>&1 &
          stock_pid=$!
          ( CUDA_VISIBLE_DEVICES=1 timeout 300 bash examples/glm5_1/side_by_side.sh \
              "${common[@]}" --time-limit 290 --only hyscale "$@"
            CUDA_VISIBLE_DEVICES=1 timeout 260 bash examples/glm5_1/side_by_side.sh \
              "${common[@]}" --time-limit 250 --hyscale-alone-at "${SIDE1_ALONE:-155648}" \
              --alone-iters 4 --only hyscale "$@" ) > "$out/pair_hyscale.log" 2>&1 &
          hyscale_pid=$!
          wait "$stock_pid"; rc=$?
          wait "$hyscale_pid" || rc=1
          grep -v Warning "$out/pair_stock.log" | tail -25
          grep -v Warning "$out/pair_hyscale.log" | tail -25
          cp "$run_dir"/out/*.log "$run_dir"/out/summary.txt "$run_dir"/out/*.json "$out"/ \
            2>/dev/null
          exit "$rc" ;;
        stock) only=(--only stock) ;;
        hyscale) rm -rf "$run_dir/ckpt/stock"; only=(--only hyscale) ;;  # 2 x 23 GB on 64 GB
        alone) rm -rf "$run_dir/ckpt/stock" "$run_dir/ckpt/hyscale"; only=(--only hyscale) ;;
        summary) ;;
        *) echo "usage: gpu_session.sh side1-long {stock|hyscale|alone|summary|pair}" >&2
           exit 2 ;;
      esac
      alone=()
      [ "$part" = alone ] || [ "$part" = summary ] && alone=(--hyscale-alone-at
        "${SIDE1_ALONE:-155648}" --alone-iters 4)
      MEGATRON_LM_DIR=$(pwd)/.carry/megatron_lm HYSCALE_PYTHON=python3 timeout 575 \
        bash examples/glm5_1/side_by_side.sh --gpus 1 --config scaled --stock-backend cudnn \
        --num-layers 2 --global-batch-size 1 --seq-length "${SIDE1_SEQ:-131072}" \
        --train-iters 22 --transformer-impl $impl --output-dir "$run_dir/out" \
        --checkpoint-dir "$run_dir/ckpt" --time-limit 540 "${alone[@]}" "${only[@]}" "$@" 2>&1 \
        | grep -v Warning | tail -60
      rc=${PIPESTATUS[0]}
      cp "$run_dir"/out/*.log "$run_dir"/out/summary.txt "$run_dir"/out/*.json "$out"/ 2>/dev/null
      exit "$rc"
    fi
    if [ "$stage" = pp2 ]; then
      # Issue #22 item 3 on nvidia-h200-x2, after gpu_cudnn.sh 1 and 2 (warm): Megatron-LM's
      # pretrain_gpt.py with PP 2 x VPP 2 (GLM-5.1's attention width, 4 layers, one a virtual
      # stage; 8 micro-batches a step, so several are in flight per layer and full recompute
      # runs them in reverse), stock cudnn then HyScale on the same seed and data: the losses
      # agree step by step, HyScale's log has its replay counters.            (~6 min)
      [ -d .carry/site/nvidia_cutlass_dsl ] || {
        echo "gpu_session.sh pp2: run scripts/gpu_cudnn.sh 1 and 2 first (same warm machine)" >&2
        exit 2; }
      MEGATRON_LM_DIR=$(pwd)/.carry/megatron_lm HYSCALE_PYTHON=python3 timeout 560 \
        bash examples/glm5_1/side_by_side.sh --gpus 2 --config scaled --cp 1 --ep 1 --pp 2 \
        --vpp 2 --num-layers 4 --global-batch-size 8 --seq-length "${PP2_SEQ:-16384}" \
        --train-iters 10 --stock-backend cudnn --transformer-impl $impl --time-limit 500 \
        --output-dir "$out" "$@" 2>&1 | grep -v Warning | tail -60
      exit "${PIPESTATUS[0]}"
    fi
    if [ "$stage" = side1 ]; then
      # One H200 against stock cudnn (examples/glm5_1/README.md): the pair at 32K (stock's
      # per-head fp32 selection makes longer pairs outlast a call), HyScale alone at 2x.
      [ -d .carry/site/nvidia_cutlass_dsl ] || {
        echo "gpu_session.sh side1: run scripts/gpu_cudnn.sh 1 and 2 first (same warm machine)" >&2
        exit 2; }
      MEGATRON_LM_DIR=$(pwd)/.carry/megatron_lm HYSCALE_PYTHON=python3 timeout 560 \
        bash examples/glm5_1/side_by_side.sh --gpus 1 --config scaled --stock-backend cudnn \
        --num-layers 2 --global-batch-size 1 --seq-length "${SIDE1_SEQ:-32768}" \
        --train-iters 22 --hyscale-alone-at 2x --alone-iters 4 --transformer-impl $impl \
        --time-limit 480 --output-dir "$out" "$@" 2>&1 | grep -v Warning | tail -80
      exit "${PIPESTATUS[0]}"
    fi
    # Arguments replace these side_by_side.sh options (stock takes 19 s an iteration at 16K).
    opts=("$@")
    [ $# -gt 0 ] || opts=(--seq-length 16384 --train-iters 10 --skip-iters 2)
    MEGATRON_LM_DIR=$(pwd)/.carry/megatron_lm HYSCALE_PYTHON=python3 timeout 560 \
      bash examples/glm5_1/side_by_side.sh --gpus 2 --transformer-impl $impl \
      --output-dir "$out" "${opts[@]}" 2>&1 | grep -v Warning | tail -60 | tee "$out/side_by_side.log"
    ;;
esac

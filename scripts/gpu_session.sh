#!/usr/bin/env bash
# One lent-GPU session in a few full calls (each under the device tool's 10-minute limit), run
# from the repository root on the H200 with `carry: [".whl"]`:
#   bash scripts/gpu_session.sh verify    # GPU op tests (HyTopK, sparse attention, indexer
#                                         # loss) + the layer tests on CUDA            (~4 min)
#   bash scripts/gpu_session.sh kernels   # HyTopK variants at 128K, the backward tiling sweep,
#                                         # the indexer-loss benchmark                 (~6 min)
#   bash scripts/gpu_session.sh layer [T...]  # bench_layer.py, DSA, GLM-5.1 geometry   (~8 min)
#   bash scripts/gpu_session.sh cp2 [T...]  # on nvidia-h200-x2: CP 2 against CP 1 (NCCL,
#                                         # DSA / CSA / QSA layers at 32K), then DSA at CP 2
#                                         # at 128K / 256K / 512K (1M: 249 GiB a GPU by the
#                                         # estimate, launch/layer_memory.py)          (~9 min)
#   bash scripts/gpu_session.sh side2     # on nvidia-h200-x2 with carry [".whl",
#                                         # ".carry/megatron_lm"] (scripts/megatron_lm_carry.sh):
#                                         # stock Megatron-LM DSA then HyScale, the small
#                                         # GLM-5.1 at 32K, CP 2, tokens/s and losses    (~9 min)
# Logs and JSON go under ${OUT:-outputs/gpu_session}/<stage>. TileLang's stock backend needs
# two more calls (scripts/gpu_tilelang.sh). Flip indexer_loss.TRITON_KERNEL_GPU_VERIFIED only
# after `verify` passed, before `layer`, so the layer uses the fused loss.
set -uo pipefail
stage=${1:-}
shift || true
case "$stage" in
  verify|kernels|layer|cp2|side2) ;;
  *) echo "usage: bash scripts/gpu_session.sh {verify|kernels|layer|cp2|side2} [T...]" >&2
     exit 2 ;;
esac
out=${OUT:-outputs/gpu_session}/$stage
mkdir -p "$out"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$(pwd):${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u;
  git log -1 --format='%h %s' 2>/dev/null; } | tee "$out/device.txt"

case "$stage" in
  verify)
    # Full logs under $out; the call's output keeps the tails.
    timeout 400 python3 -m pytest -q -rfE -m gpu tests/ops -p no:cacheprovider \
      > "$out/gpu_ops.log" 2>&1
    tail -40 "$out/gpu_ops.log"
    timeout 150 python3 -m pytest -q -rfE tests/layers -p no:cacheprovider \
      > "$out/layers.log" 2>&1
    tail -15 "$out/layers.log"
    ;;
  kernels)
    timeout 180 python3 scripts/bench_selection.py --T 131072 --configs dsv32 --reps 2 \
      --methods hytopk hytopk_heads_on_m hytopk_scan_slots scoreonly scoreonly_heads_on_m finish \
      table chunked --out "$out" 2>&1 | tee "$out/bench_selection.log"
    timeout 180 python3 scripts/bench_attention.py --bwd-sweep --shapes glm51 --t 32768 \
      --reps 2 --out "$out" 2>&1 | tee "$out/bench_attention_sweep.log"
    timeout 120 python3 scripts/bench_indexer_loss.py --out "$out" 2>&1 \
      | tee "$out/bench_indexer_loss.log"
    # The demo's trained indexer (carry "outputs/demo/indexer_capture.pt" when it exists):
    # what the pruning bound skips on a trained indexer, exactness against the reference.
    if [ -f outputs/demo/indexer_capture.pt ]; then
      timeout 60 python3 scripts/bench_selection.py --captured outputs/demo/indexer_capture.pt \
        --methods hytopk hytopk_prune table --reps 2 --tag _captured --out "$out" 2>&1 \
        | tail -8 | tee "$out/bench_selection_captured.log"
    fi
    ;;
  layer)
    seqs=${*:-8192 16384 32768 65536 131072 262144}
    timeout 560 python3 scripts/bench_layer.py --seq $seqs --repeats 1 --out "$out" 2>&1 \
      | tee "$out/bench_layer.log"
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
  side2)
    [ -f .carry/megatron_lm/pretrain_gpt.py ] || {
      echo "gpu_session.sh side2: carry .carry/megatron_lm (scripts/megatron_lm_carry.sh)" >&2
      exit 2; }
    MEGATRON_LM_DIR=$(pwd)/.carry/megatron_lm HYSCALE_PYTHON=python3 timeout 560 \
      bash examples/glm5_1/side_by_side.sh --gpus 2 --output-dir "$out" 2>&1 \
      | grep -v Warning | tail -60 | tee "$out/side_by_side.log"
    ;;
esac

#!/usr/bin/env bash
# Vanilla Megatron-LM DSA (stock spec) then HyScale, same GLM-5.1 configuration, one after the
# other; prints tokens/s and lm / indexer loss beside each other (and writes summary.txt).
#
#   bash examples/glm5_1/side_by_side.sh --dry-run                # small model, 2 GPUs, 16K
#   MEGATRON_LM_DIR=... bash examples/glm5_1/side_by_side.sh --gpus 1 --seq-length 8192
#   inside a 64-node allocation: bash examples/glm5_1/side_by_side.sh --config full
#   compare two existing logs:   bash examples/glm5_1/side_by_side.sh --parse-only A.log B.log
#   one H200 against stock cudnn (README.md "One H200 against stock cudnn"): stock cudnn and
#   HyScale at 32K, then HyScale alone at 64K, in one call:
#     MEGATRON_LM_DIR=... bash examples/glm5_1/side_by_side.sh --gpus 1 --config scaled \
#       --stock-backend cudnn --num-layers 2 --global-batch-size 1 --seq-length 32768 \
#       --train-iters 22 --hyscale-alone-at 2x --transformer-impl local --time-limit 480
#   runs longer than one call (README.md "Runs longer than one call"): checkpoints in DIR, each
#   run saves and exits before the limit, the same command again resumes it (log appended):
#     ... --only stock --checkpoint-dir outputs/side1_ckpt --time-limit 540   (call 1, 2, ...)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../_common.sh"
exec "$hyscale_python" "$hyscale_root/examples/glm5_1/launch.py" side-by-side "$@"

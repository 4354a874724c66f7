#!/usr/bin/env bash
# Scaled-down GLM-5.1 (4 layers, hidden 2048, 16 heads, GLM's MLA head dims, indexer 32 x 128
# top-2048, 16 experts top-8 + 1 shared) on 1 or 2 GPUs at 32K tokens (CP 2 on 2 GPUs).
#
#   bash examples/glm5_1/train_small.sh --dry-run
#   MEGATRON_LM_DIR=/path/to/Megatron-LM bash examples/glm5_1/train_small.sh --gpus 2
#   longer sequences: --seq-length 131072; stock DSA instead: --spec stock
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../_common.sh"
exec "$hyscale_python" "$hyscale_root/examples/glm5_1/launch.py" small "$@"

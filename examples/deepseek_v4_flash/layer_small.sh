#!/usr/bin/env bash
# DeepSeek-V4-Flash attention layer on 1 GPU (CSA by default, --model hca for HCA) at 16K ..
# 256K tokens, HyScale vs the baseline mode; or, with --gpus 2, the GLM-5.1 DSA comparison
# layer at CP 2 (V4's CSA / HCA do not support CP yet: --gpus 2 --model csa is refused).
#
#   bash examples/deepseek_v4_flash/layer_small.sh --dry-run
#   bash examples/deepseek_v4_flash/layer_small.sh                 # CSA, 1 GPU
#   bash examples/deepseek_v4_flash/layer_small.sh --model hca
#   bash examples/deepseek_v4_flash/layer_small.sh --gpus 2        # DSA, CP 2
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../_common.sh"
exec "$hyscale_python" "$hyscale_root/examples/deepseek_v4_flash/launch.py" small "$@"

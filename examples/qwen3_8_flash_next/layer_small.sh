#!/usr/bin/env bash
# Qwen3.8-Flash-Next QSA attention layer, HyScale vs the baseline mode: 1 GPU at 16K .. 512K
# tokens, or --gpus 2 at CP 2 for 256K, 512K and 1M tokens.
#
#   bash examples/qwen3_8_flash_next/layer_small.sh --dry-run
#   bash examples/qwen3_8_flash_next/layer_small.sh                # 1 GPU
#   bash examples/qwen3_8_flash_next/layer_small.sh --gpus 2       # CP 2, up to 1M
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../_common.sh"
exec "$hyscale_python" "$hyscale_root/examples/qwen3_8_flash_next/launch.py" small "$@"

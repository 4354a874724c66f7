#!/usr/bin/env bash
# Put the three Megatron-LM files that examples/glm5_1/side_by_side.sh and train_small.sh run
# (pretrain_gpt.py and the gpt_builders.py / model_provider.py it imports) into .carry/megatron_lm
# (ignored), so that a device call can carry them: the GPU machine has no network, and
# megatron.training itself comes with the megatron-core wheel (.whl/).
#   bash scripts/megatron_lm_carry.sh MEGATRON_LM_GIT_DIR [REF]
# MEGATRON_LM_GIT_DIR: a clone or mirror of NVIDIA/Megatron-LM (a bare repository works);
# REF (default core_r0.19.0): the branch or commit matching the pinned megatron-core 0.19.
# Then, on the GPU machine: MEGATRON_LM_DIR=.carry/megatron_lm bash examples/glm5_1/...
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: bash scripts/megatron_lm_carry.sh MEGATRON_LM_GIT_DIR [REF]}
ref=${2:-core_r0.19.0}
files=(pretrain_gpt.py gpt_builders.py model_provider.py)
dest=.carry/megatron_lm
commit=$(git -C "$src" rev-parse --verify "$ref^{commit}") || {
  echo "megatron_lm_carry.sh: $src has no ref $ref" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
git -C "$src" archive "$commit" "${files[@]}" | tar -x -C "$dest"
echo "$ref $commit" > "$dest/SOURCE"
echo "[megatron-lm] ${files[*]} from $ref ($commit) in $dest"

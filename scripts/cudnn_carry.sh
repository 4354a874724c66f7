#!/usr/bin/env bash
# Run HERE (a machine with network), before a GPU session that runs the library kernels
# megatron-core's `cudnn` DSA backend uses (cuDNN-frontend's SM90 DSA kernels and FlashMLA's
# sparse forward), as HyScale backends and as the stock baseline:
#   bash scripts/cudnn_carry.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR
# FLASHMLA_GIT_DIR: a clone or mirror of deepseek-ai/FlashMLA (branch nv_dev, the one
# megatron-core's error message names); CUTLASS_GIT_DIR: one of NVIDIA/cutlass holding the
# commit FlashMLA's submodule pins. Nothing fetched is committed: it all goes to .carry/.
# The lent GPU machine has no network and one call carries at most 64 MiB, and
# nvidia-cutlass-dsl-libs-cu13 alone is 88 MiB, so it travels in two pieces:
#   .carry/cudnn1  piece 1 of libs-cu13, libs-base, libs-core, cutlass-dsl, apache-tvm-ffi,
#                  FlashMLA's sources + the CUTLASS headers                       (~54 MiB)
#   .carry/cudnn2  piece 2 of libs-cu13, nvidia-cudnn-frontend                    (~55 MiB)
# scripts/gpu_cudnn.sh 1 / 2 installs them there (two calls in a row, machine warm).
# cuda-bindings and protobuf are in the GPU image already. Knob: HYSCALE_PIP.
set -euo pipefail
cd "$(dirname "$0")/.."
flashmla=${1:?usage: bash scripts/cudnn_carry.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR}
cutlass=${2:?usage: bash scripts/cudnn_carry.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR}
FLASHMLA_REF=${FLASHMLA_REF:-nv_dev}

# Pinned so that the sizes above stay true (nvidia-cudnn-frontend 1.32.0 asks for
# nvidia-cutlass-dsl[cu13] >= 4.8.0 and apache-tvm-ffi >= 0.1.11).
SPLIT=nvidia-cutlass-dsl-libs-cu13==4.8.1
PART1=(nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
       nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2)
PART2=(nvidia-cudnn-frontend==1.32.0)
MEGATRON=megatron-core==0.19.2
LIMIT_MIB=64

# shellcheck source=scripts/carry_wheels.sh
source scripts/carry_wheels.sh  # pip, target (the GPU machine's wheel tags), mib

rm -rf .carry/cudnn1 .carry/cudnn2 .carry/cudnn_split
mkdir -p .carry/cudnn1 .carry/cudnn2 .carry/cudnn_split .whl
"${pip[@]}" download -q "${target[@]}" -d .carry/cudnn_split "$SPLIT"
"${pip[@]}" download -q "${target[@]}" -d .carry/cudnn1 "${PART1[@]}"
"${pip[@]}" download -q "${target[@]}" -d .carry/cudnn2 "${PART2[@]}"
if ! compgen -G ".whl/megatron_core-*.whl" >/dev/null; then
  "${pip[@]}" download -q "${target[@]}" -d .whl "$MEGATRON"
fi
big=$(ls .carry/cudnn_split/*.whl)
half=$(( ($(stat -c %s "$big") + 1) / 2 ))
split -b "$half" -d -a 1 "$big" ".carry/cudnn_split/$(basename "$big").part"
mv ".carry/cudnn_split/$(basename "$big").part0" .carry/cudnn1/
mv ".carry/cudnn_split/$(basename "$big").part1" .carry/cudnn2/
sha256sum "$big" | awk '{print $1}' > .carry/cudnn2/libs-cu13.sha256
rm -rf .carry/cudnn_split

# FlashMLA's sources and the CUTLASS headers of the submodule commit it pins.
commit=$(git -C "$flashmla" rev-parse --verify "$FLASHMLA_REF^{commit}")
cutlass_commit=$(git -C "$flashmla" ls-tree "$commit" csrc/cutlass | awk '{print $3}')
git -C "$cutlass" cat-file -e "$cutlass_commit^{commit}" || {
  echo "cudnn_carry.sh: $cutlass lacks FlashMLA's CUTLASS commit $cutlass_commit" >&2; exit 1; }
git -C "$flashmla" archive --prefix=flashmla/ "$commit" csrc flash_mla |
  gzip -9 > .carry/cudnn1/flashmla-src.tar.gz
git -C "$cutlass" archive --prefix=flashmla/csrc/cutlass/ "$cutlass_commit" include \
  tools/util/include | gzip -9 > .carry/cudnn1/cutlass-headers.tar.gz
echo "FlashMLA $FLASHMLA_REF $commit; CUTLASS $cutlass_commit" > .carry/cudnn1/SOURCE

status=0
whl=$(mib .whl)
tree=$(git ls-files -z --cached --others --exclude-standard |
       xargs -0 -r du -cb 2>/dev/null | awk 'END {print int($1 / 1048576) + 1}')
for part in cudnn1 cudnn2; do
  size=$(mib ".carry/$part")
  total=$((size + whl + tree))
  echo "[carry] .carry/$part: ${size} MiB, with .whl and the tree ${total} MiB"
  if [ "$total" -gt "$LIMIT_MIB" ]; then
    echo "[carry] .carry/$part is over one call's ${LIMIT_MIB} MiB" >&2
    status=1
  fi
done
exit $status

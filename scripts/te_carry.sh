#!/usr/bin/env bash
# Run HERE (a machine with network), before a GPU session that runs HyScale's Transformer Engine
# path (issue #22, item 6: TE linears and norms in the specs, `transformer_impl =
# "transformer_engine"`):
#   bash scripts/te_carry.sh
# The lent GPU machine has no network and no Transformer Engine, and one device call carries at
# most 64 MiB (working tree + carried paths). transformer-engine-cu13 (TE's core library) is a
# 264 MiB wheel, so it travels in five pieces, one per call; transformer-engine-torch has no
# wheel on PyPI (source only), so its source travels too and is built on the GPU machine (nvcc
# 13 and torch are there):
#   .carry/te1 .. .carry/te4  pieces 1-4 of transformer_engine_cu13               (~53 MiB each)
#   .carry/te5  piece 5, transformer-engine (the meta package), transformer-engine-torch's
#               source, and the small pure-Python needs the image lacks          (~56 MiB)
# scripts/gpu_te.sh 1 .. 5 installs them there (five calls in a row, machine warm), then builds
# the torch extension (`gpu_te.sh build` continues a build a call's limit cut short).
# Knob: HYSCALE_PIP (default: the repository's .venv python -m pip).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=2.20.2
CORE=transformer-engine-cu13==$VERSION
META=transformer-engine==$VERSION
TORCH_SDIST=transformer_engine_torch-$VERSION.tar.gz
# transformer-engine-torch's requirements the GPU image does not list (einops, nvdlfw-inspect,
# pydantic and its needs, which want a newer typing-extensions than the image may hold);
# torch, onnx, onnxscript and packaging are there, and nvidia-cudnn-frontend travels with
# scripts/cudnn_carry.sh.
SMALL=(einops==0.8.2 nvdlfw-inspect==0.2.2 pydantic==2.14.4 pydantic-core==2.50.5
       annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
PIECES=5
LIMIT_MIB=64     # one device call: working tree + carried paths

# shellcheck source=scripts/carry_wheels.sh
source scripts/carry_wheels.sh  # pip, target (the GPU machine's wheel tags), mib

rm -rf .carry/te_split
for i in $(seq 1 $PIECES); do rm -rf ".carry/te$i"; mkdir -p ".carry/te$i"; done
mkdir -p .carry/te_split
"${pip[@]}" download -q "${target[@]}" -d .carry/te_split "$CORE"
"${pip[@]}" download -q "${target[@]}" -d ".carry/te$PIECES" "$META" "${SMALL[@]}"
# pip download would try to build the source distribution to read its metadata; fetch the file.
"${pip[@]}" download -q --no-deps --no-binary :all: --no-build-isolation \
  -d ".carry/te$PIECES" "transformer-engine-torch==$VERSION" 2>/dev/null || true
if [ ! -f ".carry/te$PIECES/$TORCH_SDIST" ]; then
  url=$(curl -fsS https://pypi.org/simple/transformer-engine-torch/ |
        grep -o "https://[^\"#]*/$TORCH_SDIST" | head -1)
  [ -n "$url" ] || { echo "te_carry.sh: no $TORCH_SDIST on PyPI's simple index" >&2; exit 1; }
  curl -fsS -o ".carry/te$PIECES/$TORCH_SDIST" "$url"
fi

big=$(ls .carry/te_split/*.whl)
piece=$(( ($(stat -c %s "$big") + PIECES - 1) / PIECES ))
split -b "$piece" -d -a 1 "$big" ".carry/te_split/$(basename "$big").part"
for i in $(seq 1 $PIECES); do
  mv ".carry/te_split/$(basename "$big").part$((i - 1))" ".carry/te$i/"
done
sha256sum "$big" | awk '{print $1}' > ".carry/te$PIECES/core.sha256"
rm -rf .carry/te_split

# TE's calls carry .carry/teN alone: megatron-core is in .carry/site from scripts/gpu_cudnn.sh.
status=0
tree=$(git ls-files -z --cached --others --exclude-standard |
       xargs -0 -r du -cb 2>/dev/null | awk 'END {print int($1 / 1048576) + 1}')
for i in $(seq 1 $PIECES); do
  size=$(mib ".carry/te$i")
  total=$((size + tree))
  echo "[carry] .carry/te$i: ${size} MiB, with the working tree ${total} MiB"
  if [ "$total" -gt "$LIMIT_MIB" ]; then
    echo "[carry] .carry/te$i + working tree = ${total} MiB: over one call's" \
         "${LIMIT_MIB} MiB" >&2
    status=1
  fi
done
exit $status

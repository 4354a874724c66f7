#!/usr/bin/env bash
# On the lent GPU machine (no network), from the repository root there, two calls in a row
# while the machine stays warm (scripts/cudnn_carry.sh prepared the folders here):
#   bash scripts/gpu_cudnn.sh 1   # carry [".carry/cudnn1"] (+ ".carry/flashmla_so" if a build
#                                 # came back earlier; part 1 needs no .whl, and with it the
#                                 # call passes 64 MiB): keeps part 1 on the machine
#   bash scripts/gpu_cudnn.sh 2   # carry [".carry/cudnn2", ".whl"]: installs, builds FlashMLA
#                                 # (unless part 1 brought a build or CUDNN_SKIP_FLASHMLA=1
#                                 # asks for cuDNN's kernels alone), checks
# Afterwards `export PYTHONPATH=$PWD/.carry/site:$PYTHONPATH` gives every later command on that
# machine cuDNN-frontend's DSA kernels (`from cudnn import DSA`), FlashMLA's sparse forward
# (`from flash_mla import flash_mla_sparse_fwd`) and megatron-core's cudnn backend.
# Part 1's files wait in .carry/stash (ignored, never carried), which lasts only while the
# machine is warm: a part 2 that finds it empty says so. Part 2 copies the FlashMLA build to
# $OUT/flashmla_so when $OUT is set; gzip it into .carry/flashmla_so here (cuda*.so.gz, 3.7 MB:
# the 13 MB .so does not fit beside either part in a call's 64 MiB) and carry it with part 1
# next time to skip the build (~1.5-4 min).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
stash=.carry/stash
# shellcheck source=scripts/carry_install.sh
source scripts/carry_install.sh  # site, py, pip_install
shopt -s nullglob

case "$part" in
  1)
    files=(.carry/cudnn1/*)
    [ ${#files[@]} -gt 0 ] || { echo "gpu_cudnn.sh: .carry/cudnn1 is empty (carry it)" >&2; exit 1; }
    rm -rf "$stash"; mkdir -p "$stash"
    cp "${files[@]}" "$stash/"
    built=(.carry/flashmla_so/cuda*.so.gz)
    [ ${#built[@]} -gt 0 ] && cp "${built[0]}" "$stash/" && echo "[cudnn 1] kept the carried" \
      "FlashMLA build $(basename "${built[0]}")"
    echo "[cudnn 1] kept ${#files[@]} files in $stash; run part 2 now (the machine stays warm 30 s)"
    exit 0 ;;
  2) ;;
  *) echo "usage: bash scripts/gpu_cudnn.sh {1|2}" >&2; exit 2 ;;
esac

[ -f "$stash/SOURCE" ] || {
  echo "gpu_cudnn.sh: $stash has no part 1 (the machine was handed back): run part 1 again" >&2
  exit 1; }
cp .carry/cudnn2/* "$stash/"
big=("$stash"/*.whl.part1)
whl=${big[0]%.part1}
[ -f "$whl.part0" ] && cat "$whl.part0" "$whl.part1" > "$whl"
echo "$(cat "$stash/libs-cu13.sha256")  $whl" | sha256sum -c --quiet - || {
  echo "gpu_cudnn.sh: the reassembled $(basename "$whl") does not match its checksum" >&2; exit 1; }
rm -f "$whl.part0" "$whl.part1"
mkdir -p "$site"
"${pip_install[@]}" "$stash"/*.whl
if ! "$py" -c "import megatron.core" 2>/dev/null; then
  "${pip_install[@]}" .whl/megatron_core-*.whl
fi
# nvidia-cutlass-dsl's .pth is not processed under --target: its packages go on the path here.
export PYTHONPATH=$(pwd)/$site:$(pwd)/$site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}

# CUDNN_SKIP_FLASHMLA=1: cuDNN-frontend's kernels only (what the cudnn-loss and selection
# stages use), no FlashMLA build (~1.5-4 min of device time) and no backend check (it needs it).
if [ -n "${CUDNN_SKIP_FLASHMLA:-}" ]; then
  cat "$stash/SOURCE"
  "$py" -c "from cudnn import DSA; print('[cudnn 2] cuDNN-frontend DSA:', type(DSA).__name__)"
  echo "[cudnn 2] ready without FlashMLA (CUDNN_SKIP_FLASHMLA): export PYTHONPATH=$PYTHONPATH"
  exit 0
fi
# FlashMLA: its sources (part 1) + HyScale's SM90-only binding, built here unless carried.
rm -rf .carry/flashmla && mkdir -p .carry/flashmla
tar -xzf "$stash/flashmla-src.tar.gz" -C .carry
tar -xzf "$stash/cutlass-headers.tar.gz" -C .carry
prebuilt=("$stash"/cuda*.so.gz)
if [ ${#prebuilt[@]} -gt 0 ]; then
  mkdir -p "$site/flash_mla"
  cp .carry/flashmla/flash_mla/*.py "$site/flash_mla/"
  gunzip -c "${prebuilt[0]}" > "$site/flash_mla/$(basename "${prebuilt[0]}" .gz)"
  echo "[cudnn 2] FlashMLA: the carried build $(basename "${prebuilt[0]}")"
else
  "$py" scripts/build_flashmla.py --src .carry/flashmla --out "$site"
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/flashmla_so" && cp "$site"/flash_mla/cuda*.so "$OUT/flashmla_so/"
  fi
fi
cat "$stash/SOURCE"
"$py" scripts/check_cudnn_backend.py
echo "[cudnn 2] ready: export PYTHONPATH=$PYTHONPATH"

#!/usr/bin/env bash
# On the lent GPU machine (no network), from the repository root there, after
# scripts/gpu_cudnn.sh 1 and 2 (TE's torch extension needs nvidia-cudnn-frontend, which they
# install into .carry/site), five calls in a row while the machine stays warm
# (scripts/te_carry.sh prepared the folders here):
#   bash scripts/gpu_te.sh 1 .. 4   # carry [".carry/teN"]: keeps piece N on the machine
#   bash scripts/gpu_te.sh 5        # carry [".carry/te5"]: reassembles and installs
#                                   # transformer-engine-cu13, then builds transformer-engine-torch
#                                   # for SM90 into .carry/site and checks the import
#   bash scripts/gpu_te.sh build    # (no carry) continues a build that a call's limit cut short:
#                                   # ninja keeps the objects in .carry/te_build/build
# Afterwards `export PYTHONPATH=$PWD/.carry/site:$PYTHONPATH` gives every later command on that
# machine `import transformer_engine.pytorch`, so `bash scripts/run.sh test -m gpu` runs the TE
# cases and `bench_layer.py` / `side_by_side.sh --transformer-impl transformer_engine` run TE.
# The pieces wait in .carry/stash_te (ignored, never carried), which lasts only while the
# machine is warm. Knobs: PYTHON, MAX_JOBS (default: every core), BUILD_SECONDS (default 500:
# the build stops there, within one call's 10 minutes, and `build` resumes it).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
stash=.carry/stash_te
build=.carry/te_build
# shellcheck source=scripts/carry_install.sh
source scripts/carry_install.sh  # site, py, pip_install
shopt -s nullglob

case "$part" in
  1|2|3|4)
    files=(.carry/te"$part"/*)
    [ ${#files[@]} -gt 0 ] || { echo "gpu_te.sh: .carry/te$part is empty (carry it)" >&2; exit 1; }
    [ "$part" = 1 ] && rm -rf "$stash"
    mkdir -p "$stash"
    cp "${files[@]}" "$stash/"
    echo "[te $part] kept ${#files[@]} file(s) in $stash; run part $((part + 1)) now (30 s)"
    exit 0 ;;
  5|build) ;;
  *) echo "usage: bash scripts/gpu_te.sh {1|2|3|4|5|build}" >&2; exit 2 ;;
esac

[ -d "$site/cudnn" ] || {
  echo "gpu_te.sh: $site has no cudnn (nvidia-cudnn-frontend): run scripts/gpu_cudnn.sh 1 and 2" \
       "first, on the same warm machine" >&2; exit 1; }
export PYTHONPATH=$(pwd)/$site:$(pwd)/$site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}

if [ "$part" = 5 ]; then
  cp .carry/te5/* "$stash/"
  pieces=("$stash"/*.whl.part*)
  [ ${#pieces[@]} -eq 5 ] || {
    echo "gpu_te.sh: $stash holds ${#pieces[@]} of 5 pieces (the machine was handed back?):" \
         "run parts 1-4 again" >&2; exit 1; }
  whl=${pieces[0]%.part*}
  cat "${pieces[@]}" > "$whl"   # the glob sorts part0 .. part4
  echo "$(cat "$stash/core.sha256")  $whl" | sha256sum -c --quiet - || {
    echo "gpu_te.sh: the reassembled $(basename "$whl") does not match its checksum" >&2; exit 1; }
  rm -f "${pieces[@]}"
  mkdir -p "$site"
  "${pip_install[@]}" "$stash"/*.whl
  rm -rf "$build" && mkdir -p "$build"
  tar -xzf "$stash"/transformer_engine_torch-*.tar.gz -C "$build" --strip-components 1
  echo "[te 5] installed $(basename "$whl") and TE's Python needs; building the torch extension"
fi

[ -f "$build/setup.py" ] || {
  echo "gpu_te.sh build: no sources in $build: run part 5 first" >&2; exit 1; }
# The sources try to download a prebuilt wheel first (no network here): build them. SM90 only.
# NVTE_NO_LOCAL_VERSION: without it the version takes the enclosing git checkout's commit
# ("2.20.2+e8f0dae", 2026-12-03), and transformer_engine refuses to load an extension whose
# version differs from transformer-engine's.
export NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 NVTE_FRAMEWORK=pytorch NVTE_NO_LOCAL_VERSION=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
started=$(date +%s)
set +e
# A wheel, not the bare extension: transformer_engine looks the distribution up by name when it
# loads its torch extension. Objects stay in $build/build between calls (ninja resumes).
(cd "$build" && timeout "${BUILD_SECONDS:-500}" "$py" setup.py bdist_wheel -d dist) \
  > "$build/build.log" 2>&1
rc=$?
set -e
echo "[te build] exit $rc after $(( $(date +%s) - started )) s (log: $build/build.log)"
tail -15 "$build/build.log"
if [ $rc -eq 124 ]; then
  echo "[te build] stopped at BUILD_SECONDS: call 'bash scripts/gpu_te.sh build' now (warm)" >&2
  exit 3
fi
[ $rc -eq 0 ] || exit $rc
# One pip run for TE's wheels and the extension's: they share the transformer_engine folder, and
# pip's --target --upgrade replaces a top-level folder whole, so the extension's wheel installed
# alone removed transformer_engine.pytorch (2026-12-03). Merged into $site afterwards.
rm -rf "$build/te_site"
"$py" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$build/te_site" \
  "$stash"/*.whl "$build"/dist/transformer_engine_torch-*.whl
cp -a "$build/te_site/." "$site/"
"$py" - <<'EOF'
import torch
import transformer_engine
import transformer_engine.pytorch as te

layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
layer(x).sum().backward()
print(f"[te] transformer_engine {transformer_engine.__version__}: te.Linear forward + backward "
      f"on {torch.cuda.get_device_name()}")
EOF
echo "[te] ready: export PYTHONPATH=$PYTHONPATH"

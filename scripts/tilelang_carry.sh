#!/usr/bin/env bash
# Run HERE (a machine with network), before a GPU session that should time megatron-core's
# stock DSA with its TileLang kernels (`scripts/bench_layer.py --stock-kernel-backend tilelang`):
#   bash scripts/tilelang_carry.sh
# The lent GPU machine has no network and a device call takes at most 64 MiB (the working tree
# plus the carried ignored paths), so the wheels TileLang needs and that GPU image lacks are
# split in two folders, each of which fits one call together with .whl/ (megatron-core):
#   .carry/tl1  tilelang                                   (~47 MiB)
#   .carry/tl2  z3-solver, apache-tvm-ffi, torch-c-dlpack-ext (~31 MiB)
# TileLang's other requirements (numpy, cloudpickle, ml-dtypes, psutil, tqdm,
# typing-extensions, torch) are already in the GPU image. scripts/gpu_tilelang.sh installs
# the two folders there. Knob: HYSCALE_PIP (default: the repository's .venv python -m pip).
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned so that the sizes below stay true; tilelang 0.1.15 asks for apache-tvm-ffi
# >=0.1.11,<0.1.13 and z3-solver >=4.13,<4.15.5.
PART1=(tilelang==0.1.15)
PART2=(z3-solver==4.15.4.0 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5)
MEGATRON=megatron-core==0.19.2
LIMIT_MIB=64     # one device call: working tree + carried paths
FOLDER_MIB=60    # each tl folder, leaving room for .whl/

# shellcheck source=scripts/carry_wheels.sh
source scripts/carry_wheels.sh  # pip, target (the GPU machine's wheel tags), mib

rm -rf .carry/tl1 .carry/tl2  # stale wheels would push a folder over the limit
mkdir -p .carry/tl1 .carry/tl2 .whl
"${pip[@]}" download -q "${target[@]}" -d .carry/tl1 "${PART1[@]}"
"${pip[@]}" download -q "${target[@]}" -d .carry/tl2 "${PART2[@]}"
if ! compgen -G ".whl/megatron_core-*.whl" >/dev/null; then
  "${pip[@]}" download -q "${target[@]}" -d .whl "$MEGATRON"
fi

status=0
whl=$(mib .whl)
# What travels anyway: tracked and untracked-not-ignored files.
tree=$(git ls-files -z --cached --others --exclude-standard |
       xargs -0 -r du -cb 2>/dev/null | awk 'END {print int($1 / 1048576) + 1}')
for part in tl1 tl2; do
  size=$(mib ".carry/$part")
  echo "[carry] .carry/$part: ${size} MiB ($(ls ".carry/$part" | tr '\n' ' '))"
  total=$((size + whl + tree))
  if [ "$size" -gt "$FOLDER_MIB" ] || [ "$total" -gt "$LIMIT_MIB" ]; then
    echo "[carry] .carry/$part + .whl + working tree = ${total} MiB: over one call's" \
         "${LIMIT_MIB} MiB" >&2
    status=1
  fi
done
echo "[carry] .whl: ${whl} MiB ($(ls .whl | tr '\n' ' ')); working tree: ${tree} MiB"
exit $status

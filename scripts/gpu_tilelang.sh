#!/usr/bin/env bash
# On the lent GPU machine (no network), from the repository root there:
#   bash scripts/gpu_tilelang.sh 1    # carry [".carry/tl1", ".whl"]: tilelang
#   bash scripts/gpu_tilelang.sh 2    # carry [".carry/tl2", ".whl"]: its dependencies + check
# Installs the wheels that scripts/tilelang_carry.sh put in .carry/tl1 / .carry/tl2 into
# .carry/site (and megatron-core from .whl/ when the image lacks it), so that
#   PYTHONPATH=.carry/site:$PYTHONPATH python3 scripts/bench_layer.py --stock-kernel-backend tilelang
# runs. One call cannot carry all of them (64 MiB), hence two parts; .carry/site is an
# ignored folder, so it survives between the calls only while the machine stays warm: run
# part 2 (and the benchmark) right after part 1. Part 2 fails when part 1's tilelang is gone.
set -euo pipefail
cd "$(dirname "$0")/.."

part=${1:-}
case "$part" in
  1|2) src=.carry/tl$part ;;
  *) echo "usage: bash scripts/gpu_tilelang.sh {1|2}" >&2; exit 2 ;;
esac
# shellcheck source=scripts/carry_install.sh
source scripts/carry_install.sh  # site, py, pip_install

shopt -s nullglob
wheels=("$src"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "gpu_tilelang.sh: no wheels in $src (run scripts/tilelang_carry.sh here, then carry" \
       "\"$src\" with this call)" >&2
  exit 1
fi
mkdir -p "$site"
echo "[tilelang $part] installing ${wheels[*]##*/} into $site"
"${pip_install[@]}" "${wheels[@]}"

export PYTHONPATH=$(pwd)/$site:${PYTHONPATH:-}
if ! "$py" -c "import megatron.core" 2>/dev/null; then
  megatron=(.whl/megatron_core-*.whl)
  if [ ${#megatron[@]} -eq 0 ]; then
    echo "gpu_tilelang.sh: megatron-core does not import and .whl/ holds no wheel of it" \
         "(carry \".whl\")" >&2
    exit 1
  fi
  echo "[tilelang $part] installing ${megatron[*]##*/} into $site"
  "${pip_install[@]}" "${megatron[@]}"
fi
[ "$part" = 1 ] && exit 0

if [ ! -d "$site/tilelang" ]; then
  echo "gpu_tilelang.sh: $site/tilelang is missing: the machine was handed back after part 1;" \
       "run part 1 again, then part 2" >&2
  exit 1
fi
# Whatever TileLang needs that neither the image nor the two parts provide shows up here.
"$py" - <<'EOF'
import importlib
import sys

missing = []
for name in ("numpy", "cloudpickle", "ml_dtypes", "psutil", "tqdm", "typing_extensions", "z3",
             "tvm_ffi", "torch_c_dlpack_ext", "tilelang"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # report every failing import, not just the first
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    sys.exit("gpu_tilelang.sh: these do not import: " + "; ".join(missing))

import tilelang
import tilelang.env
import torch
from megatron.core.utils import _missing_tilelang_dsa_kernel_dependencies

print(f"tilelang {tilelang.__version__} from {tilelang.__file__}")
print(f"CUDA_HOME for TileLang's nvcc: {tilelang.env.CUDA_HOME or '(none found)'}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
gaps = _missing_tilelang_dsa_kernel_dependencies()
if gaps:
    sys.exit(f"gpu_tilelang.sh: megatron-core still misses: {', '.join(gaps)}")
print("megatron-core's TileLang DSA kernels import: dsa_kernel_backend='tilelang' is usable")
EOF
echo "[tilelang 2] ready: export PYTHONPATH=$site:\$PYTHONPATH"

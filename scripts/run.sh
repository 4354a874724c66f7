#!/usr/bin/env bash
# The two entry points of the project, each working on a fresh machine:
#   bash scripts/run.sh demo [demo args]   - train the tiny DSA model (HyScale vs stock spec)
#   bash scripts/run.sh test [pytest args] - the test suite (CPU; GPU cases run where CUDA is)
# It creates (or reuses) a virtual environment and installs the package with what it needs.
# Knobs: HYSCALE_PYTHON (a Python >= 3.12), HYSCALE_VENV (default .venv in the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

find_python() {
  local c
  for c in "${HYSCALE_PYTHON:-}" /root/.pyenv/versions/3.12.1/bin/python3 python3.12 python3.13 python3; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "scripts/run.sh: no Python >= 3.12 found (megatron-core needs it); set HYSCALE_PYTHON" >&2
  return 1
}

venv=${HYSCALE_VENV:-$root/.venv}
stamp_src=$(cat pyproject.toml requirements/pinned.txt | sha256sum | cut -c1-16)
if [ ! -x "$venv/bin/python" ]; then
  py=$(find_python)
  echo "[setup] creating $venv with $py"
  "$py" -m venv "$venv"
fi
if [ "$(cat "$venv/.hyscale-stamp" 2>/dev/null)" != "$stamp_src" ]; then
  echo "[setup] installing megatron-hyscale and its dependencies into $venv (first run: a few minutes)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -c requirements/pinned.txt -e ".[test,demo]"
  echo "$stamp_src" > "$venv/.hyscale-stamp"
fi
py="$venv/bin/python"

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    exec "$py" -m megatron_hyscale.demo "$@" ;;
  test)
    # One intra-op thread: the tests are many small ops, and on a 2-core box two threads
    # per op oversubscribe (the suite ran 3x slower). Override by setting it yourself.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # pytest exits 5 when a selection matches no test: that is a failure here too.
    exec "$py" -m pytest "$@" ;;
  *)
    echo "usage: bash scripts/run.sh {demo|test} [args]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The two entry points of the project, each working on a fresh machine:
#   bash scripts/run.sh demo [demo args]   - train the tiny DSA model (HyScale vs stock spec)
#   bash scripts/run.sh test [pytest args] - the test suite (CPU; GPU cases run where CUDA is)
# It creates (or reuses) a virtual environment and installs the package with what it needs.
# Knobs: HYSCALE_PYTHON (a Python >= 3.12), HYSCALE_VENV (default .venv in the repository).

# Python >= 3.12 (megatron-core needs it). The first that runs and is new enough wins:
# $HYSCALE_PYTHON alone when it is set; else python3.12, python3.13, python3 on PATH; else, where
# pyenv is installed, its interpreters: `pyenv which`, then $(pyenv root)/versions/*/bin/python3
# with 3.12.x first (the version the pins are tested with), newest first. Candidates that fail to
# run (a pyenv shim of a version not selected exits 127) are skipped.
python_candidates() {
  if [ -n "${HYSCALE_PYTHON:-}" ]; then
    echo "$HYSCALE_PYTHON"; return 0
  fi
  local c pyenv_root
  for c in python3.12 python3.13 python3; do
    command -v "$c" 2>/dev/null || true
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in python3.12 python3.13 python3; do
      pyenv which "$c" 2>/dev/null || true
    done
    pyenv_root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
    { ls -d "$pyenv_root"/versions/3.12*/bin/python3 2>/dev/null | sort -rV
      ls -d "$pyenv_root"/versions/*/bin/python3 2>/dev/null | sort -rV; } || true
  fi
}

find_python() {
  local c
  while IFS= read -r c; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done < <(python_candidates)
  if [ -n "${HYSCALE_PYTHON:-}" ]; then
    echo "scripts/run.sh: HYSCALE_PYTHON=$HYSCALE_PYTHON is not a Python >= 3.12 that runs" >&2
  else
    echo "scripts/run.sh: no Python >= 3.12 found on PATH or in pyenv (megatron-core needs it);" \
         "set HYSCALE_PYTHON=/path/to/python3.12" >&2
  fi
  return 1
}

# Sourced (the tests do, to check find_python): define the functions and stop here.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  return 0
fi

set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

venv=${HYSCALE_VENV:-$root/.venv}
stamp_src=$(cat pyproject.toml requirements/pinned.txt | sha256sum | cut -c1-16)
if [ ! -x "$venv/bin/python" ]; then
  py=$(find_python)
  echo "[setup] creating $venv with $py (Python $("$py" -c 'import sys; print(sys.version.split()[0])'))"
  echo "[setup] another interpreter: HYSCALE_PYTHON=/path/to/python3.12+ (and HYSCALE_VENV=<new dir>, or remove $venv)"
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
    # Two worker processes (pytest-xdist) where no GPU is: the suite is CPU-bound and a
    # 2-core CI box ran it serially in 74 min (1788 tests, 2026-12-06), in 40-47 with two. On a
    # GPU machine one process, so GPU cases do not share the device. HYSCALE_TEST_WORKERS
    # overrides (1: no workers).
    workers=${HYSCALE_TEST_WORKERS:-}
    if [ -z "$workers" ]; then
      if command -v nvidia-smi > /dev/null 2>&1; then workers=1; else workers=2; fi
    fi
    case $workers in
      ''|*[!0-9]*|0) echo "run.sh: HYSCALE_TEST_WORKERS must be a positive integer, got" \
                       "'$workers'" >&2; exit 2 ;;
    esac
    xdist=()
    [ "$workers" -gt 1 ] && xdist=(-n "$workers")
    # pytest exits 5 when a selection matches no test: that is a failure here too.
    exec "$py" -m pytest "${xdist[@]}" "$@" ;;
  *)
    echo "usage: bash scripts/run.sh {demo|test} [args]" >&2; exit 2 ;;
esac

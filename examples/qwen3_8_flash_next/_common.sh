# Sourced by the launch scripts in this folder: finds the repository and a Python for launch.py.
# The launcher itself needs only the standard library; the bench processes use --python
# (default: HYSCALE_PYTHON, else this interpreter), which must have torch, megatron-core and
# triton.

# Under sbatch the script runs from a spool copy, so its own path does not lead to the
# repository: use HYSCALE_DIR, else the submit directory when it is the repository root.
if [ -n "${HYSCALE_DIR:-}" ]; then
  hyscale_root=$HYSCALE_DIR
elif [ -n "${SLURM_JOB_ID:-}" ] && [ -f "${SLURM_SUBMIT_DIR:-}/examples/qwen3_8_flash_next/launch.py" ]; then
  hyscale_root=$SLURM_SUBMIT_DIR
else
  hyscale_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
fi
if [ ! -f "$hyscale_root/examples/qwen3_8_flash_next/launch.py" ]; then
  echo "cannot find the HyScale repository (looked in $hyscale_root); set HYSCALE_DIR" >&2
  exit 2
fi
if [ -n "${HYSCALE_PYTHON:-}" ]; then
  hyscale_python=$HYSCALE_PYTHON
elif [ -x "$hyscale_root/.venv/bin/python" ]; then
  hyscale_python=$hyscale_root/.venv/bin/python
else
  hyscale_python=python3
fi

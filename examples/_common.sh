# Sourced by the launch scripts under examples/: finds the repository and a Python for the
# launchers. They need only the standard library; the processes they start use --python
# (default: HYSCALE_PYTHON, else this interpreter), which must have torch, triton,
# megatron-core (and Transformer Engine where the run asks for it) and HyScale.

# Under sbatch the script runs from a spool copy, so its own path does not lead to the
# repository: use HYSCALE_DIR, else the submit directory when it is the repository root.
if [ -n "${HYSCALE_DIR:-}" ]; then
  hyscale_root=$HYSCALE_DIR
elif [ -n "${SLURM_JOB_ID:-}" ] && [ -f "${SLURM_SUBMIT_DIR:-}/megatron_hyscale/__init__.py" ]; then
  hyscale_root=$SLURM_SUBMIT_DIR
else
  hyscale_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fi
if [ ! -f "$hyscale_root/megatron_hyscale/__init__.py" ]; then
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

# Sourced by the *_carry.sh scripts (run HERE, with network): how they download wheels for the
# lent GPU machine. Sets `pip` (HYSCALE_PIP, else the repository's .venv, else python3 -m pip),
# `target` (pip download flags for its CPython 3.12 on x86_64 Linux, glibc >= 2.28: pip does
# not widen a --platform to older manylinux tags, so they are listed; z3-solver ships
# manylinux_2_17 only) and `mib` (MiB on disk of its arguments).
if [ -n "${HYSCALE_PIP:-}" ]; then
  read -r -a pip <<<"$HYSCALE_PIP"
elif [ -x .venv/bin/python ]; then
  pip=(.venv/bin/python -m pip)
else
  pip=(python3 -m pip)
fi
target=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp)
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
  target+=(--platform "${tag}_x86_64")
done
mib() { du -sm "$@" | awk '{s += $1} END {print s}'; }

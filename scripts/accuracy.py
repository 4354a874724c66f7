"""Accuracy against float64: HyScale's layer and its stock counterpart, each on the same weights.

The command line of `hyscale_bench.accuracy` from a checkout (installed: `python -m
hyscale_bench.accuracy`); `--help` lists the options.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyscale_bench.accuracy import cli  # noqa: E402

if __name__ == "__main__":
    cli()

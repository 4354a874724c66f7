"""One sparse-attention layer, forward + backward under full recompute: HyScale vs its baseline.

The command line of `hyscale_bench.layer` from a checkout (installed: `python -m
hyscale_bench.layer`); `--help` lists the options.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyscale_bench.layer import cli  # noqa: E402

if __name__ == "__main__":
    cli()

"""FP8 against bf16 selection in training (the demo twice) and their top-k overlap.

The command line of `hyscale_bench.indexer_precision` from a checkout (installed: `python -m
hyscale_bench.indexer_precision`); `--help` lists the options.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyscale_bench.indexer_precision import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])

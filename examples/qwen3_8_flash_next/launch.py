#!/usr/bin/env python3
"""Qwen3.8-Flash-Next QSA layer runs of hyscale_bench.layer: the logic behind the scripts.

    launch.py full                 32 GPUs (4 x 8), 1M tokens, CP 8 x DP 4 (Slurm)
    launch.py small [--gpus 1|2]   1 GPU: 16K .. 512K; 2 GPUs: CP 2 up to 1M
    launch.py memory --seq 1048576 --cp 2

--dry-run prints the per-GPU memory estimate and the exact commands and starts nothing.
`--model dsa` runs the GLM-5.1 DSA layer at the same layout for comparison. See README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_hyscale.launch.layer_run import Example, LayerRun, main  # noqa: E402

MILLION = 1 << 20
EXAMPLE = Example(
    name="qwen3_8_flash_next",
    models=("qsa", "dsa"),
    # CP 8 inside each node (the all-gathers stay on NVLink), 4 replicas across the nodes.
    full=LayerRun(label="qwen3.8 QSA 1M, 4 x 8 GPUs", model="qsa", seq=(MILLION,), nodes=4,
                  gpus_per_node=8, cp=8, dp=4, out="outputs/bench_layer/qsa_1m_32gpu"),
    small={
        1: LayerRun(label="qwen3.8 QSA, 1 GPU", model="qsa",
                    seq=(16384, 32768, 65536, 131072, 262144, 524288),
                    out="outputs/bench_layer/qsa_1gpu"),
        2: LayerRun(label="qwen3.8 QSA, 2 GPUs (CP 2)", model="qsa",
                    seq=(262144, 524288, MILLION), gpus_per_node=2, cp=2,
                    out="outputs/bench_layer/qsa_cp2"),
    },
)

if __name__ == "__main__":
    sys.exit(main(EXAMPLE))

#!/usr/bin/env python3
"""DeepSeek-V4-Flash layer runs of hyscale_bench.layer: the logic behind this folder's scripts.

    launch.py full [--model csa|hca|dsa]   32 GPUs (4 x 8), 1M tokens, CP 8 x DP 4 (Slurm)
    launch.py small [--gpus 1|2]           1 GPU: CSA (or --model hca) at 16K .. 256K;
                                           2 GPUs: CSA at CP 2, 128K to 1M (rows in
                                           parts of 128K)
    launch.py memory --model csa --seq 131072 [--cp 1]

--dry-run prints the per-GPU memory estimate and the exact commands and starts nothing.
The default model is csa, the layer the paper reports; `full --model dsa` runs the GLM-5.1 DSA
layer at the same layout for comparison. See README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_hyscale.launch.layer_run import Example, LayerRun, main  # noqa: E402

MILLION = 1 << 20
EXAMPLE = Example(
    name="deepseek_v4_flash",
    models=("csa", "hca", "dsa"),
    # CP 8 inside each node (the all-gathers stay on NVLink), 4 replicas across the nodes.
    full=LayerRun(label="v4-flash 1M, 4 x 8 GPUs", model="csa", seq=(MILLION,), nodes=4,
                  gpus_per_node=8, cp=8, dp=4, out="outputs/bench_layer/v4_flash_1m_32gpu"),
    small={
        1: LayerRun(label="v4-flash, 1 GPU", model="csa",
                    seq=(16384, 32768, 65536, 131072, 262144),
                    out="outputs/bench_layer/v4_flash_1gpu"),
        2: LayerRun(label="v4-flash CSA, 2 GPUs (CP 2)", model="csa",
                    seq=(131072, 262144, 524288, MILLION), gpus_per_node=2, cp=2,
                    row_chunk=131072,
                    out="outputs/bench_layer/v4_flash_csa_cp2"),
    },
    notes=("At 1M tokens on 2 GPUs (CP 2) the CSA layer needs about 235 GiB per GPU by the "
           "estimate, mostly the 64 x 512 query and attention activations of 512K local rows; "
           "in parts of 128K rows (--row-chunk, each part checkpointed) 92 GiB.",),
)

if __name__ == "__main__":
    sys.exit(main(EXAMPLE))

"""scripts/profile_layer_memory.py: the allocator-history replay that finds a step's peak."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import profile_layer_memory as plm  # noqa: E402

HERE = [{"filename": "/x/megatron_hyscale/layers/csa.py", "line": 10, "name": "forward"}]
TORCH = [{"filename": "/site/torch/autograd/function.py", "line": 5, "name": "apply"}]


def _alloc(addr: int, size: int, frames: list | None = None) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames or []}


def _free(addr: int, size: int) -> dict:
    return {"action": "free_requested", "addr": addr, "size": size}


def test_peak_is_the_largest_live_sum_and_its_blocks() -> None:
    trace = [
        {"action": "alloc", "addr": 99, "size": 1, "frames": []},
        _free(99, 1),
        _free(7, 1000),  # a block from before the trace: not counted, not an error
        _alloc(1, 100, TORCH + HERE),
        _alloc(2, 50),
        _free(1, 100),
        _alloc(3, 120, HERE),
        _alloc(4, 10),  # peak here: 50 + 120 + 10 = 180
        _free(3, 120),
        _alloc(5, 100),  # 160 < 180
        {"action": "free_completed", "addr": 5, "size": 100},  # not a second free
    ]
    peak, blocks, at = plm.peak_live_blocks(trace)
    assert peak == 180
    assert at == 7
    assert sorted(b["addr"] for b in blocks) == [2, 3, 4]
    rows = plm.by_site(blocks)
    assert rows[0]["bytes"] == 120 and rows[0]["site"] == "layers/csa.py:10 forward"
    assert rows[1]["bytes"] == 60 and rows[1]["site"] == "(no stack)"


def test_site_skips_torch_frames() -> None:
    assert plm.site_of(TORCH + HERE) == "layers/csa.py:10 forward"
    node = [{"filename": "??", "line": 0,
             "name": "torch::autograd::generated::MulBackward0::apply(std::vector<at::Tensor>)"}]
    assert plm.site_of(node + TORCH + HERE) == "layers/csa.py:10 forward <- MulBackward0"
    assert plm.site_of(TORCH) == "(torch internal)"
    assert plm.user_stack(TORCH + HERE + HERE, depth=1) == ["layers/csa.py:10 forward"]


def test_refuses_without_cuda() -> None:
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_layer_memory.py")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "profile_layer_memory.py needs a CUDA GPU" in proc.stderr

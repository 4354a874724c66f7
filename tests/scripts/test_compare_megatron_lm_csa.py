"""scripts/compare_megatron_lm_csa.py: its argument checks and its rotary stand-in.

The comparison itself needs Megatron-LM's csa.py (dev branch, not in megatron-core 0.19.2): set
HYSCALE_MEGATRON_LM_CSA to that file to run it here too (BENCHMARKS.md has the recorded run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_megatron_lm_csa.py"


def _import_script():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compare_megatron_lm_csa
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return compare_megatron_lm_csa


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--csa", str(tmp_path / "none.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--csa" in proc.stderr


def test_rotary_keeps_the_channel_order_and_inverse_undoes_it() -> None:
    script = _import_script()
    g = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 3, 24, generator=g)
    # Zero angles: only the channel order moves (de-interleaved, unless restored).
    zero = torch.zeros(7, 1, 1, 16)
    torch.testing.assert_close(script.rotary(t, zero, mla_rotary_interleaved=True,
                                             mla_output_remove_interleaving=True), t)
    moved = script.rotary(t, zero, mla_rotary_interleaved=True)
    torch.testing.assert_close(moved[..., :16], torch.cat((t[..., 0:16:2], t[..., 1:16:2]), -1))
    half = torch.randn(7, 1, 1, 8, generator=g)
    freqs = torch.cat([half, half], dim=-1)  # megatron's layout: each angle for both halves
    # Interleaved with the original channel order restored: the inverse rotation undoes it.
    once = script.rotary(t, freqs, mla_rotary_interleaved=True,
                         mla_output_remove_interleaving=True)
    back = script.rotary(once, freqs, mla_rotary_interleaved=True, inverse=True,
                         mla_output_remove_interleaving=True)
    torch.testing.assert_close(back, t, rtol=1e-5, atol=1e-5)
    assert (once - t).abs().max() > 0.1


def test_hadamard_is_orthonormal() -> None:
    script = _import_script()
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    y = script.hadamard(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(script.hadamard(y), x, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not os.environ.get("HYSCALE_MEGATRON_LM_CSA"),
                    reason="set HYSCALE_MEGATRON_LM_CSA to Megatron-LM's csa.py (dev branch)")
def test_megatron_lm_csa_matches_hyscale() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--csa",
                           os.environ["HYSCALE_MEGATRON_LM_CSA"]],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

"""The wheel carries megatron_hyscale and hyscale_bench, and runs a benchmark without a checkout.

The wheel is built from a copy of the packaging inputs (the build writes build/ and egg-info
beside its sources), installed with `pip install --target` into a temporary folder, and a tiny
CPU layer benchmark runs from there in a process whose working directory is empty and whose
PYTHONPATH is that folder alone; the process checks that both packages load from it (the
repository's editable install would otherwise stand in for a missing file).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ("pyproject.toml", "README.md", "megatron_hyscale", "hyscale_bench")
TIMEOUT_S = 300

RUN_FROM_SITE = """
import runpy, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
import hyscale_bench, megatron_hyscale
for package in (hyscale_bench, megatron_hyscale):
    assert Path(package.__file__).resolve().is_relative_to(site), package.__file__
sys.argv = ["hyscale_bench.layer", *sys.argv[2:]]
runpy.run_module("hyscale_bench.layer", run_name="__main__", alter_sys=True)
"""


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_wheel_runs_a_tiny_layer_benchmark(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in PACKAGING:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheels),
         str(source), cwd=tmp_path)
    (wheel,) = wheels.glob("megatron_hyscale-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"megatron_hyscale",
                                                                "hyscale_bench"}
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel),
         cwd=tmp_path)

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                        "MASTER_PORT")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
               HYSCALE_RESULTS=str(tmp_path / "results"))
    proc = subprocess.run(
        [sys.executable, "-c", RUN_FROM_SITE, str(site), "--model", "dsa", "--device", "cpu",
         "--tiny", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, cwd=work, env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "bench_layer_dsa.json").read_text())
    assert data["model"] == "dsa" and data["tiny"]
    assert data["rows"] and isinstance(data["rows"][0]["hyscale"], dict)
    assert not any(work.iterdir())  # nothing written where it was run from

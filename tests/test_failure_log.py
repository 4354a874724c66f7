"""tests/conftest.py writes each failure to $HYSCALE_FAILURE_LOG as it happens (a GPU call cut
off by its time limit never prints pytest's summary): one failing and one passing test run in
a child pytest with this repository's conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def test_a_failure_is_logged_when_it_happens(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_demo.py").write_text(
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n\n"
        "def test_passes():\n    pass\n")
    log = tmp_path / "failures.log"
    env = {**os.environ, "HYSCALE_FAILURE_LOG": str(log)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_demo.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:]
    text = log.read_text()
    assert "FAILED test_demo.py::test_fails (call)" in text and "arithmetic" in text
    assert "test_passes" not in text

"""scripts/gpu_te.sh on a machine without a GPU: the five carried pieces of Transformer Engine's
core wheel are kept and put back together (checksum checked) before anything is installed, and
each way the calls can go wrong stops with a message naming what to do."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL = "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl"


def _layout(tmp_path: Path, *, cudnn: bool = True, checksum_of: bytes | None = None) -> Path:
    """A copy of the script in a repository layout with .carry/te1..te5 as te_carry.sh leaves
    them (a fake 'wheel' split in five pieces) and, if `cudnn`, gpu_cudnn.sh's .carry/site."""
    work = tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    for script in ("gpu_te.sh", "carry_install.sh"):
        (work / "scripts" / script).write_text((ROOT / "scripts" / script).read_text())
    payload = bytes(range(256)) * 40
    size = -(-len(payload) // 5)
    for i in range(5):
        part = work / ".carry" / f"te{i + 1}"
        part.mkdir(parents=True)
        (part / f"{WHEEL}.part{i}").write_bytes(payload[i * size:(i + 1) * size])
    digest = hashlib.sha256(payload if checksum_of is None else checksum_of).hexdigest()
    (work / ".carry" / "te5" / "core.sha256").write_text(digest + "\n")
    if cudnn:
        (work / ".carry" / "site" / "cudnn").mkdir(parents=True)
    return work


def _run(work: Path, part: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(work / "scripts" / "gpu_te.sh"), part],
                          capture_output=True, text=True, timeout=60)


def test_pieces_are_kept_then_reassembled_and_checked(tmp_path: Path) -> None:
    work = _layout(tmp_path, checksum_of=b"another wheel")
    for part in "1234":
        proc = _run(work, part)
        assert proc.returncode == 0, proc.stderr
        assert f"[te {part}] kept 1 file(s)" in proc.stdout
    proc = _run(work, "5")
    assert proc.returncode == 1
    assert f"the reassembled {WHEEL} does not match its checksum" in proc.stderr
    stash = work / ".carry" / "stash_te"
    assert len(list(stash.glob("*.part*"))) == 5  # nothing removed before the check passed


def test_the_reassembled_wheel_is_the_original(tmp_path: Path) -> None:
    work = _layout(tmp_path)
    for part in "1234":
        assert _run(work, part).returncode == 0
    proc = _run(work, "5")
    # The checksum passes, so the script goes on to pip: the fake wheel cannot install.
    assert "does not match its checksum" not in proc.stderr
    assert (work / ".carry" / "stash_te" / WHEEL).read_bytes() == bytes(range(256)) * 40
    assert proc.returncode != 0


def test_a_missing_piece_names_the_parts_to_run_again(tmp_path: Path) -> None:
    work = _layout(tmp_path)
    for part in "124":
        assert _run(work, part).returncode == 0
    proc = _run(work, "5")
    assert proc.returncode == 1
    assert "holds 4 of 5 pieces" in proc.stderr and "run parts 1-4 again" in proc.stderr


def test_without_the_cudnn_install_part_5_says_to_run_it_first(tmp_path: Path) -> None:
    work = _layout(tmp_path, cudnn=False)
    proc = _run(work, "5")
    assert proc.returncode == 1 and "run scripts/gpu_cudnn.sh 1 and 2" in proc.stderr


def test_build_without_sources_and_a_bad_part(tmp_path: Path) -> None:
    work = _layout(tmp_path)
    proc = _run(work, "build")
    assert proc.returncode == 1 and "run part 5 first" in proc.stderr
    proc = _run(work, "6")
    assert proc.returncode == 2 and "usage: bash scripts/gpu_te.sh" in proc.stderr


def _wheel(path: Path, dist: str, files: dict[str, str]) -> None:
    """A minimal pure-Python wheel at `path` holding `files` (name -> text)."""
    import zipfile

    info = f"{dist}-2.20.2.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 2.20.2\n",
            f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                             "Tag: py3-none-any\n"}
    entries = {**files, **meta}
    record = "".join(f"{name},,\n" for name in entries) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in {**entries, f"{info}/RECORD": record}.items():
            zf.writestr(name, text)


def test_build_installs_the_extension_beside_te_without_a_local_version(tmp_path: Path) -> None:
    """The built extension's wheel and TE's core wheel share the transformer_engine folder: after
    `build` both are in .carry/site (2026-12-03 on the H200 the extension's wheel, installed
    alone with --upgrade, replaced the folder and with it transformer_engine.pytorch), and the
    build ran with NVTE_NO_LOCAL_VERSION=1 (else its version carries the checkout's commit and
    TE refuses to load it)."""
    import sys

    work = _layout(tmp_path)
    stash, build = work / ".carry" / "stash_te", work / ".carry" / "te_build"
    stash.mkdir(parents=True)
    build.mkdir(parents=True)
    _wheel(stash / WHEEL.replace("manylinux_2_28_x86_64", "any"), "transformer_engine_cu13",
           {"transformer_engine/__init__.py": "", "transformer_engine/pytorch/__init__.py": ""})
    _wheel(build / "ext.whl", "transformer_engine_torch",
           {"transformer_engine/wheel_lib/extension.txt": "built"})
    (build / "setup.py").write_text(
        "import os, shutil\n"
        "assert os.environ.get('NVTE_NO_LOCAL_VERSION') == '1', 'local version on'\n"
        "os.makedirs('dist', exist_ok=True)\n"
        "shutil.copy('ext.whl', 'dist/transformer_engine_torch-2.20.2-py3-none-any.whl')\n")
    proc = subprocess.run(["bash", str(work / "scripts" / "gpu_te.sh"), "build"],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": "/tmp"})
    assert "[te build] exit 0" in proc.stdout, proc.stdout + proc.stderr
    site = work / ".carry" / "site" / "transformer_engine"
    assert (site / "pytorch" / "__init__.py").is_file()
    assert (site / "wheel_lib" / "extension.txt").read_text() == "built"
    assert proc.returncode != 0  # the closing import check needs the real TE and a GPU

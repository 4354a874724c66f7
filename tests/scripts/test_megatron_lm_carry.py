"""scripts/megatron_lm_carry.sh extracts the three Megatron-LM files from a git repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_extracts_files_at_ref(tmp_path: Path) -> None:
    repo = tmp_path / "mlm"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    for name in (*FILES, "other.py"):
        (repo / name).write_text(f"# {name}\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.email=a@b", "-c", "user.name=t", "commit", "-qm", "x")
    _git(repo, "branch", "core_r0.19.0")
    work = tmp_path / "work"  # a copy of the script's repository layout
    (work / "scripts").mkdir(parents=True)
    script = work / "scripts" / "megatron_lm_carry.sh"
    script.write_text((ROOT / "scripts" / "megatron_lm_carry.sh").read_text())
    proc = subprocess.run(["bash", str(script), str(repo)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    dest = work / ".carry" / "megatron_lm"
    assert sorted(p.name for p in dest.iterdir()) == sorted((*FILES, "SOURCE"))
    assert (dest / "pretrain_gpt.py").read_text() == "# pretrain_gpt.py\n"
    assert (dest / "SOURCE").read_text().startswith("core_r0.19.0 ")
    bad = subprocess.run(["bash", str(script), str(repo), "no-such-ref"], capture_output=True,
                         text=True)
    assert bad.returncode == 1 and "no ref no-such-ref" in bad.stderr

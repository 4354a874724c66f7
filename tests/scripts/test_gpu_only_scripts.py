"""scripts/*.py on a machine without CUDA: help texts, and GPU-only scripts refusing cleanly.

For every script, `--help` exits 0 and every argparse argument has a help text, and nothing a
user reads in the help (description, options, epilog) names an internal issue number or a
module-level kernel flag that became a field of an option object (kernels/options.py). Every
GPU-only script and mode exits with status 2 and one line on stderr ("<script> needs a CUDA
GPU (none is visible); ...") before it writes anything: no output folder, no benchmark record.

The GPU is hidden from the subprocesses (CUDA_VISIBLE_DEVICES=""), so the refusals are checked
on a GPU machine too. One subprocess a case, a few seconds each (the torch import).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
TIMEOUT_S = 120
ALL_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py"))

# Runs a script as `python SCRIPT ARGS...` would, and appends each parser's arguments (and
# their help) to $PARSER_DUMP as it parses: the help test inspects the real parser.
HOOK = r"""
import argparse, json, os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
parse_known_args = argparse.ArgumentParser.parse_known_args

def dumping(self, args=None, namespace=None):
    actions = [{"names": a.option_strings or [a.dest], "help": a.help} for a in self._actions
               if not isinstance(a, argparse._HelpAction)]
    with open(os.environ["PARSER_DUMP"], "a") as f:
        f.write(json.dumps({"prog": self.prog, "description": self.description,
                            "epilog": self.epilog, "actions": actions}) + "\n")
    return parse_known_args(self, args, namespace)

argparse.ArgumentParser.parse_known_args = dumping
runpy.run_path(script, run_name="__main__")
"""

# Internal references a user should not meet in the help.
ISSUE_NUMBER = re.compile(r"\bissues? ?#?\d", re.IGNORECASE)
STALE_FLAGS = ("DKV_CHANNELS_ON_M", "BWD_FUSED", "MIN_CAP", "GROUP_SLACK_DIV", "KEYS_ON_M",
               "ATOMIC_SLOTS", "FWD_SM90", "HEAD_BLOCKS_ADJACENT", "PROGRAMS_PER_SM")

# (script, arguments) of every GPU-only invocation; each also gets --out where it has one.
CUDA_LINE = "needs a CUDA GPU (none is visible); "
GPU_ONLY = [
    ("accuracy.py", []),  # --device cuda is the default
    ("bench_selection.py", []),
    ("bench_selection.py", ["--quick"]),
    ("bench_selection.py", ["--captured", "indexer_capture.pt"]),
    ("bench_selection.py", ["--sweep"]),
    ("bench_selection.py", ["--group-sweep"]),
    ("bench_attention.py", []),
    ("bench_attention.py", ["--quick"]),
    ("bench_attention.py", ["--bwd-sweep"]),
    ("bench_attention.py", ["--bwd-sweep", "--tilings", "64x1", "--bwd-variants", "no_carry",
                            "main_first", "--sweep-parts", "dq", "dkv"]),
    ("bench_indexer_loss.py", ["--no-from-dq"]),
    ("bench_indexer_loss.py", []),
    ("bench_indexer_loss.py", ["--quick"]),
    ("bench_indexer_loss.py", ["--target-tilings", "32x2"]),
    ("bench_indexer_loss.py", ["--variants", "all"]),
    ("bench_indexer_loss_dense.py", []),
    ("bench_indexer_loss_dense.py", ["--deterministic", "--tilings", "32x2"]),
    ("bench_selection.py", ["--row-sort-micro"]),
    ("bench_layer.py", []),  # --device cuda is the default
    ("bench_layer.py", ["--stock-kernel-backend", "cudnn"]),
    ("check_cp.py", ["--device", "cuda"]),
    ("check_cudnn_backend.py", []),
    ("profile_layer_memory.py", []),
    ("profile_selection.py", []),
    ("profile_attention.py", []),
    ("profile_attention.py", ["--list"]),
    ("probe_indexer_bwd.py", []),
    ("bench_mla_projections.py", []),
    ("bench_rms_norm.py", []),
]
# What the line names: the script, and the mode where only some modes need the GPU.
LABEL = {"accuracy.py": "accuracy.py --device cuda",
         "bench_layer.py": "bench_layer.py --device cuda",
         "check_cp.py": "check_cp.py --device cuda",
         "bench_mla_projections.py": "bench_mla_projections.py --device cuda",
         "bench_rms_norm.py": "bench_rms_norm.py --device cuda"}
# no --out: the first writes nothing, the second only its record (HYSCALE_RESULTS)
NO_OUT = ("check_cudnn_backend.py", "bench_indexer_loss_dense.py", "profile_selection.py",
          "profile_attention.py", "probe_indexer_bwd.py", "bench_mla_projections.py",
          "bench_rms_norm.py")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "TRITON_INTERPRET")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="",
               HYSCALE_RESULTS=str(tmp_path / "results"), OUT=str(tmp_path / "env_out"),
               PYTHONPATH=str(ROOT), **extra)
    return env


def _run(cmd: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=work,
                          env=_env(tmp_path, **env), timeout=TIMEOUT_S)


def test_every_script_is_covered() -> None:
    # A new script that needs CUDA belongs in GPU_ONLY; one that runs on CPU in cpu_scripts.
    cpu_scripts = {"benchmark_tables.py", "build_corpus.py", "compare_indexer_precision.py",
                   "compare_megatron_lm_csa.py",
                   "inspect_sm90.py", "measured_defaults.py", "ncu_summary.py"}
    gpu_scripts = {s for s, _ in GPU_ONLY} | {"build_flashmla.py"}
    assert set(ALL_SCRIPTS) == cpu_scripts | gpu_scripts


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_help_lists_every_option_with_help_text(script: str, tmp_path: Path) -> None:
    dump = tmp_path / "parsers.jsonl"
    proc = _run([sys.executable, "-c", HOOK, str(SCRIPTS / script), "--help"], tmp_path,
                PARSER_DUMP=str(dump))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: "), proc.stdout[:500]
    parsers = [json.loads(line) for line in dump.read_text().splitlines()]
    assert parsers, "no argparse parser ran"
    for parser in parsers:
        missing = [a["names"] for a in parser["actions"] if not (a["help"] or "").strip()]
        assert not missing, f"{script}: arguments without help text: {missing}"
        assert (parser["description"] or "").strip(), f"{script}: no description"
    for name in STALE_FLAGS:
        assert name not in proc.stdout, f"{script} --help names {name}"
    assert not ISSUE_NUMBER.search(proc.stdout), ISSUE_NUMBER.search(proc.stdout)
    assert not list((tmp_path / "cwd").iterdir())  # --help writes nothing


@pytest.mark.parametrize(("script", "args"), GPU_ONLY,
                         ids=[" ".join([s, *a]) for s, a in GPU_ONLY])
def test_gpu_only_refuses_without_cuda(script: str, args: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPTS / script), *args]
    if script not in NO_OUT:
        cmd += ["--out", str(out)]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]  # one line, no traceback
    assert lines[0].startswith(f"{LABEL.get(script, script)} {CUDA_LINE}"), lines[0]
    assert "GPU machine" in lines[0]
    assert proc.stdout == ""
    assert not out.exists()
    assert not (tmp_path / "results").exists() and not (tmp_path / "env_out").exists()
    assert not list((tmp_path / "cwd").iterdir())


def test_build_flashmla_refuses_without_nvcc(tmp_path: Path) -> None:
    out = tmp_path / "site"
    proc = _run([sys.executable, str(SCRIPTS / "build_flashmla.py"), "--src",
                 str(tmp_path / "FlashMLA"), "--out", str(out)], tmp_path,
                CUDA_HOME=str(tmp_path / "no-cuda"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("build_flashmla.py needs nvcc and a CUDA build of torch ("), lines
    assert lines[0].endswith("; run it on the GPU machine")
    assert proc.stdout == "" and not out.exists()
    assert not list((tmp_path / "cwd").iterdir())


@pytest.mark.parametrize("part", [[], ["bench", "extra"], ["test"]])
def test_gpu_session_refuses_a_missing_part_before_any_setup(tmp_path: Path, part) -> None:
    """`gpu_session.sh mma-ahead` without a known PART (tests, bench) exits 2 naming the
    parts, before it installs anything or makes its output folder (device time is spent on
    set-up)."""
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_session.sh"), "mma-ahead", *part[:1]],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
                          env={**os.environ, "OUT": str(tmp_path / "out")})
    if part[:1] == ["bench"]:  # a known part passes the check (and stops later, off a GPU)
        assert "mma-ahead {tests|bench}" not in proc.stderr
        return
    assert proc.returncode == 2 and "mma-ahead {tests|bench}" in proc.stderr
    assert not (tmp_path / "out").exists()

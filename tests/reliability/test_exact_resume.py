"""Exact resume: train N steps in a child process, save, SIGKILL it while it keeps training,
resume in a fresh process from the checkpoint and train M more steps: the losses are those of an
uninterrupted N + M step run (bitwise with megatron's `deterministic_mode=True`; within fp32
rounding without it).

The runs have dropout (hidden_dropout 0.1) and full activation recompute on, so the resume
needs, besides the parameters and the optimizer: the scheduler (the learning rate warms up),
the torch generator and megatron's RNG tracker states (dropout draws; the recompute replays
them) and the data position (the step: batch i is a function of i). What `Trainer.save` keeps is
listed in `megatron_hyscale.testing.training`'s docstring; `test_resume_without_the_rng_state_
diverges` shows the RNG part is needed.

The child runs `python -m megatron_hyscale.testing.training` (see its `_child_main`). DSA runs by
default; V4, QSA and the non-deterministic DSA run are `slow` (about 20 s each on a 2-core CPU;
`pytest -m slow tests/reliability`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import megatron_hyscale
from hyscale_bench.distributed import free_port
from megatron_hyscale import replay
from megatron_hyscale.testing.training import CHECKPOINT_WARNING_FILTERS, FULL_RECOMPUTE, Trainer

pytestmark = pytest.mark.filterwarnings(*CHECKPOINT_WARNING_FILTERS)

N, M = 3, 3
CHILD_TIMEOUT_S = 240
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megatron_hyscale.__file__)))


def config(kind: str, deterministic: bool) -> dict:
    return dict(FULL_RECOMPUTE, hidden_dropout=0.1, deterministic_mode=deterministic)


def child(kind: str, cfg: dict, log: str, *extra: str) -> subprocess.Popen:
    """The training child; its stderr goes to `log`.err (a pipe nobody reads could fill up)."""
    # its own gloo port: the parent's MASTER_PORT (in os.environ) is taken by the parent
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH"))
                                          if p))
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_hyscale.testing.training", "--kind", kind,
         "--log", log, "--config", json.dumps(cfg), *extra],
        env=env, stdout=subprocess.PIPE, stderr=open(f"{log}.err", "w"), text=True)


def stderr_of(log: str) -> str:
    with open(f"{log}.err") as f:
        return f.read()[-4000:]


def read_losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: float.fromhex(r["hex"]) for r in map(json.loads, f)}


def kill_after_save(proc: subprocess.Popen, log: str) -> None:
    """Wait for the child's "saved" line, then SIGKILL it (it is training on)."""
    timer = threading.Timer(CHILD_TIMEOUT_S, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            if line.strip() == "saved":
                break
        else:
            raise AssertionError(f"the child ended without saving:\n{stderr_of(log)}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


def uninterrupted(kind: str, cfg: dict, steps: int) -> list[float]:
    run = Trainer(kind, **cfg)
    losses = [run.train_step().loss.item() for _ in range(steps)]
    replay.assert_drained()
    return losses


CASES = [
    pytest.param("dsa", True, id="dsa-deterministic"),
    pytest.param("dsa", False, id="dsa", marks=pytest.mark.slow),
    pytest.param("v4", True, id="v4-deterministic", marks=pytest.mark.slow),
    pytest.param("qsa", True, id="qsa-deterministic", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("kind", "deterministic"), CASES)
def test_kill_and_resume_matches_an_uninterrupted_run(kind, deterministic, tmp_path):
    if kind == "v4":
        pytest.importorskip("transformers.models.deepseek_v4")
    if kind == "qsa":
        pytest.importorskip("transformers.models.qwen4_exp")
    cfg = config(kind, deterministic)
    ckpt, killed_log, resumed_log = (str(tmp_path / n) for n in ("ckpt", "killed", "resumed"))

    # train "forever", save at step N, killed right after the save
    killed = child(kind, cfg, killed_log, "--steps", "100000", "--save-at", str(N),
                   "--ckpt", ckpt)
    kill_after_save(killed, killed_log)
    # a fresh process resumes from the checkpoint for M more steps
    resumed = child(kind, cfg, resumed_log, "--steps", str(N + M), "--resume", ckpt)
    try:
        resumed.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        resumed.kill()
        raise
    assert resumed.returncode == 0, stderr_of(resumed_log)

    expected = uninterrupted(kind, cfg, N + M)
    before = read_losses(killed_log)
    after = read_losses(resumed_log)
    assert sorted(after) == list(range(N, N + M))
    got = [before[i] for i in range(N)] + [after[i] for i in range(N, N + M)]
    if deterministic:
        assert got == expected, (got, expected)  # bitwise (floats from their hex)
    else:
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64),
                                   rtol=1e-6, atol=0.0)


def test_resume_without_the_rng_state_diverges(tmp_path):
    """The dropout draws make the RNG part of the state: a resume that keeps the new process's
    generators continues differently (so the test above would notice a lost RNG state)."""
    cfg = config("dsa", True)
    run = Trainer("dsa", **cfg)
    for _ in range(N):
        run.train_step()
    run.save(str(tmp_path / "ckpt"))
    expected = [run.train_step().loss for _ in range(M)]

    exact = Trainer("dsa", seed=11, **cfg)
    exact.load(str(tmp_path / "ckpt"))
    assert [exact.train_step().loss for _ in range(M)] == expected

    lost = Trainer("dsa", seed=11, **cfg)
    lost.load(str(tmp_path / "ckpt"), rng=False)
    assert [lost.train_step().loss for _ in range(M)] != expected

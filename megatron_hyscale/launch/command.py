"""Build, print and run Megatron-LM launch commands (torchrun locally, srun + torchrun on Slurm).

A `Command` is an argv plus the environment variables it needs; `render` prints it as a shell
line a user can copy, and `run` executes it with its output teed to a log file. Nothing here
imports torch or Megatron: dry runs work on any machine.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

MEGATRON_ENV = "MEGATRON_LM_DIR"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Where scripts/megatron_lm_carry.sh puts Megatron-LM's pretrain_gpt.py (and its two imports).
CARRIED_MEGATRON_LM = REPO_ROOT / ".carry" / "megatron_lm"
# The training entry points: Megatron-LM's pretrain_gpt.py, or HyScale's own minimal one
# (megatron_hyscale/launch/train_gpt.py, for machines without a Megatron-LM checkout).
TRAINERS = ("megatron-lm", "hyscale")
HYSCALE_TRAINER = "megatron_hyscale.launch.train_gpt"
# The line it logs first: which entry point trained, in the log itself.
HYSCALE_TRAINER_BANNER = f"> trainer: {HYSCALE_TRAINER} (HyScale's minimal GPT entry point)"


class LaunchError(RuntimeError):
    """A launch cannot start (missing checkout, missing Slurm allocation, bad layout)."""


COMMAND_BEGIN = "# --- command: {label} ---"
COMMAND_END = "# --- end of command ---"
# Exit status of a run stopped at its time limit (as coreutils' timeout reports it).
TIMED_OUT = 124


@dataclass
class Command:
    """One process launch: argv plus the environment variables set on top of the caller's."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    label: str = ""

    def render(self) -> str:
        """The command as a copyable shell line (`env K=V ... argv`), wrapped for reading."""
        parts = [f"{k}={_quote(v)}" for k, v in self.env.items()]
        words = [_quote(w) for w in self.argv]
        lines, current = [], ("env " + " ".join(parts)) if parts else ""
        for word in words:
            # one option per line: a 100-argument command stays readable and diffable
            if current and word.startswith("--"):
                lines.append(current)
                current = "  " + word
            else:
                current = f"{current} {word}" if current else word
        lines.append(current)
        return " \\\n".join(lines)

    def run(self, log_path: Path | None = None, *, timeout_s: float | None = None,
            append: bool = False) -> int:
        """Run it (environment merged over os.environ); stream and tee the output to log_path
        (appended to what it holds with `append`, else written afresh).

        timeout_s: after that many seconds the run's whole process group (torchrun and its
        workers) is sent SIGTERM, then SIGKILL 20 s later; the return is then TIMED_OUT and
        the log ends with a line saying so.
        """
        env = {**os.environ, **self.env}
        if log_path is None and timeout_s is None:
            return subprocess.call(self.argv, env=env)
        mode = "a" if append else "w"
        if timeout_s is not None and timeout_s <= 0:
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(log_path, mode, encoding="utf-8") as log:
                    log.write("# not started: no time left under the time limit\n")
            return TIMED_OUT
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, mode, encoding="utf-8") if log_path is not None else None
        timed_out = threading.Event()
        proc: subprocess.Popen | None = None

        def stop() -> None:
            """SIGTERM to the run's process group, SIGKILL 20 s later if it is still there."""
            if proc is None:
                return
            for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 0.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    return
                try:
                    proc.wait(grace)
                    return
                except subprocess.TimeoutExpired:
                    continue

        # The run has its own process group (so that the time limit reaches torchrun's
        # workers), which a SIGTERM to this launcher (an outer `timeout`) would not reach:
        # turn that SIGTERM into an exit that stops the group first.
        previous = None
        if timeout_s is not None and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        timer = None
        try:
            proc = subprocess.Popen(self.argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    start_new_session=timeout_s is not None)
            if timeout_s is not None:
                timer = threading.Timer(timeout_s, lambda: (timed_out.set(), stop()))
                timer.daemon = True
                timer.start()
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                if log is not None:
                    log.write(line)
            code = proc.wait()
            if timed_out.is_set():
                note = f"# stopped at the time limit ({timeout_s:.0f} s)\n"
                sys.stdout.write(note)
                if log is not None:
                    log.write(note)
                return TIMED_OUT
            return code
        finally:
            if timer is not None:
                timer.cancel()
            if proc is not None and proc.poll() is None:  # leaving early (SIGTERM, Ctrl-C)
                stop()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if log is not None:
                log.close()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _quote(word: str) -> str:
    """shlex.quote, except that dry-run placeholders (`$VAR`, `$(...)`) stay expandable."""
    if "$" in word and not any(c in word for c in '"`\\'):
        return f'"{word}"'
    return shlex.quote(word)


def megatron_lm_dir(*, required: bool) -> Path | None:
    """The Megatron-LM checkout named by MEGATRON_LM_DIR (must hold pretrain_gpt.py).

    In a dry run (`required=False`) a missing variable gives None and the printed commands
    show `$MEGATRON_LM_DIR` literally.
    """
    value = os.environ.get(MEGATRON_ENV, "").strip()
    if not value:
        if not required:
            return None
        raise LaunchError(
            f"{MEGATRON_ENV} is not set. Point it at a Megatron-LM checkout (the directory that "
            f"holds pretrain_gpt.py), e.g. `export {MEGATRON_ENV}=$HOME/Megatron-LM`, or pass "
            "--dry-run to print the commands without running them."
        )
    path = Path(value).expanduser()
    if required and not (path / "pretrain_gpt.py").is_file():
        raise LaunchError(
            f"{MEGATRON_ENV}={value} does not contain pretrain_gpt.py; it must point at the root "
            "of a Megatron-LM checkout."
        )
    return path


def find_megatron_lm() -> Path | None:
    """The Megatron-LM checkout to run: MEGATRON_LM_DIR when set (checked by
    `megatron_lm_dir`), else the checkout's .carry/megatron_lm when it holds pretrain_gpt.py,
    else None."""
    if os.environ.get(MEGATRON_ENV, "").strip():
        return megatron_lm_dir(required=True)
    if (CARRIED_MEGATRON_LM / "pretrain_gpt.py").is_file():
        return CARRIED_MEGATRON_LM
    return None


def pretrain_script(checkout: Path | None) -> str:
    return str(checkout / "pretrain_gpt.py") if checkout else f"${MEGATRON_ENV}/pretrain_gpt.py"


def training_env(checkout: Path | None) -> dict[str, str]:
    """Environment for the training processes.

    PYTHONPATH puts HyScale (for `--spec megatron_hyscale.specs ...`) and the Megatron-LM
    checkout ahead of site-packages; the rest are what Megatron-LM's own examples set.
    """
    return launch_env(str(checkout) if checkout else f"${MEGATRON_ENV}")


def launch_env(*paths: str) -> dict[str, str]:
    """Environment of a launched process: HyScale and `paths` ahead of the caller's PYTHONPATH,
    and Megatron's usual settings."""
    paths = (str(REPO_ROOT), *paths)
    if os.environ.get("PYTHONPATH"):
        paths = (*paths, os.environ["PYTHONPATH"])
    return {
        "PYTHONPATH": ":".join(paths),
        # Megatron orders its TP/CP communication kernels assuming one hardware queue.
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        # 1M-token activations are allocated and freed in large, varying sizes.
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
    }


def torchrun(python: str, nproc: int, script: str, args: list[str], *, nnodes: int = 1,
             rdzv_endpoint: str | None = None, rdzv_id: str = "hyscale",
             module: bool = False) -> list[str]:
    """`python -m torch.distributed.run ...` (same interpreter as the caller by default);
    `module`: `script` is a module name, run as `python -m` runs it."""
    argv = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes == 1 and rdzv_endpoint is None:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        argv += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", str(rdzv_endpoint), "--rdzv-id", rdzv_id]
    return argv + (["-m"] if module else []) + [script, *args]


def slurm_master_addr(*, required: bool) -> str:
    """First host of the Slurm allocation (the torchrun rendezvous host)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if nodelist and shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True).stdout.split()
        if out:
            return out[0]
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    if required:
        raise LaunchError(
            "no Slurm allocation found (SLURM_JOB_NODELIST is unset or scontrol is missing): "
            "submit with sbatch, run inside salloc, or set MASTER_ADDR; --dry-run prints the "
            "commands anywhere."
        )
    return "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)"


def srun_torchrun(python: str, nodes: int, gpus_per_node: int, script: str, args: list[str],
                  *, master_addr: str, port: int = 29500, module: bool = False) -> list[str]:
    """One torchrun per node through srun; torchrun starts the node's GPU workers."""
    job = os.environ.get("SLURM_JOB_ID", "hyscale")
    srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", f"--gpus-per-node={gpus_per_node}",
            "--kill-on-bad-exit=1", "--export=ALL"]
    return srun + torchrun(python, gpus_per_node, script, args, nnodes=nodes,
                           rdzv_endpoint=f"{master_addr}:{port}", rdzv_id=job, module=module)


def print_command(cmd: Command) -> None:
    """The command between the markers the dry-run tests and users read."""
    print(COMMAND_BEGIN.format(label=cmd.label))
    print(cmd.render())
    print(COMMAND_END)

"""Soak: many training steps of the tiny HyScale DSA GPT under full activation recompute (every
layer's selection recorded in the forward and replayed in the recompute) with megatron's DDP and
optimizer (`testing.training.Trainer`). Nothing may grow with the step count:

- the selection replay store: no pending entry after any step, each step computes and replays
  exactly one selection per layer, and the module-level bookkeeping (live stores, offloaded
  entries, host copies) keeps its size;
- memory: the bytes of live tensors (every tensor the garbage collector can see, storages
  counted once) and the number of live Python objects are what they were after the warm-up
  tenth of the steps; the resident set size grows by less than `RSS_TOLERANCE` (allocator
  noise); on CUDA also `torch.cuda.memory_allocated()` between steps is unchanged and the peak
  of the last tenth of the steps is no higher than that of the second tenth;
- step time: the median of the last tenth of the steps is within `TIME_GROWTH` of the median
  of the tenth after the warm-up tenth (on a CPU process CPU time, which other processes on a
  shared machine disturb much less than wall time; on CUDA wall time after a synchronize).

tests/reliability/test_soak.py runs it on the CPU; on the GPU (issue #23, item 7:
`gpu_session.sh soak`) it runs as a module and writes a record:

    python -m megatron_hyscale.testing.soak --steps 300 --device cuda [--modes device offload]

(`--device cpu --steps 20` is its CPU smoke run.) The record (`hyscale_bench.measure.
save_record`, script "soak") holds one entry per mode with the figures above and the failed
checks; the exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from hyscale_bench.models import default_device
from megatron_hyscale import replay
from megatron_hyscale.testing.training import FULL_RECOMPUTE, Trainer

RSS_TOLERANCE = 32 * 2**20
# Python objects: torch's autograd / dispatcher caches add about 40 weak references and builtin
# methods over the first ~100 steps, then nothing (measured up to 400 steps); a leak of one
# object per step would show at 1000 steps.
OBJECT_TOLERANCE = 100
TIME_GROWTH = 1.5  # last tenth's median step time / second tenth's, at most
MODES = ("device", "offload")  # where recorded selections wait for their replay


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes() -> tuple[int, int]:
    """(bytes of the distinct storages of every live tensor, number of live Python objects).

    The objects are counted before the storages are looked at: `untyped_storage()` gives a
    storage a Python object that lives as long as the storage does.
    """
    gc.collect()
    objects = gc.get_objects()
    n_objects = len(objects)
    storages: dict[tuple[str, int], int] = {}
    for obj in objects:
        try:
            # type(), not isinstance: the latter reads __class__, which some lazy module
            # attributes (torch.distributed.reduce_op) answer with a deprecation warning
            if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        except Exception:  # tensors without storage (e.g. functional wrappers)
            continue
    del objects
    return sum(storages.values()), n_objects


def replay_bookkeeping() -> dict[str, int]:
    return {"stores": len(replay._stores), "offloaded": len(replay._offloaded),
            "host_copies": len(replay._host_copies), "pending": replay.pending_entries()}


@dataclass
class Snapshot:
    """What must not grow, taken between steps."""

    tensor_bytes: int
    objects: int
    rss: int
    bookkeeping: dict[str, int]
    cuda_allocated: int | None  # torch.cuda.memory_allocated(); None on a CPU

    @classmethod
    def take(cls, cuda: bool) -> Snapshot:
        live_tensor_bytes()  # once first: the storages' Python objects (see its docstring)
        tensor_bytes, objects = live_tensor_bytes()
        return cls(tensor_bytes, objects, rss_bytes(), replay_bookkeeping(),
                   torch.cuda.memory_allocated() if cuda else None)


@dataclass
class SoakResult:
    steps: int
    offload: bool
    device: str
    n_layers: int
    step_seconds: list[float]  # process CPU time (CPU) or synchronized wall time (CUDA)
    start: Snapshot  # after the warm-up tenth
    end: Snapshot
    cuda_peaks: tuple[int, int] | None  # peak allocated bytes of the second / last tenth
    failures: list[str] = field(default_factory=list)

    @property
    def tenth(self) -> int:
        return max(1, self.steps // 10)

    def median_ms(self, last: bool) -> float:
        t = self.tenth
        window = self.step_seconds[-t:] if last else self.step_seconds[t:2 * t]
        return 1e3 * statistics.median(window)

    def summary(self) -> str:
        s, e = self.start, self.end
        cuda = "" if s.cuda_allocated is None else (
            f", CUDA allocated {s.cuda_allocated} -> {e.cuda_allocated} B, peaks "
            f"{self.cuda_peaks[0]} -> {self.cuda_peaks[1]} B")
        return (f"soak {self.steps} steps on {self.device} (offload={self.offload}): tensor "
                f"bytes {s.tensor_bytes} -> {e.tensor_bytes}, objects {s.objects} -> "
                f"{e.objects}, RSS {s.rss / 2**20:.1f} -> {e.rss / 2**20:.1f} MiB{cuda}, step "
                f"time median {self.median_ms(False):.1f} -> {self.median_ms(True):.1f} ms"
                + (f"; FAILED: {'; '.join(self.failures)}" if self.failures else ""))

    def record(self) -> dict:
        return {"method": "soak-offload" if self.offload else "soak-device",
                "steps": self.steps, "device": self.device, "start": asdict(self.start),
                "end": asdict(self.end), "cuda_peaks": self.cuda_peaks,
                "step_ms_second_tenth": self.median_ms(False),
                "step_ms_last_tenth": self.median_ms(True), "failures": self.failures}


def _end_checks(r: SoakResult, time_growth: float | None) -> list[str]:
    s, e = r.start, r.end
    out = []
    if e.bookkeeping != s.bookkeeping:
        out.append(f"replay bookkeeping {s.bookkeeping} -> {e.bookkeeping}")
    if r.offload and replay.get_stats()["selections_offloaded"] != r.steps * r.n_layers:
        out.append(f"offloaded {replay.get_stats()['selections_offloaded']} selections")
    if e.tensor_bytes != s.tensor_bytes:
        out.append(f"live tensor bytes {s.tensor_bytes} -> {e.tensor_bytes}")
    if e.objects - s.objects >= OBJECT_TOLERANCE:
        out.append(f"live objects {s.objects} -> {e.objects}")
    if e.rss - s.rss >= RSS_TOLERANCE:
        out.append(f"RSS {s.rss} -> {e.rss}")
    if s.cuda_allocated is not None:
        if e.cuda_allocated != s.cuda_allocated:
            out.append(f"CUDA allocated {s.cuda_allocated} -> {e.cuda_allocated}")
        if r.cuda_peaks[1] > r.cuda_peaks[0]:
            out.append(f"CUDA peak of a step {r.cuda_peaks[0]} -> {r.cuda_peaks[1]}")
    if time_growth is not None and r.median_ms(True) >= time_growth * r.median_ms(False):
        out.append(f"step time {r.median_ms(False):.2f} -> {r.median_ms(True):.2f} ms")
    return out


def run_soak(steps: int, *, offload: bool, max_failures: int = 10,
             time_growth: float | None = TIME_GROWTH) -> SoakResult:
    """`steps` training steps (megatron set up for this process's device already); the
    per-step and end-of-run checks of the module doc, failed ones in `failures`.
    `time_growth` None: the step times are measured and reported, not checked (the CPU
    tests: even process CPU time varied 1.5x between tenths on a shared 2-core machine)."""
    cuda = torch.cuda.is_available()
    replay.configure(offload=offload)
    try:
        # Learning-rate warm-up: 10 steps (the tests' runs), shorter for a short smoke run.
        run = Trainer("dsa", stock=False, warmup=min(10, steps // 10), decay_steps=steps,
                      **FULL_RECOMPUTE)
        n_layers = run.config.num_layers
        tenth = max(1, steps // 10)
        times: list[float] = []
        failures: list[str] = []
        peaks = [0, 0]
        start = None
        replay.reset_stats()
        clock = time.perf_counter if cuda else time.process_time
        for i in range(steps):
            if cuda:
                torch.cuda.synchronize()
                if i in (tenth, steps - tenth):
                    torch.cuda.reset_peak_memory_stats()
            t0 = clock()
            loss = run.train_step().loss
            if cuda:
                torch.cuda.synchronize()
            times.append(clock() - t0)
            if cuda and i in (2 * tenth - 1, steps - 1):
                peaks[0 if i == 2 * tenth - 1 else 1] = torch.cuda.max_memory_allocated()
            stats = replay.get_stats()
            step_failures = []
            if not torch.isfinite(loss):
                step_failures.append(f"step {i}: loss {loss.item()}")
            if not stats["selections_computed"] == stats["selections_replayed"] == n_layers * (
                    i + 1):
                step_failures.append(f"step {i}: replay counters {stats}")
            if replay.pending_entries():
                step_failures.append(f"step {i}: pending {replay_bookkeeping()}")
            failures.extend(step_failures[:max(0, max_failures - len(failures))])
            if i == tenth - 1:  # after the warm-up tenth
                start = Snapshot.take(cuda)
        result = SoakResult(steps, offload, str(default_device()), n_layers, times, start,
                            Snapshot.take(cuda), tuple(peaks) if cuda else None, failures)
        result.failures.extend(_end_checks(result, time_growth))
        return result
    finally:
        replay.configure(offload=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="replay store on the device, offloaded to the host, or both")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be at least 10 (a warm-up tenth and a last tenth)")

    from hyscale_bench import measure

    if args.device == "cuda":
        measure.require_cuda("megatron_hyscale.testing.soak --device cuda",
                             "--device cpu runs it on the CPU")
    elif torch.cuda.is_available():
        parser.error("--device cpu: this process sees a GPU, which the trainer would take")

    # megatron's modules only now: a refused --device cuda exits before importing them
    from hyscale_bench.cpu import init_single_process, megatron_on_cpu
    from megatron_hyscale.testing.quiet import quiet_megatron
    from megatron_hyscale.testing.training import training_on_cpu
    results = []
    with quiet_megatron(), (megatron_on_cpu() if args.device == "cpu"
                            else contextlib.nullcontext()), training_on_cpu():
        init_single_process()
        for mode in args.modes:
            result = run_soak(args.steps, offload=mode == "offload")
            print(result.summary(), flush=True)
            results.append(result)
    cuda = args.device == "cuda"
    path = measure.save_record(
        "soak", f"dsa-{args.steps}", [r.record() for r in results],
        matmul=measure.matmul_tflops() if cuda else None,
        copy=measure.copy_tbps() if cuda else None)
    print(f"record: {path}")
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Profiler traces and memory snapshots (``[profiling]``): :class:`Profiler`, which records them,
and :class:`ProfilerCallback`, which runs it around the trainer's steps."""

from __future__ import annotations

import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from torchtitan_lite.callbacks.base import Callback, StepState, exit_arguments
from torchtitan_lite.config.schema import Profiling

__all__ = ["Profiler", "ProfilerCallback"]

logger = logging.getLogger("torchtitan_lite")


class Profiler:
    """A context manager; call :meth:`step` once after every training step.

    Traces: every ``profile_freq`` steps a window of ``profiler_warmup`` untraced and
    ``profiler_active`` traced steps ends at that step, and each rank writes
    ``<traces>/iteration_<step>/rank<r>_trace.json`` (Chrome trace format, for Perfetto or
    chrome://tracing). Memory snapshots (CUDA only): the allocator history is recorded from the
    start and ``<snapshots>/iteration_<step>/rank<r>_memory_snapshot.pickle`` is written every
    ``profile_freq`` steps (for https://pytorch.org/memory_viz), and on out-of-memory.
    """

    def __init__(self, cfg: Profiling, *, dump_folder: str | Path, rank: int, device: torch.device,
                 start_step: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        self.step_num = start_step
        self.trace_dir = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_dir = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.trace_files: list[Path] = []
        self._written: set[int] = set()
        self._torch_profiler: torch.profiler.profile | None = None
        self._snapshots = cfg.enable_memory_snapshot and device.type == "cuda"
        if cfg.enable_memory_snapshot and not self._snapshots and rank == 0:
            logger.warning("profiling.enable_memory_snapshot: memory snapshots need CUDA; none on %s", device.type)
        if cfg.enable_profiling:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
            self._torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(
                    wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active,
                    # Windows end at multiples of profile_freq, also for a run resumed at
                    # start_step: skip to the first window that fits, then cycle.
                    skip_first=((-start_step) % cfg.profile_freq - cfg.profiler_warmup
                                - cfg.profiler_active) % cfg.profile_freq,
                    skip_first_wait=1,
                ),
                on_trace_ready=self._write_trace,
                record_shapes=True,
            )

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        if self.step_num % self.cfg.profile_freq or self.step_num in self._written:
            # The run ended inside a window (or right after one, with the next one already
            # recording): nothing complete to write, and never over a complete trace.
            return
        self._written.add(self.step_num)
        folder = self.trace_dir / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        self.trace_files.append(path)
        if self.rank == 0:
            logger.info("profiler trace of step %d written to %s", self.step_num, folder)

    def _write_snapshot(self, tag: str) -> None:
        folder = self.snapshot_dir / tag
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f"rank{self.rank}_memory_snapshot.pickle").open("wb") as fh:
            pickle.dump(torch.cuda.memory._snapshot(), fh)

    def __enter__(self) -> Profiler:
        if self._snapshots:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if self._torch_profiler is not None:
            self._torch_profiler.__enter__()
        return self

    def step(self) -> None:
        self.step_num += 1
        if self._torch_profiler is not None:
            with warnings.catch_warnings():
                # Each window is written out whole before the next starts; nothing to accumulate.
                warnings.filterwarnings("ignore", message=".*Profiler clears events")
                self._torch_profiler.step()
        if self._snapshots and self.step_num % self.cfg.profile_freq == 0:
            self._write_snapshot(f"iteration_{self.step_num}")

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._snapshots and isinstance(exc, torch.OutOfMemoryError):
            self._write_snapshot(f"iteration_{self.step_num}_oom")
        if self._torch_profiler is not None:
            self._torch_profiler.__exit__(exc_type, exc, tb)
        if self._snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)


class ProfilerCallback(Callback):
    def __init__(self, cfg: Profiling) -> None:
        self.cfg = cfg
        self.profiler: Profiler | None = None

    def on_train_start(self, trainer: Any) -> None:
        self.profiler = Profiler(self.cfg, dump_folder=trainer.config.job.dump_folder, rank=trainer.rank,
                                 device=trainer.device, start_step=trainer.step)
        self.profiler.__enter__()

    def after_step(self, trainer: Any, state: StepState) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_train_end(self, trainer: Any, error: BaseException | None) -> None:
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.__exit__(*exit_arguments(error))

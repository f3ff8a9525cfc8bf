"""Profiler traces and memory snapshots (``[profiling]``)."""

from __future__ import annotations

from typing import Any

from torchtitan_lite.callbacks.base import Callback, StepState, exit_arguments
from torchtitan_lite.config.schema import Profiling
from torchtitan_lite.profiling import Profiler


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

"""The metrics record of a step, written every ``metrics.log_freq`` steps, at the first and the
last step and after validation (through ``trainer.log_metrics``: ``metrics.jsonl``, TensorBoard,
the console line, and every callback's :meth:`~.Callback.on_metrics`)."""

from __future__ import annotations

from typing import Any

from torchtitan_lite.callbacks.base import Callback, StepState
from torchtitan_lite.metrics import memory_stats, reset_peak_memory


class MetricsCallback(Callback):
    def __init__(self, log_freq: int) -> None:
        self.log_freq = log_freq

    def on_train_start(self, trainer: Any) -> None:
        reset_peak_memory(trainer.device)

    def after_step(self, trainer: Any, state: StepState) -> None:
        if state.rolled_back or state.logged:
            return
        step = trainer.step
        if step == 1 or step % self.log_freq == 0 or state.last or state.validated:
            trainer.log_metrics(step, {**state.values, **memory_stats(trainer.device)})
            reset_peak_memory(trainer.device)
            state.logged = True

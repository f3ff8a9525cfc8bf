"""Preemption: a signal of ``checkpoint.save_on_signals`` ends the run after the step in progress,
on every rank, with one checkpoint saved (:class:`~torchtitan_lite.run.stop_signals.StopSignals`)."""

from __future__ import annotations

from typing import Any

from torchtitan_lite.callbacks.base import Callback, StepState, exit_arguments
from torchtitan_lite.run.stop_signals import StopSignals


class PreemptionCallback(Callback):
    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.signals: StopSignals | None = None

    def on_train_start(self, trainer: Any) -> None:
        self.signals = StopSignals(self.names, device=trainer.device)
        self.signals.__enter__()

    def after_step(self, trainer: Any, state: StepState) -> None:
        assert self.signals is not None
        received = self.signals.requested()
        if received is not None and trainer.step < trainer.config.training.steps:
            trainer.stop_on_signal(received, self.signals)
            state.stop = True

    def on_train_end(self, trainer: Any, error: BaseException | None) -> None:
        if self.signals is not None:
            signals, self.signals = self.signals, None
            signals.__exit__(*exit_arguments(error))

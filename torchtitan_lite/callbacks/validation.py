"""Validation every ``validation.freq`` steps and at the last step."""

from __future__ import annotations

from typing import Any

from torchtitan_lite.callbacks.base import Callback, StepState


class ValidationCallback(Callback):
    def __init__(self, freq: int) -> None:
        self.freq = freq

    def after_step(self, trainer: Any, state: StepState) -> None:
        if state.rolled_back or not trainer.validators:
            return
        if trainer.step % self.freq == 0 or state.last:
            state.values.update(trainer.validate())
            state.validated = True

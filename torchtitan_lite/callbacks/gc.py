"""Garbage collection on a schedule (``training.gc_freq``) instead of Python's automatic one."""

from __future__ import annotations

from typing import Any

from torchtitan_lite.callbacks.base import Callback, StepState
from torchtitan_lite.gc_control import GarbageCollection


class GarbageCollectionCallback(Callback):
    def __init__(self, gc_freq: int) -> None:
        self.gc_freq = gc_freq
        self.handler: GarbageCollection | None = None

    def on_train_start(self, trainer: Any) -> None:
        self.handler = GarbageCollection(self.gc_freq)

    def after_step(self, trainer: Any, state: StepState) -> None:
        if not state.rolled_back and self.handler is not None:
            self.handler.run(trainer.step)

    def on_train_end(self, trainer: Any, error: BaseException | None) -> None:
        if self.handler is not None:
            self.handler.close()
            self.handler = None

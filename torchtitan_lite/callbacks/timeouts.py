"""Once the first step has run, a peer that stops answering is an error within
``comm.train_timeout_seconds`` (start-up had ``comm.init_timeout_seconds``)."""

from __future__ import annotations

from typing import Any

from torchtitan_lite.callbacks.base import Callback, StepState
from torchtitan_lite.distributed import set_collective_timeout


class TrainTimeoutCallback(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.done = False

    def on_train_start(self, trainer: Any) -> None:
        self.done = False

    def after_step(self, trainer: Any, state: StepState) -> None:
        if self.done:
            return
        self.done = True
        extra = [] if trainer.checkpointer is None else trainer.checkpointer.process_groups
        set_collective_timeout(self.seconds, [*trainer.mesh.groups(), *extra])

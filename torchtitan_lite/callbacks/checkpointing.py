"""A checkpoint when ``checkpoint.interval`` (or the last step) says so, never from non-finite weights."""

from __future__ import annotations

from typing import Any

from torchtitan_lite.callbacks.base import Callback, StepState
from torchtitan_lite.errors import TrainingError


class CheckpointCallback(Callback):
    def after_step(self, trainer: Any, state: StepState) -> None:
        checkpointer = trainer.checkpointer
        if state.rolled_back or checkpointer is None or not checkpointer.should_save(trainer.step, last=state.last):
            return
        if not trainer.weights_finite():
            raise TrainingError(f"step {trainer.step}: the weights are not finite (the loss was "
                                f"{state.values['loss']}); no checkpoint was written from them; lower optimizer.lr")
        checkpointer.save(trainer.step, trainer.train_state(), last=state.last)

    def on_train_end(self, trainer: Any, error: BaseException | None) -> None:
        if error is None and trainer.checkpointer is not None:
            trainer.checkpointer.wait()  # the last background save is committed before train() returns

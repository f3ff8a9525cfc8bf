"""What a callback is: code that runs around the training step (:class:`Callback`), and what it
sees of a step (:class:`StepState`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Callback", "StepState", "exit_arguments"]


def exit_arguments(error: BaseException | None) -> tuple[Any, BaseException | None, Any]:
    """``__exit__``'s arguments for ``error`` (a context manager a callback holds across training)."""
    return (None, None, None) if error is None else (type(error), error, error.__traceback__)


@dataclass
class StepState:
    """One finished training step, as the callbacks after it see it (and may add to)."""

    step: int
    """The step the values are of (after a rollback: the step that diverged)."""
    values: dict[str, Any]
    """Its metrics: ``loss``, ``grad_norm``, ``lr``, throughput …; validation adds its own."""
    last: bool = False
    """The run's last step (``training.steps``)."""
    rolled_back: bool = False
    """The step diverged and the run went back to its last checkpoint: nothing of it is kept."""
    logged: bool = False
    """Its metrics record is written already (a diverged step's is, before anything else)."""
    validated: bool = False
    """Validation ran after it."""
    stop: bool = False
    """End the run after this step (a preemption signal)."""


class Callback:
    """Runs around the training loop of :class:`~torchtitan_lite.trainer.Trainer`; override what
    you need. Callbacks run in the order of ``trainer.callbacks`` (the built-in ones:
    :func:`~torchtitan_lite.callbacks.default_callbacks`); ``trainer`` is the running trainer."""

    def on_train_start(self, trainer: Any) -> None:
        """Before the first step of :meth:`Trainer.train`."""

    def after_step(self, trainer: Any, state: StepState) -> None:
        """After each training step."""

    def on_metrics(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
        """Each metrics record as it is written (rank 0 only): a metrics sink."""

    def on_train_end(self, trainer: Any, error: BaseException | None) -> None:
        """When :meth:`Trainer.train` ends, normally or with ``error`` (in reverse order)."""

    def close(self, trainer: Any) -> None:
        """When the trainer is closed."""

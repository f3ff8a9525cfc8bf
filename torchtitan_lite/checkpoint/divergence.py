"""What a step whose update was not applied (a loss or gradient norm that is not finite) does next:
``training.on_nonfinite`` = ``stop`` (one error naming the step and the checkpoints that are
intact), ``skip`` (go on) or ``rollback`` (reload the newest checkpoint of this run that holds
the optimizer, leave out the global batch that diverged, and go on from there, at most
``training.max_rollbacks`` times).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_lite.checkpoint.storage import committed_steps
from torchtitan_lite.config.schema import Training
from torchtitan_lite.errors import TrainingError

__all__ = ["Divergence", "Resumed"]

logger = logging.getLogger("torchtitan_lite")


@dataclass(frozen=True)
class Resumed:
    """Where training goes on after a rollback: the checkpoint's step and tokens seen."""

    step: int
    tokens_seen: int


class Divergence:
    """``training.on_nonfinite`` for one run. ``checkpointer``: the run's
    :class:`~torchtitan_lite.checkpoint.manager.CheckpointManager` (None without checkpoints);
    ``folder_enabled``: whether ``checkpoint.enable`` writes the folder the stop message names;
    ``loader``: the data loader whose ``skipped`` set and ``step`` a rollback reads and extends."""

    def __init__(self, training: Training, *, checkpointer: Any, folder_enabled: bool, loader: Any,
                 rank: int) -> None:
        self.training, self.checkpointer, self.folder_enabled = training, checkpointer, folder_enabled
        self.loader, self.rank = loader, rank
        self.rollbacks = 0

    def __call__(self, step: int, values: dict[str, Any]) -> Resumed | None:
        """Handle step ``step`` whose update was not applied (``values``: its ``loss`` and
        ``grad_norm``): None to go on as if it had not run, a :class:`Resumed` after a rollback;
        raises :class:`TrainingError` to stop."""
        t = self.training
        what = f"step {step}: the loss ({values['loss']}) or gradient norm ({values['grad_norm']})"
        if t.on_nonfinite == "skip":
            if self.rank == 0:
                logger.warning("%s is not finite: its update was skipped (training.on_nonfinite = 'skip')", what)
            return None
        if t.on_nonfinite == "rollback" and self.checkpointer is not None and self.rollbacks < t.max_rollbacks:
            bad = self.loader.step - 1  # the global batch this step read
            state = self.checkpointer.rollback()
            if state is None:
                raise TrainingError(f"training diverged at {what} is not finite; the update was not applied; "
                                    "training.on_nonfinite = 'rollback' found no checkpoint of this run with its "
                                    "optimizer state to go back to (the first is written at checkpoint.interval)")
            self.rollbacks += 1
            self.loader.skipped.add(bad)
            resumed = Resumed(step=int(state["step"]), tokens_seen=int(state.get("tokens_seen", 0)))
            if self.rank == 0:
                logger.warning("%s is not finite: rolled back to step %d, leaving out global batch %d "
                               "(rollback %d of at most %d)", what, resumed.step, bad, self.rollbacks,
                               t.max_rollbacks)
            return resumed
        folder: Path | None = None if self.checkpointer is None else self.checkpointer.folder
        kept = committed_steps(folder) if folder is not None and self.folder_enabled else []
        intact = (f"the checkpoints in {str(folder)!r} (steps {kept}) are from finite steps" if kept
                  else "no checkpoint was written")
        if t.on_nonfinite == "rollback":
            raise TrainingError(f"training diverged at {what} is not finite after {self.rollbacks} rollbacks "
                                f"(training.max_rollbacks = {t.max_rollbacks}); the update was not applied and "
                                f"{intact}; lower optimizer.lr or raise training.max_rollbacks")
        raise TrainingError(f"training diverged at {what} is not finite; the update was not applied and "
                            f"{intact}; lower optimizer.lr, or set training.on_nonfinite = 'skip' or 'rollback'")

"""Weights & Biases: every metrics record as ``metrics.jsonl`` has it, to one W&B run (rank 0).

``metrics.enable_wandb = true`` with ``metrics.wandb_project`` and ``metrics.wandb_run_name``
(unset: ``job.description``); the run's files go under ``job.dump_folder`` (``wandb/``), its config
is the job's. W&B's own settings come from its environment as usual: ``WANDB_MODE=offline`` writes
the run to files only (``wandb sync`` uploads it later), ``WANDB_API_KEY``, ``WANDB_ENTITY`` …
``wandb`` is an optional dependency (``pip install 'torchtitan_lite[wandb]'``)."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from torchtitan_lite.callbacks.base import Callback
from torchtitan_lite.config.schema import JobConfig
from torchtitan_lite.errors import ConfigError

__all__ = ["WandbCallback", "check_wandb"]


def check_wandb(config: JobConfig) -> None:
    """With ``metrics.enable_wandb``: the package must be importable (one line, before any process group)."""
    if config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.enable_wandb: invalid value True; the wandb package is not installed "
                          "(pip install 'torchtitan_lite[wandb]', or pip install wandb)")


class WandbCallback(Callback):
    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.run: Any = None

    def on_train_start(self, trainer: Any) -> None:
        if trainer.rank != 0 or self.run is not None:
            return
        import wandb

        m, job = self.config.metrics, self.config.job  # (rank 0's metrics logger made the dump folder)
        self.run = wandb.init(project=m.wandb_project, name=m.wandb_run_name or job.description, dir=job.dump_folder,
                              config=self.config.to_dict())

    def on_metrics(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        values = {key: value for key, value in record.items()
                  if key not in ("step", "run_id", "time") and isinstance(value, (int, float))
                  and not isinstance(value, bool) and math.isfinite(value)}
        self.run.log(values, step=step)

    def close(self, trainer: Any) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()

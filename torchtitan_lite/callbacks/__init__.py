"""Callbacks: what runs around the training step, one file each (:class:`Callback`).

:func:`default_callbacks` gives the built-in ones in the order they run after a step: validation,
the metrics record (and the sinks that receive it, W&B among them), the checkpoint, garbage
collection, the profiler, the training timeout, preemption. Research code adds its own with
``trainer.callbacks.append(MyCallback())``.
"""

from __future__ import annotations

from torchtitan_lite.callbacks.base import Callback, StepState
from torchtitan_lite.callbacks.checkpointing import CheckpointCallback
from torchtitan_lite.callbacks.gc import GarbageCollectionCallback
from torchtitan_lite.callbacks.metrics import MetricsCallback
from torchtitan_lite.callbacks.preemption import PreemptionCallback
from torchtitan_lite.callbacks.profiler import ProfilerCallback
from torchtitan_lite.callbacks.timeouts import TrainTimeoutCallback
from torchtitan_lite.callbacks.validation import ValidationCallback
from torchtitan_lite.callbacks.wandb import WandbCallback, check_wandb
from torchtitan_lite.config.schema import JobConfig

__all__ = ["Callback", "CheckpointCallback", "GarbageCollectionCallback", "MetricsCallback", "PreemptionCallback",
           "ProfilerCallback", "StepState", "TrainTimeoutCallback", "ValidationCallback", "WandbCallback",
           "check_wandb", "default_callbacks"]


def default_callbacks(config: JobConfig) -> list[Callback]:
    """The job's built-in callbacks, in the order they run."""
    callbacks: list[Callback] = [ValidationCallback(config.validation.freq), MetricsCallback(config.metrics.log_freq)]
    if config.metrics.enable_wandb:
        callbacks.append(WandbCallback(config))
    callbacks += [CheckpointCallback(), GarbageCollectionCallback(config.training.gc_freq),
                  ProfilerCallback(config.profiling), TrainTimeoutCallback(config.comm.train_timeout_seconds),
                  PreemptionCallback(list(config.checkpoint.save_on_signals))]
    return callbacks

"""Stop on a signal at the end of a step (``checkpoint.save_on_signals``): what preemption needs.

Slurm, Kubernetes and spot instances send SIGTERM (or a configured signal) and wait a grace
period before SIGKILL. While :class:`StopSignals` is active, such a signal only records that it
came; the training loop asks :meth:`StopSignals.requested` after every step, which all-reduces
the flag so that every rank stops after the same step even when the signal reached only some of
them (or reached them during different steps). A second signal (the launcher repeating itself)
is counted and otherwise ignored, so it cannot tear the checkpoint being written.

Handlers can only be installed from the main thread; elsewhere (a trainer driven from another
thread) the signals keep their actions and a warning says so.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StopSignals"]

logger = logging.getLogger("torchtitan_lite")


class StopSignals:
    """Record the signals ``names`` (e.g. ``["SIGTERM", "SIGUSR1"]``) instead of acting on them,
    while active (a context manager)."""

    def __init__(self, names: list[str], *, device: torch.device) -> None:
        self.signals = [signal.Signals[name] for name in names]
        self.device = device
        self.received: signal.Signals | None = None
        self.repeats = 0
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if not self.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            logger.warning("checkpoint.save_on_signals: not installed (the trainer does not run in the main "
                           "thread); %s keep their default actions", ", ".join(s.name for s in self.signals))
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        else:
            self.repeats += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def requested(self) -> signal.Signals | None:
        """The signal that stops the job after this step, agreed by every rank (a MAX all-reduce
        of the signal's number: one tiny collective per step); None: go on."""
        if not self.signals:
            return None
        flag = torch.tensor([0 if self.received is None else int(self.received)], device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return None if value == 0 else signal.Signals(value)

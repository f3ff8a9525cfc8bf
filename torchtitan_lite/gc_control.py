"""Python's garbage collector while training: automatic collection off, collections at chosen steps.

A collection landing in the middle of a step makes step times jitter and, across ranks, stalls
every rank waiting for the slowest; it also frees whatever reference cycles hold at that moment,
so two ranks running the same step could report different memory peaks. The trainer, the memory
measurement and the estimator all run with automatic collection off through :class:`GarbageCollection`.
"""

from __future__ import annotations

import gc
from types import TracebackType

__all__ = ["GarbageCollection", "no_automatic_gc"]


class GarbageCollection:
    """Collect once (generation ``generation``), then keep automatic collection off until
    :meth:`close` (or the end of a ``with`` block) restores the interpreter's setting: the
    trainer may be one part of a longer program. :meth:`run` collects the young generations
    every ``gc_freq`` steps."""

    def __init__(self, gc_freq: int | None = None, *, generation: int = 1) -> None:
        self.gc_freq = gc_freq
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(generation)

    def run(self, step: int) -> None:
        """Collect the young generations when ``step`` is a multiple of ``gc_freq``."""
        if self.gc_freq and step % self.gc_freq == 0:
            gc.collect(1)

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()

    def __enter__(self) -> GarbageCollection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def no_automatic_gc() -> GarbageCollection:
    """``with no_automatic_gc():`` a full collection, then no automatic one inside the block."""
    return GarbageCollection(generation=2)

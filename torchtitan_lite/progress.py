"""Progress lines for long work: quiet when the work is short, a line within a few seconds and
then at intervals when it is not, so that a long plan, load or export never looks hung.

    with Progress("planning memory for llama3 8B") as progress:
        for i, mode in enumerate(modes):
            progress.update(f"estimate {i + 1} of {len(modes)}: reshard {mode}")
            ...

logs (``torchtitan_lite`` logger, INFO) ``planning memory for llama3 8B: estimate 2 of 4:
reshard never (5 s so far)`` after ``first_s`` seconds, again every ``every_s`` seconds, and
``planning memory for llama3 8B: done in 41.2 s`` at the end when anything was logged. A
progress entered inside another (in the same thread) reports through the outer one: its label
becomes the outer one's detail while it lasts.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType

__all__ = ["Progress", "log_to_stderr"]

logger = logging.getLogger("torchtitan_lite")
_ACTIVE = threading.local()  # this thread's progress reports, outermost first


class Progress:
    """A context manager that reports ``label`` (and the step set by :meth:`update`) from a
    daemon thread while the work inside it lasts longer than ``first_s``."""

    def __init__(self, label: str, *, first_s: float = 3.0, every_s: float = 15.0,
                 log: logging.Logger | None = None) -> None:
        self.label, self.first_s, self.every_s = label, first_s, every_s
        self.log = log or logger
        self.detail = ""
        self.reported = False
        self._started = 0.0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._outer: tuple[Progress, str] | None = None

    def update(self, detail: str) -> None:
        """What the work is doing now (shown in the next line)."""
        if self._outer is not None:
            self._outer[0].update(f"{self.label}: {detail}")
        self.detail = detail

    def __enter__(self) -> Progress:
        self._started = time.perf_counter()
        active = _ACTIVE.__dict__.setdefault("stack", [])
        if active:  # nested: the outer one reports
            outer = active[-1]
            self._outer = (outer, outer.detail)
            outer.update(self.label)
            active.append(self)
            return self
        active.append(self)
        self._thread = threading.Thread(target=self._report, name="torchtitan_lite-progress", daemon=True)
        self._thread.start()
        return self

    def _report(self) -> None:
        wait = self.first_s
        while not self._done.wait(wait):
            elapsed = time.perf_counter() - self._started
            detail = f": {self.detail}" if self.detail else ""
            self.log.info("%s%s (%.0f s so far)", self.label, detail, elapsed)
            self.reported = True
            wait = self.every_s

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _ACTIVE.stack.remove(self)
        if self._outer is not None:
            outer, detail = self._outer
            outer.update(detail)
            return
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.reported and kind is None:
            self.log.info("%s: done in %.1f s", self.label, time.perf_counter() - self._started)


def log_to_stderr() -> None:
    """The package's INFO lines (progress of long work) on stderr, for command-line tools,
    unless a caller (a trainer, a research script) has set up handlers of its own."""
    log = logging.getLogger("torchtitan_lite")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)

"""Progress lines of long work (:mod:`torchtitan_lite.progress`): none for short work; for long
work a line naming what it does now, then one when it is done; a nested report speaks through
the outer one."""

from __future__ import annotations

import logging
import threading

from torchtitan_lite.progress import Progress


class _Lines(logging.Handler):
    def __init__(self, wanted: str) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.wanted, self.seen = wanted, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if self.wanted in record.getMessage():
            self.seen.set()


def _reported(wanted: str, work) -> list[str]:
    log = logging.getLogger("test_progress")
    log.setLevel(logging.INFO)
    handler = _Lines(wanted)
    log.addHandler(handler)
    try:
        work(log, handler.seen)
    finally:
        log.removeHandler(handler)
    return handler.lines


def test_short_work_says_nothing() -> None:
    def work(log: logging.Logger, seen: threading.Event) -> None:
        with Progress("loading", first_s=60, log=log) as progress:
            progress.update("file 1 of 2")

    assert _reported("loading", work) == []


def test_long_work_says_what_it_does_while_it_runs_and_when_it_is_done() -> None:
    def work(log: logging.Logger, seen: threading.Event) -> None:
        with Progress("loading the weights", first_s=0.01, every_s=60, log=log) as progress:
            progress.update("file 2 of 3")
            assert seen.wait(60), "no progress line while the work ran"

    lines = _reported("file 2 of 3", work)
    assert lines[0].startswith("loading the weights: file 2 of 3 (") and lines[0].endswith(" s so far)"), lines
    assert lines[-1].startswith("loading the weights: done in "), lines


def test_a_nested_report_speaks_through_the_outer_one() -> None:
    def work(log: logging.Logger, seen: threading.Event) -> None:
        with Progress("planning", first_s=0.01, every_s=0.01, log=log):
            with Progress("auto", log=log) as inner:
                inner.update("estimate 3")
                assert seen.wait(60), "the outer report did not show the inner one"

    lines = _reported("planning: auto: estimate 3", work)
    assert not [line for line in lines if line.startswith("auto")], lines
    assert lines[-1].startswith("planning: done in "), lines

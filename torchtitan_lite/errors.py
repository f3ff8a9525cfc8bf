"""User errors: the mistakes a user can fix, each reported as one line and a documented exit code.

Every error a user can act on (a bad config value, an unreadable dataset, a checkpoint that does
not fit) is a :class:`UserError`; ``python -m torchtitan_lite.train`` prints it as one line
``error: ...`` and exits with its class's code. Anything else is a bug or a fault of the machine
and keeps its traceback.

========================  =====  ===========================================================
class                     exit   meaning
========================  =====  ===========================================================
:class:`ConfigError`      2      a config value, option or combination is not allowed
:class:`DataError`        3      a dataset or tokenizer file is missing, empty or unreadable
:class:`CheckpointError`  4      a checkpoint is missing, incomplete, or made for another model,
                                 or saving one failed
:class:`TrainingError`    5      training cannot go on: the loss or gradient norm is not
                                 finite (``training.on_nonfinite``)
:class:`UserCodeError`    6      code the job calls by its dotted path (a reward function)
                                 raised, or returned what it may not; the line names its file
                                 and line
(stopped on a signal)      75     not an error: a signal in ``checkpoint.save_on_signals``
                                 (preemption) stopped the job after one checkpoint was saved;
                                 run the job again to resume (``PREEMPTED_EXIT_CODE``; 75 is
                                 ``EX_TEMPFAIL``, "try again later")
(launcher gone)           76     the torchrun agent that started this worker died; the worker
                                 ended itself at once (``distributed.process_group.
                                 LAUNCHER_GONE_EXIT_CODE``)
========================  =====  ===========================================================

This module imports nothing else of the package: every layer may raise these.
"""

from __future__ import annotations

__all__ = ["PREEMPTED_EXIT_CODE", "CheckpointError", "ConfigError", "DataError", "DataNotHereError", "Problems",
           "TrainingError", "UserCodeError", "UserError"]

PREEMPTED_EXIT_CODE = 75
"""Exit code of a job stopped by a signal of ``checkpoint.save_on_signals`` after its checkpoint
was saved: a launcher script requeues the job on it."""


class UserError(ValueError):
    """An error the user can fix: its message is one line naming the key or file, the bad value
    and what is allowed. ``exit_code`` is the process's exit status when it ends a job."""

    exit_code = 1


class ConfigError(UserError):
    """A configuration value, option or combination that is not allowed."""

    exit_code = 2


class DataNotHereError(ConfigError):
    """A dataset named by where it is published (a Hugging Face Hub name) with no local copy set:
    training cannot start, but a planner that reads no data plans the job all the same."""


class DataError(UserError):
    """A dataset or tokenizer that cannot be used: missing, empty, unreadable or out of range."""

    exit_code = 3


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, incomplete, made for another model) or saved."""

    exit_code = 4


class TrainingError(UserError):
    """Training stopped because it diverged: a non-finite loss or gradient norm (no update was
    applied and no checkpoint written from it)."""

    exit_code = 5


class UserCodeError(UserError):
    """Code of the user's that the job calls (a reward function named by its dotted path) raised,
    or returned what it may not: the line names the function, the exception and where it was
    raised (file and line)."""

    exit_code = 6


class Problems:
    """Checks that do not build on each other, collected: every broken one is a line, and
    :meth:`raise_all` raises them together as one :class:`ConfigError` (a config's mistakes are
    reported at once)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def require(self, ok: bool, key: str, value: object, allowed: str) -> bool:
        """Record ``key: invalid value …; allowed`` unless ``ok``; returns ``ok``."""
        if not ok:
            self.lines.append(f"{key}: invalid value {value!r}; {allowed}")
        return ok

    def add(self, error: UserError) -> None:
        """Every line of an error raised by a check of its own."""
        self.lines += str(error).splitlines()

    def raise_all(self) -> None:
        if self.lines:
            raise ConfigError("\n".join(self.lines))

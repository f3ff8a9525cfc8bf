"""One job per dump folder and per checkpoint folder: exclusive locks held for the job's life.

Global rank 0 takes an ``flock`` on ``<dump_folder>/.lock`` and writes who holds it (host,
process id, start time); the operating system releases the lock when the process ends, however
it ends, so a crashed job never leaves a stale lock. A second job into the same folder is
refused with one line naming the holder, before it trains or writes anything. The lock is
advisory and local to what ``flock`` covers: processes on one machine, or a shared file system
that implements it (NFSv4, Lustre with ``flock`` mounts).

A checkpointing job's checkpoint folder (``<dump_folder>/<checkpoint.folder>``; an absolute
``checkpoint.folder`` is a folder of its own) is locked the same way, with a ``.lock`` file in
it, when it lies outside the dump folder: two jobs with different dump folders and one absolute
``checkpoint.folder`` would otherwise both write ``step-<N>`` into it. A checkpoint folder inside
the dump folder is covered by the dump folder's lock (no file is added among the step folders);
a second job naming that folder by an absolute path is not refused (it locks only the folder
itself).

A torchrun worker whose launcher died ends itself within ``LAUNCHER_GONE_BOUND_S``
(:mod:`torchtitan_lite.run.launcher_watch`), and the operating system then releases its lock. A job
relaunched at once may find the lock still held by such a worker: the holder records its
launcher, and a holder on this machine that has lost it (its parent is another process now) is
waited for, at most ``LAUNCHER_GONE_BOUND_S``, before the job is refused.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from torchtitan_lite.errors import ConfigError
from torchtitan_lite.run.launcher_watch import LAUNCHER_GONE_BOUND_S, launcher_pid, orphaned

__all__ = ["LOCK_FILE", "DumpFolderLock"]

LOCK_FILE = ".lock"
_RETRY_S = 0.02  # how often a lock held by a dying worker is tried again

logger = logging.getLogger("torchtitan_lite")


class DumpFolderLock:
    """The locks of one job: its dump folder's and, given ``checkpoint_folder`` (relative to
    ``folder``, as ``checkpoint.folder`` is; an absolute path stands alone), its checkpoint
    folder's where that lies outside ``folder``. :meth:`acquire` once, :meth:`release` (or
    process exit) to let the next job in."""

    def __init__(self, folder: str | Path, *, checkpoint_folder: str | Path | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        # (key, folder as shown, lock file): the dump folder first.
        self._locks: list[tuple[str, Path, Path]] = [("job.dump_folder", self.folder, self.path)]
        if checkpoint_folder is not None:
            resolved = (self.folder / checkpoint_folder).resolve()
            if not resolved.is_relative_to(self.folder.resolve()):
                self._locks.append(("checkpoint.folder", resolved, resolved / LOCK_FILE))
        self._files: list[IO[str]] = []

    @property
    def lock_files(self) -> list[Path]:
        """The lock files :meth:`acquire` takes: the dump folder's, then the checkpoint folder's
        where it has one of its own."""
        return [path for _, _, path in self._locks]

    def acquire(self) -> None:
        """Take every lock, or raise :class:`ConfigError` naming the key, the folder and the job
        that holds it (then none is held)."""
        try:
            for key, folder, path in self._locks:
                self._files.append(_lock(key, folder, path, dump_folder=self.folder))
        except ConfigError:
            self.release()
            raise

    def release(self) -> None:
        """Let the next job in (the lock files stay; only the locks on them are dropped)."""
        while self._files:
            handle = self._files.pop()
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            handle.close()


def _lock(key: str, folder: Path, path: Path, *, dump_folder: Path) -> IO[str]:
    """The open, ``flock``-ed lock file ``path`` (its holder recorded in it), or
    :class:`ConfigError` naming ``key``, ``folder`` and the holder. The file of a job that holds
    it is only read."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+", encoding="utf-8")
    since: float | None = None  # since when the lock was waited for, and for which holder
    waited_for: dict[str, Any] = {}
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            pass
        handle.seek(0)
        info = _holder(handle.read())
        if since is None and _dying(info):  # a worker whose launcher died: it ends within the bound
            since, waited_for = time.monotonic(), info
        if since is None or time.monotonic() - since > LAUNCHER_GONE_BOUND_S or info != waited_for:
            handle.close()
            try:
                who = f"pid {info['pid']} on {info['host']}, started {info['started']}"
            except (KeyError, TypeError):
                who = "a job that has not recorded itself yet"
            raise ConfigError(f"{key}: invalid value {str(folder)!r}; another job is using it "
                              f"({who}; lock {str(path)!r}); wait for it to end or use another "
                              f"{key}") from None
        time.sleep(_RETRY_S)
    if since is not None:  # (rank 0's log)
        logger.info("%s: waited %.2f s for pid %s, a worker whose launcher is gone, to release %s", key,
                    time.monotonic() - since, waited_for["pid"], path)
    handle.seek(0)
    handle.truncate()
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "dump_folder": str(dump_folder.absolute())}
    if launcher_pid() is not None:
        record["launcher"] = launcher_pid()
    handle.write(json.dumps(record) + "\n")
    handle.flush()
    return handle


def _holder(text: str) -> dict[str, Any]:
    """What the lock's holder recorded ({} before it has)."""
    try:
        info = json.loads(text.strip())
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _dying(info: dict[str, Any]) -> bool:
    """The holder is a worker of this machine whose launcher is gone: it is ending itself."""
    pid, launcher = info.get("pid"), info.get("launcher")
    return (info.get("host") == socket.gethostname() and isinstance(pid, int) and isinstance(launcher, int)
            and orphaned(pid, launcher))

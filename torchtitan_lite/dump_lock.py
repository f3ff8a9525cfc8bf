"""One job per dump folder: an exclusive lock held for the job's life.

Global rank 0 takes an ``flock`` on ``<dump_folder>/.lock`` and writes who holds it (host,
process id, start time); the operating system releases the lock when the process ends, however
it ends, so a crashed job never leaves a stale lock. A second job into the same folder is
refused with one line naming the holder, before it trains or writes anything. The lock is
advisory and local to what ``flock`` covers: processes on one machine, or a shared file system
that implements it (NFSv4, Lustre with ``flock`` mounts).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO

from torchtitan_lite.errors import ConfigError

__all__ = ["LOCK_FILE", "DumpFolderLock"]

LOCK_FILE = ".lock"


class DumpFolderLock:
    """The lock of one dump folder; :meth:`acquire` once, :meth:`release` (or process exit) to
    let the next job in."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigError` naming the job that holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            try:
                info = json.loads(holder)
                who = f"pid {info['pid']} on {info['host']}, started {info['started']}"
            except (ValueError, KeyError, TypeError):
                who = "a job that has not recorded itself yet"
            raise ConfigError(f"job.dump_folder: invalid value {str(self.folder)!r}; another job is using it "
                              f"({who}; lock {str(self.path)!r}); wait for it to end or use another "
                              "job.dump_folder") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "started": datetime.datetime.now().isoformat(timespec="seconds")}) + "\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        """Let the next job in (the lock file stays; only the lock on it is dropped)."""
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
